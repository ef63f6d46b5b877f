//! All SQL of the parking table `dead_letters`, where warren keeps what can never be inserted
//! (the DLQ consumer's refusals, and messages that cannot be republished). Parking succeeds
//! whenever the database takes rows at all: text PostgreSQL cannot store (U+0000) is escaped,
//! reasons are capped, and a row the database refuses for ITSELF (data and integrity errors,
//! classes 22 and 23, and codes nobody classified, such as a trigger's P0001) is parked without
//! its headers, then without its message id too. An error about the moment or the server (a
//! timeout, a lock, a deadlock, a read-only server, no connection) or the deployment (a missing
//! table) fails the park and the caller gives the messages back to their queue: a fallback row
//! then would be a second row of a message already parked. Parking is
//! idempotent: one row per message, found by its fingerprint (message id, body and the
//! publisher's own headers, [`fingerprint`]; computed here,
//! so a row parked without its id keeps it), re-opened if the message comes back after a
//! replay. A park streams its rows in (binary `COPY` into a temporary table, [`PIECE`] bytes at
//! a time, then one `INSERT ... ON CONFLICT` from it), so a body of any size is never copied
//! whole. Besides the park: the reads of `dlq parked list` and of the API's `GET` (a message's
//! parked fate), and the locked select and the mark of `dlq parked replay`. Like every statement
//! of warren's, they name the table unqualified: the connection's search path is
//! `DATABASE_SCHEMA` ([`super::DbConfig::pg_config`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use serde_json::Value;
use tokio_postgres::{Client, Transaction};

use super::{DbError, ErrorClass, Statements, abandon};

/// Longest reason stored, in bytes (cut on a character boundary).
pub const REASON_MAX: usize = 1024;

/// One message to park.
#[derive(Debug, Clone)]
pub struct ParkRow<'a> {
    /// The pipeline it belongs to (a replay sends it back there).
    pub pipeline: &'a str,
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

/// The rows of one park, streamed in before they are parked (`COPY ... FROM STDIN`): dropped
/// with the transaction that made it.
const STAGE: &str = "BEGIN; CREATE TEMPORARY TABLE warren_park \
     (p text, m text, b bytea, h jsonb, k text, r text, f bytea) ON COMMIT DROP";

/// The stream of a park's rows into [`STAGE`]'s table, in PostgreSQL's binary copy format.
const COPY: &str = "COPY warren_park (p, m, b, h, k, r, f) FROM STDIN (FORMAT binary)";

/// The park itself, from the streamed rows, and its commit.
const PARK: &str = "INSERT INTO dead_letters \
     (pipeline, message_id, body, headers, error_kind, error_reason, fingerprint) \
     SELECT p, m, b, h, k, r, f FROM warren_park \
     ON CONFLICT (pipeline, fingerprint) DO UPDATE SET \
       replayed_at = NULL, error_kind = EXCLUDED.error_kind, \
       error_reason = EXCLUDED.error_reason, headers = EXCLUDED.headers, \
       parked_at = now(), park_count = dead_letters.park_count + 1 \
     WHERE dead_letters.replayed_at IS NOT NULL; COMMIT";

/// Bytes of a park's rows sent to the server in one piece at most: beside the deliveries it
/// parks, a park holds about twice this (the piece, and the connection's write buffer, whose
/// capacity the connection keeps), whatever the bodies' sizes. Bound as statement parameters,
/// a park held its rows twice more (the bind message, and the connection's buffer that kept its
/// capacity for good): a 100 MiB body took the DLQ stage past a 256 MiB limit, and a batch of
/// 64 KiB bodies held four to five times the byte budget (review F1, F3).
pub const PIECE: usize = 1 << 20;

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
    crate::text::capped(&storable(reason), REASON_MAX).into_owned()
}

