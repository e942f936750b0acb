-- KEYS: lease, owner, due. ARGV: channel, notify before (ms), wake-up suffix (`:shard`, or
-- empty), then id1, owner1, due1, ...
-- Hands claimed tasks not started here back to the queue at their due time (at a graceful
-- shutdown, or while the consumer's handler threads are all stuck), skipping any no longer
-- leased to the owner given, and wakes the other consumers for the earliest. Returns how many
-- were handed back.

local n, first = 0, nil
for i = 4, #ARGV, 3 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[3], ARGV[i + 2], ARGV[i])
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    local due = tonumber(ARGV[i + 2])
    if first == nil or due < first then first = due end
    n = n + 1
  end
end
if first ~= nil and first < tonumber(ARGV[2]) then
  redis.pcall('PUBLISH', ARGV[1], tostring(first) .. ARGV[3])
end
return n
