//! The engine's errors. Every error that refuses a value hands it back.

use std::fmt;

/// Why [`Timer::schedule`](crate::Timer::schedule) (or `schedule_at`) refused a timer. The
/// value is handed back in every case.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScheduleError<T> {
    /// The engine has been shut down.
    Shutdown(T),
    /// The shard already holds `u32::MAX` timers.
    Capacity(T),
}

impl<T> ScheduleError<T> {
    /// The value that was not scheduled.
    pub fn into_inner(self) -> T {
        match self {
            ScheduleError::Shutdown(v) | ScheduleError::Capacity(v) => v,
        }
    }
}

impl<T> fmt::Debug for ScheduleError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::Shutdown(_) => f.write_str("Shutdown(..)"),
            ScheduleError::Capacity(_) => f.write_str("Capacity(..)"),
        }
    }
}

impl<T> fmt::Display for ScheduleError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::Shutdown(_) => f.write_str("the timer engine has been shut down"),
            ScheduleError::Capacity(_) => f.write_str("the timer shard is full (u32::MAX timers)"),
        }
    }
}

impl<T> std::error::Error for ScheduleError<T> {}

/// Why [`TimerBuilder`](crate::TimerBuilder) refused a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuildError {
    /// The tick must be at least 1 ns.
    ZeroTick,
    /// The number of shards is outside `1..=MAX_SHARDS` (1 024).
    Shards(usize),
    /// The number of callback workers is outside `1..=MAX_WORKERS` (1 024).
    Workers(usize),
    /// A bounded channel or queue capacity is outside `1..=MAX_CAPACITY` (2^24): it is
    /// allocated up front.
    Capacity(usize),
    /// The driver thread could not be spawned.
    Spawn(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::ZeroTick => f.write_str("the tick must be at least 1 ns"),
            BuildError::Shards(n) => write!(f, "shards must be in 1..={MAX_SHARDS}, got {n}"),
            BuildError::Workers(n) => {
                write!(
                    f,
                    "a callback pool needs 1..={MAX_WORKERS} workers, got {n}"
                )
            }
            BuildError::Capacity(n) => write!(
                f,
                "a bounded queue needs a capacity in 1..={MAX_CAPACITY}, got {n}"
            ),
            BuildError::Spawn(e) => write!(f, "could not spawn a thread: {e}"),
        }
    }
}

impl std::error::Error for BuildError {}

/// The most shards an engine may have (each holds a wheel).
pub(crate) const MAX_SHARDS: usize = 1_024;

/// The most workers a callback pool may have.
pub(crate) const MAX_WORKERS: usize = 1_024;

/// The largest bounded channel or queue: its slots are allocated up front.
pub(crate) const MAX_CAPACITY: usize = 1 << 24;

/// `n` if it is a capacity the builders accept.
pub(crate) fn capacity(n: usize) -> Result<usize, BuildError> {
    if (1..=MAX_CAPACITY).contains(&n) {
        Ok(n)
    } else {
        Err(BuildError::Capacity(n))
    }
}
