//! [`Producer`]: the producer side of the shared queue (enqueue, cancel, the dead-letter
//! store, the depth).

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use crate::redis::envelope::Envelope;
use crate::redis::layout::KeyLayout;
use crate::redis::payload::{new_task, IntoPayload};
use crate::redis::queue::config::{shard_of, QueueConfig, QueueError};
use crate::redis::queue::conn::{sample_depth, Conn, QueueDepth};
use crate::redis::queue::dead_letters::{parse_dead, DeadTask};
use crate::redis::queue::scripts;
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::{now_ms, WallClock};
use crate::redis::when::When;

/// Enqueues and cancels tasks, and manages the dead-letter store. Cheap to clone.
#[derive(Clone)]
pub struct Producer {
    pub(super) cfg: Arc<QueueConfig>,
    pub(super) shards: Arc<Vec<KeyLayout>>,
    pub(super) conn: Conn,
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("namespace", &self.cfg.namespace)
            .field("shards", &self.cfg.shards)
            .finish()
    }
}

impl Producer {
    /// The Lua text of the script [`enqueue`](Self::enqueue) runs, for producers in other
    /// languages: load it (`SCRIPT LOAD`) and call it with `EVALSHA`, or send it with `EVAL`.
    /// See the [key layout](crate::redis#producers-in-other-languages) for its keys and arguments.
    pub const ENQUEUE_SCRIPT: &'static str = scripts::ENQUEUE_LUA;

    /// Connects. Errors: a bad setting or namespace, a namespace a `Persistent` engine uses
    /// ([`QueueError::InUse`]), an unreachable Redis, or a call outside a Tokio runtime or
    /// on one without its time or I/O driver (`enable_all` enables both).
    pub async fn connect(cfg: QueueConfig) -> Result<Producer, QueueError> {
        let shards = cfg.check()?;
        let conn = Conn::open(&cfg, &shards).await?;
        Ok(Producer {
            cfg: Arc::new(cfg),
            shards: Arc::new(shards),
            conn,
        })
    }

    /// Connects to a queue that exists: as [`connect`](Self::connect), but a namespace no
    /// queue has used is refused with [`QueueError::UnknownNamespace`] instead of becoming a
    /// new, empty queue, and nothing is written to it. For operators' tools, where a mistyped
    /// namespace or shard count must say so.
    pub async fn connect_existing(cfg: QueueConfig) -> Result<Producer, QueueError> {
        let shards = cfg.check()?;
        let conn = Conn::open_existing(&cfg, &shards).await?;
        Ok(Producer {
            cfg: Arc::new(cfg),
            shards: Arc::new(shards),
            conn,
        })
    }

    pub(super) fn keys(&self, id: &str) -> &KeyLayout {
        &self.shards[shard_of(id, self.cfg.shards) as usize]
    }

