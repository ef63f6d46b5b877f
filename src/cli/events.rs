//! `warren events [--follow] [--pipeline P] [--type T] [--json] [--last N]`: the lifecycle
//! events of every instance sharing this `REDIS_PREFIX`, read from the Redis stream
//! `<prefix>:events` (docs/events.md). Without `--follow` it prints the newest `--last` entries
//! that pass the filters and exits; with it, it then waits for new ones (`XREAD BLOCK`) until
//! SIGINT or SIGTERM (exit 0), across quiet spells and lost links: a lost link is made again
//! (backon) and the follow resumes after the last entry it read, so nothing is printed twice or
//! skipped. Every string read from Redis is escaped before it reaches the terminal.

use std::io::Write as _;
use std::time::Duration;

use backon::Retryable as _;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamRangeReply, StreamReadOptions, StreamReadReply};
use serde_json::Value;

use crate::cli::out;
use crate::cli::{json_terminal_safe, terminal_safe as safe};
use crate::config::{Settings, redact_url};
use crate::events::{Kind, stream_key};
use crate::registry::{Redis, scrub};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep waiting for new events after the last ones, until SIGINT or SIGTERM (exit 0).
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
    /// How many of the newest events to print first, counted after the filters (1 to 100000).
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub last: u64,
}

/// How long one `XREAD` waits for new entries before asking again. Nothing new within it is no
/// error: the next read waits again.
const BLOCK_MS: usize = 5_000;

/// How long the link waits for any answer (an `XREAD` answers within [`BLOCK_MS`]): past it the
/// link is taken as lost (a half-open socket) and made again.
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(BLOCK_MS as u64 + 5_000);

/// How many entries one `XREVRANGE` reads, at least: `--last N` with filters reads backwards
/// page after page until N entries matched or the stream is exhausted.
const PAGE_MIN: u64 = 500;

/// How many entries one `XREVRANGE` reads, at the most.
const PAGE_MAX: u64 = 10_000;

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    // Listened for from the start: an interrupt while reading or reconnecting ends the follow.
    let stop = if args.follow {
        futures::future::Either::Left(super::run::signals())
    } else {
        futures::future::Either::Right(std::future::pending())
    };
    tokio::pin!(stop);
    let redis_config = settings.redis();
    let url = &redis_config.url;
    // Redis away is not "no instance": the events are read from it; say how to reach it.
    let mut conn = connect(url).await.map_err(|e| {
        anyhow::anyhow!(
            "{e}; `warren events` reads the events from Redis: {}",
            e.remedy()
        )
    })?;
    // `--pipeline`: one the configuration names, a live instance runs, or (a pipeline a reload
    // removed) the events name. Whether no instance runs it or the instances are unknown (Redis
    // lost since), the error says which, with what to do.
    let mut unknown = None;
    if let Some(name) = &args.pipeline {
        // Asked once: Redis lost since the connect above is said as such, never read as "no
        // instance runs it".
        let live = crate::registry::live(&redis_config).await;
        let known = crate::registry::record::known(settings.pipelines(), live.iter().flatten());
        if let Err(u) = crate::registry::record::find(&known, name) {
            unknown = Some(u.asked(&live));
        }
    }
    let key = stream_key(&redis_config.prefix);
    let failed = |e: redis::RedisError| {
        anyhow::anyhow!(
            "reading {key} from Redis at {}: {}",
            redact_url(url),
            scrub(&e.to_string(), url)
        )
    };
    let (lines, newest) = newest(&mut conn, &key, &args).await.map_err(failed)?;
    if let Some(unknown) = unknown
        && lines.is_empty()
    {
        anyhow::bail!("--pipeline: {}", safe(&unknown.to_string()));
    }
    // Printed oldest first.
    let mut out = out::stdout();
    for line in lines.iter().rev() {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    drop(out);
    if !args.follow {
        return Ok(0);
    }
    // Entries after the newest one read: an empty stream's first entry is after 0-0 (`$` would
    // skip what is appended before the first XREAD, or during an outage).
    let mut after = newest.unwrap_or_else(|| "0-0".to_string());
    // Whether the loss of the link was told (once per outage: until a read succeeds again).
    let mut told = false;
    loop {
        let options = StreamReadOptions::default().block(BLOCK_MS).count(1000);
        let (keys, ids) = ([key.as_str()], [after.as_str()]);
        let read: redis::RedisResult<Option<StreamReadReply>> = tokio::select! {
            read = redis::AsyncCommands::xread_options(&mut conn, &keys, &ids, &options) => read,
            () = &mut stop => return Ok(0),
        };
        match read {
            Ok(read) => {
                told = false;
                let mut out = out::stdout();
                for stream in read.map(|r| r.keys).unwrap_or_default() {
                    for entry in stream.ids {
                        if let Some(line) = render(&args, &entry.id, entry.map.get("event")) {
                            writeln!(out, "{line}")?;
                        }
                        after = entry.id;
                    }
                }
                out.flush()?;
            }
            Err(e) if lost(&e) => {
                if !told {
                    crate::cli::say(format_args!(
                        "the link to Redis at {} is lost ({}); reconnecting, the events after \
                         {} follow once it is back",
                        redact_url(url),
                        scrub(&e.to_string(), url),
                        safe(&after)
                    ));
                    told = true;
                }
                conn = tokio::select! {
                    conn = (|| connect(url)).retry(reconnect_backoff()) => {
                        conn.map_err(anyhow::Error::msg)?
                    }
                    () = &mut stop => return Ok(0),
                };
            }
            Err(e) => return Err(failed(e)),
        }
    }
}

