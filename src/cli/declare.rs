//! `warren declare [--dry-run]`: declare the topology (reporting each object as created or
//! already matched), apply the database migrations and check the configured pipelines' tables.
//! Never deletes anything: a tombstone table of no configured pipeline (one renamed or removed)
//! is named, with what to do, and kept. `--dry-run` lists the objects and the migrations (applied or pending,
//! from the built-in set and the database's history) and changes nothing.

use anyhow::Context as _;

use crate::cli::out::{self, outln};
use crate::config::Settings;
use crate::topology::Topology;
use crate::{amqp, db};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the plan (objects, and migrations applied or pending) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let topology = Topology::from_settings(settings)?;
    if args.dry_run {
        outln!("plan (nothing declared):")?;
        for step in topology.plan() {
            outln!("  {}", step.object)?;
        }
        outln!()?;
        // What `declare` would refuse, refused here with its words and exit code (review
        // R38-F13: a queue with other arguments and a missing table were a plan, exit 0): the
        // objects that exist, declared again with their properties (nothing changes, nothing
        // is made or bound), and the pipelines' tables, read.
        match broker(settings).await {
            Ok(conn) => {
                let checked = topology.check_objects(&conn).await;
                amqp::close(None, Some(conn)).await;
                let checked = checked?;
                outln!(
                    "broker: the exchanges and queues that exist have these properties; to \
                     declare: {}{}",
                    if checked.missing.is_empty() {
                        "none".to_string()
                    } else {
                        checked.missing.join(", ")
                    },
                    if checked.unchecked.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({} checked to exist only: the broker user may not configure them)",
                            checked.unchecked.len()
                        )
                    }
                )?;
            }
            Err(e) => outln!("broker: cannot be asked ({e:#}); the objects are not checked")?,
        }
        match check_tables(settings).await {
            Ok(()) => {}
            Err(e) if e.downcast_ref::<crate::config::ConfigError>().is_some() => return Err(e),
            Err(e) => outln!("tables: cannot be asked ({e:#}); they are not checked")?,
        }
        // The database is read, never written: which built-in migrations it already has.
        let applied = db::applied_migrations(&settings.database()).await;
        let embedded = db::embedded_migrations();
        // Unknown when the database cannot be asked, not "all" (review R40a F12).
        let pending = match &applied {
            Ok(done) => format!(
                "{} to apply",
                embedded.iter().filter(|(v, _)| !done.contains(v)).count()
            ),
            Err(_) => "unknown which to apply".to_string(),
        };
        outln!(
            "database schema {}: {} migrations, {pending}{}",
            settings.database_schema,
            embedded.len(),
            match &applied {
                Ok(_) => String::new(),
                Err(e) => format!(
                    " (the database at {} cannot be asked: {e}; each is shown as unknown)",
                    crate::config::redact_url(&settings.database_url)
                ),
            }
        )?;
        let rows = embedded.iter().map(|(version, name)| {
            let state = match &applied {
                Ok(done) if done.contains(version) => "applied",
                Ok(_) => "pending",
                Err(_) => "unknown",
            };
            vec![name.clone(), state.to_string()]
        });
        outln!("{}", table(&["MIGRATION", "STATE"], rows))?;
        return Ok(0);
    }
    declare_all(settings, &topology, true).await?;
    Ok(0)
}

/// Declares the topology and migrates the database; prints each step when `verbose`.
pub async fn declare_all(
    settings: &Settings,
    topology: &Topology,
    verbose: bool,
) -> anyhow::Result<()> {
    let mut rows = declare_topology(settings, topology).await?;
    let report = migrate(settings).await?;
    rows.extend(tombstones(settings).await?);
    let strays = if verbose {
        stray_tombstones(settings).await?
    } else {
        Vec::new()
    };
    for stray in &strays {
        rows.push(vec![
            format!("table {}", stray.table),
            format!("kept: no pipeline here uses it ({})", stray.count()),
        ]);
    }
    if verbose {
        let what = if report.applied.is_empty() {
            "already up to date".to_string()
        } else {
            format!("applied {}", report.applied.join(", "))
        };
        rows.push(vec![
            format!("database schema {}", settings.database_schema),
            what,
        ]);
        // Nobody reading the report is no reason to skip the tables' check (exit 2).
        out::unless_closed(outln!("{}", table(&["OBJECT", "OUTCOME"], rows)))?;
        for stray in &strays {
            out::unless_closed(outln!("{}", stray.advice()))?;
        }
    }
    check_tables(settings).await
}

