//! RabbitMQ plumbing: bounded connects with heartbeats to one of several endpoints (each link
//! moves on to the next node after a failure), exponential backoff with jitter for reconnect
//! loops, the AMQP error enum, the `x-*` headers warren reads and writes, a delivery's properties as
//! held in flight (`held`), the one policy of
//! what warren's republished copies of a message carry (`republish`), and the one get ->
//! publish with confirm -> ack loop that moves messages out of a queue (`transfer`).

pub mod config;
pub mod headers;
pub mod held;
pub mod monitor;
pub mod publisher;
pub mod republish;
pub mod transfer;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};

use tracing::{info, warn};

pub use config::{AmqpConfig, AmqpConfigError, hand_back_after};

/// An AMQP failure at warren's boundary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AmqpError {
    /// The broker link's configuration cannot work (a URL the client refuses, a bound of 0).
    #[error(transparent)]
    Config(#[from] AmqpConfigError),
    /// The connect attempt did not finish within the bound.
    #[error("connecting to the broker timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// No connection or channel right now.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// The broker did not confirm in time.
    #[error("the broker did not confirm the publish within {0:?}")]
    ConfirmTimeout(Duration),
    /// The broker refused the message (basic.nack).
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// A mandatory publish reached no queue.
    #[error(
        "unroutable: no queue is bound for exchange {exchange:?} with routing key {routing_key:?}"
    )]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    /// A passive declare found no such object.
    #[error("{0} does not exist")]
    NotFound(String),
    /// The broker closed the channel or the connection (its reply code and text) while the
    /// publish was in flight: whether the broker took it is unknown.
    #[error("the broker closed the channel: {code} {text}")]
    Closed { code: u16, text: String },
    /// The publish was sent, but its confirm never came (the link failed): whether the broker
    /// took it is unknown.
    #[error("no confirm from the broker: {0}")]
    Unconfirmed(String),
    /// The message cannot be published as it is (`republish`): it was not sent.
    #[error("cannot be republished: {0}")]
    Unpublishable(#[from] republish::Unpublishable),
    /// Any other protocol or IO error from lapin.
    #[error("{0}")]
    Protocol(String),
}

impl AmqpError {
    /// The `outcome` label of `warren_publish_total` for a publish that failed so.
    pub fn publish_outcome(&self) -> &'static str {
        match self {
            AmqpError::Unroutable { .. } => "unroutable",
            AmqpError::Nacked => "nacked",
            AmqpError::ConfirmTimeout(_) => "timeout",
            AmqpError::Unpublishable(_) => "unpublishable",
            _ => "unavailable",
        }
    }

    /// Whether trying again later can help (all but configuration and routing mistakes, and
    /// messages that cannot be published as they are).
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            AmqpError::Config(_)
                | AmqpError::Unroutable { .. }
                | AmqpError::NotFound(_)
                | AmqpError::Unpublishable(_)
        )
    }

    /// Whether the broker closed the link over something a publish itself carried (a property
    /// it refuses, a frame it cannot take), rather than over the link or the destination:
    /// PRECONDITION_FAILED (406), FRAME_ERROR (501), SYNTAX_ERROR (502), UNEXPECTED_FRAME (505).
    pub fn blames_the_message(&self) -> bool {
        matches!(self, AmqpError::Closed { code, .. } if [406, 501, 502, 505].contains(code))
    }

    /// A failed publish confirm as warren's error: the broker's close with its reply code, or
    /// an unknown fate.
    pub fn from_confirm(e: &lapin::Error) -> Self {
        match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => AmqpError::Closed {
                code: amqp.get_id(),
                text: amqp.get_message().to_string(),
            },
            _ => AmqpError::Unconfirmed(e.to_string()),
        }
    }
}

/// Counts a finished publish in the metrics by its outcome (confirmed ones timed).
pub fn count_publish(result: &Result<(), AmqpError>, took: Duration) {
    let outcome = match result {
        Ok(()) => "confirmed",
        Err(e) => e.publish_outcome(),
    };
    crate::metrics::published(outcome, took);
}

impl From<lapin::Error> for AmqpError {
    fn from(e: lapin::Error) -> Self {
        AmqpError::Protocol(e.to_string())
    }
}

/// The largest frame warren proposes on a link that carries only warren's own small messages
/// ([`Frames::Small`]) when `AMQP_URL` names none (`?frame_max=`). lapin keeps a receive and a
/// send buffer of 32 frames per connection: at RabbitMQ's default of 128 KiB that is 8 MiB of
/// memory per connection, at 16 KiB 1 MiB. A larger body is simply sent in more frames.
pub const FRAME_MAX_SMALL: u32 = 16 * 1024;

