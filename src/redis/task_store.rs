//! The store behind [`Persistent`](super::Persistent): a small trait, so that a backend other
//! than Redis (PostgreSQL, say) can be added without touching the engine.
//!
//! The engine calls it from its flusher (up to four `apply` calls in flight at once, each
//! with distinct ids) and from `restore` (`rows` and `dead_letter`, alongside the flusher);
//! implementations must be cheap to clone and safe to share.

use std::future::Future;

use super::store::{Broken, Op, Rows, StoreError};

/// Where a [`Persistent`](super::Persistent) engine keeps its pending tasks.
///
/// [`RedisStore`](super::RedisStore) is the implementation this crate ships.
pub trait TaskStore: Clone + Send + Sync + 'static {
    /// Applies a batch of changes atomically. When an id appears more than once, its last
    /// operation wins. Applying the same batch twice must leave the same state (the flusher
    /// retries a batch whose reply was lost).
    fn apply(&self, ops: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads one page of about `count` stored rows, as stored, starting at `cursor` (0 to
    /// begin; the returned [`Rows::next`] is 0 when done). A page may repeat a row the scan
    /// already returned. The engine decodes them ([`Rows::classify`]), off the store's
    /// connection, so reading the next page overlaps decoding this one.
    fn rows(
        &self,
        cursor: u64,
        count: usize,
    ) -> impl Future<Output = Result<Rows, StoreError>> + Send;

    /// Moves broken entries out of the live set into a dead-letter place, with their reason and
    /// the time `now_ms`.
    fn dead_letter(
        &self,
        broken: &[Broken],
        now_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Replaces the whole live set with the upserts in `tasks` (a `Remove` in it is ignored),
    /// atomically: a reader sees the old set or the new one, never a mix.
    fn replace_all(&self, tasks: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send;
}
