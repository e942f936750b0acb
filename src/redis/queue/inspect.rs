//! Inspecting a queue: [`Producer::get`], [`Producer::list`] and [`Producer::latency`], with
//! the types they answer in. Every read is bounded (`ZRANGE` by rank, `HSCAN`, `HGET`; never
//! `KEYS` or an unbounded `HGETALL`), on one Redis and on a cluster alike.

use std::fmt;
use std::time::Duration;

use crate::redis::envelope::Envelope;
use crate::redis::queue::config::QueueError;
use crate::redis::queue::conn::sample_shard;
use crate::redis::queue::dead_letters::parse_dead;
use crate::redis::queue::producer::{HscanPage, Producer};
use crate::redis::queue::scripts;
use crate::redis::wall_clock::now_ms;

/// Where a task stands, as [`Producer::get`] and [`Producer::list`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TaskState {
    /// Queued, waiting to be claimed.
    Scheduled,
    /// Claimed by a consumer, which fires it from its wheel.
    Leased {
        /// The claim's owner, `consumer|token` (the consumer's id and its claim's fencing
        /// token).
        owner: String,
        /// When the lease runs out unless renewed, ms since the epoch on Redis's clock.
        lease_until: u64,
    },
    /// Dead-lettered.
    Dead {
        /// Why: the last handler error, `unknown topic: ...`, ...
        reason: String,
        /// When, ms since the epoch.
        at: u64,
    },
    /// An envelope with no queue entry: another client's task half written, or one left
    /// behind; the reaper's sweep removes it after `unpaired_grace`.
    Unqueued,
}

/// One task, as [`Producer::get`] and [`Producer::list`] read it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TaskInfo {
    /// The task id.
    pub id: String,
    /// Where it stands.
    pub state: TaskState,
    /// When it is (or was) due, ms since the epoch: the queue's score for a scheduled task,
    /// the envelope's otherwise; `None` if neither is readable.
    pub due_at: Option<u64>,
    /// Deliveries tried so far (a dead letter's count, else the envelope's).
    pub attempt: u32,
    /// The envelope (topic, payload, times); `None` if what is stored does not decode (then
    /// `raw` has it).
    pub envelope: Option<Envelope>,
    /// The envelope as stored (lossy UTF-8), for one that does not decode; empty otherwise.
    pub raw: String,
}

/// Which tasks [`Producer::list`] pages through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ListState {
    /// Queued tasks, in due order.
    Scheduled,
    /// Claimed tasks, in the order their leases run out (for a task claimed ahead of its due
    /// time, its due time plus the lease: due order).
    Leased,
    /// Dead letters, in no particular order (an `HSCAN` of each shard in turn).
    Dead,
}

/// Where a [`Producer::list`] goes on from. [`ListCursor::START`] starts a listing; a page's
/// `next` continues it. Its text form ([`Display`](fmt::Display), [`ListCursor::parse`]) is what a
/// command line passes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListCursor(Position);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Position {
    Start,
    /// After (score, id) in a ZSET's order.
    After(String, String),
    /// At `HSCAN` cursor `cursor` of shard `shard`, from entry `next` of that call's answer (a
    /// small hash is answered whole, whatever the `COUNT`), or past its first `skip` entries
    /// if `next` is gone: a dead letter removed between two pages (requeued) shifts those after
    /// it, and counting alone would step over one never listed.
    Scan {
        shard: u32,
        cursor: u64,
        skip: usize,
        next: Option<Vec<u8>>,
    },
}

impl ListCursor {
    /// The start of a listing.
    pub const START: ListCursor = ListCursor(Position::Start);

