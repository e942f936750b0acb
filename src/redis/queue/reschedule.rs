//! Moving a queued task: [`Producer::reschedule`] and [`Producer::promote`].

use crate::redis::envelope::MAX_DUE_MS;
use crate::redis::queue::config::{shard_of, QueueError};
use crate::redis::queue::producer::Producer;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::{now_ms, WallClock};
use crate::redis::when::When;

impl Producer {
    /// Moves queued task `id` to `when` (earlier or later), keeping its envelope: BullMQ's
    /// `changeDelay`. `Ok(false)` if `id` is not queued: unknown, dead-lettered, or claimed
    /// already. Consumers claim what is due within their
    /// [`lookahead`](crate::redis::QueueConfig::lookahead) (2 s by default), so a task that
    /// close to its due time is usually claimed, and fires from its consumer's wheel: cancel
    /// it, or enqueue it again with `replace`. A task moved before the consumers' next claim gets a wake-up, as a new
    /// one does. Errors: [`QueueError::DueTooLate`] for a time past
    /// [`MAX_DUE_MS`](crate::redis::MAX_DUE_MS), which changes nothing; Redis failed.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-reschedule")).await?;
    /// # producer.cancel("reminder:9").await?;
    /// producer.enqueue("reminder:9", "remind", serde_json::Value::Null, Duration::from_secs(3600)).await?;
    /// // The customer asked for it a day later.
    /// assert!(producer.reschedule("reminder:9", Duration::from_secs(86_400)).await?);
    /// assert!(!producer.reschedule("no such task", Duration::ZERO).await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn reschedule(&self, id: &str, when: impl Into<When>) -> Result<bool, QueueError> {
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
            .arg(id)
            .arg(due)
            .arg(self.cfg.channel())
            .arg(self.cfg.notify_before())
            .arg(format!("{due}{}", self.cfg.wake_suffix(shard)));
        Ok(self.conn.run::<i64>(&inv).await? == 1)
    }

    /// Makes queued task `id` due now, so that it fires at once: BullMQ's `promote`. As
    /// [`reschedule`](Self::reschedule) to now.
    pub async fn promote(&self, id: &str) -> Result<bool, QueueError> {
        self.reschedule(id, When::AtMs(now_ms())).await
    }
}
