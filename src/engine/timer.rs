//! The engine's public face: [`Timer`], its [`TimerBuilder`], and the types it hands out.
//!
//! # Ground rules
//!
//! * Each shard's wheel and counters are touched only under that shard's mutex, and no shard
//!   lock is held while another lock is taken or while delivering.
//! * Only one turn (collect due timers, deliver them) runs at a time: the driver thread's, or
//!   a caller's [`Timer::fire_due`]; `Core::turn_buf` is that turn's lock and scratch buffer,
//!   held across the turn (with `sink` held across its deliveries). `stop` takes `turn_buf`
//!   before it drains, so no collected timer is between a turn and its delivery then.
//! * The wake handshake between producers and the driver is `Wake`'s (`src/engine/wake.rs`, which has
//!   its own ground rules): a producer calls `Wake::timer_due` after its insert, with no lock
//!   held; the driver calls `Wake::scanning` before a turn and parks only if `Wake::may_park`
//!   says so after it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::{Condvar, Mutex};

use super::clock::{Clock, ManualClock, Ticks};
use super::delivery::Sink;
use super::driver::{drive, Core};
use super::error::{capacity, BuildError, ScheduleError, MAX_SHARDS, MAX_WORKERS};
use super::expiration::{Expiration, Pending, TimerId};
use super::metrics::EngineMetrics;
use super::shard::{new_shard, Shard};
use super::stats::{LatenessHistogram, Stats};
use super::wake::Wake;
use crate::wheel::Layout;

/// Shuts the engine down when the last [`Timer`] handle is dropped.
struct Handle<T> {
    core: Arc<Core<T>>,
    driver: Mutex<Option<JoinHandle<()>>>,
    /// Set once a stop has closed the delivery (joined the callback workers): a stop that
    /// finds the sink taken by another waits for it, as `shutdown` promises.
    closed: Mutex<bool>,
    closed_cv: Condvar,
    /// The callback pool's threads: a stop called from one of them must not wait for the
    /// close, which joins it.
    workers: Vec<ThreadId>,
    /// The callback pool's count of running workers: a stop that finds the pool closed by
    /// another waits for it, also for a worker the closer could not join (its own thread).
    running: Option<Arc<super::delivery::Running>>,
}

impl<T> Handle<T> {
    /// Stops the driver, takes every timer out of the shards (and every expiration that could
    /// not be handed over), and closes the delivery.
    ///
    /// Lock order: `driver` (one stopper at a time), then `turn_buf` (so that no turn is
    /// between collecting timers and delivering them while the shards are drained), then
    /// `sink`, shards and `undelivered`. The delivery is closed, which joins the callback
    /// workers, with no lock held: a callback may itself call `shutdown` or drop a handle.
    fn stop(&self) -> Vec<Pending<T>> {
        let core = &self.core;
        core.stopping.store(true, SeqCst);
        let driver = core.driver.get();
        if let Some(driver) = driver {
            driver.unpark();
        }
        if core.in_turn() || driver.is_some_and(|d| d.id() == std::thread::current().id()) {
            // Called from a delivery of this engine's turn (a waker that shuts down, or drops
            // its task and with it the last handle), on the driver thread or in a caller's
            // `fire_due`: that turn holds `turn_buf` and `sink`, and hands over the rest of
            // what it collected, or leaves it in `undelivered` for the next `shutdown`. The
            // driver stops after it; the sink is closed by a later stop, or when the engine
            // is dropped.
            return self.take_pending();
        }
        let (sink, out) = {
            let mut joined = self.driver.lock();
            if let Some(handle) = joined.take() {
                // A turn blocked by backpressure gives up once `stopping` is set.
                let _ = handle.join();
            }
            let _turn = core.turn_buf.lock();
            (core.sink.lock().take(), self.take_pending())
        };
        if let Some(sink) = sink {
            sink.close();
            *self.closed.lock() = true;
            self.closed_cv.notify_all();
        } else if !self.workers.contains(&std::thread::current().id()) {
            // Another stop took the sink and is closing it (joining the workers): this one
            // returns once that is done. (From a worker, it returns at once: the close is
            // waiting for this very thread.)
            let mut closed = self.closed.lock();
            while !*closed {
                self.closed_cv.wait(&mut closed);
            }
            drop(closed);
            // A worker that closed the pool itself (a callback that shuts down) was not
            // joined: it goes on with its callback and what is still queued.
            if let Some(running) = &self.running {
                running.wait_for_none();
            }
        }
        out
    }