/// The fingerprint of a message (its parking row's identity): SHA-256 of the stored message id
/// (empty without one), a zero byte, and the body, the same as the migration's
/// `sha256(convert_to(coalesce(message_id, ''), 'UTF8') || '\\x00' || body)`; then, when the
/// message carries headers of its publisher's, a zero byte, `headers` and their canonical JSON
/// (keys sorted). The stamps warren and the broker add as a message travels (see
/// [`is_stamp`]) are left out, so every copy of one message (a redelivery, another DLQ attempt,
/// a replay that failed again) has the same fingerprint, while two messages that differ in a
/// header of their own (a tenant, a trace id) park as two rows.
pub fn fingerprint(message_id: Option<&str>, body: &[u8], headers: &Value) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    hash.update(storable(message_id.unwrap_or_default()).as_bytes());
    hash.update([0u8]);
    hash.update(body);
    if let Value::Object(map) = headers {
        let own: std::collections::BTreeMap<&String, &Value> =
            map.iter().filter(|(k, _)| !is_stamp(k)).collect();
        if !own.is_empty() {
            hash.update([0u8]);
            hash.update(b"headers");
            let mut text = String::new();
            for (k, v) in own {
                canonical(&Value::String(k.clone()), &mut text);
                text.push(':');
                canonical(v, &mut text);
                text.push(',');
            }
            hash.update(text.as_bytes());
        }
    }
    hash.finalize().to_vec()
}

/// Whether a header is a stamp of warren's or the broker's rather than the publisher's:
/// `x-retries`, `x-retry-reason`, `x-dlq-attempts`, `x-error-*`, `x-original-*` (what warren
/// moved aside), `x-warren-*` (the original's exchange, routing key and properties), `x-death`, `x-first-death-*`, `x-last-death-*` (amqp::headers and
/// amqp::republish name them), and a quorum queue's `x-delivery-count`.
fn is_stamp(key: &str) -> bool {
    matches!(
        key,
        "x-retries" | "x-retry-reason" | "x-dlq-attempts" | "x-death" | "x-delivery-count"
    ) || [
        "x-error-",
        "x-original-",
        "x-first-death-",
        "x-last-death-",
        "x-warren-",
    ]
    .iter()
    .any(|p| key.starts_with(p))
}

