//! A store of pending tasks on a Redis ZSET + HASH: batched atomic writes, paged reads that
//! sort out broken entries, and a dead-letter key.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::redis::layout::{KeyLayout, NamespaceInUse};
use crate::redis::link::{claim_namespaces, Link, PERSISTENT_ROLE};
use crate::redis::persist::rows::{Broken, BrokenReason, Cursor, Op, Page, Row, Rows};
use crate::redis::persist::task_store::{Lease, TaskStore};
use crate::redis::store_error::StoreError;

/// How long a snapshot's scratch keys live if the snapshot never swaps them in (an hour).
const SCRATCH_TTL_MS: u64 = 3_600_000;

/// `lua/swap_in.lua`: its header gives its keys, arguments and reply.
static SWAP_IN: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/swap_in.lua")));

/// `lua/lease.lua`: its header gives its keys, arguments and reply.
static LEASE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/lease.lua")));

/// `lua/undo_half_applied.lua`: its header gives its keys, arguments and reply.
static UNDO_HALF_APPLIED: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/undo_half_applied.lua")));

/// `lua/release.lua`: its header gives its keys, arguments and reply.
static RELEASE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/release.lua")));

/// `lua/page.lua`: its header gives its keys, arguments and reply.
static PAGE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/page.lua")));

/// `lua/clear.lua`: its header gives its keys, arguments and reply.
static CLEAR: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/clear.lua")));

/// `lua/remove.lua`: its header gives its keys, arguments and reply.
static REMOVE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/remove.lua")));

/// `lua/dead_letter.lua`: its header gives its keys, arguments and reply.
static DEAD_LETTER: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/dead_letter.lua")));

/// The most entries a page of a restore reads (a larger page size is taken as this): a
/// Redis command runs whole while other clients wait, and Redis refuses a `COUNT` past
/// `i64::MAX`.
pub const MAX_PAGE: usize = 100_000;

/// How many times a restore's read is sent before its error is returned.
const READ_TRIES: u32 = 4;

/// Pending tasks of one namespace in Redis, on one node or a Redis Cluster. Cheap to clone
/// (one multiplexed connection that reconnects by itself).
#[derive(Clone)]
pub struct RedisStore {
    keys: KeyLayout,
    conn: Link,
    /// What `rows` read ahead for the page after the one it returned.
    ahead: Arc<Mutex<Option<Ahead>>>,
    /// The engine that took the writer lease through this store (and its clones): its removals
    /// and snapshot swaps are checked against the lease.
    holder: Arc<Mutex<Option<String>>>,
    /// The `run_id` of the server that last answered a lease call that held the lease: a lease
    /// held on another server is [`Lease::Retaken`].
    server: Arc<Mutex<Option<String>>>,
}

/// Empties the read-ahead slot when dropped.
struct ClearOnDrop<'a>(&'a Mutex<Option<Ahead>>);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().take();
    }
}

/// A PAGE reply, as bytes (a member need not be UTF-8).
struct Fetched {
    /// The server that read the page.
    run_id: String,
    /// `member, score, member, score, ...`.
    flat: Vec<Vec<u8>>,
    /// Each member's envelope, `None` where the HASH has none.
    envelopes: Vec<Option<Vec<u8>>>,
}

/// A ZSET member that is not UTF-8, so not a task id, and its envelope if any.
struct Unreadable {
    member: Vec<u8>,
    envelope: Option<Vec<u8>>,
}

/// A page being read ahead: the cursor it starts at, and its PAGE call, sent as soon as the
/// page before it came back.
struct Ahead {
    cursor: Cursor,
    count: usize,
    page: tokio::task::JoinHandle<Result<Fetched, StoreError>>,
}

/// Where a Redis scan is: on which server (`run_id`), after which row (its score as Redis
/// prints it, and its member). Encoded in a [`Cursor`] as `run_id \n score \n member`.
struct Position {
    run_id: String,
    score: Vec<u8>,
    member: Vec<u8>,
}