/// What a [`Frames::Broker`] link proposes: RabbitMQ's default `frame_max` (128 KiB), so the
/// broker's own limit is what the link gets whenever the broker is configured at or below it.
/// Proposing it (rather than nothing, which lapin answers with the broker's value) lets lapin
/// allocate its 32-frame buffers zeroed up front, resident only as traffic reaches them, instead
/// of growing them after the handshake by writing every byte: 8 MiB resident per idle
/// connection. A broker configured above 128 KiB is met by [`Frames::BrokerOnly`].
pub const FRAME_MAX_BROKER: u32 = 128 * 1024;

/// The frame limit a link proposes. A content header (the properties, headers included) travels
/// in ONE frame, and lapin refuses an inbound frame over the negotiated limit by closing the
/// connection, so a link that receives or republishes other publishers' messages must take
/// what the broker allows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frames {
    /// At most [`FRAME_MAX_SMALL`] unless `AMQP_URL` sets `?frame_max=`: the API's and the CLI's
    /// publishers, the queue poller, `declare`, `status`.
    Small,
    /// The broker's `frame_max` up to [`FRAME_MAX_BROKER`], or `AMQP_URL`'s `?frame_max=` when
    /// it sets one: consumers, the router's publisher, `move`, the DLQ tools.
    Broker,
    /// The broker's `frame_max` whatever `AMQP_URL` says: a consumer whose link died over a
    /// frame larger than the configured limit (it could never receive that message otherwise).
    BrokerOnly,
}

/// One broker node of `AMQP_URL`.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// What the client connects with (credentials included: never logged).
    uri: AMQPUri,
    /// `host:port`, what logs and the `warren_amqp_node_info` gauge name the node by.
    pub node: String,
}

/// The nodes of `AMQP_URL` in the order this process tries them: as given, or with
/// `AMQP_SHUFFLE` in an order shuffled once per process (the same order for every link and every
/// reconnect of the process, a different one in each process). A configuration that does not
/// pass [`AmqpConfig::validate`] is its error.
pub fn endpoints(config: &AmqpConfig) -> Result<Vec<Endpoint>, AmqpError> {
    config.validate()?;
    let mut endpoints: Vec<Endpoint> = config
        .uris()?
        .into_iter()
        .map(|uri| {
            let node = format!("{}:{}", uri.authority.host, uri.authority.port);
            Endpoint { uri, node }
        })
        .collect();
    if config.shuffle {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| fastrand::u64(..));
        fastrand::Rng::with_seed(seed).shuffle(&mut endpoints);
    }
    Ok(endpoints)
}

/// Per link (by purpose): the index, in [`endpoints`], of the node it last connected to or last
/// failed on. A link's next connect starts at the node after it, so a reconnect never begins
/// with the node that just failed or was in use when the link broke.
static LAST_NODE: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

/// Where the next connect of `purpose` starts among `n` endpoints: the first for a link's first
/// connect, else the one after its last.
fn first_try(purpose: &str, n: usize) -> usize {
    let guard = LAST_NODE.lock().unwrap_or_else(|p| p.into_inner());
    guard
        .as_ref()
        .and_then(|m| m.get(purpose))
        .map_or(0, |last| (last + 1) % n)
}

fn remember_node(purpose: &str, index: usize) {
    let mut guard = LAST_NODE.lock().unwrap_or_else(|p| p.into_inner());
    guard
        .get_or_insert_with(HashMap::new)
        .insert(purpose.to_string(), index);
}

/// Opens a connection for `purpose` (shown in the broker's connection list; it also names the
/// link whose place in the endpoint list is remembered), with the configured heartbeat, each
/// attempt bounded by the connect timeout. With several endpoints it tries each once, starting
/// after the node this link used (or failed on) last, and takes the first that answers.
pub async fn connect(
    config: &AmqpConfig,
    purpose: &str,
    frames: Frames,
) -> Result<Connection, AmqpError> {
    let endpoints = endpoints(config)?;
    let n = endpoints.len();
    let start = first_try(purpose, n);
    let mut failures: Vec<String> = Vec::new();
    let mut last_error = None;
    for k in 0..n {
        let index = (start + k) % n;
        let endpoint = &endpoints[index];
        remember_node(purpose, index);
        match connect_to(endpoint, config, purpose, frames).await {
            Ok(conn) => {
                if failures.is_empty() {
                    info!(link = purpose, node = %endpoint.node, "connected to the broker");
                } else {
                    info!(link = purpose, node = %endpoint.node, passed_over = %failures.join("; "),
                        "connected to the broker");
                }
                crate::metrics::amqp_node(purpose, &endpoint.node);
                return Ok(conn);
            }
            Err(e) => {
                failures.push(format!("{}: {e}", endpoint.node));
                last_error = Some(e);
            }
        }
    }
    match last_error {
        Some(e) if n == 1 => Err(e),
        _ => Err(AmqpError::Unavailable(format!(
            "no broker node answered: {}",
            failures.join("; ")
        ))),
    }
}

