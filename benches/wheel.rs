//! The wheel against its baselines, all in one run.
//!
//! Workload (issue #2): `N` = 1M timers with deadlines uniform in [1, 60 000] ticks; half are
//! cancelled in random order, a quarter are reset to new random deadlines, then time advances
//! tick by tick to 60 000. Each phase is its own benchmark (the earlier phases run untimed as
//! set-up), with one group per phase and one function per contender:
//!
//! * `delaywheel` — `delaywheel::wheel::Wheel<u64>`
//! * `BinaryHeap` — std `BinaryHeap` of `(deadline, id)` with lazy cancel/reset through a side
//!   table of `(current deadline, value)` per id
//! * `BTreeMap` — std `BTreeMap<(deadline, id), value>` plus a deadline per id
//! * `DelayQueue` — tokio-util's, on a paused current-thread runtime; its expiry phase includes
//!   tokio's `advance` of the paused clock per tick, which it needs to see time move
//! * `hierarchical_hash_wheel_timer` — its `QuadWheelWithOverflow`; it cannot cancel or reset,
//!   so it only takes part in insert and expiry, and expires all `N` timers (twice as many per
//!   tick as the others, which spreads its per-tick cost over twice the timers)
//! * `hierarchical_hash_wheel_timer_survivors` — the same wheel, given for its expiry phase the
//!   `N/2` timers the others have left after cancel and reset, at their final deadlines and in
//!   insertion order, so that every contender fires the same timers at the same ticks: the
//!   like-for-like comparison per fired timer
//!
//! `flatness/{insert,insert_warm,cancel}/{10k,1M,10M}` build a wheel of that many timers and
//! cancel them all in random order, to show the cost per operation does not grow with the
//! number pending. `insert` starts from a new wheel each time, so it includes the kernel's
//! first touch of fresh memory: the allocator hands a 1M wheel's 32 MB back to later
//! iterations already mapped, but a 10M wheel's 320 MB comes from a new `mmap` every time (above
//! glibc's largest mmap threshold). The wheel asks for huge pages for its key table (240 MB
//! of it), so that costs a fault per 2 MiB there, not per 4 KiB. `insert_warm` inserts into a
//! wheel that held as many timers before (filled and cleared, untimed), as a long-running
//! process does: the wheel's own cost.
//!
//! After criterion, a table of medians in ns per operation (per fired timer for expiry) and the
//! ratios the issue targets is printed. Run with `cargo bench --bench wheel`; under
//! `cargo test --benches` every benchmark runs once on a 20k workload (smoke mode).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt::Debug;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Mutex;
use std::task::Poll;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use delaywheel::wheel::{TimerKey, Wheel};

#[path = "../examples/support/procfs.rs"]
mod procfs;
use procfs::minor_faults;

/// Per flatness benchmark (operation, size): the minor page faults taken while inserting, and
/// the timers inserted.
type FaultCounts = BTreeMap<(&'static str, &'static str), (u64, u64)>;

static FAULTS: Mutex<FaultCounts> = Mutex::new(BTreeMap::new());

fn count_faults(op: &'static str, label: &'static str, faults: u64, inserts: usize) {
    let mut all = FAULTS.lock().unwrap();
    let entry = all.entry((op, label)).or_default();
    entry.0 += faults;
    entry.1 += inserts as u64;
}

const HORIZON: u64 = 60_000;

fn smoke() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

/// The workload's size in a benchmark run (issue #2).
const FULL_N: usize = 1_000_000;

fn workload_n() -> usize {
    if smoke() {
        20_000
    } else {
        FULL_N
    }
}

/// Deadlines, cancel order and reset targets, the same for every contender.
struct Plan {
    deadlines: Vec<u64>,
    /// Indices of the timers to cancel, in random order (half of them).
    cancels: Vec<usize>,
    /// Indices of timers (not cancelled) to reset, with their new deadlines (a quarter).
    resets: Vec<(usize, u64)>,
    /// The timers left after the cancels and resets, with their final deadlines, by index.
    survivors: Vec<(usize, u64)>,
}

