//! The shared queue at rising rates, beside the ZSET poller of design note 002, in one run:
//! where does the tail collapse?
//!
//! For each rate of `--rates` and each design, on a fresh namespace of one Redis: a producer
//! enqueues `rate × --duration` tasks at a steady pace, each due a uniform `[0, --max-delay]`
//! after its planned enqueue time, while `--consumers` consumers fire them. The producer is kept
//! apart from the queue:
//!
//! * each enqueue's confirmation time is recorded, and the producer's lag (confirmation −
//!   planned time) is reported on its own;
//! * a task's lateness is its fire time − `max(due, confirmed)`: a task confirmed after its
//!   due time could not fire before it was in Redis.
//!
//! Reported per design and rate: the enqueue and fire rates achieved, lateness p50/p99/max,
//! lost, duplicated and early tasks, Redis CPU, client CPU (this process: the producer, the
//! consumers and the harness) and Redis commands (consumer side) per fired task, the
//! producer's lag, and the load average. The knee: the highest rate at which delaywheel's p99
//! stays at or under 5 ms with nothing lost, the producer reaching 95% of the rate. `--svg` draws p99 lateness and Redis CPU per task
//! against the rate.
//!
//! ```text
//! cargo run --release --features redis --example queue_load -- --svg queue_load.svg
//! cargo run --release --features redis --example queue_load -- --rates 30000,40000,50000
//! cargo run --release --features redis --example queue_load -- --backlog 100000  # memory
//! cargo run --release --features redis --example queue_load -- --rates 10000,20000 \
//!     --designs delaywheel --limit-factors 2,0.5      # under a rate limit
//! cargo run --features redis --example queue_load -- --smoke --json       # make test
//! ```

#[path = "support/procfs.rs"]
mod procfs;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use delaywheel::redis::{Consumer, Envelope, Handlers, Producer, QueueConfig, TopicLimit, When};
use futures_util::StreamExt;
use hdrhistogram::Histogram;

#[derive(Parser, Debug, Clone)]
#[command(about = "The shared queue's lateness against the rate, beside a ZSET poller")]
struct Args {
    /// Enqueue rates to step through, tasks per second.
    #[arg(long, value_delimiter = ',', default_values_t = [10_000u64, 20_000, 30_000, 40_000, 50_000, 60_000])]
    rates: Vec<u64>,
    /// Seconds of enqueueing per step.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Delays are uniform in [0, max_delay] seconds.
    #[arg(long, default_value_t = 5.0)]
    max_delay: f64,
    /// Consumer instances per design.
    #[arg(long, default_value_t = 4)]
    consumers: usize,
    /// Designs to run: delaywheel, poller (design note 002: pop 50, sleep 500 ms when idle).
    #[arg(long, value_delimiter = ',', default_values_t = ["delaywheel".to_string(), "poller".to_string()])]
    designs: Vec<String>,
    /// Also run the queue under a fleet-wide rate limit on its topic of this factor × the
    /// step's rate (design `limit×F`): above 1 it does not bind, below 1 it does. The report
    /// gives the fire rate achieved against the limit, and Redis commands per task.
    #[arg(long, value_delimiter = ',')]
    limit_factors: Vec<f64>,
    /// How the producer enqueues: `single` (one `enqueue` per task, 256 in flight) or `batch`
    /// (`enqueue_many` of what is due each moment). Several, comma-separated, run each.
    #[arg(long, value_delimiter = ',', default_values_t = ["single".to_string()])]
    producer: Vec<String>,
    /// The p99 lateness (ms) the knee is judged by.
    #[arg(long, default_value_t = 5.0)]
    knee_p99_ms: f64,
    /// Write the picture (SVG) here.
    #[arg(long)]
    svg: Option<String>,
    /// Instead of the rates: hold this many tasks in one consumer (due in a minute, claimed
    /// ahead) and report Redis memory per task and the consumer's memory per held task.
    #[arg(long)]
    backlog: Option<usize>,
    /// Use this Redis instead of starting a private one.
    #[arg(long)]
    redis: Option<String>,
    /// Two small steps, for tests.
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

/// One step's outcome for one design.
#[derive(Debug, Clone, serde::Serialize)]
struct Step {
    design: String,
    /// The rate limit on the topic (tasks/s), if any.
    limit: Option<u64>,
    producer: String,
    rate: u64,
    tasks: usize,
    enqueue_rate: f64,
    fire_rate: f64,
    /// The most tasks fired in any one-second window.
    fire_peak_1s: usize,
    fired: usize,
    lost: usize,
    duplicates: usize,
    early: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    producer_lag_p99_ms: f64,
    producer_lag_max_ms: f64,
    redis_cpu_us_per_task: f64,
    client_cpu_us_per_task: f64,
    redis_cmds_per_task: f64,
    load_avg_1m: f64,
}

/// Per task: planned enqueue time, due time and confirmation (µs since the epoch), fire count
/// and first fire time. Indexed by the task number in its id (`t{n}`).
struct Tasks {
    planned: Vec<u64>,
    due: Vec<u64>,
    confirmed: Vec<AtomicU64>,
    fires: Vec<AtomicU32>,
    fired_at: Vec<AtomicU64>,
}

impl Tasks {
    fn record_fire(&self, id: &str) {
        let Some(i) = id.strip_prefix('t').and_then(|n| n.parse::<usize>().ok()) else {
            return;
        };
        let now = now_us();
        if self.fires[i].fetch_add(1, Relaxed) == 0 {
            self.fired_at[i].store(now, Relaxed);
        }
    }
}

/// CPU seconds the Redis server has used (user + system).
fn redis_info_cpu(url: &str) -> f64 {
    redis_server::info_sum(url, "cpu", &["used_cpu_sys", "used_cpu_user"])
}

fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Design note 002's poller: pop up to 50 due tasks atomically, sleep 500 ms when none.
const POP: &str = r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for i = 1, #ids do
  redis.call('ZREM', KEYS[1], ids[i])
  redis.call('HGET', KEYS[2], ids[i])
  redis.call('HDEL', KEYS[2], ids[i])
end
return ids
";

fn poller(url: String, ns: String, tasks: Arc<Tasks>, cmds: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
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
            .arg(now_us() / 1_000)
            .arg(50)
            .invoke(&mut conn)
            .expect("pop");
        if popped.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
        for id in &popped {
            tasks.record_fire(id);
        }
    }
}

