//! Every metric of the crate served to Prometheus on loopback, with
//! `metrics-exporter-prometheus`: an engine, a persistent engine and a queue run a little
//! work, then the example scrapes its own endpoint once and prints the `delaywheel_` series.
//! Starts a private `redis-server`, or takes `--redis URL`; `--serve SECS` keeps the endpoint
//! up for a scraper of your own.
//!
//! ```text
//! cargo run --features redis --example prometheus              # make test
//! cargo run --features redis --example prometheus -- --serve 600
//! curl -s http://127.0.0.1:9184/metrics | grep delaywheel_
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::io::{Read, Write};
use std::time::Duration;

use delaywheel::redis::{
    now_ms, Consumer, Handlers, PersistConfig, Persistent, Producer, QueueConfig,
};
use delaywheel::Timer;
use metrics_exporter_prometheus::PrometheusBuilder;

fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

fn main() {
    let listen: std::net::SocketAddr = "127.0.0.1:9184".parse().unwrap();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    {
        let _enter = rt.enter();
        PrometheusBuilder::new()
            .with_http_listener(listen)
            .install()
            .expect("the Prometheus endpoint (is port 9184 free?)");
    }
    let (_server, url) = redis_server::RedisServer::given_or_private(arg("--redis"));

    // The engine.
    let (timer, expired) = Timer::builder()
        .name("example")
        .build_channel(None)
        .unwrap();
    for i in 0..10u32 {
        timer.schedule(i, Duration::from_millis(i.into())).unwrap();
    }
    for _ in 0..10 {
        expired.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    timer.stats();

    // A persistent engine.
    let (persistent, _fired) =
        Persistent::start(PersistConfig::new(url.as_str(), "prometheus-orders")).unwrap();
    persistent
        .schedule_at_ms(
            "order:1",
            "order.close",
            serde_json::Value::Null,
            now_ms() + 60_000,
        )
        .unwrap();
    persistent.flush(Duration::from_secs(10));

    // A queue with a topic that succeeds and one that fails.
    let mut cfg = QueueConfig::new(url.as_str(), "prometheus-queue");
    cfg.reaper_interval = Duration::from_millis(100);
    let consumer = Consumer::start(
        cfg.clone(),
        Handlers::new()
            .on("email", |_| Ok(()))
            .on("sms", |_| Err("gateway down".into())),
    )
    .unwrap();
    let producer = rt.block_on(Producer::connect(cfg)).unwrap();
    for i in 0..20 {
        let topic = if i % 4 == 0 { "sms" } else { "email" };
        rt.block_on(producer.enqueue(
            format!("n{i}"),
            topic,
            serde_json::Value::Null,
            Duration::ZERO,
        ))
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));

    let mut s = std::net::TcpStream::connect(listen).expect("the endpoint");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("delaywheel_"))
        .collect();
    for line in &series {
        println!("{line}");
    }
    println!(
        "{} delaywheel series at http://{listen}/metrics",
        series.len()
    );
    assert!(
        series
            .iter()
            .any(|l| l.starts_with("delaywheel_queue_processed_total")),
        "no per-topic queue series"
    );
    if let Some(secs) = arg("--serve").and_then(|s| s.parse().ok()) {
        println!("serving for {secs} s");
        std::thread::sleep(Duration::from_secs(secs));
    }
    consumer.shutdown(Duration::from_secs(5)).unwrap();
    persistent.shutdown();
}
