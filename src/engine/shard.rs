//! One shard: a wheel behind its own mutex, with the counters that are only ever updated while
//! that mutex is held (so they cost no extra atomic operation and share no cache line).

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::wheel::{Layout, Wheel};

/// What one shard holds under its lock.
#[derive(Debug)]
pub(crate) struct ShardState<T> {
    pub(crate) wheel: Wheel<T>,
    pub(crate) scheduled: u64,
    pub(crate) cancelled: u64,
    pub(crate) reset: u64,
    pub(crate) fired: u64,
}

/// A shard, padded to its own cache lines so that producers on different shards never contend.
pub(crate) type Shard<T> = CachePadded<Mutex<ShardState<T>>>;

pub(crate) fn new_shard<T>(layout: Layout) -> Shard<T> {
    CachePadded::new(Mutex::new(ShardState {
        wheel: Wheel::with_layout(layout),
        scheduled: 0,
        cancelled: 0,
        reset: 0,
        fired: 0,
    }))
}
