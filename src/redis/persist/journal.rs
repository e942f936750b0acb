//! The journal: every change callers made since the last flush round, and the flags by which
//! callers and the flusher signal each other.
//!
//! A write to make is not a separate record: it is the index entry itself, marked `dirty`
//! (the store lacks its current version), with its id's hash (and due time) pushed on a list
//! the flusher reads. A removal, whose task has left the index, is a record of its own, keyed
//! by id. So a task scheduled and cancelled within one flush window costs the journal a push
//! on a list and a flag, not a map entry made and removed again (and no reference to its
//! envelope: cancelling it frees it).
//!
//! The list may name entries that are no longer dirty (cancelled, acknowledged, or written
//! since, in which case their hash was pushed again if they changed again): each of its items
//! means "a dirty entry with this hash may exist", and the flusher writes the dirty entries it
//! finds, once each. Every dirty entry has an item (on the list, or, while a round runs and
//! if it became dirty before that round took the journal, among the round's): an entry's hash
//! is pushed whenever it becomes dirty, and a new version of a dirty task (a replacement)
//! stays dirty, under the same id and so the same hash.
//!
//! A round reads only the entries that became dirty before it took the journal (`since`), so
//! it never writes an id twice, nor writes an id it also removes.

use std::hash::BuildHasher;
use std::time::Instant;

use crate::redis::persist::index::{Entry, Ids, Index, TaskKey};

/// One change a flush round takes from the journal, turned into a store
/// [`Op`](super::rows::Op) by the flusher.
#[derive(Clone)]
pub(super) enum Change {
    /// Write the task whose id hashes to `hash`, as the index holds it when the flusher gets
    /// to this change, if it is still dirty then (a task cancelled or written since is
    /// skipped). Encoded by the flusher, off the caller's path. `due_at` is the due time of
    /// the version journaled, only to sort the round by.
    Upsert { hash: u64, due_at: u64 },
    /// Remove task `id` (cancelled, or fired and acknowledged). `due_at` is the due time of
    /// the version removed, as best known (0 when not), only to sort the round by.
    Remove { id: TaskKey, due_at: u64 },
}

impl Change {
    /// Where the change sorts in a round: removals by due time, then writes by due time.
    /// Redis removes ZSET members in due order three times as fast as in the order of a hash
    /// map (1M ZREM + HDEL in batches of 1 000 through `redis-cli --pipe`: 1.29 and 1.58 s
    /// sorted, 4.47 and 5.56 s shuffled): each removal walks the skiplist down to its member,
    /// and in order the walks share their cache lines. Removals first: they free memory, and
    /// a Redis at `maxmemory` (`noeviction`) refuses a batch with a ZADD or HSET in it whole
    /// but takes one of ZREM and HDEL only (see [`batch_ranges`]).
    ///
    /// [`batch_ranges`]: super::flusher
    pub(super) fn sort_key(&self) -> (bool, u64) {
        match self {
            Change::Remove { due_at, .. } => (false, *due_at),
            Change::Upsert { due_at, .. } => (true, *due_at),
        }
    }

    pub(super) fn is_removal(&self) -> bool {
        matches!(self, Change::Remove { .. })
    }
}

/// What a flush round took from the journal: removals by id, and the list's items of writes
/// (hash, due time), still to be read from the index.
pub(super) struct Taken {
    pub(super) removals: Ids<u64>,
    pub(super) upserts: Vec<(u64, u64)>,
}

impl Taken {
    /// The round's changes, built with no lock held (a round can take a million). The
    /// buffers are left, empty, for [`Journal::recycle`].
    pub(super) fn changes(&mut self) -> Vec<Change> {
        let mut changes = Vec::with_capacity(self.removals.len() + self.upserts.len());
        changes.extend(
            self.removals
                .drain()
                .map(|(id, due_at)| Change::Remove { id, due_at }),
        );
        changes.extend(
            self.upserts
                .drain(..)
                .map(|(hash, due_at)| Change::Upsert { hash, due_at }),
        );
        changes
    }
}

