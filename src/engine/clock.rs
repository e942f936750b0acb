//! Time for the engine: the clock it reads (real or manual) and the conversion between
//! `Instant`s and the wheel's `u64` ticks.
//!
//! Deadlines round **up** to the next tick and the current time rounds **down**, so a timer is
//! only ever taken out of the wheel once its deadline has truly passed: never early.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A wake-up registered on a manual clock, called after every advance; it returns whether to
/// keep it (whether its engine still exists).
type Wake = Arc<dyn Fn() -> bool + Send + Sync>;

/// A clock that tests move by hand, so time-dependent tests are deterministic and never sleep.
///
/// Cloning gives another handle to the same clock. It starts at the `Instant` it was created
/// and only moves when [`advance`](Self::advance) is called; an engine built on it is woken by
/// every advance.
///
/// ```
/// use std::time::Duration;
/// use delaywheel::ManualClock;
///
/// let clock = ManualClock::new();
/// let t0 = clock.now();
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now() - t0, Duration::from_millis(250));
/// ```
#[derive(Clone)]
pub struct ManualClock {
    now: Arc<Mutex<Instant>>,
    /// Called after every advance (each engine's driver registers a wake-up here).
    on_advance: Arc<Mutex<Vec<Wake>>>,
}

impl ManualClock {
    /// A manual clock reading the current real time, until it is advanced.
    pub fn new() -> ManualClock {
        ManualClock {
            now: Arc::new(Mutex::new(Instant::now())),
            on_advance: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The clock's current time.
    pub fn now(&self) -> Instant {
        *self.now.lock()
    }

    /// Moves the clock forward by `by` and wakes every engine built on it. A `by` so large that
    /// the `Instant` would overflow leaves the clock where it is and returns `false`.
    pub fn advance(&self, by: Duration) -> bool {
        {
            let mut now = self.now.lock();
            let Some(later) = now.checked_add(by) else {
                return false;
            };
            *now = later;
        }
        // Called with the list unlocked: a wake-up may end up dropping the last reference to
        // an engine, whose drop runs user code (values it still held), which may advance
        // this clock or build an engine on it.
        let wakes: Vec<Wake> = self.on_advance.lock().clone();
        let gone: Vec<Wake> = wakes.into_iter().filter(|wake| !wake()).collect();
        if !gone.is_empty() {
            self.on_advance
                .lock()
                .retain(|wake| !gone.iter().any(|g| Arc::ptr_eq(wake, g)));
        }
        true
    }

    pub(crate) fn on_advance(&self, f: Wake) {
        self.on_advance.lock().push(f);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now", &self.now())
            .finish()
    }
}

/// The clock an engine reads.
#[derive(Clone, Debug)]
pub(crate) enum Clock {
    /// `Instant::now()`: monotonic, never goes backwards.
    Monotonic,
    Manual(ManualClock),
}

impl Clock {
    #[inline]
    pub(crate) fn now(&self) -> Instant {
        match self {
            Clock::Monotonic => Instant::now(),
            Clock::Manual(c) => c.now(),
        }
    }
}

/// Converts between `Instant`s and ticks of `tick` length counted from `origin`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticks {
    origin: Instant,
    tick_ns: u64,
}

impl Ticks {
    /// `tick` must be at least 1 ns (the builder checks).
    pub(crate) fn new(origin: Instant, tick: Duration) -> Ticks {
        Ticks {
            origin,
            tick_ns: u64::try_from(tick.as_nanos()).unwrap_or(u64::MAX).max(1),
        }
    }

    /// Nanoseconds from the origin to `t` (0 before it), saturating at `u64::MAX` (584 years).
    #[inline]
    fn ns_since_origin(&self, t: Instant) -> u64 {
        let d = t.saturating_duration_since(self.origin);
        d.as_secs()
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::from(d.subsec_nanos()))
    }

    /// `ns / tick_ns`, rounded up. Plain `u64` arithmetic: a `u128` division is a slow library
    /// call, and this runs on every schedule.
    #[inline]
    fn ceil_ticks(&self, ns: u64) -> u64 {
        ns.div_ceil(self.tick_ns)
    }

    /// The tick at which a timer due at `deadline` may fire: rounded up. Deadlines before the
    /// origin map to 0; deadlines 584 years out saturate (they never fire, as intended).
    #[inline]
    pub(crate) fn deadline_tick(&self, deadline: Instant) -> u64 {
        match self.ns_since_origin(deadline) {
            u64::MAX => u64::MAX,
            ns => self.ceil_ticks(ns),
        }
    }

    /// The tick `delay` after `now` (rounded up; saturating).
    #[inline]
    pub(crate) fn tick_after(&self, now: Instant, delay: Duration) -> u64 {
        let delay_ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        let ns = self.ns_since_origin(now).saturating_add(delay_ns);
        if ns == u64::MAX {
            return u64::MAX;
        }
        self.ceil_ticks(ns)
    }

