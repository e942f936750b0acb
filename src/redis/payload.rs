//! Typed payloads through serde: what [`Persistent::schedule`] and [`Producer::enqueue`] take
//! ([`IntoPayload`]), and how a delivered task is read back as a type
//! ([`Envelope::payload_as`], [`PayloadError`]). The envelope stays JSON on the wire, so
//! clients in other languages read and write it as before.
//!
//! [`Persistent::schedule`]: crate::redis::Persistent::schedule
//! [`Producer::enqueue`]: crate::redis::Producer::enqueue

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::redis::envelope::{Envelope, EnvelopeError};

/// A task's payload as given to [`Persistent::schedule`](crate::redis::Persistent::schedule)
/// or [`Producer::enqueue`](crate::redis::Producer::enqueue): a reference to any
/// `Serialize` type (`&order`, `&"text"`, `&json!(..)`), or a `serde_json::Value` by value,
/// which is moved in as it is, without a copy.
///
/// A value that serde cannot turn into JSON (a map whose keys are not strings, a
/// `Serialize` impl that fails) makes the call fail with
/// [`EnvelopeError::Encode`](crate::redis::EnvelopeError::Encode), the envelope (with a
/// `null` payload) handed back; the value itself was only borrowed.
///
/// ```
/// use delaywheel::redis::IntoPayload;
///
/// #[derive(serde::Serialize)]
/// struct CloseOrder { order_id: u64 }
///
/// let value = (&CloseOrder { order_id: 42 }).into_payload().unwrap();
/// assert_eq!(value, serde_json::json!({ "order_id": 42 }));
/// ```
pub trait IntoPayload {
    /// The payload as the envelope holds it.
    fn into_payload(self) -> Result<serde_json::Value, serde_json::Error>;
}

impl IntoPayload for serde_json::Value {
    fn into_payload(self) -> Result<serde_json::Value, serde_json::Error> {
        Ok(self)
    }
}

impl<T: Serialize + ?Sized> IntoPayload for &T {
    fn into_payload(self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::to_value(self)
    }
}

/// A payload that does not decode as the type asked for: the serde error, the type's name,
/// and the payload as it was, for a dead letter or a log.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadError {
    /// The type asked for (`std::any::type_name`).
    pub type_name: &'static str,
    /// What serde said.
    pub error: String,
    /// The payload that did not decode.
    pub payload: serde_json::Value,
}

impl fmt::Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "payload does not decode as {}: {}",
            self.type_name, self.error
        )
    }
}

impl std::error::Error for PayloadError {}

/// A new task's envelope (attempt 0) with `payload` turned into JSON, for `schedule` and
/// `enqueue` alike. A payload serde cannot write is [`EnvelopeError::Encode`], with the
/// envelope (its payload `null`) to hand back.
pub(crate) fn new_task(
    id: String,
    topic: Cow<'static, str>,
    payload: impl IntoPayload,
    created_at: u64,
    due_at: u64,
) -> Result<Envelope, (EnvelopeError, Box<Envelope>)> {
    let (payload, encode_error) = match payload.into_payload() {
        Ok(v) => (v, None),
        Err(e) => (serde_json::Value::Null, Some(e)),
    };
    let mut envelope = Envelope {
        id,
        topic,
        payload,
        attempt: 0,
        created_at,
        headers: Default::default(),
        due_at,
    };
    // With feature `otel`, the trace context of the span scheduling it.
    crate::redis::trace_context::inject_current(&mut envelope.headers);
    match encode_error {
        None => Ok(envelope),
        Some(e) => Err((EnvelopeError::Encode(e.to_string()), Box::new(envelope))),
    }
}

impl Envelope {
    /// The payload decoded as `T`. A payload that does not decode is a [`PayloadError`]
    /// carrying a copy of it; the envelope is left as it is.
    ///
    /// ```
    /// use delaywheel::redis::Envelope;
    ///
    /// #[derive(Debug, PartialEq, serde::Deserialize)]
    /// struct CloseOrder { order_id: u64 }
    ///
    /// let task = Envelope {
    ///     id: "order:42".into(),
    ///     topic: "order.close".into(),
    ///     payload: serde_json::json!({ "order_id": 42 }),
    ///     attempt: 0,
    ///     created_at: 0,
    ///     headers: Default::default(),
    ///     due_at: 0,
    /// };
    /// assert_eq!(task.payload_as::<CloseOrder>().unwrap(), CloseOrder { order_id: 42 });
    /// let wrong = task.payload_as::<String>().unwrap_err();
    /// assert_eq!(wrong.payload, task.payload);
    /// ```
    pub fn payload_as<'a, T: Deserialize<'a>>(&'a self) -> Result<T, PayloadError> {
        T::deserialize(&self.payload).map_err(|e| PayloadError {
            type_name: std::any::type_name::<T>(),
            error: e.to_string(),
            payload: self.payload.clone(),
        })
    }
}
