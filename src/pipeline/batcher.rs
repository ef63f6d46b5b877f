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
use crate::db::{DbError, ErrorClass};
use crate::domain::{Domain, Rejection};
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
    /// Consecutive failed batches (drives the DLQ backoff and the breaker).
    pub failures: AtomicU32,
    /// The consumer, held while the sink-outage breaker is open.
    pub hold: Recipient<Hold>,
    /// Consecutive transient failures that open the breaker.
    pub breaker_threshold: u32,
    /// Whether the breaker is open (a probe task is running).
    pub breaker_open: AtomicBool,
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

/// Processes one batch and sends its settlement.
async fn process<D: Domain>(
    shared: Arc<Shared<D>>,
    batch: Vec<Processed<D::Record>>,
    batch_id: String,
) {
    let started = Instant::now();
    let n = batch.len();
    let mut dispositions: Vec<Option<Disposition>> = vec![None; n];
    let mut routes: Vec<(usize, Route)> = Vec::new();
    let mut parks: Vec<(usize, &'static str, String)> = Vec::new();
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
                match shared.mode {
                    Mode::Main => routes.push((
                        i,
                        Route::DeadLetter {
                            kind: rejection.kind.as_str(),
                            reason: rejection.reason.clone(),
                        },
                    )),
                    Mode::Dlq => parks.push((i, rejection.kind.as_str(), rejection.reason.clone())),
                }
            }
        }
    }

    let valid_count = valid.len();
    let results = insert_isolating(&shared, valid, &batch_id).await;
    let mut inserted = 0usize;
    let mut transient: Option<String> = None;
    // Per group of rows that ended alike: the reason is formatted once, not per message.
    for (indices, result) in results {
        let e = match result {
            Ok(()) => {
                inserted += indices.len();
                for i in indices {
                    dispositions[i] = Some(Disposition::Ack);
                }
                continue;
            }
            Err(e) => e,
        };
        let reason = e.short_reason();
        for i in indices {
            match (e.class(), shared.mode) {
                (ErrorClass::Permanent, Mode::Main) => routes.push((
                    i,
                    Route::DeadLetter {
                        kind: "db_permanent",
                        reason: reason.clone(),
                    },
                )),
                (ErrorClass::Permanent, Mode::Dlq) => {
                    parks.push((i, "db_permanent", reason.clone()))
                }
                (ErrorClass::Transient, Mode::Main) => routes.push((
                    i,
                    Route::Retry {
                        reason: reason.clone(),
                    },
                )),
                // Systemic errors only end here at shutdown; the DLQ requeues transient ones.
                _ => dispositions[i] = Some(Disposition::Requeue),
            }
        }
        if e.class() == ErrorClass::Transient {
            transient.get_or_insert(reason);
        }
    }
    if valid_count > 0 {
        metrics::batch_inserted(shared.pipeline, valid_count, inserted, started.elapsed());
        metrics::end_to_end(
            batch
                .iter()
                .zip(&dispositions)
                .filter(|(p, d)| p.result.is_ok() && **d == Some(Disposition::Ack))
                .filter_map(|(p, _)| *p.delivered.properties.timestamp()),
        );
    }
    if transient.is_some() || dispositions.contains(&Some(Disposition::Requeue)) {
        let failures = shared.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if shared.mode == Mode::Main && failures >= shared.breaker_threshold {
            open_breaker(&shared, transient.as_deref().unwrap_or("database failing"));
        }
    } else if valid_count > 0 {
        shared.failures.store(0, Ordering::Relaxed);
    }

    if !parks.is_empty() {
        let parked = park(&shared, &batch, &parks).await;
        for (i, _, _) in &parks {
            dispositions[*i] = Some(if parked {
                Disposition::Ack
            } else {
                Disposition::Requeue
            });
        }
        if parked {
            for (kind, n) in count_by_kind(parks.iter().map(|(_, kind, _)| *kind)) {
                metrics::messages_parked(kind, n);
            }
        }
    }

    if !routes.is_empty() {
        let items: Vec<(&Delivered, Route)> = routes
            .iter()
            .map(|(i, r)| (&batch[*i].delivered, r.clone()))
            .collect();
        let outcomes = shared.router.route(&items).await;
        let mut routed = Vec::new();
        for ((i, _), (disposition, kind)) in routes.iter().zip(outcomes) {
            dispositions[*i] = Some(disposition);
            if disposition == Disposition::Ack {
                metrics::message_routed(shared.pipeline, kind, &batch[*i].delivered);
                routed.push(kind);
            }
        }
        for (kind, n) in count_by_kind(routed.into_iter()) {
            metrics::messages_routed(shared.pipeline, kind, n);
        }
    }

    // A DLQ batch that is requeued waits first, so an outage is never a hot loop.
    if shared.mode == Mode::Dlq && dispositions.contains(&Some(Disposition::Requeue)) {
        let delay = dlq_backoff(shared.failures.load(Ordering::Relaxed));
        warn!(pipeline = shared.pipeline, batch_id = %batch_id, delay_ms = delay.as_millis() as u64,
            "database unavailable; requeueing the DLQ batch after a backoff");
        sleep_unless_stopping(&shared, delay).await;
    }

    if let Some(reason) = transient {
        warn!(pipeline = shared.pipeline, batch_id = %batch_id, reason = %reason, "batch failed; messages sent to the retry queue");
    }
    let generation_items = batch.iter().zip(dispositions).map(|(p, d)| {
        (
            p.delivered.generation,
            p.delivered.tag,
            d.unwrap_or(Disposition::Requeue),
        )
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

/// The DLQ requeue delay (backon): 200 ms doubling per consecutive failure up to 30 s, each
/// with up to 100% jitter on top.
fn dlq_backoff(failures: u32) -> Duration {
    crate::amqp::backoff(Duration::from_millis(200), Duration::from_secs(30))
        .nth(failures.saturating_sub(1).min(32) as usize)
        .unwrap_or(Duration::from_secs(30))
}

async fn sleep_unless_stopping<D: Domain>(shared: &Shared<D>, delay: Duration) {
    let deadline = Instant::now() + delay;
    while Instant::now() < deadline && !shared.stopping.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(50).min(deadline - Instant::now())).await;
    }
}

