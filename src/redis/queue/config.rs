//! The shared delay queue's settings ([`QueueConfig`], [`RetryPolicy`]), its shards
//! ([`shard_of`]) and its errors ([`QueueError`]). The producer side is in
//! [`producer`](super::producer), the consumer side in [`consumer`](super::consumer).
//!
//! A logical queue is split over `shards` key sets, each with its own hash tag
//! (`{ns}` for one shard, `{ns:0}`, `{ns:1}`, ... for more), chosen by a hash of the task id,
//! so on a Redis Cluster the backlog and the claim load spread over nodes.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::redis::envelope::{Envelope, EnvelopeError};
use crate::redis::layout::{KeyLayout, NamespaceError, NamespaceInUse};
use crate::redis::queue::limit::TopicLimit;
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::now_ms;

/// How long to wait before the next attempt of a failed task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Backoff {
    /// `attempt² × unit` after the `attempt`-th failure: 1 s, 4 s, 9 s, 16 s with the default
    /// unit of 1 s (design note 000).
    Quadratic {
        /// The unit (1 s in design note 000).
        unit: Duration,
    },
    /// `base × 2^(attempt − 1)`, at most `max`, then a random "equal jitter" in `[d/2, d]` so
    /// that failures of many tasks at once do not retry in lockstep.
    Exponential {
        /// The first delay.
        base: Duration,
        /// The largest delay.
        max: Duration,
    },
}

impl Backoff {
    /// The wait after the `attempt`-th failed delivery (1-based; 0 is taken as 1). Saturates
    /// rather than overflows for huge attempts or units.
    pub fn delay(&self, attempt: u32) -> Duration {
        let attempt = attempt.max(1);
        match *self {
            Backoff::Quadratic { unit } => unit.saturating_mul(attempt.saturating_mul(attempt)),
            Backoff::Exponential { base, max } => {
                let d = base
                    .saturating_mul(1u32.checked_shl(attempt - 1).unwrap_or(u32::MAX))
                    .min(max);
                let half = d / 2;
                half + Duration::from_nanos(fastrand::u64(0..=(d - half).as_nanos() as u64))
            }
        }
    }
}

/// Retries of a failed task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Deliveries in all, the first included (default 5). After the last one fails, the task
    /// goes to the dead-letter store.
    pub max_attempts: u32,
    /// The wait between attempts (default: quadratic, 1 s unit).
    pub backoff: Backoff,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            backoff: Backoff::Quadratic {
                unit: Duration::from_secs(1),
            },
        }
    }
}

/// The largest `batch` a queue accepts: one claim's reply holds that many envelopes.
const MAX_BATCH: usize = 100_000;

/// The largest reply a claim may build: `batch` envelopes of `max_envelope` bytes each.
const MAX_CLAIM_BYTES: usize = 256 << 20;

