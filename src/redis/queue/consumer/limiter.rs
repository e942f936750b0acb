//! The limiter loop: books rate slots ahead, takes and gives back concurrency slots, puts the
//! parked tasks that have their permits back in the wheel, and hands the surplus back (see
//! [`super::gates`] for the gates and their ground rules).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::redis::queue::limit::TopicLimit;
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;
use crate::Timer;

use super::gates::{Gate, Key, Slot, MAX_SLOT_POLL};
use super::shared::*;

const HORIZON: Duration = TopicLimit::HORIZON;
const SLOT_TURN: Duration = TopicLimit::SLOT_TURN;

/// How long an idle concurrency slot is kept for the next task of its topic before it is given
/// back.
const LINGER: Duration = Duration::from_millis(100);

/// Asks for rate slots per limiter call, at most.
const SLOTS_PER_CALL: usize = 1_000;

/// The limiter loop: books rate slots ahead for the tasks about to be due, takes and gives
/// back concurrency slots, puts parked tasks that have their permits back in the wheel, hands
/// the surplus of a topic's parked tasks back to the queue, and renews its concurrency slots.
/// At stop, it gives every concurrency slot back.
pub(super) async fn limiter_loop(
    shared: Arc<Shared>,
    timer: Timer<Claimed>,
    mut stop: watch::Receiver<bool>,
) {
    let gates: Vec<Arc<Gate>> = shared.limiter.gates.values().cloned().collect();
    // A round at least this often: half the smallest burst tolerance (see `Gate::lead_ms`),
    // between 5 and 50 ms.
    let round = gates
        .iter()
        .filter_map(|g| g.limit.rate.map(|_| g.limit.tolerance_ms() / 2.0))
        .fold(50.0f64, f64::min)
        .clamp(5.0, 50.0);
    let round = Duration::from_micros((round * 1e3) as u64);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(round) => {}
            _ = shared.limiter.wake.notified() => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        for gate in &gates {
            if gate.limit.rate.is_some() {
                book(&shared, &timer, gate).await;
            }
            if gate.limit.concurrency.is_some() {
                slots(&shared, gate).await;
            }
            dispatch(&shared, &timer, gate);
            surplus(&shared, gate);
        }
    }
    // Stopping: the idle concurrency slots go back, for the other consumers; those lent to
    // handlers still running go back once they end (`release_all`, from `shutdown`). Not
    // after `abort`, which stops as a crash would (the slots end with their lease).
    if shared.aborted.load(Relaxed) {
        return;
    }
    for gate in &gates {
        let names: Vec<String> = {
            let mut st = gate.st.lock();
            let idle: Vec<Slot> = std::mem::take(&mut st.free);
            for s in &idle {
                st.names.remove(&s.name);
            }
            let mut names = std::mem::take(&mut st.give_back);
            names.extend(idle.into_iter().map(|s| s.name));
            names
        };
        release(&shared, gate, names).await;
    }
}

/// Gives back every concurrency slot still held: `shutdown` calls it once the handlers have
/// ended (a slot lent to a handler still running must not go back while it runs).
pub(super) async fn release_all(shared: &Shared) {
    for gate in shared.limiter.gates.values() {
        let names: Vec<String> = {
            let mut st = gate.st.lock();
            st.free.clear();
            let mut names: Vec<String> = st.names.drain().collect();
            names.append(&mut st.give_back);
            names
        };
        release(shared, gate, names).await;
    }
}

