//! A copy whose key holds other child rows than its message gives, asked once more: the rows a
//! table's own triggers write beside the message's (an AFTER INSERT trigger on the parent that
//! adds an audit row to a mapped child table) are no difference. The message's insert is run
//! again in a savepoint rolled back: the key's child rows kept aside (a snapshot), the key's
//! child rows and parent row deleted, the parent and child rows inserted by the pipeline's own
//! statements (the triggers fire as they did), and each child table's rows of the key compared
//! with the snapshot, as multisets of the mapped columns. Until review R36f F7 every
//! redelivered copy of such a message was `id_conflict`, parked beside the stored message: a
//! duplicate.
//!
//! Asked only when the parent table has an enabled AFTER INSERT trigger, or a child table an
//! INSERT trigger (one that adds rows to its own table: review R38-F3), for records the
//! comparison of `differing_children` found different (copies and conflicts). The records of a
//! batch are asked in rounds of distinct keys, each round in one savepoint (review R41b F10:
//! asked one at a time, 3,000 copies took 45 s against 1.7 s); a round that fails (a row
//! refused) is asked again one record at a time. What the re-insert does is rolled back, except what PostgreSQL never rolls back (a
//! sequence a trigger draws from advances).
//!
//! Anything refused on the way (a guard that forbids deleting an order, raising or returning
//! NULL; a DELETE a foreign key from another table restricts; a column type without equality
//! such as `json`) leaves the answer "different", the refusal's words in the reason (review
//! R41b F9: such copies were parked `id_conflict` saying only "other rows"). The re-insert runs
//! with the setting `warren.reask` = `on` (for its savepoint only), so that a guard can let it
//! pass (`current_setting('warren.reask', true) = 'on'`, docs/pipelines.md).

use tokio_postgres::types::ToSql;

use super::super::arrays::{Array, arrays};
use super::super::names::quote;
use super::super::statements::{ORD, statements};
use super::super::whole_delete::CountedDelete;
use super::super::{Mapping, Row, Source};
use super::child_arrays;
use crate::db::error::DbError;

/// What a re-insert answered of one record (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in super::super) enum Reask {
    /// Inserted again, it writes exactly the rows its key holds: a copy.
    Same,
    /// It writes other rows, or no re-insert is asked (no trigger writes rows of its own).
    Differs,
    /// The re-insert was refused, in these words: it cannot tell.
    Refused(String),
}

/// Of `asked` (indices into `records`, each in the parents' probe as ordinal index + 1), whose
/// child rows differ from what their keys hold: whether each writes exactly the rows its key
/// holds when inserted again (see the module doc).
pub(in super::super) async fn reask(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    asked: &[usize],
) -> Result<Vec<(usize, Reask)>, DbError> {
    if asked.is_empty() || !after_insert_triggers(mapping, client).await? {
        return Ok(asked.iter().map(|&i| (i, Reask::Differs)).collect());
    }
    let mut answers = Vec::with_capacity(asked.len());
    for round in super::rounds(mapping, client, asked).await? {
        if round.len() > 1
            && let Ok(same) = in_savepoint(mapping, client, records, &round).await?
        {
            answers.extend(round.iter().map(|&i| {
                let answer = if same.contains(&i) {
                    Reask::Same
                } else {
                    Reask::Differs
                };
                (i, answer)
            }));
            continue;
        }
        for i in round {
            let answer = match in_savepoint(mapping, client, records, &[i]).await? {
                Ok(same) if same.contains(&i) => Reask::Same,
                Ok(_) => Reask::Differs,
                Err(refused) => Reask::Refused(refused),
            };
            answers.push((i, answer));
        }
    }
    Ok(answers)
}

