-- KEYS: the engine lease, its record of takes. ARGV: holder, ttl (ms), `1` if the holder
-- never held the lease. Renews the lease (PEXPIRE, which a Redis at `maxmemory` still runs)
-- if the holder has it. Takes it if it is free and either the holder never held it or the
-- last engine to take it was the holder (nobody else may have written since); the record
-- (`<count> <holder>`) then names the holder. A free lease with no record at all, asked for
-- by a holder that held it before, means Redis lost the namespace (restarted empty, a flush):
-- taken, and answered `reset`. Answers `{'held', run_id}`, `{'reset', run_id}` or
-- `{'other', name, run_id}`, with the server's `run_id`.

-- The server's identity: a new one after every restart, and on each node of a failover.
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''

local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'held', run_id}
end
if held then return {'other', held, run_id} end
local record = redis.call('GET', KEYS[2])
local count, taker = string.match(record or '', '^(%d+) (.*)$')
if ARGV[3] ~= '1' and record and taker ~= ARGV[1] then
  return {'other', taker or 'an engine whose take is not on record', run_id}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], tostring((tonumber(count) or 0) + 1) .. ' ' .. ARGV[1])
if ARGV[3] ~= '1' and not record then return {'reset', run_id} end
return {'held', run_id}
