//! A mapped batch into its table with ONE statement, typed arrays unnested in the database:
//! - `keep`: a plain `INSERT` first (every row new: the common case); when a key is held or
//!   repeated (23505), the batch again through the probe (below), in one transaction: `INSERT ..
//!   SELECT .. ORDER BY key ON CONFLICT DO NOTHING` of the converted records (no target: every
//!   unique index is an arbiter, so a copy of a row another statement is inserting at that
//!   moment is skipped, not failed; in the key's own order, so of two records that are one key
//!   the first delivered is inserted), then, of each record skipped, whether its key holds the
//!   same content (an idempotent success), other content (`id_conflict`), or nothing: then
//!   another unique index refused the row (`db_permanent`, naming the index and the key holding
//!   the value).
//! - `update`: `INSERT .. SELECT DISTINCT ON (key) .. ORDER BY key, version DESC ON CONFLICT (key)
//!   DO UPDATE .. WHERE stored.version IS NULL OR stored.version < new.version`: of several
//!   versions of one key in a batch the highest is written, and any version beats a stored row
//!   that has none; an older or equal version changes nothing and is a success (counted
//!   as unchanged). A row refused by another unique index fails the statement (23505): the sink
//!   splits the batch down to that row, which is dead-lettered as `db_permanent`.
//!
//! **PostgreSQL decides what a value is.** Whether a record equals what its key holds, which
//! key holds a value, and which records are one key are never decided by warren or by an
//! explicit cast (which truncates a `varchar(3)` where the insert refuses): the probe inserts
//! the records into a temporary copy of the mapped columns (same types, lengths, precision,
//! collations, domains), so PostgreSQL converts them by the insert's own assignment rules, and
//! every comparison then runs on the converted values with the column's own equality.

use std::collections::HashMap;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::{Cell, ColType, Column, Mapping, Row, TableName, quote};
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
    /// The probe's table, made for one transaction: the mapped columns of the table, as the
    /// table types them (type, length, precision, collation, domain), and the record's ordinal.
    pub(super) probe_table: String,
    /// The records into the probe, then, from what the probe holds: for each record (by
    /// ordinal), whether its key holds a row, and per column whether the stored value equals it.
    pub(super) probe_compare: String,
    /// `keep`: the insert of a batch some of whose keys are held, from the probe: in the order
    /// of the key's own type, so of two records that are one key the first delivered is
    /// inserted; `None` for `update`.
    pub(super) probe_keep: Option<String>,
    /// The comparison of [`Statements::probe_compare`], of what the probe already holds.
    pub(super) probe_read: String,
    /// Per column, its enum type's name for a `text` column written to an enum (empty: built
    /// without the catalog).
    pub(super) casts: Vec<Option<String>>,
    /// Whether one record of the probe (`$1`, its ordinal) is what its key holds once the
    /// table's own BEFORE INSERT triggers have made it the row an insert would write: an upsert
    /// that changes the row only when it is the same (returning it then), run inside a
    /// savepoint that is rolled back.
    pub(super) probe_same: String,
    /// `update`: the probe's path, which gives each record its own outcome (`versions.rs`).
    pub(super) versions: Option<super::versions::VersionStatements>,
}

/// The ordinal column of the probe (a name no mapped column can have: it has a space).
pub(super) const ORD: &str = "\"warren ord\"";

