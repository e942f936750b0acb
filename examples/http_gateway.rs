//! A real HTTP gateway on 127.0.0.1 with its timeouts on the engine, against the same gateway
//! on tokio's timer, and the load that tells them apart.
//!
//! The server is hyper 1.x (HTTP/1.1, keep-alive) with a header-read timeout, which hyper also
//! applies to a kept-alive connection waiting for its next request, so every request arms and
//! disarms one hyper timer; and a tower timeout on every request. With `--timer delaywheel`
//! they are `HyperTimer` and `TimeoutLayer` on a leaked `Sleeper`; with `--timer tokio`,
//! `hyper_util`'s `TokioTimer` and `tower::timeout::TimeoutLayer`. The load generator opens
//! `--connections` keep-alive connections (raw TCP, the same code for both) and sends
//! requests on each, one at a time, until `--requests` are answered or `--seconds` pass.
//!
//! The load runs in a child process of its own (this binary with `--load`), so each process
//! holds one end of each connection, and the server's CPU is its own process's. For each run it
//! prints requests/s, p50/p99 latency and the server's CPU per request (its runtime and the
//! engine's driver thread). The timers run alternated, `--runs` times each. Then the timer's memory per
//! connection (heap bytes per registered hyper sleep, by a counting allocator), and the order
//! of a graceful shutdown: the server first, then the engine.
//!
//! ```text
//! cargo run --release --features hyper,tower --example http_gateway -- --connections 10000 --runs 3
//! cargo run --features hyper,tower --example http_gateway -- --smoke --json     # make test
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::http::{HyperTimer, TimeoutLayer};
use delaywheel::sleep::Sleeper;
use hdrhistogram::Histogram;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceBuilder;

#[path = "support/procfs.rs"]
mod procfs;

/// Live heap bytes, for the timer's memory per connection.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is passed to the system allocator unchanged; the counter only adds up the
// sizes it was asked for.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Parser, Debug)]
#[command(about = "A hyper + tower gateway on delaywheel's timer against tokio's")]
struct Args {
    /// Which timers: `tokio`, `delaywheel`, or both (alternated).
    #[arg(long, value_delimiter = ',', default_value = "tokio,delaywheel")]
    timer: Vec<String>,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Requests per run (the run also stops after `--seconds`).
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Time bound of a run's load, in seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Runs per timer, alternated.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Header-read (and keep-alive idle) timeout, in ms.
    #[arg(long, default_value_t = 30_000)]
    header_read_ms: u64,
    /// The tower timeout per request, in ms.
    #[arg(long, default_value_t = 10_000)]
    request_ms: u64,
    /// A small, quick run of both timers (make test).
    #[arg(long)]
    smoke: bool,
    /// The figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
    /// Internal: run as the load process against this server address.
    #[arg(long, hide = true)]
    load: Option<SocketAddr>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Which {
    Tokio,
    Delaywheel,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::Tokio => "tokio",
            Which::Delaywheel => "delaywheel",
        }
    }
}

/// One run's figures.
#[derive(Debug, serde::Serialize)]
struct Run {
    timer: &'static str,
    connections: usize,
    requests: u64,
    errors: u64,
    requests_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    /// The server process's CPU (its runtime, and the engine's driver thread) per request.
    server_cpu_us_per_request: f64,
    /// Engine timers pending when the engine shut down, after the server (0 = nothing left).
    pending_at_engine_shutdown: Option<usize>,
}

const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: gateway\r\n\r\n";

/// Raises the limit on open files to what `connections` need (one end each, in each of the two
/// processes, plus slack): the
/// soft limit up to the hard one, and the hard one too where the process may (root). Returns
/// the limit in effect, and says so when it falls short.
fn raise_nofile(connections: usize) -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let want = connections as u64 + 256;
    let now = getrlimit(Resource::Nofile);
    let (cur, max) = (now.current.unwrap_or(u64::MAX), now.maximum);
    if cur >= want {
        return cur;
    }
    // Up to the hard limit; past it too where the process may raise that (root).
    let raised = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(want),
            maximum: Some(max.map_or(want, |m| m.max(want))),
        },
    );
    if raised.is_err() {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(max.map_or(want, |m| m.min(want))),
                maximum: max,
            },
        );
    }
    let got = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    if got < want {
        eprintln!(
            "RLIMIT_NOFILE is {got} and the hard limit stops it there: {connections} connections \
             need {want}; raise it (ulimit -n {want}) or use fewer --connections"
        );
    }
    got
}

