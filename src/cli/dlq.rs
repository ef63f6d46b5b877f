//! `warren dlq`: inspect the dead-letter queue without taking anything out of it, replay its
//! messages to the main exchange (each republish confirmed before the DLQ copy is acked), and
//! list or replay the messages parked in the `dead_letters` table (rows locked, published and
//! marked in one transaction, so a concurrent re-park waits and then re-opens the row).

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::builder::PossibleValuesParser;
use comfy_table::{Table, presets};
use lapin::message::BasicGetMessage;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio_postgres::NoTls;

use crate::amqp::publisher::{Publish, json_properties, publish_confirmed};
use crate::amqp::{self, headers, republish};
use crate::config::{Settings, redact_url};
use crate::db::{self, DbError};

/// The kinds of dead letter `--kind` selects: the values of `x-error-kind` (and of
/// `dead_letters.error_kind`), then the kinds of messages the broker dead-lettered itself (see
/// [`kind_of`]).
pub const KINDS: [&str; 10] = [
    "invalid_json",
    "invalid_payload",
    "db_permanent",
    "retries_exhausted",
    "id_conflict",
    "unpublishable",
    "broker_rejected",
    "broker_expired",
    "broker_maxlen",
    "broker_delivery_limit",
];

/// The header the DLQ consumer counts its attempts in; a replay starts the count again.
const X_DLQ_ATTEMPTS: &str = "x-dlq-attempts";

/// The broker's `x-death` reasons and the kinds they are shown and selected as.
const BROKER_KINDS: [(&str, &str); 4] = [
    ("rejected", "broker_rejected"),
    ("expired", "broker_expired"),
    ("maxlen", "broker_maxlen"),
    ("delivery_limit", "broker_delivery_limit"),
];

/// The newest entry of the `x-death` header the broker adds when it dead-letters a message
/// itself (a reject or nack without requeue, an expired TTL, an overflowing queue, a quorum
/// queue's delivery limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerDeath {
    /// The entry's `reason`, as the broker wrote it (`rejected`, `expired`, ...).
    pub reason: String,
    /// The queue the message died in, when the entry names it.
    pub queue: Option<String>,
}

impl BrokerDeath {
    /// The first entry of `x-death` (the broker puts the newest death first), or of
    /// `x-original-x-death` where a move set it aside; `None` when the header is missing or not
    /// an array of tables with a `reason`.
    pub fn of(properties: &BasicProperties) -> Option<Self> {
        let headers = properties.headers().as_ref()?.inner();
        let AMQPValue::FieldArray(deaths) = headers
            .get(republish::X_DEATH)
            .or_else(|| headers.get(republish::X_ORIGINAL_DEATH))?
        else {
            return None;
        };
        let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
            return None;
        };
        Some(Self {
            reason: headers::value_text(first.inner().get("reason")?),
            queue: first.inner().get("queue").map(headers::value_text),
        })
    }

    /// `broker_rejected`, `broker_expired`, `broker_maxlen` or `broker_delivery_limit`; `None`
    /// for a reason the broker did not document.
    pub fn kind(&self) -> Option<&'static str> {
        BROKER_KINDS
            .iter()
            .find(|(reason, _)| *reason == self.reason)
            .map(|(_, kind)| *kind)
    }

    /// What `dlq inspect` shows as the reason of a message without `x-error-reason`.
    fn describe(&self) -> String {
        match &self.queue {
            Some(q) => format!("dead-lettered by the broker ({}) in queue {q}", self.reason),
            None => format!("dead-lettered by the broker ({})", self.reason),
        }
    }
}

