//! How delaywheel talks to Redis: one node through a multiplexed connection that reconnects
//! by itself, or a Redis Cluster, which routes each command by the slot of its keys. Every key
//! of a namespace (and of a queue shard) carries one hash tag, so each command, script and
//! MULTI batch stays in one slot.

use std::time::Duration;

use redis::aio::ConnectionManager;

/// How many times a failed (re)connection, or a cluster command that certainly did not run
/// (`not_run`), is retried before the error is returned: the callers (the flusher, the
/// consumer loops) have their own backoff, and a wrong password should fail fast.
const RETRIES: u32 = 2;

/// The longest wait between those retries.
const MAX_RETRY_WAIT: Duration = Duration::from_millis(200);

/// How long a reply may take. A claim of 500 large envelopes can be a reply of megabytes: do
/// not give up on it after the redis crate's default 500 ms while the script has already run;
/// but never wait forever on a server that stopped answering without closing the connection.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A multiplexed connection to one node that reconnects by itself, with the limits above.
pub(crate) async fn connection_manager(url: &str) -> Result<ConnectionManager, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_number_of_retries(RETRIES as usize)
        .set_max_delay(MAX_RETRY_WAIT)
        .set_response_timeout(Some(RESPONSE_TIMEOUT));
    client.get_connection_manager_with_config(config).await
}

/// A connection to one Redis node, or to a Redis Cluster.
#[derive(Clone)]
pub(crate) enum Link {
    Node(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// The redis crate's connections spawn tasks on the current Tokio runtime and use its time
/// and I/O drivers, and panic without them: a connection attempted outside a runtime (from a
/// `futures` executor, say), or on a runtime built without `enable_time` or `enable_io`, is
/// refused instead. Tokio offers no way to ask whether a driver is enabled, so each is probed
/// by what panics without it (a zero sleep; on Unix, a socket pair), and the panic is caught:
/// its message is still printed by the panic hook, and under `panic = "abort"` it aborts.
fn in_tokio_runtime() -> Result<(), redis::RedisError> {
    let refused = |what: &'static str| redis::RedisError::from((redis::ErrorKind::Client, what));
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(refused(
            "delaywheel's async Redis connections must be made within a Tokio runtime",
        ));
    }
    if std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO))).is_err() {
        return Err(refused(
            "the Tokio runtime has no time driver: build it with `enable_all` (or `enable_time`)",
        ));
    }
    #[cfg(unix)]
    if std::panic::catch_unwind(|| drop(tokio::net::UnixStream::pair())).is_err() {
        return Err(refused(
            "the Tokio runtime has no I/O driver: build it with `enable_all` (or `enable_io`)",
        ));
    }
    Ok(())
}

impl Link {
    /// Connects to the node at `url`.
    pub(crate) async fn node(url: &str) -> Result<Link, redis::RedisError> {
        in_tokio_runtime()?;
        Ok(Link::Node(connection_manager(url).await?))
    }

