//! A pipeline as data: the mapping from a JSON message (and its AMQP headers) to the columns of
//! an existing table, declared in the configuration (`[[pipelines]]`), and the [`Domain`] it is.
//! A spec ([`PipelineSpec`]) is read from the file and checked ([`Mapping::compile`]): each column
//! takes a JSON Pointer (RFC 6901) into the body (`""` is the whole body) or a header, a type,
//! and optional checks; decoding a body yields one cell per column, or a rejection naming the
//! path, what was expected and what was found. `insert.rs` writes a batch with one statement
//! (`on_conflict = keep | update`); `schema.rs` checks the mapping against the table before
//! anything is consumed.

mod insert;
pub mod schema;
mod strict;

pub use strict::parse as parse_strict;

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use super::{Domain, Inserted, Rejection};
use crate::db::error::DbError;

/// What a configured pipeline says about its data (the queue names and batching live in the
/// pipeline's own settings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingSpec {
    /// The table, `name` or `schema.name`: it must exist (warren never creates or alters it).
    pub table: String,
    /// The columns of a primary key or unique index of the table.
    pub key: Vec<String>,
    #[serde(default)]
    pub on_conflict: OnConflict,
    /// `on_conflict = "update"` only: a stored row is replaced only by a higher version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version_column: Option<String>,
    #[serde(default)]
    pub unknown_fields: UnknownFields,
    /// Column name -> where its value comes from, its type and checks.
    pub columns: BTreeMap<String, ColumnSpec>,
}

/// What the same key with other content does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnConflict {
    /// The stored row stays; a message with the same key and other content is `id_conflict`.
    #[default]
    Keep,
    /// The higher `version_column` wins; an older or equal version changes nothing.
    Update,
}

/// What a top-level field that no column reads does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownFields {
    /// The message is `invalid_payload`, naming the field.
    #[default]
    Reject,
    /// The field is dropped.
    Ignore,
}

/// One column of the table and where its value comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnSpec {
    /// A JSON Pointer into the body; `""` is the whole body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// An AMQP header name instead of a path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(rename = "type")]
    pub ty: ColType,
    /// Absent or null is NULL instead of a rejection.
    #[serde(default, skip_serializing_if = "is_false")]
    pub optional: bool,
    /// Numbers: the least and greatest accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
    /// Text: the fewest and most characters accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_len: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    /// Text: `email` (a plausible address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A text format a column checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// A plausible address such as `ana@example.com` (at most 254 bytes).
    Email,
    /// One line of readable text: not blank (only whitespace) and without what a screen would
    /// not show as written (`users::line_problem`), for names and titles that end up on a screen.
    Line,
}

/// The types a column can take, and how a JSON value becomes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ColType {
    /// A JSON string.
    Text,
    /// A JSON string holding a UUID.
    Uuid,
    /// A JSON integer within 32 bits.
    Int4,
    /// A JSON integer within 64 bits.
    Int8,
    /// A JSON number (finite).
    Float8,
    /// A JSON number, or a string holding a decimal; its digits are kept as written.
    Numeric,
    /// A JSON boolean.
    Bool,
    /// A JSON string in RFC 3339 (`2026-11-24T10:00:00Z`).
    Timestamptz,
    /// A JSON string `YYYY-MM-DD`.
    Date,
    /// Any JSON value, stored as it is.
    Jsonb,
}

impl ColType {
    /// Every type, in the order the docs list them.
    pub const ALL: [ColType; 10] = [
        ColType::Text,
        ColType::Uuid,
        ColType::Int4,
        ColType::Int8,
        ColType::Float8,
        ColType::Numeric,
        ColType::Bool,
        ColType::Timestamptz,
        ColType::Date,
        ColType::Jsonb,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ColType::Text => "text",
            ColType::Uuid => "uuid",
            ColType::Int4 => "int4",
            ColType::Int8 => "int8",
            ColType::Float8 => "float8",
            ColType::Numeric => "numeric",
            ColType::Bool => "bool",
            ColType::Timestamptz => "timestamptz",
            ColType::Date => "date",
            ColType::Jsonb => "jsonb",
        }
    }

    fn is_number(self) -> bool {
        matches!(
            self,
            ColType::Int4 | ColType::Int8 | ColType::Float8 | ColType::Numeric
        )
    }
}

