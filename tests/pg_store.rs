//! `PgStore`, the persistent engine's store on PostgreSQL, against a private server (`initdb`
//! into a temp dir, a Unix socket there): round trips through `Persistent`, batches and
//! pages, the writer lease and its fence, and the faults: a server down at start, a wrong
//! password, a table of another shape, and a server killed (`SIGKILL`) and restarted while
//! batches are in flight and writes go on; and the store behind PgBouncer in transaction mode.
#![cfg(feature = "postgres")]

#[path = "support/pg_server.rs"]
mod pg_server;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use delaywheel::postgres::{PgConfig, PgError, PgStore};
use delaywheel::redis::{Cursor, Lease, Op, PersistConfig, Persistent};
use pg_server::{PgBouncer, PgServer};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn store(rt: &tokio::runtime::Runtime, server: &PgServer, ns: &str) -> PgStore {
    rt.block_on(PgStore::connect(PgConfig::new(server.url(), ns)))
        .unwrap()
}

/// The rows of `ns` in the tasks table, by a connection of the test's own.
fn count(rt: &tokio::runtime::Runtime, server: &PgServer, ns: &str) -> i64 {
    rt.block_on(async {
        server
            .client()
            .await
            .query_one(
                "SELECT count(*) FROM public.delaywheel_tasks WHERE ns = $1",
                &[&ns],
            )
            .await
            .unwrap()
            .get(0)
    })
}

fn upsert(id: &str, due_at: u64) -> Op {
    let envelope = serde_json::to_vec(&serde_json::json!({
        "id": id, "topic": "t", "payload": null, "attempt": 0, "created_at": 0, "due_at": due_at
    }))
    .unwrap();
    Op::Upsert {
        id: id.into(),
        due_at,
        envelope,
    }
}

#[test]
fn a_batch_is_applied_last_op_wins_and_read_back_in_due_order_by_pages() {
    let server = PgServer::start();
    let rt = rt();
    let s = store(&rt, &server, "pages");
    let mut ops: Vec<Op> = (0..25)
        .map(|i| upsert(&format!("t{i}"), 1_000 + (i % 5) * 10))
        .collect();
    // The same ids again in one batch: the last operation wins.
    ops.push(Op::Remove("t3".into()));
    ops.push(upsert("t4", 5));
    ops.push(Op::Remove("t7".into()));
    ops.push(upsert("t7", 7));
    rt.block_on(s.apply(&ops)).unwrap();
    let mut seen = Vec::new();
    let mut cursor = Cursor::start();
    let mut pages = 0;
    loop {
        let page = rt.block_on(s.rows(cursor, 4)).unwrap();
        pages += 1;
        seen.extend(
            page.rows
                .iter()
                .map(|r| (r.due.parse::<u64>().unwrap(), r.id.clone())),
        );
        match page.next {
            Some(c) => cursor = c,
            None => break,
        }
    }
    assert_eq!(seen.len(), 24, "t3 removed, every other id once: {seen:?}");
    assert!(pages >= 6, "{pages} pages of 4");
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen, sorted, "not in (due, id) order");
    assert_eq!(seen[0], (5, "t4".into()));
    assert_eq!(seen[1], (7, "t7".into()));
    assert!(!seen.iter().any(|(_, id)| id == "t3"));
}

#[test]
fn a_persistent_engine_on_postgres_fires_and_a_new_one_restores_what_is_pending() {
    let server = PgServer::start();
    let rt = rt();
    let (engine, fired) = Persistent::with_store(
        PersistConfig::new("unused://", "orders"),
        store(&rt, &server, "orders"),
    )
    .unwrap();
    for i in 0..100 {
        engine
            .schedule(format!("later{i}"), "close", &i, Duration::from_secs(3_600))
            .unwrap();
    }
    engine
        .schedule("soon", "close", &0, Duration::from_millis(50))
        .unwrap();
    let task = fired.recv_timeout(Duration::from_secs(10)).expect("fired");
    assert_eq!(task.id, "soon");
    engine.ack(&task);
    assert!(engine.shutdown().is_empty(), "unwritten at shutdown");
    assert_eq!(
        count(&rt, &server, "orders"),
        100,
        "acked task still stored, or a pending one lost"
    );

    let (again, _fired) = Persistent::with_store(
        PersistConfig::new("unused://", "orders"),
        store(&rt, &server, "orders"),
    )
    .unwrap();
    let report = again.restore(30).unwrap();
    assert_eq!(again.len(), 100, "{report:?}");
    assert!(again.shutdown().is_empty());
}