/// `value` as JSON with every object's keys sorted, whatever order the map keeps.
fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let sorted: std::collections::BTreeMap<&String, &Value> = map.iter().collect();
            out.push('{');
            for (k, v) in sorted {
                canonical(&Value::String(k.clone()), out);
                out.push(':');
                canonical(v, out);
                out.push(',');
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for v in items {
                canonical(v, out);
                out.push(',');
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// How much of a row a park statement keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Everything.
    All,
    /// Body, message id, kind and reason: the headers were refused.
    NoHeaders,
    /// Body, kind and reason: the message id was refused too.
    Bare,
}

/// Whether the database refused a park for the rows themselves, so that a smaller row may be
/// taken: a permanent error (classes 22 and 23), or one nobody classified that a row may cause
/// (the sink splits batches on the same rule, [`DbError::may_be_row_specific`]). Errors about
/// the moment (08, 25, 40, 53, 57, 58) or the deployment (42, 28, 3D) are not.
fn refused_for_data(e: &DbError) -> bool {
    e.class() == ErrorClass::Permanent || e.may_be_row_specific()
}

/// Parks `rows` (one statement; row by row if the database refuses their data). Fails when the
/// database does not take the rows at all (no connection, a timeout, a lock, a read-only
/// server), or refuses even a row's bare body and reason: then nothing is lost, the caller
/// gives the messages back to their queue. Each statement is entered in the stage's
/// `statements`, so its stop can cancel a park still waiting (on a lock, a slow server).
pub async fn park(
    pool: &Pool,
    bound: Duration,
    statements: &Arc<Statements>,
    rows: &[ParkRow<'_>],
) -> Result<Parked, DbError> {
    // The same message twice in one statement would trip ON CONFLICT: park each once. Each
    // fingerprint is computed once (a body may be 128 MiB).
    let mut seen = HashSet::with_capacity(rows.len());
    let unique: Vec<(&ParkRow, Vec<u8>)> = rows
        .iter()
        .map(|r| (r, fingerprint(r.message_id, r.body, &r.headers)))
        .filter(|(r, f)| seen.insert((r.pipeline, f.clone())))
        .collect();
    match insert(pool, bound, statements, &unique, Keep::All).await {
        Ok(()) => {
            return Ok(Parked {
                rows: rows.len(),
                bare: 0,
            });
        }
        Err(e) if refused_for_data(&e) => {
            if unique.len() > 1 {
                tracing::warn!(error = %e, rows = unique.len(), "park statement refused; parking row by row");
            }
        }
        Err(e) => return Err(e),
    }
    let mut bare = 0;
    for row in unique {
        let mut keep = Keep::All;
        loop {
            match insert(pool, bound, statements, std::slice::from_ref(&row), keep).await {
                Ok(()) => break,
                Err(e) if refused_for_data(&e) && keep != Keep::Bare => {
                    tracing::error!(message_id = row.0.message_id.unwrap_or("-"), error = %e,
                        "row refused by the parking table; parking less of it");
                    keep = if keep == Keep::All {
                        Keep::NoHeaders
                    } else {
                        Keep::Bare
                    };
                }
                Err(e) => return Err(e),
            }
        }
        if keep != Keep::All {
            bare += 1;
        }
    }
    Ok(Parked {
        rows: rows.len(),
        bare,
    })
}

/// A row's columns as parked, keeping what `keep` says: (message id, headers, reason).
fn kept<'a>(
    row: &'a ParkRow<'_>,
    keep: Keep,
) -> (Option<std::borrow::Cow<'a, str>>, Value, String) {
    match keep {
        Keep::All => (
            row.message_id.map(storable),
            storable_json(row.headers.clone()),
            stored_reason(row.reason),
        ),
        Keep::NoHeaders => (
            row.message_id.map(storable),
            Value::Object(Default::default()),
            stored_reason(&format!(
                "parked without its headers (the database refused them); {}",
                row.reason
            )),
        ),
        Keep::Bare => (
            None,
            Value::Object(Default::default()),
            stored_reason(&format!(
                "parked without message id and headers (the database refused them); {}",
                row.reason
            )),
        ),
    }
}

/// `rows` in PostgreSQL's binary copy format, handed to `send` in pieces of about [`PIECE`]
/// bytes: a body is cut into pieces, never copied whole.
struct CopyOut {
    buf: bytes::BytesMut,
}

impl CopyOut {
    /// The format's signature, flags and header extension.
    fn new() -> Self {
        let mut buf = bytes::BytesMut::with_capacity(4096);
        buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
        buf.extend_from_slice(&0i32.to_be_bytes());
        buf.extend_from_slice(&0i32.to_be_bytes());
        Self { buf }
    }

    /// What is written so far, once it reached a piece (or `all`).
    fn piece(&mut self, all: bool) -> Option<bytes::Bytes> {
        (self.buf.len() >= PIECE || (all && !self.buf.is_empty()))
            .then(|| self.buf.split().freeze())
    }

    fn tuple(&mut self, fields: i16) {
        self.buf.extend_from_slice(&fields.to_be_bytes());
    }

    /// One field: NULL, or its length and bytes.
    fn field(&mut self, data: Option<&[u8]>) {
        match data {
            None => self.buf.extend_from_slice(&(-1i32).to_be_bytes()),
            Some(d) => {
                self.buf.extend_from_slice(&(d.len() as i32).to_be_bytes());
                self.buf.extend_from_slice(d);
            }
        }
    }

    fn trailer(&mut self) {
        self.buf.extend_from_slice(&(-1i16).to_be_bytes());
    }
}

/// Streams `rows` into the park's table through `sink`, about a [`PIECE`] at a time.
async fn stream_rows(
    client: &deadpool_postgres::Client,
    rows: &[(&ParkRow<'_>, Vec<u8>)],
    keep: Keep,
) -> Result<(), DbError> {
    use futures::SinkExt;
    let sink = client
        .copy_in::<_, bytes::Bytes>(COPY)
        .await
        .map_err(DbError::from_pg)?;
    futures::pin_mut!(sink);
    let mut out = CopyOut::new();
    for (row, fingerprint) in rows {
        let (id, headers, reason) = kept(row, keep);
        // jsonb's binary form: a version byte, then the text (a `Value` always writes).
        let mut json = vec![1u8];
        json.extend(serde_json::to_vec(&headers).unwrap_or_else(|_| b"{}".to_vec()));
        out.tuple(7);
        out.field(Some(row.pipeline.as_bytes()));
        out.field(id.as_deref().map(str::as_bytes));
        // The body in pieces: never a second copy of all of it. (The broker's bodies are at
        // most 512 MiB; a length past i32 would be refused by the server as bad copy data.)
        let body = row.body;
        let len = i32::try_from(body.len()).unwrap_or(i32::MAX);
        out.buf.extend_from_slice(&len.to_be_bytes());
        for part in body.chunks(PIECE) {
            out.buf.extend_from_slice(part);
            if let Some(piece) = out.piece(false) {
                sink.send(piece).await.map_err(DbError::from_pg)?;
            }
        }
        out.field(Some(&json));
        out.field(Some(storable(row.kind).as_bytes()));
        out.field(Some(reason.as_bytes()));
        out.field(Some(fingerprint));
        if let Some(piece) = out.piece(false) {
            sink.send(piece).await.map_err(DbError::from_pg)?;
        }
    }
    out.trailer();
    if let Some(piece) = out.piece(true) {
        sink.send(piece).await.map_err(DbError::from_pg)?;
    }
    sink.finish().await.map_err(DbError::from_pg)?;
    Ok(())
}

/// One park for `rows` (each with its fingerprint), keeping what `keep` says of each: in one
/// transaction, the rows streamed into a temporary table (binary `COPY`, a [`PIECE`] at a
/// time), then parked from it with one statement.
async fn insert(
    pool: &Pool,
    bound: Duration,
    statements: &Arc<Statements>,
    rows: &[(&ParkRow<'_>, Vec<u8>)],
    keep: Keep,
) -> Result<(), DbError> {
    let client = pool.get().await.map_err(DbError::from_pool)?;
    let running = statements.enter(&client)?;
    // Err((error, ended)): `ended` says whether the transaction was rolled back.
    let work = async {
        let result = match client.batch_execute(STAGE).await {
            Ok(()) => match stream_rows(&client, rows, keep).await {
                Ok(()) => client.batch_execute(PARK).await.map_err(DbError::from_pg),
                Err(e) => Err(e),
            },
            Err(e) => Err(DbError::from_pg(e)),
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) => Err((e, client.batch_execute("ROLLBACK").await.is_ok())),
        }
    };
    let done = tokio::time::timeout(bound, work).await;
    drop(running);
    match done {
        Ok(Ok(())) => Ok(()),
        Ok(Err((e, true))) => {
            let result = Err(e);
            super::release(pool, client, &result);
            result
        }
        // A connection whose transaction could not be ended is never used again.
        Ok(Err((e, false))) => {
            drop(deadpool_postgres::Object::take(client));
            Err(e)
        }
        Err(_) => Err(abandon(client, bound)),
    }
}

/// A limit as SQL takes it (`LIMIT $n` is a `bigint`): beyond `i64::MAX` is no limit.
fn sql_limit(limit: u64) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// Of `fingerprints` (see [`fingerprint`]), those `pipeline` has a row of (open or replayed),
/// asked within `bound`: a stage a reload started in the place of one that parked under
/// another name asks it of that name's rows before parking a redelivery again.
pub async fn parked_of(
    pool: &Pool,
    bound: Duration,
    statements: &Arc<Statements>,
    pipeline: &str,
    fingerprints: &[Vec<u8>],
) -> Result<HashSet<Vec<u8>>, DbError> {
    let client = pool.get().await.map_err(DbError::from_pool)?;
    let running = statements.enter(&client)?;
    let asked = tokio::time::timeout(
        bound,
        client.query(
            "SELECT fingerprint FROM dead_letters \
             WHERE pipeline = $1 AND fingerprint = ANY($2::bytea[])",
            &[&pipeline, &fingerprints],
        ),
    )
    .await;
    drop(running);
    match asked {
        Ok(result) => {
            let result = result.map_err(DbError::from_pg);
            super::release(pool, client, &result);
            Ok(result?.iter().map(|r| r.get::<_, Vec<u8>>(0)).collect())
        }
        Err(_) => Err(abandon(client, bound)),
    }
}

/// Fails when the table cannot be read (missing, or not readable by this role); reads no row.
/// For work that must not start otherwise (a replay checks it before it touches the broker).
pub async fn check(client: &Client) -> Result<(), tokio_postgres::Error> {
    client
        .query_one("SELECT count(*) FROM dead_letters WHERE false", &[])
        .await
        .map(drop)
}

/// How many rows of `pipeline` are open (parked, not replayed), of `kind` only when given.
pub async fn count_open(
    client: &Client,
    pipeline: &str,
    kind: Option<&str>,
) -> Result<i64, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT count(*) FROM dead_letters \
             WHERE replayed_at IS NULL AND ($1::text IS NULL OR error_kind = $1) \
               AND pipeline = $2",
            &[&kind, &pipeline],
        )
        .await
        .and_then(|r| r.try_get(0))
}

/// An open row as `dlq parked list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The row's key: the order rows were parked in.
    pub seq: i64,
    /// The AMQP message id, if it had one (and the database took it).
    pub message_id: Option<String>,
    /// `error_kind`.
    pub kind: String,
    /// `error_reason`.
    pub reason: String,
    /// `parked_at` in UTC, `YYYY-MM-DD HH:MM:SS`.
    pub parked_at: String,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

/// The newest `limit` open rows of `pipeline` (of `kind` only, when given), newest first.
pub async fn list_open(
    client: &Client,
    pipeline: &str,
    kind: Option<&str>,
    limit: u64,
) -> Result<Vec<Listed>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT seq, message_id, error_kind, error_reason, \
                    to_char(parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'), body \
             FROM dead_letters \
             WHERE replayed_at IS NULL AND ($1::text IS NULL OR error_kind = $1) \
               AND pipeline = $3 \
             ORDER BY seq DESC LIMIT $2",
            &[&kind, &sql_limit(limit), &pipeline],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(Listed {
                seq: r.try_get(0)?,
                message_id: r.try_get(1)?,
                kind: r.try_get(2)?,
                reason: r.try_get(3)?,
                parked_at: r.try_get(4)?,
                body: r.try_get(5)?,
            })
        })
        .collect()
}

