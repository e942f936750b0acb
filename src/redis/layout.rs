//! The names of a namespace's keys.

use std::fmt;

/// The keys of one namespace (see the [module docs](super) for the layout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLayout {
    due: String,
    tasks: String,
    dead: String,
    lease: String,
    owner: String,
    fence: String,
    expired: String,
    unpaired: String,
    paused: String,
    stats: String,
    kind: String,
    engine: String,
    takes: String,
    ns: String,
}

/// A name for this process in leases and logs: host, pid and a random number (so that two
/// instances in one process differ too).
pub(crate) fn instance_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    format!(
        "{}-{}-{:08x}",
        host.trim(),
        std::process::id(),
        fastrand::u32(..)
    )
}

/// A namespace that cannot be used as a hash tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceError(pub String);

impl fmt::Display for NamespaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "namespace {:?} must be non-empty and contain no '{{' or '}}' (and a queue's must \
             not end in ':' and digits, the names of a sharded queue's shards)",
            self.0
        )
    }
}

impl std::error::Error for NamespaceError {}

/// A namespace (or one shard's key set of a sharded queue) that the other role already uses:
/// a [`Persistent`](super::Persistent) engine and a queue on the same keys would take each
/// other's tasks. Its `{ns}:kind` key names the role that claimed it first; a namespace with
/// no kind key is the other role's too when it holds a key only that role writes (a queue's
/// `lease`, `owner` or `fence`; a `Persistent` engine's writer lease `engine` or its
/// `engine:takes`), since a producer in another language need not set the kind key. A
/// namespace one of whose keys has the wrong type (another client's data under the same hash
/// tag) is refused too, naming the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceInUse {
    /// The namespace (or shard key set, `ns:i`) refused.
    pub namespace: String,
    /// The role using it, `persistent` or `queue`; or whatever another client wrote in its
    /// kind key; or `another client (...)` for a key of the wrong type, with what was found.
    pub by: String,
    /// The key that shows it: the kind key, a key of the other role's, or the key of the
    /// wrong type.
    pub key: String,
}

impl fmt::Display for NamespaceInUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let by = match self.by.as_str() {
            role @ ("queue" | "persistent") => format!("a {role}"),
            other => other.to_owned(),
        };
        write!(
            f,
            "namespace {:?} is used by {by} (key {}): give each role its own namespace",
            self.namespace, self.key
        )
    }
}

impl std::error::Error for NamespaceInUse {}

impl KeyLayout {
    /// The keys of namespace `ns`. Refuses an empty namespace or one containing a brace (it
    /// would break the hash tag), handing the name back.
    pub fn new(ns: &str) -> Result<KeyLayout, NamespaceError> {
        if ns.is_empty() || ns.contains(['{', '}']) {
            return Err(NamespaceError(ns.to_string()));
        }
        Ok(KeyLayout {
            due: format!("{{{ns}}}:due"),
            tasks: format!("{{{ns}}}:tasks"),
            dead: format!("{{{ns}}}:dead"),
            lease: format!("{{{ns}}}:lease"),
            owner: format!("{{{ns}}}:owner"),
            fence: format!("{{{ns}}}:fence"),
            expired: format!("{{{ns}}}:expired"),
            unpaired: format!("{{{ns}}}:unpaired"),
            paused: format!("{{{ns}}}:paused"),
            stats: format!("{{{ns}}}:stats"),
            kind: format!("{{{ns}}}:kind"),
            engine: format!("{{{ns}}}:engine"),
            takes: format!("{{{ns}}}:engine:takes"),
            ns: ns.to_string(),
        })
    }

    /// The ZSET of due times.
    pub fn due(&self) -> &str {
        &self.due
    }

    /// The HASH of envelopes.
    pub fn tasks(&self) -> &str {
        &self.tasks
    }

    /// The HASH of dead-lettered entries.
    pub fn dead(&self) -> &str {
        &self.dead
    }

    /// The queue's ZSET of claimed tasks: id → lease deadline (ms).
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// The queue's HASH of claim owners: id → `consumer|token`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The queue's counter of claim (fencing) tokens.
    pub fn fence(&self) -> &str {
        &self.fence
    }

