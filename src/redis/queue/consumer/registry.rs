//! [`Handlers`]: the consumer's handler table, by topic. A handler is a closure run on a
//! handler thread, or (feature `tokio`) an `async` one run on a tokio runtime; either may
//! take the payload as a type that derives `Deserialize`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::redis::envelope::Envelope;

/// What a handler returns on failure; the message becomes the retry's and the dead letter's
/// reason.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed handler future.
#[cfg(feature = "tokio")]
pub(super) type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError>> + Send>>;

/// An `async` handler: called on a handler thread, its future runs on the handler runtime.
#[cfg(feature = "tokio")]
pub(super) type AsyncHandler = Arc<dyn Fn(Envelope) -> HandlerFuture + Send + Sync>;

/// A handler run on a handler thread.
pub(super) type BlockingHandler = Arc<dyn Fn(&Envelope) -> Result<(), HandlerError> + Send + Sync>;

/// One topic's handler.
#[derive(Clone)]
pub(super) enum Handler {
    /// Runs on a handler thread.
    Blocking(BlockingHandler),
    /// See [`AsyncHandler`].
    #[cfg(feature = "tokio")]
    Async(AsyncHandler),
}

/// The handlers of a consumer, by topic.
///
/// Every kind counts against one limit,
/// [`QueueConfig::handler_threads`](crate::redis::QueueConfig::handler_threads): at most that
/// many handlers run at once, threads and futures together. An `Err`, a panic (in the closure
/// or, for an `async` handler, in its future) and a payload that does not decode are each a
/// failed attempt: retried with backoff, then dead-lettered with the error as the reason.
///
/// ```
/// use delaywheel::redis::{Envelope, Handlers};
///
/// #[derive(serde::Deserialize)]
/// struct CloseOrder { order_id: u64 }
///
/// let handlers = Handlers::new()
///     .on("audit", |task: &Envelope| {
///         println!("audit {}: {}", task.id, task.payload);
///         Ok(())
///     })
///     .on_typed("order.close", |close: CloseOrder, _task: &Envelope| {
///         println!("close order {}", close.order_id);
///         Ok(())
///     });
/// assert_eq!(format!("{handlers:?}").len() > 0, true);
/// ```
#[derive(Clone, Default)]
pub struct Handlers {
    pub(super) map: HashMap<String, Handler>,
    /// Where `async` handlers run; `None`: on a runtime the consumer owns.
    #[cfg(feature = "tokio")]
    pub(super) runtime: Option<tokio::runtime::Handle>,
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
        self.map
            .insert(topic.into(), Handler::Blocking(Arc::new(handler)));
        self
    }

    /// Runs `handler` for tasks of `topic` with the payload decoded as `T` (see
    /// [`Envelope::payload_as`]), on a handler thread. A payload that does not decode is a
    /// failed attempt whose reason is the [`PayloadError`](crate::redis::PayloadError): it is
    /// retried, then dead-lettered, never dropped.
    ///
    /// ```
    /// use delaywheel::redis::{Envelope, Handlers};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// let handlers = Handlers::new().on_typed("order.close", |close: CloseOrder, task: &Envelope| {
    ///     println!("close order {} (attempt {})", close.order_id, task.attempt);
    ///     Ok(())
    /// });
    /// # drop(handlers);
    /// ```
    pub fn on_typed<T, F>(self, topic: impl Into<String>, handler: F) -> Handlers
    where
        T: DeserializeOwned,
        F: Fn(T, &Envelope) -> Result<(), HandlerError> + Send + Sync + 'static,
    {
        self.on(topic, move |task: &Envelope| {
            let payload = task.payload_as::<T>()?;
            handler(payload, task)
        })
    }
}

#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
impl Handlers {
    /// Runs the `async` `handler` for tasks of `topic` (feature `tokio`). Its future runs on
    /// the runtime given to [`runtime`](Self::runtime), or else on one the consumer starts
    /// (as many worker threads as the machine has cores, at most `handler_threads`). It
    /// counts against `handler_threads` while it runs, and everything that holds for a thread
    /// handler holds for it: the task's lease is renewed while the future runs; a future
    /// running for [`handler_stall`](crate::redis::QueueConfig::handler_stall) with every
    /// slot taken is a stall (the consumer hands back what it holds); an `Err` or a panic is a
    /// failed attempt; `shutdown` waits for running futures until its timeout, then drops
    /// those still running and hands their tasks back to the queue.
    ///
    /// ```
    /// use delaywheel::redis::{Envelope, Handlers};
    ///
    /// let handlers = Handlers::new().on_async("order.close", |task: Envelope| async move {
    ///     // an async database or HTTP client here
    ///     println!("close {}", task.id);
    ///     Ok(())
    /// });
    /// # drop(handlers);
    /// ```
    pub fn on_async<F, Fut>(mut self, topic: impl Into<String>, handler: F) -> Handlers
    where
        F: Fn(Envelope) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let handler = move |task: Envelope| -> HandlerFuture { Box::pin(handler(task)) };
        self.map
            .insert(topic.into(), Handler::Async(Arc::new(handler)));
        self
    }

    /// [`on_async`](Self::on_async) with the payload decoded as `T` (see
    /// [`on_typed`](Self::on_typed) for a payload that does not decode).
    ///
    /// ```
    /// use delaywheel::redis::{Envelope, Handlers};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// let handlers = Handlers::new().on_async_typed(
    ///     "order.close",
    ///     |close: CloseOrder, _task: Envelope| async move {
    ///         println!("close order {}", close.order_id);
    ///         Ok(())
    ///     },
    /// );
    /// # drop(handlers);
    /// ```
    pub fn on_async_typed<T, F, Fut>(self, topic: impl Into<String>, handler: F) -> Handlers
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T, Envelope) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        self.on_async(topic, move |task: Envelope| {
            let decoded = task.payload_as::<T>();
            let handler = handler.clone();
            async move {
                match decoded {
                    Ok(payload) => handler(payload, task).await,
                    Err(e) => Err(e.into()),
                }
            }
        })
    }

    /// Runs the `async` handlers on the application's runtime, `handle` (feature `tokio`),
    /// rather than on one the consumer starts. A runtime that has shut down fails the
    /// handlers' attempts (retried, then dead-lettered), as an `Err` would. On a
    /// current-thread runtime the futures run only while its thread drives it: stop the
    /// consumer there with [`Consumer::shutdown_async`](crate::redis::Consumer::shutdown_async),
    /// not the blocking `shutdown`, which would hold that thread while it waits for them
    /// (they would then be dropped at its timeout and their tasks handed back).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use delaywheel::redis::Handlers;
    ///
    /// let handlers = Handlers::new().runtime(tokio::runtime::Handle::current());
    /// # drop(handlers);
    /// # }
    /// ```
    pub fn runtime(mut self, handle: tokio::runtime::Handle) -> Handlers {
        self.runtime = Some(handle);
        self
    }

    /// Whether any handler is `async`.
    pub(super) fn has_async(&self) -> bool {
        self.map.values().any(|h| matches!(h, Handler::Async(_)))
    }
}
