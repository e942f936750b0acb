//! The task envelope of design note 000: what is stored for each pending task.

use std::borrow::Cow;
use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// The largest due time a score can hold exactly: 2^53 − 1 ms since the Unix epoch.
pub const MAX_DUE_MS: u64 = (1 << 53) - 1;

/// How deeply a payload's arrays and objects may nest (a payload that is an array of arrays
/// nests 2 deep; a scalar, 0). [`Envelope::decode`] reads JSON through serde_json, which stops
/// at 128 levels, and the envelope itself is one: a deeper payload would be stored and then
/// never read back, so it is refused when it is scheduled or enqueued.
pub const MAX_PAYLOAD_DEPTH: usize = 126;

/// One persisted task. Times are milliseconds since the Unix epoch (wall clock: they must mean
/// the same thing after a restart).
///
/// Stored as a JSON object. Another client writing envelopes (a producer in another language)
/// must give `id`, `topic`, `payload` (`null` is a value) and `due_at`; `attempt` may be left
/// out (0, a task not yet tried) and so may `created_at` (or `null`: the due time stands in).
/// Fields that are not the envelope's are ignored. [`encode`](Self::encode) always writes the
/// six others, `headers` only when there are any, and `due_at` last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "StoredEnvelope")]
pub struct Envelope {
    /// Stable, user-chosen id; scheduling an id again replaces the task.
    pub id: String,
    /// Which handler the task goes to. Usually a constant: a `&'static str` is held without a
    /// copy (a `String` works too).
    pub topic: Cow<'static, str>,
    /// The user's data.
    pub payload: serde_json::Value,
    /// Deliveries tried so far (0 when the stored envelope has none).
    pub attempt: u32,
    /// When the task was first scheduled. `Persistent::schedule` stamps it from the kernel's
    /// coarse real-time clock on Linux, which is about a kernel tick (1 to 10 ms) behind. A
    /// stored envelope without it reads as created at its `due_at`.
    pub created_at: u64,
    /// Headers carried from the producer to the handler, such as a W3C `traceparent` (with
    /// feature `otel`, the producer's trace context is put here, and the handler's span is its
    /// child). Usually empty, and then not stored.
    #[serde(default, skip_serializing_if = "Headers::is_empty")]
    pub headers: Headers,
    /// When it is due.
    pub due_at: u64,
}

/// An envelope's headers: names to values, in name order.
pub type Headers = std::collections::BTreeMap<String, String>;

/// An envelope as stored, read with the defaults of the fields another client may leave out:
/// `attempt` 0, `created_at` the due time.
#[derive(Deserialize)]
struct StoredEnvelope {
    id: String,
    topic: Cow<'static, str>,
    payload: serde_json::Value,
    #[serde(default)]
    attempt: u32,
    #[serde(default)]
    created_at: Option<u64>,
    #[serde(default, deserialize_with = "lenient_headers")]
    headers: Headers,
    due_at: u64,
}

/// Headers as another client may write them: `null` or a non-object reads as none, and a
/// value that is not a string is left out, so that such an envelope still decodes (before
/// headers existed, an unknown field was ignored, and a task must not be dead-lettered for
/// one).
fn lenient_headers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Headers, D::Error> {
    let value = serde_json::Value::deserialize(d)?;
    Ok(match value {
        serde_json::Value::Object(map) => map
            .into_iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(s) => Some((k, s)),
                _ => None,
            })
            .collect(),
        _ => Headers::new(),
    })
}

impl From<StoredEnvelope> for Envelope {
    fn from(e: StoredEnvelope) -> Envelope {
        Envelope {
            id: e.id,
            topic: e.topic,
            payload: e.payload,
            attempt: e.attempt,
            created_at: e.created_at.unwrap_or(e.due_at),
            headers: e.headers,
            due_at: e.due_at,
        }
    }
}

