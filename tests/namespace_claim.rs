//! The checks a start makes of its namespace: a key of the wrong type is refused, naming the
//! key, and so is a namespace that holds the other role's keys though no `{ns}:kind` key says
//! so (a producer written in another language need not set it). A refused start claims
//! nothing.
#![cfg(feature = "redis")]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use delaywheel::redis::{
    Consumer, Handlers, PersistConfig, PersistError, Persistent, QueueConfig, QueueError,
};
use redis_server::RedisServer;

/// `Persistent::start` refuses a namespace one of whose keys has the wrong type, naming the
/// key; and one that holds a queue's keys though no `{ns}:kind` says so (a producer in another
/// language need not set it), instead of taking the queue's tasks. Neither refusal claims the
/// namespace.
#[test]
fn start_refuses_wrong_typed_keys_and_a_queues_keys() {
    let server = RedisServer::start_in_memory();
    server.int(&["HSET", "{odd}:due", "f", "v"]);
    match Persistent::start(PersistConfig::new(server.url(), "odd")) {
        Err(PersistError::InUse(e)) => {
            assert_eq!(e.key, "{odd}:due");
            assert!(e.to_string().contains("{odd}:due"), "{e}");
            assert!(e.by.contains("hash") && e.by.contains("zset"), "{}", e.by);
        }
        Err(e) => panic!("start got {e}"),
        Ok(_) => panic!("started on a due key that is a hash"),
    }
    assert_eq!(server.int(&["EXISTS", "{odd}:kind"]), 0);

    for key in ["lease", "owner", "fence"] {
        let ns = format!("q{key}");
        let full = format!("{{{ns}}}:{key}");
        match key {
            "lease" => server.int(&["ZADD", &full, "1", "x"]),
            "owner" => server.int(&["HSET", &full, "x", "c|1"]),
            _ => server.int(&["INCR", &full]),
        };
        match Persistent::start(PersistConfig::new(server.url(), ns.as_str())) {
            Err(PersistError::InUse(e)) => {
                assert_eq!((e.by.as_str(), e.key.as_str()), ("queue", full.as_str()))
            }
            Err(e) => panic!("start got {e}"),
            Ok(_) => panic!("started on a queue's namespace ({full})"),
        }
        assert_eq!(
            server.int(&["EXISTS", &format!("{{{ns}}}:kind")]),
            0,
            "the refused start claimed the namespace"
        );
    }
}

/// `Consumer::start` refuses a namespace one of whose keys has the wrong type, naming the key,
/// and one that holds a `Persistent` engine's writer lease (or its record of takes) with no
/// `{ns}:kind`: the consumer would take the engine's tasks and the engine would snapshot the
/// queue's away.
#[test]
fn consumer_start_refuses_wrong_typed_keys_and_a_persistent_engines_lease() {
    let server = RedisServer::start_in_memory();
    let start = |ns: &str| Consumer::start(QueueConfig::new(server.url(), ns), Handlers::new());
    for (key, set) in [
        ("dead", &["SET", "{c1}:dead", "x"][..]),
        ("lease", &["SET", "{c2}:lease", "x"][..]),
        ("fence", &["HSET", "{c3}:fence", "f", "v"][..]),
    ] {
        server.run(set);
        let full = set[1];
        match start(&full[1..3]) {
            Err(QueueError::InUse(e)) => {
                assert_eq!(e.key, full, "{key}");
                assert!(e.to_string().contains(full), "{e}");
            }
            Err(e) => panic!("start got {e}"),
            Ok(c) => {
                c.abort();
                panic!("started on a wrong-typed {full}");
            }
        }
    }
    for key in ["engine", "engine:takes"] {
        let ns = if key == "engine" { "p1" } else { "p2" };
        let full = format!("{{{ns}}}:{key}");
        let value = if key == "engine" {
            "host-1-ab"
        } else {
            "1 host-1-ab"
        };
        server.run(&["SET", &full, value]);
        match start(ns) {
            Err(QueueError::InUse(e)) => {
                assert_eq!(
                    (e.by.as_str(), e.key.as_str()),
                    ("persistent", full.as_str())
                )
            }
            Err(e) => panic!("start got {e}"),
            Ok(c) => {
                c.abort();
                panic!("started on a persistent engine's namespace ({full})");
            }
        }
        assert_eq!(
            server.int(&["EXISTS", &format!("{{{ns}}}:kind")]),
            0,
            "the refused start claimed the namespace"
        );
    }
    // A clean namespace still starts, and claims it.
    let c = start("clean").unwrap();
    assert_eq!(server.int(&["EXISTS", "{clean}:kind"]), 1);
    c.shutdown(Duration::from_secs(5)).unwrap();
}
