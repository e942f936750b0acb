-- KEYS: lease, owner. ARGV: lease (ms), then id1, owner1, id2, owner2, ... Extends to
-- now + lease (`now`: Redis's clock) the lease of each task whose owner still matches (never
-- shortens one). Returns how many it extended.

-- `now`: Redis's clock in ms (the same two lines in every script that reads it; Redis 7
-- replicates a script's effects, so reading the clock is allowed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local to, n = now + tonumber(ARGV[1]), 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    local lease = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if lease and tonumber(lease) < to then
      redis.call('ZADD', KEYS[1], to, ARGV[i])
      n = n + 1
    end
  end
end
return n
