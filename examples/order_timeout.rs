//! Design note 000, end to end: orders are placed, and a "close this order if it is still
//! unpaid in 30 minutes" task goes into the shared Redis delay queue. Two consumers fire the
//! tasks; a paid order is skipped after a status check, an unpaid one is closed with a
//! conditional update (`status = WAIT_PAY` → `CLOSED`) that counts the rows it changed, so a
//! duplicate delivery is harmless. A flaky dependency makes some attempts fail (they retry with
//! backoff), and poison tasks (no order id) end in the dead-letter store.
//!
//! ```text
//! cargo run --release --features redis --example order_timeout                # 30 min ÷ 1000
//! cargo run --release --features redis --example order_timeout -- --scale 1   # real time
//! cargo run --features redis --example order_timeout -- --smoke --json        # make test
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::redis::{Backoff, Consumer, Handlers, Producer, QueueConfig, RetryPolicy, When};
use parking_lot::Mutex;

/// A finite number of seconds, 0 or more, that a `Duration` can hold.
fn non_negative(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && (0.0..=1e12).contains(&v) {
        Ok(v)
    } else {
        Err("must be a number of seconds from 0 to 1e12".into())
    }
}

/// A finite scale of at least 1e-3 (a smaller one would stretch 30 minutes past what a
/// `Duration` of seconds in an f64 keeps exact).
fn positive_scale(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && v >= 1e-3 {
        Ok(v)
    } else {
        Err("must be a finite number, at least 0.001".into())
    }
}

#[derive(Parser, Debug)]
#[command(about = "Close unpaid orders after a timeout, through delaywheel's Redis queue")]
struct Args {
    /// Orders to place.
    #[arg(long, default_value_t = 2_000)]
    orders: usize,
    /// The order timeout in seconds (design note 000: 30 minutes; 0 or more).
    #[arg(long, default_value_t = 1_800.0, value_parser = non_negative)]
    timeout_secs: f64,
    /// Divide every duration by this (1 = real time; at least 1e-3).
    #[arg(long, default_value_t = 1_000.0, value_parser = positive_scale)]
    scale: f64,
    /// Share of orders paid before their timeout.
    #[arg(long, default_value_t = 0.6)]
    pay_ratio: f64,
    /// Share of first and second attempts that fail (a flaky dependency), retried with backoff.
    #[arg(long, default_value_t = 0.1)]
    fail_ratio: f64,
    /// Poison tasks (no order id): they dead-letter after the last attempt.
    #[arg(long, default_value_t = 3)]
    poison: usize,
    /// Use this Redis instead of starting a private one.
    #[arg(long)]
    redis: Option<String>,
    /// A seconds-long run for tests.
    #[arg(long)]
    smoke: bool,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    WaitPay,
    Paid,
    Closed,
}

/// The orders table; `close` is the conditional update `UPDATE orders SET status = 'CLOSED'
/// WHERE id = ? AND status = 'WAIT_PAY'`, returning the rows it changed.
#[derive(Default)]
struct Orders(Mutex<HashMap<u64, Status>>);

impl Orders {
    fn status(&self, id: u64) -> Option<Status> {
        self.0.lock().get(&id).copied()
    }

    fn close(&self, id: u64) -> usize {
        match self.0.lock().get_mut(&id) {
            Some(s) if *s == Status::WaitPay => {
                *s = Status::Closed;
                1
            }
            _ => 0,
        }
    }
}

#[derive(Default)]
struct Counts {
    closed: AtomicU64,
    skipped_paid: AtomicU64,
    no_change: AtomicU64,
    failed_attempts: AtomicU64,
    /// Completed deliveries per order: every order must have one, and more are duplicates.
    delivered: Mutex<HashMap<u64, u32>>,
}

