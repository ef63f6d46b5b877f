//! What a configured pipeline declares about its data, as the configuration gives it: the spec
//! of the parent table ([`MappingSpec`]), its columns ([`ColumnSpec`]), its child tables
//! ([`ChildSpec`], [`ChildColumnSpec`]) and the words of the file format (`on_conflict`,
//! `unknown_fields`, `format`, `type`). [`Mapping::compile`](super::Mapping::compile) checks and
//! compiles it.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

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
    /// Child tables, each filled from an array of the message, one row per element
    /// (`[[pipelines.children]]`, see `children.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ChildSpec>,
    /// Which messages delete their key's row (`delete = { field = "/op", value = "delete" }`,
    /// see `delete.rs`); `on_conflict = "update"` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete: Option<DeleteSpec>,
}

/// The elements a child table takes from one message when its entry gives no `max_rows`.
pub const MAX_ROWS_DEFAULT: usize = 1000;

/// A child table of a pipeline: one row per element of an array of the message, written in the
/// same transaction as the message's parent row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildSpec {
    /// The table, `name` or `schema.name`: it must exist (warren never creates or alters it).
    pub table: String,
    /// A JSON Pointer to the array whose elements are the rows.
    pub rows: String,
    /// The columns of a primary key or unique index of the child table.
    pub key: Vec<String>,
    /// An absent or null array is no rows instead of a rejection.
    #[serde(default, skip_serializing_if = "is_false")]
    pub optional: bool,
    /// The most elements one message may hold (more: `invalid_payload`); absent:
    /// [`MAX_ROWS_DEFAULT`]. Bounds the statement a batch makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<usize>,
    /// Column name -> where its value comes from: the element (paths relative to it), the
    /// parent row's column, or the element's position.
    pub columns: BTreeMap<String, ChildColumnSpec>,
}

/// One column of a child table: a path into the element (or a header, or a property of the
/// message) with a type and checks, as a parent column; or `parent = "<column>"` (the parent row's value), or `index = true`
/// (the element's position, from 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildColumnSpec {
    /// A JSON Pointer into the element; `""` is the whole element.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// An AMQP header name instead of a path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A property of the message instead of a path (as a parent column's): the message's, the
    /// same for each element.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub property: Option<Property>,
    /// The parent row's column whose value this column takes (its type is the parent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The element's position in the array, from 1 (an `int4`, or `int8` when typed so).
    #[serde(default, skip_serializing_if = "is_false")]
    pub index: bool,
    /// Required with a path or header; `parent` takes the parent's, `index` int4 or int8.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub ty: Option<ColType>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub optional: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_len: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
    /// The values accepted (text, int4, int8, uuid), as a parent column's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_of: Option<Vec<serde_json::Value>>,
    /// Text: a regular expression the value must hold a match of, as a parent column's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// The value of an absent field (a path or header column), as a parent column's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<serde_json::Value>,
}

/// A property of a message a column can read (`property = "message_id"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Property {
    MessageId,
    CorrelationId,
    /// The AMQP timestamp (seconds), read as a `timestamptz`.
    Timestamp,
    /// The AMQP `type` property.
    Type,
    AppId,
    ContentType,
    /// The routing key it was published with.
    RoutingKey,
    /// The exchange it was published to (`""`: the default exchange).
    Exchange,
}

impl Property {
    pub fn as_str(self) -> &'static str {
        match self {
            Property::MessageId => "message_id",
            Property::CorrelationId => "correlation_id",
            Property::Timestamp => "timestamp",
            Property::Type => "type",
            Property::AppId => "app_id",
            Property::ContentType => "content_type",
            Property::RoutingKey => "routing_key",
            Property::Exchange => "exchange",
        }
    }
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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

