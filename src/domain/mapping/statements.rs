//! The statements of one mapping, built once when it compiles ([`Statements`]; for
//! `on_conflict = "update"`, the probe's path too, [`VersionStatements`]), or again, once, when
//! a `text` column is an enum ([`statements`]). Only text: what runs them is `insert.rs`,
//! `probe.rs` and `versions.rs`, above this file.

use super::names::sql_text;
use super::whole_delete::CountedDelete;
use super::{ColType, Column, Mapping, TableName, quote};
use crate::db::error::DbError;

/// The statements of one mapping, built once.
#[derive(Debug, Clone)]
pub(super) struct Statements {
    /// The insert (`keep` or `update`), returning for each row it wrote its key (`keep`), or
    /// whether it is new (`update`: `xmax` is 0; a row the upsert updated carries its lock).
    pub(super) insert: String,
    /// `keep`: the plain insert tried first, when every row is new
    /// ([`crate::domain::insert_if_all_new`]); `None` for `update`.
    pub(super) insert_new: Option<String>,
    /// The probe's table, made for one transaction: the mapped columns of the table, as the
    /// table types them (type, length, precision, collation, domain), and the record's ordinal.
    /// The plain insert (`$1..$n`), no conflict target and nothing returned: the breaker's
    /// probe (an empty batch) and `pipelines test --db` of a key not held run it (an `update`
    /// upsert returns `xmax`, which an insert into a partitioned table cannot: review R39-F10).
    pub(super) insert_plain: String,
    pub(super) probe_table: String,
    /// The records into the probe, then, from what the probe holds: for each record (by
    /// ordinal), whether its key holds a row, and per column whether the stored value equals it.
    pub(super) probe_compare: String,
    /// `keep`: the insert of a batch some of whose keys are held, from the probe: in the order
    /// of the key's own type, so of two records that are one key the first delivered is
    /// inserted; `None` for `update`.
    pub(super) probe_keep: Option<String>,
    /// The comparison of [`Statements::probe_compare`], of what the probe already holds.
    pub(super) probe_read: String,
    /// Per column, its enum type's name for a `text` column written to an enum (empty: built
    /// without the catalog).
    pub(super) casts: Vec<Option<String>>,
    /// Whether one record of the probe (`$1`, its ordinal) is what its key holds once the
    /// table's own BEFORE INSERT triggers have made it the row an insert would write: an upsert
    /// that changes the row only when it is the same (returning it then), run inside a
    /// savepoint that is rolled back.
    pub(super) probe_same: String,
    /// `update`: whether one record of the probe (`$1`) is what its key holds once an update of
    /// the stored row by it would have written it, the table's BEFORE UPDATE triggers included
    /// (one that keeps a mapped column, a `created_at`): asked when [`Statements::probe_same`]
    /// says not, inside a savepoint rolled back (review R41b F5: the redelivery of a version
    /// that replaced a row was compared with the row an insert would write, and parked
    /// `id_conflict` beside itself).
    pub(super) probe_same_update: Option<String>,
    /// `update`: of the record `$1`, whose key as sent holds nothing and which was not
    /// written, the version stored under the key its insert lands on once the table's BEFORE
    /// INSERT triggers made it (a trigger folding the key), as text, and whether it is higher
    /// than, or equal to, the record's; no row when no stored row holds that key. Asked inside
    /// a savepoint rolled back (review R41b F2: an older version, or the same version with
    /// other content, was parked `db_permanent` "a BEFORE trigger discarded it").
    pub(super) probe_folded: Option<String>,
    /// `update`: the probe's path, which gives each record its own outcome (`versions.rs`).
    pub(super) versions: Option<VersionStatements>,
}

/// The ordinal column of the probe (a name no mapped column can have: it has a space).
pub(super) const ORD: &str = "\"warren ord\"";

