//! The engine with its driver thread: concurrency, backpressure, shutdown. Outcomes are checked
//! with ids and counters, never with timing.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use delaywheel::{Expiration, ManualClock, ScheduleError, Timer};

const MS: Duration = Duration::from_millis(1);
const PATIENCE: Duration = Duration::from_secs(20);

/// Waits until the driver has filled `rx` (it then blocks on the next delivery), instead of
/// sleeping for a time a slow machine may not honour.
fn until_full<T>(rx: &crossbeam_channel::Receiver<T>) {
    let start = std::time::Instant::now();
    while !rx.is_full() {
        assert!(
            start.elapsed() < PATIENCE,
            "the driver never filled the channel"
        );
        std::thread::sleep(MS);
    }
}

#[test]
fn manual_clock_advance_wakes_the_driver() {
    let clock = ManualClock::new();
    let (timer, rx) = Timer::builder()
        .manual_clock(&clock)
        .build_channel(None)
        .unwrap();
    timer.schedule(1u8, 10 * MS).unwrap();
    clock.advance(10 * MS);
    assert_eq!(rx.recv_timeout(PATIENCE).unwrap().value, 1);
}

#[test]
fn a_new_earliest_timer_wakes_a_sleeping_driver() {
    let (timer, rx) = Timer::builder().build_channel(None).unwrap();
    timer.schedule("late", Duration::from_secs(3600)).unwrap();
    std::thread::sleep(20 * MS); // the driver is now asleep for an hour
    timer.schedule("soon", 5 * MS).unwrap();
    let e = rx.recv_timeout(PATIENCE).unwrap();
    assert_eq!(e.value, "soon");
    assert!(e.deadline <= std::time::Instant::now());
}

#[test]
fn concurrent_producers_every_timer_ends_exactly_once() {
    let (timer, rx) = Timer::builder().shards(4).build_channel(None).unwrap();
    let threads = 4;
    let per_thread = 5_000u64;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads as u64)
        .map(|t| {
            let timer = timer.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut cancelled = Vec::new();
                let mut ids = Vec::new();
                barrier.wait();
                for i in 0..per_thread {
                    let value = t * per_thread + i;
                    let id = timer
                        .schedule(value, Duration::from_micros(rng.u64(0..20_000)))
                        .unwrap();
                    ids.push((id, value));
                    match rng.u8(0..4) {
                        0 => {
                            let (id, v) = ids[rng.usize(0..ids.len())];
                            if let Some(got) = timer.cancel(id) {
                                assert_eq!(got, v);
                                cancelled.push(got);
                            }
                        }
                        1 => {
                            let (id, _) = ids[rng.usize(0..ids.len())];
                            timer.reset(id, Duration::from_micros(rng.u64(0..20_000)));
                        }
                        _ => {}
                    }
                }
                cancelled
            })
        })
        .collect();
    let cancelled: Vec<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let total = threads as u64 * per_thread;
    let mut fired = Vec::new();
    while (fired.len() + cancelled.len()) < total as usize {
        fired.push(rx.recv_timeout(PATIENCE).expect("a timer was lost").value);
    }
    let fired_set: HashSet<u64> = fired.iter().copied().collect();
    assert_eq!(fired_set.len(), fired.len(), "a timer fired twice");
    let cancelled_set: HashSet<u64> = cancelled.iter().copied().collect();
    assert_eq!(
        cancelled_set.len(),
        cancelled.len(),
        "a timer was cancelled twice"
    );
    assert!(fired_set.is_disjoint(&cancelled_set), "fired and cancelled");
    assert_eq!(fired_set.len() + cancelled_set.len(), total as usize);
    assert!(timer.is_empty());
    assert!(rx.try_recv().is_err(), "more deliveries than timers");
}

#[test]
fn a_full_bounded_channel_applies_backpressure_and_drops_nothing() {
    let (timer, rx) = Timer::builder().shards(2).build_channel(Some(4)).unwrap();
    for i in 0..200u32 {
        timer.schedule(i, Duration::ZERO).unwrap();
    }
    // Nobody receives for a while: the driver must wait, not drop.
    until_full(&rx);
    std::thread::sleep(20 * MS);
    let mut got: Vec<u32> = (0..200)
        .map(|_| rx.recv_timeout(PATIENCE).expect("dropped").value)
        .collect();
    got.sort();
    assert_eq!(got, (0..200).collect::<Vec<_>>());
    assert!(rx.recv_timeout(20 * MS).is_err());
}

