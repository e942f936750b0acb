//! Write-behind persistence: an engine whose pending tasks are mirrored into Redis by a
//! background flusher, and reloaded by [`Persistent::restore`] after a restart.
//!
//! # Ground rules
//!
//! * The engine (memory) is the source of truth. Every change is recorded in the journal, keyed
//!   by task id, so later changes to an id replace earlier ones (coalescing): a task scheduled
//!   and cancelled within one flush window costs no Redis command at all.
//! * `index` and `journal` are separate mutexes, always taken in that order.
//! * A fired task stays in Redis until [`Persistent::ack`]: delivery is at-least-once. A crash
//!   between firing and the acknowledgement fires the task again after the restart.
//! * `WriteBehind` (default) loses at most the changes of the last flush window in a crash.
//!   `WriteThrough` makes `schedule` return only once Redis has acknowledged it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use super::envelope::{Envelope, EnvelopeError};
use super::layout::{KeyLayout, NamespaceError};
use super::store::{Op, RedisStore, StoreError};
use crate::{BuildError, Timer, TimerId};

/// When a change counts as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `schedule` returns at once; the flusher writes within `flush_interval`. A crash loses at
    /// most the last flush window of changes.
    #[default]
    WriteBehind,
    /// `schedule` returns only once Redis has acknowledged the write.
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

/// Settings of a [`Persistent`] engine.
#[derive(Debug, Clone)]
pub struct PersistConfig {
    /// Redis URL (`redis://user:password@host/db`, `redis+unix:///path`, ...).
    pub url: String,
    /// The namespace: keys are `{ns}:due`, `{ns}:tasks`, `{ns}:dead`.
    pub namespace: String,
    /// How often the flusher writes (default 5 ms).
    pub flush_interval: Duration,
    /// Changes per Redis transaction (default 1 000).
    pub batch: usize,
    /// Unflushed changes the journal may hold (default 1 000 000).
    pub journal_bound: usize,
    /// What happens beyond the bound.
    pub when_full: WhenFull,
    /// When a change counts as done.
    pub durability: Durability,
    /// The largest encoded envelope accepted (default 64 KiB).
    pub max_envelope: usize,
    /// Queue of fired tasks waiting for the consumer (default 65 536; the driver waits when full).
    pub fired_bound: usize,
}

impl PersistConfig {
    /// Defaults for `url` and `namespace`.
    pub fn new(url: impl Into<String>, namespace: impl Into<String>) -> PersistConfig {
        PersistConfig {
            url: url.into(),
            namespace: namespace.into(),
            flush_interval: Duration::from_millis(5),
            batch: 1_000,
            journal_bound: 1_000_000,
            when_full: WhenFull::Block,
            durability: Durability::WriteBehind,
            max_envelope: 64 * 1024,
            fired_bound: 65_536,
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
    /// The engine has been shut down.
    Shutdown(Box<Envelope>),
}

impl fmt::Display for PersistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PersistError::Namespace(e) => e.fmt(f),
            PersistError::Build(e) => e.fmt(f),
            PersistError::Store(e) => e.fmt(f),
            PersistError::Envelope(e, _) => e.fmt(f),
            PersistError::JournalFull(_) => f.write_str("the persistence journal is full"),
            PersistError::Shutdown(_) => f.write_str("the engine has been shut down"),
        }
    }
}

impl std::error::Error for PersistError {}

/// Milliseconds since the Unix epoch now (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What `restore` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RestoreReport {
    /// Tasks loaded into the wheel (overdue ones fire at once).
    pub loaded: usize,
    /// Broken entries moved to the dead-letter hash.
    pub dead_lettered: usize,
}

struct Entry {
    envelope: Arc<Envelope>,
    /// `None` once fired (waiting for `ack`).
    timer: Option<TimerId>,
    /// Whether Redis may hold some version of this task: set when the flusher takes an upsert
    /// of it out of the journal. A cancel of a task that is not persisted and whose upsert is
    /// still in the journal just drops that upsert: no Redis command at all.
    persisted: bool,
}

#[derive(Default)]
struct Journal {
    ops: HashMap<String, Op>,
    /// Completed flush rounds; `WriteThrough` waits for the round after its change.
    flushed: u64,
    /// When the oldest unflushed change was made.
    oldest: Option<Instant>,
}

impl Journal {
    /// Records `op` for its id, replacing any earlier unflushed change to that id.
    fn record(&mut self, op: Op) {
        self.ops.insert(op.id().to_string(), op);
        self.oldest.get_or_insert_with(Instant::now);
    }
}

