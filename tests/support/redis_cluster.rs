//! A private Redis Cluster for one test: `n` `redis-server` processes in cluster mode on free
//! 127.0.0.1 ports (a cluster bus needs TCP, so no Unix sockets here), joined with
//! `redis-cli --cluster create`. Killed when dropped.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL: &str =
    "redis-server / redis-cli were not found on PATH. Install them (Debian/Ubuntu: \
    `apt-get install -y redis-server`; macOS: `brew install redis`), or run `make test`.";

pub struct RedisCluster {
    dir: tempfile::TempDir,
    children: Vec<Child>,
    ports: Vec<u16>,
}

/// A port that is free, and whose cluster bus port (+10 000) is free too.
fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Starts one cluster node under `dir` on a free port, and waits until it answers. A port can
/// be taken between `free_port` and the server's bind (its bus port too): a node that exits
/// is started again on another.
fn start_node(dir: &std::path::Path, deadline: Instant) -> (Child, u16) {
    loop {
        let port = free_port();
        let node_dir = dir.join(port.to_string());
        std::fs::create_dir_all(&node_dir).unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--appendonly", "no", "--save", "", "--dir"])
            .arg(&node_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL}"),
            Err(e) => panic!("could not start redis-server: {e}"),
        };
        loop {
            let answers = TcpStream::connect(("127.0.0.1", port)).is_ok();
            // Checked after the connect: what answered may have been another process that
            // took the port, while this one exited.
            if let Ok(Some(_)) = child.try_wait() {
                break; // exited: its port was taken; another one
            }
            if answers {
                return (child, port);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("redis-server on {port} did not start");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl RedisCluster {
    pub fn start(n: usize) -> RedisCluster {
        let mut cluster = RedisCluster {
            dir: tempfile::tempdir().expect("temp dir"),
            children: Vec::new(),
            ports: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        for _ in 0..n {
            let (child, port) = start_node(cluster.dir.path(), deadline);
            cluster.children.push(child);
            cluster.ports.push(port);
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for &port in &cluster.ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let mut creating = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL} ({e})"));
        // With a deadline: a join that never completes must fail the test, not hang it.
        let status = loop {
            if let Some(status) = creating.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline + Duration::from_secs(20) {
                let _ = creating.kill();
                let _ = creating.wait();
                panic!("redis-cli --cluster create did not finish within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        if let Some(mut stdout) = creating.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        }
        assert!(status.success(), "redis-cli --cluster create failed: {out}");
        for url in cluster.urls() {
            let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
            loop {
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut conn).unwrap();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline + Duration::from_secs(20),
                    "cluster not ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    /// One `redis://127.0.0.1:port/` per node.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}/"))
            .collect()
    }

    /// How many nodes hold any key.
    pub fn nodes_with_keys(&self) -> usize {
        self.urls()
            .iter()
            .filter(|url| {
                let mut node = redis::Client::open(url.as_str())
                    .unwrap()
                    .get_connection()
                    .unwrap();
                redis::cmd("DBSIZE").query::<u64>(&mut node).unwrap() > 0
            })
            .count()
    }
}

impl RedisCluster {
    /// A connection to node `n`.
    fn node(&self, n: usize) -> redis::Connection {
        redis::Client::open(self.urls()[n].as_str())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// Moves the slot of `key` from the node that owns it to the next node, by the documented
    /// resharding steps: import, migrate every key, assign (on every node). Returns the new
    /// owner's index.
    #[allow(dead_code)] // not every test binary moves a slot
    pub fn move_slot_of(&self, key: &str) -> usize {
        // The node that owns the slot answers a plain EXISTS; the others answer MOVED.
        let from = (0..self.ports.len())
            .find(|&n| {
                redis::cmd("EXISTS")
                    .arg(key)
                    .query::<u64>(&mut self.node(n))
                    .is_ok()
            })
            .expect("a node owns the slot");
        let to = (from + 1) % self.ports.len();
        let id = |n: usize| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut self.node(n))
                .unwrap()
        };
        let (from_id, to_id) = (id(from), id(to));
        let slot: u64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.node(from))
            .unwrap();
        let setslot = |n: usize, args: &[&str]| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(args)
                .query::<()>(&mut self.node(n))
                .unwrap()
        };
        setslot(to, &["IMPORTING", &from_id]);
        setslot(from, &["MIGRATING", &to_id]);
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1_000)
            .query(&mut self.node(from))
            .unwrap();
        if !keys.is_empty() {
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.ports[to])
                .arg("")
                .arg(0)
                .arg(5_000)
                .arg("KEYS")
                .arg(&keys)
                .query::<()>(&mut self.node(from))
                .unwrap();
        }
        for n in 0..self.ports.len() {
            setslot(n, &["NODE", &to_id]);
        }
        to
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
