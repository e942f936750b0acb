//! Measures `PgStore`, the persistent engine's PostgreSQL store, against its targets, on a
//! private PostgreSQL started here with the shipped durability settings (`fsync` and
//! `synchronous_commit` on, reported), and prints a report:
//!
//! * schedule + cancel through a `WriteBehind` [`Persistent`] engine on `PgStore` vs the
//!   in-memory `Timer<String>`, same ids, same run (target ≤ 2×);
//! * flusher throughput: N task upserts journaled while the flusher waits, then flushed,
//!   beside PostgreSQL's own pace for the same statements (`INSERT … SELECT FROM unnest(…) ON
//!   CONFLICT DO UPDATE`, batches of the flusher's size, four in flight as the flusher sends
//!   them) sent by a bare loop with the same driver (target ≥ 0.8×); and the removals;
//! * restore of the N tasks into a new engine (target ≤ 10 s at 1M);
//! * bloat: the table's size after the N upserts; live and dead tuples and size after their
//!   removal; how long autovacuum, with the settings the store gives its table (a vacuum per
//!   10 000 dead rows, no cost delay), takes to clear the dead rows; and the size after a
//!   second round of N upserts into the vacuumed table (its space reused, or grown). The server
//!   runs with `autovacuum_naptime=1s` (shipped: 1 min) so that the report need not wait a
//!   minute for autovacuum's next look.
//!
//! ```text
//! cargo run --release --features postgres --example pg_report           # 1M tasks
//! cargo run --features postgres --example pg_report -- --smoke --json    # make test
//! ```

#[path = "support/persist_rounds.rs"]
mod persist_rounds;
#[path = "../tests/support/pg_server.rs"]
mod pg_server;

use std::time::{Duration, Instant};

use clap::Parser;
use delaywheel::postgres::{PgConfig, PgStore};
use delaywheel::redis::{now_ms, Envelope, PersistConfig, Persistent};
use delaywheel::Timer;
use futures_util::StreamExt;
use persist_rounds::{median, persistent_pairs_ns, timed_flush, timer_pairs_ns};
use tokio_postgres::types::Type;

