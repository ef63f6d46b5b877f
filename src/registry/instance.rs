//! This instance's registration: the Redis key scheme, the record its heartbeats write (status,
//! counters, rates, pipelines; see [`super::record`]), the relay of its remote commands, its
//! shutdown record, and the listing of every registry entry.
//!
//! Each instance keeps a hash `{prefix}:instances:{host}:{pid}` holding its record, with a 30 s
//! TTL renewed by heartbeats, reads remote-control commands from `{prefix}:commands:{host}:{pid}`, records
//! their outcomes in `{prefix}:ctl:history`, and on a graceful stop deletes its hash and appends
//! a record to the sorted set `{prefix}:shutdowns` (the newest [`SHUTDOWNS_MAX`] kept).

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;
use time::format_description::BorrowedFormatItem;
use time::macros::format_description;
use tracing::warn;

use super::commands::{Command, CtlCommand};
use super::config::{INSTANCE_TTL_S, RedisConfig, RegistryConfig};
use super::control::Rejected;
use super::guard::Guard;
use super::outcome::{CtlOutcome, Recorder};
use super::record::{
    Breaker, InstanceRecord, Listed, PipelineRecord, RECORD_FIELD, RECORD_FORMAT, StageCounts,
    Status, Unreadable,
};
use super::redis::{ConnectError, Redis};
use crate::metrics;

/// History entries kept.
const HISTORY_MAX: isize = 1000;
/// Shutdown records kept (the newest).
pub const SHUTDOWNS_MAX: isize = 1000;

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `2026-11-21 05:35:46Z` for a Unix time in seconds (UTC); the bare number of seconds for a
/// time past the year 9999.
pub fn utc(secs: u64) -> String {
    const FORMAT: &[BorrowedFormatItem<'_>] =
        format_description!("[year]-[month]-[day] [hour]:[minute]:[second]Z");
    i64::try_from(secs)
        .ok()
        .and_then(|s| OffsetDateTime::from_unix_timestamp(s).ok())
        .and_then(|t| t.format(FORMAT).ok())
        .unwrap_or_else(|| secs.to_string())
}

/// The Redis keys of one deployment.
#[derive(Debug, Clone)]
pub struct Keys {
    /// `REDIS_PREFIX`: the deployment's namespace, so several share one Redis.
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
        }
    }
    pub fn instance(&self, host: &str, pid: u32) -> String {
        format!("{}:instances:{host}:{pid}", self.prefix)
    }
    pub fn instances_pattern(&self) -> String {
        // The prefix is matched as written: Redis's glob characters in it are escaped, so a
        // prefix `rv_?` never lists (and `warren ctl` never addresses) deployment `rv_a`.
        let mut literal = String::with_capacity(self.prefix.len());
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^' | '-') {
                literal.push('\\');
            }
            literal.push(c);
        }
        format!("{literal}:instances:*")
    }
    pub fn commands(&self, host: &str, pid: u32) -> String {
        format!("{}:commands:{host}:{pid}", self.prefix)
    }
    pub fn history(&self) -> String {
        format!("{}:ctl:history", self.prefix)
    }
    pub fn shutdowns(&self) -> String {
        format!("{}:shutdowns", self.prefix)
    }
}

/// What this instance publishes about itself.
#[derive(Debug, Clone)]
pub struct Instance {
    /// With `pid`, names the instance's keys and addresses its commands.
    pub host: String,
    pub pid: u32,
    /// The roles it runs, for `warren status` and the shutdown record.
    pub roles: String,
    /// Unix seconds of its start, for the uptime.
    pub started_at: u64,
    /// A random id drawn at start: commands are signed for `host:pid/run`, so one captured for
    /// an earlier process with the same host and PID (PID 1 in every container) is refused.
    pub run: String,
    /// The pipelines it runs (none without the consumer and DLQ roles), for every tool.
    pub pipelines: Vec<PipelineRecord>,
    /// `SHUTDOWN_TIMEOUT_MS` as it started with: what `warren ctl reload` waits for beside its
    /// own bound.
    pub shutdown_timeout_ms: u64,
}