impl fmt::Display for ColType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mistake in a pipeline's spec, naming the pipeline and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pipeline {pipeline}: {problem}")]
pub struct SpecError {
    pub pipeline: String,
    pub problem: String,
}

/// Where a column's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// A JSON Pointer, as its unescaped segments (none: the whole body).
    Path {
        pointer: String,
        segments: Vec<String>,
    },
    Header(String),
}

/// One compiled column.
#[derive(Debug, Clone)]
struct Column {
    name: String,
    source: Source,
    ty: ColType,
    optional: bool,
    min: Option<f64>,
    max: Option<f64>,
    min_len: Option<usize>,
    max_len: Option<usize>,
    /// The text format checked, if any.
    format: Option<Format>,
}

/// A table name, split and checked: `schema.name` or `name` (then `DATABASE_SCHEMA`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: Option<String>,
    pub name: String,
}

impl TableName {
    fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split('.').collect();
        let (schema, name) = match parts.as_slice() {
            [name] => (None, *name),
            [schema, name] => (Some(*schema), *name),
            _ => return Err(format!("table {text:?}: expected name or schema.name")),
        };
        for part in schema.iter().chain([&name]) {
            identifier(part).map_err(|e| format!("table {text:?}: {e}"))?;
        }
        Ok(Self {
            schema: schema.map(str::to_string),
            name: name.to_string(),
        })
    }

    /// The name quoted for SQL.
    pub fn sql(&self) -> String {
        match &self.schema {
            Some(s) => format!("{}.{}", quote(s), quote(&self.name)),
            None => quote(&self.name),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// Checks a table, schema or column name: an SQL identifier warren quotes, so it is taken as
/// written (letters, digits, `_`, `$`; not starting with a digit; at most 63 bytes).
fn identifier(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit() || c == '$')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a name warren takes (letters, digits, _ and $, not starting with a \
             digit, at most 63 bytes)"
        ))
    }
}

/// `name` quoted as an SQL identifier.
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A checked mapping: the [`Domain`] of a configured pipeline.
#[derive(Debug, Clone)]
pub struct Mapping {
    /// The pipeline's name, for messages.
    pipeline: String,
    table: TableName,
    /// The columns, in the order of the spec (by name).
    columns: Vec<Column>,
    /// Indices of the key columns.
    key: Vec<usize>,
    on_conflict: OnConflict,
    /// Index of the version column (`update` only).
    version: Option<usize>,
    unknown_fields: UnknownFields,
    /// The top-level fields the paths read (`unknown_fields = "reject"` refuses others; the
    /// whole body, `""`, reads none).
    fields: HashSet<String>,
    /// The insert statements, built once.
    statements: insert::Statements,
    /// The statements again with the casts of the table's enum columns, built when the table
    /// is first written (`None`: it has none, `statements` serve).
    bound: std::sync::Arc<tokio::sync::OnceCell<Option<insert::Statements>>>,
}

