//! How delaywheel talks to Redis: one node through a multiplexed connection that reconnects
//! by itself, or a Redis Cluster, which routes each command by the slot of its keys. Every key
//! of a namespace (and of a queue shard) carries one hash tag, so each command, script and
//! MULTI batch stays in one slot.

use redis::aio::ConnectionManager;

/// A multiplexed connection that reconnects by itself. A failed (re)connection is retried
/// twice, within half a second, before the error is returned: the callers (the flusher, the
/// consumer loops) have their own backoff, and a wrong password should fail fast. Replies may
/// take up to 10 s.
pub(crate) async fn connection_manager(url: &str) -> Result<ConnectionManager, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_number_of_retries(2)
        .set_max_delay(std::time::Duration::from_millis(200))
        // A claim of 500 large envelopes can be a reply of megabytes: do not give up on it
        // after the default 500 ms while the script has already run.
        .set_response_timeout(Some(std::time::Duration::from_secs(10)));
    client.get_connection_manager_with_config(config).await
}

/// A connection to one Redis node, or to a Redis Cluster.
#[derive(Clone)]
pub(crate) enum Link {
    Node(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Link {
    /// Connects to the cluster of `cluster_nodes` when there are any, else to `url`.
    pub(crate) async fn open(
        url: &str,
        cluster_nodes: &[String],
    ) -> Result<Link, redis::RedisError> {
        if cluster_nodes.is_empty() {
            return Ok(Link::Node(connection_manager(url).await?));
        }
        let client = redis::cluster::ClusterClient::new(cluster_nodes.to_vec())?;
        Ok(Link::Cluster(client.get_async_connection().await?))
    }
}

impl redis::aio::ConnectionLike for Link {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Link::Node(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
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
            Link::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Node(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }
}
