//! The registry's link to Redis: lazy reconnects, a bound on every call, one warning per
//! outage, and messages that never show the password of `REDIS_URL`.
//!
//! When Redis is unreachable warren keeps working: each call answers `None`, the outage is
//! warned about once and reported as `warren_connection_up{target="redis"} 0`, and the next
//! call connects again.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tracing::{info, warn};

use crate::config::redact_url;
use crate::metrics;

/// Bound on any one Redis call, so a hung Redis never stalls the control loop.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a link to Redis could not be opened; the URL is shown redacted and the client's words
/// scrubbed of the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectError {
    /// `REDIS_URL` is not a Redis URL.
    #[error("REDIS_URL {url}: {error}")]
    BadUrl { url: String, error: String },
    /// Redis did not answer, or refused.
    #[error("cannot reach Redis at {url}: {error}")]
    Unreachable { url: String, error: String },
}

impl ConnectError {
    /// What a person does about it: point `REDIS_URL` at a Redis, or start the one it names.
    pub fn remedy(&self) -> &'static str {
        match self {
            ConnectError::BadUrl { .. } => "set REDIS_URL to the deployment's redis:// URL",
            ConnectError::Unreachable { .. } => {
                "start Redis (`systemctl start redis-server`, or `redis-server --daemonize yes`) \
                 or set REDIS_URL to the deployment's Redis"
            }
        }
    }
}

/// A Redis link that reconnects lazily and never blocks for long.
pub struct Redis {
    /// `REDIS_URL`, to connect again after an outage and to scrub from messages.
    url: String,
    /// The live link; `None` until the next call connects, after a failure.
    conn: Option<MultiplexedConnection>,
    /// Last known state, to warn once per outage.
    up: Option<bool>,
    /// Whether this link reports its outages (a warning, the `redis` connection gauge). The
    /// registry's does; a second link to the same Redis (the events writer) stays quiet, so an
    /// outage is one warning.
    reports: bool,
}

/// `text` (a message about the Redis at `url`) with `url` redacted and its password, as written
/// and percent-decoded, replaced by `***` wherever it appears, as in an error the redis crate
/// built from the URL.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    if let Ok(parsed) = url::Url::parse(url)
        && let Some(password) = parsed.password()
    {
        for secret in [password.to_string(), percent_decode(password)] {
            // "***" itself, or a one-character password, would turn every message to noise.
            if secret.len() > 1 && secret != "***" {
                out = out.replace(&secret, "***");
            }
        }
    }
    out
}

/// `%XX` sequences decoded (as the redis crate decodes a password), the rest kept.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Redis {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            conn: None,
            up: None,
            reports: true,
        }
    }

    /// A link that does not report its outages (see the `reports` field): its caller counts what
    /// it could not do in its own way.
    pub fn quiet(url: &str) -> Self {
        Self {
            reports: false,
            ..Self::new(url)
        }
    }

    /// Connects to `url` now, or fails with a message naming it (password redacted).
    pub async fn connect(url: &str) -> Result<MultiplexedConnection, ConnectError> {
        let shown = redact_url(url);
        let client = redis::Client::open(url).map_err(|e| ConnectError::BadUrl {
            url: shown.clone(),
            error: scrub(&e.to_string(), url),
        })?;
        let unreachable = |error: String| ConnectError::Unreachable {
            url: shown.clone(),
            error,
        };
        match tokio::time::timeout(CALL_TIMEOUT, client.get_multiplexed_async_connection()).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(unreachable(scrub(&e.to_string(), url))),
            Err(_) => Err(unreachable("timed out".into())),
        }
    }

    fn mark(&mut self, up: bool, error: Option<&str>) {
        if self.reports && self.up != Some(up) {
            metrics::connection("redis", up);
            match (up, self.up) {
                (true, Some(false)) => {
                    metrics::reconnected("redis");
                    info!("Redis is back; the instance registers again");
                }
                (false, _) => warn!(
                    error = error.unwrap_or(""),
                    "Redis unreachable: the registry and remote control pause; consuming and inserting go on"
                ),
                _ => {}
            }
        }
        self.up = Some(up);
    }

    async fn link(&mut self) -> Option<MultiplexedConnection> {
        if self.conn.is_none() {
            match Self::connect(&self.url).await {
                Ok(c) => self.conn = Some(c),
                Err(e) => {
                    self.mark(false, Some(&e.to_string()));
                    return None;
                }
            }
        }
        self.conn.clone()
    }

    fn failed(&mut self, error: String) {
        self.conn = None;
        self.mark(false, Some(&error));
    }

    /// Runs one Redis call with the bound, reconnecting if needed; `None` while Redis is away.
    /// A link made before that finds its connection dropped (Redis restarted since) is made
    /// again and the call tried once more on it: the call never reached the Redis that runs
    /// now (review R35i F4: the first events after every Redis restart were dropped, though
    /// Redis had been back for seconds).
    async fn call<T, F, Fut>(&mut self, f: F) -> Option<T>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let stale = self.conn.is_some();
        let conn = self.link().await?;
        match tokio::time::timeout(CALL_TIMEOUT, f(conn)).await {
            Ok(Err(e)) if stale && e.is_connection_dropped() => {
                self.conn = None;
                let conn = self.link().await?;
                let again = tokio::time::timeout(CALL_TIMEOUT, f(conn)).await;
                self.outcome(again)
            }
            outcome => self.outcome(outcome),
        }
    }

    /// The link's state after one call's `outcome`, and its value.
    fn outcome<T>(
        &mut self,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Option<T> {
        match outcome {
            Ok(Ok(v)) => {
                self.mark(true, None);
                Some(v)
            }
            Ok(Err(e)) => {
                let error = scrub(&e.to_string(), &self.url);
                self.failed(error);
                None
            }
            Err(_) => {
                self.failed("timed out".into());
                None
            }
        }
    }

    /// Runs one command; `None` while Redis is away.
    pub async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Option<T> {
        self.call(|mut c| async move { cmd.query_async::<T>(&mut c).await })
            .await
    }

    /// Runs a pipeline (atomically when built with `atomic()`); `None` while Redis is away.
    pub async fn pipe<T: redis::FromRedisValue>(&mut self, pipe: &redis::Pipeline) -> Option<T> {
        self.call(|mut c| async move { pipe.query_async::<T>(&mut c).await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_messages_never_show_the_password() {
        let url = "redis://user:p%40ss-W0rd@127.0.0.1:1/0";
        let text = format!("cannot connect to {url}: auth p@ss-W0rd and p%40ss-W0rd failed");
        let shown = scrub(&text, url);
        assert!(
            !shown.contains("p@ss-W0rd") && !shown.contains("p%40ss-W0rd"),
            "{shown}"
        );
        assert!(shown.contains("redis://user:***@127.0.0.1:1/0"), "{shown}");
        assert_eq!(
            scrub("no url here", "redis://127.0.0.1:6379"),
            "no url here"
        );
        assert_eq!(percent_decode("a%41%zz%4"), "aA%zz%4");
    }

    #[tokio::test]
    async fn an_unreachable_redis_is_named_without_its_password() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let url = format!("redis://:Hidden-Pw-77@127.0.0.1:{port}");
        let e = Redis::connect(&url).await.unwrap_err().to_string();
        assert!(!e.contains("Hidden-Pw-77"), "{e}");
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        let mut redis = Redis::new(&url);
        assert_eq!(redis.query::<String>(&redis::cmd("PING")).await, None);
    }
}
