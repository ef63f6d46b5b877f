//! The batcher actor: collects processed messages, flushes at `USERS_BATCH_SIZE` or
//! `USERS_BATCH_TIMEOUT_MS` after the first one, inserts the batch with one statement, isolates
//! the rows the database refuses (split in halves), routes failures, and settles every message.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use deadpool_postgres::Pool;
use tracing::{error, info, warn};

use super::Drain;
use super::acks::Disposition;
use super::consumer::{Hold, HoldReason, Settle};
use super::processor::Delivered;
use super::router::{Route, Router};
use crate::amqp::headers;
use crate::db::{DbError, ErrorClass, dead_letters};
use crate::domain::{Domain, ID_CONFLICT, Inserted, Rejection};
use crate::metrics;

/// A processed message: its delivery and the decoded record, or why it was refused.
#[derive(Debug)]
pub struct Processed<R> {
    pub delivered: Delivered,
    pub result: Result<R, Rejection>,
}

impl<R: 'static> Message for Processed<R> {
    type Result = ();
}

/// What the batcher does with messages it cannot insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The main pipeline: retry queue for transient failures, DLQ for the rest.
    Main,
    /// The DLQ consumer: requeue after a backoff for transient failures, park the rest.
    Dlq,
}

/// What every batcher of one pipeline shares.
pub struct Shared<D: Domain> {
    pub domain: Arc<D>,
    pub pool: Pool,
    pub router: Router,
    pub settle: Recipient<Settle>,
    pub mode: Mode,
    pub pipeline: &'static str,
    /// How long a transient failure is retried in place before routing.
    pub db_retry_window: Duration,
    /// Set at shutdown: in-place retries give up and requeue.
    pub stopping: Arc<AtomicBool>,
    /// Consecutive batches the database took nothing of (drives the breaker).
    pub failures: AtomicU32,
    /// The consumer, held while the sink-outage breaker is open.
    pub hold: Recipient<Hold>,
    /// Consecutive transient failures that open the breaker.
    pub breaker_threshold: u32,
    /// Whether the breaker is open (a probe task is running).
    pub breaker_open: AtomicBool,
    /// DLQ consumer: attempts at a message the database keeps refusing before it is parked.
    pub dlq_max_attempts: u32,
    /// Client-side bound on one statement.
    pub db_bound: Duration,
    /// Consecutive batches that gave messages back to their queue (drives their backoff).
    pub requeues: AtomicU32,
}

/// Opens the sink-outage breaker once: the consumer stops taking deliveries, and a probe runs
/// the domain's insert of zero rows with backoff until the database takes it again.
fn open_breaker<D: Domain>(shared: &Arc<Shared<D>>, reason: &str) {
    if shared.breaker_open.swap(true, Ordering::SeqCst) {
        return;
    }
    error!(
        pipeline = shared.pipeline,
        reason,
        "sink-outage breaker OPEN: the database keeps failing; \
        consuming stops until it answers again"
    );
    metrics::breaker(shared.pipeline, true);
    shared.hold.do_send(Hold {
        reason: HoldReason::Breaker,
        on: true,
    });
    let shared = shared.clone();
    tokio::spawn(async move {
        let mut delays = crate::amqp::reconnect_backoff();
        loop {
            let delay = delays.next().unwrap_or(Duration::from_secs(10));
            sleep_unless_stopping(&shared, delay).await;
            if shared.stopping.load(Ordering::Relaxed) {
                return;
            }
            let probe = match shared.pool.get().await {
                Ok(client) => shared.domain.insert(&client, &[]).await.map(|_| ()),
                Err(e) => Err(DbError::from_pool(e)),
            };
            match probe {
                Ok(()) => {
                    shared.failures.store(0, Ordering::Relaxed);
                    shared.breaker_open.store(false, Ordering::SeqCst);
                    metrics::breaker(shared.pipeline, false);
                    info!(
                        pipeline = shared.pipeline,
                        "sink-outage breaker closed: the database answers; consuming again"
                    );
                    shared.hold.do_send(Hold {
                        reason: HoldReason::Breaker,
                        on: false,
                    });
                    return;
                }
                Err(e) => {
                    warn!(pipeline = shared.pipeline, error = %e, "breaker probe: database still failing")
                }
            }
        }
    });
}

