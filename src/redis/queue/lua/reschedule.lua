-- KEYS: due, tasks, lease, owner, expired, dead. ARGV: id, due (ms), channel, notify before
-- (ms; 0 = never), message. Moves task `id` to `due`, keeping its envelope, whose trailing
-- `due_at` is rewritten to match (an envelope written otherwise keeps its text: the score
-- decides). Returns the state it found:
--   'queued': moved (ZADD XX);
--   'leased': claimed, so taken back as `enqueue` with `replace` takes a claimed task: queued
--             at `due`, its lease and owner removed (its consumer may still fire it; its ack
--             is refused) and its lease-expiry count forgotten;
--   'dead':   dead-lettered, left as it is (`requeue` brings it back);
--   'none':   unknown, left as it is.
-- Publishes `message` for a task moved before `notify before`.

local id = ARGV[1]
local state
if redis.call('ZSCORE', KEYS[1], id) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id)
  state = 'queued'
elseif redis.call('ZSCORE', KEYS[3], id) and redis.call('HEXISTS', KEYS[2], id) == 1 then
  -- Queued first, then the lease cleared: never in neither place.
  redis.call('ZADD', KEYS[1], ARGV[2], id)
  redis.call('ZREM', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('HDEL', KEYS[5], id)
  state = 'leased'
elseif redis.call('HEXISTS', KEYS[6], id) == 1 then
  return 'dead'
else
  return 'none'
end
local envelope = redis.call('HGET', KEYS[2], id)
if envelope then
  local moved, n = string.gsub(envelope, '\34due_at\34:%d+}$', '\34due_at\34:' .. ARGV[2] .. '}')
  if n == 1 then redis.call('HSET', KEYS[2], id, moved) end
end
if tonumber(ARGV[2]) < tonumber(ARGV[4]) then
  redis.pcall('PUBLISH', ARGV[3], ARGV[5])
end
return state
