//! The one republish policy: what warren's own copy of a message carries when warren publishes
//! it again (a retry, a dead letter, a DLQ attempt, `warren move`, `warren dlq replay`,
//! `warren dlq parked replay`), so the broker always accepts the copy and never acts on the
//! original publisher's intent a second time. Each property is:
//! - **kept**: content type and encoding, message id, correlation id, reply-to, timestamp, type,
//!   app id, cluster id, priority, and every header not named below;
//! - **moved** to an `x-original-*` header: `expiration` (a per-message TTL would expire warren's
//!   copy wherever it waits, the DLQ included, which dead-letters nowhere: the message was lost),
//!   `user_id` (the broker refuses a publish whose user id is not the publishing connection's user
//!   and closes the channel), the `CC` and `BCC` headers (sender-selected distribution would route
//!   the copy to more queues: a retry into every tier queue at once), and, on a copy that starts
//!   the message's life again (a replay, a move), `x-death`: the broker's dead-letter history.
//!   RabbitMQ 3.x drops a message it dead-letters into a queue its `x-death` already names with
//!   no reject in between, so a message the broker once dead-lettered out of the main queue
//!   (expired, over its delivery limit) vanished at its first retry after a replay. Retries and
//!   dead letters keep `x-death` (within one life it records the retry tiers), except, on a
//!   retry, its entries for the queue the retry tier dead-letters back into
//!   ([`Stamp::dead_letters_into`]): a publisher can write any `x-death`, and one naming the main
//!   queue made its message vanish at its first retry;
//! - **dropped**: `x-delivery-count` (the broker's count of the original's deliveries, meaningless
//!   on a new message);
//! - **set**: delivery mode 2, persistent, whatever the original said (once warren acked the
//!   original, the copy must survive a broker restart; the original mode, if another, goes to
//!   `x-original-delivery-mode`), and warren's own headers for the route.
//!
//! [`fit`] then measures the content header against the publishing link's frame limit (a
//! content header travels in one frame; the broker closes the connection over a larger one):
//! warren's reasons are cut to make room, and a message that still does not fit is
//! [`Unpublishable`] (the pipeline parks it; the CLI tools leave it where it is and say so).

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::amqp::headers::{
    REASON_MAX, X_DLQ_ATTEMPTS, X_ERROR_KIND, X_ERROR_REASON, X_RETRIES, X_RETRY_REASON,
};
use crate::text::capped;

/// Where a moved property goes: `x-original-` and its name.
pub const ORIGINAL_PREFIX: &str = "x-original-";
pub const X_ORIGINAL_EXPIRATION: &str = "x-original-expiration";
pub const X_ORIGINAL_USER_ID: &str = "x-original-user-id";
pub const X_ORIGINAL_DELIVERY_MODE: &str = "x-original-delivery-mode";
/// Headers the broker acts on, moved to `x-original-<name in lower case>` on every copy.
const MOVED_HEADERS: [&str; 2] = ["CC", "BCC"];
/// The broker's dead-letter history, moved on a copy that starts a new life
/// ([`Stamp::restart`]).
pub const X_DEATH: &str = "x-death";
pub const X_ORIGINAL_DEATH: &str = "x-original-x-death";
/// Headers dropped from every copy.
const DROPPED_HEADERS: [&str; 1] = ["x-delivery-count"];

/// The raw rest of the original's headers (past the parser's budget, `headers::unparsed`),
/// which the copy writes back as the entries it holds, after the others: the policy applied
/// to them by key as to the parsed ones, and no key the copy already has kept beside it
/// (RabbitMQ reads the first of two entries of one key, lapin the later). An `x-death` among
/// them is moved aside whole on a copy that starts a new life or goes through a retry tier
/// (its entries are not read there). A rest that is not well-formed is carried as one byte
/// array, as before (nobody reads into it).
fn unparsed_by_policy(headers: &mut BTreeMap<ShortString, AMQPValue>, stamp: &Stamp<'_>) {
    use crate::amqp::headers::{RawEntry, UNPARSED_KEY, rewrite_unparsed};
    let Some(raw) = headers
        .get(UNPARSED_KEY)
        .and_then(lapin::types::parsing::as_unparsed_entries)
    else {
        return;
    };
    let death_aside = stamp.restart || stamp.dead_letters_into.is_some();
    let rewritten = rewrite_unparsed(raw, |key| {
        if MOVED_HEADERS.contains(&key) || (death_aside && key == X_DEATH) {
            let to = match key {
                X_DEATH => X_ORIGINAL_DEATH.to_string(),
                _ => format!("{ORIGINAL_PREFIX}{}", key.to_ascii_lowercase()),
            };
            return RawEntry::Rename(to);
        }
        let dropped = DROPPED_HEADERS.contains(&key)
            || stamp.remove.contains(&key)
            || stamp.remove_prefixes.iter().any(|p| key.starts_with(p))
            || (key != UNPARSED_KEY && headers.contains_key(key));
        if dropped {
            RawEntry::Drop
        } else {
            RawEntry::Keep
        }
    });
    let value = match rewritten {
        Ok(raw) if raw.is_empty() => {
            headers.remove(UNPARSED_KEY);
            return;
        }
        Ok(raw) => lapin::types::parsing::unparsed_entries(raw),
        Err(_) => AMQPValue::ByteArray(raw.to_vec().into()),
    };
    headers.insert(UNPARSED_KEY.into(), value);
}

