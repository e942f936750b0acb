//! The claim loop, one per shard: claims the tasks due within the lookahead and arms a timer
//! for each, woken early by the subscriber.

use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::redis::envelope::Envelope;
use crate::redis::queue::config::QueueError;
use crate::redis::queue::dead_letters::dead_record;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;
use crate::Timer;

use super::handlers::*;
use super::shared::*;

/// Claims from the `i`-th assigned shard: at start, every `reconcile`, when notified of a task
/// due before the next claim, and again at once while claims come back full (within
/// [`ROOM_RECHECK`] when `max_held` leaves no room for the next). Each shard has
/// its own loop, its own backoff and its own wake-ups.
pub(super) async fn claim_loop(
    shared: Arc<Shared>,
    timer: Timer<Claimed>,
    mut stop: watch::Receiver<bool>,
    i: usize,
) {
    let cfg = &shared.cfg;
    let (shard, wake) = (shared.claim_from[i], &shared.wakes[i]);
    let mut next = tokio::time::Instant::now();
    // After a failed claim, not even a wake-up claims before this.
    let mut not_before = next;
    let mut failures = 0u32;
    // The nonce of the next claim: kept after a failed claim, so that a claim whose reply was
    // lost after the script ran is answered again by the retry (see `scripts::CLAIM`).
    let mut nonce = fastrand::u64(..);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = wake.notify.notified() => {
                let due = wake.at.swap(u64::MAX, SeqCst);
                // Claim `claim_margin` before the earliest notified task is due, unless a claim
                // comes sooner anyway.
                let at_ms = due.saturating_sub(cfg.claim_margin.as_millis() as u64);
                let wait = Duration::from_millis(at_ms.saturating_sub(now_ms()));
                // Any publisher may write to the channel: a far-off time is just ignored.
                if let Some(at) = tokio::time::Instant::now().checked_add(wait) {
                    next = next.min(at.max(not_before));
                }
                continue;
            }
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let mut full = false;
        let mut no_room = false;
        let mut failed = false;
        // After a failure the nonce is kept: the claim may answer a batch already leased here.
        match claim(&shared, &timer, shard, nonce, failures > 0).await {
            Ok(Some(Took { n, asked })) => {
                // Full (as many as it asked for): claim again at once if there is room.
                full = n >= asked;
                nonce = fastrand::u64(..);
            }
            // No room: nothing was sent, and a nonce kept after a failure stays for the retry.
            Ok(None) => no_room = true,
            Err(e) => {
                if failures == 0 && shared.failing.fetch_add(1, SeqCst) == 0 {
                    tracing::warn!(shard, error = %e, "claim failed; retrying with backoff");
                }
                failed = true;
            }
        }
        if no_room {
            // Neither a success nor a failure: the backoff of a claim that failed before stays
            // (a Redis that hangs must not be asked again every few ms because other shards'
            // hung claims hold the room), and so does its warning state. Look again soon, as
            // held tasks fire and make room, but not before that backoff ends.
            next = (tokio::time::Instant::now() + ROOM_RECHECK.min(cfg.reconcile)).max(not_before);
            continue;
        }
        if !failed && failures > 0 {
            shared.failing.fetch_sub(1, SeqCst);
        }
        failures = if failed {
            failures.saturating_add(1)
        } else {
            0
        };
        let pause = if failed {
            // From `claim_margin` (at least the floor, or a Redis that fails at once would be
            // asked again back to back), doubling, up to `reconcile`.
            (cfg.claim_margin.max(CLAIM_RETRY_FLOOR) * 2u32.saturating_pow(failures.min(6)))
                .min(cfg.reconcile)
                .max(CLAIM_RETRY_FLOOR)
        } else if full && shared.held.lock().len() < cfg.max_held {
            Duration::ZERO
        } else if full {
            // More may be due, and `held` is at `max_held` (or its room is reserved by other
            // shards' claims): look again soon, as its tasks fire and make room, rather than a
            // reconcile later. No Redis call until there is room.
            ROOM_RECHECK.min(cfg.reconcile)
        } else {
            // 80–100% of it, so that the loops of many shards, started together, do not claim
            // in step; never more, or a task could fall between two claims' windows (the
            // config checks `lookahead ≥ reconcile + claim_margin`).
            cfg.reconcile.mul_f64(0.8 + 0.2 * fastrand::f64())
        };
        next = tokio::time::Instant::now() + pause;
        if failed {
            // (After a success it is already past.)
            not_before = next;
        }
    }
}

