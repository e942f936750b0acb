//! The outcome writer's write tasks: what each one is ([`Job`]) and what it returns ([`Done`]).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinSet;

/// The resolver's write tasks, and what each one is: its end is booked through it, also when
/// it panicked and returned nothing.
#[derive(Default)]
pub(super) struct Writes {
    pub(super) set: JoinSet<Done>,
    pub(super) jobs: HashMap<tokio::task::Id, Job>,
}

impl Writes {
    pub(super) fn spawn(
        &mut self,
        task: impl std::future::Future<Output = Done> + Send + 'static,
        job: Job,
    ) {
        let task = self.set.spawn(task);
        self.jobs.insert(task.id(), job);
    }
}

/// An ack waiting to be sent: task id, owner, and whether an earlier call carrying it failed
/// (and so may have run: Redis then tells a task already gone from a refusal).
pub(super) type PendingAck = (String, Arc<str>, bool, u64);

/// A write task of the resolver, and what it needs back if the task panics.
pub(super) enum Job {
    /// An ack call: the batch is put back if the call fails.
    Acks {
        shard: u32,
        batch: Arc<Vec<PendingAck>>,
    },
    Renewal {
        shard: u32,
    },
    /// A retry or dead-lettering: settled (its lease left to run out) if the task panics.
    Outcome {
        shard: u32,
        id: String,
        owner: Arc<str>,
    },
}

impl Job {
    pub(super) fn shard(&self) -> u32 {
        match self {
            Job::Acks { shard, .. } | Job::Renewal { shard } | Job::Outcome { shard, .. } => *shard,
        }
    }
}

/// What a write task returns.
pub(super) enum Done {
    /// Redis's answer to an ack call, per task (1: acked; 2: already gone, as after a resend; 0: refused).
    Acks(Result<Vec<u8>, redis::RedisError>),
    /// A renewal or an outcome written (or given up on).
    Other,
}
