//! `warren dlq inspect` and `warren dlq replay`: the dead-letter queue itself, read with
//! `basic.get` and given back (inspect) or republished with a confirm before each ack (replay).

use anyhow::Context as _;
use lapin::message::BasicGetMessage;
use lapin::options::BasicGetOptions;
use lapin::types::AMQPValue;
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use super::{
    BrokerDeath, InspectArgs, ReplayArgs, age, cell, kind_of, now_s, plural, preview, table,
};
use crate::amqp::publisher::Publish;
use crate::amqp::transfer::{self, Stop};
use crate::amqp::{self, headers};
use crate::cli::out::{self, errln, out, outln};
use crate::config::{QueueType, Settings, redact_url};
use crate::registry::record::PipelineRecord;
use crate::topology::broker::{DEFAULT_DELIVERY_LIMIT, broker_version, gives_default_limit};

pub(super) async fn broker(settings: &Settings) -> anyhow::Result<Connection> {
    amqp::connect(&settings.amqp(), "dlq tool", amqp::Frames::Broker)
        .await
        .with_context(|| {
            format!(
                "cannot reach the broker at {}",
                redact_url(&settings.amqp_url)
            )
        })
}

/// Messages ready in `queue`, by a passive declare on a channel of its own (a missing queue
/// closes that channel only).
async fn depth(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    match crate::amqp::queue_stats(conn, queue).await {
        Ok((messages, _)) => Ok(messages),
        Err(e) => anyhow::bail!(
            "cannot read queue {queue} ({e}); if it does not exist, run `warren declare` first"
        ),
    }
}

/// How the DLQ's deliveries are bounded, which is what `dlq inspect` must respect.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bound {
    /// A classic queue: no delivery limit.
    Classic,
    /// A quorum DLQ declared without a delivery limit (`DLQ_DELIVERY_LIMIT=0`) on a broker that
    /// gives it none (RabbitMQ 3.x, its version given): no delivery is spent against anything.
    Unlimited { version: String },
    /// A quorum DLQ with a delivery limit: its own, or, for 0, RabbitMQ 4's default.
    Limited(Spend),
}

impl Bound {
    /// The bound of a DLQ of `queue_type` declared with `dlq_delivery_limit`, on the broker of
    /// `version` (as it says it in `connection.start`). For 0, RabbitMQ 4 gives a quorum queue
    /// a limit of 20 and 3.x none; a broker that gives no readable version is taken as 4.x (the
    /// lower bound, so inspect never spends what it cannot tell is free).
    fn of(queue_type: QueueType, dlq_delivery_limit: u32, version: Option<&str>) -> Self {
        if queue_type != QueueType::Quorum {
            return Bound::Classic;
        }
        let limit = match (dlq_delivery_limit, gives_default_limit(version)) {
            (0, Some(false)) => {
                return Bound::Unlimited {
                    version: version.unwrap_or_default().to_string(),
                };
            }
            (0, _) => u64::from(DEFAULT_DELIVERY_LIMIT),
            (n, _) => u64::from(n),
        };
        Bound::Limited(Spend {
            limit,
            margin: (limit / 10).max(2),
        })
    }

    /// The spend to check each message against (`None`: nothing to check).
    fn spend(&self) -> Option<Spend> {
        match self {
            Bound::Limited(spend) => Some(*spend),
            Bound::Classic | Bound::Unlimited { .. } => None,
        }
    }
}

/// What `dlq inspect` spends on a quorum DLQ: each `basic.get` is a delivery, and the broker
/// drops a message past the DLQ's delivery limit (the DLQ dead-letters nowhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Spend {
    /// The DLQ's `x-delivery-limit` (`DLQ_DELIVERY_LIMIT`, or the broker's default for 0).
    limit: u64,
    /// Deliveries kept in reserve: inspect refuses to bring a message closer to the limit than
    /// this (a tenth of it, at least 2), so outages and restarts still have room.
    margin: u64,
}

impl Spend {
    /// Whether a message now delivered `delivered` times (this inspection's included) is
    /// within the margin of the limit.
    fn too_close(&self, delivered: u64) -> bool {
        delivered + self.margin >= self.limit
    }
}

/// How often a message was delivered before this delivery: the quorum queue's
/// `x-delivery-count` (absent on a first delivery).
fn delivered_before(m: &BasicGetMessage) -> u64 {
    let value = m
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").cloned());
    match value {
        Some(AMQPValue::LongLongInt(n)) => u64::try_from(n).unwrap_or(0),
        Some(AMQPValue::LongInt(n)) => u64::try_from(n).unwrap_or(0),
        Some(AMQPValue::LongUInt(n)) => u64::from(n),
        Some(AMQPValue::ShortInt(n)) => u64::try_from(n).unwrap_or(0),
        Some(AMQPValue::ShortUInt(n)) => u64::from(n),
        Some(AMQPValue::ShortShortInt(n)) => u64::try_from(n).unwrap_or(0),
        Some(AMQPValue::ShortShortUInt(n)) => u64::from(n),
        _ => 0,
    }
}

