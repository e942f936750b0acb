//! `sleep` and `timeout` futures backed by the engine instead of the runtime's global timer
//! (feature `futures`; they work on any executor).
//!
//! Each future schedules one timer when it is created and cancels it when dropped. The driver
//! thread wakes the task directly when the timer fires.
//!
//! # Guarantees
//!
//! The engine's [guarantees](crate::Timer#guarantees) hold for these timers, and (paths from
//! the repository root):
//!
//! * A [`Sleep`] never completes before its deadline, and a [`Timeout`] returns the future's
//!   output if it is ready first, else [`TimeoutError::Elapsed`]. `tests/engine_tokio.rs`:
//!   `sleep_never_completes_early`, `timeout_returns_the_output_or_elapsed`.
//! * Dropping a pending future cancels its timer, without waking its task.
//!   `tests/engine_tokio.rs`: `dropping_a_sleep_cancels_its_timer`,
//!   `dropping_a_pending_sleep_cancels_without_waking_its_task`.
//! * [`Sleep::reset`] moves the same timer in the wheel (it inserts none), and a completed sleep
//!   reset is pending again; the wake-up of its old deadline does not complete it.
//!   `tests/sleep_reset.rs`: `a_reset_of_a_pending_sleep_moves_its_timer_and_inserts_none`,
//!   `a_completed_sleep_reset_is_pending_again_and_wakes_its_task`,
//!   `a_reset_right_after_the_fire_is_not_completed_by_the_old_wake_up`.
//! * A shutdown of the engine wakes every pending sleep with [`EngineShutdown`] (a timeout,
//!   with [`TimeoutError::Shutdown`]). `tests/engine_tokio.rs`:
//!   `shutdown_wakes_pending_sleeps_with_an_error`; `tests/sleep_reset.rs`:
//!   `a_reset_after_shutdown_completes_with_engine_shutdown`.
//!
//! # Deterministic tests: a manual clock, not tokio's paused one
//!
//! These futures run on the engine's clock, not on tokio's: `tokio::time::pause()` and
//! `advance()` do not move them, and under `#[tokio::test(start_paused = true)]` a
//! [`Sleeper::timeout`] still waits for real time (where `tokio::time::timeout` would return
//! `Elapsed` at once). To test code that uses them deterministically, give the code a sleeper
//! on a [`ManualClock`](crate::ManualClock) with a manual driver, and move time yourself:
//! `clock.advance(d)`, then `sleeper.timer().fire_due()` fires what is due, on the calling
//! thread.
//!
//! ```
//! use std::future::Future;
//! use std::pin::pin;
//! use std::task::{Context, Poll, Waker};
//! use std::time::Duration;
//! use delaywheel::sleep::{Sleeper, TimeoutError};
//! use delaywheel::{ManualClock, Timer};
//!
//! let clock = ManualClock::new();
//! let sleeper = Sleeper::with_builder(Timer::builder().manual_clock(&clock).manual_driver())
//!     .unwrap();
//! let mut call = pin!(sleeper.timeout(Duration::from_secs(30), std::future::pending::<()>()));
//! let mut cx = Context::from_waker(Waker::noop());
//! assert!(call.as_mut().poll(&mut cx).is_pending());
//! clock.advance(Duration::from_secs(29));
//! sleeper.timer().fire_due();
//! assert!(call.as_mut().poll(&mut cx).is_pending()); // not a millisecond early
//! clock.advance(Duration::from_secs(1));
//! sleeper.timer().fire_due();
//! assert_eq!(call.as_mut().poll(&mut cx), Poll::Ready(Err(TimeoutError::Elapsed)));
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use atomic_waker::AtomicWaker;

use super::delivery::Sink;
use super::error::BuildError;
use super::expiration::TimerId;
use super::timer::{Timer, TimerBuilder};

/// How far a sleep whose delay is past what an `Instant` holds is put: it never fires.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 86_400);