struct Inner {
    cfg: PersistConfig,
    index: Mutex<HashMap<String, Entry>>,
    journal: Mutex<Journal>,
    /// Signalled after each flush round (room in the journal, WriteThrough progress).
    flushed: Condvar,
    /// Wakes the flusher before its interval is over (`flush`, WriteThrough, shutdown).
    kick: Condvar,
    stopping: AtomicBool,
}

/// An engine whose tasks survive a restart: tasks with string ids and JSON payloads,
/// mirrored into Redis by a write-behind flusher. Fired tasks arrive on the receiver returned
/// by [`start`](Self::start) and leave Redis when [`ack`](Self::ack)ed.
pub struct Persistent {
    inner: Arc<Inner>,
    timer: Timer<String>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    store: RedisStore,
    rt: Arc<tokio::runtime::Runtime>,
}

impl fmt::Debug for Persistent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Persistent")
            .field("namespace", &self.inner.cfg.namespace)
            .field("pending", &self.timer.len())
            .finish()
    }
}

impl Persistent {
    /// Connects, starts the engine and the flusher. Call [`restore`](Self::restore) next to load
    /// what a previous process left.
    pub fn start(cfg: PersistConfig) -> Result<(Persistent, Receiver<Envelope>), PersistError> {
        let keys = KeyLayout::new(&cfg.namespace).map_err(PersistError::Namespace)?;
        // One worker thread drives the Redis connection; the flusher and `restore` block on it.
        let rt = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("delaywheel-redis")
                .enable_all()
                .build()
                .map_err(|e| PersistError::Build(BuildError::Spawn(e.to_string())))?,
        );
        let store = rt
            .block_on(RedisStore::connect(&cfg.url, keys))
            .map_err(PersistError::Store)?;
        let (tx, rx) = crossbeam_channel::bounded(cfg.fired_bound.max(1));
        let inner = Arc::new(Inner {
            cfg,
            index: Mutex::new(HashMap::new()),
            journal: Mutex::new(Journal::default()),
            flushed: Condvar::new(),
            kick: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let fire = {
            let inner = inner.clone();
            move |e: crate::Expiration<String>| deliver(&inner, &tx, e.value)
        };
        let timer = Timer::builder()
            .build_callback(1, 1024, fire)
            .map_err(PersistError::Build)?;
        let flusher = {
            let (inner, store, rt) = (inner.clone(), store.clone(), rt.clone());
            std::thread::Builder::new()
                .name("delaywheel-flush".into())
                .spawn(move || flush_loop(inner, store, &rt))
                .map_err(|e| PersistError::Build(BuildError::Spawn(e.to_string())))?
        };
        Ok((
            Persistent {
                inner,
                timer,
                flusher: Mutex::new(Some(flusher)),
                store,
                rt,
            },
            rx,
        ))
    }

    /// Schedules (or replaces) task `id` to fire at `due_at` ms since the Unix epoch. A due
    /// time in the past fires at once. Errors hand the envelope back.
    pub fn schedule(
        &self,
        id: impl Into<String>,
        topic: impl Into<String>,
        payload: serde_json::Value,
        due_at: u64,
    ) -> Result<(), PersistError> {
        let envelope = Envelope {
            id: id.into(),
            topic: topic.into(),
            payload,
            attempt: 0,
            created_at: now_ms(),
            due_at,
        };
        self.schedule_envelope(envelope)
    }

    /// Schedules (or replaces) a complete envelope.
    pub fn schedule_envelope(&self, envelope: Envelope) -> Result<(), PersistError> {
        let cfg = &self.inner.cfg;
        let bytes = match envelope.encode(cfg.max_envelope) {
            Ok(b) => b,
            Err(e) => return Err(PersistError::Envelope(e, Box::new(envelope))),
        };
        if self.inner.stopping.load(SeqCst) {
            return Err(PersistError::Shutdown(Box::new(envelope)));
        }
        let envelope = self.wait_for_room(envelope)?;
        let delay = Duration::from_millis(envelope.due_at.saturating_sub(now_ms()));
        let id = envelope.id.clone();
        let op = Op::Upsert {
            id: id.clone(),
            due_at: envelope.due_at,
            envelope: bytes,
        };
        let round = {
            let mut index = self.inner.index.lock();
            let timer = match self.timer.schedule(id.clone(), delay) {
                Ok(t) => t,
                Err(_) => return Err(PersistError::Shutdown(Box::new(envelope))),
            };
            let old = index.insert(
                id.clone(),
                Entry {
                    envelope: Arc::new(envelope),
                    timer: Some(timer),
                    persisted: false,
                },
            );
            if let Some(old) = old {
                if let Some(t) = old.timer {
                    self.timer.cancel(t);
                }
                if let Some(entry) = index.get_mut(&id) {
                    entry.persisted = old.persisted;
                }
            }
            let mut journal = self.inner.journal.lock();
            journal.record(op);
            journal.flushed
        };
        if self.inner.cfg.durability == Durability::WriteThrough {
            // The round in progress may have taken its changes before this one: wait for the
            // round after it.
            self.wait_flushed(round + 2);
        }
        Ok(())
    }

    /// Blocks (policy `Block`) or refuses (policy `Error`) while the journal is at its bound.
    fn wait_for_room(&self, envelope: Envelope) -> Result<Envelope, PersistError> {
        let mut journal = self.inner.journal.lock();
        while journal.ops.len() >= self.inner.cfg.journal_bound {
            metrics::counter!("delaywheel_journal_full_total").increment(1);
            match self.inner.cfg.when_full {
                WhenFull::Error => {
                    tracing::warn!(
                        bound = self.inner.cfg.journal_bound,
                        "journal full: task refused"
                    );
                    return Err(PersistError::JournalFull(Box::new(envelope)));
                }
                WhenFull::Block => {
                    tracing::warn!(
                        bound = self.inner.cfg.journal_bound,
                        "journal full: producer waits"
                    );
                    self.inner
                        .flushed
                        .wait_for(&mut journal, Duration::from_millis(100));
                    if self.inner.stopping.load(SeqCst) {
                        return Err(PersistError::Shutdown(Box::new(envelope)));
                    }
                }
            }
        }
        Ok(envelope)
    }

    fn wait_flushed(&self, round: u64) {
        let mut journal = self.inner.journal.lock();
        self.inner.kick.notify_one();
        while journal.flushed < round && !self.inner.stopping.load(SeqCst) {
            self.inner
                .flushed
                .wait_for(&mut journal, Duration::from_millis(100));
        }
    }

    /// Cancels task `id`; `false` if it is not pending (unknown, or already fired).
    pub fn cancel(&self, id: &str) -> bool {
        let mut index = self.inner.index.lock();
        let Some(entry) = index.get(id) else {
            return false;
        };
        let Some(timer) = entry.timer else {
            return false; // fired, waiting for ack
        };
        self.timer.cancel(timer);
        let persisted = entry.persisted;
        index.remove(id);
        let mut journal = self.inner.journal.lock();
        let unsent = matches!(journal.ops.get(id), Some(Op::Upsert { .. }));
        if unsent && !persisted {
            // Scheduled and cancelled within one flush window: Redis never hears of it.
            journal.ops.remove(id);
        } else {
            journal.record(Op::Remove(id.to_string()));
        }
        true
    }

    /// Acknowledges a fired task: it leaves Redis with the next flush. `false` if `id` is not a
    /// fired, unacknowledged task.
    pub fn ack(&self, id: &str) -> bool {
        let mut index = self.inner.index.lock();
        if index.get(id).is_none_or(|e| e.timer.is_some()) {
            return false;
        }
        index.remove(id);
        self.inner.journal.lock().record(Op::Remove(id.to_string()));
        true
    }

    /// Tasks pending or fired and not yet acknowledged.
    pub fn len(&self) -> usize {
        self.inner.index.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unflushed changes in the journal.
    pub fn journal_depth(&self) -> usize {
        self.inner.journal.lock().ops.len()
    }

    /// Loads every task in Redis into the wheel (overdue ones fire at once), paging through the
    /// ZSET and HASH `page_size` entries at a time, and dead-letters broken entries with their
    /// reason. Ids already in memory are kept as they are.
    pub fn restore(&self, page_size: usize) -> Result<RestoreReport, PersistError> {
        let mut report = RestoreReport::default();
        let mut cursor = 0;
        loop {
            let page = self
                .rt
                .block_on(self.store.page(cursor, page_size))
                .map_err(PersistError::Store)?;
            if !page.broken.is_empty() {
                self.rt
                    .block_on(self.store.dead_letter(&page.broken, now_ms()))
                    .map_err(PersistError::Store)?;
                report.dead_lettered += page.broken.len();
            }
            let now = now_ms();
            let mut index = self.inner.index.lock();
            for envelope in page.tasks {
                if index.contains_key(&envelope.id) {
                    continue; // a ZSCAN may return an entry twice
                }
                let delay = Duration::from_millis(envelope.due_at.saturating_sub(now));
                let timer = match self.timer.schedule(envelope.id.clone(), delay) {
                    Ok(t) => t,
                    Err(_) => return Err(PersistError::Shutdown(Box::new(envelope))),
                };
                index.insert(
                    envelope.id.clone(),
                    Entry {
                        envelope: Arc::new(envelope),
                        timer: Some(timer),
                        persisted: true,
                    },
                );
                report.loaded += 1;
            }
            drop(index);
            if page.next == 0 {
                break;
            }
            cursor = page.next;
        }
        tracing::info!(
            loaded = report.loaded,
            dead_lettered = report.dead_lettered,
            "restored"
        );
        Ok(report)
    }

    /// Waits until everything journaled so far is in Redis (for example before a deploy), for at
    /// most `timeout`. Returns whether it got there (`false`: Redis is down or slow).
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut journal = self.inner.journal.lock();
        // The round in progress may have started before the last change: wait for the next.
        let target = journal.flushed + 2;
        self.inner.kick.notify_one();
        while journal.flushed < target {
            self.inner.kick.notify_one();
            if self
                .inner
                .flushed
                .wait_until(&mut journal, deadline)
                .timed_out()
            {
                return journal.flushed >= target;
            }
        }
        true
    }

    /// Stops the engine and the flusher after a final flush of up to 5 s. Pending tasks stay in
    /// Redis for the next process to restore; if Redis is down, the changes of the unflushed
    /// window are lost (logged).
    pub fn shutdown(&self) {
        if !self.flush(Duration::from_secs(5)) {
            tracing::error!(
                unflushed = self.journal_depth(),
                "shutdown without a final flush: redis is unreachable"
            );
        }
        self.inner.stopping.store(true, SeqCst);
        self.inner.flushed.notify_all();
        self.inner.kick.notify_all();
        if let Some(h) = self.flusher.lock().take() {
            let _ = h.join();
        }
        drop(self.timer.shutdown());
    }
}

impl Drop for Persistent {
    fn drop(&mut self) {
        if !self.inner.stopping.load(SeqCst) {
            self.shutdown();
        }
    }
}

/// Runs on the callback worker when a task's timer fires: hand the envelope to the consumer,
/// keep the entry (it is still in Redis) until it is acknowledged.
fn deliver(inner: &Inner, tx: &Sender<Envelope>, id: String) {
    let envelope = {
        let mut index = inner.index.lock();
        match index.get_mut(&id) {
            Some(entry) if entry.timer.is_some() => {
                entry.timer = None;
                (*entry.envelope).clone()
            }
            // Replaced or cancelled after the timer was taken out: nothing to deliver.
            _ => return,
        }
    };
    // Backpressure while the consumer is slow, but never past shutdown: an undelivered task
    // stays in Redis and fires again after the restart (at-least-once).
    let mut envelope = envelope;
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

/// The flusher: every interval, write the journal in batches; on failure, put the changes back
/// (newer ones win) and back off.
fn flush_loop(inner: Arc<Inner>, store: RedisStore, rt: &tokio::runtime::Runtime) {
    let mut backoff = inner.cfg.flush_interval;
    let mut down_since: Option<Instant> = None;
    loop {
        let stopping = inner.stopping.load(SeqCst);
        let (ops, oldest) = {
            // Lock order: index, then journal (see the ground rules).
            let mut index = inner.index.lock();
            let mut journal = inner.journal.lock();
            metrics::gauge!("delaywheel_journal_depth").set(journal.ops.len() as f64);
            if let Some(t) = journal.oldest {
                metrics::gauge!("delaywheel_flush_lag_seconds").set(t.elapsed().as_secs_f64());
            }
            let ops = std::mem::take(&mut journal.ops);
            for (id, op) in &ops {
                if let (Op::Upsert { .. }, Some(entry)) = (op, index.get_mut(id)) {
                    entry.persisted = true;
                }
            }
            (ops, journal.oldest.take())
        };
        let ops: Vec<Op> = ops.into_values().collect();
        let mut failed: Vec<Op> = Vec::new();
        for chunk in ops.chunks(inner.cfg.batch.max(1)) {
            if !failed.is_empty() {
                failed.extend_from_slice(chunk);
                continue;
            }
            if let Err(e) = rt.block_on(store.apply(chunk)) {
                if down_since.is_none() {
                    tracing::warn!(error = %e, "redis write failed; retrying with backoff");
                    down_since = Some(Instant::now());
                }
                failed.extend_from_slice(chunk);
            }
        }
        {
            let mut journal = inner.journal.lock();
            if failed.is_empty() {
                journal.flushed += 1;
                if let Some(t) = down_since.take() {
                    tracing::info!(after = ?t.elapsed(), "redis writes caught up");
                }
                backoff = inner.cfg.flush_interval;
            } else {
                // Changes made while this batch was out are newer: they win.
                for op in failed {
                    journal.ops.entry(op.id().to_string()).or_insert(op);
                }
                journal.oldest = journal.oldest.min(oldest).or(oldest);
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
        inner.flushed.notify_all();
        if stopping {
            break;
        }
        let mut journal = inner.journal.lock();
        if !inner.stopping.load(SeqCst) {
            inner.kick.wait_for(&mut journal, backoff);
        }
    }
}
