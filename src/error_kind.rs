//! The kinds of failure a message is dead-lettered or parked for ([`ErrorKind`]): one list,
//! below every other module, since the stages, the metrics (a label per kind), the database's
//! parking table, the API's answers and `warren dlq` all name them. `domain` re-exports it.

/// Why a message was dead-lettered or parked, as written in `x-error-kind` and the parking
/// table: the one list of kinds (metrics, the API's answers and `warren dlq` use it too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Empty, not UTF-8, or not JSON.
    InvalidJson,
    /// JSON of the wrong shape or types, values that fail validation, or over the size limit.
    InvalidPayload,
    /// The database refused the row for good (a constraint, a value it cannot store).
    DbPermanent,
    /// The record's id is stored with other content.
    IdConflict,
    /// Transient failures outlasted `MAX_RETRIES` (or `DLQ_MAX_ATTEMPTS` in the DLQ consumer).
    RetriesExhausted,
    /// warren could not republish it (to the retry queue or the DLQ): its properties need a
    /// larger frame than the link allows, or the broker refused to take it. Parked directly.
    Unpublishable,
}

impl ErrorKind {
    /// Every kind, in the order they are documented.
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::InvalidJson,
        ErrorKind::InvalidPayload,
        ErrorKind::DbPermanent,
        ErrorKind::IdConflict,
        ErrorKind::RetriesExhausted,
        ErrorKind::Unpublishable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidJson => "invalid_json",
            ErrorKind::InvalidPayload => "invalid_payload",
            ErrorKind::DbPermanent => "db_permanent",
            ErrorKind::IdConflict => "id_conflict",
            ErrorKind::RetriesExhausted => "retries_exhausted",
            ErrorKind::Unpublishable => "unpublishable",
        }
    }

    /// The kind written as `text`, if it is one of warren's.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// Whether the message itself is at fault (the body), as opposed to the database.
    pub fn is_invalid_input(self) -> bool {
        matches!(self, ErrorKind::InvalidJson | ErrorKind::InvalidPayload)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
