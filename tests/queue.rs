//! The shared delay queue against a private `redis-server`: exactly-once firing over four
//! consumers, crashed and stalled consumers, retries and the dead-letter store,
//! poison tasks, graceful hand-back, sharding, a Redis Cluster. (Wake-up latency is timed in
//! `queue_wake.rs`, a binary of its own, so no other test competes for the two cores.)
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, shard_of, Backoff, Consumer, Handlers, KeyLayout, PersistConfig, PersistError,
    Persistent, Producer, QueueConfig, QueueError, RedisStore, RetryPolicy, When,
};
use parking_lot::Mutex;
use queue_kit::*;
use redis_cluster::RedisCluster;
use redis_server::RedisServer;

#[test]
fn four_consumers_fire_each_of_50k_tasks_exactly_once() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("q50k", |_| {});
    let fired: Fired = Arc::default();
    let consumers: Vec<Consumer> = (0..4)
        .map(|i| Consumer::start(cfg.clone(), recorder(&fired, i, "job")).unwrap())
        .collect();
    let n = 50_000u64;
    let base = now_ms() + 500;
    let tasks: Vec<_> = (0..n)
        .map(|i| (format!("job{i}"), base + i % 3_000))
        .collect();
    let dues: HashMap<String, u64> = tasks.iter().cloned().collect();
    enqueue_all(&rt, &p, "job", tasks);
    // Idempotent by id: enqueueing a pending id again changes nothing; cancel removes it.
    let later = When::After(Duration::from_secs(60));
    assert!(rt
        .block_on(p.enqueue("later", "job", serde_json::Value::Null, later))
        .unwrap());
    assert!(!rt
        .block_on(p.enqueue("later", "job", serde_json::json!(2), later))
        .unwrap());
    assert!(rt.block_on(p.cancel("later")).unwrap());
    assert!(!rt.block_on(p.cancel("later")).unwrap());
    wait_until("all tasks to fire", || fired.lock().len() == n as usize);
    wait_until("all acks", || {
        consumers.iter().map(|c| c.stats().acked).sum::<u64>() == n
    });
    let fired = fired.lock();
    let mut per_consumer = [0u64; 4];
    for (id, deliveries) in fired.iter() {
        assert_eq!(deliveries.len(), 1, "{id} fired {} times", deliveries.len());
        let (who, at_us) = deliveries[0];
        per_consumer[who] += 1;
        assert!(at_us >= dues[id] * 1_000, "{id} fired before its due time");
    }
    assert!(
        per_consumer.iter().filter(|&&c| c > 0).count() >= 2,
        "{per_consumer:?}"
    );
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased, depth.dead), (0, 0, 0));
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
}

#[test]
fn a_crashed_consumers_tasks_fire_elsewhere_after_the_lease() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("crash", |cfg| {
        cfg.lease = Duration::from_millis(300);
        cfg.reaper_interval = Duration::from_millis(50);
        // A claims them at its first reconcile claim (within 1 s), 4 s before they are due.
        cfg.lookahead = Duration::from_secs(30);
    });
    let fired: Fired = Arc::default();
    let a = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    // Due well after the first reconcile claim (1 s), so A holds them for a while (and loses
    // them before they are due, also on a loaded machine).
    let due = now_ms() + 5_000;
    claimed_by(&rt, &p, &a, "t", 200, due);
    a.abort(); // as a crash: nothing handed back, nothing fired
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("B to fire the crashed consumer's tasks", || {
        fired.lock().len() == 200
    });
    let stats = b.stats();
    assert_eq!(stats.recovered, 200);
    for (id, deliveries) in fired.lock().iter() {
        assert_eq!(deliveries.len(), 1, "{id}");
        assert_eq!(deliveries[0].0, 1, "{id} fired on the crashed consumer");
        // The lease ran until due + 300 ms: B could not have had it sooner.
        assert!(deliveries[0].1 >= (due + 300) * 1_000);
    }
    wait_until("B's acks", || b.stats().acked == 200);
    b.shutdown(Duration::from_secs(5)).unwrap();
}

/// A claim whose reply is lost after the script ran is retried with its nonce and answered
/// again, so its batch fires at its due time, not a lease (30 s) later. Redis loses the reply
/// here by closing the connection of a client whose reply passes its output buffer limit.
#[test]
fn a_claim_whose_reply_was_lost_fires_its_batch_on_time() {
    let Fixture { server, rt, cfg, p } = fixture("lostclaim", |_| {});
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let set_limit = |admin: &mut redis::Connection, limit: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("client-output-buffer-limit")
            .arg(limit)
            .query::<()>(admin)
            .unwrap();
    };
    // Replies past 4 KiB close the connection: a claim of the 400 tasks (about 45 KiB) does,
    // nothing else here does until the limit is lifted.
    let fired: Fired = Arc::default();
    let a = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    let connections = connections_received(&mut admin);
    set_limit(&mut admin, "normal 4096 0 0");
    // Past the lookahead (2 s): the first claim takes nothing, a reconcile claim takes them.
    let due = now_ms() + 3_500;
    let n = 400;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..n).map(|i| (format!("t{i}"), due)).collect(),
    );
    let keys = KeyLayout::new("lostclaim").unwrap();
    wait_until("a claim whose reply is lost", || {
        let leased: usize = redis::cmd("ZCARD")
            .arg(keys.lease())
            .query(&mut admin)
            .unwrap();
        leased == n && a.held() == 0
    });
    set_limit(&mut admin, "normal 0 0 0");
    wait_until("the batch to fire", || fired.lock().len() == n);
    for (id, deliveries) in fired.lock().iter() {
        assert_eq!(deliveries.len(), 1, "{id}");
        let at_ms = deliveries[0].1 / 1_000;
        assert!(at_ms >= due, "{id} fired early");
        // A lease later would be due + 30 s.
        assert!(at_ms < due + 10_000, "{id} fired {} ms late", at_ms - due);
    }
    assert_eq!(
        a.stats().recovered,
        0,
        "the batch came back through its lease"
    );
    // The consumer connected again: Redis had closed its connection (a reply was lost).
    assert!(
        connections_received(&mut admin) > connections,
        "no reply was lost"
    );
    wait_until("the acks", || a.stats().acked == n as u64);
    a.shutdown(Duration::from_secs(5)).unwrap();
}

/// Connections Redis has accepted.
fn connections_received(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .expect("INFO stats has total_connections_received")
        .trim()
        .parse()
        .unwrap()
}

/// A task id another client wrote that is not UTF-8 is dead-lettered at once under the id as
/// stored: an ack by its lossy reading would never match, and it would come back after every
/// lease.
#[test]
fn a_task_id_that_is_not_utf8_is_dead_lettered_under_its_stored_id() {
    let Fixture { server, rt, cfg, p } = fixture("bytes", |_| {});
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let id: &[u8] = b"order\xff";
    redis::pipe()
        .cmd("ZADD")
        .arg("{bytes}:due")
        .arg(now_ms())
        .arg(id)
        .cmd("HSET")
        .arg("{bytes}:tasks")
        .arg(id)
        .arg(r#"{"id":"order","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":0}"#)
        .query::<()>(&mut conn)
        .unwrap();
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "t")).unwrap();
    wait_until("the dead letter", || c.stats().dead_lettered == 1);
    assert_eq!(c.stats().refused, 0, "written under the id as stored");
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, "order\u{fffd}");
    assert_eq!(dead[0].reason, "task id is not UTF-8");
    let (queued, leased, stored): (u32, u32, u32) = redis::pipe()
        .zcard("{bytes}:due")
        .zcard("{bytes}:lease")
        .hlen("{bytes}:tasks")
        .query(&mut conn)
        .unwrap();
    assert_eq!((queued, leased, stored), (0, 0, 0));
    assert!(fired.lock().is_empty());
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A task that takes down every consumer that runs it (a crash loop) is not delivered
/// forever: after `max_lease_expiries` expired leases the reaper dead-letters it.
#[test]
fn a_task_that_crashes_its_consumers_is_dead_lettered_after_max_lease_expiries() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("crashloop", |cfg| {
        cfg.lease = Duration::from_millis(300);
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.max_lease_expiries = 2;
    });
    // Handlers that never return while the test runs: a consumer "crashes" (aborts) with the
    // task in hand.
    let (release, gate) = crossbeam_channel::unbounded::<()>();
    let (ran_tx, ran) = crossbeam_channel::unbounded::<usize>();
    let stuck = |who: usize| {
        let (gate, ran_tx) = (gate.clone(), ran_tx.clone());
        Handlers::new().on("job", move |_| {
            let _ = ran_tx.send(who);
            let _ = gate.recv();
            Ok(())
        })
    };
    enqueue_all(&rt, &p, "job", vec![("poison".into(), now_ms())]);
    let a = Consumer::start(cfg.clone(), stuck(0)).unwrap();
    assert_eq!(ran.recv_timeout(Duration::from_secs(30)), Ok(0));
    a.abort();
    // B's reaper returns it (one expiry), B runs it and crashes too.
    let b = Consumer::start(cfg.clone(), stuck(1)).unwrap();
    assert_eq!(ran.recv_timeout(Duration::from_secs(30)), Ok(1));
    assert_eq!(b.stats().recovered, 1);
    b.abort();
    // The second expiry: C's reaper dead-letters it instead of handing it to C.
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 2, "job")).unwrap();
    wait_until("the dead letter", || c.stats().dead_lettered == 1);
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, "poison");
    assert!(
        dead[0].reason.starts_with("lease expired 2 times"),
        "{}",
        dead[0].reason
    );
    // Deliveries tried: the two that never came back.
    assert_eq!(dead[0].attempt, 2);
    std::thread::sleep(Duration::from_millis(500));
    assert!(fired.lock().is_empty(), "C ran the poison task");
    assert_eq!(c.stats().recovered, 0);
    drop(release);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// The reaper loses no task whose stored state is broken: an envelope whose attempt count is
