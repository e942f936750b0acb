//! [`TimeoutLayer`]: a timeout on every request of a tower stack, on the engine.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tower::timeout::error::Elapsed;
use tower::{BoxError, Layer, Service};

use crate::sleep::{Sleeper, Timeout, TimeoutError};

/// A tower [`Layer`] that fails a request with tower's own [`Elapsed`] when its response
/// takes longer than `timeout`: the engine's counterpart of `tower::timeout::TimeoutLayer`,
/// with the same error type, so code that downcasts a [`BoxError`] to `Elapsed` handles both
/// the same way.
///
/// * The timer is registered lazily: a response ready at the first poll of the response
///   future costs none, and the timeout counts from the first poll at which the response
///   is pending (tower's response futures are polled as soon as they are made, so in a
///   server that is the request's start).
/// * It is cancelled when the response comes, and when the response future is dropped.
/// * `poll_ready` is the inner service's: the layer adds no buffering, so it works under
///   `load_shed` and `concurrency_limit`.
/// * If the engine has shut down, a request that is not ready at once fails with
///   [`TimeoutError::Shutdown`] (boxed): it is not left without a timeout.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use delaywheel::http::TimeoutLayer;
/// use delaywheel::sleep::Sleeper;
/// use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
///
/// let sleeper = Sleeper::new().unwrap().leak();
/// let mut svc = ServiceBuilder::new()
///     .layer(TimeoutLayer::new(sleeper, Duration::from_millis(50)))
///     .service(service_fn(|slow: bool| async move {
///         if slow {
///             std::future::pending::<()>().await;
///         }
///         Ok::<_, std::convert::Infallible>("answered")
///     }));
/// assert_eq!(svc.ready().await.unwrap().call(false).await.unwrap(), "answered");
/// let err = svc.ready().await.unwrap().call(true).await.unwrap_err();
/// assert!(err.is::<tower::timeout::error::Elapsed>());
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct TimeoutLayer {
    sleeper: Sleeper,
    timeout: Duration,
}

impl TimeoutLayer {
    /// A layer whose requests time out `timeout` after they start waiting, on `sleeper`'s
    /// engine. Any duration works: one past what an `Instant` holds never fires.
    pub fn new(sleeper: Sleeper, timeout: Duration) -> TimeoutLayer {
        TimeoutLayer { sleeper, timeout }
    }
}

impl<S> Layer<S> for TimeoutLayer {
    type Service = TimeoutService<S>;

    fn layer(&self, inner: S) -> TimeoutService<S> {
        TimeoutService {
            inner,
            sleeper: self.sleeper.clone(),
            timeout: self.timeout,
        }
    }
}

/// The service [`TimeoutLayer`] makes: `inner` with a timeout on each call. Its error is a
/// [`BoxError`]: the inner service's error, [`Elapsed`], or [`TimeoutError::Shutdown`].
#[derive(Clone, Debug)]
pub struct TimeoutService<S> {
    inner: S,
    sleeper: Sleeper,
    timeout: Duration,
}

impl<S> TimeoutService<S> {
    /// `inner` with a timeout of `timeout` on each call, on `sleeper`'s engine.
    pub fn new(inner: S, sleeper: Sleeper, timeout: Duration) -> TimeoutService<S> {
        TimeoutService {
            inner,
            sleeper,
            timeout,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, consuming the timeout.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, R> Service<R> for TimeoutService<S>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: R) -> ResponseFuture<S::Future> {
        ResponseFuture {
            inner: self.sleeper.timeout(self.timeout, self.inner.call(request)),
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of a [`TimeoutService`].
    #[must_use = "futures do nothing unless awaited"]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: Timeout<F>,
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx).map(|done| match done {
            Ok(response) => response.map_err(Into::into),
            Err(TimeoutError::Elapsed) => Err(Box::new(Elapsed::new()) as BoxError),
            Err(shutdown) => Err(Box::new(shutdown) as BoxError),
        })
    }
}