/// A link to the Redis at `url` whose calls may wait for an `XREAD BLOCK` (the client's own
/// bound is half a second).
async fn connect(url: &str) -> Result<MultiplexedConnection, crate::registry::redis::ConnectError> {
    let mut conn = Redis::connect(url).await?;
    conn.set_response_timeout(RESPONSE_TIMEOUT);
    Ok(conn)
}

/// The delays between two attempts to reconnect (backon): 100 ms doubling up to 2 s, for
/// ever, so a Redis that is back is read from within seconds.
fn reconnect_backoff() -> backon::ExponentialBuilder {
    crate::amqp::backoff_builder(Duration::from_millis(100), Duration::from_secs(2))
}

/// Whether `e` means the link is gone (or hung), not that Redis refused the command: the
/// follow reconnects and goes on rather than ending.
fn lost(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_unrecoverable_error()
        || matches!(e.retry_method(), redis::RetryMethod::WaitAndRetry)
}

/// The newest `args.last` entries that pass the filters as the lines to print, newest first,
/// and the id of the newest entry of the stream (`None` when it is empty). Reads backwards a
/// page at a time, so the work is bounded by N without filters and by the stream's length
/// (`EVENTS_MAX_LEN`) with them.
async fn newest(
    conn: &mut MultiplexedConnection,
    key: &str,
    args: &Args,
) -> redis::RedisResult<(Vec<String>, Option<String>)> {
    let page = args.last.clamp(PAGE_MIN, PAGE_MAX);
    let mut lines = Vec::new();
    let mut newest = None;
    let mut end = "+".to_string();
    loop {
        let entries: StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(key)
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(page)
            .query_async(conn)
            .await?;
        let exhausted = (entries.ids.len() as u64) < page;
        for entry in entries.ids {
            newest.get_or_insert_with(|| entry.id.clone());
            if let Some(line) = render(args, &entry.id, entry.map.get("event")) {
                lines.push(line);
                if lines.len() as u64 >= args.last {
                    return Ok((lines, newest));
                }
            }
            // The next page starts below this entry (an exclusive bound).
            end = format!("({}", entry.id);
        }
        if exhausted {
            return Ok((lines, newest));
        }
    }
}

/// The line of an entry that is no event: shown as such without filters (with `--json` as an
/// object `{"id", "unreadable"}`, so the output stays one JSON object a line); with `--type` or
/// `--pipeline` it matches neither, so it is left out (and not counted by `--last`).
fn unreadable(args: &Args, id: &str, why: String) -> Option<String> {
    if args.pipeline.is_some() || !args.types.is_empty() {
        return None;
    }
    Some(if args.json {
        json_terminal_safe(&serde_json::json!({"id": id, "unreadable": why}).to_string())
    } else {
        format!("{}: {}", safe(id), safe(&why))
    })
}

/// The line of one stream entry if it passes the filters: its JSON object with `--json`, else
/// time, type, pipeline, host:pid and the type's own fields. An entry that is no event is shown
/// as such when nothing filters ([`unreadable`]).
fn render(args: &Args, id: &str, field: Option<&redis::Value>) -> Option<String> {
    let text = match field {
        Some(redis::Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        _ => return unreadable(args, id, "an entry without an event field".into()),
    };
    let Ok(Value::Object(event)) = serde_json::from_str::<Value>(&text) else {
        return unreadable(args, id, format!("not an event: {text}"));
    };
    let field = |name: &str| event.get(name).and_then(Value::as_str).unwrap_or("");
    // An event without a pipeline (instance-wide) matches no `--pipeline`, an empty one
    // included.
    if let Some(p) = &args.pipeline
        && event.get("pipeline").and_then(Value::as_str) != Some(p.as_str())
    {
        return None;
    }
    if !args.types.is_empty() && !args.types.iter().any(|t| t == field("type")) {
        return None;
    }
    if args.json {
        return Some(json_terminal_safe(&text));
    }
    let own: Vec<String> = event
        .iter()
        .filter(|(k, _)| !["v", "type", "time", "host", "pid", "pipeline"].contains(&k.as_str()))
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={}", safe(s)),
            other => format!("{k}={}", safe(&other.to_string())),
        })
        .collect();
    Some(format!(
        "{}  {:<15} {:<12} {}:{}  {}",
        safe(field("time")),
        safe(field("type")),
        safe(field("pipeline")),
        safe(field("host")),
        event.get("pid").map_or(String::new(), |p| p.to_string()),
        own.join(" ")
    ))
}
