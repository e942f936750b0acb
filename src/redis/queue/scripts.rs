//! The Lua scripts of the shared delay queue. Each runs atomically on the shard's keys, which
//! share one hash tag, so they are valid on a Redis Cluster.
//!
//! Keys of a shard (see [`KeyLayout`](crate::redis::KeyLayout)): `due` (ZSET id → due ms, queued),
//! `tasks` (HASH id → envelope), `lease` (ZSET id → lease deadline ms, claimed), `owner` (HASH
//! id → `consumer|token`), `fence` (counter of claim tokens), `dead` (HASH id → record),
//! `unpaired` (HASH id → when, on Redis's clock, a claim or a sweep first saw the id with half
//! of its pair: queued with no envelope, or an envelope with no queue entry), and a
//! consumer's `batch` (LIST: its last claim, for a retry whose reply was lost).
//!
//! Another client may write a task in two steps (the queue entry, then the envelope, or the
//! other way round). Each half alone is given `grace` ms from when it is first seen (CLAIM
//! sees a queue entry with no envelope, SWEEP an envelope with neither a queue entry nor a
//! lease nor a dead letter) before it is dead-lettered or removed; meanwhile it is left as
//! it is, and the other tasks go on. A task is pending, for ENQUEUE and REQUEUE, when it has
//! both halves: an envelope alone does not make its id look queued.
//!
//! Fencing: a claim takes a fresh token and writes `consumer|token` as the owner of each task
//! it takes. Every later change by that consumer (ack, retry, dead-letter, give back) first
//! checks that the owner is still exactly that value, so a consumer whose lease expired and was
//! taken over cannot change the task under the new owner.
//!
//! Redis does not roll a script back when a command in it fails (a key of the wrong type, a
//! command an ACL refuses): the commands before it stay done. So every script that moves a
//! task writes its new place first (the lease and owner of a claim; the queued envelope of an
//! enqueue, a retry, a give-back or a requeue; the dead letter) and clears the old one after:
//! if the write fails, nothing has changed for that task; if a later command fails, the task
//! is in both places (a duplicate at worst), never in neither. Wake-ups are published with
//! `redis.pcall`, last: a user without pub/sub rights (Redis 7's default for new ACL users)
//! loses wake-ups, which reconcile claims cover, not the script's reply.
//!
//! Leases run on Redis's clock (`TIME`), read inside the scripts that set and expire them
//! (CLAIM, RENEW, REAP): consumers whose clocks disagree still agree on when a lease ends, so
//! a reaper whose clock runs ahead cannot take a lease that is still live. Due times are the
//! producers' wall clock, as the tasks are fired by it.

use std::sync::LazyLock;

/// Lua: `now`, Redis's clock in ms since the Unix epoch. Redis 7 replicates a script's effects,
/// not the script, so reading the clock in it is allowed.
const REDIS_NOW: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
";

use redis::Script;

/// KEYS: due, tasks, lease, owner, expired. ARGV: id, due, envelope, replace (0/1), channel,
/// notify before (ms; 0 = never), message. Returns 1 if stored, 0 if the id was pending (an
/// envelope, and the id queued or leased) and replace was not asked for. An envelope with no
/// queue entry (another client's task half written, or left behind) is written over. A task
/// stored starts with no lease expiries (a count left by an older consumer that did not clear
/// it, or by a replaced task, is forgotten). The text is public for producers in other
/// languages ([`Producer::ENQUEUE_SCRIPT`](crate::redis::Producer::ENQUEUE_SCRIPT)).
pub(crate) const ENQUEUE_LUA: &str = r"
local stored = redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
local pending = stored and (redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZSCORE', KEYS[3], ARGV[1]))
if pending and ARGV[4] == '0' then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if pending then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
redis.call('HDEL', KEYS[5], ARGV[1])
if tonumber(ARGV[2]) < tonumber(ARGV[6]) then
  redis.pcall('PUBLISH', ARGV[5], ARGV[7])
end
return 1
";

/// [`ENQUEUE_LUA`], loaded.
pub(crate) static ENQUEUE: LazyLock<Script> = LazyLock::new(|| Script::new(ENQUEUE_LUA));

/// KEYS: due, tasks, lease, owner, expired. ARGV: id. Returns 1 if the task was queued or
/// leased.
pub(crate) static CANCEL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return n
",
    )
});