    /// A cursor from its text form; `None` for text no cursor prints.
    pub fn parse(text: &str) -> Option<ListCursor> {
        if text == "start" {
            return Some(ListCursor::START);
        }
        if let Some(rest) = text.strip_prefix("after:") {
            let (score, id) = rest.split_once(':')?;
            // A score as Redis reads one: a number or an infinity, not `NaN` (which Rust reads).
            score.parse::<f64>().ok().filter(|s| !s.is_nan())?;
            return Some(ListCursor(Position::After(
                score.to_string(),
                id.to_string(),
            )));
        }
        let mut parts = text.strip_prefix("scan:")?.split(':');
        let (shard, cursor, skip) = (
            parts.next()?.parse().ok()?,
            parts.next()?.parse().ok()?,
            parts.next()?.parse().ok()?,
        );
        // The id of the next entry, hex (any bytes, and nothing a shell splits; never empty).
        let next = match parts.next() {
            None => None,
            Some("") => return None,
            Some(text) => Some(hex::decode(text).ok()?),
        };
        let cursor = ListCursor(Position::Scan {
            shard,
            cursor,
            skip,
            next,
        });
        parts.next().is_none().then_some(cursor)
    }
}

impl fmt::Display for ListCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Position::Start => f.write_str("start"),
            Position::After(score, id) => write!(f, "after:{score}:{id}"),
            Position::Scan {
                shard,
                cursor,
                skip,
                next,
            } => {
                write!(f, "scan:{shard}:{cursor}:{skip}")?;
                match next {
                    Some(id) => write!(f, ":{}", hex::encode(id)),
                    None => Ok(()),
                }
            }
        }
    }
}

/// One page of a [`Producer::list`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TaskPage {
    /// The tasks, at most the `limit` asked for.
    pub tasks: Vec<TaskInfo>,
    /// Where the next page starts; `None` at the end.
    pub next: Option<ListCursor>,
}

/// One topic's outcome counts, summed over every consumer of the queue since the queue's
/// start, as [`Producer::topic_counts`] reads them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TopicCounts {
    /// The topic: one with a registered handler, or `unknown` for all others.
    pub topic: String,
    /// Handler runs that succeeded.
    pub processed: u64,
    /// Handler runs that failed.
    pub failed: u64,
    /// Failures put back with a backoff.
    pub retried: u64,
    /// Failures past `max_attempts`.
    pub dead_lettered: u64,
}

/// One shard's figures, as [`Producer::shard_stats`] reads them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ShardStats {
    /// The shard's index.
    pub shard: u32,
    /// Queued, claimed and dead-lettered tasks.
    pub queued: u64,
    /// Claimed tasks.
    pub leased: u64,
    /// Dead-lettered tasks.
    pub dead: u64,
    /// The age of its oldest due, unclaimed task (zero if none), by this host's wall clock.
    pub latency: Duration,
    /// Whether it is paused.
    pub paused: bool,
    /// Handlers of its tasks that succeeded, and that failed, since the queue started: as the
    /// consumers write them to the `stats` hash, every `reaper_interval` (a lower bound, as
    /// [`TopicCounts`]).
    pub processed: u64,
    /// See `processed`.
    pub failed: u64,
}

/// Bytes as a string, lossily; scores and ids another client wrote need not be UTF-8.
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A task's envelope, decoded if it decodes, else kept raw.
fn decode(stored: &[u8]) -> (Option<Envelope>, String) {
    match Envelope::decode(stored) {
        Ok(e) => (Some(e), String::new()),
        Err(_) => (None, text(stored)),
    }
}

fn score(bytes: &[u8]) -> Option<u64> {
    std::str::from_utf8(bytes)
        .ok()?
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| s as u64)
}

fn info(id: String, state: TaskState, due_score: Option<u64>, stored: &[u8]) -> TaskInfo {
    let (envelope, raw) = if stored.is_empty() {
        (None, String::new())
    } else {
        decode(stored)
    };
    TaskInfo {
        due_at: due_score.or(envelope.as_ref().map(|e| e.due_at)),
        attempt: envelope.as_ref().map_or(0, |e| e.attempt),
        id,
        state,
        envelope,
        raw,
    }
}

