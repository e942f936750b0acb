//! `sleep` and `timeout` futures backed by the engine instead of the runtime's global timer
//! (feature `futures`; they work on any executor).
//!
//! Each future puts one timer in the wheel at its first poll that waits (lazy registration: a
//! timeout around a future that is ready at once costs no timer and no clock read) and cancels
//! it when dropped. The driver thread wakes the task directly when the timer fires.
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
//! * Registration is lazy: a [`Sleep`] goes into the wheel at its first poll (first polled
//!   past its deadline, it completes with none), and a [`Timeout`] whose future is ready at its
//!   first poll reads no clock and registers nothing; its timer is cancelled as soon as the
//!   future answers. `tests/lazy_registration.rs`, by the engine's counters.
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
/// request timeouts off the runtime's global timer. Cheap to clone: two reference counts, or
/// none after [`leak`](Self::leak).
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
    engine: Engine,
}

/// The engine a sleeper, sleep or timeout uses: its own handle (two reference counts), or a
/// reference to one that lives for the rest of the process ([`Sleeper::leak`]), which costs
/// nothing to copy and touches no shared cache line.
#[derive(Clone, Debug)]
enum Engine {
    Owned(Timer<Wakeup>),
    Static(&'static Timer<Wakeup>),
}

impl std::ops::Deref for Engine {
    type Target = Timer<Wakeup>;

    fn deref(&self) -> &Timer<Wakeup> {
        match self {
            Engine::Owned(timer) => timer,
            Engine::Static(timer) => timer,
        }
    }
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
        Ok(Sleeper {
            engine: Engine::Owned(timer),
        })
    }

    /// The same engine, kept for the rest of the process: this sleeper's clones, sleeps and
    /// timeouts then hold a plain reference to it instead of a handle with two reference
    /// counts. That is what a timeout per request wants on a multi-thread runtime, where every
    /// worker would otherwise update the same two counters for each request (`benches/http.rs`
    /// measures both). The engine's memory is never freed, and its driver thread runs until
    /// `timer().shutdown()`. A sleeper leaked already is returned as it is.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// use delaywheel::sleep::Sleeper;
    ///
    /// let sleeper = Sleeper::new().unwrap().leak();
    /// let answer = sleeper.timeout(Duration::from_secs(5), async { 42 }).await;
    /// assert_eq!(answer, Ok(42));
    /// # }
    /// ```
    pub fn leak(self) -> Sleeper {
        match self.engine {
            Engine::Owned(timer) => Sleeper {
                engine: Engine::Static(Box::leak(Box::new(timer))),
            },
            Engine::Static(_) => self,
        }
    }

    /// The engine behind this sleeper (for `stats()` or `shutdown()`).
    pub fn timer(&self) -> &Timer<Wakeup> {
        &self.engine
    }

    /// A future that completes `delay` from now (rounded up to the tick), or with
    /// [`EngineShutdown`] if the engine shuts down first (once the timers `shutdown` handed
    /// back are dropped) or refuses the timer.
    ///
    /// The deadline counts from this call, but nothing is put in the wheel until the first
    /// poll: a sleep dropped unpolled costs no schedule and no cancel, and a sleep first polled
    /// at or after its deadline completes at once without one. A registered sleep is cancelled
    /// when it is dropped before it fires.
    pub fn sleep(&self, delay: Duration) -> Sleep {
        let now = self.engine.now();
        self.sleep_until(far(now, delay))
    }

    /// A future that completes at `deadline` (rounded up to the tick; at once if it has
    /// passed), registered at its first poll as [`sleep`](Self::sleep)'s is.
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
        Sleep::new(self.engine.clone(), When::At(deadline))
    }

    /// Runs `future` with a deadline `delay` after it first waits. It resolves to the future's
    /// output, to [`TimeoutError::Elapsed`] at the deadline, or to [`TimeoutError::Shutdown`]
    /// if the engine shuts down first (then the future is not polled again).
    ///
    /// Lazy, as a timeout around a call that usually answers at once should be: each poll
    /// polls `future` first, and a `future` ready at its first poll costs no clock read, no
    /// allocation and no timer. The clock is read, and the timer registered, at the first
    /// poll at which `future` is pending, and **the deadline is `delay` from that poll**: later
    /// than `delay` from this call when the first poll comes later, never earlier. Use
    /// [`timeout_at`](Self::timeout_at) for a deadline fixed in advance.
    ///
    /// It runs on the engine's clock: tokio's paused clock does not move it. See the
    /// [module docs](self#deterministic-tests-a-manual-clock-not-tokios-paused-one) for
    /// deterministic tests on a manual clock.
    pub fn timeout<F: Future>(&self, delay: Duration, future: F) -> Timeout<F> {
        Timeout {
            future,
            sleep: Sleep::new(self.engine.clone(), When::After(delay)),
        }
    }

    /// Runs `future` with the deadline `deadline`, as [`timeout`](Self::timeout) does (lazily:
    /// nothing is registered while `future` is ready at its first poll).
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
            sleep: Sleep::new(self.engine.clone(), When::At(deadline)),
        }
    }
}

