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
    /// What names it and its TTL, so that the advice on a drift names what to change.
    pub named_by: NamedBy,
}

/// Where the configuration gives a queue's name and TTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NamedBy {
    /// The built-in users pipeline: the settings `MAIN_QUEUE`, `RETRY_QUEUE`, `RETRY_TTL_MS`, ...
    Settings,
    /// A file's `[[pipelines]]` entry of this name: its own keys (`pipelines.orders.retry_queue`).
    Entry(String),
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
        let named_by = if p.builtin {
            NamedBy::Settings
        } else {
            NamedBy::Entry(p.name.clone())
        };
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
                queues.push(Queue {
                    name,
                    arguments,
                    named_by: named_by.clone(),
                });
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
    /// (What the broker's version allows is checked before, [`Topology::check_broker`].)
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
            bind_on(&channel, b).await?;
            steps.push(Step {
                object: describe_binding(b),
                outcome: Some(Outcome::Bound),
            });
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(steps)
    }
}

/// What [`Topology::check`] found short of a drift.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// The exchanges and queues that do not exist (`queue orders_queue`).
    pub missing: Vec<String>,
    /// Those that exist but whose properties the broker user may not check (a declare needs
    /// the configure permission): only their existence was checked.
    pub unchecked: Vec<String>,
}

impl Topology {
    /// Checks, creating nothing, that every exchange and queue exists with the declared
    /// properties, for `warren run` without `--declare`: an existing one is declared again with
    /// them, which changes nothing when they match and is refused by the broker when they
    /// differ (a [`TopologyError::Drift`] naming the argument, as `warren declare` says it: a
    /// retry queue that still dead-letters to the main queue a reload renamed would strand
    /// every retried message, review R35g F5). One the broker user may not configure
    /// (`ACCESS_REFUSED`) is checked to exist only ([`Checked::unchecked`]). Bindings cannot
    /// be read over AMQP 0-9-1: once every exchange and queue exists, each is declared again
    /// (idempotent), so one missing is made again as `warren declare` makes it (review R35i
    /// F3: a main queue unbound by hand passed, and every retry then vanished at its hop back
    /// through the main exchange). (An object deleted between the two declares is created by
    /// the second, with the declared properties.)
    pub async fn check(&self, conn: &Connection) -> Result<Checked, TopologyError> {
        let mut checked = self.check_objects(conn).await?;
        if checked.missing.is_empty() {
            for b in &self.bindings {
                if refused(bind(conn, b).await)? {
                    checked.unchecked.push(describe_binding(b));
                }
            }
        }
        Ok(checked)
    }

    /// [`Topology::check`] of the exchanges and queues alone, binding nothing: what exists is
    /// declared again with its properties (which changes nothing, or is refused as a drift),
    /// what is missing is named and not made (`warren declare --dry-run`).
    pub async fn check_objects(&self, conn: &Connection) -> Result<Checked, TopologyError> {
        let mut checked = Checked::default();
        for e in &self.exchanges {
            let object = format!("exchange {}", e.name);
            if !crate::amqp::exchange_exists(conn, &e.name).await? {
                checked.missing.push(object);
            } else if refused(assert_exchange(conn, e).await)? {
                checked.unchecked.push(object);
            }
        }
        for q in &self.queues {
            let object = format!("queue {}", q.name);
            if !crate::amqp::queue_exists(conn, &q.name).await? {
                checked.missing.push(object);
            } else if refused(assert_queue(conn, q).await)? {
                checked.unchecked.push(object);
            }
        }
        Ok(checked)
    }
}

/// Whether a declare was refused for want of a permission (`ACCESS_REFUSED`); any other error
/// passes through.
fn refused(result: Result<(), TopologyError>) -> Result<bool, TopologyError> {
    match result {
        Ok(()) => Ok(false),
        Err(TopologyError::Amqp(e)) if e.to_string().contains("ACCESS_REFUSED") => Ok(true),
        Err(e) => Err(e),
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
    assert_exchange(conn, e).await?;
    Ok(if existed {
        Outcome::Matched
    } else {
        Outcome::Created
    })
}

/// Declares `e` with its properties (created if missing; a [`TopologyError::Drift`] if it
/// exists with others).
async fn assert_exchange(conn: &Connection, e: &Exchange) -> Result<(), TopologyError> {
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
            Ok(())
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
    assert_queue(conn, q).await?;
    Ok(if existed {
        Outcome::Matched
    } else {
        Outcome::Created
    })
}

/// Declares the binding `b` (idempotent), on a channel of its own (a refusal closes it).
async fn bind(conn: &Connection, b: &Binding) -> Result<(), TopologyError> {
    let channel: Channel = conn.create_channel().await.map_err(AmqpError::from)?;
    bind_on(&channel, b).await?;
    let _ = channel.close(200, "ok".into()).await;
    Ok(())
}

/// Declares the binding `b` (idempotent) on `channel`.
async fn bind_on(channel: &Channel, b: &Binding) -> Result<(), TopologyError> {
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
    Ok(())
}

/// Declares `q` with its arguments (created if missing; a [`TopologyError::Drift`] if it
/// exists with others).
async fn assert_queue(conn: &Connection, q: &Queue) -> Result<(), TopologyError> {
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
            Ok(())
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
        drift.hint = "on RabbitMQ 3.x, keep it as it is with DLQ_DELIVERY_LIMIT=0 (a quorum queue \
             has no default limit there; on 4.x warren refuses 0), or move its messages to a queue of your own \
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
    // The TTL and the names are the pipeline's own: the users pipeline's settings, or the keys
    // of a file's entry (review R35e F9: a file's pipeline was told to change RETRY_TTL_MS and
    // RETRY_QUEUE, the users pipeline's).
    drift.hint = match (arg, &q.named_by) {
        // The main queue and the DLQ have no TTL: no retry setting makes them match (review
        // R35h F7: a TTL on a main queue got the retry tiers' advice).
        ("x-message-ttl", _) if !q.arguments.contains_key("x-message-ttl") => {
            "warren declares no TTL on this queue (only its retry queues have one): a message \
             waiting in it, paused or behind a backlog, would expire; point the name at another \
             queue, or move its messages away and delete it (below)"
                .into()
        }
        ("x-message-ttl", NamedBy::Settings) => {
            "for the TTL: with one retry queue, set RETRY_TTL_MS to the existing value; with \
             retry tiers (RETRY_TTLS_MS) a tier queue's name carries its TTL, so give \
             RETRY_QUEUE another base name"
                .into()
        }
        ("x-message-ttl", NamedBy::Entry(p)) => format!(
            "for the TTL: the retry queues of pipeline {p} are named in its entry, each tier's after \
             its TTL: give pipelines.{p}.retry_queue another base name, or set \
             pipelines.{p}.retry_ttls_ms to the TTLs it should have (without it, RETRY_TTLS_MS, \
             else RETRY_TTL_MS apply)"
        ),
        ("x-delivery-limit", _) if is_dlq => "set DLQ_DELIVERY_LIMIT to the existing value".into(),
        ("x-delivery-limit", _) => "set DELIVERY_LIMIT to the existing value".into(),
        (_, NamedBy::Settings) => {
            "point the *_QUEUE / *_EXCHANGE settings at objects that match".into()
        }
        (_, NamedBy::Entry(p)) => format!(
            "point the names in the entry of pipeline {p} (pipelines.{p}.main_queue, retry_queue, \
             dlq_queue, main_exchange, retry_exchange, dlx_exchange) at objects that match"
        ),
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

pub mod broker;
pub mod gate;
#[cfg(test)]
mod tests;
