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
//! comparison of `differing_children` found different (copies and conflicts, rare). What the
//! re-insert does is rolled back, except what PostgreSQL never rolls back (a sequence a trigger
//! draws from advances). Anything refused on the way (a DELETE a foreign key from another table
//! restricts, a column type without equality such as `json`) leaves the answer "different", as
//! before.

use tokio_postgres::types::ToSql;

use super::super::arrays::{Array, arrays};
use super::super::names::quote;
use super::super::statements::{ORD, statements};
use super::super::{Mapping, Row, Source};
use super::child_arrays;
use crate::db::error::DbError;

/// Whether record `ord` of the parents' probe (`record`), whose child rows differ from what its
/// key holds, writes exactly the rows its key holds when inserted again (see the module doc).
pub(in super::super) async fn same_after_reinsert(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
    ord: i64,
) -> Result<bool, DbError> {
    if !after_insert_triggers(mapping, client).await? {
        return Ok(false);
    }
    client
        .batch_execute("SAVEPOINT warren_reinsert")
        .await
        .map_err(DbError::from_pg)?;
    let same = reinserted_same(mapping, client, record, ord).await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_reinsert")
        .await
        .map_err(DbError::from_pg)?;
    match same {
        Ok(same) => Ok(same),
        Err(e) if e.as_db_error().is_some() => Ok(false),
        Err(e) => Err(DbError::from_pg(e)),
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

async fn reinserted_same(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    record: &Row,
    ord: i64,
) -> Result<bool, tokio_postgres::Error> {
    let of_probe = format!("pg_temp.warren_probe AS p WHERE p.{ORD} = {ord}");
    // Per child table: its mapped columns of the stored rows, and how its rows name the parent.
    let tables: Vec<(String, String, String)> = mapping
        .children
        .iter()
        .map(|child| {
            let cols: Vec<String> = child
                .columns
                .iter()
                .map(|c| format!("s.{}", quote(&c.name)))
                .collect();
            let link: Vec<String> = child
                .columns
                .iter()
                .filter_map(|c| match c.source {
                    Source::Parent(i) => Some(format!(
                        "s.{} = p.{}",
                        quote(&c.name),
                        quote(&mapping.columns[i].name)
                    )),
                    _ => None,
                })
                .collect();
            (child.table.sql(), cols.join(", "), link.join(" AND "))
        })
        .collect();
    for (n, (ct, cols, link)) in tables.iter().enumerate() {
        client
            .batch_execute(&format!(
                "CREATE TEMPORARY TABLE warren_snapshot_{n} ON COMMIT DROP AS \
                 SELECT {cols} FROM {ct} AS s, {of_probe} AND {link}; \
                 DELETE FROM {ct} AS s USING {of_probe} AND {link}"
            ))
            .await?;
    }
    let key: Vec<String> = mapping
        .key
        .iter()
        .map(|&i| {
            let k = quote(&mapping.columns[i].name);
            format!("s.{k} = p.{k}")
        })
        .collect();
    client
        .batch_execute(&format!(
            "DELETE FROM {} AS s USING {of_probe} AND {}",
            mapping.table.sql(),
            key.join(" AND ")
        ))
        .await?;
    // With the casts of the table's enum columns, when it has them.
    let st = match statements(mapping, client).await {
        Ok(st) => st,
        Err(_) => &mapping.statements,
    };
    let records = [record];
    let parent = arrays(mapping, &records);
    let params: Vec<&(dyn ToSql + Sync)> = parent.iter().map(Array::as_param).collect();
    client.query(st.insert.as_str(), &params).await?;
    for (n, child) in mapping.children.iter().enumerate() {
        let (rows, _) = child_arrays(child, n, std::iter::once((1, record)));
        let params: Vec<&(dyn ToSql + Sync)> = rows.iter().map(Array::as_param).collect();
        client.execute(child.insert_statement(), &params).await?;
    }
    for (n, (ct, cols, link)) in tables.iter().enumerate() {
        let now = format!("SELECT {cols} FROM {ct} AS s, {of_probe} AND {link}");
        let same = client
            .query_one(
                &format!(
                    "SELECT NOT EXISTS (SELECT 1 FROM (\
                       (TABLE pg_temp.warren_snapshot_{n} EXCEPT ALL {now}) \
                       UNION ALL ({now} EXCEPT ALL TABLE pg_temp.warren_snapshot_{n})) AS d)"
                ),
                &[],
            )
            .await?;
        if !same.get::<_, bool>(0) {
            return Ok(false);
        }
    }
    Ok(true)
}
