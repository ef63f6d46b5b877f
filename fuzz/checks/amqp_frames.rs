//! The AMQP frame parser warren runs (lapin's, with the vendored amq-protocol-types) on any
//! bytes, and the republish policy on any content header it accepts. Parsing never panics (short
//! strings of invalid bytes, tables nested to any depth); a copy warren makes of the parsed
//! properties (`amqp::republish`) is what the broker takes: no `expiration`, no `user_id`, no
//! `CC`/`BCC`, persistent, within the frame limit less the broker's headroom once fitted (only
//! warren's reasons cut, and only cut), and it encodes and parses back to itself; a copy `fit`
//! refuses is one that does not fit even with every reason cut to its shortest, and the refusal
//! names its size and the frame limit.
//!
//! Input: the bytes of one or more frames as on the wire (type, channel, size, payload, 0xCE).
//!
//! [`outcomes`] says what became of each content header's copy (`fits` as it is, `cut`: fits once
//! its reasons are cut, `refused`), so a seed can name the path it is there to take
//! (tests/fuzz_seeds.rs).

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use warren::amqp::headers;
use warren::amqp::republish::{self, Stamp, Unpublishable};

/// The frame limit the copies are fitted to: RabbitMQ's default `frame_max`.
const FRAME_MAX: u32 = 131_072;

/// The properties as text, without warren's reasons (the headers `fit` may cut).
fn without_reasons(properties: &BasicProperties) -> String {
    let mut p = properties.clone();
    if let Some(table) = p.headers().clone() {
        let kept: std::collections::BTreeMap<_, _> = table
            .inner()
            .iter()
            .filter(|(k, _)| !headers::REASONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        p = p.with_headers(kept.into());
    }
    format!("{p:?}")
}

/// The text of a reason header, if it is a long string (the only kind `fit` cuts).
fn reason_text(properties: &BasicProperties, key: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        _ => None,
    }
}

/// The copy with every reason `fit` may cut at its shortest: `…`, the least `fit` leaves of a
/// text it cuts (texts of 3 bytes or less kept as they are).
fn shortest(properties: &BasicProperties) -> BasicProperties {
    let Some(mut table) = properties.headers().clone() else {
        return properties.clone();
    };
    for key in headers::REASONS {
        if let Some(AMQPValue::LongString(text)) = table.inner().get(key)
            && text.as_bytes().len() > '…'.len_utf8()
        {
            table.insert(
                key.into(),
                AMQPValue::LongString("…".as_bytes().to_vec().into()),
            );
        }
    }
    properties.clone().with_headers(table)
}

/// The properties as a header frame's bytes, and parsed back.
fn round_trip(properties: &BasicProperties) -> BasicProperties {
    let frame = AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 0,
            properties: properties.clone(),
        },
    );
    let (bytes, _) = gen_frame(&frame)(WriteContext::from(Vec::new()))
        .expect("a copy encodes")
        .into_inner();
    assert_eq!(bytes.len(), republish::header_frame_size(properties));
    match parse_frame(bytes.as_slice()) {
        Ok((_, AMQPFrame::Header(_, header))) => header.properties,
        other => panic!("a copy does not parse back: {other:?}"),
    }
}

/// Checks the copy of `original` and says what `fit` made of it: `fits`, `cut` or `refused`.
fn check_copy(original: &BasicProperties, restart: bool) -> &'static str {
    let reason = AMQPValue::LongString(vec![b'r'; 2000].into());
    let copy = republish::copy_properties(
        original,
        &Stamp {
            set: vec![
                (headers::X_RETRIES, AMQPValue::LongLongInt(1)),
                (headers::X_ERROR_REASON, reason),
            ],
            restart,
            ..Default::default()
        },
    );
    assert_eq!(copy.expiration(), &None);
    assert_eq!(copy.user_id(), &None);
    assert_eq!(copy.delivery_mode(), &Some(2));
    let keys: Vec<&str> = copy
        .headers()
        .iter()
        .flat_map(|h| h.inner().keys())
        .map(|k| k.as_str())
        .collect();
    for moved in ["CC", "BCC", "x-delivery-count"] {
        assert!(!keys.contains(&moved), "{moved} on a copy");
    }
    if restart {
        assert!(!keys.contains(&republish::X_DEATH), "x-death on a new life");
    }
    // Fitted to RabbitMQ's default frame limit less the broker's headroom, or refused: never
    // sent over it, and never refused when cutting the reasons would have made it fit.
    let limit = republish::header_limit(FRAME_MAX);
    let size = republish::header_frame_size(&copy);
    match republish::fit(copy.clone(), &headers::REASONS, FRAME_MAX) {
        Ok(fitted) => {
            let fitted_size = republish::header_frame_size(&fitted);
            assert!(
                fitted_size <= limit,
                "a fitted copy of {fitted_size} bytes, over the limit of {limit}"
            );
            if size <= limit {
                assert_eq!(
                    format!("{fitted:?}"),
                    format!("{copy:?}"),
                    "a copy that fits was changed"
                );
            }
            assert_eq!(
                without_reasons(&fitted),
                without_reasons(&copy),
                "fit changed more than warren's reasons"
            );
            for key in headers::REASONS {
                let (before, after) = (reason_text(&copy, key), reason_text(&fitted, key));
                if before != after {
                    let (before, after) = (before.unwrap_or_default(), after.unwrap_or_default());
                    let kept = after.strip_suffix('…').unwrap_or_else(|| {
                        panic!("{key} changed without being cut: {before:?} -> {after:?}")
                    });
                    assert!(
                        before.starts_with(kept) && after.len() < before.len().max(4),
                        "{key} is not a cut of itself: {before:?} -> {after:?}"
                    );
                }
            }
            let back = round_trip(&fitted);
            assert_eq!(
                format!("{back:?}"),
                format!("{fitted:?}"),
                "a copy parses back to itself"
            );
            if size <= limit { "fits" } else { "cut" }
        }
        Err(Unpublishable::TooLarge {
            size: refused,
            frame_max,
        }) => {
            assert_eq!(
                frame_max, FRAME_MAX,
                "the refusal names another frame limit"
            );
            assert!(
                refused > limit && refused <= size,
                "refused as {refused} bytes: the copy is {size}, the limit {limit}"
            );
            let least = republish::header_frame_size(&shortest(&copy));
            assert!(
                least > limit,
                "refused a copy of {size} bytes that fits once its reasons are cut ({least} \
                 bytes, the limit {limit})"
            );
            "refused"
        }
        Err(other) => panic!("fit refused for another reason than the size: {other}"),
    }
}

/// The check: panics on a broken promise.
pub fn check(data: &[u8]) {
    outcomes(data);
}

/// The check, and what became of the copy of each content header parsed (in a retry, not a new
/// life): `fits`, `cut` or `refused` ([`check_copy`]).
pub fn outcomes(data: &[u8]) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Ok((next, frame)) = parse_frame(rest) {
        if let AMQPFrame::Header(_, header) = &frame {
            out.push(check_copy(&header.properties, false));
            check_copy(&header.properties, true);
        }
        if next.len() == rest.len() {
            break;
        }
        rest = next;
    }
    out
}
