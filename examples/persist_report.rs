//! Measures the Redis persistence layer against its targets, on a private `redis-server` (or
//! `--redis URL`), and prints a report:
//!
//! * schedule + cancel through a `WriteBehind` [`Persistent`] engine vs the in-memory
//!   `Timer<String>` (target ≤ 2×), same ids, same run;
//! * flusher throughput: task upserts, and removals, per second written to Redis (target
//!   ≥ 300k/s);
//! * restore of N pending tasks with 100-byte payloads into a new engine (target ≤ 5 s at 1M);
//! * Redis memory per persisted task (`INFO memory`, used_memory growth / N).
//!
//! ```text
//! cargo run --release --features redis --example persist_report           # 1M tasks
//! cargo run --features redis --example persist_report -- --smoke --json    # make test
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::redis::{now_ms, PersistConfig, Persistent};
use delaywheel::Timer;

#[derive(Parser, Debug)]
#[command(about = "Measure delaywheel's Redis persistence against its targets")]
struct Args {
    /// Pending tasks for the flush, restore and memory figures.
    #[arg(long, default_value_t = 1_000_000)]
    tasks: usize,
    /// Payload bytes per task.
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// Schedule + cancel pairs per measured round (7 rounds; the median is reported).
    #[arg(long, default_value_t = 200_000)]
    pairs: usize,
    /// Use this Redis instead of starting a private one (the namespace is deleted first).
    #[arg(long)]
    redis: Option<String>,
    /// A seconds-long run for tests.
    #[arg(long)]
    smoke: bool,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn redis_conn(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

fn used_memory(url: &str) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query(&mut redis_conn(url))
        .expect("INFO memory");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO")
}

fn main() {
    let mut args = Args::parse();
    if args.smoke {
        args.tasks = 20_000;
        args.pairs = 5_000;
    }
    // Kept alive until the end of main: a private server stops when dropped.
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    let ns = "persist_report";
    redis::cmd("DEL")
        .arg(format!("{{{ns}}}:due"))
        .arg(format!("{{{ns}}}:tasks"))
        .query::<()>(&mut redis_conn(&url))
        .expect("DEL");
    let far = now_ms() + 3_600_000;
    let ids: Vec<String> = (0..args.tasks.max(args.pairs))
        .map(|i| format!("order:{i:08}"))
        .collect();

    // 1. schedule + cancel, interleaved rounds so both see the same machine state.
    let timer: Timer<String> = Timer::builder().build_channel(None).expect("timer").0;
    let mut cfg = PersistConfig::new(url.clone(), ns);
    cfg.flush_interval = Duration::from_millis(5);
    let (persist, _fired) = Persistent::start(cfg).expect("persistent engine");
    let (mut mem_ns, mut persist_ns) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        for id in &ids[..args.pairs] {
            let t = timer
                .schedule(id.clone(), Duration::from_secs(3_600))
                .expect("schedule");
            timer.cancel(t);
        }
        mem_ns.push(t.elapsed().as_nanos() as f64 / args.pairs as f64);
        let t = Instant::now();
        for id in &ids[..args.pairs] {
            persist
                .schedule(id.clone(), "order.close", serde_json::Value::Null, far)
                .expect("schedule");
            persist.cancel(id);
        }
        persist_ns.push(t.elapsed().as_nanos() as f64 / args.pairs as f64);
    }
    let (mem_ns, persist_ns) = (median(mem_ns), median(persist_ns));
    drop(persist);

    // 2. flusher throughput: journal N upserts while the flusher sleeps, then time the flush.
    let payload = serde_json::Value::String("x".repeat(args.payload.saturating_sub(2)));
    let mem_before = used_memory(&url);
    let mut cfg = PersistConfig::new(url.clone(), ns);
    cfg.flush_interval = Duration::from_secs(3_600);
    cfg.journal_bound = args.tasks + 1;
    let (persist, _fired) = Persistent::start(cfg).expect("persistent engine");
    assert!(persist.flush(Duration::from_secs(10)), "first flush");
    for (i, id) in ids[..args.tasks].iter().enumerate() {
        persist
            .schedule(id.clone(), "order.close", payload.clone(), far + i as u64)
            .expect("schedule");
    }
    let t = Instant::now();
    assert!(persist.flush(Duration::from_secs(600)), "flush timed out");
    let flush = t.elapsed();
    let flush_ops_per_s = args.tasks as f64 / flush.as_secs_f64();
    drop(persist);
    let bytes_per_task = (used_memory(&url) - mem_before) as f64 / args.tasks as f64;

    // 3. restore into a new engine.
    let (persist, _fired) =
        Persistent::start(PersistConfig::new(url.clone(), ns)).expect("persistent engine");
    let t = Instant::now();
    let report = persist.restore(1_000).expect("restore");
    let restore = t.elapsed();
    let lost = args.tasks - report.loaded;
    drop(persist);

    // 4. flusher throughput for removals: restore again into an engine whose flusher waits,
    // cancel every task, then time the flush.
    let mut cfg = PersistConfig::new(url.clone(), ns);
    cfg.flush_interval = Duration::from_secs(3_600);
    cfg.journal_bound = args.tasks + 1;
    let (persist, _fired) = Persistent::start(cfg).expect("persistent engine");
    persist.restore(1_000).expect("restore");
    for id in &ids[..args.tasks] {
        persist.cancel(id);
    }
    let t = Instant::now();
    assert!(persist.flush(Duration::from_secs(600)), "flush timed out");
    let remove_ops_per_s = args.tasks as f64 / t.elapsed().as_secs_f64();
    drop(persist);

    let restore_s_per_million = restore.as_secs_f64() * 1e6 / args.tasks as f64;
    println!(
        "delaywheel persistence report ({} tasks, {} B payloads)",
        args.tasks, args.payload
    );
    println!(
        "{:<44} {:>12} {:>12} {:>8}",
        "figure", "measured", "target", "ratio"
    );
    println!(
        "{:<44} {:>9.0} ns {:>12} {:>7.2}×",
        "schedule+cancel, in-memory Timer<String>", mem_ns, "", 1.0
    );
    println!(
        "{:<44} {:>9.0} ns {:>12} {:>7.2}×",
        "schedule+cancel, Persistent WriteBehind",
        persist_ns,
        "≤ 2×",
        persist_ns / mem_ns
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher upserts", flush_ops_per_s, "≥ 300000/s"
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher removals (cancel of a persisted task)", remove_ops_per_s, ""
    );
    println!(
        "{:<44} {:>10.2} s {:>12}",
        format!("restore of {} tasks", args.tasks),
        restore.as_secs_f64(),
        ""
    );
    println!(
        "{:<44} {:>10.2} s {:>12}",
        "restore, scaled to 1M tasks", restore_s_per_million, "≤ 5 s"
    );
    println!(
        "{:<44} {:>10.0} B {:>12}",
        "Redis memory per task (ZSET + HASH)", bytes_per_task, ""
    );
    println!("{:<44} {:>12}", "lost in restore", lost);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "tasks": args.tasks,
                "payload_bytes": args.payload,
                "schedule_cancel_mem_ns": mem_ns,
                "schedule_cancel_persist_ns": persist_ns,
                "schedule_cancel_ratio": persist_ns / mem_ns,
                "flush_ops_per_s": flush_ops_per_s,
                "flush_remove_ops_per_s": remove_ops_per_s,
                "restore_s": restore.as_secs_f64(),
                "restore_s_per_million": restore_s_per_million,
                "redis_bytes_per_task": bytes_per_task,
                "lost": lost,
            })
        );
    }
    if lost != 0 {
        std::process::exit(1);
    }
}
