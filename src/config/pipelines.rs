//! The `[[pipelines]]` of the configuration file: each one a queue-to-table mapping with its own
//! queue names, retry tiers, batching and limits (each defaulting to the global setting), checked
//! when the configuration loads. The built-in users pipeline is declared in the same format at
//! the end of `config/default.toml` ([`users`]) and configured by the global names
//! (`MAIN_QUEUE`, `USERS_BATCH_SIZE`, ...); a file's pipeline named `users` replaces it.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{ConfigError, RetryTier, Rule, Settings, humanize_ms, retry_base};
use crate::domain::mapping::{ColumnSpec, Mapping, MappingSpec, OnConflict, UnknownFields};

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
    // Batching and limits; absent: as for users (`USERS_*`) or the global setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proc_concurrency: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<u64>,
    // Balancing (docs/balancing.md); absent: as for users (`USERS_BALANCE`, ...).
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
/// any other pipeline, under the global names (`MAIN_QUEUE`, `USERS_BATCH_SIZE`, ...).
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
    /// The users pipeline's, from the global settings.
    pub fn users(settings: &Settings) -> Self {
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
            unknown_fields: self.unknown_fields,
            columns: self.columns.clone(),
        }
    }

    /// The compiled mapping (the configuration was checked when it loaded).
    pub fn mapping(&self) -> Result<Mapping, ConfigError> {
        Mapping::compile(&self.name, &self.mapping_spec())
            .map_err(|e| ConfigError::Pipeline(e.to_string()))
    }

    /// Its exchanges and queues, given or derived from its name.
    pub fn names(&self, settings: &Settings) -> Names {
        let n = &self.name;
        let or = |given: &Option<String>, default: String| given.clone().unwrap_or(default);
        let ttls = match &self.retry_ttls_ms {
            Some(list) => list.clone(),
            None => settings.retry_ttls_ms.0.clone(),
        };
        let retry_tiers = if ttls.is_empty() {
            vec![RetryTier {
                queue: or(
                    &self.retry_queue,
                    format!("{n}_retry_{}", humanize_ms(settings.retry_ttl_ms)),
                ),
                ttl_ms: settings.retry_ttl_ms,
            }]
        } else {
            let default = format!("{n}_retry");
            let base = retry_base(self.retry_queue.as_deref().unwrap_or(&default));
            ttls.iter()
                .map(|&ttl_ms| RetryTier {
                    queue: format!("{base}_{}", humanize_ms(ttl_ms)),
                    ttl_ms,
                })
                .collect()
        };
        Names {
            main_exchange: or(&self.main_exchange, format!("{n}_exchange")),
            main_queue: or(&self.main_queue, format!("{n}_queue")),
            retry_exchange: or(&self.retry_exchange, format!("{n}_retry_exchange")),
            retry_tiers,
            dlx_exchange: or(&self.dlx_exchange, format!("{n}_dlx")),
            dlq_queue: or(&self.dlq_queue, format!("{n}_dlq")),
        }
    }

    /// The settings as this pipeline sees them: the global ones with its names, tiers,
    /// batching and limits in place of the users pipeline's, from which its stages' spec
    /// (`pipeline::Spec::main`) and its topology are resolved, each setting's default and range
    /// kept in one place.
    pub fn view(&self, settings: &Settings) -> Settings {
        let names = self.names(settings);
        let mut view = settings.clone();
        view.main_exchange = names.main_exchange;
        view.main_queue = names.main_queue;
        view.retry_exchange = names.retry_exchange;
        view.dlx_exchange = names.dlx_exchange;
        view.dlq_queue = names.dlq_queue;
        match names.retry_tiers.as_slice() {
            [one] if self.retry_ttls_ms.is_none() && settings.retry_ttls_ms.0.is_empty() => {
                view.retry_queue = one.queue.clone();
                view.retry_ttl_ms = one.ttl_ms;
            }
            tiers => {
                // The tiers are `<base>_<ttl>`; `retry_tiers()` takes the base back off the
                // first one's name.
                view.retry_queue = tiers.first().map(|t| t.queue.clone()).unwrap_or_default();
                view.retry_ttls_ms = super::RetryTtls(tiers.iter().map(|t| t.ttl_ms).collect());
            }
        }
        let set = |value: Option<u64>, into: &mut u64| {
            if let Some(v) = value {
                *into = v;
            }
        };
        let n = |value: Option<u64>, into: &mut usize| {
            if let Some(v) = value {
                *into = usize::try_from(v).unwrap_or(usize::MAX);
            }
        };
        n(self.batch_size, &mut view.users_batch_size);
        n(self.batch_concurrency, &mut view.users_batch_concurrency);
        n(self.proc_concurrency, &mut view.users_proc_concurrency);
        set(self.batch_timeout_ms, &mut view.users_batch_timeout_ms);
        if let Some(b) = self.balance {
            view.users_balance = b;
        }
        n(self.min_concurrency, &mut view.users_min_concurrency);
        n(self.max_concurrency, &mut view.users_max_concurrency);
        set(
            self.balance_cooldown_ms,
            &mut view.users_balance_cooldown_ms,
        );
        n(self.balance_max_shift, &mut view.users_balance_max_shift);
        set(self.scale_threshold, &mut view.users_scale_threshold);
        set(self.scale_up_threshold, &mut view.users_scale_up_threshold);
        set(
            self.scale_down_threshold,
            &mut view.users_scale_down_threshold,
        );
        let small = |value: Option<u64>, into: &mut u32| {
            if let Some(v) = value {
                *into = u32::try_from(v).unwrap_or(u32::MAX);
            }
        };
        small(self.prefetch, &mut view.prefetch);
        small(self.max_retries, &mut view.max_retries);
        small(self.dlq_max_attempts, &mut view.dlq_max_attempts);
        small(self.rate_limit_per_s, &mut view.rate_limit_per_s);
        view.pipelines = Vec::new();
        view
    }

    /// The numeric settings a pipeline may set, each with the global setting whose range (and
    /// default) it takes.
    fn numbers(&self) -> [(&'static str, &'static str, Option<u64>); 16] {
        [
            (
                "min_concurrency",
                "users_min_concurrency",
                self.min_concurrency,
            ),
            (
                "max_concurrency",
                "users_max_concurrency",
                self.max_concurrency,
            ),
            (
                "balance_cooldown_ms",
                "users_balance_cooldown_ms",
                self.balance_cooldown_ms,
            ),
            (
                "balance_max_shift",
                "users_balance_max_shift",
                self.balance_max_shift,
            ),
            (
                "scale_threshold",
                "users_scale_threshold",
                self.scale_threshold,
            ),
            (
                "scale_up_threshold",
                "users_scale_up_threshold",
                self.scale_up_threshold,
            ),
            (
                "scale_down_threshold",
                "users_scale_down_threshold",
                self.scale_down_threshold,
            ),
            ("batch_size", "users_batch_size", self.batch_size),
            (
                "batch_timeout_ms",
                "users_batch_timeout_ms",
                self.batch_timeout_ms,
            ),
            (
                "batch_concurrency",
                "users_batch_concurrency",
                self.batch_concurrency,
            ),
            (
                "proc_concurrency",
                "users_proc_concurrency",
                self.proc_concurrency,
            ),
            ("prefetch", "prefetch", self.prefetch),
            ("max_retries", "max_retries", self.max_retries),
            (
                "dlq_max_attempts",
                "dlq_max_attempts",
                self.dlq_max_attempts,
            ),
            (
                "rate_limit_per_s",
                "rate_limit_per_s",
                self.rate_limit_per_s,
            ),
            ("retry_ttls_ms", "retry_ttl_ms", None),
        ]
    }
}

