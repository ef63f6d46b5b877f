//! Database errors and their classification by SQLSTATE: transient (retry), permanent for the
//! row (dead-letter it, spend no retries) or systemic (the deployment is wrong: stop, never
//! dead-letter).

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

/// How a database failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Will likely succeed later: connection loss, serialization failure, deadlock, overload.
    Transient,
    /// This row will fail the same way again: data (22) and integrity (23) errors.
    Permanent,
    /// The deployment is wrong (missing table, privileges, authentication, database): no message
    /// is at fault, so none is dead-lettered.
    Systemic,
}

/// A database failure at warren's boundary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DbError {
    /// An error the server reported, with its SQLSTATE.
    #[error("{message} (SQLSTATE {code})")]
    Server { code: String, message: String },
    /// No connection: refused, dropped, timed out, pool exhausted.
    #[error("{0}")]
    Connection(String),
    /// Never sent: the stage is stopping (its statements were cancelled, or the database did
    /// not answer another batch of the stop). Nothing of it can be stored, unlike a statement
    /// that got no answer (review R47a F5: said "the table cannot say whether it stored them",
    /// and asked about by the stage that followed).
    #[error("not started: {0}")]
    NotStarted(&'static str),
    /// The work ran past warren's own bound on it (the server's `statement_timeout` plus a
    /// margin: several statements each under the server's timeout, one message's huge child
    /// arrays) and was cancelled, while the database answered a question asked right after:
    /// the work is too slow, not the link gone. The server answered, so the DLQ consumer counts
    /// it as an attempt (an outage never counts): otherwise such a message cycled for ever.
    #[error(
        "the statement ran past warren's bound of {bound_ms} ms (DATABASE_STATEMENT_TIMEOUT_MS \
         + 2 s) while the database answered; it was cancelled"
    )]
    Outlasted { bound_ms: u64 },
    /// The configuration cannot work (a bad URL, schema, timeout or pool size).
    #[error("{0}")]
    Config(#[from] super::DbConfigError),
    /// A migration failed.
    #[error("migration failed: {0}")]
    Migration(String),
}

/// The most bytes of a reason ([`DbError::short_reason`]).
pub const REASON_CAP: usize = 1024;

