//! The consumer stage: the broker link. It owns the consuming connection and channel (qos set
//! on every connect), hands what the broker pushed to the processors in chunks (everything ready
//! at once, up to a bound, a batch's worth per batcher), and performs the acks and nacks the
//! later stages decide (`acks.rs`), only on the channel that delivered them. A watchdog rebuilds
//! a consumer whose channel closed or whose stream ended; every rebuild of a link that died young
//! waits a growing backoff first, so a link that keeps failing is never a hot loop.
//!
//! Its state is two enums, not flags: the link ([`Link`]: down, connecting, or up with its
//! connection, channel, acks, window and [`Subscription`]: none, pending or active under a tag)
//! and the phase ([`Phase`]: running, stopping, stream ended). What only exists on an open link
//! (the channel, its acker, the consumer tag) lives inside `Link::Up`, so a stale channel or tag
//! cannot outlive the link it belonged to.
//!
//! Subscribing (`basic.consume`) has one path, [`Consumer::maybe_subscribe`], taken only when
//! nothing holds the pipeline (breaker, operator): a hold survives a reconnect. It never waits for
//! the previous window to settle: a delivery held unsettled (a message waiting out its requeue
//! backoff, a batch retried in place) would hold every message behind it for as long. The new
//! subscription takes its window at once (`basic.qos`, per consumer, before `basic.consume`);
//! what the earlier subscriptions delivered stays unacked on the same channel and is acked there
//! as it settles (delivery tags are per channel; a per-consumer prefetch counts only the deliveries
//! of the consumer it was set for). Bounds: a new subscription begins only while what earlier ones
//! still hold is at most its window (so at most two windows are in flight) and under the byte
//! budget, which counts every delivery held, whichever subscription or link brought it.
//!
//! Rate limiting (`RATE_LIMIT_PER_S`, `warren ctl rate`) goes through `throttle.rs`; a timer
//! (`run_later`) releases what it holds. A stopping consumer hands everything held onwards at
//! once, so every delivery settles before the drain.
//!
//! Bytes, not only counts: the prefetch window bounds how many deliveries are in flight, not
//! their size. A delivery holds its body and its properties as parsed (a header table can take
//! some 30 times its wire size: `headers::parsed_bytes`). Once what is in flight reaches
//! `MAX_INFLIGHT_BYTES` the consumer cancels its subscription, lets what it holds settle back
//! under the budget, and subscribes again with a window cut to what the budget holds of the
//! largest delivery it saw (`basic.qos` before `basic.consume`); after two such windows of small
//! deliveries it grows back to the prefetch the same way. The budget counts everything in flight,
//! so what overshoots it is at most what the broker pushed before the cancel: one window of
//! deliveries, each body at most the broker's `max_message_size` and each content header at most
//! its `frame_max`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::oneshot;
use tracing::{debug, error, info, warn};

use super::acks::Acker;
use super::dispatch::{Dispatch, Feed};
use super::message::{Delivery, Hold, HoldReason, Settle};
use super::throttle::{Release, Throttle};
use crate::amqp::{self, AmqpError};
use crate::config::Settings;

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

/// Shutdown, step 1: stop taking deliveries (cancel the subscription). Answers once nothing
/// more will arrive; whatever the rate limiter held has been handed onwards by then.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel;

/// Shutdown, step 4: answers once every delivery is settled and its ack or nack was sent.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Settled;

/// Shutdown, step 5: close the channel and the connection. Answers when closed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Close;

/// Replace the processors deliveries are spread over (live scaling). Processors no longer used
/// finish what their mailboxes hold and stop when their last address is dropped.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetProcessors(pub Vec<Feed>);

/// Fill `batchers` batchers (batch inserts in flight) from now on, with a prefetch window of at
/// most `prefetch` (balancing). A subscription whose window differs is cancelled; the next one
/// takes the new window as soon as the cancel is answered (`basic.qos` before `basic.consume`),
/// without waiting for what is in flight to settle.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetConcurrency {
    pub batchers: usize,
    pub prefetch: u16,
}

/// Hand at most `per_s` deliveries per second onwards from now on; 0 removes the limit.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetRate {
    pub per_s: u32,
}