/// Settings of a queue, shared by its producers and consumers.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct QueueConfig {
    /// Redis URL (`redis://user:password@host/db`, `redis+unix:///path?user=..&pass=..`).
    pub url: String,
    /// Seed nodes of a Redis Cluster (`redis://host:port`); when given, commands go through a
    /// cluster connection (each shard's keys share one slot) and `url` is not used. Wake-ups
    /// are subscribed on one of these nodes (classic pub/sub reaches the whole cluster).
    pub cluster_nodes: Vec<String>,
    /// The queue's name; its keys are `{ns}:due`, `{ns}:tasks`, ... (one shard) or
    /// `{ns:i}:...` (several). Refused ([`QueueError::Namespace`]) if empty, with a brace, or
    /// ending in `:` and digits: those are a sharded queue's shard names, so `a:1` would share
    /// keys with shard 1 of a queue `a`.
    pub namespace: String,
    /// Shards of the logical queue (default 1, at most 16 384, the slots of a Redis Cluster; outside that,
    /// `QueueError::Config`). Producers and consumers must agree.
    pub shards: u32,
    /// The shards this consumer claims from (default: all).
    pub assigned_shards: Option<Vec<u32>>,
    /// A consumer claims the tasks due within this window ahead (default 2 s).
    pub lookahead: Duration,
    /// A consumer claims at least this often, notified or not (default 1 s): a lost
    /// notification delays a task by at most this much. At most `lookahead − claim_margin`.
    pub reconcile: Duration,
    /// A notified consumer claims this long before the task is due (default 20 ms).
    pub claim_margin: Duration,
    /// Tasks per claim (default 500; at most 100 000, and `batch × max_envelope` at most
    /// 256 MiB, the largest reply a claim may build in Redis's memory).
    pub batch: usize,
    /// Claimed tasks a consumer holds at most (default 100 000); it claims less beyond that.
    pub max_held: usize,
    /// A claimed task's lease runs until `max(due, now) + lease` (default 30 s; at least
    /// 1 ms, and counted in whole ms), unless renewed; past that the reaper hands it to
    /// another consumer.
    pub lease: Duration,
    /// Whether a consumer extends, every `lease / 3`, the leases of the tasks it is working
    /// on: due ones waiting for a handler thread, and those whose handler runs or whose
    /// outcome is not written yet (default true). A slow handler or a backlog then keeps its
    /// tasks for as long as this consumer lives and answers (but see `handler_stall`: once
    /// every handler thread is stuck, the tasks waiting are handed back); a consumer that crashes or
    /// stalls stops renewing, and its tasks fire elsewhere after the lease; a handler that
    /// never returns keeps its task for as long as its consumer lives. Off, a task whose
    /// handler has not finished by the end of its lease runs again elsewhere.
    pub renew_leases: bool,
    /// Acknowledgements are sent in batches at least this often (default 20 ms).
    pub ack_interval: Duration,
    /// How often each consumer reaps expired leases and samples the queue depth (default 1 s).
    pub reaper_interval: Duration,
    /// Retries of failed tasks.
    pub retry: RetryPolicy,
    /// A task whose lease runs out this many times (its consumer crashed or stalled each time
    /// while holding it, e.g. a task whose handler takes the process down) goes to the
    /// dead-letter store, with reason `lease expired N times: ...`, instead of back to the
    /// queue (default 3; 0: no limit). Counted in `{ns}:expired` until the task is
    /// acknowledged, dead-lettered, cancelled or stored again by `enqueue`; a hand-back that
    /// Redis took at a graceful shutdown, and a failed attempt's retry, do not count. Every
    /// expiry counts, whether the task had started or was still waiting in the crashed
    /// consumer (telling them apart would cost a Redis write per task): tasks claimed beside a
    /// poison task by consumers it keeps crashing can reach the limit with it (then
    /// [`Producer::requeue`](crate::redis::Producer::requeue) them). Raise it, or set 0, where consumers die for other
    /// reasons often.
    pub max_lease_expiries: u32,
    /// Threads running handlers per consumer (default 4; outside `1..=1024`,
    /// `QueueError::Config`).
    pub handler_threads: usize,
    /// When every handler thread has been running the same handler this long (none started
    /// another meanwhile), the consumer's handlers count as stalled: it hands every task it
    /// holds back to the queue at once, for other consumers to fire on time, and claims
    /// nothing until a thread is free again (default 10 s; at least 1 ms, or
    /// `QueueError::Config`; `Duration::MAX`: never). The handlers that are running keep
    /// their own tasks (renewed, with `renew_leases`, while they run). A hand-back is not a
    /// lease expiry: it does not count towards `max_lease_expiries`. Handlers that are slow
    /// by design (every thread often in a job longer than this) make the consumer hand its
    /// tasks back and claim them again each time: raise it above their longest run.
    pub handler_stall: Duration,
    /// How long a task that another client writes in two steps may stay half written
    /// (default 5 s; at most a day; zero: not at all, the first claim that finds a queued id
    /// with no envelope dead-letters it). A producer that sends `ZADD {ns}:due` and then
    /// `HSET {ns}:tasks` without MULTI leaves a queued id with no envelope between the two: a
    /// claim that finds one leaves it queued, claims the other tasks, and dead-letters it
    /// (reason `no envelope in the tasks hash`) only once this long has passed since a claim
    /// first saw it so. Likewise, a consumer's reaper removes an envelope that has no queue
    /// entry (written first, its `ZADD` not sent yet, or never) only once this long has passed
    /// since it first saw it alone. Counted on Redis's clock, from the first sighting, which
    /// `{ns}:unpaired` keeps (see the [key layout](crate::redis#key-layout)). The two writes of such
    /// a producer must land within this of each other; the queue's own writes are never half
    /// done. Long enough for the slowest such producer, short enough that a task that will
    /// never be whole is dead-lettered soon.
    pub unpaired_grace: Duration,
    /// Whether producers PUBLISH a wake-up for tasks due before the next reconcile
    /// (default true).
    pub notify: bool,
    /// The largest encoded envelope accepted (default 64 KiB; see `batch` for its limit).
    pub max_envelope: usize,
    /// A name for the consumer in leases and logs (default: host-pid-random).
    pub consumer_id: Option<String>,
    /// Rate limits and concurrency caps per topic, held across every consumer of the queue
    /// (default none; see [`TopicLimit`] and [`limit`](Self::limit)). A bad limit is
    /// [`QueueError::Config`] at start.
    pub limits: BTreeMap<String, TopicLimit>,
}

