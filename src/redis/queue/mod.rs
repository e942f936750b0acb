//! The queue role: a delay queue shared by many instances.
//!
//! * [`config`]: [`QueueConfig`], shards, errors and the [`Producer`].
//! * [`consumer`]: the [`Consumer`], one file per background loop.
//! * [`scripts`]: the Lua scripts every change to the queue runs, atomically per shard.
//! * [`dedup`]: [`Dedup`], processed-id markers for idempotent handlers.
//!
//! Nothing here uses the persistence role.

pub(crate) mod config;
pub(crate) mod consumer;
pub(crate) mod dedup;
pub(crate) mod scripts;

pub use config::{
    shard_of, Backoff, DeadTask, Producer, QueueConfig, QueueDepth, QueueError, RetryPolicy,
};
pub use consumer::{Consumer, HandlerError, Handlers, QueueStats};
pub use dedup::{Begin, Claim, Dedup, DedupError};
