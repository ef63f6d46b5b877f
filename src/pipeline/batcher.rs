//! The batcher stage: collects decoded chunks and hands its sink one batch at a time, as soon as
//! the sink is free (natural batching): whatever waits goes, up to the batch size. A batch is
//! small when the load is light (a message waits for one insert, not for a clock) and grows by
//! itself when the load rises (what arrives while the sink inserts is the next batch).
//! `batch_min_wait_ms` keeps a deliberate wait for fuller batches, capped by the batch timeout;
//! draining and a `Flush` hand over at once. While the sink works on a batch the next one
//! fills; the prefetch window bounds both. Why this shape, and what it costs the database at
//! moderate rates: docs/performance.md, "Natural batching".

use std::time::{Duration, Instant};

use actix::prelude::*;

use super::message::{Batch, Decoded, Drain, Flush, Processed};

/// When to hand a batch to the sink, and how large.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushRule {
    /// The largest batch: what waits beyond it goes in the next one.
    pub batch_size: usize,
    /// The longest a partial batch is held back on purpose: caps `min_wait`.
    pub timeout: Duration,
    /// How long the oldest waiting entry is held for a fuller batch before a free sink takes a
    /// partial one (`batch_min_wait_ms`); zero hands it over as soon as the sink is free.
    pub min_wait: Duration,
}

impl FlushRule {
    /// How long a partial batch is held for more: the minimum wait, never past the timeout.
    pub fn hold(&self) -> Duration {
        self.min_wait.min(self.timeout)
    }