/// A `basic.consume` finished on the channel of `generation`: the consumer, or why not.
#[derive(Message)]
#[rtype(result = "()")]
struct Subscribed {
    generation: u64,
    result: Result<lapin::Consumer, String>,
    tag: String,
    /// The window (qos) the subscription has.
    window: u16,
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
    /// Everything the stream held ready at one poll.
    Deliveries(u64, Vec<lapin::Result<lapin::message::Delivery>>),
    /// The subscription with this consumer tag ended.
    Ended(u64, String),
}

/// What the consumer consumes and how.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// The pipeline and which of its stages: the labels of logs and metrics; written
    /// `<pipeline>/<stage>`, the name of the AMQP link.
    pub stage: crate::metrics::StageId,
    pub queue: String,
    pub prefetch: u16,
    /// Bytes of bodies in flight at most (`MAX_INFLIGHT_BYTES`).
    pub max_inflight_bytes: u64,
    /// The largest body accepted (`MAX_MESSAGE_BYTES`): `prefetch` already holds that many
    /// bodies of this size within the budget; only a larger body cuts the window further.
    pub max_message_bytes: usize,
    /// Messages handed onwards per second at most at start (0: no limit; `warren ctl rate`
    /// changes it).
    pub rate_limit_per_s: u32,
    /// The queue depths the poller last saw (`amqp::monitor`): the idle watchdog's evidence
    /// that messages wait while nothing arrives, without a round trip of its own.
    pub depths: crate::amqp::monitor::Depths,
    /// The generation of the channel deliveries can still be settled on, 0 while there is none:
    /// written here, read by the stages that republish (a delivery of a channel that is gone
    /// is the broker's again, and republished it would be republished twice).
    pub live_generation: Arc<AtomicU64>,
}

/// The broker link, one state at a time.
enum Link {
    /// No connection and none being made: before the start, and after `Close`.
    Down,
    /// A connect (after its backoff) is under way; it answers `Connected`.
    Connecting,
    /// Connected, with its prefetch set.
    /// Boxed: the link is rebuilt rarely, and the other states carry nothing.
    Up(Box<Linked>),
}

/// An open link: the connection, its channel, that channel's acks and its subscription.
struct Linked {
    connection: Connection,
    channel: Channel,
    /// The acks of this channel; taken once a drain is over, to send the last ones.
    acker: Option<Acker>,
    /// When the link came up, to tell a young death (back off) from an old one.
    since: Instant,
    /// The prefetch window (`basic.qos`) set on this channel.
    window: u16,
    subscription: Subscription,
}

/// The subscription (`basic.consume`) of a link.
#[derive(Debug, PartialEq, Eq)]
enum Subscription {
    /// Not consuming: held, past the byte budget, or stopping.
    None,
    /// A `basic.consume` is under way.
    Pending,
    /// Consuming under this consumer tag.
    Active(String),
    /// Cancelled by warren (a hold, a new window), its stream not ended yet: deliveries the
    /// broker sent before its `cancel-ok` may still come. No new subscription until it ends:
    /// the next one's deliveries carry higher tags, and handed on before the older ones, a
    /// multi-ack of theirs would ack older deliveries not yet processed (found by the balance
    /// bench: one-by-one acks for the rest of the drain, and deliveries left unacked).
    Cancelling(String, Instant),
}

/// Where the consumer is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    /// `Cancel` came: nothing new is subscribed; the stream is ending.
    Stopping,
    /// Stopping, and the stream ended: nothing more will arrive.
    StreamEnded,
}

