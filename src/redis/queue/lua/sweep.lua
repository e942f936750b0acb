-- KEYS: tasks, due, lease, dead, unpaired, expired. ARGV: tasks cursor, unpaired cursor,
-- count, grace (ms). One step of the reaper's sweep for envelopes with no queue entry, which
-- another client's task written envelope first has until its second write lands, and one
-- whose second write never came has for good. An HSCAN step of `count` (a hint) over
-- `tasks`: an envelope whose id is neither queued nor leased nor dead-lettered is noted in
-- `unpaired` when first seen so, and removed (with its lease expiry count) when seen so
-- again `grace` ms or more later (Redis's clock); one whole again is struck from `unpaired`
-- (an empty envelope counts as none, as for CLAIM). Then an HSCAN step over `unpaired`,
-- striking out ids now whole or gone (neither queued, leased nor stored). Returns `{next tasks cursor, next unpaired cursor, envelopes removed, bad key}`:
-- the bad key is `unpaired` when it has the wrong type (nothing is done then), else `''`.

local known = redis.pcall('HLEN', KEYS[5])
if type(known) ~= 'number' then
  if not string.find(known.err, 'WRONGTYPE', 1, true) then return known end
  return {ARGV[1], ARGV[2], 0, KEYS[5]}
end
-- `now`: Redis's clock in ms (the same two lines in every script that reads it; Redis 7
-- replicates a script's effects, so reading the clock is allowed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace, removed = tonumber(ARGV[4]), 0
local step = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[3])
local fields = step[2]
for i = 1, #fields, 2 do
  local id = fields[i]
  local placed = redis.call('ZSCORE', KEYS[2], id) or redis.call('ZSCORE', KEYS[3], id) or redis.call('HEXISTS', KEYS[4], id) == 1
  if placed then
    -- Whole; or queued with an empty envelope, which is the claim's to judge, as none.
    if known > 0 and fields[i + 1] ~= '' then redis.call('HDEL', KEYS[5], id) end
  else
    local seen = tonumber(redis.call('HGET', KEYS[5], id))
    if seen and seen > now then seen = nil end
    if seen == nil and grace > 0 then
      redis.call('HSET', KEYS[5], id, now)
    elseif now - (seen or now) >= grace then
      redis.call('HDEL', KEYS[1], id)
      redis.call('HDEL', KEYS[6], id)
      redis.call('HDEL', KEYS[5], id)
      removed = removed + 1
    end
  end
end
local next_unpaired = '0'
if known > 0 then
  local noted = redis.call('HSCAN', KEYS[5], ARGV[2], 'COUNT', ARGV[3])
  next_unpaired = noted[1]
  for i = 1, #noted[2], 2 do
    local id = noted[2][i]
    local queued = redis.call('ZSCORE', KEYS[2], id) or redis.call('ZSCORE', KEYS[3], id)
    local envelope = redis.call('HGET', KEYS[1], id)
    local whole = envelope and envelope ~= '' and (queued or redis.call('HEXISTS', KEYS[4], id) == 1)
    if whole or not (queued or envelope) then redis.call('HDEL', KEYS[5], id) end
  end
end
return {step[1], next_unpaired, removed, ''}
