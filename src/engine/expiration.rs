//! What a timer is called ([`TimerId`]) and what the engine hands out for it: an
//! [`Expiration`] when it fires, a [`Pending`] timer when the engine shuts down.

use std::fmt;
use std::time::Instant;

use crate::wheel::TimerKey;

/// Names a scheduled timer: its shard and its key in that shard's wheel. Ids are
/// generation-checked: once the timer fired or was cancelled, operations on the id return
/// `None`/`false`, also after the slot was reused (a record is retired before its 32-bit
/// generation could wrap).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId {
    pub(super) engine: u32,
    pub(super) shard: u32,
    pub(super) key: TimerKey,
}

impl fmt::Debug for TimerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TimerId({}/{}:{:?})", self.engine, self.shard, self.key)
    }
}

/// A timer that fired, as delivered to the channel, callback or stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiration<T> {
    /// The id `schedule` returned.
    pub id: TimerId,
    /// When it was due (rounded up to the tick).
    pub deadline: Instant,
    /// The value it carried.
    pub value: T,
}

/// A timer handed back by [`Timer::shutdown`](crate::Timer::shutdown): still pending, or fired but not delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending<T> {
    /// The id `schedule` returned.
    pub id: TimerId,
    /// When it is due, or `None` if that is beyond what `Instant` can represent.
    pub deadline: Option<Instant>,
    /// The value it carries.
    pub value: T,
}
