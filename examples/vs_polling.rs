//! delaywheel's shared delay queue against the ZSET polling consumers of the design notes, on
//! one Redis, in one run:
//!
//! 1. design note 000: a Lua pop of 1 task, sleeping 200 ms when nothing is due;
//! 2. design note 002: a Lua pop of 50, sleeping 500 ms when nothing is due;
//! 3. delaywheel: claims of the lookahead window into each consumer's wheel, wake-ups by
//!    PUBLISH, fired at the due millisecond.
//!
//! Each design gets the same workload on a fresh namespace: `--consumers` instances, `--tasks`
//! tasks enqueued over `spread − max_delay` seconds with delays uniform in `[0, max_delay]`
//! (so due times spread over `spread` seconds). The handler records its fire time. Reported
//! per design: lateness (fire − due) p50/p99/max, consumer-side Redis commands per fired task,
//! Redis CPU over the run (INFO cpu; the producer's enqueues are the same for every design (only delaywheel's also PUBLISH wake-ups)),
//! duplicates and lost tasks.
//!
//! ```text
//! cargo run --release --features redis --example vs_polling            # 200k tasks, 20 s each
//! cargo run --release --features redis --example vs_polling -- --quick # under a minute
//! cargo run --features redis --example vs_polling -- --smoke --json    # make test
//! ```

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use delaywheel::redis::{now_ms, Consumer, Handlers, Producer, QueueConfig, When};
use futures_util::StreamExt;
use hdrhistogram::Histogram;
use parking_lot::Mutex;

