//! Write-behind persistence: an engine whose pending tasks are mirrored into Redis by a
//! background flusher, and reloaded by [`Persistent::restore`] after a restart.
//!
//! # Ground rules
//!
//! * The engine (memory) is the source of truth. Every change is recorded in the journal (a
//!   write as the task's index entry marked dirty, a removal by id), so later changes to an id
//!   replace earlier ones (coalescing), and a round writes each id once: once a restore
//!   has completed, a task scheduled and cancelled within one flush window costs no Redis
//!   command at all (before, Redis may hold an older version of the id, and the cancel writes
//!   its removal).
//! * The index (every task held) and the journal live in one [`State`] behind one mutex:
//!   every change to one is a change to the other, and one lock per call is what the hot path
//!   can afford. The timer's shard locks are taken inside it, never the other way round: the
//!   timer delivers fired tasks with no shard lock held.
//! * A fired task stays in Redis until [`Persistent::ack`]: delivery is at-least-once. A crash
//!   between firing and the acknowledgement fires the task again after the restart.
//! * `WriteBehind` (default) loses in a crash the changes not yet written: those of the last
//!   flush window while Redis answers, and every one since it stopped answering while it does
//!   not (up to `journal_bound`).
//!   `WriteThrough` makes `schedule` return only once Redis has acknowledged it.

use std::fmt;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::redis::blocking::OwnedRuntime;
use crate::redis::envelope::Envelope;
use crate::redis::payload::{new_task, IntoPayload};
use crate::redis::persist::redis_store::RedisStore;
use crate::redis::persist::task_store::TaskStore;
use crate::redis::wall_clock::Anchor;
use crate::redis::when::When;
use crate::{Timer, TimerId};

use super::config::*;
use super::index::{Entry, TaskKey};
use super::state::{Inner, State};

/// An engine whose tasks survive a restart: tasks with string ids and JSON payloads,
/// mirrored into Redis by a write-behind flusher. Fired tasks arrive on the receiver returned
/// by [`start`](Self::start) and leave Redis when [`ack`](Self::ack)ed.
///
/// The store is Redis unless [`with_store`](Self::with_store) is given another [`TaskStore`].
/// On PostgreSQL (feature `postgres`, `postgres::PgStore`) the engine and its guarantees are
/// the same; what differs is the store's: a flusher batch is one statement checked against the
/// writer lease (Redis checks removals only), the lease is a row with an expiry on the
/// database's clock (a row gone since the engine held it answers
/// [`Lease::Retaken`](crate::redis::Lease::Retaken), as a Redis that lost its data does),
/// a server restart loses no restore position, and a data loss is not detected by a server
/// identity. The `postgres` module's docs have the whole list.
///
/// Dropping the engine shuts it down, but the tasks [`shutdown`](Self::shutdown) would hand
/// back (scheduled, never written, Redis down) are then only logged, with their count and
/// the first 100 ids: call `shutdown` to keep them. If the receiver is dropped, tasks that fire afterwards stay
/// fired and unacknowledged (in Redis, so they fire again after a restart; `cancel` returns
/// `false` for them), with a warning each.
pub struct Persistent<S: TaskStore = RedisStore> {
    pub(super) inner: Arc<Inner>,
    /// Each pending task's timer, carrying its id's hash (see [`Index::fired`]).
    pub(super) timer: Timer<u64>,
    pub(super) flusher: Mutex<Option<JoinHandle<()>>>,
    /// Renews the writer lease; stopped by `shutdown` before it gives the lease up.
    pub(super) lease_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub(super) store: S,
    pub(super) rt: Arc<OwnedRuntime>,
}

impl<S: TaskStore> fmt::Debug for Persistent<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Persistent")
            .field("namespace", &self.inner.cfg.namespace)
            .field("pending", &self.timer.len())
            .finish()
    }
}

