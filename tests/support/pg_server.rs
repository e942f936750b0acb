//! A private PostgreSQL for the tests and reports: `initdb` into a temp dir, the server on a
//! Unix socket there (no TCP), stopped and removed on drop; killed (`SIGKILL`) and restarted
//! on demand. (`#[path]` include.)
//!
//! `initdb` and `postgres` refuse to run as root, so as root they run as an unprivileged user
//! (`postgres`, else `nobody`), which owns the temp dir. Debian keeps them off `PATH`, under
//! `/usr/lib/postgresql/<version>/bin`: the newest there is used, else `PG_BIN`, else `PATH`.
//! A machine without them fails the test with how to install them, never skips it.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The role the tests connect as, and its password.
pub const USER: &str = "delaywheel";
pub const PASSWORD: &str = "wheel-secret";

pub struct PgServer {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    uid: Option<(u32, u32)>,
    settings: Vec<String>,
    child: Option<Child>,
}

/// The directory of `initdb` and `postgres`.
fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.join("initdb").exists() && d.join("postgres").exists());
    on_path.unwrap_or_else(|| {
        panic!(
            "PostgreSQL's server (initdb, postgres) was not found under /usr/lib/postgresql/*/bin, \
             PG_BIN or PATH: install it (Debian: apt-get install postgresql; `make test` does) \
             and run the tests again"
        )
    })
}

/// The uid and gid to run the server as: none unless root.
fn unprivileged() -> Option<(u32, u32)> {
    // The effective uid, by the `id` command: no libc in the tests' dependencies.
    let out = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&out.stdout).trim() != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let find = |name: &str| {
        passwd.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.first() != Some(&name) || f.len() < 4 {
                return None;
            }
            Some((f[2].parse().ok()?, f[3].parse().ok()?))
        })
    };
    Some(find("postgres").or_else(|| find("nobody")).expect(
        "running as root with neither a `postgres` nor a `nobody` user to run PostgreSQL as",
    ))
}

fn run_as(cmd: &mut Command, uid: Option<(u32, u32)>) -> &mut Command {
    if let Some((u, g)) = uid {
        cmd.uid(u).gid(g);
    }
    cmd
}

fn chown(path: &Path, uid: Option<(u32, u32)>) {
    if let Some((u, g)) = uid {
        std::os::unix::fs::chown(path, Some(u), Some(g)).expect("chown the PostgreSQL dir");
    }
}

impl PgServer {
    /// A fresh cluster with the role [`USER`] (password [`PASSWORD`], scram), `fsync` off (a
    /// crash of the machine is not what the tests simulate), started.
    pub fn start() -> PgServer {
        PgServer::start_with(&["fsync=off"])
    }

