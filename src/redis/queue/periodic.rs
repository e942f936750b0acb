//! Periodic tasks (feature `periodic`): [`Periodic`] schedules, kept in Redis so that every
//! instance learns them, and the occurrences they are due at. [`Scheduler`](super::Scheduler)
//! enqueues the occurrences.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use serde::{Deserialize, Serialize};

use crate::redis::queue::config::QueueError;
use crate::redis::queue::producer::{HscanPage, Producer};

/// When a schedule's occurrences are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Every {
    /// Every `ms` milliseconds, at the multiples of it since the Unix epoch (so every
    /// instance computes the same occurrences without talking to the others).
    Interval {
        /// The period, ms.
        ms: u64,
    },
    /// A cron expression in a time zone: `sec min hour day-of-month month day-of-week [year]`,
    /// or the five fields without seconds (then at second 0), read by the `cron` crate; the
    /// zone an IANA name (`Europe/Berlin`), so that "09:00 every day" stays 09:00 across
    /// daylight-saving changes.
    Cron {
        /// The expression.
        expr: String,
        /// The IANA time zone.
        tz: String,
    },
}

/// What a scheduler does with the occurrences that fell due while no scheduler ran (more
/// than a second ago).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
#[non_exhaustive]
pub enum CatchUp {
    /// Runs none of them: the next occurrence is the next one due.
    Skip,
    /// Runs the latest of them, once.
    Latest,
    /// Runs them all, the latest `max` of them at most.
    All {
        /// The most missed occurrences run.
        max: u32,
    },
}

/// A periodic task: `topic` with `payload`, enqueued at each occurrence of `every`, under the
/// id `periodic:<name>:<occurrence ms>`.
///
/// ```
/// use std::time::Duration;
/// use delaywheel::redis::{CatchUp, Periodic};
///
/// let report = Periodic::cron("daily-report", "0 0 9 * * *", "Europe/Berlin", "report", serde_json::Value::Null)
///     .unwrap()
///     .catch_up(CatchUp::Latest);
/// let ping = Periodic::interval("ping", Duration::from_secs(30), "ping", serde_json::Value::Null).unwrap();
/// // 2026-03-29 is the day Berlin moves to summer time: 09:00 is then 07:00 UTC, not 08:00.
/// let day = 1_774_742_400_000; // 2026-03-29T00:00:00Z
/// assert_eq!(report.occurrences(day - 86_400_000, day + 86_400_000), vec![day - 86_400_000 + 8 * 3_600_000, day + 7 * 3_600_000]);
/// assert_eq!(ping.occurrences(0, 60_000), vec![30_000, 60_000]);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Periodic {
    /// Its name, unique in the queue.
    pub name: String,
    /// When it runs.
    pub every: Every,
    /// The topic of its tasks.
    pub topic: String,
    /// The payload of each task.
    pub payload: serde_json::Value,
    /// What happens to occurrences missed while no scheduler ran.
    pub catch_up: CatchUp,
}

/// Why a [`Periodic`] was refused: the value asked for is handed back in the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeriodicError {
    /// The name is empty or holds a `:`.
    Name(String),
    /// The interval is below 1 ms or past a year.
    Interval(Duration),
    /// The cron expression does not parse: the expression and the parser's message.
    Cron(String, String),
    /// The time zone is not an IANA name.
    TimeZone(String),
}

impl fmt::Display for PeriodicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeriodicError::Name(n) => write!(f, "periodic name {n:?} is empty or holds a ':'"),
            PeriodicError::Interval(d) => {
                write!(f, "interval {d:?} is not between 1 ms and a year")
            }
            PeriodicError::Cron(e, why) => write!(f, "cron expression {e:?} does not parse: {why}"),
            PeriodicError::TimeZone(tz) => write!(f, "{tz:?} is not an IANA time zone"),
        }
    }
}

impl std::error::Error for PeriodicError {}

const YEAR_MS: u64 = 365 * 86_400_000;

/// The most occurrences [`Periodic::occurrences`] lists at once.
pub(crate) const OCCURRENCES_MAX: usize = 10_000;

/// How far before its start a cron listing begins, and past its end it reads: more than the
/// largest shift of a zone's clocks (2 h), so that a start the cron crate reads as the first
/// of two instants with one local time (it goes on from the second) still lists what follows
/// the listing's own start, and the repeated hour's instants, listed in turn, are all read.
const DST_SLACK_MS: u64 = 3 * 3_600_000;

/// The last instant a cron listing starts from: 9999-12-31T23:59:59.999Z. Near chrono's own
/// end (year 262 143) the cron crate's step past its start overflows, and panics.
const CRON_LAST_MS: u64 = 253_402_300_799_999;