impl<S: TaskStore> Persistent<S> {
    /// Schedules (or replaces) task `id` to fire at `when`: a [`When`], a `Duration` from
    /// now (on the engine's [`WallClock`](crate::redis::WallClock)), or a `SystemTime`. The
    /// payload is a reference to any `Serialize` type, or a `serde_json::Value` (see
    /// [`IntoPayload`]); the fired [`Envelope`] reads it back with
    /// [`payload_as`](Envelope::payload_as). A due time in the past fires at once. Errors that
    /// refuse the task hand the envelope back (a payload that does not serialize:
    /// [`EnvelopeError::Encode`](crate::redis::EnvelopeError::Encode), the envelope's payload
    /// `null`); [`PersistError::Unconfirmed`] (`WriteThrough` with a timeout) refuses nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// use delaywheel::redis::{PersistConfig, Persistent};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let (engine, fired) = Persistent::start(PersistConfig::new(&url, "doc-schedule"))?;
    /// # engine.restore(1_000)?;
    /// // 30 minutes in production.
    /// engine.schedule("order:42", "order.close", &CloseOrder { order_id: 42 }, Duration::from_millis(10))?;
    /// let task = fired.recv().unwrap();
    /// let close: CloseOrder = task.payload_as().expect("a CloseOrder");
    /// assert_eq!(close.order_id, 42);
    /// // close order 42 if it is still unpaid, then:
    /// engine.ack(&task);
    /// # engine.shutdown();
    /// # Ok::<(), delaywheel::redis::PersistError>(())
    /// ```
    pub fn schedule(
        &self,
        id: impl Into<String>,
        topic: impl Into<std::borrow::Cow<'static, str>>,
        payload: impl IntoPayload,
        when: impl Into<When>,
    ) -> Result<(), PersistError> {
        let due_at = when.into().due_ms(&self.inner.cfg.clock);
        self.schedule_at_ms(id, topic, payload, due_at)
    }

    /// [`schedule`](Self::schedule) with the due time as stored: `due_at` ms since the Unix
    /// epoch (the same as `When::AtMs(due_at)`).
    pub fn schedule_at_ms(
        &self,
        id: impl Into<String>,
        topic: impl Into<std::borrow::Cow<'static, str>>,
        payload: impl IntoPayload,
        due_at: u64,
    ) -> Result<(), PersistError> {
        let created_at = self.inner.cfg.clock.stamp_ms();
        match new_task(id.into(), topic.into(), payload, created_at, due_at) {
            Ok(envelope) => self.schedule_envelope(envelope),
            Err((e, envelope)) => Err(PersistError::Envelope(e, envelope)),
        }
    }

    /// Schedules (or replaces) a complete envelope. Errors as for [`schedule`](Self::schedule).
    pub fn schedule_envelope(&self, envelope: Envelope) -> Result<(), PersistError> {
        // Checked (size, id, due time) here, so the caller gets the envelope back; encoded
        // later by the flusher.
        if let Err(e) = envelope.fits(self.inner.cfg.max_envelope) {
            return Err(PersistError::Envelope(e, Box::new(envelope)));
        }
        if self.inner.lost.load(SeqCst) {
            // Never an `Ok` for a task that no store write will ever carry.
            let holder = self.inner.lost_to.lock().clone();
            return Err(PersistError::LeaseLost(holder, Box::new(envelope)));
        }
        // Allocated before the lock is taken.
        let envelope = Arc::new(envelope);
        // WriteThrough's whole wait (for room, then for Redis) ends here, if it has a timeout.
        let deadline = match self.inner.cfg.durability {
            Durability::WriteThrough => self.write_through_deadline(),
            Durability::WriteBehind => None,
        };
        let mut state = self.inner.state.lock();
        let envelope = self.wait_for_room(&mut state, envelope, deadline)?;
        // Checked under the lock `shutdown` sets it under: a change journaled here is in
        // the flusher's final round.
        if self.inner.stopping.load(SeqCst) {
            return Err(PersistError::Shutdown(unshare(envelope)));
        }
        // Against the anchor the flusher refreshes, after any wait for room: time spent
        // waiting does not make the task late.
        // Hashed once, for the timer, the journal and the index.
        let hash = state.index.hash(&envelope.id);
        let Some(timer) = self.arm(hash, &state.anchor, envelope.due_at, Duration::ZERO) else {
            return Err(PersistError::Shutdown(unshare(envelope)));
        };
        // WriteThrough names the task if Redis does not confirm it in time.
        let kept =
            (self.inner.cfg.durability == Durability::WriteThrough).then(|| envelope.id.clone());
        let due_at = envelope.due_at;
        let State { index, journal, .. } = &mut *state;
        // The store may hold a version of this id: the one this replaces, or an earlier one
        // whose removal is still in the journal (this write replaces that removal).
        let entry = Entry {
            timer: Some(timer),
            persisted: journal.take_removal(hash, &envelope.id),
            dirty: true,
            since: journal.round(),
        };
        // The old key is the old envelope: dropped here, so that nothing keeps the old
        // payload alive as long as the task.
        let old = index.insert_hashed(hash, TaskKey(envelope), entry);
        let replaced_dirty = old.as_ref().is_some_and(|(_, old)| old.dirty);
        journal.scheduled(hash, due_at, replaced_dirty, index);
        if let Some(t) = old.and_then(|(_, old)| old.timer) {
            self.timer.cancel(t);
        }
        if let Some(id) = kept {
            // The wait releases the lock.
            if !self.inner.wait_for_changes_so_far(&mut state, deadline) {
                // Also when a shutdown ended the wait: the task was taken, and the shutdown's
                // final round writes it or hands it back (its list of unwritten tasks). Handing
                // it back here too would hand it back twice.
                return Err(PersistError::Unconfirmed(id));
            }
        }
        Ok(())
    }

