//! The shape of a wheel (levels × slots per level) and the bit arithmetic that maps a deadline to a slot.

use std::fmt;

/// The shape of a [`Wheel`](super::Wheel): how many levels, and how many slots on each level.
///
/// Level `l` has slots that each span `slots_per_level^l` ticks, so the lowest level has 1-tick
/// resolution and the wheel as a whole covers `slots_per_level^levels` ticks ahead of its current
/// time. Deadlines farther away than that wait in an overflow tier and still fire exactly on time.
/// The overflow tier is one unsorted list: each time the wheel reaches the span (epoch) of its
/// earliest deadline, the whole tier is re-examined, so a layout with a small range and many
/// far timers spread over many epochs pays O(overflow timers) per epoch.
///
/// The default is 8 levels of 256 slots, which covers all of `u64` (no overflow tier). A
/// level is chosen by the highest bit in which the deadline differs from the wheel's current
/// tick (aligned blocks, as in tokio), not by distance: a timer due in the current block of
/// 256 ticks sits on level 0, one in the current block of 65 536 ticks (65 s at 1 ms) on
/// level 1, and so on (a deadline just past a block boundary goes one level up, however near),
/// so a typical timeout is moved at most once or twice before it fires. Narrower levels
/// (6 of 64, as in tokio) move timers more often; see the benchmarks.
///
/// ```
/// use delaywheel::wheel::Layout;
///
/// let layout = Layout::new(4, 64).unwrap();
/// assert_eq!(layout.range(), Some(1 << 24));
/// assert!(Layout::new(4, 100).is_err()); // not a power of two
/// assert_eq!(Layout::default(), Layout::new(8, 256).unwrap());
/// assert_eq!(Layout::default().range(), None); // covers every u64 deadline
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    levels: u8,
    slot_bits: u8,
    /// `level_of_bit[b]` is `b / slot_bits`: the level of a timer whose deadline first differs
    /// from the wheel's time in bit `b` (a table, because a division is slow on the hot path).
    level_of_bit: [u8; 64],
}

/// Why [`Layout::new`] refused a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// `slots_per_level` must be a power of two from 2 to 4096.
    SlotsPerLevel(usize),
    /// `levels` must be at least 1, and `levels × log2(slots_per_level)` at most 64 bits.
    Levels {
        /// The number of levels asked for.
        levels: usize,
        /// The largest number of levels this `slots_per_level` allows.
        max: usize,
    },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LayoutError::SlotsPerLevel(n) => {
                write!(
                    f,
                    "slots per level must be a power of two in 2..=4096, got {n}"
                )
            }
            LayoutError::Levels { levels, max } => {
                write!(
                    f,
                    "levels must be in 1..={max} for this slot count, got {levels}"
                )
            }
        }
    }
}

impl std::error::Error for LayoutError {}

/// Mask of the `bits` lowest bits; all ones for 64 or more.
#[inline]
pub(crate) fn low_mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

impl Layout {
    /// A layout of `levels` levels of `slots_per_level` slots.
    ///
    /// Returns [`LayoutError::SlotsPerLevel`] unless `slots_per_level` is a power of two in
    /// `2..=4096`, and [`LayoutError::Levels`] unless `levels` is at least 1 and the levels together
    /// use at most 64 bits of the tick.
    pub const fn new(levels: usize, slots_per_level: usize) -> Result<Layout, LayoutError> {
        if slots_per_level < 2 || slots_per_level > 4096 || !slots_per_level.is_power_of_two() {
            return Err(LayoutError::SlotsPerLevel(slots_per_level));
        }
        let bits = slots_per_level.trailing_zeros() as usize;
        let max = 64 / bits;
        if levels == 0 || levels > max {
            return Err(LayoutError::Levels { levels, max });
        }
        Ok(Layout::from_bits(levels as u8, bits as u8))
    }

    const fn from_bits(levels: u8, slot_bits: u8) -> Layout {
        let mut level_of_bit = [0u8; 64];
        let mut b = 0;
        while b < 64 {
            level_of_bit[b] = (b as u8) / slot_bits;
            b += 1;
        }
        Layout {
            levels,
            slot_bits,
            level_of_bit,
        }
    }

    /// The number of levels.
    pub const fn levels(&self) -> usize {
        self.levels as usize
    }

    /// The number of slots on each level.
    pub const fn slots_per_level(&self) -> usize {
        1 << self.slot_bits
    }

    /// The span of ticks the levels cover (`slots_per_level^levels`), or `None` when they cover
    /// all of `u64` and there is no overflow tier. Levels are aligned blocks: a deadline in the
    /// block of this span that holds the wheel's current tick sits on a level, and one past
    /// the block's end waits in the overflow tier, however near (it still fires on time). So a
    /// deadline within `range()` ticks may overflow; one within the block never does.
    pub const fn range(&self) -> Option<u64> {
        let bits = self.range_bits();
        if bits >= 64 {
            None
        } else {
            Some(1 << bits)
        }
    }

