//! Write-behind persistence: an engine whose pending tasks are mirrored into Redis by a
//! background flusher, and reloaded by [`Persistent::restore`] after a restart.
//!
//! # Ground rules
//!
//! * The engine (memory) is the source of truth. Every change is recorded in the journal, keyed
//!   by task id, so later changes to an id replace earlier ones (coalescing): once a restore
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

use hashbrown::hash_map::RawEntryMut;
use hashbrown::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::redis::blocking::{wait_on, OwnedRuntime};
use crate::redis::envelope::{Envelope, EnvelopeError};
use crate::redis::layout::{KeyLayout, NamespaceError, NamespaceInUse};
use crate::redis::persist::flusher::{flush_loop, Change, Journal};
use crate::redis::persist::redis_store::{RedisStore, Rows, StoreError};
use crate::redis::persist::task_store::{guarded, Cursor, Lease, TaskStore};
use crate::redis::wall_clock::{micros_since, Anchor, WallClock};
use crate::{BuildError, Timer, TimerId};

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
    /// again (call [`Persistent::flush`] where that matters).
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

/// What [`Persistent::restore`] does with tasks whose due time passed while no process held
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

/// Settings of a [`Persistent`] engine.
#[derive(Debug, Clone)]
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
    fn check(&self) -> Result<(), PersistError> {
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

/// Errors of the persistent engine. Those that refuse a task hand the envelope back.
#[derive(Debug)]
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
    /// [`shutdown`](Persistent::shutdown) ended the wait. The task was *not* refused: it is
    /// scheduled in memory and its write stays in the journal, sent when Redis answers, as with
    /// `WriteBehind`; a shutdown's final round writes it, or returns it among the tasks it
    /// could not write. A crash before that loses it. [`Persistent::cancel`] with this id withdraws it, unless it has fired
    /// meanwhile (then it waits for `ack` like any fired task) or another `schedule` of the id
    /// has replaced it (then `cancel` withdraws that one).
    Unconfirmed(String),
    /// A setting is out of range (named in the message).
    Config(&'static str),
    /// [`Persistent::restore`] after (or interrupted by) [`Persistent::shutdown`]: the tasks
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
    /// wrote. [`Persistent::is_writing`] tells it beforehand.
    LeaseLost(String, Box<Envelope>),
}

impl fmt::Display for PersistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PersistError::Namespace(e) => e.fmt(f),
            PersistError::Build(e) => e.fmt(f),
            PersistError::Store(e) => e.fmt(f),
            PersistError::Envelope(e, _) => e.fmt(f),
            PersistError::JournalFull(_) => f.write_str("the persistence journal is full"),
            PersistError::Config(e) => write!(f, "bad persistence setting: {e}"),
            PersistError::Shutdown(_) => f.write_str("the engine has been shut down"),
            PersistError::Stopped => f.write_str("restore stopped: the engine is shut down"),
            PersistError::InUse(e) => e.fmt(f),
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

impl std::error::Error for PersistError {}

/// What `restore` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RestoreReport {
    /// Tasks loaded into the wheel (overdue ones fire per [`Overdue`]).
    pub loaded: usize,
    /// Broken entries handed to the store's dead-lettering (a [`RedisStore`] leaves those
    /// rewritten since they were read in place, and this still counts them).
    pub dead_lettered: usize,
    /// Loaded tasks that were already due (fired per [`Overdue`]).
    pub overdue: usize,
    /// Times the scan started again from the start because the store could no longer continue
    /// from its cursor (for Redis: the server restarted or failed over during the restore).
    /// What was loaded before stays loaded.
    pub rescans: usize,
}

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
pub(super) struct TaskKey(Arc<Envelope>);

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

/// Everything the callers and the flusher share, under `Inner::state`.
pub(super) struct State {
    /// The wall clock and the timer's clock read together, every second and at every flush
    /// round: `schedule` turns due times into timer deadlines with it instead of reading the
    /// clocks again (one clock read is a fifth of its cost here).
    pub(super) anchor: Anchor,
    /// Every task held: pending, or fired and not yet acknowledged.
    pub(super) index: Ids<Entry>,
    /// Restores in progress: a snapshot waits for them, or it would write a partly loaded set
    /// over the rows they have not read yet.
    pub(super) restoring: usize,
    /// A restore has completed. Until then memory may lack rows a previous process left, so
    /// snapshots are refused (they would delete those rows), and a cancel writes its removal even of
    /// a task this engine never wrote (the store may hold an earlier version of the id).
    /// (Once one has completed, memory holds every row, and a later one that fails changes
    /// nothing.)
    pub(super) restored: bool,
    /// Ids cancelled or acknowledged while a restore runs, or whose removal a flush round took
    /// out of the journal meanwhile: it must not load them again from a page read before their
    /// removal reached the store (a scan may also return a row twice).
    /// Emptied when the last restore ends.
    pub(super) gone: Ids<()>,
    pub(super) journal: Journal,
}

impl State {
    /// Notes that `id` left the index, for the restores in progress.
    fn mark_gone(&mut self, id: &TaskKey) {
        if self.restoring > 0 {
            self.gone.insert(id.clone(), ());
        }
    }

    /// No restore has completed, and none runs that could: a snapshot now would delete the
    /// rows a previous process left.
    fn unrestored(&self) -> bool {
        !self.restored && self.restoring == 0
    }

    /// Whether `id` changed since (its change still in the journal), or was cancelled or
    /// acknowledged while a restore ran: the store's row of it is not to be loaded.
    fn left(&self, id: &str) -> bool {
        self.journal.ops.contains_key(id) || self.gone.contains_key(id)
    }
}

