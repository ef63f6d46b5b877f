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
//! write its key again). [`tombstone_tables`] finds the ones warren made, so that `warren
//! declare` can name those no configured pipeline uses (a pipeline renamed or removed).

use tokio_postgres::types::ToSql;

use super::arrays::{self, Array, key_text, shown};
use super::children::{self, Child};
use super::names::sql_text;
use super::probe::{folded_after_triggers, in_probe, same_after_triggers};
use super::statements::Statements;
use super::whole_delete;
use super::{Mapping, Op, Row, quote};
use crate::db::error::DbError;
use crate::domain::Inserted;

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
    /// Its own version as the table types it, as text: what the reasons name (a `numeric(6,2)`
    /// version of `1.005` is `1.01`, the version it is compared as; review R40b F13).
    at: Option<String>,
}

/// Writes `records` of an `update` mapping through the probe, in one transaction, and says
/// of each what it did (see the module's doc).
pub(super) async fn write(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<Inserted, DbError> {
    Ok(run(mapping, st, client, records, true).await?.0)
}

/// Of each of `records`, whether what the table holds already decides it, so that writing it
/// now would change nothing: a copy of what its key holds (a delete: its tombstone at that
/// version), or older than its key's stored version or than a record of the group that wins.
/// Asked by running the write in a transaction that is rolled back (one probe for the group):
/// a statement whose outcome is unknown at a stop (review R37x F1: a key updated since by a
/// newer version was "not stored", went back, and was stored again in the table a reload
/// switched to).
pub(super) async fn settled(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
) -> Result<Vec<bool>, DbError> {
    let (done, written) = run(mapping, st, client, records, false).await?;
    let refused: Vec<usize> = done
        .conflicts
        .iter()
        .chain(&done.refused)
        .map(|(i, _)| *i)
        .collect();
    Ok(written
        .iter()
        .enumerate()
        .map(|(i, w)| !w && !refused.contains(&i))
        .collect())
}

/// [`write`]'s work, its transaction committed when `commit`: what it did, and of each record
/// whether this write wrote it (its row, or a delete's tombstone).
async fn run(
    mapping: &Mapping,
    st: &Statements,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    commit: bool,
) -> Result<(Inserted, Vec<bool>), DbError> {
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
    in_probe(&st.probe_table, client, commit, async {
        let rows: Vec<&Row> = writes.iter().map(|(_, r)| *r).collect();
        let arrays = arrays::arrays(mapping, &rows);
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
            let arrays = arrays::arrays(mapping, &rows);
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
                whole_delete::delete_whole(client, child.delete_tombstoned(), &child.table).await?;
            }
            whole_delete::delete_whole(client, &vs.rows_gone, &mapping.table).await?;
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
                    at: row.get(8),
                },
            ));
        }
        found.sort_by_key(|(i, _)| *i);
        let found_written = found.iter().filter(|(_, f)| !f.delete && f.written).count();
        // Without child tables or deletes, a row under a key a trigger rewrote is the
        // message's, written as the fast path writes it (its outcome below: a copy of itself),
        // but for `settled`, which must not take it for decided.
        let by_key_as_sent = !mapping.children.is_empty() || mapping.delete.is_some() || !commit;
        if written > found_written as u64 && by_key_as_sent {
            // A row written that no record's key holds: a trigger wrote it under another key.
            // Its child rows were looked for under the key as sent (none written), and its
            // copies would be told by that key: the transaction must not stay (review R36e F4:
            // the parent committed without its children, and the message parked beside it).
            return Err(key_rewritten(mapping));
        }
        let mut wrote = vec![false; records.len()];
        for (i, f) in &found {
            if let Some(w) = wrote.get_mut(*i) {
                *w = f.written;
            }
        }
        Ok((
            outcomes(mapping, st, client, records, found, written).await?,
            wrote,
        ))
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
    // As the table types it (the probe's), else as sent.
    let typed: std::collections::HashMap<usize, String> = found
        .iter()
        .filter_map(|(i, f)| f.at.clone().map(|at| (*i, at)))
        .collect();
    let version = |i: usize| -> String {
        typed.get(&i).cloned().unwrap_or_else(|| {
            mapping
                .version
                .and_then(|v| records.get(i).map(|r| shown(&r.0[v])))
                .unwrap_or_default()
        })
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
        } else if !f.delete && same_after_triggers(st, client, i as i64 + 1).await? {
            // Its key, as sent, holds nothing, but the row an insert of it would write (a
            // BEFORE trigger rewrote the key) is stored as it is: a copy, compared as the others.
            compare.push(i);
        } else if let Some((stored, higher, equal)) =
            folded_after_triggers(st, client, i as i64 + 1).await?
            && (higher || equal)
        {
            // Its key, as sent, holds nothing, but the key its insert lands on (a BEFORE
            // trigger folded it) holds a version as new: stale, or two states under one
            // version (review R41b F2: both were "discarded", parked `db_permanent`).
            let landed = format!(
                "(the key as a BEFORE INSERT trigger of {} writes it)",
                mapping.table
            );
            if higher {
                done.stale.push((
                    i,
                    format!(
                        "{} version {} is older than the stored version {stored} {landed}: it \
                         changes nothing",
                        key(i),
                        version(i)
                    ),
                ));
            } else {
                done.conflicts.push((
                    i,
                    format!(
                        "{} is already stored under version {} with other content {landed}",
                        key(i),
                        version(i)
                    ),
                ));
            }
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
    let mut conflicts: Vec<(usize, String)> = Vec::new();
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
        if same.iter().all(|s| *s) || same_after_triggers(st, client, i as i64 + 1).await? {
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
        conflicts.push((
            i,
            format!(
                "{} is already stored under version {} with another {}",
                key(i),
                version(i),
                differs.join(" and ")
            ),
        ));
    }
    let compared = !same_parent.is_empty() || !conflicts.is_empty();
    if !mapping.children.is_empty() && compared {
        // Every child table whose rows differ is named, beside the parent's columns too.
        let which: Vec<usize> = same_parent
            .iter()
            .copied()
            .chain(conflicts.iter().map(|(i, _)| *i))
            .collect();
        let differ = children::differing_children(mapping, client, records, &which).await?;
        children::with_other_rows(&mut conflicts, &differ);
        for i in same_parent {
            if let Some(tables) = differ.get(&i) {
                conflicts.push((
                    i,
                    format!(
                        "{} is already stored under version {} with {}",
                        key(i),
                        version(i),
                        children::other_rows(tables)
                    ),
                ));
            }
        }
    }
    done.conflicts.extend(conflicts);
    done.conflicts.sort_by_key(|(i, _)| *i);
    Ok(done)
}

