//! Bodies over `MAX_MESSAGE_BYTES`: the process's one permit to hold such a body
//! ([`OversizePermit`]) and a stage's way to it ([`Oversize`]). The vendored lapin stores a body
//! only under the channel's body limit (`Channel::set_body_limit`); a stage lifts the limit only
//! while it holds the permit, so the whole process holds at most one body over
//! `MAX_MESSAGE_BYTES` at a time, whatever the number of stages and pipelines (the `M` of
//! docs/failures.md, "Memory", counted once).
//!
//! The way, for a stage: a body over the limit arrives in any window (the first window of one
//! too) as `Delivery::discarded` and is given back unread (`give_back_oversize`); the stage
//! subscribes again only once everything it holds has settled and the permit is its own
//! (taken at once when free, else waited for in FIFO order: while it waits nothing subscribes,
//! the log says so and `warren_oversize_permit_waiting` is 1); then it subscribes with a window
//! of one and no body limit ([`Oversize::Lifted`]). The first delivery of that subscription
//! restores the limit at once: an accepted body releases the permit there, a refused one (the
//! body, whole) keeps it until it settles, parked or given back ([`Oversize::Holding`]). Nothing
//! within [`LIFTED_FOR`] (another instance took the body): the subscription is cancelled, and
//! the permit released at its stream's end. A link lost, a stop: released.
//!
//! The permit is never held by a stage that waits for something else than its own delivery: it
//! is taken only with nothing in flight, nothing subscribed, no hold, and given up at once if
//! any of these changed while it was waited for. So no stage, of one pipeline or several, waits
//! on another that waits on it.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info};

use super::Consumer;
use super::link::{Link, Phase, Subscription};
use super::window::FIRST_WINDOW;

/// How long a subscription without a body limit waits for its first delivery before it is
/// cancelled and the permit released: the body given back is at the head of the queue (the
/// broker sends it at once), unless another consumer of the queue took it meanwhile. Long
/// next to a body's transfer: warren sees a delivery only once its body is whole, and a body of
/// 100 MiB took 10 s to arrive on a loaded machine; 5 s cancelled such bodies on their way, and
/// a cancel-ok that came late behind one made the watchdog rebuild the link, the body's ack
/// lost with it (found by `tests/memory.rs`, two pipelines). A body on its way when the cancel
/// goes still arrives before the subscription's end, whole, the permit held.
pub(super) const LIFTED_FOR: Duration = Duration::from_secs(60);

/// The process's one permit to hold a body over `MAX_MESSAGE_BYTES`: made once by the
/// composition root (`app/pipelines.rs`), handed to every stage with its links
/// (`pipeline::Links`); clones share it.
#[derive(Debug, Clone)]
pub struct OversizePermit(Arc<Semaphore>);

impl Default for OversizePermit {
    fn default() -> Self {
        Self(Arc::new(Semaphore::new(1)))
    }
}

impl OversizePermit {
    /// A new permit: one per process.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a stage holds it now.
    pub fn held(&self) -> bool {
        self.0.available_permits() == 0
    }
}

/// Where a stage is with bodies over `MAX_MESSAGE_BYTES`.
#[derive(Debug, Default)]
pub(super) enum Oversize {
    /// The body limit is `MAX_MESSAGE_BYTES`: a larger body comes unread and is given back.
    #[default]
    Limited,
    /// A body was given back unread: nothing subscribes until everything in flight has
    /// settled; then the permit is taken.
    GivenBack,
    /// The permit is being waited for (another stage holds it): nothing subscribes.
    Waiting,
    /// The permit is held: the next subscription has a window of one and no body limit, and its
    /// first delivery restores the limit.
    Lifted(OwnedSemaphorePermit),
    /// The permit is held for a body over the limit that came whole, until it settles.
    /// `given_back`: meanwhile another one was given back unread, so the permit is taken again
    /// once this one settles.
    Holding {
        /// Held for its drop: the permit goes when the state does.
        _permit: OwnedSemaphorePermit,
        given_back: bool,
    },
}

impl Oversize {
    /// Whether a body was given back and the stage is on its way to take it whole: nothing
    /// subscribes beside anything still in flight.
    pub(super) fn pending(&self) -> bool {
        matches!(
            self,
            Oversize::GivenBack
                | Oversize::Waiting
                | Oversize::Lifted(_)
                | Oversize::Holding {
                    given_back: true,
                    ..
                }
        )
    }

    pub(super) fn lifted(&self) -> bool {
        matches!(self, Oversize::Lifted(_))
    }
}