impl Plan {
    fn new(n: usize) -> Plan {
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        let deadlines: Vec<u64> = (0..n).map(|_| rng.u64(1..=HORIZON)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        rng.shuffle(&mut order);
        let cancels = order[..n / 2].to_vec();
        let resets: Vec<(usize, u64)> = order[n / 2..n / 2 + n / 4]
            .iter()
            .map(|&i| (i, rng.u64(1..=HORIZON)))
            .collect();
        let mut last: Vec<Option<u64>> = deadlines.iter().map(|&d| Some(d)).collect();
        for &i in &cancels {
            last[i] = None;
        }
        for &(i, d) in &resets {
            last[i] = Some(d);
        }
        let survivors = last
            .into_iter()
            .enumerate()
            .filter_map(|(i, d)| Some((i, d?)))
            .collect();
        Plan {
            deadlines,
            cancels,
            resets,
            survivors,
        }
    }
}

/// What every contender does. `advance` moves time to `t` and returns how many timers fired.
trait Contender {
    type Key: Copy;
    const NAME: &'static str;
    const CAN_CANCEL: bool = true;
    /// Takes part in expiry only, starting from `Plan::survivors` (for a contender that cannot
    /// cancel, so that it fires the same timers as the others).
    const SURVIVORS_ONLY: bool = false;
    fn new(n: usize) -> Self;
    fn insert(&mut self, deadline: u64, value: u64) -> Self::Key;
    fn cancel(&mut self, key: Self::Key) -> Option<u64>;
    fn reset(&mut self, key: Self::Key, deadline: u64);
    /// Advances tick by tick from 1 to `HORIZON`, returning the number of timers fired.
    fn expire_all(&mut self) -> usize;
    /// A runtime to enter once around a whole phase (DelayQueue's operations need one), so
    /// that no operation pays for entering it.
    fn runtime(&self) -> Option<tokio::runtime::Handle> {
        None
    }
}

impl Contender for Wheel<u64> {
    type Key = TimerKey;
    const NAME: &'static str = "delaywheel";
    fn new(n: usize) -> Self {
        Wheel::with_capacity(n)
    }
    fn insert(&mut self, deadline: u64, value: u64) -> TimerKey {
        Wheel::insert(self, deadline, value)
    }
    fn cancel(&mut self, key: TimerKey) -> Option<u64> {
        Wheel::cancel(self, key)
    }
    fn reset(&mut self, key: TimerKey, deadline: u64) {
        assert!(Wheel::reset(self, key, deadline));
    }
    fn expire_all(&mut self) -> usize {
        let mut fired = 0;
        for t in 1..=HORIZON {
            while let Some(e) = self.poll(t) {
                black_box(e.value);
                fired += 1;
            }
        }
        fired
    }
}

/// `BinaryHeap` with lazy cancel: the heap holds `(deadline, id)`; the side table holds the
/// current deadline (or `u64::MAX` once cancelled/fired) and value of each id.
struct HeapTimers {
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    table: Vec<(u64, u64)>,
}

const GONE: u64 = u64::MAX;

impl Contender for HeapTimers {
    type Key = u32;
    const NAME: &'static str = "BinaryHeap";
    fn new(n: usize) -> Self {
        HeapTimers {
            heap: BinaryHeap::with_capacity(n),
            table: Vec::with_capacity(n),
        }
    }
    fn insert(&mut self, deadline: u64, value: u64) -> u32 {
        let id = self.table.len() as u32;
        self.table.push((deadline, value));
        self.heap.push(Reverse((deadline, id)));
        id
    }
    fn cancel(&mut self, key: u32) -> Option<u64> {
        let slot = &mut self.table[key as usize];
        if slot.0 == GONE {
            return None;
        }
        slot.0 = GONE;
        Some(slot.1)
    }
    fn reset(&mut self, key: u32, deadline: u64) {
        self.table[key as usize].0 = deadline;
        self.heap.push(Reverse((deadline, key)));
    }
    fn expire_all(&mut self) -> usize {
        let mut fired = 0;
        for t in 1..=HORIZON {
            while let Some(&Reverse((deadline, id))) = self.heap.peek() {
                if deadline > t {
                    break;
                }
                self.heap.pop();
                let slot = &mut self.table[id as usize];
                if slot.0 == deadline {
                    slot.0 = GONE;
                    black_box(slot.1);
                    fired += 1;
                }
            }
        }
        fired
    }
}

/// `BTreeMap<(deadline, id), value>` plus the current deadline of each id.
struct TreeTimers {
    map: BTreeMap<(u64, u32), u64>,
    deadlines: Vec<u64>,
}

impl Contender for TreeTimers {
    type Key = u32;
    const NAME: &'static str = "BTreeMap";
    fn new(n: usize) -> Self {
        TreeTimers {
            map: BTreeMap::new(),
            deadlines: Vec::with_capacity(n),
        }
    }
    fn insert(&mut self, deadline: u64, value: u64) -> u32 {
        let id = self.deadlines.len() as u32;
        self.deadlines.push(deadline);
        self.map.insert((deadline, id), value);
        id
    }
    fn cancel(&mut self, key: u32) -> Option<u64> {
        self.map.remove(&(self.deadlines[key as usize], key))
    }
    fn reset(&mut self, key: u32, deadline: u64) {
        let old = std::mem::replace(&mut self.deadlines[key as usize], deadline);
        let value = self.map.remove(&(old, key)).expect("pending");
        self.map.insert((deadline, key), value);
    }
    fn expire_all(&mut self) -> usize {
        let mut fired = 0;
        for t in 1..=HORIZON {
            while let Some(entry) = self.map.first_entry() {
                if entry.key().0 > t {
                    break;
                }
                black_box(entry.remove());
                fired += 1;
            }
        }
        fired
    }
}

/// tokio-util's `DelayQueue` on a paused runtime (it needs tokio's clock).
struct DelayQueueTimers {
    rt: tokio::runtime::Runtime,
    queue: tokio_util::time::DelayQueue<u64>,
    start: tokio::time::Instant,
}

impl Contender for DelayQueueTimers {
    type Key = tokio_util::time::delay_queue::Key;
    const NAME: &'static str = "DelayQueue";
    fn new(n: usize) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        let (queue, start) = {
            let _guard = rt.enter();
            (
                tokio_util::time::DelayQueue::with_capacity(n),
                tokio::time::Instant::now(),
            )
        };
        DelayQueueTimers { rt, queue, start }
    }
    // Within the runtime `run_phase` entered once (see `runtime`): entering it per operation
    // (a thread-local swap and a handle clone) was charged to DelayQueue's every insert,
    // cancel and reset.
    fn insert(&mut self, deadline: u64, value: u64) -> Self::Key {
        self.queue
            .insert_at(value, self.start + Duration::from_millis(deadline))
    }
    fn cancel(&mut self, key: Self::Key) -> Option<u64> {
        self.queue.try_remove(&key).map(|e| e.into_inner())
    }
    fn reset(&mut self, key: Self::Key, deadline: u64) {
        self.queue
            .reset_at(&key, self.start + Duration::from_millis(deadline));
    }
    fn runtime(&self) -> Option<tokio::runtime::Handle> {
        Some(self.rt.handle().clone())
    }
    fn expire_all(&mut self) -> usize {
        let queue = &mut self.queue;
        self.rt.block_on(async {
            let mut fired = 0;
            for _ in 1..=HORIZON {
                tokio::time::advance(Duration::from_millis(1)).await;
                std::future::poll_fn(|cx| {
                    while let Poll::Ready(Some(e)) = queue.poll_expired(cx) {
                        black_box(e.into_inner());
                        fired += 1;
                    }
                    Poll::Ready(())
                })
                .await;
            }
            fired
        })
    }
}

