//! A pipeline as data: the mapping from a JSON message (and its AMQP headers) to the columns of
//! an existing table, declared in the configuration (`[[pipelines]]`), and the [`Domain`] it is.
//! A spec ([`MappingSpec`], from a pipeline's entry: `config::pipelines::PipelineConfig`) is
//! checked and compiled ([`Mapping::compile`]): each column takes a JSON Pointer (RFC 6901) into
//! the body (`""` is the whole body) or a header, a type, and optional checks; decoding a body
//! yields one cell per column, or a rejection naming the path, what was expected and what was
//! found. Every pipeline is one, the built-in users pipeline included. `values.rs` holds the
//! checks of one value; `insert.rs` writes a batch with one statement (`on_conflict = keep |
//! update`), `lookup.rs` answers the API's questions to the table; `schema.rs` checks the mapping against
//! the table before anything is consumed; `children.rs` holds the child tables filled from arrays
//! of the message (`[[pipelines.children]]`), written in the parent row's transaction; `spec.rs`
//! the spec as the configuration gives it.

mod children;
mod delete;
mod insert;
mod lookup;
mod names;
mod pattern;
mod spec;
pub use delete::Op;
pub use lookup::{Refusal, Standing, Trial, Unstorable};
use names::identifier;
pub use names::{NameError, TableName, TableNameError, quote};
pub use spec::*;
pub mod schema;
mod strict;
mod values;
mod versions;

pub use strict::parse as parse_strict;
pub use strict::{DEPTH_MAX, too_deep, too_deep_reason};
use values::*;
pub use values::{
    CheckError, EMAIL_MAX, EmailProblem, PointerError, ValueError, body_fields, email_problem,
    line_problem, pg_uuid,
};

use std::collections::HashSet;

use futures::future::BoxFuture;
use serde_json::Value;

use super::{Domain, Envelope, Inserted, Rejection};
use crate::db::error::DbError;

/// A mistake in a pipeline's spec, naming the pipeline and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pipeline {pipeline}: {problem}")]
pub struct SpecError {
    pub pipeline: String,
    pub problem: String,
    /// The key at fault, as its path in the pipeline's entry (`["columns", "qty", "min"]`,
    /// `["key"]`; empty: the entry as a whole): the configuration places the error at its line.
    pub field: Vec<String>,
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
    /// A property of the message (the original's, on a copy warren republished).
    Property(Property),
    /// A child column: the parent row's column (its index in the parent's columns).
    Parent(usize),
    /// A child column: the element's position in its array, from 1.
    Index,
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
    /// The values accepted (`one_of`), as cells of the column's type.
    one_of: Option<OneOf>,
    /// Text: the regular expression a value must hold a match of (`pattern.rs`).
    pattern: Option<pattern::Pattern>,
    /// The cell of a value that is absent (`default = <value>`), checked at compile time
    /// against the type and every check of the column.
    default: Option<Cell>,
}

/// A column's `one_of`: the cells accepted, and their list as a reason shows it.
#[derive(Debug, Clone)]
struct OneOf {
    cells: Vec<Cell>,
    shown: String,
}

/// The types a `one_of` compares, exactly as PostgreSQL's `=` does.
const ONE_OF_TYPES: [ColType; 4] = [ColType::Text, ColType::Int4, ColType::Int8, ColType::Uuid];

impl Column {
    /// A column of `ty` from `source` with no checks.
    fn new(name: &str, source: Source, ty: ColType) -> Self {
        Self {
            name: name.to_string(),
            source,
            ty,
            optional: false,
            min: None,
            max: None,
            min_len: None,
            max_len: None,
            format: None,
            one_of: None,
            pattern: None,
            default: None,
        }
    }