    /// A fresh cluster with these `-c` settings, started.
    pub fn start_with(settings: &[&str]) -> PgServer {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let bin = bin_dir();
        let uid = unprivileged();
        let dir = std::env::temp_dir().join(format!(
            "delaywheel-pg-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        chown(&dir, uid);
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, PASSWORD).unwrap();
        chown(&pwfile, uid);
        let out = run_as(
            Command::new(bin.join("initdb"))
                .arg("-D")
                .arg(dir.join("data"))
                .args([
                    "-U",
                    USER,
                    "--auth=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ])
                .arg(format!("--pwfile={}", pwfile.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
            uid,
        )
        .output()
        .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port =
            20_000 + (std::process::id() % 20_000) as u16 + SEQ.load(Ordering::Relaxed) as u16;
        let mut s = PgServer {
            dir,
            bin,
            port,
            uid,
            settings: settings.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        s.spawn();
        s
    }

    fn socket(&self) -> PathBuf {
        self.dir.join(format!(".s.PGSQL.{}", self.port))
    }

    /// Starts the server, waiting until it listens; `Err` with its log if it exits first.
    fn try_spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .arg("-k")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses="]);
        for s in &self.settings {
            cmd.args(["-c", s]);
        }
        let log = std::fs::File::create(self.dir.join("log")).unwrap();
        chown(&self.dir.join("log"), self.uid);
        let child = run_as(cmd.stdout(Stdio::null()).stderr(log), self.uid)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        let start = Instant::now();
        while !self.socket().exists() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!("postgres exited ({status}): {}", self.log()));
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "postgres did not listen within 30 s: {}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The socket exists a moment before connections are accepted.
        std::thread::sleep(Duration::from_millis(50));
        Ok(())
    }

    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    /// The postmaster's process id while the server runs (its backends are its children).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What the server logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// A connection string for `tokio-postgres` (key=value form), with `password`.
    pub fn url_with(&self, password: &str) -> String {
        format!(
            "host={} port={} user={USER} password={password} dbname=postgres",
            self.dir.display(),
            self.port
        )
    }

    /// The connection string, with the right password.
    pub fn url(&self) -> String {
        self.url_with(PASSWORD)
    }

    /// A connection of its own to the server, its driver task spawned on the current tokio
    /// runtime (for tests and reports that look at the tables directly).
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url()).await
    }

    /// Kills the server with `SIGKILL`, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The backends notice their postmaster is gone and exit; the next start waits for them.
        let _ = std::fs::remove_file(self.socket());
    }

    /// Starts the server again on the same data (after `kill` or `stop`), waiting for the
    /// backends of a killed one to exit.
    pub fn restart(&mut self) {
        let start = Instant::now();
        while let Err(e) = self.try_spawn() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "postgres did not restart: {e}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (fast shutdown), and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGINT: fast shutdown.
            let _ = Command::new("kill")
                .args(["-INT", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A connection to the server at `url` (as [`PgServer::url`] gives it, for tasks that cannot
/// borrow the server), its driver task spawned on the current tokio runtime.
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect to the private PostgreSQL");
    tokio::spawn(conn);
    client
}

/// A private PgBouncer in transaction mode before a [`PgServer`]: on a Unix socket in a temp
/// dir of its own, two server connections per pool (fewer than the store's pool: clients share
/// them statement by statement), stopped on drop. Like the server it runs as an unprivileged
/// user when run as root (it refuses root). A machine without it fails the test with how to
/// install it.
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PgBouncer {
    pub fn start(server: &PgServer) -> PgBouncer {
        let bin = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .or_else(|| {
                std::env::var_os("PATH").and_then(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("pgbouncer"))
                        .find(|p| p.exists())
                })
            })
            .unwrap_or_else(|| {
                panic!(
                    "pgbouncer was not found in /usr/sbin or PATH: install it (Debian: apt-get \
                     install pgbouncer; `make test` does) and run the tests again"
                )
            });
        let dir = server.dir.with_extension("bouncer");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        chown(&dir, server.uid);
        let port = server.port + 1_000;
        let users = dir.join("userlist.txt");
        std::fs::write(&users, format!("\"{USER}\" \"{PASSWORD}\"\n")).unwrap();
        chown(&users, server.uid);
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 postgres = host={host} port={pgport} dbname=postgres\n\
                 [pgbouncer]\n\
                 listen_addr =\n\
                 listen_port = {port}\n\
                 unix_socket_dir = {dir}\n\
                 auth_type = scram-sha-256\n\
                 auth_file = {users}\n\
                 pool_mode = transaction\n\
                 default_pool_size = 2\n\
                 max_client_conn = 100\n\
                 logfile = {dir}/log\n\
                 pidfile = {dir}/pid\n",
                host = server.dir.display(),
                pgport = server.port,
                dir = dir.display(),
                users = users.display(),
            ),
        )
        .unwrap();
        chown(&ini, server.uid);
        let child = run_as(
            Command::new(bin)
                .arg(&ini)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            server.uid,
        )
        .spawn()
        .expect("start pgbouncer");
        let mut b = PgBouncer {
            dir,
            port,
            child: Some(child),
        };
        let socket = b.dir.join(format!(".s.PGSQL.{port}"));
        let start = Instant::now();
        while !socket.exists() {
            if let Some(Ok(Some(status))) = b.child.as_mut().map(Child::try_wait) {
                panic!("pgbouncer exited ({status}): {}", b.log());
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "pgbouncer did not listen within 30 s: {}",
                b.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        b
    }

    /// What PgBouncer logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// A connection string through PgBouncer.
    pub fn url(&self) -> String {
        format!(
            "host={} port={} user={USER} password={PASSWORD} dbname=postgres",
            self.dir.display(),
            self.port
        )
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
