-- KEYS: due, tasks, lease, owner, fence, dead, batch, expired, unpaired, paused. ARGV: until
-- (ms), batch, consumer, lease (ms), nonce, grace (ms). Leases up to `batch` tasks due by
-- `until` to `consumer|token` until max(due, now) + lease (`now`: Redis's clock), and returns
-- `token, id1, due1, envelope1, id2, ...`, or an empty array; or `paused` alone, leasing
-- nothing, while the `paused` key exists (a claim retried by nonce is still answered: its
-- tasks were leased before).
--
-- An id with no envelope (or an empty one; only another client writes such) is never leased:
-- leased, it would wait for the consumer's dead-lettering, and an `enqueue` of the id in
-- between would be dead-lettered with it. It may be half written (queued first, its envelope
-- on the way), so it stays queued until `grace` ms have passed since a claim first saw it so
-- (kept in `unpaired`), then goes to the dead-letter HASH. It comes back as `id, "wait", ""`
-- the first time it is seen, `id, "dead", ""` when dead-lettered, `id, "wrongtype", key`
-- when `key` (the dead-letter HASH, or `unpaired`) has the wrong type: the id then stays
-- queued, and the other tasks are claimed all the same. Ids seen before and still in their
-- grace period are not answered, and do not take a task's place: the claim reads as many
-- more ids as `unpaired` holds, up to `batch` more. A claim's reply holds at most `batch`
-- leased tasks.
--
-- Idempotent by nonce: the claim is kept in the consumer's `batch` list (`nonce, token, id1,
-- due1, ...`, expiring when the last of its leases ends), and a call with the nonce kept
-- there claims nothing new: it answers that claim again, with the tasks still leased under
-- its token. A consumer whose claim's reply was lost after the script ran calls again with
-- the same nonce and gets its batch, instead of leaving it leased to nobody until the lease
-- ends.

-- Appends keep their own counts: `#t` is a search in Lua 5.1, which cost twice the append
-- itself (400 000 appends to fresh tables: 30 ms through `#t + 1`, 10 ms through a count).
if redis.call('LINDEX', KEYS[7], 0) == ARGV[5] then
  local kept = redis.call('LRANGE', KEYS[7], 1, -1)
  local owner = ARGV[3] .. '|' .. kept[1]
  local out, n = {kept[1]}, 1
  for i = 2, #kept, 2 do
    local id = kept[i]
    if redis.call('HGET', KEYS[4], id) == owner then
      local envelope = redis.call('HGET', KEYS[2], id)
      if envelope then
        out[n + 1], out[n + 2], out[n + 3] = id, kept[i + 1], envelope
        n = n + 3
      end
    end
  end
  return out
end
if redis.call('EXISTS', KEYS[10]) == 1 then return {'paused'} end
local limit, grace = tonumber(ARGV[2]), tonumber(ARGV[6])
-- How many ids wait for their envelope: as many more are read, so that they take no task's
-- place. A wrong-typed `unpaired` is reported with each id that needs it.
local known = redis.pcall('HLEN', KEYS[9])
local tracked = type(known) == 'number'
if not tracked then
  if not string.find(known.err, 'WRONGTYPE', 1, true) then return known end
  known = 0
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, limit + math.min(known, limit))
if #ids == 0 then return {} end
local token = tostring(redis.call('INCR', KEYS[5]))
local owner = ARGV[3] .. '|' .. token
-- `now`: Redis's clock in ms (the same two lines in every script that reads it; Redis 7
-- replicates a script's effects, so reading the clock is allowed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[4])
-- `out`, with `n` entries: the reply; `kept`, with `k`: the batch kept for a retried claim.
local out, n = {token}, 1
local kept, k = {ARGV[5], token}, 2
local last = now
-- The envelopes are read with one HMGET, and the leases written with one call per key (in
-- chunks) after the loop, not four calls per task: each leased task's keys are its own, so
-- deferring its writes changes nothing the loop reads.
local candidates, c = {}, 0
for i = 1, #ids, 2 do
  c = c + 1
  candidates[c] = ids[i]
end
local envelopes, e = {}, 0
for i = 1, c, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(candidates, i, math.min(i + 499, c)))
  for j = 1, #part do
    e = e + 1
    envelopes[e] = part[j]
  end
end
-- `leased` tasks taken: `taken` holds their ids, `leases` and `owners` two entries each.
local leases, owners, taken, leased = {}, {}, {}, 0
for i = 1, #ids, 2 do
  if leased == limit then break end
  local id, due = ids[i], tonumber(ids[i + 1])
  local envelope = envelopes[(i + 1) / 2]
  if envelope and envelope ~= '' then
    leased = leased + 1
    leases[2 * leased - 1], leases[2 * leased] = math.max(due, now) + lease, id
    owners[2 * leased - 1], owners[2 * leased] = id, owner
    taken[leased] = id
    out[n + 1], out[n + 2], out[n + 3] = id, ids[i + 1], envelope
    n = n + 3
    kept[k + 1], kept[k + 2] = id, ids[i + 1]
    k = k + 2
    last = math.max(last, due)
  elseif not tracked then
    out[n + 1], out[n + 2], out[n + 3] = id, 'wrongtype', KEYS[9]
    n = n + 3
  else
    local seen = tonumber(redis.call('HGET', KEYS[9], id))
    -- A time ahead of Redis's clock (it stepped back) counts from now.
    if seen and seen > now then seen = nil end
    if seen == nil and grace > 0 then
      redis.call('HSET', KEYS[9], id, now)
      out[n + 1], out[n + 2], out[n + 3] = id, 'wait', ''
      n = n + 3
    elseif now - (seen or now) >= grace then
      -- The dead letter first: a key of the wrong type refuses it, and the id stays queued.
      local written = redis.pcall('HSET', KEYS[6], id, cjson.encode({
        reason = 'no envelope in the tasks hash', raw = '', at = now, attempt = 0}))
      if type(written) == 'table' and written.err then
        if not string.find(written.err, 'WRONGTYPE', 1, true) then return written end
        out[n + 1], out[n + 2], out[n + 3] = id, 'wrongtype', KEYS[6]
        n = n + 3
      else
        redis.call('ZREM', KEYS[1], id)
        redis.call('HDEL', KEYS[2], id)
        redis.call('HDEL', KEYS[8], id)
        redis.call('HDEL', KEYS[9], id)
        out[n + 1], out[n + 2], out[n + 3] = id, 'dead', ''
        n = n + 3
      end
    end
  end
end
for i = 1, leased, 500 do
  local j = math.min(i + 499, leased)
  redis.call('ZADD', KEYS[3], unpack(leases, 2 * i - 1, 2 * j))
  redis.call('HSET', KEYS[4], unpack(owners, 2 * i - 1, 2 * j))
  redis.call('ZREM', KEYS[1], unpack(taken, i, j))
  if known > 0 then redis.call('HDEL', KEYS[9], unpack(taken, i, j)) end
end
redis.call('DEL', KEYS[7])
for i = 1, k, 1000 do
  redis.call('RPUSH', KEYS[7], unpack(kept, i, math.min(i + 999, k)))
end
redis.call('PEXPIRE', KEYS[7], math.ceil(last - now + lease))
return out
