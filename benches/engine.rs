//! The engine against its baselines (issue #3), all in one run.
//!
//! Criterion groups:
//! * `schedule_cancel` — one thread, a 30 s timer scheduled and cancelled through the shared
//!   handle (`delaywheel`), against tokio's own timer: `tokio_sleep_registered` creates a
//!   `tokio::time::sleep(30 s)`, polls it once (that is when tokio registers it in its wheel)
//!   and drops it (deregistering);
//!   `tokio_sleep_registered_inline` does the same with the `Sleep` pinned on the stack, as
//!   it sits inline in an `async fn`'s state or in `tokio::time::timeout` (no allocation, so
//!   the harder baseline: `schedule` allocates nothing either);
//!   `tokio_sleep_unpolled` only creates and drops it (no registration), for reference.
//! * `sleep_reset` (feature `tokio`) — `Sleep::reset` of a pending sleep
//!   (`delaywheel_reset`) against dropping it and creating a new one
//!   (`delaywheel_drop_and_recreate`), and tokio's `Sleep::reset` of a registered sleep
//!   (`tokio_reset`); every deadline computed before the loop, so no side reads the clock.
//! * `producers` — 1 and 2 threads each doing schedule+cancel pairs on one shared engine
//!   (`delaywheel/1`, `delaywheel/2`) and on a `parking_lot::Mutex<BinaryHeap>` with lazy
//!   cancel (`Mutex<BinaryHeap>/1`, `/2`).
//!
//! Then two reports that criterion does not fit (they run for seconds of real time):
//! * lateness: 1M timers due over 10 s (100k/s), delivered through the channel to a consumer
//!   thread that records `receive time − requested deadline`; the same load on
//!   `tokio::time::sleep` tasks in the same run;
//! * idle: 1M timers at least an hour away, and the process's CPU time over 10 s.
//!
//! `cargo bench --features futures --bench engine`; under `cargo test --benches` everything runs once, small.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use delaywheel::Timer;
use hdrhistogram::Histogram;
use parking_lot::Mutex;

#[path = "../examples/support/procfs.rs"]
mod procfs;
use procfs::process_cpu;

fn smoke() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

const FAR: Duration = Duration::from_secs(30);