/// The batcher actor.
pub struct Batcher<D: Domain> {
    shared: Arc<Shared<D>>,
    entries: Vec<Processed<D::Record>>,
    batch_size: usize,
    timeout: Duration,
    /// The pending timeout flush, cancelled by a size flush.
    timer: Option<SpawnHandle>,
    /// After `Drain`, everything is flushed at once.
    draining: bool,
    /// Numbers batches in logs.
    next_batch_id: u64,
    /// Which batcher this is, for batch ids.
    index: usize,
}

impl<D: Domain> Batcher<D> {
    pub fn new(shared: Arc<Shared<D>>, index: usize, batch_size: usize, timeout: Duration) -> Self {
        Self {
            shared,
            entries: Vec::with_capacity(batch_size),
            batch_size,
            timeout,
            timer: None,
            draining: false,
            next_batch_id: 0,
            index,
        }
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        if let Some(timer) = self.timer.take() {
            ctx.cancel_future(timer);
        }
        if self.entries.is_empty() {
            return;
        }
        let batch = std::mem::replace(&mut self.entries, Vec::with_capacity(self.batch_size));
        self.next_batch_id += 1;
        let batch_id = format!(
            "{}-{}-{}",
            self.shared.pipeline, self.index, self.next_batch_id
        );
        let shared = self.shared.clone();
        // `wait`: one batch at a time per batcher; new messages wait in the mailbox meanwhile.
        ctx.wait(process(shared, batch, batch_id).into_actor(self));
    }
}

impl<D: Domain> Actor for Batcher<D> {
    type Context = Context<Self>;
}

impl<D: Domain> Supervised for Batcher<D> {}

impl<D: Domain> Handler<Processed<D::Record>> for Batcher<D> {
    type Result = ();

    fn handle(&mut self, msg: Processed<D::Record>, ctx: &mut Self::Context) {
        self.entries.push(msg);
        if self.entries.len() >= self.batch_size || self.draining || self.timeout.is_zero() {
            self.flush(ctx);
        } else if self.entries.len() == 1 {
            self.timer = Some(ctx.run_later(self.timeout, |act, ctx| {
                act.timer = None;
                act.flush(ctx);
            }));
        }
    }
}

impl<D: Domain> Handler<Drain> for Batcher<D> {
    type Result = ();

    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) {
        self.draining = true;
        self.flush(ctx);
    }
}

