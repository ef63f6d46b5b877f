//! Subscribing and its stream: [`Consumer::maybe_subscribe`], the one path to `basic.consume`,
//! taken only when nothing holds the pipeline (breaker, operator; a hold survives a reconnect);
//! the cancel; the stream of deliveries, taken in chunks, and its end; the holds.
//!
//! A new subscription never waits for the previous window to settle: a delivery held unsettled
//! (a message waiting out its requeue backoff, a batch retried in place) would hold every message
//! behind it for as long. It takes its window at once (`basic.qos`, per consumer, before
//! `basic.consume`); what the earlier subscriptions delivered stays unacked on the same channel
//! and is acked there as it settles (delivery tags are per channel; a per-consumer prefetch
//! counts only the deliveries of the consumer it was set for). Bounds: a new subscription begins
//! only while what earlier ones still hold is at most its window (so at most two windows are in
//! flight) and under the byte budget (`window.rs`), which counts every delivery held, whichever
//! subscription or link brought it.

use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use lapin::Channel;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tracing::{debug, info, warn};

use super::Consumer;
use super::link::{Link, Phase, Subscription};
use crate::pipeline::message::Hold;

/// The most deliveries handed onwards in one chunk (what the broker pushed and lapin holds
/// ready at one poll, up to this).
const CHUNK_MAX: usize = 1000;

/// How long the consumer leaves lapin's delivery stream alone after taking a chunk, so the next
/// chunk gathers what arrives meanwhile. Without it, a consumer faster than the socket wakes for
/// nearly every delivery (lapin's I/O thread wakes it per message: a futex wake on one thread, a
/// context switch and a trip through every stage on the other), which cost more CPU than all of
/// warren's own work (docs/performance.md, "What the measurements taught"). At 20,000 msg/s a
/// chunk then holds 20 to 40 deliveries; the latency it adds (1 to 2 ms, tokio's timer has
/// millisecond ticks) is nothing next to the batch timeout. An idle stream still delivers its first message at once.
const LINGER: Duration = Duration::from_millis(1);

