//! Bodies over `MAX_MESSAGE_BYTES`: the process's one permit to hold such a body
//! ([`OversizePermit`]) and a stage's way to it ([`Oversize`]). The vendored lapin stores a body
//! only under the channel's body limit (`Channel::set_body_limit`); a stage lifts the limit only
//! while it holds the permit, so the whole process holds at most one body over
//! `MAX_MESSAGE_BYTES` at a time, whatever the number of stages and pipelines (the `M` of
//! docs/failures.md, "Memory", counted once).
//!
//! The way, for a stage: a body over the limit arrives in any window (the first window of one
//! too) as `Delivery::discarded` and is given back unread (`give_back_oversize`); the stage
//! subscribes again only once everything it holds has settled, then takes the permit: at once
//! when free, and subscribes with a window of one and no body limit ([`Oversize::Lifted`]).
//! When another stage holds it, the stage asks for it (FIFO) and goes on meanwhile with its
//! limit in place ([`Oversize::Waiting`]): each body over the limit that comes (the one given
//! back first) is held aside, unacked and unread, and the messages behind it go on; once the
//! permit comes and what the stage holds has settled, the oldest body held aside goes back to
//! the queue, and a window of one without a body limit takes it (the others wait aside for
//! their own turns; when nothing is held aside to choose from and a body's park failed before,
//! the stage first takes the messages as they come for [`COLLECT_FOR`], holding such bodies
//! aside, so the turn never goes to the queue's head by default). The first delivery of that
//! subscription restores the limit at once: an accepted body releases the permit there, a
//! refused one (the body, whole) keeps it until it settles, parked or given back
//! ([`Oversize::Holding`]). Meanwhile a window beside it (the held-window watchdog) holds any
//! other body over the limit aside the same way; when the held body settles, the next body held
//! aside takes the permit in its turn. A held body whose park failed is held aside too, and the
//! permit goes at once: the stage asks for it again after the failed park's backoff, so a body
//! parking refuses never keeps the permit from the other stages (`oversize_rotate`). At most [`ASIDE_MAX`] are held aside
//! (past it, the stage gives one back and takes nothing more until the permit is its own), and
//! none longer than the broker's `consumer_timeout` allows (`aside_aged`: given back, and held
//! aside again as they come). No body begun
//! within [`LIFTED_FOR`] (another instance took it): the subscription is cancelled, and the
//! permit released at its stream's end. A link lost, a stop: released.
//!
//! The permit is never held by a stage that waits for something else than its own delivery: it
//! is taken only with nothing in flight, nothing subscribed, no hold, and given up at once if
//! any of these changed while it was waited for. So no stage, of one pipeline or several, waits
//! on another that waits on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use super::Consumer;
use super::link::{Link, Phase, Subscription};
use super::window::FIRST_WINDOW;
use crate::pipeline::message::Disposition;

mod aside;
use aside::Aside;
pub(super) use aside::identity;

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

/// How long a stage takes the messages as they come, holding bodies over the limit aside,
/// before a turn that would otherwise take the queue's head whole, when a body's park failed
/// before (`Consumer::failed_parks`): a lost link, a give-back at 80% of `consumer_timeout` or a
/// stop puts every body back at the head in its first order, and a turn taken at once took the
/// head, the body parking refuses included, after every lost link (review R38g F4: links lost
/// more often than a turn lasts, 30 to 60 s, kept the parkable bodies behind it from their
/// parks). Collected, the turn goes to the one whose parks failed the fewest times
/// (`Aside::take_next`). As long as the held-window watchdog's wait: the broker sends the head
/// at once, and what comes behind it in this time comes at the broker's speed.
pub(super) const COLLECT_FOR: Duration = Duration::from_secs(3);

