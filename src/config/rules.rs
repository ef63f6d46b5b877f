//! What each setting accepts ([`Rule`]) and the check of a raw value against it, before the
//! typed parse, so that the error names the setting, what was expected and what was given.

use std::net::SocketAddr;

use figment::value::Value;

use super::diagnose::{bool_hint, number_hint, ttls_hint};
use super::values::{RETRY_TTL_RANGE, Role, ValueError};
use super::{ConfigError, MAX_RETRY_TIERS, RetryTtls, Roles, redact_url};
use crate::text::closest;

/// What a setting accepts.
pub(super) enum Rule {
    /// What the inner rule accepts, or an empty string: the setting is not set (the users
    /// pipeline's own settings, whose default is another setting's).
    OrEmpty(&'static Rule),
    Int {
        min: u64,
        max: u64,
    },
    Url(&'static [&'static str]),
    /// A comma-separated list of AMQP URLs, each checked as the AMQP client parses it.
    AmqpUrls,
    /// A PostgreSQL URL as the client parses it, one host or several (`h1:5432,h2:5432`).
    PgUrl,
    Bool,
    Addr,
    Name,
    /// A prefix of Redis keys (`REDIS_PREFIX`): 1 to 255 characters without control characters
    /// (Redis has no reserved names, unlike the broker's `amq.`).
    KeyPrefix,
    Ident,
    Roles,
    /// A comma-separated list of retry TTLs (see [`RetryTtls`]).
    TtlList,
    OneOf(&'static [&'static str]),
    /// Any string, never shown in errors or `warren config`.
    Secret,
}

/// A listen address that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AddrError {
    /// Not `ip:port`, and `host:port` did not resolve.
    #[error("{0}")]
    Resolve(#[from] std::io::Error),
    /// The host resolved to nothing.
    #[error("{0} resolves to no address")]
    NoAddress(String),
}

/// A listen address (`HTTP_ADDR`, `METRICS_ADDR`): `ip:port`, or `host:port` resolved now (the
/// first address it resolves to).
pub fn listen_addr(text: &str) -> Result<SocketAddr, AddrError> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    use std::net::ToSocketAddrs as _;
    text.to_socket_addrs()?
        .next()
        .ok_or_else(|| AddrError::NoAddress(text.into()))
}

/// The entries of a comma-separated list, trimmed, in order (empty ones included, so that
/// validation can name them).
pub fn list_entries(raw: &str) -> impl Iterator<Item = &str> {
    raw.split(',').map(str::trim)
}

/// Why an entry of `AMQP_URL` is refused, as what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum AmqpUrlError {
    #[error("a URL starting with amqp:// or amqps://")]
    Scheme,
    /// The scheme is right, the port is not one.
    #[error("a port from 1 to 65535 after the host (amqp://user:password@host:5672/vhost)")]
    Port,
    /// A character of the user or password that ends them in a URL (`/`, `?`, `#`), not
    /// percent-encoded: the parser read the rest as the host and port.
    #[error("{}", Unencoded(*.0))]
    Unencoded(char),
    /// The scheme is right, there is no host after it.
    #[error("a host after amqp:// (amqp://user:password@host:5672/vhost)")]
    Host,
    /// The AMQP client's own parser refused it; its words, passwords redacted.
    #[error("an AMQP URL the client accepts ({0})")]
    Client(String),
    /// A `frame_max` no broker can work with: the handshake fails with FRAME-ERROR, for ever.
    #[error(
        "frame_max from {FRAME_MAX_MIN} (the AMQP 0-9-1 minimum frame size) to {FRAME_MAX_MAX} \
         (the broker lowers it to its own, 131072 by default on RabbitMQ), or no frame_max, \
         not {0}"
    )]
    FrameMax(u32),
    /// A numeric query parameter (`heartbeat`, `channel_max`, ...) that is not a number.
    #[error("{key} as a whole number of its unit (?{key}=60), not {value:?}")]
    Number { key: String, value: String },
}

/// The query parameters of an AMQP URL whose value the client reads as a number.
const NUMERIC_QUERY: &[&str] = &[
    "heartbeat",
    "channel_max",
    "frame_max",
    "connection_timeout",
];