/// Declares `topology` (every configured pipeline's exchanges and queues,
/// [`Topology::from_settings`]); answers each object with its outcome, as table rows.
pub async fn declare_topology(
    settings: &Settings,
    topology: &Topology,
) -> anyhow::Result<Vec<Vec<String>>> {
    let conn = broker(settings).await?;
    // What the broker's version allows (a quorum DLQ without a limit on RabbitMQ 4), before
    // anything is declared: a bad setting, exit 2.
    let version = crate::topology::broker::broker_version(&conn);
    if let Err(refused) = topology.check_broker(version.as_deref()) {
        amqp::close(None, Some(conn)).await;
        return Err(refused.into());
    }
    let result = topology.declare(&conn).await;
    amqp::close(None, Some(conn)).await;
    let steps = result?;
    let mut rows = Vec::new();
    for step in &steps {
        let outcome = step
            .outcome
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        tracing::debug!(object = %step.object, %outcome, "declared");
        rows.push(vec![step.object.clone(), outcome]);
    }
    Ok(rows)
}

/// What `warren declare` checks of the broker before declaring ([`Topology::check_broker`]:
/// on RabbitMQ 4 a quorum DLQ without a delivery limit gets one of 20), for `warren run`
/// without `--declare`, whose queues were declared by another run or another version of the
/// broker: refused as a bad setting (exit 2) with the same words. The broker is asked only
/// when the answer depends on it (a quorum DLQ with `DLQ_DELIVERY_LIMIT=0`); one that cannot be
/// reached is an error the caller retries.
pub async fn check_broker(settings: &Settings, topology: &Topology) -> anyhow::Result<()> {
    if !topology.depends_on_broker_version() {
        return Ok(());
    }
    let conn = broker(settings).await?;
    let version = crate::topology::broker::broker_version(&conn);
    amqp::close(None, Some(conn)).await;
    topology.check_broker(version.as_deref())?;
    Ok(())
}

/// What `warren run` without `--declare` does about an exchange or queue that does not exist.
/// Exchanges or queues of the configuration that do not exist on the broker: a reload refuses
/// the pipelines that need them (started, they would fail to subscribe for ever and take the
/// instance's readiness with them); a start waits for them, then checks them
/// (`cli::run::check_topology`).
/// Past [`crate::text::LISTED`] of them, the line names the first ones and how many more
/// (review R44 F9: a line of 36 KB for a thousand pipelines); `warren declare --dry-run` lists
/// every one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "not declared on the broker: {}{}; run `warren declare` with this configuration first (or \
     `warren run --declare`)",
    crate::text::listed(.0),
    if .0.len() > crate::text::LISTED {
        " (`warren declare --dry-run` with this configuration lists them all)"
    } else {
        ""
    }
)]
pub struct NotDeclared(pub Vec<String>);

/// Checks, creating nothing, that the exchanges and queues of `topology` exist with the
/// declared properties ([`Topology::check`]): one with other arguments (a retry queue that
/// dead-letters to another main queue, a queue of the other type) is refused with the advice of
/// `warren declare`; a missing one is [`NotDeclared`]. Those the broker user may not configure
/// are checked to exist only, with a warning naming them.
pub async fn check_declared(settings: &Settings, topology: &Topology) -> anyhow::Result<()> {
    check_declared_and_absent(settings, topology, &[])
        .await
        .map(|_| ())
}

