//! All SQL of the parking table `dead_letters`, where the DLQ consumer keeps what can never be
//! inserted. Parking always succeeds while the database answers: text PostgreSQL cannot store
//! (U+0000) is escaped, reasons are capped, a refused batch is parked row by row, and a row that
//! is still refused is parked as its raw body and reason alone. Parking is idempotent: one row
//! per message (message id + body), re-opened if the message comes back after a replay.

use std::collections::HashSet;
use std::time::Duration;

use deadpool_postgres::Pool;
use serde_json::Value;

use super::{DbError, abandon};

/// Longest reason stored, in bytes (cut on a character boundary).
pub const REASON_MAX: usize = 1024;

/// One message to park.
#[derive(Debug, Clone)]
pub struct ParkRow<'a> {
    /// The AMQP message id, if the message had one.
    pub message_id: Option<&'a str>,
    /// The body, byte for byte.
    pub body: &'a [u8],
    /// The AMQP headers as JSON.
    pub headers: Value,
    /// `x-error-kind`.
    pub kind: &'a str,
    /// Why it is parked.
    pub reason: &'a str,
}

/// What a park did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Parked {
    /// Rows given to [`park`] (duplicates of one message count once each).
    pub rows: usize,
    /// Rows that could only be parked as body and reason (their headers were refused).
    pub bare: usize,
}

const PARK: &str = "INSERT INTO dead_letters \
     (message_id, body, headers, error_kind, error_reason, fingerprint) \
     SELECT m, b, h, k, r, sha256(convert_to(coalesce(m, ''), 'UTF8') || '\\x00'::bytea || b) \
     FROM UNNEST($1::text[], $2::bytea[], $3::jsonb[], $4::text[], $5::text[]) AS t(m, b, h, k, r) \
     ON CONFLICT (fingerprint) DO UPDATE SET \
       replayed_at = NULL, error_kind = EXCLUDED.error_kind, \
       error_reason = EXCLUDED.error_reason, headers = EXCLUDED.headers, \
       parked_at = now(), park_count = dead_letters.park_count + 1 \
     WHERE dead_letters.replayed_at IS NOT NULL";

/// Text PostgreSQL can store: U+0000 written as the six characters `\u0000`.
pub fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        text.replace('\0', "\\u0000").into()
    } else {
        text.into()
    }
}

/// A JSON value whose strings and keys PostgreSQL's jsonb accepts.
pub fn storable_json(value: Value) -> Value {
    match value {
        Value::String(s) if s.contains('\0') => Value::String(storable(&s).into_owned()),
        Value::Array(items) => Value::Array(items.into_iter().map(storable_json).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (storable(&k).into_owned(), storable_json(v)))
                .collect(),
        ),
        other => other,
    }
}

/// A reason as stored: escaped and capped at [`REASON_MAX`] bytes.
fn stored_reason(reason: &str) -> String {
    crate::amqp::headers::capped(&storable(reason), REASON_MAX).into_owned()
}

/// Parks `rows` (one statement; row by row if the database refuses it). Fails only when the
/// database does not answer, or refuses even a row's bare body and reason: then nothing is
/// lost, the caller gives the messages back to their queue.
pub async fn park(pool: &Pool, bound: Duration, rows: &[ParkRow<'_>]) -> Result<Parked, DbError> {
    // The same message twice in one statement would trip ON CONFLICT: park each once.
    let mut seen = HashSet::with_capacity(rows.len());
    let unique: Vec<&ParkRow> = rows
        .iter()
        .filter(|r| seen.insert((r.message_id, r.body)))
        .collect();
    match insert(pool, bound, &unique, false).await {
        Ok(()) => {
            return Ok(Parked {
                rows: rows.len(),
                bare: 0,
            });
        }
        Err(e @ DbError::Server { .. }) => {
            if unique.len() > 1 {
                tracing::warn!(error = %e, rows = unique.len(), "park statement refused; parking row by row");
            }
        }
        Err(e) => return Err(e),
    }
    let mut bare = 0;
    for row in unique {
        match insert(pool, bound, &[row], false).await {
            Ok(()) => {}
            Err(e @ DbError::Server { .. }) => {
                tracing::error!(message_id = row.message_id.unwrap_or("-"), error = %e,
                    "row refused by the parking table; parking its body and reason alone");
                insert(pool, bound, &[row], true).await?;
                bare += 1;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Parked {
        rows: rows.len(),
        bare,
    })
}

/// One park statement for `rows`; `bare` keeps only body, kind and reason (the last resort).
async fn insert(
    pool: &Pool,
    bound: Duration,
    rows: &[&ParkRow<'_>],
    bare: bool,
) -> Result<(), DbError> {
    let mut ids: Vec<Option<String>> = Vec::with_capacity(rows.len());
    let mut bodies: Vec<&[u8]> = Vec::with_capacity(rows.len());
    let mut headers: Vec<Value> = Vec::with_capacity(rows.len());
    let mut kinds: Vec<String> = Vec::with_capacity(rows.len());
    let mut reasons: Vec<String> = Vec::with_capacity(rows.len());
    for r in rows {
        bodies.push(r.body);
        kinds.push(storable(r.kind).into_owned());
        if bare {
            ids.push(None);
            headers.push(Value::Object(Default::default()));
            reasons.push(stored_reason(&format!(
                "parked without message id and headers (the database refused them); {}",
                r.reason
            )));
        } else {
            ids.push(r.message_id.map(|m| storable(m).into_owned()));
            headers.push(storable_json(r.headers.clone()));
            reasons.push(stored_reason(r.reason));
        }
    }
    let client = pool.get().await.map_err(DbError::from_pool)?;
    let work = async {
        let statement = client
            .prepare_cached(PARK)
            .await
            .map_err(DbError::from_pg)?;
        client
            .execute(&statement, &[&ids, &bodies, &headers, &kinds, &reasons])
            .await
            .map_err(DbError::from_pg)?;
        Ok(())
    };
    match tokio::time::timeout(bound, work).await {
        Ok(result) => result,
        Err(_) => Err(abandon(client, bound)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_escaped_in_text_keys_and_nested_values() {
        assert_eq!(storable("a\0b"), "a\\u0000b");
        assert_eq!(storable("plain"), "plain");
        let json = serde_json::json!({"k\0": ["x\0", {"y": "z\0"}], "n": 1});
        let clean = storable_json(json);
        assert_eq!(clean["k\\u0000"][0], "x\\u0000");
        assert_eq!(clean["k\\u0000"][1]["y"], "z\\u0000");
        assert_eq!(clean["n"], 1);
    }

    #[test]
    fn stored_reasons_are_capped_and_escaped() {
        let r = stored_reason(&"\0".repeat(5000));
        assert!(r.len() <= REASON_MAX);
        assert!(!r.contains('\0'));
    }
}