/// One connect attempt to one node.
async fn connect_to(
    endpoint: &Endpoint,
    config: &AmqpConfig,
    purpose: &str,
    frames: Frames,
) -> Result<Connection, AmqpError> {
    let mut uri = endpoint.uri.clone();
    match frames {
        Frames::Small => {
            uri.query.frame_max.get_or_insert(FRAME_MAX_SMALL);
        }
        Frames::Broker => {
            uri.query.frame_max.get_or_insert(FRAME_MAX_BROKER);
        }
        // lapin proposes nothing (0) and takes the broker's.
        Frames::BrokerOnly => uri.query.frame_max = None,
    }
    uri.query.heartbeat = Some(config.heartbeat_s);
    uri.query.connection_timeout = Some(config.connect_timeout_ms);
    let name = format!(
        "warren {purpose} {}:{}",
        crate::hostname(),
        std::process::id()
    );
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = config.connect_timeout();
    match tokio::time::timeout(timeout, Connection::connect_uri(uri, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(AmqpError::Unavailable(e.to_string())),
        Err(_) => Err(AmqpError::ConnectTimeout(timeout)),
    }
}

/// Opens a connection and one channel on it.
pub async fn connect_channel(
    config: &AmqpConfig,
    purpose: &str,
    frames: Frames,
) -> Result<(Connection, Channel), AmqpError> {
    let conn = connect(config, purpose, frames).await?;
    let channel = conn.create_channel().await?;
    Ok((conn, channel))
}

/// Exponential backoff (backon's builder, for `Retryable::retry`): `min` doubling up to `max`,
/// each delay with up to 100% jitter on top, forever.
pub fn backoff_builder(min: Duration, max: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}

/// [`backoff_builder`]'s delays, for a loop that is not a `Retryable`.
pub fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    backoff_builder(min, max).build()
}

/// The reconnect backoff: 200 ms doubling up to 10 s (so at most 20 s with jitter): an outage
/// is never a hot loop, and a recovered broker or database is noticed within seconds.
pub fn reconnect_builder() -> ExponentialBuilder {
    backoff_builder(Duration::from_millis(200), Duration::from_secs(10))
}

/// [`reconnect_builder`]'s delays.
pub fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    reconnect_builder().build()
}

