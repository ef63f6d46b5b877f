//! The consumer actor: owns the consuming connection and channel (qos set on every connect),
//! hands deliveries to processors, and performs the acks and nacks the batchers decide, only on
//! the channel that delivered them. A watchdog rebuilds a consumer whose channel closed or whose
//! stream ended; every rebuild of a link that died young waits a growing backoff first, so a
//! link that keeps failing is never a hot loop.
//!
//! Subscribing (`basic.consume`) has one path, [`Consumer::maybe_subscribe`], taken only when
//! nothing holds the pipeline (breaker, operator) and the previous window is fully settled: a
//! hold survives a reconnect, and warren never has more than one prefetch window in memory.
//!
//! Rate limiting (`RATE_LIMIT_PER_S`, `warren ctl rate`): a `governor` limiter decides when each
//! delivery is handed onwards; deliveries that arrive faster wait in `held`, which the prefetch
//! window bounds (they stay unacked, so the broker, seeing the window full, keeps the rest in
//! the queue). A timer (`run_later`) releases them. A stopping consumer hands everything held
//! onwards at once, so every delivery settles before the drain.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use super::Drain;
use super::acks::{AckTracker, Disposition, Op, coalesce};
use super::processor::Delivered;
use crate::amqp::{self, AmqpError};
use crate::config::Settings;

/// Batchers report how deliveries of a channel generation ended.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Settle {
    /// The channel generation the deliveries came from; settlements for an older one are
    /// dropped (the broker already requeued those messages).
    pub generation: u64,
    pub items: Vec<(u64, Disposition)>,
}

/// Stop taking deliveries, let everything in flight settle, close. Answers when done.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// Replace the processors deliveries are spread over (live scaling). Processors no longer used
/// finish what their mailboxes hold and stop when their last address is dropped.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetProcessors {
    pub deliveries: Vec<Recipient<Delivered>>,
    pub drains: Vec<Recipient<Drain>>,
}

/// Hand at most `per_s` deliveries per second onwards from now on; 0 removes the limit.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetRate {
    pub per_s: u32,
}

/// The limiter for `per_s` messages per second, none for 0. Its burst is a twentieth of a
/// second's worth (at least 1): smooth, yet one timer wake-up releases a chunk even at high rates.
fn limiter(per_s: u32) -> Option<DefaultDirectRateLimiter> {
    let rate = NonZeroU32::new(per_s)?;
    let burst = NonZeroU32::new(per_s / 20).unwrap_or(NonZeroU32::MIN);
    Some(RateLimiter::direct(
        Quota::per_second(rate).allow_burst(burst),
    ))
}

/// Why the consumer stops taking deliveries for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// The database keeps failing: the sink-outage breaker is open.
    Breaker,
    /// An operator asked for it (`warren ctl pause`).
    Operator,
}

/// Stop (`on = true`) or resume (`on = false`) taking deliveries for `reason`. Deliveries in
/// flight finish normally; the channel stays open so they can be acked.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Hold {
    pub reason: HoldReason,
    pub on: bool,
}

/// A `basic.consume` finished on the channel of `generation`: the consumer, or why not.
#[derive(Message)]
#[rtype(result = "()")]
struct Subscribed {
    generation: u64,
    result: Result<lapin::Consumer, String>,
    tag: String,
}

/// A link that lived at least this long was healthy: the next rebuild starts without delay.
const HEALTHY_LINK: Duration = Duration::from_secs(30);

/// The idle watchdog found messages waiting while nothing arrives: rebuild the consumer.
#[derive(Message)]
#[rtype(result = "()")]
struct Stuck {
    generation: u64,
    ready: u32,
}

/// What the consumer is told about its broker link (connected, qos set, not yet consuming).
#[derive(Message)]
#[rtype(result = "()")]
struct Connected {
    conn: Connection,
    channel: Channel,
}

/// The consumer stream, tagged with its generation, and its end.
enum Event {
    Delivery(u64, Box<lapin::Result<Delivery>>),
    /// The subscription with this consumer tag ended.
    Ended(u64, String),
}