/// Where a cron listing of (`after_ms`, `until_ms`] reads from and to, and whether that is
/// wider than the span: [`DST_SLACK_MS`] on each side when the zone's clocks may change near
/// it (their offset differs across the widened span, or the span is longer than an hour,
/// where two changes could cancel out), else the span itself (a scheduler's round: a second).
fn cron_span(zone: &chrono_tz::Tz, after_ms: u64, until_ms: u64) -> (u64, u64, bool) {
    use chrono::Offset;
    let (from, stop) = (
        after_ms.saturating_sub(DST_SLACK_MS),
        until_ms.saturating_add(DST_SLACK_MS),
    );
    let offset = |ms: u64| {
        Utc.timestamp_millis_opt(i64::try_from(ms).ok()?)
            .single()
            .map(|t| zone.offset_from_utc_datetime(&t.naive_utc()).fix())
    };
    let short = until_ms.saturating_sub(after_ms) <= 3_600_000;
    if short && offset(from).is_some() && offset(from) == offset(stop) {
        (after_ms, until_ms, false)
    } else {
        (from, stop, true)
    }
}

/// The instants (ms) of cron schedule `expr` in zone `tz` from where a listing of
/// (`after_ms`, `until_ms`] reads (see [`cron_span`]), with where it may stop and whether the
/// read is widened (its instants then not in time order near a clock change); `None` for a
/// schedule that no longer parses, or a listing from past [`CRON_LAST_MS`].
fn cron_times(
    expr: &str,
    tz: &str,
    after_ms: u64,
    until_ms: u64,
) -> Option<(impl Iterator<Item = u64>, u64, bool)> {
    let (schedule, zone) = parse_cron(expr, tz).ok()?;
    if after_ms > CRON_LAST_MS {
        return None;
    }
    let (from, stop, slack) = cron_span(&zone, after_ms, until_ms);
    let start = Utc.timestamp_millis_opt(from as i64).single()?;
    let times = schedule
        .after_owned(start.with_timezone(&zone))
        .map(|t| t.timestamp_millis().max(0) as u64);
    Some((times, stop, slack))
}

fn check_name(name: &str) -> Result<(), PeriodicError> {
    if name.is_empty() || name.contains(':') {
        return Err(PeriodicError::Name(name.to_owned()));
    }
    Ok(())
}

/// A cron expression (five fields get a leading second 0) and its zone, parsed.
fn parse_cron(expr: &str, tz: &str) -> Result<(cron::Schedule, chrono_tz::Tz), PeriodicError> {
    let fields = expr.split_whitespace().count();
    let full = if fields == 5 {
        format!("0 {expr}")
    } else {
        expr.to_owned()
    };
    let schedule = cron::Schedule::from_str(&full)
        .map_err(|e| PeriodicError::Cron(expr.to_owned(), e.to_string()))?;
    let zone = chrono_tz::Tz::from_str(tz).map_err(|_| PeriodicError::TimeZone(tz.to_owned()))?;
    Ok((schedule, zone))
}

impl Periodic {
    /// Every `period`, at its multiples since the epoch, with [`CatchUp::Skip`]. Errors hand
    /// the bad value back: an empty name or one holding `:`, a period below 1 ms or past a year.
    pub fn interval(
        name: impl Into<String>,
        period: Duration,
        topic: impl Into<String>,
        payload: serde_json::Value,
    ) -> Result<Periodic, PeriodicError> {
        let name = name.into();
        check_name(&name)?;
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        if ms == 0 || ms > YEAR_MS || Duration::from_millis(ms) != period {
            return Err(PeriodicError::Interval(period));
        }
        Ok(Periodic {
            name,
            every: Every::Interval { ms },
            topic: topic.into(),
            payload,
            catch_up: CatchUp::Skip,
        })
    }

    /// At each time `expr` names in time zone `tz`, with [`CatchUp::Skip`]. Errors hand the bad
    /// value back: the name, an expression that does not parse, a zone that is not an IANA name.
    pub fn cron(
        name: impl Into<String>,
        expr: &str,
        tz: &str,
        topic: impl Into<String>,
        payload: serde_json::Value,
    ) -> Result<Periodic, PeriodicError> {
        let name = name.into();
        check_name(&name)?;
        parse_cron(expr, tz)?;
        Ok(Periodic {
            name,
            every: Every::Cron {
                expr: expr.to_owned(),
                tz: tz.to_owned(),
            },
            topic: topic.into(),
            payload,
            catch_up: CatchUp::Skip,
        })
    }

    /// The same schedule with catch-up policy `policy`.
    pub fn catch_up(mut self, policy: CatchUp) -> Periodic {
        self.catch_up = policy;
        self
    }

