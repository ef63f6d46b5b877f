//! The user's configuration file as written (the line of each key, the name of each pipeline
//! entry) and the errors of a load put in warren's words: where the value was given (file and
//! line, environment variable, flag), the setting or pipeline and field, what was expected, and
//! the closest valid name or value.

use std::path::{Path, PathBuf};

use figment::error::{Actual, Kind};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::{ConfigError, Origin, RULES, Sources, env_name_of};
use crate::text::closest;

/// The `--config` file: its path and text.
pub(super) struct FileText {
    pub path: PathBuf,
    pub text: String,
    /// Each top-level key and its byte offset, found once: a load asks where each setting is
    /// given, and parsing the whole file for each of them made a file of thousands of
    /// pipelines take seconds to load (review of issue 35, F5).
    top: Vec<(String, usize)>,
}

/// A TOML syntax error as its position and the parser's message, without the source line the
/// parser would quote: that line may hold a password or `CONTROL_SECRET`.
fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim();
    match e.span() {
        Some(span) => {
            // Bytes, not a str slice: the span need not fall on a character boundary.
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|b| **b == b'\n').count() + 1;
            let line_start = before
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(0, |i| i + 1);
            let column = String::from_utf8_lossy(&before[line_start..])
                .chars()
                .count()
                + 1;
            format!("not valid TOML at line {line}, column {column}: {message}")
        }
        None => format!("not valid TOML: {message}"),
    }
}

/// The largest configuration file read: far above any real one (a few KiB; 256 pipelines of a
/// dozen columns each, about 600 KiB), so a path that names a device or a runaway file is
/// refused instead of read until memory runs out. Checking a file takes about 80 times its
/// size while it is read (a debug build: 50 MiB for 170 KiB): 4 MiB allowed a reload to take
/// a running instance to 741 MiB (review R35e F14, 20,000 pipelines in 2.6 MB).
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// The most `[[pipelines]]` entries one configuration holds: each is a consumer, a DLQ consumer,
/// their links and pools, so more belong on several instances (`--pipelines` selects a
/// file's pipelines for an instance).
pub const MAX_PIPELINES: usize = 256;

/// `path`'s text, if it is a regular file of at most [`MAX_FILE_BYTES`]. A FIFO, a device or a
/// directory is refused before it is opened for reading: a read that never ends would hold the
/// thread that reads it (a reload runs on the runtime's one thread: every pipeline would stop).
/// The file is opened without blocking, and what it holds is read up to the bound only.
fn read_regular(path: &Path) -> Result<String, Unreadable> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Unreadable::NotAFile);
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(Unreadable::TooLarge(Some(meta.len())));
    }
    // O_NONBLOCK: if the path was swapped for a FIFO since, the open does not wait for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(Unreadable::NotAFile);
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Unreadable::TooLarge(None));
    }
    String::from_utf8(bytes).map_err(|e| {
        // Where, as every other error of the file says it (review R35h F10).
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = good.iter().filter(|b| **b == b'\n').count() + 1;
        let start = good.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let column = String::from_utf8_lossy(&good[start..]).chars().count() + 1;
        Unreadable::NotUtf8 { line, column }
    })
}

/// Why [`read_regular`] read no text, in the words a configuration error shows.
#[derive(Debug, thiserror::Error)]
enum Unreadable {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("expected a regular file (not a directory, a FIFO or a device)")]
    NotAFile,
    #[error("expected at most {MAX_FILE_BYTES} bytes{}", .0.map(|n| format!(", the file has {n}")).unwrap_or_default())]
    TooLarge(Option<u64>),
    #[error("line {line}, column {column}: not UTF-8 (a configuration file is UTF-8 text)")]
    NotUtf8 { line: usize, column: usize },
}

impl FileText {
    /// Reads the file; an unreadable one or one that is no TOML is an error naming it as it was
    /// given (`named_by`; the TOML parser's words give the line and column).
    pub fn read(path: &Path, named_by: super::FileNamedBy) -> Result<Self, ConfigError> {
        let file_error = |reason: String| ConfigError::File {
            path: path.to_path_buf(),
            named_by,
            reason,
        };
        let text = read_regular(path).map_err(|e| file_error(e.to_string()))?;
        let table = text
            .parse::<toml::Table>()
            .map_err(|e| file_error(syntax_error(&text, &e)))?;
        let pipelines = table
            .get("pipelines")
            .and_then(toml::Value::as_array)
            .map_or(0, Vec::len);
        if pipelines > MAX_PIPELINES {
            return Err(file_error(format!(
                "expected at most {MAX_PIPELINES} [[pipelines]] entries, the file has \
                 {pipelines}: run several instances, each with a file of its own or \
                 `--pipelines` naming its share"
            )));
        }
        drop(table);
        Ok(Self::new(path.to_path_buf(), text))
    }

