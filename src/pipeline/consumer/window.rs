//! The prefetch window and the byte budget. The prefetch window bounds how many deliveries are
//! in flight, not their size: a delivery holds its body and its properties as parsed (a header
//! table can take some 30 times its wire size: `headers::parsed_bytes`), and the AMQP client
//! receives a whole window of bodies, whatever their size, before warren sees the first one.
//! Four rules keep what it receives bounded in bytes:
//! - **A first window of one.** A consumer begins with a window of one delivery
//!   ([`FIRST_WINDOW`]); once a delivery with an accepted body (at most `MAX_MESSAGE_BYTES`)
//!   arrived, the window opens to the prefetch and what the budget holds (cancel, then
//!   `basic.qos` before `basic.consume`). So a restarted instance receives one delivery before it
//!   knows what the head of its queue holds (a body over `MAX_MESSAGE_BYTES` only under the
//!   next rule): a queue of huge bodies cannot take it over a memory limit at every start (a
//!   crash loop). One step, not a doubling per window:
//!   every step is a consume, and a broker slow to answer consumes made a ramp of a dozen a
//!   livelock (`tests/broker_faults.rs`, a consume answered late).
//! - **No body over `MAX_MESSAGE_BYTES` without the process's permit.** The vendored lapin reads
//!   a body limit at each content header (`Consumer::body_limit`, set on the channel before
//!   each consume): `MAX_MESSAGE_BYTES`, in every window, the first window of one included. A
//!   body announced over it is not stored (its frames are dropped) and comes marked
//!   (`Delivery::discarded`): it is given back at once (nack, requeue; no retry spent), the
//!   window cut to one and the subscription cancelled, and the next subscription waits until
//!   everything delivered before is settled and the process's one permit to hold such a body is
//!   the stage's, then takes a window of one with no limit: the body comes back whole and
//!   alone, and the permit goes once it is parked (`oversize.rs`). So the whole process holds
//!   one such body at a time, whatever its stages and pipelines (review R38-F1: every accepted
//!   delivery reopened the window in one step, and two 120 MiB bodies behind one came together,
//!   an OOM kill per group; issue 38: a main and a DLQ stage each held one, 367 MiB on 3.x).
//! - **Refused bodies one at a time.** A body over `MAX_MESSAGE_BYTES` (so received whole, in a
//!   window of one, with the permit) keeps the window at one delivery, and the next accepted
//!   one opens it again: refused bodies are held one at a time, whatever the budget.
//! - **The budget.** Once what is in flight reaches `MAX_INFLIGHT_BYTES` the consumer cancels
//!   its subscription, lets what it holds settle back under the budget, and subscribes again with
//!   a window cut to what the budget holds of the largest accepted delivery it saw (a refused
//!   one never counts there: it cuts the window to one instead, and the accepted ones behind it
//!   open it again); after two such windows of small deliveries it grows back to the prefetch
//!   the same way. A change of concurrency (balancing) changes the window the same way.
//!
//! docs/failures.md ("Memory") turns these into the bound a memory limit is sized from.

use actix::prelude::*;
use tracing::{debug, info, warn};

use super::link::{Link, Phase, Subscription};
use super::{Consumer, SetConcurrency};

/// The window of a consumer's first subscription, and the window a refused body cuts to: one
/// delivery, so at most one body is received before its size is known.
pub(super) const FIRST_WINDOW: u16 = 1;

/// How many times in a row a subscription that opens the window waits a millisecond for the
/// processors to decode what they hold (`awaits_decode`).
pub(super) const DECODE_WAITS: u32 = 100;

/// The window the consumer has earned: how many deliveries the AMQP client may receive at once
/// before warren has seen how large they are. Kept across reconnects (a process that starts
/// again starts from [`FIRST_WINDOW`]): a rebuild that started over made every rebuild a step
/// more, and a broker slow to answer consumes a livelock.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Earned {
    /// 0 until earned: [`FIRST_WINDOW`].
    window: u16,
    /// Deliveries in a row with accepted bodies since the window was last set: a whole window
    /// of them opens it.
    run: u64,
}

impl Consumer {
    /// The window the consumer has earned ([`Earned`]).
    pub(super) fn earned_window(&self) -> u16 {
        self.earned.window.max(FIRST_WINDOW)
    }

    /// Records a chunk of `delivered` deliveries, `refused` of them with bodies over
    /// `MAX_MESSAGE_BYTES`: a refused body cuts the earned window to [`FIRST_WINDOW`], accepted
    /// ones count towards opening it.
    pub(super) fn observe(&mut self, delivered: usize, refused: usize) {
        if refused > 0 {
            self.earned.window = FIRST_WINDOW;
            self.earned.run = 0;
        } else {
            self.earned.run += delivered as u64;
        }
    }

    /// Whether a subscription with `window` may begin beside what is in flight (all of it from
    /// earlier subscriptions or links: none is active): at most `window` deliveries, so that the
    /// deliveries in flight stay within two windows however often the window changes while some
    /// are held, and under the byte budget, which counts every delivery held (past it, nothing
    /// more is taken until enough settles). A single held delivery never stops it, unless it
    /// alone fills the byte budget.
    /// After a body over `MAX_MESSAGE_BYTES` was given back unread, nothing may be in flight:
    /// the next subscription takes the process's permit and lifts the body limit
    /// (`oversize.rs`).
    pub(super) fn room_for(&self, window: u16) -> bool {
        if self.oversize.pending() && self.inflight > 0 {
            return false;
        }
        self.inflight <= usize::from(window)
            && self.accepted_bytes() < self.config.max_inflight_bytes
    }

