//! The headers warren reads and writes: `x-retries` (read robustly, always written as an
//! integer), `x-retry-reason`, `x-error-kind` / `x-error-reason` on dead-lettered messages (reasons
//! capped at [`REASON_MAX`] bytes), and `x-dlq-attempts`, the DLQ consumer's own attempt count.
//! The properties of every copy warren publishes are made by `amqp::republish`.
//!
//! One bound on what comes from outside lives here too: [`short`], the one checked constructor
//! of an AMQP short string (a message id, a header name) from text warren did not write itself.
//! The cap on a message's content wherever it reaches an event or a log line is
//! [`crate::text::shown`].

use lapin::BasicProperties;
use lapin::types::{AMQPValue, ShortString, parsing};

use crate::text::shown;

pub const X_RETRIES: &str = "x-retries";
pub const X_RETRY_REASON: &str = "x-retry-reason";
pub const X_ERROR_KIND: &str = "x-error-kind";
pub const X_ERROR_REASON: &str = "x-error-reason";
pub const X_DLQ_ATTEMPTS: &str = "x-dlq-attempts";

/// Longest reason written to a header, in bytes (cut on a character boundary).
pub const REASON_MAX: usize = 1024;

/// The most bytes an AMQP short string holds (a message id, a header name, a queue name).
pub const SHORT_MAX: usize = 255;

/// Text too long for an AMQP short string: `len` bytes, over [`SHORT_MAX`]. The caller names
/// what the text was to be (`key code: at most 255 bytes as a message id, found 300`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("at most {SHORT_MAX} bytes, found {len}")]
pub struct TooLong {
    /// The text's length in bytes.
    pub len: usize,
}

/// `text` as an AMQP short string, or [`TooLong`]: the one way warren makes a short string from
/// text it did not write itself (lapin's `From<&str>` panics past 255 bytes).
pub fn short(text: impl Into<String>) -> Result<ShortString, TooLong> {
    let text = text.into();
    let len = text.len();
    ShortString::try_new(text).map_err(|_| TooLong { len })
}

/// What reading `x-retries` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retries {
    /// A usable count (missing counts as 0).
    Count(u32),
    /// Present but unusable (a string, a negative number, a float...): treated as 0, and the
    /// description says what was there so it can be logged.
    Invalid(String),
    /// Not found among the parsed headers, and the raw rest of the table (past the parser's
    /// memory budget, kept as raw bytes under [`UNPARSED_KEY`]) is not well-formed up to where
    /// it would be: the count may be in there. Acted on as exhausted, so such a message is
    /// never cycled with a count that would not grow. (A count in a well-formed rest is read
    /// there: until review R36e F1 any rest made the count unreadable, and a publisher's own
    /// `x-unparsed-entries` header sent its message to the DLQ at its first transient error.)
    Unreadable,
}

impl Retries {
    /// The count to act on: invalid values count as 0, so the next retry rewrites them; an
    /// unreadable count as `u32::MAX`.
    pub fn count(&self) -> u32 {
        match self {
            Retries::Count(n) => *n,
            Retries::Invalid(_) => 0,
            Retries::Unreadable => u32::MAX,
        }
    }
}

/// The header under which the AMQP parser (warren's patch of amq-protocol-types) keeps, as raw
/// bytes, the rest of a header table past its memory budget (128 KiB parsed).
pub const UNPARSED_KEY: &str = lapin::types::parsing::UNPARSED_KEY;

mod raw;
use raw::raw_header;
pub use raw::{RawEntry, rewrite_unparsed, unparsed};

/// The header tables a header column reads could not be read as far as its name: past the
/// parser's budget ([`MAX_PARSED_BYTES`]), the rest of the table is kept as raw bytes
/// ([`UNPARSED_KEY`]) and those are not a well-formed run of AMQP table entries, so whether the
/// message carries the header cannot be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot be read: past the first {} KiB the AMQP parser reads of a header table, the rest \
     (kept as raw bytes, {UNPARSED_KEY}) is not well-formed",
    MAX_PARSED_BYTES / 1024
)]
pub struct Unreadable;

/// What the parser reads of one header table before it keeps the rest as raw bytes.
pub const MAX_PARSED_BYTES: usize = lapin::types::parsing::MAX_PARSED_BYTES;