/// An open row locked for a replay ([`lock_for_replay`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ToReplay {
    /// The row's key, to mark it replayed ([`mark_replayed`]).
    pub seq: i64,
    /// The AMQP message id, if it had one.
    pub message_id: Option<String>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
    /// The AMQP headers as parked (JSON); `Err` when the column holds what warren cannot read
    /// back (a row written by another program: a number beyond a double), said for this row
    /// alone.
    pub headers: Result<Value, UnreadableHeaders>,
}

/// A parked row's `headers` column that is no JSON warren can read back (a row written by
/// another program: a number beyond a double); the parser's words, which name no value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("its headers cannot be read back: {reason}")]
pub struct UnreadableHeaders {
    /// What the JSON parser said (a position and what it expected).
    pub reason: String,
}

/// Locks and returns up to `limit` open rows of `pipeline` (of `kind` only, when given) after
/// `seq` `after`, oldest first, skipping rows another transaction holds. They stay locked until
/// `tx` ends: two replays never send the same row, and a re-park of a row (`ON CONFLICT .. DO
/// UPDATE SET replayed_at = NULL .. WHERE replayed_at IS NOT NULL`) waits for the commit of
/// [`mark_replayed`] and then re-opens it instead of being overwritten by a late mark.
pub async fn lock_for_replay(
    tx: &Transaction<'_>,
    pipeline: &str,
    kind: Option<&str>,
    after: i64,
    limit: u64,
) -> Result<Vec<ToReplay>, tokio_postgres::Error> {
    let rows = tx
        .query(
            "SELECT seq, message_id, body, headers::text FROM dead_letters \
             WHERE replayed_at IS NULL AND seq > $1 AND ($2::text IS NULL OR error_kind = $2) \
               AND pipeline = $4 \
             ORDER BY seq LIMIT $3 FOR UPDATE SKIP LOCKED",
            &[&after, &kind, &sql_limit(limit), &pipeline],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(ToReplay {
                seq: r.try_get(0)?,
                message_id: r.try_get(1)?,
                body: r.try_get(2)?,
                headers: match r.try_get::<_, Option<String>>(3)? {
                    None => Ok(Value::Null),
                    Some(text) => serde_json::from_str(&text).map_err(|e| UnreadableHeaders {
                        reason: e.to_string(),
                    }),
                },
            })
        })
        .collect()
}

