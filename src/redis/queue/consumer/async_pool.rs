//! The slots `async` handlers run in (feature `tokio`): `handler_threads` permits, the runtime
//! their futures run on, and the futures running now, so that `shutdown` can wait for them
//! and, past its timeout, drop them and hand their tasks back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// `K`: what a running future's task is known by (for the consumer, what a hand-back needs).
pub(super) struct AsyncPool<K> {
    /// `handler_threads` slots: a handler of either kind holds one while it runs.
    slots: Arc<Slots>,
    /// Where the futures run.
    pub(super) handle: tokio::runtime::Handle,
    /// The futures running now, by a number of their own, with their tasks.
    /// (An abort handle is `None` for the moment between the spawn and its registration.)
    running: Mutex<HashMap<u64, (K, Option<tokio::task::AbortHandle>)>>,
    next: AtomicU64,
}

impl<K: Send + 'static> AsyncPool<K> {
    pub(super) fn new(size: usize, handle: tokio::runtime::Handle) -> AsyncPool<K> {
        AsyncPool {
            slots: Arc::new(Slots {
                state: Mutex::new(SlotState {
                    free: size,
                    closed: false,
                }),
                freed: Condvar::new(),
            }),
            handle,
            running: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Waits (blocking this handler thread) for a free slot; `None` once the pool is closed.
    pub(super) fn acquire(&self) -> Option<Slot> {
        let mut state = self.slots.state.lock();
        loop {
            if state.closed {
                return None;
            }
            if state.free > 0 {
                state.free -= 1;
                return Some(Slot(self.slots.clone()));
            }
            self.slots.freed.wait(&mut state);
        }
    }

    /// Refuses every slot from now on, and wakes the threads waiting for one.
    pub(super) fn close(&self) {
        self.slots.state.lock().closed = true;
        self.slots.freed.notify_all();
    }

    /// Spawns `fut`, the handler of `task`, on the pool's runtime, registered as running
    /// until it ends or is dropped (also unpolled, by a runtime that has shut down). `false`
    /// if `Handle::spawn` panicked.
    pub(super) fn spawn<F>(self: &Arc<Self>, task: K, fut: F) -> bool
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let n = self.next.fetch_add(1, Relaxed);
        // Registered before the spawn, and not under the lock: a runtime that has shut down
        // drops the future inside `spawn`, and its guard takes the lock to unregister it.
        self.running.lock().insert(n, (task, None));
        let done = Finished(self.clone(), n);
        let spawned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.handle.spawn(async move {
                let _done = done;
                fut.await
            })
        }));
        match spawned {
            Ok(join) => {
                let mut running = self.running.lock();
                match running.get_mut(&n) {
                    Some(entry) => entry.1 = Some(join.abort_handle()),
                    // Drained by `abort_running` (shutdown gave up, or an abort) while it was
                    // being spawned, its task handed back: it must not run on. (A no-op if it
                    // has ended already.)
                    None => join.abort(),
                }
                true
            }
            Err(payload) => {
                self.running.lock().remove(&n);
                crate::engine::delivery::forget_panic(payload);
                false
            }
        }
    }

    /// Waits up to `timeout` for every running future to end. Blocking; only once no new
    /// future can start (the timer's callbacks are done).
    pub(super) fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.running.lock().is_empty() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Drops every future still running; returns their tasks, to hand back.
    pub(super) fn abort_running(&self) -> Vec<K> {
        let running: Vec<_> = self
            .running
            .lock()
            .drain()
            .map(|(_, entry)| entry)
            .collect();
        // Out of the lock: a future dropped by its abort unregisters itself.
        running
            .into_iter()
            .map(|(task, abort)| {
                // One still being spawned is aborted by `spawn` once it finds its entry gone.
                if let Some(abort) = abort {
                    abort.abort();
                }
                task
            })
            .collect()
    }
}

/// Takes a future out of the running set when it ends, or is dropped (aborted, or its runtime
/// shut down).
struct Finished<K>(Arc<AsyncPool<K>>, u64);

impl<K> Drop for Finished<K> {
    fn drop(&mut self) {
        self.0.running.lock().remove(&self.1);
    }
}

struct SlotState {
    free: usize,
    closed: bool,
}

struct Slots {
    state: Mutex<SlotState>,
    freed: Condvar,
}

/// A slot held by a running handler, given back when dropped.
pub(super) struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.state.lock().free += 1;
        self.0.freed.notify_one();
    }
}
