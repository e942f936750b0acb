//! A [`Persistent`](super::Persistent) engine's settings ([`PersistConfig`] and its
//! policies), its error type, and what a restore reports.

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::redis::envelope::{Envelope, EnvelopeError};
use crate::redis::layout::{NamespaceError, NamespaceInUse};
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::WallClock;
use crate::BuildError;

/// When a change counts as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `schedule` returns at once; the flusher writes within `flush_interval`. A crash loses
    /// the changes not yet written: the last flush window's while Redis answers, and all of
    /// those since it stopped answering while it does not (up to `journal_bound`).
    #[default]
    WriteBehind,
    /// `schedule` returns only once Redis has acknowledged the write (or, with
    /// [`PersistConfig::write_through_timeout`], says it has not within that time). `cancel`
    /// and `ack` stay write-behind: a crash right after one can bring the task back, to fire
    /// again (call [`Persistent::flush`](crate::redis::Persistent::flush) where that matters).
    WriteThrough,
}

/// What `schedule` does when the journal holds `journal_bound` unflushed changes (Redis is
/// down or slow).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenFull {
    /// Wait until the flusher has made room.
    #[default]
    Block,
    /// Return [`PersistError::JournalFull`] with the envelope.
    Error,
}

/// What [`Persistent::restore`](crate::redis::Persistent::restore) does with tasks whose due time passed while no process held
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overdue {
    /// Fire them all at once.
    #[default]
    AtOnce,
    /// Fire them at most this many per second, in the order restore finds them, so that a
    /// backlog after a long outage does not flood the handlers.
    RateLimited {
        /// Overdue tasks fired per second.
        per_second: NonZeroU32,
    },
}

/// Settings of a [`Persistent`](crate::redis::Persistent) engine.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PersistConfig {
    /// Redis URL (`redis://user:password@host/db`, `redis+unix:///path`, ...).
    pub url: String,
    /// Seed nodes of a Redis Cluster (`redis://host:port`); when given, the engine talks to
    /// the cluster and `url` is not used. The namespace's keys share one hash tag, so they
    /// live in one slot and each batch is still one MULTI on one node.
    pub cluster_nodes: Vec<String>,
    /// The namespace: keys are `{ns}:due`, `{ns}:tasks`, `{ns}:dead`.
    pub namespace: String,
    /// How often the flusher writes (default 5 ms).
    pub flush_interval: Duration,
    /// Changes per Redis transaction (default 1 000).
    pub batch: usize,
    /// Unflushed changes the journal may hold before `schedule` applies `when_full`
    /// (default 1 000 000). Cancels, acks and a restore's corrections are journaled past it,
    /// since refusing them would lose them: each is one entry per id at most, so the journal
    /// holds at most the bound plus the ids Redis may hold (the tasks written before it
    /// stopped answering).
    pub journal_bound: usize,
    /// What happens beyond the bound.
    pub when_full: WhenFull,
    /// When a change counts as done.
    pub durability: Durability,
    /// With [`Durability::WriteThrough`], the longest `schedule` waits (default `None`: as long
    /// as it takes, until `shutdown`). A journal still full at the end (policy
    /// [`WhenFull::Block`]) refuses the task with [`PersistError::JournalFull`]; a write Redis
    /// has not confirmed by then gives [`PersistError::Unconfirmed`]. `Some(Duration::ZERO)`
    /// does not wait at all. Not used with `WriteBehind`.
    pub write_through_timeout: Option<Duration>,
    /// The largest encoded envelope accepted (default 64 KiB).
    pub max_envelope: usize,
    /// Queue of fired tasks waiting for the consumer (default 65 536; the driver waits when full;
    /// `1..=2^24`, else `start` fails with [`BuildError::Capacity`]).
    pub fired_bound: usize,
    /// What `restore` does with overdue tasks (default: fire at once).
    pub overdue: Overdue,
    /// The wall clock due times are read against (default: the system's). A manual one also
    /// drives the engine's timer, for deterministic tests.
    pub clock: WallClock,
    /// How long the engine's writer lease (`{ns}:engine`, holding the engine's name) lasts
    /// unless renewed (default 5 s; renewed every third of it). An engine writes to Redis, and
    /// restores from it, only while it holds the lease, so that the engine of a new process
    /// waits for the old one's `shutdown` (which gives the lease up) or, after a crash, for
    /// the lease to expire. One that could not renew it in time stops writing (its changes
    /// wait in the journal) and takes it back once it can, unless another engine took it
    /// meanwhile (`{ns}:engine:takes` names the last taker): then it writes nothing again, and
    /// `shutdown` hands back what it did not write. Redis refuses its removals (and a
    /// snapshot's swap) once the lease is another's; a batch of writes already on its way
    /// when the lease lapses may still land. `10 ms..=1 day`, else `start` fails with
    /// [`PersistError::Config`].
    pub engine_lease: Duration,
    /// How long `start` waits for another engine's lease to be given up or to expire before
    /// it fails with [`PersistError::EngineRunning`] (default 30 s). If Redis cannot be asked
    /// (down or slow), `start` does not wait: the engine starts without the lease, writes
    /// nothing until its lease loop takes it, and a `restore` until then fails.
    pub takeover_wait: Duration,
}