#[derive(Debug)]
struct HhwtEntry(#[allow(dead_code)] u64);

/// `hierarchical_hash_wheel_timer`'s four-level byte wheel. It has no cancel or reset.
/// `SURVIVORS` selects the like-for-like expiry (see the module docs).
struct HhwtTimers<const SURVIVORS: bool>(
    hierarchical_hash_wheel_timer::wheels::quad_wheel::QuadWheelWithOverflow<HhwtEntry>,
);

impl<const SURVIVORS: bool> Contender for HhwtTimers<SURVIVORS> {
    type Key = ();
    const NAME: &'static str = if SURVIVORS {
        "hierarchical_hash_wheel_timer_survivors"
    } else {
        "hierarchical_hash_wheel_timer"
    };
    const CAN_CANCEL: bool = false;
    const SURVIVORS_ONLY: bool = SURVIVORS;
    fn new(_n: usize) -> Self {
        HhwtTimers(Default::default())
    }
    fn insert(&mut self, deadline: u64, value: u64) {
        self.0
            .insert_with_delay(HhwtEntry(value), Duration::from_millis(deadline))
            .expect("delay >= 1");
    }
    fn cancel(&mut self, _key: ()) -> Option<u64> {
        None
    }
    fn reset(&mut self, _key: (), _deadline: u64) {}
    fn expire_all(&mut self) -> usize {
        let mut fired = 0;
        for _ in 1..=HORIZON {
            let batch = self.0.tick();
            fired += batch.len();
            black_box(batch);
        }
        fired
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Insert,
    Cancel,
    Reset,
    Expire,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Insert => "insert",
            Phase::Cancel => "cancel",
            Phase::Reset => "reset",
            Phase::Expire => "expire",
        }
    }
}

