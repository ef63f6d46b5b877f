//! The bytes a signature covers and the HMAC-SHA256 over them: the canonical encoding shared by
//! commands and outcomes, the tag, and its constant-time check.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// `CONTROL_SECRET` could not key the HMAC (HMAC takes keys of any length, so this names the
/// setting in case that ever changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CONTROL_SECRET: not usable as an HMAC-SHA256 key ({0})")]
pub struct KeyError(String);

/// A version line, then each present field as `name=<byte length>:<value>` and a newline: the
/// length prefixes make the encoding unambiguous whatever the values hold.
pub(super) fn encode<'a>(
    version: &str,
    fields: impl IntoIterator<Item = Option<(&'a str, &'a str)>>,
) -> Vec<u8> {
    let mut out = format!("{version}\n").into_bytes();
    for (name, value) in fields.into_iter().flatten() {
        out.extend_from_slice(format!("{name}={}:", value.len()).as_bytes());
        out.extend_from_slice(value.as_bytes());
        out.push(b'\n');
    }
    out
}

/// The HMAC-SHA256 of `bytes` under `secret`.
fn mac(secret: &str, bytes: &[u8]) -> Result<Hmac<Sha256>, KeyError> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes())
        .map_err(|e| KeyError(e.to_string()))?;
    mac.update(bytes);
    Ok(mac)
}

/// Lower-case hex of the HMAC of `bytes` under `secret`.
pub(super) fn tag(secret: &str, bytes: &[u8]) -> Result<String, KeyError> {
    let tag = mac(secret, bytes)?.finalize().into_bytes();
    Ok(tag.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `signature` (hex, either case) is the HMAC of `bytes` under `secret`, compared in
/// constant time.
pub(super) fn verifies(secret: &str, bytes: &[u8], signature: Option<&str>) -> bool {
    let Some(tag) = signature.and_then(from_hex) else {
        return false;
    };
    mac(secret, bytes).is_ok_and(|mac| mac.verify_slice(&tag).is_ok())
}

/// Bytes from lower- or upper-case hex; `None` for anything else.
fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}
