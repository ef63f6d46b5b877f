//! The republisher: a stage's confirmed publishes of what it routes (to the retry exchange's
//! tiers, the DLX, back to the DLQ), planned from a [`Route`] and the retry budget, sent a few
//! MiB of bodies at a time ([`ROUTE_KIB`]), each offender isolated by publishing it alone
//! ([`send_isolating`]), and those sent but not confirmed in time answered as in doubt
//! ([`InDoubt`]) with how to learn their late outcome. Which failure takes which route is
//! `router.rs`'s.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tracing::{error, warn};

use super::Route;
use crate::amqp::AmqpError;
use crate::amqp::headers::{self, Retries};
use crate::amqp::publisher::{Group, Late, Publish, PublishAll, Publisher};
use crate::amqp::republish::{self, Unpublishable};
use crate::domain::ErrorKind;
use crate::metrics::StageId;
use crate::pipeline::Spec;
use crate::pipeline::message::Delivery;

/// Republishes messages to the retry exchange or the DLX, confirmed.
#[derive(Clone)]
pub struct Republisher {
    publisher: Addr<Publisher>,
    retry_exchange: String,
    /// The retry tiers' queues, in order (one without `RETRY_TTLS_MS`): the routing keys of
    /// the first, second, ... retry.
    retry_queues: Vec<String>,
    dlx_exchange: String,
    dlq_queue: String,
    /// Where the retry tiers dead-letter a copy back to (its `x-death` must not name it).
    main_queue: String,
    max_retries: u32,
    /// The pipeline and which of its stages: the labels of its logs.
    stage: StageId,
    /// How long a publish waits for the publisher to (re)connect (the fallback stage's wait
    /// for a copy still being published is bounded by it too).
    pub(super) patience: Duration,
    /// The body bytes this stage's copies may hold at once, in KiB ([`ROUTE_KIB`]), shared by
    /// its batches in flight.
    allowance: Arc<tokio::sync::Semaphore>,
}

/// Body bytes (in KiB) one stage republishes at once at most, beside one body larger than that
/// alone: lapin copies every body it publishes into frames, held until they are written to the
/// socket. A batch's refused bodies went as one group, copied at once, for every batch in
/// flight: with 64 KiB bodies and a 64 MiB budget the copies held about as much again as the
/// window (review F1). Groups of at most this many bytes go one after another, and the stage's
/// batches in flight share the allowance.
pub const ROUTE_KIB: usize = 4 << 10;

impl Republisher {
    /// The republisher of `spec`'s stage; a publish waits at most `patience` for the publisher
    /// to (re)connect.
    pub fn new(publisher: Addr<Publisher>, spec: &Spec, patience: Duration) -> Self {
        let names = &spec.names;
        Self {
            publisher,
            retry_exchange: names.retry_exchange.clone(),
            retry_queues: names.retry_tiers.iter().map(|t| t.queue.clone()).collect(),
            dlx_exchange: names.dlx_exchange.clone(),
            dlq_queue: names.dlq_queue.clone(),
            main_queue: names.main_queue.clone(),
            max_retries: spec.max_retries,
            stage: StageId::new(&spec.pipeline, spec.stage),
            patience,
            allowance: Arc::new(tokio::sync::Semaphore::new(ROUTE_KIB)),
        }
    }