/// Runs the workload up to `phase` and returns the time of that phase and its operation count.
fn run_phase<C: Contender>(plan: &Plan, phase: Phase) -> (Duration, usize) {
    let n = plan.deadlines.len();
    let mut c = C::new(n);
    let runtime = c.runtime();
    let _entered = runtime.as_ref().map(tokio::runtime::Handle::enter);
    if C::SURVIVORS_ONLY {
        assert_eq!(phase, Phase::Expire, "{} only expires", C::NAME);
        for &(i, d) in &plan.survivors {
            c.insert(d, i as u64);
        }
        let t = Instant::now();
        let fired = c.expire_all();
        let elapsed = t.elapsed();
        assert_eq!(
            fired,
            plan.survivors.len(),
            "{} lost or duplicated timers",
            C::NAME
        );
        return (elapsed, fired);
    }
    // The harness keeps every key (0 to 8 bytes, by contender). Its list is allocated and
    // touched before the clock starts, so its growth and page faults are not charged to the
    // contender: the first insert, untimed, gives the key to fill it with.
    let mut keys: Vec<C::Key> = Vec::with_capacity(n);
    let first = c.insert(plan.deadlines[0], 0);
    keys.resize(n, first);
    keys.truncate(1);
    let t = Instant::now();
    keys.extend(
        plan.deadlines
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, &d)| c.insert(d, i as u64)),
    );
    if phase == Phase::Insert {
        let elapsed = t.elapsed();
        drop(c);
        return (elapsed, n - 1);
    }
    if C::CAN_CANCEL {
        let t = Instant::now();
        for &i in &plan.cancels {
            black_box(c.cancel(keys[i]));
        }
        if phase == Phase::Cancel {
            return (t.elapsed(), plan.cancels.len());
        }
        let t = Instant::now();
        for &(i, d) in &plan.resets {
            c.reset(keys[i], d);
        }
        if phase == Phase::Reset {
            return (t.elapsed(), plan.resets.len());
        }
    }
    let t = Instant::now();
    let fired = c.expire_all();
    let elapsed = t.elapsed();
    let expected = if C::CAN_CANCEL {
        n - plan.cancels.len()
    } else {
        n
    };
    assert_eq!(fired, expected, "{} lost or duplicated timers", C::NAME);
    (elapsed, fired)
}

fn bench_contender<C: Contender>(c: &mut Criterion, plan: &Plan) {
    for phase in [Phase::Insert, Phase::Cancel, Phase::Reset, Phase::Expire] {
        let skip = if C::SURVIVORS_ONLY {
            phase != Phase::Expire
        } else {
            !C::CAN_CANCEL && matches!(phase, Phase::Cancel | Phase::Reset)
        };
        if skip {
            continue;
        }
        let mut group = c.benchmark_group(phase.name());
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(3));
        let ops = run_phase::<C>(plan, phase).1;
        group.throughput(Throughput::Elements(ops as u64));
        group.bench_function(C::NAME, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| run_phase::<C>(plan, phase).0).sum())
        });
        group.finish();
    }
}