/// Why a `basic.consume` (with the `basic.qos` of a new window before it) gave no consumer.
#[derive(Debug, thiserror::Error)]
enum SubscribeError {
    /// The broker refused it, or the link failed under it.
    #[error("{0}")]
    Refused(#[from] lapin::Error),
    /// No answer within the bound (the connect timeout, doubled for each failure in a row).
    #[error("basic.consume not answered within {0:?}")]
    Unanswered(Duration),
}

/// A `basic.consume` finished on the channel of `generation`: the consumer, or why not.
#[derive(Message)]
#[rtype(result = "()")]
struct Subscribed {
    generation: u64,
    result: Result<lapin::Consumer, SubscribeError>,
    tag: String,
    /// The window (qos) the subscription has.
    window: u16,
}

/// The consumer stream, tagged with its generation, and its end.
enum Event {
    /// Everything the stream held ready at one poll.
    Deliveries(u64, Vec<lapin::Result<lapin::message::Delivery>>),
    /// The subscription with this consumer tag ended.
    Ended(u64, String),
}

impl Consumer {
    /// Subscribes (`basic.consume`) when nothing holds the pipeline, the link is up without a
    /// subscription (none under way, none cancelled whose stream has not ended), and what the
    /// earlier subscriptions still hold leaves room (see [`Consumer::room_for`]). It never waits
    /// for them to settle: a held delivery would hold every message behind it.
    pub(super) fn maybe_subscribe(&mut self, ctx: &mut Context<Self>) {
        if self.phase != Phase::Running || !self.holds.is_empty() {
            return;
        }
        self.fold_decoded();
        let window = self.next_window();
        if !self.room_for(window) {
            return;
        }
        if self.awaits_decode(window) {
            ctx.run_later(Duration::from_millis(1), |consumer, ctx| {
                consumer.maybe_subscribe(ctx)
            });
            return;
        }
        // A body given back waits for the process's permit (`oversize.rs`), asked for only
        // when the stage could subscribe at once: never held while waiting for something else.
        if !matches!(&self.link, Link::Up(l) if l.subscription == Subscription::None
            && l.channel.status().connected())
            || !self.oversize_ready(ctx)
        {
            return;
        }
        // The permit may just have been taken: a window of one without a body limit.
        let window = self.next_window();
        let stage = self.config.stage.clone();
        let (prefetch, largest) = (self.config.prefetch, self.largest);
        // What the budget holds of the largest delivery: the budget's cut (else the earned window,
        // whose steps are logged at debug only).
        let budget_cut = window == self.budget_window() && window < prefetch.max(1);
        let max_inflight_bytes = self.config.max_inflight_bytes;
        let body_limit = self.body_limit();
        let Link::Up(linked) = &mut self.link else {
            return;
        };
        if linked.subscription != Subscription::None || !linked.channel.status().connected() {
            return;
        }
        let qos = (window != linked.window).then_some(window);
        if let Some(w) = qos.filter(|_| !budget_cut) {
            debug!(
                pipeline = stage.pipeline(),
                stage = stage.stage().as_str(),
                window = w,
                prefetch,
                "prefetch window set to the window earned (a first window of one, then open)"
            );
        } else if let Some(w) = qos {
            info!(
                pipeline = stage.pipeline(),
                stage = stage.stage().as_str(),
                window = w,
                prefetch,
                largest_delivery = largest,
                max_inflight_bytes,
                "prefetch window set to what MAX_INFLIGHT_BYTES holds of the largest delivery \
                 seen (body, parsed properties and decoded rows)"
            );
        }
        linked.subscription = Subscription::Pending;
        let channel = linked.channel.clone();
        // In place before the consume, so before its first delivery (`window.rs`).
        channel.set_body_limit(body_limit);
        let generation = self.generation;
        let tag = consumer_tag(&stage, &format!("{generation}-{}", self.subscriptions));
        self.subscriptions += 1;
        let queue = self.config.queue.clone();
        let addr = ctx.address();
        let bound = self.amqp.connect_timeout() * (1 << self.consume_failures.min(4));
        let after = self.consume_after.take();
        actix::spawn(async move {
            // Bounded: a consume that never answers must not leave the pipeline unsubscribed.
            // A new window first: the broker applies a per-consumer qos to consumers made after.
            let consume = async {
                // Bodies held aside go back to the queue before a window of one without a body
                // limit begins (`oversize.rs`): sent on the same channel ahead of it. A closed
                // acker answers with an error: the channel is gone, and the consume fails too.
                if let Some(after) = after {
                    let _ = after.await;
                }
                if let Some(w) = qos {
                    channel
                        .basic_qos(w, BasicQosOptions { global: false })
                        .await?;
                }
                channel
                    .basic_consume(
                        queue.as_str().into(),
                        tag.as_str().into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
            };
            let result = match tokio::time::timeout(bound, consume).await {
                Ok(result) => result.map_err(SubscribeError::from),
                Err(_) => Err(SubscribeError::Unanswered(bound)),
            };
            addr.do_send(Subscribed {
                generation,
                result,
                tag,
                window,
            });
        });
    }

    /// Cancels the subscription (deliveries in flight still settle on the open channel).
    pub(super) fn unsubscribe(&mut self) {
        let Some(linked) = self.linked() else {
            return;
        };
        if let Subscription::Active(tag) = &linked.subscription {
            cancel(&linked.channel, tag.clone());
            linked.subscription = Subscription::Cancelling(tag.clone(), Instant::now());
        }
    }

    pub(super) fn add_consumer_stream(
        &mut self,
        ctx: &mut Context<Self>,
        consumer: lapin::Consumer,
        tag: String,
    ) {
        let generation = self.generation;
        self.idle = (self.received, 0);
        let stream = chunks(consumer, CHUNK_MAX, LINGER)
            .map(move |chunk| Event::Deliveries(generation, chunk))
            .chain(futures::stream::once(async move {
                Event::Ended(generation, tag)
            }));
        ctx.add_stream(stream);
    }
}

/// What `stream` holds ready at one poll, up to `max` items, as one chunk; after each chunk the
/// stream is left alone for `linger`, so what arrives meanwhile makes the next chunk instead of
/// a wake-up each. The first item after a quiet spell comes at once.
pub(super) fn chunks<S: futures::Stream>(
    stream: S,
    max: usize,
    linger: Duration,
) -> impl futures::Stream<Item = Vec<S::Item>> {
    tokio_stream::StreamExt::throttle(stream.ready_chunks(max), linger)
}

/// This process's consumer tag for `stage` (`<pipeline>/<stage>`), unique per subscription
/// (`suffix`).
fn consumer_tag(stage: &crate::metrics::StageId, suffix: &str) -> String {
    format!(
        "warren-{}-{}-{stage}-{suffix}",
        crate::hostname(),
        std::process::id()
    )
}

/// Cancels the subscription `tag` on `channel` in the background; the stream then ends.
fn cancel(channel: &Channel, tag: String) {
    let channel = channel.clone();
    actix::spawn(async move {
        let _ = channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await;
    });
}

impl StreamHandler<Event> for Consumer {
    fn handle(&mut self, event: Event, ctx: &mut Self::Context) {
        match event {
            Event::Deliveries(generation, chunk)
                if generation == self.generation && self.phase != Phase::StreamEnded =>
            {
                self.dispatch(chunk, ctx)
            }
            Event::Deliveries(generation, chunk) if generation == self.generation => {
                // The stream has ended for this stop, or was given up on (a cancel-ok that did
                // not come within the connect timeout, a consume under way at the stop): what
                // still arrives is left unacked, and the broker gives it back when the channel
                // closes. Handed on, it would be processed after the acks were closed, and a
                // message routed to the DLQ or a retry queue would be routed again at its
                // redelivery: a second copy (found by review).
                debug!(
                    pipeline = self.config.stage.pipeline(),
                    stage = self.config.stage.stage().as_str(),
                    deliveries = chunk.len(),
                    "deliveries after the stream ended for the stop; left to the broker"
                );
                self.stop_counts.given_back += chunk.iter().filter(|d| d.is_ok()).count() as u64;
            }
            Event::Deliveries(..) => {}
            Event::Ended(generation, tag) => {
                // The end of a subscription warren cancelled: every delivery it brought has been
                // handed on, so the next subscription may begin (or the stop go on).
                let this_link = generation == self.generation;
                if let Some(linked) = self.linked().filter(|_| this_link)
                    && matches!(&linked.subscription, Subscription::Cancelling(t, _) if *t == tag)
                {
                    linked.subscription = Subscription::None;
                    self.oversize_unsubscribed();
                    if self.phase == Phase::Running {
                        self.maybe_subscribe(ctx);
                    } else {
                        self.stream_done(ctx);
                    }
                    return;
                }
                // Otherwise only the end of the current subscription matters.
                let current = generation == self.generation
                    && matches!(&self.link, Link::Up(l)
                        if matches!(&l.subscription, Subscription::Active(t) if *t == tag));
                if !current {
                    return;
                }
                if self.phase != Phase::Running {
                    self.stream_done(ctx);
                } else {
                    let reason = self.link_end_reason();
                    warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, reason,
                        "consumer stream ended (cancelled by the broker or channel closed); rebuilding it");
                    self.rebuild(ctx, reason);
                }
            }
        }
    }