impl Consumer {
    /// The body limit of the next subscription: none (`u64::MAX`) while the stage holds the
    /// permit for it, else `MAX_MESSAGE_BYTES`.
    pub(super) fn body_limit(&self) -> u64 {
        if self.oversize.lifted() {
            u64::MAX
        } else {
            self.config.max_message_bytes as u64
        }
    }

    /// The window of the next subscription: one under a lifted limit, else the one wanted.
    pub(super) fn next_window(&self) -> u16 {
        if self.oversize.lifted() {
            FIRST_WINDOW
        } else {
            self.wanted_window()
        }
    }

    /// Deliveries whose bodies were over `MAX_MESSAGE_BYTES` came unread and were given back
    /// (nack with requeue, already sent): the window is cut to one, the subscription cancelled
    /// at once (with the limit still in place, the broker would send the same body back at once,
    /// again and again), and the next one waits until everything delivered before is settled
    /// and the permit is the stage's, then takes a window of one without a body limit: the body
    /// comes back whole and alone, and is parked.
    pub(super) fn give_back_oversize(&mut self, n: usize) {
        crate::metrics::requeued(&self.config.stage, "oversize_in_window", n as u64);
        if self.phase != Phase::Running {
            self.stop_counts.given_back += n as u64;
            return;
        }
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            given_back = n,
            max_message_bytes = self.config.max_message_bytes,
            "bodies over MAX_MESSAGE_BYTES announced: given back to the queue unread; the window \
             is cut to 1, and once what is in flight settles and the process's one permit to \
             hold such a body is this stage's, they come back one at a time, whole, to be parked"
        );
        self.earned = super::window::Earned::default();
        if let Oversize::Holding { given_back, .. } = &mut self.oversize {
            *given_back = true;
        } else if matches!(self.oversize, Oversize::Limited) {
            self.oversize = Oversize::GivenBack;
        }
        if self.consuming() {
            self.unsubscribe();
            self.dispatch.flush_all();
        }
    }

    /// Whether a subscription may begin as far as bodies over the limit go; called by
    /// `maybe_subscribe` with the link up, nothing subscribed, nothing held. A body given back
    /// with nothing left in flight takes the permit now when it is free, else waits for it in
    /// the background (FIFO); nothing subscribes meanwhile.
    pub(super) fn oversize_ready(&mut self, ctx: &mut Context<Self>) -> bool {
        match self.oversize {
            Oversize::GivenBack if self.inflight == 0 => {}
            Oversize::GivenBack | Oversize::Waiting => return false,
            Oversize::Limited | Oversize::Lifted(_) | Oversize::Holding { .. } => return true,
        }
        if let Ok(permit) = self.config.oversize.0.clone().try_acquire_owned() {
            self.oversize = Oversize::Lifted(permit);
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "the permit to hold a body over MAX_MESSAGE_BYTES is this stage's: subscribing \
                 with a window of 1 and no body limit"
            );
            return true;
        }
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            "waiting for the process's one permit to hold a body over MAX_MESSAGE_BYTES (another \
             stage holds one): no new deliveries meanwhile"
        );
        self.oversize = Oversize::Waiting;
        self.oversize_gauge.set(1.0);
        let semaphore = self.config.oversize.0.clone();
        ctx.spawn(
            async move { semaphore.acquire_owned().await.ok() }
                .into_actor(self)
                .map(|permit, act, ctx| {
                    if let Some(permit) = permit {
                        act.granted(permit, ctx);
                    }
                }),
        );
        false
    }

    /// The permit came after a wait: the stage subscribes without a body limit, unless what it
    /// was waiting for changed meanwhile (a hold, a stop, a link lost): then the permit goes at
    /// once (never held while the stage waits for something else), and is taken again when the
    /// stage may subscribe.
    fn granted(&mut self, permit: OwnedSemaphorePermit, ctx: &mut Context<Self>) {
        self.oversize_gauge.set(0.0);
        if !matches!(self.oversize, Oversize::Waiting) {
            return;
        }
        let free = matches!(&self.link, Link::Up(l) if l.subscription == Subscription::None
            && l.channel.status().connected());
        if self.phase != Phase::Running || !self.holds.is_empty() || self.inflight > 0 || !free {
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "the permit came while the stage cannot subscribe: given up until it can"
            );
            self.oversize = Oversize::GivenBack;
            return;
        }
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            "the permit to hold a body over MAX_MESSAGE_BYTES is this stage's: subscribing with a \
             window of 1 and no body limit"
        );
        self.oversize = Oversize::Lifted(permit);
        self.maybe_subscribe(ctx);
        if matches!(&self.link, Link::Up(l) if l.subscription == Subscription::None) {
            self.oversize = Oversize::GivenBack;
        }
    }

    /// A subscription without a body limit began (`generation`, `tag`): cancelled if nothing
    /// came within [`LIFTED_FOR`].
    pub(super) fn lifted_subscribed(&mut self, ctx: &mut Context<Self>, tag: String) {
        if !self.oversize.lifted() {
            return;
        }
        let generation = self.generation;
        ctx.run_later(LIFTED_FOR, move |act, _| {
            let current = generation == act.generation
                && matches!(&act.link, Link::Up(l)
                    if matches!(&l.subscription, Subscription::Active(t) if *t == tag));
            if act.oversize.lifted() && current && act.phase == Phase::Running {
                info!(
                    pipeline = act.config.stage.pipeline(),
                    stage = act.config.stage.stage().as_str(),
                    waited_s = LIFTED_FOR.as_secs(),
                    "no delivery without a body limit: the body given back went elsewhere; \
                     cancelling, and the permit goes at the subscription's end"
                );
                act.unsubscribe();
            }
        });
    }

    /// The deliveries of a chunk came, `refused` of them over `MAX_MESSAGE_BYTES`: the first
    /// delivery of a subscription without a limit restores it at once; the permit goes with an
    /// accepted body, stays with a refused one until it settles.
    pub(super) fn oversize_delivered(&mut self, refused: usize) {
        if !self.oversize.lifted() {
            return;
        }
        self.restore_body_limit();
        let Oversize::Lifted(permit) = std::mem::take(&mut self.oversize) else {
            return;
        };
        if refused > 0 {
            self.oversize = Oversize::Holding {
                _permit: permit,
                given_back: false,
            };
        }
    }

    /// Something settled: a body held whole with the permit that settled (nothing left in
    /// flight) releases it; taken again if another was given back meanwhile.
    pub(super) fn oversize_settled(&mut self) {
        if self.inflight > 0 {
            return;
        }
        if let Oversize::Holding { given_back, .. } = self.oversize {
            self.oversize = if given_back {
                Oversize::GivenBack
            } else {
                Oversize::Limited
            };
        }
    }

    /// A subscription warren cancelled ended: without a delivery under a lifted limit, the
    /// permit goes (the body went elsewhere, or a hold or a stop came).
    pub(super) fn oversize_unsubscribed(&mut self) {
        if self.oversize.lifted() {
            self.restore_body_limit();
            self.oversize = Oversize::Limited;
        }
    }

    /// The link is gone: a permit held for a subscription without a limit goes (the next link
    /// takes it again before it subscribes); one held for a body still in flight stays until
    /// that body settles.
    pub(super) fn oversize_link_lost(&mut self) {
        if self.oversize.lifted() {
            self.oversize = Oversize::GivenBack;
        }
    }

    /// The stage stops: whatever it held goes.
    pub(super) fn oversize_closed(&mut self) {
        if matches!(self.oversize, Oversize::Waiting) {
            self.oversize_gauge.set(0.0);
        }
        self.oversize = Oversize::Limited;
    }

    /// Puts `MAX_MESSAGE_BYTES` back on the channel at once, ahead of the next content header.
    fn restore_body_limit(&self) {
        if let Link::Up(linked) = &self.link {
            linked
                .channel
                .set_body_limit(self.config.max_message_bytes as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One permit per process: a second stage waits until the first gives it back, in order.
    #[tokio::test]
    async fn the_permit_is_one_and_shared_by_its_clones() {
        let permit = OversizePermit::new();
        let other = permit.clone();
        assert!(!permit.held());
        let first = other.0.clone().try_acquire_owned().expect("free");
        assert!(permit.held());
        assert!(permit.0.clone().try_acquire_owned().is_err());
        drop(first);
        assert!(!permit.held());
        assert!(permit.0.clone().try_acquire_owned().is_ok());
    }

    #[test]
    fn a_stage_on_its_way_to_a_body_subscribes_beside_nothing() {
        assert!(!Oversize::Limited.pending());
        assert!(Oversize::GivenBack.pending());
        assert!(Oversize::Waiting.pending());
        let semaphore = Arc::new(Semaphore::new(2));
        let permit = || semaphore.clone().try_acquire_owned().expect("free");
        assert!(Oversize::Lifted(permit()).pending());
        assert!(
            !Oversize::Holding {
                _permit: permit(),
                given_back: false
            }
            .pending()
        );
    }
}
