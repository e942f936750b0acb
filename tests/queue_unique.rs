//! `Producer::enqueue_unique`: after a task is acknowledged, its id is refused for its window,
//! then taken again; a pending id reads as pending; a dead-lettered one sets no window.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Consumer, Handlers, KeyLayout, QueueError, RetryPolicy, Unique, When, MAX_UNIQUE_WINDOW,
};
use queue_kit::*;

#[test]
fn an_acknowledged_id_is_refused_for_its_window_then_taken_again() {
    let Fixture { server, rt, cfg, p } = fixture("unique", |cfg| cfg.shards = 2);
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "remind")).unwrap();
    let window = Duration::from_millis(1_500);
    let enqueue = |when: u64| {
        rt.block_on(p.enqueue_unique(
            "remind:42",
            "remind",
            serde_json::Value::Null,
            When::AtMs(when),
            window,
        ))
        .unwrap()
    };
    // Pending: queued a minute ahead, then the same id again.
    assert_eq!(enqueue(now_ms() + 60_000), Unique::Stored);
    assert_eq!(enqueue(now_ms()), Unique::Pending);
    assert!(rt.block_on(p.promote("remind:42")).unwrap().moved());
    wait_until("the first run", || fired.lock().contains_key("remind:42"));
    wait_until("its ack", || c.stats().acked == 1);
    let acked_at = Instant::now();
    // The marker lives in the id's shard, and expires with the window.
    let shard = delaywheel::redis::shard_of("remind:42", 2);
    let marker = KeyLayout::new(&format!("unique:{shard}"))
        .unwrap()
        .unique_marker("remind:42");
    let ttl = server.int(&["PTTL", &marker]);
    assert!(ttl > 0 && ttl <= 1_500, "marker {marker} ttl {ttl}");
    // Within the window: refused, however often, and nothing is stored.
    for _ in 0..3 {
        assert_eq!(enqueue(now_ms()), Unique::RecentlyDone);
    }
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, 0);
    // After it: taken, and it runs again, once.
    while acked_at.elapsed() < window + Duration::from_millis(100) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(enqueue(now_ms()), Unique::Stored);
    wait_until("the second run", || fired.lock()["remind:42"].len() == 2);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        fired.lock()["remind:42"].len(),
        2,
        "run more than once per window"
    );
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_dead_lettered_id_sets_no_window_and_bad_windows_are_refused() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("unique-dead", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        };
    });
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new().on("remind", |_| Err("sms down".into())),
    )
    .unwrap();
    let hour = Duration::from_secs(3_600);
    let enqueue = |window| {
        rt.block_on(p.enqueue_unique(
            "remind:7",
            "remind",
            serde_json::Value::Null,
            Duration::ZERO,
            window,
        ))
    };
    assert_eq!(enqueue(hour).unwrap(), Unique::Stored);
    wait_until("the dead letter", || {
        rt.block_on(p.depth()).unwrap().dead == 1
    });
    // Dead-lettered, not acknowledged: no window, so the id is taken at once.
    assert_eq!(enqueue(hour).unwrap(), Unique::Stored);
    for bad in [Duration::ZERO, MAX_UNIQUE_WINDOW + Duration::from_secs(1)] {
        match enqueue(bad) {
            Err(QueueError::Config(_)) => {}
            other => panic!("window {bad:?}: {other:?}"),
        }
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}
