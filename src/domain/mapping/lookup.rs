//! The API's questions to a pipeline's table, asked as the pipeline's insert would find the
//! answer and never written: the row of a key (`GET`), whether PostgreSQL can hold a record's
//! values, and what the table holds for a record before it is published ([`Standing`],
//! `api_check`). Each runs in a transaction that is rolled back, through the probe of
//! `insert.rs` (PostgreSQL converts and compares, warren never casts).

use tokio_postgres::types::ToSql;

use super::insert::{
    Array, arrays, holders, in_probe, same_after_triggers, shown, statements, types_on_path,
};
use super::{ColType, Mapping, Row, quote};
use crate::db::error::DbError;

/// What the table holds for one record, asked before it is published (the API's
/// `api_check`), as the pipeline's insert would find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Neither its key nor a value another unique index holds: the insert would write it.
    New,
    /// Its key, with the same content: it is stored already.
    Same,
    /// Its key, with other content in these columns (`id_conflict` in the pipeline).
    Conflict(Vec<String>),
    /// Another unique index holds its values (`db_permanent` in the pipeline): the index's
    /// columns, the record's values in them (as text), and the key of the row holding them.
    Taken {
        columns: Vec<String>,
        values: Vec<String>,
        holder: String,
    },
    /// PostgreSQL cannot hold one of its values (the server's words; `db_permanent`).
    Unstorable(String),
}

/// See [`Standing`]: the record into the probe, compared with what its key holds, then, when
/// its key holds nothing, looked up in the table's other unique indexes; all rolled back.
pub(super) async fn standing(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
) -> Result<Standing, DbError> {
    let st = statements(mapping, client).await?;
    let records = [record];
    let arrays = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    in_probe(&st.probe_table, client, false, async {
        let rows = match client.query(st.probe_compare.as_str(), &params).await {
            Ok(rows) => rows,
            Err(e)
                if e.code()
                    .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23")) =>
            {
                return Ok(Standing::Unstorable(Unstorable::of(&e).0));
            }
            Err(e) => return Err(DbError::from_pg(e)),
        };
        let Some(row) = rows.first() else {
            return Ok(Standing::New);
        };
        if row.get::<_, bool>(1) {
            let same: Vec<bool> = row.get(2);
            if same.iter().all(|s| *s) || same_after_triggers(st, client, 1).await? {
                return Ok(Standing::Same);
            }
            let differs = mapping.in_table_order(
                mapping
                    .columns
                    .iter()
                    .zip(&same)
                    .filter(|(_, s)| !**s)
                    .map(|(c, _)| c.name.as_str()),
            );
            return Ok(Standing::Conflict(
                differs.into_iter().map(str::to_string).collect(),
            ));
        }
        Ok(match holders(mapping, client, &[0]).await?.remove(&0) {
            Some(h) => {
                let values = h
                    .columns
                    .iter()
                    .filter_map(|c| mapping.columns.iter().position(|m| &m.name == c))
                    .map(|i| shown(&record.0[i]))
                    .collect();
                Standing::Taken {
                    columns: h.columns,
                    values,
                    holder: h.key,
                }
            }
            None => Standing::New,
        })
    })
    .await
}

/// The mapping's type of `key`'s column as an SQL type, for a key given as text (a path of the
/// API): the text is read as the mapping would send it, then converted to the column by the
/// probe, as the pipeline's insert would.
fn sent_as(ty: ColType) -> &'static str {
    match ty {
        // A JSON document as a key is its text.
        ColType::Jsonb => "text",
        other => other.as_str(),
    }
}

/// The row `s` as JSON text, every column as `to_jsonb` writes it but a `timestamptz`, written
/// in UTC to the microsecond, `2026-11-28T10:00:00.123000Z` (RFC 3339, as `GET /api/v1/users`
/// always wrote `inserted_at`), whatever the session's time zone; `infinity` stays as it is.
const ROW_JSON: &str = "(SELECT jsonb_object_agg(e.key, CASE \
     WHEN a.atttypid = 'timestamptz'::regtype AND jsonb_typeof(e.value) = 'string' THEN \
     CASE WHEN e.value #>> '{}' IN ('infinity', '-infinity') THEN e.value \
     ELSE to_jsonb(to_char((e.value #>> '{}')::timestamptz AT TIME ZONE 'UTC', \
     'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')) END \
     ELSE e.value END) \
     FROM jsonb_each(to_jsonb(s.*)) AS e \
     LEFT JOIN pg_catalog.pg_attribute AS a ON a.attrelid = s.tableoid AND a.attname = e.key)::text";