/// What the consumer consumes and how.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// `main` or `dlq`: for logs and metrics.
    pub pipeline: &'static str,
    pub queue: String,
    pub prefetch: u16,
    /// Deliveries sent to one batcher before moving to the next, so batches fill one at a time.
    pub batch_size: usize,
}

/// The consumer actor.
pub struct Consumer {
    config: ConsumerConfig,
    settings: Settings,
    /// Processors, fed round-robin.
    processors: Vec<Recipient<Delivered>>,
    /// The same processors, for the `Drain` marker that follows their deliveries.
    processor_drains: Vec<Recipient<Drain>>,
    next_processor: usize,
    /// Number of batchers and the one the current chunk of deliveries goes to.
    batchers: usize,
    current_batcher: usize,
    chunk_filled: usize,
    /// Bumped on every (re)connect; deliveries carry it back in `Settle`.
    generation: u64,
    connection: Option<Connection>,
    channel: Option<Channel>,
    consumer_tag: Option<String>,
    /// A `basic.consume` is under way.
    subscribing: bool,
    /// Numbers subscriptions, so consumer tags stay unique.
    subscriptions: u64,
    /// When the current link came up, to tell a young death (back off) from an old one.
    linked_at: Option<Instant>,
    /// Delays before rebuilding links that died young (backon), reset by a healthy link.
    rebuild_delays: Box<dyn Iterator<Item = Duration> + Send>,
    /// The last error the consumer stream reported, to name why the link ended.
    last_stream_error: Option<String>,
    /// Ordered channel operations, executed by one task per channel.
    ops: Option<mpsc::UnboundedSender<Vec<Op>>>,
    ops_task: Option<tokio::task::JoinHandle<()>>,
    tracker: AckTracker,
    /// Delivered but not yet settled, over all generations (drain waits for 0).
    inflight: usize,
    connecting: bool,
    /// Held by the breaker and/or an operator: no consumer subscribed while non-empty.
    holds: Vec<HoldReason>,
    /// Deliveries taken so far; metrics and the idle watchdog derive from it.
    received: u64,
    /// `received` and `inflight` as last published to the metrics (per settle and per tick,
    /// not per message).
    published: (u64, usize),
    /// `received` at the last watchdog tick, and the ticks since it last moved.
    idle: (u64, u32),
    /// The received counter, resolved once.
    received_counter: metrics::Counter,
    /// The in-flight gauge, resolved once.
    inflight_gauge: metrics::Gauge,
    stopping: bool,
    /// The stream ended after a cancel: nothing more will arrive.
    stream_ended: bool,
    drain_sent: bool,
    done: Vec<oneshot::Sender<()>>,
    /// Caps the deliveries handed onwards per second (RATE_LIMIT_PER_S, `warren ctl rate`);
    /// `None` = no limit.
    limiter: Option<DefaultDirectRateLimiter>,
    /// Deliveries taken but held back by the limiter, oldest first; unacked, so the prefetch
    /// window bounds them.
    held: VecDeque<Delivered>,
    /// A timer to release `held` is pending.
    release_pending: bool,
}

impl Consumer {
    pub fn new(
        config: ConsumerConfig,
        settings: Settings,
        processors: Vec<Recipient<Delivered>>,
        processor_drains: Vec<Recipient<Drain>>,
        batchers: usize,
    ) -> Self {
        let received_counter = crate::metrics::received_counter(config.pipeline);
        let limiter = limiter(settings.rate_limit_per_s);
        Self {
            config,
            settings,
            processors,
            processor_drains,
            next_processor: 0,
            batchers: batchers.max(1),
            current_batcher: 0,
            chunk_filled: 0,
            generation: 0,
            connection: None,
            channel: None,
            consumer_tag: None,
            subscribing: false,
            subscriptions: 0,
            linked_at: None,
            rebuild_delays: Box::new(amqp::reconnect_backoff()),
            last_stream_error: None,
            ops: None,
            ops_task: None,
            tracker: AckTracker::default(),
            inflight: 0,
            connecting: false,
            holds: Vec::new(),
            received: 0,
            published: (0, 0),
            idle: (0, 0),
            received_counter,
            inflight_gauge: crate::metrics::inflight_gauge(),
            stopping: false,
            stream_ended: false,
            drain_sent: false,
            done: Vec::new(),
            limiter,
            held: VecDeque::new(),
            release_pending: false,
        }
    }

