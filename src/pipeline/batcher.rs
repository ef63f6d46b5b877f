//! The batcher stage: collects decoded chunks and hands its sink one batch at a time, at the
//! batch size, at the batch timeout after the oldest waiting message, or at once when draining.
//! While the sink works on a batch the next one fills; the prefetch window bounds both.

use std::time::{Duration, Instant};

use actix::prelude::*;

use super::message::{Batch, Decoded, Drain, Flush, Processed};

/// When to hand a batch to the sink, and how large.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushRule {
    pub batch_size: usize,
    /// Zero flushes whatever arrived at once (deterministic tests).
    pub timeout: Duration,
}

impl FlushRule {
    /// How many entries go to the sink now: a full batch, or everything waiting once the oldest
    /// waited `timeout` or the pipeline drains; `None` while the sink is busy or the batch is
    /// not due.
    pub fn due(
        &self,
        waiting: usize,
        oldest: Option<Instant>,
        draining: bool,
        sink_busy: bool,
    ) -> Option<usize> {
        if sink_busy || waiting == 0 {
            return None;
        }
        let size = self.batch_size.max(1);
        let timed_out = oldest.is_some_and(|at| at.elapsed() >= self.timeout);
        if waiting >= size {
            Some(size)
        } else if draining || timed_out {
            Some(waiting)
        } else {
            None
        }
    }
}

/// The batcher actor.
pub struct Batcher<R: Send + Unpin + 'static> {
    rule: FlushRule,
    sink: Recipient<Batch<R>>,
    entries: Vec<Decoded<R>>,
    /// When the oldest waiting entry arrived.
    oldest: Option<Instant>,
    /// A batch is at the sink.
    busy: bool,
    /// A timer is pending for the entry that arrived at this instant.
    timer: Option<(SpawnHandle, Instant)>,
    /// After `Drain`, everything is flushed at once.
    draining: bool,
    /// After `Flush` (taken out by a scale-down): what waits goes at once, then the batcher
    /// batches as before.
    flushing: bool,
    /// `pipeline-index`, the prefix of batch ids in logs.
    name: String,
    next_batch_id: u64,
}

impl<R: Send + Unpin + 'static> Batcher<R> {
    pub fn new(rule: FlushRule, sink: Recipient<Batch<R>>, name: String) -> Self {
        Self {
            rule,
            sink,
            entries: Vec::new(),
            oldest: None,
            busy: false,
            timer: None,
            draining: false,
            flushing: false,
            name,
            next_batch_id: 0,
        }
    }

    /// Hands the sink a batch if one is due, and arms the timer for what waits.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        if let Some(n) = self.rule.due(
            self.entries.len(),
            self.oldest,
            self.draining || self.flushing,
            self.busy,
        ) {
            let entries = if n == self.entries.len() {
                std::mem::take(&mut self.entries)
            } else {
                self.entries.drain(..n).collect()
            };
            self.oldest = (!self.entries.is_empty()).then(Instant::now);
            self.flushing &= !self.entries.is_empty();
            self.next_batch_id += 1;
            let batch = Batch {
                id: format!("{}-{}", self.name, self.next_batch_id),
                entries,
            };
            self.busy = true;
            ctx.spawn(self.sink.send(batch).into_actor(self).map(|_, act, ctx| {
                act.busy = false;
                act.flush(ctx);
            }));
        }
        self.arm_timer(ctx);
    }

    /// A timer for when the oldest waiting entry is due (none while the sink is busy: its
    /// answer flushes). A timer already pending for the same entry stays: chunks that join a
    /// waiting batch cost no timer work.
    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let due = self
            .oldest
            .filter(|_| !self.busy && !self.entries.is_empty());
        if let Some((timer, at)) = self.timer.take() {
            if Some(at) == due {
                self.timer = Some((timer, at));
                return;
            }
            ctx.cancel_future(timer);
        }
        let Some(oldest) = due else {
            return;
        };
        let wait = self.rule.timeout.saturating_sub(oldest.elapsed());
        let timer = ctx.run_later(wait, |act, ctx| {
            act.timer = None;
            act.flush(ctx);
        });
        self.timer = Some((timer, oldest));
    }
}

impl<R: Send + Unpin + 'static> Actor for Batcher<R> {
    type Context = Context<Self>;
}

impl<R: Send + Unpin + 'static> Supervised for Batcher<R> {}

impl<R: Send + Unpin + 'static> Handler<Processed<R>> for Batcher<R> {
    type Result = ();

    fn handle(&mut self, msg: Processed<R>, ctx: &mut Self::Context) {
        if msg.0.is_empty() {
            return;
        }
        if self.entries.is_empty() {
            self.oldest = Some(Instant::now());
            self.entries = msg.0;
        } else {
            self.entries.extend(msg.0);
        }
        self.flush(ctx);
    }
}

impl<R: Send + Unpin + 'static> Handler<Drain> for Batcher<R> {
    type Result = ();

    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) {
        self.draining = true;
        self.flush(ctx);
    }
}

impl<R: Send + Unpin + 'static> Handler<Flush> for Batcher<R> {
    type Result = ();

    fn handle(&mut self, _: Flush, ctx: &mut Self::Context) {
        self.flushing = !self.entries.is_empty();
        self.flush(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: FlushRule = FlushRule {
        batch_size: 100,
        timeout: Duration::from_secs(60),
    };

    #[test]
    fn a_full_batch_goes_at_once_and_never_more_than_the_size() {
        let now = Some(Instant::now());
        assert_eq!(RULE.due(100, now, false, false), Some(100));
        assert_eq!(RULE.due(250, now, false, false), Some(100));
        assert_eq!(RULE.due(99, now, false, false), None);
    }

    #[test]
    fn a_partial_batch_waits_for_the_timeout_or_the_drain() {
        let old = Instant::now().checked_sub(Duration::from_secs(61));
        assert_eq!(RULE.due(7, old, false, false), Some(7));
        assert_eq!(RULE.due(7, Some(Instant::now()), true, false), Some(7));
        let zero = FlushRule {
            batch_size: 100,
            timeout: Duration::ZERO,
        };
        assert_eq!(zero.due(1, Some(Instant::now()), false, false), Some(1));
    }

    #[test]
    fn nothing_goes_while_the_sink_is_busy_or_nothing_waits() {
        let old = Instant::now().checked_sub(Duration::from_secs(61));
        assert_eq!(RULE.due(500, old, true, true), None);
        assert_eq!(RULE.due(0, None, true, false), None);
    }
}
