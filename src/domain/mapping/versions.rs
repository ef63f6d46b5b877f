//! `on_conflict = "update"` when a batch is not simply every key's newest version: each record
//! gets its own outcome, decided by PostgreSQL inside one transaction (the probe's):
//! - written: its key's highest version in the batch (of equal ones, the first delivered), and
//!   higher than what the key holds (a row's version, or a tombstone's): the row (and its child
//!   rows) replaced, or, for a delete, the row and its child rows gone and a tombstone written;
//! - `stale`: older than the version its key holds or the batch writes: changed nothing, acked,
//!   counted as stale, never as inserted;
//! - the same version as the key holds: the same content (child rows included), or a delete of
//!   a key whose tombstone has that version, is a copy (an idempotent success); other content,
//!   or a row and a delete under one version, is `id_conflict` (two states under one version is
//!   a producer's bug a team must see: dead-lettered, then parked).
//!
//! The steps, after the records are in the probe (converted by PostgreSQL into the table's
//! types): with deletes, an advisory lock per key (so a write and a delete of one key in two
//! concurrent batches take turns: each sees what the other committed); the winning writes from
//! the probe (a tombstone as new as the record holds it back); their child rows replaced; the
//! winning deletes' tombstones, then their child rows and rows deleted; the tombstones a newer
//! row replaced, removed; then one query says of every record what happened to it.
//!
//! Tombstones (`tombstones_<pipeline>`, made by `warren declare`, see [`declare`]): per deleted
//! key, the delete's version and when it was written. A tombstone goes when a newer version of
//! its key is written (the row guards the key again); otherwise it stays until an operator
//! prunes it (docs/pipelines.md: a parked or replayed older copy arriving after that would
//! write its key again).

use tokio_postgres::types::ToSql;

use super::children::Child;
use super::insert::{self, Array, ORD, Statements, key_text, shown};
use super::{Column, Mapping, Op, Row, TableName, quote};
use crate::db::error::DbError;
use crate::domain::Inserted;

/// The transaction's own id, to tell the rows and tombstones this transaction wrote (`xmin`).
const OURS: &str = "pg_current_xact_id()::xid";

/// The statements of an `update` mapping's probe path, built once with its other statements.
#[derive(Debug, Clone)]
pub(super) struct VersionStatements {
    /// The writes into the probe (`$1..$n`, then `$n+1` each record's ordinal in the batch).
    fill: String,
    /// With deletes: the deletes' probe (key and version columns, as the table types them).
    del_table: Option<String>,
    /// The deletes into it (`$1..$k` the key, `$k+1` the version, `$k+2` the ordinals).
    del_fill: String,
    /// With deletes: one advisory lock per key of the batch, in the order of the keys' hashes.
    lock: Option<String>,
    /// Each key's winning write, from the probe, unless a tombstone as new holds it back.
    upsert: String,
    /// With deletes: each key's winning delete's tombstone, unless a row as new holds it back.
    tomb_write: String,
    /// With deletes: the rows whose tombstone this transaction wrote, deleted.
    rows_gone: String,
    /// With deletes: the tombstones of keys whose row this transaction wrote, removed.
    tomb_clear: String,
    /// Per record: ordinal, delete?, written?, older than the key holds?, is the stored row at
    /// its version?, is the tombstone at its version?, the key's stored version as text.
    classify: String,
}

