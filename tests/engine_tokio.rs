//! The `tokio` feature: the expiration stream, `sleep` and `timeout`, with cancel-on-drop.
#![cfg(feature = "tokio")]

use std::time::{Duration, Instant};

use delaywheel::sleep::{EngineShutdown, Sleeper, TimeoutError};
use delaywheel::Timer;
use futures_util::StreamExt;

const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn stream_yields_expirations_in_deadline_order_then_ends() {
    let (timer, mut stream) = Timer::builder().shards(2).build_stream(16).unwrap();
    timer.schedule(3u32, 30 * MS).unwrap();
    timer.schedule(1u32, 10 * MS).unwrap();
    timer.schedule(2u32, 20 * MS).unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        let e = stream.next().await.unwrap();
        assert!(
            e.deadline <= Instant::now(),
            "delivered before its deadline"
        );
        got.push(e.value);
    }
    assert_eq!(got, vec![1, 2, 3]);
    assert!(timer.shutdown().is_empty());
    assert!(
        stream.next().await.is_none(),
        "the stream ends after shutdown"
    );
}

#[tokio::test]
async fn sleep_never_completes_early() {
    let sleeper = Sleeper::new().unwrap();
    for delay in [MS, 3 * MS, 7 * MS] {
        let start = Instant::now();
        sleeper.sleep(delay).await.unwrap();
        assert!(start.elapsed() >= delay);
    }
}

#[tokio::test]
async fn timeout_returns_the_output_or_elapsed() {
    let sleeper = Sleeper::new().unwrap();
    assert_eq!(
        sleeper.timeout(Duration::from_secs(60), async { 7 }).await,
        Ok(7)
    );
    let never = std::future::pending::<u8>();
    assert_eq!(
        sleeper.timeout(2 * MS, never).await,
        Err(TimeoutError::Elapsed)
    );
    // The completed timeout's timer was cancelled, not left in the wheel for 60 s.
    assert_eq!(sleeper.timer().len(), 0);
}

#[tokio::test]
async fn dropping_a_sleep_cancels_its_timer() {
    let sleeper = Sleeper::new().unwrap();
    let sleeps: Vec<_> = (0..100)
        .map(|_| sleeper.sleep(Duration::from_secs(3600)))
        .collect();
    assert_eq!(sleeper.timer().len(), 100);
    drop(sleeps);
    assert_eq!(sleeper.timer().len(), 0);
    assert_eq!(sleeper.timer().stats().cancelled, 100);
}

#[tokio::test]
async fn shutdown_wakes_pending_sleeps_with_an_error() {
    let sleeper = Sleeper::new().unwrap();
    let s = sleeper.clone();
    let waiter = tokio::spawn(async move { s.sleep(Duration::from_secs(3600)).await });
    tokio::time::sleep(5 * MS).await;
    drop(sleeper.timer().shutdown());
    assert_eq!(waiter.await.unwrap(), Err(EngineShutdown));
    assert_eq!(sleeper.sleep(MS).await, Err(EngineShutdown));
    let never = std::future::pending::<()>();
    assert_eq!(
        sleeper.timeout(MS, never).await,
        Err(TimeoutError::Shutdown)
    );
}

/// The usual end of a timeout: the work finished first and the `Sleep` is dropped unfired. Its
/// timer is cancelled, and the task dropping it is not woken for nothing.
#[test]
fn dropping_a_pending_sleep_cancels_without_waking_its_task() {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }
    let sleeper = Sleeper::new().unwrap();
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(count.clone());
    let mut sleep = Box::pin(sleeper.sleep(Duration::from_secs(60)));
    assert!(sleep
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    assert_eq!(sleeper.timer().len(), 1);
    drop(sleep);
    assert_eq!(sleeper.timer().len(), 0, "cancelled");
    assert_eq!(count.0.load(SeqCst), 0, "woken for nothing");
}

/// A waker that panics when the driver wakes it is contained: the driver carries on and wakes
/// the next sleep.
#[test]
fn a_panicking_waker_does_not_stop_the_driver() {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }
    let sleeper = Sleeper::new().unwrap();
    let mut first = Box::pin(sleeper.sleep(2 * MS));
    let mut second = Box::pin(sleeper.sleep(20 * MS));
    let panics = Waker::from(Arc::new(Panics));
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let counts = Waker::from(count.clone());
    assert!(first
        .as_mut()
        .poll(&mut Context::from_waker(&panics))
        .is_pending());
    assert!(second
        .as_mut()
        .poll(&mut Context::from_waker(&counts))
        .is_pending());
    let start = Instant::now();
    while count.0.load(SeqCst) == 0 && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(MS);
    }
    assert_eq!(
        count.0.load(SeqCst),
        1,
        "the driver died with the first waker"
    );
}
