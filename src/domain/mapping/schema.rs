//! A mapping against its table, before anything is consumed (`warren declare`, `warren run`): the
//! table exists; every mapped column exists with a type the mapping's type can be written to;
//! every NOT NULL column without a default is mapped and not optional; the key is a primary key
//! or unique index of the table. Child tables (`[[pipelines.children]]`) are checked the same
//! way ([`check`]), and so are their foreign keys: one to the parent table must pair each of
//! its columns with the parent column its `parent` mapping carries; one to another table may
//! not hold a column that carries the parent's ([`foreign_key_mismatches`]). Each mismatch
//! names the pipeline, the table, the column, what was found and what was expected. And, for a row the database skipped: which unique index
//! holds its value, under which key.

use std::collections::HashMap;

use super::{ColType, Column, Mapping, Source, TableName};
use crate::db::error::DbError;

/// A column of the table as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableColumn {
    pub name: String,
    /// `format_type` of the column (`integer`, `text`, `timestamp with time zone`, ...).
    pub sql_type: String,
    /// The type's name in `pg_type` (`int4`, `text`, `timestamptz`, ...); a domain's base type.
    pub type_name: String,
    /// NOT NULL on the column, or on its domain.
    pub not_null: bool,
    /// A default on the column, or on its domain (or an identity, or generated).
    pub has_default: bool,
    /// `GENERATED ALWAYS` (a generated column, or an identity the database alone fills): no
    /// insert may give it a value.
    pub generated: bool,
    /// An enum (or a domain over one): a `text` mapping is written to it, read as a label.
    pub is_enum: bool,
}

/// What the catalog says of a table: its columns and its unique indexes (name, columns).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableInfo {
    pub columns: Vec<TableColumn>,
    pub unique: Vec<(String, Vec<String>)>,
    /// The unique indexes ON CONFLICT cannot use, each `name (columns), why` (review R40b F12:
    /// a DEFERRABLE one on exactly the key was said as "found: none").
    pub unusable: Vec<String>,
}

/// The types of `pg_type` a mapping's type can be written to: those PostgreSQL converts the
/// sent value to by an assignment cast, so the insert (and the probe) decide whether a value
/// fits (a 40000 into an `int2` is refused, 22003; a `float4` rounds as PostgreSQL rounds; an
/// instant into a `timestamp` is its UTC wall time, warren's sessions being in UTC).
fn writable(ty: ColType) -> &'static [&'static str] {
    match ty {
        // And any enum (`TableColumn::is_enum`).
        ColType::Text => &["text", "varchar", "bpchar", "citext"],
        ColType::Uuid => &["uuid"],
        ColType::Int4 => &["int4", "int2", "int8", "numeric"],
        ColType::Int8 => &["int8", "int2", "int4", "numeric"],
        ColType::Float8 => &["float8", "float4", "numeric"],
        ColType::Numeric => &["numeric"],
        ColType::Bool => &["bool"],
        ColType::Timestamptz => &["timestamptz", "timestamp"],
        ColType::Date => &["date"],
        ColType::Jsonb => &["jsonb", "json"],
    }
}

/// Every mismatch between `mapping` and `table` (empty: they fit), each a full sentence.
pub fn mismatches(mapping: &Mapping, table: Option<&TableInfo>) -> Vec<String> {
    let at = format!("pipeline {}: table {}", mapping.pipeline, mapping.table);
    table_mismatches(at, &mapping.columns, mapping.key(), table, false)
}

