//! Moving a queued task: [`Producer::reschedule`] and [`Producer::promote`].

use crate::redis::envelope::MAX_DUE_MS;
use crate::redis::queue::config::{shard_of, QueueError};
use crate::redis::queue::producer::Producer;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::{now_ms, WallClock};
use crate::redis::when::When;

/// What [`Producer::reschedule`] found, and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rescheduled {
    /// It was queued: it is due at the new time now.
    Queued,
    /// It was claimed: taken back from its consumer as [`enqueue_envelope`] with `replace`
    /// takes a claimed task. It is queued at the new time, its lease and lease-expiry count
    /// gone; the consumer that held it may still fire it (delivery is at-least-once), and its
    /// ack is refused.
    ///
    /// [`enqueue_envelope`]: Producer::enqueue_envelope
    Leased,
    /// It is dead-lettered: nothing changed ([`requeue`](Producer::requeue) brings it back).
    Dead,
    /// The queue does not know it: nothing changed.
    NotFound,
}

impl Rescheduled {
    /// Whether the task was moved (it was queued or claimed).
    pub fn moved(self) -> bool {
        matches!(self, Rescheduled::Queued | Rescheduled::Leased)
    }
}

impl Producer {
    /// Moves task `id` to `when` (earlier or later), keeping its envelope (payload, attempt,
    /// headers): BullMQ's `changeDelay`. Returns the state it found it in: a queued task is
    /// moved; a claimed one follows the rule of [`enqueue_envelope`](Self::enqueue_envelope)
    /// with `replace` (see [`Rescheduled::Leased`]); a dead-lettered or unknown one is left as
    /// it is. Consumers claim what is due within their
    /// [`lookahead`](crate::redis::QueueConfig::lookahead) (2 s by default), so a task that
    /// close to its due time is usually claimed. A task moved before the consumers' next
    /// claim gets a wake-up, as a new one does. Errors: [`QueueError::DueTooLate`] for a time
    /// past [`MAX_DUE_MS`](crate::redis::MAX_DUE_MS), which changes nothing; Redis failed.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig, Rescheduled};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-reschedule")).await?;
    /// # producer.cancel("reminder:9").await?;
    /// producer.enqueue("reminder:9", "remind", serde_json::Value::Null, Duration::from_secs(3600)).await?;
    /// // The customer asked for it a day later.
    /// let found = producer.reschedule("reminder:9", Duration::from_secs(86_400)).await?;
    /// assert_eq!(found, Rescheduled::Queued);
    /// assert_eq!(producer.promote("no such task").await?, Rescheduled::NotFound);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn reschedule(
        &self,
        id: &str,
        when: impl Into<When>,
    ) -> Result<Rescheduled, QueueError> {
        let due = when.into().due_ms(&WallClock::system());
        if due > MAX_DUE_MS {
            return Err(QueueError::DueTooLate {
                id: id.to_owned(),
                due,
            });
        }
        let shard = shard_of(id, self.cfg.shards);
        let keys = &self.shards[shard as usize];
        let mut inv = scripts::RESCHEDULE.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .key(keys.dead())
            .arg(id)
            .arg(due)
            .arg(self.cfg.channel())
            .arg(self.cfg.notify_before())
            .arg(format!("{due}{}", self.cfg.wake_suffix(shard)));
        Ok(match self.conn.run::<String>(&inv).await?.as_str() {
            "queued" => Rescheduled::Queued,
            "leased" => Rescheduled::Leased,
            "dead" => Rescheduled::Dead,
            _ => Rescheduled::NotFound,
        })
    }

    /// Makes task `id` due now, so that it fires at once: BullMQ's `promote`. As
    /// [`reschedule`](Self::reschedule) to now.
    pub async fn promote(&self, id: &str) -> Result<Rescheduled, QueueError> {
        self.reschedule(id, When::AtMs(now_ms())).await
    }
}
