//! `warren pipelines`: every pipeline this configuration runs, with its queues, table and mapping.
//! `warren pipelines test NAME [FILE]`: what pipeline NAME would do with each JSON line of FILE
//! (standard input by default), the row it would insert or the rejection with its kind and
//! reason, with no broker and no database; exit 0 when every line is accepted, 1 otherwise.
//! With `--db`, each accepted message's rows are also written into the live tables by the
//! pipeline's own statements in a transaction rolled back, so a CHECK, a foreign key, a
//! trigger or a type the database refuses shows up before a message is sent; a key the table
//! holds already is only read, never written.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Subcommand;
use comfy_table::{Table, presets};
use lapin::types::{AMQPValue, FieldTable, LongString};
use serde_json::Value;

use crate::amqp::headers;
use crate::cli::out::{self, out};
use crate::cli::terminal_safe as safe;
use crate::config::Settings;
use crate::config::pipelines::{Names, PipelineSpec};
use crate::domain::mapping::{Cell, Trial};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub action: Option<Action>,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Decode JSON lines as pipeline NAME would, with no broker and no database.
    ///
    /// Each non-empty line is one message body. With --headers, each line is instead
    /// `{"headers": {...}, "properties": {...}, "body": ...}`: the headers (strings, numbers,
    /// booleans, null: AMQP's void) as the AMQP headers the pipeline's `header` columns read, the
    /// properties (message_id, correlation_id, timestamp in seconds, type, app_id, content_type,
    /// exchange, routing_key; optional) as its `property` columns read them, the body as the
    /// message. Without them, a property column is absent, but for the exchange and the
    /// routing key: the pipeline's own (where `publish --pipeline` sends; a delivery always has
    /// both).
    /// Prints, per line, `ok` and the row it would insert (JSON), or the kind and reason it would
    /// be dead-lettered with. Exit 0 when every line is accepted, 1 otherwise, 2 when NAME is no
    /// pipeline of the configuration (the closest name said).
    ///
    /// With --db, each accepted message's parent row and child rows are also written into the
    /// live tables (DATABASE_URL) by the pipeline's own statements, in a transaction that is
    /// rolled back: a CHECK, a foreign key, a trigger or a type the database refuses is
    /// printed as `db_permanent` with PostgreSQL's words (the table, column and constraint it
    /// names) and counts as refused. Nothing stays in the tables. A message whose key is stored
    /// already is not tried: that row and its child rows are only read, never written or
    /// locked.
    Test {
        /// The pipeline (see `warren pipelines`).
        name: String,
        /// A file of JSON lines; standard input when absent.
        file: Option<PathBuf>,
        /// Lines carry headers and properties: `{"headers": {...}, "properties": {...}, "body": ...}`.
        #[arg(long)]
        headers: bool,
        /// Also try each accepted message's rows against the live tables, rolled back.
        #[arg(long)]
        db: bool,
    },
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    match args.action {
        None => {
            out!("{}", list(settings)?)?;
            Ok(0)
        }
        Some(Action::Test {
            name,
            file,
            headers,
            db,
        }) => {
            let input: Box<dyn Read> = match &file {
                Some(path) => Box::new(
                    std::fs::File::open(path)
                        .with_context(|| format!("cannot read {}", path.display()))?,
                ),
                None => Box::new(std::io::stdin()),
            };
            let database = match db {
                true => Some(Database::connect(settings).await?),
                false => None,
            };
            if let Some(d) = &database {
                // What `warren run` refuses at its start (exit 2), refused here first: a table
                // that does not fit the mapping (a DEFERRABLE key, a missing column) is not
                // tried message by message (review R37x F3: such a table was "ok").
                let checked = check_table(settings, &name, d).await;
                if checked.is_err() {
                    if let Some(d) = database {
                        d.close().await;
                    }
                    return checked.map(|()| 0);
                }
            }
            let code = test(
                settings,
                &name,
                BufReader::new(input),
                headers,
                database.as_ref(),
                &mut out::stdout(),
            )
            .await;
            if let Some(d) = database {
                d.close().await;
            }
            code
        }
    }
}

/// `--db`'s link to the database, as `declare` reaches it (`DATABASE_URL`, its schema), and
/// the bound on each message's trial.
pub struct Database {
    client: tokio_postgres::Client,
    task: tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
    bound: std::time::Duration,
    url: String,
}