/// Every mismatch between the mapping and its table, and between each child table of the
/// mapping and its spec, as the catalog of `client`'s session describes them (empty: they
/// fit); each a full sentence naming the pipeline, the table and the column.
pub async fn check(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Vec<String>, DbError> {
    let info = describe_table(&mapping.table, client).await?;
    let mut out = mismatches(mapping, info.as_ref());
    // A relation that takes no INSERT of rows (review R39-F11: a materialized view with a
    // unique index passed, and the run held on a systemic error for good).
    for table in std::iter::once(&mapping.table).chain(mapping.children.iter().map(|c| &c.table)) {
        let kind: Option<String> = client
            .query_opt(
                "SELECT c.relkind::text FROM pg_class c WHERE c.oid = to_regclass($1)",
                &[&table.sql()],
            )
            .await
            .map_err(DbError::from_pg)?
            .map(|r| r.get(0));
        let what = match kind.as_deref() {
            Some("m") => "a materialized view",
            Some("v") => "a view",
            Some("f") => "a foreign table",
            _ => continue,
        };
        out.push(format!(
            "pipeline {}: {table} is {what}: a pipeline writes a table (or a partitioned table)",
            mapping.pipeline
        ));
    }
    // A rule on a table warren writes: `INSERT ... ON CONFLICT` cannot run through an INSERT or
    // UPDATE rule (0A000 on every batch, a systemic error for good), and a DO INSTEAD rule takes
    // the rows, or a delete, where the statement's answer cannot see them (review R39-F10).
    for table in std::iter::once(&mapping.table).chain(mapping.children.iter().map(|c| &c.table)) {
        let rules = client
            .query(
                "SELECT r.rulename::text, CASE r.ev_type WHEN '2' THEN 'UPDATE' \
                 WHEN '3' THEN 'INSERT' ELSE 'DELETE' END \
                 FROM pg_rewrite r WHERE r.ev_class = to_regclass($1) \
                 AND r.ev_type IN ('2', '3', '4') ORDER BY 1",
                &[&table.sql()],
            )
            .await
            .map_err(DbError::from_pg)?;
        for rule in rules {
            let (name, event): (String, String) = (rule.get(0), rule.get(1));
            out.push(format!(
                "pipeline {}: {table} has the rule {name:?} ON {event}: warren writes with \
                 INSERT ... ON CONFLICT (and DELETE), which a rule refuses or takes elsewhere \
                 unseen; drop the rule (a trigger is allowed)",
                mapping.pipeline
            ));
        }
    }
    // The privileges the pipeline's statements need (review R40b F9: a table warren may only
    // INSERT into passed, and the first message held the pipeline on 42501 for good).
    let update = matches!(mapping.on_conflict(), super::OnConflict::Update);
    let deletes = mapping.delete().is_some();
    let mut needs: Vec<(&TableName, Vec<&str>)> = Vec::new();
    let mut parent = vec!["INSERT", "SELECT"];
    if update {
        parent.push("UPDATE");
    }
    if deletes {
        parent.push("DELETE");
    }
    needs.push((&mapping.table, parent));
    for child in &mapping.children {
        let mut privileges = vec!["INSERT", "SELECT"];
        if update || deletes {
            privileges.push("DELETE");
        }
        needs.push((&child.table, privileges));
    }
    for (table, privileges) in needs {
        let missing: Option<Vec<String>> = client
            .query_opt(
                "SELECT ARRAY(SELECT p FROM unnest($2::text[]) AS p \
                 WHERE NOT has_table_privilege(c.oid, p)) \
                 FROM (SELECT to_regclass($1) AS oid) c WHERE c.oid IS NOT NULL",
                &[&table.sql(), &privileges],
            )
            .await
            .map_err(DbError::from_pg)?
            .map(|r| r.get(0));
        if let Some(missing) = missing.filter(|m| !m.is_empty()) {
            out.push(format!(
                "pipeline {}: this role may not {} {table} (expected the privileges {} on it: \
                 GRANT them, or the first message holds the pipeline on 42501)",
                mapping.pipeline,
                missing.join(", "),
                privileges.join(", ")
            ));
        }
    }
    // Row-level security that applies to this session: a policy's WITH CHECK refuses one row
    // as a missing privilege would (42501, systemic: the pipeline holds for good, review R40b
    // F5), where a CHECK constraint would have parked the one message.
    for table in std::iter::once(&mapping.table).chain(mapping.children.iter().map(|c| &c.table)) {
        let active: Option<bool> = client
            .query_one(
                "SELECT row_security_active(c.oid) FROM (SELECT to_regclass($1) AS oid) c \
                 WHERE c.oid IS NOT NULL",
                &[&table.sql()],
            )
            .await
            .ok()
            .map(|r| r.get(0));
        if active == Some(true) {
            out.push(format!(
                "pipeline {}: {table} has row-level security that applies to this role: a \
                 policy that refuses one row is said as a missing privilege (42501), which \
                 holds the pipeline rather than parking the message; write it as a role that \
                 bypasses it (the owner without FORCE ROW LEVEL SECURITY, or BYPASSRLS), or \
                 check the rows with a CHECK constraint",
                mapping.pipeline
            ));
        }
    }
    if info.is_some() {
        out.extend(tombstone_mismatch(mapping, client).await?);
        let at = format!("pipeline {}: table {}", mapping.pipeline, mapping.table);
        out.extend(key_collation_mismatches(&at, &mapping.table, mapping.key(), client).await?);
    }
    for child in &mapping.children {
        let info = describe_table(&child.table, client).await?;
        let at = format!(
            "pipeline {}: child table {} (rows {})",
            mapping.pipeline,
            child.table,
            child.rows()
        );
        out.extend(table_mismatches(
            at.clone(),
            &child.columns,
            child.key_names(),
            info.as_ref(),
            true,
        ));
        if info.is_some() {
            out.extend(carried_mismatches(&at, child, mapping, client).await?);
            // The child key's index compares as its columns do (review R40b F11: an index
            // under another collation than the column passed for a child table).
            out.extend(
                key_collation_mismatches(&at, &child.table, child.key_names(), client).await?,
            );
            let fks = foreign_keys(&child.table, &mapping.table, client).await?;
            out.extend(foreign_key_mismatches(
                &at,
                &child.columns,
                &mapping.columns,
                &mapping.table,
                &fks,
            ));
        }
    }
    Ok(out)
}

/// The type (with its modifier; a domain's base type, whose equality it has) and collation of
/// `table`'s column `column`, as the catalog says; `None` when it has no such column (the
/// column check names that).
async fn column_kind(
    table: &TableName,
    column: &str,
    client: &tokio_postgres::Client,
) -> Result<Option<(String, String)>, DbError> {
    Ok(client
        .query_opt(
            "SELECT CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) \
                    ELSE format_type(a.atttypid, a.atttypmod) END, \
                    COALESCE(co.collname::text, '') \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             LEFT JOIN pg_collation co ON co.oid = a.attcollation \
             WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 \
             AND NOT a.attisdropped",
            &[&table.sql(), &column],
        )
        .await
        .map_err(DbError::from_pg)?
        .map(|r| (r.get(0), r.get(1))))
}

/// A child column that carries a parent column (`{ parent = "k" }`) must hold it as the parent
/// table does, its type, modifier and collation the same: the child rows are found, replaced
/// and deleted under their parent by comparing the two, and the value written is the
/// message's (review R40b F3, F6, F10: a `text` column under a `citext` key, or `numeric`
/// under `numeric(6,2)`, kept another version's rows and outlived deletes; a column under
/// another collation than a nondeterministic key's held every batch on 42P22).
async fn carried_mismatches(
    at: &str,
    child: &super::children::Child,
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Vec<String>, DbError> {
    let mut out = Vec::new();
    for column in &child.columns {
        let Source::Parent(i) = column.source else {
            continue;
        };
        let Some(parent) = mapping.columns.get(i) else {
            continue;
        };
        let (Some(mine), Some(theirs)) = (
            column_kind(&child.table, &column.name, client).await?,
            column_kind(&mapping.table, &parent.name, client).await?,
        ) else {
            continue;
        };
        if mine == theirs {
            continue;
        }
        let said = |(ty, coll): &(String, String)| {
            if coll.is_empty() || coll == "default" {
                ty.clone()
            } else {
                format!("{ty} COLLATE \"{coll}\"")
            }
        };
        out.push(format!(
            "{at}: column {} is {}, but it carries the parent's {}, which {} holds as {} \
             (expected {}: the child rows are found under their parent by comparing the two, \
             and another type, modifier or collation compares, rounds or hashes otherwise)",
            column.name,
            said(&mine),
            parent.name,
            mapping.table,
            said(&theirs),
            said(&theirs)
        ));
    }
    Ok(out)
}

/// A foreign key of a child table, as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignKey {
    pub name: String,
    /// Its columns in the child table, in the key's order.
    pub columns: Vec<String>,
    /// The table it references, as the session's search path names it.
    pub references: String,
    /// Whether that table is the pipeline's own (the parent table).
    pub to_parent: bool,
    /// The referenced columns, paired with `columns`.
    pub referenced: Vec<String>,
}

/// The foreign keys of `child`, each with whether it references `parent`.
async fn foreign_keys(
    child: &TableName,
    parent: &TableName,
    client: &tokio_postgres::Client,
) -> Result<Vec<ForeignKey>, DbError> {
    let names = |side: &str, rel: &str| {
        format!(
            "ARRAY(SELECT a.attname::text FROM unnest(c.{side}) WITH ORDINALITY AS k(n, o) \
             JOIN pg_attribute a ON a.attrelid = c.{rel} AND a.attnum = k.n ORDER BY k.o)"
        )
    };
    let sql = format!(
        "SELECT c.conname::text, {}, c.confrelid::regclass::text, \
                COALESCE(c.confrelid = to_regclass($2)::oid, false), {} \
         FROM pg_constraint c WHERE c.conrelid = to_regclass($1)::oid AND c.contype = 'f' \
         AND c.conparentid = 0 ORDER BY c.conname",
        names("conkey", "conrelid"),
        names("confkey", "confrelid"),
    );
    Ok(client
        .query(&sql, &[&child.sql(), &parent.sql()])
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .map(|r| ForeignKey {
            name: r.get(0),
            columns: r.get(1),
            references: r.get(2),
            to_parent: r.get(3),
            referenced: r.get(4),
        })
        .collect())
}

/// The mismatches of a child table's foreign keys (`at` names the pipeline and the child
/// table) with its `columns`, whose `parent` columns carry the `parent` columns of the
/// pipeline's table `parent_table`. A foreign key to the parent table is welcome when each of
/// its columns carries the very parent column it references (the parent row is written first,
/// in the same transaction); one to another table may not hold a column that carries the
/// parent's (every message's child rows would then need a row there). Foreign keys on other
/// columns (a `sku` to a catalog) are the table's own business.
fn foreign_key_mismatches(
    at: &str,
    columns: &[Column],
    parent: &[Column],
    parent_table: &TableName,
    fks: &[ForeignKey],
) -> Vec<String> {
    let mut out = Vec::new();
    let carried = |column: &str| {
        columns
            .iter()
            .find(|c| c.name == column)
            .and_then(|c| match c.source {
                Source::Parent(i) => parent.get(i).map(|p| p.name.as_str()),
                _ => None,
            })
    };
    let source = |column: &str| match columns.iter().find(|c| c.name == column) {
        None => "not mapped".to_string(),
        Some(c) => match &c.source {
            Source::Parent(i) => format!(
                "the parent's {}",
                parent.get(*i).map_or("?", |p| p.name.as_str())
            ),
            Source::Index => "the element's position".into(),
            Source::Path { pointer, .. } if pointer.is_empty() => "the whole element".into(),
            Source::Path { pointer, .. } => format!("the element's {pointer}"),
            Source::Header(h) => format!("header {h}"),
            Source::Property(p) => format!("property {}", p.as_str()),
            Source::Kept => "the unknown fields".into(),
        },
    };
    for fk in fks {
        let shown = format!(
            "foreign key {} ({}) references {} ({})",
            fk.name,
            fk.columns.join(", "),
            fk.references,
            fk.referenced.join(", ")
        );
        for (column, referenced) in fk.columns.iter().zip(&fk.referenced) {
            match (fk.to_parent, carried(column)) {
                (true, Some(p)) if p == referenced => {}
                (true, _) => out.push(format!(
                    "{at}: {shown}, but column {column} holds {} (expected {column} = {{ parent \
                     = \"{referenced}\" }}: a child row references the parent row of its own \
                     message)",
                    source(column)
                )),
                (false, Some(p)) => out.push(format!(
                    "{at}: {shown}, not the pipeline's table {parent_table}, but column \
                     {column} holds the parent's {p} (expected a foreign key to \
                     {parent_table} ({p}), or none)"
                )),
                (false, None) => {}
            }
        }
    }
    out
}

/// The mismatches of one table (`at` names the pipeline and the table) with the `columns`
/// written to it and its `key`; `child`: a child table's (whose text columns cannot yet be
/// written to an enum).
fn table_mismatches(
    at: String,
    columns: &[Column],
    key: Vec<&str>,
    table: Option<&TableInfo>,
    child: bool,
) -> Vec<String> {
    let Some(table) = table else {
        return vec![format!(
            "{at} does not exist (warren never creates a pipeline's table: create it first)"
        )];
    };
    let mut out = Vec::new();
    let by_name: HashMap<&str, &TableColumn> =
        table.columns.iter().map(|c| (c.name.as_str(), c)).collect();
    for c in columns {
        match by_name.get(c.name.as_str()) {
            None if c.source == Source::Kept => out.push(format!(
                "{at}: column {} does not exist (expected a jsonb column: unknown_fields = {{ \
                 keep = \"{}\" }} keeps there the fields no column reads)",
                c.name, c.name
            )),
            Some(t) if c.source == Source::Kept && t.type_name != "jsonb" => out.push(format!(
                "{at}: column {} is {}; unknown_fields = {{ keep = \"{}\" }} needs a jsonb \
                 column (it keeps an object of the fields no column reads)",
                c.name, t.sql_type, c.name
            )),
            None => out.push(format!(
                "{at}: column {} does not exist (expected a column for the {} mapping)",
                c.name, c.ty
            )),
            Some(t)
                if !writable(c.ty).contains(&t.type_name.as_str())
                    && (!t.is_enum || c.ty != ColType::Text) =>
            {
                out.push(format!(
                    "{at}: column {} is {}; a {} mapping is written to {}",
                    c.name,
                    t.sql_type,
                    c.ty,
                    writable(c.ty).join(" or ")
                ))
            }
            Some(t) if child && t.is_enum => out.push(format!(
                "{at}: column {} is an enum ({}): a child table's text column is not written to \
                 an enum yet (expected a text, varchar or citext column)",
                c.name, t.sql_type
            )),
            Some(t) if t.generated => out.push(format!(
                "{at}: column {} is GENERATED ALWAYS: the database computes it and refuses any \
                 value an insert gives it (expected it left out of the mapping)",
                c.name
            )),
            Some(_) => {}
        }
    }
    for t in &table.columns {
        // A generated column the mapping fills is named above; one it leaves alone is filled.
        if !t.not_null || t.generated {
            continue;
        }
        match columns.iter().find(|c| c.name == t.name) {
            None if !t.has_default => out.push(format!(
                "{at}: column {} is NOT NULL without a default, and no column of the mapping \
                 fills it (expected a mapping for it)",
                t.name
            )),
            // An absent optional value is written as NULL, not as the column's default: the
            // database would refuse every message without it.
            Some(c) if c.optional => out.push(format!(
                "{at}: column {} is NOT NULL, but its mapping is optional: an absent value would \
                 be written as NULL{} (expected optional = false{})",
                t.name,
                if t.has_default {
                    ", not as the column's default"
                } else {
                    ""
                },
                if t.has_default {
                    ", or the column left out of the mapping so that its default applies"
                } else {
                    ""
                }
            )),
            _ => {}
        }
    }
    let named = key.join(", ");
    let mut key = key;
    key.sort_unstable();
    let covered = table.unique.iter().any(|(_, cols)| {
        let mut cols: Vec<&str> = cols.iter().map(String::as_str).collect();
        cols.sort_unstable();
        cols == key
    });
    if !covered {
        let found: Vec<String> = table
            .unique
            .iter()
            .map(|(name, cols)| format!("{name} ({})", cols.join(", ")))
            .collect();
        out.push(format!(
            "{at}: the key ({}) is not a primary key or unique index of the table (found: {}); \
             expected one on exactly these columns, neither partial, DEFERRABLE nor invalid (a \
             failed CREATE INDEX CONCURRENTLY) (ON CONFLICT cannot use those)",
            named,
            if found.is_empty() {
                "none".to_string()
            } else {
                found.join(", ")
            }
        ));
        if !table.unusable.is_empty() {
            let last = out.pop().unwrap_or_default();
            out.push(format!("{last}; unusable: {}", table.unusable.join("; ")));
        }
    }
    out
}

/// What the catalog says of `mapping`'s table (`None`: no such table), as the search path of
/// `client`'s session resolves an unqualified name.
pub async fn describe(
    mapping: &Mapping,
    client: &tokio_postgres::Client,
) -> Result<Option<TableInfo>, DbError> {
    describe_table(&mapping.table, client).await
}

/// What the catalog says of `table` (`None`: no such table).
async fn describe_table(
    table: &TableName,
    client: &tokio_postgres::Client,
) -> Result<Option<TableInfo>, DbError> {
    let name = table.sql();
    let oid: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&name])
        .await
        .map_err(DbError::from_pg)?
        .get(0);
    let Some(oid) = oid else {
        return Ok(None);
    };
    let columns = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), \
                    COALESCE(b.typname, t.typname)::text, \
                    a.attnotnull OR t.typnotnull, \
                    a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '' \
                        OR t.typdefaultbin IS NOT NULL, \
                    a.attidentity = 'a' OR a.attgenerated <> '', \
                    COALESCE(b.typtype, t.typtype) = 'e' \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             LEFT JOIN pg_type b ON t.typtype = 'd' AND b.oid = t.typbasetype \
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            &[&oid],
        )
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .map(|r| TableColumn {
            name: r.get(0),
            sql_type: r.get(1),
            type_name: r.get(2),
            not_null: r.get(3),
            has_default: r.get(4),
            generated: r.get(5),
            is_enum: r.get(6),
        })
        .collect();
    let unique = unique_indexes(client, oid).await?;
    let unusable = client
        .query(
            "SELECT i.relname::text || ' (' || array_to_string(ARRAY(SELECT \
                 COALESCE(a.attname::text, 'an expression') FROM unnest(x.indkey) \
                 WITH ORDINALITY AS k(n, o) LEFT JOIN pg_attribute a ON a.attrelid = x.indrelid \
                 AND a.attnum = k.n WHERE k.o <= x.indnkeyatts ORDER BY k.o), ', ') || '), ' || \
                 concat_ws(', ', CASE WHEN NOT x.indimmediate THEN 'DEFERRABLE' END, \
                     CASE WHEN x.indpred IS NOT NULL THEN 'partial' END, \
                     CASE WHEN NOT x.indisvalid THEN 'invalid' END, \
                     CASE WHEN x.indexprs IS NOT NULL THEN 'on an expression' END) \
             FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
             WHERE x.indrelid = $1 AND x.indisunique AND (NOT x.indisvalid \
                 OR x.indpred IS NOT NULL OR x.indexprs IS NOT NULL OR NOT x.indimmediate) \
             ORDER BY i.relname",
            &[&oid],
        )
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(Some(TableInfo {
        columns,
        unique,
        unusable,
    }))
}