    /// The publish for `message` along `route`, after applying the retry budget, and the kind
    /// it is counted as (`retry`, `dlq_retry` or an `x-error-kind`).
    pub fn plan(&self, message: &Delivery, route: &Route) -> (Publish, &'static str) {
        let full = message.properties.full();
        let retries = headers::retries(&full);
        if let Retries::Invalid(what) = &retries {
            warn!(message_id = message.message_id(), pipeline = self.stage.pipeline(), stage = self.stage.stage().as_str(), delivery_tag = message.tag, problem = %what,
                "unusable x-retries treated as 0; it is rewritten as an integer");
        }
        let count = retries.count();
        // What the dead-lettered copy says of its retries: the count read, or nothing over an
        // unreadable one (the headers keep whatever the parser could not read).
        let written = (retries != Retries::Unreadable).then_some(count);
        let (exchange, routing_key, properties, kind) = match route {
            Route::Retry { reason } if count < self.max_retries => (
                &self.retry_exchange,
                &self.retry_queues[retry_tier(count + 1, self.retry_queues.len())],
                republish::for_retry(&full, count + 1, reason, &self.main_queue),
                "retry",
            ),
            Route::Retry { reason } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                republish::for_dead_letter(
                    &full,
                    written,
                    ErrorKind::RetriesExhausted.as_str(),
                    &match retries {
                        Retries::Unreadable => format!(
                            "not retried: its headers past the parser's budget ({}) are not \
                             well-formed, so its x-retries cannot be read: {reason}",
                            headers::UNPARSED_KEY
                        ),
                        _ => format!("retries exhausted after {count}: {reason}"),
                    },
                ),
                ErrorKind::RetriesExhausted.as_str(),
            ),
            Route::Wait { reason } => (
                &self.retry_exchange,
                &self.retry_queues[retry_tier(1, self.retry_queues.len())],
                republish::for_retry(&full, count, reason, &self.main_queue),
                "wait",
            ),
            Route::DeadLetter { kind, reason } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                republish::for_dead_letter(&full, written, kind.as_str(), reason),
                kind.as_str(),
            ),
            Route::DlqAttempt {
                attempts,
                reason,
                waits,
            } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                republish::for_dlq_attempt(&full, *attempts, reason),
                if *waits { "wait" } else { "dlq_retry" },
            ),
        };
        // Where the original was published, for a property column of the copy.
        let properties = republish::stamp_origin(
            properties,
            &full,
            message.exchange.as_str(),
            message.routing_key.as_str(),
        );
        (
            Publish {
                exchange: exchange.clone(),
                routing_key: routing_key.clone(),
                body: message.body.clone(),
                properties,
            },
            kind,
        )
    }

    /// Routes every message, each with how its republish ended (see [`Sent`]) and the kind it
    /// is counted as. While the publisher has no connection (at start-up, during a reconnect)
    /// publishes are tried again for up to `patience`.
    /// Those in doubt ([`Sent::InDoubt`]) are answered beside, with how to learn their late
    /// outcome (indices into `items`).
    pub async fn route(
        &self,
        items: &[(&Delivery, Route)],
    ) -> (Vec<(Sent, &'static str)>, InDoubt) {
        let (publishes, kinds): (Vec<Publish>, Vec<&'static str>) = items
            .iter()
            .map(|(message, route)| self.plan(message, route))
            .unzip();
        let (outcomes, in_doubt) = self.send_in_groups(publishes).await;
        let outcomes = items
            .iter()
            .zip(kinds)
            .zip(outcomes)
            .map(|(((message, _), kind), sent)| {
                match &sent {
                    Sent::Confirmed => {}
                    Sent::Failed(e) => {
                        error!(message_id = message.message_id(), pipeline = self.stage.pipeline(), stage = self.stage.stage().as_str(), delivery_tag = message.tag, error = %e, kind,
                            "republish not confirmed; the message goes back to its queue after a backoff");
                    }
                    Sent::InDoubt(e) => {
                        warn!(message_id = message.message_id(), pipeline = self.stage.pipeline(), stage = self.stage.stage().as_str(), delivery_tag = message.tag, error = %e, kind,
                            "republish in doubt (sent, not confirmed in time; the broker may hold the copy): the message goes back to its queue after a backoff, and its redelivery waits for the late confirm");
                    }
                    Sent::Unpublishable(why) => {
                        error!(message_id = message.message_id(), pipeline = self.stage.pipeline(), stage = self.stage.stage().as_str(), delivery_tag = message.tag, reason = %why, kind,
                            "message cannot be republished; parking it");
                    }
                }
                (sent, kind)
            })
            .collect();
        (outcomes, in_doubt)
    }
}

impl Republisher {
    /// Sends `publishes` in groups of at most [`ROUTE_KIB`] of bodies (a larger body alone),
    /// each holding its share of the stage's allowance while lapin holds its copies, within one
    /// patience for all of them.
    async fn send_in_groups(&self, publishes: Vec<Publish>) -> (Vec<Sent>, InDoubt) {
        let deadline = std::time::Instant::now() + self.patience;
        let mut outcomes = Vec::with_capacity(publishes.len());
        let mut in_doubt = InDoubt::default();
        let mut publishes = publishes.into_iter().peekable();
        while publishes.peek().is_some() {
            let mut group = Vec::new();
            let mut bytes = 0usize;
            while let Some(p) =
                publishes.next_if(|p| group.is_empty() || bytes + p.body.len() <= ROUTE_KIB << 10)
            {
                bytes += p.body.len();
                group.push(p);
            }
            let kib = bytes.div_ceil(1024).clamp(1, ROUTE_KIB) as u32;
            // Never closed: an error would only mean no wait.
            let _held = self.allowance.acquire_many(kib).await.ok();
            let patience = deadline.saturating_duration_since(std::time::Instant::now());
            let (sent, late) = send_isolating(&self.publisher, group, patience).await;
            in_doubt.extend(late.shifted(outcomes.len()));
            outcomes.extend(sent);
        }
        (outcomes, in_doubt)
    }
}

/// How one republish ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// The broker confirmed it: the original can be acked.
    Confirmed,
    /// Not confirmed (no broker, nacked, unroutable, no answer): the original goes back to its
    /// queue after a backoff, and is tried again later.
    Failed(String),
    /// Sent, and not confirmed within `PUBLISH_TIMEOUT_MS`: the broker may hold the copy (a
    /// broker under an alarm confirms late). The original goes back to its queue as if it
    /// failed, but the confirm is still awaited ([`InDoubt`]), and its redelivery waits for it
    /// (`copies.rs`).
    InDoubt(String),
    /// It can never be published as it is (too large for a frame, or the broker closed the
    /// channel over it alone): the original is parked.
    Unpublishable(String),
}

