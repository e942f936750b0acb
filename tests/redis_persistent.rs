//! Write-behind persistence against a private `redis-server`: restart, coalescing, Redis down
//! with a bounded journal, WriteThrough, restore of broken entries, snapshots, the overdue
//! policy, the dedup markers, and a namespace on a Redis Cluster.
#![cfg(feature = "redis")]

#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Begin, Dedup, DedupError, Durability, EnvelopeError, Overdue, PersistConfig,
    PersistError, Persistent, WallClock, WhenFull,
};
use delaywheel::ManualClock;
use redis_cluster::RedisCluster;
use redis_server::RedisServer;

const PATIENCE: Duration = Duration::from_secs(30);

fn config(server: &RedisServer, ns: &str) -> PersistConfig {
    PersistConfig::new(server.url(), ns)
}

fn redis_int(server: &RedisServer, args: &[&str]) -> i64 {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut conn).unwrap()
}

fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap();
    info.lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
        .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// On manual clocks: the tasks fire exactly at their due millisecond after the restart.
#[test]
fn tasks_survive_a_restart_and_fire_once_each_at_their_due_tick() {
    let server = RedisServer::start();
    let n = 100_000u64;
    let start = now_ms();
    {
        let clock = ManualClock::new();
        let mut cfg = config(&server, "restart");
        cfg.clock = WallClock::manual(&clock, start);
        let (first, _fired) = Persistent::start(cfg).unwrap();
        for i in 0..n {
            let due = start + 1 + i % 1_000; // 100 tasks per millisecond for one second
            first
                .schedule_at_ms(
                    format!("order:{i}"),
                    "order.close",
                    serde_json::json!({ "i": i }),
                    due,
                )
                .unwrap();
        }
        first.shutdown(); // graceful: flushes, leaves everything in Redis
    }
    assert_eq!(redis_int(&server, &["ZCARD", "{restart}:due"]), n as i64);

    // A new process, its clock where the first one stopped.
    let clock = ManualClock::new();
    let mut cfg = config(&server, "restart");
    cfg.clock = WallClock::manual(&clock, start);
    let (second, fired) = Persistent::start(cfg).unwrap();
    let report = second.restore(1_000).unwrap();
    assert_eq!(
        (report.loaded, report.overdue, report.dead_lettered),
        (n as usize, 0, 0)
    );
    let mut seen = HashSet::new();
    for t in 1..=1_000u64 {
        assert!(
            fired.try_recv().is_err(),
            "a task fired before its due time"
        );
        clock.advance(Duration::from_millis(1));
        let now = start + t;
        for _ in 0..n / 1_000 {
            let task = fired.recv_timeout(PATIENCE).unwrap_or_else(|e| {
                panic!(
                    "a task due at +{t} ms did not fire ({e}); {} fired",
                    seen.len()
                )
            });
            assert_eq!(task.due_at, now, "{} fired at another tick", task.id);
            assert!(seen.insert(task.id.clone()), "{} fired twice", task.id);
            assert!(second.ack(&task));
        }
    }
    assert_eq!(seen.len(), n as usize);
    clock.advance(Duration::from_millis(100));
    assert!(fired.recv_timeout(Duration::from_millis(200)).is_err());
    assert!(second.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{restart}:due"]), 0);
    assert_eq!(redis_int(&server, &["HLEN", "{restart}:tasks"]), 0);
}

#[test]
fn scheduled_and_cancelled_within_a_window_costs_no_redis_command() {
    let server = RedisServer::start();
    let mut cfg = config(&server, "coalesce");
    // Rounds only when asked for: one between a schedule and its cancel would write it.
    cfg.flush_interval = Duration::from_secs(3_600);
    let (p, _fired) = Persistent::start(cfg).unwrap();
    // Before a restore completes, a cancel writes its removal (Redis may hold an older
    // version of the id); after it, a task Redis never had costs nothing.
    p.restore(100).unwrap();
    assert!(p.flush(PATIENCE));
    let (zadd, zrem) = (
        command_calls(&server, "zadd"),
        command_calls(&server, "zrem"),
    );
    for i in 0..1_000 {
        p.schedule_at_ms(
            format!("req:{i}"),
            "timeout",
            serde_json::Value::Null,
            now_ms() + 60_000,
        )
        .unwrap();
        assert!(p.cancel(&format!("req:{i}")));
    }
    assert_eq!(p.journal_depth(), 0);
    assert!(p.flush(PATIENCE));
    assert_eq!(command_calls(&server, "zadd"), zadd);
    assert_eq!(command_calls(&server, "zrem"), zrem);
    // A task that did reach Redis costs one ZREM when cancelled.
    p.schedule_at_ms("kept", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(p.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{coalesce}:due"]), 1);
    // The counters do count this flusher's commands: one ZADD for the write, one ZREM for
    // the cancel.
    assert_eq!(command_calls(&server, "zadd"), zadd + 1);
    assert!(p.cancel("kept"));
    assert!(p.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{coalesce}:due"]), 0);
    assert_eq!(command_calls(&server, "zrem"), zrem + 1);
}

#[test]
fn redis_down_bound_exceeded_refuses_and_the_flusher_catches_up() {
    let mut server = RedisServer::start();
    let mut cfg = config(&server, "down");
    cfg.journal_bound = 50;
    cfg.when_full = WhenFull::Error;
    let (p, fired) = Persistent::start(cfg).unwrap();
    server.kill();
    // 49 tasks an hour away and one due now fill the journal to its bound of 50.
    for i in 0..49 {
        p.schedule_at_ms(
            format!("t{i}"),
            "t",
            serde_json::Value::Null,
            now_ms() + 60_000,
        )
        .unwrap();
    }
    p.schedule_at_ms("now", "t", serde_json::Value::Null, now_ms())
        .unwrap();
    match p.schedule_at_ms("t50", "t", serde_json::json!("handed back"), now_ms()) {
        Err(PersistError::JournalFull(envelope)) => {
            assert_eq!(
                (envelope.id.as_str(), &envelope.payload),
                ("t50", &serde_json::json!("handed back"))
            );
        }
        other => panic!("expected JournalFull, got {other:?}"),
    }
    // The engine keeps firing in memory while Redis is down.
    assert_eq!(fired.recv_timeout(PATIENCE).unwrap().id, "now");
    server.restart();
    let start = Instant::now();
    while p.journal_depth() > 0 {
        assert!(start.elapsed() < PATIENCE, "the flusher did not catch up");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(p.flush(PATIENCE));
    // t0..t48 and "now" (fired, not acknowledged) are in Redis.
    assert_eq!(redis_int(&server, &["ZCARD", "{down}:due"]), 50);
}

/// A Redis at `maxmemory` (policy `noeviction`) refuses every batch with a ZADD or HSET in it,
/// and takes removals, which free its memory: cancels reach it, in the round that also carries
/// refused writes and in the probes after it, instead of waiting behind writes that cannot
/// land. (Rounds wrote their upserts first and stopped at the first refusal, and probes took
/// any batch of the journal: cancels stayed unwritten for as long as Redis was full.)
#[test]
fn cancels_reach_a_redis_at_maxmemory_that_refuses_writes() {
    let server = RedisServer::start_in_memory();
    let mut cfg = config(&server, "full");
    cfg.batch = 20;
    let (p, _fired) = Persistent::start(cfg).unwrap();
    let later = now_ms() + 3_600_000;
    for i in 0..300 {
        p.schedule_at_ms(format!("old{i}"), "t", serde_json::Value::Null, later)
            .unwrap();
    }
    assert!(p.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{full}:due"]), 300);
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let set_maxmemory = |conn: &mut redis::Connection, bytes: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction")
            .arg("maxmemory")
            .arg(bytes)
            .query::<()>(conn)
            .unwrap();
    };
    set_maxmemory(&mut conn, "1");
    // One round: 200 writes Redis refuses, 30 cancels it takes.
    for i in 0..200 {
        p.schedule_at_ms(format!("new{i}"), "t", serde_json::Value::Null, later)
            .unwrap();
    }
    for i in 0..30 {
        assert!(p.cancel(&format!("old{i}")));
    }
    assert!(
        !p.flush(Duration::from_millis(300)),
        "Redis took writes at maxmemory"
    );
    let wait_for = |n: i64, what: &str| {
        let start = Instant::now();
        while redis_int(&server, &["ZCARD", "{full}:due"]) != n {
            assert!(start.elapsed() < PATIENCE, "{what} did not reach Redis");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for(270, "the cancels of the refused round");
    // Cancels made while the flusher only probes (one batch per try).
    for i in 30..60 {
        assert!(p.cancel(&format!("old{i}")));
    }
    wait_for(240, "the cancels made while Redis is full");
    set_maxmemory(&mut conn, "0");
    assert!(p.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{full}:due"]), 440);
    assert_eq!(redis_int(&server, &["HLEN", "{full}:tasks"]), 440);
}

/// A rolling deploy: the new process's engine starts while the old one runs. Its `start` waits
/// for the old engine's `shutdown` (which gives the writer lease up), so its restore reads what
/// the old one wrote last, also a task scheduled after the new one began to wait. (Both used to
/// run at once: the new restore read Redis before that task was written, and it fired nowhere.)
#[test]
fn a_new_engine_waits_for_the_old_ones_shutdown_and_restores_its_last_tasks() {
    let server = RedisServer::start_in_memory();
    let cfg = config(&server, "deploy");
    let (old, _old_fired) = Persistent::start(cfg.clone()).unwrap();
    let later = now_ms() + 3_600_000;
    old.schedule_at_ms("early", "t", serde_json::Value::Null, later)
        .unwrap();
    let (started_tx, started) = crossbeam_channel::bounded(1);
    let begun = Instant::now();
    let new = std::thread::spawn(move || {
        let (new, fired) = Persistent::start(cfg).unwrap();
        started_tx.send(begun.elapsed()).unwrap();
        (new, fired)
    });
    // The new engine is waiting (for up to `takeover_wait`, 30 s) while the old one works on.
    assert!(
        started.recv_timeout(Duration::from_millis(500)).is_err(),
        "the new engine started beside the old one"
    );
    old.schedule_at_ms("last", "t", serde_json::Value::Null, later)
        .unwrap();
    assert!(old.shutdown().is_empty());
    let waited = started.recv_timeout(PATIENCE).unwrap();
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    let (new, _fired) = new.join().unwrap();
    assert_eq!(new.restore(100).unwrap().loaded, 2);
    assert!(new.contains("early") && new.contains("last"));
    new.shutdown();
}

/// An engine that never gives the lease up (a process still running): `start` fails after
/// `takeover_wait`, naming it. A lease left by a crashed process expires, and `start` takes it
/// then.
#[test]
fn start_waits_for_a_held_lease_at_most_takeover_wait() {
    let server = RedisServer::start_in_memory();
    let mut cfg = config(&server, "held");
    cfg.takeover_wait = Duration::from_millis(300);
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let hold = |conn: &mut redis::Connection, ms: u64| {
        redis::cmd("SET")
            .arg("{held}:engine")
            .arg("other-engine")
            .arg("PX")
            .arg(ms)
            .query::<()>(conn)
            .unwrap();
    };
    hold(&mut conn, 60_000);
    let begun = Instant::now();
    match Persistent::start(cfg.clone()) {
        Err(PersistError::EngineRunning(holder)) => assert_eq!(holder, "other-engine"),
        other => panic!("expected EngineRunning, got {other:?}"),
    }
    assert!(begun.elapsed() >= Duration::from_millis(300));
    // A crashed holder's lease, 700 ms left: waited out, then taken.
    hold(&mut conn, 700);
    cfg.takeover_wait = PATIENCE;
    let begun = Instant::now();
    let (p, _fired) = Persistent::start(cfg).unwrap();
    assert!(begun.elapsed() >= Duration::from_millis(500));
    let holder: String = redis::cmd("GET")
        .arg("{held}:engine")
        .query(&mut conn)
        .unwrap();
    assert_ne!(holder, "other-engine");
    p.shutdown();
    let gone: Option<String> = redis::cmd("GET")
        .arg("{held}:engine")
        .query(&mut conn)
        .unwrap();
    assert_eq!(gone, None, "shutdown did not give the lease up");
}

/// An engine whose lease another engine took (it could not renew it in time) writes nothing
/// again, and refuses to restore: the other may have written since. Its unwritten tasks come
/// back from `shutdown`. Redis refuses a write sent without the lease, too.
#[test]
fn an_engine_that_lost_its_lease_writes_nothing_again() {
    let server = RedisServer::start_in_memory();
    let mut cfg = config(&server, "fenced");
    cfg.engine_lease = Duration::from_secs(1);
    let (p, _fired) = Persistent::start(cfg).unwrap();
    let later = now_ms() + 3_600_000;
    p.schedule_at_ms("before", "t", serde_json::Value::Null, later)
        .unwrap();
    assert!(p.flush(PATIENCE));
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    redis::cmd("SET")
        .arg("{fenced}:engine")
        .arg("intruder")
        .query::<()>(&mut conn)
        .unwrap();
    // Its next renewal (every 333 ms) finds the intruder.
    let start = Instant::now();
    loop {
        match p.restore(10) {
            Err(PersistError::EngineRunning(holder)) => {
                assert_eq!(holder, "intruder");
                break;
            }
            other => {
                assert!(start.elapsed() < PATIENCE, "lease loss not seen: {other:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    // A task it would never write is refused, and handed back, not taken with an `Ok`.
    match p.schedule_at_ms("after", "t", serde_json::Value::Null, later) {
        Err(PersistError::LeaseLost(holder, envelope)) => {
            assert_eq!(
                (holder.as_str(), envelope.id.as_str()),
                ("intruder", "after")
            );
        }
        other => panic!("a schedule after the lease was lost: {other:?}"),
    }
    assert!(!p.is_writing());
    p.cancel("before");
    assert!(
        !p.flush(Duration::from_millis(300)),
        "wrote without the lease"
    );
    // Not even once the intruder is gone: it may have written meanwhile.
    redis_int(&server, &["DEL", "{fenced}:engine"]);
    assert!(
        !p.flush(Duration::from_millis(500)),
        "wrote after losing the lease"
    );
    assert_eq!(
        redis_int(&server, &["HEXISTS", "{fenced}:tasks", "before"]),
        1,
        "the cancel was written without the lease"
    );
    assert!(p.shutdown().is_empty());
}

/// A lease that lapsed with nobody taking it (Redis slow, say) is taken back and writing
/// resumes; one that another engine took and gave up meanwhile (the record of takes names
/// it) is not: that engine may have written, and the lease stays free for others. And Redis
/// itself refuses the removals of an engine that does not hold the lease, whatever the engine
/// believes.
#[test]
fn a_lapsed_lease_is_taken_back_unless_another_engine_held_it_meanwhile() {
    let server = RedisServer::start_in_memory();
    let mut cfg = config(&server, "lapse");
    cfg.engine_lease = Duration::from_secs(1);
    let (p, _fired) = Persistent::start(cfg.clone()).unwrap();
    let later = now_ms() + 3_600_000;
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let takes = |conn: &mut redis::Connection| -> String {
        redis::cmd("GET")
            .arg("{lapse}:engine:takes")
            .query(conn)
            .unwrap()
    };
    let first = takes(&mut conn);
    assert!(first.starts_with("1 "), "{first}");
    // Lapsed, nobody took it: taken back, the second take on record.
    redis_int(&server, &["DEL", "{lapse}:engine"]);
    let start = Instant::now();
    while !takes(&mut conn).starts_with("2 ") {
        assert!(start.elapsed() < PATIENCE, "the lease was not taken back");
        std::thread::sleep(Duration::from_millis(10));
    }
    p.schedule_at_ms("resumed", "t", serde_json::Value::Null, later)
        .unwrap();
    assert!(p.flush(PATIENCE));
    assert_eq!(
        redis_int(&server, &["HEXISTS", "{lapse}:tasks", "resumed"]),
        1
    );
    // Lapsed, and another engine took it and gave it up in between (one atomic step, so
    // before the next renewal): the engine stops, and leaves the lease free.
    redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg("{lapse}:engine")
        .cmd("SET")
        .arg("{lapse}:engine:takes")
        .arg("3 other-engine")
        .query::<()>(&mut conn)
        .unwrap();
    let start = Instant::now();
    loop {
        match p.restore(10) {
            Err(PersistError::EngineRunning(other)) => {
                assert_eq!(other, "other-engine");
                break;
            }
            _ => {
                assert!(start.elapsed() < PATIENCE, "the lost lease was not noticed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    assert!(matches!(
        p.schedule_at_ms("stale", "t", serde_json::Value::Null, later),
        Err(PersistError::LeaseLost(..))
    ));
    p.cancel("resumed");
    assert!(!p.flush(Duration::from_millis(300)));
    assert_eq!(
        redis_int(&server, &["HEXISTS", "{lapse}:tasks", "resumed"]),
        1,
        "the cancel was written after the lease was lost"
    );
    assert_eq!(
        redis_int(&server, &["EXISTS", "{lapse}:engine"]),
        0,
        "took it anyway"
    );
    p.shutdown();

    // The store's own check: a store that took the lease for one engine refuses its removals
    // once the lease is another's.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = delaywheel::redis::RedisStore::connect(
            &server.url(),
            delaywheel::redis::KeyLayout::new("lapse2").unwrap(),
        )
        .await
        .unwrap();
        let op = || delaywheel::redis::Op::Remove("x".into());
        assert_eq!(
            store
                .lease("me", Duration::from_secs(60), true)
                .await
                .unwrap(),
            delaywheel::redis::Lease::Held
        );
        store.apply(&[op()]).await.unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("SET")
            .arg("{lapse2}:engine")
            .arg("other")
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
        let refused = store.apply(&[op()]).await.unwrap_err();
        assert!(refused.to_string().contains("NOTHELD"), "{refused}");
    });
}

#[test]
fn write_through_returns_once_redis_has_the_task() {
    let server = RedisServer::start();
    let mut cfg = config(&server, "wt");
    cfg.durability = Durability::WriteThrough;
    cfg.flush_interval = Duration::from_millis(20);
    let (p, _fired) = Persistent::start(cfg).unwrap();
    for i in 0..20 {
        let id = format!("pay:{i}");
        p.schedule_at_ms(
            id.clone(),
            "payment.expire",
            serde_json::Value::Null,
            now_ms() + 60_000,
        )
        .unwrap();
        assert_eq!(
            redis_int(&server, &["ZCARD", "{wt}:due"]),
            i + 1,
            "{id} not yet in Redis"
        );
    }
}

#[test]
fn restore_dead_letters_broken_entries_and_loads_the_rest() {
    let server = RedisServer::start();
    let (p, _fired) = Persistent::start(config(&server, "junk")).unwrap();
    p.schedule_at_ms("ok", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(p.flush(PATIENCE));
    drop(p);
    redis_int(&server, &["ZADD", "{junk}:due", "5", "orphan"]);
    redis_int(&server, &["ZADD", "{junk}:due", "5", "bad"]);
    redis_int(&server, &["HSET", "{junk}:tasks", "bad", "\u{1}garbage"]);
    // A member that is not UTF-8, which only another client writes: it used to fail the
    // whole scan, so every restore failed and nothing after its page loaded.
    let (not_utf8, raw): (&[u8], &[u8]) = (b"\xff\xfe", b"\xc3(");
    {
        let mut conn = redis::Client::open(server.url())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("ZADD")
            .arg("{junk}:due")
            .arg(5)
            .arg(not_utf8)
            .query::<()>(&mut conn)
            .unwrap();
        redis::cmd("HSET")
            .arg("{junk}:tasks")
            .arg(not_utf8)
            .arg(raw)
            .query::<()>(&mut conn)
            .unwrap();
    }
    let (p, _fired) = Persistent::start(config(&server, "junk")).unwrap();
    let report = p.restore(10).unwrap();
    assert_eq!((report.loaded, report.dead_lettered), (1, 3));
    assert_eq!(redis_int(&server, &["HLEN", "{junk}:dead"]), 3);
    assert_eq!(redis_int(&server, &["ZCARD", "{junk}:due"]), 1);
    assert_eq!(redis_int(&server, &["HLEN", "{junk}:tasks"]), 1);
    assert_eq!(p.len(), 1);
    // Set aside under its own bytes, with the envelope's bytes kept whole (as hex).
    let record: String = {
        let mut conn = redis::Client::open(server.url())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("HGET")
            .arg("{junk}:dead")
            .arg(not_utf8)
            .query(&mut conn)
            .unwrap()
    };
    let record: serde_json::Value = serde_json::from_str(&record).unwrap();
    assert_eq!(record["raw_hex"], "c328");
    assert!(record["reason"].as_str().unwrap().contains("UTF-8"));
    drop(p);
    let (p, _fired) = Persistent::start(config(&server, "junk")).unwrap();
    let report = p.restore(10).unwrap();
    assert_eq!((report.loaded, report.dead_lettered), (1, 0));
}

#[test]
fn oversized_payloads_are_refused_with_the_envelope() {
    let server = RedisServer::start();
    let mut cfg = config(&server, "big");
    cfg.max_envelope = 256;
    let (p, _fired) = Persistent::start(cfg).unwrap();
    let big = serde_json::json!("x".repeat(1_000));
    match p.schedule_at_ms("big", "t", big.clone(), now_ms()) {
        Err(PersistError::Envelope(_, envelope)) => assert_eq!(envelope.payload, big),
        other => panic!("expected an envelope error, got {other:?}"),
    }
    // A payload nested deeper than decoding reads back: refused, not stored to be lost.
    let deep = (0..=delaywheel::redis::MAX_PAYLOAD_DEPTH)
        .fold(serde_json::json!(1), |v, _| serde_json::json!([v]));
    match p.schedule_at_ms("deep", "t", deep.clone(), now_ms()) {
        Err(PersistError::Envelope(EnvelopeError::TooDeep { .. }, envelope)) => {
            assert_eq!(envelope.payload, deep)
        }
        other => panic!("expected a nesting error, got {other:?}"),
    }
    assert!(p.is_empty());
}

/// A page size past what Redis takes as a COUNT (`usize::MAX`, meant as "all at once") is
/// capped, not sent: the restore works (it failed with Redis's "out of range").
#[test]
fn restore_with_a_huge_page_size_works() {
    let server = RedisServer::start();
    {
        let (p, _fired) = Persistent::start(config(&server, "huge_page")).unwrap();
        for i in 0..300 {
            p.schedule_at_ms(
                format!("t{i}"),
                "t",
                serde_json::Value::Null,
                now_ms() + 3_600_000,
            )
            .unwrap();
        }
        assert!(p.flush(PATIENCE));
    }
    let (p, _fired) = Persistent::start(config(&server, "huge_page")).unwrap();
    let report = p.restore(usize::MAX).unwrap();
    assert_eq!(report.loaded, 300);
}

#[test]
fn snapshot_makes_redis_match_memory_exactly_and_retries_while_redis_is_down() {
    let mut server = RedisServer::start();
    let (p, _fired) = Persistent::start(config(&server, "snap")).unwrap();
    p.restore(100).unwrap(); // snapshots need a completed restore
    let mut expected = HashSet::new();
    for i in 0..2_000 {
        let id = format!("o{i}");
        p.schedule_at_ms(id.clone(), "t", serde_json::json!(i), now_ms() + 3_600_000)
            .unwrap();
        expected.insert(id);
    }
    assert!(p.flush(PATIENCE));
    // Drift between Redis and memory: a stray entry another writer left behind.
    redis_int(&server, &["ZADD", "{snap}:due", "5", "ghost"]);
    redis_int(&server, &["HSET", "{snap}:tasks", "ghost", "{}"]);
    assert_eq!(p.snapshot(PATIENCE), Some(2_000));
    assert_eq!(server.zset_members("{snap}:due"), expected);
    assert_eq!(redis_int(&server, &["HLEN", "{snap}:tasks"]), 2_000);
    // The scratch keys expire if a snapshot never swaps them in; the swapped-in set does not.
    assert_eq!(redis_int(&server, &["PTTL", "{snap}:due"]), -1);
    assert_eq!(redis_int(&server, &["PTTL", "{snap}:tasks"]), -1);

    // With Redis down the snapshot does not complete, and the flusher keeps at it.
    server.kill();
    for i in 0..500 {
        let id = format!("o{i}");
        assert!(p.cancel(&id));
        expected.remove(&id);
    }
    assert_eq!(p.snapshot(Duration::from_millis(300)), None);
    server.restart();
    assert!(p.flush(PATIENCE));
    assert_eq!(server.zset_members("{snap}:due"), expected);
    assert_eq!(redis_int(&server, &["HLEN", "{snap}:tasks"]), 1_500);
}

#[test]
fn restore_fires_overdue_tasks_no_faster_than_the_rate_limit() {
    let server = RedisServer::start();
    let n = 300u64;
    {
        // Written straight into Redis: a backlog that fell due while no process held it.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let keys = delaywheel::redis::KeyLayout::new("late").unwrap();
        let store = rt
            .block_on(delaywheel::redis::RedisStore::connect(&server.url(), keys))
            .unwrap();
        let past = now_ms() - 60_000;
        let ops: Vec<_> = (0..n)
            .map(|i| {
                let e = delaywheel::redis::Envelope {
                    id: format!("late{i}"),
                    topic: "t".into(),
                    payload: serde_json::Value::Null,
                    attempt: 0,
                    created_at: past,
                    headers: Default::default(),
                    due_at: past + i,
                };
                delaywheel::redis::Op::Upsert {
                    id: e.id.clone(),
                    due_at: e.due_at,
                    envelope: e.encode(1 << 20).unwrap(),
                }
            })
            .collect();
        rt.block_on(store.apply(&ops)).unwrap();
    }
    let mut cfg = config(&server, "late");
    cfg.overdue = Overdue::RateLimited {
        per_second: NonZeroU32::new(1_000).unwrap(),
    };
    let (p, fired) = Persistent::start(cfg).unwrap();
    let t0 = Instant::now();
    let report = p.restore(100).unwrap();
    assert_eq!((report.loaded, report.overdue), (n as usize, n as usize));
    let mut arrivals = Vec::new();
    for _ in 0..n {
        fired
            .recv_timeout(PATIENCE)
            .expect("an overdue task never fired");
        arrivals.push(t0.elapsed());
    }
    // At 1 000/s the k-th overdue task waits k ms: by time k ms at most k have fired.
    for (k, at) in arrivals.iter().enumerate() {
        assert!(
            *at >= Duration::from_millis(k as u64),
            "overdue task #{k} fired at {at:?}, faster than 1 000/s"
        );
    }
}

#[test]
fn dedup_markers_run_a_task_once_and_recover_from_a_crashed_handler() {
    // No fsync: the lease below must not lapse between two calls on a slow disk.
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Long enough that calls in a row never see it lapse on a loaded machine.
        let dedup = Dedup::connect(
            &server.url(),
            "orders",
            // Long enough that no step below outlasts it on a loaded machine.
            Duration::from_millis(3_000),
            Duration::from_secs(3_600),
        )
        .await
        .unwrap();
        let run = |b: Begin| match b {
            Begin::Run(claim) => claim,
            other => panic!("expected Run, got {other:?}"),
        };
        let o1 = run(dedup.begin("o1").await.unwrap());
        assert_eq!(o1.id(), "o1");
        assert_eq!(dedup.begin("o1").await.unwrap(), Begin::InProgress);
        dedup.finish(&o1).await.unwrap();
        // "Forever" is a duration Redis takes (a wrapped or past-range expiry is refused, or
        // lapses at once and lets a duplicate run).
        let forever = Dedup::connect(&server.url(), "orders", Duration::MAX, Duration::MAX)
            .await
            .unwrap();
        let f1 = run(forever.begin("f1").await.unwrap());
        forever.finish(&f1).await.unwrap();
        assert_eq!(forever.begin("f1").await.unwrap(), Begin::AlreadyDone);
        assert_eq!(dedup.begin("o1").await.unwrap(), Begin::AlreadyDone);
        // A failed attempt gives the task back at once; `abandon` never undoes `done`.
        let o2 = run(dedup.begin("o2").await.unwrap());
        assert!(dedup.abandon(&o2).await.unwrap());
        run(dedup.begin("o2").await.unwrap());
        assert!(!dedup.abandon(&o1).await.unwrap());
        assert_eq!(dedup.begin("o1").await.unwrap(), Begin::AlreadyDone);
        // A handler that crashed holding the marker: the lease lapses and the task runs again.
        let o3 = run(dedup.begin("o3").await.unwrap());
        tokio::time::sleep(Duration::from_millis(3_100)).await;
        let o3_again = run(dedup.begin("o3").await.unwrap());
        // The first delivery was only slow, not dead: its abandon must not drop the marker of
        // the delivery that took over, or a third would run beside the second.
        assert!(!dedup.abandon(&o3).await.unwrap());
        assert_eq!(dedup.begin("o3").await.unwrap(), Begin::InProgress);
        assert!(dedup.abandon(&o3_again).await.unwrap());
        assert!(matches!(
            Dedup::connect(&server.url(), "a{b", Duration::ZERO, Duration::ZERO).await,
            Err(DedupError::Namespace(_))
        ));
    });
    assert!(redis_int(&server, &["PTTL", "{orders}:done:o1"]) > 3_000_000);
}

#[test]
fn acl_users_and_passwords_work_through_the_url() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut admin = client.get_connection().unwrap();
    for (user, keys) in [("app", "~{acl}:*"), ("other", "~{elsewhere}:*")] {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg("on")
            .arg(">s3cret")
            .arg(keys)
            .arg("+@all")
            .query::<()>(&mut admin)
            .unwrap();
    }
    let as_user = |user: &str, pass: &str| format!("{}?user={user}&pass={pass}", server.url());

    let (p, _fired) =
        Persistent::start(PersistConfig::new(as_user("app", "s3cret"), "acl")).unwrap();
    p.schedule_at_ms("t1", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(p.flush(PATIENCE));
    assert_eq!(redis_int(&server, &["ZCARD", "{acl}:due"]), 1);

    match Persistent::start(PersistConfig::new(as_user("app", "wrong"), "acl")) {
        Err(PersistError::Store(e)) => {
            assert!(
                e.to_string().to_lowercase().contains("authentication"),
                "{e}"
            )
        }
        other => panic!("expected an authentication error, got {other:?}"),
    }
    // A user the ACL keeps off these keys: the engine runs, the writes are refused and held.
    let (p, _fired) =
        Persistent::start(PersistConfig::new(as_user("other", "s3cret"), "acl")).unwrap();
    p.schedule_at_ms("t2", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(!p.flush(Duration::from_millis(300)));
    assert_eq!(p.journal_depth(), 1);
    assert_eq!(redis_int(&server, &["ZCARD", "{acl}:due"]), 1);
}

/// A namespace on a 3-node Redis Cluster: the flusher's MULTI batches, the snapshot's scratch
/// keys and RENAMEs, and the restore's ZSCAN + HMGET pages all go to the node that owns the
/// namespace's slot, and a restarted engine fires what the first one left.
#[test]
fn tasks_persist_and_restore_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let mut cfg = PersistConfig::new("redis://not-used.invalid/", "clustered");
    cfg.cluster_nodes = urls.clone();
    let (n, soon) = (2_000u64, 10u64);
    let far = now_ms() + 3_600_000;
    let due_soon = now_ms() + 2_000;
    let mut expected = HashSet::new();
    {
        let (engine, _fired) = Persistent::start(cfg.clone()).unwrap();
        engine.restore(1_000).unwrap(); // snapshots need a completed restore
        for i in 0..n {
            let payload = serde_json::json!({ "i": i });
            engine
                .schedule_at_ms(format!("t{i}"), "job", payload, far + i)
                .unwrap();
        }
        for i in 0..soon {
            engine
                .schedule_at_ms(format!("soon{i}"), "job", serde_json::Value::Null, due_soon)
                .unwrap();
            expected.insert(format!("soon{i}"));
        }
        assert!(engine.flush(PATIENCE), "flush to the cluster");
        for i in 0..n {
            if i % 4 == 0 {
                assert!(engine.cancel(&format!("t{i}")));
            } else {
                expected.insert(format!("t{i}"));
            }
        }
        let held = expected.len();
        assert_eq!(
            engine.snapshot(PATIENCE),
            Some(held),
            "snapshot on the cluster"
        );
        engine.shutdown();
    }
    // The cluster holds exactly the pending set, all of it on one node.
    let client = redis::cluster::ClusterClient::new(urls.clone()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let due: HashSet<String> = redis::cmd("ZRANGE")
        .arg("{clustered}:due")
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .unwrap();
    assert_eq!(due, expected);
    let tasks: u64 = redis::cmd("HLEN")
        .arg("{clustered}:tasks")
        .query(&mut conn)
        .unwrap();
    assert_eq!(tasks, expected.len() as u64);
    assert_eq!(
        cluster.nodes_with_keys(),
        1,
        "a namespace lives in one slot"
    );
    // A restart loads them from the cluster and fires the ones due soon.
    let (engine, fired) = Persistent::start(cfg).unwrap();
    let report = engine.restore(500).unwrap();
    assert_eq!(report.loaded, expected.len());
    let mut got = HashSet::new();
    while got.len() < soon as usize {
        let task = fired.recv_timeout(PATIENCE).expect("restored task fired");
        assert!(task.id.starts_with("soon"), "{} fired early", task.id);
        assert!(got.insert(task.id.clone()), "{} fired twice", task.id);
        assert!(engine.ack(&task));
    }
    assert!(engine.flush(PATIENCE));
    let left: u64 = redis::cmd("ZCARD")
        .arg("{clustered}:due")
        .query(&mut conn)
        .unwrap();
    assert_eq!(
        left,
        expected.len() as u64 - soon,
        "acked tasks leave the cluster"
    );
    engine.shutdown();
    // The dedup markers work there too, in the namespace's slot.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dedup = rt
        .block_on(Dedup::connect_cluster(
            &urls,
            "clustered",
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .unwrap();
    let Begin::Run(soon0) = rt.block_on(dedup.begin("soon0")).unwrap() else {
        panic!("soon0 was not marked yet")
    };
    rt.block_on(dedup.finish(&soon0)).unwrap();
    assert_eq!(
        rt.block_on(dedup.begin("soon0")).unwrap(),
        Begin::AlreadyDone
    );
    let Begin::Run(soon1) = rt.block_on(dedup.begin("soon1")).unwrap() else {
        panic!("soon1 was not marked yet")
    };
    assert_eq!(
        rt.block_on(dedup.begin("soon1")).unwrap(),
        Begin::InProgress
    );
    assert!(rt.block_on(dedup.abandon(&soon1)).unwrap());
    assert!(matches!(
        rt.block_on(dedup.begin("soon1")).unwrap(),
        Begin::Run(_)
    ));
    assert_eq!(
        cluster.nodes_with_keys(),
        1,
        "the marker is in the namespace's slot"
    );
}

/// A namespace whose slot moves to another node (resharding) keeps being flushed: the flusher's
/// MULTI goes to the new owner. The old node refuses it whole (EXECABORT), and the cluster
/// client learned nothing from that, so the flusher sent it to the old node for ever: flushes
/// failed and the journal filled up.
#[test]
fn a_flush_follows_its_namespace_to_another_node() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let mut cfg = PersistConfig::new("redis://not-used.invalid/", "moving");
    cfg.cluster_nodes = urls.clone();
    let (engine, _fired) = Persistent::start(cfg).unwrap();
    engine.restore(1_000).unwrap();
    let far = now_ms() + 3_600_000;
    engine
        .schedule_at_ms("before", "job", serde_json::Value::Null, far)
        .unwrap();
    assert!(engine.flush(PATIENCE), "flush before the move");
    let to = cluster.move_slot_of("{moving}:due");
    engine
        .schedule_at_ms("after", "job", serde_json::Value::Null, far)
        .unwrap();
    assert!(engine.flush(PATIENCE), "flush after the move");
    let held: Vec<String> = redis::cmd("ZRANGE")
        .arg("{moving}:due")
        .arg(0)
        .arg(-1)
        .query(
            &mut redis::Client::open(urls[to].as_str())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(held, ["after", "before"]); // same score: by member
    engine.shutdown();
}