pub(super) struct Inner {
    pub(super) cfg: PersistConfig,
    pub(super) state: Mutex<State>,
    /// Signalled after each flush round (room in the journal, WriteThrough progress).
    pub(super) flushed: Condvar,
    /// Wakes the flusher before its interval is over (`flush`, WriteThrough, shutdown).
    pub(super) kick: Condvar,
    pub(super) stopping: AtomicBool,
    /// `shutdown` has begun (the first call does the work).
    shut_down: AtomicBool,
    /// The first `shutdown` has finished; later calls wait for it on `shutdown_over`.
    shutdown_done: Mutex<bool>,
    shutdown_over: Condvar,
    /// This engine's name in the writer lease.
    holder: String,
    /// Until when this engine holds the writer lease, as far as it can tell (µs after
    /// `started`, on the monotonic clock; 0: not held): its last renewal was sent at least
    /// that long before Redis's expiry, less a margin for a write in flight. The flusher
    /// writes only before it (see [`PersistConfig::engine_lease`]).
    held_until_us: AtomicU64,
    started: Instant,
    /// Whether this engine has held the lease: a free lease is then taken back only if this
    /// engine took it last, and another holder means the namespace is lost.
    ever_held: AtomicBool,
    /// Another engine held the lease since this one took it: this engine never writes again
    /// (its state is older than what that engine may have written).
    lost: AtomicBool,
    /// The other engine last seen holding the lease (for `restore`'s error).
    lost_to: Mutex<String>,
}

impl Inner {
    /// Whether this engine holds the writer lease now (see `held_until_us`), and has not lost
    /// the namespace to another engine.
    pub(super) fn holds_lease(&self) -> bool {
        !self.lost.load(SeqCst) && self.since_start_us() < self.held_until_us.load(SeqCst)
    }

    /// Books the answer to a lease call sent at `asked` (µs after `started`) as `first` (this
    /// engine had never held the lease when it sent it): held until the call's ttl runs out
    /// (less a margin). Another holder, for a call sent once this engine had held the lease
    /// (the store takes it back only for the engine that took it last), means another engine
    /// may have written: lost for good. For a first call, it is only not held yet (and an
    /// answer booked late, after another call took the lease, changes nothing).
    fn book(&self, asked: u64, lease: Lease, first: bool) {
        match lease {
            Lease::Held => {
                self.ever_held.store(true, SeqCst);
                self.lease_held(asked);
            }
            Lease::Retaken(why) => {
                self.ever_held.store(true, SeqCst);
                self.lease_held(asked);
                if !first {
                    self.write_all_back(&why);
                }
            }
            Lease::Other(other) if !first => self.lose(other),
            Lease::Other(other) => *self.lost_to.lock() = other,
        }
        metrics::gauge!("delaywheel_persist_writing").set(if self.holds_lease() {
            1.0
        } else {
            0.0
        });
    }

    /// The store lost data this engine wrote (`why`: Redis restarted empty or from older
    /// data, failed over to a replica that lagged, or the namespace was flushed): memory holds
    /// every pending task, so it writes them all back. Once a restore has completed, as a
    /// snapshot (which also removes what a lagging replica kept of tasks since cancelled);
    /// before, as upserts in the journal (a snapshot then would delete the rows a previous
    /// process left that no restore has read yet). Counted in
    /// `delaywheel_store_data_loss_total`, and logged as an error.
    fn write_all_back(&self, why: &str) {
        metrics::counter!("delaywheel_store_data_loss_total").increment(1);
        let mut state = self.state.lock();
        let State {
            index,
            journal,
            restored,
            ..
        } = &mut *state;
        tracing::error!(reason = %why, tasks = index.len(), restored = *restored, "the store lost data: writing every pending task back");
        if *restored {
            journal.snapshot_wanted = true;
        } else {
            for (key, entry) in index.iter_mut() {
                entry.persisted = true;
                journal.record(key.clone(), Change::Upsert(key.envelope().due_at));
            }
        }
        self.kick(journal);
    }

    /// Another engine (`to`) holds or held the lease since this one took it: this engine
    /// writes nothing any more, and whoever waits for a flush round stops waiting.
    fn lose(&self, to: String) {
        self.held_until_us.store(0, SeqCst);
        if !self.lost.swap(true, SeqCst) {
            tracing::error!(other = %to, "another engine took the namespace's writer lease: this engine writes nothing to the store any more (shutdown() hands back what it did not write; restart it to restore the namespace)");
            *self.lost_to.lock() = to;
        }
        let _guard = self.state.lock();
        self.flushed.notify_all();
    }

    fn since_start_us(&self) -> u64 {
        micros_since(self.started)
    }

    /// A lease call sent at `asked` (µs after `started`) succeeded: held until its ttl, less a
    /// quarter for a write in flight.
    fn lease_held(&self, asked: u64) {
        let ttl = self.cfg.engine_lease;
        let margin = u64::try_from((ttl - ttl / 4).as_micros()).unwrap_or(u64::MAX);
        self.held_until_us
            .fetch_max(asked.saturating_add(margin), SeqCst);
    }

    /// Asks the flusher for a round now (`journal` is the locked journal).
    fn kick(&self, journal: &mut Journal) {
        journal.kicked = true;
        self.kick.notify_one();
    }

    /// Kicks the flusher until round `target` is done; `false` if `deadline` passes or the
    /// engine stops first (the flusher then does one last round and is gone: no use waiting).
    /// `shutdown` notifies `flushed` after setting `stopping`, so no wait outlives it.
    fn wait_for_round(
        &self,
        state: &mut MutexGuard<'_, State>,
        target: u64,
        deadline: Option<Instant>,
    ) -> bool {
        while state.journal.flushed < target {
            if self.lost.load(SeqCst) {
                return false; // no round will write again
            }
            // A round under way that reaches the target needs no kick: one now would ask for
            // a further round after it, which nobody waits for.
            if !(state.journal.in_round && state.journal.flushed + 1 >= target) {
                self.kick(&mut state.journal);
            }
            if self.stopping.load(SeqCst) || self.wait_round(state, deadline) {
                return state.journal.flushed >= target;
            }
        }
        true
    }

    /// Waits for the end of a flush round, until `deadline` (`None`: past what an `Instant`
    /// holds, so no deadline). Returns whether the deadline passed.
    fn wait_round(&self, state: &mut MutexGuard<'_, State>, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(deadline) => self.flushed.wait_until(state, deadline).timed_out(),
            None => {
                self.flushed.wait(state);
                false
            }
        }
    }
}

