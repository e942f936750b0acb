//! A task enqueued shortly ahead while every consumer idles is claimed in time by the wake-up
//! its producer publishes, or, when that notification is lost, by the next bounded reconcile
//! claim, and not by a claim a whole reconcile interval later. The bounds are wide (seconds,
//! against the milliseconds it takes on an idle machine): what fails is a missing wake-up or a
//! reconcile interval not honoured, not a slow machine. The precision itself is measured by
//! `examples/vs_polling.rs`. In a binary of its own: the other queue tests would compete for
//! the two cores.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{now_ms, Consumer, QueueConfig};
use queue_kit::*;
use redis_server::RedisServer;

/// Lateness of tasks enqueued `lead_ms` ahead while every consumer idles, five times.
fn wake_lateness_ms(notify: bool, reconcile: Duration, lead_ms: u64, ns: &str) -> Vec<f64> {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(server.url(), ns);
    cfg.reconcile = reconcile;
    cfg.lookahead = cfg.lookahead.max(reconcile + cfg.claim_margin);
    let fired: Fired = Arc::default();
    let consumers: Vec<Consumer> = (0..2)
        .map(|i| Consumer::start(cfg.clone(), recorder(&fired, i, "t")).unwrap())
        .collect();
    let mut pcfg = cfg.clone();
    pcfg.notify = notify;
    let p = producer(&rt, &pcfg);
    wait_for_wake_subscribers(&server, ns, 2);
    std::thread::sleep(Duration::from_millis(300)); // initial claims done: all idle
    let mut late = Vec::new();
    for i in 0..5 {
        let due = now_ms() + lead_ms;
        let id = format!("w{i}");
        enqueue_all(&rt, &p, "t", vec![(id.clone(), due)]);
        wait_until("the task to fire", || fired.lock().contains_key(&id));
        let at = fired.lock()[&id][0].1;
        assert!(at >= due * 1_000, "fired early");
        late.push((at - due * 1_000) as f64 / 1_000.0);
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    late.sort_by(f64::total_cmp);
    late
}

#[test]
fn a_task_enqueued_ahead_is_claimed_by_the_wake_up_or_the_next_reconcile() {
    // Notified: the next reconcile claim is 10 s after the consumers started, and the five
    // tasks are all due within about 1.5 s of it, so without the wake-up each would be at
    // least 8 s late.
    let notified = wake_lateness_ms(true, Duration::from_secs(10), 50, "wake");
    assert!(
        notified[4] < 4_000.0,
        "lateness {notified:?} ms: the wake-up did not claim the tasks"
    );
    // The notification dropped on purpose (the producer does not publish): the reconcile
    // claim runs every 200 ms, well within the 1 s notice, so it claims each task before it
    // is due and it fires on time. Without reconcile claims nothing would claim it at all
    // (the wait for it fails).
    // (The median, and a looser bound on the worst, so that one stall of the machine at a
    // firing does not fail it.)
    let lost = wake_lateness_ms(false, Duration::from_millis(200), 1_000, "lost");
    assert!(
        lost[2] < 1_000.0 && lost[4] < 5_000.0,
        "lateness {lost:?} ms: the reconcile interval was not honoured"
    );
}
