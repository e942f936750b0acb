//! The outcome writer: acks in batches, retries and dead-letterings as they come, each shard's
//! writes as tasks of their own.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::redis::queue::scripts;

use super::renewal::*;
use super::shared::*;
use super::writes::*;

/// Writes the outcomes of fired tasks: acks in batches every `ack_interval` (or 256 at
/// once), retries and dead-letterings as they come, and renews leases every `lease / 3`. On a
/// Redis error an ack batch is kept and retried; the lease keeps the tasks safe meanwhile.
/// `finish` (shutdown, once the handlers are done) drains what is left and returns.
///
/// Every write goes to one shard and runs as a task of its own, and this loop never waits on
/// one: a shard whose node stops answering holds back its own acks, outcomes and renewals (at
/// most one ack call, one renewal and [`OUTCOME_WRITES`] outcome writes are out per shard),
/// not the other shards', nor the handlers. Outcomes waiting or being written number at most
/// [`OUTCOME_BOUND`]; past that this loop stops reading, and handlers wait on the channel.
pub(super) async fn resolve(
    shared: Arc<Shared>,
    mut outcomes: mpsc::Receiver<Outcome>,
    mut finish: tokio::sync::oneshot::Receiver<()>,
) {
    let mut outboxes: HashMap<u32, Outbox> = HashMap::new();
    // Outcomes received and not yet written (waiting, or in a call that is out).
    let mut buffered = 0usize;
    let mut writes = Writes::default();
    let mut finishing = false;
    let mut tick = tokio::time::interval(shared.cfg.ack_interval.max(Duration::from_millis(1)));
    let mut renew_tick =
        tokio::time::interval((shared.cfg.lease / 3).max(Duration::from_millis(1)));
    renew_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The concurrency slots of limited topics, renewed whatever `renew_leases` says (a slot
    // is never held past its lease by a consumer that still runs a handler on it).
    let mut slot_tick = tokio::time::interval((shared.cfg.lease / 3).max(Duration::from_millis(1)));
    slot_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let caps = shared.limiter.has_caps();
    loop {
        let mut flush_now = finishing;
        // The shard whose outbox changed, to send what it can.
        let mut touched = None;
        tokio::select! {
            Some(o) = outcomes.recv(), if buffered < OUTCOME_BOUND => {
                buffered += 1;
                touched = Some(o.shard());
                let outbox = outboxes.entry(o.shard()).or_default();
                match o {
                    Outcome::Ack { id, owner, unique_ms, .. } => outbox.acks.push((id, owner, false, unique_ms)),
                    other => outbox.outcomes.push_back(other),
                }
            }
            Some(done) = writes.set.join_next_with_id(), if !writes.set.is_empty() => {
                let (task, done) = match done {
                    Ok((task, done)) => (task, Some(done)),
                    Err(e) => {
                        tracing::error!(error = %e, "a queue write task failed");
                        (e.id(), None)
                    }
                };
                if let Some(job) = writes.jobs.remove(&task) {
                    touched = Some(job.shard());
                    buffered -= finished(&shared, &mut outboxes, job, done);
                }
            }
            _ = tick.tick() => {
                flush_now = true;
                outboxes.retain(|_, o| !o.is_idle());
            }
            // Here, where outcomes are written, and until the last one is: a handler still
            // running at shutdown keeps its lease until it is done.
            _ = renew_tick.tick(), if shared.cfg.renew_leases => {
                for (shard, tasks) in renewals(&shared) {
                    let outbox = outboxes.entry(shard).or_default();
                    if !outbox.renewing {
                        outbox.renewing = true;
                        writes.spawn(renew(shared.clone(), shard, tasks), Job::Renewal { shard });
                    }
                }
                continue;
            }
            _ = slot_tick.tick(), if caps => {
                tokio::spawn(super::limiter::renew_slots(shared.clone()));
                continue;
            }
            _ = &mut finish, if !finishing => {
                flush_now = true;
                finishing = true;
            }
        }
        if flush_now {
            for (&shard, outbox) in &mut outboxes {
                dispatch(&shared, &mut writes, shard, outbox, true);
            }
        } else if let Some(shard) = touched {
            if let Some(outbox) = outboxes.get_mut(&shard) {
                dispatch(&shared, &mut writes, shard, outbox, false);
            }
        }
        if finishing && buffered == 0 && outcomes.is_empty() {
            // Renewals still out are dropped with `writes`: nothing is left to renew.
            return;
        }
    }
}

/// Starts the writes `outbox` has waiting, as far as its shard's limits allow: an ack call
/// (once [`ACK_BATCH`] acks wait, or whatever waits if `flush`), and outcome writes.
pub(super) fn dispatch(
    shared: &Arc<Shared>,
    writes: &mut Writes,
    shard: u32,
    outbox: &mut Outbox,
    flush: bool,
) {
    if !outbox.acking && !outbox.acks.is_empty() && (flush || outbox.acks.len() >= ACK_BATCH) {
        let n = outbox.acks.len().min(PER_CALL);
        let batch: Arc<Vec<_>> = Arc::new(outbox.acks.drain(..n).collect());
        outbox.acking = true;
        writes.spawn(
            send_acks(shared.clone(), shard, batch.clone()),
            Job::Acks { shard, batch },
        );
    }
    while outbox.writing < OUTCOME_WRITES {
        let Some(o) = outbox.outcomes.pop_front() else {
            break;
        };
        outbox.writing += 1;
        let job = Job::Outcome {
            shard,
            id: o.id().to_string(),
            owner: o.owner().clone(),
        };
        writes.spawn(write_outcome(shared.clone(), o), job);
    }
}

/// Acks a shard collects before it sends them without waiting for `ack_interval`.
pub(super) const ACK_BATCH: usize = 256;

/// Retries and dead-letterings of one shard written at once, at most.
pub(super) const OUTCOME_WRITES: usize = 4;

/// Failures of writing a retry or a dead letter, with an error no retry gets past, after which
/// it is given up.
pub(super) const OUTCOME_TRIES: u32 = 5;

/// The longest wait between two tries of writing a retry or a dead letter.
pub(super) const OUTCOME_RETRY_MAX: Duration = Duration::from_secs(2);

/// What the resolver holds for one shard.
#[derive(Default)]
pub(super) struct Outbox {
    /// Acks waiting for the shard's next ack call.
    pub(super) acks: Vec<PendingAck>,
    /// An ack call is out.
    pub(super) acking: bool,
    /// Retries and dead-letterings waiting for their turn.
    pub(super) outcomes: VecDeque<Outcome>,
    /// Retries and dead-letterings being written.
    pub(super) writing: usize,
    /// A renewal is out.
    pub(super) renewing: bool,
}

impl Outbox {
    pub(super) fn is_idle(&self) -> bool {
        self.acks.is_empty()
            && !self.acking
            && self.outcomes.is_empty()
            && self.writing == 0
            && !self.renewing
    }
}

/// Books a write task's end (`done` is `None` if it panicked); returns how many outcomes it
/// wrote, which are no longer buffered.
pub(super) fn finished(
    shared: &Shared,
    outboxes: &mut HashMap<u32, Outbox>,
    job: Job,
    done: Option<Done>,
) -> usize {
    match job {
        Job::Acks { shard, batch } => {
            let outbox = outboxes.entry(shard).or_default();
            outbox.acking = false;
            match done {
                Some(Done::Acks(Ok(results))) => {
                    acked(shared, shard, &batch, &results);
                    batch.len()
                }
                failed => {
                    // A task that panicked: whether its call went out is not known.
                    let mut ran = true;
                    if let Some(Done::Acks(Err(e))) = failed {
                        tracing::debug!(error = %e, shard, "ack failed; kept for the next round");
                        ran = crate::redis::link::may_have_run(&e);
                    }
                    // The task has ended, so this is the last reference.
                    let batch = Arc::try_unwrap(batch).unwrap_or_else(|b| (*b).clone());
                    // Sent again, marked as such if the failed call may have run (its reply
                    // lost) and was not marked before.
                    outbox.acks.extend(
                        batch
                            .into_iter()
                            .map(|(id, owner, again, unique)| (id, owner, again || ran, unique)),
                    );
                    0
                }
            }
        }
        Job::Renewal { shard } => {
            outboxes.entry(shard).or_default().renewing = false;
            0
        }
        Job::Outcome { shard, id, owner } => {
            outboxes.entry(shard).or_default().writing -= 1;
            if done.is_none() {
                settled(shared, shard, &id, &owner);
            }
            1
        }
    }
}

/// One ack call for `shard`'s `batch`. A failure waits a little before it returns, so that
/// the resolver's retries of an error Redis answers at once do not spin.
pub(super) async fn send_acks(
    shared: Arc<Shared>,
    shard: u32,
    batch: Arc<Vec<PendingAck>>,
) -> Done {
    let keys = &shared.shards[shard as usize];
    let mut inv = scripts::ACK.prepare_invoke();
    inv.key(keys.lease())
        .key(keys.owner())
        .key(keys.tasks())
        .key(keys.expired())
        .key(keys.dead());
    // A unique window's marker key for each task, only when one of them has a window.
    let windows = batch.iter().any(|(.., unique)| *unique > 0);
    // Runs of consecutive tasks that share their owner, `again` and window: one header each
    // (owner, again, window, count), then the run's ids.
    let mut start = 0;
    while let Some((_, owner, again, unique)) = batch.get(start) {
        let end = batch[start..]
            .iter()
            .position(|(_, o, a, u)| (o, a, u) != (owner, again, unique))
            .map_or(batch.len(), |n| start + n);
        inv.arg(&**owner)
            .arg(u8::from(*again))
            .arg(*unique)
            .arg(end - start);
        for (id, ..) in &batch[start..end] {
            inv.arg(id.as_str());
            if windows {
                inv.key(keys.unique_marker(id));
            }
        }
        start = end;
    }
    let results = shared.conn.run::<Vec<u8>>(&inv).await;
    if results.is_err() {
        tokio::time::sleep(shared.cfg.ack_interval.max(Duration::from_millis(50))).await;
    }
    Done::Acks(results)
}

/// Counts an answered ack call: each task's lease is no longer renewed, acked or refused.
pub(super) fn acked(shared: &Shared, shard: u32, batch: &[PendingAck], results: &[u8]) {
    for ((id, owner, ..), ok) in batch.iter().zip(results) {
        settled(shared, shard, id, owner);
        if *ok == 2 {
            // Gone, and held by no one: most likely a resend of an ack that landed.
            tracing::debug!(%id, "ack found the task already gone");
        }
        if *ok != 0 {
            shared.counters.acked.fetch_add(1, Relaxed);
        } else {
            shared.counters.refused.fetch_add(1, Relaxed);
            metrics::counter!("delaywheel_queue_acks_refused_total").increment(1);
            tracing::warn!(%id, "ack refused: the lease was taken over, or the task cancelled or replaced");
        }
    }
}

pub(super) async fn write_outcome(shared: Arc<Shared>, o: Outcome) -> Done {
    let (inv, id, ok_counter) = match &o {
        Outcome::Retry {
            shard,
            id,
            owner,
            envelope,
            due,
        } => {
            let keys = &shared.shards[*shard as usize];
            let mut inv = scripts::RETRY.prepare_invoke();
            inv.key(keys.lease())
                .key(keys.owner())
                .key(keys.tasks())
                .key(keys.due())
                .arg(id.as_str())
                .arg(&**owner)
                .arg(envelope.as_slice())
                .arg(*due)
                .arg(shared.cfg.channel())
                .arg(shared.cfg.notify_before())
                .arg(shared.cfg.wake_suffix(*shard));
            (inv, id, &shared.counters.retried)
        }
        Outcome::Dead {
            shard,
            id,
            raw_id,
            owner,
            record,
        } => {
            let keys = &shared.shards[*shard as usize];
            let mut inv = scripts::DEAD.prepare_invoke();
            inv.key(keys.lease())
                .key(keys.owner())
                .key(keys.tasks())
                .key(keys.dead())
                .key(keys.expired())
                .arg(raw_id.as_deref().unwrap_or(id.as_bytes()))
                .arg(&**owner)
                .arg(record.as_str());
            (inv, id, &shared.counters.dead_lettered)
        }
        Outcome::Ack { .. } => return Done::Other,
    };
    // Tried until Redis answers, as acks are, while the error is one a retry can get past
    // (a connection lost, a timeout, a cluster failing over, a server loading): meanwhile the
    // task stays in `working`, so its lease is renewed once Redis is back, and the retry's
    // attempt count, backoff and reason (or the dead letter) are not lost to a lease expiry
    // that would put the old envelope back (and count as a crash). An error no retry gets
    // past (NOPERM, WRONGTYPE, a script error) is given up on after a few tries: the lease then
    // runs out and the task fires again elsewhere, rather than staying leased for ever. A
    // shutdown stops this with the resolver.
    let mut wait = Duration::from_millis(50);
    let (mut failures, mut lasting) = (0u32, 0u32);
    loop {
        match shared.conn.run::<i64>(&inv).await {
            // 2: an earlier send of this write landed; its reply was lost.
            Ok(1 | 2) => {
                ok_counter.fetch_add(1, Relaxed);
                break;
            }
            Ok(_) => {
                shared.counters.refused.fetch_add(1, Relaxed);
                tracing::warn!(%id, "refused: the lease was taken over, or the task cancelled or replaced");
                break;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                // Codes the redis crate does not know, which a server answers while it is
                // busy or short of something for a while, count as passing too.
                let transient = crate::redis::link::passing(&e)
                    || matches!(
                        e.code(),
                        Some("BUSY" | "MISCONF" | "NOREPLICAS" | "OOM" | "LOADING" | "TRYAGAIN")
                    );
                if !transient {
                    lasting += 1;
                    if lasting >= OUTCOME_TRIES {
                        tracing::warn!(error = %e, %id, "writing a retry or dead letter failed; left to its lease");
                        break;
                    }
                }
                if failures == OUTCOME_TRIES {
                    tracing::warn!(error = %e, %id, "writing a retry or dead letter keeps failing; still trying");
                } else {
                    tracing::debug!(error = %e, %id, "writing a retry or dead letter failed");
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(OUTCOME_RETRY_MAX);
            }
        }
    }
    if let Outcome::Retry {
        shard, id, owner, ..
    }
    | Outcome::Dead {
        shard, id, owner, ..
    } = &o
    {
        settled(&shared, *shard, id, owner);
    }
    Done::Other
}

/// The outcome of task `id` under `owner` is written (or given up on): its lease is no longer
/// renewed. A newer claim of the same id keeps its entry.
pub(super) fn settled(shared: &Shared, shard: u32, id: &str, owner: &Arc<str>) {
    let mut working = shared.working.lock();
    let key = (shard, id.to_string());
    if working.get(&key) == Some(owner) {
        working.remove(&key);
    }
}
