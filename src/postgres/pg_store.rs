//! [`PgStore`]: the pending tasks of [`Persistent`](crate::redis::Persistent) engines in a
//! PostgreSQL table, through a pool of `tokio-postgres` connections (`deadpool-postgres`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use parking_lot::Mutex;
use tokio_postgres::types::Type;
use tokio_postgres::NoTls;

use crate::redis::{Broken, Cursor, Lease, Op, Row, Rows, StoreError, TaskStore};

use super::error::PgError;
use super::schema::Tables;

/// Where a [`PgStore`] keeps its tasks.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PgConfig {
    /// A `tokio-postgres` connection string: key=value (`host=/run/postgresql user=app
    /// password=… dbname=app`) or a URL (`postgresql://app:…@db:5432/app`). No TLS.
    pub conn: String,
    /// The engine's namespace: its rows carry it, so engines of several namespaces share the
    /// tables.
    pub namespace: String,
    /// The schema of the tables (default `public`; created if missing).
    pub schema: String,
    /// The tables' names start with this and `_` (default `delaywheel`).
    pub prefix: String,
    /// Connections in the pool, at most (default 4: the flusher's writes in flight, a restore
    /// and the lease).
    pub pool_size: usize,
}

impl PgConfig {
    /// Defaults for `conn` and `namespace`.
    pub fn new(conn: impl Into<String>, namespace: impl Into<String>) -> PgConfig {
        PgConfig {
            conn: conn.into(),
            namespace: namespace.into(),
            schema: "public".into(),
            prefix: "delaywheel".into(),
            pool_size: 4,
        }
    }
}

/// A [`TaskStore`] on PostgreSQL. Cheap to clone (the clones share the pool).
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    ns: Arc<str>,
    t: Arc<Tables>,
    /// The SQL of each call, made once.
    sql: Arc<Sql>,
    /// The engine whose writes are checked against the lease, once it took it.
    holder: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("namespace", &self.ns)
            .field("tasks", &self.t.tasks)
            .finish()
    }
}

struct Sql {
    apply: String,
    rows_from_start: String,
    rows_after: String,
    dead_letter: String,
    delete_all: String,
    insert_all: String,
    lease_row: String,
    lease_lock: String,
    lease_take: String,
    lease_renew: String,
    release: String,
}

impl Sql {
    fn new(t: &Tables) -> Sql {
        let Tables {
            tasks, dead, lease, ..
        } = t;
        // $6: the lease holder whose writes these are ('' before any lease: not checked).
        let ok = format!(
            "ok AS (SELECT ($6::text = '' OR EXISTS (SELECT 1 FROM {lease}
                 WHERE ns = $1 AND holder = $6 AND expires_at > now())) AS ok)"
        );
        Sql {
            apply: format!(
                "WITH {ok},
                 del AS (DELETE FROM {tasks} t USING ok, unnest($2::text[]) AS r(id)
                         WHERE ok.ok AND t.ns = $1 AND t.id = r.id),
                 ins AS (INSERT INTO {tasks} (ns, id, due_ms, envelope)
                         SELECT $1, u.id, u.due, u.env
                         FROM unnest($3::text[], $4::int8[], $5::bytea[]) AS u(id, due, env), ok
                         WHERE ok.ok
                         ON CONFLICT (ns, id) DO UPDATE
                         SET due_ms = EXCLUDED.due_ms, envelope = EXCLUDED.envelope)
                 SELECT ok FROM ok"
            ),
            rows_from_start: format!(
                "SELECT id, due_ms, envelope FROM {tasks} WHERE ns = $1
                 ORDER BY due_ms, id LIMIT $2"
            ),
            rows_after: format!(
                "SELECT id, due_ms, envelope FROM {tasks} WHERE ns = $1 AND (due_ms, id) > ($3, $4)
                 ORDER BY due_ms, id LIMIT $2"
            ),
            dead_letter: format!(
                "WITH b AS (SELECT * FROM unnest($2::text[], $3::bytea[], $4::text[]) AS b(id, raw, reason)),
                 moved AS (DELETE FROM {tasks} t USING b
                           WHERE t.ns = $1 AND t.id = b.id AND t.envelope IS NOT DISTINCT FROM b.raw
                           RETURNING t.id)
                 INSERT INTO {dead} (ns, id, reason, raw, at_ms)
                 SELECT $1, b.id, b.reason, b.raw, $5 FROM b
                 WHERE b.id IN (SELECT id FROM moved) OR b.raw IS NULL
                 ON CONFLICT (ns, id) DO UPDATE
                 SET reason = EXCLUDED.reason, raw = EXCLUDED.raw, at_ms = EXCLUDED.at_ms"
            ),
            delete_all: format!("DELETE FROM {tasks} WHERE ns = $1"),
            insert_all: format!(
                "INSERT INTO {tasks} (ns, id, due_ms, envelope)
                 SELECT $1, u.id, u.due, u.env
                 FROM unnest($2::text[], $3::int8[], $4::bytea[]) AS u(id, due, env)
                 ON CONFLICT (ns, id) DO UPDATE SET due_ms = EXCLUDED.due_ms, envelope = EXCLUDED.envelope"
            ),
            lease_row: format!("INSERT INTO {lease} (ns) VALUES ($1) ON CONFLICT (ns) DO NOTHING"),
            lease_lock: format!(
                "SELECT holder, coalesce(expires_at > now(), false), last_taker
                 FROM {lease} WHERE ns = $1 FOR UPDATE"
            ),
            lease_take: format!(
                "UPDATE {lease} SET holder = $2, expires_at = now() + make_interval(secs => $3),
                 takes = takes + 1, last_taker = $2 WHERE ns = $1"
            ),
            lease_renew: format!(
                "UPDATE {lease} SET expires_at = now() + make_interval(secs => $3)
                 WHERE ns = $1 AND holder = $2"
            ),
            release: format!(
                "UPDATE {lease} SET holder = NULL, expires_at = NULL WHERE ns = $1 AND holder = $2"
            ),
        }
    }
}