    /// Takes every timer out of the shards (the first call only: none are added after it) and
    /// every expiration that could not be handed over (every call: a turn a delivery stopped
    /// from within may add some after the first).
    fn take_pending(&self) -> Vec<Pending<T>> {
        let core = &self.core;
        let mut out = Vec::new();
        let shards: &[Shard<T>] = if core.stopped.swap(true, SeqCst) {
            &[]
        } else {
            &core.shards
        };
        for (i, shard) in shards.iter().enumerate() {
            let mut s = shard.lock();
            out.extend(s.wheel.drain().map(|e| Pending {
                id: TimerId {
                    engine: core.engine,
                    shard: i as u32,
                    key: e.key,
                },
                deadline: core.ticks.instant_of(e.deadline),
                value: e.value,
            }));
        }
        out.extend(core.undelivered.lock().drain(..).map(|e| Pending {
            id: e.id,
            deadline: Some(e.deadline),
            value: e.value,
        }));
        tracing::debug!(pending = out.len(), "delaywheel shut down");
        out
    }
}

impl<T> Drop for Handle<T> {
    fn drop(&mut self) {
        let left = self.stop();
        if !left.is_empty() {
            tracing::warn!(
                dropped = left.len(),
                "last timer handle dropped with timers pending; call shutdown() to keep them"
            );
        }
    }
}

/// A thread-safe timer service: sharded wheels, a driver thread that sleeps until the next
/// deadline, and delivery to a channel, a callback pool or a stream.
///
/// Cloning is cheap and every clone drives the same engine. Dropping the last clone shuts the
/// engine down (dropping whatever is pending; call [`shutdown`](Self::shutdown) to get it back).
///
/// ```
/// use std::time::Duration;
/// use delaywheel::Timer;
///
/// let (timer, expired) = Timer::builder().build_channel(None).unwrap();
/// let id = timer.schedule("request 1", Duration::from_secs(60)).unwrap();
/// timer.schedule("request 2", Duration::from_millis(10)).unwrap();
/// assert_eq!(timer.cancel(id), Some("request 1"));
/// let fired = expired.recv().unwrap();
/// assert_eq!(fired.value, "request 2");
/// assert!(fired.deadline <= std::time::Instant::now());
/// ```
///
#[doc = include_str!("GUARANTEES.md")]
pub struct Timer<T> {
    core: Arc<Core<T>>,
    handle: Arc<Handle<T>>,
}

impl<T> Clone for Timer<T> {
    fn clone(&self) -> Self {
        Timer {
            core: self.core.clone(),
            handle: self.handle.clone(),
        }
    }
}

impl<T> fmt::Debug for Timer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timer")
            .field("shards", &self.core.shards.len())
            .field("len", &self.len())
            .finish()
    }
}

impl<T: Send + 'static> Timer<T> {
    /// A builder with the defaults: 1 ms tick, one shard per available core, the default
    /// wheel layout, the real monotonic clock, and a driver thread.
    pub fn builder() -> TimerBuilder<T> {
        TimerBuilder {
            tick: Duration::from_millis(1),
            shards: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(MAX_SHARDS),
            layout: Layout::default(),
            clock: Clock::Monotonic,
            lateness_warn: Duration::from_millis(10),
            spawn_driver: true,
            name: None,
            metrics_interval: Some(Duration::from_secs(1)),
            _t: PhantomData,
        }
    }
}