    #[inline]
    pub(crate) const fn range_bits(&self) -> u32 {
        self.levels as u32 * self.slot_bits as u32
    }

    #[inline]
    pub(crate) const fn slot_bits(&self) -> u32 {
        self.slot_bits as u32
    }

    #[inline]
    pub(crate) const fn slot_mask(&self) -> u64 {
        (1 << self.slot_bits) - 1
    }

    /// The level a timer due at `deadline` belongs on when the wheel's time is `now`
    /// (`deadline > now`). A result `>= levels()` means the overflow tier.
    ///
    /// The level is that of the highest bit in which `now` and `deadline` differ, so a timer sits
    /// on the lowest level whose current rotation still contains its deadline.
    #[inline]
    pub(crate) fn level_for(&self, now: u64, deadline: u64) -> usize {
        debug_assert!(deadline > now);
        let masked = (now ^ deadline) | self.slot_mask();
        let significant = 63 - masked.leading_zeros();
        self.level_of_bit[significant as usize] as usize
    }

    /// The slot of `deadline` on `level`.
    #[inline]
    pub(crate) fn slot_for(&self, level: usize, deadline: u64) -> usize {
        ((deadline >> (self.slot_bits() * level as u32)) & self.slot_mask()) as usize
    }

    /// The first tick covered by `slot` of `level` in the rotation that contains `now`.
    #[inline]
    pub(crate) fn slot_start(&self, now: u64, level: usize, slot: usize) -> u64 {
        let shift = self.slot_bits() * level as u32;
        let base = now & !low_mask(shift + self.slot_bits());
        base | ((slot as u64) << shift)
    }

    /// The first tick of the overflow epoch (a span of `range()` ticks) that contains `deadline`.
    #[inline]
    pub(crate) fn epoch_start(&self, deadline: u64) -> u64 {
        deadline & !low_mask(self.range_bits())
    }
}

impl Default for Layout {
    fn default() -> Self {
        Layout::from_bits(8, 8)
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Layout")
            .field("levels", &self.levels())
            .field("slots_per_level", &self.slots_per_level())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes() {
        assert_eq!(Layout::new(6, 0), Err(LayoutError::SlotsPerLevel(0)));
        assert_eq!(Layout::new(6, 1), Err(LayoutError::SlotsPerLevel(1)));
        assert_eq!(Layout::new(6, 48), Err(LayoutError::SlotsPerLevel(48)));
        assert_eq!(Layout::new(6, 8192), Err(LayoutError::SlotsPerLevel(8192)));
        assert_eq!(Layout::new(5, 4096).unwrap().range(), Some(1 << 60));
        assert_eq!(
            Layout::new(0, 64),
            Err(LayoutError::Levels { levels: 0, max: 10 })
        );
        assert_eq!(
            Layout::new(11, 64),
            Err(LayoutError::Levels {
                levels: 11,
                max: 10
            })
        );
        assert!(Layout::new(64, 2).is_ok());
        assert_eq!(Layout::new(64, 2).unwrap().range(), None);
        assert_eq!(Layout::new(16, 16).unwrap().range(), None);
        assert_eq!(Layout::new(10, 64).unwrap().range(), Some(1 << 60));
    }

    #[test]
    fn level_and_slot_math() {
        let l = Layout::new(6, 64).unwrap();
        assert_eq!(l.level_for(0, 1), 0);
        assert_eq!(l.level_for(0, 63), 0);
        assert_eq!(l.level_for(0, 64), 1);
        assert_eq!(l.level_for(63, 64), 1);
        assert_eq!(l.level_for(64, 127), 0);
        assert_eq!(l.level_for(0, (1 << 36) - 1), 5);
        assert_eq!(l.level_for(0, 1 << 36), 6);
        assert_eq!(l.level_for(0, u64::MAX), 10);
        assert_eq!(l.slot_for(1, 64 * 5 + 3), 5);
        assert_eq!(l.slot_start(70, 1, 3), 192);
        assert_eq!(l.slot_start(4096 + 70, 0, 9), 4096 + 64 + 9);
        assert_eq!(l.epoch_start((3 << 36) + 5), 3 << 36);
        let d = Layout::default();
        assert_eq!(d.level_for(0, 255), 0);
        assert_eq!(d.level_for(0, 256), 1);
        assert_eq!(d.level_for(0, u64::MAX), 7);
        assert_eq!(d.slot_for(1, 256 * 200 + 3), 200);
        let full = Layout::new(16, 16).unwrap();
        assert_eq!(full.level_for(0, u64::MAX), 15);
        assert_eq!(full.slot_start(5, 15, 15), 15 << 60);
    }
}
