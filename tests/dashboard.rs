//! `delaywheel dashboard` in a real headless browser: Debian's `chromium` (which `make test`
//! installs) loads the page from the binary serving it on 127.0.0.1, against a private
//! `redis-server` holding a queue this test filled; the page must show its figures, and its
//! refreshes must change them. A screenshot is saved for people to look at.
#![cfg(feature = "cli")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delaywheel::redis::{now_ms, Consumer, Handlers, RetryPolicy};
use queue_kit::*;

/// The browser: `$CHROMIUM`, else `chromium` or `chromium-browser` on the PATH. Missing, the
/// test fails and says how to install it (it is never skipped).
fn chromium() -> String {
    if let Ok(path) = std::env::var("CHROMIUM") {
        return path;
    }
    for name in ["chromium", "chromium-browser"] {
        let found = Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if found {
            return name.to_string();
        }
    }
    panic!(
        "no chromium: the dashboard test needs a headless browser. Install Debian's `chromium` \
         (apt-get install chromium; `make test` does it), or set CHROMIUM to its path"
    );
}

/// Runs headless chromium on `url` with `args`; its stdout.
fn browse(url: &str, args: &[&str]) -> String {
    let mut cmd = Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
    ]);
    let profile = tempfile::tempdir().unwrap();
    cmd.arg(format!("--user-data-dir={}", profile.path().display()));
    cmd.args(args).arg(url);
    let out = cmd.output().expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Served(Child);