impl<T> Timer<T> {
    /// Schedules `value` to fire `delay` from now (rounded up to the tick).
    ///
    /// Any delay works: one past the wheel's range, or `Duration::MAX`, simply waits. A zero
    /// delay fires at the next tick boundary (within one tick). Errors hand the value back:
    /// [`ScheduleError::Shutdown`] after [`shutdown`](Self::shutdown), and
    /// [`ScheduleError::Capacity`] when the shard holds `u32::MAX` timers.
    pub fn schedule(&self, value: T, delay: Duration) -> Result<TimerId, ScheduleError<T>> {
        let tick = self.core.ticks.tick_after(self.core.clock.now(), delay);
        self.core.insert(tick, value)
    }

    /// Schedules `value` to fire at `at` (rounded up to the tick). An `at` in the past fires at
    /// the driver's next turn, at the latest at the next tick boundary. Errors as for
    /// [`schedule`](Self::schedule).
    pub fn schedule_at(&self, value: T, at: Instant) -> Result<TimerId, ScheduleError<T>> {
        self.core.insert(self.core.ticks.deadline_tick(at), value)
    }

    /// Cancels a pending timer and returns its value; `None` if it already fired, was
    /// cancelled, or the id is not from this engine. A timer has fired once the driver has
    /// collected it for delivery, which may be before its consumer sees it (a full bounded
    /// queue holds the driver's whole batch back): `None` means it will be delivered, not
    /// that it has been.
    pub fn cancel(&self, id: TimerId) -> Option<T> {
        let shard = self.core.shard_of(id)?;
        let mut s = shard.lock();
        let value = s.wheel.cancel(id.key)?;
        s.cancelled += 1;
        drop(s);
        self.core.metrics.cancelled.increment(1);
        Some(value)
    }

    /// Moves a pending timer to `delay` from now, keeping its id; `false` if it already fired,
    /// was cancelled, or the id is not from this engine.
    pub fn reset(&self, id: TimerId, delay: Duration) -> bool {
        self.reset_to_tick(id, || {
            self.core.ticks.tick_after(self.core.clock.now(), delay)
        })
    }

    /// Moves a pending timer to fire at `at` (rounded up to the tick), keeping its id: an O(1)
    /// move in the wheel, not a cancel and a new insert. `false` if it already fired, was
    /// cancelled, or the id is not from this engine. An `at` in the past fires at the driver's
    /// next turn.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use delaywheel::Timer;
    ///
    /// let (timer, _fired) = Timer::builder().build_channel(None).unwrap();
    /// let id = timer.schedule("idle", Duration::from_secs(60)).unwrap();
    /// let later = Instant::now() + Duration::from_secs(120);
    /// assert!(timer.reset_at(id, later));
    /// assert!(timer.deadline(id).unwrap() >= later);
    /// ```
    pub fn reset_at(&self, id: TimerId, at: Instant) -> bool {
        self.reset_to_tick(id, || self.core.ticks.deadline_tick(at))
    }

    /// Moves timer `id` to the tick `tick()` names (read once the id is known to be this
    /// engine's, before the shard lock), counts the reset, and wakes the driver for it.
    fn reset_to_tick(&self, id: TimerId, tick: impl FnOnce() -> u64) -> bool {
        let Some(shard) = self.core.shard_of(id) else {
            return false;
        };
        let tick = tick();
        let ok = {
            let mut s = shard.lock();
            let ok = s.wheel.reset(id.key, tick);
            s.reset += u64::from(ok);
            ok
        };
        if ok {
            self.core.metrics.reset.increment(1);
            self.core.wake_for(tick);
        }
        ok
    }