/// How one message of a batch ends, before its settlement.
#[derive(Clone)]
enum Fate {
    /// Settled as is (inserted, or already given its disposition).
    Settled(Disposition),
    /// Republished (retry, DLX, back to the DLQ), then acked once confirmed.
    Route(Route),
    /// Parked in `dead_letters` (DLQ consumer), then acked once committed.
    Park { kind: &'static str, reason: String },
    /// Given back to its queue after a backoff, for this reason (counted).
    Requeue(&'static str),
}

/// Where a message that failed for `kind` goes: the main pipeline dead-letters it, the DLQ
/// consumer parks it.
fn refused<D: Domain>(shared: &Shared<D>, kind: &'static str, reason: String) -> Fate {
    match shared.mode {
        Mode::Main => Fate::Route(Route::DeadLetter { kind, reason }),
        Mode::Dlq => Fate::Park { kind, reason },
    }
}

/// Where a message whose insert failed with `e` goes.
fn failed<D: Domain>(shared: &Shared<D>, message: &Delivered, e: &DbError, reason: &str) -> Fate {
    match (e.class(), shared.mode) {
        (ErrorClass::Permanent, _) => refused(shared, "db_permanent", reason.to_string()),
        (ErrorClass::Transient, Mode::Main) => Fate::Route(Route::Retry {
            reason: reason.to_string(),
        }),
        // The DLQ consumer counts its own attempts while the database answers with an error,
        // and parks after the bound: no message loops in the DLQ forever.
        (ErrorClass::Transient, Mode::Dlq) if e.server_answered() => {
            let attempts = headers::dlq_attempts(&message.properties).count() + 1;
            if attempts >= shared.dlq_max_attempts {
                Fate::Park {
                    kind: "retries_exhausted",
                    reason: format!("the DLQ consumer gave up after {attempts} attempts: {reason}"),
                }
            } else {
                Fate::Route(Route::DlqAttempt {
                    attempts,
                    reason: reason.to_string(),
                })
            }
        }
        // No database at all (an outage): wait, count nothing.
        (ErrorClass::Transient, Mode::Dlq) => Fate::Requeue("db_unavailable"),
        // Systemic errors only end here at shutdown: the message stays with the broker.
        (ErrorClass::Systemic, _) => Fate::Settled(Disposition::Requeue),
    }
}

/// Processes one batch and sends its settlement.
async fn process<D: Domain>(
    shared: Arc<Shared<D>>,
    batch: Vec<Processed<D::Record>>,
    batch_id: String,
) {
    let started = Instant::now();
    let n = batch.len();
    let mut fates: Vec<Option<Fate>> = (0..n).map(|_| None).collect();
    let mut valid: Vec<(usize, &D::Record)> = Vec::with_capacity(n);

    for (i, p) in batch.iter().enumerate() {
        match &p.result {
            Ok(record) => valid.push((i, record)),
            Err(rejection) => {
                metrics::message_refused(
                    shared.pipeline,
                    rejection.kind.as_str(),
                    &rejection.reason,
                    &p.delivered,
                );
                fates[i] = Some(refused(
                    &shared,
                    rejection.kind.as_str(),
                    rejection.reason.clone(),
                ));
            }
        }
    }

    let valid_count = valid.len();
    let results = insert_isolating(&shared, valid, &batch_id).await;
    let mut inserted = 0usize;
    let mut transient: Option<String> = None;
    // Per group of rows that ended alike: the reason is formatted once, not per message.
    for (indices, result) in results {
        match result {
            Ok(conflicts) => {
                for (i, reason) in conflicts {
                    fates[i] = Some(refused(&shared, ID_CONFLICT, reason));
                }
                for i in indices {
                    if fates[i].is_none() {
                        inserted += 1;
                        fates[i] = Some(Fate::Settled(Disposition::Ack));
                    }
                }
            }
            Err(e) => {
                let reason = e.short_reason();
                for i in indices {
                    fates[i] = Some(failed(&shared, &batch[i].delivered, &e, &reason));
                }
                if e.class() == ErrorClass::Transient {
                    transient.get_or_insert(reason);
                }
            }
        }
    }
    if valid_count > 0 {
        metrics::batch_inserted(shared.pipeline, valid_count, inserted, started.elapsed());
        metrics::end_to_end(
            batch
                .iter()
                .zip(&fates)
                .filter(|(_, f)| matches!(f, Some(Fate::Settled(Disposition::Ack))))
                .filter_map(|(p, _)| *p.delivered.properties.timestamp()),
        );
    }
    // The breaker counts batches where the database took nothing; a batch that lost one bad
    // row and committed the rest is a sign of health.
    if transient.is_some() && inserted == 0 {
        let failures = shared.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if shared.mode == Mode::Main && failures >= shared.breaker_threshold {
            open_breaker(&shared, transient.as_deref().unwrap_or("database failing"));
        }
    } else if inserted > 0 {
        shared.failures.store(0, Ordering::Relaxed);
    }

    park_all(&shared, &batch, &mut fates).await;

    // What goes back (to its queue, or to the DLQ for another attempt) waits a backoff first,
    // so a failing hop or a database that keeps refusing is never a hot loop.
    let mut waited = false;
    let retrying = fates
        .iter()
        .filter(|f| matches!(f, Some(Fate::Route(Route::DlqAttempt { .. }))))
        .count();
    if retrying > 0 {
        let delay = requeue_backoff(shared.requeues.fetch_add(1, Ordering::Relaxed) + 1);
        warn!(pipeline = shared.pipeline, batch_id = %batch_id, count = retrying,
            delay_ms = delay.as_millis() as u64,
            "the database refused DLQ messages; trying them again after a backoff");
        sleep_unless_stopping(&shared, delay).await;
        waited = true;
    }
    route_all(&shared, &batch, &mut fates).await;

    let requeued: Vec<&'static str> = fates
        .iter()
        .filter_map(|f| match f {
            Some(Fate::Requeue(reason)) => Some(*reason),
            _ => None,
        })
        .collect();
    if !requeued.is_empty() {
        let streak = if waited {
            shared.requeues.load(Ordering::Relaxed)
        } else {
            shared.requeues.fetch_add(1, Ordering::Relaxed) + 1
        };
        let delay = requeue_backoff(streak);
        for (reason, n) in count_by_kind(requeued.into_iter()) {
            metrics::requeued(shared.pipeline, reason, n);
            warn!(pipeline = shared.pipeline, batch_id = %batch_id, reason, count = n,
                delay_ms = delay.as_millis() as u64,
                "messages go back to their queue after a backoff");
        }
        if !waited {
            sleep_unless_stopping(&shared, delay).await;
        }
    } else if !waited && fates.iter().all(|f| matches!(f, Some(Fate::Settled(_)))) {
        shared.requeues.store(0, Ordering::Relaxed);
    }

    if let Some(reason) = transient {
        warn!(pipeline = shared.pipeline, batch_id = %batch_id, reason = %reason,
            "batch insert failed for some rows; they went their way (retry queue, DLQ attempt or requeue)");
    }
    let generation_items = batch.iter().zip(fates).map(|(p, f)| {
        let disposition = match f {
            Some(Fate::Settled(d)) => d,
            _ => Disposition::Requeue,
        };
        (p.delivered.generation, p.delivered.tag, disposition)
    });
    // One settle per generation present in the batch (normally exactly one).
    let mut by_generation: Vec<(u64, Vec<(u64, Disposition)>)> = Vec::new();
    for (generation, tag, d) in generation_items {
        match by_generation.iter_mut().find(|(g, _)| *g == generation) {
            Some((_, items)) => items.push((tag, d)),
            None => by_generation.push((generation, vec![(tag, d)])),
        }
    }
    for (generation, items) in by_generation {
        shared.settle.do_send(Settle { generation, items });
    }
}

/// Parks every `Fate::Park` of the batch with one statement (row by row if refused); each
/// becomes an ack once committed, or a requeue if the database does not take it.
async fn park_all<D: Domain>(
    shared: &Shared<D>,
    batch: &[Processed<D::Record>],
    fates: &mut [Option<Fate>],
) {
    let mut indices = Vec::new();
    let mut kinds = Vec::new();
    let mut rows = Vec::new();
    for (i, f) in fates.iter().enumerate() {
        if let Some(Fate::Park { kind, reason }) = f {
            let d = &batch[i].delivered;
            indices.push(i);
            kinds.push(*kind);
            rows.push(dead_letters::ParkRow {
                message_id: d.properties.message_id().as_ref().map(|m| m.as_str()),
                body: &d.body,
                headers: headers::to_json(&d.properties),
                kind,
                reason,
            });
        }
    }
    if rows.is_empty() {
        return;
    }
    let result = dead_letters::park(&shared.pool, shared.db_bound, &rows).await;
    drop(rows);
    let settled = match result {
        Ok(parked) => {
            if parked.bare > 0 {
                warn!(
                    pipeline = shared.pipeline,
                    bare = parked.bare,
                    "some messages were parked without their headers (the database refused them)"
                );
            }
            for (kind, n) in count_by_kind(kinds.into_iter()) {
                metrics::messages_parked(kind, n);
            }
            Fate::Settled(Disposition::Ack)
        }
        Err(e) => {
            error!(pipeline = shared.pipeline, error = %e, count = indices.len(),
                "cannot park messages; they go back to the DLQ");
            Fate::Requeue("db_unavailable")
        }
    };
    for i in indices {
        fates[i] = Some(settled.clone());
    }
}

/// Republishes every `Fate::Route` of the batch (confirmed); each becomes an ack once
/// confirmed, or a requeue.
async fn route_all<D: Domain>(
    shared: &Shared<D>,
    batch: &[Processed<D::Record>],
    fates: &mut [Option<Fate>],
) {
    let mut indices = Vec::new();
    let mut items: Vec<(&Delivered, Route)> = Vec::new();
    for (i, f) in fates.iter_mut().enumerate() {
        if let Some(Fate::Route(_)) = f
            && let Some(Fate::Route(route)) = f.take()
        {
            indices.push(i);
            items.push((&batch[i].delivered, route));
        }
    }
    if items.is_empty() {
        return;
    }
    let outcomes = shared.router.route(&items).await;
    let mut routed = Vec::new();
    for (i, (disposition, kind)) in indices.into_iter().zip(outcomes) {
        fates[i] = Some(match disposition {
            Disposition::Ack => {
                metrics::message_routed(shared.pipeline, kind, &batch[i].delivered);
                routed.push(kind);
                Fate::Settled(Disposition::Ack)
            }
            Disposition::Requeue => Fate::Requeue("publish_failed"),
        });
    }
    for (kind, n) in count_by_kind(routed.into_iter()) {
        metrics::messages_routed(shared.pipeline, kind, n);
    }
}

/// How many of each kind, in first-seen order (a handful of kinds per batch at most).
fn count_by_kind(kinds: impl Iterator<Item = &'static str>) -> Vec<(&'static str, u64)> {
    let mut counts: Vec<(&'static str, u64)> = Vec::new();
    for kind in kinds {
        match counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => counts.push((kind, 1)),
        }
    }
    counts
}

/// The delay before messages go back to their queue (backon): 200 ms doubling per consecutive
/// batch that requeued something, up to 30 s, each with up to 100% jitter on top.
fn requeue_backoff(streak: u32) -> Duration {
    crate::amqp::backoff(Duration::from_millis(200), Duration::from_secs(30))
        .nth(streak.saturating_sub(1).min(32) as usize)
        .unwrap_or(Duration::from_secs(30))
}

async fn sleep_unless_stopping<D: Domain>(shared: &Shared<D>, delay: Duration) {
    let deadline = Instant::now() + delay;
    while Instant::now() < deadline && !shared.stopping.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(50).min(deadline - Instant::now())).await;
    }
}

