//! The broker link's own settings ([`AmqpConfig`]: the nodes, the shuffle, the heartbeat, the
//! connect, publish and consumer timeouts, the latency header) and their checks
//! ([`AmqpConfig::validate`]). Built from warren's settings above this layer
//! (`config::components`); nothing here reads those. [`hand_back_after`] (the time a delivery
//! may be held under the broker's `consumer_timeout`) is the broker's rule, so it lives here.

use std::fmt;
use std::time::Duration;

use lapin::uri::AMQPUri;

/// What every link to the broker needs: where the nodes are and how long to wait for them.
/// The connections ([`super::connect`]), the publisher, the consumer and the queue poller read
/// it, and nothing else of warren's settings.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpConfig {
    /// The broker's nodes (`AMQP_URL`, split at its commas), in the order given; each link
    /// connects to the first that answers. Never shown whole: a URL may hold a password.
    pub urls: Vec<String>,
    /// Whether this process tries the nodes in an order of its own (`AMQP_SHUFFLE`), so many
    /// instances given the same list spread their connections over the nodes.
    pub shuffle: bool,
    /// The AMQP heartbeat in seconds (`AMQP_HEARTBEAT_S`, 0 disables), so a half-open socket
    /// is noticed.
    pub heartbeat_s: u16,
    /// The bound on one connect attempt (`AMQP_CONNECT_TIMEOUT_MS`), so a black-holed node
    /// cannot hang a reconnect loop; a consume that is not answered is bounded by it too.
    pub connect_timeout_ms: u64,
    /// The broker's `consumer_timeout` (`AMQP_CONSUMER_TIMEOUT_MS`, 0: it has none): a
    /// delivery held longer is given back first ([`AmqpConfig::hand_back_after`]).
    pub consumer_timeout_ms: u64,
    /// The bound on waiting for a publisher confirm (`PUBLISH_TIMEOUT_MS`).
    pub publish_timeout_ms: u64,
    /// Whether what warren publishes itself (the API, `warren publish`) carries
    /// `x-published-ms` (`PUBLISH_LATENCY_HEADER`).
    pub publish_latency_header: bool,
}

/// An [`AmqpConfig`] that cannot work, named by the setting it came from. A URL is shown
/// redacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmqpConfigError {
    /// No node at all.
    #[error("AMQP_URL: expected at least one amqp:// or amqps:// URL, got none")]
    NoUrl,
    /// One entry of the list is not a URL the AMQP client accepts.
    #[error("AMQP_URL: entry {entry} ({shown}): {error}")]
    Url {
        /// Its place in the list, from 1.
        entry: usize,
        /// The entry with its password replaced.
        shown: String,
        /// What the client said.
        error: String,
    },
    /// A connect bound of 0, which would time every connect out at once.
    #[error("AMQP_CONNECT_TIMEOUT_MS: expected at least 1 ms, got 0")]
    ConnectTimeout,
    /// A confirm bound of 0, which would fail every publish.
    #[error("PUBLISH_TIMEOUT_MS: expected at least 1 ms, got 0")]
    PublishTimeout,
}

impl fmt::Debug for AmqpConfig {
    /// Everything but the URLs' credentials: each node as `host:port`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self
            .urls
            .iter()
            .map(|u| crate::redact::redact_url(u))
            .collect();
        f.debug_struct("AmqpConfig")
            .field("urls", &nodes)
            .field("shuffle", &self.shuffle)
            .field("heartbeat_s", &self.heartbeat_s)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("consumer_timeout_ms", &self.consumer_timeout_ms)
            .field("publish_timeout_ms", &self.publish_timeout_ms)
            .field("publish_latency_header", &self.publish_latency_header)
            .finish()
    }
}

impl AmqpConfig {
    /// The rules the broker link relies on: at least one node, every URL one the AMQP client
    /// parses, and connect and confirm bounds that are not 0.
    pub fn validate(&self) -> Result<(), AmqpConfigError> {
        self.uris()?;
        if self.connect_timeout_ms == 0 {
            return Err(AmqpConfigError::ConnectTimeout);
        }
        if self.publish_timeout_ms == 0 {
            return Err(AmqpConfigError::PublishTimeout);
        }
        Ok(())
    }

