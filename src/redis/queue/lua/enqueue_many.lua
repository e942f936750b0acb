-- KEYS: due, tasks, lease, owner, expired (one shard's). ARGV: replace (0/1), channel, notify
-- before (ms; 0 = never), wake-up message suffix, then three per task: id, due, envelope.
-- Returns one 1 or 0 per task, in order: each task is stored as `enqueue.lua` stores it (0: its
-- id was pending and replace was not asked for). One wake-up is published for the whole call,
-- `<earliest due><suffix>`, if a task stored is due before `notify before`. A task's id given
-- twice in one call is stored once, then found pending (or replaced). A due that is not a
-- number fails the call with an error, and nothing written.

local replace = ARGV[1] == '1'
local notify_before = tonumber(ARGV[3])
local out = {}
local earliest, earliest_text = nil, nil
-- Written with one call per key (in chunks) after the loop, not three calls per task; an id
-- stored earlier in this call reads as pending, as it would task by task. `n` tasks stored:
-- `ids` holds them, `dues` and `envelopes` two entries each; `r` leased ones replaced: `taken`
-- holds them. The loop only reads: a call that fails in it (a due that is not a number) has
-- written nothing, and a replaced task's lease is cleared only after its new place is
-- written. (Appends keep their own counts: `#t` is a search in Lua 5.1.)
local dues, envelopes, ids, stored_here, n = {}, {}, {}, {}, 0
local taken, r = {}, 0
for i = 5, #ARGV, 3 do
  local id, due, envelope = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local d = tonumber(due)
  if d == nil or d ~= d then return redis.error_reply('due is not a number: ' .. due) end
  local pending
  if stored_here[id] then
    pending = true
  else
    local stored = redis.call('HEXISTS', KEYS[2], id) == 1
    pending = stored and (redis.call('ZSCORE', KEYS[1], id) or redis.call('ZSCORE', KEYS[3], id))
  end
  if pending and not replace then
    out[(i - 2) / 3] = 0
  else
    if pending and not stored_here[id] then
      r = r + 1
      taken[r] = id
    end
    stored_here[id] = true
    n = n + 1
    dues[2 * n - 1], dues[2 * n] = due, id
    envelopes[2 * n - 1], envelopes[2 * n] = id, envelope
    ids[n] = id
    out[(i - 2) / 3] = 1
    if earliest == nil or d < earliest then
      earliest, earliest_text = d, due
    end
  end
end
for i = 1, n, 500 do
  local j = math.min(i + 499, n)
  redis.call('ZADD', KEYS[1], unpack(dues, 2 * i - 1, 2 * j))
  redis.call('HSET', KEYS[2], unpack(envelopes, 2 * i - 1, 2 * j))
  redis.call('HDEL', KEYS[5], unpack(ids, i, j))
end
for i = 1, r, 500 do
  local j = math.min(i + 499, r)
  redis.call('ZREM', KEYS[3], unpack(taken, i, j))
  redis.call('HDEL', KEYS[4], unpack(taken, i, j))
end
if earliest ~= nil and earliest < notify_before then
  redis.pcall('PUBLISH', ARGV[2], earliest_text .. ARGV[4])
end
return out