/// [`reinserted_same`] inside a savepoint rolled back: `Ok(Ok(same))`, or `Ok(Err(words))` when
/// the database refused a step.
async fn in_savepoint(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    asked: &[usize],
) -> Result<Result<Vec<usize>, String>, DbError> {
    client
        .batch_execute("SAVEPOINT warren_reinsert; SELECT set_config('warren.reask', 'on', true)")
        .await
        .map_err(DbError::from_pg)?;
    let same = reinserted_same(mapping, client, records, asked).await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_reinsert; RELEASE SAVEPOINT warren_reinsert")
        .await
        .map_err(DbError::from_pg)?;
    match same {
        Ok(answer) => Ok(answer),
        // A deadlock, a timeout, a lost connection: no answer, the batch is tried again
        // (review R42a F6: taken as a refusal, a copy was parked `id_conflict`).
        Err(e) if crate::db::error::of_the_moment(&e) => Err(DbError::from_pg(e)),
        Err(e) => match e.as_db_error() {
            Some(db) => Ok(Err(format!("{} {}", db.code().code(), db.message()))),
            None => Err(DbError::from_pg(e)),
        },
    }
}

/// Whether an insert of the message may write rows of its own into a child table: `mapping`'s
/// table has an enabled AFTER INSERT trigger (row or statement), or a child table has an
/// enabled INSERT trigger, BEFORE or AFTER (review R38-F3: a child table's trigger that adds an
/// audit row to the same table made every copy `id_conflict`, parked beside its stored rows).
async fn after_insert_triggers(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
) -> Result<bool, DbError> {
    let children: Vec<String> = mapping.children.iter().map(|c| c.table.sql()).collect();
    // tgtype bits: 2 before, 4 insert, 64 instead of.
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_trigger t \
               WHERE NOT t.tgisinternal AND t.tgenabled <> 'D' AND t.tgtype & 4 <> 0 \
                 AND ((t.tgrelid = to_regclass($1)::oid AND t.tgtype & 66 = 0) \
                   OR (t.tgrelid IN (SELECT to_regclass(c)::oid FROM unnest($2::text[]) AS c) \
                       AND t.tgtype & 64 = 0)))",
            &[&mapping.table.sql(), &children],
        )
        .await
        .map_err(DbError::from_pg)?;
    Ok(row.get::<_, bool>(0))
}

