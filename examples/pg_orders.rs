//! Design note 000's order timeout on PostgreSQL alone: orders in a real table, their close
//! tasks in a [`Persistent`] engine on [`PgStore`] in the same database, and the safety net,
//! a compensation query that closes any order past its deadline whose task was lost.
//!
//! On a private PostgreSQL started here: `--orders` orders, due over `--spread` seconds; a
//! fifth are paid before their deadline (their task cancelled). Then loss is made to happen:
//! a tenth of the pending tasks are deleted behind the engine's back and the process restarts
//! (the engine stops; its journal is empty by then, so nothing rewrites those rows), and the
//! engine that starts next restores everything but those. Each close is a conditional
//! `UPDATE … WHERE status = 'unpaid'`, idempotent. The compensation scan runs every `--scan`
//! seconds and closes the unpaid orders more than `--grace` past their deadline (the grace
//! leaves the tasks that are firing to close their own). The report says how many each path
//! closed, and checks that every unpaid order was closed, the scan closing exactly the lost
//! ones, none open past its deadline by more than the scan interval plus the grace.
//!
//! ```text
//! cargo run --release --features postgres --example pg_orders
//! cargo run --features postgres --example pg_orders -- --smoke --json   # make test
//! ```

#[path = "../tests/support/pg_server.rs"]
mod pg_server;

use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::postgres::{PgConfig, PgStore};
use delaywheel::redis::{now_ms, PersistConfig, Persistent};

#[derive(Parser, Debug)]
#[command(about = "Order timeouts on PostgreSQL: PgStore, and a compensation scan for lost tasks")]
struct Args {
    /// Orders created.
    #[arg(long, default_value_t = 20_000)]
    orders: u64,
    /// Their deadlines spread over this many seconds from now.
    #[arg(long, default_value_t = 20.0)]
    spread: f64,
    /// Seconds between two runs of the compensation scan.
    #[arg(long, default_value_t = 2.0)]
    scan: f64,
    /// The scan closes orders this many seconds past their deadline.
    #[arg(long, default_value_t = 1.0)]
    grace: f64,
    /// A few seconds' run, for tests.
    #[arg(long)]
    smoke: bool,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

/// The order service's side: closes an order if it is still unpaid (idempotent).
const CLOSE: &str = "UPDATE orders SET status = 'closed', closed_by = $2, closed_at_ms = $3
                     WHERE id = $1 AND status = 'unpaid'";

/// The safety net: every unpaid order past its deadline (by the grace, $2 ms), whatever
/// became of its task.
const COMPENSATE: &str =
    "UPDATE orders SET status = 'closed', closed_by = 'scan', closed_at_ms = $1
                          WHERE status = 'unpaid' AND deadline_ms < $1::int8 - $2::int8";

fn engine(
    rt: &tokio::runtime::Runtime,
    url: &str,
) -> (
    Persistent<PgStore>,
    crossbeam_channel::Receiver<delaywheel::redis::Envelope>,
) {
    let store = rt
        .block_on(PgStore::connect(PgConfig::new(url, "pg_orders")))
        .expect("PgStore");
    Persistent::with_store(PersistConfig::new("unused://", "pg_orders"), store).expect("engine")
}

fn main() {
    let mut args = Args::parse();
    if args.smoke {
        (args.orders, args.spread, args.scan, args.grace) = (2_000, 2.0, 0.5, 0.5);
    }
    let server = pg_server::PgServer::start_with(&[]);
    let url = server.url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let db = rt.block_on(async {
        let client = server.client().await;
        client
            .batch_execute(
                "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL,
                 deadline_ms bigint NOT NULL, closed_by text, closed_at_ms bigint);
                 CREATE INDEX orders_open ON orders (deadline_ms) WHERE status = 'unpaid';",
            )
            .await
            .expect("orders table");
        client
    });

    // Orders and their close tasks.
    let (engine1, _fired) = engine(&rt, &url);
    engine1.restore(4_000).expect("restore");
    let start = now_ms() + 500;
    let spread_ms = (args.spread * 1e3) as u64;
    let deadline = |i: u64| start + i * spread_ms / args.orders.max(1);
    rt.block_on(async {
        let ids: Vec<i64> = (0..args.orders as i64).collect();
        let deadlines: Vec<i64> = (0..args.orders).map(|i| deadline(i) as i64).collect();
        db.execute(
            "INSERT INTO orders (id, status, deadline_ms)
             SELECT id, 'unpaid', d FROM unnest($1::int8[], $2::int8[]) AS u(id, d)",
            &[&ids, &deadlines],
        )
        .await
        .expect("orders");
    });
    for i in 0..args.orders {
        engine1
            .schedule_at_ms(format!("close:{i}"), "order.close", &i, deadline(i))
            .expect("schedule");
    }
    // A fifth are paid: the order is updated and its task cancelled.
    let paid: Vec<i64> = (0..args.orders as i64).filter(|i| i % 5 == 0).collect();
    rt.block_on(db.execute(
        "UPDATE orders SET status = 'paid' WHERE id = ANY($1)",
        &[&paid],
    ))
    .expect("pay");
    for i in &paid {
        engine1.cancel(&format!("close:{i}"));
    }
    assert!(engine1.flush(Duration::from_secs(60)), "flush");