impl Position {
    fn encode(&self) -> Cursor {
        let mut bytes =
            Vec::with_capacity(self.run_id.len() + self.score.len() + self.member.len() + 2);
        bytes.extend_from_slice(self.run_id.as_bytes());
        bytes.push(b'\n');
        bytes.extend_from_slice(&self.score);
        bytes.push(b'\n');
        bytes.extend_from_slice(&self.member);
        Cursor::new(bytes)
    }

    /// `None` for a cursor that this store did not make.
    fn decode(cursor: &Cursor) -> Option<Position> {
        let mut parts = cursor.as_bytes().splitn(3, |b| *b == b'\n');
        let run_id = String::from_utf8(parts.next()?.to_vec()).ok()?;
        let score = parts.next()?.to_vec();
        let member = parts.next()?.to_vec();
        Some(Position {
            run_id,
            score,
            member,
        })
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("keys", &self.keys)
            .finish()
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://user:password@host:port/db`, `rediss://` for TLS where the
    /// redis crate is built with it, `redis+unix:///path`) for the namespace whose keys are
    /// `keys`. Outside a Tokio runtime, or on one without its time or I/O driver, it returns
    /// an error.
    pub async fn connect(url: &str, keys: KeyLayout) -> Result<RedisStore, StoreError> {
        Ok(RedisStore::on(Link::node(url).await?, keys))
    }

    /// Connects to the Redis Cluster that `nodes` (seed node URLs) belong to. Every key of a
    /// namespace carries one hash tag, so the namespace lives in one slot and each batch is
    /// still one MULTI on the node that owns it.
    pub async fn connect_cluster(
        nodes: &[String],
        keys: KeyLayout,
    ) -> Result<RedisStore, StoreError> {
        Ok(RedisStore::on(Link::cluster(nodes).await?, keys))
    }

    /// For a configuration: the cluster of `cluster_nodes` when there are any, else `url`.
    pub(crate) async fn open(
        url: &str,
        cluster_nodes: &[String],
        keys: KeyLayout,
    ) -> Result<RedisStore, StoreError> {
        Ok(RedisStore::on(Link::open(url, cluster_nodes).await?, keys))
    }

    /// A store of `keys` on the connection `conn`.
    fn on(conn: Link, keys: KeyLayout) -> RedisStore {
        RedisStore {
            keys,
            conn,
            ahead: Arc::default(),
            holder: Arc::default(),
            server: Arc::default(),
        }
    }

    /// The namespace's keys.
    pub fn keys(&self) -> &KeyLayout {
        &self.keys
    }

    /// The engine whose writes the fenced scripts check the lease for (empty: none, no check).
    fn holder(&self) -> String {
        self.holder.lock().clone().unwrap_or_default()
    }

    /// Applies a batch atomically with multi-member commands, so the ZSET and the HASH change
    /// together: one MULTI/EXEC, or for a batch of removals only one Lua script. When an id
    /// appears more than once, its last operation wins. Once an engine has taken the writer
    /// lease through this store ([`lease`](Self::lease)), a batch of removals is refused
    /// (`NOTHELD`, nothing removed) unless the lease is still that engine's, so one that lost
    /// it cannot delete what the engine that took it wrote; a batch with writes is not checked
    /// (the engine checks its lease before each batch). A Redis at `maxmemory` runs a batch of
    /// removals only (the flusher sends removals in batches of their own, so cancels and acks
    /// reach a full Redis and free its memory) and refuses one with writes.
    ///
    /// Ops are written as given, not checked: an upsert that breaks [`Op`]'s limits (an empty
    /// id, a due time past 2^53 − 1, an envelope naming another id) is stored, and the next
    /// restore dead-letters it with its reason. (The engine checks each envelope when it is
    /// scheduled; refusing a whole batch here would hold up every write behind it.)
    pub async fn apply(&self, ops: &[Op]) -> Result<(), StoreError> {
        // The last operation per id wins; the others keep their order (the flusher sends them
        // sorted by due time, which keeps Redis's skiplist inserts close together).
        let (mut zadd, mut hset, mut remove) =
            (redis::cmd("ZADD"), redis::cmd("HSET"), Vec::<&str>::new());
        zadd.arg(self.keys.due());
        hset.arg(self.keys.tasks());
        let mut upserts = 0;
        for op in Op::last_per_id(ops) {
            match op {
                Op::Upsert {
                    id,
                    due_at,
                    envelope,
                } => {
                    zadd.arg(*due_at).arg(id.as_str());
                    hset.arg(id.as_str()).arg(envelope.as_slice());
                    upserts += 1;
                }
                Op::Remove(id) => remove.push(id),
            }
        }
        let mut conn = self.conn.clone();
        if upserts == 0 {
            if remove.is_empty() {
                return Ok(());
            }
            let holder = self.holder();
            let mut script = REMOVE.prepare_invoke();
            script
                .key(self.keys.due())
                .key(self.keys.tasks())
                .key(self.keys.engine())
                .arg(holder);
            for id in &remove {
                script.arg(*id);
            }
            script.invoke_async::<i64>(&mut conn).await?;
            return Ok(());
        }
        // Writes go in a MULTI, not checked against the lease: a script that passes every
        // envelope through Lua took them at half the pace (150k-210k against 240k-310k
        // writes/s in an A/B of `persist_report`).
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.add_command(zadd).ignore();
        pipe.add_command(hset).ignore();
        if !remove.is_empty() {
            pipe.cmd("ZREM").arg(self.keys.due()).arg(&remove).ignore();
            pipe.cmd("HDEL")
                .arg(self.keys.tasks())
                .arg(&remove)
                .ignore();
        }
        match pipe.query_async::<()>(&mut conn).await {
            Err(e) if crate::redis::link::wrong_type(&e) => {
                let ids: Vec<&str> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::Upsert { id, .. } => Some(id.as_str()),
                        Op::Remove(_) => None,
                    })
                    .collect();
                Err(self.undo_half_applied(&ids, e).await)
            }
            reply => Ok(reply?),
        }
    }

    /// A batch's MULTI met a key of the wrong type: Redis ran the other commands of it (a
    /// transaction does not roll back), so the envelopes are in `{ns}:tasks` with no entry in
    /// `{ns}:due` that a restore would read them by, or the other way round. Takes this
    /// batch's writes `ids` back out of the key that took them, so the store is left as it
    /// was, and returns the error, naming the key (the flusher keeps the batch in its journal
    /// and writes it again once the key is fixed). Loud: an error log and
    /// `delaywheel_store_wrong_type_total`.
    async fn undo_half_applied(&self, ids: &[&str], e: redis::RedisError) -> StoreError {
        let mut conn = self.conn.clone();
        let mut undo = UNDO_HALF_APPLIED.prepare_invoke();
        undo.key(self.keys.due()).key(self.keys.tasks());
        for id in ids {
            undo.arg(*id);
        }
        let types = match undo.invoke_async::<(String, String)>(&mut conn).await {
            Ok(types) => types,
            Err(undo_error) => {
                tracing::error!(error = %undo_error, "a batch met a key of the wrong type, and taking its writes back failed");
                return StoreError::new(e);
            }
        };
        let (key, found, expected) = if !matches!(types.0.as_str(), "zset" | "none") {
            (self.keys.due(), types.0, "zset")
        } else {
            (self.keys.tasks(), types.1, "hash")
        };
        metrics::counter!("delaywheel_store_wrong_type_total", "key" => key.to_owned())
            .increment(1);
        tracing::error!(%key, %found, expected, "a key of the namespace has the wrong type: the batch is not written (its writes were taken back) until the key is fixed");
        StoreError::new(format!(
            "key {key} holds a {found}, not a {expected}: the batch was not written ({e})"
        ))
    }

    /// Reads one page of about `count` entries, starting at `cursor`
    /// ([`Cursor::start`] to begin), decoded and sorted out: [`rows`](Self::rows) then
    /// [`Rows::classify`].
    pub async fn page(&self, cursor: Cursor, count: usize) -> Result<Page, StoreError> {
        Ok(self.rows(cursor, count).await?.classify())
    }

    /// Reads one page of `count` stored rows (0 is taken as 1, and more than [`MAX_PAGE`] as
    /// that), starting at `cursor` ([`Cursor::start`] to begin), as stored, in the ZSET's
    /// order (due time, then id bytes). Each page is one read-only script that reads the rows
    /// and their envelopes together, so a page never mixes two servers' data.
    ///
    /// Pages are keyset pages: the cursor is the last row read (its due time and id), not a
    /// position in Redis's hash table, so rows added or removed meanwhile shift nothing, and a
    /// row is never skipped, however many share one due time. The cursor also names the
    /// server (`run_id`) that answered: a page that comes from another server (Redis restarted
    /// or failed over during the scan) fails with [`StoreError::cursor_lost`], and the caller
    /// starts again from the start. Within a tokio runtime the next page is read ahead, for the
    /// call that continues at its cursor; a call at any other cursor drops it. A row changed
    /// while the scan runs (rescheduled past the cursor) may be returned twice (callers
    /// dedupe by id).
    ///
    /// Not only a read: members that are not UTF-8 (only another client writes such) cannot be
    /// rows, and would fail every restore; they are moved to `{ns}:dead` here, under their own
    /// bytes, and counted in [`Rows::set_aside`].
    pub async fn rows(&self, cursor: Cursor, count: usize) -> Result<Rows, StoreError> {
        let count = count.clamp(1, MAX_PAGE);
        let after = match cursor.is_start() {
            true => None,
            false => Some(Position::decode(&cursor).ok_or_else(|| {
                StoreError::cursor_lost("the cursor was not made by a RedisStore")
            })?),
        };
        let ahead = self
            .ahead
            .lock()
            .take()
            .filter(|a| (&a.cursor, a.count) == (&cursor, count));
        // A call given up half way (its caller stopped scanning) leaves nothing read ahead.
        let abandoned = ClearOnDrop(&self.ahead);
        let Fetched {
            run_id,
            flat,
            envelopes,
        } = match ahead {
            Some(a) => a
                .page
                .await
                .map_err(|e| StoreError::new(format!("reading a page: {e}")))??,
            None => self.fetch(after.as_ref(), count).await?,
        };
        std::mem::forget(abandoned);
        if let Some(after) = &after {
            if after.run_id != run_id {
                return Err(StoreError::cursor_lost(format!(
                    "the Redis server changed during the scan (run_id {} became {run_id})",
                    after.run_id
                )));
            }
        }
        let next = (envelopes.len() >= count).then(|| Position {
            run_id,
            score: flat[flat.len() - 1].clone(),
            member: flat[flat.len() - 2].clone(),
        });
        let next = next.map(|position| {
            let cursor = position.encode();
            // The next page, sent now: Redis reads it while this one is decoded and loaded.
            if tokio::runtime::Handle::try_current().is_ok() {
                let this = self.clone();
                let page = tokio::spawn(async move { this.fetch(Some(&position), count).await });
                *self.ahead.lock() = Some(Ahead {
                    cursor: cursor.clone(),
                    count,
                    page,
                });
            }
            cursor
        });
        self.set_aside(zip_rows(next, flat, envelopes)).await
    }

    /// Moves members that are not UTF-8 to the dead-letter hash (under the same bytes), as
    /// [`dead_letter`](Self::dead_letter) does broken rows: a restore cannot load them, and
    /// left in place they would fail every restore after this one.
    async fn set_aside(
        &self,
        (mut rows, unreadable): (Rows, Vec<Unreadable>),
    ) -> Result<Rows, StoreError> {
        if unreadable.is_empty() {
            return Ok(rows);
        }
        let now_ms = crate::redis::wall_clock::now_ms();
        let entries: Vec<(&[u8], String)> = unreadable
            .iter()
            .map(|u| {
                tracing::warn!(id = %String::from_utf8_lossy(&u.member), "task dead-lettered: the id is not UTF-8");
                let record = dead_record("the id is not UTF-8", u.envelope.as_deref(), now_ms);
                (u.member.as_slice(), record)
            })
            .collect();
        self.bury(&entries).await?;
        rows.set_aside = unreadable.len();
        Ok(rows)
    }

    /// One PAGE call: up to `count` rows after `after` (from the start if `None`), and the
    /// `run_id` of the server that read them. Sent again (up to [`READ_TRIES`] in all, a
    /// little apart) while it fails with an error a retry can get past: a dropped connection,
    /// a timeout, a cluster refusing it while it reconfigures. A read can run twice without
    /// harm, and one failed page must not end a restore of a million rows.
    async fn fetch(&self, after: Option<&Position>, count: usize) -> Result<Fetched, StoreError> {
        let mut tries = 1;
        loop {
            let mut script = PAGE.prepare_invoke();
            script
                .key(self.keys.due())
                .key(self.keys.tasks())
                .arg(count);
            if let Some(after) = after {
                script
                    .arg(after.score.as_slice())
                    .arg(after.member.as_slice());
            }
            let mut conn = self.conn.clone();
            match script
                .invoke_async::<(String, Vec<Vec<u8>>, Vec<Option<Vec<u8>>>)>(&mut conn)
                .await
            {
                Err(e) if tries < READ_TRIES && crate::redis::link::passing(&e) => {
                    tracing::debug!(error = %e, "a page read failed; sending it again");
                    tokio::time::sleep(Duration::from_millis(50) * tries).await;
                    tries += 1;
                }
                Err(e) => return Err(e.into()),
                Ok((run_id, flat, envelopes)) => {
                    if flat.len() != envelopes.len() * 2 {
                        return Err(StoreError::new(format!(
                            "unexpected page reply: {} rows and {} envelopes",
                            flat.len() / 2,
                            envelopes.len()
                        )));
                    }
                    return Ok(Fetched {
                        run_id,
                        flat,
                        envelopes,
                    });
                }
            }
        }
    }

    /// Moves broken entries to the dead-letter hash with their reason, the raw bytes and the
    /// time (ms since the epoch), and removes them from the live keys, in one script. An entry
    /// whose envelope is no longer the one read (`raw`; rewritten since, by an engine that
    /// scheduled the id again) is left as it is.
    pub async fn dead_letter(&self, broken: &[Broken], now_ms: u64) -> Result<(), StoreError> {
        if broken.is_empty() {
            return Ok(());
        }
        let mut script = DEAD_LETTER.prepare_invoke();
        script
            .key(self.keys.due())
            .key(self.keys.tasks())
            .key(self.keys.dead());
        for b in broken {
            let record = dead_record(&b.reason.to_string(), b.raw.as_deref(), now_ms);
            script
                .arg(b.id.as_str())
                .arg(if b.raw.is_some() { "1" } else { "0" })
                .arg(b.raw.as_deref().unwrap_or_default())
                .arg(record)
                .arg(match &b.reason {
                    // As ZSCAN gave it, which is as ZSCORE gives it.
                    BrokenReason::BadScore(score) => score.as_str(),
                    _ => "",
                });
        }
        let mut conn = self.conn.clone();
        let buried: Vec<u8> = script.invoke_async(&mut conn).await?;
        for (b, buried) in broken.iter().zip(buried) {
            if buried == 1 {
                tracing::warn!(id = %b.id, reason = %b.reason, "task dead-lettered");
            } else {
                tracing::info!(id = %b.id, reason = %b.reason, "broken task rewritten since it was read: left as it is");
            }
        }
        Ok(())
    }

    /// Moves `entries` (a member, its dead record) to the dead-letter hash and out of the live
    /// keys, in one transaction.
    async fn bury(&self, entries: &[(&[u8], String)]) -> Result<(), StoreError> {
        let mut hset = redis::cmd("HSET");
        hset.arg(self.keys.dead());
        for (member, record) in entries {
            hset.arg(*member).arg(record.as_str());
        }
        let members: Vec<&[u8]> = entries.iter().map(|(member, _)| *member).collect();
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.add_command(hset).ignore();
        pipe.cmd("ZREM").arg(self.keys.due()).arg(&members).ignore();
        pipe.cmd("HDEL")
            .arg(self.keys.tasks())
            .arg(&members)
            .ignore();
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    /// Takes or renews the namespace's writer lease (`{ns}:engine`) for `holder` (see
    /// [`TaskStore::lease`]). Once `holder` has it, this store's removals and snapshot swaps
    /// are checked against it.
    pub async fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> Result<Lease, StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut conn = self.conn.clone();
        let reply: Vec<String> = LEASE
            .key(self.keys.engine())
            .key(self.keys.engine_takes())
            .arg(holder)
            .arg(ms)
            .arg(if first { "1" } else { "0" })
            .invoke_async(&mut conn)
            .await?;
        match reply.as_slice() {
            [state, run_id] if state == "held" || state == "reset" => {
                *self.holder.lock() = Some(holder.to_owned());
                let before = self.server.lock().replace(run_id.clone());
                if state == "reset" {
                    return Ok(Lease::Retaken(
                        "the lease's record of takes is gone: Redis lost the namespace's data"
                            .into(),
                    ));
                }
                match before {
                    Some(before) if before != *run_id => Ok(Lease::Retaken(format!(
                        "the Redis server changed (run_id {before} became {run_id}): a restart \
                         or a failover, which may have lost writes"
                    ))),
                    _ => Ok(Lease::Held),
                }
            }
            [state, other, _] if state == "other" => Ok(Lease::Other(other.clone())),
            _ => Err(StoreError::new(format!("unexpected lease reply {reply:?}"))),
        }
    }

    /// Gives up the writer lease if `holder` has it.
    pub async fn release(&self, holder: &str) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        RELEASE
            .key(self.keys.engine())
            .arg(holder)
            .invoke_async::<i64>(&mut conn)
            .await?;
        Ok(())
    }

    /// Claims the namespace for [`Persistent`](crate::redis::Persistent) (its `{ns}:kind` key):
    /// refused if a queue uses it.
    pub(crate) async fn claim(&self) -> Result<(), NamespaceInUse> {
        claim_namespaces(&self.conn, [&self.keys], PERSISTENT_ROLE).await
    }

    /// Replaces the live set with the upserts in `tasks` (see
    /// [`TaskStore::replace_all`]): writes them in pipelined batches into scratch keys of the
    /// same hash tag, then swaps those in with one Lua script (two RENAMEs, only if both
    /// scratch keys exist; ACL users need EVAL/EVALSHA), so readers see the old set or the new
    /// one. An empty set is one DEL of the live keys. One engine per namespace: two concurrent snapshots of the same
    /// namespace would share the scratch keys.
    ///
    /// A snapshot that fails part-way deletes its scratch keys before returning the error
    /// (best effort: with Redis unreachable they stay until the next snapshot's first
    /// command), so that a copy refused for want of memory does not keep holding that memory
    /// and make the journal's writes fail too.
    pub async fn replace_all(&self, tasks: &[Op]) -> Result<(), StoreError> {
        // An engine's own scratch keys, once it holds the lease: one that lost it cannot mix
        // its writes into the holder's snapshot.
        let suffix = match self.holder.lock().as_deref() {
            Some(holder) => format!(":snapshot:{holder}"),
            None => ":snapshot".to_owned(),
        };
        let scratch_due = format!("{}{suffix}", self.keys.due());
        let scratch_tasks = format!("{}{suffix}", self.keys.tasks());
        let mut conn = self.conn.clone();
        let drop_scratch = redis::cmd("DEL")
            .arg(&scratch_due)
            .arg(&scratch_tasks)
            .to_owned();
        drop_scratch.query_async::<()>(&mut conn).await?;
        let result = self
            .fill_and_swap(tasks, &scratch_due, &scratch_tasks)
            .await;
        if result.is_err() {
            if let Err(e) = drop_scratch.query_async::<()>(&mut conn).await {
                tracing::warn!(error = %e, "could not delete a failed snapshot's scratch keys");
            }
        }
        result
    }

    /// `replace_all` after its scratch keys were emptied: fills them, then swaps them in.
    async fn fill_and_swap(
        &self,
        tasks: &[Op],
        scratch_due: &str,
        scratch_tasks: &str,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let mut written = 0usize;
        for chunk in tasks.chunks(1_000) {
            let (mut zadd, mut hset) = (redis::cmd("ZADD"), redis::cmd("HSET"));
            zadd.arg(scratch_due);
            hset.arg(scratch_tasks);
            let mut n = 0;
            for op in chunk {
                if let Op::Upsert {
                    id,
                    due_at,
                    envelope,
                } = op
                {
                    zadd.arg(*due_at).arg(id.as_str());
                    hset.arg(id.as_str()).arg(envelope.as_slice());
                    n += 1;
                }
            }
            if n == 0 {
                continue;
            }
            let mut pipe = redis::pipe();
            pipe.add_command(zadd).ignore().add_command(hset).ignore();
            // Scratch keys left by a process that died mid-snapshot (their names are its
            // engine's) expire rather than hold a copy of the set for ever; the swap makes the
            // live keys persistent again.
            for key in [scratch_due, scratch_tasks] {
                pipe.cmd("PEXPIRE").arg(key).arg(SCRATCH_TTL_MS).ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
            written += n;
        }
        if written == 0 {
            let holder = self.holder();
            CLEAR
                .key(self.keys.due())
                .key(self.keys.tasks())
                .key(self.keys.engine())
                .arg(holder)
                .invoke_async::<i64>(&mut conn)
                .await?;
            return Ok(());
        }
        // Both scratch keys must still be there (a MULTI would not roll a failed RENAME back,
        // and the live set would be half replaced); RENAME replaces each live key at once.
        let holder = self.holder();
        let swapped: i64 = SWAP_IN
            .key(scratch_due)
            .key(scratch_tasks)
            .key(self.keys.due())
            .key(self.keys.tasks())
            .key(self.keys.engine())
            .arg(holder)
            .invoke_async(&mut conn)
            .await?;
        if swapped != 1 {
            return Err(StoreError::new(
                "the snapshot's scratch keys vanished before the swap",
            ));
        }
        Ok(())
    }
}

