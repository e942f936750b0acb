//! Property test: random sequences of insert, cancel, reset, poll, drain, clear and shrink run
//! against a `BTreeMap` reference model, on several layouts (small ones force cascades and the
//! overflow tier constantly).

use std::collections::BTreeMap;

use delaywheel::wheel::{Layout, TimerKey, Wheel};
use proptest::prelude::*;

/// A deadline, relative to the wheel's time when the operation runs.
#[derive(Debug, Clone)]
enum When {
    Past(u64),
    Now,
    Near(u64),
    Mid(u64),
    /// Around and beyond the 6 × 64 layout's range (2^36; the default layout covers all of u64).
    Far(u64),
    Absolute(u64),
    Max,
}

impl When {
    fn resolve(&self, now: u64) -> u64 {
        match *self {
            When::Past(k) => now.saturating_sub(k),
            When::Now => now,
            When::Near(k) => now.saturating_add(k),
            When::Mid(k) => now.saturating_add(k),
            When::Far(k) => now.saturating_add((1 << 36) - 8).saturating_add(k),
            When::Absolute(t) => t,
            When::Max => u64::MAX,
        }
    }
}

/// A poll target, relative to the wheel's time.
#[derive(Debug, Clone)]
enum Jump {
    Zero,
    One,
    Small(u64),
    Large(u64),
    Huge(u64),
    Back(u64),
    ToMax,
}

