//! # delaywheel
//!
//! A hierarchical timing wheel for millions of timers: insert, cancel and reset in O(1) however
//! many timers are pending, expiry in deadline order, never early, never a panic for a deadline
//! years away.
//!
//! The crate is layered, each layer depending only on the ones above it in this list:
//!
//! 1. [`wheel`]: the pure data structure. No clock, no threads, no I/O; time is a `u64` tick.
//!    (Its one system call: on Linux, a key table of 32 MiB or more sized up front by
//!    `Wheel::with_capacity` asks for transparent huge pages, a hint that changes no data.)
//! 2. The engine ([`Timer`]): the clock, sharded wheels behind mutexes, a driver thread that
//!    sleeps until the next deadline, and delivery to a channel, a callback pool or (feature
//!    `tokio`) futures and streams.
//! 3. [`redis`] (feature `redis`): persistence of tasks into Redis with restore after a
//!    restart (`redis::Persistent`), and a delay queue shared by many instances that fire
//!    from their own wheels (`redis::Producer`, `redis::Consumer`).
//!
//! ```
//! use delaywheel::wheel::Wheel;
//!
//! let mut wheel = Wheel::new();
//! let request = wheel.insert(30_000, "request 17 timed out");
//! let idle = wheel.insert(60_000, "connection 4 idle");
//! wheel.cancel(request); // the response arrived in time
//! wheel.reset(idle, 90_000); // activity on the connection
//! assert!(wheel.poll(60_000).is_none());
//! assert_eq!(wheel.poll(90_000).map(|e| e.value), Some("connection 4 idle"));
//! ```
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unsafe_code)]

pub mod wheel;

mod clock;
mod delivery;
mod error;
#[cfg(feature = "redis")]
pub mod redis;
mod shard;
#[cfg(feature = "tokio")]
pub mod sleep;
mod stats;
#[cfg(feature = "tokio")]
mod stream;
mod timer;
mod wake;

/// The atomics [`wake`] uses: `tests/loom_wake.rs` compiles that file against loom's instead.
mod sync {
    pub(crate) use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
}

pub use clock::ManualClock;
pub use error::{BuildError, ScheduleError};
pub use stats::{Lateness, Stats};
#[cfg(feature = "tokio")]
pub use stream::ExpirationStream;
pub use timer::{Expiration, Pending, Timer, TimerBuilder, TimerId};

/// The README's examples, compiled and run as doc tests (with the `redis` feature, which its
/// Redis examples need).
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
