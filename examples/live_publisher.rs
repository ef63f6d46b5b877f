//! Live publisher for `scripts/bench.sh --live`: publishes users on a fixed schedule while warren
//! consumes, and measures what a user waits for: from the moment each message was *due* (message
//! `i` is due `i / rate` seconds after the start, whether or not the publisher kept up) to the
//! moment its row is *visible to another connection* (committed).
//!
//! Commit visibility is seen through LISTEN/NOTIFY: a statement-level trigger on `<schema>.users`
//! (installed by `--install-only`, which the bench runs before warren starts, so no DDL meets a
//! running warren) sends, for each insert statement, the publisher's sequence numbers of its rows
//! (`name` is `user <i>`) as ranges (`lo-hi,lo-hi`); PostgreSQL delivers a notification only once
//! its transaction committed. A watcher on a thread and connection of its own records the instant
//! each range arrives. Its cost to the database is one notification per insert statement and a
//! scan of the statement's own rows, the same for every build measured.
//!
//! Pacing: every `--slice-ms` (1 ms) it publishes what is due; publishes are pipelined with
//! publisher confirms awaited by a second task; each message is a user JSON with a fresh UUID, the
//! AMQP timestamp and the `x-published-ms` header (what warren's own publisher sets). The queue
//! depth is sampled every `--depth-every-ms` (50 ms) by a passive `queue.declare` on a channel of
//! its own. When publishing is done it waits until every confirmed message was seen committed,
//! then prints: messages, achieved rate, how late the publisher was against its schedule, the
//! rows in the table and the commits seen (insert statements with rows, and per second), max
//! queue depth against a bound, p50/p90/p99/max of due -> committed in ms against the p99 target,
//! and the verdict `kept up: yes|no (why)`: yes only when the p99 met the target, every confirmed
//! message was committed and seen, the queue stayed within the bound and the publisher reached
//! the rate asked. Exit 1 if messages never arrived.
//!
//! `cargo run --release --example live_publisher -- --rate 10000 --seconds 60 --schema S`

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, PublisherConfirm,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_postgres::AsyncMessage;
use uuid::Uuid;

/// The header carrying the publish time, as warren's publisher sets it.
const X_PUBLISHED_MS: &str = "x-published-ms";

/// The channel the trigger notifies on.
const CHANNEL: &str = "warren_bench_rows";

/// A notification's payload stays below PostgreSQL's 8,000 bytes: ranges past this length go in
/// the next notification of the same statement.
const PAYLOAD_MAX: usize = 7_000;

#[derive(Debug, Parser)]
#[command(
    about = "Publish users on a schedule and report each one's wait from due to committed row"
)]
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
    /// Install the commit watcher's trigger on `<schema>.users` and exit (before warren starts).
    #[arg(long)]
    install_only: bool,
    /// Messages per second.
    #[arg(long, default_value_t = 10000.0)]
    rate: f64,
    /// How long to publish, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Pacing slice, in ms: each slice publishes what is due since the start.
    #[arg(long, default_value_t = 1)]
    slice_ms: u64,
    /// How often the queue depth is sampled, in ms.
    #[arg(long, default_value_t = 50)]
    depth_every_ms: u64,
    /// The queue depth the consumer must stay within (two prefetch windows), one of the
    /// conditions of "kept up" beside the p99 target.
    #[arg(long, default_value_t = 4000)]
    depth_bound: u32,
    /// The p99 latency (due -> committed) reported against, in ms.
    #[arg(long, default_value_t = 1250.0)]
    target_p99_ms: f64,
    /// How long to wait, after publishing, for every message to be committed.
    #[arg(long, default_value_t = 120)]
    settle_timeout_s: u64,
}

/// The trigger: for each insert statement on `users`, the sequence numbers of the rows it
/// inserted (`name` = `user <i>`), as ranges, in notifications delivered at its commit.
fn trigger_sql(schema: &str) -> String {
    format!(
        r#"
CREATE OR REPLACE FUNCTION {schema}.bench_rows_committed() RETURNS trigger LANGUAGE plpgsql AS $f$
DECLARE
  r record;
  payload text := '';
BEGIN
  FOR r IN
    SELECT min(n) AS lo, max(n) AS hi FROM (
      SELECT n, n - row_number() OVER (ORDER BY n) AS g FROM (
        SELECT split_part(name, ' ', 2)::int8 AS n FROM new_rows WHERE name ~ '^user [0-9]+$'
      ) s
    ) t GROUP BY g
  LOOP
    IF length(payload) > {PAYLOAD_MAX} THEN
      PERFORM pg_notify('{CHANNEL}', payload);
      payload := '';
    END IF;
    payload := payload || CASE WHEN payload = '' THEN '' ELSE ',' END || r.lo || '-' || r.hi;
  END LOOP;
  IF payload <> '' THEN
    PERFORM pg_notify('{CHANNEL}', payload);
  END IF;
  RETURN NULL;
END
$f$;
DROP TRIGGER IF EXISTS bench_rows_committed ON {schema}.users;
CREATE TRIGGER bench_rows_committed AFTER INSERT ON {schema}.users
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
  EXECUTE FUNCTION {schema}.bench_rows_committed();
"#
    )
}

