//! The consumer's part of the one shutdown sequence: `Cancel` (stop taking deliveries; answered
//! once nothing more will arrive), `Settled` (answered once every delivery is settled and its
//! ack or nack sent) and `Close` (the channel and the connection), which answers what the stop
//! did with the deliveries ([`StopCounts`]): settled, or given back to the broker unprocessed.

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::link::{Link, Linked, Phase, Subscription};
use super::{Cancel, Close, Consumer, Settled};
use crate::amqp::{self};
use crate::pipeline::message::Disposition;

/// What one consumer's stop did with its deliveries: those settled while it stopped, and those
/// given back to the broker unprocessed (nacked with requeue, left unacked when the channel
/// closed, or settled on a channel that was already gone): they wait in the queue for the next
/// consumer. The last log line and the `stopped` event add them up over every stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopCounts {
    /// Acked after the stop began: stored, dead-lettered or parked.
    pub settled: u64,
    /// Back in the queue unprocessed.
    pub given_back: u64,
}

impl std::ops::AddAssign for StopCounts {
    fn add_assign(&mut self, other: Self) {
        self.settled += other.settled;
        self.given_back += other.given_back;
    }
}

impl StopCounts {
    /// Counts one settlement during the stop: an ack on the live channel settled it; a requeue,
    /// or any settlement of a channel already closed (`live` false), gave it back.
    pub(super) fn count(&mut self, items: &[(u64, Disposition)], live: bool) {
        for (_, disposition) in items {
            match disposition {
                Disposition::Ack if live => self.settled += 1,
                _ => self.given_back += 1,
            }
        }
    }
}

/// How long a stopping consumer waits for its channel and connection to close: less than the
/// stop's wait for its answer (5 s, `Pipeline::shutdown`), which would take its counts as none.
const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);

impl Consumer {
    /// Nothing more will arrive: answers `Cancel`, then checks whether all is settled.
    pub(super) fn stream_done(&mut self, ctx: &mut Context<Self>) {
        self.phase = Phase::StreamEnded;
        for w in self.cancelled.drain(..) {
            let _ = w.send(());
        }
        self.maybe_finish(ctx);
    }