/// The refusal of a batch whose upsert wrote a row under another key than its message's (a
/// BEFORE trigger rewrote it): permanent, so the batch is split down to the message, which is
/// dead-lettered, then parked, with nothing of it written.
fn key_rewritten(mapping: &Mapping) -> DbError {
    let (code, message) = key_rewritten_words(mapping);
    DbError::Server { code, message }
}

/// The SQLSTATE and words of [`key_rewritten`], which `pipelines test --db` says too.
pub(super) fn key_rewritten_words(mapping: &Mapping) -> (String, String) {
    (
        "23000".into(),
        format!(
            "the row its write stored is not under the key it sends once the batch's \
             statements ran (a BEFORE trigger of {} rewrote its key, or a trigger deleted or \
             moved the row): with on_conflict = \"update\", warren tells versions and child \
             rows by the key a message sends; nothing of it was written",
            mapping.table
        ),
    )
}

/// Whether `mapping`'s table or one of its child tables (or a table under one: a partition, an
/// inheritance child) has an enabled trigger of its own (not a foreign key's), of any kind, or
/// a rule. Then the upsert's fast path cannot tell the parent rows it
/// wrote by their `xmin`: a BEFORE trigger may write the parent row under another key than the
/// message's, and any trigger may update other parent rows (review R40b F14: a "latest order
/// per customer" trigger made a stale order's row look written, and its child rows were
/// replaced by the stale ones). Only the probe tells (`versions::write`), before any child row
/// is written. Asked by every batch (pipelined with its `BEGIN`: no round trip of its own), so
/// a trigger created while warren runs is seen by the next batch; once one is found, every
/// batch goes through the probe without asking again (a trigger dropped later leaves the
/// slower path in place until the pipeline starts again).
pub(super) async fn parent_triggers(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
) -> Result<bool, DbError> {
    use std::sync::atomic::Ordering;
    if mapping.triggers.load(Ordering::Relaxed) {
        return Ok(true);
    }
    let tables = named_tables(mapping);
    // The tables and the tables under them (partitions, inheritance children: review R43 F2, a
    // guard on a child table's partition was not seen), and their rules (R43 F1).
    let tree = named_tree();
    let statement = client
        .prepare_cached(&format!(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t \
               WHERE t.tgrelid IN {tree} AND NOT t.tgisinternal AND t.tgenabled <> 'D') \
             OR EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite AS rw \
               WHERE rw.ev_class IN {tree} AND rw.ev_type IN ('2', '3', '4'))"
        ))
        .await
        .map_err(DbError::from_pg)?;
    let found = client
        .query_one(&statement, &[&tables])
        .await
        .map_err(DbError::from_pg)?
        .get::<_, bool>(0);
    if found {
        mapping.triggers.store(true, Ordering::Relaxed);
    }
    Ok(found)
}

