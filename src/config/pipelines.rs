//! The `[[pipelines]]` of the configuration file as written ([`PipelineConfig`]): each one a
//! queue-to-table mapping with its own queue names, retry tiers, batching and limits, each
//! absent one taking the default of the same name (`batch_size`, ...). The built-in users
//! pipeline is declared in the same format at the end of `config/default.toml` ([`users`]),
//! named by the settings `MAIN_QUEUE`, ... and given its own `USERS_*` settings; a file's
//! pipeline named `users` replaces it. `spec` resolves each entry once, at load, into its
//! complete and checked [`PipelineSpec`] ([`resolve`]): what everything else reads.

mod shared;
mod spec;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ConfigError, RetryTier, Settings, humanize_ms, retry_base};
use crate::domain::mapping::{
    ChildSpec, ColumnSpec, DeleteSpec, Mapping, MappingSpec, OnConflict, UnknownFields,
};
pub use spec::{Api, Balancing, Batching, PipelineSpec, check_budget, pool_size};

/// The one resolution step (`spec.rs`): every pipeline of `settings` resolved, each on its own,
/// then the checks across them (`shared.rs`): names and tables two pipelines may not share.
pub fn resolve(
    settings: &Settings,
    timeout_at: &crate::config::Origin,
) -> Result<Vec<PipelineSpec>, ConfigError> {
    let specs = spec::resolve(settings, timeout_at)?;
    shared::check_shared_names(settings, &specs)?;
    shared::check_shared_tables(settings, &specs)?;
    Ok(specs)
}

/// One `[[pipelines]]` entry as written in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// `[a-z][a-z0-9_]{0,39}`: the metrics label, the default queue names, what its parked rows
    /// are filed under.
    pub name: String,
    /// An existing table, `name` or `schema.name`; warren never creates or alters it.
    pub table: String,
    /// The columns of a primary key or unique index of the table.
    pub key: Vec<String>,
    #[serde(default)]
    pub on_conflict: OnConflict,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version_column: Option<String>,
    #[serde(default)]
    pub unknown_fields: UnknownFields,
    /// `POST /api/v1/<name>`, `PUT` and `GET /api/v1/<name>/<key>`.
    #[serde(default)]
    pub api: bool,
    /// Who gives a `POST` its key (docs/api.md): the body, or the API (a uuid key read from a
    /// top-level field: a new UUID, or the one derived from the request's `Idempotency-Key`).
    #[serde(default)]
    pub api_key: ApiKey,
    /// Whether the API asks the table before publishing (docs/api.md): the key stored with the
    /// same content is answered at once, with other content or a value another unique index
    /// holds is a 409, nothing published.
    #[serde(default)]
    pub api_check: bool,
    // Batching and limits; absent: the default of the same name (for the pipeline named users,
    // its own `USERS_*` setting first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_min_wait_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proc_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<u64>,
    // Balancing (docs/balancing.md); absent: as for batching.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<super::Balance>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_cooldown_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_max_shift: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_threshold: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_up_threshold: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_threshold: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u64>,
    /// The retry tiers' TTLs; absent: `RETRY_TTLS_MS` (or the one tier of `RETRY_TTL_MS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_ttls_ms: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dlq_max_attempts: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_per_s: Option<u64>,
    // Names; absent: `<name>_exchange`, `<name>_queue`, `<name>_retry_exchange`,
    // `<name>_retry` + the tier suffix, `<name>_dlx`, `<name>_dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_exchange: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_queue: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_exchange: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_queue: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dlx_exchange: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dlq_queue: Option<String>,
    /// Column name -> where its value comes from, its type and checks.
    pub columns: BTreeMap<String, ColumnSpec>,
    /// Child tables filled from arrays of the message (`[[pipelines.children]]`), written in
    /// the same transaction as the parent row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ChildSpec>,
    /// Which messages delete their key's row (`delete = { field = "/op", value = "delete" }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete: Option<DeleteSpec>,
}

/// Whose default the setting of an entry key's name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultOf {
    /// Every pipeline's: an entry without the key takes the setting (`batch_size`).
    Every,
    /// The users pipeline's alone: its exchanges and queues (`MAIN_QUEUE`, ...); another
    /// pipeline derives its own from its name (`orders_queue`).
    Users,
}