/// The probe: the records of a batch converted by PostgreSQL into the table's column types by
/// an INSERT, so with the same assignment rules as the insert itself (a value too long for a
/// `varchar(3)` is refused, not truncated as an explicit cast would; a `numeric(7,2)` rounds;
/// a domain checks), held in a temporary table dropped at the end of the transaction. Every
/// question about a value against the table (is it what the key holds, which key holds it,
/// which records are one key) is then asked of the converted values with the columns' own
/// equality and collation: PostgreSQL decides, warren never casts.
fn probe_statements(
    table: &TableName,
    columns: &[Column],
    key: &[usize],
    version: Option<usize>,
    casts: &[Option<String>],
) -> Probe {
    let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
    let list = names.join(", ");
    let unnest = format!("UNNEST({})", params(columns, casts).join(", "));
    let t = table.sql();
    let keys: Vec<String> = key.iter().map(|&i| names[i].clone()).collect();
    let p_keys: Vec<String> = keys.iter().map(|k| format!("p.{k}")).collect();
    let p_list: Vec<String> = names.iter().map(|n| format!("p.{n}")).collect();
    let create = format!(
        "BEGIN; {path} CREATE TEMPORARY TABLE warren_probe ON COMMIT DROP AS \
         SELECT {list}, 0::int8 AS {ORD} FROM {t} WITH NO DATA",
        path = types_on_path(table),
    );
    let fill = format!(
        "INSERT INTO pg_temp.warren_probe ({list}, {ORD}) \
         SELECT * FROM {unnest} WITH ORDINALITY RETURNING *"
    );
    // A jsonb value may be stored in a json column, which has no equality: both sides are
    // compared as jsonb (by meaning: key order and spacing aside).
    let same: Vec<String> = (0..columns.len())
        .map(|i| match columns[i].ty {
            ColType::Jsonb => format!(
                "s.{n}::jsonb IS NOT DISTINCT FROM p.{n}::jsonb",
                n = names[i]
            ),
            _ => format!("s.{n} IS NOT DISTINCT FROM p.{n}", n = names[i]),
        })
        .collect();
    let joined: Vec<String> = key
        .iter()
        .map(|&i| format!("s.{n} = p.{n}", n = names[i]))
        .collect();
    let compare_from = |from: &str| {
        format!(
            "SELECT p.{ORD}, s.{first} IS NOT NULL, ARRAY[{same}] \
             FROM {from} LEFT JOIN {t} AS s ON {on}",
            first = names[key[0]],
            same = same.join(", "),
            on = joined.join(" AND "),
        )
    };
    let compare = format!("WITH p AS ({fill}) {}", compare_from("p"));
    let read = compare_from("pg_temp.warren_probe AS p");
    // In the key's own order (the column's type and collation: `ZED@x` and `zed@x` of a citext
    // key are one key, and the first delivered of them is the one inserted), and so in the same
    // order as every other batch: copies in other orders wait, not deadlock.
    let keep = version.is_none().then(|| {
        format!(
            "WITH p AS ({fill}) INSERT INTO {t} ({list}) SELECT {p_list} FROM p \
             ORDER BY {p_keys}, p.{ORD} ON CONFLICT DO NOTHING RETURNING 1",
            p_keys = p_keys.join(", "),
            p_list = p_list.join(", "),
        )
    });
    // As the insert would write it: `EXCLUDED` is the proposed row after the table's BEFORE
    // INSERT triggers (a trigger that rewrites a value: the stored row holds what it wrote).
    let same_after: Vec<String> = (0..columns.len())
        .map(|i| match columns[i].ty {
            ColType::Jsonb => format!(
                "stored.{n}::jsonb IS NOT DISTINCT FROM EXCLUDED.{n}::jsonb",
                n = names[i]
            ),
            _ => format!("stored.{n} IS NOT DISTINCT FROM EXCLUDED.{n}", n = names[i]),
        })
        .collect();
    let same = format!(
        "INSERT INTO {t} AS stored ({list}) SELECT {p_list} FROM pg_temp.warren_probe AS p \
         WHERE p.{ORD} = $1 ON CONFLICT ({keys}) DO UPDATE SET {first} = EXCLUDED.{first} \
         WHERE {same_after} RETURNING 1",
        keys = keys.join(", "),
        p_list = p_list.join(", "),
        first = names[key[0]],
        same_after = same_after.join(" AND "),
    );
    Probe {
        table: create,
        compare,
        read,
        keep,
        same,
    }
}

