//! Iteration over the pending timers: borrowing ([`Iter`]) and removing ([`Drain`]). Both walk
//! the key table, where the values live, in index order.

use std::fmt;

use super::{Expired, TimerKey, Wheel};

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
/// whatever it has not yielded yet.
pub struct Drain<'a, T> {
    wheel: &'a mut Wheel<T>,
    index: usize,
}

impl<'a, T> Drain<'a, T> {
    pub(super) fn new(wheel: &'a mut Wheel<T>) -> Self {
        // The slot lists only point at records: empty them all now, and take the values from
        // the records one by one below.
        wheel.clear_lists();
        Drain { wheel, index: 0 }
    }
}

impl<T> Iterator for Drain<'_, T> {
    type Item = Expired<T>;

    fn next(&mut self) -> Option<Expired<T>> {
        while self.wheel.keys.len() > 0 {
            let index = self.index;
            let record = self.wheel.keys.entries.get(index)?;
            self.index += 1;
            if record.value().is_some() {
                let (key, deadline, value) = self.wheel.keys.take(index as u32);
                return Some(Expired {
                    key,
                    deadline,
                    value,
                });
            }
        }
        None
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