impl DbError {
    pub fn from_pg(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            // Capped as every field from a message is (1 KiB): a trigger or a CHECK may echo
            // the row's values in its message, and this text reaches log lines, events and
            // reasons (found by the review: 30 KB retry lines).
            Some(db) => DbError::Server {
                code: db.code().code().to_string(),
                message: crate::text::shown(db.message()).into_owned(),
            },
            None => DbError::Connection(flatten(&e)),
        }
    }

    pub fn from_pool(e: PoolError) -> Self {
        use deadpool_postgres::TimeoutType;
        // The pool's timeouts in words an operator reads as the cause: a new connection or
        // the check of a pooled one that got no answer is a silent database (a frozen host, a
        // half-open link), as a statement past its bound is.
        match e {
            PoolError::Backend(e) => Self::from_pg(e),
            PoolError::Timeout(TimeoutType::Create) => DbError::Connection(format!(
                "no answer from the database within {} ms while connecting",
                super::POOL_CREATE.as_millis()
            )),
            PoolError::Timeout(TimeoutType::Recycle) => DbError::Connection(format!(
                "no answer from the database within {} ms to the check of a pooled connection",
                super::POOL_RECYCLE.as_millis()
            )),
            PoolError::Timeout(TimeoutType::Wait) => DbError::Connection(format!(
                "no pooled database connection free within {} ms",
                super::POOL_WAIT.as_millis()
            )),
            other => DbError::Connection(format!("pool: {other}")),
        }
    }

    /// The SQLSTATE, when the server sent one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            DbError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            // A DO INSTEAD rule without RETURNING on the table (`cannot perform DELETE RETURNING
            // on relation "order_items"`): the statement cannot work on the table as it is, for
            // the messages that need it; the rest of the batch can (review R45 F1: retried as
            // transient, it opened the breaker and spent every retry tier on each message).
            DbError::Server { .. } if self.is_returning_refused() => ErrorClass::Permanent,
            // An INSERT or UPDATE rule on the table (any kind: a `DO ALSO NOTIFY` audit rule):
            // `INSERT ... ON CONFLICT` cannot run on it at all, for every message alike, until
            // the rule goes: the table's condition, as a missing privilege (review R46b F1:
            // retried as transient, it opened the breaker and parked every message
            // `retries_exhausted`).
            DbError::Server { .. } if self.is_rule_refused() => ErrorClass::Systemic,
            DbError::Server { code, .. } => classify_sqlstate(code),
            DbError::Connection(_) | DbError::NotStarted(_) | DbError::Outlasted { .. } => {
                ErrorClass::Transient
            }
            DbError::Config(_) | DbError::Migration(_) => ErrorClass::Systemic,
        }
    }

    pub fn is_transient(&self) -> bool {
        self.class() == ErrorClass::Transient
    }

    /// Whether a row of the statement may have caused this transient-looking error, so that
    /// splitting the batch can find that row: a code nobody classified (a trigger's P0001,
    /// 54000, 0A000...). Known retry-the-statement codes (40 transaction rollback, 57 operator
    /// intervention, 08 connection), server conditions (53 resources, 58 system) and the
    /// server's state (25: a read-only server refuses every row alike) are about the moment,
    /// not a row: splitting would only multiply the load. A batch failing
    /// with an unclassified code is split like a permanent failure once its in-place retries are
    /// spent, so only the offending row goes on.
    pub fn may_be_row_specific(&self) -> bool {
        match self {
            DbError::Server { code, .. } => {
                !self.is_stale_plan()
                    && classify_sqlstate(code) == ErrorClass::Transient
                    && !["08", "25", "40", "53", "57", "58"]
                        .iter()
                        .any(|class| code.starts_with(class))
            }
            _ => false,
        }
    }

    /// Whether the connection that met this error must not be used again: the server it
    /// reaches takes no writes (25006 read-only transaction: a fenced or demoted primary, a hot
    /// standby) or is going away (57P01-57P03: shut down, crashed, starting or in recovery).
    /// Dropping it lets the pool connect again, and a multi-host `DATABASE_URL` with
    /// `target_session_attrs=read-write` then finds the writable host.
    pub fn discards_connection(&self) -> bool {
        self.sqlstate()
            .is_some_and(|code| code == "25006" || code.starts_with("57P"))
    }

    /// Whether the server refused a statement's `RETURNING` on a table (0A000 `cannot perform
    /// DELETE RETURNING on relation ...`): a DO INSTEAD rule without a RETURNING clause on it.
    pub fn is_returning_refused(&self) -> bool {
        matches!(self, DbError::Server { code, message }
            if code == "0A000" && message.starts_with("cannot perform ")
                && message.contains(" RETURNING on relation "))
    }

    /// Whether the server refused an `INSERT ... ON CONFLICT` for a rule on the table (0A000
    /// `INSERT with ON CONFLICT clause cannot be used with table that has INSERT or UPDATE
    /// rules`).
    pub fn is_rule_refused(&self) -> bool {
        matches!(self, DbError::Server { code, message }
            if code == "0A000"
                && message.contains("cannot be used with table that has INSERT or UPDATE rules"))
    }

    /// Whether the server refused a prepared statement because a table it reads or writes
    /// changed under it (`ALTER TABLE .. ALTER .. TYPE`): 0A000 `cached plan must not change
    /// result type`. The statement, not the row nor the moment, is at fault: it fails the same
    /// way on that connection until prepared again ([`super::replanning`]), so it is neither
    /// retried after a wait nor split to find a row.
    pub fn is_stale_plan(&self) -> bool {
        matches!(self, DbError::Server { code, message }
            if code == "0A000" && message.contains("cached plan must not change result type"))
    }

    /// Whether the work ran out of time: the server's `statement_timeout` (57014, also the code
    /// of a cancel, which warren sends only at a stop) or warren's own bound on it
    /// ([`DbError::Outlasted`]). One slow row (a huge child array, a slow trigger, a lock held
    /// on its key) times out its whole batch, so the sink splits a batch that timed out to find
    /// it (`pipeline/sink.rs`), within a bound of about log2 of the batch's size in timeouts;
    /// it is not [`Self::may_be_row_specific`], which splits only after the in-place retries.
    pub fn is_timeout(&self) -> bool {
        matches!(self, DbError::Outlasted { .. }) || self.sqlstate() == Some("57014")
    }

    /// Whether what the work did is unknown: it outlasted warren's bound (the answer may be
    /// lost on a silent link after the server committed) or the connection failed under it.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, DbError::Outlasted { .. } | DbError::Connection(_))
    }

    /// Whether the server answered (as opposed to no connection at all): with an error, or,
    /// for work that outlasted warren's bound, a question asked right after.
    pub fn server_answered(&self) -> bool {
        matches!(self, DbError::Server { .. } | DbError::Outlasted { .. })
    }

    /// A short reason for headers and logs: `db_error: connection refused`.
    pub fn short_reason(&self) -> String {
        let text = match self {
            DbError::Server { code, message } if self.is_returning_refused() => format!(
                "{code} {message} (a DO INSTEAD rule without RETURNING on that table: warren \
                 needs the rows a statement writes or deletes returned; drop the rule, or, \
                 unless it is conditional, give it a RETURNING clause)"
            ),
            DbError::Server { code, message } if self.is_rule_refused() => format!(
                "{code} {message} (a rule ON INSERT or ON UPDATE of a table warren writes, \
                 created while warren runs: warren writes with INSERT ... ON CONFLICT, which no \
                 such rule allows; drop the rule (a trigger is allowed), and the pipeline goes \
                 on)"
            ),
            DbError::Server { code, message } => format!("{code} {message}"),
            other => other.to_string(),
        };
        let mut reason = format!("db_error: {text}");
        // The 1 KiB every reason is capped at (`x-retry-reason`, `x-error-reason`, parking):
        // cut at 200, warren's own reasons lost their second half, what to do (review R45 F2).
        if reason.len() > REASON_CAP {
            let mut cut = REASON_CAP;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        reason
    }
}

