//! The consumer of the shared delay queue: it claims the tasks due within the lookahead
//! window, holds them in its own timing wheel, and fires each at its due millisecond.
//!
//! One file per background loop, as asynq's server gives each of its loops one, composed by
//! [`lifecycle`], which starts them and stops them:
//!
//! * [`claim`]: the claim loop, one per shard; [`subscriber`]: the wake-up subscriber;
//! * [`registry`]: the handler table users fill ([`Handlers`]); [`handlers`]: the handler
//!   pool the wheel fires into, and (feature `tokio`) `async_pool`, the slots and runtime of
//!   `async` handlers;
//! * [`outcomes`]: the outcome writer (acks, retries, dead letters), with [`writes`], its
//!   write tasks; [`renewal`]: lease renewal;
//! * [`reaper`]: expired leases back to the queue, and the sweep of lone envelopes;
//! * [`gates`]: rate limits and concurrency caps per topic, across the fleet, and
//!   [`limiter`], the loop that books and frees their permits;
//! * [`stall`]: the hand-back of a consumer whose handler threads are all stuck;
//! * [`shared`]: what they share.
//!
//! # Ground rules
//!
//! * Redis is the source of truth. A claimed task is leased to this consumer under a fencing
//!   token; every later change (ack, retry, dead-letter, give back) is refused by Redis once
//!   the lease was taken over, so a consumer that stalled past its lease cannot clobber the
//!   new owner.
//! * `held` maps each claimed task not yet started to its timer. Whoever removes an entry owns
//!   the task's fate: the firing callback (runs the handler), `shutdown` or the stall loop
//!   (hand it back). The stall loop keeps what it took in `handing_back` until Redis has it
//!   (renewed meanwhile), so a failed or interrupted hand-back is tried again, or by
//!   `shutdown`, rather than left to a lease expiry.
//! * Handlers run on the wheel's callback pool (an `async` handler's future on the handler
//!   runtime, never on the consumer's own), at most `handler_threads` at once; their outcomes go
//!   to the resolver task, which batches acks and writes each shard's calls as tasks of their
//!   own, so a shard whose node hangs holds back no other shard's.
//! * Delivery is at-least-once: a crash or an expired lease can fire a task twice. Handlers
//!   are idempotent (see [`Dedup`](crate::redis::Dedup)).

#[cfg(feature = "tokio")]
mod async_pool;
mod claim;
mod claimed;
mod gates;
mod handlers;
mod lifecycle;
mod limiter;
mod outcomes;
mod reaper;
mod registry;
mod renewal;
mod shared;
mod stall;
mod subscriber;
mod topic_metrics;
mod writes;

pub use lifecycle::Consumer;
pub use registry::{HandlerError, Handlers};
pub use shared::QueueStats;
