//! What the callers, the flusher, the lease loop and a restore share: [`State`] (the index
//! and the journal, under one mutex) and [`Inner`] (the settings, the signals between them,
//! and the writer lease as this engine knows it).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::redis::persist::task_store::Lease;
use crate::redis::wall_clock::{micros_since, Anchor};

use super::config::*;
use super::index::{Ids, Index, TaskKey};
use super::journal::Journal;

/// Everything the callers and the flusher share, under `Inner::state`.
pub(super) struct State {
    /// The wall clock and the timer's clock read together, every second and at every flush
    /// round: `schedule` turns due times into timer deadlines with it instead of reading the
    /// clocks again (one clock read is a fifth of its cost here).
    pub(super) anchor: Anchor,
    /// Every task held: pending, or fired and not yet acknowledged.
    pub(super) index: Index,
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
    pub(super) fn mark_gone(&mut self, id: &TaskKey) {
        if self.restoring > 0 {
            self.gone.insert(id.clone(), ());
        }
    }

    /// No restore has completed, and none runs that could: a snapshot now would delete the
    /// rows a previous process left.
    pub(super) fn unrestored(&self) -> bool {
        !self.restored && self.restoring == 0
    }

    /// Whether `id` changed since (its change still in the journal), or was cancelled or
    /// acknowledged while a restore ran: the store's row of it is not to be loaded.
    pub(super) fn left(&self, id: &str) -> bool {
        self.journal.has_change(id, &self.index) || self.gone.contains_key(id)
    }
}

pub(super) struct Inner {
    pub(super) cfg: PersistConfig,
    /// The task reading a [`FiredStream`](super::fired_stream::FiredStream), woken when a task
    /// is delivered and at shutdown.
    #[cfg(feature = "futures")]
    pub(super) fired_waker: atomic_waker::AtomicWaker,
    pub(super) state: Mutex<State>,
    /// Signalled after each flush round (room in the journal, WriteThrough progress).
    pub(super) flushed: Condvar,
    /// Wakes the flusher before its interval is over (`flush`, WriteThrough, shutdown).
    pub(super) kick: Condvar,
    pub(super) stopping: AtomicBool,
    /// `shutdown` has begun (the first call does the work).
    pub(super) shut_down: AtomicBool,
    /// The first `shutdown` has finished; later calls wait for it on `shutdown_over`.
    pub(super) shutdown_done: Mutex<bool>,
    pub(super) shutdown_over: Condvar,
    /// This engine's name in the writer lease.
    pub(super) holder: String,
    /// Until when this engine holds the writer lease, as far as it can tell (µs after
    /// `started`, on the monotonic clock; 0: not held): its last renewal was sent at least
    /// that long before Redis's expiry, less a margin for a write in flight. The flusher
    /// writes only before it (see [`PersistConfig::engine_lease`]).
    pub(super) held_until_us: AtomicU64,
    pub(super) started: Instant,
    /// Whether this engine has held the lease: a free lease is then taken back only if this
    /// engine took it last, and another holder means the namespace is lost.
    pub(super) ever_held: AtomicBool,
    /// Another engine held the lease since this one took it: this engine never writes again
    /// (its state is older than what that engine may have written).
    pub(super) lost: AtomicBool,
    /// The other engine last seen holding the lease (for `restore`'s error).
    pub(super) lost_to: Mutex<String>,
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
    pub(super) fn book(&self, asked: u64, lease: Lease, first: bool) {
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
    pub(super) fn write_all_back(&self, why: &str) {
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
            journal.repair_after = Some(journal.snapshot_rounds);
        } else {
            for (key, entry) in index.iter_mut() {
                entry.persisted = true;
                let hash = journal.removals.hasher().hash_one(key.id());
                journal.upsert(hash, key, entry);
            }
        }
        self.kick(journal);
    }

    /// Another engine (`to`) holds or held the lease since this one took it: this engine
    /// writes nothing any more, and whoever waits for a flush round stops waiting.
    pub(super) fn lose(&self, to: String) {
        self.held_until_us.store(0, SeqCst);
        if !self.lost.swap(true, SeqCst) {
            tracing::error!(other = %to, "another engine took the namespace's writer lease: this engine writes nothing to the store any more (shutdown() hands back what it did not write; restart it to restore the namespace)");
            *self.lost_to.lock() = to;
        }
        let _guard = self.state.lock();
        self.flushed.notify_all();
    }

    pub(super) fn since_start_us(&self) -> u64 {
        micros_since(self.started)
    }

    /// A lease call sent at `asked` (µs after `started`) succeeded: held until its ttl, less a
    /// quarter for a write in flight.
    pub(super) fn lease_held(&self, asked: u64) {
        let ttl = self.cfg.engine_lease;
        let margin = u64::try_from((ttl - ttl / 4).as_micros()).unwrap_or(u64::MAX);
        self.held_until_us
            .fetch_max(asked.saturating_add(margin), SeqCst);
    }

    /// Asks the flusher for a round now (`journal` is the locked journal).
    pub(super) fn kick(&self, journal: &mut Journal) {
        journal.kicked = true;
        self.kick.notify_one();
    }

    /// Waits (within `deadline`) until every change journaled before this call is written:
    /// the round after the one in progress, which may have taken its changes before the
    /// caller's. `false` as [`wait_for_round`](Self::wait_for_round) returns it.
    pub(super) fn wait_for_changes_so_far(
        &self,
        state: &mut MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> bool {
        let target = state.journal.flushed + 2;
        self.wait_for_round(state, target, deadline)
    }

    /// Kicks the flusher until round `target` is done; `false` if `deadline` passes or the
    /// engine stops first (the flusher then does one last round and is gone: no use waiting).
    /// `shutdown` notifies `flushed` after setting `stopping`, so no wait outlives it.
    pub(super) fn wait_for_round(
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
    pub(super) fn wait_round(
        &self,
        state: &mut MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> bool {
        match deadline {
            Some(deadline) => self.flushed.wait_until(state, deadline).timed_out(),
            None => {
                self.flushed.wait(state);
                false
            }
        }
    }
}
