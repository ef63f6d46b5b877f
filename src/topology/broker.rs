//! What the broker's version allows of the topology: RabbitMQ 4 gives every quorum queue that
//! declares no delivery limit a limit of 20, so a quorum DLQ declared without one
//! (`DLQ_DELIVERY_LIMIT=0`), which dead-letters nowhere, would drop a message on its 21st
//! delivery. Checked before anything is declared, on the version the broker gives in
//! `connection.start`.

use lapin::Connection;
use lapin::types::AMQPValue;

use super::{Queue, Topology};
use crate::config::ConfigError;

/// The first RabbitMQ major version that gives a quorum queue declared without
/// `x-delivery-limit` a limit of [`DEFAULT_DELIVERY_LIMIT`] (3.x: none).
const DEFAULT_LIMIT_SINCE: u32 = 4;

/// The delivery limit RabbitMQ 4 gives a quorum queue that declares none.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// The broker's version as it said it in `connection.start` (RabbitMQ: `3.10.7`, `4.0.5`);
/// `None` when it gave none.
pub fn broker_version(conn: &Connection) -> Option<String> {
    let properties = conn.configuration().server_properties();
    match properties.inner().get("version")? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// The major version of `version` (`4` of `4.0.5`, `4.1.0-rc.1`); `None` when it does not start
/// with a number.
fn major(version: &str) -> Option<u32> {
    version.split(['.', '-', '+']).next()?.trim().parse().ok()
}

/// Whether the broker of `version` gives a quorum queue that declares no delivery limit a
/// limit of its own ([`DEFAULT_DELIVERY_LIMIT`], RabbitMQ 4 and later); `None` when the version
/// is unknown or unreadable, for the caller to decide which way is safe.
pub fn gives_default_limit(version: Option<&str>) -> Option<bool> {
    version.and_then(major).map(|m| m >= DEFAULT_LIMIT_SINCE)
}

/// Whether the broker gives a quorum queue that declares no delivery limit a limit of its own
/// (RabbitMQ 4 and later). An unknown or unreadable version is taken as one that does not: the
/// check cannot tell, and 3.x is what warren is tested on.
fn limits_by_default(version: Option<&str>) -> bool {
    gives_default_limit(version).unwrap_or(false)
}

/// A queue the broker's default limit would make drop messages: quorum, no `x-delivery-limit`,
/// and no dead-letter exchange to send a message past the limit to (the DLQ).
fn drops_past_default_limit(q: &Queue) -> bool {
    q.queue_type() == "quorum"
        && !q.arguments.contains_key("x-delivery-limit")
        && !q.arguments.contains_key("x-dead-letter-exchange")
}

impl Topology {
    /// Whether [`Topology::check_broker`] depends on the broker's version: some queue is a
    /// quorum queue declared without a delivery limit that dead-letters nowhere (a quorum DLQ
    /// with `DLQ_DELIVERY_LIMIT=0`). Only then must `warren run` ask the broker which it is.
    pub fn depends_on_broker_version(&self) -> bool {
        self.queues.iter().any(drops_past_default_limit)
    }

    /// Refuses, as a bad setting (exit 2), a topology that would lose messages on the broker
    /// of `version`: on RabbitMQ 4 a quorum DLQ declared without a delivery limit
    /// (`DLQ_DELIVERY_LIMIT=0`) gets one of 20. Called before anything is declared.
    pub fn check_broker(&self, version: Option<&str>) -> Result<(), ConfigError> {
        if !limits_by_default(version) {
            return Ok(());
        }
        match self.queues.iter().find(|q| drops_past_default_limit(q)) {
            Some(q) => Err(ConfigError::Invalid {
                setting: "DLQ_DELIVERY_LIMIT".into(),
                expected: format!(
                    "10000 to 1000000000 on RabbitMQ {} (the default, 1000000, lasts over a year of \
                     database outage): 0 declares no delivery limit, and RabbitMQ 4 gives a \
                     quorum queue without one a limit of 20, past which the DLQ {}, which \
                     dead-letters nowhere, drops a message (see docs/cluster.md); nothing was \
                     declared",
                    version.unwrap_or_default(),
                    q.name
                ),
                got: "0".into(),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The topology of the defaults with `pairs` set.
    fn topology(pairs: &[(&str, &str)]) -> Topology {
        Topology::from_settings(&crate::topology::tests::with(pairs)).expect("a topology")
    }

    #[test]
    fn the_major_version_is_read_from_what_rabbitmq_says() {
        assert_eq!(major("3.10.7"), Some(3));
        assert_eq!(major("4.0.5"), Some(4));
        assert_eq!(major("4.1.0-rc.1"), Some(4));
        assert_eq!(major("10"), Some(10));
        assert_eq!(major(""), None);
        assert_eq!(major("v4.0"), None);
        assert!(!limits_by_default(Some("3.13.7")));
        assert!(limits_by_default(Some("4.0.0")));
        assert!(limits_by_default(Some("4.2.1")));
        assert!(!limits_by_default(None));
        assert!(!limits_by_default(Some("unknown")));
        assert_eq!(gives_default_limit(Some("3.10.7")), Some(false));
        assert_eq!(gives_default_limit(Some("4.0.5")), Some(true));
        assert_eq!(gives_default_limit(Some("unknown")), None);
        assert_eq!(gives_default_limit(None), None);
    }

    #[test]
    fn a_quorum_dlq_without_a_limit_is_refused_on_rabbitmq_4_only() {
        let unlimited = topology(&[("queue_type", "quorum"), ("dlq_delivery_limit", "0")]);
        assert_eq!(unlimited.check_broker(Some("3.10.7")).ok(), Some(()));
        assert_eq!(unlimited.check_broker(None).ok(), Some(()));
        let err = unlimited
            .check_broker(Some("4.0.5"))
            .expect_err("refused on 4.x")
            .to_string();
        for part in [
            "DLQ_DELIVERY_LIMIT: expected 10000 to 1000000000 on RabbitMQ 4.0.5",
            "a limit of 20",
            "the DLQ raffle_dlq",
            "docs/cluster.md",
            "got 0",
        ] {
            assert!(err.contains(part), "{part:?} not in {err}");
        }
        // A declared limit, and classic queues (no delivery limit at all), are fine on 4.x.
        let limited = topology(&[("queue_type", "quorum")]);
        assert_eq!(limited.check_broker(Some("4.0.5")).ok(), Some(()));
        let classic = topology(&[("dlq_delivery_limit", "0")]);
        assert_eq!(classic.check_broker(Some("4.0.5")).ok(), Some(()));
    }

    /// `warren run` without `--declare` asks the broker only when the check depends on it.
    #[test]
    fn only_a_quorum_dlq_without_a_limit_depends_on_the_brokers_version() {
        let unlimited = topology(&[("queue_type", "quorum"), ("dlq_delivery_limit", "0")]);
        assert!(unlimited.depends_on_broker_version());
        assert!(!topology(&[("queue_type", "quorum")]).depends_on_broker_version());
        assert!(!topology(&[("dlq_delivery_limit", "0")]).depends_on_broker_version());
        assert!(!topology(&[]).depends_on_broker_version());
    }
}