impl Instance {
    /// This process, running `roles` (as `warren status` shows them) and `pipelines` (none
    /// without the consumer and DLQ roles: the composition root decides), its graceful stop
    /// bounded by `shutdown_timeout_ms`, started now under a fresh run id.
    pub fn this(roles: String, pipelines: Vec<PipelineRecord>, shutdown_timeout_ms: u64) -> Self {
        Self {
            host: crate::hostname(),
            pid: std::process::id(),
            roles,
            started_at: now_s(),
            run: uuid::Uuid::new_v4().simple().to_string(),
            pipelines,
            shutdown_timeout_ms,
        }
    }

    /// `host:pid/run`: the target a command for this process is signed for.
    pub fn address(&self) -> String {
        format!("{}:{}/{}", self.host, self.pid, self.run)
    }
}

/// This instance's registration.
pub struct Registry {
    /// The link every heartbeat, command read and record goes through.
    redis: Redis,
    /// The deployment's key scheme.
    keys: Keys,
    /// What the hash publishes, and whom commands must be addressed to.
    instance: Instance,
    /// Which remote commands are applied (signatures, freshness, replays).
    guard: Guard,
    /// Whether CONTROL_SECRET is set (only signed commands applied, outcomes signed), as the
    /// record publishes it.
    signed: bool,
    /// How often the entry is renewed (`REGISTRY_HEARTBEAT_MS`), for whoever drives
    /// [`Registry::heartbeat`].
    heartbeat_every: Duration,
    /// The counters at each heartbeat of the last [`RATE_WINDOW`] (and the one just before it),
    /// oldest first: the rates are the deltas over that window, so they change at every
    /// heartbeat without the noise of one short interval.
    samples: std::collections::VecDeque<Sample>,
}

/// The span the published rates are averaged over.
pub const RATE_WINDOW: Duration = Duration::from_secs(5);

/// The instance's own counters at one moment.
#[derive(Debug, Clone)]
struct Sample {
    /// When it was taken, to divide the deltas by the time between samples.
    at: std::time::Instant,
    /// The process's messages received and inserted.
    received: u64,
    inserted: u64,
    /// Each stage's (received, inserted).
    stages: std::collections::BTreeMap<metrics::StageId, (u64, u64)>,
}

/// `(now - before) / seconds`, 0 when no time passed or a counter went back.
pub fn per_second(before: u64, now: u64, seconds: f64) -> f64 {
    if seconds <= 0.0 {
        return 0.0;
    }
    now.saturating_sub(before) as f64 / seconds
}

/// The live state an instance reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub status: Status,
    /// Processors per pipeline, as last set at start or by `scale`.
    pub processors: usize,
    /// Messages per second each pipeline takes, 0 = no limit.
    pub rate_limit_per_s: u32,
}

impl Registry {
    /// The registration of `instance` under `config` (not written before the first
    /// [`Registry::heartbeat`]).
    pub fn new(config: &RegistryConfig, instance: Instance) -> Self {
        let me = instance.address();
        Self {
            redis: Redis::new(&config.redis.url),
            keys: Keys::new(&config.redis.prefix),
            instance,
            guard: Guard::new(&config.control_secret, me),
            signed: config.secret().is_some(),
            heartbeat_every: config.heartbeat(),
            // The counters start at zero with the process.
            samples: [Sample {
                at: std::time::Instant::now(),
                received: 0,
                inserted: 0,
                stages: Default::default(),
            }]
            .into(),
        }
    }

    /// How often [`Registry::heartbeat`] should run: the configured period.
    pub fn heartbeat_every(&self) -> Duration {
        self.heartbeat_every
    }

    /// The received and inserted rates (msg/s) over the last [`RATE_WINDOW`] (or since start),
    /// from the deltas of this instance's own counters: the process's, then each stage's.
    #[allow(clippy::type_complexity)]
    fn rates(
        &mut self,
        received: u64,
        inserted: u64,
        stages: std::collections::BTreeMap<metrics::StageId, (u64, u64)>,
    ) -> (
        (f64, f64),
        std::collections::BTreeMap<metrics::StageId, (f64, f64)>,
    ) {
        let now = std::time::Instant::now();
        self.samples.push_back(Sample {
            at: now,
            received,
            inserted,
            stages: stages.clone(),
        });
        // Keep one sample at least RATE_WINDOW old, none older.
        while self.samples.len() > 2 && now.duration_since(self.samples[1].at) >= RATE_WINDOW {
            self.samples.pop_front();
        }
        let first = &self.samples[0];
        let secs = now.duration_since(first.at).as_secs_f64();
        let per_stage = stages
            .iter()
            .map(|(name, (r, i))| {
                let (r0, i0) = first.stages.get(name).copied().unwrap_or((0, 0));
                (
                    name.clone(),
                    (per_second(r0, *r, secs), per_second(i0, *i, secs)),
                )
            })
            .collect();
        (
            (
                per_second(first.received, received, secs),
                per_second(first.inserted, inserted, secs),
            ),
            per_stage,
        )
    }