fn bench_flatness(c: &mut Criterion) {
    let sizes: &[(usize, &str)] = if smoke() {
        &[(10_000, "10k"), (20_000, "20k")]
    } else {
        &[(10_000, "10k"), (1_000_000, "1M"), (10_000_000, "10M")]
    };
    for &(n, label) in sizes {
        let plan = Plan::new(n);
        let mut order: Vec<usize> = (0..n).collect();
        fastrand::Rng::with_seed(7).shuffle(&mut order);
        for op in ["insert", "insert_warm", "cancel"] {
            let mut group = c.benchmark_group(format!("flatness/{op}"));
            group.sample_size(10);
            group.warm_up_time(Duration::from_millis(500));
            group.measurement_time(Duration::from_secs(if n >= 10_000_000 { 10 } else { 3 }));
            group.throughput(Throughput::Elements(n as u64));
            group.bench_with_input(BenchmarkId::from_parameter(label), &n, |b, &n| {
                // `insert_warm` keeps one wheel that has held `n` timers. The harness's own
                // list of keys is touched once here and reused, so its page faults are not
                // charged to the wheel.
                let mut warm = (op == "insert_warm").then(|| {
                    let mut wheel: Wheel<u64> = Wheel::with_capacity(n);
                    for (i, &d) in plan.deadlines.iter().enumerate() {
                        wheel.insert(d, i as u64);
                    }
                    wheel.clear();
                    wheel
                });
                let mut keys = vec![TimerKey::from_bits(0); n];
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        keys.clear();
                        let mut wheel = warm.take().unwrap_or_else(|| Wheel::with_capacity(n));
                        let faults = minor_faults();
                        let t = Instant::now();
                        for (i, &d) in plan.deadlines.iter().enumerate() {
                            keys.push(wheel.insert(d, i as u64));
                        }
                        let inserted = t.elapsed();
                        count_faults(op, label, minor_faults() - faults, n);
                        if op != "cancel" {
                            total += inserted;
                        } else {
                            let t = Instant::now();
                            for &i in &order {
                                black_box(wheel.cancel(keys[i]));
                            }
                            total += t.elapsed();
                            assert!(wheel.is_empty());
                        }
                        if op == "insert_warm" {
                            assert_eq!(wheel.len(), n);
                            wheel.clear();
                            warm = Some(wheel);
                        }
                    }
                    total
                })
            });
            group.finish();
        }
    }
}

/// When this process started: estimates saved before it are another run's.
static STARTED: std::sync::LazyLock<std::time::SystemTime> =
    std::sync::LazyLock::new(std::time::SystemTime::now);

/// Median ns per operation of a benchmark this run finished, from criterion's saved estimates;
/// `None` for one this run did not measure (a filtered run): its file is an older run's, in
/// another machine state or of other code, and must not be divided by this run's figures.
fn median_ns_per_op(group: &str, function: &str, ops: usize) -> Option<f64> {
    let dir: PathBuf = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("criterion")
        .join(group.replace('/', "_"))
        .join(function)
        .join("new")
        .join("estimates.json");
    if std::fs::metadata(&dir).and_then(|m| m.modified()).ok()? < *STARTED {
        return None;
    }
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir).ok()?).ok()?;
    Some(json["median"]["point_estimate"].as_f64()? / ops as f64)
}