/// The consumer actor.
pub struct Consumer {
    config: ConsumerConfig,
    settings: Settings,
    /// Which processor and batcher each delivery goes to (chosen at the wiring).
    dispatch: Dispatch,
    link: Link,
    phase: Phase,
    /// Bumped on every (re)connect; deliveries carry it back in `Settle`.
    generation: u64,
    /// Numbers subscriptions, so consumer tags stay unique.
    subscriptions: u64,
    /// Consumes in a row that failed (not answered in time, refused): each waits twice as long
    /// as the one before, up to 16 connect timeouts, so a broker slow to answer (a queue busy
    /// taking back what the last link held) is given the time instead of a rebuild that makes
    /// it busier (found by CI: 301 deliveries of 100 KB headers, the consume rebuilt every 5 s
    /// for two minutes). Reset by a consume that succeeds.
    consume_failures: u32,
    /// Delays before rebuilding links that died young (backon), reset by a healthy link.
    rebuild_delays: Box<dyn Iterator<Item = Duration> + Send>,
    /// The last error the consumer stream reported, to name why the link ended.
    last_stream_error: Option<String>,
    /// The frame limit the link proposes: AMQP_URL's, or the broker's once a delivery's content
    /// header was larger than AMQP_URL's (the link died over it; it would die again).
    frames: amqp::Frames,
    /// Delivered but not yet settled, over all subscriptions and generations (drain waits for
    /// 0; a new subscription for it to be at most its window).
    inflight: usize,
    /// The bytes those deliveries hold (bodies and parsed properties).
    inflight_bytes: u64,
    /// The largest delivery (body and parsed properties) since the current subscription began
    /// (kept across a reconnect): the next window is cut to what the budget holds of it.
    largest: usize,
    /// The largest delivery of earlier subscriptions that cut the window: kept until two
    /// windows of smaller ones grow it back, so that a later change of window (the concurrency
    /// changed, a new subscription) never undoes the cut at once.
    kept_largest: usize,
    /// Deliveries since the current subscription began.
    since_subscribe: u64,
    /// The bytes-in-flight gauge, resolved once; the value last published to it.
    inflight_bytes_gauge: (metrics::Gauge, u64),
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
    /// Answered when the stream ended after `Cancel`.
    cancelled: Vec<oneshot::Sender<()>>,
    /// Answered when everything is settled and acked after `Cancel`.
    settled: Vec<oneshot::Sender<()>>,
    /// Caps the deliveries handed onwards per second (RATE_LIMIT_PER_S, `warren ctl rate`) and
    /// holds back those that came faster.
    throttle: Throttle,
    /// A timer to release what the throttle holds is pending.
    release_pending: bool,
}

impl Consumer {
    pub fn new(config: ConsumerConfig, settings: Settings, dispatch: Dispatch) -> Self {
        let received_counter = crate::metrics::received_counter(&config.stage);
        let throttle = Throttle::new(config.rate_limit_per_s);
        Self {
            config: config.clone(),
            settings,
            dispatch,
            link: Link::Down,
            phase: Phase::Running,
            generation: 0,
            subscriptions: 0,
            consume_failures: 0,
            rebuild_delays: Box::new(amqp::reconnect_backoff()),
            last_stream_error: None,
            frames: amqp::Frames::Broker,
            inflight: 0,
            inflight_bytes: 0,
            largest: 0,
            kept_largest: 0,
            since_subscribe: 0,
            inflight_bytes_gauge: (crate::metrics::inflight_bytes_gauge(&config.stage), 0),
            holds: Vec::new(),
            received: 0,
            published: (0, 0),
            idle: (0, 0),
            received_counter,
            inflight_gauge: crate::metrics::inflight_gauge(),
            cancelled: Vec::new(),
            settled: Vec::new(),
            throttle,
            release_pending: false,
        }
    }

    /// The open link, if there is one.
    fn linked(&mut self) -> Option<&mut Linked> {
        match &mut self.link {
            Link::Up(linked) => Some(linked.as_mut()),
            _ => None,
        }
    }

    /// The channel of the open link, when it is still open.
    fn open_channel(&self) -> Option<&Channel> {
        match &self.link {
            Link::Up(linked) if linked.channel.status().connected() => Some(&linked.channel),
            _ => None,
        }
    }

    fn connecting(&self) -> bool {
        matches!(self.link, Link::Connecting)
    }

    /// A subscription warren cancelled whose stream has not ended after the connect timeout.
    fn cancel_unanswered(&self) -> bool {
        matches!(&self.link, Link::Up(l) if matches!(&l.subscription,
            Subscription::Cancelling(_, since) if since.elapsed() > self.settings.connect_timeout()))
    }

    /// As many deliveries in flight as the subscription's window (or no link): the broker has
    /// a reason to send nothing. Settled deliveries whose acks wait behind a held front are
    /// released within a watchdog tick (`acks.rs`), long before the idle watchdog decides.
    fn window_full(&self) -> bool {
        match &self.link {
            Link::Up(linked) => self.inflight >= usize::from(linked.window),
            _ => true,
        }
    }

    /// Consuming: the link is up with a subscription.
    fn consuming(&self) -> bool {
        matches!(&self.link, Link::Up(l) if matches!(l.subscription, Subscription::Active(_)))
    }

