//! Deterministic engine tests: a manual clock and no driver thread, so every test says exactly
//! which timers fire at which time, and none of them sleeps.

use std::time::Duration;

use crossbeam_channel::Receiver;
use delaywheel::{Expiration, ManualClock, ScheduleError, Timer};

const MS: Duration = Duration::from_millis(1);

fn engine(shards: usize) -> (ManualClock, Timer<u32>, Receiver<Expiration<u32>>) {
    let clock = ManualClock::new();
    let (timer, rx) = Timer::builder()
        .manual_clock(&clock)
        .manual_driver()
        .shards(shards)
        .build_channel(None)
        .unwrap();
    (clock, timer, rx)
}

fn fired(rx: &Receiver<Expiration<u32>>) -> Vec<u32> {
    rx.try_iter().map(|e| e.value).collect()
}

#[test]
fn fires_exactly_at_the_deadline_never_before() {
    let (clock, timer, rx) = engine(2);
    timer.schedule(1, 10 * MS).unwrap();
    timer.schedule(2, 20 * MS).unwrap();
    timer.schedule(3, 20 * MS).unwrap(); // a tie
    clock.advance(9 * MS);
    assert_eq!(timer.fire_due(), 0);
    assert_eq!(fired(&rx), Vec::<u32>::new());
    clock.advance(MS);
    assert_eq!(timer.fire_due(), 1);
    assert_eq!(fired(&rx), vec![1]);
    clock.advance(Duration::from_micros(9_999));
    timer.fire_due();
    assert_eq!(fired(&rx), Vec::<u32>::new(), "fired early");
    clock.advance(Duration::from_micros(1));
    timer.fire_due();
    let mut both = fired(&rx);
    both.sort();
    assert_eq!(both, vec![2, 3]);
    assert!(timer.is_empty());
}

#[test]
fn sub_tick_delays_round_up() {
    let (clock, timer, rx) = engine(1);
    clock.advance(Duration::from_micros(300));
    timer.schedule(7, Duration::from_micros(500)).unwrap(); // due at 0.8 ms: tick 1
    clock.advance(Duration::from_micros(499));
    timer.fire_due();
    assert!(fired(&rx).is_empty());
    clock.advance(Duration::from_micros(201)); // 1.0 ms
    timer.fire_due();
    let e: Vec<_> = fired(&rx);
    assert_eq!(e, vec![7]);
}

#[test]
fn past_deadlines_fire_at_once_and_far_ones_wait() {
    let (clock, timer, rx) = engine(2);
    let start = timer.now();
    clock.advance(50 * MS);
    timer.schedule_at(1, start).unwrap(); // in the past
    timer.schedule(2, Duration::ZERO).unwrap();
    timer.schedule(3, Duration::MAX).unwrap(); // beyond any range: waits, no panic
    timer
        .schedule(4, Duration::from_secs(3 * 365 * 24 * 3600))
        .unwrap();
    timer.fire_due();
    let mut now = fired(&rx);
    now.sort();
    assert_eq!(now, vec![1, 2]);
    clock.advance(Duration::from_secs(365 * 24 * 3600));
    timer.fire_due();
    assert!(fired(&rx).is_empty());
    assert_eq!(timer.len(), 2);
}

#[test]
fn reset_earlier_and_later_and_cancel() {
    let (clock, timer, rx) = engine(2);
    let a = timer.schedule(1, 100 * MS).unwrap();
    let b = timer.schedule(2, 10 * MS).unwrap();
    let c = timer.schedule(3, 30 * MS).unwrap();
    assert!(timer.reset(a, 5 * MS)); // earlier
    assert!(timer.reset(b, 50 * MS)); // later
    assert_eq!(timer.cancel(c), Some(3));
    assert_eq!(timer.cancel(c), None);
    clock.advance(5 * MS);
    timer.fire_due();
    assert_eq!(fired(&rx), vec![1]);
    assert!(!timer.reset(a, MS), "reset of a fired timer");
    assert_eq!(timer.cancel(a), None);
    clock.advance(44 * MS);
    timer.fire_due();
    assert!(fired(&rx).is_empty());
    clock.advance(MS);
    timer.fire_due();
    assert_eq!(fired(&rx), vec![2]);
    let stats = timer.stats();
    assert_eq!(
        (stats.scheduled, stats.cancelled, stats.reset, stats.fired),
        (3, 1, 2, 2)
    );
    assert_eq!(stats.lateness.count, 2);
    // Both fired on the very tick of their deadline: on time is 0, not the histogram's 1 µs.
    assert_eq!(stats.lateness.max, Duration::ZERO);
}

