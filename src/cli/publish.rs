//! `warren publish`: a load generator (`--count N [--rate R] [--invalid-every K]`) and a JSON
//! lines publisher (`--stdin`, `--file PATH`; `--pipeline NAME` for any pipeline's exchange),
//! both with publisher confirms and pipelined publishes.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use actix::{Actor, Addr};
use anyhow::bail;
use futures::StreamExt;
use lapin::types::ShortString;
use tokio::io::AsyncBufReadExt;
use uuid::Uuid;

use crate::amqp::headers;
use crate::amqp::publisher::{Close, IsConnected, Publish, Publisher, json_properties};
use crate::cli::out::{self, errln, outln};
use crate::config::{Settings, redact_url};
use crate::domain::mapping::Mapping;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How many users to generate and publish.
    #[arg(long, default_value_t = 1000, conflicts_with = "stdin")]
    pub count: u64,
    /// Publish at most this many messages per second (default: as fast as confirms allow).
    #[arg(long, value_name = "MSG_PER_S")]
    pub rate: Option<f64>,
    /// Make every K-th message invalid (alternately not JSON and failing validation).
    #[arg(long, value_name = "K")]
    pub invalid_every: Option<u64>,
    /// Publish one JSON object per line of standard input instead of generating users. Every
    /// line whose publish is not confirmed is named on standard error (line number and id), so
    /// exactly those can be sent again.
    #[arg(long)]
    pub stdin: bool,
    /// Publish JSON lines (standard input, or --file) to pipeline NAME's exchange with its
    /// routing key, instead of users. Each message's id is the line's key when the pipeline's
    /// key is one column read from a top-level field (`"order_id"`) and fits an AMQP message id
    /// (255 bytes), else a new UUID.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["count", "invalid_every"])]
    pub pipeline: Option<String>,
    /// Read the JSON lines from this file instead of standard input.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["count", "invalid_every", "stdin"])]
    pub file: Option<PathBuf>,
    /// Publishes awaiting their confirm at once.
    #[arg(long, default_value_t = 512)]
    pub in_flight: usize,
}

