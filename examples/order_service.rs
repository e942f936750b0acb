//! An order service on `Persistent`, as a new user writes it: "close this order if it is
//! still unpaid in 30 minutes" survives a deploy.
//!
//! Orders are placed; each schedules a typed `CloseOrder` task with a `Duration`. Some are paid
//! in time and cancel their task (`cancel_confirmed`: Redis has the removal when it returns).
//! Halfway, the process "deploys": the engine shuts down and a new one starts on the same
//! namespace and restores what is pending. The fired tasks are read as an async `Stream` on
//! tokio, decoded with `payload_as`, and acknowledged once the order is closed. At the end
//! every unpaid order is closed, and no paid one.
//!
//! ```text
//! cargo run --features "redis futures" --example order_service
//! cargo run --features "redis futures" --example order_service -- --smoke --json   # make test
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::redis::{PersistConfig, Persistent};
use futures_util::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
#[command(about = "Close unpaid orders after a timeout, surviving a restart, on Persistent")]
struct Args {
    /// Orders to place.
    #[arg(long, default_value_t = 2_000)]
    orders: u64,
    /// The order timeout in ms (30 minutes in production; short here).
    #[arg(long, default_value_t = 2_000)]
    timeout_ms: u64,
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

/// The task's payload: what the handler needs to close the order.
#[derive(Debug, Serialize, Deserialize)]
struct CloseOrder {
    order_id: u64,
    amount_cents: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    WaitPay,
    Paid,
    Closed,
}

type Orders = Arc<Mutex<HashMap<u64, Status>>>;

/// Reads fired tasks from `engine` until it shuts down: closes each order still unpaid (a
/// conditional update, so a second delivery changes nothing), then acknowledges the task.
async fn close_unpaid(
    engine: Arc<Persistent>,
    fired: crossbeam_channel::Receiver<delaywheel::redis::Envelope>,
    orders: Orders,
) -> u64 {
    let mut fired = engine.stream(fired);
    let mut closed = 0;
    while let Some(task) = fired.next().await {
        match task.payload_as::<CloseOrder>() {
            Ok(close) => {
                let mut orders = orders.lock();
                if let Some(status) = orders.get_mut(&close.order_id) {
                    if *status == Status::WaitPay {
                        *status = Status::Closed;
                        closed += 1;
                    }
                }
            }
            Err(e) => eprintln!("not a CloseOrder, left for an operator: {e}"),
        }
        engine.ack(&task);
    }
    closed
}

fn start(
    url: &str,
) -> (
    Arc<Persistent>,
    crossbeam_channel::Receiver<delaywheel::redis::Envelope>,
) {
    let (engine, fired) = Persistent::start(PersistConfig::new(url, "orders")).expect("start");
    let report = engine.restore(4_000).expect("restore");
    println!("  engine started: {} pending tasks restored", report.loaded);
    (Arc::new(engine), fired)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (orders_n, timeout) = if args.smoke {
        (200, Duration::from_millis(800))
    } else {
        (args.orders, Duration::from_millis(args.timeout_ms))
    };
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    redis_server::RedisServer::clear_namespace(&url, "orders");
    let orders: Orders = Arc::default();
    let started = Instant::now();

    // The first process: places the first half of the orders, some paid.
    let (engine, fired) = start(&url);
    let reader = tokio::spawn(close_unpaid(engine.clone(), fired, orders.clone()));
    let place = |engine: &Persistent, range: std::ops::Range<u64>| {
        for id in range {
            orders.lock().insert(id, Status::WaitPay);
            let close = CloseOrder {
                order_id: id,
                amount_cents: 1_999,
            };
            engine
                .schedule(format!("order:{id}"), "order.close", &close, timeout)
                .expect("schedule");
        }
    };
    let pay = |engine: &Persistent, range: std::ops::Range<u64>| {
        for id in range.filter(|id| id % 3 == 0) {
            orders.lock().insert(id, Status::Paid);
            // Confirmed: a crash right after this cannot fire the paid order's task.
            engine
                .cancel_confirmed(&format!("order:{id}"))
                .expect("cancel");
        }
    };
    let half = orders_n / 2;
    place(&engine, 0..half);
    pay(&engine, 0..half);
    // The deploy: the old process stops (what it holds stays in Redis)...
    let unwritten = engine.shutdown();
    assert!(
        unwritten.is_empty(),
        "tasks not written at shutdown: {unwritten:?}"
    );
    let closed_before = reader.await.expect("reader");
    drop(engine);
    // ...and the new one restores it, and goes on.
    let (engine, fired) = start(&url);
    let reader = tokio::spawn(close_unpaid(engine.clone(), fired, orders.clone()));
    place(&engine, half..orders_n);
    pay(&engine, half..orders_n);
    // Wait for every order to be settled, then stop.
    let deadline = Instant::now() + timeout * 3 + Duration::from_secs(30);
    while orders.lock().values().any(|s| *s == Status::WaitPay) {
        assert!(Instant::now() < deadline, "orders still unpaid and open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Acks are written behind: flush them before the count below.
    assert!(engine.flush(Duration::from_secs(30)));
    let left = engine.len();
    engine.shutdown();
    let closed = closed_before + reader.await.expect("reader");

    let orders = orders.lock();
    let count = |s: Status| orders.values().filter(|v| **v == s).count() as u64;
    let (paid, closed_now, open) = (
        count(Status::Paid),
        count(Status::Closed),
        count(Status::WaitPay),
    );
    println!(
        "order service: {orders_n} orders, timeout {timeout:?}, one restart, {:.2?}",
        started.elapsed()
    );
    println!("  paid (never closed)  {paid}");
    println!("  closed when unpaid   {closed_now} (closed by the handler: {closed})");
    println!("  still open           {open}");
    println!("  tasks left in memory {left}");
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "orders": orders_n,
                "paid": paid,
                "closed": closed_now,
                "open": open,
                "lost": orders_n - paid - closed_now,
                "left": left,
            })
        );
    }
    if paid + closed_now != orders_n || closed != closed_now || left != 0 {
        std::process::exit(1);
    }
}