/// not a finite number (dead-lettered, though its record cannot carry that count) and an expiry
/// count that is not a number (requeued as its first expiry). (The script deleted first and
/// wrote the dead record last; Redis keeps what a failing script wrote, so both tasks were
/// left in no key at all.)
#[test]
fn the_reaper_loses_no_task_whose_stored_state_is_broken() {
    let Fixture { server, rt, cfg, p } = fixture("reapbroken", |cfg| {
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.max_lease_expiries = 2;
    });
    // "inf" on its second expiry, "garbled" with an expiry count that is not a number.
    let (keys, mut conn) = leased_by_a_crashed_consumer(
        &server,
        "reapbroken",
        [("inf".to_string(), "1e999"), ("garbled".to_string(), "0")],
    );
    redis::pipe()
        .hset(keys.expired(), "inf", "1")
        .hset(keys.expired(), "garbled", "x")
        .query::<()>(&mut conn)
        .unwrap();
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    wait_until("the broken tasks reaped", || {
        c.stats().dead_lettered == 1 && fired.lock().contains_key("garbled")
    });
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, "inf");
    assert!(dead[0].reason.starts_with("lease expired 2 times"));
    assert_eq!(dead[0].attempt, 2);
    assert!(dead[0].raw.contains("1e999"), "{}", dead[0].raw);
    wait_until("garbled's ack", || c.stats().acked == 1);
    assert!(server.zset_members(keys.lease()).is_empty());
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// Writes tasks `(id, attempt)` of topic `job` into namespace `ns` (one shard) as a claim
/// leaves them, leased to a consumer that crashed long ago: their leases ran out at 0. Returns
/// the keys and the connection.
fn leased_by_a_crashed_consumer<'a>(
    server: &RedisServer,
    ns: &str,
    tasks: impl IntoIterator<Item = (String, &'a str)>,
) -> (delaywheel::redis::KeyLayout, redis::Connection) {
    let keys = delaywheel::redis::KeyLayout::new(ns).unwrap();
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut pipe = redis::pipe();
    for (id, attempt) in tasks {
        let envelope = format!(
            r#"{{"id":"{id}","topic":"job","payload":null,"attempt":{attempt},"created_at":0,"due_at":0}}"#
        );
        pipe.zadd(keys.lease(), &id, 0)
            .ignore()
            .hset(keys.owner(), &id, "a crashed consumer")
            .ignore()
            .hset(keys.tasks(), &id, envelope)
            .ignore();
    }
    pipe.query::<()>(&mut conn).unwrap();
    (keys, conn)
}

/// One reaper round returns all of a crashed consumer's expired leases, not one script call's
/// batch (1 000) per `reaper_interval`.
#[test]
fn a_reaper_round_returns_every_expired_lease() {
    let Fixture {
        server,
        rt: _rt,
        cfg,
        p: _p,
    } = fixture("reapall", |cfg| {
        cfg.reaper_interval = Duration::from_secs(5);
    });
    let n = 2_500;
    leased_by_a_crashed_consumer(&server, "reapall", (0..n).map(|i| (format!("t{i}"), "0")));
    let fired: Fired = Arc::default();
    let start = Instant::now();
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    // The first round comes within one interval (the rounds start spread over it); three
    // rounds of 1 000 would take two intervals more (10 s at least).
    wait_until("every lease returned", || c.stats().recovered == n);
    assert!(
        start.elapsed() < Duration::from_secs(9),
        "returned after {:?}",
        start.elapsed()
    );
    wait_until("every task fired", || fired.lock().len() == n as usize);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_stalled_consumers_late_ack_is_refused_by_the_fencing_token() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("fence", |cfg| {
        cfg.lease = Duration::from_millis(200);
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.reconcile = Duration::from_millis(100);
        // The stalled consumer may claim the task again and stall again before B gets it;
        // each time its lease runs out. This test is about fencing, not that limit.
        cfg.max_lease_expiries = 0;
    });
    // A stalled consumer sends nothing, renewals included.
    let mut stalled = cfg.clone();
    stalled.renew_leases = false;
    let started = Arc::new(Mutex::new(0u32));
    let fired: Fired = Arc::default();
    let slow = {
        let (started, fired) = (started.clone(), fired.clone());
        Handlers::new().on("pay", move |_| {
            *started.lock() += 1;
            // Stalls past its lease: until B has taken the task over and fired it (however
            // long a loaded machine takes for that), then acks late.
            let start = std::time::Instant::now();
            while fired.lock().is_empty() && start.elapsed() < PATIENCE {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        })
    };
    let a = Consumer::start(stalled, slow).unwrap();
    enqueue_all(&rt, &p, "pay", vec![("p1".into(), now_ms())]);
    wait_until("A's handler to start", || *started.lock() == 1);
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "pay")).unwrap();
    wait_until("B to take the expired lease over", || {
        fired.lock().len() == 1
    });
    wait_until("B's ack", || b.stats().acked == 1);
    // At least one: A may have claimed the task again meanwhile, and that copy's ack, sent
    // once its handler thread is free, is refused too.
    wait_until("A's refused ack", || a.stats().refused >= 1);
    assert_eq!(a.stats().acked, 0);
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    a.shutdown(Duration::from_secs(5)).unwrap();
    b.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn failures_follow_the_backoff_then_dead_letter_and_requeue_works() {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(server.url(), "retry");
    let unit = Duration::from_millis(50);
    cfg.retry = RetryPolicy {
        max_attempts: 5,
        backoff: Backoff::Quadratic { unit },
    };
    cfg.reconcile = Duration::from_millis(500);
    let p = producer(&rt, &cfg);
    // (attempt, handler start in wall-clock µs, due time in ms): due times are wall-clock
    // scores, so the schedule is checked on that clock.
    let attempts: Arc<Mutex<Vec<(u32, u64, u64)>>> = Arc::default();
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handlers = {
        let (attempts, healthy) = (attempts.clone(), healthy.clone());
        Handlers::new().on("close", move |task| {
            attempts.lock().push((task.attempt, now_us(), task.due_at));
            if healthy.load(std::sync::atomic::Ordering::SeqCst) {
                Ok(())
            } else {
                Err("payment service unavailable".into())
            }
        })
    };
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    let enqueued_at = now_ms();
    enqueue_all(&rt, &p, "close", vec![("order9".into(), enqueued_at)]);
    wait_until("the dead letter", || c.stats().dead_lettered == 1);
    {
        let attempts = attempts.lock();
        assert_eq!(attempts.len(), 5, "five deliveries in all");
        for &(attempt, started_us, due_ms) in attempts.iter() {
            assert!(
                started_us >= due_ms * 1_000,
                "attempt {attempt} ran before its due time"
            );
        }
        for (k, w) in attempts.windows(2).enumerate() {
            let failed = (k + 1) as u32; // the attempt that just failed, 1-based
            assert_eq!(w[1].0, failed, "the envelope counts attempts");
            // The retry is due at least the backoff after the failed attempt started.
            let wait_us = (unit * failed * failed).as_micros() as u64;
            assert!(
                w[1].2 * 1_000 >= w[0].1 + wait_us,
                "retry {failed} was due {} µs after attempt {}, before its backoff of {wait_us} µs",
                w[1].2 * 1_000 - w[0].1,
                failed - 1
            );
        }
    }
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    // Any limit: the scan's COUNT hint was the limit itself, which Redis refused past i64::MAX.
    assert_eq!(rt.block_on(p.dead_letters(usize::MAX)).unwrap(), dead);
    assert_eq!(dead[0].id, "order9");
    assert_eq!(dead[0].attempt, 5);
    assert_eq!(dead[0].reason, "payment service unavailable");
    assert!(
        dead[0].at >= enqueued_at && dead[0].at <= now_ms(),
        "dead-letter time"
    );
    assert_eq!(
        delaywheel::redis::Envelope::decode(dead[0].raw.as_bytes())
            .unwrap()
            .id,
        "order9"
    );
    // Requeue: back in the queue with its attempts reset; now it succeeds.
    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(rt.block_on(p.requeue("order9")).unwrap());
    assert!(!rt.block_on(p.requeue("order9")).unwrap(), "no longer dead");
    wait_until("the requeued task's ack", || c.stats().acked == 1);
    assert_eq!(attempts.lock().last().unwrap().0, 0);
    assert!(rt.block_on(p.dead_letters(10)).unwrap().is_empty());
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn poison_tasks_are_dead_lettered_with_reasons_and_the_consumer_goes_on() {
    let Fixture { server, rt, cfg, p } = fixture("poison", |cfg| {
        // "orphan" below never gets its envelope: dead-lettered after this.
        cfg.unpaired_grace = Duration::from_millis(100);
        cfg.retry = RetryPolicy {
            max_attempts: 2,
            backoff: Backoff::Quadratic {
                unit: Duration::from_millis(10),
            },
        };
    });
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let due = now_ms();
    redis::pipe()
        .cmd("ZADD")
        .arg("{poison}:due")
        .arg(due)
        .arg("garbage")
        .cmd("HSET")
        .arg("{poison}:tasks")
        .arg("garbage")
        .arg("\u{1}not json")
        .cmd("ZADD")
        .arg("{poison}:due")
        .arg(due)
        .arg("orphan")
        .query::<()>(&mut conn)
        .unwrap();
    enqueue_all(&rt, &p, "nobody.listens", vec![("lost-topic".into(), due)]);
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "good")).unwrap();
    wait_until("three dead letters", || c.stats().dead_lettered == 3);
    enqueue_all(&rt, &p, "good", vec![("fine".into(), now_ms())]);
    wait_until("the good task after the poison ones", || {
        fired.lock().contains_key("fine")
    });
    let mut dead = rt.block_on(p.dead_letters(10)).unwrap();
    dead.sort_by(|a, b| a.id.cmp(&b.id));
    let reasons: Vec<(&str, &str)> = dead
        .iter()
        .map(|d| (d.id.as_str(), d.reason.as_str()))
        .collect();
    assert_eq!(reasons.len(), 3);
    assert_eq!(reasons[0].0, "garbage");
    assert!(
        reasons[0].1.starts_with("undecodable envelope"),
        "{reasons:?}"
    );
    assert_eq!(reasons[1], ("lost-topic", "unknown topic: nobody.listens"));
    assert_eq!(
        dead[1].attempt, 2,
        "the unknown topic went through its retries"
    );
    assert_eq!(reasons[2], ("orphan", "no envelope in the tasks hash"));
    assert!(matches!(
        rt.block_on(p.requeue("garbage")),
        Err(QueueError::NotAnEnvelope(_))
    ));
    // Enqueued again under the same id: the dead letter cannot overwrite the new task.
    let later = When::After(Duration::from_secs(3_600));
    assert!(rt
        .block_on(p.enqueue("lost-topic", "good", serde_json::json!("new"), later))
        .unwrap());
    assert!(matches!(
        rt.block_on(p.requeue("lost-topic")),
        Err(QueueError::StillPending(_))
    ));
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, 1);
    // Garbage on the wake-up channel (any client may publish there) is ignored.
    for junk in ["18446744073709551615", "-1", "not a number"] {
        redis::cmd("PUBLISH")
            .arg("{poison}:wake")
            .arg(junk)
            .query::<()>(&mut conn)
            .unwrap();
    }
    enqueue_all(&rt, &p, "good", vec![("after-junk".into(), now_ms() + 100)]);
    wait_until("a task after junk wake-ups", || {
        fired.lock().contains_key("after-junk")
    });
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A backlog larger than `max_held` drains at the pace its tasks fire, not one `max_held` per
/// reconcile interval: a full claim that leaves no room looks again as soon as the held
/// tasks have fired. (It waited a reconcile, about 1 s per 10 tasks here: 10 s for 100.)
#[test]
fn a_backlog_beyond_max_held_drains_without_waiting_for_reconciles() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("backlog", |cfg| {
        cfg.max_held = 10;
        cfg.batch = 10;
    });
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "job")).unwrap();
    let due = now_ms() + 300;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..100).map(|i| (format!("b{i}"), due)).collect(),
    );
    wait_until("the backlog to fire", || fired.lock().len() == 100);
    let last_ms = fired.lock().values().map(|d| d[0].1 / 1_000).max().unwrap();
    assert!(
        last_ms < due + 5_000,
        "the last of 100 tasks fired {} ms after its due time",
        last_ms - due
    );
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A handler error whose `Display` panics is still settled: the task is dead-lettered (one
/// attempt allowed) with a reason that says so. (The error was formatted outside the guard
/// around the handler: the panic ended the call before the outcome was sent, and the task
/// stayed leased to the consumer, its lease renewed, for as long as it ran.)
#[test]
fn a_handler_error_that_panics_when_shown_still_settles_its_task() {
    #[derive(Debug)]
    struct Unshowable;
    impl std::fmt::Display for Unshowable {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            panic!("this error cannot be shown")
        }
    }
    impl std::error::Error for Unshowable {}
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("unshowable", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            backoff: Backoff::Quadratic {
                unit: Duration::from_millis(10),
            },
        };
    });
    let c = Consumer::start(
        cfg,
        Handlers::new().on("job", |_| Err(Box::new(Unshowable))),
    )
    .unwrap();
    enqueue_all(&rt, &p, "job", vec![("u".into(), now_ms())]);
    wait_until("the dead letter", || {
        rt.block_on(p.depth()).unwrap().dead == 1
    });
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead[0].id, "u");
    assert!(
        dead[0].reason.starts_with("handler panicked"),
        "{:?}",
        dead[0]
    );
    assert_eq!(rt.block_on(p.depth()).unwrap().leased, 0);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// An envelope whose attempt count is already at its maximum (a client may enqueue any count)
