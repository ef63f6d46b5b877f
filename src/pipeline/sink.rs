//! The sink stage: inserts one batch with one statement through the domain, retries a
//! transient failure in place within `DB_RETRY_WINDOW_MS`, isolates the rows the database
//! refuses or that time out (split in halves, so one bad or slow row never takes its batch
//! down; the search for a slow one costs about log2 of the batch's size in timeouts), acks
//! what committed and hands every other message, with why, to the pipeline's fallback stage
//! (`router.rs` for the main pipeline, `dlq.rs` for the DLQ consumer). It answers the batcher
//! once the whole batch is settled: one batch at a time per sink. A batch retried in place (the
//! breaker open) is given back to its queue at 80% of the broker's `consumer_timeout`
//! (`AMQP_CONSUMER_TIMEOUT_MS`), counted from its oldest delivery, before the broker would close
//! the channel over it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use backon::Retryable;
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::breaker::Breaker;
use super::message::{Batch, Delivery, Disposition, Failure, Leftovers, Settle};
use super::predecessors::{self, Asker};
use crate::db::{DbError, ErrorClass};
use crate::domain::{Domain, ErrorKind, Inserted};
use crate::metrics;

/// What every sink of one pipeline shares.
pub struct SinkConfig<D: Domain> {
    pub domain: Arc<D>,
    pub pool: Pool,
    /// The pipeline and which of its stages: the labels of logs and metrics.
    pub stage: metrics::StageId,
    /// How long a transient failure is retried in place before the rows go their way.
    pub db_retry_window: Duration,
    /// Client-side bound on one statement.
    pub db_bound: Duration,
    /// How long a batch may be held unacked (from its oldest delivery's arrival) before the
    /// in-place retry gives it back (nack with requeue), ahead of the broker's
    /// `consumer_timeout`; `None` = the broker has none (`AMQP_CONSUMER_TIMEOUT_MS=0`).
    pub hand_back_after: Option<Duration>,
    pub breaker: Arc<Breaker>,
    /// Cancelled at shutdown: in-place retries give up (the messages are requeued).
    pub stopping: CancellationToken,
    /// Set when a batch tried during the stop got no answer from the database (no connection,
    /// a silent link): the batches still held are given back without trying, each of which
    /// would otherwise wait out the pool's connection timeout in turn, past the stop's bound
    /// (review R40a F5: a stop during a partition took all of `SHUTDOWN_TIMEOUT_MS`, exit 1).
    pub silent_at_stop: std::sync::atomic::AtomicBool,
    /// The stage's statements in flight: its stop cancels those still running at the drain's
    /// deadline, and none starts after that.
    pub statements: Arc<crate::db::Statements>,
    /// The consumer's acks.
    pub settle: Recipient<Settle>,
    /// The fallback stage, for every message not inserted.
    pub leftovers: Recipient<Leftovers>,
    /// The stage's memory, shared with its consumer: what the stages before it on the queue
    /// acked whose acks may be lost (`acked.rs`).
    pub copies: Arc<super::copies::Copies>,
    /// This start of the stage (`acked::incarnation`): a redelivery of an ack its own link lost
    /// uses that entry up, asking nothing (its own table decides it as any copy).
    pub incarnation: u64,
    /// The stages this process's reloads stopped on the same queue before starting this one
    /// (of the same kind; newest first, at most `predecessors::PREDECESSORS`): what one of them acked may
    /// come again (`predecessors::settled_before`).
    pub predecessors: Vec<predecessors::Predecessor<D>>,
}

/// The sink actor.
pub struct Sink<D: Domain> {
    config: Arc<SinkConfig<D>>,
}

impl<D: Domain> Sink<D> {
    pub fn new(config: Arc<SinkConfig<D>>) -> Self {
        Self { config }
    }
}

impl<D: Domain> Actor for Sink<D> {
    type Context = Context<Self>;
}

impl<D: Domain> Supervised for Sink<D> {}

impl<D: Domain> Handler<Batch<D::Record>> for Sink<D> {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, batch: Batch<D::Record>, _: &mut Self::Context) -> Self::Result {
        Box::pin(sink(self.config.clone(), batch))
    }
}

