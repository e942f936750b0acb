//! Operating the queue: inspection (`get`, `list`, `latency`) and pause/resume, against a
//! private `redis-server`, and on a 3-node Redis Cluster.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{
    now_ms, Consumer, Handlers, ListCursor, ListState, Producer, QueueConfig, RetryPolicy,
    TaskInfo, TaskState,
};
use queue_kit::*;
use redis_cluster::RedisCluster;

/// Every task of `state`, page by page of `limit`, checking that each page is at most `limit`.
fn list_all(
    rt: &tokio::runtime::Runtime,
    p: &Producer,
    state: ListState,
    limit: usize,
) -> Vec<TaskInfo> {
    let mut all = Vec::new();
    let mut cursor = ListCursor::START;
    for _ in 0..10_000 {
        let page = rt.block_on(p.list(state, &cursor, limit)).unwrap();
        assert!(page.tasks.len() <= limit, "a page of {}", page.tasks.len());
        all.extend(page.tasks);
        match page.next {
            // The text form round-trips, as the CLI passes it back.
            Some(next) => cursor = ListCursor::parse(&next.to_string()).expect("a cursor"),
            None => return all,
        }
    }
    panic!("the listing never ended");
}

fn inspection_on(rt: &tokio::runtime::Runtime, cfg: &QueueConfig) {
    let p = producer(rt, cfg);
    let base = now_ms() + 600_000;
    // 250 tasks over every shard, due out of order, three of them in the same millisecond.
    let tasks: Vec<(String, u64)> = (0..250u64)
        .map(|i| (format!("t{i}"), base + (i * 7919) % 1000))
        .chain((0..3).map(|i| (format!("same{i}"), base + 500)))
        .collect();
    enqueue_all(rt, &p, "job", tasks.clone());

    let t = rt.block_on(p.get("t5")).unwrap().expect("t5 is queued");
    assert_eq!(t.state, TaskState::Scheduled);
    assert_eq!(t.due_at, Some(base + (5 * 7919) % 1000));
    assert_eq!(t.envelope.as_ref().unwrap().topic, "job");
    assert_eq!(t.attempt, 0);
    assert!(rt.block_on(p.get("never enqueued")).unwrap().is_none());

    for limit in [1, 40, 1000] {
        let listed = list_all(rt, &p, ListState::Scheduled, limit);
        let ids: Vec<&str> = listed.iter().map(|t| t.id.as_str()).collect();
        let unique: HashSet<&str> = ids.iter().copied().collect();
        assert_eq!(
            unique.len(),
            tasks.len(),
            "limit {limit}: listed {}",
            ids.len()
        );
        assert_eq!(ids.len(), tasks.len(), "limit {limit}: a task listed twice");
        let dues: Vec<u64> = listed.iter().map(|t| t.due_at.unwrap()).collect();
        assert!(
            dues.windows(2).all(|w| w[0] <= w[1]),
            "limit {limit}: not in due order"
        );
    }
    // Nothing due yet: no latency.
    assert_eq!(rt.block_on(p.latency()).unwrap(), Duration::ZERO);
}

#[test]
fn get_and_list_read_every_shard_in_due_order() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        ..
    } = fixture("inspect", |cfg| cfg.shards = 4);
    inspection_on(&rt, &cfg);
}

/// Many tasks due in one millisecond (an `enqueue_many` of one due time) on two shards: a
/// page's cursor names a task of one shard only, and the other goes on after its id among
/// the tasks of that millisecond. Each is listed once. (The other shard used to step over
/// those ids one by one, up to 10 000, then skip the rest of the millisecond.)
#[test]
fn a_listing_of_many_tasks_due_in_one_millisecond_lists_each_once() {
    let Fixture {
        server: _s, rt, p, ..
    } = fixture("inspect-same", |cfg| cfg.shards = 2);
    let due = now_ms() + 600_000;
    let n = 24_000;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..n).map(|i| (format!("t{i:05}"), due)).collect(),
    );
    let listed = list_all(&rt, &p, ListState::Scheduled, 5_000);
    let unique: HashSet<&str> = listed.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(unique.len(), n, "listed {} of {n}", unique.len());
    assert_eq!(listed.len(), n, "a task listed twice");
}