/// An entry key that stands for the setting of the same name: what it takes when the entry
/// leaves it out, and how it is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryKey {
    /// The key, in the entry and as a setting (`batch_size`, `BATCH_SIZE`).
    pub key: &'static str,
    /// A number, checked by the rule of the setting of the same name (its range) before the
    /// typed parse: a value out of it, negative or a float is refused in the words a
    /// setting's is (`expected an integer from 1 to 10000, got 5.0`, `5` offered).
    pub number: bool,
    /// Whose default the setting is.
    pub default_of: DefaultOf,
    /// The users pipeline has a setting of its own, `users_<key>`, which wins over the default
    /// for it (its entry's key still wins).
    pub users_own: bool,
}

impl EntryKey {
    const fn new(key: &'static str, number: bool, users_own: bool) -> Self {
        Self {
            key,
            number,
            default_of: DefaultOf::Every,
            users_own,
        }
    }

    const fn name(key: &'static str) -> Self {
        Self {
            key,
            number: false,
            default_of: DefaultOf::Users,
            users_own: false,
        }
    }
}

/// Every entry key that stands for a setting of the same name, in one table: the numbers
/// checked before the parse ([`numbers`]) and the settings a reload applies to the pipelines
/// without a restart (`app::pipelines`) are read from it. A test holds each to a field of
/// [`PipelineConfig`] and a setting.
pub const ENTRY_KEYS: &[EntryKey] = &[
    EntryKey::name("main_exchange"),
    EntryKey::name("main_queue"),
    EntryKey::name("retry_exchange"),
    EntryKey::name("retry_queue"),
    EntryKey::name("dlx_exchange"),
    EntryKey::name("dlq_queue"),
    EntryKey::new("retry_ttls_ms", false, false),
    EntryKey::new("batch_size", true, true),
    EntryKey::new("batch_timeout_ms", true, true),
    EntryKey::new("batch_min_wait_ms", true, true),
    EntryKey::new("batch_concurrency", true, true),
    EntryKey::new("proc_concurrency", true, true),
    EntryKey::new("prefetch", true, false),
    EntryKey::new("balance", false, true),
    EntryKey::new("min_concurrency", true, true),
    EntryKey::new("max_concurrency", true, true),
    EntryKey::new("balance_cooldown_ms", true, true),
    EntryKey::new("balance_max_shift", true, true),
    EntryKey::new("scale_threshold", true, true),
    EntryKey::new("scale_up_threshold", true, true),
    EntryKey::new("scale_down_threshold", true, true),
    EntryKey::new("max_retries", true, false),
    EntryKey::new("dlq_max_attempts", true, false),
    EntryKey::new("rate_limit_per_s", true, false),
];

/// The entry's keys that are numbers ([`EntryKey::number`]), in the table's order.
pub fn numbers() -> impl Iterator<Item = &'static str> {
    ENTRY_KEYS.iter().filter(|k| k.number).map(|k| k.key)
}

/// The settings an entry key stands for: each key's own, and the users pipeline's
/// `users_<key>` where it has one.
pub fn entry_settings() -> impl Iterator<Item = String> {
    ENTRY_KEYS.iter().flat_map(|k| {
        std::iter::once(k.key.to_string()).chain(k.users_own.then(|| format!("users_{}", k.key)))
    })
}

/// Who gives a `POST` of the pipeline's API its key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiKey {
    /// The body carries it, as the pipeline reads it.
    #[default]
    Body,
    /// The API chooses it (a uuid key column read from a top-level field): a `POST` leaves it
    /// out of the body, a `PUT` may (the path's is used).
    Chosen,
}

/// Where the built-in users pipeline's declaration starts in `config/default.toml`.
pub const USERS_MARK: &str = "\n[[pipelines]]\n";

/// The built-in users pipeline as `config/default.toml` declares it (the shipped file: a unit
/// test holds it valid and to the answers users always gave). It runs through the mapping like
/// any other pipeline, under the names `MAIN_QUEUE`, ... and its own `USERS_*` settings.
pub fn users() -> Result<PipelineConfig, ConfigError> {
    #[derive(Deserialize)]
    struct Declared {
        pipelines: Vec<PipelineConfig>,
    }
    let bad =
        |why: String| ConfigError::Other(format!("config/default.toml, the users pipeline: {why}"));
    let text = super::DEFAULT_TOML
        .split_once(USERS_MARK)
        .map(|(_, rest)| format!("{USERS_MARK}{rest}"))
        .ok_or_else(|| bad("no [[pipelines]] entry".into()))?;
    let declared: Declared = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
    declared
        .pipelines
        .into_iter()
        .find(|p| p.name == "users")
        .ok_or_else(|| bad("no pipeline named users".into()))
}

