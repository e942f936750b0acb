//! A loom model of the schedule/wake handshake between producers and the driver
//! (`Core::wake_for` and `drive` in `src/timer.rs`; the ground rules at the top of that file).
//!
//! The model mirrors the protocol step by step with loom's primitives: the driver publishes
//! `next_wake = u64::MAX` before it scans the shard and the earliest deadline it found after, then
//! parks; a producer inserts under the shard lock, then, if its deadline is earlier than
//! `next_wake`, sets `woken` and unparks the driver, unless it finds `woken` already set. Loom explores every interleaving; a lost wake-up leaves the driver
//! parked forever, which loom reports as a deadlock. The same model with the first store
//! removed (the bug the rule prevents) must fail, which shows the check can fail: a stale
//! `next_wake` from the previous turn hides the new timer from the producer. So must a driver
//! that trusts the park token alone when a blocked delivery (crossbeam parking the driver
//! thread) swallows it: that is what the `woken` flag is for.

use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use loom::sync::{Arc, Mutex};
use loom::thread;

const LATE: u64 = 100;
const EARLY: u64 = 5;

/// How the modelled driver deviates from the engine's (both deviations are bugs, which the
/// checks below must catch).
#[derive(Clone, Copy, PartialEq)]
enum Driver {
    /// As `drive` in `src/timer.rs`.
    Engine,
    /// Does not publish `u64::MAX` before it scans.
    NoScanMark,
    /// Clears `woken` without looking at it, trusting the park token alone.
    IgnoresWoken,
}

/// `producers` each insert a timer while the driver turns, the last one the earliest
/// (`EARLY`; the others 2 ticks apart after it, all before `LATE`); with `blocked_delivery`,
/// the driver's first turn also blocks on a full channel the way crossbeam does, parking until
/// a consumer makes room, which swallows any unpark token a producer gave meanwhile. The
/// driver returns once it has seen the timer due at `EARLY`; a lost wake-up leaves it parked
/// forever (having published a later timer, or `LATE`), which loom reports as a deadlock. With
/// two producers, the one with the earlier timer may find the flag already set by the other
/// and do nothing: the driver must still see its timer.
fn model(driver_kind: Driver, producers: usize, blocked_delivery: bool) {
    let mut builder = loom::model::Builder::new();
    // Bounded preemptions keep the larger models to seconds; the lost wake-ups these guard
    // against need only one or two.
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let shard = Arc::new(Mutex::new(vec![LATE]));
        // What the previous turn published: a timer due at 3 that has since been cancelled.
        let next_wake = Arc::new(AtomicU64::new(3));
        let woken = Arc::new(AtomicBool::new(false));
        let room = Arc::new(AtomicBool::new(false));

        let driver = {
            let (shard, next_wake, woken, room) = (
                shard.clone(),
                next_wake.clone(),
                woken.clone(),
                room.clone(),
            );
            thread::spawn(move || {
                let mut delivered = !blocked_delivery;
                loop {
                    if driver_kind != Driver::NoScanMark {
                        next_wake.store(u64::MAX, SeqCst);
                    }
                    let earliest = shard.lock().unwrap().iter().copied().min();
                    if earliest == Some(EARLY) {
                        return; // the driver has seen a new earliest timer: it fires on time
                    }
                    if !delivered {
                        // A delivery blocked on a full channel: crossbeam parks until there is
                        // room, consuming every token meanwhile.
                        delivered = true;
                        while !room.load(SeqCst) {
                            thread::park();
                        }
                    }
                    let was_woken = woken.swap(false, SeqCst);
                    if was_woken && driver_kind != Driver::IgnoresWoken {
                        continue;
                    }
                    next_wake.store(earliest.unwrap_or(u64::MAX), SeqCst);
                    thread::park();
                }
            })
        };

        let mut handles: Vec<_> = (0..producers)
            .map(|i| {
                let (shard, next_wake, woken) = (shard.clone(), next_wake.clone(), woken.clone());
                let driver = driver.thread().clone();
                let due = EARLY + 2 * (producers - 1 - i) as u64;
                thread::spawn(move || {
                    shard.lock().unwrap().push(due);
                    // Only the producer that turns the flag on unparks; one that finds it on
                    // does nothing.
                    if due < next_wake.load(SeqCst)
                        && !woken.load(SeqCst)
                        && !woken.swap(true, SeqCst)
                    {
                        driver.unpark();
                    }
                })
            })
            .collect();
        if blocked_delivery {
            let (room, driver) = (room.clone(), driver.thread().clone());
            handles.push(thread::spawn(move || {
                room.store(true, SeqCst);
                driver.unpark();
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
        driver.join().unwrap();
    });
}

#[test]
fn the_driver_never_misses_a_new_earliest_timer() {
    model(Driver::Engine, 1, false);
}

#[test]
fn two_producers_racing_the_driver() {
    model(Driver::Engine, 2, false);
}

#[test]
fn a_delivery_that_swallows_the_unpark_loses_no_wake_up() {
    model(Driver::Engine, 1, true);
}

/// The buggy drivers, run by the tests below in a child process each, because loom aborts the
/// process when it finds the deadlock.
#[test]
#[ignore = "run in a child process by without_publishing_the_scan_a_wake_up_is_lost"]
fn buggy_protocol_child() {
    model(Driver::NoScanMark, 1, false);
}

#[test]
#[ignore = "run in a child process by without_the_woken_flag_a_swallowed_unpark_is_lost"]
fn ignores_woken_child() {
    model(Driver::IgnoresWoken, 1, true);
}

fn fails_with_a_deadlock(child: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--ignored", "--nocapture"])
        .output()
        .unwrap();
    let output = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "loom did not catch the lost wake-up");
    assert!(output.contains("deadlock"), "unexpected failure: {output}");
}

#[test]
fn without_publishing_the_scan_a_wake_up_is_lost() {
    fails_with_a_deadlock("buggy_protocol_child");
}

#[test]
fn without_the_woken_flag_a_swallowed_unpark_is_lost() {
    fails_with_a_deadlock("ignores_woken_child");
}
