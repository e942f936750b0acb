//! The dashboard's census of topics: how many tasks of each topic are queued, leased and
//! dead, and how late its oldest due task is. The queue keeps no count per topic (every script
//! that moves a task would have to read its topic), so the dashboard counts: it walks the
//! queue with [`Producer::list`] (bounded pages, every shard), at most `rate` tasks a second so
//! that a big queue costs Redis little, and shows the last complete pass with its time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{now_ms, ListCursor, ListState, Producer, QueueError};
use parking_lot::Mutex;
use serde_json::json;

/// Tasks per page the census reads.
const PAGE: usize = 500;

/// Topics shown, at most (those with the most tasks); the rest are summed under one row.
const SHOWN: usize = 50;

/// One topic's tasks in the last pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TopicNow {
    pub(crate) queued: u64,
    pub(crate) leased: u64,
    pub(crate) dead: u64,
    /// How late its oldest due, unclaimed task was when the pass read it (ms); 0 if none.
    pub(crate) latency_ms: u64,
}

/// A complete pass over the queue.
#[derive(Debug, Clone, Default)]
pub(crate) struct Census {
    /// When the pass started and how long it took (ms).
    pub(crate) at_ms: u64,
    pub(crate) took_ms: u64,
    /// Tasks it read.
    pub(crate) tasks: u64,
    pub(crate) topics: BTreeMap<String, TopicNow>,
}

impl Census {
    /// The page's form: the topics with the most tasks first, the rest under `(other topics)`.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let mut rows: Vec<(&String, &TopicNow)> = self.topics.iter().collect();
        rows.sort_by_key(|(name, t)| (std::cmp::Reverse(t.queued + t.leased + t.dead), *name));
        let mut shown: Vec<(String, TopicNow)> = rows
            .iter()
            .take(SHOWN)
            .map(|(n, t)| ((*n).clone(), (*t).clone()))
            .collect();
        if rows.len() > SHOWN {
            let mut rest = TopicNow::default();
            for (_, t) in &rows[SHOWN..] {
                rest.queued += t.queued;
                rest.leased += t.leased;
                rest.dead += t.dead;
                rest.latency_ms = rest.latency_ms.max(t.latency_ms);
            }
            shown.push(("(other topics)".into(), rest));
        }
        json!({
            "at_ms": self.at_ms,
            "took_ms": self.took_ms,
            "tasks": self.tasks,
            "topics": shown.iter().map(|(name, t)| json!({
                "topic": name,
                "queued": t.queued,
                "leased": t.leased,
                "dead": t.dead,
                "latency_ms": t.latency_ms,
            })).collect::<Vec<_>>(),
        })
    }
}

/// One pass: every queued, leased and dead task, at most `rate` a second.
async fn pass(p: &Producer, rate: u64) -> Result<Census, QueueError> {
    let started = Instant::now();
    let mut census = Census {
        at_ms: now_ms(),
        ..Census::default()
    };
    for state in [ListState::Scheduled, ListState::Leased, ListState::Dead] {
        let mut cursor = ListCursor::START;
        loop {
            let page = p.list(state, &cursor, PAGE).await?;
            let now = now_ms();
            for task in &page.tasks {
                let topic = task
                    .envelope
                    .as_ref()
                    .map_or_else(|| "(undecodable)".to_string(), |e| e.topic.to_string());
                let t = census.topics.entry(topic).or_default();
                match state {
                    ListState::Scheduled => {
                        t.queued += 1;
                        if let Some(due) = task.due_at.filter(|&d| d <= now) {
                            t.latency_ms = t.latency_ms.max(now - due);
                        }
                    }
                    ListState::Leased => t.leased += 1,
                    _ => t.dead += 1,
                }
            }
            census.tasks += page.tasks.len() as u64;
            // Paced: the pass reads at most `rate` tasks a second.
            let owed = Duration::from_secs_f64(census.tasks as f64 / rate as f64);
            if let Some(wait) = owed.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
    }
    census.took_ms = started.elapsed().as_millis() as u64;
    Ok(census)
}

/// Counts the queue again and again, `every` apart, keeping the last complete pass in `last`.
/// A failed pass (Redis away) is logged once per failure and tried again after `every`.
pub(crate) async fn run(
    p: Arc<Producer>,
    rate: u64,
    every: Duration,
    last: Arc<Mutex<Option<Census>>>,
) {
    loop {
        match pass(&p, rate).await {
            Ok(c) => *last.lock() = Some(c),
            Err(e) => eprintln!("delaywheel: the census of topics failed (tried again): {e}"),
        }
        tokio::time::sleep(every).await;
    }
}
