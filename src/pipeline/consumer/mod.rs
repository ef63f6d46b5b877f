//! The consumer stage: the broker link. It owns the consuming connection and channel (qos set
//! on every connect), hands what the broker pushed to the processors in chunks (everything ready
//! at once, up to a bound, a batch's worth per batcher), and performs the acks and nacks the
//! later stages decide (`acks.rs`), only on the channel that delivered them. A watchdog rebuilds
//! a consumer whose channel closed or whose stream ended; every rebuild of a link that died young
//! waits a growing backoff first, so a link that keeps failing is never a hot loop.
//!
//! Its state is three enums, not flags: the link ([`link::Link`]: down, connecting, or up with
//! its connection, channel, acks, window and [`link::Subscription`]: none, pending, active under
//! a tag, or cancelling) and the phase ([`link::Phase`]: running, stopping, stream ended). What
//! only exists on an open link (the channel, its acker, the consumer tag) lives inside
//! `Link::Up`, so a stale channel or tag cannot outlive the link it belonged to.
//!
//! One actor, its work in one file per concern (each an `impl Consumer` block and the handlers
//! of its messages):
//! - `mod.rs`: the messages the pipeline sends it, its configuration, its state, its start.
//! - `link.rs`: the link's states; connect, rebuild with backoff, teardown, why a link ended.
//! - `subscription.rs`: `basic.consume` and its cancel, the stream of deliveries in chunks and
//!   its end, the holds (breaker, operator).
//! - `window.rs`: the prefetch window and the byte budget (`MAX_INFLIGHT_BYTES`), and the window
//!   following the concurrency.
//! - `oversize.rs`: bodies over `MAX_MESSAGE_BYTES`: given back unread, then taken whole and
//!   alone under the process's one permit ([`OversizePermit`]).
//! - `deliveries.rs`: deliveries handed on (through the rate limit, `throttle.rs`), settlements
//!   back, the counts.
//! - `watchdog.rs`: the once-a-second checks: a closed link, a cancel never answered, a
//!   consumer idle while its queue holds messages.
//! - `stop.rs`: its part of the shutdown sequence (`Cancel`, `Settled`, `Close`).

mod deliveries;
mod link;
mod oversize;
mod stop;
mod subscription;
mod watchdog;
mod window;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::amqp::{self, AmqpConfig};
use crate::pipeline::dispatch::{Dispatch, Feed};
use crate::pipeline::message::HoldReason;
use crate::pipeline::throttle::Throttle;
use link::{Link, Phase};
pub use oversize::OversizePermit;
pub use stop::StopCounts;

/// Shutdown, step 1: stop taking deliveries (cancel the subscription). Answers once nothing
/// more will arrive; whatever the rate limiter held has been handed onwards by then.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel;

/// Shutdown, step 4: answers once every delivery is settled and its ack or nack was sent.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Settled;

/// Shutdown, step 5: close the channel and the connection. Answers when closed, with what the
/// stop did with the deliveries.
#[derive(Debug, Message)]
#[rtype(result = "StopCounts")]
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
    /// The generation of the channel deliveries can still be settled on (0 while there is
    /// none) and the copies whose ack is not proven handled: the generation is written here and
    /// read by the stages that republish (a delivery of a channel that is gone is the broker's
    /// again, and republished it would be republished twice); a link's end hands its unproven
    /// copies to the memory of lost ones, and its acker proves the others (`copies.rs`).
    pub copies: Arc<crate::pipeline::copies::Copies>,
    /// This start of the stage (`acked.rs`): the acks it records are its own, and a stage a
    /// reload starts in its place asks its table only about those.
    pub incarnation: u64,
    /// The process's one permit to hold a body over `MAX_MESSAGE_BYTES` (shared by every stage
    /// of every pipeline): the body limit is lifted only by its holder (`oversize.rs`).
    pub oversize: OversizePermit,
    /// What the stage's decoded records hold (the processors count them, the sinks release
    /// them): part of the byte budget.
    pub decoded: Arc<crate::pipeline::message::DecodedBytes>,
}

