//! The Redis store against a real, private `redis-server` (see `tests/support/redis_server.rs`).
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use delaywheel::redis::{
    BrokenReason, Cursor, Envelope, EnvelopeError, KeyLayout, NamespaceError, Op, RedisStore,
    MAX_DUE_MS,
};
use redis_server::RedisServer;

fn envelope(id: &str, due_at: u64) -> Envelope {
    Envelope {
        id: id.to_string(),
        topic: "order.close.timeout".into(),
        payload: serde_json::json!({ "order": id }),
        attempt: 0,
        created_at: 1_700_000_000_000,
        headers: Default::default(),
        due_at,
    }
}

fn upsert(e: &Envelope) -> Op {
    Op::Upsert {
        id: e.id.clone(),
        due_at: e.due_at,
        envelope: e.encode(4096).unwrap(),
    }
}

async fn all(store: &RedisStore) -> (Vec<Envelope>, Vec<delaywheel::redis::Broken>) {
    let (mut tasks, mut broken, mut cursor) = (Vec::new(), Vec::new(), Cursor::start());
    loop {
        let page = store.page(cursor, 100).await.unwrap();
        tasks.extend(page.tasks);
        broken.extend(page.broken);
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    tasks.sort_by(|a, b| a.id.cmp(&b.id));
    tasks.dedup_by(|a, b| a.id == b.id);
    (tasks, broken)
}

async fn connect(server: &RedisServer, ns: &str) -> RedisStore {
    RedisStore::connect(&server.url(), KeyLayout::new(ns).unwrap())
        .await
        .unwrap()
}

/// Stores tasks `k000`, `k001`, ... due at 0, 1, ... and returns them, sorted by id.
async fn stored(store: &RedisStore, n: u64) -> Vec<Envelope> {
    let tasks: Vec<Envelope> = (0..n).map(|i| envelope(&format!("k{i:03}"), i)).collect();
    store
        .apply(&tasks.iter().map(upsert).collect::<Vec<_>>())
        .await
        .unwrap();
    tasks
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[test]
fn namespaces_and_envelopes_refuse_bad_input() {
    assert_eq!(
        KeyLayout::new("").unwrap_err(),
        NamespaceError(String::new())
    );
    assert!(KeyLayout::new("a{b").is_err());
    let keys = KeyLayout::new("orders").unwrap();
    assert_eq!(
        (keys.due(), keys.tasks(), keys.dead()),
        ("{orders}:due", "{orders}:tasks", "{orders}:dead")
    );
    assert_eq!(envelope("", 1).encode(4096), Err(EnvelopeError::EmptyId));
    assert_eq!(
        envelope("x", MAX_DUE_MS + 1).encode(4096),
        Err(EnvelopeError::DueTooLate(MAX_DUE_MS + 1))
    );
    assert!(matches!(
        envelope("x", 1).encode(10),
        Err(EnvelopeError::TooLarge { limit: 10, .. })
    ));
    let e = envelope("x", 5);
    assert_eq!(Envelope::decode(&e.encode(4096).unwrap()).unwrap(), e);
}

#[tokio::test]
async fn apply_writes_both_keys_and_the_last_op_per_id_wins() {
    let server = RedisServer::start();
    let store = connect(&server, "t1").await;
    let (a, b, c) = (envelope("a", 10), envelope("b", 20), envelope("c", 30));
    store
        .apply(&[
            upsert(&a),
            upsert(&b),
            Op::Remove("b".into()), // scheduled then cancelled in one batch: gone
            Op::Remove("c".into()),
            upsert(&c), // cancelled then scheduled again: present
        ])
        .await
        .unwrap();
    let (tasks, broken) = all(&store).await;
    assert!(broken.is_empty());
    assert_eq!(tasks, vec![a, c]);
    let mut conn = raw(&server.url()).await;
    let zcard: usize = redis::cmd("ZCARD")
        .arg("{t1}:due")
        .query_async(&mut conn)
        .await
        .unwrap();
    let hlen: usize = redis::cmd("HLEN")
        .arg("{t1}:tasks")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!((zcard, hlen), (2, 2));
}

#[tokio::test]
async fn paging_reads_every_entry_in_small_replies() {
    let server = RedisServer::start();
    let store = connect(&server, "t2").await;
    let tasks: Vec<Envelope> = (0..10_000u64)
        .map(|i| envelope(&format!("order:{i:05}"), 1_000 + i))
        .collect();
    for chunk in tasks.chunks(1_000) {
        store
            .apply(&chunk.iter().map(upsert).collect::<Vec<_>>())
            .await
            .unwrap();
    }
    let first = store.page(Cursor::start(), 100).await.unwrap();
    assert!(
        first.next.is_some() && first.tasks.len() < 1_000,
        "one page is not the whole set"
    );
    let (read, broken) = all(&store).await;
    assert!(broken.is_empty());
    assert_eq!(read, tasks);
    // Larger pages (several read ahead, two in flight) come back whole too, each envelope
    // with its own row.
    let (mut cursor, mut seen) = (Cursor::start(), std::collections::BTreeSet::new());
    loop {
        let page = store.page(cursor, 4_000).await.unwrap();
        assert!(page.broken.is_empty());
        seen.extend(page.tasks.into_iter().map(|t| t.id));
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    assert_eq!(seen, tasks.iter().map(|t| t.id.clone()).collect());
    // A scan given up after its first page and begun again reads everything again.
    let first = store.page(Cursor::start(), 1_000).await.unwrap();
    assert!(first.next.is_some());
    let (read_again, _) = all(&store).await;
    assert_eq!(read_again, tasks);
}

#[tokio::test]
async fn broken_entries_are_sorted_out_and_dead_lettered() {
    let server = RedisServer::start();
    let store = connect(&server, "t3").await;
    store.apply(&[upsert(&envelope("good", 42))]).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let _: () = redis::pipe()
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(50)
        .arg("no-envelope")
        .ignore()
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(60)
        .arg("garbage")
        .ignore()
        .cmd("HSET")
        .arg("{t3}:tasks")
        .arg("garbage")
        .arg("{not json")
        .ignore()
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(1.5)
        .arg("fractional")
        .ignore()
        .cmd("HSET")
        .arg("{t3}:tasks")
        .arg("fractional")
        .arg(envelope("fractional", 1).encode(4096).unwrap())
        .ignore()
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(-5)
        .arg("negative")
        .ignore()
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(70)
        .arg("stray")
        .ignore()
        .cmd("HSET")
        .arg("{t3}:tasks")
        .arg("stray")
        .arg(envelope("good", 70).encode(4096).unwrap())
        .ignore()
        // An empty id, which `schedule` refuses: written by another client.
        .cmd("ZADD")
        .arg("{t3}:due")
        .arg(75)
        .arg("")
        .ignore()
        .cmd("HSET")
        .arg("{t3}:tasks")
        .arg("")
        .arg(r#"{"id":"","topic":"t","payload":null,"attempt":0,"created_at":0,"due_at":75}"#)
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    let (tasks, mut broken) = all(&store).await;
    assert_eq!(tasks, vec![envelope("good", 42)]);
    broken.sort_by(|a, b| a.id.cmp(&b.id));
    let reasons: Vec<(&str, bool)> = broken
        .iter()
        .map(|b| {
            let ok = match (b.id.as_str(), &b.reason) {
                ("no-envelope", BrokenReason::MissingEnvelope) => true,
                ("garbage", BrokenReason::Undecodable(_)) => {
                    b.raw.as_deref() == Some(b"{not json".as_slice())
                }
                ("fractional" | "negative", BrokenReason::BadScore(_)) => true,
                ("stray", BrokenReason::IdMismatch(other)) => other == "good",
                ("", BrokenReason::EmptyId) => true,
                _ => false,
            };
            (b.id.as_str(), ok)
        })
        .collect();
    assert_eq!(
        reasons,
        vec![
            ("", true),
            ("fractional", true),
            ("garbage", true),
            ("negative", true),
            ("no-envelope", true),
            ("stray", true)
        ]
    );
    // Three are rewritten after they were read (an engine scheduled the ids again): they are
    // no longer broken, and stay. One with the very envelope it had, and a valid score now.
    store
        .apply(&[
            upsert(&envelope("no-envelope", 80)),
            upsert(&envelope("stray", 90)),
            upsert(&envelope("fractional", 1)),
        ])
        .await
        .unwrap();
    store.dead_letter(&broken, 123).await.unwrap();
    let (mut tasks, broken) = all(&store).await;
    tasks.sort_by_key(|e| e.due_at);
    assert_eq!(broken.len(), 0);
    assert_eq!(
        tasks,
        vec![
            envelope("fractional", 1),
            envelope("good", 42),
            envelope("no-envelope", 80),
            envelope("stray", 90)
        ]
    );
    let dead: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg("{t3}:dead")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut dead_ids: Vec<&str> = dead.keys().map(String::as_str).collect();
    dead_ids.sort_unstable();
    assert_eq!(dead_ids, ["", "garbage", "negative"]);
    let garbage: serde_json::Value = serde_json::from_str(&dead["garbage"]).unwrap();
    assert_eq!(garbage["raw"], "{not json");
    assert_eq!(garbage["at"], 123);
    assert!(garbage["reason"].as_str().unwrap().contains("undecodable"));
}

#[tokio::test]
async fn acknowledged_writes_survive_a_sigkill_of_redis() {
    let mut server = RedisServer::start();
    let store = connect(&server, "t4").await;
    let tasks = stored(&store, 500).await;
    server.kill();
    assert!(
        store.apply(&[upsert(&envelope("lost?", 1))]).await.is_err(),
        "redis is down"
    );
    server.restart();
    let store = connect(&server, "t4").await;
    let (read, broken) = all(&store).await;
    assert!(broken.is_empty());
    assert_eq!(read, tasks);
}

#[test]
fn check_counts_exactly_what_encode_writes() {
    let payloads = [
        serde_json::Value::Null,
        serde_json::json!("quotes \" and \\ backslashes, tabs\t, newlines\n, \u{1} controls"),
        serde_json::json!({ "unicode": "ünïcødé ✓ 注文", "n": [1, -2, 3.5, 1e300], "b": true }),
        serde_json::json!("x".repeat(10_000)),
    ];
    for payload in payloads {
        let mut e = envelope("order:\"1\"", 1_700_000_000_000);
        e.payload = payload;
        let bytes = e.encode(usize::MAX).unwrap();
        assert_eq!(e.check(usize::MAX), Ok(bytes.len()));
        // The limit is inclusive, and one byte less refuses with the true size.
        assert_eq!(e.check(bytes.len()), Ok(bytes.len()));
        assert_eq!(
            e.check(bytes.len() - 1),
            Err(EnvelopeError::TooLarge {
                size: bytes.len(),
                limit: bytes.len() - 1
            })
        );
    }
}

/// A snapshot Redis refuses for want of memory deletes its scratch copy: left there, the copy
/// would hold the memory, and every later journal write would be refused too.
#[tokio::test]
async fn a_snapshot_refused_for_want_of_memory_leaves_no_scratch_copy() {
    let server = RedisServer::start_in_memory();
    let store = connect(&server, "oom").await;
    let pad = "x".repeat(1_000);
    let ops: Vec<Op> = (0..20_000)
        .map(|i| {
            let mut e = envelope(&format!("t{i}"), 1_800_000_000_000 + i);
            e.payload = serde_json::json!(pad);
            upsert(&e)
        })
        .collect();
    store.apply(&ops).await.unwrap();
    let mut conn = raw(&server.url()).await;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .unwrap();
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Room for a few MB more: far less than a second copy of the ~25 MB set.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used + 4_000_000)
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(store.replace_all(&ops).await.is_err(), "the copy fit");
    let scratch: i64 = redis::cmd("EXISTS")
        .arg("{oom}:due:snapshot")
        .arg("{oom}:tasks:snapshot")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        scratch, 0,
        "the failed snapshot's scratch keys are still there"
    );
    // The journal's writes still go through, and the live set is untouched.
    store
        .apply(&[upsert(&envelope("late", 1_900_000_000_000))])
        .await
        .unwrap();
    let live: i64 = redis::cmd("ZCARD")
        .arg("{oom}:due")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(live, 20_001);
}

/// The async constructors called outside a Tokio runtime (on another executor) return an
/// error: the redis crate's connections spawn on the current runtime, and panicked there.
#[test]
fn connecting_outside_a_tokio_runtime_is_an_error_not_a_panic() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    fn first_poll<F: Future>(f: F) -> Poll<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        std::pin::pin!(f).poll(&mut cx)
    }
    let url = "redis://127.0.0.1:1";
    let keys = || KeyLayout::new("elsewhere").unwrap();
    assert!(matches!(
        first_poll(RedisStore::connect(url, keys())),
        Poll::Ready(Err(_))
    ));
    assert!(matches!(
        first_poll(RedisStore::connect_cluster(&[url.to_string()], keys())),
        Poll::Ready(Err(_))
    ));
    let cfg = delaywheel::redis::QueueConfig::new(url, "elsewhere");
    assert!(matches!(
        first_poll(delaywheel::redis::Producer::connect(cfg)),
        Poll::Ready(Err(_))
    ));
    let dedup = delaywheel::redis::Dedup::connect(
        url,
        "elsewhere",
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(1),
    );
    assert!(matches!(first_poll(dedup), Poll::Ready(Err(_))));
}

