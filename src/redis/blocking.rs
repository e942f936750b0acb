//! Waiting for the Redis layer's own runtime from synchronous calls.

use std::future::Future;

/// Runs `fut` on `rt` and blocks this thread until it is done. Unlike
/// `Runtime::block_on`, this works from a thread that is inside another tokio runtime (an
/// `async fn` calling `Consumer::start`, say). `None` if the runtime shut down first.
pub(crate) fn wait_on<F>(rt: &tokio::runtime::Runtime, fut: F) -> Option<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = crossbeam_channel::bounded(1);
    rt.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().ok()
}

/// Stops a runtime without blocking when called from async code (where dropping it or
/// `shutdown_timeout` would panic): there its worker is left to wind down in the background.
pub(crate) fn stop_runtime(rt: tokio::runtime::Runtime, timeout: std::time::Duration) {
    if tokio::runtime::Handle::try_current().is_ok() {
        rt.shutdown_background();
    } else {
        rt.shutdown_timeout(timeout);
    }
}

/// A runtime that stops with [`stop_runtime`] when dropped, so the value holding it may be
/// dropped anywhere, async code included.
pub(crate) struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl OwnedRuntime {
    pub(crate) fn new(rt: tokio::runtime::Runtime) -> OwnedRuntime {
        OwnedRuntime(Some(rt))
    }

    /// Stops without waiting for anything (an abort).
    pub(crate) fn shutdown_background(mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl std::ops::Deref for OwnedRuntime {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        // Only `drop` takes the runtime out.
        self.0
            .as_ref()
            .expect("the runtime lives as long as its owner")
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            stop_runtime(rt, std::time::Duration::from_secs(1));
        }
    }
}