/// Dead letters listed page by page while an operator requeues the first two of each page
/// (here: removes them): every dead letter is listed. (A page's cursor counted the entries of
/// its `HSCAN` answer it took: a removal before the next page shifted the rest, and one was
/// never listed.)
#[test]
fn dead_letters_removed_between_pages_leave_none_unlisted() {
    let Fixture { server, rt, p, .. } = fixture("inspect-dead", |_| {});
    let record = r#"{"reason":"card declined","raw":"","at":1,"attempt":1}"#;
    for i in 0..30 {
        server.run(&["HSET", "{inspect-dead}:dead", &format!("d{i:02}"), record]);
    }
    let (mut cursor, mut seen) = (ListCursor::START, HashSet::new());
    loop {
        let page = rt.block_on(p.list(ListState::Dead, &cursor, 10)).unwrap();
        for t in page.tasks.iter().take(2) {
            server.run(&["HDEL", "{inspect-dead}:dead", &t.id]);
        }
        for t in page.tasks {
            assert!(seen.insert(t.id.clone()), "{} listed twice", t.id);
        }
        match page.next {
            Some(next) => cursor = ListCursor::parse(&next.to_string()).expect("a cursor"),
            None => break,
        }
    }
    assert_eq!(seen.len(), 30, "listed {seen:?}");
}

#[test]
fn get_and_list_read_a_sharded_queue_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(urls[0].clone(), "inspect-cluster");
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    inspection_on(&rt, &cfg);
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
    cfg.namespace = "pause-cluster".into();
    pause_holds_every_claim_until_resume(&rt, &cfg);
}

#[test]
fn get_and_list_show_leased_and_dead_tasks_and_latency_shows_the_oldest_due_one() {
    let Fixture { server, rt, cfg, p } = fixture("inspect-states", |cfg| {
        cfg.shards = 2;
        cfg.lookahead = Duration::from_secs(60);
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        };
    });
    // Claimed a minute ahead, so they stay leased while the test looks.
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new().on("fail", |_| Err("no such order".into())),
    )
    .unwrap();
    let ahead = now_ms() + 30_000;
    claimed_by(&rt, &p, &c, "lease", 20, ahead);
    let t = rt.block_on(p.get("lease3")).unwrap().unwrap();
    let TaskState::Leased { owner, lease_until } = &t.state else {
        panic!("lease3 is {:?}", t.state);
    };
    assert!(
        owner.contains('|') && *lease_until >= ahead,
        "{owner} {lease_until}"
    );
    assert_eq!(t.due_at, Some(ahead));
    let leased = list_all(&rt, &p, ListState::Leased, 7);
    assert_eq!(leased.len(), 20);
    assert!(leased
        .iter()
        .all(|t| matches!(t.state, TaskState::Leased { .. })));

    // Dead letters: handlers that fail once, with one attempt allowed.
    enqueue_all(
        &rt,
        &p,
        "fail",
        (0..30).map(|i| (format!("dead{i}"), now_ms())).collect(),
    );
    wait_until("30 dead letters", || {
        rt.block_on(p.depth()).unwrap().dead == 30
    });
    let d = rt.block_on(p.get("dead4")).unwrap().unwrap();
    assert!(
        matches!(&d.state, TaskState::Dead { reason, .. } if reason.contains("no such order")),
        "{:?}",
        d.state
    );
    assert_eq!(d.attempt, 1);
    let dead = list_all(&rt, &p, ListState::Dead, 4);
    let ids: HashSet<String> = dead.iter().map(|t| t.id.clone()).collect();
    assert_eq!(ids.len(), 30);

    // An envelope with no queue entry: another client's half-written task.
    let shard0 = delaywheel::redis::KeyLayout::new("inspect-states:0").unwrap();
    let half = (0..)
        .map(|i| format!("half{i}"))
        .find(|id| delaywheel::redis::shard_of(id, 2) == 0)
        .unwrap();
    server.run(&[
        "HSET",
        shard0.tasks(),
        &half,
        r#"{"id":"x","topic":"job","payload":null}"#,
    ]);
    assert_eq!(
        rt.block_on(p.get(&half)).unwrap().unwrap().state,
        TaskState::Unqueued
    );

    // Latency: the oldest due task no consumer claims (an unknown topic's is claimed too, so
    // stop the consumer first).
    c.shutdown(Duration::from_secs(5)).unwrap();
    assert_eq!(rt.block_on(p.latency()).unwrap(), Duration::ZERO);
    enqueue_all(&rt, &p, "job", vec![("late".into(), now_ms() - 2_000)]);
    let late = rt.block_on(p.latency()).unwrap();
    assert!(
        late >= Duration::from_secs(2) && late < Duration::from_secs(60),
        "{late:?}"
    );
}

