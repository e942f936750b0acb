//! [`Claimed`]: a claimed task, as the wheel holds it.

use std::sync::Arc;

use crate::redis::envelope::Envelope;

/// A claimed task in the wheel: its shard, its owner value (`consumer|token`) and envelope.
pub(super) struct Claimed {
    pub(super) shard: u32,
    pub(super) owner: Arc<str>,
    pub(super) envelope: Envelope,
}
