//! Loads N timers into a bare `Wheel` and reports insert, cancel and expire rates and the
//! resident memory per pending timer.
//!
//! ```text
//! cargo run --release --example wheel_load                      # 1M and 10M timers
//! cargo run --release --example wheel_load -- --timers 2000000  # one size
//! cargo run --example wheel_load -- --smoke --json              # seconds-long check (make test)
//! ```
//!
//! Deadlines are uniform in [1, 60 000] ticks; half the timers are cancelled in random order,
//! then time advances tick by tick until every remaining timer has fired. Resident memory is the
//! growth of the process's VmRSS while inserting (the wheel starts empty and grows as a real one
//! does), divided by the number of timers. Each size runs in a process of its own, so that one
//! run's freed memory, which the allocator may keep, cannot hide the next run's growth.

use std::time::Instant;

use clap::Parser;
use delaywheel::wheel::{TimerKey, Wheel};

#[path = "support/procfs.rs"]
mod procfs;
use procfs::rss_bytes;

/// A count of at least 1 (a run of none has no figures per timer).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Parser, Debug)]
#[command(about = "Load timers into a delaywheel Wheel and report rates and memory")]
struct Args {
    /// Numbers of timers to load, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000_000usize, 10_000_000],
          value_parser = at_least_one)]
    timers: Vec<usize>,
    /// Deadlines are uniform in [1, horizon] ticks (at least 1).
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    horizon: u64,
    /// A quick run (20k timers, 5k-tick horizon) for tests.
    #[arg(long)]
    smoke: bool,
    /// Fail (exit 1) when a run uses more than this many resident bytes per timer.
    #[arg(long, default_value_t = 40.0)]
    max_bytes_per_timer: f64,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
    /// Run the one size given and print its figures as JSON only (how each size gets a
    /// process of its own).
    #[arg(long, hide = true)]
    one: bool,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Run {
    timers: usize,
    insert_ns: f64,
    cancel_ns: f64,
    expire_ns: f64,
    rss_bytes_per_timer: f64,
    allocated_bytes_per_timer: f64,
    lost: usize,
    duplicates: usize,
}

fn run(n: usize, horizon: u64) -> Run {
    let mut rng = fastrand::Rng::with_seed(42);
    let deadlines: Vec<u64> = (0..n).map(|_| rng.u64(1..=horizon)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    // The harness's own key list is written before the first RSS reading, so that its pages
    // are not counted as the wheel's.
    let mut keys = vec![TimerKey::from_bits(0); n];

    let mut wheel: Wheel<u64> = Wheel::new();
    let rss_before = rss_bytes();
    let t = Instant::now();
    for (i, &d) in deadlines.iter().enumerate() {
        keys[i] = wheel.insert(d, i as u64);
    }
    let insert = t.elapsed();
    let rss = rss_bytes().saturating_sub(rss_before);
    let allocated = wheel.allocated_bytes();

    // Which timers have ended (cancelled or fired), by value: a second end is a duplicate.
    let mut ended = vec![false; n];
    let mut duplicates = 0;
    let t = Instant::now();
    for &i in &order[..n / 2] {
        if let Some(v) = wheel.cancel(keys[i]) {
            duplicates += usize::from(std::mem::replace(&mut ended[v as usize], true));
        }
    }
    let cancel = t.elapsed();

    let t = Instant::now();
    let mut fired = 0;
    let mut late = 0;
    for now in 1..=horizon {
        while let Some(e) = wheel.poll(now) {
            late += usize::from(e.deadline != now);
            fired += 1;
            duplicates += usize::from(std::mem::replace(&mut ended[e.value as usize], true));
        }
    }
    let expire = t.elapsed();
    assert_eq!(late, 0, "timers fired at the wrong tick");
    Run {
        timers: n,
        insert_ns: insert.as_nanos() as f64 / n as f64,
        cancel_ns: cancel.as_nanos() as f64 / (n / 2).max(1) as f64,
        expire_ns: expire.as_nanos() as f64 / fired.max(1) as f64,
        rss_bytes_per_timer: rss as f64 / n as f64,
        allocated_bytes_per_timer: allocated as f64 / n as f64,
        lost: ended.iter().filter(|&&e| !e).count(),
        duplicates,
    }
}

/// Runs one size in a child process (this binary with `--one`) and reads its figures.
fn run_in_child(n: usize, horizon: u64) -> Run {
    let out = std::process::Command::new(std::env::current_exe().expect("own path"))
        .args([
            "--one",
            "--timers",
            &n.to_string(),
            "--horizon",
            &horizon.to_string(),
        ])
        .output()
        .expect("run a child");
    assert!(
        out.status.success(),
        "the run of {n} timers failed: {out:?}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or_default()).expect("the child's figures")
}

fn main() {
    let args = Args::parse();
    if args.one {
        let r = run(args.timers[0], args.horizon);
        println!("{}", serde_json::to_string(&r).expect("figures"));
        return;
    }
    let (sizes, horizon) = if args.smoke {
        (vec![20_000], 5_000)
    } else {
        (args.timers.clone(), args.horizon)
    };
    println!("| timers | insert ns/op | cancel ns/op | expire ns/fired | resident B/timer | allocated B/timer | lost | duplicates |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut runs = Vec::new();
    for n in sizes {
        let r = run_in_child(n, horizon);
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            r.timers,
            r.insert_ns,
            r.cancel_ns,
            r.expire_ns,
            r.rss_bytes_per_timer,
            r.allocated_bytes_per_timer,
            r.lost,
            r.duplicates
        );
        runs.push(r);
    }
    if args.json {
        println!("{}", serde_json::json!({ "runs": runs }));
    }
    let failed = runs.iter().any(|r| {
        r.lost != 0
            || r.duplicates != 0
            || (!args.smoke && r.rss_bytes_per_timer > args.max_bytes_per_timer)
    });
    if failed {
        eprintln!("FAILED: a timer was lost or ended twice, or the memory target was missed");
        std::process::exit(1);
    }
}
