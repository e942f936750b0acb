//! A helper for idempotent handlers: delivery is at-least-once, so a handler may see a task
//! twice (a crash between firing and the acknowledgement, a lease that expired). Both design
//! notes give the same advice: a processed-id marker with a TTL, set with `SET NX`.
//!
//! The marker has two states, so that a crash in the middle of a handler does not swallow the
//! task: `running:<token>` (a short lease) while the handler works, `done` (a long TTL) once it
//! has. A redelivery that finds `running` backs off; once the lease lapses it runs again. The
//! token fences the marker: a delivery whose lease lapsed while it worked cannot drop the
//! marker of the delivery that took over.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::redis::layout::{KeyLayout, NamespaceError};
use crate::redis::link::Link;
use crate::redis::store_error::StoreError;

/// What [`Dedup::begin`] found for a task id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// No marker: this caller now holds the `running` marker and should do the work, then call
    /// [`Dedup::finish`] (or [`Dedup::abandon`] if it failed) with this claim.
    Run(Claim),
    /// The work was done already: skip it (and acknowledge the task).
    AlreadyDone,
    /// Another delivery is working on it right now (or crashed less than a lease ago).
    InProgress,
}

/// Holding a task's `running` marker: its id and the random token written into the marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    id: String,
    token: String,
}

impl Claim {
    /// The task id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The marker's value while this claim holds it.
    fn marker(&self) -> String {
        format!("running:{}", self.token)
    }
}

/// Processed-id markers at `{ns}:done:<id>`, in the namespace's hash slot.
#[derive(Clone)]
pub struct Dedup {
    conn: Link,
    prefix: String,
    lease: Duration,
    keep: Duration,
}

impl fmt::Debug for Dedup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedup")
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("keep", &self.keep)
            .finish()
    }
}

impl Dedup {
    /// Markers for namespace `ns` on the Redis at `url`: a `running` marker lives `lease`
    /// (longer than a handler takes), a `done` marker `keep` (longer than a task can be
    /// redelivered). With the queue, keep `lease` well below the time its retry policy spans
    /// (the sum of the backoffs: 1 + 4 + 9 + 16 = 30 s with the defaults): a handler that
    /// crashed holding the marker leaves it for `lease`, each redelivery meanwhile finds
    /// [`Begin::InProgress`] and fails an attempt, and once the attempts run out the task is
    /// dead-lettered without having run. Durations below 1 ms count as 1 ms, and above 2^62 ms (146 million years,
    /// "forever") as 2^62 ms: Redis refuses an expiry past its clock's range. Outside a Tokio
    /// runtime, or on one without its time or I/O driver, it returns an error.
    pub async fn connect(
        url: &str,
        ns: &str,
        lease: Duration,
        keep: Duration,
    ) -> Result<Dedup, DedupError> {
        Dedup::on(Link::node(url), ns, lease, keep).await
    }

    /// Like [`connect`](Self::connect), on the Redis Cluster that `nodes` (seed node URLs)
    /// belong to. The markers share the namespace's hash tag, so they live in its slot.
    pub async fn connect_cluster(
        nodes: &[String],
        ns: &str,
        lease: Duration,
        keep: Duration,
    ) -> Result<Dedup, DedupError> {
        Dedup::on(Link::cluster(nodes), ns, lease, keep).await
    }

    /// Checks the namespace, then connects.
    async fn on(
        conn: impl Future<Output = Result<Link, redis::RedisError>>,
        ns: &str,
        lease: Duration,
        keep: Duration,
    ) -> Result<Dedup, DedupError> {
        let keys = KeyLayout::new(ns).map_err(DedupError::Namespace)?;
        let conn = conn.await.map_err(|e| DedupError::Store(e.into()))?;
        Ok(Dedup {
            conn,
            prefix: keys.marker_prefix(),
            lease,
            keep,
        })
    }

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.prefix)
    }

    /// The longest expiry asked of Redis: it refuses one whose time would pass `i64::MAX` ms.
    const MAX_MS: u64 = 1 << 62;

    fn ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, Self::MAX_MS)
    }

    /// Claims task `id` for processing, atomically (`SET NX PX ... GET`), with a fresh random
    /// token in the marker.
    ///
    /// `id` names one piece of work. Where an id is reused for new work (a `Persistent` task
    /// scheduled again under its id after it ran, a queue task enqueued again), pass a key
    /// that names the version too, such as a revision the producer puts in the payload
    /// (`format!("{}@{}", task.id, revision)`): under the bare id the new work would find
    /// [`Begin::AlreadyDone`] for `keep`. (`created_at` is coarse: two versions a few ms
    /// apart can share it.)
    ///
    /// The `running` marker is not renewed: a handler that works longer than `lease` lets a
    /// redelivery run beside it. On [`Begin::InProgress`] a queue handler should fail the task
    /// so that it is retried after its backoff (which spends an attempt: see
    /// [`connect`](Self::connect) on choosing `lease`); a `Persistent` consumer leaves it
    /// unacknowledged and schedules it again a lease later.
    pub async fn begin(&self, id: &str) -> Result<Begin, StoreError> {
        let mut conn = self.conn.clone();
        let claim = Claim {
            id: id.to_owned(),
            token: format!("{:016x}", fastrand::u64(..)),
        };
        let old: Option<String> = redis::cmd("SET")
            .arg(self.key(id))
            .arg(claim.marker())
            .arg("NX")
            .arg("PX")
            .arg(Self::ms(self.lease))
            .arg("GET")
            .query_async(&mut conn)
            .await?;
        Ok(match old.as_deref() {
            None => Begin::Run(claim),
            Some("done") => Begin::AlreadyDone,
            Some(_) => Begin::InProgress,
        })
    }

    /// Records that the work of `claim`'s task is done; later deliveries get
    /// [`Begin::AlreadyDone`] for the `keep` duration. Done is done: it is recorded even if the
    /// claim's lease lapsed meanwhile and another delivery holds the marker.
    pub async fn finish(&self, claim: &Claim) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("SET")
            .arg(self.key(&claim.id))
            .arg("done")
            .arg("PX")
            .arg(Self::ms(self.keep))
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Drops `claim`'s `running` marker after a failed attempt, so a retry runs at once.
    /// Returns whether it still held it: a `done` marker, or the marker of another delivery
    /// that took over after this claim's lease lapsed, is left alone (`false`).
    pub async fn abandon(&self, claim: &Claim) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let dropped: i64 = redis::Script::new(include_str!("lua/dedup_abandon.lua"))
            .key(self.key(&claim.id))
            .arg(claim.marker())
            .invoke_async(&mut conn)
            .await?;
        Ok(dropped == 1)
    }
}

/// Why [`Dedup::connect`] failed (the cause is its [`source`](std::error::Error::source)).
#[derive(Debug)]
#[non_exhaustive]
pub enum DedupError {
    /// The namespace cannot be a hash tag.
    Namespace(NamespaceError),
    /// Redis refused or is unreachable.
    Store(StoreError),
}

impl fmt::Display for DedupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DedupError::Namespace(_) => f.write_str("the namespace cannot be used"),
            DedupError::Store(_) => f.write_str("redis refused or is unreachable"),
        }
    }
}

impl std::error::Error for DedupError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DedupError::Namespace(e) => Some(e),
            DedupError::Store(e) => Some(e),
        }
    }
}
