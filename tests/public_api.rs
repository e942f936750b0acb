//! The public API, path by path (issue 23: moving the files of `src/` keeps every path).
//!
//! `tests/public_api.txt` lists every public item by the path where the generated docs show
//! it, as `.ci/public_items.py` extracts them from `cargo doc --all-features --no-deps` (the
//! list was taken before the moves). Each one is imported below by that exact path, one `use`
//! a line, and named again in a test, so this file stops compiling if a path stops resolving,
//! and `every_listed_path_is_imported_here` fails if the list and the imports drift apart.
//! To check the docs themselves after a change:
//!
//! ```text
//! cargo doc --all-features --no-deps
//! python3 .ci/public_items.py target/doc/delaywheel | diff tests/public_api.txt -
//! ```
//!
//! The items of the optional features are imported in modules gated like the crate gates them:
//! `sleep` and `ExpirationStream` under `futures`, `redis` under `redis`, `FiredStream` under
//! both.

use std::any::type_name;

use delaywheel::wheel;
use delaywheel::wheel::CapacityError;
use delaywheel::wheel::Drain;
use delaywheel::wheel::Expired;
use delaywheel::wheel::Iter;
use delaywheel::wheel::Layout;
use delaywheel::wheel::LayoutError;
use delaywheel::wheel::TimerKey;
use delaywheel::wheel::Wheel;
use delaywheel::BuildError;
use delaywheel::Expiration;
use delaywheel::Lateness;
use delaywheel::ManualClock;
use delaywheel::Pending;
use delaywheel::ScheduleError;
use delaywheel::Stats;
use delaywheel::Timer;
use delaywheel::TimerBuilder;
use delaywheel::TimerId;

/// Checks that `T` is the type named `item` (its path, less the generics, ends in `::item`),
/// whatever module defines it. Returns `T`'s name.
fn named<T: ?Sized>(item: &str) -> &'static str {
    let name = type_name::<T>();
    let path = name.split('<').next().unwrap_or(name);
    assert!(
        path.ends_with(&format!("::{item}")),
        "{item} resolved to {name}"
    );
    name
}

/// `named` for each type: its name as written, then the type with generic arguments if any.
macro_rules! types {
    ($($item:ident $(<$($arg:tt),*>)?),* $(,)?) => {
        [$(named::<$item $(<$($arg),*>)?>(stringify!($item))),*]
    };
}

#[test]
fn crate_root_items_resolve() {
    let names = types![
        BuildError,
        Expiration<()>,
        Lateness,
        ManualClock,
        Pending<()>,
        ScheduleError<()>,
        Stats,
        Timer<()>,
        TimerBuilder<()>,
        TimerId,
    ];
    assert_eq!(names.len(), 10);
}

#[test]
fn wheel_items_resolve() {
    let names = types![
        CapacityError<()>,
        Drain<'static, ()>,
        Expired<()>,
        Iter<'static, ()>,
        Layout,
        LayoutError,
        TimerKey,
        Wheel<()>,
    ];
    assert_eq!(names.len(), 8);
    // The module path and the item paths name the same items.
    assert_eq!(type_name::<wheel::Wheel<()>>(), type_name::<Wheel<()>>());
}

#[cfg(feature = "futures")]
mod futures_feature {
    use super::{named, type_name};

    use delaywheel::sleep;
    use delaywheel::sleep::EngineShutdown;
    use delaywheel::sleep::Sleep;
    use delaywheel::sleep::Sleeper;
    use delaywheel::sleep::Timeout;
    use delaywheel::sleep::TimeoutError;
    use delaywheel::sleep::Wakeup;
    use delaywheel::ExpirationStream;

    /// A future for `Timeout`'s parameter.
    type Ready = std::future::Ready<()>;

    #[test]
    fn futures_items_resolve() {
        let names = types![
            EngineShutdown,
            ExpirationStream<()>,
            Sleep,
            Sleeper,
            Timeout<Ready>,
            TimeoutError,
            Wakeup,
        ];
        assert_eq!(names.len(), 7);
        assert_eq!(type_name::<sleep::Sleeper>(), type_name::<Sleeper>());
    }
}

#[cfg(feature = "redis")]
mod redis_feature {
    use super::{named, type_name};