/// Marks as done the redeliveries whose copy this stage (or one a reload replaced) routed and
/// saw confirmed before the link that delivered them went down with their acks: acked as
/// already routed, never inserted, also when the mapping now accepts them (review R47a F1: a
/// reload that widened the mapping stored what the old stage had dead-lettered, and its DLQ
/// stage had parked: both stored and parked). One whose copy is still being published goes
/// back to its queue until the outcome is known. The fallback stage asks the same memory
/// about what it routes (`router.rs`).
fn already_routed<D: Domain>(
    config: &SinkConfig<D>,
    deliveries: &[Delivery],
    inserted: &mut [bool],
    failures: &mut [Option<Failure>],
) {
    let asked: Vec<usize> = (0..deliveries.len())
        .filter(|&i| deliveries[i].redelivered && !inserted[i] && failures[i].is_none())
        .collect();
    if asked.is_empty() || !config.copies.remembers_lost() {
        return;
    }
    let mut ids = Vec::new();
    for i in asked {
        let d = &deliveries[i];
        match config.copies.recall(d, config.copies.fingerprint(d)) {
            super::copies::Recall::Routed => {
                inserted[i] = true;
                ids.push(d.message_id());
            }
            super::copies::Recall::Pending => {
                failures[i] = Some(Failure::Db {
                    class: ErrorClass::Systemic,
                    server_answered: false,
                    reason: "a copy of it made before its link went down is still being \
                             published: given back until the outcome is known"
                        .into(),
                });
            }
            super::copies::Recall::Unknown => {}
        }
    }
    if !ids.is_empty() {
        metrics::redeliveries(&config.stage, "already_routed", ids.len() as u64);
        info!(
            pipeline = config.stage.pipeline(),
            stage = config.stage.stage().as_str(),
            count = ids.len(),
            message_ids = ?ids.iter().take(10).collect::<Vec<_>>(),
            "redeliveries acked as already routed before any insert: their copies were \
             confirmed before the link that delivered them went down with their acks"
        );
    }
}