/// What the watcher saw: when each sequence number was first seen committed, and how many
/// notifications (insert statements with rows, or parts of one) arrived.
struct Seen {
    at: Vec<Option<Instant>>,
    notifications: u64,
}

/// Listens on its own thread and connection (so publishing never delays a notification's
/// reading) until `stop`; counts each newly seen sequence number in `count`.
fn watch_commits(
    total: usize,
    count: Arc<AtomicUsize>,
    listening: std::sync::mpsc::Sender<Result<(), String>>,
    stop: oneshot::Receiver<()>,
) -> std::thread::JoinHandle<Seen> {
    std::thread::spawn(move || {
        let mut seen = Seen {
            at: vec![None; total],
            notifications: 0,
        };
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                let _ = listening.send(Err(e.to_string()));
                return seen;
            }
        };
        runtime.block_on(async {
            let (client, mut connection) =
                match tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls).await
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = listening.send(Err(e.to_string()));
                        return;
                    }
                };
            let (tx, mut rx) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                while let Some(message) = messages.next().await {
                    match message {
                        Ok(AsyncMessage::Notification(n)) => {
                            let _ = tx.send((Instant::now(), n.payload().to_string()));
                        }
                        Ok(_) => {}
                        Err(e) => {
                            eprintln!("live_publisher: watcher connection: {e}");
                            break;
                        }
                    }
                }
            });
            let answer = client
                .batch_execute(&format!("LISTEN {CHANNEL}"))
                .await
                .map_err(|e| e.to_string());
            let _ = listening.send(answer);
            let mut stop = stop;
            loop {
                let (at, payload) = tokio::select! {
                    got = rx.recv() => match got { Some(g) => g, None => break },
                    _ = &mut stop => break,
                };
                seen.notifications += 1;
                for range in payload.split(',') {
                    let Some((lo, hi)) = range.split_once('-') else {
                        continue;
                    };
                    let (Ok(lo), Ok(hi)) = (lo.parse::<usize>(), hi.parse::<usize>()) else {
                        continue;
                    };
                    for i in lo..=hi.min(total.saturating_sub(1)) {
                        if seen.at[i].is_none() {
                            seen.at[i] = Some(at);
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        });
        seen
    })
}

/// One published message: its id, whether the broker confirmed it (only confirmed messages
/// are expected in the table) and how late it went out against its due time.
struct Sent {
    id: Uuid,
    confirmed: bool,
    late: Duration,
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

/// Samples the queue depth every `every` until told to stop; answers (max, samples, over bound).
async fn sample_depth(
    channel: Channel,
    queue: String,
    bound: u32,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<(u32, u32, u32), lapin::Error> {
    let (mut max, mut samples, mut over) = (0u32, 0u32, 0u32);
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
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
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (db, db_connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = db_connection.await {
            eprintln!("live_publisher: database connection: {e}");
        }
    });
    if args.install_only {
        db.batch_execute(&trigger_sql(&args.schema)).await?;
        return Ok(());
    }
    if !(args.rate > 0.0 && args.seconds > 0.0 && args.slice_ms > 0 && args.depth_every_ms > 0) {
        return Err("--rate, --seconds, --slice-ms and --depth-every-ms must be above 0".into());
    }
    let installed: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = 'users' AND t.tgname = 'bench_rows_committed'",
            &[&args.schema],
        )
        .await?
        .get(0);
    if installed == 0 {
        return Err(format!(
            "no commit watcher on {}.users: run `live_publisher --install-only` first \
             (scripts/bench.sh does, before warren starts)",
            args.schema
        )
        .into());
    }
    let total = (args.rate * args.seconds).round() as usize;

    let seen_count = Arc::new(AtomicUsize::new(0));
    let (listening_tx, listening_rx) = std::sync::mpsc::channel();
    let (stop_watch, stop_watch_rx) = oneshot::channel();
    let watcher = watch_commits(total, seen_count.clone(), listening_tx, stop_watch_rx);
    listening_rx
        .recv()
        .map_err(|_| "the commit watcher ended before it listened")?
        .map_err(|e| format!("the commit watcher: {e}"))?;

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
        Duration::from_millis(args.depth_every_ms),
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

