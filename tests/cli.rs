//! The `delaywheel` command line, run as a binary against a private `redis-server` (and a
//! 3-node cluster), its `--json` parsed, its exit codes checked.
#![cfg(feature = "cli")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use delaywheel::redis::{
    now_ms, Consumer, Handlers, PersistConfig, Persistent, QueueConfig, RetryPolicy,
};
use queue_kit::*;
use redis_cluster::RedisCluster;
use serde_json::Value;

/// Runs the binary with `args` (the URL from the environment, as an operator would keep a
/// password out of `ps`).
fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_delaywheel"))
        .env("DELAYWHEEL_REDIS_URL", url)
        .args(args)
        .output()
        .expect("run delaywheel")
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited")
}

/// The JSON document of a run that must succeed.
fn json(url: &str, args: &[&str]) -> Value {
    let out = cli(url, args);
    assert_eq!(
        code(&out),
        0,
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn stats_ls_get_cancel_pause_and_resume_on_a_sharded_queue() {
    let Fixture {
        server,
        rt,
        cfg: _,
        p,
    } = fixture("cli-q", |cfg| cfg.shards = 2);
    let url = server.url();
    let base = now_ms() + 600_000;
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..25).map(|i| (format!("t{i}"), base + i)).collect(),
    );
    let ns = ["--namespace", "cli-q", "--shards", "2", "--json"];
    let with =
        |rest: &[&str]| -> Vec<String> { ns.iter().chain(rest).map(|s| s.to_string()).collect() };
    let run = |rest: &[&str]| {
        let args = with(rest);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        json(&url, &args)
    };

    let stats = run(&["stats"]);
    assert_eq!(stats["queued"], 25);
    assert_eq!(
        (stats["leased"].as_u64(), stats["dead"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(stats["paused"], false);

    // Every task once, in due order, four a page, following `next`.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut args = vec!["ls", "scheduled", "--limit", "4"];
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = run(&args);
        let tasks = page["tasks"].as_array().unwrap();
        assert!(tasks.len() <= 4);
        seen.extend(tasks.iter().map(|t| t["due_at_ms"].as_u64().unwrap()));
        match page["next"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, (0..25).map(|i| base + i).collect::<Vec<_>>());

    let t = run(&["get", "t3"]);
    assert_eq!(
        (t["state"].as_str(), t["topic"].as_str()),
        (Some("scheduled"), Some("job"))
    );
    assert_eq!(t["due_at_ms"], base + 3);

    let cancelled = run(&["cancel", "t3"]);
    assert_eq!(cancelled["cancelled"], "t3");
    let gone = cli(
        &url,
        &with(&["get", "t3"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(code(&gone), 3, "get of a cancelled task: {}", stderr(&gone));
    let again = cli(
        &url,
        &with(&["cancel", "t3"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(code(&again), 3);

    assert_eq!(run(&["pause"])["paused"], true);
    assert_eq!(run(&["stats"])["paused"], true);
    assert!(rt.block_on(p.is_paused()).unwrap());
    let resumed = run(&["resume"]);
    assert_eq!(
        (resumed["paused"].as_bool(), resumed["was_paused"].as_bool()),
        (Some(false), Some(true))
    );
    assert!(!rt.block_on(p.is_paused()).unwrap());

    // The periodic schedules, as registered.
    let every = delaywheel::redis::Periodic::interval(
        "nightly",
        Duration::from_secs(86_400),
        "report",
        serde_json::Value::Null,
    )
    .unwrap();
    rt.block_on(p.add_periodic(&every)).unwrap();
    let listed = run(&["schedules"]);
    assert_eq!(listed["schedules"][0]["name"], "nightly");
    assert_eq!(listed["schedules"][0]["every"]["ms"], 86_400_000);

    // The human table names the tasks too.
    let table = cli(
        &url,
        &[
            "--namespace",
            "cli-q",
            "--shards",
            "2",
            "ls",
            "scheduled",
            "--limit",
            "3",
        ],
    );
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("t0") && text.contains("next: --cursor"),
        "{text}"
    );
}

#[test]
fn dead_letters_are_listed_and_requeued_one_by_one_or_all_paced() {
    let Fixture { server, rt, cfg, p } = fixture("cli-dead", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        };
    });
    let url = server.url();
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new().on("fail", |_| Err("card declined".into())),
    )
    .unwrap();
    // Past 128 entries the dead-letter hash is a real hash table, which HSCAN walks in
    // several answers: the listing and the paced requeue must both get every one.
    let n = 400;
    enqueue_all(
        &rt,
        &p,
        "fail",
        (0..n).map(|i| (format!("d{i}"), now_ms())).collect(),
    );
    wait_until("the dead letters", || {
        rt.block_on(p.depth()).unwrap().dead == n as u64
    });
    c.shutdown(Duration::from_secs(5)).unwrap();
    let ns = ["--namespace", "cli-dead", "--json"];
    let run = |rest: &[&str]| {
        let args: Vec<&str> = ns.iter().chain(rest).copied().collect();
        json(&url, &args)
    };
    let page = run(&["ls", "dead", "--limit", "1000"]);
    let dead = page["tasks"].as_array().unwrap();
    assert_eq!(dead.len(), n);
    assert!(dead
        .iter()
        .all(|t| t["reason"].as_str().unwrap().contains("card declined")));
    assert!(page["next"].is_null());
    // Seven a page, following `next` over the hash table's cursor: each of them (a SCAN may
    // give one twice while the table is rehashing, so they are counted as a set).
    let mut seen = HashSet::new();
    let mut cursor: Option<String> = None;
    for _ in 0..1_000 {
        let mut args = vec!["ls", "dead", "--limit", "7"];
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = run(&args);
        for t in page["tasks"].as_array().unwrap() {
            assert!(
                seen.insert(t["id"].as_str().unwrap().to_string()),
                "{t} twice"
            );
        }
        match page["next"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(seen.len(), n);

    assert_eq!(run(&["requeue", "d0"])["requeued"], "d0");
    let missing = cli(&url, &["--namespace", "cli-dead", "requeue", "d0"]);
    assert_eq!(code(&missing), 3, "requeue of a task no longer dead");

    // The other 399, paced at 1 000 a second: at least 0.39 s from the first to the last.
    let start = Instant::now();
    let all = run(&["requeue", "--all-dead", "--rate", "1000"]);
    let took = start.elapsed();
    assert_eq!(all["requeued"], (n - 1) as u64);
    assert!(all["failed"].as_array().unwrap().is_empty());
    assert!(took >= Duration::from_millis(390), "not paced: {took:?}");
    let depth = rt.block_on(p.depth()).unwrap();
    assert_eq!((depth.dead, depth.queued), (0, n as u64));
    let dues: HashSet<u64> = run(&["ls", "scheduled", "--limit", "1000"])["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["due_at_ms"].as_u64().unwrap())
        .collect();
    assert!(
        dues.len() >= 200,
        "the requeued tasks came due together: {} distinct ms",
        dues.len()
    );
}

#[test]
fn bad_input_gives_one_line_and_a_meaningful_exit_code() {
    let server = redis_server::RedisServer::start_in_memory();
    let url = server.url();
    // A queue to find, and a persistent engine's namespace.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _p = producer(&rt, &QueueConfig::new(url.clone(), "cli-real"));
    let (engine, _fired) = Persistent::start(PersistConfig::new(url.clone(), "orders")).unwrap();

    let unknown = cli(&url, &["--namespace", "cli-typo", "stats"]);
    assert_eq!(code(&unknown), 1);
    let msg = stderr(&unknown);
    assert!(
        msg.contains("no queue in namespace") && msg.lines().count() == 1,
        "{msg}"
    );
    // Nothing was written for the mistyped namespace.
    assert_eq!(server.int(&["EXISTS", "{cli-typo}:kind"]), 0);

    let persistent = cli(&url, &["--namespace", "orders", "stats"]);
    assert_eq!(code(&persistent), 1);
    assert!(
        stderr(&persistent).contains("persistent"),
        "{}",
        stderr(&persistent)
    );

    let wrong_url = cli(
        "redis://127.0.0.1:1/",
        &["--namespace", "cli-real", "stats"],
    );
    assert_eq!(code(&wrong_url), 1);
    let msg = stderr(&wrong_url);
    assert!(
        msg.starts_with("delaywheel: cannot open the queue") && msg.lines().count() == 1,
        "{msg}"
    );

    // A destructive command needs its id, or --all-dead.
    let bare = cli(&url, &["--namespace", "cli-real", "requeue"]);
    assert_eq!(code(&bare), 2, "{}", stderr(&bare));
    let both = cli(
        &url,
        &["--namespace", "cli-real", "requeue", "x", "--all-dead"],
    );
    assert_eq!(code(&both), 2);
    let bad_cursor = cli(
        &url,
        &[
            "--namespace",
            "cli-real",
            "ls",
            "scheduled",
            "--cursor",
            "nonsense",
        ],
    );
    assert_eq!(code(&bad_cursor), 2);
    assert!(stderr(&bad_cursor).contains("not a cursor"));
    let zero = cli(
        &url,
        &["--namespace", "cli-real", "ls", "dead", "--limit", "0"],
    );
    assert_eq!(code(&zero), 2, "{}", stderr(&zero));
    // A page so large that its script would stall Redis, a cursor that is no due time, and
    // one of another listing: usage errors too.
    for args in [
        &["ls", "scheduled", "--limit", "10001"][..],
        &["ls", "scheduled", "--cursor", "after:NaN:x"],
        &["ls", "scheduled", "--cursor", "scan:0:0:0"],
        &["ls", "dead", "--cursor", "after:5:x"],
    ] {
        let out = cli(&url, &[&["--namespace", "cli-real"][..], args].concat());
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
    }
    let most = cli(
        &url,
        &[
            "--namespace",
            "cli-real",
            "ls",
            "scheduled",
            "--limit",
            "10000",
        ],
    );
    assert_eq!(code(&most), 0, "{}", stderr(&most));
    assert!(engine.shutdown().is_empty());
}

/// Without `--cluster`, `--redis` is one URL, whose password may hold a comma.
#[test]
fn a_password_with_a_comma_reaches_redis_whole() {
    let server = redis_server::RedisServer::start_in_memory();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _p = producer(&rt, &QueueConfig::new(server.url(), "cli-pass"));
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("pa,ss")
        .query::<()>(
            &mut redis::Client::open(server.url())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
        .unwrap();
    let url = format!("{}?pass=pa,ss", server.url());
    let stats = json(&url, &["--namespace", "cli-pass", "--json", "stats"]);
    assert_eq!(stats["queued"], 0, "{stats}");
}

/// Ids, topics and dead-letter reasons come from producers and handlers: printed for a person,
/// their control characters are escaped, so that an escape sequence in one cannot rewrite the
/// operator's terminal. `--json` escapes them as JSON does.
#[test]
fn control_characters_reach_the_terminal_escaped() {
    let Fixture {
        server, rt, cfg, p, ..
    } = fixture("cli-esc", |cfg| {
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        }
    });
    let evil = "t\u{1b}]0;owned\u{7}";
    let c = Consumer::start(
        cfg,
        Handlers::new().on("bell\u{7}", |_| Err("bad \u{1b}[2J card".into())),
    )
    .unwrap();
    enqueue_all(&rt, &p, "bell\u{7}", vec![(evil.to_string(), now_ms())]);
    wait_until("the dead letter", || {
        rt.block_on(p.depth()).unwrap().dead == 1
    });
    c.shutdown(Duration::from_secs(5)).unwrap();
    // Two queued far ahead: a page of one ends with a cursor holding the first one's id.
    let far = now_ms() + 3_600_000;
    enqueue_all(
        &rt,
        &p,
        "later",
        vec![("s\u{1b}[31m".to_string(), far), ("z".to_string(), far + 1)],
    );
    let url = server.url();
    for args in [
        &["--namespace", "cli-esc", "ls", "dead"][..],
        &["--namespace", "cli-esc", "get", evil],
        &["--namespace", "cli-esc", "ls", "scheduled", "--limit", "1"],
    ] {
        let out = cli(&url, args);
        assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{args:?}: {text:?}"
        );
        assert!(text.contains("\\u{1b}"), "{args:?}: {text:?}");
    }
    let dead = json(&url, &["--namespace", "cli-esc", "--json", "get", evil]);
    assert_eq!(dead["id"], evil);
    assert_eq!(dead["reason"], "bad \u{1b}[2J card");
}

#[test]
fn the_cli_reads_a_sharded_queue_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = QueueConfig::new(urls[0].clone(), "cli-cluster");
    cfg.cluster_nodes = urls.clone();
    cfg.shards = 6;
    let p = producer(&rt, &cfg);
    enqueue_all(
        &rt,
        &p,
        "job",
        (0..30)
            .map(|i| (format!("c{i}"), now_ms() + 600_000 + i))
            .collect(),
    );
    assert!(cluster.nodes_with_keys() >= 2, "all shards on one node");
    let nodes = urls.join(",");
    let base = [
        "--cluster",
        "--namespace",
        "cli-cluster",
        "--shards",
        "6",
        "--json",
    ];
    fn args<'a>(base: &[&'a str], rest: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(rest).copied().collect()
    }
    assert_eq!(json(&nodes, &args(&base, &["stats"]))["queued"], 30);
    let page = json(&nodes, &args(&base, &["ls", "scheduled", "--limit", "100"]));
    assert_eq!(page["tasks"].as_array().unwrap().len(), 30);
    assert_eq!(
        json(&nodes, &args(&base, &["get", "c7"]))["state"],
        "scheduled"
    );
    json(&nodes, &args(&base, &["pause"]));
    assert!(rt.block_on(p.is_paused()).unwrap());
    json(&nodes, &args(&base, &["resume"]));
    // A shard count below the queue's: refused, rather than looking ids up on the wrong shard.
    let short = cli(
        &nodes,
        &[
            "--cluster",
            "--namespace",
            "cli-cluster",
            "--shards",
            "3",
            "get",
            "c7",
        ],
    );
    assert_eq!(code(&short), 1);
    assert!(stderr(&short).contains("more shards"), "{}", stderr(&short));
    assert!(!rt.block_on(p.is_paused()).unwrap());
}