/// What a top-level field that no column reads does: `unknown_fields = "reject"` (the
/// default), `"ignore"`, or `{ keep = "<column>" }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum UnknownFields {
    /// The message is `invalid_payload`, naming the field.
    #[default]
    Reject,
    /// The field is dropped.
    Ignore,
    /// Every such field is kept in this `jsonb` column of the table, as one object of them
    /// (`{}` when there are none), so a producer that adds fields loses nothing.
    Keep(String),
}

impl UnknownFields {
    /// The column the unknown fields are kept in (`keep`).
    pub fn keep_column(&self) -> Option<&str> {
        match self {
            UnknownFields::Keep(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Display for UnknownFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnknownFields::Reject => f.write_str("reject"),
            UnknownFields::Ignore => f.write_str("ignore"),
            UnknownFields::Keep(c) => write!(f, "keep (in column {c})"),
        }
    }
}

/// The words of a bad `unknown_fields` (the configuration names the setting and its line).
const UNKNOWN_FIELDS_EXPECTED: &str = "\"reject\", \"ignore\", or { keep = \"<column>\" } (a jsonb column \
     of the table that keeps the fields no column reads)";

impl Serialize for UnknownFields {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            UnknownFields::Reject => s.serialize_str("reject"),
            UnknownFields::Ignore => s.serialize_str("ignore"),
            UnknownFields::Keep(c) => {
                let mut map = s.serialize_map(Some(1))?;
                map.serialize_entry("keep", c)?;
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for UnknownFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UnknownFields;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(UNKNOWN_FIELDS_EXPECTED)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                use serde::de::Unexpected;
                match v {
                    "reject" => Ok(UnknownFields::Reject),
                    "ignore" => Ok(UnknownFields::Ignore),
                    "keep" => Err(E::invalid_value(
                        Unexpected::Str(v),
                        &"{ keep = \"<column>\" }, naming the jsonb column the unknown fields \
                          are kept in",
                    )),
                    _ => Err(E::invalid_value(Unexpected::Str(v), &self)),
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                use serde::de::Error;
                let mut column: Option<String> = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key != "keep" || column.is_some() {
                        return Err(A::Error::unknown_field(&key, &["keep"]));
                    }
                    column = Some(map.next_value()?);
                }
                column
                    .map(UnknownFields::Keep)
                    .ok_or_else(|| A::Error::missing_field("keep"))
            }
        }
        d.deserialize_any(Visitor)
    }
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
    /// A property of the message instead of a path (`message_id`, `timestamp`, `exchange`,
    /// ...): the original's, also on a retried or replayed copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub property: Option<Property>,
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
    /// The values accepted, compared exactly as PostgreSQL's `=` compares them (text, int4,
    /// int8, uuid): `currency must be one of EUR, USD, found GBP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_of: Option<Vec<serde_json::Value>>,
    /// Text: a regular expression the value must hold a match of, as PostgreSQL's `~` answers
    /// it, in the subset both read alike (`pattern.rs`; anchor it, `^...$`, for the whole value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// The value taken when the field (or header) is absent, as if the message held it: checked
    /// when the configuration loads against the column's type and checks. A `null` is not
    /// absent (NULL when `optional`, else refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<serde_json::Value>,
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
    /// not show as written ([`line_problem`]), for names and titles that end up on a screen.
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

    pub(super) fn is_number(self) -> bool {
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

/// Which messages are deletes: those whose `field` (a JSON Pointer into the body) holds
/// `value`. A delete carries the key and the version; its key's row and child rows go, and a
/// tombstone keeps the version (`delete.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteSpec {
    /// A JSON Pointer into the body (`/op`).
    pub field: String,
    /// The value there that means delete (a string, an integer or a boolean).
    pub value: DeleteValue,
}

/// The value of a delete's field: compared with the message's as JSON (a string with a
/// string, an integer with an integer, a boolean with a boolean).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// `expecting`: the parser's own words named this enum (review R36g F6).
#[serde(
    untagged,
    expecting = "a string, an integer or a boolean (the value of the field that marks a delete)"
)]
pub enum DeleteValue {
    Bool(bool),
    Int(i64),
    Text(String),
}
