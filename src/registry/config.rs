//! The registry's own settings: where Redis is and the deployment's namespace in it
//! ([`RedisConfig`], shared with the events writer), and the registry's and remote control's
//! ([`RegistryConfig`]: the control secret, the heartbeat), with their checks. Built from
//! warren's settings above this layer (`config::components`); nothing here reads those.

use std::fmt;
use std::time::Duration;

/// Lifetime of an instance hash without a heartbeat: each heartbeat renews it, so the heartbeat
/// period stays below it.
pub const INSTANCE_TTL_S: u64 = 30;

/// The deployment's Redis: what the registry, the remote control and the events stream reach.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Where Redis is (`REDIS_URL`, `redis://` or `rediss://`). Never shown whole: it may hold a
    /// password.
    pub url: String,
    /// The prefix of every key (`REDIS_PREFIX`), so several deployments share one Redis.
    pub prefix: String,
}

/// What this instance's registration and its remote control need beside Redis.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryConfig {
    /// Where the registry lives.
    pub redis: RedisConfig,
    /// The shared secret remote commands must be signed with (`CONTROL_SECRET`); empty accepts
    /// unsigned ones. Never shown.
    pub control_secret: String,
    /// The period of the heartbeat that renews this instance's entry (`REGISTRY_HEARTBEAT_MS`);
    /// below the entry's lifetime ([`INSTANCE_TTL_S`]), or the entry would expire between two.
    pub heartbeat_ms: u64,
}

/// A [`RedisConfig`] or [`RegistryConfig`] that cannot work, named by the setting it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryConfigError {
    /// Not a Redis URL naming a host; shown redacted.
    #[error(
        "REDIS_URL: expected a URL starting with redis:// or rediss:// naming a host, got {0:?}"
    )]
    Url(String),
    /// A prefix no key can start with.
    #[error("REDIS_PREFIX: expected 1 to 255 characters without control characters, got {0:?}")]
    Prefix(String),
    /// A heartbeat that cannot keep the entry alive.
    #[error(
        "REGISTRY_HEARTBEAT_MS: expected 1 to {most} ms (below the instance entry's \
         {INSTANCE_TTL_S} s lifetime, which each heartbeat renews), got {0}",
        most = INSTANCE_TTL_S * 1000 - 1
    )]
    Heartbeat(u64),
}

impl fmt::Debug for RedisConfig {
    /// The URL with its password replaced.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &crate::config::redact_url(&self.url))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl fmt::Debug for RegistryConfig {
    /// Whether a control secret is set, never the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryConfig")
            .field("redis", &self.redis)
            .field(
                "control_secret",
                &if self.control_secret.is_empty() {
                    "(none)"
                } else {
                    "(set, not shown)"
                },
            )
            .field("heartbeat_ms", &self.heartbeat_ms)
            .finish()
    }
}

impl RedisConfig {
    /// A URL of scheme `redis` or `rediss` naming a host, and a prefix keys can start with.
    pub fn validate(&self) -> Result<(), RegistryConfigError> {
        match url::Url::parse(&self.url) {
            Ok(u)
                if ["redis", "rediss"].contains(&u.scheme())
                    && u.host_str().is_some_and(|h| !h.is_empty()) => {}
            _ => {
                return Err(RegistryConfigError::Url(crate::config::redact_url(
                    &self.url,
                )));
            }
        }
        let p = &self.prefix;
        if p.is_empty() || p.len() > 255 || p.chars().any(char::is_control) {
            return Err(RegistryConfigError::Prefix(p.clone()));
        }
        Ok(())
    }
}

impl RegistryConfig {
    /// Redis's rules ([`RedisConfig::validate`]) and a heartbeat that renews the instance's
    /// entry before it expires.
    pub fn validate(&self) -> Result<(), RegistryConfigError> {
        self.redis.validate()?;
        if self.heartbeat_ms == 0 || self.heartbeat_ms >= INSTANCE_TTL_S * 1000 {
            return Err(RegistryConfigError::Heartbeat(self.heartbeat_ms));
        }
        Ok(())
    }

    /// The heartbeat's period.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    /// The control secret, `None` when unset (unsigned commands accepted).
    pub fn secret(&self) -> Option<&str> {
        Some(self.control_secret.as_str()).filter(|s| !s.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> RegistryConfig {
        RegistryConfig {
            redis: RedisConfig {
                url: "redis://:s3cret@127.0.0.1:6379/0".into(),
                prefix: "warren".into(),
            },
            control_secret: "t0p-secret".into(),
            heartbeat_ms: 2_000,
        }
    }

    /// Each rule fails on its own, naming its setting; neither the Redis password nor the
    /// control secret shows in an error or in the debug form.
    #[test]
    fn each_rule_names_its_setting_and_no_secret_shows() {
        let with = |f: fn(&mut RegistryConfig)| {
            let mut c = good();
            f(&mut c);
            c.validate()
        };
        assert_eq!(with(|_| {}), Ok(()));
        assert_eq!(
            with(|c| c.redis.url = "rediss://h:6380".into()),
            Ok(()),
            "TLS"
        );
        for bad in ["http://:s3cret@h/", "redis://", "not a url"] {
            let mut c = good();
            c.redis.url = bad.into();
            let e = c.validate().unwrap_err();
            assert!(matches!(e, RegistryConfigError::Url(_)), "{bad}: {e:?}");
            assert!(e.to_string().starts_with("REDIS_URL: "), "{e}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        }
        for bad in ["", "a\nb"] {
            let mut c = good();
            c.redis.prefix = bad.into();
            assert_eq!(c.validate(), Err(RegistryConfigError::Prefix(bad.into())));
        }
        assert_eq!(
            with(|c| c.heartbeat_ms = 0),
            Err(RegistryConfigError::Heartbeat(0))
        );
        let late = with(|c| c.heartbeat_ms = 30_000).unwrap_err();
        assert_eq!(
            late.to_string(),
            "REGISTRY_HEARTBEAT_MS: expected 1 to 29999 ms (below the instance entry's 30 s \
             lifetime, which each heartbeat renews), got 30000"
        );
        assert_eq!(with(|c| c.heartbeat_ms = 29_999), Ok(()));
        let shown = format!("{:?}", good());
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains("t0p-secret"), "{shown}");
    }

    /// The period is the milliseconds; an empty secret is none.
    #[test]
    fn the_heartbeat_and_the_secret_are_read_as_set() {
        assert_eq!(good().heartbeat(), Duration::from_secs(2));
        assert_eq!(good().secret(), Some("t0p-secret"));
        let unsigned = RegistryConfig {
            control_secret: String::new(),
            ..good()
        };
        assert_eq!(unsigned.secret(), None);
    }
}