/// An engine whose tasks survive a restart: tasks with string ids and JSON payloads,
/// mirrored into Redis by a write-behind flusher. Fired tasks arrive on the receiver returned
/// by [`start`](Self::start) and leave Redis when [`ack`](Self::ack)ed.
///
/// The store is Redis unless [`with_store`](Self::with_store) is given another [`TaskStore`].
///
/// Dropping the engine shuts it down, but the tasks [`shutdown`](Self::shutdown) would hand
/// back (scheduled, never written, Redis down) are then only logged, with their count and
/// the first 100 ids: call `shutdown` to keep them. If the receiver is dropped, tasks that fire afterwards stay
/// fired and unacknowledged (in Redis, so they fire again after a restart; `cancel` returns
/// `false` for them), with a warning each.
pub struct Persistent<S: TaskStore = RedisStore> {
    inner: Arc<Inner>,
    timer: Timer<TaskKey>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    /// Renews the writer lease; stopped by `shutdown` before it gives the lease up.
    lease_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    store: S,
    rt: Arc<OwnedRuntime>,
}

impl<S: TaskStore> fmt::Debug for Persistent<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Persistent")
            .field("namespace", &self.inner.cfg.namespace)
            .field("pending", &self.timer.len())
            .finish()
    }
}

/// How long `shutdown` waits for a running restore to stop at its next page.
const RESTORE_STOP_WAIT: Duration = Duration::from_secs(10);

/// The error for a store runtime that stopped while a call waited on it.
fn runtime_stopped() -> PersistError {
    PersistError::Build(BuildError::Spawn("the runtime stopped".into()))
}

/// One worker thread drives the store's connection; the flusher and `restore` block on it.
fn store_runtime() -> Result<Arc<OwnedRuntime>, PersistError> {
    Ok(Arc::new(OwnedRuntime::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("delaywheel-store")
            .enable_all()
            .build()
            .map_err(|e| PersistError::Build(BuildError::Spawn(e.to_string())))?,
    )))
}

impl Persistent<RedisStore> {
    /// Connects to `cfg.url` (or the Redis Cluster of `cfg.cluster_nodes`), starts the engine
    /// and the flusher. Call
    /// [`restore`](Self::restore) next to load what a previous process left. Errors: a
    /// namespace that cannot be a hash tag, a namespace a queue uses
    /// ([`PersistError::InUse`]), an unreachable Redis, no threads.
    pub fn start(
        cfg: PersistConfig,
    ) -> Result<(Persistent<RedisStore>, Receiver<Envelope>), PersistError> {
        cfg.check()?;
        let keys = KeyLayout::new(&cfg.namespace).map_err(PersistError::Namespace)?;
        let rt = store_runtime()?;
        let (url, nodes) = (cfg.url.clone(), cfg.cluster_nodes.clone());
        let store = wait_on(
            &rt,
            async move { RedisStore::open(&url, &nodes, keys).await },
        )
        .ok_or_else(runtime_stopped)?
        .map_err(PersistError::Store)?;
        Persistent::launch(cfg, store, rt)
    }
}

impl<S: TaskStore> Persistent<S> {
    /// Starts the engine on another store (`cfg.url`, `cfg.cluster_nodes` and `cfg.namespace`
    /// are not used), after [`TaskStore::claim`] (a [`RedisStore`] on a queue's namespace is
    /// refused with [`PersistError::InUse`]). The store's futures run on the engine's own
    /// tokio runtime (one worker thread).
    pub fn with_store(
        cfg: PersistConfig,
        store: S,
    ) -> Result<(Persistent<S>, Receiver<Envelope>), PersistError> {
        cfg.check()?;
        let rt = store_runtime()?;
        Persistent::launch(cfg, store, rt)
    }

