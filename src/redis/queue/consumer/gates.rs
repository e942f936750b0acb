//! The limiter's gates: rate limits and concurrency caps per topic, held across the fleet
//! (see [`TopicLimit`]). A task of a limited topic starts only with a permit ([`admit`]); one
//! that fires without one is parked in its gate, still in `held` (its lease renewed), and the
//! limiter loop ([`super::limiter`]) puts it back in the wheel once it has one.
//!
//! # Ground rules
//!
//! * A parked task is in `held` and in its gate's `parked`, not in the wheel. Whoever removes its
//!   `held` entry owns it, as for a task in the wheel: the limiter loop, when it gives the task a
//!   new timer, checks that the entry is still there under the same owner, and otherwise drops
//!   its copy (`shutdown` or the stall loop handed it back).
//! * Rate slots are booked in Redis before they are used, for the tasks about to be due, by the
//!   loop alone; a slot whose task went away is never given to another task (it is wasted,
//!   which only ever makes the fleet start fewer).
//! * Concurrency slots are leased in Redis like tasks: renewed every `lease / 3` by the loop,
//!   given back once idle or after their turn, and at shutdown.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::redis::queue::limit::{limit_keys, TopicLimit};
use crate::redis::wall_clock::now_ms;

use super::claimed::Claimed;

/// How late after its rate slot a task may still start on it, in ms (a start counts at its
/// slot, so this much is added to the bound of any window).
pub(super) const LATE_START_MS: u64 = 5;

/// The longest wait between two asks for concurrency slots while none is free.
pub(super) const MAX_SLOT_POLL: Duration = Duration::from_millis(100);

/// The gates of the limited topics, and the signal that wakes the loop.
pub(super) struct Limiter {
    pub(super) gates: HashMap<String, Arc<Gate>>,
    pub(super) wake: Arc<Notify>,
}

impl Limiter {
    /// Whether any topic has a concurrency cap.
    pub(super) fn has_caps(&self) -> bool {
        self.gates.values().any(|g| g.limit.concurrency.is_some())
    }

    pub(super) fn new(cfg: &crate::redis::QueueConfig) -> Limiter {
        let wake = Arc::new(Notify::new());
        let gates = cfg
            .limits
            .iter()
            .map(|(topic, limit)| {
                let (rate_key, running_key) = limit_keys(&cfg.namespace, topic);
                let gate = Gate {
                    limit: *limit,
                    rate_key,
                    running_key,
                    wake: wake.clone(),
                    st: Mutex::new(GateState::default()),
                };
                (topic.clone(), Arc::new(gate))
            })
            .collect();
        Limiter { gates, wake }
    }
}

/// One limited topic.
pub(super) struct Gate {
    pub(super) limit: TopicLimit,
    pub(super) rate_key: String,
    pub(super) running_key: String,
    pub(super) wake: Arc<Notify>,
    pub(super) st: Mutex<GateState>,
}

/// A task: its shard and id.
pub(super) type Key = (u32, String);

/// What a gate keeps, under its lock.
#[derive(Default)]
pub(super) struct GateState {
    /// Held tasks of the topic, not fired yet, with no rate slot booked: `(due, shard, id)`.
    pub(super) upcoming: BTreeSet<(u64, u32, String)>,
    /// Booked rate slots (ms, this process's wall clock), by task.
    pub(super) booked: HashMap<Key, u64>,
    /// Tasks that fired without a permit, oldest first.
    pub(super) parked: VecDeque<Claimed>,
    /// Concurrency slots held in Redis and idle.
    pub(super) free: Vec<Slot>,
    /// Every concurrency slot held in Redis (idle or lent to a running handler).
    pub(super) names: HashSet<String>,
    /// Slots to give back to Redis (idle too long, or at the end of their turn).
    pub(super) give_back: Vec<String>,
    /// Not before this, ask for rate slots for parked tasks (the next slot is further off
    /// than the horizon), or for concurrency slots (none was free).
    pub(super) rate_not_before: Option<Instant>,
    pub(super) slot_not_before: Option<Instant>,
    pub(super) slot_poll: Duration,
    pub(super) next_number: u64,
}

/// A concurrency slot held in Redis.
pub(super) struct Slot {
    pub(super) name: String,
    pub(super) taken: Instant,
    pub(super) idle_since: Instant,
}

