//! The measuring rounds the persistence reports share (`persist_report` on Redis, `pg_report`
//! on PostgreSQL), so both measure the same thing the same way. (`#[path]` include.)

use std::time::{Duration, Instant};

use delaywheel::redis::{Persistent, TaskStore};
use delaywheel::Timer;

/// The median of `v` (the upper one of an even count); `v` must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One round of schedule + cancel pairs on an in-memory `Timer<String>`, one per id, 1 h
/// timers: ns per pair.
pub fn timer_pairs_ns(timer: &Timer<String>, ids: &[String]) -> f64 {
    let t = Instant::now();
    for id in ids {
        let h = timer
            .schedule(id.clone(), Duration::from_secs(3_600))
            .expect("schedule");
        timer.cancel(h);
    }
    t.elapsed().as_nanos() as f64 / ids.len() as f64
}

/// One round of schedule + cancel pairs through a `Persistent` engine, one per id, a null
/// payload due at `due_ms`: ns per pair.
pub fn persistent_pairs_ns<S: TaskStore>(p: &Persistent<S>, ids: &[String], due_ms: u64) -> f64 {
    let t = Instant::now();
    for id in ids {
        p.schedule_at_ms(id.clone(), "order.close", serde_json::Value::Null, due_ms)
            .expect("schedule");
        p.cancel(id);
    }
    t.elapsed().as_nanos() as f64 / ids.len() as f64
}

/// How long a flush of everything journaled takes; panics if it takes over `timeout`.
pub fn timed_flush<S: TaskStore>(p: &Persistent<S>, timeout: Duration) -> Duration {
    let t = Instant::now();
    assert!(p.flush(timeout), "flush timed out");
    t.elapsed()
}
