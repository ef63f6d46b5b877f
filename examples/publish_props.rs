//! Publisher for `scripts/bench.sh --props`: publishes N users (the ~100-byte JSON `warren
//! publish` sends) as persistent JSON with a chosen set of the properties warren's publisher
//! can set, so the bench can tell what each costs the broker to take in and to deliver.
//! Publisher confirms are awaited by a second task, at most 10,000 outstanding.
//!
//! `--props` is a comma-separated list of: `id` (message id, the hyphenated UUID), `id:N` (a
//! message id of N characters: the UUID's hex digits, repeated past 32; `id:32` is the UUID
//! without hyphens), `no_content_type` (without the content type), `timestamp` (the AMQP
//! timestamp, seconds), `published_ms` (the `x-published-ms` header table), `traceparent` (a W3C
//! traceparent header); `bare` for none of them (content type and delivery mode only).
//!
//! `cargo run --release --example publish_props -- --count 200000 --props id,timestamp`

mod common;

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, PublisherConfirm};
use tokio::sync::mpsc;
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(about = "Publish N users with a chosen set of AMQP properties")]
struct Args {
    /// Exchange to publish to.
    #[arg(long, env = "MAIN_EXCHANGE")]
    exchange: String,
    /// Routing key (the queue's name, as warren binds it).
    #[arg(long, env = "MAIN_QUEUE")]
    queue: String,
    /// How many messages.
    #[arg(long)]
    count: usize,
    /// Properties beyond content type and delivery mode: bare, or a list of id, id:N,
    /// no_content_type, timestamp, published_ms, traceparent.
    #[arg(long, default_value = "bare")]
    props: String,
}

#[derive(Default)]
struct Props {
    id: bool,
    id_len: Option<usize>,
    no_content_type: bool,
    timestamp: bool,
    published_ms: bool,
    traceparent: bool,
}

fn parse_props(list: &str) -> Result<Props, String> {
    let mut p = Props::default();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match name {
            "bare" => {}
            "id" => p.id = true,
            "no_content_type" => p.no_content_type = true,
            other if other.starts_with("id:") => {
                let n = other[3..]
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=255).contains(n));
                p.id_len = Some(n.ok_or_else(|| {
                    format!(
                        "--props: '{other}': id:N needs N from 1 to 255 (the message id's length)"
                    )
                })?);
            }
            "timestamp" => p.timestamp = true,
            "published_ms" => p.published_ms = true,
            "traceparent" => p.traceparent = true,
            other => {
                return Err(format!(
                    "--props: unknown property '{other}'; expected bare or a list of id, id:N, no_content_type, timestamp, published_ms, traceparent"
                ));
            }
        }
    }
    Ok(p)
}

fn properties(p: &Props, id: &Uuid) -> BasicProperties {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if !p.no_content_type {
        props = props.with_content_type("application/json".into());
    }
    if p.id {
        props = props.with_message_id(id.to_string().into());
    }
    if let Some(n) = p.id_len {
        let hex = id.simple().to_string().repeat(8);
        props = props.with_message_id(hex[..n].into());
    }
    if p.timestamp {
        props = props.with_timestamp(now.as_secs());
    }
    if p.published_ms || p.traceparent {
        let mut headers = FieldTable::default();
        if p.published_ms {
            headers.insert(
                "x-published-ms".into(),
                AMQPValue::LongLongInt(now.as_millis() as i64),
            );
        }
        if p.traceparent {
            headers.insert(
                "traceparent".into(),
                AMQPValue::LongString(
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                        .as_bytes()
                        .to_vec()
                        .into(),
                ),
            );
        }
        props = props.with_headers(headers);
    }
    props
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let props = parse_props(&args.props)?;
    let conn = Connection::connect(&common::amqp_url(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let (confirm_tx, mut confirm_rx) = mpsc::channel::<PublisherConfirm>(10_000);
    let confirmer = tokio::spawn(async move {
        let mut failed = 0usize;
        while let Some(confirm) = confirm_rx.recv().await {
            if !matches!(confirm.await, Ok(Confirmation::Ack(None))) {
                failed += 1;
            }
        }
        failed
    });
    let started = Instant::now();
    for i in 0..args.count {
        let id = Uuid::new_v4();
        let body = format!(r#"{{"id":"{id}","name":"user {i}","email":"user-{id}@example.com"}}"#);
        let confirm = channel
            .basic_publish(
                args.exchange.as_str().into(),
                args.queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                properties(&props, &id),
            )
            .await?;
        confirm_tx.send(confirm).await?;
    }
    drop(confirm_tx);
    let failed = confirmer.await?;
    let secs = started.elapsed().as_secs_f64();
    let _ = conn.close(200, "bye".into()).await;
    if failed > 0 {
        return Err(format!("{failed} of {} messages were not confirmed", args.count).into());
    }
    let usage = common::usage()?;
    println!(
        "published {} messages in {secs:.2} s ({}; publisher CPU {:.2} s, peak RSS {} KiB): {:.0} msg/s",
        args.count,
        args.props,
        usage.cpu.as_secs_f64(),
        usage.peak_rss_kb,
        args.count as f64 / secs.max(1e-9)
    );
    Ok(())
}
