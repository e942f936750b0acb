//! The shared delay queue: its settings, its shards, and the producer side (enqueue, cancel,
//! the dead-letter store). The consumer side is in [`consumer`](crate::redis::Consumer).
//!
//! A logical queue is split over `shards` key sets, each with its own hash tag
//! (`{ns}` for one shard, `{ns:0}`, `{ns:1}`, ... for more), chosen by a hash of the task id,
//! so on a Redis Cluster the backlog and the claim load spread over nodes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::redis::envelope::{Envelope, EnvelopeError};
use crate::redis::layout::{KeyLayout, NamespaceError, NamespaceInUse};
use crate::redis::link::{claim_namespaces, Link, QUEUE_ROLE};
use crate::redis::payload::IntoPayload;
use crate::redis::queue::scripts;
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::{now_ms, WallClock};
use crate::redis::when::When;

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
    /// [`Producer::requeue`] them). Raise it, or set 0, where consumers die for other
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
        }
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

/// A dead-lettered task, as [`Producer::dead_letters`] lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadTask {
    /// The task id.
    pub id: String,
    /// Why it died: the last handler error, `unknown topic: ...`, `undecodable envelope`, ...
    pub reason: String,
    /// When, ms since the Unix epoch.
    pub at: u64,
    /// Deliveries tried.
    pub attempt: u32,
    /// The stored envelope as found (possibly not valid JSON).
    pub raw: String,
}

/// How long connecting waits for the scripts to load on every node.
const PRELOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Redis connection shared by the producer and consumer sides, counting the commands it sends.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) conn: Link,
    pub(crate) commands: Arc<AtomicU64>,
}

impl Conn {
    /// Connects to `cfg.cluster_nodes` as a cluster when there are any, else to `cfg.url`,
    /// loads the scripts, and claims the key sets of `shards` for the queue: one a
    /// [`Persistent`](crate::redis::Persistent) engine uses is refused with [`QueueError::InUse`].
    pub(crate) async fn open(cfg: &QueueConfig, shards: &[KeyLayout]) -> Result<Conn, QueueError> {
        let conn = Conn {
            conn: Link::open(&cfg.url, &cfg.cluster_nodes).await?,
            commands: Arc::new(AtomicU64::new(0)),
        };
        conn.preload().await;
        conn.count(shards.len() as u64);
        claim_namespaces(&conn.conn, shards, QUEUE_ROLE)
            .await
            .map_err(QueueError::InUse)?;
        Ok(conn)
    }

    /// Loads every queue script on every node now, while they answer. Otherwise a script's
    /// first call loads it, on all nodes at once (a cluster sends SCRIPT LOAD to every node),
    /// and waits for any node that does not answer, also when the call is for another node's
    /// shard: a consumer's first hand-back at shutdown, say, would wait on a hung node for
    /// every shard. A failure is only logged: a script not loaded here loads on its first call.
    async fn preload(&self) {
        let loads = scripts::ALL.iter().map(|script| {
            let mut conn = self.conn.clone();
            async move { script.load_async(&mut conn).await }
        });
        self.count(scripts::ALL.len() as u64);
        // Not for long: a node that does not answer must not hold up the start.
        let loaded =
            tokio::time::timeout(PRELOAD_TIMEOUT, futures_util::future::join_all(loads)).await;
        let failed = match loaded {
            Ok(results) => results
                .into_iter()
                .find_map(Result::err)
                .map(|e| e.to_string()),
            Err(_) => Some(format!("no answer within {PRELOAD_TIMEOUT:?}")),
        };
        if let Some(e) = failed {
            tracing::warn!(error = %e, "could not load the queue's scripts ahead; each loads on its first call");
        }
    }

    /// Counts `n` commands about to be sent, in `commands` and in the metric.
    pub(crate) fn count(&self, n: u64) {
        self.commands.fetch_add(n, Relaxed);
        metrics::counter!("delaywheel_queue_redis_commands_total").increment(n);
    }

    /// Runs a script invocation (one command on the wire; EVALSHA, with a reload after a
    /// server restart dropped the script cache).
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, redis::RedisError> {
        self.count(1);
        let mut conn = self.conn.clone();
        inv.invoke_async(&mut conn).await
    }
}

/// Enqueues and cancels tasks, and manages the dead-letter store. Cheap to clone.
#[derive(Clone)]
pub struct Producer {
    cfg: Arc<QueueConfig>,
    shards: Arc<Vec<KeyLayout>>,
    conn: Conn,
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("namespace", &self.cfg.namespace)
            .field("shards", &self.cfg.shards)
            .finish()
    }
}

