//! The task index: each task held, keyed by its id through [`TaskKey`], which is the task's
//! envelope, shared with the flusher (which encodes it) and the delivery of a fired task.

use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::hash_table::Entry as Slot;
use hashbrown::{HashMap, HashTable};

use crate::redis::envelope::Envelope;
use crate::TimerId;

/// Every task held, by id: a hash table of `(key, entry)` pairs hashed by id, so that a fired
/// timer, which carries only its task's id hash, finds its task by hash and timer id (and a
/// schedule or cancel hashes its id once, for the index and the journal alike).
pub(super) struct Index {
    table: HashTable<(TaskKey, Entry)>,
    hasher: foldhash::fast::RandomState,
}

impl Index {
    /// An empty index hashing with `hasher` (the journal's too).
    #[inline]
    pub(super) fn with_hasher(hasher: foldhash::fast::RandomState) -> Index {
        Index {
            table: HashTable::new(),
            hasher,
        }
    }

    /// The hash of `id`, as the index and the journal hash it.
    #[inline]
    pub(super) fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub(super) fn contains(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    #[inline]
    pub(super) fn get(&self, id: &str) -> Option<(&TaskKey, &Entry)> {
        self.table
            .find(self.hash(id), |(k, _)| k.id() == id)
            .map(|(k, e)| (k, e))
    }

    #[inline]
    pub(super) fn get_mut(&mut self, id: &str) -> Option<(&TaskKey, &mut Entry)> {
        let hash = self.hash(id);
        self.table
            .find_mut(hash, |(k, _)| k.id() == id)
            .map(|(k, e)| (&*k, e))
    }

    /// Removes `id`'s task (`hash` is its hash), returning its key and entry.
    #[inline]
    pub(super) fn remove_hashed(&mut self, hash: u64, id: &str) -> Option<(TaskKey, Entry)> {
        match self.table.find_entry(hash, |(k, _)| k.id() == id) {
            Ok(slot) => Some(slot.remove().0),
            Err(_) => None,
        }
    }

    /// Removes `id`'s task (`hash`: its hash) if it is pending: its key and entry, or
    /// `Err(true)` if it has fired (held until acknowledged: left in place), `Err(false)` if
    /// it is not held.
    #[inline]
    pub(super) fn remove_pending(&mut self, hash: u64, id: &str) -> Result<(TaskKey, Entry), bool> {
        match self.table.find_entry(hash, |(k, _)| k.id() == id) {
            Ok(slot) if slot.get().1.timer.is_none() => Err(true),
            Ok(slot) => Ok(slot.remove().0),
            Err(_) => Err(false),
        }
    }

    #[inline]
    pub(super) fn remove(&mut self, id: &str) -> Option<(TaskKey, Entry)> {
        self.remove_hashed(self.hash(id), id)
    }

    /// Holds `entry` under `key` (`hash` is its id's hash), returning the key and entry it
    /// replaces (the id's previous version), if any. A replacement is `persisted` if the
    /// version it replaces was: the store may hold that one. A dirty replacement of a dirty
    /// version keeps its `since`: the item that names it is the replaced version's.
    #[inline]
    pub(super) fn insert_hashed(
        &mut self,
        hash: u64,
        key: TaskKey,
        entry: Entry,
    ) -> Option<(TaskKey, Entry)> {
        debug_assert_eq!(hash, self.hash(key.id()));
        let hasher = &self.hasher;
        match self.table.entry(
            hash,
            |(k, _)| k.id() == key.id(),
            |(k, _)| hasher.hash_one(k.id()),
        ) {
            Slot::Occupied(mut slot) => {
                let old = std::mem::replace(slot.get_mut(), (key, entry));
                let new = &mut slot.get_mut().1;
                new.persisted |= old.1.persisted;
                if new.dirty && old.1.dirty {
                    new.since = old.1.since;
                }
                Some(old)
            }
            Slot::Vacant(slot) => {
                slot.insert((key, entry));
                None
            }
        }
    }

    #[inline]
    pub(super) fn insert(&mut self, key: TaskKey, entry: Entry) -> Option<(TaskKey, Entry)> {
        self.insert_hashed(self.hash(key.id()), key, entry)
    }

    /// The task whose timer `timer` is, if it still has it (`hash`: its id's hash, the
    /// timer's value). A task replaced or cancelled since has another timer or none.
    #[inline]
    pub(super) fn fired(&mut self, hash: u64, timer: TimerId) -> Option<(&TaskKey, &mut Entry)> {
        self.table
            .find_mut(hash, |(_, e)| e.timer == Some(timer))
            .map(|(k, e)| (&*k, e))
    }

    #[inline]
    pub(super) fn get_hashed_mut(&mut self, hash: u64, id: &str) -> Option<(&TaskKey, &mut Entry)> {
        debug_assert_eq!(hash, self.hash(id));
        self.table
            .find_mut(hash, |(k, _)| k.id() == id)
            .map(|(k, e)| (&*k, e))
    }

    /// An entry whose id hashes to `hash` that became dirty before round `round` took the
    /// journal, if there is one (see the journal).
    pub(super) fn dirty(&mut self, hash: u64, round: u32) -> Option<(&TaskKey, &mut Entry)> {
        let hasher = &self.hasher;
        self.table
            .find_mut(hash, |(k, e)| {
                e.dirty && e.since != round && hasher.hash_one(k.id()) == hash
            })
            .map(|(k, e)| (&*k, e))
    }

    /// Every entry whose id hashes to `hash` (one, but for a collision of two ids).
    pub(super) fn with_hash(&mut self, hash: u64) -> impl Iterator<Item = (&TaskKey, &mut Entry)> {
        let hasher = &self.hasher;
        self.table
            .iter_hash_mut(hash)
            .filter(move |(k, _)| hasher.hash_one(k.id()) == hash)
            .map(|(k, e)| (&*k, e))
    }

    #[inline]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&TaskKey, &Entry)> {
        self.table.iter().map(|(k, e)| (k, e))
    }

