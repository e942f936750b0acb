//! `async` queue handlers (feature `tokio`) and typed payloads: every guarantee of a thread
//! handler holds for a future (lease renewal while it runs, the stall hand-back, retries on
//! `Err` and on panic, a shutdown that waits and then hands back), on the application's
//! runtime or the consumer's own, bounded by `handler_threads`.
#![cfg(all(feature = "redis", feature = "tokio"))]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Backoff, Begin, Consumer, Dedup, Envelope, Handlers, Producer, QueueConfig, RetryPolicy,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use queue_kit::*;
use redis_server::RedisServer;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct CloseOrder {
    order_id: u64,
    reason: String,
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("").to_owned()
}

async fn wait_async(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The new user's program: a struct as the payload, an `async move` block as the handler on
/// the application's runtime, `Dedup` awaited from it with no runtime of its own, and the
/// consumer started and stopped from async code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_handler_runs_on_the_applications_runtime_with_a_typed_payload() {
    let server = RedisServer::start_in_memory();
    let cfg = QueueConfig::new(server.url(), "async-app");
    let dedup = Dedup::connect(
        &server.url(),
        "async-app-markers",
        Duration::from_secs(5),
        Duration::from_secs(3_600),
    )
    .await
    .unwrap();
    let seen: Arc<Mutex<Vec<(CloseOrder, bool, String)>>> = Arc::default();
    let handlers = {
        let seen = seen.clone();
        Handlers::new()
            .runtime(tokio::runtime::Handle::current())
            .on_async_typed("order.close", move |close: CloseOrder, task: Envelope| {
                let (seen, dedup) = (seen.clone(), dedup.clone());
                async move {
                    // Yields to the runtime: a future, not a blocking call.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let first = match dedup.begin(&task.id).await? {
                        Begin::Run(claim) => {
                            dedup.finish(&claim).await?;
                            true
                        }
                        _ => false,
                    };
                    seen.lock().push((close, first, thread_name()));
                    Ok(())
                }
            })
    };
    let c = Consumer::start_async(cfg.clone(), handlers).await.unwrap();
    let p = Producer::connect(cfg).await.unwrap();
    let order = CloseOrder {
        order_id: 42,
        reason: "unpaid".into(),
    };
    assert!(p
        .enqueue("order:42", "order.close", &order, Duration::ZERO)
        .await
        .unwrap());
    wait_async("the first delivery's ack", || c.stats().acked == 1).await;
    // Again (a redelivery): the marker says done.
    assert!(p
        .enqueue("order:42", "order.close", &order, Duration::ZERO)
        .await
        .unwrap());
    wait_async("the second delivery's ack", || c.stats().acked == 2).await;
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!((&seen[0].0, seen[0].1), (&order, true));
    assert_eq!((&seen[1].0, seen[1].1), (&order, false));
    // The test runtime's workers, not a consumer thread.
    let worker = tokio::spawn(async { thread_name() }).await.unwrap();
    for (_, _, thread) in &seen {
        assert_eq!(thread, &worker);
    }
    assert_eq!(c.shutdown_async(Duration::from_secs(5)).await.unwrap(), 0);
}