    // Message i is due at `started + i / rate`: its wait is counted from there, so a publisher
    // that falls behind its schedule shows in the latency instead of hiding it.
    let due = |started: Instant, i: usize| started + Duration::from_secs_f64(i as f64 / args.rate);
    let mut sent: Vec<Sent> = Vec::with_capacity(total);
    let started = Instant::now();
    let mut slices = tokio::time::interval(Duration::from_millis(args.slice_ms));
    slices.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while sent.len() < total {
        slices.tick().await;
        let now_due = ((started.elapsed().as_secs_f64() * args.rate) as usize + 1).min(total);
        while sent.len() < now_due {
            let id = Uuid::new_v4();
            let i = sent.len();
            let body =
                format!(r#"{{"id":"{id}","name":"user {i}","email":"user-{id}@example.com"}}"#);
            let confirm = channel
                .basic_publish(
                    args.exchange.as_str().into(),
                    args.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.as_bytes(),
                    properties(&id.to_string(), unix_now()),
                )
                .await?;
            let _ = confirm_tx.send((i, confirm));
            sent.push(Sent {
                id,
                confirmed: true,
                late: Instant::now().saturating_duration_since(due(started, i)),
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
    let mut late: Vec<f64> = sent.iter().map(|s| s.late.as_secs_f64() * 1e3).collect();
    late.sort_by(f64::total_cmp);
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
    println!(
        "publisher behind its schedule: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (part of every latency below)",
        percentile(&late, 0.50),
        percentile(&late, 0.99),
        late[late.len() - 1]
    );

    // Every confirmed message seen committed, or the settle timeout.
    let settle_deadline = Instant::now() + Duration::from_secs(args.settle_timeout_s);
    let seen_confirmed = |seen: usize| seen >= confirmed;
    while !seen_confirmed(seen_count.load(Ordering::Relaxed)) && Instant::now() < settle_deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run_secs = started.elapsed().as_secs_f64();
    let settle_secs = run_secs - publish_secs;
    let _ = stop_tx.send(true);
    let _ = stop_watch.send(());
    let seen = watcher.join().map_err(|_| "the commit watcher panicked")?;
    let (max_depth, samples, over) = sampler.await??;
    let _ = conn.close(200, "bye".into()).await;

    // What the table holds of the confirmed ids (a row the watcher missed would show here).
    let ids: Vec<Uuid> = sent.iter().filter(|s| s.confirmed).map(|s| s.id).collect();
    let in_table: i64 = db
        .query_one(
            &format!(
                "SELECT count(*) FROM {}.users u JOIN unnest($1::uuid[]) AS t(id) USING (id)",
                args.schema
            ),
            &[&ids],
        )
        .await?
        .get(0);
    let waits: HashMap<usize, f64> = sent
        .iter()
        .enumerate()
        .filter(|(_, s)| s.confirmed)
        .filter_map(|(i, _)| {
            let at = seen.at[i]?;
            Some((
                i,
                at.saturating_duration_since(due(started, i)).as_secs_f64() * 1e3,
            ))
        })
        .collect();
    let mut latencies: Vec<f64> = waits.into_values().collect();
    latencies.sort_by(f64::total_cmp);
    println!(
        "in the table: {in_table} of {confirmed} confirmed messages; seen committed: {} (waited {settle_secs:.2} s after publishing ended)",
        latencies.len()
    );
    println!(
        "commits seen: {} insert notifications, {:.0}/s over {run_secs:.1} s, {:.1} rows each",
        seen.notifications,
        seen.notifications as f64 / run_secs.max(1e-9),
        latencies.len() as f64 / (seen.notifications.max(1)) as f64
    );
    println!(
        "max queue depth: {max_depth} (sampled every {} ms, {samples} samples, {over} above the bound); bound {}: {}",
        args.depth_every_ms,
        args.depth_bound,
        if max_depth <= args.depth_bound {
            "within"
        } else {
            "exceeded"
        }
    );
    if latencies.is_empty() {
        return Err("no message was seen committed".into());
    }
    let p99 = percentile(&latencies, 0.99);
    println!(
        "end-to-end latency (due -> committed row): p50 {:.1} ms, p90 {:.1} ms, p99 {p99:.1} ms, max {:.1} ms",
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
        misses.push(format!("p99 {p99:.1} ms above {} ms", args.target_p99_ms));
    }
    if latencies.len() < confirmed {
        misses.push(format!(
            "{} confirmed messages not seen committed",
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
        "publisher CPU: {:.2} s (its watcher included), peak RSS {:.1} MiB",
        usage.cpu.as_secs_f64(),
        usage.peak_rss_kb as f64 / 1024.0
    );
    if (in_table as usize) < confirmed {
        return Err(format!(
            "{} confirmed messages did not reach the table within {} s",
            confirmed - in_table as usize,
            args.settle_timeout_s
        )
        .into());
    }
    Ok(())
}