/// The probe's statements (see [`probe_statements`]).
struct Probe {
    /// Begins the transaction and makes the probe's table.
    table: String,
    /// The records into the probe, then per record: is its key held, and per column is the
    /// stored value the same.
    compare: String,
    /// The same question of the records already in the probe (after `keep`).
    read: String,
    /// `keep`: the records into the probe, and from it into the table.
    keep: Option<String>,
    /// See [`Statements::probe_same`].
    same: String,
}

/// A statement that puts, for the rest of the transaction, the schema of each column type of
/// `table` (a domain's base type's) on the search path after what is there: an `=` between two
/// values is looked up by name, and an extension's type (`citext` in `public`) has its own
/// equality in its own schema, which the session's path (`DATABASE_SCHEMA`) may not hold; without
/// it PostgreSQL would compare two `citext` values as text, case and all. (`ORDER BY` and
/// `DISTINCT ON`, and the table's unique indexes, use the type's own operators whatever the
/// path.)
pub(super) fn types_on_path(table: &TableName) -> String {
    // The table's name is an identifier warren checked (no quote can be in it).
    let t = table.sql().replace('\'', "''");
    format!(
        "SELECT set_config('search_path', current_setting('search_path') || COALESCE(( \
           SELECT string_agg(DISTINCT ', ' || quote_ident(n.nspname), '') \
           FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid \
           LEFT JOIN pg_type b ON ty.typtype = 'd' AND b.oid = ty.typbasetype \
           JOIN pg_namespace n ON n.oid = COALESCE(b.typnamespace, ty.typnamespace) \
           WHERE a.attrelid = to_regclass('{t}') AND a.attnum > 0 \
             AND n.nspname NOT IN ('pg_catalog', 'information_schema')), ''), true);"
    )
}

/// `ON CONFLICT (key) DO UPDATE` of `update`: every other column from the new version, only
/// when it is higher than the stored one (or the stored row has none).
pub(super) fn on_conflict_update(names: &[String], key: &[usize], version: usize) -> String {
    let keys: Vec<&str> = key.iter().map(|&i| names[i].as_str()).collect();
    let sets: Vec<String> = names
        .iter()
        .enumerate()
        .filter(|(i, _)| !key.contains(i))
        .map(|(_, n)| format!("{n} = EXCLUDED.{n}"))
        .collect();
    format!(
        "ON CONFLICT ({keys}) DO UPDATE SET {sets} \
         WHERE stored.{ver} IS NULL OR stored.{ver} < EXCLUDED.{ver}",
        keys = keys.join(", "),
        ver = names[version],
        sets = if sets.is_empty() {
            format!("{0} = EXCLUDED.{0}", names[version])
        } else {
            sets.join(", ")
        }
    )
}

/// The SQL type a column's parameter array is sent as, and the cast to the column's type.
/// `cast`: the column's own type, for a `text` column written to an enum (PostgreSQL has no
/// assignment cast from text to an enum: the enum's input function reads the label).
pub(super) fn param(ty: ColType, n: usize, cast: Option<&str>) -> String {
    match (ty, cast) {
        (ColType::Text, Some(to)) => format!("${n}::text[]::{to}[]"),
        (ColType::Text, None) => format!("${n}::text[]"),
        (ColType::Uuid, _) => format!("${n}::uuid[]"),
        (ColType::Int4, _) => format!("${n}::int4[]"),
        (ColType::Int8, _) => format!("${n}::int8[]"),
        (ColType::Float8, _) => format!("${n}::float8[]"),
        (ColType::Bool, _) => format!("${n}::bool[]"),
        (ColType::Jsonb, _) => format!("${n}::text[]::jsonb[]"),
        // Sent as text, parsed by the database: the digits and the instant as written.
        (ColType::Numeric, _) => format!("${n}::text[]::numeric[]"),
        (ColType::Timestamptz, _) => format!("${n}::text[]::timestamptz[]"),
        (ColType::Date, _) => format!("${n}::text[]::date[]"),
    }
}

