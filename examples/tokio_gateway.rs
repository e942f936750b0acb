//! A tokio gateway's two timeouts on the engine, as a new user writes them: a request
//! timeout around each request's handling (`Sleeper::timeout`), and an idle timeout per
//! connection, one `Sleep` reset on every request (`Sleep::reset`).
//!
//! A line-based TCP server on 127.0.0.1: each line `work <ms>` is a request that takes `<ms>`
//! to serve; the reply is `ok` or `timeout`. A connection with no request for `--idle-ms` is
//! closed. Three clients then check both timeouts: one sends quick requests and goes quiet
//! (closed after the idle timeout, not before), one sends a request slower than the request
//! timeout (answered `timeout`), and one stays busy past the idle timeout (never closed while
//! busy).
//!
//! ```text
//! cargo run --features futures --example tokio_gateway
//! cargo run --features futures --example tokio_gateway -- --smoke --json   # make test
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::sleep::{Sleeper, TimeoutError};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser, Debug)]
#[command(about = "A tokio gateway's request and idle timeouts on delaywheel")]
struct Args {
    /// Request timeout, in ms.
    #[arg(long, default_value_t = 200)]
    request_ms: u64,
    /// Idle timeout of a connection, in ms.
    #[arg(long, default_value_t = 500)]
    idle_ms: u64,
    /// The same checks, quicker (make test).
    #[arg(long)]
    smoke: bool,
    /// The figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

/// One connection: requests under a request timeout, and one idle sleep reset by each.
async fn serve(stream: TcpStream, sleeper: Sleeper, request: Duration, idle: Duration) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut idle_sleep = sleeper.sleep(idle);
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let Ok(Some(line)) = line else { return };
                // Activity: the same sleep, moved in the wheel (no new timer).
                idle_sleep.reset(Instant::now() + idle);
                let ms: u64 = line.strip_prefix("work ").and_then(|n| n.parse().ok()).unwrap_or(0);
                let work = tokio::time::sleep(Duration::from_millis(ms));
                let reply = match sleeper.timeout(request, work).await {
                    Ok(()) => "ok\n",
                    Err(TimeoutError::Elapsed) => "timeout\n",
                    Err(_) => return, // the engine shut down
                };
                if write.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                // The reply is activity too.
                idle_sleep.reset(Instant::now() + idle);
            }
            _ = &mut idle_sleep => {
                let _ = write.write_all(b"idle\n").await;
                return;
            }
        }
    }
}

/// A client: sends each `(ms, pause)` request, then waits for the server to close; returns
/// the replies and how long after its last reply the connection closed.
async fn client(addr: std::net::SocketAddr, requests: Vec<(u64, u64)>) -> (Vec<String>, Duration) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut replies = Vec::new();
    for (ms, pause) in requests {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        write
            .write_all(format!("work {ms}\n").as_bytes())
            .await
            .expect("send");
        replies.push(lines.next_line().await.expect("read").expect("a reply"));
    }
    let quiet = Instant::now();
    while let Ok(Some(line)) = lines.next_line().await {
        replies.push(line);
    }
    (replies, quiet.elapsed())
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (request, idle) = if args.smoke {
        (Duration::from_millis(100), Duration::from_millis(300))
    } else {
        (
            Duration::from_millis(args.request_ms),
            Duration::from_millis(args.idle_ms),
        )
    };
    let sleeper = Sleeper::new().expect("engine");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let server = {
        let sleeper = sleeper.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve(stream, sleeper.clone(), request, idle));
            }
        })
    };
    let quick = request.as_millis() as u64 / 10;
    let slow = request.as_millis() as u64 * 3;
    // Busy: a request every idle/3, for about twice the idle timeout.
    let steps = 6;
    let busy_plan: Vec<(u64, u64)> = (0..steps)
        .map(|_| (quick, idle.as_millis() as u64 / 3))
        .collect();
    let started = Instant::now();
    let (quiet, slowpoke, busy) = tokio::join!(
        client(addr, vec![(quick, 0), (quick, 20), (quick, 20)]),
        client(addr, vec![(slow, 0)]),
        client(addr, busy_plan),
    );
    let elapsed = started.elapsed();
    server.abort();

    let ok = |r: &[String]| r.iter().filter(|l| *l == "ok").count();
    let checks = [
        ("quick requests answered", ok(&quiet.0) == 3),
        (
            "a quiet connection is closed as idle",
            quiet.0.last().map(String::as_str) == Some("idle"),
        ),
        ("not before the idle timeout", quiet.1 >= idle),
        (
            "a slow request times out",
            slowpoke.0.first().map(String::as_str) == Some("timeout"),
        ),
        (
            "a busy connection is never closed while busy",
            ok(&busy.0) == steps,
        ),
        (
            "and is closed once it goes quiet",
            busy.0.last().map(String::as_str) == Some("idle"),
        ),
    ];
    println!(
        "tokio gateway: request timeout {request:?}, idle timeout {idle:?}, ran {elapsed:.2?}"
    );
    for (what, passed) in checks {
        println!("  {:<48} {}", what, if passed { "yes" } else { "NO" });
    }
    println!(
        "  quiet connection closed {:.0?} after its last reply (idle timeout {idle:?})",
        quiet.1
    );
    let failed = checks.iter().filter(|(_, p)| !p).count();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "request_timeout_ms": request.as_millis() as u64,
                "idle_timeout_ms": idle.as_millis() as u64,
                "idle_closed_after_ms": quiet.1.as_secs_f64() * 1e3,
                "requests_ok": ok(&quiet.0) + ok(&busy.0),
                "requests_timed_out": slowpoke.0.iter().filter(|l| *l == "timeout").count(),
                "failed_checks": failed,
            })
        );
    }
    sleeper.timer().shutdown();
    if failed > 0 {
        std::process::exit(1);
    }
}