impl Database {
    pub async fn connect(settings: &Settings) -> anyhow::Result<Self> {
        let config = settings.database();
        let bound = std::time::Duration::from_secs(5) + config.call_bound();
        let url = crate::config::redact_url(&settings.database_url);
        let connecting = async {
            config
                .pg_config()?
                .connect(tokio_postgres::NoTls)
                .await
                .map_err(crate::db::DbError::from_pg)
        };
        let (client, connection) = tokio::time::timeout(bound, connecting)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "no answer from the database within {} ms",
                    bound.as_millis()
                )
            })
            .and_then(|r| r.map_err(anyhow::Error::from))
            .with_context(|| format!("--db: cannot reach the database at {url}"))?;
        Ok(Self {
            client,
            task: tokio::spawn(connection),
            bound,
            url,
        })
    }

    async fn close(self) {
        drop(self.client);
        let _ = self.task.await;
    }
}

/// The table check of `warren run`'s start (`schema::check`) for the pipeline `name` (not the
/// built-in users pipeline, whose table is warren's migration): a mismatch is a configuration
/// error (exit 2) in the same words.
async fn check_table(settings: &Settings, name: &str, d: &Database) -> anyhow::Result<()> {
    let spec = find(settings, name)?;
    if spec.builtin {
        return Ok(());
    }
    let mapping = spec.mapping().map_err(|e| anyhow::anyhow!(e.to_string()))?;
    let found = tokio::time::timeout(
        d.bound,
        crate::domain::mapping::schema::check(&mapping, &d.client),
    )
    .await
    .map_err(|_| {
        anyhow::anyhow!(
            "no answer from the database within {} ms",
            d.bound.as_millis()
        )
    })
    .and_then(|r| r.map_err(anyhow::Error::from))
    .with_context(|| format!("--db: cannot check the table in the database at {}", d.url))?;
    if found.is_empty() {
        return Ok(());
    }
    Err(crate::config::ConfigError::Pipeline(found.join("\n")).into())
}

/// The pipeline `name` as the configuration resolves it; an unknown name is a usage error
/// (exit 2), with the closest name and the known ones.
fn find<'a>(settings: &'a Settings, name: &str) -> anyhow::Result<&'a PipelineSpec> {
    settings
        .pipeline(name)
        .ok_or_else(|| super::Usage(settings.no_pipeline(name)).into())
}

