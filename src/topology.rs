//! The declared RabbitMQ topology: the model read from `topology/topology.toml` with names and
//! the TTL filled from configuration, and an idempotent declare that reports, per object, whether
//! it was created or already matched, and explains drift without ever deleting anything.

use std::collections::BTreeMap;
use std::fmt;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};
use serde::Deserialize;

use crate::amqp::AmqpError;
use crate::config::Settings;

/// The topology template, built into the binary.
pub const TEMPLATE: &str = include_str!("../topology/topology.toml");

/// The whole topology.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
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

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Queue {
    pub name: String,
    /// Queue arguments (`x-message-ttl`, `x-dead-letter-*`), integers or strings.
    #[serde(default)]
    pub arguments: BTreeMap<String, Arg>,
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

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    pub exchange: String,
    pub queue: String,
    /// Defaults to the queue's name.
    #[serde(default)]
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
     warren never deletes or changes an existing object. To resolve it, either\n\
     - make the configuration match what exists ({hint}), or\n\
     - stop what routes to it first (unbind it: RabbitMQ confirms and drops a message routed to a queue \
     being deleted), move its messages away, delete it ({delete_cmd}) and run `warren declare` again."
)]
pub struct Drift {
    pub object: String,
    pub argument: String,
    pub existing: String,
    pub wanted: String,
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

impl Topology {
    /// The topology for `settings`.
    pub fn from_settings(settings: &Settings) -> Result<Self, TopologyError> {
        Self::render(TEMPLATE, settings)
    }

    /// Fills `${setting}` placeholders of `template` from `settings` and parses the result.
    pub fn render(template: &str, settings: &Settings) -> Result<Self, TopologyError> {
        let values =
            toml::Value::try_from(settings).map_err(|e| TopologyError::Template(e.to_string()))?;
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
                .ok_or_else(|| TopologyError::Template(format!("unknown setting ${{{key}}}")))?;
            match value {
                toml::Value::String(s) => {
                    out.push_str(&s.replace('\\', "\\\\").replace('"', "\\\""))
                }
                other => out.push_str(&other.to_string()),
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        toml::from_str(&out).map_err(|e| TopologyError::Template(e.to_string()))
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

fn describe_exchange(e: &Exchange) -> String {
    format!("exchange {} ({}, durable)", e.name, e.kind)
}

fn describe_queue(q: &Queue) -> String {
    let args: Vec<String> = q
        .arguments
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if args.is_empty() {
        format!("queue {} (durable)", q.name)
    } else {
        format!("queue {} (durable, {})", q.name, args.join(", "))
    }
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
            "",
            &format!(
                "rabbitmqadmin delete exchange name={}, or the management UI",
                e.name
            ),
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
        Err(err) => {
            let hint = if q.arguments.contains_key("x-message-ttl") {
                "for the TTL, set RETRY_TTL_MS to the existing value"
            } else {
                "point the *_QUEUE / *_EXCHANGE settings at objects that match"
            };
            Err(drift_or(
                err,
                "queue",
                &q.name,
                hint,
                &format!("rabbitmqctl delete_queue {}", q.name),
            ))
        }
    }
}

/// Turns a PRECONDITION_FAILED into a [`TopologyError::Drift`] that names the argument and both
/// values; any other error passes through.
fn drift_or(
    err: lapin::Error,
    what: &str,
    name: &str,
    hint: &str,
    delete_cmd: &str,
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
    TopologyError::Drift(Box::new(Drift {
        object: format!("{what} {name}"),
        argument,
        existing,
        wanted,
        hint: if hint.is_empty() {
            "rename it in the configuration".into()
        } else {
            hint.into()
        },
        delete_cmd: delete_cmd.into(),
    }))
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

    #[test]
    fn names_with_quotes_stay_inside_their_strings() {
        let mut s = Settings::defaults();
        s.main_queue = "we\"ird\\q".into();
        let t = Topology::from_settings(&s).unwrap();
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
        let text = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'e' in vhost '/': received 'direct' but current is 'fanout'";
        assert_eq!(
            parse_inequivalent(text).unwrap(),
            ("type".into(), "direct".into(), "fanout".into())
        );
    }
}