#[test]
fn the_writer_lease_goes_to_one_engine_and_fences_the_other() {
    let server = PgServer::start();
    let rt = rt();
    let (a, b) = (store(&rt, &server, "lease"), store(&rt, &server, "lease"));
    let ttl = Duration::from_secs(30);
    assert_eq!(rt.block_on(a.lease("a", ttl, true)).unwrap(), Lease::Held);
    assert_eq!(
        rt.block_on(b.lease("b", ttl, true)).unwrap(),
        Lease::Other("a".into())
    );
    rt.block_on(a.apply(&[upsert("x", 1)])).unwrap();
    rt.block_on(a.release("a")).unwrap();
    assert_eq!(rt.block_on(b.lease("b", ttl, true)).unwrap(), Lease::Held);
    // `a` held it before and `b` took it since: `a` may not take it back, nor write.
    assert_eq!(
        rt.block_on(a.lease("a", ttl, false)).unwrap(),
        Lease::Other("b".into())
    );
    let refused = rt.block_on(a.apply(&[Op::Remove("x".into())])).unwrap_err();
    assert!(refused.to_string().contains("NOTHELD"), "{refused}");
    assert_eq!(
        count(&rt, &server, "lease"),
        1,
        "a fenced-off engine removed a row"
    );
    // The lease row gone (the table emptied): the engine that held it retakes it, told so.
    rt.block_on(async {
        server
            .client()
            .await
            .execute("DELETE FROM public.delaywheel_lease", &[])
            .await
            .unwrap();
    });
    assert!(matches!(
        rt.block_on(b.lease("b", ttl, false)).unwrap(),
        Lease::Retaken(_)
    ));
}

#[test]
fn a_server_that_is_down_or_refuses_the_password_is_a_typed_error() {
    let mut server = PgServer::start();
    let rt = rt();
    let wrong = rt
        .block_on(PgStore::connect(PgConfig::new(
            server.url_with("not-the-password"),
            "x",
        )))
        .unwrap_err();
    assert!(matches!(wrong, PgError::Auth(_)), "{wrong:?}");
    server.stop();
    let down = rt
        .block_on(PgStore::connect(PgConfig::new(server.url(), "x")))
        .unwrap_err();
    assert!(matches!(down, PgError::Unreachable(_)), "{down:?}");
    let mut bad = PgConfig::new(server.url(), "x");
    bad.prefix = "Robert'); DROP".into();
    assert!(matches!(
        rt.block_on(PgStore::connect(bad)).unwrap_err(),
        PgError::Config(_)
    ));
}

