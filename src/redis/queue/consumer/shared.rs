//! What the consumer's loops share: [`Shared`] (settings, counters, the timer's bookkeeping), the
//! handler table, the stats, and the messages between the loops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::redis::layout::KeyLayout;
use crate::redis::queue::config::QueueConfig;
use crate::redis::queue::conn::Conn;

pub(super) use super::claimed::Claimed;
use super::registry::Handlers;
use crate::redis::wall_clock::since_epoch;
use crate::TimerId;

/// Outcomes of fired tasks waiting for the resolver, at most.
pub(super) const OUTCOME_BOUND: usize = 65_536;

/// Counters and lateness of one consumer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueStats {
    /// Claim commands sent.
    pub claims: u64,
    /// Tasks claimed.
    pub claimed: u64,
    /// Tasks whose handler ran.
    pub fired: u64,
    /// Acks Redis accepted.
    pub acked: u64,
    /// Acks (and retries, dead-letterings) Redis refused: the lease had been taken over, or
    /// the task was cancelled or replaced by a producer meanwhile.
    pub refused: u64,
    /// Failed attempts put back for a retry.
    pub retried: u64,
    /// Tasks this consumer dead-lettered: out of attempts, or (by its reaper) out of lease
    /// expiries (`max_lease_expiries`).
    pub dead_lettered: u64,
    /// Expired leases this consumer's reaper returned to the queue.
    pub recovered: u64,
    /// Claimed tasks handed back: at shutdown, or while every handler thread was stuck (see
    /// [`QueueConfig::handler_stall`](crate::redis::QueueConfig::handler_stall)).
    pub given_back: u64,
    /// Leases extended because their task was still being worked on.
    pub renewed: u64,
    /// Redis commands sent (scripts count one each, pipelines one per command).
    pub commands: u64,
    /// Handler start − due time, in µs: median, 99th percentile and maximum.
    pub lateness_p50_us: u64,
    /// See `lateness_p50_us`.
    pub lateness_p99_us: u64,
    /// See `lateness_p50_us`.
    pub lateness_max_us: u64,
}

/// A claimed, unfired task: its timer, its owner value (`consumer|token`) and due time.
pub(super) type Held = (TimerId, Arc<str>, u64);

/// A claimed task to hand back to the queue: shard, id, owner and due time (ms).
pub(super) type HandBack = (u32, String, Arc<str>, u64);

/// What became of a fired task, for the resolver to write.
pub(super) enum Outcome {
    Ack {
        shard: u32,
        id: String,
        owner: Arc<str>,
        /// The task's unique window, ms (0: none): its id is refused by `enqueue_unique`
        /// for this long after the ack.
        unique_ms: u64,
    },
    Retry {
        shard: u32,
        id: String,
        owner: Arc<str>,
        envelope: Vec<u8>,
        due: u64,
    },
    Dead {
        shard: u32,
        id: String,
        /// The id as stored, when it is not UTF-8 (`id` is then its lossy reading).
        raw_id: Option<Vec<u8>>,
        owner: Arc<str>,
        record: String,
    },
}

impl Outcome {
    pub(super) fn shard(&self) -> u32 {
        match self {
            Outcome::Ack { shard, .. }
            | Outcome::Retry { shard, .. }
            | Outcome::Dead { shard, .. } => *shard,
        }
    }

    pub(super) fn id(&self) -> &str {
        match self {
            Outcome::Ack { id, .. } | Outcome::Retry { id, .. } | Outcome::Dead { id, .. } => id,
        }
    }

    pub(super) fn owner(&self) -> &Arc<str> {
        match self {
            Outcome::Ack { owner, .. }
            | Outcome::Retry { owner, .. }
            | Outcome::Dead { owner, .. } => owner,
        }
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) claims: AtomicU64,
    pub(super) claimed: AtomicU64,
    pub(super) fired: AtomicU64,
    pub(super) acked: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) recovered: AtomicU64,
    pub(super) given_back: AtomicU64,
    pub(super) renewed: AtomicU64,
}

/// The earliest due time (ms) wake-ups announced since a claim loop last looked, and the
/// signal that it changed: a flood of wake-ups coalesces into one value.
pub(super) struct Wake {
    pub(super) at: AtomicU64,
    pub(super) notify: tokio::sync::Notify,
}