/// Without a runtime given, the futures run on one the consumer owns, at most
/// `handler_threads` at a time, and that many do run at once.
#[test]
fn async_handlers_on_the_consumers_runtime_run_at_most_handler_threads_at_once() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-own", |cfg| cfg.handler_threads = 3);
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let threads: Arc<Mutex<Vec<String>>> = Arc::default();
    let handlers = {
        let (now, most, threads) = (now.clone(), most.clone(), threads.clone());
        Handlers::new().on_async("job", move |_task: Envelope| {
            let (now, most, threads) = (now.clone(), most.clone(), threads.clone());
            async move {
                let running = now.fetch_add(1, SeqCst) + 1;
                most.fetch_max(running, SeqCst);
                threads.lock().push(thread_name());
                tokio::time::sleep(Duration::from_millis(200)).await;
                now.fetch_sub(1, SeqCst);
                Ok(())
            }
        })
    };
    let c = Consumer::start(cfg, handlers).unwrap();
    let due = now_ms();
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..12).map(|i| (format!("j{i}"), due)).collect(),
    );
    wait_until("twelve acks", || c.stats().acked == 12);
    assert_eq!(
        most.load(SeqCst),
        3,
        "not bounded by handler_threads, or never reached it"
    );
    for t in threads.lock().iter() {
        assert!(t.starts_with("delaywheel-handler"), "ran on {t}");
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// An `Err`, a panic in the future, a panic in the closure before any future exists, and a
/// payload that does not decode are each a failed attempt: retried, then dead-lettered with
/// the reason. Nothing panics out, nothing is lost.
#[test]
fn async_and_typed_handler_failures_are_retried_then_dead_lettered() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-fail", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 2,
            backoff: Backoff::Quadratic {
                unit: Duration::from_millis(20),
            },
        };
    });
    let attempts: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = |a: &Arc<Mutex<Vec<String>>>, id: &str| a.lock().push(id.to_owned());
    let handlers = {
        let (a1, a2, a3, a4) = (
            attempts.clone(),
            attempts.clone(),
            attempts.clone(),
            attempts.clone(),
        );
        Handlers::new()
            .on_async("err", move |t: Envelope| {
                let a = a1.clone();
                async move {
                    log(&a, &t.id);
                    tokio::task::yield_now().await;
                    Err("the payment service said no".into())
                }
            })
            .on_async("panic", move |t: Envelope| {
                let a = a2.clone();
                async move {
                    log(&a, &t.id);
                    tokio::task::yield_now().await;
                    panic!("a bug in the handler");
                }
            })
            .on_async("panic-call", move |t: Envelope| {
                log(&a3, &t.id);
                if t.attempt < 10 {
                    panic!("a bug before the future");
                }
                async { Ok(()) }
            })
            .on_async_typed("typed", move |close: CloseOrder, t: Envelope| {
                let a = a4.clone();
                async move {
                    log(&a, &t.id);
                    assert!(close.order_id > 0);
                    Ok(())
                }
            })
            .on_typed("typed-sync", |close: CloseOrder, _t: &Envelope| {
                assert!(close.order_id > 0);
                Ok(())
            })
    };
    let c = Consumer::start(cfg, handlers).unwrap();
    rt.block_on(async {
        for topic in ["err", "panic", "panic-call"] {
            p.enqueue(topic, topic, serde_json::Value::Null, Duration::ZERO)
                .await
                .unwrap();
        }
        // A payload from another client that is not a CloseOrder.
        let wrong = serde_json::json!({ "order": "42" });
        p.enqueue("typed", "typed", &wrong, Duration::ZERO)
            .await
            .unwrap();
        p.enqueue("typed-sync", "typed-sync", &wrong, Duration::ZERO)
            .await
            .unwrap();
    });
    wait_until("five dead letters", || {
        rt.block_on(p.depth()).unwrap().dead == 5
    });
    let mut dead = rt.block_on(p.dead_letters(10)).unwrap();
    dead.sort_by(|a, b| a.id.cmp(&b.id));
    let reasons: Vec<(&str, &str, u32)> = dead
        .iter()
        .map(|d| (d.id.as_str(), d.reason.as_str(), d.attempt))
        .collect();
    assert_eq!(reasons[0], ("err", "the payment service said no", 2));
    assert_eq!(reasons[1].0, "panic");
    assert!(reasons[1].1.contains("panicked"), "{reasons:?}");
    assert_eq!(reasons[2].0, "panic-call");
    assert!(reasons[2].1.contains("panicked"), "{reasons:?}");
    for (i, id) in [(3, "typed"), (4, "typed-sync")] {
        assert_eq!(reasons[i].0, id);
        assert!(
            reasons[i].1.starts_with("payload does not decode as ")
                && reasons[i].1.contains("CloseOrder")
                && reasons[i].1.contains("missing field `order_id`"),
            "{reasons:?}"
        );
        assert_eq!(reasons[i].2, 2);
    }
    // The undecodable payload is in the dead letter as it was sent.
    assert!(
        dead[3].raw.contains(r#""payload":{"order":"42"}"#),
        "{}",
        dead[3].raw
    );
    let mut tried = attempts.lock().clone();
    tried.sort();
    // The typed async handler never ran: its payload did not decode.
    assert_eq!(
        tried,
        ["err", "err", "panic", "panic", "panic-call", "panic-call"]
    );
    let s = c.stats();
    assert_eq!((s.retried, s.dead_lettered), (5, 5), "{s:?}");
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A future that runs for several leases keeps its task: renewed while it runs, run once, and
/// no other consumer's reaper takes it.
#[test]
fn the_lease_of_a_running_future_is_renewed() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-renew", |cfg| {
        cfg.lease = Duration::from_millis(3_000);
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.reconcile = Duration::from_millis(100);
        cfg.handler_threads = 1;
    });
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let slow = |runs: &Arc<Mutex<Vec<String>>>| {
        let runs = runs.clone();
        Handlers::new().on_async("job", move |t: Envelope| {
            let runs = runs.clone();
            async move {
                runs.lock().push(t.id.clone());
                tokio::time::sleep(Duration::from_millis(6_500)).await; // over two leases
                Ok(())
            }
        })
    };
    enqueue_all(&rt, &p, "job", vec![("long".into(), now_ms())]);
    let a = Consumer::start(cfg.clone(), slow(&runs)).unwrap();
    wait_until("A's handler", || !runs.lock().is_empty());
    let b = Consumer::start(cfg.clone(), slow(&runs)).unwrap();
    wait_until("the ack", || a.stats().acked + b.stats().acked == 1);
    assert_eq!(*runs.lock(), ["long"], "the task ran twice");
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.acked, 1);
    assert_eq!(sa.recovered + sb.recovered, 0, "a lease ran out");
    assert!(sa.renewed >= 2, "{sa:?}");
    a.shutdown(Duration::from_secs(5)).unwrap();
    b.shutdown(Duration::from_secs(5)).unwrap();
}