#[test]
fn a_table_of_another_shape_is_refused_by_name_and_left_alone() {
    let server = PgServer::start();
    let rt = rt();
    rt.block_on(async {
        server
            .client()
            .await
            .batch_execute(
                "CREATE SCHEMA odd; CREATE TABLE odd.delaywheel_tasks (ns text, id text, due_ms text);",
            )
            .await
            .unwrap();
    });
    let mut cfg = PgConfig::new(server.url(), "x");
    cfg.schema = "odd".into();
    match rt.block_on(PgStore::connect(cfg)).unwrap_err() {
        PgError::Shape { table, detail } => {
            assert_eq!(table, "odd.delaywheel_tasks");
            assert!(detail.contains("due_ms"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn two_stores_starting_together_migrate_once_and_set_the_vacuum_settings() {
    let server = PgServer::start();
    let rt = rt();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            PgStore::connect(PgConfig::new(server.url(), "a")),
            PgStore::connect(PgConfig::new(server.url(), "b"))
        )
    });
    a.unwrap();
    b.unwrap();
    let (versions, options): (Vec<i32>, Vec<String>) = rt.block_on(async {
        let client = server.client().await;
        let versions = client
            .query(
                "SELECT version FROM public.delaywheel_migrations ORDER BY version",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let options: Option<Vec<String>> = client
            .query_one(
                "SELECT reloptions FROM pg_class WHERE oid = 'public.delaywheel_tasks'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (versions, options.unwrap_or_default())
    });
    assert_eq!(versions, [1, 2], "each migration recorded once");
    for want in [
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=10000",
        "autovacuum_vacuum_cost_delay=0",
    ] {
        assert!(
            options.iter().any(|o| o == want),
            "{want} not in {options:?}"
        );
    }
}

#[test]
fn behind_pgbouncer_in_transaction_mode_the_store_writes_restores_leases_and_dead_letters() {
    let server = PgServer::start();
    let bouncer = PgBouncer::start(&server);
    let rt = rt();
    let connect = |ns: &str| {
        rt.block_on(PgStore::connect(PgConfig::new(bouncer.url(), ns)))
            .unwrap_or_else(|e| panic!("connect through PgBouncer: {e}\n{}", bouncer.log()))
    };
    // The flusher's four connections share PgBouncer's two to the server, statement by
    // statement: a named prepared statement would not survive that.
    let (engine, _fired) = Persistent::with_store(
        PersistConfig::new("unused://", "bounced"),
        connect("bounced"),
    )
    .unwrap();
    engine.restore(1_000).unwrap();
    for i in 0..2_000 {
        engine
            .schedule(format!("t{i}"), "t", &i, Duration::from_secs(3_600))
            .unwrap();
    }
    assert!(
        engine.flush(Duration::from_secs(10)),
        "flush through PgBouncer"
    );
    for i in 0..500 {
        assert!(engine.cancel(&format!("t{i}")));
    }
    assert!(engine.shutdown().is_empty(), "unwritten at shutdown");
    assert_eq!(count(&rt, &server, "bounced"), 1_500);
    // A row that does not decode, written behind the engines' backs.
    rt.block_on(async {
        server
            .client()
            .await
            .execute(
                "INSERT INTO public.delaywheel_tasks (ns, id, due_ms, envelope)
                 VALUES ('bounced', 'broken', 1, 'not json')",
                &[],
            )
            .await
            .unwrap()
    });
    // A new engine restores by keyset pages of 100 and dead-letters the broken row.
    let (again, _fired) = Persistent::with_store(
        PersistConfig::new("unused://", "bounced"),
        connect("bounced"),
    )
    .unwrap();
    again.restore(100).unwrap();
    assert_eq!(again.len(), 1_500);
    // It holds the lease: another store is told so.
    let other = connect("bounced");
    assert!(matches!(
        rt.block_on(other.lease("other", Duration::from_secs(30), true))
            .unwrap(),
        Lease::Other(_)
    ));
    assert!(again.shutdown().is_empty());
    let dead: i64 = rt.block_on(async {
        server
            .client()
            .await
            .query_one(
                "SELECT count(*) FROM public.delaywheel_dead WHERE ns = 'bounced' AND id = 'broken'",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    });
    assert_eq!(dead, 1, "the broken row dead-lettered");
    assert_eq!(count(&rt, &server, "bounced"), 1_500);
}

/// Every id of `ns` in the tasks table, by a connection of the test's own.
fn ids(rt: &tokio::runtime::Runtime, server: &PgServer, ns: &str) -> BTreeSet<String> {
    rt.block_on(async {
        server
            .client()
            .await
            .query(
                "SELECT id FROM public.delaywheel_tasks WHERE ns = $1",
                &[&ns],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    })
}

#[test]
fn postgres_killed_and_restarted_under_writes_loses_nothing() {
    let mut server = PgServer::start();
    let rt = rt();
    let (engine, _fired) = Persistent::with_store(
        PersistConfig::new("unused://", "crash"),
        store(&rt, &server, "crash"),
    )
    .unwrap();
    let payload = "x".repeat(100);
    // A burst the flusher needs a few hundred milliseconds to write (batches of 1 000), so
    // that the kill lands while its batches are in flight.
    let mut expected = BTreeSet::new();
    for i in 0..30_000 {
        let id = format!("burst{i}");
        engine
            .schedule(id.as_str(), "t", &payload, Duration::from_secs(3_600))
            .unwrap();
        expected.insert(id);
    }
    let stop = AtomicBool::new(false);
    let (written, depth_at_kill) = std::thread::scope(|s| {
        // Writes go on throughout, before, during and after the outage: schedules, and a
        // cancel of every third one (a removal the store must apply, or never see).
        let writer = s.spawn(|| {
            let mut kept = BTreeSet::new();
            let mut i = 0;
            while !stop.load(Relaxed) {
                let id = format!("w{i}");
                engine
                    .schedule(id.as_str(), "t", &i, Duration::from_secs(3_600))
                    .unwrap();
                if i % 3 == 2 {
                    assert!(engine.cancel(&id));
                } else {
                    kept.insert(id);
                }
                i += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            kept
        });
        std::thread::sleep(Duration::from_millis(30));
        // Unflushed changes when the server dies: the burst's batches, taken or waiting.
        let depth_at_kill = engine.journal_depth();
        server.kill();
        std::thread::sleep(Duration::from_millis(500));
        server.restart();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Relaxed);
        (writer.join().unwrap(), depth_at_kill)
    });
    assert!(
        depth_at_kill > 1_000,
        "the kill must find writes in flight: {depth_at_kill} unflushed"
    );
    expected.extend(written);
    let start = Instant::now();
    while !engine.flush(Duration::from_secs(1)) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never flushed after the restart"
        );
    }
    assert!(engine.shutdown().is_empty(), "unwritten at shutdown");
    let stored = ids(&rt, &server, "crash");
    let missing: Vec<_> = expected.difference(&stored).take(5).collect();
    let extra: Vec<_> = stored.difference(&expected).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} tasks in the table, {} expected; missing {missing:?}, cancelled but stored {extra:?}",
        stored.len(),
        expected.len()
    );
    // And a new engine restores exactly them.
    let (again, _fired) = Persistent::with_store(
        PersistConfig::new("unused://", "crash"),
        store(&rt, &server, "crash"),
    )
    .unwrap();
    again.restore(1_000).unwrap();
    assert_eq!(again.len(), expected.len());
    assert!(again.shutdown().is_empty());
}
