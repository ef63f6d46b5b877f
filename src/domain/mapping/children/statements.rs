//! The SQL of one child table (see the parent module's doc), built once at compile time: the
//! plain insert of its rows, and for `update` and the probe the statements that replace the
//! children of the keys whose parent row this transaction wrote (told by `xmin`).

use super::*;
use crate::domain::mapping::statements::{TOID, XMIN, param, types_on_path, written_here};
use crate::domain::mapping::whole_delete;

/// The statements of one child table, built once (see the module's doc).
#[derive(Debug, Clone)]
pub(super) struct ChildStatements {
    /// The child rows (`$1..$n`, one array per column).
    pub(super) insert: String,
    /// [`ChildStatements::insert`] that answers how many rows it wrote and of how many parents
    /// the rows written differ from the rows sent ([`moved`]).
    pub(super) insert_checked: String,
    /// `update`: the stored children of the keys (`$1..$k`, the parent key's arrays) whose
    /// parent row this transaction wrote, deleted.
    pub(super) delete: String,
    /// [`ChildStatements::delete`] answering the rows deleted and the rows meant
    /// ([`CountedDelete`]): `pipelines test --db`.
    pub(super) delete_counted: CountedDelete,
    /// `update`: the child rows (`$1..$n`, then `$n+1` each row's record ordinal) of each key's
    /// winning record (`$n+2..`: the parent key's arrays, then the versions), when this
    /// transaction wrote its parent row; answers the rows written and the rows of the winners.
    pub(super) insert_won: String,
    /// `delete` for the keys of the parents' probe (`pg_temp.warren_probe`), counted
    /// ([`CountedDelete`]).
    pub(super) delete_probe: CountedDelete,
    /// `insert_won` with the winners read from the parents' probe (`$1..$n`, `$n+1`); answers
    /// the same two counts.
    pub(super) insert_won_probe: String,
    /// Makes the child probe: the mapped columns of the child table, as it types them, and the
    /// record's ordinal (inside the parents' probe transaction).
    pub(super) probe_table: String,
    /// The child rows into the child probe (`$1..$n`, `$n+1`).
    pub(super) probe_fill: String,
    /// Of the records `$1` (ordinals in the parents' probe), those whose key holds other child
    /// rows than the child probe holds for them (compared with the columns' own equality): each
    /// row of the probe looked up by the child key with `=` (its index, so linear in the rows;
    /// a jsonb key column is compared as the others are; a key column is never optional), then
    /// compared column by column with `IS NOT DISTINCT FROM`.
    pub(super) probe_differs: String,
    /// Whether the record `$1`'s child rows, as an insert of them would write them (the child
    /// table's BEFORE INSERT triggers included: `EXCLUDED`), are each a stored row of its key
    /// as it is, and as many as its key holds: asked of a record `probe_differs` found, inside
    /// a savepoint rolled back (a trigger that rewrites a value: review R36e F2).
    pub(super) probe_same: String,
    /// [`ChildStatements::probe_same`] of the records `$1` (ordinals of distinct parent keys)
    /// at once: the ordinals of those whose rows are the same (review R41b F10).
    pub(super) probe_same_many: String,
    /// Deletes: the child rows of the keys whose tombstone this transaction wrote (empty
    /// without deletes), counted ([`CountedDelete`]).
    pub(super) delete_tombstoned: CountedDelete,
}

