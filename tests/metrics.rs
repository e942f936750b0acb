//! The metrics the engine and the Redis layer publish through the `metrics` facade, read back
//! from a debugging recorder. (One test in its own binary: the recorder is process-global.)
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Consumer, Handlers, PersistConfig, Persistent, Producer, QueueConfig, When,
};
use delaywheel::Timer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// name → (counter total, last gauge, histogram samples) over all label sets, accumulated
/// across snapshots (the debugging recorder hands counters and histograms out as deltas, and
/// swaps every gauge to 0 when it reads it: a gauge reads non-zero only if it was set since).
#[derive(Default)]
struct Seen(HashMap<String, (u64, f64, usize)>);

impl Seen {
    fn read(
        &mut self,
        snapshotter: &metrics_util::debugging::Snapshotter,
    ) -> &HashMap<String, (u64, f64, usize)> {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let e = self.0.entry(key.key().name().to_string()).or_default();
            match value {
                DebugValue::Counter(c) => e.0 += c,
                DebugValue::Gauge(g) => e.1 = g.into_inner(),
                DebugValue::Histogram(h) => e.2 += h.len(),
            }
        }
        &self.0
    }
}

#[test]
fn the_engine_persistence_and_queue_publish_their_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");
    let mut seen = Seen::default();

    // The engine: stats() publishes counters, pending gauges and lateness.
    let (timer, expired) = Timer::builder().build_channel(None).unwrap();
    let a = timer.schedule(1u32, Duration::from_secs(60)).unwrap();
    timer.schedule(2u32, Duration::from_millis(1)).unwrap();
    timer.cancel(a);
    expired.recv_timeout(Duration::from_secs(10)).unwrap();
    timer.schedule(3u32, Duration::from_secs(60)).unwrap();
    // The driver records a delivery's lateness once its send returns, which may be after
    // the consumer has it; each `stats()` publishes, so the last one read counts.
    let start = Instant::now();
    while timer.stats().lateness.count < 1 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no lateness recorded"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let m = seen.read(&snapshotter).clone();
    assert_eq!(m["delaywheel_scheduled_total"].0, 3);
    assert_eq!(m["delaywheel_cancelled_total"].0, 1);
    assert_eq!(m["delaywheel_fired_total"].0, 1);
    assert_eq!(m["delaywheel_pending"].1, 1.0, "one timer pending");
    // The lateness gauges carry the histogram's figures (nothing fired since they were read).
    let lateness = timer.stats().lateness;
    assert_eq!(
        m["delaywheel_lateness_p99_seconds"].1,
        lateness.p99.as_secs_f64()
    );

    // Two engines in one process publish series of their own, labelled by name: the counts
    // add up, where one series set absolutely by each engine in turn kept the larger.
    let fire = |name: &str, n: u32| {
        let (t, rx) = Timer::builder().name(name).build_channel(None).unwrap();
        for i in 0..n {
            t.schedule(i, Duration::ZERO).unwrap();
        }
        for _ in 0..n {
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        t
    };
    let (a, b) = (fire("a", 3), fire("b", 2));
    a.stats();
    b.stats();
    let engines: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "delaywheel_fired_total")
        .filter_map(|(key, _, _, value)| {
            let engine = key.key().labels().find(|l| l.key() == "engine")?;
            match value {
                DebugValue::Counter(c) => Some((engine.value().to_string(), c)),
                _ => None,
            }
        })
        .collect();
    for (name, n) in [("a", 3), ("b", 2)] {
        assert!(
            engines.contains(&(name.to_string(), n)),
            "engine {name}: {engines:?}"
        );
    }

    // Persistence: journal depth and lag, flushed operations, failures while Redis is down.
    let mut server = redis_server::RedisServer::start();
    let (p, _fired) = Persistent::start(PersistConfig::new(server.url(), "m")).unwrap();
    for i in 0..10 {
        p.schedule_at_ms(
            format!("t{i}"),
            "t",
            serde_json::Value::Null,
            now_ms() + 60_000,
        )
        .unwrap();
    }
    assert!(p.flush(Duration::from_secs(30)));
    server.kill();
    p.schedule_at_ms("down", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(!p.flush(Duration::from_millis(300)));
    // Each retry round publishes the journal's depth and lag: the unwritten change shows.
    let (mut depth, mut lag) = (0.0f64, 0.0f64);
    let start = Instant::now();
    while depth < 1.0 || lag <= 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "journal depth {depth}, lag {lag} while redis is down"
        );
        std::thread::sleep(Duration::from_millis(20));
        let m = seen.read(&snapshotter);
        depth = depth.max(m["delaywheel_journal_depth"].1);
        lag = lag.max(m["delaywheel_flush_lag_seconds"].1);
    }
    let m = seen.read(&snapshotter).clone();
    assert_eq!(m["delaywheel_flushed_ops_total"].0, 10);
    assert!(m["delaywheel_flush_failures_total"].0 >= 1);
    server.restart();
    assert!(p.flush(Duration::from_secs(30)));
    assert_eq!(
        seen.read(&snapshotter)["delaywheel_flushed_ops_total"].0,
        11
    );
    drop(p);

    // Redis lost the namespace (restarted empty) under a running engine: counted as a loss of
    // Redis data, and the engine writes again (its writing gauge back at 1).
    let losses = seen
        .read(&snapshotter)
        .get("delaywheel_store_data_loss_total")
        .map_or(0, |m| m.0);
    let mut empty = redis_server::RedisServer::start_in_memory();
    let mut cfg = PersistConfig::new(empty.url(), "lossy");
    cfg.engine_lease = Duration::from_millis(600);
    let (p, _fired) = Persistent::start(cfg).unwrap();
    p.schedule_at_ms("kept", "t", serde_json::Value::Null, now_ms() + 60_000)
        .unwrap();
    assert!(p.flush(Duration::from_secs(30)));
    empty.restart();
    let start = Instant::now();
    loop {
        let m = seen.read(&snapshotter);
        let lost = m.get("delaywheel_store_data_loss_total").map_or(0, |m| m.0);
        let writing = m.get("delaywheel_persist_writing").map_or(0.0, |m| m.1);
        if lost > losses && writing == 1.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "data losses {lost} (before: {losses}), writing gauge {writing}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(p);

    // The queue: depth, leased, dead, claim batches, lateness, commands per fired task.
    let mut cfg = QueueConfig::new(server.url(), "mq");
    cfg.reaper_interval = Duration::from_millis(50);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let producer = rt.block_on(Producer::connect(cfg.clone())).unwrap();
    let c = Consumer::start(cfg, Handlers::new().on("job", |_| Ok(()))).unwrap();
    // Due in an hour: they stay queued, and the depth gauge must count them.
    for i in 0..5 {
        rt.block_on(producer.enqueue(
            format!("far{i}"),
            "job",
            serde_json::Value::Null,
            When::After(Duration::from_secs(3_600)),
        ))
        .unwrap();
    }
    for i in 0..20 {
        rt.block_on(producer.enqueue(
            format!("j{i}"),
            "job",
            serde_json::Value::Null,
            When::After(Duration::from_millis(100)),
        ))
        .unwrap();
    }
    let start = Instant::now();
    while c.stats().acked < 20 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "tasks did not fire"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // A reaper round (every 50 ms) samples the depth (the five far tasks) and the commands per
    // fired task.
    let start = Instant::now();
    let (mut depth, mut per_task) = (None, 0.0f64);
    let mut m = seen.read(&snapshotter).clone();
    while depth != Some(5.0) || per_task <= 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "queue depth {depth:?}, commands per task {per_task}"
        );
        std::thread::sleep(Duration::from_millis(20));
        m = seen.read(&snapshotter).clone();
        let gauge = |name: &str| m.get(name).map(|g| g.1);
        if let Some(5.0) = gauge("delaywheel_queue_depth") {
            depth = Some(5.0);
        }
        per_task = per_task.max(gauge("delaywheel_queue_commands_per_fired_task").unwrap_or(0.0));
    }
    assert_eq!(m["delaywheel_queue_fired_total"].0, 20);
    assert_eq!(m["delaywheel_queue_lateness_seconds"].2, 20);
    assert!(m["delaywheel_queue_claim_batch"].2 >= 1);
    assert!(m["delaywheel_queue_redis_commands_total"].0 >= 20); // the enqueues and more
    assert!(per_task < 100.0, "{per_task}");
    for gauge in [
        "delaywheel_queue_depth",
        "delaywheel_queue_leased",
        "delaywheel_queue_dead",
    ] {
        assert!(m.contains_key(gauge), "{gauge} missing");
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}
