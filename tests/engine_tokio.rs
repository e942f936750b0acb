//! The `tokio` feature: the expiration stream, `sleep` and `timeout`, with cancel-on-drop.
#![cfg(feature = "futures")]

use std::future::Future;
use std::time::{Duration, Instant};

use delaywheel::sleep::{EngineShutdown, Sleeper, TimeoutError};
use delaywheel::{ManualClock, Timer};
use futures_util::StreamExt;

const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn stream_yields_expirations_in_deadline_order_then_ends() {
    // A manual clock, advanced once all three are scheduled: on the real clock a stall of
    // 30 ms between two schedules would let the first fire before the others exist.
    let clock = ManualClock::new();
    let (timer, mut stream) = Timer::builder()
        .shards(2)
        .manual_clock(&clock)
        .build_stream(16)
        .unwrap();
    let base = clock.now();
    timer.schedule_at(3u32, base + 30 * MS).unwrap();
    timer.schedule_at(2u32, base + 20 * MS).unwrap();
    // From another thread, so into the other shard: the turn that collects 1 and 2 takes them
    // from two shards, the one holding the later first, and must deliver them merged.
    let t = timer.clone();
    std::thread::spawn(move || t.schedule_at(1u32, base + 10 * MS).unwrap())
        .join()
        .unwrap();
    let mut per_shard = timer.stats().pending_per_shard;
    per_shard.sort_unstable();
    assert_eq!(per_shard, [1, 2], "not spread over both shards");
    let mut got = Vec::new();
    for step in [29 * MS, MS] {
        clock.advance(step);
        // Two come due at 29 ms, the third only at 30.
        let n = if got.is_empty() { 2 } else { 1 };
        for _ in 0..n {
            let e = stream.next().await.unwrap();
            assert!(e.deadline <= clock.now(), "delivered before its deadline");
            got.push(e.value);
        }
        assert_eq!(timer.len(), 3 - got.len(), "the third fired early");
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
    let mut sleeps: Vec<_> = (0..100)
        .map(|_| sleeper.sleep(Duration::from_secs(3600)))
        .collect();
    // Registered at the first poll, not at creation.
    assert_eq!(sleeper.timer().len(), 0);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    for sleep in &mut sleeps {
        assert!(std::pin::Pin::new(sleep).poll(&mut cx).is_pending());
    }
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
    // Scheduled before the shutdown, so it is the shutdown that ends it (a sleep created after
    // it is refused with the same error).
    while sleeper.timer().is_empty() {
        tokio::time::sleep(MS).await;
    }
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

/// A stream dropped while its task waits on it lets go of that task's waker: nothing would
/// ever wake it again (sends to a dropped stream fail), and a waker can own anything, even a
/// handle of the engine itself, which would then never shut down on its own.
#[test]
fn a_dropped_stream_lets_go_of_its_waker() {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use futures_util::Stream;

    struct Idle;
    impl Wake for Idle {
        fn wake(self: Arc<Self>) {}
    }
    let (timer, mut stream) = Timer::<u32>::builder().build_stream(4).unwrap();
    let idle = Arc::new(Idle);
    let waker = Waker::from(idle.clone());
    assert!(matches!(
        Pin::new(&mut stream).poll_next(&mut Context::from_waker(&waker)),
        Poll::Pending
    ));
    drop(waker);
    assert_eq!(Arc::strong_count(&idle), 2, "the stream holds the waker");
    drop(stream);
    assert_eq!(
        Arc::strong_count(&idle),
        1,
        "the dropped stream kept its waker"
    );
    // The engine still works, and hands back what it could not deliver.
    timer.schedule(7, Duration::ZERO).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while timer.stats().undelivered == 0 {
        assert!(
            Instant::now() < deadline,
            "the expiration was not handed over"
        );
        std::thread::sleep(MS);
    }
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
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
    // The first did fire (its waker panicked), rather than never firing at all.
    assert_eq!(
        first.as_mut().poll(&mut Context::from_waker(Waker::noop())),
        std::task::Poll::Ready(Ok(()))
    );
}

/// Wakers that panic when a shutdown wakes them (a pending sleep's, as the handed-back timers
/// are dropped; the stream's, as it closes) are contained: the panic does not escape the
/// library's shutdown or drop. (It escaped both; in a drop during unwinding, that aborts.)
#[test]
fn a_waker_that_panics_at_shutdown_is_contained() {
    use std::future::Future;
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }
    let panics = Waker::from(Arc::new(Panics));
    let sleeper = Sleeper::new().unwrap();
    let mut sleep = Box::pin(sleeper.sleep(Duration::from_secs(3_600)));
    assert!(sleep
        .as_mut()
        .poll(&mut Context::from_waker(&panics))
        .is_pending());
    let pending = sleeper.timer().shutdown();
    assert_eq!(pending.len(), 1);
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(pending)));
    assert!(dropped.is_ok(), "a sleep's waker panicked out of the drop");

    let (timer, mut stream) = Timer::builder().build_stream(4).unwrap();
    timer.schedule(0u32, Duration::from_secs(3_600)).unwrap();
    assert!(Box::pin(stream.next())
        .as_mut()
        .poll(&mut Context::from_waker(&panics))
        .is_pending());
    let shut =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || timer.shutdown().len()));
    assert_eq!(
        shut.ok(),
        Some(1),
        "the stream's waker panicked out of shutdown"
    );
}

/// A waker that shuts its engine down when woken, keeping what `shutdown` hands back.
struct ShutdownOnWake {
    timer: parking_lot::Mutex<Option<Timer<&'static str>>>,
    returned: parking_lot::Mutex<Vec<&'static str>>,
}

