-- KEYS: due, tasks, lease, owner, expired. ARGV: id. Returns 1 if the task was queued or
-- leased.

local n = redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return n
