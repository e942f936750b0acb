//! The pure hierarchical timing wheel: ticks in, expired timers out.
//!
//! [`Wheel<T>`] has no clock, no threads and no I/O. Time is a `u64` tick whose length the caller
//! chooses (the engine uses 1 ms). Insert, cancel and reset are O(1) however many timers are
//! pending; [`poll`](Wheel::poll) yields every timer whose deadline has been reached, in
//! non-decreasing deadline order, and never one early.
//!
//! # Layout, and why
//!
//! At a million timers the storage no longer fits in cache. On the machines we measured, a
//! dependent cache miss costs about 190 ns and independent misses overlap to about 30 ns, so the
//! design is driven by which operation pays which miss:
//!
//! * **Elements live inline in per-slot vectors.** Each slot of each level is a `Vec` of
//!   8-byte elements `{ deadline low 32 bits, key index }`, whatever `T` is. Expiring a
//!   level-0 slot is an O(1) swap of that vector into the ready list, and popping from it is a
//!   sequential read: no linked-list walk, so no dependent miss per fired timer. Cascading a
//!   higher-level slot reads its vector sequentially and computes each element's new slot from
//!   the low deadline bits it carries; the only random access is a *store* of the element's new
//!   position into the key table, which does not stall the loop (records are prefetched 16
//!   elements ahead), and which leaves the record in cache for the moment the timer fires.
//!   (Measured: skipping that store for timers that land in small level-0 slots, and finding
//!   them by a short scan on cancel instead, made expiry 1.2–1.5× *slower*: the fire then pays
//!   the record's miss itself, a few at a time, where the cascade overlaps thousands.)
//! * **A key table makes cancel indexed, not lazy.** Each timer has a record `{ deadline,
//!   generation, position, value }` in a slab (24 bytes for `T = u64`). Cancel reads the
//!   record, derives the slot from the deadline and the wheel's time, and `swap_remove`s the
//!   element, patching the position of the element that moved. Nothing is left behind: a
//!   cancelled timer's record goes on a free list at once and its element is gone, so the
//!   memory is reused by the next insert. The price is two dependent misses per cancel at
//!   scale (record, then element).
//! * **No slot id is stored.** As in tokio's wheel, a timer due at `d` sits on the level of the
//!   highest bit in which `d` and the wheel's time differ. The wheel only advances to the start of
//!   the next occupied slot (found with `trailing_zeros` on per-level occupancy bitmaps), so this
//!   stays true and the slot can be recomputed from the deadline whenever it is needed.
//! * **Wide levels.** The default is 8 levels of 256 slots, which covers all of `u64`: a timer
//!   due within the current aligned block of 65 536 ticks (65 s at 1 ms) is moved at most once
//!   before it fires, where 64-slot levels move it twice (one due across a block boundary may
//!   be moved once more). Measured, this halved the expiry cost per fired timer.
//! * **Memory.** 24 bytes of record plus 8 bytes of element: 32 bytes per pending `u64` timer,
//!   plus the spare capacity the slot vectors keep for reuse (`examples/wheel_load.rs` reports
//!   the resident figure; `shrink_to_fit` returns it). `tokio-util`'s `DelayQueue` uses 64.
//!
//! Timers due at or before the wheel's time sit in a ready list, sorted (what a level-0 slot
//! becomes) or, once an insert or cancel of a timer already due breaks that order, a binary
//! heap until it empties: O(log n) per operation there, never a re-sort. Timers beyond the
//! last level's range sit in an overflow tier that is re-examined only when the wheel reaches the epoch of the
//! earliest of them (or of a cancelled one that was the earliest: the tier's minimum is a lower
//! bound, made exact by each rescan), so a deadline years away (up to `u64::MAX`) costs nothing
//! until then and still fires exactly on time.
//!
//! ```
//! use delaywheel::wheel::Wheel;
//!
//! let mut wheel = Wheel::new();
//! let a = wheel.insert(10, "a");
//! let b = wheel.insert(5, "b");
//! assert_eq!(wheel.cancel(a), Some("a"));
//! assert_eq!(wheel.poll(4), None); // nothing is due yet
//! let fired = wheel.poll(100).unwrap();
//! assert_eq!((fired.key, fired.deadline, fired.value), (b, 5, "b"));
//! assert_eq!(wheel.poll(100), None);
//! assert_eq!(wheel.now(), 100);
//! ```
//!
//! # Guarantees
//!
//! Each with the tests that check it (paths from the repository root; `make test` runs them
//! all, the model test with 10 000 proptest cases).
//!
//! * **Never early, in deadline order.** [`poll`](Wheel::poll)`(now)` yields exactly the
//!   timers whose deadline is at or before `now`, in non-decreasing deadline order, for any
//!   deadline up to `u64::MAX`, including those already due when inserted (they fire at the
//!   next poll); a `now` that goes backwards fires nothing and changes nothing. `tests/wheel_rules.rs`: `never_fires_early_tick_by_tick`,
//!   `past_and_present_deadlines_fire_at_the_next_poll`,
//!   `overflow_tier_fires_exactly_on_time_up_to_u64_max`, `a_huge_jump_catches_up_in_one_loop`,
//!   `ties_and_order`, `a_clock_that_goes_backwards_changes_nothing`,
//!   `a_large_presized_wheel_fires_every_timer_in_order`.
//! * **The wheel behaves as a sorted map.** `tests/wheel_model.rs`: `wheel_matches_model`
//!   runs random insert, cancel, reset, poll, drain, clear and shrink sequences against a
//!   `BTreeMap` model on eight layouts, with deadlines in the past, now, near, far, beyond the
//!   range and at `u64::MAX`, poll jumps of 0, 1, small, huge and backwards, and stale and
//!   forged keys.
//! * **A key matches one timer, once.** [`cancel`](Wheel::cancel) and
//!   [`reset`](Wheel::reset) of a key whose timer fired, was cancelled or belongs to a cleared
//!   or shrunk wheel return `None`/`false` and touch nothing; a record is retired before its
//!   32-bit generation wraps, so a stale key never matches again. `tests/wheel_rules.rs`:
//!   `stale_keys_return_none_and_touch_nothing`, `stale_keys_survive_shrink_and_clear`,
//!   `reset_moves_earlier_and_later_and_keeps_the_key`; unit tests in `src/wheel/keys.rs`.
//! * **Every value is dropped exactly once**, whichever way it leaves the wheel (fired,
//!   cancelled, drained, cleared, or the wheel dropped), also when a drain is leaked part-way
//!   or a value's drop panics inside [`clear`](Wheel::clear) (the timers left still fire at
//!   their deadlines). `tests/wheel_drops.rs`: `every_value_is_dropped_exactly_once`
//!   (proptest, on the default layout and on a small one that reaches every level and the
//!   overflow tier).
//! * **Memory.** At most 40 allocated bytes per pending `u64` timer at 1M timers, and
//!   cancelled storage is reused; [`shrink_to_fit`](Wheel::shrink_to_fit) returns it.
//!   `tests/wheel_rules.rs`: `at_most_40_allocated_bytes_per_pending_u64_timer_at_1m`,
//!   `cancelled_storage_is_reused_and_shrink_returns_memory`.
//!
//! # Fuzzing
//!
//! `fuzz/fuzz_targets/wheel_ops.rs` is a libFuzzer target (`cargo install cargo-fuzz && make
//! fuzz`, under AddressSanitizer). Its interpreter, `tests/support/wheel_ops.rs`, drives insert,
//! cancel, reset, poll, iter, full, partial and leaked drains, clear, shrink and dropping a
//! wheel with timers pending, on heap values counted alive (a double drop or a leak fails).
//! `tests/wheel_fuzz_replay.rs` runs the same interpreter on random and edge inputs in
//! `make test`, so the target cannot rot. Runs of 287 000 and 298 000 inputs found nothing.
//!
//! # Unsafe code
//!
//! `unsafe` is denied crate-wide except in three places, all in this module:
//!
//! * the value slot of a key-table record (`MaybeUninit`, initialised exactly when the
//!   record's generation is odd; the ground rules are at the top of `src/wheel/keys.rs`). It
//!   saves the 8 bytes an `Option<u64>` would add to every record, which keeps a timer under
//!   40 bytes. `tests/wheel_drops.rs` covers every block that touches a value;
//! * a cache prefetch hint (a no-op off x86_64) in the cascade, expiry and insert loops: a
//!   third off expiry in an A/B run (34.7 ms without, 23.1 ms with);
//! * the `madvise(MADV_HUGEPAGE)` call for a pre-sized key table of 32 MiB or more
//!   (`src/wheel/huge_pages.rs`; Linux only, a hint that changes no data): a third off
//!   inserting 10M timers into a new [`Wheel::with_capacity`].

