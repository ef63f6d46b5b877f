//! The main pipeline's fallback stage and the outcome policy: which failure goes where. A
//! message the domain or the database refused for good goes to the DLX with `x-error-kind` /
//! `x-error-reason`; a transient failure through the retry queue with `x-retries` + 1 (the n-th
//! retry through the n-th tier's queue, later ones through the last) until `MAX_RETRIES`, then to
//! the DLX; a systemic one stays with the broker. A body over `MAX_MESSAGE_BYTES` is parked here
//! ([`Fallback::park_over`]); if parking fails it goes back to its queue after the requeue
//! backoff (never to the broker's dead-lettering), and is parked once the database takes it;
//! what is republished goes a few MiB of bodies at a time ([`ROUTE_KIB`]). Every republish is
//! confirmed before the original is acked; a copy whose ack was lost with the link, or whose
//! confirm came late (in doubt), is remembered (`copies.rs`) and its redelivery acked as already
//! routed. A republish not confirmed leaves the message with its queue (requeue after a backoff),
//! not with the broker's dead-lettering, at-most-once and lost if its target is missing then.
//! The publishing itself (groups, isolating an offender, in doubt) is `router/republisher.rs`.

mod republisher;

use crate::metrics::StageId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use actix::prelude::*;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::copies::{Copies, Fingerprint, Recall};
use super::message::{Delivery, Disposition, Failure, Leftovers, Settle};
use crate::amqp::headers;
use crate::db::{ErrorClass, dead_letters};
use crate::domain::ErrorKind;
use crate::metrics;

pub use republisher::{InDoubt, ROUTE_KIB, Republisher, Sent, send_isolating};

/// Where one message should go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A transient failure: through the retry queue, unless its retries are spent.
    Retry { reason: String },
    /// Asked again later ([`Failure::Waits`]): through the first retry tier, its `x-retries`
    /// as they are.
    Wait { reason: String },
    /// Straight to the DLQ with this `x-error-kind`.
    DeadLetter { kind: ErrorKind, reason: String },
    /// The DLQ consumer tries again later: back to the DLQ with `x-dlq-attempts` = `attempts`.
    /// `waits`: asked again because it waits ([`Failure::Waits`]), its attempts as they were:
    /// counted as a wait, not as an attempt spent.
    DlqAttempt {
        attempts: u32,
        reason: String,
        waits: bool,
    },
}

/// How one message that was not inserted ends, before its settlement.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    /// Settled as is.
    Settled(Disposition),
    /// Republished (retry, DLX, back to the DLQ), then acked once confirmed.
    Route(Route),
    /// Parked in `dead_letters` (DLQ consumer), then acked once committed.
    Park { kind: ErrorKind, reason: String },
    /// Given back to its queue after a backoff, for this reason (counted).
    Requeue(&'static str),
}

/// The main pipeline's policy: where a message that failed this way goes. `oversize`: its body
/// is over `MAX_MESSAGE_BYTES`; refused, it is parked here, never republished (see
/// [`Fallback::park_over`]).
pub fn main_fate(failure: &Failure, oversize: bool) -> Fate {
    match failure {
        Failure::Refused { kind, reason } if oversize => Fate::Park {
            kind: *kind,
            reason: reason.clone(),
        },
        Failure::Refused { kind, reason } => Fate::Route(Route::DeadLetter {
            kind: *kind,
            reason: reason.clone(),
        }),
        Failure::Db { class, reason, .. } => match class {
            ErrorClass::Permanent => Fate::Route(Route::DeadLetter {
                kind: ErrorKind::DbPermanent,
                reason: reason.to_string(),
            }),
            ErrorClass::Transient => Fate::Route(Route::Retry {
                reason: reason.to_string(),
            }),
            // Systemic errors only end here at shutdown, or when the sink gives a batch back before
            // the broker's consumer_timeout: the message stays with the broker.
            ErrorClass::Systemic => Fate::Settled(Disposition::Requeue),
        },
        Failure::Waits { reason } => Fate::Route(Route::Wait {
            reason: reason.to_string(),
        }),
    }
}