/// fails once more and is dead-lettered: the count saturates instead of overflowing, which
/// panicked and left the task leased to this consumer for good.
#[test]
fn an_attempt_count_at_its_maximum_is_dead_lettered() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("worn", |_| {});
    let envelope = delaywheel::redis::Envelope {
        id: "worn".into(),
        topic: "nobody.listens".into(),
        payload: serde_json::Value::Null,
        attempt: u32::MAX,
        created_at: now_ms(),
        headers: Default::default(),
        due_at: now_ms(),
    };
    assert!(rt.block_on(p.enqueue_envelope(envelope, false)).unwrap());
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "good")).unwrap();
    wait_until("the dead letter", || c.stats().dead_lettered == 1);
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!((dead[0].id.as_str(), dead[0].attempt), ("worn", u32::MAX));
    assert_eq!(dead[0].reason, "unknown topic: nobody.listens");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A namespace ending in `:` and digits is refused: it names a shard of a sharded queue, whose
/// keys it would share (`a:1` and shard 1 of `a`).
#[test]
fn a_namespace_that_names_another_queues_shard_is_refused() {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for ns in ["orders:1", "a:b:007"] {
        let cfg = QueueConfig::new(server.url(), ns);
        match rt.block_on(Producer::connect(cfg.clone())) {
            Err(QueueError::Namespace(e)) => assert_eq!(e.0, ns),
            other => panic!("{ns}: the producer got {:?}", other.map(|_| ())),
        }
        match Consumer::start(cfg, Handlers::new()) {
            Err(QueueError::Namespace(e)) => assert_eq!(e.0, ns),
            other => panic!("{ns}: the consumer got {:?}", other.map(|_| ())),
        }
    }
    for ns in ["orders", "orders:v2", "orders:"] {
        let cfg = QueueConfig::new(server.url(), ns);
        assert!(rt.block_on(Producer::connect(cfg)).is_ok(), "{ns} refused");
    }
}

/// A handler's failure while Redis is down for a few seconds is still written as a retry
/// once Redis is back: attempt count and all. (The write was given up after five tries,
/// about 1.5 s, and the lease's expiry later put the old envelope back, attempt 0, counted
/// as a crash.)
#[test]
fn a_failure_written_while_redis_is_down_is_written_once_it_is_back() {
    let mut server = RedisServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(server.url(), "outage");
    cfg.retry = RetryPolicy {
        max_attempts: 5,
        backoff: Backoff::Quadratic {
            unit: Duration::from_secs(3_600),
        },
    };
    let p = producer(&rt, &cfg);
    let (entered_tx, entered) = crossbeam_channel::bounded::<()>(1);
    let (go, go_rx) = crossbeam_channel::bounded::<()>(1);
    let handlers = Handlers::new().on("job", move |_| {
        let _ = entered_tx.try_send(());
        let _ = go_rx.recv_timeout(PATIENCE);
        Err("downstream unavailable".into())
    });
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("o1".into(), now_ms())]);
    entered.recv_timeout(PATIENCE).expect("the handler runs");
    server.kill();
    go.send(()).unwrap();
    // Longer than the five tries the write used to get.
    std::thread::sleep(Duration::from_secs(3));
    server.restart();
    wait_until("the retry to be written", || c.stats().retried == 1);
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let raw: Vec<u8> = redis::cmd("HGET")
        .arg("{outage}:tasks")
        .arg("o1")
        .query(&mut conn)
        .unwrap();
    let stored = delaywheel::redis::Envelope::decode(&raw).unwrap();
    assert_eq!(stored.attempt, 1, "the retry's attempt count");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A task that fires hours late (a backlog after an outage) shows in the lateness maximum,
/// at the histogram's top (an hour), rather than being left out of it.
#[test]
fn a_task_hours_late_counts_in_the_lateness_maximum() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("backlog", |_| {});
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "t")).unwrap();
    enqueue_all(&rt, &p, "t", vec![("old".into(), now_ms() - 7_200_000)]);
    wait_until("the ack", || c.stats().acked == 1);
    assert!(c.stats().lateness_max_us >= 3_600_000_000);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A queue and a `Persistent` engine on one namespace would take each other's tasks (and a
/// snapshot would delete the queue's): whichever comes second is refused, naming the role
/// that holds the namespace. One shard's key set of a sharded queue counts as a namespace.
#[test]
fn a_queue_and_a_persistent_engine_cannot_share_a_namespace() {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (p, _fired) = Persistent::start(PersistConfig::new(server.url(), "orders")).unwrap();
    let cfg = QueueConfig::new(server.url(), "orders");
    match rt.block_on(Producer::connect(cfg.clone())) {
        Err(QueueError::InUse(e)) => {
            assert_eq!(
                (e.namespace.as_str(), e.by.as_str()),
                ("orders", "persistent")
            )
        }
        other => panic!("the producer got {:?}", other.map(|_| ())),
    }
    match Consumer::start(cfg, Handlers::new()) {
        Err(QueueError::InUse(e)) => assert_eq!(e.by, "persistent"),
        other => panic!("the consumer got {:?}", other.map(|_| ())),
    }
    // Another engine of the same role is welcome, once the first has shut down (it holds the
    // namespace's writer lease until then).
    p.shutdown();
    let (again, _fired_again) =
        Persistent::start(PersistConfig::new(server.url(), "orders")).unwrap();
    again.shutdown();

    let mut sharded = QueueConfig::new(server.url(), "jobs");
    sharded.shards = 2;
    let _producer = producer(&rt, &sharded);
    match Persistent::start(PersistConfig::new(server.url(), "jobs:1")) {
        Err(PersistError::InUse(e)) => {
            assert_eq!((e.namespace.as_str(), e.by.as_str()), ("jobs:1", "queue"))
        }
        Err(e) => panic!("the persistent engine got {e}"),
        Ok(_) => panic!("a persistent engine took a queue shard's keys"),
    }
    // Also through `with_store`, with a store opened by hand.
    let store = rt
        .block_on(RedisStore::connect(
            &server.url(),
            KeyLayout::new("jobs:1").unwrap(),
        ))
        .unwrap();
    match Persistent::with_store(PersistConfig::new("unused://", "unused"), store) {
        Err(PersistError::InUse(e)) => assert_eq!(e.by, "queue"),
        Err(e) => panic!("with_store got {e}"),
        Ok(_) => panic!("with_store took a queue shard's keys"),
    }
    // The sharded queue's keys are `{jobs:0}` and `{jobs:1}`: `{jobs}` is free.
    let (free, _fired_free) = Persistent::start(PersistConfig::new(server.url(), "jobs")).unwrap();
    free.shutdown();

    // A kind key another client made a hash of is not a claim to skip.
    let client = redis::Client::open(server.url()).unwrap();
    let _: () = redis::cmd("HSET")
        .arg("{theirs}:kind")
        .arg("f")
        .arg("v")
        .query(&mut client.get_connection().unwrap())
        .unwrap();
    let theirs = QueueConfig::new(server.url(), "theirs");
    assert!(matches!(
        rt.block_on(Producer::connect(theirs)),
        Err(QueueError::InUse(_))
    ));
}

/// A dead letter Redis keeps refusing (its hash is a string: WRONGTYPE, as it would refuse an
/// ACL user without write access to it) is given up on, and the task fires again after its
/// lease, not leased for ever; once the dead letters can be written, it is dead-lettered. (The
/// write was retried for ever while the lease kept being renewed; and the script released
/// the lease before the refused write, so the task was gone from the queue, leased nowhere.)
#[test]
fn a_dead_letter_redis_refuses_leaves_the_task_to_its_lease() {
    let Fixture {
        server,
        rt,
        mut cfg,
        p,
    } = fixture("refused", |_| {});
    cfg.retry = RetryPolicy {
        max_attempts: 1,
        backoff: Backoff::Quadratic {
            unit: Duration::from_secs(1),
        },
    };
    cfg.lease = Duration::from_secs(1);
    cfg.reaper_interval = Duration::from_millis(100);
    cfg.max_lease_expiries = 0;
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handlers = {
        let runs = runs.clone();
        Handlers::new().on("job", move |_| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err("poison".into())
        })
    };
    let c = Consumer::start(cfg, handlers).unwrap();
    // Once it runs: `Consumer::start` refuses a namespace with a key of the wrong type.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let _: () = redis::cmd("SET")
        .arg("{refused}:dead")
        .arg("not a hash")
        .query(&mut conn)
        .unwrap();
    enqueue_all(&rt, &p, "job", vec![("d1".into(), now_ms())]);
    wait_until("the task to fire again after its lease", || {
        runs.load(std::sync::atomic::Ordering::SeqCst) >= 2
    });
    let _: () = redis::cmd("DEL")
        .arg("{refused}:dead")
        .query(&mut conn)
        .unwrap();
    wait_until("the dead letter", || c.stats().dead_lettered >= 1);
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].id.as_str(), dead[0].reason.as_str()),
        ("d1", "poison")
    );
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// An enqueue that Redis does not take hands the envelope back, payload and all.
#[test]
fn an_enqueue_redis_fails_hands_the_envelope_back() {
    let Fixture {
        mut server, rt, p, ..
    } = fixture("gone", |_| {});
    server.kill();
    let envelope = delaywheel::redis::Envelope {
        id: "order1".into(),
        topic: "t".into(),
        payload: serde_json::json!({"amount": 42}),
        attempt: 0,
        created_at: now_ms(),
        headers: Default::default(),
        due_at: now_ms() + 1_000,
    };
    match rt.block_on(p.enqueue_envelope(envelope.clone(), false)) {
        Err(QueueError::NotEnqueued(_, back)) => assert_eq!(*back, envelope),
        other => panic!("expected NotEnqueued with the envelope, got {other:?}"),
    }
}