/// `delaywheel <global> dashboard --listen <a free loopback port> <args>` against `url`, once
/// it listens; and the address.
fn serve(url: &str, global: &[&str], args: &[&str]) -> (Served, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let served = Served(
        Command::new(env!("CARGO_BIN_EXE_delaywheel"))
            .env("DELAYWHEEL_REDIS_URL", url)
            .args(global)
            .args(["dashboard", "--listen", &listen])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while std::net::TcpStream::connect(&listen).is_err() {
        assert!(start.elapsed() < PATIENCE, "the dashboard never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    (served, listen)
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_dashboard_shows_a_filled_queue_and_its_refreshes_change_the_figures() {
    let Fixture { server, rt, cfg, p } = fixture("dash", |cfg| {
        cfg.shards = 2;
        cfg.reaper_interval = Duration::from_millis(50);
        cfg.retry = RetryPolicy {
            max_attempts: 1,
            ..cfg.retry
        };
    });
    // Outcomes of two topics, three dead letters with their reason.
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new()
            .on("email", |_| Ok(()))
            .on("charge", |_| Err("card declined".into())),
    )
    .unwrap();
    let now = now_ms();
    enqueue_all(
        &rt,
        &p,
        "email",
        (0..7).map(|i| (format!("e{i}"), now)).collect(),
    );
    enqueue_all(
        &rt,
        &p,
        "charge",
        (0..3).map(|i| (format!("c{i}"), now)).collect(),
    );
    wait_until("the outcomes", || {
        rt.block_on(p.depth()).unwrap().dead == 3 && c.stats().acked == 7
    });
    c.shutdown(Duration::from_secs(5)).unwrap();
    // Outcomes per shard too: the shards' counts add up to the topics'.
    let shards = rt.block_on(p.shard_stats()).unwrap();
    let (processed, failed) = shards
        .iter()
        .fold((0, 0), |(a, b), s| (a + s.processed, b + s.failed));
    assert_eq!((processed, failed), (7, 3), "{shards:?}");
    assert!(
        shards.iter().all(|s| s.processed + s.failed > 0),
        "ten tasks, one shard without any: {shards:?}"
    );
    // 25 queued far ahead, and one overdue that no consumer claims: its latency grows.
    enqueue_all(
        &rt,
        &p,
        "email",
        (0..25)
            .map(|i| (format!("f{i}"), now + 3_600_000 + i))
            .collect(),
    );
    enqueue_all(&rt, &p, "email", vec![("overdue".into(), now - 5_000)]);

    let (_served, listen) = serve(
        &server.url(),
        &["--namespace", "dash", "--shards", "2"],
        &["--refresh", "0.2"],
    );
    // More tasks arrive while the browser watches.
    let stop = Arc::new(AtomicBool::new(false));
    let feeder = {
        let (stop, rt2, p2) = (
            stop.clone(),
            tokio::runtime::Runtime::new().unwrap(),
            p.clone(),
        );
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(SeqCst) {
                rt2.block_on(p2.enqueue(
                    format!("more{i}"),
                    "email",
                    serde_json::Value::Null,
                    delaywheel::redis::When::AtMs(now + 7_200_000),
                ))
                .unwrap();
                i += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let url = format!("http://{listen}/");
    // Virtual time: 3 s of the page's clock, waiting for each fetch in real time.
    let dom = browse(&url, &["--dump-dom", "--virtual-time-budget=3000"]);
    let port = listen.rsplit(':').next().unwrap();
    let shot = std::env::temp_dir().join(format!("delaywheel-dashboard-{port}.png"));
    browse(
        &url,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1100,1100",
            "--virtual-time-budget=3000",
        ],
    );
    stop.store(true, SeqCst);
    feeder.join().unwrap();

    // The page shows the queue: its namespace, its topics, the dead letters and their reason.
    for want in ["dash", "running", "email", "charge", "card declined", "c0"] {
        assert!(dom.contains(want), "the page lacks {want:?}:\n{dom}");
    }
    let refreshes: u32 = dom
        .split("data-refreshes=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(refreshes >= 3, "refreshed {refreshes} times:\n{dom}");
    // The queued figure, sample by sample: it changed while the page refreshed.
    let samples: Vec<u64> = dom
        .split("<span id=\"samples\">")
        .nth(1)
        .and_then(|r| r.split('<').next())
        .unwrap_or("")
        .split(", ")
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    assert!(samples.len() >= 3, "samples {samples:?}");
    assert!(
        samples[0] >= 26,
        "the first sample {samples:?} misses the filled queue"
    );
    assert!(
        samples.last() > samples.first(),
        "the refreshes changed nothing: {samples:?}"
    );
    // Topic counts: 7 processed of `email`, 3 dead-lettered of `charge`.
    assert!(dom.contains("<td>email</td><td>7</td>"), "{dom}");
    assert!(
        dom.contains("<td>charge</td><td>0</td><td>3</td><td>0</td><td>3</td>"),
        "{dom}"
    );
    // Topics now, from the census: email's queued tasks (26 and what the feeder added) and
    // its overdue one's latency; charge's three dead letters.
    let census = dom
        .split("<table id=\"census\">")
        .nth(1)
        .and_then(|t| t.split("</table>").next())
        .unwrap_or_else(|| panic!("no census table:\n{dom}"));
    let cells = |topic: &str| -> Vec<u64> {
        census
            .split(&format!("<tr><td>{topic}</td>"))
            .nth(1)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_else(|| panic!("no census row for {topic}:\n{census}"))
            .split("<td>")
            .filter_map(|c| c.split('<').next()?.parse().ok())
            .collect()
    };
    let (email, charge) = (cells("email"), cells("charge"));
    assert!(
        email.len() == 4 && email[0] >= 26 && email[1] == 0 && email[2] == 0,
        "email: queued, leased, dead, latency = {email:?}"
    );
    assert!(
        email[3] >= 5_000,
        "the overdue email task shows {} ms late",
        email[3]
    );
    assert_eq!(
        charge,
        vec![0, 0, 3, 0],
        "charge: queued, leased, dead, latency"
    );
    let png = std::fs::metadata(&shot).expect("a screenshot").len();
    assert!(png > 10_000, "a {png}-byte screenshot");
    println!("screenshot: {}", shot.display());
}

/// The status code of a GET of `path` from `listen`, naming `host` as its Host.
fn status_for_host(listen: &str, path: &str, host: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(listen).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply.split_whitespace().nth(1).unwrap_or("").to_string()
}

/// On loopback the dashboard answers only requests for a loopback host, on any port (an SSH
/// tunnel or a port mapping changes it), or for one given with `--allow-host` (a reverse
/// proxy's): a page elsewhere that points its own name at 127.0.0.1 (DNS rebinding) sends that
/// name, and must not read the queue's ids and dead letters.
#[test]
fn the_dashboard_refuses_a_request_for_another_host() {
    let Fixture { server, .. } = fixture("rebind", |_| {});
    let (_served, listen) = serve(
        &server.url(),
        &["--namespace", "rebind"],
        &["--allow-host", "Queue.Example.com"],
    );
    let port = listen.rsplit(':').next().unwrap();
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LocalHost:9000".to_string(),
        "localhost.".to_string(),
        "dash.localhost:8080".to_string(),
        "[::1]:9000".to_string(),
        "queue.example.com".to_string(),
        "queue.example.com:443".to_string(),
    ] {
        assert_eq!(
            status_for_host(&listen, "/api/stats", &host),
            "200",
            "{host}"
        );
    }
    for host in [
        format!("attacker.example:{port}"),
        format!("127.0.0.1.attacker.example:{port}"),
        "localhost.attacker.example".to_string(),
        "example.com".to_string(),
    ] {
        assert_eq!(
            status_for_host(&listen, "/api/stats", &host),
            "403",
            "{host}"
        );
        assert_eq!(status_for_host(&listen, "/", &host), "403", "{host}");
    }
}