/// Inserts, settles what committed, and hands the rest to the fallback stage.
async fn sink<D: Domain>(config: Arc<SinkConfig<D>>, batch: Batch<D::Record>) {
    let started = Instant::now();
    let Batch { id, entries } = batch;
    let n = entries.len();
    let (mut deliveries, results): (Vec<Delivery>, Vec<_>) =
        entries.into_iter().map(|e| (e.delivery, e.result)).unzip();
    // Acked: settled by the stage a reload replaced, stored (`committed`), stale or deleted.
    let mut failures: Vec<Option<Failure>> = (0..n).map(|_| None).collect();
    // Each with the predecessor that settled it, if one did: its ack is remembered under it.
    let settled_by = predecessors::settled_before(
        &asker(&config),
        (&config.copies, config.incarnation),
        &config.predecessors,
        &deliveries,
        &mut failures,
    )
    .await;
    let mut inserted: Vec<bool> = settled_by.iter().map(Option::is_some).collect();
    already_routed(&config, &deliveries, &mut inserted, &mut failures);
    let mut acked = inserted.iter().filter(|done| **done).count();
    let mut records: Vec<(usize, D::Record)> = Vec::with_capacity(n);
    for (i, result) in results.into_iter().enumerate() {
        if inserted[i] || failures[i].is_some() {
            continue;
        }
        match result {
            Ok(record) => records.push((i, record)),
            Err(rejection) => {
                let kind = rejection.kind;
                metrics::message_refused(
                    &config.stage,
                    kind.as_str(),
                    &rejection.reason,
                    deliveries[i].message_id(),
                    deliveries[i].tag,
                );
                failures[i] = Some(Failure::Refused {
                    kind,
                    reason: rejection.reason,
                });
            }
        }
    }

    let mut committed = 0usize;
    let mut stale: Vec<(usize, String)> = Vec::new();
    let mut deleted = 0usize;
    let mut transient: Option<String> = None;
    // A statement of the batch the stop cancelled near the drain's deadline (SQLSTATE 57014
    // while stopping): the stop's doing, said as such, not as the database failing.
    let mut cancelled_by_stop = false;
    if !records.is_empty() {
        let refs: Vec<(usize, &D::Record)> = records.iter().map(|(i, r)| (*i, r)).collect();
        let give_back_at = give_back_at(
            deliveries.iter().map(|d| d.received_at).min(),
            config.hand_back_after,
        );
        let untried = config.stopping.is_cancelled()
            && config
                .silent_at_stop
                .load(std::sync::atomic::Ordering::Relaxed);
        let results = if untried {
            let all = refs.iter().map(|(i, _)| *i).collect();
            let untried =
                DbError::NotStarted("the database did not answer another batch during the stop");
            vec![(all, Err(untried))]
        } else {
            insert_isolating(&config, refs, &id, give_back_at).await
        };
        for (indices, result) in results {
            match result {
                Ok(Refusals {
                    conflicts,
                    refused,
                    stale: group_stale,
                    deleted: group_deleted,
                }) => {
                    for (i, reason) in conflicts {
                        failures[i] = Some(Failure::Refused {
                            kind: ErrorKind::IdConflict,
                            reason,
                        });
                    }
                    for (i, reason) in refused {
                        failures[i] = Some(Failure::Refused {
                            kind: ErrorKind::DbPermanent,
                            reason,
                        });
                    }
                    for i in indices {
                        if failures[i].is_none() {
                            inserted[i] = true;
                            acked += 1;
                            if group_stale.iter().any(|(s, _)| *s == i) {
                                continue;
                            }
                            if group_deleted.contains(&i) {
                                deleted += 1;
                            } else {
                                committed += 1;
                            }
                        }
                    }
                    stale.extend(group_stale);
                }
                Err(e) => {
                    let reason: Arc<str> = e.short_reason().into();
                    if config.stopping.is_cancelled() && e.outcome_unknown() && !untried {
                        // Their statement may have committed, and the table could not say (its
                        // link half-open: the question on the pool's connections got no answer
                        // either) or said not yet: they go back to their queue remembered as
                        // acks this stage may have made, so that a stage a reload starts there
                        // asks this table about their redeliveries (review R46a F6: a batch the
                        // old table committed, its answer lost, was stored again in the new one).
                        let prints: Vec<super::acked::AckPrint> = indices
                            .iter()
                            .map(|&i| {
                                let d = &deliveries[i];
                                super::acked::print(&d.body, d.properties.bare())
                            })
                            .collect();
                        config.copies.acked().give_back(config.incarnation, &prints);
                    }
                    for i in indices {
                        failures[i] = Some(Failure::Db {
                            class: e.class(),
                            server_answered: e.server_answered(),
                            reason: reason.clone(),
                        });
                    }
                    if e.class() == ErrorClass::Transient && transient.is_none() {
                        transient = Some(reason.to_string());
                    }
                    if config.stopping.is_cancelled() && !e.server_answered() && e.is_transient() {
                        config
                            .silent_at_stop
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    cancelled_by_stop |= config.stopping.is_cancelled()
                        && e.sqlstate()
                            == Some(tokio_postgres::error::SqlState::QUERY_CANCELED.code());
                }
            }
        }
        let took = started.elapsed();
        metrics::batch_inserted(&config.stage, records.len(), committed, took);
        if !stale.is_empty() || deleted > 0 {
            metrics::messages_settled(&config.stage, stale.len() as u64, deleted as u64);
        }
        for (i, reason) in &stale {
            crate::events::emit(
                Some(config.stage.pipeline()),
                crate::events::Kind::Stale {
                    message_id: deliveries[*i].message_id().to_string(),
                    reason: reason.clone(),
                },
            );
        }
        if acked > 0 {
            crate::events::emit(
                Some(config.stage.pipeline()),
                crate::events::Kind::BatchCommitted {
                    rows: committed as u64,
                    messages: n as u64,
                    duration_ms: took.as_millis() as u64,
                    stale: stale.len() as u64,
                    deleted: deleted as u64,
                },
            );
        }
        metrics::end_to_end(
            deliveries
                .iter()
                .zip(&inserted)
                .filter(|(_, ok)| **ok)
                .filter_map(|(d, _)| d.published_ms)
                .min(),
        );
        config
            .breaker
            .record(acked, transient.as_deref(), &config.domain, &config.pool);
    }
    // The records are gone: their bytes leave the consumer's budget before anything settles
    // (a consumer waiting for room decides at the settlement).
    drop(records);
    for d in &mut deliveries {
        d.decoded.release();
    }
    if let Some(reason) = &transient {
        let (pipeline, stage) = (config.stage.pipeline(), config.stage.stage().as_str());
        if cancelled_by_stop {
            info!(pipeline, stage, batch_id = %id,
                "batch insert cancelled by the stop: it still waited at the drain's deadline (a \
                 lock, a slow server); its messages go back to their queue unprocessed, and the \
                 breaker does not count it");
        } else if config.stopping.is_cancelled() {
            info!(pipeline, stage, batch_id = %id, reason = %crate::text::shown(reason),
                "batch not inserted during the stop; its messages go back to their queue \
                 unprocessed, and the breaker does not count it");
        } else {
            warn!(pipeline, stage, batch_id = %id, reason = %crate::text::shown(reason),
                "batch insert failed for some rows; they go their way (retry queue, DLQ attempt or requeue)");
        }
    }

    for settle in Settle::group_settled(
        deliveries
            .iter()
            .zip(&inserted)
            .zip(&settled_by)
            .filter(|((_, ok), _)| **ok)
            .map(|((d, _), by)| (d, Disposition::Ack, *by)),
    ) {
        config.settle.do_send(settle);
    }
    if acked == n {
        return;
    }
    let items: Vec<(Delivery, Failure)> = deliveries
        .into_iter()
        .zip(failures)
        .zip(inserted)
        .filter(|(_, ok)| !ok)
        // A valid row is always in a group, so `None` cannot happen; it would be requeued.
        .map(|((d, f), _)| {
            let failure = f.unwrap_or(Failure::Db {
                class: ErrorClass::Systemic,
                server_answered: false,
                reason: "not inserted".into(),
            });
            (d, failure)
        })
        .collect();
    // Waits until the fallback settled them: one batch at a time per sink.
    let _ = config
        .leftovers
        .send(Leftovers {
            batch_id: id,
            items,
        })
        .await;
}

/// The records of a committed group that were not stored, by batch index, with their reason;
/// and those acked without being stored as their own row.
struct Refusals {
    /// Their id is stored with other content (`id_conflict`).
    conflicts: Vec<(usize, String)>,
    /// Another unique key of theirs is taken (`db_permanent`).
    refused: Vec<(usize, String)>,
    /// Older than their key's version (`on_conflict = "update"`): acked, changed nothing.
    stale: Vec<(usize, String)>,
    /// Deletes that hold: acked.
    deleted: Vec<usize>,
}

/// Indices of a group and how its insert ended: what it did not store when it committed, or
/// the error.
type GroupResult = (Vec<usize>, Result<Refusals, DbError>);

/// Inserts `records`, splitting a group in halves when the database refuses it in a way a row
/// may have caused (permanently, or transiently with a server error once the in-place retries
/// are spent), so only the offending rows fail. Known transient classes (connection, deadlock,
/// resources) are about the moment, not a row: not split.
///
/// A group that times out (`DbError::is_timeout`: the server's `statement_timeout`, or warren's
/// own bound) is split too, at once, without an in-place retry: one slow row (a huge child
/// array, a slow trigger, a lock held on its key) times out the whole batch, and without the
/// split every row of the batch spent a retry (or a DLQ attempt) with it, each time, and went to
/// the DLQ (or was parked) with it. Both halves are tried before either is split again; when
/// both time out, the time is the moment's (an overloaded server) or several rows' own, and the
/// search stops there: those halves fail as they are. So one slow row among N costs at most
/// ceil(log2 N) + 1 timeouts, and the search never more than ceil(log2 N) + 2 timeouts
/// followed by a split ([`timeout_budget`]), not N: a timeout of a single row, or one past the
/// budget, at a stop, or too near the time the batch is given back, fails as before.
async fn insert_isolating<D: Domain>(
    config: &Arc<SinkConfig<D>>,
    records: Vec<(usize, &D::Record)>,
    batch_id: &str,
    give_back_at: Option<Instant>,
) -> Vec<GroupResult> {
    let mut search = Isolation {
        config,
        batch_id,
        deadline: Instant::now() + config.db_retry_window,
        give_back_at,
        timeout_budget: timeout_budget(records.len()),
        stack: vec![Work::Group(records)],
        out: Vec::new(),
        splits: 0,
        halvings: 0,
        timed_out: 0,
        alone: 0,
    };
    while let Some(work) = search.stack.pop() {
        match work {
            Work::Group(group) => {
                let (result, split) = search.attempt(&group).await;
                search.take(group, result, split).await;
            }
            Work::Halves(left, right) => {
                let (left_result, left_split) = search.attempt(&left).await;
                let (right_result, right_split) = search.attempt(&right).await;
                let timed_out =
                    |r: &Result<Inserted, DbError>| matches!(r, Err(e) if e.is_timeout());
                let both = timed_out(&left_result) && timed_out(&right_result);
                // Pushed so that the left half's rows are searched first, as the stack does.
                search.take(right, right_result, right_split && !both).await;
                search.take(left, left_result, left_split && !both).await;
            }
        }
    }
    let (pipeline, stage) = (config.stage.pipeline(), config.stage.stage().as_str());
    if search.splits > 0 {
        info!(
            pipeline,
            stage,
            batch_id,
            splits = search.splits,
            "batch split to isolate refused rows"
        );
    }
    if search.halvings > 0 {
        info!(
            pipeline,
            stage,
            batch_id,
            halvings = search.halvings,
            timed_out = search.timed_out,
            alone = search.alone,
            "batch that timed out split to find its slow rows; the others went on"
        );
    }
    search.out
}

/// A group of a batch's records, with their indices in the batch.
type Group<'r, R> = Vec<(usize, &'r R)>;

