//! `warren move --from QUEUE --to EXCHANGE[/ROUTING_KEY]`: moves what a queue holds to an
//! exchange, each message republished (body unchanged, properties as the republish policy keeps
//! them: `amqp::republish`) with publisher confirms and acked at the source
//! only once its copy is confirmed, so an interrupted or failed move loses nothing.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lapin::message::BasicGetMessage;
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use crate::amqp::publisher::{Publish, publish_group};
use crate::amqp::republish::{self, Stamp};
use crate::amqp::{self, AmqpError};
use crate::config::{Settings, redact_url};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The queue to take the messages from.
    #[arg(long, value_name = "QUEUE")]
    pub from: String,
    /// Where to republish them: EXCHANGE keeps each message's own routing key, EXCHANGE/KEY
    /// uses KEY for all; "/KEY" is the default exchange, which routes to the queue named KEY.
    #[arg(long, value_name = "EXCHANGE[/ROUTING_KEY]", value_parser = parse_target)]
    pub to: Target,
    /// Move at most N messages.
    #[arg(long, value_name = "N", value_parser = parse_limit)]
    pub limit: Option<u64>,
    /// Messages republished and awaiting their confirms at once (1 to 10000).
    #[arg(long, value_name = "N", default_value_t = 100,
        value_parser = clap::value_parser!(u16).range(1..=10_000))]
    pub in_flight: u16,
}

/// Where moved messages go.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The exchange ("" is the default exchange).
    pub exchange: String,
    /// One routing key for every message; `None` keeps each message's own.
    pub routing_key: Option<String>,
}

impl Target {
    /// How the report names the routing key.
    fn key_text(&self) -> String {
        match &self.routing_key {
            Some(k) => format!("routing key {k:?}"),
            None => "each message's own routing key".into(),
        }
    }

    fn exchange_text(&self) -> &str {
        if self.exchange.is_empty() {
            "the default exchange"
        } else {
            &self.exchange
        }
    }
}

/// `--to EXCHANGE[/ROUTING_KEY]`, split at the first `/`.
fn parse_target(raw: &str) -> Result<Target, String> {
    let (exchange, routing_key) = match raw.split_once('/') {
        Some((e, k)) => (e, Some(k.to_string())),
        None => (raw, None),
    };
    if exchange.is_empty() && routing_key.as_deref().is_none_or(str::is_empty) {
        return Err(
            "expected EXCHANGE, EXCHANGE/ROUTING_KEY or /QUEUE (the default exchange)".into(),
        );
    }
    if exchange.len() > 255 || routing_key.as_ref().is_some_and(|k| k.len() > 255) {
        return Err("names and routing keys are at most 255 bytes".into());
    }
    Ok(Target {
        exchange: exchange.to_string(),
        routing_key,
    })
}

/// `--limit`: a whole number of at least 1.
fn parse_limit(raw: &str) -> Result<u64, String> {
    match raw.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number of at least 1".into()),
    }
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let conn = amqp::connect(settings, "move", amqp::Frames::Broker)
        .await
        .with_context(|| {
            format!(
                "cannot reach the broker at {}",
                redact_url(&settings.amqp_url)
            )
        })?;
    let stop = CancellationToken::new();
    let flag = stop.clone();
    let signals = tokio::spawn(async move {
        super::run::signals().await;
        flag.cancel();
    });
    let plan = Plan {
        source: args.from.clone(),
        target: args.to.clone(),
        limit: args.limit,
        in_flight: usize::from(args.in_flight),
        timeout: settings.publish_timeout(),
        frame_max: conn.configuration().frame_max(),
    };
    let result = move_messages(&conn, &plan, &stop).await;
    let left = amqp::queue_stats(&conn, &plan.source).await.ok();
    // Closing the connection returns anything still unacked to the source, whatever happened.
    amqp::close(None, Some(conn)).await;
    signals.abort();
    let tally = result?;
    let left = left.map_or_else(|| "unknown".into(), |(m, _)| m.to_string());
    println!(
        "moved {} from {} to {} ({}); {left} left in {}",
        plural(tally.moved),
        plan.source,
        plan.target.exchange_text(),
        plan.target.key_text(),
        plan.source,
    );
    if let Some(failure) = tally.failure {
        eprintln!("warren move: stopped: {failure}");
        return Ok(1);
    }
    if tally.interrupted {
        eprintln!("warren move: interrupted; run it again to move the rest");
        return Ok(130);
    }
    Ok(0)
}

