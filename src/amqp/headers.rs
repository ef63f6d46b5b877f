//! The headers warren reads and writes: `x-retries` (read robustly, always written as an
//! integer), `x-retry-reason`, `x-error-kind` / `x-error-reason` on dead-lettered messages (reasons
//! capped at [`REASON_MAX`] bytes), and `x-dlq-attempts`, the DLQ consumer's own attempt count.
//! The properties of every copy warren publishes are made by `amqp::republish`.

use lapin::BasicProperties;
use lapin::types::AMQPValue;

pub const X_RETRIES: &str = "x-retries";
pub const X_RETRY_REASON: &str = "x-retry-reason";
pub const X_ERROR_KIND: &str = "x-error-kind";
pub const X_ERROR_REASON: &str = "x-error-reason";
pub const X_DLQ_ATTEMPTS: &str = "x-dlq-attempts";

/// Longest reason written to a header, in bytes (cut on a character boundary).
pub const REASON_MAX: usize = 1024;

/// `text` cut to at most `max` bytes on a character boundary, with `…` when cut.
pub fn capped(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut cut = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut]).into()
}

/// What reading `x-retries` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retries {
    /// A usable count (missing counts as 0).
    Count(u32),
    /// Present but unusable (a string, a negative number, a float...): treated as 0, and the
    /// description says what was there so it can be logged.
    Invalid(String),
}

impl Retries {
    /// The count to act on: invalid values count as 0, so the next retry rewrites them.
    pub fn count(&self) -> u32 {
        match self {
            Retries::Count(n) => *n,
            Retries::Invalid(_) => 0,
        }
    }
}

/// Reads `x-retries`: missing is 0, any AMQP integer type is read, anything else is invalid.
pub fn retries(properties: &BasicProperties) -> Retries {
    count(properties, X_RETRIES)
}

/// Reads `x-dlq-attempts` the same way as `x-retries`.
pub fn dlq_attempts(properties: &BasicProperties) -> Retries {
    count(properties, X_DLQ_ATTEMPTS)
}

/// Reads a count header: missing is 0, any AMQP integer type is read, anything else is invalid.
fn count(properties: &BasicProperties, key: &str) -> Retries {
    let Some(value) = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(key))
    else {
        return Retries::Count(0);
    };
    let n: Option<i128> = match value {
        AMQPValue::ShortShortInt(v) => Some(*v as i128),
        AMQPValue::ShortShortUInt(v) => Some(*v as i128),
        AMQPValue::ShortInt(v) => Some(*v as i128),
        AMQPValue::ShortUInt(v) => Some(*v as i128),
        AMQPValue::LongInt(v) => Some(*v as i128),
        AMQPValue::LongUInt(v) => Some(*v as i128),
        AMQPValue::LongLongInt(v) => Some(*v as i128),
        _ => None,
    };
    match n {
        Some(n) if n >= 0 => Retries::Count(n.min(u32::MAX as i128) as u32),
        Some(n) => Retries::Invalid(format!("negative {key} {n}")),
        None => Retries::Invalid(format!("{key} of unusable type: {value:?}")),
    }
}

/// The header warren's publisher sets to the publish time in Unix milliseconds (the AMQP
/// timestamp has one-second resolution): end-to-end latency is measured from it.
pub const PUBLISHED_MS: &str = "x-published-ms";

/// When the message was published, in Unix milliseconds: `x-published-ms` when present, else
/// the AMQP timestamp (whole seconds, as other publishers set it); `None` without either.
pub fn published_ms(properties: &BasicProperties) -> Option<u64> {
    let header = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(PUBLISHED_MS));
    match header {
        Some(AMQPValue::LongLongInt(ms)) if *ms > 0 => Some(*ms as u64),
        Some(AMQPValue::Timestamp(ms)) if *ms > 0 => Some(*ms),
        _ => properties
            .timestamp()
            .filter(|s| *s > 0)
            .map(|s| s.saturating_mul(1000)),
    }
}

/// The W3C Trace Context header: kept on every copy warren publishes (it is no header of warren's
/// own, see `republish.rs`), written in the log lines and events about its message, and set by
/// the HTTP API from the request's.
pub const TRACEPARENT: &str = "traceparent";

