//! delaywheel's shared delay queue against the polling consumers of the design notes, in one
//! run: the four schemes of design note 002.
//!
//! 1. `pg-poll50-1s`, scheme 1, a database table polled: pollers claim up to 50 due rows with
//!    `SELECT … FOR UPDATE SKIP LOCKED` (marking them taken), delete them once handled, and
//!    sleep 1 s when nothing is due, on a private PostgreSQL;
//! 2. `note000-pop1-200ms`, scheme 2 (design note 000): a Lua pop of 1 task from a ZSET,
//!    sleeping 200 ms when nothing is due;
//! 3. `note002-pop50-500ms`, scheme 3: a Lua pop of 50, sleeping 500 ms when nothing is due;
//! 4. `delaywheel`, scheme 4: claims of the lookahead window into each consumer's wheel,
//!    wake-ups by PUBLISH, fired at the due millisecond.
//!
//! Each design gets the same workload on a fresh namespace (or table): `--consumers`
//! instances, `--tasks` tasks enqueued over `spread − max_delay` seconds with delays uniform in
//! `[0, max_delay]` (so due times spread over `spread` seconds). The handler records its fire
//! time. The Redis designs' producer sends one `enqueue` per task (256 in flight); the table's
//! sends one multi-row `INSERT` of what is due each millisecond (a transaction per row would
//! be a WAL flush per row). Reported per design: lateness (fire − due) p50/p99/max,
//! consumer-side commands or queries per fired task, the server's CPU over the run (Redis: INFO
//! cpu; PostgreSQL: its processes in procfs) and per task, producer's writes included,
//! duplicates and lost tasks. The private PostgreSQL runs with `fsync=off` (the private Redis
//! keeps nothing on disk either) and `synchronous_commit` as shipped.
//!
//! ```text
//! cargo run --release --features postgres --example vs_polling            # 200k tasks, 20 s each
//! cargo run --release --features postgres --example vs_polling -- --quick # under a minute
//! cargo run --features postgres --example vs_polling -- --smoke --json    # make test
//! ```

#[path = "../tests/support/pg_server.rs"]
mod pg_server;
#[path = "support/procfs.rs"]
mod procfs;
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
    /// Designs to run, of: pg-poll50-1s, note000-pop1-200ms, note002-pop50-500ms, delaywheel.
    #[arg(long, value_delimiter = ',', default_values_t = DESIGNS.map(String::from))]
    designs: Vec<String>,
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

const DESIGNS: [&str; 4] = [
    "pg-poll50-1s",
    "note000-pop1-200ms",
    "note002-pop50-500ms",
    "delaywheel",
];

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Deliveries: (id, due ms, fire µs).
type Log = Arc<Mutex<Vec<(String, u64, u64)>>>;

struct Report {
    name: String,
    /// "redis" or "postgres".
    server: &'static str,
    fired: usize,
    lost: usize,
    duplicates: usize,
    early: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    cmds_per_task: f64,
    server_cpu_s: f64,
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

fn run_design(name: &str, args: &Args, url: &str, work: &[(String, u64, u64)]) -> Report {
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
    wait_for(name, args, &log, work.len(), &producing);
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

    report(name, "redis", &log, work, consumer_cmds, redis_cpu_s)
}

/// The outcome of one design from its delivery log.
fn report(
    name: &str,
    server: &'static str,
    log: &Log,
    work: &[(String, u64, u64)],
    cmds: u64,
    server_cpu_s: f64,
) -> Report {
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
        name: name.to_string(),
        server,
        fired: unique,
        lost: work.len() - unique,
        duplicates: log.len() - unique,
        early,
        p50_ms: hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_ms: hist.value_at_quantile(0.99) as f64 / 1e3,
        max_ms: hist.max() as f64 / 1e3,
        cmds_per_task: cmds as f64 / unique.max(1) as f64,
        server_cpu_s,
    }
}

