//! The Redis instance registry, never on the data path: each instance keeps a hash
//! `{prefix}:instances:{host}:{pid}` with a 30 s TTL renewed by heartbeats, reads remote-control
//! commands from `{prefix}:commands:{host}:{pid}`, records their outcomes in
//! `{prefix}:ctl:history`, and on a graceful stop deletes its hash and appends a record to the
//! sorted set `{prefix}:shutdowns` (the newest [`SHUTDOWNS_MAX`] kept). When Redis is
//! unreachable warren keeps working, warns once per outage, reports
//! `warren_connection_up{target="redis"} 0`, and registers again later.
//!
//! Remote commands are signed with HMAC-SHA256 under `CONTROL_SECRET` over a canonical
//! encoding of every field and the target instance ([`CtlCommand::canonical`]); the target names
//! the instance's run (`host:pid/run`, a random id drawn at start and published in its hash), so
//! a command captured for one process is refused by a later one with the same host and PID (PID 1
//! in every container). [`Guard`] refuses unsigned, badly signed, stale, future, replayed and
//! misaddressed ones. Outcomes are signed the same way ([`CtlOutcome::canonical`]), so a line
//! written into the history by anyone who can write to Redis does not pass for an instance's.
//! No message built here shows the password of `REDIS_URL`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use time::OffsetDateTime;
use time::format_description::BorrowedFormatItem;
use time::macros::format_description;
use tracing::{info, warn};

use crate::config::{Settings, redact_url};
use crate::metrics;

/// Lifetime of an instance hash without a heartbeat.
pub const INSTANCE_TTL_S: u64 = 30;
/// Bound on any one Redis call, so a hung Redis never stalls the control loop.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// History entries kept.
const HISTORY_MAX: isize = 1000;
/// Shutdown records kept (the newest).
pub const SHUTDOWNS_MAX: isize = 1000;
/// A signed command issued further than this from the instance's clock is refused.
pub const MAX_SKEW_S: u64 = 120;
/// Start of the error of a command refused for carrying no signature.
pub const REFUSED_UNSIGNED: &str = "refused: unsigned command";
/// Start of the error of a command refused for a signature that does not verify.
pub const REFUSED_BAD_SIGNATURE: &str = "refused: bad signature";

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
        format!("{}:instances:*", self.prefix)
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

/// A remote-control command, as queued for one instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtlCommand {
    /// Shared by the copies sent to several instances, to find their outcomes.
    pub id: String,
    /// `pause`, `resume`, `drain`, `scale` or `rate`.
    pub command: String,
    /// For `scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processors: Option<usize>,
    /// For `rate`: messages per second, 0 = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The pipeline it applies to (`pause`, `resume`, `scale`, `rate`); absent: every pipeline
    /// of the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    pub issued_at: u64,
    /// Who asked (`host:pid` of the `warren ctl` process).
    pub by: String,
    /// The instance it is meant for, `host:pid/run` (`run` from the instance's hash; `host:pid`
    /// from older `warren ctl`s), so a copy pushed to another instance's list, or to a later
    /// process with the same host and PID, is refused; absent in commands from the oldest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlCommand::canonical`] under `CONTROL_SECRET`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl CtlCommand {
    /// The bytes the signature covers: a version line, then each field as
    /// `name=<byte length>:<value>` and a newline, in this order: `id`, `command`, `processors`
    /// (empty when absent), `rate` and `pipeline` (each only when present, so commands without
    /// them keep the signatures they always had), `issued_at`, `by`, `target` (the instance that
    /// applies it, as `host:pid`). The length prefixes make the encoding unambiguous whatever the values hold.
    pub fn canonical(&self, target: &str) -> Vec<u8> {
        // No `..`: a new field does not compile until it is added here, so every argument is
        // covered by the signature.
        let CtlCommand {
            id,
            command,
            processors,
            rate,
            pipeline,
            issued_at,
            by,
            target: _,
            signature: _,
        } = self;
        let processors = processors.map(|n| n.to_string()).unwrap_or_default();
        let rate = rate.map(|n| n.to_string());
        let issued_at = issued_at.to_string();
        encode(
            "warren-ctl-v1",
            [
                Some(("id", id.as_str())),
                Some(("command", command.as_str())),
                Some(("processors", processors.as_str())),
                rate.as_deref().map(|r| ("rate", r)),
                pipeline.as_deref().map(|p| ("pipeline", p)),
                Some(("issued_at", issued_at.as_str())),
                Some(("by", by.as_str())),
                Some(("target", target)),
            ],
        )
    }

    /// Addresses the command to `target` (`host:pid/run`) and signs it with `secret`.
    pub fn sign(&mut self, secret: &str, target: &str) -> Result<(), String> {
        self.target = Some(target.to_string());
        self.signature = Some(tag(secret, &self.canonical(target))?);
        Ok(())
    }

    /// Whether the signature is the one `secret` gives for this command applied by `target`
    /// (compared in constant time).
    pub fn signature_matches(&self, secret: &str, target: &str) -> bool {
        verifies(secret, &self.canonical(target), self.signature.as_deref())
    }
}

