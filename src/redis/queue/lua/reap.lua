-- KEYS: lease, owner, due, tasks, dead, expired. ARGV: batch, channel, max expiries (0: no
-- limit), wake-up suffix (`:shard`, or empty). Returns tasks whose lease expired by Redis's clock (their consumer died or stalled)
-- to the queue at their due time (Redis's now, if that is earlier or unknown), and wakes the consumers; counts each task's expiries, and moves a
-- task whose lease has now expired `max` times to the dead-letter HASH instead (a task that
-- takes its consumer down each time is not delivered forever), with a record as the
-- consumer writes one. Returns `{requeued, dead-lettered, bad key}`: the bad key is the
-- dead-letter HASH when it has the wrong type (the tasks it refused stay leased, and are tried
-- again by the next call), else `''`.

-- `now`: Redis's clock in ms (the same two lines in every script that reads it; Redis 7
-- replicates a script's effects, so reading the clock is allowed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local max, requeued, dead, bad = tonumber(ARGV[3]), 0, 0, ''
-- A script that fails part way keeps what it wrote: for each id, whatever can fail (a count or
-- a record that does not encode) comes before the first delete, and the task's new place is
-- written before its old one is cleared. An error then leaves the task leased, whole.
for _, id in ipairs(ids) do
  local n = (tonumber(redis.call('HGET', KEYS[6], id)) or 0) + 1
  if max > 0 and n >= max then
    local raw = redis.call('HGET', KEYS[4], id) or ''
    local ok, envelope = pcall(cjson.decode, raw)
    local attempt = 0
    if ok and type(envelope) == 'table' and type(envelope.attempt) == 'number' then
      attempt = envelope.attempt
    end
    -- cjson reads 1e999 as inf, and NaN, and encodes neither.
    if attempt ~= attempt or attempt == math.huge or attempt == -math.huge then attempt = 0 end
    local reason = 'lease expired ' .. n .. ' times: its consumer crashed or stalled each time'
    -- Deliveries tried: the failed ones the envelope counts, and the n that never returned.
    local encoded, record = pcall(cjson.encode, {
      reason = reason, raw = raw, at = now, attempt = attempt + n})
    if not encoded then
      record = cjson.encode({reason = reason, raw = '', at = now, attempt = n})
    end
    -- A dead-letter key of the wrong type refuses the record: the task stays leased, tried
    -- again next round, and the key is named in the reply; the other tasks go on.
    local written = redis.pcall('HSET', KEYS[5], id, record)
    if type(written) == 'table' and written.err then
      if not string.find(written.err, 'WRONGTYPE', 1, true) then return written end
      bad = KEYS[5]
    else
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[4], id)
      redis.call('HDEL', KEYS[6], id)
      dead = dead + 1
    end
  else
    -- Back at its own due time (the producers' clock, as every score in the queue), read from
    -- the end of the envelope, where `due_at` is the last field: at Redis's `now` it would wait
    -- for as long as Redis's clock runs ahead of the consumers'. The lease ran from that due
    -- time at the earliest, so it has passed by Redis's clock; the earlier of the two, to be
    -- sure. An envelope written otherwise (by hand) goes back at `now`.
    local back = now
    local due = tonumber(string.match(string.sub(redis.call('HGET', KEYS[4], id) or '', -40),
      '\34due_at\34:(%d+)}$'))
    if due and due < back then back = due end
    redis.call('ZADD', KEYS[3], back, id)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HSET', KEYS[6], id, n)
    requeued = requeued + 1
  end
end
if requeued > 0 then redis.pcall('PUBLISH', ARGV[2], tostring(now) .. ARGV[4]) end
return {requeued, dead, bad}
