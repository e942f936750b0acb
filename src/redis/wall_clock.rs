//! The wall clock the Redis layer reads. Due times are ms since the Unix epoch, because they
//! must mean the same thing after a restart; tests replace the clock with a manual one so
//! that restarts can be checked to the tick without sleeping.

use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::ManualClock;

/// Where the time "now" comes from, in ms since the Unix epoch.
#[derive(Clone, Default)]
pub struct WallClock(Source);

#[derive(Clone, Default)]
enum Source {
    #[default]
    System,
    Manual {
        clock: ManualClock,
        origin: Instant,
        start_ms: u64,
    },
}

impl fmt::Debug for WallClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::System => f.write_str("WallClock::System"),
            Source::Manual { start_ms, .. } => write!(f, "WallClock::Manual(start {start_ms} ms)"),
        }
    }
}

impl WallClock {
    /// The system's real-time clock (the default).
    pub fn system() -> WallClock {
        WallClock(Source::System)
    }

    /// A clock that reads `start_ms` plus how far `clock` has been advanced since this call.
    /// An engine given it also runs its timer on `clock`, so tasks fire exactly when the test
    /// advances it past their due time.
    pub fn manual(clock: &ManualClock, start_ms: u64) -> WallClock {
        WallClock(Source::Manual {
            clock: clock.clone(),
            origin: clock.now(),
            start_ms,
        })
    }

    /// Milliseconds since the Unix epoch now (0 for a system clock set before 1970).
    pub fn now_ms(&self) -> u64 {
        match &self.0 {
            Source::System => since_epoch().as_millis() as u64,
            Source::Manual {
                clock,
                origin,
                start_ms,
            } => manual_ms(*start_ms, *origin, clock.now()),
        }
    }

    /// Time since the Unix epoch now, to the nanosecond (as `now_ms`, unrounded).
    pub(crate) fn since_epoch(&self) -> Duration {
        match &self.0 {
            Source::System => since_epoch(),
            Source::Manual {
                clock,
                origin,
                start_ms,
            } => Duration::from_millis(*start_ms)
                .saturating_add(clock.now().saturating_duration_since(*origin)),
        }
    }

    /// A time stamp for [`Envelope::created_at`](super::Envelope::created_at): like
    /// [`now_ms`](Self::now_ms), but a system clock is read through the kernel's coarse
    /// real-time clock where there is one (Linux), which is about one kernel tick (1 to 10 ms)
    /// behind it (more on a tickless or starved VM) and costs a fraction of a precise read.
    /// Nothing is timed against it.
    pub(crate) fn stamp_ms(&self) -> u64 {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Source::System => coarse_ms(),
            _ => self.now_ms(),
        }
    }

    /// Reads the wall clock and the timer's clock together, so that due times can be turned
    /// into timer deadlines later without reading either clock again.
    pub(crate) fn anchor(&self) -> Anchor {
        match &self.0 {
            // The wall clock first: time that passes before the second read makes the anchor's
            // `Instant` later than its wall time, so deadlines derived from it are late by
            // that much, never early.
            Source::System => {
                let wall_ms = self.now_ms();
                Anchor {
                    mono: Instant::now(),
                    wall_ms,
                }
            }
            // One reading for both: the test thread may advance the clock between two.
            Source::Manual {
                clock,
                origin,
                start_ms,
            } => {
                let mono = clock.now();
                Anchor {
                    mono,
                    wall_ms: manual_ms(*start_ms, *origin, mono),
                }
            }
        }
    }

    /// The manual clock behind it, if any.
    pub(crate) fn manual_clock(&self) -> Option<&ManualClock> {
        match &self.0 {
            Source::System => None,
            Source::Manual { clock, .. } => Some(clock),
        }
    }
}

/// Whole µs from `start` to now on the monotonic clock (which a step of the wall clock does
/// not move), saturating: the consumer's and the persistent engine's timestamps of their own.
pub(crate) fn micros_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The system's real-time clock as time since the Unix epoch (zero for a clock set before
/// 1970), for callers that need it finer than [`WallClock::now_ms`].
pub(crate) fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// `CLOCK_REALTIME_COARSE` in ms since the Unix epoch (0 before 1970).
#[cfg(target_os = "linux")]
fn coarse_ms() -> u64 {
    use rustix::time::{clock_gettime, ClockId};
    let t = clock_gettime(ClockId::RealtimeCoarse);
    match u64::try_from(t.tv_sec) {
        Ok(s) => s.saturating_mul(1_000) + (t.tv_nsec as u64) / 1_000_000,
        Err(_) => 0,
    }
}

