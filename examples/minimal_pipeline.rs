//! Minimal pipeline for `scripts/bench.sh`: the least code that does warren's job, to measure
//! warren against. One task, no actors: a lapin consumer (prefetch 2000) decodes each
//! `{"id","name","email"}` body with serde_json, inserts every 1000 messages (or, with a partial
//! batch, once no message came for a short timeout: the queue is drained) with ONE
//! `INSERT .. SELECT * FROM UNNEST(..) ON CONFLICT DO NOTHING` through tokio-postgres, then sends
//! ONE `basic.ack multiple=true` for the batch. Stops after N messages and prints one line of
//! `key=value` figures: messages, drain seconds (first delivery to last ack), rate, rows
//! inserted, undecodable bodies, acks sent, batches, its own CPU time and peak RSS.
//!
//! `cargo run --release --example minimal_pipeline -- --queue QUEUE --count N --schema SCHEMA`

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(about = "Drain N user messages into <schema>.users: decode, batch insert, multi-ack")]
struct Args {
    /// Queue to drain.
    #[arg(long, env = "MAIN_QUEUE")]
    queue: String,
    /// Messages to drain; the pipeline stops once N are acked.
    #[arg(long)]
    count: u64,
    /// Schema holding the `users` table (created by `warren declare`).
    #[arg(long, env = "DATABASE_SCHEMA")]
    schema: String,
    /// Unacked deliveries the broker may have in flight (basic.qos).
    #[arg(long, default_value_t = 2000)]
    prefetch: u16,
    /// Messages per insert and ack.
    #[arg(long, default_value_t = 1000)]
    batch_size: usize,
    /// A partial batch is flushed once no message came for this long (the queue is drained).
    #[arg(long, default_value_t = 50)]
    batch_timeout_ms: u64,
    /// Give up when no delivery arrives for this long.
    #[arg(long, default_value_t = 30)]
    idle_timeout_s: u64,
}

/// The message body.
#[derive(serde::Deserialize)]
struct User {
    id: Uuid,
    name: String,
    email: String,
}

/// The columns of the batch being collected, as the UNNEST insert takes them.
#[derive(Default)]
struct Batch {
    ids: Vec<Uuid>,
    names: Vec<String>,
    emails: Vec<String>,
    /// Deliveries in the batch, decodable or not (all of them are acked with it).
    len: usize,
    /// The highest delivery tag of the batch: the one multi-ack settles them all.
    last_tag: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.count == 0 || args.batch_size == 0 {
        return Err("--count and --batch-size must be at least 1".into());
    }
    let (client, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("minimal_pipeline: database connection: {e}");
        }
    });
    let insert = client
        .prepare(&format!(
            "INSERT INTO {}.users (id, name, email) \
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[]) ON CONFLICT DO NOTHING",
            args.schema
        ))
        .await?;

    let conn = Connection::connect(&common::amqp_url(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await?;
    let mut consumer = channel
        .basic_consume(
            args.queue.as_str().into(),
            "minimal_pipeline".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let batch_timeout = Duration::from_millis(args.batch_timeout_ms);
    let idle = Duration::from_secs(args.idle_timeout_s);
    let mut batch = Batch::default();
    let (mut received, mut settled, mut inserted, mut invalid) = (0u64, 0u64, 0u64, 0u64);
    let (mut acks, mut batches) = (0u64, 0u64);
    let mut first: Option<Instant> = None;
    while settled < args.count {
        // With a partial batch, a pause of `batch_timeout` means the queue is drained: flush.
        let wait = if batch.len > 0 { batch_timeout } else { idle };
        let due = match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(delivery)) => {
                let delivery = delivery?;
                first.get_or_insert_with(Instant::now);
                received += 1;
                match serde_json::from_slice::<User>(&delivery.data) {
                    Ok(user) => {
                        batch.ids.push(user.id);
                        batch.names.push(user.name);
                        batch.emails.push(user.email);
                    }
                    Err(_) => invalid += 1,
                }
                batch.len += 1;
                batch.last_tag = delivery.delivery_tag;
                batch.len >= args.batch_size || received == args.count
            }
            Ok(None) => {
                return Err(format!("the consumer ended after {received} deliveries").into());
            }
            Err(_) if batch.len > 0 => true,
            Err(_) => {
                return Err(format!(
                    "only {received} of {} messages arrived (nothing for {} s)",
                    args.count, args.idle_timeout_s
                )
                .into());
            }
        };
        if !due {
            continue;
        }
        inserted += client
            .execute(&insert, &[&batch.ids, &batch.names, &batch.emails])
            .await?;
        channel
            .basic_ack(batch.last_tag, BasicAckOptions { multiple: true })
            .await?;
        acks += 1;
        batches += 1;
        settled += batch.len as u64;
        batch.ids.clear();
        batch.names.clear();
        batch.emails.clear();
        batch.len = 0;
    }
    let secs = first.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
    let _ = conn.close(200, "bye".into()).await;
    let usage = common::usage()?;
    println!(
        "minimal_pipeline messages={settled} secs={secs:.3} rate={:.0} inserted={inserted} invalid={invalid} acks={acks} batches={batches} cpu_us={} peak_rss_kb={}",
        settled as f64 / secs.max(1e-9),
        usage.cpu.as_micros(),
        usage.peak_rss_kb
    );
    Ok(())
}