/// How many times as long as a turn whose park failed the stage goes on before it asks for
/// the permit again, at least: a turn stands the stage still (what it holds settles, the body
/// comes whole, its park is tried), so a body parking refuses holds its messages for at most a
/// tenth of the time. The backoff of the parks failed in a row alone (200 ms doubling) gave
/// turns every 0.2 to 2 s at first, of 0.8 to 3.7 s each for bodies of 10 to 100 MB: the stage
/// stood still about half of its first 30 s, 20,000 small messages behind one such body drained
/// 2.5 to 6 times slower (review R38j F1).
pub(super) const TURN_DUTY: u32 = 9;

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
    GivenBack {
        /// Held aside while the permit was waited for, given back when it is taken.
        aside: Aside,
    },
    /// The permit is being waited for (another stage holds it), or will be asked for after a
    /// failed park's backoff (`oversize_rotate`) or a moment of collecting ([`COLLECT_FOR`]).
    /// Meanwhile the stage takes deliveries under its limit and holds the bodies over it aside.
    Waiting {
        aside: Aside,
        /// One more came than could be held aside (or they were held too long): given back,
        /// and nothing subscribes until the permit comes.
        full: bool,
    },
    /// The permit is held: the next subscription has a window of one and no body limit, and its
    /// first delivery restores the limit. What is still held aside waits for its own turn.
    Lifted(OwnedSemaphorePermit, Aside),
    /// The permit is held for a body over the limit that came whole, until it settles.
    Holding {
        /// Held for its drop: the permit goes when the state does.
        _permit: OwnedSemaphorePermit,
        /// The body's delivery (channel generation, delivery tag): its settlement releases the
        /// permit.
        body: (u64, u64),
        /// The body's identity ([`identity`]): a failed park counts against it.
        identity: u64,
        /// The bytes it holds (body and parsed properties): the `M` of the memory bound, not
        /// part of the byte budget's `A` (`accepted_bytes`).
        bytes: u64,
        /// Deliveries over the limit that came meanwhile (in a window beside the held body), or
        /// were held aside before and wait for their turn: each is given back alone when the
        /// permit is taken for it, and taken whole then.
        aside: Aside,
        /// Meanwhile another one was given back unread (past [`ASIDE_MAX`], or while
        /// stopping), so the permit is taken again once this one settles.
        given_back: bool,
    },
}

/// The most deliveries over `MAX_MESSAGE_BYTES` a stage holds aside (unacked, bodies not stored)
/// while it holds the permit for another body or waits for it: each is a tag and nothing else,
/// so the stage goes on to the messages behind them (review R38c F1: two big bodies in a row
/// while parking failed, the second given back at once, cut the window beside the first to
/// nothing, and no message behind them moved; review R38d F1/F2: a stage waiting for the permit
/// took no deliveries at all while another stage's park kept failing). Past it, one more is
/// given back, and the stage takes nothing more until the permit is its own: so only more than
/// this many such bodies in a row stop the messages behind them while parking fails (review
/// R38e F1: 33 did, with a bound of 32). What one costs: 8 bytes here, an unacked message on
/// the broker (its body is in the queue anyway), and a resubscription when it comes (the
/// broker's window of the subscription it came on is refreshed); on a quorum queue, a
/// cancelled consumer stays listed while it has unacked messages.
pub(super) const ASIDE_MAX: usize = 1024;

/// The most bodies whose failed parks a stage remembers (by [`identity`]); past it, it forgets
/// them all (the order of turns starts again from the oldest).
const FAILED_PARKS_MAX: usize = 4 * ASIDE_MAX;

/// How long a stage goes on after a turn of `turn` whose park failed, the `streak`-th in a
/// row, before it asks for the permit again: the parks' backoff, and at least [`TURN_DUTY`]
/// times the turn (at most 10 minutes: a body's turn never waits longer than that).
fn turn_wait(streak: u32, turn: Option<Duration>) -> Duration {
    let backoff = crate::pipeline::router::requeue_backoff(streak);
    let duty = turn.map_or(Duration::ZERO, |t| t.saturating_mul(TURN_DUTY));
    backoff.max(duty.min(Duration::from_secs(600)))
}

impl Oversize {
    /// Whether a body was given back and the stage is on its way to take it whole: nothing
    /// subscribes beside anything still in flight.
    pub(super) fn pending(&self) -> bool {
        self.lifted() || self.stands_still()
    }