/// KEYS: due, tasks, lease, owner, fence, dead, batch, expired, unpaired. ARGV: until (ms),
/// batch, consumer, lease (ms), nonce, grace (ms). Leases up to `batch` tasks due by `until` to
/// `consumer|token` until max(due, now) + lease (`now`: Redis's clock), and returns `token,
/// id1, due1, envelope1, id2, ...`, or an empty array.
///
/// An id with no envelope (or an empty one; only another client writes such) is never leased:
/// leased, it would wait for the consumer's dead-lettering, and an `enqueue` of the id in
/// between would be dead-lettered with it. It may be half written (queued first, its envelope
/// on the way), so it stays queued until `grace` ms have passed since a claim first saw it so
/// (kept in `unpaired`), then goes to the dead-letter HASH. It comes back as `id, "wait", ""`
/// the first time it is seen, `id, "dead", ""` when dead-lettered, `id, "wrongtype", key`
/// when `key` (the dead-letter HASH, or `unpaired`) has the wrong type: the id then stays
/// queued, and the other tasks are claimed all the same. Ids seen before and still in their
/// grace period are not answered, and do not take a task's place: the claim reads as many
/// more ids as `unpaired` holds, up to `batch` more. A claim's reply holds at most `batch`
/// leased tasks.
///
/// Idempotent by nonce: the claim is kept in the consumer's `batch` list (`nonce, token, id1,
/// due1, ...`, expiring when the last of its leases ends), and a call with the nonce kept
/// there claims nothing new: it answers that claim again, with the tasks still leased under
/// its token. A consumer whose claim's reply was lost after the script ran calls again with
/// the same nonce and gets its batch, instead of leaving it leased to nobody until the lease
/// ends.
pub(crate) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
if redis.call('LINDEX', KEYS[7], 0) == ARGV[5] then
  local kept = redis.call('LRANGE', KEYS[7], 1, -1)
  local owner = ARGV[3] .. '|' .. kept[1]
  local out = {{kept[1]}}
  for i = 2, #kept, 2 do
    local id = kept[i]
    if redis.call('HGET', KEYS[4], id) == owner then
      local envelope = redis.call('HGET', KEYS[2], id)
      if envelope then
        out[#out + 1] = id
        out[#out + 1] = kept[i + 1]
        out[#out + 1] = envelope
      end
    end
  end
  return out
end
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
if #ids == 0 then return {{}} end
local token = redis.call('INCR', KEYS[5])
local owner = ARGV[3] .. '|' .. token
{REDIS_NOW}local lease = tonumber(ARGV[4])
local out = {{tostring(token)}}
local kept = {{ARGV[5], tostring(token)}}
local last, leased = now, 0
for i = 1, #ids, 2 do
  if leased == limit then break end
  local id, due = ids[i], tonumber(ids[i + 1])
  local envelope = redis.call('HGET', KEYS[2], id)
  if envelope and envelope ~= '' then
    redis.call('ZADD', KEYS[3], math.max(due, now) + lease, id)
    redis.call('HSET', KEYS[4], id, owner)
    redis.call('ZREM', KEYS[1], id)
    if known > 0 then redis.call('HDEL', KEYS[9], id) end
    out[#out + 1] = id
    out[#out + 1] = ids[i + 1]
    out[#out + 1] = envelope
    kept[#kept + 1] = id
    kept[#kept + 1] = ids[i + 1]
    last = math.max(last, due)
    leased = leased + 1
  elseif not tracked then
    out[#out + 1] = id
    out[#out + 1] = 'wrongtype'
    out[#out + 1] = KEYS[9]
  else
    local seen = tonumber(redis.call('HGET', KEYS[9], id))
    -- A time ahead of Redis's clock (it stepped back) counts from now.
    if seen and seen > now then seen = nil end
    if seen == nil and grace > 0 then
      redis.call('HSET', KEYS[9], id, now)
      out[#out + 1] = id
      out[#out + 1] = 'wait'
      out[#out + 1] = ''
    elseif now - (seen or now) >= grace then
      -- The dead letter first: a key of the wrong type refuses it, and the id stays queued.
      local written = redis.pcall('HSET', KEYS[6], id, cjson.encode({{
        reason = 'no envelope in the tasks hash', raw = '', at = now, attempt = 0}}))
      if type(written) == 'table' and written.err then
        if not string.find(written.err, 'WRONGTYPE', 1, true) then return written end
        out[#out + 1] = id
        out[#out + 1] = 'wrongtype'
        out[#out + 1] = KEYS[6]
      else
        redis.call('ZREM', KEYS[1], id)
        redis.call('HDEL', KEYS[2], id)
        redis.call('HDEL', KEYS[8], id)
        redis.call('HDEL', KEYS[9], id)
        out[#out + 1] = id
        out[#out + 1] = 'dead'
        out[#out + 1] = ''
      end
    end
  end
end
redis.call('DEL', KEYS[7])
for i = 1, #kept, 1000 do
  redis.call('RPUSH', KEYS[7], unpack(kept, i, math.min(i + 999, #kept)))
end
redis.call('PEXPIRE', KEYS[7], math.ceil(last - now + lease))
return out
",
    ))
});

/// KEYS: lease, owner. ARGV: lease (ms), then id1, owner1, id2, owner2, ... Extends to
/// now + lease (`now`: Redis's clock) the lease of each task whose owner still matches (never
/// shortens one). Returns how many it extended.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{REDIS_NOW}local to, n = now + tonumber(ARGV[1]), 0
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
",
    ))
});

/// KEYS: lease, owner, tasks, expired, dead. ARGV: id1, owner1, again1, id2, ... Removes each
/// task whose owner still matches; returns per task 1 (removed), 0 (refused: the lease was
/// taken over, or ran out and the task is queued again or dead-lettered), or, for an ack sent
/// again (`again` = 1) after a call that may have run, 2 if the task is gone, held by no one
/// and not dead-lettered: most likely that call ran and only its reply was lost. (Another
/// consumer's takeover and ack in between, or a producer's cancel, would read the same;
/// without such a call before, they read as 0.)
pub(crate) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local out = {}
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    redis.call('HDEL', KEYS[4], ARGV[i])
    out[#out + 1] = 1
  elseif ARGV[i + 2] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 then
    out[#out + 1] = 2
  else
    out[#out + 1] = 0
  end
end
return out
",
    )
});

/// KEYS: lease, owner, tasks, due. ARGV: id, owner, new envelope, next due (ms), channel,
/// notify before (ms), wake-up suffix (`:shard`, or empty). Puts a failed task back in the
/// queue for its next attempt, if the owner still matches, and wakes the consumers if it is
/// due soon. Returns 1, or 2 if the task already holds the new envelope (an earlier send of
/// this retry ran and its reply was lost), else 0 (refused: the lease was taken over).
pub(crate) static RETRY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[3] then return 2 end
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if tonumber(ARGV[4]) < tonumber(ARGV[6]) then redis.pcall('PUBLISH', ARGV[5], ARGV[4] .. ARGV[7]) end
return 1
",
    )
});

/// KEYS: lease, owner, tasks, dead, expired. ARGV: id, owner, record. Moves a task to the
/// dead-letter HASH, if the owner still matches. Returns 1, or 2 if the dead-letter HASH
/// already holds this record (an earlier send ran and its reply was lost), else 0.
pub(crate) static DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  if redis.call('HGET', KEYS[4], ARGV[1]) == ARGV[3] then return 2 end
  return 0
end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
",
    )
});

/// KEYS: lease, owner, due. ARGV: channel, notify before (ms), wake-up suffix (`:shard`, or
/// empty), then id1, owner1, due1, ...
/// Hands claimed tasks not started here back to the queue at their due time (at a graceful
/// shutdown, or while the consumer's handler threads are all stuck), skipping any no longer
/// leased to the owner given, and wakes the other consumers for the earliest. Returns how many
/// were handed back.
pub(crate) static GIVE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
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
",
    )
});

/// KEYS: lease, owner, due, tasks, dead, expired. ARGV: batch, channel, max expiries (0: no
/// limit), wake-up suffix (`:shard`, or empty). Returns tasks whose lease expired by Redis's clock (their consumer died or stalled)
/// to the queue at their due time (Redis's now, if that is earlier or unknown), and wakes the consumers; counts each task's expiries, and moves a
/// task whose lease has now expired `max` times to the dead-letter HASH instead (a task that
/// takes its consumer down each time is not delivered forever), with a record as the
/// consumer writes one. Returns `{requeued, dead-lettered, bad key}`: the bad key is the
/// dead-letter HASH when it has the wrong type (the tasks it refused stay leased, and are tried
/// again by the next call), else `''`.
pub(crate) static REAP: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{REDIS_NOW}local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
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
    local encoded, record = pcall(cjson.encode, {{
      reason = reason, raw = raw, at = now, attempt = attempt + n}})
    if not encoded then
      record = cjson.encode({{reason = reason, raw = '', at = now, attempt = n}})
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
      '\34due_at\34:(%d+)}}$'))
    if due and due < back then back = due end
    redis.call('ZADD', KEYS[3], back, id)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HSET', KEYS[6], id, n)
    requeued = requeued + 1
  end
end
if requeued > 0 then redis.pcall('PUBLISH', ARGV[2], tostring(now) .. ARGV[4]) end
return {{requeued, dead, bad}}
",
    ))
});

