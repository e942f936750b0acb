-- KEYS: lease, owner, tasks, expired, dead. ARGV: id1, owner1, again1, id2, ... Removes each
-- task whose owner still matches; returns per task 1 (removed), 0 (refused: the lease was
-- taken over, or ran out and the task is queued again or dead-lettered), or, for an ack sent
-- again (`again` = 1) after a call that may have run, 2 if the task is gone, held by no one
-- and not dead-lettered: most likely that call ran and only its reply was lost. (Another
-- consumer's takeover and ack in between, or a producer's cancel, would read the same;
-- without such a call before, they read as 0.)

local out = {}
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    redis.call('HDEL', KEYS[4], ARGV[i])
    out[#out + 1] = 1
  elseif ARGV[i + 2] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 then
    out[#out + 1] = 2
  else
    out[#out + 1] = 0
  end
end
return out
