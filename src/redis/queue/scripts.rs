//! The Lua scripts of the shared delay queue, each in a file of its own under `lua/` (loaded with
//! `include_str!`, runnable by hand with `redis-cli --eval`), whose header comment gives its keys,
//! its arguments and its reply. Each runs atomically on the shard's keys, which
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

use redis::Script;

/// `lua/enqueue.lua`: its header gives its keys, arguments and reply. The text is public for
/// producers in other languages ([`Producer::ENQUEUE_SCRIPT`](crate::redis::Producer::ENQUEUE_SCRIPT)).
pub(crate) const ENQUEUE_LUA: &str = include_str!("lua/enqueue.lua");

/// [`ENQUEUE_LUA`], loaded.
pub(crate) static ENQUEUE: LazyLock<Script> = LazyLock::new(|| Script::new(ENQUEUE_LUA));

/// `lua/enqueue_many.lua`: its header gives its keys, arguments and reply.
pub(crate) static ENQUEUE_MANY: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/enqueue_many.lua")));

/// `lua/cancel.lua`: its header gives its keys, arguments and reply.
pub(crate) static CANCEL: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/cancel.lua")));

/// `lua/claim.lua`: its header gives its keys, arguments and reply.
pub(crate) static CLAIM: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/claim.lua")));

/// `lua/renew.lua`: its header gives its keys, arguments and reply.
pub(crate) static RENEW: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/renew.lua")));

/// `lua/ack.lua`: its header gives its keys, arguments and reply.
pub(crate) static ACK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/ack.lua")));

/// `lua/retry.lua`: its header gives its keys, arguments and reply.
pub(crate) static RETRY: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/retry.lua")));

/// `lua/dead.lua`: its header gives its keys, arguments and reply.
pub(crate) static DEAD: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/dead.lua")));

/// `lua/give_back.lua`: its header gives its keys, arguments and reply.
pub(crate) static GIVE_BACK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/give_back.lua")));

/// `lua/reap.lua`: its header gives its keys, arguments and reply.
pub(crate) static REAP: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/reap.lua")));

/// `lua/requeue.lua`: its header gives its keys, arguments and reply.
pub(crate) static REQUEUE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/requeue.lua")));

/// `lua/sweep.lua`: its header gives its keys, arguments and reply.
pub(crate) static SWEEP: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/sweep.lua")));

/// `lua/inspect.lua`: its header gives its keys, arguments and reply.
pub(crate) static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/inspect.lua")));

/// `lua/inspect_page.lua`: its header gives its keys, arguments and reply.
pub(crate) static INSPECT_PAGE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/inspect_page.lua")));

/// `lua/reschedule.lua`: its header gives its keys, arguments and reply.
pub(crate) static RESCHEDULE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/reschedule.lua")));

/// `lua/periodic_enqueue.lua`: its header gives its keys, arguments and reply.
#[cfg(feature = "periodic")]
pub(crate) static PERIODIC_ENQUEUE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/periodic_enqueue.lua")));

/// `lua/periodic_advance.lua`: its header gives its keys, arguments and reply.
#[cfg(feature = "periodic")]
pub(crate) static PERIODIC_ADVANCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/periodic_advance.lua")));

/// `lua/topic_counts.lua`: its header gives its keys, arguments and reply.
pub(crate) static TOPIC_COUNTS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/topic_counts.lua")));

/// `lua/resume.lua`: its header gives its keys, arguments and reply.
pub(crate) static RESUME: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/resume.lua")));

/// `lua/rate_slots.lua`: its header gives its keys, arguments and reply.
pub(crate) static RATE_SLOTS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/rate_slots.lua")));

/// `lua/slots_take.lua`: its header gives its keys, arguments and reply.
pub(crate) static SLOTS_TAKE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/slots_take.lua")));

/// `lua/slots_renew.lua`: its header gives its keys, arguments and reply.
pub(crate) static SLOTS_RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/slots_renew.lua")));