/// Header `name` of `table`, wherever the parser left it: among the parsed entries or, past the
/// parser's budget ([`MAX_PARSED_BYTES`]), in the raw bytes of the rest of the table
/// ([`UNPARSED_KEY`]). The budget bounds what a hostile table takes in memory once parsed; the
/// raw rest is searched without parsing it (each entry stepped over by its encoded length: no
/// allocation, one pass over bytes the delivery holds already, at most a frame's), and only the
/// value found is parsed, so reading a header costs no more than the budget allows. A table or
/// array found there is given as the raw bytes of its content (a byte array), as the parser
/// keeps a nested container past its budget. Of two entries of one name the later counts, as
/// when a table is parsed whole. [`Unreadable`] when the raw rest is not well-formed up to
/// where the name would be.
pub fn header<'a>(
    table: &'a lapin::types::FieldTable,
    name: &str,
) -> Result<Option<std::borrow::Cow<'a, AMQPValue>>, Unreadable> {
    use std::borrow::Cow;
    let entries = table.inner();
    if let Some(raw) = unparsed(table) {
        if let Some(value) = raw_header(raw, name)? {
            return Ok(Some(Cow::Owned(value)));
        }
        // The rest itself is no header of the message's (one the publisher named so is among
        // the raw entries, found above).
        if name == UNPARSED_KEY {
            return Ok(None);
        }
    }
    Ok(entries.get(name).map(Cow::Borrowed))
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
    // Wherever the parser left it: in a raw rest too (a copy writes its count back there as
    // it reads it here: `republish::copy_properties` drops the rest's own).
    let value = match properties.headers().as_ref().map(|h| header(h, key)) {
        None | Some(Ok(None)) => return Retries::Count(0),
        Some(Err(Unreadable)) => return Retries::Unreadable,
        Some(Ok(Some(value))) => value,
    };
    let n: Option<i128> = match &*value {
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
        // The value is the publisher's: shown capped, as everything of a message in a log line.
        None => Retries::Invalid(format!(
            "{key} of unusable type: {}",
            shown(&format!("{value:?}"))
        )),
    }
}

/// Where the original of a copy warren republished was published: its exchange and routing
/// key (set on every copy, `republish::stamp_origin`: a retry comes back from the retry tier
/// through the DLX, a replay through the main exchange, and the broker's own `exchange` and
/// `routing_key` then name warren's hop, not the publisher's).
pub const X_WARREN_EXCHANGE: &str = "x-warren-exchange";
pub const X_WARREN_ROUTING_KEY: &str = "x-warren-routing-key";
/// The original's properties a parked row keeps in its headers (the parking table has columns
/// for the message id and headers only), given back as properties by a parked replay.
pub const X_WARREN_TIMESTAMP: &str = "x-warren-timestamp";
pub const X_WARREN_CORRELATION_ID: &str = "x-warren-correlation-id";
pub const X_WARREN_TYPE: &str = "x-warren-type";
pub const X_WARREN_APP_ID: &str = "x-warren-app-id";
pub const X_WARREN_CONTENT_TYPE: &str = "x-warren-content-type";