/// Indices of a group and how its insert ended: the conflicting records (by batch index, with
/// their reason) when it committed, or the error.
type GroupResult = (Vec<usize>, Result<Vec<(usize, String)>, DbError>);

/// Inserts `records`, splitting a group in halves when the database refuses it in a way a row
/// may have caused (permanently, or transiently with a server error once the in-place retries
/// are spent), so only the offending rows fail. Transient errors are retried in place within the
/// retry window; systemic errors are retried with backoff until they clear or warren stops.
async fn insert_isolating<D: Domain>(
    shared: &Arc<Shared<D>>,
    records: Vec<(usize, &D::Record)>,
    batch_id: &str,
) -> Vec<GroupResult> {
    let mut out = Vec::new();
    if records.is_empty() {
        return out;
    }
    let deadline = Instant::now() + shared.db_retry_window;
    let mut stack: Vec<Vec<(usize, &D::Record)>> = vec![records];
    let mut splits = 0usize;
    while let Some(group) = stack.pop() {
        let refs: Vec<&D::Record> = group.iter().map(|(_, r)| *r).collect();
        match insert_retrying(shared, &refs, deadline, batch_id).await {
            Ok(done) => {
                let conflicts = done
                    .conflicts
                    .into_iter()
                    .filter_map(|(j, reason)| group.get(j).map(|(i, _)| (*i, reason)))
                    .collect();
                out.push((group.into_iter().map(|(i, _)| i).collect(), Ok(conflicts)));
            }
            Err(e)
                if group.len() > 1
                    && !shared.stopping.load(Ordering::Relaxed)
                    && (e.class() == ErrorClass::Permanent
                        || (e.class() == ErrorClass::Transient && e.may_be_row_specific())) =>
            {
                splits += 1;
                let mut left = group;
                let right = left.split_off(left.len() / 2);
                stack.push(right);
                stack.push(left);
            }
            Err(e) => out.push((group.into_iter().map(|(i, _)| i).collect(), Err(e))),
        }
    }
    if splits > 0 {
        info!(
            pipeline = shared.pipeline,
            batch_id, splits, "batch split to isolate refused rows"
        );
    }
    out
}

