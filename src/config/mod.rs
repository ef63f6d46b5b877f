//! Typed settings: the layering (shipped defaults < `--config` file < environment < CLI flags)
//! and the validation whose errors name the setting, the value and what was expected.
//!
//! Its parts: this file declares every setting once (`settings!`) and loads and validates
//! [`Settings`]; `sources` says where values come from (the file, the environment, the command
//! line) and `warren config --origin`; `rules` what each setting accepts; `values` the typed
//! values (queue type, balance, roles, retry tiers); `error` the [`ConfigError`]s and where a
//! value was given ([`Origin`]); `diagnose` the file's lines and an error in warren's words
//! (where, which setting or pipeline field, what was expected, the closest valid name);
//! secrets are kept out of what is shown by `crate::redact` (re-exported here); [`pipelines`] the `[[pipelines]]` entries and
//! the one resolution step that turns each, with the defaults, into its checked
//! [`pipelines::PipelineSpec`] when the settings load ([`Settings::pipelines`]).

mod diagnose;
mod error;
pub mod pipelines;
mod rules;
mod sources;
mod values;

pub use crate::redact::redact_url;
pub use crate::text::closest;
use diagnose::FileText;
pub use error::{ConfigError, Origin};
#[cfg(test)]
pub use rules::sample_values;
use rules::{Rule, check, suggest};
pub use rules::{list_entries, listen_addr};
pub use sources::{FileNamedBy, Sources, environment_help, file_origin, origins};
use sources::{check_warren_env, env_name_of, parse_raw, setting_of_env};
pub use values::{
    Balance, LogFormat, MAX_RETRY_TIERS, QueueType, RetryTier, RetryTtls, Role, Roles, humanize_ms,
    retry_base,
};

use std::collections::BTreeMap;

use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::Value;
use serde::{Deserialize, Serialize};

