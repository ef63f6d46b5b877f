//! A mapped batch into its table with ONE statement, typed arrays unnested in the database:
//! - `keep`: `INSERT .. ON CONFLICT DO NOTHING` (no target: every unique index is an arbiter, so a
//!   copy of a row another statement is inserting at that moment is skipped, not failed). When
//!   fewer rows come back than were given, one more statement compares each record with what
//!   its key holds: the same content is an idempotent success, other content `id_conflict`, and
//!   a key that holds nothing means another unique index refused the row (`db_permanent`, naming
//!   the index and, when it can, the key holding the value).
//! - `update`: `INSERT .. SELECT DISTINCT ON (key) .. ORDER BY key, version DESC ON CONFLICT (key)
//!   DO UPDATE .. WHERE stored.version IS NULL OR stored.version < new.version`: of several
//!   versions of one key in a batch the highest is written, and any version beats a stored row
//!   that has none; an older or equal version changes nothing and is a success (counted
//!   as unchanged). A row refused by another unique index fails the statement (23505): the sink
//!   splits the batch down to that row, which is dead-lettered as `db_permanent`.

use std::collections::HashMap;

use tokio_postgres::types::ToSql;

use super::{Cell, ColType, Column, Mapping, OnConflict, Row, TableName, quote};
use crate::db::error::DbError;
use crate::domain::Inserted;

/// The statements of one mapping, built once.
#[derive(Debug, Clone)]
pub(super) struct Statements {
    /// The insert (`keep` or `update`), returning the key of each row it wrote.
    pub(super) insert: String,
    /// `keep`: the plain insert tried first, when every row is new
    /// ([`crate::domain::insert_if_all_new`]); `None` for `update`.
    pub(super) insert_new: Option<String>,
    /// `keep`: for each record (by ordinality), whether its key holds a row, and per column
    /// whether the stored value equals the record's. Built without the table's column types;
    /// [`compare_sql`] builds it again with them once a session can read them.
    pub(super) compare: String,
}

/// The comparison of records with what their keys hold, each sent value first cast to its
/// column's type as the catalog gives it (`numeric(7,2)`, `varchar(3)`, `timestamptz(0)`, a
/// domain): what the insert stored went through that cast (it rounds, pads), so a copy of a
/// stored message compares equal to its row. Built once per mapping, on first need; without the
/// catalog's answer (no such table) the untyped statement.
fn compare_statement(
    table: &TableName,
    columns: &[Column],
    key: &[usize],
    types: &HashMap<String, String>,
) -> String {
    let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
    let list = names.join(", ");
    let params: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| param(c.ty, i + 1))
        .collect();
    let unnest = format!("UNNEST({})", params.join(", "));
    // The sent value as the column stores it.
    let sent = |i: usize| match types.get(&columns[i].name) {
        Some(ty) if columns[i].ty != ColType::Jsonb => format!("CAST(v.{} AS {ty})", names[i]),
        _ => format!("v.{}", names[i]),
    };
    // A jsonb value may be stored in a json column, which has no equality: both sides are
    // compared as jsonb (by meaning: key order and spacing aside).
    let same: Vec<String> = (0..columns.len())
        .map(|i| match columns[i].ty {
            ColType::Jsonb => format!(
                "s.{n}::jsonb IS NOT DISTINCT FROM v.{n}::jsonb",
                n = names[i]
            ),
            _ => format!("s.{} IS NOT DISTINCT FROM {}", names[i], sent(i)),
        })
        .collect();
    let joined: Vec<String> = key
        .iter()
        .map(|&i| format!("s.{} = {}", names[i], sent(i)))
        .collect();
    format!(
        "SELECT v.ord, s.{first} IS NOT NULL, ARRAY[{same}] \
         FROM {unnest} WITH ORDINALITY AS v({list}, ord) \
         LEFT JOIN {t} AS s ON {on}",
        first = names[key[0]],
        same = same.join(", "),
        on = joined.join(" AND "),
        t = table.sql(),
    )
}

