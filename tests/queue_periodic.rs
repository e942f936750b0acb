//! Periodic tasks: schedules kept in Redis, and schedulers in several instances that enqueue
//! each occurrence once, on one Redis and on a 3-node cluster; listing and removing; the
//! catch-up after a stop. (Time zones and the policies' arithmetic are unit-tested.)
#![cfg(feature = "periodic")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{
    CatchUp, Consumer, Periodic, PeriodicError, Producer, QueueConfig, Scheduler,
};
use queue_kit::*;
use redis_cluster::RedisCluster;

/// The occurrences (ms) of schedule `name` that ran, each with how many times.
fn runs(fired: &Fired, name: &str) -> Vec<(u64, usize)> {
    let prefix = format!("periodic:{name}:");
    let mut out: Vec<(u64, usize)> = fired
        .lock()
        .iter()
        .filter_map(|(id, d)| Some((id.strip_prefix(&prefix)?.parse().ok()?, d.len())))
        .collect();
    out.sort_unstable();
    out
}

/// Three schedulers, one of them started late, a 1 s schedule: every occurrence in the span
/// runs, exactly once.
fn once_per_occurrence(rt: &tokio::runtime::Runtime, cfg: &QueueConfig, secs: u64) {
    let p = producer(rt, cfg);
    let every = Periodic::interval(
        "tick",
        Duration::from_secs(1),
        "tick",
        serde_json::Value::Null,
    )
    .unwrap();
    assert!(!rt.block_on(p.add_periodic(&every)).unwrap());
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "tick")).unwrap();
    let producers: Vec<Producer> = (0..3).map(|_| producer(rt, cfg)).collect();
    let early: Vec<Scheduler> = {
        let _in = rt.enter();
        producers[..2]
            .iter()
            .map(|p| Scheduler::start(p.clone()))
            .collect()
    };
    std::thread::sleep(Duration::from_secs(secs / 2));
    let late = {
        let _in = rt.enter();
        Scheduler::start(producers[2].clone())
    };
    std::thread::sleep(Duration::from_secs(secs - secs / 2));
    for s in early.into_iter().chain([late]) {
        rt.block_on(s.stop());
    }
    // The last ones enqueued (a second ahead) fire too.
    std::thread::sleep(Duration::from_millis(1_500));
    let ran = runs(&fired, "tick");
    assert!(
        ran.len() as u64 >= secs - 1,
        "only {} occurrences in {secs} s: {ran:?}",
        ran.len()
    );
    for (occurrence, n) in &ran {
        assert_eq!(*n, 1, "occurrence {occurrence} ran {n} times");
    }
    for w in ran.windows(2) {
        assert_eq!(
            w[1].0 - w[0].0,
            1_000,
            "a gap or an odd occurrence: {ran:?}"
        );
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn three_schedulers_run_each_occurrence_once() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        ..
    } = fixture("periodic", |cfg| cfg.shards = 2);
    once_per_occurrence(&rt, &cfg, 8);
}

#[test]
fn schedulers_on_a_redis_cluster_run_each_occurrence_once() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(urls[0].clone(), "periodic-cluster");
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    once_per_occurrence(&rt, &cfg, 5);
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
}

#[test]
fn schedules_are_listed_and_removed_and_bad_ones_refused() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("periodic-list", |_| {});
    let a = Periodic::interval(
        "a",
        Duration::from_secs(5),
        "x",
        serde_json::json!({"k": 1}),
    )
    .unwrap();
    let b = Periodic::cron(
        "b",
        "30 9 * * 1-5",
        "America/New_York",
        "y",
        serde_json::Value::Null,
    )
    .unwrap()
    .catch_up(CatchUp::Latest);
    rt.block_on(p.add_periodic(&a)).unwrap();
    rt.block_on(p.add_periodic(&b)).unwrap();
    assert_eq!(
        rt.block_on(p.periodics()).unwrap(),
        vec![a.clone(), b.clone()]
    );
    // Another instance reads the same.
    let other = producer(&rt, &cfg);
    assert_eq!(rt.block_on(other.periodics()).unwrap().len(), 2);
    assert!(rt.block_on(p.remove_periodic("a")).unwrap());
    assert!(!rt.block_on(p.remove_periodic("a")).unwrap());
    assert_eq!(rt.block_on(other.periodics()).unwrap(), vec![b]);

    let null = serde_json::Value::Null;
    assert_eq!(
        Periodic::interval("", Duration::from_secs(1), "t", null.clone()),
        Err(PeriodicError::Name(String::new()))
    );
    assert_eq!(
        Periodic::interval("z", Duration::ZERO, "t", null.clone()),
        Err(PeriodicError::Interval(Duration::ZERO))
    );
    assert!(matches!(
        Periodic::cron("z", "every day", "UTC", "t", null.clone()),
        Err(PeriodicError::Cron(..))
    ));
    assert_eq!(
        Periodic::cron("z", "0 9 * * *", "Mars/Olympus", "t", null),
        Err(PeriodicError::TimeZone("Mars/Olympus".into()))
    );
}

