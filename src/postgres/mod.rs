//! A [`TaskStore`](crate::redis::TaskStore) on PostgreSQL (feature `postgres`):
//! [`PgStore`] keeps a [`Persistent`](crate::redis::Persistent) engine's pending tasks in a
//! table, for services that run PostgreSQL and no Redis.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use delaywheel::postgres::{PgConfig, PgStore};
//! use delaywheel::redis::{PersistConfig, Persistent};
//!
//! let store = PgStore::connect(PgConfig::new("host=/run/postgresql user=app dbname=app", "orders")).await?;
//! // The URL is not used with a store of its own.
//! let (engine, fired) = Persistent::with_store(PersistConfig::new("unused://", "orders"), store)?;
//! # drop((engine, fired));
//! # Ok(())
//! # }
//! ```
//!
//! # Schema
//!
//! Created by the store on first use, by numbered migrations recorded in
//! `<schema>.<prefix>_migrations` and run under a transaction-scoped advisory lock (so two
//! processes starting together migrate once). One table per role, keyed by namespace:
//!
//! | table | columns | |
//! |---|---|---|
//! | `<prefix>_tasks` | `ns text, id text, due_ms bigint, envelope bytea`, key `(ns, id)` | pending tasks; index `(ns, due_ms, id)` serves restore in due order |
//! | `<prefix>_dead` | `ns text, id text, reason text, raw bytea, at_ms bigint`, key `(ns, id)` | rows a restore could not decode |
//! | `<prefix>_lease` | `ns text, holder text, expires_at timestamptz, takes bigint, last_taker text`, key `ns` | the writer lease |
//!
//! A table that exists with other columns is refused at connect ([`PgError::Shape`], naming
//! the table). `schema` and `prefix` are settings ([`PgConfig`]).
//!
//! # Vacuum and bloat
//!
//! Every row of `<prefix>_tasks` is deleted soon after it is written, so its dead rows grow as
//! fast as tasks are written. Migration 2 sets the table's autovacuum by a count of dead rows,
//! not a share of the table (autovacuum's default, a fifth of the rows, lets a 1M-row table
//! carry 200k dead ones first): `autovacuum_vacuum_scale_factor = 0`,
//! `autovacuum_vacuum_threshold = 10000` (the same for inserts), and
//! `autovacuum_vacuum_cost_delay = 0`. Change them with `ALTER TABLE … SET (…)`; a later start
//! does not set them again. Measured (`examples/pg_report.rs`, 1M rows of 100-byte payloads):
//! autovacuum ran 22 times while the 1M rows were removed, and left none dead; the heap then
//! shrank to nothing, and a second million rows reused the indexes' space (293 MB heap +
//! 288 MB indexes, as after the first). Keep the default `fillfactor` (100): a rewrite of a
//! task changes `due_ms`, which is indexed, so it can never be a HOT update that free space
//! in the page would serve.
//!
//! # What differs from `RedisStore`
//!
//! * **Writes.** A flusher batch is one statement (`WITH … DELETE …, INSERT … ON CONFLICT DO
//!   UPDATE` from `unnest` arrays): one round trip, atomic, and checked against the writer
//!   lease in the same statement (a batch of a lease holder that lost its lease writes nothing
//!   and fails). The last operation per id wins, as in `RedisStore`.
//! * **The writer lease** is a row with an expiry on the server's clock (`now()`), not a
//!   session advisory lock (which would end with its connection, and which PgBouncer's
//!   transaction pooling breaks). A lease row that is gone when an engine that held it asks
//!   again (the table was emptied, a restore from an older backup) is
//!   [`Lease::Retaken`](crate::redis::Lease::Retaken): the engine writes its pending set back.
//! * **Restore** reads by keyset `(due_ms, id)`, never `OFFSET`; a server restart mid-scan
//!   loses no position (the keyset is a value, not a server cursor).
//! * **Statements** are sent unnamed, with their parameter types (`query_typed`): one round
//!   trip each, and no prepared statement kept on the server.
//! * **PgBouncer** in transaction mode works, any version: the store keeps no session state
//!   (no session advisory lock, no `SET`, no named prepared statement; the migrations' lock is
//!   scoped to their transaction). Tested behind PgBouncer 1.18 with fewer server connections
//!   than the store's pool: writes, restore by pages, dead letters and the lease.

mod error;
mod pg_store;
mod schema;

pub use error::PgError;
pub use pg_store::{PgConfig, PgStore};
