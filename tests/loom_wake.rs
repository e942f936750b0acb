//! A loom model of the schedule/wake handshake between producers and the driver: the engine's
//! own `src/engine/wake.rs` (its ground rules at the top of that file), compiled here against loom's
//! atomics, driven the way `drive` and `Core::insert` in `src/timer.rs` drive it.
//!
//! The driver calls `Wake::scanning` before it scans the shard and `Wake::may_park` after, then
//! parks; a producer inserts under the shard lock, then calls `Wake::timer_due`. Loom explores
//! every interleaving; a lost wake-up leaves the driver parked forever, which loom reports as a
//! deadlock. The checks can fail, and three tests show it: a driver that skips `scanning` (a
//! stale deadline from the previous turn hides the new timer from the producer); a driver that
//! parks whatever `may_park` says, trusting the park token alone when a blocked delivery
//! (crossbeam parking the driver thread) swallows it, which is what the `woken` flag is for;
//! and producers that keep the old rule (one that finds the flag on does nothing), written
//! here against `Wake`'s fields, when the producer that set the flag stalls before its
//! unpark: the early timer of a producer that has returned then waits for the stalled one.
//! That is what the flag's `WAKING` state is for.

// The model uses what the engine uses, not every item of the file.
#[allow(dead_code)]
#[path = "../src/engine/wake.rs"]
mod wake;

/// loom's atomics, where the engine has std's (`mod sync` in `src/lib.rs`).
mod sync {
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering::SeqCst};
}

use loom::sync::atomic::AtomicBool;
use loom::sync::{Arc, Mutex, Notify};
use loom::thread;

use sync::SeqCst;
use wake::{Wake, IDLE, WAKE_ONE, WAKE_STATE, WAKING, WOKEN};

const LATE: u64 = 100;
const EARLY: u64 = 5;

/// How the modelled producers wake the driver.
#[derive(Clone, Copy, PartialEq)]
enum Producers {
    /// The engine's `Wake::timer_due`: one that finds the flag `WAKING` unparks too.
    Engine,
    /// The old rule (a bug the check below must catch): one that finds the flag on, in either
    /// state, does nothing.
    FlagOnDoesNothing,
}

/// How the modelled driver deviates from the engine's (both deviations are bugs, which the
/// checks below must catch).
#[derive(Clone, Copy, PartialEq)]
enum Driver {
    /// As `drive` in `src/timer.rs`.
    Engine,
    /// Does not call `Wake::scanning` before it scans.
    NoScanMark,
    /// Parks whatever `Wake::may_park` says, trusting the park token alone.
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
    model_with(
        driver_kind,
        Producers::Engine,
        producers,
        blocked_delivery,
        false,
    );
}

/// As [`model`]; with `stalled_setter`, the first producer (the later of two timers), if it
/// is the one that turns the flag on, stalls before its unpark until the driver has seen the
/// earliest timer: that one's producer, which returns meanwhile, must have the driver see it
/// without the stalled one.
fn model_with(
    driver_kind: Driver,
    producer_kind: Producers,
    producers: usize,
    blocked_delivery: bool,
    stalled_setter: bool,
) {
    let mut builder = loom::model::Builder::new();
    // Bounded preemptions keep the larger models to seconds; the lost wake-ups these guard
    // against need only one or two.
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let shard = Arc::new(Mutex::new(vec![LATE]));
        let wake = Arc::new(Wake::new());
        // The previous turn published a timer due at 3 that has since been cancelled.
        wake.scanning();
        assert!(wake.may_park(Some(3)));
        let room = Arc::new(AtomicBool::new(false));
        // Announced by the driver once it has seen the earliest timer.
        let seen = Arc::new(Notify::new());

        let driver = {
            let (shard, wake, room, seen) =
                (shard.clone(), wake.clone(), room.clone(), seen.clone());
            thread::spawn(move || {
                let mut delivered = !blocked_delivery;
                loop {
                    if driver_kind != Driver::NoScanMark {
                        wake.scanning();
                    }
                    let earliest = shard.lock().unwrap().iter().copied().min();
                    if earliest == Some(EARLY) {
                        seen.notify();
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
                    if !wake.may_park(earliest) && driver_kind != Driver::IgnoresWoken {
                        continue;
                    }
                    thread::park();
                }
            })
        };

        let mut handles: Vec<_> = (0..producers)
            .map(|i| {
                let (shard, wake, seen) = (shard.clone(), wake.clone(), seen.clone());
                let driver = driver.thread().clone();
                let due = EARLY + 2 * (producers - 1 - i) as u64;
                let stalls = stalled_setter && i == 0;
                thread::spawn(move || {
                    shard.lock().unwrap().push(due);
                    // Blocked, not spinning: if nothing else wakes the driver, loom finds every
                    // thread blocked and reports the deadlock.
                    let stall = || {
                        if stalls {
                            seen.wait();
                        }
                    };
                    match producer_kind {
                        Producers::Engine => wake.timer_due(due, || {
                            // The engine's producer unparks once at most per call: this stalls
                            // the one that set the flag, or (stronger) one helping another.
                            stall();
                            driver.unpark();
                        }),
                        Producers::FlagOnDoesNothing => {
                            old_rule(&wake, due, stall, || driver.unpark());
                        }
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

#[test]
fn a_setter_stalled_before_its_unpark_delays_no_other_producers_timer() {
    model_with(Driver::Engine, Producers::Engine, 2, false, true);
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

#[test]
#[ignore = "run in a child process by under_the_old_rule_a_stalled_setter_delays_the_others"]
fn flag_on_does_nothing_child() {
    model_with(Driver::Engine, Producers::FlagOnDoesNothing, 2, false, true);
}

/// `Wake::timer_due` under the old rule: one that finds the flag on, in either state, does
/// nothing; one that turns it on calls `stall`, unparks, then marks it `WOKEN`.
fn old_rule(wake: &Wake, due: u64, stall: impl Fn(), unpark: impl Fn()) {
    if due >= wake.next_wake.load(SeqCst) {
        return;
    }
    let flag = wake.woken.load(SeqCst);
    if flag & WAKE_STATE != IDLE {
        return;
    }
    let waking = (flag & !WAKE_STATE).wrapping_add(WAKE_ONE) | WAKING;
    if wake
        .woken
        .compare_exchange(flag, waking, SeqCst, SeqCst)
        .is_ok()
    {
        stall();
        unpark();
        let woken_now = (waking & !WAKE_STATE) | WOKEN;
        let _ = wake
            .woken
            .compare_exchange(waking, woken_now, SeqCst, SeqCst);
    }
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

#[test]
fn under_the_old_rule_a_stalled_setter_delays_the_others() {
    fails_with_a_deadlock("flag_on_does_nothing_child");
}
