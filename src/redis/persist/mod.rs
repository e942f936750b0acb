//! The persistence role: [`Persistent`], an engine whose pending tasks survive a restart.
//!
//! * [`engine`]: the engine's calls (schedule, cancel, ack, flush, snapshot);
//!   [`lifecycle`]: its start, which composes the threads and loops below, and its shutdown;
//!   [`deliver`]: the callback that hands fired tasks over; [`restore`]: its restore;
//!   [`config`]: its settings and errors; `fired_stream` (feature `futures`): the fired tasks
//!   as a `Stream`.
//! * [`index`]: the tasks held; [`journal`]: the changes not yet written; [`state`]: both
//!   under one mutex, and what the threads share.
//! * [`flusher`]: the write-behind thread that drains the journal; [`lease`]: the writer
//!   lease, taken at start and renewed by a loop.
//! * [`task_store`]: the [`TaskStore`] trait a backend implements; [`rows`]: the changes and
//!   rows that pass through it;
//!   [`redis_store`]: [`RedisStore`], the Redis backend, with its Lua scripts.
//!
//! Dependencies point one way, from the engine down: lifecycle, engine and restore, then
//! deliver, flusher and lease, state, journal, index, config, and the store trait and rows
//! that the Redis store implements. Nothing here uses the queue.
//!
//! The Redis store's scripts are `.lua` files in `lua/`, each with its keys, arguments and
//! reply in its header: `page` (one keyset page of a restore, with the server's `run_id`),
//! `remove` (a batch of removals, which Redis runs at `maxmemory`), `dead_letter`, `clear`,
//! `swap_in` (a snapshot's rename, only under the engine's lease), `undo_half_applied`,
//! `lease` and `release` (the writer lease).
//!
//! The contract (guarantees, durability, the writer lease, restore, the key layout, metrics,
//! known limits) is in the public docs of [`crate::redis`].

pub(crate) mod config;
pub(crate) mod deliver;
pub(crate) mod engine;
#[cfg(feature = "futures")]
pub(crate) mod fired_stream;
pub(crate) mod flusher;
pub(crate) mod index;
pub(crate) mod journal;
pub(crate) mod lease;
pub(crate) mod lifecycle;
pub(crate) mod redis_store;
pub(crate) mod restore;
pub(crate) mod rows;
pub(crate) mod state;
pub(crate) mod task_store;

pub use config::{Durability, Overdue, PersistConfig, PersistError, RestoreReport, WhenFull};
pub use engine::Persistent;
#[cfg(feature = "futures")]
pub use fired_stream::FiredStream;
pub use redis_store::{RedisStore, MAX_PAGE};
pub use rows::{Broken, BrokenReason, Cursor, Op, Page, Row, Rows};
pub use task_store::{Lease, TaskStore};
