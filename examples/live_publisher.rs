//! Live publisher for `scripts/bench.sh --live`: publishes users at a fixed rate while warren
//! consumes, then measures each message's end-to-end latency from the database. Pacing is per
//! slice (every 10 ms it publishes what the rate says is due), publishes are pipelined with
//! publisher confirms awaited by a second task; each message is a user JSON with a fresh UUID,
//! the AMQP timestamp (seconds) and the `x-published-ms` header (i64, Unix ms: the header warren's
//! own publisher sets). Every second a passive `queue.declare` on a separate channel samples the
//! queue depth. When publishing is done it waits until every confirmed id is in
//! `<schema>.users`, then prints: messages, achieved rate, max queue depth against a bound,
//! p50/p90/p99/max of `inserted_at - x-published-ms` in ms with the p99 target, and the verdict
//! `kept up: yes|no (why)`: yes only when the p99 met the target, every confirmed message
//! arrived, the queue stayed within the bound and the publisher reached the rate asked. Exit 1
//! if messages never arrived.
//!
//! `cargo run --release --example live_publisher -- --rate 10000 --seconds 60 --schema S`

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, PublisherConfirm,
};
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

/// The header carrying the publish time, as warren's publisher sets it.
const X_PUBLISHED_MS: &str = "x-published-ms";

#[derive(Debug, Parser)]
#[command(about = "Publish users at a fixed rate and report end-to-end latency to the database")]
struct Args {
    /// Exchange to publish to.
    #[arg(long, env = "MAIN_EXCHANGE")]
    exchange: String,
    /// Queue the exchange routes to (also the routing key), sampled for its depth.
    #[arg(long, env = "MAIN_QUEUE")]
    queue: String,
    /// Schema holding the `users` table the consumer writes.
    #[arg(long, env = "DATABASE_SCHEMA")]
    schema: String,
    /// Messages per second.
    #[arg(long, default_value_t = 10000.0)]
    rate: f64,
    /// How long to publish, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Pacing slice, in ms: each slice publishes what is due since the start.
    #[arg(long, default_value_t = 10)]
    slice_ms: u64,
    /// The queue depth the consumer must stay within (two prefetch windows), one of the
    /// conditions of "kept up" beside the p99 target.
    #[arg(long, default_value_t = 4000)]
    depth_bound: u32,
    /// The p99 latency reported against, in ms (batch timeout + 250).
    #[arg(long, default_value_t = 1250)]
    target_p99_ms: i64,
    /// How long to wait, after publishing, for every message to reach the table.
    #[arg(long, default_value_t = 120)]
    settle_timeout_s: u64,
}

/// One published message: its id and when it was published.
struct Sent {
    id: Uuid,
    published_ms: i64,
    /// Whether the broker confirmed it (only confirmed messages are expected in the table).
    confirmed: bool,
}

fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

fn properties(id: &str, now: Duration) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        X_PUBLISHED_MS.into(),
        AMQPValue::LongLongInt(now.as_millis() as i64),
    );
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.into())
        .with_timestamp(now.as_secs())
        .with_headers(headers)
}

