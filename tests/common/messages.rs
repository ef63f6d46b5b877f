//! Messages: bodies and properties to publish (`user_body`, `json_props`, `with_header`,
//! `long_string`, `dead_letter_props`) and reading fetched ones back (`header`, `as_int`,
//! `int_header`, `strict_int_header`, `text_header`, `message_id`, `message_uuid`).

use lapin::BasicProperties;
use lapin::message::BasicGetMessage;
use lapin::types::{AMQPValue, LongString};
use uuid::Uuid;

/// A valid user body.
pub fn user_body(id: Uuid) -> Vec<u8> {
    format!(r#"{{"id":"{id}","name":"user {id}","email":"{id}@example.com"}}"#).into_bytes()
}

/// Properties as warren's publisher sets them.
pub fn json_props(id: Uuid) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.to_string().into())
}

/// Properties with one header set.
pub fn with_header(props: BasicProperties, key: &str, value: AMQPValue) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(key.into(), value);
    props.with_headers(headers)
}

pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Properties of a message the main pipeline dead-lettered: JSON, `message_id`, and the
/// `x-retries`, `x-error-kind` and `x-error-reason` headers warren's router writes.
pub fn dead_letter_props(
    message_id: &str,
    kind: &str,
    retries: i64,
    reason: &str,
) -> BasicProperties {
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id(message_id.into());
    let props = with_header(props, "x-retries", AMQPValue::LongLongInt(retries));
    let props = with_header(props, "x-error-kind", long_string(kind));
    with_header(props, "x-error-reason", long_string(reason))
}

/// One header, as sent.
pub fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(key)
}

/// The value of an AMQP integer of any type; `None` for anything else.
pub fn as_int(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(v) => Some(*v as i64),
        AMQPValue::ShortShortUInt(v) => Some(*v as i64),
        AMQPValue::ShortInt(v) => Some(*v as i64),
        AMQPValue::ShortUInt(v) => Some(*v as i64),
        AMQPValue::LongInt(v) => Some(*v as i64),
        AMQPValue::LongUInt(v) => Some(*v as i64),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// An integer header of any AMQP integer type; `None` if missing or not an integer.
pub fn int_header(props: &BasicProperties, key: &str) -> Option<i64> {
    header(props, key).and_then(as_int)
}

/// An integer header of any AMQP integer type; `None` if missing, and a failed test if it is
/// there but not an integer.
pub fn strict_int_header(props: &BasicProperties, key: &str) -> Option<i64> {
    header(props, key)
        .map(|v| as_int(v).unwrap_or_else(|| panic!("{key} is not an integer: {v:?}")))
}

/// A string header (long or short string); `None` if missing or of another type.
pub fn text_header(props: &BasicProperties, key: &str) -> Option<String> {
    match header(props, key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// The `message_id` of a fetched message; empty when it has none.
pub fn message_id(m: &BasicGetMessage) -> String {
    m.delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_default()
}

/// The `message_id` of a fetched message as a UUID; a failed test when it is missing or is not
/// a UUID.
pub fn message_uuid(m: &BasicGetMessage) -> Uuid {
    let id = m
        .delivery
        .properties
        .message_id()
        .as_ref()
        .expect("message_id kept");
    id.as_str()
        .parse()
        .unwrap_or_else(|e| panic!("message_id {id} is not a UUID: {e}"))
}