    fn connect(&mut self, ctx: &mut Context<Self>) {
        if self.connecting || self.stopping {
            return;
        }
        self.connecting = true;
        let settings = self.settings.clone();
        let config = self.config.clone();
        let addr = ctx.address();
        let first_delay = self.rebuild_delay();
        actix::spawn(async move {
            if !first_delay.is_zero() {
                tokio::time::sleep(first_delay).await;
            }
            let mut delays = amqp::reconnect_backoff();
            let mut attempt = 0u32;
            loop {
                attempt += 1;
                match open(&settings, &config).await {
                    Ok((conn, channel)) => {
                        addr.do_send(Connected { conn, channel });
                        return;
                    }
                    Err(e) => {
                        let delay = delays.next().unwrap_or(Duration::from_secs(30));
                        if attempt == 1 || attempt.is_power_of_two() {
                            warn!(pipeline = config.pipeline, queue = %config.queue, attempt, error = %e,
                                retry_in_ms = delay.as_millis() as u64, "consumer cannot consume; retrying");
                        }
                        tokio::time::sleep(delay).await;
                        if !addr.connected() {
                            return;
                        }
                    }
                }
            }
        });
    }

    /// How long to wait before rebuilding the link: nothing for the first one or after a
    /// healthy one, a growing backoff (200 ms doubling to 10 s, jittered) after each link that
    /// died young.
    fn rebuild_delay(&mut self) -> Duration {
        match self.linked_at.take() {
            None if self.generation == 0 => Duration::ZERO,
            Some(at) if at.elapsed() >= HEALTHY_LINK => {
                self.rebuild_delays = Box::new(amqp::reconnect_backoff());
                Duration::ZERO
            }
            _ => self
                .rebuild_delays
                .next()
                .unwrap_or(Duration::from_secs(10)),
        }
    }

    /// Rebuilds the link for `reason` (counted), after the backoff `connect` applies.
    fn rebuild(&mut self, ctx: &mut Context<Self>, reason: &'static str) {
        crate::metrics::consumer_restart(self.config.pipeline, reason);
        self.teardown();
        self.connect(ctx);
    }

