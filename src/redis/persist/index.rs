//! The task index: each task held, keyed by its id through [`TaskKey`], which is the task's
//! envelope, shared by the index, the journal and the timer.

use hashbrown::HashMap;
use std::sync::Arc;

use crate::redis::envelope::Envelope;
use crate::TimerId;

/// A task held in the index. Its envelope is its key ([`TaskKey`]): the index's key is always
/// the current version (a replacement swaps the key along with the entry).
pub(super) struct Entry {
    /// `None` once fired (waiting for `ack`).
    pub(super) timer: Option<TimerId>,
    /// Whether Redis may hold some version of this task: set when the flusher reads an upsert
    /// of it from the index to write it (or a write of it failed). After a restore has
    /// completed, a cancel of a task that is not persisted and whose upsert is still in the
    /// journal just drops that upsert: no Redis command at all.
    pub(super) persisted: bool,
}

/// A task id as a map key and timer value: the task's envelope, shared. The key and the
/// envelope are one allocation, and the index, the journal and the timer share it by reference
/// count (an id of its own cost a fifth of a persistent schedule's time here). It hashes and
/// compares as its id, so maps keyed by it are looked up by `&str`.
#[derive(Clone)]
pub(super) struct TaskKey(pub(super) Arc<Envelope>);

impl TaskKey {
    /// The key of `envelope`.
    pub(super) fn of(envelope: &Arc<Envelope>) -> TaskKey {
        TaskKey(envelope.clone())
    }

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
/// cannot collide on purpose). A key may hold an older version of its task than the index's
/// entry (the journal keeps the key of the first change in a flush window): only its id is
/// read through it.
pub(super) type Ids<V> = HashMap<TaskKey, V, foldhash::fast::RandomState>;