/// What the search for a batch's rows at fault still has to try.
enum Work<'r, R> {
    /// One group.
    Group(Group<'r, R>),
    /// The halves of a group that timed out, both tried before either is split again.
    Halves(Group<'r, R>, Group<'r, R>),
}

/// How many tries of one batch's search may time out and still be followed by a split: what
/// finding one slow row among `n` takes (the batch, then one half at each of ceil(log2 n)
/// halvings), and one more.
fn timeout_budget(n: usize) -> usize {
    let halvings = usize::BITS - n.saturating_sub(1).leading_zeros();
    halvings as usize + 2
}

/// The search for the rows at fault in one batch: what it still has to try, what it found, and
/// what it spent.
struct Isolation<'c, 'r, D: Domain> {
    config: &'c Arc<SinkConfig<D>>,
    batch_id: &'c str,
    /// Transient failures are retried in place until then (`DB_RETRY_WINDOW_MS` from the start).
    deadline: Instant,
    give_back_at: Option<Instant>,
    /// [`timeout_budget`] of the batch.
    timeout_budget: usize,
    stack: Vec<Work<'r, D::Record>>,
    out: Vec<GroupResult>,
    /// Splits after a refusal.
    splits: usize,
    /// Splits after a timeout.
    halvings: usize,
    /// Tries that timed out.
    timed_out: usize,
    /// Rows that timed out alone.
    alone: usize,
}

