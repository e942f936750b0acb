//! The queue role: a delay queue shared by many instances.
//!
//! * [`config`]: [`QueueConfig`], shards and errors; [`conn`]: the counted connection both
//!   sides share; [`dead_letters`]: the dead-letter records.
//! * [`producer`]: the [`Producer`].
//! * [`consumer`]: the [`Consumer`], one file per background loop.
//! * [`scripts`]: the Lua scripts every change to the queue runs, atomically per shard.
//! * [`dedup`]: [`Dedup`], processed-id markers for idempotent handlers.
//! * [`limit`]: [`TopicLimit`], rate limits and concurrency caps per topic (enforced by the
//!   consumer's limiter loop, with scripts RATE_SLOTS, SLOTS_TAKE and SLOTS_RENEW).
//!
//! The scripts are `.lua` files in `lua/`, each with its keys, arguments and reply in its
//! header: ENQUEUE (ZADD + HSET, PUBLISH if due soon), CLAIM (the new place first: lease and
//! owner under one fresh token, then ZREM; the batch kept for a retry with the same nonce),
//! ACK, RETRY, DEAD, GIVE_BACK, RENEW (the leases whose owner still matches), REAP (expired
//! leases back to the queue, or to the dead letters past `max_lease_expiries`), SWEEP (a
//! reaper's scan for envelopes with no queue entry), REQUEUE, CANCEL, and Dedup's ABANDON.
//!
//! The contract (guarantees, leases, retries, the key layout, producers in other languages,
//! metrics, known limits) is in the public docs of [`crate::redis`].
//!
//! Nothing here uses the persistence role.

pub(crate) mod config;
pub(crate) mod conn;
pub(crate) mod consumer;
pub(crate) mod dead_letters;
pub(crate) mod dedup;
pub(crate) mod inspect;
pub(crate) mod limit;
pub(crate) mod pause;
#[cfg(feature = "periodic")]
pub(crate) mod periodic;
pub(crate) mod producer;
pub(crate) mod reschedule;
#[cfg(feature = "periodic")]
pub(crate) mod scheduler;
pub(crate) mod scripts;
pub(crate) mod unique;

pub use config::{shard_of, Backoff, QueueConfig, QueueError, RetryPolicy};
pub use conn::QueueDepth;
pub use consumer::{Consumer, HandlerError, Handlers, QueueStats};
pub use dead_letters::DeadTask;
pub use dedup::{Begin, Claim, Dedup, DedupError};
pub use inspect::{ListCursor, ListState, ShardStats, TaskInfo, TaskPage, TaskState, TopicCounts};
pub use limit::TopicLimit;
#[cfg(feature = "periodic")]
pub use periodic::{CatchUp, Every, Periodic, PeriodicError};
pub use producer::Producer;
pub use reschedule::Rescheduled;
#[cfg(feature = "periodic")]
pub use scheduler::Scheduler;
pub use unique::{Unique, MAX_UNIQUE_WINDOW};
