//! The wake-up subscriber: listens on the queue's pub/sub channel and wakes the claim loops.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::shared::*;

/// Subscribes to the queue's wake-ups and forwards each due time to the claim loop;
/// resubscribes after a lost connection (meanwhile the reconcile claims cover).
pub(super) async fn listen(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    use futures_util::StreamExt;
    let channel = shared.cfg.channel();
    // On a cluster, any node will do: classic PUBLISH reaches every node. Rotate through the
    // seeds when one is lost.
    let nodes = if shared.cfg.cluster_nodes.is_empty() {
        vec![shared.cfg.url.clone()]
    } else {
        shared.cfg.cluster_nodes.clone()
    };
    let mut attempt = 0usize;
    loop {
        let node = nodes[attempt % nodes.len()].clone();
        attempt += 1;
        let subscribed = async {
            let client = redis::Client::open(node.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = tokio::select! {
            r = subscribed => r,
            _ = stop.changed() => return,
        };
        match pubsub {
            Ok(pubsub) => {
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        m = messages.next() => match m {
                            Some(m) => {
                                if let Ok(text) = m.get_payload::<String>() {
                                    wake_loops(&shared, &text);
                                }
                            }
                            None => break,
                        },
                        _ = stop.changed() => return,
                    }
                }
                tracing::warn!("wake-up subscription lost; resubscribing");
            }
            Err(e) => tracing::warn!(error = %e, "cannot subscribe to wake-ups; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Hands a wake-up (`due` or `due:shard`) to the claim loop of its shard, or, without a
/// shard (a queue of one shard, or an older producer), to every loop. Anything else is
/// ignored: any client may publish on the channel.
pub(super) fn wake_loops(shared: &Shared, text: &str) {
    let (due, shard) = match text.split_once(':') {
        Some((due, shard)) => match shard.parse::<u32>() {
            Ok(shard) => (due, Some(shard)),
            Err(_) => return,
        },
        None => (text, None),
    };
    let Ok(due) = due.parse::<u64>() else {
        return;
    };
    for (wake, _) in shared
        .wakes
        .iter()
        .zip(&shared.claim_from)
        .filter(|(_, &s)| shard.is_none_or(|wanted| wanted == s))
    {
        wake.at.fetch_min(due, SeqCst);
        wake.notify.notify_one();
    }
}