    fn launch(
        cfg: PersistConfig,
        store: S,
        rt: Arc<OwnedRuntime>,
    ) -> Result<(Persistent<S>, Receiver<Envelope>), PersistError> {
        // Before anything starts: a namespace another role uses is refused.
        let claiming = store.clone();
        wait_on(&rt, async move {
            guarded("claim", async { Ok(claiming.claim().await) }).await
        })
        .ok_or_else(runtime_stopped)?
        .map_err(PersistError::Store)?
        .map_err(PersistError::InUse)?;
        // Then the writer lease: another engine on the namespace (the old process of a
        // rolling deploy) is waited for, so that the restore reads what it wrote last.
        let holder = crate::redis::layout::instance_name();
        let started = Instant::now();
        let took = {
            let (store, holder, ttl, wait) = (
                store.clone(),
                holder.clone(),
                cfg.engine_lease,
                cfg.takeover_wait,
            );
            wait_on(&rt, async move {
                acquire(&store, &holder, ttl, wait, started).await
            })
            .ok_or_else(runtime_stopped)??
        };
        let (tx, rx) = crossbeam_channel::bounded(cfg.fired_bound);
        let anchor = cfg.clock.anchor();
        // The index and the journal hash alike (one seed), so that a call hashes its id once.
        let hasher = foldhash::fast::RandomState::default();
        let inner = Arc::new(Inner {
            cfg,
            state: Mutex::new(State {
                anchor,
                index: Ids::with_hasher(hasher.clone()),
                restoring: 0,
                restored: false,
                gone: Ids::default(),
                journal: Journal {
                    ops: Ids::with_hasher(hasher),
                    ..Journal::default()
                },
            }),
            flushed: Condvar::new(),
            kick: Condvar::new(),
            stopping: AtomicBool::new(false),
            shut_down: AtomicBool::new(false),
            shutdown_done: Mutex::new(false),
            shutdown_over: Condvar::new(),
            holder,
            held_until_us: AtomicU64::new(0),
            started,
            ever_held: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            lost_to: Mutex::new(String::new()),
        });
        if let Some((asked, lease)) = took {
            inner.book(asked, lease, true);
        }
        let lease_task = rt.spawn(lease_loop(inner.clone(), store.clone()));
        let fire = {
            let inner = inner.clone();
            move |e: crate::Expiration<TaskKey>| deliver(&inner, &tx, e.value.id(), e.id)
        };
        let mut builder = Timer::builder().name(format!("persistent:{}", inner.cfg.namespace));
        if let Some(clock) = inner.cfg.clock.manual_clock() {
            builder = builder.manual_clock(clock);
        }
        let timer = builder
            .build_callback(1, 1024, fire)
            .map_err(PersistError::Build)?;
        {
            // Keeps the anchor `schedule` reads due times against at most a second old, even
            // while a flush round waits on a slow store.
            let inner = inner.clone();
            rt.spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(1));
                while !inner.stopping.load(SeqCst) {
                    every.tick().await;
                    let anchor = inner.cfg.clock.anchor();
                    inner.state.lock().anchor = anchor;
                }
            });
        }
        let flusher = {
            let (inner, store, rt) = (inner.clone(), store.clone(), rt.clone());
            std::thread::Builder::new()
                .name("delaywheel-flush".into())
                .spawn(move || flush_loop(&inner, &store, &rt))
                .map_err(|e| PersistError::Build(BuildError::Spawn(e.to_string())))?
        };
        Ok((
            Persistent {
                inner,
                timer,
                flusher: Mutex::new(Some(flusher)),
                lease_task: Mutex::new(Some(lease_task)),
                store,
                rt,
            },
            rx,
        ))
    }

    /// Schedules (or replaces) task `id` to fire at `due_at` ms since the Unix epoch. A due
    /// time in the past fires at once. Errors that refuse the task hand the envelope back;
    /// [`PersistError::Unconfirmed`] (`WriteThrough` with a timeout) refuses nothing.
    pub fn schedule(
        &self,
        id: impl Into<String>,
        topic: impl Into<std::borrow::Cow<'static, str>>,
        payload: serde_json::Value,
        due_at: u64,
    ) -> Result<(), PersistError> {
        let envelope = Envelope {
            id: id.into(),
            topic: topic.into(),
            payload,
            attempt: 0,
            created_at: self.inner.cfg.clock.stamp_ms(),
            due_at,
        };
        self.schedule_envelope(envelope)
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
            Durability::WriteThrough => self
                .inner
                .cfg
                .write_through_timeout
                .and_then(|t| Instant::now().checked_add(t)),
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
        let Some(timer) = self.arm(
            TaskKey::of(&envelope),
            &state.anchor,
            envelope.due_at,
            Duration::ZERO,
        ) else {
            return Err(PersistError::Shutdown(unshare(envelope)));
        };
        // WriteThrough names the task if Redis does not confirm it in time.
        let kept =
            (self.inner.cfg.durability == Durability::WriteThrough).then(|| envelope.id.clone());
        let due_at = envelope.due_at;
        // The index takes this reference: the timer and the journal hold the other two.
        let id = TaskKey(envelope);
        let State { index, journal, .. } = &mut *state;
        let hash = index.hasher().hash_one(id.id());
        // Redis may hold a version of this id: the one this replaces, or an earlier one
        // whose removal is still in the journal. One lookup records the upsert and reads
        // what it replaces.
        let replaced = journal.record_hashed(hash, id.clone(), Change::Upsert(due_at));
        let stored = matches!(replaced, Some(Change::Remove(_)));
        let entry = Entry {
            timer: Some(timer),
            persisted: stored,
        };
        match index.raw_entry_mut().from_key_hashed_nocheck(hash, id.id()) {
            RawEntryMut::Vacant(slot) => {
                slot.insert_hashed_nocheck(hash, id, entry);
            }
            RawEntryMut::Occupied(mut slot) => {
                if replaced.is_some() {
                    // The journal kept the key of its first change to the id: an older version.
                    journal.rekey(id.clone());
                }
                // The old key is the old envelope: swapped out, so that nothing keeps the old
                // payload alive as long as the task.
                slot.insert_key(id);
                let old = slot.insert(entry);
                if let Some(t) = old.timer {
                    self.timer.cancel(t);
                }
                slot.get_mut().persisted |= old.persisted;
            }
        }
        if let Some(id) = kept {
            // The round in progress may have taken its changes before this one: wait (the wait
            // releases the lock) for the round after it.
            let round = journal.flushed;
            if !self.inner.wait_for_round(&mut state, round + 2, deadline) {
                // Also when a shutdown ended the wait: the task was taken, and the shutdown's
                // final round writes it or hands it back (its list of unwritten tasks). Handing
                // it back here too would hand it back twice.
                return Err(PersistError::Unconfirmed(id));
            }
        }
        Ok(())
    }

    /// Arms the timer of task `id` for wall time `due_at` plus `extra`, read against `anchor`.
    /// `None` once the timer has shut down.
    fn arm(&self, id: TaskKey, anchor: &Anchor, due_at: u64, extra: Duration) -> Option<TimerId> {
        match anchor.instant_of(due_at, extra) {
            Some(at) => self.timer.schedule_at(id, at),
            // Past what an `Instant` holds: as far as the timer reaches.
            None => self.timer.schedule(id, Duration::MAX),
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
        let hash = state.index.hasher().hash_one(id);
        let (key, entry) = match state
            .index
            .raw_entry_mut()
            .from_key_hashed_nocheck(hash, id)
        {
            // Fired, waiting for ack: not this call's to remove.
            RawEntryMut::Occupied(slot) if slot.get().timer.is_none() => return false,
            RawEntryMut::Occupied(slot) => slot.remove_entry(),
            RawEntryMut::Vacant(_) => {
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
        // Before a restore has completed, the store may hold a version of this id from a
        // previous process, which a restore would load: the removal is written either way.
        let persisted = entry.persisted || !state.restored;
        let due_at = key.envelope().due_at;
        state.journal.remove(hash, key, persisted, due_at);
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
        if self.inner.stopping.load(SeqCst)
            || !state
                .index
                .get_key_value(task.id.as_str())
                .is_some_and(fired)
        {
            return false;
        }
        let Some((id, _)) = state.index.remove_entry(task.id.as_str()) else {
            return false;
        };
        state.mark_gone(&id);
        state.journal.record_removal(id.id(), id.envelope().due_at);
        true
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
        self.inner.state.lock().index.contains_key(id)
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

    /// Loads every task in Redis into the wheel (overdue ones fire per [`Overdue`]), paging
    /// through the ZSET and HASH `page_size` entries at a time, and dead-letters broken entries
    /// with their reason (an entry whose envelope names another id included). Ids already in
    /// memory are kept as they are, and ids cancelled or acknowledged since are not loaded
    /// again. A snapshot asked for meanwhile waits until the restore is done. A store that can
    /// no longer continue its scan ([`StoreError::is_cursor_lost`]: for Redis, a restart or a
    /// failover during the restore) has it start again from the start, keeping what was
    /// loaded, up to 8 times ([`RestoreReport::rescans`]). An error if the store fails, the
    /// scan stops before the last page, or it lost its cursor more than that: never `Ok` with
    /// rows skipped, and then no snapshot runs until a restore completes;
    /// [`PersistError::Stopped`] after
    /// [`shutdown`](Self::shutdown), or when one begins meanwhile (it waits for the restore to
    /// stop at its next page). A `page_size` of 0 is taken as 1, and one above
    /// [`MAX_PAGE`](crate::redis::MAX_PAGE) as that.
    ///
    /// Pages of a few thousand restored fastest in `examples/persist_report.rs` (1M tasks:
    /// about 5.1 s with 4 000 against 5.9 s with 1 000, on a slow VM); each page is one Redis
    /// command that runs whole while other clients wait.
    pub fn restore(&self, page_size: usize) -> Result<RestoreReport, PersistError> {
        if self.inner.shut_down.load(SeqCst) {
            return Err(PersistError::Stopped);
        }
        if !self.inner.holds_lease() && !self.inner.lost.load(SeqCst) {
            // Another engine may be writing: what it writes after this read would be missed.
            let (store, inner) = (self.store.clone(), self.inner.clone());
            wait_on(&self.rt, async move { ask_lease(&inner, &store).await })
                .ok_or_else(runtime_stopped)?
                .map_err(PersistError::Store)?;
        }
        if !self.inner.holds_lease() {
            let to = self.inner.lost_to.lock().clone();
            return Err(if to.is_empty() {
                PersistError::Store(StoreError::new("the writer lease could not be taken"))
            } else {
                PersistError::EngineRunning(to)
            });
        }
        let page_size = page_size.clamp(1, crate::redis::persist::redis_store::MAX_PAGE);
        let mut restoring = Restoring::begin(&self.inner);
        let mut report = RestoreReport::default();
        let mut overdue = 0u64;
        // Whether the last page said the scan is complete.
        let mut scanned = false;
        // A fetcher task reads the next pages while this thread decodes the current one and
        // loads it into the wheel. A cursor the store can no longer continue from (its server
        // changed) starts the scan again from the start: what was loaded stays (a row read
        // again is deduplicated by id), and nothing is skipped.
        let (tx, pages) = tokio::sync::mpsc::channel(2);
        let store = self.store.clone();
        let fetcher = self.rt.spawn(async move {
            let mut cursor = Cursor::start();
            let mut rescans = 0;
            loop {
                let page = guarded("read", store.rows(cursor, page_size)).await;
                let page = match page {
                    Err(e) if e.is_cursor_lost() && rescans < MAX_RESCANS => {
                        rescans += 1;
                        tracing::warn!(error = %e, rescans, "restore: the scan starts again from the start");
                        if tx.send(Fetched::Rescan).await.is_err() {
                            return;
                        }
                        cursor = Cursor::start();
                        continue;
                    }
                    page => page,
                };
                let next = page.as_ref().ok().and_then(|p| p.next.clone());
                if tx.send(Fetched::Page(page)).await.is_err() {
                    return;
                }
                match next {
                    Some(next) => cursor = next,
                    None => return,
                }
            }
        });
        let _abort_on_return = AbortOnDrop(fetcher);
        let mut pages = Some(pages);
        while let Some(page) = pages.take().and_then(|mut rx| {
            // Received through the engine's runtime: `blocking_recv` would panic when
            // `restore` is called from async code.
            let (rx, page) = wait_on(&self.rt, async move {
                let page = rx.recv().await;
                (rx, page)
            })?;
            pages = Some(rx);
            page
        }) {
            if self.inner.shut_down.load(SeqCst) {
                // `shutdown` waits for this restore before its final round: stop here.
                return Err(PersistError::Stopped);
            }
            let page = match page {
                Fetched::Page(page) => page,
                Fetched::Rescan => {
                    report.rescans += 1;
                    scanned = false;
                    continue;
                }
            };
            let rows = page.map_err(PersistError::Store)?;
            report.dead_lettered += rows.set_aside;
            let mut page = rows.classify();
            scanned = page.next.is_none();
            {
                // An id this engine holds or has changed since is not the store's to judge: the
                // row may have changed between the scan's two reads. A held one's row is in
                // the store, though: a cancel must remove it, like a valid row's.
                let mut state = self.inner.state.lock();
                page.broken.retain(|b| {
                    if let Some(held) = state.index.get_mut(b.id.as_str()) {
                        held.persisted = true;
                        return false;
                    }
                    !state.left(&b.id)
                });
            }
            if !page.broken.is_empty() {
                let (store, broken) = (self.store.clone(), page.broken.clone());
                let at = self.inner.cfg.clock.now_ms();
                let buried = wait_on(&self.rt, async move {
                    guarded("dead-letter", async {
                        store.dead_letter(&broken, at).await
                    })
                    .await
                });
                // An id scheduled between the check above and the dead-lettering may have been
                // written meanwhile, and the dead-lettering removed that row with the broken
                // one: write the task held again. Also when the call failed: its removal may
                // have been applied with only the reply lost.
                {
                    let mut state = self.inner.state.lock();
                    let State { index, journal, .. } = &mut *state;
                    for b in &page.broken {
                        if let Some((key, entry)) = index.get_key_value_mut(b.id.as_str()) {
                            entry.persisted = true;
                            journal.record(key.clone(), Change::Upsert(key.envelope().due_at));
                        }
                    }
                }
                buried
                    .ok_or_else(runtime_stopped)?
                    .map_err(PersistError::Store)?;
                report.dead_lettered += page.broken.len();
            }
            let anchor = self.inner.cfg.clock.anchor();
            let now = anchor.wall_ms();
            let mut state = self.inner.state.lock();
            for envelope in page.tasks {
                if let Some(held) = state.index.get_mut(envelope.id.as_str()) {
                    // Scheduled again before the restore (or returned twice by the scan): the
                    // engine's version wins, and Redis holds one, so a cancel must remove it.
                    held.persisted = true;
                    continue;
                }
                if state.left(&envelope.id) {
                    if !state.journal.ops.contains_key(envelope.id.as_str()) {
                        // Cancelled or acknowledged since the restore began, before its row
                        // was read: no removal of this row is on its way (a task scheduled
                        // and cancelled meanwhile costs none), so the row would outlive it.
                        state.journal.record_removal(&envelope.id, envelope.due_at);
                    }
                    continue;
                }
                let extra = if envelope.due_at > now {
                    Duration::ZERO
                } else {
                    overdue += 1;
                    match self.inner.cfg.overdue {
                        Overdue::AtOnce => Duration::ZERO,
                        Overdue::RateLimited { per_second } => Duration::from_millis(
                            (overdue - 1).saturating_mul(1_000) / u64::from(per_second.get()),
                        ),
                    }
                };
                let due = envelope.due_at.max(now);
                let id = TaskKey(Arc::new(envelope));
                let Some(timer) = self.arm(id.clone(), &anchor, due, extra) else {
                    // A stored task: it stays in the store.
                    return Err(PersistError::Stopped);
                };
                state.index.insert(
                    id,
                    Entry {
                        timer: Some(timer),
                        persisted: true,
                    },
                );
                report.loaded += 1;
            }
        }
        if !scanned {
            return Err(PersistError::Store(StoreError::new(
                "the store's scan ended before its last page (its reader stopped)",
            )));
        }
        report.overdue = overdue as usize;
        restoring.completed = true;
        tracing::info!(
            loaded = report.loaded,
            overdue = report.overdue,
            dead_lettered = report.dead_lettered,
            "restored"
        );
        Ok(report)
    }

    /// Waits until everything journaled so far is in Redis (for example before a deploy), for at
    /// most `timeout`. Returns whether it got there (`false`: Redis is down or slow).
    /// With nothing journaled and no round out, that is already so: `true` at once, whatever
    /// the timeout, also after [`shutdown`](Self::shutdown). During a
    /// [`restore`](Self::restore), a task whose broken row the restore is dead-lettering is
    /// journaled again only once that call returns; a store that cannot leave a rewritten row
    /// in place (see [`TaskStore::dead_letter`]; [`RedisStore`] can) may lack it until then.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.inner.state.lock();
        // Not at once while a restore runs: it may have removed a row (with a broken one it
        // dead-letters) that it has yet to journal again. (Two rounds do not wait for that.)
        if state.journal.ops.is_empty() && !state.journal.in_round && state.restoring == 0 {
            return true;
        }
        // The round in progress may have started before the last change: wait for the next.
        let target = state.journal.flushed + 2;
        self.inner.wait_for_round(&mut state, target, deadline)
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

    /// Stops the engine and the flusher after a final flush of up to 5 s (then one last round
    /// of whatever is still journaled). Pending tasks stay in Redis for the next process to
    /// restore.
    ///
    /// Returns the tasks whose current version could not be written (Redis down or refusing
    /// the writes at the end), so that the caller can keep them elsewhere: without that, the
    /// next process would not know them, or would restore an older version. Removals that
    /// could not be written (cancels, acks) are not returned: the next process restores those
    /// tasks and they fire again, as at-least-once delivery allows. Both are logged. A restore
    /// in progress stops at its next page, and is waited for up to 10 s.
    ///
    /// A second call (from another thread, or after the first) returns an empty list once the
    /// first call has finished, so that whichever returns, the engine has stopped.
    pub fn shutdown(&self) -> Vec<Envelope> {
        if self.inner.shut_down.swap(true, SeqCst) {
            let mut done = self.inner.shutdown_done.lock();
            while !*done {
                self.inner.shutdown_over.wait(&mut done);
            }
            return Vec::new();
        }
        // Set on the way out, also should `stop` unwind, so later calls never wait for ever.
        struct Over<'a>(&'a Inner);
        impl Drop for Over<'_> {
            fn drop(&mut self) {
                *self.0.shutdown_done.lock() = true;
                self.0.shutdown_over.notify_all();
            }
        }
        let _over = Over(&self.inner);
        self.stop()
    }

    /// The work of the first `shutdown`.
    fn stop(&self) -> Vec<Envelope> {
        if !self.inner.lost.load(SeqCst) && !self.flush(Duration::from_secs(5)) {
            tracing::warn!(
                unflushed = self.journal_depth(),
                "no final flush within 5 s: redis is unreachable or slow; one last round follows"
            );
        }
        {
            // Under the state lock: a change is either journaled before this (and written by
            // the flusher's final round) or refused after it. A restore in progress stops at
            // its next page; until then it may still journal corrections (a task whose row its
            // dead-lettering removed), which the final round must carry.
            let mut state = self.inner.state.lock();
            let give_up = Instant::now() + RESTORE_STOP_WAIT;
            while state.restoring > 0 && Instant::now() < give_up {
                self.inner
                    .flushed
                    .wait_for(&mut state, Duration::from_millis(100));
            }
            if state.restoring > 0 {
                tracing::warn!(
                    "a restore did not stop within {RESTORE_STOP_WAIT:?} (its store call hangs): \
                     shutting down without it"
                );
            }
            self.inner.stopping.store(true, SeqCst);
        }
        self.inner.flushed.notify_all();
        self.inner.kick.notify_all();
        if let Some(h) = self.flusher.lock().take() {
            let _ = h.join();
        }
        // The lease loop ends before the lease is given up: a renewal of its after the release
        // would take the lease again (on one connection, a call sent before the release runs
        // before it).
        if let Some(task) = self.lease_task.lock().take() {
            task.abort();
            let _ = wait_on(&self.rt, async move {
                let _ = task.await;
            });
        }
        if !self.inner.lost.load(SeqCst) {
            // So that the next engine (a new process) need not wait for it to expire. Also
            // when this engine does not know it holds it: a take aborted with the loop may
            // have landed (the script deletes the lease only if it names this engine).
            let (store, holder) = (self.store.clone(), self.inner.holder.clone());
            let timeout = lease_call_timeout(self.inner.cfg.engine_lease);
            let released = wait_on(&self.rt, async move {
                tokio::time::timeout(timeout, store.release(&holder)).await
            });
            if !matches!(released, Some(Ok(Ok(())))) {
                tracing::warn!("writer lease not given up: the next engine waits for it to expire");
            }
        }
        // The flusher's final round is done: what is still journaled was not written.
        let (unwritten, removals) = {
            let state = self.inner.state.lock();
            let mut unwritten = Vec::new();
            let mut removals = 0usize;
            for (key, change) in &state.journal.ops {
                match (change, state.index.get_key_value(key.id())) {
                    (Change::Upsert(_), Some((held, _))) => {
                        unwritten.push((**held.envelope()).clone())
                    }
                    _ => removals += 1,
                }
            }
            (unwritten, removals)
        };
        if !unwritten.is_empty() || removals > 0 {
            tracing::error!(
                tasks = unwritten.len(),
                removals,
                "shut down with changes the store did not take: the tasks are handed back, \
                 the removed tasks will fire again after a restore"
            );
        }
        drop(self.timer.shutdown());
        unwritten
    }
}

impl<S: TaskStore> Drop for Persistent<S> {
    fn drop(&mut self) {
        // A no-op after `shutdown`. Dropped without one, unwritten tasks cannot be handed
        // back: named in the log, at least.
        let lost = self.shutdown();
        if !lost.is_empty() {
            let ids: Vec<&str> = lost.iter().take(100).map(|e| e.id.as_str()).collect();
            tracing::error!(
                tasks = lost.len(),
                ?ids,
                "engine dropped without shutdown(): tasks Redis never took are lost \
                 (the first 100 ids named)"
            );
        }
    }
}

/// The longest a lease call may take (2 s, and a third of the lease at most): a store that
/// does not answer counts as one that failed.
fn lease_call_timeout(ttl: Duration) -> Duration {
    (ttl / 3).min(Duration::from_secs(2))
}

/// One call to take or renew the writer lease (see [`TaskStore::lease`]).
async fn take_lease<S: TaskStore>(
    store: &S,
    holder: &str,
    ttl: Duration,
    first: bool,
) -> Result<Lease, StoreError> {
    let call = guarded("lease", store.lease(holder, ttl, first));
    match tokio::time::timeout(lease_call_timeout(ttl), call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::new(
            "the store did not answer the lease call in time",
        )),
    }
}

