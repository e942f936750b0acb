//! The task envelope of design note 000: what is stored for each pending task.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The largest due time a score can hold exactly: 2^53 − 1 ms since the Unix epoch.
pub const MAX_DUE_MS: u64 = (1 << 53) - 1;

/// One persisted task. Times are milliseconds since the Unix epoch (wall clock: they must mean
/// the same thing after a restart).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Stable, user-chosen id; scheduling an id again replaces the task.
    pub id: String,
    /// Which handler the task goes to.
    pub topic: String,
    /// The user's data.
    pub payload: serde_json::Value,
    /// Deliveries tried so far.
    pub attempt: u32,
    /// When the task was first scheduled.
    pub created_at: u64,
    /// When it is due.
    pub due_at: u64,
}

/// Why an [`Envelope`] was refused. Each variant says which limit was broken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvelopeError {
    /// The id is empty.
    EmptyId,
    /// `due_at` is above [`MAX_DUE_MS`].
    DueTooLate(u64),
    /// The encoded envelope is larger than the configured limit.
    TooLarge {
        /// The encoded size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload could not be encoded as JSON.
    Encode(String),
}

impl fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EnvelopeError::EmptyId => f.write_str("task id is empty"),
            EnvelopeError::DueTooLate(ms) => write!(f, "due time {ms} ms is above 2^53 - 1"),
            EnvelopeError::TooLarge { size, limit } => {
                write!(
                    f,
                    "encoded task is {size} bytes, over the {limit}-byte limit"
                )
            }
            EnvelopeError::Encode(e) => write!(f, "payload does not encode: {e}"),
        }
    }
}

impl std::error::Error for EnvelopeError {}

impl Envelope {
    /// Checks the envelope and encodes it, refusing one larger than `limit` bytes.
    pub fn encode(&self, limit: usize) -> Result<Vec<u8>, EnvelopeError> {
        let size = self.check(limit)?;
        let mut bytes = Vec::with_capacity(size);
        serde_json::to_writer(&mut bytes, self)
            .map_err(|e| EnvelopeError::Encode(e.to_string()))?;
        Ok(bytes)
    }

    /// Checks what [`encode`](Self::encode) checks, without building the bytes (the encoded
    /// JSON is only counted), and returns the encoded size.
    pub fn check(&self, limit: usize) -> Result<usize, EnvelopeError> {
        if self.id.is_empty() {
            return Err(EnvelopeError::EmptyId);
        }
        if self.due_at > MAX_DUE_MS {
            return Err(EnvelopeError::DueTooLate(self.due_at));
        }
        let mut counter = Counter(0);
        serde_json::to_writer(&mut counter, self)
            .map_err(|e| EnvelopeError::Encode(e.to_string()))?;
        if counter.0 > limit {
            return Err(EnvelopeError::TooLarge {
                size: counter.0,
                limit,
            });
        }
        Ok(counter.0)
    }

    /// Decodes an envelope written by [`encode`](Self::encode).
    pub fn decode(bytes: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A writer that only counts the bytes written to it.
struct Counter(usize);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