/// Regression: a timer scheduled while the driver is blocked on a full channel must still
/// fire. The producer's unpark reaches the driver while it is parked *inside* crossbeam's
/// blocking send, which swallows the token; the driver then finished its turn with "nothing
/// pending" and parked for good. The `woken` flag is what carries the wake-up now.
#[test]
fn a_timer_scheduled_while_delivery_is_blocked_still_fires() {
    for round in 0..5 {
        let (timer, rx) = Timer::builder().shards(1).build_channel(Some(1)).unwrap();
        for i in 0..3u32 {
            timer.schedule(i, Duration::ZERO).unwrap();
        }
        until_full(&rx);
        std::thread::sleep(20 * MS); // the driver holds 2 and blocks on the full channel
        timer.schedule(99, 30 * MS).unwrap();
        std::thread::sleep(20 * MS);
        let mut got: Vec<u32> = (0..4)
            .map(|_| {
                rx.recv_timeout(PATIENCE)
                    .unwrap_or_else(|_| panic!("round {round}: the late timer never fired"))
                    .value
            })
            .collect();
        got.sort();
        assert_eq!(got, [0, 1, 2, 99]);
    }
}

#[test]
fn shutdown_while_producers_run_loses_nothing() {
    let (timer, rx) = Timer::builder().shards(2).build_channel(Some(64)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..2u64)
        .map(|t| {
            let timer = timer.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut accepted, mut refused) = (Vec::new(), Vec::new());
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) || refused.is_empty() {
                    let v = t * 1_000_000 + i;
                    i += 1;
                    match timer.schedule(v, Duration::from_micros(i % 3_000)) {
                        Ok(_) => accepted.push(v),
                        Err(ScheduleError::Shutdown(back)) => {
                            refused.push(back);
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                (accepted, refused)
            })
        })
        .collect();
    std::thread::sleep(30 * MS);
    let pending = timer.shutdown();
    stop.store(true, Ordering::SeqCst);
    let mut accepted = Vec::new();
    for p in producers {
        let (a, r) = p.join().unwrap();
        assert_eq!(r.len(), 1);
        accepted.extend(a);
    }
    let delivered: Vec<u64> = rx.try_iter().map(|e| e.value).collect();
    let returned: Vec<u64> = pending.into_iter().map(|p| p.value).collect();
    let mut all: Vec<u64> = delivered.iter().chain(&returned).copied().collect();
    all.sort();
    let mut expected = accepted.clone();
    expected.sort();
    assert_eq!(
        all, expected,
        "every accepted timer is delivered or handed back once"
    );
}

#[test]
fn callback_pool_a_slow_callback_does_not_delay_others() {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (started_tx, started) = crossbeam_channel::bounded(1);
    let (release, released) = crossbeam_channel::bounded::<()>(1);
    let timer = Timer::builder()
        .shards(1)
        .build_callback(2, 64, move |e| {
            if e.value == 0 {
                // Slow until the test has seen the other one arrive.
                started_tx.send(()).unwrap();
                let _ = released.recv_timeout(2 * PATIENCE);
            }
            tx.send(e.value).unwrap();
        })
        .unwrap();
    timer.schedule(0u32, Duration::ZERO).unwrap();
    started
        .recv_timeout(PATIENCE)
        .expect("the slow callback runs");
    timer.schedule(1u32, Duration::ZERO).unwrap();
    // The fast one arrives while the slow one still waits on the other worker.
    assert_eq!(
        rx.recv_timeout(PATIENCE),
        Ok(1),
        "held up by the slow callback"
    );
    release.send(()).unwrap();
    assert_eq!(rx.recv_timeout(PATIENCE).unwrap(), 0);
}

#[test]
fn a_panicking_callback_is_contained() {
    let (tx, rx) = crossbeam_channel::unbounded();
    let timer = Timer::builder()
        .build_callback(1, 8, move |e| {
            if e.value == 0 {
                panic!("handler bug");
            }
            tx.send(e.value).unwrap();
        })
        .unwrap();
    timer.schedule(0u32, Duration::ZERO).unwrap();
    timer.schedule(1u32, MS).unwrap();
    assert_eq!(rx.recv_timeout(PATIENCE).unwrap(), 1);
}

