//! The dead-letter store's records: [`DeadTask`], as [`Producer::dead_letters`] lists them,
//! and the record the consumer writes.
//!
//! [`Producer::dead_letters`]: crate::redis::Producer::dead_letters

use crate::redis::wall_clock::now_ms;

/// A dead-lettered task, as [`Producer::dead_letters`](crate::redis::Producer::dead_letters) lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadTask {
    /// The task id.
    pub id: String,
    /// Why it died: the last handler error, `unknown topic: ...`, `undecodable envelope`, ...
    pub reason: String,
    /// When, ms since the Unix epoch.
    pub at: u64,
    /// Deliveries tried.
    pub attempt: u32,
    /// The stored envelope as found (possibly not valid JSON).
    pub raw: String,
}

/// The dead-letter record written by the consumer: `{reason, raw, at, attempt}`.
pub(crate) fn dead_record(reason: &str, raw: &str, attempt: u32) -> String {
    serde_json::json!({ "reason": reason, "raw": raw, "at": now_ms(), "attempt": attempt })
        .to_string()
}

/// A record as stored, read back with the defaults of a record another client wrote.
pub(crate) fn parse_dead(id: String, record: &str) -> DeadTask {
    let v: serde_json::Value = serde_json::from_str(record).unwrap_or_default();
    DeadTask {
        id,
        reason: v["reason"]
            .as_str()
            .unwrap_or("unreadable record")
            .to_string(),
        at: v["at"].as_u64().unwrap_or(0),
        // Saturated: the reaper adds its count through Lua's doubles, past u32 for a
        // hand-made envelope.
        attempt: v["attempt"]
            .as_u64()
            .or_else(|| {
                v["attempt"]
                    .as_f64()
                    .filter(|a| *a >= 0.0)
                    .map(|a| a as u64)
            })
            .map_or(0, |a| u32::try_from(a).unwrap_or(u32::MAX)),
        raw: v["raw"].as_str().unwrap_or(record).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead-letter record's attempt count past `u32` (the reaper's Lua arithmetic on a
    /// hand-made envelope) saturates instead of wrapping to a small count.
    #[test]
    fn a_dead_records_attempt_count_saturates() {
        let attempt = |record: &str| parse_dead("x".into(), record).attempt;
        assert_eq!(attempt(r#"{"attempt":5}"#), 5);
        assert_eq!(attempt(r#"{"attempt":4294967300}"#), u32::MAX);
        assert_eq!(attempt(r#"{"attempt":4.2949673e+11}"#), u32::MAX);
        assert_eq!(attempt(r#"{"attempt":-3}"#), 0);
        assert_eq!(attempt("garbage"), 0);
    }
}