/// The probe: the records of a batch converted by PostgreSQL into the table's column types by
/// an INSERT, so with the same assignment rules as the insert itself (a value too long for a
/// `varchar(3)` is refused, not truncated as an explicit cast would; a `numeric(7,2)` rounds;
/// a domain checks), held in a temporary table dropped at the end of the transaction. Every
/// question about a value against the table (is it what the key holds, which key holds it,
/// which records are one key) is then asked of the converted values with the columns' own
/// equality and collation: PostgreSQL decides, warren never casts.
fn probe_statements(
    table: &TableName,
    columns: &[Column],
    key: &[usize],
    version: Option<usize>,
    casts: &[Option<String>],
) -> Probe {
    let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
    let list = names.join(", ");
    let unnest = format!("UNNEST({})", params(columns, casts).join(", "));
    let t = table.sql();
    let keys: Vec<String> = key.iter().map(|&i| names[i].clone()).collect();
    let p_keys: Vec<String> = keys.iter().map(|k| format!("p.{k}")).collect();
    let p_list: Vec<String> = names.iter().map(|n| format!("p.{n}")).collect();
    let create = format!(
        "BEGIN; {path} CREATE TEMPORARY TABLE warren_probe ON COMMIT DROP AS \
         SELECT {list}, 0::int8 AS {ORD} FROM {t} WITH NO DATA; \
         CREATE TEMPORARY TABLE warren_written ON COMMIT DROP AS \
         SELECT {k} FROM {t} WITH NO DATA",
        path = types_on_path(table),
        k = keys.join(", "),
    );
    let fill = format!(
        "INSERT INTO pg_temp.warren_probe ({list}, {ORD}) \
         SELECT * FROM {unnest} WITH ORDINALITY RETURNING *"
    );
    // A jsonb value may be stored in a json column, which has no equality: both sides are
    // compared as jsonb (by meaning: key order and spacing aside).
    let same: Vec<String> = (0..columns.len())
        .map(|i| match columns[i].ty {
            ColType::Jsonb => format!(
                "s.{n}::jsonb IS NOT DISTINCT FROM p.{n}::jsonb",
                n = names[i]
            ),
            _ => format!("s.{n} IS NOT DISTINCT FROM p.{n}", n = names[i]),
        })
        .collect();
    let joined: Vec<String> = key
        .iter()
        .map(|&i| format!("s.{n} = p.{n}", n = names[i]))
        .collect();
    let compare_from = |from: &str| {
        format!(
            "SELECT p.{ORD}, s.{first} IS NOT NULL, ARRAY[{same}] \
             FROM {from} LEFT JOIN {t} AS s ON {on}",
            first = names[key[0]],
            same = same.join(", "),
            on = joined.join(" AND "),
        )
    };
    let compare = format!("WITH p AS ({fill}) {}", compare_from("p"));
    let read = compare_from("pg_temp.warren_probe AS p");
    // In the key's own order (the column's type and collation: `ZED@x` and `zed@x` of a citext
    // key are one key, and the first delivered of them is the one inserted), and so in the same
    // order as every other batch: copies in other orders wait, not deadlock.
    let keep = version.is_none().then(|| {
        format!(
            "WITH p AS ({fill}), ins AS (INSERT INTO {t} ({list}) SELECT {p_list} FROM p \
             ORDER BY {p_keys}, p.{ORD} ON CONFLICT DO NOTHING RETURNING {k}), \
             x AS (INSERT INTO {WRITTEN} SELECT * FROM ins) SELECT 1 FROM ins",
            k = keys.join(", "),
            p_keys = p_keys.join(", "),
            p_list = p_list.join(", "),
        )
    });
    // As the insert would write it: `EXCLUDED` is the proposed row after the table's BEFORE
    // INSERT triggers (a trigger that rewrites a value: the stored row holds what it wrote).
    let same_after: Vec<String> = (0..columns.len())
        .map(|i| match columns[i].ty {
            ColType::Jsonb => format!(
                "stored.{n}::jsonb IS NOT DISTINCT FROM EXCLUDED.{n}::jsonb",
                n = names[i]
            ),
            _ => format!("stored.{n} IS NOT DISTINCT FROM EXCLUDED.{n}", n = names[i]),
        })
        .collect();
    let same = format!(
        "INSERT INTO {t} AS stored ({list}) SELECT {p_list} FROM pg_temp.warren_probe AS p \
         WHERE p.{ORD} = $1 ON CONFLICT ({keys}) DO UPDATE SET {first} = EXCLUDED.{first} \
         WHERE {same_after} RETURNING 1",
        keys = keys.join(", "),
        p_list = p_list.join(", "),
        first = names[key[0]],
        same_after = same_after.join(" AND "),
    );
    // The stored row (`o`, as the statement's snapshot sees it) and the row an update of it by
    // the record writes (`u`, after the BEFORE INSERT and BEFORE UPDATE triggers), compared.
    let same_update = version.map(|_| {
        let sets: Vec<String> = (0..columns.len())
            .filter(|i| !key.contains(i))
            .map(|i| format!("{n} = EXCLUDED.{n}", n = names[i]))
            .collect();
        let sets = if sets.is_empty() {
            format!("{0} = EXCLUDED.{0}", names[key[0]])
        } else {
            sets.join(", ")
        };
        let s_list: Vec<String> = names.iter().map(|n| format!("s.{n}")).collect();
        let stored_list: Vec<String> = names.iter().map(|n| format!("stored.{n}")).collect();
        let equal: Vec<String> = (0..columns.len())
            .map(|i| match columns[i].ty {
                ColType::Jsonb => format!(
                    "o.{n}::jsonb IS NOT DISTINCT FROM u.{n}::jsonb",
                    n = names[i]
                ),
                _ => format!("o.{n} IS NOT DISTINCT FROM u.{n}", n = names[i]),
            })
            .collect();
        format!(
            "WITH o AS (SELECT {s_list} FROM {t} AS s JOIN pg_temp.warren_probe AS p ON {on} \
               WHERE p.{ORD} = $1), \
             u AS (INSERT INTO {t} AS stored ({list}) SELECT {p_list} \
               FROM pg_temp.warren_probe AS p WHERE p.{ORD} = $1 \
               ON CONFLICT ({keys}) DO UPDATE SET {sets} RETURNING {stored_list}) \
             SELECT 1 FROM o, u WHERE {equal}",
            s_list = s_list.join(", "),
            on = joined.join(" AND "),
            p_list = p_list.join(", "),
            keys = keys.join(", "),
            stored_list = stored_list.join(", "),
            equal = equal.join(" AND "),
        )
    });
    // `update`: the key the record's insert lands on once the BEFORE INSERT triggers made it
    // (a trigger that folds the key: `lower(email)`), and that key's stored version against
    // the record's, when a row holds it (`xmax` not 0: the upsert met it).
    let folded = version.map(|v| {
        format!(
            "WITH w AS (INSERT INTO {t} AS stored ({list}) SELECT {p_list} \
               FROM pg_temp.warren_probe AS p WHERE p.{ORD} = $1 \
               ON CONFLICT ({keys}) DO UPDATE SET {first} = stored.{first} \
               RETURNING stored.{ver} AS v, stored.xmax::text <> '0' AS was) \
             SELECT w.v::text, w.v > p.{ver}, w.v = p.{ver} \
             FROM w, pg_temp.warren_probe AS p WHERE p.{ORD} = $1 AND w.was",
            keys = keys.join(", "),
            p_list = p_list.join(", "),
            first = names[key[0]],
            ver = names[v],
        )
    });
    Probe {
        same_update,
        folded,
        table: create,
        compare,
        read,
        keep,
        same,
    }
}