/// The smallest `frame_max` AMQP 0-9-1 allows (its `frame-min-size`).
const FRAME_MAX_MIN: u32 = 4096;
/// The largest `frame_max` warren takes: a frame of 1 MiB is already more than RabbitMQ's own
/// limit, which the handshake settles on.
const FRAME_MAX_MAX: u32 = 1_048_576;

/// One entry of `AMQP_URL`: a URL of scheme amqp or amqps with a host, which the AMQP client
/// accepts too (it has its own parser, for query options such as heartbeat: a URL it refuses
/// must stop warren now, not loop in a reconnect). The error says what was expected.
fn check_amqp_url(entry: &str) -> Result<(), AmqpUrlError> {
    if let Some(c) = unencoded_userinfo(entry) {
        return Err(AmqpUrlError::Unencoded(c));
    }
    let lower = entry.to_ascii_lowercase();
    let amqp = lower.starts_with("amqp://") || lower.starts_with("amqps://");
    match url::Url::parse(entry) {
        Ok(u) if amqp && u.host_str().is_some_and(|h| !h.is_empty()) => {}
        Ok(_) | Err(url::ParseError::EmptyHost) if amqp => return Err(AmqpUrlError::Host),
        Err(url::ParseError::InvalidPort) if amqp => return Err(AmqpUrlError::Port),
        _ => return Err(AmqpUrlError::Scheme),
    }
    // The client's words for a number it cannot read name no parameter (review R40a F7):
    // its numeric query parameters are read here first.
    if let Ok(u) = url::Url::parse(entry) {
        for (key, value) in u.query_pairs() {
            if NUMERIC_QUERY.contains(&key.as_ref()) && value.parse::<u64>().is_err() {
                return Err(AmqpUrlError::Number {
                    key: key.into_owned(),
                    value: crate::text::shown(&value).into_owned(),
                });
            }
        }
    }
    let uri = entry
        .parse::<lapin::uri::AMQPUri>()
        .map_err(|e| AmqpUrlError::Client(redact_url(&e)))?;
    match uri.query.frame_max {
        Some(n) if !(FRAME_MAX_MIN..=FRAME_MAX_MAX).contains(&n) => Err(AmqpUrlError::FrameMax(n)),
        _ => Ok(()),
    }
}

/// A character that ends a URL's user and password (`/`, `?`, `#`) found between the scheme and
/// the last `@` (review R35e F11: a password with `#` read as "expected a port", the redacted
/// URL shown with a port). Never the password itself: only the character is named.
fn unencoded_userinfo(url: &str) -> Option<char> {
    let (_, rest) = url.split_once("://")?;
    let (userinfo, _) = rest.rsplit_once('@')?;
    userinfo.chars().find(|c| matches!(c, '/' | '?' | '#'))
}

/// What to say of a user or password holding `c` unencoded.
struct Unencoded(char);

impl std::fmt::Display for Unencoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let code = match self.0 {
            '/' => "%2F",
            '?' => "%3F",
            _ => "%23",
        };
        write!(
            f,
            "the user and password percent-encoded: a `{}` in them must be written {code} \
             (scheme://user:pass{code}word@host:port/...)",
            self.0
        )
    }
}

/// How a value is shown in an error: strings quoted, numbers bare.
fn show(value: &Value) -> String {
    match value {
        Value::String(_, s) => format!("{s:?}"),
        Value::Num(_, n) => match (n.to_u128(), n.to_i128(), n.to_f64()) {
            (Some(u), _, _) => u.to_string(),
            (_, Some(i), _) => i.to_string(),
            // As written: `5.0` is no integer, and must not read as `5`.
            (_, _, Some(f)) => format!("{f:?}"),
            _ => format!("{n:?}"),
        },
        Value::Bool(_, b) => b.to_string(),
        Value::Char(_, c) => format!("{c:?}"),
        Value::Empty(_, _) => "nothing".into(),
        Value::Dict(_, _) => "a table".into(),
        Value::Array(_, _) => "a list".into(),
    }
}

