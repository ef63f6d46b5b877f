//! Lifecycle events: what happens to this instance and its pipelines, appended to the Redis
//! stream `<REDIS_PREFIX>:events` (capped with `MAXLEN ~ EVENTS_MAX_LEN`) for another program to
//! follow and act on (`warren events --follow`, a UI, an alerting bot) without being wired in.
//!
//! Each stream entry has one field, `event`, holding a JSON object: `v` (the format's version,
//! [`VERSION`]), `type`, `time` (RFC 3339, UTC), `host`, `pid`, `pipeline` (when the event is
//! about one) and the type's own fields ([`Kind`]); docs/events.md describes every type.
//!
//! The data path never waits on Redis: [`emit`] is a non-blocking send into a bounded channel
//! that one background task ([`start`]) drains, a pipelined `XADD` per chunk. A full channel
//! (Redis slow or down) or a failed write drops the events, counted in
//! `warren_events_dropped_total{reason}`; nothing blocks, and nothing is retried but a write on a
//! link Redis dropped since it was made (a restart: `registry::redis`), once on a new link.
//!
//! What an event holds and what waits are bounded, whatever the messages carry: every text field
//! is capped at [`SHOWN_MAX`] bytes (a refused message's reason, its id, its `traceparent`), and
//! the events waiting for the writer, the chunk being written included, hold at most
//! [`QUEUE_BYTES`] of JSON; the Redis write of a chunk copies at most [`CHUNK_BYTES`] of it
//! twice (the command, its encoding). So events take at most [`MEMORY_BOUND`] (6 MiB) beside
//! what `MAX_INFLIGHT_BYTES` bounds, even when Redis accepts connections and never answers
//! (docs/events.md).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::sync::{mpsc, oneshot};

use crate::metrics;
use crate::registry::RedisConfig;
use crate::registry::redis::Redis;
use crate::text::{SHOWN_MAX, shown};

/// The version of the event format: bumped when a field changes meaning or disappears (new
/// fields and new types do not bump it).
pub const VERSION: u32 = 1;

/// Events waiting for the writer at most; past it they are dropped (`reason="full"`).
const QUEUE: usize = 10_000;

/// Bytes of events (their JSON, and [`ITEM_BYTES`] each) waiting for the writer or being written
/// at most; past it new events are dropped (`reason="full"`).
pub const QUEUE_BYTES: usize = 4 << 20;

/// What one waiting event takes beside its JSON's bytes: the queue's slot, the string's header
/// and the allocator's rounding.
const ITEM_BYTES: usize = 64;

/// Events written to Redis in one pipelined round trip at most.
const CHUNK: usize = 500;

/// Bytes of events' JSON in one pipelined round trip at most (a larger chunk is written in
/// several): what the Redis command and its encoding copy.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The most memory events take, waiting and being written: [`QUEUE_BYTES`] and two copies of
/// one round trip's [`CHUNK_BYTES`]. docs/events.md and docs/failures.md state it.
pub const MEMORY_BOUND: usize = QUEUE_BYTES + 2 * CHUNK_BYTES;

