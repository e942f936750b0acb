-- KEYS: due, tasks. ARGV: the ids a batch wrote. When one of the keys holds the wrong type
-- (the batch's MULTI failed on it), removes the ids from the other, which took them, so no
-- half of the batch stays. Returns the two keys' types.

local due = redis.call('TYPE', KEYS[1])['ok']
local tasks = redis.call('TYPE', KEYS[2])['ok']
local due_ok = due == 'zset' or due == 'none'
local tasks_ok = tasks == 'hash' or tasks == 'none'
for i = 1, #ARGV, 1000 do
  local j = math.min(i + 999, #ARGV)
  if due_ok and not tasks_ok then redis.call('ZREM', KEYS[1], unpack(ARGV, i, j)) end
  if tasks_ok and not due_ok then redis.call('HDEL', KEYS[2], unpack(ARGV, i, j)) end
end
return {due, tasks}