    /// Subscribes (`basic.consume`) when nothing holds the pipeline, no subscription exists or is
    /// under way, and every delivery of the previous window is settled: one window at a time.
    fn maybe_subscribe(&mut self, ctx: &mut Context<Self>) {
        if self.stopping
            || self.connecting
            || self.subscribing
            || !self.holds.is_empty()
            || self.consumer_tag.is_some()
            || self.inflight > 0
        {
            return;
        }
        let Some(channel) = self.channel.clone().filter(|c| c.status().connected()) else {
            return;
        };
        self.subscribing = true;
        let generation = self.generation;
        let tag = consumer_tag(
            self.config.pipeline,
            &format!("{generation}-{}", self.subscriptions),
        );
        self.subscriptions += 1;
        let queue = self.config.queue.clone();
        let addr = ctx.address();
        let bound = self.settings.connect_timeout();
        actix::spawn(async move {
            // Bounded: a consume that never answers must not leave the pipeline unsubscribed.
            let consume = channel.basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            );
            let result = match tokio::time::timeout(bound, consume).await {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(_) => Err(format!("basic.consume not answered within {bound:?}")),
            };
            addr.do_send(Subscribed {
                generation,
                result,
                tag,
            });
        });
    }

    /// Drops the current channel: its unacked deliveries go back to the queue on the broker.
    fn teardown(&mut self) {
        self.ops = None;
        self.ops_task = None;
        self.tracker = AckTracker::default();
        self.consumer_tag = None;
        self.subscribing = false;
        // Held deliveries of this channel go back to the queue with it.
        self.inflight = self.inflight.saturating_sub(self.held.len());
        self.held.clear();
        let channel = self.channel.take();
        let conn = self.connection.take();
        actix::spawn(amqp::close(channel, conn));
    }

    fn dispatch(&mut self, delivery: Delivery, ctx: &mut Context<Self>) {
        self.tracker.delivered(delivery.delivery_tag);
        self.inflight += 1;
        self.received += 1;
        let message = Delivered {
            generation: self.generation,
            tag: delivery.delivery_tag,
            redelivered: delivery.redelivered,
            body: delivery.data,
            properties: delivery.properties,
            batcher: 0,
        };
        if self.limiter.is_none() && self.held.is_empty() {
            self.hand_on(message);
        } else {
            self.held.push_back(message);
            self.release(ctx);
        }
    }

    /// Hands held deliveries onwards as fast as the limiter allows, in order, and schedules
    /// itself for when the next one may go. Without a limiter, or while stopping, everything
    /// held goes at once. Deliveries of a closed channel are dropped (the broker requeued them).
    fn release(&mut self, ctx: &mut Context<Self>) {
        while let Some(front) = self.held.front() {
            if front.generation != self.generation {
                self.held.pop_front();
                self.inflight = self.inflight.saturating_sub(1);
                continue;
            }
            let wait = match &self.limiter {
                Some(l) if !self.stopping => l
                    .check()
                    .err()
                    .map(|not_until| not_until.wait_time_from(l.clock().now())),
                _ => None,
            };
            if let Some(wait) = wait {
                if !self.release_pending {
                    self.release_pending = true;
                    ctx.run_later(wait.max(Duration::from_millis(1)), |act, ctx| {
                        act.release_pending = false;
                        act.release(ctx);
                    });
                }
                return;
            }
            if let Some(message) = self.held.pop_front() {
                self.hand_on(message);
            }
        }
        if self.inflight == 0 {
            self.maybe_subscribe(ctx);
            self.maybe_finish(ctx);
        }
    }

    /// Sends one delivery to the next processor, for the batcher of the current chunk.
    fn hand_on(&mut self, mut message: Delivered) {
        message.batcher = self.current_batcher;
        self.chunk_filled += 1;
        if self.chunk_filled >= self.config.batch_size {
            self.chunk_filled = 0;
            self.current_batcher = (self.current_batcher + 1) % self.batchers;
        }
        let processor = &self.processors[self.next_processor];
        self.next_processor = (self.next_processor + 1) % self.processors.len();
        processor.do_send(message);
    }

    fn send_drain(&mut self) {
        if self.drain_sent {
            return;
        }
        self.drain_sent = true;
        for p in &self.processor_drains {
            p.do_send(Drain);
        }
    }

    /// Cancels the subscription (deliveries in flight still settle on the open channel).
    fn unsubscribe(&mut self) {
        if let (Some(ch), Some(tag)) = (&self.channel, self.consumer_tag.take()) {
            cancel(ch, tag);
        }
    }

    /// Publishes the received count and the in-flight gauge (deltas since the last call).
    fn publish_counts(&mut self) {
        let (received, inflight) = self.published;
        if self.received > received {
            let delta = self.received - received;
            self.received_counter.increment(delta);
            crate::metrics::STATS
                .received
                .fetch_add(delta, std::sync::atomic::Ordering::Relaxed);
        }
        let delta = self.inflight as i64 - inflight as i64;
        if delta != 0 {
            crate::metrics::inflight(&self.inflight_gauge, delta);
        }
        self.published = (self.received, self.inflight);
    }

    fn add_consumer_stream(
        &mut self,
        ctx: &mut Context<Self>,
        consumer: lapin::Consumer,
        tag: String,
    ) {
        let generation = self.generation;
        self.consumer_tag = Some(tag.clone());
        self.idle = (self.received, 0);
        let stream = consumer
            .map(move |d| Event::Delivery(generation, Box::new(d)))
            .chain(futures::stream::once(async move {
                Event::Ended(generation, tag)
            }));
        ctx.add_stream(stream);
    }

    /// The idle watchdog, once per tick: nothing delivered for 15 ticks, nothing in flight,
    /// yet the queue holds messages -> the consumer is silently dead; rebuild it.
    fn check_idle(&mut self, ctx: &mut Context<Self>) {
        const IDLE_TICKS: u32 = 15;
        if self.received != self.idle.0 {
            self.idle = (self.received, 0);
            return;
        }
        self.idle.1 += 1;
        if self.idle.1 < IDLE_TICKS
            || self.stopping
            || self.connecting
            || !self.holds.is_empty()
            || self.inflight > 0
            || self.consumer_tag.is_none()
        {
            return;
        }
        self.idle.1 = 0;
        // The depth comes from the queue poller (`metrics::poll_queues`), no extra round trip.
        if let Some(ready) = crate::metrics::queue_depth(&self.config.queue)
            && ready > 0
        {
            ctx.notify(Stuck {
                generation: self.generation,
                ready,
            });
        }
    }

    /// Why the current link ended, from what the stream reported; a delivery the AMQP client
    /// cannot parse is named with what to do about it.
    fn link_end_reason(&self) -> &'static str {
        match &self.last_stream_error {
            Some(e) if e.contains("failed to parse") => {
                error!(pipeline = self.config.pipeline, queue = %self.config.queue, error = %e,
                    "a delivery at the head of the queue cannot be parsed by the AMQP client; \
                     it is redelivered on every reconnect (paced by a backoff) and blocks the \
                     messages behind it. Remove it with a tool that tolerates it (for example the \
                     management UI's Get Messages with 'Reject requeue false', which sends it to \
                     the DLX); on a quorum queue its delivery limit dead-letters it by itself");
                "parse_error"
            }
            _ if self
                .channel
                .as_ref()
                .is_some_and(|c| c.status().connected()) =>
            {
                "cancelled"
            }
            _ => "connection_lost",
        }
    }

    fn maybe_finish(&mut self, ctx: &mut Context<Self>) {
        if !(self.stopping && self.stream_ended && self.inflight == 0) || self.done.is_empty() {
            return;
        }
        let ops = self.ops.take();
        let task = self.ops_task.take();
        let channel = self.channel.take();
        let conn = self.connection.take();
        let waiters = std::mem::take(&mut self.done);
        let pipeline = self.config.pipeline;
        ctx.spawn(
            async move {
                drop(ops);
                if let Some(task) = task {
                    let _ = task.await;
                }
                amqp::close(channel, conn).await;
                info!(pipeline, "consumer drained and closed");
                for w in waiters {
                    let _ = w.send(());
                }
            }
            .into_actor(self),
        );
    }
}

