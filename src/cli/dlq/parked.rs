//! `warren dlq parked list` and `warren dlq parked replay`: the messages parked in the
//! `dead_letters` table, listed, or replayed to their pipeline's exchange (rows locked, published
//! and marked in one transaction, so a concurrent re-park waits and then re-opens the row).

use anyhow::Context as _;
use lapin::options::ConfirmSelectOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection};
use tokio_postgres::NoTls;

use super::queue::broker;
use super::{
    ParkedListArgs, ParkedReplayArgs, X_DLQ_ATTEMPTS, cell, now_s, plural, preview, table,
};
use crate::amqp::publisher::{Publish, json_properties, publish_confirmed};
use crate::amqp::{self, headers};
use crate::cli::out::{self, errln, out, outln};
use crate::config::{Settings, redact_url};
use crate::db::DbError;
use crate::db::dead_letters::{self, Listed};
use crate::registry::record::PipelineRecord;

async fn database(settings: &Settings) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = settings
        .database()
        .pg_config()?
        .connect(NoTls)
        .await
        .map_err(DbError::from_pg)
        .with_context(|| {
            format!(
                "cannot reach the database at {}",
                redact_url(&settings.database_url)
            )
        })?;
    tokio::spawn(connection);
    Ok(client)
}

/// Wraps a query error with where the table is and how to create it.
fn table_error(settings: &Settings, e: tokio_postgres::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot read dead_letters in schema {} ({}); if it does not exist, run `warren declare` first",
        settings.database_schema,
        DbError::from_pg(e)
    )
}

/// One parked row as `parked list --json` prints it.
fn row_json(row: &Listed) -> serde_json::Value {
    serde_json::json!({
        "seq": row.seq,
        "message_id": row.message_id,
        "kind": row.kind,
        "reason": row.reason,
        "parked_at": format!("{}Z", row.parked_at.replace(' ', "T")),
        "body": String::from_utf8_lossy(&row.body),
    })
}

/// One parked row as a line of `parked list`'s table.
fn row_cells(row: &Listed) -> Vec<String> {
    vec![
        row.seq.to_string(),
        row.message_id
            .as_deref()
            .map(cell)
            .unwrap_or_else(|| "-".into()),
        cell(&row.kind),
        row.parked_at.clone(),
        preview(&row.reason, 50),
        preview(&String::from_utf8_lossy(&row.body), 50),
    ]
}

/// With nothing parked under a name no configuration or live instance knows, why it is unknown
/// (a misspelt `--pipeline` lists nothing): on stderr, after the summary.
fn unknown_note(total: i64, args: &ParkedListArgs) {
    if let (0, Some(unknown)) = (total, &args.unknown) {
        crate::cli::say(format_args!(
            "note: {}",
            crate::cli::terminal_safe(&unknown.to_string())
        ));
    }
}