/// Runs `sql` (and `params`) in a transaction holding `create`'s temporary table, rolled back.
async fn rolled_back<T>(
    client: &tokio_postgres::Client,
    create: &str,
    work: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    let result = match client.batch_execute(create).await {
        Ok(()) => work.await,
        Err(e) => Err(e),
    };
    match client.batch_execute("ROLLBACK").await {
        Ok(()) => result,
        Err(e) => result.and(Err(e)),
    }
}

/// The row whose one-column key equals `key` as the pipeline would store it (the API's `GET`),
/// as JSON text: `key` is converted to the column's type by an insert into the probe (so a
/// value too long for a `varchar(3)` key is refused, 22001, never truncated onto another
/// row), then compared with the column's own equality (a `citext` key finds its row in any
/// case); a `timestamptz` written as [`ROW_JSON`] says. `None` when no row holds it.
pub(super) async fn find_by_key(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
    key: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let [k] = mapping.key.as_slice() else {
        return Ok(None);
    };
    let column = &mapping.columns[*k];
    let name = quote(&column.name);
    // The casts read once per mapping with its statements, not a catalog query per GET.
    let casts = match statements(mapping, client).await {
        Ok(st) => st.casts.clone(),
        Err(_) => Vec::new(),
    };
    let ty = casts
        .get(*k)
        .cloned()
        .flatten()
        .unwrap_or_else(|| sent_as(column.ty).to_string());
    let t = mapping.table.sql();
    let create = format!(
        "BEGIN; {path} CREATE TEMPORARY TABLE warren_key ON COMMIT DROP AS \
         SELECT {name} FROM {t} WITH NO DATA",
        path = types_on_path(&mapping.table),
    );
    let sql = format!(
        "WITH p AS (INSERT INTO pg_temp.warren_key ({name}) SELECT $1::text::{ty} RETURNING {name}) \
         SELECT {ROW_JSON} FROM {t} AS s JOIN p ON s.{name} = p.{name}"
    );
    rolled_back(client, &create, async {
        // `s.*`, the whole row: `to_jsonb(s)` would be a column of the table named `s`.
        match client.query_opt(&sql, &[&key]).await? {
            Some(row) => Ok(row.try_get::<_, Option<String>>(0)?),
            None => Ok(None),
        }
    })
    .await
}

/// A value PostgreSQL refuses to hold in the table (a data exception or a domain's check,
/// SQLSTATE 22 or 23): the code and the server's words, `22001 value too long for type ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unstorable(pub String);

impl Unstorable {
    fn of(e: &tokio_postgres::Error) -> Self {
        Self(match e.as_db_error() {
            Some(db) => format!("{} {}", db.code().code(), db.message()),
            None => e.to_string(),
        })
    }
}

/// Whether the table can hold `record` as the pipeline's insert would write it: converted by
/// PostgreSQL into the columns' types in the probe, rolled back. `Ok(Err(refusal))`: a value
/// PostgreSQL refuses (a data exception or a domain's check, SQLSTATE 22 or 23), with the
/// server's words; the table's own constraints, triggers and keys are the pipeline's to meet.
pub(super) async fn storable(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
    record: &Row,
) -> Result<Result<(), Unstorable>, tokio_postgres::Error> {
    let st = match statements(mapping, client).await {
        Ok(st) => st,
        Err(_) => &mapping.statements,
    };
    let records = [record];
    let arrays = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    rolled_back(client, &st.probe_table, async {
        match client.query(st.probe_compare.as_str(), &params).await {
            Ok(_) => Ok(Ok(())),
            Err(e)
                if e.code()
                    .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23")) =>
            {
                Ok(Err(Unstorable::of(&e)))
            }
            Err(e) => Err(e),
        }
    })
    .await
}
