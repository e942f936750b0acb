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
//!   occupancy of its record.

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
    /// Even; records created later start above it, so keys to truncated records stay stale.
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

    /// Stores a new timer; hands the value back when `u32::MAX - 1` records are in use. The
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
        e.gen = e.gen.wrapping_add(1);
        e.pos = free_head;
        // SAFETY: the record was occupied (checked above), so `value` was initialised; the
        // generation is now even, so it is never read again until `alloc` writes a new value.
        let value = unsafe { e.value.assume_init_read() };
        self.free_head = index;
        self.len -= 1;
        (key, e.deadline, value)
    }

    /// Drops every value and frees every record (used by `clear`); keys handed out before stay
    /// stale.
    pub(crate) fn free_all(&mut self) {
        for i in 0..self.entries.len() {
            if self.entries[i].occupied() {
                drop(self.take(i as u32));
            }
        }
        self.rebuild_free_list();
    }

    /// Drops trailing vacant records and releases spare capacity. The free list is rebuilt in
    /// ascending order so that new timers fill the lowest indices first, which lets a later
    /// shrink release more.
    pub(crate) fn shrink_to_fit(&mut self) {
        while let Some(last) = self.entries.last() {
            if last.occupied() {
                break;
            }
            // Keys naming this index stay stale: new records start above every generation it had.
            // (A 32-bit generation can only make a stale key collide after 2^31 reuses.)
            self.gen_floor = self.gen_floor.max(last.gen.wrapping_add(2) & !1);
            // A vacant record holds no value, so popping it drops nothing.
            self.entries.pop();
        }
        self.entries.shrink_to_fit();
        self.rebuild_free_list();
    }

    fn rebuild_free_list(&mut self) {
        self.free_head = NONE;
        for (i, e) in self.entries.iter_mut().enumerate().rev() {
            if !e.occupied() {
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
        for e in &mut self.entries {
            if e.occupied() {
                e.gen = e.gen.wrapping_add(1);
                // SAFETY: occupied, so initialised; the generation was made even first, so even
                // if this drop panics the value is never read or dropped again.
                unsafe { e.value.assume_init_drop() };
            }
        }
    }
}
