//! The seam between the pipeline core and what it stores: a [`Domain`] decodes and validates a
//! message body into a record and inserts a batch of records with one statement. The core
//! (consume, process, batch, ack, retry, dead-letter) knows nothing else of the data.

pub mod users;

use futures::future::BoxFuture;

use crate::db::DbError;

/// Why a body was refused before it reached the database. Refused messages go straight to the
/// DLQ, with no retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `x-error-kind` of the dead-lettered message.
    pub kind: RejectKind,
    /// Readable text for `x-error-reason`.
    pub reason: String,
}

/// The kinds of refusal, as written in `x-error-kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    /// Empty, not UTF-8, or not JSON.
    InvalidJson,
    /// JSON of the wrong shape or types, values that fail validation, or over the size limit.
    InvalidPayload,
}

impl RejectKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectKind::InvalidJson => "invalid_json",
            RejectKind::InvalidPayload => "invalid_payload",
        }
    }
}

impl Rejection {
    pub fn json(reason: impl Into<String>) -> Self {
        Self {
            kind: RejectKind::InvalidJson,
            reason: reason.into(),
        }
    }

    pub fn payload(reason: impl Into<String>) -> Self {
        Self {
            kind: RejectKind::InvalidPayload,
            reason: reason.into(),
        }
    }
}

/// A kind of data the pipeline can move into PostgreSQL.
pub trait Domain: Send + Sync + 'static {
    /// A decoded, validated message.
    type Record: Send + Sync + Unpin + 'static;

    /// Decodes and validates one body. Must not panic on any input.
    fn decode(&self, body: &[u8]) -> Result<Self::Record, Rejection>;

    /// Inserts `records` with ONE statement, idempotently: a record already stored exactly as
    /// it is counts as done. A record whose key is stored with other content is not done: it is
    /// reported in [`Inserted::conflicts`] (dead-lettered as `id_conflict`), never dropped
    /// silently. The caller commits or splits on error.
    fn insert<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Self::Record],
    ) -> BoxFuture<'a, Result<Inserted, DbError>>;
}

/// What one insert did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Rows that were new.
    pub rows: u64,
    /// Records (by index in the slice given) whose key is already stored with other content,
    /// each with the reason to dead-letter it with.
    pub conflicts: Vec<(usize, String)>,
}

/// The `x-error-kind` of a record whose key is stored with other content.
pub const ID_CONFLICT: &str = "id_conflict";
