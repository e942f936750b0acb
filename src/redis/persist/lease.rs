//! The writer lease: taken as an engine starts ([`acquire`]), renewed by a loop on the store's
//! runtime ([`lease_loop`]), its answers booked in [`Inner`](super::state::Inner).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::redis::persist::task_store::{guarded, Lease, TaskStore};
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::micros_since;

use super::config::*;
use super::state::Inner;

/// The longest a lease call may take (2 s, and a third of the lease at most): a store that
/// does not answer counts as one that failed.
pub(super) fn lease_call_timeout(ttl: Duration) -> Duration {
    (ttl / 3).min(Duration::from_secs(2))
}

/// One call to take or renew the writer lease (see [`TaskStore::lease`]).
pub(super) async fn take_lease<S: TaskStore>(
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
pub(super) async fn acquire<S: TaskStore>(
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
pub(super) async fn ask_lease<S: TaskStore>(inner: &Inner, store: &S) -> Result<(), StoreError> {
    let asked = inner.since_start_us();
    let first = !inner.ever_held.load(SeqCst);
    let lease = take_lease(store, &inner.holder, inner.cfg.engine_lease, first).await?;
    inner.book(asked, lease, first);
    Ok(())
}

/// Renews the writer lease every third of its length, or takes it while this engine does not
/// hold it; runs until `shutdown` ends it (after the final round) or the engine has lost the
/// namespace to another engine.
pub(super) async fn lease_loop<S: TaskStore>(inner: Arc<Inner>, store: S) {
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
