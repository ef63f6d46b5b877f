//! The API's questions to a pipeline's table, asked as the pipeline's insert would find the
//! answer and never written: the row of a key (`GET`), whether PostgreSQL can hold a record's
//! values, and what the table holds for a record before it is published ([`Standing`],
//! `api_check`). Each runs in a transaction that is rolled back, through the probe of
//! `insert.rs` (PostgreSQL converts and compares, warren never casts). And `warren pipelines
//! test --db`'s [`Trial`]: a record's parent and child rows written into the live tables by
//! the pipeline's own statements, in a transaction rolled back.

use tokio_postgres::types::ToSql;

use super::arrays::{Array, arrays, shown};
use super::probe::{holders, in_probe, same_after_triggers};
use super::statements::{statements, types_on_path};
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

/// The row `alias` as jsonb, every column as `to_jsonb` writes it but a `timestamptz`, written
/// in UTC to the microsecond, `2026-11-28T10:00:00.123000Z` (RFC 3339, as `GET /api/v1/users`
/// always wrote `inserted_at`), whatever the session's time zone; `infinity` stays as it is.
fn row_json(alias: &str) -> String {
    format!(
        "(SELECT jsonb_object_agg(e.key, CASE \
         WHEN a.atttypid = 'timestamptz'::regtype AND jsonb_typeof(e.value) = 'string' THEN \
         CASE WHEN e.value #>> '{{}}' IN ('infinity', '-infinity') THEN e.value \
         ELSE to_jsonb(to_char((e.value #>> '{{}}')::timestamptz AT TIME ZONE 'UTC', \
         'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')) END \
         ELSE e.value END) \
         FROM jsonb_each(to_jsonb({alias}.*)) AS e \
         LEFT JOIN pg_catalog.pg_attribute AS a ON a.attrelid = {alias}.tableoid \
           AND a.attname = e.key)"
    )
}

/// The row `s` as [`row_json`] writes it, with each child table's rows of it under its
/// array's name (the last segment of `rows`: `"items": [...]`), each row as [`row_json`]
/// writes it, in the order of the element's position (an `index` column), else of the child
/// table's key; `[]` when it has none.
fn with_children(mapping: &Mapping) -> String {
    let mut out = row_json("s");
    for child in &mapping.children {
        let name = child.rows().rsplit('/').next().unwrap_or_default();
        let name = name
            .replace("~1", "/")
            .replace("~0", "~")
            .replace('\'', "''");
        let link: Vec<String> = mapping
            .key
            .iter()
            .filter_map(|&pk| {
                let c = child
                    .columns
                    .iter()
                    .find(|c| c.source == super::Source::Parent(pk))?;
                Some(format!(
                    "c.{} = s.{}",
                    quote(&c.name),
                    quote(&mapping.columns[pk].name)
                ))
            })
            .collect();
        let order: Vec<String> = match child
            .columns
            .iter()
            .find(|c| c.source == super::Source::Index)
        {
            Some(c) => vec![format!("c.{}", quote(&c.name))],
            None => child
                .key
                .iter()
                .map(|&i| format!("c.{}", quote(&child.columns[i].name)))
                .collect(),
        };
        out = format!(
            "({out} || jsonb_build_object('{name}', (SELECT COALESCE(jsonb_agg({} ORDER BY {}), \
             '[]'::jsonb) FROM {} AS c WHERE {})))",
            row_json("c"),
            order.join(", "),
            child.table.sql(),
            link.join(" AND "),
        );
    }
    format!("{out}::text")
}

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
/// case); a `timestamptz` written as [`row_json`] says, and each child table's rows under its
/// array's name ([`with_children`]). `None` when no row holds it.
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
         SELECT {} FROM {t} AS s JOIN p ON s.{name} = p.{name}",
        with_children(mapping)
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

/// What the live tables make of one record's rows (`warren pipelines test --db`): written by
/// the pipeline's own statements (the parent row, then each child table's rows) in a
/// transaction that is rolled back, so the tables' CHECKs, foreign keys, triggers and types
/// answer as they would for the pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trial {
    /// Written: the parent row and this many child rows.
    Written(u64),
    /// Its key holds a row already: nothing of it was written (the stored row and its child
    /// rows are only read), and the pipeline's `on_conflict` decides what it is (`keep`: a
    /// copy or `id_conflict`; `update`: a replacement when its version is higher, else a
    /// copy, `stale` or `id_conflict`).
    Held,
    /// The insert wrote no row and no key held it: a trigger discarded it (the pipeline parks
    /// it `db_permanent`).
    Discarded,
    /// The database refused a row of it (the pipeline's `db_permanent`).
    Refused(Refusal),
    /// A delete: it writes no rows, so nothing of it is tried.
    Delete,
}