    /// Starts a connect, after the backoff a link that lived `lived` earns (`None`: there was
    /// none). Not while one is under way, nor once stopping.
    fn connect(&mut self, ctx: &mut Context<Self>, lived: Option<Duration>) {
        if self.connecting() || self.phase != Phase::Running {
            return;
        }
        self.link = Link::Connecting;
        let settings = self.settings.clone();
        let config = self.config.clone();
        let frames = self.frames;
        let addr = ctx.address();
        let first_delay = self.rebuild_delay(lived);
        actix::spawn(async move {
            let open = || open(&settings, &config, frames);
            let wanted = || addr.connected();
            if let Some((conn, channel)) = amqp::until_open(
                &config.stage.to_string(),
                "consumer cannot consume; retrying",
                first_delay,
                open,
                wanted,
            )
            .await
            {
                addr.do_send(Connected { conn, channel });
            }
        });
    }

    /// How long to wait before (re)building the link: nothing for the first one or after a
    /// healthy one, a growing backoff (200 ms doubling to 10 s, jittered) after each link that
    /// died young.
    fn rebuild_delay(&mut self, lived: Option<Duration>) -> Duration {
        match lived {
            None if self.generation == 0 => Duration::ZERO,
            Some(lived) if lived >= HEALTHY_LINK => {
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
        crate::metrics::consumer_restart(&self.config.stage, reason);
        let lived = self.teardown();
        self.connect(ctx, lived);
    }

    /// Subscribes (`basic.consume`) when nothing holds the pipeline, the link is up without a
    /// subscription (none under way, none cancelled whose stream has not ended), and what the
    /// earlier subscriptions still hold leaves room (see [`Consumer::room_for`]). It never waits
    /// for them to settle: a held delivery would hold every message behind it.
    fn maybe_subscribe(&mut self, ctx: &mut Context<Self>) {
        if self.phase != Phase::Running || !self.holds.is_empty() {
            return;
        }
        let window = self.wanted_window();
        if !self.room_for(window) {
            return;
        }
        let stage = self.config.stage.clone();
        let (prefetch, largest) = (self.config.prefetch, self.largest);
        let max_inflight_bytes = self.config.max_inflight_bytes;
        let Link::Up(linked) = &mut self.link else {
            return;
        };
        if linked.subscription != Subscription::None || !linked.channel.status().connected() {
            return;
        }
        let qos = (window != linked.window).then_some(window);
        if let Some(w) = qos {
            info!(
                pipeline = stage.pipeline(),
                stage = stage.stage().as_str(),
                window = w,
                prefetch,
                largest_delivery = largest,
                max_inflight_bytes,
                "prefetch window set to what MAX_INFLIGHT_BYTES holds of the largest delivery \
                 seen (body and parsed properties)"
            );
        }
        linked.subscription = Subscription::Pending;
        let channel = linked.channel.clone();
        let generation = self.generation;
        let tag = consumer_tag(&stage, &format!("{generation}-{}", self.subscriptions));
        self.subscriptions += 1;
        let queue = self.config.queue.clone();
        let addr = ctx.address();
        let bound = self.settings.connect_timeout() * (1 << self.consume_failures.min(4));
        actix::spawn(async move {
            // Bounded: a consume that never answers must not leave the pipeline unsubscribed.
            // A new window first: the broker applies a per-consumer qos to consumers made after.
            let consume = async {
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
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(_) => Err(format!("basic.consume not answered within {bound:?}")),
            };
            addr.do_send(Subscribed {
                generation,
                result,
                tag,
                window,
            });
        });
    }

    /// Drops the link: its unacked deliveries go back to the queue on the broker. Answers how
    /// long the link lived (`None`: there was none).
    fn teardown(&mut self) -> Option<Duration> {
        // Held deliveries of this channel go back to the queue with it.
        let (held, held_bytes) = self.throttle.clear();
        self.inflight = self.inflight.saturating_sub(held);
        self.inflight_bytes = self.inflight_bytes.saturating_sub(held_bytes);
        match std::mem::replace(&mut self.link, Link::Down) {
            Link::Up(linked) => {
                // However it ended (the channel closed, the stream ended, a stuck consumer): the
                // link is down until the next one is up.
                self.config.live_generation.store(0, Ordering::Release);
                crate::events::amqp_link(
                    &self.config.stage.to_string(),
                    false,
                    Some(self.config.stage.pipeline()),
                );
                // Dropping the acker ends its task; the channel's unacked deliveries are requeued.
                drop(linked.acker);
                actix::spawn(amqp::close(Some(linked.channel), Some(linked.connection)));
                Some(linked.since.elapsed())
            }
            Link::Down | Link::Connecting => None,
        }
    }

    /// Takes what the broker pushed: records every delivery for the acks, then hands the
    /// chunk onwards (through the limiter when one is set).
    fn dispatch(
        &mut self,
        chunk: Vec<lapin::Result<lapin::message::Delivery>>,
        ctx: &mut Context<Self>,
    ) {
        let generation = self.generation;
        // One clock read per chunk: the sink gives back deliveries held near the broker's
        // consumer_timeout, counted from here (see `Delivery::received_at`).
        let received_at = Instant::now();
        let mut deliveries = Vec::with_capacity(chunk.len());
        for item in chunk {
            match item {
                Ok(d) => deliveries.push(Delivery {
                    generation,
                    tag: d.delivery_tag,
                    redelivered: d.redelivered,
                    held_bytes: (d.data.len() + crate::amqp::headers::parsed_bytes(&d.properties))
                        as u64,
                    body: d.data.into(),
                    properties: d.properties,
                    received_at,
                }),
                Err(e) => {
                    warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), error = %e, "consumer stream error");
                    self.last_stream_error = Some(e.to_string());
                }
            }
        }
        if deliveries.is_empty() {
            return;
        }
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.delivered(deliveries.iter().map(|d| d.tag));
        }
        self.inflight += deliveries.len();
        self.received += deliveries.len() as u64;
        self.since_subscribe += deliveries.len() as u64;
        for d in &deliveries {
            self.inflight_bytes += d.held_bytes;
            self.largest = self.largest.max(d.held_bytes as usize);
        }
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
    /// there would only cut the others short.
    fn hand_on(&mut self, deliveries: Vec<Delivery>) {
        self.dispatch.hand_on(deliveries);
        let starved = matches!(&self.link, Link::Up(l)
            if self.inflight >= usize::from(l.window)
                && usize::from(l.window) < self.dispatch.batch_size());
        if self.phase == Phase::Running && (!self.consuming() || starved) {
            self.dispatch.flush_all();
        }
    }