/// Takes the writer lease as an engine starts, waiting up to `wait` while another engine holds
/// it: the answer and when its call was sent (µs after `started`) once taken, `None` if the
/// store could not be asked (the engine starts without it, and [`lease_loop`] takes it later),
/// [`PersistError::EngineRunning`] if the wait ran out.
async fn acquire<S: TaskStore>(
    store: &S,
    holder: &str,
    ttl: Duration,
    wait: Duration,
    started: Instant,
) -> Result<Option<(u64, Lease)>, PersistError> {
    let deadline = tokio::time::Instant::now().checked_add(wait);
    // A holder that shuts down deletes the lease: seen within this.
    let poll = (ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(100));
    let mut told = false;
    loop {
        let asked = micros_since(started);
        match take_lease(store, holder, ttl, true).await {
            Ok(Lease::Other(other)) => {
                if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                    return Err(PersistError::EngineRunning(other));
                }
                if !told {
                    tracing::info!(%other, ?wait, "another engine holds the namespace's writer lease: waiting for it to stop");
                    told = true;
                }
                tokio::time::sleep(poll).await;
            }
            Ok(held) => return Ok(Some((asked, held))),
            Err(e) => {
                tracing::warn!(error = %e, "could not take the namespace's writer lease: starting without it (nothing is written until it is taken)");
                return Ok(None);
            }
        }
    }
}