    fn finished(&mut self, _: &mut Self::Context) {
        // Each stream ends with an `Ended` event; the actor lives on.
    }
}

impl Handler<Hold> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Hold, ctx: &mut Self::Context) {
        let was_held = !self.holds.is_empty();
        if msg.on {
            if !self.holds.contains(&msg.reason) {
                self.holds.push(msg.reason);
            }
        } else {
            self.holds.retain(|r| *r != msg.reason);
        }
        let held = !self.holds.is_empty();
        if held && !was_held {
            warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), reason = ?msg.reason, "holding: no new deliveries");
            self.unsubscribe();
        } else if !held && was_held && self.phase == Phase::Running {
            info!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), reason = ?msg.reason, inflight = self.inflight,
                "resuming deliveries");
            if self.open_channel().is_some() {
                self.maybe_subscribe(ctx);
            } else if !self.connecting() {
                self.rebuild(ctx, "connection_lost");
            }
        }
    }
}

impl Handler<Subscribed> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Subscribed, ctx: &mut Self::Context) {
        let running = self.phase == Phase::Running;
        let current = msg.generation == self.generation;
        if current {
            self.consume_failures = match msg.result {
                Ok(_) => 0,
                Err(_) => self.consume_failures.saturating_add(1),
            };
        }
        let (batchers, batch_size) = (self.dispatch.batchers(), self.dispatch.batch_size());
        let Some(linked) = self.linked().filter(|_| current) else {
            // The link it was made on is gone, and the subscription with it.
            return;
        };
        linked.subscription = Subscription::None;
        match msg.result {
            Ok(consumer) if !running => {
                // Stopping began while subscribing: whatever this subscription delivered before
                // the cancel stays unacked and goes back to the queue when the channel closes.
                drop(consumer);
                cancel(&linked.channel, msg.tag);
                self.oversize_unsubscribed();
            }
            Ok(consumer) => {
                linked.window = msg.window;
                if let Some(acker) = linked.acker.as_mut() {
                    acker.set_window(msg.window, batchers, batch_size);
                }
                linked.subscription = Subscription::Active(msg.tag.clone());
                self.kept_largest = self.kept_largest.max(self.largest);
                self.largest = 0;
                self.since_subscribe = 0;
                info!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue,
                    consumer_tag = %msg.tag, generation = msg.generation, window = msg.window,
                    "consuming");
                self.add_consumer_stream(ctx, consumer, msg.tag.clone());
                self.lifted_subscribed(ctx, msg.tag);
                // A hold that came while subscribing wins at once, and so does a body given
                // back meanwhile (the stage takes nothing until it is taken whole); a
                // concurrency that changed while subscribing gets its window.
                if !self.holds.is_empty() || self.oversize.stands_still() {
                    self.unsubscribe();
                } else {
                    self.follow_window();
                }
            }
            Err(e) => {
                warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, error = %e,
                    "cannot subscribe; rebuilding the link");
                if running {
                    self.rebuild(ctx, "connection_lost");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;

    /// Deliveries that arrive while the consumer lingers come as one chunk; after a quiet spell
    /// the first one comes at once (paused clock: no real sleeps).
    #[tokio::test(start_paused = true)]
    async fn what_arrives_during_the_linger_is_one_chunk_and_the_first_after_quiet_comes_at_once() {
        let (tx, rx) = mpsc::unbounded::<u32>();
        let mut chunks = std::pin::pin!(chunks(rx, 1000, Duration::from_millis(1)));
        tx.unbounded_send(1).unwrap();
        let start = tokio::time::Instant::now();
        assert_eq!(chunks.next().await, Some(vec![1]));
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "the first delivery waits for nothing"
        );
        // While the consumer lingers, three more arrive: one chunk, after the linger.
        for i in 2..=4 {
            tx.unbounded_send(i).unwrap();
        }
        assert_eq!(chunks.next().await, Some(vec![2, 3, 4]));
        assert_eq!(start.elapsed(), Duration::from_millis(1));
        // A quiet spell longer than the linger: the next one comes as soon as it arrives.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let quiet_end = tokio::time::Instant::now();
        tx.unbounded_send(5).unwrap();
        assert_eq!(chunks.next().await, Some(vec![5]));
        assert_eq!(quiet_end.elapsed(), Duration::ZERO);
        // A chunk never holds more than the bound.
        for i in 0..2500 {
            tx.unbounded_send(i).unwrap();
        }
        let mut seen = Vec::new();
        while seen.iter().sum::<usize>() < 2500 {
            seen.push(chunks.next().await.unwrap().len());
        }
        assert_eq!(seen, [1000, 1000, 500]);
    }
}
