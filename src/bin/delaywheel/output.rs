//! Tables for people and JSON for scripts.

use delaywheel::redis::{TaskInfo, TaskPage, TaskState};
use serde_json::json;

/// A task as JSON: id, state (with its owner and lease, or its reason), due time, attempts,
/// topic, payload; the raw stored text for an envelope that does not decode.
pub(crate) fn task_json(t: &TaskInfo) -> serde_json::Value {
    let mut v = json!({
        "id": t.id,
        "due_at_ms": t.due_at,
        "attempt": t.attempt,
        "topic": t.envelope.as_ref().map(|e| e.topic.to_string()),
        "payload": t.envelope.as_ref().map(|e| e.payload.clone()),
    });
    match &t.state {
        TaskState::Scheduled => v["state"] = json!("scheduled"),
        TaskState::Leased { owner, lease_until } => {
            v["state"] = json!("leased");
            v["owner"] = json!(owner);
            v["lease_until_ms"] = json!(lease_until);
        }
        TaskState::Dead { reason, at } => {
            v["state"] = json!("dead");
            v["reason"] = json!(reason);
            v["dead_at_ms"] = json!(at);
        }
        TaskState::Unqueued => v["state"] = json!("unqueued"),
        _ => v["state"] = json!("other"),
    }
    if !t.raw.is_empty() {
        v["raw"] = json!(t.raw);
    }
    v
}

/// `text` for a terminal: its control characters (an escape sequence in a task id or a
/// handler's error could rewrite the screen, the window's title or the clipboard) escaped as
/// Rust writes them (`\u{1b}`). `--json` escapes them as JSON does.
pub(crate) fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().collect()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

fn state_text(t: &TaskInfo) -> (String, String) {
    match &t.state {
        TaskState::Scheduled => ("scheduled".into(), String::new()),
        TaskState::Leased { owner, lease_until } => (
            "leased".into(),
            format!("{}, lease until {lease_until}", shown(owner)),
        ),
        TaskState::Dead { reason, .. } => ("dead".into(), shown(reason).into_owned()),
        TaskState::Unqueued => ("unqueued".into(), "envelope with no queue entry".into()),
        _ => ("other".into(), String::new()),
    }
}

pub(crate) fn print_task(t: &TaskInfo, json_out: bool) {
    if json_out {
        println!("{}", task_json(t));
        return;
    }
    let (state, detail) = state_text(t);
    println!("id       {}", shown(&t.id));
    println!("state    {state}");
    if !detail.is_empty() {
        println!("         {detail}");
    }
    println!(
        "due      {}",
        t.due_at.map_or("-".to_string(), |d| format!("{d} ms"))
    );
    println!("attempt  {}", t.attempt);
    match &t.envelope {
        Some(e) => {
            println!("topic    {}", shown(&e.topic));
            println!("payload  {}", e.payload);
        }
        None if !t.raw.is_empty() => println!("raw      {}", shown(&t.raw)),
        None => {}
    }
}

pub(crate) fn print_page(page: &TaskPage, json_out: bool) {
    let next = page.next.as_ref().map(ToString::to_string);
    if json_out {
        let tasks: Vec<_> = page.tasks.iter().map(task_json).collect();
        println!("{}", json!({ "tasks": tasks, "next": next }));
        return;
    }
    println!(
        "{:<24} {:<10} {:>15} {:>7}  {:<16} detail",
        "id", "state", "due ms", "attempt", "topic"
    );
    for t in &page.tasks {
        let (state, detail) = state_text(t);
        println!(
            "{:<24} {:<10} {:>15} {:>7}  {:<16} {detail}",
            shown(&t.id),
            state,
            t.due_at.map_or("-".to_string(), |d| d.to_string()),
            t.attempt,
            t.envelope.as_ref().map_or("-".into(), |e| shown(&e.topic)),
        );
    }
    match next {
        // A scheduled or leased cursor holds the last task's id as it is.
        Some(n) => println!("next: --cursor {}", shown(&n)),
        None => println!("(end)"),
    }
}
