//! Typed settings: the layering (shipped defaults < `--config` file < environment < CLI flags)
//! and the validation whose errors name the setting, the value and what was expected.

mod components;
pub mod pipelines;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::Value;
use serde::{Deserialize, Serialize};

/// The shipped `config/default.toml`, built into the binary so warren runs from any directory.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// The settings part of [`DEFAULT_TOML`]: everything before its `[[pipelines]]` entry (the
/// built-in users pipeline, [`pipelines::users`]), which is not a default of a file's list of
/// pipelines but a pipeline of its own.
pub fn default_settings_toml() -> &'static str {
    DEFAULT_TOML
        .split_once(pipelines::USERS_MARK)
        .map_or(DEFAULT_TOML, |(settings, _)| settings)
}

/// Declares every setting once: its doc, its key (the field name, the key in
/// `config/default.toml` and `--set`; the environment variable is the key in upper case), its
/// type, and what it accepts ([`Rule`], checked before the typed parse so the error names the
/// setting). Generates [`Settings`] and [`RULES`] from the one list, so they cannot disagree;
/// `config/default.toml` gives each its default, and a test parses it into [`Settings`].
macro_rules! settings {
    ($( $(#[$doc:meta])* $key:ident: $ty:ty => $rule:expr, )*) => {
        /// Every setting of warren. The key in `config/default.toml` is the field name; the
        /// environment variable is the same name in upper case.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $( $(#[$doc])* pub $key: $ty, )*
            /// The file's `[[pipelines]]` (see [`pipelines`]), beside the built-in users pipeline. Last:
            /// TOML writes tables after plain values.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            pub pipelines: Vec<pipelines::PipelineConfig>,
            /// `warren run --pipelines` left the built-in users pipeline out (not a setting).
            #[serde(skip)]
            pub without_users: bool,
        }

        /// Every setting and its rule, in the order of `config/default.toml`.
        const RULES: &[(&str, Rule)] = &[ $( (stringify!($key), $rule), )* ];
    };
}

settings! {
    // --- connections -------------------------------------------------------------------
    /// Where the broker is: one node's URL, or several (a cluster's nodes) separated by commas;
    /// consumers and publishers open their own connections, to the first node that answers.
    amqp_url: String => Rule::AmqpUrls,
    /// Whether each process shuffles the `amqp_url` list once at start, so many instances given
    /// the same list spread their connections over the nodes instead of all taking the first.
    amqp_shuffle: bool => Rule::Bool,
    /// AMQP heartbeat so a half-open socket is noticed (0 disables).
    amqp_heartbeat_s: u16 => Rule::Int { min: 0, max: 600 },
    /// Bound on one connect attempt, so a black-holed broker cannot hang a reconnect loop.
    amqp_connect_timeout_ms: u64 => Rule::Int { min: 100, max: 600_000 },
    /// The broker's `consumer_timeout` (0 = it has none): warren gives back (nacks with requeue)
    /// any delivery it would hold unacked longer, before the broker closes the channel over it.
    amqp_consumer_timeout_ms: u64 => Rule::Int { min: 0, max: 86_400_000 },
    /// Where the rows go; several `host:port` pairs are tried in turn (with
    /// `target_session_attrs=read-write`, only a primary is taken).
    database_url: String => Rule::PgUrl,
    /// Schema holding the tables, so several deployments (or tests) share one database.
    database_schema: String => Rule::Ident,
    /// Pool size; at least the batch concurrency so batches never wait for a connection.
    database_pool_size: usize => Rule::Int { min: 1, max: 256 },
    /// Server-side `statement_timeout` of warren's sessions; the client gives up on a statement
    /// this long plus a margin after sending it, so a half-open connection cannot hang a batch.
    database_statement_timeout_ms: u64 => Rule::Int { min: 100, max: 3_600_000 },
    /// Connections of the HTTP API's own pool, so API traffic can never starve the pipeline.
    api_pool_size: usize => Rule::Int { min: 1, max: 64 },
    /// Redis for the instance registry and remote control.
    redis_url: String => Rule::Url(&["redis", "rediss"]),
    /// Prefix of every Redis key, so several deployments share one Redis.
    redis_prefix: String => Rule::Name,
    /// Shared secret that signs remote-control commands (HMAC-SHA256); empty = unsigned
    /// commands are accepted, with a warning at start.
    control_secret: String => Rule::Secret,
    /// Registry heartbeat period (the entry's TTL is 30 s).
    registry_heartbeat_ms: u64 => Rule::Int { min: 100, max: 20_000 },
    /// HTTP API listen address.
    http_addr: String => Rule::Addr,
    /// Prometheus endpoint listen address.
    metrics_addr: String => Rule::Addr,
    // --- topology ----------------------------------------------------------------------
    /// `classic` (the default) or `quorum`: the type of every queue warren declares. Quorum
    /// queues are replicated over the cluster and dead-letter at least once.
    queue_type: QueueType => Rule::OneOf(&["classic", "quorum"]),
    /// Quorum queues only: deliveries of one message from the main queue (redeliveries after a
    /// requeue or a lost consumer included) after which the broker dead-letters it to the DLQ.
    delivery_limit: u32 => Rule::Int { min: 1, max: 1000 },
    /// Quorum queues only: the DLQ's own delivery limit, declared explicitly (0: not declared,
    /// the broker's default applies: none on RabbitMQ 3.x, 20 on 4.x, after which the DLQ, which
    /// dead-letters nowhere, would drop a message).
    dlq_delivery_limit: u32 => Rule::Int { min: 0, max: 1_000_000_000 },
    /// Exchange the publisher writes to and the retry queue dead-letters back to.
    main_exchange: String => Rule::Name,
    /// Queue the main pipeline consumes.
    main_queue: String => Rule::Name,
    /// Exchange transient failures are republished to.
    retry_exchange: String => Rule::Name,
    /// TTL queue that holds retried messages for `retry_ttl_ms`; with retry tiers, the base of
    /// the tier queues' names (see [`Settings::retry_tiers`]).
    retry_queue: String => Rule::Name,
    /// Dead-letter exchange.
    dlx_exchange: String => Rule::Name,
    /// Dead-letter queue the DLQ consumer drains.
    dlq_queue: String => Rule::Name,
    // --- pipeline ----------------------------------------------------------------------
    /// Roles `warren run` runs.
    roles: Roles => Rule::Roles,
    /// Message TTL of the retry queue (the single tier when `retry_ttls_ms` is empty).
    retry_ttl_ms: u64 => Rule::Int { min: 1, max: 86_400_000 },
    /// Retry tiers: one retry queue per TTL, the n-th retry of a message waiting in the n-th
    /// (the last one for every later retry), so retries back off. Empty: one tier,
    /// `retry_queue` with `retry_ttl_ms`.
    retry_ttls_ms: RetryTtls => Rule::TtlList,
    /// Retries before a message is dead-lettered as `retries_exhausted`.
    max_retries: u32 => Rule::Int { min: 0, max: 100 },
    /// Attempts the DLQ consumer makes at a message whose insert keeps failing with a database
    /// error before it parks it, so no message loops in the DLQ forever.
    dlq_max_attempts: u32 => Rule::Int { min: 1, max: 1000 },
    /// Flush a batch at this many messages.
    users_batch_size: usize => Rule::Int { min: 1, max: 10_000 },
    /// Flush a batch this long after its first message.
    users_batch_timeout_ms: u64 => Rule::Int { min: 0, max: 600_000 },
    /// Processor actors: 1 decodes on the pipeline's own thread; more decode in parallel on
    /// threads of their own (at most one per core).
    users_proc_concurrency: usize => Rule::Int { min: 1, max: 256 },
    /// Batcher actors (batch inserts in flight at once).
    users_batch_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// How the batch inserts in flight follow the backlog: `off` (fixed at
    /// `users_batch_concurrency`), `simple` or `auto` (docs/balancing.md).
    users_balance: Balance => Rule::OneOf(&["off", "simple", "auto"]),
    /// Balanced: the fewest batch inserts in flight (where `auto` starts).
    users_min_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// Balanced: the most batch inserts in flight.
    users_max_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// Balanced: time between two decisions, so the concurrency never flaps.
    users_balance_cooldown_ms: u64 => Rule::Int { min: 100, max: 3_600_000 },
    /// `auto`: the most inserts in flight one decision adds or takes away.
    users_balance_max_shift: usize => Rule::Int { min: 1, max: 64 },
    /// `simple`: messages of backlog per insert in flight.
    users_scale_threshold: u64 => Rule::Int { min: 1, max: 100_000_000 },
    /// `auto`: a backlog above this many messages per insert in flight asks for more.
    users_scale_up_threshold: u64 => Rule::Int { min: 1, max: 100_000_000 },
    /// `auto`: a backlog that stays below this many messages per insert in flight gives back.
    users_scale_down_threshold: u64 => Rule::Int { min: 0, max: 100_000_000 },
    /// Batch inserts in flight in the whole process, every pipeline's together; balanced
    /// pipelines share what the fixed ones leave, by backlog. 0: `database_pool_size`.
    max_inserts_in_flight: usize => Rule::Int { min: 0, max: 256 },
    /// Consumer prefetch; 0 derives it: batch size x batch concurrency x 2.
    prefetch: u32 => Rule::Int { min: 0, max: 65_535 },
    /// Messages per second each pipeline takes from its queue; 0 = no limit. Changed at run
    /// time by `warren ctl rate`.
    rate_limit_per_s: u32 => Rule::Int { min: 0, max: 1_000_000 },
    /// Largest accepted body; larger ones are dead-lettered unread.
    max_message_bytes: usize => Rule::Int { min: 1, max: 134_217_728 },
    /// Bytes of messages one pipeline holds at once (delivered, not yet settled: bodies and
    /// their properties as parsed): the prefetch window never exceeds budget /
    /// MAX_MESSAGE_BYTES; past the budget (larger, refused bodies; large header tables) the
    /// consumer takes no more until they settle, and its next window is cut to what the budget
    /// holds of the largest delivery seen.
    max_inflight_bytes: u64 => Rule::Int { min: 1_048_576, max: 17_179_869_184 },
    /// How long a failing batch is retried in place before going to the retry queue.
    db_retry_window_ms: u64 => Rule::Int { min: 0, max: 600_000 },
    /// Consecutive transient batch failures that open the sink-outage breaker.
    breaker_failures: u32 => Rule::Int { min: 1, max: 1000 },
    // --- publishing and shutdown -------------------------------------------------------
    /// Bound on waiting for a publisher confirm.
    publish_timeout_ms: u64 => Rule::Int { min: 100, max: 600_000 },
    /// Whether what warren publishes (the API, `warren publish`) carries the `x-published-ms`
    /// header, the publish time in milliseconds for the end-to-end latency; without it the
    /// latency is measured from the AMQP timestamp, to the second. A header table costs the
    /// broker CPU on every message (docs/performance.md).
    publish_latency_header: bool => Rule::Bool,
    /// Bound on the graceful shutdown.
    shutdown_timeout_ms: u64 => Rule::Int { min: 0, max: 3_600_000 },
    // --- logs --------------------------------------------------------------------------
    /// How log lines are written.
    log_format: LogFormat => Rule::OneOf(&["text", "json"]),
    // --- events ------------------------------------------------------------------------
    /// Entries the Redis event stream keeps, about (`MAXLEN ~`); 0 turns events off.
    events_max_len: u64 => Rule::Int { min: 0, max: 100_000_000 },
}

/// The type of the queues warren declares (`QUEUE_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Classic queues: what warren declared before the setting existed.
    Classic,
    /// Quorum queues: replicated, at-least-once dead-lettering, a delivery limit.
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl std::fmt::Display for QueueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a pipeline's batch inserts in flight follow its backlog (`USERS_BALANCE`, a pipeline's
/// `balance`; docs/balancing.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Balance {
    /// A fixed number: the batch concurrency.
    #[default]
    Off,
    /// `min(max, max(min, ceil(backlog / threshold)))`, every cooldown.
    Simple,
    /// Step by step while a step makes the pipeline faster.
    Auto,
}

