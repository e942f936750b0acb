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

use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{now_ms, Consumer, Handlers, PersistConfig, Persistent, When};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use parking_lot::Mutex;
use queue_kit::*;

/// A connection of its own to the fixture's server, for writing as another client would.
fn admin(server: &redis_server::RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap()
}

/// A complete envelope of topic `job`, as another client writes one.
fn envelope(id: &str, due: u64) -> String {
    format!(
        r#"{{"id":"{id}","topic":"job","payload":null,"attempt":0,"created_at":0,"due_at":{due}}}"#
    )
}

/// A producer that sends `ZADD {ns}:due` and then `HSET {ns}:tasks` without MULTI, with a claim
/// landing between the two: the claim leaves the id queued, and the task fires once its
/// envelope lands. (The claim dead-lettered it at once, reason "no envelope", and the late
/// envelope was then left with no queue entry.)
#[test]
fn a_claim_between_the_two_writes_of_a_task_waits_for_its_envelope() {
    let Fixture { server, rt, cfg, p } = fixture("gap", |cfg| {
        cfg.reconcile = Duration::from_millis(100);
    });
    let mut conn = admin(&server);
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    let due = now_ms();
    redis::cmd("ZADD")
        .arg("{gap}:due")
        .arg(due)
        .arg("late")
        .query::<()>(&mut conn)
        .unwrap();
    // Two claims done since the ZADD: the second was sent after it.
    let before = c.stats().claims;
    wait_until("two claims in the gap", || c.stats().claims >= before + 2);
    assert_eq!(c.stats().dead_lettered, 0, "dead-lettered in the gap");
    redis::cmd("HSET")
        .arg("{gap}:tasks")
        .arg("late")
        .arg(envelope("late", due))
        .query::<()>(&mut conn)
        .unwrap();
    wait_until("the task to fire", || fired.lock().contains_key("late"));
    wait_until("its ack", || c.stats().acked == 1);
    assert_eq!(fired.lock()["late"].len(), 1);
    assert!(rt.block_on(p.dead_letters(10)).unwrap().is_empty());
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased, depth.dead), (0, 0, 0));
    // The claim forgot when it first saw the id without its envelope.
    let tracked: bool = redis::cmd("HEXISTS")
        .arg("{gap}:unpaired")
        .arg("late")
        .query(&mut conn)
        .unwrap();
    assert!(!tracked, "the first sighting outlived the task's claim");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// An id whose envelope never comes is dead-lettered, but only once the grace period has run
