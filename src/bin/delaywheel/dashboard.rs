//! `delaywheel dashboard`: a read-only page of the queue, served on loopback by hyper. One
//! HTML page (`dashboard.html`, no build step) that polls `/api/stats` every `--refresh`
//! seconds; every figure it shows comes from Redis, so it shows the whole fleet. The figures
//! per topic now (queued, leased, dead, latency) come from the [`census`](crate::census),
//! a paced walk of the queue, as of its last complete pass.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{now_ms, ListCursor, ListState, Producer, QueueError, TaskState};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::json;

use crate::census::{self, Census};
use crate::{fail, Exit};

const PAGE: &str = include_str!("dashboard.html");

/// Dead letters the page lists, at most.
const DEAD_SHOWN: usize = 20;

/// The page's data: per shard, per topic, and the first dead letters.
async fn stats(
    p: &Producer,
    namespace: &str,
    refresh: Duration,
    census: &Mutex<Option<Census>>,
) -> Result<serde_json::Value, QueueError> {
    let shards = p.shard_stats().await?;
    let topics = p.topic_counts().await?;
    let dead = p
        .list(ListState::Dead, &ListCursor::START, DEAD_SHOWN)
        .await?;
    let census = census.lock().as_ref().map(Census::to_json);
    Ok(json!({
        "namespace": namespace,
        "census": census,
        "at_ms": now_ms(),
        "refresh_ms": refresh.as_millis() as u64,
        "paused": shards.iter().any(|s| s.paused),
        "shards": shards.iter().map(|s| json!({
            "shard": s.shard,
            "queued": s.queued,
            "leased": s.leased,
            "dead": s.dead,
            "latency_ms": s.latency.as_millis() as u64,
            "paused": s.paused,
            "processed": s.processed,
            "failed": s.failed,
        })).collect::<Vec<_>>(),
        "topics": topics.iter().map(|t| json!({
            "topic": t.topic,
            "processed": t.processed,
            "failed": t.failed,
            "retried": t.retried,
            "dead_lettered": t.dead_lettered,
        })).collect::<Vec<_>>(),
        "dead": dead.tasks.iter().take(DEAD_SHOWN).map(|t| {
            let (reason, at) = match &t.state {
                TaskState::Dead { reason, at } => (reason.clone(), *at),
                _ => (String::new(), 0),
            };
            json!({
                "id": t.id,
                "reason": reason,
                "at_ms": at,
                "attempt": t.attempt,
                "topic": t.envelope.as_ref().map(|e| e.topic.to_string()),
            })
        }).collect::<Vec<_>>(),
    }))
}

fn respond(status: StatusCode, kind: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = kind.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    if let Ok(v) = "no-store".parse() {
        r.headers_mut().insert(hyper::header::CACHE_CONTROL, v);
    }
    r
}

/// The hosts the dashboard answers for. On a loopback address, a request must name a
/// loopback host (`localhost`, `*.localhost`, `127.0.0.1`, `[::1]`, any port: an SSH tunnel or
/// a port mapping changes it) or one given with `--allow-host` (the name a reverse proxy
/// forwards): a page elsewhere that points a name of its own at 127.0.0.1 (DNS rebinding)
/// sends that name, and is refused, where the browser would let it read the queue's ids and
/// dead letters. On another address, any host.
struct Hosts {
    any: bool,
    allowed: Vec<String>,
}

impl Hosts {
    fn new(addr: SocketAddr, allowed: &[String]) -> Hosts {
        Hosts {
            any: !addr.ip().is_loopback(),
            allowed: allowed
                .iter()
                .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
                .collect(),
        }
    }

    /// Whether a request naming `host` (its Host header) may be answered.
    fn allow(&self, host: Option<&str>) -> bool {
        if self.any {
            return true;
        }
        let Some(host) = host else {
            return false;
        };
        let name = match host.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some((ip, _)) => ip,
                None => return false,
            },
            None => host.split_once(':').map_or(host, |(name, _)| name),
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        name == "localhost"
            || name.ends_with(".localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
            || self.allowed.contains(&name)
    }
}

async fn route(
    req: Request<Incoming>,
    hosts: Arc<Hosts>,
    p: Arc<Producer>,
    namespace: Arc<str>,
    refresh: Duration,
    census: Arc<Mutex<Option<Census>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok());
    if !hosts.allow(host) {
        return Ok(respond(
            StatusCode::FORBIDDEN,
            "text/plain",
            "this dashboard answers only requests for a loopback host or an --allow-host\n",
        ));
    }
    if req.method() != Method::GET {
        return Ok(respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "read-only\n",
        ));
    }
    Ok(match req.uri().path() {
        "/" => respond(StatusCode::OK, "text/html; charset=utf-8", PAGE),
        "/api/stats" => match stats(&p, &namespace, refresh, &census).await {
            Ok(v) => respond(StatusCode::OK, "application/json", v.to_string()),
            Err(e) => respond(
                StatusCode::SERVICE_UNAVAILABLE,
                "application/json",
                json!({ "error": e.to_string() }).to_string(),
            ),
        },
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    })
}

/// Serves the dashboard on `listen` until the process is stopped, its census reading at most
/// `census_rate` tasks a second, answering requests for a loopback host or one of
/// `allow_hosts` (see [`Hosts`]).
pub(crate) async fn serve(
    p: Producer,
    namespace: &str,
    listen: SocketAddr,
    refresh: Duration,
    census_rate: u64,
    allow_hosts: &[String],
) -> Exit {
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => return fail(&format!("cannot listen on {listen}"), &e),
    };
    let addr = listener.local_addr().unwrap_or(listen);
    println!("dashboard of {namespace:?} at http://{addr}/ (read-only; Ctrl-C stops it)");
    let (p, namespace) = (Arc::new(p), Arc::<str>::from(namespace));
    let last = Arc::new(Mutex::new(None));
    let hosts = Arc::new(Hosts::new(addr, allow_hosts));
    tokio::spawn(census::run(p.clone(), census_rate, refresh, last.clone()));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors, say: wait a little rather than spin.
                tracing_warn(&e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (p, namespace, last, hosts) =
            (p.clone(), namespace.clone(), last.clone(), hosts.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                route(
                    req,
                    hosts.clone(),
                    p.clone(),
                    namespace.clone(),
                    refresh,
                    last.clone(),
                )
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn tracing_warn(e: &std::io::Error) {
    eprintln!("delaywheel: accept failed: {e}");
}