/// What to move, and how.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The queue the messages leave.
    pub source: String,
    /// Where their copies go.
    pub target: Target,
    /// At most this many; `None` = as many as the source held at the start.
    pub limit: Option<u64>,
    /// Window size: copies awaiting their confirms at once.
    pub in_flight: usize,
    /// Bound on each confirm.
    pub timeout: Duration,
    /// The publishing link's frame limit: a copy whose content header exceeds it is not sent.
    pub frame_max: u32,
}

/// What a move did.
#[derive(Debug, Default)]
pub struct Tally {
    /// Copies confirmed at the destination whose source copy was acked.
    pub moved: u64,
    /// Why the move stopped early, if it did (it stops at the first failure).
    pub failure: Option<String>,
    /// Whether a signal stopped it.
    pub interrupted: bool,
}

/// Moves messages from `plan.source` to `plan.target` on `conn` (see [`Args`] for the rules),
/// until the source is empty, the limit or the source's starting depth is reached, a failure,
/// or `stop` (which also ends a wait for the source that does not answer: what it took is not
/// acked and returns to it). An error means nothing was taken (a missing queue or exchange).
pub async fn move_messages(
    conn: &Connection,
    plan: &Plan,
    stop: &CancellationToken,
) -> anyhow::Result<Tally> {
    let present = match amqp::queue_stats(conn, &plan.source).await {
        Ok((messages, _)) => u64::from(messages),
        Err(AmqpError::NotFound(_)) => bail!("queue {} does not exist", plan.source),
        Err(e) => bail!("cannot read queue {}: {e}", plan.source),
    };
    if !plan.target.exchange.is_empty()
        && !amqp::exchange_exists(conn, &plan.target.exchange)
            .await
            .context("cannot check the destination exchange")?
    {
        bail!(
            "exchange {} does not exist; nothing was moved (declare it, and bind a queue to it, first)",
            plan.target.exchange
        );
    }
    let budget = plan.limit.map_or(present, |l| l.min(present));
    let get = conn.create_channel().await?;
    let publish = conn.create_channel().await?;
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context("cannot put the publishing channel in confirm mode")?;

    let mut tally = Tally::default();
    let started = Instant::now();
    let mut reported = Instant::now();
    while tally.moved < budget && tally.failure.is_none() {
        if stop.is_cancelled() {
            tally.interrupted = true;
            break;
        }
        let want = (budget - tally.moved).min(plan.in_flight as u64) as usize;
        let window = tokio::select! {
            taken = tokio::time::timeout(plan.timeout, take(&get, &plan.source, want)) => taken,
            _ = stop.cancelled() => {
                tally.interrupted = true;
                break;
            }
        };
        let window = match window {
            Ok(Ok(w)) if w.is_empty() => break,
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                tally.failure = Some(format!(
                    "basic.get on {}: {e} (unacked messages return to it)",
                    plan.source
                ));
                break;
            }
            Err(_) => {
                tally.failure = Some(format!(
                    "basic.get on {} not answered within {:?} (unacked messages return to it)",
                    plan.source, plan.timeout
                ));
                break;
            }
        };
        // A window being forwarded finishes (its publishes and the ack are bounded): stopping
        // in the middle would leave its copies in both places.
        match forward(&publish, &get, window, plan).await {
            Ok(n) => tally.moved += n,
            Err(failure) => tally.failure = Some(failure),
        }
        if reported.elapsed() >= Duration::from_secs(1) {
            reported = Instant::now();
            eprintln!(
                "moved {} of {budget} ({:.0} msg/s)",
                tally.moved,
                tally.moved as f64 / started.elapsed().as_secs_f64()
            );
        }
    }
    let _ = publish.close(200, "bye".into()).await;
    // Unacked messages (a failed window) go back to the source now.
    let _ = get.close(200, "bye".into()).await;
    Ok(tally)
}