/// Enqueues every task at its planned time, recording each confirmation: one `enqueue` per
/// task (256 in flight), or with `batch` one `enqueue_many` per millisecond of planned times
/// (see [`produce_windows`]).
async fn produce(producer: &Producer, tasks: &Tasks, batch: bool) {
    if batch {
        return produce_windows(producer, tasks).await;
    }
    let n = tasks.planned.len();
    let mut i = 0;
    while i < n {
        let now = now_us();
        let end = tasks.planned[i..].partition_point(|&p| p <= now) + i;
        if end == i {
            tokio::time::sleep(Duration::from_micros(200)).await;
            continue;
        }
        let results: Vec<_> = futures_util::stream::iter(i..end)
            .map(|k| async move {
                let r = producer
                    .enqueue(
                        format!("t{k}"),
                        "job",
                        serde_json::Value::Null,
                        When::AtMs(tasks.due[k] / 1_000),
                    )
                    .await;
                tasks.confirmed[k].store(now_us(), Relaxed);
                r
            })
            .buffer_unordered(256)
            .collect()
            .await;
        for r in results {
            r.expect("enqueue");
        }
        i = end;
    }
}

/// The batch producer: one `enqueue_many` per millisecond window of planned times, sent once
/// the window has passed (up to 4 windows in flight when behind). The calls, and so Redis's
/// cost per enqueued task, are the same for every design whatever the load: sending "all that
/// is due" made batches grow with the producer's latency, which differs between designs (the
/// poller's lighter runs sent a third the tasks per call, at 1.4x the Redis time per task).
async fn produce_windows(producer: &Producer, tasks: &Tasks) {
    let n = tasks.planned.len();
    // Window k: tasks planned in [start_k, start_k + 1 ms).
    let mut windows: Vec<std::ops::Range<usize>> = Vec::new();
    let mut i = 0;
    while i < n {
        let start = tasks.planned[i] / 1_000 * 1_000;
        let end = tasks.planned[i..].partition_point(|&p| p < start + 1_000) + i;
        windows.push(i..end);
        i = end;
    }
    let send = |range: std::ops::Range<usize>| async move {
        let ready = tasks.planned[range.start] / 1_000 * 1_000 + 1_000;
        let now = now_us();
        if now < ready {
            tokio::time::sleep(Duration::from_micros(ready - now)).await;
        }
        let created = now_us() / 1_000;
        let envelopes = range.clone().map(|k| Envelope {
            id: format!("t{k}"),
            topic: "job".into(),
            payload: serde_json::Value::Null,
            attempt: 0,
            created_at: created,
            headers: Default::default(),
            due_at: tasks.due[k] / 1_000,
        });
        let results = producer.enqueue_many(envelopes, false).await;
        let confirmed = now_us();
        for (k, r) in range.zip(results) {
            r.expect("enqueue");
            tasks.confirmed[k].store(confirmed, Relaxed);
        }
    };
    futures_util::stream::iter(windows)
        .map(send)
        .buffered(4)
        .collect::<Vec<()>>()
        .await;
}

fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e3
}

fn run_step(args: &Args, url: &str, design: &str, producing: &str, rate: u64) -> Step {
    // `limit×F`: the queue, under a rate limit of F × the rate.
    let limit = design
        .strip_prefix("limit×")
        .and_then(|f| f.parse::<f64>().ok())
        .map(|f| ((rate as f64 * f).round() as u64).clamp(1, u64::from(u32::MAX)));
    let queue = design == "delaywheel" || limit.is_some();
    let ns = format!("load_{}_{producing}_{rate}", design.replace('×', "x"));
    redis_server::RedisServer::clear_namespace(url, &ns);
    let n = ((rate as f64) * args.duration).round().max(1.0) as usize;
    let mut rng = fastrand::Rng::with_seed(rate);
    let start = now_us() + 200_000; // the consumers start first
    let max_delay_us = (args.max_delay * 1e6) as u64;
    let planned: Vec<u64> = (0..n)
        .map(|k| start + (k as u64 * 1_000_000) / rate)
        .collect();
    let due: Vec<u64> = planned
        .iter()
        .map(|p| (p + rng.u64(0..=max_delay_us)).div_ceil(1_000) * 1_000)
        .collect();
    let tasks = Arc::new(Tasks {
        planned,
        due,
        confirmed: (0..n).map(|_| AtomicU64::new(0)).collect(),
        fires: (0..n).map(|_| AtomicU32::new(0)).collect(),
        fired_at: (0..n).map(|_| AtomicU64::new(0)).collect(),
    });
    let mut cfg = QueueConfig::new(url, ns.as_str());
    if let Some(l) = limit {
        cfg = cfg.limit(
            "job",
            TopicLimit::new().rate(l as u32, Duration::from_secs(1)),
        );
    }
    // Wake-ups are the queue's; the poller's producer publishes none.
    cfg.notify = queue;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let producer = rt
        .block_on(Producer::connect(cfg.clone()))
        .expect("producer");
    let (cmds, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let (redis_cpu0, client_cpu0) = (redis_info_cpu(url), procfs::process_cpu());
    let mut consumers = Vec::new();
    let mut pollers = Vec::new();
    for _ in 0..args.consumers {
        let tasks = tasks.clone();
        if queue {
            let handlers = Handlers::new().on("job", move |t: &Envelope| {
                tasks.record_fire(&t.id);
                Ok(())
            });
            consumers.push(Consumer::start(cfg.clone(), handlers).expect("consumer"));
        } else {
            let (url, ns, cmds, stop) = (url.to_string(), ns.clone(), cmds.clone(), stop.clone());
            pollers.push(std::thread::spawn(move || {
                poller(url, ns, tasks, cmds, stop)
            }));
        }
    }
    rt.block_on(produce(&producer, &tasks, producing == "batch"));
    let enqueued_by = now_us();
    // Under a limit that binds, the tasks drain at the limit.
    let drain = limit.map_or(0.0, |l| n as f64 / l as f64);
    let deadline = Instant::now() + Duration::from_secs_f64(args.max_delay + drain + 15.0);
    while tasks.fires.iter().any(|f| f.load(Relaxed) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200)); // a duplicate has time to show
    let (redis_cpu, client_cpu) = (
        redis_info_cpu(url) - redis_cpu0,
        (procfs::process_cpu() - client_cpu0).as_secs_f64(),
    );
    let load = load_avg();
    stop.store(true, Relaxed);
    for p in pollers {
        p.join().expect("poller");
    }
    let mut commands = cmds.load(Relaxed);
    for c in consumers {
        commands += c.stats().commands;
        c.shutdown(Duration::from_secs(5)).expect("shutdown");
    }

    let mut lateness = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram");
    let mut lag = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram");
    let (mut fired, mut duplicates, mut early) = (0, 0, 0);
    let (mut first_fire, mut last_fire) = (u64::MAX, 0);
    for k in 0..n {
        let confirmed = tasks.confirmed[k].load(Relaxed);
        lag.saturating_record(confirmed.saturating_sub(tasks.planned[k]).max(1));
        let count = tasks.fires[k].load(Relaxed) as usize;
        if count == 0 {
            continue;
        }
        fired += 1;
        duplicates += count - 1;
        let at = tasks.fired_at[k].load(Relaxed);
        if at < tasks.due[k] {
            early += 1;
        }
        first_fire = first_fire.min(at);
        last_fire = last_fire.max(at);
        lateness.saturating_record(at.saturating_sub(tasks.due[k].max(confirmed)).max(1));
    }
    let fired_span = last_fire.saturating_sub(first_fire).max(1) as f64 / 1e6;
    let mut fire_times: Vec<u64> = (0..n)
        .map(|k| tasks.fired_at[k].load(Relaxed))
        .filter(|&t| t > 0)
        .collect();
    fire_times.sort_unstable();
    let mut fire_peak_1s = 0;
    let mut lo = 0;
    for hi in 0..fire_times.len() {
        while fire_times[hi] - fire_times[lo] >= 1_000_000 {
            lo += 1;
        }
        fire_peak_1s = fire_peak_1s.max(hi - lo + 1);
    }
    let enqueue_span = enqueued_by.saturating_sub(tasks.planned[0]).max(1) as f64 / 1e6;
    Step {
        design: design.to_string(),
        limit,
        producer: producing.to_string(),
        rate,
        tasks: n,
        enqueue_rate: n as f64 / enqueue_span,
        fire_rate: fired as f64 / fired_span,
        fire_peak_1s,
        fired,
        lost: n - fired,
        duplicates,
        early,
        p50_ms: quantile_ms(&lateness, 0.5),
        p99_ms: quantile_ms(&lateness, 0.99),
        max_ms: lateness.max() as f64 / 1e3,
        producer_lag_p99_ms: quantile_ms(&lag, 0.99),
        producer_lag_max_ms: lag.max() as f64 / 1e3,
        redis_cpu_us_per_task: redis_cpu * 1e6 / fired.max(1) as f64,
        client_cpu_us_per_task: client_cpu * 1e6 / fired.max(1) as f64,
        redis_cmds_per_task: commands as f64 / fired.max(1) as f64,
        load_avg_1m: load,
    }
}

