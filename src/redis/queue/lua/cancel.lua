-- KEYS: due, tasks, lease, owner, expired. ARGV: id. Removes the task wherever it is and
-- returns 1 if it was queued or leased, else 0 (an envelope alone, half written by another
-- client or left behind, is removed too, but was no task).

redis.call('HDEL', KEYS[2], ARGV[1])
-- (Both, for a task another client left half moved.)
local n = math.min(redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1]), 1)
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return n
