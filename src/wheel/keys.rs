//! The key table: one generation-checked record per timer holding its deadline, the position of
//! its element in a slot, and its value, so that cancel and reset touch one record.
//!
//! # Ground rules
//!
//! * A record is **occupied** exactly when its generation is odd. Only then is `value`
//!   initialised; a vacant record's `value` is uninitialised and its `pos` links the free list.
//! * Every transition goes through [`Keys::alloc`] (vacant → occupied, writes the value) and
//!   [`Keys::take`] (occupied → vacant, moves the value out). Nothing else writes `gen` of an
//!   occupied record, so the parity always tells whether `value` may be read.
//! * The generation changes on both transitions, so a [`TimerKey`] matches at most one
//!   occupancy of its record. It never wraps: a record whose occupancy took the last odd
//!   generation is **retired** when it is vacated (generation [`RETIRED`], off the free list,
//!   never popped by `shrink_to_fit`), and `shrink_to_fit` only truncates records below
//!   [`FLOOR_MAX`], so every record starts with at least 2^30 occupancies ahead of it. A
//!   retired record costs its 24 bytes once per 2^30 or more uses of one index.

#![allow(unsafe_code)]

use std::fmt;
use std::mem::MaybeUninit;

use super::huge_pages;

/// A handle to a timer in a [`Wheel`](super::Wheel), returned by `insert`.
///
/// Keys are generation-checked: once the timer has fired, been cancelled or drained, the key is
/// stale, and every operation on it returns `None`/`false` without touching anything, even after
/// its storage has been reused by another timer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerKey {
    pub(crate) index: u32,
    pub(crate) gen: u32,
}

impl TimerKey {
    /// The key packed into a `u64` (for example to carry it through an FFI or a map).
    pub const fn to_bits(self) -> u64 {
        ((self.gen as u64) << 32) | self.index as u64
    }

    /// The inverse of [`to_bits`](Self::to_bits). Any `u64` is accepted: a value that does not
    /// name a live timer is simply a stale key.
    pub const fn from_bits(bits: u64) -> TimerKey {
        TimerKey {
            index: bits as u32,
            gen: (bits >> 32) as u32,
        }
    }
}

impl fmt::Debug for TimerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TimerKey({}v{})", self.index, self.gen)
    }
}

/// The end of the free list, and the largest index never handed out.
pub(crate) const NONE: u32 = u32::MAX;

/// The generation of a retired record: vacant (even), and never produced otherwise (a vacated
/// record's generation is at least 2 unless it would have wrapped).
const RETIRED: u32 = 0;

/// `shrink_to_fit` leaves in place a vacant record whose generation is this high or more, so
/// `gen_floor` (and the first generation of any record) stays at most this.
const FLOOR_MAX: u32 = 1 << 31;

/// One timer's record: 24 bytes for `T = u64`.
pub(crate) struct Record<T> {
    pub(crate) deadline: u64,
    gen: u32,
    /// Occupied: the element's index in its slot list. Vacant: the next free record.
    pub(crate) pos: u32,
    value: MaybeUninit<T>,
}

impl<T> Record<T> {
    #[inline]
    fn occupied(&self) -> bool {
        self.gen & 1 == 1
    }

    /// The value of an occupied record.
    #[inline]
    pub(crate) fn value(&self) -> Option<&T> {
        if self.occupied() {
            // SAFETY: by the ground rules an odd generation means `value` is initialised, and
            // it stays so while `&self` is borrowed.
            Some(unsafe { self.value.assume_init_ref() })
        } else {
            None
        }
    }
}

pub(crate) struct Keys<T> {
    pub(crate) entries: Vec<Record<T>>,
    free_head: u32,
    /// Even, at most [`FLOOR_MAX`]; records created later start above it, so keys to truncated
    /// records stay stale.
    gen_floor: u32,
    len: usize,
}

impl<T> fmt::Debug for Keys<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keys")
            .field("len", &self.len)
            .field("records", &self.entries.len())
            .finish()
    }
}