/// How soon a claim loop that found no room under `max_held` (after a full claim, or with
/// none sent) looks again.
pub(super) const ROOM_RECHECK: Duration = Duration::from_millis(10);

/// The shortest wait before a claim that failed is tried again.
pub(super) const CLAIM_RETRY_FLOOR: Duration = Duration::from_millis(10);

/// Room reserved in `held` for one claim, given back when the claim is done (by then what it
/// took is in `held`).
pub(super) struct Reserved<'a> {
    pub(super) shared: &'a Shared,
    pub(super) n: usize,
}

impl Reserved<'_> {
    /// Up to a batch of the room left under `max_held`, counting what other claims in flight
    /// reserved; `None` if there is none, or the handlers are stalled and this is not the
    /// `replay` of a failed claim (whose batch may be leased here already: it is taken in, and
    /// handed back by the stall loop, rather than left to its leases). Reserved under `held`'s lock, so two claims cannot
    /// both count the same room (a release meanwhile only makes the count conservative).
    pub(super) fn take(shared: &Shared, replay: bool) -> Option<Reserved<'_>> {
        if !replay && handlers_stalled(shared) {
            return None;
        }
        let held = shared.held.lock();
        let used = held.len().saturating_add(shared.reserved.load(SeqCst));
        let n = shared
            .cfg
            .max_held
            .saturating_sub(used)
            .min(shared.cfg.batch);
        if n == 0 {
            return None;
        }
        shared.reserved.fetch_add(n, SeqCst);
        drop(held);
        Some(Reserved { shared, n })
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.shared.reserved.fetch_sub(self.n, SeqCst);
    }
}

/// What a claim took: `n` tasks, of the `asked` it had room for. (A claim answered again, its
/// first reply lost, may bring more than it asked for this time: they were leased already.)
pub(super) struct Took {
    pub(super) n: usize,
    pub(super) asked: usize,
}

