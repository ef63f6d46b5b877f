//! The declared RabbitMQ topology: the model read from `topology/topology.toml` with names and
//! TTLs filled from configuration (one retry queue per retry tier, the quorum arguments when
//! `QUEUE_TYPE` is quorum), and an idempotent declare that reports, per object, whether it was
//! created or already matched, and explains drift (a queue of the other type included) without
//! ever deleting anything.

use std::collections::BTreeMap;
use std::fmt;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};
use serde::Deserialize;

use crate::amqp::AmqpError;
use crate::config::pipelines::PipelineSpec;
use crate::config::{QueueType, RetryTier, Settings};

/// The topology template, built into the binary.
pub const TEMPLATE: &str = include_str!("../topology/topology.toml");

/// The whole topology, resolved for one configuration: names and TTLs filled in, one retry
/// queue per retry tier, the quorum arguments added when `QUEUE_TYPE` is `quorum`.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    pub exchanges: Vec<Exchange>,
    pub queues: Vec<Queue>,
    pub bindings: Vec<Binding>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exchange {
    pub name: String,
    /// `direct`, `fanout`, `topic` or `headers`.
    pub kind: String,
}

/// A queue as declared: its type is its `x-queue-type` argument (none: classic).
#[derive(Debug, Clone, PartialEq)]
pub struct Queue {
    pub name: String,
    /// Queue arguments (`x-message-ttl`, `x-dead-letter-*`, `x-queue-type`, ...).
    pub arguments: BTreeMap<String, Arg>,
}

impl Queue {
    /// `classic` or `quorum`, as the arguments say.
    pub fn queue_type(&self) -> String {
        match self.arguments.get("x-queue-type") {
            Some(t) => t.to_string(),
            None => "classic".into(),
        }
    }
}

/// The template as written in `topology/topology.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Template {
    exchanges: Vec<Exchange>,
    queues: Vec<QueueTemplate>,
    bindings: Vec<BindingTemplate>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct QueueTemplate {
    name: String,
    #[serde(default)]
    arguments: BTreeMap<String, Arg>,
    /// Added to `arguments` when the queue type is quorum.
    #[serde(default)]
    quorum_arguments: BTreeMap<String, Arg>,
    /// Repeated for each retry tier, `${retry_queue}` / `${retry_ttl_ms}` being the tier's.
    #[serde(default)]
    per_retry_tier: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BindingTemplate {
    exchange: String,
    queue: String,
    #[serde(default)]
    routing_key: Option<String>,
    /// Repeated for each retry tier, as the queue it binds.
    #[serde(default)]
    per_retry_tier: bool,
}

/// A queue argument value.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Arg {
    Int(i64),
    Str(String),
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::Int(n) => write!(f, "{n}"),
            Arg::Str(s) => write!(f, "{s}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    pub exchange: String,
    pub queue: String,
    /// Defaults to the queue's name.
    pub routing_key: Option<String>,
}

impl Binding {
    pub fn key(&self) -> &str {
        self.routing_key.as_deref().unwrap_or(&self.queue)
    }
}

/// A topology error: the template is broken, or the broker holds something else.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("topology/topology.toml: {0}")]
    Template(String),
    /// An object exists with other properties; nothing was changed.
    #[error(transparent)]
    Drift(Box<Drift>),
    #[error(transparent)]
    Amqp(#[from] AmqpError),
}

/// An object that exists with other properties than the declared ones.
#[derive(Debug, thiserror::Error)]
#[error(
    "{object} exists with {argument} = {existing}, but warren declares {argument} = {wanted}.\n\
     {note}warren never deletes or changes an existing object. To resolve it, either\n\
     - make the configuration match what exists ({hint}), or\n\
     - stop what routes to it first (unbind it: RabbitMQ confirms and drops a message routed to a queue \
     being deleted), move its messages away, delete it ({delete_cmd}) and run `warren declare` again."
)]
pub struct Drift {
    pub object: String,
    pub argument: String,
    pub existing: String,
    pub wanted: String,
    /// What the difference means, when it says more than the argument (a queue of the other
    /// type); empty or one line ending in a newline.
    pub note: String,
    pub hint: String,
    pub delete_cmd: String,
}

