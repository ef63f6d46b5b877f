//! The batcher stage: collects decoded chunks and hands its sink one batch at a time, as soon as
//! the sink is free (natural batching): whatever waits goes, up to the batch size. A batch is
//! small when the load is light (a message waits for one insert, not for a clock) and grows by
//! itself when the load rises (what arrives while the sink inserts is the next batch). A partial
//! batch goes at most once per [`PACE`] after the previous one: a lone message after a pause goes
//! at once, a steady stream costs at most one statement per pace per batcher however short the
//! inserts are, and a drain's batches fill. `batch_min_wait_ms` keeps a deliberate wait for
//! fuller batches, capped by the batch timeout; draining and a `Flush` hand over at once. While the sink works on a batch the next one
//! fills; the prefetch window bounds both. Why this shape, and what it costs the database at
//! moderate rates: docs/performance.md, "Natural batching".

use std::time::{Duration, Instant};

use actix::prelude::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::message::{Batch, Decoded, Drain, Flush, Processed};

/// The shortest time between a batch and the next partial one of the same batcher (capped by the
/// batch timeout). Short enough that a message waits for it less than the live latency targets
/// allow (docs/performance.md, "Natural batching"), long enough that short inserts do not turn
/// a stream into one statement per few rows: at most 50 partial statements a second a batcher.
pub const PACE: Duration = Duration::from_millis(20);

/// Which batchers' sinks are inserting, and since when: written by each batcher as it hands its
/// sink a batch and gets the answer, read by the dispatch.
#[derive(Debug)]
pub struct SinkStates {
    epoch: Instant,
    /// Per batcher: microseconds from `epoch` to when its sink took the batch under way, plus
    /// one; 0 while the sink is free.
    since: Vec<AtomicU64>,
}

impl SinkStates {
    /// `n` sinks, all free.
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            since: (0..n).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Batcher `i`'s sink took a batch.
    pub fn busy(&self, i: usize) {
        let micros = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
        if let Some(s) = self.since.get(i) {
            s.store(micros + 1, Ordering::Relaxed);
        }
    }

    /// Batcher `i`'s sink answered.
    pub fn free(&self, i: usize) {
        if let Some(s) = self.since.get(i) {
            s.store(0, Ordering::Relaxed);
        }
    }