/// Pause, enqueue, check nothing fires; resume, check everything fires soon after.
fn pause_holds_every_claim_until_resume(rt: &tokio::runtime::Runtime, cfg: &QueueConfig) {
    let p = producer(rt, cfg);
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "paused-job")).unwrap();
    rt.block_on(p.pause()).unwrap();
    assert!(rt.block_on(p.is_paused()).unwrap());
    let n = 100;
    let due = now_ms() + 200;
    enqueue_all(
        rt,
        &p,
        "paused-job",
        (0..n).map(|i| (format!("p{i}"), due)).collect(),
    );
    // Past the due time and more than a reconcile (1 s): a claim would have fired them.
    std::thread::sleep(Duration::from_millis(1_500));
    assert!(fired.lock().is_empty(), "fired while paused");
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, n as u64);
    let resumed = now_us();
    assert!(rt.block_on(p.resume()).unwrap());
    assert!(!rt.block_on(p.is_paused()).unwrap());
    wait_until("every task after the resume", || fired.lock().len() == n);
    let mut late: Vec<u64> = fired
        .lock()
        .values()
        .map(|d| d[0].1.saturating_sub(resumed))
        .collect();
    late.sort_unstable();
    let max = *late.last().unwrap();
    // Woken by the resume, not by a reconcile (1 s later): well under a second.
    assert!(max < 500_000, "fired up to {max} µs after the resume");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_paused_queue_claims_nothing_and_fires_everything_after_resume() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        ..
    } = fixture("pause", |cfg| cfg.shards = 2);
    pause_holds_every_claim_until_resume(&rt, &cfg);
}

#[test]
fn a_consumer_started_while_paused_claims_nothing_until_resume() {
    let Fixture { server, rt, cfg, p } = fixture("pause-start", |_| {});
    rt.block_on(p.pause()).unwrap();
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..10).map(|i| (format!("s{i}"), now_ms())).collect(),
    );
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_for_wake_subscribers(&server, "pause-start", 1);
    std::thread::sleep(Duration::from_millis(1_500));
    assert!(
        fired.lock().is_empty(),
        "a consumer started while paused claimed"
    );
    assert_eq!(c.held(), 0);
    // Enqueue goes on while paused.
    enqueue_all(&rt, &p, "job", vec![("s10".into(), now_ms())]);
    assert_eq!(rt.block_on(p.depth()).unwrap().queued, 11);
    assert!(rt.block_on(p.resume()).unwrap());
    assert!(!rt.block_on(p.resume()).unwrap(), "resumed twice");
    wait_until("every task after the resume", || fired.lock().len() == 11);
    c.shutdown(Duration::from_secs(5)).unwrap();
}
