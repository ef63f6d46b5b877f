//! A delete every row of which must go: the stored child rows a newer version replaces, the row
//! and child rows of a key a delete message removes, the rows a copy's re-insert asks again.
//! Where a table's trigger keeps some of them, warren would store a message beside rows it
//! meant to remove (review R41b F7, F8: a "never delete shipped lines" guard left a new
//! version stored with the old one's lines, a delete's children gone beside a parent kept), so
//! the message is refused whole instead (SQLSTATE 23000, permanent: the batch is split down to
//! it, and it is parked `db_permanent` with nothing of it written).
//!
//! A [`CountedDelete`] is three statements, built once with the mapping's others:
//! - **ask** whether any row is to go at all, and whether the table (or a table under it) has
//!   a DELETE trigger: nothing to go, no delete is run, for a statement-level trigger fires on
//!   a delete of no rows too (review R42a F5: a statement-level guard that raises refused every
//!   batch of an `update` pipeline with child tables, new keys included);
//! - **delete**, answering the rows it deleted and the rows it was to delete (fewer deleted: a
//!   row-level BEFORE DELETE trigger returned NULL);
//! - with a DELETE trigger or rule (asked again by the delete itself: one created between the
//!   question and the delete fires in it, review R45 F5), **left**: the rows still there after
//!   it (an AFTER DELETE trigger that puts the row back, `INSERT ... VALUES (OLD.*)`, deletes
//!   every row and keeps them all: review R42a F4; a DO INSTEAD rule created while warren runs:
//!   R43 F1).
//!
//! Not seen: a deferred constraint trigger (`DEFERRABLE INITIALLY DEFERRED`) that puts rows
//! back, which runs at the commit, after the question (review R43 F5, docs/pipelines.md).

use tokio_postgres::types::ToSql;

use super::TableName;
use super::names::sql_text;
use crate::db::error::DbError;

/// The statements of one delete of `table`'s rows `USING {using} WHERE {cond}` (see the
/// module). Every one takes the same parameters.
#[derive(Debug, Clone, Default)]
pub(super) struct CountedDelete {
    ask: String,
    delete: String,
    left: String,
}

/// The oids of the tables `roots` selects (one `oid` column) and of every table under them
/// (inheritance children, partitions, at any depth), as a parenthesised subquery: what acts on
/// a write or delete of a table is found on these (a trigger of a partition fires for its rows).
pub(super) fn tree(roots: &str) -> String {
    format!(
        "(WITH RECURSIVE tree(r) AS ({roots} UNION ALL \
           SELECT i.inhrelid FROM pg_catalog.pg_inherits AS i JOIN tree ON i.inhparent = tree.r) \
         SELECT r FROM tree)"
    )
}

/// Whether a DELETE rule of the tables `tree` selects acts on a delete of them: a DO INSTEAD
/// rule that keeps the row is a guard (review R43 F1: a rule created while warren runs, which
/// the check at start cannot see, kept a newer version's old child rows beside its own).
fn delete_rules(tree: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite AS rw WHERE rw.ev_class IN {tree} \
           AND rw.ev_type = '4')"
    )
}

/// Whether any DELETE trigger (enabled, of any kind) or DELETE rule acts on a delete of
/// `table` (SQL) or a table under it, as a boolean SQL expression: read by a delete statement
/// itself, it sees what was created while the statement waited for its lock.
pub(super) fn acted_on(table: &str) -> String {
    let tree = tree(&format!("SELECT {}::regclass::oid", sql_text(table)));
    format!(
        "(EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS tg WHERE tg.tgrelid IN {tree} \
           AND NOT tg.tgisinternal AND tg.tgenabled <> 'D' AND tg.tgtype & 8 = 8) OR {})",
        delete_rules(&tree)
    )
}

/// What a [`CountedDelete`] did: the rows it was to delete, and how many of them are still
/// there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Deleted {
    pub meant: i64,
    pub kept: i64,
}