/// [`check_declared`], and which of `queues` do not exist on the broker (for a reload's left
/// queues: one never declared holds nothing to move, review R39-F15).
pub async fn check_declared_and_absent(
    settings: &Settings,
    topology: &Topology,
    queues: &[String],
) -> anyhow::Result<Vec<String>> {
    let conn = broker(settings).await?;
    let checked = topology.check(&conn).await;
    let mut absent = Vec::new();
    if checked.is_ok() {
        for queue in queues {
            match amqp::queue_exists(&conn, queue).await {
                Ok(false) => absent.push(queue.clone()),
                Ok(true) => {}
                Err(e) => {
                    amqp::close(None, Some(conn)).await;
                    return Err(anyhow::Error::new(e)
                        .context(format!("asking the broker whether queue {queue} exists")));
                }
            }
        }
    }
    amqp::close(None, Some(conn)).await;
    let checked = checked?;
    if !checked.unchecked.is_empty() {
        tracing::warn!(
            objects = %crate::text::listed(&checked.unchecked),
            count = checked.unchecked.len(),
            "the broker user may not configure these exchanges and queues (ACCESS_REFUSED): \
             their existence was checked, not their arguments"
        );
    }
    if !checked.missing.is_empty() {
        return Err(NotDeclared(checked.missing).into());
    }
    Ok(absent)
}

/// A connection to the broker for declaring or checking the topology, its error naming where
/// (the URL redacted).
async fn broker(settings: &Settings) -> anyhow::Result<lapin::Connection> {
    amqp::connect(&settings.amqp(), "declare", amqp::Frames::Small)
        .await
        .with_context(|| {
            format!(
                "cannot reach the broker at {}",
                crate::config::redact_url(&settings.amqp_url)
            )
        })
}

/// The database answered and refused the migrations (a privilege, a failing statement): waiting
/// for it does not help, unlike a database that does not answer (yet).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MigrationRefused(pub db::DbError);

/// Applies the migrations in `DATABASE_SCHEMA`. A database that answered and refused them is a
/// [`MigrationRefused`]; any other failure (no connection, a server starting up) is worth
/// waiting for (`warren run --declare`).
pub async fn migrate(settings: &Settings) -> anyhow::Result<db::MigrationReport> {
    let context = || {
        format!(
            "cannot migrate the database at {}",
            crate::config::redact_url(&settings.database_url)
        )
    };
    match db::migrate(&settings.database()).await {
        Ok(report) => Ok(report),
        Err(e) if e.is_transient() => Err(anyhow::Error::new(e).context(context())),
        Err(e) => Err(anyhow::Error::new(MigrationRefused(e)).context(context())),
    }
}

/// The configured pipelines' tables fit their mappings, or a configuration error (exit 2)
/// listing every mismatch.
pub async fn check_tables(settings: &Settings) -> anyhow::Result<()> {
    check_tables_among(settings, settings).await
}

/// [`check_tables`] of `settings`' pipelines, the partitions and inheritance trees of their
/// tables checked against every pipeline of `all` (the whole configuration, when `run
/// --pipelines` selected some: review R39-F5, two instances of one file, each selecting one
/// pipeline, wrote around the tombstones; a reload's new configuration).
pub async fn check_tables_among(settings: &Settings, all: &Settings) -> anyhow::Result<()> {
    refused_if_any(settings, pipeline_mismatches(settings, all)).await
}

/// The partitions and inheritance trees of the tables of `all`'s pipelines alone (the end of
/// [`check_tables_among`]): a reload under `run --pipelines` that starts none of the file's
/// new pipelines still refuses a file in which another instance's pipeline would write the
/// rows of a selected table with deletes (review R39-F5).
pub async fn check_shared_tables(all: &Settings) -> anyhow::Result<()> {
    // No pipeline's own table checked, only `all`'s shared ones ([`pipeline_mismatches`]).
    let mut none = all.clone();
    none.select_pipelines(&[]);
    check_tables_among(&none, all).await
}

