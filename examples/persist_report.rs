//! Measures the Redis persistence layer against its targets, on a private `redis-server` (or
//! `--redis URL`), and prints a report:
//!
//! * schedule + cancel through a `WriteBehind` [`Persistent`] engine vs the in-memory
//!   `Timer<String>` (target ≤ 2×), same ids, same run: with a `null` payload, and with a
//!   typed one (a struct serialized at the call);
//! * flusher throughput: task upserts, and removals, per second written to Redis (target
//!   ≥ 300k/s), beside Redis's own pace for the same writes (the same command stream down a
//!   raw socket, no client library), the Redis server's CPU meanwhile, and the longest
//!   `schedule` call a producer sees meanwhile. Upserts are timed twice: into a Redis that
//!   grows to hold them (its first use of that memory), and again after the removals freed
//!   it (a long-running Redis), each beside the raw stream in the same state; and a steady
//!   state's round, half removals and half new tasks;
//! * restore of N pending tasks with 100-byte payloads into a new engine (target ≤ 5 s at 1M);
//! * Redis memory per persisted task (`INFO memory`, used_memory growth / N).
//!
//! ```text
//! cargo run --release --features redis --example persist_report           # 1M tasks
//! cargo run --features redis --example persist_report -- --smoke --json    # make test
//! ```

#[path = "support/persist_rounds.rs"]
mod persist_rounds;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::redis::{now_ms, PersistConfig, Persistent};
use delaywheel::Timer;
use persist_rounds::{median, persistent_pairs_ns, timed_flush, timer_pairs_ns};

/// The typed payload of the schedule + cancel measure: what an order service schedules.
#[derive(serde::Serialize)]
struct CloseOrder {
    order_id: u64,
    customer_id: u64,
}

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

/// CPU seconds the Redis server has used (user + system, all its threads).
fn redis_cpu_s(url: &str) -> f64 {
    redis_server::info_sum(url, "cpu", &["used_cpu_user", "used_cpu_sys"])
}

/// Entries per restore page. Alternating 1M restores on a slow VM: pages of 1 000 took 5.31–6.10 s
/// (median 5.86), of 4 000 4.81–5.34 s (5.09), of 10 000 4.81 and 5.43 s. Each page is one
/// ZSCAN step and one HMGET, each of which Redis runs whole while other clients wait.
const RESTORE_PAGE: usize = 4_000;