/// The server: hyper with `which`'s timer, a tower timeout per request. Returns its address.
async fn serve(which: Which, sleeper: Option<Sleeper>, args: &Args) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let header_read = Duration::from_millis(args.header_read_ms);
    let request = Duration::from_millis(args.request_ms);
    let answer = |_req: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    };
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.header_read_timeout(header_read);
            let io = TokioIo::new(stream);
            match (which, &sleeper) {
                (Which::Delaywheel, Some(sleeper)) => {
                    http.timer(HyperTimer::new(sleeper.clone()));
                    let svc = ServiceBuilder::new()
                        .layer(TimeoutLayer::new(sleeper.clone(), request))
                        .service_fn(answer);
                    let svc = hyper_util::service::TowerToHyperService::new(svc);
                    tokio::spawn(async move { drop(http.serve_connection(io, svc).await) });
                }
                _ => {
                    http.timer(TokioTimer::new());
                    let svc = ServiceBuilder::new()
                        .layer(tower::timeout::TimeoutLayer::new(request))
                        .service_fn(answer);
                    let svc = hyper_util::service::TowerToHyperService::new(svc);
                    tokio::spawn(async move { drop(http.serve_connection(io, svc).await) });
                }
            }
        }
    });
    addr
}

/// One keep-alive connection of the load: requests one at a time while `left` lasts.
async fn client(
    left: Arc<AtomicU64>,
    until: Instant,
    mut stream: TcpStream,
) -> (Histogram<u64>, u64) {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut errors = 0;
    let mut buf = vec![0u8; 4096];
    while Instant::now() < until {
        if left
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_err()
        {
            break;
        }
        let start = Instant::now();
        if stream.write_all(REQUEST).await.is_err() {
            errors += 1;
            break;
        }
        let mut got = 0;
        let ok = loop {
            match stream.read(&mut buf[got..]).await {
                Ok(0) | Err(_) => break false,
                Ok(n) => got += n,
            }
            if buf[..got].ends_with(b"\r\n\r\nok") {
                break buf.starts_with(b"HTTP/1.1 200");
            }
            if got == buf.len() {
                break false;
            }
        };
        if !ok {
            errors += 1;
            break;
        }
        let _ = hist.record(start.elapsed().as_micros().max(1) as u64);
    }
    (hist, errors)
}

/// What the load process reports of one run.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Load {
    requests: u64,
    errors: u64,
    wall_s: f64,
    p50_us: u64,
    p99_us: u64,
}

/// The load process (`--load ADDR`): connects `--connections`, says `ready`, waits for a line
/// on stdin, runs the load and prints one `Load` as JSON. A process of its own, so that each
/// side holds one end of each connection (10 000 connections need 20 000 files in one
/// process), and the server's CPU is its process's alone.
fn load(addr: SocketAddr, args: &Args) {
    raise_nofile(args.connections);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // Connect in batches: a listener's backlog would drop a storm of SYNs.
    let streams: Vec<TcpStream> = rt.block_on(async {
        let mut all = Vec::with_capacity(args.connections);
        while all.len() < args.connections {
            let batch = (args.connections - all.len()).min(256);
            let joins: Vec<_> = (0..batch)
                .map(|_| tokio::spawn(TcpStream::connect(addr)))
                .collect();
            for j in joins {
                let s = j.await.unwrap().expect("connect");
                let _ = s.set_nodelay(true);
                all.push(s);
            }
        }
        all
    });
    println!("ready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("stdin");
    let left = Arc::new(AtomicU64::new(args.requests));
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let (hist, errors) = rt.block_on(async {
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|s| tokio::spawn(client(left.clone(), until, s)))
            .collect();
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
        let mut errors = 0;
        for t in tasks {
            let (h, e) = t.await.unwrap();
            hist.add(h).unwrap();
            errors += e;
        }
        (hist, errors)
    });
    let out = Load {
        requests: hist.len(),
        errors,
        wall_s: start.elapsed().as_secs_f64(),
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
    };
    println!("{}", serde_json::to_string(&out).unwrap());
}