/// The mismatches `check` finds, as a configuration error (exit 2) listing each; bounded, and
/// an error naming the database when it cannot be asked.
async fn refused_if_any(
    settings: &Settings,
    check: impl std::future::Future<Output = Result<Vec<String>, db::DbError>>,
) -> anyhow::Result<()> {
    // A database that accepts the connection and then says nothing (a half-open link, a frozen
    // host) is an error after the connect timeout and one statement's bound, not a silent hang.
    let bound = std::time::Duration::from_secs(5) + settings.database().call_bound();
    let checked = tokio::time::timeout(bound, check)
        .await
        .unwrap_or_else(|_| {
            Err(db::DbError::Connection(format!(
                "no answer from the database within {} ms",
                bound.as_millis()
            )))
        });
    let mismatches = checked.with_context(|| {
        format!(
            "cannot check the pipelines' tables in the database at {}",
            crate::config::redact_url(&settings.database_url)
        )
    })?;
    if mismatches.is_empty() {
        return Ok(());
    }
    Err(crate::config::ConfigError::Pipeline(mismatches.join("\n")).into())
}

/// Makes the tombstone table of every configured pipeline with deletes that lacks one
/// (docs/pipelines.md, "Deletes"); answers each with its outcome, as table rows.
pub async fn tombstones(settings: &Settings) -> anyhow::Result<Vec<Vec<String>>> {
    let mut mappings = Vec::new();
    for p in settings.pipelines().iter().filter(|p| !p.builtin) {
        let m = p.mapping().map_err(|e| anyhow::anyhow!(e.to_string()))?;
        if m.delete().is_some() {
            mappings.push(m);
        }
    }
    if mappings.is_empty() {
        return Ok(Vec::new());
    }
    let (client, connection) = settings
        .database()
        .pg_config()?
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(db::DbError::from_pg)
        .context("cannot make the tombstone tables")?;
    let task = tokio::spawn(connection);
    let mut rows = Vec::new();
    let mut result = Ok(());
    for m in &mappings {
        let Some((_, _, table)) = m.delete() else {
            continue;
        };
        match m.declare_tombstones(&client).await {
            Ok(Some(made)) => rows.push(vec![
                format!("table {table}"),
                if made { "created" } else { "already matched" }.to_string(),
            ]),
            Ok(None) => {}
            Err(e) => {
                // A table that does not exist yet is the tables' check to name (exit 2).
                if e.sqlstate() == Some("42P01") {
                    continue;
                }
                result = Err(e);
                break;
            }
        }
    }
    drop(client);
    let _ = task.await;
    result
        .map(|()| rows)
        .context("cannot make the tombstone tables")
}

/// A tombstone table warren made that no configured pipeline uses.
#[derive(Debug)]
pub struct StrayTombstones {
    /// The table, schema-qualified as SQL reads it.
    pub table: String,
    /// The pipeline it was made for.
    pub pipeline: String,
    /// Whether that pipeline is configured (without deletes now) or not at all.
    pub configured: bool,
    /// Tombstones in it.
    pub rows: i64,
}

impl StrayTombstones {
    /// What the operator reads below the report: why it is kept and what to do with it.
    pub fn advice(&self) -> String {
        let whose = if self.configured {
            format!("pipeline {}, which has no deletes any more", self.pipeline)
        } else {
            format!(
                "pipeline {}, which this configuration does not have",
                self.pipeline
            )
        };
        format!(
            "tombstone table {table} ({rows}) is of {whose}: warren keeps it (it \
             drops no table it does not know to be unused).\n  \
             renamed pipeline: move it to the new name before that pipeline runs, or its \
             deletes no longer hold back older writes (docs/pipelines.md#deletes, a renamed \
             pipeline)\n  \
             no longer needed: DROP TABLE {table};",
            table = self.table,
            rows = self.count(),
        )
    }

