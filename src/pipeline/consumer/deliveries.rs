//! Deliveries in and out: what the broker pushed is recorded for the acks and handed to the
//! processors in chunks (through the rate limiter, `throttle.rs`, when one is set: a timer,
//! `run_later`, releases what it holds), settlements come back, and the counts are published
//! per chunk and per tick, never per message. A stopping consumer hands everything held onwards
//! at once, so every delivery settles before the drain.

use std::time::{Duration, Instant};

use actix::prelude::*;
use tracing::{debug, info, warn};

use super::link::{Link, Phase, Subscription};
use super::{Consumer, SetProcessors, SetRate};
use crate::pipeline::message::{Delivery, Disposition, Settle};
use crate::pipeline::throttle::Release;

impl Consumer {
    /// Takes what the broker pushed: records every delivery for the acks, then hands the
    /// chunk onwards (through the limiter when one is set).
    pub(super) fn dispatch(
        &mut self,
        chunk: Vec<lapin::Result<lapin::message::Delivery>>,
        ctx: &mut Context<Self>,
    ) {
        let generation = self.generation;
        // One clock read per chunk: the sink gives back deliveries held near the broker's
        // consumer_timeout, counted from here (see `Delivery::received_at`).
        let received_at = Instant::now();
        let mut deliveries = Vec::with_capacity(chunk.len());
        // Every tag in delivery order (the acks'), and those whose body lapin did not store.
        let mut tags = Vec::with_capacity(chunk.len());
        let mut oversize = Vec::new();
        let mut aside = 0;
        for item in chunk {
            match item {
                Ok(d) if d.discarded.is_some() => {
                    debug!(
                        pipeline = self.config.stage.pipeline(),
                        stage = self.config.stage.stage().as_str(),
                        tag = d.delivery_tag,
                        announced_bytes = d.discarded,
                        "a body over MAX_MESSAGE_BYTES announced in an open window: not stored"
                    );
                    tags.push(d.delivery_tag);
                    let identity =
                        super::oversize::identity(&d.properties, d.discarded.unwrap_or_default());
                    if self.set_aside(d.delivery_tag, identity) {
                        aside += 1;
                    } else {
                        oversize.push((d.delivery_tag, Disposition::Requeue));
                    }
                }
                Ok(d) => {
                    tags.push(d.delivery_tag);
                    deliveries.push(Delivery::new(generation, d, received_at))
                }
                Err(e) => {
                    warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), error = %e, "consumer stream error");
                    self.last_stream_error = Some(e.to_string());
                }
            }
        }
        if tags.is_empty() {
            return;
        }
        // A cancelled subscription still delivering is answering: its cancel-ok comes behind
        // (`cancel_unanswered` counts from here).
        if let Some(Subscription::Cancelling(_, since)) = self.linked().map(|l| &mut l.subscription)
        {
            *since = Instant::now();
        }
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.delivered(tags.into_iter());
            // Given back at once, unread: not a failure, no retry spent.
            acker.settle(&oversize);
        }
        if !oversize.is_empty() {
            self.give_back_oversize(oversize.len());
        }
        if aside > 0 {
            self.held_aside(aside);
        }
        if deliveries.is_empty() {
            return;
        }
        self.inflight += deliveries.len();
        self.received += deliveries.len() as u64;
        self.since_subscribe += deliveries.len() as u64;
        let (mut refused, mut first_refused) = (0, None);
        for d in &deliveries {
            self.inflight_bytes += d.held_bytes;
            if d.body.len() > self.config.max_message_bytes {
                // A refused body cuts the window to one (`observe`), not the budget's window:
                // counted here, one 8 MiB body kept the window at 31 for good.
                refused += 1;
                first_refused.get_or_insert_with(|| {
                    let identity =
                        super::oversize::identity(d.properties.bare(), d.body.len() as u64);
                    (d.tag, d.held_bytes, identity)
                });
            } else {
                self.largest = self.largest.max(d.held_bytes as usize);
            }
        }
        // The largest delivery decoded since the last chunk, its record included: a window
        // of records that hold many times their bodies is cut to what the budget holds of them.
        self.fold_decoded();
        self.observe(deliveries.len(), refused);
        // The first delivery without a body limit restores it; a refused body keeps the permit.
        self.oversize_delivered(first_refused);
        self.check_budget();
        if self.throttle.is_open() {
            self.hand_on(deliveries);
        } else {
            self.throttle.hold(deliveries);
            self.release(ctx);
        }
    }

    /// Hands deliveries to the processors. When nothing more can come before what is in
    /// flight settles and no batch could fill meanwhile (between subscriptions: a window being
    /// changed, a hold; or a full window smaller than a batch), the batches they join go to the
    /// sinks at once instead of at the batch timeout: a `Flush` follows them to every batcher in
    /// use. Without it, a window change stalled the pipeline for a whole batch timeout, and a
    /// window smaller than a batch (a small PREFETCH, or the byte budget's cut for large bodies)
    /// took one window per batch timeout. A full window of at least a batch always holds a
    /// whole batch (the dispatch cuts contiguous batches), whose commit frees room: flushing
    /// there would only cut the others short. Nor while the first window of one opens
    /// (`growing`): a larger window comes at once, and a backlog keeps making whole batches.
    pub(super) fn hand_on(&mut self, deliveries: Vec<Delivery>) {
        self.handed.0 += deliveries.len() as u64;
        self.dispatch.hand_on(deliveries);
        // This subscription delivered its whole window (what earlier ones still hold does not
        // count against it on the broker: its qos is per consumer).
        let starved = matches!(&self.link, Link::Up(l)
            if self.inflight >= usize::from(l.window)
                && self.since_subscribe >= u64::from(l.window)
                && usize::from(l.window) < self.dispatch.batch_size());
        if self.phase == Phase::Running && (!self.consuming() || starved) && !self.growing() {
            self.dispatch.flush_all();
        }
    }

    /// Hands held deliveries onwards as fast as the limiter allows, in order, and schedules
    /// itself for when the next one may go. Without a limiter, or while stopping, everything
    /// held goes at once. Deliveries of a closed channel are dropped (the broker requeued them).
    pub(super) fn release(&mut self, ctx: &mut Context<Self>) {
        let Release {
            ready,
            dropped,
            dropped_bytes,
            wait,
        } = self
            .throttle
            .take(self.generation, self.phase != Phase::Running);
        self.inflight = self.inflight.saturating_sub(dropped);
        if self.phase != Phase::Running {
            // Of a closed channel: the broker has them again.
            self.stop_counts.given_back += dropped as u64;
        }
        self.inflight_bytes = self.inflight_bytes.saturating_sub(dropped_bytes);
        if dropped > 0 {
            self.oversize_settled();
        }
        if let Some(wait) = wait
            && !self.release_pending
        {
            self.release_pending = true;
            ctx.run_later(wait.max(Duration::from_millis(1)), |act, ctx| {
                act.release_pending = false;
                act.release(ctx);
            });
        }
        if !ready.is_empty() {
            self.hand_on(ready);
        }
        self.maybe_subscribe(ctx);
        if self.throttle.is_empty() && self.inflight == 0 {
            self.maybe_finish(ctx);
        }
    }

    /// Publishes the received count and the in-flight gauge (deltas since the last call).
    pub(super) fn publish_counts(&mut self) {
        let (received, inflight) = self.published;
        if self.received > received {
            let delta = self.received - received;
            self.received_counter.increment(delta);
            self.stats
                .received
                .fetch_add(delta, std::sync::atomic::Ordering::Relaxed);
        }
        let delta = self.inflight as i64 - inflight as i64;
        if delta != 0 {
            crate::metrics::inflight(&self.inflight_gauge, delta);
        }
        self.published = (self.received, self.inflight);
        if self.inflight_bytes_gauge.1 != self.inflight_bytes {
            self.inflight_bytes_gauge.1 = self.inflight_bytes;
            self.inflight_bytes_gauge.0.set(self.inflight_bytes as f64);
        }
    }
}