    /// Whether a subscription with `window` may begin beside what is in flight (all of it from
    /// earlier subscriptions or links: none is active): at most `window` deliveries, so that the
    /// deliveries in flight stay within two windows however often the window changes while some
    /// are held, and under the byte budget, which counts every delivery held (past it, nothing
    /// more is taken until enough settles). A single held delivery never stops it, unless it
    /// alone fills the byte budget.
    fn room_for(&self, window: u16) -> bool {
        self.inflight <= usize::from(window) && self.inflight_bytes < self.config.max_inflight_bytes
    }

    /// The window the next subscription takes: the prefetch, cut to what the byte budget holds
    /// of the largest delivery seen during the current one if that was larger than any accepted
    /// body (at least 1).
    fn wanted_window(&self) -> u16 {
        self.window_for(self.largest.max(self.kept_largest))
    }

    /// The prefetch, cut to what the byte budget holds of deliveries of `largest` bytes.
    fn window_for(&self, largest: usize) -> u16 {
        let largest = (largest.max(self.config.max_message_bytes) as u64).max(1);
        let fits = (self.config.max_inflight_bytes / largest).clamp(1, u64::from(u16::MAX));
        (fits as u16).min(self.config.prefetch.max(1))
    }

    /// Past the byte budget: no more deliveries until what is in flight settles back under it,
    /// then a smaller window. A cut window that saw two windows' worth of small bodies grows
    /// back the same way. Either way the subscription is cancelled, so this runs once per
    /// subscription.
    fn check_budget(&mut self) {
        if self.phase != Phase::Running || !self.consuming() {
            return;
        }
        let Link::Up(linked) = &self.link else {
            return;
        };
        let window = linked.window;
        if self.inflight_bytes >= self.config.max_inflight_bytes {
            warn!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                inflight_bytes = self.inflight_bytes,
                max_inflight_bytes = self.config.max_inflight_bytes,
                largest_delivery = self.largest,
                "the deliveries in flight (bodies and parsed properties) reached \
                 MAX_INFLIGHT_BYTES; no new deliveries until they settle under it, then a smaller \
                 prefetch window"
            );
        } else if window < self.config.prefetch
            && self.since_subscribe >= 2 * u64::from(window)
            && self.window_for(self.largest) > window
        {
            self.kept_largest = 0;
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                window,
                "two windows of bodies the budget holds more of: the window grows back once \
                 what is in flight settles"
            );
        } else {
            return;
        }
        self.unsubscribe();
        self.dispatch.flush_all();
    }

    /// Hands held deliveries onwards as fast as the limiter allows, in order, and schedules
    /// itself for when the next one may go. Without a limiter, or while stopping, everything
    /// held goes at once. Deliveries of a closed channel are dropped (the broker requeued them).
    fn release(&mut self, ctx: &mut Context<Self>) {
        let Release {
            ready,
            dropped,
            dropped_bytes,
            wait,
        } = self
            .throttle
            .take(self.generation, self.phase != Phase::Running);
        self.inflight = self.inflight.saturating_sub(dropped);
        self.inflight_bytes = self.inflight_bytes.saturating_sub(dropped_bytes);
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

    /// Nothing more will arrive: answers `Cancel`, then checks whether all is settled.
    fn stream_done(&mut self, ctx: &mut Context<Self>) {
        self.phase = Phase::StreamEnded;
        for w in self.cancelled.drain(..) {
            let _ = w.send(());
        }
        self.maybe_finish(ctx);
    }

    /// A subscription whose window is not the one wanted (the concurrency changed) is
    /// cancelled, and the next one takes the new window once the cancel is answered (its
    /// stream ended), whatever is still in flight.
    fn follow_window(&mut self) {
        let wanted = self.wanted_window();
        if self.phase != Phase::Running
            || !matches!(&self.link, Link::Up(l) if l.window != wanted
                && matches!(l.subscription, Subscription::Active(_)))
        {
            return;
        }
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            window = wanted,
            inflight = self.inflight,
            "the prefetch window follows the concurrency: resubscribing"
        );
        self.unsubscribe();
        // What the batchers hold goes at once: nothing more arrives until the cancel is
        // answered, and a window shrunk below what is in flight waits for some of it to settle.
        self.dispatch.flush_all();
        // The stream's end (`Event::Ended`) subscribes again.
    }

    /// Cancels the subscription (deliveries in flight still settle on the open channel).
    fn unsubscribe(&mut self) {
        let Some(linked) = self.linked() else {
            return;
        };
        if let Subscription::Active(tag) = &linked.subscription {
            cancel(&linked.channel, tag.clone());
            linked.subscription = Subscription::Cancelling(tag.clone(), Instant::now());
        }
    }

    /// Publishes the received count and the in-flight gauge (deltas since the last call).
    fn publish_counts(&mut self) {
        let (received, inflight) = self.published;
        if self.received > received {
            let delta = self.received - received;
            self.received_counter.increment(delta);
            crate::metrics::stage(&self.config.stage)
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

    fn add_consumer_stream(
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

    /// The idle watchdog, once per tick: nothing delivered for 15 ticks, room in the window,
    /// yet the queue holds messages -> the consumer is silently dead; rebuild it. (Room, not
    /// nothing in flight: a delivery held for minutes must not hide a dead subscription.)
    fn check_idle(&mut self, ctx: &mut Context<Self>) {
        const IDLE_TICKS: u32 = 15;
        if self.received != self.idle.0 {
            self.idle = (self.received, 0);
            return;
        }
        self.idle.1 += 1;
        if self.idle.1 < IDLE_TICKS
            || self.phase != Phase::Running
            || !self.holds.is_empty()
            || self.window_full()
            || !self.consuming()
        {
            return;
        }
        self.idle.1 = 0;
        if let Some(ready) = self.config.depths.get(&self.config.queue)
            && ready > 0
        {
            ctx.notify(Stuck {
                generation: self.generation,
                ready,
            });
        }
    }

    /// Why the current link ended, from what the stream reported; a delivery the AMQP client
    /// cannot parse is named with what to do about it, and a frame over the configured limit
    /// makes the next link take the broker's limit.
    fn link_end_reason(&mut self) -> &'static str {
        match &self.last_stream_error {
            Some(e) if e.contains("frame too large") => {
                warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, error = %e,
                    "a delivery's content header is larger than the frame_max that AMQP_URL sets; \
                     this consumer takes the broker's frame_max from now on");
                self.frames = amqp::Frames::BrokerOnly;
                "frame_too_large"
            }
            Some(e) if e.contains("failed to parse") => {
                error!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, error = %e,
                    "a delivery at the head of the queue cannot be parsed by the AMQP client; \
                     it is redelivered on every reconnect (paced by a backoff) and blocks the \
                     messages behind it. Remove it with a tool that tolerates it (for example the \
                     management UI's Get Messages with 'Reject requeue false', which sends it to \
                     the DLX); on a quorum queue its delivery limit dead-letters it by itself");
                "parse_error"
            }
            _ if self.open_channel().is_some() => "cancelled",
            _ => "connection_lost",
        }
    }

    /// Once stopping, the stream ended and nothing is in flight: sends the last acks and
    /// answers `Settled`.
    fn maybe_finish(&mut self, ctx: &mut Context<Self>) {
        if self.phase != Phase::StreamEnded || self.inflight > 0 || self.settled.is_empty() {
            return;
        }
        let acker = self.linked().and_then(|l| l.acker.take());
        let waiters = std::mem::take(&mut self.settled);
        ctx.spawn(
            async move {
                if let Some(acker) = acker {
                    acker.close().await;
                }
                for w in waiters {
                    let _ = w.send(());
                }
            }
            .into_actor(self),
        );
    }
}

