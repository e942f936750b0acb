//! A private `redis-server` for one test (or bench, or example): started from PATH on a Unix
//! socket in its own temporary directory, with `appendonly yes` and `appendfsync always`, so a
//! test can SIGKILL it and restart it on the same data. Shared through `#[path]` includes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How to get the binary, for the failure message.
const INSTALL: &str = "redis-server was not found on PATH. Install it (Debian/Ubuntu: \
    `apt-get install -y redis-server`; macOS: `brew install redis`), or run `make test`, \
    which installs it when it can.";

/// A running private server; killed when dropped.
pub struct RedisServer {
    dir: tempfile::TempDir,
    child: Option<Child>,
    durable: bool,
}

#[allow(dead_code)]
impl RedisServer {
    /// Starts a server, panicking with install instructions when `redis-server` is missing.
    pub fn start() -> RedisServer {
        Self::start_with(true)
    }

    /// Starts a server that keeps nothing on disk (no append-only file), as a cache or a
    /// benchmark wants: fsync costs are then not measured.
    pub fn start_in_memory() -> RedisServer {
        Self::start_with(false)
    }

    fn start_with(durable: bool) -> RedisServer {
        let mut server = RedisServer {
            dir: socket_dir(),
            child: None,
            durable,
        };
        server.spawn();
        server
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// The connection URL (`redis+unix://...`).
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    /// The data directory (the append-only file lives here).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn spawn(&mut self) {
        check_version();
        let socket = self.socket();
        let _ = std::fs::remove_file(&socket);
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args(["--unixsocketperm", "700", "--dir"])
            .arg(self.dir.path())
            .args(["--appendonly", if self.durable { "yes" } else { "no" }])
            .args(["--appendfsync", "always", "--save", ""])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL}"),
            Err(e) => panic!("could not start redis-server: {e}"),
        };
        self.child = Some(child);
        // Ready when it answers PING: after a restart it first replays its append-only file,
        // and answers LOADING meanwhile.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "redis-server exited at start ({status}); data dir {}",
                    self.dir.path().display()
                );
            }
            if socket.exists() && self.answers_ping() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING on {} within 30 s",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn answers_ping(&self) -> bool {
        let reply = redis::Client::open(self.url())
            .and_then(|client| client.get_connection())
            .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
        matches!(reply.as_deref(), Ok("PONG"))
    }

    /// Closes the connection of every client but the caller's (`CLIENT KILL TYPE normal`):
    /// each one's next command fails on it. Returns how many were closed.
    #[allow(dead_code)] // not every test binary drops connections
    pub fn kill_clients(&self) -> u64 {
        let client = redis::Client::open(self.url()).expect("redis URL");
        let mut conn = client.get_connection().expect("connect to redis-server");
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query(&mut conn)
            .expect("CLIENT KILL")
    }

    /// Runs one command (`args[0]` and its arguments) on a connection of its own, and returns
    /// its reply.
    pub fn run(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(self.url()).expect("redis URL");
        let mut conn = client.get_connection().expect("connect to redis-server");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn).expect("a command of the test")
    }

    /// [`run`](Self::run) for a command whose reply is an integer.
    pub fn int(&self, args: &[&str]) -> i64 {
        match self.run(args) {
            redis::Value::Int(n) => n,
            other => panic!("{args:?} answered {other:?}"),
        }
    }

    /// The members of the ZSET `key`.
    pub fn zset_members(&self, key: &str) -> std::collections::HashSet<String> {
        let client = redis::Client::open(self.url()).expect("redis URL");
        let mut conn = client.get_connection().expect("connect to redis-server");
        let all: Vec<String> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query(&mut conn)
            .expect("ZRANGE");
        all.into_iter().collect()
    }

    /// For examples: the Redis at `url` if one is given, else a private in-memory server
    /// (returned too, so it lives as long as the caller keeps it) and its URL.
    pub fn given_or_private(url: Option<String>) -> (Option<RedisServer>, String) {
        match url {
            Some(url) => (None, url),
            None => {
                let server = RedisServer::start_in_memory();
                let url = server.url();
                (Some(server), url)
            }
        }
    }

    /// For examples run against a given Redis: deletes every key of namespace `ns` (a fixed
    /// name, which an earlier run may have left keys under) and returns how many.
    pub fn clear_namespace(url: &str, ns: &str) -> usize {
        let client = redis::Client::open(url).expect("redis URL");
        let mut conn = client.get_connection().expect("connect to redis");
        // SCAN, not KEYS: the Redis given may be a shared one.
        let keys: Vec<String> = redis::Commands::scan_match(&mut conn, format!("{{{ns}}}*"))
            .expect("SCAN")
            .collect::<Result<_, _>>()
            .expect("SCAN");
        for key in &keys {
            redis::cmd("DEL")
                .arg(key)
                .query::<()>(&mut conn)
                .expect("DEL");
        }
        keys.len()
    }

    /// SIGKILLs the server: no shutdown, no final flush.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same data directory and socket.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A temporary directory for a server's socket and data: in `TMPDIR` unless a socket path there
/// would pass the 107 bytes a Unix socket path may have, then in `/tmp`.
/// Fails with install instructions when `redis-server` is missing or older than 7.0 (the
/// tests use `SET NX GET` and `CLIENT PAUSE ... ALL`, which fail with unclear errors on 6).
/// The numeric fields `names` of `INFO section` of the Redis at `url`, summed (the reports'
/// Redis CPU and memory figures).
#[allow(dead_code)]
pub fn info_sum(url: &str, section: &str, names: &[&str]) -> f64 {
    let mut conn = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query(&mut conn)
        .expect("INFO");
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| names.contains(name))
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

fn check_version() {
    static CHECKED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    CHECKED.get_or_init(|| {
        let out = match Command::new("redis-server").arg("--version").output() {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL}"),
            Err(e) => panic!("could not run redis-server --version: {e}"),
        };
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // "Redis server v=7.0.15 sha=..."
        let major = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("v="))
            .and_then(|v| v.split('.').next())
            .and_then(|m| m.parse::<u32>().ok());
        match major {
            Some(m) if m >= 7 => {}
            _ => panic!(
                "redis-server on PATH is {:?}; the tests need 7.0 or later: install a newer \
                 one (Debian 12 / Ubuntu 24.04: `apt-get install -y redis-server`; or from \
                 https://redis.io/downloads) first on PATH",
                text.trim()
            ),
        }
    });
}

fn socket_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    if dir.path().join("redis.sock").as_os_str().len() < 100 {
        return dir;
    }
    tempfile::tempdir_in("/tmp").expect("temp dir in /tmp")
}