/// Why messages taken from the DLQ may still be there until their channel closes.
const NOT_RETURNED: &str =
    "cannot return the messages to the DLQ (closing the channel returns them)";

/// Returns every message still unacked on `channel` up to `last_tag` to its queue.
async fn requeue_up_to(channel: &Channel, last_tag: Option<u64>) -> anyhow::Result<()> {
    transfer::give_back(channel, last_tag)
        .await
        .context(NOT_RETURNED)
}

/// What `dlq inspect` shows of one message.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    message_id: Option<String>,
    kind: Option<String>,
    reason: Option<String>,
    /// `x-retries` as written (absent: `None`).
    retries: Option<String>,
    /// The AMQP timestamp property (seconds since the epoch).
    timestamp: Option<u64>,
    bytes: usize,
    redelivered: bool,
}

impl Seen {
    fn of(m: &BasicGetMessage) -> Self {
        let p = &m.properties;
        let reason = headers::text(p, headers::X_ERROR_REASON).or_else(|| {
            headers::text(p, headers::X_ERROR_KIND)
                .is_none()
                .then(|| BrokerDeath::of(p).map(|d| d.describe()))
                .flatten()
        });
        Self {
            message_id: p.message_id().as_ref().map(|s| s.as_str().to_string()),
            kind: kind_of(p),
            reason,
            retries: headers::text(p, headers::X_RETRIES),
            timestamp: *p.timestamp(),
            bytes: m.data.len(),
            redelivered: m.redelivered,
        }
    }

    fn row(&self, now: u64) -> Vec<String> {
        let dash = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
        vec![
            dash(&self.message_id),
            dash(&self.kind),
            dash(&self.retries),
            age(now, self.timestamp),
            self.reason
                .as_deref()
                .map(|r| preview(r, 80))
                .unwrap_or_else(|| "-".into()),
        ]
    }

    fn json(&self, now: u64) -> serde_json::Value {
        // A number when it is one, the raw text when it is not (so nothing is hidden).
        let retries = match self.retries.as_deref() {
            None => serde_json::Value::Null,
            Some(raw) => raw
                .parse::<u64>()
                .map(|n| serde_json::json!(n))
                .unwrap_or_else(|_| serde_json::json!(raw)),
        };
        serde_json::json!({
            "message_id": self.message_id,
            "kind": self.kind,
            "reason": self.reason,
            "retries": retries,
            "timestamp": self.timestamp,
            "age_s": self.timestamp.map(|t| now.saturating_sub(t)),
            "bytes": self.bytes,
            "redelivered": self.redelivered,
        })
    }
}

pub(super) async fn inspect(
    settings: &Settings,
    target: &PipelineRecord,
    args: InspectArgs,
) -> anyhow::Result<i32> {
    let conn = broker(settings).await?;
    let version = broker_version(&conn);
    let bound = Bound::of(
        settings.queue_type,
        settings.dlq_delivery_limit,
        version.as_deref(),
    );
    let result = inspect_on(&conn, target, &args, bound).await;
    // Closing the connection returns anything still unacked to the queue, whatever happened.
    amqp::close(None, Some(conn)).await;
    result
}

