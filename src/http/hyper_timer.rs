//! [`HyperTimer`]: hyper 1.x's pluggable timer on the engine.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::sleep::{Sleep, Sleeper};

/// A [`hyper::rt::Timer`] backed by the engine: hyper's server and client take it for their
/// header-read, keep-alive and pool-idle timeouts, where `hyper_util`'s `TokioTimer` would put
/// them on tokio's timer.
///
/// * `sleep` and `sleep_until` return a sleep on the engine, registered at its first poll.
/// * `reset` moves the same registration in the wheel (O(1)), as
///   [`Sleep::reset`](crate::sleep::Sleep::reset) does; a sleep from another timer is replaced
///   by one of ours.
/// * `now` reads the engine's clock: on a [`ManualClock`](crate::ManualClock), hyper's
///   deadlines move with it.
///
/// **At engine shutdown a hyper sleep fires at once**, never hangs: hyper then times out what
/// it was waiting for (it closes an idle connection, or fails a header read). So stop the
/// server first, then the engine.
///
/// ```
/// use std::time::Duration;
/// use delaywheel::http::HyperTimer;
/// use delaywheel::sleep::Sleeper;
///
/// let timer = HyperTimer::new(Sleeper::new().unwrap().leak());
/// let mut http = hyper::server::conn::http1::Builder::new();
/// http.timer(timer).header_read_timeout(Duration::from_secs(5));
/// ```
#[derive(Clone, Debug)]
pub struct HyperTimer {
    sleeper: Sleeper,
}

impl HyperTimer {
    /// A timer on `sleeper`'s engine.
    pub fn new(sleeper: Sleeper) -> HyperTimer {
        HyperTimer { sleeper }
    }

    /// The sleeper behind this timer (its `timer()` has the engine's `stats()` and
    /// `shutdown()`).
    pub fn sleeper(&self) -> &Sleeper {
        &self.sleeper
    }
}

impl hyper::rt::Timer for HyperTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HyperSleep(self.sleeper.sleep(duration)))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HyperSleep(self.sleeper.sleep_until(deadline)))
    }

    fn now(&self) -> Instant {
        self.sleeper.timer().now()
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<HyperSleep>() {
            Some(ours) => ours.get_mut().0.reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

/// hyper's view of a [`Sleep`]: it completes with `()`, also when the engine shut down.
#[derive(Debug)]
struct HyperSleep(Sleep);

impl Future for HyperSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // Fired or shut down: either way hyper's wait is over (see `HyperTimer`).
        Pin::new(&mut self.0).poll(cx).map(drop)
    }
}

impl hyper::rt::Sleep for HyperSleep {}