    /// Connects to the Redis Cluster that `nodes` (seed node URLs) belong to, with the same
    /// retry and reply limits as a node.
    pub(crate) async fn cluster(nodes: &[String]) -> Result<Link, redis::RedisError> {
        in_tokio_runtime()?;
        let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
            // Never 2 here: the cluster client would also send a command again after a reply
            // timeout or a dropped connection, when the first may already have run: a script
            // twice. What is safe to send again is sent again by `Link` (`not_run`).
            .retries(0)
            .max_retry_wait(MAX_RETRY_WAIT.as_millis() as u64)
            .connection_timeout(RESPONSE_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .build()?;
        Ok(Link::Cluster(client.get_async_connection().await?))
    }

    /// For a configuration: the cluster of `cluster_nodes` when there are any, else `url`.
    pub(crate) async fn open(
        url: &str,
        cluster_nodes: &[String],
    ) -> Result<Link, redis::RedisError> {
        if cluster_nodes.is_empty() {
            Link::node(url).await
        } else {
            Link::cluster(cluster_nodes).await
        }
    }
}

impl redis::aio::ConnectionLike for Link {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Link::Node(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => Box::pin(async move {
                let mut sent = 0;
                loop {
                    match c.req_packed_command(cmd).await {
                        Err(e) if sent < RETRIES && not_run(&e) => {
                            sent += 1;
                            tracing::debug!(error = %e, "cluster refused a command; sending it again");
                            tokio::time::sleep(MAX_RETRY_WAIT / 4 * sent).await;
                        }
                        reply => return reply,
                    }
                }
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Link::Node(c) => c.req_packed_commands(pipeline, offset, count),
            // A plain pipeline is never sent again: part of it may have run. A MULTI refused
            // whole (EXECABORT, every queued command refused as `not_run` says) ran nothing,
            // but the cluster client does not learn a moved slot from it, and would send it to
            // the old node for ever: a single command on its first key does (its MOVED makes
            // the client rebuild its slot map), then the MULTI goes again.
            Link::Cluster(c) => Box::pin(async move {
                let mut sent = 0;
                loop {
                    match c.req_packed_commands(pipeline, offset, count).await {
                        Err(e) if sent < RETRIES && discarded(&e) => {
                            sent += 1;
                            tracing::debug!(error = %e, "cluster refused a transaction; sending it again");
                            if let Some(key) = first_key(pipeline) {
                                let probe = redis::cmd("EXISTS").arg(key).clone();
                                let _ = c.req_packed_command(&probe).await;
                            }
                            tokio::time::sleep(MAX_RETRY_WAIT / 4 * sent).await;
                        }
                        reply => return reply,
                    }
                }
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Node(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }
}

/// Whether a command that failed with `e` certainly did not run, so that sending it again
/// cannot run it twice: the cluster moved its slot (`MOVED`; the client refreshes its slot
/// map meanwhile), refused it while it reconfigures (`TRYAGAIN`, `CLUSTERDOWN`,
/// `MASTERDOWN`, `LOADING`, `READONLY` from a demoted master), or the client had no
/// connection to send it on. Not `ASK` (it needs `ASKING` on the other node first: the error
/// goes to the caller, whose own backoff tries again), and never a reply timeout or a dropped
/// connection, after which the command may well have run.
fn not_run(e: &redis::RedisError) -> bool {
    use redis::RetryMethod::*;
    // Any other (newer) kind: not known to be safe.
    matches!(
        e.retry_method(),
        MovedRedirect | WaitAndRetry | RefreshSlotsAndRetry | ReconnectFromInitialConnections
    )
}

/// Whether a retry can get past the error `e` that a command failed with: a dropped
/// connection, a timeout, a cluster refusing it while it reconfigures, a server loading;
/// not an answer no retry changes (`NOPERM`, `WRONGTYPE`, a script error). Whether the
/// command may have run is another question ([`may_have_run`]): only a command that can run
/// twice without harm is sent again on this alone.
pub(crate) fn passing(e: &redis::RedisError) -> bool {
    !matches!(e.retry_method(), redis::RetryMethod::NoRetry)
}

/// Whether a command that failed with `e` may have run all the same: an I/O error (a reply
/// that timed out, a connection that dropped after the command went out), not a refused
/// connection, nor an answer from Redis.
pub(crate) fn may_have_run(e: &redis::RedisError) -> bool {
    e.is_io_error() && !e.is_connection_refusal()
}

/// Whether `e` is a MULTI that Redis discarded whole, every queued command refused with a
/// code that says it did not run (`MOVED`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`,
/// `LOADING`, `READONLY`): nothing of it ran.
fn discarded(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind::*;
    e.kind() == redis::ErrorKind::Server(ExecAbort)
        && e.clone().into_server_errors().is_some_and(|errors| {
            !errors.is_empty()
                && errors.iter().all(|(_, err)| {
                    matches!(
                        err.kind(),
                        Some(Moved | TryAgain | ClusterDown | MasterDown | BusyLoading | ReadOnly)
                    )
                })
        })
}

/// The first key of a pipeline: the first argument after the name of its first command that
/// has one (MULTI has none).
fn first_key(pipeline: &redis::Pipeline) -> Option<Vec<u8>> {
    pipeline
        .cmd_iter()
        .find_map(|cmd| match cmd.args_iter().nth(1) {
            Some(redis::Arg::Simple(key)) => Some(key.to_vec()),
            _ => None,
        })
}

/// The role names a namespace's `{ns}:kind` key holds.
pub(crate) const PERSISTENT_ROLE: &str = "persistent";
pub(crate) const QUEUE_ROLE: &str = "queue";

/// How long a start waits for its namespace claims: a node that does not answer must not hold
/// it up (the claim is then skipped, with a warning).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(2);

/// `lua/claim_namespace.lua`: its header gives its keys, arguments and reply.
static CLAIM: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("lua/claim_namespace.lua")));

/// A role's own keys in a namespace, with the type each must have, and the keys only the other
/// role writes.
fn role_keys(keys: &super::KeyLayout, role: &str) -> (Vec<(String, &'static str)>, Vec<String>) {
    let shared = [
        (keys.due().to_owned(), "zset"),
        (keys.tasks().to_owned(), "hash"),
        (keys.dead().to_owned(), "hash"),
    ];
    let persistent = [
        (keys.engine().to_owned(), "string"),
        (keys.engine_takes().to_owned(), "string"),
    ];
    let queue = [
        (keys.lease().to_owned(), "zset"),
        (keys.owner().to_owned(), "hash"),
        (keys.fence().to_owned(), "string"),
        (keys.expired().to_owned(), "hash"),
        (keys.unpaired().to_owned(), "hash"),
    ];
    let (own, other): (Vec<_>, Vec<_>) = if role == QUEUE_ROLE {
        (queue.to_vec(), persistent.to_vec())
    } else {
        (persistent.to_vec(), queue.to_vec())
    };
    let own = shared.into_iter().chain(own).collect();
    // The lease, owner and fence are what show a queue (its fence, a counter, stays for
    // ever); `expired` and `unpaired` come and go.
    let other = other
        .into_iter()
        .map(|(key, _)| key)
        .filter(|key| key != keys.expired() && key != keys.unpaired())
        .collect();
    (own, other)
}

/// Claims the namespaces `layouts` for `role` (the [`CLAIM`] script, one call per namespace):
/// `Err` names the first one refused, and the key that refused it (the kind key naming the
/// other role, a key only the other role writes, or a key of the wrong type). A namespace
/// Redis cannot be asked about in time is only logged.
pub(crate) async fn claim_namespaces<'a>(
    link: &Link,
    layouts: impl IntoIterator<Item = &'a super::KeyLayout>,
    role: &str,
) -> Result<(), super::NamespaceInUse> {
    let other_role = if role == QUEUE_ROLE {
        PERSISTENT_ROLE
    } else {
        QUEUE_ROLE
    };
    let claims = layouts.into_iter().map(|keys| {
        let mut conn = link.clone();
        let (own, other) = role_keys(keys, role);
        let mut script = CLAIM.prepare_invoke();
        script.key(keys.kind());
        for (key, _) in &own {
            script.key(key.as_str());
        }
        for key in &other {
            script.key(key.as_str());
        }
        script.arg(role).arg(own.len());
        for (_, expected) in &own {
            script.arg(*expected);
        }
        script.arg(other_role);
        let namespace = keys.namespace().to_owned();
        async move {
            // Each on its own clock: one slow node must not discard the others' answers.
            let answer =
                tokio::time::timeout(CLAIM_TIMEOUT, script.invoke_async::<Vec<String>>(&mut conn))
                    .await;
            (namespace, answer)
        }
    });
    let answers = futures_util::future::join_all(claims).await;
    for (namespace, answer) in answers {
        match answer {
            Ok(Ok(reply)) => match reply.as_slice() {
                [ok] if ok == "ok" => {}
                [inuse, by, key] if inuse == "inuse" => {
                    return Err(super::NamespaceInUse {
                        namespace,
                        by: by.clone(),
                        key: key.clone(),
                    });
                }
                [wrong, key, found, expected] if wrong == "type" => {
                    return Err(super::NamespaceInUse {
                        namespace,
                        by: format!(
                            "another client (its key {key} is a {found}, not the {expected} \
                             this role keeps there)"
                        ),
                        key: key.clone(),
                    });
                }
                _ => {
                    tracing::warn!(%namespace, role, ?reply, "namespace claim answered oddly; not checked");
                }
            },
            Ok(Err(e)) => {
                // An ACL user without the rights, a read-only replica: not checked.
                tracing::warn!(%namespace, role, error = %e, "namespace claim failed; not checked");
            }
            Err(_) => {
                tracing::warn!(%namespace, role, "namespace claim unanswered within {CLAIM_TIMEOUT:?}; not checked");
            }
        }
    }
    Ok(())
}

/// Whether `e` (a transaction's failure, or a command's) says a key held another type.
pub(crate) fn wrong_type(e: &redis::RedisError) -> bool {
    e.code() == Some("WRONGTYPE")
        || e.clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, err)| err.code() == "WRONGTYPE"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    /// Only an error on a connection that was made may hide a command that ran.
    #[test]
    fn which_failures_may_have_run() {
        let io = |kind: ErrorKind| redis::RedisError::from(Error::new(kind, "test"));
        assert!(may_have_run(&io(ErrorKind::TimedOut)));
        assert!(may_have_run(&io(ErrorKind::ConnectionReset)));
        assert!(may_have_run(&io(ErrorKind::UnexpectedEof)));
        assert!(!may_have_run(&io(ErrorKind::ConnectionRefused)));
        let refused = redis::RedisError::from((redis::ErrorKind::Client, "test"));
        assert!(!may_have_run(&refused));
        assert!(!not_run(&io(ErrorKind::TimedOut)));
        assert!(!not_run(&refused));
    }
}