    #[inline]
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&TaskKey, &mut Entry)> {
        self.table.iter_mut().map(|(k, e)| (&*k, e))
    }
}

/// A task held in the index. Its envelope is its key ([`TaskKey`]): the index's key is always
/// the current version (a replacement swaps the key along with the entry).
pub(super) struct Entry {
    /// `None` once fired (waiting for `ack`).
    pub(super) timer: Option<TimerId>,
    /// Whether Redis may hold some version of this task: set when the flusher reads an upsert
    /// of it from the index to write it (or a write of it failed). After a restore has
    /// completed, a cancel of a task that is not persisted and still dirty just drops it: no
    /// store command at all.
    pub(super) persisted: bool,
    /// Its current version is still to be written (no round has read it yet): see the
    /// journal.
    pub(super) dirty: bool,
    /// The journal's round count when it became dirty: the round taken then (and running)
    /// does not read it, since the items that round took may not name it. Meaningless while
    /// not dirty.
    pub(super) since: u32,
}

/// A task id as a map key: the task's envelope, shared. The key and the envelope are one
/// allocation, which the flusher and a fired task's delivery share by reference count (an id
/// of its own cost a fifth of a persistent schedule's time here). It hashes and compares as
/// its id, so maps keyed by it are looked up by `&str`.
#[derive(Clone)]
pub(super) struct TaskKey(pub(super) Arc<Envelope>);

impl TaskKey {
    /// A key for an id whose envelope is not held (a failed removal, journaled again).
    pub(super) fn bare(id: &str) -> TaskKey {
        TaskKey(Arc::new(Envelope {
            id: id.to_owned(),
            topic: std::borrow::Cow::Borrowed(""),
            payload: serde_json::Value::Null,
            attempt: 0,
            created_at: 0,
            headers: Default::default(),
            due_at: 0,
        }))
    }

    pub(super) fn id(&self) -> &str {
        &self.0.id
    }

    /// The envelope: in the index, the task's current version.
    pub(super) fn envelope(&self) -> &Arc<Envelope> {
        &self.0
    }
}

impl std::borrow::Borrow<str> for TaskKey {
    fn borrow(&self) -> &str {
        self.id()
    }
}

impl std::hash::Hash for TaskKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes: `Borrow<str>` lookups must find it.
        self.id().hash(state);
    }
}

impl PartialEq for TaskKey {
    fn eq(&self, other: &TaskKey) -> bool {
        self.id() == other.id()
    }
}

impl Eq for TaskKey {}

/// Maps keyed by task id, hashed with foldhash (seeded per process, so ids chosen by a client
/// cannot collide on purpose). Outside the index, a key may be a bare id ([`TaskKey::bare`]): only
/// its id is read through it.
pub(super) type Ids<V> = HashMap<TaskKey, V, foldhash::fast::RandomState>;
