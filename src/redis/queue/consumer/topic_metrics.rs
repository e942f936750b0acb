//! The consumer's metrics per topic: handles registered once, at start, for every topic a
//! handler is registered for and one `unknown` label for every other topic, so that the label
//! set is bounded and counting an outcome allocates nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use metrics::{Counter, Histogram};

/// The label of every topic no handler is registered for.
pub(super) const UNKNOWN_TOPIC: &str = "unknown";

/// One topic's series, and the same counts since they were last written to Redis's `stats`
/// hash (for dashboards, which read Redis, not this process).
pub(super) struct TopicMetrics {
    processed: Counter,
    failed: Counter,
    retried: Counter,
    dead_lettered: Counter,
    duration: Histogram,
    /// processed, failed, retried, dead-lettered, not yet written to Redis.
    unwritten: [AtomicU64; 4],
}

impl TopicMetrics {
    fn register(namespace: &str, topic: &str) -> TopicMetrics {
        let labels = [
            ("namespace", namespace.to_owned()),
            ("topic", topic.to_owned()),
        ];
        TopicMetrics {
            processed: metrics::counter!("delaywheel_queue_processed_total", &labels),
            failed: metrics::counter!("delaywheel_queue_failed_total", &labels),
            retried: metrics::counter!("delaywheel_queue_retried_total", &labels),
            dead_lettered: metrics::counter!("delaywheel_queue_dead_lettered_total", &labels),
            duration: metrics::histogram!("delaywheel_queue_handler_duration_seconds", &labels),
            unwritten: Default::default(),
        }
    }

    /// A handler ran for `took` (`None`: its future was dropped unfinished) and succeeded or
    /// failed; a failure then either retries or dead-letters.
    pub(super) fn ran(&self, took: Option<Duration>, ok: bool) {
        if let Some(took) = took {
            self.duration.record(took.as_secs_f64());
        }
        if ok {
            self.processed.increment(1);
            self.unwritten[0].fetch_add(1, Relaxed);
        } else {
            self.failed.increment(1);
            self.unwritten[1].fetch_add(1, Relaxed);
        }
    }

    pub(super) fn retried(&self) {
        self.retried.increment(1);
        self.unwritten[2].fetch_add(1, Relaxed);
    }

    pub(super) fn dead_lettered(&self) {
        self.dead_lettered.increment(1);
        self.unwritten[3].fetch_add(1, Relaxed);
    }

    /// The counts since the last call, taken (zeroed).
    fn take(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.unwritten[i].swap(0, Relaxed))
    }

    /// Gives back counts that could not be written.
    fn put_back(&self, counts: [u64; 4]) {
        for (i, n) in counts.into_iter().enumerate() {
            self.unwritten[i].fetch_add(n, Relaxed);
        }
    }
}

/// Every topic's series, and the `unknown` one; and per shard, the handlers that succeeded
/// and failed since the counts were last written.
pub(super) struct ByTopic {
    known: HashMap<String, TopicMetrics>,
    unknown: TopicMetrics,
    by_shard: Vec<[AtomicU64; 2]>,
}

impl ByTopic {
    pub(super) fn register<'a>(
        namespace: &str,
        topics: impl IntoIterator<Item = &'a str>,
        shards: u32,
    ) -> ByTopic {
        ByTopic {
            by_shard: (0..shards).map(|_| Default::default()).collect(),
            known: topics
                .into_iter()
                .map(|t| (t.to_owned(), TopicMetrics::register(namespace, t)))
                .collect(),
            unknown: TopicMetrics::register(namespace, UNKNOWN_TOPIC),
        }
    }

    /// The series of `topic`, or the `unknown` ones.
    pub(super) fn of(&self, topic: &str) -> &TopicMetrics {
        self.known.get(topic).unwrap_or(&self.unknown)
    }

    /// A handler of a task of `shard` succeeded (`ok`) or failed.
    pub(super) fn shard_ran(&self, shard: u32, ok: bool) {
        if let Some(counts) = self.by_shard.get(shard as usize) {
            counts[usize::from(!ok)].fetch_add(1, Relaxed);
        }
    }

    fn all(&self) -> impl Iterator<Item = (&str, &TopicMetrics)> {
        self.known
            .iter()
            .map(|(t, m)| (t.as_str(), m))
            .chain(std::iter::once((UNKNOWN_TOPIC, &self.unknown)))
    }

    /// Adds the counts since the last call to the queue's `stats` hash (`topic|processed`,
    /// `topic|failed`, `topic|retried`, `topic|dead_lettered`, and per shard
    /// `shard:<i>:processed`, `shard:<i>:failed`, which no topic's field can be: they have no
    /// `|`): one script call adding every
    /// count that moved, none if nothing moved. Counts are kept for the next call only when
    /// the call surely did not run; one that may have run (its reply lost) is not sent again,
    /// so a count is never added twice (it may be lost: the dashboards' figures are a lower
    /// bound then, the metrics exact).
    pub(super) async fn write(&self, conn: &crate::redis::queue::conn::Conn, key: &str) {
        const FIELDS: [&str; 4] = ["processed", "failed", "retried", "dead_lettered"];
        let taken: Vec<(&TopicMetrics, [u64; 4])> =
            self.all().map(|(_, m)| (m, m.take())).collect();
        let mut inv = crate::redis::queue::scripts::TOPIC_COUNTS.prepare_invoke();
        inv.key(key);
        let mut n = 0;
        for ((topic, _), (_, counts)) in self.all().zip(&taken) {
            for (field, count) in FIELDS.iter().zip(counts) {
                if *count > 0 {
                    inv.arg(format!("{topic}|{field}")).arg(*count);
                    n += 1;
                }
            }
        }
        let by_shard: Vec<[u64; 2]> = self
            .by_shard
            .iter()
            .map(|c| [c[0].swap(0, Relaxed), c[1].swap(0, Relaxed)])
            .collect();
        for (i, counts) in by_shard.iter().enumerate() {
            for (field, count) in ["processed", "failed"].iter().zip(counts) {
                if *count > 0 {
                    inv.arg(format!("shard:{i}:{field}")).arg(*count);
                    n += 1;
                }
            }
        }
        if n == 0 {
            return;
        }
        if let Err(e) = conn.run::<i64>(&inv).await {
            if crate::redis::link::may_have_run(&e) {
                tracing::debug!(error = %e, "the topic counts may not have been written; not sent again");
            } else {
                tracing::debug!(error = %e, "could not write the topic counts; kept for the next round");
                for (m, counts) in taken {
                    m.put_back(counts);
                }
                for (c, counts) in self.by_shard.iter().zip(by_shard) {
                    c[0].fetch_add(counts[0], Relaxed);
                    c[1].fetch_add(counts[1], Relaxed);
                }
            }
        }
    }
}