/// The listing: one block per pipeline.
fn list(settings: &Settings) -> anyhow::Result<String> {
    let mut out = String::new();
    // The built-in users pipeline, as config/default.toml declares it, unless a file's replaces
    // it (its names are the settings MAIN_QUEUE, ...), then the file's: as resolved.
    for spec in settings.pipelines() {
        let p = &spec.mapping;
        let mut conflict = format!("{:?}", p.on_conflict).to_lowercase();
        if let Some(v) = &p.version_column {
            conflict.push_str(&format!(" (version_column {v})"));
        }
        if let Some(d) = &p.delete {
            let value = match &d.value {
                crate::domain::mapping::DeleteValue::Text(t) => format!("{t:?}"),
                crate::domain::mapping::DeleteValue::Int(n) => n.to_string(),
                crate::domain::mapping::DeleteValue::Bool(b) => b.to_string(),
            };
            conflict.push_str(&format!(
                ", delete when {} = {value} (tombstones_{})",
                d.field, spec.name
            ));
        }
        let table = format!(
            "{}, key {}, on_conflict {conflict}, unknown_fields {}{}",
            p.table,
            p.key.join("+"),
            p.unknown_fields,
            if spec.api.enabled { ", api" } else { "" },
        );
        let columns = p
            .columns
            .iter()
            .map(|(name, c)| {
                let source = match (&c.path, &c.header, c.property) {
                    (Some(path), _, _) if path.is_empty() => "(whole body)".to_string(),
                    (Some(path), _, _) => path.clone(),
                    (None, Some(h), _) => format!("header {h}"),
                    (None, None, Some(p)) => format!("property {p}"),
                    (None, None, None) => "-".into(),
                };
                let mut checks = checks(c.optional, c.format, c.min, c.max, c.min_len, c.max_len);
                more_checks(
                    &mut checks,
                    c.one_of.as_deref(),
                    c.pattern.as_deref(),
                    c.default.as_ref(),
                );
                row(name, &source, c.ty.as_str(), &checks)
            })
            .chain(
                p.unknown_fields
                    .keep_column()
                    .map(|kept| row(kept, "(unknown fields)", "jsonb", "")),
            )
            .collect();
        let mut children = String::new();
        for c in &p.children {
            let rows: Vec<Vec<String>> = c
                .columns
                .iter()
                .map(|(name, c)| {
                    let source = match (&c.path, &c.header, &c.parent) {
                        (Some(path), _, _) if path.is_empty() => "(whole element)".to_string(),
                        (Some(path), _, _) => path.clone(),
                        (_, Some(h), _) => format!("header {h}"),
                        (_, _, Some(p)) => format!("parent {p}"),
                        _ if c.property.is_some() => {
                            format!("property {}", c.property.map(|p| p.as_str()).unwrap_or(""))
                        }
                        _ if c.index => "(position, from 1)".into(),
                        _ => "-".into(),
                    };
                    // A parent column takes its parent's type; an index is an int4 unless typed.
                    let parent_ty = c
                        .parent
                        .as_ref()
                        .and_then(|name| p.columns.get(name))
                        .map(|pc| pc.ty.as_str());
                    let ty = c.ty.map(|t| t.as_str()).or(parent_ty).unwrap_or("int4");
                    let mut checks =
                        checks(c.optional, c.format, c.min, c.max, c.min_len, c.max_len);
                    more_checks(
                        &mut checks,
                        c.one_of.as_deref(),
                        c.pattern.as_deref(),
                        c.default.as_ref(),
                    );
                    row(name, &source, ty, &checks)
                })
                .collect();
            children.push_str(&format!(
                "  child   {} from {}{}, key {}, max_rows {}\n{}\n",
                c.table,
                c.rows,
                if c.optional { " (optional)" } else { "" },
                c.key.join("+"),
                c.max_rows
                    .unwrap_or(crate::domain::mapping::MAX_ROWS_DEFAULT),
                columns_table(rows)
            ));
        }
        let title = if spec.builtin {
            format!("{} (built-in)", spec.name)
        } else {
            spec.name.clone()
        };
        let mut text = block(&title, &spec.names, &table, columns);
        if !children.is_empty() {
            text.pop();
            text.push_str(&children);
            text.push('\n');
        }
        out.push_str(&text);
    }
    Ok(out)
}

/// A column's checks as the listing shows them (`optional, min 1`).
fn checks(
    optional: bool,
    format: Option<crate::domain::mapping::Format>,
    min: Option<f64>,
    max: Option<f64>,
    min_len: Option<usize>,
    max_len: Option<usize>,
) -> String {
    let mut checks = Vec::new();
    if optional {
        checks.push("optional".to_string());
    }
    if let Some(f) = format {
        checks.push(format!("format {}", format!("{f:?}").to_lowercase()));
    }
    for (what, v) in [("min", min), ("max", max)] {
        if let Some(v) = v {
            checks.push(format!("{what} {v}"));
        }
    }
    for (what, v) in [("min_len", min_len), ("max_len", max_len)] {
        if let Some(v) = v {
            checks.push(format!("{what} {v}"));
        }
    }
    checks.join(", ")
}

/// Appends to a column's listed checks its values, pattern and default (`one_of ["EUR","USD"],
/// pattern "^[A-Z]{3}$", default "EUR"`).
fn more_checks(
    checks: &mut String,
    one_of: Option<&[Value]>,
    pattern: Option<&str>,
    default: Option<&Value>,
) {
    let mut more = Vec::new();
    if let Some(values) = one_of {
        more.push(format!("one_of {}", Value::from(values.to_vec())));
    }
    if let Some(p) = pattern {
        more.push(format!("pattern {}", Value::from(p)));
    }
    if let Some(v) = default {
        more.push(format!("default {v}"));
    }
    for m in more {
        if !checks.is_empty() {
            checks.push_str(", ");
        }
        checks.push_str(&m);
    }
}

/// Columns as an indented borderless table.
fn columns_table(rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_header(vec!["COLUMN", "SOURCE", "TYPE", "CHECKS"])
        .add_rows(rows);
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    let indented: Vec<String> = t.trim_fmt().lines().map(|l| format!("  {l}")).collect();
    indented.join("\n")
}

fn row(column: &str, source: &str, ty: &str, checks: &str) -> Vec<String> {
    vec![column.into(), source.into(), ty.into(), checks.into()]
}