/// Stale items on the list of writes (beyond the dirty entries) past which a schedule rebuilds
/// it from the index, on top of the index's size: the rebuild costs O(index), so it is paid
/// for by at least as many pushes.
pub(super) const COMPACT_SLACK: usize = 1024;

/// The largest buffer (in items) a round gives back to the journal: a larger one (a burst, or
/// a journal built while the store was down) is freed, not kept for good.
const RECYCLE_MAX: usize = 1 << 16;

#[derive(Default)]
pub(super) struct Journal {
    /// Removals to write, by id (the key is the bare id: a removal does not keep its task's
    /// envelope alive). No id here is in the index: a task scheduled again takes its removal
    /// out (its write replaces it).
    pub(super) removals: Ids<u64>,
    /// The hashes (and due times) of index entries that may be dirty; see the module docs.
    pub(super) upserts: Vec<(u64, u64)>,
    /// Index entries marked dirty.
    pub(super) dirty: usize,
    /// Rounds taken (wrapping; only compared for equality): the round in progress, or the
    /// last one. An entry that became dirty since the round in progress took the journal is
    /// left to the next one (see `Entry::since`), so that a round never writes an id twice
    /// (two items of one id: the entry read, then written again, then read again by the
    /// other item) nor writes an id it also removes (a task cancelled, its removal taken,
    /// then scheduled again): the batches of one round may land in any order.
    round: u32,
    /// Completed flush rounds; `WriteThrough` waits for the round after its change.
    pub(super) flushed: u64,
    /// When the oldest unflushed change was made.
    pub(super) oldest: Option<Instant>,
    /// A snapshot was asked for: the next round writes the whole pending set instead of the
    /// journal (which it subsumes). Stays set until a snapshot succeeds.
    pub(super) snapshot_wanted: bool,
    /// Snapshot rounds taken so far, and the number of the last one that succeeded: a caller
    /// of `snapshot` waits for one taken after its call (a snapshot out then read the index
    /// before it, and may fail too).
    pub(super) snapshot_rounds: u64,
    pub(super) snapshot_ok: u64,
    /// The size of the last snapshot written.
    pub(super) snapshot_len: usize,
    /// The store lost data after a restore had completed (see `Inner::write_all_back`): the
    /// pending set is written back by a snapshot taken after the round numbered here. Until
    /// one succeeds, the store lacks tasks that no entry marks dirty: `flush` waits for it, and
    /// `shutdown` hands back every task held.
    pub(super) repair_after: Option<u64>,
    /// Someone waits for a round (`flush`, WriteThrough, `snapshot`): the flusher starts one
    /// now instead of sleeping. A flag, not just the condvar, so a kick made while the flusher
    /// is busy is not lost.
    pub(super) kicked: bool,
    /// The flusher has taken a round and not yet booked its end (failures journaled again):
    /// its removals may not have reached the store. `restore` waits for it before reading.
    pub(super) in_round: bool,
    /// Changes the round in progress took out of the journal and has not booked yet (its
    /// removals, and the writes it has read from the index so far): they count against
    /// `journal_bound` as much as those still journaled (a failed round puts them back).
    pub(super) taken: usize,
}

impl Journal {
    /// A journal whose removals hash as the index does (one seed, so a call hashes its id
    /// once).
    pub(super) fn with_hasher(hasher: foldhash::fast::RandomState) -> Journal {
        Journal {
            removals: Ids::with_hasher(hasher),
            ..Journal::default()
        }
    }

    /// Unflushed changes: journaled, or taken by the round in progress.
    pub(super) fn depth(&self) -> usize {
        self.removals.len() + self.dirty + self.taken
    }

    /// A data loss the store reported is not repaired yet (see `repair_after`).
    pub(super) fn repair_pending(&self) -> bool {
        self.repair_after.is_some_and(|r| self.snapshot_ok <= r)
    }