/// Publishes `publishes` through `publisher` as one group, then:
/// - what was never sent (no connection) is sent again, as a group, for up to `patience`;
/// - what was in flight when the broker closed the link goes again ALONE, one at a time: the
///   publish that closes the channel on its own is the offender (`Unpublishable`), the others
///   are confirmed. A close that does not blame a message (a missing exchange, say) fails the
///   rest at once instead of closing a channel for each.
///
/// Nothing that may have reached the broker is sent again as part of a group, so a group never
/// multiplies its copies: a publish is sent twice at most, when the broker closed the link
/// while it was in flight (the first copy may have been taken; the target's consumers take such
/// copies idempotently: a retry is inserted once, a dead letter parked once).
///
/// A publish sent whose confirm did not come in time is [`Sent::InDoubt`], never sent again
/// here; its late outcome comes through the [`InDoubt`] answered beside.
pub async fn send_isolating(
    publisher: &Addr<Publisher>,
    publishes: Vec<Publish>,
    patience: Duration,
) -> (Vec<Sent>, InDoubt) {
    let n = publishes.len();
    let deadline = std::time::Instant::now() + patience;
    let mut sent: Vec<Option<Sent>> = vec![None; n];
    let mut in_doubt = InDoubt::default();
    let mut unsent: Vec<usize> = (0..n).collect();
    let mut suspects: Vec<usize> = Vec::new();
    let pause = Duration::from_millis(100);
    while !unsent.is_empty() {
        let group = unsent.iter().map(|&i| publishes[i].clone()).collect();
        let Group { results, late } = publish_all(publisher, group).await;
        let doubtful = in_doubt.add(&unsent, late);
        let mut again = Vec::new();
        for (i, result) in unsent.iter().copied().zip(results) {
            match result {
                Err(e) if doubtful.contains(&i) => sent[i] = Some(Sent::InDoubt(e.to_string())),
                Ok(()) => sent[i] = Some(Sent::Confirmed),
                Err(AmqpError::Unavailable(_)) => again.push(i),
                Err(AmqpError::Unpublishable(e)) => {
                    sent[i] = Some(Sent::Unpublishable(e.to_string()))
                }
                Err(e @ AmqpError::Closed { .. }) => {
                    suspects.push(i);
                    sent[i] = Some(Sent::Failed(e.to_string()));
                }
                Err(e) => sent[i] = Some(Sent::Failed(e.to_string())),
            }
        }
        unsent = again;
        if unsent.is_empty() {
            break;
        }
        if std::time::Instant::now() + pause > deadline {
            for &i in &unsent {
                sent[i] = Some(Sent::Failed("no connection to the broker".into()));
            }
            break;
        }
        tokio::time::sleep(pause).await;
    }
    suspects.sort_unstable();
    let mut blameless: Option<String> = None;
    for i in suspects {
        if let Some(why) = &blameless {
            sent[i] = Some(Sent::Failed(why.clone()));
            continue;
        }
        let outcome = loop {
            let Group { results, late } = publish_all(publisher, vec![publishes[i].clone()]).await;
            let doubtful = !in_doubt.add(&[i], late).is_empty();
            let result = results
                .into_iter()
                .next()
                .unwrap_or_else(|| Err(AmqpError::Unavailable("no answer".into())));
            match result {
                Err(e) if doubtful => break Sent::InDoubt(e.to_string()),
                Ok(()) => break Sent::Confirmed,
                Err(AmqpError::Unavailable(e)) => {
                    if std::time::Instant::now() + pause > deadline {
                        break Sent::Failed(e);
                    }
                    tokio::time::sleep(pause).await;
                }
                Err(AmqpError::Unpublishable(e)) => break Sent::Unpublishable(e.to_string()),
                Err(e) if e.blames_the_message() => {
                    break Sent::Unpublishable(Unpublishable::Refused(e.to_string()).to_string());
                }
                Err(e) => {
                    if matches!(e, AmqpError::Closed { .. }) {
                        blameless = Some(e.to_string());
                    }
                    break Sent::Failed(e.to_string());
                }
            }
        };
        sent[i] = Some(outcome);
    }
    let sent = sent
        .into_iter()
        .map(|s| s.unwrap_or_else(|| Sent::Failed("not published".into())))
        .collect();
    (sent, in_doubt)
}

