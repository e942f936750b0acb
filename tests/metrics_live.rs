//! The engine publishes its metrics on its own, without `stats()` being called: counters as
//! events happen, gauges from the driver every `metrics_interval`. Read from a debugging
//! recorder. (Its own binary: the recorder is process-global.)

use std::collections::HashMap;
use std::time::{Duration, Instant};

use delaywheel::Timer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// `(name, engine label)` → counter total (accumulated: the recorder hands out deltas), and
/// the gauges set since the last read (it swaps each gauge to 0 as it reads it, so a gauge
/// shows only if it was set since).
#[derive(Default)]
struct Seen {
    counters: HashMap<(String, String), u64>,
    gauges: HashMap<(String, String, String), f64>,
}

impl Seen {
    fn read(&mut self, snapshotter: &Snapshotter) {
        self.gauges.clear();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let label = |name: &str| {
                key.key()
                    .labels()
                    .find(|l| l.key() == name)
                    .map_or(String::new(), |l| l.value().to_string())
            };
            let name = key.key().name().to_string();
            let engine = label("engine");
            match value {
                DebugValue::Counter(c) => *self.counters.entry((name, engine)).or_default() += c,
                DebugValue::Gauge(g) => {
                    let part = format!("{}{}", label("shard"), label("level"));
                    self.gauges.insert((name, engine, part), g.into_inner());
                }
                DebugValue::Histogram(_) => {}
            }
        }
    }

    fn counter(&self, name: &str, engine: &str) -> u64 {
        self.counters
            .get(&(name.to_string(), engine.to_string()))
            .copied()
            .unwrap_or(0)
    }

    fn gauge(&self, name: &str, engine: &str) -> Option<f64> {
        self.gauges
            .get(&(name.to_string(), engine.to_string(), String::new()))
            .copied()
    }
}

fn wait_for(what: &str, snapshotter: &Snapshotter, seen: &mut Seen, f: impl Fn(&Seen) -> bool) {
    let start = Instant::now();
    loop {
        seen.read(snapshotter);
        if f(seen) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}: {:?} {:?}",
            seen.counters,
            seen.gauges
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn counters_count_as_events_happen_and_the_driver_publishes_the_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");
    let mut seen = Seen::default();

    let (timer, expired) = Timer::builder()
        .name("live")
        .shards(2)
        .metrics_interval(Some(Duration::from_millis(20)))
        .build_channel(None)
        .unwrap();
    let a = timer.schedule(1u32, Duration::from_secs(60)).unwrap();
    timer.schedule(2u32, Duration::from_millis(1)).unwrap();
    let c = timer.schedule(3u32, Duration::from_secs(60)).unwrap();
    timer.cancel(a);
    assert!(timer.reset(c, Duration::from_secs(120)));
    expired.recv_timeout(Duration::from_secs(10)).unwrap();
    // Never `stats()` in this test.
    wait_for(
        "the counters and the gauges",
        &snapshotter,
        &mut seen,
        |s| {
            s.counter("delaywheel_scheduled_total", "live") == 3
                && s.counter("delaywheel_cancelled_total", "live") == 1
                && s.counter("delaywheel_reset_total", "live") == 1
                && s.counter("delaywheel_fired_total", "live") == 1
                && s.gauge("delaywheel_pending", "live") == Some(1.0)
                && s.gauge("delaywheel_lateness_p99_seconds", "live").is_some()
        },
    );
    // Per shard and per level, one timer in all.
    wait_for("the shard and level gauges", &snapshotter, &mut seen, |s| {
        let sum = |name: &str| -> Option<f64> {
            let v: Vec<f64> = s
                .gauges
                .iter()
                .filter(|((n, e, _), _)| n == name && e == "live")
                .map(|(_, v)| *v)
                .collect();
            (!v.is_empty()).then(|| v.iter().sum())
        };
        sum("delaywheel_pending_shard") == Some(1.0) && sum("delaywheel_pending_level") == Some(1.0)
    });
    // A change shows at the next interval, still with nobody polling.
    for i in 0..4 {
        timer.schedule(10 + i, Duration::from_secs(60)).unwrap();
    }
    wait_for(
        "the pending gauge to follow",
        &snapshotter,
        &mut seen,
        |s| {
            s.gauge("delaywheel_pending", "live") == Some(5.0)
                && s.counter("delaywheel_scheduled_total", "live") == 7
        },
    );

    // With the interval off, the counters still count as events happen; no gauge is set.
    let (quiet, expired) = Timer::builder()
        .name("quiet")
        .metrics_interval(None)
        .build_channel(None)
        .unwrap();
    quiet.schedule(1u32, Duration::from_millis(1)).unwrap();
    quiet.schedule(2u32, Duration::from_secs(60)).unwrap();
    expired.recv_timeout(Duration::from_secs(10)).unwrap();
    wait_for(
        "the quiet engine's counters",
        &snapshotter,
        &mut seen,
        |s| {
            s.counter("delaywheel_scheduled_total", "quiet") == 2
                && s.counter("delaywheel_fired_total", "quiet") == 1
        },
    );
    std::thread::sleep(Duration::from_millis(100));
    seen.read(&snapshotter);
    // (Registered at build, so the recorder lists it, at 0: never set.)
    assert_eq!(
        seen.gauge("delaywheel_pending", "quiet").unwrap_or(0.0),
        0.0,
        "{:?}",
        seen.gauges
    );
    // `stats()` still publishes them.
    quiet.stats();
    seen.read(&snapshotter);
    assert_eq!(seen.gauge("delaywheel_pending", "quiet"), Some(1.0));
    timer.shutdown();
    quiet.shutdown();
}

/// An interval past what an `Instant` holds (a way to say "never") publishes nothing and
/// leaves the driver firing timers; one under a millisecond does not make it spin.
#[test]
fn extreme_metrics_intervals_leave_the_driver_working() {
    for every in [Duration::MAX, Duration::from_nanos(1)] {
        let (timer, expired) = Timer::builder()
            .metrics_interval(Some(every))
            .build_channel(None)
            .unwrap();
        timer.schedule(1u32, Duration::from_millis(5)).unwrap();
        let fired = expired.recv_timeout(Duration::from_secs(10));
        assert_eq!(fired.map(|e| e.value), Ok(1), "{every:?}");
        timer.shutdown();
    }
}