/// The kind of a dead letter: its `x-error-kind`, or, when warren did not write one (the
/// broker dead-lettered the message itself), the kind of the broker's reason in the newest
/// `x-death` entry (`broker_rejected`, ...).
pub fn kind_of(properties: &BasicProperties) -> Option<String> {
    headers::text(properties, headers::X_ERROR_KIND).or_else(|| {
        BrokerDeath::of(properties)
            .and_then(|d| d.kind())
            .map(str::to_string)
    })
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The pipeline whose DLQ and parked messages to work on (see `warren pipelines`); a replay
    /// sends its messages back to this pipeline's queue.
    #[arg(long, global = true, value_name = "NAME", default_value = "users")]
    pub pipeline: String,
    #[command(subcommand)]
    pub command: DlqCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// List messages of the DLQ (id, kind, reason, retries, age) and leave them in the queue.
    Inspect(InspectArgs),
    /// Move DLQ messages back to the main exchange, with x-retries reset to 0.
    ///
    /// The x-error-* headers are removed; the body and the other properties are kept. A message
    /// the broker dead-lettered itself (x-death, no x-error-kind) has the kind broker_<reason>
    /// (broker_rejected, broker_expired, broker_maxlen, broker_delivery_limit). Each
    /// republish is confirmed by the broker before the DLQ copy is acked, so nothing is lost;
    /// a failed republish leaves its message in the DLQ, stops the replay and exits 1.
    Replay(ReplayArgs),
    /// The messages the DLQ consumer parked in the dead_letters table.
    #[command(subcommand)]
    Parked(ParkedCommand),
}

#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// Show at most N messages (the queue's depth is printed too).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: u64,
    /// Print one JSON object per message instead of a table (the depth goes to stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// Replay only messages of this kind (x-error-kind, or broker_<reason> from x-death); the
    /// others stay in the DLQ.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Replay at most N messages (default: every message in the queue when the command starts).
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: Option<u64>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ParkedCommand {
    /// List parked messages not yet replayed, newest first.
    List(ParkedListArgs),
    /// Publish parked messages not yet replayed to the main exchange, oldest first.
    ///
    /// Each row's body goes out as a persistent JSON message with its message id, its parked
    /// headers (without x-error-* and x-dlq-attempts) and x-retries 0. Rows are locked (FOR
    /// UPDATE SKIP LOCKED, up to 100 at a time), published with confirms, and marked replayed in
    /// the same transaction, so a concurrent re-park of a row waits and then re-opens it. A row
    /// whose publish failed is left untouched, and the command exits 1.
    Replay(ParkedReplayArgs),
}

#[derive(Debug, clap::Args)]
pub struct ParkedListArgs {
    /// The pipeline whose rows (from `dlq --pipeline`).
    #[arg(skip)]
    pub pipeline: String,
    /// Only rows with this error kind.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Show at most N rows.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: u64,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ParkedReplayArgs {
    /// The pipeline whose rows (from `dlq --pipeline`).
    #[arg(skip)]
    pub pipeline: String,
    /// Only rows with this error kind.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Replay at most N rows (default: all).
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: Option<u64>,
}