/// What a fallback stage shares with its pipeline.
pub struct Fallback {
    /// The pipeline and which of its stages: the labels of its logs and metrics.
    pub stage: StageId,
    pub republisher: Republisher,
    /// The consumer's acks.
    pub settle: Recipient<Settle>,
    /// Cancelled at shutdown: backoffs end at once (the messages are requeued without delay).
    pub stopping: CancellationToken,
    /// Consecutive batches that gave messages back to their queue (drives their backoff).
    pub requeues: AtomicU32,
    /// Where messages are parked: the DLQ consumer's refused ones, and any message warren
    /// cannot republish (it is in warren's hands and must not cycle).
    pub pool: deadpool_postgres::Pool,
    /// Client-side bound on the park statement.
    pub db_bound: Duration,
    /// The stage's statements in flight: its stop cancels a park running at its deadline.
    pub statements: Arc<crate::db::Statements>,
    /// The pipeline parked rows are filed under (`dead_letters.pipeline`).
    pub parks_as: String,
    /// `MAX_MESSAGE_BYTES`: a refused body over it is parked at once, never republished: the
    /// DLQ consumer would refuse it too, and the way through the DLQ held it thrice at once
    /// (a 100 MiB body OOM-killed a 256 MiB container at every restart, review F3). Parked
    /// here it is held once, streamed a piece at a time (`dead_letters::PIECE`).
    pub park_over: usize,
    /// The generation of the consumer's open channel, and the copies whose ack is not proven
    /// handled by the broker (shared with the consumer).
    pub copies: Arc<Copies>,
    /// This stage's start (`acked::incarnation`): a park whose outcome the stop cannot know is
    /// remembered under it.
    pub incarnation: u64,
    /// The names the stages this process's reloads stopped on the same queue parked under,
    /// when other than this one's (a pipeline renamed on the same queue): a redelivery one of
    /// them parked, whose ack may be lost, is not parked again under the new name (review R40a
    /// F6: parked under both names).
    pub parked_before: Vec<String>,
    /// 80% of the broker's `consumer_timeout` (`AmqpConfig::hand_back_after`): a backoff never
    /// holds a delivery past it.
    pub hand_back_after: Option<Duration>,
}

impl Fallback {
    /// `delay`, cut so that deliveries received at `oldest` are given back before the broker's
    /// `consumer_timeout` closes their channel (review R38f F5: a body over the limit held 49 s
    /// through its park's backoff under a 20 s timeout).
    pub fn within_hand_back(
        &self,
        delay: Duration,
        oldest: Option<std::time::Instant>,
    ) -> Duration {
        match (self.hand_back_after, oldest) {
            (Some(bound), Some(at)) => delay.min(bound.saturating_sub(at.elapsed())),
            _ => delay,
        }
    }