    /// The file `path` holding `text` (valid TOML, or no key is found in it).
    pub(super) fn new(path: PathBuf, text: String) -> Self {
        let top = DeTable::parse(&text)
            .map(|root| {
                root.get_ref()
                    .iter()
                    .map(|(k, _)| {
                        (
                            AsRef::<str>::as_ref(k.get_ref()).to_string(),
                            k.span().start,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self { path, text, top }
    }

    /// Refuses a top-level key that is no setting, naming the file, the line and the closest
    /// setting.
    pub fn check_keys(&self) -> Result<(), ConfigError> {
        let Ok(root) = DeTable::parse(&self.text) else {
            return Ok(());
        };
        for (key, _) in root.get_ref().iter() {
            let key: &str = key.get_ref();
            if key != "pipelines" && !RULES.iter().any(|(k, _)| *k == key) {
                return Err(ConfigError::Unknown {
                    key: key.to_string(),
                    at: self.at(&[key.to_string()]),
                    closest: closest(key, file_keys(), false).map(Into::into),
                });
            }
        }
        Ok(())
    }

    /// The file at the key `path` (table keys and list indexes, `["pipelines", "0", "name"]`):
    /// with the line of the key, or of the deepest part of the path the file has.
    pub fn at(&self, path: &[String]) -> Origin {
        Origin::File {
            path: self.path.clone(),
            line: self.offset_of(path).map(|at| line_of(&self.text, at)),
        }
    }

    /// The byte offset of the key at `path`, or of the deepest part of it the file has.
    pub(super) fn offset_of(&self, path: &[String]) -> Option<usize> {
        if let [key] = path {
            return self.top.iter().find(|(k, _)| k == key).map(|(_, at)| *at);
        }
        let root = DeTable::parse(&self.text).ok()?;
        let mut table: Option<&DeTable> = Some(root.get_ref());
        let mut list: Option<&[Spanned<DeValue>]> = None;
        let mut found = None;
        for segment in path {
            let next: &Spanned<DeValue> = if let Some(t) = table {
                let Some((key, value)) = t
                    .iter()
                    .find(|(k, _)| AsRef::<str>::as_ref(k.get_ref()) == segment.as_str())
                else {
                    break;
                };
                found = Some(key.span().start);
                value
            } else if let Some(items) = list {
                let Some(value) = segment.parse::<usize>().ok().and_then(|i| items.get(i)) else {
                    break;
                };
                // A `[[pipelines]]` entry: where its first key is (its own span may be empty).
                found = first_key(value).or(Some(value.span().start)).or(found);
                value
            } else {
                break;
            };
            (table, list) = match next.get_ref() {
                DeValue::Table(t) => (Some(t), None),
                DeValue::Array(a) => (None, Some(&a[..])),
                _ => (None, None),
            };
        }
        found
    }

    /// The name of the `index`-th `[[pipelines]]` entry, if it has one.
    fn pipeline_name(&self, index: usize) -> Option<String> {
        let table: toml::Table = self.text.parse().ok()?;
        let name = table.get("pipelines")?.get(index)?.get("name")?.as_str()?;
        Some(name.to_string())
    }

    /// The `table` of child table `child` of the `index`-th `[[pipelines]]` entry, if it has one.
    fn child_table(&self, index: usize, child: &str) -> Option<String> {
        let table: toml::Table = self.text.parse().ok()?;
        let entry = table.get("pipelines")?.get(index)?;
        let name = entry
            .get("children")?
            .get(child.parse::<usize>().ok()?)?
            .get("table")?
            .as_str()?;
        Some(name.to_string())
    }

    /// `pipelines.orders` (or `pipelines[2]` for an entry without a name).
    fn pipeline_label(&self, index: usize) -> String {
        self.pipeline_name(index)
            .map_or(format!("pipelines[{index}]"), |n| format!("pipelines.{n}"))
    }
}

/// The keys a file may have at its top: every setting and `pipelines`.
fn file_keys() -> impl Iterator<Item = &'static str> {
    RULES
        .iter()
        .map(|(k, _)| *k)
        .chain(std::iter::once("pipelines"))
}

/// Where the first key of a table value starts.
fn first_key(value: &Spanned<DeValue>) -> Option<usize> {
    match value.get_ref() {
        DeValue::Table(t) => t.iter().map(|(k, _)| k.span().start).min(),
        _ => None,
    }
}

/// The 1-based line of the byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |before| before.matches('\n').count() + 1)
}

/// Where the value of `key` was given: a flag, an environment variable, the file or the
/// defaults, in the order the layers win.
pub(super) fn origin_of(key: &str, sources: &Sources, file: Option<&FileText>) -> Origin {
    if sources.overrides.contains_key(key) {
        // An override set by code (a test's) was given by no one: nothing to point at.
        return sources
            .given
            .get(key)
            .map_or(Origin::Default, |given| Origin::Flag(given.clone()));
    }
    if sources.use_env
        && let Some(name) = env_name_of(key)
    {
        return Origin::Env(name);
    }
    match file {
        Some(file) if file.offset_of(&[key.to_string()]).is_some() => file.at(&[key.to_string()]),
        _ => Origin::Default,
    }
}

/// `error` said where its value came from: a pipeline entry's error with the file and line, a
/// setting's with its origin (unless it is a default: then the error is about a combination,
/// and says so itself).
pub(super) fn place(
    error: ConfigError,
    sources: &Sources,
    file: Option<&FileText>,
    closest: Option<String>,
) -> ConfigError {
    let at = match (&error, file) {
        (ConfigError::Entry { index, field, .. }, Some(file)) => {
            let mut path = vec!["pipelines".to_string(), index.to_string()];
            path.extend(field.iter().cloned());
            file.at(&path)
        }
        (ConfigError::Invalid { setting, .. }, _) => {
            let key = setting
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_ascii_lowercase();
            if !RULES.iter().any(|(k, _)| *k == key) {
                return error;
            }
            match origin_of(&key, sources, file) {
                Origin::Default => return error,
                at => at,
            }
        }
        _ => return error,
    };
    let error = match error {
        ConfigError::Entry { error, .. } => *error,
        other => other,
    };
    ConfigError::At {
        at,
        error: Box::new(error),
        closest,
    }
}

/// A figment error of the typed parse in warren's words. Every setting was checked by its rule
/// before, so what reaches the typed parse is a `[[pipelines]]` entry of the file: named with
/// the file, the line, the pipeline and the field.
pub(super) fn from_figment(error: figment::Error, file: Option<&FileText>) -> ConfigError {
    let path: Vec<String> = error
        .path
        .iter()
        .filter(|s| !s.is_empty())
        .cloned()
        .collect();
    let index = path.get(1).and_then(|i| i.parse::<usize>().ok());
    match (path.first().map(String::as_str), index, file) {
        (Some("pipelines"), Some(index), Some(file)) => {
            entry_error(file, index, &path[2..], error.kind)
        }
        // `[pipelines]` (one table) where `[[pipelines]]` (a list of tables) was meant.
        (Some("pipelines"), None, Some(file)) if path.len() == 1 => {
            let got = match &error.kind {
                Kind::InvalidType(actual, _) => shown(actual),
                other => other.to_string(),
            };
            ConfigError::At {
                at: file.at(&path),
                error: Box::new(ConfigError::Invalid {
                    setting: "pipelines".into(),
                    expected: "a list of entries, each opening with [[pipelines]] (two brackets)"
                        .into(),
                    got,
                }),
                closest: None,
            }
        }
        _ => ConfigError::Other(without_source(&error.to_string(), file)),
    }
}

/// A parser's message without the source lines it quotes (`  3 | amqp_url = "..."`, which may
/// hold a password or `CONTROL_SECRET`), and with the file named where it says "TOML source
/// string".
fn without_source(message: &str, file: Option<&FileText>) -> String {
    let quoted = |line: &str| {
        let t = line.trim_start();
        let digits = t.trim_start_matches(|c: char| c.is_ascii_digit());
        digits.trim_start().starts_with('|')
    };
    let kept: Vec<&str> = message.lines().filter(|l| !quoted(l)).collect();
    let text = kept
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    match file {
        Some(f) => text.replace("TOML source string", &f.path.display().to_string()),
        None => text,
    }
}

/// What a refused value in a pipeline entry is shown as: never a secret. A setting misplaced
/// under a pipeline (`control_secret = ...` after a `[pipelines.columns]` table) is refused as
/// the entry's, with its value: hidden when the key names a secret setting, a URL's password
/// redacted.
fn guarded(key: Option<&str>, got: String) -> String {
    let secret = key.is_some_and(|key| {
        RULES
            .iter()
            .any(|(k, rule)| k.eq_ignore_ascii_case(key) && matches!(rule, super::Rule::Secret))
    });
    if secret {
        "a value (not shown: it is a secret)".into()
    } else {
        super::redact_url(&got)
    }
}

/// The error `kind` at `field` (a path in the entry) of the `index`-th pipeline of `file`.
fn entry_error(file: &FileText, index: usize, field: &[String], kind: Kind) -> ConfigError {
    let label = file.pipeline_label(index);
    let full = |field: &[String]| {
        let mut path = vec!["pipelines".to_string(), index.to_string()];
        path.extend(field.iter().cloned());
        path
    };
    let setting = |field: &[String]| {
        std::iter::once(label.clone())
            .chain(field.iter().cloned())
            .collect::<Vec<_>>()
            .join(".")
    };
    let at = file.at(&full(field));
    let invalid = |expected: String, got: String, closest: Option<String>| ConfigError::At {
        at: at.clone(),
        error: Box::new(ConfigError::Invalid {
            setting: setting(field),
            expected,
            got: guarded(field.last().map(String::as_str), got),
        }),
        closest,
    };
    match kind {
        Kind::UnknownField(key, expected) => {
            // The key may already end the path (figment prefixes the entry's key to its error).
            let mut within = field.to_vec();
            if within.last() == Some(&key) {
                within.pop();
            }
            let mut key_path = within.clone();
            key_path.push(key.clone());
            let name = file
                .pipeline_name(index)
                .unwrap_or_else(|| format!("pipelines[{index}]"));
            let child = |i: &str| {
                file.child_table(index, i)
                    .map_or(format!("child table {i}"), |t| format!("child table {t}"))
            };
            let table = match within.as_slice() {
                [columns, column, ..] if columns == "columns" => {
                    format!("pipeline {name}, column {column}")
                }
                [children, i, columns, column, ..]
                    if children == "children" && columns == "columns" =>
                {
                    format!("pipeline {name}, {}, column {column}", child(i))
                }
                [children, i, ..] if children == "children" => {
                    format!("pipeline {name}, {}", child(i))
                }
                _ => format!("pipeline {name}"),
            };
            ConfigError::UnknownKey {
                at: file.at(&full(&key_path)),
                table,
                closest: closest(&key, expected.iter().copied(), false).map(Into::into),
                key,
            }
        }
        Kind::UnknownVariant(got, expected) => invalid(
            format!("one of {}", expected.join(", ")),
            format!("{got:?}"),
            closest(&got, expected.iter().copied(), true).map(Into::into),
        ),
        Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
            // The setting's own name (`retry_ttls_ms` for `retry_ttls_ms.0`): a duration with a
            // unit means a number only for a setting in `_ms` or `_s`.
            let name = field
                .iter()
                .rev()
                .find(|f| f.parse::<usize>().is_err())
                .map_or("", String::as_str);
            let hint = value_hint(&actual, &expected, name);
            invalid(in_words(&expected), shown(&actual), hint)
        }
        Kind::MissingField(key) => ConfigError::At {
            at,
            error: Box::new(ConfigError::Invalid {
                setting: format!("{}.{key}", setting(field)),
                expected: "a value (the key is required)".into(),
                got: "nothing".into(),
            }),
            closest: None,
        },
        other => ConfigError::At {
            at,
            error: Box::new(ConfigError::Pipeline(format!(
                "{}: {other}",
                setting(field)
            ))),
            closest: None,
        },
    }
}

/// serde's name of an expected type in warren's words.
fn in_words(expected: &str) -> String {
    match expected {
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a whole number".into(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a sequence" => "a list".into(),
        "a map" => "a table".into(),
        other if other.starts_with("struct ") => "a table".into(),
        other => other.into(),
    }
}

/// How a value of the wrong type is shown.
fn shown(actual: &Actual) -> String {
    match actual {
        Actual::Str(s) => format!("{s:?}"),
        Actual::Unsigned(n) => n.to_string(),
        Actual::Signed(n) => n.to_string(),
        Actual::Float(n) => n.to_string(),
        Actual::Bool(b) => b.to_string(),
        Actual::Seq => "a list".into(),
        Actual::Map => "a table".into(),
        other => other.to_string(),
    }
}

/// What was probably meant by a value of the wrong type: a number written as a string, a
/// boolean as a word, a list as a comma-separated string.
fn value_hint(actual: &Actual, expected: &str, key: &str) -> Option<String> {
    let Actual::Str(text) = actual else {
        return None;
    };
    match in_words(expected).as_str() {
        "a whole number" | "an integer" | "a number" => number_hint(text, key),
        "true or false" => bool_hint(text),
        "a list" => {
            // `"1s,1m"` for `retry_ttls_ms`: `[1000, 60000]` (review R46a F4).
            let items: Option<Vec<u64>> = text
                .split(',')
                .map(|t| number_hint(t, key).and_then(|n| n.parse::<u64>().ok()))
                .collect();
            items.map(|items| {
                let items: Vec<String> = items.iter().map(u64::to_string).collect();
                format!("[{}]", items.join(", "))
            })
        }
        _ => None,
    }
}

/// The number meant by `text` for the setting `key`: `"500"` (quoted), `10_000` or `10,000`
/// (separated), or a duration with a unit (`10s`) for a setting in `_ms` or `_s` (`10000`).
pub(super) fn number_hint(text: &str, key: &str) -> Option<String> {
    let text = text.trim();
    let plain: String = text.chars().filter(|c| !matches!(c, '_' | ',')).collect();
    // `1_000`, `1,000`, `"5.0"`: the integer it means.
    if let Some(n) = scaled(&plain, 1) {
        return Some(n.to_string());
    }
    let digits = text
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .count();
    let unit = match text[digits..].trim() {
        "ms" => 1,
        "s" => 1000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        _ => return None,
    };
    // `1.5s`: 1500 ms (review R46a F4: no suggestion for a decimal with a unit).
    let ms = scaled(&text[..digits], unit)?;
    if key.ends_with("_ms") {
        Some(ms.to_string())
    } else if key.ends_with("_s") && ms.is_multiple_of(1000) {
        Some((ms / 1000).to_string())
    } else {
        None
    }
}

/// `number` (digits, at most one decimal point) times `unit`, when that is a whole number:
/// computed in decimal, not in floats (`1.1` s is 1100 ms, not 1100.0000000000002).
fn scaled(number: &str, unit: u64) -> Option<u64> {
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty())
        || !digits(whole)
        || !digits(fraction)
        || fraction.len() > 18
    {
        return None;
    }
    let parse = |s: &str| match s {
        "" => Some(0u128),
        _ => s.parse::<u128>().ok(),
    };
    let scale = 10u128.pow(fraction.len() as u32);
    let total = parse(whole)?
        .checked_mul(scale)?
        .checked_add(parse(fraction)?)?
        .checked_mul(u128::from(unit))?;
    match total % scale {
        0 => u64::try_from(total / scale).ok(),
        _ => None,
    }
}

/// The list of retry TTLs meant by `text`, each entry as [`number_hint`] reads a value in ms
/// (`"1s,1m"`: `1000,60000`); none unless every entry means one.
pub(super) fn ttls_hint(text: &str) -> Option<String> {
    let entries: Option<Vec<String>> = text
        .split(',')
        .map(|entry| number_hint(entry, "ttl_ms"))
        .collect();
    let entries = entries?;
    let meant = entries.join(",");
    (meant != text.trim()).then_some(meant)
}

/// The boolean meant by a word: `yes`, `on`, `1` are true; `no`, `off`, `0` false.
pub(super) fn bool_hint(text: &str) -> Option<String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "y" | "on" | "1" | "enabled" => Some("true".into()),
        "false" | "no" | "n" | "off" | "0" | "disabled" => Some("false".into()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> FileText {
        FileText::new(PathBuf::from("w.toml"), text.into())
    }

    /// Review R46a F4: a decimal, a decimal with a unit and a list of durations are offered
    /// the value meant; what means no whole value is offered nothing.
    #[test]
    fn decimals_and_lists_of_durations_get_the_value_meant() {
        for (text, key, meant) in [
            ("5.0", "batch_size", Some("5")),
            ("1_000", "batch_size", Some("1000")),
            ("5.5", "batch_size", None),
            ("1.5s", "batch_timeout_ms", Some("1500")),
            ("1.1s", "batch_timeout_ms", Some("1100")),
            ("0.25m", "batch_timeout_ms", Some("15000")),
            ("1.0005s", "batch_timeout_ms", None),
            ("1.5s", "timeout_s", None),
            ("2.0s", "timeout_s", Some("2")),
            (".", "batch_size", None),
            ("1..5s", "batch_timeout_ms", None),
            ("99999999999999999999999s", "batch_timeout_ms", None),
        ] {
            assert_eq!(number_hint(text, key).as_deref(), meant, "{text} for {key}");
        }
        for (text, meant) in [
            ("1s,1m", Some("1000,60000")),
            ("1s, 10s, 1.5m", Some("1000,10000,90000")),
            ("1000,60000", None),
            ("1s,x", None),
            ("", None),
        ] {
            assert_eq!(ttls_hint(text).as_deref(), meant, "{text}");
        }
    }

    /// A byte that is not UTF-8 is named by its line and column (review R35h F10: the
    /// standard library's words, no line).
    #[test]
    fn a_file_that_is_not_utf8_is_refused_naming_where() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("utf.toml");
        std::fs::write(&path, b"batch_size = 5\n# \xff\xfe\n").expect("write");
        let err = read_regular(&path).expect_err("not UTF-8");
        assert_eq!(
            err.to_string(),
            "line 2, column 3: not UTF-8 (a configuration file is UTF-8 text)"
        );
    }

