//! Where expired timers go: a crossbeam channel, a callback pool, or (feature `futures`) a
//! stream. The driver hands each batch over after releasing every shard lock.
//!
//! A bounded channel or pool queue that is full blocks the driver: that is the backpressure.
//! Nothing is dropped; the driver re-checks for shutdown every few milliseconds while it waits,
//! and an expiration it could not hand over is returned by `shutdown()`.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{SendTimeoutError, Sender, TrySendError};
use parking_lot::{Condvar, Mutex};

use super::expiration::Expiration;

/// How long a blocked send waits before looking at the shutdown flag again.
const SEND_RECHECK: Duration = Duration::from_millis(5);

pub(crate) enum Sink<T> {
    Channel(Sender<Expiration<T>>),
    Pool {
        tx: Sender<Expiration<T>>,
        workers: Vec<JoinHandle<()>>,
        running: Arc<Running>,
    },
    /// Runs on the driver thread itself: only for work that cannot block (waking a future).
    #[cfg_attr(not(feature = "futures"), allow(dead_code))]
    Inline(Arc<dyn Fn(Expiration<T>) + Send + Sync>),
    #[cfg(feature = "futures")]
    Stream {
        tx: Sender<Expiration<T>>,
        waker: Arc<atomic_waker::AtomicWaker>,
    },
}

/// How many of a callback pool's workers have not exited. A stop that finds the pool closed by
/// another waits for none to be left: the closer cannot join a worker it runs on (a callback
/// that shuts its engine down), and that worker goes on with the rest of its callback and the
/// expirations still queued.
#[derive(Default)]
pub(crate) struct Running {
    n: Mutex<usize>,
    none_left: Condvar,
}

impl Running {
    /// Blocks until every worker has exited.
    pub(crate) fn wait_for_none(&self) {
        let mut n = self.n.lock();
        while *n > 0 {
            self.none_left.wait(&mut n);
        }
    }

    fn exited(&self) {
        let mut n = self.n.lock();
        *n -= 1;
        if *n == 0 {
            self.none_left.notify_all();
        }
    }
}

/// Counts its worker out when the worker's thread ends.
struct Exit(Arc<Running>);

impl Drop for Exit {
    fn drop(&mut self) {
        self.0.exited();
    }
}

impl<T> fmt::Debug for Sink<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Sink::Channel(_) => "Sink::Channel",
            Sink::Pool { .. } => "Sink::Pool",
            Sink::Inline(_) => "Sink::Inline",
            #[cfg(feature = "futures")]
            Sink::Stream { .. } => "Sink::Stream",
        })
    }
}

impl<T: Send + 'static> Sink<T> {
    /// A pool of `workers` threads running `f`, fed through a queue of `bound` expirations.
    pub(crate) fn pool(
        workers: usize,
        bound: usize,
        f: Arc<dyn Fn(Expiration<T>) + Send + Sync>,
    ) -> std::io::Result<Sink<T>> {
        let (tx, rx) = crossbeam_channel::bounded::<Expiration<T>>(bound);
        let mut handles = Vec::with_capacity(workers);
        let running = Arc::new(Running::default());
        for i in 0..workers {
            let rx = rx.clone();
            let f = f.clone();
            // Counted in before the spawn, so that it cannot exit before it is counted; out
            // again if the spawn fails.
            *running.n.lock() += 1;
            let exit = Exit(running.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("delaywheel-cb-{i}"))
                    .spawn(move || {
                        // Declared in this order so that they drop in the other: the callback
                        // (and whatever it holds) is gone before the worker counts itself out,
                        // as it is before a `join` returns.
                        let _exit = exit;
                        let f = f;
                        for exp in rx {
                            let id = exp.id;
                            // A panicking callback must not take the worker (and every later
                            // timer on it) down with it.
                            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(exp))) {
                                tracing::error!(?id, "timer callback panicked");
                                forget_panic(payload);
                            }
                        }
                    })?,
            );
        }
        Ok(Sink::Pool {
            tx,
            workers: handles,
            running,
        })
    }
}

impl<T> Sink<T> {
    /// Hands one expiration over, blocking while a bounded queue is full. Gives it back when
    /// the receiving side is gone, or when `stopping()` turns true while blocked.
    pub(crate) fn deliver(
        &self,
        exp: Expiration<T>,
        stopping: impl Fn() -> bool,
    ) -> Result<(), Expiration<T>> {
        let tx = match self {
            Sink::Inline(f) => {
                contained("an inline delivery", || f(exp));
                return Ok(());
            }
            Sink::Channel(tx) | Sink::Pool { tx, .. } => tx,
            #[cfg(feature = "futures")]
            Sink::Stream { tx, .. } => tx,
        };
        let mut exp = exp;
        loop {
            if stopping() {
                // Shutting down: one last try, then hand it back rather than wait.
                match tx.try_send(exp) {
                    Ok(()) => break,
                    Err(TrySendError::Full(back) | TrySendError::Disconnected(back)) => {
                        return Err(back)
                    }
                }
            }
            match tx.send_timeout(exp, SEND_RECHECK) {
                Ok(()) => break,
                Err(SendTimeoutError::Timeout(back)) => exp = back,
                Err(SendTimeoutError::Disconnected(back)) => return Err(back),
            }
        }
        #[cfg(feature = "futures")]
        if let Sink::Stream { waker, .. } = self {
            contained("the stream's waker", || waker.wake());
        }
        Ok(())
    }

    /// The callback pool's worker threads (none for the other deliveries).
    pub(crate) fn worker_ids(&self) -> Vec<std::thread::ThreadId> {
        match self {
            Sink::Pool { workers, .. } => workers.iter().map(|w| w.thread().id()).collect(),
            _ => Vec::new(),
        }
    }

    /// The callback pool's count of running workers (none for the other deliveries).
    pub(crate) fn running(&self) -> Option<Arc<Running>> {
        match self {
            Sink::Pool { running, .. } => Some(running.clone()),
            _ => None,
        }
    }

    /// Closes the queue and waits for pool workers to finish what was queued.
    pub(crate) fn close(self) {
        match self {
            Sink::Pool { tx, workers, .. } => {
                drop(tx);
                let me = std::thread::current().id();
                for w in workers {
                    // A callback that drops the last handle runs on a worker: don't join itself.
                    if w.thread().id() != me {
                        let _ = w.join();
                    }
                }
            }
            #[cfg(feature = "futures")]
            Sink::Stream { tx, waker } => {
                drop(tx);
                contained("the stream's waker", || waker.wake());
            }
            Sink::Channel(_) | Sink::Inline(_) => {}
        }
    }
}

/// Runs user code (a callback, a waker): a panic in it is logged and contained. On the driver
/// thread it cannot end the driver and leave every other timer unfired; in a shutdown or a
/// drop it cannot escape library code (or abort the process, in a drop during unwinding).
pub(crate) fn contained(what: &str, f: impl FnOnce()) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
        tracing::error!("{what} panicked; carried on");
        forget_panic(payload);
    }
}

/// Drops a caught panic's payload, whose own `Drop` may panic too (a payload is any type): that
/// second panic is contained here, and its payload leaked rather than dropped.
pub(crate) fn forget_panic(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}
