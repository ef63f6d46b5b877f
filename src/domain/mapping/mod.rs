//! A pipeline as data: the mapping from a JSON message (and its AMQP headers) to the columns of
//! an existing table, declared in the configuration (`[[pipelines]]`), and the [`Domain`] it is.
//! A spec ([`MappingSpec`], from a pipeline's entry: `config::pipelines::PipelineConfig`) is
//! checked and compiled ([`Mapping::compile`]): each column takes a JSON Pointer (RFC 6901) into
//! the body (`""` is the whole body) or a header, a type, and optional checks; decoding a body
//! yields one cell per column, or a rejection naming the path, what was expected and what was
//! found. Every pipeline is one, the built-in users pipeline included. `values.rs` holds the
//! checks of one value, `times.rs` those of a time or a date; `insert.rs` writes a batch with one statement (`on_conflict = keep |
//! update`), choosing its path: above `children.rs`, `versions.rs` (`update`'s per-record
//! outcomes), `probe.rs` (the probe's questions), and, at the bottom, `statements.rs` (every
//! statement's text, built once) and `arrays.rs` (a batch as parameters); `lookup.rs` answers the API's questions to the table; `schema.rs` checks the mapping against
//! the table before anything is consumed; `children.rs` holds the child tables filled from arrays
//! of the message (`[[pipelines.children]]`), written in the parent row's transaction; `spec.rs`
//! the spec as the configuration gives it; `decode.rs` one message into its cells.

mod arrays;
mod children;
mod decode;
use decode::shown_cell;
mod delete;
mod insert;
mod lookup;
mod names;
mod pattern;
mod probe;
mod spec;
mod statements;
pub use delete::Op;
pub use lookup::{Refusal, Standing, Trial, Unstorable};
use names::identifier;
pub use names::{NameError, TableName, TableNameError, quote};
pub use spec::*;
pub mod schema;
mod strict;
mod times;
mod values;
mod versions;
mod whole_delete;
pub use versions::{TombstoneTable, tombstone_tables};

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

/// ` (did you mean X?)` when a name of `names` is close to `got` (review R40a F10: a column
/// one letter off got no hint, where every misspelt key of the file gets one), else nothing.
pub(crate) fn meant<'a>(got: &str, names: impl IntoIterator<Item = &'a str>) -> String {
    crate::text::closest(got, names, false)
        .map(|m| format!(" (did you mean {m}?)"))
        .unwrap_or_default()
}

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
    /// `unknown_fields = { keep = "<column>" }`: the body's top-level fields no column reads,
    /// as one JSON object.
    Kept,
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

/// Why a value written in the spec (a `one_of` value, a `default`) is not a value of its
/// column: what a message's value would be told (`expected a string, found the number 5`,
/// `expected at least 1, found 0`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", unfit_words(.0))]
struct Unfit(ValueError);

/// [`Unfit`]'s words: a declared check's expectation, else the value's error as it reads.
fn unfit_words(error: &ValueError) -> String {
    match error {
        ValueError::Check(check) => check.expected(),
        other => other.to_string(),
    }
}

/// Why a column's `default` is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
enum DefaultError {
    #[error(
        "default: expected a value of the column's type (null is no default: an optional \
         column is NULL when its field is absent)"
    )]
    Null,
    #[error("default: {0}")]
    Unfit(Unfit),
}

/// A column's `one_of`: the cells accepted, and their list as a reason shows it.
#[derive(Debug, Clone)]
struct OneOf {
    cells: OneOfSet,
    shown: String,
}

/// The cells of a `one_of`, looked up by hashing: a list of 90,000 values took 26 s to load
/// (each value compared with every one before it) and a message's check walked all of them
/// (review R35g F8).
#[derive(Debug, Clone, Default)]
struct OneOfSet {
    texts: std::collections::HashSet<String>,
    ints: std::collections::HashSet<i64>,
    uuids: std::collections::HashSet<uuid::Uuid>,
}

impl OneOfSet {
    /// Adds `cell` (of the types a `one_of` takes); whether it was not there yet.
    fn insert(&mut self, cell: &Cell) -> bool {
        match cell {
            Cell::Text(t) => self.texts.insert(t.clone()),
            Cell::Int4(n) => self.ints.insert(i64::from(*n)),
            Cell::Int8(n) => self.ints.insert(*n),
            Cell::Uuid(u) => self.uuids.insert(*u),
            _ => false,
        }
    }

