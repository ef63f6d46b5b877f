//! The configuration's errors: what was wrong, where it was set, and the closest valid name.

use std::path::PathBuf;

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