    /// The last tick that has completely begun at `now` (rounded down). Never `u64::MAX`: that
    /// is the tick of deadlines too far out to represent, which must never come due, even
    /// with a 1 ns tick once `now` itself saturates.
    #[inline]
    pub(crate) fn now_tick(&self, now: Instant) -> u64 {
        (self.ns_since_origin(now) / self.tick_ns).min(u64::MAX - 1)
    }

    /// The `Instant` at which `tick` begins, or `None` past what `Instant` can represent.
    pub(crate) fn instant_of(&self, tick: u64) -> Option<Instant> {
        let ns = u128::from(tick) * u128::from(self.tick_ns);
        let d = Duration::new(
            u64::try_from(ns / 1_000_000_000).ok()?,
            (ns % 1_000_000_000) as u32,
        );
        self.origin.checked_add(d)
    }

    /// How long from `now` until `tick` begins (zero if it has).
    pub(crate) fn until(&self, now: Instant, tick: u64) -> Option<Duration> {
        self.instant_of(tick)
            .map(|t| t.saturating_duration_since(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wake-up may advance the clock itself (an engine's drop, run by a wake-up that held
    /// its last reference, drops values whose `Drop` does): the list is not locked meanwhile.
    #[test]
    fn a_wake_up_may_advance_the_clock() {
        let clock = ManualClock::new();
        let again = clock.clone();
        let once = Arc::new(std::sync::atomic::AtomicBool::new(true));
        clock.on_advance(Arc::new(move || {
            if once.swap(false, std::sync::atomic::Ordering::SeqCst) {
                again.advance(Duration::from_millis(1));
            }
            true
        }));
        let start = clock.now();
        let (tx, rx) = std::sync::mpsc::channel();
        let c = clock.clone();
        std::thread::spawn(move || tx.send(c.advance(Duration::from_millis(1))));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Ok(true),
            "advance deadlocked"
        );
        assert_eq!(clock.now() - start, Duration::from_millis(2));
    }

    #[test]
    fn wake_ups_of_dropped_engines_leave_the_clock() {
        let clock = ManualClock::new();
        let alive = Arc::new(());
        let weak = Arc::downgrade(&alive);
        clock.on_advance(Arc::new(move || weak.upgrade().is_some()));
        clock.on_advance(Arc::new(|| false));
        assert!(clock.advance(Duration::from_millis(1)));
        assert_eq!(clock.on_advance.lock().len(), 1);
        drop(alive);
        assert!(clock.advance(Duration::from_millis(1)));
        assert!(clock.on_advance.lock().is_empty());
    }

    #[test]
    fn a_saturated_deadline_never_comes_due_even_at_a_1_ns_tick() {
        let origin = Instant::now();
        let t = Ticks::new(origin, Duration::from_nanos(1));
        let year = Duration::from_secs(365 * 24 * 3600);
        let never = t.tick_after(origin, 700 * year);
        assert_eq!(never, u64::MAX);
        // 590 years on, the clock itself is past what a u64 of nanoseconds holds.
        let Some(late) = origin.checked_add(590 * year) else {
            return; // this platform's Instant cannot get there, so neither can the clock
        };
        assert!(t.now_tick(late) < never, "fired 110 years early");
    }

    #[test]
    fn deadlines_round_up_and_now_rounds_down() {
        let origin = Instant::now();
        let t = Ticks::new(origin, Duration::from_millis(1));
        assert_eq!(t.deadline_tick(origin), 0);
        assert_eq!(t.deadline_tick(origin + Duration::from_micros(1)), 1);
        assert_eq!(t.deadline_tick(origin + Duration::from_millis(1)), 1);
        assert_eq!(t.deadline_tick(origin + Duration::from_micros(1001)), 2);
        assert_eq!(t.now_tick(origin + Duration::from_micros(1999)), 1);
        assert_eq!(t.tick_after(origin, Duration::MAX), u64::MAX);
        assert_eq!(
            t.tick_after(origin, Duration::from_secs(u64::MAX / 2)),
            u64::MAX
        );
        // A time before the origin is tick 0, not a panic.
        assert_eq!(
            t.now_tick(origin - Duration::from_millis(5).min(origin.elapsed())),
            0
        );
        assert_eq!(t.instant_of(3), Some(origin + Duration::from_millis(3)));
        assert_eq!(
            t.instant_of(u64::MAX).map(|_| ()),
            origin
                .checked_add(Duration::from_millis(u64::MAX))
                .map(|_| ())
        );
    }

    #[test]
    fn manual_clock_moves_only_when_advanced_and_wakes() {
        let c = ManualClock::new();
        let t0 = c.now();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        c.on_advance(Arc::new(move || {
            h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            true
        }));
        assert_eq!(c.now(), t0);
        assert!(c.advance(Duration::from_secs(1)));
        assert_eq!(c.now(), t0 + Duration::from_secs(1));
        assert!(!c.advance(Duration::MAX));
        assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