/// KEYS: dead, tasks, due, lease. ARGV: id, envelope, due (ms), channel, the dead record as
/// read, wake-up suffix (`:shard`, or empty).
/// Moves a dead-lettered task back to the queue with a fresh envelope and wakes the consumers.
/// Returns 0 if the dead-letter HASH no longer holds that record for the id (gone, or
/// dead-lettered again since it was read), -1 (and changes nothing) if a task with that id is
/// pending again (an envelope, and queued or leased; an envelope alone is written over).
pub(crate) static REQUEUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[5] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 and (redis.call('ZSCORE', KEYS[3], ARGV[1]) or redis.call('ZSCORE', KEYS[4], ARGV[1])) then return -1 end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.pcall('PUBLISH', ARGV[4], ARGV[3] .. ARGV[6])
return 1
",
    )
});

/// KEYS: tasks, due, lease, dead, unpaired, expired. ARGV: tasks cursor, unpaired cursor,
/// count, grace (ms). One step of the reaper's sweep for envelopes with no queue entry, which
/// another client's task written envelope first has until its second write lands, and one
/// whose second write never came has for good. An HSCAN step of `count` (a hint) over
/// `tasks`: an envelope whose id is neither queued nor leased nor dead-lettered is noted in
/// `unpaired` when first seen so, and removed (with its lease expiry count) when seen so
/// again `grace` ms or more later (Redis's clock); one whole again is struck from `unpaired`
/// (an empty envelope counts as none, as for CLAIM). Then an HSCAN step over `unpaired`,
/// striking out ids now whole or gone (neither queued, leased nor stored). Returns `{next tasks cursor, next unpaired cursor, envelopes removed, bad key}`:
/// the bad key is `unpaired` when it has the wrong type (nothing is done then), else `''`.
pub(crate) static SWEEP: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
local known = redis.pcall('HLEN', KEYS[5])
if type(known) ~= 'number' then
  if not string.find(known.err, 'WRONGTYPE', 1, true) then return known end
  return {{ARGV[1], ARGV[2], 0, KEYS[5]}}
end
{REDIS_NOW}local grace, removed = tonumber(ARGV[4]), 0
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
return {{step[1], next_unpaired, removed, ''}}
",
    ))
});

/// Every script, for loading them all ahead of their first calls.
pub(crate) static ALL: [&LazyLock<Script>; 11] = [
    &ENQUEUE, &CANCEL, &CLAIM, &RENEW, &ACK, &RETRY, &DEAD, &GIVE_BACK, &REAP, &REQUEUE, &SWEEP,
];

