//! The probe's questions for a batch that is not simply new (see `insert.rs`): [`in_probe`]
//! (a transaction around a temporary copy of the mapped columns), `keep`'s insert through it
//! ([`keep_in_probe`]), whether a record is what its key holds once the table's triggers ran
//! ([`same_after_triggers`]), and which unique index holds a skipped record's value
//! ([`holders`], [`refused_reason`]).

use std::collections::HashMap;

use tokio_postgres::types::ToSql;

use super::arrays::key_text;
use super::statements::{ORD, Statements};
use super::{Mapping, Row, quote};
use crate::db::error::DbError;
use crate::domain::Inserted;

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
/// [`Statements::probe_same`]), or, with `update`, the row an update of the stored row would
/// write ([`Statements::probe_same_update`]): each asked inside a savepoint rolled back, so
/// nothing changes. An error (a trigger or a constraint refusing the row) is "not the same".
pub(super) async fn same_after_triggers(
    st: &Statements,
    client: &deadpool_postgres::Client,
    ord: i64,
) -> Result<bool, DbError> {
    if same_by(&st.probe_same, client, ord).await? {
        return Ok(true);
    }
    match &st.probe_same_update {
        Some(sql) => same_by(sql, client, ord).await,
        None => Ok(false),
    }
}

/// `update`: the version stored under the key record `ord`'s insert lands on once the
/// table's BEFORE INSERT triggers made it, and whether it is higher than or equal to the
/// record's ([`Statements::probe_folded`]); `None` when no row holds that key, or the question
/// was refused. Asked inside a savepoint rolled back.
pub(super) async fn folded_after_triggers(
    st: &Statements,
    client: &deadpool_postgres::Client,
    ord: i64,
) -> Result<Option<(String, bool, bool)>, DbError> {
    let Some(sql) = &st.probe_folded else {
        return Ok(None);
    };
    client
        .batch_execute("SAVEPOINT warren_folded")
        .await
        .map_err(DbError::from_pg)?;
    let found = client.query_opt(sql.as_str(), &[&ord]).await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_folded; RELEASE SAVEPOINT warren_folded")
        .await
        .map_err(DbError::from_pg)?;
    match found {
        Ok(row) => Ok(row.map(|r| (r.get(0), r.get(1), r.get(2)))),
        Err(e) if !crate::db::error::of_the_moment(&e) => Ok(None),
        Err(e) => Err(DbError::from_pg(e)),
    }
}

/// Whether `sql` (the record `$1`) answers a row, asked inside a savepoint rolled back.
async fn same_by(sql: &str, client: &deadpool_postgres::Client, ord: i64) -> Result<bool, DbError> {
    client
        .batch_execute("SAVEPOINT warren_same")
        .await
        .map_err(DbError::from_pg)?;
    let same = client.query(sql, &[&ord]).await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_same; RELEASE SAVEPOINT warren_same")
        .await
        .map_err(DbError::from_pg)?;
    match same {
        Ok(rows) => Ok(!rows.is_empty()),
        Err(e) if !crate::db::error::of_the_moment(&e) => Ok(false),
        Err(e) => Err(DbError::from_pg(e)),
    }
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
