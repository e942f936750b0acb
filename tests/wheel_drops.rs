//! The wheel stores values in `MaybeUninit` records (see `src/wheel/keys.rs`). These tests run
//! random operations on values that record their own drops, and check that every value is
//! dropped exactly once, whichever way it leaves the wheel (fired, cancelled, drained, cleared,
//! or dropped with the wheel), and that values read through `iter` are the live ones. Drains
//! are also leaked part-way, and a value's drop panics inside `clear` or a drain's drop: the
//! wheel must stay whole either way (every timer left fires at its deadline). When one
//! value's drop panics as the wheel itself is dropped, the others are still dropped.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;

use delaywheel::wheel::{Layout, TimerKey, Wheel};
use proptest::prelude::*;

#[derive(Debug)]
struct Tracked {
    id: u64,
    dropped: Rc<RefCell<Vec<u64>>>,
    /// Heap data, so a double drop or a use after free shows up as a crash or garbage.
    payload: Box<[u64; 4]>,
    /// Counts drops down; the drop that takes it from 1 to 0 panics (after recording itself).
    bomb: Rc<Cell<u32>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        assert_eq!(self.payload[0], self.id, "value corrupted");
        self.dropped.borrow_mut().push(self.id);
        let left = self.bomb.get();
        if left > 0 {
            self.bomb.set(left - 1);
            if left == 1 {
                std::panic::panic_any(PLANTED);
            }
        }
    }
}

const PLANTED: &str = "a value's drop panicked";

