//! The Redis layer (feature `redis`), in two roles:
//!
//! * [`Persistent`]: an engine whose tasks survive a restart. A write-behind flusher mirrors
//!   them into a [`TaskStore`] ([`RedisStore`] by default) and [`Persistent::restore`] reloads
//!   them.
//! * [`Producer`] and [`Consumer`]: a delay queue shared by many instances. Each consumer
//!   claims the tasks due within its lookahead window, atomically and under a fencing token,
//!   and fires each from its own wheel at the due millisecond.
//!
//! The files: the parts both roles use at this folder's root (`link.rs`, the connection to a
//! node or a cluster; `layout.rs`, the key names; `envelope.rs`, the task envelope;
//! `wall_clock.rs`, epoch milliseconds; `store_error.rs`; `blocking.rs`, the runtime the
//! blocking APIs run on), then one folder per role, `persist/` and `queue/`, neither of which
//! uses the other. Every Lua script is a `.lua` file beside the module that runs it.
//!
//! The examples below need a running Redis, so they are compiled but not run here; the tests
//! in `tests/redis_*.rs`, `tests/persist_*.rs` and `tests/queue.rs` run the same calls against
//! a private `redis-server`.
//!
//! ```no_run
//! use std::time::Duration;
//! use delaywheel::redis::{PersistConfig, Persistent};
//!
//! let (engine, fired) = Persistent::start(PersistConfig::new("redis://127.0.0.1/", "orders"))?;
//! engine.restore(4_000)?; // what the previous process left, 4 000 entries per page
//! engine.schedule("order:42", "order.close", serde_json::json!({ "order_id": 42 }), Duration::from_secs(30 * 60))?;
//! for task in fired {
//!     // close the order if it is still unpaid (idempotently), then:
//!     engine.ack(&task);
//! }
//! # Ok::<(), delaywheel::redis::PersistError>(())
//! ```
//!
//! ```no_run
//! use std::time::Duration;
//! use delaywheel::redis::{Consumer, Handlers, Producer, QueueConfig, When};
//!
//! # async fn run() -> Result<(), delaywheel::redis::QueueError> {
//! // A namespace of its own: a `Persistent` engine and a queue on one namespace would
//! // take each other's tasks.
//! let cfg = QueueConfig::new("redis://127.0.0.1/", "order-queue");
//! let consumer = Consumer::start(cfg.clone(), Handlers::new().on("order.close", |task| {
//!     println!("closing {}", task.payload["order_id"]);
//!     Ok(())
//! }))?;
//! let producer = Producer::connect(cfg).await?;
//! producer.enqueue("order:42", "order.close", serde_json::json!({ "order_id": 42 }),
//!     When::After(Duration::from_secs(1_800))).await?;
//! # consumer.shutdown(Duration::from_secs(5))?;
//! # Ok(())
//! # }
//! ```
//!
//! # Key layout
//!
//! Every key of a namespace shares the hash tag `{ns}`, so a namespace lives in one Redis
//! Cluster slot and multi-key transactions on it are allowed:
//!
//! | key | type | content |
//! |---|---|---|
//! | `{ns}:due` | ZSET | member = task id, score = due time in ms since the Unix epoch |
//! | `{ns}:tasks` | HASH | task id → the JSON [`Envelope`] |
//! | `{ns}:dead` | HASH | task id → JSON `{ "reason", "raw", "at", "attempt" }` of an entry that could not be used (`raw`: the envelope; [`Persistent`] keeps one that is not UTF-8 in `raw_hex` (and `raw` is `null`), the queue in `raw` with those bytes replaced by U+FFFD, or by its reaper as Lua's cjson writes them; with no envelope, `null` from [`Persistent`] and `""` from the queue's scripts; `attempt`: queue only) |
//! | `{ns}:lease` | ZSET | queue: claimed task id → lease deadline in ms (Redis's clock) |
//! | `{ns}:owner` | HASH | queue: claimed task id → `consumer|token` (the fencing token) |
//! | `{ns}:fence` | STRING | queue: the counter of fencing tokens |
//! | `{ns}:expired` | HASH | queue: task id → how many times a lease on it ran out |
//! | `{ns}:unpaired` | HASH | queue: task id → when (ms, Redis's clock) it was first seen half written: queued with no envelope (by a claim), or an envelope with no queue entry (by a reaper's sweep); struck out when the task is whole or gone (see [`QueueConfig::unpaired_grace`]) |
//! | `{ns}:kind` | STRING | the role using the namespace, `persistent` or `queue` (set by the first to connect; the other is refused with [`NamespaceInUse`]) |
//! | `{ns}:engine` | STRING | [`Persistent`]'s writer lease: the name of the one engine that writes and restores the namespace (see [`PersistConfig::engine_lease`]) |
//! | `{ns}:engine:takes` | STRING | `<count> <name>`: how many times that lease was taken while free, and by whom last |
//! | `{ns}:done:<id>` | STRING | [`Dedup`] marker: `running:<token>` (lease TTL) or `done` (keep TTL) |
//! | `{ns}:wake` | pub/sub channel | queue: wake-ups (a due time in ms, and on a sharded queue `:` and the shard) |
//! | `{ns}:due:snapshot:<engine>`, `{ns}:tasks:snapshot:<engine>` | ZSET, HASH | [`Persistent::snapshot`]'s scratch copy (no `:<engine>` without a lease), renamed over `{ns}:due` and `{ns}:tasks` |
//!
//! Scores are integers below 2^53, so a double holds them exactly.
//!
//! # Producers in other languages
//!
//! A queue task is two writes on its shard's keys (`{ns}` for one shard; with `shards = N`,
//! `{ns:i}` where `i` is [`shard_of`]`(id, N)`): its envelope in `{ns}:tasks` (a JSON
//! [`Envelope`]: `id`, `topic`, `payload` and `due_at` are required, `attempt` and
//! `created_at` may be left out) and its id in `{ns}:due`, scored by its due time (integer ms
//! since the Unix epoch, the same as `due_at`). A producer that writes them itself should, in
//! order of preference:
//!
//! 1. call the ENQUEUE script, the one [`Producer::enqueue`] runs (its text is
//!    [`Producer::ENQUEUE_SCRIPT`]: `SCRIPT LOAD` it once and call `EVALSHA`). It writes
//!    both at once, leaves a pending id alone, and wakes the consumers:
//!    * KEYS: `{ns}:due`, `{ns}:tasks`, `{ns}:lease`, `{ns}:owner`, `{ns}:expired`.
//!    * ARGV: the id; the due time (ms); the envelope (JSON); `1` to replace a pending task of
//!      that id, else `0`; the wake-up channel `{ns}:wake` (the namespace without a shard
//!      suffix, for every shard); publish a wake-up if the due time is before this (ms; `0`:
//!      never; [`Producer`] uses now + `reconcile` + `claim_margin`); the wake-up message
//!      (the due time, followed on a sharded queue by `:` and the shard, e.g.
//!      `1733234567890:3`).
//!    * Reply: `1` if stored, `0` if a task of that id was pending (an envelope, and queued
//!      or claimed) and `0` was given for replace.
//! 2. or send `HSET {ns}:tasks` and `ZADD {ns}:due` in one MULTI/EXEC (this overwrites a
//!    pending task of the same id, and publishes no wake-up: consumers then find the task at
//!    their next reconcile claim, within `reconcile`);
//! 3. or write the envelope first, then the ZADD.
//!
//! A task written in two steps is half written in between, and the consumers tolerate that
//! for [`QueueConfig::unpaired_grace`] (5 s by default), counted from when they first see it:
//! an id queued with no envelope is left queued (not claimed) and dead-lettered once that
//! has passed (reason `no envelope in the tasks hash`); an envelope with no queue entry is
//! removed once it has passed. Either way, both writes must land within the grace period.
//! An envelope with no queue entry does not make its id pending: [`Producer::enqueue`]
//! stores a new task under that id.

mod blocking;
mod envelope;
mod layout;
mod link;
mod payload;
mod persist;
mod queue;
mod store_error;
mod wall_clock;
mod when;

pub use envelope::{Envelope, EnvelopeError, MAX_DUE_MS, MAX_PAYLOAD_DEPTH};
pub use layout::{KeyLayout, NamespaceError, NamespaceInUse};
pub use payload::{IntoPayload, PayloadError};
#[cfg(feature = "futures")]
pub use persist::FiredStream;
pub use persist::{
    Broken, BrokenReason, Cursor, Durability, Lease, Op, Overdue, Page, PersistConfig,
    PersistError, Persistent, RedisStore, RestoreReport, Row, Rows, TaskStore, WhenFull, MAX_PAGE,
};
pub use queue::{
    shard_of, Backoff, Begin, Claim, Consumer, DeadTask, Dedup, DedupError, HandlerError, Handlers,
    Producer, QueueConfig, QueueDepth, QueueError, QueueStats, RetryPolicy,
};
pub use store_error::StoreError;
pub use wall_clock::{now_ms, WallClock};
pub use when::When;