/// An engine on a manual clock with `n` timers due at one tick and a channel of one: its driver
/// has handed one over and blocks on the next. (Not due at once: a driver woken by the first
/// schedule could take some before the rest were scheduled.)
fn blocked_on_a_full_channel(n: u32) -> (Timer<u32>, crossbeam_channel::Receiver<Expiration<u32>>) {
    let clock = ManualClock::new();
    let (timer, rx) = Timer::builder()
        .manual_clock(&clock)
        .build_channel(Some(1))
        .unwrap();
    for i in 0..n {
        timer.schedule(i, MS).unwrap();
    }
    clock.advance(MS);
    until_full(&rx);
    (timer, rx)
}

#[test]
fn stats_answer_while_the_driver_waits_on_a_full_channel() {
    let (timer, rx) = blocked_on_a_full_channel(10);
    let (tx, done) = crossbeam_channel::bounded(1);
    let t = timer.clone();
    std::thread::spawn(move || tx.send(t.stats()).unwrap());
    let stats = done
        .recv_timeout(PATIENCE)
        .expect("stats() blocked behind the delivery");
    assert_eq!(stats.fired, 10);
    assert_eq!(rx.iter().take(10).count(), 10);
}

/// Timers that fired but could not be handed over (a full channel at shutdown) are counted
/// as undelivered, and their lateness is not recorded: it describes deliveries.
#[test]
fn stats_count_fired_timers_that_were_never_delivered_apart() {
    let (timer, rx) = blocked_on_a_full_channel(3);
    let back = timer.shutdown();
    assert_eq!(back.len(), 2, "handed back");
    let stats = timer.stats();
    assert_eq!((stats.fired, stats.undelivered), (3, 2));
    assert_eq!(
        stats.lateness.count, 1,
        "lateness recorded for undelivered timers"
    );
    assert_eq!(rx.iter().count(), 1);
}

/// A callback that shuts the engine down while another thread does: neither waits on the
/// other (the stopper closes the delivery, which joins the workers, with no lock held), and
/// every timer ends once.
#[test]
fn a_callback_that_shuts_down_during_shutdown_does_not_deadlock() {
    let slot: Arc<std::sync::OnceLock<Timer<u32>>> = Arc::default();
    let (entered_tx, entered) = crossbeam_channel::bounded::<()>(1);
    let (go, go_rx) = crossbeam_channel::bounded::<()>(1);
    let (from_callback_tx, from_callback) = crossbeam_channel::unbounded::<usize>();
    let callback_timer = slot.clone();
    let timer = Timer::builder()
        .build_callback(1, 16, move |_e: delaywheel::Expiration<u32>| {
            let _ = entered_tx.try_send(());
            let _ = go_rx.recv_timeout(PATIENCE);
            if let Some(timer) = callback_timer.get() {
                let _ = from_callback_tx.send(timer.shutdown().len());
            }
        })
        .unwrap();
    slot.set(timer.clone()).ok().unwrap();
    timer.schedule(0, Duration::ZERO).unwrap();
    for i in 1..=10 {
        timer.schedule(i, Duration::from_secs(3_600)).unwrap();
    }
    entered.recv_timeout(PATIENCE).expect("the callback runs");
    let (done_tx, done) = crossbeam_channel::bounded(1);
    let stopper = timer.clone();
    std::thread::spawn(move || done_tx.send(stopper.shutdown().len()).unwrap());
    // Let the stopper reach the join of the worker, then let the callback shut down too.
    std::thread::sleep(50 * MS);
    go.send(()).unwrap();
    let by_thread = done.recv_timeout(PATIENCE).expect("shutdown returned");
    let by_callback = from_callback
        .recv_timeout(PATIENCE)
        .expect("the callback's shutdown returned");
    assert_eq!(
        by_thread + by_callback,
        10,
        "each pending timer handed back once"
    );
}

