//! A batch as its statements' parameters: one typed array per column ([`Array`], [`arrays`],
//! a statement [`run`] with them), and a row's key and cells as reasons show them
//! ([`key_text`], [`shown`]). Below every file that writes.

use tokio_postgres::types::ToSql;

use super::{Cell, ColType, Mapping, Row};
use crate::db::error::DbError;

/// One column of a batch, as the array its parameter is sent as.
pub(super) enum Array<'a> {
    Text(Vec<Option<&'a str>>),
    Uuid(Vec<Option<uuid::Uuid>>),
    Int4(Vec<Option<i32>>),
    Int8(Vec<Option<i64>>),
    Float8(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
}

impl<'a> Array<'a> {
    pub(super) fn new(ty: ColType, n: usize) -> Self {
        match ty {
            ColType::Text
            | ColType::Numeric
            | ColType::Timestamptz
            | ColType::Date
            | ColType::Jsonb => Array::Text(Vec::with_capacity(n)),
            ColType::Uuid => Array::Uuid(Vec::with_capacity(n)),
            ColType::Int4 => Array::Int4(Vec::with_capacity(n)),
            ColType::Int8 => Array::Int8(Vec::with_capacity(n)),
            ColType::Float8 => Array::Float8(Vec::with_capacity(n)),
            ColType::Bool => Array::Bool(Vec::with_capacity(n)),
        }
    }

    pub(super) fn push(&mut self, cell: &'a Cell) {
        match (self, cell) {
            (Array::Text(v), Cell::Text(s) | Cell::Numeric(s))
            | (Array::Text(v), Cell::Timestamptz(s) | Cell::Date(s) | Cell::Jsonb(s)) => {
                v.push(Some(s.as_str()))
            }
            (Array::Uuid(v), Cell::Uuid(u)) => v.push(Some(*u)),
            (Array::Int4(v), Cell::Int4(n)) => v.push(Some(*n)),
            (Array::Int8(v), Cell::Int8(n)) => v.push(Some(*n)),
            (Array::Float8(v), Cell::Float8(n)) => v.push(Some(*n)),
            (Array::Bool(v), Cell::Bool(b)) => v.push(Some(*b)),
            (a, _) => a.push_null(),
        }
    }

    fn push_null(&mut self) {
        match self {
            Array::Text(v) => v.push(None),
            Array::Uuid(v) => v.push(None),
            Array::Int4(v) => v.push(None),
            Array::Int8(v) => v.push(None),
            Array::Float8(v) => v.push(None),
            Array::Bool(v) => v.push(None),
        }
    }

    pub(super) fn as_param(&self) -> &(dyn ToSql + Sync) {
        match self {
            Array::Text(v) => v,
            Array::Uuid(v) => v,
            Array::Int4(v) => v,
            Array::Int8(v) => v,
            Array::Float8(v) => v,
            Array::Bool(v) => v,
        }
    }
}

/// The parameter arrays of `records`, one per column.
pub(super) fn arrays<'a>(mapping: &Mapping, records: &[&'a Row]) -> Vec<Array<'a>> {
    let mut arrays: Vec<Array<'a>> = mapping
        .columns
        .iter()
        .map(|c| Array::new(c.ty, records.len()))
        .collect();
    for r in records {
        for (array, cell) in arrays.iter_mut().zip(&r.0) {
            array.push(cell);
        }
    }
    arrays
}

/// A cell as text, for reasons.
pub(super) fn shown(cell: &Cell) -> String {
    match cell {
        Cell::Null => "NULL".into(),
        Cell::Text(s)
        | Cell::Numeric(s)
        | Cell::Timestamptz(s)
        | Cell::Date(s)
        | Cell::Jsonb(s) => s.clone(),
        Cell::Uuid(u) => u.to_string(),
        Cell::Int4(n) => n.to_string(),
        Cell::Int8(n) => n.to_string(),
        Cell::Float8(n) => n.to_string(),
        Cell::Bool(b) => b.to_string(),
    }
}

/// The key of `row` as text: `id 5f0c...` or `(a, b) (1, 2)`.
pub(super) fn key_text(mapping: &Mapping, row: &Row) -> String {
    let names = mapping.key();
    let values: Vec<String> = mapping.key.iter().map(|&i| shown(&row.0[i])).collect();
    if names.len() == 1 {
        format!("{} {}", names[0], values[0])
    } else {
        format!("({}) ({})", names.join(", "), values.join(", "))
    }
}

/// `statement` run with `arrays`, then `more`, as its parameters, prepared once per connection.
pub(super) async fn run(
    client: &deadpool_postgres::Client,
    statement: &str,
    arrays: &[Array<'_>],
    more: &[&(dyn ToSql + Sync)],
) -> Result<u64, DbError> {
    let mut params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    params.extend_from_slice(more);
    let prepared = client
        .prepare_cached(statement)
        .await
        .map_err(DbError::from_pg)?;
    client
        .execute(&prepared, &params)
        .await
        .map_err(DbError::from_pg)
}