/// The rows of a child table (`alias`) whose columns `cols` hold the keys (`keys`, columns of
/// `using`'s rows that pass `of_using`, pairwise), as what follows `DELETE FROM {table} AS
/// {alias}`. A key of one column is compared with `= ANY` of the keys gathered once, without a
/// join: an index led by that column answers it, with or without statistics. As a join
/// PostgreSQL planned it, on a child table never analysed, as a hash join over a scan of the
/// whole table (review R45 F3: 20,000 deletes of stored orders with 4 million items, 22-24 s);
/// a join that also had the `= ANY` was a nested loop testing the whole array at each key
/// (quadratic in the batch). Each row is tested by its value: a row another session updates
/// meanwhile is tested again as it is then (a delete by `ctid` misses it). A key of several
/// columns stays a join, which PostgreSQL plans as a lookup a key once the table is analysed:
/// `= ANY` on its first column read the whole table when that column has few values (a tenant:
/// review R46b F4), and `= ANY` on each column is a lookup for each combination of their values
/// (quadratic in the batch when both vary).
pub(super) fn by_keys(
    alias: &str,
    cols: &[String],
    using: &str,
    of_using: &str,
    keys: &[String],
) -> String {
    if let ([col], [key]) = (cols, keys) {
        return format!(
            "WHERE {alias}.{col} = ANY(ARRAY(SELECT {key} FROM {using} WHERE {of_using}))"
        );
    }
    let on: Vec<String> = cols
        .iter()
        .zip(keys)
        .map(|(c, k)| format!("{alias}.{c} = {k}"))
        .collect();
    format!("USING {using} WHERE {of_using} AND {}", on.join(" AND "))
}

impl CountedDelete {
    /// `DELETE FROM {table} AS {alias} USING {using} WHERE {cond}`, `table` as SQL: for a
    /// table whose rows are found by a unique key (one row a key, which PostgreSQL plans as a
    /// lookup a key without statistics too).
    pub(super) fn new(table: &str, alias: &str, using: &str, cond: &str) -> Self {
        Self::build(
            table,
            alias,
            using,
            cond,
            &format!("USING {using} WHERE {cond}"),
        )
    }

    /// The delete of a child table's rows of the keys `keys` (columns of `using`'s rows that
    /// pass `of_using`) held in its columns `cols` ([`by_keys`]).
    pub(super) fn of_keys(
        table: &str,
        alias: &str,
        cols: &[String],
        using: &str,
        of_using: &str,
        keys: &[String],
    ) -> Self {
        let on: Vec<String> = cols
            .iter()
            .zip(keys)
            .map(|(c, k)| format!("{alias}.{c} = {k}"))
            .collect();
        Self::build(
            table,
            alias,
            using,
            &format!("{of_using} AND {}", on.join(" AND ")),
            &by_keys(alias, cols, using, of_using, keys),
        )
    }

