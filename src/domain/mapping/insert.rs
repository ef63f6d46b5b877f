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
//!
//! This file is the top of the writing: it chooses the path of a batch (a plain insert, the
//! probe's `probe.rs`, `update`'s per-record outcomes `versions.rs`, child tables
//! `children.rs`); the statements (`statements.rs`) and parameters (`arrays.rs`) sit below.

use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::arrays::{self, Array, arrays};
use super::probe::{in_probe, keep_in_probe, same_after_triggers};
use super::statements::{statements, types_on_path};
use super::{Mapping, OnConflict, Row, children, versions};
use crate::db::error::DbError;
use crate::domain::Inserted;

pub(super) async fn insert(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<crate::domain::Inserted, DbError> {
    if !mapping.children.is_empty() {
        return with_children(mapping, client, records).await;
    }
    let st = statements(mapping, client).await?;
    if records.is_empty() {
        // The breaker's probe: the statement runs, writing nothing (a read-only server, a
        // missing table or privilege still answer as they would for a batch).
        let statement = client
            .prepare_cached(probe_statement(mapping, st))
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
    if mapping.delete.is_some() || versions::partitioned(mapping, client).await? {
        // Deletes: every batch through the probe, under a lock per key (`versions.rs`); a
        // partitioned table too (its insert returns no system column).
        return versions::write(mapping, st, client, records).await;
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
            let mut done = versions::write(mapping, st, client, records).await?;
            done.rows += rows.len() as u64;
            Ok(done)
        }
        Err(e) if e.code() == Some(&SqlState::CARDINALITY_VIOLATION) => {
            tracing::debug!(pipeline = %mapping.pipeline, error = %e,
                "records of one key under the column's type: inserting through the probe");
            versions::write(mapping, st, client, records).await
        }
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
                            || children::same_children(mapping, client, record).await?))
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

/// What the breaker's probe (a batch of no records) runs: the batch's own statement, so a plan
/// cached on the connection is asked as a batch would (`db::replanning`); for `update` the plain
/// insert, as its upsert returns `xmax`, which a partitioned table cannot (review R39-F10).
fn probe_statement<'s>(mapping: &Mapping, st: &'s super::statements::Statements) -> &'s str {
    match mapping.version {
        None => &st.insert,
        Some(_) => &st.insert_plain,
    }
}