/// The probe's statements (see [`probe_statements`]).
struct Probe {
    /// Begins the transaction and makes the probe's table.
    table: String,
    /// The records into the probe, then per record: is its key held, and per column is the
    /// stored value the same.
    compare: String,
    /// The same question of the records already in the probe (after `keep`).
    read: String,
    /// `keep`: the records into the probe, and from it into the table.
    keep: Option<String>,
    /// See [`Statements::probe_same`].
    same: String,
    /// See [`Statements::probe_same_update`].
    same_update: Option<String>,
    /// See [`Statements::probe_folded`].
    folded: Option<String>,
}

/// A statement that puts, for the rest of the transaction, the schema of each column type of
/// `table` (a domain's base type's) on the search path after what is there: an `=` between two
/// values is looked up by name, and an extension's type (`citext` in `public`) has its own
/// equality in its own schema, which the session's path (`DATABASE_SCHEMA`) may not hold; without
/// it PostgreSQL would compare two `citext` values as text, case and all. (`ORDER BY` and
/// `DISTINCT ON`, and the table's unique indexes, use the type's own operators whatever the
/// path.)
pub(super) fn types_on_path(table: &TableName) -> String {
    // The table's name is an identifier warren checked (no quote can be in it).
    let t = table.sql().replace('\'', "''");
    format!(
        "SELECT set_config('search_path', current_setting('search_path') || COALESCE(( \
           SELECT string_agg(DISTINCT ', ' || quote_ident(n.nspname), '') \
           FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid \
           LEFT JOIN pg_type b ON ty.typtype = 'd' AND b.oid = ty.typbasetype \
           JOIN pg_namespace n ON n.oid = COALESCE(b.typnamespace, ty.typnamespace) \
           WHERE a.attrelid = to_regclass('{t}') AND a.attnum > 0 \
             AND n.nspname NOT IN ('pg_catalog', 'information_schema')), ''), true);"
    )
}

