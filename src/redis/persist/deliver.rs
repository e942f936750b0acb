//! The fired path of a [`Persistent`](super::engine::Persistent) engine: the timer's callback
//! that hands a fired task to the receiver and keeps it held until it is acknowledged.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::redis::envelope::Envelope;
use crate::TimerId;

use super::state::Inner;

/// Runs on the callback worker when a task's timer fires: hand the envelope to the consumer,
/// keep the entry (it is still in Redis) until it is acknowledged.
pub(super) fn deliver(inner: &Inner, tx: &Sender<Envelope>, hash: u64, fired: TimerId) {
    if inner.stopping.load(SeqCst) {
        // Shutting down: the task stays in Redis; do not wait on a consumer that may be gone.
        return;
    }
    let shared = {
        let mut state = inner.state.lock();
        match state.index.fired(hash, fired) {
            Some((key, entry)) => {
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
            Ok(()) => {
                #[cfg(feature = "futures")]
                inner.fired_waker.wake();
                return;
            }
            Err(crossbeam_channel::SendTimeoutError::Timeout(back)) => {
                if inner.stopping.load(SeqCst) {
                    tracing::debug!(id = %back.id, "shutting down: fired task left in Redis");
                    return;
                }
                envelope = back;
            }
            Err(crossbeam_channel::SendTimeoutError::Disconnected(back)) => {
                tracing::warn!(id = %back.id, "fired task not delivered: the consumer is gone (it stays in Redis)");
                return;
            }
        }
    }
}