    /// The pipelines the record publishes from now on (a reload changed them).
    pub fn set_pipelines(&mut self, pipelines: Vec<PipelineRecord>) {
        self.instance.pipelines = pipelines;
    }

    fn key(&self) -> String {
        self.keys.instance(&self.instance.host, self.instance.pid)
    }

    /// Writes the record, whole, with live counters, and renews its TTL.
    pub async fn heartbeat(&mut self, report: Report) {
        let record = self.record_now(report);
        let Ok(json) = serde_json::to_string(&record) else {
            return;
        };
        let key = self.key();
        let mut pipe = redis::pipe();
        // The whole hash is replaced, so no field of an older warren's stays beside the record.
        pipe.atomic()
            .del(&key)
            .ignore()
            .hset(&key, RECORD_FIELD, json)
            .ignore()
            .expire(&key, INSTANCE_TTL_S as i64)
            .ignore();
        let _: Option<()> = self.redis.pipe(&pipe).await;
    }

    /// This instance's record now: `report` and its counters, their rates over the window.
    fn record_now(&mut self, report: Report) -> InstanceRecord {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &metrics::STATS;
        let totals = metrics::totals();
        let (received, inserted) = (totals.received, totals.inserted);
        let stages = metrics::stages();
        let counts = stages
            .iter()
            .map(|(name, s)| {
                (
                    name.clone(),
                    (s.received.load(Relaxed), s.inserted.load(Relaxed)),
                )
            })
            .collect();
        let ((received_per_s, inserted_per_s), stage_rates) =
            self.rates(received, inserted, counts);
        let round = |x: f64| (x * 10.0).round() / 10.0;
        let counts = stages
            .iter()
            .map(|(name, s)| {
                let (r, i) = stage_rates.get(name).copied().unwrap_or((0.0, 0.0));
                let counts = StageCounts {
                    paused: s.paused.load(Relaxed),
                    received: s.received.load(Relaxed),
                    inserted: s.inserted.load(Relaxed),
                    retried: s.retried.load(Relaxed),
                    dead_lettered: s.dead_lettered.load(Relaxed),
                    received_per_s: round(r),
                    inserted_per_s: round(i),
                    concurrency: s.concurrency.load(Relaxed),
                    processors: s.processors.load(Relaxed),
                    rate_limit_per_s: s.rate_limit_per_s.load(Relaxed),
                };
                (name.to_string(), counts)
            })
            .collect();
        let breaker = if stats.breakers_open.load(Relaxed) != 0 {
            Breaker::Open
        } else {
            Breaker::Closed
        };
        let i = &self.instance;
        InstanceRecord {
            format: RECORD_FORMAT,
            host: i.host.clone(),
            pid: i.pid,
            run: i.run.clone(),
            roles: i.roles.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at: i.started_at,
            last_heartbeat: now_s(),
            status: match report.status {
                Status::Running if !crate::topology::gate::is_open() => Status::Waiting,
                status => status,
            },
            processors: report.processors,
            concurrency: stages
                .iter()
                .map(|(_, s)| s.concurrency.load(Relaxed))
                .sum(),
            rate_limit_per_s: report.rate_limit_per_s,
            shutdown_timeout_ms: Some(i.shutdown_timeout_ms),
            signed_commands: Some(self.signed),
            breaker,
            received,
            inserted,
            retried: totals.retried,
            dead_lettered: totals.dead_lettered,
            inflight: u64::try_from(stats.inflight.load(Relaxed)).unwrap_or(0),
            received_per_s: round(received_per_s),
            inserted_per_s: round(inserted_per_s),
            stages: counts,
            pipelines: i.pipelines.clone(),
        }
    }