#[test]
fn after_a_five_second_stop_all_catches_up_and_skip_does_not() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("periodic-catch", |_| {});
    let sec = Duration::from_secs(1);
    let all = Periodic::interval("all", sec, "tick", serde_json::Value::Null)
        .unwrap()
        .catch_up(CatchUp::All { max: 100 });
    let skip = Periodic::interval("skip", sec, "tick", serde_json::Value::Null).unwrap();
    rt.block_on(p.add_periodic(&all)).unwrap();
    rt.block_on(p.add_periodic(&skip)).unwrap();
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "tick")).unwrap();
    let run_for = |d: Duration| {
        let s = {
            let _in = rt.enter();
            Scheduler::start(p.clone())
        };
        std::thread::sleep(d);
        rt.block_on(s.stop());
    };
    run_for(Duration::from_secs(2));
    std::thread::sleep(Duration::from_secs(5));
    run_for(Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(1_500));
    let gaps = |name: &str| -> usize {
        let ran: BTreeSet<u64> = runs(&fired, name).into_iter().map(|(t, _)| t).collect();
        let (first, last) = (*ran.first().unwrap(), *ran.last().unwrap());
        ((last - first) / 1_000 + 1) as usize - ran.len()
    };
    assert_eq!(
        gaps("all"),
        0,
        "All left missed occurrences out: {:?}",
        runs(&fired, "all")
    );
    assert!(
        gaps("skip") >= 3,
        "Skip ran missed occurrences: {:?}",
        runs(&fired, "skip")
    );
    for (t, n) in runs(&fired, "all").into_iter().chain(runs(&fired, "skip")) {
        assert_eq!(n, 1, "occurrence {t} ran {n} times");
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// Redis down for 15 s under a running scheduler of a 1 ms schedule: 15 000 occurrences fall
/// meanwhile, more than one round lists (10 000). They fell while the scheduler ran, so none is
/// "missed" (the policy is Skip): every one is enqueued once Redis is back, with no gap. (The
/// first round after the outage counted as a good one, and the next skipped what it had not
/// listed.)
#[test]
fn an_outage_longer_than_a_rounds_listing_skips_nothing() {
    let mut server = redis_server::RedisServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = QueueConfig::new(server.url(), "periodic-outage");
    let p = producer(&rt, &cfg);
    let every_ms = Periodic::interval(
        "ms",
        Duration::from_millis(1),
        "tick",
        serde_json::Value::Null,
    )
    .unwrap();
    rt.block_on(p.add_periodic(&every_ms)).unwrap();
    let s = {
        let _in = rt.enter();
        Scheduler::start(p.clone())
    };
    std::thread::sleep(Duration::from_secs(1));
    server.kill();
    std::thread::sleep(Duration::from_secs(15));
    server.restart();
    let caught_up = || {
        let last: Option<String> = redis::cmd("HGET")
            .arg("{periodic-outage}:periodic:last")
            .arg("ms")
            .query(
                &mut redis::Client::open(server.url())
                    .ok()?
                    .get_connection()
                    .ok()?,
            )
            .ok()?;
        Some(last?.parse::<u64>().ok()? >= delaywheel::redis::now_ms())
    };
    wait_until("the scheduler caught up", || caught_up() == Some(true));
    rt.block_on(s.stop());
    let enqueued: BTreeSet<u64> = server
        .zset_members("{periodic-outage}:due")
        .into_iter()
        .filter_map(|id| id.strip_prefix("periodic:ms:")?.parse().ok())
        .collect();
    let (first, last) = (*enqueued.first().unwrap(), *enqueued.last().unwrap());
    assert!(last - first > 15_000, "from {first} to {last}");
    let missing = (last - first + 1) as usize - enqueued.len();
    assert_eq!(
        missing, 0,
        "{missing} occurrences in [{first}, {last}] never enqueued"
    );
}