/// Frame bytes around a content header's properties: frame type, channel and size (7), class,
/// weight and body size (12), property flags (2), frame end (1).
pub const HEADER_FRAME_OVERHEAD: usize = 22;

/// Why a message cannot be republished as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unpublishable {
    /// Its properties need a larger content header frame than the link allows.
    #[error(
        "its properties need a content header frame of {size} bytes, over the link's frame_max of {frame_max} bytes"
    )]
    TooLarge { size: usize, frame_max: u32 },
    /// The broker closed the channel over this publish alone (the reason is the broker's).
    #[error("the broker refused to take it: {0}")]
    Refused(String),
}

/// What warren writes on a copy besides the original's properties.
#[derive(Debug, Clone, Default)]
pub struct Stamp<'a> {
    /// Headers set (replacing any of the same name).
    pub set: Vec<(&'a str, AMQPValue)>,
    /// Headers removed, besides those the policy moves or drops.
    pub remove: &'a [&'a str],
    /// Header prefixes removed (`x-error-` on a replay).
    pub remove_prefixes: &'a [&'a str],
    /// The copy starts the message's life again (a replay, a move): `x-death` is moved aside.
    pub restart: bool,
    /// The queue the broker will dead-letter the copy into (a retry tier's main queue): the
    /// `x-death` entries naming it are moved aside, so the broker never takes the hop for a
    /// dead-letter cycle.
    pub dead_letters_into: Option<&'a str>,
}

