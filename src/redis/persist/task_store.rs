//! The store behind [`Persistent`](crate::redis::Persistent): a small trait, so that a backend other
//! than Redis (PostgreSQL, say) can be added without touching the engine.
//!
//! The engine calls it from its flusher (up to four `apply` calls in flight at once, each
//! with distinct ids) and from `restore` (`rows` and `dead_letter`, alongside the flusher);
//! implementations must be cheap to clone and safe to share.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;

use crate::redis::layout::NamespaceInUse;
use crate::redis::persist::rows::{Broken, Cursor, Op, Rows};
use crate::redis::store_error::StoreError;

/// Where a [`Persistent`](crate::redis::Persistent) engine keeps its pending tasks.
///
/// [`RedisStore`](crate::redis::RedisStore) is the implementation this crate ships.
pub trait TaskStore: Clone + Send + Sync + 'static {
    /// Applies a batch of changes atomically. When an id appears more than once, its last
    /// operation wins. Applying the same batch twice must leave the same state (the flusher
    /// retries a batch whose reply was lost).
    fn apply(&self, ops: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads one page of about `count` stored rows, as stored, starting at `cursor`
    /// ([`Cursor::start`] to begin; the returned [`Rows::next`] is `None` when done). An entry
    /// the store cannot hand out as a row (for Redis, a member that is not UTF-8) it moves to
    /// its dead letters itself, and counts in [`Rows::set_aside`]. A page may repeat a row the
    /// scan already returned. The engine decodes them ([`Rows::classify`]), off the store's
    /// connection, so reading the next page overlaps decoding this one.
    ///
    /// A cursor must never skip a row silently. When the store can no longer continue from
    /// `cursor` (its server restarted, failed over or reconnected to a store whose positions
    /// mean something else), it returns [`StoreError::cursor_lost`]: the engine then reads the
    /// set again from the start, keeping what it loaded, and a restore that cannot finish a
    /// scan fails rather than return `Ok` with rows missing.
    fn rows(
        &self,
        cursor: Cursor,
        count: usize,
    ) -> impl Future<Output = Result<Rows, StoreError>> + Send;

    /// Moves broken entries out of the live set into a dead-letter place, with their reason and
    /// the time `now_ms`. An entry rewritten since it was read (its envelope is no longer
    /// [`Broken::raw`]) should be left as it is, if the store can tell: the engine writes such
    /// an id again after the call, but a crash before that write would lose its task.
    fn dead_letter(
        &self,
        broken: &[Broken],
        now_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Replaces the whole live set with the upserts in `tasks` (a `Remove` in it is ignored),
    /// atomically: a reader sees the old set or the new one, never a mix.
    fn replace_all(&self, tasks: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Claims the store's key space for a [`Persistent`](crate::redis::Persistent) engine, once, as it
    /// starts ([`Persistent::start`](crate::redis::Persistent::start) and
    /// [`with_store`](crate::redis::Persistent::with_store)): refused with [`NamespaceInUse`] when
    /// another role (a queue) uses it, and the engine does not start. The default claims
    /// nothing; [`RedisStore`](crate::redis::RedisStore) claims its namespace's `{ns}:kind` key.
    fn claim(&self) -> impl Future<Output = Result<(), NamespaceInUse>> + Send {
        std::future::ready(Ok(()))
    }

    /// Takes or renews the store's writer lease for the engine named `holder`, for `ttl`. An
    /// engine writes only while it holds the lease, so that two engines on one store (a
    /// rolling deploy) take turns instead of overwriting each other (see
    /// [`PersistConfig::engine_lease`](crate::redis::PersistConfig::engine_lease)). When the
    /// lease is free, it is taken if `first` (this engine never held it) or if this engine was
    /// the last to take it; otherwise another engine held it meanwhile, and may have
    /// written: the answer is [`Lease::Other`] naming it. A store that lost its data since
    /// the caller last held the lease (its record of who took it last is gone, or its server
    /// changed) must not answer `Other` for that: it gives the lease to the caller and answers
    /// [`Lease::Retaken`]. Renewing must not need memory the
    /// store may lack (a Redis at `maxmemory`). Once an engine holds the lease, the store
    /// should refuse its destructive writes if another takes it. The default holds no lease:
    /// every engine may write.
    fn lease(
        &self,
        holder: &str,
        ttl: Duration,
        first: bool,
    ) -> impl Future<Output = Result<Lease, StoreError>> + Send {
        let _ = (holder, ttl, first);
        std::future::ready(Ok(Lease::Held))
    }

    /// Gives up the writer lease if `holder` holds it (at shutdown, so that the next engine
    /// need not wait for it to expire). The default does nothing.
    fn release(&self, holder: &str) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = holder;
        std::future::ready(Ok(()))
    }
}

/// What [`TaskStore::lease`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lease {
    /// The caller holds the lease.
    Held,
    /// The caller holds the lease again, but the store has lost data since it last held it
    /// (the reason is given): a Redis that restarted with no persistence or from older data,
    /// a failover to a replica that lagged, a flush of the namespace. What the caller wrote
    /// before may be gone, so the engine writes its whole pending set back. A store returns
    /// this when it can tell (a new server identity, or the lease's own record of takes gone);
    /// never to a caller that never held the lease.
    Retaken(String),
    /// Another engine, named, holds it, or took it since the caller last did.
    Other(String),
}

/// Runs a store call (built inside `call`, so a panic while building it counts too), and turns
/// a panic in it into a [`StoreError`]. A broken store then fails like one that is down: a
/// batch's changes go back into the journal and are retried with backoff, a snapshot that
/// panics is retried too, instead of ending the flusher thread (whose journal would then only
/// grow until producers hit its bound), and `restore` returns the error.
pub(super) async fn guarded<T>(
    what: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match AssertUnwindSafe(call).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            tracing::error!(call = what, panic = %message, "a store call panicked");
            crate::engine::delivery::forget_panic(panic);
            Err(StoreError::new(format!("store {what} panicked: {message}")))
        }
    }
}