    /// Arms the timer of a task (`hash`: its id's hash, which the timer carries) for wall
    /// time `due_at` plus `extra`, read against `anchor`. `None` once the timer has shut down.
    pub(super) fn arm(
        &self,
        hash: u64,
        anchor: &Anchor,
        due_at: u64,
        extra: Duration,
    ) -> Option<TimerId> {
        match anchor.instant_of(due_at, extra) {
            Some(at) => self.timer.schedule_at(hash, at),
            // Past what an `Instant` holds: as far as the timer reaches.
            None => self.timer.schedule(hash, Duration::MAX),
        }
        .ok()
    }

    /// Blocks (policy `Block`, until `deadline` if there is one) or refuses (policy `Error`)
    /// while the journal is at its bound.
    fn wait_for_room(
        &self,
        state: &mut MutexGuard<'_, State>,
        envelope: Arc<Envelope>,
        deadline: Option<Instant>,
    ) -> Result<Arc<Envelope>, PersistError> {
        while state.journal.depth() >= self.inner.cfg.journal_bound {
            metrics::counter!("delaywheel_journal_full_total").increment(1);
            // A round now, not after the flush interval: with Redis up it makes room at once.
            // (While Redis is down a kick does not cut the flusher's backoff short.)
            self.inner.kick(&mut state.journal);
            match self.inner.cfg.when_full {
                WhenFull::Error => {
                    tracing::warn!(
                        bound = self.inner.cfg.journal_bound,
                        "journal full: task refused"
                    );
                    return Err(PersistError::JournalFull(unshare(envelope)));
                }
                WhenFull::Block => {
                    tracing::warn!(
                        bound = self.inner.cfg.journal_bound,
                        "journal full: producer waits"
                    );
                    let mut until = Instant::now() + Duration::from_millis(100);
                    if let Some(deadline) = deadline {
                        if deadline <= Instant::now() {
                            return Err(PersistError::JournalFull(unshare(envelope)));
                        }
                        until = until.min(deadline);
                    }
                    self.inner.flushed.wait_until(state, until);
                    if self.inner.stopping.load(SeqCst) {
                        return Err(PersistError::Shutdown(unshare(envelope)));
                    }
                    if self.inner.lost.load(SeqCst) {
                        // No round will ever make room.
                        let holder = self.inner.lost_to.lock().clone();
                        return Err(PersistError::LeaseLost(holder, unshare(envelope)));
                    }
                }
            }
        }
        Ok(envelope)
    }