    /// Nothing is journaled (a round in progress may still hold changes).
    pub(super) fn is_empty(&self) -> bool {
        self.removals.is_empty() && self.dirty == 0
    }

    /// Whether a change to `id` is journaled: its removal, or a write of the task held.
    pub(super) fn has_change(&self, id: &str, index: &Index) -> bool {
        self.removals.contains_key(id) || index.get(id).is_some_and(|(_, e)| e.dirty)
    }

    /// Takes out a removal of `id` (`hash`: its hash) that is journaled, for a new version of
    /// the task: `true` if there was one (the store may then hold an older version).
    #[inline]
    pub(super) fn take_removal(&mut self, hash: u64, id: &str) -> bool {
        if self.removals.is_empty() {
            return false;
        }
        debug_assert_eq!(hash, self.removals.hasher().hash_one(id));
        match self
            .removals
            .raw_entry_mut()
            .from_key_hashed_nocheck(hash, id)
        {
            hashbrown::hash_map::RawEntryMut::Occupied(slot) => {
                slot.remove();
                true
            }
            hashbrown::hash_map::RawEntryMut::Vacant(_) => false,
        }
    }

    /// The `since` of an entry that becomes dirty now.
    #[inline]
    pub(super) fn round(&self) -> u32 {
        self.round
    }

    /// A new version of a task (due at `due_at`, its id hashing to `hash`), marked dirty,
    /// took the index's place of a version that was dirty (`replaced_dirty`) or not (or of
    /// none). Rebuilds the list of writes from `index` if it holds too many stale items.
    #[inline]
    pub(super) fn scheduled(
        &mut self,
        hash: u64,
        due_at: u64,
        replaced_dirty: bool,
        index: &Index,
    ) {
        self.changed();
        if replaced_dirty {
            return; // the replaced version's item names this one too
        }
        self.dirty += 1;
        self.upserts.push((hash, due_at));
        // (Fewer items than dirty entries while a round holds some of theirs.)
        if self.upserts.len().saturating_sub(self.dirty) > index.len() + COMPACT_SLACK {
            self.compact(index);
        }
    }

    /// Marks `entry` (of the task `key`, whose id hashes to `hash`) dirty: its current version
    /// is to be written. A no-op if it already is.
    pub(super) fn upsert(&mut self, hash: u64, key: &TaskKey, entry: &mut Entry) {
        self.changed();
        if !entry.dirty {
            entry.dirty = true;
            entry.since = self.round;
            self.dirty += 1;
            self.upserts.push((hash, key.envelope().due_at));
        }
    }

    /// A task whose `entry` is `entry` left the index (cancelled or acknowledged): if it was
    /// dirty, its write is no longer to be made (its item on the list goes stale).
    #[inline]
    pub(super) fn forget(&mut self, entry: &Entry) {
        if entry.dirty {
            debug_assert!(self.dirty > 0);
            self.dirty -= 1;
        }
    }

    /// Rebuilds the list of writes from the dirty entries of `index`, dropping stale items.
    fn compact(&mut self, index: &Index) {
        self.upserts.clear();
        self.upserts.extend(
            index
                .iter()
                .filter(|(_, e)| e.dirty)
                .map(|(k, _)| (index.hash(k.id()), k.envelope().due_at)),
        );
        debug_assert_eq!(self.upserts.len(), self.dirty);
    }

    /// Takes every journaled change for a round, in O(1) (under the lock callers wait for):
    /// the writes are read from the index later, a stretch at a time. (No round is in
    /// progress: every dirty entry of `index` has its item on the list, which debug builds
    /// check.)
    pub(super) fn take_all(&mut self, index: &Index) -> Taken {
        #[cfg(debug_assertions)]
        {
            let items: std::collections::HashSet<u64> =
                self.upserts.iter().map(|(hash, _)| *hash).collect();
            let dirty = index.iter().filter(|(_, e)| e.dirty);
            let mut count = 0;
            for (key, _) in dirty {
                count += 1;
                assert!(
                    items.contains(&index.hash(key.id())),
                    "dirty task {} has no item on the journal's list: its write would be lost",
                    key.id()
                );
            }
            assert_eq!(
                count, self.dirty,
                "the journal's count of dirty entries is off"
            );
        }
        #[cfg(not(debug_assertions))]
        let _ = index;
        self.round = self.round.wrapping_add(1);
        Taken {
            removals: self.take_removals(),
            upserts: std::mem::take(&mut self.upserts),
        }
    }