/// The API's options need the API, and `api_key = "chosen"` a uuid key read from a top-level
/// field (the API writes it there), `api_check` `on_conflict = "keep"` (a stored key with other
/// content is a conflict only then).
fn check_api(p: &PipelineConfig, at: &str) -> Result<(), ConfigError> {
    let invalid = |field: &str, expected: &str, got: String| ConfigError::Invalid {
        setting: format!("{at}.{field}"),
        expected: expected.into(),
        got,
    };
    if !p.api && (p.api_key != ApiKey::Body || p.api_check) {
        let field = if p.api_check { "api_check" } else { "api_key" };
        return Err(invalid(
            field,
            "api = true first (it is an option of the API)",
            {
                if p.api_check {
                    "true".into()
                } else {
                    "\"chosen\"".into()
                }
            },
        ));
    }
    if p.api_key == ApiKey::Chosen {
        let key = p.key.first().and_then(|k| p.columns.get(k));
        let top_level = key
            .and_then(|c| c.path.as_deref())
            .is_some_and(|path| path.len() > 1 && path[1..].chars().all(|c| c != '/' && c != '~'));
        if !key.is_some_and(|c| c.ty == crate::domain::mapping::ColType::Uuid) || !top_level {
            return Err(invalid(
                "api_key",
                "\"body\", or \"chosen\" with a uuid key column read from a top-level field \
                 (path = \"/<field>\"), which the API fills",
                "\"chosen\"".into(),
            ));
        }
    }
    if p.api_check && p.on_conflict != OnConflict::Keep {
        return Err(invalid(
            "api_check",
            "false with on_conflict = \"update\" (a newer version is no conflict)",
            "true".into(),
        ));
    }
    Ok(())
}