/// This process's consumer tag for `pipeline`, unique per subscription (`suffix`).
fn consumer_tag(pipeline: &str, suffix: &str) -> String {
    format!(
        "warren-{}-{}-{pipeline}-{suffix}",
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

/// Connects and sets the prefetch; subscribing is left to [`Consumer::maybe_subscribe`].
async fn open(
    settings: &Settings,
    config: &ConsumerConfig,
) -> Result<(Connection, Channel), AmqpError> {
    let (conn, channel) = amqp::connect_channel(settings, config.pipeline).await?;
    let result = channel
        .basic_qos(config.prefetch, BasicQosOptions { global: false })
        .await;
    match result {
        Ok(()) => Ok((conn, channel)),
        Err(e) => {
            amqp::close(Some(channel), Some(conn)).await;
            Err(e.into())
        }
    }
}

/// Executes channel operations in order; stops at the first failure (the channel is gone and
/// the broker requeues whatever was not acked).
async fn run_ops(
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Vec<Op>>,
    pipeline: &'static str,
) {
    while let Some(mut ops) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            ops.extend(more);
        }
        for op in coalesce(ops) {
            let result = match op {
                Op::AckUpTo(tag) => {
                    channel
                        .basic_ack(tag, BasicAckOptions { multiple: true })
                        .await
                }
                Op::Requeue(tag) => {
                    channel
                        .basic_nack(
                            tag,
                            BasicNackOptions {
                                multiple: false,
                                requeue: true,
                            },
                        )
                        .await
                }
            };
            if let Err(e) = result {
                warn!(pipeline, error = %e, "cannot ack on this channel any more; the broker will redeliver");
                return;
            }
        }
    }
}