/// A consumer whose only slot is taken by a future that never ends hands the tasks it holds
/// to another consumer, which fires them on time.
#[test]
fn a_consumer_whose_async_handlers_are_stuck_hands_its_tasks_to_another() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-stuck", |cfg| {
        cfg.handler_threads = 1;
        cfg.handler_stall = Duration::from_millis(500);
        cfg.lookahead = Duration::from_secs(20);
        cfg.reconcile = Duration::from_millis(200);
    });
    let fired: Fired = Arc::default();
    let started = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let started = started.clone();
        Handlers::new().on_async("hang", move |_t: Envelope| {
            started.fetch_add(1, SeqCst);
            std::future::pending::<Result<(), delaywheel::redis::HandlerError>>()
        })
    };
    let a = Consumer::start(cfg.clone(), handlers).unwrap();
    let due = now_ms() + 4_000;
    claimed_by(&rt, &p, &a, "j", 20, due);
    enqueue_all(&rt, &p, "hang", vec![("hang".into(), now_ms())]);
    wait_until("the hanging future", || started.load(SeqCst) == 1);
    let b = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("A to hand its tasks back", || a.stats().given_back == 20);
    assert_eq!(a.held(), 0);
    wait_until("B to fire all 20", || fired.lock().len() == 20);
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id} fired twice");
        assert!(d[0].1 >= due * 1_000, "{id} early");
        assert!(d[0].1 < (due + 5_000) * 1_000, "{id} fired late");
    }
    b.shutdown(Duration::from_secs(5)).unwrap();
    // The hanging future is dropped at the timeout and its task handed back.
    assert_eq!(a.shutdown(Duration::from_millis(300)).unwrap(), 1);
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (1, 0));
}