/// Books rate slots: for the parked tasks with none (due now), and for the held tasks due
/// within the lead (see `Gate::lead_ms`). A slot later than its task's due time moves the
/// task's timer.
async fn book(shared: &Shared, timer: &Timer<Claimed>, gate: &Arc<Gate>) {
    let lead = gate.lead_ms();
    let now = now_ms();
    let asks = {
        // `held` first (the lock order): a task no longer held (handed back by the stall loop,
        // or claimed again) is not booked for.
        let held = shared.held.lock();
        let mut st = gate.st.lock();
        // Bookings whose task went away (handed back, cancelled) are dropped after a while.
        st.booked.retain(|_, slot| *slot + 60_000 > now);
        // While the limit binds (the last ask left tasks without a slot), nothing is asked
        // until half a horizon's worth of slots is free: the tasks about to be due would get
        // none either (the parked ones come first), and asking on every round or wake-up
        // would cost a call each.
        if st.rate_not_before.is_some_and(|t| Instant::now() < t) {
            return;
        }
        // With a cap too, only as many parked tasks as there are idle concurrency slots: a
        // slot booked for a task that then waits for a concurrency slot would pass unused.
        let room = if gate.limit.concurrency.is_some() {
            st.free.len()
        } else {
            SLOTS_PER_CALL
        };
        let mut asks: Vec<(Key, u64)> = st
            .parked
            .iter()
            .filter(|c| {
                held.get(&(c.shard, c.envelope.id.clone()))
                    .is_some_and(|(_, owner, _)| **owner == *c.owner)
            })
            .map(|c| (c.shard, c.envelope.id.clone()))
            .filter(|k| !st.booked.contains_key(k))
            .take(room.min(SLOTS_PER_CALL))
            .map(|k| (k, 0))
            .collect();
        while asks.len() < SLOTS_PER_CALL {
            match st.upcoming.first() {
                Some((due, _, _)) if *due <= now + lead => {
                    let Some((due, shard, id)) = st.upcoming.pop_first() else {
                        break;
                    };
                    let key = (shard, id);
                    if held.contains_key(&key) {
                        asks.push((key, due));
                    }
                }
                _ => break,
            }
        }
        drop(st);
        drop(held);
        asks
    };
    if asks.is_empty() {
        return;
    }
    let interval = gate.limit.interval_ms().unwrap_or(1.0);
    let mut inv = scripts::RATE_SLOTS.prepare_invoke();
    inv.key(&gate.rate_key)
        .arg(format!("{interval:.6}"))
        .arg(format!("{:.6}", gate.limit.tolerance_ms()))
        .arg(HORIZON.as_millis() as u64);
    for (_, due) in &asks {
        inv.arg(*due);
    }
    let sent = now_ms();
    let reply: Vec<u64> = match shared.conn.run(&inv).await {
        Ok(r) => r,
        Err(e) => {
            // The tasks fire at their due time, are parked, and are asked for again.
            tracing::debug!(error = %e, "booking rate slots failed");
            return;
        }
    };
    let [redis_now, next, slots @ ..] = reply.as_slice() else {
        return;
    };
    // Redis's clock to this process's: the reply's `now` was read about halfway through.
    let local_now = (sent + now_ms()) / 2;
    let to_local = |t: u64| (t + local_now).saturating_sub(*redis_now);
    let mut moves = Vec::new();
    {
        let mut st = gate.st.lock();
        for ((key, due), slot) in asks.iter().zip(slots) {
            let slot = to_local(*slot);
            st.booked.insert(key.clone(), slot);
            if *due != 0 && slot > *due {
                moves.push((key.clone(), slot));
            }
        }
        // Tasks left with no slot: ask again for the parked ones once half a horizon's
        // worth of slots is free (asking every round would cost a call per consumer per
        // round at a limit that binds).
        if slots.len() < asks.len() {
            let half = HORIZON.as_millis() as u64 / 2;
            let wait = to_local(*next).saturating_sub(now_ms() + half);
            st.rate_not_before = Some(Instant::now() + Duration::from_millis(wait));
        } else {
            st.rate_not_before = None;
        }
    }
    // Held tasks whose slot is after their due time wait for it in the wheel.
    for (key, slot) in moves {
        let mut held = shared.held.lock();
        let Some((tid, _, _)) = held.get_mut(&key) else {
            continue;
        };
        if let Some(c) = timer.cancel(*tid) {
            let delay = Duration::from_millis(slot.saturating_sub(now_ms()));
            match timer.schedule(c, delay) {
                Ok(t) => *tid = t,
                // Shutting down: the entry stays, and the lease brings the task back.
                Err(_) => return,
            }
        }
        // (Already fired: it is parked or starting, and finds its slot in `booked`.)
    }
}