const PENDING: u8 = 0;
const FIRED: u8 = 1;
const SHUT_DOWN: u8 = 2;

#[derive(Debug, Default)]
struct SleepState {
    state: AtomicU8,
    waker: AtomicWaker,
}

/// The value a [`Sleeper`]'s timers carry: it wakes its future when it fires, and, if it is
/// dropped unfired (the engine shut down), wakes it with an error instead of leaving it hanging.
#[derive(Debug)]
pub struct Wakeup(Arc<SleepState>);

impl Wakeup {
    fn fire(self) {
        self.0.state.store(FIRED, SeqCst);
        self.0.waker.wake();
    }
}

impl Drop for Wakeup {
    fn drop(&mut self) {
        if self
            .0
            .state
            .compare_exchange(PENDING, SHUT_DOWN, SeqCst, SeqCst)
            .is_ok()
        {
            // Run wherever the engine's pending timers are dropped (a shutdown, a drop):
            // a panicking waker must not escape there.
            super::delivery::contained("a sleep's waker", || self.0.waker.wake());
        }
    }
}

/// The engine shut down before the timer fired (or refused to schedule it: it was shut down
/// already, or its shard held `u32::MAX` timers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineShutdown;

impl fmt::Display for EngineShutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the timer engine shut down before the timer fired")
    }
}

impl std::error::Error for EngineShutdown {}

/// Why a [`Timeout`] did not return the inner future's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimeoutError {
    /// The deadline passed first.
    Elapsed,
    /// The engine shut down first.
    Shutdown,
}

impl fmt::Display for TimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimeoutError::Elapsed => f.write_str("deadline elapsed"),
            TimeoutError::Shutdown => f.write_str("the timer engine shut down"),
        }
    }
}

impl std::error::Error for TimeoutError {}

/// An engine for futures: `sleep` and `timeout` on the wheel, so that a gateway can move its
/// request timeouts off the runtime's global timer. Cheap to clone.
///
/// A pending [`Sleep`] holds a handle to its engine, so the engine (and its driver thread)
/// lives while any sleep does, also after every `Sleeper` is dropped. On an executor that
/// drops its tasks when it shuts down (tokio) that ends with them. On one whose tasks are owned
/// by their wakers, a task left pending when the executor goes away is held by its own sleep's
/// timer: call `timer().shutdown()` first, which wakes every pending sleep with
/// [`EngineShutdown`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use delaywheel::sleep::{Sleeper, TimeoutError};
///
/// let sleeper = Sleeper::new().unwrap();
/// sleeper.sleep(Duration::from_millis(2)).await.unwrap();
/// let slow = std::future::pending::<()>();
/// assert_eq!(sleeper.timeout(Duration::from_millis(2), slow).await, Err(TimeoutError::Elapsed));
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Sleeper {
    timer: Timer<Wakeup>,
}

impl Sleeper {
    /// A sleeper on an engine with the default settings.
    pub fn new() -> Result<Sleeper, BuildError> {
        Sleeper::with_builder(Timer::builder())
    }

    /// A sleeper on an engine configured by `builder` (tick, shards, clock...). The driver
    /// wakes the tasks itself, so there is no delivery to choose.
    pub fn with_builder(builder: TimerBuilder<Wakeup>) -> Result<Sleeper, BuildError> {
        let timer = builder.build_with(Sink::Inline(Arc::new(|e| Wakeup::fire(e.value))))?;
        Ok(Sleeper { timer })
    }

    /// The engine behind this sleeper (for `stats()` or `shutdown()`).
    pub fn timer(&self) -> &Timer<Wakeup> {
        &self.timer
    }

