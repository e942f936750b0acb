//! [`Consumer`]: starts the loops (claim, subscriber, handlers, outcomes, reaper, stall
//! watch), and stops them: `shutdown` hands back what it holds, `abort` drops it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use crate::redis::blocking::{wait_on, OwnedRuntime};
use crate::redis::queue::config::{QueueConfig, QueueError};
use crate::redis::queue::conn::Conn;
use crate::redis::store_error::StoreError;
use crate::Timer;

#[cfg(feature = "tokio")]
use super::async_pool::AsyncPool;
use super::claim::*;
use super::handlers::*;
use super::outcomes::*;
use super::reaper::*;
use super::registry::Handlers;
use super::shared::*;
use super::stall::*;
use super::subscriber::*;

/// A consumer of the shared queue. Start several, in one process or many. Delivery is
/// at-least-once: a claimed task is leased to one consumer, which fires it; it fires again
/// elsewhere if that consumer dies, stalls past its lease (with `renew_leases` off), its
/// handler threads are all stuck (below), or the task is enqueued again with `replace` while claimed
/// (the old copy's ack is then refused). A task cancelled by a producer while a consumer holds
/// it still fires there, at its old due time (its ack is then refused). Handlers are to be
/// idempotent ([`Dedup`](crate::redis::Dedup) helps).
///
/// A consumer whose handler threads are all stuck (each running one handler for
/// [`handler_stall`](crate::redis::QueueConfig::handler_stall), none finished) hands the tasks it
/// holds back to the queue and stops claiming until a thread is free: they fire elsewhere, on
/// time, rather than wait behind the stuck handlers. The stuck handlers' own tasks stay, their
/// leases renewed while they run.
/// An ack that Redis refuses with an error no retry gets past (`NOPERM`, `WRONGTYPE` on a key
/// another client wrote) is tried again for as long as the consumer lives.
pub struct Consumer {
    pub(super) shared: Arc<Shared>,
    pub(super) timer: Timer<Claimed>,
    pub(super) rt: Option<OwnedRuntime>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) loops: Vec<tokio::task::JoinHandle<()>>,
    pub(super) resolver: Option<tokio::task::JoinHandle<()>>,
    pub(super) finish: Option<tokio::sync::oneshot::Sender<()>>,
    /// The runtime `async` handlers run on, when the consumer started it.
    #[cfg(feature = "tokio")]
    pub(super) handler_rt: Option<OwnedRuntime>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("id", &self.shared.id)
            .field("namespace", &self.shared.cfg.namespace)
            .field("held", &self.shared.held.lock().len())
            .finish()
    }
}