impl QueueConfig {
    /// Defaults for `url` and `namespace`.
    pub fn new(url: impl Into<String>, namespace: impl Into<String>) -> QueueConfig {
        QueueConfig {
            url: url.into(),
            cluster_nodes: Vec::new(),
            namespace: namespace.into(),
            shards: 1,
            assigned_shards: None,
            lookahead: Duration::from_secs(2),
            reconcile: Duration::from_secs(1),
            claim_margin: Duration::from_millis(20),
            batch: 500,
            max_held: 100_000,
            lease: Duration::from_secs(30),
            renew_leases: true,
            ack_interval: Duration::from_millis(20),
            reaper_interval: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            max_lease_expiries: 3,
            handler_threads: 4,
            handler_stall: Duration::from_secs(10),
            unpaired_grace: Duration::from_secs(5),
            notify: true,
            max_envelope: 64 * 1024,
            consumer_id: None,
            limits: BTreeMap::new(),
        }
    }

    /// Sets the limits of `topic`'s handlers (replacing any set before), as
    /// `limits.insert(topic, limit)`; see [`TopicLimit`].
    pub fn limit(mut self, topic: impl Into<String>, limit: TopicLimit) -> QueueConfig {
        self.limits.insert(topic.into(), limit);
        self
    }

    /// Checks the settings; the error names the first bad one.
    pub(crate) fn check(&self) -> Result<Vec<KeyLayout>, QueueError> {
        if let Some((_, suffix)) = self.namespace.rsplit_once(':') {
            if !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()) {
                return Err(QueueError::Namespace(NamespaceError(
                    self.namespace.clone(),
                )));
            }
        }
        if self.shards == 0 || self.shards > MAX_QUEUE_SHARDS {
            return Err(QueueError::Config("shards must be in 1..=16384"));
        }
        if self.batch == 0 || self.max_held == 0 || self.handler_threads == 0 {
            return Err(QueueError::Config(
                "batch, max_held and handler_threads must be at least 1",
            ));
        }
        if self.batch > MAX_BATCH {
            // Also: past 2^53 a claim's LIMIT, a Lua double, would not be an integer.
            return Err(QueueError::Config("batch must be at most 100000"));
        }
        if self.batch.saturating_mul(self.max_envelope) > MAX_CLAIM_BYTES {
            // A claim's reply is built in Redis's memory by one script.
            return Err(QueueError::Config(
                "batch × max_envelope must be at most 256 MiB (a claim's largest reply)",
            ));
        }
        if self.handler_threads > 1_024 {
            return Err(QueueError::Config("handler_threads must be at most 1024"));
        }
        if self.retry.max_attempts == 0 {
            return Err(QueueError::Config("retry.max_attempts must be at least 1"));
        }
        if self.reconcile.is_zero() || self.reaper_interval.is_zero() {
            return Err(QueueError::Config(
                "reconcile and reaper_interval must be positive",
            ));
        }
        if self.handler_stall < Duration::from_millis(1) {
            return Err(QueueError::Config("handler_stall must be at least 1 ms"));
        }
        // Leases are written in whole ms: a shorter one would end at the due time.
        if self.lease < Duration::from_millis(1) {
            return Err(QueueError::Config("lease must be at least 1 ms"));
        }
        let day = Duration::from_secs(86_400);
        if [
            self.lookahead,
            self.reconcile,
            self.claim_margin,
            self.lease,
            self.ack_interval,
            self.reaper_interval,
            self.unpaired_grace,
        ]
        .iter()
        .any(|d| *d > day)
        {
            // Beyond any sensible setting, and it keeps every sum of them far from overflow.
            return Err(QueueError::Config(
                "lookahead, reconcile, claim_margin, lease, ack_interval, reaper_interval and \
                 unpaired_grace must be at most a day",
            ));
        }
        if self.lookahead < self.reconcile + self.claim_margin {
            // Otherwise a task with no wake-up could fall between two claims' windows.
            return Err(QueueError::Config(
                "lookahead must be at least reconcile + claim_margin",
            ));
        }
        for limit in self.limits.values() {
            limit.check().map_err(QueueError::Config)?;
        }
        if let Some(a) = &self.assigned_shards {
            if a.is_empty() || a.iter().any(|&s| s >= self.shards) {
                return Err(QueueError::Config(
                    "assigned_shards must be non-empty and below shards",
                ));
            }
        }
        (0..self.shards)
            .map(|i| {
                let ns = if self.shards == 1 {
                    self.namespace.clone()
                } else {
                    format!("{}:{i}", self.namespace)
                };
                KeyLayout::new(&ns)
                    .map_err(|_| QueueError::Namespace(NamespaceError(self.namespace.clone())))
            })
            .collect()
    }

    /// Tasks due before this time (ms) get a wake-up: the consumers' next reconcile claim might
    /// come too late for them. 0 (never) when `notify` is off.
    pub(crate) fn notify_before(&self) -> u64 {
        if self.notify {
            now_ms() + (self.reconcile + self.claim_margin).as_millis() as u64
        } else {
            0
        }
    }

    /// What a wake-up for a task of `shard` appends to its due time: `:shard` on a sharded
    /// queue, so that only that shard's claim loops answer it, and nothing on a queue of one
    /// shard (a consumer also takes a bare due time as a wake-up for all its shards).
    pub(crate) fn wake_suffix(&self, shard: u32) -> String {
        if self.shards > 1 {
            format!(":{shard}")
        } else {
            String::new()
        }
    }

    /// The pub/sub channel of wake-ups.
    pub(crate) fn channel(&self) -> String {
        format!("{{{}}}:wake", self.namespace)
    }
}