/// Bytes counted against [`QUEUE_BYTES`] now: added by [`emit`], taken off once written (or
/// dropped) by the writer.
static QUEUED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// What happened, with the fields of its type.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Kind {
    /// `warren run` started its roles.
    Started { version: String, roles: String },
    /// Every link the roles need is up (`/readyz` answers 200).
    Ready,
    /// An operator paused the pipeline (or all): no new deliveries.
    Paused { by: String },
    /// An operator resumed it.
    Resumed { by: String },
    /// The graceful shutdown began (`signal`, `drain`).
    Draining { reason: String },
    /// The process is about to exit with `exit_code` (0: every delivery settled or given back
    /// in time; 1: the shutdown timeout left some in flight). Of the deliveries its stop had in
    /// hand, `settled` were acked (stored, dead-lettered, parked) and `given_back` went back to
    /// the broker unprocessed (they wait in their queues for the next consumer).
    Stopped {
        exit_code: i32,
        settled: u64,
        given_back: u64,
    },
    /// A link to `target` (`broker`, `database`) went down; `link` names which (a pipeline's
    /// consumer, a publisher), `node` the broker node it was on.
    LinkLost {
        target: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        link: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        node: Option<String>,
    },
    /// The link is up again, on `node`.
    LinkRestored {
        target: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        link: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        node: Option<String>,
    },
    /// The sink-outage breaker opened: the pipeline holds its deliveries until the database
    /// answers.
    BreakerOpened { failures: u32 },
    /// The breaker closed: deliveries flow again.
    BreakerClosed,
    /// The pipeline's concurrency of `what` (`processors`, `inserts`) changed.
    Scaled {
        what: String,
        from: usize,
        to: usize,
        reason: String,
    },
    /// A batch committed: `rows` messages stored (of `messages`) in `duration_ms`; `stale`
    /// of them older than their key's version (changed nothing) and `deleted` deletes that
    /// hold, both acked and not counted in `rows` (absent when 0). One per batch.
    BatchCommitted {
        rows: u64,
        messages: u64,
        duration_ms: u64,
        #[serde(skip_serializing_if = "is_zero")]
        stale: u64,
        #[serde(skip_serializing_if = "is_zero")]
        deleted: u64,
    },
    /// A message was republished to the dead-letter exchange.
    DeadLettered {
        message_id: String,
        kind: String,
        reason: String,
        /// The message's W3C `traceparent`, when it has a valid one.
        #[serde(skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    /// The DLQ stage parked a message in `dead_letters`.
    Parked {
        message_id: String,
        kind: String,
        reason: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    /// A message older than the version its key holds or its batch writes
    /// (`on_conflict = "update"`): acked, it changed nothing; `reason` names the key and both
    /// versions.
    Stale { message_id: String, reason: String },
    /// Deliveries held too long were given back to the queue before the broker's consumer
    /// timeout (nack with requeue).
    GivenBack { count: u64, reason: String },
    /// Something failed that an operator should know about.
    Error { message: String },
    /// A reload (`SIGHUP`, `warren ctl reload`) applied the configuration: the pipelines it
    /// started, stopped, and drained and started again with their new spec, by name;
    /// `restart_needed` the settings it changed that apply only at a restart.
    Reloaded {
        added: Vec<String>,
        removed: Vec<String>,
        changed: Vec<String>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        restart_needed: Vec<String>,
        /// Whether every stage it stopped settled all its deliveries within
        /// `SHUTDOWN_TIMEOUT_MS`; false: the rest went back to their queues (nothing lost).
        drained: bool,
        /// Queues of the pipelines removed or changed that no pipeline consumes now,
        /// `queue (pipeline)`: what they hold waits there until moved (absent when none).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        left_queues: Vec<String>,
    },
    /// A reload found a configuration that does not load or check (or a table that does not
    /// fit): nothing changed; `reason` says where and what.
    ReloadFailed { reason: String },
}

/// For `skip_serializing_if`: a count of 0 is left out.
fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Kind {
    /// The `type` field of this kind, as written.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Started { .. } => "started",
            Kind::Ready => "ready",
            Kind::Paused { .. } => "paused",
            Kind::Resumed { .. } => "resumed",
            Kind::Draining { .. } => "draining",
            Kind::Stopped { .. } => "stopped",
            Kind::LinkLost { .. } => "link_lost",
            Kind::LinkRestored { .. } => "link_restored",
            Kind::BreakerOpened { .. } => "breaker_opened",
            Kind::BreakerClosed => "breaker_closed",
            Kind::Scaled { .. } => "scaled",
            Kind::BatchCommitted { .. } => "batch_committed",
            Kind::DeadLettered { .. } => "dead_lettered",
            Kind::Parked { .. } => "parked",
            Kind::Stale { .. } => "stale",
            Kind::GivenBack { .. } => "given_back",
            Kind::Error { .. } => "error",
            Kind::Reloaded { .. } => "reloaded",
            Kind::ReloadFailed { .. } => "reload_failed",
        }
    }

    /// This kind with every text field capped at [`SHOWN_MAX`] bytes ([`shown`]): a reason, a
    /// message id, a `traceparent` come from messages, and an event never grows with them.
    pub fn bounded(self) -> Self {
        let cap = |s: String| -> String {
            if s.len() <= SHOWN_MAX {
                s
            } else {
                shown(&s).into_owned()
            }
        };
        let opt = |s: Option<String>| s.map(cap);
        match self {
            Kind::Started { version, roles } => Kind::Started {
                version: cap(version),
                roles: cap(roles),
            },
            Kind::Paused { by } => Kind::Paused { by: cap(by) },
            Kind::Resumed { by } => Kind::Resumed { by: cap(by) },
            Kind::Draining { reason } => Kind::Draining {
                reason: cap(reason),
            },
            Kind::LinkLost { target, link, node } => Kind::LinkLost {
                target: cap(target),
                link: opt(link),
                node: opt(node),
            },
            Kind::LinkRestored { target, link, node } => Kind::LinkRestored {
                target: cap(target),
                link: opt(link),
                node: opt(node),
            },
            Kind::Scaled {
                what,
                from,
                to,
                reason,
            } => Kind::Scaled {
                what: cap(what),
                from,
                to,
                reason: cap(reason),
            },
            Kind::DeadLettered {
                message_id,
                kind,
                reason,
                traceparent,
            } => Kind::DeadLettered {
                message_id: cap(message_id),
                kind: cap(kind),
                reason: cap(reason),
                traceparent: opt(traceparent),
            },
            Kind::Parked {
                message_id,
                kind,
                reason,
                traceparent,
            } => Kind::Parked {
                message_id: cap(message_id),
                kind: cap(kind),
                reason: cap(reason),
                traceparent: opt(traceparent),
            },
            Kind::Stale { message_id, reason } => Kind::Stale {
                message_id: cap(message_id),
                reason: cap(reason),
            },
            Kind::GivenBack { count, reason } => Kind::GivenBack {
                count,
                reason: cap(reason),
            },
            Kind::Error { message } => Kind::Error {
                message: cap(message),
            },
            Kind::Reloaded {
                added,
                removed,
                changed,
                restart_needed,
                drained,
                left_queues,
            } => {
                let all = |v: Vec<String>| v.into_iter().map(cap).collect();
                Kind::Reloaded {
                    added: all(added),
                    removed: all(removed),
                    changed: all(changed),
                    restart_needed: all(restart_needed),
                    drained,
                    left_queues: all(left_queues),
                }
            }
            Kind::ReloadFailed { reason } => Kind::ReloadFailed {
                reason: cap(reason),
            },
            other @ (Kind::Ready
            | Kind::Stopped { .. }
            | Kind::BreakerOpened { .. }
            | Kind::BreakerClosed
            | Kind::BatchCommitted { .. }) => other,
        }
    }

    /// Every type, as written (docs/events.md lists the same).
    pub const NAMES: [&'static str; 19] = [
        "started",
        "ready",
        "paused",
        "resumed",
        "draining",
        "stopped",
        "link_lost",
        "link_restored",
        "breaker_opened",
        "breaker_closed",
        "scaled",
        "batch_committed",
        "dead_lettered",
        "parked",
        "stale",
        "given_back",
        "error",
        "reloaded",
        "reload_failed",
    ];
}