/// The exchange and routing key a message was first published with, from the message as
/// delivered (`exchange`, `routing_key`): a copy of warren's names them in
/// [`X_WARREN_EXCHANGE`] and [`X_WARREN_ROUTING_KEY`]; a message the broker dead-lettered
/// (expired, over a delivery limit) before warren copied it names its first hop in
/// `x-first-death-exchange` and the routing keys of the `x-death` entry of that first death;
/// else the delivery's own. A publisher can write these headers too: they are believed, as
/// every property is.
pub fn origin<'a>(
    properties: &'a BasicProperties,
    exchange: &'a str,
    routing_key: &'a str,
) -> (std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>) {
    use std::borrow::Cow;
    let Some(table) = properties.headers().as_ref() else {
        return (Cow::Borrowed(exchange), Cow::Borrowed(routing_key));
    };
    let headers = table.inner();
    let string = |v: &AMQPValue| match v {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => Some(value_text(v)),
        _ => None,
    };
    // warren's own stamps, wherever the parser left them (in the raw rest of a table past its
    // budget too).
    let stamp = |name: &str| header(table, name).ok().flatten().and_then(|v| string(&v));
    if let Some(ex) = stamp(X_WARREN_EXCHANGE) {
        let rk = stamp(X_WARREN_ROUTING_KEY)
            .map(Cow::Owned)
            .unwrap_or(Cow::Borrowed(routing_key));
        return (Cow::Owned(ex), rk);
    }
    if let Some(ex) = headers.get("x-first-death-exchange").and_then(string) {
        let queue = headers.get("x-first-death-queue").and_then(string);
        let reason = headers.get("x-first-death-reason").and_then(string);
        // The first death's entry: its queue and reason, the last such in the history.
        let key = match headers.get("x-death") {
            Some(AMQPValue::FieldArray(deaths)) => deaths.as_slice().iter().rev().find_map(|d| {
                let AMQPValue::FieldTable(t) = d else {
                    return None;
                };
                let t = t.inner();
                let same = t.get("queue").and_then(string) == queue
                    && t.get("reason").and_then(string) == reason
                    && t.get("exchange").and_then(string).as_deref() == Some(ex.as_str());
                match t.get("routing-keys") {
                    Some(AMQPValue::FieldArray(keys)) if same => {
                        keys.as_slice().first().and_then(string)
                    }
                    _ => None,
                }
            }),
            _ => None,
        };
        if let Some(key) = key {
            return (Cow::Owned(ex), Cow::Owned(key));
        }
    }
    (Cow::Borrowed(exchange), Cow::Borrowed(routing_key))
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

/// What one entry of a parsed header table takes beyond its key's bytes and its value's own
/// allocations: its slot in a B-tree node (key and value), the node's slack and the key's
/// allocation.
const TABLE_ENTRY_BYTES: usize = 128;
/// A table's first B-tree node (11 slots), allocated by its first entry.
const TABLE_NODE_BYTES: usize = 640;
/// What one element of a parsed field array takes beyond its own allocations: the value and the
/// vector's spare capacity.
const ARRAY_ELEMENT_BYTES: usize = 2 * std::mem::size_of::<AMQPValue>();

/// About the bytes `properties` hold once parsed, beyond their fixed size: the strings' bytes
/// and the header table, each table, entry and element counted at what it takes in memory, not
/// on the wire. A header table can take many times its wire size (an array of voids: one byte
/// each on the wire, 64 parsed with the array's spare room; the parser stops that at 128 KiB a
/// table, keeping the rest as bytes), so the consumer's byte budget (`MAX_INFLIGHT_BYTES`)
/// counts this beside the body. Walks the table once; a message without headers costs a few
/// branches.
pub fn parsed_bytes(properties: &BasicProperties) -> usize {
    let strings = [
        properties.content_type(),
        properties.content_encoding(),
        properties.correlation_id(),
        properties.reply_to(),
        properties.expiration(),
        properties.message_id(),
        properties.kind(),
        properties.user_id(),
        properties.app_id(),
        properties.cluster_id(),
    ];
    let strings: usize = strings
        .iter()
        .filter_map(|s| s.as_ref())
        .map(|s| s.as_str().len())
        .sum();
    strings + properties.headers().as_ref().map_or(0, table_bytes)
}

pub(crate) fn table_bytes(table: &lapin::types::FieldTable) -> usize {
    let entries = table.inner();
    let node = if entries.is_empty() {
        0
    } else {
        TABLE_NODE_BYTES
    };
    node + entries
        .iter()
        .map(|(key, value)| TABLE_ENTRY_BYTES + key.as_str().len() + value_bytes(value))
        .sum::<usize>()
}

/// A value's bytes beyond its slot. Recursion is bounded by the parser's nesting limit (64).
fn value_bytes(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::ShortString(s) => s.as_str().len(),
        AMQPValue::LongString(s) => s.as_bytes().len(),
        AMQPValue::ByteArray(b) => b.as_slice().len(),
        AMQPValue::FieldTable(t) => table_bytes(t),
        AMQPValue::FieldArray(a) => a
            .as_slice()
            .iter()
            .map(|v| ARRAY_ELEMENT_BYTES + value_bytes(v))
            .sum(),
        _ => 0,
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

/// Longest `traceparent` warren carries, in bytes. Version `00` is 55; a later version may add
/// fields after a `-`, which W3C Trace Context lets a vendor ignore: a longer value is treated as
/// no traceparent at all (the API publishes without it, events and log lines leave it out), so a
/// client's header can neither make a request fail (a content header over the link's frame) nor
/// grow every event and log line about its message. The header itself stays on the message.
pub const TRACEPARENT_MAX: usize = 512;

/// Whether `text` is a `traceparent` value a W3C Trace Context reader accepts and warren carries:
/// version `00` is exactly 55 characters; a later version may carry more after a `-`, up to
/// [`TRACEPARENT_MAX`] bytes in all.
pub fn valid_traceparent(text: &str) -> bool {
    let b = text.as_bytes();
    if b.len() > TRACEPARENT_MAX {
        return false;
    }
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
    // Wherever the parser left it: past its budget too (review R38i F4: `dlq inspect` showed no
    // kind for a copy whose own stamps were in the raw rest, and `replay --kind` skipped it).
    let value = header(properties.headers().as_ref()?, key).ok()??;
    Some(value_text(&value))
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
            map.insert(k.as_str().to_string(), value_json(v));
        }
    }
    serde_json::Value::Object(map)
}

