//! The consumer of the shared delay queue: it claims the tasks due within the lookahead
//! window, holds them in its own timing wheel, and fires each at its due millisecond.
//!
//! # Ground rules
//!
//! * Redis is the source of truth. A claimed task is leased to this consumer under a fencing
//!   token; every later change (ack, retry, dead-letter, give back) is refused by Redis once
//!   the lease was taken over, so a consumer that stalled past its lease cannot clobber the
//!   new owner.
//! * `held` maps each claimed task not yet started to its timer. Whoever removes an entry owns
//!   the task's fate: the firing callback (runs the handler), `shutdown` or the stall loop
//!   (hand it back). The stall loop keeps what it took in `handing_back` until Redis has it
//!   (renewed meanwhile), so a failed or interrupted hand-back is tried again, or by
//!   `shutdown`, rather than left to a lease expiry.
//! * Handlers run on the wheel's callback pool, never on the async runtime; their outcomes go
//!   to the resolver task, which batches acks and writes each shard's calls as tasks of their
//!   own, so a shard whose node hangs holds back no other shard's.
//! * Delivery is at-least-once: a crash or an expired lease can fire a task twice. Handlers
//!   are idempotent (see [`Dedup`](crate::redis::Dedup)).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::redis::blocking::{wait_on, OwnedRuntime};
use crate::redis::envelope::{Envelope, MAX_DUE_MS};
use crate::redis::layout::KeyLayout;
use crate::redis::queue::config::{dead_record, sample_depth, Conn, QueueConfig, QueueError};
use crate::redis::queue::scripts;
use crate::redis::store_error::StoreError;
use crate::redis::wall_clock::now_ms;
use crate::redis::wall_clock::{micros_since, since_epoch};
use crate::{Timer, TimerId};

/// Outcomes of fired tasks waiting for the resolver, at most.
const OUTCOME_BOUND: usize = 65_536;

/// What a handler returns on failure; the message becomes the dead-letter reason.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

type Handler = Arc<dyn Fn(&Envelope) -> Result<(), HandlerError> + Send + Sync>;

/// The handlers of a consumer, by topic.
#[derive(Clone, Default)]
pub struct Handlers {
    map: HashMap<String, Handler>,
}

impl fmt::Debug for Handlers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.map.keys()).finish()
    }
}

impl Handlers {
    /// No handlers yet.
    pub fn new() -> Handlers {
        Handlers::default()
    }

    /// Runs `handler` for tasks of `topic` (replacing an earlier one for the same topic). It
    /// runs on a handler thread; an `Err` or a panic is a failed attempt.
    pub fn on<F>(mut self, topic: impl Into<String>, handler: F) -> Handlers
    where
        F: Fn(&Envelope) -> Result<(), HandlerError> + Send + Sync + 'static,
    {
        self.map.insert(topic.into(), Arc::new(handler));
        self
    }
}

/// Counters and lateness of one consumer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueStats {
    /// Claim commands sent.
    pub claims: u64,
    /// Tasks claimed.
    pub claimed: u64,
    /// Tasks whose handler ran.
    pub fired: u64,
    /// Acks Redis accepted.
    pub acked: u64,
    /// Acks (and retries, dead-letterings) Redis refused: the lease had been taken over, or
    /// the task was cancelled or replaced by a producer meanwhile.
    pub refused: u64,
    /// Failed attempts put back for a retry.
    pub retried: u64,
    /// Tasks this consumer dead-lettered: out of attempts, or (by its reaper) out of lease
    /// expiries (`max_lease_expiries`).
    pub dead_lettered: u64,
    /// Expired leases this consumer's reaper returned to the queue.
    pub recovered: u64,
    /// Claimed tasks handed back: at shutdown, or while every handler thread was stuck (see
    /// [`QueueConfig::handler_stall`](crate::redis::QueueConfig::handler_stall)).
    pub given_back: u64,
    /// Leases extended because their task was still being worked on.
    pub renewed: u64,
    /// Redis commands sent (scripts count one each, pipelines one per command).
    pub commands: u64,
    /// Handler start − due time, in µs: median, 99th percentile and maximum.
    pub lateness_p50_us: u64,
    /// See `lateness_p50_us`.
    pub lateness_p99_us: u64,
    /// See `lateness_p50_us`.
    pub lateness_max_us: u64,
}

/// A claimed, unfired task: its timer, its owner value (`consumer|token`) and due time.
type Held = (TimerId, Arc<str>, u64);

/// A claimed task to hand back to the queue: shard, id, owner and due time (ms).
type HandBack = (u32, String, Arc<str>, u64);

/// A claimed task in the wheel.
struct Claimed {
    shard: u32,
    owner: Arc<str>,
    envelope: Envelope,
}

/// What became of a fired task, for the resolver to write.
enum Outcome {
    Ack {
        shard: u32,
        id: String,
        owner: Arc<str>,
    },
    Retry {
        shard: u32,
        id: String,
        owner: Arc<str>,
        envelope: Vec<u8>,
        due: u64,
    },
    Dead {
        shard: u32,
        id: String,
        /// The id as stored, when it is not UTF-8 (`id` is then its lossy reading).
        raw_id: Option<Vec<u8>>,
        owner: Arc<str>,
        record: String,
    },
}

impl Outcome {
    fn shard(&self) -> u32 {
        match self {
            Outcome::Ack { shard, .. }
            | Outcome::Retry { shard, .. }
            | Outcome::Dead { shard, .. } => *shard,
        }
    }

    fn id(&self) -> &str {
        match self {
            Outcome::Ack { id, .. } | Outcome::Retry { id, .. } | Outcome::Dead { id, .. } => id,
        }
    }

    fn owner(&self) -> &Arc<str> {
        match self {
            Outcome::Ack { owner, .. }
            | Outcome::Retry { owner, .. }
            | Outcome::Dead { owner, .. } => owner,
        }
    }
}

#[derive(Default)]
struct Counters {
    claims: AtomicU64,
    claimed: AtomicU64,
    fired: AtomicU64,
    acked: AtomicU64,
    refused: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    recovered: AtomicU64,
    given_back: AtomicU64,
    renewed: AtomicU64,
}

/// The earliest due time (ms) wake-ups announced since a claim loop last looked, and the
/// signal that it changed: a flood of wake-ups coalesces into one value.
struct Wake {
    at: AtomicU64,
    notify: tokio::sync::Notify,
}

