//! The persistence role: [`Persistent`], an engine whose pending tasks survive a restart.
//!
//! * [`engine`]: the engine itself (schedule, cancel, ack, flush, snapshot, shutdown) and the
//!   callback that delivers fired tasks.
//! * [`flusher`]: the journal of changes and the write-behind flusher thread that drains it.
//! * [`task_store`]: the [`TaskStore`] trait a backend implements, and its types;
//!   [`redis_store`]: [`RedisStore`], the Redis backend, with its Lua scripts.
//!
//! Dependencies point one way: the engine uses the flusher, both use the store trait, and the
//! Redis store implements it; nothing here uses the queue.

pub(crate) mod engine;
pub(crate) mod flusher;
pub(crate) mod redis_store;
pub(crate) mod task_store;

pub use engine::{
    Durability, Overdue, PersistConfig, PersistError, Persistent, RestoreReport, WhenFull,
};
pub use redis_store::{
    Broken, BrokenReason, Op, Page, RedisStore, Row, Rows, StoreError, MAX_PAGE,
};
pub use task_store::{Cursor, Lease, TaskStore};