fn store_err(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::new(e)
}

impl PgStore {
    /// Connects (one connection first, so that a server that is down or refuses the
    /// credentials is a typed error now), checks the shape of the tables that exist, and
    /// creates or migrates the others.
    pub async fn connect(cfg: PgConfig) -> Result<PgStore, PgError> {
        let t = Tables::new(&cfg.schema, &cfg.prefix)?;
        if cfg.namespace.is_empty() {
            return Err(PgError::Config("the namespace is empty".into()));
        }
        if cfg.pool_size == 0 {
            return Err(PgError::Config("pool_size must be at least 1".into()));
        }
        let pg: tokio_postgres::Config = cfg
            .conn
            .parse()
            .map_err(|e: tokio_postgres::Error| PgError::Config(e.to_string()))?;
        let manager = Manager::from_config(
            pg,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(cfg.pool_size)
            .build()
            .map_err(|e| PgError::Config(e.to_string()))?;
        let mut client = pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => PgError::from_driver(&e),
            other => PgError::Unreachable(other.to_string()),
        })?;
        t.migrate(&mut client).await?;
        drop(client);
        Ok(PgStore {
            pool,
            ns: cfg.namespace.into(),
            sql: Arc::new(Sql::new(&t)),
            t: Arc::new(t),
            holder: Arc::new(Mutex::new(None)),
        })
    }

    /// The tables' names: tasks, dead letters, lease.
    pub fn tables(&self) -> (&str, &str, &str) {
        (&self.t.tasks, &self.t.dead, &self.t.lease)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(store_err)
    }

    /// Applies a batch in one statement (see [`TaskStore::apply`]). Once the engine holds the
    /// writer lease, the statement writes nothing unless the lease is still its own, and the
    /// call fails.
    pub async fn apply(&self, ops: &[Op]) -> Result<(), StoreError> {
        // The last operation per id wins: one row per id in the statement (ON CONFLICT cannot
        // touch a row twice).
        let ops = Op::last_per_id(ops);
        let removed: Vec<&str> = ops
            .iter()
            .filter(|op| matches!(op, Op::Remove(_)))
            .map(|op| op.id())
            .collect();
        let (ids, dues, envs) = upsert_columns(ops);
        if removed.is_empty() && ids.is_empty() {
            return Ok(());
        }
        let holder = self.holder.lock().clone().unwrap_or_default();
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                &self.sql.apply,
                &[
                    (&&*self.ns, Type::TEXT),
                    (&removed, Type::TEXT_ARRAY),
                    (&ids, Type::TEXT_ARRAY),
                    (&dues, Type::INT8_ARRAY),
                    (&envs, Type::BYTEA_ARRAY),
                    (&holder, Type::TEXT),
                ],
            )
            .await
            .map_err(store_err)?;
        if !row.get::<_, bool>(0) {
            return Err(store_err(format!(
                "NOTHELD: the writer lease of namespace {} is no longer {holder}'s: nothing written",
                self.ns
            )));
        }
        Ok(())
    }

    /// One page of rows in (due, id) order after `cursor` (see [`TaskStore::rows`]).
    pub async fn rows(&self, cursor: Cursor, count: usize) -> Result<Rows, StoreError> {
        let limit = i64::try_from(count.max(1)).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let rows = if cursor.is_start() {
            client
                .query_typed(
                    &self.sql.rows_from_start,
                    &[(&&*self.ns, Type::TEXT), (&limit, Type::INT8)],
                )
                .await
        } else {
            let (due, id) = decode_cursor(&cursor)
                .ok_or_else(|| StoreError::cursor_lost("not a cursor of this store"))?;
            client
                .query_typed(
                    &self.sql.rows_after,
                    &[
                        (&&*self.ns, Type::TEXT),
                        (&limit, Type::INT8),
                        (&due, Type::INT8),
                        (&id, Type::TEXT),
                    ],
                )
                .await
        }
        .map_err(store_err)?;
        let mut out = Rows::default();
        for r in &rows {
            let (id, due, envelope): (String, i64, Vec<u8>) = (r.get(0), r.get(1), r.get(2));
            out.rows.push(Row {
                id,
                due: due.to_string(),
                envelope: Some(envelope),
            });
        }
        if rows.len() as i64 == limit {
            let last = rows
                .last()
                .map(|r| (r.get::<_, i64>(1), r.get::<_, String>(0)));
            out.next = last.map(|(due, id)| encode_cursor(due, &id));
        }
        Ok(out)
    }

    /// Moves broken rows to the dead-letter table, with their reason (see
    /// [`TaskStore::dead_letter`]); a row rewritten since it was read stays.
    pub async fn dead_letter(&self, broken: &[Broken], now_ms: u64) -> Result<(), StoreError> {
        if broken.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = broken.iter().map(|b| b.id.as_str()).collect();
        let raws: Vec<Option<&[u8]>> = broken.iter().map(|b| b.raw.as_deref()).collect();
        let reasons: Vec<String> = broken.iter().map(|b| b.reason.to_string()).collect();
        let at = i64::try_from(now_ms).unwrap_or(i64::MAX);
        let client = self.client().await?;
        client
            .execute_typed(
                &self.sql.dead_letter,
                &[
                    (&&*self.ns, Type::TEXT),
                    (&ids, Type::TEXT_ARRAY),
                    (&raws, Type::BYTEA_ARRAY),
                    (&reasons, Type::TEXT_ARRAY),
                    (&at, Type::INT8),
                ],
            )
            .await
            .map_err(store_err)?;
        Ok(())
    }

    /// Replaces the namespace's rows with `tasks`' upserts in one transaction (see
    /// [`TaskStore::replace_all`]).
    pub async fn replace_all(&self, tasks: &[Op]) -> Result<(), StoreError> {
        // The last upsert per id (a removal in it is ignored).
        let mut last: HashMap<&str, &Op> = HashMap::with_capacity(tasks.len());
        for op in tasks {
            if let Op::Upsert { id, .. } = op {
                last.insert(id, op);
            }
        }
        let (ids, dues, envs) = upsert_columns(last.into_values());
        let holder = self.holder.lock().clone().unwrap_or_default();
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(store_err)?;
        if !holder.is_empty() {
            let held = tx
                .query_typed_opt(&self.sql.lease_lock, &[(&&*self.ns, Type::TEXT)])
                .await
                .map_err(store_err)?
                .is_some_and(|r| {
                    r.get::<_, Option<String>>(0).as_deref() == Some(holder.as_str())
                        && r.get::<_, bool>(1)
                });
            if !held {
                return Err(store_err(format!(
                    "NOTHELD: the writer lease of namespace {} is no longer {holder}'s: nothing replaced",
                    self.ns
                )));
            }
        }
        tx.execute_typed(&self.sql.delete_all, &[(&&*self.ns, Type::TEXT)])
            .await
            .map_err(store_err)?;
        tx.execute_typed(
            &self.sql.insert_all,
            &[
                (&&*self.ns, Type::TEXT),
                (&ids, Type::TEXT_ARRAY),
                (&dues, Type::INT8_ARRAY),
                (&envs, Type::BYTEA_ARRAY),
            ],
        )
        .await
        .map_err(store_err)?;
        tx.commit().await.map_err(store_err)?;
        Ok(())
    }

    /// Takes or renews the writer lease (see [`TaskStore::lease`]), on the server's clock.
    pub async fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> Result<Lease, StoreError> {
        let secs = ttl.as_secs_f64().max(0.001);
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(store_err)?;
        let ns_str: &str = &self.ns;
        let ns = || {
            (
                &ns_str as &(dyn tokio_postgres::types::ToSql + Sync),
                Type::TEXT,
            )
        };
        let made = tx
            .execute_typed(&self.sql.lease_row, &[ns()])
            .await
            .map_err(store_err)?
            == 1;
        let row = tx
            .query_typed_one(&self.sql.lease_lock, &[ns()])
            .await
            .map_err(store_err)?;
        let (current, live, last): (Option<String>, bool, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        let answer = if live && current.as_deref() == Some(holder) {
            tx.execute_typed(
                &self.sql.lease_renew,
                &[ns(), (&holder, Type::TEXT), (&secs, Type::FLOAT8)],
            )
            .await
            .map_err(store_err)?;
            Lease::Held
        } else if live {
            Lease::Other(current.unwrap_or_default())
        } else if !first && last.as_deref().is_some_and(|l| l != holder) {
            Lease::Other(last.unwrap_or_default())
        } else {
            tx.execute_typed(
                &self.sql.lease_take,
                &[ns(), (&holder, Type::TEXT), (&secs, Type::FLOAT8)],
            )
            .await
            .map_err(store_err)?;
            if !first && made {
                Lease::Retaken(
                    "the lease's row was gone: the table lost the namespace's rows (emptied, or \
                     restored from an older backup)"
                        .into(),
                )
            } else {
                Lease::Held
            }
        };
        tx.commit().await.map_err(store_err)?;
        if !matches!(answer, Lease::Other(_)) {
            *self.holder.lock() = Some(holder.to_owned());
        }
        Ok(answer)
    }

    /// Gives the lease up if `holder` has it.
    pub async fn release(&self, holder: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute_typed(
                &self.sql.release,
                &[(&&*self.ns, Type::TEXT), (&holder, Type::TEXT)],
            )
            .await
            .map_err(store_err)?;
        Ok(())
    }
}

