//! The driver: [`Core`], what every handle of one engine shares (the shards, the clock, the
//! delivery sink, the wake handshake), its `turn` (collect what is due from every shard, then
//! deliver it outside the shard locks), and [`drive`], the thread that turns and then sleeps
//! until the next deadline or until a producer wakes it. The ground rules are in
//! [`timer`](super::timer)'s module docs.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::clock::{Clock, Ticks};
use super::delivery::Sink;
use super::error::ScheduleError;
use super::expiration::{Expiration, TimerId};
use super::metrics::EngineMetrics;
use super::shard::{Shard, ShardState};
use super::stats::{LatenessHistogram, Stats};
use super::wake::Wake;
use crate::wheel::Expired;

pub(crate) struct Core<T> {
    /// Distinguishes this engine's ids from another engine's.
    pub(super) engine: u32,
    pub(super) shards: Box<[Shard<T>]>,
    pub(super) ticks: Ticks,
    pub(super) clock: Clock,
    /// The wake handshake with the driver (see the ground rules).
    pub(super) wake: Wake,
    pub(super) driver: OnceLock<Thread>,
    pub(super) stopping: AtomicBool,
    pub(super) stopped: AtomicBool,
    pub(super) sink: Mutex<Option<Sink<T>>>,
    pub(super) undelivered: Mutex<Vec<Expiration<T>>>,
    /// Expirations that could not be handed over, ever (`undelivered` is emptied by stops).
    pub(super) undelivered_total: AtomicU64,
    pub(super) lateness: Mutex<LatenessHistogram>,
    pub(super) lateness_warn: Duration,
    pub(super) next_shard: AtomicUsize,
    pub(super) turn_buf: Mutex<Vec<(u32, Expired<T>)>>,
    /// Its series in the `metrics` facade.
    pub(super) metrics: EngineMetrics,
}

impl<T> Drop for Core<T> {
    fn drop(&mut self) {
        // Left by a turn that a stop from within it let finish (see `Timer::shutdown`), with no
        // later stop to hand them back.
        let undelivered = self.undelivered.get_mut().len();
        if undelivered > 0 {
            tracing::warn!(
                timers = undelivered,
                "engine dropped with fired timers it could not deliver"
            );
        }
        // A stop from within a turn leaves the sink open: whoever drops the engine last closes
        // it, so that a stream ends (its task is woken) and pool workers finish.
        if let Some(sink) = self.sink.get_mut().take() {
            sink.close();
        }
    }
}

/// The most expirations a turn's buffer keeps room for between turns.
const TURN_BUF_KEEP: usize = 4_096;