async fn inspect_on(
    conn: &Connection,
    target: &PipelineRecord,
    args: &InspectArgs,
    bound: Bound,
) -> anyhow::Result<i32> {
    let spend = bound.spend();
    let queue = target.dlq_queue.as_str();
    let total = depth(conn, queue).await?;
    let channel = conn.create_channel().await?;
    let mut seen = Vec::new();
    let mut last_tag = None;
    let mut got = Ok(());
    // The most deliveries a message shown has had, this one included (quorum only).
    let mut most = 0;
    while (seen.len() as u64) < args.limit && (seen.len() as u64) < u64::from(total) {
        // Not acked: each stays unacked on this channel (so it is not returned twice) until the
        // nack below puts them all back.
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
        {
            Ok(Some(m)) => {
                last_tag = Some(m.delivery_tag);
                let delivered = delivered_before(&m) + 1;
                most = most.max(delivered);
                if let Some(spend) = spend.filter(|s| s.too_close(delivered)) {
                    let id = Seen::of(&m).message_id.unwrap_or_else(|| "-".into());
                    got = Err(anyhow::anyhow!(
                        "dlq inspect refused: message {id} in {queue} has been delivered \
                         {delivered} times, within {} of the DLQ's delivery limit of {} \
                         (DLQ_DELIVERY_LIMIT, or RabbitMQ 4's default of 20 when it is 0), past \
                         which the broker drops it; every inspection spends one delivery of each \
                         message shown. Move it out instead (`warren dlq replay`, or `warren \
                         move` to a queue of your own); all messages are left in the queue",
                        spend.margin,
                        spend.limit
                    ));
                    break;
                }
                seen.push(Seen::of(&m));
            }
            Ok(None) => break,
            Err(e) => {
                got = Err(anyhow::anyhow!("basic.get on {queue}: {e}"));
                break;
            }
        }
    }
    let released = requeue_up_to(&channel, last_tag).await;
    let _ = channel.close(200, "bye".into()).await;
    got?;
    released?;

    let now = now_s();
    let spent = match &bound {
        Bound::Limited(spend) if !seen.is_empty() => format!(
            "; this spent 1 delivery of each message shown (quorum DLQ: limit {}, most \
             delivered now {most})",
            spend.limit
        ),
        Bound::Unlimited { version } if !seen.is_empty() => format!(
            "; quorum DLQ without a delivery limit (DLQ_DELIVERY_LIMIT=0 on RabbitMQ \
             {version}, which gives it none): no delivery limit to spend, no check needed"
        ),
        _ => String::new(),
    };
    if args.json {
        for s in &seen {
            outln!(
                "{}",
                crate::cli::json_terminal_safe(&s.json(now).to_string())
            )?;
        }
        errln!(
            "dlq {queue}: {}, {} shown, all left in the queue{spent}",
            plural(u64::from(total), "message"),
            seen.len()
        );
    } else {
        outln!(
            "dlq {queue}: {}, {} shown, all left in the queue{spent}",
            plural(u64::from(total), "message"),
            seen.len()
        )?;
        if !seen.is_empty() {
            let rows: Vec<Vec<String>> = seen.iter().map(|s| s.row(now)).collect();
            out!(
                "{}",
                table(&["MESSAGE ID", "KIND", "RETRIES", "AGE", "REASON"], &rows)
            )?;
        }
    }
    Ok(0)
}

pub(super) async fn replay(
    settings: &Settings,
    target: &PipelineRecord,
    args: ReplayArgs,
) -> anyhow::Result<i32> {
    let conn = broker(settings).await?;
    let result = replay_on(&conn, settings, target, &args).await;
    // Closing the connection returns anything still unacked to the DLQ, whatever happened.
    amqp::close(None, Some(conn)).await;
    let tally = result?;
    let filter = args
        .kind
        .as_deref()
        .map(|k| format!(" of kind {k}"))
        .unwrap_or_default();
    // A closed stdout loses the report, never the exit code of a failure.
    out::unless_closed(outln!(
        "replayed {}{filter} from {} to {} (routing key {}); skipped {} (left in the DLQ); failed {}",
        plural(tally.acked + tally.unacked, "message"),
        target.dlq_queue,
        target.main_exchange,
        target.main_queue,
        tally.skipped,
        tally.failed,
    ))?;
    if let Some(stop) = tally.stopped {
        errln!(
            "warren dlq replay: stopped: {}",
            failure(stop, &target.dlq_queue)
        );
        return Ok(1);
    }
    Ok(0)
}

/// Replays the DLQ through [`transfer`](crate::amqp::transfer): one message at a time, at most
/// the messages it held at the start (`--limit` counts the replayed and the failed, not the
/// skipped), each copy through the republish policy's replay stamp (`x-retries` 0, the
/// `x-error-*` headers gone); a message not of `--kind` is left in the DLQ.
async fn replay_on(
    conn: &Connection,
    settings: &Settings,
    target: &PipelineRecord,
    args: &ReplayArgs,
) -> anyhow::Result<transfer::Tally> {
    let queue = target.dlq_queue.as_str();
    let present = u64::from(depth(conn, queue).await?);
    let plan = transfer::Plan {
        queue,
        take: present,
        publish: args.limit,
        window: 1,
        confirm_timeout: settings.publish_timeout(),
        get_timeout: None,
        frame_max: conn.configuration().frame_max(),
    };
    let mut route = |m: &mut BasicGetMessage| {
        if let Some(want) = &args.kind
            && kind_of(&m.properties).as_deref() != Some(want)
        {
            return None;
        }
        Some(Publish {
            exchange: target.main_exchange.clone(),
            routing_key: target.main_queue.clone(),
            body: std::mem::take(&mut m.data).into(),
            properties: crate::amqp::republish::stamp_origin(
                crate::amqp::republish::for_replay(&m.properties),
                &m.properties,
                m.delivery.exchange.as_str(),
                m.delivery.routing_key.as_str(),
            ),
        })
    };
    // A replay has no stop of its own: a signal ends the process, and the broker returns what
    // it had not acked.
    let never = CancellationToken::new();
    Ok(transfer::transfer(conn, &plan, &mut route, &never).await?)
}