/// Samples the queue depth every second until told to stop; answers (max, samples, over bound).
async fn sample_depth(
    channel: Channel,
    queue: String,
    bound: u32,
    mut stop: watch::Receiver<bool>,
) -> Result<(u32, u32, u32), lapin::Error> {
    let (mut max, mut samples, mut over) = (0u32, 0u32, 0u32);
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => break,
        }
        let q = channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        max = max.max(q.message_count());
        samples += 1;
        if q.message_count() > bound {
            over += 1;
        }
    }
    Ok((max, samples, over))
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[i64], q: f64) -> i64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if !(args.rate > 0.0 && args.seconds > 0.0 && args.slice_ms > 0) {
        return Err("--rate, --seconds and --slice-ms must be above 0".into());
    }
    let total = (args.rate * args.seconds).round() as u64;
    let (db, db_connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = db_connection.await {
            eprintln!("live_publisher: database connection: {e}");
        }
    });

    let conn = Connection::connect(&common::amqp_url(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(sample_depth(
        conn.create_channel().await?,
        args.queue.clone(),
        args.depth_bound,
        stop_rx,
    ));

    // Confirms are awaited in publish order by their own task, so publishing never waits.
    let (confirm_tx, mut confirm_rx) = mpsc::unbounded_channel::<(usize, PublisherConfirm)>();
    let confirmer = tokio::spawn(async move {
        let mut failed: Vec<(usize, String)> = Vec::new();
        while let Some((i, confirm)) = confirm_rx.recv().await {
            match confirm.await {
                Ok(Confirmation::Ack(None)) => {}
                Ok(Confirmation::Ack(Some(_))) | Ok(Confirmation::Nack(Some(_))) => {
                    failed.push((i, "unroutable".into()))
                }
                Ok(Confirmation::Nack(None)) => failed.push((i, "nacked".into())),
                Ok(Confirmation::NotRequested) => failed.push((i, "not confirmed".into())),
                Err(e) => failed.push((i, e.to_string())),
            }
        }
        failed
    });

    let mut sent: Vec<Sent> = Vec::with_capacity(total as usize);
    let started = Instant::now();
    let mut slices = tokio::time::interval(Duration::from_millis(args.slice_ms));
    slices.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while (sent.len() as u64) < total {
        slices.tick().await;
        let due = ((started.elapsed().as_secs_f64() * args.rate) as u64).min(total);
        while (sent.len() as u64) < due {
            let id = Uuid::new_v4();
            let i = sent.len();
            let body =
                format!(r#"{{"id":"{id}","name":"user {i}","email":"user-{id}@example.com"}}"#);
            let now = unix_now();
            let confirm = channel
                .basic_publish(
                    args.exchange.as_str().into(),
                    args.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.as_bytes(),
                    properties(&id.to_string(), now),
                )
                .await?;
            let _ = confirm_tx.send((i, confirm));
            sent.push(Sent {
                id,
                published_ms: now.as_millis() as i64,
                confirmed: true,
            });
        }
    }
    let publish_secs = started.elapsed().as_secs_f64();
    drop(confirm_tx);
    let failed = confirmer.await?;
    for (i, _) in &failed {
        sent[*i].confirmed = false;
    }
    let confirmed = sent.len() - failed.len();
    println!(
        "published {} messages in {publish_secs:.2} s: {:.0} msg/s achieved (asked {:.0}); {confirmed} confirmed, {} failed{}",
        sent.len(),
        sent.len() as f64 / publish_secs.max(1e-9),
        args.rate,
        failed.len(),
        failed
            .first()
            .map(|(_, e)| format!(" (first: {e})"))
            .unwrap_or_default()
    );

    // Wait for the last confirmed id (cheap), then read every confirmed id's inserted_at.
    let ids: Vec<Uuid> = sent.iter().filter(|s| s.confirmed).map(|s| s.id).collect();
    let deadline = Instant::now() + Duration::from_secs(args.settle_timeout_s);
    let one = db
        .prepare(&format!(
            "SELECT count(*) FROM {}.users WHERE id = $1",
            args.schema
        ))
        .await?;
    let all = db
        .prepare(&format!(
            "SELECT u.id, floor(extract(epoch FROM u.inserted_at) * 1000)::int8 \
             FROM {}.users u JOIN unnest($1::uuid[]) AS t(id) USING (id)",
            args.schema
        ))
        .await?;
    if let Some(last) = ids.last() {
        while db.query_one(&one, &[last]).await?.get::<_, i64>(0) == 0 && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let rows = loop {
        let rows = db.query(&all, &[&ids]).await?;
        if rows.len() >= ids.len() || Instant::now() >= deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let settle_secs = started.elapsed().as_secs_f64() - publish_secs;
    let _ = stop_tx.send(true);
    let (max_depth, samples, over) = sampler.await??;
    let _ = conn.close(200, "bye".into()).await;

    let published: HashMap<Uuid, i64> = sent
        .iter()
        .filter(|s| s.confirmed)
        .map(|s| (s.id, s.published_ms))
        .collect();
    let mut latencies: Vec<i64> = rows
        .iter()
        .filter_map(|r| {
            let id: Uuid = r.get(0);
            let inserted_ms: i64 = r.get(1);
            published.get(&id).map(|p| inserted_ms - p)
        })
        .collect();
    latencies.sort_unstable();
    println!(
        "in the table: {} of {confirmed} confirmed messages (read {settle_secs:.2} s after publishing ended)",
        latencies.len()
    );
    println!(
        "max queue depth: {max_depth} (sampled every 1 s, {samples} samples, {over} above the bound); bound {}: {}",
        args.depth_bound,
        if max_depth <= args.depth_bound {
            "within"
        } else {
            "exceeded"
        }
    );
    if latencies.is_empty() {
        return Err("no message reached the table".into());
    }
    let p99 = percentile(&latencies, 0.99);
    println!(
        "end-to-end latency (inserted_at - x-published-ms): p50 {} ms, p90 {} ms, p99 {p99} ms, max {} ms",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.90),
        latencies[latencies.len() - 1]
    );
    println!(
        "target p99 <= {} ms: {}",
        args.target_p99_ms,
        if p99 <= args.target_p99_ms {
            "met"
        } else {
            "not met"
        }
    );
    // Kept up means the consumer held the latency target at the rate asked: a shallow queue
    // alone proves nothing (a consumer that holds a full prefetch window while the database
    // falls behind keeps the queue short and the latency growing), and neither does a rate the
    // publisher itself could not reach.
    let achieved = sent.len() as f64 / publish_secs.max(1e-9);
    let mut misses = Vec::new();
    if p99 > args.target_p99_ms {
        misses.push(format!("p99 {p99} ms above {} ms", args.target_p99_ms));
    }
    if latencies.len() < confirmed {
        misses.push(format!(
            "{} confirmed messages missing",
            confirmed - latencies.len()
        ));
    }
    if max_depth > args.depth_bound {
        misses.push(format!(
            "queue depth {max_depth} above {}",
            args.depth_bound
        ));
    }
    if achieved < 0.98 * args.rate {
        misses.push(format!(
            "the publisher reached {achieved:.0} of {:.0} msg/s",
            args.rate
        ));
    }
    if misses.is_empty() {
        println!("kept up: yes (p99 within target, queue within bound, rate reached)");
    } else {
        println!("kept up: no ({})", misses.join("; "));
    }
    let usage = common::usage()?;
    println!(
        "publisher CPU: {:.2} s, peak RSS {:.1} MiB",
        usage.cpu.as_secs_f64(),
        usage.peak_rss_kb as f64 / 1024.0
    );
    if latencies.len() < confirmed {
        return Err(format!(
            "{} confirmed messages did not reach the table within {} s",
            confirmed - latencies.len(),
            args.settle_timeout_s
        )
        .into());
    }
    Ok(())
}