    /// A stop that does not wait for the cancelled subscription's stream (a body still
    /// arriving, or none asked for yet without a body limit): it is taken as ended now, and what
    /// still arrives on it is left to the broker.
    fn leave_stream(&mut self, ctx: &mut Context<Self>) {
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            body_on_its_way = self.body_on_its_way(),
            "stopping without waiting for the cancelled subscription's stream; what still \
             arrives on it goes back to the broker with the channel"
        );
        self.stream_done(ctx);
    }

    /// Once stopping, the stream ended and nothing is in flight: sends the last acks and
    /// answers `Settled`.
    pub(super) fn maybe_finish(&mut self, ctx: &mut Context<Self>) {
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

impl Handler<Cancel> for Consumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Cancel, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.cancelled.push(tx);
        if self.phase == Phase::Running {
            self.phase = Phase::Stopping;
            // What is held aside unread goes back to the queue now.
            self.oversize_stopping();
            // Whatever the limiter holds goes onwards now, ahead of the drain marker.
            self.release(ctx);
            // A body still arriving (a body of 100 MiB takes seconds, more on a slow link),
            // whether taken whole without a body limit or read and dropped over it, and a
            // subscription without a body limit that has delivered nothing yet, are not waited
            // for: the subscription is cancelled and its stream taken as ended now. What still
            // arrives on it is left to the broker, which has it back when the channel closes
            // (counted given back then: `Close`). Reviews R38i F3 and R38j F2: a stop waited for
            // such a body, then for its park, to SHUTDOWN_TIMEOUT_MS and an exit 1.
            let leave = (self.oversize.lifted() && self.inflight == 0) || self.body_on_its_way();
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
                            if leave {
                                self.leave_stream(ctx);
                            }
                        }
                        Subscription::Cancelling(..) if leave => self.leave_stream(ctx),
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
    type Result = ResponseActFuture<Self, StopCounts>;

    fn handle(&mut self, _: Close, _: &mut Self::Context) -> Self::Result {
        if self.phase == Phase::Running {
            self.phase = Phase::Stopping;
        }
        // The last counts now, not at the next tick: a stage a reload removed has left the live
        // stages by then (`metrics::forget`), and the process's record counts them at its stop.
        self.publish_counts();
        // Whatever is still unsettled (the drain timed out; what the limiter holds is counted
        // in flight too) goes back to the queue with the channel.
        self.stop_counts.given_back += self.inflight as u64;
        self.inflight = 0;
        // A body still arriving when the stream was taken as ended (`Cancel`): the broker has
        // it back with the channel.
        if self.body_on_its_way() {
            self.stop_counts.given_back += 1;
        }
        // The process's permit for a body over MAX_MESSAGE_BYTES, if this stage held it.
        self.oversize_closed();
        let counts = self.stop_counts;
        let link = std::mem::replace(&mut self.link, Link::Down);
        let stage = self.config.stage.clone();
        let (copies, generation) = (self.config.copies.clone(), self.generation);
        Box::pin(
            async move {
                if let Link::Up(linked) = link {
                    // Taken and closed by the drain (`maybe_finish`): every ack was sent before
                    // the close. Still here, its task may still be sending them.
                    let Linked {
                        acker,
                        channel,
                        connection,
                        ..
                    } = *linked;
                    let acks_sent = acker.is_none();
                    drop(acker);
                    // Bounded: a link that does not answer (a body still arriving on a stalled
                    // link: review R38j F2) must not keep the counts from the stop, whose wait
                    // for this answer is 5 s (`Pipeline::shutdown`). The broker has back what
                    // was not acked once the process ends.
                    let close = async {
                        let answered = channel.close(200, "bye".into()).await.is_ok();
                        amqp::close(None, Some(connection)).await;
                        answered
                    };
                    // Unanswered, the close proves nothing of the acks sent before it: those of
                    // the last commits may never have reached the broker, which delivers those
                    // messages again once it drops the link. The next consumer finds them in its
                    // table (a copy); a stage this process's reloads start on the queue under
                    // another spec (table, name or mapping) asks this one's table and parking
                    // first (`predecessors::settled_before`; review R40a F4, F6: stored in both tables,
                    // parked under both names, or stored and parked id_conflict).
                    let answered = tokio::time::timeout(CLOSE_WITHIN, close).await;
                    if answered == Ok(true) && acks_sent {
                        // The channel's close-ok: every ack sent before the close was handled,
                        // none of those messages comes again, and the stage a reload starts
                        // asks nothing about them (`acked.rs`). A channel already gone proves
                        // nothing: its acks stay lost.
                        copies.acked().handled(generation);
                    } else if answered.is_err() {
                        warn!(
                            pipeline = stage.pipeline(),
                            stage = stage.stage().as_str(),
                            within_ms = CLOSE_WITHIN.as_millis() as u64,
                            "the broker link did not answer its close; left to end with the \
                             process. Its last acks may not have reached the broker, which then \
                             delivers those messages again: a stage this process starts on the \
                             queue takes those it finds stored or parked already as done (another \
                             instance, or this one after a restart, stores them again)"
                        );
                    }
                }
                info!(
                    pipeline = stage.pipeline(),
                    stage = stage.stage().as_str(),
                    settled = counts.settled,
                    given_back = counts.given_back,
                    "consumer closed"
                );
                counts
            }
            .into_actor(self)
            // The actor ends once its link is closed (until then it still sees what the broker sent
            // behind the cancel, and leaves it to the broker): its tick with it, and the stage's
            // processors, batchers and sinks, which only its addresses kept alive, so a stage a
            // reload stopped leaves nothing running behind.
            .map(|counts, _, ctx| {
                ctx.stop();
                counts
            }),
        )
    }
}