/// A shutdown while Redis hangs (every command paused) keeps to its timeout: the loops waiting
/// on a reply are stopped, not waited for until Redis answers.
#[test]
fn shutdown_keeps_its_timeout_while_redis_hangs() {
    let Fixture {
        server,
        rt: _rt,
        cfg,
        ..
    } = fixture("hang", |_| {});
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg, recorder(&fired, 0, "t")).unwrap();
    wait_until("a first claim", || c.stats().claims > 0);
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(6_000)
        .arg("ALL")
        .query::<()>(&mut conn)
        .unwrap();
    // Long enough for the next claim (every second) and reap to be waiting on Redis.
    std::thread::sleep(Duration::from_millis(1_500));
    let start = Instant::now();
    let result = c.shutdown(Duration::from_millis(200));
    let took = start.elapsed();
    // (Waiting on the paused Redis would take the 4.5 s left of its pause.)
    assert!(
        took < Duration::from_secs(3),
        "shutdown(200 ms) took {took:?} while Redis hung"
    );
    assert!(result.is_ok(), "nothing was held to hand back: {result:?}");
}

#[test]
fn graceful_shutdown_hands_claimed_tasks_back_at_once() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("handback", |cfg| {
        // 30 s leases. A claims them at its first reconcile claim (within 1 s), 4 s before
        // they are due.
        cfg.lookahead = Duration::from_secs(30);
    });
    let fired: Fired = Arc::default();
    let a = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    // Due well after the first reconcile claim (1 s), so A holds them for a while (and loses
    // them before they are due, also on a loaded machine).
    let due = now_ms() + 5_000;
    claimed_by(&rt, &p, &a, "h", 300, due);
    assert_eq!(a.shutdown(Duration::from_secs(5)).unwrap(), 300);
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (300, 0));
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("B to fire the handed-back tasks", || {
        fired.lock().len() == 300
    });
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id}");
        assert_eq!(d[0].0, 1);
        assert!(d[0].1 >= due * 1_000, "{id} early");
        // Well before the 30 s lease would have expired.
        assert!(d[0].1 < (due + 5_000) * 1_000, "{id} waited for the lease");
    }
    b.shutdown(Duration::from_secs(5)).unwrap();
}

/// A consumer `a` (recording `job` tasks as consumer 0 in `fired`) whose only handler thread
/// is stuck in task `hang` until `release` is sent, holding 20 tasks `j0..j19` due at `due`,
/// `ahead` ms after the start; its `handler_stall` is `stall`.
struct Stuck {
    fixture: Fixture,
    fired: Fired,
    release: crossbeam_channel::Sender<()>,
    a: Consumer,
    due: u64,
}

fn stuck_consumer(ns: &str, stall: Duration, ahead: u64) -> Stuck {
    let fixture = fixture(ns, |cfg| {
        cfg.handler_threads = 1;
        cfg.handler_stall = stall;
        cfg.lookahead = Duration::from_secs(20);
        cfg.reconcile = Duration::from_millis(200);
    });
    let fired: Fired = Arc::default();
    let (started_tx, started) = crossbeam_channel::bounded(1);
    let (release, released) = crossbeam_channel::bounded::<()>(1);
    let handlers = recorder(&fired, 0, "job").on("hang", move |_| {
        let _ = started_tx.send(());
        let _ = released.recv();
        Ok(())
    });
    let a = Consumer::start(fixture.cfg.clone(), handlers).unwrap();
    let due = now_ms() + ahead;
    claimed_by(&fixture.rt, &fixture.p, &a, "j", 20, due);
    let hang = vec![("hang".to_string(), now_ms())];
    enqueue_all(&fixture.rt, &fixture.p, "hang", hang);
    started.recv_timeout(PATIENCE).unwrap();
    Stuck {
        fixture,
        fired,
        release,
        a,
        due,
    }
}

/// A consumer whose only handler thread is stuck hands the tasks it holds to another consumer,
/// which fires them on time, and claims nothing until the thread is free; the stuck task
/// stays with it. (It used to keep them, renewed, for as long as it lived.)
#[test]
fn a_consumer_whose_handlers_are_stuck_hands_its_tasks_to_another() {
    // 20 tasks A holds, due well after the stall shows (500 ms after the stuck one starts).
    let Stuck {
        fixture:
            Fixture {
                server: _server,
                rt,
                cfg,
                p,
            },
        fired,
        release,
        a,
        due,
    } = stuck_consumer("stuck", Duration::from_millis(500), 4_000);
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("A to hand its tasks back", || a.stats().given_back == 20);
    assert_eq!(a.held(), 0);
    // Claimed while A is stuck: only B may take them.
    let later = now_ms() + 500;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..10).map(|i| (format!("k{i}"), later)).collect(),
    );
    wait_until("B to fire all 30", || fired.lock().len() == 30);
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id} fired twice");
        assert_eq!(d[0].0, 1, "{id} fired on the stuck consumer");
        let due = if id.starts_with('j') { due } else { later };
        assert!(d[0].1 >= due * 1_000, "{id} early");
        // Not held until the stuck handler returns (never, here) or a lease runs out (30 s).
        assert!(d[0].1 < (due + 5_000) * 1_000, "{id} fired late");
    }
    assert_eq!(a.stats().claimed, 21, "A claimed while stuck");
    // Free again: A acks its own task, which it kept, and claims again.
    release.send(()).unwrap();
    b.shutdown(Duration::from_secs(5)).unwrap();
    wait_until("A's ack", || a.stats().acked == 1);
    enqueue_all(&rt, &p, "job", vec![("after".into(), now_ms())]);
    wait_until("A to fire again", || fired.lock().contains_key("after"));
    assert_eq!(fired.lock()["after"][0].0, 0);
    let s = a.stats();
    assert_eq!((s.refused, s.recovered), (0, 0), "{s:?}");
    a.shutdown(Duration::from_secs(5)).unwrap();
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
}

/// A stall hand-back that Redis refuses (here a broken `owner` key: an error no retry gets
/// past) is tried again until it lands: the tasks reach another consumer on time, not after
/// their leases.
#[test]
fn a_refused_stall_hand_back_is_tried_again() {
    let Stuck {
        fixture: Fixture { server, rt, cfg, p },
        fired,
        release,
        a,
        due,
    } = stuck_consumer("stuckretry", Duration::from_millis(2_000), 9_000);
    let keys = KeyLayout::new("stuckretry").unwrap();
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    // Every script that checks an owner now fails with WRONGTYPE.
    let saved = format!("{}:saved", keys.owner());
    redis::pipe()
        .cmd("RENAME")
        .arg(keys.owner())
        .arg(&saved)
        .cmd("SET")
        .arg(keys.owner())
        .arg("broken")
        .query::<()>(&mut conn)
        .unwrap();
    wait_until("A to take its tasks out for the hand-back", || {
        a.held() == 0
    });
    std::thread::sleep(Duration::from_millis(1_000)); // a few refused tries
    assert_eq!(a.stats().given_back, 0, "handed back through a broken key");
    redis::pipe()
        .cmd("DEL")
        .arg(keys.owner())
        .cmd("RENAME")
        .arg(&saved)
        .arg(keys.owner())
        .query::<()>(&mut conn)
        .unwrap();
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("the hand-back to land", || a.stats().given_back == 20);
    wait_until("B to fire all 20", || fired.lock().len() == 20);
    for (id, d) in fired.lock().iter() {
        assert_eq!((d.len(), d[0].0), (1, 1), "{id}: {d:?}");
        assert!(d[0].1 >= due * 1_000, "{id} early");
        assert!(d[0].1 < (due + 5_000) * 1_000, "{id} waited for its lease");
    }
    release.send(()).unwrap();
    wait_until("A's ack", || a.stats().acked == 1);
    b.shutdown(Duration::from_secs(5)).unwrap();
    a.shutdown(Duration::from_secs(5)).unwrap();
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
}

/// A shutdown whose acks Redis does not take in time says so: `Err`, not `Ok`. (The acks were
/// dropped with the runtime and `Ok` came back; the tasks then ran again after their leases.)
#[test]
fn a_shutdown_whose_acks_are_not_written_is_an_error() {
    let Fixture { server, rt, cfg, p } = fixture("unacked", |cfg| {
        cfg.lookahead = Duration::from_secs(30);
    });
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    // Due well after the claim (within ms of the enqueue), also on a loaded machine.
    enqueue_all(&rt, &p, "job", vec![("u".into(), now_ms() + 2_000)]);
    wait_until("the claim", || c.held() == 1);
    // Writes (scripts among them) wait from now on: the ack cannot be written.
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(8_000)
        .arg("WRITE")
        .query::<()>(&mut conn)
        .unwrap();
    wait_until("the handler", || fired.lock().contains_key("u"));
    let stopped = c.shutdown(Duration::from_millis(500));
    assert!(
        matches!(stopped, Err(QueueError::Store(_))),
        "the ack was not written: {stopped:?}"
    );
    // Still there, unacknowledged (a read: not held by the pause).
    let held: bool = redis::cmd("HEXISTS")
        .arg("{unacked}:tasks")
        .arg("u")
        .query(&mut conn)
        .unwrap();
    assert!(held, "the ack was written after all");
}

/// The hand-back at shutdown tries again after a dropped connection: the tasks go back to
/// the queue at once, not after their leases. (A failed call ended its shard's hand-back.)
#[test]
fn a_hand_back_survives_a_dropped_connection() {
    let Fixture { server, rt, cfg, p } = fixture("handback-drop", |cfg| {
        cfg.lookahead = Duration::from_secs(30);
    });
    let fired: Fired = Arc::default();
    let a = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    let due = now_ms() + 20_000;
    claimed_by(&rt, &p, &a, "d", 50, due);
    // Every client loses its connection: A's next command fails on it.
    assert!(server.kill_clients() >= 1);
    assert_eq!(a.shutdown(Duration::from_secs(5)).unwrap(), 50);
    // (The producer lost its connection too: a new one.)
    let depth = rt.block_on(producer(&rt, &cfg).depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (50, 0));
    drop(p);
}