impl Mapping {
    /// Checks `spec` of pipeline `pipeline` and compiles it. Every mistake names the pipeline and
    /// the setting: a column without a source or with two, a path that is not a JSON Pointer, a
    /// check that does not fit the type, a key column not mapped, `update` without a mapped
    /// `version_column`.
    pub fn compile(pipeline: &str, spec: &MappingSpec) -> Result<Self, SpecError> {
        let err = |problem: String| SpecError {
            pipeline: pipeline.to_string(),
            problem,
        };
        let table = TableName::parse(&spec.table).map_err(err)?;
        if spec.columns.is_empty() {
            return Err(err("columns: at least one column is needed".into()));
        }
        let mut columns = Vec::with_capacity(spec.columns.len());
        let mut fields = HashSet::new();
        for (name, c) in &spec.columns {
            let at = |p: String| err(format!("columns.{name}: {p}"));
            identifier(name).map_err(at)?;
            let source = match (&c.path, &c.header) {
                (Some(_), Some(_)) => {
                    return Err(at("give a path or a header, not both".into()));
                }
                (None, None) => {
                    return Err(at(
                        "give a path (a JSON Pointer into the body, \"\" for the whole body) or a header"
                            .into(),
                    ));
                }
                (Some(pointer), None) => {
                    let segments = pointer_segments(pointer).map_err(at)?;
                    if let Some(first) = segments.first() {
                        fields.insert(first.clone());
                    }
                    Source::Path {
                        pointer: pointer.clone(),
                        segments,
                    }
                }
                (None, Some(header)) => {
                    if header.is_empty() || header.len() > 255 {
                        return Err(at("header: expected a name of 1 to 255 bytes".into()));
                    }
                    Source::Header(header.clone())
                }
            };
            if (c.min.is_some() || c.max.is_some()) && !c.ty.is_number() {
                return Err(at(format!(
                    "min and max are for numbers (int4, int8, float8, numeric), not {}",
                    c.ty
                )));
            }
            if let (Some(lo), Some(hi)) = (c.min, c.max)
                && lo > hi
            {
                return Err(at(format!("min {lo} is above max {hi}")));
            }
            if (c.min_len.is_some() || c.max_len.is_some() || c.format.is_some())
                && c.ty != ColType::Text
            {
                return Err(at(format!(
                    "min_len, max_len and format are for text, not {}",
                    c.ty
                )));
            }
            if let (Some(lo), Some(hi)) = (c.min_len, c.max_len)
                && lo > hi
            {
                return Err(at(format!("min_len {lo} is above max_len {hi}")));
            }
            columns.push(Column {
                name: name.clone(),
                source,
                ty: c.ty,
                optional: c.optional,
                min: c.min,
                max: c.max,
                min_len: c.min_len,
                max_len: c.max_len,
                format: c.format,
            });
        }
        let index_of = |name: &str| columns.iter().position(|c| c.name == name);
        if spec.key.is_empty() {
            return Err(err(
                "key: name the columns of a primary key or unique index".into(),
            ));
        }
        let mut key = Vec::with_capacity(spec.key.len());
        for k in &spec.key {
            let i = index_of(k)
                .ok_or_else(|| err(format!("key: column {k:?} is not among the columns")))?;
            if columns[i].optional {
                return Err(err(format!(
                    "key: column {k:?} is optional; a key is never NULL"
                )));
            }
            if key.contains(&i) {
                return Err(err(format!("key: column {k:?} named twice")));
            }
            key.push(i);
        }
        let version = match (spec.on_conflict, &spec.version_column) {
            (OnConflict::Update, None) => {
                return Err(err(
                    "on_conflict = \"update\" needs version_column (a stored row is replaced only by a higher version)"
                        .into(),
                ));
            }
            (OnConflict::Keep, Some(_)) => {
                return Err(err(
                    "version_column is for on_conflict = \"update\" only".into()
                ));
            }
            (OnConflict::Keep, None) => None,
            (OnConflict::Update, Some(v)) => {
                let i = index_of(v)
                    .ok_or_else(|| err(format!("version_column {v:?} is not among the columns")))?;
                if !matches!(
                    columns[i].ty,
                    ColType::Int4 | ColType::Int8 | ColType::Numeric | ColType::Timestamptz
                ) {
                    return Err(err(format!(
                        "version_column {v:?} is {}; expected int4, int8, numeric or timestamptz",
                        columns[i].ty
                    )));
                }
                if columns[i].optional {
                    return Err(err(format!("version_column {v:?} cannot be optional")));
                }
                if key.contains(&i) {
                    return Err(err(format!("version_column {v:?} is a key column")));
                }
                Some(i)
            }
        };
        let statements = insert::Statements::build(&table, &columns, &key, version, &[]);
        Ok(Self {
            pipeline: pipeline.to_string(),
            table,
            columns,
            key,
            on_conflict: spec.on_conflict,
            version,
            unknown_fields: spec.unknown_fields,
            fields,
            statements,
            bound: Default::default(),
        })
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The row whose one-column key equals `key` (text, as a path gives it), converted and
    /// compared by PostgreSQL as the pipeline's insert would store it; as JSON text.
    pub async fn find_by_key(
        &self,
        client: &tokio_postgres::Client,
        key: &str,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        insert::find_by_key(self, client, key).await
    }

    /// Whether PostgreSQL can hold `record`'s values in the table's columns (`Ok(Err(reason))`
    /// when it refuses one), as the pipeline's insert would write them; nothing is written.
    pub async fn storable(
        &self,
        client: &tokio_postgres::Client,
        record: &Row,
    ) -> Result<Result<(), String>, tokio_postgres::Error> {
        insert::storable(self, client, record).await
    }

    /// (column, type, optional) in the spec's order.
    pub fn columns(&self) -> impl Iterator<Item = (&str, ColType, bool)> {
        self.columns
            .iter()
            .map(|c| (c.name.as_str(), c.ty, c.optional))
    }

    /// The key's column names.
    pub fn key(&self) -> Vec<&str> {
        self.key
            .iter()
            .map(|&i| self.columns[i].name.as_str())
            .collect()
    }

    /// The version column, with `on_conflict = "update"`.
    pub fn version_column(&self) -> Option<&str> {
        self.version.map(|i| self.columns[i].name.as_str())
    }

    pub fn on_conflict(&self) -> OnConflict {
        self.on_conflict
    }

    /// Decodes one message: its body (and headers) into one cell per column, or why not.
    pub fn decode_message(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Row, Rejection> {
        if body.is_empty() {
            return Err(Rejection::json("empty body"));
        }
        let text = std::str::from_utf8(body)
            .map_err(|e| Rejection::json(format!("body is not UTF-8: {e}")))?;
        let doc: Value = strict::parse(text).map_err(|e| match e.classify() {
            // A repeated key in JSON that is otherwise well formed; cut short or broken
            // further on, it is not JSON.
            serde_json::error::Category::Data => {
                match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                    Ok(_) => Rejection::payload(e.to_string()),
                    Err(syntax) => Rejection::json(format!("not JSON: {syntax}")),
                }
            }
            _ => Rejection::json(format!("not JSON: {e}")),
        })?;
        if self.unknown_fields == UnknownFields::Reject
            && let Value::Object(map) = &doc
        {
            let mut unknown: Vec<&String> =
                map.keys().filter(|k| !self.fields.contains(*k)).collect();
            if !unknown.is_empty() {
                unknown.sort();
                let list: Vec<String> = unknown.iter().map(|k| format!("/{k}")).collect();
                return Err(Rejection::payload(format!(
                    "unknown field{} {} (unknown_fields = \"reject\")",
                    if list.len() == 1 { "" } else { "s" },
                    list.join(", ")
                )));
            }
        }
        let mut cells = Vec::with_capacity(self.columns.len());
        let mut problems = Vec::new();
        for c in &self.columns {
            match self.cell(c, text, &doc, headers) {
                Ok(cell) => cells.push(cell),
                Err(p) => problems.push(p),
            }
        }
        if problems.is_empty() {
            Ok(Row(cells))
        } else {
            Err(Rejection::payload(problems.join("; ")))
        }
    }

    /// One column's cell, or what is wrong with its value.
    fn cell(
        &self,
        c: &Column,
        text: &str,
        doc: &Value,
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Cell, String> {
        let (at, value) = match &c.source {
            Source::Path { pointer, segments } => {
                let shown = if pointer.is_empty() {
                    "the body".to_string()
                } else {
                    pointer.clone()
                };
                (shown, lookup(doc, segments).cloned())
            }
            Source::Header(h) => {
                let at = format!("header {h}");
                let value = match headers
                    .and_then(|t| t.inner().get(h.as_str()))
                    .map(header_json)
                {
                    Some(Err(amqp_type)) => {
                        return Err(format!(
                            "{at}: expected {}, found {amqp_type} (a header column reads a \
                             string, a number, a boolean or void)",
                            expects(c.ty)
                        ));
                    }
                    Some(Ok(v)) => Some(v),
                    None => None,
                };
                (at, value)
            }
        };
        let value = match value {
            None | Some(Value::Null) if c.optional => return Ok(Cell::Null),
            None => return Err(format!("{at}: missing (a {} is required)", c.ty)),
            Some(Value::Null) => return Err(format!("{at}: null (a {} is required)", c.ty)),
            Some(v) => v,
        };
        let wrong = |v: &Value| format!("{at}: expected {}, found {}", expects(c.ty), found(v));
        let cell = match c.ty {
            ColType::Text => match value {
                Value::String(s) => {
                    check_text(c, &at, &s)?;
                    Cell::Text(s)
                }
                other => return Err(wrong(&other)),
            },
            ColType::Uuid => match &value {
                Value::String(s) => Cell::Uuid(
                    s.parse()
                        .map_err(|_| format!("{at}: expected a UUID, found {:?}", clip(s)))?,
                ),
                other => return Err(wrong(other)),
            },
            ColType::Int4 | ColType::Int8 => {
                // As written: `-0` is 0 (serde_json reads it as a float).
                let written = || match &c.source {
                    Source::Path { segments, .. } => raw_number(text, segments),
                    Source::Header(_) => None,
                };
                let n = strict::integer(&value, written).ok_or_else(|| wrong(&value))?;
                check_range(c, &at, n as f64, &n.to_string())?;
                if c.ty == ColType::Int4 {
                    Cell::Int4(i32::try_from(n).map_err(|_| {
                        format!("{at}: {n} does not fit an int4 (-2147483648 to 2147483647)")
                    })?)
                } else {
                    Cell::Int8(n)
                }
            }
            ColType::Float8 => {
                let n = match &value {
                    Value::Number(n) => n.as_f64().ok_or_else(|| wrong(&value))?,
                    other => return Err(wrong(other)),
                };
                // A number below the smallest double parses to 0: PostgreSQL's float8 refuses
                // it (`select '1e-400'::float8`: out of range), so warren never stores 0 for it.
                if n == 0.0
                    && let Source::Path { segments, .. } = &c.source
                    && let Some(raw) = raw_number(text, segments)
                    && raw
                        .split(['e', 'E'])
                        .next()
                        .is_some_and(|m| m.bytes().any(|b| (b'1'..=b'9').contains(&b)))
                {
                    return Err(format!(
                        "{at}: the number {} is too small for a float8 (below the smallest \
                         double, about 4.9e-324; PostgreSQL refuses it as out of range): map it \
                         as numeric to keep it",
                        clip(&raw)
                    ));
                }
                check_range(c, &at, n, &n.to_string())?;
                Cell::Float8(n)
            }
            ColType::Numeric => {
                let digits = match &value {
                    Value::Number(_) => match &c.source {
                        // The number as written: the parsed value would have lost digits.
                        Source::Path { segments, .. } => {
                            raw_number(text, segments).unwrap_or_else(|| value.to_string())
                        }
                        Source::Header(_) => value.to_string(),
                    },
                    Value::String(s) if is_decimal(s) => s.clone(),
                    Value::String(s) => {
                        return Err(format!(
                            "{at}: expected a number or a string holding a decimal, found {:?}",
                            clip(s)
                        ));
                    }
                    other => return Err(wrong(other)),
                };
                if !numeric_fits(&digits) {
                    return Err(format!(
                        "{at}: {} is beyond PostgreSQL's numeric (at most 131072 digits before \
                         the point and 16383 after)",
                        clip(&digits)
                    ));
                }
                let approx: f64 = digits.parse().unwrap_or(f64::NAN);
                check_range(c, &at, approx, &digits)?;
                Cell::Numeric(digits)
            }
            ColType::Bool => match value {
                Value::Bool(b) => Cell::Bool(b),
                other => return Err(wrong(&other)),
            },
            ColType::Timestamptz => match &value {
                Value::String(s) => {
                    let t = time::OffsetDateTime::parse(
                        s,
                        &time::format_description::well_known::Rfc3339,
                    )
                    .map_err(|e| {
                        format!("{at}: expected an RFC 3339 time, found {:?} ({e})", clip(s))
                    })?;
                    check_year(&at, t.year(), s)?;
                    // PostgreSQL reads UTC offsets up to 15:59 either way.
                    if t.offset().whole_minutes().unsigned_abs() > 15 * 60 + 59 {
                        return Err(format!(
                            "{at}: expected a UTC offset from -15:59 to +15:59 (what PostgreSQL \
                             reads), found {:?}",
                            clip(s)
                        ));
                    }
                    Cell::Timestamptz(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Date => match &value {
                Value::String(s) => {
                    let format = time::macros::format_description!("[year]-[month]-[day]");
                    let d = time::Date::parse(s, format).map_err(|e| {
                        format!(
                            "{at}: expected a date YYYY-MM-DD, found {:?} ({e})",
                            clip(s)
                        )
                    })?;
                    check_year(&at, d.year(), s)?;
                    if s.starts_with(['+', '-']) {
                        return Err(format!(
                            "{at}: expected a date YYYY-MM-DD, its year without a sign, found {:?}",
                            clip(s)
                        ));
                    }
                    Cell::Date(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Jsonb => {
                if contains_nul(&value) {
                    return Err(format!(
                        "{at}: holds U+0000, which PostgreSQL's jsonb cannot store"
                    ));
                }
                // The JSON as written (jsonb keeps a number's digits; a parsed float would not).
                let raw = match &c.source {
                    Source::Path { segments, .. } => raw_json(text, segments),
                    Source::Header(_) => None,
                };
                let json = raw.unwrap_or_else(|| value.to_string());
                if let Some(n) = strict::number_beyond_numeric(&json) {
                    return Err(format!(
                        "{at}: holds the number {}, beyond what PostgreSQL's jsonb stores (a \
                         numeric: at most 131072 digits before the point and 16383 after)",
                        clip(n)
                    ));
                }
                Cell::Jsonb(json)
            }
        };
        Ok(cell)
    }
}

/// A decoded message: one cell per column of its mapping, in the mapping's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Cell>);

/// One column's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Null,
    Text(String),
    Uuid(uuid::Uuid),
    Int4(i32),
    Int8(i64),
    Float8(f64),
    /// The digits as written.
    Numeric(String),
    Bool(bool),
    /// RFC 3339, checked.
    Timestamptz(String),
    /// `YYYY-MM-DD`, checked.
    Date(String),
    /// The JSON text as written.
    Jsonb(String),
}

impl Domain for Mapping {
    type Record = Row;

    fn decode(&self, body: &[u8]) -> Result<Row, Rejection> {
        self.decode_message(body, None)
    }

    fn decode_with(
        &self,
        body: &[u8],
        properties: &lapin::BasicProperties,
    ) -> Result<Row, Rejection> {
        self.decode_message(body, properties.headers().as_ref())
    }

    fn insert<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Row],
    ) -> BoxFuture<'a, Result<Inserted, DbError>> {
        Box::pin(insert::insert(self, client, records))
    }

    fn stored<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        record: &'a Row,
    ) -> BoxFuture<'a, Result<bool, DbError>> {
        Box::pin(insert::stored(self, client, record))
    }
}

/// The unescaped segments of a JSON Pointer (RFC 6901): `""` is the whole document, otherwise
/// `/` then segments separated by `/`, with `~1` for `/` and `~0` for `~`.
fn pointer_segments(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!(
            "path {pointer:?} is not a JSON Pointer: it must be \"\" (the whole body) or start with /"
        ));
    };
    rest.split('/')
        .map(|seg| {
            let mut out = String::with_capacity(seg.len());
            let mut chars = seg.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => {
                        return Err(format!(
                            "path {pointer:?} is not a JSON Pointer: ~ must be followed by 0 or 1"
                        ));
                    }
                }
            }
            Ok(out)
        })
        .collect()
}

