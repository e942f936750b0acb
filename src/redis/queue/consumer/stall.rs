//! The stall hand-back: a consumer whose handler threads are all stuck hands its claimed
//! tasks back to the queue, and retries a hand-back Redis refused.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::redis::queue::scripts;
use crate::redis::store_error::StoreError;
use crate::Timer;

use super::handlers::*;
use super::shared::*;

/// Hands claimed tasks `(shard, id, owner, due)` back to the queue, [`PER_CALL`] per script
/// call, each call given until `deadline` (at least [`GIVE_BACK_FLOOR`]), and tried again
/// until then after an error a retry can get past. The shards go at once, each on its own:
/// after a lasting failure a shard stops (its other tasks are returned by a reaper after their
/// lease), and the others go on. Returns how many were handed back, and the first failure.
pub(super) async fn hand_back(
    shared: Arc<Shared>,
    tasks: Vec<HandBack>,
    deadline: std::time::Instant,
) -> (usize, Option<StoreError>) {
    let by_shard = by_shard(
        tasks
            .into_iter()
            .map(|(shard, id, owner, due)| (shard, (id, owner, due))),
    );
    let calls = by_shard.into_iter().map(|(shard, tasks)| {
        let shared = shared.clone();
        async move {
            let keys = &shared.shards[shard as usize];
            let mut given = 0;
            for chunk in tasks.chunks(PER_CALL) {
                let mut inv = scripts::GIVE_BACK.prepare_invoke();
                inv.key(keys.lease())
                    .key(keys.owner())
                    .key(keys.due())
                    .arg(shared.cfg.channel())
                    .arg(shared.cfg.notify_before())
                    .arg(shared.cfg.wake_suffix(shard));
                for (id, owner, due) in chunk {
                    inv.arg(id.as_str()).arg(&**owner).arg(*due);
                }
                // Tried again while the error is one a retry can get past (a dropped
                // connection, a cluster reconfiguring) and time is left: the script checks
                // each owner, so a second run of a call that ran hands nothing back twice.
                let mut wait = Duration::from_millis(20);
                loop {
                    let left = remaining(deadline).max(GIVE_BACK_FLOOR);
                    match tokio::time::timeout(left, shared.conn.run::<u64>(&inv)).await {
                        Ok(Ok(n)) => {
                            given += n as usize;
                            break;
                        }
                        Ok(Err(e))
                            if crate::redis::link::passing(&e) && remaining(deadline) > wait =>
                        {
                            tracing::debug!(error = %e, shard, "hand-back failed; trying again");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_millis(200));
                        }
                        Ok(Err(e)) => return (given, Some(StoreError::from(e))),
                        Err(_) => {
                            let e = "redis did not answer before the hand-back's deadline";
                            return (given, Some(StoreError::new(e)));
                        }
                    }
                }
            }
            (given, None)
        }
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .fold((0, None), |(given, failure), (g, f)| {
            (given + g, failure.or(f))
        })
}

/// Watches for stalled handlers (see [`handlers_stalled`]), every quarter of `handler_stall`
/// (between 1 ms and 1 s). While they are stalled, no claim is sent (`Reserved::take`), and
/// whatever this consumer holds, fired or not, is taken out of `held` and handed back to the
/// queue (a task that fires here later finds its entry gone and does not run). A hand-back that
/// fails is tried again at every check, the tasks' leases renewed meanwhile (see
/// [`retry_hand_back`]); what is left at shutdown, `shutdown` hands back.
pub(super) async fn stall_loop(
    shared: Arc<Shared>,
    timer: Timer<Claimed>,
    mut stop: watch::Receiver<bool>,
) {
    let every =
        (shared.cfg.handler_stall / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the last check found the handlers stalled: a stall is logged once.
    let mut stalled = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if !handlers_stalled(&shared) {
            if std::mem::take(&mut stalled) {
                tracing::info!(consumer = %shared.id, "a handler thread is free again: claiming");
            }
            // A hand-back that failed is tried again, stalled or not.
            retry_hand_back(&shared, &mut stop).await;
            continue;
        }
        if !std::mem::replace(&mut stalled, true) {
            tracing::warn!(
                consumer = %shared.id,
                threads = shared.cfg.handler_threads,
                stall = ?shared.cfg.handler_stall,
                "every handler thread is stuck in one handler: handing held tasks back and \
                 claiming none until a thread is free"
            );
        }
        // Whoever removes an entry owns it: a handler that starts meanwhile finds its entry
        // gone and does nothing.
        let taken: Vec<_> = shared
            .held
            .lock()
            .drain()
            .map(|((shard, id), (t, owner, due))| {
                timer.cancel(t);
                (shard, id, owner, due)
            })
            .collect();
        shared.handing_back.lock().extend(taken);
        // The limiter's parked copies of what was taken: no longer this consumer's to run.
        drop(super::gates::take_parked(&shared.limiter));
        retry_hand_back(&shared, &mut stop).await;
    }
}

/// Hands back what the stall loop took (`handing_back`): the whole list, again after a failure
/// (the script skips a task no longer leased to this consumer). Returns early, leaving the list
/// to `shutdown`, once the consumer stops.
pub(super) async fn retry_hand_back(shared: &Arc<Shared>, stop: &mut watch::Receiver<bool>) {
    let back = shared.handing_back.lock().clone();
    if back.is_empty() {
        return;
    }
    let deadline = std::time::Instant::now() + shared.cfg.lease / 3;
    let carried = back.len();
    let (given, failure) = tokio::select! {
        r = hand_back(shared.clone(), back, deadline) => r,
        _ = stop.changed() => return,
    };
    shared.counters.given_back.fetch_add(given as u64, Relaxed);
    metrics::counter!("delaywheel_queue_given_back_total").increment(given as u64);
    match failure {
        None => {
            let mut list = shared.handing_back.lock();
            // Only what this call carried: the loop alone adds to the list, between calls.
            let n = carried.min(list.len());
            list.drain(..n);
            tracing::info!(consumer = %shared.id, tasks = given, "held tasks handed back (the handlers were stuck, or a limited topic had too many waiting)");
        }
        Some(e) => {
            tracing::warn!(consumer = %shared.id, error = %e, tasks = carried, "handing back held tasks failed; trying again");
        }
    }
}