    /// Every node's URL as the client parses it, in the order given.
    pub(super) fn uris(&self) -> Result<Vec<AMQPUri>, AmqpConfigError> {
        if self.urls.is_empty() {
            return Err(AmqpConfigError::NoUrl);
        }
        self.urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                url.parse().map_err(|error: String| AmqpConfigError::Url {
                    entry: i + 1,
                    shown: crate::redact::redact_url(url),
                    error,
                })
            })
            .collect()
    }

    /// The bound on one connect attempt.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// The bound on waiting for a publisher confirm.
    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }

    /// How long a delivery may stay unacked in warren before it is given back (nack with
    /// requeue): 80% of the broker's `consumer_timeout` ([`hand_back_after`]); `None` when
    /// the broker has none.
    pub fn hand_back_after(&self) -> Option<Duration> {
        hand_back_after(self.consumer_timeout_ms)
    }
}

/// How long a delivery may stay unacked in warren under a broker `consumer_timeout` of
/// `timeout_ms` (0 = none): 80% of it. The 20% margin (6 minutes at RabbitMQ's default of
/// 30) covers what may still run after the check: the database statement in flight (bounded by
/// `DATABASE_STATEMENT_TIMEOUT_MS` + 2 s), the fallback stage's settling and the nack's way to
/// the broker; the broker itself only checks on its channel tick (every 60 s on 3.10), which can
/// only make it later.
pub fn hand_back_after(timeout_ms: u64) -> Option<Duration> {
    (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms * 4 / 5))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> AmqpConfig {
        AmqpConfig {
            urls: vec![
                "amqp://u:s3cret@127.0.0.1:5672/%2f".into(),
                "amqps://u:s3cret@rabbit-2:5671/%2f".into(),
            ],
            shuffle: false,
            heartbeat_s: 30,
            connect_timeout_ms: 5_000,
            consumer_timeout_ms: 1_800_000,
            publish_timeout_ms: 10_000,
            publish_latency_header: true,
        }
    }

    /// Each rule fails on its own, naming its setting; no password shows in an error or in
    /// the configuration's debug form.
    #[test]
    fn each_rule_names_its_setting_and_no_password_shows() {
        let with = |f: fn(&mut AmqpConfig)| {
            let mut c = good();
            f(&mut c);
            c.validate()
        };
        assert_eq!(with(|_| {}), Ok(()));
        assert_eq!(with(|c| c.urls.clear()), Err(AmqpConfigError::NoUrl));
        let bad = with(|c| c.urls[1] = "http://u:s3cret@h/".into()).unwrap_err();
        let shown = bad.to_string();
        assert!(shown.starts_with("AMQP_URL: entry 2 ("), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert_eq!(
            with(|c| c.connect_timeout_ms = 0),
            Err(AmqpConfigError::ConnectTimeout)
        );
        assert!(
            AmqpConfigError::ConnectTimeout
                .to_string()
                .starts_with("AMQP_CONNECT_TIMEOUT_MS: ")
        );
        assert_eq!(
            with(|c| c.publish_timeout_ms = 0),
            Err(AmqpConfigError::PublishTimeout)
        );
        assert!(
            AmqpConfigError::PublishTimeout
                .to_string()
                .starts_with("PUBLISH_TIMEOUT_MS: ")
        );
        assert!(!format!("{:?}", good()).contains("s3cret"));
    }

    /// The bounds are the settings' milliseconds; the hand-back time is 80% of the broker's
    /// consumer timeout, none without one.
    #[test]
    fn the_bounds_come_from_their_milliseconds() {
        let c = good();
        assert_eq!(c.connect_timeout(), Duration::from_secs(5));
        assert_eq!(c.publish_timeout(), Duration::from_secs(10));
        assert_eq!(c.hand_back_after(), Some(Duration::from_secs(1_440)));
        let none = AmqpConfig {
            consumer_timeout_ms: 0,
            ..good()
        };
        assert_eq!(none.hand_back_after(), None);
    }
}