/// The message's `traceparent` header when it holds a valid one (W3C Trace Context: version,
/// trace id, parent id, flags in lower-case hex; neither id all zeros; version `ff` invalid).
pub fn traceparent(properties: &BasicProperties) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(TRACEPARENT)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .ok()
            .filter(|t| valid_traceparent(t))
            .map(str::to_string),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()).filter(|t| valid_traceparent(t)),
        _ => None,
    }
}

/// Whether `text` is a `traceparent` value a W3C Trace Context reader accepts: version `00` is
/// exactly 55 characters; a later version may carry more after a `-`.
pub fn valid_traceparent(text: &str) -> bool {
    let b = text.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b.get(r)
            .is_some_and(|s| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')))
    };
    let nonzero =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|s| s.iter().any(|c| *c != b'0'));
    let shape = b.len() >= 55
        && hex(0..2)
        && b[2] == b'-'
        && hex(3..35)
        && b[35] == b'-'
        && hex(36..52)
        && b[52] == b'-'
        && hex(53..55)
        && nonzero(3..35)
        && nonzero(36..52);
    shape
        && match &b[..2] {
            b"ff" => false,
            b"00" => b.len() == 55,
            _ => b.len() == 55 || b.get(55) == Some(&b'-'),
        }
}

/// A header value as readable text (for logs, `dlq inspect` and the parked table).
pub fn text(properties: &BasicProperties, key: &str) -> Option<String> {
    let value = properties.headers().as_ref()?.inner().get(key)?;
    Some(value_text(value))
}

/// An AMQP value as text.
pub fn value_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Boolean(v) => v.to_string(),
        AMQPValue::Float(v) => v.to_string(),
        AMQPValue::Double(v) => v.to_string(),
        AMQPValue::Timestamp(v) => v.to_string(),
        other => format!("{other:?}"),
    }
}

/// The headers as JSON (for the `dead_letters` table).
pub fn to_json(properties: &BasicProperties) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    if let Some(headers) = properties.headers() {
        for (k, v) in headers.inner() {
            let json = match v {
                AMQPValue::LongLongInt(n) => serde_json::json!(n),
                AMQPValue::LongInt(n) => serde_json::json!(n),
                AMQPValue::ShortInt(n) => serde_json::json!(n),
                AMQPValue::Boolean(b) => serde_json::json!(b),
                other => serde_json::Value::String(value_text(other)),
            };
            map.insert(k.as_str().to_string(), json);
        }
    }
    serde_json::Value::Object(map)
}

/// The headers whose text warren may cut when a copy must fit in a frame (`republish::fit`).
pub const REASONS: [&str; 2] = [X_ERROR_REASON, X_RETRY_REASON];

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldTable;

    fn props(v: AMQPValue) -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert(X_RETRIES.into(), v);
        BasicProperties::default().with_headers(h)
    }

    #[test]
    fn missing_is_zero_and_every_integer_type_is_read() {
        assert_eq!(retries(&BasicProperties::default()), Retries::Count(0));
        assert_eq!(retries(&props(AMQPValue::ShortShortInt(2))).count(), 2);
        assert_eq!(retries(&props(AMQPValue::ShortShortUInt(2))).count(), 2);
        assert_eq!(retries(&props(AMQPValue::ShortInt(2))).count(), 2);
        assert_eq!(retries(&props(AMQPValue::ShortUInt(2))).count(), 2);
        assert_eq!(retries(&props(AMQPValue::LongInt(3))).count(), 3);
        assert_eq!(retries(&props(AMQPValue::LongUInt(3))).count(), 3);
        assert_eq!(retries(&props(AMQPValue::LongLongInt(1))).count(), 1);
    }

    #[test]
    fn strings_negatives_and_floats_are_invalid_and_count_as_zero() {
        for v in [
            AMQPValue::LongString("2".into()),
            AMQPValue::LongLongInt(-1),
            AMQPValue::Double(1.5),
            AMQPValue::Boolean(true),
        ] {
            let r = retries(&props(v));
            assert!(matches!(r, Retries::Invalid(_)), "{r:?}");
            assert_eq!(r.count(), 0);
        }
    }

    /// The W3C Trace Context rules: shape, lower-case hex, ids not all zeros, version ff
    /// invalid, version 00 exactly 55 characters, a later version possibly longer.
    #[test]
    fn a_traceparent_is_valid_only_as_w3c_trace_context_says() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid_traceparent(good));
        assert!(valid_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-later"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "é0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "€-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!valid_traceparent(bad), "{bad:?}");
        }
    }
}
