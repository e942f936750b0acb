//! `Persistent` under Redis faults that an outside fault test found: a restore that spans a
//! Redis restart, Redis restarting empty or with older data under a running engine, and a
//! namespace key of the wrong type. Each against a private `redis-server` it kills and
//! restarts.
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Broken, Cursor, Envelope, KeyLayout, Lease, Op, PersistConfig, Persistent, RedisStore,
    Rows, StoreError, TaskStore,
};
use parking_lot::Mutex;
use redis_server::RedisServer;

const PATIENCE: Duration = Duration::from_secs(30);

fn run_id(server: &RedisServer) -> String {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .unwrap()
        .trim()
        .to_owned()
}

/// Waits until `done`, failing with `what` after [`PATIENCE`].
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes `n` tasks straight into the namespace's keys, as a previous process left them: ten
/// per due millisecond, so pages end inside runs of equal due times.
fn stored_tasks(server: &RedisServer, ns: &str, n: u64, due: u64) -> Vec<String> {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let ids: Vec<String> = (0..n).map(|i| format!("order:{i}")).collect();
    for chunk in ids.chunks(5_000) {
        let mut pipe = redis::pipe();
        let (mut zadd, mut hset) = (redis::cmd("ZADD"), redis::cmd("HSET"));
        zadd.arg(format!("{{{ns}}}:due"));
        hset.arg(format!("{{{ns}}}:tasks"));
        for id in chunk {
            let i: u64 = id[6..].parse().unwrap();
            let envelope = Envelope {
                id: id.clone(),
                topic: "order.close".into(),
                payload: serde_json::json!({ "i": i }),
                attempt: 0,
                created_at: due,
                headers: Default::default(),
                due_at: due + i / 10,
            };
            zadd.arg(envelope.due_at).arg(id);
            hset.arg(id).arg(envelope.encode(4096).unwrap());
        }
        pipe.add_command(zadd).add_command(hset);
        pipe.query::<()>(&mut conn).unwrap();
    }
    ids
}

/// What [`AfterFirstPage`] runs.
type Hook = Box<dyn FnOnce() + Send>;

/// A [`RedisStore`] that runs a hook after its first page is read: here, a restart of the
/// server, so that a restore is sure to span it (a kill timed by the clock may land after a
/// restore of 100k rows has already ended).
#[derive(Clone)]
struct AfterFirstPage {
    store: RedisStore,
    pages: Arc<AtomicUsize>,
    hook: Arc<Mutex<Option<Hook>>>,
}

impl TaskStore for AfterFirstPage {
    fn apply(
        &self,
        ops: &[Op],
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.store.apply(ops)
    }

    async fn rows(&self, cursor: Cursor, count: usize) -> Result<Rows, StoreError> {
        let rows = self.store.rows(cursor, count).await;
        if self.pages.fetch_add(1, SeqCst) == 0 {
            if let Some(hook) = self.hook.lock().take() {
                // Blocks the store's one worker thread while the server restarts: the page
                // read ahead is sent only after it.
                hook();
            }
        }
        rows
    }

    fn dead_letter(
        &self,
        broken: &[Broken],
        now_ms: u64,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.store.dead_letter(broken, now_ms)
    }

    fn replace_all(
        &self,
        tasks: &[Op],
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.store.replace_all(tasks)
    }

    fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> impl std::future::Future<Output = Result<Lease, StoreError>> + Send {
        self.store.lease(holder, ttl, first)
    }

    fn release(
        &self,
        holder: &str,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.store.release(holder)
    }
}