/// One pipeline: its name, queues, table, then its columns as a table.
fn block(title: &str, names: &Names, table: &str, columns: Vec<Vec<String>>) -> String {
    let tiers: Vec<String> = names.retry_tiers.iter().map(|t| t.queue.clone()).collect();
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_header(vec!["COLUMN", "SOURCE", "TYPE", "CHECKS"])
        .add_rows(columns);
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    let indented: Vec<String> = t.trim_fmt().lines().map(|l| format!("  {l}")).collect();
    format!(
        "{title}\n  queue   {} -> {}\n  retry   {} -> {}\n  dlq     {} -> {}\n  table   {table}\n{}\n\n",
        names.main_exchange,
        names.main_queue,
        names.retry_exchange,
        tiers.join(", "),
        names.dlx_exchange,
        names.dlq_queue,
        indented.join("\n"),
    )
}

/// Decodes every line of `input` as pipeline `name` would and writes the verdicts to `out`;
/// with `db`, tries each accepted message's rows against the live tables, rolled back.
pub async fn test(
    settings: &Settings,
    name: &str,
    input: impl BufRead,
    with_headers: bool,
    db: Option<&Database>,
    out: &mut impl std::io::Write,
) -> anyhow::Result<i32> {
    // The built-in users pipeline is its declaration, as for any other.
    let pipeline = find(settings, name)?;
    let mapping = pipeline.mapping()?;
    let (mut accepted, mut refused) = (0u64, 0u64);
    // Lines as bytes: a body that is not UTF-8 is the pipeline's `invalid_json` to report,
    // not the end of the input (the lines after it are checked too).
    for (i, line) in input.split(b'\n').enumerate() {
        let mut line = line.context("cannot read the input")?;
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let (body, headers, properties) = if with_headers {
            let parsed = std::str::from_utf8(&line)
                .map_err(|e| format!("not UTF-8: {e}"))
                .and_then(envelope);
            match parsed {
                Ok(parts) => parts,
                Err(e) => bail!("line {}: {e}", i + 1),
            }
        } else {
            (line, None, None)
        };
        // Refused unread over the size limit, as the pipeline's processor refuses it.
        let verdict = if body.len() > pipeline.max_message_bytes {
            Err(crate::domain::Rejection::payload(format!(
                "body of {} bytes exceeds MAX_MESSAGE_BYTES ({})",
                body.len(),
                pipeline.max_message_bytes
            )))
        } else {
            // Without properties, as with `"properties": {}`: a delivery always has an exchange
            // and a routing key, the pipeline's own where `publish --pipeline` sends (review
            // R36g F3: a required routing_key column refused every line `run` stores).
            let (props, exchange, routing_key) = match properties
                .clone()
                .unwrap_or_default()
                .amqp(headers.clone(), &pipeline.names)
            {
                Ok(parts) => parts,
                Err(e) => bail!("line {}: {e}", i + 1),
            };
            let envelope = crate::domain::Envelope {
                properties: &props,
                exchange: &exchange,
                routing_key: &routing_key,
            };
            let decoded = mapping
                .decode_envelope(&body, &envelope)
                .map_err(|r| r.rejection);
            decoded.map(|row| {
                if row.2 == crate::domain::mapping::Op::Delete {
                    // A delete: its key and version, what it deletes (no child rows).
                    let (names, cells): (Vec<&str>, Vec<_>) = mapping
                        .columns()
                        .zip(&row.0)
                        .filter(|((c, _, _), _)| {
                            mapping.key().contains(c) || mapping.version_column() == Some(*c)
                        })
                        .map(|((c, _, _), cell)| (c, cell.clone()))
                        .unzip();
                    return (true, row_json(names.into_iter(), &cells), Vec::new(), row);
                }
                let parent = row_json(mapping.columns().map(|(c, _, _)| c), &row.0);
                // Each child row under its parent, named by its table.
                let children: Vec<String> = mapping
                    .child_tables()
                    .zip(&row.1)
                    .flat_map(|((table, _, _, columns), rows)| {
                        rows.iter().map(move |cells| {
                            format!("{table} {}", row_json(columns.iter().copied(), cells))
                        })
                    })
                    .collect();
                (false, parent, children, row)
            })
        };
        let verdict = match (verdict, db) {
            (Ok((false, parent, children, row)), Some(db)) => {
                let tried = tokio::time::timeout(db.bound, mapping.trial(&db.client, &row))
                    .await
                    .map_err(|_| anyhow::anyhow!("no answer within {} ms", db.bound.as_millis()))
                    .and_then(|r| r.map_err(anyhow::Error::from))
                    .with_context(|| {
                        format!(
                            "--db: line {}: cannot try its rows in the database at {}",
                            i + 1,
                            db.url
                        )
                    })?;
                match tried {
                    // A code the run retries (a trigger's RAISE, P0001, is no class warren
                    // knows): retried in place and through the retry queue, then parked
                    // `retries_exhausted` if it persists (review R42a F2: said db_permanent).
                    Trial::Refused(r)
                        if crate::db::error::classify_sqlstate(&r.code)
                            == crate::db::ErrorClass::Transient =>
                    {
                        Err(crate::domain::Rejection {
                            kind: crate::domain::ErrorKind::RetriesExhausted,
                            reason: format!(
                                "the database refuses it: {r} (a code warren retries: tried \
                                 again in place and through the retry queue, then parked \
                                 retries_exhausted if it persists)"
                            ),
                        })
                    }
                    Trial::Refused(r) => {
                        Err(refused_by_db(format!("the database refuses it: {r}")))
                    }
                    Trial::Discarded => Err(refused_by_db(
                        "the database refuses it: not written (a trigger of the table \
                         discarded its row)"
                            .into(),
                    )),
                    Trial::Held => Ok((
                        false,
                        parent,
                        children,
                        Some(format!(
                            "db: not tried: its key is stored already (--db writes no row of \
                             a stored key), the pipeline's on_conflict decides ({})",
                            match mapping.version_column() {
                                Some(_) =>
                                    "a higher version replaces it and its child rows, the \
                                     same content is a copy, an older version changes nothing",
                                None => "the same content is a copy, other content is id_conflict",
                            }
                        )),
                    )),
                    Trial::Delete => Ok((true, parent, children, None)),
                    Trial::Written(n) => Ok((
                        false,
                        parent,
                        children,
                        Some(format!(
                            "db: ok, the parent row and {n} child row{} written and rolled back",
                            if n == 1 { "" } else { "s" }
                        )),
                    )),
                }
            }
            // A delete writes no rows: nothing of it is tried.
            (verdict, _) => {
                verdict.map(|(delete, parent, children, _)| (delete, parent, children, None))
            }
        };
        match verdict {
            Ok((delete, row, children, db_note)) => {
                accepted += 1;
                writeln!(
                    out,
                    "{}: {} {}",
                    i + 1,
                    if delete { "delete" } else { "ok" },
                    crate::cli::json_terminal_safe(&row)
                )?;
                for child in children {
                    writeln!(out, "   + {}", crate::cli::json_terminal_safe(&child))?;
                }
                if let Some(note) = db_note {
                    writeln!(out, "   {}", safe(&note))?;
                }
            }
            Err(r) => {
                refused += 1;
                writeln!(out, "{}: {} {}", i + 1, r.kind, safe(&r.reason))?;
            }
        }
    }
    writeln!(out, "{accepted} accepted, {refused} refused")?;
    Ok(if refused == 0 { 0 } else { 1 })
}

