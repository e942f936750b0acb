//! A load generator shaped like a gateway, on the in-memory engine.
//!
//! Producer threads open requests at a steady rate, each with a request timeout; most requests
//! complete within a few milliseconds and cancel their timeout, the rest expire. Each producer
//! also keeps connections whose idle timeouts are reset on every request. A consumer thread
//! receives the expirations and measures how late the request timeouts arrive (receive time
//! minus the deadline the producer asked for). Then a second phase loads
//! `--idle-timers` timers an hour away and measures resident memory per timer and the CPU the
//! process uses while they wait.
//!
//! ```text
//! cargo run --release --example gateway                 # defaults: ~20 s
//! cargo run --release --example gateway -- --json       # figures as JSON on the last line
//! cargo run --example gateway -- --smoke                # seconds (make test)
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::{Expiration, Timer, TimerId};
use hdrhistogram::Histogram;

#[path = "support/procfs.rs"]
mod procfs;
use indicatif::{ProgressBar, ProgressStyle};
use procfs::{process_cpu, rss_bytes};

#[derive(Parser, Debug)]
#[command(about = "Gateway-shaped load on the delaywheel engine")]
struct Args {
    /// Request timers to schedule in all (the run also stops after --duration).
    #[arg(long, default_value_t = 2_000_000)]
    timers: u64,
    /// Requests per second, over all producer threads.
    #[arg(long, default_value_t = 200_000)]
    rate: u64,
    /// Share of requests that complete (and cancel their timeout) in time.
    #[arg(long, default_value_t = 0.95)]
    cancel_ratio: f64,
    /// Producer threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds of load (1 to a day).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration: u64,
    /// Request timeout, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    request_timeout_ms: u64,
    /// Idle timeout of a connection, in milliseconds.
    #[arg(long, default_value_t = 3_000)]
    idle_timeout_ms: u64,
    /// Connections per producer thread.
    #[arg(long, default_value_t = 1_000)]
    connections: usize,
    /// Timers loaded an hour ahead for the memory and idle-CPU phase.
    #[arg(long, default_value_t = 1_000_000)]
    idle_timers: usize,
    /// Seconds over which idle CPU is measured.
    #[arg(long, default_value_t = 5)]
    idle_window: u64,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
    /// A run of a few seconds (for tests).
    #[arg(long)]
    smoke: bool,
}

/// What a timer stands for, with a number unique to it (so the consumer can tell a duplicate).
/// A request carries the deadline it asked for, which the consumer measures lateness against;
/// an idle timer is reset many times, so it carries no deadline.
#[derive(Debug)]
enum Event {
    Request { seq: u64, due: Instant },
    Idle { seq: u64 },
}

impl Event {
    fn seq(&self) -> u64 {
        match self {
            Event::Request { seq, .. } | Event::Idle { seq } => *seq,
        }
    }
}

#[derive(Default)]
struct Counters {
    scheduled: AtomicU64,
    cancelled: AtomicU64,
    reset: AtomicU64,
}

fn producer(timer: Timer<Event>, args: Arc<Args>, counters: Arc<Counters>, quota: u64, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let per_thread_rate = (args.rate / args.threads.max(1) as u64).max(1);
    let request_timeout = Duration::from_millis(args.request_timeout_ms);
    let idle_timeout = Duration::from_millis(args.idle_timeout_ms);
    let start = Instant::now();
    let end = start + Duration::from_secs(args.duration);
    // Connections and their idle timers.
    let mut conns: Vec<Option<TimerId>> = vec![None; args.connections.max(1)];
    // Requests that will complete: (completion time, timer).
    let mut inflight: VecDeque<(Instant, TimerId)> = VecDeque::new();
    let mut sent = 0u64;
    // Unique across producers: the thread's seed in the high bits.
    let mut seq = seed << 40;
    let mut next_seq = move || {
        seq += 1;
        seq
    };
    while sent < quota {
        let now = Instant::now();
        if now >= end {
            break;
        }
        // Pace: by now we should have sent this many.
        let target = ((now - start).as_secs_f64() * per_thread_rate as f64) as u64;
        if sent >= target {
            std::thread::sleep(Duration::from_micros(200));
        }
        let batch = target.saturating_sub(sent).min(quota - sent).min(1_000);
        for _ in 0..batch {
            // The deadline of this request, from its own clock read (not the batch's `now`,
            // which a preemption mid-batch would leave behind).
            let due = Instant::now() + request_timeout;
            let seq = next_seq();
            let id = timer
                .schedule_at(Event::Request { seq, due }, due)
                .expect("engine running");
            counters.scheduled.fetch_add(1, Relaxed);
            sent += 1;
            if rng.f64() < args.cancel_ratio {
                let done = now + Duration::from_micros(rng.u64(100..5_000));
                inflight.push_back((done, id));
            }
            // Activity on a connection pushes its idle timeout back.
            let conn = rng.usize(0..conns.len());
            let reset = conns[conn].is_some_and(|id| timer.reset(id, idle_timeout));
            if reset {
                counters.reset.fetch_add(1, Relaxed);
            } else {
                conns[conn] = Some(
                    timer
                        .schedule(Event::Idle { seq: next_seq() }, idle_timeout)
                        .expect("engine running"),
                );
                counters.scheduled.fetch_add(1, Relaxed);
            }
        }
        // Requests that completed by now cancel their timeout (completion times are within
        // 5 ms, so the front is roughly the earliest).
        while inflight.front().is_some_and(|&(done, _)| done <= now) {
            if let Some((_, id)) = inflight.pop_front() {
                if timer.cancel(id).is_some() {
                    counters.cancelled.fetch_add(1, Relaxed);
                }
            }
        }
    }
    for (_, id) in inflight {
        if timer.cancel(id).is_some() {
            counters.cancelled.fetch_add(1, Relaxed);
        }
    }
}