/// `ON CONFLICT (key) DO UPDATE` of `update`: every other column from the new version, only
/// when it is higher than the stored one (or the stored row has none).
pub(super) fn on_conflict_update(names: &[String], key: &[usize], version: usize) -> String {
    let keys: Vec<&str> = key.iter().map(|&i| names[i].as_str()).collect();
    let sets: Vec<String> = names
        .iter()
        .enumerate()
        .filter(|(i, _)| !key.contains(i))
        .map(|(_, n)| format!("{n} = EXCLUDED.{n}"))
        .collect();
    format!(
        "ON CONFLICT ({keys}) DO UPDATE SET {sets} \
         WHERE stored.{ver} IS NULL OR stored.{ver} < EXCLUDED.{ver}",
        keys = keys.join(", "),
        ver = names[version],
        sets = if sets.is_empty() {
            format!("{0} = EXCLUDED.{0}", names[version])
        } else {
            sets.join(", ")
        }
    )
}

/// The SQL type a column's parameter array is sent as, and the cast to the column's type.
/// `cast`: the column's own type, for a `text` column written to an enum (PostgreSQL has no
/// assignment cast from text to an enum: the enum's input function reads the label).
pub(super) fn param(ty: ColType, n: usize, cast: Option<&str>) -> String {
    match (ty, cast) {
        (ColType::Text, Some(to)) => format!("${n}::text[]::{to}[]"),
        (ColType::Text, None) => format!("${n}::text[]"),
        (ColType::Uuid, _) => format!("${n}::uuid[]"),
        (ColType::Int4, _) => format!("${n}::int4[]"),
        (ColType::Int8, _) => format!("${n}::int8[]"),
        (ColType::Float8, _) => format!("${n}::float8[]"),
        (ColType::Bool, _) => format!("${n}::bool[]"),
        (ColType::Jsonb, _) => format!("${n}::text[]::jsonb[]"),
        // Sent as text, parsed by the database: the digits and the instant as written.
        (ColType::Numeric, _) => format!("${n}::text[]::numeric[]"),
        (ColType::Timestamptz, _) => format!("${n}::text[]::timestamptz[]"),
        (ColType::Date, _) => format!("${n}::text[]::date[]"),
    }
}

/// The parameters of `columns`, `$1` on, each with its column's cast (see [`param`]).
pub(super) fn params(columns: &[Column], casts: &[Option<String>]) -> Vec<String> {
    columns
        .iter()
        .enumerate()
        .map(|(i, c)| param(c.ty, i + 1, casts.get(i).and_then(|c| c.as_deref())))
        .collect()
}

/// For each column of `mapping`, its type when it is a `text` column of an enum (or a domain
/// over one), as the catalog names it; read once, when the table is first written.
async fn enum_casts(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Vec<Option<String>>, DbError> {
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, NULL), \
               COALESCE(b.typtype, t.typtype) = 'e', a.attnum \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             LEFT JOIN pg_type b ON t.typtype = 'd' AND b.oid = t.typbasetype \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&mapping.table.sql()],
        )
        .await
        .map_err(DbError::from_pg)?;
    let of = |c: &Column| rows.iter().find(|r| r.get::<_, String>(0) == c.name);
    // The table's order of the columns, for reasons that list several (learnt once).
    let _ = mapping.attnums.set(
        mapping
            .columns
            .iter()
            .map(|c| of(c).map_or(i16::MAX, |r| r.get::<_, i16>(3)))
            .collect(),
    );
    Ok(mapping
        .columns
        .iter()
        .map(|c| {
            of(c)
                .filter(|r| c.ty == ColType::Text && r.get::<_, bool>(2))
                .map(|r| r.get::<_, String>(1))
        })
        .collect())
}