fn one_run(which: Which, args: &Args) -> Run {
    use std::io::{BufRead, Write};
    let sleeper = (which == Which::Delaywheel).then(|| Sleeper::new().expect("engine").leak());
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let addr = server.block_on(serve(which, sleeper.clone(), args));
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--load", &addr.to_string()])
        .args(["--connections", &args.connections.to_string()])
        .args(["--requests", &args.requests.to_string()])
        .args(["--seconds", &args.seconds.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the load process");
    let mut from = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    from.read_line(&mut line).expect("the load process");
    assert_eq!(line.trim(), "ready", "the load process did not connect");
    let cpu0 = procfs::process_cpu();
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    line.clear();
    from.read_line(&mut line)
        .expect("the load process's figures");
    let cpu = procfs::process_cpu() - cpu0;
    let status = child.wait().unwrap();
    let got: Load = serde_json::from_str(line.trim())
        .unwrap_or_else(|e| panic!("the load process ({status}) said {line:?}: {e}"));
    // Graceful shutdown: the load has closed its connections; stop the server (its connection
    // tasks end with them), then the engine.
    server.shutdown_timeout(Duration::from_secs(5));
    let pending = sleeper.map(|s| s.timer().shutdown().len());
    Run {
        timer: which.name(),
        connections: args.connections,
        requests: got.requests,
        errors: got.errors,
        requests_per_s: got.requests as f64 / got.wall_s,
        p50_us: got.p50_us,
        p99_us: got.p99_us,
        server_cpu_us_per_request: cpu.as_secs_f64() * 1e6 / got.requests.max(1) as f64,
        pending_at_engine_shutdown: pending,
    }
}

/// Heap bytes per registered hyper sleep (a connection's header-read timer), with `n` of them.
fn timer_bytes(which: Which, n: usize) -> f64 {
    use hyper::rt::Timer;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let timer: Box<dyn Timer> = match which {
            Which::Delaywheel => Box::new(HyperTimer::new(Sleeper::new().unwrap())),
            Which::Tokio => Box::new(TokioTimer::new()),
        };
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Warm up whatever the timer allocates once (wheel levels, tokio's driver state).
        let mut warm: Vec<_> = (0..1000)
            .map(|_| timer.sleep(Duration::from_secs(60)))
            .collect();
        for s in &mut warm {
            assert!(s.as_mut().poll(&mut cx).is_pending());
        }
        drop(warm);
        let before = LIVE.load(Relaxed);
        let mut sleeps = Vec::with_capacity(n);
        let vec_bytes =
            (n * std::mem::size_of::<std::pin::Pin<Box<dyn hyper::rt::Sleep>>>()) as i64;
        for i in 0..n {
            let mut s = timer.sleep(Duration::from_secs(60) + Duration::from_millis(i as u64));
            assert!(s.as_mut().poll(&mut cx).is_pending());
            sleeps.push(s);
        }
        let bytes = LIVE.load(Relaxed) - before - vec_bytes;
        drop(sleeps);
        bytes as f64 / n as f64
    })
}

fn main() {
    let mut args = Args::parse();
    if let Some(addr) = args.load {
        return load(addr, &args);
    }
    if args.smoke {
        args.connections = 50;
        args.requests = 5_000;
        args.seconds = 10;
        args.runs = 1;
    }
    let which: Vec<Which> = args
        .timer
        .iter()
        .map(|t| match t.as_str() {
            "tokio" => Which::Tokio,
            "delaywheel" => Which::Delaywheel,
            other => {
                eprintln!("--timer: unknown timer {other:?} (tokio, delaywheel)");
                std::process::exit(2);
            }
        })
        .collect();
    let nofile = raise_nofile(args.connections);
    println!(
        "http_gateway: {} keep-alive connections, {} requests or {} s per run, {} run(s) per \
         timer, RLIMIT_NOFILE {nofile}",
        args.connections, args.requests, args.seconds, args.runs
    );
    println!(
        "{:<11} {:>9} {:>7} {:>10} {:>8} {:>8} {:>14}",
        "timer", "requests", "errors", "req/s", "p50 µs", "p99 µs", "server µs/req"
    );
    let mut runs = Vec::new();
    for _ in 0..args.runs {
        for &w in &which {
            let r = one_run(w, &args);
            println!(
                "{:<11} {:>9} {:>7} {:>10.0} {:>8} {:>8} {:>14.2}",
                r.timer,
                r.requests,
                r.errors,
                r.requests_per_s,
                r.p50_us,
                r.p99_us,
                r.server_cpu_us_per_request
            );
            if let Some(p) = r.pending_at_engine_shutdown {
                println!(
                    "  shutdown: server stopped first, then the engine, with {p} timers pending"
                );
            }
            runs.push(r);
        }
    }
    let median = |w: Which, f: fn(&Run) -> f64| {
        let mut v: Vec<f64> = runs.iter().filter(|r| r.timer == w.name()).map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let ratio = match (
        median(Which::Delaywheel, |r| r.server_cpu_us_per_request),
        median(Which::Tokio, |r| r.server_cpu_us_per_request),
    ) {
        (Some(d), Some(t)) if t > 0.0 => Some(d / t),
        _ => None,
    };
    if let Some(ratio) = ratio {
        println!("server CPU per request, delaywheel / tokio (medians): {ratio:.3}");
    }
    let bytes: Vec<(&str, f64)> = which
        .iter()
        .map(|&w| (w.name(), timer_bytes(w, args.connections.max(1000))))
        .collect();
    for (name, b) in &bytes {
        println!("timer memory per connection ({name}): {b:.0} B per registered hyper sleep");
    }
    let errors: u64 = runs.iter().map(|r| r.errors).sum();
    let answered = runs.iter().all(|r| r.requests > 0);
    let clean = runs
        .iter()
        .all(|r| r.pending_at_engine_shutdown.unwrap_or(0) == 0);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "runs": runs,
                "cpu_ratio_delaywheel_over_tokio": ratio,
                "timer_bytes_per_connection": bytes.iter().map(|(n, b)| (n.to_string(), *b)).collect::<std::collections::BTreeMap<_, _>>(),
            })
        );
    }
    if errors > 0 || !answered || !clean {
        eprintln!("http_gateway: {errors} errors, every run answered: {answered}, engine empty at shutdown: {clean}");
        std::process::exit(1);
    }
}