    use delaywheel::redis;
    use delaywheel::redis::now_ms;
    use delaywheel::redis::shard_of;
    use delaywheel::redis::Backoff;
    use delaywheel::redis::Begin;
    use delaywheel::redis::Broken;
    use delaywheel::redis::BrokenReason;
    use delaywheel::redis::Claim;
    use delaywheel::redis::Consumer;
    use delaywheel::redis::Cursor;
    use delaywheel::redis::DeadTask;
    use delaywheel::redis::Dedup;
    use delaywheel::redis::DedupError;
    use delaywheel::redis::Durability;
    use delaywheel::redis::Envelope;
    use delaywheel::redis::EnvelopeError;
    use delaywheel::redis::HandlerError;
    use delaywheel::redis::Handlers;
    use delaywheel::redis::Headers;
    use delaywheel::redis::IntoPayload;
    use delaywheel::redis::KeyLayout;
    use delaywheel::redis::Lease;
    use delaywheel::redis::ListCursor;
    use delaywheel::redis::ListState;
    use delaywheel::redis::NamespaceError;
    use delaywheel::redis::NamespaceInUse;
    use delaywheel::redis::Op;
    use delaywheel::redis::Overdue;
    use delaywheel::redis::Page;
    use delaywheel::redis::PayloadError;
    use delaywheel::redis::PersistConfig;
    use delaywheel::redis::PersistError;
    use delaywheel::redis::Persistent;
    use delaywheel::redis::Producer;
    use delaywheel::redis::QueueConfig;
    use delaywheel::redis::QueueDepth;
    use delaywheel::redis::QueueError;
    use delaywheel::redis::QueueStats;
    use delaywheel::redis::RedisStore;
    use delaywheel::redis::Rescheduled;
    use delaywheel::redis::RestoreReport;
    use delaywheel::redis::RetryPolicy;
    use delaywheel::redis::Row;
    use delaywheel::redis::Rows;
    use delaywheel::redis::ShardStats;
    use delaywheel::redis::StoreError;
    use delaywheel::redis::TaskInfo;
    use delaywheel::redis::TaskPage;
    use delaywheel::redis::TaskState;
    use delaywheel::redis::TaskStore;
    use delaywheel::redis::TopicCounts;
    use delaywheel::redis::TopicLimit;
    use delaywheel::redis::Unique;
    use delaywheel::redis::WallClock;
    use delaywheel::redis::When;
    use delaywheel::redis::WhenFull;
    use delaywheel::redis::MAX_DUE_MS;
    use delaywheel::redis::MAX_PAGE;
    use delaywheel::redis::MAX_PAYLOAD_DEPTH;
    use delaywheel::redis::MAX_UNIQUE_WINDOW;

    #[test]
    fn redis_types_resolve() {
        let names = types![
            Backoff,
            Begin,
            Broken,
            BrokenReason,
            Claim,
            Consumer,
            Cursor,
            DeadTask,
            Dedup,
            DedupError,
            Durability,
            Envelope,
            EnvelopeError,
            Handlers,
            KeyLayout,
            Lease,
            ListCursor,
            ListState,
            NamespaceError,
            NamespaceInUse,
            Op,
            Overdue,
            Page,
            PayloadError,
            PersistConfig,
            PersistError,
            Persistent,
            Producer,
            QueueConfig,
            QueueDepth,
            QueueError,
            QueueStats,
            RedisStore,
            Rescheduled,
            RestoreReport,
            RetryPolicy,
            Row,
            Rows,
            ShardStats,
            StoreError,
            TaskInfo,
            TaskPage,
            TaskState,
            TopicCounts,
            TopicLimit,
            Unique,
            WallClock,
            When,
            WhenFull,
        ];
        assert_eq!(names.len(), 49);
        assert_eq!(type_name::<redis::Envelope>(), type_name::<Envelope>());
        // An alias has no name of its own: the headers are a map of strings,
        assert_eq!(
            type_name::<Headers>(),
            type_name::<std::collections::BTreeMap<String, String>>()
        );
        // and the handlers' error the boxed error they return.
        assert_eq!(
            type_name::<HandlerError>(),
            type_name::<Box<dyn std::error::Error + Send + Sync>>()
        );
    }

