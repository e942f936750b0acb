-- KEYS: lease, owner, tasks, due. ARGV: id, owner, new envelope, next due (ms), channel,
-- notify before (ms), wake-up suffix (`:shard`, or empty). Puts a failed task back in the
-- queue for its next attempt, if the owner still matches, and wakes the consumers if it is
-- due soon. Returns 1, or 2 if the task already holds the new envelope (an earlier send of
-- this retry ran and its reply was lost), else 0 (refused: the lease was taken over).

if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[3] then return 2 end
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if tonumber(ARGV[4]) < tonumber(ARGV[6]) then redis.pcall('PUBLISH', ARGV[5], ARGV[4] .. ARGV[7]) end
return 1
