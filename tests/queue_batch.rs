//! `Producer::enqueue_many`: one script call per shard and batch, the same result per task as
//! `enqueue_envelope` would give, every refused envelope handed back.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{now_ms, Consumer, Envelope, EnvelopeError, QueueError};

use queue_kit::*;

fn envelope(id: &str, due_at: u64) -> Envelope {
    Envelope {
        id: id.to_string(),
        topic: "job".into(),
        payload: serde_json::json!({ "id": id }),
        attempt: 0,
        created_at: now_ms(),
        headers: Default::default(),
        due_at,
    }
}

/// Across shards and batches: each task stored once and fired once; ids already pending are
/// `Ok(false)`; an envelope over the size limit is refused alone, handed back; an id given
/// twice in one call is stored once. Fewer script calls than tasks.
#[test]
fn enqueue_many_stores_each_task_as_enqueue_would() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("many", |cfg| {
        cfg.shards = 4;
        cfg.max_envelope = 1_024;
    });
    let due = now_ms() + 1_500;
    let mut batch: Vec<Envelope> = (0..1_000)
        .map(|i| envelope(&format!("m{i}"), due))
        .collect();
    let mut big = envelope("big", due);
    big.payload = serde_json::json!("x".repeat(2_000));
    batch.insert(500, big);
    batch.push(envelope("m7", due)); // the same id again, in the same call
    let before = p.commands();
    let results = rt.block_on(p.enqueue_many(batch, false));
    let calls = p.commands() - before;
    assert_eq!(results.len(), 1_002);
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (500, Err(QueueError::Envelope(EnvelopeError::TooLarge { .. }, back))) => {
                assert_eq!(back.id, "big")
            }
            (1_001, Ok(false)) => {}
            (i, Ok(true)) if i != 500 && i != 1_001 => {}
            (i, other) => panic!("task {i}: {other:?}"),
        }
    }
    // 4 shards, each at most ENQUEUE_BATCH a call: a handful of calls, not 1 000.
    assert!(calls <= 12, "{calls} script calls");
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, 1_000);
    // Again: every id is pending.
    let again: Vec<Envelope> = (0..1_000)
        .map(|i| envelope(&format!("m{i}"), due))
        .collect();
    let results = rt.block_on(p.enqueue_many(again, false));
    assert!(
        results.iter().all(|r| matches!(r, Ok(false))),
        "{:?}",
        &results[..3]
    );
    // They all fire, once each, not early.
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_until("all fired", || fired.lock().len() == 1_000);
    std::thread::sleep(Duration::from_millis(200));
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id} fired twice");
        assert!(d[0].1 >= due * 1_000, "{id} early");
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// Redis fails the call: every task of it comes back `NotEnqueued`, its envelope handed back.
#[test]
fn enqueue_many_hands_every_envelope_back_when_redis_fails() {
    let Fixture {
        mut server,
        rt,
        cfg: _,
        p,
    } = fixture("many-down", |_| {});
    server.kill();
    let batch: Vec<Envelope> = (0..10)
        .map(|i| envelope(&format!("d{i}"), now_ms()))
        .collect();
    let results = rt.block_on(p.enqueue_many(batch, false));
    assert_eq!(results.len(), 10);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Err(QueueError::NotEnqueued(_, back)) => assert_eq!(back.id, format!("d{i}")),
            other => panic!("task {i}: {other:?}"),
        }
    }
}
