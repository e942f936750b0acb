//! "Close this order if it is still unpaid in 30 minutes", surviving a restart: `Persistent`
//! with `restore`, `ack` and a clean `shutdown`. Starts a private `redis-server`, or takes
//! `--redis URL`.
//!
//! ```text
//! cargo run --features redis --example durable_orders
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use delaywheel::redis::{PersistConfig, Persistent};

#[derive(serde::Serialize, serde::Deserialize)]
struct CloseOrder {
    order_id: u64,
}

fn main() -> Result<(), delaywheel::redis::PersistError> {
    let url = std::env::args().skip_while(|a| a != "--redis").nth(1);
    let (_server, url) = redis_server::RedisServer::given_or_private(url);
    let cfg = PersistConfig::new(&url, "durable-orders");

    // The first process schedules, then stops: the task stays in Redis.
    let (engine, _fired) = Persistent::start(cfg.clone())?;
    engine.restore(4_000)?;
    let close = CloseOrder { order_id: 42 };
    engine.schedule(
        "order:42",
        "order.close",
        &close,
        Duration::from_millis(300),
    )?;
    let unwritten = engine.shutdown(); // flushes; returns what it could not write
    assert!(unwritten.is_empty());
    drop(engine);

    // The next process restores it, and it fires on time.
    let (engine, fired) = Persistent::start(cfg)?;
    println!("restored {} task(s)", engine.restore(4_000)?.loaded);
    let task = fired.recv_timeout(Duration::from_secs(30)).expect("fired");
    let close: CloseOrder = task.payload_as().expect("a CloseOrder");
    println!("closing order {} if it is still unpaid", close.order_id);
    engine.ack(&task); // done: it will not fire again after a restart
    engine.shutdown();
    Ok(())
}