/// What was probably meant by a value `rule` refused for `key`, if something close is valid: a
/// number written as a string, with separators or with a unit; a boolean as a word; the closest
/// choice of a closed set (or role of a list); a bare port as an address. Never for a secret.
pub(super) fn suggest(key: &str, rule: &Rule, value: &Value) -> Option<String> {
    let text = match value {
        Value::String(_, s) => Some(s.as_str()),
        _ => None,
    };
    match rule {
        Rule::OrEmpty(inner) => suggest(key, inner, value),
        Rule::Int { min, max } => {
            let meant = match value {
                // `5.0`: the integer it means.
                Value::Num(_, n) => n
                    .to_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e15)
                    .map(|f| format!("{}", f as u64)),
                _ => number_hint(text?, key),
            }?;
            // Only a value the setting takes: the integer meant is no suggestion when it is
            // outside the range too (review R44 F2: `proc_concurrency = 1e3`, range 1 to 256, was
            // answered "did you mean 1000?"); the error names the range anyway.
            meant
                .parse::<u64>()
                .ok()
                .filter(|n| (*min..=*max).contains(n))
                .map(|n| n.to_string())
        }
        Rule::Bool => match value {
            Value::Num(_, n) => n.to_u128().and_then(|n| bool_hint(&n.to_string())),
            _ => bool_hint(text?),
        },
        Rule::OneOf(choices) => closest(text?, choices.iter().copied(), true).map(Into::into),
        Rule::Roles => {
            let names: Vec<&str> = Role::ALL.iter().map(|r| r.as_str()).collect();
            let fixed: Option<Vec<&str>> = text?
                .split(',')
                .map(|entry| closest(entry.trim(), names.iter().copied(), true))
                .collect();
            fixed.map(|roles| roles.join(","))
        }
        Rule::Addr => {
            let port = match value {
                Value::Num(_, n) => n.to_u128().and_then(|p| u16::try_from(p).ok()),
                _ => text?.trim().trim_start_matches(':').parse::<u16>().ok(),
            };
            port.map(|p| format!("127.0.0.1:{p}"))
        }
        // Only a list the setting takes (`"1s,1m"` is `1000,60000`).
        Rule::TtlList => {
            ttls_hint(text?).filter(|meant| check(key, rule, &Value::from(meant.clone())).is_ok())
        }
        Rule::Ident => {
            let lower = text?.to_ascii_lowercase();
            (check(key, rule, &Value::from(lower.clone())).is_ok()).then_some(lower)
        }
        _ => None,
    }
}