/// `--limit`: a whole number of at least 1.
fn parse_limit(raw: &str) -> Result<u64, String> {
    match raw.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number of at least 1".into()),
    }
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    // The settings as the chosen pipeline sees them: its DLQ, its exchange and queue.
    let view = match settings.pipelines.iter().find(|p| p.name == args.pipeline) {
        Some(p) => p.view(settings),
        None if args.pipeline == "users" => settings.clone(),
        None => {
            let mut known = vec!["users".to_string()];
            known.extend(settings.pipelines.iter().map(|p| p.name.clone()));
            anyhow::bail!(
                "--pipeline: no pipeline {:?}; this configuration has: {}",
                crate::cli::terminal_safe(&args.pipeline),
                known.join(", ")
            );
        }
    };
    let settings = &view;
    match args.command {
        DlqCommand::Inspect(a) => inspect(settings, a).await,
        DlqCommand::Replay(a) => replay(settings, a).await,
        DlqCommand::Parked(ParkedCommand::List(mut a)) => {
            a.pipeline = args.pipeline;
            parked_list(settings, a).await
        }
        DlqCommand::Parked(ParkedCommand::Replay(mut a)) => {
            a.pipeline = args.pipeline;
            parked_replay(settings, a).await
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The queue: inspect and replay
// ---------------------------------------------------------------------------------------------

async fn broker(settings: &Settings) -> anyhow::Result<Connection> {
    amqp::connect(settings, "dlq tool", amqp::Frames::Broker)
        .await
        .with_context(|| {
            format!(
                "cannot reach the broker at {}",
                redact_url(&settings.amqp_url)
            )
        })
}

/// Messages ready in `queue`, by a passive declare on a channel of its own (a missing queue
/// closes that channel only).
async fn depth(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    match crate::amqp::queue_stats(conn, queue).await {
        Ok((messages, _)) => Ok(messages),
        Err(e) => anyhow::bail!(
            "cannot read queue {queue} ({e}); if it does not exist, run `warren declare` first"
        ),
    }
}

/// Returns every message still unacked on `channel` up to `last_tag` to its queue.
async fn requeue_up_to(channel: &Channel, last_tag: Option<u64>) -> anyhow::Result<()> {
    if let Some(tag) = last_tag {
        channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await
            .context("cannot return the messages to the DLQ (closing the channel returns them)")?;
    }
    Ok(())
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What `dlq inspect` shows of one message.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    message_id: Option<String>,
    kind: Option<String>,
    reason: Option<String>,
    /// `x-retries` as written (absent: `None`).
    retries: Option<String>,
    /// The AMQP timestamp property (seconds since the epoch).
    timestamp: Option<u64>,
    bytes: usize,
    redelivered: bool,
}

impl Seen {
    fn of(m: &BasicGetMessage) -> Self {
        let p = &m.properties;
        let reason = headers::text(p, headers::X_ERROR_REASON).or_else(|| {
            headers::text(p, headers::X_ERROR_KIND)
                .is_none()
                .then(|| BrokerDeath::of(p).map(|d| d.describe()))
                .flatten()
        });
        Self {
            message_id: p.message_id().as_ref().map(|s| s.as_str().to_string()),
            kind: kind_of(p),
            reason,
            retries: headers::text(p, headers::X_RETRIES),
            timestamp: *p.timestamp(),
            bytes: m.data.len(),
            redelivered: m.redelivered,
        }
    }

    fn row(&self, now: u64) -> Vec<String> {
        let dash = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
        vec![
            dash(&self.message_id),
            dash(&self.kind),
            dash(&self.retries),
            age(now, self.timestamp),
            self.reason
                .as_deref()
                .map(|r| preview(r, 80))
                .unwrap_or_else(|| "-".into()),
        ]
    }

    fn json(&self, now: u64) -> serde_json::Value {
        // A number when it is one, the raw text when it is not (so nothing is hidden).
        let retries = match self.retries.as_deref() {
            None => serde_json::Value::Null,
            Some(raw) => raw
                .parse::<u64>()
                .map(|n| serde_json::json!(n))
                .unwrap_or_else(|_| serde_json::json!(raw)),
        };
        serde_json::json!({
            "message_id": self.message_id,
            "kind": self.kind,
            "reason": self.reason,
            "retries": retries,
            "timestamp": self.timestamp,
            "age_s": self.timestamp.map(|t| now.saturating_sub(t)),
            "bytes": self.bytes,
            "redelivered": self.redelivered,
        })
    }
}

async fn inspect(settings: &Settings, args: InspectArgs) -> anyhow::Result<i32> {
    let conn = broker(settings).await?;
    let result = inspect_on(&conn, settings, &args).await;
    // Closing the connection returns anything still unacked to the queue, whatever happened.
    amqp::close(None, Some(conn)).await;
    result
}

async fn inspect_on(
    conn: &Connection,
    settings: &Settings,
    args: &InspectArgs,
) -> anyhow::Result<i32> {
    let queue = settings.dlq_queue.as_str();
    let total = depth(conn, queue).await?;
    let channel = conn.create_channel().await?;
    let mut seen = Vec::new();
    let mut last_tag = None;
    let mut got = Ok(());
    while (seen.len() as u64) < args.limit && (seen.len() as u64) < u64::from(total) {
        // Not acked: each stays unacked on this channel (so it is not returned twice) until the
        // nack below puts them all back.
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
        {
            Ok(Some(m)) => {
                last_tag = Some(m.delivery_tag);
                seen.push(Seen::of(&m));
            }
            Ok(None) => break,
            Err(e) => {
                got = Err(anyhow::anyhow!("basic.get on {queue}: {e}"));
                break;
            }
        }
    }
    let released = requeue_up_to(&channel, last_tag).await;
    let _ = channel.close(200, "bye".into()).await;
    got?;
    released?;

    let now = now_s();
    if args.json {
        for s in &seen {
            println!(
                "{}",
                crate::cli::json_terminal_safe(&s.json(now).to_string())
            );
        }
        eprintln!(
            "dlq {queue}: {}, {} shown, all left in the queue",
            plural(u64::from(total), "message"),
            seen.len()
        );
    } else {
        println!(
            "dlq {queue}: {}, {} shown, all left in the queue",
            plural(u64::from(total), "message"),
            seen.len()
        );
        if !seen.is_empty() {
            let rows: Vec<Vec<String>> = seen.iter().map(|s| s.row(now)).collect();
            print!(
                "{}",
                table(&["MESSAGE ID", "KIND", "RETRIES", "AGE", "REASON"], &rows)
            );
        }
    }
    Ok(0)
}

/// Counts of a replay.
#[derive(Debug, Default)]
struct Tally {
    replayed: u64,
    skipped: u64,
    failed: u64,
    /// The first failure, for the report; a replay stops at it.
    failure: Option<String>,
}

async fn replay(settings: &Settings, args: ReplayArgs) -> anyhow::Result<i32> {
    let conn = broker(settings).await?;
    let result = replay_on(&conn, settings, &args).await;
    // Closing the connection returns anything still unacked to the DLQ, whatever happened.
    amqp::close(None, Some(conn)).await;
    let tally = result?;
    let filter = args
        .kind
        .as_deref()
        .map(|k| format!(" of kind {k}"))
        .unwrap_or_default();
    println!(
        "replayed {}{filter} from {} to {} (routing key {}); skipped {} (left in the DLQ); failed {}",
        plural(tally.replayed, "message"),
        settings.dlq_queue,
        settings.main_exchange,
        settings.main_queue,
        tally.skipped,
        tally.failed,
    );
    if let Some(failure) = tally.failure {
        eprintln!("warren dlq replay: stopped: {failure}");
        return Ok(1);
    }
    Ok(0)
}

async fn replay_on(
    conn: &Connection,
    settings: &Settings,
    args: &ReplayArgs,
) -> anyhow::Result<Tally> {
    let queue = settings.dlq_queue.as_str();
    let present = u64::from(depth(conn, queue).await?);
    let get = conn.create_channel().await?;
    let publish = conn.create_channel().await?;
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context("cannot put the publishing channel in confirm mode")?;
    let timeout = settings.publish_timeout();
    let frame_max = conn.configuration().frame_max();
    let mut tally = Tally::default();
    let mut seen = 0u64;
    // The highest delivery tag left unacked on `get` (skipped or failed): nacked with requeue
    // at the end, with `multiple`, so every one of them returns to the DLQ.
    let mut held: Option<u64> = None;
    while seen < present
        && args
            .limit
            .is_none_or(|limit| tally.replayed + tally.failed < limit)
    {
        let mut m = match get
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
        {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                tally.failure = Some(format!(
                    "basic.get on {queue}: {e} (unacked messages return to the DLQ)"
                ));
                break;
            }
        };
        seen += 1;
        if let Some(want) = &args.kind
            && kind_of(&m.properties).as_deref() != Some(want)
        {
            tally.skipped += 1;
            held = Some(m.delivery_tag);
            continue;
        }
        let id = m
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_else(|| format!("(no message id, delivery {})", m.delivery_tag));
        let msg = Publish {
            exchange: settings.main_exchange.clone(),
            routing_key: settings.main_queue.clone(),
            body: std::mem::take(&mut m.data).into(),
            properties: crate::amqp::republish::for_replay(&m.properties),
        };
        match publish_confirmed(&publish, msg, frame_max, timeout).await {
            Ok(()) => {
                let acked = match m.acker.ack(BasicAckOptions::default()).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err("the channel is closed".to_string()),
                    Err(e) => Err(e.to_string()),
                };
                tally.replayed += 1;
                if let Err(e) = acked {
                    // Republished but still in the DLQ: a later replay sends it again, which the
                    // idempotent insert makes harmless.
                    tally.failure = Some(format!(
                        "message {id} was republished but its DLQ copy could not be acked ({e}); \
                         replaying it again is harmless"
                    ));
                    break;
                }
            }
            Err(e) => {
                tally.failed += 1;
                held = Some(m.delivery_tag);
                tally.failure = Some(format!(
                    "message {id} was not republished and stays in the DLQ: {e}"
                ));
                break;
            }
        }
    }
    let released = requeue_up_to(&get, held).await;
    let _ = publish.close(200, "bye".into()).await;
    let _ = get.close(200, "bye".into()).await;
    if let Err(e) = released
        && tally.failure.is_none()
    {
        tally.failure = Some(format!("{e:#}"));
    }
    Ok(tally)
}