    /// Whether `cell` is one of them.
    fn contains(&self, cell: &Cell) -> bool {
        match cell {
            Cell::Text(t) => self.texts.contains(t.as_str()),
            Cell::Int4(n) => self.ints.contains(&i64::from(*n)),
            Cell::Int8(n) => self.ints.contains(n),
            Cell::Uuid(u) => self.uuids.contains(u),
            _ => false,
        }
    }
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
            let mut cells = OneOfSet::default();
            let mut shown = Vec::with_capacity(values.len());
            for v in values {
                let cell = self
                    .probe(v)
                    .map_err(|words| ("one_of", format!("one_of: the value {v}: {words}")))?;
                if cells.insert(&cell) {
                    shown.push(shown_cell(&cell));
                }
            }
            self.one_of = Some(OneOf {
                cells,
                shown: shown.join(", "),
            });
        }
        Ok(())
    }

    /// `value` as a message's value of this column would be read and checked, or what is
    /// wrong with it (`expected a string, found the number 5`, `expected at least 1, found 0`).
    fn probe(&self, value: &Value) -> Result<Cell, Unfit> {
        let mut probe = self.clone();
        probe.source = Source::Path {
            pointer: String::new(),
            segments: Vec::new(),
        };
        probe.optional = false;
        probe.default = None;
        Mapping::cell(&probe, &value.to_string(), value, None, None).map_err(Unfit)
    }

    /// Sets the column's `default` (the spec's value), after checking it as a message's value
    /// of the column would be checked: `Err` names what is wrong with it (`expected a string,
    /// found the number 5`, `expected at least 1, found 0`).
    fn set_default(&mut self, value: Option<&Value>) -> Result<(), DefaultError> {
        let Some(value) = value else {
            return Ok(());
        };
        if value.is_null() {
            return Err(DefaultError::Null);
        }
        self.default = Some(self.probe(value).map_err(DefaultError::Unfit)?);
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
            Source::Kept => "the unknown fields".into(),
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
    statements: statements::Statements,
    /// The statements again with the casts of the table's enum columns, built when the table
    /// is first written (`None`: it has none, `statements` serve).
    bound: std::sync::Arc<tokio::sync::OnceCell<Option<statements::Statements>>>,
    /// Per column, its place in the table (`attnum`), learnt with `bound`: a reason that lists
    /// several columns lists them in the table's order (`another name and email`).
    attnums: std::sync::Arc<std::sync::OnceLock<Vec<i16>>>,
    /// The child tables, in the spec's order (each message's [`Row::1`] holds their rows in
    /// this order).
    children: Vec<children::Child>,
    /// Which messages delete their key's row, and the table of its tombstones (`delete.rs`).
    delete: Option<delete::Delete>,
    /// Whether the table or a child table was found with an enabled trigger of its own by an
    /// `update` mapping with child tables (`versions::parent_triggers`, asked by every batch
    /// until one is found).
    triggers: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether the table is partitioned, learnt when an `update` mapping first writes
    /// (`versions::partitioned`).
    partitioned: std::sync::Arc<tokio::sync::OnceCell<bool>>,
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
                .map_err(|p| at_key("default", p.to_string()))?;
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
            let i = index_of(k).ok_or_else(|| {
                err(
                    "key",
                    format!(
                        "key: column {k:?} is not among the columns{}",
                        meant(k, columns.iter().map(|c| c.name.as_str()))
                    ),
                )
            })?;
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
                        format!(
                            "version_column {v:?} is not among the columns{}",
                            meant(v, columns.iter().map(|c| c.name.as_str()))
                        ),
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
        if let Some(kept) = spec.unknown_fields.keep_column() {
            let at = |p: String| err_at(&["unknown_fields"], format!("unknown_fields: {p}"));
            identifier(kept).map_err(|e| at(format!("keep: {e}")))?;
            if spec.columns.contains_key(kept) {
                return Err(at(format!(
                    "keep = {kept:?} is also among the columns (expected a column of its own, \
                     left out of columns: warren fills it with the fields no column reads)"
                )));
            }
            columns.push(Column::new(kept, Source::Kept, ColType::Jsonb));
        }
        let tombstones = delete.as_ref().map(|d| &d.tombstones);
        let statements =
            statements::Statements::build(&table, &columns, &key, version, &[], tombstones);
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
                    // Placed at the key at fault within the child's entry (a column's line),
                    // not the child's first line (review R35e F6).
                    let n = n.to_string();
                    let mut field = vec!["children", n.as_str()];
                    field.extend(problem.field.iter().map(String::as_str));
                    err_at(&field, format!("children.{}: {problem}", child.table))
                })?;
            if let Some(first) = c.first_field() {
                fields.insert(first.to_string());
                reads_object |= !c.optional() && !first.bytes().all(|b| b.is_ascii_digit());
            }
            compiled_children.push(c);
        }
        children::distinct_tables(&table, &compiled_children)
            .map_err(|problem| err("children", problem.to_string()))?;
        children::share_fields(&mut compiled_children);
        Ok(Self {
            pipeline: pipeline.to_string(),
            table,
            columns,
            key,
            on_conflict: spec.on_conflict,
            version,
            unknown_fields: spec.unknown_fields.clone(),
            fields,
            reads_object,
            statements,
            bound: Default::default(),
            attnums: Default::default(),
            children: compiled_children,
            delete,
            triggers: Default::default(),
            partitioned: Default::default(),
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

    /// Whether a column, the parent's or a child's, reads the header table: a header, or where
    /// the message was published (a copy names its original's in headers).
    pub fn reads_headers(&self) -> bool {
        let reads = |c: &Column| {
            matches!(
                c.source,
                Source::Header(_) | Source::Property(Property::Exchange | Property::RoutingKey)
            )
        };
        self.columns.iter().any(reads)
            || self
                .children
                .iter()
                .any(|child| child.columns.iter().any(reads))
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

impl Row {
    /// The bytes this row holds in memory: itself, its cells, their text, and its child rows
    /// (a message of 12 KB can give 1,000 child rows of some 260 bytes each), each heap block
    /// as the allocator gives it (at least 32 bytes with its header: a one-byte text costs 32,
    /// not 1; counted at 1, the rows of review R38f F1 held 2 to 3 times what was counted).
    pub fn held_bytes(&self) -> u64 {
        /// One heap block of `n` bytes as the allocator holds it (0: none).
        fn block(n: usize) -> usize {
            if n == 0 { 0 } else { n.max(24) + 8 }
        }
        fn cells(cells: &[Cell], capacity: usize) -> usize {
            block(capacity * std::mem::size_of::<Cell>())
                + cells
                    .iter()
                    .map(|c| match c {
                        Cell::Text(s)
                        | Cell::Numeric(s)
                        | Cell::Timestamptz(s)
                        | Cell::Date(s)
                        | Cell::Jsonb(s) => block(s.capacity()),
                        _ => 0,
                    })
                    .sum::<usize>()
        }
        let children: usize = self
            .1
            .iter()
            .map(|rows| {
                block(rows.capacity() * std::mem::size_of::<Vec<Cell>>())
                    + rows.iter().map(|r| cells(r, r.capacity())).sum::<usize>()
            })
            .sum();
        (std::mem::size_of::<Row>()
            + cells(&self.0, self.0.capacity())
            + block(self.1.capacity() * std::mem::size_of::<ChildRows>())
            + children) as u64
    }
}

impl Domain for Mapping {
    type Record = Row;

    fn record_bytes(&self, record: &Row) -> u64 {
        record.held_bytes()
    }

    /// With child tables, each element of an array is a row of its own: some 64 times the
    /// bytes of a small element at most (a 60 KB body of 6,000 items held 786 KB counted).
    fn record_estimate(&self, body: usize) -> u64 {
        let factor = if self.children.is_empty() { 2 } else { 64 };
        factor * body as u64 + std::mem::size_of::<Row>() as u64
    }

    fn decode(&self, body: &[u8]) -> Result<Row, Rejection> {
        self.decode_message(body, None)
    }

    fn reads_headers(&self) -> bool {
        Mapping::reads_headers(self)
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

    fn settled<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Row],
    ) -> BoxFuture<'a, Result<Vec<bool>, DbError>> {
        Box::pin(insert::settled(self, client, records))
    }
}

#[cfg(test)]
mod properties_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod times_tests;
#[cfg(test)]
mod users_tests;
