//! Dropping the last handle shuts the engine down and leaves no thread behind. (Its own test
//! binary: it counts this process's threads.)

use std::time::Duration;

use delaywheel::Timer;

fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

#[test]
fn dropping_the_last_handle_joins_every_thread() {
    let (timer, rx) = Timer::builder().shards(2).build_channel(Some(1)).unwrap();
    let pool = Timer::builder()
        .build_callback(3, 8, |_e: delaywheel::Expiration<u32>| {})
        .unwrap();
    // A new thread names itself once it runs: wait for that, not for a fixed time.
    let named = |prefix: &str, n: usize| {
        let start = std::time::Instant::now();
        while threads_named(prefix) != n && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        threads_named(prefix)
    };
    assert_eq!(named("delaywheel-dri", 2), 2);
    assert_eq!(named("delaywheel-cb", 3), 3);
    // Pending timers, a clone on another thread, and a driver blocked on a full channel.
    for i in 0..10u32 {
        timer.schedule(i, Duration::ZERO).unwrap();
        pool.schedule(i, Duration::from_secs(60)).unwrap();
    }
    let clone = timer.clone();
    std::thread::spawn(move || drop(clone)).join().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    drop(timer);
    drop(pool);
    assert_eq!(threads_named("delaywheel-"), 0, "threads left behind");
    // The one expiration the channel could hold was delivered; nothing more arrives.
    assert_eq!(rx.try_iter().count(), 1);
}