    /// Its occurrences after `after_ms` up to `until_ms` (ms since the epoch), in order, at
    /// most 10 000 (a schedule read back from Redis that no longer parses has none, nor one
    /// listed from past the year 9999). A cron time that a zone's clocks pass twice (falling
    /// back) occurs twice; one they skip (springing forward) does not occur.
    pub fn occurrences(&self, after_ms: u64, until_ms: u64) -> Vec<u64> {
        const MAX: usize = OCCURRENCES_MAX;
        match &self.every {
            Every::Interval { ms } => {
                let ms = (*ms).max(1);
                let first = (after_ms / ms).saturating_add(1).saturating_mul(ms);
                (0..MAX as u64)
                    .map(|k| first.saturating_add(k.saturating_mul(ms)))
                    .take_while(|t| *t <= until_ms)
                    .collect()
            }
            Every::Cron { expr, tz } => {
                // Read from well before `after_ms`: from the first of two instants with one
                // local time (clocks falling back), the cron crate goes on from the second and
                // would skip the hour repeated. Within that hour it lists each local time's two
                // instants in turn, so the listing is sorted here, and read a slack past
                // `until_ms` (and past the most it keeps) so that no earlier instant is left.
                let Some((times, stop, _)) = cron_times(expr, tz, after_ms, until_ms) else {
                    return Vec::new();
                };
                let mut times: Vec<u64> = times
                    .take_while(|t| *t <= stop)
                    .filter(|t| *t > after_ms && *t <= until_ms)
                    .take(2 * MAX)
                    .collect();
                times.sort_unstable();
                times.dedup();
                times.truncate(MAX);
                times
            }
        }
    }

    /// Its first occurrence after `after_ms`, if any (as [`occurrences`](Self::occurrences)
    /// would list it first, without listing the rest).
    pub(crate) fn next_after(&self, after_ms: u64) -> Option<u64> {
        match &self.every {
            Every::Interval { ms } => {
                let ms = (*ms).max(1);
                (after_ms / ms).checked_add(1)?.checked_mul(ms)
            }
            Every::Cron { expr, tz } => {
                let (mut times, _, slack) = cron_times(expr, tz, after_ms, after_ms)?;
                if !slack {
                    return times.find(|t| *t > after_ms);
                }
                // Near a clock change the crate's order is not time order for up to the
                // slack: the earliest after `after_ms` is known once one comes a slack later.
                let mut best: Option<u64> = None;
                for t in times.take(4 * OCCURRENCES_MAX) {
                    if best.is_some_and(|b| t > b.saturating_add(DST_SLACK_MS)) {
                        break;
                    }
                    if t > after_ms && best.is_none_or(|b| t < b) {
                        best = Some(t);
                    }
                }
                best
            }
        }
    }

    /// The id of its task at `occurrence`.
    pub fn task_id(&self, occurrence: u64) -> String {
        format!("periodic:{}:{occurrence}", self.name)
    }
}

impl Producer {
    /// Registers (or replaces) schedule `periodic` for every instance: kept in Redis, where
    /// each [`Scheduler`](crate::redis::Scheduler) of the queue reads it within a second.
    /// `Ok(true)` if a schedule of that name was replaced. Errors: Redis failed.
    pub async fn add_periodic(&self, periodic: &Periodic) -> Result<bool, QueueError> {
        let json = serde_json::to_string(periodic)
            .map_err(|_| QueueError::Config("a periodic schedule that does not serialize"))?;
        let mut conn = self.conn.conn.clone();
        self.conn.count(1);
        let added: i64 = redis::cmd("HSET")
            .arg(self.shards[0].periodic())
            .arg(&periodic.name)
            .arg(json)
            .query_async(&mut conn)
            .await?;
        Ok(added == 0)
    }

    /// Removes schedule `name`: no occurrence of it is enqueued after the schedulers have
    /// read the change (within a second); ones enqueued already still run. `Ok(false)` if
    /// there was none.
    pub async fn remove_periodic(&self, name: &str) -> Result<bool, QueueError> {
        let mut conn = self.conn.conn.clone();
        self.conn.count(2);
        let (removed, _): (i64, i64) = redis::pipe()
            .cmd("HDEL")
            .arg(self.shards[0].periodic())
            .arg(name)
            .cmd("HDEL")
            .arg(self.shards[0].periodic_last())
            .arg(name)
            .query_async(&mut conn)
            .await?;
        Ok(removed == 1)
    }

