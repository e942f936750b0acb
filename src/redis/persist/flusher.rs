//! The write-behind half of [`Persistent`](crate::redis::Persistent): the flusher thread that
//! drains the journal (see `journal.rs`) into the store in batches, or writes a snapshot of the
//! whole pending set.
//!
//! The ground rules are those of `engine.rs`: memory is the source of truth, the journal
//! lives with the index under one mutex (`Inner::state`), and encoding and writing happen
//! outside it.

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::redis::envelope::Envelope;
use crate::redis::persist::index::{Ids, TaskKey};
use crate::redis::persist::journal::{Change, Taken};
use crate::redis::persist::rows::Op;
use crate::redis::persist::state::{Inner, State};
use crate::redis::persist::task_store::{guarded, TaskStore};
use crate::redis::store_error::StoreError;

/// A round's changes in the order they are written: by due time, so each batch touches one
/// stretch of the ZSET (removals first, then writes). Redis takes sorted writes about a third
/// faster, and sorted removals three times as fast. Sorted with no lock held.
fn in_round_order(mut changes: Vec<Change>) -> Vec<Change> {
    changes.sort_unstable_by_key(Change::sort_key);
    changes
}

/// The batches of a round in [`in_round_order`]: up to `batch` changes each, and never a
/// removal and a write in one, so that a Redis at `maxmemory` (which refuses a MULTI with a
/// ZADD or HSET in it whole) still takes every batch of removals, which free its memory.
fn batch_ranges(changes: &[Change], batch: usize) -> Vec<std::ops::Range<usize>> {
    let batch = batch.max(1);
    let split = changes.partition_point(Change::is_removal);
    let mut ranges = Vec::with_capacity(changes.len() / batch + 2);
    for (mut start, end) in [(0, split), (split, changes.len())] {
        while start < end {
            let stop = (start + batch).min(end);
            ranges.push(start..stop);
            start = stop;
        }
    }
    ranges
}

/// The store operations of a stretch of a round's changes. The index is read under the lock
/// for this stretch only, so producers wait at most that long, and the stretches after it are
/// read only once the ones before are on their way. A change to an id made meanwhile is in
/// the journal for the next round; an upsert whose task is gone since, or was written by
/// then, is skipped (its cancel or ack journaled the removal, or nothing at all for a task the
/// store never held).
fn resolve(inner: &Inner, changes: &[Change]) -> Vec<Op> {
    let writes: Vec<Result<Arc<Envelope>, &TaskKey>> = {
        let mut state = inner.state.lock();
        let State { index, journal, .. } = &mut *state;
        changes
            .iter()
            .filter_map(|change| match change {
                Change::Upsert { hash, .. } => journal
                    .read_write(*hash, index)
                    .map(|(key, _)| Ok(key.envelope().clone())),
                Change::Remove { id, .. } => Some(Err(id)),
            })
            .collect()
    };
    writes
        .into_iter()
        .filter_map(|w| match w {
            Ok(envelope) => upsert_op(&envelope),
            Err(id) => Some(Op::Remove(id.id().to_owned())),
        })
        .collect()
}

/// The store operation that writes `envelope`. Its size and fields were checked when it was
/// scheduled, so a failure here would be a serde bug: logged, and the task not written.
fn upsert_op(envelope: &Envelope) -> Option<Op> {
    match envelope.encode(usize::MAX) {
        Ok(bytes) => Some(Op::Upsert {
            id: envelope.id.clone(),
            due_at: envelope.due_at,
            envelope: bytes,
        }),
        Err(e) => {
            tracing::error!(id = %envelope.id, error = %e, "envelope no longer encodes; not written");
            None
        }
    }
}

/// The first wait before a failed snapshot is tried again (or the flush interval, if longer,
/// up to [`SNAPSHOT_RETRY_MAX`]); it doubles with each failure, up to that maximum.
const SNAPSHOT_RETRY_MIN: Duration = Duration::from_millis(20);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(10);

