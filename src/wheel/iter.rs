//! Iteration over the pending timers: borrowing ([`Iter`]) and removing ([`Drain`]).

use std::fmt;

use super::{Elem, Expired, TimerKey, Wheel};

/// The element lists of a wheel in a fixed order: ready, every slot, overflow.
fn list<T>(wheel: &Wheel<T>, i: usize) -> Option<&Vec<Elem<T>>> {
    let slots = wheel.slots.len();
    match i {
        0 => Some(&wheel.ready),
        i if i <= slots => Some(&wheel.slots[i - 1]),
        i if i == slots + 1 => Some(&wheel.overflow),
        _ => None,
    }
}

fn list_mut<T>(wheel: &mut Wheel<T>, i: usize) -> Option<&mut Vec<Elem<T>>> {
    let slots = wheel.slots.len();
    match i {
        0 => Some(&mut wheel.ready),
        i if i <= slots => Some(&mut wheel.slots[i - 1]),
        i if i == slots + 1 => Some(&mut wheel.overflow),
        _ => None,
    }
}

/// Iterator over `(key, deadline, &value)` of the pending timers, from [`Wheel::iter`].
pub struct Iter<'a, T> {
    wheel: &'a Wheel<T>,
    list: usize,
    pos: usize,
    remaining: usize,
}

impl<'a, T> Iter<'a, T> {
    pub(super) fn new(wheel: &'a Wheel<T>) -> Self {
        Iter {
            wheel,
            list: 0,
            pos: 0,
            remaining: wheel.len(),
        }
    }
}

impl<'a, T> Iterator for Iter<'a, T> {
    type Item = (TimerKey, u64, &'a T);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let list = list(self.wheel, self.list)?;
            if let Some(elem) = list.get(self.pos) {
                self.pos += 1;
                self.remaining -= 1;
                let entry = &self.wheel.keys.entries[elem.key as usize];
                let key = TimerKey {
                    index: elem.key,
                    gen: entry.gen,
                };
                return Some((key, entry.deadline, &elem.value));
            }
            self.list += 1;
            self.pos = 0;
        }
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
        loop {
            // Popping from the end leaves every other element's position valid.
            let elem = list_mut(self.wheel, self.list)?.pop();
            match elem {
                Some(elem) => {
                    let (key, deadline) = self.wheel.keys.free(elem.key);
                    return Some(Expired {
                        key,
                        deadline,
                        value: elem.value,
                    });
                }
                None => {
                    // This list is empty now: clear its occupancy bit, then move on.
                    let per_level = self.wheel.layout.slots_per_level();
                    if (1..=self.wheel.slots.len()).contains(&self.list) {
                        let i = self.list - 1;
                        self.wheel.clear_occupied(i / per_level, i % per_level);
                    }
                    self.list += 1;
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.wheel.len(), Some(self.wheel.len()))
    }
}

impl<T> ExactSizeIterator for Drain<'_, T> {}

impl<T> Drop for Drain<'_, T> {
    fn drop(&mut self) {
        self.for_each(drop);
        self.wheel.reset_list_bounds();
    }
}

impl<T> fmt::Debug for Drain<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Drain")
            .field("remaining", &self.wheel.len())
            .finish()
    }
}