impl Balance {
    pub fn as_str(self) -> &'static str {
        match self {
            Balance::Off => "off",
            Balance::Simple => "simple",
            Balance::Auto => "auto",
        }
    }
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How log lines are written (`LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, fields flattened (for log shippers).
    Json,
}

/// A part of warren that `warren run` can run (`ROLES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The main pipeline: the main queue into the table, failures to retry or DLQ.
    Consumer,
    /// The DLQ consumer: the DLQ into the table, or parked.
    Dlq,
    /// The REST API.
    Api,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Consumer, Role::Dlq, Role::Api];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Consumer => "consumer",
            Role::Dlq => "dlq",
            Role::Api => "api",
        }
    }

    fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// The roles of one `warren run`: a non-empty set, written comma-separated (`consumer,api`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles(Vec<Role>);

impl Roles {
    /// Parses `"consumer, api"`: blanks around names allowed, at least one, each known.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut roles = Vec::new();
        for name in text.split(',').map(str::trim) {
            let role = Role::parse(name).ok_or_else(|| format!("{name:?} is not a role"))?;
            if !roles.contains(&role) {
                roles.push(role);
            }
        }
        Ok(Roles(roles))
    }

    pub fn contains(&self, role: Role) -> bool {
        self.0.contains(&role)
    }

    /// The names known, for error messages: `consumer,dlq,api`.
    pub fn known() -> String {
        Role::ALL.map(Role::as_str).join(",")
    }
}

impl std::fmt::Display for Roles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|r| r.as_str()).collect();
        f.write_str(&names.join(","))
    }
}

impl Serialize for Roles {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Roles {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Roles::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The TTLs of the retry tiers in ms, in order (`RETRY_TTLS_MS`); empty = the single tier of
/// `RETRY_TTL_MS`. Written as a comma-separated list (`"1000,10000,60000"`); a list of integers
/// or one integer is read too (an environment variable holding one number arrives as one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryTtls(pub Vec<u64>);

/// Most retry tiers (more would be more queues than any backoff needs).
pub const MAX_RETRY_TIERS: usize = 10;
/// Bounds of one retry TTL in ms, as `RETRY_TTL_MS`.
const RETRY_TTL_RANGE: (u64, u64) = (1, 86_400_000);

impl RetryTtls {
    /// Parses `"1000, 10000,60000"`; blanks around entries are allowed, an empty text is no tier.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let ttls = text
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("{:?} is not an integer", t.trim()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::checked(ttls)
    }

    /// The tiers if there are at most [`MAX_RETRY_TIERS`], each in range, increasing.
    fn checked(ttls: Vec<u64>) -> Result<Self, String> {
        let (min, max) = RETRY_TTL_RANGE;
        if ttls.len() > MAX_RETRY_TIERS {
            return Err(format!("{} tiers", ttls.len()));
        }
        if let Some(t) = ttls.iter().find(|t| !(min..=max).contains(*t)) {
            return Err(format!("{t} is out of range"));
        }
        if let Some(w) = ttls.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!("{} does not follow {} upwards", w[1], w[0]));
        }
        Ok(Self(ttls))
    }
}

impl Serialize for RetryTtls {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = self.0.iter().map(u64::to_string).collect();
        s.serialize_str(&text.join(","))
    }
}

impl<'de> Deserialize<'de> for RetryTtls {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            One(u64),
            Many(Vec<u64>),
        }
        let parsed = match Raw::deserialize(d)? {
            Raw::Text(t) => RetryTtls::parse(&t),
            Raw::One(n) => RetryTtls::checked(vec![n]),
            Raw::Many(v) => RetryTtls::checked(v),
        };
        parsed.map_err(serde::de::Error::custom)
    }
}

/// One retry tier: the queue a retry waits in and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryTier {
    pub queue: String,
    pub ttl_ms: u64,
}

/// A TTL as the suffix of a tier queue's name: whole hours `2h`, minutes `1m`, seconds `10s`,
/// else milliseconds `300ms`.
pub fn humanize_ms(ms: u64) -> String {
    match ms {
        0 => "0ms".into(),
        _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
        _ if ms.is_multiple_of(60_000) => format!("{}m", ms / 60_000),
        _ if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        _ => format!("{ms}ms"),
    }
}

/// `raffle_retry_10s` -> `raffle_retry`: the name without a trailing `_<number><ms|s|m|h>`.
pub fn retry_base(retry_queue: &str) -> &str {
    let Some((base, suffix)) = retry_queue.rsplit_once('_') else {
        return retry_queue;
    };
    let digits = suffix.chars().take_while(char::is_ascii_digit).count();
    let unit = &suffix[digits..];
    if digits > 0 && !base.is_empty() && ["ms", "s", "m", "h"].contains(&unit) {
        base
    } else {
        retry_queue
    }
}

/// A configuration error; each names the setting it is about. Exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value of the wrong type or outside its range.
    #[error("{setting}: expected {expected}, got {got}")]
    Invalid {
        setting: String,
        expected: String,
        got: String,
    },
    /// A key in a configuration file that warren does not know.
    #[error(
        "unknown setting `{key}` in {source_name}; known settings are listed in config/default.toml"
    )]
    Unknown { key: String, source_name: String },
    /// A `--set` flag that is not `KEY=VALUE`.
    #[error("--set {0}: expected KEY=VALUE, for example --set users_batch_size=500")]
    BadFlag(String),
    /// The file given with `--config` could not be read.
    #[error("--config {path}: {reason}")]
    File { path: PathBuf, reason: String },
    /// A `[[pipelines]]` entry that does not compile (its text names the pipeline and column).
    #[error("{0}")]
    Pipeline(String),
    /// A `WARREN_*` environment variable that is no setting.
    #[error(
        "{name}: no such setting (did you mean {closest}?); every setting is listed by \
         `warren run --help` and in docs/configuration.md"
    )]
    UnknownEnv { name: String, closest: String },
    /// Anything else figment reports.
    #[error("configuration: {0}")]
    Other(String),
}

/// What a setting accepts.
enum Rule {
    Int {
        min: u64,
        max: u64,
    },
    Url(&'static [&'static str]),
    /// A comma-separated list of AMQP URLs, each checked as the AMQP client parses it.
    AmqpUrls,
    /// A PostgreSQL URL as the client parses it, one host or several (`h1:5432,h2:5432`).
    PgUrl,
    Bool,
    Addr,
    Name,
    Ident,
    Roles,
    /// A comma-separated list of retry TTLs (see [`RetryTtls`]).
    TtlList,
    OneOf(&'static [&'static str]),
    /// Any string, never shown in errors or `warren config`.
    Secret,
}

