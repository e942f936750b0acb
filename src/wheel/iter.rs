//! Iteration over the pending timers: borrowing ([`Iter`], which walks the key table, where the
//! values live, in index order) and removing ([`Drain`], which takes the slot lists' elements
//! from their ends, so that the wheel stays consistent whenever it stops).

use std::fmt;

use super::{Expired, TimerKey, Wheel};

impl<T> Wheel<T> {
    /// Iterates over the pending timers as `(key, deadline, &value)`, in no particular order.
    pub fn iter(&self) -> Iter<'_, T> {
        Iter::new(self)
    }

    /// Removes every pending timer and yields it, in no particular order (for shutdown and
    /// snapshots). Dropping the iterator early removes the rest too. The wheel's time is kept.
    ///
    /// The wheel is consistent after every step: if the iterator is leaked (`mem::forget`), or
    /// a value's `Drop` panics while the iterator drops the rest, the timers not yet removed
    /// stay pending, and fire, cancel and reset as before.
    pub fn drain(&mut self) -> Drain<'_, T> {
        Drain::new(self)
    }
}

/// Iterator over `(key, deadline, &value)` of the pending timers, from [`Wheel::iter`].
pub struct Iter<'a, T> {
    wheel: &'a Wheel<T>,
    index: usize,
    remaining: usize,
}

impl<'a, T> Iter<'a, T> {
    pub(super) fn new(wheel: &'a Wheel<T>) -> Self {
        Iter {
            wheel,
            index: 0,
            remaining: wheel.len(),
        }
    }
}

impl<'a, T> Iterator for Iter<'a, T> {
    type Item = (TimerKey, u64, &'a T);

    fn next(&mut self) -> Option<Self::Item> {
        let entries = &self.wheel.keys.entries;
        while let Some(record) = entries.get(self.index) {
            let index = self.index as u32;
            self.index += 1;
            if let Some(value) = record.value() {
                self.remaining -= 1;
                return Some((self.wheel.keys.key_at(index), record.deadline, value));
            }
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl<T> ExactSizeIterator for Iter<'_, T> {}

impl<T> fmt::Debug for Iter<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Iter")
            .field("remaining", &self.remaining)
            .finish()
    }
}

/// Removing iterator over the pending timers, from [`Wheel::drain`]. Dropping it removes
/// whatever it has not yielded yet. Leaking it leaves the rest pending, as they were.
pub struct Drain<'a, T> {
    wheel: &'a mut Wheel<T>,
    /// The list `Wheel::remove_any` takes from next.
    list: usize,
}

impl<'a, T> Drain<'a, T> {
    pub(super) fn new(wheel: &'a mut Wheel<T>) -> Self {
        Drain { wheel, list: 0 }
    }
}

impl<T> Iterator for Drain<'_, T> {
    type Item = Expired<T>;

    fn next(&mut self) -> Option<Expired<T>> {
        let (key, deadline, value) = self.wheel.remove_any(&mut self.list)?;
        Some(Expired {
            key,
            deadline,
            value,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.wheel.len(), Some(self.wheel.len()))
    }
}

impl<T> ExactSizeIterator for Drain<'_, T> {}

impl<T> Drop for Drain<'_, T> {
    fn drop(&mut self) {
        self.for_each(drop);
    }
}

impl<T> fmt::Debug for Drain<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Drain")
            .field("remaining", &self.wheel.len())
            .finish()
    }
}