/// What `stream` holds ready at one poll, up to `max` items, as one chunk; after each chunk the
/// stream is left alone for `linger`, so what arrives meanwhile makes the next chunk instead of
/// a wake-up each. The first item after a quiet spell comes at once.
fn chunks<S: futures::Stream>(
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

/// Connects and sets the prefetch; subscribing is left to [`Consumer::maybe_subscribe`].
async fn open(
    settings: &Settings,
    config: &ConsumerConfig,
    frames: amqp::Frames,
) -> Result<(Connection, Channel), AmqpError> {
    let (conn, channel) =
        amqp::connect_channel(settings, &config.stage.to_string(), frames).await?;
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

impl Actor for Consumer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.connect(ctx, None);
        // Watchdog: a closed channel or connection is noticed and the consumer rebuilt.
        ctx.run_interval(Duration::from_secs(1), |act, ctx| {
            act.publish_counts();
            if let Some(acker) = act.linked().and_then(|l| l.acker.as_mut()) {
                acker.tick();
            }
            if act.phase == Phase::Stopping && act.cancel_unanswered() {
                // Stopping behind a cancel whose stream never ended: the stop goes on; what that
                // subscription still held unacked goes back to the queue with the channel.
                warn!(
                    pipeline = act.config.stage.pipeline(),
                    stage = act.config.stage.stage().as_str(),
                    "a cancelled subscription's stream did not end; stopping without it"
                );
                if let Some(linked) = act.linked() {
                    linked.subscription = Subscription::None;
                }
                act.stream_done(ctx);
            }
            if act.phase != Phase::Running || act.connecting() {
                return;
            }
            if act.open_channel().is_none() {
                warn!(
                    pipeline = act.config.stage.pipeline(),
                    stage = act.config.stage.stage().as_str(),
                    "consumer channel is closed; rebuilding it"
                );
                let reason = act.link_end_reason();
                act.rebuild(ctx, reason);
            } else if act.cancel_unanswered() {
                // Its stream never ended: the link is rebuilt (its unacked deliveries go back to
                // the queue with the channel) rather than the pipeline waiting for ever.
                warn!(
                    pipeline = act.config.stage.pipeline(),
                    stage = act.config.stage.stage().as_str(),
                    "a cancelled subscription's stream did not end; rebuilding the link"
                );
                act.rebuild(ctx, "cancel_unanswered");
            } else {
                act.check_idle(ctx);
            }
        });
    }
}