/// Whether `name` is a pipeline name: `[a-z][a-z0-9_]{0,39}`.
fn is_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && name.len() <= 40
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The range a global integer setting accepts.
fn range_of(key: &str) -> Option<(u64, u64)> {
    super::RULES.iter().find_map(|(k, rule)| match rule {
        Rule::Int { min, max } if *k == key => Some((*min, *max)),
        _ => None,
    })
}

/// Checks the file's pipelines: each name, each mapping, each number within the range of the
/// global setting it stands for, no two pipelines of one name, and no exchange or queue shared
/// by two pipelines (the users pipeline's included, unless one of the file's replaces it).
pub fn check(settings: &Settings) -> Result<(), ConfigError> {
    let invalid = |setting: String, expected: &str, got: String| ConfigError::Invalid {
        setting,
        expected: expected.into(),
        got,
    };
    // An error about the `index`-th entry's `field`: the loader adds the file and line.
    let entry = |index: usize, field: &str, error: ConfigError| ConfigError::Entry {
        index,
        field: field
            .split('.')
            .filter(|f| !f.is_empty())
            .map(Into::into)
            .collect(),
        error: Box::new(error),
    };
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, p) in settings.pipelines.iter().enumerate() {
        let at = format!("pipelines[{i}]");
        if !is_name(&p.name) {
            return Err(entry(
                i,
                "name",
                invalid(
                    format!("{at}.name"),
                    "a name of a lower-case letter then up to 39 lower-case letters, digits or _",
                    format!("{:?}", p.name),
                ),
            ));
        }
        if let Some(first) = seen.insert(&p.name, i) {
            return Err(entry(
                i,
                "name",
                invalid(
                    format!("{at}.name"),
                    "a name no other pipeline has",
                    format!("{:?}, as pipelines[{first}]", p.name),
                ),
            ));
        }
        let at = format!("pipelines.{}", p.name);
        for (field, global, value) in p.numbers() {
            if let (Some(v), Some((min, max))) = (value, range_of(global))
                && (v < min || v > max)
            {
                return Err(entry(
                    i,
                    field,
                    invalid(
                        format!("{at}.{field}"),
                        &format!("an integer from {min} to {max}"),
                        v.to_string(),
                    ),
                ));
            }
        }
        let view = p.view(settings);
        if view.users_min_concurrency > view.users_max_concurrency {
            return Err(entry(
                i,
                "min_concurrency",
                invalid(
                    format!("{at}.min_concurrency"),
                    &format!("at most max_concurrency ({})", view.users_max_concurrency),
                    view.users_min_concurrency.to_string(),
                ),
            ));
        }
        if view.users_balance == super::Balance::Auto
            && view.users_scale_down_threshold >= view.users_scale_up_threshold
        {
            return Err(entry(
                i,
                "scale_down_threshold",
                invalid(
                    format!("{at}.scale_down_threshold"),
                    &format!(
                        "below scale_up_threshold ({}), or auto would step down and up again at \
                     every decision",
                        view.users_scale_up_threshold
                    ),
                    view.users_scale_down_threshold.to_string(),
                ),
            ));
        }
        if let Some(ttls) = &p.retry_ttls_ms {
            let (min, max) = range_of("retry_ttl_ms").unwrap_or((1, u64::MAX));
            if ttls.is_empty() || ttls.iter().any(|t| *t < min || *t > max) || !ttls.is_sorted() {
                return Err(entry(
                    i,
                    "retry_ttls_ms",
                    invalid(
                        format!("{at}.retry_ttls_ms"),
                        &format!(
                            "a non-empty list of TTLs in ascending order, each from {min} to {max} ms"
                        ),
                        format!("{ttls:?}"),
                    ),
                ));
            }
        }
        p.mapping().map_err(|e| entry(i, "", e))?;
        if p.api && p.key.len() != 1 {
            return Err(entry(
                i,
                "api",
                invalid(
                    format!("{at}.api"),
                    "false, or a one-column key (PUT and GET /api/v1/<name>/<key> address a row by it)",
                    format!("true with key {:?}", p.key),
                ),
            ));
        }
        check_api(p, &at)?;
    }
    // Names shared by two pipelines.
    let replaced = settings.pipelines.iter().any(|p| p.name == "users");
    let mut all: Vec<(String, Names)> = settings
        .pipelines
        .iter()
        .map(|p| (p.name.clone(), p.names(settings)))
        .collect();
    if !replaced {
        all.insert(0, ("users".into(), Names::users(settings)));
    }
    // The error of a file's pipeline is placed at its entry (the built-in users one has none).
    let placed = |pipeline: &str, what: &str, error: ConfigError| match settings
        .pipelines
        .iter()
        .position(|p| p.name == pipeline)
    {
        Some(index) => entry(index, what, error),
        None => error,
    };
    for (pipeline, names) in &all {
        for (what, name) in names.all() {
            if name.is_empty()
                || name.len() > 255
                || name.starts_with("amq.")
                || name.chars().any(char::is_control)
            {
                return Err(placed(
                    pipeline,
                    what,
                    invalid(
                        format!("pipelines.{pipeline}.{what}"),
                        "a name of 1 to 255 bytes, without control characters, not starting \
                         with amq. (reserved by the broker)",
                        format!("{name:?}"),
                    ),
                ));
            }
        }
    }
    // Exchanges and queues are two name spaces of the broker.
    let mut owner: HashMap<(bool, String), (String, &'static str)> = HashMap::new();
    for (pipeline, names) in &all {
        for (what, name) in names.all() {
            let key = (what.ends_with("exchange"), name.to_string());
            if let Some((other, other_what)) = owner.get(&key)
                && (other != pipeline || *other_what != what)
            {
                return Err(placed(
                    pipeline,
                    what,
                    invalid(
                        format!("pipelines.{pipeline}.{what}"),
                        "a name no other pipeline uses for its exchanges and queues",
                        format!("{name:?}, also the {other_what} of pipeline {other}"),
                    ),
                ));
            }
            owner.insert(key, (pipeline.clone(), what));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