/// One lease call for a running engine (renew, or take as `first` if it never held it), its
/// answer booked (see [`Inner::book`]).
async fn ask_lease<S: TaskStore>(inner: &Inner, store: &S) -> Result<(), StoreError> {
    let asked = inner.since_start_us();
    let first = !inner.ever_held.load(SeqCst);
    let lease = take_lease(store, &inner.holder, inner.cfg.engine_lease, first).await?;
    inner.book(asked, lease, first);
    Ok(())
}

/// Renews the writer lease every third of its length, or takes it while this engine does not
/// hold it; runs until `shutdown` ends it (after the final round) or the engine has lost the
/// namespace to another engine.
async fn lease_loop<S: TaskStore>(inner: Arc<Inner>, store: S) {
    let ttl = inner.cfg.engine_lease;
    let mut every = tokio::time::interval(ttl / 3);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await; // the first tick is now, and `launch` has just asked
    loop {
        every.tick().await;
        // Not at `stopping`: the flusher's final round needs the lease (`shutdown` ends this
        // loop once that round is done).
        if inner.lost.load(SeqCst) {
            return;
        }
        let held = inner.holds_lease();
        match ask_lease(&inner, &store).await {
            Ok(()) => {
                if !held && inner.holds_lease() {
                    tracing::info!("writer lease taken: writing to the store");
                    let mut state = inner.state.lock();
                    inner.kick(&mut state.journal);
                }
            }
            Err(e) => {
                // Held until its last renewal runs out, as far as this engine can tell.
                tracing::debug!(error = %e, "renewing the writer lease failed");
                metrics::gauge!("delaywheel_persist_writing").set(if inner.holds_lease() {
                    1.0
                } else {
                    0.0
                });
                if held && !inner.holds_lease() {
                    tracing::warn!(error = %e, "writer lease not renewed in time: writing stops until it is");
                }
            }
        }
    }
}