/// The most shards a queue may have: as many as a Redis Cluster has slots.
const MAX_QUEUE_SHARDS: u32 = 16_384;

/// The shard of task `id` among `shards`: FNV-1a of the id, so every process, in any
/// language, agrees. `shards == 0` is taken as 1 (shard 0).
pub fn shard_of(id: &str, shards: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(shards.max(1))) as u32
}

/// Errors of the queue. Those that refuse a task hand the envelope back. Variants that wrap
/// another error say what failed in their `Display`, and return the wrapped error from
/// [`source`](std::error::Error::source) (print the chain to see both).
#[derive(Debug)]
#[non_exhaustive]
pub enum QueueError {
    /// The namespace cannot be a hash tag.
    Namespace(NamespaceError),
    /// A setting is out of range.
    Config(&'static str),
    /// Redis refused or failed.
    Store(StoreError),
    /// The envelope breaks a limit (size, due time, empty id).
    Envelope(EnvelopeError, Box<Envelope>),
    /// Redis refused or failed an enqueue: the envelope is handed back. The task may be queued
    /// all the same (a reply lost after the write). Enqueueing it again without `replace` is
    /// safe: it then returns `Ok(false)` if the first write landed. With `replace`, a copy a
    /// consumer claimed meanwhile would fire as well. On a Redis Cluster it also comes back
    /// while the shard's slot migrates to another node (`ASK` is not followed): enqueue again.
    NotEnqueued(StoreError, Box<Envelope>),
    /// A dead-lettered entry is not a task envelope, so it cannot be requeued.
    NotAnEnvelope(String),
    /// A dead-lettered task cannot be requeued: a task with the same id is pending.
    StillPending(String),
    /// The consumer could not start its threads.
    Spawn(String),
    /// The namespace (or one of its shards' key sets) is used by a
    /// [`Persistent`](crate::redis::Persistent) engine.
    InUse(NamespaceInUse),
    /// No queue has used this namespace (or shard key set, `ns:i`): its kind key is missing.
    /// From [`Producer::connect_existing`](crate::redis::Producer::connect_existing).
    UnknownNamespace(String),
    /// [`Producer::reschedule`](crate::redis::Producer::reschedule) was asked for a time past
    /// [`MAX_DUE_MS`](crate::redis::MAX_DUE_MS): the id and that time, handed back. Nothing
    /// changed.
    DueTooLate {
        /// The task id.
        id: String,
        /// The due time asked for, ms since the epoch.
        due: u64,
    },
}

impl fmt::Display for QueueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueueError::Namespace(_) => f.write_str("the namespace cannot be used"),
            QueueError::Config(e) => write!(f, "bad queue setting: {e}"),
            QueueError::Store(_) => f.write_str("redis refused or failed"),
            QueueError::Envelope(_, envelope) => {
                write!(f, "task {:?} refused: it breaks a limit", envelope.id)
            }
            QueueError::NotEnqueued(_, envelope) => {
                write!(f, "task {:?} not enqueued", envelope.id)
            }
            QueueError::NotAnEnvelope(id) => {
                write!(f, "dead-lettered entry {id} holds no task envelope")
            }
            QueueError::StillPending(id) => {
                write!(f, "task {id} is pending again; its dead letter stays")
            }
            QueueError::Spawn(e) => write!(f, "could not start the consumer: {e}"),
            QueueError::InUse(_) => f.write_str("the namespace is used by a persistent engine"),
            QueueError::UnknownNamespace(ns) => {
                write!(
                    f,
                    "no queue has used namespace {ns:?} (its kind key is missing)"
                )
            }
            QueueError::DueTooLate { id, due } => {
                write!(f, "task {id:?} cannot be due at {due} ms: past MAX_DUE_MS")
            }
        }
    }
}

impl std::error::Error for QueueError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            QueueError::Namespace(e) => Some(e),
            QueueError::Store(e) => Some(e),
            QueueError::Envelope(e, _) => Some(e),
            QueueError::NotEnqueued(e, _) => Some(e),
            QueueError::InUse(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for QueueError {
    fn from(e: redis::RedisError) -> Self {
        QueueError::Store(e.into())
    }
}