    /// Its tombstones, in words.
    fn count(&self) -> String {
        match self.rows {
            1 => "1 tombstone".to_string(),
            n => format!("{n} tombstones"),
        }
    }
}

/// The tombstone tables warren made in `DATABASE_SCHEMA` that no pipeline of `settings` uses:
/// of a pipeline renamed or removed, or without deletes now (docs/pipelines.md, "Deletes").
pub async fn stray_tombstones(settings: &Settings) -> anyhow::Result<Vec<StrayTombstones>> {
    let mut used = Vec::new();
    for p in settings.pipelines().iter().filter(|p| !p.builtin) {
        let m = p.mapping().map_err(|e| anyhow::anyhow!(e.to_string()))?;
        if let Some((_, _, table)) = m.delete() {
            used.push(table.name.clone());
        }
    }
    let (client, connection) = settings
        .database()
        .pg_config()?
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(db::DbError::from_pg)
        .context("cannot look for tombstone tables")?;
    let task = tokio::spawn(connection);
    let schema = &settings.database_schema;
    let found = crate::domain::mapping::tombstone_tables(&client, schema).await;
    drop(client);
    let _ = task.await;
    let found = found.context("cannot look for tombstone tables")?;
    Ok(found
        .into_iter()
        .filter(|t| !used.contains(&t.name))
        .map(|t| StrayTombstones {
            table: format!("{}.{}", sql_name(schema), sql_name(&t.name)),
            configured: settings.pipeline(&t.pipeline).is_some(),
            pipeline: t.pipeline,
            rows: t.rows,
        })
        .collect())
}

/// `name` as SQL reads it: bare when it is a plain lower-case identifier, else quoted.
fn sql_name(name: &str) -> String {
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        name.to_string()
    } else {
        crate::domain::mapping::quote(name)
    }
}

