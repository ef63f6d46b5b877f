//! A hostile publisher for the ledger: messages drawn from what AMQP 0-9-1 lets a publisher send
//! rather than from a list of cases. Every basic property unset, set, or at its limits (short
//! strings of up to 255 invalid bytes, priorities and delivery modes out of range, expirations,
//! another broker user's `user_id`, timestamps at both ends), header tables of every field type,
//! with keys of any bytes, nested to the frame limit or filled to it, forged `x-retries`,
//! `x-death`, `CC`; bodies from empty to past `MAX_MESSAGE_BYTES`, invalid UTF-8, unknown fields.
//! Some draws the broker itself refuses (an expiration that is not a number, a user id that is
//! not the connection's): those are never confirmed and stay out of the ledger.
//!
//! Each message carries its ledger key `h-N` where warren keeps it: its message id starts with
//! it, and its body holds `#h-N#` (a user's name, a malformed body) unless the body is empty, in
//! which case the message id is plain. [`key_of`] finds the key of a parked row.

use std::collections::BTreeMap;

use fastrand::Rng;
use uuid::Uuid;

use super::raw_amqp::{self, RawProperties};

/// One drawn message.
#[derive(Debug, Clone)]
pub struct Hostile {
    /// The ledger key (`h-N`).
    pub key: String,
    pub properties: RawProperties,
    pub body: Vec<u8>,
    /// The user it carries if its body is a valid user: (id, name, email).
    pub user: Option<(Uuid, String, String)>,
    /// Published on the other broker user's connection (its `user_id` is that user's).
    pub as_other_user: bool,
    /// The classes of property and body drawn, for the run's report.
    pub classes: Vec<&'static str>,
}

/// Up to `n` bytes that are not UTF-8 (a mix of lone continuation bytes and invalid leads).
fn invalid_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| match rng.u8(0..4) {
            0 => 0xff,
            1 => 0xfe,
            2 => rng.u8(0x80..0xc0),
            _ => rng.u8(0xf5..=0xff),
        })
        .collect()
}

/// A short-string property: unset, ASCII, empty, at 255 bytes, or invalid bytes up to 255.
fn short_prop(
    rng: &mut Rng,
    classes: &mut Vec<&'static str>,
    name: &'static str,
) -> Option<Vec<u8>> {
    match rng.u8(0..10) {
        0..=4 => None,
        5 => Some(format!("{name}-value").into_bytes()),
        6 => {
            classes.push("short_string_empty");
            Some(Vec::new())
        }
        7 => {
            classes.push("short_string_255");
            Some(vec![b'a'; 255])
        }
        _ => {
            classes.push("short_string_invalid_utf8");
            let n = rng.usize(1..=255);
            Some(invalid_bytes(rng, n))
        }
    }
}

/// A field-table key: ASCII, empty, or invalid bytes up to 255.
fn key(rng: &mut Rng, classes: &mut Vec<&'static str>, n: usize) -> Vec<u8> {
    match rng.u8(0..10) {
        0 => {
            classes.push("header_key_empty");
            Vec::new()
        }
        1 | 2 => {
            classes.push("header_key_invalid_utf8");
            let len = rng.usize(1..=255);
            invalid_bytes(rng, len)
        }
        _ => format!("k{n}").into_bytes(),
    }
}

/// One field value of a random type, as its type octet and encoding; tables and arrays recurse
/// while `depth` allows.
fn value(rng: &mut Rng, classes: &mut Vec<&'static str>, depth: u32) -> Vec<u8> {
    let kinds: &[u8] = if depth == 0 {
        b"tbBsuIilfdDSTxV"
    } else {
        b"tbBsuIilfdDSTxVAF"
    };
    let t = kinds[rng.usize(0..kinds.len())];
    let mut v = vec![t];
    match t {
        b't' => v.push(rng.u8(..)),
        b'b' | b'B' => v.push(rng.u8(..)),
        b's' | b'u' => v.extend_from_slice(&rng.u16(..).to_be_bytes()),
        b'I' | b'i' => v.extend_from_slice(&rng.u32(..).to_be_bytes()),
        b'l' | b'T' => v.extend_from_slice(&rng.u64(..).to_be_bytes()),
        b'f' => v.extend_from_slice(&rng.u32(..).to_be_bytes()),
        b'd' => v.extend_from_slice(&rng.u64(..).to_be_bytes()),
        b'D' => {
            v.push(rng.u8(..));
            v.extend_from_slice(&rng.u32(..).to_be_bytes());
        }
        b'S' | b'x' => {
            let n = rng.usize(0..64);
            let bytes = if rng.bool() {
                invalid_bytes(rng, n)
            } else {
                vec![b'v'; n]
            };
            v.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
            v.extend(bytes);
        }
        b'V' => {}
        b'A' => {
            let mut items = Vec::new();
            for _ in 0..rng.usize(0..4) {
                items.extend(value(rng, classes, depth - 1));
            }
            v.extend_from_slice(&(items.len() as u32).to_be_bytes());
            v.extend(items);
        }
        _ => {
            // 'F'
            let mut entries = Vec::new();
            for n in 0..rng.usize(0..4) {
                let k = key(rng, classes, n);
                raw_amqp::entry(&mut entries, &k, &value(rng, classes, depth - 1));
            }
            v.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            v.extend(entries);
        }
    }
    v
}

