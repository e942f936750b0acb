//! `Sleep::reset`, `deadline`, `is_elapsed`, `sleep_until` and `timeout_at`, and
//! `Timer::reset_at` and `Timer::deadline`. These are our own versions of the reset cases in
//! tokio's `tests/time_sleep.rs`, run on a manual clock with a manual driver, so each step is
//! deterministic: the clock moves only when a test advances it, and timers fire only in
//! `fire_due`.
#![cfg(feature = "futures")]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use delaywheel::sleep::{EngineShutdown, Sleep, Sleeper, TimeoutError};
use delaywheel::{ManualClock, Timer};

const MS: Duration = Duration::from_millis(1);

/// A sleeper on a manual clock whose timers fire only in `fire_due`.
fn manual() -> (Sleeper, ManualClock) {
    let clock = ManualClock::new();
    let sleeper =
        Sleeper::with_builder(Timer::builder().manual_clock(&clock).manual_driver()).unwrap();
    (sleeper, clock)
}

/// Counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

fn poll(sleep: &mut Sleep, waker: &Waker) -> Poll<Result<(), EngineShutdown>> {
    Pin::new(sleep).poll(&mut Context::from_waker(waker))
}

/// Advances the clock by `by` and fires what is due.
fn advance(sleeper: &Sleeper, clock: &ManualClock, by: Duration) {
    clock.advance(by);
    sleeper.timer().fire_due();
}

/// tokio's `reset_future_sleep_before_fire`: a pending sleep moved later does not complete at
/// its old deadline, and completes at its new one.
#[test]
fn a_pending_sleep_reset_later_completes_at_the_new_deadline() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let waker = Waker::noop();
    let mut sleep = sleeper.sleep(100 * MS);
    assert!(poll(&mut sleep, waker).is_pending());
    sleep.reset(start + 200 * MS);
    assert_eq!(sleep.deadline(), start + 200 * MS);
    advance(&sleeper, &clock, 100 * MS);
    assert!(
        poll(&mut sleep, waker).is_pending(),
        "fired at the old deadline"
    );
    assert!(!sleep.is_elapsed());
    advance(&sleeper, &clock, 99 * MS);
    assert!(poll(&mut sleep, waker).is_pending(), "fired early");
    advance(&sleeper, &clock, MS);
    assert_eq!(poll(&mut sleep, waker), Poll::Ready(Ok(())));
    assert!(sleep.is_elapsed());
}

/// tokio's `reset_past_sleep_before_fire` and `reset_sleep_to_past`: a pending sleep moved to
/// a deadline that has passed completes at the next turn.
#[test]
fn a_pending_sleep_reset_into_the_past_completes_at_the_next_turn() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let waker = Waker::noop();
    let mut sleep = sleeper.sleep(100 * MS);
    assert!(poll(&mut sleep, waker).is_pending());
    advance(&sleeper, &clock, 50 * MS);
    sleep.reset(start + 10 * MS);
    assert!(
        poll(&mut sleep, waker).is_pending(),
        "completed with no turn"
    );
    sleeper.timer().fire_due();
    assert_eq!(poll(&mut sleep, waker), Poll::Ready(Ok(())));
}

/// tokio's `reset_future_sleep_after_fire`: a completed sleep reset to a later deadline is
/// pending again, wakes the task that polls it, and completes at its new deadline.
#[test]
fn a_completed_sleep_reset_is_pending_again_and_wakes_its_task() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let count = Arc::new(Count::default());
    let waker = Waker::from(count.clone());
    let mut sleep = sleeper.sleep(10 * MS);
    advance(&sleeper, &clock, 10 * MS);
    assert_eq!(poll(&mut sleep, &waker), Poll::Ready(Ok(())));
    sleep.reset(start + 30 * MS);
    assert!(!sleep.is_elapsed());
    assert!(poll(&mut sleep, &waker).is_pending());
    let woken = count.0.load(SeqCst);
    advance(&sleeper, &clock, 19 * MS);
    assert!(poll(&mut sleep, &waker).is_pending(), "fired early");
    advance(&sleeper, &clock, MS);
    assert!(count.0.load(SeqCst) > woken, "the task was not woken");
    assert_eq!(poll(&mut sleep, &waker), Poll::Ready(Ok(())));
}