pub(super) fn check(key: &str, rule: &Rule, value: &Value) -> Result<(), ConfigError> {
    let invalid = |expected: String| ConfigError::Invalid {
        setting: key.to_ascii_uppercase(),
        expected,
        got: match (rule, value) {
            (Rule::Url(_) | Rule::AmqpUrls | Rule::PgUrl, Value::String(_, s)) => {
                format!("{:?}", redact_url(s))
            }
            _ => show(value),
        },
    };
    match rule {
        Rule::OrEmpty(inner) => {
            if matches!(value, Value::String(_, s) if s.trim().is_empty()) {
                return Ok(());
            }
            // The error reads as the default's: empty is the shipped value, seldom what was meant.
            return check(key, inner, value);
        }
        Rule::Int { min, max } => {
            let ok = match value {
                Value::Num(_, n) => n
                    .to_u128_lossy()
                    .is_some_and(|v| v >= *min as u128 && v <= *max as u128),
                _ => false,
            };
            if !ok {
                return Err(invalid(format!("an integer from {min} to {max}")));
            }
        }
        Rule::Url(schemes) => {
            let expected = || format!("a URL starting with {}://", schemes.join(":// or "));
            let Value::String(_, s) = value else {
                return Err(invalid(expected()));
            };
            if let Some(c) = unencoded_userinfo(s) {
                return Err(invalid(Unencoded(c).to_string()));
            }
            match url::Url::parse(s) {
                Ok(u) if schemes.contains(&u.scheme()) && u.host_str().is_some() => {
                    // The Redis client's own parser (the database number, the protocol): a URL
                    // it refuses never connects, and must stop warren now, not read as an
                    // outage for ever (review R35e F1).
                    if u.scheme() == "redis"
                        && let Err(e) = redis::Client::open(s.as_str())
                    {
                        return Err(invalid(format!(
                            "a Redis URL the client accepts ({})",
                            redact_url(&e.to_string())
                        )));
                    }
                }
                Err(url::ParseError::InvalidPort) => {
                    return Err(invalid(format!(
                        "a port from 1 to 65535 after the host ({}://host:6379)",
                        schemes[0]
                    )));
                }
                _ => return Err(invalid(expected())),
            }
        }
        Rule::AmqpUrls => {
            let Value::String(_, s) = value else {
                return Err(invalid(
                    "a URL starting with amqp:// or amqps:// (or several, separated by commas)"
                        .into(),
                ));
            };
            let entries: Vec<&str> = list_entries(s).collect();
            for (i, entry) in entries.iter().enumerate() {
                let Err(problem) = check_amqp_url(entry) else {
                    continue;
                };
                // One URL: the error reads as before; in a list it names the entry.
                return Err(if entries.len() == 1 {
                    invalid(problem.to_string())
                } else {
                    ConfigError::Invalid {
                        setting: format!(
                            "{} (entry {} of {})",
                            key.to_ascii_uppercase(),
                            i + 1,
                            entries.len()
                        ),
                        expected: problem.to_string(),
                        got: format!("{:?}", redact_url(entry)),
                    }
                });
            }
        }
        Rule::PgUrl => {
            let expected = |problem: String| {
                invalid(format!(
                    "a URL starting with postgres:// or postgresql://{problem} (one host, or \
                     several: postgres://user:password@host1:5432,host2:5432/db)"
                ))
            };
            let Value::String(_, s) = value else {
                return Err(expected(String::new()));
            };
            let lower = s.to_ascii_lowercase();
            if !lower.starts_with("postgres://") && !lower.starts_with("postgresql://") {
                return Err(expected(String::new()));
            }
            match s.parse::<tokio_postgres::Config>() {
                Ok(c) if c.get_hosts().is_empty() => {
                    return Err(expected(" naming a host".into()));
                }
                Ok(c) if c.get_ssl_mode() == tokio_postgres::config::SslMode::Require => {
                    return Err(expected(
                        " without sslmode=require (warren connects without TLS: it has no TLS \
                         implementation, so such a URL could never connect; use sslmode=disable \
                         or prefer, or a TLS-terminating proxy)"
                            .into(),
                    ));
                }
                Ok(_) => {}
                Err(e) => {
                    // Which parameter and why (`unknown option `sslpassword``), not only
                    // "invalid connection string"; it names options, never their values.
                    let why = match std::error::Error::source(&e) {
                        Some(cause) => format!("{e}: {cause}"),
                        None => e.to_string(),
                    };
                    return Err(expected(format!(
                        " that the PostgreSQL client accepts ({})",
                        redact_url(&why)
                    )));
                }
            }
        }
        Rule::Bool => {
            if !matches!(value, Value::Bool(..)) {
                return Err(invalid("true or false".into()));
            }
        }
        Rule::Addr => {
            let ok = matches!(value, Value::String(_, s) if listen_addr(s).is_ok());
            if !ok {
                return Err(invalid(
                    "an address host:port such as 127.0.0.1:8080 or localhost:8080 (a host name \
                     must resolve)"
                        .into(),
                ));
            }
        }
        Rule::Name => {
            let ok = matches!(value, Value::String(_, s)
                if !s.is_empty() && s.len() <= 255 && !s.starts_with("amq.") && !s.chars().any(char::is_control));
            if !ok {
                return Err(invalid(
                    "a name of 1 to 255 characters, not starting with \"amq.\"".into(),
                ));
            }
        }
        Rule::KeyPrefix => {
            let ok = matches!(value, Value::String(_, s)
                if !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control));
            if !ok {
                return Err(invalid(
                    "a Redis key prefix of 1 to 255 characters without control characters".into(),
                ));
            }
        }
        Rule::Ident => {
            let ok = matches!(value, Value::String(_, s)
                if !s.is_empty() && s.len() <= 63
                    && s.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
                    && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
            if !ok {
                return Err(invalid(
                    "an SQL identifier: lower-case letters, digits and _, at most 63".into(),
                ));
            }
        }
        Rule::Roles => {
            if !matches!(value, Value::String(_, s) if Roles::parse(s).is_ok()) {
                return Err(invalid(format!(
                    "a comma-separated subset of {}",
                    Roles::known()
                )));
            }
        }
        Rule::Secret => {
            if !matches!(value, Value::String(..)) {
                return Err(ConfigError::Invalid {
                    setting: key.to_ascii_uppercase(),
                    expected: "a string".into(),
                    got: "a value of another type (not shown)".into(),
                });
            }
        }
        Rule::TtlList => {
            let parsed = match value {
                Value::String(_, s) => RetryTtls::parse(s),
                Value::Num(_, n) => n
                    .to_u128_lossy()
                    .and_then(|v| u64::try_from(v).ok())
                    .ok_or(ValueError::NotAnInteger(show(value)))
                    .and_then(|v| RetryTtls::checked(vec![v])),
                Value::Array(_, items) => items
                    .iter()
                    .map(|item| match item {
                        Value::Num(_, n) => n.to_u128_lossy().and_then(|v| u64::try_from(v).ok()),
                        _ => None,
                    })
                    .collect::<Option<Vec<u64>>>()
                    .ok_or(ValueError::NotAnInteger(show(value)))
                    .and_then(RetryTtls::checked),
                _ => Err(ValueError::NotAnInteger(show(value))),
            };
            if parsed.is_err() {
                let (min, max) = RETRY_TTL_RANGE;
                return Err(invalid(format!(
                    "a comma-separated list of at most {MAX_RETRY_TIERS} increasing TTLs in ms, \
                     each from {min} to {max} (empty = RETRY_TTL_MS alone)"
                )));
            }
        }
        Rule::OneOf(choices) => {
            let ok = matches!(value, Value::String(_, s) if choices.contains(&s.as_str()));
            if !ok {
                return Err(invalid(format!("one of {}", choices.join(", "))));
            }
        }
    }
    Ok(())
}