/// A second `shutdown` while the first is still waiting for the callbacks returns only once
/// they are done too. (It found the delivery taken by the first and returned at once, while
/// callbacks still ran: a caller could then tear down what they use.)
#[test]
fn a_second_shutdown_waits_for_the_callbacks_too() {
    let done = Arc::new(AtomicBool::new(false));
    let (entered_tx, entered) = crossbeam_channel::bounded::<()>(1);
    let (go, go_rx) = crossbeam_channel::bounded::<()>(1);
    let finished = done.clone();
    let timer = Timer::builder()
        .build_callback(1, 4, move |e: delaywheel::Expiration<u32>| {
            // Only the first timer waits for `go` (sent once): the others the loop below may
            // get scheduled before the shutdown refuses them would each wait it out.
            if e.value == 0 {
                let _ = entered_tx.try_send(());
                let _ = go_rx.recv_timeout(PATIENCE);
                finished.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
    timer.schedule(0, Duration::ZERO).unwrap();
    entered.recv_timeout(PATIENCE).expect("the callback runs");
    let first = {
        let t = timer.clone();
        std::thread::spawn(move || t.shutdown())
    };
    // The first stop has taken the delivery once schedules are refused; it then joins the
    // worker, which waits for `go`.
    while timer.schedule(1, Duration::ZERO).is_ok() {
        std::thread::sleep(MS);
    }
    std::thread::sleep(50 * MS);
    let second = {
        let (t, done) = (timer.clone(), done.clone());
        std::thread::spawn(move || {
            t.shutdown();
            done.load(Ordering::SeqCst)
        })
    };
    std::thread::sleep(50 * MS);
    go.send(()).unwrap();
    assert!(
        second.join().unwrap(),
        "the second shutdown returned while the callback still ran"
    );
    first.join().unwrap();
}

/// A `shutdown` that finds the engine stopped by a callback (on a pool worker, which the
/// callback's own stop cannot join) waits for that worker to finish its callback and what is
/// still queued. (It returned at once, while the callback still ran.)
#[test]
fn a_shutdown_after_a_callback_stopped_the_engine_waits_for_that_callback() {
    let me: Arc<std::sync::OnceLock<Timer<u32>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    // Held by the callback only: gone once the callback is.
    let held_by_callback = Arc::new(());
    let (stopped_tx, stopped) = crossbeam_channel::bounded::<()>(1);
    let timer = {
        let (me, done, held) = (me.clone(), done.clone(), held_by_callback.clone());
        Timer::builder()
            .build_callback(1, 4, move |e: Expiration<u32>| {
                let _held = &held;
                if e.value != 0 {
                    return;
                }
                if let Some(t) = me.get() {
                    t.shutdown();
                }
                let _ = stopped_tx.send(());
                // The rest of the callback, after its engine has stopped.
                std::thread::sleep(200 * MS);
                done.store(true, Ordering::SeqCst);
            })
            .unwrap()
    };
    assert!(me.set(timer.clone()).is_ok());
    timer.schedule(0, Duration::ZERO).unwrap();
    stopped
        .recv_timeout(PATIENCE)
        .expect("the callback stopped the engine");
    timer.shutdown();
    assert!(
        done.load(Ordering::SeqCst),
        "shutdown returned while the callback still ran"
    );
    // As after a `join`: the callback (and what it holds) is dropped before `shutdown` returns.
    assert_eq!(
        Arc::strong_count(&held_by_callback),
        1,
        "shutdown returned before the callback was dropped"
    );
}

/// `fire_due` and `shutdown` at the same time (no driver thread): every timer is delivered or
/// handed back, exactly once. `shutdown` waits for the turn in progress before it drains.
#[test]
fn fire_due_racing_shutdown_loses_nothing() {
    // Many timers, so that the turn spends a while collecting them before it delivers.
    for round in 0..20u32 {
        let (timer, rx) = Timer::builder()
            .manual_driver()
            .build_channel(None)
            .unwrap();
        let n = 20_000u32;
        for i in 0..n {
            timer.schedule(i, Duration::ZERO).unwrap();
        }
        std::thread::sleep(Duration::from_micros(1_100)); // past the tick they round up to
        let start = Arc::new(Barrier::new(2));
        let firer = {
            let (timer, start) = (timer.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                timer.fire_due()
            })
        };
        start.wait();
        let returned: Vec<u32> = timer.shutdown().into_iter().map(|p| p.value).collect();
        firer.join().unwrap();
        let mut all: Vec<u32> = rx.try_iter().map(|e| e.value).chain(returned).collect();
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>(), "round {round}");
    }
}

/// A callback that panics with a payload whose own drop panics too leaves its worker running:
/// later timers on it are still delivered.
#[test]
fn a_callback_panic_whose_payload_panics_when_dropped_keeps_the_worker() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("the payload's drop panicked");
        }
    }
    let (tx, rx) = crossbeam_channel::unbounded();
    let timer = Timer::builder()
        .build_callback(1, 16, move |e: delaywheel::Expiration<u32>| {
            if e.value == 0 {
                std::panic::panic_any(Bomb);
            }
            tx.send(e.value).unwrap();
        })
        .unwrap();
    timer.schedule(0, Duration::ZERO).unwrap();
    timer.schedule(1, Duration::from_millis(20)).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(1));
    assert!(timer.shutdown().is_empty());
}