/// What declaring one object did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Created,
    Matched,
    /// Bindings cannot be told apart without the management API: declared idempotently.
    Bound,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Created => "created",
            Outcome::Matched => "already matched",
            Outcome::Bound => "bound",
        })
    }
}

/// One line of a declare report or plan.
#[derive(Debug, Clone)]
pub struct Step {
    /// `exchange raffle_exchange (direct, durable)`.
    pub object: String,
    pub outcome: Option<Outcome>,
}

/// What the topology takes from the settings beside the pipelines: the type of every queue and
/// the quorum queues' delivery limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queues {
    /// `QUEUE_TYPE`.
    pub queue_type: QueueType,
    /// `DELIVERY_LIMIT`: the main queue's (quorum only).
    pub delivery_limit: u32,
    /// `DLQ_DELIVERY_LIMIT`: the DLQ's (quorum only; 0 declares none).
    pub dlq_delivery_limit: u32,
}

impl Queues {
    pub fn of(settings: &Settings) -> Self {
        Self {
            queue_type: settings.queue_type,
            delivery_limit: settings.delivery_limit,
            dlq_delivery_limit: settings.dlq_delivery_limit,
        }
    }
}

impl Topology {
    /// The topology of every pipeline `settings` runs ([`Settings::pipelines`]), one after the
    /// other.
    pub fn from_settings(settings: &Settings) -> Result<Self, TopologyError> {
        let queues = Queues::of(settings);
        let mut all = Topology {
            exchanges: Vec::new(),
            queues: Vec::new(),
            bindings: Vec::new(),
        };
        for p in settings.pipelines() {
            let one = Self::of(p, queues)?;
            all.exchanges.extend(one.exchanges);
            all.queues.extend(one.queues);
            all.bindings.extend(one.bindings);
        }
        Ok(all)
    }

    /// The topology of the pipeline `p`.
    pub fn of(p: &PipelineSpec, queues: Queues) -> Result<Self, TopologyError> {
        Self::render(TEMPLATE, p, queues)
    }

    /// Fills `${name}` placeholders of `template` from the pipeline's names and `queues`, and
    /// resolves it: entries marked `per_retry_tier` once per retry tier (the template is filled
    /// once per tier, with `retry_queue` and `retry_ttl_ms` the tier's), `quorum_arguments`
    /// added for quorum queues.
    pub fn render(template: &str, p: &PipelineSpec, queues: Queues) -> Result<Self, TopologyError> {
        let filled: Vec<Template> = p
            .names
            .retry_tiers
            .iter()
            .map(|tier| fill(template, &placeholders(p, tier, queues)))
            .collect::<Result<_, _>>()?;
        let quorum = queues.queue_type == QueueType::Quorum;
        let mut tiers = filled.into_iter();
        let first = tiers
            .next()
            .ok_or_else(|| TopologyError::Template("no retry tier".into()))?;
        let others: Vec<Template> = tiers.collect();
        let mut queues = Vec::new();
        for (i, q) in first.queues.into_iter().enumerate() {
            let repeat = q.per_retry_tier;
            let copies = std::iter::once(q).chain(
                others
                    .iter()
                    .filter(|_| repeat)
                    .map(|t| t.queues[i].clone()),
            );
            for QueueTemplate {
                name,
                mut arguments,
                quorum_arguments,
                ..
            } in copies
            {
                if quorum {
                    arguments.extend(quorum_arguments);
                }
                // A delivery limit of 0 is not declared (the broker's default applies).
                if arguments.get("x-delivery-limit") == Some(&Arg::Int(0)) {
                    arguments.remove("x-delivery-limit");
                }
                queues.push(Queue { name, arguments });
            }
        }
        let mut bindings = Vec::new();
        for (i, b) in first.bindings.iter().enumerate() {
            let copies = std::iter::once(b).chain(
                others
                    .iter()
                    .filter(|_| b.per_retry_tier)
                    .map(|t| &t.bindings[i]),
            );
            bindings.extend(copies.map(|b| Binding {
                exchange: b.exchange.clone(),
                queue: b.queue.clone(),
                routing_key: b.routing_key.clone(),
            }));
        }
        Ok(Topology {
            exchanges: first.exchanges,
            queues,
            bindings,
        })
    }