/// Every configured pipeline's mapping against its table (see
/// [`crate::domain::mapping::schema`]), before anything is consumed: `Ok` with every mismatch of
/// every pipeline, each a sentence naming the pipeline, the table and the column (empty: they
/// fit); `Err` when the database cannot be asked.
async fn pipeline_mismatches(
    settings: &Settings,
    all: &Settings,
) -> Result<Vec<String>, db::DbError> {
    // The file's pipelines: the built-in users pipeline's table is warren's own migration.
    let mut mappings = Vec::new();
    for p in settings.pipelines().iter().filter(|p| !p.builtin) {
        mappings.push(
            p.mapping()
                .map_err(|e| db::DbError::Migration(e.to_string()))?,
        );
    }
    if mappings.is_empty() && all.pipelines().iter().all(|p| p.builtin) {
        return Ok(Vec::new());
    }
    let (client, connection) = settings
        .database()
        .pg_config()?
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(db::DbError::from_pg)?;
    let task = tokio::spawn(connection);
    let mut out = Vec::new();
    let mut result = Ok(());
    for m in &mappings {
        match crate::domain::mapping::schema::check(m, &client).await {
            Ok(found) => out.extend(found),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_ok() {
        match shared_families(all, &client).await {
            Ok(found) => out.extend(found),
            Err(e) => result = Err(e),
        }
    }
    drop(client);
    let _ = task.await;
    result.map(|()| out)
}

/// The load refuses a table that a pipeline with deletes shares with another pipeline by its
/// name (`config::pipelines::shared`); here, by the catalog: a partition of it, its parent, or
/// another table of its inheritance tree, written by another pipeline, holds the same rows
/// under another name, and that pipeline's writes never see the tombstones (review R38-F11: a
/// delete lost through a partition). One sentence per such pair.
async fn shared_families(
    settings: &Settings,
    client: &tokio_postgres::Client,
) -> Result<Vec<String>, db::DbError> {
    let root = "WITH RECURSIVE up(oid, depth) AS ( \
                   SELECT to_regclass($1)::oid, 0 \
                   UNION ALL SELECT i.inhparent, up.depth + 1 FROM pg_inherits i \
                   JOIN up ON i.inhrelid = up.oid) \
                 SELECT up.oid::regclass::text, n.nspname::text, c.relname::text \
                 FROM up JOIN pg_class c ON c.oid = up.oid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE up.oid IS NOT NULL ORDER BY depth DESC LIMIT 1";
    // warren's own tables in its schema: a pipeline's table under one of them (an inheritance
    // child) writes warren's rows (review R39-F6: a child of a tombstone table made another
    // pipeline's writes stale).
    let reserved = |schema: &str, name: &str| {
        schema == settings.database_schema
            && (name == "dead_letters"
                || name == "refinery_schema_history"
                || name.starts_with("tombstones_"))
    };
    let mut tables: Vec<(&str, bool, String, String)> = Vec::new();
    for spec in settings.pipelines().iter().filter(|p| !p.builtin) {
        let deletes = spec.mapping.delete.is_some();
        for table in std::iter::once(&spec.mapping.table)
            .chain(spec.mapping.children.iter().map(|c| &c.table))
        {
            // Read as the table check reads it (quoted: `R40A.ITEMS` is not `r40a.items`;
            // review R40a F3: the two checks read one name two ways in one answer).
            let quoted = crate::domain::mapping::TableName::parse(table)
                .map(|t| t.sql())
                .unwrap_or_else(|_| table.clone());
            let found = client
                .query_opt(root, &[&quoted])
                .await
                .map_err(db::DbError::from_pg)?;
            if let Some(row) = found {
                let family: String = row.get(0);
                let (schema, name): (String, String) = (row.get(1), row.get(2));
                if reserved(&schema, &name) {
                    return Ok(vec![format!(
                        "pipeline {} writes {table}, under warren's own table {family} (its \
                         partition or inheritance child): a pipeline's rows there are read as \
                         warren's; map a table of the pipeline's own",
                        spec.name
                    )]);
                }
                tables.push((spec.name.as_str(), deletes, table.clone(), family));
            }
        }
    }
    let mut out = Vec::new();
    for (name, deletes, table, family) in &tables {
        if !deletes {
            continue;
        }
        if let Some((other, _, theirs, _)) = tables
            .iter()
            .find(|(o, _, t, f)| o != name && f == family && t != table)
        {
            out.push(format!(
                "pipeline {name} has deletes and writes {table}; pipeline {other} writes \
                 {theirs}, of the same partitioned or inherited table {family}: the same rows \
                 under another name, and {other}'s writes would not see {name}'s tombstones \
                 (an older write of a deleted key would bring its row back); feed both sources \
                 to one pipeline (bind them to its queue)"
            ));
        }
    }
    Ok(out)
}

/// A borderless table (comfy-table), two spaces between columns, no trailing blanks.
fn table(header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::NOTHING)
        .set_header(header.to_vec())
        .add_rows(rows);
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    t.trim_fmt()
}

#[cfg(test)]
mod tests {
    use super::NotDeclared;

    /// Review R44 F9: what is not declared is named in one line (a reload's error, the start's
    /// warning): a file of a thousand pipelines on undeclared queues made a line of 36 KB. The
    /// first few are named, then how many more and where to see them all.
    #[test]
    fn what_is_not_declared_is_named_in_a_short_line() {
        let missing: Vec<String> = (0..1000)
            .map(|i| format!("queue pipeline_number_{i}_queue"))
            .collect();
        let text = NotDeclared(missing).to_string();
        assert!(text.len() < 1024, "a line of {} bytes: {text}", text.len());
        assert!(
            text.contains("queue pipeline_number_0_queue, ")
                && text.contains("queue pipeline_number_4_queue and 995 more"),
            "{text}"
        );
        assert!(text.contains("warren declare --dry-run"), "{text}");
        let two = NotDeclared(vec!["exchange a".into(), "queue b".into()]).to_string();
        assert!(
            two.starts_with(
                "not declared on the broker: exchange a, queue b; run `warren declare`"
            ),
            "{two}"
        );
    }
}
