//! One producer and two consumers of the shared delay queue: each task fires once, on one of
//! them, at its due millisecond. Starts a private `redis-server`, or takes `--redis URL`.
//!
//! ```text
//! cargo run --features redis,tokio --example queue
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{Consumer, Envelope, Handlers, Producer, QueueConfig};

fn handlers(name: &'static str, fired: Arc<AtomicUsize>) -> Handlers {
    Handlers::new().on("reminder", move |task: &Envelope| {
        println!("{name}: {} ({})", task.id, task.payload);
        fired.fetch_add(1, SeqCst);
        Ok(()) // an Err retries with backoff, then dead-letters
    })
}

#[tokio::main]
async fn main() -> Result<(), delaywheel::redis::QueueError> {
    let url = std::env::args().skip_while(|a| a != "--redis").nth(1);
    let (_server, url) = redis_server::RedisServer::given_or_private(url);
    let cfg = QueueConfig::new(&url, "reminders-example");
    let fired = Arc::new(AtomicUsize::new(0));
    let a = Consumer::start_async(cfg.clone(), handlers("a", fired.clone())).await?;
    let b = Consumer::start_async(cfg.clone(), handlers("b", fired.clone())).await?;

    let producer = Producer::connect(cfg).await?;
    for i in 0..10u64 {
        let text = format!("reminder {i}");
        producer
            .enqueue(
                format!("r{i}"),
                "reminder",
                &text,
                Duration::from_millis(100 * i),
            )
            .await?;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while fired.load(SeqCst) < 10 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.shutdown_async(Duration::from_secs(5)).await?;
    b.shutdown_async(Duration::from_secs(5)).await?;
    println!("fired {} tasks on two consumers", fired.load(SeqCst));
    assert_eq!(fired.load(SeqCst), 10, "each task fires once");
    Ok(())
}