    /// Cancels task `id`; `false` if it is not pending (unknown, or already fired), or after
    /// [`shutdown`](Self::shutdown) (the removal could no longer be written).
    ///
    /// Until a [`restore`](Self::restore) has completed, the store may hold tasks of a previous
    /// process that this one has not loaded: a cancel of an id not held here still removes it
    /// from the store and keeps the restore from loading it, and returns `false` (this engine
    /// held no such task). Not while the journal is at its bound (Redis down or slow): then
    /// such a cancel does nothing. Call `restore` first.
    pub fn cancel(&self, id: &str) -> bool {
        let mut state = self.inner.state.lock();
        if self.inner.stopping.load(SeqCst) {
            return false; // the flusher's final round may be done: it would not be written
        }
        // Hashed once, for the index and the journal.
        let hash = state.index.hash(id);
        let (key, entry) = match state.index.remove_pending(hash, id) {
            Ok(task) => task,
            // Fired, waiting for ack: not this call's to remove.
            Err(true) => return false,
            Err(false) => {
                // Not past the journal's bound: such cancels of ids that may never have
                // existed must not grow it without limit while Redis is down.
                if !state.restored && state.journal.depth() < self.inner.cfg.journal_bound {
                    state.mark_gone(&TaskKey::bare(id));
                    state.journal.record_removal(id, 0);
                }
                return false;
            }
        };
        if let Some(timer) = entry.timer {
            self.timer.cancel(timer);
        }
        state.mark_gone(&key);
        // Scheduled and cancelled before a round read it, and never written before: the store
        // holds nothing to remove. Unless no restore has completed: the store may then hold a
        // version of this id from a previous process, which a restore would load, so the
        // removal is written either way.
        let unwritten = entry.dirty && !entry.persisted && state.restored;
        state.journal.forget(&entry);
        if !unwritten {
            state.journal.record_removal(id, key.envelope().due_at);
        }
        true
    }

    /// Acknowledges a fired task, given as it was received: it leaves Redis with the next
    /// flush. `false` if the id's fired, unacknowledged version is not this one: the id is
    /// unknown, pending again, or was replaced and its new version fired too (that version
    /// waits for its own `ack`; this one's was not written, so a crash before then fires the
    /// new one again, never loses it). Also `false` after [`shutdown`](Self::shutdown) (the
    /// task stays in Redis and fires again after a restore).
    ///
    /// A version is told by its contents: a replacement identical to the fired version in
    /// every field (payload, attempt and due time, and `created_at`, the coarse clock's
    /// millisecond) is taken for it, and acknowledged with it.
    pub fn ack(&self, task: &Envelope) -> bool {
        let mut state = self.inner.state.lock();
        // The cheap fields first: a payload can be 64 KiB, compared under the lock.
        let fired = |(key, e): (&TaskKey, &Entry)| {
            let held = &**key.envelope();
            e.timer.is_none()
                && (held.due_at, held.created_at, held.attempt)
                    == (task.due_at, task.created_at, task.attempt)
                && held == task
        };
        if self.inner.stopping.load(SeqCst) || !state.index.get(task.id.as_str()).is_some_and(fired)
        {
            return false;
        }
        let Some((id, entry)) = state.index.remove(task.id.as_str()) else {
            return false;
        };
        state.journal.forget(&entry);
        state.mark_gone(&id);
        state.journal.record_removal(id.id(), id.envelope().due_at);
        true
    }

    /// [`cancel`](Self::cancel), then waits until the store has the removal: a crash after
    /// this returns `Ok` cannot bring the task back (a cancelled payment reminder, an order
    /// closed after it was paid). `Ok(held)`, as `cancel` returns it, once the flush round
    /// after the call is written. [`PersistError::Unconfirmed`] (the id) if it is not written
    /// within [`PersistConfig::write_through_timeout`] (if set; otherwise this waits while
    /// the store is down), or a shutdown ends the wait: the removal stays journaled and is
    /// written when the store answers. [`PersistError::LeaseLost`] is not possible here (no
    /// envelope); an engine that lost its lease returns `Unconfirmed`. Under either
    /// [`Durability`].
    ///
    /// ```
    /// use delaywheel::redis::{PersistConfig, PersistError, Persistent};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let (engine, _fired) = Persistent::start(PersistConfig::new(&url, "doc-cancel"))?;
    /// # engine.schedule("order:42", "order.close", serde_json::Value::Null, std::time::Duration::from_secs(60))?;
    /// // The order was paid: its timeout must never fire, even if this process dies now.
    /// match engine.cancel_confirmed("order:42") {
    ///     Ok(_) => {}
    ///     Err(PersistError::Unconfirmed(id)) => eprintln!("{id}: cancel not yet in Redis"),
    ///     Err(e) => return Err(e),
    /// }
    /// # engine.shutdown();
    /// # Ok::<(), delaywheel::redis::PersistError>(())
    /// ```
    pub fn cancel_confirmed(&self, id: &str) -> Result<bool, PersistError> {
        let held = self.cancel(id);
        self.confirm(id)?;
        Ok(held)
    }

