//! Crashes, with real processes: the writer SIGKILLed in `WriteThrough` mode, and
//! `redis-server` SIGKILLed under load.
#![cfg(all(feature = "redis", target_os = "linux"))]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{now_ms, Durability, PersistConfig, Persistent};
use redis_server::RedisServer;

const PATIENCE: Duration = Duration::from_secs(60);
const CHILD_URL: &str = "DELAYWHEEL_CHILD_REDIS_URL";

/// Runs the ignored test `child` of this binary as a child process on `server`, reads the ids
/// it prints after `marker` (once each is acknowledged), and SIGKILLs it once it has printed
/// `kill_after` of them: no shutdown, no final flush. Returns the ids read. A child that wedges
/// first is killed after two minutes (its stdout then ends), and one that dies by itself fails
/// the test, so it never waits forever.
fn ids_until_killed(
    child: &str,
    server: &RedisServer,
    marker: &str,
    kill_after: usize,
) -> Vec<String> {
    let mut process = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            child,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_URL, server.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (done, watch) = crossbeam_channel::bounded::<()>(1);
    let pid =
        rustix::process::Pid::from_raw(process.id() as i32).expect("a child's pid is positive");
    let watchdog = std::thread::spawn(move || {
        if let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
            watch.recv_timeout(Duration::from_secs(120))
        {
            // By pid: the reading loop holds the `Child`. (It may have exited meanwhile.)
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    });
    let mut ids = Vec::new();
    let mut killed = false;
    for line in BufReader::new(process.stdout.take().unwrap()).lines() {
        let Ok(line) = line else { break };
        // Anywhere in the line: the child's test harness prints its test's name without a
        // newline, ahead of the first.
        if let Some((_, id)) = line.split_once(marker) {
            ids.push(id.to_string());
            if ids.len() == kill_after {
                process.kill().unwrap();
                killed = true;
            }
        }
    }
    let status = process.wait().unwrap();
    drop(done);
    watchdog.join().unwrap();
    assert!(
        killed,
        "the child died by itself, or hung and was killed, after {} ids: {status}",
        ids.len()
    );
    ids
}

/// The child of `write_through_acknowledged_ids_survive_a_sigkill_of_the_process`: schedules
/// tasks in `WriteThrough` mode forever, printing each id once `schedule` has returned.
#[test]
#[ignore = "run as a child process by write_through_acknowledged_ids_survive_a_sigkill_of_the_process"]
fn child_schedules_write_through_until_killed() {
    let url = std::env::var(CHILD_URL).expect("only run as a child process");
    let mut cfg = PersistConfig::new(url, "crash");
    cfg.durability = Durability::WriteThrough;
    let (p, _fired) = Persistent::start(cfg).unwrap();
    let out = std::io::stdout();
    for i in 0u64.. {
        let id = format!("order:{i}");
        p.schedule_at_ms(
            id.clone(),
            "order.close",
            serde_json::json!({ "i": i }),
            now_ms() + 3_600_000,
        )
        .unwrap();
        let mut out = out.lock();
        writeln!(out, "acked {id}").unwrap();
        out.flush().unwrap();
    }
}

#[test]
fn write_through_acknowledged_ids_survive_a_sigkill_of_the_process() {
    let server = RedisServer::start();
    let kill_after = fastrand::usize(100..1_500);
    let acked = ids_until_killed(
        "child_schedules_write_through_until_killed",
        &server,
        "acked ",
        kill_after,
    );
    assert_eq!(acked[0], "order:0", "the first ack was not read");

    let (p, _fired) = Persistent::start(PersistConfig::new(server.url(), "crash")).unwrap();
    let report = p.restore(500).unwrap();
    assert!(report.loaded >= acked.len());
    let lost: Vec<_> = acked.iter().filter(|id| !p.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "acknowledged but lost after the crash: {lost:?}"
    );
}

/// The child of `confirmed_cancels_survive_a_sigkill_of_the_process`: schedules a task and
/// cancels it with `cancel_confirmed`, forever, printing each id once the cancel is confirmed.
/// Every other task is left scheduled, so that the store holds live rows too.
#[test]
#[ignore = "run as a child process by confirmed_cancels_survive_a_sigkill_of_the_process"]
fn child_cancels_confirmed_until_killed() {
    let url = std::env::var(CHILD_URL).expect("only run as a child process");
    let (p, _fired) = Persistent::start(PersistConfig::new(url, "cancels")).unwrap();
    p.restore(1_000).unwrap();
    let out = std::io::stdout();
    for i in 0u64.. {
        let id = format!("order:{i}");
        p.schedule_at_ms(
            id.clone(),
            "order.close",
            serde_json::json!({ "i": i }),
            now_ms() + 3_600_000,
        )
        .unwrap();
        if i % 2 == 1 {
            continue;
        }
        assert!(p.cancel_confirmed(&id).unwrap(), "{id} was not held");
        let mut out = out.lock();
        writeln!(out, "cancelled {id}").unwrap();
        out.flush().unwrap();
    }
}

/// A cancel that `cancel_confirmed` confirmed stays cancelled after the process is SIGKILLed
/// at a random moment: the restarted engine restores none of those tasks. (A plain `cancel` is
/// write-behind: its removal may still be in the journal when the process dies.)
#[test]
fn confirmed_cancels_survive_a_sigkill_of_the_process() {
    let server = RedisServer::start();
    let kill_after = fastrand::usize(50..500);
    let cancelled = ids_until_killed(
        "child_cancels_confirmed_until_killed",
        &server,
        "cancelled ",
        kill_after,
    );
    let (p, _fired) = Persistent::start(PersistConfig::new(server.url(), "cancels")).unwrap();
    p.restore(500).unwrap();
    assert!(
        p.len() >= kill_after - 1,
        "the live tasks were lost: {}",
        p.len()
    );
    let back: Vec<_> = cancelled.iter().filter(|id| p.contains(id)).collect();
    assert!(
        back.is_empty(),
        "confirmed cancels undone by the crash: {back:?}"
    );
}

#[test]
fn redis_sigkilled_mid_load_loses_nothing_while_the_wheel_keeps_firing() {
    let mut server = RedisServer::start();
    let (p, fired) = Persistent::start(PersistConfig::new(server.url(), "load")).unwrap();
    let p = Arc::new(p);
    let stop = Arc::new(AtomicBool::new(false));
    let redis_down = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicBool::new(false));
    let (acked, acked_while_down) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));

    // Producer: long tasks (an hour away, one in three cancelled again) and short ones (fire
    // within 30 ms, acknowledged by the consumer).
    let producer = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut long = HashSet::new();
            let mut shorts = 0u64;
            let mut i = 0u64;
            while !stop.load(SeqCst) {
                i += 1;
                let id = format!("long{i}");
                p.schedule_at_ms(id.clone(), "t", serde_json::json!(i), now_ms() + 3_600_000)
                    .unwrap();
                long.insert(id);
                if i.is_multiple_of(3) {
                    let victim = format!("long{}", i - 1);
                    assert!(p.cancel(&victim));
                    long.remove(&victim);
                }
                p.schedule_at_ms(
                    format!("short{i}"),
                    "t",
                    serde_json::Value::Null,
                    now_ms() + 30,
                )
                .unwrap();
                shorts += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            (long, shorts)
        })
    };
    let consumer = {
        let (p, acked, acked_while_down, redis_down, finished) = (
            p.clone(),
            acked.clone(),
            acked_while_down.clone(),
            redis_down.clone(),
            finished.clone(),
        );
        std::thread::spawn(move || loop {
            let task = match fired.recv_timeout(Duration::from_millis(50)) {
                Ok(task) => task,
                Err(_) if finished.load(SeqCst) => return,
                Err(_) => continue,
            };
            assert!(p.ack(&task), "{} fired but could not be acked", task.id);
            acked.fetch_add(1, SeqCst);
            if redis_down.load(SeqCst) {
                acked_while_down.fetch_add(1, SeqCst);
            }
        })
    };

    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    redis_down.store(true, SeqCst);
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        p.journal_depth() > 0,
        "changes made while Redis is down wait in the journal"
    );
    redis_down.store(false, SeqCst);
    server.restart();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, SeqCst);
    let (long, shorts) = producer.join().unwrap();

    let start = Instant::now();
    while acked.load(SeqCst) < shorts {
        assert!(start.elapsed() < PATIENCE, "short tasks did not all fire");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        acked_while_down.load(SeqCst) > 100,
        "the wheel did not keep firing while Redis was down ({} fired)",
        acked_while_down.load(SeqCst)
    );
    assert!(p.flush(PATIENCE), "the flusher did not catch up");
    assert_eq!(p.len(), long.len());
    assert_eq!(server.zset_members("{load}:due"), long);
    let client = redis::Client::open(server.url()).unwrap();
    let hlen: usize = redis::cmd("HLEN")
        .arg("{load}:tasks")
        .query(&mut client.get_connection().unwrap())
        .unwrap();
    assert_eq!(hlen, long.len());
    finished.store(true, SeqCst);
    consumer.join().unwrap();
}