    /// The next command addressed to this instance, if any, with what it asks if it may be
    /// applied (see [`Guard`]; refused or malformed, the error to record it failed with, logged
    /// here). One that is not a command at all is logged and dropped.
    pub async fn next_command(&mut self) -> Option<(CtlCommand, Result<Command, Rejected>)> {
        let key = self.keys.commands(&self.instance.host, self.instance.pid);
        // Bytes: a command that is not UTF-8 is a malformed command like any other, not a
        // failure of the link (read as a string, the client's conversion error was taken for
        // Redis being unreachable and the link redone; review of issue 35, F3).
        let raw: Option<Vec<u8>> = self
            .redis
            .query::<Option<Vec<u8>>>(redis::cmd("LPOP").arg(&key))
            .await
            .flatten();
        let raw = match String::from_utf8(raw?) {
            Ok(raw) => raw,
            Err(e) => {
                let raw = String::from_utf8_lossy(e.as_bytes());
                warn!(error = %e.utf8_error(), command = %crate::text::shown(&raw), "unreadable remote command ignored");
                return None;
            }
        };
        match serde_json::from_str::<CtlCommand>(&raw) {
            Ok(c) => {
                let verdict = self
                    .guard
                    .check(&c, now_s())
                    .map_err(Rejected::from)
                    .and_then(|()| Command::read(&c).map_err(Rejected::from));
                if let Err(error) = &verdict {
                    warn!(id = %crate::text::shown(&c.id), command = %crate::text::shown(&c.command),
                        by = %crate::text::shown(&c.by), %error, "remote command refused");
                }
                Some((c, verdict))
            }
            Err(e) => {
                warn!(error = %e, command = %crate::text::shown(&raw), "unreadable remote command ignored");
                None
            }
        }
    }

    /// Records what this instance did with `command`; `detail`, when given, is what it said
    /// (a reload's changes).
    pub async fn record(
        &mut self,
        command: &CtlCommand,
        result: &Result<(), impl std::fmt::Display>,
        detail: Option<String>,
    ) {
        let me = Recorder {
            host: &self.instance.host,
            pid: self.instance.pid,
            run: &self.instance.run,
        };
        let mut outcome = CtlOutcome::of(command, me, result, now_s());
        if detail.is_some() {
            outcome.detail = detail;
        }
        self.guard.sign(&mut outcome);
        self.push_history(&outcome).await;
    }

    /// Appends `outcome` to the history (the newest [`HISTORY_MAX`] kept).
    async fn push_history(&mut self, outcome: &CtlOutcome) {
        let Ok(json) = serde_json::to_string(outcome) else {
            return;
        };
        let key = self.keys.history();
        let mut pipe = redis::pipe();
        pipe.lpush(&key, json)
            .ignore()
            .ltrim(&key, 0, HISTORY_MAX - 1)
            .ignore();
        let _: Option<()> = self.redis.pipe(&pipe).await;
    }

    /// Records a balancing decision in the history `warren ctl history` lists: command
    /// `balance`, the pipeline, and `detail` (the change, its reason and inputs).
    pub async fn record_decision(&mut self, pipeline: &str, detail: String) {
        let me = Recorder {
            host: &self.instance.host,
            pid: self.instance.pid,
            run: &self.instance.run,
        };
        let id = uuid::Uuid::new_v4().to_string();
        let mut outcome = CtlOutcome::decision(me, id, pipeline, detail, now_s());
        self.guard.sign(&mut outcome);
        self.push_history(&outcome).await;
    }

    /// Graceful stop: deletes the hash and appends the shutdown record.
    pub async fn deregister(&mut self, reason: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &metrics::STATS;
        let totals = metrics::totals();
        let record = serde_json::json!({
            "host": self.instance.host,
            "pid": self.instance.pid,
            "roles": self.instance.roles,
            "reason": reason,
            "started_at": self.instance.started_at,
            "stopped_at": now_s(),
            "uptime_s": now_s().saturating_sub(self.instance.started_at),
            "received": totals.received,
            "inserted": totals.inserted,
            "retried": totals.retried,
            "dead_lettered": totals.dead_lettered,
            "parked": stats.parked.load(Relaxed),
        });
        let key = self.key();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .del(&key)
            .ignore()
            .zadd(self.keys.shutdowns(), record.to_string(), now_s())
            .ignore()
            .zremrangebyrank(self.keys.shutdowns(), 0, -(SHUTDOWNS_MAX + 1))
            .ignore();
        let _: Option<()> = self.redis.pipe(&pipe).await;
    }
}

