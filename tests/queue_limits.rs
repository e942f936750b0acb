//! Rate limits and concurrency caps per topic, held across several consumers, on one Redis and
//! on a 3-node cluster: the counts are taken by the handlers themselves.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{Consumer, Handlers, QueueConfig, TopicLimit};
use queue_kit::*;
use redis_cluster::RedisCluster;

/// The wheel's tick: a start may come this much after its slot.
const TICK_US: u64 = 2_000;

/// The most handler starts in any window of `window_us` (less the tick), over `starts`.
fn most_in_a_window(starts: &mut [u64], window_us: u64) -> usize {
    starts.sort_unstable();
    let span = window_us - TICK_US;
    let mut most = 0;
    let mut lo = 0;
    for hi in 0..starts.len() {
        while starts[hi] - starts[lo] >= span {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

fn starts(fired: &Fired) -> Vec<u64> {
    fired
        .lock()
        .values()
        .flat_map(|v| v.iter().map(|(_, t)| *t))
        .collect()
}

/// `n` tasks of `topic`, all due in 300 ms: a backlog the limit spreads out.
fn backlog(f: &Fixture, topic: &str, n: usize) -> Vec<(String, u64)> {
    let due = now_us() / 1_000 + 300;
    let tasks: Vec<(String, u64)> = (0..n).map(|i| (format!("{topic}-{i}"), due)).collect();
    enqueue_all(&f.rt, &f.p, topic, tasks.clone());
    tasks
}

/// 4 consumers under a limit of `limit`/s: every task runs, at most `limit` + the burst in any
/// one-second window, and the limit is used (not far below it).
fn rate_holds(cfg: &QueueConfig, f: &Fixture, limit: u32, tasks: usize) {
    let fired: Fired = Arc::default();
    let consumers: Vec<Consumer> = (0..4)
        .map(|i| Consumer::start(cfg.clone(), recorder(&fired, i, "sms")).unwrap())
        .collect();
    let began = Instant::now();
    backlog(f, "sms", tasks);
    wait_until("every limited task", || fired.lock().len() >= tasks);
    let took = began.elapsed();
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    let burst = cfg.limits["sms"].burst() as usize;
    let mut s = starts(&fired);
    assert_eq!(s.len(), tasks, "a task ran twice");
    let most = most_in_a_window(&mut s, 1_000_000);
    assert!(
        most <= limit as usize + burst,
        "{most} starts in one second, over {limit} + burst {burst}"
    );
    // Not throttled far below the limit either: the backlog drains at about the limit.
    let floor = Duration::from_secs_f64(tasks as f64 / f64::from(limit) * 0.8);
    let ceiling = Duration::from_secs_f64(tasks as f64 / f64::from(limit) * 1.5 + 2.0);
    assert!(
        took >= floor && took <= ceiling,
        "{tasks} tasks at {limit}/s took {took:?}"
    );
    eprintln!("{tasks} tasks at {limit}/s: {took:?}, at most {most} in a second");
}

#[test]
fn four_consumers_keep_to_a_rate_limit_of_100_a_second() {
    let f = fixture("limit-rate", |cfg| {
        *cfg = cfg
            .clone()
            .limit("sms", TopicLimit::new().rate(100, Duration::from_secs(1)));
    });
    rate_holds(&f.cfg.clone(), &f, 100, 1_000);
}

#[test]
fn a_rate_limit_holds_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(urls[0].clone(), "limit-cluster")
        .limit("sms", TopicLimit::new().rate(50, Duration::from_secs(1)));
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    let f = Fixture {
        server: redis_server::RedisServer::start_in_memory(),
        p: producer(&rt, &cfg),
        rt,
        cfg: cfg.clone(),
    };
    rate_holds(&cfg, &f, 50, 300);
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
}

#[test]
fn a_throttled_topic_does_not_delay_an_unthrottled_one() {
    let f = fixture("limit-apart", |cfg| {
        // Room for 300 held tasks, of which 50 may wait for the slow topic's permits.
        cfg.max_held = 300;
        *cfg = cfg.clone().limit(
            "slow",
            TopicLimit::new()
                .rate(10, Duration::from_secs(1))
                .max_waiting(50),
        );
    });
    let fired: Fired = Arc::default();
    let slow = fired.clone();
    let handlers = recorder(&fired, 0, "fast").on("slow", move |t| {
        slow.lock()
            .entry(t.id.clone())
            .or_default()
            .push((1, now_us()));
        Ok(())
    });
    let c = Consumer::start(f.cfg.clone(), handlers).unwrap();
    backlog(&f, "slow", 1_000);
    // The fast topic's tasks come due while the slow one's backlog waits.
    let due0 = now_us() / 1_000 + 1_000;
    let fast: Vec<(String, u64)> = (0..200)
        .map(|i| (format!("fast-{i}"), due0 + i as u64 * 5))
        .collect();
    enqueue_all(&f.rt, &f.p, "fast", fast.clone());
    wait_until("the fast tasks", || {
        let m = fired.lock();
        fast.iter().all(|(id, _)| m.contains_key(id))
    });
    let lateness: Vec<u64> = {
        let m = fired.lock();
        fast.iter()
            .map(|(id, due)| m[id][0].1.saturating_sub(due * 1_000))
            .collect()
    };
    let worst = *lateness.iter().max().unwrap();
    let stats = c.stats();
    c.shutdown(Duration::from_secs(5)).unwrap();
    assert!(
        worst < 100_000,
        "a fast task fired {worst} µs late behind the throttled topic"
    );
    // The slow topic's surplus went back to the queue rather than fill `held`.
    assert!(stats.given_back > 0, "nothing handed back: {stats:?}");
    let slow_ran = fired
        .lock()
        .keys()
        .filter(|k| k.starts_with("slow"))
        .count();
    assert!(
        (5..=40).contains(&slow_ran),
        "{slow_ran} slow tasks ran in about two seconds at 10/s"
    );
}

/// A handler that counts the handlers of its topic running at once, across consumers, and
/// keeps the most it saw.
fn counting(
    topic: &str,
    running: &Arc<AtomicUsize>,
    most: &Arc<AtomicUsize>,
    done: &Arc<AtomicUsize>,
    hold: Duration,
) -> Handlers {
    let (running, most, done) = (running.clone(), most.clone(), done.clone());
    Handlers::new().on(topic, move |_| {
        let now = running.fetch_add(1, SeqCst) + 1;
        most.fetch_max(now, SeqCst);
        std::thread::sleep(hold);
        running.fetch_sub(1, SeqCst);
        done.fetch_add(1, SeqCst);
        Ok(())
    })
}

#[test]
fn a_concurrency_cap_of_3_holds_across_four_consumers() {
    let f = fixture("limit-cap", |cfg| {
        cfg.handler_threads = 4;
        *cfg = cfg.clone().limit("pay", TopicLimit::new().concurrency(3));
    });
    let (running, most, done) = <(Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>)>::default();
    let consumers: Vec<Consumer> = (0..4)
        .map(|_| {
            let h = counting("pay", &running, &most, &done, Duration::from_millis(20));
            Consumer::start(f.cfg.clone(), h).unwrap()
        })
        .collect();
    let began = Instant::now();
    backlog(&f, "pay", 300);
    wait_until("every capped task", || done.load(SeqCst) >= 300);
    let took = began.elapsed();
    let commands: u64 = consumers.iter().map(|c| c.stats().commands).sum();
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    let left = f.server.run(&["ZCARD", "{limit-cap:limit:pay}:running"]);
    assert_eq!(
        left,
        redis::Value::Int(0),
        "slots left after every shutdown"
    );
    let most = most.load(SeqCst);
    assert!(most <= 3, "{most} handlers ran at once under a cap of 3");
    assert!(most >= 2, "the cap was never used past 1: {most}");
    eprintln!("300 tasks of 20 ms under a cap of 3 on 4 consumers: {took:?}, {commands} commands");
}

#[test]
fn a_concurrency_cap_holds_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let mut cfg = QueueConfig::new(urls[0].clone(), "cap-cluster")
        .limit("pay", TopicLimit::new().concurrency(2));
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = producer(&rt, &cfg);
    let (running, most, done) = <(Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>)>::default();
    let consumers: Vec<Consumer> = (0..3)
        .map(|_| {
            let h = counting("pay", &running, &most, &done, Duration::from_millis(20));
            Consumer::start(cfg.clone(), h).unwrap()
        })
        .collect();
    let due = now_us() / 1_000 + 300;
    let tasks: Vec<(String, u64)> = (0..100).map(|i| (format!("pay-{i}"), due)).collect();
    enqueue_all(&rt, &p, "pay", tasks);
    wait_until("every capped task", || done.load(SeqCst) >= 100);
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    let most = most.load(SeqCst);
    assert!(most <= 2, "{most} handlers ran at once under a cap of 2");
    assert!(most == 2, "the cap was never used past 1");
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
}

#[test]
fn a_rate_limit_and_a_cap_together_hold_both() {
    let f = fixture("limit-both", |cfg| {
        *cfg = cfg.clone().limit(
            "pay",
            TopicLimit::new()
                .rate(50, Duration::from_secs(1))
                .concurrency(2),
        );
    });
    let (running, most, done) = <(Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>)>::default();
    let fired: Fired = Arc::default();
    let consumers: Vec<Consumer> = (0..4)
        .map(|i| {
            let (running, most, done, fired) =
                (running.clone(), most.clone(), done.clone(), fired.clone());
            let h = Handlers::new().on("pay", move |t| {
                fired
                    .lock()
                    .entry(t.id.clone())
                    .or_default()
                    .push((i, now_us()));
                let now = running.fetch_add(1, SeqCst) + 1;
                most.fetch_max(now, SeqCst);
                std::thread::sleep(Duration::from_millis(25));
                running.fetch_sub(1, SeqCst);
                done.fetch_add(1, SeqCst);
                Ok(())
            });
            Consumer::start(f.cfg.clone(), h).unwrap()
        })
        .collect();
    backlog(&f, "pay", 200);
    wait_until("every task under both limits", || done.load(SeqCst) >= 200);
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).unwrap();
    }
    let most = most.load(SeqCst);
    assert!(most <= 2, "{most} handlers ran at once under a cap of 2");
    let mut s = starts(&fired);
    assert_eq!(s.len(), 200, "a task ran twice");
    let in_a_second = most_in_a_window(&mut s, 1_000_000);
    assert!(
        in_a_second <= 55,
        "{in_a_second} starts in one second, over 50 + burst 5"
    );
}

