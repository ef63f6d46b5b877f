//! The HTTP API's own settings ([`HttpConfig`]: where it listens, its pool, the largest body it
//! publishes) and the metrics listener's ([`ListenerConfig`]), with their checks. Built from
//! warren's settings above this layer (`config::components`); nothing here reads those.

use std::net::SocketAddr;

/// What the API needs beside the broker link it publishes through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// Where it listens (`HTTP_ADDR`): `host:port`, a host name resolved at start.
    pub addr: String,
    /// The connections of its own database pool (`API_POOL_SIZE`), so API traffic can never
    /// take the pipelines' connections.
    pub pool_size: usize,
    /// The largest body the pipelines accept (`MAX_MESSAGE_BYTES`): the API refuses a larger
    /// one with 422 instead of publishing it to be parked.
    pub max_message_bytes: usize,
    /// `MAX_INFLIGHT_BYTES`: half of it is what the API's writes in work hold between them (their
    /// bodies, and the rows decoded from them), at most; more wait their turn.
    pub max_inflight_bytes: u64,
}

/// The metrics listener's (`/metrics`, `/healthz`, `/readyz`, on every role) settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Where it listens (`METRICS_ADDR`).
    pub addr: String,
}

/// An [`HttpConfig`] or [`ListenerConfig`] that cannot work, named by the setting it came
/// from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpConfigError {
    /// An address that is no `host:port`, or a host that resolves to nothing.
    #[error("{setting} {addr}: expected an address host:port (a host name must resolve): {error}")]
    Addr {
        /// `HTTP_ADDR` or `METRICS_ADDR`.
        setting: &'static str,
        addr: String,
        /// What resolving it said.
        error: String,
    },
    /// A pool of no connection.
    #[error("API_POOL_SIZE: expected at least 1 connection, got 0")]
    PoolSize,
    /// A body limit of 0, which would refuse every request.
    #[error("MAX_MESSAGE_BYTES: expected at least 1 byte, got 0")]
    MaxMessageBytes,
}

/// `text` as the address to bind, a host name resolved (its first address), or why not, as
/// the configuration's own check reads it (`config::listen_addr`).
fn resolve(setting: &'static str, text: &str) -> Result<SocketAddr, HttpConfigError> {
    crate::config::listen_addr(text).map_err(|e| HttpConfigError::Addr {
        setting,
        addr: text.to_string(),
        error: e.to_string(),
    })
}

impl HttpConfig {
    /// An address that resolves, a pool of at least one connection, a body limit above 0.
    pub fn validate(&self) -> Result<(), HttpConfigError> {
        self.socket_addr()?;
        if self.pool_size == 0 {
            return Err(HttpConfigError::PoolSize);
        }
        if self.max_message_bytes == 0 {
            return Err(HttpConfigError::MaxMessageBytes);
        }
        Ok(())
    }

    /// The address to bind.
    pub fn socket_addr(&self) -> Result<SocketAddr, HttpConfigError> {
        resolve("HTTP_ADDR", &self.addr)
    }
}

impl ListenerConfig {
    /// An address that resolves.
    pub fn validate(&self) -> Result<(), HttpConfigError> {
        self.socket_addr().map(drop)
    }

    /// The address to bind.
    pub fn socket_addr(&self) -> Result<SocketAddr, HttpConfigError> {
        resolve("METRICS_ADDR", &self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> HttpConfig {
        HttpConfig {
            addr: "127.0.0.1:8080".into(),
            pool_size: 4,
            max_message_bytes: 1 << 20,
            max_inflight_bytes: 16 << 20,
        }
    }

    /// Each rule fails on its own, naming its setting; a host name resolves.
    #[test]
    fn each_rule_names_its_setting() {
        let with = |f: fn(&mut HttpConfig)| {
            let mut c = good();
            f(&mut c);
            c.validate()
        };
        assert_eq!(with(|_| {}), Ok(()));
        let named = HttpConfig {
            addr: "localhost:8080".into(),
            ..good()
        };
        assert_eq!(named.validate(), Ok(()));
        assert!(named.socket_addr().unwrap().ip().is_loopback());
        let addr = with(|c| c.addr = "no-port".into()).unwrap_err();
        assert!(
            addr.to_string()
                .starts_with("HTTP_ADDR no-port: expected an address host:port"),
            "{addr}"
        );
        assert_eq!(with(|c| c.pool_size = 0), Err(HttpConfigError::PoolSize));
        assert!(
            HttpConfigError::PoolSize
                .to_string()
                .starts_with("API_POOL_SIZE: ")
        );
        assert_eq!(
            with(|c| c.max_message_bytes = 0),
            Err(HttpConfigError::MaxMessageBytes)
        );
        assert!(
            HttpConfigError::MaxMessageBytes
                .to_string()
                .starts_with("MAX_MESSAGE_BYTES: ")
        );
    }

    /// The metrics listener's address is checked as the API's, under its own name.
    #[test]
    fn the_listener_address_is_named_metrics_addr() {
        let ok = ListenerConfig {
            addr: "127.0.0.1:0".into(),
        };
        assert_eq!(ok.validate(), Ok(()));
        let bad = ListenerConfig {
            addr: "127.0.0.1".into(),
        };
        let e = bad.validate().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("METRICS_ADDR 127.0.0.1: expected an address host:port"),
            "{e}"
        );
    }
}