/// Scheme 1's table, after design note 002 (its `status`: 0 waiting, 1 taken), with a
/// partial index on the due time of the waiting rows.
const DB_SCHEMA: &str = "
DROP TABLE IF EXISTS delay_tasks;
CREATE TABLE delay_tasks (
    id         text PRIMARY KEY,
    task_type  text NOT NULL,
    payload    text NOT NULL,
    execute_at bigint NOT NULL,
    status     smallint NOT NULL DEFAULT 0
);
CREATE INDEX delay_tasks_due ON delay_tasks (execute_at) WHERE status = 0;";

/// The producer's write: every task due to be enqueued this millisecond, in one statement.
const DB_INSERT: &str = "INSERT INTO delay_tasks (id, task_type, payload, execute_at)
    SELECT u.id, 'job', 'null', u.at FROM unnest($1::text[], $2::bigint[]) AS u(id, at)";

/// A poller's claim: up to $2 rows due by $1, skipping rows another poller holds.
const DB_CLAIM: &str = "UPDATE delay_tasks t SET status = 1
    FROM (SELECT id FROM delay_tasks WHERE status = 0 AND execute_at <= $1
          ORDER BY execute_at LIMIT $2 FOR UPDATE SKIP LOCKED) c
    WHERE t.id = c.id RETURNING t.id, t.execute_at";

/// A poller's ack of what it handled.
const DB_ACK: &str =
    "DELETE FROM delay_tasks d USING unnest($1::text[]) AS u(id) WHERE d.id = u.id";