/// `a = b AND ...` of `left.<columns[i]>` and `right.<names[j]>`, pairwise.
pub(super) fn joined(left: &str, l: &[String], right: &str, r: &[String]) -> String {
    l.iter()
        .zip(r)
        .map(|(a, b)| format!("{left}.{a} = {right}.{b}"))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// How many of the child rows an `ins` CTE wrote into `ct` (returning the link columns `lk`)
/// have no parent row (`t`, its key `pk`) that this transaction wrote: compared in the tables'
/// own types. Not 0 when a BEFORE INSERT trigger rewrote a row's link to its parent (review
/// R36i F7: the row written under another order, the message half-written and the other order
/// a row more). A trigger that moves a row to another parent of the same batch is not seen.
/// Also when a BEFORE trigger of the parent `t` wrote the parent row under another key than the
/// message's (review R39-F3: `keep` stored the parent under the rewritten key and its child rows
/// under the sent one). Asked only when `ct` or `t` has an enabled BEFORE INSERT row trigger
/// (read in the same statement): the lookups cost about 1 us a child row (20-25% of the child
/// insert), and without such a trigger no row can be under another parent.
///
/// `probe`: in the probe's transaction, where the parent rows this transaction wrote are known
/// (`written_here`), not only told by `xmin` (which a trigger updating other parent rows
/// fools: review R40b F14).
fn moved(ct: &str, t: &str, pk: &[String], lk: &[String], probe: bool) -> String {
    let (fenced, ours) = if probe {
        let s_pk: Vec<String> = pk.iter().map(|k| format!("s.{k}")).collect();
        (
            format!(
                "s.xmin AS {XMIN}, s.tableoid AS {TOID}, {}",
                s_pk.join(", ")
            ),
            written_here(t, "s", "s", pk),
        )
    } else {
        (format!("s.xmin AS {XMIN}"), format!("s.{XMIN} = {OURS}"))
    };
    format!(
        "CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS tg \
           WHERE tg.tgrelid IN ({ct_text}::regclass, {t_text}::regclass) AND NOT tg.tgisinternal \
             AND tg.tgenabled <> 'D' AND tg.tgtype & 7 = 7) \
         THEN (SELECT count(*) FROM ins WHERE NOT EXISTS (SELECT 1 FROM (SELECT {fenced} \
           FROM {t} AS s WHERE {on} OFFSET 0) AS s WHERE {ours})) ELSE 0 END",
        ct_text = crate::domain::mapping::names::sql_text(ct),
        t_text = crate::domain::mapping::names::sql_text(t),
        on = joined("s", pk, "ins", lk),
    )
}

/// The transaction's own id, to tell the parent rows this transaction wrote (their `xmin`).
pub(super) const OURS: &str = "pg_current_xact_id()::xid";

impl ChildStatements {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build(
        n: usize,
        table: &TableName,
        columns: &[Column],
        key: &[usize],
        link: &[usize],
        parent_table: &TableName,
        parent: &[Column],
        parent_key: &[usize],
        version: Option<usize>,
        tombstones: Option<&TableName>,
    ) -> Self {
        let ct = table.sql();
        let t = parent_table.sql();
        let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
        let list = names.join(", ");
        let v_list: Vec<String> = names.iter().map(|c| format!("v.{c}")).collect();
        let v_list = v_list.join(", ");
        let c_params: Vec<String> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| param(c.ty, i + 1, None))
            .collect();
        let count = columns.len();
        let ord_param = format!("${}::int8[]", count + 1);
        let pk: Vec<String> = parent_key.iter().map(|&i| quote(&parent[i].name)).collect();
        let lk: Vec<String> = link.iter().map(|&i| names[i].clone()).collect();
        let pks = pk.join(", ");
        let probe = probe_name(n);
        let insert = format!(
            "INSERT INTO {ct} ({list}) SELECT * FROM UNNEST({}) AS v({list})",
            c_params.join(", ")
        );
        let all_rows = format!("UNNEST({}) AS v({list})", c_params.join(", "));
        let insert_checked = format!(
            "WITH ins AS (INSERT INTO {ct} ({list}) SELECT * FROM {all_rows} RETURNING {lks}) \
             SELECT (SELECT count(*) FROM ins), {}",
            moved(&ct, &t, &pk, &lk, false),
            lks = lk.join(", "),
        );
        let pk_params = |from: usize| -> Vec<String> {
            parent_key
                .iter()
                .enumerate()
                .map(|(j, &i)| param(parent[i].ty, from + j, None))
                .collect()
        };
        // The parents this transaction wrote are found from the batch's keys through the
        // key's index; the fence (`OFFSET 0`) keeps the `xmin` test above that lookup, else
        // PostgreSQL may scan the whole parent table for it (R36-F2).
        let s_keys: Vec<String> = pk.iter().map(|k| format!("s.{k}")).collect();
        let s_pk = s_keys.join(", ");
        let using = format!(
            "(SELECT {s_pk}, s.xmin AS {XMIN} \
               FROM UNNEST({}) AS w({pks}) JOIN {t} AS s ON {} OFFSET 0) AS s",
            pk_params(1).join(", "),
            joined("s", &pk, "w", &pk),
        );
        let ours = format!("s.{XMIN} = {OURS}");
        // It answers whether a DELETE trigger or rule acts on it, read in its own statement: one
        // created after the batch's question (behind its BEGIN) and before this delete fires
        // in it, and the batch goes through the probe instead (review R45 F5: an AFTER DELETE
        // trigger created in that window put a line back beside the newer version's).
        let delete = format!(
            "WITH d AS (DELETE FROM {ct} AS c {} RETURNING 1) SELECT {}",
            whole_delete::by_keys("c", &lk, &using, &ours, &s_keys),
            whole_delete::acted_on(&ct)
        );
        let delete_counted = CountedDelete::of_keys(&ct, "c", &lk, &using, &ours, &s_keys);
        let won_rows = format!(
            "UNNEST({}, {ord_param}) AS v({list}, {ORD}) WHERE v.{ORD} IN (SELECT {ORD} FROM won)",
            c_params.join(", ")
        );
        let lks = lk.join(", ");
        let (insert_won, insert_won_probe) = match version {
            Some(ver) => {
                let first = count + 2;
                let ver_param = param(parent[ver].ty, first + pk.len(), None);
                let vn = quote(&parent[ver].name);
                // Each statement answers how many rows it wrote and how many the winners
                // have: fewer written, a trigger discarded some (`Child::insert_won_checked`).
                let won = format!(
                    "WITH won AS (SELECT w.{ORD} FROM (\
                       SELECT DISTINCT ON ({pks}) {pks}, {ORD} \
                       FROM UNNEST({kp}, {ver_param}) WITH ORDINALITY AS w({pks}, {vn}, {ORD}) \
                       ORDER BY {pks}, {vn} DESC, {ORD}) AS w \
                     JOIN {t} AS s ON {on} WHERE s.xmin = {OURS}), \
                     ins AS (INSERT INTO {ct} ({list}) SELECT {v_list} \
                     FROM {won_rows} RETURNING {lks}) \
                     SELECT (SELECT count(*) FROM ins), (SELECT count(*) \
                       FROM UNNEST({ord_param}) AS o({ORD}) WHERE o.{ORD} IN (SELECT {ORD} FROM won)), {moved}",
                    moved = moved(&ct, &t, &pk, &lk, false),
                    kp = pk_params(first).join(", "),
                    on = joined("s", &pk, "w", &pk),
                );
                let p_pks: Vec<String> = pk.iter().map(|k| format!("p.{k}")).collect();
                // Through the probe, the parent rows this transaction's upsert wrote (not
                // those a trigger only touched: `written_here`).
                let won_probe = format!(
                    "WITH won AS (SELECT w.{ORD} FROM (\
                       SELECT DISTINCT ON ({pp}) {pp}, p.{ORD} FROM pg_temp.warren_probe AS p \
                       ORDER BY {pp}, p.{vn} DESC, p.{ORD}) AS w \
                     JOIN LATERAL (SELECT s.xmin AS {XMIN}, s.tableoid AS {TOID} FROM {t} AS s \
                       WHERE {on} OFFSET 0) AS s ON {written}), \
                     ins AS (INSERT INTO {ct} ({list}) SELECT {v_list} \
                     FROM {won_rows} RETURNING {lks}) \
                     SELECT (SELECT count(*) FROM ins), (SELECT count(*) \
                       FROM UNNEST({ord_param}) AS o({ORD}) WHERE o.{ORD} IN (SELECT {ORD} FROM won)), {moved}",
                    moved = moved(&ct, &t, &pk, &lk, true),
                    pp = p_pks.join(", "),
                    on = joined("s", &pk, "w", &pk),
                    written = written_here(&t, "s", "w", &pk),
                );
                (won, won_probe)
            }
            None => (String::new(), String::new()),
        };
        let delete_probe = CountedDelete::of_keys(
            &ct,
            "c",
            &lk,
            &format!(
                "(SELECT {s_pk}, s.xmin AS {XMIN}, s.tableoid AS {TOID} \
                   FROM pg_temp.warren_probe AS w JOIN {t} AS s ON {} OFFSET 0) AS s",
                joined("s", &pk, "w", &pk),
            ),
            &written_here(&t, "s", "s", &pk),
            &s_keys,
        );
        let probe_table = format!(
            "{path} CREATE TEMPORARY TABLE {probe} ON COMMIT DROP AS \
             SELECT {list}, 0::int8 AS {ORD} FROM {ct} WITH NO DATA",
            path = types_on_path(table),
        );
        let probe_fill = format!(
            "INSERT INTO pg_temp.{probe} ({list}, {ORD}) SELECT * FROM UNNEST({}, {ord_param})",
            c_params.join(", ")
        );
        // A key column never NULL (not optional: an absent or null value is refused) is
        // compared with `=`, which the child key's index answers; `IS NOT DISTINCT FROM` alone
        // made PostgreSQL compare every stored row with every row of the message (quadratic:
        // 20 s for 10,000 rows).
        let same: Vec<String> = columns
            .iter()
            .zip(&names)
            .enumerate()
            .map(|(i, (c, n))| match c.ty {
                ColType::Jsonb => format!("s.{n}::jsonb IS NOT DISTINCT FROM m.{n}::jsonb"),
                _ if key.contains(&i) && !c.optional => format!("s.{n} = m.{n}"),
                _ => format!("s.{n} IS NOT DISTINCT FROM m.{n}"),
            })
            .collect();
        let of_parent = joined("s", &lk, "p", &pk);
        let probe_differs = format!(
            "SELECT p.{ORD} FROM pg_temp.warren_probe AS p WHERE p.{ORD} = ANY($1) AND (\
               (SELECT count(*) FROM {ct} AS s WHERE {of_parent}) <> \
               (SELECT count(*) FROM pg_temp.{probe} AS m WHERE m.{ORD} = p.{ORD}) \
               OR EXISTS (SELECT 1 FROM pg_temp.{probe} AS m WHERE m.{ORD} = p.{ORD} \
                 AND NOT EXISTS (SELECT 1 FROM {ct} AS s WHERE {of_parent} AND {same})))",
            same = same.join(" AND "),
        );
        let keys: Vec<String> = key.iter().map(|&i| names[i].clone()).collect();
        let m_list: Vec<String> = names.iter().map(|n| format!("m.{n}")).collect();
        let same_after: Vec<String> = columns
            .iter()
            .zip(&names)
            .map(|(c, n)| match c.ty {
                ColType::Jsonb => format!("s.{n}::jsonb IS NOT DISTINCT FROM EXCLUDED.{n}::jsonb"),
                _ => format!("s.{n} IS NOT DISTINCT FROM EXCLUDED.{n}"),
            })
            .collect();
        let mine = format!("(SELECT count(*) FROM pg_temp.{probe} AS m WHERE m.{ORD} = $1)");
        // `xmax` is 0 in a row the insert made (no stored row of that key): not a copy.
        let probe_same = format!(
            "WITH w AS (INSERT INTO {ct} AS s ({list}) SELECT {m_list} FROM pg_temp.{probe} AS m                WHERE m.{ORD} = $1 ON CONFLICT ({keys}) DO UPDATE SET {k0} = EXCLUDED.{k0}                WHERE {same_after} RETURNING s.xmax::text <> '0' AS was)              SELECT (SELECT count(*) FROM {ct} AS s, pg_temp.warren_probe AS p                  WHERE p.{ORD} = $1 AND {of_parent}) = {mine}                AND count(*) = {mine} AND coalesce(bool_and(w.was), true) FROM w",
            m_list = m_list.join(", "),
            keys = keys.join(", "),
            k0 = keys[0],
            same_after = same_after.join(" AND "),
        );
        // The same question of several records at once (`$1`, their ordinals; their parent
        // keys distinct): the ordinals of those whose rows are the same.
        let lks_s: Vec<String> = lk.iter().map(|k| format!("s.{k}")).collect();
        let probe_same_many = format!(
            "WITH w AS (INSERT INTO {ct} AS s ({list}) SELECT {m_list} FROM pg_temp.{probe} AS m \
               WHERE m.{ORD} = ANY($1) ON CONFLICT ({keys}) DO UPDATE SET {k0} = EXCLUDED.{k0} \
               WHERE {same_after} RETURNING {s_lk}, s.xmax::text <> '0' AS was), \
             wa AS (SELECT {lks}, count(*) AS n, bool_and(w.was) AS was FROM w GROUP BY {lks}), \
             mc AS (SELECT m.{ORD}, count(*) AS n FROM pg_temp.{probe} AS m \
               WHERE m.{ORD} = ANY($1) GROUP BY m.{ORD}) \
             SELECT p.{ORD} FROM pg_temp.warren_probe AS p \
               LEFT JOIN mc ON mc.{ORD} = p.{ORD} LEFT JOIN wa ON {wa_p} \
             WHERE p.{ORD} = ANY($1) \
               AND (SELECT count(*) FROM {ct} AS s WHERE {of_parent}) = coalesce(mc.n, 0) \
               AND coalesce(wa.n, 0) = coalesce(mc.n, 0) AND coalesce(wa.was, true)",
            m_list = m_list.join(", "),
            keys = keys.join(", "),
            k0 = keys[0],
            same_after = same_after.join(" AND "),
            s_lk = lks_s.join(", "),
            lks = lk.join(", "),
            wa_p = joined("wa", &lk, "p", &pk),
        );
        let delete_tombstoned = tombstones
            .map(|tomb| {
                // The tombstones this transaction wrote, found from the batch's deletes.
                let tb_pk: Vec<String> = pk.iter().map(|k| format!("tb.{k}")).collect();
                CountedDelete::of_keys(
                    &ct,
                    "c",
                    &lk,
                    &format!(
                        "(SELECT {}, tb.xmin AS {XMIN} \
                           FROM pg_temp.warren_probe_del AS d JOIN {tomb} AS tb ON {} OFFSET 0) \
                           AS tb",
                        tb_pk.join(", "),
                        joined("tb", &pk, "d", &pk),
                        tomb = tomb.sql(),
                    ),
                    &format!("tb.{XMIN} = {OURS}"),
                    &tb_pk,
                )
            })
            .unwrap_or_default();
        Self {
            insert,
            insert_checked,
            delete,
            delete_counted,
            delete_tombstoned,
            insert_won,
            delete_probe,
            insert_won_probe,
            probe_table,
            probe_fill,
            probe_differs,
            probe_same,
            probe_same_many,
        }
    }
}
