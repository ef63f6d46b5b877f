//! Tuned pipeline for `scripts/bench.sh`: warren's job done with care in plain code, so that
//! "faster than the least code" (`minimal_pipeline.rs`) is not mistaken for "faster than good
//! code". One task, no actors: a lapin consumer (prefetch 4000) decodes each
//! `{"id","name","email"}` body with serde_json into batches of up to 1000 (a batch goes once
//! full, 1 s after its first message, or with the N-th message). Each batch goes to whichever of
//! the two writers (a database connection each) is free, so two inserts are in flight while the
//! next batch fills: a plain `INSERT .. SELECT * FROM UNNEST(..)` first, and the idempotent
//! `.. ON CONFLICT (id) DO NOTHING` only when the plain one met a unique violation (SQLSTATE
//! 23505: a redelivered message). Acks go in batch order: once a batch and every batch before it
//! are committed, one `basic.ack multiple=true` settles them all, so a multi-ack never covers an
//! uncommitted row. Stops after N messages and prints the same line as `minimal_pipeline`
//! (drain seconds by its own clock: from its start to its last ack). The independent yardstick's
//! probe (`pipeline --inflight 2 --plain-first`) does the same job.
//!
//! `cargo run --release --example tuned_pipeline -- --queue QUEUE --count N --schema SCHEMA`

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::users::{self, Batch, Drained};
use futures::StreamExt;
use lapin::options::BasicAckOptions;
use tokio::task::JoinSet;
use tokio::time::Instant as Deadline;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(
    about = "Drain N user messages into <schema>.users: plain insert first, two inserts in flight, acks in order"
)]
struct Args {
    #[command(flatten)]
    drain: users::Drain,
    /// Unacked deliveries the broker may have in flight (basic.qos).
    #[arg(long, default_value_t = 4000)]
    prefetch: u16,
    /// Messages per insert, at most.
    #[arg(long, default_value_t = 1000)]
    batch_size: usize,
    /// A batch goes this long after its first message, full or not.
    #[arg(long, default_value_t = 1000)]
    batch_timeout_ms: u64,
    /// Batch inserts in flight, each on a connection of its own.
    #[arg(long, default_value_t = 2)]
    inflight: usize,
    /// Give up when nothing arrives and nothing is in flight for this long.
    #[arg(long, default_value_t = 30)]
    idle_timeout_s: u64,
}

/// One database connection with both statements prepared on it.
struct Writer {
    client: tokio_postgres::Client,
    /// The first try: no conflict handling to pay for.
    plain: tokio_postgres::Statement,
    /// After a unique violation: the same rows, those already present skipped.
    idempotent: tokio_postgres::Statement,
}

/// The columns of one batch on their way to the database.
type Rows = (Vec<Uuid>, Vec<String>, Vec<String>);

impl Writer {
    async fn connect(schema: &str) -> Result<Writer, tokio_postgres::Error> {
        let client = users::connect("tuned_pipeline").await?;
        let plain = client.prepare(&users::unnest_insert(schema, "")).await?;
        let idempotent = client
            .prepare(&users::unnest_insert(
                schema,
                " ON CONFLICT (id) DO NOTHING",
            ))
            .await?;
        Ok(Writer {
            client,
            plain,
            idempotent,
        })
    }

    /// Inserts the rows (plain first) in a transaction of their own; the rows inserted.
    async fn insert(&self, (ids, names, emails): Rows) -> Result<u64, tokio_postgres::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&ids, &names, &emails];
        match self.client.execute(&self.plain, &params).await {
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                self.client.execute(&self.idempotent, &params).await
            }
            done => done,
        }
    }
}

/// A batch handed to a writer, waiting for its commit, then for every earlier batch's.
struct Pending {
    /// The batch's highest delivery tag: the multi-ack that settles it.
    last_tag: u64,
    len: usize,
    invalid: usize,
    /// The rows its insert reported, once committed.
    inserted: Option<u64>,
}

