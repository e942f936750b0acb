//! `Producer::reschedule` and `promote`: a queued task moves, keeps its envelope, and fires
//! at its new time, never at its old one; a claimed, dead or unknown one is refused.
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{
    now_ms, Consumer, QueueError, Rescheduled, RetryPolicy, TaskState, When, MAX_DUE_MS,
};
use queue_kit::*;

#[test]
fn a_rescheduled_task_fires_at_its_new_time_and_a_promoted_one_at_once() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("resched", |cfg| cfg.shards = 2);
    let now = now_ms();
    // `later` was due in 300 ms, now in 1.5 s; `sooner` was due in an hour, now in 400 ms;
    // `promoted` was due in an hour, now at once.
    enqueue_all(
        &rt,
        &p,
        "job",
        vec![
            ("later".into(), now + 300),
            ("sooner".into(), now + 3_600_000),
            ("promoted".into(), now + 3_600_000),
        ],
    );
    let later_at = now + 1_500;
    let sooner_at = now + 400;
    let moved = |id: &str, at: u64| rt.block_on(p.reschedule(id, When::AtMs(at))).unwrap();
    assert_eq!(moved("later", later_at), Rescheduled::Queued);
    assert_eq!(moved("sooner", sooner_at), Rescheduled::Queued);
    let promoted_at = now_ms();
    assert_eq!(
        rt.block_on(p.promote("promoted")).unwrap(),
        Rescheduled::Queued
    );
    // The envelope follows its score.
    let t = rt.block_on(p.get("later")).unwrap().unwrap();
    assert_eq!(
        (t.due_at, t.envelope.unwrap().due_at),
        (Some(later_at), later_at)
    );
    // The consumer starts after the moves: one running would have claimed `later` already
    // (due within its lookahead), and a claimed task cannot be moved.
    let fired: Fired = Arc::default();
    let c = Consumer::start(cfg.clone(), recorder(&fired, 0, "job")).unwrap();
    wait_until("all three", || fired.lock().len() == 3);
    let at = |id: &str| fired.lock()[id][0].1 / 1_000;
    assert!(at("later") >= later_at, "fired at its old time");
    assert!(
        at("sooner") >= sooner_at && at("sooner") < sooner_at + 500,
        "sooner at {}",
        at("sooner")
    );
    assert!(at("promoted") >= promoted_at && at("promoted") < promoted_at + 500);
    for (id, d) in fired.lock().iter() {
        assert_eq!(d.len(), 1, "{id} fired {} times", d.len());
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_claimed_task_is_taken_back_as_replace_does_and_dead_or_unknown_ones_are_left() {
    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("resched-states", |cfg| {
        cfg.lookahead = Duration::from_secs(60);
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        };
    });
    assert_eq!(
        rt.block_on(p.reschedule("unknown", When::AtMs(now_ms())))
            .unwrap(),
        Rescheduled::NotFound
    );
    assert_eq!(
        rt.block_on(p.promote("unknown")).unwrap(),
        Rescheduled::NotFound
    );
    // Claimed a minute ahead by a consumer that is then stopped without handing it back
    // (`abort`, as a crash): promoted, it is queued again and fires on another consumer now.
    let first = Consumer::start(cfg.clone(), recorder(&Fired::default(), 0, "job")).unwrap();
    claimed_by(&rt, &p, &first, "held", 1, now_ms() + 30_000);
    first.abort();
    let promoted_at = now_ms();
    assert_eq!(
        rt.block_on(p.promote("held0")).unwrap(),
        Rescheduled::Leased
    );
    let t = rt.block_on(p.get("held0")).unwrap().unwrap();
    assert_eq!(t.state, TaskState::Scheduled);
    let fired: Fired = Arc::default();
    let second = Consumer::start(cfg.clone(), recorder(&fired, 1, "job")).unwrap();
    wait_until("the promoted task", || fired.lock().contains_key("held0"));
    let at = fired.lock()["held0"][0].1 / 1_000;
    assert!(
        at >= promoted_at && at < promoted_at + 5_000,
        "fired at {at}, promoted at {promoted_at}"
    );
    // Dead-lettered: left as it is.
    enqueue_all(&rt, &p, "nobody", vec![("dead0".into(), now_ms())]);
    wait_until("the dead letter", || {
        rt.block_on(p.depth()).unwrap().dead == 1
    });
    assert_eq!(rt.block_on(p.promote("dead0")).unwrap(), Rescheduled::Dead);
    assert!(matches!(
        rt.block_on(p.get("dead0")).unwrap().unwrap().state,
        TaskState::Dead { .. }
    ));
    // A time past what a score holds: refused with the id and the time handed back.
    enqueue_all(&rt, &p, "job", vec![("far".into(), now_ms() + 40_000_000)]);
    match rt.block_on(p.reschedule("far", When::AtMs(MAX_DUE_MS + 1))) {
        Err(QueueError::DueTooLate { id, due }) => {
            assert_eq!((id.as_str(), due), ("far", MAX_DUE_MS + 1))
        }
        other => panic!("{other:?}"),
    }
    second.shutdown(Duration::from_secs(5)).unwrap();
}
