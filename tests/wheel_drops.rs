//! The wheel stores values in `MaybeUninit` records (see `src/wheel/keys.rs`). These tests run
//! random operations on values that record their own drops, and check that every value is
//! dropped exactly once, whichever way it leaves the wheel (fired, cancelled, drained, cleared,
//! or dropped with the wheel), and that values read through `iter` are the live ones.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;

use delaywheel::wheel::{TimerKey, Wheel};
use proptest::prelude::*;

#[derive(Debug)]
struct Tracked {
    id: u64,
    dropped: Rc<RefCell<Vec<u64>>>,
    /// Heap data, so a double drop or a use after free shows up as a crash or garbage.
    payload: Box<[u64; 4]>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        assert_eq!(self.payload[0], self.id, "value corrupted");
        self.dropped.borrow_mut().push(self.id);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Cancel(usize),
    Reset(usize, u64),
    Poll(u64),
    Iter,
    DrainSome(usize),
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
        1 => Just(Op::Clear),
        1 => Just(Op::Shrink),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn every_value_is_dropped_exactly_once(ops in proptest::collection::vec(op(), 1..120)) {
        let dropped = Rc::new(RefCell::new(Vec::new()));
        let mut created = 0u64;
        let mut live: BTreeMap<TimerKey, u64> = BTreeMap::new();
        let mut keys = Vec::new();
        {
            let mut wheel: Wheel<Tracked> = Wheel::new();
            for op in &ops {
                let now = wheel.now();
                match op {
                    Op::Insert(d) => {
                        let id = created;
                        created += 1;
                        let value = Tracked { id, dropped: dropped.clone(), payload: Box::new([id; 4]) };
                        let key = wheel.insert(now + d, value);
                        live.insert(key, id);
                        keys.push(key);
                    }
                    Op::Cancel(i) if !keys.is_empty() => {
                        let key = keys[i % keys.len()];
                        let got = wheel.cancel(key).map(|v| v.id);
                        prop_assert_eq!(got, live.remove(&key));
                    }
                    Op::Reset(i, d) if !keys.is_empty() => {
                        let key = keys[i % keys.len()];
                        prop_assert_eq!(wheel.reset(key, now + d), live.contains_key(&key));
                    }
                    Op::Poll(step) => {
                        while let Some(e) = wheel.poll(now + step) {
                            prop_assert_eq!(live.remove(&e.key), Some(e.value.id));
                        }
                    }
                    Op::Iter => {
                        let seen: BTreeMap<TimerKey, u64> =
                            wheel.iter().map(|(k, _, v)| (k, v.id)).collect();
                        prop_assert_eq!(&seen, &live);
                    }
                    Op::DrainSome(n) => {
                        // Take a few, drop the iterator: the rest are dropped too.
                        for e in wheel.drain().take(*n) {
                            prop_assert_eq!(live.remove(&e.key), Some(e.value.id));
                        }
                        live.clear();
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
                for id in live.values() {
                    prop_assert!(!dropped_now.contains(id), "pending value {} dropped", id);
                }
                prop_assert_eq!(dropped_now.len() as u64 + live.len() as u64, created);
            }
        } // the wheel is dropped here with whatever is still pending
        let all: HashSet<u64> = dropped.borrow().iter().copied().collect();
        prop_assert_eq!(all.len(), dropped.borrow().len(), "double drop");
        prop_assert_eq!(all.len() as u64, created, "leaked values");
    }
}