/// What a manual wall clock started at `start_ms` when its clock read `origin` reads when its
/// clock reads `now`.
fn manual_ms(start_ms: u64, origin: Instant, now: Instant) -> u64 {
    start_ms.saturating_add(now.saturating_duration_since(origin).as_millis() as u64)
}

/// A wall time and the timer's `Instant` read together. The wall time is floored to the ms and
/// read first, so a deadline derived from it is never early. It goes stale only if someone
/// steps the wall clock (the two clocks run at the same rate otherwise: NTP slews both), which
/// is why its owner reads a fresh one every second.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Anchor {
    mono: Instant,
    wall_ms: u64,
}

impl Anchor {
    /// The wall time it was read at, in ms since the Unix epoch.
    pub(crate) fn wall_ms(&self) -> u64 {
        self.wall_ms
    }

    /// The timer `Instant` at which the wall clock reads `due_ms` (plus `extra`); `None` only
    /// past what an `Instant` can hold. A due time in the past gives an instant in the past
    /// (or the anchor itself), which a timer fires at once.
    pub(crate) fn instant_of(&self, due_ms: u64, extra: Duration) -> Option<Instant> {
        let at = if due_ms >= self.wall_ms {
            self.mono
                .checked_add(Duration::from_millis(due_ms - self.wall_ms))?
        } else {
            self.mono
                .checked_sub(Duration::from_millis(self.wall_ms - due_ms))
                .unwrap_or(self.mono)
        };
        at.checked_add(extra)
    }
}

/// Milliseconds since the Unix epoch now, on the system clock (0 if it is before 1970).
pub fn now_ms() -> u64 {
    WallClock::system().now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchor_maps_due_times_onto_the_timer_clock() {
        let clock = ManualClock::new();
        let wall = WallClock::manual(&clock, 1_000_000);
        clock.advance(Duration::from_millis(250));
        let anchor = wall.anchor();
        assert_eq!(anchor.wall_ms(), 1_000_250);
        let base = clock.now();
        assert_eq!(
            anchor.instant_of(1_000_300, Duration::ZERO),
            Some(base + Duration::from_millis(50))
        );
        assert_eq!(
            anchor.instant_of(1_000_300, Duration::from_millis(7)),
            Some(base + Duration::from_millis(57))
        );
        // In the past: at or before the anchor, never after it.
        assert!(anchor.instant_of(0, Duration::ZERO).unwrap() <= base);
        assert_eq!(
            anchor.instant_of(1_000_200, Duration::ZERO),
            base.checked_sub(Duration::from_millis(50)).or(Some(base))
        );
    }

    #[test]
    fn a_stamp_is_the_wall_time_to_a_kernel_tick() {
        let system = WallClock::system();
        for _ in 0..1_000 {
            let before = system.now_ms();
            let stamp = system.stamp_ms();
            let after = system.now_ms();
            // Coarse: never ahead of the precise clock, behind it by about a kernel tick
            // (CONFIG_HZ 100 makes that 10 ms; a tickless or starved VM can lag more).
            assert!(stamp <= after, "stamp {stamp} after {after}");
            assert!(stamp + 100 >= before, "stamp {stamp} far behind {before}");
        }
        let clock = ManualClock::new();
        let manual = WallClock::manual(&clock, 5_000);
        clock.advance(Duration::from_millis(3));
        assert_eq!(manual.stamp_ms(), 5_003);
    }

    #[test]
    fn system_anchor_is_never_early() {
        let anchor = WallClock::system().anchor();
        let due = anchor.wall_ms() + 20;
        let at = anchor.instant_of(due, Duration::ZERO).unwrap();
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        // The wall clock has reached the due time by the instant it maps to.
        assert!(WallClock::system().now_ms() >= due);
    }
}