/// Every entry of the deployment's registry (SCAN + HGETALL), by key: each one's record, or why
/// it cannot be read. `None` while Redis is away.
pub async fn instances(redis: &mut Redis, keys: &Keys) -> Option<Vec<Listed>> {
    let mut cursor: u64 = 0;
    // Keys and fields as bytes: one that is not UTF-8 is an entry that cannot be read, not a
    // Redis that cannot be reached (which would blind `status` and `ctl` to every instance).
    let mut names: Vec<Vec<u8>> = Vec::new();
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis
            .query(
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(keys.instances_pattern())
                    .arg("COUNT")
                    .arg(500),
            )
            .await?;
        names.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    names.sort();
    names.dedup();
    let mut out = Vec::with_capacity(names.len());
    for raw in names {
        let key = String::from_utf8_lossy(&raw).into_owned();
        // A key of another type under the pattern is an entry that cannot be read, not an
        // outage: its type is asked first.
        let kind: String = redis.query(redis::cmd("TYPE").arg(&raw)).await?;
        let record = match kind.as_str() {
            // Gone since the SCAN (its TTL ran out, or a graceful stop).
            "none" => continue,
            _ if std::str::from_utf8(&raw).is_err() => {
                Err(Unreadable::Garbage("a key that is not UTF-8".into()))
            }
            "hash" => {
                let fields: HashMap<Vec<u8>, Vec<u8>> =
                    redis.query(redis::cmd("HGETALL").arg(&raw)).await?;
                if fields.is_empty() {
                    continue;
                }
                let text: Option<HashMap<String, String>> = fields
                    .into_iter()
                    .map(|(k, v)| Some((String::from_utf8(k).ok()?, String::from_utf8(v).ok()?)))
                    .collect();
                match text {
                    Some(fields) => InstanceRecord::read(&fields),
                    None => Err(Unreadable::Garbage("a field that is not UTF-8".into())),
                }
            }
            other => Err(Unreadable::Garbage(format!("a Redis {other}, not a hash"))),
        };
        out.push(Listed { key, record });
    }
    Some(out)
}

/// The readable records of the live instances of the deployment `redis` names (none when no
/// instance is registered), or why Redis could not tell (asked once, without the warnings of a
/// long-lived link): a tool says which of the two it met.
pub async fn live(redis: &RedisConfig) -> Result<Vec<InstanceRecord>, ConnectError> {
    Redis::connect(&redis.url).await?;
    let keys = Keys::new(&redis.prefix);
    let listed = instances(&mut Redis::quiet(&redis.url), &keys)
        .await
        .ok_or_else(|| ConnectError::Unreachable {
            url: crate::config::redact_url(&redis.url),
            error: "it stopped answering while the instances were listed".into(),
        })?;
    Ok(listed.into_iter().filter_map(|l| l.record.ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times_are_formatted() {
        assert_eq!(utc(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc(1_795_239_346), "2026-11-21 05:35:46Z");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00Z");
        assert_eq!(utc(253_402_300_799), "9999-12-31 23:59:59Z");
        assert_eq!(utc(u64::MAX), u64::MAX.to_string());
    }

    #[test]
    fn keys_follow_the_documented_layout() {
        let k = Keys::new("warren");
        assert_eq!(k.instance("h", 7), "warren:instances:h:7");
        assert_eq!(k.instances_pattern(), "warren:instances:*");
        assert_eq!(
            Keys::new("rv_?[a]*").instances_pattern(),
            "rv_\\?\\[a\\]\\*:instances:*"
        );
        assert_eq!(k.commands("h", 7), "warren:commands:h:7");
        assert_eq!(k.history(), "warren:ctl:history");
        assert_eq!(k.shutdowns(), "warren:shutdowns");
    }

    #[test]
    fn rates_are_counter_deltas_over_the_elapsed_time() {
        assert_eq!(per_second(100, 600, 2.0), 250.0);
        assert_eq!(per_second(100, 100, 2.0), 0.0);
        assert_eq!(per_second(600, 100, 2.0), 0.0, "a counter going back");
        assert_eq!(per_second(0, 10, 0.0), 0.0, "no time passed");
    }
}
