//! The consumer's metrics per topic: handles registered once, at start, for every topic a
//! handler is registered for and one `unknown` label for every other topic, so that the label
//! set is bounded and counting an outcome allocates nothing.

use std::collections::HashMap;
use std::time::Duration;

use metrics::{Counter, Histogram};

/// The label of every topic no handler is registered for.
pub(super) const UNKNOWN_TOPIC: &str = "unknown";

/// One topic's series.
pub(super) struct TopicMetrics {
    processed: Counter,
    failed: Counter,
    retried: Counter,
    dead_lettered: Counter,
    duration: Histogram,
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
        } else {
            self.failed.increment(1);
        }
    }

    pub(super) fn retried(&self) {
        self.retried.increment(1);
    }

    pub(super) fn dead_lettered(&self) {
        self.dead_lettered.increment(1);
    }
}

/// Every topic's series, and the `unknown` one.
pub(super) struct ByTopic {
    known: HashMap<String, TopicMetrics>,
    unknown: TopicMetrics,
}

impl ByTopic {
    pub(super) fn register<'a>(
        namespace: &str,
        topics: impl IntoIterator<Item = &'a str>,
    ) -> ByTopic {
        ByTopic {
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
}
