//! The seam between the pipeline core and what it stores: a [`Domain`] decodes and validates a
//! message body into a record and inserts a batch of records with one statement. The core
//! (consume, process, batch, ack, retry, dead-letter) knows nothing else of the data. Behind it
//! is one implementation, the declared [`mapping::Mapping`]: every pipeline, the built-in users
//! one included, is a mapping; there is no typed domain per table.

pub mod mapping;

use futures::future::BoxFuture;

use crate::db::error::DbError;

/// Why a body was refused before it reached the database. Refused messages go straight to the
/// DLQ, with no retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `x-error-kind` of the dead-lettered message (`InvalidJson` or `InvalidPayload`).
    pub kind: ErrorKind,
    /// Readable text for `x-error-reason`.
    pub reason: String,
}

pub use crate::error_kind::ErrorKind;

impl Rejection {
    pub fn json(reason: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::InvalidJson,
            reason: reason.into(),
        }
    }

    pub fn payload(reason: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::InvalidPayload,
            reason: reason.into(),
        }
    }
}

/// What a delivered message carries besides its body: its properties, and the exchange and
/// routing key the broker delivered it with (a copy warren republished names its original's in
/// headers: `amqp::headers::origin`).
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    pub properties: &'a lapin::BasicProperties,
    pub exchange: &'a str,
    pub routing_key: &'a str,
}

/// A kind of data the pipeline can move into PostgreSQL.
pub trait Domain: Send + Sync + 'static {
    /// A decoded, validated message.
    type Record: Send + Sync + Unpin + 'static;

    /// Decodes and validates one body. Must not panic on any input.
    fn decode(&self, body: &[u8]) -> Result<Self::Record, Rejection>;

    /// Whether [`Domain::decode_with`] reads the message's header table: when it does not, it
    /// is given the properties without it (a small table is held packed, `amqp::held`, and
    /// rebuilt only for what reads it).
    fn reads_headers(&self) -> bool {
        false
    }

    /// Decodes one message, its properties and where it was delivered from at hand (a mapping
    /// reads columns from headers and properties); the body alone by default.
    fn decode_with(
        &self,
        body: &[u8],
        _envelope: &Envelope<'_>,
    ) -> Result<Self::Record, Rejection> {
        self.decode(body)
    }

    /// The bytes `record` holds in memory, itself and what it owns (counted against
    /// `MAX_INFLIGHT_BYTES` until its batch's statement ends). Its own size by default.
    fn record_bytes(&self, _record: &Self::Record) -> u64 {
        std::mem::size_of::<Self::Record>() as u64
    }

    /// About the most bytes a record decoded from a body of `body` bytes may hold, reserved
    /// against `MAX_INFLIGHT_BYTES` before the body is decoded. Twice the body by default.
    fn record_estimate(&self, body: usize) -> u64 {
        2 * body as u64 + std::mem::size_of::<Self::Record>() as u64
    }

    /// Inserts `records` with ONE statement, idempotently: a record already stored exactly as
    /// it is counts as done, also when another copy of it is being inserted at the same moment
    /// (delivery is at least once: a redelivered copy can meet the first copy's statement still
    /// running, so a unique index must never refuse a record for its own copy). A record whose
    /// key is stored with other content is not done: it is reported in [`Inserted::conflicts`]
    /// (dead-lettered as `id_conflict`), one the database refuses on another unique key in
    /// [`Inserted::refused`] (`db_permanent`), never dropped silently. The caller commits or
    /// splits on error.
    fn insert<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Self::Record],
    ) -> BoxFuture<'a, Result<Inserted, DbError>>;

    /// Whether `record` is already stored exactly as it is (its key holds the same content).
    /// Asked of a record the database refuses on its own: a redelivered copy of a message whose
    /// first copy committed meets a CHECK or trigger added since (PostgreSQL checks constraints
    /// before `ON CONFLICT` sees the duplicate), and is then done, not refused. `false` by
    /// default (a domain that cannot tell refuses as before).
    fn stored<'a>(
        &'a self,
        _client: &'a deadpool_postgres::Client,
        _record: &'a Self::Record,
    ) -> BoxFuture<'a, Result<bool, DbError>> {
        Box::pin(async { Ok(false) })
    }

    /// Of each of `records`, a batch whose statement's outcome is unknown (no answer at a
    /// stop), whether what the table holds already decides it, so that it is done whether or
    /// not that statement committed: stored exactly as it is, or, with versions, older than
    /// what its key holds. Each record [`Domain::stored`] by default.
    fn settled<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Self::Record],
    ) -> BoxFuture<'a, Result<Vec<bool>, DbError>> {
        Box::pin(async move {
            let mut done = Vec::with_capacity(records.len());
            for record in records {
                done.push(self.stored(client, record).await?);
            }
            Ok(done)
        })
    }
}

/// What one insert did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Rows that were new.
    pub rows: u64,
    /// Records (by index in the slice given) whose key is already stored with other content,
    /// each with the reason to dead-letter it with.
    pub conflicts: Vec<(usize, String)>,
    /// Records (by index) not stored because another unique key of theirs belongs to another
    /// record (an email stored under another id), each with the reason: refused for good.
    pub refused: Vec<(usize, String)>,
    /// Records (by index) older than the version their key holds or the batch writes
    /// (`on_conflict = "update"`): acked, changed nothing, counted and evented as `stale`, never
    /// as inserted; each with the reason (the key, its version and the newer one).
    pub stale: Vec<(usize, String)>,
    /// Records (by index) that are deletes (`delete = { field, value }`) and hold: their key's
    /// row and child rows are gone, its tombstone keeps their version (a redelivered delete
    /// included). Acked, counted as `deleted`.
    pub deleted: Vec<usize>,
}

/// The fast path of an idempotent batch insert: `sql` is the plain `INSERT .. SELECT FROM
/// UNNEST(..)` without `ON CONFLICT`. When every row is new (the steady state) it is the whole
/// insert, and a cheaper one for the database than `ON CONFLICT DO NOTHING`, which first probes
/// every unique index for each row and then inserts speculatively (docs/performance.md).
/// `Ok(Some(rows))`: every row was inserted. `Ok(None)`: a unique or exclusion constraint
/// refused a row, so nothing of the statement stays (it is one statement, atomic) and the caller
/// runs its `ON CONFLICT` statement, which tells copies from conflicts. `Err`: anything else,
/// as the `ON CONFLICT` statement would have answered it.
pub async fn insert_if_all_new(
    client: &deadpool_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<u64>, DbError> {
    use tokio_postgres::error::SqlState;
    let statement = client.prepare_cached(sql).await.map_err(DbError::from_pg)?;
    match client.execute(&statement, params).await {
        Ok(rows) => Ok(Some(rows)),
        Err(e)
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION)
                || e.code() == Some(&SqlState::EXCLUSION_VIOLATION) =>
        {
            Ok(None)
        }
        Err(e) => Err(DbError::from_pg(e)),
    }
}