impl Handler<Connected> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Connected, ctx: &mut Self::Context) {
        if self.phase != Phase::Running {
            self.link = Link::Down;
            actix::spawn(amqp::close(Some(msg.channel), Some(msg.conn)));
            self.stream_done(ctx);
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        self.config
            .live_generation
            .store(generation, Ordering::Release);
        self.link = Link::Up(Box::new(Linked {
            acker: Some(Acker::open(
                msg.channel.clone(),
                self.config.stage.clone(),
                self.config.prefetch,
            )),
            connection: msg.conn,
            channel: msg.channel,
            since: Instant::now(),
            // `open` set the configured prefetch on the new channel.
            window: self.config.prefetch,
            subscription: Subscription::None,
        }));
        self.last_stream_error = None;
        info!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, prefetch = self.config.prefetch,
            generation, held = !self.holds.is_empty(), "connected");
        crate::events::amqp_link(
            &self.config.stage.to_string(),
            true,
            Some(self.config.stage.pipeline()),
        );
        if generation > 1 {
            crate::metrics::reconnected("amqp");
        }
        self.maybe_subscribe(ctx);
    }
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

impl Handler<Settle> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Settle, ctx: &mut Self::Context) {
        self.inflight = self.inflight.saturating_sub(msg.items.len());
        self.inflight_bytes = self.inflight_bytes.saturating_sub(msg.bytes);
        self.publish_counts();
        let current = msg.generation == self.generation;
        if current && let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.settle(&msg.items);
        } else {
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                generation = msg.generation,
                "settlement for a closed channel dropped; the broker redelivers those messages"
            );
        }
        // Whatever is still held: a new subscription waits only for room (`room_for`).
        self.maybe_subscribe(ctx);
        self.maybe_finish(ctx);
    }
}