/// p99 lateness (log scale) and Redis CPU per task against the rate, one line per design.
fn draw(path: &str, steps: &[Step]) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (960, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(480);
    let max_rate = steps.iter().map(|s| s.rate).max().unwrap_or(1) as f64 * 1.05;
    let max_p99 = steps.iter().map(|s| s.p99_ms).fold(1.0, f64::max) * 2.0;
    let max_cpu = steps
        .iter()
        .map(|s| s.redis_cpu_us_per_task)
        .fold(1.0, f64::max)
        * 1.1;
    let colors = [RED, BLUE, GREEN, MAGENTA];
    let mut p99 = ChartBuilder::on(&left)
        .caption("p99 lateness (ms, log)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..max_rate, (0.1f64..max_p99).log_scale())?;
    p99.configure_mesh().x_desc("tasks/s").draw()?;
    let mut cpu = ChartBuilder::on(&right)
        .caption("Redis CPU per task (µs)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..max_rate, 0f64..max_cpu)?;
    cpu.configure_mesh().x_desc("tasks/s").draw()?;
    let mut series: Vec<(String, String)> = steps
        .iter()
        .map(|s| (s.design.clone(), s.producer.clone()))
        .collect();
    series.dedup();
    series.sort();
    series.dedup();
    for ((design, producing), color) in series.iter().zip(colors.iter().cycle()) {
        let name = format!("{design}, {producing} enqueues");
        let mine: Vec<&Step> = steps
            .iter()
            .filter(|s| &s.design == design && &s.producer == producing)
            .collect();
        let line = |f: fn(&Step) -> f64| -> Vec<(f64, f64)> {
            mine.iter().map(|s| (s.rate as f64, f(s))).collect()
        };
        p99.draw_series(LineSeries::new(line(|s| s.p99_ms.max(0.1)), color))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        p99.draw_series(
            line(|s| s.p99_ms.max(0.1))
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
        cpu.draw_series(LineSeries::new(line(|s| s.redis_cpu_us_per_task), color))?;
        cpu.draw_series(
            line(|s| s.redis_cpu_us_per_task)
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    p99.configure_series_labels().border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

fn redis_used_memory(url: &str) -> u64 {
    redis_server::info_sum(url, "memory", &["used_memory"]) as u64
}

/// A deep backlog: `n` tasks queued (Redis memory per task), then claimed and held by one
/// consumer (its resident memory per held task).
fn backlog(url: &str, n: usize, json: bool) {
    let ns = "load_backlog";
    redis_server::RedisServer::clear_namespace(url, ns);
    let mut cfg = QueueConfig::new(url, ns);
    cfg.lookahead = Duration::from_secs(120);
    cfg.max_held = n;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let producer = rt
        .block_on(Producer::connect(cfg.clone()))
        .expect("producer");
    let due = now_us() / 1_000 + 60_000;
    let before = redis_used_memory(url);
    let envelopes = (0..n).map(|k| Envelope {
        id: format!("t{k}"),
        topic: "job".into(),
        payload: serde_json::json!({ "order_id": k }),
        attempt: 0,
        created_at: due - 60_000,
        headers: Default::default(),
        due_at: due,
    });
    for r in rt.block_on(producer.enqueue_many(envelopes, false)) {
        r.expect("enqueue");
    }
    let queued = redis_used_memory(url);
    let rss_before = procfs::rss_bytes();
    let c = Consumer::start(cfg, Handlers::new().on("job", |_| Ok(()))).expect("consumer");
    let deadline = Instant::now() + Duration::from_secs(50);
    while c.held() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = c.held();
    let (leased, rss_after) = (redis_used_memory(url), procfs::rss_bytes());
    let redis_queued = queued.saturating_sub(before) as f64 / n as f64;
    let redis_leased = leased.saturating_sub(before) as f64 / n as f64;
    let consumer = rss_after.saturating_sub(rss_before) as f64 / held.max(1) as f64;
    println!("backlog of {n} tasks (payload {{\"order_id\": k}}), {held} held by one consumer:");
    println!("  Redis memory per queued task  {redis_queued:>8.0} B");
    println!("  Redis memory per leased task  {redis_leased:>8.0} B");
    println!("  consumer memory per held task {consumer:>8.0} B (resident set growth)");
    if json {
        println!(
            "{}",
            serde_json::json!({
                "tasks": n,
                "held": held,
                "redis_bytes_per_queued_task": redis_queued,
                "redis_bytes_per_leased_task": redis_leased,
                "consumer_bytes_per_held_task": consumer,
            })
        );
    }
    c.abort();
    if held < n {
        std::process::exit(1);
    }
}

fn main() {
    let mut args = Args::parse();
    if let Some(n) = args.backlog {
        let n = if args.smoke { n.min(2_000) } else { n };
        let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
        backlog(&url, n, args.json);
        return;
    }
    if args.smoke {
        (args.rates, args.duration, args.max_delay, args.consumers) =
            (vec![2_000, 4_000], 1.0, 0.5, 2);
    }
    let (_server, url) = redis_server::RedisServer::given_or_private(args.redis.clone());
    let mut steps = Vec::new();
    for (i, &rate) in args.rates.iter().enumerate() {
        // Alternate the order of the designs, so that neither always runs in a warmer state.
        let mut order = args.designs.clone();
        if i % 2 == 1 {
            order.reverse();
        }
        let limited: Vec<String> = args
            .limit_factors
            .iter()
            .map(|f| format!("limit×{f}"))
            .collect();
        for design in order.iter().chain(&limited) {
            for producing in &args.producer {
                let step = run_step(&args, &url, design, producing, rate);
                eprintln!(
                    "{design:>10} {producing:>6} {rate:>7}/s: p99 {:.2} ms, lost {}, dups {}",
                    step.p99_ms, step.lost, step.duplicates
                );
                steps.push(step);
            }
        }
    }
    steps.sort_by(|a, b| (a.rate, &a.design, &a.producer).cmp(&(b.rate, &b.design, &b.producer)));
    println!(
        "{} consumers; {} s of enqueueing per step; delays 0..{} s; lateness from max(due, enqueued)",
        args.consumers, args.duration, args.max_delay
    );
    println!(
        "{:<17} {:>7} {:>9} {:>9} {:>5} {:>5} {:>8} {:>8} {:>9} {:>10} {:>11} {:>11} {:>9} {:>5}",
        "design/producer",
        "rate",
        "enq/s",
        "fire/s",
        "lost",
        "dups",
        "p50 ms",
        "p99 ms",
        "max ms",
        "lag p99 ms",
        "redis µs/t",
        "client µs/t",
        "cmds/t",
        "load"
    );
    for s in &steps {
        println!(
            "{:<17} {:>7} {:>9.0} {:>9.0} {:>5} {:>5} {:>8.2} {:>8.2} {:>9.2} {:>10.2} {:>11.1} {:>11.1} {:>9.4} {:>5.2}",
            format!("{}/{}", s.design, s.producer), s.rate, s.enqueue_rate, s.fire_rate, s.lost, s.duplicates, s.p50_ms,
            s.p99_ms, s.max_ms, s.producer_lag_p99_ms, s.redis_cpu_us_per_task,
            s.client_cpu_us_per_task, s.redis_cmds_per_task, s.load_avg_1m
        );
    }
    // The knee, per producer mode: the highest rate below which every step held. A step holds
    // when p99 stays within the bound, nothing is lost or duplicated, and the producer did
    // reach the rate (95% of it): a rate the producer cannot enqueue is not one the queue ran.
    let mut knees = serde_json::Map::new();
    for producing in &args.producer {
        let knee = steps
            .iter()
            .filter(|s| s.design == "delaywheel" && &s.producer == producing)
            .take_while(|s| {
                s.p99_ms <= args.knee_p99_ms
                    && s.lost == 0
                    && s.duplicates == 0
                    && s.enqueue_rate >= 0.95 * s.rate as f64
            })
            .map(|s| s.rate)
            .last();
        match knee {
            Some(k) => println!(
                "knee ({producing} enqueues): {k} tasks/s (p99 ≤ {} ms, nothing lost, ≥ 95% enqueued)",
                args.knee_p99_ms
            ),
            None => println!("knee ({producing} enqueues): below the lowest rate tried"),
        }
        knees.insert(producing.clone(), serde_json::json!(knee));
    }
    if let Some(path) = &args.svg {
        match draw(path, &steps) {
            Ok(()) => println!("picture: {path}"),
            Err(e) => {
                eprintln!("could not draw {path}: {e}");
                std::process::exit(1);
            }
        }
    }
    if args.json {
        println!("{}", serde_json::json!({ "steps": steps, "knee": knees }));
    }
    if !args.limit_factors.is_empty() {
        println!(
            "under a rate limit (fire/s: the mean over the run; peak: the most in one second; \
             cmds/t includes the limiter's calls):"
        );
        println!(
            "{:<17} {:>7} {:>9} {:>9} {:>9} {:>10} {:>9} {:>11}",
            "design", "rate", "limit", "fire/s", "peak 1 s", "peak/limit", "cmds/t", "redis µs/t"
        );
        for s in steps
            .iter()
            .filter(|s| s.design == "delaywheel" || s.limit.is_some())
        {
            let limit = s.limit.map_or("-".to_string(), |l| l.to_string());
            let ratio = s.limit.map_or("-".to_string(), |l| {
                format!("{:.3}", s.fire_peak_1s as f64 / l as f64)
            });
            println!(
                "{:<17} {:>7} {:>9} {:>9.0} {:>9} {:>10} {:>9.4} {:>11.1}",
                s.design,
                s.rate,
                limit,
                s.fire_rate,
                s.fire_peak_1s,
                ratio,
                s.redis_cmds_per_task,
                s.redis_cpu_us_per_task
            );
        }
    }
    if steps.iter().any(|s| {
        (s.design == "delaywheel" || s.limit.is_some())
            && (s.lost > 0 || s.duplicates > 0 || s.early > 0)
    }) {
        std::process::exit(1);
    }
}