    /// Republishes every `Fate::Route` (confirmed); each becomes an ack once confirmed, a
    /// requeue if it was not, or a park if it can never be republished as it is.
    ///
    /// A delivery whose channel is gone (the link was lost while it was in the pipeline) is not
    /// republished: the broker took it back when the channel closed and delivers it again, and a
    /// copy routed now would be routed again then, a second copy in the DLQ or the retry queue
    /// (found by review). It is settled as given back, which the consumer drops with the channel.
    ///
    /// A copy confirmed whose ack is then lost with its link (the channel died before the broker
    /// handled it) is remembered ([`Copies`]): its redelivery is acked as already routed, not
    /// routed again; one whose copy is still being published waits for that outcome (at most
    /// twice the publish patience and 5 s, else it goes back to its queue, `copy_pending`).
    ///
    /// A copy sent and not confirmed in time is in doubt ([`Sent::InDoubt`]): its original goes
    /// back to its queue as for a failure, but the memory keeps it ([`Copies::in_doubt`]), a
    /// task learns the late confirm and tells the memory, and the redelivery waits for it
    /// (acked as already routed if it was confirmed, routed if not).
    pub async fn route_all(&self, items: &[(Delivery, Failure)], fates: &mut [Fate]) {
        let live = self.copies.live();
        let mut stale = 0usize;
        let mut redelivered = Vec::new();
        for (i, fate) in fates.iter_mut().enumerate() {
            if let Fate::Route(_) = fate {
                if items[i].0.generation != live {
                    *fate = Fate::Settled(Disposition::Requeue);
                    stale += 1;
                } else if items[i].0.redelivered {
                    redelivered.push(i);
                }
            }
        }
        if !redelivered.is_empty() && self.copies.any_lost() {
            self.recall(items, fates, redelivered).await;
        }
        let mut indices = Vec::new();
        let mut keys = Vec::new();
        for (i, fate) in fates.iter().enumerate() {
            if let Fate::Route(_) = fate {
                let d = &items[i].0;
                indices.push(i);
                keys.push((d.generation, d.tag, self.copies.fingerprint(d)));
            }
        }
        // Remembered before the publish, under the lock that the link's end takes: a copy is
        // either published for a live channel (and moves to the lost ones if the link dies) or
        // not at all.
        let allowed = self.copies.publishing(&keys);
        let mut routes: Vec<(&Delivery, Route)> = Vec::new();
        let mut routed_at = Vec::new();
        for (i, ok) in indices.into_iter().zip(allowed) {
            match (&fates[i], ok) {
                (Fate::Route(route), true) => {
                    routes.push((&items[i].0, route.clone()));
                    routed_at.push(i);
                }
                _ => {
                    fates[i] = Fate::Settled(Disposition::Requeue);
                    stale += 1;
                }
            }
        }
        if stale > 0 {
            info!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = stale,
                "not republished: the channel that delivered them is gone, and the broker \
                 delivers them again"
            );
        }
        if routes.is_empty() {
            return;
        }
        let (outcomes, in_doubt) = self.republisher.route(&routes).await;
        let mut ended: Vec<(u64, u64, bool)> = Vec::with_capacity(outcomes.len());
        let mut doubtful: Vec<(u64, u64)> = Vec::new();
        for (&i, (sent, _)) in routed_at.iter().zip(&outcomes) {
            let d = &items[i].0;
            match sent {
                Sent::InDoubt(_) => doubtful.push((d.generation, d.tag)),
                sent => ended.push((d.generation, d.tag, *sent == Sent::Confirmed)),
            }
        }
        self.copies.published(&ended);
        if !doubtful.is_empty() {
            // Their originals go back to their queue: remembered for the redeliveries, which
            // wait for the late outcome (then acked as already routed, or routed).
            self.copies.in_doubt(&doubtful);
            let keys: Vec<(u64, u64)> = routed_at
                .iter()
                .map(|&i| (items[i].0.generation, items[i].0.tag))
                .collect();
            let (copies, stage) = (self.copies.clone(), self.stage.clone());
            tokio::spawn(async move {
                let late: Vec<(u64, u64, bool)> = in_doubt
                    .outcomes()
                    .await
                    .into_iter()
                    .filter_map(|(k, ok)| keys.get(k).map(|&(g, t)| (g, t, ok)))
                    .collect();
                copies.published(&late);
                let confirmed = late.iter().filter(|(.., ok)| *ok).count();
                info!(
                    pipeline = stage.pipeline(),
                    stage = stage.stage().as_str(),
                    confirmed,
                    not_confirmed = late.len() - confirmed,
                    "republishes in doubt ended: the redeliveries of those confirmed are acked \
                     as already routed, the others are routed"
                );
            });
        }
        let mut routed = Vec::new();
        for (i, (sent, kind)) in routed_at.into_iter().zip(outcomes) {
            fates[i] = match sent {
                Sent::Confirmed => {
                    let d = &items[i].0;
                    let trace = headers::traceparent(&d.properties.full());
                    metrics::message_routed(
                        &self.stage,
                        kind,
                        d.message_id(),
                        d.tag,
                        trace.as_deref(),
                    );
                    if !metrics::is_retry_kind(kind) {
                        crate::events::emit(
                            Some(self.stage.pipeline()),
                            crate::events::Kind::DeadLettered {
                                message_id: d.message_id().to_string(),
                                kind: kind.to_string(),
                                reason: items[i].1.to_string(),
                                traceparent: trace,
                            },
                        );
                    }
                    routed.push(kind);
                    Fate::Settled(Disposition::Ack)
                }
                Sent::Failed(_) | Sent::InDoubt(_) => Fate::Requeue("publish_failed"),
                Sent::Unpublishable(why) => Fate::Park {
                    kind: ErrorKind::Unpublishable,
                    reason: format!("{why}; it was to go on as {kind}: {}", items[i].1),
                },
            };
        }
        for (kind, n) in count_by_kind(routed.into_iter()) {
            metrics::messages_routed(&self.stage, kind, n);
        }
    }

    /// At a stop, what the database did not take for a passing reason (an outage, a timeout, a
    /// statement the stop cancelled: `ErrorClass::Transient`) goes back to the broker
    /// unprocessed, nack with requeue at once: no retry (nor DLQ attempt) is spent on it, and
    /// it is counted as given back (review F4: a stop in an outage spent a retry on each).
    pub fn give_back_at_stop(&self, items: &[(Delivery, Failure)], fates: &mut [Fate]) {
        if !self.stopping.is_cancelled() {
            return;
        }
        let mut given_back = 0u64;
        for ((_, failure), fate) in items.iter().zip(fates.iter_mut()) {
            let transient = matches!(
                failure,
                Failure::Db {
                    class: ErrorClass::Transient,
                    ..
                }
            );
            if transient && !matches!(fate, Fate::Settled(_)) {
                *fate = Fate::Settled(Disposition::Requeue);
                given_back += 1;
            }
        }
        if given_back > 0 {
            metrics::requeued(&self.stage, "stopping", given_back);
            info!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = given_back,
                "stopping: messages the database did not take go back to their queue unprocessed \
                 (no retry spent; the next consumer takes them)"
            );
        }
    }

    /// Looks the redeliveries at `indices` (each a `Fate::Route`) up in the memory of copies:
    /// one whose copy was confirmed before its link died is acked as already routed; one whose
    /// copy is still being published waits for the outcome (bounded, then it goes back to its
    /// queue); any other is routed.
    async fn recall(&self, items: &[(Delivery, Failure)], fates: &mut [Fate], indices: Vec<usize>) {
        let bound = self.republisher.patience * 2 + Duration::from_secs(5);
        let deadline = tokio::time::Instant::now() + bound;
        let fingerprints: Vec<(usize, Fingerprint)> = indices
            .into_iter()
            .map(|i| (i, self.copies.fingerprint(&items[i].0)))
            .collect();
        let mut open = fingerprints;
        let mut acked: Vec<&Delivery> = Vec::new();
        loop {
            let outcome = self.copies.outcome();
            let mut pending = Vec::new();
            for (i, fingerprint) in open {
                match self.copies.recall(&items[i].0, fingerprint) {
                    Recall::Routed => {
                        fates[i] = Fate::Settled(Disposition::Ack);
                        acked.push(&items[i].0);
                    }
                    Recall::Pending => pending.push((i, fingerprint)),
                    Recall::Unknown => {}
                }
            }
            open = pending;
            if open.is_empty() {
                break;
            }
            let waited = tokio::select! {
                _ = outcome => true,
                _ = tokio::time::sleep_until(deadline) => false,
                _ = self.stopping.cancelled() => false,
            };
            if !waited {
                warn!(
                    pipeline = self.stage.pipeline(),
                    stage = self.stage.stage().as_str(),
                    count = open.len(),
                    "redeliveries whose earlier copy is still being published go back to their \
                     queue"
                );
                for (i, _) in &open {
                    fates[*i] = Fate::Requeue("copy_pending");
                }
                break;
            }
        }
        if !acked.is_empty() {
            metrics::redeliveries(&self.stage, "already_routed", acked.len() as u64);
            let ids: Vec<&str> = acked.iter().take(10).map(|d| d.message_id()).collect();
            info!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = acked.len(),
                message_ids = ?ids,
                "redeliveries acked as already routed: their copies were confirmed before the \
                 link that delivered them went down with their acks"
            );
        }
    }

    /// Parks every `Fate::Park` with one statement (row by row if refused); each becomes an
    /// ack once committed; if the database does not take it, a requeue (after the backoff).
    pub async fn park_all(&self, items: &[(Delivery, Failure)], fates: &mut [Fate]) {
        let mut indices = Vec::new();
        let mut kinds = Vec::new();
        let mut rows = Vec::new();
        for (i, fate) in fates.iter().enumerate() {
            if let Fate::Park { kind, reason } = fate {
                let d = &items[i].0;
                indices.push(i);
                kinds.push(kind.as_str());
                rows.push(dead_letters::ParkRow {
                    pipeline: &self.parks_as,
                    message_id: d
                        .properties
                        .bare()
                        .message_id()
                        .as_ref()
                        .map(|m| m.as_str()),
                    body: &d.body,
                    headers: headers::parked_json(
                        &d.properties.full(),
                        d.exchange.as_str(),
                        d.routing_key.as_str(),
                    ),
                    kind: kind.as_str(),
                    reason,
                });
            }
        }
        if rows.is_empty() {
            return;
        }
        // Parked already under the name a reload replaced: acked as done, not parked again.
        let before = self.parked_before(items, &indices, &rows).await;
        if !before.is_empty() {
            let kept: Vec<bool> = indices.iter().map(|i| !before.contains(i)).collect();
            let mut at = kept.iter();
            rows.retain(|_| *at.next().unwrap_or(&true));
            let mut at = kept.iter();
            kinds.retain(|_| *at.next().unwrap_or(&true));
            indices.retain(|i| !before.contains(i));
            if rows.is_empty() {
                drop(rows);
                for i in before {
                    fates[i] = Fate::Settled(Disposition::Ack);
                }
                return;
            }
        }
        let result = dead_letters::park(&self.pool, self.db_bound, &self.statements, &rows).await;
        drop(rows);
        let settled = match result {
            Ok(parked) => {
                if parked.bare > 0 {
                    warn!(
                        pipeline = self.stage.pipeline(),
                        stage = self.stage.stage().as_str(),
                        bare = parked.bare,
                        "some messages were parked without their headers (the database refused them)"
                    );
                }
                for i in &indices {
                    if let (d, Fate::Park { kind, reason }) = (&items[*i].0, &fates[*i]) {
                        crate::events::emit(
                            Some(self.stage.pipeline()),
                            crate::events::Kind::Parked {
                                message_id: d.message_id().to_string(),
                                kind: kind.as_str().to_string(),
                                reason: reason.clone(),
                                traceparent: headers::traceparent(&d.properties.full()),
                            },
                        );
                    }
                }
                for (kind, n) in count_by_kind(kinds.into_iter()) {
                    metrics::messages_parked(&self.stage, kind, n);
                }
                Fate::Settled(Disposition::Ack)
            }
            // Given back (after the requeue backoff), in every stage: the broker keeps them until
            // the database takes them. Not the broker's dead-lettering (a nack without requeue):
            // RabbitMQ dead-letters at most once, and a DLQ unbound or deleted at that moment
            // dropped two 8 MiB bodies (review R38b-F1). A refused body over MAX_MESSAGE_BYTES
            // held for its backoff does not hold the window behind it: the accepted deliveries
            // behind it flow meanwhile (`tests/memory.rs`).
            // At a stop, a park that failed for a passing reason is the stop's doing: the drain
            // cancelled it near its deadline (SQLSTATE 57014: it still waited on a lock, a slow
            // server) or no longer started it. Said as such, not as the database failing (an
            // ERROR saying the database did not take them read as an outage, review R35), and
            // given back at once, like what the sink gives back then (`give_back_at_stop`).
            Err(e) if self.stopping.is_cancelled() && e.is_transient() => {
                let (pipeline, stage) = (self.stage.pipeline(), self.stage.stage().as_str());
                let count = indices.len();
                if e.sqlstate() == Some(tokio_postgres::error::SqlState::QUERY_CANCELED.code()) {
                    info!(
                        pipeline,
                        stage,
                        count,
                        "park cancelled by the stop: it still waited at the drain's deadline (a \
                         lock, a slow server); its messages go back to their queue unparked, and \
                         the next consumer parks them"
                    );
                } else if e.outcome_unknown() {
                    // The park may have committed, its answer lost (the link half-open): they
                    // go back remembered as acks this stage may have made, so that a DLQ stage
                    // a reload starts asks the parking about them (review R47a F4: said "not
                    // parked", they were parked, and the next stage, whose mapping accepted
                    // them, stored them too; or parked them under its new name).
                    let prints: Vec<super::acked::AckPrint> = indices
                        .iter()
                        .map(|&i| {
                            let d = &items[i].0;
                            super::acked::print(&d.body, d.properties.bare())
                        })
                        .collect();
                    self.copies.acked().give_back(self.incarnation, &prints);
                    info!(pipeline, stage, count, reason = %e,
                        "messages whose park got no answer at the stop: the parking may hold \
                         them; they go back to their queue, and a stage a reload starts there \
                         asks the parking about them");
                } else {
                    info!(pipeline, stage, count, reason = %e,
                        "messages not parked during the stop; they go back to their queue \
                         unparked, and the next consumer parks them");
                }
                metrics::requeued(&self.stage, "stopping", count as u64);
                Fate::Settled(Disposition::Requeue)
            }
            Err(e) => {
                let ids: Vec<&str> = indices
                    .iter()
                    .take(10)
                    .map(|i| items[*i].0.message_id())
                    .collect();
                error!(pipeline = self.stage.pipeline(), stage = self.stage.stage().as_str(), error = %e, count = indices.len(), message_ids = ?ids,
                    "cannot park messages; they go back to their queue until the database takes them");
                Fate::Requeue("db_unavailable")
            }
        };
        for i in indices {
            fates[i] = settled.clone();
        }
        for i in before {
            fates[i] = Fate::Settled(Disposition::Ack);
        }
    }

    /// Of the messages about to be parked (`indices` into `items`, their `rows`), those a stage
    /// a reload replaced parked already under another name ([`Fallback::parked_before`]):
    /// redeliveries only. Counted and logged; what cannot be asked is parked as any other.
    async fn parked_before(
        &self,
        items: &[(Delivery, Failure)],
        indices: &[usize],
        rows: &[dead_letters::ParkRow<'_>],
    ) -> std::collections::HashSet<usize> {
        let mut found = std::collections::HashSet::new();
        for name in &self.parked_before {
            let asked: Vec<(usize, Vec<u8>)> = indices
                .iter()
                .zip(rows)
                .filter(|(i, _)| items[**i].0.redelivered && !found.contains(*i))
                .map(|(i, r)| {
                    (
                        *i,
                        dead_letters::fingerprint(r.message_id, r.body, &r.headers),
                    )
                })
                .collect();
            if asked.is_empty() {
                break;
            }
            let prints: Vec<Vec<u8>> = asked.iter().map(|(_, f)| f.clone()).collect();
            let parked = match dead_letters::parked_of(
                &self.pool,
                self.db_bound,
                &self.statements,
                name,
                &prints,
            )
            .await
            {
                Ok(parked) => parked,
                Err(e) => {
                    warn!(
                        pipeline = self.stage.pipeline(),
                        stage = self.stage.stage().as_str(),
                        before = %name,
                        error = %e,
                        "cannot ask whether redeliveries were parked under a name a reload \
                         replaced; they are parked under this one"
                    );
                    continue;
                }
            };
            let here: Vec<usize> = asked
                .iter()
                .filter(|(_, f)| parked.contains(f))
                .map(|(i, _)| *i)
                .collect();
            if !here.is_empty() {
                metrics::redeliveries(&self.stage, "settled_before_reload", here.len() as u64);
                info!(
                    pipeline = self.stage.pipeline(),
                    stage = self.stage.stage().as_str(),
                    before = %name,
                    count = here.len(),
                    "redeliveries acked as done: a stage a reload replaced had parked them \
                     under its name (their acks may have been lost with its link)"
                );
                found.extend(here);
            }
        }
        found
    }

    /// Settles every message of the batch: at once, except what goes back to its queue
    /// (`Fate::Requeue`), which is held a requeue backoff first, so a failure that repeats is
    /// never a hot loop (`waited`: the backoff was already spent on this batch, settle at once).
    /// The hold is a task of its own: the sink goes on with its next batch meanwhile, and the
    /// consumer acks what settles behind the held messages (`acks.rs`).
    pub async fn settle(
        &self,
        batch_id: &str,
        items: Vec<(Delivery, Failure)>,
        fates: Vec<Fate>,
        waited: bool,
    ) {
        let requeued: Vec<&'static str> = fates
            .iter()
            .filter_map(|f| match f {
                Fate::Requeue(reason) => Some(*reason),
                _ => None,
            })
            .collect();
        let mut delay = None;
        if !requeued.is_empty() {
            let wait = if waited {
                requeue_backoff(self.requeues.load(Ordering::Relaxed))
            } else {
                self.next_backoff()
            };
            let wait = self.within_hand_back(wait, items.iter().map(|(d, _)| d.received_at).min());
            for (reason, n) in count_by_kind(requeued.into_iter()) {
                metrics::requeued(&self.stage, reason, n);
                warn!(
                    pipeline = self.stage.pipeline(),
                    stage = self.stage.stage().as_str(),
                    batch_id,
                    reason,
                    count = n,
                    delay_ms = wait.as_millis() as u64,
                    "messages go back to their queue after a backoff"
                );
            }
            delay = (!waited).then_some(wait);
        } else if !waited && fates.iter().all(|f| matches!(f, Fate::Settled(_))) {
            self.requeues.store(0, Ordering::Relaxed);
        }
        // A body over MAX_MESSAGE_BYTES is never held through the backoff: it holds the
        // process's one permit while it is in memory, and every other stage and pipeline waited
        // for it (review R38h F1); its consumer holds it aside and waits the backoff itself,
        // without the permit (`Consumer::oversize_rotate`).
        let (now, later): (Vec<_>, Vec<_>) = items
            .iter()
            .zip(fates)
            .map(|((d, _), fate)| match fate {
                Fate::Settled(disposition) => (d, disposition, false),
                _ => (
                    d,
                    Disposition::Requeue,
                    delay.is_some() && d.body.len() <= self.park_over,
                ),
            })
            .partition(|(.., held)| !held);
        for settle in Settle::group(now.into_iter().map(|(d, disposition, _)| (d, disposition))) {
            self.settle.do_send(settle);
        }
        if let Some(delay) = delay {
            let (settle, stopping) = (self.settle.clone(), self.stopping.clone());
            let copies = self.copies.clone();
            let generation = later.iter().map(|(d, ..)| d.generation).max();
            let later = Settle::group(
                later
                    .into_iter()
                    .map(|(d, disposition, _)| (d, disposition)),
            );
            tokio::spawn(async move {
                backoff_while_linked(delay, &stopping, &copies, generation.unwrap_or(0)).await;
                for s in later {
                    settle.do_send(s);
                }
            });
        }
    }

    /// The next delay of the requeue backoff (the streak grows by one).
    pub fn next_backoff(&self) -> Duration {
        self.next_backoff_at_most(u32::MAX)
    }

    /// The same, but never more steps than `steps` (the streak still grows by one): a delay
    /// for messages that were tried only that often.
    pub fn next_backoff_at_most(&self, steps: u32) -> Duration {
        let streak = self.requeues.fetch_add(1, Ordering::Relaxed) + 1;
        requeue_backoff(streak.min(steps.max(1)))
    }
}

