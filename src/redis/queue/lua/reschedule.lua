-- KEYS: due, tasks. ARGV: id, due (ms), channel, notify before (ms; 0 = never), message.
-- Moves a queued task (not claimed) to `due`, keeping its envelope, whose trailing `due_at`
-- is rewritten to match (an envelope written otherwise keeps its text: the score decides).
-- Publishes `message` if `due` is before `notify before`. Returns 1 if moved, 0 if the id
-- is not queued (unknown, claimed, or dead-lettered).

if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[1])
local envelope = redis.call('HGET', KEYS[2], ARGV[1])
if envelope then
  local head, n = string.gsub(envelope, '\34due_at\34:%d+}$', '\34due_at\34:' .. ARGV[2] .. '}')
  if n == 1 then redis.call('HSET', KEYS[2], ARGV[1], head) end
end
if tonumber(ARGV[2]) < tonumber(ARGV[4]) then
  redis.pcall('PUBLISH', ARGV[3], ARGV[5])
end
return 1
