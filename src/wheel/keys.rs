//! The key table: one generation-checked record per timer, saying when it is due and where its
//! element sits, so cancel and reset find it in O(1).

use std::fmt;

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

/// One record. While occupied (`gen` odd) `pos` is the element's index in its list; while vacant
/// (`gen` even) `pos` links the free list.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyEntry {
    pub(crate) deadline: u64,
    pub(crate) gen: u32,
    pub(crate) pos: u32,
}

impl KeyEntry {
    #[inline]
    fn occupied(&self) -> bool {
        self.gen & 1 == 1
    }
}

#[derive(Debug)]
pub(crate) struct Keys {
    pub(crate) entries: Vec<KeyEntry>,
    free_head: u32,
    /// Even; records created later start above it, so keys to truncated records stay stale.
    gen_floor: u32,
    len: usize,
}

impl Keys {
    pub(crate) fn with_capacity(n: usize) -> Keys {
        Keys {
            entries: Vec::with_capacity(n),
            free_head: NONE,
            gen_floor: 0,
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Takes a record for a new timer due at `deadline`; `None` when `u32::MAX - 1` are in use.
    /// The caller sets `pos`.
    #[inline]
    pub(crate) fn alloc(&mut self, deadline: u64) -> Option<TimerKey> {
        let index = if self.free_head != NONE {
            let index = self.free_head;
            let e = &mut self.entries[index as usize];
            debug_assert!(!e.occupied());
            self.free_head = e.pos;
            e.gen = e.gen.wrapping_add(1);
            e.deadline = deadline;
            index
        } else {
            let index = u32::try_from(self.entries.len())
                .ok()
                .filter(|&i| i != NONE)?;
            self.entries.push(KeyEntry {
                deadline,
                gen: self.gen_floor | 1,
                pos: 0,
            });
            index
        };
        self.len += 1;
        Some(TimerKey {
            index,
            gen: self.entries[index as usize].gen,
        })
    }

    /// The record of a live key, or `None` for a stale one.
    #[inline]
    pub(crate) fn get(&self, key: TimerKey) -> Option<&KeyEntry> {
        self.entries
            .get(key.index as usize)
            .filter(|e| e.gen == key.gen && e.occupied())
    }

    /// Frees the record at `index` (which must be occupied) and returns the key it had and its
    /// deadline.
    #[inline]
    pub(crate) fn free(&mut self, index: u32) -> (TimerKey, u64) {
        let e = &mut self.entries[index as usize];
        debug_assert!(e.occupied());
        let key = TimerKey { index, gen: e.gen };
        let deadline = e.deadline;
        e.gen = e.gen.wrapping_add(1);
        e.pos = self.free_head;
        self.free_head = index;
        self.len -= 1;
        (key, deadline)
    }

    /// Frees every record (used by `clear`); keys handed out before stay stale.
    pub(crate) fn free_all(&mut self) {
        for e in &mut self.entries {
            if e.occupied() {
                e.gen = e.gen.wrapping_add(1);
            }
        }
        self.len = 0;
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
            // (`last.gen` is even; a wrapped generation can only make a stale key collide after
            // 2^31 reuses of one record, as with any 32-bit generation.)
            self.gen_floor = self.gen_floor.max(last.gen.wrapping_add(2) & !1);
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
        self.entries.capacity() * std::mem::size_of::<KeyEntry>()
    }
}