/// Concurrency slots: gives back the idle ones and those whose turn ended, and takes as many
/// as the parked tasks need.
async fn slots(shared: &Shared, gate: &Arc<Gate>) {
    let cap = gate.limit.concurrency.unwrap_or(u32::MAX);
    let (give, want, first) = {
        let mut st = gate.st.lock();
        let now = Instant::now();
        // Idle for LINGER: back to Redis, also while tasks are parked (waiting for a rate
        // slot, say), so that a throttled consumer does not sit on slots others could use;
        // then not asked for again for a poll interval.
        let (keep, idle): (Vec<Slot>, Vec<Slot>) = std::mem::take(&mut st.free)
            .into_iter()
            .partition(|s| now.duration_since(s.idle_since) < LINGER);
        st.free = keep;
        if !idle.is_empty() && !st.parked.is_empty() {
            st.slot_not_before = Some(now + MAX_SLOT_POLL);
        }
        for s in idle {
            st.names.remove(&s.name);
            st.give_back.push(s.name);
        }
        let give = std::mem::take(&mut st.give_back);
        let need = st.parked.len().saturating_sub(st.free.len());
        let want = if need > 0 && st.slot_not_before.is_none_or(|t| now >= t) {
            need.min(cap as usize)
        } else {
            0
        };
        let first = st.next_number;
        st.next_number += want as u64;
        (give, want, first)
    };
    release(shared, gate, give).await;
    if want > 0 {
        let mut inv = scripts::SLOTS_TAKE.prepare_invoke();
        inv.key(&gate.running_key)
            .arg(cap)
            .arg(shared.cfg.lease.as_millis() as u64)
            .arg(shared.batch_name.as_str())
            .arg(want)
            .arg(first);
        match shared.conn.run::<Vec<String>>(&inv).await {
            Ok(reply) => {
                let got = reply.len().saturating_sub(1);
                let now = Instant::now();
                let mut st = gate.st.lock();
                for name in reply.into_iter().skip(1) {
                    st.names.insert(name.clone());
                    st.free.push(Slot {
                        name,
                        taken: now,
                        idle_since: now,
                    });
                }
                if got < want {
                    // Full: ask again after a backoff, 10 ms doubling up to MAX_SLOT_POLL.
                    st.slot_poll =
                        (st.slot_poll * 2).clamp(Duration::from_millis(10), MAX_SLOT_POLL);
                    st.slot_not_before = Some(now + st.slot_poll);
                } else {
                    st.slot_poll = Duration::ZERO;
                    st.slot_not_before = None;
                }
            }
            Err(e) => tracing::debug!(error = %e, "taking concurrency slots failed"),
        }
    }
}

/// Renews the leases of the concurrency slots this consumer holds. The resolver calls it every
/// `lease / 3`, until the last outcome is written: a handler still running during a shutdown
/// keeps its slot.
pub(super) async fn renew_slots(shared: Arc<Shared>) {
    for gate in shared.limiter.gates.values() {
        let names: Vec<String> = gate.st.lock().names.iter().cloned().collect();
        if names.is_empty() {
            continue;
        }
        let mut inv = scripts::SLOTS_RENEW.prepare_invoke();
        inv.key(&gate.running_key)
            .arg(shared.cfg.lease.as_millis() as u64);
        for n in &names {
            inv.arg(n.as_str());
        }
        match shared.conn.run::<Vec<String>>(&inv).await {
            Ok(lost) if !lost.is_empty() => {
                tracing::warn!(
                    slots = lost.len(),
                    "concurrency slots lost (their lease ran out): not lent again"
                );
                let mut st = gate.st.lock();
                for n in &lost {
                    st.names.remove(n);
                }
                st.free.retain(|s| !lost.contains(&s.name));
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "renewing concurrency slots failed"),
        }
    }
}