/// The statements of `mapping` for its table as it is: those built at compile time, or, when
/// a `text` column is an enum, built again with its cast (once per mapping).
pub(super) async fn statements<'m>(
    mapping: &'m Mapping,
    client: &tokio_postgres::Client,
) -> Result<&'m Statements, DbError> {
    let bound = mapping
        .bound
        .get_or_try_init(|| async {
            let casts = enum_casts(mapping, client).await?;
            Ok::<_, DbError>(casts.iter().any(Option::is_some).then(|| {
                Statements::build(
                    &mapping.table,
                    &mapping.columns,
                    &mapping.key,
                    mapping.version,
                    &casts,
                    mapping.delete.as_ref().map(|d| &d.tombstones),
                )
            }))
        })
        .await?;
    Ok(bound.as_ref().unwrap_or(&mapping.statements))
}

impl Statements {
    pub(super) fn build(
        table: &TableName,
        columns: &[Column],
        key: &[usize],
        version: Option<usize>,
        casts: &[Option<String>],
        tombstones: Option<&TableName>,
    ) -> Self {
        let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
        let list = names.join(", ");
        let unnest = format!("UNNEST({})", params(columns, casts).join(", "));
        let key_names: Vec<&str> = key.iter().map(|&i| names[i].as_str()).collect();
        let keys = key_names.join(", ");
        let t = table.sql();
        let insert_plain = format!("INSERT INTO {t} ({list}) SELECT * FROM {unnest} AS v({list})");
        let insert_new = version.is_none().then(|| {
            format!("INSERT INTO {t} ({list}) SELECT * FROM {unnest} AS v({list}) ORDER BY {keys}")
        });
        let insert = match version {
            None => format!(
                // In key order, as the plain insert: copies in other orders wait, not deadlock.
                // Of two records of one key in a batch, the first delivered is inserted and the
                // other compared with it, as if they had come one at a time.
                "INSERT INTO {t} ({list}) SELECT {list} FROM {unnest} WITH ORDINALITY \
                 AS v({list}, {ORD}) ORDER BY {keys}, {ORD} \
                 ON CONFLICT DO NOTHING \
                 RETURNING {keys}"
            ),
            // DISTINCT ON the parameters as sent: two records of one key that PostgreSQL tells
            // apart only under the column's type (`User@x` and `user@x` in a citext key) both
            // reach the conflict and the statement fails with 21000, never silently: then the
            // probe's statement (`probe_upsert`) runs instead, on the converted values. Equal
            // parameters are always equal columns, so nothing is collapsed that should not be.
            // Of equal versions of one key in a batch, the first delivered, as if one at a time.
            Some(v) => format!(
                "INSERT INTO {t} AS stored ({list}) \
                 SELECT DISTINCT ON ({keys}) {list} FROM {unnest} WITH ORDINALITY \
                 AS v({list}, {ORD}) \
                 ORDER BY {keys}, {ver} DESC, {ORD} \
                 {conflict} RETURNING stored.xmax = 0",
                ver = names[v],
                conflict = on_conflict_update(&names, key, v),
            ),
        };
        let probe = probe_statements(table, columns, key, version, casts);
        Self {
            insert,
            insert_new,
            insert_plain,
            probe_table: probe.table,
            probe_compare: probe.compare,
            probe_keep: probe.keep,
            probe_read: probe.read,
            probe_same: probe.same,
            probe_same_update: probe.same_update,
            probe_folded: probe.folded,
            casts: casts.to_vec(),
            versions: version
                .map(|v| VersionStatements::build(table, columns, key, v, casts, tombstones)),
        }
    }
}