    // Loss: a tenth of the pending tasks deleted behind the engine's back, then a crash.
    let lost = rt
        .block_on(db.execute(
            "DELETE FROM public.delaywheel_tasks
             WHERE ns = 'pg_orders' AND (substr(id, 7)::int8 % 10) = 3",
            &[],
        ))
        .expect("delete");
    drop(engine1); // the process stops: its journal is empty, nothing rewrites those rows

    // The process that starts next: restores, closes what fires, and runs the scan.
    let (engine2, fired) = engine(&rt, &url);
    let report = engine2.restore(4_000).expect("restore");
    let scan_every = Duration::from_secs_f64(args.scan);
    let end = Instant::now()
        + Duration::from_millis(deadline(args.orders).saturating_sub(now_ms()))
        + 2 * scan_every
        + Duration::from_secs_f64(args.grace)
        + Duration::from_secs(1);
    let (mut by_task, mut by_scan, mut late_us) = (0u64, 0u64, Vec::new());
    let mut next_scan = Instant::now() + scan_every;
    let grace_ms = (args.grace * 1e3) as i64;
    while Instant::now() < end {
        if let Ok(task) = fired.recv_timeout(Duration::from_millis(10)) {
            let id: i64 = task.id["close:".len()..].parse().expect("order id");
            let now = now_ms();
            late_us.push(now.saturating_sub(task.due_at) * 1_000);
            let n = rt
                .block_on(db.execute(CLOSE, &[&id, &"task", &(now as i64)]))
                .expect("close");
            by_task += n;
            engine2.ack(&task);
        }
        if Instant::now() >= next_scan {
            let n = rt
                .block_on(db.execute(COMPENSATE, &[&(now_ms() as i64), &grace_ms]))
                .expect("scan");
            by_scan += n;
            next_scan += scan_every;
        }
    }
    assert!(engine2.shutdown().is_empty(), "unwritten at shutdown");

    // No order open past its deadline + the scan interval, none left open at all.
    let (open, overdue_ms): (i64, i64) = rt.block_on(async {
        let open: i64 = db
            .query_one("SELECT count(*) FROM orders WHERE status = 'unpaid'", &[])
            .await
            .expect("open")
            .get(0);
        let overdue: i64 = db
            .query_one(
                "SELECT coalesce(max(closed_at_ms - deadline_ms), 0) FROM orders WHERE status = 'closed'",
                &[],
            )
            .await
            .expect("overdue")
            .get(0);
        (open, overdue)
    });
    late_us.sort_unstable();
    let q = |p: f64| {
        late_us
            .get(((late_us.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1e3
    };
    let scan_ms = (args.scan * 1e3) as i64;
    let bound_ms = scan_ms + grace_ms;
    println!(
        "{} orders over {} s; {} paid; {lost} tasks deleted behind the engine's back, then a restart",
        args.orders,
        args.spread,
        paid.len()
    );
    println!("restored after the restart: {} tasks", report.loaded);
    println!(
        "closed by their task: {by_task} (lateness p50 {:.2} ms, p99 {:.2} ms); closed by the \
         compensation scan (every {} s): {by_scan}",
        q(0.5),
        q(0.99),
        args.scan
    );
    println!(
        "still open: {open}; longest an order stayed open past its deadline: {overdue_ms} ms \
         (bound: the scan interval and the grace, {bound_ms} ms, and a scan's run)"
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "orders": args.orders, "paid": paid.len(), "tasks_deleted": lost,
                "restored": report.loaded, "closed_by_task": by_task, "closed_by_scan": by_scan,
                "task_lateness_p50_ms": q(0.5), "task_lateness_p99_ms": q(0.99),
                "still_open": open, "max_open_past_deadline_ms": overdue_ms,
            })
        );
    }
    let expected = args.orders - paid.len() as u64;
    if open != 0
        || by_task + by_scan != expected
        || by_scan != lost
        || overdue_ms > bound_ms + 1_000
    {
        eprintln!(
            "FAILED: {open} open, {by_task} + {by_scan} closed of {expected}, {lost} lost, \
             {overdue_ms} ms past a deadline"
        );
        std::process::exit(1);
    }
}