/// Gives concurrency slots back to Redis (best effort: a slot not given back ends with its
/// lease).
async fn release(shared: &Shared, gate: &Gate, names: Vec<String>) {
    if names.is_empty() {
        return;
    }
    let mut conn = shared.conn.conn.clone();
    shared.conn.count(1);
    let done: Result<u64, _> = redis::cmd("ZREM")
        .arg(&gate.running_key)
        .arg(&names)
        .query_async(&mut conn)
        .await;
    if let Err(e) = done {
        tracing::debug!(error = %e, "giving concurrency slots back failed; they end with their lease");
    }
}

/// Puts the parked tasks that now have their permits back in the wheel: at their rate slot,
/// or at once. (They take their concurrency slot when they fire; one that finds none taken
/// meanwhile is parked again.)
fn dispatch(shared: &Shared, timer: &Timer<Claimed>, gate: &Gate) {
    let go: Vec<(Claimed, u64)> = {
        let mut st = gate.st.lock();
        let mut free = if gate.limit.concurrency.is_some() {
            st.free.len()
        } else {
            usize::MAX
        };
        let mut go = Vec::new();
        let mut keep = VecDeque::new();
        while let Some(c) = st.parked.pop_front() {
            let key = (c.shard, c.envelope.id.clone());
            let slot = match gate.limit.rate {
                None => Some(0),
                Some(_) => st.booked.get(&key).copied(),
            };
            match slot {
                Some(at) if free > 0 => {
                    free -= 1;
                    go.push((c, at));
                }
                _ => keep.push_back(c),
            }
        }
        st.parked = keep;
        go
    };
    let mut held = shared.held.lock();
    for (c, at) in go {
        let key = (c.shard, c.envelope.id.clone());
        let Some((tid, owner, _)) = held.get_mut(&key) else {
            continue; // handed back meanwhile
        };
        if **owner != *c.owner {
            continue; // claimed again since: the newer claim has its own timer
        }
        let delay = Duration::from_millis(at.saturating_sub(now_ms()));
        match timer.schedule(c, delay) {
            Ok(t) => *tid = t,
            Err(_) => return, // shutting down: the lease brings it back
        }
    }
}

/// Once a topic has more than `max_waiting` tasks parked, hands the newest back to the queue
/// (down to three quarters of `max_waiting`), due when the limit would let them run, so that a
/// throttled topic does not fill `held`.
fn surplus(shared: &Arc<Shared>, gate: &Gate) {
    let over: Vec<Claimed> = {
        let mut st = gate.st.lock();
        let n = st.parked.len();
        if n <= gate.limit.max_waiting {
            return;
        }
        // Down to three quarters of it: handed back one by one as they park, the surplus
        // would cost a call (and a wake-up of every consumer) per task.
        let keep = (gate.limit.max_waiting * 3 / 4).max(1);
        st.parked.drain(keep..).collect()
    };
    // Due when the tasks kept would have run (their count at the rate), and at least a
    // second ahead: each hand-back costs a claim and a give-back, so a backlog that came back
    // sooner would cycle through this consumer many times before it runs. Without a rate,
    // after a slot's turn.
    let wait_ms = match gate.limit.interval_ms() {
        Some(interval) => ((interval * gate.limit.max_waiting as f64) as u64).max(1_000),
        None => SLOT_TURN.as_millis() as u64,
    };
    let due = now_ms().saturating_add(wait_ms);
    let mut back = Vec::new();
    {
        let mut held = shared.held.lock();
        let mut st = gate.st.lock();
        for c in over {
            let key = (c.shard, c.envelope.id.clone());
            st.booked.remove(&key);
            if held.get(&key).is_some_and(|(_, o, _)| **o == *c.owner) {
                held.remove(&key);
                back.push((c.shard, c.envelope.id, c.owner, due));
            }
        }
    }
    if back.is_empty() {
        return;
    }
    tracing::debug!(
        tasks = back.len(),
        "parked tasks past max_waiting handed back"
    );
    // Through the stall loop's list: handed back at its next check (within a second), tried
    // again until Redis has them, their leases renewed meanwhile, and by `shutdown` if it
    // comes first.
    shared.handing_back.lock().extend(back);
}
