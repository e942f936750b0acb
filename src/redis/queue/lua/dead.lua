-- KEYS: lease, owner, tasks, dead, expired. ARGV: id, owner, record. Moves a task to the
-- dead-letter HASH, if the owner still matches. Returns 1, or 2 if the dead-letter HASH
-- already holds this record (an earlier send ran and its reply was lost), else 0.

if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  if redis.call('HGET', KEYS[4], ARGV[1]) == ARGV[3] then return 2 end
  return 0
end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
