//! The configuration's errors: what was wrong, where it was set ([`Origin`]), and the closest
//! valid name or value.

use std::fmt;
use std::path::PathBuf;

/// Where a value was given, as an error names it so that its reader can find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The `--config` file, with the line of the key when it is known.
    File { path: PathBuf, line: Option<usize> },
    /// An environment variable, by the name it was found under (`WARREN_` or bare).
    Env(String),
    /// A command-line flag as given: `--set users_batch_size=0`, `--roles consumer,web`.
    Flag(String),
    /// The built-in defaults (a value nobody set).
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File {
                path,
                line: Some(line),
            } => write!(f, "{}, line {line}", path.display()),
            Origin::File { path, line: None } => write!(f, "{}", path.display()),
            Origin::Env(name) => write!(f, "the environment variable {name}"),
            Origin::Flag(flag) => f.write_str(flag),
            Origin::Default => f.write_str("the built-in defaults"),
        }
    }
}

/// ` (did you mean X?)` when there is a closest valid name or value, else nothing.
struct Hint<'a>(&'a Option<String>);

impl fmt::Display for Hint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(closest) => write!(f, " (did you mean {closest}?)"),
            None => Ok(()),
        }
    }
}

/// An error with where its value was given: `<where>: <error>`, but for a setting's value from
/// the environment, which names the variable as the setting (`WARREN_USERS_BATCH_SIZE: expected
/// ..., got "abc" (from the environment)`), and a setting's from the file, named by its key
/// there (`users_batch_size`).
struct Located<'a> {
    at: &'a Origin,
    error: &'a ConfigError,
    closest: &'a Option<String>,
}

impl fmt::Display for Located<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hint = Hint(self.closest);
        match (self.at, self.error) {
            (
                Origin::Env(name),
                ConfigError::Invalid {
                    setting,
                    expected,
                    got,
                },
            ) => {
                // `AMQP_URL (entry 2 of 3)`: the variable's name in place of the setting's.
                let (head, rest) = setting.split_once(' ').unwrap_or((setting, ""));
                let rest = if rest.is_empty() {
                    String::new()
                } else {
                    format!(" {rest}")
                };
                if name.strip_prefix("WARREN_").unwrap_or(name) == head {
                    let hint = match self.closest {
                        Some(closest) => format!("; did you mean {closest}?"),
                        None => String::new(),
                    };
                    write!(
                        f,
                        "{name}{rest}: expected {expected}, got {got} (from the environment{hint})"
                    )
                } else {
                    write!(f, "{}: {}{hint}", self.at, self.error)
                }
            }
            (
                Origin::File { .. },
                ConfigError::Invalid {
                    setting,
                    expected,
                    got,
                },
            ) if !setting.starts_with("pipelines") => {
                let key = setting.to_ascii_lowercase();
                write!(
                    f,
                    "{}: {key}: expected {expected}, got {got}{hint}",
                    self.at
                )
            }
            _ => write!(f, "{}: {}{hint}", self.at, self.error),
        }
    }
}

/// Where every setting is listed, for the user of the binary (not a file of the repository).
pub const SETTINGS_REFERENCE: &str =
    "every setting is listed by `warren config` and in docs/configuration.md";

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
    /// A setting warren does not know, in the file (at its line) or in `--set`.
    #[error(
        "unknown setting `{key}` in {at}{}; {SETTINGS_REFERENCE}",
        Hint(closest)
    )]
    Unknown {
        key: String,
        at: Origin,
        closest: Option<String>,
    },
    /// A key a `[[pipelines]]` entry (or one of its columns) does not have.
    #[error(
        "{at}: unknown key `{key}` in {table}{}; a pipeline's keys are listed in \
         docs/pipelines.md",
        Hint(closest)
    )]
    UnknownKey {
        at: Origin,
        /// `pipeline orders` or `pipeline orders, column total`.
        table: String,
        key: String,
        closest: Option<String>,
    },
    /// An error about a value, with where the value was given and, when there is one, the
    /// closest valid value or name.
    #[error("{}", Located { at, error, closest })]
    At {
        at: Origin,
        error: Box<ConfigError>,
        closest: Option<String>,
    },
    /// An error about the `index`-th `[[pipelines]]` entry of the file, `field` the path of the
    /// key in it (empty: the entry as a whole); the loader turns it into [`ConfigError::At`]
    /// with the file's line.
    #[error("{error}")]
    Entry {
        index: usize,
        field: Vec<String>,
        error: Box<ConfigError>,
    },
    /// A `--set` flag that is not `KEY=VALUE`.
    #[error("--set {0}: expected KEY=VALUE, for example --set users_batch_size=500")]
    BadFlag(String),
    /// The file given with `--config` or `WARREN_CONFIG` (`named_by`, as the error names it)
    /// could not be read.
    #[error("{}: {reason}", named_by.naming(path))]
    File {
        path: PathBuf,
        named_by: super::FileNamedBy,
        reason: String,
    },
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

#[cfg(test)]
mod tests {
    use crate::text::closest;

    #[test]
    fn the_closest_name_is_offered_only_when_close() {
        let settings = ["users_batch_size", "roles", "prefetch"];
        assert_eq!(
            closest("user_batch_size", settings, false),
            Some("users_batch_size")
        );
        assert_eq!(closest("nope", settings, false), None);
        assert_eq!(closest("upsert", ["keep", "update"], true), Some("update"));
        assert_eq!(
            closest("Quorum", ["classic", "quorum"], true),
            Some("quorum")
        );
        assert_eq!(closest("money", ["text", "uuid", "numeric"], true), None);
    }
}
