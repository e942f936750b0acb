//! What each command does, given a connected producer.

use std::time::{Duration, Instant};

use delaywheel::redis::{ListCursor, ListState, Producer, QueueError};
use serde_json::json;

use crate::output::{print_page, print_task, shown};
use crate::{fail, Command, Exit, State};

pub(crate) async fn run(p: &Producer, command: Command, json_out: bool) -> Exit {
    match command {
        Command::Stats => stats(p, json_out).await,
        Command::Ls {
            state,
            limit,
            cursor,
        } => ls(p, state, limit as usize, cursor.as_deref(), json_out).await,
        Command::Get { id } => match p.get(&id).await {
            Ok(Some(task)) => {
                print_task(&task, json_out);
                Exit::Done
            }
            Ok(None) => not_found(&id, json_out),
            Err(e) => fail("get failed", &e),
        },
        Command::Cancel { id } => match p.cancel(&id).await {
            Ok(true) => done(
                json_out,
                json!({ "cancelled": id }),
                &format!("cancelled {id}"),
            ),
            Ok(false) => not_found(&id, json_out),
            Err(e) => fail("cancel failed", &e),
        },
        Command::Requeue {
            id: Some(id),
            all_dead: false,
            ..
        } => match p.requeue(&id).await {
            Ok(true) => done(
                json_out,
                json!({ "requeued": id }),
                &format!("requeued {id}"),
            ),
            Ok(false) => not_found(&id, json_out),
            Err(e) => fail(&format!("requeue of {id} refused"), &e),
        },
        Command::Requeue { rate, .. } => requeue_all(p, rate, json_out).await,
        Command::Pause => match p.pause().await {
            Ok(()) => done(json_out, json!({ "paused": true }), "paused"),
            Err(e) => fail("pause failed", &e),
        },
        Command::Resume => match p.resume().await {
            Ok(was) => done(
                json_out,
                json!({ "paused": false, "was_paused": was }),
                if was { "resumed" } else { "was not paused" },
            ),
            Err(e) => fail("resume failed", &e),
        },
        Command::Schedules => match p.periodics().await {
            Ok(all) => {
                if json_out {
                    println!("{}", json!({ "schedules": all }));
                } else {
                    println!("{:<24} {:<40} {:<16} catch-up", "name", "every", "topic");
                    for s in &all {
                        let every = match &s.every {
                            delaywheel::redis::Every::Interval { ms } => format!("{ms} ms"),
                            delaywheel::redis::Every::Cron { expr, tz } => format!("{expr} ({tz})"),
                            _ => "?".into(),
                        };
                        println!(
                            "{:<24} {:<40} {:<16} {:?}",
                            shown(&s.name),
                            shown(&every),
                            shown(&s.topic),
                            s.catch_up
                        );
                    }
                }
                Exit::Done
            }
            Err(e) => fail("listing the schedules failed", &e),
        },
        // Served by `main` before it comes here.
        Command::Dashboard { .. } => {
            eprintln!("delaywheel: the dashboard runs on its own");
            Exit::Failed
        }
    }
}

fn done(json_out: bool, value: serde_json::Value, text: &str) -> Exit {
    if json_out {
        println!("{value}");
    } else {
        println!("{text}");
    }
    Exit::Done
}

fn not_found(id: &str, json_out: bool) -> Exit {
    if json_out {
        println!("{}", json!({ "id": id, "found": false }));
    }
    eprintln!("delaywheel: no task {id:?} in this queue");
    Exit::NotFound
}

async fn stats(p: &Producer, json_out: bool) -> Exit {
    let (depth, latency, paused) = match (p.depth().await, p.latency().await, p.is_paused().await) {
        (Ok(d), Ok(l), Ok(paused)) => (d, l, paused),
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => return fail("stats failed", &e),
    };
    if json_out {
        println!(
            "{}",
            json!({
                "queued": depth.queued,
                "leased": depth.leased,
                "dead": depth.dead,
                "latency_ms": latency.as_millis() as u64,
                "paused": paused,
            })
        );
    } else {
        println!("queued   {}", depth.queued);
        println!("leased   {}", depth.leased);
        println!("dead     {}", depth.dead);
        println!("latency  {} ms", latency.as_millis());
        println!("paused   {}", if paused { "yes" } else { "no" });
    }
    Exit::Done
}

async fn ls(
    p: &Producer,
    state: State,
    limit: usize,
    cursor: Option<&str>,
    json_out: bool,
) -> Exit {
    let cursor = match cursor {
        None => ListCursor::START,
        Some(text) => match ListCursor::parse(text) {
            Some(c) => c,
            None => {
                eprintln!("delaywheel: {text:?} is not a cursor `ls` printed");
                return Exit::Usage;
            }
        },
    };
    let which = match state {
        State::Scheduled => ListState::Scheduled,
        State::Leased => ListState::Leased,
        State::Dead => ListState::Dead,
    };
    match p.list(which, &cursor, limit).await {
        Ok(page) => {
            print_page(&page, json_out);
            Exit::Done
        }
        // A cursor of another listing (the limit is checked before).
        Err(QueueError::Config(why)) => {
            eprintln!("delaywheel: {why}");
            Exit::Usage
        }
        Err(e) => fail("ls failed", &e),
    }
}

/// Requeues every dead letter, `rate` a second: the i-th at `start + i / rate`. The ids are
/// listed first, then requeued: requeueing while listing would change the hash the listing's
/// cursor walks, and could step over dead letters.
async fn requeue_all(p: &Producer, rate: u32, json_out: bool) -> Exit {
    let mut ids = Vec::new();
    let mut cursor = ListCursor::START;
    loop {
        let page = match p.list(ListState::Dead, &cursor, 1_000).await {
            Ok(page) => page,
            Err(e) => return fail("listing the dead letters failed", &e),
        };
        ids.extend(page.tasks.into_iter().map(|t| t.id));
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    let start = Instant::now();
    let (mut requeued, mut failed) = (0u64, Vec::new());
    for (i, id) in ids.into_iter().enumerate() {
        let at = start + Duration::from_secs_f64(i as f64 / f64::from(rate));
        tokio::time::sleep_until(at.into()).await;
        match p.requeue(&id).await {
            Ok(true) => requeued += 1,
            // Gone meanwhile (requeued by another hand): nothing to do.
            Ok(false) => {}
            Err(e @ (QueueError::NotAnEnvelope(_) | QueueError::StillPending(_))) => {
                failed.push((id, e.to_string()))
            }
            Err(e) => return fail(&format!("requeue of {id} failed"), &e),
        }
    }
    if json_out {
        let failed: Vec<_> = failed
            .iter()
            .map(|(id, e)| json!({ "id": id, "error": e }))
            .collect();
        println!("{}", json!({ "requeued": requeued, "failed": failed }));
    } else {
        println!("requeued {requeued}");
        for (id, e) in &failed {
            println!("refused  {}: {}", shown(id), shown(e));
        }
    }
    if failed.is_empty() {
        Exit::Done
    } else {
        Exit::Failed
    }
}
