//! One test per rule of the wheel's contract (issue #2).

use delaywheel::wheel::{Layout, TimerKey, Wheel};

/// Polls at `now` until `None`, returning `(deadline, value)` in the order yielded.
fn poll_all<T>(wheel: &mut Wheel<T>, now: u64) -> Vec<(u64, T)> {
    std::iter::from_fn(|| wheel.poll(now))
        .map(|e| (e.deadline, e.value))
        .collect()
}

#[test]
fn past_and_present_deadlines_fire_at_the_next_poll() {
    let mut w = Wheel::new();
    assert!(w.poll(1_000).is_none());
    w.insert(1_000, "now");
    w.insert(3, "past");
    w.insert(0, "zero");
    assert_eq!(w.next_deadline(), Some(0));
    // An earlier `now` is not an error and still yields what is due.
    assert_eq!(
        poll_all(&mut w, 5),
        vec![(0, "zero"), (3, "past"), (1_000, "now")]
    );
    assert_eq!(w.now(), 1_000);
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
}

#[test]
fn never_fires_early_tick_by_tick() {
    let mut w = Wheel::new();
    let deadlines = [
        1u64, 63, 64, 65, 4095, 4096, 4097, 100_000, 262_143, 262_144,
    ];
    for &d in &deadlines {
        w.insert(d, d);
    }
    let mut fired = Vec::new();
    for t in 0..=262_144u64 {
        while let Some(e) = w.poll(t) {
            assert_eq!(e.deadline, t, "fired at {t}, due at {}", e.deadline);
            assert_eq!(e.value, e.deadline);
            fired.push(e.value);
        }
    }
    assert_eq!(fired, deadlines);
}

#[test]
fn overflow_tier_fires_exactly_on_time_up_to_u64_max() {
    // 6 levels of 64 slots: 2^36 ticks, then the overflow tier.
    let layout = Layout::new(6, 64).unwrap();
    let range = layout.range().unwrap();
    let mut w = Wheel::with_layout(layout);
    let deadlines = [
        range - 1,
        range,
        range + 1,
        3 * range + 17,
        1 << 50,
        u64::MAX - 1,
        u64::MAX,
    ];
    for &d in deadlines.iter().rev() {
        w.insert(d, d);
    }
    for &d in &deadlines {
        // One tick before: nothing; at the deadline: exactly this timer.
        assert!(w.poll(d - 1).is_none(), "{d} fired early");
        let next = w.next_deadline().unwrap();
        assert!(next <= d && next >= d - 1, "next_deadline {next} for {d}");
        let e = w.poll(d).expect("due");
        assert_eq!((e.deadline, e.value), (d, d));
        assert!(w.poll(d).is_none());
    }
    assert!(w.is_empty());
}

#[test]
fn a_huge_jump_catches_up_in_one_loop() {
    // If polling cost were proportional to ticks, this would never finish.
    let mut w = Wheel::new();
    for (i, d) in [5u64, 1 << 20, 1 << 40, 1 << 62, u64::MAX]
        .into_iter()
        .enumerate()
    {
        w.insert(d, i);
    }
    let fired = poll_all(&mut w, u64::MAX);
    assert_eq!(
        fired.iter().map(|f| f.0).collect::<Vec<_>>(),
        vec![5, 1 << 20, 1 << 40, 1 << 62, u64::MAX]
    );
    assert_eq!(w.now(), u64::MAX);
    // After time has reached the end, inserts still work and fire at once.
    w.insert(7, 99);
    assert_eq!(poll_all(&mut w, 0), vec![(7, 99)]);
}

#[test]
fn stale_keys_return_none_and_touch_nothing() {
    let mut w = Wheel::new();
    let fired = w.insert(1, 'a');
    let cancelled = w.insert(10, 'b');
    let live = w.insert(20, 'c');
    assert_eq!(w.cancel(cancelled), Some('b'));
    assert_eq!(w.poll(1).map(|e| e.key), Some(fired));
    // Fired, cancelled: stale.
    for key in [fired, cancelled] {
        assert_eq!(w.cancel(key), None);
        assert!(!w.reset(key, 5));
        assert!(!w.contains(key));
        assert_eq!(w.deadline(key), None);
    }
    // Slot reused by a new timer: the old key still does not reach it.
    let reused = w.insert(30, 'd');
    assert_eq!(w.cancel(fired), None);
    assert_eq!(w.cancel(cancelled), None);
    assert_eq!(w.len(), 2);
    assert_eq!(w.deadline(reused), Some(30));
    // A forged key.
    assert_eq!(w.cancel(TimerKey::from_bits(u64::MAX)), None);
    assert_eq!(TimerKey::from_bits(live.to_bits()), live);
    assert_eq!(poll_all(&mut w, 100), vec![(20, 'c'), (30, 'd')]);
}