impl Consumer {
    /// Connects, subscribes to wake-ups and starts claiming. Errors: a bad setting or
    /// namespace, a namespace a `Persistent` engine uses ([`QueueError::InUse`]), an
    /// unreachable Redis, no threads.
    pub fn start(cfg: QueueConfig, handlers: Handlers) -> Result<Consumer, QueueError> {
        let shards = cfg.check()?;
        // Owned so that an early return drops it safely, even from async code.
        let rt = OwnedRuntime::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("delaywheel-queue")
                .enable_all()
                .build()
                .map_err(|e| QueueError::Spawn(e.to_string()))?,
        );
        let (open_cfg, open_shards) = (cfg.clone(), shards.clone());
        let conn = wait_on(
            &rt,
            async move { Conn::open(&open_cfg, &open_shards).await },
        )
        .ok_or(QueueError::Spawn("the runtime stopped".into()))??;
        let id = cfg
            .consumer_id
            .clone()
            .unwrap_or_else(crate::redis::layout::instance_name);
        let mut claim_from = cfg
            .assigned_shards
            .clone()
            .unwrap_or_else(|| (0..cfg.shards).collect());
        // One claim loop per shard, however often it is listed.
        claim_from.sort_unstable();
        claim_from.dedup();
        let wakes = claim_from
            .iter()
            .map(|_| Wake {
                at: AtomicU64::new(u64::MAX),
                notify: tokio::sync::Notify::new(),
            })
            .collect();
        #[cfg(feature = "tokio")]
        let (async_pool, handler_rt) = async_handlers(&cfg, &handlers)?;
        let (out_tx, out_rx) = mpsc::channel(OUTCOME_BOUND);
        let shared = Arc::new(Shared {
            batch_name: format!("{id}:{:016x}", fastrand::u64(..)),
            id,
            shards,
            claim_from,
            conn,
            by_topic: super::topic_metrics::ByTopic::register(
                &cfg.namespace,
                handlers.map.keys().map(String::as_str),
                cfg.shards,
            ),
            handlers,
            held: Mutex::new(HashMap::new()),
            working: Mutex::new(HashMap::new()),
            outcomes: out_tx,
            wakes,
            failing: AtomicUsize::new(0),
            reserved: AtomicUsize::new(0),
            counters: Counters::default(),
            lateness: Mutex::new(
                Histogram::new_with_bounds(1, 3_600_000_000, 3)
                    .map_err(|e| QueueError::Spawn(e.to_string()))?,
            ),
            aborted: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            last_start_us: AtomicU64::new(0),
            started: std::time::Instant::now(),
            handing_back: Mutex::new(Vec::new()),
            limiter: super::gates::Limiter::new(&cfg),
            #[cfg(feature = "tokio")]
            async_pool,
            cfg,
        });
        let timer = {
            let shared = shared.clone();
            Timer::builder()
                .shards(1)
                .name(format!("queue:{}", shared.cfg.namespace))
                .build_callback(shared.cfg.handler_threads, 65_536, move |e| {
                    fire(&shared, e.value)
                })
                .map_err(|e| QueueError::Spawn(e.to_string()))?
        };
        let (stop, stop_rx) = watch::channel(false);
        // A claim loop per shard, so that a shard whose node is slow to answer delays no
        // other shard's claims.
        let mut loops: Vec<_> = (0..shared.claim_from.len())
            .map(|i| {
                rt.spawn(claim_loop(
                    shared.clone(),
                    timer.clone(),
                    stop_rx.clone(),
                    i,
                ))
            })
            .collect();
        loops.push(rt.spawn(listen(shared.clone(), stop_rx.clone())));
        loops.push(rt.spawn(stall_loop(shared.clone(), timer.clone(), stop_rx.clone())));
        if !shared.limiter.gates.is_empty() {
            loops.push(rt.spawn(super::limiter::limiter_loop(
                shared.clone(),
                timer.clone(),
                stop_rx.clone(),
            )));
        }
        // And a reaper per shard, for the same reason.
        loops.extend(
            (0..shared.claim_from.len())
                .map(|i| rt.spawn(reap_loop(shared.clone(), stop_rx.clone(), i))),
        );
        let (finish, finish_rx) = tokio::sync::oneshot::channel();
        let resolver = rt.spawn(resolve(shared.clone(), out_rx, finish_rx));
        tracing::debug!(consumer = %shared.id, "queue consumer started");
        Ok(Consumer {
            shared,
            timer,
            rt: Some(rt),
            stop,
            loops,
            resolver: Some(resolver),
            finish: Some(finish),
            #[cfg(feature = "tokio")]
            handler_rt,
        })
    }

    /// This consumer's name in leases.
    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// Claimed tasks not yet started: waiting in the wheel, or fired and waiting for a handler
    /// thread. (A claim answered again after its reply was lost can take it past `max_held`
    /// by one batch.)
    pub fn held(&self) -> usize {
        self.shared.held.lock().len()
    }

    /// A snapshot of the counters and the lateness percentiles.
    pub fn stats(&self) -> QueueStats {
        let c = &self.shared.counters;
        let h = self.shared.lateness.lock();
        QueueStats {
            claims: c.claims.load(Relaxed),
            claimed: c.claimed.load(Relaxed),
            fired: c.fired.load(Relaxed),
            acked: c.acked.load(Relaxed),
            refused: c.refused.load(Relaxed),
            retried: c.retried.load(Relaxed),
            dead_lettered: c.dead_lettered.load(Relaxed),
            recovered: c.recovered.load(Relaxed),
            given_back: c.given_back.load(Relaxed),
            renewed: c.renewed.load(Relaxed),
            commands: self.shared.conn.commands.load(Relaxed),
            lateness_p50_us: h.value_at_quantile(0.5),
            lateness_p99_us: h.value_at_quantile(0.99),
            lateness_max_us: h.max(),
        }
    }

    /// Stops claiming, hands every claimed task that has not fired back to the queue at once
    /// (another consumer fires it at its due time, without waiting for the lease), lets
    /// running and queued handlers finish within `timeout`, sends their acks, and stops. If
    /// the timeout passes first, queued handlers are not started (their tasks are handed back
    /// too), and the ones running finish on their own, unacknowledged: at-least-once,
    /// they run again elsewhere after the lease. It returns within about `timeout` even while
    /// Redis hangs: claim and reaper loops waiting on a node that does not answer are stopped
    /// after half of it, so the hand-back keeps the other half; each hand-back call (500 tasks)
    /// and the final acks get at least 100 ms,
    /// which a slow Redis and many held tasks can add to it. Returns how many tasks were
    /// handed back (fewer than were, if a call whose reply was lost was sent again: the second
    /// run finds its tasks already back); `Err` if Redis could not take them back in time, or
    /// could not take the acks and other outcomes of finished handlers (their leases expire and
    /// the reaper returns them instead). A `timeout` past what an `Instant` holds waits as
    /// long as it takes.
    ///
    /// Not from one of this consumer's own handlers: it waits for the handlers to finish, that
    /// one included, so it returns only at the timeout (never, with an unbounded one), and
    /// that handler's own task runs again after its lease. A claim whose reply was still out
    /// when the claim loops were stopped is not handed back: its tasks wait for their leases.
    pub fn shutdown(mut self, timeout: Duration) -> Result<usize, QueueError> {
        let now = std::time::Instant::now();
        let deadline = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        let _ = self.stop.send(true);
        let Some(rt) = self.rt.take() else {
            return Ok(0);
        };
        // The loops (two per shard) see `stop` between Redis calls; they are awaited together,
        // and those still waiting on a Redis that hangs are stopped halfway to the deadline
        // instead (the reply they wait for changes nothing that the lease and the reaper do not
        // repair), so that the hand-back below keeps the other half: one shard's hung node must
        // not use up the time the other shards need to give their tasks back.
        let loops: Vec<_> = self.loops.drain(..).collect();
        let aborts: Vec<_> = loops.iter().map(|l| l.abort_handle()).collect();
        let left = remaining(deadline) / 2;
        let all_done = wait_on(&rt, async move {
            tokio::time::timeout(left, futures_util::future::join_all(loops))
                .await
                .is_ok()
        });
        if all_done != Some(true) {
            // Those still waiting on Redis; aborting one that ended is a no-op.
            aborts.iter().for_each(tokio::task::AbortHandle::abort);
        }
        // Take every unfired task out of the wheel. Entries whose timer already fired stay:
        // their handlers run (or wait in the pool's queue) and settle them. What a stall
        // hand-back had not brought back yet goes too (a second hand-back of a task Redis took
        // finds another owner or none, and changes nothing).
        let mut back = std::mem::take(&mut *self.shared.handing_back.lock());
        let mut held = self.shared.held.lock();
        // Parked by the limiter (fired, waiting for a permit): out of the wheel, but held.
        for c in super::gates::take_parked(&self.shared.limiter) {
            let key = (c.shard, c.envelope.id.clone());
            if held
                .get(&key)
                .is_some_and(|(_, owner, _)| **owner == *c.owner)
            {
                held.remove(&key);
                back.push((c.shard, c.envelope.id, c.owner, c.envelope.due_at));
            }
        }
        held.retain(|(shard, id), (timer, owner, due)| {
            if self.timer.cancel(*timer).is_some() {
                back.push((*shard, id.clone(), owner.clone(), *due));
                false
            } else {
                true
            }
        });
        drop(held);
        let (mut given, mut failure) = self.give_back(&rt, back, deadline);
        // Handlers finish within the timeout; expirations the timer could not hand to them
        // come back from its shutdown and are handed back to the queue too.
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let timer = self.timer.clone();
        let stopping = std::thread::Builder::new()
            .name("delaywheel-queue-stop".into())
            .spawn(move || {
                let _ = done_tx.send(timer.shutdown());
            });
        let stopped = match stopping {
            Ok(_) => done_rx.recv_timeout(remaining(deadline)).ok(),
            Err(e) => {
                tracing::error!(error = %e, "no thread to stop the timer on");
                None
            }
        };
        match stopped {
            Some(undelivered) => {
                // `async` handlers' futures may still run: waited for until the deadline,
                // then dropped, their tasks handed back (below).
                #[cfg(feature = "tokio")]
                if let Some(pool) = &self.shared.async_pool {
                    if !pool.wait_idle(remaining(deadline)) {
                        self.shared.aborted.store(true, SeqCst);
                    }
                }
                let rest: Vec<_> = {
                    let mut held = self.shared.held.lock();
                    // And the tasks the limiter parked while the handlers finished (fired,
                    // no permit): held, out of the wheel.
                    let parked = super::gates::take_parked(&self.shared.limiter);
                    undelivered
                        .into_iter()
                        .map(|p| p.value)
                        .chain(parked)
                        .filter_map(|c| {
                            let key = (c.shard, c.envelope.id.clone());
                            if held
                                .get(&key)
                                .is_none_or(|(_, owner, _)| **owner != *c.owner)
                            {
                                return None;
                            }
                            let (_, owner, due) = held.remove(&key)?;
                            Some((c.shard, c.envelope.id, owner, due))
                        })
                        .collect()
                };
                let (g, f) = self.give_back(&rt, rest, deadline);
                given += g;
                failure = failure.or(f);
            }
            None => {
                // Handlers that have not started by now must not start: their acks could no
                // longer be sent, so they would run here and again after their lease. Those
                // still running finish (a thread cannot be stopped); their leases expire.
                self.shared.aborted.store(true, SeqCst);
                tracing::warn!(
                    consumer = %self.shared.id,
                    ?timeout,
                    "handlers still running at shutdown; their tasks' leases will expire"
                );
                // Fired tasks whose handlers had not started are still in `held` (a handler
                // takes its entry out when it starts): handed back, not left to their lease.
                // Whoever removes an entry owns it, so a handler starting meanwhile finds its
                // entry gone and does nothing.
                let waiting: Vec<_> = self
                    .shared
                    .held
                    .lock()
                    .drain()
                    .map(|((shard, id), (_, owner, due))| (shard, id, owner, due))
                    .collect();
                let (g, f) = self.give_back(&rt, waiting, deadline);
                given += g;
                failure = failure.or(f);
            }
        }
        // `async` handlers still running past the timeout: unlike a thread, a future can be
        // stopped, so it is dropped, and its task handed back at once rather than left to its
        // lease.
        #[cfg(feature = "tokio")]
        if let Some(pool) = &self.shared.async_pool {
            pool.close();
            if self.shared.aborted.load(SeqCst) {
                let running = pool.abort_running();
                if !running.is_empty() {
                    tracing::warn!(
                        consumer = %self.shared.id,
                        tasks = running.len(),
                        "async handlers still running at the shutdown timeout: dropped, their tasks handed back"
                    );
                }
                let (g, f) = self.give_back(&rt, running, deadline);
                given += g;
                failure = failure.or(f);
            }
        }
        self.shared
            .counters
            .given_back
            .fetch_add(given as u64, Relaxed);
        if let Some(f) = self.finish.take() {
            let _ = f.send(());
        }
        if let Some(r) = self.resolver.take() {
            let left = remaining(deadline).max(Duration::from_millis(100));
            let drained = wait_on(&rt, async move { tokio::time::timeout(left, r).await });
            // The topic counts of the handlers that finished during the shutdown.
            let shared = self.shared.clone();
            let left = remaining(deadline).max(Duration::from_millis(100));
            wait_on(&rt, async move {
                let key = shared.shards[0].stats();
                let _ = tokio::time::timeout(left, shared.by_topic.write(&shared.conn, key)).await;
            });
            // The concurrency slots, once no handler runs (else they end with their lease).
            if !self.shared.aborted.load(SeqCst) && self.shared.busy.load(SeqCst) == 0 {
                let shared = self.shared.clone();
                let left = remaining(deadline).max(Duration::from_millis(100));
                wait_on(&rt, async move {
                    let _ = tokio::time::timeout(left, super::limiter::release_all(&shared)).await;
                });
            }
            if !matches!(drained, Some(Ok(Ok(())))) {
                // Acks, retries or dead letters of finished handlers are dropped with the
                // runtime: their tasks run again after their leases. Said, not hidden.
                tracing::warn!(consumer = %self.shared.id, "outcomes of finished handlers not written before the shutdown timeout");
                failure = failure.or(Some(StoreError::new(
                    "the outcomes (acks, retries, dead letters) of finished handlers were not all \
                     written in time: their tasks run again after their leases",
                )));
            }
        }
        drop(rt);
        #[cfg(feature = "tokio")]
        drop(self.handler_rt.take());
        tracing::debug!(consumer = %self.shared.id, given_back = given, "queue consumer stopped");
        match failure {
            None => Ok(given),
            Some(e) => Err(QueueError::Store(e)),
        }
    }

    /// Hands claimed tasks back to the queue (see [`hand_back`]), waiting on `rt`.
    pub(super) fn give_back(
        &self,
        rt: &tokio::runtime::Runtime,
        tasks: Vec<HandBack>,
        deadline: std::time::Instant,
    ) -> (usize, Option<StoreError>) {
        let (given, failure) = wait_on(rt, hand_back(self.shared.clone(), tasks, deadline))
            .unwrap_or_else(|| (0, Some(StoreError::new("the runtime stopped"))));
        metrics::counter!("delaywheel_queue_given_back_total").increment(given as u64);
        (given, failure)
    }

    /// Stops at once, as a crash would: no hand-back, no acks sent, fired tasks not run, and
    /// nothing waited for (a stuck handler is left to finish on its own). Other consumers'
    /// reapers return its claimed tasks once their leases expire.
    pub fn abort(mut self) {
        self.halt();
    }

    pub(super) fn halt(&mut self) {
        self.shared.aborted.store(true, SeqCst);
        let _ = self.stop.send(true);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        // As a crash would: running futures stop, their tasks are left to their leases.
        #[cfg(feature = "tokio")]
        if let Some(pool) = &self.shared.async_pool {
            pool.close();
            drop(pool.abort_running());
        }
        #[cfg(feature = "tokio")]
        if let Some(rt) = self.handler_rt.take() {
            rt.shutdown_background();
        }
        let timer = self.timer.clone();
        let _ = std::thread::Builder::new()
            .name("delaywheel-queue-halt".into())
            .spawn(move || drop(timer.shutdown()));
    }
}