/// The shipped `config/default.toml`, built into the binary so warren runs from any directory.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

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
            /// Every pipeline to run, resolved once by [`Settings::load`] ([`pipelines::resolve`]):
            /// what [`Settings::pipelines`] answers.
            #[serde(skip)]
            resolved: Vec<pipelines::PipelineSpec>,
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
    redis_prefix: String => Rule::KeyPrefix,
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
    /// dead-letters nowhere, would drop a message: refused on 4.x where the topology is declared,
    /// `topology::broker`). 1 to [`DLQ_DELIVERY_LIMIT_FLOOR`] - 1 are refused: an outage spends
    /// them.
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
    // Every pipeline's defaults: a `[[pipelines]]` entry's key of the same name wins over each.
    /// The largest batch: at this many messages waiting, a batch goes as soon as its sink is free.
    batch_size: usize => Rule::Int { min: 1, max: 10_000 },
    /// The longest a partial batch is held back for more messages (it caps `batch_min_wait_ms`).
    batch_timeout_ms: u64 => Rule::Int { min: 0, max: 600_000 },
    /// How long a partial batch is held for more messages before a free sink takes it (0: a free
    /// sink takes whatever waits, at once); at most `batch_timeout_ms`.
    batch_min_wait_ms: u64 => Rule::Int { min: 0, max: 600_000 },
    /// Processor actors: 1 decodes on the pipeline's own thread; more decode in parallel on
    /// threads of their own (at most one per core).
    proc_concurrency: usize => Rule::Int { min: 1, max: 256 },
    /// Batcher actors (batch inserts in flight at once).
    batch_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// How the batch inserts in flight follow the backlog: `off` (fixed at
    /// `batch_concurrency`), `simple` or `auto` (docs/balancing.md).
    balance: Balance => Rule::OneOf(BALANCES),
    /// Balanced: the fewest batch inserts in flight (where `auto` starts).
    min_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// Balanced: the most batch inserts in flight.
    max_concurrency: usize => Rule::Int { min: 1, max: 64 },
    /// Balanced: time between two decisions, so the concurrency never flaps.
    balance_cooldown_ms: u64 => Rule::Int { min: 100, max: 3_600_000 },
    /// `auto`: the most inserts in flight one decision adds or takes away.
    balance_max_shift: usize => Rule::Int { min: 1, max: 64 },
    /// `simple`: messages of backlog per insert in flight.
    scale_threshold: u64 => Rule::Int { min: 1, max: 100_000_000 },
    /// `auto`: a backlog above this many messages per insert in flight asks for more.
    scale_up_threshold: u64 => Rule::Int { min: 1, max: 100_000_000 },
    /// `auto`: a backlog that stays below this many messages per insert in flight gives back.
    scale_down_threshold: u64 => Rule::Int { min: 0, max: 100_000_000 },
    // The users pipeline's own: each, when set, wins over the default of the same name for the
    // pipeline named users alone (its entry's own key still wins); empty = the default applies.
    /// The users pipeline's own `batch_size`.
    #[serde(with = "values::unset")]
    users_batch_size: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 10_000 }),
    /// The users pipeline's own `batch_timeout_ms`.
    #[serde(with = "values::unset")]
    users_batch_timeout_ms: Option<u64> => Rule::OrEmpty(&Rule::Int { min: 0, max: 600_000 }),
    /// The users pipeline's own `batch_min_wait_ms`.
    #[serde(with = "values::unset")]
    users_batch_min_wait_ms: Option<u64> => Rule::OrEmpty(&Rule::Int { min: 0, max: 600_000 }),
    /// The users pipeline's own `proc_concurrency`.
    #[serde(with = "values::unset")]
    users_proc_concurrency: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 256 }),
    /// The users pipeline's own `batch_concurrency`.
    #[serde(with = "values::unset")]
    users_batch_concurrency: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 64 }),
    /// The users pipeline's own `balance`.
    #[serde(with = "values::unset")]
    users_balance: Option<Balance> => Rule::OrEmpty(&Rule::OneOf(BALANCES)),
    /// The users pipeline's own `min_concurrency`.
    #[serde(with = "values::unset")]
    users_min_concurrency: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 64 }),
    /// The users pipeline's own `max_concurrency`.
    #[serde(with = "values::unset")]
    users_max_concurrency: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 64 }),
    /// The users pipeline's own `balance_cooldown_ms`.
    #[serde(with = "values::unset")]
    users_balance_cooldown_ms: Option<u64> =>
        Rule::OrEmpty(&Rule::Int { min: 100, max: 3_600_000 }),
    /// The users pipeline's own `balance_max_shift`.
    #[serde(with = "values::unset")]
    users_balance_max_shift: Option<usize> => Rule::OrEmpty(&Rule::Int { min: 1, max: 64 }),
    /// The users pipeline's own `scale_threshold`.
    #[serde(with = "values::unset")]
    users_scale_threshold: Option<u64> =>
        Rule::OrEmpty(&Rule::Int { min: 1, max: 100_000_000 }),
    /// The users pipeline's own `scale_up_threshold`.
    #[serde(with = "values::unset")]
    users_scale_up_threshold: Option<u64> =>
        Rule::OrEmpty(&Rule::Int { min: 1, max: 100_000_000 }),
    /// The users pipeline's own `scale_down_threshold`.
    #[serde(with = "values::unset")]
    users_scale_down_threshold: Option<u64> =>
        Rule::OrEmpty(&Rule::Int { min: 0, max: 100_000_000 }),
    /// Batch inserts in flight in the whole process, every pipeline's together; balanced
    /// pipelines share what the fixed ones leave, by backlog. 0: `database_pool_size`.
    max_inserts_in_flight: usize => Rule::Int { min: 0, max: 256 },
    /// Consumer prefetch; 0 derives it: batch size x batch concurrency x 2.
    prefetch: u32 => Rule::Int { min: 0, max: 65_535 },
    /// Messages per second each pipeline takes from its queue; 0 = no limit. Changed at run
    /// time by `warren ctl rate`.
    rate_limit_per_s: u32 => Rule::Int { min: 0, max: 1_000_000 },
    /// Largest accepted body; larger ones are parked unread where they were refused.
    max_message_bytes: usize => Rule::Int { min: 1, max: 134_217_728 },
    /// Bytes of messages each stage (a pipeline's main or DLQ consumer) holds at once
    /// (delivered, not yet settled: bodies, their properties as parsed, and the rows decoded
    /// from them, each counted up to this: a stage holds at most about twice it and one
    /// message's rows more): the prefetch window never exceeds budget /
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

/// The choices of `balance` and `users_balance`.
const BALANCES: &[&str] = &["off", "simple", "auto"];