/// One event as it is written to the stream.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub v: u32,
    #[serde(flatten)]
    pub kind: Kind,
    pub time: String,
    pub host: String,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
}

impl Event {
    /// `kind`, now, from this process, about the pipeline named `pipeline` if any; its text
    /// fields capped ([`Kind::bounded`]).
    pub fn new(pipeline: Option<&str>, kind: Kind) -> Self {
        Self {
            v: VERSION,
            kind: kind.bounded(),
            time: OffsetDateTime::now_utc()
                .format(&Rfc3339)
                .unwrap_or_default(),
            host: HOST.get_or_init(crate::hostname).clone(),
            pid: std::process::id(),
            pipeline: pipeline.map(str::to_string),
        }
    }

    /// The JSON object of the `event` field.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// This machine's host name, read once.
static HOST: OnceLock<String> = OnceLock::new();

/// The AMQP links seen so far and whether each is up, and the node each was last on: a link's
/// first connect is not an event, a loss and the restore after it are.
static LINKS: Mutex<Option<HashMap<String, LinkState>>> = Mutex::new(None);

/// Whether a link is up, and the broker node it was last on.
type LinkState = (bool, Option<String>);

/// An AMQP link of this process (a pipeline's consumer, a publisher) came up or went down:
/// reported to the metrics ([`metrics::amqp_link`]) and, on a change after its first connect,
/// as `link_lost` / `link_restored` with the node, about `pipeline` when the link is one of a
/// pipeline's consumers (`<pipeline>/<stage>`), not a publisher.
pub fn amqp_link(link: &str, up: bool, pipeline: Option<&str>) {
    metrics::amqp_link(link, up);
    let changed = {
        let mut guard = LINKS.lock().unwrap_or_else(|p| p.into_inner());
        let links = guard.get_or_insert_with(HashMap::new);
        let node = metrics::amqp_node_of(link);
        match links.insert(link.to_string(), (up, node.clone())) {
            Some((was, old_node)) if was != up => Some(if up { node } else { old_node.or(node) }),
            None if !up => Some(node),
            _ => None,
        }
    };
    if let Some(node) = changed {
        let (target, link) = ("broker".to_string(), Some(link.to_string()));
        let kind = if up {
            Kind::LinkRestored { target, link, node }
        } else {
            Kind::LinkLost { target, link, node }
        };
        emit(pipeline, kind);
    }
}

/// A publisher's link came up or went down ([`crate::amqp::publisher::LinkReport`]): the link
/// metric and `link_lost` / `link_restored`, as [`amqp_link`] for a link that is no pipeline's.
pub fn publisher_link(purpose: &'static str, up: bool) {
    amqp_link(purpose, up, None);
}

/// Whether the database answered (`up`), reported to the metrics ([`metrics::postgres`]) and,
/// on a change after the first answer, as `link_lost` / `link_restored` of the database.
pub fn database(up: bool) {
    static SEEN: AtomicU8 = AtomicU8::new(0);
    let now = if up { 1 } else { 2 };
    let was = SEEN.swap(now, Ordering::Relaxed);
    metrics::postgres(up);
    if was != now && (was != 0 || !up) {
        let (target, link, node) = ("database".to_string(), None, None);
        emit(
            None,
            if up {
                Kind::LinkRestored { target, link, node }
            } else {
                Kind::LinkLost { target, link, node }
            },
        );
    }
}

/// What the writer task is handed.
enum Item {
    /// An event's JSON, and the bytes it counts against [`QUEUE_BYTES`].
    Event(String, usize),
    /// Answered once everything sent before it was written (or dropped).
    Flush(oneshot::Sender<()>),
}

/// The writer's inbox; unset until [`start`] (and in subcommands, which emit nothing).
static INBOX: OnceLock<mpsc::Sender<Item>> = OnceLock::new();

/// Emits `kind` about the pipeline named `pipeline`, if any.
/// Never blocks; a full inbox (in events or in [`QUEUE_BYTES`]) drops the event and counts it.
pub fn emit(pipeline: Option<&str>, kind: Kind) {
    let Some(inbox) = INBOX.get() else {
        return;
    };
    let json = Event::new(pipeline, kind).to_json();
    let bytes = json.len() + ITEM_BYTES;
    if !reserve(bytes) {
        metrics::events_dropped("full", 1);
        return;
    }
    if inbox.try_send(Item::Event(json, bytes)).is_err() {
        release(bytes);
        metrics::events_dropped("full", 1);
    }
}

/// Counts `bytes` against [`QUEUE_BYTES`]; `false` (nothing counted) when they do not fit.
fn reserve(bytes: usize) -> bool {
    QUEUED_BYTES
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
            (queued + bytes <= QUEUE_BYTES).then_some(queued + bytes)
        })
        .is_ok()
}