/// The properties of warren's copy of a message with `original` properties, stamped with
/// `stamp` (see the module documentation for what is kept, moved, dropped and set).
pub fn copy_properties(original: &BasicProperties, stamp: &Stamp<'_>) -> BasicProperties {
    let mut kept: BTreeMap<ShortString, AMQPValue> = original
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    let mut moved: Vec<(String, AMQPValue)> = Vec::new();
    kept.retain(|k, v| {
        let key = k.as_str();
        if MOVED_HEADERS.contains(&key) || (stamp.restart && key == X_DEATH) {
            moved.push((
                format!("{ORIGINAL_PREFIX}{}", key.to_ascii_lowercase()),
                v.clone(),
            ));
            return false;
        }
        !(DROPPED_HEADERS.contains(&key)
            || stamp.remove.contains(&key)
            || stamp.remove_prefixes.iter().any(|p| key.starts_with(p)))
    });
    if let Some(target) = stamp.dead_letters_into
        && let Some(death) = kept.get(X_DEATH)
    {
        // The broker updates this header when it dead-letters the copy, and RabbitMQ 3.10
        // crashes the queue process on an entry it cannot read (not a table, a queue or reason
        // that is no string, a count that is no integer): the message is lost and the queue
        // stays down. Such entries, and those naming the target (a dead-letter cycle), are
        // moved aside; a header that is no array goes whole.
        let entries: Vec<AMQPValue> = match death {
            AMQPValue::FieldArray(deaths) => deaths.as_slice().to_vec(),
            other => vec![other.clone()],
        };
        let whole = !matches!(death, AMQPValue::FieldArray(_));
        let text = |v: &AMQPValue| {
            matches!(v, AMQPValue::LongString(_) | AMQPValue::ShortString(_))
                .then(|| crate::amqp::headers::value_text(v))
        };
        let stays = |d: &AMQPValue| match d {
            AMQPValue::FieldTable(t) => {
                let t = t.inner();
                let queue = t.get("queue").and_then(text);
                let reason = t.get("reason").and_then(text);
                let count_ok = t.get("count").is_none_or(|c| {
                    matches!(
                        c,
                        AMQPValue::ShortShortInt(_)
                            | AMQPValue::ShortShortUInt(_)
                            | AMQPValue::ShortInt(_)
                            | AMQPValue::ShortUInt(_)
                            | AMQPValue::LongInt(_)
                            | AMQPValue::LongUInt(_)
                            | AMQPValue::LongLongInt(_)
                    )
                });
                matches!((&queue, &reason), (Some(q), Some(_)) if q != target) && count_ok
            }
            _ => false,
        };
        let (stay, away): (Vec<AMQPValue>, Vec<AMQPValue>) =
            entries.into_iter().partition(|d| !whole && stays(d));
        if !away.is_empty() {
            if stay.is_empty() {
                kept.remove(X_DEATH);
            } else {
                kept.insert(X_DEATH.into(), AMQPValue::FieldArray(stay.into()));
            }
            moved.push((
                X_ORIGINAL_DEATH.to_string(),
                AMQPValue::FieldArray(away.into()),
            ));
        }
    }
    let mut headers = kept;
    for (k, v) in moved {
        headers.insert(short(&k), v);
    }
    if let Some(expiration) = original.expiration() {
        headers.insert(
            X_ORIGINAL_EXPIRATION.into(),
            long(expiration.as_str().as_bytes()),
        );
    }
    if let Some(user) = original.user_id() {
        headers.insert(X_ORIGINAL_USER_ID.into(), long(user.as_str().as_bytes()));
    }
    if let Some(mode) = original.delivery_mode()
        && *mode != 2
    {
        headers.insert(
            X_ORIGINAL_DELIVERY_MODE.into(),
            AMQPValue::ShortShortUInt(*mode),
        );
    }
    for (k, v) in &stamp.set {
        headers.insert(short(k), v.clone());
    }
    unparsed_by_policy(&mut headers, stamp);
    let headers = FieldTable::from(headers);
    // Every property decided one by one (lapin offers no way to unset one): the kept ones
    // copied, `expiration` and `user_id` left out, the delivery mode and headers set.
    let mut copy = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(v) = original.content_type() {
        copy = copy.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        copy = copy.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        copy = copy.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        copy = copy.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        copy = copy.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        copy = copy.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        copy = copy.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        copy = copy.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        copy = copy.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        copy = copy.with_cluster_id(v.clone());
    }
    copy
}

/// `copy` (warren's copy of `original`, delivered with `exchange` and `routing_key`) with the
/// original's exchange and routing key in `x-warren-exchange` and `x-warren-routing-key`
/// ([`headers::origin`]: those the original names already, or its own), so a property column
/// of a retried or replayed copy reads where the message was published, not warren's hop.
pub fn stamp_origin(
    copy: BasicProperties,
    original: &BasicProperties,
    exchange: &str,
    routing_key: &str,
) -> BasicProperties {
    let (ex, rk) = crate::amqp::headers::origin(original, exchange, routing_key);
    let mut headers = copy.headers().clone().unwrap_or_default();
    headers.insert(
        crate::amqp::headers::X_WARREN_EXCHANGE.into(),
        long(ex.as_bytes()),
    );
    headers.insert(
        crate::amqp::headers::X_WARREN_ROUTING_KEY.into(),
        long(rk.as_bytes()),
    );
    copy.with_headers(headers)
}

/// The size of the content header frame that carries `properties`.
pub fn header_frame_size(properties: &BasicProperties) -> usize {
    use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
    let frame = AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 0,
            properties: properties.clone(),
        },
    );
    match gen_frame(&frame)(WriteContext::from(Vec::new())) {
        Ok(ctx) => ctx.position as usize,
        // Encoding into a growing buffer cannot fail for want of room; should it fail
        // otherwise, the publish would fail the same way: count it as fitting nothing.
        Err(_) => usize::MAX,
    }
}

/// Room left in a copy's content header for what the broker adds when it dead-letters the copy
/// (an `x-death` entry with its queue, reason, count, time, exchange and routing keys, and the
/// `x-first-death-*` headers): at most this, and at most a quarter of the frame. A copy that
/// filled the frame to the byte grew past `frame_max` at the retry tier's hop back, and no
/// consumer could ever receive it again (found by the adversarial review).
pub const BROKER_HEADROOM: usize = 4096;

/// The largest content header warren writes on a link of `frame_max` bytes: the frame less
/// [`BROKER_HEADROOM`].
pub fn header_limit(frame_max: u32) -> usize {
    let frame = frame_max as usize;
    frame - BROKER_HEADROOM.min(frame / 4)
}

