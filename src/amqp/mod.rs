//! RabbitMQ plumbing: bounded connects with heartbeats, exponential backoff with jitter for
//! reconnect loops, the AMQP error enum, and the `x-*` headers warren reads and writes.

pub mod headers;
pub mod publisher;

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};

use tracing::warn;

use crate::config::Settings;

/// An AMQP failure at warren's boundary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AmqpError {
    /// AMQP_URL cannot be parsed.
    #[error("AMQP_URL: {0}")]
    BadUrl(String),
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
    /// Any other protocol or IO error from lapin.
    #[error("{0}")]
    Protocol(String),
}

impl AmqpError {
    /// Whether trying again later can help (all but configuration and routing mistakes).
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            AmqpError::BadUrl(_) | AmqpError::Unroutable { .. } | AmqpError::NotFound(_)
        )
    }
}

impl From<lapin::Error> for AmqpError {
    fn from(e: lapin::Error) -> Self {
        AmqpError::Protocol(e.to_string())
    }
}

/// Opens a connection for `purpose` (shown in the broker's connection list), with the configured
/// heartbeat, bounded by the connect timeout.
pub async fn connect(settings: &Settings, purpose: &str) -> Result<Connection, AmqpError> {
    let mut uri: AMQPUri = settings
        .amqp_url
        .parse()
        .map_err(|e: String| AmqpError::BadUrl(e))?;
    uri.query.heartbeat = Some(settings.amqp_heartbeat_s);
    uri.query.connection_timeout = Some(settings.amqp_connect_timeout_ms);
    let name = format!(
        "warren {purpose} {}:{}",
        crate::hostname(),
        std::process::id()
    );
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = settings.connect_timeout();
    match tokio::time::timeout(timeout, Connection::connect_uri(uri, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(AmqpError::Unavailable(e.to_string())),
        Err(_) => Err(AmqpError::ConnectTimeout(timeout)),
    }
}

/// Opens a connection and one channel on it.
pub async fn connect_channel(
    settings: &Settings,
    purpose: &str,
) -> Result<(Connection, Channel), AmqpError> {
    let conn = connect(settings, purpose).await?;
    let channel = conn.create_channel().await?;
    Ok((conn, channel))
}

/// Exponential backoff (backon): `min` doubling up to `max`, each delay with up to 100% jitter
/// on top, forever.
pub fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// The reconnect backoff: 200 ms doubling up to 10 s (so at most 20 s with jitter): an outage
/// is never a hot loop, and a recovered broker or database is noticed within seconds.
pub fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    backoff(Duration::from_millis(200), Duration::from_secs(10))
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
    open.retry(
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(10))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times(),
    )
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
    let channel = conn.create_channel().await?;
    let result = channel
        .queue_declare(
            queue.into(),
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
    let channel = conn.create_channel().await?;
    let result = channel
        .exchange_declare(
            exchange.into(),
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
