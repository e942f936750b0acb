//! `HyperTimer`: a real hyper server (and a hyper client) on 127.0.0.1 with the engine as its
//! timer. Each test checks the engine's counters as well as the socket, so a timeout that came
//! from anywhere else would fail it. Every wait has a bound, so no test can hang the suite.
#![cfg(feature = "hyper")]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use delaywheel::http::HyperTimer;
use delaywheel::sleep::Sleeper;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::rt::Timer as _;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bound on any single wait of a test.
const BOUND: Duration = Duration::from_secs(10);
/// Allowed lateness of a timeout, on top of the 1 ms tick: scheduling noise on a loaded
/// 2-core machine, not the timer's.
const MARGIN: Duration = Duration::from_millis(150);

/// A server that answers every request with `ok`, each connection served by hyper with the
/// engine as its timer. Returns the address and the count of connections that have ended.
async fn serve(
    timer: HyperTimer,
    header_read: Duration,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let count = ended.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (timer, count) = (timer.clone(), count.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(timer)
                    .header_read_timeout(header_read)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                count.fetch_add(1, SeqCst);
            });
        }
    });
    (addr, ended)
}

/// Reads until the peer closes the connection; returns what it read.
async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => all.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("the server never closed the connection");
    all
}

fn within(elapsed: Duration, timeout: Duration) {
    assert!(
        elapsed >= timeout,
        "closed early: {elapsed:?} < {timeout:?}"
    );
    assert!(
        elapsed <= timeout + Duration::from_millis(1) + MARGIN,
        "closed late: {elapsed:?} for a timeout of {timeout:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_half_a_request_is_cut_off_at_the_header_read_timeout() {
    let timer = HyperTimer::new(Sleeper::new().unwrap());
    let timeout = Duration::from_millis(300);
    let (addr, _) = serve(timer.clone(), timeout).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // The server starts its timer after the accept, so no earlier than this.
    let start = Instant::now();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    let reply = read_to_close(&mut stream).await;
    within(start.elapsed(), timeout);
    assert!(
        !reply.starts_with(b"HTTP/1.1 200"),
        "answered a half request"
    );
    let stats = timer.sleeper().timer().stats();
    assert!(
        stats.scheduled >= 1 && stats.fired >= 1,
        "not the engine's timeout: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connection_idle_past_the_timeout_is_closed_and_a_busy_one_is_not() {
    let timer = HyperTimer::new(Sleeper::new().unwrap());
    let timeout = Duration::from_millis(300);
    let (addr, ended) = serve(timer.clone(), timeout).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // Three requests 200 ms apart on one connection: each restarts the wait.
    let mut last = Instant::now();
    for _ in 0..3 {
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut reply = Vec::new();
        let mut buf = [0u8; 1024];
        while !reply.ends_with(b"ok") {
            let n = tokio::time::timeout(BOUND, stream.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(
                n > 0,
                "closed while busy: {:?}",
                String::from_utf8_lossy(&reply)
            );
            reply.extend_from_slice(&buf[..n]);
        }
        assert!(
            reply.starts_with(b"HTTP/1.1 200 OK"),
            "{}",
            String::from_utf8_lossy(&reply)
        );
        last = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(ended.load(SeqCst), 0, "a busy connection was closed");
    // Now idle: closed one timeout after the last response (200 ms of it slept above). The
    // server's wait starts once it has written the response, a loopback hop before `last`.
    let rest = read_to_close(&mut stream).await;
    let idle = last.elapsed();
    within(idle + Duration::from_millis(20), timeout);
    assert!(rest.is_empty() || !rest.starts_with(b"HTTP/1.1 200"));
    assert!(timer.sleeper().timer().stats().fired >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hyper_client_with_this_timer_gets_answers_and_closes_idle_pooled_connections() {
    let server_timer = HyperTimer::new(Sleeper::new().unwrap());
    // The server would wait 30 s: a connection that ends sooner was closed by the client.
    let (addr, ended) = serve(server_timer, Duration::from_secs(30)).await;
    let timer = HyperTimer::new(Sleeper::new().unwrap());
    let idle = Duration::from_millis(200);
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_timer(timer.clone())
        .timer(timer.clone())
        .pool_idle_timeout(idle)
        .build_http::<Full<Bytes>>();
    let url: hyper::Uri = format!("http://{addr}/").parse().unwrap();
    for _ in 0..2 {
        let response = tokio::time::timeout(BOUND, client.get(url.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
    }
    assert_eq!(ended.load(SeqCst), 0, "the pooled connection was not kept");
    let start = Instant::now();
    tokio::time::timeout(BOUND, async {
        while ended.load(SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the idle pooled connection was never closed");
    // The pool checks its idle connections every `idle`, so one is closed after 1-2 of them.
    let elapsed = start.elapsed();
    assert!(elapsed <= 2 * idle + MARGIN, "closed late: {elapsed:?}");
    let stats = timer.sleeper().timer().stats();
    assert!(
        stats.fired >= 1,
        "the pool did not use the engine: {stats:?}"
    );
    // And a new request opens a new connection.
    let response = tokio::time::timeout(BOUND, client.get(url))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_engine_shutdown_a_hyper_timeout_fires_at_once() {
    let timer = HyperTimer::new(Sleeper::new().unwrap());
    let (addr, _) = serve(timer.clone(), Duration::from_secs(30)).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    // Wait until hyper has put its 30 s header-read timer in the wheel.
    tokio::time::timeout(BOUND, async {
        while timer.sleeper().timer().is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap();
    let start = Instant::now();
    drop(timer.sleeper().timer().shutdown());
    read_to_close(&mut stream).await;
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "waited for a dead engine"
    );
}

#[test]
fn reset_moves_the_same_registration_and_replaces_a_foreign_sleep() {
    let timer = HyperTimer::new(Sleeper::new().unwrap());
    let engine = timer.sleeper().timer();
    let mut cx = Context::from_waker(Waker::noop());
    let mut sleep = timer.sleep(Duration::from_secs(60));
    assert!(sleep.as_mut().poll(&mut cx).is_pending());
    for i in 1..=5 {
        timer.reset(&mut sleep, Instant::now() + Duration::from_secs(60 + i));
    }
    let stats = engine.stats();
    assert_eq!(
        (stats.scheduled, stats.reset, stats.cancelled),
        (1, 5, 0),
        "{stats:?}"
    );
    // A sleep from another timer is replaced by one of ours (registered at its first poll).
    let mut foreign: Pin<Box<dyn hyper::rt::Sleep>> = Box::pin(Foreign);
    timer.reset(&mut foreign, Instant::now() + Duration::from_secs(60));
    assert!(foreign.as_mut().poll(&mut cx).is_pending());
    assert_eq!(engine.stats().scheduled, 2);
    drop((sleep, foreign));
    assert_eq!(engine.len(), 0);
}

#[test]
fn now_reads_the_engines_clock() {
    let clock = delaywheel::ManualClock::new();
    let sleeper = Sleeper::with_builder(
        delaywheel::Timer::builder()
            .manual_clock(&clock)
            .manual_driver(),
    )
    .unwrap();
    let timer = HyperTimer::new(sleeper);
    let before = timer.now();
    clock.advance(Duration::from_secs(3600));
    assert_eq!(timer.now() - before, Duration::from_secs(3600));
}

/// A sleep from some other timer.
struct Foreign;

impl Future for Foreign {
    type Output = ();
    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        Poll::Pending
    }
}

impl hyper::rt::Sleep for Foreign {}
