//! Broker baseline for `scripts/bench.sh`: drains N messages from a queue with a minimal lapin
//! consumer (prefetch 2000, one multi-ack per 1000 deliveries, no database) and prints the rate,
//! i.e. what the broker itself delivers on this machine.
//!
//! `cargo run --release --example broker_baseline -- QUEUE N`

use std::time::Instant;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let queue = args.next().ok_or("usage: broker_baseline QUEUE N")?;
    let n: u64 = args
        .next()
        .ok_or("usage: broker_baseline QUEUE N")?
        .parse()?;
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "baseline".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut seen = 0u64;
    let mut started = None;
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        started.get_or_insert_with(Instant::now);
        seen += 1;
        if seen.is_multiple_of(1000) || seen == n {
            channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
        }
        if seen == n {
            break;
        }
    }
    let secs = started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
    println!(
        "broker baseline: {seen} messages in {secs:.2} s: {:.0} msg/s",
        seen as f64 / secs.max(1e-9)
    );
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}