pub(super) async fn parked_list(settings: &Settings, args: ParkedListArgs) -> anyhow::Result<i32> {
    let client = database(settings).await?;
    let kind = args.kind.as_deref();
    let total = dead_letters::count_open(&client, &args.pipeline, kind)
        .await
        .map_err(|e| table_error(settings, e))?;
    // A name neither the configuration nor a live instance knows (Redis answered), with nothing
    // parked under it (of any kind): a typo, refused as one (exit 1), naming the pipelines that
    // are known. With Redis away it may be another instance's: listed, with a warning.
    if let Some(unknown) = args.unknown.as_ref().filter(|_| args.registry_answered) {
        let any = if kind.is_some() {
            dead_letters::count_open(&client, &args.pipeline, None)
                .await
                .map_err(|e| table_error(settings, e))?
        } else {
            total
        };
        if any == 0 {
            anyhow::bail!("{}", crate::cli::terminal_safe(&unknown.to_string()));
        }
    }
    let rows = dead_letters::list_open(&client, &args.pipeline, kind, args.limit)
        .await
        .map_err(|e| table_error(settings, e))?;
    let filter = args
        .kind
        .as_deref()
        .map(|k| format!(" of kind {k}"))
        .unwrap_or_default();
    let summary = format!(
        "parked in {}.dead_letters for pipeline {}, not replayed: {}{filter}, {} shown, newest first",
        settings.database_schema,
        args.pipeline,
        plural(u64::try_from(total).unwrap_or(0), "message"),
        rows.len()
    );
    if args.json {
        for r in &rows {
            outln!(
                "{}",
                crate::cli::json_terminal_safe(&row_json(r).to_string())
            )?;
        }
        errln!("{summary}");
        unknown_note(total, &args);
        return Ok(0);
    }
    outln!("{summary}")?;
    unknown_note(total, &args);
    if !rows.is_empty() {
        let cells: Vec<Vec<String>> = rows.iter().map(row_cells).collect();
        let header = [
            "SEQ",
            "MESSAGE ID",
            "KIND",
            "PARKED AT (UTC)",
            "REASON",
            "BODY",
        ];
        out!("{}", table(&header, &cells))?;
    }
    Ok(0)
}

/// The AMQP headers of a replayed parked row, rebuilt from its `headers` column: strings become
/// long strings, integers long long ints, booleans booleans, anything else (floats, integers
/// beyond `i64`, null, arrays, objects) its JSON text; every `x-error-*` header and
/// `x-dlq-attempts` are left out and `x-retries` is 0. A JSON null column means no headers; a
/// column that is not an object, or a name longer than AMQP allows (255 bytes), is refused.
pub fn replay_headers(json: &serde_json::Value) -> Result<FieldTable, ReplayError> {
    let mut table = FieldTable::default();
    match json {
        serde_json::Value::Null => {}
        serde_json::Value::Object(map) => {
            for (name, value) in map {
                if name.starts_with("x-error-") || name == X_DLQ_ATTEMPTS {
                    continue;
                }
                let key = headers::short(name.as_str())
                    .map_err(|e| ReplayError::LongName { len: e.len })?;
                let value = headers::json_value(value).map_err(|error| ReplayError::Header {
                    name: name.clone(),
                    error,
                })?;
                table.insert(key, value);
            }
        }
        other => {
            return Err(ReplayError::NotAnObject(preview(&other.to_string(), 40)));
        }
    }
    table.insert(
        ShortString::from(headers::X_RETRIES),
        AMQPValue::LongLongInt(0),
    );
    Ok(table)
}

/// Why a parked row cannot be replayed as it is: a problem of that row only (the replay leaves
/// it and goes on with the others).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Its `headers` column could not be read.
    #[error("{0}")]
    Unreadable(String),
    #[error("headers must be a JSON object, got {0}")]
    NotAnObject(String),
    #[error("header name of {len} bytes is longer than AMQP allows ({max})", max = headers::SHORT_MAX)]
    LongName { len: usize },
    #[error("header {name}: {error}")]
    Header {
        name: String,
        error: headers::MalformedHeader,
    },
    #[error("message_id of {len} bytes is longer than AMQP allows ({max})", max = headers::SHORT_MAX)]
    LongMessageId { len: usize },
}