/// A pending sleep keeps its registration across resets: the engine moves its timer (one
/// wheel reset each), it does not cancel it and insert a new one.
#[test]
fn a_reset_of_a_pending_sleep_moves_its_timer_and_inserts_none() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let mut sleep = sleeper.sleep(100 * MS);
    // Registered at its first poll.
    assert!(poll(&mut sleep, Waker::noop()).is_pending());
    let before = sleeper.timer().stats();
    assert_eq!(before.scheduled, 1);
    for i in 1..=10u32 {
        sleep.reset(start + 100 * MS + i * MS);
    }
    let after = sleeper.timer().stats();
    assert_eq!(after.reset - before.reset, 10);
    assert_eq!(
        after.scheduled, before.scheduled,
        "a reset inserted a timer"
    );
    assert_eq!(
        after.cancelled, before.cancelled,
        "a reset cancelled its timer"
    );
    assert_eq!(sleeper.timer().len(), 1);
    drop(sleep);
    assert_eq!(
        sleeper.timer().len(),
        0,
        "dropping the sleep cancels its timer"
    );
}

/// A sleep whose timer fires while the waker of the first registration is on its way does not
/// complete the new one: a reset right after the fire starts a new registration.
#[test]
fn a_reset_right_after_the_fire_is_not_completed_by_the_old_wake_up() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let waker = Waker::noop();
    let mut sleep = sleeper.sleep(10 * MS);
    advance(&sleeper, &clock, 10 * MS); // fired, not polled yet
    sleep.reset(start + 50 * MS);
    assert!(poll(&mut sleep, waker).is_pending());
    advance(&sleeper, &clock, 40 * MS);
    assert_eq!(poll(&mut sleep, waker), Poll::Ready(Ok(())));
}

/// On an engine that shut down, a reset sleep completes with `EngineShutdown`, not never.
#[test]
fn a_reset_after_shutdown_completes_with_engine_shutdown() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let waker = Waker::noop();
    let mut sleep = sleeper.sleep(10 * MS);
    drop(sleeper.timer().shutdown());
    sleep.reset(start + 50 * MS);
    assert_eq!(poll(&mut sleep, waker), Poll::Ready(Err(EngineShutdown)));
}

/// `sleep_until` completes at its deadline, `timeout_at` gives the output or `Elapsed`.
#[test]
fn sleep_until_and_timeout_at_use_the_deadline_given() {
    let (sleeper, clock) = manual();
    let start = clock.now();
    let waker = Waker::noop();
    let mut sleep = sleeper.sleep_until(start + 20 * MS);
    assert_eq!(sleep.deadline(), start + 20 * MS);
    advance(&sleeper, &clock, 19 * MS);
    assert!(poll(&mut sleep, waker).is_pending());
    advance(&sleeper, &clock, MS);
    assert_eq!(poll(&mut sleep, waker), Poll::Ready(Ok(())));

    let mut cx = Context::from_waker(waker);
    let mut pending =
        Box::pin(sleeper.timeout_at(clock.now() + 5 * MS, std::future::pending::<()>()));
    assert!(pending.as_mut().poll(&mut cx).is_pending());
    advance(&sleeper, &clock, 5 * MS);
    assert_eq!(
        pending.as_mut().poll(&mut cx),
        Poll::Ready(Err(TimeoutError::Elapsed))
    );
    let mut ready = Box::pin(sleeper.timeout_at(clock.now() + 5 * MS, async { 3 }));
    assert_eq!(ready.as_mut().poll(&mut cx), Poll::Ready(Ok(3)));
}

/// `Timer::reset_at` moves a pending timer to an instant and keeps its id; `deadline` reads
/// it back rounded up to the tick. Neither works on a timer that fired or was cancelled.
#[test]
fn timer_reset_at_and_deadline() {
    let clock = ManualClock::new();
    let (timer, fired) = Timer::builder()
        .manual_clock(&clock)
        .manual_driver()
        .build_channel(None)
        .unwrap();
    let start = clock.now();
    let id = timer.schedule_at("a", start + 10 * MS).unwrap();
    assert_eq!(timer.deadline(id), Some(start + 10 * MS));
    assert!(timer.reset_at(id, start + 30 * MS + Duration::from_micros(200)));
    // The default tick is 1 ms: rounded up.
    assert_eq!(timer.deadline(id), Some(start + 31 * MS));
    clock.advance(30 * MS);
    assert_eq!(timer.fire_due(), 0, "fired before its deadline");
    clock.advance(MS);
    assert_eq!(timer.fire_due(), 1);
    assert_eq!(fired.try_recv().unwrap().value, "a");
    assert!(!timer.reset_at(id, start + 50 * MS), "reset a fired timer");
    assert_eq!(timer.deadline(id), None);
    let other = timer.schedule("b", 5 * MS).unwrap();
    assert!(timer.cancel(other).is_some());
    assert!(!timer.reset_at(other, Instant::now()));
}
