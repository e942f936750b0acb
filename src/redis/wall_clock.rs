//! The wall clock the Redis layer reads. Due times are ms since the Unix epoch, because they
//! must mean the same thing after a restart; tests replace the clock with a manual one so
//! that restarts can be checked to the tick without sleeping.

use std::fmt;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

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
            Source::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            Source::Manual {
                clock,
                origin,
                start_ms,
            } => start_ms
                .saturating_add(clock.now().saturating_duration_since(*origin).as_millis() as u64),
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