#[test]
fn sharded_queue_spreads_keys_and_assigned_consumers_cover_it() {
    let Fixture { server, rt, cfg, p } = fixture("big", |cfg| {
        cfg.shards = 4;
    });
    let due = now_ms() + 300;
    let n = 2_000;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..n).map(|i| (format!("s{i}"), due)).collect(),
    );
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut total = 0;
    for s in 0..4 {
        let card: usize = redis::cmd("ZCARD")
            .arg(format!("{{big:{s}}}:due"))
            .query(&mut conn)
            .unwrap();
        let expected = (0..n)
            .filter(|i| shard_of(&format!("s{i}"), 4) == s)
            .count();
        assert_eq!(card, expected, "shard {s}");
        assert!(card > n / 8, "shard {s} holds only {card}");
        total += card;
    }
    assert_eq!(total, n);
    let fired: Fired = Arc::default();
    let halves: Vec<Consumer> = [vec![0, 1], vec![2, 3]]
        .into_iter()
        .enumerate()
        .map(|(i, shards)| {
            let mut c = cfg.clone();
            c.assigned_shards = Some(shards);
            Consumer::start(c, recorder(&fired, i, "job")).unwrap()
        })
        .collect();
    wait_until("every shard's tasks", || fired.lock().len() == n);
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].0,
            (shard_of(id, 4) / 2) as usize,
            "{id} fired off its shards"
        );
    }
    for c in halves {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    for tweak in [
        |c: &mut QueueConfig| c.shards = 0,
        // Beyond a cluster's slots: refused before a key set is built for each.
        |c: &mut QueueConfig| c.shards = u32::MAX,
        |c: &mut QueueConfig| c.handler_threads = 1_025,
        // A claim's LIMIT goes through Lua's doubles: refused before it stops being an integer.
        |c: &mut QueueConfig| c.batch = 100_001,
        // A claim's reply (batch × max_envelope) past 256 MiB: 6.5 GB here.
        |c: &mut QueueConfig| c.batch = 100_000,
        // Leases are counted in whole ms: a shorter one would end at the due time.
        |c: &mut QueueConfig| c.lease = Duration::from_micros(999),
        |c: &mut QueueConfig| c.handler_stall = Duration::ZERO,
    ] {
        let mut bad = cfg.clone();
        tweak(&mut bad);
        assert!(matches!(
            Consumer::start(bad, Handlers::new()),
            Err(QueueError::Config(_))
        ));
    }
    let mut bad = cfg.clone();
    bad.reconcile = bad.lookahead;
    assert!(matches!(
        rt.block_on(Producer::connect(bad)),
        Err(QueueError::Config(_))
    ));
    // A setting so large that the sums and instants made from it would overflow.
    let mut bad = cfg.clone();
    bad.reconcile = Duration::MAX;
    bad.lookahead = Duration::MAX;
    assert!(matches!(
        rt.block_on(Producer::connect(bad)),
        Err(QueueError::Config(_))
    ));
    let mut bad = cfg;
    bad.assigned_shards = Some(vec![7]);
    assert!(matches!(
        rt.block_on(Producer::connect(bad)),
        Err(QueueError::Config(_))
    ));
}

#[test]
fn replace_swaps_a_pending_task_and_a_claimed_copy_can_no_longer_ack() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("replace", |cfg| {
        // Claimed at once, and far enough ahead that a stalled machine does not fire it
        // before the test replaces it.
        cfg.lookahead = Duration::from_secs(10);
    });
    let seen: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let handlers = {
        let seen = seen.clone();
        Handlers::new().on("job", move |t| {
            seen.lock().push(t.payload.clone());
            Ok(())
        })
    };
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    let envelope = |payload: serde_json::Value, due_at: u64| delaywheel::redis::Envelope {
        id: "r1".into(),
        topic: "job".into(),
        payload,
        attempt: 0,
        created_at: now_ms(),
        headers: Default::default(),
        due_at,
    };
    // Claimed (due within the lookahead), then replaced. The new version fires once. The
    // claimed copy fires too if its time comes before the consumer claims the new version
    // (at-least-once; its ack is then refused), and not at all if the new claim comes first
    // (the newer claim cancels the older timer). The version that was refused never fires.
    // Beyond the wake-up window: claimed by the consumer's first claim, then held until due.
    let first_due = now_ms() + 5_000;
    assert!(rt
        .block_on(p.enqueue_envelope(envelope(serde_json::json!(1), first_due), false))
        .unwrap());
    wait_until("the claim", || c.held() == 1);
    assert!(!rt
        .block_on(p.enqueue_envelope(envelope(serde_json::json!(2), first_due), false))
        .unwrap());
    assert!(rt
        .block_on(p.enqueue_envelope(envelope(serde_json::json!(3), now_ms() + 800), true))
        .unwrap());
    wait_until("the new version", || {
        seen.lock().contains(&serde_json::json!(3))
    });
    wait_until("its ack", || c.stats().acked == 1);
    std::thread::sleep(Duration::from_millis(200));
    let seen = seen.lock().clone();
    let old_fired = seen.contains(&serde_json::json!(1));
    let expected = if old_fired {
        vec![serde_json::json!(1), serde_json::json!(3)]
    } else {
        vec![serde_json::json!(3)]
    };
    assert_eq!(seen, expected);
    assert_eq!(c.stats().refused, u64::from(old_fired));
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn exponential_backoff_doubles_within_its_jitter_and_caps() {
    let b = Backoff::Exponential {
        base: Duration::from_millis(100),
        max: Duration::from_secs(2),
    };
    for attempt in 1..=10u32 {
        let full = (Duration::from_millis(100) * 2u32.pow(attempt - 1)).min(Duration::from_secs(2));
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..50 {
            let d = b.delay(attempt);
            assert!(
                d >= full / 2 && d <= full,
                "attempt {attempt}: {d:?} outside [{:?}, {full:?}]",
                full / 2
            );
            distinct.insert(d);
        }
        assert!(distinct.len() > 1, "no jitter at attempt {attempt}");
    }
    let q = Backoff::Quadratic {
        unit: Duration::from_secs(1),
    };
    let waits: Vec<u64> = (1..=4).map(|a| q.delay(a).as_secs()).collect();
    assert_eq!(waits, [1, 4, 9, 16]);
    assert_eq!(RetryPolicy::default().max_attempts, 5);
    assert_eq!(
        RetryPolicy::default().backoff,
        Backoff::Quadratic {
            unit: Duration::from_secs(1)
        }
    );
}

/// A live consumer keeps what it works on: a handler that runs for several leases, and a task
/// waiting behind it for the one handler thread, each run once, here, and no reaper takes them.
#[test]
fn leases_of_running_and_waiting_tasks_are_renewed() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("renew", |cfg| {
        // Renewed every second: a renewal may stall for over a second on a loaded machine,
        // and the lease then still has two.
        cfg.lease = Duration::from_millis(3_000);
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.reconcile = Duration::from_millis(100);
        cfg.handler_threads = 1;
    });
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let slow = |runs: &Arc<Mutex<Vec<String>>>| {
        let runs = runs.clone();
        Handlers::new().on("job", move |t| {
            runs.lock().push(t.id.clone());
            std::thread::sleep(Duration::from_millis(6_500)); // over two leases
            Ok(())
        })
    };
    let due = now_ms();
    enqueue_all(
        &rt,
        &p,
        "job",
        vec![("first".into(), due), ("second".into(), due)],
    );
    // A claims both at once; one runs, the other waits for the handler thread.
    let a = Consumer::start(cfg.clone(), slow(&runs)).unwrap();
    wait_until("A's first handler", || !runs.lock().is_empty());
    assert_eq!(a.stats().claimed, 2);
    // A second consumer, with nothing to claim, whose reaper takes any lease that runs out.
    let b = Consumer::start(cfg.clone(), slow(&runs)).unwrap();
    wait_until("both acks", || {
        a.stats().acked + b.stats().acked == 2 && runs.lock().len() >= 2
    });
    std::thread::sleep(Duration::from_millis(3_000)); // a lease more for a duplicate to show
    let mut ran = runs.lock().clone();
    ran.sort();
    assert_eq!(ran, ["first", "second"], "a task ran twice or not at all");
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.recovered + sb.recovered, 0, "a lease ran out");
    assert_eq!(sa.refused + sb.refused, 0);
    assert!(sa.renewed + sb.renewed >= 2, "{sa:?} {sb:?}");
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    a.shutdown(Duration::from_secs(5)).unwrap();
    b.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn shutdown_lets_a_running_handler_finish_and_sends_its_ack() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("finish", |_| {});
    let (started_tx, started) = crossbeam_channel::bounded(1);
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handlers = {
        let finished = finished.clone();
        Handlers::new().on("job", move |_| {
            let _ = started_tx.send(());
            std::thread::sleep(Duration::from_millis(400));
            finished.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
    };
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("slow".into(), now_ms())]);
    started.recv_timeout(PATIENCE).unwrap();
    c.shutdown(Duration::from_secs(5)).unwrap();
    assert!(
        finished.load(std::sync::atomic::Ordering::SeqCst),
        "shutdown did not wait"
    );
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0), "the ack did not land");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_layer_starts_and_stops_from_async_code() {
    let server = RedisServer::start_in_memory();
    let cfg = QueueConfig::new(server.url(), "async");
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    let p = Producer::connect(cfg).await.unwrap();
    p.enqueue(
        "a1",
        "job",
        serde_json::Value::Null,
        When::After(Duration::ZERO),
    )
    .await
    .unwrap();
    let start = Instant::now();
    while !fired.lock().contains_key("a1") {
        assert!(start.elapsed() < PATIENCE);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    c.shutdown(Duration::from_secs(5)).unwrap();

    let persist_cfg = delaywheel::redis::PersistConfig::new(server.url(), "async_persist");
    let (engine, _fired) = delaywheel::redis::Persistent::start(persist_cfg.clone()).unwrap();
    engine
        .schedule_at_ms("x", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    engine.shutdown();
    drop(engine);
    let (engine, _fired) = delaywheel::redis::Persistent::start(persist_cfg).unwrap();
    assert_eq!(engine.restore(100).unwrap().loaded, 1);
    drop(engine);
    let dropped =
        Consumer::start(QueueConfig::new(server.url(), "async"), Handlers::new()).unwrap();
    drop(dropped);
}

/// Claims on several shards run at once, and together stay within `max_held`: each reserves
/// its room first.
#[test]
fn concurrent_shard_claims_stay_within_max_held() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("held", |cfg| {
        cfg.shards = 4;
        cfg.batch = 8;
        cfg.max_held = 10;
        cfg.reconcile = Duration::from_millis(100);
        // Claimed at once, and held for seconds before they are due.
        cfg.lookahead = Duration::from_secs(10);
    });
    // Due well after the set-up below, also on a loaded machine.
    let due = now_ms() + 7_000;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..40).map(|i| (format!("h{i}"), due)).collect(),
    );
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_until("the room filled", || c.held() >= 10);
    // Several claim rounds on every shard, none of them due yet.
    std::thread::sleep(Duration::from_millis(400));
    let (held, claimed) = (c.held(), c.stats().claimed);
    assert!(
        now_ms() < due,
        "the setup took too long: the tasks came due"
    );
    assert_eq!(held, 10, "held past max_held");
    assert_eq!(claimed, 10);
    wait_until("all forty", || fired.lock().len() == 40);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// On a sharded queue a wake-up names its shard, and only that shard's claim loop answers it:
/// one claim, not one per shard (with thousands of shards, every wake-up would otherwise be
/// thousands of claims).
#[test]
fn a_wake_up_claims_only_its_shard() {
    let Fixture {
        server: _server,
        rt,
        cfg,
        p,
    } = fixture("wake_shard", |cfg| {
        cfg.shards = 4;
        // No reconcile claim during the test: only the first claims and the wake-up's.
        cfg.reconcile = Duration::from_secs(30);
        cfg.lookahead = Duration::from_secs(40);
    });
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_until("the first claim of every shard", || c.stats().claims == 4);
    // Past the lookahead's first claims, so only the wake-up can bring it in time.
    wait_for_wake_subscribers(&_server, &cfg.namespace, 1);
    let before = c.stats().claims;
    enqueue_all(&rt, &p, "job", vec![("w1".into(), now_ms() + 300)]);
    wait_until("the woken task", || fired.lock().contains_key("w1"));
    assert_eq!(c.stats().claims - before, 1, "claims on other shards");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// How long the paused-node tests pause a node (ms): under the client's 10 s reply timeout, so
/// that no call waiting on the paused node gives up on it, which would change what the tests
/// see, and long enough to leave a loaded machine a wide margin below.
const PAUSE_MS: u64 = 9_000;
/// What those tests wait for must happen this soon after the pause began (ms): well before it
/// ends, so that nothing that waited on the paused node can pass.
const WITHIN_PAUSE: u64 = 7_000;

/// A 6-shard queue on a 3-node cluster, for the paused-node tests: shard 0's node (`paused`),
/// a shard on another node (`other`), and a task id that goes to `other`.
struct SplitCluster {
    cluster: RedisCluster,
    urls: Vec<String>,
    rt: tokio::runtime::Runtime,
    cfg: QueueConfig,
    p: Producer,
    paused: usize,
    other: u32,
    /// The shards whose slots are not on the paused node.
    healthy: Vec<u32>,
    id: String,
}

impl SplitCluster {
    fn start(ns: &str, tweak: impl FnOnce(&mut QueueConfig)) -> SplitCluster {
        let cluster = RedisCluster::start(3);
        let urls = cluster.urls();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut cfg = QueueConfig::new(urls[0].clone(), ns);
        cfg.cluster_nodes = urls.clone();
        cfg.shards = 6;
        cfg.reconcile = Duration::from_millis(100);
        // Claimed by the reconcile claims alone: the wake-up channel may be on the paused node.
        cfg.notify = false;
        tweak(&mut cfg);
        let p = producer(&rt, &cfg);
        // The node that owns a shard's slot answers a plain EXISTS; the others answer MOVED.
        let owner = |shard: u32| {
            (0..urls.len())
                .find(|&n| {
                    let mut conn = redis::Client::open(urls[n].as_str())
                        .unwrap()
                        .get_connection()
                        .unwrap();
                    redis::cmd("EXISTS")
                        .arg(format!("{{{ns}:{shard}}}:due"))
                        .query::<u64>(&mut conn)
                        .is_ok()
                })
                .expect("a node owns the slot")
        };
        let paused = owner(0);
        let healthy: Vec<u32> = (1..6).filter(|&s| owner(s) != paused).collect();
        let other = *healthy.first().expect("all shards on one node");
        let id = (0..)
            .map(|i| format!("t{i}"))
            .find(|id| shard_of(id, 6) == other)
            .unwrap();
        SplitCluster {
            cluster,
            urls,
            rt,
            cfg,
            p,
            paused,
            other,
            healthy,
            id,
        }
    }

    /// Pauses every client of shard 0's node for [`PAUSE_MS`]; returns when (ms) it began.
    fn pause(&self) -> u64 {
        let mut node = redis::Client::open(self.urls[self.paused].as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(PAUSE_MS)
            .arg("ALL")
            .query::<()>(&mut node)
            .unwrap();
        now_ms()
    }

    /// Waits for the pause begun at `paused_at` to end, so that shutdown does not wait on it.
    /// (`CLIENT UNPAUSE` cannot end it sooner: under `PAUSE ALL` it waits like any command.)
    fn wait_out(paused_at: u64) {
        std::thread::sleep(Duration::from_millis(
            (paused_at + PAUSE_MS + 100).saturating_sub(now_ms()),
        ));
    }
}

/// The EVALSHA calls node `url` has run so far.
fn evalsha_calls(url: &str) -> u64 {
    let mut node = redis::Client::open(url).unwrap().get_connection().unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut node)
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// A TCP proxy in front of one cluster node. Once armed, it passes the next request on and
/// closes the connection instead of passing the reply back: a reply lost after the command
/// ran.
struct ReplyDropper {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl ReplyDropper {
    fn start(node_port: u16) -> ReplyDropper {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering::SeqCst;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let armed2 = armed.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { return };
                let mut server = TcpStream::connect(("127.0.0.1", node_port)).unwrap();
                let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || std::io::copy(&mut c2, &mut s2));
                let armed = armed2.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n @ 1..) = server.read(&mut buf) {
                        if armed.swap(false, SeqCst) {
                            break;
                        }
                        if client.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = client.shutdown(Shutdown::Both);
                    let _ = server.shutdown(Shutdown::Both);
                });
            }
        });
        ReplyDropper { port, armed }
    }
}

/// An enqueue whose reply is lost (the connection drops after the script ran) is not sent
/// again, because it may have run: the caller gets `NotEnqueued`, which says the task may be
/// queued all the same. The cluster client used to send it again, so the script ran twice and
/// the second run answered "already queued" (`Ok(false)`) to the very call that queued it
/// (with `replace`, a copy claimed in between would have fired twice).
#[test]
fn an_enqueue_whose_reply_is_lost_is_not_sent_again() {
    let split = SplitCluster::start("unsent", |_| {});
    let url = split.urls[split.paused].clone();
    let node_port: u16 = url
        .trim_start_matches("redis://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    // Clients reach shard 0's node through the proxy: the node announces the proxy's port.
    let proxy = ReplyDropper::start(node_port);
    let mut node = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("cluster-announce-bus-port")
        .arg(node_port + 10_000)
        .arg("cluster-announce-port")
        .arg(proxy.port)
        .query::<()>(&mut node)
        .unwrap();
    wait_until("every node to announce the proxy", || {
        split.urls.iter().all(|u| {
            let mut c = redis::Client::open(u.as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut c).unwrap();
            nodes.contains(&format!(":{}@", proxy.port))
        })
    });
    let p = producer(&split.rt, &split.cfg);
    let id = (0..)
        .map(|i| format!("u{i}"))
        .find(|id| shard_of(id, 6) == 0)
        .unwrap();
    let enqueue = |id: &str| {
        split.rt.block_on(p.enqueue(
            id.to_owned(),
            "job",
            serde_json::Value::Null,
            When::AtMs(now_ms() + 3_600_000),
        ))
    };
    // Through the proxy, with the script loaded, as a running producer is.
    assert!(matches!(enqueue("u-warm-up"), Ok(true)));
    let before = evalsha_calls(&url);
    proxy.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = enqueue(&id);
    assert!(
        !proxy.armed.load(std::sync::atomic::Ordering::SeqCst),
        "no reply was dropped"
    );
    assert!(
        matches!(sent, Err(QueueError::NotEnqueued(..))),
        "a reply that never came: {sent:?}"
    );
    assert_eq!(
        evalsha_calls(&url) - before,
        1,
        "the enqueue ran more than once"
    );
    // It did run: enqueueing again tells so, as NotEnqueued's docs say (once the client has
    // its connection back).
    let start = Instant::now();
    let again = loop {
        match enqueue(&id) {
            Err(QueueError::NotEnqueued(..)) if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            again => break again,
        }
    };
    assert!(matches!(again, Ok(false)), "{again:?}");
}

/// A command the cluster refuses with MOVED, after its slot went to another node, is sent
/// again to the new owner: the client no longer does that by itself (it would also resend
/// after a timeout, above), so `Link` does, for the refusals that say nothing ran.
#[test]
fn an_enqueue_follows_its_slot_to_another_node() {
    let split = SplitCluster::start("moved", |_| {});
    let id = (0..)
        .map(|i| format!("m{i}"))
        .find(|id| shard_of(id, 6) == 0)
        .unwrap();
    // The producer knows the slot map (and has loaded its script everywhere).
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(split.id.clone(), now_ms() + 3_600_000)],
    );
    let to = split.cluster.move_slot_of("{moved:0}:due");
    let sent = split.rt.block_on(split.p.enqueue(
        id.clone(),
        "job",
        serde_json::Value::Null,
        When::AtMs(now_ms() + 3_600_000),
    ));
    assert!(matches!(sent, Ok(true)), "{sent:?}");
    let held: bool = redis::cmd("HEXISTS")
        .arg("{moved:0}:tasks")
        .arg(&id)
        .query(
            &mut redis::Client::open(split.urls[to].as_str())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
        .unwrap();
    assert!(held, "the task is not on the slot's new node");
}

