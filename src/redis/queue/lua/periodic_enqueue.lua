-- KEYS: due, tasks, lease, owner, expired, marker. ARGV: id, due, envelope, marker ttl (ms),
-- channel, notify before (ms; 0 = never), message. Enqueues one occurrence of a periodic task
-- at most once, however many schedulers try: the first call sets the occurrence's marker
-- (SET NX, expiring after `marker ttl`) and stores the task as `enqueue.lua` does (not over a
-- pending one); every later call finds the marker and changes nothing. Returns 1 if stored,
-- 0 if not.

if not redis.call('SET', KEYS[6], '1', 'NX', 'PX', ARGV[4]) then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
  and (redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZSCORE', KEYS[3], ARGV[1])) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[5], ARGV[1])
if tonumber(ARGV[2]) < tonumber(ARGV[6]) then
  redis.pcall('PUBLISH', ARGV[5], ARGV[7])
end
return 1