fn report(plan: &Plan) {
    let n = plan.deadlines.len();
    let fired = n - plan.cancels.len();
    let names = [
        "delaywheel",
        "BinaryHeap",
        "BTreeMap",
        "DelayQueue",
        "hierarchical_hash_wheel_timer",
        "hierarchical_hash_wheel_timer_survivors",
    ];
    let phases: [(&str, usize); 4] = [
        // The first insert is untimed (see `run_phase`).
        ("insert", n - 1),
        ("cancel", plan.cancels.len()),
        ("reset", plan.resets.len()),
        ("expire", fired),
    ];
    let get = |phase: &str, name: &str| {
        let ops = phases.iter().find(|p| p.0 == phase).map(|p| p.1)?;
        let ops = if phase == "expire" && name == "hierarchical_hash_wheel_timer" {
            n
        } else {
            ops
        };
        median_ns_per_op(phase, name, ops)
    };
    let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
    println!("\nMedian ns per operation (expire: per fired timer), N = {n}");
    println!("| contender | insert | cancel | reset | expire |");
    println!("|---|---:|---:|---:|---:|");
    for name in names {
        println!(
            "| {name} | {} | {} | {} | {} |",
            fmt(get("insert", name)),
            fmt(get("cancel", name)),
            fmt(get("reset", name)),
            fmt(get("expire", name))
        );
    }
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}×", a / b),
        _ => "n/a".into(),
    };
    println!("\n| target | measured |");
    println!("|---|---:|");
    println!(
        "| insert ≤ 1.0× BinaryHeap | {} |",
        ratio(get("insert", "delaywheel"), get("insert", "BinaryHeap"))
    );
    println!(
        "| expire ≤ 1.0× hierarchical_hash_wheel_timer, same timers fired | {} |",
        ratio(
            get("expire", "delaywheel"),
            get("expire", "hierarchical_hash_wheel_timer_survivors")
        )
    );
    println!(
        "| expire vs hierarchical_hash_wheel_timer firing all N (twice the timers per tick) | {} |",
        ratio(
            get("expire", "delaywheel"),
            get("expire", "hierarchical_hash_wheel_timer")
        )
    );
    println!(
        "| cancel ≤ 0.5× DelayQueue | {} |",
        ratio(get("cancel", "delaywheel"), get("cancel", "DelayQueue"))
    );
    println!(
        "| reset ≤ 0.5× DelayQueue | {} |",
        ratio(get("reset", "delaywheel"), get("reset", "DelayQueue"))
    );
    let (small, large) = if smoke() {
        (10_000, 20_000)
    } else {
        (10_000, 10_000_000)
    };
    let label = |n: usize| match n {
        10_000 => "10k",
        20_000 => "20k",
        _ => "10M",
    };
    let flat = |op: &str, n: usize| median_ns_per_op(&format!("flatness/{op}"), label(n), n);
    for (op, what) in [
        (
            "insert_warm",
            "≤ 2× at 10k (a wheel that held as many timers before)",
        ),
        ("insert", "vs 10k (a new wheel: its memory is fresh)"),
        ("cancel", "vs 10k (for information)"),
    ] {
        println!(
            "| {op} at {} {what} | {} ({} vs {} ns) |",
            label(large),
            ratio(flat(op, large), flat(op, small)),
            fmt(flat(op, large)),
            fmt(flat(op, small))
        );
    }
    println!("\nMinor page faults per 1 000 inserts, over every flatness iteration:");
    for ((op, size), (faults, inserts)) in FAULTS.lock().unwrap().iter() {
        let per_k = *faults as f64 * 1_000.0 / (*inserts).max(1) as f64;
        println!("| {op} | {size} | {per_k:.2} |");
    }
}

fn main() {
    // Read now: estimates saved before this moment are not this run's.
    std::sync::LazyLock::force(&STARTED);
    let plan = Plan::new(workload_n());
    let mut c = Criterion::default().configure_from_args();
    bench_contender::<Wheel<u64>>(&mut c, &plan);
    bench_contender::<HeapTimers>(&mut c, &plan);
    bench_contender::<TreeTimers>(&mut c, &plan);
    bench_contender::<DelayQueueTimers>(&mut c, &plan);
    bench_contender::<HhwtTimers<false>>(&mut c, &plan);
    bench_contender::<HhwtTimers<true>>(&mut c, &plan);
    bench_flatness(&mut c);
    c.final_summary();
    // Also in the smoke run, so that the report's code cannot rot; criterion writes no
    // estimates then, and those of earlier runs are not used, so its table shows n/a.
    if smoke() {
        println!("\n(smoke run: no estimates of this run, so the tables below are n/a)");
        report(&Plan::new(FULL_N));
    } else {
        report(&plan);
    }
}
