//! The mapping's times against what PostgreSQL reads (`times.rs`): years before 0001 and after
//! 9999, UTC offsets, dates with a signed year, timestamp properties past the end of a
//! timestamptz. The other unit tests of the mapping are in `tests.rs`, whose helpers these use.

use super::tests::{cell, orders, refused, with};
use super::*;
use crate::domain::ErrorKind;

#[test]
fn a_year_postgresql_cannot_read_is_refused_at_decode() {
    let m = orders();
    for at in ["0000-01-01T00:00:00Z", "-0001-01-01T00:00:00Z"] {
        let body = with("placed_at", &format!("{at:?}"));
        let e = refused(&m, &body);
        assert_eq!(e.kind, ErrorKind::InvalidPayload, "{at}");
        assert!(e.reason.contains("/placed_at"), "{at}: {}", e.reason);
        assert!(
            at.starts_with('-') || e.reason.contains("year from 0001"),
            "{at}: {}",
            e.reason
        );
    }
    let body = with("placed_at", "\"0001-01-01T00:00:00Z\"");
    assert!(m.decode_message(body.as_bytes(), None).is_ok());
}

/// Found by review (R36-F4): a time after year 9999 was refused as no RFC 3339 time ("a
/// character literal was not valid"), though a timestamptz holds it; and a timestamp property
/// that large was "beyond the times a timestamptz holds". Both are taken up to PostgreSQL's end
/// of a timestamptz, and past it refused naming that end.
#[test]
fn a_time_after_9999_is_taken_up_to_the_end_of_a_timestamptz() {
    use crate::domain::Envelope;
    let m = orders();
    let body = with("placed_at", "\"10000-01-01T00:00:00Z\"");
    let row = m
        .decode_message(body.as_bytes(), None)
        .expect("10000 is a timestamptz");
    assert_eq!(
        cell(&m, &row, "placed_at"),
        Cell::Timestamptz("10000-01-01T00:00:00Z".into())
    );
    let e = refused(&m, &with("placed_at", "\"294277-01-01T00:00:00Z\""));
    assert_eq!(
        e.reason,
        "/placed_at: expected a time up to 294276-12-31T23:59:59.999999Z (the last a \
         PostgreSQL timestamptz holds), found \"294277-01-01T00:00:00Z\""
    );
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "t"
        key = ["k"]
        [columns]
        k  = { path = "/k", type = "int4" }
        at = { property = "timestamp", type = "timestamptz" }
        "#,
    )
    .expect("parses");
    let p = Mapping::compile("t", &spec).expect("compiles");
    let decode = |secs: u64| {
        let props = lapin::BasicProperties::default().with_timestamp(secs);
        let envelope = Envelope {
            properties: &props,
            exchange: "",
            routing_key: "q",
        };
        p.decode_envelope(br#"{"k":1}"#, &envelope)
            .map(|row| row.0[0].clone())
            .map_err(|r| r.rejection.reason)
    };
    assert_eq!(
        decode(253_402_300_800),
        Ok(Cell::Timestamptz("10000-01-01T00:00:00Z".into()))
    );
    let words = decode(9_224_318_016_000).unwrap_err();
    assert!(
        words.starts_with("property timestamp: the timestamp 9224318016000 (Unix seconds) is past")
            && words.contains("294276-12-31T23:59:59Z, the last second a PostgreSQL timestamptz"),
        "{words}"
    );
}

/// Found by the second review: an offset beyond what PostgreSQL reads (+-15:59) passed decode,
/// and the database refused the batch.
#[test]
fn an_offset_postgresql_cannot_read_is_refused_at_decode() {
    let m = orders();
    for (at, ok) in [
        ("2026-11-24T10:00:00-23:59", false),
        ("2026-11-24T10:00:00+16:00", false),
        ("2026-11-24T10:00:00+15:59", true),
        ("2026-11-24T10:00:00-15:59", true),
    ] {
        let body = with("placed_at", &format!("{at:?}"));
        match m.decode_message(body.as_bytes(), None) {
            Ok(_) => assert!(ok, "{at} accepted"),
            Err(e) => {
                assert!(!ok, "{at}: {}", e.reason);
                assert!(e.reason.contains("UTC offset"), "{at}: {}", e.reason);
            }
        }
    }
}

/// Found by the second review: a date with a signed year (`+2026-01-01`) passed decode, and the
/// database refused the batch; and dates of year 0.
#[test]
fn a_date_postgresql_cannot_read_is_refused_at_decode() {
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "days"
        key = ["day"]
        [columns]
        day = { path = "/day", type = "date" }
        "#,
    )
    .unwrap();
    let m = Mapping::compile("days", &spec).unwrap();
    for (day, ok) in [
        ("2026-01-01", true),
        ("0001-01-01", true),
        ("+2026-01-01", false),
        ("0000-01-01", false),
        ("-0001-01-01", false),
    ] {
        let body = format!(r#"{{"day":"{day}"}}"#);
        let got = m.decode_message(body.as_bytes(), None);
        assert_eq!(got.is_ok(), ok, "{day}: {got:?}");
        if let Err(e) = got {
            assert!(e.reason.starts_with("/day: "), "{day}: {}", e.reason);
        }
    }
}
