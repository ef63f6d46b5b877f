//! Deletes (`delete = { field = "/op", value = "delete" }`): which messages delete their key's
//! row, checked at compile time, and how such a message decodes: its key and its version only
//! (every other column NULL, no child rows), as an [`Op::Delete`] row. What a delete does to
//! the table, and the tombstone that keeps its version, are written by `versions.rs`.
//!
//! Refused at compile time: a delete without `on_conflict = "update"` (without a version, a
//! delete and a write of one key that arrive out of order cannot be told apart: which was
//! last?), a pointer that is not one or is the whole body, a field some key or version column
//! reads (the message would need to be its own key).

use serde_json::Value;

use super::values::{lookup, pointer_segments};
use super::{
    Cell, DeleteSpec, DeleteValue, Envelope, Mapping, OnConflict, Refused, Rejection, Row, Source,
    TableName,
};

/// What a message asks of its key: to be written (the common case) or deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Op {
    #[default]
    Write,
    Delete,
}

/// A compiled delete spec.
#[derive(Debug, Clone)]
pub(super) struct Delete {
    /// The pointer, as written (for messages).
    pub(super) field: String,
    segments: Vec<String>,
    value: DeleteValue,
    /// Warren's table of the pipeline's tombstones (`tombstones_<pipeline>`, in the schema of
    /// warren's sessions, `DATABASE_SCHEMA`): per deleted key, the delete's version.
    pub(super) tombstones: TableName,
}

impl Delete {
    /// Checks `spec` against the pipeline's key and version columns; the problem in words, and
    /// the key of the spec at fault.
    pub(super) fn compile(
        pipeline: &str,
        spec: &DeleteSpec,
        on_conflict: OnConflict,
        key_and_version: &[&super::Column],
    ) -> Result<Self, (&'static str, String)> {
        if on_conflict != OnConflict::Update {
            return Err((
                "delete",
                "delete needs on_conflict = \"update\" and a version_column: without a version, \
                 a delete and a write of one key that arrive out of order cannot be told apart \
                 (which one was last?)"
                    .into(),
            ));
        }
        let segments =
            pointer_segments(&spec.field).map_err(|e| ("field", format!("delete.field: {e}")))?;
        if segments.is_empty() {
            return Err((
                "field",
                "delete.field: expected a JSON Pointer to a field (\"/op\"), not \"\" (the whole \
                 body)"
                    .into(),
            ));
        }
        for c in key_and_version {
            if let Source::Path { pointer, .. } = &c.source
                && (pointer == &spec.field
                    || spec.field.starts_with(&format!("{pointer}/"))
                    || pointer.starts_with(&format!("{}/", spec.field)))
            {
                return Err((
                    "field",
                    format!(
                        "delete.field {:?} is read by column {} (a key or the version): a \
                         delete carries its key and version in fields of their own",
                        spec.field, c.name
                    ),
                ));
            }
        }
        let tombstones = TableName::parse(&format!("tombstones_{pipeline}")).map_err(|e| {
            (
                "delete",
                format!("delete: the tombstone table's name tombstones_{pipeline}: {e}"),
            )
        })?;
        Ok(Self {
            field: spec.field.clone(),
            segments,
            value: spec.value.clone(),
            tombstones,
        })
    }

    /// The top-level field the pointer reads.
    pub(super) fn first_field(&self) -> &str {
        &self.segments[0]
    }

    /// Whether `doc` is a delete: its field holds the value (as JSON: `"delete"` is not
    /// `"Delete"`, `1` is not `"1"` nor `true`).
    pub(super) fn matches(&self, doc: &Value) -> bool {
        match (lookup(doc, &self.segments), &self.value) {
            (Some(Value::String(s)), DeleteValue::Text(t)) => s == t,
            (Some(Value::Bool(b)), DeleteValue::Bool(t)) => b == t,
            (Some(Value::Number(n)), DeleteValue::Int(t)) => n.as_i64() == Some(*t),
            _ => false,
        }
    }

    /// The value, as a reason shows it.
    pub(super) fn shown_value(&self) -> String {
        match &self.value {
            DeleteValue::Bool(b) => b.to_string(),
            DeleteValue::Int(n) => n.to_string(),
            DeleteValue::Text(s) => format!("{s:?}"),
        }
    }
}

impl Mapping {
    /// A delete message (`doc`, its JSON `text`): its key and version cells, checked as any
    /// message's; every other column NULL and no child rows (a delete writes none of them).
    pub(super) fn decode_delete(
        &self,
        text: &str,
        doc: &Value,
        headers: Option<&lapin::types::FieldTable>,
        envelope: Option<&Envelope<'_>>,
    ) -> Result<Row, Refused> {
        let mut cells = vec![Cell::Null; self.columns.len()];
        let mut problems = Vec::new();
        for i in self.key.iter().copied().chain(self.version) {
            let c = &self.columns[i];
            match Self::cell(c, text, doc, headers, envelope) {
                Ok(cell) => cells[i] = cell,
                Err(e) => problems.push((c, e)),
            }
        }
        if problems.is_empty() {
            return Ok(Row(
                cells,
                vec![Vec::new(); self.children.len()],
                Op::Delete,
            ));
        }
        let reason: Vec<String> = problems.iter().map(|(c, e)| c.reason(e)).collect();
        Err(Refused {
            rejection: Rejection::payload(format!("{} (a delete)", reason.join("; "))),
            problems: problems
                .into_iter()
                .map(|(c, error)| super::Problem::Column {
                    column: c.name.clone(),
                    error,
                })
                .collect(),
        })
    }
}