/// The consumer actor.
pub struct Consumer {
    config: ConsumerConfig,
    /// The broker link's settings: where to connect, the connect bound (a consume's too), the
    /// broker's consumer timeout (when a held delivery is given back).
    amqp: AmqpConfig,
    /// Which processor and batcher each delivery goes to (chosen at the wiring).
    dispatch: Dispatch,
    link: Link,
    phase: Phase,
    /// Bumped on every (re)connect (handed out by the stage's memory of copies, so a stage a
    /// reload starts in this one's place never repeats one); deliveries carry it back in
    /// `Settle`. 0 before the first link.
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
    /// The largest accepted delivery (body at most `MAX_MESSAGE_BYTES`, and its parsed
    /// properties) since the current subscription began (kept across a reconnect): the next
    /// window is cut to what the budget holds of it. Refused bodies never count here: they cut
    /// the window to one and the next accepted delivery opens it again (`window.rs`).
    largest: usize,
    /// The largest delivery of earlier subscriptions that cut the window: kept until two
    /// windows of smaller ones grow it back, so that a later change of window (the concurrency
    /// changed, a new subscription) never undoes the cut at once.
    kept_largest: usize,
    /// Deliveries since the current subscription began.
    since_subscribe: u64,
    /// The window the consumer has earned (a first window of one, `window.rs`).
    earned: window::Earned,
    /// Where the stage is with bodies over `MAX_MESSAGE_BYTES` (`oversize.rs`): given back
    /// unread (`Delivery::discarded`, the vendored lapin's body limit), waiting for the
    /// process's permit, or holding it (the limit lifted for one delivery, or a body held whole).
    oversize: oversize::Oversize,
    /// Failed parks per body over the limit (by `oversize::identity`): the next turn goes to
    /// the body held aside whose parks failed the fewest times.
    failed_parks: std::collections::HashMap<u64, u32>,
    /// Parks of bodies over the limit failed in a row: the backoff before the stage asks for
    /// the permit again (`oversize_rotate`); 0 once one held.
    park_streak: u32,
    /// When the stage began to stand still for a body's turn (its deliveries settling before the
    /// permit, the body taken whole, its park): a turn whose park failed is followed by
    /// [`oversize::TURN_DUTY`] times its length of going on (`oversize_rotate`).
    turn_since: Option<std::time::Instant>,
    /// `warren_oversize_permit_waiting`, resolved once.
    oversize_gauge: metrics::Gauge,
    /// Answered once the nacks of what was held aside were sent: the next `basic.consume`
    /// waits for it (`oversize.rs`, `Acker::sent`).
    consume_after: Option<oneshot::Receiver<()>>,
    /// The bytes-in-flight gauge, resolved once; the value last published to it.
    inflight_bytes_gauge: (metrics::Gauge, u64),
    /// Held by the breaker and/or an operator: no consumer subscribed while non-empty.
    holds: Vec<HoldReason>,
    /// Deliveries taken so far; metrics and the idle watchdog derive from it.
    received: u64,
    /// Deliveries handed to the processors so far (compared with `DecodedBytes::done` before a
    /// window opens), and the subscribes put off meanwhile (`subscription.rs`).
    handed: (u64, u32),
    /// `received` and `inflight` as last published to the metrics (per settle and per tick,
    /// not per message).
    published: (u64, usize),
    /// `received` at the last watchdog tick, and the ticks since it last moved.
    idle: (u64, u32),
    /// `received` at the last watchdog tick, and the ticks since, while a window of one is full
    /// (`check_held_window`).
    held_window: (u64, u32),
    /// The received counter, resolved once.
    received_counter: metrics::Counter,
    /// The stage's counts for the registry, resolved once: a stage a reload removed, whose
    /// consumer still runs until its link closes, never makes itself live again by counting
    /// (review R42b F7: the old name's stage stayed in the record and `warren status`).
    stats: std::sync::Arc<crate::metrics::StageStats>,
    /// The in-flight gauge, resolved once.
    inflight_gauge: metrics::Gauge,
    /// What the stop did with the deliveries so far (counted once stopping).
    stop_counts: StopCounts,
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
    pub fn new(config: ConsumerConfig, amqp: AmqpConfig, dispatch: Dispatch) -> Self {
        let received_counter = crate::metrics::received_counter(&config.stage);
        let throttle = Throttle::new(config.rate_limit_per_s);
        Self {
            config: config.clone(),
            amqp,
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
            earned: window::Earned::default(),
            oversize: oversize::Oversize::Limited,
            failed_parks: Default::default(),
            park_streak: 0,
            turn_since: None,
            oversize_gauge: crate::metrics::oversize_waiting_gauge(&config.stage),
            consume_after: None,
            inflight_bytes_gauge: (crate::metrics::inflight_bytes_gauge(&config.stage), 0),
            holds: Vec::new(),
            received: 0,
            handed: (0, 0),
            published: (0, 0),
            idle: (0, 0),
            held_window: (0, 0),
            received_counter,
            stats: crate::metrics::stage(&config.stage),
            inflight_gauge: crate::metrics::inflight_gauge(),
            stop_counts: StopCounts::default(),
            cancelled: Vec::new(),
            settled: Vec::new(),
            throttle,
            release_pending: false,
        }
    }
}

impl Actor for Consumer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.connect(ctx, None);
        ctx.run_interval(Duration::from_secs(1), |act, ctx| act.tick(ctx));
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        // A stopped consumer holds nothing: what it had not settled (a drain that reached
        // SHUTDOWN_TIMEOUT_MS) went back to the broker with its channel, and a settle of it
        // reaches no one now. The in-flight gauge and the record drop it (they kept it for the
        // rest of the process's life; review of issue 35, F2).
        self.inflight = 0;
        self.inflight_bytes = 0;
        self.publish_counts();
        tracing::info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            "consumer stopped"
        );
    }
}