    /// Sets the column's `one_of` and `pattern` (the spec's), checked: `Err` is the key at
    /// fault and what is wrong. Each value of `one_of` must pass the column's type and other
    /// checks.
    fn set_checks(
        &mut self,
        one_of: Option<&[Value]>,
        pattern: Option<&str>,
    ) -> Result<(), (&'static str, String)> {
        if let Some(source) = pattern {
            if self.ty != ColType::Text {
                return Err(("pattern", format!("pattern is for text, not {}", self.ty)));
            }
            self.pattern = Some(
                pattern::Pattern::compile(source)
                    .map_err(|e| ("pattern", format!("pattern: {e}")))?,
            );
        }
        if let Some(values) = one_of {
            if !ONE_OF_TYPES.contains(&self.ty) {
                return Err((
                    "one_of",
                    format!(
                        "one_of is for text, int4, int8 and uuid (values compared exactly), not {}",
                        self.ty
                    ),
                ));
            }
            if values.is_empty() {
                return Err(("one_of", "one_of: name at least one value".into()));
            }
            let mut cells = Vec::with_capacity(values.len());
            for v in values {
                let cell = self
                    .probe(v)
                    .map_err(|words| ("one_of", format!("one_of: the value {v}: {words}")))?;
                if !cells.contains(&cell) {
                    cells.push(cell);
                }
            }
            let shown: Vec<String> = cells.iter().map(shown_cell).collect();
            self.one_of = Some(OneOf {
                cells,
                shown: shown.join(", "),
            });
        }
        Ok(())
    }

    /// `value` as a message's value of this column would be read and checked, or what is
    /// wrong with it (`expected a string, found the number 5`, `expected at least 1, found 0`).
    fn probe(&self, value: &Value) -> Result<Cell, String> {
        let mut probe = self.clone();
        probe.source = Source::Path {
            pointer: String::new(),
            segments: Vec::new(),
        };
        probe.optional = false;
        probe.default = None;
        Mapping::cell(&probe, &value.to_string(), value, None, None).map_err(|e| match &e {
            ValueError::Check(check) => check.expected(),
            other => other.to_string(),
        })
    }

    /// Sets the column's `default` (the spec's value), after checking it as a message's value
    /// of the column would be checked: `Err` names what is wrong with it (`expected a string,
    /// found the number 5`, `expected at least 1, found 0`).
    fn set_default(&mut self, value: Option<&Value>) -> Result<(), String> {
        let Some(value) = value else {
            return Ok(());
        };
        if value.is_null() {
            return Err(
                "default: expected a value of the column's type (null is no default: an \
                 optional column is NULL when its field is absent)"
                    .into(),
            );
        }
        self.default = Some(
            self.probe(value)
                .map_err(|words| format!("default: {words}"))?,
        );
        Ok(())
    }

    /// Where its value is, as a reason names it: the path, `the body`, or `header <name>`.
    fn at(&self) -> String {
        match &self.source {
            Source::Path { pointer, .. } if pointer.is_empty() => "the body".into(),
            Source::Path { pointer, .. } => pointer.clone(),
            Source::Header(h) => format!("header {h}"),
            Source::Property(p) => format!("property {p}"),
            Source::Parent(_) => "the parent row".into(),
            Source::Index => "the element's position".into(),
        }
    }

    /// The reason's words for what is wrong with its value, named by where it was looked for:
    /// a value a declared check refused as users always said it, the field then the rule (`name
    /// must not be empty`, `customer/email must be a valid email address ...`); anything else by
    /// its path, then what was expected and found (`/id: missing (a uuid is required)`).
    fn reason(&self, error: &ValueError) -> String {
        match (error, &self.source) {
            (ValueError::Check(check), Source::Path { pointer, .. }) if !pointer.is_empty() => {
                format!("{} {check}", &pointer[1..])
            }
            (ValueError::Check(check), _) => format!("{} {check}", self.at()),
            (other, _) => format!("{}: {other}", self.at()),
        }
    }
}

/// A refused message: the rejection (its kind and the reason the DLQ carries), and each field
/// at fault, for an answer that names them.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub rejection: Rejection,
    /// Empty when the body as a whole is at fault (empty, not UTF-8, not JSON, a key twice,
    /// not an object).
    pub problems: Vec<Problem>,
}

impl From<Rejection> for Refused {
    fn from(rejection: Rejection) -> Self {
        Self {
            rejection,
            problems: Vec::new(),
        }
    }
}