    /// `which`: the delete's rows, after `DELETE FROM {table} AS {alias}`; `using` and `cond`
    /// the same rows as a join, for the question and the counts.
    fn build(table: &str, alias: &str, using: &str, cond: &str, which: &str) -> Self {
        // The table and the tables under it (inheritance children, partitions): a trigger of
        // any of them acts on the delete.
        let tree = tree(&format!("SELECT {}::regclass::oid", sql_text(table)));
        // tgtype bits: 1 row, 2 before, 8 delete.
        let triggers = |bits: u8| {
            format!(
                "EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS tg WHERE tg.tgrelid IN {tree} \
                   AND NOT tg.tgisinternal AND tg.tgenabled <> 'D' AND tg.tgtype & {bits} = {bits})"
            )
        };
        // The rows to go, looked up from each of the batch's keys (`using`): a fenced lateral
        // subquery is a lookup by the table's index whatever its statistics say. A plain join,
        // or an EXISTS over one, was planned without statistics (a table never analysed) as a
        // scan of the whole table for each key (review R43 F8: 4,000 new orders in 202 s, a
        // full scan of a 166,689-row child table per order).
        let rows = format!(
            "(SELECT DISTINCT x.t, x.c FROM {using} CROSS JOIN LATERAL \
               (SELECT {alias}.tableoid AS t, {alias}.ctid AS c FROM {table} AS {alias} \
                 WHERE {cond} OFFSET 0) AS x) AS h"
        );
        let rules = delete_rules(&tree);
        Self {
            ask: format!(
                "SELECT EXISTS (SELECT 1 FROM {using} CROSS JOIN LATERAL \
                   (SELECT 1 FROM {table} AS {alias} WHERE {cond} LIMIT 1) AS x), {} OR {rules}",
                triggers(8)
            ),
            // The second count is made only when a row-level BEFORE DELETE trigger exists
            // (read in the same statement: a `CASE` runs one branch); else it is the first.
            // The third column asks again, in the delete's own statement, whether a DELETE
            // trigger or rule acts on it: one created between the question and the delete (its
            // lock waited for) fires in it, and must be counted after it (review R45 F5: an AFTER
            // DELETE trigger committed in that window put a line back, and the newer version
            // was stored beside it).
            delete: format!(
                "WITH d AS (DELETE FROM {table} AS {alias} {which} RETURNING 1) \
                 SELECT (SELECT count(*) FROM d), CASE WHEN {} \
                   THEN (SELECT count(*) FROM {rows}) ELSE (SELECT count(*) FROM d) END, \
                   {} OR {rules}",
                triggers(11),
                triggers(8)
            ),
            left: format!("SELECT count(*) FROM {rows}"),
        }
    }

    /// Run with `params`, in the caller's transaction: what it deleted and kept (nothing
    /// meant: no statement was run but the question).
    pub(super) async fn run(
        &self,
        client: &tokio_postgres::Client,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Deleted, tokio_postgres::Error> {
        let row = client.query_one(self.ask.as_str(), params).await?;
        let (any, triggers) = (row.get::<_, bool>(0), row.get::<_, bool>(1));
        if !any {
            return Ok(Deleted { meant: 0, kept: 0 });
        }
        let row = client.query_one(self.delete.as_str(), params).await?;
        let (deleted, meant) = (row.get::<_, i64>(0), row.get::<_, i64>(1));
        let left = if triggers || row.get::<_, bool>(2) {
            client
                .query_one(self.left.as_str(), params)
                .await?
                .get::<_, i64>(0)
        } else {
            0
        };
        Ok(Deleted {
            meant,
            kept: (meant - deleted).max(left).min(meant),
        })
    }
}

/// `delete` of `table`'s rows run once (no parameters): every row it meant to delete gone, or
/// the refusal of the message, some of whose rows a trigger kept (see the module).
pub(super) async fn delete_whole(
    client: &deadpool_postgres::Client,
    delete: &CountedDelete,
    table: &TableName,
) -> Result<(), DbError> {
    let done = delete.run(client, &[]).await.map_err(DbError::from_pg)?;
    if done.kept > 0 {
        return Err(DbError::Server {
            code: KEPT_CODE.into(),
            message: kept_message(table, done),
        });
    }
    Ok(())
}

/// The SQLSTATE of a message some of whose rows a trigger kept (`integrity_constraint_violation`:
/// permanent, so the message is parked `db_permanent`).
pub(super) const KEPT_CODE: &str = "23000";

/// What a message is refused for when a trigger of `table` kept rows its write or delete
/// removes.
pub(super) fn kept_message(table: &TableName, done: Deleted) -> String {
    format!(
        "a trigger or rule of {table} kept {} of the {} rows the message removes (a BEFORE \
         DELETE trigger that returns NULL, one that puts the row back, or a DO INSTEAD rule on \
         DELETE): a newer version replaces \
         its key's child rows, a delete removes its row and them; warren writes a message \
         whole or not at all; nothing of it was written",
        done.kept, done.meant
    )
}