impl Actor for Consumer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.connect(ctx);
        // Watchdog: a closed channel or connection is noticed and the consumer rebuilt.
        ctx.run_interval(Duration::from_secs(1), |act, ctx| {
            act.publish_counts();
            if act.stopping || act.connecting {
                return;
            }
            let alive = act
                .channel
                .as_ref()
                .is_some_and(|ch| ch.status().connected());
            if !alive {
                warn!(
                    pipeline = act.config.pipeline,
                    "consumer channel is closed; rebuilding it"
                );
                crate::metrics::amqp_link(act.config.pipeline, false);
                let reason = act.link_end_reason();
                act.rebuild(ctx, reason);
            } else {
                act.check_idle(ctx);
            }
        });
    }
}

impl Handler<Connected> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Connected, ctx: &mut Self::Context) {
        self.connecting = false;
        if self.stopping {
            actix::spawn(amqp::close(Some(msg.channel), Some(msg.conn)));
            self.stream_ended = true;
            self.send_drain();
            self.maybe_finish(ctx);
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        let (tx, rx) = mpsc::unbounded_channel();
        self.ops = Some(tx);
        self.ops_task = Some(tokio::spawn(run_ops(
            msg.channel.clone(),
            rx,
            self.config.pipeline,
        )));
        self.tracker = AckTracker::default();
        self.channel = Some(msg.channel);
        self.connection = Some(msg.conn);
        self.linked_at = Some(Instant::now());
        self.last_stream_error = None;
        info!(pipeline = self.config.pipeline, queue = %self.config.queue, prefetch = self.config.prefetch,
            generation, held = !self.holds.is_empty(), "connected");
        crate::metrics::amqp_link(self.config.pipeline, true);
        if generation > 1 {
            crate::metrics::reconnected("amqp");
        }
        self.maybe_subscribe(ctx);
    }
}