/// What one flusher round writes.
enum Round {
    /// The journaled changes, when the oldest of them was made, and whether they are the
    /// whole journal (not a probe): only a whole round counts as flushed, since `flush` and
    /// WriteThrough take two flushed rounds to mean "everything before the call is written".
    Journal(Taken, Option<Instant>, bool),
    /// The whole pending set (a snapshot), which subsumes the journal: the removals and the
    /// hashes of the writes it took, put back if the snapshot fails, when the oldest of them
    /// was made, and the snapshot round's number.
    Snapshot(Vec<Arc<Envelope>>, Ids<u64>, Vec<u64>, Option<Instant>, u64),
}

/// Takes the next round's work out of the journal (and, for a snapshot, the index). While the
/// store is `down`, a round is a probe of one batch: a failure then puts back one batch under
/// the lock, not the whole journal (a stall for every producer, once per retry). A wanted
/// snapshot waits while `hold_snapshot` (after a failed one: the journal goes first, and the
/// snapshot's own backoff runs).
fn take_round(inner: &Inner, down: bool, hold_snapshot: bool) -> Round {
    let anchor = inner.cfg.clock.anchor();
    let mut state = inner.state.lock();
    state.anchor = anchor;
    let State {
        index,
        journal,
        restoring,
        restored,
        gone,
        ..
    } = &mut *state;
    metrics::gauge!("delaywheel_journal_depth").set(journal.depth() as f64);
    if let Some(t) = journal.oldest {
        metrics::gauge!("delaywheel_flush_lag_seconds").set(t.elapsed().as_secs_f64());
    }
    // Not while a restore runs, nor before one has completed: the snapshot would write a
    // partly loaded set over the rows not read yet.
    if journal.snapshot_wanted && *restoring == 0 && *restored && !hold_snapshot {
        journal.snapshot_wanted = false;
        journal.snapshot_rounds += 1;
        // Every entry's current version is in the snapshot: none is dirty any more.
        let all = index
            .iter_mut()
            .map(|(key, entry)| {
                entry.persisted = true;
                entry.dirty = false;
                key.envelope().clone()
            })
            .collect();
        journal.in_round = true;
        let (removals, hashes) = journal.take_for_snapshot();
        return Round::Snapshot(
            all,
            removals,
            hashes,
            journal.oldest.take(),
            journal.snapshot_rounds,
        );
    }
    let (ops, oldest, whole) = if down && journal.depth() > inner.cfg.batch {
        // A probe: one batch, O(batch) here; the rest waits in the journal, oldest included.
        // Removals if there are any: a Redis at `maxmemory` refuses every batch with a write
        // in it, and takes removals, which free its memory (writes alone would be refused for
        // as long as it stays full).
        (journal.take_batch(inner.cfg.batch, index), None, false)
    } else {
        // Taken whole, in O(1): the index is read later, a stretch at a time (`resolve`).
        (journal.take_all(index), journal.oldest.take(), true)
    };
    if *restoring > 0 {
        // The removals this round takes leave the journal before they reach the store: a
        // restore running now may read their rows meanwhile, and must not load them.
        for id in ops.removals.keys() {
            gone.insert(id.clone(), ());
        }
    }
    journal.in_round = true;
    Round::Journal(ops, oldest, whole)
}