impl<'r, D: Domain> Isolation<'_, 'r, D> {
    /// Whether a group of `len` rows that times out now is split: it has more than one row, the
    /// search's budget is not spent, warren is not stopping (a stop cancels its statements with
    /// a 57014 too, and gives their batch back), and the batch has time for two more bounds
    /// before it is given back to the broker.
    fn splits_on_timeout(&self, len: usize) -> bool {
        len > 1
            && self.timed_out < self.timeout_budget
            && !self.config.stopping.is_cancelled()
            && !past_give_back(
                self.give_back_at,
                Instant::now(),
                self.config.db_bound.saturating_mul(2),
            )
    }

    /// Inserts `group` (retried in place as [`insert_retrying`] does, except a timeout that is
    /// to be split); the result, and whether a timeout of it is split.
    async fn attempt(&mut self, group: &Group<'r, D::Record>) -> (Result<Inserted, DbError>, bool) {
        let split = self.splits_on_timeout(group.len());
        let refs: Vec<&D::Record> = group.iter().map(|(_, r)| *r).collect();
        let result = insert_retrying(
            self.config,
            &refs,
            self.deadline,
            self.give_back_at,
            self.batch_id,
            !split,
        )
        .await;
        if matches!(&result, Err(e) if e.is_timeout()) {
            self.timed_out += 1;
        }
        (result, split)
    }

    /// What `group`'s try ended with: its result, or more work (its halves) when it failed in a
    /// way one of its rows may have caused; `split_timeout`: a timeout of it is split.
    async fn take(
        &mut self,
        group: Group<'r, D::Record>,
        result: Result<Inserted, DbError>,
        split_timeout: bool,
    ) {
        match result {
            Ok(done) => {
                let in_batch = |list: Vec<(usize, String)>| -> Vec<(usize, String)> {
                    list.into_iter()
                        .filter_map(|(j, reason)| group.get(j).map(|(i, _)| (*i, reason)))
                        .collect()
                };
                let refusals = Refusals {
                    conflicts: in_batch(done.conflicts),
                    refused: in_batch(done.refused),
                    stale: in_batch(done.stale),
                    deleted: done
                        .deleted
                        .iter()
                        .filter_map(|&j| group.get(j).map(|(i, _)| *i))
                        .collect(),
                };
                self.out
                    .push((group.into_iter().map(|(i, _)| i).collect(), Ok(refusals)));
            }
            // Checked again now: a stop that began while the statement ran cancels it with a
            // 57014 too, which is the stop's, not a slow row's (the full suite: batches blocked
            // on a lock at the stop were split, and said as timed out).
            Err(e) if split_timeout && e.is_timeout() && !self.config.stopping.is_cancelled() => {
                self.halvings += 1;
                let mut left = group;
                let right = left.split_off(left.len() / 2);
                self.stack.push(Work::Halves(left, right));
            }
            // Also while stopping: a group's error belongs to the group, not to each row, and
            // only the split can tell which row it was (the halves take milliseconds; without
            // it, a shutdown during a batch with one duplicate email dead-lettered the whole
            // batch, and the DLQ consumer parked it).
            Err(e) if group.len() > 1 && splits_on(&e) => {
                self.splits += 1;
                let mut left = group;
                let right = left.split_off(left.len() / 2);
                self.stack.push(Work::Group(right));
                self.stack.push(Work::Group(left));
            }
            // A row the server refuses on its own may be one it already holds exactly: a
            // redelivered copy whose first copy committed, refused now by a CHECK or trigger
            // added since. Then it is done, not refused (or it would end in the table and in
            // the DLQ or parking both).
            Err(e)
                if group.len() == 1
                    && e.server_answered()
                    && e.class() != ErrorClass::Systemic
                    && already_stored(self.config, group[0].1).await =>
            {
                info!(
                    pipeline = self.config.stage.pipeline(),
                    stage = self.config.stage.stage().as_str(),
                    batch_id = self.batch_id,
                    error = %e,
                    "a refused row is already stored as it is: done"
                );
                let refusals = Refusals {
                    conflicts: Vec::new(),
                    refused: Vec::new(),
                    stale: Vec::new(),
                    deleted: Vec::new(),
                };
                self.out.push((vec![group[0].0], Ok(refusals)));
            }
            // At a stop, a group whose statement got no answer (the link went silent, the
            // client's bound passed, `DbError::outcome_unknown`) may have committed: given back as it is, its messages
            // came again to the stage that follows, into another table after a reload that
            // changed it (review R35i F9: 4 messages in both tables). Asked of the table
            // first, on another connection, once the bound passed: the server ended such a
            // statement by then (its `statement_timeout`), and a transaction left open without
            // its COMMIT never commits (`idle_in_transaction_session_timeout` ends it). What is
            // stored as it is is done; the rest goes back, as all of it does when the
            // table cannot be asked.
            Err(e) if self.config.stopping.is_cancelled() && e.outcome_unknown() => {
                let stored = predecessors::stored_of(
                    &asker(self.config),
                    self.config.domain.as_ref(),
                    &group,
                )
                .await
                .unwrap_or_else(|asked| {
                    info!(
                        pipeline = self.config.stage.pipeline(),
                        stage = self.config.stage.stage().as_str(),
                        batch_id = self.batch_id,
                        error = %e,
                        asked = %asked,
                        rows = group.len(),
                        "rows whose statement got no answer at the stop: the table cannot say \
                         whether it stored them; they go back to their queue, and a stage a \
                         reload starts there asks this table about them"
                    );
                    vec![false; group.len()]
                });
                let (done, rest): (Vec<_>, Vec<_>) = group
                    .into_iter()
                    .zip(stored)
                    .partition(|(_, stored)| *stored);
                if !done.is_empty() {
                    info!(
                        pipeline = self.config.stage.pipeline(),
                        stage = self.config.stage.stage().as_str(),
                        batch_id = self.batch_id,
                        error = %e,
                        rows = done.len(),
                        "rows whose statement got no answer at the stop are stored as they are: done"
                    );
                    let refusals = Refusals {
                        conflicts: Vec::new(),
                        refused: Vec::new(),
                        stale: Vec::new(),
                        deleted: Vec::new(),
                    };
                    self.out.push((
                        done.into_iter().map(|((i, _), _)| i).collect(),
                        Ok(refusals),
                    ));
                }
                if !rest.is_empty() {
                    self.out
                        .push((rest.into_iter().map(|((i, _), _)| i).collect(), Err(e)));
                }
            }
            Err(e) => {
                if group.len() == 1 && e.is_timeout() {
                    self.alone += 1;
                }
                self.out
                    .push((group.into_iter().map(|(i, _)| i).collect(), Err(e)));
            }
        }
    }
}

