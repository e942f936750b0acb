//! [`Scheduler`] (feature `periodic`): enqueues the occurrences of the queue's periodic
//! schedules. Run one in as many instances as you like: each occurrence is enqueued once.

use std::time::Duration;

use tokio::sync::watch;

use crate::redis::payload::new_task;
use crate::redis::queue::config::{shard_of, QueueError};
use crate::redis::queue::periodic::{CatchUp, Periodic, OCCURRENCES_MAX};
use crate::redis::queue::producer::Producer;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;

/// How far ahead occurrences are enqueued: they are in Redis before they are due, so that the
/// consumers claim them ahead and fire them on time.
const AHEAD: Duration = Duration::from_secs(1);

/// An occurrence due longer ago than this counts as missed (it falls under the schedule's
/// [`CatchUp`] policy).
const MISSED_AFTER: u64 = 1_000;

/// How often the schedules are read again from Redis.
const REREAD: Duration = Duration::from_secs(1);

/// Enqueues the occurrences of the queue's [`Periodic`] schedules, a second ahead of each,
/// from a task on the current tokio runtime. Each occurrence becomes task
/// `periodic:<name>:<occurrence ms>`, enqueued once however many schedulers run (an occurrence
/// marker set in the same script that stores it), so N instances that all run a scheduler
/// fire each occurrence once, on one consumer. Schedules added or removed with
/// [`Producer::add_periodic`] / [`remove_periodic`](Producer::remove_periodic) are read within
/// a second. After a time with no scheduler running, each schedule's [`CatchUp`] policy says
/// which missed occurrences run.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
/// use std::time::Duration;
/// use delaywheel::redis::{Periodic, Producer, QueueConfig, Scheduler};
///
/// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
/// let producer = Producer::connect(QueueConfig::new(&url, "doc-periodic")).await?;
/// let cleanup = Periodic::interval("cleanup", Duration::from_secs(60), "cleanup", serde_json::Value::Null).unwrap();
/// producer.add_periodic(&cleanup).await?;
/// let scheduler = Scheduler::start(producer.clone());
/// // ... consumers with a "cleanup" handler run it every minute, once per minute.
/// scheduler.stop().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Scheduler {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Scheduler {
    /// Starts scheduling on the current tokio runtime (a call outside one panics, as
    /// `tokio::spawn` does). Redis failures are logged and retried at the next tick.
    pub fn start(producer: Producer) -> Scheduler {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(producer, stopped));
        Scheduler { stop, task }
    }

    /// Stops it and waits for its last round to end.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn run(producer: Producer, mut stopped: watch::Receiver<bool>) {
    let mut schedules: Vec<Periodic> = Vec::new();
    // When each schedule's last round that reached Redis began: occurrences since then fell
    // while this scheduler ran (a Redis outage, a slow round), and are not "missed".
    let mut ok_since: std::collections::HashMap<String, u64> = Default::default();
    let mut read_at: Option<tokio::time::Instant> = None;
    loop {
        if read_at.is_none_or(|at| at.elapsed() >= REREAD) {
            match producer.periodics().await {
                Ok(s) => {
                    schedules = s;
                    // A schedule removed and later added again starts afresh, not from a
                    // round of days ago.
                    ok_since.retain(|name, _| schedules.iter().any(|p| p.name == *name));
                }
                Err(e) => tracing::warn!(error = %e, "scheduler: could not read the schedules"),
            }
            read_at = Some(tokio::time::Instant::now());
        }
        let mut next = now_ms() + REREAD.as_millis() as u64;
        for p in &schedules {
            let began = now_ms();
            match tick(&producer, p, ok_since.get(&p.name).copied()).await {
                Ok((soonest, caught_up)) => {
                    next = next.min(soonest);
                    // A round that listed its most (after an outage longer than that many
                    // periods) leaves the rest to the next: they fell while this scheduler
                    // ran too, and are not missed.
                    if caught_up {
                        ok_since.insert(p.name.clone(), began);
                    }
                }
                Err(e) => tracing::warn!(name = %p.name, error = %e, "scheduler: round failed"),
            }
        }
        // Until the next occurrence comes within `AHEAD`, or the next re-read.
        let wait = Duration::from_millis(
            next.saturating_sub(AHEAD.as_millis() as u64)
                .saturating_sub(now_ms())
                .clamp(10, REREAD.as_millis() as u64),
        );
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stopped.changed() => return,
        }
    }
}

/// Which of `occurrences` (in order) to enqueue: every one from `missed_before` on, and of
/// the earlier (missed) ones what the policy says.
pub(crate) fn select(occurrences: &[u64], missed_before: u64, policy: CatchUp) -> Vec<u64> {
    let split = occurrences.partition_point(|t| *t < missed_before);
    let (missed, current) = occurrences.split_at(split);
    let kept: &[u64] = match policy {
        CatchUp::Skip => &[],
        CatchUp::Latest => &missed[missed.len().saturating_sub(1)..],
        CatchUp::All { max } => &missed[missed.len().saturating_sub(max as usize)..],
    };
    kept.iter().chain(current).copied().collect()
}

