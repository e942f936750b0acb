//! Observability: the `stats()` snapshot and the lateness histogram. (The `metrics` series are
//! in [`metrics`](super::metrics).)

use std::time::Duration;

use hdrhistogram::Histogram;

/// A snapshot of an engine's state, from [`Timer::stats`](crate::Timer::stats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Pending timers in each shard.
    pub pending_per_shard: Vec<usize>,
    /// Pending timers on each wheel level, summed over shards (index 0 = lowest level); timers
    /// due but not yet delivered and timers in the overflow tier are not on a level.
    pub pending_per_level: Vec<usize>,
    /// Timers scheduled since start.
    pub scheduled: u64,
    /// Timers cancelled before they fired.
    pub cancelled: u64,
    /// Successful resets.
    pub reset: u64,
    /// Timers taken out of the wheel because they were due (delivered or not).
    pub fired: u64,
    /// Fired timers that could not be handed to the delivery: its receiving side was gone,
    /// or a bounded queue was still full at shutdown. [`shutdown`](crate::Timer::shutdown)
    /// hands them back.
    pub undelivered: u64,
    /// Lateness of the fired timers handed to the delivery: the time each was handed over −
    /// its deadline (rounded up to the tick). Read as each is handed over, before its own
    /// send: a full channel or queue that held up earlier timers of the same turn makes it
    /// late too.
    pub lateness: Lateness,
}

impl Stats {
    /// All pending timers.
    pub fn pending(&self) -> usize {
        self.pending_per_shard.iter().sum()
    }
}

/// Lateness percentiles: how long after its deadline each timer was handed to the delivery
/// (channel send, callback queue or stream). Recorded with microsecond resolution, up to one
/// hour: a timer later than that counts as one hour late.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lateness {
    /// Timers recorded.
    pub count: u64,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Maximum (at most one hour, see above).
    pub max: Duration,
}

/// The driver's lateness histogram, in microseconds (up to an hour; beyond saturates).
#[derive(Debug)]
pub(crate) struct LatenessHistogram(Histogram<u64>);

const MAX_US: u64 = 3_600_000_000;

impl LatenessHistogram {
    pub(crate) fn new() -> LatenessHistogram {
        // 3 significant digits, 1 µs .. 1 h: a few tens of KiB. These bounds are valid
        // constants (`new_with_bounds` only fails for low < 1, high < 2 × low or sigfig > 5).
        LatenessHistogram(
            Histogram::new_with_bounds(1, MAX_US, 3).expect("constant histogram bounds are valid"),
        )
    }

    pub(crate) fn record(&mut self, late: Duration) {
        // 0 (on time) is recorded as 0: values under the 1 µs bound go in its first bucket.
        let us = u64::try_from(late.as_micros())
            .unwrap_or(MAX_US)
            .min(MAX_US);
        self.0.saturating_record(us);
    }

    pub(crate) fn snapshot(&self) -> Lateness {
        let us = |v: u64| Duration::from_micros(v);
        Lateness {
            count: self.0.len(),
            p50: us(self.0.value_at_quantile(0.5)),
            p99: us(self.0.value_at_quantile(0.99)),
            max: us(self.0.max()),
        }
    }
}