/// Runs on the callback worker when a task's timer fires: hand the envelope to the consumer,
/// keep the entry (it is still in Redis) until it is acknowledged.
fn deliver(inner: &Inner, tx: &Sender<Envelope>, id: &str, fired: TimerId) {
    if inner.stopping.load(SeqCst) {
        // Shutting down: the task stays in Redis; do not wait on a consumer that may be gone.
        return;
    }
    let shared = {
        let mut state = inner.state.lock();
        match state.index.get_key_value_mut(id) {
            Some((key, entry)) if entry.timer == Some(fired) => {
                entry.timer = None;
                key.envelope().clone()
            }
            // Replaced (it has a newer timer) or cancelled after this timer was taken out:
            // nothing to deliver.
            _ => return,
        }
    };
    // Copied out of the lock: a payload can be 64 KiB.
    let mut envelope = (*shared).clone();
    drop(shared);
    // Backpressure while the consumer is slow, but never past shutdown: an undelivered task
    // stays in Redis and fires again after the restart (at-least-once).
    loop {
        match tx.send_timeout(envelope, Duration::from_millis(20)) {
            Ok(()) => return,
            Err(crossbeam_channel::SendTimeoutError::Timeout(back)) => {
                if inner.stopping.load(SeqCst) {
                    tracing::debug!(%id, "shutting down: fired task left in Redis");
                    return;
                }
                envelope = back;
            }
            Err(crossbeam_channel::SendTimeoutError::Disconnected(_)) => {
                tracing::warn!(%id, "fired task not delivered: the consumer is gone (it stays in Redis)");
                return;
            }
        }
    }
}

