//! The cost of a timeout, side by side in one run, on a multi-thread tokio runtime with 2
//! workers. Contenders in every group: no timeout at all (`none`, the baseline), this crate's
//! `Sleeper::timeout` on a leaked sleeper (`delaywheel`) and on an owned one
//! (`delaywheel_owned`: two reference counts per timeout), `tokio::time::timeout` (`tokio`),
//! `pingora_timeout::tokio_timeout` (`pingora_tokio`: tokio's timer, registered lazily) and
//! `pingora_timeout::fast_timeout::fast_timeout` (`pingora_fast`: one shared timer per 10 ms
//! of deadline; `pingora_timeout::timeout` is the same function). A timer's overhead is its time minus `none`'s.
//!
//! * `timeout_ready`: a timeout around a future ready at its first poll; each worker runs the
//!   loop, and the time is per timeout on one worker while the other does the same.
//! * `timeout_pending_once`: a timeout around a oneshot answered by another task, so it is
//!   pending once, then ready. Two pairs of tasks (asker and answerer), one per worker.
//! * `timeout_100k_tasks`: 100 000 tasks, each looping on `timeout_pending_once`'s call,
//!   answered by 2 answerer tasks; the time is wall time per call, all tasks together.
//!
//! The timeout is 1 s in every case, and never fires. Then a report of what each gives up in
//! precision: how late 50 ms timeouts fire. `cargo bench --features futures --bench
//! timeout`; under `cargo test --benches` each runs once, small.

use std::future::Future;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use delaywheel::sleep::Sleeper;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot, Notify};

const LIMIT: Duration = Duration::from_secs(1);

/// The contenders: each wraps `future` in its timeout, or in none.
#[derive(Clone, Copy, Debug)]
enum Contender {
    None,
    Delaywheel,
    DelaywheelOwned,
    Tokio,
    Pingora,
    PingoraFast,
}

const CONTENDERS: [Contender; 6] = [
    Contender::None,
    Contender::Delaywheel,
    Contender::DelaywheelOwned,
    Contender::Tokio,
    Contender::Pingora,
    Contender::PingoraFast,
];

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::None => "none",
            Contender::Delaywheel => "delaywheel",
            Contender::DelaywheelOwned => "delaywheel_owned",
            Contender::Tokio => "tokio",
            Contender::Pingora => "pingora_tokio",
            Contender::PingoraFast => "pingora_fast",
        }
    }
}

/// The two sleepers: leaked (a plain reference per timeout) and owned.
#[derive(Clone)]
struct Engines {
    leaked: Sleeper,
    owned: Sleeper,
}

/// `future` under `who`'s timeout; `true` if it finished in time.
async fn run<F: Future>(who: Contender, engines: &Engines, future: F) -> bool {
    run_for(who, engines, LIMIT, future).await
}

/// `future` under `who`'s timeout of `limit`; `true` if it finished in time.
async fn run_for<F: Future>(who: Contender, engines: &Engines, limit: Duration, future: F) -> bool {
    match who {
        Contender::None => {
            future.await;
            true
        }
        Contender::Delaywheel => engines.leaked.timeout(limit, future).await.is_ok(),
        Contender::DelaywheelOwned => engines.owned.timeout(limit, future).await.is_ok(),
        Contender::Tokio => tokio::time::timeout(limit, future).await.is_ok(),
        Contender::Pingora => pingora_timeout::tokio_timeout(limit, future).await.is_ok(),
        Contender::PingoraFast => pingora_timeout::fast_timeout::fast_timeout(limit, future)
            .await
            .is_ok(),
    }
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `per_worker(iters)` on each of the 2 workers at once; the wall time of the slower.
fn on_both_workers<F, Fut>(rt: &Runtime, iters: u64, per_worker: F) -> Duration
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    rt.block_on(async {
        let go = Arc::new(Notify::new());
        let ready = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let (go, ready, work) = (go.clone(), ready.clone(), per_worker(iters));
                tokio::spawn(async move {
                    let notified = go.notified();
                    ready.fetch_add(1, SeqCst);
                    notified.await;
                    let start = Instant::now();
                    work.await;
                    start.elapsed()
                })
            })
            .collect();
        while ready.load(SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        go.notify_waiters();
        let mut slowest = Duration::ZERO;
        for t in tasks {
            slowest = slowest.max(t.await.unwrap());
        }
        slowest
    })
}

fn bench_ready(c: &mut Criterion, rt: &Runtime, engines: &Engines) {
    let mut group = c.benchmark_group("timeout_ready");
    group.throughput(Throughput::Elements(1));
    for who in CONTENDERS {
        group.bench_function(who.name(), |b| {
            b.iter_custom(|iters| {
                on_both_workers(rt, iters, |n| {
                    let engines = engines.clone();
                    async move {
                        for i in 0..n {
                            let done = run(who, &engines, std::future::ready(black_box(i))).await;
                            assert!(done);
                        }
                    }
                })
            })
        });
    }
    group.finish();
}