/// The upserts among `ops` as the columns of an `unnest` statement: ids, due times (a due time
/// past `i64::MAX` saturates), envelopes.
fn upsert_columns<'a>(
    ops: impl IntoIterator<Item = &'a Op>,
) -> (Vec<&'a str>, Vec<i64>, Vec<&'a [u8]>) {
    let (mut ids, mut dues, mut envs) = (Vec::new(), Vec::new(), Vec::new());
    for op in ops {
        if let Op::Upsert {
            id,
            due_at,
            envelope,
        } = op
        {
            ids.push(id.as_str());
            dues.push(i64::try_from(*due_at).unwrap_or(i64::MAX));
            envs.push(envelope.as_slice());
        }
    }
    (ids, dues, envs)
}

/// A cursor: the last row's due time and id.
fn encode_cursor(due: i64, id: &str) -> Cursor {
    let mut b = due.to_be_bytes().to_vec();
    b.extend_from_slice(id.as_bytes());
    Cursor::new(b)
}

fn decode_cursor(c: &Cursor) -> Option<(i64, String)> {
    let b = c.as_bytes();
    let due = i64::from_be_bytes(b.get(..8)?.try_into().ok()?);
    Some((due, String::from_utf8(b[8..].to_vec()).ok()?))
}

impl TaskStore for PgStore {
    fn apply(
        &self,
        ops: &[Op],
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        PgStore::apply(self, ops)
    }

    fn rows(
        &self,
        cursor: Cursor,
        count: usize,
    ) -> impl std::future::Future<Output = Result<Rows, StoreError>> + Send {
        PgStore::rows(self, cursor, count)
    }

    fn dead_letter(
        &self,
        broken: &[Broken],
        now_ms: u64,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        PgStore::dead_letter(self, broken, now_ms)
    }

    fn replace_all(
        &self,
        tasks: &[Op],
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        PgStore::replace_all(self, tasks)
    }

    fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> impl std::future::Future<Output = Result<Lease, StoreError>> + Send {
        PgStore::lease(self, holder, ttl, first)
    }

    fn release(
        &self,
        holder: &str,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        PgStore::release(self, holder)
    }
}