impl StreamHandler<Event> for Consumer {
    fn handle(&mut self, event: Event, ctx: &mut Self::Context) {
        match event {
            Event::Delivery(generation, delivery) if generation == self.generation => {
                match *delivery {
                    Ok(d) => self.dispatch(d, ctx),
                    Err(e) => {
                        warn!(pipeline = self.config.pipeline, error = %e, "consumer stream error");
                        self.last_stream_error = Some(e.to_string());
                    }
                }
            }
            Event::Delivery(..) => {}
            Event::Ended(generation, tag) => {
                // Only the end of the current subscription matters; an older one was cancelled
                // by us for a hold.
                let current = generation == self.generation
                    && self.consumer_tag.as_deref() == Some(tag.as_str());
                if !current {
                    return;
                }
                if self.stopping {
                    self.stream_ended = true;
                    self.send_drain();
                    self.maybe_finish(ctx);
                } else if !self.connecting {
                    let reason = self.link_end_reason();
                    warn!(pipeline = self.config.pipeline, queue = %self.config.queue, reason,
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

impl Handler<Settle> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Settle, ctx: &mut Self::Context) {
        self.inflight = self.inflight.saturating_sub(msg.items.len());
        self.publish_counts();
        if msg.generation == self.generation && self.ops.is_some() {
            let mut ops = Vec::new();
            for (tag, disposition) in msg.items {
                self.tracker.settle(tag, disposition, &mut ops);
            }
            if !ops.is_empty()
                && let Some(tx) = &self.ops
            {
                let _ = tx.send(ops);
            }
        } else {
            debug!(
                pipeline = self.config.pipeline,
                generation = msg.generation,
                "settlement for a closed channel dropped; the broker redelivers those messages"
            );
        }
        if self.inflight == 0 {
            self.maybe_subscribe(ctx);
        }
        self.maybe_finish(ctx);
    }
}

impl Handler<Shutdown> for Consumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.done.push(tx);
        if !self.stopping {
            self.stopping = true;
            // Whatever the limiter holds goes onwards now, ahead of the drain marker.
            self.release(ctx);
            match (&self.channel, &self.consumer_tag) {
                (Some(ch), Some(tag)) if ch.status().connected() => {
                    info!(pipeline = self.config.pipeline, "cancelling the consumer");
                    cancel(ch, tag.clone());
                }
                _ => {
                    self.stream_ended = true;
                    self.send_drain();
                }
            }
        }
        self.maybe_finish(ctx);
        Box::pin(async move {
            let _ = rx.await;
        })
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
            warn!(pipeline = self.config.pipeline, reason = ?msg.reason, "holding: no new deliveries");
            self.unsubscribe();
        } else if !held && was_held && !self.stopping {
            info!(pipeline = self.config.pipeline, reason = ?msg.reason, inflight = self.inflight,
                "resuming deliveries once the last window is settled");
            if self
                .channel
                .as_ref()
                .is_some_and(|c| c.status().connected())
            {
                self.maybe_subscribe(ctx);
            } else if !self.connecting {
                self.rebuild(ctx, "connection_lost");
            }
        }
    }
}

impl Handler<Subscribed> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Subscribed, ctx: &mut Self::Context) {
        if msg.generation != self.generation {
            return;
        }
        self.subscribing = false;
        match msg.result {
            Ok(consumer) if self.stopping => {
                // Stopping began while subscribing: whatever this subscription delivered before
                // the cancel stays unacked and goes back to the queue when the channel closes.
                drop(consumer);
                if let Some(ch) = &self.channel {
                    cancel(ch, msg.tag);
                }
            }
            Ok(consumer) => {
                info!(pipeline = self.config.pipeline, queue = %self.config.queue,
                    consumer_tag = %msg.tag, generation = msg.generation, "consuming");
                self.add_consumer_stream(ctx, consumer, msg.tag);
                // A hold that came while subscribing wins at once.
                if !self.holds.is_empty() {
                    self.unsubscribe();
                }
            }
            Err(e) => {
                warn!(pipeline = self.config.pipeline, queue = %self.config.queue, error = %e,
                    "cannot subscribe; rebuilding the link");
                if !self.stopping && !self.connecting {
                    self.rebuild(ctx, "connection_lost");
                }
            }
        }
    }
}

impl Handler<Stuck> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Stuck, ctx: &mut Self::Context) {
        if msg.generation != self.generation || self.stopping || self.inflight > 0 {
            return;
        }
        warn!(pipeline = self.config.pipeline, queue = %self.config.queue, ready = msg.ready,
            "consumer receives nothing while its queue holds messages; rebuilding it");
        self.rebuild(ctx, "stuck");
    }
}

impl Handler<SetProcessors> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: SetProcessors, _: &mut Self::Context) {
        if msg.deliveries.is_empty() || msg.deliveries.len() != msg.drains.len() {
            return;
        }
        info!(
            pipeline = self.config.pipeline,
            processors = msg.deliveries.len(),
            "processors scaled"
        );
        self.processors = msg.deliveries;
        self.processor_drains = msg.drains;
        self.next_processor = 0;
        if self.drain_sent {
            for p in &self.processor_drains {
                p.do_send(Drain);
            }
        }
    }
}

impl Handler<SetRate> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: SetRate, ctx: &mut Self::Context) {
        info!(
            pipeline = self.config.pipeline,
            rate_limit_per_s = msg.per_s,
            "rate limit set"
        );
        self.limiter = limiter(msg.per_s);
        self.release(ctx);
    }
}