/// The key's columns that a unique index on exactly the key's columns compares under another
/// collation than the column's own (`CREATE UNIQUE INDEX ON t (k COLLATE "ci")` on a column of
/// the default collation), each a sentence. `ON CONFLICT (k)` takes such an index as its
/// arbiter, so two keys the index takes as one (`ABC`, `abc`) would be one to the insert and two
/// to everything else warren asks of the key by the column's `=`: the probe that finds the
/// stored row, the winner of a batch, the advisory lock of a key with deletes (its hash follows
/// the column's collation) and the tombstone (its key typed as the column). A column whose own
/// collation is nondeterministic, or a `citext` one, is fine: there the column's `=`, its hash
/// and the index agree.
async fn key_collation_mismatches(
    at: &str,
    table: &TableName,
    key: Vec<&str>,
    client: &tokio_postgres::Client,
) -> Result<Vec<String>, DbError> {
    let rows = client
        .query(
            "SELECT i.relname::text, array_agg(a.attname::text ORDER BY k.ord), \
               array_agg(CASE WHEN k.coll <> a.attcollation THEN a.attname::text END \
                 ORDER BY k.ord), \
               array_agg(COALESCE(ic.collname::text, '') ORDER BY k.ord), \
               array_agg(COALESCE(ac.collname::text, '') ORDER BY k.ord) \
             FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
             CROSS JOIN LATERAL unnest(x.indkey::int2[], x.indcollation::oid[]) \
               WITH ORDINALITY AS k(attnum, coll, ord) \
             JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum \
             LEFT JOIN pg_collation ic ON ic.oid = k.coll \
             LEFT JOIN pg_collation ac ON ac.oid = a.attcollation \
             WHERE x.indrelid = to_regclass($1) AND x.indisunique AND x.indisvalid AND x.indpred IS NULL \
               AND x.indexprs IS NULL AND x.indimmediate AND k.ord <= x.indnkeyatts \
             GROUP BY i.relname ORDER BY i.relname",
            &[&table.sql()],
        )
        .await
        .map_err(DbError::from_pg)?;
    let mut key = key;
    key.sort_unstable();
    let mut out = Vec::new();
    for row in rows {
        let index: String = row.get(0);
        let columns: Vec<String> = row.get(1);
        let differ: Vec<Option<String>> = row.get(2);
        let index_coll: Vec<String> = row.get(3);
        let column_coll: Vec<String> = row.get(4);
        let mut sorted: Vec<&str> = columns.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        if sorted != key {
            continue;
        }
        for (i, column) in differ.iter().enumerate() {
            let Some(column) = column else { continue };
            let named = |c: &str| {
                if c.is_empty() {
                    "none".to_string()
                } else {
                    format!("{c:?}")
                }
            };
            out.push(format!(
                "{at}: column {column}: the key's unique index {index} compares it under the \
                 collation {}, the column under {} (warren finds, locks and tombstones a key \
                 by the column's equality: two keys the index takes as one would be two to \
                 warren); expected the index on the column's own collation (or the column given \
                 the index's: ALTER TABLE {table} ALTER COLUMN {column} TYPE <its type> COLLATE \
                 {})",
                named(&index_coll[i]),
                named(&column_coll[i]),
                named(&index_coll[i]),
            ));
        }
    }
    Ok(out)
}

/// The unique indexes (and primary key) of the table `oid`: (name, columns), expression,
/// partial and deferrable ones left out (ON CONFLICT cannot take them as its arbiter, so they
/// cannot be a key).
pub(super) async fn unique_indexes<C: tokio_postgres::GenericClient>(
    client: &C,
    oid: u32,
) -> Result<Vec<(String, Vec<String>)>, DbError> {
    Ok(client
        .query(
            "SELECT i.relname::text, array_agg(a.attname::text ORDER BY k.ord) \
             FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
             CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord) \
             JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum \
             WHERE x.indrelid = $1 AND x.indisunique AND x.indisvalid AND x.indpred IS NULL \
               AND x.indexprs IS NULL AND x.indimmediate AND k.ord <= x.indnkeyatts \
             GROUP BY i.relname ORDER BY i.relname",
            &[&oid],
        )
        .await
        .map_err(DbError::from_pg)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// The mismatch of a pipeline with deletes whose tombstone table is missing or lacks the key's
/// unique index (`warren run` before `warren declare`), as a sentence; `None`: it fits.
async fn tombstone_mismatch(
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
    let unique = unique_indexes(client, oid).await?;
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
