//! The wake handshake between producers and the driver: how a producer that inserts a timer
//! earlier than anything the driver sleeps for makes sure the driver sees it, without a write
//! to shared memory on every schedule.
//!
//! # Ground rules
//!
//! * The driver calls [`Wake::scanning`] *before* it scans the shards and
//!   [`Wake::may_park`] *after*, with the earliest deadline it found; it parks only when
//!   `may_park` says so. A producer calls [`Wake::timer_due`] after its insert, with the shard's
//!   lock released. So an insert the scan did not see finds `next_wake` at `u64::MAX` or at a
//!   deadline later than its own (the scan took the shard's lock after the insert otherwise),
//!   and wakes the driver.
//! * The wake-up is the `woken` flag, set before the unpark and checked (and cleared) by the
//!   driver in `may_park`, right before it parks: the park token alone is not enough, because a
//!   delivery blocked on a full channel parks the driver thread inside crossbeam, which
//!   consumes the token.
//! * The flag has two "on" states: `WAKING` (set, its setter has not unparked yet) and `WOKEN`
//!   (set, and unparked since). Only the producer that turns the flag on unparks as a rule; one
//!   that finds it `WOKEN` does nothing (the driver has a wake-up to consume, and a turn after
//!   it), and one that finds it `WAKING` unparks too, so that a setter descheduled before its
//!   unpark delays no timer. A count of wake-ups above the state bits keeps a setter's late
//!   `WAKING → WOKEN` off a later setter's `WAKING`.
//!
//! `tests/loom_wake.rs` compiles this very file against loom's atomics (through `super::sync`)
//! and explores every interleaving of a driver and producers that use it.

use crossbeam_utils::CachePadded;

use super::sync::{AtomicU64, SeqCst};

/// `Wake::woken`'s state, in its low two bits: no wake-up pending.
pub(crate) const IDLE: u64 = 0;
/// A wake-up pending, whose setter has not unparked the driver yet.
pub(crate) const WAKING: u64 = 1;
/// A wake-up pending, and the driver unparked since it was set.
pub(crate) const WOKEN: u64 = 2;
/// The state bits of `Wake::woken`; the bits above count the wake-ups set, so that a setter's
/// late `WAKING → WOKEN` cannot land on another setter's `WAKING` (ABA).
pub(crate) const WAKE_STATE: u64 = 3;
/// One wake-up in the count above the state bits.
pub(crate) const WAKE_ONE: u64 = 4;

/// The two words of the handshake; see the ground rules.
#[derive(Debug)]
pub(crate) struct Wake {
    /// The earliest deadline tick the driver sleeps until; `u64::MAX` while it scans, or while
    /// nothing is pending. Both fields are `pub(crate)` for the loom model's deliberately broken
    /// producer only; the engine goes through the methods.
    pub(crate) next_wake: AtomicU64,
    /// Set by a producer that wakes the driver (`WAKING`, then `WOKEN` once it has unparked
    /// it), cleared (`IDLE`) by the driver. On a cache line of its own: producers write it
    /// (while the wheel is empty, on every schedule), and it shared a line with a flag every
    /// schedule reads.
    pub(crate) woken: CachePadded<AtomicU64>,
}

impl Wake {
    /// No wake-up pending, and the driver not yet sleeping for any deadline.
    pub(crate) fn new() -> Self {
        Wake {
            next_wake: AtomicU64::new(u64::MAX),
            woken: CachePadded::new(AtomicU64::new(IDLE)),
        }
    }

    /// A producer inserted a timer due at `tick`: wakes the driver (with `unpark`) if that is
    /// earlier than what it sleeps until.
    #[inline]
    pub(crate) fn timer_due(&self, tick: u64, unpark: impl Fn()) {
        if tick < self.next_wake.load(SeqCst) {
            self.wake(unpark);
        }
    }

    /// Wakes the driver: the flag first (it survives an unpark that a blocked delivery
    /// swallows), then `unpark` (it ends a park in progress).
    pub(crate) fn wake(&self, unpark: impl Fn()) {
        // Already on: the driver has yet to consume a wake-up, and was unparked for it. Read
        // before it is written: while the wheel is empty every schedule comes here, and a
        // write per schedule made producers on different cores fight over the line (`perf`:
        // 41% of `schedule`'s samples on the swap). A producer that reads it on still has its
        // timer seen: the driver's swap that clears it comes after that read, and the turn
        // after that swap locks this shard after the insert (or the swap would have happened
        // before the read, through the shard's lock, and the read would see it cleared).
        // The wake-up then rests on the producer that set it, which unparks right after; while
        // it has not (`WAKING`: it may have been descheduled in between), others unpark too.
        let seen = self.woken.load(SeqCst);
        match seen & WAKE_STATE {
            WOKEN => return,
            WAKING => return unpark(),
            _ => {}
        }
        let waking = (seen & !WAKE_STATE).wrapping_add(WAKE_ONE) | WAKING;
        match self.woken.compare_exchange(seen, waking, SeqCst, SeqCst) {
            Ok(_) => {
                unpark();
                // Unless the driver has cleared it meanwhile (it then had its wake-up); the
                // count makes this fail, too, on a later setter's `WAKING`.
                let woken = (waking & !WAKE_STATE) | WOKEN;
                let _ = self.woken.compare_exchange(waking, woken, SeqCst, SeqCst);
            }
            Err(now) if now & WAKE_STATE == WAKING => unpark(),
            Err(_) => {}
        }
    }

    /// The driver is about to scan the shards: until [`may_park`](Self::may_park), every
    /// insert wakes it.
    pub(crate) fn scanning(&self) {
        self.next_wake.store(u64::MAX, SeqCst);
    }

    /// The driver scanned, and found `next` the earliest pending deadline. `false`: a producer
    /// woke it since [`scanning`](Self::scanning) (its unpark may have been swallowed by a
    /// delivery that blocked), so it must turn again; the wake-up is consumed. `true`: it may
    /// park until `next`, which is published, so that a later insert wakes it only if earlier.
    pub(crate) fn may_park(&self, next: Option<u64>) -> bool {
        if self.woken.fetch_and(!WAKE_STATE, SeqCst) & WAKE_STATE != IDLE {
            return false;
        }
        if let Some(tick) = next {
            self.next_wake.store(tick, SeqCst);
        }
        true
    }
}
