//! Trace context through an envelope's headers: the span a handler runs in, and, with feature
//! `otel`, the W3C `traceparent` of the span that scheduled the task, put into the headers by
//! the producer and made the parent of the handler's span by the consumer (through
//! `tracing-opentelemetry` and OpenTelemetry's global propagator, which the application sets,
//! e.g. to `TraceContextPropagator`).

use crate::redis::envelope::{Envelope, Headers};

/// The span a task's handler runs in: `delaywheel.task`, with its id, topic and attempt, and
/// the `traceparent` header it carries (empty if none). With feature `otel`, its parent is the
/// context the headers carry.
pub(crate) fn task_span(envelope: &Envelope) -> tracing::Span {
    let span = tracing::info_span!(
        "delaywheel.task",
        id = %envelope.id,
        topic = %envelope.topic,
        attempt = envelope.attempt,
        traceparent = tracing::field::Empty,
    );
    if let Some(parent) = envelope.headers.get("traceparent") {
        span.record("traceparent", parent.as_str());
    }
    #[cfg(feature = "otel")]
    otel::adopt(&span, &envelope.headers);
    span
}

/// Puts the current span's trace context into `headers` (feature `otel`; without it, nothing).
pub(crate) fn inject_current(headers: &mut Headers) {
    #[cfg(feature = "otel")]
    otel::inject_current(headers);
    #[cfg(not(feature = "otel"))]
    let _ = headers;
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::propagation::{Extractor, Injector};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::redis::envelope::Headers;

    struct Write<'a>(&'a mut Headers);

    impl Injector for Write<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key.to_owned(), value);
        }
    }

    struct Read<'a>(&'a Headers);

    impl Extractor for Read<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    pub(super) fn inject_current(headers: &mut Headers) {
        let span = tracing::Span::current();
        // No current span (or no subscriber): its context would be the empty one, which
        // injects nothing. Skipping the propagator (a global lock and a context built and
        // dropped) saves a sixteenth of a persistent schedule's time.
        if span.is_none() {
            return;
        }
        let context = span.context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&context, &mut Write(headers))
        });
    }

    pub(super) fn adopt(span: &tracing::Span, headers: &Headers) {
        if headers.is_empty() {
            return;
        }
        let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Read(headers)));
        let _ = span.set_parent(parent);
    }
}
