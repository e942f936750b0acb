//! The queue's metrics per topic, scraped from a real Prometheus endpoint on 127.0.0.1 with an
//! HTTP GET (`metrics-exporter-prometheus`, as `examples/prometheus.rs` serves them): counters
//! of processed, failed, retried and dead-lettered tasks labelled by topic (an unknown topic
//! under one label), the handler-duration histogram, and the latency and paused gauges per
//! shard. (Its own binary: the recorder is process-global.)
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{now_ms, Backoff, Consumer, Handlers, RetryPolicy};
use metrics_exporter_prometheus::PrometheusBuilder;
use queue_kit::*;

/// The exposition text, by a plain HTTP/1.1 GET.
fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "{}",
        &text[..text.len().min(200)]
    );
    text
}

/// The value of the series `name{labels...}` whose labels include each of `labels`.
fn value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn per_topic_counters_durations_and_the_latency_and_paused_gauges_are_scraped() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    {
        let _enter = rt.enter();
        PrometheusBuilder::new()
            .with_http_listener(port)
            .install()
            .expect("the only recorder of this binary");
    }
    let Fixture {
        server: _s,
        rt: _rt,
        cfg,
        p,
    } = fixture("qm", |cfg| {
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.retry = RetryPolicy {
            max_attempts: 2,
            backoff: Backoff::Quadratic {
                unit: Duration::from_millis(10),
            },
        };
    });
    let flaky_calls = Arc::new(AtomicU32::new(0));
    let calls = flaky_calls.clone();
    let handlers = Handlers::new()
        .on("ok", |_| {
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        })
        // Fails its first attempt, then succeeds: failed 1, retried 1, processed 1.
        .on("flaky", move |_| {
            if calls.fetch_add(1, SeqCst) == 0 {
                Err("first try".into())
            } else {
                Ok(())
            }
        })
        .on("bad", |_| Err("always".into()));
    let c = Consumer::start(cfg.clone(), handlers).unwrap();
    let now = now_ms();
    enqueue_all(
        &_rt,
        &p,
        "ok",
        (0..5).map(|i| (format!("ok{i}"), now)).collect(),
    );
    enqueue_all(&_rt, &p, "flaky", vec![("flaky0".into(), now)]);
    enqueue_all(&_rt, &p, "bad", vec![("bad0".into(), now)]);
    enqueue_all(&_rt, &p, "mystery", vec![("m0".into(), now)]);
    wait_until("the outcomes", || {
        let s = c.stats();
        s.acked == 6 && _rt.block_on(p.depth()).unwrap().dead == 2
    });
    // Latency: a task due a second ago that this consumer's paused shard cannot claim.
    _rt.block_on(p.pause()).unwrap();
    enqueue_all(&_rt, &p, "ok", vec![("late".into(), now_ms() - 1_000)]);

    let ns = r#"namespace="qm""#;
    let start = Instant::now();
    let text = loop {
        let text = scrape(port);
        let latency = value(&text, "delaywheel_queue_latency_seconds", &[ns]).unwrap_or(0.0);
        let paused = value(&text, "delaywheel_queue_paused", &[ns]).unwrap_or(0.0);
        if latency >= 1.0 && paused == 1.0 {
            break text;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "latency {latency}, paused {paused}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let count = |name: &str, topic: &str| {
        value(&text, name, &[ns, &format!(r#"topic="{topic}""#)])
            .unwrap_or_else(|| panic!("no {name} for topic {topic}:\n{text}"))
    };
    assert_eq!(count("delaywheel_queue_processed_total", "ok"), 5.0);
    assert_eq!(count("delaywheel_queue_processed_total", "flaky"), 1.0);
    assert_eq!(count("delaywheel_queue_failed_total", "flaky"), 1.0);
    assert_eq!(count("delaywheel_queue_retried_total", "flaky"), 1.0);
    assert_eq!(count("delaywheel_queue_failed_total", "bad"), 2.0);
    assert_eq!(count("delaywheel_queue_retried_total", "bad"), 1.0);
    assert_eq!(count("delaywheel_queue_dead_lettered_total", "bad"), 1.0);
    // An unregistered topic goes under one label: the label set stays bounded.
    assert_eq!(
        count("delaywheel_queue_dead_lettered_total", "unknown"),
        1.0
    );
    assert!(!text.contains(r#"topic="mystery""#));
    // Handler durations: 5 runs of `ok`, each at least 2 ms.
    assert_eq!(
        count("delaywheel_queue_handler_duration_seconds_count", "ok"),
        5.0
    );
    assert!(count("delaywheel_queue_handler_duration_seconds_sum", "ok") >= 0.010);
    _rt.block_on(p.resume()).unwrap();
    c.shutdown(Duration::from_secs(5)).unwrap();
}
