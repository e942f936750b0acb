//! The four calls a new user guessed and the compiler refused, in the form the API now gives
//! them, each compiled and run: `Persistent::schedule` with a `Duration`, a struct that derives
//! `Serialize` as the payload, an `async move` block as a queue handler, and `reset` on an
//! idle `Sleep`.
#![cfg(all(feature = "redis", feature = "tokio"))]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use delaywheel::redis::{
    Consumer, Envelope, Handlers, PersistConfig, Persistent, Producer, QueueConfig,
};
use delaywheel::sleep::Sleeper;
use redis_server::RedisServer;
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct CloseOrder {
    order_id: u64,
}

/// `expected u64, found Duration`: `schedule` takes a `Duration` (or a `SystemTime`, or a
/// `When`); `expected Value, found CloseOrder`: it takes `&CloseOrder`.
#[test]
fn persistent_schedule_takes_a_duration_and_a_struct() {
    let server = RedisServer::start_in_memory();
    let (engine, fired) = Persistent::start(PersistConfig::new(server.url(), "calls")).unwrap();
    let close = CloseOrder { order_id: 42 };
    engine
        .schedule("order:42", "order.close", &close, Duration::from_millis(30))
        .unwrap();
    let task = fired.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(task.payload_as::<CloseOrder>().unwrap(), close);
    assert!(engine.ack(&task));
    engine.shutdown();
}

/// `found async block`: a handler may be an `async move` block, on the application's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_move_block_is_a_queue_handler() {
    let server = RedisServer::start_in_memory();
    let cfg = QueueConfig::new(server.url(), "calls-q");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let handlers = Handlers::new()
        .runtime(tokio::runtime::Handle::current())
        .on_async("order.close", move |task: Envelope| {
            let tx = tx.clone();
            async move {
                tokio::task::yield_now().await;
                tx.send(task.payload_as::<CloseOrder>()?)?;
                Ok(())
            }
        });
    let consumer = Consumer::start_async(cfg.clone(), handlers).await.unwrap();
    let producer = Producer::connect(cfg).await.unwrap();
    producer
        .enqueue(
            "order:7",
            "order.close",
            &CloseOrder { order_id: 7 },
            Duration::ZERO,
        )
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .unwrap();
    assert_eq!(got, Some(CloseOrder { order_id: 7 }));
    consumer
        .shutdown_async(Duration::from_secs(5))
        .await
        .unwrap();
}

/// `no method named reset found for struct Sleep`: the idle timeout is one sleep, reset on
/// every read, and it fires only after the last reset.
#[tokio::test]
async fn reset_moves_an_idle_sleep() {
    let sleeper = Sleeper::new().unwrap();
    let idle = Duration::from_millis(100);
    let mut sleep = sleeper.sleep(idle);
    let start = Instant::now();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(50)).await; // a read
        sleep.reset(Instant::now() + idle);
    }
    let last = sleep.deadline();
    (&mut sleep).await.expect("the engine is running");
    assert!(Instant::now() >= last, "fired before its reset deadline");
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert!(sleep.is_elapsed());
}