#[test]
fn reset_moves_earlier_and_later_and_keeps_the_key() {
    let mut w = Wheel::new();
    let a = w.insert(5_000, "a");
    let b = w.insert(10, "b");
    assert!(w.reset(a, 7)); // earlier, to another level
    assert!(w.reset(b, 1 << 40)); // later, into the overflow tier
    assert_eq!(w.deadline(a), Some(7));
    assert_eq!(poll_all(&mut w, 5_000), vec![(7, "a")]);
    assert!(w.contains(b));
    assert!(w.reset(b, 4_000)); // into the past: fires at the next poll
    assert_eq!(w.poll(0).map(|e| (e.key, e.deadline)), Some((b, 4_000)));
}

#[test]
fn cancelled_storage_is_reused_and_shrink_returns_memory() {
    let mut w = Wheel::new();
    let keys: Vec<_> = (0..100_000u64)
        .map(|i| w.insert(1 + i % 50_000, i))
        .collect();
    let peak = w.allocated_bytes();
    for k in keys {
        assert!(w.cancel(k).is_some());
    }
    // The same number again reuses the freed records and slots: no growth.
    let keys: Vec<_> = (0..100_000u64)
        .map(|i| w.insert(1 + i % 50_000, i))
        .collect();
    assert_eq!(w.allocated_bytes(), peak);
    // The free list is LIFO, so the last 100 keys took the lowest records; cancel the rest.
    for k in &keys[..99_900] {
        w.cancel(*k);
    }
    w.shrink_to_fit();
    let after = w.allocated_bytes();
    assert!(
        after * 10 < peak,
        "shrink_to_fit kept {after} of {peak} bytes"
    );
    // Keys from before the shrink stay stale; live ones still work.
    assert_eq!(w.cancel(keys[50_000]), None);
    assert!(w.contains(keys[99_950]));
    assert_eq!(w.len(), 100);
    let fired = poll_all(&mut w, u64::MAX);
    assert_eq!(fired.len(), 100);
}

#[test]
fn stale_keys_survive_shrink_and_clear() {
    let mut w = Wheel::new();
    let old: Vec<_> = (0..100u64).map(|i| w.insert(i + 1, i)).collect();
    w.clear();
    assert!(w.is_empty());
    w.shrink_to_fit();
    let new: Vec<_> = (0..100u64).map(|i| w.insert(i + 1, i + 1000)).collect();
    for k in &old {
        assert_eq!(w.cancel(*k), None);
        assert!(!w.reset(*k, 1));
    }
    assert_eq!(w.len(), 100);
    assert_eq!(w.cancel(new[0]), Some(1000));
}

#[test]
fn next_deadline_is_none_exactly_when_empty_and_exact_on_level_zero() {
    let mut w = Wheel::new();
    assert_eq!(w.next_deadline(), None);
    let k = w.insert(40, ());
    assert_eq!(w.next_deadline(), Some(40));
    w.insert(5_000, ());
    assert_eq!(w.next_deadline(), Some(40));
    w.cancel(k);
    // On level 1 it is the start of the (256-tick) slot: never later than the deadline.
    let next = w.next_deadline().unwrap();
    assert_eq!(next, 5_000 & !255);
    assert!(w.poll(next).is_none());
    assert_eq!(w.next_deadline(), Some(5_000));
    assert_eq!(poll_all(&mut w, 5_000).len(), 1);
    assert_eq!(w.next_deadline(), None);
}

/// The overflow tier's minimum is forgotten when the tier empties: a later overflow timer's
/// `next_deadline` is its own, not a tick long gone. (It kept the cancelled timer's deadline,
/// so a driver would wake at once, or years early, for nothing.)
#[test]
fn next_deadline_forgets_an_overflow_timer_that_left() {
    // 2 slots on 1 level: everything from 2 ticks ahead is in the overflow tier.
    let mut w = Wheel::with_layout(Layout::new(1, 2).unwrap());
    let gone = w.insert(10, ());
    assert_eq!(w.cancel(gone), Some(()));
    assert!(w.poll(100).is_none());
    w.insert(1_000, ());
    let next = w.next_deadline().unwrap();
    assert!(
        (w.now()..=1_000).contains(&next),
        "next_deadline {next} at now {}",
        w.now()
    );
}

#[test]
fn ties_and_order() {
    let mut w = Wheel::new();
    for i in 0..200u64 {
        w.insert(1_000 - (i % 10) * 64, i);
    }
    let fired = poll_all(&mut w, 2_000);
    assert_eq!(fired.len(), 200);
    assert!(fired.windows(2).all(|p| p[0].0 <= p[1].0));
}