    fn line(at: Origin) -> Option<usize> {
        match at {
            Origin::File { line, .. } => line,
            other => panic!("not the file: {other:?}"),
        }
    }

    #[test]
    fn a_key_is_found_at_its_line_in_tables_lists_and_inline_tables() {
        let f = file(
            "prefetch = 10\n\n[[pipelines]]\nname = \"a\"\n\n[[pipelines]]\nname = \"b\"\n\
             batch_size = 5\n[pipelines.columns]\nid = { path = \"/id\", type = \"uuid\" }\n",
        );
        let at = |path: &[&str]| {
            let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
            line(f.at(&path))
        };
        assert_eq!(at(&["prefetch"]), Some(1));
        assert_eq!(at(&["pipelines", "0", "name"]), Some(4));
        assert_eq!(at(&["pipelines", "1", "batch_size"]), Some(8));
        assert_eq!(at(&["pipelines", "1", "columns", "id", "type"]), Some(10));
        // A key the entry does not have: the entry, where its first key is.
        assert_eq!(at(&["pipelines", "1", "main_queue"]), Some(7));
        assert_eq!(at(&["nothing"]), None);
        assert_eq!(f.pipeline_label(1), "pipelines.b");
        assert_eq!(f.pipeline_label(5), "pipelines[5]");
    }

