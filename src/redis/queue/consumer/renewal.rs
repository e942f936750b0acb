//! Lease renewal: renews the leases of the tasks this consumer holds, every `lease / 3`.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;

use super::shared::*;
use super::writes::*;

/// The tasks whose leases are to be extended, by shard: fired ones whose outcome is not
/// written yet, and claimed ones already due (waiting for a handler thread).
pub(super) fn renewals(shared: &Shared) -> HashMap<u32, Vec<(String, Arc<str>)>> {
    let now = now_ms();
    let mut tasks = Vec::new();
    // `held` first: a task that fires meanwhile moves from `held` to `working`, so it is seen
    // in one of them (or both: renewed twice), never in neither.
    tasks.extend(
        shared
            .held
            .lock()
            .iter()
            .filter(|(_, (_, _, due))| *due <= now)
            .map(|((shard, id), (_, owner, _))| (*shard, (id.clone(), owner.clone()))),
    );
    tasks.extend(
        shared
            .working
            .lock()
            .iter()
            .map(|((shard, id), owner)| (*shard, (id.clone(), owner.clone()))),
    );
    // Taken for a hand-back Redis has not confirmed yet: leased to this consumer until then.
    tasks.extend(
        shared
            .handing_back
            .lock()
            .iter()
            .map(|(shard, id, owner, _)| (*shard, (id.clone(), owner.clone()))),
    );
    by_shard(tasks)
}

/// Extends the leases of `tasks` on `shard` until a full `lease` from now.
pub(super) async fn renew(shared: Arc<Shared>, shard: u32, tasks: Vec<(String, Arc<str>)>) -> Done {
    let lease = u64::try_from(shared.cfg.lease.as_millis()).unwrap_or(u64::MAX);
    let keys = &shared.shards[shard as usize];
    for chunk in tasks.chunks(PER_CALL) {
        let mut inv = scripts::RENEW.prepare_invoke();
        inv.key(keys.lease()).key(keys.owner()).arg(lease);
        for (id, owner) in chunk {
            inv.arg(id.as_str()).arg(&**owner);
        }
        match shared.conn.run::<u64>(&inv).await {
            Ok(n) => {
                shared.counters.renewed.fetch_add(n, Relaxed);
                metrics::counter!("delaywheel_queue_leases_renewed_total").increment(n);
            }
            // The next round tries again; until then the leases run as they were.
            Err(e) => tracing::debug!(error = %e, shard, "renewing leases failed"),
        }
    }
    Done::Other
}
