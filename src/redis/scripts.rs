//! The Lua scripts of the shared delay queue. Each runs atomically on the shard's keys, which
//! share one hash tag, so they are valid on a Redis Cluster.
//!
//! Keys of a shard (see [`KeyLayout`](super::KeyLayout)): `due` (ZSET id → due ms, queued),
//! `tasks` (HASH id → envelope), `lease` (ZSET id → lease deadline ms, claimed), `owner` (HASH
//! id → `consumer|token`), `fence` (counter of claim tokens), `dead` (HASH id → record).
//!
//! Fencing: a claim takes a fresh token and writes `consumer|token` as the owner of each task
//! it takes. Every later change by that consumer (ack, retry, dead-letter, give back) first
//! checks that the owner is still exactly that value, so a consumer whose lease expired and was
//! taken over cannot change the task under the new owner.

use std::sync::LazyLock;

use redis::Script;

/// KEYS: due, tasks, lease, owner. ARGV: id, due, envelope, replace (0/1), channel, notify
/// before (ms; 0 = never), message. Returns 1 if stored, 0 if the id was pending and replace
/// was not asked for.
pub(crate) static ENQUEUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  if ARGV[4] == '0' then return 0 end
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if tonumber(ARGV[2]) < tonumber(ARGV[6]) then
  redis.call('PUBLISH', ARGV[5], ARGV[7])
end
return 1
",
    )
});

/// KEYS: due, tasks, lease, owner. ARGV: id. Returns 1 if the task was queued or leased.
pub(crate) static CANCEL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return n
",
    )
});

/// KEYS: due, tasks, lease, owner, fence. ARGV: until (ms), batch, consumer, lease (ms), now
/// (ms). Takes up to `batch` tasks due by `until`, leases them to `consumer|token` until
/// max(due, now) + lease, and returns `token, id1, due1, envelope1, id2, ...` (an empty
/// envelope when the HASH has none), or an empty array.
pub(crate) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return {} end
local token = redis.call('INCR', KEYS[5])
local owner = ARGV[3] .. '|' .. token
local now, lease = tonumber(ARGV[5]), tonumber(ARGV[4])
local out = {tostring(token)}
for i = 1, #ids, 2 do
  local id, due = ids[i], tonumber(ids[i + 1])
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZADD', KEYS[3], math.max(due, now) + lease, id)
  redis.call('HSET', KEYS[4], id, owner)
  out[#out + 1] = id
  out[#out + 1] = ids[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
end
return out
",
    )
});

/// KEYS: lease, owner. ARGV: until (ms), then id1, owner1, id2, owner2, ... Extends to
/// `until` the lease of each task whose owner still matches (never shortens one). Returns how
/// many it extended.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local to, n = tonumber(ARGV[1]), 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    local lease = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if lease and tonumber(lease) < to then
      redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
      n = n + 1
    end
  end
end
return n
",
    )
});

/// KEYS: lease, owner, tasks. ARGV: id1, owner1, id2, owner2, ... Removes each task whose
/// owner still matches; returns 1 or 0 per task (0: refused, the lease was taken over).
pub(crate) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
",
    )
});

/// KEYS: lease, owner, tasks, due. ARGV: id, owner, new envelope, next due (ms), channel,
/// notify before (ms). Puts a failed task back in the queue for its next attempt, if the owner
/// still matches, and wakes the consumers if it is due soon.
pub(crate) static RETRY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
if tonumber(ARGV[4]) < tonumber(ARGV[6]) then redis.call('PUBLISH', ARGV[5], ARGV[4]) end
return 1
",
    )
});

/// KEYS: lease, owner, tasks, dead. ARGV: id, owner, record. Moves a task to the dead-letter
/// HASH, if the owner still matches.
pub(crate) static DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return 1
",
    )
});

/// KEYS: lease, owner, due. ARGV: channel, notify before (ms), then id1, owner1, due1, ...
/// Hands claimed, unfired tasks back to the queue at their due time (graceful shutdown) and
/// wakes the other consumers for the earliest. Returns how many were handed back.
pub(crate) static GIVE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n, first = 0, nil
for i = 3, #ARGV, 3 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('ZADD', KEYS[3], ARGV[i + 2], ARGV[i])
    local due = tonumber(ARGV[i + 2])
    if first == nil or due < first then first = due end
    n = n + 1
  end
end
if first ~= nil and first < tonumber(ARGV[2]) then redis.call('PUBLISH', ARGV[1], tostring(first)) end
return n
",
    )
});

/// KEYS: lease, owner, due. ARGV: now (ms), batch, channel. Returns tasks whose lease expired
/// (their consumer died or stalled) to the queue, due now, and wakes the consumers. Returns
/// how many.
pub(crate) static REAP: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZADD', KEYS[3], ARGV[1], id)
end
if #ids > 0 then redis.call('PUBLISH', ARGV[3], ARGV[1]) end
return #ids
",
    )
});

/// KEYS: dead, tasks, due. ARGV: id, envelope, due (ms), channel, the dead record as read.
/// Moves a dead-lettered task back to the queue with a fresh envelope and wakes the consumers.
/// Returns 0 if the dead-letter HASH no longer holds that record for the id (gone, or
/// dead-lettered again since it was read), -1 (and changes nothing) if a task with that id is
/// pending again.
pub(crate) static REQUEUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[5] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return -1 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('PUBLISH', ARGV[4], ARGV[3])
return 1
",
    )
});