/// The earlier of two optional times (`None`: no time).
fn older(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Batches in flight at once. The multiplexed connection pipelines them, so building one batch
/// overlaps Redis applying the ones before it. The ids of one round are distinct, so the
/// order in which batches land does not matter.
const IN_FLIGHT: usize = 4;

/// What [`write_batches`] did.
#[derive(Default)]
struct Written {
    /// Batches taken from the iterator; the ones after were neither built nor sent.
    taken: usize,
    /// Operations Redis took.
    written: usize,
    /// Operations built but not written (from the first failure on), to be journaled again.
    failed: Vec<Op>,
    /// The first failure.
    error: Option<StoreError>,
}

/// The batches in flight, by the id of the task writing each: a task that ends without an
/// answer (cancelled under us) still hands its batch back through here.
type InFlight = HashMap<tokio::task::Id, Arc<Vec<Op>>>;

type BatchDone = Result<(tokio::task::Id, Result<(), StoreError>), tokio::task::JoinError>;

impl Written {
    /// Books a finished batch: a failed one goes back to `failed`.
    fn book(&mut self, done: BatchDone, in_flight: &mut InFlight) {
        let (task, result) = match done {
            Ok(done) => done,
            Err(join) => {
                // A panic in the store call is caught inside the task (`guarded`), so only a
                // task cancelled under us gets here: its batch failed, and is journaled again.
                tracing::error!(error = %join, "a store write task ended without an answer");
                let e = StoreError::new(format!("store write lost: {join}"));
                (join.id(), Err(e))
            }
        };
        let Some(chunk) = in_flight.remove(&task) else {
            return;
        };
        match result {
            Ok(()) => self.written += chunk.len(),
            Err(e) => {
                self.error.get_or_insert(e);
                // The task has ended, so this is the last reference.
                self.failed
                    .extend(Arc::try_unwrap(chunk).unwrap_or_else(|c| (*c).clone()));
            }
        }
    }
}

/// Writes `batches`, up to [`IN_FLIGHT`] at a time; the next batch is taken from the iterator
/// (and so built) while those are in flight. At the first failure it stops taking batches: a
/// store that is down costs one batch per round, however long the journal.
fn write_batches<S: TaskStore>(
    store: &S,
    rt: &tokio::runtime::Runtime,
    mut batches: impl Iterator<Item = Vec<Op>>,
) -> Written {
    rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        let mut in_flight = InFlight::new();
        let mut done = Written::default();
        loop {
            // A slot first, then the next batch: it is built (and the lease it may check is
            // looked at) only when it can be sent.
            while tasks.len() >= IN_FLIGHT {
                if let Some(batch) = tasks.join_next_with_id().await {
                    done.book(batch, &mut in_flight);
                }
            }
            let Some(chunk) = batches.next() else {
                break;
            };
            done.taken += 1;
            if done.error.is_some() {
                done.failed.extend(chunk);
                break;
            }
            if chunk.is_empty() {
                continue;
            }
            let (store, chunk) = (store.clone(), Arc::new(chunk));
            let task = tasks.spawn({
                let chunk = chunk.clone();
                async move { guarded("write", async { store.apply(&chunk).await }).await }
            });
            in_flight.insert(task.id(), chunk);
        }
        while let Some(batch) = tasks.join_next_with_id().await {
            done.book(batch, &mut in_flight);
        }
        done
    })
}