mod huge_pages;
mod iter;
mod keys;
mod layout;

use std::fmt;
use std::mem;

pub use iter::{Drain, Iter};
pub use keys::TimerKey;
pub use layout::{Layout, LayoutError};

use keys::Keys;
use layout::low_mask;

/// A timer taken out of the wheel by [`Wheel::poll`] or [`Wheel::drain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired<T> {
    /// The key the timer had; it is stale from now on.
    pub key: TimerKey,
    /// The deadline the timer was scheduled for (not the time it was polled at).
    pub deadline: u64,
    /// The value the timer carried.
    pub value: T,
}

/// [`Wheel::try_insert`] refused a timer because no record index is free (`u32::MAX` timers
/// pending, fewer with retired records: see [`Wheel::try_insert`]). The value is handed back.
#[derive(Clone, PartialEq, Eq)]
pub struct CapacityError<T>(pub T);

impl<T> fmt::Debug for CapacityError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CapacityError(..)")
    }
}

impl<T> fmt::Display for CapacityError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the wheel has no record free: u32::MAX timers pending, fewer once records whose \
             generation ran out are retired",
        )
    }
}

impl<T> std::error::Error for CapacityError<T> {}

/// One timer as stored in a slot list: 8 bytes, whatever `T` is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Elem {
    /// The low 32 bits of the deadline: enough to re-slot the timer when a level whose slots
    /// span fewer than 2^32 ticks cascades, without reading its record.
    dlow: u32,
    /// Index of the timer's record in the key table.
    key: u32,
}