    /// [`ack`](Self::ack), then waits until the store has the removal, as
    /// [`cancel_confirmed`](Self::cancel_confirmed) does: `Ok(acked)` once written, else
    /// [`PersistError::Unconfirmed`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use delaywheel::redis::{PersistConfig, Persistent};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let (engine, fired) = Persistent::start(PersistConfig::new(&url, "doc-ack"))?;
    /// # engine.restore(1_000)?;
    /// engine.schedule("charge:7", "charge.retry", serde_json::Value::Null, Duration::from_millis(5))?;
    /// let task = fired.recv().unwrap();
    /// // The charge went through: once this returns `Ok`, a crash cannot run it again.
    /// assert!(engine.ack_confirmed(&task)?);
    /// # engine.shutdown();
    /// # Ok::<(), delaywheel::redis::PersistError>(())
    /// ```
    pub fn ack_confirmed(&self, task: &Envelope) -> Result<bool, PersistError> {
        let acked = self.ack(task);
        self.confirm(&task.id)?;
        Ok(acked)
    }

    /// Waits, within `write_through_timeout`, until a flush round that began after this call
    /// has been written.
    fn confirm(&self, id: &str) -> Result<(), PersistError> {
        let deadline = self.write_through_deadline();
        let mut state = self.inner.state.lock();
        if self.inner.wait_for_changes_so_far(&mut state, deadline) {
            Ok(())
        } else {
            Err(PersistError::Unconfirmed(id.to_owned()))
        }
    }

    /// Tasks pending or fired and not yet acknowledged.
    pub fn len(&self) -> usize {
        self.inner.state.lock().index.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether task `id` is held: pending, or fired and not yet acknowledged.
    pub fn contains(&self, id: &str) -> bool {
        self.inner.state.lock().index.contains(id)
    }

    /// Whether this engine writes to the store now: it holds the namespace's writer lease, as
    /// far as its last renewal tells, and has not lost it to another engine. `false` while the
    /// store is unreachable (changes wait in the journal), or for good once another engine took
    /// the lease ([`PersistError::LeaseLost`]). The same as the gauge
    /// `delaywheel_persist_writing` (1 or 0), set at each lease renewal: alert when it stays 0.
    pub fn is_writing(&self) -> bool {
        self.inner.holds_lease()
    }

    /// Unflushed changes in the journal.
    pub fn journal_depth(&self) -> usize {
        self.inner.state.lock().journal.depth()
    }

    /// Waits until everything journaled so far is in Redis (for example before a deploy), for at
    /// most `timeout`. Returns whether it got there (`false`: Redis is down or slow).
    /// With nothing journaled and no round out, that is already so: `true` at once, whatever
    /// the timeout, also after [`shutdown`](Self::shutdown). After the store lost data (it
    /// restarted empty, say, once a restore had completed), the pending set written back
    /// counts too: `false` until it is in the store. During a
    /// [`restore`](Self::restore), a task whose broken row the restore is dead-lettering is
    /// journaled again only once that call returns; a store that cannot leave a rewritten row
    /// in place (see [`TaskStore::dead_letter`]; [`RedisStore`] can) may lack it until then.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.inner.state.lock();
        // The store lacks tasks that no entry marks dirty until the snapshot that writes them
        // back lands: the flusher tries it (within its own backoff), each round notifying.
        while state.journal.repair_pending() {
            if (self.inner.lost.load(SeqCst)
                || self.inner.stopping.load(SeqCst)
                || self.inner.wait_round(&mut state, deadline))
                && state.journal.repair_pending()
            {
                return false;
            }
        }
        // Not at once while a restore runs: it may have removed a row (with a broken one it
        // dead-letters) that it has yet to journal again. (Two rounds do not wait for that.)
        if state.journal.is_empty() && !state.journal.in_round && state.restoring == 0 {
            return true;
        }
        self.inner.wait_for_changes_so_far(&mut state, deadline)
    }

    /// When a wait for Redis under `write_through_timeout` ends, if it has one.
    fn write_through_deadline(&self) -> Option<Instant> {
        self.inner
            .cfg
            .write_through_timeout
            .and_then(|t| Instant::now().checked_add(t))
    }