    /// How many entries go to the sink now: `None` while the sink is busy or nothing waits; a
    /// full batch at once; everything waiting (up to the size) once the oldest was held
    /// [`FlushRule::hold`], or at once when the pipeline drains.
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
        let held = oldest.is_none_or(|at| at.elapsed() >= self.hold());
        if waiting >= size {
            Some(size)
        } else if draining || held {
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
    /// When the oldest waiting entry arrived (after a batch of the size left some behind: when
    /// the oldest of that batch did, so the rest are not held again).
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
            if self.entries.is_empty() {
                self.oldest = None;
            }
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

    /// A timer for when the oldest waiting entry was held long enough (none while the sink is
    /// busy: its answer flushes; none without a minimum wait: a free sink took it already). A timer already pending for the same entry stays: chunks that join a
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
        let wait = self.rule.hold().saturating_sub(oldest.elapsed());
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
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::pipeline::message::Delivery;

    /// The shipped defaults' shape: a long timeout, no minimum wait.
    const RULE: FlushRule = FlushRule {
        batch_size: 100,
        timeout: Duration::from_secs(60),
        min_wait: Duration::ZERO,
    };

    fn ago(ms: u64) -> Option<Instant> {
        Instant::now().checked_sub(Duration::from_millis(ms))
    }

    #[test]
    fn a_full_batch_goes_at_once_and_never_more_than_the_size() {
        let now = Some(Instant::now());
        assert_eq!(RULE.due(100, now, false, false), Some(100));
        assert_eq!(RULE.due(250, now, false, false), Some(100));
        let waiting = FlushRule {
            min_wait: Duration::from_secs(30),
            ..RULE
        };
        assert_eq!(waiting.due(250, now, false, false), Some(100));
    }

    #[test]
    fn a_free_sink_takes_whatever_waits_without_waiting_for_the_timeout() {
        // The old rule held these until the oldest had waited the timeout (60 s).
        assert_eq!(RULE.due(1, Some(Instant::now()), false, false), Some(1));
        assert_eq!(RULE.due(99, Some(Instant::now()), false, false), Some(99));
    }

    #[test]
    fn a_minimum_wait_holds_a_partial_batch_until_the_oldest_waited_it() {
        let rule = FlushRule {
            min_wait: Duration::from_millis(500),
            ..RULE
        };
        assert_eq!(rule.due(7, Some(Instant::now()), false, false), None);
        assert_eq!(rule.due(7, ago(501), false, false), Some(7));
        // Draining does not wait.
        assert_eq!(rule.due(7, Some(Instant::now()), true, false), Some(7));
    }

    #[test]
    fn the_timeout_caps_the_minimum_wait() {
        let rule = FlushRule {
            batch_size: 100,
            timeout: Duration::from_millis(200),
            min_wait: Duration::from_secs(60),
        };
        assert_eq!(rule.hold(), Duration::from_millis(200));
        assert_eq!(rule.due(7, ago(100), false, false), None);
        assert_eq!(rule.due(7, ago(201), false, false), Some(7));
    }

    /// A sink that records each batch's delivery tags and answers (is free again) only when the
    /// test lets it.
    struct HeldSink {
        seen: Arc<Mutex<Vec<Vec<u64>>>>,
        gate: Arc<tokio::sync::Semaphore>,
    }

    impl Actor for HeldSink {
        type Context = Context<Self>;
    }

    impl Handler<Batch<u32>> for HeldSink {
        type Result = ResponseFuture<()>;
        fn handle(&mut self, batch: Batch<u32>, _: &mut Self::Context) -> Self::Result {
            let tags = batch.entries.iter().map(|e| e.delivery.tag).collect();
            self.seen.lock().expect("not poisoned").push(tags);
            let gate = self.gate.clone();
            Box::pin(async move {
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
            })
        }
    }

    fn chunk(tags: std::ops::Range<u64>) -> Processed<u32> {
        Processed(
            tags.map(|tag| Decoded {
                delivery: Delivery {
                    generation: 1,
                    tag,
                    redelivered: false,
                    body: bytes::Bytes::new(),
                    properties: lapin::BasicProperties::default(),
                    held_bytes: 0,
                    received_at: Instant::now(),
                },
                result: Ok(0),
            })
            .collect(),
        )
    }

    /// Waits (up to 2 s, far below the rule's 60 s timeout) until the sink saw `want`.
    async fn sink_saw(seen: &Arc<Mutex<Vec<Vec<u64>>>>, want: &[Vec<u64>]) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let now = seen.lock().expect("not poisoned").clone();
            if now == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the sink saw {now:?}, not {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[actix::test]
    async fn a_free_sink_gets_what_waits_at_once_and_what_arrives_meanwhile_is_the_next_batch() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let sink = HeldSink {
            seen: seen.clone(),
            gate: gate.clone(),
        }
        .start();
        let batcher = Batcher::new(RULE, sink.recipient(), "test-0".into()).start();
        // A lone message goes at once (the old rule held it for the 60 s timeout).
        batcher.send(chunk(1..2)).await.expect("batcher");
        sink_saw(&seen, &[vec![1]]).await;
        // While the sink inserts it, what arrives waits ...
        batcher.send(chunk(2..4)).await.expect("batcher");
        batcher.send(chunk(4..5)).await.expect("batcher");
        assert_eq!(*seen.lock().expect("not poisoned"), [vec![1]]);
        // ... and is the next batch, whole, once the sink is free.
        gate.add_permits(1);
        sink_saw(&seen, &[vec![1], vec![2, 3, 4]]).await;
        // More than a batch's worth waiting goes in batches of the size, the rest next.
        batcher.send(chunk(5..155)).await.expect("batcher");
        gate.add_permits(1);
        sink_saw(&seen, &[vec![1], vec![2, 3, 4], (5..105).collect()]).await;
        gate.add_permits(1);
        sink_saw(
            &seen,
            &[
                vec![1],
                vec![2, 3, 4],
                (5..105).collect(),
                (105..155).collect(),
            ],
        )
        .await;
    }

    #[test]
    fn nothing_goes_while_the_sink_is_busy_or_nothing_waits() {
        assert_eq!(RULE.due(500, ago(61_000), true, true), None);
        assert_eq!(RULE.due(1, ago(61_000), false, true), None);
        assert_eq!(RULE.due(0, None, true, false), None);
    }
}