/// The value at `segments` of `doc` (an array index is a decimal without leading zeros).
fn lookup<'a>(doc: &'a Value, segments: &[String]) -> Option<&'a Value> {
    let mut at = doc;
    for seg in segments {
        at = match at {
            Value::Object(map) => map.get(seg)?,
            Value::Array(items) => {
                if seg.len() > 1 && seg.starts_with('0') {
                    return None;
                }
                items.get(seg.parse::<usize>().ok()?)?
            }
            _ => return None,
        };
    }
    Some(at)
}

/// The text of the number at `segments` of the JSON `text`, as written (numbers lose digits
/// when parsed into a float: `numeric` keeps them).
fn raw_number(text: &str, segments: &[String]) -> Option<String> {
    let s = raw_json(text, segments)?;
    s.starts_with(|c: char| c == '-' || c.is_ascii_digit())
        .then_some(s)
}

/// The JSON text of the value at `segments` of the JSON `text`, as written.
fn raw_json(text: &str, segments: &[String]) -> Option<String> {
    let mut raw: &RawValue = serde_json::from_str(text).ok()?;
    for seg in segments {
        let trimmed = raw.get().trim_start();
        raw = if trimmed.starts_with('{') {
            let map: BTreeMap<String, &RawValue> = serde_json::from_str(raw.get()).ok()?;
            map.get(seg).copied()?
        } else {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).ok()?;
            items.get(seg.parse::<usize>().ok()?).copied()?
        };
    }
    Some(raw.get().trim().to_string())
}

