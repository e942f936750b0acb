-- KEYS: running (ZSET: slot name → lease deadline, ms on Redis's clock). ARGV: lease (ms),
-- then slot names.
-- Extends to now + lease the lease of each slot still held; one whose lease ran out (and was
-- dropped by a SLOTS_TAKE) is not taken again.
-- Reply: the names no longer held.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline, lost = now + tonumber(ARGV[1]), {}
for i = 2, #ARGV do
  local lease = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if lease and tonumber(lease) > now then
    redis.call('ZADD', KEYS[1], deadline, ARGV[i])
  else
    redis.call('ZREM', KEYS[1], ARGV[i])
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