/// Properties of a replayed parked message: persistent JSON, the row's message id and the
/// headers of [`replay_headers`]. A message id longer than AMQP allows (255 bytes) cannot be
/// published.
pub(super) fn parked_properties(
    message_id: Option<&str>,
    headers_json: &serde_json::Value,
) -> Result<BasicProperties, ReplayError> {
    let id = match message_id.map(headers::short) {
        Some(Err(e)) => return Err(ReplayError::LongMessageId { len: e.len }),
        Some(Ok(id)) => Some(id),
        None => None,
    };
    // The original's properties the row keeps in its headers (`headers::parked_json`) are
    // given back as properties: a property column of the replay reads the original's.
    let kept = |key: &str| headers_json.get(key);
    // A row that recorded them (its origin is always among them) gives back exactly those: a
    // timestamp or content type the original did not carry is not made up (review R36e F10:
    // the replay's time and `application/json` were stored as the original's, and a replay run
    // twice parked the stored message as a conflict). An older row gets a fresh message's.
    let base = if kept(headers::X_WARREN_EXCHANGE).is_some() {
        let base = BasicProperties::default().with_delivery_mode(2);
        match id {
            Some(id) => base.with_message_id(id),
            None => base,
        }
    } else {
        match id {
            // Its headers are the parked ones (below), never a new latency header. With the
            // content type, unlike a fresh message: a replay always carries a header table
            // (x-retries), so its properties pass 64 bytes anyway (`json_properties`).
            Some(id) => json_properties(id, false).with_content_type("application/json".into()),
            None => BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_timestamp(now_s()),
        }
    };
    let text = |key: &str| {
        kept(key)
            .and_then(|v| v.as_str())
            .and_then(|s| headers::short(s).ok())
    };
    let mut base = base;
    if let Some(t) = kept(headers::X_WARREN_TIMESTAMP).and_then(|v| v.as_u64()) {
        base = base.with_timestamp(t);
    }
    if let Some(v) = text(headers::X_WARREN_CORRELATION_ID) {
        base = base.with_correlation_id(v);
    }
    if let Some(v) = text(headers::X_WARREN_TYPE) {
        base = base.with_type(v);
    }
    if let Some(v) = text(headers::X_WARREN_APP_ID) {
        base = base.with_app_id(v);
    }
    if let Some(v) = text(headers::X_WARREN_CONTENT_TYPE) {
        base = base.with_content_type(v);
    }
    let given_back = [
        headers::X_WARREN_TIMESTAMP,
        headers::X_WARREN_CORRELATION_ID,
        headers::X_WARREN_TYPE,
        headers::X_WARREN_APP_ID,
        headers::X_WARREN_CONTENT_TYPE,
    ];
    let table: FieldTable = replay_headers(headers_json)?
        .inner()
        .iter()
        .filter(|(k, _)| !given_back.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into();
    // Through the republish policy like every copy warren publishes (`amqp::republish`).
    Ok(crate::amqp::republish::for_replay(
        &base.with_headers(table),
    ))
}

pub(super) async fn parked_replay(
    settings: &Settings,
    target: &PipelineRecord,
    args: ParkedReplayArgs,
) -> anyhow::Result<i32> {
    let mut client = database(settings).await?;
    // Fails early, before the broker is touched, when the table is missing.
    dead_letters::check(&client)
        .await
        .map_err(|e| table_error(settings, e))?;
    let conn = broker(settings).await?;
    let result = parked_replay_on(&conn, &mut client, settings, target, &args).await;
    amqp::close(None, Some(conn)).await;
    let tally = result?;
    let filter = args
        .kind
        .as_deref()
        .map(|k| format!(" of kind {k}"))
        .unwrap_or_default();
    // A closed stdout loses the report, never the exit code of a failure.
    out::unless_closed(outln!(
        "replayed {}{filter} to {} (routing key {}); failed {}{}",
        plural(tally.replayed, "parked message"),
        target.main_exchange,
        target.main_queue,
        tally.failed,
        if tally.unmarked > 0 {
            format!(
                "; of the replayed, {} published but still open in dead_letters (run the \
                 replay again: they are sent once more and stored once)",
                tally.unmarked
            )
        } else {
            String::new()
        },
    ))?;
    if let Some(failure) = tally.failure {
        errln!("warren dlq parked replay: {failure}");
        return Ok(1);
    }
    Ok(0)
}

/// Counts of a parked replay.
#[derive(Debug, Default)]
struct Tally {
    /// Rows published (confirmed).
    replayed: u64,
    /// Rows left untouched: not publishable, or their publish failed.
    failed: u64,
    /// The first failure, for the report; a replay stops at a failed publish.
    failure: Option<String>,
    /// Rows published (confirmed) whose `replayed_at` could not be committed: still open, so
    /// listed and replayed again (the idempotent insert stores each message once).
    unmarked: u64,
}

/// Rows locked, published and marked per transaction: bounds how long a concurrent re-park of
/// one of them waits.
const REPLAY_CHUNK: u64 = 100;

/// `seq`s as text for a message, `3, 4, 5`.
fn seq_list(seqs: &[i64]) -> String {
    seqs.iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

async fn parked_replay_on(
    conn: &Connection,
    client: &mut tokio_postgres::Client,
    settings: &Settings,
    target: &PipelineRecord,
    args: &ParkedReplayArgs,
) -> anyhow::Result<Tally> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context("cannot put the publishing channel in confirm mode")?;
    let timeout = settings.publish_timeout();
    let frame_max = conn.configuration().frame_max();
    let mut tally = Tally::default();
    let mut after = 0i64;
    loop {
        let budget = args
            .limit
            .map_or(REPLAY_CHUNK, |limit| {
                limit.saturating_sub(tally.replayed + tally.failed)
            })
            .min(REPLAY_CHUNK);
        if budget == 0 {
            break;
        }
        // The rows stay locked from before their publish until replayed_at is committed
        // (`dead_letters::lock_for_replay`): two replays never send the same row, and a
        // concurrent re-park waits and then re-opens the row.
        let tx = client
            .transaction()
            .await
            .map_err(|e| table_error(settings, e))?;
        let rows =
            dead_letters::lock_for_replay(&tx, &args.pipeline, args.kind.as_deref(), after, budget)
                .await
                .map_err(|e| table_error(settings, e))?;
        if rows.is_empty() {
            break;
        }
        let mut confirmed: Vec<i64> = Vec::with_capacity(rows.len());
        let mut stopped = false;
        for row in rows {
            after = row.seq;
            let properties = match row
                .headers
                .as_ref()
                .map_err(|e| ReplayError::Unreadable(e.to_string()))
                .and_then(|h| parked_properties(row.message_id.as_deref(), h))
            {
                Ok(p) => p,
                Err(e) => {
                    // A problem of this row only: leave it, go on with the others.
                    tally.failed += 1;
                    tally
                        .failure
                        .get_or_insert(format!("row {} is left untouched: {e}", row.seq));
                    continue;
                }
            };
            let msg = Publish {
                exchange: target.main_exchange.clone(),
                routing_key: target.main_queue.clone(),
                body: row.body.into(),
                properties,
            };
            match publish_confirmed(&channel, msg, frame_max, timeout).await {
                Ok(()) => confirmed.push(row.seq),
                Err(e) => {
                    // Not marked: what was confirmed before it is committed below.
                    tally.failed += 1;
                    tally.failure = Some(format!(
                        "stopped: row {} was not published and is left untouched: {e}",
                        row.seq
                    ));
                    stopped = true;
                    break;
                }
            }
        }
        if confirmed.is_empty() {
            // Nothing to mark: dropping the transaction releases the locks.
            drop(tx);
            if stopped {
                break;
            }
            continue;
        }
        let marked = async {
            dead_letters::mark_replayed(&tx, &confirmed).await?;
            tx.commit().await
        }
        .await;
        tally.replayed += confirmed.len() as u64;
        if let Err(e) = marked {
            // Published but not marked: a later replay sends them again, which the idempotent
            // insert makes harmless.
            tally.unmarked += confirmed.len() as u64;
            tally.failure = Some(format!(
                "rows {} were published but cannot be marked as replayed: {}",
                seq_list(&confirmed),
                DbError::from_pg(e)
            ));
            break;
        }
        if stopped {
            break;
        }
    }
    let _ = channel.close(200, "bye".into()).await;
    Ok(tally)
}