/// `shutdown` lets a running future finish within its timeout and sends its ack; past the
/// timeout, a future still running is dropped and its task handed back, and so are the tasks
/// waiting for a slot.
#[test]
fn shutdown_waits_for_running_futures_then_hands_back_the_rest() {
    let Fixture { server, rt, cfg, p } = fixture("async-stop", |cfg| cfg.handler_threads = 1);
    let finished = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let (finished, started) = (finished.clone(), started.clone());
        Handlers::new().on_async("job", move |t: Envelope| {
            let (finished, started) = (finished.clone(), started.clone());
            async move {
                started.fetch_add(1, SeqCst);
                let ms = if t.id == "quick" { 400 } else { 60_000 };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                finished.fetch_add(1, SeqCst);
                Ok(())
            }
        })
    };
    // A future that finishes within the timeout.
    let c = Consumer::start(cfg.clone(), handlers.clone()).unwrap();
    enqueue_all(&rt, &p, "job", vec![("quick".into(), now_ms())]);
    wait_until("the quick future", || started.load(SeqCst) == 1);
    assert_eq!(c.shutdown(Duration::from_secs(5)).unwrap(), 0);
    assert_eq!(finished.load(SeqCst), 1, "shutdown did not wait");
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0), "the ack did not land");

    // One that does not, and two waiting behind it for the one slot.
    let c = Consumer::start(cfg, handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("slow".into(), now_ms())]);
    wait_until("the slow future", || started.load(SeqCst) == 2);
    enqueue_all(
        &rt,
        &p,
        "job",
        vec![("q1".into(), now_ms()), ("q2".into(), now_ms())],
    );
    wait_until("the queued tasks claimed", || c.stats().claimed == 3);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        started.load(SeqCst),
        2,
        "a queued task ran: the test shows nothing"
    );
    let began = Instant::now();
    let given = c.shutdown(Duration::from_millis(500)).unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(given, 3);
    assert_eq!(finished.load(SeqCst), 1);
    assert_handed_back(&server, "async-stop", &["slow", "q1", "q2"]);
}

/// The application's runtime shuts down under a running future, and stays down: the dropped
/// future is a failed attempt, and so is each later one that cannot run, until the task is
/// dead-lettered with the reason. Never stranded in the consumer, renewed for ever.
#[test]
fn a_handler_runtime_that_shuts_down_fails_the_attempts_and_loses_nothing() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-rt-gone", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 3,
            backoff: Backoff::Quadratic {
                unit: Duration::from_millis(20),
            },
        };
    });
    let app = tokio::runtime::Runtime::new().unwrap();
    let started = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let started = started.clone();
        Handlers::new()
            .runtime(app.handle().clone())
            .on_async("job", move |_t: Envelope| {
                started.fetch_add(1, SeqCst);
                async {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok(())
                }
            })
    };
    let c = Consumer::start(cfg, handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("t".into(), now_ms())]);
    wait_until("the future", || started.load(SeqCst) == 1);
    app.shutdown_background();
    wait_until("the dead letter", || {
        rt.block_on(p.depth()).unwrap().dead == 1
    });
    let dead = rt.block_on(p.dead_letters(10)).unwrap();
    assert_eq!(dead[0].id, "t");
    assert_eq!(dead[0].attempt, 3);
    assert!(
        dead[0].reason.contains("future was dropped"),
        "{}",
        dead[0].reason
    );
    let s = c.stats();
    assert_eq!((s.retried, s.dead_lettered, s.acked), (2, 1, 0), "{s:?}");
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.queued, depth.leased), (0, 0));
    c.shutdown(Duration::from_secs(5)).unwrap();
}

/// A closure that builds a tokio future before returning it (`tokio::time::sleep` at the
/// call) runs inside the handler runtime's context: its task is acked, not failed with "no
/// reactor running".
#[test]
fn an_async_handler_that_builds_its_tokio_future_eagerly_runs() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("async-eager", |_| {});
    let handlers = Handlers::new().on_async("job", |_t: Envelope| {
        let pause = tokio::time::sleep(Duration::from_millis(5));
        async move {
            pause.await;
            Ok(())
        }
    });
    let c = Consumer::start(cfg, handlers).unwrap();
    enqueue_all(&rt, &p, "job", vec![("eager".into(), now_ms())]);
    wait_until("the ack", || c.stats().acked == 1);
    let s = c.stats();
    assert_eq!((s.retried, s.dead_lettered), (0, 0), "{s:?}");
    c.shutdown(Duration::from_secs(5)).unwrap();
}