    /// When a pending timer is due: its deadline rounded up to the tick, as the wheel holds it.
    /// `None` if it already fired, was cancelled, the id is not from this engine, or the
    /// deadline is past what an `Instant` holds.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use delaywheel::Timer;
    ///
    /// let (timer, _fired) = Timer::builder().build_channel(None).unwrap();
    /// let at = Instant::now() + Duration::from_secs(5);
    /// let id = timer.schedule_at("request", at).unwrap();
    /// let due = timer.deadline(id).unwrap();
    /// assert!(due >= at && due - at < Duration::from_millis(1)); // the default 1 ms tick
    /// timer.cancel(id);
    /// assert_eq!(timer.deadline(id), None);
    /// ```
    pub fn deadline(&self, id: TimerId) -> Option<Instant> {
        let shard = self.core.shard_of(id)?;
        let tick = shard.lock().wheel.deadline(id.key)?;
        self.core.ticks.instant_of(tick)
    }

    /// Pending timers, over all shards.
    pub fn len(&self) -> usize {
        self.core.shards.iter().map(|s| s.lock().wheel.len()).sum()
    }

    /// Whether no timer is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The engine clock's current time.
    pub fn now(&self) -> Instant {
        self.core.clock.now()
    }

    /// Takes every timer that is due now out of the wheel and delivers it on the calling
    /// thread; returns how many it took. One it could not hand over (the receiver is gone, or
    /// the engine is shutting down) is kept for [`shutdown`](Self::shutdown) and counted in
    /// [`Stats::undelivered`](crate::Stats::undelivered), and counts here too. With
    /// [`TimerBuilder::manual_driver`] this is the only way timers fire; with the driver thread
    /// it is harmless (turns take a lock, so they never overlap). Like the driver, it waits
    /// while a bounded channel or callback queue is full: do not call it from the thread that
    /// reads that channel, or from callbacks while every worker of the pool is busy. Called
    /// from a delivery of this engine's own turn (a waker), it returns 0 at once: that turn is
    /// still delivering.
    pub fn fire_due(&self) -> usize {
        if self.core.in_turn() {
            return 0;
        }
        self.core.turn().0
    }

    /// A snapshot of the counters, pending timers per shard and level, and lateness. Its gauges
    /// are also published through the `metrics` facade (as the driver does on its own every
    /// [`metrics_interval`](TimerBuilder::metrics_interval)).
    pub fn stats(&self) -> Stats {
        let stats = self.core.stats();
        self.core.metrics.publish(&stats);
        stats
    }

    /// Stops the driver, waits for callback workers to finish what they were given, and returns
    /// every timer not delivered: those still pending and any that fired but could not be handed
    /// over (a full queue at shutdown, or a dropped receiver). Later schedules fail with
    /// [`ScheduleError::Shutdown`]; a second call returns an empty list, except after a call
    /// made from within a turn (below), whose undelivered rest it returns. It may be called
    /// from a callback: it then waits for the other workers, not for the rest of the calling
    /// worker's queue, which runs after the callback returns; but if another `shutdown` is
    /// already closing the pool, it returns at once (that one is joining this very worker,
    /// and two callbacks that both shut down would otherwise wait for each other), while
    /// other callbacks may still run. Called from the driver thread
    /// itself (a waker run by a `Sleeper`'s or a stream's delivery), it returns at once, and
    /// the turn in progress delivers the rest of what it had collected; what it cannot hand
    /// over waits for the next call (or is dropped with the engine, with a warning). Such a
    /// call does not close the delivery either: an `ExpirationStream`
    /// or a channel's receiver ends at the next call, or once the last handle is dropped. A
    /// call made while another is still waiting for the callback workers waits for them too.
    ///
    /// Two engines whose deliveries each call the other's `shutdown` (a callback or waker of
    /// one stopping the other, both at once) wait for each other's driver for ever: stop
    /// another engine from a delivery only if that engine's deliveries never stop this one.
    /// Likewise, a callback must not wait for a thread that is calling `shutdown` while
    /// another `shutdown` waits for the callbacks: each would wait for the other.
    pub fn shutdown(&self) -> Vec<Pending<T>> {
        self.handle.stop()
    }
}

