//! Starting and stopping a [`Persistent`] engine: the store's runtime, the namespace claim and
//! the writer lease, then the timer, the lease loop, the anchor refresher and the flusher
//! thread that `launch` composes; [`shutdown`](Persistent::shutdown) stops them in the
//! reverse order, after a final flush, and hands back what the store did not take.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::{Condvar, Mutex};

use crate::redis::blocking::{wait_on, OwnedRuntime};
use crate::redis::envelope::Envelope;
use crate::redis::layout::KeyLayout;
use crate::redis::persist::flusher::flush_loop;
use crate::redis::persist::journal::Journal;
use crate::redis::persist::redis_store::RedisStore;
use crate::redis::persist::task_store::{guarded, TaskStore};
use crate::{BuildError, Timer};

use super::config::*;
use super::deliver::deliver;
use super::engine::Persistent;
use super::index::{Ids, Index};
use super::lease::{acquire, lease_call_timeout, lease_loop};
use super::state::{Inner, State};

/// How long `shutdown` waits for a running restore to stop at its next page.
const RESTORE_STOP_WAIT: Duration = Duration::from_secs(10);

/// The error for a store runtime that stopped while a call waited on it.
pub(super) fn runtime_stopped() -> PersistError {
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
            #[cfg(feature = "futures")]
            fired_waker: atomic_waker::AtomicWaker::new(),
            state: Mutex::new(State {
                anchor,
                index: Index::with_hasher(hasher.clone()),
                restoring: 0,
                restored: false,
                gone: Ids::default(),
                journal: Journal::with_hasher(hasher),
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
            move |e: crate::Expiration<u64>| deliver(&inner, &tx, e.value, e.id)
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

    /// Stops the engine and the flusher after a final flush of up to 5 s (then one last round
    /// of whatever is still journaled). Pending tasks stay in Redis for the next process to
    /// restore.
    ///
    /// Returns the tasks whose current version could not be written (Redis down or refusing
    /// the writes at the end; every task held, if the store lost data and the pending set
    /// could not be written back), so that the caller can keep them elsewhere: without that, the
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
                // A stream waiting for tasks ends.
                #[cfg(feature = "futures")]
                self.0.fired_waker.wake();
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
        // The flusher's final round is done: what is still journaled was not written, nor,
        // while a data loss is not repaired, any task held.
        let (unwritten, removals) = {
            let state = self.inner.state.lock();
            let lost = state.journal.repair_pending();
            if lost {
                tracing::error!(
                    tasks = state.index.len(),
                    "shut down before the tasks the store lost were written back: all handed back"
                );
            }
            let unwritten: Vec<Envelope> = state
                .index
                .iter()
                .filter(|(_, entry)| lost || entry.dirty)
                .map(|(key, _)| (**key.envelope()).clone())
                .collect();
            (unwritten, state.journal.removals.len())
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