/// `properties` if their content header fits in a frame of `frame_max` bytes (0: no limit) with
/// the broker's headroom left ([`header_limit`]), after cutting the text of the `shrinkable`
/// headers (warren's reasons) as far as needed; [`Unpublishable::TooLarge`] if even that is not
/// enough.
pub fn fit(
    mut properties: BasicProperties,
    shrinkable: &[&str],
    frame_max: u32,
) -> Result<BasicProperties, Unpublishable> {
    if frame_max == 0 {
        return Ok(properties);
    }
    let limit = header_limit(frame_max);
    let size = header_frame_size(&properties);
    if size <= limit {
        return Ok(properties);
    }
    let mut excess = size - limit;
    if let Some(headers) = properties.headers().clone() {
        let mut headers = headers;
        for key in shrinkable {
            if excess == 0 {
                break;
            }
            let Some(AMQPValue::LongString(text)) = headers.inner().get(*key) else {
                continue;
            };
            // Measured in the header's own bytes: a publisher's reason of invalid UTF-8 reads
            // with a 3-byte U+FFFD for each bad byte, and cut from that reading it could come out
            // longer than it went in (found by the fuzz seeds' outcome check).
            let sent = text.as_bytes().len();
            let keep = sent.saturating_sub(excess + '…'.len_utf8());
            let read = String::from_utf8_lossy(text.as_bytes()).into_owned();
            let cut = capped(&read, keep).into_owned();
            if cut.len() >= sent {
                continue;
            }
            excess = excess.saturating_sub(sent - cut.len());
            headers.insert(short(key), long(cut.as_bytes()));
        }
        properties = properties.with_headers(headers);
    }
    let size = header_frame_size(&properties);
    if size <= limit {
        Ok(properties)
    } else {
        Err(Unpublishable::TooLarge { size, frame_max })
    }
}

/// A header name as a short string ([`crate::amqp::headers::short`]): names warren writes are
/// its own constants, under 255 bytes; anything longer is cut on a character boundary rather
/// than panicking.
fn short(name: &str) -> ShortString {
    use crate::amqp::headers::{SHORT_MAX, short};
    short(name).unwrap_or_else(|_| short(capped(name, SHORT_MAX).into_owned()).unwrap_or_default())
}

fn long(bytes: &[u8]) -> AMQPValue {
    AMQPValue::LongString(LongString::from(bytes.to_vec()))
}

/// The original's properties with the given headers set (others kept), as the republish policy
/// makes every copy (`amqp::republish`).
pub fn with_headers(properties: &BasicProperties, set: &[(&str, AMQPValue)]) -> BasicProperties {
    copy_properties(
        properties,
        &Stamp {
            set: set.to_vec(),
            ..Default::default()
        },
    )
}

/// Properties for a retry: `x-retries` = `retries`, `x-retry-reason` = `reason`; the retry tier
/// dead-letters the copy back into `main_queue` (see `Stamp::dead_letters_into`).
pub fn for_retry(
    properties: &BasicProperties,
    retries: u32,
    reason: &str,
    main_queue: &str,
) -> BasicProperties {
    copy_properties(
        properties,
        &Stamp {
            set: vec![
                (X_RETRIES, AMQPValue::LongLongInt(retries as i64)),
                (X_RETRY_REASON, long(capped(reason, REASON_MAX).as_bytes())),
            ],
            dead_letters_into: Some(main_queue),
            ..Default::default()
        },
    )
}

/// Properties for a dead-lettered message: `x-retries` = `retries` (left as it is when `None`:
/// a count that could not be read is not replaced by a made-up one), the kind and the reason.
pub fn for_dead_letter(
    properties: &BasicProperties,
    retries: Option<u32>,
    kind: &str,
    reason: &str,
) -> BasicProperties {
    let retries = retries.map(|n| (X_RETRIES, AMQPValue::LongLongInt(n as i64)));
    let set: Vec<(&str, AMQPValue)> = retries
        .into_iter()
        .chain([
            (X_ERROR_KIND, long(kind.as_bytes())),
            (X_ERROR_REASON, long(capped(reason, REASON_MAX).as_bytes())),
        ])
        .collect();
    with_headers(properties, &set)
}