/// Inserts `records`, splitting a group in halves when the database refuses it permanently, so
/// only the offending rows fail. Transient errors are retried in place within the retry window;
/// systemic errors are retried with backoff until they clear or warren stops.
async fn insert_isolating<D: Domain>(
    shared: &Arc<Shared<D>>,
    records: Vec<(usize, &D::Record)>,
    batch_id: &str,
) -> Vec<(Vec<usize>, Result<(), DbError>)> {
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
            Ok(_) => out.push((group.into_iter().map(|(i, _)| i).collect(), Ok(()))),
            Err(e) if e.class() == ErrorClass::Permanent && group.len() > 1 => {
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
/// (the deployment is wrong) with backoff until they clear or warren stops.
async fn insert_retrying<D: Domain>(
    shared: &Arc<Shared<D>>,
    records: &[&D::Record],
    deadline: Instant,
    batch_id: &str,
) -> Result<u64, DbError> {
    let mut delays = crate::amqp::reconnect_backoff();
    loop {
        let result = match shared.pool.get().await {
            Ok(client) => shared.domain.insert(&client, records).await,
            Err(e) => Err(DbError::from_pool(e)),
        };
        let e = match result {
            Ok(n) => {
                metrics::postgres(true);
                return Ok(n);
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

/// Parks messages that can never be inserted in `dead_letters`, with one statement.
async fn park<D: Domain>(
    shared: &Shared<D>,
    batch: &[Processed<D::Record>],
    parks: &[(usize, &'static str, String)],
) -> bool {
    let mut ids: Vec<Option<String>> = Vec::with_capacity(parks.len());
    let mut bodies: Vec<&[u8]> = Vec::with_capacity(parks.len());
    let mut hdrs: Vec<serde_json::Value> = Vec::with_capacity(parks.len());
    let mut kinds: Vec<&str> = Vec::with_capacity(parks.len());
    let mut reasons: Vec<&str> = Vec::with_capacity(parks.len());
    for (i, kind, reason) in parks {
        let d = &batch[*i].delivered;
        ids.push(
            d.properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_string()),
        );
        bodies.push(&d.body);
        hdrs.push(headers::to_json(&d.properties));
        kinds.push(kind);
        reasons.push(reason);
    }
    let result = async {
        let client = shared.pool.get().await.map_err(DbError::from_pool)?;
        client
            .execute(
                "INSERT INTO dead_letters (message_id, body, headers, error_kind, error_reason) \
                 SELECT * FROM UNNEST($1::text[], $2::bytea[], $3::jsonb[], $4::text[], $5::text[])",
                &[&ids, &bodies, &hdrs, &kinds, &reasons],
            )
            .await
            .map_err(DbError::from_pg)
    }
    .await;
    match result {
        Ok(_) => true,
        Err(e) => {
            error!(pipeline = shared.pipeline, error = %e, count = parks.len(), "cannot park messages; requeueing them");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlq_backoff_grows_from_200ms_to_30s() {
        let first = dlq_backoff(1);
        assert!(
            first >= Duration::from_millis(200) && first < Duration::from_millis(400),
            "{first:?}"
        );
        let later = dlq_backoff(5);
        assert!(later >= Duration::from_millis(3200), "{later:?}");
        let capped = dlq_backoff(40);
        assert!(
            capped >= Duration::from_secs(30) && capped < Duration::from_secs(60),
            "{capped:?}"
        );
    }
}