struct Shared {
    cfg: QueueConfig,
    id: String,
    /// Names this consumer's kept claims (`{ns}:batch:<this>`): its id and a random
    /// instance number, so that two consumers given the same id do not overwrite each other's.
    batch_name: String,
    shards: Vec<KeyLayout>,
    claim_from: Vec<u32>,
    conn: Conn,
    handlers: Handlers,
    held: Mutex<HashMap<(u32, String), Held>>,
    /// Fired tasks whose outcome is not written yet, by owner: their leases are renewed.
    working: Mutex<HashMap<(u32, String), Arc<str>>>,
    /// To the resolver; bounded, and the resolver holds at most [`OUTCOME_BOUND`] more, so
    /// handlers wait (rather than memory grow) while Redis is slow to take their outcomes.
    outcomes: mpsc::Sender<Outcome>,
    /// One per shard in `claim_from`, for its claim loop.
    wakes: Vec<Wake>,
    /// Claim loops whose last claim failed: the first to fail logs the outage, not every shard.
    failing: AtomicUsize,
    /// Room in `held` that claims in flight have reserved: claims on several shards run at
    /// once, and together stay within `max_held`.
    reserved: AtomicUsize,
    counters: Counters,
    lateness: Mutex<Histogram<u64>>,
    /// Set by `abort`: fired tasks are dropped as a crashed process would drop them.
    aborted: AtomicBool,
    /// Handler threads running a handler now, and when one last started (µs after `started`,
    /// on the monotonic clock, which a step of the wall clock does not move): all of them
    /// busy, none started for `handler_stall`, is a stall (see `stall_loop`).
    busy: AtomicUsize,
    last_start_us: AtomicU64,
    started: std::time::Instant,
    /// Tasks the stall loop took out of `held` and has not yet handed back.
    handing_back: Mutex<Vec<HandBack>>,
}

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
    shared: Arc<Shared>,
    timer: Timer<Claimed>,
    rt: Option<OwnedRuntime>,
    stop: watch::Sender<bool>,
    loops: Vec<tokio::task::JoinHandle<()>>,
    resolver: Option<tokio::task::JoinHandle<()>>,
    finish: Option<tokio::sync::oneshot::Sender<()>>,
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