/// Whether `s` is a decimal PostgreSQL's numeric takes: optional sign, digits, an optional
/// fraction, an optional exponent.
fn is_decimal(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e)),
        None => (s, None),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |d: &str| d.chars().all(|c| c.is_ascii_digit());
    (!int.is_empty() || !frac.is_empty())
        && digits(int)
        && digits(frac)
        && exponent.is_none_or(|e| {
            let e = e.strip_prefix(['-', '+']).unwrap_or(e);
            !e.is_empty() && digits(e)
        })
}

/// Whether the decimal `s` (as [`is_decimal`] takes it) is one PostgreSQL's numeric can hold:
/// at most 131072 digits before the point (a zero has none) and a scale of at most 16383, the
/// scale being the digits written after the point minus the exponent, and an exponent below
/// 1073741823 in size (PostgreSQL 15's numeric.c; tests/mapping.rs asks the server itself).
/// Beyond them the server
/// refuses the whole statement ("value overflows numeric format"), which would cost a batch
/// split to find the row.
fn numeric_fits(s: &str) -> bool {
    const MAX_BEFORE_POINT: i64 = 131_072;
    const MAX_SCALE: i64 = 16_383;
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = s.split_once(['e', 'E']).unwrap_or((s, "0"));
    let exponent: i64 = {
        let (negative, digits) = match exponent.strip_prefix('-') {
            Some(d) => (true, d),
            None => (false, exponent.strip_prefix('+').unwrap_or(exponent)),
        };
        let digits = digits.trim_start_matches('0');
        // Past 18 digits it overflows any bound here: saturate.
        let magnitude: i64 = if digits.len() > 18 {
            i64::MAX / 4
        } else {
            digits.parse().unwrap_or(0)
        };
        if negative { -magnitude } else { magnitude }
    };
    // The server refuses any exponent from INT_MAX / 2 on, even on a zero (numeric.c).
    if exponent.abs() >= i64::from(i32::MAX / 2) {
        return false;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let scale = frac.len() as i64 - exponent;
    if scale > MAX_SCALE {
        return false;
    }
    let int = int.trim_start_matches('0');
    let before_point = if !int.is_empty() {
        int.len() as i64
    } else {
        match frac.find(|c| c != '0') {
            Some(zeros) => -(zeros as i64),
            // Zero: no digit before the point, whatever the exponent.
            None => return true,
        }
    };
    before_point + exponent <= MAX_BEFORE_POINT
}

fn check_text(c: &Column, at: &str, s: &str) -> Result<(), String> {
    if s.contains('\0') {
        return Err(format!(
            "{at}: holds U+0000, which PostgreSQL text cannot store"
        ));
    }
    let chars = s.chars().count();
    if let Some(min) = c.min_len
        && chars < min
    {
        return Err(format!(
            "{at}: expected at least {min} characters, found {chars}"
        ));
    }
    if let Some(max) = c.max_len
        && chars > max
    {
        return Err(format!(
            "{at}: expected at most {max} characters, found {chars}"
        ));
    }
    match c.format {
        Some(Format::Email) => {
            if let Some(problem) = super::users::email_problem(s) {
                return Err(format!("{at}: {problem}"));
            }
        }
        Some(Format::Line) => {
            if s.trim().is_empty() {
                return Err(format!(
                    "{at}: expected one line of text, found a blank one"
                ));
            }
            if let Some(what) = super::users::line_problem(s) {
                return Err(format!("{at}: expected one line of text, found {what}"));
            }
        }
        None => {}
    }
    Ok(())
}

fn check_range(c: &Column, at: &str, n: f64, shown: &str) -> Result<(), String> {
    // NaN (a numeric beyond a float's range) is neither above nor below: it passes no bound.
    if let Some(min) = c.min
        && (n.is_nan() || n < min)
    {
        return Err(format!("{at}: expected at least {min}, found {shown}"));
    }
    if let Some(max) = c.max
        && (n.is_nan() || n > max)
    {
        return Err(format!("{at}: expected at most {max}, found {shown}"));
    }
    Ok(())
}

/// What a type expects, for messages.
fn expects(ty: ColType) -> &'static str {
    match ty {
        ColType::Text => "a string",
        ColType::Uuid => "a string holding a UUID",
        ColType::Int4 => "an integer (int4)",
        ColType::Int8 => "an integer (int8)",
        ColType::Float8 => "a number",
        ColType::Numeric => "a number or a string holding a decimal",
        ColType::Bool => "true or false",
        ColType::Timestamptz => "a string holding an RFC 3339 time",
        ColType::Date => "a string holding a date YYYY-MM-DD",
        ColType::Jsonb => "any JSON value",
    }
}

