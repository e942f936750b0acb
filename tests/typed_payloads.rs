//! Typed payloads through serde: `Persistent::schedule` and `Producer::enqueue` take a
//! `&impl Serialize`, the envelope stays JSON on the wire (other clients read it as before),
//! and `Envelope::payload_as` reads it back, or says why not with the payload in hand.
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeMap;
use std::time::Duration;

use delaywheel::redis::{
    EnvelopeError, PersistConfig, PersistError, Persistent, Producer, QueueConfig, QueueError,
};
use redis_server::RedisServer;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct CloseOrder {
    order_id: u64,
    customer: String,
    lines: Vec<u32>,
}

fn order() -> CloseOrder {
    CloseOrder {
        order_id: 42,
        customer: "ada".into(),
        lines: vec![3, 1],
    }
}

/// A struct scheduled on `Persistent` is stored as plain JSON in the task hash, and comes
/// back as the struct from the fired task.
#[test]
fn a_struct_payload_is_stored_as_json_and_read_back_typed() {
    let server = RedisServer::start_in_memory();
    let (engine, fired) = Persistent::start(PersistConfig::new(server.url(), "typed")).unwrap();
    engine
        .schedule(
            "order:42",
            "order.close",
            &order(),
            Duration::from_millis(50),
        )
        .unwrap();
    assert!(engine.flush(Duration::from_secs(30)));
    // What another client reads: the envelope's JSON, with the payload as an object.
    let raw = match server.run(&["HGET", "{typed}:tasks", "order:42"]) {
        redis::Value::BulkString(b) => String::from_utf8(b).unwrap(),
        other => panic!("HGET: {other:?}"),
    };
    let stored: serde_json::Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        stored["payload"],
        serde_json::json!({ "order_id": 42, "customer": "ada", "lines": [3, 1] })
    );
    let task = fired.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(task.payload_as::<CloseOrder>().unwrap(), order());
    // Asked for the wrong type: the error names it and hands the payload back.
    let wrong = task.payload_as::<Vec<String>>().unwrap_err();
    assert!(wrong.type_name.contains("Vec"), "{wrong:?}");
    assert_eq!(wrong.payload, stored["payload"]);
    assert!(wrong.to_string().starts_with("payload does not decode as "));
    assert!(engine.ack(&task));
    engine.shutdown();
}

/// A payload serde cannot write as JSON (a map whose keys are not strings) is refused with
/// `EnvelopeError::Encode`, the envelope handed back, nothing stored; a `Value` by value and a
/// `&Value` both still work.
#[test]
fn a_payload_that_does_not_serialize_is_refused_with_the_envelope_handed_back() {
    let server = RedisServer::start_in_memory();
    let (engine, _fired) =
        Persistent::start(PersistConfig::new(server.url(), "typed-bad")).unwrap();
    let bad: BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into();
    match engine.schedule("bad", "t", &bad, Duration::from_secs(60)) {
        Err(PersistError::Envelope(EnvelopeError::Encode(msg), back)) => {
            assert!(msg.contains("key must be a string"), "{msg}");
            assert_eq!(
                (back.id.as_str(), &back.payload),
                ("bad", &serde_json::Value::Null)
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!engine.contains("bad"));
    let value = serde_json::json!({ "n": 1 });
    engine
        .schedule("by-ref", "t", &value, Duration::from_secs(60))
        .unwrap();
    engine
        .schedule("by-value", "t", value, Duration::from_secs(60))
        .unwrap();
    assert_eq!(engine.len(), 2);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = rt
        .block_on(Producer::connect(QueueConfig::new(server.url(), "typed-q")))
        .unwrap();
    match rt.block_on(p.enqueue("bad", "t", &bad, Duration::ZERO)) {
        Err(QueueError::Envelope(EnvelopeError::Encode(_), back)) => assert_eq!(back.id, "bad"),
        other => panic!("{other:?}"),
    }
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, 0);
    assert!(rt
        .block_on(p.enqueue("good", "t", &order(), Duration::from_secs(60)))
        .unwrap());
    engine.shutdown();
}

/// A `Persistent` engine's fired tasks read as a `Stream` on an async runtime: each task
/// once, in due order, and the stream ends at shutdown.
#[cfg(feature = "futures")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_engines_fired_tasks_read_as_a_stream() {
    use futures_util::StreamExt;

    let server = RedisServer::start_in_memory();
    let (engine, fired) =
        Persistent::start(PersistConfig::new(server.url(), "typed-stream")).unwrap();
    let engine = std::sync::Arc::new(engine);
    let mut fired = engine.stream(fired);
    for i in 0..20u64 {
        let mut o = order();
        o.order_id = i;
        engine
            .schedule(
                format!("o{i}"),
                "order.close",
                &o,
                Duration::from_millis(20 + 5 * i),
            )
            .unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 20 {
        let task = tokio::time::timeout(Duration::from_secs(30), fired.next())
            .await
            .expect("a fired task within 30 s")
            .expect("the stream ended early");
        got.push(task.payload_as::<CloseOrder>().unwrap().order_id);
        assert!(engine.ack(&task));
    }
    assert_eq!(got, (0..20).collect::<Vec<_>>());
    // Ends at shutdown, woken by it: no task is pending, so nothing else would wake it.
    let stopper = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(100));
            engine.shutdown()
        })
    };
    let end = tokio::time::timeout(Duration::from_secs(30), fired.next()).await;
    assert!(
        matches!(end, Ok(None)),
        "the stream did not end at shutdown"
    );
    assert!(stopper.await.unwrap().is_empty());
}