/// The transaction's own id, to tell the rows and tombstones this transaction wrote (`xmin`).
const OURS: &str = "pg_current_xact_id()::xid";

/// A row's `xmin` as a fenced lookup by key names it (a name no mapped column can have), to
/// be tested above the fence: tested below it, PostgreSQL scans the whole table for it.
pub(super) const XMIN: &str = "\"warren xmin\"";

/// A row's `tableoid` as a fenced lookup by key names it (see [`written_here`]).
pub(super) const TOID: &str = "\"warren tableoid\"";

/// The keys of the rows this transaction's own parent statement wrote (what its `RETURNING`
/// answered), typed as the table's key: made with the probe, filled by the probe's `keep`
/// insert and `update` upsert.
pub(super) const WRITTEN: &str = "pg_temp.warren_written";

/// Whether the row `row` of `table` found by the key of `of` (`row` from a fenced lookup
/// naming its `xmin` [`XMIN`] and its `tableoid` [`TOID`]) was written by this transaction's
/// own parent statement: its `xmin` is this transaction's and its key is in [`WRITTEN`]. An
/// `xmin` alone is fooled by a trigger that updates other rows of the table (review R40b F14:
/// a "latest order per customer" trigger made a stale order's row this transaction's, and its
/// child rows were replaced by the stale ones). The one row written without being returned,
/// one a BEFORE INSERT trigger of the table wrote into another table of its tree itself
/// (classic trigger partitioning into inheritance children), is told by its `xmin`, its
/// `tableoid` and that trigger.
pub(super) fn written_here(table: &str, row: &str, of: &str, keys: &[String]) -> String {
    let t = sql_text(table);
    // `IN`, not a correlated `EXISTS`: PostgreSQL hashes the written keys once (a hashed
    // SubPlan); an `EXISTS` under the `OR` scanned them again for every row, quadratic in the
    // batch.
    let of_keys: Vec<String> = keys.iter().map(|k| format!("{of}.{k}")).collect();
    let x_keys: Vec<String> = keys.iter().map(|k| format!("x.{k}")).collect();
    format!(
        "({row}.{XMIN} = {OURS} AND (({of_keys}) IN (SELECT {x_keys} FROM {WRITTEN} AS x) \
           OR ({row}.{TOID} <> {t}::regclass AND EXISTS (SELECT 1 FROM pg_catalog.pg_trigger \
             AS tg WHERE tg.tgrelid = {t}::regclass AND NOT tg.tgisinternal \
               AND tg.tgenabled <> 'D' AND tg.tgtype & 7 = 7))))",
        of_keys = of_keys.join(", "),
        x_keys = x_keys.join(", "),
    )
}