/// A page script's rows (`member, score, ...`) and envelopes, as rows. Members that are not
/// UTF-8 are returned apart, with their envelopes.
fn zip_rows(
    next: Option<Cursor>,
    flat: Vec<Vec<u8>>,
    envelopes: Vec<Option<Vec<u8>>>,
) -> (Rows, Vec<Unreadable>) {
    let mut rows = Rows {
        next,
        rows: Vec::with_capacity(envelopes.len()),
        set_aside: 0,
    };
    let mut unreadable = Vec::new();
    let mut flat = flat.into_iter();
    for envelope in envelopes {
        let (Some(id), Some(due)) = (flat.next(), flat.next()) else {
            break;
        };
        // A score is ASCII; lossy only for a reply that is not a score at all, which the
        // classification then refuses.
        let due = String::from_utf8_lossy(&due).into_owned();
        match String::from_utf8(id) {
            Ok(id) => rows.rows.push(Row { id, due, envelope }),
            Err(e) => unreadable.push(Unreadable {
                member: e.into_bytes(),
                envelope,
            }),
        }
    }
    (rows, unreadable)
}

/// A dead-letter record: the reason, the raw envelope (`raw` as text when it is UTF-8, else
/// `raw_hex`, so no byte is lost) and the time, ms since the epoch.
fn dead_record(reason: &str, raw: Option<&[u8]>, now_ms: u64) -> String {
    let mut record = serde_json::json!({ "reason": reason, "at": now_ms, "raw": null });
    if let Some(raw) = raw {
        match std::str::from_utf8(raw) {
            Ok(text) => record["raw"] = text.into(),
            Err(_) => {
                record["raw_hex"] = hex::encode(raw).into();
            }
        }
    }
    record.to_string()
}

impl TaskStore for RedisStore {
    fn apply(&self, ops: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::apply(self, ops)
    }

    fn rows(
        &self,
        cursor: Cursor,
        count: usize,
    ) -> impl Future<Output = Result<Rows, StoreError>> + Send {
        RedisStore::rows(self, cursor, count)
    }

    fn dead_letter(
        &self,
        broken: &[Broken],
        now_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::dead_letter(self, broken, now_ms)
    }

    fn replace_all(&self, tasks: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::replace_all(self, tasks)
    }

    fn claim(&self) -> impl Future<Output = Result<(), NamespaceInUse>> + Send {
        RedisStore::claim(self)
    }

    fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> impl Future<Output = Result<Lease, StoreError>> + Send {
        RedisStore::lease(self, holder, ttl, first)
    }

    fn release(&self, holder: &str) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::release(self, holder)
    }
}