#[derive(Parser, Debug, Clone)]
#[command(about = "delaywheel's Redis delay queue vs ZSET polling consumers")]
struct Args {
    /// Tasks per design.
    #[arg(long, default_value_t = 200_000)]
    tasks: usize,
    /// Due times spread over this many seconds.
    #[arg(long, default_value_t = 20.0)]
    spread: f64,
    /// Delays are uniform in [0, max_delay] seconds.
    #[arg(long, default_value_t = 10.0)]
    max_delay: f64,
    /// Consumer instances per design.
    #[arg(long, default_value_t = 4)]
    consumers: usize,
    /// Use this Redis instead of starting a private one.
    #[arg(long)]
    redis: Option<String>,
    /// A smaller workload (40k tasks over 8 s) that runs in under a minute.
    #[arg(long)]
    quick: bool,
    /// A seconds-long run for tests.
    #[arg(long)]
    smoke: bool,
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Deliveries: (id, due ms, fire µs).
type Log = Arc<Mutex<Vec<(String, u64, u64)>>>;

struct Report {
    name: &'static str,
    fired: usize,
    lost: usize,
    duplicates: usize,
    early: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    cmds_per_task: f64,
    redis_cpu_s: f64,
}

fn redis_cpu(url: &str) -> f64 {
    redis_server::info_sum(url, "cpu", &["used_cpu_sys", "used_cpu_user"])
}

/// The workload: (id, enqueue offset ms, delay ms), sorted by enqueue time.
fn workload(args: &Args) -> Vec<(String, u64, u64)> {
    let mut rng = fastrand::Rng::with_seed(7);
    let window = ((args.spread - args.max_delay) * 1_000.0).max(1.0) as u64;
    let max_delay = (args.max_delay * 1_000.0) as u64;
    let mut w: Vec<_> = (0..args.tasks)
        .map(|i| {
            (
                format!("task:{i}"),
                rng.u64(0..window),
                rng.u64(0..=max_delay),
            )
        })
        .collect();
    w.sort_by_key(|t| t.1);
    w
}

/// Enqueues the workload in real time; returns when the last task is enqueued.
fn produce(rt: &tokio::runtime::Runtime, producer: &Producer, work: &[(String, u64, u64)]) {
    let start = Instant::now();
    rt.block_on(async {
        let mut i = 0;
        while i < work.len() {
            let elapsed = start.elapsed().as_millis() as u64;
            let end = work[i..].partition_point(|t| t.1 <= elapsed) + i;
            let now = now_ms();
            let batch: Vec<_> = work[i..end]
                .iter()
                .map(|(id, _, delay)| {
                    producer.enqueue(
                        id.clone(),
                        "job",
                        serde_json::Value::Null,
                        When::AtMs(now + delay),
                    )
                })
                .collect();
            let results: Vec<_> = futures_util::stream::iter(batch)
                .buffer_unordered(256)
                .collect()
                .await;
            for r in results {
                r.expect("enqueue");
            }
            i = end;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
}

/// The polling consumers: pop up to `n` due tasks atomically, sleep `idle` when none.
const POP: &str = r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for i = 1, #ids, 2 do
  redis.call('ZREM', KEYS[1], ids[i])
  redis.call('HGET', KEYS[2], ids[i])
  redis.call('HDEL', KEYS[2], ids[i])
  out[#out + 1] = ids[i]
  out[#out + 1] = ids[i + 1]
end
return out
";

fn poller(
    url: String,
    ns: String,
    n: usize,
    idle: Duration,
    log: Log,
    cmds: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let mut conn = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("redis");
    let script = redis::Script::new(POP);
    let (due_key, tasks_key) = (format!("{{{ns}}}:due"), format!("{{{ns}}}:tasks"));
    while !stop.load(Relaxed) {
        cmds.fetch_add(1, Relaxed);
        let popped: Vec<String> = script
            .key(&due_key)
            .key(&tasks_key)
            .arg(now_ms())
            .arg(n)
            .invoke(&mut conn)
            .expect("pop");
        if popped.is_empty() {
            std::thread::sleep(idle);
            continue;
        }
        let fired = now_us();
        let mut log = log.lock();
        for pair in popped.chunks_exact(2) {
            let due = pair[1].parse::<f64>().map_or(0, |f| f as u64);
            log.push((pair[0].clone(), due, fired));
        }
    }
}

fn run_design(name: &'static str, args: &Args, url: &str, work: &[(String, u64, u64)]) -> Report {
    let ns = format!("vs_{name}").replace('.', "_");
    // A fixed name: an earlier run against the same Redis (`--redis`) may have left keys.
    redis_server::RedisServer::clear_namespace(url, &ns);
    let log: Log = Arc::default();
    let cmds = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut cfg = QueueConfig::new(url, ns.as_str());
    cfg.notify = name == "delaywheel";
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let producer = rt
        .block_on(Producer::connect(cfg.clone()))
        .expect("producer");
    let cpu_before = redis_cpu(url);
    let mut pollers = Vec::new();
    let mut consumers = Vec::new();
    for _ in 0..args.consumers {
        match name {
            "delaywheel" => {
                let log = log.clone();
                let handlers = Handlers::new().on("job", move |task| {
                    log.lock().push((task.id.clone(), task.due_at, now_us()));
                    Ok(())
                });
                consumers.push(Consumer::start(cfg.clone(), handlers).expect("consumer"));
            }
            _ => {
                let (n, idle) = if name == "note000-pop1-200ms" {
                    (1, Duration::from_millis(200))
                } else {
                    (50, Duration::from_millis(500))
                };
                let (url, ns, log, cmds, stop) = (
                    url.to_string(),
                    ns.clone(),
                    log.clone(),
                    cmds.clone(),
                    stop.clone(),
                );
                pollers.push(std::thread::spawn(move || {
                    poller(url, ns, n, idle, log, cmds, stop)
                }));
            }
        }
    }
    let bar = indicatif::ProgressBar::new(work.len() as u64).with_message(name);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>22} [{bar:40}] {pos}/{len} fired")
            .expect("template")
            .progress_chars("=> "),
    );
    let producing = {
        let (producer, work) = (producer.clone(), work.to_vec());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            produce(&rt, &producer, &work);
        })
    };
    let deadline = Instant::now() + Duration::from_secs_f64(args.spread + 10.0);
    loop {
        let fired = log.lock().len();
        bar.set_position(fired as u64);
        if (fired >= work.len() && producing.is_finished()) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bar.finish_and_clear();
    producing.join().expect("producer");
    std::thread::sleep(Duration::from_millis(100)); // last acks
    stop.store(true, Relaxed);
    for p in pollers {
        p.join().expect("poller");
    }
    let mut consumer_cmds = cmds.load(Relaxed);
    for c in consumers {
        consumer_cmds += c.stats().commands;
        c.shutdown(Duration::from_secs(5)).expect("shutdown");
    }
    let redis_cpu_s = redis_cpu(url) - cpu_before;

    let log = log.lock();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram");
    let mut early = 0;
    for (id, due, fired) in log.iter() {
        *seen.entry(id.as_str()).or_default() += 1;
        let due_us = due * 1_000;
        if *fired < due_us {
            early += 1;
        }
        hist.record(fired.saturating_sub(due_us).max(1))
            .expect("record");
    }
    let unique = seen.len();
    Report {
        name,
        fired: unique,
        lost: work.len() - unique,
        duplicates: log.len() - unique,
        early,
        p50_ms: hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_ms: hist.value_at_quantile(0.99) as f64 / 1e3,
        max_ms: hist.max() as f64 / 1e3,
        cmds_per_task: consumer_cmds as f64 / unique.max(1) as f64,
        redis_cpu_s,
    }
}

fn main() {
    let mut args = Args::parse();
    if args.quick {
        (args.tasks, args.spread, args.max_delay) = (40_000, 8.0, 4.0);
    }
    if args.smoke {
        (args.tasks, args.spread, args.max_delay) = (2_000, 2.0, 1.0);
    }
    // Kept alive until the end of main: a private server stops when dropped.
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    let work = workload(&args);
    let reports: Vec<Report> = ["note000-pop1-200ms", "note002-pop50-500ms", "delaywheel"]
        .into_iter()
        .map(|name| run_design(name, &args, &url, &work))
        .collect();
    println!(
        "{} tasks, {} consumers, due times over {} s, delays 0..{} s",
        args.tasks, args.consumers, args.spread, args.max_delay
    );
    println!(
        "{:<22} {:>8} {:>6} {:>6} {:>9} {:>9} {:>9} {:>11} {:>10}",
        "design", "fired", "lost", "dups", "p50 ms", "p99 ms", "max ms", "cmds/task", "redis cpu"
    );
    for r in &reports {
        println!(
            "{:<22} {:>8} {:>6} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>11.4} {:>9.2}s",
            r.name,
            r.fired,
            r.lost,
            r.duplicates,
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.cmds_per_task,
            r.redis_cpu_s
        );
    }
    let early: usize = reports.iter().map(|r| r.early).sum();
    if early > 0 {
        println!("fired before due: {early}");
    }
    if args.json {
        let designs: Vec<_> = reports
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name,
                    "fired": r.fired,
                    "lost": r.lost,
                    "duplicates": r.duplicates,
                    "early": r.early,
                    "lateness_p50_ms": r.p50_ms,
                    "lateness_p99_ms": r.p99_ms,
                    "lateness_max_ms": r.max_ms,
                    "redis_cmds_per_task": r.cmds_per_task,
                    "redis_cpu_s": r.redis_cpu_s,
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "designs": designs }));
    }
    let ours = reports
        .iter()
        .find(|r| r.name == "delaywheel")
        .expect("ours");
    if ours.lost > 0 || ours.duplicates > 0 || ours.early > 0 {
        std::process::exit(1);
    }
}