fn main() {
    let mut args = Args::parse();
    if args.smoke {
        args.orders = 300;
        args.scale = 3_600.0; // 30 min → 0.5 s
    }
    let scaled = |secs: f64| Duration::from_secs_f64(secs / args.scale);
    // Kept alive until the end of main: a private server stops when dropped.
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    // A fixed name: an earlier run against the same Redis (`--redis`) may have left keys.
    redis_server::RedisServer::clear_namespace(&url, "orders");
    let mut cfg = QueueConfig::new(url, "orders");
    cfg.retry = RetryPolicy {
        max_attempts: 5,
        // attempt² seconds, scaled like every other duration (at least 5 ms).
        backoff: Backoff::Quadratic {
            unit: scaled(1.0).max(Duration::from_millis(5)),
        },
    };
    let orders = Arc::new(Orders::default());
    let counts = Arc::new(Counts::default());
    let handler = {
        let (orders, counts, fail_ratio) = (orders.clone(), counts.clone(), args.fail_ratio);
        move |task: &delaywheel::redis::Envelope| -> Result<(), delaywheel::redis::HandlerError> {
            let Some(id) = task.payload["order_id"].as_u64() else {
                return Err("payload has no order_id".into());
            };
            // The flaky dependency fails some first and second attempts; the retries get
            // through, so only poison tasks exhaust their attempts.
            if task.attempt < 2 && fastrand::f64() < fail_ratio {
                counts.failed_attempts.fetch_add(1, Relaxed);
                return Err("order service timed out".into());
            }
            match orders.status(id) {
                Some(Status::Paid) => {
                    counts.skipped_paid.fetch_add(1, Relaxed);
                }
                Some(_) => {
                    // Conditional update: a duplicate delivery changes no row.
                    if orders.close(id) == 1 {
                        counts.closed.fetch_add(1, Relaxed);
                    } else {
                        counts.no_change.fetch_add(1, Relaxed);
                    }
                }
                None => return Err(format!("order {id} not found").into()),
            }
            *counts.delivered.lock().entry(id).or_default() += 1;
            Ok(())
        }
    };
    let handler = Arc::new(handler);
    let consumers: Vec<Consumer> = (0..2)
        .map(|_| {
            let h = handler.clone();
            Consumer::start(
                cfg.clone(),
                Handlers::new().on("order.close.timeout", move |t| h(t)),
            )
            .expect("consumer")
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let producer = rt.block_on(Producer::connect(cfg)).expect("producer");

    // Place the orders over a short while; pay some of them before their timeout.
    let timeout = scaled(args.timeout_secs);
    let start = Instant::now();
    let mut paid = Vec::new();
    for id in 0..args.orders as u64 {
        orders.0.lock().insert(id, Status::WaitPay);
        if fastrand::f64() < args.pay_ratio {
            // Paid well within the timeout: here before the timeout task is even queued, so
            // that a stall of this thread (the smoke run's timeout is 0.5 s) cannot let the
            // timeout fire first and close an order the report counts as paid.
            orders.0.lock().insert(id, Status::Paid);
            paid.push(id);
        }
        rt.block_on(producer.enqueue(
            format!("order:{id}:close"),
            "order.close.timeout",
            serde_json::json!({ "order_id": id, "biz": "close unpaid order" }),
            When::After(timeout),
        ))
        .expect("enqueue");
    }
    for i in 0..args.poison {
        rt.block_on(producer.enqueue(
            format!("poison:{i}"),
            "order.close.timeout",
            serde_json::json!({ "garbage": true }),
            When::After(timeout),
        ))
        .expect("enqueue");
    }

    // Wait for every order to be settled and every poison task to be dead-lettered.
    let unpaid = args.orders - paid.len();
    let give_up = start + timeout + Duration::from_secs(60) + scaled(1.0) * 60;
    loop {
        let settled = counts.delivered.lock().len();
        let dead = rt.block_on(producer.depth()).expect("depth").dead;
        if settled >= args.orders && dead >= args.poison as u64 || Instant::now() > give_up {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats: Vec<_> = consumers.iter().map(|c| c.stats()).collect();
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).expect("shutdown");
    }
    let dead = rt
        .block_on(producer.dead_letters(args.poison + 100))
        .expect("dead letters");
    let (undelivered, duplicates) = {
        let delivered = counts.delivered.lock();
        let undelivered = (0..args.orders as u64)
            .filter(|id| !delivered.contains_key(id))
            .count();
        let extra: u64 = delivered.values().map(|&n| u64::from(n - 1)).sum();
        (undelivered, extra)
    };
    let closed = counts.closed.load(Relaxed);
    let still_open = orders
        .0
        .lock()
        .values()
        .filter(|s| **s == Status::WaitPay)
        .count();
    // Each consumer keeps its own histogram: the worst of their p99s, not the p99 of all.
    let p99_ms = stats.iter().map(|s| s.lateness_p99_us).max().unwrap_or(0) as f64 / 1e3;
    let retried: u64 = stats.iter().map(|s| s.retried).sum();
    println!("orders placed           {}", args.orders);
    println!("paid before timeout     {}", paid.len());
    println!("closed unpaid           {closed} (expected {unpaid})");
    println!(
        "skipped, already paid   {}",
        counts.skipped_paid.load(Relaxed)
    );
    println!(
        "duplicate deliveries    {duplicates} ({} of them to unpaid orders: no row changed)",
        counts.no_change.load(Relaxed)
    );
    println!("never delivered         {undelivered}");
    println!(
        "failed attempts         {} ({retried} retried)",
        counts.failed_attempts.load(Relaxed)
    );
    println!("dead-lettered           {}", dead.len());
    for d in &dead {
        println!("  {} after {} attempts: {}", d.id, d.attempt, d.reason);
    }
    println!("still WAIT_PAY          {still_open}");
    println!("lateness p99            {p99_ms:.2} ms (the worst consumer's)");
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "orders": args.orders,
                "paid": paid.len(),
                "closed": closed,
                "expected_closed": unpaid,
                "skipped_paid": counts.skipped_paid.load(Relaxed),
                "duplicates": duplicates,
                "undelivered": undelivered,
                "retried": retried,
                "dead_lettered": dead.len(),
                "still_open": still_open,
                "lateness_p99_ms": p99_ms,
            })
        );
    }
    if closed != unpaid as u64 || still_open != 0 || dead.len() != args.poison || undelivered != 0 {
        eprintln!(
            "FAILED: every order's task must be delivered, every unpaid order close exactly \
             once, and only poison may dead-letter"
        );
        std::process::exit(1);
    }
}