/// Why an [`Envelope`] was refused. Each variant says which limit was broken.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The payload's arrays and objects nest deeper than [`MAX_PAYLOAD_DEPTH`].
    TooDeep {
        /// The limit, [`MAX_PAYLOAD_DEPTH`].
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
            EnvelopeError::TooDeep { limit } => {
                write!(f, "payload nests deeper than {limit} levels")
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
        self.check_fields()?;
        let size = encoded_len(self).map_err(|e| EnvelopeError::Encode(e.to_string()))?;
        if size > limit {
            return Err(EnvelopeError::TooLarge { size, limit });
        }
        Ok(size)
    }

    /// Checks what [`check`](Self::check) checks, with the same answer, but skips the exact
    /// count when an upper bound of the encoded size is within `limit` (the usual case: the
    /// bound costs a walk over the payload's values, not a scan of every byte).
    pub(crate) fn fits(&self, limit: usize) -> Result<(), EnvelopeError> {
        self.check_fields()?;
        if self.size_bound() <= limit {
            return Ok(());
        }
        self.check(limit).map(drop)
    }

    /// The id is not empty, the due time fits a score, and the payload nests no deeper than
    /// decoding reads (checked first: the size bound and the encoder recurse into it).
    fn check_fields(&self) -> Result<(), EnvelopeError> {
        if self.id.is_empty() {
            return Err(EnvelopeError::EmptyId);
        }
        if self.due_at > MAX_DUE_MS {
            return Err(EnvelopeError::DueTooLate(self.due_at));
        }
        if nests_deeper(&self.payload, MAX_PAYLOAD_DEPTH) {
            return Err(EnvelopeError::TooDeep {
                limit: MAX_PAYLOAD_DEPTH,
            });
        }
        Ok(())
    }

    /// An upper bound of the encoded size: the encoding of an empty envelope (so the field
    /// names are counted by serde itself), plus every string byte at its longest escape, the
    /// envelope's integers at their longest and the payload's numbers exactly.
    fn size_bound(&self) -> usize {
        static EMPTY: OnceLock<usize> = OnceLock::new();
        let empty = *EMPTY.get_or_init(|| {
            let empty = Envelope {
                id: String::new(),
                topic: Cow::Borrowed(""),
                payload: serde_json::Value::Null,
                attempt: 0,
                created_at: 0,
                headers: Default::default(),
                due_at: 0,
            };
            // A fixed, encodable value: cannot fail; a generous guess if it ever did.
            encoded_len(&empty).unwrap_or(256)
        });
        [
            empty,
            string_bound(&self.id),
            string_bound(&self.topic),
            json_bound(&self.payload),
            3 * U64_MAX_DIGITS,
            // `"headers":{` and `}`, then `"name":"value",` for each.
            if self.headers.is_empty() { 0 } else { 13 },
            self.headers
                .iter()
                .map(|(k, v)| {
                    string_bound(k)
                        .saturating_add(string_bound(v))
                        .saturating_add(2)
                })
                .fold(0, usize::saturating_add),
        ]
        .into_iter()
        .fold(0, usize::saturating_add)
    }

    /// Decodes an envelope written by [`encode`](Self::encode), or by another client: see
    /// [`Envelope`] for the fields it must have.
    pub fn decode(bytes: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The longest encoding of one byte of a string (`\u001f`).
const ESCAPED_MAX: usize = 6;

/// The digits of `u64::MAX`, the longest an envelope's integers can be.
const U64_MAX_DIGITS: usize = 20;

/// An upper bound of the length of `s` encoded as a JSON string (saturating, like every bound
/// here: a bound past `usize::MAX` is over any limit anyway).
fn string_bound(s: &str) -> usize {
    ESCAPED_MAX.saturating_mul(s.len()).saturating_add(2)
}

/// An upper bound of the length of `value` encoded by serde_json. Numbers are counted exactly
/// (a few bytes each): with serde_json's `arbitrary_precision` feature, which any crate in the
/// build can turn on, a number keeps its original text, of any length.
fn json_bound(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    let sum = |a: usize, b: usize| a.saturating_add(b);
    match value {
        Value::Null | Value::Bool(_) => 5,
        Value::Number(n) => {
            // Writing a number cannot fail; a generous guess if it ever did.
            encoded_len(n).unwrap_or(64)
        }
        Value::String(s) => string_bound(s),
        // Brackets, and a comma after each item (one too many: a bound).
        Value::Array(items) => items
            .iter()
            .map(|v| json_bound(v).saturating_add(1))
            .fold(2, sum),
        Value::Object(fields) => fields
            .iter()
            .map(|(k, v)| {
                string_bound(k)
                    .saturating_add(json_bound(v))
                    .saturating_add(2)
            })
            .fold(2, sum),
    }
}

/// Whether `value`'s arrays and objects nest more than `limit` deep. A walk with a stack of
/// at most `limit` iterators, not a recursion: a payload built in memory can nest deep enough
/// to overflow the thread's stack, and is refused here before anything recurses into it.
fn nests_deeper(value: &serde_json::Value, limit: usize) -> bool {
    use serde_json::Value;
    enum Children<'a> {
        Items(std::slice::Iter<'a, Value>),
        Fields(serde_json::map::Values<'a>),
    }
    fn children(value: &Value) -> Option<Children<'_>> {
        match value {
            Value::Array(items) => Some(Children::Items(items.iter())),
            Value::Object(fields) => Some(Children::Fields(fields.values())),
            _ => None,
        }
    }
    let Some(top) = children(value) else {
        return false; // a scalar nests 0 deep
    };
    if limit == 0 {
        return true;
    }
    let mut open = vec![top];
    while let Some(next) = open.last_mut() {
        let child = match next {
            Children::Items(items) => items.next(),
            Children::Fields(fields) => fields.next(),
        };
        match child {
            None => {
                open.pop();
            }
            Some(child) => {
                if let Some(inner) = children(child) {
                    if open.len() == limit {
                        return true;
                    }
                    open.push(inner);
                }
            }
        }
    }
    false
}

/// The length of `value` encoded as JSON, counted without building the bytes.
fn encoded_len(value: &impl Serialize) -> Result<usize, serde_json::Error> {
    let mut counter = Counter(0);
    serde_json::to_writer(&mut counter, value)?;
    Ok(counter.0)
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

#[cfg(test)]
mod tests {

    /// Another client's `headers` that is `null`, not an object, or holds a non-string value
    /// does not make the envelope undecodable.
    #[test]
    fn headers_of_another_shape_read_as_none_or_are_left_out() {
        let with = |h: &str| {
            format!(r#"{{"id":"a","topic":"t","payload":null,"headers":{h},"due_at":5}}"#)
        };
        for h in ["null", "[1,2]", "7", r#""x""#] {
            let e = Envelope::decode(with(h).as_bytes()).unwrap();
            assert!(e.headers.is_empty(), "{h}");
        }
        let e = Envelope::decode(with(r#"{"a":"1","b":2,"c":null}"#).as_bytes()).unwrap();
        assert_eq!(e.headers.len(), 1);
        assert_eq!(e.headers["a"], "1");
    }
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from), // NaN and infinities become null
            prop_oneof![
                Just(f64::MIN),
                Just(-f64::MIN_POSITIVE),
                Just(-1.234_567_890_123_456_7e-300)
            ]
            .prop_map(Value::from),
            ".*".prop_map(Value::String),
            "[\\x00-\\x1f\"\\\\]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((".{0,6}", inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// The bound never undercounts, so `fits` refuses exactly what `check` refuses.
        #[test]
        fn the_bound_is_never_below_the_encoding(
            id in "[^\\n]{1,12}|[\\x00-\\x1f\\x7f]{1,3}",
            topic in ".{0,12}",
            payload in json(),
            attempt: u32,
            created_at: u64,
            due_at in 0..=MAX_DUE_MS,
        ) {
            let e = Envelope { id, topic: topic.into(), payload, attempt, created_at, headers: Headers::new(), due_at };
            // The payload's own bound, without the envelope's slack.
            let payload = serde_json::to_vec(&e.payload).unwrap().len();
            prop_assert!(json_bound(&e.payload) >= payload);
            let size = e.check(usize::MAX).unwrap();
            prop_assert!(e.size_bound() >= size, "bound {} < size {}", e.size_bound(), size);
            for limit in [size.saturating_sub(1), size, e.size_bound()] {
                prop_assert_eq!(e.fits(limit).is_ok(), e.check(limit).is_ok());
                prop_assert_eq!(e.fits(limit).err(), e.check(limit).err());
            }
        }
    }

    /// An array nested `depth` deep, with `inner` innermost.
    fn nested(depth: usize, inner: Value) -> Value {
        (0..depth).fold(inner, |v, i| {
            if i % 2 == 0 {
                Value::Array(vec![Value::Null, v])
            } else {
                Value::Object([("k".to_owned(), v)].into_iter().collect())
            }
        })
    }

    #[test]
    fn nesting_is_counted_per_container_level() {
        assert!(!nests_deeper(&Value::Null, 0));
        assert!(nests_deeper(&Value::Array(vec![]), 0));
        for depth in 1..10 {
            let v = nested(depth, Value::from(1));
            assert!(!nests_deeper(&v, depth), "depth {depth}");
            assert!(nests_deeper(&v, depth - 1), "depth {depth}");
        }
        // The deep branch is not the first one.
        let v = Value::Array(vec![
            Value::Array(vec![]),
            nested(5, Value::Null),
            Value::Null,
        ]);
        assert!(!nests_deeper(&v, 6));
        assert!(nests_deeper(&v, 5));
    }

    /// The limit is exactly what decoding reads back: the deepest payload allowed round-trips,
    /// one level more is refused by every check, and its encoding (made by hand) does not
    /// decode. So nothing accepted is lost to decoding, and nothing decodable is refused.
    #[test]
    fn the_depth_limit_is_what_decode_reads() {
        let mut e = Envelope {
            id: "deep".into(),
            topic: "t".into(),
            payload: nested(MAX_PAYLOAD_DEPTH, Value::from("x")),
            attempt: 0,
            created_at: 0,
            headers: Default::default(),
            due_at: 0,
        };
        let bytes = e.encode(usize::MAX).unwrap();
        assert_eq!(Envelope::decode(&bytes).unwrap(), e);

        e.payload = nested(MAX_PAYLOAD_DEPTH + 1, Value::from("x"));
        let refused = Err(EnvelopeError::TooDeep {
            limit: MAX_PAYLOAD_DEPTH,
        });
        assert_eq!(e.encode(usize::MAX).map(drop), refused);
        assert_eq!(e.check(usize::MAX).map(drop), refused);
        assert_eq!(e.fits(usize::MAX), refused);
        let bytes = serde_json::to_vec(&e).unwrap();
        let err = Envelope::decode(&bytes).unwrap_err();
        assert!(err.to_string().contains("recursion limit"), "{err}");
    }

    /// A payload far too deep to encode or measure recursively is refused without recursing.
    #[test]
    fn a_payload_deeper_than_the_stack_is_refused_without_recursing() {
        let e = Envelope {
            id: "deep".into(),
            topic: "t".into(),
            payload: nested(200_000, Value::Null),
            attempt: 0,
            created_at: 0,
            headers: Default::default(),
            due_at: 0,
        };
        assert_eq!(
            e.fits(usize::MAX),
            Err(EnvelopeError::TooDeep {
                limit: MAX_PAYLOAD_DEPTH
            })
        );
        // Dropping a `Value` recurses too (serde_json's own drop): unwound by hand here.
        let mut v = e.payload;
        loop {
            v = match v {
                Value::Array(mut items) => items.pop().unwrap_or(Value::Null),
                Value::Object(mut fields) => fields.remove("k").unwrap_or(Value::Null),
                _ => break,
            };
        }
    }

    /// Another client may leave out `attempt` and `created_at` (or write `created_at` as
    /// `null`): 0 and the due time stand in. The other four are required.
    #[test]
    fn attempt_and_created_at_have_defaults_and_the_rest_is_required() {
        let decoded =
            Envelope::decode(br#"{"id":"a","topic":"t","payload":{"x":1},"due_at":7}"#).unwrap();
        assert_eq!(
            decoded,
            Envelope {
                id: "a".into(),
                topic: "t".into(),
                payload: serde_json::json!({"x": 1}),
                attempt: 0,
                created_at: 7,
                headers: Default::default(),
                due_at: 7,
            }
        );
        let null = br#"{"id":"a","topic":"t","payload":null,"created_at":null,"due_at":7}"#;
        assert_eq!(Envelope::decode(null).unwrap().created_at, 7);
        let given = br#"{"id":"a","topic":"t","payload":null,"attempt":2,"created_at":3,"due_at":7,"extra":1}"#;
        let given = Envelope::decode(given).unwrap();
        assert_eq!((given.attempt, given.created_at), (2, 3));
        // What `encode` writes reads back as it was.
        assert_eq!(
            Envelope::decode(&given.encode(usize::MAX).unwrap()).unwrap(),
            given
        );
        for field in ["id", "topic", "payload", "due_at"] {
            let mut v = serde_json::json!({"id": "a", "topic": "t", "payload": null, "due_at": 7});
            v.as_object_mut().unwrap().remove(field);
            let err = Envelope::decode(v.to_string().as_bytes()).unwrap_err();
            assert!(err.to_string().contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn fits_refuses_what_check_refuses() {
        let mut e = Envelope {
            id: String::new(),
            topic: "t".into(),
            payload: Value::Null,
            attempt: 0,
            created_at: 0,
            headers: Default::default(),
            due_at: 0,
        };
        assert_eq!(e.fits(1 << 20), Err(EnvelopeError::EmptyId));
        e.id = "a".into();
        e.due_at = MAX_DUE_MS + 1;
        assert_eq!(
            e.fits(1 << 20),
            Err(EnvelopeError::DueTooLate(MAX_DUE_MS + 1))
        );
        e.due_at = 0;
        let size = e.check(usize::MAX).unwrap();
        assert!(e.fits(size).is_ok());
        assert_eq!(
            e.fits(size - 1),
            Err(EnvelopeError::TooLarge {
                size,
                limit: size - 1
            })
        );
    }
}