/// What an insert task hands back: the batch's place in the order, the writer (free again)
/// and the outcome.
type Finished = (u64, usize, Result<u64, tokio_postgres::Error>);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let args = Args::parse();
    if args.drain.count == 0 || args.batch_size == 0 || args.inflight == 0 {
        return Err("--count, --batch-size and --inflight must be at least 1".into());
    }
    let mut writers = Vec::with_capacity(args.inflight);
    for _ in 0..args.inflight {
        writers.push(Arc::new(Writer::connect(&args.drain.schema).await?));
    }
    let (conn, channel, mut consumer) =
        common::subscribe(&args.drain.queue, args.prefetch, "tuned_pipeline").await?;

    let batch_timeout = Duration::from_millis(args.batch_timeout_ms);
    let idle = Duration::from_secs(args.idle_timeout_s);
    let mut batch = Batch::default();
    let mut received = 0u64;
    let mut d = Drained::default();
    // Writers free to take a batch, and the inserts running on the others.
    let mut free: Vec<usize> = (0..writers.len()).rev().collect();
    let mut running: JoinSet<Finished> = JoinSet::new();
    // Batches handed over and not yet acked, in order; `first_seq` is the front's number.
    let mut pending: VecDeque<Pending> = VecDeque::with_capacity(args.inflight + 1);
    let mut first_seq = 0u64;
    // The open batch goes when this passes (set by its first message).
    let batch_deadline = tokio::time::sleep(batch_timeout);
    tokio::pin!(batch_deadline);
    let mut timed_out = false;
    // Nothing arrived and nothing finished for this long: the drain is stuck.
    let idle_deadline = tokio::time::sleep(idle);
    tokio::pin!(idle_deadline);

    while d.settled < args.drain.count {
        let due = batch.len > 0
            && (batch.len >= args.batch_size || received == args.drain.count || timed_out);
        if due && let Some(w) = free.pop() {
            let writer = Arc::clone(&writers[w]);
            let rows = (
                std::mem::replace(&mut batch.ids, Vec::with_capacity(args.batch_size)),
                std::mem::replace(&mut batch.names, Vec::with_capacity(args.batch_size)),
                std::mem::replace(&mut batch.emails, Vec::with_capacity(args.batch_size)),
            );
            let seq = first_seq + pending.len() as u64;
            running.spawn(async move { (seq, w, writer.insert(rows).await) });
            pending.push_back(Pending {
                last_tag: batch.last_tag,
                len: batch.len,
                invalid: batch.invalid,
                inserted: None,
            });
            d.batches += 1;
            batch.clear();
            timed_out = false;
            continue;
        }
        // A full batch waits for a writer; until then no more deliveries are taken.
        let wants = received < args.drain.count && batch.len < args.batch_size;
        tokio::select! {
            biased;
            Some(finished) = running.join_next() => {
                let (seq, w, outcome) = finished?;
                free.push(w);
                let slot = (seq - first_seq) as usize;
                pending[slot].inserted = Some(outcome?);
                ack_committed(&channel, &mut pending, &mut first_seq, &mut d).await?;
                idle_deadline.as_mut().reset(Deadline::now() + idle);
            }
            _ = &mut batch_deadline, if batch.len > 0 && !timed_out => timed_out = true,
            delivery = consumer.next(), if wants => {
                let Some(delivery) = delivery else {
                    return Err(format!("the consumer ended after {received} deliveries").into());
                };
                let delivery = delivery?;
                received += 1;
                batch.push(delivery.delivery_tag, &delivery.data);
                if batch.len == 1 {
                    let now = Deadline::now();
                    batch_deadline.as_mut().reset(now + batch_timeout);
                    idle_deadline.as_mut().reset(now + idle);
                }
            }
            _ = &mut idle_deadline, if running.is_empty() && batch.len == 0 => {
                return Err(format!(
                    "only {received} of {} messages arrived (nothing for {} s)",
                    args.drain.count, args.idle_timeout_s
                )
                .into());
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = conn.close(200, "bye".into()).await;
    users::report("tuned_pipeline", secs, &d)?;
    Ok(())
}

/// Acks the committed batches at the front of the order with one multi-ack (the last one's tag):
/// a batch committed before an earlier one waits for it, so the ack never covers an uncommitted
/// row.
async fn ack_committed(
    channel: &lapin::Channel,
    pending: &mut VecDeque<Pending>,
    first_seq: &mut u64,
    d: &mut Drained,
) -> Result<(), lapin::Error> {
    let mut last_tag = None;
    while pending.front().is_some_and(|p| p.inserted.is_some()) {
        let Some(done) = pending.pop_front() else {
            break;
        };
        *first_seq += 1;
        d.inserted += done.inserted.unwrap_or(0);
        d.settled += done.len as u64;
        d.invalid += done.invalid as u64;
        last_tag = Some(done.last_tag);
    }
    if let Some(tag) = last_tag {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await?;
        d.acks += 1;
    }
    Ok(())
}