/// One schedule's round: enqueues its occurrences after the last one recorded, up to `AHEAD`
/// from now, then records the last. `ok_since`: when this scheduler's last round of it that
/// reached Redis began (and caught up). Returns its next occurrence after that, and whether
/// it caught up (listed fewer than the most a round lists).
async fn tick(
    producer: &Producer,
    p: &Periodic,
    ok_since: Option<u64>,
) -> Result<(u64, bool), QueueError> {
    let now = now_ms();
    let last = last_enqueued(producer, &p.name).await?;
    // Missed: due more than a second ago, before this scheduler's last good round.
    let missed_before = ok_since
        .unwrap_or(now)
        .min(now)
        .saturating_sub(MISSED_AFTER);
    // A schedule no scheduler has run yet starts now: nothing before it is "missed".
    let after = last.unwrap_or(now.saturating_sub(MISSED_AFTER));
    let until = now + AHEAD.as_millis() as u64;
    let occurrences = p.occurrences(after, until);
    let record = |latest: u64| {
        let mut inv = scripts::PERIODIC_ADVANCE.prepare_invoke();
        inv.key(producer.shards[0].periodic_last())
            .key(producer.shards[0].periodic())
            .arg(&p.name)
            .arg(latest);
        inv
    };
    if occurrences.len() == OCCURRENCES_MAX {
        if let Some(&latest) = occurrences.last().filter(|l| **l < missed_before) {
            // Far behind (a long stop of a frequent schedule): these are all past the missed
            // ones the policy keeps, which come from the newest end. Step over them unrun; the
            // next round, at once, goes on from there.
            producer.conn.run::<String>(&record(latest)).await?;
            return Ok((now, false));
        }
    }
    let caught_up = occurrences.len() < OCCURRENCES_MAX;
    for occurrence in select(&occurrences, missed_before, p.catch_up) {
        enqueue(producer, p, occurrence).await?;
    }
    if let Some(&latest) = occurrences.last() {
        producer.conn.run::<String>(&record(latest)).await?;
    }
    let soonest = p.next_after(until).unwrap_or(u64::MAX);
    Ok((soonest, caught_up))
}

async fn last_enqueued(producer: &Producer, name: &str) -> Result<Option<u64>, QueueError> {
    let mut conn = producer.conn.conn.clone();
    producer.conn.count(1);
    let last: Option<String> = redis::cmd("HGET")
        .arg(producer.shards[0].periodic_last())
        .arg(name)
        .query_async(&mut conn)
        .await?;
    Ok(last.and_then(|l| l.parse().ok()))
}

/// Enqueues occurrence `occurrence` of `p`, unless a scheduler did already.
async fn enqueue(producer: &Producer, p: &Periodic, occurrence: u64) -> Result<bool, QueueError> {
    let id = p.task_id(occurrence);
    let envelope = new_task(
        id,
        p.topic.clone().into(),
        p.payload.clone(),
        now_ms(),
        occurrence,
    )
    .map_err(|(e, env)| QueueError::Envelope(e, env))?;
    let bytes = envelope
        .encode(producer.cfg.max_envelope)
        .map_err(|e| QueueError::Envelope(e, Box::new(envelope.clone())))?;
    let shard = shard_of(&envelope.id, producer.cfg.shards);
    let keys = &producer.shards[shard as usize];
    // Markers outlive every scheduler's view of the last occurrence by far.
    let marker_ttl = marker_ttl(p);
    let mut inv = scripts::PERIODIC_ENQUEUE.prepare_invoke();
    inv.key(keys.due())
        .key(keys.tasks())
        .key(keys.lease())
        .key(keys.owner())
        .key(keys.expired())
        .key(keys.periodic_marker(&envelope.id))
        .arg(envelope.id.as_str())
        .arg(occurrence)
        .arg(bytes)
        .arg(marker_ttl)
        .arg(producer.cfg.channel())
        .arg(producer.cfg.notify_before())
        .arg(format!("{occurrence}{}", producer.cfg.wake_suffix(shard)));
    Ok(producer.conn.run::<i64>(&inv).await? == 1)
}

/// How long an occurrence's marker lasts: ten periods, at least ten minutes, at most a day.
fn marker_ttl(p: &Periodic) -> u64 {
    let period = match &p.every {
        crate::redis::queue::periodic::Every::Interval { ms } => *ms,
        _ => 60_000,
    };
    period.saturating_mul(10).clamp(600_000, 86_400_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a 5 s stop of a 1 s schedule: Skip runs none of the missed, Latest the last, All
    /// up to its bound; every current occurrence runs under each.
    #[test]
    fn catch_up_policies_after_a_five_second_stop() {
        let now = 100_000;
        let missed_before = now - MISSED_AFTER;
        // Missed: 95 000 .. 98 000 (more than a second ago); current: 99 000 .. 101 000.
        let occurrences: Vec<u64> = (95..=101).map(|s| s * 1_000).collect();
        assert_eq!(
            select(&occurrences, missed_before, CatchUp::Skip),
            vec![99_000, 100_000, 101_000]
        );
        assert_eq!(
            select(&occurrences, missed_before, CatchUp::Latest),
            vec![98_000, 99_000, 100_000, 101_000]
        );
        assert_eq!(
            select(&occurrences, missed_before, CatchUp::All { max: 2 }),
            vec![97_000, 98_000, 99_000, 100_000, 101_000]
        );
        assert_eq!(
            select(&occurrences, missed_before, CatchUp::All { max: 100 }),
            occurrences
        );
    }
}
