//! The engine: a thread-safe timer service built on the [`wheel`](crate::wheel).
//!
//! * [`timer`]: the [`Timer`](crate::Timer) handle and its [`TimerBuilder`](crate::TimerBuilder).
//! * [`driver`]: the driver thread, which sleeps until the next deadline, advances the shards'
//!   wheels and hands what expired to delivery, outside every shard lock.
//! * [`shard`]: one wheel behind one mutex; [`clock`]: the monotonic (or a manual) clock in
//!   ticks; [`wake`]: the handshake that wakes the driver when a new timer is earlier than
//!   the one it sleeps for.
//! * [`delivery`]: to a channel or a callback pool; [`stats`]: counters and lateness;
//!   [`error`]: what a schedule or a build refuses.
//! * With feature `futures`: [`sleep`](crate::sleep) (futures) and [`stream`] (an expiration
//!   stream), runtime-agnostic adapters over the same engine.
//!
//! Dependencies point one way: the handle and the driver use the parts below them, and
//! nothing here uses [`redis`](crate::redis).
//!
//! The engine's guarantees, each with the tests that cover it, are in `GUARANTEES.md` beside
//! this file, which the [`Timer`](crate::Timer) docs include (its `# Guarantees` section on
//! docs.rs). Observability: the counters of `metrics.rs` count as events happen and the
//! driver publishes the gauges every
//! [`metrics_interval`](crate::TimerBuilder::metrics_interval) (the series are listed there);
//! `tracing` logs the driver's lifecycle at debug, and a warning when a delivery is later
//! than [`lateness_warning`](crate::TimerBuilder::lateness_warning) (10 ms).

pub(crate) mod clock;
pub(crate) mod delivery;
pub(crate) mod driver;
pub(crate) mod error;
pub(crate) mod expiration;
pub(crate) mod metrics;
pub(crate) mod shard;
#[cfg(feature = "futures")]
pub mod sleep;
pub(crate) mod stats;
#[cfg(feature = "futures")]
pub(crate) mod stream;
pub(crate) mod timer;
pub(crate) mod wake;

/// The atomics [`wake`] uses: `tests/loom_wake.rs` compiles that file against loom's instead.
mod sync {
    pub(crate) use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
}
