//! The AMQP frame parser warren runs (lapin's, with the vendored amq-protocol-types) on any
//! bytes, and the republish policy on any content header it accepts. Parsing never panics (short
//! strings of invalid bytes, tables nested to any depth); a copy warren makes of the parsed
//! properties (`amqp::republish`) is what the broker takes: no `expiration`, no `user_id`, no
//! `CC`/`BCC`, persistent, within the frame limit once fitted, and it encodes and parses back to
//! itself.
//!
//! Input: the bytes of one or more frames as on the wire (type, channel, size, payload, 0xCE).

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use warren::amqp::headers;
use warren::amqp::republish::{self, Stamp};

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

fn check_copy(original: &BasicProperties, restart: bool) {
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
    // Fitted to RabbitMQ's default frame limit, or refused: never sent over it.
    if let Ok(fitted) = republish::fit(copy, &headers::REASONS, 131_072) {
        assert!(republish::header_frame_size(&fitted) <= 131_072);
        let back = round_trip(&fitted);
        assert_eq!(
            format!("{back:?}"),
            format!("{fitted:?}"),
            "a copy parses back to itself"
        );
    }
}

/// The check: panics on a broken promise.
pub fn check(data: &[u8]) {
    let mut rest = data;
    while let Ok((next, frame)) = parse_frame(rest) {
        if let AMQPFrame::Header(_, header) = &frame {
            check_copy(&header.properties, false);
            check_copy(&header.properties, true);
        }
        if next.len() == rest.len() {
            break;
        }
        rest = next;
    }
}