impl PersistConfig {
    /// Refuses settings that could never work, before anything is connected or started.
    pub(super) fn check(&self) -> Result<(), PersistError> {
        if self.flush_interval.is_zero() || self.batch == 0 || self.journal_bound == 0 {
            // A zero interval spins against a Redis that is down; a zero bound or batch can
            // never take a change.
            return Err(PersistError::Config(
                "flush_interval, batch and journal_bound must be positive",
            ));
        }
        crate::engine::error::capacity(self.fired_bound).map_err(PersistError::Build)?;
        if !(Duration::from_millis(10)..=Duration::from_secs(86_400)).contains(&self.engine_lease) {
            return Err(PersistError::Config(
                "engine_lease must be between 10 ms and a day",
            ));
        }
        Ok(())
    }

    /// Defaults for `url` and `namespace`.
    pub fn new(url: impl Into<String>, namespace: impl Into<String>) -> PersistConfig {
        PersistConfig {
            url: url.into(),
            cluster_nodes: Vec::new(),
            namespace: namespace.into(),
            flush_interval: Duration::from_millis(5),
            batch: 1_000,
            journal_bound: 1_000_000,
            when_full: WhenFull::Block,
            durability: Durability::WriteBehind,
            write_through_timeout: None,
            max_envelope: 64 * 1024,
            fired_bound: 65_536,
            overdue: Overdue::AtOnce,
            clock: WallClock::system(),
            engine_lease: Duration::from_secs(5),
            takeover_wait: Duration::from_secs(30),
        }
    }
}