    /// Takes back the buffers a round took (emptied by [`Taken::changes`]) where the
    /// journal's are smaller: callers then write into memory that is already theirs. (Freeing
    /// them on the flusher's thread, while callers allocate on theirs, cost schedule + cancel
    /// a tenth of its time: glibc's allocator serializes the two threads on the arena.)
    pub(super) fn recycle(&mut self, taken: Taken) {
        let Taken {
            mut removals,
            mut upserts,
        } = taken;
        if self.upserts.capacity() < upserts.capacity() && upserts.capacity() <= RECYCLE_MAX {
            upserts.clear();
            upserts.append(&mut self.upserts);
            self.upserts = upserts;
        }
        if self.removals.capacity() < removals.capacity() && removals.capacity() <= RECYCLE_MAX {
            removals.clear();
            removals.extend(self.removals.drain());
            self.removals = removals;
        }
    }

    /// Takes the journaled removals (counted as taken), leaving an empty map that hashes as
    /// this one did.
    pub(super) fn take_removals(&mut self) -> Ids<u64> {
        let empty = Ids::with_hasher(self.removals.hasher().clone());
        let removals = std::mem::replace(&mut self.removals, empty);
        self.taken += removals.len();
        removals
    }

    /// Takes the journal for a snapshot round: its removals and the hashes of its writes (for
    /// [`put_back`](Self::put_back) if the snapshot fails), counted as taken. The caller marks
    /// every entry clean: the snapshot writes each one's current version.
    pub(super) fn take_for_snapshot(&mut self) -> (Ids<u64>, Vec<u64>) {
        self.round = self.round.wrapping_add(1);
        self.taken += self.dirty;
        self.dirty = 0;
        let hashes = self.upserts.drain(..).map(|(hash, _)| hash).collect();
        (self.take_removals(), hashes)
    }

    /// Takes one batch for a probe of a store that is down: removals if any are journaled (a
    /// Redis at `maxmemory` refuses every batch with a write in it, and takes removals, which
    /// free its memory), else up to `batch` writes.
    pub(super) fn take_batch(&mut self, batch: usize, index: &mut Index) -> Taken {
        self.round = self.round.wrapping_add(1);
        let mut removals = Ids::with_hasher(self.removals.hasher().clone());
        if !self.removals.is_empty() {
            let ids: Vec<TaskKey> = self.removals.keys().take(batch).cloned().collect();
            for id in ids {
                if let Some(due_at) = self.removals.remove(id.id()) {
                    removals.insert(id, due_at);
                }
            }
            self.taken += removals.len();
            return Taken {
                removals,
                upserts: Vec::new(),
            };
        }
        // Items whose entry is no longer dirty are dropped here, not sent: a probe of stale
        // items only would write nothing, and pass for the store being back. (At most the
        // stale items the list may hold: about the index's size, as a rebuild costs.)
        let mut upserts = Vec::with_capacity(batch.min(self.upserts.len()));
        while upserts.len() < batch {
            let Some((hash, due_at)) = self.upserts.pop() else {
                break;
            };
            if index.dirty(hash, self.round).is_some() {
                upserts.push((hash, due_at));
            }
        }
        Taken { removals, upserts }
    }