// ---------------------------------------------------------------------------------------------
// The parked messages: list and replay
// ---------------------------------------------------------------------------------------------

async fn database(settings: &Settings) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = db::pg_config(settings)?
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

fn sql_limit(limit: u64) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// One row of `dead_letters` as `parked list` shows it.
struct ParkedRow {
    seq: i64,
    message_id: Option<String>,
    kind: String,
    reason: String,
    /// `parked_at` in UTC, `YYYY-MM-DD HH:MM:SS`.
    parked_at: String,
    body: Vec<u8>,
}

impl ParkedRow {
    fn from_row(r: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            seq: r.try_get(0)?,
            message_id: r.try_get(1)?,
            kind: r.try_get(2)?,
            reason: r.try_get(3)?,
            parked_at: r.try_get(4)?,
            body: r.try_get(5)?,
        })
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "seq": self.seq,
            "message_id": self.message_id,
            "kind": self.kind,
            "reason": self.reason,
            "parked_at": format!("{}Z", self.parked_at.replace(' ', "T")),
            "body": String::from_utf8_lossy(&self.body),
        })
    }

    fn cells(&self) -> Vec<String> {
        vec![
            self.seq.to_string(),
            self.message_id
                .as_deref()
                .map(cell)
                .unwrap_or_else(|| "-".into()),
            cell(&self.kind),
            self.parked_at.clone(),
            preview(&self.reason, 50),
            preview(&String::from_utf8_lossy(&self.body), 50),
        ]
    }
}