    #[test]
    fn the_value_meant_is_offered_only_when_it_is_plain() {
        assert_eq!(
            number_hint("500", "users_batch_size").as_deref(),
            Some("500")
        );
        assert_eq!(number_hint("10_000", "x").as_deref(), Some("10000"));
        assert_eq!(number_hint("10,000", "x").as_deref(), Some("10000"));
        assert_eq!(number_hint("2s", "retry_ttl_ms").as_deref(), Some("2000"));
        assert_eq!(number_hint("1m", "retry_ttl_ms").as_deref(), Some("60000"));
        assert_eq!(
            number_hint("30s", "amqp_heartbeat_s").as_deref(),
            Some("30")
        );
        // A unit the setting's name does not take, and what is no number at all.
        assert_eq!(number_hint("2s", "users_batch_size"), None);
        assert_eq!(number_hint("abc", "retry_ttl_ms"), None);
        assert_eq!(number_hint("-1", "retry_ttl_ms"), None);
        assert_eq!(bool_hint("Yes").as_deref(), Some("true"));
        assert_eq!(bool_hint("off").as_deref(), Some("false"));
        assert_eq!(bool_hint("maybe"), None);
    }

    #[test]
    fn a_check_across_settings_is_placed_where_its_setting_was_given() {
        let sources = Sources {
            use_env: false,
            ..Sources::default()
        }
        .with_override("users_min_concurrency", "9");
        let error = ConfigError::Invalid {
            setting: "USERS_MIN_CONCURRENCY".into(),
            expected: "at most USERS_MAX_CONCURRENCY (8)".into(),
            got: "9".into(),
        };
        assert_eq!(
            place(error, &sources, None, None).to_string(),
            "--users-min-concurrency 9: USERS_MIN_CONCURRENCY: expected at most \
             USERS_MAX_CONCURRENCY (8), got 9"
        );
        // A default is nobody's: the error stays as it was.
        let error = ConfigError::Invalid {
            setting: "PREFETCH".into(),
            expected: "x".into(),
            got: "y".into(),
        };
        assert_eq!(
            place(error, &sources, None, None).to_string(),
            "PREFETCH: expected x, got y"
        );
    }
}
