//! The typed values of settings that are more than a number or a string: the queue type, the
//! balancing mode, the log format, the roles, the retry tiers, and the users pipeline's own
//! settings that may be left empty ([`unset`]); what is wrong with a value ([`ValueError`]).

use serde::{Deserialize, Serialize};

/// What is wrong with a value of a setting: the rule's check names the setting and what was
/// expected; this says what part of the value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("{0:?} is not a role")]
    NotARole(String),
    #[error("{0:?} is not an integer")]
    NotAnInteger(String),
    #[error("{0} tiers, more than {MAX_RETRY_TIERS}")]
    TooManyTiers(usize),
    #[error("{0} is out of range")]
    OutOfRange(u64),
    #[error("{later} does not follow {earlier} upwards")]
    NotIncreasing { earlier: u64, later: u64 },
}

/// The type of the queues warren declares (`QUEUE_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Classic queues: what warren declared before the setting existed.
    Classic,
    /// Quorum queues: replicated, at-least-once dead-lettering, a delivery limit.
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl std::fmt::Display for QueueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a pipeline's batch inserts in flight follow its backlog (`BALANCE`, a pipeline's
/// `balance`; docs/balancing.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Balance {
    /// A fixed number: the batch concurrency.
    #[default]
    Off,
    /// `min(max, max(min, ceil(backlog / threshold)))`, every cooldown.
    Simple,
    /// Step by step while a step makes the pipeline faster.
    Auto,
}

impl Balance {
    pub fn as_str(self) -> &'static str {
        match self {
            Balance::Off => "off",
            Balance::Simple => "simple",
            Balance::Auto => "auto",
        }
    }
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How log lines are written (`LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, fields flattened (for log shippers).
    Json,
}

/// A part of warren that `warren run` can run (`ROLES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The main pipeline: the main queue into the table, failures to retry or DLQ.
    Consumer,
    /// The DLQ consumer: the DLQ into the table, or parked.
    Dlq,
    /// The REST API.
    Api,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Consumer, Role::Dlq, Role::Api];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Consumer => "consumer",
            Role::Dlq => "dlq",
            Role::Api => "api",
        }
    }

    fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// The roles of one `warren run`: a non-empty set, written comma-separated (`consumer,api`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles(Vec<Role>);

impl Roles {
    /// Parses `"consumer, api"`: blanks around names allowed, at least one, each known.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        let mut roles = Vec::new();
        for name in text.split(',').map(str::trim) {
            let role = Role::parse(name).ok_or_else(|| ValueError::NotARole(name.into()))?;
            if !roles.contains(&role) {
                roles.push(role);
            }
        }
        Ok(Roles(roles))
    }

    pub fn contains(&self, role: Role) -> bool {
        self.0.contains(&role)
    }

    /// The names known, for error messages: `consumer,dlq,api`.
    pub fn known() -> String {
        Role::ALL.map(Role::as_str).join(",")
    }
}

impl std::fmt::Display for Roles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|r| r.as_str()).collect();
        f.write_str(&names.join(","))
    }
}

impl Serialize for Roles {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Roles {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Roles::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The TTLs of the retry tiers in ms, in order (`RETRY_TTLS_MS`); empty = the single tier of
/// `RETRY_TTL_MS`. Written as a comma-separated list (`"1000,10000,60000"`); a list of integers
/// or one integer is read too (an environment variable holding one number arrives as one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryTtls(pub Vec<u64>);

/// Most retry tiers (more would be more queues than any backoff needs).
pub const MAX_RETRY_TIERS: usize = 10;
/// Bounds of one retry TTL in ms, as `RETRY_TTL_MS`.
pub(super) const RETRY_TTL_RANGE: (u64, u64) = (1, 86_400_000);

impl RetryTtls {
    /// Parses `"1000, 10000,60000"`; blanks around entries are allowed, an empty text is no tier.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let ttls = text
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<u64>()
                    .map_err(|_| ValueError::NotAnInteger(t.trim().into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::checked(ttls)
    }

    /// The tiers if there are at most [`MAX_RETRY_TIERS`], each in range, increasing.
    pub(super) fn checked(ttls: Vec<u64>) -> Result<Self, ValueError> {
        let (min, max) = RETRY_TTL_RANGE;
        if ttls.len() > MAX_RETRY_TIERS {
            return Err(ValueError::TooManyTiers(ttls.len()));
        }
        if let Some(t) = ttls.iter().find(|t| !(min..=max).contains(*t)) {
            return Err(ValueError::OutOfRange(*t));
        }
        if let Some(w) = ttls.windows(2).find(|w| w[0] >= w[1]) {
            return Err(ValueError::NotIncreasing {
                earlier: w[0],
                later: w[1],
            });
        }
        Ok(Self(ttls))
    }
}

impl Serialize for RetryTtls {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = self.0.iter().map(u64::to_string).collect();
        s.serialize_str(&text.join(","))
    }
}

impl<'de> Deserialize<'de> for RetryTtls {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            One(u64),
            Many(Vec<u64>),
        }
        let parsed = match Raw::deserialize(d)? {
            Raw::Text(t) => RetryTtls::parse(&t),
            Raw::One(n) => RetryTtls::checked(vec![n]),
            Raw::Many(v) => RetryTtls::checked(v),
        };
        parsed.map_err(serde::de::Error::custom)
    }
}

/// One retry tier: the queue a retry waits in and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryTier {
    pub queue: String,
    pub ttl_ms: u64,
}

/// A TTL as the suffix of a tier queue's name: whole hours `2h`, minutes `1m`, seconds `10s`,
/// else milliseconds `300ms`.
pub fn humanize_ms(ms: u64) -> String {
    match ms {
        0 => "0ms".into(),
        _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
        _ if ms.is_multiple_of(60_000) => format!("{}m", ms / 60_000),
        _ if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        _ => format!("{ms}ms"),
    }
}

/// `raffle_retry_10s` -> `raffle_retry`: the name without a trailing `_<number><ms|s|m|h>`.
pub fn retry_base(retry_queue: &str) -> &str {
    let Some((base, suffix)) = retry_queue.rsplit_once('_') else {
        return retry_queue;
    };
    let digits = suffix.chars().take_while(char::is_ascii_digit).count();
    let unit = &suffix[digits..];
    if digits > 0 && !base.is_empty() && ["ms", "s", "m", "h"].contains(&unit) {
        base
    } else {
        retry_queue
    }
}

/// A setting of the users pipeline's own (`users_batch_size`, ...) that may be left empty:
/// `""` (the shipped default, or `USERS_BATCH_SIZE=` in the environment) is `None`, the
/// default of the same name applies; a value is `Some`. `warren config` shows `None` as `""`.
pub mod unset {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(
        value: &Option<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => v.serialize(s),
            None => s.serialize_str(""),
        }
    }

    pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw<T> {
            Value(T),
            Text(String),
        }
        match Raw::<T>::deserialize(d)? {
            Raw::Value(v) => Ok(Some(v)),
            Raw::Text(t) if t.trim().is_empty() => Ok(None),
            Raw::Text(t) => Err(serde::de::Error::custom(format!(
                "{t:?}: expected a value or nothing (empty)"
            ))),
        }
    }
}
