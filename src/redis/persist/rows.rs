//! What passes between the engine and its store: the changes the flusher writes ([`Op`]),
//! the rows a restore reads back ([`Row`], [`Rows`], decoded into a [`Page`] of tasks and
//! [`Broken`] entries), and where a paged read goes on ([`Cursor`]).

use std::fmt;

use crate::redis::envelope::{Envelope, MAX_DUE_MS};

/// One change to the stored set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Store (or replace) a task: its id, due time and encoded envelope.
    Upsert {
        /// The task id.
        id: String,
        /// The due time, ms since the Unix epoch (at most 2^53 − 1).
        due_at: u64,
        /// The encoded [`Envelope`].
        envelope: Vec<u8>,
    },
    /// Remove a task (cancelled, or fired and acknowledged).
    Remove(String),
}

impl Op {
    /// The task id the operation is about.
    pub(crate) fn id(&self) -> &str {
        match self {
            Op::Upsert { id, .. } | Op::Remove(id) => id,
        }
    }

    /// The operations of a batch that are the last for their id, in their order: in a
    /// [`TaskStore::apply`](super::TaskStore::apply) batch the last operation per id wins (and
    /// a store's statement may touch a row only once).
    pub(crate) fn last_per_id(ops: &[Op]) -> Vec<&Op> {
        let mut last: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            last.insert(op.id(), i);
        }
        ops.iter()
            .enumerate()
            .filter(|(i, op)| last.get(op.id()) == Some(i))
            .map(|(_, op)| op)
            .collect()
    }
}

/// Why a stored entry could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokenReason {
    /// The ZSET names the id but the HASH has no envelope for it.
    MissingEnvelope,
    /// The envelope is not valid JSON of an [`Envelope`].
    Undecodable(String),
    /// The score is not an integer time in `0..=2^53 − 1` ms.
    BadScore(String),
    /// The envelope names another id (given here) than the entry it is stored under.
    IdMismatch(String),
    /// The id is empty (which `schedule` refuses; another client wrote it).
    EmptyId,
}

impl fmt::Display for BrokenReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BrokenReason::MissingEnvelope => f.write_str("no envelope in the tasks hash"),
            BrokenReason::Undecodable(e) => write!(f, "undecodable envelope: {e}"),
            BrokenReason::BadScore(s) => write!(f, "score {s} is not a valid due time"),
            BrokenReason::IdMismatch(other) => write!(f, "the envelope names id {other:?}"),
            BrokenReason::EmptyId => f.write_str("the id is empty"),
        }
    }
}

/// A stored entry that could not be used, with what was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    /// The ZSET member.
    pub id: String,
    /// The raw envelope bytes, if any.
    pub raw: Option<Vec<u8>>,
    /// What is wrong with it.
    pub reason: BrokenReason,
}

/// One stored task as a store holds it, before it is decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The task id.
    pub id: String,
    /// The due time as stored (a Redis score, a column): an integer of ms since the epoch.
    pub due: String,
    /// The encoded envelope, or `None` when the store has no envelope for the id.
    pub envelope: Option<Vec<u8>>,
}

/// One page of stored rows, and where to continue (`None`: done).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rows {
    /// The cursor for the next page; `None` when the scan is complete.
    pub next: Option<Cursor>,
    /// The rows.
    pub rows: Vec<Row>,
    /// Entries of this page the store moved to its dead letters itself, because it cannot
    /// hand them out as rows (for Redis: ZSET members that are not UTF-8, which only another
    /// client writes).
    pub set_aside: usize,
}

impl Rows {
    /// Decodes the rows, sorting out those with no envelope, an undecodable one, one that
    /// names another id, an empty id, or a due time that is not an integer in
    /// `0..=2^53 − 1`. The stored due time is authoritative.
    pub fn classify(self) -> Page {
        let mut page = Page {
            next: self.next,
            ..Page::default()
        };
        for Row { id, due, envelope } in self.rows {
            let due_ms = due
                .parse::<f64>()
                .ok()
                .filter(|s| s.fract() == 0.0 && *s >= 0.0 && *s <= MAX_DUE_MS as f64);
            let reason = match (due_ms, &envelope) {
                (None, _) => BrokenReason::BadScore(due),
                (Some(_), None) => BrokenReason::MissingEnvelope,
                (Some(due_ms), Some(bytes)) => match Envelope::decode(bytes) {
                    Ok(env) if env.id != id => BrokenReason::IdMismatch(env.id),
                    Ok(_) if id.is_empty() => BrokenReason::EmptyId,
                    Ok(mut env) => {
                        env.due_at = due_ms as u64;
                        page.tasks.push(env);
                        continue;
                    }
                    Err(e) => BrokenReason::Undecodable(e.to_string()),
                },
            };
            page.broken.push(Broken {
                id,
                raw: envelope,
                reason,
            });
        }
        page
    }
}

/// One page of a scan: usable tasks, broken entries, and where to continue (`None`: done).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Page {
    /// The cursor for the next page; `None` when the scan is complete.
    pub next: Option<Cursor>,
    /// Tasks whose envelope and score are valid (the score is authoritative for `due_at`).
    pub tasks: Vec<Envelope>,
    /// Entries that are not.
    pub broken: Vec<Broken>,
}

/// Where a paged read of a store ([`TaskStore::rows`](super::TaskStore::rows)) goes on: opaque bytes that only the
/// store that made them reads (a position in its order, and whatever it needs to tell that the
/// position still means the same thing: [`RedisStore`](crate::redis::RedisStore) keeps the server's
/// `run_id`, the due time and the id of the last row read). Empty bytes are the start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cursor(Vec<u8>);

impl Cursor {
    /// The start of a scan.
    pub const fn start() -> Cursor {
        Cursor(Vec::new())
    }

    /// A store's position, as it encodes it (empty bytes are the start).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Cursor {
        Cursor(bytes.into())
    }

    /// Whether this is the start of a scan.
    pub fn is_start(&self) -> bool {
        self.0.is_empty()
    }

    /// The position's bytes, for the store that made them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}