/// Every setting as (key in `config/default.toml` and `--set`, environment variable), in the
/// order of that file. docs/configuration.md is tested against it (tests/docs.rs).
pub fn setting_names() -> impl Iterator<Item = (&'static str, String)> {
    RULES
        .iter()
        .map(|(key, _)| (*key, key.to_ascii_uppercase()))
}

/// How long a delivery may stay unacked in warren under a broker `consumer_timeout` of
/// `timeout_ms` (0 = none): 80% of it. The 20% margin (6 minutes at RabbitMQ's default of
/// 30) covers what may still run after the check: the database statement in flight (bounded by
/// `DATABASE_STATEMENT_TIMEOUT_MS` + 2 s), the fallback stage's settling and the nack's way to
/// the broker; the broker itself only checks on its channel tick (every 60 s on 3.10), which can
/// only make it later.
pub fn hand_back_after(timeout_ms: u64) -> Option<Duration> {
    (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms * 4 / 5))
}

/// Where settings come from, besides the shipped defaults and the environment.
#[derive(Debug, Default, Clone)]
pub struct Sources {
    /// A TOML file layered over the defaults (`--config PATH`).
    pub file: Option<PathBuf>,
    /// CLI overrides, `key -> raw value` (from `--set` and named flags); they win over all.
    pub overrides: BTreeMap<String, String>,
    /// Whether to read the process environment (tests turn it off to stay hermetic).
    pub use_env: bool,
}

impl Sources {
    /// Defaults < file < environment < overrides.
    pub fn new(file: Option<PathBuf>) -> Self {
        Self {
            file,
            overrides: BTreeMap::new(),
            use_env: true,
        }
    }

    /// Adds `--set KEY=VALUE` flags; keys are accepted in either case.
    pub fn with_set_flags(mut self, flags: &[String]) -> Result<Self, ConfigError> {
        for flag in flags {
            let (key, value) = flag
                .split_once('=')
                .ok_or_else(|| ConfigError::BadFlag(flag.clone()))?;
            let key = key.trim().to_ascii_lowercase();
            if !RULES.iter().any(|(k, _)| *k == key) {
                return Err(ConfigError::Unknown {
                    key,
                    source_name: "--set".into(),
                });
            }
            self.overrides.insert(key, value.to_string());
        }
        Ok(self)
    }

    /// Adds one override from a named CLI flag.
    pub fn with_override(mut self, key: &str, value: impl Into<String>) -> Self {
        self.overrides.insert(key.to_string(), value.into());
        self
    }
}

/// `WARREN_*` environment variables that are not settings and are allowed: `--config`'s
/// variable and those of warren's own scripts (bench, cluster).
const WARREN_NOT_SETTINGS: &[&str] = &["WARREN_CONFIG", "WARREN_BIN", "WARREN_CLUSTER_DIR"];
/// Prefixes of `WARREN_*` variables of warren's test harness, free for tools.
const WARREN_TOOL_PREFIXES: &[&str] = &["WARREN_TEST_", "WARREN_LEDGER_", "WARREN_BENCH_"];

/// The environment variable of `key` that is set, if any: `WARREN_<NAME>` wins over `<NAME>`.
fn env_name_of(key: &str) -> Option<String> {
    let upper = key.to_ascii_uppercase();
    [format!("WARREN_{upper}"), upper]
        .into_iter()
        .find(|name| std::env::var_os(name).is_some())
}

/// Whether `name` (with `value`) is one of the variables Kubernetes gives every pod for each
/// Service of its namespace (service links): a Service `warren` (or `warren-api`) makes
/// `WARREN_SERVICE_HOST`, `WARREN_SERVICE_PORT`, `WARREN_SERVICE_PORT_<PORT NAME>`,
/// `WARREN_PORT=tcp://..`, `WARREN_PORT_<N>_TCP`, `.._TCP_PROTO`, `.._TCP_PORT` and
/// `.._TCP_ADDR` (`WARREN_API_...` for `warren-api`). They are not settings, and a Deployment
/// named like its Service must still start.
fn is_kubernetes_service_link(name: &str, value: &str) -> bool {
    if name.ends_with("_SERVICE_HOST")
        || name.ends_with("_SERVICE_PORT")
        || name.contains("_SERVICE_PORT_")
    {
        return true;
    }
    let proto = ["tcp://", "udp://", "sctp://"];
    if name.ends_with("_PORT") && proto.iter().any(|p| value.starts_with(p)) {
        return true;
    }
    // `<SERVICE>_PORT_<number>_<TCP|UDP|SCTP>` and its `_PROTO`, `_PORT`, `_ADDR`.
    let mut parts = name.rsplit('_');
    let (mut last, mut before) = (parts.next(), parts.next());
    if matches!(last, Some("PROTO" | "PORT" | "ADDR")) {
        (last, before) = (before, parts.next());
    }
    matches!(last, Some("TCP" | "UDP" | "SCTP"))
        && before.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        && parts.next() == Some("PORT")
}

/// Refuses a `WARREN_*` variable that is no setting (a misspelling would otherwise be ignored),
/// naming the closest setting. Kubernetes' service links are not refused.
fn check_warren_env() -> Result<(), ConfigError> {
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix("WARREN_") else {
            continue;
        };
        if WARREN_NOT_SETTINGS.contains(&name)
            || WARREN_TOOL_PREFIXES.iter().any(|p| name.starts_with(p))
        {
            continue;
        }
        let key = rest.to_ascii_lowercase();
        if RULES.iter().any(|(k, _)| *k == key)
            || is_kubernetes_service_link(name, &value.to_string_lossy())
        {
            continue;
        }
        let closest = RULES
            .iter()
            .map(|(k, _)| *k)
            .min_by_key(|k| strsim::levenshtein(k, &key))
            .unwrap_or("");
        return Err(ConfigError::UnknownEnv {
            name: name.to_string(),
            closest: format!("WARREN_{}", closest.to_ascii_uppercase()),
        });
    }
    Ok(())
}

/// Where each setting's value comes from, for `warren config --origin`: `--set`/a flag, an
/// environment variable (named), the file (its path), or the built-in defaults.
pub fn origins(sources: &Sources) -> Result<BTreeMap<&'static str, String>, ConfigError> {
    let file_keys: Vec<String> = match &sources.file {
        Some(path) => std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.parse::<toml::Table>().ok())
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default(),
        None => Vec::new(),
    };
    Ok(RULES
        .iter()
        .map(|(key, _)| {
            let origin = if sources.overrides.contains_key(*key) {
                "command line (--set or a flag)".to_string()
            } else if let Some(name) = sources.use_env.then(|| env_name_of(key)).flatten() {
                format!("environment {name}")
            } else if file_keys.iter().any(|k| k == key) {
                format!(
                    "file {}",
                    sources
                        .file
                        .as_deref()
                        .map(Path::display)
                        .map(|d| d.to_string())
                        .unwrap_or_default()
                )
            } else {
                "default".to_string()
            };
            (*key, origin)
        })
        .collect())
}

/// The ENVIRONMENT section of `warren run --help` and the man pages, from the shipped defaults
/// file (each setting's comment and default): one entry per setting.
pub fn environment_help() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut comment: Vec<&str> = Vec::new();
    for line in DEFAULT_TOML.lines() {
        let line = line.trim();
        if let Some(text) = line.strip_prefix('#') {
            // A section's heading (`--- connections ---`) belongs to no setting.
            if !text.trim().starts_with("---") {
                comment.push(text.trim());
            }
            continue;
        }
        if let Some((key, value)) = line.split_once(" = ")
            && RULES.iter().any(|(k, _)| *k == key.trim())
        {
            let key = key.trim();
            let shown = if matches!(
                RULES.iter().find(|(k, _)| *k == key).map(|(_, r)| r),
                Some(Rule::Secret)
            ) {
                "(unset)".to_string()
            } else {
                redact_url(value.trim())
            };
            out.push((
                format!(
                    "{} (or WARREN_{})",
                    key.to_ascii_uppercase(),
                    key.to_ascii_uppercase()
                ),
                format!("{} Default: {shown}.", comment.join(" ")),
            ));
        }
        comment.clear();
    }
    out
}

impl Settings {
    /// Loads and validates the settings from `sources`.
    pub fn load(sources: &Sources) -> Result<Self, ConfigError> {
        if sources.use_env {
            check_warren_env()?;
        }
        let mut figment = Figment::from(Toml::string(default_settings_toml()));
        if let Some(path) = &sources.file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            check_file_keys(&text, path)?;
            figment = figment.merge(Toml::string(&text));
        }
        if sources.use_env {
            let keys: Vec<&str> = RULES.iter().map(|(k, _)| *k).collect();
            // `WARREN_<NAME>` wins over `<NAME>` (a shared environment may hold the bare name).
            figment = figment
                .merge(Env::raw().only(&keys))
                .merge(Env::prefixed("WARREN_").only(&keys));
        }
        let mut overrides: BTreeMap<String, Value> = sources
            .overrides
            .iter()
            .map(|(k, v)| {
                let secret = RULES
                    .iter()
                    .any(|(key, r)| key == k && matches!(r, Rule::Secret));
                let value = if secret {
                    Value::from(v.clone())
                } else {
                    parse_raw(v)
                };
                (k.clone(), value)
            })
            .collect();
        // A secret is text even when it looks like a number (the environment parser would
        // turn "123" into one).
        if sources.use_env {
            for (key, rule) in RULES {
                if matches!(rule, Rule::Secret)
                    && !overrides.contains_key(*key)
                    && let Some(raw) = env_name_of(key).and_then(|name| std::env::var(name).ok())
                {
                    overrides.insert(key.to_string(), Value::from(raw));
                }
            }
        }
        figment = figment.merge(Serialized::defaults(overrides));

