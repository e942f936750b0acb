-- KEYS: due, tasks. ARGV: count, then (to continue a scan) the score and the member of the
-- last row read. Reply: `{run_id, {member, score, ...}, {envelope, ...}}`: the server's
-- `run_id`, up to `count` rows after that one in the ZSET's order (score, then member bytes),
-- and their envelopes (nil where the HASH has none). The rows and envelopes go back as Redis
-- made them (a copy into one flat table in Lua cost a third of a restore's time). Read-only.
--
-- A keyset page: the rows after (score, member), found by ZCOUNT (the rows due before that
-- score) and a binary search of the members due at that very score (compared as bytes, as
-- Redis orders them; Lua's `<` would follow the server's locale). Removed or added rows shift
-- nothing, and so a restarted server continues the scan where the last one stopped.

-- The server's identity: a new one after every restart, and on each node of a failover.
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''

local count = tonumber(ARGV[1])
local start = 0
if #ARGV >= 3 then
  local score, member = ARGV[2], ARGV[3]
  local function not_after(a, b)
    if a == b then return true end
    for i = 1, math.min(#a, #b) do
      local x, y = string.byte(a, i), string.byte(b, i)
      if x ~= y then return x < y end
    end
    return #a < #b
  end
  local lo = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. score)
  local hi = lo + redis.call('ZCOUNT', KEYS[1], score, score)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if not_after(redis.call('ZRANGE', KEYS[1], mid, mid)[1], member) then
      lo = mid + 1
    else
      hi = mid
    end
  end
  start = lo
end
local flat = redis.call('ZRANGE', KEYS[1], start, start + count - 1, 'WITHSCORES')
local ids = {}
for i = 1, #flat, 2 do ids[#ids + 1] = flat[i] end
if #ids <= 4000 then
  if #ids == 0 then return {run_id, flat, {}} end
  return {run_id, flat, redis.call('HMGET', KEYS[2], unpack(ids))}
end
local envelopes = {}
for i = 1, #ids, 4000 do
  local part = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 3999, #ids)))
  for k = 1, #part do envelopes[#envelopes + 1] = part[k] end
end
return {run_id, flat, envelopes}