/// Whether the table already holds `record` exactly, asked within the statement bound; `false`
/// when it cannot tell (the refusal then stands).
async fn already_stored<D: Domain>(config: &Arc<SinkConfig<D>>, record: &D::Record) -> bool {
    let Ok(client) = config.pool.get().await else {
        return false;
    };
    let Ok(running) = config.statements.enter(&client) else {
        return false;
    };
    let asked = tokio::time::timeout(config.db_bound, config.domain.stored(&client, record)).await;
    drop(running);
    match asked {
        Ok(result) => {
            crate::db::release(&config.pool, client, &result);
            result.unwrap_or(false)
        }
        Err(_) => {
            let _ = crate::db::abandon(client, config.db_bound);
            false
        }
    }
}

/// What `config`'s questions to a table need (`predecessors::stored_of`).
fn asker<D: Domain>(config: &SinkConfig<D>) -> Asker<'_> {
    Asker {
        pool: &config.pool,
        statements: &config.statements,
        db_bound: config.db_bound,
        stage: &config.stage,
    }
}

/// Whether a group failing with `e` is split to find the row that caused it.
fn splits_on(e: &DbError) -> bool {
    match e.class() {
        ErrorClass::Permanent => true,
        ErrorClass::Transient => e.may_be_row_specific(),
        ErrorClass::Systemic => false,
    }
}

