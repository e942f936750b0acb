//! [`TopicLimit`]: a rate limit and a concurrency cap on one topic's handlers, held across
//! every consumer of a queue, and the names of the keys that hold them.

use std::time::Duration;

/// Limits on one topic's handlers, across every consumer of the queue: at most
/// [`rate`](Self::rate) starts per period, and at most [`concurrency`](Self::concurrency)
/// running at once. Set them with [`QueueConfig::limit`](crate::redis::QueueConfig::limit);
/// every consumer of the namespace is to be given the same limits (each call to Redis carries
/// the limit of the consumer making it).
///
/// ```
/// use std::time::Duration;
/// use delaywheel::redis::{QueueConfig, TopicLimit};
///
/// // At most 100 SMS a second in total, and at most 3 sent at once.
/// let cfg = QueueConfig::new("redis://127.0.0.1/", "notify").limit(
///     "sms",
///     TopicLimit::new()
///         .rate(100, Duration::from_secs(1))
///         .concurrency(3),
/// );
/// assert_eq!(cfg.limits["sms"].burst(), 10);
/// ```
///
/// A task that fires without a permit stays in its consumer's wheel, still leased to it (its
/// lease renewed), and fires again as soon as it has one; it is neither handed back nor
/// counted as a failure. Waiting tasks count against
/// [`max_held`](crate::redis::QueueConfig::max_held); past [`max_waiting`](Self::max_waiting)
/// of them, a consumer hands the newest back to the queue (down to three quarters of it, in
/// one call), due when the limit would let them run and at least a second later, so that a
/// throttled topic does not fill the room other topics' tasks need.
///
/// **Rate.** Starts are spaced by a GCRA on Redis's clock (one key per topic): any window of
/// one period holds at most `limit + burst` starts, where the burst is a tenth of the limit
/// (at least 1). Consumers book slots in batches, up to [`HORIZON`](Self::HORIZON) ahead, for the tasks
/// they hold that are about to be due: at a limit that does not bind, a task fires at its due
/// time and the limiter costs a call per batch.
///
/// **Concurrency.** Slots are members of a ZSET per topic, each leased like a task (renewed
/// every `lease / 3`): a consumer that crashes while holding slots loses them after
/// [`lease`](crate::redis::QueueConfig::lease). A consumer keeps a slot for its next waiting
/// task of the topic, and gives it back once none waits, or once it has kept it for
/// [`SLOT_TURN`](Self::SLOT_TURN), so that the other consumers get their turn.
///
/// On a sharded queue, and on a Redis Cluster, each topic's limiter keys live in a slot of
/// their own (`{ns:limit:topic}:rate`, `{ns:limit:topic}:running`): a limiter call is a call
/// of its own, never part of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TopicLimit {
    /// At most this many starts per period, fleet-wide (with the burst, see
    /// [`burst`](Self::burst)).
    pub rate: Option<(u32, Duration)>,
    /// At most this many handlers running at once, fleet-wide.
    pub concurrency: Option<u32>,
    /// Tasks of the topic a consumer keeps waiting for a permit, at most (default 1 000);
    /// the newest past that go back to the queue.
    pub max_waiting: usize,
}

impl TopicLimit {
    /// How far ahead a consumer books rate slots: at a limit that binds, the slots one
    /// consumer takes in one call reach at most this far ahead.
    pub const HORIZON: Duration = Duration::from_millis(250);

    /// How long a consumer keeps a concurrency slot for its own waiting tasks before it gives
    /// the slot back for any consumer to take.
    pub const SLOT_TURN: Duration = Duration::from_millis(500);

    /// No limit yet; add [`rate`](Self::rate), [`concurrency`](Self::concurrency) or both.
    pub fn new() -> TopicLimit {
        TopicLimit {
            rate: None,
            concurrency: None,
            max_waiting: 1_000,
        }
    }