        for (key, rule) in RULES {
            let value = figment
                .find_value(key)
                .map_err(|e| ConfigError::Other(e.to_string()))?;
            check(key, rule, &value)?;
        }
        let settings: Settings = figment
            .extract()
            .map_err(|e| ConfigError::Other(e.to_string()))?;
        settings.validate()?;
        Ok(settings)
    }

    /// Loads the shipped defaults only (no file, no environment), for unit tests; the shipped
    /// file is checked by `shipped_defaults_parse_and_match_the_documented_values`.
    #[cfg(test)]
    pub(crate) fn defaults() -> Self {
        let sources = Sources {
            use_env: false,
            ..Sources::default()
        };
        Self::load(&sources).expect("the shipped config/default.toml is valid")
    }

    /// Checks that span several settings.
    fn validate(&self) -> Result<(), ConfigError> {
        let tiers = self.retry_tiers();
        // With tiers, the tier queues take the retry queue's place (RETRY_QUEUE is their base).
        let retry_setting = if self.retry_ttls_ms.0.is_empty() {
            "retry_queue"
        } else {
            "retry_ttls_ms"
        };
        let mut names = vec![("main_queue", &self.main_queue)];
        names.extend(tiers.iter().map(|t| (retry_setting, &t.queue)));
        names.push(("dlq_queue", &self.dlq_queue));
        if let Some(t) = tiers.iter().find(|t| t.queue.len() > 255) {
            return Err(ConfigError::Invalid {
                setting: "RETRY_QUEUE".into(),
                expected: "a base name short enough for the retry tier queues' names (255 at most)"
                    .into(),
                got: format!("{:?}", t.queue),
            });
        }
        self.validate_consumer_timeout()?;
        self.validate_balance()?;
        for (i, (a, va)) in names.iter().enumerate() {
            for (b, vb) in names.iter().skip(i + 1) {
                if va == vb {
                    return Err(ConfigError::Invalid {
                        setting: b.to_ascii_uppercase(),
                        expected: format!("a queue name different from {}", a.to_ascii_uppercase()),
                        got: format!("{vb:?}"),
                    });
                }
            }
        }
        pipelines::check(self)
    }

    /// The retry tiers in order, at least one. Without `retry_ttls_ms`: `retry_queue` with
    /// `retry_ttl_ms`, as always. With it: one queue per TTL, named from the base of
    /// `retry_queue` (its name without a trailing TTL suffix such as `_10s`) and the TTL:
    /// `raffle_retry_10s` and `1000,10000,60000` give `raffle_retry_1s`, `raffle_retry_10s`,
    /// `raffle_retry_1m`.
    pub fn retry_tiers(&self) -> Vec<RetryTier> {
        if self.retry_ttls_ms.0.is_empty() {
            return vec![RetryTier {
                queue: self.retry_queue.clone(),
                ttl_ms: self.retry_ttl_ms,
            }];
        }
        let base = retry_base(&self.retry_queue);
        self.retry_ttls_ms
            .0
            .iter()
            .map(|&ttl_ms| RetryTier {
                queue: format!("{base}_{}", humanize_ms(ttl_ms)),
                ttl_ms,
            })
            .collect()
    }

    /// `AMQP_CONSUMER_TIMEOUT_MS` is 0 or at least a second, and a rate limit set at start
    /// cannot keep a full prefetch window waiting past it (the last of `prefetch` deliveries
    /// waits `prefetch / rate` seconds in the consumer, unacked).
    /// The users pipeline's bounds, and a set `max_inserts_in_flight` that holds what every
    /// pipeline always holds (a fixed one its batch concurrency, a balanced one its minimum).
    fn validate_balance(&self) -> Result<(), ConfigError> {
        if self.users_min_concurrency > self.users_max_concurrency {
            return Err(ConfigError::Invalid {
                setting: "USERS_MIN_CONCURRENCY".into(),
                expected: format!(
                    "at most USERS_MAX_CONCURRENCY ({})",
                    self.users_max_concurrency
                ),
                got: self.users_min_concurrency.to_string(),
            });
        }
        if self.users_balance == Balance::Auto
            && self.users_scale_down_threshold >= self.users_scale_up_threshold
        {
            return Err(ConfigError::Invalid {
                setting: "USERS_SCALE_DOWN_THRESHOLD".into(),
                expected: format!(
                    "below USERS_SCALE_UP_THRESHOLD ({}), or auto would step down and up \
                     again at every decision",
                    self.users_scale_up_threshold
                ),
                got: self.users_scale_down_threshold.to_string(),
            });
        }
        let held = self.held_inserts();
        if self.max_inserts_in_flight > 0 && self.max_inserts_in_flight < held {
            return Err(ConfigError::Invalid {
                setting: "MAX_INSERTS_IN_FLIGHT".into(),
                expected: format!(
                    "0 or at least the {held} batch inserts the pipelines always hold (each \
                     pipeline's batch concurrency, or its min_concurrency when balanced)"
                ),
                got: self.max_inserts_in_flight.to_string(),
            });
        }
        Ok(())
    }

    /// The batch inserts in flight this pipeline's view of the settings always holds: its batch
    /// concurrency when fixed, its minimum when balanced.
    pub fn held_concurrency(&self) -> usize {
        match self.users_balance {
            Balance::Off => self.users_batch_concurrency,
            _ => self.users_min_concurrency,
        }
    }

    /// The most batch inserts in flight this pipeline's view of the settings can have: the
    /// batchers its main stage has (balanced up to `max_concurrency`, or moved by an operator's
    /// bounds).
    pub fn most_concurrency(&self) -> usize {
        self.users_batch_concurrency.max(self.users_max_concurrency)
    }

    /// What every pipeline of the file, and the built-in users one unless the file replaces
    /// it, always holds.
    fn held_inserts(&self) -> usize {
        let users = if self.pipelines.iter().any(|p| p.name == "users") {
            0
        } else {
            self.held_concurrency()
        };
        users
            + self
                .pipelines
                .iter()
                .map(|p| p.view(self).held_concurrency())
                .sum::<usize>()
    }

    /// The process-wide budget of batch inserts in flight: `max_inserts_in_flight`, or
    /// `database_pool_size` when 0 (never below what the pipelines always hold).
    pub fn inserts_budget(&self) -> usize {
        match self.max_inserts_in_flight {
            0 => self.database_pool_size.max(self.held_inserts()),
            n => n,
        }
    }

    fn validate_consumer_timeout(&self) -> Result<(), ConfigError> {
        let timeout = self.amqp_consumer_timeout_ms;
        if timeout > 0 && timeout < 1000 {
            return Err(ConfigError::Invalid {
                setting: "AMQP_CONSUMER_TIMEOUT_MS".into(),
                expected:
                    "0 (the broker has no consumer_timeout) or the broker's consumer_timeout, \
                    at least 1000 ms"
                        .into(),
                got: timeout.to_string(),
            });
        }
        if let Some(give_back) = self.window_outlasts_hand_back(self.rate_limit_per_s) {
            return Err(ConfigError::Invalid {
                setting: "RATE_LIMIT_PER_S".into(),
                expected: format!(
                    "a rate at which one prefetch window ({} deliveries) is handed on within \
                         {} ms (80% of AMQP_CONSUMER_TIMEOUT_MS): raise the rate, lower PREFETCH, \
                         or set AMQP_CONSUMER_TIMEOUT_MS to the broker's larger consumer_timeout",
                    self.effective_prefetch(),
                    give_back.as_millis()
                ),
                got: self.rate_limit_per_s.to_string(),
            });
        }
        Ok(())
    }

    /// How long warren may hold a delivery unacked before it gives it back (nack with requeue):
    /// see [`hand_back_after`]; `None` when the broker has no consumer timeout.
    pub fn hand_back_after(&self) -> Option<Duration> {
        hand_back_after(self.amqp_consumer_timeout_ms)
    }

    /// At `per_s` messages a second (0 = no limit), whether the last delivery of a full prefetch
    /// window would wait in the rate limiter as long as the hand-back time or longer (the broker
    /// may then close the channel over it); that time if so. Checked at start (an error) and on
    /// `warren ctl rate` (a warning).
    pub fn window_outlasts_hand_back(&self, per_s: u32) -> Option<Duration> {
        window_outlasts(self.effective_prefetch(), per_s, self.hand_back_after())
    }

    /// The prefetch actually used: the setting, or two batches per batcher (batch size x batch
    /// concurrency x 2): each batcher fills its next batch while its sink inserts the last, so
    /// the broker keeps delivering while every sink is busy. (With one batch per batcher the
    /// window closed whenever all of them were inserting, and the broker waited for a commit and
    /// its ack: measured with the broker on a core of its own, 0.82-0.89 of the raw drain
    /// against 0.88-0.98 with the larger window; docs/performance.md, "What the measurements
    /// taught".)
    pub fn effective_prefetch(&self) -> u16 {
        let counted = if self.prefetch > 0 {
            self.prefetch.min(u16::MAX as u32) as u16
        } else {
            let derived = self
                .users_batch_size
                .saturating_mul(self.users_batch_concurrency)
                .saturating_mul(2);
            derived.clamp(1, u16::MAX as usize) as u16
        };
        counted.min(self.window_of_largest_bodies())
    }

    /// How many bodies of the largest accepted size (`MAX_MESSAGE_BYTES`) the byte budget
    /// (`MAX_INFLIGHT_BYTES`) holds: the prefetch window never exceeds it, so the accepted
    /// bodies in flight never exceed the budget.
    pub fn window_of_largest_bodies(&self) -> u16 {
        let fits = self.max_inflight_bytes / (self.max_message_bytes as u64).max(1);
        fits.clamp(1, u16::MAX as u64) as u16
    }

    /// Whether `role` is among the configured roles.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(role)
    }

    pub fn batch_timeout(&self) -> Duration {
        Duration::from_millis(self.users_batch_timeout_ms)
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }

    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.amqp_connect_timeout_ms)
    }

    /// The broker nodes of `amqp_url`, in the order given (validation made sure there is at
    /// least one and none is empty).
    pub fn amqp_urls(&self) -> Vec<&str> {
        list_entries(&self.amqp_url)
            .filter(|u| !u.is_empty())
            .collect()
    }

    /// The settings as TOML with passwords in URLs replaced by `***`.
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.amqp_url = redact_url(&shown.amqp_url);
        shown.database_url = redact_url(&shown.database_url);
        shown.redis_url = redact_url(&shown.redis_url);
        if !shown.control_secret.is_empty() {
            shown.control_secret = "***".into();
        }
        // The pipelines in effect: the built-in users one first, unless a file's replaces it.
        if !shown.pipelines.iter().any(|p| p.name == "users")
            && let Ok(users) = pipelines::users()
        {
            shown.pipelines.insert(0, users);
        }
        toml::to_string(&shown).unwrap_or_else(|e| format!("# cannot render settings: {e}\n"))
    }
}