/// How many elements ahead the cascade and expiry loops prefetch records.
const PREFETCH_AHEAD: usize = 16;

/// Elements per 64-byte cache line.
const ELEMS_PER_LINE: usize = 64 / mem::size_of::<Elem>();

/// Asks the CPU to start loading the cache line at `p`. A hint only: it has no effect on
/// behaviour, and is a no-op off x86_64.
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch<U>(p: *const U) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` never dereferences its argument, faults or writes memory: any
    // address, even one past the end of an allocation, is sound. SSE is part of the x86_64
    // baseline, so the instruction exists on every x86_64 CPU.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Where a pending timer's element lives, derived from its deadline and the wheel's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// Due at or before `now()`: in the ready list.
    Ready,
    /// In `slots[level * slots_per_level + slot]`.
    Slot { level: usize, slot: usize },
    /// Beyond the last level's range.
    Overflow,
}

/// The next point the wheel must stop at while advancing.
#[derive(Debug, Clone, Copy)]
enum Event {
    Slot {
        level: usize,
        slot: usize,
        start: u64,
    },
    Overflow {
        start: u64,
    },
}

impl Event {
    fn start(&self) -> u64 {
        match *self {
            Event::Slot { start, .. } | Event::Overflow { start } => start,
        }
    }
}

/// A hierarchical timing wheel holding timers that carry a `T`.
///
/// See the [module documentation](self) for the layout and its costs.
pub struct Wheel<T> {
    layout: Layout,
    /// The wheel's time: every pending timer due at or before it is in `ready`.
    elapsed: u64,
    keys: Keys<T>,
    /// `levels * slots_per_level` vectors, level-major.
    slots: Box<[Vec<Elem>]>,
    /// Occupancy bitmap: level `l` owns `words_per_level` words, and bit `s` of them is set
    /// exactly when slot `s` of that level is non-empty.
    occupied: Box<[u64]>,
    words_per_level: usize,
    /// Timers due at or before `elapsed`, in one of two orders (see `ready_heap`). A record's
    /// `pos` is its index here, in either.
    ready: Vec<Elem>,
    /// `false`: sorted by descending deadline, popped from the end in O(1); what a level-0
    /// slot becomes (all its timers tie), and what inserts in descending order and cancels
    /// among ties keep. `true`: a binary min-heap on the deadline (root at 0), O(log n) per
    /// insert, cancel and pop; entered, by one O(n) reversal, at the first change that would
    /// break the sorted order, and left when the list empties. (A flag to re-sort on the next
    /// pop instead cost a whole sort at each pop that followed such a change: quadratic for a
    /// caller that interleaves them.)
    ready_heap: bool,
    /// Elements rewritten by switches to the heap order, for the tests' complexity checks.
    #[cfg(test)]
    heapified: usize,
    /// Timers beyond the last level's range.
    overflow: Vec<Elem>,
    /// A lower bound of the overflow deadlines (exact after each overflow rescan).
    overflow_min: u64,
}

impl<T> Default for Wheel<T> {
    fn default() -> Self {
        Wheel::new()
    }
}

impl<T> fmt::Debug for Wheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wheel")
            .field("layout", &self.layout)
            .field("now", &self.elapsed)
            .field("len", &self.len())
            .field("next_deadline", &self.next_deadline())
            .finish()
    }
}

impl<T> Wheel<T> {
    /// An empty wheel with the default [`Layout`] (8 levels of 256 slots) at tick 0.
    pub fn new() -> Wheel<T> {
        Wheel::with_layout(Layout::default())
    }

    /// An empty wheel with room for `n` timers before its key table reallocates.
    ///
    /// On Linux a key table of 32 MiB or more (1.4M timers of `u64`) asks the kernel for
    /// transparent huge pages, so filling it takes a page fault per 2 MiB rather than per
    /// 4 KiB (a new 10M-timer wheel filled in 0.66× the time). The memory's contents are
    /// unaffected; a kernel without THP ignores the advice.
    ///
    /// `n` is a hint: it is capped at the most timers a wheel can index (`u32::MAX`), and a
    /// reservation the system refuses (one past `isize::MAX` bytes, or more memory than it
    /// will promise) leaves the wheel empty, growing on demand like [`new`](Self::new). It
    /// never panics.
    pub fn with_capacity(n: usize) -> Wheel<T> {
        let mut wheel = Wheel::new();
        wheel.keys = Keys::with_capacity(n);
        wheel
    }

    /// An empty wheel of the given shape at tick 0.
    pub fn with_layout(layout: Layout) -> Wheel<T> {
        let n = layout.levels() * layout.slots_per_level();
        let words_per_level = layout.slots_per_level().div_ceil(64);
        Wheel {
            layout,
            elapsed: 0,
            keys: Keys::with_capacity(0),
            slots: (0..n).map(|_| Vec::new()).collect(),
            occupied: vec![0; layout.levels() * words_per_level].into_boxed_slice(),
            words_per_level,
            ready: Vec::new(),
            ready_heap: false,
            #[cfg(test)]
            heapified: 0,
            overflow: Vec::new(),
            overflow_min: u64::MAX,
        }
    }

    /// The wheel's shape.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The number of pending timers.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no timer is pending.
    pub fn is_empty(&self) -> bool {
        self.keys.len() == 0
    }

    /// The wheel's current tick: the largest `now` passed to [`poll`](Self::poll) so far, once
    /// that poll has returned `None` (0 for a new wheel).
    pub fn now(&self) -> u64 {
        self.elapsed
    }

    /// Adds a timer due at `deadline` and returns its key. O(1).
    ///
    /// A deadline at or before [`now`](Self::now) fires at the next `poll`. Any deadline up to
    /// `u64::MAX` is accepted.
    ///
    /// # Panics
    ///
    /// When no record index is free, as for [`try_insert`](Self::try_insert), which returns the
    /// value instead (like `Vec::push` on capacity overflow).
    pub fn insert(&mut self, deadline: u64, value: T) -> TimerKey {
        match self.try_insert(deadline, value) {
            Ok(key) => key,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`insert`](Self::insert), but hands the value back in a [`CapacityError`] when every
    /// record index is in use, instead of panicking: at most `u32::MAX` timers pending, fewer
    /// once records whose generation ran out (each index reused at least 2^30 times) are
    /// retired.
    #[inline]
    pub fn try_insert(&mut self, deadline: u64, value: T) -> Result<TimerKey, CapacityError<T>> {
        let key = self.keys.alloc(deadline, value).map_err(CapacityError)?;
        self.place(
            Elem {
                dlow: deadline as u32,
                key: key.index,
            },
            deadline,
        );
        Ok(key)
    }

    /// Removes a pending timer and returns its value. O(1).
    ///
    /// Returns `None`, touching nothing, when the key is stale: the timer already fired, was
    /// cancelled or drained. (A key from *another* wheel is not detected: it may name one of
    /// this wheel's timers. The engine's `TimerId` carries an engine tag for that.)
    #[inline]
    pub fn cancel(&mut self, key: TimerKey) -> Option<T> {
        let deadline = self.keys.get(key)?.deadline;
        self.unlink(key.index, deadline);
        Some(self.keys.take(key.index).2)
    }

    /// Moves a pending timer to a new deadline, keeping its key valid. O(1).
    ///
    /// Returns `false`, touching nothing, when the key is stale. A deadline at or before
    /// [`now`](Self::now) makes the timer fire at the next `poll`.
    #[inline]
    pub fn reset(&mut self, key: TimerKey, deadline: u64) -> bool {
        let Some(old) = self.keys.get(key).map(|e| e.deadline) else {
            return false;
        };
        if old == deadline {
            return true;
        }
        let (from, to) = (self.locate(old), self.locate(deadline));
        if from == to {
            if let Loc::Slot { level, slot } = to {
                // Same slot (an idle timeout pushed back a little): only the deadline changes.
                let pos = self.keys.entries[key.index as usize].pos as usize;
                self.keys.entries[key.index as usize].deadline = deadline;
                self.slots[level * self.layout.slots_per_level() + slot][pos].dlow =
                    deadline as u32;
                return true;
            }
        }
        self.unlink(key.index, old);
        self.keys.entries[key.index as usize].deadline = deadline;
        let elem = Elem {
            dlow: deadline as u32,
            key: key.index,
        };
        self.place(elem, deadline);
        true
    }

    /// The deadline of a pending timer, or `None` when the key is stale.
    pub fn deadline(&self, key: TimerKey) -> Option<u64> {
        self.keys.get(key).map(|e| e.deadline)
    }

    /// Whether `key` names a pending timer.
    pub fn contains(&self, key: TimerKey) -> bool {
        self.keys.get(key).is_some()
    }

    /// Takes the next expired timer, if any.
    ///
    /// The wheel advances to `max(now, self.now())`: its time never goes backwards, and an
    /// earlier `now` is not an error (it only yields what is already due). Calling `poll` until it
    /// returns `None` yields every timer due at or before that time, in non-decreasing deadline
    /// order (ties in no particular order); afterwards `self.now()` is that time.
    ///
    /// The work is proportional to the timers yielded and the occupied slots passed on the way,
    /// not to the number of ticks, so a jump of years is as cheap as a jump of one tick over the
    /// same timers.
    #[inline]
    pub fn poll(&mut self, now: u64) -> Option<Expired<T>> {
        let now = now.max(self.elapsed);
        loop {
            if !self.ready.is_empty() {
                return self.pop_ready();
            }
            match self.next_event() {
                Some(event) if event.start() <= now => self.process(event),
                _ => {
                    self.elapsed = now;
                    return None;
                }
            }
        }
    }

    /// A tick no later than the earliest pending deadline, or `None` exactly when nothing is
    /// pending. A driver that sleeps until it never oversleeps.
    ///
    /// It is exact when the earliest timer is on the lowest level (due within the current
    /// rotation of `slots_per_level` ticks), and otherwise the start of the slot that holds it;
    /// with only overflow timers pending, the earliest one's deadline, or earlier after a
    /// cancel there (the tier's minimum is a lower bound until its next rescan).
    /// It is read from the per-level occupancy bitmaps (O(levels × slots_per_level / 64)
    /// words), with no scan of slots.
    pub fn next_deadline(&self) -> Option<u64> {
        let earliest = if self.ready_heap {
            self.ready.first()
        } else {
            self.ready.last()
        };
        if let Some(elem) = earliest {
            return Some(self.keys.entries[elem.key as usize].deadline);
        }
        if let Some(event) = self.next_event() {
            return Some(match event {
                Event::Slot { start, .. } => start,
                Event::Overflow { .. } => self.overflow_min,
            });
        }
        None
    }

    /// How many pending timers sit on each level (index 0 = lowest). Timers already due but not
    /// yet polled, and those in the overflow tier, are on no level. O(levels × slots).
    pub fn pending_per_level(&self) -> Vec<usize> {
        self.slots
            .chunks(self.layout.slots_per_level())
            .map(|level| level.iter().map(Vec::len).sum())
            .collect()
    }

    /// Removes every pending timer, dropping the values. Keys handed out before stay stale. If a
    /// value's `Drop` panics, the panic propagates and the timers not yet dropped stay pending.
    pub fn clear(&mut self) {
        // Not through `Drain`, whose own drop would drop the rest while the panic unwinds (and
        // a second panicking value would then abort).
        let mut from = 0;
        while let Some(removed) = self.remove_any(&mut from) {
            drop(removed);
        }
        // New timers fill the lowest records first, so a later shrink can release the rest.
        self.keys.rebuild_free_list();
    }

    /// Returns memory to the allocator after a peak: spare capacity of every slot and of the key
    /// table, and the key records past the highest pending one (except a record used about 2^30
    /// times or more, which stays so that its generations are never handed out again).
    pub fn shrink_to_fit(&mut self) {
        for list in self.lists_mut() {
            list.shrink_to_fit();
        }
        self.keys.shrink_to_fit();
    }

    /// The bytes this wheel has allocated on the heap (by capacity), for memory accounting.
    pub fn allocated_bytes(&self) -> usize {
        let elem = mem::size_of::<Elem>();
        let lists: usize = self.lists().map(|l| l.capacity() * elem).sum();
        let headers = (self.slots.len() + 2) * mem::size_of::<Vec<Elem>>()
            + self.occupied.len() * mem::size_of::<u64>();
        lists + headers + self.keys.capacity_bytes()
    }

    // ---- internals ------------------------------------------------------------------------

    /// All element lists: ready, every slot, overflow.
    fn lists(&self) -> impl Iterator<Item = &Vec<Elem>> {
        std::iter::once(&self.ready)
            .chain(self.slots.iter())
            .chain(std::iter::once(&self.overflow))
    }

    fn lists_mut(&mut self) -> impl Iterator<Item = &mut Vec<Elem>> {
        std::iter::once(&mut self.ready)
            .chain(self.slots.iter_mut())
            .chain(std::iter::once(&mut self.overflow))
    }

    /// Removes one pending timer, the last element of the first non-empty list from `*from`
    /// (0: ready, then every slot, then overflow, as `lists` yields them), and moves `*from`
    /// past the lists found empty; `None` when there is none. Removing a list's last element
    /// moves no other, so the wheel is consistent after each call (for `Drain`, which may be
    /// leaked, and `clear`, whose drops may panic).
    pub(crate) fn remove_any(&mut self, from: &mut usize) -> Option<(TimerKey, u64, T)> {
        let mut index = None;
        for list in self.lists().skip(*from) {
            if let Some(last) = list.last() {
                // Taken now; start loading the record taken a few calls from now.
                if let Some(ahead) = list.len().checked_sub(PREFETCH_AHEAD + 1) {
                    let next = list[ahead].key as usize;
                    prefetch(self.keys.entries.as_ptr().wrapping_add(next));
                }
                index = Some(last.key);
                break;
            }
            *from += 1;
        }
        let index = index?;
        let deadline = self.keys.entries[index as usize].deadline;
        self.unlink(index, deadline);
        Some(self.keys.take(index))
    }

    #[inline]
    fn locate(&self, deadline: u64) -> Loc {
        if deadline <= self.elapsed {
            return Loc::Ready;
        }
        let level = self.layout.level_for(self.elapsed, deadline);
        if level >= self.layout.levels() {
            Loc::Overflow
        } else {
            Loc::Slot {
                level,
                slot: self.layout.slot_for(level, deadline),
            }
        }
    }

    /// Puts `elem` (whose record already holds `deadline`) where `deadline` belongs and records
    /// its position.
    #[inline]
    fn place(&mut self, elem: Elem, deadline: u64) {
        let key = elem.key as usize;
        let list = match self.locate(deadline) {
            Loc::Slot { level, slot } => {
                self.occupied[level * self.words_per_level + slot / 64] |= 1 << (slot % 64);
                &mut self.slots[level * self.layout.slots_per_level() + slot]
            }
            Loc::Ready => {
                // Popped from the end: still sorted only if this is the earliest so far.
                let out_of_order = self
                    .ready
                    .last()
                    .is_some_and(|last| deadline > self.keys.entries[last.key as usize].deadline);
                if self.ready_heap || out_of_order {
                    return self.heap_push(elem);
                }
                &mut self.ready
            }
            Loc::Overflow => {
                // The first one sets it: a minimum left from timers that have all gone would
                // name a tick long past in `next_deadline`.
                self.overflow_min = if self.overflow.is_empty() {
                    deadline
                } else {
                    self.overflow_min.min(deadline)
                };
                &mut self.overflow
            }
        };
        // Grow by 1.5× rather than 2×: slot vectors keep their capacity for reuse, and halving
        // the spare room measurably cuts resident bytes per timer.
        if list.len() == list.capacity() {
            list.reserve_exact((list.len() / 2).max(4));
        }
        // Fits: a list never holds more elements than there are key records (< u32::MAX).
        self.keys.entries[key].pos = list.len() as u32;
        list.push(elem);
        // Inserts land on hundreds of slot lists at once, too many streams for the hardware
        // prefetcher, so each list's next cache line would be a store miss when its turn comes.
        // Ask for it now; by the time this list is written again it is in cache.
        prefetch(list.as_ptr().wrapping_add(list.len() + ELEMS_PER_LINE));
    }

    /// Removes the element of the pending timer `index`, due at `deadline`, from its list.
    /// It does not read the element (that would be a second dependent cache miss): the last
    /// element of the list is moved over it, and that one's record learns its new position.
    #[inline]
    fn unlink(&mut self, index: u32, deadline: u64) {
        let loc = self.locate(deadline);
        if loc == Loc::Ready && self.unlink_ready_out_of_order(index, deadline) {
            return;
        }
        let pos = self.keys.entries[index as usize].pos as usize;
        let list = match loc {
            Loc::Slot { level, slot } => {
                &mut self.slots[level * self.layout.slots_per_level() + slot]
            }
            Loc::Ready => &mut self.ready,
            Loc::Overflow => &mut self.overflow,
        };
        debug_assert_eq!(list[pos].key, index, "key table and slot disagree");
        // A pending timer's list holds at least its own element.
        let Some(last) = list.pop() else {
            debug_assert!(false, "unlink from an empty list");
            return;
        };
        if pos < list.len() {
            list[pos] = last;
            self.keys.entries[last.key as usize].pos = pos as u32;
        }
        if list.is_empty() {
            match loc {
                Loc::Slot { level, slot } => self.clear_occupied(level, slot),
                Loc::Ready | Loc::Overflow => {}
            }
        }
    }

    /// Removes ready timer `index` (due at `deadline`) if the ready list is, or must become, a
    /// heap; `false` (nothing done) if a swap-remove keeps it sorted. Out of line: the
    /// slot lists' cancels and the sorted pops stay lean.
    #[cold]
    #[inline(never)]
    fn unlink_ready_out_of_order(&mut self, index: u32, deadline: u64) -> bool {
        // The element moved over it is the last, the earliest of a sorted list: in its place
        // the order holds only if the two tie (then everything from there on ties). Timers due
        // in one tick tie, and cancelling among them keeps the O(1) pops.
        if !self.ready_heap {
            let pos = self.keys.entries[index as usize].pos as usize;
            let breaks_order = pos + 1 < self.ready.len()
                && self
                    .ready
                    .last()
                    .is_some_and(|last| self.keys.entries[last.key as usize].deadline != deadline);
            if !breaks_order {
                return false;
            }
        }
        self.ready_to_heap();
        let pos = self.keys.entries[index as usize].pos as usize;
        debug_assert_eq!(self.ready[pos].key, index, "key table and heap disagree");
        let _ = self.heap_remove(pos);
        true
    }

    /// Adds a ready element in the heap order (switching to it first if need be).
    #[cold]
    #[inline(never)]
    fn heap_push(&mut self, elem: Elem) {
        self.ready_to_heap();
        self.keys.entries[elem.key as usize].pos = self.ready.len() as u32;
        self.ready.push(elem);
        self.sift_up(self.ready.len() - 1);
    }

    /// Switches the ready list to the heap order, if it is not in it: a list sorted by
    /// descending deadline, reversed, is a min-heap. O(n), once per switch.
    fn ready_to_heap(&mut self) {
        if self.ready_heap {
            return;
        }
        self.ready.reverse();
        for (pos, elem) in self.ready.iter().enumerate() {
            self.keys.entries[elem.key as usize].pos = pos as u32;
        }
        #[cfg(test)]
        {
            self.heapified += self.ready.len();
        }
        self.ready_heap = true;
    }

    /// The deadline of the ready element at `pos`.
    #[inline]
    fn ready_deadline(&self, pos: usize) -> u64 {
        self.keys.entries[self.ready[pos].key as usize].deadline
    }

    /// Swaps two ready elements, and their records' positions.
    #[inline]
    fn ready_swap(&mut self, a: usize, b: usize) {
        self.ready.swap(a, b);
        self.keys.entries[self.ready[a].key as usize].pos = a as u32;
        self.keys.entries[self.ready[b].key as usize].pos = b as u32;
    }

    /// Moves the heap element at `pos` up to its place; returns where it ends.
    fn sift_up(&mut self, mut pos: usize) -> usize {
        while pos > 0 {
            let parent = (pos - 1) / 2;
            if self.ready_deadline(pos) >= self.ready_deadline(parent) {
                break;
            }
            self.ready_swap(pos, parent);
            pos = parent;
        }
        pos
    }

    /// Moves the heap element at `pos` down to its place.
    fn sift_down(&mut self, mut pos: usize) {
        loop {
            let left = 2 * pos + 1;
            if left >= self.ready.len() {
                return;
            }
            let right = left + 1;
            let child = if right < self.ready.len()
                && self.ready_deadline(right) < self.ready_deadline(left)
            {
                right
            } else {
                left
            };
            if self.ready_deadline(child) >= self.ready_deadline(pos) {
                return;
            }
            self.ready_swap(pos, child);
            pos = child;
        }
    }

    /// Removes the heap element at `pos` (its record is left as it is); leaves the sorted
    /// order when the list empties. Out of line, as the other heap paths: the sorted pops stay
    /// lean.
    #[cold]
    #[inline(never)]
    fn heap_remove(&mut self, pos: usize) -> Option<Elem> {
        let last = self.ready.len().checked_sub(1)?;
        debug_assert!(pos <= last, "heap position out of range");
        if pos < last {
            self.ready_swap(pos, last);
        }
        let elem = self.ready.pop()?;
        if pos < self.ready.len() {
            let at = self.sift_up(pos);
            self.sift_down(at);
        }
        if self.ready.is_empty() {
            self.ready_heap = false;
        }
        Some(elem)
    }

    #[inline]
    pub(crate) fn clear_occupied(&mut self, level: usize, slot: usize) {
        self.occupied[level * self.words_per_level + slot / 64] &= !(1 << (slot % 64));
    }

    /// The earliest point the wheel must stop at: the first occupied slot of the lowest occupied
    /// level (every slot of a level lies after the wheel's position on it, and every level
    /// starts after the one below), or, with all levels empty, the overflow epoch of the
    /// earliest overflow deadline.
    #[inline]
    fn next_event(&self) -> Option<Event> {
        for (word, &occ) in self.occupied.iter().enumerate() {
            if occ != 0 {
                let level = word / self.words_per_level;
                let slot = (word % self.words_per_level) * 64 + occ.trailing_zeros() as usize;
                let start = self.layout.slot_start(self.elapsed, level, slot);
                debug_assert!(start > self.elapsed, "slot behind the wheel's time");
                return Some(Event::Slot { level, slot, start });
            }
        }
        if self.overflow.is_empty() {
            return None;
        }
        // `max` keeps a stale lower bound from moving time backwards; a rescan makes it exact.
        let start = self.layout.epoch_start(self.overflow_min).max(self.elapsed);
        Some(Event::Overflow { start })
    }

    /// Advances the wheel's time to `event` and empties the slot (or overflow tier) due there:
    /// timers due exactly then go to `ready`, the rest move down to where they now belong.
    fn process(&mut self, event: Event) {
        match event {
            Event::Slot { level, slot, start } => {
                self.elapsed = start;
                self.clear_occupied(level, slot);
                let idx = level * self.layout.slots_per_level() + slot;
                let mut list = mem::take(&mut self.slots[idx]);
                if level == 0 {
                    // Every timer here is due exactly at `start`: the vector becomes the ready
                    // list as it is (positions unchanged), and the empty ready vector's capacity
                    // goes back to the slot.
                    debug_assert!(self.ready.is_empty() && !self.ready_heap);
                    mem::swap(&mut self.ready, &mut list);
                } else {
                    let shift = self.layout.slot_bits() * level as u32;
                    let high = start & !low_mask(shift);
                    let mut drain = list.drain(..);
                    while let Some(elem) = drain.next() {
                        // The record's `pos` is about to be written: start loading it now.
                        if let Some(ahead) = drain.as_slice().get(PREFETCH_AHEAD) {
                            prefetch(self.keys.entries.as_ptr().wrapping_add(ahead.key as usize));
                        }
                        let deadline = if shift <= 32 {
                            high | (u64::from(elem.dlow) & low_mask(shift))
                        } else {
                            self.keys.entries[elem.key as usize].deadline
                        };
                        debug_assert_eq!(deadline, self.keys.entries[elem.key as usize].deadline);
                        self.place(elem, deadline);
                    }
                    drop(drain);
                }
                self.slots[idx] = list;
            }
            Event::Overflow { start } => {
                self.elapsed = start;
                self.overflow_min = u64::MAX;
                let list = mem::take(&mut self.overflow);
                for elem in list {
                    let deadline = self.keys.entries[elem.key as usize].deadline;
                    self.place(elem, deadline);
                }
            }
        }
    }

    /// Pops the earliest ready timer.
    #[inline]
    fn pop_ready(&mut self) -> Option<Expired<T>> {
        let elem = if self.ready_heap {
            self.heap_remove(0)?
        } else {
            let elem = self.ready.pop()?;
            if let Some(ahead) = self.ready.len().checked_sub(PREFETCH_AHEAD) {
                let next = self.ready[ahead].key as usize;
                prefetch(self.keys.entries.as_ptr().wrapping_add(next));
            }
            elem
        };
        let (key, deadline, value) = self.keys.take(elem.key);
        Some(Expired {
            key,
            deadline,
            value,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the ready list's order (sorted descending, or a min-heap) and every position.
    fn check_ready<T>(wheel: &Wheel<T>) {
        let dl = |i: usize| wheel.keys.entries[wheel.ready[i].key as usize].deadline;
        for (i, elem) in wheel.ready.iter().enumerate() {
            assert_eq!(
                wheel.keys.entries[elem.key as usize].pos as usize, i,
                "position"
            );
            if wheel.ready_heap {
                if i > 0 {
                    assert!(dl((i - 1) / 2) <= dl(i), "heap order at {i}");
                }
            } else if i > 0 {
                assert!(dl(i - 1) >= dl(i), "sorted order at {i}");
            }
        }
    }

    /// Cancelling among timers that tie in the ready list keeps it sorted (O(1) pops). A cancel
    /// whose filler has another deadline switches it to the heap order, and the pops still
    /// come out in order.
    #[test]
    fn cancelling_among_tied_ready_timers_keeps_the_order() {
        let mut wheel = Wheel::new();
        assert!(wheel.poll(50).is_none());
        // Due already, so straight into the ready list, in descending order: 20, then 10s.
        let later = wheel.insert(20, -1);
        let tied: Vec<TimerKey> = (0..100).map(|i| wheel.insert(10, i)).collect();
        assert!(!wheel.ready_heap);
        for &key in &tied[1..60] {
            assert!(wheel.cancel(key).is_some());
            assert!(
                !wheel.ready_heap,
                "a tied cancel changed the ready list's order"
            );
        }
        check_ready(&wheel);
        // The filler from the end (due at 10) would move to the front, before a 10.
        assert!(wheel.cancel(later).is_some());
        assert!(wheel.ready_heap);
        check_ready(&wheel);
        let fired: Vec<i32> = std::iter::from_fn(|| wheel.poll(50).map(|e| e.value)).collect();
        let mut expected: Vec<i32> = std::iter::once(0).chain(60..100).collect();
        let mut sorted = fired.clone();
        sorted.sort_unstable();
        expected.sort_unstable();
        assert_eq!(sorted, expected);
        assert!(wheel.is_empty());
        assert!(
            !wheel.ready_heap,
            "an empty ready list is back in the sorted order"
        );
    }

    /// Timers already due inserted out of order between single polls, over a large backlog
    /// of due timers: the ready list switches to the heap order once, and each insert, cancel
    /// and pop after that is O(log n). (A flag to re-sort on the next pop sorted the whole
    /// backlog at every poll: 100 000 × 1 000 elements here.)
    #[test]
    fn interleaved_late_inserts_and_polls_over_a_backlog_do_not_resort_it() {
        let mut wheel = Wheel::new();
        assert!(wheel.poll(1 << 20).is_none());
        let n = 100_000u64;
        // Descending: the backlog stays sorted, as a level-0 slot's timers would be.
        for d in (0..n).rev() {
            wheel.insert(d, d);
        }
        assert!(!wheel.ready_heap);
        let mut last = 0;
        let mut cancel_next = None;
        for i in 0..1_000u64 {
            let key = wheel.insert(200_000 + i, 200_000 + i);
            if let Some(k) = cancel_next.replace(key) {
                assert!(wheel.cancel(k).is_some());
            }
            let e = wheel.poll(0).expect("a due timer");
            assert!(e.deadline >= last, "popped out of order");
            last = e.deadline;
        }
        check_ready(&wheel);
        // One switch, at the first late insert, over the backlog as it was.
        assert!(
            wheel.heapified == n as usize,
            "{} elements rewritten by switches to the heap order",
            wheel.heapified
        );
        let rest: Vec<u64> = std::iter::from_fn(|| wheel.poll(0).map(|e| e.deadline)).collect();
        assert!(rest.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(rest.len() as u64, n - 1_000 + 1);
    }

    #[test]
    fn sizes_for_u64() {
        assert_eq!(mem::size_of::<Elem>(), 8);
        assert_eq!(mem::size_of::<keys::Record<u64>>(), 24);
    }
}