fn now_us() -> u64 {
    since_epoch().as_micros() as u64
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
        let (out_tx, out_rx) = mpsc::channel(OUTCOME_BOUND);
        let shared = Arc::new(Shared {
            batch_name: format!("{id}:{:016x}", fastrand::u64(..)),
            id,
            shards,
            claim_from,
            conn,
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
        self.shared
            .held
            .lock()
            .retain(|(shard, id), (timer, owner, due)| {
                if self.timer.cancel(*timer).is_some() {
                    back.push((*shard, id.clone(), owner.clone(), *due));
                    false
                } else {
                    true
                }
            });
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
                let rest: Vec<_> = {
                    let mut held = self.shared.held.lock();
                    undelivered
                        .into_iter()
                        .filter_map(|p| {
                            let c = p.value;
                            let (_, owner, due) = held.remove(&(c.shard, c.envelope.id.clone()))?;
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
        tracing::debug!(consumer = %self.shared.id, given_back = given, "queue consumer stopped");
        match failure {
            None => Ok(given),
            Some(e) => Err(QueueError::Store(e)),
        }
    }

    /// Hands claimed tasks back to the queue (see [`hand_back`]), waiting on `rt`.
    fn give_back(
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

    fn halt(&mut self) {
        self.shared.aborted.store(true, SeqCst);
        let _ = self.stop.send(true);
        if let Some(rt) = self.rt.take() {
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

/// Hands claimed tasks `(shard, id, owner, due)` back to the queue, [`PER_CALL`] per script
/// call, each call given until `deadline` (at least [`GIVE_BACK_FLOOR`]), and tried again
/// until then after an error a retry can get past. The shards go at once, each on its own:
/// after a lasting failure a shard stops (its other tasks are returned by a reaper after their
/// lease), and the others go on. Returns how many were handed back, and the first failure.
async fn hand_back(
    shared: Arc<Shared>,
    tasks: Vec<HandBack>,
    deadline: std::time::Instant,
) -> (usize, Option<StoreError>) {
    let by_shard = by_shard(
        tasks
            .into_iter()
            .map(|(shard, id, owner, due)| (shard, (id, owner, due))),
    );
    let calls = by_shard.into_iter().map(|(shard, tasks)| {
        let shared = shared.clone();
        async move {
            let keys = &shared.shards[shard as usize];
            let mut given = 0;
            for chunk in tasks.chunks(PER_CALL) {
                let mut inv = scripts::GIVE_BACK.prepare_invoke();
                inv.key(keys.lease())
                    .key(keys.owner())
                    .key(keys.due())
                    .arg(shared.cfg.channel())
                    .arg(shared.cfg.notify_before())
                    .arg(shared.cfg.wake_suffix(shard));
                for (id, owner, due) in chunk {
                    inv.arg(id.as_str()).arg(&**owner).arg(*due);
                }
                // Tried again while the error is one a retry can get past (a dropped
                // connection, a cluster reconfiguring) and time is left: the script checks
                // each owner, so a second run of a call that ran hands nothing back twice.
                let mut wait = Duration::from_millis(20);
                loop {
                    let left = remaining(deadline).max(GIVE_BACK_FLOOR);
                    match tokio::time::timeout(left, shared.conn.run::<u64>(&inv)).await {
                        Ok(Ok(n)) => {
                            given += n as usize;
                            break;
                        }
                        Ok(Err(e))
                            if crate::redis::link::passing(&e) && remaining(deadline) > wait =>
                        {
                            tracing::debug!(error = %e, shard, "hand-back failed; trying again");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_millis(200));
                        }
                        Ok(Err(e)) => return (given, Some(StoreError::from(e))),
                        Err(_) => {
                            let e = "redis did not answer before the hand-back's deadline";
                            return (given, Some(StoreError::new(e)));
                        }
                    }
                }
            }
            (given, None)
        }
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .fold((0, None), |(given, failure), (g, f)| {
            (given + g, failure.or(f))
        })
}

/// Runs on a handler thread when a claimed task's timer fires.
fn fire(shared: &Shared, c: Claimed) {
    if shared.aborted.load(SeqCst) {
        return; // "crashing"
    }
    {
        let mut held = shared.held.lock();
        let key = (c.shard, c.envelope.id.clone());
        match held.get(&key) {
            // Only the claim this timer belongs to: the id may have been claimed again since.
            Some((_, owner, _)) if **owner == *c.owner => {
                held.remove(&key);
            }
            // Handed back (at shutdown, or while the handlers were stuck), or superseded by a
            // newer claim.
            _ => return,
        }
        // Its lease is renewed until its outcome is written.
        shared.working.lock().insert(key, c.owner.clone());
    }
    shared
        .last_start_us
        .store(micros_since(shared.started), SeqCst);
    let busy = Busy::enter(shared);
    let late_us = now_us().saturating_sub(c.envelope.due_at.saturating_mul(1_000));
    // Saturating: a backlog hours late (after an outage) counts at the histogram's top,
    // rather than being left out of the maximum.
    shared.lateness.lock().saturating_record(late_us);
    metrics::histogram!("delaywheel_queue_lateness_seconds").record(late_us as f64 / 1e6);
    shared.counters.fired.fetch_add(1, Relaxed);
    metrics::counter!("delaywheel_queue_fired_total").increment(1);
    // The error is formatted and dropped inside the guard too: a user error type whose
    // `Display` or `Drop` panics must not end this call before the outcome is sent, which
    // would leave the task in `working`, its lease renewed and never settled.
    let result: Result<(), String> = match shared.handlers.map.get(c.envelope.topic.as_ref()) {
        Some(h) => std::panic::catch_unwind(AssertUnwindSafe(|| {
            h(&c.envelope).map_err(|e| e.to_string())
        }))
        .unwrap_or_else(|payload| {
            // Its drop may panic too; out of this thread, the task's outcome would be lost.
            crate::engine::delivery::forget_panic(payload);
            Err("handler panicked (or its error's Display or Drop did)".into())
        }),
        None => Err(format!("unknown topic: {}", c.envelope.topic)),
    };
    // Sending the outcome below may wait for a slow Redis: that is not a stalled handler.
    drop(busy);
    let Claimed {
        shard,
        owner,
        mut envelope,
    } = c;
    let outcome = match result {
        Ok(()) => Outcome::Ack {
            shard,
            id: envelope.id,
            owner,
        },
        Err(reason) => {
            // Saturating: a client may enqueue any count, and a panic here would strand the task
            // (its lease renewed, its outcome never sent).
            envelope.attempt = envelope.attempt.saturating_add(1);
            let retry = &shared.cfg.retry;
            if envelope.attempt >= retry.max_attempts {
                tracing::warn!(id = %envelope.id, attempt = envelope.attempt, %reason, "task dead-lettered");
                let raw = serde_json::to_string(&envelope).unwrap_or_default();
                Outcome::Dead {
                    shard,
                    record: dead_record(&reason, &raw, envelope.attempt),
                    id: envelope.id,
                    raw_id: None,
                    owner,
                }
            } else {
                let wait = retry.backoff.delay(envelope.attempt);
                // Rounded up, so the retry never comes before its backoff; a backoff past
                // what a score holds waits as long as one can.
                let wait_us = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
                envelope.due_at = now_us()
                    .saturating_add(wait_us)
                    .div_ceil(1_000)
                    .min(MAX_DUE_MS);
                tracing::debug!(id = %envelope.id, attempt = envelope.attempt, ?wait, %reason, "task failed; retrying");
                Outcome::Retry {
                    shard,
                    due: envelope.due_at,
                    envelope: serde_json::to_vec(&envelope).unwrap_or_default(),
                    id: envelope.id,
                    owner,
                }
            }
        }
    };
    // A handler thread, not the runtime: it may block while the resolver catches up. The
    // send fails only once the runtime is gone (abort), when nothing is written anyway.
    let _ = shared.outcomes.blocking_send(outcome);
}

/// A handler thread running a handler, counted in `Shared::busy` until dropped.
struct Busy<'a>(&'a Shared);

impl Busy<'_> {
    fn enter(shared: &Shared) -> Busy<'_> {
        shared.busy.fetch_add(1, SeqCst);
        Busy(shared)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, SeqCst);
    }
}

/// Whether every handler thread is running a handler, and the latest of them started at
/// least `handler_stall` ago.
fn handlers_stalled(shared: &Shared) -> bool {
    if shared.busy.load(SeqCst) < shared.cfg.handler_threads {
        return false;
    }
    let stall = u64::try_from(shared.cfg.handler_stall.as_micros()).unwrap_or(u64::MAX);
    micros_since(shared.started).saturating_sub(shared.last_start_us.load(SeqCst)) >= stall
}

/// Watches for stalled handlers (see [`handlers_stalled`]), every quarter of `handler_stall`
/// (between 1 ms and 1 s). While they are stalled, no claim is sent (`Reserved::take`), and
/// whatever this consumer holds, fired or not, is taken out of `held` and handed back to the
/// queue (a task that fires here later finds its entry gone and does not run). A hand-back that
/// fails is tried again at every check, the tasks' leases renewed meanwhile (see
/// [`retry_hand_back`]); what is left at shutdown, `shutdown` hands back.
async fn stall_loop(shared: Arc<Shared>, timer: Timer<Claimed>, mut stop: watch::Receiver<bool>) {
    let every =
        (shared.cfg.handler_stall / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the last check found the handlers stalled: a stall is logged once.
    let mut stalled = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if !handlers_stalled(&shared) {
            if std::mem::take(&mut stalled) {
                tracing::info!(consumer = %shared.id, "a handler thread is free again: claiming");
            }
            // A hand-back that failed is tried again, stalled or not.
            retry_hand_back(&shared, &mut stop).await;
            continue;
        }
        if !std::mem::replace(&mut stalled, true) {
            tracing::warn!(
                consumer = %shared.id,
                threads = shared.cfg.handler_threads,
                stall = ?shared.cfg.handler_stall,
                "every handler thread is stuck in one handler: handing held tasks back and \
                 claiming none until a thread is free"
            );
        }
        // Whoever removes an entry owns it: a handler that starts meanwhile finds its entry
        // gone and does nothing.
        let taken: Vec<_> = shared
            .held
            .lock()
            .drain()
            .map(|((shard, id), (t, owner, due))| {
                timer.cancel(t);
                (shard, id, owner, due)
            })
            .collect();
        shared.handing_back.lock().extend(taken);
        retry_hand_back(&shared, &mut stop).await;
    }
}

/// Hands back what the stall loop took (`handing_back`): the whole list, again after a failure
/// (the script skips a task no longer leased to this consumer). Returns early, leaving the list
/// to `shutdown`, once the consumer stops.
async fn retry_hand_back(shared: &Arc<Shared>, stop: &mut watch::Receiver<bool>) {
    let back = shared.handing_back.lock().clone();
    if back.is_empty() {
        return;
    }
    let deadline = std::time::Instant::now() + shared.cfg.lease / 3;
    let carried = back.len();
    let (given, failure) = tokio::select! {
        r = hand_back(shared.clone(), back, deadline) => r,
        _ = stop.changed() => return,
    };
    shared.counters.given_back.fetch_add(given as u64, Relaxed);
    metrics::counter!("delaywheel_queue_given_back_total").increment(given as u64);
    match failure {
        None => {
            let mut list = shared.handing_back.lock();
            // Only what this call carried: the loop alone adds to the list, between calls.
            let n = carried.min(list.len());
            list.drain(..n);
            tracing::info!(consumer = %shared.id, tasks = given, "held tasks handed back: the handlers are stuck");
        }
        Some(e) => {
            tracing::warn!(consumer = %shared.id, error = %e, tasks = carried, "handing back held tasks failed; trying again");
        }
    }
}

/// Claims from the `i`-th assigned shard: at start, every `reconcile`, when notified of a task
/// due before the next claim, and again at once while claims come back full (within
/// [`ROOM_RECHECK`] when `max_held` leaves no room for the next). Each shard has
/// its own loop, its own backoff and its own wake-ups.
async fn claim_loop(
    shared: Arc<Shared>,
    timer: Timer<Claimed>,
    mut stop: watch::Receiver<bool>,
    i: usize,
) {
    let cfg = &shared.cfg;
    let (shard, wake) = (shared.claim_from[i], &shared.wakes[i]);
    let mut next = tokio::time::Instant::now();
    // After a failed claim, not even a wake-up claims before this.
    let mut not_before = next;
    let mut failures = 0u32;
    // The nonce of the next claim: kept after a failed claim, so that a claim whose reply was
    // lost after the script ran is answered again by the retry (see `scripts::CLAIM`).
    let mut nonce = fastrand::u64(..);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = wake.notify.notified() => {
                let due = wake.at.swap(u64::MAX, SeqCst);
                // Claim `claim_margin` before the earliest notified task is due, unless a claim
                // comes sooner anyway.
                let at_ms = due.saturating_sub(cfg.claim_margin.as_millis() as u64);
                let wait = Duration::from_millis(at_ms.saturating_sub(now_ms()));
                // Any publisher may write to the channel: a far-off time is just ignored.
                if let Some(at) = tokio::time::Instant::now().checked_add(wait) {
                    next = next.min(at.max(not_before));
                }
                continue;
            }
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let mut full = false;
        let mut no_room = false;
        let mut failed = false;
        // After a failure the nonce is kept: the claim may answer a batch already leased here.
        match claim(&shared, &timer, shard, nonce, failures > 0).await {
            Ok(Some(Took { n, asked })) => {
                // Full (as many as it asked for): claim again at once if there is room.
                full = n >= asked;
                nonce = fastrand::u64(..);
            }
            // No room: nothing was sent, and a nonce kept after a failure stays for the retry.
            Ok(None) => no_room = true,
            Err(e) => {
                if failures == 0 && shared.failing.fetch_add(1, SeqCst) == 0 {
                    tracing::warn!(shard, error = %e, "claim failed; retrying with backoff");
                }
                failed = true;
            }
        }
        if no_room {
            // Neither a success nor a failure: the backoff of a claim that failed before stays
            // (a Redis that hangs must not be asked again every few ms because other shards'
            // hung claims hold the room), and so does its warning state. Look again soon, as
            // held tasks fire and make room, but not before that backoff ends.
            next = (tokio::time::Instant::now() + ROOM_RECHECK.min(cfg.reconcile)).max(not_before);
            continue;
        }
        if !failed && failures > 0 {
            shared.failing.fetch_sub(1, SeqCst);
        }
        failures = if failed {
            failures.saturating_add(1)
        } else {
            0
        };
        let pause = if failed {
            // From `claim_margin` (at least the floor, or a Redis that fails at once would be
            // asked again back to back), doubling, up to `reconcile`.
            (cfg.claim_margin.max(CLAIM_RETRY_FLOOR) * 2u32.saturating_pow(failures.min(6)))
                .min(cfg.reconcile)
                .max(CLAIM_RETRY_FLOOR)
        } else if full && shared.held.lock().len() < cfg.max_held {
            Duration::ZERO
        } else if full {
            // More may be due, and `held` is at `max_held` (or its room is reserved by other
            // shards' claims): look again soon, as its tasks fire and make room, rather than a
            // reconcile later. No Redis call until there is room.
            ROOM_RECHECK.min(cfg.reconcile)
        } else {
            // 80–100% of it, so that the loops of many shards, started together, do not claim
            // in step; never more, or a task could fall between two claims' windows (the
            // config checks `lookahead ≥ reconcile + claim_margin`).
            cfg.reconcile.mul_f64(0.8 + 0.2 * fastrand::f64())
        };
        next = tokio::time::Instant::now() + pause;
        if failed {
            // (After a success it is already past.)
            not_before = next;
        }
    }
}

/// How soon a claim loop that found no room under `max_held` (after a full claim, or with
/// none sent) looks again.
const ROOM_RECHECK: Duration = Duration::from_millis(10);

/// The shortest wait before a claim that failed is tried again.
const CLAIM_RETRY_FLOOR: Duration = Duration::from_millis(10);

/// Room reserved in `held` for one claim, given back when the claim is done (by then what it
/// took is in `held`).
struct Reserved<'a> {
    shared: &'a Shared,
    n: usize,
}

impl Reserved<'_> {
    /// Up to a batch of the room left under `max_held`, counting what other claims in flight
    /// reserved; `None` if there is none, or the handlers are stalled and this is not the
    /// `replay` of a failed claim (whose batch may be leased here already: it is taken in, and
    /// handed back by the stall loop, rather than left to its leases). Reserved under `held`'s lock, so two claims cannot
    /// both count the same room (a release meanwhile only makes the count conservative).
    fn take(shared: &Shared, replay: bool) -> Option<Reserved<'_>> {
        if !replay && handlers_stalled(shared) {
            return None;
        }
        let held = shared.held.lock();
        let used = held.len().saturating_add(shared.reserved.load(SeqCst));
        let n = shared
            .cfg
            .max_held
            .saturating_sub(used)
            .min(shared.cfg.batch);
        if n == 0 {
            return None;
        }
        shared.reserved.fetch_add(n, SeqCst);
        drop(held);
        Some(Reserved { shared, n })
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.shared.reserved.fetch_sub(self.n, SeqCst);
    }
}

/// What a claim took: `n` tasks, of the `asked` it had room for. (A claim answered again, its
/// first reply lost, may bring more than it asked for this time: they were leased already.)
struct Took {
    n: usize,
    asked: usize,
}

/// One claim on `shard` with `nonce` (the nonce of a failed claim answers that claim's batch
/// again, `replay`); puts the tasks in the wheel. `None` if there was no room under
/// `max_held`, or the handlers are stalled: no claim was sent.
async fn claim(
    shared: &Shared,
    timer: &Timer<Claimed>,
    shard: u32,
    nonce: u64,
    replay: bool,
) -> Result<Option<Took>, QueueError> {
    let cfg = &shared.cfg;
    let Some(room) = Reserved::take(shared, replay) else {
        return Ok(None);
    };
    let asked = room.n;
    let keys = &shared.shards[shard as usize];
    let now = now_ms();
    let mut inv = scripts::CLAIM.prepare_invoke();
    inv.key(keys.due())
        .key(keys.tasks())
        .key(keys.lease())
        .key(keys.owner())
        .key(keys.fence())
        .key(keys.dead())
        .key(keys.batch(&shared.batch_name))
        .key(keys.expired())
        .key(keys.unpaired())
        .arg(now + cfg.lookahead.as_millis() as u64)
        .arg(room.n)
        .arg(shared.id.as_str())
        .arg(cfg.lease.as_millis() as u64)
        .arg(nonce)
        .arg(cfg.unpaired_grace.as_millis() as u64);
    let reply: Vec<Vec<u8>> = shared.conn.run(&inv).await?;
    shared.counters.claims.fetch_add(1, Relaxed);
    let Some((token, rest)) = reply.split_first() else {
        metrics::histogram!("delaywheel_queue_claim_batch").record(0.0);
        return Ok(Some(Took { n: 0, asked }));
    };
    let owner: Arc<str> = format!("{}|{}", shared.id, String::from_utf8_lossy(token)).into();
    let marked = |mark: &[u8]| rest.chunks_exact(3).filter(|t| t[1] == mark).count();
    let (waiting, refused) = (marked(b"wait"), marked(b"wrongtype"));
    // What the claim changed in Redis (a task leased or dead-lettered, an id first seen with
    // no envelope), for whether it was full. An id left queued on a wrong-typed key changed
    // nothing, and is read again by the next claim: counted, it would make claims back to
    // back.
    let n = rest.len() / 3 - refused;
    metrics::histogram!("delaywheel_queue_claim_batch").record((n - waiting) as f64);
    shared
        .counters
        .claimed
        .fetch_add((n - waiting) as u64, Relaxed);
    for t in rest.chunks_exact(3) {
        let id = String::from_utf8_lossy(&t[0]).into_owned();
        if t[1] == b"dead" {
            // No envelope: the claim dead-lettered it, and leased nothing.
            tracing::warn!(%id, reason = "no envelope in the tasks hash", "claimed task dead-lettered");
            shared.counters.dead_lettered.fetch_add(1, Relaxed);
            continue;
        }
        if t[1] == b"wait" {
            // Queued with no envelope, maybe half written: left queued for its grace period.
            tracing::debug!(%id, "queued task has no envelope yet; left queued for unpaired_grace");
            continue;
        }
        if t[1] == b"wrongtype" {
            wrong_type(shard, &String::from_utf8_lossy(&t[2]), Some(&id));
            continue;
        }
        if std::str::from_utf8(&t[0]).is_err() {
            // Written by another client: no envelope can name it, and an ack by its lossy
            // reading would never match. Dead-lettered under the id as stored.
            tracing::warn!(%id, "claimed task with a non-UTF-8 id dead-lettered");
            let raw = String::from_utf8_lossy(&t[2]).into_owned();
            let _ = shared
                .outcomes
                .send(Outcome::Dead {
                    shard,
                    record: dead_record("task id is not UTF-8", &raw, 0),
                    id,
                    raw_id: Some(t[0].clone()),
                    owner: owner.clone(),
                })
                .await;
            continue;
        }
        let due: u64 = std::str::from_utf8(&t[1])
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map_or(now, |f| f as u64);
        let envelope = match Envelope::decode(&t[2]) {
            Ok(mut e) if e.id == id => {
                e.due_at = due; // the score is authoritative
                e
            }
            // (An id with no envelope never comes here: the claim dead-lettered it.)
            other => {
                let reason = match other {
                    Ok(e) => format!("envelope id {} does not match its key", e.id),
                    Err(e) => format!("undecodable envelope: {e}"),
                };
                tracing::warn!(%id, %reason, "claimed task dead-lettered");
                let raw = String::from_utf8_lossy(&t[2]).into_owned();
                let _ = shared
                    .outcomes
                    .send(Outcome::Dead {
                        shard,
                        record: dead_record(&reason, &raw, 0),
                        id,
                        raw_id: None,
                        owner: owner.clone(),
                    })
                    .await;
                continue;
            }
        };
        let delay = Duration::from_micros(due.saturating_mul(1_000).saturating_sub(now_us()));
        let mut held = shared.held.lock();
        let claimed = Claimed {
            shard,
            owner: owner.clone(),
            envelope,
        };
        match timer.schedule(claimed, delay) {
            Ok(t) => {
                // Claimed again (it was replaced and re-queued): the newer claim wins.
                if let Some((old, _, _)) = held.insert((shard, id), (t, owner.clone(), due)) {
                    timer.cancel(old);
                }
            }
            Err(_) => return Ok(Some(Took { n, asked })), // shutting down: the lease brings it back
        }
    }
    Ok(Some(Took { n, asked }))
}

/// Reports a key of the wrong type (another client wrote it) that keeps an entry (`id`, if
/// one) where it is: an error naming the key, and `delaywheel_queue_wrong_type_total` with
/// the key as its `key` label. The key is left as it is, for an operator to look at; the
/// other tasks go on.
fn wrong_type(shard: u32, key: &str, id: Option<&str>) {
    tracing::error!(
        shard,
        key,
        id,
        "a queue key has the wrong type: what needs it is left as it is until the key is fixed"
    );
    metrics::counter!("delaywheel_queue_wrong_type_total", "key" => key.to_owned()).increment(1);
}

/// Subscribes to the queue's wake-ups and forwards each due time to the claim loop;
/// resubscribes after a lost connection (meanwhile the reconcile claims cover).
async fn listen(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    use futures_util::StreamExt;
    let channel = shared.cfg.channel();
    // On a cluster, any node will do: classic PUBLISH reaches every node. Rotate through the
    // seeds when one is lost.
    let nodes = if shared.cfg.cluster_nodes.is_empty() {
        vec![shared.cfg.url.clone()]
    } else {
        shared.cfg.cluster_nodes.clone()
    };
    let mut attempt = 0usize;
    loop {
        let node = nodes[attempt % nodes.len()].clone();
        attempt += 1;
        let subscribed = async {
            let client = redis::Client::open(node.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = tokio::select! {
            r = subscribed => r,
            _ = stop.changed() => return,
        };
        match pubsub {
            Ok(pubsub) => {
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        m = messages.next() => match m {
                            Some(m) => {
                                if let Ok(text) = m.get_payload::<String>() {
                                    wake_loops(&shared, &text);
                                }
                            }
                            None => break,
                        },
                        _ = stop.changed() => return,
                    }
                }
                tracing::warn!("wake-up subscription lost; resubscribing");
            }
            Err(e) => tracing::warn!(error = %e, "cannot subscribe to wake-ups; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Hands a wake-up (`due` or `due:shard`) to the claim loop of its shard, or, without a
/// shard (a queue of one shard, or an older producer), to every loop. Anything else is
/// ignored: any client may publish on the channel.
fn wake_loops(shared: &Shared, text: &str) {
    let (due, shard) = match text.split_once(':') {
        Some((due, shard)) => match shard.parse::<u32>() {
            Ok(shard) => (due, Some(shard)),
            Err(_) => return,
        },
        None => (text, None),
    };
    let Ok(due) = due.parse::<u64>() else {
        return;
    };
    for (wake, _) in shared
        .wakes
        .iter()
        .zip(&shared.claim_from)
        .filter(|(_, &s)| shard.is_none_or(|wanted| wanted == s))
    {
        wake.at.fetch_min(due, SeqCst);
        wake.notify.notify_one();
    }
}

/// Returns expired leases of the `i`-th assigned shard to the queue, takes a step of the sweep
/// for envelopes with no queue entry (see `scripts::SWEEP`), and samples its depth, every
/// `reaper_interval`.
async fn reap_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>, i: usize) {
    let shard = shared.claim_from[i];
    // Where the sweep goes on in `tasks` and in `unpaired` (HSCAN cursors).
    let mut sweep = (String::from("0"), String::from("0"));
    // The shards' reapers start spread over one interval, so they do not run in step.
    let offset = shared.cfg.reaper_interval.mul_f64(fastrand::f64());
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + offset,
        shared.cfg.reaper_interval,
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let keys = &shared.shards[shard as usize];
        let mut inv = scripts::REAP.prepare_invoke();
        inv.key(keys.lease())
            .key(keys.owner())
            .key(keys.due())
            .key(keys.tasks())
            .key(keys.dead())
            .key(keys.expired())
            .arg(REAP_BATCH)
            .arg(shared.cfg.channel())
            .arg(shared.cfg.max_lease_expiries)
            .arg(shared.cfg.wake_suffix(shard));
        // Full batches are followed by another at once (a crashed consumer may have held
        // 100k tasks), a bounded number per round so that one round does not run forever.
        let (mut n, mut dead, mut bad) = (0, 0, String::new());
        for _ in 0..REAP_CALLS_PER_ROUND {
            match shared.conn.run::<(u64, u64, String)>(&inv).await {
                Ok((requeued, died, refused_by)) => {
                    n += requeued;
                    dead += died;
                    if !refused_by.is_empty() {
                        bad = refused_by;
                    }
                    if requeued + died < REAP_BATCH {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reaper: redis unavailable");
                    break;
                }
            }
        }
        if n > 0 {
            tracing::info!(shard, recovered = n, "expired leases returned to the queue");
            shared.counters.recovered.fetch_add(n, Relaxed);
            metrics::counter!("delaywheel_queue_lease_recovered_total").increment(n);
        }
        if dead > 0 {
            tracing::warn!(
                shard,
                dead,
                max = shared.cfg.max_lease_expiries,
                "tasks whose lease ran out too often were dead-lettered"
            );
            shared.counters.dead_lettered.fetch_add(dead, Relaxed);
        }
        if !bad.is_empty() {
            // Tasks out of lease expiries stay leased until the dead-letter key is fixed.
            wrong_type(shard, &bad, None);
        }
        sweep_step(&shared, shard, &mut sweep).await;
        let fired = shared.counters.fired.load(Relaxed);
        if fired > 0 {
            metrics::gauge!("delaywheel_queue_commands_per_fired_task")
                .set(shared.conn.commands.load(Relaxed) as f64 / fired as f64);
        }
        if let Ok(d) = sample_depth(&shared.conn, keys).await {
            let shard = shard.to_string();
            metrics::gauge!("delaywheel_queue_depth", "shard" => shard.clone())
                .set(d.queued as f64);
            metrics::gauge!("delaywheel_queue_leased", "shard" => shard.clone())
                .set(d.leased as f64);
            metrics::gauge!("delaywheel_queue_dead", "shard" => shard).set(d.dead as f64);
        }
    }
}

/// One step of the sweep of `shard` for envelopes with no queue entry, from the cursors in
/// `sweep`, which it moves on. A failure is only logged: the next round tries again.
async fn sweep_step(shared: &Shared, shard: u32, sweep: &mut (String, String)) {
    let keys = &shared.shards[shard as usize];
    let unpaired = keys.unpaired();
    let mut inv = scripts::SWEEP.prepare_invoke();
    inv.key(keys.tasks())
        .key(keys.due())
        .key(keys.lease())
        .key(keys.dead())
        .key(unpaired)
        .key(keys.expired())
        .arg(&sweep.0)
        .arg(&sweep.1)
        .arg(SWEEP_COUNT)
        .arg(shared.cfg.unpaired_grace.as_millis() as u64);
    match shared.conn.run::<(String, String, u64, String)>(&inv).await {
        Ok((tasks, noted, removed, bad)) => {
            *sweep = (tasks, noted);
            if removed > 0 {
                tracing::warn!(
                    shard,
                    removed,
                    "envelopes with no queue entry past unpaired_grace removed"
                );
                metrics::counter!("delaywheel_queue_unpaired_removed_total").increment(removed);
            }
            if !bad.is_empty() {
                wrong_type(shard, &bad, None);
            }
        }
        Err(e) => tracing::debug!(error = %e, "sweep: redis unavailable"),
    }
}

/// Envelopes a sweep step looks at, about (an HSCAN `COUNT`, a hint): each comes with its
/// envelope, so a step copies at most this many envelopes in Redis.
const SWEEP_COUNT: u64 = 100;

/// Writes the outcomes of fired tasks: acks in batches every `ack_interval` (or 256 at
/// once), retries and dead-letterings as they come, and renews leases every `lease / 3`. On a
/// Redis error an ack batch is kept and retried; the lease keeps the tasks safe meanwhile.
/// `finish` (shutdown, once the handlers are done) drains what is left and returns.
///
/// Every write goes to one shard and runs as a task of its own, and this loop never waits on
/// one: a shard whose node stops answering holds back its own acks, outcomes and renewals (at
/// most one ack call, one renewal and [`OUTCOME_WRITES`] outcome writes are out per shard),
/// not the other shards', nor the handlers. Outcomes waiting or being written number at most
/// [`OUTCOME_BOUND`]; past that this loop stops reading, and handlers wait on the channel.
async fn resolve(
    shared: Arc<Shared>,
    mut outcomes: mpsc::Receiver<Outcome>,
    mut finish: tokio::sync::oneshot::Receiver<()>,
) {
    let mut outboxes: HashMap<u32, Outbox> = HashMap::new();
    // Outcomes received and not yet written (waiting, or in a call that is out).
    let mut buffered = 0usize;
    let mut writes = Writes::default();
    let mut finishing = false;
    let mut tick = tokio::time::interval(shared.cfg.ack_interval.max(Duration::from_millis(1)));
    let mut renew_tick =
        tokio::time::interval((shared.cfg.lease / 3).max(Duration::from_millis(1)));
    renew_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut flush_now = finishing;
        // The shard whose outbox changed, to send what it can.
        let mut touched = None;
        tokio::select! {
            Some(o) = outcomes.recv(), if buffered < OUTCOME_BOUND => {
                buffered += 1;
                touched = Some(o.shard());
                let outbox = outboxes.entry(o.shard()).or_default();
                match o {
                    Outcome::Ack { id, owner, .. } => outbox.acks.push((id, owner, false)),
                    other => outbox.outcomes.push_back(other),
                }
            }
            Some(done) = writes.set.join_next_with_id(), if !writes.set.is_empty() => {
                let (task, done) = match done {
                    Ok((task, done)) => (task, Some(done)),
                    Err(e) => {
                        tracing::error!(error = %e, "a queue write task failed");
                        (e.id(), None)
                    }
                };
                if let Some(job) = writes.jobs.remove(&task) {
                    touched = Some(job.shard());
                    buffered -= finished(&shared, &mut outboxes, job, done);
                }
            }
            _ = tick.tick() => {
                flush_now = true;
                outboxes.retain(|_, o| !o.is_idle());
            }
            // Here, where outcomes are written, and until the last one is: a handler still
            // running at shutdown keeps its lease until it is done.
            _ = renew_tick.tick(), if shared.cfg.renew_leases => {
                for (shard, tasks) in renewals(&shared) {
                    let outbox = outboxes.entry(shard).or_default();
                    if !outbox.renewing {
                        outbox.renewing = true;
                        writes.spawn(renew(shared.clone(), shard, tasks), Job::Renewal { shard });
                    }
                }
                continue;
            }
            _ = &mut finish, if !finishing => {
                flush_now = true;
                finishing = true;
            }
        }
        if flush_now {
            for (&shard, outbox) in &mut outboxes {
                dispatch(&shared, &mut writes, shard, outbox, true);
            }
        } else if let Some(shard) = touched {
            if let Some(outbox) = outboxes.get_mut(&shard) {
                dispatch(&shared, &mut writes, shard, outbox, false);
            }
        }
        if finishing && buffered == 0 && outcomes.is_empty() {
            // Renewals still out are dropped with `writes`: nothing is left to renew.
            return;
        }
    }
}

/// Starts the writes `outbox` has waiting, as far as its shard's limits allow: an ack call
/// (once [`ACK_BATCH`] acks wait, or whatever waits if `flush`), and outcome writes.
fn dispatch(
    shared: &Arc<Shared>,
    writes: &mut Writes,
    shard: u32,
    outbox: &mut Outbox,
    flush: bool,
) {
    if !outbox.acking && !outbox.acks.is_empty() && (flush || outbox.acks.len() >= ACK_BATCH) {
        let n = outbox.acks.len().min(PER_CALL);
        let batch: Arc<Vec<_>> = Arc::new(outbox.acks.drain(..n).collect());
        outbox.acking = true;
        writes.spawn(
            send_acks(shared.clone(), shard, batch.clone()),
            Job::Acks { shard, batch },
        );
    }
    while outbox.writing < OUTCOME_WRITES {
        let Some(o) = outbox.outcomes.pop_front() else {
            break;
        };
        outbox.writing += 1;
        let job = Job::Outcome {
            shard,
            id: o.id().to_string(),
            owner: o.owner().clone(),
        };
        writes.spawn(write_outcome(shared.clone(), o), job);
    }
}

/// The resolver's write tasks, and what each one is: its end is booked through it, also when
/// it panicked and returned nothing.
#[derive(Default)]
struct Writes {
    set: JoinSet<Done>,
    jobs: HashMap<tokio::task::Id, Job>,
}

impl Writes {
    fn spawn(&mut self, task: impl std::future::Future<Output = Done> + Send + 'static, job: Job) {
        let task = self.set.spawn(task);
        self.jobs.insert(task.id(), job);
    }
}

/// An ack waiting to be sent: task id, owner, and whether an earlier call carrying it failed
/// (and so may have run: Redis then tells a task already gone from a refusal).
type PendingAck = (String, Arc<str>, bool);

/// Acks a shard collects before it sends them without waiting for `ack_interval`.
const ACK_BATCH: usize = 256;

/// Retries and dead-letterings of one shard written at once, at most.
const OUTCOME_WRITES: usize = 4;

/// Failures of writing a retry or a dead letter, with an error no retry gets past, after which
/// it is given up.
const OUTCOME_TRIES: u32 = 5;

/// The longest wait between two tries of writing a retry or a dead letter.
const OUTCOME_RETRY_MAX: Duration = Duration::from_secs(2);

/// What the resolver holds for one shard.
#[derive(Default)]
struct Outbox {
    /// Acks waiting for the shard's next ack call.
    acks: Vec<PendingAck>,
    /// An ack call is out.
    acking: bool,
    /// Retries and dead-letterings waiting for their turn.
    outcomes: VecDeque<Outcome>,
    /// Retries and dead-letterings being written.
    writing: usize,
    /// A renewal is out.
    renewing: bool,
}

impl Outbox {
    fn is_idle(&self) -> bool {
        self.acks.is_empty()
            && !self.acking
            && self.outcomes.is_empty()
            && self.writing == 0
            && !self.renewing
    }
}

/// A write task of the resolver, and what it needs back if the task panics.
enum Job {
    /// An ack call: the batch is put back if the call fails.
    Acks {
        shard: u32,
        batch: Arc<Vec<PendingAck>>,
    },
    Renewal {
        shard: u32,
    },
    /// A retry or dead-lettering: settled (its lease left to run out) if the task panics.
    Outcome {
        shard: u32,
        id: String,
        owner: Arc<str>,
    },
}

impl Job {
    fn shard(&self) -> u32 {
        match self {
            Job::Acks { shard, .. } | Job::Renewal { shard } | Job::Outcome { shard, .. } => *shard,
        }
    }
}

/// What a write task returns.
enum Done {
    /// Redis's answer to an ack call, per task (1: acked; 2: already gone, as after a resend; 0: refused).
    Acks(Result<Vec<u8>, redis::RedisError>),
    /// A renewal or an outcome written (or given up on).
    Other,
}

/// Books a write task's end (`done` is `None` if it panicked); returns how many outcomes it
/// wrote, which are no longer buffered.
fn finished(
    shared: &Shared,
    outboxes: &mut HashMap<u32, Outbox>,
    job: Job,
    done: Option<Done>,
) -> usize {
    match job {
        Job::Acks { shard, batch } => {
            let outbox = outboxes.entry(shard).or_default();
            outbox.acking = false;
            match done {
                Some(Done::Acks(Ok(results))) => {
                    acked(shared, shard, &batch, &results);
                    batch.len()
                }
                failed => {
                    // A task that panicked: whether its call went out is not known.
                    let mut ran = true;
                    if let Some(Done::Acks(Err(e))) = failed {
                        tracing::debug!(error = %e, shard, "ack failed; kept for the next round");
                        ran = crate::redis::link::may_have_run(&e);
                    }
                    // The task has ended, so this is the last reference.
                    let batch = Arc::try_unwrap(batch).unwrap_or_else(|b| (*b).clone());
                    // Sent again, marked as such if the failed call may have run (its reply
                    // lost) and was not marked before.
                    outbox.acks.extend(
                        batch
                            .into_iter()
                            .map(|(id, owner, again)| (id, owner, again || ran)),
                    );
                    0
                }
            }
        }
        Job::Renewal { shard } => {
            outboxes.entry(shard).or_default().renewing = false;
            0
        }
        Job::Outcome { shard, id, owner } => {
            outboxes.entry(shard).or_default().writing -= 1;
            if done.is_none() {
                settled(shared, shard, &id, &owner);
            }
            1
        }
    }
}

/// One ack call for `shard`'s `batch`. A failure waits a little before it returns, so that
/// the resolver's retries of an error Redis answers at once do not spin.
async fn send_acks(shared: Arc<Shared>, shard: u32, batch: Arc<Vec<PendingAck>>) -> Done {
    let keys = &shared.shards[shard as usize];
    let mut inv = scripts::ACK.prepare_invoke();
    inv.key(keys.lease())
        .key(keys.owner())
        .key(keys.tasks())
        .key(keys.expired())
        .key(keys.dead());
    for (id, owner, again) in batch.iter() {
        inv.arg(id.as_str()).arg(&**owner).arg(u8::from(*again));
    }
    let results = shared.conn.run::<Vec<u8>>(&inv).await;
    if results.is_err() {
        tokio::time::sleep(shared.cfg.ack_interval.max(Duration::from_millis(50))).await;
    }
    Done::Acks(results)
}

/// Counts an answered ack call: each task's lease is no longer renewed, acked or refused.
fn acked(shared: &Shared, shard: u32, batch: &[PendingAck], results: &[u8]) {
    for ((id, owner, _), ok) in batch.iter().zip(results) {
        settled(shared, shard, id, owner);
        if *ok == 2 {
            // Gone, and held by no one: most likely a resend of an ack that landed.
            tracing::debug!(%id, "ack found the task already gone");
        }
        if *ok != 0 {
            shared.counters.acked.fetch_add(1, Relaxed);
        } else {
            shared.counters.refused.fetch_add(1, Relaxed);
            metrics::counter!("delaywheel_queue_acks_refused_total").increment(1);
            tracing::warn!(%id, "ack refused: the lease was taken over, or the task cancelled or replaced");
        }
    }
}

async fn write_outcome(shared: Arc<Shared>, o: Outcome) -> Done {
    let (inv, id, ok_counter) = match &o {
        Outcome::Retry {
            shard,
            id,
            owner,
            envelope,
            due,
        } => {
            let keys = &shared.shards[*shard as usize];
            let mut inv = scripts::RETRY.prepare_invoke();
            inv.key(keys.lease())
                .key(keys.owner())
                .key(keys.tasks())
                .key(keys.due())
                .arg(id.as_str())
                .arg(&**owner)
                .arg(envelope.as_slice())
                .arg(*due)
                .arg(shared.cfg.channel())
                .arg(shared.cfg.notify_before())
                .arg(shared.cfg.wake_suffix(*shard));
            (inv, id, &shared.counters.retried)
        }
        Outcome::Dead {
            shard,
            id,
            raw_id,
            owner,
            record,
        } => {
            let keys = &shared.shards[*shard as usize];
            let mut inv = scripts::DEAD.prepare_invoke();
            inv.key(keys.lease())
                .key(keys.owner())
                .key(keys.tasks())
                .key(keys.dead())
                .key(keys.expired())
                .arg(raw_id.as_deref().unwrap_or(id.as_bytes()))
                .arg(&**owner)
                .arg(record.as_str());
            (inv, id, &shared.counters.dead_lettered)
        }
        Outcome::Ack { .. } => return Done::Other,
    };
    // Tried until Redis answers, as acks are, while the error is one a retry can get past
    // (a connection lost, a timeout, a cluster failing over, a server loading): meanwhile the
    // task stays in `working`, so its lease is renewed once Redis is back, and the retry's
    // attempt count, backoff and reason (or the dead letter) are not lost to a lease expiry
    // that would put the old envelope back (and count as a crash). An error no retry gets
    // past (NOPERM, WRONGTYPE, a script error) is given up on after a few tries: the lease then
    // runs out and the task fires again elsewhere, rather than staying leased for ever. A
    // shutdown stops this with the resolver.
    let mut wait = Duration::from_millis(50);
    let (mut failures, mut lasting) = (0u32, 0u32);
    loop {
        match shared.conn.run::<i64>(&inv).await {
            // 2: an earlier send of this write landed; its reply was lost.
            Ok(1 | 2) => {
                ok_counter.fetch_add(1, Relaxed);
                break;
            }
            Ok(_) => {
                shared.counters.refused.fetch_add(1, Relaxed);
                tracing::warn!(%id, "refused: the lease was taken over, or the task cancelled or replaced");
                break;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                // Codes the redis crate does not know, which a server answers while it is
                // busy or short of something for a while, count as passing too.
                let transient = crate::redis::link::passing(&e)
                    || matches!(
                        e.code(),
                        Some("BUSY" | "MISCONF" | "NOREPLICAS" | "OOM" | "LOADING" | "TRYAGAIN")
                    );
                if !transient {
                    lasting += 1;
                    if lasting >= OUTCOME_TRIES {
                        tracing::warn!(error = %e, %id, "writing a retry or dead letter failed; left to its lease");
                        break;
                    }
                }
                if failures == OUTCOME_TRIES {
                    tracing::warn!(error = %e, %id, "writing a retry or dead letter keeps failing; still trying");
                } else {
                    tracing::debug!(error = %e, %id, "writing a retry or dead letter failed");
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(OUTCOME_RETRY_MAX);
            }
        }
    }
    if let Outcome::Retry {
        shard, id, owner, ..
    }
    | Outcome::Dead {
        shard, id, owner, ..
    } = &o
    {
        settled(&shared, *shard, id, owner);
    }
    Done::Other
}

/// The outcome of task `id` under `owner` is written (or given up on): its lease is no longer
/// renewed. A newer claim of the same id keeps its entry.
fn settled(shared: &Shared, shard: u32, id: &str, owner: &Arc<str>) {
    let mut working = shared.working.lock();
    let key = (shard, id.to_string());
    if working.get(&key) == Some(owner) {
        working.remove(&key);
    }
}

/// The tasks whose leases are to be extended, by shard: fired ones whose outcome is not
/// written yet, and claimed ones already due (waiting for a handler thread).
fn renewals(shared: &Shared) -> HashMap<u32, Vec<(String, Arc<str>)>> {
    let now = now_ms();
    let mut tasks = Vec::new();
    // `held` first: a task that fires meanwhile moves from `held` to `working`, so it is seen
    // in one of them (or both: renewed twice), never in neither.
    tasks.extend(
        shared
            .held
            .lock()
            .iter()
            .filter(|(_, (_, _, due))| *due <= now)
            .map(|((shard, id), (_, owner, _))| (*shard, (id.clone(), owner.clone()))),
    );
    tasks.extend(
        shared
            .working
            .lock()
            .iter()
            .map(|((shard, id), owner)| (*shard, (id.clone(), owner.clone()))),
    );
    // Taken for a hand-back Redis has not confirmed yet: leased to this consumer until then.
    tasks.extend(
        shared
            .handing_back
            .lock()
            .iter()
            .map(|(shard, id, owner, _)| (*shard, (id.clone(), owner.clone()))),
    );
    by_shard(tasks)
}

/// Extends the leases of `tasks` on `shard` until a full `lease` from now.
async fn renew(shared: Arc<Shared>, shard: u32, tasks: Vec<(String, Arc<str>)>) -> Done {
    let lease = u64::try_from(shared.cfg.lease.as_millis()).unwrap_or(u64::MAX);
    let keys = &shared.shards[shard as usize];
    for chunk in tasks.chunks(PER_CALL) {
        let mut inv = scripts::RENEW.prepare_invoke();
        inv.key(keys.lease()).key(keys.owner()).arg(lease);
        for (id, owner) in chunk {
            inv.arg(id.as_str()).arg(&**owner);
        }
        match shared.conn.run::<u64>(&inv).await {
            Ok(n) => {
                shared.counters.renewed.fetch_add(n, Relaxed);
                metrics::counter!("delaywheel_queue_leases_renewed_total").increment(n);
            }
            // The next round tries again; until then the leases run as they were.
            Err(e) => tracing::debug!(error = %e, shard, "renewing leases failed"),
        }
    }
    Done::Other
}

/// Expired leases a reaper's script call returns, at most, and calls per reaper round.
const REAP_BATCH: u64 = 1_000;
const REAP_CALLS_PER_ROUND: usize = 100;

/// Tasks per script call when a consumer writes about many at once (hand-back, renewal).
const PER_CALL: usize = 500;

/// The least time a hand-back call at shutdown is given, even past the deadline: handing tasks
/// back at once spares them a lease's wait.
const GIVE_BACK_FLOOR: Duration = Duration::from_millis(100);

/// The time left until `deadline` (zero once it has passed).
fn remaining(deadline: std::time::Instant) -> Duration {
    deadline.saturating_duration_since(std::time::Instant::now())
}

/// `(shard, task)` pairs grouped by shard: every script touches the keys of one shard.
fn by_shard<T>(tasks: impl IntoIterator<Item = (u32, T)>) -> HashMap<u32, Vec<T>> {
    let mut grouped: HashMap<u32, Vec<T>> = HashMap::new();
    for (shard, task) in tasks {
        grouped.entry(shard).or_default().push(task);
    }
    grouped
}
