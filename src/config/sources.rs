//! Where settings come from: the file, the environment (with its `WARREN_` names and the
//! variables that are not settings) and the command line; `warren config --origin`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::value::Value;

use super::diagnose::FileText;
use super::{ConfigError, DEFAULT_TOML, Origin, RULES, Rule, redact_url};
use crate::text::closest;

/// How the configuration file was named, which its errors say: a user who set
/// `WARREN_CONFIG` never typed `--config`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum FileNamedBy {
    /// `--config PATH`.
    #[default]
    Flag,
    /// The environment variable `WARREN_CONFIG`.
    Env,
}

impl FileNamedBy {
    /// `--config PATH` or `WARREN_CONFIG=PATH`, as the user gave it.
    pub fn naming(self, path: &Path) -> String {
        match self {
            FileNamedBy::Flag => format!("--config {}", path.display()),
            FileNamedBy::Env => format!("WARREN_CONFIG={}", path.display()),
        }
    }
}

/// Where settings come from, besides the shipped defaults and the environment.
#[derive(Debug, Default, Clone)]
pub struct Sources {
    /// A TOML file layered over the defaults (`--config PATH` or `WARREN_CONFIG`).
    pub file: Option<PathBuf>,
    /// Which of the two named it, for its errors.
    pub file_named_by: FileNamedBy,
    /// CLI overrides, `key -> raw value` (from `--set` and named flags); they win over all.
    pub overrides: BTreeMap<String, String>,
    /// Whether to read the process environment (tests turn it off to stay hermetic).
    pub use_env: bool,
    /// How each override was given on the command line (`--set users_batch_size=0`), so that
    /// an error about its value can quote it.
    pub given: BTreeMap<String, String>,
    /// The caller keeps only some pipelines (`warren run --pipelines`) and checks the inserts
    /// they always hold against the budget after it ([`super::Settings::check_inserts_budget`]):
    /// pipelines that will not run must not count.
    pub selecting: bool,
    /// Values that win over every other source: a reload pins the settings that apply only at a
    /// restart to the values the process runs with, so its pipelines are resolved and checked
    /// against what runs (review R35g F3, F4: a reload checked a new pipeline against a new
    /// `MAX_INSERTS_IN_FLIGHT` or `DATABASE_SCHEMA` that did not apply).
    pub pinned: BTreeMap<String, serde_json::Value>,
}

impl Sources {
    /// Defaults < file < environment < overrides.
    pub fn new(file: Option<PathBuf>) -> Self {
        Self {
            file,
            file_named_by: FileNamedBy::Flag,
            overrides: BTreeMap::new(),
            use_env: true,
            given: BTreeMap::new(),
            selecting: false,
            pinned: BTreeMap::new(),
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
                // The value is not shown: an unknown key may be a misspelled secret.
                let at = Origin::Flag(format!("--set {key}=..."));
                let closest = closest(&key, RULES.iter().map(|(k, _)| *k), false);
                return Err(ConfigError::Unknown {
                    closest: closest.map(Into::into),
                    key,
                    at,
                });
            }
            self.given.insert(
                key.clone(),
                format!("--set {key}={}", shown_flag(&key, value)),
            );
            self.overrides.insert(key, value.to_string());
        }
        Ok(self)
    }

    /// Adds one override from a named CLI flag (`--roles` for `roles`).
    pub fn with_override(mut self, key: &str, value: impl Into<String>) -> Self {
        let value = value.into();
        let flag = format!("--{} {}", key.replace('_', "-"), shown_flag(key, &value));
        self.given.insert(key.to_string(), flag);
        self.overrides.insert(key.to_string(), value);
        self
    }
}

/// A flag's value as an error may quote it: a secret never, a URL's password redacted.
fn shown_flag(key: &str, value: &str) -> String {
    if RULES
        .iter()
        .any(|(k, rule)| *k == key && matches!(rule, Rule::Secret))
    {
        "***".into()
    } else {
        redact_url(value)
    }
}