    /// The plan, one line per object, nothing declared.
    pub fn plan(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        for e in &self.exchanges {
            steps.push(Step {
                object: describe_exchange(e),
                outcome: None,
            });
        }
        for q in &self.queues {
            steps.push(Step {
                object: describe_queue(q),
                outcome: None,
            });
        }
        for b in &self.bindings {
            steps.push(Step {
                object: describe_binding(b),
                outcome: None,
            });
        }
        steps
    }

    /// Declares every object, in order: exchanges, queues, bindings. Stops at the first drift.
    pub async fn declare(&self, conn: &Connection) -> Result<Vec<Step>, TopologyError> {
        let mut steps = Vec::new();
        for e in &self.exchanges {
            let outcome = declare_exchange(conn, e).await?;
            steps.push(Step {
                object: describe_exchange(e),
                outcome: Some(outcome),
            });
        }
        for q in &self.queues {
            let outcome = declare_queue(conn, q).await?;
            steps.push(Step {
                object: describe_queue(q),
                outcome: Some(outcome),
            });
        }
        let channel = conn.create_channel().await.map_err(AmqpError::from)?;
        for b in &self.bindings {
            channel
                .queue_bind(
                    b.queue.as_str().into(),
                    b.exchange.as_str().into(),
                    b.key().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(AmqpError::from)?;
            steps.push(Step {
                object: describe_binding(b),
                outcome: Some(Outcome::Bound),
            });
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(steps)
    }
}

/// The values of the template's placeholders for one retry tier of the pipeline `p`: its names
/// (under the names of the users pipeline's settings, `main_queue`, ...), the tier's queue and
/// TTL, the queue type and the delivery limits.
fn placeholders(p: &PipelineSpec, tier: &RetryTier, queues: Queues) -> toml::Table {
    let n = &p.names;
    let mut values = toml::Table::new();
    for (key, value) in [
        ("main_exchange", &n.main_exchange),
        ("main_queue", &n.main_queue),
        ("retry_exchange", &n.retry_exchange),
        ("retry_queue", &tier.queue),
        ("dlx_exchange", &n.dlx_exchange),
        ("dlq_queue", &n.dlq_queue),
    ] {
        values.insert(key.into(), toml::Value::String(value.clone()));
    }
    values.insert(
        "queue_type".into(),
        toml::Value::String(queues.queue_type.as_str().into()),
    );
    // Every number fits an i64: the TTL is at most a day, the limits at most 10^9.
    for (key, value) in [
        ("retry_ttl_ms", tier.ttl_ms),
        ("delivery_limit", queues.delivery_limit.into()),
        ("dlq_delivery_limit", queues.dlq_delivery_limit.into()),
    ] {
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        values.insert(key.into(), toml::Value::Integer(value));
    }
    values
}

/// Fills the `${name}` placeholders of `template` from `values` and parses it.
fn fill(template: &str, values: &toml::Table) -> Result<Template, TopologyError> {
    // Comment lines may mention placeholders; only data is filled.
    let data: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut out = String::with_capacity(data.len());
    let mut rest = data.as_str();
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| TopologyError::Template("unclosed ${".into()))?;
        let key = &after[..end];
        let value = values
            .get(key)
            .ok_or_else(|| TopologyError::Template(format!("unknown placeholder ${{{key}}}")))?;
        match value {
            toml::Value::String(s) => out.push_str(&s.replace('\\', "\\\\").replace('"', "\\\"")),
            other => out.push_str(&other.to_string()),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    toml::from_str(&out).map_err(|e| TopologyError::Template(e.to_string()))
}

fn describe_exchange(e: &Exchange) -> String {
    format!("exchange {} ({}, durable)", e.name, e.kind)
}

/// `queue raffle_queue (quorum, durable, x-dead-letter-exchange=raffle_dlx, ...)`: the type
/// first, then the other arguments.
fn describe_queue(q: &Queue) -> String {
    let mut parts = vec![q.queue_type(), "durable".to_string()];
    parts.extend(
        q.arguments
            .iter()
            .filter(|(k, _)| k.as_str() != "x-queue-type")
            .map(|(k, v)| format!("{k}={v}")),
    );
    format!("queue {} ({})", q.name, parts.join(", "))
}

fn describe_binding(b: &Binding) -> String {
    format!(
        "binding {} -> {} (routing key {})",
        b.exchange,
        b.queue,
        b.key()
    )
}

fn kind_of(name: &str) -> ExchangeKind {
    match name {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        other => ExchangeKind::Custom(other.into()),
    }
}

/// Queue arguments as AMQP values: integers as signed 32-bit when they fit (what most clients
/// send), so a queue declared by another tool with the same TTL still matches.
pub fn arguments(q: &Queue) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in &q.arguments {
        let value = match v {
            Arg::Int(n) => match i32::try_from(*n) {
                Ok(small) => AMQPValue::LongInt(small),
                Err(_) => AMQPValue::LongLongInt(*n),
            },
            Arg::Str(s) => AMQPValue::LongString(LongString::from(s.as_bytes().to_vec())),
        };
        table.insert(k.as_str().into(), value);
    }
    table
}

async fn declare_exchange(conn: &Connection, e: &Exchange) -> Result<Outcome, TopologyError> {
    let existed = crate::amqp::exchange_exists(conn, &e.name).await?;
    let channel: Channel = conn.create_channel().await.map_err(AmqpError::from)?;
    let result = channel
        .exchange_declare(
            e.name.as_str().into(),
            kind_of(&e.kind),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match result {
        Ok(()) => {
            let _ = channel.close(200, "ok".into()).await;
            Ok(if existed {
                Outcome::Matched
            } else {
                Outcome::Created
            })
        }
        Err(err) => Err(drift_or(
            err,
            "exchange",
            &e.name,
            &format!(
                "rabbitmqadmin delete exchange name={}, or the management UI",
                e.name
            ),
            |_| {},
        )),
    }
}

async fn declare_queue(conn: &Connection, q: &Queue) -> Result<Outcome, TopologyError> {
    let existed = crate::amqp::queue_exists(conn, &q.name).await?;
    let channel: Channel = conn.create_channel().await.map_err(AmqpError::from)?;
    let result = channel
        .queue_declare(
            q.name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments(q),
        )
        .await;
    match result {
        Ok(_) => {
            let _ = channel.close(200, "ok".into()).await;
            Ok(if existed {
                Outcome::Matched
            } else {
                Outcome::Created
            })
        }
        Err(err) => Err(drift_or(
            err,
            "queue",
            &q.name,
            &format!("rabbitmqctl delete_queue {}", q.name),
            |drift| advise_queue(q, drift),
        )),
    }
}

/// Turns a PRECONDITION_FAILED into a [`TopologyError::Drift`] that names the argument and both
/// values, with the advice `advise` gives; any other error passes through.
fn drift_or(
    err: lapin::Error,
    what: &str,
    name: &str,
    delete_cmd: &str,
    advise: impl FnOnce(&mut Drift),
) -> TopologyError {
    let text = err.to_string();
    if !text.contains("PRECONDITION_FAILED") {
        return TopologyError::Amqp(err.into());
    }
    let (argument, wanted, existing) = parse_inequivalent(&text).unwrap_or_else(|| {
        (
            "a property".into(),
            "?".into(),
            format!("something else ({text})"),
        )
    });
    let mut drift = Drift {
        object: format!("{what} {name}"),
        argument,
        existing,
        wanted,
        note: String::new(),
        hint: "rename it in the configuration".into(),
        delete_cmd: delete_cmd.into(),
    };
    advise(&mut drift);
    TopologyError::Drift(Box::new(drift))
}

/// What RabbitMQ shows for an argument that is not set.
const NOT_SET: &str = "(not set)";

/// The advice for a drifted queue. RabbitMQ names the first argument that differs, in its own
/// order, which for a queue of the other type is seldom `x-queue-type`: a quorum queue over a
/// classic main queue fails on `x-overflow`, a classic one over a quorum main queue on
/// `x-dead-letter-strategy`. Only quorum queues carry these arguments here, so a difference
/// there between "set" and "not set" in the direction of the other type says that type.
fn advise_queue(q: &Queue, drift: &mut Drift) {
    const QUORUM_ONLY: [&str; 4] = [
        "x-queue-type",
        "x-dead-letter-strategy",
        "x-overflow",
        "x-delivery-limit",
    ];
    let wanted_type = q.queue_type();
    let arg = drift.argument.as_str();
    // The DLQ (the queue that dead-letters nowhere) declares its delivery limit since warren
    // declares it explicitly; one declared before that has none, and is still a quorum queue.
    let is_dlq = !q.arguments.contains_key("x-dead-letter-exchange");
    if is_dlq && arg == "x-delivery-limit" && drift.existing == NOT_SET {
        drift.note = "warren declares a quorum DLQ with its delivery limit (DLQ_DELIVERY_LIMIT) \
             since RabbitMQ 4 gives every quorum queue a limit of 20, past which this queue, \
             which dead-letters nowhere, would drop a message; this DLQ was declared without one.\n"
            .into();
        drift.hint = "keep it as it is with DLQ_DELIVERY_LIMIT=0 (on RabbitMQ 3.x a quorum queue \
             has no default limit), or move its messages to a queue of your own \
             (`warren move`), delete it, `warren declare`, and move them back"
            .into();
        return;
    }
    let existing_type = if arg == "x-queue-type" {
        Some(if drift.existing == NOT_SET {
            "classic".to_string()
        } else {
            drift.existing.clone()
        })
    } else if QUORUM_ONLY.contains(&arg) {
        match wanted_type.as_str() {
            "quorum" if drift.existing == NOT_SET => Some("classic".to_string()),
            "classic" if drift.wanted == NOT_SET => Some("quorum".to_string()),
            _ => None,
        }
    } else {
        None
    };
    if let Some(existing_type) = existing_type.filter(|t| *t != wanted_type) {
        let certainty = if arg == "x-queue-type" {
            "It is"
        } else {
            "It looks like"
        };
        drift.note = format!(
            "{certainty} a {existing_type} queue, and QUEUE_TYPE={wanted_type} declares \
             {wanted_type} queues: RabbitMQ never changes the type of an existing queue.\n"
        );
        if matches!(existing_type.as_str(), "classic" | "quorum") {
            drift.hint = format!("set QUEUE_TYPE={existing_type}");
        }
        return;
    }
    drift.hint = match arg {
        "x-message-ttl" => "for the TTL: with one retry queue, set RETRY_TTL_MS to the existing \
                            value; with retry tiers (RETRY_TTLS_MS) a tier queue's name carries \
                            its TTL, so give RETRY_QUEUE another base name"
            .into(),
        "x-delivery-limit" if is_dlq => "set DLQ_DELIVERY_LIMIT to the existing value".into(),
        "x-delivery-limit" => "set DELIVERY_LIMIT to the existing value".into(),
        _ => "point the *_QUEUE / *_EXCHANGE settings at objects that match".into(),
    };
}

/// Reads RabbitMQ's "inequivalent arg 'A' for queue 'Q' in vhost '/': received X but current is
/// Y" into (argument, wanted, existing).
pub fn parse_inequivalent(text: &str) -> Option<(String, String, String)> {
    let start = text.find("inequivalent arg '")? + "inequivalent arg '".len();
    let rest = &text[start..];
    let argument = rest[..rest.find('\'')?].to_string();
    let received = rest.find("received ")? + "received ".len();
    let after = &rest[received..];
    let split = after.find(" but current is ")?;
    let wanted = clean_value(&after[..split]);
    let existing = clean_value(&after[split + " but current is ".len()..]);
    Some((argument, wanted, existing))
}

/// `the value '5000' of type 'long'` -> `5000`; `none` -> `(not set)`.
fn clean_value(raw: &str) -> String {
    let raw = raw.trim().trim_end_matches(['"', ')', '.']);
    if raw == "none" {
        return "(not set)".into();
    }
    let raw = raw.strip_prefix("the value ").unwrap_or(raw);
    let value = match raw.find(" of type ") {
        Some(i) => &raw[..i],
        None => raw,
    };
    value.trim_matches('\'').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_renders_the_documented_topology() {
        let t = Topology::from_settings(&Settings::defaults()).unwrap();
        let names: Vec<_> = t.exchanges.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["raffle_exchange", "raffle_retry_exchange", "raffle_dlx"]
        );
        assert!(t.exchanges.iter().all(|e| e.kind == "direct"));
        let main = &t.queues[0];
        assert_eq!(main.name, "raffle_queue");
        assert_eq!(
            main.arguments["x-dead-letter-exchange"],
            Arg::Str("raffle_dlx".into())
        );
        assert_eq!(
            main.arguments["x-dead-letter-routing-key"],
            Arg::Str("raffle_dlq".into())
        );
        let retry = &t.queues[1];
        assert_eq!(retry.name, "raffle_retry_10s");
        assert_eq!(retry.arguments["x-message-ttl"], Arg::Int(10_000));
        assert_eq!(
            retry.arguments["x-dead-letter-exchange"],
            Arg::Str("raffle_exchange".into())
        );
        assert_eq!(
            retry.arguments["x-dead-letter-routing-key"],
            Arg::Str("raffle_queue".into())
        );
        assert_eq!(t.queues[2].name, "raffle_dlq");
        assert!(t.queues[2].arguments.is_empty());
        assert_eq!(t.bindings.len(), 3);
        assert!(t.bindings.iter().all(|b| b.key() == b.queue));
    }

    /// Every resolved pipeline's objects, each with its own names and tiers: the built-in users
    /// pipeline's from the settings, a file's from its entry (derived from its name).
    #[test]
    fn every_pipeline_renders_its_own_names_and_tiers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"id\"]\n\
             retry_ttls_ms = [1000, 60000]\n[pipelines.columns]\n\
             id = { path = \"/id\", type = \"uuid\" }\n",
        )
        .unwrap();
        let sources = crate::config::Sources {
            file: Some(path),
            use_env: false,
            ..Default::default()
        }
        .with_override("queue_type", "quorum");
        let s = Settings::load(&sources).unwrap();
        let t = Topology::from_settings(&s).unwrap();
        let queues: Vec<_> = t.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(
            queues,
            [
                "raffle_queue",
                "raffle_retry_10s",
                "raffle_dlq",
                "orders_queue",
                "orders_retry_1s",
                "orders_retry_1m",
                "orders_dlq"
            ]
        );
        assert!(t.queues.iter().all(|q| q.queue_type() == "quorum"));
        let orders = &t.queues[4];
        assert_eq!(orders.arguments["x-message-ttl"], Arg::Int(1000));
        assert_eq!(
            orders.arguments["x-dead-letter-routing-key"],
            Arg::Str("orders_queue".into())
        );
        assert_eq!(t.exchanges.len(), 6);
        assert_eq!(t.bindings.len(), 3 + 4);
        // One pipeline alone, as `warren run --pipelines orders` declares it.
        let orders = s.pipeline("orders").unwrap();
        let alone = Topology::of(orders, Queues::of(&s)).unwrap();
        assert_eq!(alone.queues.len(), 4);
        assert_eq!(alone.exchanges[0].name, "orders_exchange");
    }

    #[test]
    fn names_with_quotes_stay_inside_their_strings() {
        let t = Topology::from_settings(&with(&[("main_queue", "we\"ird\\q")])).unwrap();
        assert_eq!(t.queues[0].name, "we\"ird\\q");
    }

    #[test]
    fn rabbitmq_drift_messages_are_read() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '10000' of type 'signedint' but current is the value '5000' of type 'signedint'";
        assert_eq!(
            parse_inequivalent(text).unwrap(),
            ("x-message-ttl".into(), "10000".into(), "5000".into())
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received the value 'dlx' of type 'longstr' but current is none";
        assert_eq!(parse_inequivalent(text).unwrap().2, "(not set)");
        // Quorum queues (RabbitMQ 3.10): a delivery limit is shown bare, a missing argument as none.
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received '5' but current is '20'";
        assert_eq!(
            parse_inequivalent(text).unwrap(),
            ("x-delivery-limit".into(), "5".into(), "20".into())
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': received none but current is the value 'at-least-once' of type 'longstr'";
        assert_eq!(
            parse_inequivalent(text).unwrap(),
            (
                "x-dead-letter-strategy".into(),
                NOT_SET.into(),
                "at-least-once".into()
            )
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'e' in vhost '/': received 'direct' but current is 'fanout'";
        assert_eq!(
            parse_inequivalent(text).unwrap(),
            ("type".into(), "direct".into(), "fanout".into())
        );
    }

    fn with(pairs: &[(&str, &str)]) -> Settings {
        let mut sources = crate::config::Sources {
            use_env: false,
            ..Default::default()
        };
        for (k, v) in pairs {
            sources = sources.with_override(k, *v);
        }
        Settings::load(&sources).unwrap()
    }

    fn args(q: &Queue) -> Vec<(String, String)> {
        q.arguments
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect()
    }

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v: Vec<_> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn classic_queues_carry_no_quorum_argument() {
        let t = Topology::from_settings(&Settings::defaults()).unwrap();
        for q in &t.queues {
            assert_eq!(q.queue_type(), "classic");
            for arg in [
                "x-queue-type",
                "x-overflow",
                "x-dead-letter-strategy",
                "x-delivery-limit",
            ] {
                assert!(!q.arguments.contains_key(arg), "{q:?}");
            }
        }
        assert_eq!(
            describe_queue(&t.queues[2]),
            "queue raffle_dlq (classic, durable)"
        );
    }

    #[test]
    fn the_quorum_topology() {
        let t =
            Topology::from_settings(&with(&[("queue_type", "quorum"), ("delivery_limit", "7")]))
                .unwrap();
        let names: Vec<_> = t.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, ["raffle_queue", "raffle_retry_10s", "raffle_dlq"]);
        assert!(t.queues.iter().all(|q| q.queue_type() == "quorum"));
        assert_eq!(
            args(&t.queues[0]),
            owned(&[
                ("x-dead-letter-exchange", "raffle_dlx"),
                ("x-dead-letter-routing-key", "raffle_dlq"),
                ("x-dead-letter-strategy", "at-least-once"),
                ("x-delivery-limit", "7"),
                ("x-overflow", "reject-publish"),
                ("x-queue-type", "quorum"),
            ])
        );
        assert_eq!(t.queues[0].arguments["x-delivery-limit"], Arg::Int(7));
        assert_eq!(
            args(&t.queues[1]),
            owned(&[
                ("x-dead-letter-exchange", "raffle_exchange"),
                ("x-dead-letter-routing-key", "raffle_queue"),
                ("x-dead-letter-strategy", "at-least-once"),
                ("x-message-ttl", "10000"),
                ("x-overflow", "reject-publish"),
                ("x-queue-type", "quorum"),
            ])
        );
        // The DLQ declares its own delivery limit (RabbitMQ 4 would otherwise give it 20).
        assert_eq!(
            args(&t.queues[2]),
            owned(&[("x-delivery-limit", "1000000"), ("x-queue-type", "quorum")])
        );
        assert_eq!(
            describe_queue(&t.queues[2]),
            "queue raffle_dlq (quorum, durable, x-delivery-limit=1000000)"
        );
        // 0 declares none.
        let t = Topology::from_settings(&with(&[
            ("queue_type", "quorum"),
            ("dlq_delivery_limit", "0"),
        ]))
        .unwrap();
        assert_eq!(args(&t.queues[2]), owned(&[("x-queue-type", "quorum")]));
        assert!(describe_queue(&t.queues[0]).starts_with("queue raffle_queue (quorum, durable, "));
    }

    #[test]
    fn retry_tiers_are_one_queue_and_binding_each() {
        let t = Topology::from_settings(&with(&[("retry_ttls_ms", "1000,10000,60000")])).unwrap();
        let queues: Vec<_> = t
            .queues
            .iter()
            .map(|q| (q.name.as_str(), q.arguments.get("x-message-ttl").cloned()))
            .collect();
        assert_eq!(
            queues,
            [
                ("raffle_queue", None),
                ("raffle_retry_1s", Some(Arg::Int(1000))),
                ("raffle_retry_10s", Some(Arg::Int(10_000))),
                ("raffle_retry_1m", Some(Arg::Int(60_000))),
                ("raffle_dlq", None),
            ]
        );
        for q in &t.queues[1..4] {
            assert_eq!(
                q.arguments["x-dead-letter-exchange"],
                Arg::Str("raffle_exchange".into())
            );
            assert_eq!(
                q.arguments["x-dead-letter-routing-key"],
                Arg::Str("raffle_queue".into())
            );
        }
        let bindings: Vec<_> = t
            .bindings
            .iter()
            .map(|b| (b.exchange.as_str(), b.queue.as_str(), b.key()))
            .collect();
        assert_eq!(
            bindings,
            [
                ("raffle_exchange", "raffle_queue", "raffle_queue"),
                (
                    "raffle_retry_exchange",
                    "raffle_retry_1s",
                    "raffle_retry_1s"
                ),
                (
                    "raffle_retry_exchange",
                    "raffle_retry_10s",
                    "raffle_retry_10s"
                ),
                (
                    "raffle_retry_exchange",
                    "raffle_retry_1m",
                    "raffle_retry_1m"
                ),
                ("raffle_dlx", "raffle_dlq", "raffle_dlq"),
            ]
        );
        // Quorum tiers get the quorum arguments, each.
        let t = Topology::from_settings(&with(&[
            ("retry_ttls_ms", "300,600"),
            ("queue_type", "quorum"),
        ]))
        .unwrap();
        assert_eq!(t.queues.len(), 4);
        for q in &t.queues[1..3] {
            assert_eq!(q.queue_type(), "quorum");
            assert_eq!(
                q.arguments["x-dead-letter-strategy"],
                Arg::Str("at-least-once".into())
            );
            assert!(!q.arguments.contains_key("x-delivery-limit"));
        }
    }

    fn drift_of(q: &Queue, argument: &str, existing: &str, wanted: &str) -> Drift {
        let mut d = Drift {
            object: format!("queue {}", q.name),
            argument: argument.into(),
            existing: existing.into(),
            wanted: wanted.into(),
            note: String::new(),
            hint: String::new(),
            delete_cmd: "rabbitmqctl delete_queue q".into(),
        };
        advise_queue(q, &mut d);
        d
    }

    #[test]
    fn a_queue_of_the_other_type_is_named_as_such() {
        let quorum = Topology::from_settings(&with(&[("queue_type", "quorum")])).unwrap();
        let classic = Topology::from_settings(&Settings::defaults()).unwrap();
        // What RabbitMQ 3.10 reports for warren's main queue and DLQ of the other type.
        let d = drift_of(&quorum.queues[0], "x-overflow", NOT_SET, "reject-publish");
        assert!(
            d.note
                .starts_with("It looks like a classic queue, and QUEUE_TYPE=quorum"),
            "{}",
            d.note
        );
        assert_eq!(d.hint, "set QUEUE_TYPE=classic");
        let d = drift_of(
            &classic.queues[0],
            "x-dead-letter-strategy",
            "at-least-once",
            NOT_SET,
        );
        assert!(
            d.note
                .starts_with("It looks like a quorum queue, and QUEUE_TYPE=classic"),
            "{}",
            d.note
        );
        assert_eq!(d.hint, "set QUEUE_TYPE=quorum");
        let d = drift_of(&quorum.queues[2], "x-queue-type", NOT_SET, "quorum");
        assert!(d.note.starts_with("It is a classic queue"), "{}", d.note);
        let d = drift_of(&classic.queues[2], "x-queue-type", "quorum", NOT_SET);
        assert!(d.note.starts_with("It is a quorum queue"), "{}", d.note);
        let text = TopologyError::Drift(Box::new(d)).to_string();
        assert!(
            text.starts_with(
                "queue raffle_dlq exists with x-queue-type = quorum, but warren declares \
                 x-queue-type = (not set).\nIt is a quorum queue, and QUEUE_TYPE=classic declares \
                 classic queues: RabbitMQ never changes the type of an existing queue.\n\
                 warren never deletes or changes an existing object."
            ),
            "{text}"
        );
        assert!(text.contains("(set QUEUE_TYPE=quorum)"), "{text}");
        // A quorum DLQ declared before warren declared its delivery limit.
        let d = drift_of(&quorum.queues[2], "x-delivery-limit", NOT_SET, "1000000");
        assert!(
            d.note
                .starts_with("warren declares a quorum DLQ with its delivery limit")
        );
        assert!(d.hint.contains("DLQ_DELIVERY_LIMIT=0"), "{}", d.hint);
        let d = drift_of(&quorum.queues[2], "x-delivery-limit", "50", "1000000");
        assert_eq!(d.hint, "set DLQ_DELIVERY_LIMIT to the existing value");
        // Same type, other values: the plain advice.
        let d = drift_of(&quorum.queues[0], "x-delivery-limit", "20", "7");
        assert_eq!(d.note, "");
        assert_eq!(d.hint, "set DELIVERY_LIMIT to the existing value");
        let d = drift_of(&classic.queues[1], "x-message-ttl", "5000", "10000");
        assert_eq!(d.note, "");
        assert!(
            d.hint.contains("set RETRY_TTL_MS to the existing value"),
            "{}",
            d.hint
        );
    }
}
