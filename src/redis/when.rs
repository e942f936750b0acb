//! [`When`]: one way to say when a task is due, for [`Persistent::schedule`] and
//! [`Producer::enqueue`] alike.
//!
//! [`Persistent::schedule`]: crate::redis::Persistent::schedule
//! [`Producer::enqueue`]: crate::redis::Producer::enqueue

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::redis::wall_clock::WallClock;

/// When a task is due. A `Duration` or a `SystemTime` converts into it (`impl Into<When>`
/// parameters take either as it is), and so does a `When`.
///
/// A due time past [`MAX_DUE_MS`](crate::redis::MAX_DUE_MS) (2^53 ms since the epoch, some
/// 285 000 years) is refused when the task is given, with
/// [`EnvelopeError::DueTooLate`](crate::redis::EnvelopeError::DueTooLate), the envelope handed
/// back; a time before the epoch is taken as the epoch (due at once).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use delaywheel::redis::When;
///
/// assert_eq!(When::from(Duration::from_secs(30)), When::After(Duration::from_secs(30)));
/// let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_733_000_000_123);
/// assert_eq!(When::from(at), When::At(at));
/// assert_eq!(When::AtMs(1_733_000_000_123).epoch_ms(), Some(1_733_000_000_123));
/// assert_eq!(When::At(at).epoch_ms(), Some(1_733_000_000_123));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// After this delay from now (the engine's or the producer's wall clock), rounded up to
    /// the millisecond.
    After(Duration),
    /// At this wall-clock time, rounded up to the millisecond.
    At(SystemTime),
    /// At this time in milliseconds since the Unix epoch: the raw form stored in Redis, as
    /// another language's producer writes it.
    AtMs(u64),
}

impl When {
    /// The due time in ms since the epoch, if it does not depend on the clock (`At` and
    /// `AtMs`); `None` for `After`.
    pub fn epoch_ms(self) -> Option<u64> {
        match self {
            When::After(_) => None,
            When::At(t) => Some(ceil_ms(t.duration_since(UNIX_EPOCH).unwrap_or_default())),
            When::AtMs(ms) => Some(ms),
        }
    }

    /// The due time in ms since the epoch, `After` counted from `clock` now. The clock and the
    /// delay are added to the nanosecond and rounded up once: each rounded down on its own
    /// would make the task due up to 2 ms early.
    pub(crate) fn due_ms(self, clock: &WallClock) -> u64 {
        match self {
            When::After(d) => ceil_ms(clock.since_epoch().saturating_add(d)),
            other => other.epoch_ms().unwrap_or(u64::MAX),
        }
    }
}

impl From<Duration> for When {
    fn from(delay: Duration) -> When {
        When::After(delay)
    }
}

impl From<SystemTime> for When {
    fn from(at: SystemTime) -> When {
        When::At(at)
    }
}

/// `d` in whole milliseconds, rounded up; `u64::MAX` past it.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}