async fn parked_list(settings: &Settings, args: ParkedListArgs) -> anyhow::Result<i32> {
    let client = database(settings).await?;
    let total: i64 = client
        .query_one(
            "SELECT count(*) FROM dead_letters \
             WHERE replayed_at IS NULL AND ($1::text IS NULL OR error_kind = $1) \
               AND pipeline = $2",
            &[&args.kind, &args.pipeline],
        )
        .await
        .and_then(|r| r.try_get(0))
        .map_err(|e| table_error(settings, e))?;
    let rows = client
        .query(
            "SELECT seq, message_id, error_kind, error_reason, \
                    to_char(parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'), body \
             FROM dead_letters \
             WHERE replayed_at IS NULL AND ($1::text IS NULL OR error_kind = $1) \
               AND pipeline = $3 \
             ORDER BY seq DESC LIMIT $2",
            &[&args.kind, &sql_limit(args.limit), &args.pipeline],
        )
        .await
        .and_then(|rows| {
            rows.iter()
                .map(ParkedRow::from_row)
                .collect::<Result<Vec<_>, _>>()
        })
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
            println!("{}", crate::cli::json_terminal_safe(&r.json().to_string()));
        }
        eprintln!("{summary}");
        return Ok(0);
    }
    println!("{summary}");
    if !rows.is_empty() {
        let cells: Vec<Vec<String>> = rows.iter().map(ParkedRow::cells).collect();
        let header = [
            "SEQ",
            "MESSAGE ID",
            "KIND",
            "PARKED AT (UTC)",
            "REASON",
            "BODY",
        ];
        print!("{}", table(&header, &cells));
    }
    Ok(0)
}

/// The AMQP headers of a replayed parked row, rebuilt from its `headers` column: strings become
/// long strings, integers long long ints, booleans booleans, anything else (floats, integers
/// beyond `i64`, null, arrays, objects) its JSON text; every `x-error-*` header and
/// `x-dlq-attempts` are left out and `x-retries` is 0. A JSON null column means no headers; a
/// column that is not an object, or a name longer than AMQP allows (255 bytes), is refused.
pub fn replay_headers(json: &serde_json::Value) -> Result<FieldTable, String> {
    let mut table = FieldTable::default();
    match json {
        serde_json::Value::Null => {}
        serde_json::Value::Object(map) => {
            for (name, value) in map {
                if name.starts_with("x-error-") || name == X_DLQ_ATTEMPTS {
                    continue;
                }
                let key = ShortString::try_new(name.as_str()).map_err(|_| {
                    format!(
                        "header name of {} bytes is longer than AMQP allows (255)",
                        name.len()
                    )
                })?;
                let value = match (value, value.as_i64()) {
                    (_, Some(n)) => AMQPValue::LongLongInt(n),
                    (serde_json::Value::String(s), _) => {
                        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
                    }
                    (serde_json::Value::Bool(b), _) => AMQPValue::Boolean(*b),
                    (other, _) => {
                        AMQPValue::LongString(LongString::from(other.to_string().into_bytes()))
                    }
                };
                table.insert(key, value);
            }
        }
        other => {
            return Err(format!(
                "headers must be a JSON object, got {}",
                preview(&other.to_string(), 40)
            ));
        }
    }
    table.insert(
        ShortString::from(headers::X_RETRIES),
        AMQPValue::LongLongInt(0),
    );
    Ok(table)
}