    /// Whether the stage takes no deliveries until what it holds settled and the permit is its
    /// own: a subscription that begins meanwhile is cancelled at once.
    pub(super) fn stands_still(&self) -> bool {
        matches!(
            self,
            Oversize::GivenBack { .. }
                | Oversize::Waiting { full: true, .. }
                | Oversize::Holding {
                    given_back: true,
                    ..
                }
        )
    }

    /// Whether a delivery over the limit that just came unread can be held aside: the stage
    /// holds the permit for another body or waits for it, and there is room.
    fn room_aside(&self) -> bool {
        match self {
            Oversize::Holding {
                aside,
                given_back: false,
                ..
            }
            | Oversize::Waiting { aside, full: false } => aside.room(),
            _ => false,
        }
    }

    /// What is held aside, if anything can be.
    fn aside(&mut self) -> Option<&mut Aside> {
        match self {
            Oversize::GivenBack { aside }
            | Oversize::Waiting { aside, .. }
            | Oversize::Lifted(_, aside)
            | Oversize::Holding { aside, .. } => Some(aside),
            Oversize::Limited => None,
        }
    }

    pub(super) fn lifted(&self) -> bool {
        matches!(self, Oversize::Lifted(..))
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
    /// again and again), and the next one waits until everything delivered before is settled;
    /// then the permit is taken (or asked for, and the stage goes on meanwhile, holding such
    /// bodies aside), and a window of one without a body limit takes the body back whole and
    /// alone, to be parked.
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
        if matches!(self.oversize, Oversize::Limited) {
            // A turn begins: the stage stands still until what it holds settled.
            self.turn_since = Some(Instant::now());
        }
        match &mut self.oversize {
            Oversize::Holding { given_back, .. } => *given_back = true,
            Oversize::Waiting { full, .. } => *full = true,
            Oversize::Limited => {
                self.oversize = Oversize::GivenBack {
                    aside: Aside::default(),
                }
            }
            Oversize::GivenBack { .. } | Oversize::Lifted(..) => {}
        }
        if self.consuming() {
            self.unsubscribe();
            self.dispatch.flush_all();
        }
    }