/// One field at fault in a refused message.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// A top-level field no column reads (`unknown_fields = "reject"`).
    Unknown(String),
    /// A column's value: the column, and what is wrong with it.
    Column { column: String, error: ValueError },
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
    /// Whether a required column reads a field of an object (not an array's item): a body
    /// that is no object is then refused as the wrong shape.
    reads_object: bool,
    /// The insert statements, built once.
    statements: insert::Statements,
    /// The statements again with the casts of the table's enum columns, built when the table
    /// is first written (`None`: it has none, `statements` serve).
    bound: std::sync::Arc<tokio::sync::OnceCell<Option<insert::Statements>>>,
    /// Per column, its place in the table (`attnum`), learnt with `bound`: a reason that lists
    /// several columns lists them in the table's order (`another name and email`).
    attnums: std::sync::Arc<std::sync::OnceLock<Vec<i16>>>,
    /// The child tables, in the spec's order (each message's [`Row::1`] holds their rows in
    /// this order).
    children: Vec<children::Child>,
    /// Which messages delete their key's row, and the table of its tombstones (`delete.rs`).
    delete: Option<delete::Delete>,
}

impl Mapping {
    /// Checks `spec` of pipeline `pipeline` and compiles it. Every mistake names the pipeline and
    /// the setting: a column without a source or with two, a path that is not a JSON Pointer, a
    /// check that does not fit the type, a key column not mapped, `update` without a mapped
    /// `version_column`.
    pub fn compile(pipeline: &str, spec: &MappingSpec) -> Result<Self, SpecError> {
        let err_at = |field: &[&str], problem: String| SpecError {
            pipeline: pipeline.to_string(),
            problem,
            field: field.iter().map(|f| f.to_string()).collect(),
        };
        let table = TableName::parse(&spec.table).map_err(|e| err_at(&["table"], e.to_string()))?;
        if spec.columns.is_empty() {
            return Err(err_at(
                &["columns"],
                "columns: at least one column is needed".into(),
            ));
        }
        let mut columns = Vec::with_capacity(spec.columns.len());
        let mut fields = HashSet::new();
        for (name, c) in &spec.columns {
            // The column's mistake, placed at its key `key` (or at the column, "").
            let at_key = |key: &str, p: String| {
                let field: &[&str] = if key.is_empty() {
                    &["columns", name]
                } else {
                    &["columns", name, key]
                };
                err_at(field, format!("columns.{name}: {p}"))
            };
            let at = |p: String| at_key("", p);
            identifier(name).map_err(|e| at(e.to_string()))?;
            let source = match (&c.path, &c.header) {
                (Some(_), Some(_)) => {
                    return Err(at_key("header", "give a path or a header, not both".into()));
                }
                (Some(_), None) | (None, Some(_)) if c.property.is_some() => {
                    return Err(at_key(
                        "property",
                        "give one of path, header or property, not two".into(),
                    ));
                }
                (None, None) => match c.property {
                    Some(p) => {
                        let fits = match p {
                            Property::Timestamp => c.ty == ColType::Timestamptz,
                            _ => matches!(c.ty, ColType::Text | ColType::Uuid),
                        };
                        if !fits {
                            return Err(at_key(
                                "type",
                                format!(
                                    "property {p} is read as {}, not {}",
                                    if p == Property::Timestamp {
                                        "timestamptz"
                                    } else {
                                        "text or uuid"
                                    },
                                    c.ty
                                ),
                            ));
                        }
                        Source::Property(p)
                    }
                    None => {
                        return Err(at(
                            "give a path (a JSON Pointer into the body, \"\" for the whole body), a \
                             header or a property"
                                .into(),
                        ));
                    }
                },
                (Some(pointer), None) => {
                    let segments =
                        pointer_segments(pointer).map_err(|e| at_key("path", e.to_string()))?;
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
                        return Err(at_key(
                            "header",
                            "header: expected a name of 1 to 255 bytes".into(),
                        ));
                    }
                    Source::Header(header.clone())
                }
            };
            if (c.min.is_some() || c.max.is_some()) && !c.ty.is_number() {
                let key = if c.min.is_some() { "min" } else { "max" };
                return Err(at_key(
                    key,
                    format!(
                        "min and max are for numbers (int4, int8, float8, numeric), not {}",
                        c.ty
                    ),
                ));
            }
            if let (Some(lo), Some(hi)) = (c.min, c.max)
                && lo > hi
            {
                return Err(at_key("min", format!("min {lo} is above max {hi}")));
            }
            if (c.min_len.is_some() || c.max_len.is_some() || c.format.is_some())
                && c.ty != ColType::Text
            {
                let key = match (c.min_len, c.max_len) {
                    (Some(_), _) => "min_len",
                    (None, Some(_)) => "max_len",
                    (None, None) => "format",
                };
                return Err(at_key(
                    key,
                    format!("min_len, max_len and format are for text, not {}", c.ty),
                ));
            }
            if let (Some(lo), Some(hi)) = (c.min_len, c.max_len)
                && lo > hi
            {
                return Err(at_key(
                    "min_len",
                    format!("min_len {lo} is above max_len {hi}"),
                ));
            }
            let mut column = Column {
                optional: c.optional,
                min: c.min,
                max: c.max,
                min_len: c.min_len,
                max_len: c.max_len,
                format: c.format,
                ..Column::new(name, source, c.ty)
            };
            column
                .set_checks(c.one_of.as_deref(), c.pattern.as_deref())
                .map_err(|(key, p)| at_key(key, p))?;
            column
                .set_default(c.default.as_ref())
                .map_err(|p| at_key("default", p))?;
            columns.push(column);
        }
        let index_of = |name: &str| columns.iter().position(|c| c.name == name);
        let err = |key: &str, problem: String| err_at(&[key], problem);
        if spec.key.is_empty() {
            return Err(err(
                "key",
                "key: name the columns of a primary key or unique index".into(),
            ));
        }
        let mut key = Vec::with_capacity(spec.key.len());
        for k in &spec.key {
            let i = index_of(k)
                .ok_or_else(|| err("key", format!("key: column {k:?} is not among the columns")))?;
            if columns[i].optional {
                return Err(err(
                    "key",
                    format!("key: column {k:?} is optional; a key is never NULL"),
                ));
            }
            if key.contains(&i) {
                return Err(err("key", format!("key: column {k:?} named twice")));
            }
            key.push(i);
        }
        let version = match (spec.on_conflict, &spec.version_column) {
            (OnConflict::Update, None) => {
                return Err(err(
                    "on_conflict",
                    "on_conflict = \"update\" needs version_column (a stored row is replaced only by a higher version)"
                        .into(),
                ));
            }
            (OnConflict::Keep, Some(_)) => {
                return Err(err(
                    "version_column",
                    "version_column is for on_conflict = \"update\" only".into(),
                ));
            }
            (OnConflict::Keep, None) => None,
            (OnConflict::Update, Some(v)) => {
                let i = index_of(v).ok_or_else(|| {
                    err(
                        "version_column",
                        format!("version_column {v:?} is not among the columns"),
                    )
                })?;
                if !matches!(
                    columns[i].ty,
                    ColType::Int4 | ColType::Int8 | ColType::Numeric | ColType::Timestamptz
                ) {
                    return Err(err(
                        "version_column",
                        format!(
                            "version_column {v:?} is {}; expected int4, int8, numeric or timestamptz",
                            columns[i].ty
                        ),
                    ));
                }
                if columns[i].optional {
                    return Err(err(
                        "version_column",
                        format!("version_column {v:?} cannot be optional"),
                    ));
                }
                if key.contains(&i) {
                    return Err(err(
                        "version_column",
                        format!("version_column {v:?} is a key column"),
                    ));
                }
                Some(i)
            }
        };
        let delete = match &spec.delete {
            None => None,
            Some(d) => {
                let read: Vec<&Column> = key.iter().chain(&version).map(|&i| &columns[i]).collect();
                let d = delete::Delete::compile(pipeline, d, spec.on_conflict, &read).map_err(
                    |(at, problem)| match at {
                        "delete" => err("delete", problem),
                        at => err_at(&["delete", at], problem),
                    },
                )?;
                fields.insert(d.first_field().to_string());
                Some(d)
            }
        };
        let tombstones = delete.as_ref().map(|d| &d.tombstones);
        let statements =
            insert::Statements::build(&table, &columns, &key, version, &[], tombstones);
        let mut reads_object = columns.iter().any(|c| match &c.source {
            Source::Path { segments, .. } => {
                !c.optional
                    && segments
                        .first()
                        .is_some_and(|f| !f.bytes().all(|b| b.is_ascii_digit()))
            }
            _ => false,
        });
        let mut compiled_children = Vec::with_capacity(spec.children.len());
        for (n, child) in spec.children.iter().enumerate() {
            let c = children::Child::compile(n, child, &table, &columns, &key, version, tombstones)
                .map_err(|problem| {
                    err_at(
                        &["children", &n.to_string()],
                        format!("children.{}: {problem}", child.table),
                    )
                })?;
            if let Some(first) = c.first_field() {
                fields.insert(first.to_string());
                reads_object |= !c.optional() && !first.bytes().all(|b| b.is_ascii_digit());
            }
            compiled_children.push(c);
        }
        children::distinct_tables(&table, &compiled_children)
            .map_err(|problem| err("children", problem))?;
        Ok(Self {
            pipeline: pipeline.to_string(),
            table,
            columns,
            key,
            on_conflict: spec.on_conflict,
            version,
            unknown_fields: spec.unknown_fields,
            fields,
            reads_object,
            statements,
            bound: Default::default(),
            attnums: Default::default(),
            children: compiled_children,
            delete,
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
        lookup::find_by_key(self, client, key).await
    }

    /// Whether PostgreSQL can hold `record`'s values in the table's columns (`Ok(Err(refusal))`
    /// when it refuses one), as the pipeline's insert would write them; nothing is written.
    pub async fn storable(
        &self,
        client: &tokio_postgres::Client,
        record: &Row,
    ) -> Result<Result<(), Unstorable>, tokio_postgres::Error> {
        lookup::storable(self, client, record).await
    }

    /// What the table holds for `record` ([`Standing`]), as the pipeline's insert would find it;
    /// nothing is written. Asked by the API before it publishes (`api_check`).
    pub async fn standing(
        &self,
        client: &deadpool_postgres::Client,
        record: &Row,
    ) -> Result<Standing, DbError> {
        lookup::standing(self, client, record).await
    }

    /// What the live tables make of `record`'s parent and child rows, written by the
    /// pipeline's own statements in a transaction that is rolled back ([`Trial`]; `warren
    /// pipelines test --db`): nothing stays.
    pub async fn trial(
        &self,
        client: &tokio_postgres::Client,
        record: &Row,
    ) -> Result<Trial, DbError> {
        lookup::trial(self, client, record).await
    }

    /// Each child table: its name, the pointer to its array, its most rows per message, and
    /// its column names in the order of the cells of a [`ChildRows`] row.
    pub fn child_tables(&self) -> impl Iterator<Item = (&TableName, &str, usize, Vec<&str>)> {
        self.children.iter().map(|c| {
            (
                &c.table,
                c.rows(),
                c.max_rows(),
                c.columns.iter().map(|c| c.name.as_str()).collect(),
            )
        })
    }

    /// The delete spec: the field's pointer and the value that means delete (shown as a
    /// reason shows it), and warren's tombstone table of the pipeline.
    pub fn delete(&self) -> Option<(&str, String, &TableName)> {
        self.delete
            .as_ref()
            .map(|d| (d.field.as_str(), d.shown_value(), &d.tombstones))
    }

    /// (column, type, optional) in the spec's order.
    pub fn columns(&self) -> impl Iterator<Item = (&str, ColType, bool)> {
        self.columns
            .iter()
            .map(|c| (c.name.as_str(), c.ty, c.optional))
    }

    /// Column names (of this mapping) in the table's order once it is known, else as given.
    fn in_table_order<'a>(&self, names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
        let mut names: Vec<&str> = names.collect();
        if let Some(attnums) = self.attnums.get() {
            names.sort_by_key(|n| {
                self.columns
                    .iter()
                    .position(|c| c.name == *n)
                    .and_then(|i| attnums.get(i).copied())
                    .unwrap_or(i16::MAX)
            });
        }
        names
    }