/// Marks the rows `seqs` replayed, in `tx` (which the caller commits); returns how many rows
/// changed.
pub async fn mark_replayed(
    tx: &Transaction<'_>,
    seqs: &[i64],
) -> Result<u64, tokio_postgres::Error> {
    tx.execute(
        "UPDATE dead_letters SET replayed_at = now() WHERE seq = ANY($1)",
        &[&seqs],
    )
    .await
}

/// What became of a message that was parked and not replayed (the API's answer for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fate {
    /// `error_kind`.
    pub kind: String,
    /// `error_reason`.
    pub reason: String,
    /// `parked_at` in UTC, RFC 3339 with microseconds: `2024-05-01T12:00:00.000000Z`.
    pub parked_at: String,
}

/// The newest open row with message id `message_id` (of `pipeline` only, when given).
pub async fn open_fate(
    client: &Client,
    pipeline: Option<&str>,
    message_id: &str,
) -> Result<Option<Fate>, tokio_postgres::Error> {
    let parked = client
        .query_opt(
            "SELECT error_kind, error_reason, \
             to_char(parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
             FROM dead_letters WHERE message_id = $1 AND replayed_at IS NULL \
             AND ($2::text IS NULL OR pipeline = $2) ORDER BY seq DESC LIMIT 1",
            &[&message_id, &pipeline],
        )
        .await?;
    parked
        .map(|row| {
            Ok(Fate {
                kind: row.try_get(0)?,
                reason: row.try_get(1)?,
                parked_at: row.try_get(2)?,
            })
        })
        .transpose()
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
    fn a_fingerprint_is_the_migrations_hash_and_keeps_the_id() {
        // sha256('m1' || '\x00' || 'body'), as PostgreSQL computes it in V3, for a message
        // without headers of its publisher's (none, or only stamps).
        let none = serde_json::json!({});
        let f = fingerprint(Some("m1"), b"body", &none);
        let mut input = b"m1".to_vec();
        input.push(0);
        input.extend_from_slice(b"body");
        use sha2::Digest;
        assert_eq!(f, sha2::Sha256::digest(&input).to_vec());
        assert_eq!(f, fingerprint(Some("m1"), b"body", &Value::Null));
        let stamps = serde_json::json!({"x-retries": 3, "x-error-kind": "invalid_json",
            "x-dlq-attempts": 2, "x-death": [{"count": 1}], "x-original-expiration": "4000",
            "x-delivery-count": 3,
            "x-first-death-queue": "q"});
        assert_eq!(
            f,
            fingerprint(Some("m1"), b"body", &stamps),
            "stamps are not identity"
        );
        assert_ne!(f, fingerprint(None, b"body", &none));
        assert_eq!(
            fingerprint(None, b"body", &none),
            fingerprint(Some(""), b"body", &none)
        );
    }

    #[test]
    fn a_header_of_the_publishers_tells_two_messages_apart_whatever_its_order() {
        let a = serde_json::json!({"tenant": "a", "x-retries": 1});
        let b = serde_json::json!({"tenant": "b", "x-retries": 1});
        assert_ne!(
            fingerprint(Some("m"), b"x", &a),
            fingerprint(Some("m"), b"x", &b)
        );
        assert_ne!(
            fingerprint(Some("m"), b"x", &a),
            fingerprint(Some("m"), b"x", &serde_json::json!({}))
        );
        let one = serde_json::json!({"k": {"a": 1, "b": [1, {"y": 2, "x": 1}]}, "j": 2});
        let other: Value =
            serde_json::from_str(r#"{"j": 2, "k": {"b": [1, {"x": 1, "y": 2}], "a": 1}}"#).unwrap();
        assert_eq!(
            fingerprint(None, b"x", &one),
            fingerprint(None, b"x", &other),
            "key order is not identity"
        );
    }

    #[test]
    fn only_errors_about_the_row_make_a_smaller_row() {
        let server = |code: &str| DbError::Server {
            code: code.into(),
            message: "x".into(),
        };
        for code in ["22021", "22P05", "23514", "22001", "P0001"] {
            assert!(refused_for_data(&server(code)), "{code}");
        }
        for code in [
            "57014", "40P01", "25006", "57P01", "53300", "42P01", "08006",
        ] {
            assert!(!refused_for_data(&server(code)), "{code}");
        }
        assert!(!refused_for_data(&DbError::Connection("gone".into())));
    }

    #[test]
    fn stored_reasons_are_capped_and_escaped() {
        let r = stored_reason(&"\0".repeat(5000));
        assert!(r.len() <= REASON_MAX);
        assert!(!r.contains('\0'));
    }
}