/// For tests that try every setting: a few valid values of each (by its rule, whatever its
/// default; some may still be refused in combination with the defaults of others, or equal the
/// default), in the order of [`super::RULES`].
#[cfg(test)]
pub fn sample_values() -> Vec<(&'static str, Vec<String>)> {
    fn of(rule: &Rule) -> Vec<String> {
        let strings = |values: &[&str]| values.iter().map(|v| v.to_string()).collect();
        match rule {
            Rule::OrEmpty(inner) => of(inner),
            Rule::Int { min, max } => {
                let mut values = vec![*min, min + 1, (min + max) / 2, *max];
                values.dedup();
                values.iter().map(u64::to_string).collect()
            }
            Rule::Url(schemes) => vec![format!("{}://127.0.0.1:6390", schemes[0])],
            Rule::AmqpUrls => strings(&["amqp://guest:guest@127.0.0.1:5673/%2f"]),
            Rule::PgUrl => strings(&["postgres://warren:secret@127.0.0.1:5433/other"]),
            Rule::Bool => strings(&["true", "false"]),
            Rule::Addr => strings(&["127.0.0.1:1"]),
            Rule::Name => strings(&["sample_name"]),
            Rule::KeyPrefix => strings(&["sample:"]),
            Rule::Ident => strings(&["sample_schema"]),
            Rule::Roles => strings(&["consumer", "dlq", "consumer,dlq,api"]),
            Rule::TtlList => strings(&["", "1000", "1000,60000"]),
            Rule::OneOf(choices) => strings(choices),
            Rule::Secret => strings(&["sample-secret"]),
        }
    }
    super::RULES
        .iter()
        .map(|(key, rule)| (*key, of(rule)))
        .collect()
}