/// A message the live tables refuse (`--db`), as the pipeline would park it.
fn refused_by_db(reason: String) -> crate::domain::Rejection {
    crate::domain::Rejection {
        kind: crate::domain::ErrorKind::DbPermanent,
        reason,
    }
}

/// The properties a `--headers` line may give its message (`"properties": {...}`), for the
/// property columns.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LineProperties {
    message_id: Option<String>,
    correlation_id: Option<String>,
    /// Seconds since the epoch, as AMQP carries it.
    timestamp: Option<u64>,
    #[serde(rename = "type")]
    kind: Option<String>,
    app_id: Option<String>,
    content_type: Option<String>,
    /// Where it was published; absent: the pipeline's own exchange and routing key, where
    /// `warren publish --pipeline` and the API publish (a delivery always has them).
    exchange: Option<String>,
    routing_key: Option<String>,
}

impl LineProperties {
    /// As AMQP properties (with `headers`), and the exchange and routing key; a property AMQP
    /// cannot carry (over 255 bytes: a short string) is refused naming it (review R36g F3: it
    /// was taken as absent).
    fn amqp(
        &self,
        headers: Option<FieldTable>,
        names: &Names,
    ) -> Result<(lapin::BasicProperties, String, String), String> {
        let short = |name: &str, s: &Option<String>| {
            s.as_deref()
                .map(|s| headers::short(s).map_err(|e| format!("property {name}: {e}")))
                .transpose()
        };
        let mut p = lapin::BasicProperties::default();
        if let Some(h) = headers {
            p = p.with_headers(h);
        }
        if let Some(v) = short("message_id", &self.message_id)? {
            p = p.with_message_id(v);
        }
        if let Some(v) = short("correlation_id", &self.correlation_id)? {
            p = p.with_correlation_id(v);
        }
        if let Some(t) = self.timestamp {
            p = p.with_timestamp(t);
        }
        if let Some(v) = short("type", &self.kind)? {
            p = p.with_type(v);
        }
        if let Some(v) = short("app_id", &self.app_id)? {
            p = p.with_app_id(v);
        }
        if let Some(v) = short("content_type", &self.content_type)? {
            p = p.with_content_type(v);
        }
        for (name, value) in [
            ("exchange", &self.exchange),
            ("routing_key", &self.routing_key),
        ] {
            short(name, value)?;
        }
        Ok((
            p,
            self.exchange
                .clone()
                .unwrap_or_else(|| names.main_exchange.clone()),
            self.routing_key
                .clone()
                .unwrap_or_else(|| names.main_queue.clone()),
        ))
    }
}