/// When a batch whose oldest delivery arrived at `oldest` is given back instead of retried in
/// place any longer: `hand_back_after` later (`None`: never, the broker has no consumer timeout).
fn give_back_at(oldest: Option<Instant>, hand_back_after: Option<Duration>) -> Option<Instant> {
    Some(oldest? + hand_back_after?)
}

/// Whether the retry that would start after `delay` must not happen: it would start at or past
/// `give_back_at`, when the batch goes back to the broker instead.
fn past_give_back(give_back_at: Option<Instant>, now: Instant, delay: Duration) -> bool {
    give_back_at.is_some_and(|at| now + delay >= at)
}

/// One insert statement, retried in place (backon): transient errors until `deadline`, systemic
/// errors (the deployment is wrong) with the breaker open until they clear or warren stops, or
/// until `give_back_at`: then the error is returned as it is and the fallback stage gives the
/// batch back to its queue (a systemic error is requeued, `x-retries` untouched), so the broker's
/// `consumer_timeout` never closes the channel over it; the breaker keeps the consumer held.
/// Each attempt is bounded on the client side, so a half-open connection fails it in seconds.
/// `retry_timeouts`: a timeout is retried in place too (not when the group is split on it).
async fn insert_retrying<D: Domain>(
    config: &Arc<SinkConfig<D>>,
    records: &[&D::Record],
    deadline: Instant,
    give_back_at: Option<Instant>,
    batch_id: &str,
    retry_timeouts: bool,
) -> Result<Inserted, DbError> {
    let attempt = || async {
        let client = match config.pool.get().await {
            Ok(client) => client,
            Err(e) => {
                let e = DbError::from_pool(e);
                if matches!(e, DbError::Connection(_)) {
                    crate::events::database(false);
                }
                return Err(e);
            }
        };
        // Known to the stop, which cancels it if it still runs at the drain's deadline.
        let running = config.statements.enter(&client)?;
        // A table changed under a prepared statement: prepared again and run at once.
        let insert = crate::db::replanning(&config.pool, || config.domain.insert(&client, records));
        let result = match tokio::time::timeout(config.db_bound, insert).await {
            Ok(result) => {
                drop(running);
                crate::db::release(&config.pool, client, &result);
                result
            }
            Err(_) => {
                drop(running);
                // Too slow while the database answers is the work's failure (counted by the
                // DLQ consumer); no answer at all is an outage (never counted).
                Err(crate::db::abandon_asking(&config.pool, client, config.db_bound).await)
            }
        };
        match &result {
            Ok(_) => crate::events::database(true),
            Err(DbError::Connection(_)) => crate::events::database(false),
            Err(_) => {}
        }
        result
    };
    let (pipeline, stage) = (config.stage.pipeline(), config.stage.stage().as_str());
    let stopping = config.stopping.clone();
    attempt
        .retry(crate::amqp::reconnect_builder())
        .sleep(super::cancellable_sleep(stopping.clone()))
        .when(|e| {
            !stopping.is_cancelled()
                && e.class() != ErrorClass::Permanent
                && (retry_timeouts || !e.is_timeout())
        })
        .adjust(|e, delay| match (e.class(), delay) {
            (ErrorClass::Transient, Some(d)) if Instant::now() + d > deadline => None,
            (_, Some(d)) if past_give_back(give_back_at, Instant::now(), d) => {
                warn!(pipeline, stage, batch_id, error = %e,
                    "batch held unacked near the broker's consumer_timeout \
                     (AMQP_CONSUMER_TIMEOUT_MS); giving it back to the queue");
                crate::events::emit(
                    Some(config.stage.pipeline()),
                    crate::events::Kind::GivenBack {
                        count: records.len() as u64,
                        reason: "consumer_timeout".into(),
                    },
                );
                None
            }
            _ => delay,
        })
        .notify(|e, delay| {
            let retry_in_ms = delay.as_millis() as u64;
            if e.class() == ErrorClass::Systemic {
                error!(pipeline, stage, batch_id, error = %e, retry_in_ms,
                    "SYSTEMIC database error: the deployment is wrong (table, privileges, database); \
                     holding the batch, no message is dead-lettered");
                crate::events::emit(
                    Some(config.stage.pipeline()),
                    crate::events::Kind::Error {
                        message: format!("systemic database error: {e}"),
                    },
                );
                config
                    .breaker
                    .trip("systemic database error", &config.domain, &config.pool);
            } else {
                warn!(pipeline, stage, batch_id, error = %e, retry_in_ms,
                    "transient database error; retrying the batch in place");
            }
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_search_may_split_as_often_as_finding_one_slow_row_takes_and_once_more() {
        // The batch, then one group per halving: ceil(log2 n) + 1 timeouts find one slow row.
        assert_eq!(timeout_budget(1), 2);
        assert_eq!(timeout_budget(2), 3);
        assert_eq!(timeout_budget(20), 7);
        assert_eq!(timeout_budget(32), 7);
        assert_eq!(timeout_budget(33), 8);
        assert_eq!(timeout_budget(1000), 12);
        assert_eq!(timeout_budget(0), 2);
    }

    #[test]
    fn a_batch_is_given_back_at_its_oldest_delivery_plus_the_hand_back_time() {
        let oldest = Instant::now();
        let after = Duration::from_secs(24 * 60);
        assert_eq!(
            give_back_at(Some(oldest), Some(after)),
            Some(oldest + after)
        );
        assert_eq!(
            give_back_at(Some(oldest), None),
            None,
            "no consumer timeout"
        );
        assert_eq!(give_back_at(None, Some(after)), None, "no delivery");
    }

    #[test]
    fn a_retry_starting_at_or_past_the_give_back_time_does_not_happen() {
        let now = Instant::now();
        let at = Some(now + Duration::from_secs(10));
        assert!(!past_give_back(at, now, Duration::from_secs(9)));
        assert!(past_give_back(at, now, Duration::from_secs(10)));
        assert!(past_give_back(
            at,
            now + Duration::from_secs(11),
            Duration::ZERO
        ));
        assert!(!past_give_back(None, now, Duration::from_secs(1_000_000)));
    }
}
