//! The prefetch window and the byte budget. The prefetch window bounds how many deliveries are
//! in flight, not their size: a delivery holds its body and its properties as parsed (a header
//! table can take some 30 times its wire size: `headers::parsed_bytes`). Once what is in flight
//! reaches `MAX_INFLIGHT_BYTES` the consumer cancels its subscription, lets what it holds settle
//! back under the budget, and subscribes again with a window cut to what the budget holds of
//! the largest delivery it saw (`basic.qos` before `basic.consume`); after two such windows of
//! small deliveries it grows back to the prefetch the same way. The budget counts everything in
//! flight, so what overshoots it is at most what the broker pushed before the cancel: one window
//! of deliveries, each body at most the broker's `max_message_size` and each content header at
//! most its `frame_max`. A change of concurrency (balancing) changes the window the same way.

use actix::prelude::*;
use tracing::{debug, info, warn};

use super::link::{Link, Phase, Subscription};
use super::{Consumer, SetConcurrency};

impl Consumer {
    /// Whether a subscription with `window` may begin beside what is in flight (all of it from
    /// earlier subscriptions or links: none is active): at most `window` deliveries, so that the
    /// deliveries in flight stay within two windows however often the window changes while some
    /// are held, and under the byte budget, which counts every delivery held (past it, nothing
    /// more is taken until enough settles). A single held delivery never stops it, unless it
    /// alone fills the byte budget.
    pub(super) fn room_for(&self, window: u16) -> bool {
        self.inflight <= usize::from(window) && self.inflight_bytes < self.config.max_inflight_bytes
    }

    /// The window the next subscription takes: the prefetch, cut to what the byte budget holds
    /// of the largest delivery seen during the current one if that was larger than any accepted
    /// body (at least 1).
    pub(super) fn wanted_window(&self) -> u16 {
        self.window_for(self.largest.max(self.kept_largest))
    }

    /// The prefetch, cut to what the byte budget holds of deliveries of `largest` bytes.
    pub(super) fn window_for(&self, largest: usize) -> u16 {
        let largest = (largest.max(self.config.max_message_bytes) as u64).max(1);
        let fits = (self.config.max_inflight_bytes / largest).clamp(1, u64::from(u16::MAX));
        (fits as u16).min(self.config.prefetch.max(1))
    }

    /// Past the byte budget: no more deliveries until what is in flight settles back under it,
    /// then a smaller window. A cut window that saw two windows' worth of small bodies grows
    /// back the same way. Either way the subscription is cancelled, so this runs once per
    /// subscription.
    pub(super) fn check_budget(&mut self) {
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

    /// A subscription whose window is not the one wanted (the concurrency changed) is
    /// cancelled, and the next one takes the new window once the cancel is answered (its
    /// stream ended), whatever is still in flight.
    pub(super) fn follow_window(&mut self) {
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