impl Jump {
    fn resolve(&self, now: u64) -> u64 {
        match *self {
            Jump::Zero => now,
            Jump::One => now.saturating_add(1),
            Jump::Small(k) | Jump::Large(k) | Jump::Huge(k) => now.saturating_add(k),
            Jump::Back(k) => now.saturating_sub(k),
            Jump::ToMax => u64::MAX,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(When),
    Cancel(usize),
    CancelForged(u64),
    Reset(usize, When),
    Poll(Jump),
    /// Poll at most this many timers, leaving the rest of the due ones pending.
    PollSome(Jump, usize),
    Iter,
    Drain,
    Clear,
    Shrink,
}

fn when() -> impl Strategy<Value = When> {
    prop_oneof![
        2 => (0u64..200).prop_map(When::Past),
        1 => Just(When::Now),
        6 => (1u64..70).prop_map(When::Near),
        4 => (1u64..300_000).prop_map(When::Mid),
        2 => (0u64..20).prop_map(When::Far),
        1 => any::<u64>().prop_map(When::Absolute),
        1 => (0u64..4).prop_map(|k| When::Absolute(u64::MAX - k)),
        1 => Just(When::Max),
    ]
}

fn jump() -> impl Strategy<Value = Jump> {
    prop_oneof![
        2 => Just(Jump::Zero),
        2 => Just(Jump::One),
        5 => (2u64..100).prop_map(Jump::Small),
        3 => (100u64..400_000).prop_map(Jump::Large),
        1 => ((1u64 << 30)..(1u64 << 40)).prop_map(Jump::Huge),
        2 => (1u64..500).prop_map(Jump::Back),
        1 => Just(Jump::ToMax),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => when().prop_map(Op::Insert),
        4 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<u64>().prop_map(Op::CancelForged),
        4 => (any::<usize>(), when()).prop_map(|(i, w)| Op::Reset(i, w)),
        5 => jump().prop_map(Op::Poll),
        2 => (jump(), 0usize..4).prop_map(|(j, n)| Op::PollSome(j, n)),
        1 => Just(Op::Iter),
        1 => Just(Op::Drain),
        1 => Just(Op::Clear),
        1 => Just(Op::Shrink),
    ]
}

const LAYOUTS: [(usize, usize); 8] = [
    (8, 256),
    (6, 64),
    (3, 4),
    (2, 8),
    (1, 2),
    (16, 16),
    (10, 64),
    (2, 4096),
];

struct Harness {
    wheel: Wheel<u64>,
    /// Pending timers: key → (deadline, value).
    model: BTreeMap<TimerKey, (u64, u64)>,
    /// Every key ever handed out, live or stale.
    issued: Vec<TimerKey>,
    next_value: u64,
}

impl Harness {
    fn model_min(&self) -> Option<u64> {
        self.model.values().map(|&(d, _)| d).min()
    }

    fn pick(&self, i: usize) -> Option<TimerKey> {
        (!self.issued.is_empty()).then(|| self.issued[i % self.issued.len()])
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let now = self.wheel.now();
        match op {
            Op::Insert(w) => {
                let deadline = w.resolve(now);
                let value = self.next_value;
                self.next_value += 1;
                let key = self.wheel.insert(deadline, value);
                prop_assert!(self.model.insert(key, (deadline, value)).is_none());
                self.issued.push(key);
            }
            Op::Cancel(i) => {
                if let Some(key) = self.pick(*i) {
                    let expected = self.model.remove(&key).map(|(_, v)| v);
                    prop_assert_eq!(self.wheel.cancel(key), expected);
                }
            }
            Op::CancelForged(bits) => {
                let key = TimerKey::from_bits(*bits);
                let expected = self.model.remove(&key).map(|(_, v)| v);
                prop_assert_eq!(self.wheel.cancel(key), expected);
            }
            Op::Reset(i, w) => {
                if let Some(key) = self.pick(*i) {
                    let deadline = w.resolve(now);
                    let live = match self.model.get_mut(&key) {
                        Some(entry) => {
                            entry.0 = deadline;
                            true
                        }
                        None => false,
                    };
                    prop_assert_eq!(self.wheel.reset(key, deadline), live);
                    prop_assert_eq!(self.wheel.deadline(key), live.then_some(deadline));
                }
            }
            Op::Poll(j) => self.poll(j.resolve(now), usize::MAX)?,
            Op::PollSome(j, n) => self.poll(j.resolve(now), *n)?,
            Op::Iter => {
                let mut seen: Vec<_> = self.wheel.iter().map(|(k, d, v)| (k, d, *v)).collect();
                seen.sort();
                let expected: Vec<_> = self.model.iter().map(|(k, (d, v))| (*k, *d, *v)).collect();
                prop_assert_eq!(seen, expected);
            }
            Op::Drain => {
                let mut seen: Vec<_> = self
                    .wheel
                    .drain()
                    .map(|e| (e.key, e.deadline, e.value))
                    .collect();
                seen.sort();
                let expected: Vec<_> = self.model.iter().map(|(k, (d, v))| (*k, *d, *v)).collect();
                prop_assert_eq!(seen, expected);
                self.model.clear();
                prop_assert_eq!(self.wheel.now(), now);
            }
            Op::Clear => {
                self.wheel.clear();
                self.model.clear();
            }
            Op::Shrink => self.wheel.shrink_to_fit(),
        }
        self.check_invariants()
    }

    /// Polls at `target` up to `limit` times; every timer yielded must be the earliest pending one
    /// and due; a `None` means nothing pending is due.
    fn poll(&mut self, target: u64, limit: usize) -> Result<(), TestCaseError> {
        let effective = target.max(self.wheel.now());
        let mut taken = 0;
        while taken < limit {
            match self.wheel.poll(target) {
                Some(e) => {
                    let expected_min = self.model_min();
                    prop_assert_eq!(Some(e.deadline), expected_min, "not the earliest");
                    prop_assert!(e.deadline <= effective, "fired early");
                    prop_assert_eq!(self.model.remove(&e.key), Some((e.deadline, e.value)));
                    taken += 1;
                }
                None => {
                    if let Some(min) = self.model_min() {
                        prop_assert!(min > effective, "due timer {min} not fired by {effective}");
                    }
                    prop_assert_eq!(self.wheel.now(), effective);
                    break;
                }
            }
        }
        Ok(())
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.wheel.len(), self.model.len());
        prop_assert_eq!(self.wheel.is_empty(), self.model.is_empty());
        let next = self.wheel.next_deadline();
        match self.model_min() {
            None => prop_assert_eq!(next, None),
            Some(min) => {
                let next = next.expect("next_deadline is None with timers pending");
                prop_assert!(next <= min, "next_deadline {next} after earliest {min}");
                let now = self.wheel.now();
                let slots = self.wheel.layout().slots_per_level() as u64;
                if min > now && (min ^ now) < slots {
                    prop_assert_eq!(next, min, "inexact on the lowest level");
                }
            }
        }
        for (key, (deadline, _)) in &self.model {
            prop_assert_eq!(self.wheel.deadline(*key), Some(*deadline));
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000),
        max_shrink_iters: 10_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn wheel_matches_model(
        layout in 0..LAYOUTS.len(),
        // With the default layout: sized up front for 1.5M timers, a 36 MB key table that
        // takes the huge-page advice.
        presized in proptest::bool::weighted(0.5),
        start in prop_oneof![Just(0u64), any::<u64>(), Just(u64::MAX - 100)],
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let (levels, slots) = LAYOUTS[layout];
        let wheel = if (levels, slots) == (8, 256) && presized {
            Wheel::with_capacity(1_500_000)
        } else {
            Wheel::with_layout(Layout::new(levels, slots).unwrap())
        };
        let mut h = Harness {
            wheel,
            model: BTreeMap::new(),
            issued: Vec::new(),
            next_value: 0,
        };
        // Move the wheel's time to the start point first.
        prop_assert!(h.wheel.poll(start).is_none());
        for op in &ops {
            h.apply(op)?;
        }
        // Finally everything fires by u64::MAX, in order.
        h.poll(u64::MAX, usize::MAX)?;
        prop_assert!(h.model.is_empty());
        prop_assert!(h.wheel.is_empty());
    }
}