impl std::task::Wake for ShutdownOnWake {
    fn wake(self: std::sync::Arc<Self>) {
        if let Some(timer) = self.timer.lock().take() {
            let back = timer.shutdown();
            self.returned
                .lock()
                .extend(back.into_iter().map(|p| p.value));
        }
    }
}

/// Three timers due at once into a stream that holds one, whose waker shuts the engine down
/// from inside the turn delivering them. The turn is a caller's `fire_due` (manual driver) or
/// the driver thread's. Neither hangs, and every timer ends exactly once: read from the stream,
/// or handed back by one `shutdown` or the other.
fn shutdown_from_a_stream_waker(manual_driver: bool) {
    use std::sync::Arc;
    use std::task::{Context, Waker};

    let clock = delaywheel::ManualClock::new();
    let mut builder = Timer::builder().manual_clock(&clock);
    if manual_driver {
        builder = builder.manual_driver();
    }
    let (timer, mut stream) = builder.build_stream(1).unwrap();
    for name in ["a", "b", "c"] {
        timer.schedule(name, 10 * MS).unwrap();
    }
    let wake = Arc::new(ShutdownOnWake {
        timer: parking_lot::Mutex::new(Some(timer.clone())),
        returned: parking_lot::Mutex::new(Vec::new()),
    });
    let waker = Waker::from(wake.clone());
    let mut cx = Context::from_waker(&waker);
    assert!(stream.poll_next_unpin(&mut cx).is_pending());
    clock.advance(10 * MS);
    if manual_driver {
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let turn = timer.clone();
        std::thread::spawn(move || done_tx.send(turn.fire_due()).unwrap());
        assert_eq!(
            done_rx.recv_timeout(Duration::from_secs(10)),
            Ok(3),
            "fire_due hung: the waker's shutdown waited for the turn it was called from"
        );
    } else {
        let start = Instant::now();
        while wake.timer.lock().is_some() {
            assert!(start.elapsed() < Duration::from_secs(10), "never woken");
            std::thread::sleep(MS);
        }
    }
    let mut ended: Vec<&str> = timer.shutdown().into_iter().map(|p| p.value).collect();
    ended.extend(wake.returned.lock().iter().copied());
    while let std::task::Poll::Ready(Some(e)) = stream.poll_next_unpin(&mut cx) {
        ended.push(e.value);
    }
    ended.sort_unstable();
    assert_eq!(ended, ["a", "b", "c"], "each timer ends exactly once");
    // The stream ends: the engine is shut down and everything delivered was read.
    assert!(matches!(
        stream.poll_next_unpin(&mut cx),
        std::task::Poll::Ready(None)
    ));
}

#[test]
fn shutdown_from_a_stream_waker_inside_fire_due() {
    shutdown_from_a_stream_waker(true);
}

#[test]
fn shutdown_from_a_stream_waker_on_the_driver_thread() {
    shutdown_from_a_stream_waker(false);
}

/// Turns of two engines nest: A's waker drives B (`fire_due`), and B's waker calls back into
/// A, whose turn is still delivering further out. Neither hangs.
#[test]
fn nested_turns_of_two_engines_do_not_hang() {
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    type Engine = Timer<&'static str>;
    struct Call(Box<dyn Fn() + Send + Sync>);
    impl Wake for Call {
        fn wake(self: Arc<Self>) {
            (self.0)()
        }
    }
    let clock = delaywheel::ManualClock::new();
    let build = || {
        Timer::builder()
            .manual_clock(&clock)
            .manual_driver()
            .build_stream(4)
            .unwrap()
    };
    let ((a, mut a_stream), (b, mut b_stream)) = (build(), build());
    a.schedule("a", 10 * MS).unwrap();
    b.schedule("b", 10 * MS).unwrap();
    let (calls_tx, calls) = crossbeam_channel::unbounded::<(&str, usize)>();
    let wake_a = {
        let (b, tx): (Engine, _) = (b.clone(), calls_tx.clone());
        Waker::from(Arc::new(Call(Box::new(move || {
            tx.send(("b.fire_due", b.fire_due())).unwrap();
        }))))
    };
    let wake_b = {
        let (a, tx): (Engine, _) = (a.clone(), calls_tx);
        Waker::from(Arc::new(Call(Box::new(move || {
            tx.send(("a.fire_due", a.fire_due())).unwrap();
            tx.send(("a.shutdown", a.shutdown().len())).unwrap();
        }))))
    };
    assert!(a_stream
        .poll_next_unpin(&mut Context::from_waker(&wake_a))
        .is_pending());
    assert!(b_stream
        .poll_next_unpin(&mut Context::from_waker(&wake_b))
        .is_pending());
    clock.advance(10 * MS);
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let outer = a.clone();
    std::thread::spawn(move || done_tx.send(outer.fire_due()).unwrap());
    assert_eq!(
        done_rx.recv_timeout(Duration::from_secs(10)),
        Ok(1),
        "a turn of A, nested inside itself through B, hung"
    );
    let calls: Vec<_> = calls.try_iter().collect();
    // A's turn is still delivering: A answers 0 and hands back nothing (its timer was
    // collected); B fired its own timer.
    assert_eq!(
        calls,
        [("a.fire_due", 0), ("a.shutdown", 0), ("b.fire_due", 1)]
    );
    assert!(a.schedule("late", MS).is_err(), "A is shut down");
    drop(b.shutdown());
}