fn bench_schedule_cancel(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_cancel");
    group.throughput(Throughput::Elements(1));
    let (timer, _rx) = Timer::builder().build_channel(None).unwrap();
    group.bench_function("delaywheel", |b| {
        b.iter(|| {
            let id = timer.schedule(black_box(7u64), FAR).unwrap();
            black_box(timer.cancel(id));
        })
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let mut cx = Context::from_waker(Waker::noop());
    group.bench_function("tokio_sleep_registered", |b| {
        b.iter(|| {
            let mut sleep = Box::pin(tokio::time::sleep(FAR));
            assert!(sleep.as_mut().poll(&mut cx).is_pending());
            drop(sleep);
        })
    });
    group.bench_function("tokio_sleep_registered_inline", |b| {
        b.iter(|| {
            let mut sleep = std::pin::pin!(tokio::time::sleep(FAR));
            assert!(sleep.as_mut().poll(&mut cx).is_pending());
        })
    });
    // What any schedule + cancel through sharded, locked wheels pays before touching a wheel:
    // one clock read and two uncontended lock/unlock pairs (the design: one shard lock
    // for the schedule, one for the cancel). If this alone is over 0.25x tokio's `Sleep`, so
    // is every such engine.
    let shard = Mutex::new(0u64);
    group.bench_function("floor_clock_read_and_two_locks", |b| {
        b.iter(|| {
            let now = black_box(Instant::now());
            *shard.lock() += black_box(1);
            *shard.lock() -= black_box(1);
            now
        })
    });
    group.bench_function("tokio_sleep_unpolled", |b| {
        b.iter(|| {
            let sleep = Box::pin(tokio::time::sleep(FAR));
            drop(black_box(sleep));
        })
    });
    group.finish();
}

use std::future::Future;

/// `Sleep::reset` of a pending sleep (the engine moves its timer in the wheel) against dropping
/// the sleep and creating a new one (cancel + insert), and against tokio's `Sleep::reset` of a
/// registered sleep, in one run. No side reads the clock in the loop: every deadline is an
/// `Instant` computed before it, and the resets alternate between two of them 1 s apart (so
/// each reset moves the timer).
#[cfg(feature = "futures")]
fn bench_sleep_reset(c: &mut Criterion) {
    use delaywheel::sleep::Sleeper;
    let mut group = c.benchmark_group("sleep_reset");
    group.throughput(Throughput::Elements(1));
    let sleeper = Sleeper::new().unwrap();
    let now = Instant::now();
    let (a, b) = (now + FAR, now + FAR + Duration::from_secs(1));
    let mut cx = Context::from_waker(Waker::noop());
    group.bench_function("delaywheel_reset", |bench| {
        let mut sleep = sleeper.sleep_until(a);
        // Registered in the wheel at its first poll, as tokio's is.
        assert!(std::pin::Pin::new(&mut sleep).poll(&mut cx).is_pending());
        let mut flip = false;
        bench.iter(|| {
            flip = !flip;
            sleep.reset(black_box(if flip { b } else { a }));
        })
    });
    group.bench_function("delaywheel_drop_and_recreate", |bench| {
        let mut sleep = sleeper.sleep_until(a);
        let mut flip = false;
        bench.iter(|| {
            flip = !flip;
            sleep = sleeper.sleep_until(black_box(if flip { b } else { a }));
            assert!(std::pin::Pin::new(&mut sleep).poll(&mut cx).is_pending());
        })
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let (ta, tb) = (
        tokio::time::Instant::from_std(a),
        tokio::time::Instant::from_std(b),
    );
    group.bench_function("tokio_reset", |bench| {
        let mut sleep = Box::pin(tokio::time::sleep_until(ta));
        assert!(sleep.as_mut().poll(&mut cx).is_pending()); // registered in tokio's wheel
        let mut flip = false;
        bench.iter(|| {
            flip = !flip;
            sleep.as_mut().reset(black_box(if flip { tb } else { ta }));
        })
    });
    group.finish();
}

/// A `BinaryHeap` timer behind one mutex, with lazy cancel through a side table.
struct HeapTimers {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    live: Vec<bool>,
}

impl HeapTimers {
    /// Room for `n` timers, already written once. Lazily cancelled entries stay until their
    /// deadline (30 s here), so a run of `n` pairs grows the heap to `n`: in a long-running
    /// process that memory would be in use already, not faulted in during the run.
    fn warm(n: usize) -> HeapTimers {
        let now = Instant::now();
        let mut heap = BinaryHeap::with_capacity(n);
        heap.extend((0..n as u64).map(|i| Reverse((now, i))));
        heap.clear();
        let mut live = vec![true; n];
        live.clear();
        HeapTimers { heap, live }
    }
}

fn run_threads(threads: usize, per_thread: usize, op: Arc<dyn Fn() + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let barrier = barrier.clone();
            let op = op.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..per_thread {
                    op();
                }
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    t.elapsed()
}

/// One producer operation: schedule a far timer through `timer`, then cancel it.
fn schedule_cancel(timer: Timer<u64>) -> Arc<dyn Fn() + Send + Sync> {
    Arc::new(move || {
        let id = timer.schedule(black_box(1u64), FAR).unwrap();
        black_box(timer.cancel(id));
    })
}

fn bench_producers(c: &mut Criterion) {
    let per_thread = if smoke() { 1_000 } else { 200_000 };
    let mut group = c.benchmark_group("producers");
    group.sample_size(10);
    for threads in [1usize, 2] {
        group.throughput(Throughput::Elements((threads * per_thread) as u64));
        group.bench_with_input(
            BenchmarkId::new("delaywheel", threads),
            &threads,
            |b, &t| {
                b.iter_custom(|iters| {
                    let (timer, _rx) = Timer::builder().shards(2).build_channel(None).unwrap();
                    let op = schedule_cancel(timer);
                    (0..iters)
                        .map(|_| run_threads(t, per_thread, op.clone()))
                        .sum()
                })
            },
        );
        // The same, while other timers fire every millisecond (10 due 1 ms after they are
        // scheduled, by another thread), as in a gateway whose timeouts also expire: the
        // driver then often finds the wheel empty, and every schedule wakes it.
        group.bench_with_input(
            BenchmarkId::new("delaywheel_while_firing", threads),
            &threads,
            |b, &t| {
                b.iter_custom(|iters| {
                    let (timer, rx) = Timer::builder().shards(2).build_channel(None).unwrap();
                    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let ticker = {
                        let (timer, stop) = (timer.clone(), stop.clone());
                        std::thread::spawn(move || {
                            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                                for _ in 0..10 {
                                    let _ = timer.schedule(0u64, Duration::from_millis(1));
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        })
                    };
                    let consumer = std::thread::spawn(move || while rx.recv().is_ok() {});
                    let op = schedule_cancel(timer.clone());
                    let took = (0..iters)
                        .map(|_| run_threads(t, per_thread, op.clone()))
                        .sum();
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    ticker.join().unwrap();
                    drop((op, timer));
                    consumer.join().unwrap();
                    took
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("Mutex<BinaryHeap>", threads),
            &threads,
            |b, &t| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            // A fresh heap per run: one reused across runs would grow by every
                            // run's entries, and charge its growth to the baseline.
                            let heap = Arc::new(Mutex::new(HeapTimers::warm(t * per_thread)));
                            let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                                let deadline = Instant::now() + FAR;
                                let id = {
                                    let mut h = heap.lock();
                                    let id = h.live.len() as u64;
                                    h.live.push(true);
                                    h.heap.push(Reverse((deadline, id)));
                                    id
                                };
                                heap.lock().live[id as usize] = false;
                            });
                            run_threads(t, per_thread, op)
                        })
                        .sum()
                })
            },
        );
    }
    group.finish();
}

fn percentiles(h: &Histogram<u64>) -> (f64, f64, f64) {
    let ms = |us: u64| us as f64 / 1000.0;
    (
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99)),
        ms(h.max()),
    )
}