/// A version line, then each present field as `name=<byte length>:<value>` and a newline: the
/// length prefixes make the encoding unambiguous whatever the values hold.
fn encode<'a>(
    version: &str,
    fields: impl IntoIterator<Item = Option<(&'a str, &'a str)>>,
) -> Vec<u8> {
    let mut out = format!("{version}\n").into_bytes();
    for (name, value) in fields.into_iter().flatten() {
        out.extend_from_slice(format!("{name}={}:", value.len()).as_bytes());
        out.extend_from_slice(value.as_bytes());
        out.push(b'\n');
    }
    out
}

/// The HMAC-SHA256 of `bytes` under `secret`; HMAC accepts keys of any length, so the error
/// only names the setting in case that ever changes.
fn mac(secret: &str, bytes: &[u8]) -> Result<Hmac<Sha256>, String> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes())
        .map_err(|e| format!("CONTROL_SECRET: not usable as an HMAC-SHA256 key ({e})"))?;
    mac.update(bytes);
    Ok(mac)
}

/// Lower-case hex of the HMAC of `bytes` under `secret`.
fn tag(secret: &str, bytes: &[u8]) -> Result<String, String> {
    let tag = mac(secret, bytes)?.finalize().into_bytes();
    Ok(tag.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `signature` (hex, either case) is the HMAC of `bytes` under `secret`, compared in
/// constant time.
fn verifies(secret: &str, bytes: &[u8], signature: Option<&str>) -> bool {
    let Some(tag) = signature.and_then(from_hex) else {
        return false;
    };
    mac(secret, bytes).is_ok_and(|mac| mac.verify_slice(&tag).is_ok())
}

/// Bytes from lower- or upper-case hex; `None` for anything else.
fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Decides which remote commands this instance applies. With a secret, only commands signed
/// for this instance, issued within [`MAX_SKEW_S`] of now and not seen before; without one,
/// every command (as before signing existed).
pub struct Guard {
    /// `CONTROL_SECRET`; `None` when unset.
    secret: Option<String>,
    /// This instance as `host:pid/run`, which the signature must cover.
    me: String,
    /// Ids of the commands already accepted, with their `issued_at`, so a replay is refused;
    /// forgotten once they are too old to pass the freshness check anyway.
    seen: HashMap<String, u64>,
}

impl Guard {
    pub fn new(secret: &str, me: String) -> Self {
        Self {
            secret: Some(secret.to_string()).filter(|s| !s.is_empty()),
            me,
            seen: HashMap::new(),
        }
    }

    /// `Ok` when `command` may be applied now (`now` in Unix seconds), else why it is refused.
    pub fn check(&mut self, command: &CtlCommand, now: u64) -> Result<(), String> {
        let (host_pid, _run) = self.me.split_once('/').unwrap_or((&self.me, ""));
        if let Some(target) = &command.target
            && *target != self.me
        {
            // Without a secret, a command of an older `warren ctl` (`host:pid`) is still taken.
            let older = self.secret.is_none() && target == host_pid;
            if !older {
                let why =
                    if target.split_once('/').map_or(target.as_str(), |(hp, _)| hp) == host_pid {
                        " (meant for another run of this host and PID: an earlier process, or a \
                     command captured and pushed again)"
                    } else {
                        ""
                    };
                return Err(format!(
                    "refused: addressed to {target}, not to this instance ({}){why}",
                    self.me
                ));
            }
        }
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        if command.signature.is_none() {
            return Err(format!(
                "{REFUSED_UNSIGNED}: this instance has CONTROL_SECRET set and accepts only \
                 signed commands (run `warren ctl` with the same CONTROL_SECRET)"
            ));
        }
        if !command.signature_matches(secret, &self.me) {
            return Err(format!(
                "{REFUSED_BAD_SIGNATURE}: not signed with this instance's CONTROL_SECRET for \
                 this instance, or altered on the way"
            ));
        }
        if command.issued_at + MAX_SKEW_S < now {
            return Err(format!(
                "refused: stale command, issued {} s ago (more than {MAX_SKEW_S} s; check the clocks \
                 if it was just sent)",
                now - command.issued_at
            ));
        }
        if command.issued_at > now + MAX_SKEW_S {
            return Err(format!(
                "refused: command from the future, issued {} s ahead of this instance's clock \
                 (more than {MAX_SKEW_S} s; check the clocks)",
                command.issued_at - now
            ));
        }
        // Keep ids while a copy could still pass the freshness check, with a margin for a clock
        // that steps back.
        self.seen
            .retain(|_, issued| *issued + 2 * MAX_SKEW_S >= now);
        if self.seen.contains_key(&command.id) {
            return Err(format!(
                "refused: replay, command {} was already received by this instance",
                command.id
            ));
        }
        self.seen.insert(command.id.clone(), command.issued_at);
        Ok(())
    }

    /// Signs `outcome` when this instance has a secret.
    pub fn sign(&self, outcome: &mut CtlOutcome) {
        if let Some(secret) = &self.secret {
            outcome.signature = tag(secret, &outcome.canonical()).ok();
        }
    }
}

/// What an instance did with a command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtlOutcome {
    pub id: String,
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processors: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The command's `--pipeline`, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    pub host: String,
    pub pid: u32,
    /// `executed` or `failed`.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub at: u64,
    /// The run of the instance that recorded it (see [`Instance::run`]); absent from older ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlOutcome::canonical`] under `CONTROL_SECRET`, when the
    /// instance has one: a `warren ctl` with the secret believes only outcomes that verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl CtlOutcome {
    /// The bytes the signature covers, encoded as commands are (see [`CtlCommand::canonical`])
    /// under the version line `warren-outcome-v1`: `id`, `command`, `processors` and `rate`
    /// (empty when absent), `pipeline` (only when present), `host`, `pid`, `run`, `outcome`,
    /// `error` (empty when absent), `at`.
    pub fn canonical(&self) -> Vec<u8> {
        let CtlOutcome {
            id,
            command,
            processors,
            rate,
            pipeline,
            host,
            pid,
            outcome,
            error,
            at,
            run,
            signature: _,
        } = self;
        let processors = processors.map(|n| n.to_string()).unwrap_or_default();
        let rate = rate.map(|n| n.to_string()).unwrap_or_default();
        let (pid, at) = (pid.to_string(), at.to_string());
        encode(
            "warren-outcome-v1",
            [
                Some(("id", id.as_str())),
                Some(("command", command.as_str())),
                Some(("processors", processors.as_str())),
                Some(("rate", rate.as_str())),
                pipeline.as_deref().map(|p| ("pipeline", p)),
                Some(("host", host.as_str())),
                Some(("pid", pid.as_str())),
                Some(("run", run.as_deref().unwrap_or_default())),
                Some(("outcome", outcome.as_str())),
                Some(("error", error.as_deref().unwrap_or_default())),
                Some(("at", at.as_str())),
            ],
        )
    }

    /// Whether the outcome carries the signature `secret` gives it.
    pub fn verifies(&self, secret: &str) -> bool {
        verifies(secret, &self.canonical(), self.signature.as_deref())
    }
}

/// What this instance publishes about itself.
#[derive(Debug, Clone)]
pub struct Instance {
    pub host: String,
    pub pid: u32,
    pub roles: String,
    pub started_at: u64,
    /// A random id drawn at start: commands are signed for `host:pid/run`, so one captured for
    /// an earlier process with the same host and PID (PID 1 in every container) is refused.
    pub run: String,
}

impl Instance {
    pub fn this(settings: &Settings) -> Self {
        Self {
            host: crate::hostname(),
            pid: std::process::id(),
            roles: settings.roles.to_string(),
            started_at: now_s(),
            run: uuid::Uuid::new_v4().simple().to_string(),
        }
    }

    /// `host:pid/run`: the target a command for this process is signed for.
    pub fn address(&self) -> String {
        format!("{}:{}/{}", self.host, self.pid, self.run)
    }
}

/// A Redis link that reconnects lazily and never blocks for long.
pub struct Redis {
    url: String,
    conn: Option<MultiplexedConnection>,
    /// Last known state, to warn once per outage.
    up: Option<bool>,
}

/// `text` (a message about the Redis at `url`) with `url` redacted and its password, as written
/// and percent-decoded, replaced by `***` wherever it appears, as in an error the redis crate
/// built from the URL.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    if let Ok(parsed) = url::Url::parse(url)
        && let Some(password) = parsed.password()
    {
        for secret in [password.to_string(), percent_decode(password)] {
            // "***" itself, or a one-character password, would turn every message to noise.
            if secret.len() > 1 && secret != "***" {
                out = out.replace(&secret, "***");
            }
        }
    }
    out
}

