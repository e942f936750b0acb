//! An async `Stream` of expirations (feature `futures`; it works on any executor).

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use crossbeam_channel::{Receiver, TryRecvError};
use futures_core::Stream;

use super::delivery::Sink;
use super::error::BuildError;
use super::expiration::Expiration;
use super::timer::{Timer, TimerBuilder};

/// The expirations of an engine built with [`TimerBuilder::build_stream`], as a
/// `futures_core::Stream`. It ends once the engine has shut down and everything delivered has
/// been read. A [`Timer::shutdown`] called from within one of the engine's own turns (this
/// stream's waker, run by the driver thread, or [`Timer::fire_due`]) does not end it: the
/// stream ends at the next `shutdown` from outside a turn, or once the last handle is dropped.
pub struct ExpirationStream<T> {
    rx: Receiver<Expiration<T>>,
    waker: Arc<AtomicWaker>,
}

impl<T> fmt::Debug for ExpirationStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpirationStream")
            .field("buffered", &self.rx.len())
            .finish()
    }
}

// Nothing in the stream is ever pinned in place (no pin projection), so it may move freely.
impl<T> Unpin for ExpirationStream<T> {}

impl<T> Stream for ExpirationStream<T> {
    type Item = Expiration<T>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Expiration<T>>> {
        let this = self.get_mut();
        for attempt in 0..2 {
            match this.rx.try_recv() {
                Ok(e) => return Poll::Ready(Some(e)),
                Err(TryRecvError::Disconnected) => return Poll::Ready(None),
                // Register, then look again: a send between the two is not missed.
                Err(TryRecvError::Empty) if attempt == 0 => this.waker.register(cx.waker()),
                Err(TryRecvError::Empty) => {}
            }
        }
        Poll::Pending
    }
}

impl<T> Drop for ExpirationStream<T> {
    fn drop(&mut self) {
        // Sends fail once the receiver is gone, so nothing would wake the registered waker
        // again: it would only keep its task (or whatever it owns) alive until shutdown.
        drop(self.waker.take());
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "futures")))]
impl<T: Send + 'static> TimerBuilder<T> {
    /// Builds an engine whose expirations are read as an async [`ExpirationStream`], through a
    /// queue of `bound` expirations (backpressure as for a bounded channel: the driver waits,
    /// nothing is dropped). Only with the `futures` feature. A `bound` outside `1..=2^24` fails
    /// with [`BuildError::Capacity`]. Once the stream is dropped, expirations are kept and
    /// returned by [`Timer::shutdown`], as for a dropped channel receiver; those still in the
    /// stream's queue when it was dropped go with it.
    pub fn build_stream(self, bound: usize) -> Result<(Timer<T>, ExpirationStream<T>), BuildError> {
        let (tx, rx) = crossbeam_channel::bounded(super::error::capacity(bound)?);
        let waker = Arc::new(AtomicWaker::new());
        let timer = self.build_with(Sink::Stream {
            tx,
            waker: waker.clone(),
        })?;
        Ok((timer, ExpirationStream { rx, waker }))
    }
}