    /// How long batcher `i`'s sink has been inserting at `now`; `None` while it is free.
    pub(super) fn busy_for(&self, i: usize, now: Instant) -> Option<Duration> {
        let since = self.since.get(i)?.load(Ordering::Relaxed).checked_sub(1)?;
        let took = self.epoch + Duration::from_micros(since);
        Some(now.saturating_duration_since(took))
    }
}

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

    /// The shortest time between a batch and the next partial one: [`PACE`], never past the
    /// timeout.
    pub fn pace(&self) -> Duration {
        PACE.min(self.timeout)
    }

    /// When a partial batch may go: once its oldest entry was held [`FlushRule::hold`] and the
    /// previous batch went [`FlushRule::pace`] ago. `None` when nothing waits.
    pub fn partial_at(&self, oldest: Option<Instant>, last: Option<Instant>) -> Option<Instant> {
        let held = oldest? + self.hold();
        Some(last.map_or(held, |last| held.max(last + self.pace())))
    }

    /// How many entries go to the sink now: `None` while the sink is busy or nothing waits; a
    /// full batch at once; everything waiting (up to the size) from
    /// [`FlushRule::partial_at`] on, or at once when the pipeline drains. `last` is when the
    /// previous batch went.
    pub fn due(
        &self,
        waiting: usize,
        oldest: Option<Instant>,
        last: Option<Instant>,
        draining: bool,
        sink_busy: bool,
    ) -> Option<usize> {
        if sink_busy || waiting == 0 {
            return None;
        }
        let size = self.batch_size.max(1);
        let ready = self
            .partial_at(oldest, last)
            .is_none_or(|at| Instant::now() >= at);
        if waiting >= size {
            Some(size)
        } else if draining || ready {
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
    /// When the last batch went to the sink.
    last: Option<Instant>,
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
    /// Where this batcher says whether its sink is inserting (the dispatch reads it), and its
    /// index there.
    states: Option<(Arc<SinkStates>, usize)>,
}

impl<R: Send + Unpin + 'static> Batcher<R> {
    pub fn new(rule: FlushRule, sink: Recipient<Batch<R>>, name: String) -> Self {
        Self {
            rule,
            sink,
            entries: Vec::new(),
            oldest: None,
            busy: false,
            last: None,
            timer: None,
            draining: false,
            flushing: false,
            name,
            next_batch_id: 0,
            states: None,
        }
    }

    /// Says in `states[index]` when its sink is inserting.
    pub fn reporting(mut self, states: Arc<SinkStates>, index: usize) -> Self {
        self.states = Some((states, index));
        self
    }

    /// Hands the sink a batch if one is due, and arms the timer for what waits.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        if let Some(n) = self.rule.due(
            self.entries.len(),
            self.oldest,
            self.last,
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
            self.last = Some(Instant::now());
            if let Some((states, i)) = &self.states {
                states.busy(*i);
            }
            ctx.spawn(self.sink.send(batch).into_actor(self).map(|_, act, ctx| {
                act.busy = false;
                if let Some((states, i)) = &act.states {
                    states.free(*i);
                }
                act.flush(ctx);
            }));
        }
        self.arm_timer(ctx);
    }

    /// A timer for when the waiting partial batch may go ([`FlushRule::partial_at`]; none while
    /// the sink is busy: its answer flushes). A timer already pending for the same instant
    /// stays: chunks that join a waiting batch cost no timer work.
    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let due = self
            .rule
            .partial_at(self.oldest, self.last)
            .filter(|_| !self.busy && !self.entries.is_empty());
        if let Some((timer, at)) = self.timer.take() {
            if Some(at) == due {
                self.timer = Some((timer, at));
                return;
            }
            ctx.cancel_future(timer);
        }
        let Some(at) = due else {
            return;
        };
        let wait = at.saturating_duration_since(Instant::now());
        let timer = ctx.run_later(wait, |act, ctx| {
            act.timer = None;
            act.flush(ctx);
        });
        self.timer = Some((timer, at));
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
        assert_eq!(RULE.due(100, now, None, false, false), Some(100));
        assert_eq!(RULE.due(250, now, None, false, false), Some(100));
        let waiting = FlushRule {
            min_wait: Duration::from_secs(30),
            ..RULE
        };
        assert_eq!(waiting.due(250, now, None, false, false), Some(100));
    }

    #[test]
    fn a_free_sink_takes_whatever_waits_without_waiting_for_the_timeout() {
        // The old rule held these until the oldest had waited the timeout (60 s).
        assert_eq!(
            RULE.due(1, Some(Instant::now()), None, false, false),
            Some(1)
        );
        assert_eq!(
            RULE.due(99, Some(Instant::now()), None, false, false),
            Some(99)
        );
    }

    #[test]
    fn a_minimum_wait_holds_a_partial_batch_until_the_oldest_waited_it() {
        let rule = FlushRule {
            min_wait: Duration::from_millis(500),
            ..RULE
        };
        assert_eq!(rule.due(7, Some(Instant::now()), None, false, false), None);
        assert_eq!(rule.due(7, ago(501), None, false, false), Some(7));
        // Draining does not wait.
        assert_eq!(
            rule.due(7, Some(Instant::now()), None, true, false),
            Some(7)
        );
    }

    #[test]
    fn the_timeout_caps_the_minimum_wait() {
        let rule = FlushRule {
            batch_size: 100,
            timeout: Duration::from_millis(200),
            min_wait: Duration::from_secs(60),
        };
        assert_eq!(rule.hold(), Duration::from_millis(200));
        assert_eq!(rule.due(7, ago(100), None, false, false), None);
        assert_eq!(rule.due(7, ago(201), None, false, false), Some(7));
    }

    #[test]
    fn a_partial_batch_waits_for_the_pace_after_the_previous_batch_and_a_full_one_does_not() {
        let now = Instant::now();
        let just_now = Some(now);
        // A lone message after a pause goes at once ...
        assert_eq!(RULE.due(1, just_now, ago(1_000), false, false), Some(1));
        // ... one that follows the previous batch closely waits for the pace ...
        assert_eq!(RULE.due(3, just_now, ago(5), false, false), None);
        assert_eq!(RULE.due(3, just_now, ago(21), false, false), Some(3));
        // ... unless the batch is full or the pipeline drains.
        assert_eq!(RULE.due(100, just_now, just_now, false, false), Some(100));
        assert_eq!(RULE.due(3, just_now, just_now, true, false), Some(3));
        let at = RULE.partial_at(just_now, just_now).expect("waiting");
        assert_eq!(at, now + PACE);
        // A timeout shorter than the pace caps it.
        let short = FlushRule {
            timeout: Duration::from_millis(5),
            ..RULE
        };
        assert_eq!(short.pace(), Duration::from_millis(5));
        assert_eq!(short.due(3, just_now, ago(6), false, false), Some(3));
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
                    properties: Default::default(),
                    published_ms: None,
                    exchange: Default::default(),
                    routing_key: Default::default(),
                    held_bytes: 0,
                    received_at: Instant::now(),
                    decoded: Default::default(),
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
        assert_eq!(RULE.due(500, ago(61_000), None, true, true), None);
        assert_eq!(RULE.due(1, ago(61_000), None, false, true), None);
        assert_eq!(RULE.due(0, None, None, true, false), None);
    }
}
