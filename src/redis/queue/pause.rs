//! Pausing a queue: [`Producer::pause`], [`Producer::resume`], [`Producer::is_paused`].

use crate::redis::queue::config::QueueError;
use crate::redis::queue::producer::Producer;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;

impl Producer {
    /// Stops every consumer of the namespace from claiming, for an incident or a deploy of a
    /// downstream system. One write per shard (each shard's `paused` key lives in its own hash
    /// slot, so a queue of N shards on a Redis Cluster takes N writes); idempotent.
    ///
    /// * New claims stop at once: a claim that finds the key leases nothing, on a consumer
    ///   started before the pause or during it.
    /// * Tasks claimed before the pause still fire: at most those due within
    ///   [`QueueConfig::lookahead`](crate::redis::QueueConfig::lookahead) of the last claim,
    ///   so the pause holds everything due more than `lookahead` after it.
    /// * Enqueue, cancel, requeue and the reaper go on: a lease that runs out puts its task
    ///   back in the queue, where it waits for the resume.
    ///
    /// The consumers' gauge `delaywheel_queue_paused{namespace, shard}` is 1 while their claims
    /// find the queue paused. Errors: Redis failed, and some shards may be paused (call it
    /// again, or [`resume`](Self::resume)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use delaywheel::redis::{Producer, QueueConfig};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-pause")).await?;
    /// producer.pause().await?;
    /// assert!(producer.is_paused().await?);
    /// assert!(producer.resume().await?); // the consumers claim again at once
    /// assert!(!producer.is_paused().await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pause(&self) -> Result<(), QueueError> {
        let by = format!("paused at {} ms", now_ms());
        for keys in self.shards.iter() {
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let () = redis::cmd("SET")
                .arg(keys.paused())
                .arg(&by)
                .query_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    /// Lifts a [`pause`](Self::pause) and wakes every consumer at once (by the wake-up
    /// channel, not after a reconcile): tasks due while paused fire right after. `Ok(true)`
    /// if any shard was paused. Errors: Redis failed, and some shards may still be paused
    /// (call it again).
    pub async fn resume(&self) -> Result<bool, QueueError> {
        let mut any = false;
        let now = now_ms();
        for (shard, keys) in self.shards.iter().enumerate() {
            let mut inv = scripts::RESUME.prepare_invoke();
            inv.key(keys.paused())
                .arg(self.cfg.channel())
                .arg(format!("{now}{}", self.cfg.wake_suffix(shard as u32)));
            any |= self.conn.run::<i64>(&inv).await? == 1;
        }
        Ok(any)
    }

    /// Whether any shard of the queue is paused.
    pub async fn is_paused(&self) -> Result<bool, QueueError> {
        for keys in self.shards.iter() {
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let n: i64 = redis::cmd("EXISTS")
                .arg(keys.paused())
                .query_async(&mut conn)
                .await?;
            if n == 1 {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