/// Takes `bytes` off the count of [`QUEUE_BYTES`] (written or dropped).
fn release(bytes: usize) {
    QUEUED_BYTES.fetch_sub(bytes, Ordering::AcqRel);
}

/// Waits (at most `bound`) until every event emitted so far was written or dropped: the last
/// events of a stopping process reach Redis before it exits.
pub async fn flush(bound: Duration) {
    let Some(inbox) = INBOX.get() else {
        return;
    };
    let (tx, rx) = oneshot::channel();
    if inbox.try_send(Item::Flush(tx)).is_ok() {
        let _ = tokio::time::timeout(bound, rx).await;
    }
}

/// The stream's key for `prefix`.
pub fn stream_key(prefix: &str) -> String {
    format!("{prefix}:events")
}

/// The events writer's own settings, built from warren's above this module
/// (`config::components`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsConfig {
    /// The deployment's Redis, whose `<REDIS_PREFIX>:events` stream the events go to.
    pub redis: RedisConfig,
    /// Entries the stream keeps, about (`EVENTS_MAX_LEN`, `XADD MAXLEN ~`); 0 turns events off.
    pub max_len: u64,
}

impl EventsConfig {
    /// Redis's rules (`max_len` takes any value: 0 is off).
    pub fn validate(&self) -> Result<(), crate::registry::RegistryConfigError> {
        self.redis.validate()
    }
}