#[derive(Parser, Debug)]
#[command(about = "Measure delaywheel's PostgreSQL store against its targets")]
struct Args {
    /// Pending tasks for the flush, restore and bloat figures.
    #[arg(long, default_value_t = 1_000_000)]
    tasks: usize,
    /// Payload bytes per task.
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// Schedule + cancel pairs per measured round (7 rounds; the median is reported).
    #[arg(long, default_value_t = 200_000)]
    pairs: usize,
    /// A seconds-long run for tests.
    #[arg(long)]
    smoke: bool,
    /// Print the figures as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

const RESTORE_PAGE: usize = 4_000;

fn engine(
    rt: &tokio::runtime::Runtime,
    url: &str,
    ns: &str,
    flush_interval: Duration,
    bound: usize,
) -> Persistent<PgStore> {
    let store = rt
        .block_on(PgStore::connect(PgConfig::new(url, ns)))
        .expect("PgStore");
    let mut cfg = PersistConfig::new("unused://", ns);
    cfg.flush_interval = flush_interval;
    cfg.journal_bound = bound;
    Persistent::with_store(cfg, store).expect("engine").0
}

/// A flush of a million rows takes seconds; this bounds a stuck one.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1_800);

/// Journals an upsert of each of `ids` (due from `far` on) in an engine of namespace `flush`
/// whose flusher waits, then times their flush. The engine is shut down and dropped after, its
/// connections closed.
fn upsert_round(
    rt: &tokio::runtime::Runtime,
    url: &str,
    ids: &[String],
    payload: &serde_json::Value,
    far: u64,
) -> Duration {
    let persist = engine(
        rt,
        url,
        "flush",
        Duration::from_secs(3_600),
        2 * ids.len() + 1,
    );
    persist.restore(RESTORE_PAGE).expect("restore");
    for (i, id) in ids.iter().enumerate() {
        persist
            .schedule_at_ms(id.clone(), "order.close", payload.clone(), far + i as u64)
            .expect("schedule");
    }
    let took = timed_flush(&persist, FLUSH_TIMEOUT);
    assert!(persist.shutdown().is_empty(), "unwritten at shutdown");
    took
}

/// PostgreSQL's pace for the flusher's statements, by a bare loop: the same upserts, in
/// batches of `batch`, `IN_FLIGHT` statements at once on as many connections, each sent as
/// the store sends it (unnamed and typed: one round trip).
async fn bare_upserts(
    server: &pg_server::PgServer,
    envelopes: &[(String, u64, Vec<u8>)],
    batch: usize,
) -> f64 {
    const IN_FLIGHT: usize = 4;
    let mut clients = Vec::new();
    for _ in 0..IN_FLIGHT {
        clients.push(server.client().await);
    }
    let sql = "INSERT INTO public.delaywheel_tasks (ns, id, due_ms, envelope)
               SELECT $1, u.id, u.due, u.env
               FROM unnest($2::text[], $3::int8[], $4::bytea[]) AS u(id, due, env)
               ON CONFLICT (ns, id) DO UPDATE SET due_ms = EXCLUDED.due_ms, envelope = EXCLUDED.envelope";
    let t = Instant::now();
    let chunks: Vec<_> = envelopes.chunks(batch).collect();
    futures_util::stream::iter(chunks.into_iter().enumerate())
        .map(|(i, chunk)| {
            let client = &clients[i % IN_FLIGHT];
            async move {
                let ids: Vec<&str> = chunk.iter().map(|(id, _, _)| id.as_str()).collect();
                let dues: Vec<i64> = chunk.iter().map(|(_, d, _)| *d as i64).collect();
                let envs: Vec<&[u8]> = chunk.iter().map(|(_, _, e)| e.as_slice()).collect();
                client
                    .execute_typed(
                        sql,
                        &[
                            (&"bare", Type::TEXT),
                            (&ids, Type::TEXT_ARRAY),
                            (&dues, Type::INT8_ARRAY),
                            (&envs, Type::BYTEA_ARRAY),
                        ],
                    )
                    .await
                    .expect("bare upsert");
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<()>>()
        .await;
    envelopes.len() as f64 / t.elapsed().as_secs_f64()
}

/// The tasks table's tuples, size and autovacuum runs, as the statistics have them.
struct TableStats {
    live: i64,
    dead: i64,
    /// The table's heap, and its indexes.
    heap: i64,
    indexes: i64,
    autovacuums: i64,
}

impl TableStats {
    fn sizes(&self) -> String {
        format!(
            "{:.0} + {:.0} MB",
            self.heap as f64 / 1e6,
            self.indexes as f64 / 1e6
        )
    }
}

async fn table_stats(client: &tokio_postgres::Client) -> TableStats {
    let r = client
        .query_one(
            "SELECT n_live_tup, n_dead_tup, pg_table_size(relid), pg_indexes_size(relid),
                    autovacuum_count
             FROM pg_stat_user_tables WHERE relname = 'delaywheel_tasks'",
            &[],
        )
        .await
        .expect("stats");
    TableStats {
        live: r.get(0),
        dead: r.get(1),
        heap: r.get(2),
        indexes: r.get(3),
        autovacuums: r.get(4),
    }
}

fn main() {
    let mut args = Args::parse();
    if args.smoke {
        args.tasks = 20_000;
        args.pairs = 5_000;
    }
    // As shipped: fsync and synchronous_commit on. Autovacuum looks every second.
    let server = pg_server::PgServer::start_with(&["autovacuum_naptime=1s"]);
    let url = server.url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (client, settings) = rt.block_on(async {
        let client = server.client().await;
        let mut settings = Vec::new();
        for s in [
            "server_version",
            "synchronous_commit",
            "fsync",
            "shared_buffers",
        ] {
            let v: String = client
                .query_one(&format!("SHOW {s}"), &[])
                .await
                .expect("SHOW")
                .get(0);
            settings.push((s, v));
        }
        (client, settings)
    });
    let far = now_ms() + 3_600_000;
    let ids: Vec<String> = (0..args.tasks.max(args.pairs))
        .map(|i| format!("order:{i:08}"))
        .collect();

    // 1. schedule + cancel, interleaved rounds so both see the same machine state.
    let timer: Timer<String> = Timer::builder().build_channel(None).expect("timer").0;
    let persist = engine(&rt, &url, "pairs", Duration::from_millis(5), 1 << 20);
    persist.restore(RESTORE_PAGE).expect("restore");
    let (mut mem_ns, mut pg_ns) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        mem_ns.push(timer_pairs_ns(&timer, &ids[..args.pairs]));
        pg_ns.push(persistent_pairs_ns(&persist, &ids[..args.pairs], far));
    }
    let (mem_ns, pg_ns) = (median(mem_ns), median(pg_ns));
    assert!(persist.shutdown().is_empty(), "unwritten at shutdown");
    drop(persist);

    // 2. flusher upserts: journal N while the flusher waits, then time the flush.
    let payload = serde_json::Value::String("x".repeat(args.payload.saturating_sub(2)));
    let flush = upsert_round(&rt, &url, &ids[..args.tasks], &payload, far);
    let flush_per_s = args.tasks as f64 / flush.as_secs_f64();
    let first = rt.block_on(table_stats(&client));

    // 2b. PostgreSQL's own pace for the same statements, by a bare loop, same batch size.
    let batch = PersistConfig::new("unused://", "x").batch;
    let envelopes: Vec<(String, u64, Vec<u8>)> = ids[..args.tasks]
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let e = Envelope {
                id: id.clone(),
                topic: "order.close".into(),
                payload: payload.clone(),
                attempt: 0,
                created_at: now_ms(),
                headers: Default::default(),
                due_at: far + i as u64,
            };
            (
                id.clone(),
                e.due_at,
                serde_json::to_vec(&e).expect("encode"),
            )
        })
        .collect();
    let bare_per_s = rt.block_on(bare_upserts(&server, &envelopes, batch));
    drop(envelopes);
    rt.block_on(client.execute("DELETE FROM public.delaywheel_tasks WHERE ns = 'bare'", &[]))
        .expect("delete the bare loop's rows");

    // 3. restore into a new engine.
    let persist = engine(
        &rt,
        &url,
        "flush",
        Duration::from_millis(5),
        2 * args.tasks + 1,
    );
    let t = Instant::now();
    let report = persist.restore(RESTORE_PAGE).expect("restore");
    let restore = t.elapsed();
    let lost = ids[..args.tasks]
        .iter()
        .filter(|id| !persist.contains(id))
        .count();
    assert_eq!(lost, 0, "restore missed tasks ({report:?})");
    assert!(persist.shutdown().is_empty(), "unwritten at shutdown");
    drop(persist);

    // 4. removals: cancel every task in a waiting engine, then time the flush.
    let persist = engine(
        &rt,
        &url,
        "flush",
        Duration::from_secs(3_600),
        2 * args.tasks + 1,
    );
    persist.restore(RESTORE_PAGE).expect("restore");
    for id in &ids[..args.tasks] {
        persist.cancel(id);
    }
    let remove_per_s = args.tasks as f64 / timed_flush(&persist, FLUSH_TIMEOUT).as_secs_f64();
    assert!(persist.shutdown().is_empty(), "unwritten at shutdown");
    drop(persist);

    // 5. bloat: the table after the removals, then after autovacuum, then after a second round
    // of upserts into the vacuumed table.
    // A backend reports its statistics at most once a second (the engine's connections
    // closed at its shutdown, reporting theirs).
    std::thread::sleep(Duration::from_millis(1_100));
    let removed = rt.block_on(table_stats(&client));
    let t = Instant::now();
    // Autovacuum may have run during the removals already (every 10 000 dead rows): done when
    // it has run since, or left fewer than that.
    let vacuumed = rt.block_on(async {
        loop {
            let s = table_stats(&client).await;
            if s.autovacuums > removed.autovacuums
                || s.dead < 10_000
                || t.elapsed() > Duration::from_secs(120)
            {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let vacuum_wait = t.elapsed();
    upsert_round(&rt, &url, &ids[..args.tasks], &payload, far);
    let second = rt.block_on(table_stats(&client));
    let ratio_pairs = pg_ns / mem_ns;
    let ratio_flush = flush_per_s / bare_per_s;
    println!(
        "delaywheel PostgreSQL store report ({} tasks, {} B payloads; {})",
        args.tasks,
        args.payload,
        settings
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("{:<48} {:>14} {:>10}", "figure", "measured", "target");
    println!(
        "{:<48} {:>11.0} ns {:>10}",
        "schedule + cancel, in-memory Timer<String>", mem_ns, ""
    );
    println!(
        "{:<48} {:>11.0} ns {:>10}",
        "schedule + cancel, Persistent on PgStore",
        pg_ns,
        format!("≤ 2×: {ratio_pairs:.2}×")
    );
    println!(
        "{:<48} {:>10.0} /s {:>10}",
        "flusher upserts", flush_per_s, ""
    );
    println!(
        "{:<48} {:>10.0} /s {:>10}",
        "the same statements, bare loop",
        bare_per_s,
        format!("≥ 0.8×: {ratio_flush:.2}×")
    );
    println!("{:<48} {:>10.0} /s", "flusher removals", remove_per_s);
    println!(
        "{:<48} {:>12.2} s {:>10}",
        format!("restore of {} tasks", args.tasks),
        restore.as_secs_f64(),
        "≤ 10 s at 1M"
    );
    println!(
        "{:<48} {:>14}",
        format!("table after {} upserts: heap + indexes", args.tasks),
        first.sizes()
    );
    println!(
        "{:<48} {:>14}",
        "after their removal: live / dead tuples",
        format!("{} / {}", removed.live, removed.dead)
    );
    println!(
        "{:<48} {:>14}",
        "  heap + indexes; autovacuum runs so far",
        format!("{}; {}", removed.sizes(), removed.autovacuums)
    );
    println!(
        "{:<48} {:>12.1} s",
        "  dead tuples under 10 000 after",
        vacuum_wait.as_secs_f64()
    );
    println!(
        "{:<48} {:>14}",
        format!("after {} more upserts: heap + indexes", args.tasks),
        second.sizes()
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "tasks": args.tasks,
                "settings": settings.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<std::collections::BTreeMap<_, _>>(),
                "schedule_cancel_mem_ns": mem_ns,
                "schedule_cancel_pg_ns": pg_ns,
                "schedule_cancel_ratio": ratio_pairs,
                "flush_upserts_per_s": flush_per_s,
                "bare_upserts_per_s": bare_per_s,
                "flush_to_bare_ratio": ratio_flush,
                "flush_removals_per_s": remove_per_s,
                "restore_s": restore.as_secs_f64(),
                "restored": report.loaded,
                "heap_bytes_after_upserts": first.heap,
                "index_bytes_after_upserts": first.indexes,
                "live_tuples_after_removals": removed.live,
                "dead_tuples_after_removals": removed.dead,
                "heap_bytes_after_removals": removed.heap,
                "index_bytes_after_removals": removed.indexes,
                "autovacuums_by_removals": removed.autovacuums,
                "autovacuum_wait_s": vacuum_wait.as_secs_f64(),
                "dead_tuples_after_autovacuum": vacuumed.dead,
                "heap_bytes_after_second_round": second.heap,
                "index_bytes_after_second_round": second.indexes,
            })
        );
    }
}