    /// Writes the whole pending set (pending and fired-but-unacknowledged tasks) to the store
    /// and swaps it in atomically, so that the store then matches memory exactly: anything a
    /// lost write or a stray writer left behind is gone. The flusher does it as its next round,
    /// in place of the journal it subsumes. Returns the number of tasks written, or `None` if it
    /// did not complete within `timeout` (the store is down, and the flusher keeps retrying it;
    /// or a restore runs: the snapshot waits for it to complete, as it would write a partly
    /// loaded set over the rows not read).
    ///
    /// Only after a [`restore`](Self::restore) has completed: before, memory may lack the rows
    /// a previous process left, which the snapshot would delete. Without one this returns `None`
    /// at once, unless a restore is running (then it waits for it, within `timeout`; if that
    /// restore fails, the snapshot is refused and dropped, and `None` comes back at once).
    pub fn snapshot(&self, timeout: Duration) -> Option<usize> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.inner.state.lock();
        if state.unrestored() {
            tracing::warn!("snapshot refused: no restore has completed");
            return None;
        }
        state.journal.snapshot_wanted = true;
        // One taken after this call: a snapshot out now read the index before it.
        let after = state.journal.snapshot_rounds;
        self.inner.kick(&mut state.journal);
        while state.journal.snapshot_ok <= after {
            if self.inner.lost.load(SeqCst) {
                return None; // another engine has the namespace: nothing is written again
            }
            if state.unrestored() {
                // The restore it waited for failed: refused, as if none had run. No longer
                // asked for either: every caller waiting for it returns `None` here (none can
                // be waiting while a restore has completed), so a later restore that completes
                // must not start a rewrite of the whole set that nobody waits for.
                state.journal.snapshot_wanted = false;
                return None;
            }
            if self.inner.stopping.load(SeqCst) || self.inner.wait_round(&mut state, deadline) {
                let journal = &state.journal;
                return (journal.snapshot_ok > after).then_some(journal.snapshot_len);
            }
        }
        Some(state.journal.snapshot_len)
    }
}