/// Properties for a DLQ message the DLQ consumer tries again later: `x-dlq-attempts` =
/// `attempts`, the reason of the last failure in `x-error-reason`; the rest kept.
pub fn for_dlq_attempt(
    properties: &BasicProperties,
    attempts: u32,
    reason: &str,
) -> BasicProperties {
    with_headers(
        properties,
        &[
            (X_DLQ_ATTEMPTS, AMQPValue::LongLongInt(attempts as i64)),
            (X_ERROR_REASON, long(capped(reason, REASON_MAX).as_bytes())),
        ],
    )
}

/// Properties for a message replayed from the DLQ: `x-retries` = 0, every `x-error-*` header
/// and `x-dlq-attempts` removed, `x-death` moved aside (a new life); the rest as the republish
/// policy keeps it.
pub fn for_replay(properties: &BasicProperties) -> BasicProperties {
    copy_properties(
        properties,
        &Stamp {
            set: vec![(X_RETRIES, AMQPValue::LongLongInt(0))],
            remove: &[X_DLQ_ATTEMPTS],
            remove_prefixes: &["x-error-"],
            restart: true,
            dead_letters_into: None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(p: &BasicProperties, key: &str) -> Option<String> {
        crate::amqp::headers::text(p, key)
    }

    #[test]
    fn what_the_broker_acts_on_is_moved_and_the_rest_kept() {
        let mut h = FieldTable::default();
        h.insert("CC".into(), long(b"other_queue"));
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        h.insert("trace".into(), long(b"abc"));
        let original = BasicProperties::default()
            .with_expiration("4000".into())
            .with_user_id("someone_else".into())
            .with_delivery_mode(1)
            .with_priority(7)
            .with_message_id("m1".into())
            .with_reply_to("r".into())
            .with_correlation_id("c".into())
            .with_app_id("a".into())
            .with_type("t".into())
            .with_timestamp(42)
            .with_content_type("application/json".into())
            .with_headers(h);
        let copy = copy_properties(
            &original,
            &Stamp {
                set: vec![("x-retries", AMQPValue::LongLongInt(1))],
                ..Default::default()
            },
        );
        assert_eq!(copy.expiration(), &None);
        assert_eq!(copy.user_id(), &None);
        assert_eq!(copy.delivery_mode(), &Some(2));
        assert_eq!(text(&copy, X_ORIGINAL_EXPIRATION).as_deref(), Some("4000"));
        assert_eq!(
            text(&copy, X_ORIGINAL_USER_ID).as_deref(),
            Some("someone_else")
        );
        assert_eq!(text(&copy, X_ORIGINAL_DELIVERY_MODE).as_deref(), Some("1"));
        assert_eq!(text(&copy, "CC"), None);
        assert_eq!(text(&copy, "x-original-cc").as_deref(), Some("other_queue"));
        // Within one life, the broker's history stays; a new life moves it aside.
        assert!(text(&copy, "x-death").is_some());
        let restarted = copy_properties(
            &original,
            &Stamp {
                restart: true,
                ..Default::default()
            },
        );
        assert_eq!(text(&restarted, "x-death"), None);
        assert!(text(&restarted, X_ORIGINAL_DEATH).is_some());
        assert_eq!(text(&copy, "x-delivery-count"), None);
        assert_eq!(text(&copy, "trace").as_deref(), Some("abc"));
        assert_eq!(text(&copy, "x-retries").as_deref(), Some("1"));
        // Kept as they were.
        assert_eq!(copy.priority(), &Some(7));
        assert_eq!(copy.message_id(), original.message_id());
        assert_eq!(copy.reply_to(), original.reply_to());
        assert_eq!(copy.correlation_id(), original.correlation_id());
        assert_eq!(copy.app_id(), original.app_id());
        assert_eq!(copy.kind(), original.kind());
        assert_eq!(copy.timestamp(), original.timestamp());
        assert_eq!(copy.content_type(), original.content_type());
    }

    #[test]
    fn a_retry_sets_aside_the_deaths_in_the_queue_it_dead_letters_into() {
        let death = |queue: &str| {
            let mut t = FieldTable::default();
            t.insert("queue".into(), long(queue.as_bytes()));
            t.insert("reason".into(), long(b"expired"));
            AMQPValue::FieldTable(t)
        };
        let mut h = FieldTable::default();
        h.insert(
            X_DEATH.into(),
            AMQPValue::FieldArray(vec![death("retry_1s"), death("main"), death("retry_2s")].into()),
        );
        let original = BasicProperties::default().with_headers(h);
        let copy = copy_properties(
            &original,
            &Stamp {
                dead_letters_into: Some("main"),
                ..Default::default()
            },
        );
        let queues = |key: &str| -> Vec<String> {
            match copy.headers().as_ref().and_then(|h| h.inner().get(key)) {
                Some(AMQPValue::FieldArray(a)) => a
                    .as_slice()
                    .iter()
                    .filter_map(|d| match d {
                        AMQPValue::FieldTable(t) => {
                            t.inner().get("queue").map(crate::amqp::headers::value_text)
                        }
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            }
        };
        assert_eq!(queues(X_DEATH), ["retry_1s", "retry_2s"]);
        assert_eq!(queues(X_ORIGINAL_DEATH), ["main"]);
    }

    #[test]
    fn a_copy_of_a_copy_changes_nothing_more() {
        let original = BasicProperties::default()
            .with_expiration("4000".into())
            .with_delivery_mode(2);
        let once = copy_properties(&original, &Stamp::default());
        let twice = copy_properties(&once, &Stamp::default());
        assert_eq!(once, twice);
        assert_eq!(text(&twice, X_ORIGINAL_DELIVERY_MODE), None);
    }

    #[test]
    fn the_frame_size_is_the_encoded_header() {
        // An empty header: 22 bytes, as in amq-protocol's own test of the frame.
        assert_eq!(header_frame_size(&BasicProperties::default()), 22);
        let p = BasicProperties::default().with_message_id("abc".into());
        assert_eq!(header_frame_size(&p), 22 + 1 + 3);
    }

    #[test]
    fn reasons_are_cut_to_fit_and_what_cannot_fit_is_unpublishable() {
        let mut h = FieldTable::default();
        h.insert("big".into(), long(&vec![b'x'; 10_000]));
        h.insert("x-error-reason".into(), long(&vec![b'r'; 1000]));
        let p = BasicProperties::default().with_headers(h);
        let size = header_frame_size(&p);
        // A frame with room for the big header and 100 bytes of the reason, besides the
        // broker's headroom.
        let limit = ((size - 900) * 4 / 3 + 4) as u32;
        let fitted = fit(p.clone(), &["x-error-reason"], limit).unwrap();
        assert!(header_frame_size(&fitted) <= header_limit(limit));
        assert!(
            header_frame_size(&fitted) < limit as usize - 3000,
            "headroom left"
        );
        let reason = text(&fitted, "x-error-reason").unwrap();
        assert!(reason.ends_with('…') && reason.len() < 1000, "{reason}");
        // Less room than the big header alone needs: unpublishable.
        let err = fit(p.clone(), &["x-error-reason"], 8_000).unwrap_err();
        assert!(matches!(
            err,
            Unpublishable::TooLarge {
                frame_max: 8_000,
                ..
            }
        ));
        // No limit, or room enough: unchanged.
        assert_eq!(fit(p.clone(), &["x-error-reason"], 0).unwrap(), p);
        assert_eq!(fit(p.clone(), &[], 131_072).unwrap(), p);
        // A header that fits the frame but not the broker's headroom: unpublishable, so the
        // broker's own dead-letter hop can never push it past frame_max.
        let err = fit(p.clone(), &[], (size + 100) as u32).unwrap_err();
        assert!(matches!(err, Unpublishable::TooLarge { .. }), "{err}");
        assert_eq!(header_limit(131_072), 131_072 - 4096);
        assert_eq!(header_limit(4096), 3072);
    }
}

#[cfg(test)]
mod origin_tests {
    use super::*;
    use crate::amqp::headers::{X_WARREN_EXCHANGE, X_WARREN_ROUTING_KEY, origin, text};

    #[test]
    fn every_copy_names_where_the_original_was_published() {
        let original = BasicProperties::default().with_message_id("m".into());
        // The first copy: the delivery's exchange and routing key.
        let retry = stamp_origin(
            for_retry(&original, 1, "db", "main"),
            &original,
            "shop",
            "orders.eu",
        );
        assert_eq!(text(&retry, X_WARREN_EXCHANGE).as_deref(), Some("shop"));
        assert_eq!(
            text(&retry, X_WARREN_ROUTING_KEY).as_deref(),
            Some("orders.eu")
        );
        // Back from the retry tier (delivered through warren's exchange), then dead-lettered,
        // then replayed: still the original's.
        let dead = stamp_origin(
            for_dead_letter(&retry, Some(1), "db_permanent", "x"),
            &retry,
            "main_exchange",
            "main_queue",
        );
        let replay = stamp_origin(for_replay(&dead), &dead, "dlx", "dlq");
        assert_eq!(
            origin(&replay, "main_exchange", "main_queue"),
            ("shop".into(), "orders.eu".into())
        );
    }

    #[test]
    fn a_message_the_broker_dead_lettered_names_its_first_hop() {
        let mut death = FieldTable::default();
        death.insert("queue".into(), long(b"main"));
        death.insert("reason".into(), long(b"expired"));
        death.insert("exchange".into(), long(b"shop"));
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(vec![long(b"orders.eu")].into()),
        );
        let mut h = FieldTable::default();
        h.insert("x-first-death-exchange".into(), long(b"shop"));
        h.insert("x-first-death-queue".into(), long(b"main"));
        h.insert("x-first-death-reason".into(), long(b"expired"));
        h.insert(
            X_DEATH.into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        let p = BasicProperties::default().with_headers(h);
        assert_eq!(
            origin(&p, "dlx", "dlq"),
            ("shop".into(), "orders.eu".into())
        );
        // Nothing said: the delivery's own.
        assert_eq!(
            origin(&BasicProperties::default(), "shop", "k"),
            ("shop".into(), "k".into())
        );
    }
}

#[cfg(test)]
mod stamp_tests {
    use super::*;
    use crate::amqp::headers::*;
    use lapin::types::FieldTable;

    #[test]
    fn reasons_are_capped_on_a_character_boundary() {
        let long_reason = "é".repeat(2000);
        let p = for_dead_letter(&BasicProperties::default(), Some(0), "k", &long_reason);
        let written = text(&p, X_ERROR_REASON).unwrap();
        assert!(written.len() <= REASON_MAX, "{}", written.len());
        assert!(written.ends_with('…'));
        assert_eq!(capped("short", REASON_MAX), "short");
        let p = for_dlq_attempt(&p, 2, &long_reason);
        assert_eq!(dlq_attempts(&p), Retries::Count(2));
        assert!(text(&p, X_ERROR_REASON).unwrap().len() <= REASON_MAX);
        assert_eq!(text(&for_replay(&p), X_DLQ_ATTEMPTS), None);
    }

    #[test]
    fn retry_headers_replace_the_count_and_keep_the_rest() {
        let mut h = FieldTable::default();
        h.insert("trace".into(), long(b"abc"));
        h.insert(X_RETRIES.into(), long(b"junk"));
        let p = BasicProperties::default()
            .with_message_id("m1".into())
            .with_headers(h);
        let next = for_retry(&p, 1, "db_error: x", "main");
        assert_eq!(retries(&next), Retries::Count(1));
        assert_eq!(text(&next, X_RETRY_REASON).unwrap(), "db_error: x");
        assert_eq!(text(&next, "trace").unwrap(), "abc");
        assert_eq!(next.message_id().as_ref().unwrap().as_str(), "m1");
        let dead = for_dead_letter(&next, Some(3), "retries_exhausted", "r");
        assert_eq!(text(&dead, X_ERROR_KIND).unwrap(), "retries_exhausted");
        assert_eq!(to_json(&dead)["x-retries"], serde_json::json!(3));
        // A count that could not be read is not replaced: the copy keeps what was there.
        let dead = for_dead_letter(&p, None, "retries_exhausted", "r");
        assert_eq!(text(&dead, X_ERROR_KIND).unwrap(), "retries_exhausted");
        assert!(matches!(retries(&dead), Retries::Invalid(_)), "{dead:?}");
        assert_eq!(text(&dead, "trace").unwrap(), "abc");
    }

    #[test]
    fn replay_resets_the_count_drops_the_error_headers_and_keeps_the_rest() {
        let dead = for_dead_letter(
            &BasicProperties::default()
                .with_message_id("m2".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_timestamp(42),
            Some(3),
            "retries_exhausted",
            "db_error: x",
        );
        let dead = with_headers(&dead, &[("trace", long(b"abc"))]);
        let replay = for_replay(&dead);
        assert_eq!(retries(&replay), Retries::Count(0));
        assert_eq!(text(&replay, X_ERROR_KIND), None);
        assert_eq!(text(&replay, X_ERROR_REASON), None);
        assert_eq!(text(&replay, "trace").unwrap(), "abc");
        assert_eq!(replay.message_id().as_ref().unwrap().as_str(), "m2");
        assert_eq!(
            replay.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(*replay.delivery_mode(), Some(2));
        assert_eq!(*replay.timestamp(), Some(42));
        // No headers at all: only x-retries = 0 is added.
        let bare = for_replay(&BasicProperties::default());
        assert_eq!(to_json(&bare), serde_json::json!({"x-retries": 0}));
    }
}

/// Reviews R36e F1 and R36f F3: headers past the parser's budget, on a copy.
#[cfg(test)]
mod unparsed_tests {
    use super::*;
    use crate::amqp::headers::{X_RETRIES, header, retries, unparsed};
    use amq_protocol::frame::WriteContext;

    /// One table entry on the wire: key, type octet and value bytes.
    fn entry(key: &str, ty: u8, value: &[u8]) -> Vec<u8> {
        [&[key.len() as u8][..], key.as_bytes(), &[ty], value].concat()
    }

    fn long_string(text: &[u8]) -> Vec<u8> {
        [&(text.len() as u32).to_be_bytes()[..], text].concat()
    }

    fn parse(content: &[u8]) -> FieldTable {
        let wire = [&(content.len() as u32).to_be_bytes()[..], content].concat();
        lapin::types::parsing::parse_field_table(&wire[..])
            .expect("parse")
            .1
    }

    fn generate(table: &FieldTable) -> Vec<u8> {
        let wire = lapin::types::generation::gen_field_table(table)(WriteContext::from(Vec::new()))
            .expect("encode")
            .write;
        wire[4..].to_vec()
    }

    /// A message whose headers pass the parser's budget (2,000 small entries first), with, in
    /// the raw rest: a header a column reads, what the broker acts on (`CC`, `x-death`), the
    /// broker's count, and a retry count of the publisher's.
    fn past_the_budget() -> BasicProperties {
        let mut content: Vec<u8> = (0..2000)
            .flat_map(|i| entry(&format!("a{i:04}"), b'V', &[]))
            .collect();
        content.extend(entry("CC", b'A', &long_string(b"")));
        content.extend(entry("x-delivery-count", b'l', &5i64.to_be_bytes()));
        content.extend(entry(X_RETRIES, b'l', &1i64.to_be_bytes()));
        content.extend(entry(X_DEATH, b'A', &0u32.to_be_bytes()));
        content.extend(entry("x-tenant", b'S', &long_string(b"acme")));
        let headers = parse(&content);
        assert!(unparsed(&headers).is_some(), "the budget was not spent");
        assert!(!headers.inner().contains_key("x-tenant"));
        BasicProperties::default().with_headers(headers)
    }

    /// The copy carries the rest back as its entries, under the republish policy: a header read
    /// from the copy is the original's (it was NULL: R36f F3); `CC` and `x-death` are set aside,
    /// the broker's count dropped, and the retry count is the copy's alone.
    #[test]
    fn a_retry_copy_writes_the_raw_rest_back_as_entries_under_the_policy() {
        let original = past_the_budget();
        assert_eq!(retries(&original), crate::amqp::headers::Retries::Count(1));
        let copy = for_retry(&original, 2, "db down", "main_q");
        let again = parse(&generate(copy.headers().as_ref().expect("headers")));
        let read = |name: &str| {
            header(&again, name)
                .expect("readable")
                .map(|v| v.into_owned())
        };
        assert_eq!(read("x-tenant"), Some(AMQPValue::LongString("acme".into())));
        assert_eq!(read("CC"), None);
        assert!(read("x-original-cc").is_some());
        assert_eq!(read(X_DEATH), None);
        assert!(read(X_ORIGINAL_DEATH).is_some());
        assert_eq!(read("x-delivery-count"), None);
        let copied = BasicProperties::default().with_headers(again.clone());
        assert_eq!(retries(&copied), crate::amqp::headers::Retries::Count(2));
        // One entry of each name on the wire: the broker reads the first, lapin the later.
        let wire = generate(&again);
        let count = wire
            .windows(X_RETRIES.len() + 1)
            .filter(|w| w[0] as usize == X_RETRIES.len() && &w[1..] == X_RETRIES.as_bytes())
            .count();
        assert_eq!(count, 1, "x-retries once on the copy");
        // A copy of the copy: the same again.
        let second = for_retry(&copied, 3, "db down", "main_q");
        let again = parse(&generate(second.headers().as_ref().expect("headers")));
        assert_eq!(
            header(&again, "x-tenant")
                .expect("readable")
                .map(|v| v.into_owned()),
            Some(AMQPValue::LongString("acme".into()))
        );
        assert_eq!(
            retries(&BasicProperties::default().with_headers(again)),
            crate::amqp::headers::Retries::Count(3)
        );
    }
}