#[test]
fn cancel_racing_expiry_ends_each_timer_exactly_once() {
    // Every timer is due; another thread cancels every other one while this one's turn
    // collects and delivers them: whichever wins, each timer ends exactly once, cancelled
    // (its value handed back) or delivered, never both, never neither.
    for round in 0..20u32 {
        let (clock, timer, rx) = engine(3);
        let ids: Vec<_> = (0..2_000).map(|i| timer.schedule(i, MS).unwrap()).collect();
        clock.advance(MS);
        let start = std::sync::Barrier::new(2);
        let cancelled: Vec<u32> = std::thread::scope(|s| {
            let canceller = s.spawn(|| {
                start.wait();
                ids.iter()
                    .step_by(2)
                    .filter_map(|&id| timer.cancel(id))
                    .collect::<Vec<u32>>()
            });
            start.wait();
            timer.fire_due();
            canceller.join().unwrap()
        });
        timer.fire_due();
        let delivered = fired(&rx);
        let mut all: Vec<u32> = cancelled.iter().copied().chain(delivered).collect();
        all.sort();
        assert_eq!(all, (0..2_000).collect::<Vec<_>>(), "round {round}");
        // Cancels after firing find nothing.
        assert!(ids.iter().all(|&id| timer.cancel(id).is_none()));
    }
}

#[test]
fn a_clock_that_stalls_changes_nothing() {
    let (clock, timer, rx) = engine(1);
    timer.schedule(1, 10 * MS).unwrap();
    for _ in 0..5 {
        assert_eq!(timer.fire_due(), 0); // the clock does not move
    }
    clock.advance(10 * MS);
    timer.fire_due();
    assert_eq!(fired(&rx), vec![1]);
}

#[test]
fn shutdown_hands_back_everything_and_refuses_new_timers() {
    let (clock, timer, rx) = engine(4);
    for i in 0..100 {
        timer.schedule(i, (i + 1) * 10 * MS).unwrap();
    }
    clock.advance(105 * MS);
    timer.fire_due();
    assert_eq!(fired(&rx).len(), 10);
    let handle = timer.clone();
    let mut back: Vec<u32> = timer.shutdown().into_iter().map(|p| p.value).collect();
    back.sort();
    assert_eq!(back, (10..100).collect::<Vec<_>>());
    assert_eq!(handle.schedule(5, MS), Err(ScheduleError::Shutdown(5)));
    assert!(handle.shutdown().is_empty());
    assert_eq!(handle.schedule(6, MS).unwrap_err().into_inner(), 6);
}

#[test]
fn builder_rejects_bad_settings_with_typed_errors() {
    use delaywheel::BuildError;
    let e = Timer::<u8>::builder()
        .shards(0)
        .build_channel(None)
        .unwrap_err();
    assert_eq!(e, BuildError::Shards(0));
    let e = Timer::<u8>::builder()
        .tick(Duration::ZERO)
        .build_channel(None)
        .unwrap_err();
    assert_eq!(e, BuildError::ZeroTick);
    let e = Timer::<u8>::builder()
        .shards(1_025)
        .build_channel(None)
        .unwrap_err();
    assert_eq!(e, BuildError::Shards(1_025));
    for bad in [0, (1 << 24) + 1, usize::MAX] {
        let e = Timer::<u8>::builder().build_channel(Some(bad)).unwrap_err();
        assert_eq!(e, BuildError::Capacity(bad));
        let e = Timer::<u8>::builder()
            .build_callback(1, bad, |_| {})
            .unwrap_err();
        assert_eq!(e, BuildError::Capacity(bad));
    }
    for bad in [0, 1_025, usize::MAX] {
        let e = Timer::<u8>::builder()
            .build_callback(bad, 8, |_| {})
            .unwrap_err();
        assert_eq!(e, BuildError::Workers(bad));
    }
}

#[test]
fn stats_show_pending_per_shard_and_level() {
    let (_clock, timer, _rx) = engine(2);
    timer.schedule(1, 10 * MS).unwrap(); // level 0
    timer.schedule(2, 1000 * MS).unwrap(); // level 1
    timer.schedule(3, Duration::from_secs(3600)).unwrap(); // level 2
    let s = timer.stats();
    assert_eq!(s.pending(), 3);
    assert_eq!(s.pending_per_shard.len(), 2);
    assert_eq!(&s.pending_per_level[..3], &[1, 1, 1]);
}

#[test]
fn an_id_from_another_engine_touches_nothing() {
    let (_c1, a, _rx1) = engine(1);
    let (_c2, b, _rx2) = engine(1);
    let id_a = a.schedule(1, 10 * MS).unwrap();
    let id_b = b.schedule(2, 10 * MS).unwrap();
    // Same shard, and the same first key in each wheel: only the engine tag tells them apart.
    assert_eq!(b.cancel(id_a), None);
    assert!(!b.reset(id_a, MS));
    assert_eq!(b.len(), 1);
    assert_eq!(a.cancel(id_a), Some(1));
    assert_eq!(b.cancel(id_b), Some(2));
}