impl<T> Keys<T> {
    pub(crate) fn with_capacity(n: usize) -> Keys<T> {
        // A hint: no more records than keys can index (`NONE` is never handed out), and a
        // reservation the system refuses leaves the table to grow on demand.
        let mut entries = Vec::new();
        if entries.try_reserve_exact(n.min(NONE as usize)).is_ok() {
            // Only a table sized up front: see `huge_pages` for why growth is not advised.
            let _ = huge_pages::advise(&entries);
        }
        Keys {
            entries,
            free_head: NONE,
            gen_floor: 0,
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Stores a new timer; hands the value back when `u32::MAX` records are in use. The
    /// caller sets `pos`.
    #[inline]
    pub(crate) fn alloc(&mut self, deadline: u64, value: T) -> Result<TimerKey, T> {
        let index = if self.free_head != NONE {
            let index = self.free_head;
            let e = &mut self.entries[index as usize];
            debug_assert!(!e.occupied());
            self.free_head = e.pos;
            e.deadline = deadline;
            e.value.write(value);
            e.gen = e.gen.wrapping_add(1);
            index
        } else {
            let Some(index) = u32::try_from(self.entries.len())
                .ok()
                .filter(|&i| i != NONE)
            else {
                return Err(value);
            };
            self.entries.push(Record {
                deadline,
                gen: self.gen_floor | 1,
                pos: 0,
                value: MaybeUninit::new(value),
            });
            index
        };
        self.len += 1;
        Ok(TimerKey {
            index,
            gen: self.entries[index as usize].gen,
        })
    }

    /// The record of a live key, or `None` for a stale one.
    #[inline]
    pub(crate) fn get(&self, key: TimerKey) -> Option<&Record<T>> {
        self.entries
            .get(key.index as usize)
            .filter(|e| e.gen == key.gen && e.occupied())
    }

    /// The key of the occupied record at `index`.
    #[inline]
    pub(crate) fn key_at(&self, index: u32) -> TimerKey {
        TimerKey {
            index,
            gen: self.entries[index as usize].gen,
        }
    }

    /// Empties the record at `index` and returns the key it had, its deadline and its value.
    ///
    /// # Panics
    ///
    /// If the record is vacant: that would be a bug in the wheel (an element pointing at a freed
    /// record), and reading the value would be undefined behaviour, so it is checked always.
    #[inline]
    pub(crate) fn take(&mut self, index: u32) -> (TimerKey, u64, T) {
        let free_head = self.free_head;
        let e = &mut self.entries[index as usize];
        assert!(e.occupied(), "delaywheel bug: taking a vacant record");
        let key = TimerKey { index, gen: e.gen };
        let retire = e.gen == u32::MAX;
        // `RETIRED` is `u32::MAX + 1` wrapped: even either way.
        e.gen = e.gen.wrapping_add(1);
        // SAFETY: the record was occupied (checked above), so `value` was initialised; the
        // generation is now even, so it is never read again until `alloc` writes a new value.
        let value = unsafe { e.value.assume_init_read() };
        if retire {
            // The next generation would be one already handed out: never reuse this record.
            debug_assert_eq!(e.gen, RETIRED);
        } else {
            e.pos = free_head;
            self.free_head = index;
        }
        self.len -= 1;
        (key, e.deadline, value)
    }

    /// Drops trailing vacant records and releases spare capacity. The free list is rebuilt in
    /// ascending order so that new timers fill the lowest indices first, which lets a later
    /// shrink release more.
    pub(crate) fn shrink_to_fit(&mut self) {
        while let Some(last) = self.entries.last() {
            // A retired record, or one used so often that a record recreated above its
            // generations would have few left, stays.
            if last.occupied() || last.gen == RETIRED || last.gen >= FLOOR_MAX {
                break;
            }
            // Keys naming this index stay stale: new records start above every generation it had.
            self.gen_floor = self.gen_floor.max(last.gen + 2);
            debug_assert!(self.gen_floor <= FLOOR_MAX && self.gen_floor.is_multiple_of(2));
            // A vacant record holds no value, so popping it drops nothing.
            self.entries.pop();
        }
        self.entries.shrink_to_fit();
        self.rebuild_free_list();
    }

    /// Links every vacant, unretired record into the free list, lowest index first.
    pub(crate) fn rebuild_free_list(&mut self) {
        self.free_head = NONE;
        for (i, e) in self.entries.iter_mut().enumerate().rev() {
            if !e.occupied() && e.gen != RETIRED {
                e.pos = self.free_head;
                self.free_head = i as u32;
            }
        }
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Record<T>>()
    }
}

impl<T> Drop for Keys<T> {
    fn drop(&mut self) {
        /// Drops the values left if one value's drop panics, as `Vec` does (a second panic
        /// aborts, as it does there).
        struct Rest<'a, T>(std::slice::IterMut<'a, Record<T>>);
        impl<T> Drop for Rest<'_, T> {
            fn drop(&mut self) {
                self.0.by_ref().for_each(drop_value);
            }
        }
        let mut rest = Rest(self.entries.iter_mut());
        rest.0.by_ref().for_each(drop_value);
    }
}