impl Handler<Cancel> for Consumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Cancel, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.cancelled.push(tx);
        if self.phase == Phase::Running {
            self.phase = Phase::Stopping;
            // Whatever the limiter holds goes onwards now, ahead of the drain marker.
            self.release(ctx);
            // The subscription stays recorded, so its end (`Event::Ended`) answers the waiters.
            match &self.link {
                Link::Up(linked) if linked.channel.status().connected() => {
                    match &linked.subscription {
                        Subscription::Active(_) => {
                            info!(
                                pipeline = self.config.stage.pipeline(),
                                stage = self.config.stage.stage().as_str(),
                                "cancelling the consumer"
                            );
                            // Recorded as cancelling, as any cancel: its end answers the waiters,
                            // and a cancel-ok that never comes is noticed by the watchdog, which
                            // goes on with the stop without it. (Left `Active`, a silent link
                            // held the stop to SHUTDOWN_TIMEOUT_MS and an exit 1.)
                            self.unsubscribe();
                        }
                        // Its end (`Event::Ended`) goes on with the stop.
                        Subscription::Cancelling(..) => {}
                        Subscription::None | Subscription::Pending => self.stream_done(ctx),
                    }
                }
                _ => self.stream_done(ctx),
            }
        } else if self.phase == Phase::StreamEnded {
            self.stream_done(ctx);
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl Handler<Settled> for Consumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Settled, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.settled.push(tx);
        self.maybe_finish(ctx);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl Handler<Close> for Consumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Close, _: &mut Self::Context) -> Self::Result {
        if self.phase == Phase::Running {
            self.phase = Phase::Stopping;
        }
        let link = std::mem::replace(&mut self.link, Link::Down);
        let stage = self.config.stage.clone();
        Box::pin(async move {
            if let Link::Up(linked) = link {
                drop(linked.acker);
                amqp::close(Some(linked.channel), Some(linked.connection)).await;
            }
            info!(
                pipeline = stage.pipeline(),
                stage = stage.stage().as_str(),
                "consumer closed"
            );
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
                self.add_consumer_stream(ctx, consumer, msg.tag);
                // A hold that came while subscribing wins at once; a concurrency that changed
                // while subscribing gets its window.
                if !self.holds.is_empty() {
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

impl Handler<Stuck> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Stuck, ctx: &mut Self::Context) {
        if msg.generation != self.generation || self.phase != Phase::Running || self.window_full() {
            return;
        }
        warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, ready = msg.ready,
            "consumer receives nothing while its queue holds messages; rebuilding it");
        self.rebuild(ctx, "stuck");
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

impl Handler<SetConcurrency> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: SetConcurrency, _: &mut Self::Context) {
        let before = self.dispatch.batchers();
        let batchers = self.dispatch.set_batchers(msg.batchers);
        // More batches may now commit ahead of the oldest; the window may stay as it is (the
        // byte budget's cap), so the acks learn it here, not only at the next subscription.
        let batch_size = self.dispatch.batch_size();
        if let Some(linked) = self.linked() {
            let window = linked.window;
            if let Some(acker) = linked.acker.as_mut() {
                acker.set_window(window, before.max(batchers), batch_size);
            }
        }
        self.config.prefetch = msg.prefetch.max(1);
        let window = self.wanted_window();
        debug!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            batchers,
            window,
            "concurrency set"
        );
        self.follow_window();
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
            self.settings.hand_back_after(),
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