impl Drop for Consumer {
    /// Dropped without [`shutdown`](Consumer::shutdown): the same as
    /// [`abort`](Consumer::abort) (handlers whose acks could not be sent are not run).
    fn drop(&mut self) {
        if self.rt.is_some() {
            self.halt();
        }
    }
}

/// The slots and runtime of `async` handlers, if there are any: the runtime given to
/// [`Handlers::runtime`], or one started here (as many workers as cores, at most
/// `handler_threads`).
#[cfg(feature = "tokio")]
#[allow(clippy::type_complexity)]
fn async_handlers(
    cfg: &QueueConfig,
    handlers: &Handlers,
) -> Result<(Option<Arc<AsyncPool<HandBack>>>, Option<OwnedRuntime>), QueueError> {
    if !handlers.has_async() {
        return Ok((None, None));
    }
    let (handle, owned) = match &handlers.runtime {
        Some(handle) => (handle.clone(), None),
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let rt = OwnedRuntime::new(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(cores.min(cfg.handler_threads).max(1))
                    .thread_name("delaywheel-handler")
                    .enable_all()
                    .build()
                    .map_err(|e| QueueError::Spawn(e.to_string()))?,
            );
            (rt.handle().clone(), Some(rt))
        }
    };
    Ok((
        Some(Arc::new(AsyncPool::new(cfg.handler_threads, handle))),
        owned,
    ))
}

