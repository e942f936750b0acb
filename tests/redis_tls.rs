//! TLS to Redis through the connection URL (feature `tls`): a private `redis-server` with a
//! TLS port and a certificate made for this test, trusted through `SSL_CERT_FILE`.
//! (One test in its own binary: it sets that variable before anything reads it.)
#![cfg(feature = "tls")]

use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use delaywheel::redis::{now_ms, PersistConfig, PersistError, Persistent};

const INSTALL: &str = "redis-server and openssl must be on PATH (Debian/Ubuntu: \
    `apt-get install -y redis-server openssl`), or run `make test`.";

#[test]
fn persistence_works_over_rediss_and_refuses_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let made = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("{INSTALL} ({e})"));
    assert!(made.success(), "openssl could not make a certificate");
    // Sound: this binary has this one test, and no other thread reads the environment yet.
    std::env::set_var("SSL_CERT_FILE", &cert);

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            &port.to_string(),
        ])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--tls-ca-cert-file")
        .arg(&cert)
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{INSTALL} ({e})"));
    // Killed however the test ends, a failed assertion included.
    let _server = KillOnDrop(server);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "redis-server did not open its TLS port"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let url = format!("rediss://127.0.0.1:{port}/");
    let (p, _fired) = Persistent::start(PersistConfig::new(url.clone(), "tls")).unwrap();
    p.schedule_at_ms(
        "secure",
        "t",
        serde_json::json!("over TLS"),
        now_ms() + 60_000,
    )
    .unwrap();
    assert!(p.flush(Duration::from_secs(30)));
    drop(p);
    let (p, _fired) = Persistent::start(PersistConfig::new(url, "tls")).unwrap();
    assert_eq!(p.restore(10).unwrap().loaded, 1);
    assert!(p.contains("secure"));
    drop(p);

    // Plain text to the TLS port is refused with a typed error.
    let plain = format!("redis://127.0.0.1:{port}/");
    assert!(matches!(
        Persistent::start(PersistConfig::new(plain, "tls")),
        Err(PersistError::Store(_))
    ));
}

/// A child process killed and reaped when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