    /// A future that completes `delay` from now (rounded up to the tick), or with
    /// [`EngineShutdown`] if the engine shuts down first (once the timers `shutdown` handed
    /// back are dropped) or refuses the timer. The timer is scheduled now, and
    /// cancelled if the future is dropped before it fires.
    pub fn sleep(&self, delay: Duration) -> Sleep {
        let now = self.timer.now();
        // Past what an `Instant` holds: 30 years, which never fires either (as tokio does).
        let deadline = now
            .checked_add(delay)
            .or_else(|| now.checked_add(FAR_FUTURE))
            .unwrap_or(now);
        self.sleep_until(deadline)
    }

    /// A future that completes at `deadline` (rounded up to the tick; at once if it has
    /// passed), as [`sleep`](Self::sleep) does.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::{Duration, Instant};
    /// use delaywheel::sleep::Sleeper;
    ///
    /// let sleeper = Sleeper::new().unwrap();
    /// let deadline = Instant::now() + Duration::from_millis(2);
    /// sleeper.sleep_until(deadline).await.unwrap();
    /// assert!(Instant::now() >= deadline);
    /// # }
    /// ```
    pub fn sleep_until(&self, deadline: Instant) -> Sleep {
        let state = Arc::new(SleepState::default());
        let id = self.timer.schedule_at(Wakeup(state.clone()), deadline).ok();
        Sleep {
            state,
            id,
            deadline,
            timer: self.timer.clone(),
        }
    }

    /// Runs `future` with a deadline `delay` from now. It resolves to the future's output, to
    /// [`TimeoutError::Elapsed`] at the deadline, or to [`TimeoutError::Shutdown`] if the
    /// engine shuts down first (then the future is not polled again). Each poll polls `future`
    /// first: on an engine already shut down (which refuses the timer), a `future` ready at
    /// its first poll still gives its output.
    ///
    /// It runs on the engine's clock: tokio's paused clock does not move it. See the
    /// [module docs](self#deterministic-tests-a-manual-clock-not-tokios-paused-one) for
    /// deterministic tests on a manual clock.
    pub fn timeout<F: Future>(&self, delay: Duration, future: F) -> Timeout<F> {
        Timeout {
            future,
            sleep: self.sleep(delay),
        }
    }

    /// Runs `future` with the deadline `deadline`, as [`timeout`](Self::timeout) does.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::{Duration, Instant};
    /// use delaywheel::sleep::{Sleeper, TimeoutError};
    ///
    /// let sleeper = Sleeper::new().unwrap();
    /// let deadline = Instant::now() + Duration::from_millis(2);
    /// let slow = std::future::pending::<()>();
    /// assert_eq!(sleeper.timeout_at(deadline, slow).await, Err(TimeoutError::Elapsed));
    /// assert_eq!(sleeper.timeout_at(deadline, async { 7 }).await, Ok(7));
    /// # }
    /// ```
    pub fn timeout_at<F: Future>(&self, deadline: Instant, future: F) -> Timeout<F> {
        Timeout {
            future,
            sleep: self.sleep_until(deadline),
        }
    }
}

/// The future returned by [`Sleeper::sleep`].
#[must_use = "futures do nothing unless awaited"]
pub struct Sleep {
    state: Arc<SleepState>,
    id: Option<TimerId>,
    /// As asked for (not rounded to the tick).
    deadline: Instant,
    timer: Timer<Wakeup>,
}

impl Sleep {
    /// When this sleep completes, as asked for (the engine fires it at the tick boundary at or
    /// after this; a delay past what an `Instant` holds is taken as 30 years).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use delaywheel::sleep::Sleeper;
    ///
    /// let sleeper = Sleeper::new().unwrap();
    /// let at = Instant::now() + Duration::from_secs(30);
    /// let mut sleep = sleeper.sleep_until(at);
    /// assert_eq!(sleep.deadline(), at);
    /// sleep.reset(at + Duration::from_secs(30));
    /// assert_eq!(sleep.deadline(), at + Duration::from_secs(30));
    /// ```
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the sleep has completed: its timer fired (an engine shutdown does not count).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// use delaywheel::sleep::Sleeper;
    ///
    /// let sleeper = Sleeper::new().unwrap();
    /// let mut sleep = sleeper.sleep(Duration::from_millis(5));
    /// assert!(!sleep.is_elapsed());
    /// (&mut sleep).await.unwrap();
    /// assert!(sleep.is_elapsed());
    /// # }
    /// ```
    pub fn is_elapsed(&self) -> bool {
        self.state.state.load(SeqCst) == FIRED
    }

