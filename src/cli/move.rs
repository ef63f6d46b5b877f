//! `warren move --from QUEUE --to EXCHANGE[/ROUTING_KEY]`: moves what a queue holds to an
//! exchange, each message republished (body unchanged, properties as the republish policy keeps
//! them: `amqp::republish`) with publisher confirms and acked at the source
//! only once its copy is confirmed, so an interrupted or failed move loses nothing.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lapin::Connection;
use lapin::message::BasicGetMessage;
use tokio_util::sync::CancellationToken;

use crate::amqp::publisher::Publish;
use crate::amqp::republish::{self, Stamp};
use crate::amqp::transfer::{self, Route, Stop};
use crate::amqp::{self, AmqpError};
use crate::cli::out::{self, errln, outln};
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
    #[arg(long, value_name = "N", value_parser = crate::cli::dlq::parse_limit)]
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

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let conn = amqp::connect(&settings.amqp(), "move", amqp::Frames::Broker)
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
    // A closed stdout loses the report, never the exit code of a failure or an interrupt.
    out::unless_closed(outln!(
        "moved {} from {} to {} ({}); {left} left in {}",
        plural(tally.moved),
        plan.source,
        plan.target.exchange_text(),
        plan.target.key_text(),
        plan.source,
    ))?;
    if let Some(failure) = tally.failure {
        errln!("warren move: stopped: {failure}");
        return Ok(1);
    }
    if tally.interrupted {
        errln!("warren move: interrupted; run it again to move the rest");
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
/// The loop is [`transfer`](crate::amqp::transfer), a window of `--in-flight` messages at a
/// time, each copy through the republish policy.
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
    let mut mover = Mover {
        target: &plan.target,
        budget,
        started: Instant::now(),
        reported: Instant::now(),
    };
    let moved = transfer::transfer(
        conn,
        &transfer::Plan {
            queue: &plan.source,
            take: budget,
            publish: None,
            window: plan.in_flight,
            confirm_timeout: plan.timeout,
            get_timeout: Some(plan.timeout),
            frame_max: plan.frame_max,
        },
        &mut mover,
        stop,
    )
    .await?;
    Ok(Tally {
        moved: moved.acked,
        failure: moved.stopped.map(|s| failure(&s, &plan.source)),
        interrupted: moved.interrupted,
    })
}

/// The route of a move: every message, to the target, and a progress line a second.
struct Mover<'a> {
    /// Where the copies go.
    target: &'a Target,
    /// How many the move takes at most (the report's "of N").
    budget: u64,
    /// When the move began, for the rate.
    started: Instant,
    /// When progress was last reported: at most once a second.
    reported: Instant,
}

impl Route for Mover<'_> {
    /// The copy: body unchanged, properties as the republish policy keeps them (stamped as a
    /// fresh start), the target's routing key or the message's own.
    fn route(&mut self, m: &mut BasicGetMessage) -> Option<Publish> {
        Some(Publish {
            exchange: self.target.exchange.clone(),
            routing_key: self
                .target
                .routing_key
                .clone()
                .unwrap_or_else(|| m.delivery.routing_key.to_string()),
            body: std::mem::take(&mut m.delivery.data).into(),
            properties: republish::stamp_origin(
                republish::copy_properties(
                    &m.delivery.properties,
                    &Stamp {
                        restart: true,
                        ..Default::default()
                    },
                ),
                &m.delivery.properties,
                m.delivery.exchange.as_str(),
                m.delivery.routing_key.as_str(),
            ),
        })
    }

    fn published(&mut self, tally: &transfer::Tally) {
        if self.reported.elapsed() >= Duration::from_secs(1) {
            self.reported = Instant::now();
            errln!(
                "moved {} of {} ({:.0} msg/s)",
                tally.acked,
                self.budget,
                tally.acked as f64 / self.started.elapsed().as_secs_f64()
            );
        }
    }
}

/// What `warren move` says of a transfer that stopped early, `source` being the queue.
fn failure(stop: &Stop, source: &str) -> String {
    match stop {
        Stop::Get(e) => format!("basic.get on {source}: {e} (unacked messages return to it)"),
        Stop::GetTimeout(bound) => format!(
            "basic.get on {source} not answered within {bound:?} (unacked messages return to it)"
        ),
        Stop::NotPublished {
            message_id,
            error,
            window,
            confirmed,
        } => {
            let mut failure = format!(
                "message {message_id} was not republished: {error}; it and the {} other messages \
                 taken with it stay in {source}",
                window - 1,
            );
            if *confirmed > 0 {
                failure.push_str(&format!(
                    " ({confirmed} of them were confirmed at the destination too: moving again \
                     sends those twice)"
                ));
            }
            failure
        }
        Stop::NotAcked { count, error, .. } => format!(
            "{count} messages were republished but could not be acked at {source} ({error}): \
             they are in both places"
        ),
        Stop::NotReturned(e) => format!(
            "cannot return the messages to {source} ({e}); closing the channel returns them"
        ),
    }
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