/// One group through the publisher actor; a gone actor fails every publish as unsent.
async fn publish_all(publisher: &Addr<Publisher>, group: Vec<Publish>) -> Group {
    let n = group.len();
    match publisher.send(PublishAll(group)).await {
        Ok(group) => group,
        Err(e) => Group {
            results: vec![
                Err(AmqpError::Unavailable(format!(
                    "publisher actor is gone: {e}"
                )));
                n
            ],
            late: None,
        },
    }
}

/// Publishes in doubt ([`Sent::InDoubt`]) and how to learn their late outcome: the broker's
/// confirms, still awaited in the background (`publisher::LATE_CONFIRMS` at most).
#[derive(Debug, Default)]
pub struct InDoubt {
    /// Per group that had some: their indices (among the publishes routed), and their outcome.
    parts: Vec<(Vec<usize>, tokio::sync::oneshot::Receiver<Vec<bool>>)>,
}

impl InDoubt {
    /// Takes in the late publishes of a group whose publish `i` is `at[i]` among those routed;
    /// answers the indices (among those routed) in doubt.
    fn add(&mut self, at: &[usize], late: Option<Late>) -> Vec<usize> {
        let Some(late) = late else {
            return Vec::new();
        };
        let indices: Vec<usize> = late
            .indices
            .iter()
            .filter_map(|&i| at.get(i).copied())
            .collect();
        self.parts.push((indices.clone(), late.outcome));
        indices
    }

    /// The same publishes, `by` further on (their group was a later part of a larger one).
    fn shifted(mut self, by: usize) -> Self {
        for (indices, _) in &mut self.parts {
            indices.iter_mut().for_each(|i| *i += by);
        }
        self
    }

    /// Takes in `other`'s publishes.
    fn extend(&mut self, other: InDoubt) {
        self.parts.extend(other.parts);
    }

    /// Whether nothing is in doubt.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Waits for every late outcome: (index, whether it was confirmed after all). An outcome
    /// that never comes (the publisher is gone) counts as not confirmed.
    pub async fn outcomes(self) -> Vec<(usize, bool)> {
        let mut all = Vec::new();
        for (indices, outcome) in self.parts {
            let confirmed = outcome.await.unwrap_or_default();
            all.extend(
                indices
                    .iter()
                    .enumerate()
                    .map(|(k, &i)| (i, confirmed.get(k).copied().unwrap_or(false))),
            );
        }
        all
    }
}

/// The tier (index into the retry queues) of a message's `retry`-th retry, counted from 1 as
/// `x-retries` after the increment: the n-th retry waits in the n-th tier, every retry after
/// the last tier in the last. `tiers` is at least 1.
pub fn retry_tier(retry: u32, tiers: usize) -> usize {
    (retry.max(1) as usize).min(tiers.max(1)) - 1
}
