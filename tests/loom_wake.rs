//! A loom model of the schedule/wake handshake between producers and the driver
//! (`Core::wake_for` and `drive` in `src/timer.rs`; the ground rules at the top of that file).
//!
//! The model mirrors the protocol step by step with loom's primitives: the driver publishes
//! `next_wake = u64::MAX` before it scans the shard and the earliest deadline it found after, then
//! parks; a producer inserts under the shard lock, then, if its deadline is earlier than
//! `next_wake`, sets `woken` and unparks the driver, unless it finds `woken` already set. Loom explores every interleaving; a lost wake-up leaves the driver
//! parked forever, which loom reports as a deadlock. The same model with the first store
//! removed (the bug the rule prevents) must fail, which shows the check can fail: a stale
//! `next_wake` from the previous turn hides the new timer from the producer.

use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use loom::sync::{Arc, Mutex};
use loom::thread;

const LATE: u64 = 100;
const EARLY: u64 = 5;

fn model(publish_scanning: bool, producers: usize) {
    let mut builder = loom::model::Builder::new();
    // Bounded preemptions keep the two-producer model to seconds; the lost wake-up this
    // guards against needs only one preemption.
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let shard = Arc::new(Mutex::new(vec![LATE]));
        // What the previous turn published: a timer due at 3 that has since been cancelled.
        let next_wake = Arc::new(AtomicU64::new(3));
        let woken = Arc::new(AtomicBool::new(false));

        let driver = {
            let (shard, next_wake, woken) = (shard.clone(), next_wake.clone(), woken.clone());
            thread::spawn(move || loop {
                if publish_scanning {
                    next_wake.store(u64::MAX, SeqCst);
                }
                let earliest = shard.lock().unwrap().iter().copied().min();
                if earliest == Some(EARLY) {
                    return; // the driver has seen the new earliest timer: it will fire on time
                }
                if woken.swap(false, SeqCst) {
                    continue;
                }
                next_wake.store(earliest.unwrap_or(u64::MAX), SeqCst);
                thread::park();
            })
        };

        let handles: Vec<_> = (0..producers)
            .map(|_| {
                let (shard, next_wake, woken) = (shard.clone(), next_wake.clone(), woken.clone());
                let driver = driver.thread().clone();
                thread::spawn(move || {
                    shard.lock().unwrap().push(EARLY);
                    // Only the producer that turns the flag on unparks; one that finds it on
                    // does nothing.
                    if EARLY < next_wake.load(SeqCst)
                        && !woken.load(SeqCst)
                        && !woken.swap(true, SeqCst)
                    {
                        driver.unpark();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        driver.join().unwrap();
    });
}

#[test]
fn the_driver_never_misses_a_new_earliest_timer() {
    model(true, 1);
}

#[test]
fn two_producers_racing_the_driver() {
    model(true, 2);
}

/// The same model without the `u64::MAX` store. Run by the test below in a child process,
/// because loom aborts the process when it finds the deadlock.
#[test]
#[ignore = "run in a child process by without_publishing_the_scan_a_wake_up_is_lost"]
fn buggy_protocol_child() {
    model(false, 1);
}

#[test]
fn without_publishing_the_scan_a_wake_up_is_lost() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "buggy_protocol_child",
            "--ignored",
            "--nocapture",
        ])
        .output()
        .unwrap();
    let output = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "loom did not catch the lost wake-up");
    assert!(output.contains("deadlock"), "unexpected failure: {output}");
}
