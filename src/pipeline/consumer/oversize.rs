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
//! body, whole) keeps it until it settles, parked or given back ([`Oversize::Holding`]). Meanwhile
//! a window beside it (the held-window watchdog) holds any other body over the limit aside,
//! unacked and unread, and goes on to the messages behind it; what was held aside goes back to
//! the queue when the held body settles, and is taken whole in its turn. No body begun within
//! [`LIFTED_FOR`] (another instance took it): the subscription is cancelled, and the permit
//! released at its stream's end. A link lost, a stop: released.
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
use crate::pipeline::message::Disposition;

/// How long a subscription without a body limit waits for its body to begin arriving before it
/// is cancelled and the permit released: the body given back is at the head of the queue (the
/// broker sends it at once), unless another consumer of the queue took it meanwhile (then the
/// permit would be held for nothing, and every other stage's big body wait: review R38c F3,
/// 60 s on an empty queue). A body on its way (its content header came: the vendored lapin's
/// `Channel::body_remaining`) is waited for however long it takes: warren sees a delivery only
/// once it is whole, and a body of 100 MiB took 10 s to arrive on a loaded machine. A body
/// whose header comes just after the cancel still arrives before the subscription's end, whole,
/// the permit held; the cancel-ok behind it is not taken for unanswered meanwhile
/// (`cancel_unanswered`). 10 s, not less: a broker slow to send the head of a queue (a quorum
/// queue reading a big body back) would otherwise see it given back again, a delivery more on
/// a quorum queue's count each time.
pub(super) const LIFTED_FOR: Duration = Duration::from_secs(10);

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
    Holding {
        /// Held for its drop: the permit goes when the state does.
        _permit: OwnedSemaphorePermit,
        /// The body's delivery (channel generation, delivery tag): its settlement releases the
        /// permit.
        body: (u64, u64),
        /// The bytes it holds (body and parsed properties): the `M` of the memory bound, not
        /// part of the byte budget's `A` (`accepted_bytes`).
        bytes: u64,
        /// Deliveries over the limit that came meanwhile (in a window beside the held body),
        /// of the current channel, held unacked without their bodies (nothing of them is
        /// stored): given back once the body settles, and taken whole one at a time then. At
        /// most [`ASIDE_MAX`].
        aside: Vec<u64>,
        /// Meanwhile another one was given back unread (past [`ASIDE_MAX`], or while
        /// stopping), so the permit is taken again once this one settles.
        given_back: bool,
    },
}

