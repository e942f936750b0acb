//! The reaper, one per shard: returns expired leases to the queue, dead-letters tasks past
//! their expiry limit, and sweeps envelopes left alone.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::sync::watch;

use crate::redis::queue::conn::sample_shard;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;

use super::shared::*;

/// Returns expired leases of the `i`-th assigned shard to the queue, takes a step of the sweep
/// for envelopes with no queue entry (see `scripts::SWEEP`), and samples its depth, every
/// `reaper_interval`.
pub(super) async fn reap_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>, i: usize) {
    let shard = shared.claim_from[i];
    // Where the sweep goes on in `tasks` and in `unpaired` (HSCAN cursors).
    let mut sweep = (String::from("0"), String::from("0"));
    // The shards' reapers start spread over one interval, so they do not run in step.
    let offset = shared.cfg.reaper_interval.mul_f64(fastrand::f64());
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + offset,
        shared.cfg.reaper_interval,
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => {
                if i == 0 {
                    shared.by_topic.write(&shared.conn, shared.shards[0].stats()).await;
                }
                return;
            }
        }
        let keys = &shared.shards[shard as usize];
        let mut inv = scripts::REAP.prepare_invoke();
        inv.key(keys.lease())
            .key(keys.owner())
            .key(keys.due())
            .key(keys.tasks())
            .key(keys.dead())
            .key(keys.expired())
            .arg(REAP_BATCH)
            .arg(shared.cfg.channel())
            .arg(shared.cfg.max_lease_expiries)
            .arg(shared.cfg.wake_suffix(shard));
        // Full batches are followed by another at once (a crashed consumer may have held
        // 100k tasks), a bounded number per round so that one round does not run forever.
        let (mut n, mut dead, mut bad) = (0, 0, String::new());
        for _ in 0..REAP_CALLS_PER_ROUND {
            match shared.conn.run::<(u64, u64, String)>(&inv).await {
                Ok((requeued, died, refused_by)) => {
                    n += requeued;
                    dead += died;
                    if !refused_by.is_empty() {
                        bad = refused_by;
                    }
                    if requeued + died < REAP_BATCH {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reaper: redis unavailable");
                    break;
                }
            }
        }
        if n > 0 {
            tracing::info!(shard, recovered = n, "expired leases returned to the queue");
            shared.counters.recovered.fetch_add(n, Relaxed);
            metrics::counter!("delaywheel_queue_lease_recovered_total").increment(n);
        }
        if dead > 0 {
            tracing::warn!(
                shard,
                dead,
                max = shared.cfg.max_lease_expiries,
                "tasks whose lease ran out too often were dead-lettered"
            );
            shared.counters.dead_lettered.fetch_add(dead, Relaxed);
        }
        if !bad.is_empty() {
            // Tasks out of lease expiries stay leased until the dead-letter key is fixed.
            wrong_type(shard, &bad, None);
        }
        sweep_step(&shared, shard, &mut sweep).await;
        if i == 0 {
            // One reaper per consumer writes its topic counts, to the first shard's key set.
            shared
                .by_topic
                .write(&shared.conn, shared.shards[0].stats())
                .await;
        }
        let fired = shared.counters.fired.load(Relaxed);
        if fired > 0 {
            metrics::gauge!("delaywheel_queue_commands_per_fired_task")
                .set(shared.conn.commands.load(Relaxed) as f64 / fired as f64);
        }
        if let Ok((d, oldest)) = sample_shard(&shared.conn, keys, true).await {
            let labels = [
                ("namespace", shared.cfg.namespace.clone()),
                ("shard", shard.to_string()),
            ];
            metrics::gauge!("delaywheel_queue_depth", &labels).set(d.queued as f64);
            metrics::gauge!("delaywheel_queue_leased", &labels).set(d.leased as f64);
            metrics::gauge!("delaywheel_queue_dead", &labels).set(d.dead as f64);
            // The age of the oldest due task no consumer has claimed: how late the queue runs.
            let now = now_ms() as f64;
            let late = oldest
                .filter(|s| s.is_finite() && *s < now)
                .map_or(0.0, |s| now - s);
            metrics::gauge!("delaywheel_queue_latency_seconds", &labels).set(late / 1e3);
        }
    }
}

/// One step of the sweep of `shard` for envelopes with no queue entry, from the cursors in
/// `sweep`, which it moves on. A failure is only logged: the next round tries again.
pub(super) async fn sweep_step(shared: &Shared, shard: u32, sweep: &mut (String, String)) {
    let keys = &shared.shards[shard as usize];
    let unpaired = keys.unpaired();
    let mut inv = scripts::SWEEP.prepare_invoke();
    inv.key(keys.tasks())
        .key(keys.due())
        .key(keys.lease())
        .key(keys.dead())
        .key(unpaired)
        .key(keys.expired())
        .arg(&sweep.0)
        .arg(&sweep.1)
        .arg(SWEEP_COUNT)
        .arg(shared.cfg.unpaired_grace.as_millis() as u64);
    match shared.conn.run::<(String, String, u64, String)>(&inv).await {
        Ok((tasks, noted, removed, bad)) => {
            *sweep = (tasks, noted);
            if removed > 0 {
                tracing::warn!(
                    shard,
                    removed,
                    "envelopes with no queue entry past unpaired_grace removed"
                );
                metrics::counter!("delaywheel_queue_unpaired_removed_total").increment(removed);
            }
            if !bad.is_empty() {
                wrong_type(shard, &bad, None);
            }
        }
        Err(e) => tracing::debug!(error = %e, "sweep: redis unavailable"),
    }
}

/// Envelopes a sweep step looks at, about (an HSCAN `COUNT`, a hint): each comes with its
/// envelope, so a step copies at most this many envelopes in Redis.
pub(super) const SWEEP_COUNT: u64 = 100;

/// Expired leases a reaper's script call returns, at most, and calls per reaper round.
pub(super) const REAP_BATCH: u64 = 1_000;

pub(super) const REAP_CALLS_PER_ROUND: usize = 100;