    /// Whether a subscription may begin as far as bodies over the limit go; called by
    /// `maybe_subscribe` with the link up, nothing subscribed, nothing held. A body given back
    /// with nothing left in flight takes the permit now when it is free; else the permit is
    /// asked for (FIFO), and the stage subscribes meanwhile under its limit, holding such
    /// bodies aside (`Oversize::Waiting`).
    pub(super) fn oversize_ready(&mut self, ctx: &mut Context<Self>) -> bool {
        match &self.oversize {
            Oversize::GivenBack { .. } if self.inflight == 0 => {}
            Oversize::GivenBack { .. } => return false,
            Oversize::Waiting { full, .. } => return !full,
            Oversize::Limited | Oversize::Lifted(..) | Oversize::Holding { .. } => return true,
        }
        let Oversize::GivenBack { aside } = std::mem::take(&mut self.oversize) else {
            return false;
        };
        // Nothing held aside to choose from, and a park failed before: the body at the queue's
        // head may be one parking refuses, so the turn waits until the bodies behind it were
        // seen (review R38g F4).
        let collect = aside.is_empty() && !self.failed_parks.is_empty();
        if collect {
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                collect_ms = COLLECT_FOR.as_millis() as u64,
                "a body over MAX_MESSAGE_BYTES is to be taken whole and bodies' parks failed \
                 before: taking the messages as they come for a moment first, holding such \
                 bodies aside unread, so the turn goes to the one whose parks failed the fewest \
                 times"
            );
        } else if let Ok(permit) = self.config.oversize.0.clone().try_acquire_owned() {
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                "the permit to hold a body over MAX_MESSAGE_BYTES is this stage's: subscribing \
                 with a window of 1 and no body limit"
            );
            self.lift(permit, aside);
            return true;
        } else {
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                aside_max = ASIDE_MAX,
                "waiting for the process's one permit to hold a body over MAX_MESSAGE_BYTES \
                 (another stage holds one); meanwhile this stage goes on, holding such bodies \
                 aside unread"
            );
        }
        self.oversize = Oversize::Waiting { aside, full: false };
        if collect {
            ctx.run_later(COLLECT_FOR, |act, ctx| act.ask_permit(ctx));
        } else {
            self.ask_permit(ctx);
        }
        true
    }

    /// Waiting for the permit (FIFO, the gauge says so); `granted` when it comes.
    fn ask_permit(&mut self, ctx: &mut Context<Self>) {
        if !matches!(self.oversize, Oversize::Waiting { .. }) {
            return;
        }
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
    }

    /// The permit is this stage's, with nothing in flight and nothing subscribed: the oldest body
    /// held aside goes back to the queue (at its head: RabbitMQ requeues to a message's place),
    /// and the next subscription (a window of one, no body limit) begins only once that nack was
    /// sent (`Acker::sent`), so the body is in the queue before it. The others stay aside for
    /// their own turns: each body is given back once per turn, not once per turn of every one
    /// (review R38e F1: 32 given back at each failed park, 256 give-backs a minute, each a
    /// delivery counted on a quorum queue).
    fn lift(&mut self, permit: OwnedSemaphorePermit, mut aside: Aside) {
        if let Some(next) = aside.take_next(&self.failed_parks) {
            self.give_back_aside(vec![next]);
        }
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_ref()) {
            self.consume_after = Some(acker.sent());
        }
        self.oversize = Oversize::Lifted(permit, aside);
    }

    /// The permit came after a wait: the stage subscribes without a body limit when it can at
    /// once (nothing in flight, nothing subscribed, no hold); else the permit goes at once
    /// (never held while the stage waits for something else), the subscription is cancelled,
    /// and the permit is taken again once what is in flight settled.
    fn granted(&mut self, permit: OwnedSemaphorePermit, ctx: &mut Context<Self>) {
        if !matches!(self.oversize, Oversize::Waiting { .. }) {
            return;
        }
        self.oversize_gauge.set(0.0);
        let Oversize::Waiting { aside, .. } = std::mem::take(&mut self.oversize) else {
            return;
        };
        // The turn begins: from here the stage stands still until the body's park ends.
        self.turn_since = Some(Instant::now());
        let free = matches!(&self.link, Link::Up(l) if l.subscription == Subscription::None
            && l.channel.status().connected());
        if self.phase != Phase::Running || !self.holds.is_empty() || self.inflight > 0 || !free {
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                inflight = self.inflight,
                "the permit came while the stage has deliveries in flight: given up until they \
                 settle"
            );
            drop(permit);
            self.oversize = Oversize::GivenBack { aside };
            if self.consuming() {
                self.unsubscribe();
                self.dispatch.flush_all();
            }
            return;
        }
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            "the permit to hold a body over MAX_MESSAGE_BYTES is this stage's: subscribing with a \
             window of 1 and no body limit"
        );
        self.lift(permit, aside);
        self.maybe_subscribe(ctx);
        if matches!(&self.link, Link::Up(l) if l.subscription == Subscription::None) {
            self.oversize = Oversize::GivenBack {
                aside: Aside::default(),
            };
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
    /// or waits for it, and there is room ([`ASIDE_MAX`]); answers whether it was. Else it is
    /// given back.
    pub(super) fn set_aside(&mut self, tag: u64, identity: u64) -> bool {
        if self.phase != Phase::Running || !self.oversize.room_aside() {
            return false;
        }
        if let Some(aside) = self.oversize.aside() {
            aside.push(tag, identity);
        }
        self.ack_around(tag);
        true
    }

    /// A delivery of the current channel is held aside: its acker acks what settles behind it
    /// at once, one by one, never waiting for it (review R38i F1: the window filled behind it
    /// and waited for the watchdog's tick, the pipeline some 50 times slower).
    fn ack_around(&mut self, tag: u64) {
        if let Some(acker) = self.linked().and_then(|l| l.acker.as_mut()) {
            acker.aside(tag);
        }
    }

    /// Deliveries over the limit were held aside (`set_aside`): they fill the broker's window
    /// of the subscription that brought them, so it is cancelled, and the next one begins at
    /// once (what is held aside counts in no window of warren's: it holds no bytes).
    pub(super) fn held_aside(&mut self, n: usize) {
        let waiting = matches!(self.oversize, Oversize::Waiting { .. });
        info!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            set_aside = n,
            held_aside = self.oversize.aside().map_or(0, |a| a.len()),
            max_message_bytes = self.config.max_message_bytes,
            "bodies over MAX_MESSAGE_BYTES announced while this stage {}: held aside unread \
             (nothing of them stored) and given back when its turn comes; the messages behind \
             them go on",
            if waiting {
                "waits for the process's one permit to hold one"
            } else {
                "holds one whole"
            }
        );
        if self.consuming() {
            self.unsubscribe();
        }
    }

    /// Once per watchdog tick: deliveries held aside longer than the broker's
    /// `consumer_timeout` allows (`hand_back_after`) go back to the queue (else the broker
    /// closes the channel, and everything in flight on it goes back too). The stage goes on:
    /// they come again, unread, and are held aside anew, their clock started again (review
    /// R38e E9: standing still after such a give-back held small messages for 45 s).
    pub(super) fn aside_aged(&mut self) {
        let Some(bound) = self.amqp.hand_back_after() else {
            return;
        };
        if self.phase != Phase::Running
            || !self
                .oversize
                .aside()
                .is_some_and(|a| a.held_longer_than(bound))
        {
            return;
        }
        let tags = self.oversize.aside().map(Aside::take).unwrap_or_default();
        warn!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            given_back = tags.len(),
            held_for_s = bound.as_secs(),
            "bodies held aside unread for as long as the broker's consumer_timeout allows: given \
             back to the queue, to be held aside again as they come"
        );
        self.give_back_aside(tags);
    }

    /// The deliveries of a chunk came, `refused` the tag and bytes of the first of them over
    /// `MAX_MESSAGE_BYTES` (of the current channel): the first delivery of a subscription
    /// without a limit restores it at once; the permit goes with an accepted body, stays with a
    /// refused one until it settles.
    pub(super) fn oversize_delivered(&mut self, refused: Option<(u64, u64, u64)>) {
        if !self.oversize.lifted() {
            return;
        }
        self.restore_body_limit();
        let Oversize::Lifted(permit, aside) = std::mem::take(&mut self.oversize) else {
            return;
        };
        if let Some((tag, bytes, identity)) = refused {
            self.oversize = Oversize::Holding {
                _permit: permit,
                body: (self.generation, tag),
                identity,
                bytes,
                aside,
                given_back: false,
            };
        } else {
            // An accepted body (the one given back went elsewhere): the permit goes; what is
            // still held aside takes it again in its turn.
            self.after_turn(aside, false);
        }
    }

    /// A turn with the permit ended: with bodies still held aside, or one given back meanwhile
    /// (`again`), the stage stands still until what it holds settled and takes the permit for
    /// the next of them; else it is done.
    fn after_turn(&mut self, aside: Aside, again: bool) {
        self.turn_since = None;
        self.oversize = if aside.is_empty() && !again {
            Oversize::Limited
        } else {
            Oversize::GivenBack { aside }
        };
        if self.oversize.stands_still() && self.consuming() {
            self.unsubscribe();
            self.dispatch.flush_all();
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

    /// Settlements of the current channel: when the body held whole with the permit goes back
    /// to its queue (its park failed), it is not given back but held aside (its body dropped,
    /// its delivery unacked), behind any others, and its turn ends at once: the permit goes to
    /// whichever stage waits for it, and this stage asks for it again only after the failed
    /// park's backoff (`requeue_backoff` of the parks failed in a row), taking its messages
    /// meanwhile and holding such bodies aside (`Oversize::Waiting`). The router settles such a
    /// body at once (`Fallback::settle`), never holding it through the backoff.
    ///
    /// Given back, it went to the queue's head, and the next turn took it again: one body
    /// whose park always fails (a trigger or a CHECK on `dead_letters`) kept every other body of
    /// the stage from its park (review R38e F2). Held through its backoff (31 to 51 s), it kept
    /// the process's one permit from every other stage and pipeline: another pipeline's
    /// parkable bodies were parked one a minute, its small messages waiting behind them for
    /// minutes (review R38h F1).
    pub(super) fn oversize_rotate(
        &mut self,
        items: &mut Vec<(u64, Disposition)>,
        ctx: &mut Context<Self>,
    ) {
        let Oversize::Holding { body, identity, .. } = &self.oversize else {
            return;
        };
        if body.0 != self.generation {
            return;
        }
        let (held, identity) = (body.1, *identity);
        let Some(at) = items.iter().position(|(tag, _)| *tag == held) else {
            return;
        };
        // Each failed park counts against the body (its next turn comes after the others'),
        // a park that held forgets it.
        let turn = self.turn_since.take().map(|since| since.elapsed());
        if items[at].1 == Disposition::Ack {
            self.failed_parks.remove(&identity);
            self.park_streak = 0;
            return;
        }
        if self.failed_parks.len() >= FAILED_PARKS_MAX {
            self.failed_parks.clear();
        }
        *self.failed_parks.entry(identity).or_default() += 1;
        self.park_streak = self.park_streak.saturating_add(1);
        if self.phase != Phase::Running {
            return;
        }
        items.remove(at);
        let Oversize::Holding {
            mut aside,
            given_back,
            ..
        } = std::mem::take(&mut self.oversize)
        else {
            return;
        };
        aside.push(held, identity);
        self.ack_around(held);
        // The backoff of the parks failed in a row (as the router's requeues grow): whichever
        // body takes the next turn, parks that keep failing never make a hot loop; and at least
        // `TURN_DUTY` times the turn, so the stage goes on at least nine tenths of the time.
        let wait = turn_wait(self.park_streak, turn);
        debug!(
            pipeline = self.config.stage.pipeline(),
            stage = self.config.stage.stage().as_str(),
            tag = held,
            held_aside = aside.len(),
            wait_ms = wait.as_millis() as u64,
            "a body whose park failed is held aside; the permit goes, and is asked for again \
             after the backoff"
        );
        // The permit goes with the state. One given back meanwhile (`given_back`): nothing is
        // taken until the permit comes again.
        self.oversize = Oversize::Waiting {
            aside,
            full: given_back,
        };
        // The subscription that brought it has its window filled by it (unacked): cancelled,
        // and the next one, under the limit, takes the messages behind it.
        if self.consuming() {
            self.unsubscribe();
            if self.oversize.stands_still() {
                self.dispatch.flush_all();
            }
        }
        ctx.run_later(wait, |act, ctx| act.ask_permit(ctx));
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
        if !matches!(self.oversize, Oversize::Holding { .. }) {
            return;
        }
        let Oversize::Holding {
            mut aside,
            given_back,
            ..
        } = std::mem::take(&mut self.oversize)
        else {
            return;
        };
        if self.phase != Phase::Running {
            self.give_back_aside(aside.take());
            return;
        }
        self.after_turn(aside, given_back);
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
        if let Some(aside) = self.oversize.aside() {
            let aside = aside.take();
            self.give_back_aside(aside);
        }
    }

    /// A subscription warren cancelled ended: without a delivery under a lifted limit, the
    /// permit goes (the body went elsewhere, or a hold or a stop came).
    pub(super) fn oversize_unsubscribed(&mut self) {
        if self.oversize.lifted() {
            self.restore_body_limit();
            let Oversize::Lifted(_, aside) = std::mem::take(&mut self.oversize) else {
                return;
            };
            self.after_turn(aside, false);
        }
    }

    /// The link is gone: a permit held for a subscription without a limit goes (the next link
    /// takes it again before it subscribes); one held for a body still in flight stays until
    /// that body settles. What was held aside went back to the queue with the channel: taken
    /// whole later.
    pub(super) fn oversize_link_lost(&mut self) {
        let stopping = self.phase != Phase::Running;
        let mut gone = 0;
        match &mut self.oversize {
            Oversize::Lifted(_, aside) => {
                gone = aside.take().len();
                self.oversize = Oversize::GivenBack {
                    aside: Aside::default(),
                }
            }
            Oversize::Holding {
                aside, given_back, ..
            } if !aside.is_empty() => {
                gone = aside.take().len();
                *given_back = true;
            }
            Oversize::Waiting { aside, full } => {
                gone = aside.take().len();
                *full = false;
            }
            Oversize::GivenBack { aside } => gone = aside.take().len(),
            _ => {}
        }
        if stopping {
            self.stop_counts.given_back += gone as u64;
        }
    }

    /// The stage stops: whatever it held goes.
    pub(super) fn oversize_closed(&mut self) {
        if matches!(self.oversize, Oversize::Waiting { .. }) {
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

    /// Review R38j F1: after a turn whose park failed the stage goes on nine times as long as
    /// the turn took, at least the parks' backoff, at most 10 minutes.
    #[test]
    fn a_failed_turn_is_followed_by_nine_times_its_length_of_going_on() {
        // No turn measured: the backoff alone (200 ms, and its jitter).
        assert!(turn_wait(1, None) < Duration::from_millis(500));
        assert_eq!(
            turn_wait(1, Some(Duration::from_millis(800))),
            Duration::from_millis(7200)
        );
        assert_eq!(
            turn_wait(1, Some(Duration::from_secs(4))),
            Duration::from_secs(36)
        );
        // A short turn: the backoff decides (never a hot loop).
        assert!(turn_wait(12, Some(Duration::from_millis(1))) >= Duration::from_secs(30));
        assert_eq!(
            turn_wait(1, Some(Duration::from_secs(3600))),
            Duration::from_secs(600)
        );
    }

    fn aside(n: u64) -> Aside {
        let mut aside = Aside::default();
        (0..n).for_each(|t| aside.push(t, t));
        aside
    }

    #[test]
    fn a_stage_on_its_way_to_a_body_subscribes_beside_nothing() {
        assert!(!Oversize::Limited.pending());
        assert!(Oversize::GivenBack { aside: aside(0) }.pending());
        // Waiting for the permit, the stage goes on (holding big bodies aside) until one more
        // comes than it can hold.
        let waiting = |full| Oversize::Waiting {
            aside: aside(1),
            full,
        };
        assert!(!waiting(false).pending());
        assert!(!waiting(false).stands_still());
        assert!(waiting(true).pending());
        assert!(waiting(true).stands_still());
        let semaphore = Arc::new(Semaphore::new(2));
        let permit = || semaphore.clone().try_acquire_owned().expect("free");
        assert!(Oversize::Lifted(permit(), aside(0)).pending());
        assert!(!Oversize::Lifted(permit(), aside(0)).stands_still());
        assert!(
            !Oversize::Holding {
                _permit: permit(),
                body: (1, 1),
                identity: 1,
                bytes: 1,
                aside: aside(1),
                given_back: false
            }
            .pending()
        );
    }

    /// Bodies are held aside only beside a body held whole or while the permit is waited for,
    /// at most `ASIDE_MAX`, and not once one was given back (the stage takes the permit again
    /// then, for all of them).
    #[test]
    fn bodies_are_held_aside_only_beside_a_held_body_or_while_waiting_and_within_the_bound() {
        let semaphore = Arc::new(Semaphore::new(4));
        let permit = || semaphore.clone().try_acquire_owned().expect("free");
        let holding = |n: usize, given_back| Oversize::Holding {
            _permit: permit(),
            body: (1, 1),
            identity: 1,
            bytes: 1,
            aside: aside(n as u64),
            given_back,
        };
        assert!(holding(0, false).room_aside());
        assert!(holding(ASIDE_MAX - 1, false).room_aside());
        assert!(!holding(ASIDE_MAX, false).room_aside());
        assert!(!holding(0, true).room_aside());
        let waiting = |n: usize, full| Oversize::Waiting {
            aside: aside(n as u64),
            full,
        };
        assert!(waiting(0, false).room_aside());
        assert!(waiting(ASIDE_MAX - 1, false).room_aside());
        assert!(!waiting(ASIDE_MAX, false).room_aside());
        assert!(!waiting(0, true).room_aside());
        assert!(!Oversize::Limited.room_aside());
        assert!(!Oversize::GivenBack { aside: aside(0) }.room_aside());
        assert!(!Oversize::Lifted(permit(), aside(0)).room_aside());
    }
}
