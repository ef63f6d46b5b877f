//! `warren events [--follow] [--pipeline P] [--type T] [--json] [--last N]`: the lifecycle
//! events of every instance sharing this `REDIS_PREFIX`, read from the Redis stream
//! `<prefix>:events` (docs/events.md). Without `--follow` it prints the last `--last` entries
//! and exits; with it, it then waits for new ones (`XREAD BLOCK`) until interrupted. Every
//! string read from Redis is escaped before it reaches the terminal.

use std::io::Write as _;

use redis::streams::{StreamRangeReply, StreamReadOptions, StreamReadReply};
use serde_json::Value;

use crate::cli::{json_terminal_safe, terminal_safe as safe};
use crate::config::{Settings, redact_url};
use crate::events::{Kind, stream_key};
use crate::registry::{Redis, scrub};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep waiting for new events after the last ones, until interrupted.
    #[arg(long, short)]
    pub follow: bool,
    /// Only events about this pipeline (instance-wide events, which name none, are left out).
    #[arg(long, value_name = "NAME")]
    pub pipeline: Option<String>,
    /// Only events of this type (repeatable): started, ready, paused, ..., error.
    #[arg(long = "type", value_name = "TYPE", value_parser = clap::builder::PossibleValuesParser::new(Kind::NAMES))]
    pub types: Vec<String>,
    /// Print each event as its JSON object, one per line.
    #[arg(long)]
    pub json: bool,
    /// How many of the newest entries to read first (1 to 100000).
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub last: u64,
}

/// How long one `XREAD` waits for new entries before asking again (so an interrupt is noticed).
const BLOCK_MS: usize = 5_000;

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let url = &settings.redis_url;
    let mut conn = Redis::connect(url).await.map_err(anyhow::Error::msg)?;
    // `--pipeline`: one the configuration names or a live instance runs.
    if let Some(name) = &args.pipeline {
        let known = crate::registry::known_pipelines(settings).await;
        if let Err(unknown) = crate::registry::record::find(&known, name) {
            anyhow::bail!("--pipeline: {}", safe(&unknown.to_string()));
        }
    }
    let key = stream_key(&settings.redis_prefix);
    let failed = |e: redis::RedisError| {
        anyhow::anyhow!(
            "reading {key} from Redis at {}: {}",
            redact_url(url),
            scrub(&e.to_string(), url)
        )
    };
    // The newest `last` entries, printed oldest first.
    let newest: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(&key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(args.last)
        .query_async(&mut conn)
        .await
        .map_err(failed)?;
    let mut after = newest
        .ids
        .first()
        .map_or_else(|| "$".to_string(), |e| e.id.clone());
    let mut out = std::io::stdout().lock();
    for entry in newest.ids.iter().rev() {
        print_entry(&mut out, &args, &entry.id, entry.map.get("event"))?;
    }
    out.flush()?;
    drop(out);
    if !args.follow {
        return Ok(0);
    }
    loop {
        let options = StreamReadOptions::default().block(BLOCK_MS).count(1000);
        let (keys, ids) = ([key.as_str()], [after.as_str()]);
        let read: Option<StreamReadReply> = tokio::select! {
            read = redis::AsyncCommands::xread_options(&mut conn, &keys, &ids, &options) => {
                read.map_err(failed)?
            }
            _ = tokio::signal::ctrl_c() => return Ok(0),
        };
        let mut out = std::io::stdout().lock();
        for stream in read.map(|r| r.keys).unwrap_or_default() {
            for entry in stream.ids {
                print_entry(&mut out, &args, &entry.id, entry.map.get("event"))?;
                after = entry.id;
            }
        }
        out.flush()?;
    }
}

/// Prints one stream entry if it passes the filters: its JSON object with `--json`, else one
/// line: time, type, pipeline, host:pid and the type's own fields.
fn print_entry(
    out: &mut impl std::io::Write,
    args: &Args,
    id: &str,
    field: Option<&redis::Value>,
) -> std::io::Result<()> {
    let text = match field {
        Some(redis::Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        _ => return writeln!(out, "{}: an entry without an event field", safe(id)),
    };
    let Ok(Value::Object(event)) = serde_json::from_str::<Value>(&text) else {
        return writeln!(out, "{}: not an event: {}", safe(id), safe(&text));
    };
    let field = |name: &str| event.get(name).and_then(Value::as_str).unwrap_or("");
    if let Some(p) = &args.pipeline
        && field("pipeline") != p
    {
        return Ok(());
    }
    if !args.types.is_empty() && !args.types.iter().any(|t| t == field("type")) {
        return Ok(());
    }
    if args.json {
        return writeln!(out, "{}", json_terminal_safe(&text));
    }
    let own: Vec<String> = event
        .iter()
        .filter(|(k, _)| !["v", "type", "time", "host", "pid", "pipeline"].contains(&k.as_str()))
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={}", safe(s)),
            other => format!("{k}={}", safe(&other.to_string())),
        })
        .collect();
    writeln!(
        out,
        "{}  {:<15} {:<12} {}:{}  {}",
        safe(field("time")),
        safe(field("type")),
        safe(field("pipeline")),
        safe(field("host")),
        event.get("pid").map_or(String::new(), |p| p.to_string()),
        own.join(" ")
    )
}