    /// Enqueues task `id` for `topic` at `when` (a [`When`], a `Duration` from now, or a
    /// `SystemTime`). The payload is a reference to any `Serialize` type, or a
    /// `serde_json::Value` (see [`IntoPayload`]); a handler reads it back with
    /// [`Envelope::payload_as`] or [`Handlers::on_typed`](crate::redis::Handlers::on_typed).
    /// Idempotent by id: if `id` is already queued
    /// (or claimed), nothing changes and `Ok(false)` is returned. An envelope stored under
    /// `id` with no queue entry (another client's, half written or left behind) does not
    /// count: it is written over. Errors hand the envelope back (a payload that does not
    /// serialize: [`EnvelopeError::Encode`](crate::redis::EnvelopeError::Encode), the envelope's payload `null`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig};
    ///
    /// #[derive(serde::Serialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-enqueue")).await?;
    /// # producer.cancel("order:42").await?;
    /// let close = CloseOrder { order_id: 42 };
    /// assert!(producer.enqueue("order:42", "order.close", &close, Duration::from_secs(30 * 60)).await?);
    /// // The same id again changes nothing.
    /// assert!(!producer.enqueue("order:42", "order.close", &close, Duration::from_secs(60)).await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue(
        &self,
        id: impl Into<String>,
        topic: impl Into<std::borrow::Cow<'static, str>>,
        payload: impl IntoPayload,
        when: impl Into<When>,
    ) -> Result<bool, QueueError> {
        let due_at = when.into().due_ms(&WallClock::system());
        match new_task(id.into(), topic.into(), payload, now_ms(), due_at) {
            Ok(envelope) => self.enqueue_envelope(envelope, false).await,
            Err((e, envelope)) => Err(QueueError::Envelope(e, envelope)),
        }
    }

    /// Enqueues a complete envelope. With `replace`, a pending task of the same id is replaced
    /// (a consumer that had claimed it can no longer ack it); without, it is kept and
    /// `Ok(false)` is returned. Errors hand the envelope back: [`QueueError::Envelope`] for one
    /// that breaks a limit, [`QueueError::NotEnqueued`] when Redis fails.
    pub async fn enqueue_envelope(
        &self,
        envelope: Envelope,
        replace: bool,
    ) -> Result<bool, QueueError> {
        let bytes = match envelope.encode(self.cfg.max_envelope) {
            Ok(b) => b,
            Err(e) => return Err(QueueError::Envelope(e, Box::new(envelope))),
        };
        let shard = shard_of(&envelope.id, self.cfg.shards);
        let keys = &self.shards[shard as usize];
        let notify_before = self.cfg.notify_before();
        let wake = format!("{}{}", envelope.due_at, self.cfg.wake_suffix(shard));
        let mut inv = scripts::ENQUEUE.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .arg(envelope.id.as_str())
            .arg(envelope.due_at)
            .arg(bytes)
            .arg(u8::from(replace))
            .arg(self.cfg.channel())
            .arg(notify_before)
            .arg(wake);
        match self.conn.run::<i64>(&inv).await {
            Ok(n) => Ok(n == 1),
            Err(e) => Err(QueueError::NotEnqueued(e.into(), Box::new(envelope))),
        }
    }

    /// Enqueues many envelopes at once: one script call per shard and up to
    /// [`ENQUEUE_BATCH`](Self::ENQUEUE_BATCH) tasks, the calls sent together, and one
    /// wake-up per call instead of one per task. At high rates this is a fraction of the
    /// Redis work of as many [`enqueue_envelope`](Self::enqueue_envelope) calls.
    ///
    /// Returns one result per envelope, in the order given, each what
    /// [`enqueue_envelope`](Self::enqueue_envelope) would return for it: `Ok(true)` stored,
    /// `Ok(false)` its id was pending (without `replace`), [`QueueError::Envelope`] for one that
    /// breaks a limit (the others go on), [`QueueError::NotEnqueued`] for each task of a call
    /// Redis failed (each handed back; the call's tasks may be stored all the same if only the
    /// reply was lost, and enqueueing them again without `replace` is harmless). An id given
    /// twice is stored once; the second copy finds it pending (or replaces it).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use delaywheel::redis::{now_ms, Envelope, Producer, QueueConfig};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-enqueue-many")).await?;
    /// let due = now_ms() + 30 * 60 * 1_000;
    /// let tasks = (0..1_000).map(|i| Envelope {
    ///     id: format!("order:{i}"),
    ///     topic: "order.close".into(),
    ///     payload: serde_json::json!({ "order_id": i }),
    ///     attempt: 0,
    ///     created_at: now_ms(),
    ///     headers: Default::default(),
    ///     due_at: due,
    /// });
    /// let results = producer.enqueue_many(tasks, false).await;
    /// # for r in &results { if let Err(e) = r { panic!("{e:?}"); } }
    /// assert_eq!(results.len(), 1_000);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue_many(
        &self,
        envelopes: impl IntoIterator<Item = Envelope>,
        replace: bool,
    ) -> Vec<Result<bool, QueueError>> {
        let mut results: Vec<Option<Result<bool, QueueError>>> = Vec::new();
        // Per shard: (position in the results, encoded envelope, envelope).
        let mut by_shard: std::collections::HashMap<u32, Vec<(usize, Vec<u8>, Envelope)>> =
            std::collections::HashMap::new();
        for envelope in envelopes {
            let at = results.len();
            match envelope.encode(self.cfg.max_envelope) {
                Ok(bytes) => {
                    results.push(None);
                    let shard = shard_of(&envelope.id, self.cfg.shards);
                    by_shard
                        .entry(shard)
                        .or_default()
                        .push((at, bytes, envelope));
                }
                Err(e) => results.push(Some(Err(QueueError::Envelope(e, Box::new(envelope))))),
            }
        }
        // The shards at once, each shard's chunks one after another: an id given twice lands
        // in one shard, and its copies must reach Redis in the order given.
        let calls = by_shard.into_iter().map(|(shard, tasks)| async move {
            let mut replies = Vec::new();
            let mut tasks = tasks.into_iter().peekable();
            while tasks.peek().is_some() {
                let chunk: Vec<_> = tasks.by_ref().take(Self::ENQUEUE_BATCH).collect();
                let keys = &self.shards[shard as usize];
                let mut inv = scripts::ENQUEUE_MANY.prepare_invoke();
                inv.key(keys.due())
                    .key(keys.tasks())
                    .key(keys.lease())
                    .key(keys.owner())
                    .key(keys.expired())
                    .arg(u8::from(replace))
                    .arg(self.cfg.channel())
                    .arg(self.cfg.notify_before())
                    .arg(self.cfg.wake_suffix(shard));
                for (_, bytes, envelope) in &chunk {
                    inv.arg(envelope.id.as_str())
                        .arg(envelope.due_at)
                        .arg(bytes.as_slice());
                }
                let reply = self.conn.run::<Vec<i64>>(&inv).await;
                replies.push((chunk, reply));
            }
            replies
        });
        for (chunk, reply) in futures_util::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
        {
            match reply {
                Ok(stored) if stored.len() == chunk.len() => {
                    for ((at, _, _), n) in chunk.into_iter().zip(stored) {
                        results[at] = Some(Ok(n == 1));
                    }
                }
                Ok(stored) => {
                    let e = format!(
                        "enqueue_many: {} replies for {} tasks",
                        stored.len(),
                        chunk.len()
                    );
                    for (at, _, envelope) in chunk {
                        let err = StoreError::new(e.clone());
                        results[at] = Some(Err(QueueError::NotEnqueued(err, Box::new(envelope))));
                    }
                }
                Err(e) => {
                    let e = e.to_string();
                    for (at, _, envelope) in chunk {
                        let err = StoreError::new(e.clone());
                        results[at] = Some(Err(QueueError::NotEnqueued(err, Box::new(envelope))));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(QueueError::Config("enqueue_many lost a result"))))
            .collect()
    }

    /// The most tasks [`enqueue_many`](Self::enqueue_many) sends in one script call.
    pub const ENQUEUE_BATCH: usize = 256;

    /// Cancels task `id` whether queued or claimed; `Ok(false)` if it is not there. A
    /// consumer that already claimed it may still fire it (its ack is then refused): handlers
    /// that must not act on a cancelled task check their own state, as they would anyway
    /// under at-least-once delivery.
    pub async fn cancel(&self, id: &str) -> Result<bool, QueueError> {
        let keys = self.keys(id);
        let mut inv = scripts::CANCEL.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.expired())
            .arg(id);
        Ok(self.conn.run::<i64>(&inv).await? == 1)
    }

    /// Up to `limit` dead-lettered tasks, over all shards (a hash that changes meanwhile may
    /// list one twice). Ids and records that are not UTF-8 are listed lossily (U+FFFD).
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadTask>, QueueError> {
        let mut out = Vec::new();
        for keys in self.shards.iter() {
            // HSCAN's COUNT is a hint: a large hash answers a few entries per call, so follow
            // the cursor until the limit or the end.
            let mut cursor = 0u64;
            while out.len() < limit {
                let mut conn = self.conn.conn.clone();
                self.conn.count(1);
                // Bytes: an id or record another client wrote need not be UTF-8, and one such
                // entry must not fail the whole listing.
                let (next, flat): HscanPage = redis::cmd("HSCAN")
                    .arg(keys.dead())
                    .arg(cursor)
                    .arg("COUNT")
                    // A hint, capped: Redis refuses a COUNT past i64::MAX, and a huge one
                    // would walk the whole hash in one call while the server waits.
                    .arg((limit - out.len()).min(1_000))
                    .query_async(&mut conn)
                    .await?;
                let room = limit - out.len();
                out.extend(flat.into_iter().take(room).map(|(id, record)| {
                    let id = String::from_utf8_lossy(&id).into_owned();
                    parse_dead(id, &String::from_utf8_lossy(&record))
                }));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    /// Moves dead-lettered task `id` back to the queue, due now, with its attempts reset.
    /// `Ok(false)` if it is not dead-lettered; [`QueueError::NotAnEnvelope`] if what was
    /// dead-lettered is not a task envelope, [`QueueError::StillPending`] if a task with the
    /// same id was enqueued since (both leave everything as it is). The envelope goes back as
    /// it was stored, so `max_envelope` is not applied to it again. A task dead-lettered with
    /// no envelope (`no envelope in the tasks hash`) whose envelope was written since (by
    /// another client, too late) goes back with that envelope.
    pub async fn requeue(&self, id: &str) -> Result<bool, QueueError> {
        let keys = self.keys(id);
        let mut conn = self.conn.conn.clone();
        self.conn.count(1);
        // Bytes: a record need not be UTF-8 (the reaper copies a stored envelope as it is).
        let record: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(keys.dead())
            .arg(id)
            .query_async(&mut conn)
            .await?;
        let Some(record) = record else {
            return Ok(false);
        };
        let Ok(text) = std::str::from_utf8(&record) else {
            return Err(QueueError::NotAnEnvelope(id.to_string()));
        };
        let dead = parse_dead(id.to_string(), text);
        let mut envelope = Envelope::decode(dead.raw.as_bytes()).ok();
        if envelope.is_none() && dead.raw.is_empty() {
            // Dead-lettered with no envelope: one written since is the task's.
            self.conn.count(1);
            let stored: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(keys.tasks())
                .arg(id)
                .query_async(&mut conn)
                .await?;
            envelope = stored.and_then(|bytes| Envelope::decode(&bytes).ok());
        }
        // One stored under another id was dead-lettered for that: it is not this task.
        let Some(mut envelope) = envelope.filter(|e| e.id == id) else {
            return Err(QueueError::NotAnEnvelope(id.to_string()));
        };
        envelope.attempt = 0;
        envelope.due_at = now_ms();
        let bytes = envelope
            .encode(usize::MAX)
            .map_err(|e| QueueError::Envelope(e, Box::new(envelope.clone())))?;
        let mut inv = scripts::REQUEUE.prepare_invoke();
        inv.key(keys.dead())
            .key(keys.tasks())
            .key(keys.due())
            .key(keys.lease())
            .arg(id)
            .arg(bytes)
            .arg(envelope.due_at)
            .arg(self.cfg.channel())
            // Only the record read above: one dead-lettered again meanwhile stays.
            .arg(&record)
            .arg(self.cfg.wake_suffix(shard_of(id, self.cfg.shards)));
        match self.conn.run::<i64>(&inv).await? {
            1 => Ok(true),
            -1 => Err(QueueError::StillPending(id.to_string())),
            _ => Ok(false),
        }
    }

    /// Queued (not claimed), claimed, and dead-lettered tasks, over all shards.
    pub async fn depth(&self) -> Result<QueueDepth, QueueError> {
        let mut depth = QueueDepth::default();
        for keys in self.shards.iter() {
            let d = sample_depth(&self.conn, keys).await?;
            depth.queued += d.queued;
            depth.leased += d.leased;
            depth.dead += d.dead;
        }
        Ok(depth)
    }

    /// Commands this producer has sent.
    pub fn commands(&self) -> u64 {
        self.conn.commands.load(Relaxed)
    }
}

/// One HSCAN reply: the next cursor, then (field, value) pairs as stored.
pub(super) type HscanPage = (u64, Vec<(Vec<u8>, Vec<u8>)>);

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A delay is counted from the clock to the nanosecond and rounded up: with both rounded
    /// down to the ms, a task 1.9 ms out was due about 1 ms after the call, or at once.
    #[test]
    fn a_delay_never_makes_a_task_due_early() {
        use crate::redis::wall_clock::since_epoch;
        for delay_us in [1, 999, 1_000, 1_001, 1_900, 2_500_000] {
            let delay = Duration::from_micros(delay_us);
            let before = since_epoch();
            let due_ms = When::After(delay).due_ms(&WallClock::system());
            assert!(
                u128::from(due_ms) * 1_000_000 >= (before + delay).as_nanos(),
                "{delay:?} from {before:?} is due at {due_ms} ms"
            );
        }
        assert_eq!(
            When::After(Duration::MAX).due_ms(&WallClock::system()),
            u64::MAX
        );
    }
}