    /// The queue's HASH of lease expiries: id → how many times a lease on the task ran out
    /// (its consumer crashed or stalled), kept until the task is acknowledged, dead-lettered,
    /// cancelled or replaced.
    pub fn expired(&self) -> &str {
        &self.expired
    }

    /// The queue's HASH of ids seen with half of their pair (a `{ns}:due` entry with no
    /// envelope, or an envelope with no queue entry) → when first seen (ms, Redis's clock),
    /// for the grace period [`QueueConfig::unpaired_grace`](super::QueueConfig::unpaired_grace)
    /// gives a producer that writes the two in separate commands.
    pub fn unpaired(&self) -> &str {
        &self.unpaired
    }

    /// The queue's pause flag, one per shard: while it exists, claims lease nothing (see
    /// [`Producer::pause`](super::Producer::pause)). Its value says who paused it and when.
    pub fn paused(&self) -> &str {
        &self.paused
    }

    /// The queue's HASH of outcome counts per topic (`topic|processed`, `topic|failed`,
    /// `topic|retried`, `topic|dead_lettered`), which every consumer adds to every
    /// `reaper_interval`; kept in the first shard's key set. For dashboards, which read Redis
    /// (see [`Producer::topic_counts`](super::Producer::topic_counts)).
    pub fn stats(&self) -> &str {
        &self.stats
    }

    /// The queue's marker of task `id`'s unique window: set when the task is acknowledged, if
    /// it was enqueued with [`Producer::enqueue_unique`](super::Producer::enqueue_unique), and
    /// expiring at the window's end; while it exists, `enqueue_unique` refuses the id. In the
    /// shard's hash slot.
    pub fn unique_marker(&self, id: &str) -> String {
        format!("{{{}}}:unique:{id}", self.ns)
    }

    /// The queue's HASH of periodic schedules, name → definition (JSON); kept in the first
    /// shard's key set (see [`Producer::add_periodic`](super::Producer::add_periodic)).
    pub fn periodic(&self) -> String {
        format!("{{{}}}:periodic", self.ns)
    }

    /// The queue's HASH of each periodic schedule's last enqueued occurrence (ms), for the
    /// catch-up after no scheduler ran; kept in the first shard's key set.
    pub fn periodic_last(&self) -> String {
        format!("{{{}}}:periodic:last", self.ns)
    }

    /// The marker of periodic occurrence task `id`: set by the first scheduler to enqueue it,
    /// so that the others do not (expiring after a while). In the task's shard's hash slot.
    pub fn periodic_marker(&self, id: &str) -> String {
        format!("{{{}}}:periodic:marker:{id}", self.ns)
    }

    /// The queue's LIST of the last claim of consumer `consumer` (a consumer passes its id and
    /// a random instance number, `id:instance`): the claim's nonce, its
    /// token, then each leased id and its due time. A claim retried with the same nonce (its
    /// reply was lost) answers with it instead of claiming again. Expires with the claim's
    /// leases.
    pub fn batch(&self, consumer: &str) -> String {
        format!("{{{}}}:batch:{consumer}", self.ns)
    }

    /// Which role uses the namespace, `persistent` or `queue`: set by the first to connect,
    /// checked by every later one (see [`NamespaceInUse`]).
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The writer lease of a [`Persistent`](super::Persistent) engine: the name of the engine
    /// that writes the namespace, expiring unless it renews it (see
    /// [`PersistConfig::engine_lease`](super::PersistConfig::engine_lease)).
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// The record of takes of [`engine`](Self::engine): `<count> <name>`, how many times the
    /// lease was taken while free and the engine that took it last. An engine takes a lapsed
    /// lease back only if it was that engine (nobody else may have written meanwhile).
    pub fn engine_takes(&self) -> &str {
        &self.takes
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// The prefix of processed-id markers ([`Dedup`](super::Dedup)): `{ns}:done:`.
    pub fn marker_prefix(&self) -> String {
        format!("{{{}}}:done:", self.ns)
    }
}