/// The statements of an `update` mapping's probe path, built once with its other statements.
#[derive(Debug, Clone)]
pub(super) struct VersionStatements {
    /// The writes into the probe (`$1..$n`, then `$n+1` each record's ordinal in the batch).
    pub(super) fill: String,
    /// With deletes: the deletes' probe (key and version columns, as the table types them).
    pub(super) del_table: Option<String>,
    /// The deletes into it (`$1..$k` the key, `$k+1` the version, `$k+2` the ordinals).
    pub(super) del_fill: String,
    /// With deletes: one advisory lock per key of the batch, in the order of the keys' hashes.
    pub(super) lock: Option<String>,
    /// Each key's winning write, from the probe, unless a tombstone as new holds it back.
    pub(super) upsert: String,
    /// With deletes: each key's winning delete's tombstone, unless a row as new holds it back.
    pub(super) tomb_write: String,
    /// With deletes: the rows whose tombstone this transaction wrote, deleted, every one
    /// ([`CountedDelete`]).
    pub(super) rows_gone: CountedDelete,
    /// With deletes: the tombstones of keys whose row this transaction wrote, removed.
    pub(super) tomb_clear: String,
    /// Per record: ordinal, delete?, written?, older than the key holds?, is the stored row at
    /// its version?, is the tombstone at its version?, the key's stored version as text, is
    /// the newest a tombstone?, its own version as the table types it (rounded, as text).
    pub(super) classify: String,
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
        let params = params(columns, casts);
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
                param(
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
            "WITH ins AS (INSERT INTO {t} AS stored ({list}) \
             SELECT {p_list} FROM pg_temp.warren_probe AS p \
             WHERE p.{ORD} IN (SELECT w.{ORD} FROM {winners} AS w WHERE NOT w.del){held_back} \
             ORDER BY {p_keys} {conflict} RETURNING {s_keys}), \
             x AS (INSERT INTO {WRITTEN} SELECT * FROM ins) SELECT 1 FROM ins",
            p_list = p_list.join(", "),
            p_keys = of("p"),
            s_keys = of("stored"),
            conflict = on_conflict_update(&names, key, version),
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
                    // Both found from the batch's keys, through the key's index: the
                    // fence (`OFFSET 0`) keeps the `xmin` test above the lookup, else
                    // PostgreSQL scanned the whole table for it (R36-F2: 24 and 39 ms a
                    // batch of 100 at 200,000 rows and tombstones; 0.4 ms so).
                    CountedDelete::new(
                        &t,
                        "s",
                        &format!(
                            "(SELECT {tb_k}, tb.{ver}, tb.xmin AS {XMIN} \
                               FROM pg_temp.warren_probe_del AS d JOIN {tomb} AS tb ON {} \
                               OFFSET 0) AS tb",
                            on("tb", "d"),
                            tb_k = of("tb"),
                        ),
                        &format!(
                            "{} AND tb.{XMIN} = {OURS} AND (s.{ver} IS NULL OR s.{ver} < tb.{ver})",
                            on("s", "tb"),
                        ),
                    ),
                    format!(
                        "DELETE FROM {tomb} AS tb USING (SELECT {s_k}, s.{ver}, s.xmin AS {XMIN} \
                           FROM pg_temp.warren_probe AS p JOIN {t} AS s ON {} \
                           OFFSET 0) AS s \
                         WHERE {} AND s.{XMIN} = {OURS} AND tb.{ver} < s.{ver}",
                        on("s", "p"),
                        on("tb", "s"),
                        s_k = of("s"),
                    ),
                )
            }
            None => Default::default(),
        };
        // The stored row and tombstone of each record's key, each looked up by the key's
        // index (a fenced lateral subquery: PostgreSQL cannot turn it into a join of whole
        // tables). A plain LEFT JOIN was planned as hash joins reading both tables whole, the
        // probe being unanalyzed (R36-F2: 200,000 rows each, about 0.5 s a batch).
        const SK: &str = "\"warren key\"";
        const SV: &str = "\"warren version\"";
        let (tb_join, tb_ver, tb_ours) = match tombstones {
            Some(tomb) => (
                format!(
                    " LEFT JOIN LATERAL (SELECT tb.{ver} AS {SV}, tb.xmin AS {XMIN} \
                     FROM {} AS tb WHERE {} OFFSET 0) AS tb ON true",
                    tomb.sql(),
                    on("tb", "u")
                ),
                format!("tb.{SV}"),
                format!("tb.{XMIN} = {OURS}"),
            ),
            None => (String::new(), "NULL".to_string(), "false".to_string()),
        };
        let classify = format!(
            "SELECT u.{ORD}, u.del, \
               COALESCE(w.{ORD} = u.{ORD} AND CASE WHEN u.del THEN {tb_ours} \
                 ELSE {written} END, false), \
               COALESCE(u.{ver} < GREATEST(s.{SV}, {tb_ver}), false), \
               COALESCE(s.{SV} = u.{ver}, false), \
               COALESCE({tb_ver} = u.{ver}, false), \
               GREATEST(s.{SV}, {tb_ver})::text, \
               COALESCE({tb_ver} > s.{SV} OR s.{SK} IS NULL, false), \
               u.{ver}::text \
             FROM {every} AS u JOIN {winners} AS w ON {w_u} \
             LEFT JOIN LATERAL (SELECT s.{first} AS {SK}, s.{ver} AS {SV}, s.xmin AS {XMIN}, \
               s.tableoid AS {TOID} FROM {t} AS s WHERE {s_u} OFFSET 0) AS s ON true{tb_join}",
            first = keys[0],
            written = written_here(&t, "s", "u", &keys),
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