/// A header table: every field type, keys of any bytes, sometimes nested to the frame limit or
/// filled to it, sometimes with headers the broker or warren act on, forged.
fn headers(rng: &mut Rng, classes: &mut Vec<&'static str>, main_queue: &str) -> Vec<u8> {
    let mut entries = Vec::new();
    for n in 0..rng.usize(0..8) {
        let k = key(rng, classes, n);
        let v = value(rng, classes, 3);
        raw_amqp::entry(&mut entries, &k, &v);
    }
    classes.push("header_every_type");
    match rng.u8(0..12) {
        0 => {
            classes.push("header_nested_deep");
            let depth = rng.usize(65..15_000);
            raw_amqp::entry(&mut entries, b"deep", &raw_amqp::nested_table(depth));
        }
        1 => {
            classes.push("header_near_frame_limit");
            let n = rng.usize(20_000..120_000);
            raw_amqp::entry(&mut entries, b"pad", &raw_amqp::long_str(&vec![b'p'; n]));
        }
        2 => {
            classes.push("header_cc");
            let mut list = Vec::new();
            for q in [main_queue, "nowhere"] {
                list.extend(raw_amqp::long_str(q.as_bytes()));
            }
            let mut v = vec![b'A'];
            v.extend_from_slice(&(list.len() as u32).to_be_bytes());
            v.extend(list);
            raw_amqp::entry(&mut entries, b"CC", &v);
        }
        3 => {
            classes.push("header_forged_x_death");
            let mut death = Vec::new();
            raw_amqp::entry(
                &mut death,
                b"queue",
                &raw_amqp::long_str(main_queue.as_bytes()),
            );
            raw_amqp::entry(&mut death, b"reason", &raw_amqp::long_str(b"expired"));
            let table = raw_amqp::table(&death);
            let mut v = vec![b'A'];
            v.extend_from_slice(&(table.len() as u32).to_be_bytes());
            v.extend(table);
            raw_amqp::entry(&mut entries, b"x-death", &v);
        }
        4 => {
            classes.push("header_forged_x_retries");
            let v = match rng.u8(0..3) {
                0 => raw_amqp::long_str(b"lots"),
                1 => {
                    let mut v = vec![b'l'];
                    v.extend_from_slice(&(-5i64).to_be_bytes());
                    v
                }
                _ => {
                    let mut v = vec![b'l'];
                    v.extend_from_slice(&i64::MAX.to_be_bytes());
                    v
                }
            };
            raw_amqp::entry(&mut entries, b"x-retries", &v);
            raw_amqp::entry(
                &mut entries,
                b"x-error-kind",
                &raw_amqp::long_str(b"forged"),
            );
        }
        _ => {}
    }
    entries
}