/// A `--headers` line parsed: the body's bytes, its headers as AMQP ones, its properties.
type Line = (Vec<u8>, Option<FieldTable>, Option<LineProperties>);

/// `{"headers": {...}, "properties": {...}, "body": ...}`: the body's bytes as written, the
/// headers as AMQP ones, and the properties if given.
fn envelope(line: &str) -> Result<Line, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Envelope<'a> {
        #[serde(default)]
        headers: serde_json::Map<String, Value>,
        #[serde(default)]
        properties: Option<LineProperties>,
        #[serde(borrow)]
        body: &'a serde_json::value::RawValue,
    }
    let e: Envelope = serde_json::from_str(line).map_err(|e| {
        format!(
            "expected {{\"headers\": {{...}}, \"properties\": {{...}}, \"body\": ...}} \
             (--headers): {e}"
        )
    })?;
    let mut table = FieldTable::default();
    for (k, v) in e.headers {
        let value = match v {
            Value::String(s) => AMQPValue::LongString(LongString::from(s)),
            Value::Bool(b) => AMQPValue::Boolean(b),
            Value::Number(n) if n.is_i64() => AMQPValue::LongLongInt(n.as_i64().unwrap_or(0)),
            Value::Number(n) => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
            // AMQP's void field: a header column reads it as null, as from the broker.
            Value::Null => AMQPValue::Void,
            other => {
                return Err(format!(
                    "header {k:?}: a string, number, boolean or null, got {other}"
                ));
            }
        };
        // No message can carry a longer name (an AMQP short string): the line describes none.
        let name = headers::short(k.as_str()).map_err(|e| {
            format!(
                "header {:?}: a header name is {e}",
                crate::text::capped(&k, 40)
            )
        })?;
        table.insert(name, value);
    }
    Ok((e.body.get().as_bytes().to_vec(), Some(table), e.properties))
}

/// A decoded row as a JSON object, column -> value; a `jsonb` value and a `numeric` one as
/// written in the message (a JSON reader would round `1e2` to `100.0` and long decimals).
fn row_json<'a>(columns: impl Iterator<Item = &'a str>, cells: &[Cell]) -> String {
    use serde_json::value::{RawValue, to_raw_value};
    let mut out: Vec<(String, Box<RawValue>)> = Vec::new();
    for (name, cell) in columns.zip(cells) {
        let value = match cell {
            Cell::Null => to_raw_value(&Value::Null),
            Cell::Text(s) | Cell::Timestamptz(s) | Cell::Date(s) => to_raw_value(s),
            Cell::Uuid(u) => to_raw_value(&u.to_string()),
            Cell::Int4(n) => to_raw_value(n),
            Cell::Int8(n) => to_raw_value(n),
            Cell::Float8(f) => to_raw_value(f),
            Cell::Bool(b) => to_raw_value(b),
            Cell::Numeric(text) | Cell::Jsonb(text) => {
                RawValue::from_string(text.clone()).or_else(|_| to_raw_value(text))
            }
        };
        if let Ok(v) = value {
            out.push((name.to_string(), v));
        }
    }
    let fields: Vec<String> = out
        .iter()
        .map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), v.get()))
        .collect();
    format!("{{{}}}", fields.join(","))
}
