//! The engine's errors. Every error that refuses a value hands it back.

use std::fmt;

/// Why [`Timer::schedule`](crate::Timer::schedule) (or `schedule_at`) refused a timer. The
/// value is handed back in every case.
#[derive(Clone, PartialEq, Eq)]
pub enum ScheduleError<T> {
    /// The engine has been shut down.
    Shutdown(T),
    /// The shard already holds `u32::MAX - 1` timers.
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
            ScheduleError::Capacity(_) => {
                f.write_str("the timer shard is full (u32::MAX - 1 timers)")
            }
        }
    }
}

impl<T> std::error::Error for ScheduleError<T> {}

/// Why [`TimerBuilder`](crate::TimerBuilder) refused a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildError {
    /// The tick must be at least 1 ns.
    ZeroTick,
    /// At least one shard is needed (and at most 65 536).
    Shards(usize),
    /// A callback pool needs at least one worker.
    ZeroWorkers,
    /// A bounded channel or queue needs a capacity of at least 1.
    ZeroCapacity,
    /// The driver thread could not be spawned.
    Spawn(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::ZeroTick => f.write_str("the tick must be at least 1 ns"),
            BuildError::Shards(n) => write!(f, "shards must be in 1..=65536, got {n}"),
            BuildError::ZeroWorkers => f.write_str("a callback pool needs at least one worker"),
            BuildError::ZeroCapacity => {
                f.write_str("a bounded queue needs a capacity of at least 1")
            }
            BuildError::Spawn(e) => write!(f, "could not spawn a thread: {e}"),
        }
    }
}

impl std::error::Error for BuildError {}