/// Replaces every secret in a URL setting with `***`: the password of the user info (everything
/// between the first `:` and the last `@` of the part after `scheme://`), the value of every
/// query parameter whose name says it holds a secret (`password`, `sslpassword`, `pass`, `pwd`,
/// `secret`, `token`, ... in any case), in every entry of a comma-separated list (`AMQP_URL`)
/// and in the one user info of a URL with several hosts (`postgres://u:p@h1:5432,h2:5432/db`);
/// and in a PostgreSQL key/value string (`host=h password=p`), the value of such keys. It works
/// on the text, not through a URL parser, so a URL no parser accepts is redacted all the same;
/// where it cannot tell (an `@` in a path or a query, a `?` or `#` in a password), it hides more
/// rather than less.
pub fn redact_url(raw: &str) -> String {
    let schemes: Vec<usize> = raw.match_indices("://").map(|(i, _)| i).collect();
    if schemes.is_empty() {
        return redact_keywords(raw);
    }
    // Each entry of a list starts after the last separator before its `://`; without one, the
    // `://` is inside the previous entry (a query value, say) and starts nothing.
    let mut starts = vec![0];
    for pair in schemes.windows(2) {
        let between = &raw[pair[0] + 3..pair[1]];
        if let Some(sep) = between.rfind([',', ' ', ';']) {
            starts.push(pair[0] + 3 + sep + 1);
        }
    }
    starts.push(raw.len());
    starts
        .windows(2)
        .map(|w| redact_entry(&raw[w[0]..w[1]]))
        .collect()
}

/// One URL of a list (with the separator that follows it, if any), redacted.
fn redact_entry(entry: &str) -> String {
    let body = entry.trim_end_matches([',', ' ', ';']);
    let separators = &entry[body.len()..];
    let Some(sep) = body.find("://") else {
        return redact_keywords(entry);
    };
    let (head, rest) = body.split_at(sep + 3);
    let mut out = String::from(head);
    let after_userinfo = match rest.rfind('@') {
        Some(at) => {
            match rest[..at].find(':') {
                Some(colon) => {
                    out.push_str(&rest[..=colon]);
                    out.push_str("***");
                }
                None => out.push_str(&rest[..at]),
            }
            &rest[at..]
        }
        None => rest,
    };
    match after_userinfo.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let (params, fragment) = match query.find('#') {
                Some(hash) => query.split_at(hash),
                None => (query, ""),
            };
            let shown: Vec<String> = params
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if is_secret_key(key) => format!("{key}=***"),
                    _ => param.to_string(),
                })
                .collect();
            out.push_str(&shown.join("&"));
            out.push_str(fragment);
        }
        None => out.push_str(after_userinfo),
    }
    out.push_str(separators);
    out
}

/// Whether a query parameter or connection keyword names a secret.
fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// A PostgreSQL key/value connection string (`host=h password='a b'`) with the value of every
/// secret keyword replaced by `***`; any other text comes back as it was.
fn redact_keywords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let (before, after) = rest.split_at(eq);
        out.push_str(before);
        out.push('=');
        let after = &after[1..];
        let key = before
            .trim_end()
            .rsplit(|c: char| c.is_whitespace())
            .next()
            .unwrap_or("");
        if !is_secret_key(key) {
            rest = after;
            continue;
        }
        let value = after.trim_start();
        out.push_str(&after[..after.len() - value.len()]);
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            // A quoted value ends at the first quote not escaped by a backslash.
            let mut escaped = false;
            let close = quoted.char_indices().find(|&(_, c)| {
                let closes = c == '\'' && !escaped;
                escaped = c == '\\' && !escaped;
                closes
            });
            close.map_or(value.len(), |(i, _)| i + 2)
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        out.push_str("***");
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// At `per_s` messages a second (0 = no limit), whether the last delivery of a window of
/// `prefetch` would wait in the rate limiter as long as `give_back` (the hand-back time) or
/// longer; that time if so (see [`Settings::window_outlasts_hand_back`]).
pub fn window_outlasts(prefetch: u16, per_s: u32, give_back: Option<Duration>) -> Option<Duration> {
    let give_back = give_back?;
    let window = Duration::from_secs(u64::from(prefetch)) / per_s.max(1);
    (per_s > 0 && window >= give_back).then_some(give_back)
}

/// A listen address (`HTTP_ADDR`, `METRICS_ADDR`): `ip:port`, or `host:port` resolved now (the
/// first address it resolves to).
pub fn listen_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    use std::net::ToSocketAddrs as _;
    text.to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or_else(|| format!("{text} resolves to no address"))
}

/// The entries of a comma-separated list, trimmed, in order (empty ones included, so that
/// validation can name them).
pub fn list_entries(raw: &str) -> impl Iterator<Item = &str> {
    raw.split(',').map(str::trim)
}

/// Parses a raw string the way environment variables are parsed (numbers become numbers).
fn parse_raw(raw: &str) -> Value {
    raw.parse::<Value>()
        .unwrap_or_else(|_| Value::from(raw.to_string()))
}

/// Rejects keys in a user's file that warren does not know, naming the key and the file.
fn check_file_keys(text: &str, path: &Path) -> Result<(), ConfigError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    for key in table.keys() {
        if key != "pipelines" && !RULES.iter().any(|(k, _)| k == key) {
            return Err(ConfigError::Unknown {
                key: key.clone(),
                source_name: path.display().to_string(),
            });
        }
    }
    Ok(())
}

/// One entry of `AMQP_URL`: a URL of scheme amqp or amqps with a host, which the AMQP client
/// accepts too (it has its own parser, for query options such as heartbeat: a URL it refuses
/// must stop warren now, not loop in a reconnect). The error says what was expected.
fn check_amqp_url(entry: &str) -> Result<(), String> {
    match url::Url::parse(entry) {
        Ok(u) if ["amqp", "amqps"].contains(&u.scheme()) && u.host_str().is_some() => {}
        _ => return Err("a URL starting with amqp:// or amqps://".into()),
    }
    entry
        .parse::<lapin::uri::AMQPUri>()
        .map(|_| ())
        .map_err(|e| format!("an AMQP URL the client accepts ({})", redact_url(&e)))
}

/// How a value is shown in an error: strings quoted, numbers bare.
fn show(value: &Value) -> String {
    match value {
        Value::String(_, s) => format!("{s:?}"),
        Value::Num(_, n) => match (n.to_u128(), n.to_i128(), n.to_f64()) {
            (Some(u), _, _) => u.to_string(),
            (_, Some(i), _) => i.to_string(),
            (_, _, Some(f)) => f.to_string(),
            _ => format!("{n:?}"),
        },
        Value::Bool(_, b) => b.to_string(),
        Value::Char(_, c) => format!("{c:?}"),
        Value::Empty(_, _) => "nothing".into(),
        Value::Dict(_, _) => "a table".into(),
        Value::Array(_, _) => "a list".into(),
    }
}