impl VersionStatements {
    pub(super) fn build(
        table: &TableName,
        columns: &[Column],
        key: &[usize],
        version: usize,
        casts: &[Option<String>],
        tombstones: Option<&TableName>,
    ) -> Self {
        let t = table.sql();
        let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
        let list = names.join(", ");
        let n = columns.len();
        let params = insert::params(columns, casts);
        let keys: Vec<String> = key.iter().map(|&i| names[i].clone()).collect();
        let ver = &names[version];
        let of = |alias: &str| -> String {
            keys.iter()
                .map(|k| format!("{alias}.{k}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let on = |a: &str, b: &str| -> String {
            keys.iter()
                .map(|k| format!("{a}.{k} = {b}.{k}"))
                .collect::<Vec<_>>()
                .join(" AND ")
        };
        let fill = format!(
            "INSERT INTO pg_temp.warren_probe ({list}, {ORD}) SELECT * FROM UNNEST({}, ${}::int8[])",
            params.join(", "),
            n + 1
        );
        let kv = format!("{}, {ver}", keys.join(", "));
        let del_table = tombstones.map(|_| {
            format!(
                "CREATE TEMPORARY TABLE warren_probe_del ON COMMIT DROP AS \
                 SELECT {kv}, 0::int8 AS {ORD} FROM {t} WITH NO DATA"
            )
        });
        let kv_params: Vec<String> = key
            .iter()
            .chain(std::iter::once(&version))
            .enumerate()
            .map(|(j, &i)| {
                insert::param(
                    columns[i].ty,
                    j + 1,
                    casts.get(i).and_then(|c| c.as_deref()),
                )
            })
            .collect();
        let del_fill = format!(
            "INSERT INTO pg_temp.warren_probe_del ({kv}, {ORD}) SELECT * FROM UNNEST({}, ${}::int8[])",
            kv_params.join(", "),
            key.len() + 2
        );
        // Every record: the writes, and with deletes the deletes.
        let every = match tombstones {
            Some(_) => format!(
                "(SELECT {kv}, {ORD}, false AS del FROM pg_temp.warren_probe \
                 UNION ALL SELECT {kv}, {ORD}, true FROM pg_temp.warren_probe_del)"
            ),
            None => format!("(SELECT {kv}, {ORD}, false AS del FROM pg_temp.warren_probe)"),
        };
        // Each key's winner: its highest version, of equal ones the first delivered.
        let winners = format!(
            "(SELECT DISTINCT ON ({k}) {kv}, {ORD}, del FROM {every} AS u \
             ORDER BY {k}, {ver} DESC, {ORD})",
            k = keys.join(", "),
        );
        let hash: Vec<String> = keys
            .iter()
            .map(|k| format!("hash_array(ARRAY[u.{k}])"))
            .collect();
        let lock = tombstones.map(|tomb| {
            format!(
                "SELECT pg_advisory_xact_lock(hashtext({name}), x.h) FROM (SELECT DISTINCT {h} \
                 AS h FROM {every} AS u ORDER BY 1 OFFSET 0) AS x",
                name = sql_text(&tomb.sql()),
                h = hash.join(" # "),
            )
        });
        let held_back = match tombstones {
            Some(tomb) => format!(
                " AND NOT EXISTS (SELECT 1 FROM {tomb} AS tb WHERE {} AND tb.{ver} >= p.{ver})",
                on("tb", "p"),
                tomb = tomb.sql()
            ),
            None => String::new(),
        };
        let p_list: Vec<String> = names.iter().map(|c| format!("p.{c}")).collect();
        let upsert = format!(
            "INSERT INTO {t} AS stored ({list}) SELECT {p_list} FROM pg_temp.warren_probe AS p \
             WHERE p.{ORD} IN (SELECT w.{ORD} FROM {winners} AS w WHERE NOT w.del){held_back} \
             ORDER BY {p_keys} {conflict} RETURNING 1",
            p_list = p_list.join(", "),
            p_keys = of("p"),
            conflict = insert::on_conflict_update(&names, key, version),
        );
        let (tomb_write, rows_gone, tomb_clear) = match tombstones {
            Some(tomb) => {
                let tomb = tomb.sql();
                (
                    format!(
                        "INSERT INTO {tomb} AS tb ({kv}) SELECT {w_keys}, w.{ver} FROM {winners} AS w \
                         WHERE w.del AND NOT EXISTS (SELECT 1 FROM {t} AS s WHERE {s_w} \
                           AND s.{ver} >= w.{ver}) \
                         ORDER BY {w_keys} \
                         ON CONFLICT ({k}) DO UPDATE SET {ver} = EXCLUDED.{ver}, deleted_at = now() \
                         WHERE tb.{ver} < EXCLUDED.{ver}",
                        w_keys = of("w"),
                        s_w = on("s", "w"),
                        k = keys.join(", "),
                    ),
                    format!(
                        "DELETE FROM {t} AS s USING {tomb} AS tb WHERE {} AND tb.xmin = {OURS} \
                         AND (s.{ver} IS NULL OR s.{ver} < tb.{ver})",
                        on("s", "tb")
                    ),
                    format!(
                        "DELETE FROM {tomb} AS tb USING {t} AS s WHERE {} AND s.xmin = {OURS} \
                         AND tb.{ver} < s.{ver}",
                        on("tb", "s")
                    ),
                )
            }
            None => Default::default(),
        };
        let (tb_join, tb_ver, tb_ours) = match tombstones {
            Some(tomb) => (
                format!(" LEFT JOIN {} AS tb ON {}", tomb.sql(), on("tb", "u")),
                format!("tb.{ver}"),
                format!("tb.xmin = {OURS}"),
            ),
            None => (String::new(), "NULL".to_string(), "false".to_string()),
        };
        let classify = format!(
            "SELECT u.{ORD}, u.del, \
               COALESCE(w.{ORD} = u.{ORD} AND CASE WHEN u.del THEN {tb_ours} \
                 ELSE s.xmin = {OURS} END, false), \
               COALESCE(u.{ver} < GREATEST(s.{ver}, {tb_ver}), false), \
               COALESCE(s.{ver} = u.{ver}, false), \
               COALESCE({tb_ver} = u.{ver}, false), \
               GREATEST(s.{ver}, {tb_ver})::text, \
               COALESCE({tb_ver} > s.{ver} OR s.{first} IS NULL, false) \
             FROM {every} AS u JOIN {winners} AS w ON {w_u} \
             LEFT JOIN {t} AS s ON {s_u}{tb_join}",
            first = keys[0],
            w_u = on("w", "u"),
            s_u = on("s", "u"),
        );
        Self {
            fill,
            del_table,
            del_fill,
            lock,
            upsert,
            tomb_write,
            rows_gone,
            tomb_clear,
            classify,
        }
    }
}

/// `s` as an SQL string literal.
fn sql_text(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// What one record's classification said (see [`VersionStatements::classify`]).
struct Found {
    delete: bool,
    written: bool,
    older: bool,
    row_at: bool,
    tomb_at: bool,
    /// The key's newest stored version (row or tombstone), as text.
    newest: Option<String>,
    /// The newest is a tombstone's (the key is deleted).
    deleted: bool,
}

/// Writes `records` of an `update` mapping through the probe, in one transaction, and says
/// of each what it did (see the module's doc).
pub(super) async fn write(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<Inserted, DbError> {
    let Some(vs) = &st.versions else {
        return Err(DbError::Migration("update without its statements".into()));
    };
    let writes: Vec<(usize, &Row)> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.2 == Op::Write)
        .map(|(i, r)| (i, *r))
        .collect();
    let deletes: Vec<(usize, &Row)> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.2 == Op::Delete)
        .map(|(i, r)| (i, *r))
        .collect();
    insert::in_probe(&st.probe_table, client, true, async {
        let rows: Vec<&Row> = writes.iter().map(|(_, r)| *r).collect();
        let arrays = insert::arrays(mapping, &rows);
        let ords: Vec<i64> = writes.iter().map(|(i, _)| *i as i64 + 1).collect();
        let mut params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
        params.push(&ords);
        exec(client, &vs.fill, &params).await?;
        if let Some(del_table) = &vs.del_table {
            client
                .batch_execute(del_table)
                .await
                .map_err(DbError::from_pg)?;
            let rows: Vec<&Row> = deletes.iter().map(|(_, r)| *r).collect();
            let arrays = insert::arrays(mapping, &rows);
            let ords: Vec<i64> = deletes.iter().map(|(i, _)| *i as i64 + 1).collect();
            let mut params: Vec<&(dyn ToSql + Sync)> = mapping
                .key
                .iter()
                .chain(&mapping.version)
                .map(|&i| arrays[i].as_param())
                .collect();
            params.push(&ords);
            exec(client, &vs.del_fill, &params).await?;
        }
        if let Some(lock) = &vs.lock {
            client.query(lock, &[]).await.map_err(DbError::from_pg)?;
        }
        let written = exec(client, &vs.upsert, &[]).await?;
        for (n, child) in mapping.children.iter().enumerate() {
            replace_children(child, n, client, &writes).await?;
        }
        if vs.lock.is_some() {
            exec(client, &vs.tomb_write, &[]).await?;
            for child in &mapping.children {
                exec(client, child.delete_tombstoned(), &[]).await?;
            }
            exec(client, &vs.rows_gone, &[]).await?;
            exec(client, &vs.tomb_clear, &[]).await?;
        }
        let mut found: Vec<(usize, Found)> = Vec::with_capacity(records.len());
        for row in client
            .query(vs.classify.as_str(), &[])
            .await
            .map_err(DbError::from_pg)?
        {
            let i = (row.get::<_, i64>(0) - 1) as usize;
            found.push((
                i,
                Found {
                    delete: row.get(1),
                    written: row.get(2),
                    older: row.get(3),
                    row_at: row.get(4),
                    tomb_at: row.get(5),
                    newest: row.get(6),
                    deleted: row.get(7),
                },
            ));
        }
        found.sort_by_key(|(i, _)| *i);
        outcomes(mapping, st, client, records, found, written).await
    })
    .await
}

/// Each record's outcome from what the classification found; a write at its key's stored
/// version is compared with what the key holds (columns, then child rows).
async fn outcomes(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    found: Vec<(usize, Found)>,
    written: u64,
) -> Result<Inserted, DbError> {
    let mut done = Inserted {
        rows: written,
        ..Default::default()
    };
    let version = |i: usize| -> String {
        mapping
            .version
            .and_then(|v| records.get(i).map(|r| shown(&r.0[v])))
            .unwrap_or_default()
    };
    let key = |i: usize| {
        records
            .get(i)
            .map(|r| key_text(mapping, r))
            .unwrap_or_default()
    };
    let mut compare: Vec<usize> = Vec::new();
    for (i, f) in found {
        if f.written {
            if f.delete {
                done.deleted.push(i);
            }
        } else if f.older {
            let newest = f.newest.unwrap_or_default();
            let what = if f.deleted {
                format!("the version {newest} it was deleted under")
            } else {
                format!("the stored version {newest}")
            };
            done.stale.push((
                i,
                format!(
                    "{} version {} is older than {what}: it changes nothing",
                    key(i),
                    version(i)
                ),
            ));
        } else if f.delete && f.tomb_at {
            done.deleted.push(i);
        } else if f.delete && f.row_at {
            done.conflicts.push((
                i,
                format!(
                    "{} is stored under version {}, and this delete has the same version (two \
                     states under one version)",
                    key(i),
                    version(i)
                ),
            ));
        } else if !f.delete && f.row_at {
            compare.push(i);
        } else if !f.delete && f.tomb_at {
            done.conflicts.push((
                i,
                format!(
                    "{} was deleted under version {}, and this write has the same version (two \
                     states under one version)",
                    key(i),
                    version(i)
                ),
            ));
        } else {
            done.refused.push((
                i,
                format!(
                    "{} version {}: not written and nothing stored under its key at that \
                     version: a BEFORE trigger of {} discarded it",
                    key(i),
                    version(i),
                    mapping.table
                ),
            ));
        }
    }
    if compare.is_empty() {
        return Ok(done);
    }
    // The probe's ordinals are the batch's (index + 1).
    let mut same_parent: Vec<usize> = Vec::new();
    for row in client
        .query(st.probe_read.as_str(), &[])
        .await
        .map_err(DbError::from_pg)?
    {
        let i = (row.get::<_, i64>(0) - 1) as usize;
        if !compare.contains(&i) {
            continue;
        }
        let same: Vec<bool> = row.get(2);
        if same.iter().all(|s| *s) || insert::same_after_triggers(st, client, i as i64 + 1).await? {
            same_parent.push(i);
            continue;
        }
        let differs = mapping.in_table_order(
            mapping
                .columns
                .iter()
                .zip(&same)
                .filter(|(_, s)| !**s)
                .map(|(c, _)| c.name.as_str()),
        );
        done.conflicts.push((
            i,
            format!(
                "{} is already stored under version {} with another {}",
                key(i),
                version(i),
                differs.join(" and ")
            ),
        ));
    }
    if !mapping.children.is_empty() && !same_parent.is_empty() {
        for (i, table) in
            super::children::differing_children(mapping, client, records, &same_parent).await?
        {
            done.conflicts.push((
                i,
                format!(
                    "{} is already stored under version {} with other rows of {table}",
                    key(i),
                    version(i)
                ),
            ));
        }
    }
    done.conflicts.sort_by_key(|(i, _)| *i);
    Ok(done)
}

/// The child rows of the keys whose row this transaction wrote, replaced by the winning
/// write's (the writes' ordinals in the probe are their batch indices + 1).
async fn replace_children(
    child: &Child,
    n: usize,
    client: &deadpool_postgres::Client,
    writes: &[(usize, &Row)],
) -> Result<(), DbError> {
    exec(client, child.delete_probe(), &[]).await?;
    let (arrays, ords) =
        super::children::child_arrays(child, n, writes.iter().map(|(i, r)| (*i as i64 + 1, *r)));
    let mut params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    params.push(&ords);
    exec(client, child.insert_won_probe(), &params).await?;
    Ok(())
}

/// `statement` run once with `params` (a statement that reads a probe, a temporary table made
/// again by each transaction, is never kept prepared).
async fn exec(
    client: &deadpool_postgres::Client,
    statement: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, DbError> {
    client
        .execute(statement, params)
        .await
        .map_err(DbError::from_pg)
}

impl Mapping {
    /// Makes the pipeline's tombstone table when it has deletes and the table is missing
    /// (`warren declare`); `Ok(Some(made))`: it has one (`made`: now).
    pub async fn declare_tombstones(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<Option<bool>, DbError> {
        if self.delete.is_none() {
            return Ok(None);
        }
        declare(self, client).await.map(Some)
    }
}

/// Makes the pipeline's tombstone table when it is missing (`warren declare`): the key's and
/// the version's columns as the pipeline's table types them (so a key compares as the table's
/// own), `deleted_at`, and the key as its primary key. `Ok(true)`: made now.
async fn declare(mapping: &Mapping, client: &tokio_postgres::Client) -> Result<bool, DbError> {
    let Some(d) = &mapping.delete else {
        return Ok(false);
    };
    let tomb = d.tombstones.sql();
    let exists: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&tomb])
        .await
        .map_err(DbError::from_pg)?
        .get(0);
    if exists.is_some() {
        return Ok(false);
    }
    let keys: Vec<String> = mapping.key().iter().map(|k| quote(k)).collect();
    let ver = mapping.version.map(|v| quote(&mapping.columns[v].name));
    let Some(ver) = ver else {
        return Ok(false);
    };
    let sql = format!(
        "BEGIN; \
         SELECT pg_advisory_xact_lock(hashtext({name})); \
         CREATE TABLE IF NOT EXISTS {tomb} AS SELECT {k}, {ver} FROM {t} WITH NO DATA; \
         ALTER TABLE {tomb} ALTER COLUMN {ver} SET NOT NULL, \
           ADD COLUMN IF NOT EXISTS deleted_at timestamptz NOT NULL DEFAULT now(); \
         COMMENT ON TABLE {tomb} IS {comment}; \
         COMMIT",
        name = sql_text(&tomb),
        k = keys.join(", "),
        t = mapping.table.sql(),
        comment = sql_text(&format!(
            "warren: the deletes of pipeline {} (key, version); see docs/pipelines.md",
            mapping.pipeline
        )),
    );
    if let Err(e) = client.batch_execute(&sql).await {
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(DbError::from_pg(e));
    }
    // The key, once (a second declare finds it).
    let pk = format!(
        "DO $$ BEGIN \
           IF NOT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = to_regclass({name}) \
                          AND indisprimary) THEN \
             ALTER TABLE {tomb} ADD PRIMARY KEY ({k}); \
           END IF; \
         END $$",
        name = sql_text(&tomb),
        k = keys.join(", "),
    );
    client.batch_execute(&pk).await.map_err(DbError::from_pg)?;
    Ok(true)
}

/// The mismatch of a pipeline with deletes whose tombstone table is missing or lacks the key's
/// unique index (`warren run` before `warren declare`), as a sentence; `None`: it fits.
pub(super) async fn check(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Option<String>, DbError> {
    let Some(d) = &mapping.delete else {
        return Ok(None);
    };
    let tomb = d.tombstones.sql();
    let oid: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&tomb])
        .await
        .map_err(DbError::from_pg)?
        .get(0);
    let Some(oid) = oid else {
        return Ok(Some(format!(
            "pipeline {}: the tombstone table {} does not exist (a pipeline with deletes keeps \
             the version of each deleted key there: run warren declare, which makes it)",
            mapping.pipeline, d.tombstones
        )));
    };
    let mut key: Vec<&str> = mapping.key();
    key.sort_unstable();
    let unique = super::schema::unique_indexes(client, oid).await?;
    let keyed = unique.iter().any(|(_, cols)| {
        let mut c: Vec<&str> = cols.iter().map(String::as_str).collect();
        c.sort_unstable();
        c == key
    });
    if !keyed {
        return Ok(Some(format!(
            "pipeline {}: the tombstone table {} has no unique index on ({}) (made by warren \
             declare; drop it and declare again)",
            mapping.pipeline,
            d.tombstones,
            mapping.key().join(", ")
        )));
    }
    // The key compares in the tombstones as in the table: the same type and collation (a
    // table whose key column changed after declare made the tombstones would not).
    let key: Vec<String> = mapping.key().iter().map(|k| k.to_string()).collect();
    let differ: Vec<String> = client
        .query(
            "SELECT t.attname::text FROM pg_attribute AS t \
             JOIN pg_attribute AS s ON s.attrelid = to_regclass($2) AND s.attname = t.attname \
             WHERE t.attrelid = $1 AND t.attname = ANY($3) \
               AND (t.atttypid <> s.atttypid OR t.attcollation <> s.attcollation) \
             ORDER BY t.attnum",
            &[&oid, &mapping.table.sql(), &key],
        )
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok((!differ.is_empty()).then(|| {
        format!(
            "pipeline {}: the tombstone table {} types or collates the key column {} otherwise \
             than the table {} (the table changed after warren declare made it; drop it and \
             declare again)",
            mapping.pipeline,
            d.tombstones,
            differ.join(", "),
            mapping.table
        )
    }))
}
