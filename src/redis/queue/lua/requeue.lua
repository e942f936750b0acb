-- KEYS: dead, tasks, due, lease. ARGV: id, envelope, due (ms), channel, the dead record as
-- read, wake-up suffix (`:shard`, or empty).
-- Moves a dead-lettered task back to the queue with a fresh envelope and wakes the consumers.
-- Returns 0 if the dead-letter HASH no longer holds that record for the id (gone, or
-- dead-lettered again since it was read), -1 (and changes nothing) if a task with that id is
-- pending again (an envelope, and queued or leased; an envelope alone is written over).

if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[5] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 and (redis.call('ZSCORE', KEYS[3], ARGV[1]) or redis.call('ZSCORE', KEYS[4], ARGV[1])) then return -1 end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.pcall('PUBLISH', ARGV[4], ARGV[3] .. ARGV[6])
return 1
