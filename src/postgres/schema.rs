//! The store's tables: numbered migrations, run once under an advisory lock, and the check
//! that tables which already exist have the store's shape.

use tokio_postgres::types::Type;

use super::error::PgError;

/// Dead (or newly inserted) rows of the tasks table after which autovacuum takes it up
/// (migration 2).
pub(crate) const VACUUM_EVERY: u32 = 10_000;

/// The names of the store's tables in one schema, with one prefix.
#[derive(Debug, Clone)]
pub(crate) struct Tables {
    pub(crate) schema: String,
    pub(crate) tasks: String,
    pub(crate) dead: String,
    pub(crate) lease: String,
    pub(crate) migrations: String,
}

/// Whether `name` is a plain identifier, safe to put in SQL text unquoted.
fn plain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl Tables {
    pub(crate) fn new(schema: &str, prefix: &str) -> Result<Tables, PgError> {
        for (what, name) in [("schema", schema), ("table prefix", prefix)] {
            if !plain(name) {
                return Err(PgError::Config(format!(
                    "{what} {name:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most 40 bytes)"
                )));
            }
        }
        let t = |n: &str| format!("{schema}.{prefix}_{n}");
        Ok(Tables {
            schema: schema.to_owned(),
            tasks: t("tasks"),
            dead: t("dead"),
            lease: t("lease"),
            migrations: t("migrations"),
        })
    }

    /// The migrations, in order; version `i + 1` is the `i`-th.
    fn migrations(&self) -> Vec<String> {
        let Tables {
            tasks, dead, lease, ..
        } = self;
        let index = format!("{}_due", tasks.rsplit('.').next().unwrap_or("tasks"));
        vec![
            format!(
            "CREATE TABLE IF NOT EXISTS {tasks} (
                ns text NOT NULL, id text NOT NULL, due_ms bigint NOT NULL,
                envelope bytea NOT NULL, PRIMARY KEY (ns, id));
             CREATE INDEX IF NOT EXISTS {index} ON {tasks} (ns, due_ms, id);
             CREATE TABLE IF NOT EXISTS {dead} (
                ns text NOT NULL, id text NOT NULL, reason text NOT NULL, raw bytea,
                at_ms bigint NOT NULL, PRIMARY KEY (ns, id));
             CREATE TABLE IF NOT EXISTS {lease} (
                ns text PRIMARY KEY, holder text, expires_at timestamptz,
                takes bigint NOT NULL DEFAULT 0, last_taker text);"
            ),
            // 2: the tasks table is a queue (every row is deleted soon after it is written),
            // so vacuum it by a count of dead rows, not a share of the table: autovacuum's
            // default (a fifth of the rows) lets a 1M-row table carry 200k dead ones first.
            // Its cost delay is off: a vacuum that keeps up matters more here than its I/O.
            format!(
                "ALTER TABLE {tasks} SET (
                    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = {VACUUM_EVERY},
                    autovacuum_vacuum_insert_scale_factor = 0,
                    autovacuum_vacuum_insert_threshold = {VACUUM_EVERY},
                    autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_cost_delay = 0);"
            ),
        ]
    }

    /// The columns each table must have: (table, [(column, type)]).
    fn shapes(&self) -> Vec<(&str, Vec<(&'static str, &'static str)>)> {
        vec![
            (
                self.tasks.as_str(),
                vec![
                    ("ns", "text"),
                    ("id", "text"),
                    ("due_ms", "bigint"),
                    ("envelope", "bytea"),
                ],
            ),
            (
                self.dead.as_str(),
                vec![
                    ("ns", "text"),
                    ("id", "text"),
                    ("reason", "text"),
                    ("raw", "bytea"),
                    ("at_ms", "bigint"),
                ],
            ),
            (
                self.lease.as_str(),
                vec![
                    ("ns", "text"),
                    ("holder", "text"),
                    ("expires_at", "timestamp with time zone"),
                    ("takes", "bigint"),
                    ("last_taker", "text"),
                ],
            ),
        ]
    }

    /// Checks the shape of the tables that exist, then runs the migrations not yet recorded,
    /// one transaction each, under an advisory lock held to the end of the transaction.
    pub(crate) async fn migrate(&self, client: &mut tokio_postgres::Client) -> Result<(), PgError> {
        let sql = |e: tokio_postgres::Error| PgError::from_driver(&e);
        self.check_shapes(client).await?;
        let tx = client.transaction().await.map_err(sql)?;
        tx.execute_typed(
            "SELECT pg_advisory_xact_lock(hashtext('delaywheel:migrate'))",
            &[],
        )
        .await
        .map_err(sql)?;
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {};
             CREATE TABLE IF NOT EXISTS {} (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());",
            self.schema, self.migrations
        ))
        .await
        .map_err(sql)?;
        let done: i32 = tx
            .query_typed_one(
                &format!("SELECT coalesce(max(version), 0) FROM {}", self.migrations),
                &[],
            )
            .await
            .map_err(sql)?
            .get(0);
        for (i, m) in self.migrations().iter().enumerate() {
            let version = i as i32 + 1;
            if version <= done {
                continue;
            }
            tx.batch_execute(m).await.map_err(sql)?;
            tx.execute_typed(
                &format!("INSERT INTO {} (version) VALUES ($1)", self.migrations),
                &[(&version, Type::INT4)],
            )
            .await
            .map_err(sql)?;
        }
        tx.commit().await.map_err(sql)?;
        // A table made by someone else meanwhile is checked too.
        self.check_shapes(client).await
    }

    /// Refuses a table that exists without the columns (and types) the store needs.
    async fn check_shapes(&self, client: &tokio_postgres::Client) -> Result<(), PgError> {
        for (table, columns) in self.shapes() {
            let (schema, name) = table.split_once('.').unwrap_or(("public", table));
            let rows = client
                .query_typed(
                    "SELECT column_name::text, data_type::text FROM information_schema.columns
                     WHERE table_schema = $1 AND table_name = $2",
                    &[(&schema, Type::TEXT), (&name, Type::TEXT)],
                )
                .await
                .map_err(|e| PgError::from_driver(&e))?;
            if rows.is_empty() {
                continue; // not made yet
            }
            let found: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
            for (column, kind) in columns {
                match found.iter().find(|(c, _)| c == column) {
                    None => {
                        return Err(PgError::Shape {
                            table: table.to_owned(),
                            detail: format!("no column {column} ({kind})"),
                        })
                    }
                    Some((_, k)) if k != kind => {
                        return Err(PgError::Shape {
                            table: table.to_owned(),
                            detail: format!("column {column} is {k}, not {kind}"),
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }
}
