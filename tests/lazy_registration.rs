//! Lazy registration of the engine's futures, checked with the engine's counters, not with
//! timing: a `Sleep` goes into the wheel at its first poll, a `Timeout` at the first poll at
//! which its future waits, and a timeout whose future answers is cancelled then and there.
//! All on a manual clock with a manual driver, so every step is deterministic.
#![cfg(feature = "futures")]

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use delaywheel::sleep::{Sleeper, TimeoutError};
use delaywheel::{ManualClock, Timer};

const MS: Duration = Duration::from_millis(1);

fn manual() -> (Sleeper, ManualClock) {
    let clock = ManualClock::new();
    let sleeper =
        Sleeper::with_builder(Timer::builder().manual_clock(&clock).manual_driver()).unwrap();
    (sleeper, clock)
}

fn poll<F: Future>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

/// A future that is pending on its first `n` polls, then ready with `n`.
struct PendingFor(usize);

impl Future for PendingFor {
    type Output = usize;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
        if self.0 == 0 {
            return Poll::Ready(7);
        }
        self.0 -= 1;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[test]
fn a_timeout_ready_at_its_first_poll_registers_nothing() {
    let (sleeper, _clock) = manual();
    for _ in 0..1000 {
        let call = pin!(sleeper.timeout(Duration::from_secs(5), async { 1 }));
        assert_eq!(poll(call), Poll::Ready(Ok(1)));
    }
    let stats = sleeper.timer().stats();
    assert_eq!((stats.scheduled, stats.cancelled), (0, 0), "{stats:?}");
    assert_eq!(sleeper.timer().len(), 0);
}

#[test]
fn a_timeout_registers_at_its_first_pending_poll_and_is_cancelled_when_the_answer_comes() {
    let (sleeper, _clock) = manual();
    let mut call = pin!(sleeper.timeout(Duration::from_secs(5), PendingFor(1)));
    assert_eq!(
        sleeper.timer().stats().scheduled,
        0,
        "registered at creation"
    );
    assert!(poll(call.as_mut()).is_pending());
    assert_eq!(sleeper.timer().stats().scheduled, 1);
    assert_eq!(sleeper.timer().len(), 1);
    assert_eq!(poll(call.as_mut()), Poll::Ready(Ok(7)));
    // Cancelled by the answer, while the future itself is still alive.
    assert_eq!(sleeper.timer().stats().cancelled, 1);
    assert_eq!(sleeper.timer().len(), 0);
}

#[test]
fn a_timeouts_deadline_counts_from_its_first_pending_poll() {
    let (sleeper, clock) = manual();
    let mut call = pin!(sleeper.timeout(100 * MS, std::future::pending::<()>()));
    // Created, then first polled 40 ms later: the deadline is 100 ms after that poll.
    clock.advance(40 * MS);
    assert!(poll(call.as_mut()).is_pending());
    clock.advance(99 * MS);
    sleeper.timer().fire_due();
    assert!(
        poll(call.as_mut()).is_pending(),
        "early: counted from creation"
    );
    clock.advance(MS);
    sleeper.timer().fire_due();
    assert_eq!(poll(call.as_mut()), Poll::Ready(Err(TimeoutError::Elapsed)));
}

#[test]
fn a_timeout_at_a_fixed_deadline_keeps_it_whenever_it_is_first_polled() {
    let (sleeper, clock) = manual();
    let deadline = clock.now() + 100 * MS;
    let mut call = pin!(sleeper.timeout_at(deadline, std::future::pending::<()>()));
    clock.advance(40 * MS);
    assert!(poll(call.as_mut()).is_pending());
    clock.advance(60 * MS);
    sleeper.timer().fire_due();
    assert_eq!(poll(call.as_mut()), Poll::Ready(Err(TimeoutError::Elapsed)));
}

#[test]
fn a_sleep_registers_at_its_first_poll_and_its_deadline_counts_from_creation() {
    let (sleeper, clock) = manual();
    let mut unpolled = sleeper.sleep(100 * MS);
    unpolled.reset(clock.now() + 200 * MS);
    drop(unpolled);
    let mut sleep = pin!(sleeper.sleep(100 * MS));
    let stats = sleeper.timer().stats();
    assert_eq!(
        (stats.scheduled, stats.cancelled, stats.reset),
        (0, 0, 0),
        "an unpolled sleep touched the wheel: {stats:?}"
    );
    clock.advance(40 * MS);
    assert!(poll(sleep.as_mut()).is_pending());
    assert_eq!(sleeper.timer().stats().scheduled, 1);
    clock.advance(60 * MS);
    sleeper.timer().fire_due();
    assert_eq!(poll(sleep.as_mut()), Poll::Ready(Ok(())));
}

#[test]
fn a_sleep_first_polled_after_its_deadline_completes_without_a_timer() {
    let (sleeper, clock) = manual();
    let mut sleep = pin!(sleeper.sleep(10 * MS));
    clock.advance(10 * MS);
    assert_eq!(poll(sleep.as_mut()), Poll::Ready(Ok(())));
    assert!(sleep.is_elapsed());
    assert_eq!(sleeper.timer().stats().scheduled, 0);
}

#[test]
fn a_leaked_sleeper_runs_the_same_futures() {
    let (sleeper, clock) = manual();
    let leaked = sleeper.leak();
    let again = leaked.clone().leak();
    let mut call = pin!(again.timeout(10 * MS, std::future::pending::<()>()));
    assert!(poll(call.as_mut()).is_pending());
    assert_eq!(leaked.timer().len(), 1, "not the same engine");
    clock.advance(10 * MS);
    leaked.timer().fire_due();
    assert_eq!(poll(call.as_mut()), Poll::Ready(Err(TimeoutError::Elapsed)));
    drop(leaked.timer().shutdown());
    let mut late = pin!(again.timeout(10 * MS, std::future::pending::<()>()));
    assert_eq!(
        poll(late.as_mut()),
        Poll::Ready(Err(TimeoutError::Shutdown))
    );
}
