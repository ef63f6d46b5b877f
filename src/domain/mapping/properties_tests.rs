//! Property columns (`property = "message_id"`, ...): what they read from a delivery and a
//! copy of it, and the property values they refuse.

use super::tests::cell;
use super::*;
use crate::domain::Envelope;

/// A delivery with `properties`, published to exchange `shop` with routing key `orders`.
fn to_shop(properties: &lapin::BasicProperties) -> Envelope<'_> {
    Envelope {
        properties,
        exchange: "shop",
        routing_key: "orders",
    }
}

/// Review R36f F8: the AMQP parser reads property bytes that are not UTF-8 as U+FFFD, so
/// message ids `id-\xff` and `id-\xfe` read alike, and a key of them took the second for a
/// copy of the first (acked, never stored). A property read into a column that holds U+FFFD
/// refuses the message, naming the property.
#[test]
fn a_property_holding_u_fffd_is_refused_naming_it() {
    use lapin::types::ShortString;
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "t"
        key = ["mid"]
        [columns]
        mid = { property = "message_id", type = "text" }
        "#,
    )
    .expect("parses");
    let m = Mapping::compile("t", &spec).expect("compiles");
    for (id, ok) in [
        ("id-\u{fffd}", false),
        ("id-\u{fffd}\u{fffd}", false),
        ("id-é", true),
    ] {
        let props = lapin::BasicProperties::default().with_message_id(ShortString::from(id));
        match m.decode_envelope(b"{}", &to_shop(&props)) {
            Ok(_) => assert!(ok, "{id} accepted"),
            Err(e) => {
                assert!(!ok, "{id}: {e:?}");
                assert_eq!(e.rejection.kind, crate::domain::ErrorKind::InvalidPayload);
                assert!(
                    e.rejection.reason.contains("property message_id")
                        && e.rejection.reason.contains("U+FFFD"),
                    "{}",
                    e.rejection.reason
                );
            }
        }
    }
}

/// Review R36f F2: a property every element of an array reads, refused, repeated its reason
/// once per element (1,000 times, cut at 1 KiB mid-word). Each distinct reason comes once.
#[test]
fn a_refused_property_read_by_every_element_is_said_once() {
    use lapin::types::ShortString;
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "t"
        key = ["k"]
        [columns]
        k = { path = "/k", type = "int4" }
        mid = { property = "message_id", type = "text" }
        [[children]]
        table = "c"
        rows = "/items"
        key = ["k", "line"]
        [children.columns]
        k = { parent = "k" }
        line = { index = true }
        mid = { property = "message_id", type = "text" }
        "#,
    )
    .expect("parses");
    let m = Mapping::compile("t", &spec).expect("compiles");
    let props = lapin::BasicProperties::default().with_message_id(ShortString::from("a\u{fffd}"));
    let e = m
        .decode_envelope(br#"{"k":1,"items":[{},{},{}]}"#, &to_shop(&props))
        .expect_err("refused");
    assert_eq!(
        e.rejection.reason.matches("U+FFFD").count(),
        1,
        "{}",
        e.rejection.reason
    );
}