/// A requeue backoff of deliveries of channel `generation` (the newest among them): it ends
/// at its delay, at the stop, or as soon as that channel is gone (the broker has them back
/// already; the consumer counted them in flight until they settle, and a body whose park
/// failed, holding the stage's permit, kept the stage still for its whole backoff after a lost
/// link: review R38g F4).
pub async fn backoff_while_linked(
    delay: Duration,
    stopping: &CancellationToken,
    copies: &Copies,
    generation: u64,
) {
    tokio::select! {
        _ = super::sleep_or_cancel(delay, stopping) => {}
        _ = copies.gone(generation) => {}
    }
}

/// The main pipeline's fallback stage: dead-letters or retries what the sink did not insert.
pub struct Router {
    fallback: Arc<Fallback>,
}

impl Router {
    pub fn new(fallback: Fallback) -> Self {
        Self {
            fallback: Arc::new(fallback),
        }
    }
}

impl Actor for Router {
    type Context = Context<Self>;
}

impl Supervised for Router {}

impl Handler<Leftovers> for Router {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, msg: Leftovers, _: &mut Self::Context) -> Self::Result {
        let fallback = self.fallback.clone();
        Box::pin(async move {
            let mut fates: Vec<Fate> = msg
                .items
                .iter()
                .map(|(d, f)| main_fate(f, d.body.len() > fallback.park_over))
                .collect();
            fallback.give_back_at_stop(&msg.items, &mut fates);
            fallback.route_all(&msg.items, &mut fates).await;
            fallback.park_all(&msg.items, &mut fates).await;
            fallback
                .settle(&msg.batch_id, msg.items, fates, false)
                .await;
        })
    }
}

/// How many of each kind, in first-seen order (a handful of kinds per batch at most).
pub fn count_by_kind(kinds: impl Iterator<Item = &'static str>) -> Vec<(&'static str, u64)> {
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
pub fn requeue_backoff(streak: u32) -> Duration {
    crate::amqp::backoff(Duration::from_millis(200), Duration::from_secs(30))
        .nth(streak.saturating_sub(1).min(32) as usize)
        .unwrap_or(Duration::from_secs(30))
}

#[cfg(test)]
mod tests;
