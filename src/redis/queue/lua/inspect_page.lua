-- KEYS: zset (`due` or `lease`), tasks, owner. ARGV: score, id (both '' from the start),
-- limit. Reads, changing nothing, up to `limit` members of `zset` after (score, id) in the
-- ZSET's own order (by score, then by id bytewise), each with its envelope and owner.
-- Returns `more, id1, score1, envelope1, owner1, id2, ...`: `more` is "1" if members may follow
-- the last one returned; absent envelopes and owners are ''.
--
-- Bounded: a cursor whose member is still in the ZSET continues from its rank (ZRANK). One
-- that has gone (claimed, acked) continues from the first member of its score, stepping over
-- those at that score not after its id; past 10 000 such steps it goes on from the next score.

local limit = tonumber(ARGV[3])
local start = 0
local score, after = ARGV[1], ARGV[2]
local skip = false
if after ~= '' then
  local rank = redis.call('ZRANK', KEYS[1], after)
  local at = rank and redis.call('ZSCORE', KEYS[1], after)
  if rank and tonumber(at) == tonumber(score) then
    start = rank + 1
  else
    start = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. score)
    skip = true
  end
end

-- Whether string `a` sorts after `b` byte by byte, as the ZSET orders equal scores.
local function later(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end

local out = {'0'}
local found, stepped = 0, 0
local s = tonumber(score)
while found < limit do
  local chunk = redis.call('ZRANGE', KEYS[1], start, start + limit - 1, 'WITHSCORES')
  if #chunk == 0 then return out end
  for i = 1, #chunk, 2 do
    local id, sc = chunk[i], chunk[i + 1]
    start = start + 1
    if skip and tonumber(sc) == s and not later(id, after) then
      stepped = stepped + 1
      if stepped >= 10000 then
        start = redis.call('ZCOUNT', KEYS[1], '-inf', score)
        skip = false
        break
      end
    else
      skip = false
      found = found + 1
      local env = redis.call('HGET', KEYS[2], id)
      local owner = redis.call('HGET', KEYS[3], id)
      out[#out + 1] = id
      out[#out + 1] = sc
      out[#out + 1] = env or ''
      out[#out + 1] = owner or ''
      if found == limit then break end
    end
  end
end
out[1] = '1'
return out