#[test]
fn concurrency_slots_of_a_killed_consumer_come_back_after_its_lease() {
    let f = fixture("limit-crash", |cfg| {
        cfg.lease = Duration::from_secs(2);
        cfg.max_lease_expiries = 0;
        *cfg = cfg.clone().limit("pay", TopicLimit::new().concurrency(2));
    });
    // The first consumer's handlers hang: it holds both slots when it is killed.
    let hung = Arc::new(AtomicUsize::new(0));
    let h = {
        let hung = hung.clone();
        Handlers::new().on("pay", move |_| {
            hung.fetch_add(1, SeqCst);
            std::thread::sleep(Duration::from_secs(10));
            Ok(())
        })
    };
    let a = Consumer::start(f.cfg.clone(), h).unwrap();
    backlog(&f, "pay", 4);
    wait_until("both slots taken", || hung.load(SeqCst) == 2);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(hung.load(SeqCst), 2, "a third handler ran under a cap of 2");
    let killed = Instant::now();
    a.abort();
    // Fresh tasks, due at once: only the dead consumer's slots keep them from running.
    let (running, most, done) = <(Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>)>::default();
    let first = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let h = {
        let first = first.clone();
        let (running, most, done) = (running.clone(), most.clone(), done.clone());
        Handlers::new().on("pay", move |_| {
            first.lock().get_or_insert_with(Instant::now);
            let now = running.fetch_add(1, SeqCst) + 1;
            most.fetch_max(now, SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            running.fetch_sub(1, SeqCst);
            done.fetch_add(1, SeqCst);
            Ok(())
        })
    };
    let b = Consumer::start(f.cfg.clone(), h).unwrap();
    let due = now_us() / 1_000;
    let fresh: Vec<(String, u64)> = (0..6).map(|i| (format!("fresh-{i}"), due)).collect();
    enqueue_all(&f.rt, &f.p, "pay", fresh);
    // The fresh ones, and the four of the dead consumer once their leases end.
    wait_until("every task run on the second consumer", || {
        done.load(SeqCst) >= 10
    });
    let waited = first.lock().unwrap().duration_since(killed);
    b.shutdown(Duration::from_secs(5)).unwrap();
    assert!(
        most.load(SeqCst) <= 2,
        "over the cap: {}",
        most.load(SeqCst)
    );
    // The slots came back with their lease (renewed up to a third of it before the kill),
    // not before, and not never.
    assert!(
        waited >= Duration::from_millis(1_200) && waited <= Duration::from_secs(5),
        "the second consumer's first start came {waited:?} after the kill"
    );
    let left = f.server.run(&["ZCARD", "{limit-crash:limit:pay}:running"]);
    assert_eq!(left, redis::Value::Int(0), "slots left after shutdown");
}

#[test]
fn bad_limits_are_refused_at_start() {
    let f = fixture("limit-bad", |_| {});
    let cfg = f
        .cfg
        .clone()
        .limit("x", TopicLimit::new().rate(0, Duration::from_secs(1)));
    let err = Consumer::start(cfg, Handlers::new()).unwrap_err();
    assert!(err.to_string().contains("rate limit"), "{err}");
    let cfg = f.cfg.clone().limit("x", TopicLimit::new().concurrency(0));
    let err = Consumer::start(cfg, Handlers::new()).unwrap_err();
    assert!(err.to_string().contains("concurrency"), "{err}");
}