/// The envelope of a refused schedule, handed back: the only reference, unless the call went
/// as far as sharing it (then a copy).
fn unshare(envelope: Arc<Envelope>) -> Box<Envelope> {
    Box::new(Arc::try_unwrap(envelope).unwrap_or_else(|e| (*e).clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::{now_ms, Broken, Op, Rows, StoreError};
    use crossbeam_channel::Receiver;

    /// A store that takes every write, and keeps the operations it was sent.
    #[derive(Clone, Default)]
    struct Recording(Arc<Mutex<Vec<Op>>>);

    impl TaskStore for Recording {
        async fn apply(&self, ops: &[Op]) -> Result<(), StoreError> {
            self.0.lock().extend_from_slice(ops);
            Ok(())
        }
        async fn rows(&self, _: crate::redis::Cursor, _: usize) -> Result<Rows, StoreError> {
            Ok(Rows::default())
        }
        async fn dead_letter(&self, _: &[Broken], _: u64) -> Result<(), StoreError> {
            Ok(())
        }
        async fn replace_all(&self, _: &[Op]) -> Result<(), StoreError> {
            Ok(())
        }
    }

    /// Tasks scheduled and cancelled within one flush window cost the store nothing, and the
    /// journal's list of writes stays bounded by the index, however many of them there are
    /// (each leaves a stale item, which the list sheds): a task journaled before them, and
    /// replaced among them, is still written, once, as its last version.
    #[test]
    fn churn_between_rounds_keeps_the_journal_bounded_and_loses_no_write() {
        let store = Recording::default();
        let mut cfg = PersistConfig::new("unused://", "unused");
        cfg.flush_interval = Duration::from_secs(3_600); // rounds only when asked for
        let (p, _fired) = Persistent::with_store(cfg, store.clone()).unwrap();
        p.restore(100).unwrap();
        let far = now_ms() + 3_600_000;
        p.schedule_at_ms("keep", "t", serde_json::json!(-1), far)
            .unwrap();
        let mut most = 0;
        for i in 0..20_000 {
            let id = format!("churn:{i}");
            p.schedule_at_ms(id.clone(), "t", serde_json::Value::Null, far)
                .unwrap();
            assert!(p.cancel(&id));
            if i % 1_000 == 0 {
                p.schedule_at_ms("keep", "t", serde_json::json!(i), far)
                    .unwrap();
            }
            most = most.max(p.inner.state.lock().journal.upserts.len());
        }
        assert_eq!(p.journal_depth(), 1, "one write waits: keep's");
        // At most two tasks held and dirty at a time (keep, and one of the churn): the list
        // holds them, and at most the index's size plus the slack of stale items.
        assert!(
            most <= 2 + 2 + crate::redis::persist::journal::COMPACT_SLACK,
            "the list of writes grew to {most} items for one dirty task"
        );
        assert!(p.flush(Duration::from_secs(10)));
        let ops = store.0.lock().clone();
        assert_eq!(ops.len(), 1, "{} ops written", ops.len());
        match &ops[0] {
            Op::Upsert { id, envelope, .. } => {
                assert_eq!(id, "keep");
                let written = Envelope::decode(envelope).unwrap();
                assert_eq!(written.payload, serde_json::json!(19_000));
            }
            other => panic!("wrote {other:?}"),
        }
        assert_eq!(p.journal_depth(), 0);
        p.shutdown();
    }

    /// An engine whose flusher writes only when asked (`flush`), holding task "a" with a 1 KB
    /// payload, due at the returned time, not yet flushed.
    fn with_a_large_task() -> (Persistent<Recording>, Receiver<Envelope>, u64) {
        let mut cfg = PersistConfig::new("unused://", "unused");
        cfg.flush_interval = Duration::from_secs(3_600); // rounds only when asked for
        let (p, fired) = Persistent::with_store(cfg, Recording::default()).unwrap();
        let far = now_ms() + 3_600_000;
        p.schedule_at_ms("a", "t", serde_json::json!("x".repeat(1_000)), far)
            .unwrap();
        (p, fired, far)
    }

    /// A cancelled (or acknowledged) persisted task leaves a removal in the journal until the
    /// next flush, which can be long while Redis is down: the removal holds its id, not its
    /// envelope.
    #[test]
    fn a_journaled_removal_keeps_no_reference_to_the_envelope() {
        let (p, _fired, _) = with_a_large_task();
        assert!(p.flush(Duration::from_secs(10)));
        let envelope = {
            let state = p.inner.state.lock();
            state.index.get("a").unwrap().0 .0.clone()
        };
        assert!(p.cancel("a"));
        assert_eq!(p.journal_depth(), 1, "the removal waits for the next round");
        assert_eq!(
            Arc::strong_count(&envelope),
            1,
            "the journaled removal holds the envelope"
        );
        assert!(p.flush(Duration::from_secs(10)));
        p.shutdown();
    }

    /// The index is keyed by the envelope itself: a task scheduled again must leave nothing
    /// holding its old envelope (payloads can be 64 KiB), and the key names the current one.
    #[test]
    fn a_replaced_task_keeps_no_reference_to_its_old_envelope() {
        let (p, _fired) = Persistent::with_store(
            PersistConfig::new("unused://", "unused"),
            Recording::default(),
        )
        .unwrap();
        let far = now_ms() + 3_600_000;
        let key_of = |p: &Persistent<Recording>| {
            let state = p.inner.state.lock();
            let (key, _) = state.index.get("a").unwrap();
            assert_eq!(state.index.len(), 1);
            key.0.clone()
        };
        p.schedule_at_ms("a", "t", serde_json::json!(1), far)
            .unwrap();
        assert!(p.flush(Duration::from_secs(10)));
        let old = key_of(&p);
        p.schedule_at_ms("a", "t", serde_json::json!(2), far)
            .unwrap();
        assert!(p.flush(Duration::from_secs(10)));
        assert_eq!(Arc::strong_count(&old), 1, "the old envelope is still held");
        assert_eq!(key_of(&p).payload, serde_json::json!(2));
        assert!(p.cancel("a"));
        p.shutdown();
    }

    /// The same within one flush window (or while Redis is down): the journaled write of the
    /// id must not keep the first version's envelope either. (An earlier journal kept its
    /// first key, and with it up to `journal_bound` payloads no one could read any more.)
    #[test]
    fn a_task_replaced_before_its_flush_keeps_no_reference_to_its_old_envelope() {
        let (p, _fired, far) = with_a_large_task();
        let old = p.inner.state.lock().index.get("a").unwrap().0 .0.clone();
        p.schedule_at_ms("a", "t", serde_json::json!(2), far)
            .unwrap();
        assert_eq!(p.journal_depth(), 1, "one upsert of the id, waiting");
        assert_eq!(Arc::strong_count(&old), 1, "the old envelope is still held");
        assert!(p.flush(Duration::from_secs(10)));
        p.shutdown();
    }
}
