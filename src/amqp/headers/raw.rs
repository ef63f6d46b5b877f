//! The raw rest of a header table: past the parser's budget ([`MAX_PARSED_BYTES`]) the AMQP
//! parser (warren's patch of amq-protocol-types) keeps the rest of a top-level table as the raw
//! bytes of its entries, under [`UNPARSED_KEY`]. Here: finding it ([`unparsed`]), stepping
//! over its entries without parsing them, reading one header there (`raw_header`), and
//! rewriting it by key for a copy ([`rewrite_unparsed`]).

use lapin::types::AMQPValue;

#[cfg(doc)]
use super::MAX_PARSED_BYTES;
use super::{SHORT_MAX, UNPARSED_KEY, Unreadable};

/// The raw rest of `table` past the parser's budget ([`UNPARSED_KEY`]), if it has one: the
/// entries as they came on the wire. Only the parser makes it (its value has a form no wire
/// value has: `lapin::types::parsing::unparsed_entries`), and a copy carries it back as those
/// entries (reviews R36e F1: a publisher's own `x-unparsed-entries` was read as the rest, its
/// header columns given values the message did not carry; R36f F3: a copy carried the rest as
/// one byte-array entry, and a header column read from the copy was NULL).
pub fn unparsed(table: &lapin::types::FieldTable) -> Option<&[u8]> {
    table
        .inner()
        .get(UNPARSED_KEY)
        .and_then(lapin::types::parsing::as_unparsed_entries)
}

/// The entries of a raw rest ([`unparsed`]) one after the other: each one's key bytes and the
/// whole entry's bytes (key, type octet and value), as the parser left them; `Err` at the first
/// that is not well-formed.
fn raw_entries(raw: &[u8]) -> impl Iterator<Item = Result<(&[u8], &[u8]), Unreadable>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= raw.len() {
            return None;
        }
        let entry = raw_entry(raw, at);
        match entry {
            Ok((key, end)) => {
                let whole = &raw[at..end];
                at = end;
                Some(Ok((key, whole)))
            }
            Err(e) => {
                at = raw.len();
                Some(Err(e))
            }
        }
    })
}

/// The entry of `raw` at `at`: its key's bytes and where it ends.
fn raw_entry(raw: &[u8], at: usize) -> Result<(&[u8], usize), Unreadable> {
    let key_len = usize::from(raw[at]);
    let key = raw.get(at + 1..at + 1 + key_len).ok_or(Unreadable)?;
    let ty_at = at + 1 + key_len;
    let ty = *raw.get(ty_at).ok_or(Unreadable)?;
    let length = |at: usize| -> Result<usize, Unreadable> {
        let bytes = raw.get(at..at + 4).ok_or(Unreadable)?;
        let n = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        Ok(4 + n as usize)
    };
    // The value's size on the wire, by the type octets lapin's parser reads (RabbitMQ's).
    let size = match ty {
        b'V' => 0,
        b't' | b'b' | b'B' => 1,
        b's' | b'U' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'D' => 5,
        b'L' | b'l' | b'd' | b'T' => 8,
        b'S' | b'x' | b'A' | b'F' => length(ty_at + 1)?,
        _ => return Err(Unreadable),
    };
    let end = ty_at + 1 + size;
    if end > raw.len() {
        return Err(Unreadable);
    }
    Ok((key, end))
}

/// What a copy does with an entry of a raw rest ([`rewrite_unparsed`]).
pub enum RawEntry {
    Keep,
    Drop,
    /// Kept under another key.
    Rename(String),
}

/// `raw` (a raw rest, [`unparsed`]) with each entry kept, dropped or renamed as `policy` says of
/// its key (as the parser reads keys: bytes that are not UTF-8 decoded lossily), its value's
/// bytes untouched: how a copy applies the republish policy to entries the parser did not
/// read. `Err` when the rest is not well-formed (the copy then carries it as it is).
pub fn rewrite_unparsed(
    raw: &[u8],
    policy: impl Fn(&str) -> RawEntry,
) -> Result<Vec<u8>, Unreadable> {
    let mut out = Vec::with_capacity(raw.len());
    for entry in raw_entries(raw) {
        let (key, whole) = entry?;
        let name = String::from_utf8_lossy(key);
        match policy(&name) {
            RawEntry::Keep => out.extend_from_slice(whole),
            RawEntry::Drop => {}
            RawEntry::Rename(to) => {
                let to = &to.as_bytes()[..to.len().min(SHORT_MAX)];
                out.push(to.len() as u8);
                out.extend_from_slice(to);
                out.extend_from_slice(&whole[1 + key.len()..]);
            }
        }
    }
    Ok(out)
}

/// The value of the last entry named `name` in `raw`, AMQP table entries one after the other
/// (a short string key, a type octet, the value), as the parser leaves them past its budget.
pub(super) fn raw_header(raw: &[u8], name: &str) -> Result<Option<AMQPValue>, Unreadable> {
    let mut found: Option<(u8, &[u8])> = None;
    for entry in raw_entries(raw) {
        let (key, whole) = entry?;
        if key_is(key, name) {
            let value = &whole[1 + key.len()..];
            found = Some((value[0], value));
        }
    }
    let Some((ty, value)) = found else {
        return Ok(None);
    };
    Ok(Some(match ty {
        // A container is not parsed here (its content could be any size once parsed).
        b'A' | b'F' => AMQPValue::ByteArray(value[5..].to_vec().into()),
        _ => match lapin::types::parsing::parse_value(value) {
            Ok(([], v)) => v,
            _ => return Err(Unreadable),
        },
    }))
}

/// Whether a raw entry's key is `name` as the parser reads keys: bytes that are not UTF-8 are
/// decoded lossily (U+FFFD each invalid sequence, `?` when that would pass 255 bytes).
fn key_is(key: &[u8], name: &str) -> bool {
    if let Ok(key) = std::str::from_utf8(key) {
        return key == name;
    }
    let lossy = String::from_utf8_lossy(key);
    if lossy.len() <= SHORT_MAX {
        return lossy == name;
    }
    let mut short = String::with_capacity(key.len());
    for chunk in key.utf8_chunks() {
        short.push_str(chunk.valid());
        if !chunk.invalid().is_empty() {
            short.push('?');
        }
    }
    short == name
}