/// A restore during which redis-server is SIGKILLed and restarted from its append-only file
/// (`appendfsync always`: Redis itself loses nothing) loads every row or fails; it used to
/// continue with the old server's ZSCAN cursor, return `Ok` with a fifth of the rows missing,
/// and a snapshot then deleted them from Redis for good. The restart happens after the first
/// page is read, by a hook, and the test asserts that the restore saw the server change.
/// Then a snapshot leaves every row in Redis, and cancels of ids on the last pages (which the
/// restore had not loaded when the server changed) remove their rows.
#[test]
fn a_restore_across_a_redis_restart_loads_every_row() {
    let server = Arc::new(Mutex::new(RedisServer::start()));
    let n = 120_000u64;
    let ids = stored_tasks(&server.lock(), "restart", n, now_ms() + 3_600_000);
    let before = run_id(&server.lock());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = server.lock().url();
    let redis_store = rt
        .block_on(RedisStore::connect(
            &url,
            KeyLayout::new("restart").unwrap(),
        ))
        .unwrap();
    let restarts = server.clone();
    let store = AfterFirstPage {
        store: redis_store,
        pages: Arc::default(),
        hook: Arc::new(Mutex::new(Some(Box::new(move || {
            restarts.lock().restart()
        })))),
    };
    let (p, _fired) =
        Persistent::with_store(PersistConfig::new("unused://", "restart"), store).unwrap();
    let report = p.restore(1_000).unwrap();
    assert_ne!(run_id(&server.lock()), before, "the server did not restart");
    assert!(
        report.rescans >= 1,
        "the restore did not see the server change: {report:?}"
    );
    assert_eq!(report.loaded, n as usize, "{report:?}");
    assert_eq!(p.len(), n as usize);

    assert_eq!(p.snapshot(PATIENCE), Some(n as usize));
    let server = server.lock();
    assert_eq!(server.int(&["ZCARD", "{restart}:due"]), n as i64);
    assert_eq!(server.int(&["HLEN", "{restart}:tasks"]), n as i64);

    // The last thousand by due time: on the restore's last pages.
    let cancelled: HashSet<&String> = ids[ids.len() - 1_000..].iter().collect();
    for id in &cancelled {
        assert!(p.cancel(id), "{id} was not loaded");
    }
    assert!(p.flush(PATIENCE));
    let left = server.zset_members("{restart}:due");
    assert_eq!(left.len(), n as usize - cancelled.len());
    assert!(left.iter().all(|id| !cancelled.contains(id)));
    p.shutdown();
}

fn fast_lease(server: &RedisServer, ns: &str) -> PersistConfig {
    let mut cfg = PersistConfig::new(server.url(), ns);
    cfg.engine_lease = Duration::from_millis(600);
    cfg
}

fn schedule_n(p: &Persistent, prefix: &str, n: usize) {
    let later = now_ms() + 3_600_000;
    for i in 0..n {
        p.schedule_at_ms(format!("{prefix}:{i}"), "t", serde_json::Value::Null, later)
            .unwrap();
    }
}

/// Redis restarted empty (no persistence, or a failover to an empty replica) under a running
/// engine: the engine tells that the lease is gone from "another engine holds it", takes it
/// again and writes every pending task back (as a snapshot, a restore having completed), and
/// goes on writing. It used to log that another engine took the lease, write nothing again,
/// and keep returning `Ok` from `schedule`.
#[test]
fn an_engine_writes_everything_back_after_redis_restarts_empty() {
    let mut server = RedisServer::start_in_memory();
    let (p, _fired) = Persistent::start(fast_lease(&server, "empty")).unwrap();
    p.restore(1_000).unwrap();
    schedule_n(&p, "a", 1_000);
    assert!(p.flush(PATIENCE));
    assert_eq!(server.int(&["ZCARD", "{empty}:due"]), 1_000);

    server.restart(); // no append-only file: it comes back empty
    assert_eq!(server.int(&["EXISTS", "{empty}:due"]), 0);
    eventually("the pending set was not written back", || {
        server.int(&["ZCARD", "{empty}:due"]) == 1_000
            && server.int(&["HLEN", "{empty}:tasks"]) == 1_000
    });
    assert!(p.is_writing());
    schedule_n(&p, "b", 10);
    assert!(p.flush(PATIENCE), "no longer writing");
    assert_eq!(server.int(&["ZCARD", "{empty}:due"]), 1_010);
    assert!(p.shutdown().is_empty());
}