/// out since a claim first saw it without one; the claims in between keep it queued and claim
/// the other tasks. (It was dead-lettered by the first claim that saw it.)
#[test]
fn an_id_whose_envelope_never_comes_is_dead_lettered_after_the_grace_period() {
    let grace = Duration::from_millis(800);
    let Fixture { server, rt, cfg, p } = fixture("never", |cfg| {
        cfg.reconcile = Duration::from_millis(100);
        cfg.unpaired_grace = grace;
    });
    let mut conn = admin(&server);
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    let written = now_ms();
    redis::cmd("ZADD")
        .arg("{never}:due")
        .arg(written)
        .arg("ghost")
        .query::<()>(&mut conn)
        .unwrap();
    // Claims go on around it meanwhile.
    enqueue_all(&rt, &p, "job", vec![("beside".into(), now_ms())]);
    wait_until("the task beside it", || fired.lock().contains_key("beside"));
    wait_until("the dead letter", || c.stats().dead_lettered == 1);
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].id.as_str(), dead[0].reason.as_str()),
        ("ghost", "no envelope in the tasks hash")
    );
    // `at` is Redis's clock, on this machine.
    assert!(
        dead[0].at >= written + grace.as_millis() as u64,
        "dead-lettered {} ms after it was queued, within its grace period",
        dead[0].at.saturating_sub(written)
    );
    let (queued, tracked): (u32, bool) = redis::pipe()
        .zcard("{never}:due")
        .hexists("{never}:unpaired", "ghost")
        .query(&mut conn)
        .unwrap();
    assert_eq!((queued, tracked), (0, false));
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// An envelope with no queue entry (a late `HSET` after its id was dead-lettered, or the first
/// write of a producer that writes the envelope first) does not make its id look queued: an
/// `enqueue` of the id stores the new task, and a `requeue` of the dead letter takes the
/// envelope. The reaper removes an envelope left alone past the grace period, and keeps one
/// whose queue entry comes within it. (`enqueue` returned `Ok(false)` for ever, the task never
/// fired, and `requeue` failed.)
#[test]
fn an_envelope_with_no_queue_entry_blocks_nothing_and_is_swept_after_the_grace_period() {
    let Fixture { server, rt, cfg, p } = fixture("orphan", |cfg| {
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.unpaired_grace = Duration::from_millis(500);
    });
    let mut conn = admin(&server);
    let now = now_ms();
    redis::pipe()
        .hset("{orphan}:tasks", "left", envelope("left", now))
        // Dead-lettered by a claim in the gap, its envelope written after.
        .hset(
            "{orphan}:dead",
            "late",
            r#"{"reason":"no envelope in the tasks hash","raw":"","at":0,"attempt":0}"#,
        )
        .hset("{orphan}:tasks", "late", envelope("late", now))
        .query::<()>(&mut conn)
        .unwrap();
    assert!(
        rt.block_on(p.enqueue("left", "job", serde_json::json!("mine"), When::AtMs(now)))
            .unwrap(),
        "an envelope with no queue entry blocked the enqueue"
    );
    assert!(
        rt.block_on(p.requeue("late")).unwrap(),
        "the dead letter was not requeued"
    );
    let payloads: Arc<Mutex<Vec<(String, serde_json::Value)>>> = Arc::default();
    let handlers = {
        let payloads = payloads.clone();
        Handlers::new().on("job", move |task| {
            payloads
                .lock()
                .push((task.id.clone(), task.payload.clone()));
            Ok(())
        })
    };
    let c = Consumer::start(cfg, handlers).unwrap();
    wait_until("both tasks to fire", || payloads.lock().len() == 2);
    let mut seen = payloads.lock().clone();
    seen.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        seen,
        [
            ("late".to_string(), serde_json::Value::Null),
            ("left".to_string(), serde_json::json!("mine"))
        ]
    );
    assert!(rt.block_on(p.dead_letters(10)).unwrap().is_empty());

    // An envelope written first, its queue entry after the reaper has seen it alone: kept.
    // One that stays alone: removed after the grace period.
    redis::pipe()
        .hset("{orphan}:tasks", "first", envelope("first", now))
        .hset("{orphan}:tasks", "stray", envelope("stray", now))
        .query::<()>(&mut conn)
        .unwrap();
    wait_until("the reaper to see both alone", || {
        let seen: Vec<bool> = redis::pipe()
            .hexists("{orphan}:unpaired", "first")
            .hexists("{orphan}:unpaired", "stray")
            .query(&mut conn)
            .unwrap();
        seen == [true, true]
    });
    redis::cmd("ZADD")
        .arg("{orphan}:due")
        .arg(now)
        .arg("first")
        .query::<()>(&mut conn)
        .unwrap();
    wait_until("the stray envelope removed", || {
        !redis::cmd("HEXISTS")
            .arg("{orphan}:tasks")
            .arg("stray")
            .query::<bool>(&mut conn)
            .unwrap()
    });
    wait_until("the task written envelope first to fire", || {
        payloads.lock().iter().any(|(id, _)| id == "first")
    });
    wait_until("the acks", || c.stats().acked == 3);
    let (stored, tracked): (u32, u32) = redis::pipe()
        .hlen("{orphan}:tasks")
        .hlen("{orphan}:unpaired")
        .query(&mut conn)
        .unwrap();
    assert_eq!((stored, tracked), (0, 0));
    c.shutdown(Duration::from_secs(5)).unwrap();
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

/// A `{ns}:dead` key of the wrong type, with an id whose envelope never came (its grace
/// period long over), stops no claim: the good tasks are all claimed and fire, the claim
/// reports the key (an error log and `delaywheel_queue_wrong_type_total`), and the id stays
/// queued. (The claim's dead-lettering failed the whole script: 0 of 50 tasks handled.)
/// The only test of this binary that reads the metrics recorder, which is process-global.
#[test]
fn a_wrong_typed_dead_key_beside_an_id_with_no_envelope_blocks_no_claim() {
    let metrics = DebuggingRecorder::new();
    let snapshotter = metrics.snapshotter();
    metrics.install().expect("the only recorder of this binary");
    let Fixture { server, rt, cfg, p } = fixture("wrongdead", |_| {});
    let fired: Fired = Arc::default();
    // Started first: `Consumer::start` refuses a namespace with a key of the wrong type.
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    let mut conn = admin(&server);
    redis::pipe()
        .atomic()
        .set("{wrongdead}:dead", "not a hash")
        // First in every claim (the lowest score), seen without an envelope long ago.
        .zadd("{wrongdead}:due", "bare", 0)
        .hset("{wrongdead}:unpaired", "bare", 0)
        .query::<()>(&mut conn)
        .unwrap();
    let n = 50;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..n).map(|i| (format!("t{i}"), now_ms())).collect(),
    );
    wait_until("all 50 tasks to fire", || fired.lock().len() == n);
    wait_until("their acks", || c.stats().acked == n as u64);
    let mut reported = 0;
    wait_until("the wrong-typed key reported", || {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let named = key
                .key()
                .labels()
                .any(|l| l.key() == "key" && l.value() == "{wrongdead}:dead");
            if key.key().name() == "delaywheel_queue_wrong_type_total" && named {
                if let DebugValue::Counter(n) = value {
                    reported += n;
                }
            }
        }
        reported > 0
    });
    // The entry stays where it was, and so does the key.
    let (score, kind): (Option<f64>, String) = redis::pipe()
        .zscore("{wrongdead}:due", "bare")
        .cmd("TYPE")
        .arg("{wrongdead}:dead")
        .query(&mut conn)
        .unwrap();
    assert_eq!((score, kind.as_str()), (Some(0.0), "string"));
    assert_eq!(c.stats().dead_lettered, 0);
    c.shutdown(Duration::from_secs(5)).unwrap();
}
