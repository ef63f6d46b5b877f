//! Raw drain for `scripts/bench.sh`: what the broker alone delivers on this machine. A bare
//! lapin consumer drains N messages (prefetch 5000, one `basic.ack multiple=true` per 100
//! deliveries; no decoding, no database) and prints one line of `key=value` figures: messages,
//! drain seconds by its own clock (from its start to its last ack; `scripts/bench.sh` times
//! every contender itself, from the broker), rate, acks sent, batches (groups of deliveries one
//! ack settles), its own CPU time and peak RSS.
//!
//! `cargo run --release --example raw_drain -- --queue QUEUE --count N`

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use lapin::options::BasicAckOptions;

#[derive(Debug, Parser)]
#[command(about = "Drain N messages with a bare lapin consumer (no database) and print the rate")]
struct Args {
    /// Queue to drain.
    #[arg(long, env = "MAIN_QUEUE")]
    queue: String,
    /// Messages to drain; the drain ends at the N-th delivery.
    #[arg(long)]
    count: u64,
    /// Unacked deliveries the broker may have in flight (basic.qos).
    #[arg(long, default_value_t = 5000)]
    prefetch: u16,
    /// One `basic.ack multiple=true` per this many deliveries (and one for the last).
    #[arg(long, default_value_t = 100)]
    ack_every: u64,
    /// Give up when no delivery arrives for this long.
    #[arg(long, default_value_t = 30)]
    idle_timeout_s: u64,
}

// One task does everything and lapin has its own I/O thread: no worker threads needed.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let args = Args::parse();
    if args.count == 0 || args.ack_every == 0 {
        return Err("--count and --ack-every must be at least 1".into());
    }
    let (conn, channel, mut consumer) =
        common::subscribe(&args.queue, args.prefetch, "raw_drain").await?;
    let idle = Duration::from_secs(args.idle_timeout_s);
    let (mut seen, mut acks) = (0u64, 0u64);
    while seen < args.count {
        let delivery = match tokio::time::timeout(idle, consumer.next()).await {
            Ok(Some(delivery)) => delivery?,
            Ok(None) => return Err(format!("the consumer ended after {seen} deliveries").into()),
            Err(_) => {
                return Err(format!(
                    "only {seen} of {} messages arrived (nothing for {} s)",
                    args.count, args.idle_timeout_s
                )
                .into());
            }
        };
        seen += 1;
        if seen.is_multiple_of(args.ack_every) || seen == args.count {
            channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
            acks += 1;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = conn.close(200, "bye".into()).await;
    let usage = common::usage()?;
    println!(
        "raw_drain messages={seen} secs={secs:.3} rate={:.0} acks={acks} batches={} cpu_us={} peak_rss_kb={}",
        seen as f64 / secs.max(1e-9),
        seen.div_ceil(args.ack_every),
        usage.cpu.as_micros(),
        usage.peak_rss_kb
    );
    Ok(())
}
