//! The journal: every change callers made since the last flush round, keyed by task id (a
//! later change to an id replaces an earlier one), and the flags by which callers and the
//! flusher signal each other.

use std::hash::BuildHasher;
use std::time::Instant;

use hashbrown::hash_map::{Entry as MapEntry, RawEntryMut};

use crate::redis::persist::index::{Ids, Index, TaskKey};

/// A journaled change to one id, turned into a store [`Op`] by the flusher.
#[derive(Clone, Copy)]
pub(super) enum Change {
    /// Write the task's envelope, as the index holds it when the flusher gets to this change:
    /// the caller shares nothing with the journal but the id, and the due time the round is
    /// sorted by. Encoded by the flusher, off the caller's path, and never if a later change
    /// replaces it first. A failed write comes back as this too, and then writes the newest
    /// version.
    Upsert(u64),
    /// Remove the task (cancelled, or fired and acknowledged). It carries the due time of the
    /// version removed, as best known (0 when not), only to sort the round by.
    Remove(u64),
}

impl Change {
    /// Where the change sorts in a round: removals by due time, then writes by due time.
    /// Redis removes ZSET members in due order three times as fast as in the order of a hash
    /// map (1M ZREM + HDEL in batches of 1 000 through `redis-cli --pipe`: 1.29 and 1.58 s
    /// sorted, 4.47 and 5.56 s shuffled): each removal walks the skiplist down to its member,
    /// and in order the walks share their cache lines. Removals first: they free memory, and
    /// a Redis at `maxmemory` (`noeviction`) refuses a batch with a ZADD or HSET in it whole
    /// but takes one of ZREM and HDEL only (see [`batch_ranges`]).
    pub(super) fn sort_key(&self) -> (bool, u64) {
        match self {
            Change::Remove(due_at) => (false, *due_at),
            Change::Upsert(due_at) => (true, *due_at),
        }
    }

    pub(super) fn is_removal(&self) -> bool {
        matches!(self, Change::Remove(_))
    }
}

#[derive(Default)]
pub(super) struct Journal {
    pub(super) ops: Ids<Change>,
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
    /// Someone waits for a round (`flush`, WriteThrough, `snapshot`): the flusher starts one
    /// now instead of sleeping. A flag, not just the condvar, so a kick made while the flusher
    /// is busy is not lost.
    pub(super) kicked: bool,
    /// The flusher has taken a round and not yet booked its end (failures journaled again):
    /// its removals may not have reached the store. `restore` waits for it before reading.
    pub(super) in_round: bool,
    /// Changes the round in progress took out of `ops` and has not booked yet: they count
    /// against `journal_bound` as much as those still in `ops` (a failed round puts them back).
    pub(super) taken: usize,
}

impl Journal {
    /// Unflushed changes: journaled, or taken by the round in progress.
    pub(super) fn depth(&self) -> usize {
        self.ops.len() + self.taken
    }

    /// Puts back what a failed snapshot took, unless a newer change to the id is journaled (it
    /// wins). A task `index` holds under such an id is marked persisted: the store may still
    /// hold a version the snapshot was to remove, and a newer change that wins over that
    /// removal (a task scheduled again meanwhile) must not let a later cancel skip the store.
    pub(super) fn put_back(&mut self, ops: Ids<Change>, index: &mut Index) {
        for (id, change) in ops {
            if let Some((_, entry)) = index.get_mut(id.id()) {
                entry.persisted = true;
            }
            if let MapEntry::Vacant(slot) = self.ops.entry(id) {
                slot.insert(change);
            }
        }
    }

    /// Records `change` for `id`, replacing (and returning) any earlier unflushed change to
    /// that id.
    pub(super) fn record(&mut self, id: TaskKey, change: Change) -> Option<Change> {
        let hash = self.ops.hasher().hash_one(id.id());
        self.record_hashed(hash, id, change)
    }

    /// [`record`](Self::record), given the id's hash (the journal and the index hash alike).
    pub(super) fn record_hashed(
        &mut self,
        hash: u64,
        id: TaskKey,
        change: Change,
    ) -> Option<Change> {
        self.changed();
        debug_assert_eq!(hash, self.ops.hasher().hash_one(id.id()));
        match self
            .ops
            .raw_entry_mut()
            .from_key_hashed_nocheck(hash, id.id())
        {
            RawEntryMut::Occupied(mut slot) => Some(slot.insert(change)),
            RawEntryMut::Vacant(slot) => {
                slot.insert_hashed_nocheck(hash, id, change);
                None
            }
        }
    }

    /// Takes the journaled changes, leaving an empty map that hashes as this one did (as the
    /// index does).
    pub(super) fn take_ops(&mut self) -> Ids<Change> {
        let empty = Ids::with_hasher(self.ops.hasher().clone());
        std::mem::replace(&mut self.ops, empty)
    }

    /// Keys the change journaled for `key`'s id by `key` (a task's new version), so that it no
    /// longer keeps the version it was first journaled with alive (payloads can be 64 KiB).
    /// Only on a replacement: `record` keeps a key it finds, and re-keying every call would
    /// cost the hot path a probe.
    pub(super) fn rekey(&mut self, key: TaskKey) {
        if let Some((_, change)) = self.ops.remove_entry(key.id()) {
            self.ops.insert(key, change);
        }
    }

    /// Notes when the oldest unflushed change was made (for the lag metric).
    pub(super) fn changed(&mut self) {
        if self.oldest.is_none() {
            self.oldest = Some(Instant::now());
        }
    }

    /// Records the removal of `id`'s task. A task Redis never heard of (not `persisted`, its
    /// upsert still here) just loses that upsert: scheduled and cancelled within one flush
    /// window, it costs no Redis command at all. (Before a restore has completed the caller
    /// passes `persisted`: Redis may hold an older version of the id.)
    /// `hash` is the id's hash (the journal and the index hash alike).
    pub(super) fn remove(&mut self, hash: u64, id: TaskKey, persisted: bool, due_at: u64) {
        debug_assert_eq!(hash, self.ops.hasher().hash_one(id.id()));
        match self
            .ops
            .raw_entry_mut()
            .from_key_hashed_nocheck(hash, id.id())
        {
            RawEntryMut::Occupied(slot)
                if !persisted && matches!(slot.get(), Change::Upsert(_)) =>
            {
                slot.remove();
            }
            _ => self.record_removal(id.id(), due_at),
        }
    }

    /// Records the removal of `id`'s task (due at `due_at`, as best known: only the round's
    /// order depends on it), replacing any earlier change to it, under the id alone
    /// ([`TaskKey::bare`]): a removal must not keep the task's envelope (a payload can be
    /// 64 KiB) alive until it is flushed, which can be long while Redis is down.
    pub(super) fn record_removal(&mut self, id: &str, due_at: u64) {
        self.ops.remove(id);
        self.record(TaskKey::bare(id), Change::Remove(due_at));
    }
}
