//! The handler pool: a fired task goes to a handler thread, which runs its handler (or, for an
//! `async` one, starts its future on the handler runtime); the outcome goes to the outcome
//! writer.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

#[cfg(feature = "tokio")]
use futures_util::FutureExt;
#[cfg(feature = "tokio")]
use tokio::sync::mpsc;

use crate::redis::envelope::MAX_DUE_MS;
use crate::redis::queue::dead_letters::dead_record;
use crate::redis::trace_context::task_span;
use crate::redis::wall_clock::micros_since;

use super::registry::Handler;
use super::shared::*;
#[cfg(feature = "tokio")]
use super::{
    async_pool::{AsyncPool, Slot},
    registry::AsyncHandler,
};

/// Runs on a handler thread when a claimed task's timer fires.
pub(super) fn fire(shared: &Arc<Shared>, c: Claimed) {
    if shared.aborted.load(SeqCst) {
        return; // "crashing"
    }
    // With `async` handlers, a handler of either kind runs in a slot: a task waits for one
    // here, still in `held`, so that a stall or `shutdown` can hand it back meanwhile.
    #[cfg(feature = "tokio")]
    let slot = match &shared.async_pool {
        Some(pool) => match pool.acquire() {
            Some(slot) => Some(slot),
            None => return, // closed by `shutdown` or `abort`
        },
        None => None,
    };
    // A limited topic's task without its permits is parked, still held, for the limiter loop;
    // asked for here, right before the start, after any wait for a slot.
    let Some((c, permit)) = super::gates::admit(&shared.limiter, c) else {
        return;
    };
    if !start(shared, &c) {
        return;
    }
    let handler = shared.handlers.map.get(c.envelope.topic.as_ref()).cloned();
    #[cfg(feature = "tokio")]
    if let (Some(Handler::Async(h)), Some(pool)) = (&handler, &shared.async_pool) {
        run_async(shared, pool, h, c, (slot, permit));
        return;
    }
    let busy = Busy::enter(shared);
    let span = task_span(&c.envelope);
    let _in_span = span.enter();
    let began = std::time::Instant::now();
    // The error is formatted and dropped inside the guard too: a user error type whose
    // `Display` or `Drop` panics must not end this call before the outcome is sent, which
    // would leave the task in `working`, its lease renewed and never settled.
    let result: Result<(), String> = match handler {
        Some(Handler::Blocking(h)) => std::panic::catch_unwind(AssertUnwindSafe(|| {
            h(&c.envelope).map_err(|e| e.to_string())
        }))
        .unwrap_or_else(panicked),
        #[cfg(feature = "tokio")]
        Some(Handler::Async(_)) => Err("no runtime for async handlers".into()),
        None => Err(format!("unknown topic: {}", c.envelope.topic)),
    };
    // Sending the outcome below may wait for a slow Redis: that is not a stalled handler.
    drop(busy);
    drop(permit);
    #[cfg(feature = "tokio")]
    drop(slot);
    let outcome = settle(shared, c, result, Some(began.elapsed()));
    // A handler thread, not the runtime: it may block while the resolver catches up. The
    // send fails only once the runtime is gone (abort), when nothing is written anyway.
    let _ = shared.outcomes.blocking_send(outcome);
}

/// The failure a panic in a handler is.
fn panicked(payload: Box<dyn std::any::Any + Send>) -> Result<(), String> {
    // Its drop may panic too; out of this thread, the task's outcome would be lost.
    crate::engine::delivery::forget_panic(payload);
    Err("handler panicked (or its error's Display or Drop did)".into())
}

/// Takes a fired task out of `held` into `working` and counts its start; `false` if it is no
/// longer this timer's to run (handed back, or claimed again since).
fn start(shared: &Shared, c: &Claimed) -> bool {
    {
        let mut held = shared.held.lock();
        // Again under the lock: `abort`, or a shutdown that gave up waiting, may have come
        // while this thread waited for a slot; then nothing starts.
        if shared.aborted.load(SeqCst) {
            return false;
        }
        let key = (c.shard, c.envelope.id.clone());
        match held.get(&key) {
            // Only the claim this timer belongs to: the id may have been claimed again since.
            Some((_, owner, _)) if **owner == *c.owner => {
                held.remove(&key);
            }
            // Handed back (at shutdown, or while the handlers were stuck), or superseded by a
            // newer claim.
            _ => return false,
        }
        // Its lease is renewed until its outcome is written.
        shared.working.lock().insert(key, c.owner.clone());
    }
    shared
        .last_start_us
        .store(micros_since(shared.started), SeqCst);
    let late_us = now_us().saturating_sub(c.envelope.due_at.saturating_mul(1_000));
    // Saturating: a backlog hours late (after an outage) counts at the histogram's top,
    // rather than being left out of the maximum.
    shared.lateness.lock().saturating_record(late_us);
    metrics::histogram!("delaywheel_queue_lateness_seconds").record(late_us as f64 / 1e6);
    shared.counters.fired.fetch_add(1, Relaxed);
    metrics::counter!("delaywheel_queue_fired_total").increment(1);
    true
}

