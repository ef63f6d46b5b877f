//! The copies of `keep` with child tables: when a parent key is held or repeated in a batch,
//! the records whose parent row this transaction wrote insert their children, and every other
//! record whose parent is a copy has its children compared with what its key holds (converted
//! by PostgreSQL in a probe of each child table, its BEFORE INSERT triggers applied, and the
//! parent's own triggers' rows told apart by a re-insert: `reinsert.rs`): the same rows, an
//! idempotent success; other rows, `id_conflict`. `update` asks the same question of the
//! versions that lost (`versions.rs`).

use std::collections::{BTreeMap, HashSet};

use tokio_postgres::types::ToSql;

use super::super::arrays::{Array, key_text};
use super::super::statements::{ORD, TOID, XMIN, written_here};
use super::super::{Mapping, Row, quote};
use super::statements::joined;
use super::{child_arrays, reinsert};
use crate::db::error::DbError;
use crate::domain::Inserted;

/// `keep`, some key held or repeated, inside the parents' probe transaction after their insert
/// (`done`: what it found): the records whose parent row this transaction wrote insert their
/// children (of several records of one key, the first delivered, the one written); every
/// other record whose parent is a copy has its children compared with what its key holds,
/// and other rows make it `id_conflict`.
pub(in crate::domain::mapping) async fn keep_children(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    done: &mut Inserted,
) -> Result<(), DbError> {
    let t = mapping.table.sql();
    let pk: Vec<String> = mapping
        .key
        .iter()
        .map(|&i| quote(&mapping.columns[i].name))
        .collect();
    // From the batch's keys through the key's index; the fence keeps the `xmin` test above
    // the lookup (below it, PostgreSQL may scan the whole table: R36-F2).
    // Written by this transaction's insert, not only touched by a trigger (`written_here`).
    let sql = format!(
        "SELECT f.{ORD}, f.at FROM (SELECT p.{ORD}, s.ctid::text AS at, s.xmin AS {XMIN}, \
           s.tableoid AS {TOID}, {p_pk} FROM pg_temp.warren_probe AS p JOIN {t} AS s ON {} \
           OFFSET 0) AS f \
         WHERE {}",
        joined("s", &pk, "p", &pk),
        written_here(&t, "f", "f", &pk),
        p_pk = pk
            .iter()
            .map(|k| format!("p.{k}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    let out: HashSet<usize> = done
        .conflicts
        .iter()
        .chain(&done.refused)
        .map(|(i, _)| *i)
        .collect();
    // Per parent row written here, the first record (by ordinal) that is not refused.
    let mut written: BTreeMap<String, usize> = BTreeMap::new();
    for row in client.query(&sql, &[]).await.map_err(DbError::from_pg)? {
        let i = (row.get::<_, i64>(0) - 1) as usize;
        if out.contains(&i) {
            continue;
        }
        let at: String = row.get(1);
        let first = written.entry(at).or_insert(i);
        *first = (*first).min(i);
    }
    let owners: HashSet<usize> = written.into_values().collect();
    for (n, child) in mapping.children.iter().enumerate() {
        let (arrays, ords) = child_arrays(
            child,
            n,
            records
                .iter()
                .enumerate()
                .filter(|(i, _)| owners.contains(i))
                .map(|(i, r)| (i as i64 + 1, *r)),
        );
        child.insert_all(client, &arrays, ords.len()).await?;
    }
    let copies: Vec<usize> = (0..records.len())
        .filter(|i| !out.contains(i) && !owners.contains(i))
        .collect();
    // The records whose parent content differs are conflicts already: their reason also names
    // the child tables whose rows differ.
    let parent_conflicts: Vec<usize> = done.conflicts.iter().map(|(i, _)| *i).collect();
    if copies.is_empty() && parent_conflicts.is_empty() {
        return Ok(());
    }
    let which: Vec<usize> = copies.iter().chain(&parent_conflicts).copied().collect();
    let differ = differing_children(mapping, client, records, &which).await?;
    with_other_rows(&mut done.conflicts, &differ);
    for i in copies {
        if let Some(tables) = differ.get(&i) {
            done.conflicts.push((
                i,
                format!(
                    "{} is already stored with {}",
                    key_text(mapping, records[i]),
                    other_rows(tables)
                ),
            ));
        }
    }
    Ok(())
}

/// The child tables whose stored rows of a key differ from a record's, and, when the re-insert
/// that tells a trigger's rows apart was refused, its words (`reinsert.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::domain::mapping) struct Differs {
    pub(in crate::domain::mapping) tables: Vec<String>,
    pub(in crate::domain::mapping) unasked: Option<String>,
}

/// `other rows of shop.order_items and shop.payments`, and why a trigger's rows could not be
/// told apart when the re-insert was refused.
pub(in crate::domain::mapping) fn other_rows(differs: &Differs) -> String {
    let mut words = format!("other rows of {}", differs.tables.join(" and "));
    if let Some(refused) = &differs.unasked {
        words.push_str(&format!(
            " (or rows a trigger writes beside the message's: the re-insert that tells them \
             apart was refused: {refused}; a guard can let it pass when \
             current_setting('warren.reask', true) = 'on', see docs/pipelines.md)"
        ));
    }
    words
}

/// Appends ` and other rows of ...` to the reason of each conflict (a parent row stored with
/// other content) whose record's child rows differ too (`differ`).
pub(in crate::domain::mapping) fn with_other_rows(
    conflicts: &mut [(usize, String)],
    differ: &BTreeMap<usize, Differs>,
) {
    for (i, reason) in conflicts.iter_mut() {
        if let Some(tables) = differ.get(i) {
            reason.push_str(" and ");
            reason.push_str(&other_rows(tables));
        }
    }
}

/// Of `which` (indices into `records`, each in the parents' probe as ordinal index + 1), those
/// whose key holds other child rows than the record has, with every child table that differs
/// (in the spec's order); asked inside the parents' probe transaction, of the child rows
/// converted by PostgreSQL into each child table's types.
pub(in crate::domain::mapping) async fn differing_children(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    which: &[usize],
) -> Result<BTreeMap<usize, Differs>, DbError> {
    let mut differ: BTreeMap<usize, Differs> = BTreeMap::new();
    let ords: Vec<i64> = which.iter().map(|&i| i as i64 + 1).collect();
    for (n, child) in mapping.children.iter().enumerate() {
        client
            .batch_execute(&child.statements.probe_table)
            .await
            .map_err(DbError::from_pg)?;
        let (arrays, row_ords) =
            child_arrays(child, n, which.iter().map(|&i| (i as i64 + 1, records[i])));
        let mut params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(Array::as_param).collect();
        params.push(&row_ords);
        client
            .execute(child.statements.probe_fill.as_str(), &params)
            .await
            .map_err(DbError::from_pg)?;
        let found: Vec<usize> = client
            .query(child.statements.probe_differs.as_str(), &[&ords])
            .await
            .map_err(DbError::from_pg)?
            .iter()
            .map(|row| (row.get::<_, i64>(0) - 1) as usize)
            .collect();
        let same = same_after_triggers_many(mapping, client, child, &found).await?;
        for i in found {
            if !same.contains(&i) {
                differ
                    .entry(i)
                    .or_default()
                    .tables
                    .push(child.table.to_string());
            }
        }
    }
    // Rows the parent's own triggers add beside the message's are no difference.
    let asked: Vec<usize> = differ.keys().copied().collect();
    for (i, answer) in reinsert::reask(mapping, client, records, &asked).await? {
        match answer {
            reinsert::Reask::Same => {
                differ.remove(&i);
            }
            reinsert::Reask::Differs => {}
            reinsert::Reask::Refused(words) => {
                if let Some(d) = differ.get_mut(&i) {
                    d.unasked = Some(words);
                }
            }
        }
    }
    Ok(differ)
}

/// Of `asked` (indices into `records`), those whose rows of `child` are what their key holds
/// once its BEFORE INSERT triggers made them the rows an insert would write: each round of
/// distinct keys asked at once (review R41b F10: one savepoint a record, 3,000 copies took
/// 18 s), a round the database refuses asked one record at a time.
async fn same_after_triggers_many(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    child: &super::Child,
    asked: &[usize],
) -> Result<HashSet<usize>, DbError> {
    let mut same = HashSet::new();
    for round in super::rounds(mapping, client, asked).await? {
        if round.len() > 1 {
            let ords: Vec<i64> = round.iter().map(|&i| i as i64 + 1).collect();
            client
                .batch_execute("SAVEPOINT warren_same_children")
                .await
                .map_err(DbError::from_pg)?;
            let found = client
                .query(child.statements.probe_same_many.as_str(), &[&ords])
                .await;
            client
                .batch_execute("ROLLBACK TO SAVEPOINT warren_same_children; RELEASE SAVEPOINT warren_same_children")
                .await
                .map_err(DbError::from_pg)?;
            match found {
                Ok(rows) => {
                    same.extend(rows.iter().map(|r| (r.get::<_, i64>(0) - 1) as usize));
                    continue;
                }
                Err(e) if !crate::db::error::of_the_moment(&e) => {}
                Err(e) => return Err(DbError::from_pg(e)),
            }
        }
        for i in round {
            if same_after_triggers(client, &child.statements.probe_same, i as i64 + 1).await? {
                same.insert(i);
            }
        }
    }
    Ok(same)
}

/// Whether record `ord`'s child rows are what its key holds once the child table's BEFORE
/// INSERT triggers made them the rows an insert would write (`probe_same`): asked inside a
/// savepoint rolled back, so nothing changes. An error (a trigger or a constraint refusing a
/// row, two rows of the record one stored row) is "not the same".
async fn same_after_triggers(
    client: &deadpool_postgres::Client,
    probe_same: &str,
    ord: i64,
) -> Result<bool, DbError> {
    client
        .batch_execute("SAVEPOINT warren_same_children")
        .await
        .map_err(DbError::from_pg)?;
    let same = client.query_one(probe_same, &[&ord]).await;
    client
        .batch_execute(
            "ROLLBACK TO SAVEPOINT warren_same_children; RELEASE SAVEPOINT warren_same_children",
        )
        .await
        .map_err(DbError::from_pg)?;
    match same {
        Ok(row) => Ok(row.get::<_, Option<bool>>(0).unwrap_or(false)),
        Err(e) if !crate::db::error::of_the_moment(&e) => Ok(false),
        Err(e) => Err(DbError::from_pg(e)),
    }
}

/// Whether the record at ordinal 1 of the parents' probe, whose parent row its key holds as it
/// is, also has exactly its child rows stored (asked inside the probe's transaction).
pub(in crate::domain::mapping) async fn same_children(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
) -> Result<bool, DbError> {
    Ok(differing_children(mapping, client, &[record], &[0])
        .await?
        .is_empty())
}