/// The tests' private `redis-server` (shared with the integration tests).
#[cfg(test)]
#[path = "../../../tests/support/redis_server.rs"]
#[allow(unreachable_pub, dead_code)]
mod redis_server;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::KeyLayout;

    /// A private server (alive while the first is) and a connection to it.
    fn redis() -> (super::redis_server::RedisServer, redis::Connection) {
        let server = super::redis_server::RedisServer::start_in_memory();
        let conn = redis::Client::open(server.url())
            .unwrap()
            .get_connection()
            .unwrap();
        (server, conn)
    }

    /// Makes the lease on `id` run out (its deadline 0), as a consumer's crash would.
    fn expire_lease(conn: &mut redis::Connection, k: &KeyLayout, id: &str) {
        redis::cmd("ZADD")
            .arg(k.lease())
            .arg(0)
            .arg(id)
            .query::<()>(conn)
            .unwrap();
    }

    /// Runs REAP on `k` with `max` lease expiries: (requeued, dead-lettered).
    fn reap(conn: &mut redis::Connection, k: &KeyLayout, max: u32) -> (u64, u64) {
        let (requeued, dead, bad) = reap_reply(conn, k, max);
        assert_eq!(bad, "", "a key named as of the wrong type");
        (requeued, dead)
    }

    /// Runs REAP on `k` with `max` lease expiries: its whole reply.
    fn reap_reply(conn: &mut redis::Connection, k: &KeyLayout, max: u32) -> (u64, u64, String) {
        REAP.key(k.lease())
            .key(k.owner())
            .key(k.due())
            .key(k.tasks())
            .key(k.dead())
            .key(k.expired())
            .arg(100)
            .arg("chan")
            .arg(max)
            .arg("")
            .invoke(conn)
            .unwrap()
    }

    /// The dead-letter record of `id`, decoded.
    fn dead_record(conn: &mut redis::Connection, k: &KeyLayout, id: &str) -> serde_json::Value {
        let record: String = redis::cmd("HGET")
            .arg(k.dead())
            .arg(id)
            .query(conn)
            .unwrap();
        serde_json::from_str(&record).unwrap()
    }

    /// The claim script's reply for everything due, leased to consumer `c` for `lease_ms`
    /// (a claim of its own: a fresh nonce).
    fn claim_reply(conn: &mut redis::Connection, k: &KeyLayout, lease_ms: u64) -> Vec<String> {
        try_claim(conn, k, lease_ms).unwrap()
    }

    /// CLAIM of everything due with a fresh nonce, as Redis answered it.
    fn try_claim(
        conn: &mut redis::Connection,
        k: &KeyLayout,
        lease_ms: u64,
    ) -> redis::RedisResult<Vec<String>> {
        static NONCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nonce = NONCE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        claim_with_nonce(conn, k, lease_ms, 100, &format!("n{nonce}"))
    }

    /// CLAIM of up to `batch` tasks due by consumer `c`, with nonce `nonce`, and no grace
    /// period for an id with no envelope.
    fn claim_with_nonce(
        conn: &mut redis::Connection,
        k: &KeyLayout,
        lease_ms: u64,
        batch: usize,
        nonce: &str,
    ) -> redis::RedisResult<Vec<String>> {
        claim_with_grace(conn, k, lease_ms, batch, nonce, 0)
    }

    /// CLAIM of up to `batch` tasks due by consumer `c`, with nonce `nonce`, and `grace_ms`
    /// for an id with no envelope.
    fn claim_with_grace(
        conn: &mut redis::Connection,
        k: &KeyLayout,
        lease_ms: u64,
        batch: usize,
        nonce: &str,
        grace_ms: u64,
    ) -> redis::RedisResult<Vec<String>> {
        CLAIM
            .key(k.due())
            .key(k.tasks())
            .key(k.lease())
            .key(k.owner())
            .key(k.fence())
            .key(k.dead())
            .key(k.batch("c"))
            .key(k.expired())
            .key(k.unpaired())
            .arg(i64::MAX)
            .arg(batch)
            .arg("c")
            .arg(lease_ms)
            .arg(nonce)
            .arg(grace_ms)
            .invoke(conn)
    }

    /// Claims everything due with a lease of `lease_ms`; the owner of each claimed id.
    fn claim(conn: &mut redis::Connection, k: &KeyLayout, lease_ms: u64) -> Vec<(String, String)> {
        let reply = claim_reply(conn, k, lease_ms);
        let token = reply.first().cloned().unwrap_or_default();
        reply[1.min(reply.len())..]
            .chunks(3)
            .map(|t| (t[0].clone(), format!("c|{token}")))
            .collect()
    }

    /// An ack, retry or dead-lettering sent again after its reply was lost answers 2 (it
    /// landed), not 0, which the consumer counts as a takeover; a late ack not sent again,
    /// and one whose lease ran out and whose task is queued again, still answer 0.
    #[test]
    fn an_outcome_sent_again_reads_as_landed_not_refused() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("resent").unwrap();
        for id in ["a", "r", "d", "late"] {
            redis::pipe()
                .zadd(k.due(), id, 0)
                .hset(k.tasks(), id, "{}")
                .query::<()>(&mut conn)
                .unwrap();
        }
        let claimed: std::collections::HashMap<String, String> =
            claim(&mut conn, &k, 60_000).into_iter().collect();
        assert_eq!(claimed.len(), 4);
        let ack = |conn: &mut redis::Connection, id: &str, again: bool| -> Vec<u8> {
            ACK.key(k.lease())
                .key(k.owner())
                .key(k.tasks())
                .key(k.expired())
                .key(k.dead())
                .arg(id)
                .arg(&claimed[id])
                .arg(u8::from(again))
                .invoke(conn)
                .unwrap()
        };
        assert_eq!(ack(&mut conn, "a", false), [1]);
        assert_eq!(ack(&mut conn, "a", true), [2], "a resent ack");
        // Not sent again: another consumer took the task over and acked it.
        assert_eq!(ack(&mut conn, "a", false), [0], "a late ack");
        let retry = |conn: &mut redis::Connection| -> i64 {
            RETRY
                .key(k.lease())
                .key(k.owner())
                .key(k.tasks())
                .key(k.due())
                .arg("r")
                .arg(&claimed["r"])
                .arg(r#"{"attempt":1}"#)
                .arg(5)
                .arg("chan")
                .arg(0)
                .arg("")
                .invoke(conn)
                .unwrap()
        };
        assert_eq!(retry(&mut conn), 1);
        assert_eq!(retry(&mut conn), 2, "a resent retry");
        let dead = |conn: &mut redis::Connection| -> i64 {
            DEAD.key(k.lease())
                .key(k.owner())
                .key(k.tasks())
                .key(k.dead())
                .key(k.expired())
                .arg("d")
                .arg(&claimed["d"])
                .arg(r#"{"reason":"x"}"#)
                .invoke(conn)
                .unwrap()
        };
        assert_eq!(dead(&mut conn), 1);
        assert_eq!(dead(&mut conn), 2, "a resent dead-lettering");
        // "late"'s lease runs out: the reaper queues it again, and its ack is refused.
        expire_lease(&mut conn, &k, "late");
        assert_eq!(reap(&mut conn, &k, 0), (1, 0));
        assert_eq!(ack(&mut conn, "late", true), [0], "a lease that ran out");
        // "r", claimed again, is still the envelope the retry wrote: a late resend landed.
        let reclaimed = claim(&mut conn, &k, 60_000);
        assert!(reclaimed.iter().any(|(id, _)| id == "r"));
        assert_eq!(retry(&mut conn), 2);
        // Once its new owner wrote a retry of its own, the old resend is refused.
        redis::cmd("HSET")
            .arg(k.tasks())
            .arg("r")
            .arg(r#"{"attempt":2}"#)
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(retry(&mut conn), 0, "the task moved on: refused");
        // Its lease runs out again and the reaper dead-letters it: a resent ack is refused,
        // as the task did not end acknowledged.
        // ("late" was claimed again with "r" above.)
        expire_lease(&mut conn, &k, "late");
        assert_eq!(reap(&mut conn, &k, 1), (0, 1));
        assert_eq!(ack(&mut conn, "late", true), [0], "a dead-lettered task");
    }

    /// A claim called again with its nonce (its reply was lost) answers the same batch, as
    /// far as it is still leased under the claim's token, and claims nothing new; a new
    /// nonce claims anew. The kept batch expires with the claim's leases.
    #[test]
    fn a_claim_retried_with_its_nonce_answers_its_batch_again() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("nonce").unwrap();
        let envelope = |id: &str| {
            format!(
                r#"{{"id":"{id}","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":0}}"#
            )
        };
        // More than one RPUSH's worth (1 000 entries) of kept ids and dues.
        let ids: Vec<String> = (0..700).map(|i| format!("t{i:03}")).collect();
        for (i, id) in ids.iter().enumerate() {
            redis::pipe()
                .zadd(k.due(), id, i)
                .hset(k.tasks(), id, envelope(id))
                .query::<()>(&mut conn)
                .unwrap();
        }
        let first = claim_with_nonce(&mut conn, &k, 60_000, 1_000, "x").unwrap();
        assert_eq!(first.len(), 1 + 3 * ids.len());
        let again = claim_with_nonce(&mut conn, &k, 60_000, 1_000, "x").unwrap();
        assert_eq!(again, first, "the retry did not answer the same batch");
        let fence: u64 = redis::cmd("GET").arg(k.fence()).query(&mut conn).unwrap();
        assert_eq!(fence.to_string(), first[0], "the retry took a new token");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k.batch("c"))
            .query(&mut conn)
            .unwrap();
        assert!((1..=60_000).contains(&ttl), "batch kept for {ttl} ms");

        // A task queued since is not taken by the retry; one acknowledged since and one
        // whose lease another consumer took over are left out of its answer.
        let owner = format!("c|{}", first[0]);
        redis::pipe()
            .zadd(k.due(), "new", 0)
            .hset(k.tasks(), "new", envelope("new"))
            .hdel(k.owner(), "t000")
            .zrem(k.lease(), "t000")
            .hdel(k.tasks(), "t000")
            .hset(k.owner(), "t001", "d|99")
            .query::<()>(&mut conn)
            .unwrap();
        let retried = claim_with_nonce(&mut conn, &k, 60_000, 1_000, "x").unwrap();
        assert_eq!(retried[0], first[0]);
        assert_eq!(
            retried[1..],
            first[7..],
            "t000 and t001 are not this claim's any more"
        );
        let still: Option<String> = redis::cmd("HGET")
            .arg(k.owner())
            .arg("t002")
            .query(&mut conn)
            .unwrap();
        assert_eq!(still.as_deref(), Some(owner.as_str()));
        let queued: u32 = redis::cmd("ZCARD").arg(k.due()).query(&mut conn).unwrap();
        assert_eq!(queued, 1, "the retry claimed the new task");

        // A new nonce is a new claim, with a new token.
        let next = claim_with_nonce(&mut conn, &k, 60_000, 1_000, "y").unwrap();
        assert_eq!(next.len(), 4);
        assert_eq!(next[1], "new");
        assert_ne!(next[0], first[0]);

        // A score another client wrote with a fraction (due in the future, so that it sets
        // the batch's expiry) still gives the batch an expiry in whole ms.
        let soon: u64 = redis::cmd("TIME")
            .query::<(u64, u64)>(&mut conn)
            .map(|(s, _)| s * 1_000 + 500)
            .unwrap();
        redis::pipe()
            .cmd("ZADD")
            .arg(k.due())
            .arg(format!("{soon}.5"))
            .arg("frac")
            .hset(k.tasks(), "frac", envelope("frac"))
            .query::<()>(&mut conn)
            .unwrap();
        let frac = claim_with_nonce(&mut conn, &k, 60_000, 1_000, "z").unwrap();
        assert_eq!(frac[1], "frac");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k.batch("c"))
            .query(&mut conn)
            .unwrap();
        assert!((60_000..=62_000).contains(&ttl), "batch kept for {ttl} ms");
    }

    /// An id with no envelope (or an empty one) is dead-lettered by the claim itself, never
    /// leased: an enqueue of that id right after the claim is a task like any other, claimed
    /// and leased whole. (Leased, it waited for the consumer's dead-lettering, which deleted
    /// whatever envelope the id had by then.)
    #[test]
    fn a_claim_dead_letters_an_id_with_no_envelope_and_leases_nothing() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("bare").unwrap();
        redis::pipe()
            .zadd(k.due(), "none", 0)
            .zadd(k.due(), "empty", 0)
            .hset(k.tasks(), "empty", "")
            // A lease on "none" ran out before (its envelope went meanwhile).
            .hset(k.expired(), "none", 1)
            .query::<()>(&mut conn)
            .unwrap();
        let reply = claim_reply(&mut conn, &k, 60_000);
        assert_eq!(reply[1..], ["empty", "dead", "", "none", "dead", ""]);
        let (leased, queued, dead, expiries): (u32, u32, Vec<String>, u32) = redis::pipe()
            .zcard(k.lease())
            .zcard(k.due())
            .hkeys(k.dead())
            .hlen(k.expired())
            .query(&mut conn)
            .unwrap();
        assert_eq!(
            (leased, queued),
            (0, 0),
            "an id with no envelope was leased"
        );
        assert_eq!(expiries, 0, "a dead letter's expiry count was kept");
        assert_eq!(dead.len(), 2);
        let record = dead_record(&mut conn, &k, "none");
        assert_eq!(record["reason"], "no envelope in the tasks hash");
        // The id enqueued again now is a task like any other.
        let envelope =
            r#"{"id":"none","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":0}"#;
        redis::pipe()
            .zadd(k.due(), "none", 0)
            .hset(k.tasks(), "none", envelope)
            .query::<()>(&mut conn)
            .unwrap();
        let claimed = claim(&mut conn, &k, 60_000);
        assert_eq!(claimed.len(), 1);
        let stored: Option<String> = redis::cmd("HGET")
            .arg(k.tasks())
            .arg("none")
            .query(&mut conn)
            .unwrap();
        assert_eq!(stored.as_deref(), Some(envelope));
    }

    /// An id with no envelope is left queued for its grace period, counted from the first
    /// claim that saw it so, and takes no task's place meanwhile; then it is dead-lettered,
    /// unless the dead-letter key has the wrong type: then it stays queued, the claim names
    /// the key, and the good tasks are claimed all the same. So does a wrong-typed
    /// `unpaired`.
    #[test]
    fn a_claim_waits_out_the_grace_period_of_an_id_with_no_envelope() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("grace").unwrap();
        let unpaired = k.unpaired().to_owned();
        redis::pipe()
            .zadd(k.due(), "half", 0)
            .zadd(k.due(), "a", 1)
            .zadd(k.due(), "b", 1)
            .hset(k.tasks(), "a", "{}")
            .hset(k.tasks(), "b", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        let claim = |conn: &mut redis::Connection, nonce: &str| {
            claim_with_grace(conn, &k, 60_000, 2, nonce, 60_000).unwrap()
        };
        let ids = |reply: &[String]| -> Vec<(String, String)> {
            reply[1..]
                .chunks(3)
                .map(|t| {
                    (
                        t[0].clone(),
                        if t[1] == "1" {
                            "leased".into()
                        } else {
                            t[1].clone()
                        },
                    )
                })
                .collect()
        };
        let pair = |id: &str, what: &str| (id.to_string(), what.to_string());
        // First seen: noted, and answered (the claim changed something), beside a task.
        assert_eq!(
            ids(&claim(&mut conn, "1")),
            [pair("half", "wait"), pair("a", "leased")]
        );
        // Seen before, in its grace period: read beyond, not answered.
        assert_eq!(ids(&claim(&mut conn, "2")), [pair("b", "leased")]);
        let noted: Option<i64> = redis::cmd("HGET")
            .arg(&unpaired)
            .arg("half")
            .query(&mut conn)
            .unwrap();
        assert!(noted.unwrap() > 1_600_000_000_000);
        // Its grace period over: dead-lettered, and forgotten.
        redis::cmd("HSET")
            .arg(&unpaired)
            .arg("half")
            .arg(0)
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(ids(&claim(&mut conn, "3")), [pair("half", "dead")]);
        let (queued, tracked): (u32, u32) = redis::pipe()
            .zcard(k.due())
            .hlen(&unpaired)
            .query(&mut conn)
            .unwrap();
        assert_eq!((queued, tracked), (0, 0));
        assert_eq!(
            dead_record(&mut conn, &k, "half")["reason"],
            "no envelope in the tasks hash"
        );

        // A dead-letter key of the wrong type: named, the id kept, the good task claimed.
        redis::pipe()
            .del(k.dead())
            .set(k.dead(), "not a hash")
            .zadd(k.due(), "half2", 0)
            .hset(&unpaired, "half2", 0)
            .zadd(k.due(), "c", 1)
            .hset(k.tasks(), "c", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        let reply = claim(&mut conn, "4");
        assert_eq!(reply[1..], ["half2", "wrongtype", k.dead(), "c", "1", "{}"]);
        let (score, noted): (Option<f64>, bool) = redis::pipe()
            .zscore(k.due(), "half2")
            .hexists(&unpaired, "half2")
            .query(&mut conn)
            .unwrap();
        assert_eq!((score, noted), (Some(0.0), true));

        // An `unpaired` of the wrong type: likewise.
        redis::pipe()
            .del(&unpaired)
            .set(&unpaired, "not a hash")
            .zadd(k.due(), "d", 1)
            .hset(k.tasks(), "d", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        let reply = claim(&mut conn, "5");
        assert_eq!(
            reply[1..],
            ["half2", "wrongtype", unpaired.as_str(), "d", "1", "{}"]
        );
    }

    /// SWEEP notes an envelope with neither a queue entry, a lease nor a dead letter, removes
    /// it once seen so again after the grace period, and strikes out of `unpaired` the ids
    /// whole again or gone.
    #[test]
    fn a_sweep_removes_an_envelope_alone_after_the_grace_period() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("sweep").unwrap();
        let unpaired = k.unpaired().to_owned();
        redis::pipe()
            .hset(k.tasks(), "alone", "{}")
            .hset(k.expired(), "alone", 1)
            .zadd(k.due(), "queued", 1)
            .hset(k.tasks(), "queued", "{}")
            .zadd(k.lease(), "leased", 1)
            .hset(k.tasks(), "leased", "{}")
            .hset(k.dead(), "dead", "{}")
            .hset(k.tasks(), "dead", "{}")
            .hset(&unpaired, "queued", 0)
            .hset(&unpaired, "gone", 0)
            .zadd(k.due(), "half", 1)
            .hset(&unpaired, "half", 0)
            // Queued with an empty envelope: the claim's to judge, as one with none.
            .zadd(k.due(), "empty", 1)
            .hset(k.tasks(), "empty", "")
            .hset(&unpaired, "empty", 0)
            .query::<()>(&mut conn)
            .unwrap();
        let sweep = |conn: &mut redis::Connection, grace: u64| -> (String, String, u64, String) {
            SWEEP
                .key(k.tasks())
                .key(k.due())
                .key(k.lease())
                .key(k.dead())
                .key(&unpaired)
                .key(k.expired())
                .arg(0)
                .arg(0)
                .arg(100)
                .arg(grace)
                .invoke(conn)
                .unwrap()
        };
        let noted = |conn: &mut redis::Connection| -> Vec<String> {
            let mut ids: Vec<String> = redis::cmd("HKEYS").arg(&unpaired).query(conn).unwrap();
            ids.sort();
            ids
        };
        // Small hashes answer whole in one step: cursors back at 0.
        assert_eq!(
            sweep(&mut conn, 60_000),
            ("0".into(), "0".into(), 0, String::new())
        );
        // `alone` noted, `half` and `empty` (queued, their envelopes awaited) kept; the
        // others struck out.
        assert_eq!(noted(&mut conn), ["alone", "empty", "half"]);
        assert_eq!(
            sweep(&mut conn, 60_000).2,
            0,
            "removed within its grace period"
        );
        redis::cmd("HSET")
            .arg(&unpaired)
            .arg("alone")
            .arg(0)
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(sweep(&mut conn, 60_000).2, 1);
        let mut stored: Vec<String> = redis::cmd("HKEYS").arg(k.tasks()).query(&mut conn).unwrap();
        stored.sort();
        assert_eq!(stored, ["dead", "empty", "leased", "queued"]);
        let counted: bool = redis::cmd("HEXISTS")
            .arg(k.expired())
            .arg("alone")
            .query(&mut conn)
            .unwrap();
        assert!(!counted, "its lease expiry count was kept");
        assert_eq!(noted(&mut conn), ["empty", "half"]);
        // With no grace period, at once.
        redis::cmd("HSET")
            .arg(k.tasks())
            .arg("alone2")
            .arg("{}")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(sweep(&mut conn, 0).2, 1);
        // A wrong-typed `unpaired` is named, and nothing is done.
        redis::pipe()
            .del(&unpaired)
            .set(&unpaired, "x")
            .hset(k.tasks(), "alone3", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(
            sweep(&mut conn, 0),
            ("0".into(), "0".into(), 0, unpaired.clone())
        );
    }

    /// Scripts that move a task and fail part way (a key of the wrong type, which another
    /// client wrote) leave it where it was: the new place is written before the old one is
    /// cleared. (CLAIM removed the task from the queue before leasing it, and REQUEUE deleted
    /// the dead letter before queueing it: each failure lost a task.)
    #[test]
    fn a_script_that_fails_part_way_loses_no_task() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("broken").unwrap();
        let envelope =
            r#"{"id":"a","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":0}"#;
        redis::pipe()
            .zadd(k.due(), "a", 0)
            .hset(k.tasks(), "a", envelope)
            .set(k.lease(), "not a zset")
            .query::<()>(&mut conn)
            .unwrap();
        assert!(
            try_claim(&mut conn, &k, 60_000).is_err(),
            "the claim succeeded"
        );
        let queued: u32 = redis::cmd("ZCARD").arg(k.due()).query(&mut conn).unwrap();
        assert_eq!(queued, 1, "the failed claim took the task out of the queue");

        // A dead letter requeued into a queue of the wrong type stays a dead letter.
        let record = r#"{"reason":"r","raw":"","at":0}"#;
        redis::pipe()
            .del(k.due())
            .del(k.tasks())
            .set(k.due(), "not a zset")
            .hset(k.dead(), "a", record)
            .query::<()>(&mut conn)
            .unwrap();
        let requeued: redis::RedisResult<i64> = REQUEUE
            .key(k.dead())
            .key(k.tasks())
            .key(k.due())
            .key(k.lease())
            .arg("a")
            .arg(envelope)
            .arg(0)
            .arg("chan")
            .arg(record)
            .arg("")
            .invoke(&mut conn);
        assert!(requeued.is_err(), "the requeue succeeded");
        let dead: Option<String> = redis::cmd("HGET")
            .arg(k.dead())
            .arg("a")
            .query(&mut conn)
            .unwrap();
        assert_eq!(dead.as_deref(), Some(record), "the dead letter is gone");
        // Nor is an envelope left behind that would make the id look pending for ever.
        let stored: bool = redis::cmd("HEXISTS")
            .arg(k.tasks())
            .arg("a")
            .query(&mut conn)
            .unwrap();
        assert!(
            !stored,
            "the failed requeue left an envelope with no queue entry"
        );
    }

    /// A task whose lease keeps running out (its consumer crashing each time) is delivered
    /// `max` times, then dead-lettered with the reason and its attempt count; an ack forgets
    /// the count, so expiries of earlier deliveries do not follow a task that succeeded.
    #[test]
    fn a_task_whose_lease_keeps_running_out_is_dead_lettered() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("loop").unwrap();
        let envelope =
            r#"{"id":"crash","topic":"t","payload":null,"attempt":2,"created_at":0,"due_at":0}"#;
        redis::pipe()
            .zadd(k.due(), "crash", 0)
            .hset(k.tasks(), "crash", envelope)
            .zadd(k.due(), "fine", 0)
            .hset(k.tasks(), "fine", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        // Two deliveries whose consumer dies (a lease of 0 ms runs out at once).
        assert_eq!(claim(&mut conn, &k, 0).len(), 2);
        assert_eq!(
            reap(&mut conn, &k, 3),
            (2, 0),
            "first expiry: back to the queue"
        );
        assert_eq!(claim(&mut conn, &k, 0).len(), 2);
        assert_eq!(reap(&mut conn, &k, 3), (2, 0));
        // "fine" succeeds on its third delivery: the ack forgets its expiries.
        let claimed = claim(&mut conn, &k, 60_000);
        let fine = claimed.iter().find(|(id, _)| id == "fine").unwrap();
        let acked: Vec<u8> = ACK
            .key(k.lease())
            .key(k.owner())
            .key(k.tasks())
            .key(k.expired())
            .key(k.dead())
            .arg(&fine.0)
            .arg(&fine.1)
            .arg(0)
            .invoke(&mut conn)
            .unwrap();
        assert_eq!(acked, [1]);
        let left: bool = redis::cmd("HEXISTS")
            .arg(k.expired())
            .arg("fine")
            .query(&mut conn)
            .unwrap();
        assert!(!left, "an acknowledged task's expiries are forgotten");
        // "crash" takes its third consumer down too: dead-lettered, not queued again.
        expire_lease(&mut conn, &k, "crash");
        assert_eq!(reap(&mut conn, &k, 3), (0, 1));
        let record = dead_record(&mut conn, &k, "crash");
        assert_eq!(
            record["reason"],
            "lease expired 3 times: its consumer crashed or stalled each time"
        );
        // Deliveries tried: the 2 failures the envelope counts, and the 3 that never came back.
        assert_eq!(record["attempt"], 5);
        assert_eq!(record["raw"], envelope);
        assert!(record["at"].as_u64().unwrap() > 1_600_000_000_000);
        let (queued, stored, counted): (u32, bool, bool) = redis::pipe()
            .zcard(k.due())
            .hexists(k.tasks(), "crash")
            .hexists(k.expired(), "crash")
            .query(&mut conn)
            .unwrap();
        assert_eq!((queued, stored, counted), (0, false, false));
        // With no limit, expiries only requeue.
        redis::pipe()
            .zadd(k.due(), "crash", 0)
            .hset(k.tasks(), "crash", envelope)
            .query::<()>(&mut conn)
            .unwrap();
        for _ in 0..5 {
            assert_eq!(claim(&mut conn, &k, 0).len(), 1);
            assert_eq!(reap(&mut conn, &k, 0), (1, 0));
        }
    }

    /// A dead-letter key of the wrong type stops no reaping: a task out of lease expiries
    /// stays leased, the key is named, and the other expired leases go back to the queue.
    /// (The failed HSET failed the script at that task, the first by score in every round
    /// after: no lease after it was returned any more.)
    #[test]
    fn a_wrong_typed_dead_key_stops_no_reaping() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("reapwrong").unwrap();
        redis::pipe()
            .zadd(k.lease(), "poison", 0)
            .hset(k.owner(), "poison", "c|1")
            .hset(k.tasks(), "poison", "{}")
            .hset(k.expired(), "poison", 1)
            .zadd(k.lease(), "fine", 1)
            .hset(k.owner(), "fine", "c|1")
            .hset(k.tasks(), "fine", "{}")
            .set(k.dead(), "not a hash")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(reap_reply(&mut conn, &k, 2), (1, 0, k.dead().to_string()));
        let (leased, queued): (Vec<String>, Vec<String>) = redis::pipe()
            .zrange(k.lease(), 0, -1)
            .zrange(k.due(), 0, -1)
            .query(&mut conn)
            .unwrap();
        assert_eq!(
            (leased, queued),
            (vec!["poison".into()], vec!["fine".into()])
        );
        // Once the key is fixed, the next round dead-letters it.
        redis::cmd("DEL")
            .arg(k.dead())
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(reap(&mut conn, &k, 2), (0, 1));
    }

    /// Redis's clock, in ms.
    fn redis_now(conn: &mut redis::Connection) -> i64 {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
        s * 1_000 + us / 1_000
    }

    /// A reaped task goes back at its own due time, as its envelope ends with it, not at
    /// Redis's now: every score in the queue is on the producers' clock, and a consumer fires
    /// a task at its score, so Redis's clock running ahead of the consumers' would delay it by
    /// the difference. A due time past Redis's now, or none readable, puts it back at now.
    #[test]
    fn a_reaped_task_goes_back_at_its_own_due_time() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("reap_due").unwrap();
        let now = redis_now(&mut conn);
        let envelope = |id: &str, due: i64| {
            // A payload that names a due time of its own, to be ignored.
            format!(
                r#"{{"id":"{id}","topic":"t","payload":{{"due_at":7}},"attempt":0,"created_at":0,"due_at":{due}}}"#
            )
        };
        let past = now - 3_600_000;
        let future = now + 3_600_000;
        // As the queue encodes it: the reaper reads `due_at` from the encoding's tail.
        let encoded = crate::redis::Envelope {
            id: "past".into(),
            topic: "t".into(),
            payload: serde_json::json!({"due_at": 7}),
            attempt: 0,
            created_at: 0,
            due_at: past as u64,
        }
        .encode(usize::MAX)
        .unwrap();
        redis::pipe()
            .zadd(k.due(), "past", past)
            .hset(k.tasks(), "past", encoded)
            .zadd(k.due(), "ahead", past)
            .hset(k.tasks(), "ahead", envelope("ahead", future))
            .zadd(k.due(), "foreign", past)
            .hset(k.tasks(), "foreign", r#"{"due_at":5,"id":"foreign"}"#)
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(claim(&mut conn, &k, 0).len(), 3);
        assert_eq!(reap(&mut conn, &k, 0), (3, 0));
        let after = redis_now(&mut conn);
        let score = |conn: &mut redis::Connection, id: &str| -> i64 {
            redis::cmd("ZSCORE")
                .arg(k.due())
                .arg(id)
                .query::<f64>(conn)
                .unwrap() as i64
        };
        assert_eq!(score(&mut conn, "past"), past, "not back at its due time");
        for id in ["ahead", "foreign"] {
            let s = score(&mut conn, id);
            assert!((now..=after).contains(&s), "{id} back at {s}, not now");
        }
    }

    /// Leases are set and expired on Redis's clock: the scripts take no time from the caller,
    /// so consumers whose clocks disagree cannot disagree on a lease (a reaper whose clock ran
    /// ahead used to take live leases, and the task fired twice).
    #[test]
    fn leases_run_on_redis_time() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("clock").unwrap();
        let now = redis_now(&mut conn);
        // Two tasks due an hour ago, one in an hour (a lease never ends before its due time).
        redis::pipe()
            .zadd(k.due(), "past", now - 3_600_000)
            .zadd(k.due(), "past2", now - 3_600_000)
            .zadd(k.due(), "future", now + 3_600_000)
            .hset(k.tasks(), "past", "{}")
            .hset(k.tasks(), "past2", "{}")
            .hset(k.tasks(), "future", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        let claimed = claim(&mut conn, &k, 60_000);
        assert_eq!(claimed.len(), 3, "{claimed:?}");
        let lease = |conn: &mut redis::Connection, id: &str| -> i64 {
            redis::cmd("ZSCORE")
                .arg(k.lease())
                .arg(id)
                .query::<f64>(conn)
                .unwrap() as i64
        };
        let after = redis_now(&mut conn);
        // max(due, Redis's now) + lease.
        assert!((now + 60_000..=after + 60_000).contains(&lease(&mut conn, "past")));
        assert_eq!(lease(&mut conn, "future"), now + 3_600_000 + 60_000);
        // Nothing has expired by Redis's clock: the reaper takes nothing.
        let reap = |conn: &mut redis::Connection| reap(conn, &k, 0).0;
        assert_eq!(reap(&mut conn), 0);
        // A lease renewed runs from Redis's now; one that ran out is reaped, due now.
        let (_, owner) = claimed.iter().find(|(id, _)| id == "past").unwrap();
        redis::cmd("ZADD")
            .arg(k.lease())
            .arg(now - 1)
            .arg("past2")
            .query::<()>(&mut conn)
            .unwrap();
        let renewed: u64 = RENEW
            .key(k.lease())
            .key(k.owner())
            .arg(120_000)
            .arg("past")
            .arg(owner)
            .invoke(&mut conn)
            .unwrap();
        assert_eq!(renewed, 1);
        let after = redis_now(&mut conn);
        assert!((now + 120_000..=after + 120_000).contains(&lease(&mut conn, "past")));
        assert_eq!(reap(&mut conn), 1);
        let due: f64 = redis::cmd("ZSCORE")
            .arg(k.due())
            .arg("past2")
            .query(&mut conn)
            .unwrap();
        assert!(
            (now..=redis_now(&mut conn)).contains(&(due as i64)),
            "due now, by Redis"
        );
    }
}