/// `%XX` sequences decoded (as the redis crate decodes a password), the rest kept.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Redis {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            conn: None,
            up: None,
        }
    }

    /// Connects to `url` now, or fails with a message naming it (password redacted).
    pub async fn connect(url: &str) -> Result<MultiplexedConnection, String> {
        let shown = redact_url(url);
        let client = redis::Client::open(url)
            .map_err(|e| format!("REDIS_URL {shown}: {}", scrub(&e.to_string(), url)))?;
        match tokio::time::timeout(CALL_TIMEOUT, client.get_multiplexed_async_connection()).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(format!(
                "cannot reach Redis at {shown}: {}",
                scrub(&e.to_string(), url)
            )),
            Err(_) => Err(format!("cannot reach Redis at {shown}: timed out")),
        }
    }

    fn mark(&mut self, up: bool, error: Option<&str>) {
        if self.up != Some(up) {
            metrics::connection("redis", up);
            match (up, self.up) {
                (true, Some(false)) => {
                    metrics::reconnected("redis");
                    info!("Redis is back; the instance registers again");
                }
                (false, _) => warn!(
                    error = error.unwrap_or(""),
                    "Redis unreachable: the registry and remote control pause; consuming and inserting go on"
                ),
                _ => {}
            }
        }
        self.up = Some(up);
    }

    async fn link(&mut self) -> Option<MultiplexedConnection> {
        if self.conn.is_none() {
            match Self::connect(&self.url).await {
                Ok(c) => self.conn = Some(c),
                Err(e) => {
                    self.mark(false, Some(&e));
                    return None;
                }
            }
        }
        self.conn.clone()
    }

    fn failed(&mut self, error: String) {
        self.conn = None;
        self.mark(false, Some(&error));
    }

    /// Runs one Redis call with the bound, reconnecting if needed; `None` while Redis is away.
    async fn call<T, F, Fut>(&mut self, f: F) -> Option<T>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let conn = self.link().await?;
        match tokio::time::timeout(CALL_TIMEOUT, f(conn)).await {
            Ok(Ok(v)) => {
                self.mark(true, None);
                Some(v)
            }
            Ok(Err(e)) => {
                let error = scrub(&e.to_string(), &self.url);
                self.failed(error);
                None
            }
            Err(_) => {
                self.failed("timed out".into());
                None
            }
        }
    }

    /// Runs one command; `None` while Redis is away.
    pub async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Option<T> {
        self.call(|mut c| async move { cmd.query_async::<T>(&mut c).await })
            .await
    }

    /// Runs a pipeline (atomically when built with `atomic()`); `None` while Redis is away.
    pub async fn pipe<T: redis::FromRedisValue>(&mut self, pipe: &redis::Pipeline) -> Option<T> {
        self.call(|mut c| async move { pipe.query_async::<T>(&mut c).await })
            .await
    }
}