/// Up to `n` messages of `queue`, unacked on `channel`; fewer when it runs empty.
async fn take(
    channel: &Channel,
    queue: &str,
    n: usize,
) -> Result<Vec<BasicGetMessage>, lapin::Error> {
    let mut window = Vec::with_capacity(n);
    while window.len() < n {
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await?
        {
            Some(m) => window.push(m),
            None => break,
        }
    }
    Ok(window)
}

/// Republishes `window` (in order, as one group: a returned copy is told to the right message),
/// then acks it at the source with one multiple ack: all of it, or, if any copy failed, none of
/// it.
/// Returns how many were moved, or why it stopped.
async fn forward(
    publish: &Channel,
    get: &Channel,
    mut window: Vec<BasicGetMessage>,
    plan: &Plan,
) -> Result<u64, String> {
    let copies = window
        .iter_mut()
        .map(|m| Publish {
            exchange: plan.target.exchange.clone(),
            routing_key: plan
                .target
                .routing_key
                .clone()
                .unwrap_or_else(|| m.delivery.routing_key.to_string()),
            body: std::mem::take(&mut m.delivery.data).into(),
            properties: republish::copy_properties(
                &m.delivery.properties,
                &Stamp {
                    restart: true,
                    ..Default::default()
                },
            ),
        })
        .collect();
    let results = publish_group(publish, copies, plan.frame_max, plan.timeout).await;
    let confirmed = results.iter().filter(|r| r.is_ok()).count();
    if let Some((i, Err(e))) = results.iter().enumerate().find(|(_, r)| r.is_err()) {
        let id = message_id(&window[i]);
        let mut failure = format!(
            "message {id} was not republished: {e}; it and the {} other messages taken with it \
             stay in {}",
            window.len() - 1,
            plan.source
        );
        if confirmed > 0 {
            failure.push_str(&format!(
                " ({confirmed} of them were confirmed at the destination too: moving again \
                 sends those twice)"
            ));
        }
        return Err(failure);
    }
    let Some(last) = window.last() else {
        return Ok(0);
    };
    let acked = get
        .basic_ack(
            last.delivery.delivery_tag,
            BasicAckOptions { multiple: true },
        )
        .await;
    match acked {
        Ok(()) => Ok(window.len() as u64),
        Err(e) => Err(format!(
            "{} messages were republished but could not be acked at {} ({e}): they are in both \
             places",
            window.len(),
            plan.source
        )),
    }
}

fn message_id(m: &BasicGetMessage) -> String {
    m.delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|| format!("(no message id, delivery {})", m.delivery.delivery_tag))
}

fn plural(n: u64) -> String {
    if n == 1 {
        "1 message".into()
    } else {
        format!("{n} messages")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_split_at_the_first_slash() {
        assert_eq!(
            parse_target("ex").unwrap(),
            Target {
                exchange: "ex".into(),
                routing_key: None
            }
        );
        assert_eq!(
            parse_target("ex/a/b").unwrap(),
            Target {
                exchange: "ex".into(),
                routing_key: Some("a/b".into())
            }
        );
        assert_eq!(
            parse_target("ex/").unwrap().routing_key.as_deref(),
            Some("")
        );
        let default = parse_target("/q").unwrap();
        assert_eq!(default.exchange, "");
        assert_eq!(default.exchange_text(), "the default exchange");
        assert!(parse_target("").is_err());
        assert!(parse_target("/").is_err());
        assert!(parse_target(&"x".repeat(256)).is_err());
    }
}
