//! [`FiredStream`]: a persistent engine's fired tasks as an async `Stream` (feature
//! `futures`), beside the crossbeam `Receiver` that [`Persistent::start`] returns.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crossbeam_channel::{Receiver, TryRecvError};
use futures_core::Stream;

use crate::redis::envelope::Envelope;

use super::engine::Persistent;
use super::state::Inner;
use super::task_store::TaskStore;

/// The fired tasks of a [`Persistent`] engine as a `futures_core::Stream`, read on any
/// executor: made by [`Persistent::stream`] from the receiver its `start` returned. It ends
/// once the engine has shut down and every task delivered before has been read. Acknowledge
/// each task with [`Persistent::ack`] as from the receiver.
pub struct FiredStream {
    rx: Receiver<Envelope>,
    inner: Arc<Inner>,
}

impl fmt::Debug for FiredStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FiredStream")
            .field("buffered", &self.rx.len())
            .finish()
    }
}

impl Stream for FiredStream {
    type Item = Envelope;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Envelope>> {
        let this = self.get_mut();
        for attempt in 0..2 {
            match this.rx.try_recv() {
                Ok(task) => return Poll::Ready(Some(task)),
                Err(TryRecvError::Disconnected) => return Poll::Ready(None),
                Err(TryRecvError::Empty) if *this.inner.shutdown_done.lock() => {
                    return Poll::Ready(None)
                }
                // Register, then look again: a task sent between the two is not missed.
                Err(TryRecvError::Empty) if attempt == 0 => {
                    this.inner.fired_waker.register(cx.waker())
                }
                Err(TryRecvError::Empty) => {}
            }
        }
        Poll::Pending
    }
}

impl Drop for FiredStream {
    fn drop(&mut self) {
        // Nothing would wake the registered waker again: it would only keep its task alive.
        drop(self.inner.fired_waker.take());
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "futures")))]
impl<S: TaskStore> Persistent<S> {
    /// Turns `fired`, the receiver this engine's [`start`](Persistent::start) (or
    /// [`with_store`](Persistent::with_store)) returned, into an async [`FiredStream`]
    /// (feature `futures`). Tasks are read from it as from the receiver, with the same
    /// backpressure; the engine wakes the stream's task when it sends one. One stream per
    /// engine: the engine keeps one waker, so of two streams (on clones of the receiver) only
    /// the one polled last is woken. The stream is woken only by this engine: given another
    /// engine's receiver, it reads that engine's tasks only when this one fires or shuts
    /// down.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::PersistError> {
    /// use std::time::Duration;
    /// use futures_util::StreamExt;
    /// use delaywheel::redis::{PersistConfig, Persistent};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let (engine, fired) = Persistent::start(PersistConfig::new(&url, "doc-stream"))?;
    /// # engine.restore(1_000)?;
    /// engine.schedule("order:42", "order.close", serde_json::Value::Null, Duration::from_millis(5))?;
    /// let mut fired = engine.stream(fired);
    /// while let Some(task) = fired.next().await {
    ///     // close the order if it is still unpaid, then:
    ///     engine.ack(&task);
    /// #   break;
    /// }
    /// # engine.shutdown();
    /// # Ok(())
    /// # }
    /// ```
    pub fn stream(&self, fired: Receiver<Envelope>) -> FiredStream {
        FiredStream {
            rx: fired,
            inner: self.inner.clone(),
        }
    }
}
