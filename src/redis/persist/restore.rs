//! [`Persistent::restore`](super::Persistent::restore): pages through the store while a
//! fetcher task reads ahead, loads what it finds into the wheel, dead-letters broken rows, and
//! starts the scan again if the store lost its cursor.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use crate::redis::blocking::wait_on;
use crate::redis::persist::rows::{Cursor, Rows};
use crate::redis::persist::task_store::{guarded, TaskStore};
use crate::redis::store_error::StoreError;

use super::config::*;
use super::engine::Persistent;
use super::index::{Entry, Ids, TaskKey};
use super::lease::ask_lease;
use super::lifecycle::runtime_stopped;
use super::state::{Inner, State};

impl<S: TaskStore> Persistent<S> {
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
                    if let Some((_, held)) = state.index.get_mut(b.id.as_str()) {
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
                        let hash = index.hash(&b.id);
                        if let Some((key, entry)) = index.get_hashed_mut(hash, &b.id) {
                            entry.persisted = true;
                            journal.upsert(hash, key, entry);
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
                if let Some((_, held)) = state.index.get_mut(envelope.id.as_str()) {
                    // Scheduled again before the restore (or returned twice by the scan): the
                    // engine's version wins, and Redis holds one, so a cancel must remove it.
                    held.persisted = true;
                    continue;
                }
                if state.left(&envelope.id) {
                    if !state.journal.removals.contains_key(envelope.id.as_str()) {
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
                let Some(timer) = self.arm(state.index.hash(id.id()), &anchor, due, extra) else {
                    // A stored task: it stays in the store.
                    return Err(PersistError::Stopped);
                };
                state.index.insert(
                    id,
                    Entry {
                        timer: Some(timer),
                        persisted: true,
                        dirty: false,
                        since: 0,
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