/// `WARREN_*` environment variables that are not settings and are allowed: `--config`'s
/// variable and those of warren's own scripts (bench, cluster).
const WARREN_NOT_SETTINGS: &[&str] = &["WARREN_CONFIG", "WARREN_BIN", "WARREN_CLUSTER_DIR"];
/// Prefixes of `WARREN_*` variables of warren's test harness, free for tools.
const WARREN_TOOL_PREFIXES: &[&str] = &["WARREN_TEST_", "WARREN_LEDGER_", "WARREN_BENCH_"];

/// The environment variable of `key` that is set, if any: `WARREN_<NAME>` wins over `<NAME>`.
pub(super) fn env_name_of(key: &str) -> Option<String> {
    let upper = key.to_ascii_uppercase();
    [format!("WARREN_{upper}"), upper]
        .into_iter()
        .find(|name| std::env::var_os(name).is_some())
}

/// The setting the environment variable `name` sets, given `prefix` (`""` for the bare names,
/// `"WARREN_"`): the setting's key when `name` is exactly `prefix` + the key in upper case.
/// Only those names are settings: `prefetch`, `Prefetch` or `warren_prefetch` are not, and are
/// ignored like any other variable (figment's own matching would ignore the case, and the last
/// of `PREFETCH=9 prefetch=7` would win).
pub(super) fn setting_of_env(name: &str, prefix: &str) -> Option<&'static str> {
    let rest = name.strip_prefix(prefix)?;
    RULES.iter().map(|(key, _)| *key).find(|key| {
        rest.len() == key.len()
            && rest
                .bytes()
                .zip(key.bytes())
                .all(|(r, k)| r == k.to_ascii_uppercase())
    })
}

/// Whether `name` (with `value`) is one of the variables Kubernetes gives every pod for each
/// Service of its namespace (service links): a Service `warren` (or `warren-api`) makes
/// `WARREN_SERVICE_HOST`, `WARREN_SERVICE_PORT`, `WARREN_SERVICE_PORT_<PORT NAME>`,
/// `WARREN_PORT=tcp://..`, `WARREN_PORT_<N>_TCP`, `.._TCP_PROTO`, `.._TCP_PORT` and
/// `.._TCP_ADDR` (`WARREN_API_...` for `warren-api`). They are not settings, and a Deployment
/// named like its Service must still start.
pub(super) fn is_kubernetes_service_link(name: &str, value: &str) -> bool {
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
pub(super) fn check_warren_env() -> Result<(), ConfigError> {
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
        // `WARREN_prefetch` is no setting (only the upper-case names are): refused as a misspelling.
        let key = rest.to_ascii_lowercase();
        if setting_of_env(name, "WARREN_").is_some()
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

/// Each setting's origin, by the setting's key (what [`origins`] answers).
pub type Origins = BTreeMap<&'static str, String>;

/// Where each setting's value comes from, for `warren config --origin`: `--set`/a flag, an
/// environment variable (named), the file (its path), or the built-in defaults.
pub fn origins(sources: &Sources) -> Result<Origins, ConfigError> {
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

/// Where the key at `path` of the `--config` file was given (`["pipelines", "1", "batch_size"]`,
/// `["pipelines", "1", "columns", "total", "max"]`), for `warren config --origin`: `file PATH,
/// line N`; `None` when the file does not have that very key (the value is then a default).
pub fn file_origin(sources: &Sources, path: &[String]) -> Option<String> {
    let file = FileText::read(sources.file.as_deref()?, sources.file_named_by).ok()?;
    let table: toml::Table = file.text.parse().ok()?;
    let (first, rest) = path.split_first()?;
    rest.iter()
        .try_fold(table.get(first)?, |value, segment| match value {
            toml::Value::Table(t) => t.get(segment),
            toml::Value::Array(items) => items.get(segment.parse::<usize>().ok()?),
            _ => None,
        })?;
    match file.at(path) {
        Origin::File {
            path,
            line: Some(line),
        } => Some(format!("file {}, line {line}", path.display())),
        _ => None,
    }
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
            } else if value.trim() == "\"\"" {
                "empty".to_string()
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

/// Parses a raw string the way environment variables are parsed (numbers become numbers).
pub(super) fn parse_raw(raw: &str) -> Value {
    raw.parse::<Value>()
        .unwrap_or_else(|_| Value::from(raw.to_string()))
}
