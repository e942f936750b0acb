//! The Redis layer (feature `redis`): the task envelope, the key layout, and a store that keeps
//! pending tasks in a Redis ZSET + HASH.
//!
//! [`Persistent`] is an engine whose tasks survive a restart: a write-behind flusher mirrors
//! them into Redis and [`Persistent::restore`] reloads them. The shared delay queue (several
//! instances claiming from one ZSET) is not here yet.
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
//! | `{ns}:dead` | HASH | task id → JSON `{ "reason", "raw", "at" }` of an entry that could not be used |
//! | `{ns}:done:<id>` | STRING | [`Dedup`] marker: `running` (lease TTL) or `done` (keep TTL) |
//!
//! Scores are integers below 2^53, so a double holds them exactly.

mod consumer;
mod dedup;
mod envelope;
mod layout;
mod persistent;
mod queue;
mod scripts;
mod store;
mod task_store;

pub use consumer::{Consumer, HandlerError, Handlers, QueueStats};
pub use dedup::{Begin, Dedup, DedupError};
pub use envelope::{Envelope, EnvelopeError, MAX_DUE_MS};
pub use layout::{KeyLayout, NamespaceError};
pub use persistent::{
    now_ms, Durability, Overdue, PersistConfig, PersistError, Persistent, RestoreReport, WhenFull,
};
pub use queue::{
    shard_of, Backoff, DeadTask, Producer, QueueConfig, QueueDepth, QueueError, RetryPolicy, When,
};
pub use store::{Broken, BrokenReason, Op, Page, RedisStore, StoreError};
pub use task_store::TaskStore;