/// Runs `open` until it succeeds, with the reconnect backoff (backon) and no limit on attempts,
/// logging the first failure and then every power-of-two attempt (the message `failing`); gives up (`None`) once
/// `wanted()` says nobody waits for the result any more.
pub async fn until_open<T, F, Fut>(
    purpose: &str,
    failing: &'static str,
    first_delay: Duration,
    open: F,
    wanted: impl Fn() -> bool,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, AmqpError>>,
{
    if !first_delay.is_zero() {
        tokio::time::sleep(first_delay).await;
    }
    let mut attempt = 0u32;
    open.retry(reconnect_builder())
        .when(|_| wanted())
        .notify(|e, delay| {
            attempt += 1;
            if attempt == 1 || attempt.is_power_of_two() {
                warn!(purpose, attempt, error = %e, retry_in_ms = delay.as_millis() as u64,
                "{failing}");
            }
        })
        .await
        .ok()
}

/// Closes a channel and its connection, ignoring errors (they are already gone, or going).
pub async fn close(channel: Option<Channel>, conn: Option<Connection>) {
    if let Some(ch) = channel {
        let _ = ch.close(200, "bye".into()).await;
    }
    if let Some(conn) = conn {
        let _ = conn.close(200, "bye".into()).await;
    }
}

/// (messages ready, consumers) of `queue`, by a passive declare on a channel of its own (a
/// missing queue closes that channel, not the caller's).
pub async fn queue_stats(conn: &Connection, queue: &str) -> Result<(u32, u32), AmqpError> {
    // A name from the command line: no queue has one over 255 bytes.
    let name = headers::short(queue).map_err(|e| {
        AmqpError::NotFound(format!("queue {:?} (a name is {e})", short_preview(queue)))
    })?;
    let channel = conn.create_channel().await?;
    let result = channel
        .queue_declare(
            name,
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    match result {
        Ok(q) => {
            let _ = channel.close(200, "ok".into()).await;
            Ok((q.message_count(), q.consumer_count()))
        }
        Err(e) if is_not_found(&e) => Err(AmqpError::NotFound(format!("queue {queue}"))),
        Err(e) => Err(e.into()),
    }
}

/// The first 40 bytes of a name too long to show whole.
fn short_preview(name: &str) -> std::borrow::Cow<'_, str> {
    crate::text::capped(name, 40)
}

/// Whether `queue` exists.
pub async fn queue_exists(conn: &Connection, queue: &str) -> Result<bool, AmqpError> {
    match queue_stats(conn, queue).await {
        Ok(_) => Ok(true),
        Err(AmqpError::NotFound(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether `exchange` exists, by a passive declare on a channel of its own.
pub async fn exchange_exists(conn: &Connection, exchange: &str) -> Result<bool, AmqpError> {
    // No exchange has a name over 255 bytes.
    let Ok(name) = headers::short(exchange) else {
        return Ok(false);
    };
    let channel = conn.create_channel().await?;
    let result = channel
        .exchange_declare(
            name,
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    match result {
        Ok(()) => {
            let _ = channel.close(200, "ok".into()).await;
            Ok(true)
        }
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the broker answered 404 NOT_FOUND (the channel is closed by it).
fn is_not_found(e: &lapin::Error) -> bool {
    e.to_string().contains("NOT_FOUND")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_urls(urls: &str, shuffle: bool) -> AmqpConfig {
        AmqpConfig {
            urls: urls.split(',').map(String::from).collect(),
            shuffle,
            heartbeat_s: 30,
            connect_timeout_ms: 5_000,
            consumer_timeout_ms: 0,
            publish_timeout_ms: 10_000,
            publish_latency_header: false,
        }
    }

    #[test]
    fn endpoints_are_named_by_host_and_port_without_credentials() {
        let s = with_urls(
            "amqp://u:s3cret@127.0.0.1:5681/%2f,amqp://u:s3cret@localhost/%2f",
            false,
        );
        let nodes: Vec<String> = endpoints(&s).unwrap().into_iter().map(|e| e.node).collect();
        assert_eq!(nodes, ["127.0.0.1:5681", "localhost:5672"]);
    }

    #[test]
    fn a_link_starts_at_the_first_node_then_moves_past_its_last() {
        let link = "test-rotation";
        assert_eq!(first_try(link, 3), 0);
        remember_node(link, 0);
        assert_eq!(first_try(link, 3), 1);
        remember_node(link, 2);
        assert_eq!(first_try(link, 3), 0, "wraps around");
        // Another link keeps its own place.
        assert_eq!(first_try("test-other-link", 3), 0);
    }

    #[test]
    fn the_shuffle_is_one_order_for_the_whole_process() {
        let urls: Vec<String> = (1..=8).map(|i| format!("amqp://h{i}:5672/%2f")).collect();
        let s = with_urls(&urls.join(","), true);
        let order = |s: &AmqpConfig| -> Vec<String> {
            endpoints(s).unwrap().into_iter().map(|e| e.node).collect()
        };
        let first = order(&s);
        assert_eq!(order(&s), first, "the same order on every connect");
        let mut sorted = first.clone();
        sorted.sort();
        let given: Vec<String> = (1..=8).map(|i| format!("h{i}:5672")).collect();
        assert_eq!(sorted, given, "the same nodes");
        assert_eq!(order(&with_urls(&urls.join(","), false)), given);
    }

    #[tokio::test]
    async fn a_closed_port_is_passed_over_for_the_next_node_and_named_in_the_error() {
        // Two ports bound and released at once: nothing listens on them.
        let (la, lb) = (
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        );
        let (a, b) = (
            la.local_addr().unwrap().port(),
            lb.local_addr().unwrap().port(),
        );
        drop((la, lb));
        let s = with_urls(
            &format!("amqp://u:s3cret@127.0.0.1:{a}/%2f,amqp://u:s3cret@127.0.0.1:{b}/%2f"),
            false,
        );
        let err = connect(&s, "test-closed", Frames::Small)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("broker unavailable: no broker node answered: 127.0.0.1:"),
            "{err}"
        );
        assert!(err.contains(&format!("127.0.0.1:{a}: ")), "{err}");
        assert!(err.contains(&format!("127.0.0.1:{b}: ")), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
    }
}