    /// Moves the sleep to complete at `deadline` instead, whether or not it has completed
    /// already (then it is pending again), as tokio's `Sleep::reset` does. A pending sleep
    /// keeps its registration: the engine moves its timer in the wheel, an O(1) reset, not a
    /// cancel and a new insert. On an engine that has shut down, the sleep then completes
    /// with [`EngineShutdown`].
    ///
    /// The idle-timeout pattern: one sleep, reset on every read.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::{Duration, Instant};
    /// use delaywheel::sleep::Sleeper;
    ///
    /// let sleeper = Sleeper::new().unwrap();
    /// let idle = Duration::from_millis(5);
    /// let mut sleep = sleeper.sleep(idle);
    /// for _read in 0..3 {
    ///     // ... a read arrived: the connection is not idle.
    ///     sleep.reset(Instant::now() + idle);
    /// }
    /// (&mut sleep).await.unwrap(); // no read for `idle`: close the connection
    /// assert!(sleep.is_elapsed());
    /// # }
    /// ```
    pub fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if let Some(id) = self.id {
            if self.state.state.load(SeqCst) == PENDING && self.timer.reset_at(id, deadline) {
                return;
            }
        }
        // Fired (or firing: its wake-up is on the way, and must not complete the new one), or
        // never scheduled: a new registration, which wakes the task that waits on this sleep.
        if let Some(id) = self.id.take() {
            drop(self.timer.cancel(id));
        }
        let waiting = self.state.waker.take();
        self.state = Arc::new(SleepState::default());
        if let Some(waker) = waiting {
            self.state.waker.register(&waker);
        }
        self.id = self
            .timer
            .schedule_at(Wakeup(self.state.clone()), deadline)
            .ok();
    }
}

impl fmt::Debug for Sleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sleep").field("id", &self.id).finish()
    }
}

impl Future for Sleep {
    type Output = Result<(), EngineShutdown>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let check = |s: &SleepState| match s.state.load(SeqCst) {
            FIRED => Some(Ok(())),
            SHUT_DOWN => Some(Err(EngineShutdown)),
            _ => None,
        };
        // Scheduling failed (the engine was already shut down).
        if self.id.is_none() {
            return Poll::Ready(Err(EngineShutdown));
        }
        if let Some(done) = check(&self.state) {
            return Poll::Ready(done);
        }
        self.state.waker.register(cx.waker());
        match check(&self.state) {
            Some(done) => Poll::Ready(done),
            None => Poll::Pending,
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        // Nobody waits any more: the cancelled `Wakeup` must not wake the task dropping us.
        drop(self.state.waker.take());
        if let Some(id) = self.id {
            if self.state.state.load(SeqCst) == PENDING {
                // Cancel-on-drop: the wheel forgets the timer at once.
                drop(self.timer.cancel(id));
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The future returned by [`Sleeper::timeout`].
    #[must_use = "futures do nothing unless awaited"]
    pub struct Timeout<F> {
        #[pin]
        future: F,
        sleep: Sleep,
    }
}

impl<F> fmt::Debug for Timeout<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timeout")
            .field("sleep", &self.sleep)
            .finish()
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, TimeoutError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(v) = this.future.poll(cx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(this.sleep).poll(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Err(TimeoutError::Elapsed)),
            Poll::Ready(Err(EngineShutdown)) => Poll::Ready(Err(TimeoutError::Shutdown)),
            Poll::Pending => Poll::Pending,
        }
    }
}