/// The headers a parked row keeps of a message delivered with `exchange` and `routing_key`:
/// its headers ([`to_json`]), where it was first published ([`origin`]) and the properties
/// the parking table has no column for (timestamp, correlation id, type, app id, content type,
/// as `x-warren-*`), which a parked replay gives back as properties.
pub fn parked_json(
    properties: &BasicProperties,
    exchange: &str,
    routing_key: &str,
) -> serde_json::Value {
    let mut json = to_json(properties);
    let (ex, rk) = origin(properties, exchange, routing_key);
    if let serde_json::Value::Object(map) = &mut json {
        map.insert(X_WARREN_EXCHANGE.into(), ex.as_ref().into());
        map.insert(X_WARREN_ROUTING_KEY.into(), rk.as_ref().into());
        if let Some(t) = properties.timestamp() {
            map.insert(X_WARREN_TIMESTAMP.into(), (*t).into());
        }
        for (key, value) in [
            (X_WARREN_CORRELATION_ID, properties.correlation_id()),
            (X_WARREN_TYPE, properties.kind()),
            (X_WARREN_APP_ID, properties.app_id()),
            (X_WARREN_CONTENT_TYPE, properties.content_type()),
        ] {
            if let Some(v) = value {
                map.insert(key.into(), v.as_str().into());
            }
        }
    }
    json
}

/// The key of the JSON object that stands for an AMQP value JSON has no form of its own.
const TAG: &str = "$amqp";

/// One header value as JSON, reversibly for what a replay must give back as it came
/// ([`json_value`]): integers of 16 bits and more as numbers, booleans, void as null, UTF-8
/// strings as strings; byte arrays, strings of invalid UTF-8 or holding U+0000, decimals,
/// timestamps, arrays and
/// tables as an object tagged `"$amqp"` (bytes in hex). Other values (8-bit integers, floats) as
/// their text, as before.
fn value_json(v: &AMQPValue) -> serde_json::Value {
    use serde_json::{Value, json};
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    match v {
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::Void => Value::Null,
        // A string holding U+0000 too: PostgreSQL's jsonb cannot hold it, and an escaped copy
        // would come back from a replay as other text.
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(text) if !text.contains('\0') => Value::String(text.to_string()),
            _ => json!({TAG: "long_string", "hex": hex(s.as_bytes())}),
        },
        AMQPValue::ByteArray(b) => json!({TAG: "byte_array", "hex": hex(b.as_slice())}),
        // The parser's raw rest: given back as the entries it holds (`unparsed`).
        AMQPValue::FieldArray(_) if parsing::as_unparsed_entries(v).is_some() => {
            json!({TAG: "unparsed_entries", "hex": hex(parsing::as_unparsed_entries(v).unwrap_or_default())})
        }
        AMQPValue::DecimalValue(d) => json!({TAG: "decimal", "scale": d.scale, "value": d.value}),
        AMQPValue::Timestamp(t) => json!({TAG: "timestamp", "value": t}),
        AMQPValue::FieldArray(a) => {
            json!({TAG: "field_array", "value": a.as_slice().iter().map(value_json).collect::<Vec<_>>()})
        }
        AMQPValue::FieldTable(t) => json!({TAG: "field_table", "value": t
            .inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), value_json(v)))
            .collect::<serde_json::Map<_, _>>()}),
        other => Value::String(value_text(other)),
    }
}