/// The parameters of `columns`, `$1` on, each with its column's cast (see [`param`]).
pub(super) fn params(columns: &[Column], casts: &[Option<String>]) -> Vec<String> {
    columns
        .iter()
        .enumerate()
        .map(|(i, c)| param(c.ty, i + 1, casts.get(i).and_then(|c| c.as_deref())))
        .collect()
}

/// For each column of `mapping`, its type when it is a `text` column of an enum (or a domain
/// over one), as the catalog names it; read once, when the table is first written.
async fn enum_casts(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Vec<Option<String>>, DbError> {
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, NULL), \
               COALESCE(b.typtype, t.typtype) = 'e', a.attnum \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             LEFT JOIN pg_type b ON t.typtype = 'd' AND b.oid = t.typbasetype \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&mapping.table.sql()],
        )
        .await
        .map_err(DbError::from_pg)?;
    let of = |c: &Column| rows.iter().find(|r| r.get::<_, String>(0) == c.name);
    // The table's order of the columns, for reasons that list several (learnt once).
    let _ = mapping.attnums.set(
        mapping
            .columns
            .iter()
            .map(|c| of(c).map_or(i16::MAX, |r| r.get::<_, i16>(3)))
            .collect(),
    );
    Ok(mapping
        .columns
        .iter()
        .map(|c| {
            of(c)
                .filter(|r| c.ty == ColType::Text && r.get::<_, bool>(2))
                .map(|r| r.get::<_, String>(1))
        })
        .collect())
}

/// The statements of `mapping` for its table as it is: those built at compile time, or, when
/// a `text` column is an enum, built again with its cast (once per mapping).
pub(super) async fn statements<'m>(
    mapping: &'m Mapping,
    client: &tokio_postgres::Client,
) -> Result<&'m Statements, DbError> {
    let bound = mapping
        .bound
        .get_or_try_init(|| async {
            let casts = enum_casts(mapping, client).await?;
            Ok::<_, DbError>(casts.iter().any(Option::is_some).then(|| {
                Statements::build(
                    &mapping.table,
                    &mapping.columns,
                    &mapping.key,
                    mapping.version,
                    &casts,
                    mapping.delete.as_ref().map(|d| &d.tombstones),
                )
            }))
        })
        .await?;
    Ok(bound.as_ref().unwrap_or(&mapping.statements))
}

impl Statements {
    pub(super) fn build(
        table: &TableName,
        columns: &[Column],
        key: &[usize],
        version: Option<usize>,
        casts: &[Option<String>],
        tombstones: Option<&TableName>,
    ) -> Self {
        let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
        let list = names.join(", ");
        let unnest = format!("UNNEST({})", params(columns, casts).join(", "));
        let key_names: Vec<&str> = key.iter().map(|&i| names[i].as_str()).collect();
        let keys = key_names.join(", ");
        let t = table.sql();
        let insert_new = version.is_none().then(|| {
            format!("INSERT INTO {t} ({list}) SELECT * FROM {unnest} AS v({list}) ORDER BY {keys}")
        });
        let insert = match version {
            None => format!(
                // In key order, as the plain insert: copies in other orders wait, not deadlock.
                // Of two records of one key in a batch, the first delivered is inserted and the
                // other compared with it, as if they had come one at a time.
                "INSERT INTO {t} ({list}) SELECT {list} FROM {unnest} WITH ORDINALITY \
                 AS v({list}, {ORD}) ORDER BY {keys}, {ORD} \
                 ON CONFLICT DO NOTHING \
                 RETURNING {keys}"
            ),
            // DISTINCT ON the parameters as sent: two records of one key that PostgreSQL tells
            // apart only under the column's type (`User@x` and `user@x` in a citext key) both
            // reach the conflict and the statement fails with 21000, never silently: then the
            // probe's statement (`probe_upsert`) runs instead, on the converted values. Equal
            // parameters are always equal columns, so nothing is collapsed that should not be.
            // Of equal versions of one key in a batch, the first delivered, as if one at a time.
            Some(v) => format!(
                "INSERT INTO {t} AS stored ({list}) \
                 SELECT DISTINCT ON ({keys}) {list} FROM {unnest} WITH ORDINALITY \
                 AS v({list}, {ORD}) \
                 ORDER BY {keys}, {ver} DESC, {ORD} \
                 {conflict} RETURNING {keys}",
                ver = names[v],
                conflict = on_conflict_update(&names, key, v),
            ),
        };
        let probe = probe_statements(table, columns, key, version, casts);
        Self {
            insert,
            insert_new,
            probe_table: probe.table,
            probe_compare: probe.compare,
            probe_keep: probe.keep,
            probe_read: probe.read,
            probe_same: probe.same,
            casts: casts.to_vec(),
            versions: version.map(|v| {
                super::versions::VersionStatements::build(table, columns, key, v, casts, tombstones)
            }),
        }
    }
}

