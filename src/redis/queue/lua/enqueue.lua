-- KEYS: due, tasks, lease, owner, expired, and optionally the id's unique-window marker.
-- ARGV: id, due, envelope, replace (0/1), channel, notify before (ms; 0 = never), message.
-- Returns 1 if stored, 0 if the id was pending (an envelope, and the id queued or leased) and
-- replace was not asked for, 2 if the marker exists (the id was acknowledged within its
-- unique window; nothing is stored). An envelope with no
-- queue entry (another client's task half written, or left behind) is written over. A task
-- stored starts with no lease expiries (a count left by an older consumer that did not clear
-- it, or by a replaced task, is forgotten). The text is public for producers in other
-- languages (`Producer::ENQUEUE_SCRIPT`).

if KEYS[6] and redis.call('EXISTS', KEYS[6]) == 1 then return 2 end
local stored = redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
local pending = stored and (redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZSCORE', KEYS[3], ARGV[1]))
if pending and ARGV[4] == '0' then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if pending then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
redis.call('HDEL', KEYS[5], ARGV[1])
if tonumber(ARGV[2]) < tonumber(ARGV[6]) then
  redis.pcall('PUBLISH', ARGV[5], ARGV[7])
end
return 1
