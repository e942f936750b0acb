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
//! 2. `src/engine/`, the engine ([`Timer`]): the clock, sharded wheels behind mutexes, a
//!    driver thread that sleeps until the next deadline, and delivery to a channel, a callback
//!    pool or (feature `futures`) futures and streams ([`sleep`]).
//! 3. [`redis`] (feature `redis`): shared parts at its root (the connection, key names, the
//!    envelope, the wall clock), then one folder per role: `redis/persist/`, persistence of
//!    tasks into Redis with restore after a restart (`redis::Persistent`), and
//!    `redis/queue/`, a delay queue shared by many instances that fire from their own wheels
//!    (`redis::Producer`, `redis::Consumer`).
//!
//! 4. [`http`] (features `hyper`, `tower`): the engine as hyper's timer and as a tower timeout
//!    layer, built on [`sleep`].
//!
//! `make test` runs `.ci/layers.py`, which fails on an import cycle between files or an import
//! against this order.
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
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod wheel;

mod engine;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

#[cfg(any(feature = "hyper", feature = "tower"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "hyper", feature = "tower"))))]
pub mod http;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;

#[cfg(feature = "futures")]
#[cfg_attr(docsrs, doc(cfg(feature = "futures")))]
pub use engine::sleep;

pub use engine::clock::ManualClock;
pub use engine::error::{BuildError, ScheduleError};
pub use engine::expiration::{Expiration, Pending, TimerId};
pub use engine::stats::{Lateness, Stats};
#[cfg(feature = "futures")]
#[cfg_attr(docsrs, doc(cfg(feature = "futures")))]
pub use engine::stream::ExpirationStream;
pub use engine::timer::{Timer, TimerBuilder};

/// The README's examples, compiled and run as doc tests (with the `redis` feature, which its
/// Redis examples need).
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