/// Of each of `records` (a batch whose statement's outcome is unknown), whether the table
/// already decides it, so that it is done whether or not that statement committed: `update`,
/// through a write rolled back ([`versions::settled`]: a copy, or older than what its key
/// holds); `keep`, each stored exactly as it is ([`stored`]).
pub(super) async fn settled(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<Vec<bool>, DbError> {
    let st = statements(mapping, client).await?;
    if st.versions.is_some() {
        return versions::settled(mapping, st, client, records).await;
    }
    let mut done = Vec::with_capacity(records.len());
    for record in records {
        done.push(stored(mapping, client, record).await?);
    }
    Ok(done)
}

/// The batch refused with `e` in its transaction, which is rolled back (`end`).
async fn refused(client: &deadpool_postgres::Client, e: DbError) -> Result<Inserted, DbError> {
    end(client, Err::<Option<()>, _>(e))
        .await
        .map(|_| Inserted::default())
}

/// Ends the transaction `work` ran in: committed when it succeeded with `Some`, else rolled
/// back. A transaction that cannot be ended is the connection's failure.
async fn end<T>(
    client: &deadpool_postgres::Client,
    result: Result<Option<T>, DbError>,
) -> Result<Option<T>, DbError> {
    let end = if matches!(result, Ok(Some(_))) {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    match client.batch_execute(end).await {
        Ok(()) => result,
        Err(e) => result.and(Err(DbError::from_pg(e))),
    }
}

/// Inserts `records` of a mapping with child tables: each message's parent row and child rows
/// in one transaction, one statement per table (see `children.rs`'s module doc).
async fn with_children(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<Inserted, DbError> {
    let st = statements(mapping, client).await?;
    let arrays = arrays(mapping, records);
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    if records.is_empty() {
        // The breaker's probe: each statement runs, writing nothing (a missing table or
        // privilege answers as it would for a batch).
        let prepared = client
            .prepare_cached(probe_statement(mapping, st))
            .await
            .map_err(DbError::from_pg)?;
        client
            .query(&prepared, &params)
            .await
            .map_err(DbError::from_pg)?;
        for (n, child) in mapping.children.iter().enumerate() {
            let (arrays, _) = children::child_arrays(child, n, std::iter::empty());
            arrays::run(client, child.insert_statement(), &arrays, &[]).await?;
        }
        return Ok(Inserted::default());
    }
    let all = || records.iter().enumerate().map(|(i, r)| (i as i64 + 1, *r));
    // The parent's column types' schemas on the path for the transaction: the child inserts
    // compare the rows they wrote with the parent's key by `=`, looked up by name (a `citext`
    // key compared as text called a re-cased child row moved: review R38-F9).
    let begin = format!("BEGIN; {}", types_on_path(&mapping.table));
    match mapping.on_conflict {
        OnConflict::Keep => {
            // Every parent new (the common case): the parents, then every child row; whether a
            // rule takes inserted rows elsewhere, asked behind the BEGIN (one round trip).
            let (begun, rules) = tokio::join!(
                client.batch_execute(&begin),
                versions::insert_rules(mapping, client)
            );
            begun.map_err(DbError::from_pg)?;
            if let Err(e) = rules {
                return refused(client, e).await;
            }
            let fast = async {
                let Some(sql) = &st.insert_new else {
                    return Ok(None);
                };
                match crate::domain::insert_if_all_new(client, sql, &params).await? {
                    Some(rows) if rows == records.len() as u64 => {
                        for (n, child) in mapping.children.iter().enumerate() {
                            let (arrays, ords) = children::child_arrays(child, n, all());
                            child.insert_all(client, &arrays, ords.len()).await?;
                        }
                        Ok(Some(rows))
                    }
                    // A key held or repeated, or a row a trigger discarded: through the probe.
                    _ => Ok(None),
                }
            }
            .await;
            if let Some(rows) = end(client, fast).await? {
                return Ok(Inserted {
                    rows,
                    ..Default::default()
                });
            }
            let Some(keep) = &st.probe_keep else {
                return Err(DbError::Migration(
                    "keep without its probe statement".into(),
                ));
            };
            in_probe(&st.probe_table, client, true, async {
                let mut done = keep_in_probe(mapping, st, client, records, &params, keep).await?;
                children::keep_children(mapping, client, records, &mut done).await?;
                Ok(done)
            })
            .await
        }
        OnConflict::Update => {
            if mapping.delete.is_some() || versions::partitioned(mapping, client).await? {
                versions::insert_rules(mapping, client).await?;
                // Deletes: every batch through the probe, under a lock per key; a partitioned
                // table too (its insert returns no system column).
                return versions::write(mapping, st, client, records).await;
            }
            if !mapping.children.is_empty()
                && mapping.triggers.load(std::sync::atomic::Ordering::Relaxed)
            {
                versions::insert_rules(mapping, client).await?;
                // A trigger may write the parent row under another key than the message's, or
                // update other parent rows: only the probe can tell which rows its upsert wrote
                // (`versions::write`), before any child row is written.
                return versions::write(mapping, st, client, records).await;
            }
            // Whether a trigger was created since: asked in the transaction, behind its BEGIN
            // (one round trip for both).
            let (begun, triggers, rules) = tokio::join!(
                client.batch_execute(&begin),
                async {
                    if mapping.children.is_empty() {
                        Ok(false)
                    } else {
                        versions::parent_triggers(mapping, client).await
                    }
                },
                versions::insert_rules(mapping, client)
            );
            begun.map_err(DbError::from_pg)?;
            if let Err(e) = rules {
                return refused(client, e).await;
            }
            let key_arrays: Vec<&(dyn ToSql + Sync)> =
                mapping.key.iter().map(|&i| params[i]).collect();
            let version = mapping.version.map(|v| params[v]);
            let upsert = async {
                if triggers? {
                    // Rolled back, then through the probe.
                    return Ok(None);
                }
                let prepared = client
                    .prepare_cached(&st.insert)
                    .await
                    .map_err(DbError::from_pg)?;
                let (written, all_new) = match client.query(&prepared, &params).await {
                    Ok(rows) => (rows.len(), rows.iter().all(|r| r.get::<_, bool>(0))),
                    // Two records of one key under the column's type: through the probe.
                    Err(e)
                        if e.code()
                            == Some(&tokio_postgres::error::SqlState::CARDINALITY_VIOLATION) =>
                    {
                        return Ok(None);
                    }
                    Err(e) => return Err(DbError::from_pg(e)),
                };
                // Every record written: each is its key's only record (DISTINCT ON keeps one a
                // key) and its version won, so every child row of the batch is a winner's.
                let every = written == records.len();
                for (n, child) in mapping.children.iter().enumerate() {
                    // Every parent row new, and a foreign key to it guarding the table: no
                    // key holds a child row to replace.
                    if !(every && all_new && child.guarded(mapping, client).await?) {
                        let prepared = client
                            .prepare_cached(child.delete_statement())
                            .await
                            .map_err(DbError::from_pg)?;
                        let acted = client
                            .query_one(&prepared, &key_arrays)
                            .await
                            .map_err(DbError::from_pg)?
                            .get::<_, bool>(0);
                        if acted {
                            // A DELETE trigger or rule created since the batch's question:
                            // rolled back, then through the probe, which counts what it keeps.
                            mapping
                                .triggers
                                .store(true, std::sync::atomic::Ordering::Relaxed);
                            return Ok(None);
                        }
                    }
                    let (arrays, ords) = children::child_arrays(child, n, all());
                    if every {
                        // The common case: the plain insert of every child row.
                        child.insert_all(client, &arrays, ords.len()).await?;
                        continue;
                    }
                    let mut more: Vec<&(dyn ToSql + Sync)> = vec![&ords];
                    more.extend(key_arrays.iter().copied());
                    more.extend(version);
                    // Planned for this batch, never kept prepared: a cached (generic) plan
                    // guesses 10 rows an array and joins the child rows to the winners in a
                    // nested loop, rows times records (40 ms of PostgreSQL's CPU for 1,000
                    // orders of 3,000 items).
                    let mut params: Vec<&(dyn ToSql + Sync)> =
                        arrays.iter().map(Array::as_param).collect();
                    params.extend_from_slice(&more);
                    child
                        .insert_won_checked(client, child.insert_won_statement(), &params)
                        .await?;
                }
                Ok(Some(written))
            }
            .await;
            match end(client, upsert).await? {
                // Every record its key's newest version: the common case.
                Some(written) if written == records.len() => Ok(Inserted {
                    rows: written as u64,
                    ..Default::default()
                }),
                // An older or equal version, or two records of one key: each record's outcome
                // through the probe; what was committed is its key's newest, a copy there.
                Some(written) => {
                    let mut done = versions::write(mapping, st, client, records).await?;
                    done.rows += written as u64;
                    Ok(done)
                }
                None => versions::write(mapping, st, client, records).await,
            }
        }
    }
}