/// Properties of a replayed parked message: persistent JSON, the row's message id and the
/// headers of [`replay_headers`]. A message id longer than AMQP allows (255 bytes) cannot be
/// published.
fn parked_properties(
    message_id: Option<&str>,
    headers_json: &serde_json::Value,
) -> Result<BasicProperties, String> {
    let base = match message_id {
        Some(id) if ShortString::try_new(id).is_err() => {
            return Err(format!(
                "message_id of {} bytes is longer than AMQP allows (255)",
                id.len()
            ));
        }
        Some(id) => json_properties(id),
        None => BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_timestamp(now_s()),
    };
    // Through the republish policy like every copy warren publishes (`amqp::republish`).
    Ok(crate::amqp::republish::for_replay(
        &base.with_headers(replay_headers(headers_json)?),
    ))
}

async fn parked_replay(settings: &Settings, args: ParkedReplayArgs) -> anyhow::Result<i32> {
    let mut client = database(settings).await?;
    // Fails early, before the broker is touched, when the table is missing.
    client
        .query_one("SELECT count(*) FROM dead_letters WHERE false", &[])
        .await
        .map_err(|e| table_error(settings, e))?;
    let conn = broker(settings).await?;
    let result = parked_replay_on(&conn, &mut client, settings, &args).await;
    amqp::close(None, Some(conn)).await;
    let tally = result?;
    let filter = args
        .kind
        .as_deref()
        .map(|k| format!(" of kind {k}"))
        .unwrap_or_default();
    println!(
        "replayed {}{filter} to {} (routing key {}); failed {}",
        plural(tally.replayed, "parked message"),
        settings.main_exchange,
        settings.main_queue,
        tally.failed,
    );
    if let Some(failure) = tally.failure {
        eprintln!("warren dlq parked replay: {failure}");
        return Ok(1);
    }
    Ok(0)
}

/// One row selected for replay.
struct ReplayRow {
    seq: i64,
    message_id: Option<String>,
    body: Vec<u8>,
    headers: serde_json::Value,
}