/// `delay` after `now`; past what an `Instant` holds, 30 years, which never fires either (as
/// tokio does).
fn far(now: Instant, delay: Duration) -> Instant {
    now.checked_add(delay)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// When a sleep completes: at an instant, or (a [`Timeout`]'s, until its first pending poll)
/// a delay after the poll that registers it.
#[derive(Clone, Copy, Debug)]
enum When {
    At(Instant),
    After(Duration),
}

/// Where a sleep stands with the engine.
#[derive(Debug)]
enum Registration {
    /// Nothing in the wheel yet: the first poll registers it.
    Unregistered,
    /// Its timer is (or was) in the wheel; `state` says whether it fired.
    Registered { state: Arc<SleepState>, id: TimerId },
    /// Completed with no timer: its deadline had passed at its first poll.
    Passed,
    /// The engine refused the timer: it was shut down.
    Refused,
}

/// The future returned by [`Sleeper::sleep`].
#[must_use = "futures do nothing unless awaited"]
pub struct Sleep {
    registration: Registration,
    /// As asked for (not rounded to the tick).
    when: When,
    engine: Engine,
}

impl Sleep {
    fn new(engine: Engine, when: When) -> Sleep {
        Sleep {
            registration: Registration::Unregistered,
            when,
            engine,
        }
    }

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
        match self.when {
            When::At(at) => at,
            // Only a timeout's sleep before its first pending poll, which no caller sees.
            When::After(delay) => far(self.engine.now(), delay),
        }
    }

    /// Whether the sleep has completed: its timer fired, or its deadline had passed when it
    /// was first polled (an engine shutdown does not count).
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
        match &self.registration {
            Registration::Registered { state, .. } => state.state.load(SeqCst) == FIRED,
            Registration::Passed => true,
            Registration::Unregistered | Registration::Refused => false,
        }
    }

    /// Moves the sleep to complete at `deadline` instead, whether or not it has completed
    /// already (then it is pending again), as tokio's `Sleep::reset` does. A pending sleep
    /// keeps its registration: the engine moves its timer in the wheel, an O(1) reset, not a
    /// cancel and a new insert. A sleep not registered yet only takes the new deadline. On an
    /// engine that has shut down, the sleep then completes with [`EngineShutdown`].
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
        self.when = When::At(deadline);
        let Registration::Registered { state, id } = &mut self.registration else {
            // Not in the wheel: the next poll registers it at the new deadline (or, after a
            // refusal, asks the engine again).
            self.registration = Registration::Unregistered;
            return;
        };
        if state.state.load(SeqCst) == PENDING && self.engine.reset_at(*id, deadline) {
            return;
        }
        // Fired (or firing: its wake-up is on the way, and must not complete the new one), or
        // woken by a shutdown: a new registration, which wakes the task that waits on this
        // sleep.
        drop(self.engine.cancel(*id));
        let waiting = state.waker.take();
        let fresh = Arc::new(SleepState::default());
        if let Some(waker) = waiting {
            fresh.waker.register(&waker);
        }
        self.registration = match self.engine.schedule_at(Wakeup(fresh.clone()), deadline) {
            Ok(id) => Registration::Registered { state: fresh, id },
            Err(_) => Registration::Refused,
        };
    }

    /// The first poll: completes at once if the deadline has passed, else puts the timer in
    /// the wheel (resolving a delay against the clock now) and waits for it.
    fn register(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), EngineShutdown>> {
        let now = self.engine.now();
        let deadline = match self.when {
            When::At(at) => at,
            When::After(delay) => far(now, delay),
        };
        self.when = When::At(deadline);
        if deadline <= now {
            self.registration = Registration::Passed;
            return Poll::Ready(Ok(()));
        }
        let state = Arc::new(SleepState::default());
        match self.engine.schedule_at(Wakeup(state.clone()), deadline) {
            Ok(id) => {
                state.waker.register(cx.waker());
                let done = fired(&state);
                self.registration = Registration::Registered { state, id };
                done.map_or(Poll::Pending, Poll::Ready)
            }
            Err(_) => {
                self.registration = Registration::Refused;
                Poll::Ready(Err(EngineShutdown))
            }
        }
    }
}

impl Sleep {
    /// Takes the timer out of the wheel, if it is there and pending: the timeout it served is
    /// over. The sleep is left unregistered.
    fn disarm(&mut self) {
        if let Registration::Registered { state, id } = &self.registration {
            drop(state.waker.take());
            if state.state.load(SeqCst) == PENDING {
                drop(self.engine.cancel(*id));
            }
            self.registration = Registration::Unregistered;
        }
    }
}

/// How a registered sleep ended, if it has.
fn fired(state: &SleepState) -> Option<Result<(), EngineShutdown>> {
    match state.state.load(SeqCst) {
        FIRED => Some(Ok(())),
        SHUT_DOWN => Some(Err(EngineShutdown)),
        _ => None,
    }
}

impl fmt::Debug for Sleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sleep")
            .field("registration", &self.registration)
            .finish()
    }
}

impl Future for Sleep {
    type Output = Result<(), EngineShutdown>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &this.registration {
            Registration::Unregistered => this.register(cx),
            Registration::Passed => Poll::Ready(Ok(())),
            Registration::Refused => Poll::Ready(Err(EngineShutdown)),
            Registration::Registered { state, .. } => {
                if let Some(done) = fired(state) {
                    return Poll::Ready(done);
                }
                state.waker.register(cx.waker());
                fired(state).map_or(Poll::Pending, Poll::Ready)
            }
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        // Cancel-on-drop: the wheel forgets the timer at once. Nobody waits any more, so the
        // cancelled `Wakeup` must not wake the task dropping us (`disarm` takes the waker).
        self.disarm();
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
            // The answer came: its timer is cancelled now, not when the future is dropped.
            this.sleep.disarm();
            return Poll::Ready(Ok(v));
        }
        match Pin::new(this.sleep).poll(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Err(TimeoutError::Elapsed)),
            Poll::Ready(Err(EngineShutdown)) => Poll::Ready(Err(TimeoutError::Shutdown)),
            Poll::Pending => Poll::Pending,
        }
    }
}
