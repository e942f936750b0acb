//! Dropping the last handle shuts the engine down and leaves no thread behind. (Its own test
//! binary: it counts this process's threads.)

use std::sync::Mutex;
use std::time::Duration;

use delaywheel::Timer;

fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// The tests here count threads by name: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Waits (up to 10 s) until `n` threads are named `prefix...`; returns how many are.
fn named(prefix: &str, n: usize) -> usize {
    let start = std::time::Instant::now();
    // A new thread names itself once it runs: wait for that, not for a fixed time.
    while threads_named(prefix) != n && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    threads_named(prefix)
}

#[test]
fn dropping_the_last_handle_joins_every_thread() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (timer, rx) = Timer::builder().shards(2).build_channel(Some(1)).unwrap();
    let pool = Timer::builder()
        .build_callback(3, 8, |_e: delaywheel::Expiration<u32>| {})
        .unwrap();
    assert_eq!(named("delaywheel-dri", 2), 2);
    assert_eq!(named("delaywheel-cb", 3), 3);
    // Pending timers, a clone on another thread, and a driver blocked on a full channel.
    for i in 0..10u32 {
        timer.schedule(i, Duration::ZERO).unwrap();
        pool.schedule(i, Duration::from_secs(60)).unwrap();
    }
    let clone = timer.clone();
    std::thread::spawn(move || drop(clone)).join().unwrap();
    // The driver fills the channel, then blocks on it with the next expiration.
    let start = std::time::Instant::now();
    while !rx.is_full() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(rx.is_full(), "the driver never delivered");
    drop(timer);
    drop(pool);
    // Joined; the kernel may list an exited thread a moment longer, not 2 s (a thread left
    // blocked on the full channel would stay for good).
    let start = std::time::Instant::now();
    while threads_named("delaywheel-") > 0 && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(threads_named("delaywheel-"), 0, "threads left behind");
    // The one expiration the channel could hold was delivered; nothing more arrives.
    assert_eq!(rx.try_iter().count(), 1);
}

/// A waker run by the driver (a `Sleeper`'s delivery) that drops its task, and with it the
/// last handle of the engine: the engine stops from its own driver thread, and that thread
/// ends instead of waiting on itself.
#[cfg(feature = "futures")]
#[test]
fn a_waker_that_drops_the_last_handle_on_the_driver_stops_the_engine() {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    use delaywheel::sleep::{Sleep, Sleeper};

    type Slot = Arc<Mutex<Option<Pin<Box<Sleep>>>>>;
    struct DropOnWake(Slot);
    impl Wake for DropOnWake {
        fn wake(self: Arc<Self>) {
            let task = self.0.lock().unwrap().take();
            drop(task);
        }
    }

    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let sleeper = Sleeper::with_builder(Timer::builder().shards(1)).unwrap();
    assert_eq!(named("delaywheel-dri", 1), 1);
    let slot: Slot = Arc::new(Mutex::new(Some(Box::pin(
        sleeper.sleep(Duration::from_millis(5)),
    ))));
    drop(sleeper); // the future now holds the last handle
    let waker = Waker::from(Arc::new(DropOnWake(slot.clone())));
    {
        let mut task = slot.lock().unwrap();
        let future = task.as_mut().unwrap().as_mut();
        assert!(future.poll(&mut Context::from_waker(&waker)).is_pending());
    }
    drop(waker);
    assert_eq!(named("delaywheel-", 0), 0, "the driver thread is stuck");
    assert!(
        slot.lock().unwrap().is_none(),
        "the task was woken and dropped"
    );
}

thread_local! {
    static KEPT: std::cell::RefCell<Option<Timer<u32>>> = const { std::cell::RefCell::new(None) };
}

/// An engine kept in a thread-local is dropped among the thread's other thread-locals when
/// the thread exits, after the engine's own bookkeeping may already be gone: that drop shuts
/// it down like any other. (It used to abort the process: a panic in a thread-local's
/// destructor, reading the destroyed turn marker.)
#[test]
fn an_engine_in_a_thread_local_shuts_down_when_its_thread_exits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dropped_tx, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (timer, rx) = Timer::builder()
            .manual_driver()
            .build_channel(None)
            .unwrap();
        timer.schedule(1u32, Duration::from_secs(3_600)).unwrap();
        // Kept first, then the turn marker comes to life: destroyed in reverse order, the
        // marker goes before the engine.
        KEPT.with(|k| *k.borrow_mut() = Some(timer.clone()));
        assert_eq!(timer.fire_due(), 0);
        drop(timer);
        // Disconnects once the engine (and with it the channel's sender) is gone.
        std::thread::spawn(move || {
            while rx.recv().is_ok() {}
            let _ = dropped_tx.send(());
        });
    })
    .join()
    .expect("the thread exited cleanly");
    dropped
        .recv_timeout(Duration::from_secs(10))
        .expect("the engine was dropped with its thread");
}