/// Errors of the persistent engine. Those that refuse a task hand the envelope back. Variants
/// that wrap another error say what failed in their `Display`, and return the wrapped error
/// from [`source`](std::error::Error::source) (print the chain to see both).
#[derive(Debug)]
#[non_exhaustive]
pub enum PersistError {
    /// The namespace cannot be a hash tag.
    Namespace(NamespaceError),
    /// The engine could not be built.
    Build(BuildError),
    /// Redis refused or failed.
    Store(StoreError),
    /// The envelope breaks a limit (size, due time, empty id).
    Envelope(EnvelopeError, Box<Envelope>),
    /// The journal is full (Redis down or slow) and the policy is [`WhenFull::Error`].
    JournalFull(Box<Envelope>),
    /// The engine has been shut down: the envelope comes back unscheduled. (A `WriteThrough`
    /// schedule that a shutdown interrupts while it waits for Redis returns
    /// [`Unconfirmed`](Self::Unconfirmed) instead: that task was taken.)
    Shutdown(Box<Envelope>),
    /// `WriteThrough` only: Redis did not confirm the task within
    /// [`PersistConfig::write_through_timeout`] (it is down or slow), or a
    /// [`shutdown`](crate::redis::Persistent::shutdown) ended the wait. The task was *not* refused: it is
    /// scheduled in memory and its write stays in the journal, sent when Redis answers, as with
    /// `WriteBehind`; a shutdown's final round writes it, or returns it among the tasks it
    /// could not write. A crash before that loses it. [`Persistent::cancel`](crate::redis::Persistent::cancel) with this id withdraws it, unless it has fired
    /// meanwhile (then it waits for `ack` like any fired task) or another `schedule` of the id
    /// has replaced it (then `cancel` withdraws that one).
    Unconfirmed(String),
    /// A setting is out of range (named in the message).
    Config(&'static str),
    /// [`Persistent::restore`](crate::redis::Persistent::restore) after (or interrupted by) [`Persistent::shutdown`](crate::redis::Persistent::shutdown): the tasks
    /// not loaded stay in the store.
    Stopped,
    /// The namespace is used by a queue ([`Producer`](crate::redis::Producer),
    /// [`Consumer`](crate::redis::Consumer)).
    InUse(NamespaceInUse),
    /// Another engine (named) holds the namespace's writer lease: it did not give it up
    /// within [`PersistConfig::takeover_wait`] (from `start`), or holds it now (from
    /// `restore`). See [`PersistConfig::engine_lease`].
    EngineRunning(String),
    /// Another engine (named) took the namespace's writer lease from this one while it ran
    /// (a second process on the namespace, a lease that ran out while this one stalled): this
    /// engine writes nothing to the store any more, so it refuses new tasks, handing the
    /// envelope back. Shut it down and start a new engine, which restores what the other
    /// wrote. [`Persistent::is_writing`](crate::redis::Persistent::is_writing) tells it beforehand.
    LeaseLost(String, Box<Envelope>),
}

impl fmt::Display for PersistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PersistError::Namespace(_) => f.write_str("the namespace cannot be used"),
            PersistError::Build(_) => f.write_str("the persistent engine could not be built"),
            PersistError::Store(_) => f.write_str("the task store failed"),
            PersistError::Envelope(_, envelope) => {
                write!(f, "task {:?} refused: it breaks a limit", envelope.id)
            }
            PersistError::JournalFull(_) => f.write_str("the persistence journal is full"),
            PersistError::Config(e) => write!(f, "bad persistence setting: {e}"),
            PersistError::Shutdown(_) => f.write_str("the engine has been shut down"),
            PersistError::Stopped => f.write_str("restore stopped: the engine is shut down"),
            PersistError::InUse(_) => f.write_str("the namespace is used by a queue"),
            PersistError::EngineRunning(holder) => write!(
                f,
                "another persistent engine ({holder}) holds the namespace's writer lease"
            ),
            PersistError::LeaseLost(holder, envelope) => write!(
                f,
                "task {:?} refused: another persistent engine ({holder}) took the namespace's \
                 writer lease, and this engine no longer writes to the store",
                envelope.id
            ),
            PersistError::Unconfirmed(id) => write!(
                f,
                "task {id:?} is scheduled but Redis did not confirm it within the write-through timeout"
            ),
        }
    }
}

impl std::error::Error for PersistError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PersistError::Namespace(e) => Some(e),
            PersistError::Build(e) => Some(e),
            PersistError::Store(e) => Some(e),
            PersistError::Envelope(e, _) => Some(e),
            PersistError::InUse(e) => Some(e),
            _ => None,
        }
    }
}

/// What `restore` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RestoreReport {
    /// Tasks loaded into the wheel (overdue ones fire per [`Overdue`]).
    pub loaded: usize,
    /// Broken entries handed to the store's dead-lettering (a [`RedisStore`](crate::redis::RedisStore) leaves those
    /// rewritten since they were read in place, and this still counts them).
    pub dead_lettered: usize,
    /// Loaded tasks that were already due (fired per [`Overdue`]).
    pub overdue: usize,
    /// Times the scan started again from the start because the store could no longer continue
    /// from its cursor (for Redis: the server restarted or failed over during the restore).
    /// What was loaded before stays loaded.
    pub rescans: usize,
}
