//! The engine's series in the `metrics` facade, registered once when the engine is built:
//! counters the callers and the driver increment as events happen, and gauges (pending timers
//! per shard and level, lateness) the driver sets on its own every `metrics_interval`. Each is
//! labelled with the engine's name, so that engines in one process keep series of their own.
//!
//! Registered at build: a recorder installed after the engine was built sees none of them.

use std::time::Duration;

use metrics::{Counter, Gauge};

use super::stats::Stats;

pub(crate) struct EngineMetrics {
    pub(crate) scheduled: Counter,
    pub(crate) cancelled: Counter,
    pub(crate) reset: Counter,
    pub(crate) fired: Counter,
    pub(crate) undelivered: Counter,
    pending: Gauge,
    pending_shard: Vec<Gauge>,
    pending_level: Vec<Gauge>,
    lateness: [Gauge; 3],
    /// How often the driver publishes the gauges; `None`: only [`Timer::stats`] does.
    ///
    /// [`Timer::stats`]: crate::Timer::stats
    pub(crate) every: Option<Duration>,
}

impl EngineMetrics {
    pub(crate) fn register(
        engine: &str,
        shards: usize,
        levels: usize,
        every: Option<Duration>,
    ) -> EngineMetrics {
        let label = || engine.to_owned();
        let counter = |name: &'static str| metrics::counter!(name, "engine" => label());
        let gauge = |name: &'static str| metrics::gauge!(name, "engine" => label());
        EngineMetrics {
            scheduled: counter("delaywheel_scheduled_total"),
            cancelled: counter("delaywheel_cancelled_total"),
            reset: counter("delaywheel_reset_total"),
            fired: counter("delaywheel_fired_total"),
            undelivered: counter("delaywheel_undelivered_total"),
            pending: gauge("delaywheel_pending"),
            pending_shard: (0..shards)
                .map(|s| {
                    metrics::gauge!("delaywheel_pending_shard", "engine" => label(), "shard" => s.to_string())
                })
                .collect(),
            pending_level: (0..levels)
                .map(|l| {
                    metrics::gauge!("delaywheel_pending_level", "engine" => label(), "level" => l.to_string())
                })
                .collect(),
            lateness: [
                gauge("delaywheel_lateness_p50_seconds"),
                gauge("delaywheel_lateness_p99_seconds"),
                gauge("delaywheel_lateness_max_seconds"),
            ],
            // At least 1 ms: a shorter interval would have the driver lock every shard in a
            // tight loop.
            every: every
                .filter(|d| !d.is_zero())
                .map(|d| d.max(Duration::from_millis(1))),
        }
    }

    /// Sets the gauges from a snapshot. (The counters count as events happen.)
    pub(crate) fn publish(&self, stats: &Stats) {
        self.pending.set(stats.pending() as f64);
        for (gauge, &n) in self.pending_shard.iter().zip(&stats.pending_per_shard) {
            gauge.set(n as f64);
        }
        for (gauge, &n) in self.pending_level.iter().zip(&stats.pending_per_level) {
            gauge.set(n as f64);
        }
        let l = &stats.lateness;
        for (gauge, value) in self.lateness.iter().zip([l.p50, l.p99, l.max]) {
            gauge.set(value.as_secs_f64());
        }
    }
}