/// A row the database refused, in its words: the SQLSTATE, the message, the table, column and
/// constraint it names (where it names them) and its detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: String,
    pub message: String,
    pub table: Option<String>,
    pub column: Option<String>,
    pub constraint: Option<String>,
    pub detail: Option<String>,
}

impl Refusal {
    fn of(db: &tokio_postgres::error::DbError) -> Self {
        let shown = |s: &str| crate::text::shown(s).into_owned();
        Self {
            code: db.code().code().to_string(),
            message: shown(db.message()),
            table: db.table().map(shown),
            column: db.column().map(shown),
            constraint: db.constraint().map(shown),
            detail: db.detail().map(shown),
        }
    }
}

impl std::fmt::Display for Refusal {
    /// `23514 new row for relation "order_items" violates check constraint "..." (table
    /// order_items, constraint ...): Failing row contains (...)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.code, self.message)?;
        let named: Vec<String> = [
            ("table", &self.table),
            ("column", &self.column),
            ("constraint", &self.constraint),
        ]
        .into_iter()
        .filter_map(|(what, v)| v.as_ref().map(|v| format!("{what} {v}")))
        .collect();
        if !named.is_empty() {
            write!(f, " ({})", named.join(", "))?;
        }
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

/// See [`Trial`]. First the key is looked up, read only (through the probe, as PostgreSQL
/// converts it): a key the table holds is [`Trial::Held`], and nothing of it is written.
/// Else `keep`: the plain insert of the batch whose keys are all new (a key held meanwhile is
/// its unique violation, told apart from another unique index's by the index's columns);
/// `update`: the upsert, then, as the pipeline does, the key's stored children (none, unless
/// left by another writer) deleted before the record's are inserted. A refusal is one the pipeline would park (a data or integrity error, or a code
/// only a row can cause: a trigger's); any other failure is the database's, an `Err`.
pub(super) async fn trial(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
    record: &Row,
) -> Result<Trial, DbError> {
    if record.2 == super::Op::Delete {
        return Ok(Trial::Delete);
    }
    let st = statements(mapping, client).await?;
    let records = [record];
    let arrays = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    let key_params: Vec<&(dyn ToSql + Sync)> = mapping.key.iter().map(|&i| params[i]).collect();
    // BEGIN, and the probe's table: the record converted into the table's types.
    client
        .batch_execute(&st.probe_table)
        .await
        .map_err(DbError::from_pg)?;
    let tried = async {
        // A key the table holds is only read, never written: its row and child rows are the
        // live pipeline's, and a write (the upsert of a higher version, the delete of its
        // children) would lock them for the trial, fire their UPDATE and DELETE triggers, and
        // hold the pipeline's own writes to that key until the rollback.
        let found = client.query(st.probe_compare.as_str(), &params).await?;
        if found.first().is_some_and(|row| row.get::<_, bool>(1)) {
            return Ok(Trial::Held);
        }
        // `update`: its key as sent is not held, but the key its insert lands on may be (a
        // BEFORE trigger folding the key): then the run finds it stale, a copy, a conflict or
        // a newer version, as for a held key (review R41b F14: refused here as the unique
        // violation the plain insert meets). Asked in a savepoint rolled back, which locks
        // that row for the moment it takes.
        if mapping.version.is_some() {
            client
                .batch_execute("SAVEPOINT warren_trial_folded")
                .await?;
            let folded = match &st.probe_folded {
                Some(sql) => client.query_opt(sql.as_str(), &[&1i64]).await,
                None => Ok(None),
            };
            client
                .batch_execute("ROLLBACK TO SAVEPOINT warren_trial_folded; RELEASE SAVEPOINT warren_trial_folded")
                .await?;
            match folded {
                Ok(Some(_)) => return Ok(Trial::Held),
                Ok(None) => {}
                Err(e) if e.as_db_error().is_some() => {}
                Err(e) => return Err(e),
            }
        }
        // Its key is not held (above): the plain insert writes what the upsert would.
        let parent = st.insert_plain.as_str();
        if client.execute(parent, &params).await? == 0 {
            // No row held its key (above), and the insert wrote none: a BEFORE INSERT trigger
            // discarded it, as the run finds it and parks it (review R36h F11: an `update`
            // pipeline's discarded row was said "stored already"), unless the trigger wrote
            // it itself where the table shows it (classic trigger partitioning into an
            // inheritance child), which the run stores (review R40b F4: refused here, and by
            // the API's pre-check for every new key of such a table).
            let now = client.query(st.probe_compare.as_str(), &params).await?;
            if !now.first().is_some_and(|row| row.get::<_, bool>(1)) {
                return Ok(Trial::Discarded);
            }
        }
        // Written, but not under its key as sent (compared in the table's types, through the
        // probe): a BEFORE trigger rewrote the key, which the run refuses with `update` in
        // these words (review R38-F4: `ok` with no child rows, a child table's words with some).
        // Without child tables or deletes, which go by the key as sent, the row under the
        // rewritten key is the message's, as the run writes it.
        if mapping.version.is_some() && (!mapping.children.is_empty() || mapping.delete.is_some()) {
            let on: Vec<String> = mapping
                .key
                .iter()
                .map(|&i| {
                    let k = quote(&mapping.columns[i].name);
                    format!("s.{k} = p.{k}")
                })
                .collect();
            let ours = client
                .query_one(
                    &format!(
                        "SELECT EXISTS (SELECT 1 FROM {} AS s, pg_temp.warren_probe AS p \
                         WHERE {} AND s.xmin = pg_current_xact_id()::xid)",
                        mapping.table.sql(),
                        on.join(" AND ")
                    ),
                    &[],
                )
                .await?
                .get::<_, bool>(0);
            if !ours {
                let (code, message) = super::versions::key_rewritten_words(mapping);
                return Ok(Trial::Refused(Refusal {
                    code,
                    message,
                    table: Some(mapping.table.to_string()),
                    column: None,
                    constraint: None,
                    detail: None,
                }));
            }
        }
        let children = match super::children::trial(mapping, client, record, &key_params).await? {
            Ok(children) => children,
            Err(discarded) => {
                return Ok(Trial::Refused(Refusal {
                    code: discarded.code.into(),
                    message: discarded.message,
                    table: Some(discarded.table),
                    column: None,
                    constraint: None,
                    detail: None,
                }));
            }
        };
        // Deferred constraints (a foreign key or a constraint trigger `DEFERRABLE INITIALLY
        // DEFERRED`) are checked at a commit, which a trial never makes: checked now, so what
        // the run's commit refuses the trial refuses (review R36h F10, R36i F1).
        client
            .batch_execute("SET CONSTRAINTS ALL IMMEDIATE")
            .await?;
        Ok::<_, tokio_postgres::Error>(Trial::Written(children))
    }
    .await;
    let rolled_back = client.batch_execute("ROLLBACK").await;
    let trial = match tried {
        Ok(trial) => trial,
        Err(e) => {
            let Some(db) = e.as_db_error() else {
                return Err(DbError::from_pg(e));
            };
            let error = DbError::Server {
                code: db.code().code().to_string(),
                message: crate::text::shown(db.message()).into_owned(),
            };
            let row_specific = error.class() == crate::db::error::ErrorClass::Permanent
                || error.may_be_row_specific();
            if !row_specific {
                return Err(error);
            }
            // `keep`'s plain insert: the key's own unique index is the key held.
            if mapping.version.is_none()
                && db.code() == &tokio_postgres::error::SqlState::UNIQUE_VIOLATION
                && db.table() == Some(mapping.table.name.as_str())
                && rolled_back.is_ok()
                && is_key_index(mapping, client, db).await?
            {
                Trial::Held
            } else {
                Trial::Refused(Refusal::of(db))
            }
        }
    };
    rolled_back.map_err(DbError::from_pg)?;
    Ok(trial)
}

/// Whether the unique index a violation names (`db.constraint()`, in `db.schema()`) is on
/// exactly the mapping's key columns.
async fn is_key_index(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
    db: &tokio_postgres::error::DbError,
) -> Result<bool, DbError> {
    let (Some(schema), Some(index)) = (db.schema(), db.constraint()) else {
        return Ok(false);
    };
    let row = client
        .query_opt(
            "SELECT array_agg(a.attname::text ORDER BY a.attname) \
             FROM pg_class i JOIN pg_namespace n ON n.oid = i.relnamespace \
             JOIN pg_index x ON x.indexrelid = i.oid \
             JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = ANY(x.indkey) \
             WHERE n.nspname = $1 AND i.relname = $2",
            &[&schema, &index],
        )
        .await
        .map_err(DbError::from_pg)?;
    let Some(columns) = row.and_then(|r| r.get::<_, Option<Vec<String>>>(0)) else {
        return Ok(false);
    };
    let mut key: Vec<String> = mapping.key().iter().map(|k| k.to_string()).collect();
    key.sort();
    Ok(columns == key)
}