/// The comparison statement of `mapping` with its table's column types (see
/// [`compare_statement`]), read from the catalog once.
async fn compare_sql<'m>(
    mapping: &'m Mapping,
    client: &deadpool_postgres::Client,
) -> Result<&'m str, DbError> {
    mapping
        .compare_typed
        .get_or_try_init(|| async {
            let rows = client
                .query(
                    "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) \
                     FROM pg_attribute a \
                     WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                    &[&mapping.table.sql()],
                )
                .await
                .map_err(DbError::from_pg)?;
            if rows.is_empty() {
                return Ok(mapping.statements.compare.clone());
            }
            let types: HashMap<String, String> =
                rows.iter().map(|r| (r.get(0), r.get(1))).collect();
            Ok(compare_statement(
                &mapping.table,
                &mapping.columns,
                &mapping.key,
                &types,
            ))
        })
        .await
        .map(String::as_str)
}

/// The SQL type a column's parameter array is sent as, and the cast to the column's type.
fn param(ty: ColType, n: usize) -> String {
    match ty {
        ColType::Text => format!("${n}::text[]"),
        ColType::Uuid => format!("${n}::uuid[]"),
        ColType::Int4 => format!("${n}::int4[]"),
        ColType::Int8 => format!("${n}::int8[]"),
        ColType::Float8 => format!("${n}::float8[]"),
        ColType::Bool => format!("${n}::bool[]"),
        ColType::Jsonb => format!("${n}::text[]::jsonb[]"),
        // Sent as text, parsed by the database: the digits and the instant as written.
        ColType::Numeric => format!("${n}::text[]::numeric[]"),
        ColType::Timestamptz => format!("${n}::text[]::timestamptz[]"),
        ColType::Date => format!("${n}::text[]::date[]"),
    }
}

impl Statements {
    pub(super) fn build(
        table: &TableName,
        columns: &[Column],
        key: &[usize],
        version: Option<usize>,
    ) -> Self {
        let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
        let list = names.join(", ");
        let params: Vec<String> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| param(c.ty, i + 1))
            .collect();
        let unnest = format!("UNNEST({})", params.join(", "));
        let key_names: Vec<&str> = key.iter().map(|&i| names[i].as_str()).collect();
        let keys = key_names.join(", ");
        let t = table.sql();
        let insert_new = version.is_none().then(|| {
            format!("INSERT INTO {t} ({list}) SELECT * FROM {unnest} AS v({list}) ORDER BY {keys}")
        });
        let insert = match version {
            None => format!(
                // In key order, as the plain insert: copies in other orders wait, not deadlock.
                "INSERT INTO {t} ({list}) SELECT * FROM {unnest} AS v({list}) ORDER BY {keys} \
                 ON CONFLICT DO NOTHING \
                 RETURNING {keys}"
            ),
            Some(v) => {
                let sets: Vec<String> = names
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !key.contains(i))
                    .map(|(_, n)| format!("{n} = EXCLUDED.{n}"))
                    .collect();
                format!(
                    "INSERT INTO {t} AS stored ({list}) \
                     SELECT DISTINCT ON ({keys}) * FROM {unnest} AS v({list}) \
                     ORDER BY {keys}, {ver} DESC \
                     ON CONFLICT ({keys}) DO UPDATE SET {sets} \
                     WHERE stored.{ver} IS NULL OR stored.{ver} < EXCLUDED.{ver} \
                     RETURNING {keys}",
                    ver = names[v],
                    sets = if sets.is_empty() {
                        format!("{0} = EXCLUDED.{0}", names[v])
                    } else {
                        sets.join(", ")
                    }
                )
            }
        };
        // A jsonb value may be stored in a json column, which has no equality: both sides are
        // compared as jsonb (by meaning: key order and spacing aside).
        let compare = compare_statement(table, columns, key, &HashMap::new());
        Self {
            insert,
            insert_new,
            compare,
        }
    }
}