impl Producer {
    /// The Lua text of the script [`enqueue`](Self::enqueue) runs, for producers in other
    /// languages: load it (`SCRIPT LOAD`) and call it with `EVALSHA`, or send it with `EVAL`.
    /// See the [key layout](crate::redis#producers-in-other-languages) for its keys and arguments.
    pub const ENQUEUE_SCRIPT: &'static str = scripts::ENQUEUE_LUA;

    /// Connects. Errors: a bad setting or namespace, a namespace a `Persistent` engine uses
    /// ([`QueueError::InUse`]), an unreachable Redis, or a call outside a Tokio runtime or
    /// on one without its time or I/O driver (`enable_all` enables both).
    pub async fn connect(cfg: QueueConfig) -> Result<Producer, QueueError> {
        let shards = cfg.check()?;
        let conn = Conn::open(&cfg, &shards).await?;
        Ok(Producer {
            cfg: Arc::new(cfg),
            shards: Arc::new(shards),
            conn,
        })
    }

    fn keys(&self, id: &str) -> &KeyLayout {
        &self.shards[shard_of(id, self.cfg.shards) as usize]
    }

    /// Enqueues task `id` for `topic` at `when` (a [`When`], a `Duration` from now, or a
    /// `SystemTime`). The payload is a reference to any `Serialize` type, or a
    /// `serde_json::Value` (see [`IntoPayload`]); a handler reads it back with
    /// [`Envelope::payload_as`] or [`Handlers::on_typed`](crate::redis::Handlers::on_typed).
    /// Idempotent by id: if `id` is already queued
    /// (or claimed), nothing changes and `Ok(false)` is returned. An envelope stored under
    /// `id` with no queue entry (another client's, half written or left behind) does not
    /// count: it is written over. Errors hand the envelope back (a payload that does not
    /// serialize: [`EnvelopeError::Encode`], the envelope's payload `null`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig};
    ///
    /// #[derive(serde::Serialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-enqueue")).await?;
    /// # producer.cancel("order:42").await?;
    /// let close = CloseOrder { order_id: 42 };
    /// assert!(producer.enqueue("order:42", "order.close", &close, Duration::from_secs(30 * 60)).await?);
    /// // The same id again changes nothing.
    /// assert!(!producer.enqueue("order:42", "order.close", &close, Duration::from_secs(60)).await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue(
        &self,
        id: impl Into<String>,
        topic: impl Into<std::borrow::Cow<'static, str>>,
        payload: impl IntoPayload,
        when: impl Into<When>,
    ) -> Result<bool, QueueError> {
        let (payload, encode_error) = match payload.into_payload() {
            Ok(v) => (v, None),
            Err(e) => (serde_json::Value::Null, Some(e)),
        };
        let envelope = Envelope {
            id: id.into(),
            topic: topic.into(),
            payload,
            attempt: 0,
            created_at: now_ms(),
            due_at: when.into().due_ms(&WallClock::system()),
        };
        if let Some(e) = encode_error {
            let e = EnvelopeError::Encode(e.to_string());
            return Err(QueueError::Envelope(e, Box::new(envelope)));
        }
        self.enqueue_envelope(envelope, false).await
    }

    /// Enqueues a complete envelope. With `replace`, a pending task of the same id is replaced
    /// (a consumer that had claimed it can no longer ack it); without, it is kept and
    /// `Ok(false)` is returned. Errors hand the envelope back: [`QueueError::Envelope`] for one
    /// that breaks a limit, [`QueueError::NotEnqueued`] when Redis fails.
    pub async fn enqueue_envelope(
        &self,
        envelope: Envelope,
        replace: bool,
    ) -> Result<bool, QueueError> {
        let bytes = match envelope.encode(self.cfg.max_envelope) {
            Ok(b) => b,
            Err(e) => return Err(QueueError::Envelope(e, Box::new(envelope))),
        };
        let shard = shard_of(&envelope.id, self.cfg.shards);
        let keys = &self.shards[shard as usize];
        let notify_before = self.cfg.notify_before();
        let wake = format!("{}{}", envelope.due_at, self.cfg.wake_suffix(shard));
        let mut inv = scripts::ENQUEUE.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .arg(envelope.id.as_str())
            .arg(envelope.due_at)
            .arg(bytes)
            .arg(u8::from(replace))
            .arg(self.cfg.channel())
            .arg(notify_before)
            .arg(wake);
        match self.conn.run::<i64>(&inv).await {
            Ok(n) => Ok(n == 1),
            Err(e) => Err(QueueError::NotEnqueued(e.into(), Box::new(envelope))),
        }
    }

    /// Enqueues many envelopes at once: one script call per shard and up to
    /// [`ENQUEUE_BATCH`](Self::ENQUEUE_BATCH) tasks, the calls sent together, and one
    /// wake-up per call instead of one per task. At high rates this is a fraction of the
    /// Redis work of as many [`enqueue_envelope`](Self::enqueue_envelope) calls.
    ///
    /// Returns one result per envelope, in the order given, each what
    /// [`enqueue_envelope`](Self::enqueue_envelope) would return for it: `Ok(true)` stored,
    /// `Ok(false)` its id was pending (without `replace`), [`QueueError::Envelope`] for one that
    /// breaks a limit (the others go on), [`QueueError::NotEnqueued`] for each task of a call
    /// Redis failed (each handed back; the call's tasks may be stored all the same if only the
    /// reply was lost, and enqueueing them again without `replace` is harmless). An id given
    /// twice is stored once; the second copy finds it pending (or replaces it).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use delaywheel::redis::{now_ms, Envelope, Producer, QueueConfig};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-enqueue-many")).await?;
    /// let due = now_ms() + 30 * 60 * 1_000;
    /// let tasks = (0..1_000).map(|i| Envelope {
    ///     id: format!("order:{i}"),
    ///     topic: "order.close".into(),
    ///     payload: serde_json::json!({ "order_id": i }),
    ///     attempt: 0,
    ///     created_at: now_ms(),
    ///     due_at: due,
    /// });
    /// let results = producer.enqueue_many(tasks, false).await;
    /// # for r in &results { if let Err(e) = r { panic!("{e:?}"); } }
    /// assert_eq!(results.len(), 1_000);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue_many(
        &self,
        envelopes: impl IntoIterator<Item = Envelope>,
        replace: bool,
    ) -> Vec<Result<bool, QueueError>> {
        let mut results: Vec<Option<Result<bool, QueueError>>> = Vec::new();
        // Per shard: (position in the results, encoded envelope, envelope).
        let mut by_shard: std::collections::HashMap<u32, Vec<(usize, Vec<u8>, Envelope)>> =
            std::collections::HashMap::new();
        for envelope in envelopes {
            let at = results.len();
            match envelope.encode(self.cfg.max_envelope) {
                Ok(bytes) => {
                    results.push(None);
                    let shard = shard_of(&envelope.id, self.cfg.shards);
                    by_shard
                        .entry(shard)
                        .or_default()
                        .push((at, bytes, envelope));
                }
                Err(e) => results.push(Some(Err(QueueError::Envelope(e, Box::new(envelope))))),
            }
        }
        let calls = by_shard.into_iter().flat_map(|(shard, tasks)| {
            let mut chunks = Vec::new();
            let mut tasks = tasks.into_iter().peekable();
            while tasks.peek().is_some() {
                let chunk: Vec<_> = tasks.by_ref().take(Self::ENQUEUE_BATCH).collect();
                chunks.push((shard, chunk));
            }
            chunks
        });
        let calls = calls.map(|(shard, chunk)| async move {
            let keys = &self.shards[shard as usize];
            let mut inv = scripts::ENQUEUE_MANY.prepare_invoke();
            inv.key(keys.due())
                .key(keys.tasks())
                .key(keys.lease())
                .key(keys.owner())
                .key(keys.expired())
                .arg(u8::from(replace))
                .arg(self.cfg.channel())
                .arg(self.cfg.notify_before())
                .arg(self.cfg.wake_suffix(shard));
            for (_, bytes, envelope) in &chunk {
                inv.arg(envelope.id.as_str())
                    .arg(envelope.due_at)
                    .arg(bytes.as_slice());
            }
            let reply = self.conn.run::<Vec<i64>>(&inv).await;
            (chunk, reply)
        });
        for (chunk, reply) in futures_util::future::join_all(calls).await {
            match reply {
                Ok(stored) if stored.len() == chunk.len() => {
                    for ((at, _, _), n) in chunk.into_iter().zip(stored) {
                        results[at] = Some(Ok(n == 1));
                    }
                }
                Ok(stored) => {
                    let e = format!(
                        "enqueue_many: {} replies for {} tasks",
                        stored.len(),
                        chunk.len()
                    );
                    for (at, _, envelope) in chunk {
                        let err = StoreError::new(e.clone());
                        results[at] = Some(Err(QueueError::NotEnqueued(err, Box::new(envelope))));
                    }
                }
                Err(e) => {
                    let e = e.to_string();
                    for (at, _, envelope) in chunk {
                        let err = StoreError::new(e.clone());
                        results[at] = Some(Err(QueueError::NotEnqueued(err, Box::new(envelope))));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(QueueError::Config("enqueue_many lost a result"))))
            .collect()
    }

    /// The most tasks [`enqueue_many`](Self::enqueue_many) sends in one script call.
    pub const ENQUEUE_BATCH: usize = 256;

    /// Cancels task `id` whether queued or claimed; `Ok(false)` if it is not there. A
    /// consumer that already claimed it may still fire it (its ack is then refused): handlers
    /// that must not act on a cancelled task check their own state, as they would anyway
    /// under at-least-once delivery.
    pub async fn cancel(&self, id: &str) -> Result<bool, QueueError> {
        let keys = self.keys(id);
        let mut inv = scripts::CANCEL.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .arg(id);
        Ok(self.conn.run::<i64>(&inv).await? == 1)
    }

    /// Up to `limit` dead-lettered tasks, over all shards (a hash that changes meanwhile may
    /// list one twice). Ids and records that are not UTF-8 are listed lossily (U+FFFD).
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadTask>, QueueError> {
        let mut out = Vec::new();
        for keys in self.shards.iter() {
            // HSCAN's COUNT is a hint: a large hash answers a few entries per call, so follow
            // the cursor until the limit or the end.
            let mut cursor = 0u64;
            while out.len() < limit {
                let mut conn = self.conn.conn.clone();
                self.conn.count(1);
                // Bytes: an id or record another client wrote need not be UTF-8, and one such
                // entry must not fail the whole listing.
                let (next, flat): HscanPage = redis::cmd("HSCAN")
                    .arg(keys.dead())
                    .arg(cursor)
                    .arg("COUNT")
                    // A hint, capped: Redis refuses a COUNT past i64::MAX, and a huge one
                    // would walk the whole hash in one call while the server waits.
                    .arg((limit - out.len()).min(1_000))
                    .query_async(&mut conn)
                    .await?;
                let room = limit - out.len();
                out.extend(flat.into_iter().take(room).map(|(id, record)| {
                    let id = String::from_utf8_lossy(&id).into_owned();
                    parse_dead(id, &String::from_utf8_lossy(&record))
                }));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    /// Moves dead-lettered task `id` back to the queue, due now, with its attempts reset.
    /// `Ok(false)` if it is not dead-lettered; [`QueueError::NotAnEnvelope`] if what was
    /// dead-lettered is not a task envelope, [`QueueError::StillPending`] if a task with the
    /// same id was enqueued since (both leave everything as it is). The envelope goes back as
    /// it was stored, so `max_envelope` is not applied to it again. A task dead-lettered with
    /// no envelope (`no envelope in the tasks hash`) whose envelope was written since (by
    /// another client, too late) goes back with that envelope.
    pub async fn requeue(&self, id: &str) -> Result<bool, QueueError> {
        let keys = self.keys(id);
        let mut conn = self.conn.conn.clone();
        self.conn.count(1);
        // Bytes: a record need not be UTF-8 (the reaper copies a stored envelope as it is).
        let record: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(keys.dead())
            .arg(id)
            .query_async(&mut conn)
            .await?;
        let Some(record) = record else {
            return Ok(false);
        };
        let Ok(text) = std::str::from_utf8(&record) else {
            return Err(QueueError::NotAnEnvelope(id.to_string()));
        };
        let dead = parse_dead(id.to_string(), text);
        let mut envelope = Envelope::decode(dead.raw.as_bytes()).ok();
        if envelope.is_none() && dead.raw.is_empty() {
            // Dead-lettered with no envelope: one written since is the task's.
            self.conn.count(1);
            let stored: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(keys.tasks())
                .arg(id)
                .query_async(&mut conn)
                .await?;
            envelope = stored.and_then(|bytes| Envelope::decode(&bytes).ok());
        }
        // One stored under another id was dead-lettered for that: it is not this task.
        let Some(mut envelope) = envelope.filter(|e| e.id == id) else {
            return Err(QueueError::NotAnEnvelope(id.to_string()));
        };
        envelope.attempt = 0;
        envelope.due_at = now_ms();
        let bytes = envelope
            .encode(usize::MAX)
            .map_err(|e| QueueError::Envelope(e, Box::new(envelope.clone())))?;
        let mut inv = scripts::REQUEUE.prepare_invoke();
        inv.key(keys.dead())
            .key(keys.tasks())
            .key(keys.due())
            .key(keys.lease())
            .arg(id)
            .arg(bytes)
            .arg(envelope.due_at)
            .arg(self.cfg.channel())
            // Only the record read above: one dead-lettered again meanwhile stays.
            .arg(&record)
            .arg(self.cfg.wake_suffix(shard_of(id, self.cfg.shards)));
        match self.conn.run::<i64>(&inv).await? {
            1 => Ok(true),
            -1 => Err(QueueError::StillPending(id.to_string())),
            _ => Ok(false),
        }
    }

    /// Queued (not claimed), claimed, and dead-lettered tasks, over all shards.
    pub async fn depth(&self) -> Result<QueueDepth, QueueError> {
        let mut depth = QueueDepth::default();
        for keys in self.shards.iter() {
            let d = sample_depth(&self.conn, keys).await?;
            depth.queued += d.queued;
            depth.leased += d.leased;
            depth.dead += d.dead;
        }
        Ok(depth)
    }

    /// Commands this producer has sent.
    pub fn commands(&self) -> u64 {
        self.conn.commands.load(Relaxed)
    }
}

/// Sizes of a queue's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueDepth {
    /// Tasks waiting to be claimed (ZCARD of `due`).
    pub queued: u64,
    /// Tasks claimed by a consumer (ZCARD of `lease`).
    pub leased: u64,
    /// Dead-lettered tasks (HLEN of `dead`).
    pub dead: u64,
}

pub(crate) async fn sample_depth(conn: &Conn, keys: &KeyLayout) -> Result<QueueDepth, QueueError> {
    let mut c = conn.conn.clone();
    conn.count(3);
    let (queued, leased, dead): (u64, u64, u64) = redis::pipe()
        .cmd("ZCARD")
        .arg(keys.due())
        .cmd("ZCARD")
        .arg(keys.lease())
        .cmd("HLEN")
        .arg(keys.dead())
        .query_async(&mut c)
        .await?;
    Ok(QueueDepth {
        queued,
        leased,
        dead,
    })
}

/// One HSCAN reply: the next cursor, then (field, value) pairs as stored.
type HscanPage = (u64, Vec<(Vec<u8>, Vec<u8>)>);

/// The dead-letter record written by the consumer: `{reason, raw, at, attempt}`.
pub(crate) fn dead_record(reason: &str, raw: &str, attempt: u32) -> String {
    serde_json::json!({ "reason": reason, "raw": raw, "at": now_ms(), "attempt": attempt })
        .to_string()
}

fn parse_dead(id: String, record: &str) -> DeadTask {
    let v: serde_json::Value = serde_json::from_str(record).unwrap_or_default();
    DeadTask {
        id,
        reason: v["reason"]
            .as_str()
            .unwrap_or("unreadable record")
            .to_string(),
        at: v["at"].as_u64().unwrap_or(0),
        // Saturated: the reaper adds its count through Lua's doubles, past u32 for a
        // hand-made envelope.
        attempt: v["attempt"]
            .as_u64()
            .or_else(|| {
                v["attempt"]
                    .as_f64()
                    .filter(|a| *a >= 0.0)
                    .map(|a| a as u64)
            })
            .map_or(0, |a| u32::try_from(a).unwrap_or(u32::MAX)),
        raw: v["raw"].as_str().unwrap_or(record).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead-letter record's attempt count past `u32` (the reaper's Lua arithmetic on a
    /// hand-made envelope) saturates instead of wrapping to a small count.
    #[test]
    fn a_dead_records_attempt_count_saturates() {
        let attempt = |record: &str| parse_dead("x".into(), record).attempt;
        assert_eq!(attempt(r#"{"attempt":5}"#), 5);
        assert_eq!(attempt(r#"{"attempt":4294967300}"#), u32::MAX);
        assert_eq!(attempt(r#"{"attempt":4.2949673e+11}"#), u32::MAX);
        assert_eq!(attempt(r#"{"attempt":-3}"#), 0);
        assert_eq!(attempt("garbage"), 0);
    }

    /// A delay is counted from the clock to the nanosecond and rounded up: with both rounded
    /// down to the ms, a task 1.9 ms out was due about 1 ms after the call, or at once.
    #[test]
    fn a_delay_never_makes_a_task_due_early() {
        use crate::redis::wall_clock::since_epoch;
        for delay_us in [1, 999, 1_000, 1_001, 1_900, 2_500_000] {
            let delay = Duration::from_micros(delay_us);
            let before = since_epoch();
            let due_ms = When::After(delay).due_ms(&WallClock::system());
            assert!(
                u128::from(due_ms) * 1_000_000 >= (before + delay).as_nanos(),
                "{delay:?} from {before:?} is due at {due_ms} ms"
            );
        }
        assert_eq!(
            When::After(Duration::MAX).due_ms(&WallClock::system()),
            u64::MAX
        );
    }
}