/// An error and its sources, as a reporter prints them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

/// The async constructors called on a Tokio runtime without its time or I/O driver return an
/// error that says which: the redis crate's connections panicked inside Tokio there.
#[test]
fn connecting_on_a_runtime_without_time_or_io_is_an_error_not_a_panic() {
    let url = "redis://127.0.0.1:1";
    let no_time = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let no_io = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    for (rt, missing) in [(no_time, "time driver"), (no_io, "I/O driver")] {
        let cfg = delaywheel::redis::QueueConfig::new(url, "partial");
        let producer = rt.block_on(delaywheel::redis::Producer::connect(cfg));
        let e = chain(&producer.expect_err("connected without a driver"));
        assert!(e.contains(missing), "{missing}: {e}");
        let dedup = rt.block_on(delaywheel::redis::Dedup::connect(
            url,
            "partial",
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(1),
        ));
        let e = chain(&dedup.expect_err("connected without a driver"));
        assert!(e.contains(missing), "{missing}: {e}");
        let store = rt.block_on(RedisStore::connect(url, KeyLayout::new("partial").unwrap()));
        assert!(store.is_err(), "{missing}");
    }
}

/// A restore's read that fails on a dropped connection is sent again: one failed step must not
/// end a restore (reads are safe to repeat).
#[tokio::test]
async fn a_read_on_a_dropped_connection_is_sent_again() {
    let server = RedisServer::start();
    let store = connect(&server, "dropped").await;
    let tasks = stored(&store, 300).await;
    for _ in 0..3 {
        // Every client loses its connection: the store's next read fails on it.
        assert!(
            server.kill_clients() >= 1,
            "the store's connection was not killed"
        );
        let (read, broken) = all(&store).await;
        assert_eq!(read, tasks);
        assert!(broken.is_empty());
    }
}