/// One column of a batch, as the array its parameter is sent as.
enum Array {
    Text(Vec<Option<String>>),
    Uuid(Vec<Option<uuid::Uuid>>),
    Int4(Vec<Option<i32>>),
    Int8(Vec<Option<i64>>),
    Float8(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
}

impl Array {
    fn new(ty: ColType, n: usize) -> Self {
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

    fn push(&mut self, cell: &Cell) {
        match (self, cell) {
            (Array::Text(v), Cell::Text(s) | Cell::Numeric(s))
            | (Array::Text(v), Cell::Timestamptz(s) | Cell::Date(s) | Cell::Jsonb(s)) => {
                v.push(Some(s.clone()))
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

    fn as_param(&self) -> &(dyn ToSql + Sync) {
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
fn arrays(mapping: &Mapping, records: &[&Row]) -> Vec<Array> {
    let mut arrays: Vec<Array> = mapping
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
fn shown(cell: &Cell) -> String {
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
fn key_text(mapping: &Mapping, row: &Row) -> String {
    let names = mapping.key();
    let values: Vec<String> = mapping.key.iter().map(|&i| shown(&row.0[i])).collect();
    if names.len() == 1 {
        format!("{} {}", names[0], values[0])
    } else {
        format!("({}) ({})", names.join(", "), values.join(", "))
    }
}

pub(super) async fn insert(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<crate::domain::Inserted, DbError> {
    if records.is_empty() {
        // The breaker's probe: the statement runs, writing nothing (a read-only server, a
        // missing table or privilege still answer as they would for a batch).
        let statement = client
            .prepare_cached(&mapping.statements.insert)
            .await
            .map_err(DbError::from_pg)?;
        let arrays = arrays(mapping, records);
        let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
        client
            .query(&statement, &params)
            .await
            .map_err(DbError::from_pg)?;
        return Ok(Inserted::default());
    }
    let arrays = arrays(mapping, records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    if let Some(sql) = &mapping.statements.insert_new
        && let Some(rows) = crate::domain::insert_if_all_new(client, sql, &params).await?
    {
        return Ok(Inserted {
            rows,
            ..Default::default()
        });
    }
    let statement = client
        .prepare_cached(&mapping.statements.insert)
        .await
        .map_err(DbError::from_pg)?;
    let written = client
        .query(&statement, &params)
        .await
        .map_err(DbError::from_pg)?
        .len();
    if mapping.on_conflict == OnConflict::Update || written == records.len() {
        return Ok(Inserted {
            rows: written as u64,
            unchanged: (records.len() - written) as u64,
            ..Default::default()
        });
    }
    // Some records were skipped: a copy (this batch or an earlier one), other content under
    // their key, or another unique index's value.
    let compare = client
        .prepare_cached(compare_sql(mapping, client).await?)
        .await
        .map_err(DbError::from_pg)?;
    let mut conflicts = Vec::new();
    let mut skipped = Vec::new();
    for row in client
        .query(&compare, &params)
        .await
        .map_err(DbError::from_pg)?
    {
        let i = (row.get::<_, i64>(0) - 1) as usize;
        let stored: bool = row.get(1);
        let same: Vec<bool> = row.get(2);
        if !stored {
            skipped.push(i);
        } else if let Some(record) = records.get(i)
            && same.iter().any(|s| !s)
        {
            let differs: Vec<&str> = mapping
                .columns
                .iter()
                .zip(&same)
                .filter(|(_, s)| !**s)
                .map(|(c, _)| c.name.as_str())
                .collect();
            conflicts.push((
                i,
                format!(
                    "{} is already stored with another {}",
                    key_text(mapping, record),
                    differs.join(" and ")
                ),
            ));
        }
    }
    let refused = if skipped.is_empty() {
        Vec::new()
    } else {
        unique_holders(mapping, client, records, &skipped).await?
    };
    Ok(Inserted {
        rows: written as u64,
        conflicts,
        refused,
        ..Default::default()
    })
}

/// Whether `record`'s key holds exactly its content (every mapped column the same).
pub(super) async fn stored(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
) -> Result<bool, DbError> {
    let records = [record];
    let arrays = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    let compare = client
        .prepare_cached(compare_sql(mapping, client).await?)
        .await
        .map_err(DbError::from_pg)?;
    Ok(client
        .query(&compare, &params)
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .any(|row| row.get::<_, bool>(1) && row.get::<_, Vec<bool>>(2).iter().all(|s| *s)))
}

/// For `refused` reasons: the first unique index (other than the key's) that holds a record's
/// value, and the key that holds it.
pub(super) fn refused_reason(
    index: &str,
    columns: &[String],
    holder: Option<String>,
    mapping: &Mapping,
) -> String {
    let violation = format!("23505 duplicate key value violates unique constraint \"{index}\"");
    let what = if columns.len() == 1 {
        format!("the {}", columns[0])
    } else {
        format!("({})", columns.join(", "))
    };
    match holder {
        Some(k) => {
            let names = mapping.key();
            let key = if names.len() == 1 {
                format!("{} {k}", names[0])
            } else {
                format!("({}) ({k})", names.join(", "))
            };
            format!("{violation}: {what} is stored under {key}")
        }
        None => violation,
    }
}

/// The cells of a record by column name (for the unique-index look-up).
pub(super) fn cells_by_name<'a>(mapping: &'a Mapping, row: &'a Row) -> HashMap<&'a str, &'a Cell> {
    mapping
        .columns
        .iter()
        .zip(&row.0)
        .map(|(c, cell)| (c.name.as_str(), cell))
        .collect()
}

pub(super) fn cell_text(cell: &Cell) -> String {
    shown(cell)
}

/// For each skipped record (by index in `records`): why the database skipped it, naming the
/// unique index (other than the key's) that holds its value and the key holding it.
pub(super) async fn unique_holders(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    skipped: &[usize],
) -> Result<Vec<(usize, String)>, DbError> {
    let name = mapping.table.sql();
    let oid: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&name])
        .await
        .map_err(DbError::from_pg)?
        .get(0);
    let indexes = match oid {
        Some(oid) => {
            let plain: &tokio_postgres::Client = client;
            super::schema::unique_indexes(plain, oid).await?
        }
        None => Vec::new(),
    };
    let mut key: Vec<&str> = mapping.key();
    key.sort_unstable();
    let mut reasons: HashMap<usize, String> = HashMap::new();
    for (index, cols) in &indexes {
        let mut sorted: Vec<&str> = cols.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        if sorted == key {
            continue;
        }
        let types: Option<Vec<ColType>> = cols
            .iter()
            .map(|c| mapping.columns.iter().find(|m| &m.name == c).map(|m| m.ty))
            .collect();
        let Some(types) = types else {
            continue; // an index on a column the mapping does not fill
        };
        let pending: Vec<usize> = skipped
            .iter()
            .copied()
            .filter(|i| !reasons.contains_key(i))
            .collect();
        if pending.is_empty() {
            break;
        }
        let mut arrays: Vec<Vec<Option<String>>> = vec![Vec::new(); cols.len()];
        for &i in &pending {
            let cells = cells_by_name(mapping, records[i]);
            for (k, c) in cols.iter().enumerate() {
                arrays[k].push(match cells.get(c.as_str()) {
                    Some(Cell::Null) | None => None,
                    Some(cell) => Some(cell_text(cell)),
                });
            }
        }
        let names: Vec<String> = (0..cols.len()).map(|k| format!("c{k}")).collect();
        let params: Vec<String> = (1..=cols.len()).map(|n| format!("${n}::text[]")).collect();
        let on: Vec<String> = cols
            .iter()
            .zip(&types)
            .zip(&names)
            .map(|((c, ty), v)| format!("s.{} = v.{v}::{ty}", quote(c)))
            .collect();
        let keys: Vec<String> = mapping
            .key()
            .iter()
            .map(|k| format!("s.{}::text", quote(k)))
            .collect();
        let sql = format!(
            "SELECT v.ord, concat_ws(', ', {keys}) FROM UNNEST({params}) WITH ORDINALITY \
             AS v({names}, ord) JOIN {table} AS s ON {on}",
            keys = keys.join(", "),
            params = params.join(", "),
            names = names.join(", "),
            table = mapping.table.sql(),
            on = on.join(" AND "),
        );
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = arrays
            .iter()
            .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let found = client
            .query(&sql, &params)
            .await
            .map_err(DbError::from_pg)?;
        for row in found {
            let ord = (row.get::<_, i64>(0) - 1) as usize;
            if let Some(&i) = pending.get(ord) {
                reasons.insert(i, refused_reason(index, cols, Some(row.get(1)), mapping));
            }
        }
    }
    Ok(skipped
        .iter()
        .map(|&i| {
            let reason = reasons.remove(&i).unwrap_or_else(|| {
                format!(
                    "refused by a unique index of {} (skipped by ON CONFLICT DO NOTHING)",
                    mapping.table
                )
            });
            (i, reason)
        })
        .collect())
}