    /// Compiles only while `TaskStore` is the trait `RedisStore` implements.
    fn task_store<S: TaskStore>() -> &'static str {
        type_name::<S>()
    }

    /// Compiles only while `IntoPayload` is the trait a `&impl Serialize` implements.
    fn payload<P: IntoPayload>(p: P) -> serde_json::Value {
        p.into_payload().unwrap()
    }

    #[test]
    fn redis_trait_functions_and_constants_resolve() {
        assert_eq!(task_store::<RedisStore>(), type_name::<RedisStore>());
        assert_eq!(payload(&42u8), serde_json::json!(42));
        let now: fn() -> u64 = now_ms;
        assert!(now() > 0);
        let shard: fn(&str, u32) -> u32 = shard_of;
        assert!(shard("order:42", 4) < 4);
        let constants: [(&str, u64); 4] = [
            ("MAX_DUE_MS", MAX_DUE_MS),
            ("MAX_PAGE", MAX_PAGE as u64),
            ("MAX_PAYLOAD_DEPTH", MAX_PAYLOAD_DEPTH as u64),
            ("MAX_UNIQUE_WINDOW", MAX_UNIQUE_WINDOW.as_secs()),
        ];
        for (name, value) in constants {
            assert!(value > 0, "{name} is {value}");
        }
    }
}

#[cfg(all(feature = "redis", feature = "futures"))]
mod redis_futures_feature {
    use super::named;

    use delaywheel::redis::FiredStream;

    #[test]
    fn redis_futures_items_resolve() {
        assert_eq!(types![FiredStream].len(), 1);
    }
}

#[cfg(all(feature = "hyper", feature = "tower"))]
mod http_features {
    use super::{named, type_name};

    use delaywheel::http;
    use delaywheel::http::HyperTimer;
    use delaywheel::http::ResponseFuture;
    use delaywheel::http::TimeoutLayer;
    use delaywheel::http::TimeoutService;

    type Ready = std::future::Ready<()>;

    #[test]
    fn http_items_resolve() {
        let names = types![
            HyperTimer,
            ResponseFuture<Ready>,
            TimeoutLayer,
            TimeoutService<()>,
        ];
        assert_eq!(names.len(), 4);
        assert_eq!(type_name::<http::HyperTimer>(), type_name::<HyperTimer>());
    }
}

#[cfg(feature = "postgres")]
mod postgres_feature {
    use super::{named, type_name};

    use delaywheel::postgres;
    use delaywheel::postgres::PgConfig;
    use delaywheel::postgres::PgError;
    use delaywheel::postgres::PgStore;

    #[test]
    fn postgres_items_resolve() {
        let names = types![PgConfig, PgError, PgStore];
        assert_eq!(names.len(), 3);
        assert_eq!(type_name::<postgres::PgStore>(), type_name::<PgStore>());
    }
}

#[cfg(feature = "periodic")]
mod periodic_feature {
    use super::named;

    use delaywheel::redis::CatchUp;
    use delaywheel::redis::Every;
    use delaywheel::redis::Periodic;
    use delaywheel::redis::PeriodicError;
    use delaywheel::redis::Scheduler;

    #[test]
    fn periodic_items_resolve() {
        let names = types![CatchUp, Every, Periodic, PeriodicError, Scheduler];
        assert_eq!(names.len(), 5);
    }
}

/// The paths `use`d in this file, one `use delaywheel::...;` a line.
fn imported_paths() -> Vec<&'static str> {
    include_str!("public_api.rs")
        .lines()
        .filter_map(|line| line.trim().strip_prefix("use "))
        .filter(|rest| rest.starts_with("delaywheel::"))
        .map(|rest| {
            let path = rest.strip_suffix(';').expect("one `use` a line");
            path.split(" as ").next().unwrap_or(path)
        })
        .collect()
}

#[test]
fn every_listed_path_is_imported_here() {
    let listed: Vec<&str> = include_str!("public_api.txt")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect();
    let imported = imported_paths();
    // 73 before the moves of issue 23: the list may grow, and no item may go.
    assert!(listed.len() >= 73, "only {} paths listed", listed.len());
    let mut unique = listed.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), listed.len(), "a path is listed twice");
    let missing: Vec<&&str> = listed.iter().filter(|p| !imported.contains(p)).collect();
    let extra: Vec<&&str> = imported.iter().filter(|p| !listed.contains(p)).collect();
    assert!(
        missing.is_empty(),
        "listed in public_api.txt, not imported: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "imported, not listed in public_api.txt: {extra:?}"
    );
    assert_eq!(imported.len(), listed.len(), "a path is imported twice");
}