/// What `warren dlq replay` says of a replay of `queue` that stopped early.
fn failure(stop: Stop, queue: &str) -> String {
    match stop {
        Stop::Get(e) => format!("basic.get on {queue}: {e} (unacked messages return to the DLQ)"),
        Stop::GetTimeout(bound) => format!(
            "basic.get on {queue} not answered within {bound:?} (unacked messages return to the \
             DLQ)"
        ),
        // Sent, its confirm lost with the link (or the channel closed meanwhile): the broker
        // may have taken it (review R38-F14: said "not republished", and it was in both).
        Stop::NotPublished {
            message_id,
            error: error @ (amqp::AmqpError::Unconfirmed(_) | amqp::AmqpError::Closed { .. }),
            ..
        } => format!(
            "message {message_id} stays in the DLQ; its copy was sent but not confirmed \
             ({error}): it may or may not have reached its queue too (replaying it again is \
             harmless: the insert is idempotent)"
        ),
        Stop::NotPublished {
            message_id, error, ..
        } => format!("message {message_id} was not republished and stays in the DLQ: {error}"),
        // Republished but still in the DLQ: a later replay sends it again, which the
        // idempotent insert makes harmless.
        Stop::NotAcked {
            message_id, error, ..
        } => format!(
            "message {message_id} was republished but its DLQ copy could not be acked ({error}); \
             replaying it again is harmless"
        ),
        Stop::NotReturned(e) => format!("{:#}", anyhow::Error::new(e).context(NOT_RETURNED)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review R38-F14: a copy sent whose confirm was lost may be in its queue too; one never
    /// sent is not.
    #[test]
    fn a_replay_stopped_by_a_lost_confirm_says_the_copy_may_have_arrived() {
        let stop = |error| Stop::NotPublished {
            message_id: "rp-179".into(),
            error,
            window: 1,
            confirmed: 0,
        };
        let lost = failure(
            stop(amqp::AmqpError::Unconfirmed("connection aborted".into())),
            "q",
        );
        assert!(
            lost.contains("may or may not have reached its queue") && !lost.contains("was not"),
            "{lost}"
        );
        let refused = failure(stop(amqp::AmqpError::Nacked), "q");
        assert!(refused.contains("was not republished"), "{refused}");
    }

    #[test]
    fn the_dlq_bound_follows_the_queue_type_the_limit_and_the_broker_version() {
        let spend = |limit, margin| Bound::Limited(Spend { limit, margin });
        // Classic: no delivery limit at all, whatever the setting or broker.
        assert_eq!(
            Bound::of(QueueType::Classic, 0, Some("4.0.5")),
            Bound::Classic
        );
        // Quorum, 0: none on RabbitMQ 3.x; 20 on 4.x, and when the version cannot be read.
        assert_eq!(
            Bound::of(QueueType::Quorum, 0, Some("3.10.7")),
            Bound::Unlimited {
                version: "3.10.7".into()
            }
        );
        assert_eq!(Bound::of(QueueType::Quorum, 0, Some("4.0.5")), spend(20, 2));
        assert_eq!(
            Bound::of(QueueType::Quorum, 0, Some("4.1.0-rc.1")),
            spend(20, 2)
        );
        assert_eq!(Bound::of(QueueType::Quorum, 0, None), spend(20, 2));
        assert_eq!(Bound::of(QueueType::Quorum, 0, Some("v?")), spend(20, 2));
        // A declared limit is the limit on any broker.
        assert_eq!(
            Bound::of(QueueType::Quorum, 1_000_000, Some("3.10.7")),
            spend(1_000_000, 100_000)
        );
        assert_eq!(
            Bound::of(QueueType::Quorum, 10_000, Some("4.0.5")),
            spend(10_000, 1_000)
        );
        assert_eq!(
            Bound::of(QueueType::Quorum, 0, Some("3.10.7")).spend(),
            None
        );
        let near = Bound::of(QueueType::Quorum, 0, Some("4.0.5"))
            .spend()
            .unwrap();
        assert!(!near.too_close(17) && near.too_close(18));
    }
}