#[test]
fn property_columns_read_the_originals_properties() {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "t"
        key = ["k"]
        [columns]
        k      = { path = "/k", type = "int4" }
        msg_id = { property = "message_id", type = "uuid" }
        corr   = { property = "correlation_id", type = "text", optional = true }
        at     = { property = "timestamp", type = "timestamptz" }
        kind   = { property = "type", type = "text", optional = true }
        app    = { property = "app_id", type = "text", default = "unknown" }
        ctype  = { property = "content_type", type = "text", optional = true }
        rk     = { property = "routing_key", type = "text" }
        ex     = { property = "exchange", type = "text" }
        "#,
    )
    .expect("parses");
    let m = Mapping::compile("t", &spec).expect("compiles");
    let id = "5f0c8a4e-8f0e-4f6e-9d53-1a2b3c4d5e6f";
    let props = lapin::BasicProperties::default()
        .with_message_id(ShortString::from(id))
        .with_correlation_id(ShortString::from("c-1"))
        .with_timestamp(1_764_000_000)
        .with_type(ShortString::from("order.created"))
        .with_content_type(ShortString::from("application/json"));
    let delivered = Envelope {
        properties: &props,
        exchange: "shop",
        routing_key: "orders.eu",
    };
    let row = m
        .decode_envelope(br#"{"k":1}"#, &delivered)
        .expect("decodes");
    assert_eq!(cell(&m, &row, "msg_id"), Cell::Uuid(id.parse().unwrap()));
    assert_eq!(cell(&m, &row, "corr"), Cell::Text("c-1".into()));
    assert_eq!(
        cell(&m, &row, "at"),
        Cell::Timestamptz("2025-11-24T16:00:00Z".into())
    );
    assert_eq!(cell(&m, &row, "kind"), Cell::Text("order.created".into()));
    assert_eq!(
        cell(&m, &row, "app"),
        Cell::Text("unknown".into()),
        "its default"
    );
    assert_eq!(cell(&m, &row, "rk"), Cell::Text("orders.eu".into()));
    assert_eq!(cell(&m, &row, "ex"), Cell::Text("shop".into()));
    // A copy warren republished (a retry, back through the retry tier): the original's
    // exchange and routing key, from its headers.
    let mut h = FieldTable::default();
    h.insert(
        "x-warren-exchange".into(),
        AMQPValue::LongString("shop".into()),
    );
    h.insert(
        "x-warren-routing-key".into(),
        AMQPValue::LongString("orders.eu".into()),
    );
    let copy = props.clone().with_headers(h);
    let retried = Envelope {
        properties: &copy,
        exchange: "t_exchange",
        routing_key: "t_queue",
    };
    assert_eq!(
        m.decode_envelope(br#"{"k":1}"#, &retried).expect("decodes"),
        row
    );
    // Absent and required: refused naming the property; optional: NULL.
    let bare = lapin::BasicProperties::default().with_timestamp(0);
    let r = m
        .decode_envelope(
            br#"{"k":1}"#,
            &Envelope {
                properties: &bare,
                exchange: "",
                routing_key: "q",
            },
        )
        .unwrap_err();
    assert_eq!(
        r.rejection.reason,
        "property message_id: missing (a uuid is required)"
    );
    let no_id = bare.clone().with_message_id(ShortString::from(id));
    let row = m
        .decode_envelope(
            br#"{"k":1}"#,
            &Envelope {
                properties: &no_id,
                exchange: "",
                routing_key: "q",
            },
        )
        .expect("the rest optional");
    assert_eq!(cell(&m, &row, "corr"), Cell::Null);
    assert_eq!(
        cell(&m, &row, "ex"),
        Cell::Text("".into()),
        "the default exchange"
    );
    assert_eq!(
        cell(&m, &row, "at"),
        Cell::Timestamptz("1970-01-01T00:00:00Z".into())
    );
    // A message id that is no UUID, for a uuid column.
    let bad = bare.with_message_id(ShortString::from("m-1"));
    let r = m
        .decode_envelope(
            br#"{"k":1}"#,
            &Envelope {
                properties: &bad,
                exchange: "",
                routing_key: "q",
            },
        )
        .unwrap_err();
    assert_eq!(
        r.rejection.reason,
        "property message_id: expected a UUID, found \"m-1\""
    );
    // Mistakes in the spec.
    for (column, wanted) in [
        (
            "c = { property = \"timestamp\", type = \"int8\" }",
            "columns.c: property timestamp is read as timestamptz, not int8",
        ),
        (
            "c = { property = \"app_id\", type = \"int4\" }",
            "columns.c: property app_id is read as text or uuid, not int4",
        ),
        (
            "c = { path = \"/c\", property = \"app_id\", type = \"text\" }",
            "columns.c: give one of path, header or property, not two",
        ),
    ] {
        let spec: MappingSpec = toml::from_str(&format!(
            "table = \"t\"\nkey = [\"k\"]\n[columns]\nk = {{ path = \"/k\", type = \"int4\" }}\n{column}\n"
        ))
        .expect("parses");
        let err = Mapping::compile("t", &spec).unwrap_err();
        assert_eq!(err.to_string(), format!("pipeline t: {wanted}"));
    }
}