/// Refuses the batch when the table of `mapping` with child tables, a child table, or a table
/// under one has a DO INSTEAD rule on INSERT: the rows written to it go elsewhere, and the
/// insert's RETURNING answers as if they were there (review R45 F4: a rule created while warren
/// runs took every order's items into another table, each order stored and acked without
/// them). The check at start refuses such a rule on the tables themselves; this one, asked by
/// every batch (behind its `BEGIN` where there is one), sees one created since, or on an
/// inheritance child a routing trigger writes by name. Not on a partition: tuple routing never
/// applies a partition's rules (review R46b F2: a harmless rule left on a partition parked
/// every message). The refusal is each message's, for good (the batch is split, each parked
/// `db_permanent` with this reason), nothing written.
pub(super) async fn insert_rules(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
) -> Result<(), DbError> {
    let tables = named_tables(mapping);
    let tree = named_tree();
    let statement = client
        .prepare_cached(&format!(
            "SELECT rw.rulename::text, format('%I.%I', n.nspname, c.relname) \
             FROM pg_catalog.pg_rewrite AS rw \
               JOIN pg_catalog.pg_class AS c ON c.oid = rw.ev_class \
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace \
             WHERE rw.ev_class IN {tree} AND rw.ev_type = '3' AND rw.is_instead \
               AND NOT c.relispartition \
             ORDER BY 2, 1 LIMIT 1"
        ))
        .await
        .map_err(DbError::from_pg)?;
    let found = client
        .query_opt(&statement, &[&tables])
        .await
        .map_err(DbError::from_pg)?;
    match found {
        None => Ok(()),
        Some(row) => Err(DbError::Server {
            code: whole_delete::KEPT_CODE.into(),
            message: format!(
                "the DO INSTEAD rule {:?} on INSERT of {} takes the rows written to it elsewhere, \
                 where the statement's answer cannot see them; warren writes a message whole or \
                 not at all; nothing of it was written; drop the rule",
                row.get::<_, String>(0),
                row.get::<_, String>(1)
            ),
        }),
    }
}

/// The tables `mapping` writes (its table, then its child tables), the parameter of
/// [`named_tree`].
fn named_tables(mapping: &Mapping) -> Vec<String> {
    std::iter::once(mapping.table.sql())
        .chain(mapping.children.iter().map(|c| c.table.sql()))
        .collect()
}