/// Enqueues the workload into the table in real time, one `INSERT` per millisecond's tasks.
async fn produce_db(url: &str, work: &[(String, u64, u64)]) {
    let client = pg_server::connect(url).await;
    let insert = client.prepare(DB_INSERT).await.expect("prepare");
    let start = Instant::now();
    let mut i = 0;
    while i < work.len() {
        let elapsed = start.elapsed().as_millis() as u64;
        let end = work[i..].partition_point(|t| t.1 <= elapsed) + i;
        if end > i {
            let now = now_ms() as i64;
            let ids: Vec<&str> = work[i..end].iter().map(|t| t.0.as_str()).collect();
            let at: Vec<i64> = work[i..end].iter().map(|t| now + t.2 as i64).collect();
            client.execute(&insert, &[&ids, &at]).await.expect("insert");
        }
        i = end;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A table poller: claim up to `n` due rows, record them as fired, delete them; sleep `idle`
/// when none was due.
async fn db_poller(
    url: String,
    n: i64,
    idle: Duration,
    log: Log,
    queries: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let client = pg_server::connect(&url).await;
    let claim = client.prepare(DB_CLAIM).await.expect("prepare");
    let ack = client.prepare(DB_ACK).await.expect("prepare");
    while !stop.load(Relaxed) {
        queries.fetch_add(1, Relaxed);
        let rows = client
            .query(&claim, &[&(now_ms() as i64), &n])
            .await
            .expect("claim");
        if rows.is_empty() {
            tokio::time::sleep(idle).await;
            continue;
        }
        let fired = now_us();
        let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        {
            let mut log = log.lock();
            for (id, row) in ids.iter().zip(&rows) {
                log.push((id.clone(), row.get::<_, i64>(1) as u64, fired));
            }
        }
        queries.fetch_add(1, Relaxed);
        client.execute(&ack, &[&ids]).await.expect("ack");
    }
}

/// Scheme 1 on the private PostgreSQL.
fn run_db_design(
    name: &str,
    args: &Args,
    pg: &pg_server::PgServer,
    work: &[(String, u64, u64)],
) -> Report {
    let url = pg.url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        pg_server::connect(&url)
            .await
            .batch_execute(DB_SCHEMA)
            .await
            .expect("create the table")
    });
    let log: Log = Arc::default();
    let queries = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let pid = pg.pid().expect("PostgreSQL runs");
    let cpu_before = procfs::tree_cpu(pid);
    let pollers: Vec<_> = (0..args.consumers)
        .map(|_| {
            rt.spawn(db_poller(
                url.clone(),
                50,
                Duration::from_secs(1),
                log.clone(),
                queries.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let producing = {
        let (url, work) = (url.clone(), work.to_vec());
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(produce_db(&url, &work))
        })
    };
    wait_for(name, args, &log, work.len(), &producing);
    producing.join().expect("producer");
    stop.store(true, Relaxed);
    rt.block_on(async {
        for p in pollers {
            p.await.expect("poller");
        }
    });
    let cpu_s = (procfs::tree_cpu(pid) - cpu_before).as_secs_f64();
    report(name, "postgres", &log, work, queries.load(Relaxed), cpu_s)
}

/// Shows progress until every task fired and the producer is done, or `spread + 10` s.
fn wait_for(
    name: &str,
    args: &Args,
    log: &Log,
    tasks: usize,
    producing: &std::thread::JoinHandle<()>,
) {
    let bar = indicatif::ProgressBar::new(tasks as u64).with_message(name.to_string());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>22} [{bar:40}] {pos}/{len} fired")
            .expect("template")
            .progress_chars("=> "),
    );
    let deadline = Instant::now() + Duration::from_secs_f64(args.spread + 10.0);
    loop {
        let fired = log.lock().len();
        bar.set_position(fired as u64);
        if (fired >= tasks && producing.is_finished()) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bar.finish_and_clear();
}

fn main() {
    let mut args = Args::parse();
    if args.quick {
        (args.tasks, args.spread, args.max_delay) = (40_000, 8.0, 4.0);
    }
    if args.smoke {
        (args.tasks, args.spread, args.max_delay) = (2_000, 2.0, 1.0);
    }
    for d in &args.designs {
        if !DESIGNS.contains(&d.as_str()) {
            eprintln!("unknown design {d:?}: one of {}", DESIGNS.join(", "));
            std::process::exit(2);
        }
    }
    // Kept alive until the end of main: a private server stops when dropped.
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    let pg = args
        .designs
        .iter()
        .any(|d| d.starts_with("pg-"))
        .then(pg_server::PgServer::start);
    let work = workload(&args);
    let reports: Vec<Report> = args
        .designs
        .iter()
        .map(|name| match &pg {
            Some(pg) if name.starts_with("pg-") => run_db_design(name, &args, pg, &work),
            _ => run_design(name, &args, &url, &work),
        })
        .collect();
    println!(
        "{} tasks, {} consumers, due times over {} s, delays 0..{} s",
        args.tasks, args.consumers, args.spread, args.max_delay
    );
    println!(
        "{:<22} {:>8} {:>6} {:>6} {:>9} {:>9} {:>9} {:>10} {:>9} {:>11}",
        "design",
        "fired",
        "lost",
        "dups",
        "p50 ms",
        "p99 ms",
        "max ms",
        "cmds/task",
        "server",
        "cpu µs/task"
    );
    for r in &reports {
        println!(
            "{:<22} {:>8} {:>6} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>10.4} {:>9} {:>11.1}",
            r.name,
            r.fired,
            r.lost,
            r.duplicates,
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.cmds_per_task,
            r.server,
            r.server_cpu_s * 1e6 / r.fired.max(1) as f64
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
                    "server": r.server,
                    "cmds_per_task": r.cmds_per_task,
                    "server_cpu_s": r.server_cpu_s,
                    "server_cpu_us_per_task": r.server_cpu_s * 1e6 / r.fired.max(1) as f64,
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "designs": designs }));
    }
    // The contenders' losses are results to report; ours fail the run.
    if reports
        .iter()
        .any(|r| r.name == "delaywheel" && (r.lost > 0 || r.duplicates > 0 || r.early > 0))
    {
        std::process::exit(1);
    }
}