/// Configures and starts a [`Timer`]. From [`Timer::builder`].
pub struct TimerBuilder<T> {
    tick: Duration,
    shards: usize,
    layout: Layout,
    clock: Clock,
    lateness_warn: Duration,
    metrics_interval: Option<Duration>,
    spawn_driver: bool,
    name: Option<Arc<str>>,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for TimerBuilder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimerBuilder")
            .field("tick", &self.tick)
            .field("shards", &self.shards)
            .field("layout", &self.layout)
            .field("clock", &self.clock)
            .field("spawn_driver", &self.spawn_driver)
            .field("name", &self.name)
            .field("metrics_interval", &self.metrics_interval)
            .finish()
    }
}

impl<T: Send + 'static> TimerBuilder<T> {
    /// The tick length (default 1 ms): deadlines round up to it. Zero is refused at build
    /// ([`BuildError::ZeroTick`]); a tick is at most `u64::MAX` ns (about 584 years), longer ones
    /// are clamped to that.
    pub fn tick(mut self, tick: Duration) -> Self {
        self.tick = tick;
        self
    }

    /// The number of shards (default: the available cores, at most 1 024). Outside `1..=1024`
    /// the build fails with [`BuildError::Shards`].
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// The wheel layout of every shard.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// Reads time from `clock` instead of the real monotonic clock; every `advance` wakes the
    /// driver.
    pub fn manual_clock(mut self, clock: &ManualClock) -> Self {
        self.clock = Clock::Manual(clock.clone());
        self
    }

    /// Delivery later than this logs a `tracing` warning (default 10 ms).
    pub fn lateness_warning(mut self, threshold: Duration) -> Self {
        self.lateness_warn = threshold;
        self
    }

    /// The value of the `engine` label on this engine's metrics (default: a number unique
    /// within the process), so that several engines in one process publish separate series
    /// rather than overwriting each other's. Any string is accepted.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(Arc::from(name.into()));
        self
    }

    /// How often the driver publishes the engine's gauges through the `metrics` facade on its
    /// own (default every second): pending timers in all (`delaywheel_pending`), per shard and
    /// per level, and the lateness percentiles. `None` or zero: only [`Timer::stats`] publishes
    /// them; under 1 ms counts as 1 ms, and one past what an `Instant` holds as `None`. The counters (`delaywheel_scheduled_total`, `_cancelled_total`, `_reset_total`,
    /// `_fired_total`, `_undelivered_total`) count as events happen, either way. The series are
    /// registered when the engine is built: install the recorder before. Without a driver
    /// ([`manual_driver`](Self::manual_driver)) nothing publishes on its own.
    ///
    /// ```
    /// use std::time::Duration;
    /// use delaywheel::Timer;
    ///
    /// let (timer, _expired) = Timer::<u32>::builder()
    ///     .name("gateway")
    ///     .metrics_interval(Some(Duration::from_millis(250)))
    ///     .build_channel(None)?;
    /// # timer.shutdown();
    /// # Ok::<(), delaywheel::BuildError>(())
    /// ```
    pub fn metrics_interval(mut self, every: Option<Duration>) -> Self {
        self.metrics_interval = every;
        self
    }

    /// Starts no driver thread: timers fire only when [`Timer::fire_due`] is called. With a
    /// [`ManualClock`], this makes tests fully deterministic.
    pub fn manual_driver(mut self) -> Self {
        self.spawn_driver = false;
        self
    }

    /// Builds an engine that sends expirations to a crossbeam channel: bounded to `bound`
    /// (backpressure: the driver waits while it is full, and never drops a timer) or unbounded
    /// with `None`. A `bound` outside `1..=2^24` fails with [`BuildError::Capacity`].
    ///
    /// Expirations the driver cannot send because the receiver was dropped are kept, and
    /// returned by [`Timer::shutdown`] (they count in [`Stats::undelivered`], and keep memory
    /// until then); those the receiver had already taken in when it was dropped go with it.
    pub fn build_channel(
        self,
        bound: Option<usize>,
    ) -> Result<(Timer<T>, Receiver<Expiration<T>>), BuildError> {
        let (tx, rx) = match bound {
            Some(n) => crossbeam_channel::bounded(capacity(n)?),
            None => crossbeam_channel::unbounded(),
        };
        Ok((self.build_with(Sink::Channel(tx))?, rx))
    }

    /// Builds an engine that runs `callback` for each expiration on a pool of `workers`
    /// threads, fed by a queue of `queue` expirations (backpressure as for a bounded channel).
    /// `workers` outside `1..=1024` fails with [`BuildError::Workers`], `queue` outside
    /// `1..=2^24` with [`BuildError::Capacity`]; on any error `callback` is dropped without
    /// having run (no timer could have reached it).
    /// A slow callback holds up only its own worker; a panicking one is logged and the worker
    /// carries on. A callback that holds a clone of the returned `Timer` keeps the engine
    /// alive (dropping the other handles does not stop it): call [`Timer::shutdown`].
    pub fn build_callback<F>(
        self,
        workers: usize,
        queue: usize,
        callback: F,
    ) -> Result<Timer<T>, BuildError>
    where
        F: Fn(Expiration<T>) + Send + Sync + 'static,
    {
        if !(1..=MAX_WORKERS).contains(&workers) {
            return Err(BuildError::Workers(workers));
        }
        let queue = capacity(queue)?;
        self.validate()?;
        let sink = Sink::pool(workers, queue, Arc::new(callback))
            .map_err(|e| BuildError::Spawn(e.to_string()))?;
        self.build_with(sink)
    }

    fn validate(&self) -> Result<(), BuildError> {
        if self.tick.is_zero() {
            return Err(BuildError::ZeroTick);
        }
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return Err(BuildError::Shards(self.shards));
        }
        Ok(())
    }

    pub(crate) fn build_with(self, sink: Sink<T>) -> Result<Timer<T>, BuildError> {
        self.validate()?;
        let origin = self.clock.now();
        static ENGINES: AtomicU32 = AtomicU32::new(0);
        let engine = ENGINES.fetch_add(1, SeqCst);
        let name = self.name.unwrap_or_else(|| Arc::from(engine.to_string()));
        let core = Arc::new(Core {
            engine,
            shards: (0..self.shards).map(|_| new_shard(self.layout)).collect(),
            ticks: Ticks::new(origin, self.tick),
            clock: self.clock.clone(),
            wake: Wake::new(),
            driver: OnceLock::new(),
            stopping: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            sink: Mutex::new(Some(sink)),
            undelivered: Mutex::new(Vec::new()),
            undelivered_total: AtomicU64::new(0),
            lateness: Mutex::new(LatenessHistogram::new()),
            lateness_warn: self.lateness_warn,
            next_shard: AtomicUsize::new(0),
            turn_buf: Mutex::new(Vec::new()),
            metrics: EngineMetrics::register(
                &name,
                self.shards,
                self.layout.levels(),
                self.metrics_interval,
            ),
        });
        let mut driver = None;
        if self.spawn_driver {
            let c = core.clone();
            let handle = std::thread::Builder::new()
                .name("delaywheel-driver".into())
                .spawn(move || drive(c))
                .map_err(|e| BuildError::Spawn(e.to_string()))?;
            let _ = core.driver.set(handle.thread().clone());
            if let Clock::Manual(clock) = &self.clock {
                let weak = Arc::downgrade(&core);
                // Dropped from the clock's list once the engine is gone.
                clock.on_advance(Arc::new(move || {
                    weak.upgrade().map(|core| core.wake_driver()).is_some()
                }));
            }
            driver = Some(handle);
        }
        let (workers, running) = core
            .sink
            .lock()
            .as_ref()
            .map_or_else(|| (Vec::new(), None), |s| (s.worker_ids(), s.running()));
        let handle = Arc::new(Handle {
            core: core.clone(),
            driver: Mutex::new(driver),
            closed: Mutex::new(false),
            closed_cv: Condvar::new(),
            workers,
            running,
        });
        Ok(Timer { core, handle })
    }
}