/// One insert statement, retried in place: transient errors until `deadline`, systemic errors
/// (the deployment is wrong) with backoff until they clear or warren stops. Each attempt is
/// bounded on the client side, so a half-open connection fails it within seconds.
async fn insert_retrying<D: Domain>(
    shared: &Arc<Shared<D>>,
    records: &[&D::Record],
    deadline: Instant,
    batch_id: &str,
) -> Result<Inserted, DbError> {
    let mut delays = crate::amqp::reconnect_backoff();
    loop {
        let result = match shared.pool.get().await {
            Ok(client) => {
                match tokio::time::timeout(shared.db_bound, shared.domain.insert(&client, records))
                    .await
                {
                    Ok(result) => result,
                    Err(_) => Err(crate::db::abandon(client, shared.db_bound)),
                }
            }
            Err(e) => Err(DbError::from_pool(e)),
        };
        let e = match result {
            Ok(done) => {
                metrics::postgres(true);
                return Ok(done);
            }
            Err(e) => e,
        };
        if matches!(e, DbError::Connection(_)) {
            metrics::postgres(false);
        }
        if shared.stopping.load(Ordering::Relaxed) {
            return Err(e);
        }
        let delay = delays.next().unwrap_or(Duration::from_secs(30));
        match e.class() {
            ErrorClass::Permanent => return Err(e),
            ErrorClass::Transient => {
                if Instant::now() + delay > deadline {
                    return Err(e);
                }
                warn!(pipeline = shared.pipeline, batch_id, error = %e, retry_in_ms = delay.as_millis() as u64,
                    "transient database error; retrying the batch in place");
            }
            ErrorClass::Systemic => {
                error!(pipeline = shared.pipeline, batch_id, error = %e, retry_in_ms = delay.as_millis() as u64,
                    "SYSTEMIC database error: the deployment is wrong (table, privileges, database); \
                     holding the batch, no message is dead-lettered");
                open_breaker(shared, "systemic database error");
            }
        }
        sleep_unless_stopping(shared, delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeue_backoff_grows_from_200ms_to_30s() {
        let first = requeue_backoff(1);
        assert!(
            first >= Duration::from_millis(200) && first < Duration::from_millis(400),
            "{first:?}"
        );
        let later = requeue_backoff(5);
        assert!(later >= Duration::from_millis(3200), "{later:?}");
        let capped = requeue_backoff(40);
        assert!(
            capped >= Duration::from_secs(30) && capped < Duration::from_secs(60),
            "{capped:?}"
        );
    }
}
