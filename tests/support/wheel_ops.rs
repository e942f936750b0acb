//! Byte-driven operation interpreter for the wheel, checked against a `BTreeMap` model.
//!
//! Shared by the cargo-fuzz target (`fuzz/fuzz_targets/wheel_ops.rs`) and by the test
//! `tests/wheel_fuzz_replay.rs`, which runs it on random inputs so it cannot rot.

use std::cell::Cell;
use std::collections::BTreeMap;

use delaywheel::wheel::{Layout, TimerKey, Wheel};

thread_local! {
    /// Values alive (created and not yet dropped), to catch a double drop or a leak.
    static ALIVE: Cell<i64> = const { Cell::new(0) };
}

/// A value on the heap (so a double drop or a use after free crashes, or trips the sanitizer)
/// that counts itself alive.
#[derive(Debug)]
struct Val(Box<u32>);

impl Val {
    fn new(v: u32) -> Val {
        ALIVE.with(|a| a.set(a.get() + 1));
        Val(Box::new(v))
    }
}

impl Drop for Val {
    fn drop(&mut self) {
        ALIVE.with(|a| a.set(a.get() - 1));
    }
}

/// Reads little-endian values off the input; missing bytes read as zero.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u64(&mut self, len: usize) -> u64 {
        (0..len).fold(0, |acc, i| {
            acc | (u64::from(self.byte().unwrap_or(0)) << (8 * i))
        })
    }
    /// A deadline or jump size: small, medium, large or full-range.
    fn span(&mut self) -> u64 {
        match self.byte().unwrap_or(0) % 4 {
            0 => self.u64(1),
            1 => self.u64(3),
            2 => self.u64(5),
            _ => self.u64(8),
        }
    }
}

const LAYOUTS: [(usize, usize); 5] = [(8, 256), (6, 64), (3, 4), (1, 2), (16, 16)];

/// Runs the operations encoded in `data`, panicking on any disagreement with the model.
pub fn run(data: &[u8]) {
    let mut input = Input(data);
    let first = input.byte().unwrap_or(0);
    let (levels, slots) = LAYOUTS[usize::from(first) % LAYOUTS.len()];
    // Inputs whose first byte picks the default layout and has its top bit set get that layout
    // sized up front for 1.5M timers: a 36 MB key table that takes the huge-page advice, so
    // that path runs under the model too.
    let mut wheel = if (levels, slots) == (8, 256) && first & 0x80 != 0 {
        Wheel::with_capacity(1_500_000)
    } else {
        Wheel::with_layout(Layout::new(levels, slots).expect("valid layout"))
    };
    let mut model: BTreeMap<TimerKey, (u64, u32)> = BTreeMap::new();
    let mut issued: Vec<TimerKey> = Vec::new();
    let mut value = 0u32;
    let alive_before = ALIVE.with(Cell::get);
    while let Some(op) = input.byte() {
        let now = wheel.now();
        match op % 8 {
            0 | 1 => {
                let span = input.span();
                let deadline = if op & 0x80 != 0 {
                    now.saturating_sub(span)
                } else {
                    now.saturating_add(span)
                };
                value += 1;
                let key = wheel.insert(deadline, Val::new(value));
                assert!(model.insert(key, (deadline, value)).is_none());
                issued.push(key);
            }
            2 => {
                if let Some(&key) = issued.get(input.u64(2) as usize % issued.len().max(1)) {
                    let got = wheel.cancel(key).map(|v| *v.0);
                    assert_eq!(got, model.remove(&key).map(|v| v.1));
                }
            }
            3 => {
                let pick = input.u64(2) as usize;
                // The top bit resets into the past: into (or within) the ready list.
                let deadline = if op & 0x80 != 0 {
                    now.saturating_sub(input.span())
                } else {
                    now.saturating_add(input.span())
                };
                if let Some(&key) = issued.get(pick % issued.len().max(1)) {
                    let live = model.get_mut(&key).map(|v| v.0 = deadline).is_some();
                    assert_eq!(wheel.reset(key, deadline), live);
                }
            }
            4 | 5 => {
                let target = if op & 0x80 != 0 {
                    now.saturating_sub(input.span())
                } else {
                    now.saturating_add(input.span())
                };
                let effective = target.max(now);
                let limit = if op % 8 == 4 {
                    usize::MAX
                } else {
                    usize::from(input.byte().unwrap_or(0) % 4)
                };
                let mut taken = 0;
                while taken < limit {
                    let Some(e) = wheel.poll(target) else {
                        assert!(
                            model.values().all(|v| v.0 > effective),
                            "due timer not fired"
                        );
                        assert_eq!(wheel.now(), effective);
                        break;
                    };
                    let min = model.values().map(|v| v.0).min();
                    assert_eq!(Some(e.deadline), min, "not the earliest");
                    assert!(e.deadline <= effective, "fired early");
                    assert_eq!(model.remove(&e.key), Some((e.deadline, *e.value.0)));
                    taken += 1;
                }
            }
            6 => match input.byte().unwrap_or(0) % 4 {
                0 => {
                    for e in wheel.drain() {
                        assert_eq!(model.remove(&e.key), Some((e.deadline, *e.value.0)));
                    }
                    assert!(model.is_empty());
                }
                sub => {
                    let take = usize::from(input.byte().unwrap_or(0) % 8);
                    let mut drain = wheel.drain();
                    for e in drain.by_ref().take(take) {
                        assert_eq!(model.remove(&e.key), Some((e.deadline, *e.value.0)));
                    }
                    match sub {
                        // Dropped early: removes the rest.
                        1 => {
                            drop(drain);
                            model.clear();
                        }
                        // Leaked: the rest stay pending, and must fire as before.
                        2 => std::mem::forget(drain),
                        _ => {
                            drop(drain);
                            wheel.clear();
                            model.clear();
                        }
                    }
                }
            },
            _ => {
                if input.byte().unwrap_or(0) % 2 == 0 {
                    wheel.shrink_to_fit();
                } else {
                    let seen: BTreeMap<TimerKey, (u64, u32)> =
                        wheel.iter().map(|(k, d, v)| (k, (d, *v.0))).collect();
                    assert_eq!(seen, model, "iter disagrees");
                }
            }
        }
        assert_eq!(
            ALIVE.with(Cell::get) - alive_before,
            model.len() as i64,
            "values alive != timers pending"
        );
        assert_eq!(wheel.len(), model.len());
        match (wheel.next_deadline(), model.values().map(|v| v.0).min()) {
            (None, None) => {}
            (Some(next), Some(min)) => assert!(next <= min, "next_deadline after the earliest"),
            (next, min) => panic!("next_deadline {next:?} with earliest {min:?}"),
        }
    }
    if first & 0x40 != 0 {
        // Dropped with timers pending: the wheel's own drop frees them.
        drop(wheel);
    } else {
        let rest = std::iter::from_fn(|| wheel.poll(u64::MAX)).count();
        assert_eq!(rest, model.len());
        assert!(wheel.is_empty());
        drop(wheel);
    }
    assert_eq!(
        ALIVE.with(Cell::get),
        alive_before,
        "values leaked or dropped twice"
    );
}
