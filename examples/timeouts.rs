//! Request and idle timeouts on the engine, and a `timeout` around a future.
//!
//! ```text
//! cargo run --features futures --example timeouts
//! ```

use std::time::{Duration, Instant};

use delaywheel::sleep::{Sleeper, TimeoutError};
use delaywheel::Timer;

#[derive(Debug, PartialEq)]
enum Expired {
    Request(u64),
    Idle(u32),
}

#[tokio::main]
async fn main() {
    // One engine for every timer of the process; expirations arrive on a channel.
    let (timer, expired) = Timer::builder().build_channel(Some(1_024)).expect("engine");
    // A request timeout per request: cancelled when the response comes in time.
    let fast = timer
        .schedule(Expired::Request(1), Duration::from_millis(50))
        .unwrap();
    timer
        .schedule(Expired::Request(2), Duration::from_millis(50))
        .unwrap();
    assert_eq!(timer.cancel(fast), Some(Expired::Request(1)));
    // An idle timeout per connection: reset on every read, never re-created.
    let idle = timer
        .schedule(Expired::Idle(7), Duration::from_millis(80))
        .unwrap();
    for _read in 0..3 {
        std::thread::sleep(Duration::from_millis(30));
        timer.reset(idle, Duration::from_millis(80));
    }
    let first = expired.recv().unwrap();
    let second = expired.recv().unwrap();
    println!("expired: {:?}, then {:?}", first.value, second.value);
    assert_eq!(
        (first.value, second.value),
        (Expired::Request(2), Expired::Idle(7))
    );
    timer.shutdown();

    // In async code: `timeout` and `sleep` futures backed by an engine.
    let sleeper = Sleeper::new().expect("engine");
    let slow_call = tokio::time::sleep(Duration::from_secs(5));
    let started = Instant::now();
    let result = sleeper.timeout(Duration::from_millis(100), slow_call).await;
    assert_eq!(result, Err(TimeoutError::Elapsed));
    println!("slow call timed out after {:?}", started.elapsed());
    let mut idle = sleeper.sleep(Duration::from_millis(50));
    idle.reset(Instant::now() + Duration::from_millis(60)); // a read arrived
    (&mut idle).await.expect("engine running");
    println!("connection idle: closing it");
}