/// The most deliveries over `MAX_MESSAGE_BYTES` a stage holds aside (unacked, bodies not stored)
/// while it holds the permit for another body: each is a tag and nothing else, so the window
/// beside a held body goes on to the messages behind them (review R38c F1: two big bodies in a
/// row while parking failed, the second given back at once, cut the window beside the first to
/// nothing, and no message behind them moved). Past it, they are given back as before.
pub(super) const ASIDE_MAX: usize = 32;

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

    /// Whether a delivery over the limit that just came unread can be held aside: the stage
    /// holds the permit for another body, and there is room.
    fn room_aside(&self) -> bool {
        matches!(self, Oversize::Holding { aside, given_back: false, .. } if aside.len() < ASIDE_MAX)
    }

    pub(super) fn lifted(&self) -> bool {
        matches!(self, Oversize::Lifted(_))
    }

    /// The bytes of the body held whole with the permit (0: none).
    pub(super) fn held_bytes(&self) -> u64 {
        match self {
            Oversize::Holding { bytes, .. } => *bytes,
            _ => 0,
        }
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

    /// A subscription without a body limit began (`generation`, `tag`): cancelled if no body
    /// began to arrive within [`LIFTED_FOR`].
    pub(super) fn lifted_subscribed(&mut self, ctx: &mut Context<Self>, tag: String) {
        if self.oversize.lifted() {
            self.lifted_check(ctx, self.generation, tag, LIFTED_FOR);
        }
    }

    /// After `after`: a subscription without a body limit (`generation`, `tag`) that is still
    /// waiting for its first delivery is cancelled, unless a body is on its way (checked again
    /// a second later then).
    fn lifted_check(
        &mut self,
        ctx: &mut Context<Self>,
        generation: u64,
        tag: String,
        after: Duration,
    ) {
        ctx.run_later(after, move |act, ctx| {
            let current = generation == act.generation
                && matches!(&act.link, Link::Up(l)
                    if matches!(&l.subscription, Subscription::Active(t) if *t == tag));
            if !act.oversize.lifted() || !current || act.phase != Phase::Running {
                return;
            }
            if act.body_on_its_way() {
                act.lifted_check(ctx, generation, tag, Duration::from_secs(1));
                return;
            }
            info!(
                pipeline = act.config.stage.pipeline(),
                stage = act.config.stage.stage().as_str(),
                waited_s = LIFTED_FOR.as_secs(),
                "no body arriving without a body limit: the body given back went elsewhere; \
                 cancelling, and the permit goes at the subscription's end"
            );
            act.unsubscribe();
        });
    }

    /// A delivery over `MAX_MESSAGE_BYTES` came unread (`tag`, of the current channel): held
    /// aside (unacked, nothing of it stored) when the stage holds the permit for another body
    /// and there is room ([`ASIDE_MAX`]); answers whether it was. Else it is given back.
    pub(super) fn set_aside(&mut self, tag: u64) -> bool {
        if self.phase != Phase::Running || !self.oversize.room_aside() {
            return false;
        }
        if let Oversize::Holding { aside, .. } = &mut self.oversize {
            aside.push(tag);
        }
        true
    }

    /// Deliveries over the limit were held aside (`set_aside`): they fill the broker's window
    /// of the subscription that brought them, so it is cancelled, and the next one begins at
    /// once (what is held aside counts in no window of warren's: it holds no bytes).
    pub(super) fn held_aside(&mut self, n: usize) {
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            set_aside = n,
            max_message_bytes = self.config.max_message_bytes,
            "bodies over MAX_MESSAGE_BYTES announced while this stage holds one whole: held aside \
             unread (nothing of them stored) and given back once it settles; the messages \
             behind them go on"
        );
        if self.consuming() {
            self.unsubscribe();
        }
    }

    /// The deliveries of a chunk came, `refused` the tag and bytes of the first of them over
    /// `MAX_MESSAGE_BYTES` (of the current channel): the first delivery of a subscription
    /// without a limit restores it at once; the permit goes with an accepted body, stays with a
    /// refused one until it settles.
    pub(super) fn oversize_delivered(&mut self, refused: Option<(u64, u64)>) {
        if !self.oversize.lifted() {
            return;
        }
        self.restore_body_limit();
        let Oversize::Lifted(permit) = std::mem::take(&mut self.oversize) else {
            return;
        };
        if let Some((tag, bytes)) = refused {
            self.oversize = Oversize::Holding {
                _permit: permit,
                body: (self.generation, tag),
                bytes,
                aside: Vec::new(),
                given_back: false,
            };
        }
    }

    /// Deliveries of channel `generation` settled: the body held whole with the permit among
    /// them releases it (what was held aside meanwhile is given back, and the permit taken
    /// again for it).
    pub(super) fn oversize_settle(&mut self, generation: u64, items: &[(u64, Disposition)]) {
        if matches!(self.oversize, Oversize::Holding { body, .. }
            if body.0 == generation && items.iter().any(|(tag, _)| *tag == body.1))
        {
            self.release_held();
        }
    }

    /// Something settled, or went with a closed channel: with nothing left in flight, a body
    /// held whole with the permit has settled too (it may have gone with a channel, unsettled),
    /// and releases it.
    pub(super) fn oversize_settled(&mut self) {
        if self.inflight == 0 {
            self.release_held();
        }
    }

    /// The body held whole with the permit settled: the permit goes; what was held aside goes
    /// back to the queue now, and the stage takes the permit again for it (nothing subscribes
    /// until what is in flight settled: `Oversize::pending`).
    fn release_held(&mut self) {
        let Oversize::Holding {
            aside, given_back, ..
        } = std::mem::take(&mut self.oversize)
        else {
            return;
        };
        let again = given_back || !aside.is_empty();
        self.give_back_aside(aside);
        if again && self.phase == Phase::Running {
            self.oversize = Oversize::GivenBack;
            if self.consuming() {
                self.unsubscribe();
                self.dispatch.flush_all();
            }
        }
    }

    /// Gives back (nack, requeue) deliveries held aside, on the channel they came on.
    fn give_back_aside(&mut self, aside: Vec<u64>) {
        if aside.is_empty() {
            return;
        }
        crate::metrics::requeued(&self.config.stage, "oversize_in_window", aside.len() as u64);
        if self.phase != Phase::Running {
            self.stop_counts.given_back += aside.len() as u64;
        }
        let items: Vec<_> = aside
            .into_iter()
            .map(|t| (t, Disposition::Requeue))
            .collect();
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.settle(&items);
        }
    }

    /// The stage begins to stop: what it held aside goes back to the queue now (it is in no
    /// count the drain waits for).
    pub(super) fn oversize_stopping(&mut self) {
        if let Oversize::Holding { aside, .. } = &mut self.oversize {
            let aside = std::mem::take(aside);
            self.give_back_aside(aside);
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
        match &mut self.oversize {
            Oversize::Lifted(_) => self.oversize = Oversize::GivenBack,
            // What was held aside went back to the queue with the channel: taken whole later.
            Oversize::Holding {
                aside, given_back, ..
            } if !aside.is_empty() => {
                if self.phase != Phase::Running {
                    self.stop_counts.given_back += aside.len() as u64;
                }
                aside.clear();
                *given_back = true;
            }
            _ => {}
        }
    }

    /// The stage stops: whatever it held goes.
    pub(super) fn oversize_closed(&mut self) {
        if matches!(self.oversize, Oversize::Waiting) {
            self.oversize_gauge.set(0.0);
        }
        // Held aside still (a stop that never cancelled): back with the channel.
        self.oversize_stopping();
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
                body: (1, 1),
                bytes: 1,
                aside: vec![2],
                given_back: false
            }
            .pending()
        );
    }

    /// Bodies are held aside only beside a body held whole, at most `ASIDE_MAX`, and not once
    /// one was given back (the stage takes the permit again then, for all of them).
    #[test]
    fn bodies_are_held_aside_only_beside_a_held_body_and_within_the_bound() {
        let semaphore = Arc::new(Semaphore::new(4));
        let permit = || semaphore.clone().try_acquire_owned().expect("free");
        let holding = |aside: usize, given_back| Oversize::Holding {
            _permit: permit(),
            body: (1, 1),
            bytes: 1,
            aside: (0..aside as u64).collect(),
            given_back,
        };
        assert!(holding(0, false).room_aside());
        assert!(holding(ASIDE_MAX - 1, false).room_aside());
        assert!(!holding(ASIDE_MAX, false).room_aside());
        assert!(!holding(0, true).room_aside());
        assert!(!Oversize::Limited.room_aside());
        assert!(!Oversize::GivenBack.room_aside());
        assert!(!Oversize::Lifted(permit()).room_aside());
    }
}