    /// At most `limit` starts per `per` (with the burst). Checked when the consumer starts:
    /// `limit` 0, or `per` zero or over a day, is [`QueueError::Config`](crate::redis::QueueError::Config).
    pub fn rate(mut self, limit: u32, per: Duration) -> TopicLimit {
        self.rate = Some((limit, per));
        self
    }

    /// At most `max` handlers at once. Checked when the consumer starts: 0 is
    /// [`QueueError::Config`](crate::redis::QueueError::Config).
    pub fn concurrency(mut self, max: u32) -> TopicLimit {
        self.concurrency = Some(max);
        self
    }

    /// Waiting tasks a consumer keeps, at most (checked when the consumer starts: 0 is
    /// [`QueueError::Config`](crate::redis::QueueError::Config)).
    pub fn max_waiting(mut self, n: usize) -> TopicLimit {
        self.max_waiting = n;
        self
    }

    /// The burst a rate limit allows on top of its limit in any window of one period: a tenth
    /// of the limit, at least 1 (0 without a rate limit).
    pub fn burst(&self) -> u32 {
        self.rate.map_or(0, |(limit, _)| (limit / 10).max(1))
    }

    /// The time between two starts at the limit, in ms.
    pub(crate) fn interval_ms(&self) -> Option<f64> {
        self.rate
            .map(|(limit, per)| per.as_secs_f64() * 1e3 / f64::from(limit.max(1)))
    }

    /// How much earlier than the even spacing a start may come (the burst), in ms.
    pub(crate) fn tolerance_ms(&self) -> f64 {
        self.interval_ms()
            .map_or(0.0, |i| i * f64::from(self.burst().saturating_sub(1)))
    }

    /// Checks the limit of `topic`; the error names what is wrong.
    pub(crate) fn check(&self) -> Result<(), &'static str> {
        if let Some((limit, per)) = self.rate {
            if limit == 0 || per.is_zero() || per > Duration::from_secs(86_400) {
                return Err("a rate limit needs a limit of at least 1 and a period in (0, 1 day]");
            }
        }
        if self.concurrency == Some(0) {
            return Err("a concurrency cap must be at least 1");
        }
        if self.max_waiting == 0 {
            return Err("max_waiting must be at least 1");
        }
        Ok(())
    }
}

/// The keys of `topic`'s limiter in namespace `ns`: its GCRA state and its concurrency slots.
/// They share a hash tag of their own, apart from every shard's.
pub(crate) fn limit_keys(ns: &str, topic: &str) -> (String, String) {
    (
        format!("{{{ns}:limit:{topic}}}:rate"),
        format!("{{{ns}:limit:{topic}}}:running"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_burst_is_a_tenth_of_the_limit_and_at_least_one() {
        let l = TopicLimit::new().rate(100, Duration::from_secs(1));
        assert_eq!(l.burst(), 10);
        assert_eq!(l.interval_ms(), Some(10.0));
        assert_eq!(l.tolerance_ms(), 90.0);
        assert_eq!(TopicLimit::new().rate(5, Duration::from_secs(1)).burst(), 1);
        assert_eq!(TopicLimit::new().concurrency(3).burst(), 0);
    }

    #[test]
    fn bad_limits_are_refused() {
        let s = Duration::from_secs(1);
        assert!(TopicLimit::new().rate(0, s).check().is_err());
        assert!(TopicLimit::new().rate(1, Duration::ZERO).check().is_err());
        assert!(TopicLimit::new().concurrency(0).check().is_err());
        assert!(TopicLimit::new().max_waiting(0).check().is_err());
        assert!(TopicLimit::new().rate(1, s).concurrency(1).check().is_ok());
    }

    #[test]
    fn both_keys_of_a_topic_share_one_hash_tag() {
        let (rate, running) = limit_keys("q", "sms");
        assert_eq!(rate, "{q:limit:sms}:rate");
        assert_eq!(running, "{q:limit:sms}:running");
    }
}
