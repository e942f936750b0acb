//! Uniqueness for a window after completion: [`Producer::enqueue_unique`].

use std::borrow::Cow;
use std::time::Duration;

use crate::redis::envelope::Envelope;
use crate::redis::payload::{new_task, IntoPayload};
use crate::redis::queue::config::{shard_of, QueueError};
use crate::redis::queue::producer::Producer;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::{now_ms, WallClock};
use crate::redis::when::When;

/// The header that carries a task's unique window (ms) from the producer to the consumer's
/// ack, which sets the id's marker for that long.
pub(crate) const UNIQUE_HEADER: &str = "delaywheel-unique-ms";

/// The longest unique window: a year.
pub const MAX_UNIQUE_WINDOW: Duration = Duration::from_secs(365 * 86_400);

/// A task's unique window in ms, 0 for none (or an unreadable header), at most
/// [`MAX_UNIQUE_WINDOW`]: a longer one, which only another client can have written, counts as
/// that. (Redis refuses an expiry past its range, and the ack that carried it would fail with
/// every ack in its call, call after call.)
pub(crate) fn window_ms(envelope: &Envelope) -> u64 {
    let max = MAX_UNIQUE_WINDOW.as_millis() as u64;
    envelope
        .headers
        .get(UNIQUE_HEADER)
        .and_then(|w| w.parse::<u64>().ok())
        .map_or(0, |w| w.min(max))
}

/// What [`Producer::enqueue_unique`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unique {
    /// Stored: the task is queued.
    Stored,
    /// Not stored: a task with this id is queued or claimed.
    Pending,
    /// Not stored: a task with this id was acknowledged less than its window ago.
    RecentlyDone,
}

impl Producer {
    /// Enqueues task `id` as [`enqueue`](Self::enqueue) does, unique for `window` after it
    /// completes: once a handler has succeeded and the task is acknowledged, the same id is
    /// not stored again until `window` has passed ("at most one reminder per order per hour").
    /// The caller chooses what a refusal means from the answer: [`Unique::RecentlyDone`] or
    /// [`Unique::Pending`] (ignore it, or treat it as an error).
    ///
    /// * The window is kept in the envelope's headers (`delaywheel-unique-ms`); the consumer's
    ///   ack sets one marker key per id, expiring after the window, in the same script call
    ///   that removes the task; this call checks it in the same script that stores the task.
    /// * It starts at the acknowledgment. A task dead-lettered, cancelled or replaced sets no
    ///   marker: its id can be enqueued again at once (a dead letter is kept, and
    ///   [`requeue`](Self::requeue) brings it back as it is).
    /// * A plain [`enqueue`](Self::enqueue) does not check the marker.
    ///
    /// Errors: [`QueueError::Config`] for a zero window or one past [`MAX_UNIQUE_WINDOW`],
    /// and the errors of `enqueue`, which hand the envelope back.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig, Unique};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-unique")).await?;
    /// # producer.cancel("remind:order:42").await?;
    /// let hour = Duration::from_secs(3600);
    /// let first = producer
    ///     .enqueue_unique("remind:order:42", "remind", serde_json::Value::Null, Duration::from_secs(60), hour)
    ///     .await?;
    /// assert_eq!(first, Unique::Stored);
    /// let again = producer
    ///     .enqueue_unique("remind:order:42", "remind", serde_json::Value::Null, Duration::from_secs(60), hour)
    ///     .await?;
    /// assert_eq!(again, Unique::Pending); // queued already; after its ack, RecentlyDone for an hour
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue_unique(
        &self,
        id: impl Into<String>,
        topic: impl Into<Cow<'static, str>>,
        payload: impl IntoPayload,
        when: impl Into<When>,
        window: Duration,
    ) -> Result<Unique, QueueError> {
        if window < Duration::from_millis(1) || window > MAX_UNIQUE_WINDOW {
            return Err(QueueError::Config(
                "a unique window must be between 1 ms and MAX_UNIQUE_WINDOW",
            ));
        }
        let due_at = when.into().due_ms(&WallClock::system());
        let mut envelope = match new_task(id.into(), topic.into(), payload, now_ms(), due_at) {
            Ok(envelope) => envelope,
            Err((e, envelope)) => return Err(QueueError::Envelope(e, envelope)),
        };
        envelope
            .headers
            .insert(UNIQUE_HEADER.to_owned(), window.as_millis().to_string());
        let bytes = match envelope.encode(self.cfg.max_envelope) {
            Ok(b) => b,
            Err(e) => return Err(QueueError::Envelope(e, Box::new(envelope))),
        };
        let shard = shard_of(&envelope.id, self.cfg.shards);
        let keys = &self.shards[shard as usize];
        let mut inv = scripts::ENQUEUE.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .key(keys.unique_marker(&envelope.id))
            .arg(envelope.id.as_str())
            .arg(envelope.due_at)
            .arg(bytes)
            .arg(0u8)
            .arg(self.cfg.channel())
            .arg(self.cfg.notify_before())
            .arg(format!(
                "{}{}",
                envelope.due_at,
                self.cfg.wake_suffix(shard)
            ));
        match self.conn.run::<i64>(&inv).await {
            Ok(1) => Ok(Unique::Stored),
            Ok(2) => Ok(Unique::RecentlyDone),
            Ok(_) => Ok(Unique::Pending),
            Err(e) => Err(QueueError::NotEnqueued(e.into(), Box::new(envelope))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_window(header: &str) -> Envelope {
        let mut envelope = Envelope {
            id: "t".into(),
            topic: "t".into(),
            payload: serde_json::Value::Null,
            due_at: 0,
            attempt: 0,
            created_at: 0,
            headers: Default::default(),
        };
        envelope
            .headers
            .insert(UNIQUE_HEADER.to_string(), header.to_string());
        envelope
    }

    /// A window past the longest (only another client writes one) counts as the longest; one
    /// that does not read as a number, as none.
    #[test]
    fn a_window_header_reads_as_at_most_the_longest_window() {
        let max = MAX_UNIQUE_WINDOW.as_millis() as u64;
        assert_eq!(window_ms(&with_window("5000")), 5_000);
        assert_eq!(window_ms(&with_window(&max.to_string())), max);
        assert_eq!(window_ms(&with_window(&u64::MAX.to_string())), max);
        assert_eq!(window_ms(&with_window("soon")), 0);
        assert_eq!(window_ms(&with_window("-1")), 0);
    }
}