/// Drops the value of `e` if it holds one, and marks it empty.
fn drop_value<T>(e: &mut Record<T>) {
    if e.occupied() {
        e.gen = e.gen.wrapping_add(1);
        // SAFETY: occupied, so initialised; the generation was made even first, so even if
        // this drop panics the value is never read or dropped again.
        unsafe { e.value.assume_init_drop() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record whose generation would wrap is retired: a key of its first occupancy can never
    /// match it again, and neither the free list nor a shrink hands the index out again.
    #[test]
    fn a_record_is_retired_before_its_generation_wraps() {
        let mut keys: Keys<u64> = Keys::with_capacity(0);
        let first = keys.alloc(1, 10).unwrap();
        assert_eq!((first.index, first.gen), (0, 1));
        keys.take(first.index);
        // As if index 0 had been used 2^31 − 1 times since.
        keys.entries[0].gen = u32::MAX - 1;
        let last = keys.alloc(2, 20).unwrap();
        assert_eq!((last.index, last.gen), (0, u32::MAX));
        assert_eq!(keys.take(last.index), (last, 2, 20));
        assert_eq!(keys.entries[0].gen, RETIRED);
        let next = keys.alloc(3, 30).unwrap();
        assert_eq!(next.index, 1, "a retired record was reused");
        assert!(keys.get(first).is_none() && keys.get(last).is_none());
        keys.take(next.index);
        // Truncation stops at the retired record, and the free list skips it.
        keys.shrink_to_fit();
        assert_eq!(keys.entries.len(), 1);
        let again = keys.alloc(4, 40).unwrap();
        assert_eq!(again.index, 1);
        assert!(
            again.gen > next.gen,
            "index 1 came back with a used generation"
        );
        assert!(keys.get(next).is_none());
    }

    /// A much-used vacant record is not truncated, so the floor that records recreated after a
    /// shrink start from stays low, and each of them has at least 2^30 uses (2^31
    /// generations, two per use) ahead of it.
    #[test]
    fn a_shrink_keeps_the_generation_floor_low() {
        let mut keys: Keys<u64> = Keys::with_capacity(0);
        let a = keys.alloc(1, 1).unwrap();
        keys.take(a.index);
        keys.entries[0].gen = FLOOR_MAX;
        keys.shrink_to_fit();
        assert_eq!(keys.entries.len(), 1, "a much-used record was truncated");
        assert!(keys.gen_floor <= FLOOR_MAX);
        let b = keys.alloc(2, 2).unwrap();
        assert_eq!((b.index, b.gen), (0, FLOOR_MAX + 1));
        // A little-used one is truncated, and recreated above its generations.
        let c = keys.alloc(3, 3).unwrap();
        assert_eq!((c.index, c.gen), (1, 1));
        keys.take(c.index);
        keys.shrink_to_fit();
        assert_eq!(keys.entries.len(), 1);
        let d = keys.alloc(4, 4).unwrap();
        assert_eq!(d.index, 1);
        assert!(d.gen > c.gen && keys.get(c).is_none());
    }
}