impl Producer {
    /// Where task `id` stands: scheduled, leased (owner and lease deadline), dead (reason),
    /// or an envelope with no queue entry, with its envelope, due time and attempts. An id
    /// the queue does not know gives `Ok(None)`. One script call on the id's shard, which
    /// reads a consistent snapshot and changes nothing.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), delaywheel::redis::QueueError> {
    /// use std::time::Duration;
    /// use delaywheel::redis::{Producer, QueueConfig, TaskState};
    ///
    /// # let url = std::env::var("DELAYWHEEL_TEST_REDIS").expect("set DELAYWHEEL_TEST_REDIS to a Redis URL (`make test` starts a private one)");
    /// let producer = Producer::connect(QueueConfig::new(&url, "doc-get")).await?;
    /// # producer.cancel("order:7").await?;
    /// producer.enqueue("order:7", "order.close", serde_json::Value::Null, Duration::from_secs(60)).await?;
    /// let task = producer.get("order:7").await?.expect("queued");
    /// assert_eq!(task.state, TaskState::Scheduled);
    /// assert_eq!(task.envelope.unwrap().topic, "order.close");
    /// assert!(producer.get("no such task").await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn get(&self, id: &str) -> Result<Option<TaskInfo>, QueueError> {
        let keys = self.keys(id);
        let mut inv = scripts::INSPECT.prepare_invoke();
        inv.key(keys.due())
            .key(keys.tasks())
            .key(keys.lease())
            .key(keys.owner())
            .key(keys.dead())
            .arg(id);
        let got: Vec<Vec<u8>> = self.conn.run(&inv).await?;
        let [due, lease, owner, stored, dead] = <[Vec<u8>; 5]>::try_from(got)
            .map_err(|_| QueueError::Config("inspect.lua answered the wrong number of values"))?;
        let id = id.to_string();
        if !due.is_empty() {
            return Ok(Some(info(id, TaskState::Scheduled, score(&due), &stored)));
        }
        if !lease.is_empty() {
            let state = TaskState::Leased {
                owner: text(&owner),
                lease_until: score(&lease).unwrap_or(0),
            };
            return Ok(Some(info(id, state, None, &stored)));
        }
        if !dead.is_empty() {
            let d = parse_dead(id.clone(), &text(&dead));
            let mut task = info(
                id,
                TaskState::Dead {
                    reason: d.reason,
                    at: d.at,
                },
                None,
                d.raw.as_bytes(),
            );
            task.attempt = d.attempt;
            return Ok(Some(task));
        }
        if !stored.is_empty() {
            return Ok(Some(info(id, TaskState::Unqueued, None, &stored)));
        }
        Ok(None)
    }

    /// One page of up to `limit` tasks in `state`, from `cursor` ([`ListCursor::START`], or a
    /// page's `next`), over every shard: scheduled tasks in due order and leased ones in lease
    /// order, merged across shards; dead letters shard by shard (a page that ends inside one
    /// `HSCAN` answer asks for it again, and steps over what it listed). A page reads at most `limit`
    /// tasks per shard (a shard that does not hold the cursor's task finds where to go on by
    /// a binary search among the tasks due in its millisecond). Tasks that move while a listing goes on
    /// may be listed twice or not at all, as with any `SCAN` (a leased task whose lease is
    /// renewed moves ahead of the cursor, and may come again).
    ///
    /// Errors: Redis failed; [`QueueError::Config`] for a `limit` of 0 or a cursor of another
    /// state's listing.
    pub async fn list(
        &self,
        state: ListState,
        cursor: &ListCursor,
        limit: usize,
    ) -> Result<TaskPage, QueueError> {
        if limit == 0 {
            return Err(QueueError::Config("a listing's limit must be at least 1"));
        }
        match state {
            ListState::Dead => self.list_dead(cursor, limit).await,
            ListState::Scheduled | ListState::Leased => {
                self.list_ordered(state == ListState::Leased, cursor, limit)
                    .await
            }
        }
    }

    async fn list_ordered(
        &self,
        leased: bool,
        cursor: &ListCursor,
        limit: usize,
    ) -> Result<TaskPage, QueueError> {
        let (score_arg, id_arg) = match &cursor.0 {
            Position::Start => (String::new(), String::new()),
            Position::After(score, id) => (score.clone(), id.clone()),
            Position::Scan { .. } => {
                return Err(QueueError::Config(
                    "a dead-letter cursor lists dead letters",
                ))
            }
        };
        // (score, id bytes, task)
        let mut merged: Vec<(f64, Vec<u8>, TaskInfo)> = Vec::new();
        let mut more = false;
        for keys in self.shards.iter() {
            let mut inv = scripts::INSPECT_PAGE.prepare_invoke();
            inv.key(if leased { keys.lease() } else { keys.due() })
                .key(keys.tasks())
                .key(keys.owner())
                .arg(&score_arg)
                .arg(&id_arg)
                .arg(limit);
            let reply: Vec<Vec<u8>> = self.conn.run(&inv).await?;
            let Some((flag, rest)) = reply.split_first() else {
                continue;
            };
            more |= flag.as_slice() == b"1";
            for t in rest.chunks_exact(4) {
                let s = std::str::from_utf8(&t[1])
                    .ok()
                    .and_then(|s| s.parse::<f64>().ok())
                    .unwrap_or(f64::NAN);
                let state = if leased {
                    TaskState::Leased {
                        owner: text(&t[3]),
                        lease_until: score(&t[1]).unwrap_or(0),
                    }
                } else {
                    TaskState::Scheduled
                };
                let due = if leased { None } else { score(&t[1]) };
                merged.push((s, t[0].clone(), info(text(&t[0]), state, due, &t[2])));
            }
        }
        merged.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        more |= merged.len() > limit;
        merged.truncate(limit);
        let next = match merged.last() {
            Some((s, id, _)) if more => Some(ListCursor(Position::After(
                // The score as Redis prints it: an integer stays an integer.
                if s.fract() == 0.0 && s.abs() < 1e15 {
                    format!("{}", *s as i64)
                } else {
                    format!("{s}")
                },
                text(id),
            ))),
            _ => None,
        };
        Ok(TaskPage {
            tasks: merged.into_iter().map(|(_, _, t)| t).collect(),
            next,
        })
    }

    async fn list_dead(&self, cursor: &ListCursor, limit: usize) -> Result<TaskPage, QueueError> {
        let (mut shard, mut at, mut skip, mut next_id) = match &cursor.0 {
            Position::Start => (0u32, 0u64, 0usize, None),
            Position::Scan {
                shard,
                cursor,
                skip,
                next,
            } => (*shard, *cursor, *skip, next.clone()),
            Position::After(..) => {
                return Err(QueueError::Config(
                    "a scheduled or leased cursor lists those states",
                ))
            }
        };
        let mut tasks = Vec::new();
        while (shard as usize) < self.shards.len() && tasks.len() < limit {
            let keys = &self.shards[shard as usize];
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let (next, flat): HscanPage = redis::cmd("HSCAN")
                .arg(keys.dead())
                .arg(at)
                .arg("COUNT")
                .arg((limit - tasks.len()).min(1_000))
                .query_async(&mut conn)
                .await?;
            // HSCAN may answer more than COUNT (a small hash whole): take what fits, and the
            // next page asks the same again and goes on from the first entry it did not take
            // (or, if that one is gone, past as many entries as this one took).
            let answered = flat.len();
            if let Some(id) = next_id.take() {
                if let Some(i) = flat.iter().position(|(k, _)| *k == id) {
                    skip = i;
                }
            }
            let room = limit - tasks.len();
            let took = answered.saturating_sub(skip).min(room);
            let following = flat.get(skip + took).map(|(k, _)| k.clone());
            for (id, record) in flat.into_iter().skip(skip).take(took) {
                let d = parse_dead(text(&id), &text(&record));
                let mut task = info(
                    d.id.clone(),
                    TaskState::Dead {
                        reason: d.reason,
                        at: d.at,
                    },
                    None,
                    d.raw.as_bytes(),
                );
                task.attempt = d.attempt;
                tasks.push(task);
            }
            if skip + took < answered {
                skip += took;
                next_id = following;
                break;
            }
            skip = 0;
            if next == 0 {
                shard += 1;
                at = 0;
            } else {
                at = next;
            }
        }
        let next = ((shard as usize) < self.shards.len()).then_some(ListCursor(Position::Scan {
            shard,
            cursor: at,
            skip,
            next: next_id,
        }));
        Ok(TaskPage { tasks, next })
    }

    /// Every topic's outcome counts, summed over every consumer since the queue's start,
    /// sorted by topic. Each consumer adds its counts every `reaper_interval` (and at
    /// shutdown), so they lag by up to that. Read with `HSCAN` (the hash holds four fields per
    /// topic with a handler); an unreadable field is skipped.
    pub async fn topic_counts(&self) -> Result<Vec<TopicCounts>, QueueError> {
        let key = self.shards[0].stats();
        let mut by_topic: std::collections::BTreeMap<String, TopicCounts> = Default::default();
        let mut at = 0u64;
        loop {
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let (next, flat): HscanPage = redis::cmd("HSCAN")
                .arg(key)
                .arg(at)
                .arg("COUNT")
                .arg(1_000)
                .query_async(&mut conn)
                .await?;
            for (field, value) in flat {
                let field = text(&field);
                let Some((topic, what)) = field.rsplit_once('|') else {
                    continue;
                };
                let Some(n) = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                else {
                    continue;
                };
                let t = by_topic
                    .entry(topic.to_owned())
                    .or_insert_with(|| TopicCounts {
                        topic: topic.to_owned(),
                        ..TopicCounts::default()
                    });
                match what {
                    "processed" => t.processed = n,
                    "failed" => t.failed = n,
                    "retried" => t.retried = n,
                    "dead_lettered" => t.dead_lettered = n,
                    _ => {}
                }
            }
            if next == 0 {
                break;
            }
            at = next;
        }
        Ok(by_topic.into_values().collect())
    }

    /// Every shard's depths, latency, pause and outcome counts, in shard order: one pipeline
    /// of five reads per shard, and one `HMGET` of the counts.
    pub async fn shard_stats(&self) -> Result<Vec<ShardStats>, QueueError> {
        let mut out = Vec::with_capacity(self.shards.len());
        // The outcome counts of every shard: one HMGET of the stats hash.
        let mut conn = self.conn.conn.clone();
        self.conn.count(1);
        let mut get = redis::cmd("HMGET");
        get.arg(self.shards[0].stats());
        for i in 0..self.shards.len() {
            get.arg(format!("shard:{i}:processed"))
                .arg(format!("shard:{i}:failed"));
        }
        let counts: Vec<Option<String>> = get.query_async(&mut conn).await?;
        let count = |k: usize| {
            counts
                .get(k)
                .and_then(|v| v.as_deref()?.parse::<u64>().ok())
                .unwrap_or(0)
        };
        for (i, keys) in self.shards.iter().enumerate() {
            let (depth, oldest) = sample_shard(&self.conn, keys, true).await?;
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let paused: i64 = redis::cmd("EXISTS")
                .arg(keys.paused())
                .query_async(&mut conn)
                .await?;
            let now = now_ms();
            let late = oldest
                .filter(|s| s.is_finite() && *s >= 0.0 && (*s as u64) < now)
                .map_or(0, |s| now - s as u64);
            out.push(ShardStats {
                shard: i as u32,
                queued: depth.queued,
                leased: depth.leased,
                dead: depth.dead,
                latency: Duration::from_millis(late),
                paused: paused == 1,
                processed: count(2 * i),
                failed: count(2 * i + 1),
            });
        }
        Ok(out)
    }

    /// How late the queue runs: the age of the oldest task that is due and not claimed
    /// (`now` − its due time, by this host's wall clock), zero if none is. One `ZRANGE` of
    /// one entry per shard.
    pub async fn latency(&self) -> Result<Duration, QueueError> {
        let now = now_ms();
        let mut oldest = now;
        for keys in self.shards.iter() {
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let first: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
                .arg(keys.due())
                .arg(0)
                .arg(0)
                .arg("WITHSCORES")
                .query_async(&mut conn)
                .await?;
            if let Some((_, s)) = first.first() {
                if s.is_finite() && *s >= 0.0 {
                    oldest = oldest.min(*s as u64);
                }
            }
        }
        Ok(Duration::from_millis(now - oldest))
    }
}