/// The re-insert of `asked` (see the module doc), in the caller's savepoint: the indices of
/// those whose rows, inserted again, are each child table's rows of their key as they were.
/// `Ok(Err(words))` when a trigger kept a row the re-insert deletes, or not every parent row was
/// written again (two records of one key, when several are asked: then each is asked alone);
/// `Err` when the database refused a step.
async fn reinserted_same(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    records: &[&Row],
    asked: &[usize],
) -> Result<Result<Vec<usize>, String>, tokio_postgres::Error> {
    let ords: Vec<String> = asked.iter().map(|i| (*i as i64 + 1).to_string()).collect();
    let ords = format!("'{{{}}}'::int8[]", ords.join(","));
    let probe = "pg_temp.warren_probe AS p";
    let asked_here = format!("p.{ORD} = ANY({ords})");
    // Per child table: its mapped columns of the stored rows, and how its rows name the parent.
    struct Child {
        table: String,
        cols: String,
        /// The stored rows of the asked keys, as (ordinal, mapped columns).
        stored: String,
        lk: Vec<String>,
        pk: Vec<String>,
    }
    let tables: Vec<Child> = mapping
        .children
        .iter()
        .map(|child| {
            let cols: Vec<String> = child
                .columns
                .iter()
                .map(|c| format!("s.{}", quote(&c.name)))
                .collect();
            // The child columns carrying the parent's key, and the probe's columns of it.
            let (lk, pk): (Vec<String>, Vec<String>) = child
                .columns
                .iter()
                .filter_map(|c| match c.source {
                    Source::Parent(i) => Some((
                        quote(&c.name),
                        format!("p.{}", quote(&mapping.columns[i].name)),
                    )),
                    _ => None,
                })
                .unzip();
            let table = child.table.sql();
            let cols = cols.join(", ");
            // The stored rows of the asked keys, each key's looked up by the child table's
            // index (a fenced lateral subquery) whatever its statistics say, as the delete
            // below does (review R45 F3).
            let link: Vec<String> = lk
                .iter()
                .zip(&pk)
                .map(|(c, k)| format!("s.{c} = {k}"))
                .collect();
            let stored = format!(
                "SELECT p.{ORD}, {cols} FROM {probe} CROSS JOIN LATERAL \
                   (SELECT * FROM {table} AS s WHERE {} OFFSET 0) AS s WHERE {asked_here}",
                link.join(" AND ")
            );
            Child {
                table,
                cols,
                stored,
                lk,
                pk,
            }
        })
        .collect();
    // A row a guard keeps (a BEFORE DELETE trigger returning NULL, or an AFTER DELETE trigger
    // that puts it back) is a refusal too: what the re-insert writes would be compared with it
    // still there.
    let deleted_whole = |delete: CountedDelete| async move {
        Ok::<_, tokio_postgres::Error>(delete.run(client, &[]).await?.kept == 0)
    };
    for (n, c) in tables.iter().enumerate() {
        client
            .batch_execute(&format!(
                "CREATE TEMPORARY TABLE warren_snapshot_{n} ON COMMIT DROP AS {}",
                c.stored
            ))
            .await?;
        let delete = CountedDelete::of_keys(&c.table, "s", &c.lk, probe, &asked_here, &c.pk);
        if !deleted_whole(delete).await? {
            return Ok(Err(kept(&c.table)));
        }
    }
    let key: Vec<String> = mapping
        .key
        .iter()
        .map(|&i| {
            let k = quote(&mapping.columns[i].name);
            format!("s.{k} = p.{k}")
        })
        .collect();
    let t = mapping.table.sql();
    let delete = CountedDelete::new(
        &t,
        "s",
        probe,
        &format!("{asked_here} AND {}", key.join(" AND ")),
    );
    if !deleted_whole(delete).await? {
        return Ok(Err(kept(&t)));
    }
    // With the casts of the table's enum columns, when it has them.
    let st = match statements(mapping, client).await {
        Ok(st) => st,
        Err(_) => &mapping.statements,
    };
    let these: Vec<&Row> = asked.iter().map(|&i| records[i]).collect();
    let parent = arrays(mapping, &these);
    let params: Vec<&(dyn ToSql + Sync)> = parent.iter().map(Array::as_param).collect();
    let written = client.query(st.insert.as_str(), &params).await?.len();
    if written != asked.len() {
        // Two of them are one key (asked alone, each is its own), or a trigger discarded it.
        return Ok(Err(format!(
            "{written} of {} rows written again",
            asked.len()
        )));
    }
    for (n, child) in mapping.children.iter().enumerate() {
        let (rows, _) = child_arrays(child, n, asked.iter().map(|&i| (i as i64 + 1, records[i])));
        let params: Vec<&(dyn ToSql + Sync)> = rows.iter().map(Array::as_param).collect();
        client.execute(child.insert_statement(), &params).await?;
    }
    // Each table's rows of every asked key as (ordinal, mapped columns), before and after, as
    // multisets: one hashed set operation (a correlated comparison per record was quadratic).
    let mut same: std::collections::BTreeSet<usize> = asked.iter().copied().collect();
    for (n, c) in tables.iter().enumerate() {
        let (cols, now) = (&c.cols, &c.stored);
        let then = format!("SELECT s.{ORD}, {cols} FROM pg_temp.warren_snapshot_{n} AS s");
        for row in client
            .query(
                &format!(
                    "SELECT DISTINCT d.{ORD} FROM (({then} EXCEPT ALL {now}) \
                       UNION ALL ({now} EXCEPT ALL {then})) AS d"
                ),
                &[],
            )
            .await?
        {
            same.remove(&((row.get::<_, i64>(0) - 1) as usize));
        }
    }
    Ok(Ok(same.into_iter().collect()))
}

/// What a re-insert says when a trigger of `table` kept a row it deletes.
fn kept(table: &str) -> String {
    format!("a trigger of {table} kept a row the re-insert deletes (a DELETE trigger)")
}