/// Every setting as (key in `config/default.toml` and `--set`, environment variable), in the
/// order of that file. docs/configuration.md is tested against it (tests/docs.rs).
pub fn setting_names() -> impl Iterator<Item = (&'static str, String)> {
    RULES
        .iter()
        .map(|(key, _)| (*key, key.to_ascii_uppercase()))
}

pub use crate::amqp::hand_back_after;

/// Checks each value of `file` that another source overrides (the environment, a flag) by its
/// setting's rule, as if it were the effective one: the error names the file's line and says
/// what overrides it.
fn check_overridden(sources: &Sources, file: &FileText) -> Result<(), ConfigError> {
    // The file alone, merged once (and only when a value of it is overridden).
    let mut alone: Option<Option<Value>> = None;
    for (key, rule) in RULES {
        let path = [key.to_string()];
        if file.offset_of(&path).is_none() {
            continue;
        }
        let over = match diagnose::origin_of(key, sources, Some(file)) {
            Origin::File { .. } | Origin::Default => continue,
            over => over,
        };
        let alone = alone
            .get_or_insert_with(|| Figment::from(Toml::string(&file.text)).find_value("").ok());
        let Some(value) = alone.as_ref().and_then(|all| all.find_ref(key)).cloned() else {
            continue;
        };
        if let Err(e) = check(key, rule, &value) {
            let e = match e {
                ConfigError::Invalid {
                    setting,
                    expected,
                    got,
                } => ConfigError::Invalid {
                    setting,
                    expected,
                    got: format!(
                        "{got} (overridden by {over}, but a value in the file must be valid on \
                         its own)"
                    ),
                },
                other => other,
            };
            return Err(ConfigError::At {
                at: file.at(&path),
                error: Box::new(e),
                closest: suggest(key, rule, &value),
            });
        }
    }
    Ok(())
}

/// Each `[[pipelines]]` entry's numbers ([`pipelines::numbers`]) by the rule of the setting
/// of the same name, before the typed parse: the same words as the setting's error (the
/// range, the value as written, the integer a whole float means), at the entry's file and line.
fn check_entry_numbers(merged: &Value, file: Option<&FileText>) -> Result<(), ConfigError> {
    let Some(Value::Array(_, entries)) = merged.find_ref("pipelines") else {
        return Ok(());
    };
    for (index, entry) in entries.iter().enumerate() {
        let Value::Dict(_, fields) = entry else {
            continue;
        };
        for key in pipelines::numbers() {
            let (Some(value), Some((_, rule))) =
                (fields.get(key), RULES.iter().find(|(k, _)| *k == key))
            else {
                continue;
            };
            let Err(ConfigError::Invalid { expected, got, .. }) = check(key, rule, value) else {
                continue;
            };
            let name = match fields.get("name") {
                Some(Value::String(_, n)) => format!("pipelines.{n}"),
                _ => format!("pipelines[{index}]"),
            };
            let error = ConfigError::Invalid {
                setting: format!("{name}.{key}"),
                expected,
                got,
            };
            return Err(match file {
                Some(file) => ConfigError::At {
                    at: file.at(&["pipelines".into(), index.to_string(), key.to_string()]),
                    error: Box::new(error),
                    closest: suggest(key, rule, value),
                },
                None => error,
            });
        }
    }
    Ok(())
}

/// The smallest non-zero `DLQ_DELIVERY_LIMIT`: the DLQ dead-letters nowhere, and a database
/// outage makes the DLQ consumer give each message back about 100 times an hour (measured: a
/// limit of 20 was spent in 13 minutes), so 10,000 lasts about four days of outage.
pub const DLQ_DELIVERY_LIMIT_FLOOR: u32 = 10_000;

