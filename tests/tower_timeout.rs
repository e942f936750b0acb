//! `TimeoutLayer`: a tower stack with the engine's timeout, checked against tower's own error
//! type, under `ServiceBuilder`, with cloned services, under load shedding, and in a real hyper
//! server on 127.0.0.1. The engine's counters show when a timer was registered and cancelled.
#![cfg(all(feature = "tower", feature = "hyper"))]

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use delaywheel::http::TimeoutLayer;
use delaywheel::sleep::{Sleeper, TimeoutError};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::oneshot;
use tower::timeout::error::Elapsed;
use tower::{service_fn, BoxError, Layer, Service, ServiceBuilder, ServiceExt};

const BOUND: Duration = Duration::from_secs(10);
const MARGIN: Duration = Duration::from_millis(150);

/// A service that answers at once for `Fast`, after the oneshot for `Wait`, and never for
/// `Never`.
enum Call {
    Fast,
    Wait(oneshot::Receiver<()>),
    Never,
}

async fn answer(call: Call) -> Result<&'static str, Infallible> {
    match call {
        Call::Fast => {}
        Call::Wait(rx) => drop(rx.await),
        Call::Never => std::future::pending().await,
    }
    Ok("answered")
}

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("a test wait passed its bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elapsed_request_fails_with_towers_own_elapsed_error_and_a_fast_one_registers_nothing() {
    let sleeper = Sleeper::new().unwrap().leak();
    let timeout = Duration::from_millis(100);
    let mut svc = ServiceBuilder::new()
        .layer(TimeoutLayer::new(sleeper.clone(), timeout))
        .service(service_fn(answer));
    for _ in 0..100 {
        let ok = bounded(svc.ready().await.unwrap().call(Call::Fast)).await;
        assert_eq!(ok.unwrap(), "answered");
    }
    assert_eq!(
        sleeper.timer().stats().scheduled,
        0,
        "a ready answer registered a timer"
    );
    let start = Instant::now();
    let err: BoxError = bounded(svc.ready().await.unwrap().call(Call::Never))
        .await
        .unwrap_err();
    let elapsed = start.elapsed();
    assert!(err.is::<Elapsed>(), "not tower's Elapsed: {err}");
    assert!(elapsed >= timeout, "early: {elapsed:?}");
    assert!(
        elapsed <= timeout + Duration::from_millis(1) + MARGIN,
        "late: {elapsed:?}"
    );
    assert_eq!(sleeper.timer().stats().fired, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timer_is_cancelled_when_the_response_comes_and_when_the_future_is_dropped() {
    let sleeper = Sleeper::new().unwrap();
    let mut svc =
        TimeoutLayer::new(sleeper.clone(), Duration::from_secs(60)).layer(service_fn(answer));
    let mut cx = Context::from_waker(Waker::noop());

    let (tx, rx) = oneshot::channel();
    let mut response = pin!(svc.call(Call::Wait(rx)));
    assert!(response.as_mut().poll(&mut cx).is_pending());
    assert_eq!(sleeper.timer().len(), 1, "pending, so registered");
    tx.send(()).unwrap();
    let answered = bounded(std::future::poll_fn(|cx| response.as_mut().poll(cx))).await;
    assert_eq!(answered.unwrap(), "answered");
    // Cancelled by the response, while the response future is still alive.
    assert_eq!(sleeper.timer().len(), 0);
    assert_eq!(sleeper.timer().stats().cancelled, 1);

    let mut dropped = Box::pin(svc.call(Call::Never));
    assert!(dropped.as_mut().poll(&mut cx).is_pending());
    assert_eq!(sleeper.timer().len(), 1);
    drop(dropped);
    assert_eq!(sleeper.timer().len(), 0);
    assert_eq!(sleeper.timer().stats().cancelled, 2);
    assert_eq!(sleeper.timer().stats().fired, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloned_services_share_the_engine_and_time_out_independently() {
    let sleeper = Sleeper::new().unwrap();
    let svc = ServiceBuilder::new()
        .layer(TimeoutLayer::new(
            sleeper.clone(),
            Duration::from_millis(50),
        ))
        .service(service_fn(answer));
    let mut tasks = Vec::new();
    for i in 0..20 {
        let mut clone = svc.clone();
        tasks.push(tokio::spawn(async move {
            let call = if i % 2 == 0 { Call::Fast } else { Call::Never };
            clone.ready().await.unwrap().call(call).await
        }));
    }
    let mut elapsed = 0;
    for (i, task) in tasks.into_iter().enumerate() {
        match bounded(task).await.unwrap() {
            Ok(answer) => assert!(i % 2 == 0, "call {i} answered: {answer}"),
            Err(e) => {
                assert!(i % 2 == 1 && e.is::<Elapsed>(), "call {i}: {e}");
                elapsed += 1;
            }
        }
    }
    assert_eq!(elapsed, 10);
    assert_eq!(sleeper.timer().stats().fired, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_shedding_a_busy_service_is_overloaded_at_once_and_frees_its_slot_on_timeout() {
    let sleeper = Sleeper::new().unwrap();
    let timeout = Duration::from_millis(100);
    let mut svc = ServiceBuilder::new()
        .load_shed()
        .layer(TimeoutLayer::new(sleeper.clone(), timeout))
        .concurrency_limit(1)
        .service(service_fn(answer));
    // The one slot is taken by a call that never answers.
    let stuck = svc.ready().await.unwrap().call(Call::Never);
    let held = tokio::spawn(stuck);
    tokio::task::yield_now().await;
    // Shed at once: poll_ready of the timeout is the limit's, which is not ready.
    let start = Instant::now();
    let shed = bounded(svc.ready().await.unwrap().call(Call::Fast))
        .await
        .unwrap_err();
    assert!(shed.is::<tower::load_shed::error::Overloaded>(), "{shed}");
    assert!(start.elapsed() < timeout, "waited instead of shedding");
    // The stuck call times out, which frees the slot.
    let timed_out = bounded(held).await.unwrap().unwrap_err();
    assert!(timed_out.is::<Elapsed>(), "{timed_out}");
    let ok = bounded(svc.ready().await.unwrap().call(Call::Fast))
        .await
        .unwrap();
    assert_eq!(ok, "answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_engine_shutdown_a_waiting_request_fails_with_shutdown_not_without_a_timeout() {
    let sleeper = Sleeper::new().unwrap();
    let mut svc =
        TimeoutLayer::new(sleeper.clone(), Duration::from_secs(60)).layer(service_fn(answer));
    drop(sleeper.timer().shutdown());
    // A ready answer is still given.
    assert_eq!(bounded(svc.call(Call::Fast)).await.unwrap(), "answered");
    let err = bounded(svc.call(Call::Never)).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<TimeoutError>(),
        Some(&TimeoutError::Shutdown),
        "{err}"
    );
}

/// The layer in a real server: hyper on 127.0.0.1 serving a tower stack, whose slow path is
/// answered 504 when the layer's timeout elapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_hyper_server_a_slow_request_is_answered_504_at_the_timeout() {
    let sleeper = Sleeper::new().unwrap().leak();
    let timeout = Duration::from_millis(100);
    let stack = ServiceBuilder::new()
        .layer(TimeoutLayer::new(sleeper.clone(), timeout))
        .service(service_fn(|req: Request<Incoming>| async move {
            if req.uri().path() == "/slow" {
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
    // Map the layer's errors to responses, as a gateway does.
    let app = service_fn(move |req: Request<Incoming>| {
        let stack = stack.clone();
        async move {
            Ok::<_, Infallible>(match stack.oneshot(req).await {
                Ok(response) => response,
                Err(e) if e.is::<Elapsed>() => {
                    let mut r = Response::new(Full::new(Bytes::from_static(b"timed out")));
                    *r.status_mut() = StatusCode::GATEWAY_TIMEOUT;
                    r
                }
                Err(e) => panic!("unexpected error: {e}"),
            })
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let app = app.clone();
            tokio::spawn(async move {
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let fast = bounded(client.get(format!("http://{addr}/").parse().unwrap()))
        .await
        .unwrap();
    assert_eq!(fast.status(), StatusCode::OK);
    assert_eq!(
        &fast.into_body().collect().await.unwrap().to_bytes()[..],
        b"ok"
    );
    let start = Instant::now();
    let slow = bounded(client.get(format!("http://{addr}/slow").parse().unwrap()))
        .await
        .unwrap();
    let elapsed = start.elapsed();
    assert_eq!(slow.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(
        elapsed >= timeout && elapsed <= timeout + Duration::from_millis(1) + MARGIN,
        "{elapsed:?}"
    );
    assert_eq!(sleeper.timer().stats().fired, 1);
}