/// A generated message: a valid user, or every K-th an invalid one.
fn generated(i: u64, invalid_every: Option<u64>) -> (String, Vec<u8>) {
    let id = Uuid::new_v4().to_string();
    let invalid = invalid_every.is_some_and(|k| k > 0 && (i + 1).is_multiple_of(k));
    let body = if invalid && (i / invalid_every.unwrap_or(1)).is_multiple_of(2) {
        format!("not json {i}").into_bytes()
    } else if invalid {
        format!(r#"{{"id":"{id}","name":"","email":"not-an-email"}}"#).into_bytes()
    } else {
        format!(r#"{{"id":"{id}","name":"user {i}","email":"user-{id}@example.com"}}"#).into_bytes()
    };
    (id, body)
}

async fn connected_publisher(settings: &Settings) -> anyhow::Result<Addr<Publisher>> {
    let amqp = settings.amqp();
    let publisher = Publisher::new(
        amqp.clone(),
        "cli",
        crate::amqp::Frames::Small,
        crate::events::publisher_link,
    )
    .start();
    let deadline = Instant::now() + amqp.connect_timeout() + Duration::from_secs(1);
    while Instant::now() < deadline {
        if publisher.send(IsConnected).await.unwrap_or(false) {
            return Ok(publisher);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!(
        "cannot reach the broker at {}",
        redact_url(&settings.amqp_url)
    )
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    if args.rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
        return Err(super::Usage(
            "--rate: expected a number of messages per second above 0".into(),
        )
        .into());
    }
    if args.in_flight == 0 {
        bail!("--in-flight: expected at least 1");
    }
    // What is published goes to the pipeline's exchange and queue as resolved: users unless
    // --pipeline names another.
    let name = args.pipeline.as_deref().unwrap_or("users");
    let pipeline = match settings.pipeline(name) {
        Some(p) => p,
        None if args.pipeline.is_none() => bail!("this configuration runs no users pipeline"),
        None => {
            return Err(super::Usage(format!("--pipeline: {}", settings.no_pipeline(name))).into());
        }
    };
    let id_field = id_field(&pipeline.mapping()?);
    let input: Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>> = match &args.file {
        Some(path) => Some(Box::new(tokio::fs::File::open(path).await.map_err(
            |e| anyhow::anyhow!("--file: cannot read {}: {e}", path.display()),
        )?)),
        None if args.stdin || args.pipeline.is_some() => Some(Box::new(tokio::io::stdin())),
        None => None,
    };
    let exchange = pipeline.names.main_exchange.clone();
    let routing_key = pipeline.names.main_queue.clone();
    let publisher = connected_publisher(settings).await?;
    let latency_header = settings.publish_latency_header;
    let make = |id: ShortString, body: Vec<u8>| Publish {
        exchange: exchange.clone(),
        routing_key: routing_key.clone(),
        properties: json_properties(id, latency_header),
        body: body.into(),
    };
    let started = Instant::now();
    let mut failed = 0u64;
    let mut published = 0u64;
    let mut first_error: Option<String> = None;

    // (input line for --stdin, message id, body)
    let messages: futures::stream::BoxStream<'_, (Option<u64>, ShortString, Vec<u8>)> =
        if let Some(input) = input {
            let lines = stream_lines(input);
            let id_field = &id_field;
            lines
                .filter_map(move |(n, line)| async move {
                    match serde_json::from_str::<serde_json::Value>(&line) {
                        Ok(serde_json::Value::Object(o)) => {
                            let id = match id_field.as_deref().and_then(|f| o.get(f)) {
                                Some(serde_json::Value::String(s)) => s.clone(),
                                Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                                    n.to_string()
                                }
                                _ => Uuid::new_v4().to_string(),
                            };
                            // A key too long for a message id is no reason to leave the message
                            // out (the body is sent unchecked): it gets a new id, and the line says so.
                            let id = headers::short(id).unwrap_or_else(|e| {
                            let fresh = Uuid::new_v4().to_string();
                            errln!(
                                "warren publish: line {n}: {:?}: {e} (an AMQP message id), sent \
                                 with message id {fresh}",
                                super::terminal_safe(id_field.as_deref().unwrap_or_default())
                            );
                            // A UUID: 36 bytes, always a short string.
                            headers::short(fresh).unwrap_or_default()
                        });
                            Some((Some(n), id, line.into_bytes()))
                        }
                        Ok(_) => {
                            errln!("warren publish: line {n}: expected a JSON object, skipped");
                            None
                        }
                        Err(e) => {
                            errln!("warren publish: line {n}: not JSON ({e}), skipped");
                            None
                        }
                    }
                })
                .boxed()
        } else {
            let invalid_every = args.invalid_every;
            futures::stream::iter(0..args.count)
                .map(move |i| {
                    let (id, body) = generated(i, invalid_every);
                    // A UUID: 36 bytes, always a short string.
                    (None, headers::short(id).unwrap_or_default(), body)
                })
                .boxed()
        };
    // `--rate`, for generated messages and `--stdin` lines alike: the i-th is sent no earlier
    // than i / rate seconds after the start.
    let messages = match args.rate {
        Some(rate) => messages
            .enumerate()
            .then(move |(i, message)| async move {
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(due.into()).await;
                message
            })
            .boxed(),
        None => messages,
    };

    let mut results = messages
        .map(|(line, id, body)| {
            let sent = publisher.send(make(id.clone(), body));
            async move { (line, id, sent.await) }
        })
        .buffer_unordered(args.in_flight);
    while let Some((line, id, result)) = results.next().await {
        let error = match result {
            Ok(Ok(())) => {
                published += 1;
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        failed += 1;
        if let Some(n) = line {
            errln!("warren publish: {}", not_confirmed(n, id.as_str(), &error));
        }
        first_error.get_or_insert(error);
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = publisher.send(Close).await;
    // A closed stdout loses the report, never the exit code of a failure.
    out::unless_closed(outln!(
        "published {published} messages in {secs:.2} s ({:.0} msg/s), {failed} failed",
        published as f64 / secs.max(1e-9)
    ))?;
    if let Some(e) = first_error {
        errln!("warren publish: first failure: {e}");
        return Ok(1);
    }
    Ok(0)
}

/// The report of one `--stdin` line whose publish was not confirmed: it may or may not have
/// reached the queue, so it is to be sent again (the same id is harmless: one row).
fn not_confirmed(line: u64, id: &str, error: &str) -> String {
    format!("line {line} (id {id}) not confirmed: {error}")
}

/// The top-level field a line's message id is read from: the key's, when the pipeline's key is
/// one column read from a top-level field (`id` for users, `order_id`); else none, and each
/// line gets a new UUID (review R41b F6: a two-column key's lines took the field `id`, so the
/// messages of two rows shared one message id).
fn id_field(mapping: &Mapping) -> Option<String> {
    match mapping.key().as_slice() {
        [k] => mapping.field_of(k).map(str::to_string),
        _ => None,
    }
}

/// `input` (standard input or a file) as numbered, non-empty lines. A line that is not UTF-8 is
/// named and skipped like a line that is not JSON, and the lines after it are read (found by
/// the review: it ended the input there, with exit 0 and the rest unpublished).
fn stream_lines(
    input: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
) -> futures::stream::BoxStream<'static, (u64, String)> {
    let reader = tokio::io::BufReader::new(input);
    futures::stream::unfold(
        (reader.split(b'\n'), 0u64),
        |(mut lines, mut n)| async move {
            loop {
                match lines.next_segment().await {
                    Ok(Some(bytes)) => {
                        n += 1;
                        match String::from_utf8(bytes) {
                            Ok(line) if line.trim().is_empty() => continue,
                            Ok(line) => return Some(((n, line), (lines, n))),
                            Err(_) => {
                                let _ = writeln!(
                                    std::io::stderr(),
                                    "warren publish: line {n}: not UTF-8, skipped"
                                );
                                continue;
                            }
                        }
                    }
                    Ok(None) => return None,
                    Err(e) => {
                        let _ = writeln!(
                            std::io::stderr(),
                            "warren publish: cannot read the input: {e}"
                        );
                        return None;
                    }
                }
            }
        },
    )
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Domain;

    #[test]
    fn a_line_not_confirmed_is_named_by_number_and_id() {
        assert_eq!(
            not_confirmed(7, "u-7", "broker unavailable: no connection to the broker"),
            "line 7 (id u-7) not confirmed: broker unavailable: no connection to the broker"
        );
    }

    #[test]
    fn every_kth_generated_message_is_invalid() {
        let users = crate::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles");
        let mut invalid = 0;
        for i in 0..100 {
            let (_, body) = generated(i, Some(10));
            if users.decode(&body).is_err() {
                invalid += 1;
            }
        }
        assert_eq!(invalid, 10);
        assert!(users.decode(&generated(0, None).1).is_ok());
    }

    /// Review R41b F6: the message id is a one-column key's top-level field; a key of two
    /// columns, or one not read from a top-level field, gives each line a new UUID.
    #[test]
    fn the_message_id_is_read_from_a_one_column_top_level_key_only() {
        let compile = |key: &str, id: &str| {
            let spec: crate::domain::mapping::MappingSpec = toml::from_str(&format!(
                "table = \"t\"\nkey = {key}\n[columns]\nid = {id}\n\
                 region = {{ path = \"/region\", type = \"text\" }}\n"
            ))
            .expect("spec");
            Mapping::compile("t", &spec).expect("compiles")
        };
        let top = r#"{ path = "/id", type = "text" }"#;
        assert_eq!(id_field(&compile(r#"["id"]"#, top)).as_deref(), Some("id"));
        assert_eq!(id_field(&compile(r#"["id", "region"]"#, top)), None);
        let nested = r#"{ path = "/a/id", type = "text" }"#;
        assert_eq!(id_field(&compile(r#"["id"]"#, nested)), None);
    }
}