/// Starts the writer task (once per process); `EVENTS_MAX_LEN = 0` turns events off.
pub fn start(config: &EventsConfig) {
    if config.max_len == 0 {
        return;
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    if INBOX.set(tx).is_err() {
        return;
    }
    let key = stream_key(&config.redis.prefix);
    // Quiet: the registry's own link warns of a Redis outage once; the events count their drops.
    let redis = Redis::quiet(&config.redis.url);
    tokio::spawn(write(rx, redis, key, config.max_len));
}

/// The writer: a chunk of what waits, one pipelined `XADD` per [`CHUNK_BYTES`] of it, until the
/// process ends. The chunk's events stay counted against [`QUEUE_BYTES`] until written.
async fn write(mut rx: mpsc::Receiver<Item>, mut redis: Redis, key: String, max_len: u64) {
    let mut items = Vec::with_capacity(CHUNK);
    while rx.recv_many(&mut items, CHUNK).await > 0 {
        let mut flushes = Vec::new();
        let mut round: Vec<(String, usize)> = Vec::new();
        let mut round_bytes = 0;
        for item in items.drain(..) {
            match item {
                Item::Event(json, bytes) => {
                    if round_bytes + json.len() > CHUNK_BYTES && !round.is_empty() {
                        send(&mut redis, &key, max_len, std::mem::take(&mut round)).await;
                        round_bytes = 0;
                    }
                    round_bytes += json.len();
                    round.push((json, bytes));
                }
                Item::Flush(done) => flushes.push(done),
            }
        }
        if !round.is_empty() {
            send(&mut redis, &key, max_len, round).await;
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// Writes `events` (JSON, counted bytes) in one pipelined round trip, then takes them off the
/// count of [`QUEUE_BYTES`], written or dropped.
async fn send(redis: &mut Redis, key: &str, max_len: u64, events: Vec<(String, usize)>) {
    let mut pipe = redis::pipe();
    let mut bytes = 0;
    for (json, counted) in &events {
        bytes += counted;
        pipe.cmd("XADD")
            .arg(key)
            .arg("MAXLEN")
            .arg("~")
            .arg(max_len)
            .arg("*")
            .arg("event")
            .arg(json)
            .ignore();
    }
    let n = events.len() as u64;
    drop(events);
    if redis.pipe::<()>(&pipe).await.is_none() {
        metrics::events_dropped("redis", n);
    }
    release(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of every kind, with its fields.
    fn every_kind() -> Vec<Kind> {
        vec![
            Kind::Started {
                version: "0.1.0".into(),
                roles: "consumer,dlq,api".into(),
            },
            Kind::Ready,
            Kind::Paused { by: "ctl".into() },
            Kind::Resumed { by: "ctl".into() },
            Kind::Draining {
                reason: "signal".into(),
            },
            Kind::Stopped {
                exit_code: 0,
                settled: 10,
                given_back: 0,
            },
            Kind::LinkLost {
                target: "broker".into(),
                link: Some("users/main".into()),
                node: Some("127.0.0.1:5672".into()),
            },
            Kind::LinkRestored {
                target: "database".into(),
                link: None,
                node: None,
            },
            Kind::BreakerOpened { failures: 3 },
            Kind::BreakerClosed,
            Kind::Scaled {
                what: "processors".into(),
                from: 1,
                to: 4,
                reason: "operator".into(),
            },
            Kind::BatchCommitted {
                rows: 99,
                messages: 100,
                duration_ms: 12,
                stale: 0,
                deleted: 0,
            },
            Kind::DeadLettered {
                message_id: "m-1".into(),
                kind: "invalid_json".into(),
                reason: "expected value".into(),
                traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            },
            Kind::Parked {
                message_id: "m-1".into(),
                kind: "invalid_json".into(),
                reason: "expected value".into(),
                traceparent: None,
            },
            Kind::Stale {
                message_id: "m-2".into(),
                reason: "id a version 2 is older than the stored version 3: it changes nothing"
                    .into(),
            },
            Kind::GivenBack {
                count: 7,
                reason: "consumer_timeout".into(),
            },
            Kind::Error {
                message: "boom".into(),
            },
            Kind::Reloaded {
                added: vec!["orders".into()],
                removed: vec![],
                changed: vec!["users".into()],
                restart_needed: vec!["amqp_url".into()],
                drained: true,
                left_queues: vec!["orders_queue (orders)".into()],
            },
            Kind::ReloadFailed {
                reason: "pipelines[1].batch_size: expected 1 to 10000, got 0".into(),
            },
        ]
    }

    /// Every type serializes with the common fields and its own, its `type` as documented.
    #[test]
    fn every_type_has_the_common_fields_and_its_name() {
        let kinds = every_kind();
        assert_eq!(
            kinds.iter().map(Kind::name).collect::<Vec<_>>(),
            Kind::NAMES,
            "one of each, in the documented order"
        );
        for kind in kinds {
            let name = kind.name();
            let json: serde_json::Value =
                serde_json::from_str(&Event::new(Some("orders"), kind).to_json()).expect("JSON");
            assert_eq!(json["v"], VERSION, "{json}");
            assert_eq!(json["type"], name, "{json}");
            assert_eq!(json["pipeline"], "orders", "{json}");
            assert_eq!(json["pid"], std::process::id(), "{json}");
            assert!(json["host"].as_str().is_some_and(|h| !h.is_empty()));
            let time = json["time"].as_str().expect("time");
            assert!(
                OffsetDateTime::parse(time, &Rfc3339).is_ok(),
                "RFC 3339: {time}"
            );
        }
    }

    #[test]
    fn the_fields_of_each_type_are_named_as_documented() {
        let json = |k: Kind| -> serde_json::Value {
            serde_json::from_str(&Event::new(None, k).to_json()).expect("JSON")
        };
        let e = json(Kind::Scaled {
            what: "inserts".into(),
            from: 2,
            to: 3,
            reason: "backlog".into(),
        });
        assert_eq!((e["from"].as_u64(), e["to"].as_u64()), (Some(2), Some(3)));
        assert_eq!(e["reason"], "backlog");
        assert!(e.get("pipeline").is_none(), "no pipeline when none: {e}");
        let e = json(Kind::BatchCommitted {
            rows: 5,
            messages: 6,
            duration_ms: 7,
            stale: 0,
            deleted: 0,
        });
        assert_eq!(
            (e["rows"].as_u64(), e["duration_ms"].as_u64()),
            (Some(5), Some(7))
        );
        assert!(
            e.get("stale").is_none() && e.get("deleted").is_none(),
            "{e}"
        );
        let e = json(Kind::BatchCommitted {
            rows: 1,
            messages: 4,
            duration_ms: 7,
            stale: 2,
            deleted: 1,
        });
        assert_eq!(
            (e["stale"].as_u64(), e["deleted"].as_u64()),
            (Some(2), Some(1))
        );
        let e = json(Kind::Stopped {
            exit_code: 1,
            settled: 3,
            given_back: 100,
        });
        assert_eq!(
            (
                e["exit_code"].as_i64(),
                e["settled"].as_u64(),
                e["given_back"].as_u64()
            ),
            (Some(1), Some(3), Some(100))
        );
        let e = json(Kind::LinkLost {
            target: "broker".into(),
            link: None,
            node: None,
        });
        assert!(e.get("node").is_none(), "{e}");
        let e = json(Kind::Reloaded {
            added: vec!["orders".into()],
            removed: vec![],
            changed: vec![],
            restart_needed: vec![],
            drained: false,
            left_queues: vec![],
        });
        assert_eq!(e["drained"], false, "{e}");
        assert_eq!(e["added"], serde_json::json!(["orders"]), "{e}");
        assert_eq!(e["removed"], serde_json::json!([]), "{e}");
        assert!(e.get("restart_needed").is_none(), "only when some: {e}");
        let e = json(Kind::ReloadFailed {
            reason: "bad".into(),
        });
        assert_eq!(e["reason"], "bad", "{e}");
    }

    /// Issue 34, item 3: an event never carries more of a message than [`SHOWN_MAX`] bytes of
    /// each field (a 30 KB reason, a long id or traceparent), whatever its type.
    #[test]
    fn every_text_field_of_an_event_is_capped() {
        let long = "r".repeat(30_000);
        for kind in every_kind() {
            let inflated = match kind {
                Kind::DeadLettered { kind, .. } => Kind::DeadLettered {
                    message_id: long.clone(),
                    kind,
                    reason: long.clone(),
                    traceparent: Some(long.clone()),
                },
                Kind::Parked { kind, .. } => Kind::Parked {
                    message_id: long.clone(),
                    kind,
                    reason: long.clone(),
                    traceparent: Some(long.clone()),
                },
                Kind::Error { .. } => Kind::Error {
                    message: long.clone(),
                },
                Kind::GivenBack { count, .. } => Kind::GivenBack {
                    count,
                    reason: long.clone(),
                },
                Kind::Scaled { what, from, to, .. } => Kind::Scaled {
                    what,
                    from,
                    to,
                    reason: long.clone(),
                },
                Kind::Draining { .. } => Kind::Draining {
                    reason: long.clone(),
                },
                Kind::ReloadFailed { .. } => Kind::ReloadFailed {
                    reason: long.clone(),
                },
                other => other,
            };
            let json = Event::new(Some("orders"), inflated).to_json();
            assert!(json.len() < 4 * SHOWN_MAX + 512, "{} bytes", json.len());
            let value: serde_json::Value = serde_json::from_str(&json).expect("JSON");
            for (field, v) in value.as_object().expect("an object") {
                if let Some(text) = v.as_str() {
                    assert!(text.len() <= SHOWN_MAX, "{field}: {} bytes", text.len());
                }
            }
        }
    }

    /// Issue 34, item 3: what waits for the writer is counted in bytes, and refused past
    /// [`QUEUE_BYTES`] until the writer takes it off.
    #[test]
    fn the_queue_holds_at_most_queue_bytes() {
        assert!(
            reserve(QUEUE_BYTES),
            "an empty queue takes its whole budget"
        );
        assert!(!reserve(1), "a full one takes nothing more");
        release(QUEUE_BYTES);
        assert!(reserve(1));
        release(1);
        assert_eq!(MEMORY_BOUND, 6 << 20, "docs/events.md states 6 MiB");
    }
}
