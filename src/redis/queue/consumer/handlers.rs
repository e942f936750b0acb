//! The handler pool: a fired task goes to a handler thread, whose outcome goes to the
//! outcome writer.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};

use crate::redis::envelope::MAX_DUE_MS;
use crate::redis::queue::config::dead_record;
use crate::redis::wall_clock::micros_since;

use super::shared::*;

/// Runs on a handler thread when a claimed task's timer fires.
pub(super) fn fire(shared: &Shared, c: Claimed) {
    if shared.aborted.load(SeqCst) {
        return; // "crashing"
    }
    {
        let mut held = shared.held.lock();
        let key = (c.shard, c.envelope.id.clone());
        match held.get(&key) {
            // Only the claim this timer belongs to: the id may have been claimed again since.
            Some((_, owner, _)) if **owner == *c.owner => {
                held.remove(&key);
            }
            // Handed back (at shutdown, or while the handlers were stuck), or superseded by a
            // newer claim.
            _ => return,
        }
        // Its lease is renewed until its outcome is written.
        shared.working.lock().insert(key, c.owner.clone());
    }
    shared
        .last_start_us
        .store(micros_since(shared.started), SeqCst);
    let busy = Busy::enter(shared);
    let late_us = now_us().saturating_sub(c.envelope.due_at.saturating_mul(1_000));
    // Saturating: a backlog hours late (after an outage) counts at the histogram's top,
    // rather than being left out of the maximum.
    shared.lateness.lock().saturating_record(late_us);
    metrics::histogram!("delaywheel_queue_lateness_seconds").record(late_us as f64 / 1e6);
    shared.counters.fired.fetch_add(1, Relaxed);
    metrics::counter!("delaywheel_queue_fired_total").increment(1);
    // The error is formatted and dropped inside the guard too: a user error type whose
    // `Display` or `Drop` panics must not end this call before the outcome is sent, which
    // would leave the task in `working`, its lease renewed and never settled.
    let result: Result<(), String> = match shared.handlers.map.get(c.envelope.topic.as_ref()) {
        Some(h) => std::panic::catch_unwind(AssertUnwindSafe(|| {
            h(&c.envelope).map_err(|e| e.to_string())
        }))
        .unwrap_or_else(|payload| {
            // Its drop may panic too; out of this thread, the task's outcome would be lost.
            crate::engine::delivery::forget_panic(payload);
            Err("handler panicked (or its error's Display or Drop did)".into())
        }),
        None => Err(format!("unknown topic: {}", c.envelope.topic)),
    };
    // Sending the outcome below may wait for a slow Redis: that is not a stalled handler.
    drop(busy);
    let Claimed {
        shard,
        owner,
        mut envelope,
    } = c;
    let outcome = match result {
        Ok(()) => Outcome::Ack {
            shard,
            id: envelope.id,
            owner,
        },
        Err(reason) => {
            // Saturating: a client may enqueue any count, and a panic here would strand the task
            // (its lease renewed, its outcome never sent).
            envelope.attempt = envelope.attempt.saturating_add(1);
            let retry = &shared.cfg.retry;
            if envelope.attempt >= retry.max_attempts {
                tracing::warn!(id = %envelope.id, attempt = envelope.attempt, %reason, "task dead-lettered");
                let raw = serde_json::to_string(&envelope).unwrap_or_default();
                Outcome::Dead {
                    shard,
                    record: dead_record(&reason, &raw, envelope.attempt),
                    id: envelope.id,
                    raw_id: None,
                    owner,
                }
            } else {
                let wait = retry.backoff.delay(envelope.attempt);
                // Rounded up, so the retry never comes before its backoff; a backoff past
                // what a score holds waits as long as one can.
                let wait_us = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
                envelope.due_at = now_us()
                    .saturating_add(wait_us)
                    .div_ceil(1_000)
                    .min(MAX_DUE_MS);
                tracing::debug!(id = %envelope.id, attempt = envelope.attempt, ?wait, %reason, "task failed; retrying");
                Outcome::Retry {
                    shard,
                    due: envelope.due_at,
                    envelope: serde_json::to_vec(&envelope).unwrap_or_default(),
                    id: envelope.id,
                    owner,
                }
            }
        }
    };
    // A handler thread, not the runtime: it may block while the resolver catches up. The
    // send fails only once the runtime is gone (abort), when nothing is written anyway.
    let _ = shared.outcomes.blocking_send(outcome);
}

/// A handler thread running a handler, counted in `Shared::busy` until dropped.
pub(super) struct Busy<'a>(&'a Shared);

impl Busy<'_> {
    pub(super) fn enter(shared: &Shared) -> Busy<'_> {
        shared.busy.fetch_add(1, SeqCst);
        Busy(shared)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, SeqCst);
    }
}

/// Whether every handler thread is running a handler, and the latest of them started at
/// least `handler_stall` ago.
pub(super) fn handlers_stalled(shared: &Shared) -> bool {
    if shared.busy.load(SeqCst) < shared.cfg.handler_threads {
        return false;
    }
    let stall = u64::try_from(shared.cfg.handler_stall.as_micros()).unwrap_or(u64::MAX);
    micros_since(shared.started).saturating_sub(shared.last_start_us.load(SeqCst)) >= stall
}