/// `n` timers with deadlines spread evenly over `span`, starting 1 s from now (so that
/// scheduling them all is finished before the first is due).
fn lateness_delaywheel(
    n: usize,
    span: Duration,
    tick: Duration,
) -> (Histogram<u64>, Histogram<u64>) {
    let (timer, rx) = Timer::builder()
        .tick(tick)
        .shards(2)
        .build_channel(Some(65_536))
        .unwrap();
    let start = Instant::now() + Duration::from_secs(1);
    let step = span / n as u32;
    let consumer = std::thread::spawn(move || {
        let new = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
        // Against the deadline asked for, and against the tick it was rounded up to.
        let (mut asked, mut rounded) = (new(), new());
        let mut seen = vec![false; n];
        // Bounded: a lost timer must fail the run, not hang it (the last is due 1 s + span
        // from now).
        let patience = Duration::from_secs(1) + span + Duration::from_secs(10);
        for _ in 0..n {
            let e = rx
                .recv_timeout(patience)
                .unwrap_or_else(|_| panic!("a timer was lost: none delivered in {patience:?}"));
            let now = Instant::now();
            // Counted as failures, not clamped to 0: an early fire must not improve the figures.
            assert!(now >= e.value && now >= e.deadline, "a timer fired early");
            let i = ((e.value - start).as_nanos() / step.as_nanos().max(1)) as usize;
            assert!(
                !std::mem::replace(&mut seen[i.min(n - 1)], true),
                "a timer fired twice"
            );
            asked.saturating_record(now.duration_since(e.value).as_micros().max(1) as u64);
            rounded.saturating_record(now.duration_since(e.deadline).as_micros().max(1) as u64);
        }
        (asked, rounded)
    });
    let mut rng = fastrand::Rng::with_seed(3);
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    for i in order {
        let deadline = start + step * i as u32;
        timer.schedule_at(deadline, deadline).unwrap();
    }
    consumer.join().unwrap()
}

fn lateness_tokio(n: usize, span: Duration) -> Histogram<u64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let start = Instant::now() + Duration::from_secs(1);
    let step = span / n as u32;
    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap(),
    ));
    rt.block_on(async {
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let deadline = start + step * i as u32;
            let hist = hist.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(deadline.into()).await;
                let late = Instant::now().saturating_duration_since(deadline);
                hist.lock()
                    .saturating_record(late.as_micros().max(1) as u64);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let h = hist.lock().clone();
    h
}

fn idle_cpu(n: usize, window: Duration) -> f64 {
    let (timer, _rx) = Timer::builder().build_channel(None).unwrap();
    for i in 0..n {
        timer
            .schedule(i as u64, Duration::from_secs(3600 + (i % 3600) as u64))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let before = process_cpu();
    std::thread::sleep(window);
    let used = process_cpu().saturating_sub(before);
    drop(timer.shutdown());
    100.0 * used.as_secs_f64() / window.as_secs_f64()
}

fn reports() {
    let (n, span, window) = if smoke() {
        (
            2_000,
            Duration::from_millis(200),
            Duration::from_millis(200),
        )
    } else {
        (1_000_000, Duration::from_secs(10), Duration::from_secs(10))
    };
    println!("\nLateness: {n} timers over {span:?}, receive time − deadline (ms)");
    println!("| design | p50 | p99 | max |");
    println!("|---|---:|---:|---:|");
    for (name, tick) in [
        ("delaywheel, 1 ms tick", Duration::from_millis(1)),
        ("delaywheel, 100 µs tick", Duration::from_micros(100)),
    ] {
        let (asked, rounded) = lateness_delaywheel(n, span, tick);
        let (p50, p99, max) = percentiles(&asked);
        println!("| {name} | {p50:.3} | {p99:.3} | {max:.3} |");
        let (p50, p99, max) = percentiles(&rounded);
        println!("| {name}, after the tick it rounds up to | {p50:.3} | {p99:.3} | {max:.3} |");
    }
    let (p50, p99, max) = percentiles(&lateness_tokio(n, span));
    println!("| tokio::time::sleep (2 workers) | {p50:.3} | {p99:.3} | {max:.3} |");
    let idle = idle_cpu(n, window);
    println!("\nIdle: {n} timers ≥ 1 h away, CPU over {window:?}: {idle:.4}% of one core");
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_schedule_cancel(&mut c);
    #[cfg(feature = "futures")]
    bench_sleep_reset(&mut c);
    bench_producers(&mut c);
    c.final_summary();
    // `DELAYWHEEL_SKIP_REPORTS=1 cargo bench --bench engine -- <filter>` runs criterion only.
    if std::env::var_os("DELAYWHEEL_SKIP_REPORTS").is_none() {
        reports();
    }
}