/// One claim on `shard` with `nonce` (the nonce of a failed claim answers that claim's batch
/// again, `replay`); puts the tasks in the wheel. `None` if there was no room under
/// `max_held`, or the handlers are stalled: no claim was sent.
pub(super) async fn claim(
    shared: &Shared,
    timer: &Timer<Claimed>,
    shard: u32,
    nonce: u64,
    replay: bool,
) -> Result<Option<Took>, QueueError> {
    let cfg = &shared.cfg;
    let Some(room) = Reserved::take(shared, replay) else {
        return Ok(None);
    };
    let asked = room.n;
    let keys = &shared.shards[shard as usize];
    let now = now_ms();
    let mut inv = scripts::CLAIM.prepare_invoke();
    inv.key(keys.due())
        .key(keys.tasks())
        .key(keys.lease())
        .key(keys.owner())
        .key(keys.fence())
        .key(keys.dead())
        .key(keys.batch(&shared.batch_name))
        .key(keys.expired())
        .key(keys.unpaired())
        .key(keys.paused())
        .arg(now + cfg.lookahead.as_millis() as u64)
        .arg(room.n)
        .arg(shared.id.as_str())
        .arg(cfg.lease.as_millis() as u64)
        .arg(nonce)
        .arg(cfg.unpaired_grace.as_millis() as u64);
    let reply: Vec<Vec<u8>> = shared.conn.run(&inv).await?;
    shared.counters.claims.fetch_add(1, Relaxed);
    // A real claim's first element is its token, a number.
    let paused = reply.len() == 1 && reply[0] == b"paused";
    metrics::gauge!(
        "delaywheel_queue_paused",
        "namespace" => cfg.namespace.clone(),
        "shard" => shard.to_string()
    )
    .set(f64::from(u8::from(paused)));
    if paused {
        metrics::histogram!("delaywheel_queue_claim_batch").record(0.0);
        return Ok(Some(Took { n: 0, asked }));
    }
    let Some((token, rest)) = reply.split_first() else {
        metrics::histogram!("delaywheel_queue_claim_batch").record(0.0);
        return Ok(Some(Took { n: 0, asked }));
    };
    let owner: Arc<str> = format!("{}|{}", shared.id, String::from_utf8_lossy(token)).into();
    let marked = |mark: &[u8]| rest.chunks_exact(3).filter(|t| t[1] == mark).count();
    let (waiting, refused) = (marked(b"wait"), marked(b"wrongtype"));
    // What the claim changed in Redis (a task leased or dead-lettered, an id first seen with
    // no envelope), for whether it was full. An id left queued on a wrong-typed key changed
    // nothing, and is read again by the next claim: counted, it would make claims back to
    // back.
    let n = rest.len() / 3 - refused;
    metrics::histogram!("delaywheel_queue_claim_batch").record((n - waiting) as f64);
    shared
        .counters
        .claimed
        .fetch_add((n - waiting) as u64, Relaxed);
    for t in rest.chunks_exact(3) {
        let id = String::from_utf8_lossy(&t[0]).into_owned();
        if t[1] == b"dead" {
            // No envelope: the claim dead-lettered it, and leased nothing.
            tracing::warn!(%id, reason = "no envelope in the tasks hash", "claimed task dead-lettered");
            shared.counters.dead_lettered.fetch_add(1, Relaxed);
            continue;
        }
        if t[1] == b"wait" {
            // Queued with no envelope, maybe half written: left queued for its grace period.
            tracing::debug!(%id, "queued task has no envelope yet; left queued for unpaired_grace");
            continue;
        }
        if t[1] == b"wrongtype" {
            wrong_type(shard, &String::from_utf8_lossy(&t[2]), Some(&id));
            continue;
        }
        if std::str::from_utf8(&t[0]).is_err() {
            // Written by another client: no envelope can name it, and an ack by its lossy
            // reading would never match. Dead-lettered under the id as stored.
            tracing::warn!(%id, "claimed task with a non-UTF-8 id dead-lettered");
            let raw = String::from_utf8_lossy(&t[2]).into_owned();
            let _ = shared
                .outcomes
                .send(Outcome::Dead {
                    shard,
                    record: dead_record("task id is not UTF-8", &raw, 0),
                    id,
                    raw_id: Some(t[0].clone()),
                    owner: owner.clone(),
                })
                .await;
            continue;
        }
        let due: u64 = std::str::from_utf8(&t[1])
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map_or(now, |f| f as u64);
        let envelope = match Envelope::decode(&t[2]) {
            Ok(mut e) if e.id == id => {
                e.due_at = due; // the score is authoritative
                e
            }
            // (An id with no envelope never comes here: the claim dead-lettered it.)
            other => {
                let reason = match other {
                    Ok(e) => format!("envelope id {} does not match its key", e.id),
                    Err(e) => format!("undecodable envelope: {e}"),
                };
                tracing::warn!(%id, %reason, "claimed task dead-lettered");
                let raw = String::from_utf8_lossy(&t[2]).into_owned();
                let _ = shared
                    .outcomes
                    .send(Outcome::Dead {
                        shard,
                        record: dead_record(&reason, &raw, 0),
                        id,
                        raw_id: None,
                        owner: owner.clone(),
                    })
                    .await;
                continue;
            }
        };
        let delay = Duration::from_micros(due.saturating_mul(1_000).saturating_sub(now_us()));
        super::gates::claimed(&shared.limiter, envelope.topic.as_ref(), shard, &id, due);
        let mut held = shared.held.lock();
        let claimed = Claimed {
            shard,
            owner: owner.clone(),
            envelope,
        };
        match timer.schedule(claimed, delay) {
            Ok(t) => {
                // Claimed again (it was replaced and re-queued): the newer claim wins.
                if let Some((old, _, _)) = held.insert((shard, id), (t, owner.clone(), due)) {
                    timer.cancel(old);
                }
            }
            Err(_) => return Ok(Some(Took { n, asked })), // shutting down: the lease brings it back
        }
    }
    Ok(Some(Took { n, asked }))
}