/// A shard whose node stops answering delays no other shard's reaping: a crashed consumer's
/// task on another node is reaped and fires elsewhere after its lease. (One reaper went
/// through the shards in turn, so it waited on the paused node first.)
#[test]
fn a_paused_node_delays_no_other_shards_reaping() {
    let split = SplitCluster::start("reaped", |cfg| {
        cfg.reaper_interval = Duration::from_millis(50);
        // Long enough that the lease runs out after the pause below has begun (B's start and
        // first claims take well under that, also on a loaded machine), and well within it
        // (the pause begins about a second after A's claim, and the task must fire within
        // WITHIN_PAUSE of it).
        cfg.lease = Duration::from_millis(4_500);
    });
    // A claims the task (on its shard only) and crashes while running it: no renewals.
    let started = Arc::new(Mutex::new(false));
    let a = {
        let started = started.clone();
        let mut only_other = split.cfg.clone();
        only_other.assigned_shards = Some(vec![split.other]);
        only_other.renew_leases = false;
        Consumer::start(
            only_other,
            Handlers::new().on("job", move |_| {
                *started.lock() = true;
                std::thread::sleep(Duration::from_secs(30));
                Ok(())
            }),
        )
        .unwrap()
    };
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(split.id.clone(), now_ms())],
    );
    wait_until("A's handler", || *started.lock());
    a.abort();
    // B claims and reaps every shard; shard 0's node stops answering.
    let fired: Fired = Arc::default();
    let b = Consumer::start(split.cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("B's first claims", || b.stats().claims >= 6);
    let paused_at = split.pause();
    assert!(
        fired.lock().is_empty(),
        "reaped before the pause: the test shows nothing"
    );
    wait_until("the reaped task", || fired.lock().contains_key(&split.id));
    let fired_ms = fired.lock()[&split.id][0].1 / 1_000;
    assert!(
        fired_ms < paused_at + WITHIN_PAUSE,
        "fired {} ms after the pause began: the reaper waited on the paused node",
        fired_ms.saturating_sub(paused_at)
    );
    assert!(b.stats().recovered >= 1, "{:?}", b.stats());
    SplitCluster::wait_out(paused_at);
    b.shutdown(Duration::from_secs(5)).unwrap();
}

/// A shard whose node stops answering delays no other shard's tasks: each shard has its own
/// claim loop. (One loop used to claim the shards one after another, so a paused node held
/// every shard's claims for as long as the pause.)
#[test]
fn a_paused_node_delays_no_other_shards_tasks() {
    let split = SplitCluster::start("paused", |_| {});
    let fired: Fired = Arc::default();
    let c = Consumer::start(split.cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_until("first claims", || c.stats().claims >= 6);
    // The producer's first enqueue loads its script on every node (SCRIPT LOAD goes to all
    // of them): done before the pause, as a running producer has.
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![("warm-up".into(), now_ms() + 3_600_000)],
    );
    let paused_at = split.pause();
    let due = paused_at + 500;
    enqueue_all(&split.rt, &split.p, "job", vec![(split.id.clone(), due)]);
    wait_until("the task on the other node", || {
        fired.lock().contains_key(&split.id)
    });
    let fired_ms = fired.lock()[&split.id][0].1 / 1_000;
    assert!(
        fired_ms < paused_at + WITHIN_PAUSE,
        "due {} ms after the pause began, fired after {} ms: behind the paused node",
        due - paused_at,
        fired_ms.saturating_sub(paused_at)
    );
    SplitCluster::wait_out(paused_at);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A shard whose node stops answering delays no other shard's acks: the ack of a task on the
/// paused node hangs, and a task on another node still gets its ack written. (The resolver used
/// to write the shards' acks one after another and wait on each, so the hung ack held back every
/// other shard's, and behind them the handlers, blocked on a full outcome channel.)
#[test]
fn a_paused_node_delays_no_other_shards_acks() {
    let split = SplitCluster::start("acks", |cfg| cfg.handler_threads = 2);
    let on_paused = (0..)
        .map(|i| format!("p{i}"))
        .find(|id| shard_of(id, 6) == 0)
        .unwrap();
    let (release_tx, release) = crossbeam_channel::bounded::<()>(1);
    let (started_tx, started) = crossbeam_channel::bounded::<()>(1);
    let handlers = {
        let on_paused = on_paused.clone();
        Handlers::new().on("job", move |t| {
            if t.id == on_paused {
                let _ = started_tx.send(());
                let _ = release.recv();
            }
            Ok(())
        })
    };
    let c = Consumer::start(split.cfg.clone(), handlers).unwrap();
    wait_until("first claims", || c.stats().claims >= 6);
    // A running consumer has acked on every node before: the first call of a script loads it
    // on all of them (SCRIPT LOAD goes to every node), which would wait for the paused one.
    let warm_up = (0..)
        .map(|i| format!("w{i}"))
        .find(|id| shard_of(id, 6) == split.other)
        .unwrap();
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(warm_up, now_ms()), (on_paused.clone(), now_ms())],
    );
    started.recv_timeout(Duration::from_secs(10)).unwrap();
    wait_until("the warm-up's ack", || c.stats().acked == 1);
    let paused_at = split.pause();
    // Its handler returns now: its ack goes to the paused node and hangs there.
    release_tx.send(()).unwrap();
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(split.id.clone(), paused_at + 300)],
    );
    wait_until("the other shard's ack", || c.stats().acked >= 2);
    let acked_ms = now_ms();
    assert!(
        acked_ms < paused_at + WITHIN_PAUSE,
        "acked {} ms after the pause began: behind the paused node's ack",
        acked_ms.saturating_sub(paused_at)
    );
    assert_eq!(c.stats().acked, 2, "the paused node acked during its pause");
    SplitCluster::wait_out(paused_at);
    wait_until("the paused node's ack", || c.stats().acked == 3);
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A shard whose node stops answering delays no other shard's lease renewals: a task on
/// another node whose handler runs past its lease keeps it, and runs once. (The resolver
/// renewed the shards one after another, inline, so a renewal hung on the paused node held back
/// every other shard's, and their leases ran out.)
#[test]
fn a_paused_node_delays_no_other_shards_renewals() {
    let split = SplitCluster::start("renewals", |cfg| {
        cfg.handler_threads = 3;
        // Renewed every 1 s: a renewal may come 2 s late (a loaded machine) before the lease
        // runs out.
        cfg.lease = Duration::from_millis(3_000);
        cfg.reaper_interval = Duration::from_millis(50);
    });
    let on_paused = (0..)
        .map(|i| format!("p{i}"))
        .find(|id| shard_of(id, 6) == 0)
        .unwrap();
    let warm_up = (0..)
        .map(|i| format!("w{i}"))
        .find(|id| shard_of(id, 6) == split.other)
        .unwrap();
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let (release_tx, release) = crossbeam_channel::bounded::<()>(1);
    let handlers = {
        let (runs, on_paused, warm_up) = (runs.clone(), on_paused.clone(), warm_up.clone());
        Handlers::new().on("job", move |t| {
            *runs.lock().entry(t.id.clone()).or_default() += 1;
            if t.id == on_paused {
                let _ = release.recv_timeout(Duration::from_secs(30));
            } else if t.id == warm_up {
                // Across two renewals, so the script is loaded on every node before the pause.
                std::thread::sleep(Duration::from_millis(2_500));
            } else {
                // Past its lease; acked about 4.5 s into the pause, 2.5 s before
                // `WITHIN_PAUSE`.
                std::thread::sleep(Duration::from_millis(3_500));
            }
            Ok(())
        })
    };
    let c = Consumer::start(split.cfg.clone(), handlers).unwrap();
    wait_until("first claims", || c.stats().claims >= 6);
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(warm_up, now_ms()), (on_paused.clone(), now_ms())],
    );
    wait_until("the warm-up's ack", || c.stats().acked == 1);
    assert!(c.stats().renewed >= 1, "{:?}", c.stats());
    // Shard 0's task is running: its renewals go to the paused node and hang there.
    let paused_at = split.pause();
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        vec![(split.id.clone(), paused_at + 100)],
    );
    wait_until("the other shard's task, done", || c.stats().acked >= 2);
    assert!(
        now_ms() < paused_at + WITHIN_PAUSE,
        "acked {} ms after the pause began",
        now_ms() - paused_at
    );
    // A duplicate shows up within the handler's run after a lost lease was reaped.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        runs.lock().get(&split.id),
        Some(&1),
        "its lease ran out while its handler ran: renewals waited on the paused node"
    );
    SplitCluster::wait_out(paused_at);
    release_tx.send(()).unwrap();
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn the_queue_spreads_over_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(urls[0].clone(), "clustered");
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    let p = producer(&rt, &cfg);
    let fired: Fired = Arc::default();
    let consumers: Vec<Consumer> = (0..2)
        .map(|i| Consumer::start(cfg.clone(), recorder(&fired, i, "job")).unwrap())
        .collect();
    let due = now_ms() + 1_000;
    let n = 3_000;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..n)
            .map(|i| (format!("c{i}"), due + i as u64 % 500))
            .collect(),
    );
    // The shards' keys live on different nodes.
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
    wait_until("every task on the cluster", || fired.lock().len() == n);
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id} fired {} times", d.len());
    }
    wait_until("acks", || {
        consumers.iter().map(|c| c.stats().acked).sum::<u64>() == n as u64
    });
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
}

/// One consumer with one handler thread whose handler records the id and takes `handler`:
/// `n` tasks due at once, and the first handler already running when this returns.
fn busy_single_handler(
    ns: &str,
    n: usize,
    handler: Duration,
) -> (Fixture, Arc<Mutex<Vec<String>>>, Consumer) {
    let fixture = fixture(ns, |cfg| {
        cfg.handler_threads = 1;
    });
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let handlers = {
        let runs = runs.clone();
        Handlers::new().on("job", move |t| {
            runs.lock().push(t.id.clone());
            std::thread::sleep(handler);
            Ok(())
        })
    };
    let c = Consumer::start(fixture.cfg.clone(), handlers).unwrap();
    let due = now_ms() + 300;
    enqueue_all(
        &fixture.rt,
        &fixture.p,
        "job",
        (0..n).map(|i| (format!("q{i}"), due)).collect(),
    );
    // Every task claimed and past its due time, so every timer has fired (the first handler
    // runs, the others wait for its thread) and none is still in the wheel.
    wait_until("every task claimed", || c.stats().claimed == n as u64);
    wait_until("the first handler", || !runs.lock().is_empty());
    // Two seconds past the due time: a driver held up that long on a loaded machine would
    // leave timers unfired, which a shutdown hands back instead of running.
    std::thread::sleep(Duration::from_millis(
        (due + 2_000).saturating_sub(now_ms()),
    ));
    (fixture, runs, c)
}

#[test]
fn shutdown_runs_tasks_already_fired_and_queued_for_a_busy_handler() {
    let (
        Fixture {
            server: _server,
            rt,
            p,
            ..
        },
        runs,
        c,
    ) = busy_single_handler("queued", 10, Duration::from_millis(700));
    // Most of the ten have fired and wait for the one handler thread.
    c.shutdown(Duration::from_secs(20)).unwrap();
    let mut runs = runs.lock().clone();
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), 10, "queued tasks were dropped at shutdown");
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!(
        (depth.queued, depth.leased),
        (0, 0),
        "left leased: {depth:?}"
    );
}

/// A shutdown whose timeout passes while handlers are busy: the tasks queued behind them do
/// not start on this consumer afterwards (their acks could no longer be sent, so they would run
/// twice); they are left to their leases.
#[test]
fn a_timed_out_shutdown_starts_no_more_handlers() {
    let (_fixture, runs, c) = busy_single_handler("timedout", 5, Duration::from_millis(700));
    let _ = c.shutdown(Duration::from_millis(50));
    let after_shutdown = runs.lock().len();
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(
        runs.lock().len(),
        after_shutdown,
        "handlers started after shutdown returned"
    );
}

