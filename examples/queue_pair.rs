//! A producer and a consumer of the shared delay queue in one tokio service, as a new user
//! writes them: a typed payload, an `async` handler on the application's runtime that awaits
//! an async client (here `Dedup`, so a redelivery does no work twice), and a consumer started
//! and stopped without blocking a runtime thread.
//!
//! The producer enqueues `--tasks` reminders due over `--spread-ms`; some are enqueued twice
//! under a new id to show the dedup marker at work, and a few carry a payload that is not a
//! `Reminder` (dead-lettered with the decode error as the reason). At the end each good
//! reminder was sent once, and the bad ones are in the dead-letter store.
//!
//! ```text
//! cargo run --features "redis tokio" --example queue_pair
//! cargo run --features "redis tokio" --example queue_pair -- --smoke --json   # make test
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::redis::{
    Backoff, Begin, Consumer, Dedup, Envelope, Handlers, Producer, QueueConfig, RetryPolicy,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
#[command(about = "A producer and an async consumer of delaywheel's Redis delay queue")]
struct Args {
    /// Reminders to enqueue.
    #[arg(long, default_value_t = 5_000)]
    tasks: u64,
    /// Due times spread over this many ms from now.
    #[arg(long, default_value_t = 5_000)]
    spread_ms: u64,
    /// Use this Redis instead of starting a private one.
    #[arg(long)]
    redis: Option<String>,
    /// A seconds-long run (make test).
    #[arg(long)]
    smoke: bool,
    /// The figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

/// The payload: who to remind, of what.
#[derive(Debug, Serialize, Deserialize)]
struct Reminder {
    user_id: u64,
    text: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (tasks, spread) = if args.smoke {
        (300, Duration::from_millis(1_000))
    } else {
        (args.tasks, Duration::from_millis(args.spread_ms))
    };
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    redis_server::RedisServer::clear_namespace(&url, "reminders");
    redis_server::RedisServer::clear_namespace(&url, "reminders-sent");
    let mut cfg = QueueConfig::new(url.clone(), "reminders");
    cfg.retry = RetryPolicy {
        max_attempts: 2,
        backoff: Backoff::Quadratic {
            unit: Duration::from_millis(50),
        },
    };

    // The consumer: an async handler that awaits the dedup marker, then "sends" the reminder.
    let dedup = Dedup::connect(
        &url,
        "reminders-sent",
        Duration::from_secs(10),
        Duration::from_secs(3_600),
    )
    .await?;
    let sent: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let handlers = {
        let sent = sent.clone();
        Handlers::new()
            .runtime(tokio::runtime::Handle::current())
            .on_async_typed("remind", move |r: Reminder, _task: Envelope| {
                let (dedup, sent) = (dedup.clone(), sent.clone());
                async move {
                    // One marker per reminder, whichever task id carried it.
                    match dedup
                        .begin(&format!("user:{}:{}", r.user_id, r.text))
                        .await?
                    {
                        Begin::Run(claim) => {
                            *sent.lock().entry(r.user_id).or_default() += 1;
                            dedup.finish(&claim).await?;
                        }
                        Begin::AlreadyDone => {}
                        Begin::InProgress => return Err("another delivery is sending it".into()),
                    }
                    Ok(())
                }
            })
    };
    let consumer = Consumer::start_async(cfg.clone(), handlers).await?;

    // The producer.
    let producer = Producer::connect(cfg).await?;
    let started = Instant::now();
    for i in 0..tasks {
        let due = spread * (i as u32) / (tasks.max(1) as u32);
        let reminder = Reminder {
            user_id: i,
            text: "your cart is waiting".into(),
        };
        producer
            .enqueue(format!("remind:{i}"), "remind", &reminder, due)
            .await?;
        // Every tenth again under another id: the marker makes it a no-op.
        if i % 10 == 0 {
            producer
                .enqueue(format!("remind:{i}:again"), "remind", &reminder, due)
                .await?;
        }
    }
    let bad = serde_json::json!({ "user": "not a number" });
    for i in 0..3 {
        producer
            .enqueue(format!("bad:{i}"), "remind", &bad, Duration::ZERO)
            .await?;
    }
    let extra = tasks.div_ceil(10);
    let deadline = Instant::now() + spread + Duration::from_secs(60);
    loop {
        let s = consumer.stats();
        if s.acked >= tasks + extra && s.dead_lettered >= 3 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("timed out: {s:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = consumer.stats();
    consumer.shutdown_async(Duration::from_secs(10)).await?;
    let dead = producer.dead_letters(10).await?;
    let sent = sent.lock();
    let once = sent.values().filter(|n| **n == 1).count() as u64;
    let twice = sent.values().filter(|n| **n > 1).count() as u64;
    println!(
        "queue pair: {tasks} reminders (+{extra} enqueued twice, +3 bad) in {:.2?}",
        started.elapsed()
    );
    println!("  sent once            {once}");
    println!("  sent more than once  {twice}");
    println!(
        "  lateness p50/p99/max {} / {} / {} µs",
        stats.lateness_p50_us, stats.lateness_p99_us, stats.lateness_max_us
    );
    for d in &dead {
        println!("  dead letter {}: {}", d.id, d.reason);
    }
    let bad_reasons = dead
        .iter()
        .filter(|d| d.reason.starts_with("payload does not decode"))
        .count();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "tasks": tasks,
                "sent_once": once,
                "sent_twice": twice,
                "lost": tasks - once - twice,
                "dead_letters": dead.len(),
                "lateness_p99_us": stats.lateness_p99_us,
            })
        );
    }
    if once != tasks || twice != 0 || bad_reasons != 3 {
        std::process::exit(1);
    }
    Ok(())
}
