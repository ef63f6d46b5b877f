//! Minimal pipeline for `scripts/bench.sh`: the least code that does warren's job, to measure
//! warren against. One task, no actors: a lapin consumer (prefetch 2000) decodes each
//! `{"id","name","email"}` body with serde_json, inserts every 1000 messages (or, with a partial
//! batch, once no message came for a short timeout: the queue is drained) with ONE
//! `INSERT .. SELECT * FROM UNNEST(..) ON CONFLICT DO NOTHING` through tokio-postgres, then sends
//! ONE `basic.ack multiple=true` for the batch; one insert in flight. Stops after N messages and
//! prints one line of `key=value` figures: messages, drain seconds by its own clock (from its
//! start to its last ack; `scripts/bench.sh` times it itself, from the broker), rate, rows
//! inserted, undecodable bodies, acks sent, batches, its own CPU time and peak RSS.
//! `tuned_pipeline.rs` is the same job done with care.
//!
//! `cargo run --release --example minimal_pipeline -- --queue QUEUE --count N --schema SCHEMA`

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use common::users::{self, Batch, Drained};
use futures::StreamExt;
use lapin::options::BasicAckOptions;

#[derive(Debug, Parser)]
#[command(about = "Drain N user messages into <schema>.users: decode, batch insert, multi-ack")]
struct Args {
    #[command(flatten)]
    drain: users::Drain,
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

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let args = Args::parse();
    if args.drain.count == 0 || args.batch_size == 0 {
        return Err("--count and --batch-size must be at least 1".into());
    }
    let client = users::connect("minimal_pipeline").await?;
    let insert = client
        .prepare(&users::unnest_insert(
            &args.drain.schema,
            " ON CONFLICT DO NOTHING",
        ))
        .await?;

    let (conn, channel, mut consumer) =
        common::subscribe(&args.drain.queue, args.prefetch, "minimal_pipeline").await?;

    let batch_timeout = Duration::from_millis(args.batch_timeout_ms);
    let idle = Duration::from_secs(args.idle_timeout_s);
    let mut batch = Batch::default();
    let mut received = 0u64;
    let mut d = Drained::default();
    while d.settled < args.drain.count {
        // With a partial batch, a pause of `batch_timeout` means the queue is drained: flush.
        let wait = if batch.len > 0 { batch_timeout } else { idle };
        let due = match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(delivery)) => {
                let delivery = delivery?;
                received += 1;
                batch.push(delivery.delivery_tag, &delivery.data);
                batch.len >= args.batch_size || received == args.drain.count
            }
            Ok(None) => {
                return Err(format!("the consumer ended after {received} deliveries").into());
            }
            Err(_) if batch.len > 0 => true,
            Err(_) => {
                return Err(format!(
                    "only {received} of {} messages arrived (nothing for {} s)",
                    args.drain.count, args.idle_timeout_s
                )
                .into());
            }
        };
        if !due {
            continue;
        }
        d.inserted += client
            .execute(&insert, &[&batch.ids, &batch.names, &batch.emails])
            .await?;
        channel
            .basic_ack(batch.last_tag, BasicAckOptions { multiple: true })
            .await?;
        d.acks += 1;
        d.batches += 1;
        d.settled += batch.len as u64;
        d.invalid += batch.invalid as u64;
        batch.clear();
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = conn.close(200, "bye".into()).await;
    users::report("minimal_pipeline", secs, &d)?;
    Ok(())
}