/// Every script the consumers and producers call on the hot path, for loading them all ahead
/// of their first calls (the inspection and pause scripts load on first use).
pub(crate) static ALL: [&LazyLock<Script>; 12] = [
    &ENQUEUE,
    &ENQUEUE_MANY,
    &CANCEL,
    &CLAIM,
    &RENEW,
    &ACK,
    &RETRY,
    &DEAD,
    &GIVE_BACK,
    &REAP,
    &REQUEUE,
    &SWEEP,
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

    /// Queues each of `ids` due at 0 (so due now), with the envelope `{}`.
    fn queue_due_now(conn: &mut redis::Connection, k: &KeyLayout, ids: &[&str]) {
        for id in ids {
            redis::pipe()
                .zadd(k.due(), *id, 0)
                .hset(k.tasks(), *id, "{}")
                .query::<()>(conn)
                .unwrap();
        }
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
            .key(k.paused())
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

    /// An ack call of several runs (a header per run of tasks sharing an owner) answers each
    /// task in the order given, whichever run it is in, and removes what it acknowledged.
    #[test]
    fn an_ack_of_several_runs_answers_each_task_in_order() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("runs").unwrap();
        queue_due_now(&mut conn, &k, &["t1", "t2"]);
        let first = claim(&mut conn, &k, 60_000);
        queue_due_now(&mut conn, &k, &["t3", "t4"]);
        let second = claim(&mut conn, &k, 60_000);
        let (a, b) = (first[0].1.clone(), second[0].1.clone());
        assert_ne!(a, b, "two claims, two owners");
        let answers: Vec<u8> = ACK
            .key(k.lease())
            .key(k.owner())
            .key(k.tasks())
            .key(k.expired())
            .key(k.dead())
            .arg(&a)
            .arg(0)
            .arg(0)
            .arg(1)
            .arg("t1")
            .arg(&b)
            .arg(0)
            .arg(0)
            .arg(2)
            .arg("t3")
            .arg("t4")
            .arg(&a)
            .arg(0)
            .arg(0)
            .arg(1)
            .arg("t2")
            .arg("c|999999")
            .arg(0)
            .arg(0)
            .arg(1)
            .arg("t1")
            .invoke(&mut conn)
            .unwrap();
        assert_eq!(answers, [1, 1, 1, 1, 0]);
        let (leased, owned, stored): (usize, usize, usize) = redis::pipe()
            .zcard(k.lease())
            .hlen(k.owner())
            .hlen(k.tasks())
            .query(&mut conn)
            .unwrap();
        assert_eq!((leased, owned, stored), (0, 0, 0));
    }

    /// An ack, retry or dead-lettering sent again after its reply was lost answers 2 (it
    /// landed), not 0, which the consumer counts as a takeover; a late ack not sent again,
    /// and one whose lease ran out and whose task is queued again, still answer 0.
    #[test]
    fn an_outcome_sent_again_reads_as_landed_not_refused() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("resent").unwrap();
        queue_due_now(&mut conn, &k, &["a", "r", "d", "late"]);
        let claimed: std::collections::HashMap<String, String> =
            claim(&mut conn, &k, 60_000).into_iter().collect();
        assert_eq!(claimed.len(), 4);
        let ack = |conn: &mut redis::Connection, id: &str, again: bool| -> Vec<u8> {
            ACK.key(k.lease())
                .key(k.owner())
                .key(k.tasks())
                .key(k.expired())
                .key(k.dead())
                .arg(&claimed[id])
                .arg(u8::from(again))
                .arg(0)
                .arg(1)
                .arg(id)
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
    /// A paused shard leases nothing and says so, while a claim retried by its nonce is still
    /// answered (its tasks were leased before the pause); lifting the pause claims again.
    #[test]
    fn a_paused_shard_leases_nothing_but_answers_a_retried_claim() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("paused").unwrap();
        let envelope = |id: &str| {
            format!(
                r#"{{"id":"{id}","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":0}}"#
            )
        };
        for id in ["a", "b"] {
            redis::pipe()
                .zadd(k.due(), id, 0)
                .hset(k.tasks(), id, envelope(id))
                .query::<()>(&mut conn)
                .unwrap();
        }
        let first = claim_with_nonce(&mut conn, &k, 60_000, 1, "kept").unwrap();
        assert_eq!(first.len(), 4, "{first:?}");
        redis::cmd("SET")
            .arg(k.paused())
            .arg("by test")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(
            claim_reply(&mut conn, &k, 60_000),
            vec!["paused".to_string()]
        );
        let queued: u64 = redis::cmd("ZCARD").arg(k.due()).query(&mut conn).unwrap();
        assert_eq!(queued, 1, "a paused claim leased");
        let again = claim_with_nonce(&mut conn, &k, 60_000, 1, "kept").unwrap();
        assert_eq!(
            again, first,
            "a retried claim was not answered while paused"
        );
        redis::cmd("DEL")
            .arg(k.paused())
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(claim_reply(&mut conn, &k, 60_000).len(), 4);
    }

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
        // 0.5 to 1.5 s out, whatever the millisecond now: `s * 1_000 + 500` was in the past
        // half the time, and the batch then expired a lease from now (59 999 ms), not after.
        let soon: u64 = redis::cmd("TIME")
            .query::<(u64, u64)>(&mut conn)
            .map(|(s, _)| s * 1_000 + 1_500)
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
            .arg(&fine.1)
            .arg(0)
            .arg(0)
            .arg(1)
            .arg(&fine.0)
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
            headers: Default::default(),
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

    /// A replaced task that was leased loses its lease only once its new place is written: an
    /// `enqueue_many` that fails part way (here on a due that is not a number) leaves it
    /// leased to its consumer, not in no queue at all.
    #[test]
    fn an_enqueue_many_that_fails_part_way_leaves_a_replaced_task_leased() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("replace-fail").unwrap();
        queue_due_now(&mut conn, &k, &["x"]);
        let held = claim(&mut conn, &k, 60_000);
        assert_eq!(held.len(), 1);
        let failed: redis::RedisResult<Vec<u8>> = ENQUEUE_MANY
            .key(k.due())
            .key(k.tasks())
            .key(k.lease())
            .key(k.owner())
            .key(k.expired())
            .arg(1)
            .arg("chan")
            .arg(0)
            .arg("")
            .arg("x")
            .arg(1_000)
            .arg("{\"v\":2}")
            .arg("y")
            .arg("soon")
            .arg("{}")
            .invoke(&mut conn);
        assert!(failed.is_err(), "a due that is not a number fails the call");
        let (lease, owner, envelope, y): (Option<f64>, Option<String>, Option<String>, bool) =
            redis::pipe()
                .zscore(k.lease(), "x")
                .hget(k.owner(), "x")
                .hget(k.tasks(), "x")
                .hexists(k.tasks(), "y")
                .query(&mut conn)
                .unwrap();
        assert!(lease.is_some(), "x keeps its lease");
        assert_eq!(owner.as_deref(), Some(held[0].1.as_str()));
        assert_eq!(envelope.as_deref(), Some("{}"), "and its envelope");
        assert!(!y, "nothing of the call written");
    }

    /// CANCEL answers 1 for a task queued or leased, whether or not its envelope is there
    /// yet, and 0 for an envelope alone (which it removes all the same) or nothing.
    #[test]
    fn a_cancel_answers_whether_a_task_was_queued_or_leased() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("cancel-answer").unwrap();
        queue_due_now(&mut conn, &k, &["leased"]);
        assert_eq!(claim(&mut conn, &k, 60_000).len(), 1);
        redis::pipe()
            .zadd(k.due(), "queued", i64::MAX / 2)
            .hset(k.tasks(), "queued", "{}")
            .zadd(k.due(), "no-envelope", i64::MAX / 2)
            .hset(k.tasks(), "envelope-alone", "{}")
            .query::<()>(&mut conn)
            .unwrap();
        let mut cancel = |id: &str| -> u64 {
            CANCEL
                .key(k.due())
                .key(k.tasks())
                .key(k.lease())
                .key(k.owner())
                .key(k.expired())
                .arg(id)
                .invoke(&mut conn)
                .unwrap()
        };
        assert_eq!(cancel("leased"), 1);
        assert_eq!(cancel("queued"), 1);
        assert_eq!(cancel("no-envelope"), 1);
        assert_eq!(cancel("envelope-alone"), 0);
        assert_eq!(cancel("never"), 0);
        assert_eq!(cancel("queued"), 0, "gone after the first cancel");
        let left: (u64, u64, u64, u64) = redis::pipe()
            .zcard(k.due())
            .hlen(k.tasks())
            .zcard(k.lease())
            .hlen(k.owner())
            .query(&mut conn)
            .unwrap();
        assert_eq!(left, (0, 0, 0, 0), "every key cleared");
    }

    /// A unique window Redis refuses as an expiry (written by another client) sets no marker
    /// and fails no ack: the ack used to fail, with every other ack in its call, each time the
    /// consumer sent it again.
    #[test]
    fn an_ack_with_a_window_redis_refuses_still_removes_its_tasks() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("bad-window").unwrap();
        queue_due_now(&mut conn, &k, &["t1", "t2"]);
        let held = claim(&mut conn, &k, 60_000);
        assert_eq!(held.len(), 2);
        let owner = &held[0].1;
        let answers: Vec<u8> = ACK
            .key(k.lease())
            .key(k.owner())
            .key(k.tasks())
            .key(k.expired())
            .key(k.dead())
            .key(k.unique_marker("t1"))
            .key(k.unique_marker("t2"))
            .arg(owner)
            .arg(0)
            .arg(u64::MAX)
            .arg(1)
            .arg("t1")
            .arg(owner)
            .arg(0)
            .arg(60_000)
            .arg(1)
            .arg("t2")
            .invoke(&mut conn)
            .unwrap();
        assert_eq!(answers, [1, 1]);
        let (stored, bad, good): (usize, bool, bool) = redis::pipe()
            .hlen(k.tasks())
            .exists(k.unique_marker("t1"))
            .exists(k.unique_marker("t2"))
            .query(&mut conn)
            .unwrap();
        assert_eq!((stored, bad, good), (0, false, true));
    }

    /// A round that read a schedule before its removal records nothing after it: the removal
    /// deletes the schedule's last occurrence too, and a record brought back would make the
    /// schedule, added again later, go on from there.
    #[cfg(feature = "periodic")]
    #[test]
    fn a_removed_schedule_is_not_recorded_again() {
        let (_server, mut conn) = redis();
        let k = KeyLayout::new("periodic-gone").unwrap();
        let advance = |conn: &mut redis::Connection, at: u64| -> String {
            PERIODIC_ADVANCE
                .key(k.periodic_last())
                .key(k.periodic())
                .arg("p")
                .arg(at)
                .invoke(conn)
                .unwrap()
        };
        redis::cmd("HSET")
            .arg(k.periodic())
            .arg("p")
            .arg("{}")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(advance(&mut conn, 100), "100");
        assert_eq!(advance(&mut conn, 50), "100", "never moved back");
        redis::pipe()
            .hdel(k.periodic(), "p")
            .hdel(k.periodic_last(), "p")
            .query::<()>(&mut conn)
            .unwrap();
        assert_eq!(advance(&mut conn, 200), "");
        let last: Option<String> = redis::cmd("HGET")
            .arg(k.periodic_last())
            .arg("p")
            .query(&mut conn)
            .unwrap();
        assert_eq!(last, None);
    }
}