struct Report {
    scheduled: u64,
    cancelled: u64,
    reset: u64,
    fired: u64,
    duplicates: u64,
    /// Delivered before their deadline: a request before the one it asked for, or any timer
    /// before the (rounded) deadline the engine reports for it, resets included.
    early: u64,
    handed_back: u64,
    lost: i64,
    throughput: f64,
    /// `None` when no request timer fired (nothing to measure: not a perfect 0).
    lateness: Option<(f64, f64, f64)>,
    /// `None` with no idle timers, or where the resident size cannot be read (not Linux).
    bytes_per_timer: Option<f64>,
    /// `None` where the process's CPU time cannot be read (not Linux).
    idle_cpu_pct: Option<f64>,
}

fn main() {
    let mut args = Args::parse();
    if args.smoke {
        args.timers = args.timers.min(20_000);
        args.rate = args.rate.min(20_000);
        args.duration = 1;
        args.request_timeout_ms = args.request_timeout_ms.min(200);
        args.idle_timeout_ms = args.idle_timeout_ms.min(300);
        args.connections = args.connections.min(100);
        args.idle_timers = args.idle_timers.min(50_000);
        args.idle_window = 1;
    }
    let args = Arc::new(args);
    let (timer, rx) = Timer::<Event>::builder()
        .build_channel(Some(65_536))
        .expect("engine");
    let counters = Arc::new(Counters::default());

    let fired = Arc::new(AtomicU64::new(0));
    let consumer = {
        let fired = fired.clone();
        let timers = args.timers;
        std::thread::spawn(move || {
            let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("bounds");
            // Sized up front: a rehash of a large set on this thread would show up as
            // lateness.
            let mut seen = std::collections::HashSet::with_capacity(
                usize::try_from(timers).unwrap_or(usize::MAX).min(1 << 24),
            );
            let (mut duplicates, mut early) = (0u64, 0u64);
            for Expiration {
                value, deadline, ..
            } in rx
            {
                let now = Instant::now();
                // Counted, not clamped to 0: an early fire must fail the run, not improve it.
                let requested = match value {
                    Event::Request { due, .. } => Some(due),
                    Event::Idle { .. } => None,
                };
                if now < deadline || requested.is_some_and(|due| now < due) {
                    early += 1;
                } else if let Some(due) = requested {
                    h.saturating_record(now.duration_since(due).as_micros().max(1) as u64);
                }
                if seen.insert(value.seq()) {
                    fired.fetch_add(1, Relaxed);
                } else {
                    duplicates += 1;
                }
            }
            (h, duplicates, early)
        })
    };

    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.duration)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} load {pos}/{len} s  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let quota = args.timers / args.threads.max(1) as u64;
    let producers: Vec<_> = (0..args.threads.max(1))
        .map(|t| {
            let (timer, args, counters) = (timer.clone(), args.clone(), counters.clone());
            std::thread::spawn(move || producer(timer, args, counters, quota, t as u64))
        })
        .collect();
    while producers.iter().any(|p| !p.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        bar.set_position(start.elapsed().as_secs().min(args.duration));
        bar.set_message(format!(
            "scheduled {} cancelled {} fired {} pending {}",
            counters.scheduled.load(Relaxed),
            counters.cancelled.load(Relaxed),
            fired.load(Relaxed),
            timer.len()
        ));
    }
    for p in producers {
        p.join().expect("producer");
    }
    let load_time = start.elapsed();
    // Let every remaining timer (at most an idle timeout away) fire.
    let drain_until = Instant::now()
        + Duration::from_millis(args.request_timeout_ms.max(args.idle_timeout_ms))
        + Duration::from_secs(1);
    while !timer.is_empty() && Instant::now() < drain_until {
        std::thread::sleep(Duration::from_millis(50));
    }
    bar.finish_and_clear();

    // Phase 2: memory per pending timer, and CPU while they wait an hour.
    let (mem_timer, _mem_rx) = Timer::<u64>::builder().build_channel(None).expect("engine");
    let rss_before = rss_bytes();
    for i in 0..args.idle_timers as u64 {
        mem_timer
            .schedule(i, Duration::from_secs(3600 + i % 600))
            .expect("engine running");
    }
    let rss_after = rss_bytes();
    let bytes_per_timer = (args.idle_timers > 0 && rss_after > 0)
        .then(|| rss_after.saturating_sub(rss_before) as f64 / args.idle_timers as f64);
    std::thread::sleep(Duration::from_millis(200));
    let cpu_before = process_cpu();
    // At least a moment: a zero window would make the share 0/0.
    let window = Duration::from_secs(args.idle_window).max(Duration::from_millis(100));
    std::thread::sleep(window);
    let idle_cpu_pct =
        100.0 * process_cpu().saturating_sub(cpu_before).as_secs_f64() / window.as_secs_f64();
    drop(mem_timer.shutdown());

    // Everything was due before the idle window began: a timer still pending is one the
    // driver failed to fire, so it counts as lost.
    let handed_back = timer.shutdown().len() as u64;
    let (histogram, duplicates, early) = consumer.join().expect("consumer");
    // Read once the consumer has seen everything the engine handed over.
    let stats = timer.stats();
    let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    let scheduled = counters.scheduled.load(Relaxed);
    let cancelled = counters.cancelled.load(Relaxed);
    let fired = fired.load(Relaxed);
    let report = Report {
        scheduled,
        cancelled,
        reset: counters.reset.load(Relaxed),
        fired,
        duplicates,
        early,
        handed_back,
        lost: scheduled as i64 - (cancelled + fired) as i64,
        throughput: scheduled as f64 / load_time.as_secs_f64(),
        lateness: (!histogram.is_empty())
            .then(|| (ms(0.5), ms(0.99), histogram.max() as f64 / 1000.0)),
        bytes_per_timer,
        idle_cpu_pct: cfg!(target_os = "linux").then_some(idle_cpu_pct),
    };
    // Every timer the engine fired was received, or is counted as not handed over.
    let agree = stats.fired == fired + duplicates + stats.undelivered;
    print_report(&report, args.json);
    if report.lost != 0 || report.duplicates != 0 || report.early != 0 || !agree {
        eprintln!(
            "FAILED: {} timers lost ({} handed back at shutdown, past their deadlines), {} delivered twice, \
             {} early; the engine fired {} ({} not handed over), the consumer received {}",
            report.lost,
            report.handed_back,
            report.duplicates,
            report.early,
            stats.fired,
            stats.undelivered,
            fired + duplicates
        );
        std::process::exit(1);
    }
}