/// The panics `ClearPanicking` plants are expected: keep the default hook (and its backtrace,
/// slow to symbolize thousands of times) for any other. This binary holds this one test.
fn quiet_planted_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&PLANTED) {
                default(info);
            }
        }));
    });
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Cancel(usize),
    Reset(usize, u64),
    Poll(u64),
    Iter,
    DrainSome(usize),
    /// Take a few from a drain, then leak it.
    ForgetDrain(usize),
    /// `clear` (or, if true, a drain dropped untouched), with the n-th drop (from 1) panicking.
    ClearPanicking(u32, bool),
    Clear,
    Shrink,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u64..5_000).prop_map(Op::Insert),
        3 => any::<usize>().prop_map(Op::Cancel),
        2 => (any::<usize>(), 0u64..5_000).prop_map(|(i, d)| Op::Reset(i, d)),
        3 => (0u64..2_000).prop_map(Op::Poll),
        1 => Just(Op::Iter),
        1 => (0usize..5).prop_map(Op::DrainSome),
        1 => (0usize..5).prop_map(Op::ForgetDrain),
        1 => (1u32..6, any::<bool>()).prop_map(|(n, drain)| Op::ClearPanicking(n, drain)),
        1 => Just(Op::Clear),
        1 => Just(Op::Shrink),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn every_value_is_dropped_exactly_once(
        ops in proptest::collection::vec(op(), 1..120),
        // The wheel is dropped at the end with this drop (from 1; 0 for none) panicking.
        drop_bomb in 0u32..4,
        // A small layout (3 levels of 4 slots: 64 ticks), so that the same deadlines also sit
        // on every level and in the overflow tier, not only on the default's two lowest.
        small in any::<bool>(),
    ) {
        quiet_planted_panics();
        let dropped = Rc::new(RefCell::new(Vec::new()));
        let bomb = Rc::new(Cell::new(0));
        let mut created = 0u64;
        // key → (id, deadline)
        let mut live: BTreeMap<TimerKey, (u64, u64)> = BTreeMap::new();
        let mut keys = Vec::new();
        {
            let mut wheel: Wheel<Tracked> = if small {
                Wheel::with_layout(Layout::new(3, 4).expect("a valid layout"))
            } else {
                Wheel::new()
            };
            for op in &ops {
                let now = wheel.now();
                match op {
                    Op::Insert(d) => {
                        let id = created;
                        created += 1;
                        let value = Tracked {
                            id,
                            dropped: dropped.clone(),
                            payload: Box::new([id; 4]),
                            bomb: bomb.clone(),
                        };
                        let key = wheel.insert(now + d, value);
                        live.insert(key, (id, now + d));
                        keys.push(key);
                    }
                    Op::Cancel(i) if !keys.is_empty() => {
                        let key = keys[i % keys.len()];
                        let got = wheel.cancel(key).map(|v| v.id);
                        prop_assert_eq!(got, live.remove(&key).map(|(id, _)| id));
                    }
                    Op::Reset(i, d) if !keys.is_empty() => {
                        let key = keys[i % keys.len()];
                        let held = live.get_mut(&key).map(|v| v.1 = now + d).is_some();
                        prop_assert_eq!(wheel.reset(key, now + d), held);
                    }
                    Op::Poll(step) => {
                        while let Some(e) = wheel.poll(now + step) {
                            prop_assert!(e.deadline <= now + step, "fired early");
                            prop_assert_eq!(live.remove(&e.key), Some((e.value.id, e.deadline)));
                        }
                        prop_assert!(live.values().all(|v| v.1 > now + step), "a due timer did not fire");
                    }
                    Op::Iter => {
                        let seen: BTreeMap<TimerKey, (u64, u64)> =
                            wheel.iter().map(|(k, d, v)| (k, (v.id, d))).collect();
                        prop_assert_eq!(&seen, &live);
                    }
                    Op::DrainSome(n) => {
                        // Take a few, drop the iterator: the rest are dropped too.
                        for e in wheel.drain().take(*n) {
                            prop_assert_eq!(live.remove(&e.key), Some((e.value.id, e.deadline)));
                        }
                        live.clear();
                    }
                    Op::ForgetDrain(n) => {
                        // Leaked: the ones not taken stay pending.
                        let mut drain = wheel.drain();
                        for e in drain.by_ref().take(*n) {
                            prop_assert_eq!(live.remove(&e.key), Some((e.value.id, e.deadline)));
                        }
                        std::mem::forget(drain);
                    }
                    Op::ClearPanicking(nth, via_drain) => {
                        bomb.set(*nth);
                        let before = dropped.borrow().len();
                        let cleared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            if *via_drain {
                                drop(wheel.drain())
                            } else {
                                wheel.clear()
                            }
                        }));
                        prop_assert_eq!(cleared.is_err(), bomb.get() == 0);
                        if cleared.is_err() {
                            // Stopped at the panicking drop: nothing after it was dropped.
                            prop_assert_eq!(dropped.borrow().len() - before, *nth as usize);
                        }
                        bomb.set(0);
                        // Whatever was dropped is gone; the rest must still be pending.
                        let gone: HashSet<u64> = dropped.borrow().iter().copied().collect();
                        live.retain(|_, v| !gone.contains(&v.0));
                    }
                    Op::Clear => {
                        wheel.clear();
                        live.clear();
                    }
                    Op::Shrink => wheel.shrink_to_fit(),
                    Op::Cancel(_) | Op::Reset(..) => {}
                }
                prop_assert_eq!(wheel.len(), live.len());
                // Everything that left the wheel has been dropped, nothing pending has.
                let dropped_now: HashSet<u64> = dropped.borrow().iter().copied().collect();
                prop_assert_eq!(dropped_now.len(), dropped.borrow().len(), "double drop");
                for (id, _) in live.values() {
                    prop_assert!(!dropped_now.contains(id), "pending value {} dropped", id);
                }
                match (wheel.next_deadline(), live.values().map(|v| v.1).min()) {
                    (None, None) => {}
                    (Some(next), Some(min)) => prop_assert!(next <= min),
                    (next, min) => prop_assert!(false, "next_deadline {:?}, earliest {:?}", next, min),
                }
                prop_assert_eq!(dropped_now.len() as u64 + live.len() as u64, created);
            }
            // Dropped with whatever is still pending; if one value's drop panics, the rest
            // are still dropped (as `Vec` does).
            bomb.set(drop_bomb);
            let whole = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(wheel)));
            prop_assert_eq!(whole.is_err(), drop_bomb > 0 && bomb.get() == 0);
            bomb.set(0);
        }
        let all: HashSet<u64> = dropped.borrow().iter().copied().collect();
        prop_assert_eq!(all.len(), dropped.borrow().len(), "double drop");
        prop_assert_eq!(all.len() as u64, created, "leaked values");
    }
}
