//! One way to say "when": `Persistent::schedule` and `Producer::enqueue` both take a
//! `Duration` from now, a `SystemTime`, or a `When`, and the raw epoch milliseconds stay as
//! `When::AtMs` and `Persistent::schedule_at_ms`.
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use delaywheel::redis::{
    now_ms, PersistConfig, Persistent, Producer, QueueConfig, WallClock, When,
};
use delaywheel::ManualClock;
use redis_server::RedisServer;

fn score(server: &RedisServer, key: &str, id: &str) -> u64 {
    match server.run(&["ZSCORE", key, id]) {
        redis::Value::BulkString(b) => String::from_utf8(b).unwrap().parse().unwrap(),
        other => panic!("ZSCORE {key} {id}: {other:?}"),
    }
}

/// On a manual wall clock, a `Duration` is counted from the engine's clock, a `SystemTime` and
/// `When::AtMs` are absolute, and each lands in Redis as the due time it names.
#[test]
fn persistent_schedule_takes_a_duration_a_system_time_or_epoch_ms() {
    let server = RedisServer::start_in_memory();
    let clock = ManualClock::new();
    let start = 1_800_000_000_000u64;
    let mut cfg = PersistConfig::new(server.url(), "when");
    cfg.clock = WallClock::manual(&clock, start);
    let (p, _fired) = Persistent::start(cfg).unwrap();
    p.schedule(
        "in30s",
        "t",
        serde_json::Value::Null,
        Duration::from_secs(30),
    )
    .unwrap();
    let at = UNIX_EPOCH + Duration::from_millis(start + 45_000);
    p.schedule("at", "t", serde_json::Value::Null, at).unwrap();
    p.schedule(
        "ms",
        "t",
        serde_json::Value::Null,
        When::AtMs(start + 60_000),
    )
    .unwrap();
    p.schedule_at_ms("raw", "t", serde_json::Value::Null, start + 75_000)
        .unwrap();
    // A part of a millisecond rounds up: never due early.
    p.schedule(
        "sub",
        "t",
        serde_json::Value::Null,
        Duration::from_micros(1_500),
    )
    .unwrap();
    assert!(p.flush(Duration::from_secs(30)));
    for (id, due) in [
        ("in30s", start + 30_000),
        ("at", start + 45_000),
        ("ms", start + 60_000),
        ("raw", start + 75_000),
        ("sub", start + 2),
    ] {
        assert_eq!(score(&server, "{when}:due", id), due, "{id}");
    }
    p.shutdown();
}

/// The producer takes the same forms.
#[test]
fn producer_enqueue_takes_the_same_forms() {
    let server = RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let producer = rt
        .block_on(Producer::connect(QueueConfig::new(server.url(), "whenq")))
        .unwrap();
    let before = now_ms();
    let in_an_hour = SystemTime::now() + Duration::from_secs(3_600);
    rt.block_on(async {
        producer
            .enqueue(
                "d",
                "t",
                serde_json::Value::Null,
                Duration::from_secs(3_600),
            )
            .await
            .unwrap();
        producer
            .enqueue("s", "t", serde_json::Value::Null, in_an_hour)
            .await
            .unwrap();
        producer
            .enqueue(
                "m",
                "t",
                serde_json::Value::Null,
                When::AtMs(before + 7_200_000),
            )
            .await
            .unwrap();
    });
    let d = score(&server, "{whenq}:due", "d");
    assert!(
        (before + 3_600_000..=now_ms() + 3_600_000 + 1).contains(&d),
        "{d}"
    );
    assert_eq!(
        score(&server, "{whenq}:due", "s"),
        When::from(in_an_hour).epoch_ms().unwrap()
    );
    assert_eq!(score(&server, "{whenq}:due", "m"), before + 7_200_000);
}
