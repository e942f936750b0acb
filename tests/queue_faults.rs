//! The queue under the faults of issue 22 that another client's writes cause: a producer in
//! another language that writes a task in two steps (the queue entry, then the envelope, or the
//! other way round), envelopes without the fields such a producer may leave out, and a key of
//! the wrong type beside an entry that has to be dead-lettered. Each against a private
//! `redis-server`, writing the foreign state with plain commands.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use delaywheel::redis::{now_ms, Consumer, Handlers, PersistConfig, Persistent};
use queue_kit::*;

/// A connection of its own to the fixture's server, for writing as another client would.
fn admin(server: &redis_server::RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap()
}

/// An envelope from another client without `attempt` and `created_at` is a task: attempt 0,
/// created at its due time. (It was dead-lettered as undecodable.)
#[test]
fn a_queued_envelope_without_attempt_or_created_at_takes_their_defaults() {
    let Fixture { server, rt, cfg, p } = fixture("minimal", |_| {});
    let mut conn = admin(&server);
    let due = now_ms();
    redis::pipe()
        .atomic()
        .zadd("{minimal}:due", "bare", due)
        .hset(
            "{minimal}:tasks",
            "bare",
            format!(r#"{{"id":"bare","topic":"job","payload":{{"n":1}},"due_at":{due}}}"#),
        )
        .query::<()>(&mut conn)
        .unwrap();
    let (tx, rx) = crossbeam_channel::unbounded();
    let c = Consumer::start(
        cfg,
        Handlers::new().on("job", move |task| {
            let _ = tx.send(task.clone());
            Ok(())
        }),
    )
    .unwrap();
    let task = rx.recv_timeout(PATIENCE).expect("the task did not fire");
    assert_eq!(task.id, "bare");
    assert_eq!(task.payload, serde_json::json!({ "n": 1 }));
    assert_eq!((task.attempt, task.created_at, task.due_at), (0, due, due));
    wait_until("its ack", || c.stats().acked == 1);
    assert_eq!(c.stats().dead_lettered, 0);
    assert!(rt.block_on(p.dead_letters(10)).unwrap().is_empty());
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A `Persistent` restore reads such an envelope the same way.
#[test]
fn a_restored_envelope_without_attempt_or_created_at_takes_their_defaults() {
    let server = redis_server::RedisServer::start_in_memory();
    let mut conn = admin(&server);
    let due = now_ms() + 200;
    redis::pipe()
        .atomic()
        .zadd("{kept}:due", "bare", due)
        .hset(
            "{kept}:tasks",
            "bare",
            format!(r#"{{"id":"bare","topic":"t","payload":[1],"due_at":{due}}}"#),
        )
        .query::<()>(&mut conn)
        .unwrap();
    let (engine, fired) = Persistent::start(PersistConfig::new(server.url(), "kept")).unwrap();
    let report = engine.restore(100).unwrap();
    assert_eq!((report.loaded, report.dead_lettered), (1, 0));
    let task = fired.recv_timeout(PATIENCE).expect("the task did not fire");
    assert_eq!(task.id, "bare");
    assert_eq!(task.payload, serde_json::json!([1]));
    assert_eq!((task.attempt, task.created_at, task.due_at), (0, due, due));
    engine.ack(&task);
    engine.shutdown();
}