/// The broker objects of one pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub main_exchange: String,
    pub main_queue: String,
    pub retry_exchange: String,
    pub retry_tiers: Vec<RetryTier>,
    pub dlx_exchange: String,
    pub dlq_queue: String,
}

impl Names {
    /// The built-in users pipeline's, from the settings `MAIN_EXCHANGE`, `MAIN_QUEUE`,
    /// `RETRY_EXCHANGE`, `RETRY_QUEUE` (and the tiers), `DLX_EXCHANGE`, `DLQ_QUEUE`.
    fn users(settings: &Settings) -> Self {
        Self {
            main_exchange: settings.main_exchange.clone(),
            main_queue: settings.main_queue.clone(),
            retry_exchange: settings.retry_exchange.clone(),
            retry_tiers: settings.retry_tiers(),
            dlx_exchange: settings.dlx_exchange.clone(),
            dlq_queue: settings.dlq_queue.clone(),
        }
    }

    /// Every exchange and queue, with what it is (`main_queue`, ...), for the clash check.
    fn all(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("main_exchange", self.main_exchange.as_str()),
            ("main_queue", self.main_queue.as_str()),
            ("retry_exchange", self.retry_exchange.as_str()),
            ("dlx_exchange", self.dlx_exchange.as_str()),
            ("dlq_queue", self.dlq_queue.as_str()),
        ];
        out.extend(
            self.retry_tiers
                .iter()
                .map(|t| ("retry_queue", t.queue.as_str())),
        );
        out
    }
}

impl PipelineConfig {
    /// What the mapping core compiles.
    pub fn mapping_spec(&self) -> MappingSpec {
        MappingSpec {
            table: self.table.clone(),
            key: self.key.clone(),
            on_conflict: self.on_conflict,
            version_column: self.version_column.clone(),
            unknown_fields: self.unknown_fields.clone(),
            columns: self.columns.clone(),
            children: self.children.clone(),
            delete: self.delete.clone(),
        }
    }

    /// The compiled mapping.
    pub fn mapping(&self) -> Result<Mapping, ConfigError> {
        Mapping::compile(&self.name, &self.mapping_spec())
            .map_err(|e| ConfigError::Pipeline(e.to_string()))
    }

    /// Its exchanges and queues, given or derived from its name (resolved into
    /// [`PipelineSpec::names`]). A file's pipeline named users takes, for each name it does not
    /// give, the users naming settings (`MAIN_QUEUE`, ..., its retry tiers named from
    /// `RETRY_QUEUE`), as the built-in one does: declaring users in a file does not move its
    /// queues.
    fn names(&self, settings: &Settings) -> Names {
        let n = &self.name;
        let users = n == "users";
        let or = |given: &Option<String>, setting: &String, derived: String| {
            given
                .clone()
                .unwrap_or_else(|| if users { setting.clone() } else { derived })
        };
        let ttls = match &self.retry_ttls_ms {
            Some(list) => list.clone(),
            None => settings.retry_ttls_ms.0.clone(),
        };
        let retry_tiers = if ttls.is_empty() {
            vec![RetryTier {
                queue: or(
                    &self.retry_queue,
                    &settings.retry_queue,
                    format!("{n}_retry_{}", humanize_ms(settings.retry_ttl_ms)),
                ),
                ttl_ms: settings.retry_ttl_ms,
            }]
        } else {
            let base = retry_base(&or(
                &self.retry_queue,
                &settings.retry_queue,
                format!("{n}_retry"),
            ))
            .to_string();
            ttls.iter()
                .map(|&ttl_ms| RetryTier {
                    queue: format!("{base}_{}", humanize_ms(ttl_ms)),
                    ttl_ms,
                })
                .collect()
        };
        Names {
            main_exchange: or(
                &self.main_exchange,
                &settings.main_exchange,
                format!("{n}_exchange"),
            ),
            main_queue: or(&self.main_queue, &settings.main_queue, format!("{n}_queue")),
            retry_exchange: or(
                &self.retry_exchange,
                &settings.retry_exchange,
                format!("{n}_retry_exchange"),
            ),
            retry_tiers,
            dlx_exchange: or(
                &self.dlx_exchange,
                &settings.dlx_exchange,
                format!("{n}_dlx"),
            ),
            dlq_queue: or(&self.dlq_queue, &settings.dlq_queue, format!("{n}_dlq")),
        }
    }
}

#[cfg(test)]
mod tests;