/// This instance's registration.
pub struct Registry {
    redis: Redis,
    keys: Keys,
    instance: Instance,
    /// Which remote commands are applied (signatures, freshness, replays).
    guard: Guard,
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
    at: std::time::Instant,
    received: u64,
    inserted: u64,
    /// Each stage's (received, inserted).
    stages: std::collections::BTreeMap<&'static str, (u64, u64)>,
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
    /// `running`, `paused` or `draining`.
    pub status: &'static str,
    pub processors: usize,
    /// Messages per second each pipeline takes, 0 = no limit.
    pub rate_limit_per_s: u32,
}

impl Registry {
    pub fn new(settings: &Settings) -> Self {
        let instance = Instance::this(settings);
        let me = instance.address();
        Self {
            redis: Redis::new(&settings.redis_url),
            keys: Keys::new(&settings.redis_prefix),
            instance,
            guard: Guard::new(&settings.control_secret, me),
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

    /// The received and inserted rates (msg/s) over the last [`RATE_WINDOW`] (or since start),
    /// from the deltas of this instance's own counters: the process's, then each stage's.
    #[allow(clippy::type_complexity)]
    fn rates(
        &mut self,
        received: u64,
        inserted: u64,
        stages: std::collections::BTreeMap<&'static str, (u64, u64)>,
    ) -> (
        (f64, f64),
        std::collections::BTreeMap<&'static str, (f64, f64)>,
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
                (*name, (per_second(r0, *r, secs), per_second(i0, *i, secs)))
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

    fn key(&self) -> String {
        self.keys.instance(&self.instance.host, self.instance.pid)
    }

    /// Writes the hash with live counters and renews its TTL.
    pub async fn heartbeat(&mut self, report: Report) {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &metrics::STATS;
        let totals = metrics::totals();
        let (received, inserted) = (totals.received, totals.inserted);
        let stages = metrics::stages();
        let counts = stages
            .iter()
            .map(|(name, s)| (*name, (s.received.load(Relaxed), s.inserted.load(Relaxed))))
            .collect();
        let ((received_per_s, inserted_per_s), stage_rates) =
            self.rates(received, inserted, counts);
        // Each stage's counters and rates, as one JSON object (`warren status` shows them).
        let pipelines: serde_json::Map<String, serde_json::Value> = stages
            .iter()
            .map(|(name, s)| {
                let (r, i) = stage_rates.get(name).copied().unwrap_or((0.0, 0.0));
                let round = |x: f64| (x * 10.0).round() / 10.0;
                (
                    name.to_string(),
                    serde_json::json!({
                        "paused": s.paused.load(Relaxed),
                        "received": s.received.load(Relaxed),
                        "inserted": s.inserted.load(Relaxed),
                        "retried": s.retried.load(Relaxed),
                        "dead_lettered": s.dead_lettered.load(Relaxed),
                        "received_per_s": round(r),
                        "inserted_per_s": round(i),
                    }),
                )
            })
            .collect();
        let breaker = if stats.breakers_open.load(Relaxed) != 0 {
            "open"
        } else {
            "closed"
        };
        let i = &self.instance;
        let fields: Vec<(&str, String)> = vec![
            ("host", i.host.clone()),
            ("pid", i.pid.to_string()),
            ("roles", i.roles.clone()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            ("started_at", i.started_at.to_string()),
            ("run", i.run.clone()),
            ("status", report.status.to_string()),
            ("processors", report.processors.to_string()),
            ("received", received.to_string()),
            ("inserted", inserted.to_string()),
            ("received_per_s", format!("{received_per_s:.1}")),
            ("inserted_per_s", format!("{inserted_per_s:.1}")),
            ("breaker", breaker.to_string()),
            ("rate_limit_per_s", report.rate_limit_per_s.to_string()),
            ("retried", totals.retried.to_string()),
            ("dead_lettered", totals.dead_lettered.to_string()),
            ("inflight", stats.inflight.load(Relaxed).max(0).to_string()),
            (
                "pipelines",
                serde_json::Value::Object(pipelines).to_string(),
            ),
            ("last_heartbeat", now_s().to_string()),
        ];
        let key = self.key();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset_multiple(&key, &fields)
            .ignore()
            .expire(&key, INSTANCE_TTL_S as i64)
            .ignore();
        let _: Option<()> = self.redis.pipe(&pipe).await;
    }

    /// The next command addressed to this instance, if any, with whether it may be applied
    /// (see [`Guard`]); a refused one is logged here and is to be recorded as failed.
    pub async fn next_command(&mut self) -> Option<(CtlCommand, Result<(), String>)> {
        let key = self.keys.commands(&self.instance.host, self.instance.pid);
        let raw: Option<String> = self
            .redis
            .query::<Option<String>>(redis::cmd("LPOP").arg(&key))
            .await
            .flatten();
        let raw = raw?;
        match serde_json::from_str::<CtlCommand>(&raw) {
            Ok(c) => {
                let verdict = self.guard.check(&c, now_s());
                if let Err(error) = &verdict {
                    warn!(id = %c.id, command = %c.command, by = %c.by, %error, "remote command refused");
                }
                Some((c, verdict))
            }
            Err(e) => {
                warn!(error = %e, command = %raw, "unreadable remote command ignored");
                None
            }
        }
    }

    /// Records what this instance did with `command`.
    pub async fn record(&mut self, command: &CtlCommand, result: Result<(), String>) {
        let mut outcome = CtlOutcome {
            id: command.id.clone(),
            command: command.command.clone(),
            processors: command.processors,
            rate: command.rate,
            pipeline: command.pipeline.clone(),
            host: self.instance.host.clone(),
            pid: self.instance.pid,
            outcome: if result.is_ok() { "executed" } else { "failed" }.into(),
            error: result.err(),
            at: now_s(),
            run: Some(self.instance.run.clone()),
            signature: None,
        };
        self.guard.sign(&mut outcome);
        let Ok(json) = serde_json::to_string(&outcome) else {
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

/// One registered instance, as `warren status` reads it.
pub type InstanceFields = HashMap<String, String>;

/// Every live instance of the deployment (SCAN + HGETALL).
pub async fn instances(redis: &mut Redis, keys: &Keys) -> Option<Vec<InstanceFields>> {
    let mut cursor: u64 = 0;
    let mut names: Vec<String> = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis
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
    for name in names {
        let fields: InstanceFields = redis.query(redis::cmd("HGETALL").arg(&name)).await?;
        if !fields.is_empty() {
            out.push(fields);
        }
    }
    Some(out)
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
        assert_eq!(k.commands("h", 7), "warren:commands:h:7");
        assert_eq!(k.history(), "warren:ctl:history");
        assert_eq!(k.shutdowns(), "warren:shutdowns");
    }

    #[test]
    fn commands_round_trip_as_json() {
        let mut c = CtlCommand {
            id: "x".into(),
            command: "scale".into(),
            processors: Some(4),
            rate: None,
            pipeline: None,
            issued_at: 1,
            by: "h:1".into(),
            target: None,
            signature: None,
        };
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        c.sign("k", "h:2").unwrap();
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn commands_of_older_ctls_still_parse() {
        let c: CtlCommand =
            serde_json::from_str(r#"{"id":"x","command":"pause","issued_at":5,"by":"h:1"}"#)
                .unwrap();
        assert_eq!((c.target, c.signature), (None, None));
    }

    #[test]
    fn the_signature_covers_the_pipeline_and_leaves_older_commands_alone() {
        let plain = sample();
        assert!(
            !String::from_utf8(plain.canonical("vm:1"))
                .unwrap()
                .contains("pipeline"),
            "a command without --pipeline signs as before"
        );
        let mut c = sample();
        c.pipeline = Some("orders".into());
        assert!(
            String::from_utf8(c.canonical("vm:1"))
                .unwrap()
                .contains("\npipeline=6:orders\n")
        );
        c.sign("k", "vm:1/r").unwrap();
        assert!(c.signature_matches("k", "vm:1/r"));
        let mut moved = c.clone();
        moved.pipeline = Some("users".into());
        assert!(!moved.signature_matches("k", "vm:1/r"), "pipeline changed");
        let mut widened = c.clone();
        widened.pipeline = None;
        assert!(
            !widened.signature_matches("k", "vm:1/r"),
            "pipeline dropped"
        );
    }

    fn sample() -> CtlCommand {
        CtlCommand {
            id: "0b8f".into(),
            command: "scale".into(),
            processors: Some(4),
            rate: None,
            pipeline: None,
            issued_at: 1_795_239_346,
            by: "ops:42".into(),
            target: None,
            signature: None,
        }
    }

    #[test]
    fn the_canonical_encoding_and_signature_are_the_documented_ones() {
        let c = sample();
        assert_eq!(
            String::from_utf8(c.canonical("vm:20740")).unwrap(),
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:4\n\
             issued_at=10:1795239346\nby=6:ops:42\ntarget=8:vm:20740\n"
        );
        // Computed independently (Python's hmac module over the bytes above).
        let mut signed = c.clone();
        signed.sign("s3cret", "vm:20740").unwrap();
        assert_eq!(signed.target.as_deref(), Some("vm:20740"));
        assert_eq!(
            signed.signature.as_deref(),
            Some("6c14c808b9ddffaed54779e9a952a26961fa099c52957be11545e8033fd069ce")
        );
        assert!(signed.signature_matches("s3cret", "vm:20740"));
        let mut upper = signed.clone();
        upper.signature = upper.signature.map(|s| s.to_uppercase());
        assert!(upper.signature_matches("s3cret", "vm:20740"));
    }

    #[test]
    fn the_signature_covers_every_field_and_the_target() {
        let mut signed = sample();
        signed.sign("k", "vm:1").unwrap();
        assert!(signed.signature_matches("k", "vm:1"));
        assert!(!signed.signature_matches("other", "vm:1"), "another secret");
        assert!(!signed.signature_matches("k", "vm:2"), "another target");
        let altered: [fn(&mut CtlCommand); 6] = [
            |c| c.id.push('x'),
            |c| c.command = "drain".into(),
            |c| c.processors = Some(5),
            |c| c.processors = None,
            |c| c.issued_at += 1,
            |c| c.by = "someone:1".into(),
        ];
        for (i, alter) in altered.iter().enumerate() {
            let mut c = signed.clone();
            alter(&mut c);
            assert!(!c.signature_matches("k", "vm:1"), "alteration {i} verified");
        }
        // Field boundaries cannot be moved: "ab" + "c" differs from "a" + "bc".
        let (mut a, mut b) = (sample(), sample());
        (a.id, a.command) = ("ab".into(), "c".into());
        (b.id, b.command) = ("a".into(), "bc".into());
        assert_ne!(a.canonical("t"), b.canonical("t"));
        for bad in ["", "zz", "abc", "6c14"] {
            let mut c = signed.clone();
            c.signature = Some(bad.into());
            assert!(!c.signature_matches("k", "vm:1"), "{bad:?}");
        }
    }

    #[test]
    fn the_rate_joins_the_signed_encoding_only_when_present() {
        let mut c = sample();
        (c.command, c.processors, c.rate) = ("rate".into(), None, Some(500));
        assert_eq!(
            String::from_utf8(c.canonical("vm:1")).unwrap(),
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\n\
             issued_at=10:1795239346\nby=6:ops:42\ntarget=4:vm:1\n"
        );
        c.sign("k", "vm:1").unwrap();
        for altered in [Some(5000), Some(0), None] {
            let mut other = c.clone();
            other.rate = altered;
            assert!(!other.signature_matches("k", "vm:1"), "{altered:?}");
        }
        assert!(c.signature_matches("k", "vm:1"));
    }

    #[test]
    fn rates_are_counter_deltas_over_the_elapsed_time() {
        assert_eq!(per_second(100, 600, 2.0), 250.0);
        assert_eq!(per_second(100, 100, 2.0), 0.0);
        assert_eq!(per_second(600, 100, 2.0), 0.0, "a counter going back");
        assert_eq!(per_second(0, 10, 0.0), 0.0, "no time passed");
    }

    fn signed(id: &str, issued_at: u64, secret: &str, target: &str) -> CtlCommand {
        let mut c = sample();
        c.id = id.into();
        c.issued_at = issued_at;
        c.sign(secret, target).unwrap();
        c
    }

    #[test]
    fn the_guard_refuses_unsigned_forged_stale_future_replayed_and_redirected_commands() {
        let now = 1_000_000;
        let mut guard = Guard::new("k", "vm:1".into());
        assert_eq!(guard.check(&signed("a", now, "k", "vm:1"), now), Ok(()));
        // The edges of the window are accepted.
        assert_eq!(
            guard.check(&signed("b", now - 120, "k", "vm:1"), now),
            Ok(())
        );
        assert_eq!(
            guard.check(&signed("c", now + 120, "k", "vm:1"), now),
            Ok(())
        );

        let refused = |guard: &mut Guard, c: &CtlCommand| guard.check(c, now).unwrap_err();
        let e = refused(&mut guard, &sample());
        assert!(
            e.starts_with(REFUSED_UNSIGNED) && e.contains("CONTROL_SECRET"),
            "{e}"
        );
        let e = refused(&mut guard, &signed("d", now, "wrong", "vm:1"));
        assert!(e.starts_with(REFUSED_BAD_SIGNATURE), "{e}");
        let e = refused(&mut guard, &signed("e", now - 121, "k", "vm:1"));
        assert!(e.contains("stale") && e.contains("121 s ago"), "{e}");
        let e = refused(&mut guard, &signed("f", now + 121, "k", "vm:1"));
        assert!(e.contains("future") && e.contains("121 s"), "{e}");
        let e = refused(&mut guard, &signed("a", now, "k", "vm:1"));
        assert!(e.contains("replay") && e.contains('a'), "{e}");
        // Signed for another instance: its target says so; without the field the signature
        // still does not verify.
        let mut other = signed("g", now, "k", "vm:2");
        let e = refused(&mut guard, &other);
        assert!(e.contains("addressed to vm:2"), "{e}");
        other.target = None;
        assert!(refused(&mut guard, &other).starts_with(REFUSED_BAD_SIGNATURE));
        // Refusals do not mark an id as seen; a valid copy still goes through once.
        assert_eq!(guard.check(&signed("d", now, "k", "vm:1"), now), Ok(()));

        // Ids are forgotten only once a copy would be refused as stale anyway.
        let later = now + 241;
        assert!(
            guard
                .check(&signed("a", now, "k", "vm:1"), later)
                .unwrap_err()
                .contains("stale")
        );
        assert_eq!(guard.check(&signed("h", later, "k", "vm:1"), later), Ok(()));
        assert!(!guard.seen.contains_key("a"));
    }

    #[test]
    fn a_command_signed_for_an_earlier_run_of_the_same_host_and_pid_is_refused() {
        let now = 1_000_000;
        // The first process, PID 1 in its container, accepts a command signed for its run...
        let mut first = Guard::new("k", "vm:1/run-a".into());
        let captured = signed("a", now, "k", "vm:1/run-a");
        assert_eq!(first.check(&captured, now), Ok(()));
        // ...the process after a restart (same host, same PID, empty memory of ids) does not,
        // nor a command signed for the bare `host:pid` (as captured before runs existed).
        let mut second = Guard::new("k", "vm:1/run-b".into());
        let e = second.check(&captured, now + 15).unwrap_err();
        assert!(
            e.contains("addressed to vm:1/run-a") && e.contains("another run"),
            "{e}"
        );
        let e = second
            .check(&signed("b", now, "k", "vm:1"), now)
            .unwrap_err();
        assert!(e.contains("another run"), "{e}");
        // Its target rewritten to this run: the signature does not verify.
        let mut redirected = captured.clone();
        redirected.target = Some("vm:1/run-b".into());
        assert!(
            second
                .check(&redirected, now)
                .unwrap_err()
                .starts_with(REFUSED_BAD_SIGNATURE)
        );
        assert_eq!(
            second.check(&signed("c", now, "k", "vm:1/run-b"), now),
            Ok(())
        );
        // Without a secret, the bare `host:pid` of older `warren ctl`s still reaches it.
        let mut open = Guard::new("", "vm:1/run-b".into());
        assert_eq!(open.check(&signed("d", now, "", "vm:1"), now), Ok(()));
    }

    #[test]
    fn outcomes_are_signed_over_every_field_and_verified() {
        let guard = Guard::new("k", "vm:1/r".into());
        let mut o = CtlOutcome {
            id: "0b8f".into(),
            command: "pause".into(),
            processors: None,
            rate: None,
            pipeline: None,
            host: "vm".into(),
            pid: 1,
            outcome: "executed".into(),
            error: None,
            at: 1_795_239_346,
            run: Some("r".into()),
            signature: None,
        };
        assert_eq!(
            String::from_utf8(o.canonical()).unwrap(),
            "warren-outcome-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\nrate=0:\nhost=2:vm\n\
             pid=1:1\nrun=1:r\noutcome=8:executed\nerror=0:\nat=10:1795239346\n"
        );
        assert!(!o.verifies("k"), "unsigned");
        guard.sign(&mut o);
        assert!(o.verifies("k"));
        assert!(!o.verifies("other"));
        let altered: [fn(&mut CtlOutcome); 6] = [
            |o| o.outcome = "failed".into(),
            |o| o.error = Some("x".into()),
            |o| o.pid = 2,
            |o| o.run = None,
            |o| o.at += 1,
            |o| o.id.push('x'),
        ];
        for alter in altered {
            let mut copy = o.clone();
            alter(&mut copy);
            assert!(!copy.verifies("k"), "{copy:?}");
        }
        let mut unsigned = o.clone();
        Guard::new("", "vm:1/r".into()).sign(&mut unsigned);
        assert!(
            unsigned.signature == o.signature,
            "no secret leaves it as it was"
        );
    }

    #[test]
    fn without_a_secret_every_command_is_accepted_as_before() {
        let mut guard = Guard::new("", "vm:1".into());
        assert_eq!(guard.check(&sample(), 0), Ok(()));
        assert_eq!(guard.check(&sample(), u64::MAX / 2), Ok(()));
        assert_eq!(guard.check(&signed("x", 0, "whatever", "vm:1"), 0), Ok(()));
        let e = guard.check(&signed("x", 0, "k", "vm:2"), 0).unwrap_err();
        assert!(e.contains("addressed to vm:2"), "{e}");
    }

    #[test]
    fn redis_messages_never_show_the_password() {
        let url = "redis://user:p%40ss-W0rd@127.0.0.1:1/0";
        let text = format!("cannot connect to {url}: auth p@ss-W0rd and p%40ss-W0rd failed");
        let shown = scrub(&text, url);
        assert!(
            !shown.contains("p@ss-W0rd") && !shown.contains("p%40ss-W0rd"),
            "{shown}"
        );
        assert!(shown.contains("redis://user:***@127.0.0.1:1/0"), "{shown}");
        assert_eq!(
            scrub("no url here", "redis://127.0.0.1:6379"),
            "no url here"
        );
        assert_eq!(percent_decode("a%41%zz%4"), "aA%zz%4");
    }

    #[tokio::test]
    async fn an_unreachable_redis_is_named_without_its_password() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let url = format!("redis://:Hidden-Pw-77@127.0.0.1:{port}");
        let e = Redis::connect(&url).await.unwrap_err();
        assert!(!e.contains("Hidden-Pw-77"), "{e}");
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        let mut redis = Redis::new(&url);
        assert_eq!(redis.query::<String>(&redis::cmd("PING")).await, None);
    }
}
