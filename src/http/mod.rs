//! The HTTP seams: the engine where a gateway's timeouts come from, so that a hyper server or
//! a tower stack moves its timeouts onto the wheel without rewriting anything.
//!
//! * [`HyperTimer`] (feature `hyper`): a [`hyper::rt::Timer`] on a
//!   [`Sleeper`](crate::sleep::Sleeper), for hyper's header-read, keep-alive and pool-idle
//!   timeouts.
//! * [`TimeoutLayer`] (feature `tower`): a tower [`Layer`](tower::Layer) that puts a timeout on
//!   every request, failing it with tower's own
//!   [`Elapsed`](tower::timeout::error::Elapsed).
//!
//! Both build on [`sleep`](crate::sleep), and import nothing from [`redis`](crate::redis).
//! Both register their timers lazily: a request that completes at its first poll costs no
//! timer at all. For a timeout per request on a multi-thread runtime, give them a
//! [`Sleeper::leak`](crate::sleep::Sleeper::leak)ed sleeper: its futures then share no
//! reference count.
//!
//! A graceful shutdown stops the server first, then the engine: a hyper timeout whose engine
//! has shut down fires at once (it never waits forever), and a request under the tower layer
//! fails with [`TimeoutError::Shutdown`](crate::sleep::TimeoutError::Shutdown).

#[cfg(feature = "hyper")]
mod hyper_timer;
#[cfg(feature = "tower")]
mod timeout_layer;

#[cfg(feature = "hyper")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper")))]
pub use hyper_timer::HyperTimer;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub use timeout_layer::{ResponseFuture, TimeoutLayer, TimeoutService};