/// An error with its sources, on one line (tokio-postgres hides the io cause in `source`).
fn flatten(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// The class of a SQLSTATE. Unknown codes are treated as transient: a bounded number of
/// retries, then the DLQ, is the safe default for an error nobody has classified.
/// Whether `e` is about the moment, not the statement's rows: a deadlock or serialization
/// failure (40), a cancel or timeout (57), the connection (08, or no answer at all), the
/// server's resources (53, 58) or state (25). A question warren asks in a savepoint (is this
/// copy the same once the table's triggers ran?) that fails so has no answer: the batch is
/// tried again, never the question taken as "not the same" (review R42a F6: a deadlock in the
/// re-insert of copies parked copies `id_conflict` beside their rows).
pub fn of_the_moment(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        Some(db) => ["08", "25", "40", "53", "57", "58"]
            .iter()
            .any(|class| db.code().code().starts_with(class)),
        None => true,
    }
}

pub fn classify_sqlstate(code: &str) -> ErrorClass {
    const TRANSIENT: &[&str] = &[
        "40001", "40P01", "53300", "57P01", "57P02", "57P03", "57014",
    ];
    if code.starts_with("08") || TRANSIENT.contains(&code) {
        return ErrorClass::Transient;
    }
    // 21: a cardinality violation (`ON CONFLICT DO UPDATE command cannot affect row a second
    // time`, 21000) is the rows' doing, the same at every try: a trigger that touches a row the
    // statement upserts later (review R41b F11: retried in place for the whole window first).
    if code.starts_with("21") || code.starts_with("22") || code.starts_with("23") {
        return ErrorClass::Permanent;
    }
    if code.starts_with("42")
        || code.starts_with("28")
        || code == SqlState::INVALID_CATALOG_NAME.code()
    {
        return ErrorClass::Systemic;
    }
    // Resource and system errors (53 out of memory/disk, 58 I/O) are conditions of the server
    // that pass; everything else unknown is retried a bounded number of times.
    ErrorClass::Transient
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review R47a F5: a statement never sent is transient (its messages go back) and its
    /// outcome is known (nothing of it stored), unlike a connection that failed after sending.
    #[test]
    fn a_statement_not_started_stored_nothing() {
        let e = DbError::NotStarted("the stage is stopping and its statements were cancelled");
        assert!(e.is_transient());
        assert!(!e.outcome_unknown());
        assert!(!e.server_answered());
        assert!(
            e.to_string()
                .starts_with("not started: the stage is stopping")
        );
        assert!(DbError::Connection("reset".into()).outcome_unknown());
    }

    /// The pool's timeouts say what an operator reads as the cause (the full suite once: a
    /// frozen link failed a batch at a new connection, `pool: Timeout occurred while creating
    /// a new object`, where a statement on a pooled one said "no answer from the database").
    #[test]
    fn the_pools_timeouts_are_said_in_warrens_words() {
        use deadpool_postgres::TimeoutType;
        let said = |t| DbError::from_pool(PoolError::Timeout(t)).to_string();
        assert!(
            said(TimeoutType::Create)
                .contains("no answer from the database within 5000 ms while connecting"),
            "{}",
            said(TimeoutType::Create)
        );
        assert!(said(TimeoutType::Recycle).contains("no answer from the database within 2000 ms"));
        assert!(
            said(TimeoutType::Wait).contains("no pooled database connection free within 5000 ms")
        );
    }

    #[test]
    fn sqlstates_are_classified_as_documented() {
        for code in [
            "08000", "08006", "08001", "40001", "40P01", "53300", "57P01", "57P02", "57P03",
            "57014",
        ] {
            assert_eq!(classify_sqlstate(code), ErrorClass::Transient, "{code}");
        }
        for code in ["21000", "22001", "22P02", "23505", "23502", "23503"] {
            assert_eq!(classify_sqlstate(code), ErrorClass::Permanent, "{code}");
        }
        for code in ["42P01", "42501", "28P01", "28000", "3D000"] {
            assert_eq!(classify_sqlstate(code), ErrorClass::Systemic, "{code}");
        }
    }

    #[test]
    fn only_unclassified_codes_may_be_row_specific() {
        let server = |code: &str| DbError::Server {
            code: code.into(),
            message: "x".into(),
        };
        for code in ["P0001", "54000", "0A000"] {
            assert!(server(code).may_be_row_specific(), "{code}");
        }
        // 25006: a read-only server refuses every row alike (a failover, not a row).
        for code in [
            "08006", "53300", "57P01", "40001", "40P01", "57014", "58030", "23505", "25006",
        ] {
            assert!(!server(code).may_be_row_specific(), "{code}");
        }
        assert!(!DbError::Connection("refused".into()).may_be_row_specific());
        // Timeouts have their own search (`is_timeout`), not this one.
        assert!(!DbError::Outlasted { bound_ms: 5000 }.may_be_row_specific());
    }

    #[test]
    fn the_servers_timeout_and_warrens_bound_are_timeouts() {
        let server = |code: &str| DbError::Server {
            code: code.into(),
            message: "x".into(),
        };
        assert!(server("57014").is_timeout());
        assert!(DbError::Outlasted { bound_ms: 5000 }.is_timeout());
        for code in ["57P01", "40001", "55P03", "P0001", "23505"] {
            assert!(!server(code).is_timeout(), "{code}");
        }
        assert!(!DbError::Connection("no answer".into()).is_timeout());
    }

    #[test]
    fn work_that_outlasted_the_bound_while_the_server_answered_is_an_answer() {
        let e = DbError::Outlasted { bound_ms: 5000 };
        assert!(e.is_transient());
        assert!(e.server_answered(), "counted as a DLQ attempt");
        assert!(!e.discards_connection(), "already dropped");
        let reason = e.short_reason();
        assert!(reason.len() <= REASON_CAP, "{reason}");
        assert!(
            reason.contains("5000 ms") && reason.contains("DATABASE_STATEMENT_TIMEOUT_MS"),
            "{reason}"
        );
        assert!(!DbError::Connection("no answer".into()).server_answered());
    }

    #[test]
    fn a_stale_plan_is_the_statements_fault_not_a_rows() {
        let stale = DbError::Server {
            code: "0A000".into(),
            message: "cached plan must not change result type".into(),
        };
        assert!(stale.is_stale_plan());
        assert!(!stale.may_be_row_specific());
        // Transient: if preparing again does not help (the table changed again meanwhile),
        // the batch is retried as any transient failure.
        assert!(stale.is_transient());
        // Another feature_not_supported is not a stale plan (and may be a row's).
        let other = DbError::Server {
            code: "0A000".into(),
            message: "unsupported Unicode escape sequence".into(),
        };
        assert!(!other.is_stale_plan());
        assert!(other.may_be_row_specific());
        let same_words = DbError::Server {
            code: "XX000".into(),
            message: "cached plan must not change result type".into(),
        };
        assert!(!same_words.is_stale_plan());
        assert!(
            !DbError::Connection("cached plan must not change result type".into()).is_stale_plan()
        );
    }

    #[test]
    fn a_read_only_or_departing_server_costs_the_connection() {
        let server = |code: &str| DbError::Server {
            code: code.into(),
            message: "x".into(),
        };
        for code in ["25006", "57P01", "57P02", "57P03"] {
            assert!(server(code).discards_connection(), "{code}");
            assert!(server(code).is_transient(), "{code}");
        }
        for code in ["40001", "57014", "23505", "P0001"] {
            assert!(!server(code).discards_connection(), "{code}");
        }
    }

    #[test]
    fn a_rule_without_returning_refuses_the_messages_not_the_moment() {
        let e = DbError::Server {
            code: "0A000".into(),
            message: "cannot perform DELETE RETURNING on relation \"order_items\"".into(),
        };
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert!(
            e.short_reason().contains("DO INSTEAD rule"),
            "{}",
            e.short_reason()
        );
        // Other 0A000 stay as they were: a stale plan is replanned, the rest retried.
        let stale = DbError::Server {
            code: "0A000".into(),
            message: "cached plan must not change result type".into(),
        };
        assert_eq!(stale.class(), ErrorClass::Transient);
        assert!(stale.is_stale_plan());
    }

    #[test]
    fn connection_errors_are_transient_and_reasons_are_short() {
        let e = DbError::Connection("connection refused".into());
        assert!(e.is_transient());
        assert_eq!(e.short_reason(), "db_error: connection refused");
        let long = DbError::Connection("é".repeat(1000));
        assert!(long.short_reason().len() <= REASON_CAP);
        // A reason of warren's own is kept whole up to the cap.
        let own = DbError::Connection("x".repeat(900));
        assert_eq!(own.short_reason().len(), "db_error: ".len() + 900);
    }
}