    /// Every registered schedule, by name. A definition that does not read back (another
    /// client's) is skipped, with a warning.
    pub async fn periodics(&self) -> Result<Vec<Periodic>, QueueError> {
        let key = self.shards[0].periodic();
        let mut out = Vec::new();
        let mut at = 0u64;
        loop {
            let mut conn = self.conn.conn.clone();
            self.conn.count(1);
            let (next, flat): HscanPage = redis::cmd("HSCAN")
                .arg(&key)
                .arg(at)
                .arg("COUNT")
                .arg(1_000)
                .query_async(&mut conn)
                .await?;
            for (name, json) in flat {
                match serde_json::from_slice::<Periodic>(&json) {
                    Ok(p) => out.push(p),
                    Err(e) => tracing::warn!(
                        name = %String::from_utf8_lossy(&name),
                        error = %e,
                        "a periodic schedule that does not read back is skipped"
                    ),
                }
            }
            if next == 0 {
                break;
            }
            at = next;
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc_ms(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> u64 {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, 0)
            .unwrap()
            .timestamp_millis() as u64
    }

    fn berlin(expr: &str) -> Periodic {
        Periodic::cron("p", expr, "Europe/Berlin", "t", serde_json::Value::Null).unwrap()
    }

    /// Berlin's clocks fall back at 01:00Z on 2026-10-25 (03:00 CEST is 02:00 CET): 02:00
    /// local comes twice, at 00:00Z and 01:00Z. Listed from the first, the second still comes.
    #[test]
    fn a_cron_time_the_clocks_pass_twice_occurs_twice() {
        let hourly = berlin("0 0 * * * *");
        let from = utc_ms(2026, 10, 25, 0, 0);
        let hour = 3_600_000;
        assert_eq!(
            hourly.occurrences(from, from + 3 * hour),
            [from + hour, from + 2 * hour, from + 3 * hour]
        );
        assert_eq!(
            hourly.occurrences(from - 2 * hour, from + hour),
            [from - hour, from, from + hour]
        );
    }

    /// The scheduler's rounds across the repeated hour: each lists from the last occurrence the
    /// round before enqueued, up to a second ahead. Every minute comes once, in order, the
    /// repeated hour's included.
    #[test]
    fn rounds_across_the_repeated_hour_list_every_minute_once() {
        let every_minute = berlin("0 * * * * *");
        let (start, end) = (utc_ms(2026, 10, 24, 23, 30), utc_ms(2026, 10, 25, 2, 30));
        let mut last = start;
        let mut listed = Vec::new();
        let mut now = start;
        while now < end {
            now += 30_000;
            let found = every_minute.occurrences(last, now + 1_000);
            if let Some(&l) = found.last() {
                last = l;
            }
            listed.extend(found);
        }
        let want: Vec<u64> = (1..=180).map(|m| start + m * 60_000).collect();
        assert_eq!(listed, want);
    }

    /// Springing forward (2026-03-29, 02:00 CET is 03:00 CEST): 02:30 local never comes that
    /// day, and the schedule goes on the next.
    #[test]
    fn a_cron_time_the_clocks_skip_does_not_occur() {
        let half_past_two = berlin("0 30 2 * * *");
        let from = utc_ms(2026, 3, 28, 12, 0);
        assert_eq!(
            half_past_two.occurrences(from, from + 2 * 86_400_000),
            [utc_ms(2026, 3, 30, 0, 30)]
        );
    }

    /// The next occurrence, as a listing would give it first: across the repeated hour too.
    #[test]
    fn the_next_occurrence_is_a_listings_first() {
        let hourly = berlin("0 0 * * * *");
        let hour = 3_600_000;
        for from in [
            utc_ms(2026, 10, 24, 22, 0),
            utc_ms(2026, 10, 25, 0, 0),
            utc_ms(2026, 10, 25, 0, 30),
            utc_ms(2026, 7, 1, 12, 0),
        ] {
            assert_eq!(
                hourly.next_after(from),
                hourly.occurrences(from, from + 2 * hour).first().copied(),
                "after {from}"
            );
        }
        assert_eq!(
            hourly.next_after(utc_ms(2026, 10, 25, 0, 0)),
            Some(utc_ms(2026, 10, 25, 1, 0))
        );
        let every =
            Periodic::interval("i", Duration::from_secs(5), "t", serde_json::Value::Null).unwrap();
        assert_eq!(every.next_after(12_000), Some(15_000));
        assert_eq!(every.next_after(u64::MAX - 1), None);
    }

    /// A listing from past the year 9999 (a corrupt `last` in Redis, say) is empty; it used to
    /// panic near chrono's end.
    #[test]
    fn a_listing_from_the_far_future_is_empty() {
        let hourly = berlin("0 0 * * * *");
        for after in [CRON_LAST_MS + 1, 8_210_266_876_799_000, u64::MAX - 1] {
            assert!(hourly.occurrences(after, u64::MAX).is_empty(), "{after}");
        }
    }
}