impl ReplayRow {
    fn from_row(r: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            seq: r.try_get(0)?,
            message_id: r.try_get(1)?,
            body: r.try_get(2)?,
            headers: r.try_get(3)?,
        })
    }
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
        // The rows stay locked from before their publish until replayed_at is committed: two
        // replays never send the same row, and a re-park of a row (`ON CONFLICT .. DO UPDATE SET
        // replayed_at = NULL .. WHERE replayed_at IS NOT NULL`) waits for the commit and then
        // re-opens it instead of being overwritten by a late mark.
        let tx = client
            .transaction()
            .await
            .map_err(|e| table_error(settings, e))?;
        let rows = tx
            .query(
                "SELECT seq, message_id, body, headers FROM dead_letters \
                 WHERE replayed_at IS NULL AND seq > $1 AND ($2::text IS NULL OR error_kind = $2) \
                   AND pipeline = $4 \
                 ORDER BY seq LIMIT $3 FOR UPDATE SKIP LOCKED",
                &[&after, &args.kind, &sql_limit(budget), &args.pipeline],
            )
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(ReplayRow::from_row)
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(|e| table_error(settings, e))?;
        if rows.is_empty() {
            break;
        }
        let mut confirmed: Vec<i64> = Vec::with_capacity(rows.len());
        let mut stopped = false;
        for row in rows {
            after = row.seq;
            let properties = match parked_properties(row.message_id.as_deref(), &row.headers) {
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
                exchange: settings.main_exchange.clone(),
                routing_key: settings.main_queue.clone(),
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
            tx.execute(
                "UPDATE dead_letters SET replayed_at = now() WHERE seq = ANY($1)",
                &[&confirmed],
            )
            .await?;
            tx.commit().await
        }
        .await;
        tally.replayed += confirmed.len() as u64;
        if let Err(e) = marked {
            // Published but not marked: a later replay sends them again, which the idempotent
            // insert makes harmless.
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

// ---------------------------------------------------------------------------------------------
// Output helpers
// ---------------------------------------------------------------------------------------------

/// `1 message`, `2 messages`.
fn plural(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Time since `timestamp` as `42s`, `7m05s`, `3h12m`, `2d04h`; `-` without a timestamp.
fn age(now: u64, timestamp: Option<u64>) -> String {
    let Some(t) = timestamp else {
        return "-".into();
    };
    let s = now.saturating_sub(t);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

/// Text fit for one table cell: control characters become spaces.
fn cell(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// `cell(s)` cut to at most `max` characters, with `...` when cut.
fn preview(s: &str, max: usize) -> String {
    let clean = cell(s);
    if clean.chars().count() <= max {
        return clean;
    }
    let mut cut: String = clean.chars().take(max.saturating_sub(3)).collect();
    cut.push_str("...");
    cut
}

/// An aligned table (comfy-table, no borders): a header line, then the rows, two spaces
/// between columns, no trailing blanks.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_header(header.to_vec())
        .add_rows(rows.iter().cloned());
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    format!("{}\n", t.trim_fmt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn ages_are_short_and_a_missing_timestamp_is_a_dash() {
        assert_eq!(age(1000, None), "-");
        assert_eq!(age(1000, Some(958)), "42s");
        assert_eq!(age(1000, Some(2000)), "0s");
        assert_eq!(age(10_000, Some(10_000 - 425)), "7m05s");
        assert_eq!(age(100_000, Some(100_000 - 3 * 3600 - 12 * 60)), "3h12m");
        assert_eq!(
            age(1_000_000, Some(1_000_000 - 2 * 86400 - 4 * 3600)),
            "2d04h"
        );
    }

    #[test]
    fn previews_are_cut_on_characters_and_lose_control_characters() {
        assert_eq!(preview("a\nb", 10), "a b");
        assert_eq!(preview("ééééééé", 5), "éé...");
        assert_eq!(preview("abc", 3), "abc");
    }

    #[test]
    fn tables_are_aligned() {
        let t = table(
            &["A", "LONG", "C"],
            &[
                vec!["xyz".into(), "1".into(), "last".into()],
                vec!["é".into(), "22".into(), "-".into()],
            ],
        );
        assert_eq!(t, "A    LONG  C\nxyz  1     last\né    22    -\n");
        // Aligned by display width: a CJK character takes two terminal columns.
        let t = table(&["A", "B"], &[vec!["日本".into(), "x".into()]]);
        assert_eq!(t, "A     B\n日本  x\n");
    }

    #[test]
    fn limits_and_kinds_are_checked_by_the_parser() {
        let parse = |args: &[&str]| {
            let mut full = vec!["warren", "dlq"];
            full.extend_from_slice(args);
            crate::cli::Cli::try_parse_from(full)
        };
        assert!(parse(&["inspect"]).is_ok());
        assert!(parse(&["replay", "--kind", "invalid_json", "--limit", "5"]).is_ok());
        assert!(parse(&["parked", "list", "--kind", "db_permanent"]).is_ok());
        let err = parse(&["inspect", "--limit", "0"]).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let err = parse(&["replay", "--kind", "nope"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("retries_exhausted"), "{err}");
        assert!(parse(&["parked", "replay", "--limit", "-1"]).is_err());
    }

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
    }

    fn with(pairs: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in pairs {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    /// An `x-death` header as the broker writes it: the newest death first.
    fn x_death(reasons: &[&str]) -> AMQPValue {
        let entries = reasons
            .iter()
            .map(|r| {
                let mut t = FieldTable::default();
                t.insert("reason".into(), long(r));
                t.insert("queue".into(), long("raffle_queue"));
                t.insert("count".into(), AMQPValue::LongLongInt(1));
                AMQPValue::FieldTable(t)
            })
            .collect::<Vec<_>>();
        AMQPValue::FieldArray(entries.into())
    }

    #[test]
    fn broker_dead_letters_get_a_kind_from_the_newest_x_death_entry() {
        for (reason, kind) in BROKER_KINDS {
            let p = with(&[("x-death", x_death(&[reason, "expired"]))]);
            assert_eq!(kind_of(&p).as_deref(), Some(kind), "{reason}");
            assert!(KINDS.contains(&kind));
        }
        let p = with(&[("x-death", x_death(&["rejected"]))]);
        let death = BrokerDeath::of(&p).unwrap();
        assert_eq!(death.queue.as_deref(), Some("raffle_queue"));
        assert_eq!(
            death.describe(),
            "dead-lettered by the broker (rejected) in queue raffle_queue"
        );
        // warren's own kind wins over the broker's.
        let p = with(&[
            ("x-death", x_death(&["rejected"])),
            (headers::X_ERROR_KIND, long("db_permanent")),
        ]);
        assert_eq!(kind_of(&p).as_deref(), Some("db_permanent"));
        // Unknown reasons, empty arrays and malformed headers have no kind.
        for bad in [
            x_death(&["something_new"]),
            x_death(&[]),
            long("FieldArray([...])"),
            AMQPValue::FieldArray(vec![long("rejected")].into()),
        ] {
            let p = with(&[("x-death", bad.clone())]);
            assert_eq!(kind_of(&p), None, "{bad:?}");
        }
        assert_eq!(kind_of(&BasicProperties::default()), None);
        assert!(!KINDS.contains(&"unparkable"));
        assert!(KINDS.contains(&"id_conflict"));
    }

    #[test]
    fn replay_headers_convert_json_types_and_drop_the_error_headers() {
        let json = serde_json::json!({
            "trace": "abc",
            "n": 5,
            "neg": -7,
            "flag": true,
            "f": 1.5,
            "big": u64::MAX,
            "nothing": null,
            "list": [1, "a"],
            "obj": {"a": 1},
            "x-death": "FieldArray([...])",
            "x-retries": 3,
            "x-error-kind": "db_permanent",
            "x-error-reason": "boom",
            "x-dlq-attempts": 4,
        });
        let table = replay_headers(&json).unwrap();
        let mut want = FieldTable::default();
        want.insert("trace".into(), long("abc"));
        want.insert("n".into(), AMQPValue::LongLongInt(5));
        want.insert("neg".into(), AMQPValue::LongLongInt(-7));
        want.insert("flag".into(), AMQPValue::Boolean(true));
        want.insert("f".into(), long("1.5"));
        want.insert("big".into(), long("18446744073709551615"));
        want.insert("nothing".into(), long("null"));
        want.insert("list".into(), long(r#"[1,"a"]"#));
        want.insert("obj".into(), long(r#"{"a":1}"#));
        want.insert("x-death".into(), long("FieldArray([...])"));
        want.insert("x-retries".into(), AMQPValue::LongLongInt(0));
        assert_eq!(table, want);

        let mut only_retries = FieldTable::default();
        only_retries.insert("x-retries".into(), AMQPValue::LongLongInt(0));
        assert_eq!(
            replay_headers(&serde_json::json!({})).unwrap(),
            only_retries
        );
        assert_eq!(
            replay_headers(&serde_json::Value::Null).unwrap(),
            only_retries
        );
        let err = replay_headers(&serde_json::json!([1])).unwrap_err();
        assert!(err.contains("JSON object"), "{err}");
        let long_name = serde_json::json!({ "h".repeat(256): 1 });
        let err = replay_headers(&long_name).unwrap_err();
        assert!(err.contains("256 bytes"), "{err}");
    }

    #[test]
    fn parked_properties_are_persistent_json_with_zero_retries() {
        let none = serde_json::Value::Null;
        let p = parked_properties(Some("m1"), &none).unwrap();
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "m1");
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(headers::retries(&p), headers::Retries::Count(0));
        assert!(
            parked_properties(None, &none)
                .unwrap()
                .message_id()
                .is_none()
        );
        assert!(parked_properties(Some(&"x".repeat(300)), &none).is_err());
    }
}
