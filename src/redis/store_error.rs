//! [`StoreError`]: an error of Redis, or of another backend behind a
//! [`TaskStore`](super::TaskStore), as both roles report it.

use std::fmt;

/// An error of the store's backend (Redis, or another [`TaskStore`](crate::redis::TaskStore)).
#[derive(Debug)]
pub struct StoreError {
    source: Box<dyn std::error::Error + Send + Sync>,
    cursor_lost: bool,
}

impl StoreError {
    /// Wraps a backend's error.
    pub fn new(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
        StoreError {
            source: e.into(),
            cursor_lost: false,
        }
    }

    /// The error a [`TaskStore::rows`](crate::redis::TaskStore::rows) returns for a cursor it can no
    /// longer continue from (`why`: its server restarted or failed over, say): the caller
    /// starts the scan again from [`Cursor::start`](crate::redis::Cursor::start).
    pub fn cursor_lost(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
        StoreError {
            source: why.into(),
            cursor_lost: true,
        }
    }

    /// Whether this is a [`cursor_lost`](Self::cursor_lost) error.
    pub fn is_cursor_lost(&self) -> bool {
        self.cursor_lost
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.cursor_lost {
            write!(f, "store: scan cursor lost: {}", self.source)
        } else {
            write!(f, "store: {}", self.source)
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError::new(e)
    }
}