/// A concurrency slot lent to one running handler; back to its gate when dropped.
pub(super) struct Permit {
    gate: Arc<Gate>,
    slot: Option<Slot>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(mut slot) = self.slot.take() else {
            return;
        };
        let mut st = self.gate.st.lock();
        if !st.names.contains(&slot.name) {
            return; // lost (its lease ran out): not ours to lend again
        }
        if slot.taken.elapsed() >= TopicLimit::SLOT_TURN && !st.parked.is_empty() {
            // Its turn is over while tasks wait: back to Redis, for any consumer to take.
            st.names.remove(&slot.name);
            st.give_back.push(slot.name);
            st.slot_not_before = Some(Instant::now() + MAX_SLOT_POLL);
        } else {
            slot.idle_since = Instant::now();
            st.free.push(slot);
        }
        let wake = !st.parked.is_empty() || !st.give_back.is_empty();
        drop(st);
        if wake {
            self.gate.wake.notify_one();
        }
    }
}

/// Whether the fired task `c` may start: `Some` with its concurrency slot (if its topic has a
/// cap) when it has every permit its topic needs, else `None`: it is parked for the loop.
pub(super) fn admit(limiter: &Limiter, c: Claimed) -> Option<(Claimed, Option<Permit>)> {
    let Some(gate) = limiter.gates.get(c.envelope.topic.as_ref()) else {
        return Some((c, None));
    };
    let key: Key = (c.shard, c.envelope.id.clone());
    let now = now_ms();
    let mut st = gate.st.lock();
    st.upcoming
        .remove(&(c.envelope.due_at, key.0, key.1.clone()));
    let slot_free = gate.limit.concurrency.is_none() || !st.free.is_empty();
    // A slot booked for now, or passed by at most `LATE_START` (its timer or a handler
    // thread came late). One passed by more is void: started now, it could bunch with the
    // starts of the slots after it past the limit; the task is booked again.
    if let Some(&slot) = st.booked.get(&key) {
        if slot + LATE_START_MS < now {
            st.booked.remove(&key);
        }
    }
    let rate_ok =
        gate.limit.rate.is_none() || st.booked.get(&key).is_some_and(|&slot| slot <= now + 1);
    if !(slot_free && rate_ok) {
        st.parked.push_back(c);
        drop(st);
        gate.wake.notify_one();
        return None;
    }
    st.booked.remove(&key);
    let slot = if gate.limit.concurrency.is_some() {
        st.free.pop()
    } else {
        None
    };
    drop(st);
    let permit = slot.map(|s| Permit {
        gate: gate.clone(),
        slot: Some(s),
    });
    Some((c, permit))
}

/// Notes a claimed task of a rate-limited topic, for the loop to book its slot before it is due.
/// One due within the booking lead wakes the loop at once: claimed just in time (after a
/// wake-up), it would otherwise fire before the next round booked it, and be parked.
pub(super) fn claimed(limiter: &Limiter, topic: &str, shard: u32, id: &str, due: u64) {
    if let Some(gate) = limiter.gates.get(topic) {
        if gate.limit.rate.is_some() {
            gate.st.lock().upcoming.insert((due, shard, id.to_owned()));
            if due <= now_ms() + gate.lead_ms() {
                gate.wake.notify_one();
            }
        }
    }
}

impl Gate {
    /// How far ahead of their due time the loop books rate slots, in ms: 0.8 of the burst
    /// tolerance (at least 20 ms), at most the horizon. A slot is `max(due, tat − tolerance)`: while the tasks
    /// booked ahead stay within the tolerance, another consumer's task due now still gets
    /// its due time; and rounds come every half tolerance, so a task is booked at least 0.3
    /// of it before it is due.
    pub(super) fn lead_ms(&self) -> u64 {
        // At least 20 ms: with a burst of 1 (a limit under 20 per period) the tolerance is
        // zero, and nothing would be booked before it is due. Booking ahead then moves the
        // slot of another consumer's task due sooner by up to this much.
        (self.limit.tolerance_ms() * 0.8)
            .max(20.0)
            .min(TopicLimit::HORIZON.as_millis() as f64) as u64
    }
}

/// The tasks parked in every gate, taken out (for `shutdown` to hand back).
pub(super) fn take_parked(limiter: &Limiter) -> Vec<Claimed> {
    limiter
        .gates
        .values()
        .flat_map(|g| std::mem::take(&mut g.st.lock().parked))
        .collect()
}