fn print_report(r: &Report, json: bool) {
    println!("| figure | value |");
    println!("|---|---:|");
    println!("| scheduled | {} |", r.scheduled);
    println!("| cancelled | {} |", r.cancelled);
    println!("| reset | {} |", r.reset);
    println!("| fired | {} |", r.fired);
    println!("| delivered twice | {} |", r.duplicates);
    println!("| delivered early | {} |", r.early);
    println!(
        "| handed back at shutdown (past their deadlines: lost) | {} |",
        r.handed_back
    );
    println!("| lost | {} |", r.lost);
    println!("| throughput (schedules/s) | {:.0} |", r.throughput);
    println!(
        "| request timeout lateness p50 / p99 / max (ms) | {} |",
        r.lateness
            .map_or("n/a (none fired)".to_string(), |(p50, p99, max)| format!(
                "{p50:.3} / {p99:.3} / {max:.3}"
            ))
    );
    println!(
        "| resident bytes per pending timer | {} |",
        r.bytes_per_timer
            .map_or("n/a".to_string(), |b| format!("{b:.1}"))
    );
    println!(
        "| CPU while idle (% of one core) | {} |",
        r.idle_cpu_pct
            .map_or("n/a".to_string(), |c| format!("{c:.4}"))
    );
    if json {
        let v = serde_json::json!({
            "scheduled": r.scheduled,
            "cancelled": r.cancelled,
            "reset": r.reset,
            "fired": r.fired,
            "duplicates": r.duplicates,
            "early": r.early,
            "handed_back": r.handed_back,
            "lost": r.lost,
            "throughput_per_s": r.throughput,
            "lateness_p50_ms": r.lateness.map(|l| l.0),
            "lateness_p99_ms": r.lateness.map(|l| l.1),
            "lateness_max_ms": r.lateness.map(|l| l.2),
            "bytes_per_timer": r.bytes_per_timer,
            "idle_cpu_pct": r.idle_cpu_pct,
        });
        println!("{v}");
    }
}