/// The flusher: every interval, write the journal in batches (or a snapshot when one is asked
/// for); on failure, put the changes back (newer ones win) and back off.
pub(super) fn flush_loop<S: TaskStore>(inner: &Inner, store: &S, rt: &tokio::runtime::Runtime) {
    let mut backoff = inner.cfg.flush_interval;
    let mut down_since: Option<Instant> = None;
    // The last journal round failed: the next is a probe of one batch.
    let mut journal_down = false;
    // The last round was a snapshot that failed: the next one is a journal round, whole
    // unless journal writes fail too (a store may refuse snapshots and take writes).
    let mut snapshot_failed = false;
    // Failed snapshots back off on their own clock: journal rounds that succeed in between
    // (a store short of memory for the scratch copy still takes writes) do not reset it, or
    // a whole copy of the pending set would be taken and sent every other round.
    // (Within the maximum: a flush interval may be as long as `Duration::MAX`.)
    let first_snapshot_backoff = SNAPSHOT_RETRY_MIN
        .max(inner.cfg.flush_interval)
        .min(SNAPSHOT_RETRY_MAX);
    let mut snapshot_backoff = first_snapshot_backoff;
    let mut snapshot_not_before: Option<Instant> = None;
    loop {
        // The wait comes before each round, the first included: nothing can be journaled
        // before the engine is handed out, so the first round is the first one asked for (a
        // kick) or due (the interval), not one run whenever this thread happens to start,
        // which nobody could tell apart from a round a caller asked for.
        {
            let mut state = inner.state.lock();
            // A wanted snapshot held back by its own backoff is tried when that ends, even if
            // the next round is further off. Only while that time is still ahead: once it has
            // passed, a snapshot held back (by a restore) is started by whatever ends the hold
            // (the restore kicks), not by rounds run back to back.
            let mut wait = backoff;
            if let Some(t) = snapshot_not_before.filter(|_| state.journal.snapshot_wanted) {
                let now = Instant::now();
                if t > now {
                    wait = wait.min(t - now);
                }
            }
            if down_since.is_some() {
                // Backing off: a kick (a `flush` or WriteThrough caller waiting, which kicks after
                // every round) does not cut the wait short, or a waiting caller would make the
                // retries run back to back against a store that is down. Shutdown does.
                let until = Instant::now() + wait;
                while !inner.stopping.load(SeqCst) {
                    if inner.kick.wait_until(&mut state, until).timed_out() {
                        break;
                    }
                }
            } else if !inner.stopping.load(SeqCst) && !state.journal.kicked {
                inner.kick.wait_for(&mut state, wait);
            }
            state.journal.kicked = false;
        }
        let stopping = inner.stopping.load(SeqCst);
        if !inner.holds_lease() {
            // Another engine may be writing the namespace (see `PersistConfig::engine_lease`):
            // nothing is written, and the journal keeps every change, until the lease loop has
            // the lease again (and kicks). A final round is not run either: `shutdown` hands
            // back what was not written.
            if stopping {
                break;
            }
            continue;
        }
        // The final round takes everything, whatever the state of the store.
        let probe = journal_down && !stopping;
        let mut whole = true;
        // The final round tries a wanted snapshot whatever its backoff (the last chance to
        // write back what a data loss took), unless the one before it just failed.
        let hold_snapshot = std::mem::take(&mut snapshot_failed)
            || (!stopping && snapshot_not_before.is_some_and(|t| Instant::now() < t));
        let round = take_round(inner, probe, hold_snapshot);
        // The buffers of the journal a round took, given back at its end.
        let mut spare = None;
        let mut snapshot_round = None;
        let (result, written) = match round {
            Round::Journal(mut taken, oldest, all) => {
                whole = all;
                let changes = in_round_order(taken.changes());
                spare = Some(taken);
                // Read from the index and encoded batch by batch, while the batches before
                // are in flight.
                let ranges = batch_ranges(&changes, inner.cfg.batch);
                // The lease is checked before each batch too: a long round (a journal built
                // while Redis was down) must not write on after it lapsed.
                let Written {
                    taken,
                    written,
                    failed,
                    mut error,
                } = write_batches(
                    store,
                    rt,
                    ranges
                        .iter()
                        .take_while(|_| inner.holds_lease())
                        .map(|range| resolve(inner, &changes[range.clone()])),
                );
                // Never read from the index: back into the journal as they were.
                let unsent = &changes[ranges.get(taken).map_or(changes.len(), |r| r.start)..];
                if error.is_none() && !unsent.is_empty() {
                    error = Some(StoreError::new("the writer lease lapsed during the round"));
                }
                metrics::counter!("delaywheel_flushed_ops_total").increment(written as u64);
                if !failed.is_empty() || !unsent.is_empty() {
                    let mut state = inner.state.lock();
                    let State { index, journal, .. } = &mut *state;
                    // Changes made while this batch was out are newer: they win. Put back even
                    // when a snapshot is wanted: it may be held back (by a restore) for long,
                    // and must not be what these changes wait for.
                    // Built and failed, or never built: (id, whether it wrote the task, the
                    // due time a removal sorts by).
                    // Writes never read from the index: their entries are still dirty, and
                    // their items go back on the list as they were.
                    let mut again = Vec::with_capacity(failed.len() + unsent.len());
                    for change in unsent {
                        match change {
                            Change::Upsert { hash, due_at } => {
                                journal.upserts.push((*hash, *due_at));
                            }
                            Change::Remove { id, due_at } => again.push((id.id(), false, *due_at)),
                        }
                    }
                    again.extend(
                        failed
                            .iter()
                            .map(|op| (op.id(), matches!(op, Op::Upsert { .. }), 0)),
                    );
                    for (id, upsert, due_hint) in again {
                        // Redis may hold what a failed op left half done, or the version an op
                        // was to remove (a task scheduled again since did not see that removal
                        // in the journal): a cancel of the task now held must reach Redis,
                        // whether or not a newer change to it is journaled.
                        let hash = index.hash(id);
                        if let Some((key, entry)) = index.get_hashed_mut(hash, id) {
                            entry.persisted = true;
                            // A task held is written (again) as its current version, whatever
                            // the op was: never removed. (A round holds no removal of an id it
                            // writes or that was held when it took the journal.)
                            debug_assert!(upsert || entry.dirty, "a held task's removal failed");
                            if !entry.dirty {
                                journal.upsert(hash, key, entry);
                            }
                            continue;
                        }
                        // A removal tried again (also of a write whose task is gone since),
                        // unless a newer one is journaled.
                        if !journal.removals.contains_key(id) {
                            journal.record_removal(id, due_hint);
                        }
                    }
                    journal.oldest = older(journal.oldest, oldest);
                    // What the round took is booked (written, or back in the journal): counted
                    // once, not twice, until the round ends.
                    journal.taken = 0;
                }
                journal_down = error.is_some();
                (error.map_or(Ok(()), Err), None)
            }
            Round::Snapshot(envelopes, removals, hashes, oldest, number) => {
                snapshot_round = Some(number);
                let ops: Vec<Op> = envelopes.iter().filter_map(|e| upsert_op(e)).collect();
                let started = Instant::now();
                match rt.block_on(guarded("snapshot", async { store.replace_all(&ops).await })) {
                    Ok(()) => {
                        snapshot_backoff = first_snapshot_backoff;
                        snapshot_not_before = None;
                        (Ok(()), Some(ops.len()))
                    }
                    Err(e) => {
                        // At least as long as the attempt took: a snapshot of a large set that
                        // fails late must not be sent again at once.
                        snapshot_backoff = snapshot_backoff.max(started.elapsed());
                        snapshot_not_before = Instant::now().checked_add(snapshot_backoff);
                        snapshot_backoff =
                            snapshot_backoff.saturating_mul(2).min(SNAPSHOT_RETRY_MAX);
                        // The store is as it was: the changes the snapshot took are still to be
                        // written, by the next round (a journal round: a store may refuse
                        // snapshots and take writes) or by the snapshot tried again after it.
                        let mut state = inner.state.lock();
                        let State { index, journal, .. } = &mut *state;
                        journal.snapshot_wanted = true;
                        journal.put_back(removals, hashes, index);
                        journal.taken = 0;
                        journal.oldest = older(journal.oldest, oldest);
                        snapshot_failed = true;
                        (Err(e), None)
                    }
                }
            }
        };
        {
            let mut state = inner.state.lock();
            let journal = &mut state.journal;
            journal.in_round = false;
            journal.taken = 0;
            if let Some(buffer) = spare.take() {
                journal.recycle(buffer);
            }
            match result {
                Ok(()) => {
                    if whole {
                        journal.flushed += 1;
                    }
                    if let Some(n) = written {
                        journal.snapshot_ok = snapshot_round.unwrap_or(journal.snapshot_ok);
                        journal.snapshot_len = n;
                        tracing::info!(tasks = n, "snapshot written");
                    }
                    if let Some(t) = down_since.take() {
                        tracing::info!(after = ?t.elapsed(), "store writes caught up");
                    }
                    backoff = inner.cfg.flush_interval;
                }
                Err(e) => {
                    if down_since.is_none() {
                        tracing::warn!(error = %e, "store write failed; retrying with backoff");
                        down_since = Some(Instant::now());
                    }
                    metrics::counter!("delaywheel_flush_failures_total").increment(1);
                    backoff = backoff.saturating_mul(2).min(Duration::from_secs(1));
                }
            }
        }
        inner.flushed.notify_all();
        // At the end, a snapshot that failed leaves one last try to the journal round.
        if stopping && !snapshot_failed {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::redis::persist::index::Index;
    use crate::redis::persist::journal::Journal;
    use crate::redis::{Broken, Rows};

    /// A store that is down: every call fails, and `apply` calls are counted.
    #[derive(Clone, Default)]
    struct Down(Arc<AtomicUsize>);

    impl TaskStore for Down {
        fn apply(&self, _: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send {
            self.0.fetch_add(1, SeqCst);
            async { Err(StoreError::new("down")) }
        }
        async fn rows(&self, _: crate::redis::Cursor, _: usize) -> Result<Rows, StoreError> {
            Err(StoreError::new("down"))
        }
        async fn dead_letter(&self, _: &[Broken], _: u64) -> Result<(), StoreError> {
            Err(StoreError::new("down"))
        }
        async fn replace_all(&self, _: &[Op]) -> Result<(), StoreError> {
            Err(StoreError::new("down"))
        }
    }

    /// A round writes its removals in due order, then its upserts in due order, in batches that
    /// never mix the two.
    #[test]
    fn a_round_is_written_in_due_order_removals_first() {
        let mut journal = Journal::default();
        let dues = [40u64, 10, 30, 20, 50, 0];
        for (i, due) in dues.iter().enumerate() {
            if i % 2 == 0 {
                journal.upserts.push((i as u64, *due));
            } else {
                journal.record_removal(&format!("t{i}"), *due);
            }
        }
        let mut taken = journal.take_all(&Index::with_hasher(Default::default()));
        let round = in_round_order(taken.changes());
        let order: Vec<(bool, u64)> = round.iter().map(Change::sort_key).collect();
        // (false: a removal.)
        assert_eq!(
            order,
            [
                (false, 0),
                (false, 10),
                (false, 20),
                (true, 30),
                (true, 40),
                (true, 50)
            ]
        );
        // Batches of 2: two of removals (2 + 1), two of writes (2 + 1), none mixed.
        assert_eq!(batch_ranges(&round, 2), [0..2, 2..3, 3..5, 5..6]);
        assert_eq!(batch_ranges(&round, 100), [0..3, 3..6]);
        assert_eq!(batch_ranges(&round[..3], 2), [0..2, 2..3]);
        assert_eq!(batch_ranges(&round[3..], 2), [0..2, 2..3]);
        assert!(batch_ranges(&[], 2).is_empty());
    }

    /// A store that is down costs a round the batches already in flight and one more, not the
    /// whole journal built (read from the index and encoded) for nothing.
    #[test]
    fn a_failing_store_stops_the_round_early() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = Down::default();
        let built = AtomicUsize::new(0);
        let batches = (0..1_000).map(|i| {
            built.fetch_add(1, SeqCst);
            vec![Op::Remove(format!("t{i}"))]
        });
        let done = write_batches(&store, &rt, batches);
        let built = built.load(SeqCst);
        assert!(built <= IN_FLIGHT + 1, "{built} batches built");
        assert_eq!(done.taken, built);
        assert_eq!(done.written, 0);
        assert!(done.error.is_some());
        // Every batch built comes back: sent and failed, or built after the failure.
        assert_eq!(done.failed.len(), built);
        assert_eq!(store.0.load(SeqCst), built - usize::from(built > IN_FLIGHT));
    }

    /// A write task that ends without an answer (cancelled) hands its batch back as failed,
    /// to be journaled again. (Its operations used to be lost, repaired only by a snapshot,
    /// which waits for a restore: until one, nothing counted as flushed.)
    #[test]
    fn a_cancelled_write_hands_its_batch_back() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (failed, error) = rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            let mut in_flight = InFlight::new();
            let batch = vec![Op::Remove("a".into()), Op::Remove("b".into())];
            let task = tasks.spawn(std::future::pending::<Result<(), StoreError>>());
            in_flight.insert(task.id(), Arc::new(batch));
            tasks.abort_all();
            let mut done = Written::default();
            while let Some(d) = tasks.join_next_with_id().await {
                done.book(d, &mut in_flight);
            }
            assert!(in_flight.is_empty());
            (done.failed, done.error)
        });
        assert_eq!(failed, vec![Op::Remove("a".into()), Op::Remove("b".into())]);
        assert!(error.is_some());
    }
}