/// A dead-letter hash in Redis's hashtable encoding, where HSCAN's COUNT is only a hint: the
/// listing follows the cursor and stops at the limit. And a dead record that names another id
/// is refused by `requeue`.
#[test]
fn dead_letters_lists_up_to_the_limit_from_a_large_hash() {
    let Fixture { server, rt, p, .. } = fixture("manydead", |_| {});
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut hset = redis::cmd("HSET");
    hset.arg("{manydead}:dead");
    for i in 0..500 {
        hset.arg(format!("d{i}"))
            .arg(r#"{"reason":"test","raw":"{}","at":1,"attempt":5}"#);
    }
    let _: () = hset.query(&mut conn).unwrap();
    let some = rt.block_on(p.dead_letters(300)).unwrap();
    assert_eq!(some.len(), 300);
    let mut all: Vec<String> = rt
        .block_on(p.dead_letters(1_000))
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 500);
    // A record whose envelope names another id is not a task to requeue under this one.
    let other = delaywheel::redis::Envelope {
        id: "other".into(),
        topic: "job".into(),
        payload: serde_json::Value::Null,
        attempt: 5,
        created_at: 1,
        headers: Default::default(),
        due_at: 1,
    };
    let record = serde_json::json!({
        "reason": "envelope id does not match its key",
        "raw": String::from_utf8(other.encode(4096).unwrap()).unwrap(),
        "at": 1,
    });
    let _: () = redis::cmd("HSET")
        .arg("{manydead}:dead")
        .arg("x")
        .arg(record.to_string())
        .query(&mut conn)
        .unwrap();
    assert!(matches!(
        rt.block_on(p.requeue("x")),
        Err(QueueError::NotAnEnvelope(id)) if id == "x"
    ));
}

#[test]
fn a_reclaimed_id_fires_once_with_its_newest_version() {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(server.url(), "reclaim");
    cfg.reconcile = Duration::from_millis(100);
    // The first version is claimed at once, and due late enough that a stalled machine does
    // not fire it before the test replaces it.
    cfg.lookahead = Duration::from_secs(10);
    let mut quiet = cfg.clone();
    quiet.notify = false; // the replacement gets no wake-up: the next reconcile claims it
    let p = producer(&rt, &quiet);
    let seen: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let handlers = {
        let seen = seen.clone();
        Handlers::new().on("job", move |t| {
            seen.lock().push(t.payload.clone());
            Ok(())
        })
    };
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    let envelope = |payload: i32, due_at: u64| delaywheel::redis::Envelope {
        id: "x".into(),
        topic: "job".into(),
        payload: serde_json::json!(payload),
        attempt: 0,
        created_at: now_ms(),
        headers: Default::default(),
        due_at,
    };
    let due = now_ms() + 3_000;
    assert!(rt
        .block_on(p.enqueue_envelope(envelope(1, due), false))
        .unwrap());
    wait_until("the claim", || c.held() == 1);
    assert!(rt
        .block_on(p.enqueue_envelope(envelope(2, due + 100), true))
        .unwrap());
    wait_until("the second claim", || c.stats().claimed == 2);
    wait_until("the delivery", || !seen.lock().is_empty());
    wait_until("its ack", || c.stats().acked == 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(*seen.lock(), vec![serde_json::json!(2)]);
    assert_eq!(c.stats().refused, 0);
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// At shutdown, a shard whose node stops answering keeps back only its own tasks: the other
/// shards' held tasks are handed back to the queue. (The hand-back went shard by shard in a
/// map's order and stopped at the first failure, so the shards after the paused one left
/// their tasks leased until the lease ran out, each counted as an expiry.)
#[test]
fn a_paused_node_keeps_back_no_other_shards_hand_back() {
    let split = SplitCluster::start("handback", |cfg| {
        cfg.lookahead = Duration::from_secs(120);
    });
    let c = Consumer::start(split.cfg.clone(), Handlers::new()).unwrap();
    wait_until("first claims", || c.stats().claims >= 6);
    // One task per shard, due in a minute: claimed and held, none fired.
    let ids: Vec<(u32, String)> = (0..6)
        .map(|s| {
            let id = (0..)
                .map(|i| format!("h{i}"))
                .find(|id| shard_of(id, 6) == s)
                .unwrap();
            (s, id)
        })
        .collect();
    let due = now_ms() + 60_000;
    enqueue_all(
        &split.rt,
        &split.p,
        "job",
        ids.iter().map(|(_, id)| (id.clone(), due)).collect(),
    );
    wait_until("all six held", || c.held() == 6);
    let paused_at = split.pause();
    // A claim or reap on the paused node holds the wait for the loops to its end, half the
    // timeout: the healthy shards' hand-back keeps the other half (it had only a 100 ms floor
    // when that wait took all of it). Well within the pause.
    let r = c.shutdown(Duration::from_millis(2_000));
    assert!(
        r.is_err(),
        "the paused node's shard cannot have been handed back"
    );
    SplitCluster::wait_out(paused_at);
    let client = redis::cluster::ClusterClient::new(split.urls.clone()).unwrap();
    let mut conn = client.get_connection().unwrap();
    for (shard, id) in &ids {
        let queued: Option<f64> = redis::cmd("ZSCORE")
            .arg(format!("{{handback:{shard}}}:due"))
            .arg(id)
            .query(&mut conn)
            .unwrap();
        if split.healthy.contains(shard) {
            assert!(
                queued.is_some(),
                "shard {shard}'s task {id} was not handed back"
            );
        }
    }
}

/// A claim that Redis refuses at once is retried with backoff even with `claim_margin` 0.
/// (The backoff grew from `claim_margin`: from 0 it stayed 0, and each claim loop asked Redis
/// again back to back, thousands of times a second.)
#[test]
fn a_failing_claim_backs_off_even_with_no_claim_margin() {
    let Fixture { server, cfg, .. } = fixture("spin", |cfg| {
        cfg.claim_margin = Duration::ZERO;
        cfg.reaper_interval = Duration::from_secs(3_600);
    });
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    // Every script call, failed or not: `calls` and `rejected_calls` of EVAL and EVALSHA.
    let script_calls = |conn: &mut redis::Connection| -> u64 {
        let stats: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_eval"))
            .flat_map(|l| l.split([':', ',']))
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| *k == "calls" || *k == "rejected_calls")
            .map(|(_, v)| v.parse::<u64>().unwrap())
            .sum()
    };
    let c = Consumer::start(cfg, Handlers::new()).unwrap();
    // Once it runs (`Consumer::start` refuses a key of the wrong type), the queue's ZSET
    // becomes a string: every claim fails at once (WRONGTYPE).
    redis::cmd("SET")
        .arg("{spin}:due")
        .arg("not a zset")
        .query::<()>(&mut conn)
        .unwrap();
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut conn)
        .unwrap();
    // Two failed claims at least (or the test shows nothing), then a second's worth.
    wait_until("claims to fail", || script_calls(&mut conn) >= 2);
    let before = script_calls(&mut conn);
    std::thread::sleep(Duration::from_secs(1));
    let calls = script_calls(&mut conn) - before;
    c.abort();
    assert!(
        calls < 50,
        "{calls} script calls in one second: the claims spin"
    );
}

/// A shutdown whose timeout ends while a handler still runs hands back the fired tasks whose
/// handlers had not started (queued behind it): they go back to the queue at once, not to the
/// end of their lease. (They stayed leased, a lease late, each counted as an expiry.)
#[test]
fn a_shutdown_that_times_out_hands_back_tasks_waiting_for_a_handler() {
    let Fixture { server, rt, cfg, p } = fixture("queued", |cfg| cfg.handler_threads = 1);
    let (started_tx, started) = crossbeam_channel::bounded::<()>(1);
    let c = Consumer::start(
        cfg,
        Handlers::new().on("job", move |t| {
            if t.id == "slow" {
                let _ = started_tx.send(());
                // Still running at the checks below, however slow the machine; it finishes
                // on its own after the shutdown, which does not wait for it.
                std::thread::sleep(Duration::from_secs(10));
            }
            Ok(())
        }),
    )
    .unwrap();
    let now = now_ms();
    enqueue_all(&rt, &p, "job", vec![("slow".into(), now)]);
    started
        .recv_timeout(PATIENCE)
        .expect("the slow handler ran");
    enqueue_all(
        &rt,
        &p,
        "job",
        vec![("q1".into(), now_ms()), ("q2".into(), now_ms())],
    );
    // Fired, and waiting for the one handler thread.
    wait_until("the queued tasks fired", || {
        c.held() == 2 && c.stats().claimed == 3
    });
    // Due at once: their timers fire as soon as they are armed; this is long enough for that
    // on a loaded machine (an unfired timer would be handed back by the earlier step, and the
    // test would show nothing).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        c.stats().fired,
        1,
        "a queued task ran: the test shows nothing"
    );
    let given = c.shutdown(Duration::from_millis(300)).unwrap();
    assert_eq!(given, 2);
    assert_handed_back(&server, "queued", &["q1", "q2"]);
}

/// A queue handler (on a plain pool thread) uses `Dedup` through a runtime the application
/// owns, as the README says: the marker is taken and finished, and a second delivery of the
/// id finds the work done.
#[test]
fn a_handler_uses_dedup_through_its_own_runtime() {
    let Fixture { server, rt, cfg, p } = fixture("dedup-handler", |_| {});
    let rt = Arc::new(rt);
    let dedup = rt
        .block_on(delaywheel::redis::Dedup::connect(
            &server.url(),
            "dedup-handler-markers",
            Duration::from_secs(5),
            Duration::from_secs(3_600),
        ))
        .unwrap();
    let seen: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
    let handlers = {
        let (rt, dedup, seen) = (rt.clone(), dedup.clone(), seen.clone());
        Handlers::new().on("job", move |task| {
            match rt
                .block_on(dedup.begin(&task.id))
                .map_err(|e| e.to_string())?
            {
                delaywheel::redis::Begin::Run(claim) => {
                    seen.lock().push((task.id.clone(), true));
                    rt.block_on(dedup.finish(&claim))
                        .map_err(|e| e.to_string())?;
                }
                _ => seen.lock().push((task.id.clone(), false)),
            }
            Ok(())
        })
    };
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("once".into(), now_ms())]);
    wait_until("the first delivery's ack", || c.stats().acked == 1);
    // The same id again (a redelivery): the marker says done.
    enqueue_all(&rt, &p, "job", vec![("once".into(), now_ms())]);
    wait_until("the second delivery", || seen.lock().len() == 2);
    assert_eq!(
        *seen.lock(),
        [("once".to_string(), true), ("once".to_string(), false)]
    );
    c.shutdown(Duration::from_secs(5)).unwrap();
}