/// One column of a batch, as the array its parameter is sent as.
pub(super) enum Array {
    Text(Vec<Option<String>>),
    Uuid(Vec<Option<uuid::Uuid>>),
    Int4(Vec<Option<i32>>),
    Int8(Vec<Option<i64>>),
    Float8(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
}

impl Array {
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

    pub(super) fn push(&mut self, cell: &Cell) {
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
pub(super) fn arrays(mapping: &Mapping, records: &[&Row]) -> Vec<Array> {
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

pub(super) async fn insert(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<crate::domain::Inserted, DbError> {
    if !mapping.children.is_empty() {
        return super::children::insert(mapping, client, records).await;
    }
    let st = statements(mapping, client).await?;
    if records.is_empty() {
        // The breaker's probe: the statement runs, writing nothing (a read-only server, a
        // missing table or privilege still answer as they would for a batch).
        let statement = client
            .prepare_cached(&st.insert)
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
    if let Some(sql) = &st.insert_new
        && let Some(rows) = crate::domain::insert_if_all_new(client, sql, &params).await?
    {
        if rows == records.len() as u64 {
            return Ok(Inserted {
                rows,
                ..Default::default()
            });
        }
        // Fewer rows than records and no error: the table discarded some (a BEFORE INSERT
        // trigger returned NULL). Which ones, the probe's path says (written: copies now; not
        // written and their key not held: parked, never acked as inserted).
        tracing::warn!(pipeline = %mapping.pipeline, records = records.len(), written = rows,
            "the table wrote fewer rows than the batch had (a trigger discarding rows?); \
             finding which through the probe");
    }
    if let Some(keep) = &st.probe_keep {
        // keep, and some key is held or repeated: the batch through the probe, in one
        // transaction.
        return in_probe(
            &st.probe_table,
            client,
            true,
            keep_in_probe(mapping, st, client, records, &params, keep),
        )
        .await;
    }
    if mapping.delete.is_some() {
        // Deletes: every batch through the probe, under a lock per key (`versions.rs`).
        return super::versions::write(mapping, st, client, records).await;
    }
    let statement = client
        .prepare_cached(&st.insert)
        .await
        .map_err(DbError::from_pg)?;
    match client.query(&statement, &params).await {
        // Every record its key's newest version: the common case, one statement.
        Ok(rows) if rows.len() == records.len() => Ok(Inserted {
            rows: rows.len() as u64,
            ..Default::default()
        }),
        // An older or equal version, or two records of one key (also two that only the
        // column's type says are one, 21000): each record's outcome through the probe. What the
        // statement wrote stays (it is the key's newest version), and is found a copy there.
        Ok(rows) => {
            let mut done = super::versions::write(mapping, st, client, records).await?;
            done.rows += rows.len() as u64;
            Ok(done)
        }
        Err(e) if e.code() == Some(&SqlState::CARDINALITY_VIOLATION) => {
            tracing::debug!(pipeline = %mapping.pipeline, error = %e,
                "records of one key under the column's type: inserting through the probe");
            super::versions::write(mapping, st, client, records).await
        }
        Err(e) => Err(DbError::from_pg(e)),
    }
}

/// `keep`, some key held or repeated, inside the probe's transaction (see [`in_probe`]): the
/// batch inserted in the key's own order (the first delivered of one key wins), then PostgreSQL
/// says of each record skipped whether its key holds the same content (a copy), other content
/// (`id_conflict`), or nothing (another unique index's value).
pub(super) async fn keep_in_probe(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    params: &[&(dyn ToSql + Sync)],
    keep: &str,
) -> Result<Inserted, DbError> {
    let mut conflicts = Vec::new();
    let mut skipped = Vec::new();
    let written = client
        .execute(keep, params)
        .await
        .map_err(DbError::from_pg)? as usize;
    if written == records.len() {
        return Ok(Inserted {
            rows: written as u64,
            ..Default::default()
        });
    }
    for row in client
        .query(st.probe_read.as_str(), &[])
        .await
        .map_err(DbError::from_pg)?
    {
        let i = (row.get::<_, i64>(0) - 1) as usize;
        let stored: bool = row.get(1);
        let same: Vec<bool> = row.get(2);
        if !stored {
            // Its key, as sent, holds nothing: a copy whose key a BEFORE INSERT trigger
            // rewrote (`lower(k)`) is still a copy; else another unique index, or the
            // table, refused it.
            if !same_after_triggers(st, client, i as i64 + 1).await? {
                skipped.push(i);
            }
        } else if let Some(record) = records.get(i)
            && same.iter().any(|s| !s)
            && !same_after_triggers(st, client, i as i64 + 1).await?
        {
            let differs = mapping.in_table_order(
                mapping
                    .columns
                    .iter()
                    .zip(&same)
                    .filter(|(_, s)| !**s)
                    .map(|(c, _)| c.name.as_str()),
            );
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
        unique_holders(mapping, client, &skipped).await?
    };
    Ok(Inserted {
        rows: written as u64,
        conflicts,
        refused,
        ..Default::default()
    })
}

/// Runs `work` in a transaction that holds the probe's table (see [`probe_statements`]), then
/// ends it: committed when `commit` and `work` succeeded, else rolled back. A transaction that
/// cannot be ended is the connection's failure.
pub(super) async fn in_probe<T>(
    probe_table: &str,
    client: &deadpool_postgres::Client,
    commit: bool,
    work: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    let result = match client
        .batch_execute(probe_table)
        .await
        .map_err(DbError::from_pg)
    {
        Ok(()) => work.await,
        Err(e) => Err(e),
    };
    let end = if commit && result.is_ok() {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    match client.batch_execute(end).await {
        Ok(()) => result,
        Err(e) => result.and(Err(DbError::from_pg(e))),
    }
}

/// Whether record `ord` (1 on) of the probe is what its key holds once the table's BEFORE
/// INSERT triggers have made it the row an insert would write (see
/// [`Statements::probe_same`]): asked inside a savepoint rolled back, so nothing changes. An
/// error (a trigger or a constraint refusing the row) is "not the same".
pub(super) async fn same_after_triggers(
    st: &Statements,
    client: &deadpool_postgres::Client,
    ord: i64,
) -> Result<bool, DbError> {
    client
        .batch_execute("SAVEPOINT warren_same")
        .await
        .map_err(DbError::from_pg)?;
    let same = client.query(st.probe_same.as_str(), &[&ord]).await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_same")
        .await
        .map_err(DbError::from_pg)?;
    match same {
        Ok(rows) => Ok(!rows.is_empty()),
        Err(e) if e.as_db_error().is_some() => Ok(false),
        Err(e) => Err(DbError::from_pg(e)),
    }
}

/// Whether `record`'s key holds exactly its content (every mapped column the same), as
/// PostgreSQL converts and compares it. A record the table cannot hold (a value too long, out
/// of range, refused by its domain) is not stored, whatever a cast of it would equal.
pub(super) async fn stored(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
) -> Result<bool, DbError> {
    if record.2 == super::Op::Delete {
        // A refused delete is not asked after: its refusal stands.
        return Ok(false);
    }
    let st = statements(mapping, client).await?;
    let records = [record];
    let arrays = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    in_probe(&st.probe_table, client, false, async {
        match client.query(st.probe_compare.as_str(), &params).await {
            Ok(rows) => match rows.first() {
                Some(row) if row.get::<_, bool>(1) => {
                    let parent = row.get::<_, Vec<bool>>(2).iter().all(|s| *s)
                        || same_after_triggers(st, client, 1).await?;
                    // With child tables, its key must also hold exactly its child rows.
                    Ok(parent
                        && (mapping.children.is_empty()
                            || super::children::same_children(mapping, client, record).await?))
                }
                _ => Ok(false),
            },
            // Data exceptions (22) and integrity violations (23: a domain's CHECK, NOT NULL of
            // a domain): the value cannot be stored as the insert would write it.
            Err(e)
                if e.code()
                    .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23")) =>
            {
                Ok(false)
            }
            Err(e) => Err(DbError::from_pg(e)),
        }
    })
    .await
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

/// For each skipped record (by its index in the batch): why the database skipped it, naming
/// the unique index (other than the key's) that holds its value and the key holding it. Asked
/// of the probe (inside [`in_probe`]), so each index's columns compare as the index does.
async fn unique_holders(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    skipped: &[usize],
) -> Result<Vec<(usize, String)>, DbError> {
    let mut holders = holders(mapping, client, skipped).await?;
    Ok(skipped
        .iter()
        .map(|&i| {
            let reason = match holders.remove(&i) {
                Some(h) => refused_reason(&h.index, &h.columns, Some(h.key), mapping),
                None => format!(
                    "not written, and no unique index of {} holds its values: a unique index \
                     over an expression or a BEFORE INSERT trigger of the table refused or \
                     discarded it (skipped by ON CONFLICT DO NOTHING)",
                    mapping.table
                ),
            };
            (i, reason)
        })
        .collect())
}

/// A unique index (other than the key's) holding a record's values, and the key of the row
/// holding them.
pub(super) struct Holder {
    pub(super) index: String,
    pub(super) columns: Vec<String>,
    /// The key's values, `, `-separated.
    pub(super) key: String,
}

/// Of the records of the probe at `records` (indices in the batch), those whose values a
/// unique index other than the key's holds: the first such index (by name) and the key holding
/// them. Asked of the probe (inside [`in_probe`]), so each index's columns compare as the index
/// does.
pub(super) async fn holders(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[usize],
) -> Result<HashMap<usize, Holder>, DbError> {
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
    let mut found: HashMap<usize, Holder> = HashMap::new();
    for (index, cols) in &indexes {
        let mut sorted: Vec<&str> = cols.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        if sorted == key {
            continue;
        }
        if !cols
            .iter()
            .all(|c| mapping.columns.iter().any(|m| &m.name == c))
        {
            continue; // an index on a column the mapping does not fill
        }
        let pending: Vec<i64> = records
            .iter()
            .filter(|i| !found.contains_key(i))
            .map(|&i| i as i64 + 1)
            .collect();
        if pending.is_empty() {
            break;
        }
        let on: Vec<String> = cols
            .iter()
            .map(|c| format!("s.{q} = p.{q}", q = quote(c)))
            .collect();
        let keys: Vec<String> = mapping
            .key()
            .iter()
            .map(|k| format!("s.{}::text", quote(k)))
            .collect();
        let sql = format!(
            "SELECT p.{ORD}, concat_ws(', ', {keys}) FROM pg_temp.warren_probe p \
             JOIN {table} AS s ON {on} WHERE p.{ORD} = ANY($1)",
            keys = keys.join(", "),
            table = mapping.table.sql(),
            on = on.join(" AND "),
        );
        for row in client
            .query(&sql, &[&pending])
            .await
            .map_err(DbError::from_pg)?
        {
            let i = (row.get::<_, i64>(0) - 1) as usize;
            found.entry(i).or_insert_with(|| Holder {
                index: index.clone(),
                columns: cols.clone(),
                key: row.get(1),
            });
        }
    }
    Ok(found)
}