impl Settings {
    /// Loads and validates the settings from `sources`.
    pub fn load(sources: &Sources) -> Result<Self, ConfigError> {
        if sources.use_env {
            check_warren_env()?;
        }
        let mut figment = Figment::from(Toml::string(default_settings_toml()));
        let file = sources
            .file
            .as_deref()
            .map(|path| FileText::read(path, sources.file_named_by))
            .transpose()?;
        if let Some(file) = &file {
            file.check_keys()?;
            figment = figment.merge(Toml::string(&file.text));
        }
        if sources.use_env {
            // `WARREN_<NAME>` wins over `<NAME>` (a shared environment may hold the bare name).
            // Only the upper-case names are settings, matched on the variable's own name.
            let names = |prefix: &'static str| {
                Env::raw()
                    .filter_map(move |name| setting_of_env(name.as_str(), prefix).map(Into::into))
            };
            figment = figment.merge(names("")).merge(names("WARREN_"));
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
        if !sources.pinned.is_empty() {
            figment = figment.merge(Serialized::defaults(&sources.pinned));
        }

        // Merged once: figment merges (and clones) every layer, the file's pipelines included,
        // at each look-up, which made a file of thousands of pipelines take seconds to load.
        let merged = figment
            .find_value("")
            .map_err(|e| diagnose::from_figment(e, file.as_ref()))?;
        for (key, rule) in RULES {
            let value = merged
                .find_ref(key)
                .cloned()
                .ok_or_else(|| figment::error::Kind::MissingField(key.to_string().into()).into())
                .map_err(|e| diagnose::from_figment(e, file.as_ref()))?;
            check(key, rule, &value).map_err(|e| {
                diagnose::place(e, sources, file.as_ref(), suggest(key, rule, &value))
            })?;
        }
        // The file's own values, also those the environment or a flag overrides: each value
        // of a file is valid on its own (a mistake in it is not silently carried along). The
        // rules across settings are checked on the effective values only, below: taking an
        // override away may still break one of them (docs/configuration.md, "Layers").
        if let Some(file) = &file {
            check_overridden(sources, file)?;
        }
        check_entry_numbers(&merged, file.as_ref())?;
        let mut settings: Settings = figment
            .extract()
            .map_err(|e| diagnose::from_figment(e, file.as_ref()))?;
        settings
            .validate()
            .map_err(|e| diagnose::place(e, sources, file.as_ref(), None))?;
        // The one resolution step: every pipeline's entry plus the defaults, checked.
        let timeout_at = diagnose::origin_of("amqp_consumer_timeout_ms", sources, file.as_ref());
        settings.resolved = pipelines::resolve(&settings, &timeout_at)
            .map_err(|e| diagnose::place(e, sources, file.as_ref(), None))?;
        if !sources.selecting {
            settings
                .check_inserts_budget()
                .map_err(|e| diagnose::place(e, sources, file.as_ref(), None))?;
        }
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

    /// The checks of single settings that the rules cannot express; the checks across a
    /// pipeline's fields and across pipelines are the resolution's ([`pipelines::resolve`]).
    fn validate(&self) -> Result<(), ConfigError> {
        // The API's listener and the metrics listener of one process cannot share an address
        // (review R38-F15: `run` exited 1 blaming "another process").
        // Port 0 is any free port: two listeners on it get two (the bench gives both `:0`).
        // Compared as the listeners bind them: `localhost:P` is `127.0.0.1:P`, and a wildcard
        // holds the port on every address (review R40a F2); a host that does not resolve is
        // compared as written (the bind names it).
        let (http, metrics) = (self.http_addr.trim(), self.metrics_addr.trim());
        let clash = match (rules::listen_addr(http), rules::listen_addr(metrics)) {
            (Ok(h), Ok(m)) => {
                h.port() != 0
                    && h.port() == m.port()
                    && (h.ip() == m.ip() || h.ip().is_unspecified() || m.ip().is_unspecified())
            }
            _ => !http.ends_with(":0") && http == metrics,
        };
        if self.has_role(Role::Api) && clash {
            return Err(ConfigError::Invalid {
                setting: "HTTP_ADDR".into(),
                expected: "an address other than METRICS_ADDR: the HTTP API and the metrics \
                           listener of one process listen on two addresses"
                    .into(),
                got: format!(
                    "{:?}, which is METRICS_ADDR ({:?}) once bound",
                    self.http_addr, self.metrics_addr
                ),
            });
        }
        let limit = self.dlq_delivery_limit;
        if limit > 0 && limit < DLQ_DELIVERY_LIMIT_FLOOR {
            return Err(ConfigError::Invalid {
                setting: "DLQ_DELIVERY_LIMIT".into(),
                expected: format!(
                    "0 (none declared) or {DLQ_DELIVERY_LIMIT_FLOOR} to 1000000000: the DLQ \
                     dead-letters nowhere, so a message past its limit is dropped, and while \
                     the database is down every message the DLQ consumer gives back spends a \
                     delivery (about 100 an hour each), so a smaller limit loses messages \
                     within hours (see docs/cluster.md)"
                ),
                got: limit.to_string(),
            });
        }
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
        Ok(())
    }

    /// Every pipeline this configuration runs, resolved and checked when it loaded: the
    /// built-in users pipeline first (unless a file's pipeline named users replaces it, or
    /// `warren run --pipelines` left it out), then the file's, in its order.
    pub fn pipelines(&self) -> &[pipelines::PipelineSpec] {
        &self.resolved
    }

    /// The pipeline `name` among [`Settings::pipelines`].
    pub fn pipeline(&self, name: &str) -> Option<&pipelines::PipelineSpec> {
        self.resolved.iter().find(|p| p.name == name)
    }

    /// Why `name` is none of [`Settings::pipelines`], for a user who gave it: the closest name
    /// (`did you mean orders?`) and every name this configuration has.
    pub fn no_pipeline(&self, name: &str) -> String {
        let known: Vec<&str> = self.resolved.iter().map(|p| p.name.as_str()).collect();
        let hint = crate::text::closest(name, known.iter().copied(), false)
            .map(|c| format!(" (did you mean {c}?)"))
            .unwrap_or_default();
        format!(
            "no pipeline {name:?}{hint}; this configuration has: {}",
            known.join(", ")
        )
    }

    /// `MAX_INSERTS_IN_FLIGHT` holds at least the batch inserts the pipelines to run always
    /// hold: checked at load, or after [`Settings::select_pipelines`] when the sources said a
    /// selection follows (the pipelines left out do not count).
    pub fn check_inserts_budget(&self) -> Result<(), ConfigError> {
        pipelines::check_budget(&self.resolved, self.max_inserts_in_flight)
    }

    /// Keeps only the pipelines named in `wanted` (`warren run --pipelines`): the resolved
    /// specs and the file's entries.
    pub fn select_pipelines(&mut self, wanted: &[&str]) {
        // A set: a reload selects every pipeline it starts, thousands in a large file.
        let wanted: std::collections::HashSet<&str> = wanted.iter().copied().collect();
        self.pipelines.retain(|p| wanted.contains(p.name.as_str()));
        self.resolved.retain(|p| wanted.contains(p.name.as_str()));
        self.without_users = !wanted.contains("users");
    }

    /// The retry tiers of the built-in users pipeline in order, at least one. Without
    /// `retry_ttls_ms`: `retry_queue` with `retry_ttl_ms`, as always. With it: one queue per
    /// TTL, named from the base of `retry_queue` (its name without a trailing TTL suffix such as
    /// `_10s`) and the TTL: `raffle_retry_10s` and `1000,10000,60000` give `raffle_retry_1s`,
    /// `raffle_retry_10s`, `raffle_retry_1m`.
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

    /// The process-wide budget of batch inserts in flight: `max_inserts_in_flight`, or
    /// `database_pool_size` when 0 (never below what the pipelines always hold).
    pub fn inserts_budget(&self) -> usize {
        let held: usize = self.resolved.iter().map(|p| p.held_inserts()).sum();
        match self.max_inserts_in_flight {
            0 => self.database_pool_size.max(held),
            n => n,
        }
    }

    /// The pipelines' pool: `database_pool_size`, raised to a connection for each insert that
    /// can be in flight (the main stages' most, within [`Settings::inserts_budget`], and the
    /// DLQ stages' batch concurrency) and one more.
    pub fn pipelines_pool_size(&self) -> usize {
        pipelines::pool_size(
            &self.resolved,
            self.database_pool_size,
            self.inserts_budget(),
        )
    }

    /// How long warren may hold a delivery unacked before it gives it back (nack with requeue):
    /// see [`hand_back_after`]; `None` when the broker has no consumer timeout.
    pub fn hand_back_after(&self) -> Option<Duration> {
        hand_back_after(self.amqp_consumer_timeout_ms)
    }

    /// Whether `role` is among the configured roles.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(role)
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

/// At `per_s` messages a second (0 = no limit), whether the last delivery of a window of
/// `prefetch` would wait in the rate limiter as long as `give_back` (the hand-back time) or
/// longer; that time if so (see [`pipelines::PipelineSpec::window_outlasts`]).
pub fn window_outlasts(prefetch: u16, per_s: u32, give_back: Option<Duration>) -> Option<Duration> {
    let give_back = give_back?;
    let window = Duration::from_secs(u64::from(prefetch)) / per_s.max(1);
    (per_s > 0 && window >= give_back).then_some(give_back)
}

#[cfg(test)]
mod tests;