thread_local! {
    /// The shard this thread last scheduled into (see `Core::lock_for_insert`).
    static SHARD_HINT: Cell<u32> = const { Cell::new(u32::MAX) };

    /// The engines (their `Core`s' addresses) whose turns this thread is in, innermost last:
    /// a delivery (a waker, an inline callback) that calls back into one of them must not
    /// take that turn's locks again (`stop`, `fire_due`). Turns of several engines can nest
    /// (a waker of one calls another's `fire_due`, whose waker calls the first).
    static IN_TURN: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Marks this thread as in a turn of one engine until dropped.
struct TurnMark;

impl TurnMark {
    // `try_with`: while a thread exits, its thread-locals are destroyed one by one, and an
    // engine kept in another (or a future holding one) may run a turn or stop after `IN_TURN`
    // is gone. A panic there would abort the process. Such a turn goes unmarked: one of its
    // deliveries that called back into the same engine (`fire_due`, `shutdown`) would wait on
    // the turn's own lock. Turns nested that way in a thread-local's destructor are not
    // supported; dropping or stopping an engine there is.
    pub(super) fn enter(core: usize) -> TurnMark {
        let _ = IN_TURN.try_with(|t| t.borrow_mut().push(core));
        TurnMark
    }
}

impl Drop for TurnMark {
    fn drop(&mut self) {
        let _ = IN_TURN.try_with(|t| t.borrow_mut().pop());
    }
}

impl<T> Core<T> {
    /// Locks a shard for an insert: the one this thread used last if it is free, else the next
    /// free one (remembered for next time), else (all busy) waits for its own. Producers on
    /// different threads thereby settle on different shards, however threads come and go.
    #[inline]
    pub(super) fn lock_for_insert(&self) -> (usize, MutexGuard<'_, ShardState<T>>) {
        let n = self.shards.len();
        let mut first = SHARD_HINT.with(Cell::get) as usize;
        if first >= n {
            first = self.next_shard.fetch_add(1, SeqCst) % n;
            SHARD_HINT.with(|c| c.set(first as u32));
        }
        let mut i = first;
        loop {
            if let Some(guard) = self.shards[i].try_lock() {
                if i != first {
                    SHARD_HINT.with(|c| c.set(i as u32));
                }
                return (i, guard);
            }
            i += 1;
            if i == n {
                i = 0;
            }
            if i == first {
                return (first, self.shards[first].lock());
            }
        }
    }

    /// The shard an id of this engine names; `None` for another engine's id.
    #[inline]
    pub(super) fn shard_of(&self, id: TimerId) -> Option<&Shard<T>> {
        if id.engine != self.engine {
            return None;
        }
        self.shards.get(id.shard as usize)
    }

    /// Wakes the driver if a timer due at `tick` is earlier than what it sleeps until.
    #[inline]
    pub(super) fn wake_for(&self, tick: u64) {
        self.wake.timer_due(tick, || self.unpark_driver());
    }

    /// Wakes the driver (a manual clock advanced).
    pub(super) fn wake_driver(&self) {
        self.wake.wake(|| self.unpark_driver());
    }

    pub(super) fn unpark_driver(&self) {
        if let Some(driver) = self.driver.get() {
            driver.unpark();
        }
    }

    pub(super) fn insert(&self, tick: u64, value: T) -> Result<TimerId, ScheduleError<T>> {
        let (shard, key) = {
            let (shard, mut s) = self.lock_for_insert();
            // Checked under the shard lock: `shutdown` sets the flag before it drains the shards,
            // so a timer is either drained and handed back, or refused here. Never lost.
            if self.stopping.load(SeqCst) {
                return Err(ScheduleError::Shutdown(value));
            }
            let key = s.wheel.try_insert(tick, value);
            if key.is_ok() {
                s.scheduled += 1;
            }
            (shard, key)
        };
        let key = key.map_err(|e| ScheduleError::Capacity(e.0))?;
        self.metrics.scheduled.increment(1);
        self.wake_for(tick);
        Ok(TimerId {
            engine: self.engine,
            shard: shard as u32,
            key,
        })
    }

    /// A snapshot of the counters, pending timers per shard and level, and lateness.
    pub(super) fn stats(&self) -> Stats {
        let mut stats = Stats {
            pending_per_shard: Vec::with_capacity(self.shards.len()),
            pending_per_level: Vec::new(),
            scheduled: 0,
            cancelled: 0,
            reset: 0,
            fired: 0,
            undelivered: self.undelivered_total.load(SeqCst),
            lateness: self.lateness.lock().snapshot(),
        };
        for shard in self.shards.iter() {
            let s = shard.lock();
            stats.pending_per_shard.push(s.wheel.len());
            let levels = s.wheel.pending_per_level();
            stats.pending_per_level.resize(levels.len(), 0);
            for (acc, n) in stats.pending_per_level.iter_mut().zip(levels) {
                *acc += n;
            }
            stats.scheduled += s.scheduled;
            stats.cancelled += s.cancelled;
            stats.reset += s.reset;
            stats.fired += s.fired;
        }
        stats
    }

    /// This engine's address, as `IN_TURN` holds it.
    pub(super) fn addr(&self) -> usize {
        self as *const Self as usize
    }

    /// Whether this thread is delivering a turn of this engine (so holds its `turn_buf`),
    /// innermost or not.
    pub(super) fn in_turn(&self) -> bool {
        // Destroyed (the thread is exiting): see `TurnMark::enter`.
        IN_TURN
            .try_with(|t| t.borrow().contains(&self.addr()))
            .unwrap_or(false)
    }

    /// Collects every due timer, delivers them with no shard lock held, and returns the
    /// earliest pending deadline tick.
    pub(crate) fn turn(&self) -> (usize, Option<u64>) {
        let mut buf = self.turn_buf.lock();
        let _mark = TurnMark::enter(self.addr());
        let now_tick = self.ticks.now_tick(self.clock.now());
        let mut next: Option<u64> = None;
        for (i, shard) in self.shards.iter().enumerate() {
            let mut s = shard.lock();
            let before = buf.len();
            while let Some(e) = s.wheel.poll(now_tick) {
                buf.push((i as u32, e));
            }
            s.fired += (buf.len() - before) as u64;
            self.metrics.fired.increment((buf.len() - before) as u64);
            if let Some(d) = s.wheel.next_deadline() {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        let fired = buf.len();
        if fired == 0 {
            return (0, next);
        }
        if self.shards.len() > 1 {
            buf.sort_by_key(|(_, e)| e.deadline);
        }
        let sink = self.sink.lock();
        // Timers later than the warning threshold, and the latest: one warning per turn, not
        // one per timer, so that a backlog does not flood the log.
        let (mut late_count, mut latest) = (0usize, Duration::ZERO);
        for (shard, e) in buf.drain(..) {
            let now = self.clock.now();
            let deadline = self.ticks.instant_of(e.deadline).unwrap_or(now);
            let late = now.saturating_duration_since(deadline);
            let exp = Expiration {
                id: TimerId {
                    engine: self.engine,
                    shard,
                    key: e.key,
                },
                deadline,
                value: e.value,
            };
            let result = match sink.as_ref() {
                Some(sink) => sink.deliver(exp, || self.stopping.load(SeqCst)),
                None => Err(exp),
            };
            match result {
                Ok(()) => {
                    // Locked per record, not across the loop: a delivery blocked by
                    // backpressure must not block `stats()`.
                    self.lateness.lock().record(late);
                    if late > self.lateness_warn {
                        late_count += 1;
                        latest = latest.max(late);
                    }
                }
                Err(exp) => {
                    self.undelivered_total.fetch_add(1, SeqCst);
                    self.metrics.undelivered.increment(1);
                    let mut undelivered = self.undelivered.lock();
                    if undelivered.is_empty() && !self.stopping.load(SeqCst) {
                        // Kept for `shutdown` to hand back, so they pile up until then.
                        tracing::warn!(
                            "the receiving side of the delivery is gone: expirations are kept \
                             until shutdown() hands them back"
                        );
                    }
                    undelivered.push(exp);
                }
            }
        }
        // A burst's buffer is not kept for the life of the engine.
        if buf.capacity() > TURN_BUF_KEEP {
            buf.shrink_to(TURN_BUF_KEEP);
        }
        if late_count > 0 {
            tracing::warn!(
                timers = late_count,
                ?latest,
                threshold = ?self.lateness_warn,
                "timers delivered late"
            );
        }
        (fired, next)
    }
}

/// The driver thread: turn, then sleep until the next deadline (or until woken), and publish
/// the gauges every `metrics_interval` on the way.
pub(super) fn drive<T>(core: Arc<Core<T>>) {
    tracing::debug!(shards = core.shards.len(), "delaywheel driver started");
    // `checked_add`: an interval past what an `Instant` holds ("never") publishes nothing.
    let mut next_publish = core
        .metrics
        .every
        .and_then(|every| Instant::now().checked_add(every));
    while !core.stopping.load(SeqCst) {
        core.wake.scanning();
        let (_, next) = core.turn();
        if core.stopping.load(SeqCst) {
            break;
        }
        // The gauges, on real time (also on a manual clock: a dashboard reads them on its own).
        let publish_in = match (next_publish, core.metrics.every) {
            (Some(at), Some(every)) => {
                let now = Instant::now();
                if now >= at {
                    core.metrics.publish(&core.stats());
                    next_publish = now.checked_add(every);
                    next_publish.map(|_| every)
                } else {
                    Some(at - now)
                }
            }
            _ => None,
        };
        // Woken since the scan: its unpark may have been swallowed by a delivery that blocked
        // (crossbeam parks this thread too). One that inserts after this check still unparks
        // a park to come.
        if !core.wake.may_park(next) {
            continue;
        }
        // How long to sleep for the next deadline: `None` until woken.
        let for_timer = match next {
            None => None,
            Some(tick) => match &core.clock {
                Clock::Manual(_) => {
                    if tick > core.ticks.now_tick(core.clock.now()) {
                        None
                    } else {
                        Some(Duration::ZERO)
                    }
                }
                Clock::Monotonic => core.ticks.until(Instant::now(), tick),
            },
        };
        // A wait shorter than asked is safe: the loop turns and parks again.
        match (for_timer, publish_in) {
            (Some(d), _) if d.is_zero() => {}
            (None, None) => std::thread::park(),
            (Some(d), None) | (None, Some(d)) => std::thread::park_timeout(d),
            (Some(a), Some(b)) => std::thread::park_timeout(a.min(b)),
        }
    }
    tracing::debug!("delaywheel driver stopped");
}
