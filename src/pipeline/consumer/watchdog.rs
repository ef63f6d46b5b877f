//! The consumer's watchdog, once a second: a closed channel or connection, a cancel never
//! answered, and a consumer that receives nothing while its queue holds messages (the idle
//! watchdog, from the depths the poller saw) each rebuild the link; a window of one held by its
//! one delivery gets a subscription beside it.

use actix::prelude::*;
use tracing::{info, warn};

use super::Consumer;
use super::link::{Link, Phase, Subscription};
use super::window::FIRST_WINDOW;

/// Watchdog ticks a window of one may stay full, nothing received, before a subscription
/// takes a window beside its delivery (`check_held_window`).
const HELD_TICKS: u32 = 3;

/// The idle watchdog found messages waiting while nothing arrives: rebuild the consumer.
#[derive(Message)]
#[rtype(result = "()")]
struct Stuck {
    generation: u64,
    ready: u32,
}

impl Consumer {
    /// A subscription warren cancelled whose stream has not ended after the connect timeout,
    /// counted from the cancel or from its last delivery, and with no body on its way: a
    /// cancel-ok comes behind what the broker sent before it, and a body of 100 MiB takes
    /// seconds to arrive (rebuilt under it, the link lost the delivery's ack: tests/memory.rs).
    pub(super) fn cancel_unanswered(&self) -> bool {
        !self.body_on_its_way()
            && matches!(&self.link, Link::Up(l) if matches!(&l.subscription,
                Subscription::Cancelling(_, since) if since.elapsed() > self.amqp.connect_timeout()))
    }

    /// A body's content header came and its frames are still arriving (the vendored lapin's
    /// `Channel::body_remaining`): the link is busy, not silent.
    pub(super) fn body_on_its_way(&self) -> bool {
        matches!(&self.link, Link::Up(l) if l.channel.body_remaining() > 0)
    }

    /// As many deliveries in flight as the subscription's window (or no link): the broker has
    /// a reason to send nothing. Settled deliveries whose acks wait behind a held front are
    /// released within a watchdog tick (`acks.rs`), long before the idle watchdog decides.
    pub(super) fn window_full(&self) -> bool {
        match &self.link {
            Link::Up(linked) => self.inflight >= usize::from(linked.window),
            _ => true,
        }
    }

    /// The idle watchdog, once per tick: nothing delivered for 15 ticks with room in the
    /// window, yet the queue holds messages -> the consumer is silently dead; rebuild it. (Room, not
    /// nothing in flight: a delivery held for minutes must not hide a dead subscription.)
    pub(super) fn check_idle(&mut self, ctx: &mut Context<Self>) {
        const IDLE_TICKS: u32 = 15;
        if self.received != self.idle.0 {
            self.idle = (self.received, 0);
            return;
        }
        // Counted from when the window last had room: a full window (one body of 48 MiB
        // parked for 17 s under a window of one on a loaded machine) is the broker's reason to
        // send nothing, and the next body takes a while to arrive whole. Counted across it, the
        // first tick after the park rebuilt the link while that next body was on its way, and it
        // came again, whole, beside the first (found by tests/memory.rs, the open window case).
        // Likewise a subscription without a body limit, waiting for the body given back: a body
        // of 100 MiB took over 15 s to arrive on a loaded machine, and rebuilt under it, the link
        // let the permit go while the AMQP client still held what had come of it (peak 200 MiB
        // with two pipelines' bodies, tests/memory.rs). `LIFTED_FOR` and a body on its way bound that
        // wait instead (`oversize.rs`).
        if self.window_full() || self.oversize.lifted() || self.body_on_its_way() {
            self.idle.1 = 0;
            return;
        }
        self.idle.1 += 1;
        if self.idle.1 < IDLE_TICKS
            || self.phase != Phase::Running
            || !self.holds.is_empty()
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

    /// The watchdog, once a second: publishes the counts, releases acks held behind a settled
    /// front, notices a closed channel or connection and a cancel never answered (the consumer
    /// is rebuilt, or a stop goes on without it), and runs the idle check.
    pub(super) fn tick(&mut self, ctx: &mut Context<Self>) {
        self.publish_counts();
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.tick();
        }
        self.aside_aged();
        if self.phase == Phase::Stopping && self.cancel_unanswered() {
            // Stopping behind a cancel whose stream never ended: the stop goes on; what that
            // subscription still held unacked goes back to the queue with the channel.
            warn!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "a cancelled subscription's stream did not end; stopping without it"
            );
            if let Some(linked) = self.linked() {
                linked.subscription = Subscription::None;
            }
            self.stream_done(ctx);
        }
        if self.phase != Phase::Running || self.connecting() {
            return;
        }
        if self.open_channel().is_none() {
            warn!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "consumer channel is closed; rebuilding it"
            );
            let reason = self.link_end_reason();
            self.rebuild(ctx, reason);
        } else if self.cancel_unanswered() {
            // Its stream never ended: the link is rebuilt (its unacked deliveries go back to
            // the queue with the channel) rather than the pipeline waiting for ever.
            warn!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "a cancelled subscription's stream did not end; rebuilding the link"
            );
            self.rebuild(ctx, "cancel_unanswered");
        } else {
            self.check_held_window();
            self.check_idle(ctx);
        }
    }

    /// A window of one whose delivery stays unsettled (a refused body waiting out its requeue
    /// backoff while parking fails, or a long park) gives the broker its reason to send
    /// nothing: every message behind it waited as long (review R38 F3: 0 of 100 users stored
    /// while INSERT on dead_letters was revoked). After [`HELD_TICKS`] ticks of it, the
    /// subscription is cancelled, and the next one takes its window beside the held delivery
    /// once the cancel is answered (`room_for`: at most two windows in flight, and under the
    /// byte budget, which the held body counts in). The new one stores no body over
    /// `MAX_MESSAGE_BYTES` while anything is in flight (`body_limit`): never two refused bodies.
    fn check_held_window(&mut self) {
        let window = match &self.link {
            Link::Up(l) if matches!(l.subscription, Subscription::Active(_)) => l.window,
            _ => 0,
        };
        let full = window == FIRST_WINDOW && self.window_full() && self.holds.is_empty();
        if !full || self.received != self.held_window.0 {
            self.held_window = (self.received, 0);
            return;
        }
        self.held_window.1 += 1;
        if self.held_window.1 < HELD_TICKS || !self.room_for(window) {
            return;
        }
        self.held_window.1 = 0;
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            inflight = self.inflight,
            "the window's one delivery stays unsettled; a new subscription takes a window beside it"
        );
        self.unsubscribe();
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
