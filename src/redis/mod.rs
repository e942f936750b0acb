//! The Redis layer (feature `redis`): the task envelope, the key layout, and a store that keeps
//! pending tasks in a Redis ZSET + HASH.
//!
//! **Status**: this is the storage foundation of the persistence layer. The write-behind
//! flusher, `restore()` into a running engine, the durability modes and the shared delay queue
//! build on it and are not here yet.
//!
//! # Key layout
//!
//! Every key of a namespace shares the hash tag `{ns}`, so a namespace lives in one Redis
//! Cluster slot and multi-key transactions on it are allowed:
//!
//! | key | type | content |
//! |---|---|---|
//! | `{ns}:due` | ZSET | member = task id, score = due time in ms since the Unix epoch |
//! | `{ns}:tasks` | HASH | task id → the JSON [`Envelope`] |
//! | `{ns}:dead` | HASH | task id → JSON `{ "reason", "raw", "at" }` of an entry that could not be used |
//!
//! Scores are integers below 2^53, so a double holds them exactly.

mod envelope;
mod layout;
mod store;

pub use envelope::{Envelope, EnvelopeError, MAX_DUE_MS};
pub use layout::{KeyLayout, NamespaceError};
pub use store::{Broken, BrokenReason, Op, Page, RedisStore, StoreError};