/// Pages are keyset pages by (due time, id bytes): thousands of rows due in one millisecond,
/// ids that sort differently as bytes than in a locale, and the last row of each page removed
/// before the next page is read (so the next page cannot find it by rank) still come back
/// each exactly once, with none skipped.
#[tokio::test]
async fn pages_by_due_time_and_id_skip_nothing_in_runs_of_one_due_time() {
    let server = RedisServer::start_in_memory();
    let store = connect(&server, "ties").await;
    let mut tasks: Vec<Envelope> = (0..2_500u64)
        .map(|i| envelope(&format!("tie:{i:04}"), 5_000))
        .collect();
    tasks.extend((0..300u64).map(|i| envelope(&format!("Étape:{i}"), 5_000)));
    tasks.extend((0..300u64).map(|i| envelope(&format!("zeta:{i}"), 4_000 + i % 3)));
    tasks.extend((0..300u64).map(|i| envelope(&format!("late:{i}"), 9_000 + i)));
    store
        .apply(&tasks.iter().map(upsert).collect::<Vec<_>>())
        .await
        .unwrap();
    let mut conn = raw(&server.url()).await;
    let (mut cursor, mut seen, mut removed) =
        (Cursor::start(), Vec::<String>::new(), Vec::<String>::new());
    loop {
        let page = store.page(cursor, 97).await.unwrap();
        assert!(page.broken.is_empty());
        seen.extend(page.tasks.iter().map(|t| t.id.clone()));
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
        // The row the cursor names is gone before the next page is read.
        let last = page.tasks.last().unwrap().id.clone();
        let _: () = redis::cmd("ZREM")
            .arg("{ties}:due")
            .arg(&last)
            .query_async(&mut conn)
            .await
            .unwrap();
        removed.push(last);
    }
    let unique: std::collections::HashSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a row came back twice");
    assert_eq!(seen.len(), tasks.len(), "a row was skipped");
    assert!(removed.len() > 30);
}