    /// The bytes in flight the byte budget counts: all but a body over `MAX_MESSAGE_BYTES` held
    /// whole with the process's permit, which is the `M` of the memory bound, apart from the
    /// budget's `A` (docs/failures.md, "Memory"). Counted in, a body larger than the budget
    /// kept every window beside it shut while its park failed: nothing behind it moved (review
    /// R38d F3: bodies over the Deployment's 32 MiB).
    /// The decoded records of the deliveries in flight count too (`DecodedBytes`): a record can
    /// hold many times its body (review R36e F9: child rows).
    pub(super) fn accepted_bytes(&self) -> u64 {
        self.inflight_bytes
            .saturating_sub(self.oversize.held_bytes())
            + self.config.decoded.live()
    }

    /// Takes in the largest delivery the processors decoded since the last look, its record
    /// included: a window of records that hold many times their bodies is cut to what the
    /// budget holds of them (review R36e F9: 1,000 child rows from a body of 12 KB).
    pub(super) fn fold_decoded(&mut self) {
        let decoded = self.config.decoded.take_largest() as usize;
        self.largest = self.largest.max(decoded);
    }

    /// Whether the processors have yet to decode some of what was handed to them, when the
    /// next window would be larger than the current one: its size must wait for theirs (a
    /// first window of one opening on a message whose record is 20 times its body took a whole
    /// window of them before the budget knew). Never more than [`DECODE_WAITS`] times in a row
    /// (a processor restarted by its supervisor loses what it held: never a stall).
    pub(super) fn awaits_decode(&mut self, window: u16) -> bool {
        let current = self.linked().map_or(FIRST_WINDOW, |l| l.window);
        if window <= current
            || self.config.decoded.done() >= self.handed.0
            || self.handed.1 >= DECODE_WAITS
        {
            self.handed.1 = 0;
            return false;
        }
        self.handed.1 += 1;
        true
    }

    /// The window the next subscription takes: the prefetch, cut to what the byte budget holds
    /// of the largest delivery seen during the current one if that was larger than any accepted
    /// body (at least 1), and to the window the consumer has earned.
    pub(super) fn wanted_window(&self) -> u16 {
        self.budget_window().min(self.earned_window())
    }

    /// The prefetch, cut to what the byte budget holds of the largest delivery seen (this
    /// subscription's, or the one an earlier cut keeps).
    pub(super) fn budget_window(&self) -> u16 {
        self.window_for(self.largest.max(self.kept_largest))
    }

    /// The prefetch, cut to what the byte budget holds of deliveries of `largest` bytes.
    pub(super) fn window_for(&self, largest: usize) -> u16 {
        let largest = (largest.max(self.config.max_message_bytes) as u64).max(1);
        let fits = (self.config.max_inflight_bytes / largest).clamp(1, u64::from(u16::MAX));
        (fits as u16).min(self.config.prefetch.max(1))
    }

    /// After each chunk: past the byte budget, no more deliveries until what is in flight settles
    /// back under it, then a smaller window; a refused body cuts the window to one delivery at
    /// once; a cut window that saw two windows' worth of small bodies grows back; a whole window
    /// of accepted bodies opens the earned window to what the budget holds. Each cancels the subscription,
    /// and the next one takes the new window, so this acts once per subscription.
    pub(super) fn check_budget(&mut self) {
        if self.phase != Phase::Running || !self.consuming() {
            return;
        }
        let Link::Up(linked) = &self.link else {
            return;
        };
        let window = linked.window;
        let earned = self.earned_window();
        if self.accepted_bytes() >= self.config.max_inflight_bytes {
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
        } else if earned < window {
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                window,
                max_message_bytes = self.config.max_message_bytes,
                "a body over MAX_MESSAGE_BYTES arrived: refused bodies are taken one at a time; \
                 the prefetch window is cut to 1 now and grows back with the accepted ones"
            );
        } else if self.kept_largest > 0
            && self.since_subscribe >= 2 * u64::from(window)
            && self.window_for(self.largest).min(earned) > window
        {
            self.kept_largest = 0;
            info!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                window,
                "two windows of bodies the budget holds more of: the window grows back once \
                 what is in flight settles"
            );
        } else if window == earned
            && self.earned.run >= u64::from(window)
            && self.budget_window() > window
        {
            self.earned.window = self.budget_window();
            self.earned.run = 0;
            debug!(
                pipeline = self.config.stage.pipeline(),
                stage = self.config.stage.stage().as_str(),
                from = window,
                to = self.earned.window,
                "a whole window of accepted bodies: the window opens"
            );
            // The next subscription begins as soon as the cancel is answered (what is in flight
            // is less than the new window): the batches keep filling, nothing is flushed early.
            self.unsubscribe();
            return;
        } else {
            return;
        }
        self.unsubscribe();
        self.dispatch.flush_all();
    }

    /// The window is opening (a window of accepted bodies came): the next subscription takes a larger one as soon as
    /// the current one's cancel is answered, so the batches need not go before they fill (a
    /// backlog still makes whole batches while the window grows from 1).
    pub(super) fn growing(&self) -> bool {
        matches!(&self.link, Link::Up(l) if self.next_window() > l.window)
    }

    /// A subscription whose window is not the one wanted (the concurrency changed) is
    /// cancelled, and the next one takes the new window once the cancel is answered (its
    /// stream ended), whatever is still in flight.
    pub(super) fn follow_window(&mut self) {
        let wanted = self.next_window();
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