/// The tables named by the text array `$1` ([`named_tables`]) and every table under them, as
/// [`whole_delete::tree`] gives them.
fn named_tree() -> String {
    whole_delete::tree("SELECT to_regclass(n)::oid FROM unnest($1::text[]) AS n")
}

/// Whether `mapping`'s table is partitioned (asked once): an insert into one cannot return a
/// system column (`0A000`), which the upsert's fast path tells new rows by (`xmax = 0`), so its
/// batches go through the probe (review R39-F10: every batch of such an `update` pipeline
/// failed, taken for a transient error, and nothing was ever stored).
pub(super) async fn partitioned(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
) -> Result<bool, DbError> {
    mapping
        .partitioned
        .get_or_try_init(|| async {
            let row = client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_class c \
                       WHERE c.oid = to_regclass($1)::oid AND c.relkind = 'p')",
                    &[&mapping.table.sql()],
                )
                .await
                .map_err(DbError::from_pg)?;
            Ok(row.get::<_, bool>(0))
        })
        .await
        .copied()
}

/// The child rows of the keys whose row this transaction wrote, replaced by the winning
/// write's (the writes' ordinals in the probe are their batch indices + 1).
async fn replace_children(
    child: &Child,
    n: usize,
    client: &deadpool_postgres::Client,
    writes: &[(usize, &Row)],
) -> Result<(), DbError> {
    whole_delete::delete_whole(client, child.delete_probe(), &child.table).await?;
    let (arrays, ords) =
        children::child_arrays(child, n, writes.iter().map(|(i, r)| (*i as i64 + 1, *r)));
    let mut params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
    params.push(&ords);
    child
        .insert_won_checked(client, child.insert_won_probe(), &params)
        .await
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

/// How the comment of a tombstone table warren made begins (the pipeline's name follows): what
/// tells it from a table of someone else's that happens to be named `tombstones_...`.
const TOMBSTONES_COMMENT: &str = "warren: the deletes of pipeline ";

/// A tombstone table warren made, as [`tombstone_tables`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TombstoneTable {
    /// Its name in the schema (`tombstones_<pipeline>`).
    pub name: String,
    /// The pipeline its name is for (`<pipeline>`): the one whose deletes it guards.
    pub pipeline: String,
    /// The tombstones it holds: an operator decides by it whether it matters.
    pub rows: i64,
}

/// The tombstone tables warren made in `schema` (named `tombstones_<pipeline>`, its comment
/// saying warren made it), by name, with their rows counted.
pub async fn tombstone_tables(
    client: &tokio_postgres::Client,
    schema: &str,
) -> Result<Vec<TombstoneTable>, DbError> {
    let found = client
        .query(
            "SELECT c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_description d ON d.objoid = c.oid \
               AND d.classoid = 'pg_class'::regclass AND d.objsubid = 0 \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') \
               AND starts_with(c.relname::text, 'tombstones_') \
               AND starts_with(d.description, $2) \
             ORDER BY 1",
            &[&schema, &TOMBSTONES_COMMENT],
        )
        .await
        .map_err(DbError::from_pg)?;
    let mut tables = Vec::with_capacity(found.len());
    for row in found {
        let name: String = row.get(0);
        let qualified = format!("{}.{}", quote(schema), quote(&name));
        let rows: i64 = client
            .query_one(&format!("SELECT count(*) FROM {qualified}"), &[])
            .await
            .map_err(DbError::from_pg)?
            .get(0);
        let pipeline = name
            .strip_prefix("tombstones_")
            .unwrap_or(&name)
            .to_string();
        tables.push(TombstoneTable {
            name,
            pipeline,
            rows,
        });
    }
    Ok(tables)
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
            "{TOMBSTONES_COMMENT}{} (key, version); see docs/pipelines.md",
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
