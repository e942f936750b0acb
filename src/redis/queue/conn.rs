//! [`Conn`]: the queue's Redis connection, shared by the producer and the consumer sides,
//! counting the commands it sends; and the depth sample both sides read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::redis::layout::KeyLayout;
use crate::redis::link::{claim_namespaces, Link, QUEUE_ROLE};
use crate::redis::queue::config::{QueueConfig, QueueError};
use crate::redis::queue::scripts;

/// How long connecting waits for the scripts to load on every node.
const PRELOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Redis connection shared by the producer and consumer sides, counting the commands it sends.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) conn: Link,
    pub(crate) commands: Arc<AtomicU64>,
}

impl Conn {
    /// Connects to `cfg.cluster_nodes` as a cluster when there are any, else to `cfg.url`,
    /// loads the scripts, and claims the key sets of `shards` for the queue: one a
    /// [`Persistent`](crate::redis::Persistent) engine uses is refused with [`QueueError::InUse`].
    pub(crate) async fn open(cfg: &QueueConfig, shards: &[KeyLayout]) -> Result<Conn, QueueError> {
        let conn = Conn {
            conn: Link::open(&cfg.url, &cfg.cluster_nodes).await?,
            commands: Arc::new(AtomicU64::new(0)),
        };
        conn.preload().await;
        conn.count(shards.len() as u64);
        claim_namespaces(&conn.conn, shards, QUEUE_ROLE)
            .await
            .map_err(QueueError::InUse)?;
        Ok(conn)
    }

    /// As [`open`](Self::open), for a namespace a queue has used already: one whose kind key
    /// is missing on any shard is refused with [`QueueError::UnknownNamespace`], and nothing is
    /// written to it. For tools that inspect a queue, where a mistyped namespace must not
    /// become a new, empty queue.
    pub(crate) async fn open_existing(
        cfg: &QueueConfig,
        shards: &[KeyLayout],
    ) -> Result<Conn, QueueError> {
        let link = Link::open(&cfg.url, &cfg.cluster_nodes).await?;
        for keys in shards {
            let mut c = link.clone();
            let kind: Option<String> = redis::cmd("GET")
                .arg(keys.kind())
                .query_async(&mut c)
                .await?;
            if kind.is_none() {
                return Err(QueueError::UnknownNamespace(keys.namespace().to_owned()));
            }
        }
        // A shard past the count given: the queue has more shards, and ids would be looked up
        // on the wrong ones.
        if shards.len() > 1 {
            let next = KeyLayout::new(&format!("{}:{}", cfg.namespace, shards.len()));
            if let Ok(next) = next {
                let mut c = link.clone();
                let kind: Option<String> = redis::cmd("GET")
                    .arg(next.kind())
                    .query_async(&mut c)
                    .await?;
                if kind.is_some() {
                    return Err(QueueError::Config(
                        "the queue has more shards than `shards` says: give its shard count",
                    ));
                }
            }
        }
        let conn = Conn {
            conn: link,
            commands: Arc::new(AtomicU64::new(shards.len() as u64)),
        };
        conn.preload().await;
        conn.count(shards.len() as u64);
        claim_namespaces(&conn.conn, shards, QUEUE_ROLE)
            .await
            .map_err(QueueError::InUse)?;
        Ok(conn)
    }

    /// Loads every queue script on every node now, while they answer. Otherwise a script's
    /// first call loads it, on all nodes at once (a cluster sends SCRIPT LOAD to every node),
    /// and waits for any node that does not answer, also when the call is for another node's
    /// shard: a consumer's first hand-back at shutdown, say, would wait on a hung node for
    /// every shard. A failure is only logged: a script not loaded here loads on its first call.
    async fn preload(&self) {
        let loads = scripts::ALL.iter().map(|script| {
            let mut conn = self.conn.clone();
            async move { script.load_async(&mut conn).await }
        });
        self.count(scripts::ALL.len() as u64);
        // Not for long: a node that does not answer must not hold up the start.
        let loaded =
            tokio::time::timeout(PRELOAD_TIMEOUT, futures_util::future::join_all(loads)).await;
        let failed = match loaded {
            Ok(results) => results
                .into_iter()
                .find_map(Result::err)
                .map(|e| e.to_string()),
            Err(_) => Some(format!("no answer within {PRELOAD_TIMEOUT:?}")),
        };
        if let Some(e) = failed {
            tracing::warn!(error = %e, "could not load the queue's scripts ahead; each loads on its first call");
        }
    }

    /// Counts `n` commands about to be sent, in `commands` and in the metric.
    pub(crate) fn count(&self, n: u64) {
        self.commands.fetch_add(n, Relaxed);
        metrics::counter!("delaywheel_queue_redis_commands_total").increment(n);
    }

    /// Runs a script invocation (one command on the wire; EVALSHA, with a reload after a
    /// server restart dropped the script cache).
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, redis::RedisError> {
        self.count(1);
        let mut conn = self.conn.clone();
        inv.invoke_async(&mut conn).await
    }
}

/// Sizes of a queue's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueDepth {
    /// Tasks waiting to be claimed (ZCARD of `due`).
    pub queued: u64,
    /// Tasks claimed by a consumer (ZCARD of `lease`).
    pub leased: u64,
    /// Dead-lettered tasks (HLEN of `dead`).
    pub dead: u64,
}

pub(crate) async fn sample_depth(conn: &Conn, keys: &KeyLayout) -> Result<QueueDepth, QueueError> {
    Ok(sample_shard(conn, keys, false).await?.0)
}

/// A shard's depth and, with `oldest`, the due time (ms) of its oldest queued task (the
/// next to claim, whether due or not): one pipeline of three or four reads.
pub(crate) async fn sample_shard(
    conn: &Conn,
    keys: &KeyLayout,
    oldest: bool,
) -> Result<(QueueDepth, Option<f64>), QueueError> {
    let mut c = conn.conn.clone();
    let mut pipe = redis::pipe();
    pipe.cmd("ZCARD")
        .arg(keys.due())
        .cmd("ZCARD")
        .arg(keys.lease())
        .cmd("HLEN")
        .arg(keys.dead());
    if oldest {
        pipe.cmd("ZRANGE")
            .arg(keys.due())
            .arg(0)
            .arg(0)
            .arg("WITHSCORES");
    }
    conn.count(3 + u64::from(oldest));
    let (queued, leased, dead, first) = if oldest {
        let (q, l, d, first): (u64, u64, u64, Vec<(Vec<u8>, f64)>) =
            pipe.query_async(&mut c).await?;
        (q, l, d, first.first().map(|(_, s)| *s))
    } else {
        let (q, l, d): (u64, u64, u64) = pipe.query_async(&mut c).await?;
        (q, l, d, None)
    };
    Ok((
        QueueDepth {
            queued,
            leased,
            dead,
        },
        first,
    ))
}