/// What a JSON value is, for messages.
fn found(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {:?}", clip(s)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// `s` cut to 60 characters for a message.
fn clip(s: &str) -> String {
    if s.chars().count() <= 60 {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(60).collect::<String>())
    }
}

fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

/// PostgreSQL reads no year 0 and no negative year in ISO spelling (it writes BC instead): such
/// a date or time is refused here, naming the path, rather than by the database for its batch.
fn check_year(at: &str, year: i32, text: &str) -> Result<(), String> {
    if year < 1 {
        return Err(format!(
            "{at}: expected a year from 0001 (PostgreSQL reads no year 0 or below), found {:?}",
            clip(text)
        ));
    }
    Ok(())
}

/// An AMQP header value as JSON, so a header column reads like a path: strings as strings,
/// integers and floats as numbers, booleans, void as null. Anything else (byte arrays, arrays,
/// tables, decimals, timestamps, a string of invalid UTF-8) has no one JSON reading: `Err`
/// names its AMQP type, and the message is refused rather than stored as some rendering of it.
fn header_json(v: &lapin::types::AMQPValue) -> Result<Value, &'static str> {
    use lapin::types::AMQPValue as A;
    Ok(match v {
        A::LongString(s) => Value::String(
            std::str::from_utf8(s.as_bytes())
                .map_err(|_| "a string of invalid UTF-8")?
                .to_string(),
        ),
        A::ShortString(s) => Value::String(s.as_str().to_string()),
        A::Boolean(b) => Value::Bool(*b),
        A::ShortShortInt(n) => Value::from(*n),
        A::ShortShortUInt(n) => Value::from(*n),
        A::ShortInt(n) => Value::from(*n),
        A::ShortUInt(n) => Value::from(*n),
        A::LongInt(n) => Value::from(*n),
        A::LongUInt(n) => Value::from(*n),
        A::LongLongInt(n) => Value::from(*n),
        A::Float(f) => Value::from(*f as f64),
        A::Double(f) => Value::from(*f),
        A::Void => Value::Null,
        A::ByteArray(_) => return Err("a byte array"),
        A::FieldArray(_) => return Err("a field array"),
        A::FieldTable(_) => return Err("a field table"),
        A::DecimalValue(_) => return Err("an AMQP decimal"),
        A::Timestamp(_) => return Err("an AMQP timestamp"),
    })
}

#[cfg(test)]
mod tests;
