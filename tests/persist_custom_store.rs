//! The persistent engine on a store that is not Redis: an in-memory `TaskStore` written here,
//! as a PostgreSQL store would be. The engine code is the same; only the trait is implemented.
#![cfg(feature = "redis")]

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use delaywheel::redis::{
    now_ms, Broken, Envelope, Op, PersistConfig, Persistent, Row, Rows, StoreError, TaskStore,
};
use parking_lot::Mutex;

/// id → (due_at, encoded envelope).
type Table = BTreeMap<String, (u64, Vec<u8>)>;

/// `down` makes every call fail.
#[derive(Clone, Default)]
struct MemStore {
    table: Arc<Mutex<Table>>,
    down: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl MemStore {
    fn check(&self) -> Result<(), StoreError> {
        self.calls.fetch_add(1, SeqCst);
        if self.down.load(SeqCst) {
            return Err(StoreError::new("store is down"));
        }
        Ok(())
    }

    fn ids(&self) -> HashSet<String> {
        self.table.lock().keys().cloned().collect()
    }
}

impl TaskStore for MemStore {
    fn apply(&self, ops: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = self.check().map(|()| {
            let mut rows = self.table.lock();
            for op in ops {
                match op {
                    Op::Upsert {
                        id,
                        due_at,
                        envelope,
                    } => {
                        rows.insert(id.clone(), (*due_at, envelope.clone()));
                    }
                    Op::Remove(id) => {
                        rows.remove(id);
                    }
                }
            }
        });
        async move { result }
    }

    fn rows(
        &self,
        cursor: u64,
        count: usize,
    ) -> impl Future<Output = Result<Rows, StoreError>> + Send {
        let result = self.check().map(|()| {
            let stored = self.table.lock();
            let mut page = Rows::default();
            for (id, (due, raw)) in stored.iter().skip(cursor as usize).take(count) {
                page.rows.push(Row {
                    id: id.clone(),
                    due: due.to_string(),
                    envelope: Some(raw.clone()),
                });
            }
            let next = cursor as usize + page.rows.len();
            page.next = if next >= stored.len() { 0 } else { next as u64 };
            page
        });
        async move { result }
    }

    fn dead_letter(
        &self,
        broken: &[Broken],
        _now_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = self.check().map(|()| {
            assert!(broken.is_empty(), "this store never yields broken rows");
        });
        async move { result }
    }

    fn replace_all(&self, tasks: &[Op]) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = self.check().map(|()| {
            let mut rows = self.table.lock();
            rows.clear();
            for op in tasks {
                if let Op::Upsert {
                    id,
                    due_at,
                    envelope,
                } = op
                {
                    rows.insert(id.clone(), (*due_at, envelope.clone()));
                }
            }
        });
        async move { result }
    }
}

const PATIENCE: Duration = Duration::from_secs(30);

#[test]
fn the_engine_persists_and_restores_through_another_store() {
    let store = MemStore::default();
    let cfg = PersistConfig::new("unused://", "unused");
    let far = now_ms() + 3_600_000;
    {
        let (p, _fired) = Persistent::with_store(cfg.clone(), store.clone()).unwrap();
        for i in 0..1_000 {
            p.schedule(format!("t{i}"), "topic", serde_json::json!(i), far)
                .unwrap();
        }
        for i in 0..100 {
            assert!(p.cancel(&format!("t{i}")));
        }
        assert!(p.flush(PATIENCE));
        assert_eq!(store.ids().len(), 900);

        // While the store is down the journal holds the changes; they land when it is back.
        store.down.store(true, SeqCst);
        for i in 100..200 {
            assert!(p.cancel(&format!("t{i}")));
        }
        assert!(!p.flush(Duration::from_millis(200)));
        assert_eq!(store.ids().len(), 900);
        store.down.store(false, SeqCst);
        assert!(p.flush(PATIENCE));
        assert_eq!(store.ids().len(), 800);
        assert_eq!(p.snapshot(PATIENCE), Some(800));
        p.shutdown();
    }
    let expected: HashSet<String> = (200..1_000).map(|i| format!("t{i}")).collect();
    assert_eq!(store.ids(), expected);

    let (p, _fired) = Persistent::with_store(cfg, store.clone()).unwrap();
    let report = p.restore(64).unwrap();
    assert_eq!(report.loaded, 800);
    assert!(expected.iter().all(|id| p.contains(id)));
    assert!(!p.contains("t0"));
    assert!(store.calls.load(SeqCst) > 0);
}

/// Scheduling an id again replaces the task: the store ends with the last envelope, whether
/// the first was still in the journal, already written, or in the rounds the flusher keeps
/// retrying while the store is down.
#[test]
fn a_task_scheduled_again_is_stored_with_its_last_envelope() {
    let store = MemStore::default();
    let (p, _fired) =
        Persistent::with_store(PersistConfig::new("unused://", "unused"), store.clone()).unwrap();
    let far = now_ms() + 3_600_000;
    let stored = |id: &str| {
        let table = store.table.lock();
        let (due, bytes) = table.get(id).expect("stored");
        let envelope = Envelope::decode(bytes).unwrap();
        assert_eq!(envelope.due_at, *due);
        (envelope.payload, envelope.due_at)
    };
    // Both in one flush window.
    p.schedule("a", "t", serde_json::json!(1), far).unwrap();
    p.schedule("a", "t", serde_json::json!(2), far + 1).unwrap();
    // The first written, then replaced.
    p.schedule("b", "t", serde_json::json!(1), far).unwrap();
    assert!(p.flush(PATIENCE));
    assert_eq!(stored("b"), (serde_json::json!(1), far));
    p.schedule("b", "t", serde_json::json!(2), far + 1).unwrap();
    // The first is in the failing rounds when the second comes.
    store.down.store(true, SeqCst);
    p.schedule("c", "t", serde_json::json!(1), far).unwrap();
    assert!(!p.flush(Duration::from_millis(200)));
    p.schedule("c", "t", serde_json::json!(2), far + 1).unwrap();
    store.down.store(false, SeqCst);
    assert!(p.flush(PATIENCE));
    for id in ["a", "b", "c"] {
        assert_eq!(stored(id), (serde_json::json!(2), far + 1), "{id}");
    }
    assert_eq!(store.ids().len(), 3);
    p.shutdown();
}