fn check(key: &str, rule: &Rule, value: &Value) -> Result<(), ConfigError> {
    let invalid = |expected: String| ConfigError::Invalid {
        setting: key.to_ascii_uppercase(),
        expected,
        got: match (rule, value) {
            (Rule::Url(_) | Rule::AmqpUrls | Rule::PgUrl, Value::String(_, s)) => {
                format!("{:?}", redact_url(s))
            }
            _ => show(value),
        },
    };
    match rule {
        Rule::Int { min, max } => {
            let ok = match value {
                Value::Num(_, n) => n
                    .to_u128_lossy()
                    .is_some_and(|v| v >= *min as u128 && v <= *max as u128),
                _ => false,
            };
            if !ok {
                return Err(invalid(format!("an integer from {min} to {max}")));
            }
        }
        Rule::Url(schemes) => {
            let expected = || format!("a URL starting with {}://", schemes.join(":// or "));
            let Value::String(_, s) = value else {
                return Err(invalid(expected()));
            };
            match url::Url::parse(s) {
                Ok(u) if schemes.contains(&u.scheme()) && u.host_str().is_some() => {}
                _ => return Err(invalid(expected())),
            }
        }
        Rule::AmqpUrls => {
            let Value::String(_, s) = value else {
                return Err(invalid(
                    "a URL starting with amqp:// or amqps:// (or several, separated by commas)"
                        .into(),
                ));
            };
            let entries: Vec<&str> = list_entries(s).collect();
            for (i, entry) in entries.iter().enumerate() {
                let Err(problem) = check_amqp_url(entry) else {
                    continue;
                };
                // One URL: the error reads as before; in a list it names the entry.
                return Err(if entries.len() == 1 {
                    invalid(problem)
                } else {
                    ConfigError::Invalid {
                        setting: format!(
                            "{} (entry {} of {})",
                            key.to_ascii_uppercase(),
                            i + 1,
                            entries.len()
                        ),
                        expected: problem,
                        got: format!("{:?}", redact_url(entry)),
                    }
                });
            }
        }
        Rule::PgUrl => {
            let expected = |problem: String| {
                invalid(format!(
                    "a URL starting with postgres:// or postgresql://{problem} (one host, or \
                     several: postgres://user:password@host1:5432,host2:5432/db)"
                ))
            };
            let Value::String(_, s) = value else {
                return Err(expected(String::new()));
            };
            let lower = s.to_ascii_lowercase();
            if !lower.starts_with("postgres://") && !lower.starts_with("postgresql://") {
                return Err(expected(String::new()));
            }
            match s.parse::<tokio_postgres::Config>() {
                Ok(c) if !c.get_hosts().is_empty() => {}
                Ok(_) => return Err(expected(" naming a host".into())),
                Err(e) => {
                    return Err(expected(format!(
                        " that the PostgreSQL client accepts ({})",
                        redact_url(&e.to_string())
                    )));
                }
            }
        }
        Rule::Bool => {
            if !matches!(value, Value::Bool(..)) {
                return Err(invalid("true or false".into()));
            }
        }
        Rule::Addr => {
            let ok = matches!(value, Value::String(_, s) if listen_addr(s).is_ok());
            if !ok {
                return Err(invalid(
                    "an address host:port such as 127.0.0.1:8080 or localhost:8080 (a host name \
                     must resolve)"
                        .into(),
                ));
            }
        }
        Rule::Name => {
            let ok = matches!(value, Value::String(_, s)
                if !s.is_empty() && s.len() <= 255 && !s.starts_with("amq.") && !s.chars().any(char::is_control));
            if !ok {
                return Err(invalid(
                    "a name of 1 to 255 characters, not starting with \"amq.\"".into(),
                ));
            }
        }
        Rule::Ident => {
            let ok = matches!(value, Value::String(_, s)
                if !s.is_empty() && s.len() <= 63
                    && s.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
                    && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
            if !ok {
                return Err(invalid(
                    "an SQL identifier: lower-case letters, digits and _, at most 63".into(),
                ));
            }
        }
        Rule::Roles => {
            if !matches!(value, Value::String(_, s) if Roles::parse(s).is_ok()) {
                return Err(invalid(format!(
                    "a comma-separated subset of {}",
                    Roles::known()
                )));
            }
        }
        Rule::Secret => {
            if !matches!(value, Value::String(..)) {
                return Err(ConfigError::Invalid {
                    setting: key.to_ascii_uppercase(),
                    expected: "a string".into(),
                    got: "a value of another type (not shown)".into(),
                });
            }
        }
        Rule::TtlList => {
            let parsed = match value {
                Value::String(_, s) => RetryTtls::parse(s),
                Value::Num(_, n) => n
                    .to_u128_lossy()
                    .and_then(|v| u64::try_from(v).ok())
                    .ok_or_else(|| "not a TTL".to_string())
                    .and_then(|v| RetryTtls::checked(vec![v])),
                Value::Array(_, items) => items
                    .iter()
                    .map(|item| match item {
                        Value::Num(_, n) => n.to_u128_lossy().and_then(|v| u64::try_from(v).ok()),
                        _ => None,
                    })
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| "not a list of integers".to_string())
                    .and_then(RetryTtls::checked),
                _ => Err("not a list".into()),
            };
            if parsed.is_err() {
                let (min, max) = RETRY_TTL_RANGE;
                return Err(invalid(format!(
                    "a comma-separated list of at most {MAX_RETRY_TIERS} increasing TTLs in ms, \
                     each from {min} to {max} (empty = RETRY_TTL_MS alone)"
                )));
            }
        }
        Rule::OneOf(choices) => {
            let ok = matches!(value, Value::String(_, s) if choices.contains(&s.as_str()));
            if !ok {
                return Err(invalid(format!("one of {}", choices.join(", "))));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let mut sources = Sources {
            use_env: false,
            ..Sources::default()
        };
        for (k, v) in pairs {
            sources = sources.with_override(k, *v);
        }
        Settings::load(&sources)
    }

    #[test]
    fn kubernetes_service_links_are_told_from_misspelled_settings() {
        for (name, value) in [
            ("WARREN_SERVICE_HOST", "10.96.0.12"),
            ("WARREN_SERVICE_PORT", "9898"),
            ("WARREN_SERVICE_PORT_METRICS", "9898"),
            ("WARREN_PORT", "tcp://10.96.0.12:9898"),
            ("WARREN_PORT_9898_TCP", "tcp://10.96.0.12:9898"),
            ("WARREN_PORT_9898_TCP_PROTO", "tcp"),
            ("WARREN_PORT_9898_TCP_PORT", "9898"),
            ("WARREN_PORT_9898_TCP_ADDR", "10.96.0.12"),
            ("WARREN_API_PORT_8080_UDP_ADDR", "10.96.0.13"),
            ("WARREN_API_PORT", "udp://10.96.0.13:8080"),
        ] {
            assert!(is_kubernetes_service_link(name, value), "{name}={value}");
        }
        for (name, value) in [
            ("WARREN_METRICS_PORT", "9898"),
            ("WARREN_PORT", "9898"),
            ("WARREN_PORT_X_TCP", "1"),
            ("WARREN_PORT_9898_HTTP", "1"),
            ("WARREN_9898_TCP_ADDR", "1"),
            ("WARREN_USER_BATCH_SIZE", "10"),
        ] {
            assert!(!is_kubernetes_service_link(name, value), "{name}={value}");
        }
    }

    #[test]
    fn balancing_settings_that_cannot_work_are_refused_naming_the_setting() {
        let refused = |pairs: &[(&str, &str)], setting: &str| match with(pairs) {
            Err(ConfigError::Invalid { setting: s, .. }) => assert_eq!(s, setting, "{pairs:?}"),
            other => panic!("{pairs:?}: {other:?}"),
        };
        refused(
            &[
                ("users_min_concurrency", "5"),
                ("users_max_concurrency", "4"),
            ],
            "USERS_MIN_CONCURRENCY",
        );
        refused(
            &[
                ("users_balance", "auto"),
                ("users_scale_up_threshold", "100"),
            ],
            "USERS_SCALE_DOWN_THRESHOLD",
        );
        refused(&[("max_inserts_in_flight", "1")], "MAX_INSERTS_IN_FLIGHT");
        // simple ignores auto's thresholds; a budget of what is held is enough.
        assert!(
            with(&[
                ("users_balance", "simple"),
                ("users_scale_up_threshold", "100")
            ])
            .is_ok()
        );
        let s = with(&[("max_inserts_in_flight", "2")]).unwrap();
        assert_eq!(s.inserts_budget(), 2);
        let s = with(&[
            ("users_batch_concurrency", "12"),
            ("database_pool_size", "4"),
        ])
        .unwrap();
        assert_eq!(
            s.inserts_budget(),
            12,
            "0: the pool size, or what is held if more"
        );
    }

    #[test]
    fn shipped_defaults_parse_and_match_the_documented_values() {
        let s = Settings::defaults();
        assert_eq!(s.retry_ttl_ms, 10_000);
        assert_eq!(s.max_retries, 3);
        assert_eq!(s.users_batch_size, 1000);
        assert_eq!(s.users_batch_timeout_ms, 1000);
        assert_eq!(s.users_proc_concurrency, 1);
        assert_eq!(s.users_batch_concurrency, 2);
        assert_eq!(s.amqp_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
        assert_eq!(
            s.database_url,
            "postgres://warren:warren@127.0.0.1:5432/warren"
        );
        assert_eq!(s.redis_url, "redis://127.0.0.1:6379");
        assert_eq!(s.http_addr, "127.0.0.1:8080");
        assert_eq!(s.metrics_addr, "127.0.0.1:9898");
        assert_eq!(s.shutdown_timeout_ms, 20_000);
        assert_eq!(s.effective_prefetch(), 4000);
    }

    #[test]
    fn every_rule_has_a_key_in_the_shipped_file_and_back() {
        let table: toml::Table = default_settings_toml().parse().unwrap();
        for (key, _) in RULES {
            assert!(table.contains_key(*key), "{key} missing from default.toml");
        }
        assert_eq!(table.len(), RULES.len());
        // Beyond the settings, the file declares the users pipeline, and nothing else.
        let whole: toml::Table = DEFAULT_TOML.parse().unwrap();
        assert_eq!(whole.len(), RULES.len() + 1);
        assert!(whole["pipelines"].is_array());
    }

    #[test]
    fn a_non_integer_names_setting_range_and_value() {
        let err = with(&[("users_batch_size", "abc")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "USERS_BATCH_SIZE: expected an integer from 1 to 10000, got \"abc\""
        );
    }

    #[test]
    fn out_of_range_and_negative_are_refused() {
        let err = with(&[("users_batch_size", "0")]).unwrap_err();
        assert!(err.to_string().contains("got 0"), "{err}");
        let err = with(&[("max_retries", "-1")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("MAX_RETRIES: expected an integer from 0 to 100"),
            "{err}"
        );
    }

    #[test]
    fn urls_addresses_and_roles_are_checked() {
        let err = with(&[("amqp_url", "http://x")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("AMQP_URL: expected a URL starting with amqp://"),
            "{err}"
        );
        let err = with(&[("http_addr", "localhost")]).unwrap_err();
        assert!(err.to_string().starts_with("HTTP_ADDR:"), "{err}");
        let err = with(&[("roles", "consumer,web")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("ROLES: expected a comma-separated subset"),
            "{err}"
        );
        assert!(
            with(&[("roles", "consumer, api")])
                .unwrap()
                .has_role(Role::Api)
        );
    }

    #[test]
    fn roles_and_log_format_are_closed_sets() {
        let s = with(&[("roles", " api ,consumer,api"), ("log_format", "json")]).unwrap();
        assert_eq!(s.roles.to_string(), "api,consumer");
        assert!(s.has_role(Role::Consumer) && !s.has_role(Role::Dlq));
        assert_eq!(s.log_format, LogFormat::Json);
        for bad in ["", "consumer,", "Consumer"] {
            let err = with(&[("roles", bad)]).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "ROLES: expected a comma-separated subset of consumer,dlq,api, got {:?}",
                    bad
                ),
            );
        }
        let err = with(&[("log_format", "yaml")]).unwrap_err().to_string();
        assert!(
            err.starts_with("LOG_FORMAT: expected one of text, json"),
            "{err}"
        );
        assert_eq!(Settings::defaults().roles.to_string(), "consumer,dlq,api");
    }

    #[test]
    fn consumer_timeout_gives_deliveries_back_at_80_percent() {
        assert_eq!(hand_back_after(0), None);
        assert_eq!(
            hand_back_after(1_800_000),
            Some(Duration::from_secs(24 * 60))
        );
        assert_eq!(hand_back_after(5000), Some(Duration::from_secs(4)));
        let s = with(&[]).unwrap();
        assert_eq!(s.hand_back_after(), Some(Duration::from_secs(24 * 60)));
        let e = with(&[("amqp_consumer_timeout_ms", "500")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("AMQP_CONSUMER_TIMEOUT_MS"), "{e}");
        assert!(e.contains("at least 1000 ms"), "{e}");
        assert!(with(&[("amqp_consumer_timeout_ms", "0")]).is_ok());
        // A window of 4000 deliveries at 1 per second waits 4000 s, past 80% of 30 minutes.
        let e = with(&[("rate_limit_per_s", "1")]).unwrap_err().to_string();
        assert!(e.contains("RATE_LIMIT_PER_S"), "{e}");
        assert!(e.contains("4000 deliveries"), "{e}");
        assert!(with(&[("rate_limit_per_s", "1"), ("prefetch", "100")]).is_ok());
        assert!(with(&[("rate_limit_per_s", "1"), ("amqp_consumer_timeout_ms", "0")]).is_ok());
        // The same rule for a live rate (`warren ctl rate`): 3 per second passes the window in
        // 1333 s, within 1440 s; 2 per second does not; 0 is no limit.
        let give_back = Some(Duration::from_secs(24 * 60));
        assert_eq!(s.window_outlasts_hand_back(2), give_back);
        assert_eq!(s.window_outlasts_hand_back(3), None);
        assert_eq!(s.window_outlasts_hand_back(0), None);
    }

    #[test]
    fn overrides_win_and_prefetch_is_derived_or_capped() {
        let s = with(&[
            ("users_batch_size", "100"),
            ("users_batch_concurrency", "3"),
        ])
        .unwrap();
        assert_eq!(s.effective_prefetch(), 600);
        let s = with(&[
            ("users_batch_size", "10000"),
            ("users_batch_concurrency", "64"),
            ("max_inflight_bytes", "17179869184"),
        ])
        .unwrap();
        assert_eq!(s.effective_prefetch(), 65535);
        let s = with(&[("prefetch", "50")]).unwrap();
        assert_eq!(s.effective_prefetch(), 50);
        // The byte budget holds 4096 bodies of the largest accepted size by default: the window
        // never exceeds it.
        let s = with(&[("users_batch_concurrency", "8")]).unwrap();
        assert_eq!(s.window_of_largest_bodies(), 4096);
        assert_eq!(s.effective_prefetch(), 4096);
        let s = with(&[
            ("max_message_bytes", "16777216"),
            ("max_inflight_bytes", "33554432"),
        ])
        .unwrap();
        assert_eq!(s.effective_prefetch(), 2);
    }

    #[test]
    fn unknown_set_flags_and_file_keys_are_named() {
        let err = Sources::default()
            .with_set_flags(&["nope=1".into()])
            .unwrap_err();
        assert!(err.to_string().contains("`nope`"), "{err}");
        let err = Sources::default()
            .with_set_flags(&["nope".into()])
            .unwrap_err();
        assert!(err.to_string().contains("KEY=VALUE"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(&path, "users_batch_size = 10\nbogus = 1\n").unwrap();
        let err = Settings::load(&Sources {
            file: Some(path),
            use_env: false,
            ..Sources::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("`bogus`"), "{err}");
    }

    #[test]
    fn a_config_file_layers_over_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(&path, "users_batch_size = 10\n").unwrap();
        let s = Settings::load(&Sources {
            file: Some(path),
            use_env: false,
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(s.users_batch_size, 10);
        assert_eq!(s.max_retries, 3);
    }

    #[test]
    fn urls_are_checked_by_the_amqp_parser_and_redacted_in_errors() {
        let err = with(&[("amqp_url", "amqp://u:s3cret@h:5672/%2f?heartbeat=10s")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("AMQP_URL: expected an AMQP URL the client accepts"),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "{text}");
        let err = with(&[("database_url", "http://u:s3cret@h/db")]).unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[test]
    fn amqp_url_takes_a_list_and_names_the_bad_entry_without_its_password() {
        let list = "amqp://u:p1@h1:5681/%2f, amqp://u:p2@h2:5682/%2f,amqp://u:p3@h3:5683/%2f";
        let s = with(&[("amqp_url", list)]).unwrap();
        assert_eq!(
            s.amqp_urls(),
            [
                "amqp://u:p1@h1:5681/%2f",
                "amqp://u:p2@h2:5682/%2f",
                "amqp://u:p3@h3:5683/%2f"
            ]
        );
        assert!(!s.amqp_shuffle);

        let bad = "amqp://u:p1@h1:5681/%2f,http://u:s3cret@h2:5682/%2f,amqp://u:p3@h3/%2f";
        let text = with(&[("amqp_url", bad)]).unwrap_err().to_string();
        assert_eq!(
            text,
            "AMQP_URL (entry 2 of 3): expected a URL starting with amqp:// or amqps://, \
             got \"http://u:***@h2:5682/%2f\"",
        );
        let bad = "amqp://u:p1@h1:5681/%2f,amqp://u:s3cret@h2:5682/%2f?heartbeat=x";
        let text = with(&[("amqp_url", bad)]).unwrap_err().to_string();
        assert!(
            text.starts_with("AMQP_URL (entry 2 of 2): expected an AMQP URL the client accepts"),
            "{text}"
        );
        assert!(!text.contains("s3cret") && !text.contains("p1"), "{text}");
        // An empty entry (a trailing comma) is named too.
        let text = with(&[("amqp_url", "amqp://h1/%2f,")])
            .unwrap_err()
            .to_string();
        assert!(
            text.starts_with("AMQP_URL (entry 2 of 2): expected a URL"),
            "{text}"
        );
    }

    #[test]
    fn amqp_shuffle_is_a_boolean() {
        assert!(with(&[("amqp_shuffle", "true")]).unwrap().amqp_shuffle);
        assert!(!with(&[("amqp_shuffle", "false")]).unwrap().amqp_shuffle);
        let text = with(&[("amqp_shuffle", "yes")]).unwrap_err().to_string();
        assert_eq!(text, "AMQP_SHUFFLE: expected true or false, got \"yes\"");
    }

    #[test]
    fn database_url_takes_several_hosts_and_the_client_reads_them_all() {
        let url = "postgres://u:s3cret@127.0.0.1:1,127.0.0.1:5432/warren\
                   ?target_session_attrs=read-write";
        let s = with(&[("database_url", url)]).unwrap();
        let config = s.database().pg_config().unwrap();
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(config.get_ports(), [1, 5432]);
        assert_eq!(
            config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            redact_url(url),
            "postgres://u:***@127.0.0.1:1,127.0.0.1:5432/warren?target_session_attrs=read-write"
        );
        assert!(
            !s.to_redacted_toml().contains("s3cret"),
            "{}",
            s.to_redacted_toml()
        );
        for bad in [
            "postgres://u:s3cret@h1:5432,h2:x/db",
            "postgres:///db",
            "mysql://u:s3cret@h/db",
        ] {
            let text = with(&[("database_url", bad)]).unwrap_err().to_string();
            assert!(
                text.starts_with("DATABASE_URL: expected a URL starting with postgres://"),
                "{text}"
            );
            assert!(!text.contains("s3cret"), "{text}");
        }
    }

    #[test]
    fn redaction_covers_lists_multi_host_urls_and_what_no_parser_accepts() {
        let cases = [
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "amqp://a:p1@h1:5681/%2f,amqp://h2:5682/%2f,amqps://c:p3@h3/v?heartbeat=5",
                "amqp://a:***@h1:5681/%2f,amqp://h2:5682/%2f,amqps://c:***@h3/v?heartbeat=5",
            ),
            ("redis://:s3cret@h:6379", "redis://:***@h:6379"),
            ("redis://h:6379", "redis://h:6379"),
            // a password with characters a URL parser refuses
            ("postgres://u:p,@w@h1,h2/db", "postgres://u:***@h1,h2/db"),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("not a url", "not a url"),
            // a password with the characters that end an authority (tokio-postgres accepts it)
            (
                "postgres://warren:Sup3r?Secret@h/db",
                "postgres://warren:***@h/db",
            ),
            ("postgres://u:a#b/c@h:5432/db", "postgres://u:***@h:5432/db"),
            ("amqp://u:p@ss@h/%2f", "amqp://u:***@h/%2f"),
            // secrets in query strings, in every entry of a list
            (
                "postgres://postgres@127.0.0.1:5432/db?password=s3cret",
                "postgres://postgres@127.0.0.1:5432/db?password=***",
            ),
            (
                "postgres://h/db?sslmode=require&SSLPassword=s3cret&application_name=w#frag",
                "postgres://h/db?sslmode=require&SSLPassword=***&application_name=w#frag",
            ),
            (
                "amqp://h1/%2f?auth_token=s3cret,amqps://u:s3cret@h2/v?heartbeat=5",
                "amqp://h1/%2f?auth_token=***,amqps://u:***@h2/v?heartbeat=5",
            ),
            (
                "amqp://h1/%2f?password=s3cret, amqp://h2/%2f",
                "amqp://h1/%2f?password=***, amqp://h2/%2f",
            ),
            // a PostgreSQL key/value string
            (
                "host=h user=u password=s3cret dbname=d",
                "host=h user=u password=*** dbname=d",
            ),
            (
                "host=h password = 'a \\' b' dbname=d",
                "host=h password = *** dbname=d",
            ),
        ];
        for (raw, shown) in cases {
            assert_eq!(redact_url(raw), shown, "{raw}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        let shown = Settings::defaults().to_redacted_toml();
        assert!(
            shown.contains("amqp://guest:***@127.0.0.1:5672/%2f"),
            "{shown}"
        );
        assert!(
            shown.contains("postgres://warren:***@127.0.0.1:5432/warren"),
            "{shown}"
        );
        assert!(!shown.contains(":guest@"));
    }

    #[test]
    fn identical_queue_names_are_refused() {
        let err = with(&[("dlq_queue", "raffle_queue")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("DLQ_QUEUE: expected a queue name different from MAIN_QUEUE"),
            "{err}"
        );
    }

    #[test]
    fn queue_type_is_classic_by_default_and_a_closed_set() {
        let s = Settings::defaults();
        assert_eq!(s.queue_type, QueueType::Classic);
        assert_eq!(s.delivery_limit, 20);
        assert_eq!(
            with(&[("queue_type", "quorum")]).unwrap().queue_type,
            QueueType::Quorum
        );
        let err = with(&[("queue_type", "stream")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "QUEUE_TYPE: expected one of classic, quorum, got \"stream\""
        );
        let err = with(&[("delivery_limit", "0")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "DELIVERY_LIMIT: expected an integer from 1 to 1000, got 0"
        );
    }

    #[test]
    fn without_retry_tiers_the_retry_queue_is_the_one_tier() {
        let s = Settings::defaults();
        assert_eq!(s.retry_ttls_ms, RetryTtls::default());
        assert_eq!(
            s.retry_tiers(),
            [RetryTier {
                queue: "raffle_retry_10s".into(),
                ttl_ms: 10_000
            }]
        );
    }

    #[test]
    fn retry_tiers_are_named_from_the_retry_queue_base() {
        let s = with(&[("retry_ttls_ms", "1000, 10000,60000")]).unwrap();
        let names: Vec<_> = s.retry_tiers().into_iter().map(|t| t.queue).collect();
        assert_eq!(
            names,
            ["raffle_retry_1s", "raffle_retry_10s", "raffle_retry_1m"]
        );
        assert_eq!(
            s.retry_tiers().iter().map(|t| t.ttl_ms).collect::<Vec<_>>(),
            [1000, 10_000, 60_000]
        );
        // A name without a TTL suffix is the base as it is.
        let s = with(&[("retry_queue", "q_retry"), ("retry_ttls_ms", "300,7200000")]).unwrap();
        let names: Vec<_> = s.retry_tiers().into_iter().map(|t| t.queue).collect();
        assert_eq!(names, ["q_retry_300ms", "q_retry_2h"]);
        // One number (as an environment variable holding one arrives) is one tier.
        let s = with(&[("retry_ttls_ms", "1500")]).unwrap();
        assert_eq!(s.retry_tiers()[0].queue, "raffle_retry_1500ms");
        // The settings survive the round trip through TOML (`warren config`, the topology).
        let s = with(&[("retry_ttls_ms", "1000,2000")]).unwrap();
        let shown = s.to_redacted_toml();
        assert!(shown.contains("retry_ttls_ms = \"1000,2000\""), "{shown}");
        assert!(shown.contains("queue_type = \"classic\""), "{shown}");
    }

    #[test]
    fn humanized_ttls_and_bases() {
        assert_eq!(humanize_ms(999), "999ms");
        assert_eq!(humanize_ms(1000), "1s");
        assert_eq!(humanize_ms(90_000), "90s");
        assert_eq!(humanize_ms(60_000), "1m");
        assert_eq!(humanize_ms(5_400_000), "90m");
        assert_eq!(humanize_ms(86_400_000), "24h");
        assert_eq!(retry_base("raffle_retry_10s"), "raffle_retry");
        assert_eq!(retry_base("raffle_retry_300ms"), "raffle_retry");
        assert_eq!(retry_base("raffle_retry_1h"), "raffle_retry");
        assert_eq!(retry_base("raffle_retry"), "raffle_retry");
        assert_eq!(retry_base("retry_x10s"), "retry_x10s");
        assert_eq!(retry_base("_10s"), "_10s");
        assert_eq!(retry_base("q_10d"), "q_10d");
    }

    #[test]
    fn bad_retry_tiers_name_the_setting() {
        for bad in [
            "1000,abc",
            "1000,1000",
            "10000,1000",
            "0",
            "1,86400001",
            "1,2,3,4,5,6,7,8,9,10,11",
            "-5",
        ] {
            let err = with(&[("retry_ttls_ms", bad)]).unwrap_err();
            assert!(
                err.to_string().starts_with(
                    "RETRY_TTLS_MS: expected a comma-separated list of at most 10 increasing TTLs in ms"
                ),
                "{bad}: {err}"
            );
        }
        let err = with(&[
            ("main_queue", "raffle_retry_1s"),
            ("retry_ttls_ms", "1000,2000"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("RETRY_TTLS_MS: expected a queue name different from MAIN_QUEUE"),
            "{err}"
        );
    }

    #[test]
    fn retry_tiers_from_a_file_may_be_a_toml_list() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "retry_ttls_ms = [500, 5000]\nqueue_type = \"quorum\"\n",
        )
        .unwrap();
        let s = Settings::load(&Sources {
            file: Some(path),
            use_env: false,
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(s.retry_ttls_ms, RetryTtls(vec![500, 5000]));
        assert_eq!(s.queue_type, QueueType::Quorum);
    }
}
