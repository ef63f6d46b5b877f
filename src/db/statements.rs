//! The statements one pipeline stage has running on the server ([`Statements`]), so its stop can
//! cancel them (`pg_cancel_backend`'s protocol message, SQLSTATE 57014 for the statement) and
//! know each one ended: rolled back, or committed before the cancel reached it. A statement
//! left running past a stop committed later, after its deliveries had gone back to the broker
//! and been taken again by a stage started in its place (a reload switching the table): the
//! same message stored twice (review R35-F1).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_postgres::{CancelToken, Client, NoTls};

use super::DbError;

/// How long a cancel request may take to reach the server (it opens a connection of its own).
const CANCEL_BOUND: Duration = Duration::from_secs(5);

/// The statements of one stage in flight, each by its connection's cancel token.
#[derive(Default)]
pub struct Statements {
    state: Mutex<State>,
    /// Woken each time a statement ends: [`Statements::ended`] waits on it.
    ended: Notify,
}

#[derive(Default)]
struct State {
    /// The next statement's number.
    next: u64,
    /// The statements running now.
    running: HashMap<u64, CancelToken>,
    /// Set by [`Statements::cancel_all`]: the stage stops, and starts no statement any more.
    cancelled: bool,
}

/// One statement running: it leaves the set when dropped, which must happen before its
/// connection goes back to the pool (a later cancel would reach the next user's statement).
#[must_use = "the statement leaves the set when this is dropped"]
pub struct Running {
    statements: Arc<Statements>,
    id: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut state = self.statements.lock();
        state.running.remove(&self.id);
        drop(state);
        self.statements.ended.notify_waiters();
    }
}

impl Statements {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Err` once the stage's statements were cancelled: none starts any more.
    pub fn check_open(&self) -> Result<(), DbError> {
        match self.lock().cancelled {
            true => Err(DbError::NotStarted(
                "the stage is stopping and its statements were cancelled",
            )),
            false => Ok(()),
        }
    }

    /// Enters a statement about to run on `client`; once the stage's statements were cancelled
    /// none starts any more: a transient error (its messages go back to the broker), so nothing
    /// the stop cancelled is tried again behind its back.
    pub fn enter(self: &Arc<Self>, client: &Client) -> Result<Running, DbError> {
        let mut state = self.lock();
        if state.cancelled {
            return Err(DbError::NotStarted(
                "the stage is stopping and its statements were cancelled",
            ));
        }
        let id = state.next;
        state.next += 1;
        state.running.insert(id, client.cancel_token());
        Ok(Running {
            statements: self.clone(),
            id,
        })
    }

    /// Cancels every statement running now and refuses any new one; answers how many were
    /// running. Each ends on the server as it would at any error: rolled back, or committed if
    /// it was committing already (its result then says so). A cancel that arrives after its
    /// statement ended does nothing, or, in the instant its connection went to another stage,
    /// fails that stage's statement with a transient error (retried as any other).
    pub fn cancel_all(&self) -> usize {
        let tokens: Vec<CancelToken> = {
            let mut state = self.lock();
            state.cancelled = true;
            state.running.values().cloned().collect()
        };
        for token in &tokens {
            cancel(token.clone());
        }
        tokens.len()
    }

    /// How many statements run now.
    pub fn running(&self) -> usize {
        self.lock().running.len()
    }

    /// Waits until no statement runs, at most `bound`; answers whether none does.
    pub async fn ended(&self, bound: Duration) -> bool {
        tokio::time::timeout(bound, async {
            loop {
                let notified = self.ended.notified();
                if self.running() == 0 {
                    return;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }
}

/// Sends a cancel request for whatever runs on the connection of `token`, in a task of its own,
/// bounded by [`CANCEL_BOUND`]; a failure is logged (the server's `statement_timeout` still
/// ends the statement).
pub fn cancel(token: CancelToken) {
    tokio::spawn(async move {
        match tokio::time::timeout(CANCEL_BOUND, token.cancel_query(NoTls)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not cancel a database statement"),
            Err(_) => tracing::warn!(
                bound_ms = CANCEL_BOUND.as_millis() as u64,
                "could not cancel a database statement: no answer"
            ),
        }
    });
}

/// The server process of the connection `token` cancels for (`pg_backend_pid()` on it), read
/// from the cancel request the client would send: tokio-postgres keeps it private and has no
/// accessor (`CancelToken::cancel_query_raw` writes the request, 16 bytes, into a stream we
/// give it: length, code, process id, secret key). `None` when it cannot be read (a TLS mode
/// that would negotiate first).
pub async fn backend_pid(token: &CancelToken) -> Option<i32> {
    use tokio::io::AsyncReadExt;
    let (mut ours, theirs) = tokio::io::duplex(64);
    token.cancel_query_raw(theirs, NoTls).await.ok()?;
    let mut request = Vec::with_capacity(16);
    ours.read_to_end(&mut request).await.ok()?;
    const CANCEL_REQUEST_CODE: i32 = 80_877_102;
    let word = |i: usize| -> Option<i32> {
        Some(i32::from_be_bytes(request.get(i..i + 4)?.try_into().ok()?))
    };
    (request.len() == 16 && word(0)? == 16 && word(4)? == CANCEL_REQUEST_CODE)
        .then(|| word(8))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn with_nothing_running_a_cancel_cancels_nothing_and_the_wait_ends_at_once() {
        let statements = Statements::new();
        assert_eq!(statements.cancel_all(), 0);
        assert_eq!(statements.running(), 0);
        assert!(statements.ended(Duration::ZERO).await);
    }
}
