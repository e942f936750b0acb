//! Headers through the queue, and (feature `otel`) trace context: the handler's span is a
//! child of the span that enqueued the task, across the producer, Redis and the consumer.
//! Spans are read back from OpenTelemetry's in-memory exporter. (One subscriber per binary.)
#![cfg(feature = "redis")]

#[path = "support/queue_kit.rs"]
mod queue_kit;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{now_ms, Consumer, Envelope, Handlers, Headers};
use parking_lot::Mutex;
use queue_kit::*;

#[test]
fn headers_travel_with_the_task_and_are_stored_only_when_there_are_any() {
    let Fixture { server, rt, cfg, p } = fixture("headers", |_| {});
    let seen: Arc<Mutex<Vec<(String, Headers)>>> = Arc::default();
    let record = seen.clone();
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new().on("job", move |t: &Envelope| {
            record.lock().push((t.id.clone(), t.headers.clone()));
            Ok(())
        }),
    )
    .unwrap();
    let mut headers = Headers::new();
    headers.insert("tenant".into(), "acme".into());
    headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    let due = now_ms() + 60_000;
    let with = Envelope {
        id: "with".into(),
        topic: "job".into(),
        payload: serde_json::Value::Null,
        attempt: 0,
        created_at: now_ms(),
        headers: headers.clone(),
        due_at: due,
    };
    assert!(rt.block_on(p.enqueue_envelope(with, false)).unwrap());
    enqueue_all(&rt, &p, "job", vec![("without".into(), due)]);
    // As stored: headers before `due_at` (the reaper's scripts edit the envelope's end), and
    // no `headers` key at all when there are none.
    let stored = |id: &str| match server.run(&["HGET", "{headers}:tasks", id]) {
        redis::Value::BulkString(b) => String::from_utf8(b).unwrap(),
        other => panic!("{other:?}"),
    };
    let with_text = stored("with");
    assert!(
        with_text.contains(r#""headers":{"tenant":"acme","traceparent":"#),
        "{with_text}"
    );
    assert!(
        with_text.ends_with(&format!(r#""due_at":{due}}}"#)),
        "{with_text}"
    );
    assert!(!stored("without").contains("headers"));
    assert_eq!(
        rt.block_on(p.get("with"))
            .unwrap()
            .unwrap()
            .envelope
            .unwrap()
            .headers,
        headers
    );
    // Delivered with them.
    let now = now_ms();
    for id in ["with", "without"] {
        rt.block_on(p.cancel(id)).unwrap();
    }
    let mut again = Envelope {
        id: "with".into(),
        topic: "job".into(),
        payload: serde_json::Value::Null,
        attempt: 0,
        created_at: now,
        headers: headers.clone(),
        due_at: now,
    };
    assert!(rt
        .block_on(p.enqueue_envelope(again.clone(), false))
        .unwrap());
    again.id = "plain".into();
    again.headers.clear();
    assert!(rt.block_on(p.enqueue_envelope(again, false)).unwrap());
    wait_until("both delivered", || seen.lock().len() == 2);
    let seen = seen.lock().clone();
    for (id, h) in seen {
        match id.as_str() {
            "with" => assert_eq!(h, headers),
            _ => assert!(h.is_empty(), "{id}: {h:?}"),
        }
    }
    c.shutdown(Duration::from_secs(5)).unwrap();
}

#[cfg(feature = "otel")]
#[test]
fn the_handlers_span_is_a_child_of_the_span_that_enqueued_its_task() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{InMemorySpanExporterBuilder, SdkTracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    let exporter = InMemorySpanExporterBuilder::new().build();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    let Fixture {
        server: _s,
        rt,
        cfg,
        p,
    } = fixture("traced", |_| {});
    let in_handler: Arc<Mutex<Option<String>>> = Arc::default();
    let record = in_handler.clone();
    let c = Consumer::start(
        cfg.clone(),
        Handlers::new().on("job", move |_t: &Envelope| {
            let cx = tracing::Span::current().context();
            *record.lock() = Some(cx.span().span_context().trace_id().to_string());
            Ok(())
        }),
    )
    .unwrap();
    let checkout = tracing::info_span!("checkout");
    let trace_id = checkout
        .context()
        .span()
        .span_context()
        .trace_id()
        .to_string();
    let span_id = checkout.context().span().span_context().span_id();
    rt.block_on(
        async {
            p.enqueue("order:1", "job", serde_json::Value::Null, Duration::ZERO)
                .await
                .unwrap()
        }
        .instrument(checkout.clone()),
    );
    drop(checkout);
    wait_until("the handler", || in_handler.lock().is_some());
    assert_eq!(
        in_handler.lock().as_deref(),
        Some(trace_id.as_str()),
        "another trace"
    );
    c.shutdown(Duration::from_secs(5)).unwrap();
    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().unwrap();
    // (The other test's tasks run under this subscriber too, in traces of their own.)
    let task = spans
        .iter()
        .find(|s| s.name == "delaywheel.task" && s.span_context.trace_id().to_string() == trace_id)
        .unwrap_or_else(|| {
            panic!(
                "no handler span in {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(task.span_context.trace_id().to_string(), trace_id);
    assert_eq!(
        task.parent_span_id, span_id,
        "not a child of the enqueueing span"
    );
}