/// The same before any restore: the tasks held are written back as upserts, not as a snapshot,
/// which would delete rows a previous process left that no restore has read.
#[test]
fn before_a_restore_the_tasks_held_are_written_back_as_upserts() {
    let mut server = RedisServer::start_in_memory();
    let (p, _fired) = Persistent::start(fast_lease(&server, "unrestored")).unwrap();
    schedule_n(&p, "a", 500);
    assert!(p.flush(PATIENCE));
    server.restart();
    // A row another process left in the new server, which a snapshot would delete.
    stored_tasks(&server, "unrestored", 1, now_ms() + 3_600_000);
    eventually("the tasks held were not written back", || {
        server.int(&["ZCARD", "{unrestored}:due"]) == 501
    });
    let report = p.restore(100).unwrap();
    assert_eq!(report.loaded, 1);
    assert_eq!(p.len(), 501);
    p.shutdown();
}

/// Redis restarted from older data (as after a failover to a replica that lagged): the lease
/// and its record of takes survived, so only the server's new `run_id` tells. The engine
/// writes the whole set back then too, not only once the namespace is gone: here a tenth of
/// the rows are missing from the restarted server, and come back.
#[test]
fn an_engine_writes_everything_back_when_the_server_changes_with_part_of_the_data() {
    let mut server = RedisServer::start();
    let (p, _fired) = Persistent::start(fast_lease(&server, "lagged")).unwrap();
    p.restore(1_000).unwrap();
    schedule_n(&p, "a", 1_000);
    assert!(p.flush(PATIENCE));
    // Behind the engine's back, as a lagging replica would lack them.
    for i in 0..100 {
        let id = format!("a:{i}");
        server.int(&["ZREM", "{lagged}:due", &id]);
        server.int(&["HDEL", "{lagged}:tasks", &id]);
    }
    server.restart(); // from its append-only file: the lease and the takes record survive
    assert_eq!(server.int(&["ZCARD", "{lagged}:due"]), 900);
    assert_eq!(server.int(&["EXISTS", "{lagged}:engine:takes"]), 1);
    eventually("the missing rows were not written back", || {
        server.int(&["ZCARD", "{lagged}:due"]) == 1_000
            && server.int(&["HLEN", "{lagged}:tasks"]) == 1_000
    });
    assert!(p.is_writing());
    p.shutdown();
}

/// A flush batch that meets a `{ns}:due` of the wrong type leaves nothing half-written: Redis
/// runs the rest of a MULTI whose ZADD fails, and its envelopes used to stay in `{ns}:tasks`
/// where no restore reads them. The batch stays in the journal, and is written whole once the
/// key is fixed.
#[test]
fn a_batch_that_meets_a_wrong_typed_due_key_is_taken_back() {
    let server = RedisServer::start_in_memory();
    let (p, _fired) = Persistent::start(PersistConfig::new(server.url(), "typed")).unwrap();
    p.restore(100).unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    redis::cmd("SET")
        .arg("{typed}:due")
        .arg("not a zset")
        .query::<()>(&mut conn)
        .unwrap();
    let execs = |conn: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
        info.lines()
            .find(|l| l.starts_with("cmdstat_exec:"))
            .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    let before = execs(&mut conn);
    p.schedule_at_ms("t1", "t", serde_json::Value::Null, now_ms() + 3_600_000)
        .unwrap();
    assert!(!p.flush(Duration::from_millis(500)), "written to a string");
    assert!(execs(&mut conn) > before, "no batch was sent");
    eventually("the batch's envelope stayed in {typed}:tasks", || {
        server.int(&["HEXISTS", "{typed}:tasks", "t1"]) == 0
    });
    server.int(&["DEL", "{typed}:due"]);
    assert!(p.flush(PATIENCE));
    assert_eq!(server.int(&["ZCARD", "{typed}:due"]), 1);
    assert_eq!(server.int(&["HEXISTS", "{typed}:tasks", "t1"]), 1);
    p.shutdown();
}
