//! The consumer's watchdog, once a second: a closed channel or connection, a cancel never
//! answered, and a consumer that receives nothing while its queue holds messages (the idle
//! watchdog, from the depths the poller saw) each rebuild the link.

use actix::prelude::*;
use tracing::warn;

use super::Consumer;
use super::link::{Link, Phase, Subscription};

/// The idle watchdog found messages waiting while nothing arrives: rebuild the consumer.
#[derive(Message)]
#[rtype(result = "()")]
struct Stuck {
    generation: u64,
    ready: u32,
}

impl Consumer {
    /// A subscription warren cancelled whose stream has not ended after the connect timeout.
    pub(super) fn cancel_unanswered(&self) -> bool {
        matches!(&self.link, Link::Up(l) if matches!(&l.subscription,
            Subscription::Cancelling(_, since) if since.elapsed() > self.amqp.connect_timeout()))
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
        // with two pipelines' bodies, tests/memory.rs). `LIFTED_FOR` bounds that wait instead.
        if self.window_full() || self.oversize.lifted() {
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
            self.check_idle(ctx);
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