/// Counts a restore in progress in `State::restoring` while it lives, and records at the end
/// whether it completed.
struct Restoring<'a> {
    inner: &'a Inner,
    completed: bool,
}

impl<'a> Restoring<'a> {
    fn begin(inner: &'a Inner) -> Restoring<'a> {
        let mut state = inner.state.lock();
        state.restoring += 1;
        // Removals from now on are noted in `gone`; those of a round the flusher took before
        // may not have reached the store yet, and the scan could read them back: wait for
        // that round to end (a failed one puts them back into the journal, which the restore
        // checks).
        while state.journal.in_round && !inner.stopping.load(SeqCst) {
            inner
                .flushed
                .wait_for(&mut state, Duration::from_millis(100));
        }
        drop(state);
        Restoring {
            inner,
            completed: false,
        }
    }
}

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        let mut state = self.inner.state.lock();
        state.restoring -= 1;
        if self.completed {
            state.restored = true;
        }
        // A `snapshot` waiting for this restore learns how it ended.
        self.inner.flushed.notify_all();
        if state.restoring == 0 {
            state.gone = Ids::default();
            if state.journal.snapshot_wanted && state.restored {
                self.inner.kick(&mut state.journal); // the snapshot it held back
            }
        }
    }
}

/// The envelope of a refused schedule, handed back: the only reference, unless the call went
/// as far as sharing it (then a copy).
fn unshare(envelope: Arc<Envelope>) -> Box<Envelope> {
    Box::new(Arc::try_unwrap(envelope).unwrap_or_else(|e| (*e).clone()))
}

/// How many times a restore starts its scan again after a lost cursor before it fails: a store
/// whose server keeps changing under the scan never finishes one.
const MAX_RESCANS: usize = 8;

/// What a restore's fetcher hands over: a page, or word that the scan starts again.
enum Fetched {
    Page(Result<Rows, StoreError>),
    Rescan,
}

/// Aborts a task when dropped (an early return from `restore` stops its fetcher).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::{now_ms, Broken, Op, Rows};

    /// A store that takes every write.
    #[derive(Clone)]
    struct Accept;

    impl TaskStore for Accept {
        async fn apply(&self, _: &[Op]) -> Result<(), StoreError> {
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

    /// An engine whose flusher writes only when asked (`flush`), holding task "a" with a 1 KB
    /// payload, due at the returned time, not yet flushed.
    fn with_a_large_task() -> (Persistent<Accept>, Receiver<Envelope>, u64) {
        let mut cfg = PersistConfig::new("unused://", "unused");
        cfg.flush_interval = Duration::from_secs(3_600); // rounds only when asked for
        let (p, fired) = Persistent::with_store(cfg, Accept).unwrap();
        let far = now_ms() + 3_600_000;
        p.schedule("a", "t", serde_json::json!("x".repeat(1_000)), far)
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
            state.index.get_key_value("a").unwrap().0 .0.clone()
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
        let (p, _fired) =
            Persistent::with_store(PersistConfig::new("unused://", "unused"), Accept).unwrap();
        let far = now_ms() + 3_600_000;
        let key_of = |p: &Persistent<Accept>| {
            let state = p.inner.state.lock();
            let (key, _) = state.index.get_key_value("a").unwrap();
            assert_eq!(state.index.len(), 1);
            key.0.clone()
        };
        p.schedule("a", "t", serde_json::json!(1), far).unwrap();
        assert!(p.flush(Duration::from_secs(10)));
        let old = key_of(&p);
        p.schedule("a", "t", serde_json::json!(2), far).unwrap();
        assert!(p.flush(Duration::from_secs(10)));
        assert_eq!(Arc::strong_count(&old), 1, "the old envelope is still held");
        assert_eq!(key_of(&p).payload, serde_json::json!(2));
        assert!(p.cancel("a"));
        p.shutdown();
    }

    /// The same within one flush window (or while Redis is down): the journal's upsert of the
    /// id must not keep the first version's envelope either. (It kept its first key, and with
    /// it up to `journal_bound` payloads no one could read any more.)
    #[test]
    fn a_task_replaced_before_its_flush_keeps_no_reference_to_its_old_envelope() {
        let (p, _fired, far) = with_a_large_task();
        let old = p
            .inner
            .state
            .lock()
            .index
            .get_key_value("a")
            .unwrap()
            .0
             .0
            .clone();
        p.schedule("a", "t", serde_json::json!(2), far).unwrap();
        assert_eq!(p.journal_depth(), 1, "one upsert of the id, waiting");
        assert_eq!(Arc::strong_count(&old), 1, "the old envelope is still held");
        assert!(p.flush(Duration::from_secs(10)));
        p.shutdown();
    }
}
