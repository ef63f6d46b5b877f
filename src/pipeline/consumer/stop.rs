//! The consumer's part of the one shutdown sequence: `Cancel` (stop taking deliveries; answered
//! once nothing more will arrive), `Settled` (answered once every delivery is settled and its
//! ack or nack sent) and `Close` (the channel and the connection).

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::info;

use super::link::{Link, Phase, Subscription};
use super::{Cancel, Close, Consumer, Settled};
use crate::amqp::{self};

impl Consumer {
    /// Nothing more will arrive: answers `Cancel`, then checks whether all is settled.
    pub(super) fn stream_done(&mut self, ctx: &mut Context<Self>) {
        self.phase = Phase::StreamEnded;
        for w in self.cancelled.drain(..) {
            let _ = w.send(());
        }
        self.maybe_finish(ctx);
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
        // The last counts now, not at the next tick: a stage a reload removed has left the live
        // stages by then (`metrics::forget`), and the process's record counts them at its stop.
        self.publish_counts();
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