/// Why a parked header's JSON cannot be given back as the AMQP value it stands for
/// ([`json_value`]): which part of the tagged form is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedHeader {
    /// A `long_string` or `byte_array` without its `hex` text.
    #[error("no \"hex\" text")]
    NoHex,
    /// `hex` text of an odd length.
    #[error("odd \"hex\" text")]
    OddHex,
    /// `hex` text with a pair that is no hexadecimal byte.
    #[error("bad \"hex\" text")]
    BadHex,
    #[error("a decimal without a scale of 0 to 255")]
    DecimalScale,
    #[error("a decimal without a 32-bit value")]
    DecimalValue,
    #[error("a timestamp without a value")]
    Timestamp,
    #[error("a field array without a value list")]
    FieldArray,
    #[error("a field table without a value object")]
    FieldTable,
    /// A nested table's key longer than AMQP allows.
    #[error("a table key: {0}")]
    TableKey(#[from] TooLong),
    /// A `$amqp` tag warren never writes (or none that is text).
    #[error("unknown \"$amqp\" tag {0:?}")]
    UnknownTag(Option<String>),
}

/// The AMQP value a parked header's JSON stands for ([`value_json`] reversed): numbers as 64-bit
/// integers, strings as long strings, null as void, the tagged objects as what they tag. Other
/// JSON (a float, an untagged array or object) as its JSON text. `Err` names what is malformed.
pub fn json_value(json: &serde_json::Value) -> Result<AMQPValue, MalformedHeader> {
    use serde_json::Value;
    let unhex = |v: &Value| -> Result<Vec<u8>, MalformedHeader> {
        let text = v
            .get("hex")
            .and_then(Value::as_str)
            .ok_or(MalformedHeader::NoHex)?;
        if text.len() % 2 != 0 {
            return Err(MalformedHeader::OddHex);
        }
        (0..text.len())
            .step_by(2)
            .map(|i| {
                text.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(MalformedHeader::BadHex)
            })
            .collect()
    };
    Ok(match json {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) if n.as_i64().is_some() => AMQPValue::LongLongInt(n.as_i64().unwrap_or(0)),
        Value::String(s) => AMQPValue::LongString(s.as_bytes().to_vec().into()),
        Value::Object(o) if o.get(TAG).is_some() => {
            let value = o.get("value");
            match o.get(TAG).and_then(Value::as_str) {
                Some("long_string") => AMQPValue::LongString(unhex(json)?.into()),
                Some("byte_array") => AMQPValue::ByteArray(unhex(json)?.into()),
                Some("unparsed_entries") => parsing::unparsed_entries(unhex(json)?),
                Some("decimal") => AMQPValue::DecimalValue(lapin::types::DecimalValue {
                    scale: o
                        .get("scale")
                        .and_then(Value::as_u64)
                        .and_then(|s| u8::try_from(s).ok())
                        .ok_or(MalformedHeader::DecimalScale)?,
                    value: value
                        .and_then(Value::as_u64)
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or(MalformedHeader::DecimalValue)?,
                }),
                Some("timestamp") => AMQPValue::Timestamp(
                    value
                        .and_then(Value::as_u64)
                        .ok_or(MalformedHeader::Timestamp)?,
                ),
                Some("field_array") => AMQPValue::FieldArray(
                    value
                        .and_then(Value::as_array)
                        .ok_or(MalformedHeader::FieldArray)?
                        .iter()
                        .map(json_value)
                        .collect::<Result<Vec<_>, _>>()?
                        .into(),
                ),
                Some("field_table") => {
                    let mut table = lapin::types::FieldTable::default();
                    for (k, v) in value
                        .and_then(Value::as_object)
                        .ok_or(MalformedHeader::FieldTable)?
                    {
                        table.insert(short(k.as_str())?, json_value(v)?);
                    }
                    AMQPValue::FieldTable(table)
                }
                other => return Err(MalformedHeader::UnknownTag(other.map(String::from))),
            }
        }
        other => AMQPValue::LongString(other.to_string().into_bytes().into()),
    })
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

    /// `table` as the consumer receives it: encoded, then parsed by lapin's (patched) parser.
    fn received(table: &FieldTable) -> FieldTable {
        use amq_protocol::frame::WriteContext;
        let ctx = lapin::types::generation::gen_field_table(table)(WriteContext::from(Vec::new()))
            .expect("encode");
        let bytes = ctx.write;
        lapin::types::parsing::parse_field_table(&bytes[..])
            .expect("parse")
            .1
    }

    /// 2,000 voids sorted before the names that follow spend the parser's budget (each entry
    /// is charged ~130 bytes), so what sorts after them is kept raw.
    fn past_the_budget(after: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for i in 0..2_000 {
            t.insert(format!("x-f{i:04}").into(), AMQPValue::Void);
        }
        for (k, v) in after {
            t.insert((*k).into(), v.clone());
        }
        received(&t)
    }

    #[test]
    fn a_header_past_the_parsers_budget_is_read_from_the_raw_rest() {
        let values = [
            ("x-va-text", AMQPValue::LongString(b"acme".to_vec().into())),
            ("x-vb-bool", AMQPValue::Boolean(true)),
            ("x-vc-int", AMQPValue::LongLongInt(-7)),
            ("x-vd-short", AMQPValue::ShortInt(300)),
            ("x-ve-double", AMQPValue::Double(2.5)),
            ("x-vg-void", AMQPValue::Void),
            ("x-vh-time", AMQPValue::Timestamp(1_700_000_000)),
            ("x-vi-bytes", AMQPValue::ByteArray(vec![1, 2].into())),
        ];
        let mut nested = FieldTable::default();
        nested.insert("k".into(), AMQPValue::LongInt(1));
        let mut all = values.to_vec();
        all.push(("x-vj-table", AMQPValue::FieldTable(nested)));
        let table = past_the_budget(&all);
        assert!(table.inner().contains_key(UNPARSED_KEY), "budget not spent");
        for (name, value) in &values {
            assert!(table.inner().get(*name).is_none(), "{name} was parsed");
            assert_eq!(
                header(&table, name).map(|v| v.map(|v| v.into_owned())),
                Ok(Some(value.clone())),
                "{name}"
            );
        }
        // A container is given as its content's raw bytes, as the parser keeps one.
        assert!(matches!(
            header(&table, "x-vj-table"),
            Ok(Some(v)) if matches!(v.as_ref(), AMQPValue::ByteArray(_))
        ));
        assert_eq!(header(&table, "x-absent"), Ok(None));
        // One the parser read is read as before.
        assert_eq!(
            header(&table, "x-f0000").map(|v| v.map(|v| v.into_owned())),
            Ok(Some(AMQPValue::Void))
        );
    }

    #[test]
    fn raw_entries_that_are_not_well_formed_are_unreadable_and_the_later_entry_counts() {
        let raw_table = |raw: Vec<u8>| {
            let mut t = FieldTable::default();
            t.insert(
                "x-tenant".into(),
                AMQPValue::LongString(b"early".to_vec().into()),
            );
            t.insert(UNPARSED_KEY.into(), parsing::unparsed_entries(raw));
            t
        };
        let entry = |key: &str, value: &[u8]| {
            let mut e = vec![key.len() as u8];
            e.extend_from_slice(key.as_bytes());
            e.push(b'S');
            e.extend_from_slice(&(value.len() as u32).to_be_bytes());
            e.extend_from_slice(value);
            e
        };
        // The raw rest comes after the parsed entries: its entry of the name is the later one.
        let t = raw_table(entry("x-tenant", b"late"));
        assert_eq!(
            header(&t, "x-tenant").map(|v| v.map(|v| v.into_owned())),
            Ok(Some(AMQPValue::LongString(b"late".to_vec().into())))
        );
        // Cut short, an unknown type octet, a length past the end: cannot be told.
        let mut cut = entry("x-other", b"abc");
        cut.pop();
        assert_eq!(header(&raw_table(cut), "x-tenant"), Err(Unreadable));
        let mut odd = entry("x-other", b"abc");
        odd[8] = b'?';
        assert_eq!(header(&raw_table(odd), "x-tenant"), Err(Unreadable));
        let mut long = entry("x-other", b"abc");
        long[12] = 9;
        assert_eq!(header(&raw_table(long), "x-tenant"), Err(Unreadable));
        // A key of invalid UTF-8 is compared as the parser decodes it.
        let mut lossy = entry("x-ab", b"v");
        lossy[3] = 0xff;
        assert_eq!(
            header(&raw_table(lossy), "x-\u{FFFD}b").map(|v| v.is_some()),
            Ok(true)
        );
    }

    /// Review R38i F4: warren's own stamps on a copy of a message past the budget are in the
    /// raw rest; the DLQ tools read them there (`text`, `origin`).
    #[test]
    fn warrens_stamps_in_the_raw_rest_are_read_there() {
        let stamp = |key: &str, value: &[u8]| {
            [
                &[key.len() as u8][..],
                key.as_bytes(),
                b"S",
                &(value.len() as u32).to_be_bytes(),
                value,
            ]
            .concat()
        };
        let raw = [
            stamp(X_ERROR_KIND, b"retries_exhausted"),
            stamp(X_WARREN_EXCHANGE, b"shop"),
            stamp(X_WARREN_ROUTING_KEY, b"orders"),
        ]
        .concat();
        let mut h = FieldTable::default();
        h.insert(UNPARSED_KEY.into(), parsing::unparsed_entries(raw));
        let p = BasicProperties::default().with_headers(h);
        assert_eq!(text(&p, X_ERROR_KIND).as_deref(), Some("retries_exhausted"));
        let (ex, rk) = origin(&p, "dlx", "dlq");
        assert_eq!((ex.as_ref(), rk.as_ref()), ("shop", "orders"));
    }

    #[test]
    fn a_count_the_parser_may_have_kept_as_bytes_is_read_there_or_unreadable() {
        let with_rest = |raw: Vec<u8>, parsed: Option<i32>| {
            let mut h = FieldTable::default();
            h.insert(UNPARSED_KEY.into(), parsing::unparsed_entries(raw));
            if let Some(n) = parsed {
                h.insert(X_RETRIES.into(), AMQPValue::LongInt(n));
            }
            BasicProperties::default().with_headers(h)
        };
        // A rest that is not well-formed: whether the count is in there cannot be told.
        let cut = with_rest(vec![1, b'x'], None);
        assert_eq!(retries(&cut), Retries::Unreadable);
        assert_eq!(dlq_attempts(&cut).count(), u32::MAX);
        assert_eq!(
            retries(&with_rest(vec![1, b'x'], Some(2))),
            Retries::Unreadable
        );
        // A well-formed one: read there (the later entry), else the parsed one, else none.
        let count = [&[9u8][..], b"x-retries", b"I", &3i32.to_be_bytes()].concat();
        let other = [&[1u8][..], b"a", b"V"].concat();
        assert_eq!(
            retries(&with_rest(count.clone(), Some(2))),
            Retries::Count(3)
        );
        assert_eq!(retries(&with_rest(count, None)), Retries::Count(3));
        assert_eq!(
            retries(&with_rest(other.clone(), Some(2))),
            Retries::Count(2)
        );
        assert_eq!(retries(&with_rest(other, None)), Retries::Count(0));
        // A publisher's own header of that name is no rest: the count is what is parsed.
        let mut spoof = FieldTable::default();
        spoof.insert(
            UNPARSED_KEY.into(),
            AMQPValue::ByteArray(vec![1, b'x'].into()),
        );
        assert_eq!(
            retries(&BasicProperties::default().with_headers(spoof)),
            Retries::Count(0)
        );
    }

    #[test]
    fn parsed_bytes_count_strings_and_every_entry_and_element_of_the_headers() {
        assert_eq!(parsed_bytes(&BasicProperties::default()), 0);
        let id = BasicProperties::default().with_message_id("a".repeat(36).into());
        assert_eq!(parsed_bytes(&id), 36);
        // One byte a void on the wire, a whole value parsed: the estimate follows memory.
        let voids = props(AMQPValue::FieldArray(vec![AMQPValue::Void; 1000].into()));
        let top = TABLE_NODE_BYTES + TABLE_ENTRY_BYTES + X_RETRIES.len();
        let expected = top + 1000 * 2 * size_of::<AMQPValue>();
        assert_eq!(parsed_bytes(&voids), expected);
        assert!(
            expected > 60 * 1000,
            "an array of voids takes ~60x its wire size"
        );
        let mut inner = FieldTable::default();
        inner.insert("k".into(), AMQPValue::LongString(b"abcd".to_vec().into()));
        let nested = props(AMQPValue::FieldTable(inner));
        assert_eq!(
            parsed_bytes(&nested),
            top + TABLE_NODE_BYTES + TABLE_ENTRY_BYTES + 1 + 4
        );
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

    /// Issue 34, item 2: a short string from outside input is an error past 255 bytes, never a
    /// panic; at 255 it is made.
    #[test]
    fn short_strings_from_outside_input_are_checked_not_panicked() {
        assert_eq!(short("k".repeat(255)).map(|s| s.as_str().len()), Ok(255));
        let e = short("k".repeat(300)).unwrap_err();
        assert_eq!(e, TooLong { len: 300 });
        assert_eq!(e.to_string(), "at most 255 bytes, found 300");
        // Bytes, not characters: 128 two-byte characters are 256 bytes.
        assert_eq!(short("é".repeat(128)), Err(TooLong { len: 256 }));
    }

    /// Issue 34, item 3: an unusable `x-retries` is described capped, as everything of a
    /// message that reaches a log line (`crate::text::shown`).
    #[test]
    fn an_unusable_retry_count_is_described_capped() {
        use crate::text::SHOWN_MAX;
        let retries = props(AMQPValue::LongString(
            "x".repeat(50_000).into_bytes().into(),
        ));
        let Retries::Invalid(what) = super::retries(&retries) else {
            panic!("a string count is invalid");
        };
        assert!(what.len() <= SHOWN_MAX + 40, "{}", what.len());
    }

    /// Issue 34, item 8: a later version's traceparent is carried up to 512 bytes; a longer one
    /// (valid by the grammar) is not carried.
    #[test]
    fn a_traceparent_is_carried_up_to_512_bytes() {
        let head = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-";
        let at = format!("{head}{}", "a".repeat(TRACEPARENT_MAX - head.len()));
        assert!(valid_traceparent(&at));
        let over = format!("{at}a");
        assert!(!valid_traceparent(&over));
        let mut h = FieldTable::default();
        h.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString(over.into_bytes().into()),
        );
        assert_eq!(
            traceparent(&BasicProperties::default().with_headers(h)),
            None
        );
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

    /// Found by the second review: a parked header of a type JSON has no form for came back from
    /// `dlq parked replay` as its Rust rendering, a string, which a header column then stored.
    /// Every such type now survives parking and replay as it came.
    #[test]
    fn every_header_type_a_replay_must_give_back_survives_the_parking_json() {
        use lapin::types::{ByteArray, DecimalValue, FieldArray};
        let mut inner = FieldTable::default();
        inner.insert("queue".into(), AMQPValue::LongString("q".into()));
        inner.insert("count".into(), AMQPValue::LongLongInt(2));
        let values = [
            AMQPValue::LongString("plain".into()),
            AMQPValue::LongString(b"a\xe9b".to_vec().into()),
            AMQPValue::LongString(b"a\0b".to_vec().into()),
            AMQPValue::ByteArray(ByteArray::from(b"bytes\xff".to_vec())),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 1,
                value: 15,
            }),
            AMQPValue::Timestamp(1_767_225_600),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::FieldTable(inner.clone()),
                AMQPValue::Void,
            ])),
            AMQPValue::FieldTable(inner),
            AMQPValue::Void,
            AMQPValue::Boolean(true),
            AMQPValue::LongLongInt(-7),
            // The parser's raw rest (a parked message's headers past its budget): given back
            // as the rest, which a replay writes back as its entries.
            parsing::unparsed_entries([&[1u8][..], b"a", b"V"].concat()),
        ];
        for v in values {
            let mut h = FieldTable::default();
            h.insert("x-h".into(), v.clone());
            let json = to_json(&BasicProperties::default().with_headers(h));
            let back = json_value(&json["x-h"]).unwrap_or_else(|e| panic!("{v:?}: {e}"));
            assert_eq!(back, v, "{json}");
        }
        let nope = json_value(&serde_json::json!({"$amqp": "nope"})).unwrap_err();
        assert_eq!(nope, MalformedHeader::UnknownTag(Some("nope".into())));
        assert_eq!(nope.to_string(), r#"unknown "$amqp" tag Some("nope")"#);
        assert_eq!(
            json_value(&serde_json::json!({"$amqp": "byte_array", "hex": "zz"})),
            Err(MalformedHeader::BadHex)
        );
        assert_eq!(
            json_value(&serde_json::json!({"$amqp": "byte_array", "hex": "abc"})),
            Err(MalformedHeader::OddHex)
        );
        let mut inner = serde_json::Map::new();
        inner.insert("k".repeat(256), 1.into());
        let long_key = serde_json::json!({"$amqp": "field_table", "value": inner});
        let key = json_value(&long_key).unwrap_err();
        assert_eq!(key, MalformedHeader::TableKey(TooLong { len: 256 }));
        assert_eq!(key.to_string(), "a table key: at most 255 bytes, found 256");
    }
}