    /// Reads the write `hash` names from `index` for the round in progress: the dirty entry
    /// with that hash, if one is left, marked clean (its current version is on its way) and
    /// persisted (the store may hold it from now on). Counted as taken.
    pub(super) fn read_write<'a>(
        &mut self,
        hash: u64,
        index: &'a mut Index,
    ) -> Option<(&'a TaskKey, &'a mut Entry)> {
        let (key, entry) = index.dirty(hash, self.round)?;
        entry.dirty = false;
        entry.persisted = true;
        self.dirty -= 1;
        self.taken += 1;
        Some((key, entry))
    }

    /// Puts back what a snapshot round took and failed to write: each removal unless a newer
    /// change to the id is journaled (it wins), and each write (`hashes`) by marking the
    /// entries of those hashes dirty again. A task `index` holds under such an id is marked
    /// persisted: the store may still hold a version the snapshot was to remove, and a newer
    /// change that wins over that removal (a task scheduled again meanwhile) must not let a
    /// later cancel skip the store.
    pub(super) fn put_back(&mut self, removals: Ids<u64>, hashes: Vec<u64>, index: &mut Index) {
        for (id, due_at) in removals {
            let hash = index.hash(id.id());
            if let Some((key, entry)) = index.get_hashed_mut(hash, id.id()) {
                // Scheduled again since: written as its current version, never removed.
                entry.persisted = true;
                self.upsert(hash, key, entry);
                continue;
            }
            self.removals.entry(id).or_insert(due_at);
        }
        for hash in hashes {
            for (key, entry) in index.with_hash(hash) {
                entry.persisted = true;
                self.upsert(hash, key, entry);
            }
        }
    }

    /// Notes when the oldest unflushed change was made (for the lag metric).
    pub(super) fn changed(&mut self) {
        if self.oldest.is_none() {
            self.oldest = Some(Instant::now());
        }
    }

    /// Records the removal of `id`'s task (due at `due_at`, as best known: only the round's
    /// order depends on it), under the id alone ([`TaskKey::bare`]): a removal must not keep
    /// the task's envelope (a payload can be 64 KiB) alive until it is flushed, which can be
    /// long while Redis is down. The task is no longer in the index.
    pub(super) fn record_removal(&mut self, id: &str, due_at: u64) {
        self.changed();
        match self.removals.get_mut(id) {
            Some(due) => *due = due_at,
            None => {
                self.removals.insert(TaskKey::bare(id), due_at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round reads each write once: an entry written by it, then changed again while it
    /// runs, is left to the next round, even though the round holds a second (stale) item of
    /// its id. (Two writes of one id in one round may land in either order, the older last.)
    #[test]
    fn a_round_reads_no_entry_dirtied_after_it_took_the_journal() {
        let mut index = Index::with_hasher(Default::default());
        let mut journal = Journal::default();
        let key = TaskKey::bare("x");
        let hash = index.hash("x");
        let dirty = |journal: &Journal| Entry {
            timer: None,
            persisted: false,
            dirty: true,
            since: journal.round(),
        };
        // Scheduled, cancelled before any round (a stale item), scheduled again.
        index.insert_hashed(hash, key.clone(), dirty(&journal));
        journal.scheduled(hash, 1, false, &index);
        let (_, old) = index.remove_hashed(hash, "x").unwrap();
        journal.forget(&old);
        index.insert_hashed(hash, key.clone(), dirty(&journal));
        journal.scheduled(hash, 2, false, &index);
        let round = journal.take_all(&index);
        assert_eq!(round.upserts.len(), 2, "two items of x");
        assert!(
            journal.read_write(hash, &mut index).is_some(),
            "the first reads x"
        );
        // Written again while the round runs: dirty again, a new item.
        let (key, entry) = index.get_hashed_mut(hash, "x").unwrap();
        journal.upsert(hash, &key.clone(), entry);
        assert!(
            journal.read_write(hash, &mut index).is_none(),
            "the round's second item read x again"
        );
        let next = journal.take_all(&index);
        assert_eq!(next.upserts.len(), 1);
        assert!(
            journal.read_write(hash, &mut index).is_some(),
            "the next round reads x"
        );
        assert_eq!(journal.dirty, 0);
    }
}
