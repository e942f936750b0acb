-- KEYS: zset (`due` or `lease`), tasks, owner. ARGV: score, id (both '' from the start),
-- limit. Reads, changing nothing, up to `limit` members of `zset` after (score, id) in the
-- ZSET's own order (by score, then by id bytewise), each with its envelope and owner.
-- Returns `more, id1, score1, envelope1, owner1, id2, ...`: `more` is "1" if members may follow
-- the last one returned; absent envelopes and owners are ''.
--
-- Bounded: a cursor whose member is still in the ZSET continues from its rank (ZRANK). One
-- that is not (claimed or acked since, or on another shard of the queue, which shares the
-- cursor) continues from the first member of its score whose id sorts after its id, found by
-- a binary search over the ranks of that score's members (O(log^2 n)).

local limit = tonumber(ARGV[3])
local start = 0
local score, after = ARGV[1], ARGV[2]

-- Whether string `a` sorts after `b` byte by byte, as the ZSET orders equal scores.
local function later(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end

if after ~= '' then
  local rank = redis.call('ZRANK', KEYS[1], after)
  local at = rank and redis.call('ZSCORE', KEYS[1], after)
  if rank and tonumber(at) == tonumber(score) then
    start = rank + 1
  else
    -- The members of `score` hold ranks [lo, hi), in id order.
    local lo = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. score)
    local hi = redis.call('ZCOUNT', KEYS[1], '-inf', score)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if later(redis.call('ZRANGE', KEYS[1], mid, mid)[1], after) then
        hi = mid
      else
        lo = mid + 1
      end
    end
    start = lo
  end
end

local out = {'0'}
local found = 0
while found < limit do
  local chunk = redis.call('ZRANGE', KEYS[1], start, start + limit - found - 1, 'WITHSCORES')
  if #chunk == 0 then return out end
  for i = 1, #chunk, 2 do
    local id, sc = chunk[i], chunk[i + 1]
    start = start + 1
    found = found + 1
    local env = redis.call('HGET', KEYS[2], id)
    local owner = redis.call('HGET', KEYS[3], id)
    out[#out + 1] = id
    out[#out + 1] = sc
    out[#out + 1] = env or ''
    out[#out + 1] = owner or ''
  end
end
out[1] = '1'
return out