fn redis_conn(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

fn used_memory(url: &str) -> f64 {
    redis_server::info_sum(url, "memory", &["used_memory"])
}

/// An engine on namespace `ns` whose flusher waits until asked (`flush`), with room in its
/// journal for `bound` changes. Its receiver of fired tasks comes with it, to be kept alive.
fn waiting_engine(
    url: &str,
    ns: &str,
    bound: usize,
) -> (
    Persistent,
    crossbeam_channel::Receiver<delaywheel::redis::Envelope>,
) {
    let mut cfg = PersistConfig::new(url.to_string(), ns);
    cfg.flush_interval = Duration::from_secs(3_600);
    cfg.journal_bound = bound;
    Persistent::start(cfg).expect("persistent engine")
}

/// Schedules a task for each of `ids`, the i-th due at `first_due + i`.
fn schedule_all(persist: &Persistent, ids: &[String], payload: &serde_json::Value, first_due: u64) {
    for (i, id) in ids.iter().enumerate() {
        persist
            .schedule_at_ms(
                id.clone(),
                "order.close",
                payload.clone(),
                first_due + i as u64,
            )
            .expect("schedule");
    }
}

/// A flush of a million tasks takes seconds; this bounds a stuck one.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(600);

/// One command in RESP.
fn resp(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// The namespace of the raw-socket ceiling's writes, and the marker ending its stream.
const CEILING_NS: &str = "{persist_report_ceiling}";
const CEILING_DONE: &[u8] = b"persist-report-ceiling-done";

/// The flusher's writes for `ids` as one RESP stream of MULTI/ZADD/HSET/EXEC batches of 1 000,
/// ending with an ECHO of [`CEILING_DONE`].
fn raw_stream(ids: &[String], payload: &serde_json::Value, far: u64) -> Vec<u8> {
    let (due_key, tasks_key) = (format!("{CEILING_NS}:due"), format!("{CEILING_NS}:tasks"));
    let mut stream = Vec::new();
    for (b, chunk) in ids.chunks(1_000).enumerate() {
        let mut zadd: Vec<Vec<u8>> = vec![b"ZADD".to_vec(), due_key.clone().into_bytes()];
        let mut hset: Vec<Vec<u8>> = vec![b"HSET".to_vec(), tasks_key.clone().into_bytes()];
        for (j, id) in chunk.iter().enumerate() {
            let due_at = far + (b * 1_000 + j) as u64;
            let envelope = delaywheel::redis::Envelope {
                id: id.clone(),
                topic: "order.close".into(),
                payload: payload.clone(),
                attempt: 0,
                created_at: now_ms(),
                headers: Default::default(),
                due_at,
            };
            zadd.push(due_at.to_string().into_bytes());
            zadd.push(id.clone().into_bytes());
            hset.push(id.clone().into_bytes());
            hset.push(envelope.encode(usize::MAX).expect("encode"));
        }
        resp(&mut stream, &[b"MULTI"]);
        resp(
            &mut stream,
            &zadd.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        );
        resp(
            &mut stream,
            &hset.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        );
        resp(&mut stream, &[b"EXEC"]);
    }
    resp(&mut stream, &[b"ECHO", CEILING_DONE]);
    stream
}

/// Tasks per second Redis takes when `stream` (from [`raw_stream`], `tasks` tasks), built
/// before the clock starts, is written down a raw socket (no client library) and read back to
/// its final marker. `None` for URLs other than `redis+unix://PATH` and `redis://HOST:PORT`
/// (no credentials).
fn raw_stream_ops_per_s(url: &str, stream: &[u8], tasks: usize) -> Option<f64> {
    use std::io::{Read, Write};
    let marker = CEILING_DONE;
    let mut conn: Box<dyn ReadWrite> = if let Some(path) = url.strip_prefix("redis+unix://") {
        Box::new(std::os::unix::net::UnixStream::connect(path).ok()?)
    } else {
        let addr = url.strip_prefix("redis://")?.trim_end_matches('/');
        if addr.contains('@') || addr.contains('/') {
            return None;
        }
        Box::new(std::net::TcpStream::connect(addr).ok()?)
    };
    let t = Instant::now();
    conn.write_all(stream).ok()?;
    // Replies are a few bytes per batch: they wait in the socket until the writing is done.
    let mut seen = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    while !seen.windows(marker.len()).any(|w| w == marker) {
        let n = conn.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        seen.extend_from_slice(&buf[..n]);
    }
    let elapsed = t.elapsed();
    // Any error reply (`-ERR`, `-OOM`, `-WRONGTYPE`, `-EXECABORT`, ...) starts a line with '-'.
    assert!(
        !(seen.starts_with(b"-") || seen.windows(3).any(|w| w == b"\r\n-")),
        "Redis refused part of the ceiling stream"
    );
    redis::cmd("DEL")
        .arg(format!("{CEILING_NS}:due"))
        .arg(format!("{CEILING_NS}:tasks"))
        .query::<()>(&mut redis_conn(url))
        .expect("DEL");
    Some(tasks as f64 / elapsed.as_secs_f64())
}

trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}

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
    persist.restore(RESTORE_PAGE).expect("restore");
    let (mut mem_ns, mut persist_ns, mut typed_ns) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..7 {
        mem_ns.push(timer_pairs_ns(&timer, &ids[..args.pairs]));
        persist_ns.push(persistent_pairs_ns(&persist, &ids[..args.pairs], far));
        // The same with a typed payload, as an order service writes it: serialized at the call.
        let t = Instant::now();
        for (i, id) in ids[..args.pairs].iter().enumerate() {
            let close = CloseOrder {
                order_id: i as u64,
                customer_id: 7,
            };
            persist
                .schedule_at_ms(id.clone(), "order.close", &close, far)
                .expect("schedule");
            persist.cancel(id);
        }
        typed_ns.push(t.elapsed().as_nanos() as f64 / args.pairs as f64);
    }
    let (mem_ns, persist_ns, typed_ns) = (median(mem_ns), median(persist_ns), median(typed_ns));
    // Where the typed payload's cost goes: serde alone, into the envelope's `Value` and into
    // JSON bytes (the least any design pays that checks the encoded size at the call).
    let serde_ns = |to_bytes: bool| {
        let rounds: Vec<f64> = (0..7)
            .map(|_| {
                let t = Instant::now();
                for i in 0..args.pairs {
                    let close = CloseOrder {
                        order_id: i as u64,
                        customer_id: 7,
                    };
                    if to_bytes {
                        std::hint::black_box(serde_json::to_vec(&close).expect("encode"));
                    } else {
                        std::hint::black_box(serde_json::to_value(&close).expect("encode"));
                    }
                }
                t.elapsed().as_nanos() as f64 / args.pairs as f64
            })
            .collect();
        median(rounds)
    };
    let (to_value_ns, to_vec_ns) = (serde_ns(false), serde_ns(true));
    drop(persist);

    // 2. flusher throughput: journal N upserts while the flusher sleeps, then time the flush.
    let payload = serde_json::Value::String("x".repeat(args.payload.saturating_sub(2)));
    let mem_before = used_memory(&url);
    // Room for the backlog and, beside it, for the producer below: the changes a round takes
    // count against the bound until the round ends.
    let (persist, _fired) = waiting_engine(&url, ns, 2 * args.tasks + 1);
    // As a process starts (until a restore completes, a cancel writes its removal).
    persist.restore(RESTORE_PAGE).expect("restore");
    assert!(persist.flush(Duration::from_secs(10)), "first flush");
    schedule_all(&persist, &ids[..args.tasks], &payload, far);
    // A producer keeps scheduling during the flush: its longest wait for the engine's lock.
    let flushing = std::sync::atomic::AtomicBool::new(true);
    let redis_cpu_before = redis_cpu_s(&url);
    let (flush, redis_cpu_after, producer_max_wait) = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut longest = Duration::ZERO;
            for i in 0u64.. {
                if !flushing.load(std::sync::atomic::Ordering::Relaxed) {
                    // Not part of the later figures.
                    for j in 0..i {
                        persist.cancel(&format!("probe:{j}"));
                    }
                    break;
                }
                let t = Instant::now();
                persist
                    .schedule_at_ms(
                        format!("probe:{i}"),
                        "order.close",
                        serde_json::Value::Null,
                        far,
                    )
                    .expect("schedule");
                longest = longest.max(t.elapsed());
                std::thread::sleep(Duration::from_micros(200));
            }
            longest
        });
        let flush = timed_flush(&persist, FLUSH_TIMEOUT);
        // Read at the end of the timed flush, not after the probes' own flush below.
        let cpu = redis_cpu_s(&url);
        flushing.store(false, std::sync::atomic::Ordering::Relaxed);
        (flush, cpu, producer.join().expect("producer"))
    });
    assert!(persist.flush(Duration::from_secs(60)), "flush timed out");
    let flush_ops_per_s = args.tasks as f64 / flush.as_secs_f64();
    let redis_busy = (redis_cpu_after - redis_cpu_before) / flush.as_secs_f64();
    drop(persist);
    let bytes_per_task = (used_memory(&url) - mem_before) / args.tasks as f64;

    // 2b. Redis's own pace for that load, in the same run: the same MULTI/ZADD/HSET/EXEC
    // stream (batches of 1 000, the same envelopes), written as fast as a socket takes it,
    // twice: into memory Redis has never used (as the flush above), then into the memory the
    // first run freed (as the warm flush below). The stream is built once.
    let stream = raw_stream(&ids[..args.tasks], &payload, far);
    let ceiling_cold = raw_stream_ops_per_s(&url, &stream, args.tasks);
    let ceiling_warm = raw_stream_ops_per_s(&url, &stream, args.tasks);
    drop(stream);

    // 3. restore into a new engine.
    let (persist, _fired) =
        Persistent::start(PersistConfig::new(url.clone(), ns)).expect("persistent engine");
    let t = Instant::now();
    let report = persist.restore(RESTORE_PAGE).expect("restore");
    let restore = t.elapsed();
    // Every task by id (a count alone would let a duplicate hide a loss).
    let lost = ids[..args.tasks]
        .iter()
        .filter(|id| !persist.contains(id))
        .count();
    assert_eq!(
        report.loaded + lost,
        args.tasks,
        "restore loaded tasks that were never scheduled"
    );
    drop(persist);

    // 4. flusher throughput for removals: restore again into an engine whose flusher waits,
    // cancel every task, then time the flush.
    let (persist, _fired) = waiting_engine(&url, ns, args.tasks + 1);
    persist.restore(RESTORE_PAGE).expect("restore");
    for id in &ids[..args.tasks] {
        persist.cancel(id);
    }
    let remove_ops_per_s = args.tasks as f64 / timed_flush(&persist, FLUSH_TIMEOUT).as_secs_f64();
    drop(persist);

    // 5. flusher upserts again, into a Redis whose allocator holds the memory the removals
    // freed: a long-running Redis's state, where the first flush paid for Redis growing.
    let (persist, _fired) = waiting_engine(&url, ns, args.tasks + 1);
    persist.restore(RESTORE_PAGE).expect("restore");
    schedule_all(&persist, &ids[..args.tasks], &payload, far);
    let redis_cpu_before = redis_cpu_s(&url);
    let warm_flush = timed_flush(&persist, FLUSH_TIMEOUT);
    let warm_redis_busy = (redis_cpu_s(&url) - redis_cpu_before) / warm_flush.as_secs_f64();
    let warm_flush_ops_per_s = args.tasks as f64 / warm_flush.as_secs_f64();

    // 6. a steady state's round: half the tasks leave (cancelled or acknowledged) and as many
    // new ones arrive, journaled while the flusher waits, then flushed as one round.
    let half = args.tasks / 2;
    let newcomers: Vec<String> = (0..half).map(|i| format!("new:{i}")).collect();
    for id in &ids[..half] {
        persist.cancel(id);
    }
    schedule_all(&persist, &newcomers, &payload, far + args.tasks as u64);
    let mixed_ops_per_s = (2 * half) as f64 / timed_flush(&persist, FLUSH_TIMEOUT).as_secs_f64();
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
        "{:<44} {:>9.0} ns {:>12} {:>7.2}×",
        "  the same, typed payload (struct, 2 fields)",
        typed_ns,
        "≤ 2×",
        typed_ns / mem_ns
    );
    println!(
        "{:<44} {:>9.0} ns {:>12} {:>7.2}×",
        "  serde_json::to_value of that payload alone",
        to_value_ns,
        "",
        to_value_ns / mem_ns
    );
    println!(
        "{:<44} {:>9.0} ns {:>12} {:>7.2}×",
        "  serde_json::to_vec of that payload alone",
        to_vec_ns,
        "",
        to_vec_ns / mem_ns
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher upserts, Redis growing", flush_ops_per_s, "≥ 300000/s"
    );
    if let Some(c) = ceiling_cold {
        println!(
            "{:<44} {:>9.0}/s {:>12} {:>7.2}×",
            "  Redis's pace: same writes, raw socket",
            c,
            "",
            flush_ops_per_s / c
        );
    }
    println!(
        "{:<44} {:>9.0} % {:>12}",
        "  Redis CPU during that flush (of one core)",
        redis_busy * 100.0,
        ""
    );
    println!(
        "{:<44} {:>9.2} ms {:>12}",
        "  longest schedule() during that flush",
        producer_max_wait.as_secs_f64() * 1e3,
        ""
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher removals (cancel of a persisted task)", remove_ops_per_s, ""
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher upserts, Redis warm", warm_flush_ops_per_s, "≥ 300000/s"
    );
    if let Some(c) = ceiling_warm {
        println!(
            "{:<44} {:>9.0}/s {:>12} {:>7.2}×",
            "  Redis's pace: same writes, raw socket",
            c,
            "",
            warm_flush_ops_per_s / c
        );
    }
    println!(
        "{:<44} {:>9.0} % {:>12}",
        "  Redis CPU during that flush (of one core)",
        warm_redis_busy * 100.0,
        ""
    );
    println!(
        "{:<44} {:>9.0}/s {:>12}",
        "flusher, half removals and half upserts", mixed_ops_per_s, "≥ 300000/s"
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
                "schedule_cancel_typed_ns": typed_ns,
                "schedule_cancel_typed_ratio": typed_ns / mem_ns,
                "payload_to_value_ns": to_value_ns,
                "payload_to_vec_ns": to_vec_ns,
                "flush_ops_per_s": flush_ops_per_s,
                "flush_remove_ops_per_s": remove_ops_per_s,
                "redis_pace_cold_ops_per_s": ceiling_cold,
                "flush_warm_ops_per_s": warm_flush_ops_per_s,
                "flush_mixed_ops_per_s": mixed_ops_per_s,
                "redis_pace_warm_ops_per_s": ceiling_warm,
                "redis_cpu_during_warm_flush": warm_redis_busy,
                "schedule_max_wait_during_flush_ms": producer_max_wait.as_secs_f64() * 1e3,
                "redis_cpu_during_flush": redis_busy,
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
