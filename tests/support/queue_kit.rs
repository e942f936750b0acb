//! What the queue tests share: a private Redis with a producer, a handler that records
//! deliveries, and waiting without sleeping longer than needed. (`#[path]` include.)
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{Consumer, Handlers, Producer, QueueConfig, When};
use futures_util::StreamExt;
use parking_lot::Mutex;

use super::redis_server::RedisServer;

pub const PATIENCE: Duration = Duration::from_secs(30);

pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Fire records: id → (consumer index, fire time µs) per delivery.
pub type Fired = Arc<Mutex<HashMap<String, Vec<(usize, u64)>>>>;

pub fn recorder(fired: &Fired, who: usize, topic: &str) -> Handlers {
    let fired = fired.clone();
    Handlers::new().on(topic, move |task| {
        fired
            .lock()
            .entry(task.id.clone())
            .or_default()
            .push((who, now_us()));
        Ok(())
    })
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `subscribers` consumers of queue `ns` listen for wake-ups (the server counts
/// them), instead of sleeping and hoping they do.
pub fn wait_for_wake_subscribers(server: &RedisServer, ns: &str, subscribers: i64) {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    wait_until("the wake-up subscriptions", || {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(format!("{{{ns}}}:wake"))
            .query(&mut conn)
            .unwrap();
        n >= subscribers
    });
}

/// What most tests start from: a private Redis, a runtime for the async producer, the
/// queue's settings (default, then `tweak`ed) and a producer.
pub struct Fixture {
    pub server: RedisServer,
    pub rt: tokio::runtime::Runtime,
    pub cfg: QueueConfig,
    pub p: Producer,
}

pub fn fixture(ns: &str, tweak: impl FnOnce(&mut QueueConfig)) -> Fixture {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(server.url(), ns);
    tweak(&mut cfg);
    let p = producer(&rt, &cfg);
    Fixture { server, rt, cfg, p }
}

pub fn producer(rt: &tokio::runtime::Runtime, cfg: &QueueConfig) -> Producer {
    rt.block_on(Producer::connect(cfg.clone())).unwrap()
}

/// Enqueues `(id, due)` pairs, 64 in flight at a time over the multiplexed connection.
pub fn enqueue_all(
    rt: &tokio::runtime::Runtime,
    p: &Producer,
    topic: &str,
    tasks: Vec<(String, u64)>,
) {
    rt.block_on(async {
        let results: Vec<_> = futures_util::stream::iter(tasks)
            .map(|(id, due)| {
                p.enqueue(
                    id,
                    topic.to_owned(),
                    serde_json::Value::Null,
                    When::AtMs(due),
                )
            })
            .buffer_unordered(64)
            .collect()
            .await;
        for r in results {
            assert!(r.unwrap(), "a fresh id was refused");
        }
    });
}

/// Each of `ids` is back in the queue of namespace `ns` (one shard), leased by no one:
/// handed back.
pub fn assert_handed_back(server: &RedisServer, ns: &str, ids: &[&str]) {
    for id in ids {
        let queued = server.run(&["ZSCORE", &format!("{{{ns}}}:due"), id]);
        let leased = server.run(&["ZSCORE", &format!("{{{ns}}}:lease"), id]);
        assert!(
            queued != redis::Value::Nil && leased == redis::Value::Nil,
            "{id}: queued {queued:?}, leased {leased:?}"
        );
    }
}

/// Enqueues `n` tasks `{prefix}0`, `{prefix}1`, ... of topic `job`, due at `due` (ms), and
/// waits until consumer `c` has claimed them all.
pub fn claimed_by(
    rt: &tokio::runtime::Runtime,
    p: &Producer,
    c: &Consumer,
    prefix: &str,
    n: usize,
    due: u64,
) {
    enqueue_all(
        rt,
        p,
        "job",
        (0..n).map(|i| (format!("{prefix}{i}"), due)).collect(),
    );
    wait_until("the consumer to claim them all", || c.held() == n);
}