    /// Whether a required column reads a field of an object: a body that is no object is then
    /// refused as the wrong shape.
    pub fn reads_object(&self) -> bool {
        self.reads_object
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

    /// Decodes one message: its body (and headers) into one cell per column, or why not. No
    /// properties: a property column is absent (NULL when optional, its default, or refused).
    pub fn decode_message(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Row, Rejection> {
        self.decode_detailed(body, headers).map_err(|r| r.rejection)
    }

    /// As [`Mapping::decode_message`], and a refusal also names each field at fault
    /// ([`Problem`]), for an answer that lists them (the API's 422). Nothing more is built on
    /// the way to a row.
    pub fn decode_detailed(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Row, Refused> {
        self.decode_full(body, headers, None)
    }

    /// Decodes one delivered message: body, headers and properties (`envelope`).
    pub fn decode_envelope(&self, body: &[u8], envelope: &Envelope<'_>) -> Result<Row, Refused> {
        self.decode_full(body, envelope.properties.headers().as_ref(), Some(envelope))
    }

    fn decode_full(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
        envelope: Option<&Envelope<'_>>,
    ) -> Result<Row, Refused> {
        if body.is_empty() {
            return Err(Rejection::json("empty body").into());
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
            // JSON, but deeper than warren reads: said so, as a payload it will not take.
            _ if strict::too_deep(&e) => Rejection::payload(strict::too_deep_reason(&e)),
            _ => Rejection::json(format!("not JSON: {e}")),
        })?;
        // Fields are read from an object: another value is the wrong shape, said as such rather
        // than as every required column missing.
        if self.reads_object && !doc.is_object() {
            return Err(Rejection::payload(format!(
                "the body: expected a JSON object (the columns read its fields), found {}",
                found(&doc)
            ))
            .into());
        }
        if self.unknown_fields == UnknownFields::Reject
            && let Value::Object(map) = &doc
        {
            let mut unknown: Vec<&String> =
                map.keys().filter(|k| !self.fields.contains(*k)).collect();
            if !unknown.is_empty() {
                unknown.sort();
                let list: Vec<String> = unknown.iter().map(|k| format!("/{k}")).collect();
                return Err(Refused {
                    rejection: Rejection::payload(format!(
                        "unknown field{} {} (unknown_fields = \"reject\")",
                        if list.len() == 1 { "" } else { "s" },
                        list.join(", ")
                    )),
                    problems: unknown
                        .into_iter()
                        .map(|k| Problem::Unknown(k.clone()))
                        .collect(),
                });
            }
        }
        if let Some(d) = &self.delete
            && d.matches(&doc)
        {
            return self.decode_delete(text, &doc, headers, envelope);
        }
        let mut cells = Vec::with_capacity(self.columns.len());
        let mut problems = Vec::new();
        for c in &self.columns {
            match Self::cell(c, text, &doc, headers, envelope) {
                Ok(cell) => cells.push(cell),
                Err(p) => problems.push((c, p)),
            }
        }
        let mut rows = Vec::with_capacity(self.children.len());
        let mut child_problems: Vec<(String, Problem)> = Vec::new();
        for child in &self.children {
            match child.decode(self, text, &doc, &cells, headers) {
                Ok(r) => rows.push(r),
                Err(mut found) => {
                    rows.push(Vec::new());
                    child_problems.append(&mut found);
                }
            }
        }
        if problems.is_empty() && child_problems.is_empty() {
            return Ok(Row(cells, rows, Op::Write));
        }
        if problems.len() > 1 {
            // In the order the body gives its fields (a field it lacks, or a header, after).
            let order = values::body_fields(text);
            problems.sort_by_key(|(c, _)| match &c.source {
                Source::Path { segments, .. } => segments
                    .first()
                    .and_then(|f| order.iter().position(|o| o == f))
                    .unwrap_or(usize::MAX),
                _ => usize::MAX,
            });
        }
        let mut reason: Vec<String> = problems.iter().map(|(c, e)| c.reason(e)).collect();
        reason.extend(child_problems.iter().map(|(r, _)| r.clone()));
        Err(Refused {
            rejection: Rejection::payload(reason.join("; ")),
            problems: problems
                .into_iter()
                .map(|(c, error)| Problem::Column {
                    column: c.name.clone(),
                    error,
                })
                .chain(child_problems.into_iter().map(|(_, p)| p))
                .collect(),
        })
    }

    /// The top-level fields of a body the columns read, sorted.
    pub fn fields(&self) -> Vec<&str> {
        let mut fields: Vec<&str> = self.fields.iter().map(String::as_str).collect();
        fields.sort_unstable();
        fields
    }

    /// The top-level field of the body column `column` reads its value from (its path is
    /// `/<field>`), if it reads one so.
    pub fn field_of(&self, column: &str) -> Option<&str> {
        match &self.columns.iter().find(|c| c.name == column)?.source {
            Source::Path { segments, .. } if segments.len() == 1 => Some(segments[0].as_str()),
            _ => None,
        }
    }

    /// One column's cell, or what is wrong with its value.
    fn cell(
        c: &Column,
        text: &str,
        doc: &Value,
        headers: Option<&lapin::types::FieldTable>,
        envelope: Option<&Envelope<'_>>,
    ) -> Result<Cell, ValueError> {
        let value = match &c.source {
            Source::Path { segments, .. } => lookup(doc, segments).cloned(),
            Source::Property(p) => match envelope {
                Some(e) => property(*p, e)?,
                None => None,
            },
            // Filled by the child table's decode, never looked up.
            Source::Parent(_) | Source::Index => None,
            Source::Header(h) => match headers
                .and_then(|t| t.inner().get(h.as_str()))
                .map(header_json)
            {
                Some(Err(amqp_type)) => {
                    return Err(ValueError::Unfit(format!(
                        "expected {}, found {amqp_type} (a header column reads a string, a \
                         number, a boolean or void)",
                        expects(c.ty)
                    )));
                }
                Some(Ok(v)) => Some(v),
                None => None,
            },
        };
        let value = match value {
            None if c.default.is_some() => return Ok(c.default.clone().unwrap_or(Cell::Null)),
            None | Some(Value::Null) if c.optional => return Ok(Cell::Null),
            None => return Err(ValueError::Missing(c.ty)),
            Some(Value::Null) => return Err(ValueError::Null(c.ty)),
            Some(v) => v,
        };
        let wrong = |v: &Value| ValueError::WrongType {
            expected: c.ty,
            found: found(v),
        };
        let cell = match c.ty {
            ColType::Text => match value {
                Value::String(s) => {
                    check_text(c, &s)?;
                    Cell::Text(s)
                }
                other => return Err(wrong(&other)),
            },
            ColType::Uuid => match &value {
                // As PostgreSQL's uuid input reads it, braces and groupings included.
                Value::String(s) => Cell::Uuid(
                    pg_uuid(s)
                        .ok_or_else(|| unfit(format!("expected a UUID, found {:?}", clip(s))))?,
                ),
                other => return Err(wrong(other)),
            },
            ColType::Int4 | ColType::Int8 => {
                // As written: `-0` is 0 (serde_json reads it as a float).
                let written = || match &c.source {
                    Source::Path { segments, .. } => raw_number(text, segments),
                    _ => None,
                };
                let n = strict::integer(&value, written).ok_or_else(|| wrong(&value))?;
                check_range(c, n as f64, &n.to_string())?;
                if c.ty == ColType::Int4 {
                    Cell::Int4(i32::try_from(n).map_err(|_| {
                        unfit(format!(
                            "{n} does not fit an int4 (-2147483648 to 2147483647)"
                        ))
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
                    return Err(unfit(format!(
                        "the number {} is too small for a float8 (below the smallest double, \
                         about 4.9e-324; PostgreSQL refuses it as out of range): map it as \
                         numeric to keep it",
                        clip(&raw)
                    )));
                }
                check_range(c, n, &n.to_string())?;
                Cell::Float8(n)
            }
            ColType::Numeric => {
                let digits = match &value {
                    Value::Number(_) => match &c.source {
                        // The number as written: the parsed value would have lost digits.
                        Source::Path { segments, .. } => {
                            raw_number(text, segments).unwrap_or_else(|| value.to_string())
                        }
                        _ => value.to_string(),
                    },
                    Value::String(s) if is_decimal(s) => s.clone(),
                    Value::String(s) => {
                        return Err(unfit(format!(
                            "expected a number or a string holding a decimal, found {:?}",
                            clip(s)
                        )));
                    }
                    other => return Err(wrong(other)),
                };
                if !numeric_fits(&digits) {
                    return Err(unfit(format!(
                        "{} is beyond PostgreSQL's numeric (at most 131072 digits before the \
                         point and 16383 after)",
                        clip(&digits)
                    )));
                }
                let approx: f64 = digits.parse().unwrap_or(f64::NAN);
                check_range(c, approx, &digits)?;
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
                        unfit(format!(
                            "expected an RFC 3339 time, found {:?} ({e})",
                            clip(s)
                        ))
                    })?;
                    check_year(t.year(), s)?;
                    // PostgreSQL reads UTC offsets up to 15:59 either way.
                    if t.offset().whole_minutes().unsigned_abs() > 15 * 60 + 59 {
                        return Err(unfit(format!(
                            "expected a UTC offset from -15:59 to +15:59 (what PostgreSQL \
                             reads), found {:?}",
                            clip(s)
                        )));
                    }
                    Cell::Timestamptz(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Date => match &value {
                Value::String(s) => {
                    let format = time::macros::format_description!("[year]-[month]-[day]");
                    let d = time::Date::parse(s, format).map_err(|e| {
                        unfit(format!(
                            "expected a date YYYY-MM-DD, found {:?} ({e})",
                            clip(s)
                        ))
                    })?;
                    check_year(d.year(), s)?;
                    if s.starts_with(['+', '-']) {
                        return Err(unfit(format!(
                            "expected a date YYYY-MM-DD, its year without a sign, found {:?}",
                            clip(s)
                        )));
                    }
                    Cell::Date(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Jsonb => {
                if contains_nul(&value) {
                    return Err(unfit(
                        "holds U+0000, which PostgreSQL's jsonb cannot store".into(),
                    ));
                }
                // The JSON as written (jsonb keeps a number's digits; a parsed float would not).
                let raw = match &c.source {
                    Source::Path { segments, .. } => raw_json(text, segments),
                    _ => None,
                };
                let json = raw.unwrap_or_else(|| value.to_string());
                if let Some(n) = strict::number_beyond_numeric(&json) {
                    return Err(unfit(format!(
                        "holds the number {}, beyond what PostgreSQL's jsonb stores (a numeric: \
                         at most 131072 digits before the point and 16383 after)",
                        clip(n)
                    )));
                }
                Cell::Jsonb(json)
            }
        };
        if let Some(one_of) = &c.one_of
            && !one_of.cells.contains(&cell)
        {
            return Err(CheckError::NotOneOf {
                allowed: one_of.shown.clone(),
                found: shown_cell(&cell),
            }
            .into());
        }
        Ok(cell)
    }
}

/// A cell of a `one_of` column as a reason shows it (`EUR`, `7`).
fn shown_cell(cell: &Cell) -> String {
    match cell {
        Cell::Text(s) => values::shown(s),
        Cell::Uuid(u) => u.to_string(),
        Cell::Int4(n) => n.to_string(),
        Cell::Int8(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// The value of property `p` of a delivered message, as JSON (absent: `None`); the exchange
/// and routing key are where the original was published (`headers::origin`), the timestamp an
/// RFC 3339 time of its seconds.
fn property(p: Property, e: &Envelope<'_>) -> Result<Option<Value>, ValueError> {
    let text = |s: &Option<lapin::types::ShortString>| {
        s.as_ref().map(|s| Value::String(s.as_str().to_string()))
    };
    let props = e.properties;
    Ok(match p {
        Property::MessageId => text(props.message_id()),
        Property::CorrelationId => text(props.correlation_id()),
        Property::Type => text(props.kind()),
        Property::AppId => text(props.app_id()),
        Property::ContentType => text(props.content_type()),
        Property::Exchange | Property::RoutingKey => {
            let (ex, rk) = crate::amqp::headers::origin(props, e.exchange, e.routing_key);
            let v = if p == Property::Exchange { ex } else { rk };
            Some(Value::String(v.into_owned()))
        }
        Property::Timestamp => match *props.timestamp() {
            None => None,
            Some(t) => {
                let time = i64::try_from(t)
                    .ok()
                    .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t).ok())
                    .and_then(|t| {
                        t.format(&time::format_description::well_known::Rfc3339)
                            .ok()
                    })
                    .ok_or_else(|| {
                        unfit(format!(
                            "the timestamp {t} is beyond the times a timestamptz holds"
                        ))
                    })?;
                Some(Value::String(time))
            }
        },
    })
}

/// A value the column's type cannot take, in these words.
fn unfit(words: String) -> ValueError {
    ValueError::Unfit(words)
}

/// A decoded message: one cell per column of its mapping, in the mapping's order; and, per
/// child table of the mapping (in its order), the rows its array gave, each one cell per
/// column of the child table (empty for a mapping without child tables); and whether it
/// writes its key or deletes it (a delete's cells are its key and version, the rest NULL).
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Cell>, pub Vec<ChildRows>, pub Op);

/// The rows one message gives one child table, each one cell per column of the child table.
pub type ChildRows = Vec<Vec<Cell>>;

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

    fn decode_with(&self, body: &[u8], envelope: &Envelope<'_>) -> Result<Row, Rejection> {
        self.decode_envelope(body, envelope)
            .map_err(|r| r.rejection)
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

#[cfg(test)]
mod tests;
#[cfg(test)]
mod users_tests;
