//! The header readers and writers on any headers table: `warren::amqp::headers` (`retries`,
//! `text`, `to_json`, and the republish stamps `for_retry`, `for_dead_letter`, `for_replay`) and the `dlq` tool's own
//! (`kind_of`, `replay_headers`). None may panic, and each keeps its promise.
//!
//! Input: 4 bytes of `x-retries` to write (big endian), then the entries of an AMQP field table
//! as on the wire (short-string name, type octet, value); parsing stops at the first entry that
//! does not parse, so most inputs give a table.

use lapin::BasicProperties;
use lapin::types::parsing::{parse_short_string, parse_value};
use lapin::types::{AMQPValue, FieldTable};
use warren::amqp::headers::{self, Retries};
use warren::amqp::republish;
use warren::cli::dlq::{KINDS, kind_of, replay_headers};

/// The entries of `wire` up to the first one that does not parse.
fn table(mut wire: &[u8]) -> FieldTable {
    let mut table = FieldTable::default();
    while let Ok((rest, name)) = parse_short_string(wire) {
        let Ok((rest, value)) = parse_value(rest) else {
            break;
        };
        table.insert(name, value);
        wire = rest;
    }
    table
}

/// The headers of `p` other than those whose name satisfies `dropped`, as text (a float NaN
/// is not equal to itself, its text is).
fn others(p: &BasicProperties, dropped: impl Fn(&str) -> bool) -> String {
    let kept: Vec<(&str, &AMQPValue)> = p
        .headers()
        .iter()
        .flat_map(|h| h.inner().iter())
        .filter(|(k, _)| !dropped(k.as_str()))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    format!("{kept:?}")
}

/// The check: panics on a broken promise.
pub fn check(data: &[u8]) {
    let Some((count, wire)) = data.split_first_chunk::<4>() else {
        return;
    };
    let count = u32::from_be_bytes(*count);
    let input = table(wire);
    let p = BasicProperties::default().with_headers(input.clone());

    // Readers.
    let _ = headers::retries(&p).count();
    for (name, value) in input.inner() {
        assert_eq!(
            headers::text(&p, name.as_str()),
            Some(headers::value_text(value))
        );
    }
    let json = headers::to_json(&p);
    assert_eq!(
        json.as_object().map(|o| o.len()),
        Some(input.inner().len()),
        "to_json lost or invented a header"
    );
    let reason = format!(
        "reason {}",
        json.to_string().chars().take(40).collect::<String>()
    );

    // Writers: the count and the texts they promise, every other header kept.
    let retry = republish::for_retry(&p, count, &reason, "main");
    assert_eq!(headers::retries(&retry), Retries::Count(count));
    assert_eq!(
        headers::text(&retry, headers::X_RETRY_REASON),
        Some(reason.clone())
    );
    // The republish policy moves what the broker acts on to x-original-* headers and drops
    // the broker's own delivery count (`amqp::republish`); everything else is kept.
    let policy =
        |k: &str| matches!(k, "CC" | "BCC" | "x-delivery-count") || k.starts_with("x-original-");
    let written = |k: &str| {
        k == headers::X_RETRIES || k == headers::X_RETRY_REASON || k == "x-death" || policy(k)
    };
    assert_eq!(others(&retry, written), others(&p, written));

    // Over an unreadable count nothing is made up: x-retries stays what it was, if anything.
    let kept = republish::for_dead_letter(&p, None, "retries_exhausted", &reason);
    assert_eq!(
        headers::text(&kept, headers::X_RETRIES),
        headers::text(&p, headers::X_RETRIES)
    );
    let dead = republish::for_dead_letter(&p, Some(count), "db_permanent", &reason);
    assert_eq!(headers::retries(&dead), Retries::Count(count));
    assert_eq!(
        headers::text(&dead, headers::X_ERROR_KIND).as_deref(),
        Some("db_permanent")
    );
    assert_eq!(kind_of(&dead).as_deref(), Some("db_permanent"));

    let replay = republish::for_replay(&dead);
    assert_eq!(headers::retries(&replay), Retries::Count(0));
    let error = |k: &str| k.starts_with("x-error-");
    assert!(
        replay
            .headers()
            .iter()
            .flat_map(|h| h.inner().keys())
            .all(|k| !error(k.as_str())),
        "an x-error-* header survived the replay"
    );
    // A replay starts afresh: x-retries reset, the error headers and the DLQ consumer's own
    // attempt count dropped; everything else kept.
    let reset = |k: &str| {
        error(k)
            || k == headers::X_RETRIES
            || k == headers::X_DLQ_ATTEMPTS
            || k == "x-death"
            || policy(k)
    };
    assert_eq!(others(&replay, reset), others(&dead, reset));

    // The dlq tool: a kind is x-error-kind or one of the broker kinds; the parked headers of any
    // message can be replayed.
    if let Some(kind) = kind_of(&p) {
        assert!(
            headers::text(&p, headers::X_ERROR_KIND).as_deref() == Some(kind.as_str())
                || KINDS.contains(&kind.as_str()),
            "kind {kind} from nowhere"
        );
    }
    let parked = replay_headers(&json).expect("headers of a message can be replayed");
    assert_eq!(
        parked.inner().get(headers::X_RETRIES),
        Some(&AMQPValue::LongLongInt(0))
    );
    assert!(
        parked
            .inner()
            .keys()
            .all(|k| !error(k.as_str()) && k.as_str() != "x-dlq-attempts")
    );
}