/// What a handler's result makes of its task: an ack, a retry after the backoff, or a dead
/// letter once the attempts are used up. Counted in the task's topic's metrics, with the
/// handler's run time `took` (`None`: its future was dropped before it ended).
fn settle(
    shared: &Shared,
    c: Claimed,
    result: Result<(), String>,
    took: Option<std::time::Duration>,
) -> Outcome {
    let Claimed {
        shard,
        owner,
        mut envelope,
    } = c;
    let topic = shared.by_topic.of(envelope.topic.as_ref());
    topic.ran(took, result.is_ok());
    shared.by_topic.shard_ran(shard, result.is_ok());
    match result {
        Ok(()) => Outcome::Ack {
            shard,
            unique_ms: crate::redis::queue::unique::window_ms(&envelope),
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
                topic.dead_lettered();
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
                topic.retried();
                Outcome::Retry {
                    shard,
                    due: envelope.due_at,
                    envelope: serde_json::to_vec(&envelope).unwrap_or_default(),
                    id: envelope.id,
                    owner,
                }
            }
        }
    }
}

/// Starts an `async` handler's future on the pool's runtime, holding `slot` (and counted
/// busy) until it ends; its outcome goes to the resolver from there.
#[cfg(feature = "tokio")]
fn run_async(
    shared: &Arc<Shared>,
    pool: &Arc<AsyncPool<HandBack>>,
    handler: &AsyncHandler,
    c: Claimed,
    (slot, permit): (Option<Slot>, Option<super::gates::Permit>),
) {
    let busy = Busy::enter(shared);
    let back: HandBack = (
        c.shard,
        c.envelope.id.clone(),
        c.owner.clone(),
        c.envelope.due_at,
    );
    // The call that makes the future may panic too. It runs inside the handler runtime's
    // context, so that a closure that builds a tokio future eagerly (`tokio::time::timeout`
    // at the call) finds its runtime.
    let span = task_span(&c.envelope);
    let made = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let _context = pool.handle.enter();
        let _in_span = span.enter();
        handler(c.envelope.clone())
    }));
    let mut unsettled = Unsettled {
        shared: shared.clone(),
        claimed: Some(c),
    };
    let job = async move {
        let began = std::time::Instant::now();
        let result = match made {
            Ok(fut) => match AssertUnwindSafe(fut).catch_unwind().await {
                // Formatted inside a guard, as for a thread handler.
                Ok(r) => {
                    std::panic::catch_unwind(AssertUnwindSafe(move || r.map_err(|e| e.to_string())))
                        .unwrap_or_else(panicked)
                }
                Err(payload) => panicked(payload),
            },
            Err(payload) => panicked(payload),
        };
        drop(busy);
        drop(slot);
        drop(permit);
        // Room first: dropped while it waits (a runtime shutting down), the task is still
        // unsettled, and its drop fails the attempt rather than lose it.
        let permit = unsettled.shared.outcomes.reserve().await;
        let Some(c) = unsettled.claimed.take() else {
            return;
        };
        let outcome = settle(&unsettled.shared, c, result, Some(began.elapsed()));
        // The channel closes only once the runtime of the consumer's loops is gone (abort),
        // when nothing is written anyway.
        if let Ok(permit) = permit {
            permit.send(outcome);
        }
    };
    if !pool.spawn(back, tracing::Instrument::instrument(job, span)) {
        tracing::error!("the runtime of the async handlers has shut down: a fired task fails");
    }
}

/// A fired task whose `async` handler has not sent its outcome yet. Dropped unsent (its
/// future dropped by a runtime that shut down, or never spawned), it fails the attempt, so
/// the task is retried rather than stranded in `working`, renewed forever. Not after
/// `shutdown` gave up waiting or `abort`: those hand the task back, or leave it to its lease.
#[cfg(feature = "tokio")]
struct Unsettled {
    shared: Arc<Shared>,
    claimed: Option<Claimed>,
}

#[cfg(feature = "tokio")]
impl Drop for Unsettled {
    fn drop(&mut self) {
        let Some(c) = self.claimed.take() else {
            return;
        };
        if self.shared.aborted.load(SeqCst) {
            return;
        }
        let why = "the handler's future was dropped before it ended (its runtime shut down)";
        let outcome = settle(&self.shared, c, Err(why.into()), None);
        if let Err(e) = self.shared.outcomes.try_send(outcome) {
            // No room: renewal stops, and the task comes back once its lease expires (only
            // this claim's entry: the id may have been claimed again since).
            let o = match e {
                mpsc::error::TrySendError::Full(o) | mpsc::error::TrySendError::Closed(o) => o,
            };
            super::outcomes::settled(&self.shared, o.shard(), o.id(), o.owner());
        }
    }
}

/// A handler running (on a thread, or as a future), counted in `Shared::busy` until dropped.
pub(super) struct Busy(Arc<Shared>);

impl Busy {
    pub(super) fn enter(shared: &Arc<Shared>) -> Busy {
        shared.busy.fetch_add(1, SeqCst);
        Busy(shared.clone())
    }
}

impl Drop for Busy {
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