/// Draws message `n` (key `h-n`). Bodies past `max_message_bytes` are drawn too.
pub fn draw(rng: &mut Rng, n: usize, main_queue: &str, max_message_bytes: usize) -> Hostile {
    let key = format!("h-{n}");
    let marker = format!("#{key}#");
    let mut classes = Vec::new();
    let mut user = None;
    let body: Vec<u8> = match rng.u8(0..20) {
        0 | 1 => {
            classes.push("body_malformed");
            format!("{{not json {marker}").into_bytes()
        }
        2 => {
            classes.push("body_invalid_utf8");
            [b"\xff\xfe".as_slice(), marker.as_bytes(), b"\xc3"].concat()
        }
        3 => {
            classes.push("body_empty");
            Vec::new()
        }
        4 => {
            classes.push("body_over_max_message_bytes");
            let mut b = marker.clone().into_bytes();
            b.resize(
                rng.usize(max_message_bytes + 1..max_message_bytes * 4),
                b'x',
            );
            b
        }
        5 => {
            classes.push("body_unknown_field");
            format!(
                r#"{{"id":"{}","name":"x {marker}","email":"a@example.com","extra":1}}"#,
                Uuid::new_v4()
            )
            .into_bytes()
        }
        6 => {
            classes.push("body_not_an_object");
            format!(r#"["{marker}"]"#).into_bytes()
        }
        _ => {
            let id = Uuid::new_v4();
            let name = format!("user {marker}");
            let email = format!("{id}@example.com");
            let mut b =
                format!(r#"{{"id":"{id}","name":"{name}","email":"{email}"}}"#).into_bytes();
            if rng.u8(0..10) == 0 {
                // Exactly at the limit: accepted.
                classes.push("body_at_max_message_bytes");
                b.resize(max_message_bytes, b' ');
            } else {
                classes.push("body_valid_user");
            }
            user = Some((id, name, email));
            b
        }
    };
    // The message id: plain, the key and invalid bytes, or none (the body holds the key).
    let message_id = match rng.u8(0..10) {
        _ if body.is_empty() => Some(key.clone().into_bytes()),
        0..=4 => Some(key.clone().into_bytes()),
        5..=7 => {
            classes.push("message_id_invalid_utf8");
            let room = 255 - key.len() - 1;
            let n = rng.usize(1..=room);
            Some([format!("{key}-").into_bytes(), invalid_bytes(rng, n)].concat())
        }
        _ => {
            classes.push("message_id_unset");
            None
        }
    };
    let mut p = RawProperties {
        message_id,
        content_type: match rng.u8(0..3) {
            0 => Some(b"application/json".to_vec()),
            _ => short_prop(rng, &mut classes, "type"),
        },
        content_encoding: short_prop(rng, &mut classes, "encoding"),
        correlation_id: short_prop(rng, &mut classes, "correlation"),
        reply_to: short_prop(rng, &mut classes, "reply"),
        kind: short_prop(rng, &mut classes, "kind"),
        app_id: short_prop(rng, &mut classes, "app"),
        cluster_id: short_prop(rng, &mut classes, "cluster"),
        ..Default::default()
    };
    p.delivery_mode = match rng.u8(0..6) {
        0 => None,
        1 => {
            classes.push("delivery_mode_transient");
            Some(1)
        }
        2 => {
            classes.push("delivery_mode_out_of_range");
            Some(rng.u8(3..=255))
        }
        _ => Some(2),
    };
    p.priority = match rng.u8(0..5) {
        0 => {
            classes.push("priority_out_of_range");
            Some(rng.u8(10..=255))
        }
        1 => Some(rng.u8(0..10)),
        _ => None,
    };
    p.timestamp = match rng.u8(0..6) {
        0 => {
            classes.push("timestamp_extreme");
            Some(if rng.bool() { 0 } else { u64::MAX })
        }
        1 => Some(1_800_000_000),
        _ => None,
    };
    // Long enough that the broker never expires them in the main queue before warren takes
    // them (a short one is tests/hostile.rs's); some the broker refuses (not a number).
    p.expiration = match rng.u8(0..10) {
        0 => {
            classes.push("expiration");
            Some(b"3600000".to_vec())
        }
        1 => {
            classes.push("expiration_max");
            Some(b"4294967295".to_vec())
        }
        2 => {
            classes.push("expiration_refused_by_broker");
            Some(b"soon".to_vec())
        }
        _ => None,
    };
    let mut as_other_user = false;
    p.user_id = match rng.u8(0..10) {
        0 => Some(b"guest".to_vec()),
        1 | 2 => {
            classes.push("user_id_other_user");
            as_other_user = true;
            None // set by the caller, who knows the user's name
        }
        3 => {
            classes.push("user_id_refused_by_broker");
            Some(b"nobody-of-this-broker".to_vec())
        }
        _ => None,
    };
    if rng.bool() {
        p.headers = Some(headers(rng, &mut classes, main_queue));
    }
    classes.sort_unstable();
    classes.dedup();
    Hostile {
        key,
        properties: p,
        body,
        user,
        as_other_user,
        classes,
    }
}

/// The ledger key (`h-N` or `m-N`) of a parked row: the body's `#key#` marker, else the message
/// id's leading key.
pub fn key_of(message_id: Option<&str>, body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    for prefix in ["#h-", "#m-"] {
        if let Some(start) = text.find(prefix) {
            let digits: String = text[start + 3..]
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            if !digits.is_empty() && text[start + 3 + digits.len()..].starts_with('#') {
                return Some(format!("{}{digits}", &prefix[1..]));
            }
        }
    }
    let id = message_id?;
    for prefix in ["h-", "m-"] {
        if let Some(rest) = id.strip_prefix(prefix) {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            let after = &rest[digits.len()..];
            if !digits.is_empty() && (after.is_empty() || after.starts_with('-')) {
                return Some(format!("{prefix}{digits}"));
            }
        }
    }
    None
}

/// How many messages drew each class.
pub fn tally<'a>(drawn: impl Iterator<Item = &'a Hostile>) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for h in drawn {
        for c in &h.classes {
            *counts.entry(*c).or_default() += 1;
        }
    }
    counts
}