#[test]
fn iter_drain_and_clear() {
    let mut w = Wheel::with_layout(Layout::new(2, 4).unwrap());
    let keys: Vec<_> = [0u64, 3, 9, 100, u64::MAX]
        .iter()
        .map(|&d| w.insert(d, d.wrapping_mul(2)))
        .collect();
    let mut seen: Vec<_> = w.iter().map(|(k, d, v)| (k, d, *v)).collect();
    seen.sort();
    let mut expected: Vec<_> = keys
        .iter()
        .zip([0u64, 3, 9, 100, u64::MAX])
        .map(|(k, d)| (*k, d, d.wrapping_mul(2)))
        .collect();
    expected.sort();
    assert_eq!(seen, expected);
    assert_eq!(w.iter().len(), 5);

    let mut drained: Vec<_> = w.drain().map(|e| (e.key, e.deadline, e.value)).collect();
    drained.sort();
    assert_eq!(drained, expected);
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
    assert!(w.poll(u64::MAX).is_none());

    // A drain dropped half-way still empties the wheel.
    for d in 1..50u64 {
        w.insert(d, d);
    }
    let first = w.drain().next();
    assert!(first.is_some());
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);

    w.insert(1, 1);
    w.clear();
    assert!(w.is_empty());
    assert!(w.poll(u64::MAX).is_none());
}

#[test]
fn a_clock_that_goes_backwards_changes_nothing() {
    let mut w = Wheel::new();
    w.insert(100, "x");
    assert!(w.poll(50).is_none());
    assert!(w.poll(10).is_none()); // backwards
    assert_eq!(w.now(), 50);
    assert!(w.poll(99).is_none());
    assert_eq!(poll_all(&mut w, 20), Vec::<(u64, &str)>::new());
    assert_eq!(poll_all(&mut w, 100), vec![(100, "x")]);
}

#[test]
fn at_most_40_allocated_bytes_per_pending_u64_timer_at_1m() {
    // Deterministic companion of the resident-memory report in `examples/wheel_load.rs`:
    // capacity-based accounting of every heap byte the wheel holds, spare capacity included.
    let n = 1_000_000u64;
    let mut w: Wheel<u64> = Wheel::with_capacity(n as usize);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.insert(1 + x % 60_000, i);
    }
    let per_timer = w.allocated_bytes() as f64 / n as f64;
    assert!(per_timer <= 40.0, "{per_timer:.1} bytes per timer");
}

/// A wheel sized up front for 1.5M timers holds a 36 MB key table, which asks the kernel for
/// huge pages (`src/wheel/huge_pages.rs`): it must behave exactly as any other wheel. Checked
/// against a sorted model: same timers, same order, cancelled ones never fire.
#[test]
fn a_large_presized_wheel_fires_every_timer_in_order() {
    const N: u64 = 300_000;
    let mut wheel = Wheel::with_capacity(1_500_000);
    let mut rng = fastrand::Rng::with_seed(11);
    let mut model = std::collections::BTreeMap::new();
    let mut keys = Vec::new();
    for i in 0..N {
        let deadline = rng.u64(1..=120_000);
        keys.push((wheel.insert(deadline, i), deadline, i));
        model.insert((deadline, i), ());
    }
    for &(key, deadline, i) in keys.iter().step_by(3) {
        assert_eq!(wheel.cancel(key), Some(i));
        model.remove(&(deadline, i));
    }
    let mut fired = Vec::new();
    for now in (0..=120_000).step_by(997) {
        while let Some(e) = wheel.poll(now) {
            assert!(e.deadline <= now, "fired early");
            fired.push((e.deadline, e.value));
        }
    }
    while let Some(e) = wheel.poll(120_000) {
        fired.push((e.deadline, e.value));
    }
    assert!(
        fired.windows(2).all(|w| w[0].0 <= w[1].0),
        "not in deadline order"
    );
    // Ties may come in any order.
    fired.sort_unstable();
    assert_eq!(fired, model.into_keys().collect::<Vec<_>>());
    assert!(wheel.is_empty());
}

/// `with_capacity` is a hint: an impossible one neither panics nor aborts, and the wheel works.
/// `u32::MAX` records of a 2 GiB value overflow `isize::MAX` bytes, which every system refuses
/// (the value is never built: it would not fit on a stack).
#[test]
fn an_impossible_capacity_is_only_a_hint() {
    let wheel = Wheel::<[u8; 1 << 31]>::with_capacity(usize::MAX);
    assert!(wheel.is_empty());
    assert!(wheel.allocated_bytes() < 1 << 20);
    // 103 GB of records: granted or refused by the system, either way the wheel works.
    let mut wheel = Wheel::<u64>::with_capacity(u32::MAX as usize);
    let key = wheel.insert(5, 9);
    assert_eq!(wheel.poll(5).map(|e| (e.key, e.value)), Some((key, 9)));
}