pub(super) struct Shared {
    pub(super) cfg: QueueConfig,
    pub(super) id: String,
    /// Names this consumer's kept claims (`{ns}:batch:<this>`): its id and a random
    /// instance number, so that two consumers given the same id do not overwrite each other's.
    pub(super) batch_name: String,
    pub(super) shards: Vec<KeyLayout>,
    pub(super) claim_from: Vec<u32>,
    pub(super) conn: Conn,
    pub(super) handlers: Handlers,
    /// The metrics per topic, registered at start.
    pub(super) by_topic: super::topic_metrics::ByTopic,
    pub(super) held: Mutex<HashMap<(u32, String), Held>>,
    /// Fired tasks whose outcome is not written yet, by owner: their leases are renewed.
    pub(super) working: Mutex<HashMap<(u32, String), Arc<str>>>,
    /// To the resolver; bounded, and the resolver holds at most [`OUTCOME_BOUND`] more, so
    /// handlers wait (rather than memory grow) while Redis is slow to take their outcomes.
    pub(super) outcomes: mpsc::Sender<Outcome>,
    /// One per shard in `claim_from`, for its claim loop.
    pub(super) wakes: Vec<Wake>,
    /// Claim loops whose last claim failed: the first to fail logs the outage, not every shard.
    pub(super) failing: AtomicUsize,
    /// Room in `held` that claims in flight have reserved: claims on several shards run at
    /// once, and together stay within `max_held`.
    pub(super) reserved: AtomicUsize,
    pub(super) counters: Counters,
    pub(super) lateness: Mutex<Histogram<u64>>,
    /// Set by `abort`: fired tasks are dropped as a crashed process would drop them.
    pub(super) aborted: AtomicBool,
    /// Handler threads running a handler now, and when one last started (µs after `started`,
    /// on the monotonic clock, which a step of the wall clock does not move): all of them
    /// busy, none started for `handler_stall`, is a stall (see `stall_loop`).
    pub(super) busy: AtomicUsize,
    pub(super) last_start_us: AtomicU64,
    pub(super) started: std::time::Instant,
    /// Tasks the stall loop took out of `held` and has not yet handed back.
    pub(super) handing_back: Mutex<Vec<HandBack>>,
    /// The gates of the topics with limits (see [`super::gates`]).
    pub(super) limiter: super::gates::Limiter,
    /// The slots and the runtime of `async` handlers, when there are any.
    #[cfg(feature = "tokio")]
    pub(super) async_pool: Option<Arc<super::async_pool::AsyncPool<HandBack>>>,
}

pub(super) fn now_us() -> u64 {
    since_epoch().as_micros() as u64
}

/// Reports a key of the wrong type (another client wrote it) that keeps an entry (`id`, if
/// one) where it is: an error naming the key, and `delaywheel_queue_wrong_type_total` with
/// the key as its `key` label. The key is left as it is, for an operator to look at; the
/// other tasks go on.
pub(super) fn wrong_type(shard: u32, key: &str, id: Option<&str>) {
    tracing::error!(
        shard,
        key,
        id,
        "a queue key has the wrong type: what needs it is left as it is until the key is fixed"
    );
    metrics::counter!("delaywheel_queue_wrong_type_total", "key" => key.to_owned()).increment(1);
}

/// Tasks per script call when a consumer writes about many at once (hand-back, renewal).
pub(super) const PER_CALL: usize = 500;

/// The least time a hand-back call at shutdown is given, even past the deadline: handing tasks
/// back at once spares them a lease's wait.
pub(super) const GIVE_BACK_FLOOR: Duration = Duration::from_millis(100);

/// The time left until `deadline` (zero once it has passed).
pub(super) fn remaining(deadline: std::time::Instant) -> Duration {
    deadline.saturating_duration_since(std::time::Instant::now())
}

/// `(shard, task)` pairs grouped by shard: every script touches the keys of one shard.
pub(super) fn by_shard<T>(tasks: impl IntoIterator<Item = (u32, T)>) -> HashMap<u32, Vec<T>> {
    let mut grouped: HashMap<u32, Vec<T>> = HashMap::new();
    for (shard, task) in tasks {
        grouped.entry(shard).or_default().push(task);
    }
    grouped
}