impl Handler<Settle> for Consumer {
    type Result = ();

    fn handle(&mut self, mut msg: Settle, ctx: &mut Self::Context) {
        self.inflight = self.inflight.saturating_sub(msg.items.len());
        self.inflight_bytes = self.inflight_bytes.saturating_sub(msg.bytes);
        self.publish_counts();
        let current = msg.generation == self.generation;
        // A body held whole whose park failed, with others held aside for their turns: it
        // joins them, unacked, behind them, instead of going back to the queue's head.
        if current {
            self.oversize_rotate(&mut msg.items, ctx);
        }
        if self.phase != Phase::Running {
            let live = current && self.linked().is_some_and(|l| l.acker.is_some());
            self.stop_counts.count(&msg.items, live);
        }
        if current && let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.settle(&msg.items);
            self.config
                .copies
                .acked()
                .acked(msg.generation, self.config.incarnation, &msg.acked);
        } else {
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                generation = msg.generation,
                "settlement for a closed channel dropped; the broker redelivers those messages"
            );
            self.config.copies.acked().dropped(&msg.acked);
        }
        // A body held whole with the process's permit settled: the permit goes.
        self.oversize_settle(msg.generation, &msg.items);
        self.oversize_settled();
        // Whatever is still held: a new subscription waits only for room (`room_for`).
        self.maybe_subscribe(ctx);
        self.maybe_finish(ctx);
    }
}

impl Handler<SetRate> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: SetRate, ctx: &mut Self::Context) {
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            rate_limit_per_s = msg.per_s,
            "rate limit set"
        );
        // RATE_LIMIT_PER_S is checked against AMQP_CONSUMER_TIMEOUT_MS at start (config.rs);
        // a live rate is only warned about: the last delivery of a full prefetch window waits
        // prefetch / rate seconds unacked, and the broker closes the channel past its timeout.
        if crate::config::window_outlasts(
            self.config.prefetch,
            msg.per_s,
            self.amqp.hand_back_after(),
        )
        .is_some()
        {
            warn!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                rate_limit_per_s = msg.per_s,
                prefetch = self.config.prefetch,
                "at this rate a full prefetch window waits in warren longer than 80% of \
                 AMQP_CONSUMER_TIMEOUT_MS: the broker may close the channel (warren then \
                 reconnects); raise the rate or lower PREFETCH"
            );
        }
        self.throttle.set_rate(msg.per_s);
        self.release(ctx);
    }
}

impl Handler<SetProcessors> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: SetProcessors, _: &mut Self::Context) {
        if self.dispatch.set_processors(msg.0) {
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                processors = self.dispatch.processors(),
                "processors scaled"
            );
        }
    }
}