/// Answers every oneshot that comes in on `rx`.
async fn answerer(mut rx: mpsc::UnboundedReceiver<oneshot::Sender<()>>) {
    while let Some(tx) = rx.recv().await {
        let _ = tx.send(());
    }
}

/// One call of (b): hand a oneshot to an answerer, then wait for the answer under a timeout.
async fn ask(who: Contender, engines: &Engines, to: &mpsc::UnboundedSender<oneshot::Sender<()>>) {
    let (tx, rx) = oneshot::channel();
    to.send(tx).unwrap();
    let done = run(who, engines, rx).await;
    assert!(done);
}

fn bench_pending_once(c: &mut Criterion, rt: &Runtime, engines: &Engines) {
    let mut group = c.benchmark_group("timeout_pending_once");
    group.throughput(Throughput::Elements(1));
    for who in CONTENDERS {
        group.bench_function(who.name(), |b| {
            b.iter_custom(|iters| {
                on_both_workers(rt, iters, |n| {
                    let engines = engines.clone();
                    let (to, from) = mpsc::unbounded_channel();
                    tokio::spawn(answerer(from));
                    async move {
                        for _ in 0..n {
                            ask(who, &engines, &to).await;
                        }
                    }
                })
            })
        });
    }
    group.finish();
}

fn bench_many_tasks(c: &mut Criterion, rt: &Runtime, engines: &Engines, tasks: usize) {
    let mut group = c.benchmark_group("timeout_100k_tasks");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    for who in CONTENDERS {
        group.bench_with_input(BenchmarkId::new(who.name(), tasks), &tasks, |b, &tasks| {
            b.iter_custom(|iters| {
                // Each task makes `rounds` calls; the time is scaled to `iters` calls.
                let rounds = iters.div_ceil(tasks as u64).max(1);
                let wall = rt.block_on(async {
                    let answerers: Vec<_> = (0..2)
                        .map(|_| {
                            let (to, from) = mpsc::unbounded_channel();
                            tokio::spawn(answerer(from));
                            to
                        })
                        .collect();
                    let go = Arc::new(Notify::new());
                    let ready = Arc::new(AtomicUsize::new(0));
                    let handles: Vec<_> = (0..tasks)
                        .map(|i| {
                            let to = answerers[i % 2].clone();
                            let (go, ready, engines) = (go.clone(), ready.clone(), engines.clone());
                            tokio::spawn(async move {
                                let notified = go.notified();
                                ready.fetch_add(1, SeqCst);
                                notified.await;
                                for _ in 0..rounds {
                                    ask(who, &engines, &to).await;
                                }
                            })
                        })
                        .collect();
                    while ready.load(SeqCst) < tasks {
                        tokio::task::yield_now().await;
                    }
                    let start = Instant::now();
                    go.notify_waiters();
                    for h in handles {
                        h.await.unwrap();
                    }
                    start.elapsed()
                });
                wall.mul_f64(iters as f64 / (rounds * tasks as u64) as f64)
            })
        });
    }
    group.finish();
}

/// What each timer gives up in precision: `n` timeouts of 50 ms around futures that never
/// finish, started 0.1 ms apart, and how late each fired (elapsed − 50 ms), as p50/p99/max.
fn report_precision(rt: &Runtime, engines: &Engines, n: usize) {
    let limit = Duration::from_millis(50);
    println!("\nprecision: {n} timeouts of 50 ms each, lateness p50 / p99 / max in ms");
    for who in CONTENDERS.into_iter().skip(1) {
        let mut late: Vec<Duration> = rt.block_on(async {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let engines = engines.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_micros(100 * i as u64)).await;
                        let start = Instant::now();
                        let done =
                            run_for(who, &engines, limit, std::future::pending::<()>()).await;
                        assert!(!done);
                        start.elapsed().saturating_sub(limit)
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(n);
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        late.sort();
        let at = |q: f64| late[((late.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
        println!(
            "  {:<17} {:>6.2} {:>6.2} {:>6.2}",
            who.name(),
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let rt = runtime();
    // Both sleepers' engines are built inside the runtime's context, as a service's would be.
    let engines = rt.block_on(async {
        Engines {
            leaked: Sleeper::new().unwrap().leak(),
            owned: Sleeper::new().unwrap(),
        }
    });
    // pingora's fast timer: never hand a 1 s timeout over to tokio.
    pingora_timeout::fast_timeout::set_fast_timeout_to_tokio_threshold(None);
    bench_ready(&mut c, &rt, &engines);
    bench_pending_once(&mut c, &rt, &engines);
    // Under `cargo test --benches`, a small crowd: the smoke run checks the code, not the cost.
    let smoke = !std::env::args().any(|a| a == "--bench");
    bench_many_tasks(&mut c, &rt, &engines, if smoke { 1_000 } else { 100_000 });
    c.final_summary();
    report_precision(&rt, &engines, if smoke { 100 } else { 2_000 });
}