#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
impl Consumer {
    /// [`start`](Self::start) for async code (feature `tokio`): the connecting and the
    /// threads' start run on tokio's blocking pool, so no runtime thread waits. Errors as for
    /// `start`, and [`QueueError::Spawn`] if the blocking pool could not run it.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Consumer, Envelope, Handlers, Producer, QueueConfig};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let (done, mut closed) = tokio::sync::mpsc::unbounded_channel();
    /// let handlers = Handlers::new()
    ///     .runtime(tokio::runtime::Handle::current())
    ///     .on_async("order.close", move |task: Envelope| {
    ///         let done = done.clone();
    ///         async move {
    ///             // an async database call here
    ///             done.send(task.id)?;
    ///             Ok(())
    ///         }
    ///     });
    /// let cfg = QueueConfig::new(&url, "doc-consumer");
    /// let consumer = Consumer::start_async(cfg.clone(), handlers).await?;
    /// let producer = Producer::connect(cfg).await?;
    /// producer.enqueue("order:42", "order.close", serde_json::Value::Null, Duration::ZERO).await?;
    /// assert_eq!(closed.recv().await.as_deref(), Some("order:42"));
    /// consumer.shutdown_async(Duration::from_secs(10)).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn start_async(cfg: QueueConfig, handlers: Handlers) -> Result<Consumer, QueueError> {
        tokio::task::spawn_blocking(move || Consumer::start(cfg, handlers))
            .await
            .map_err(|e| QueueError::Spawn(e.to_string()))?
    }

    /// [`shutdown`](Self::shutdown) for async code (feature `tokio`): the wait runs on
    /// tokio's blocking pool, so no runtime thread waits, and `async` handlers on the
    /// application's runtime go on running meanwhile. Returns as `shutdown` does, and
    /// [`QueueError::Spawn`] if the blocking pool could not run it (the consumer is then
    /// dropped, as by [`abort`](Self::abort)). See [`start_async`](Self::start_async) for an
    /// example.
    pub async fn shutdown_async(self, timeout: Duration) -> Result<usize, QueueError> {
        tokio::task::spawn_blocking(move || self.shutdown(timeout))
            .await
            .map_err(|e| QueueError::Spawn(e.to_string()))?
    }
}
