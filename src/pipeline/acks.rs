//! The acks of one channel: turns per-message settlements into as few channel operations as
//! possible, in an order the broker accepts (one `basic.ack multiple=true` for each contiguous
//! run of settled deliveries, requeues sent individually before any multi-ack that would cover
//! them), and executes them in order on one task per channel. There is no reject: the broker's
//! own dead-lettering is at-most-once, so warren never hands a message to it.
//!
//! A delivery held unsettled at the front of the window (a batch retried in place, a message
//! waiting out a requeue backoff) must not hold the settled ones behind it: they count against
//! the prefetch window, which fills, and the broker stops delivering. So when the front has been
//! held across a watchdog tick ([`Acker::tick`]), or more is settled behind it than the happy
//! path ever has there (half the window, and more than all but one batch of it, but never the
//! whole window: [`release_point`]), the settled deliveries behind it are acked one by one
//! (`basic.ack multiple=false`). On the happy path (batches commit within milliseconds, at most
//! `batchers - 1` batches ahead of the front) neither happens and the acks stay ordered
//! multi-acks. A delivery the consumer holds aside for long (a body over `MAX_MESSAGE_BYTES`
//! waiting for its turn: [`Acker::aside`]) is not waited for at all: what settles behind it is
//! acked one by one at once (review R38i F1: behind one such body, the window filled and waited
//! for the next tick, one window a second, 6,000 users in 18 to 36 s instead of 0.5).
//!
//! Acks are not confirmed in AMQP. While a copy the fallback stage republished waits for proof
//! that the broker handled its original's ack (`copies.rs`), the executor follows the acks it
//! sent with a fence, a passive declare of `amq.direct` on the same channel: the broker handles a
//! channel's frames in order, so its answer proves every ack sent before it was handled, and those
//! copies are forgotten. Without such copies (the happy path) there is no fence. A fence runs
//! beside the acks, one at a time, and never holds them up: a drain at a stop waits for the acks
//! to be sent, never for a proof (an awaited fence held a stop whose link was slow to answer).
//!
//! A resubscription (a new window, a resume, the byte budget) never waits for a held front: the
//! next subscription on the same channel starts once the cancelled one's stream ended, so its
//! deliveries come behind the held one in tag order, and are acked behind it the same way.

use crate::metrics::StageId;
use std::collections::VecDeque;
use std::sync::Arc;

use lapin::options::{BasicAckOptions, BasicNackOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::copies::Copies;
pub use super::message::Disposition;

/// A channel operation to perform, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `basic.ack(tag, multiple = true)`.
    AckUpTo(u64),
    /// `basic.ack(tag, multiple = false)`: a settled delivery behind a held one.
    AckOne(u64),
    /// `basic.nack(tag, multiple = false, requeue = true)`.
    Requeue(u64),
}

/// What the executor task is given, in order.
#[derive(Debug)]
enum Work {
    Ops(Vec<Op>),
    /// Answered once every operation given before it was sent on the channel.
    Sent(oneshot::Sender<()>),
}

/// Where one outstanding delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not settled yet.
    Open,
    /// Not settled yet, and held for long by the consumer ([`Acker::aside`]): what settles
    /// behind it is acked one by one at once.
    Aside,
    /// Settled with Ack; its ack not sent yet (a multi-ack from the front will cover it).
    Ack,
    /// Its operation was sent on its own (a requeue, or a single ack): no multi-ack may name it.
    Sent,
}

/// Outstanding deliveries of one channel, in delivery order.
#[derive(Debug, Default)]
pub struct AckTracker {
    /// (delivery tag, state) in delivery order.
    outstanding: VecDeque<(u64, State)>,
    /// Entries in state `Ack` (settled, waiting for the front).
    waiting: usize,
}

impl AckTracker {
    /// Records a delivery. Tags grow on a channel, and the consumer hands them on in that
    /// order (a new subscription starts only after the old one's stream ended). Should one come
    /// lower than the last anyway, it is put in its place, so its settlement is found and the
    /// front never waits on it for ever (answers false then: the caller says so).
    pub fn delivered(&mut self, tag: u64) -> bool {
        match self.outstanding.back() {
            Some((last, _)) if *last >= tag => {
                let i = self.outstanding.partition_point(|(t, _)| *t < tag);
                if self.outstanding.get(i).is_none_or(|(t, _)| *t != tag) {
                    self.outstanding.insert(i, (tag, State::Open));
                }
                false
            }
            _ => {
                self.outstanding.push_back((tag, State::Open));
                true
            }
        }
    }

    /// Deliveries not settled yet, or settled and not yet acked.
    pub fn len(&self) -> usize {
        self.outstanding.len()
    }

    pub fn is_empty(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// Settled deliveries waiting behind an unsettled front.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// The tag of the unsettled delivery at the front, if the front is held.
    pub fn held_front(&self) -> Option<u64> {
        self.outstanding
            .front()
            .filter(|(_, state)| matches!(state, State::Open | State::Aside))
            .map(|(tag, _)| *tag)
    }

    /// Whether the front is a delivery held aside ([`AckTracker::aside`]).
    pub fn front_aside(&self) -> bool {
        self.outstanding
            .front()
            .is_some_and(|(_, state)| *state == State::Aside)
    }

    /// Marks an unsettled delivery as held aside for long: it is settled later like any other,
    /// but nothing settled behind it waits for it. Unknown or settled tags are ignored.
    pub fn aside(&mut self, tag: u64) {
        if let Ok(i) = self.outstanding.binary_search_by_key(&tag, |(t, _)| *t)
            && self.outstanding[i].1 == State::Open
        {
            self.outstanding[i].1 = State::Aside;
        }
    }

    /// Settles `tag` and appends the operations that become possible to `ops`.
    /// Unknown or already settled tags are ignored (never acked twice).
    pub fn settle(&mut self, tag: u64, disposition: Disposition, ops: &mut Vec<Op>) {
        let Ok(i) = self.outstanding.binary_search_by_key(&tag, |(t, _)| *t) else {
            return;
        };
        if !matches!(self.outstanding[i].1, State::Open | State::Aside) {
            return;
        }
        match disposition {
            Disposition::Ack => {
                self.outstanding[i].1 = State::Ack;
                self.waiting += 1;
            }
            Disposition::Requeue => {
                self.outstanding[i].1 = State::Sent;
                ops.push(Op::Requeue(tag));
            }
        }
        let mut ack_to = None;
        while let Some((t, state)) = self.outstanding.front().copied() {
            match state {
                State::Open | State::Aside => break,
                State::Ack => {
                    ack_to = Some(t);
                    self.waiting -= 1;
                }
                State::Sent => {}
            }
            self.outstanding.pop_front();
        }
        if let Some(t) = ack_to {
            ops.push(Op::AckUpTo(t));
        }
    }

    /// Acks every settled delivery behind the held front one by one.
    pub fn release(&mut self, ops: &mut Vec<Op>) {
        if self.waiting == 0 {
            return;
        }
        for (tag, state) in self.outstanding.iter_mut() {
            if *state == State::Ack {
                *state = State::Sent;
                ops.push(Op::AckOne(*tag));
            }
        }
        self.waiting = 0;
    }
}

/// Collapses consecutive `AckUpTo` into the last one (they are cumulative).
pub fn coalesce(ops: Vec<Op>) -> Vec<Op> {
    let mut out: Vec<Op> = Vec::with_capacity(ops.len());
    for op in ops {
        if let (Some(Op::AckUpTo(_)), Op::AckUpTo(_)) = (out.last(), op) {
            out.pop();
        }
        out.push(op);
    }
    out
}

/// Settled deliveries behind a held front that make the acks go one by one at once, with
/// `batchers` batch inserts in flight, batches of `batch_size` and a window of `window`: half
/// the window, and more than the happy path ever settles ahead of the oldest batch, which is
/// the other batchers' whole batches and, with two batches a batcher in the window (the
/// default), all but the oldest batch (a batcher's second batch waits behind its first while
/// the others commit both of theirs). At half the window alone, four batches of 1,000 in a
/// window of 4,096 (the byte budget's cut) had three batches acked one by one each time the
/// oldest committed last (the balance bench); at `batchers - 1` batches, four batchers of 200
/// gave about 13 acks a batch (a review).
/// Never more than the window less the front: behind a held front no more can settle before the
/// broker stops delivering, and a point past it left the release to the next watchdog tick,
/// one window a second (review R38i F1: a window of 192 under 2 batchers of 1,000).
pub fn release_point(window: u16, batchers: usize, batch_size: usize) -> usize {
    let others = batchers.saturating_sub(1).saturating_mul(batch_size);
    let ahead = others.max(usize::from(window).saturating_sub(batch_size));
    let point = usize::from(window / 2).max(ahead + 1);
    point.min(usize::from(window).saturating_sub(1)).max(1)
}

/// The acks of one channel generation: the tracker, and the task that executes its operations
/// in order.
pub struct Acker {
    tracker: AckTracker,
    /// Settled deliveries behind a held front that make the acks go one by one at once: half
    /// the prefetch window, and more than the batches that may commit ahead of the front's
    /// (the happy path never has that many ahead of it).
    release_at: usize,
    /// The held front seen at the last tick: still held at this one, it releases what waits.
    held: Option<u64>,
    /// Work for the executor task; `None` once closing.
    ops: Option<mpsc::UnboundedSender<Work>>,
    /// The stage whose deliveries these are: the labels of its logs and its ack counter.
    stage: StageId,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Acker {
    /// Starts the executor for `channel`, whose consumer has a window of `prefetch`; `copies`
    /// is its stage's memory of copies and the channel's generation, for the proofs.
    pub fn open(
        channel: Channel,
        stage: StageId,
        prefetch: u16,
        copies: (Arc<Copies>, u64),
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            tracker: AckTracker::default(),
            release_at: usize::from(prefetch / 2).max(1),
            held: None,
            ops: Some(tx),
            task: Some(tokio::spawn(run_ops(channel, rx, stage.clone(), copies))),
            stage,
        }
    }

    /// The window of the channel's consumer changed (balancing, the byte budget), or the
    /// batch inserts in flight: from now on the acks behind a held front go one by one past
    /// [`release_point`]. Left at the first window, a grown one would have its second batch
    /// acked one by one.
    pub fn set_window(&mut self, window: u16, batchers: usize, batch_size: usize) {
        self.release_at = release_point(window, batchers, batch_size);
    }

    /// Records deliveries (tags grow on a channel).
    pub fn delivered(&mut self, tags: impl Iterator<Item = u64>) {
        for tag in tags {
            if !self.tracker.delivered(tag) {
                warn!(
                    pipeline = self.stage.pipeline(),
                    stage = self.stage.stage().as_str(),
                    tag,
                    "a delivery came after a later one; recorded in its place (its ack waits for it)"
                );
            }
        }
    }

    /// A delivery the consumer holds aside for long, unsettled (a body over `MAX_MESSAGE_BYTES`
    /// waiting for its turn): what settles behind it is acked one by one at once, never held
    /// for it. Its own settlement comes later as any other's.
    pub fn aside(&mut self, tag: u64) {
        self.tracker.aside(tag);
        if self.tracker.front_aside() {
            let mut ops = Vec::new();
            self.tracker.release(&mut ops);
            self.send(ops);
        }
    }

    /// Settles deliveries and sends the operations that became possible; past the release
    /// point settled behind a held front, or behind a delivery held aside, those are acked
    /// one by one.
    pub fn settle(&mut self, items: &[(u64, Disposition)]) {
        let mut ops = Vec::new();
        for (tag, disposition) in items {
            self.tracker.settle(*tag, *disposition, &mut ops);
        }
        if self.tracker.waiting() >= self.release_at || self.tracker.front_aside() {
            self.tracker.release(&mut ops);
        }
        self.send(ops);
    }

    /// Once per watchdog tick: a front held since the last tick releases what waits behind it.
    pub fn tick(&mut self) {
        let front = self.tracker.held_front();
        if front.is_some() && front == self.held {
            let mut ops = Vec::new();
            self.tracker.release(&mut ops);
            self.send(ops);
        }
        self.held = front;
    }

    fn send(&self, ops: Vec<Op>) {
        if !ops.is_empty()
            && let Some(tx) = &self.ops
        {
            let _ = tx.send(Work::Ops(ops));
        }
    }

    /// Answers once every operation settled so far was sent on the channel (or the channel
    /// failed, or the acks closed): a frame sent on the channel after the answer reaches the
    /// broker after them. A lifted subscription waits for it, so that the bodies it gave back
    /// are in the queue before it takes its window of one (`consumer/oversize.rs`).
    pub fn sent(&self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        if let Some(ops) = &self.ops {
            let _ = ops.send(Work::Sent(tx));
        }
        rx
    }

    /// Waits until every operation sent so far was executed (or the channel failed).
    pub async fn close(mut self) {
        drop(self.ops.take());
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// Executes channel operations in order; stops at the first failure (the channel is gone and
/// the broker requeues whatever was not acked). After operations that acked a copy's original
/// not yet proven handled, a fence proves it (see the module doc). The fence runs beside the
/// operations, one at a time, and never holds them up: a broker slow to answer (or a link whose
/// answers are held) still gets every ack at once, and a drain never waits for a proof.
async fn run_ops(
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Work>,
    stage: StageId,
    (copies, generation): (Arc<Copies>, u64),
) {
    let acks = crate::metrics::acks_counter(&stage);
    // Every tag up to `upto` is acked; `ones` were acked alone since the last fence began.
    let (mut upto, mut ones) = (0u64, Vec::new());
    // Answers of fences: the acks they prove (every tag up to .., and those acked alone).
    let (proofs_tx, mut proofs) = mpsc::unbounded_channel::<(lapin::Result<()>, u64, Vec<u64>)>();
    let mut fencing = false;
    loop {
        let mut sent = Vec::new();
        let mut ops = tokio::select! {
            work = rx.recv() => match work {
                Some(Work::Ops(ops)) => ops,
                Some(Work::Sent(answer)) => {
                    sent.push(answer);
                    Vec::new()
                }
                None => return,
            },
            Some((answer, proven_upto, proven_ones)) = proofs.recv() => {
                fencing = false;
                match answer {
                    Ok(()) => copies.prove(generation, proven_upto, &proven_ones),
                    // The channel is gone: those copies stay unproven, and the link's end
                    // makes them candidates for their redeliveries.
                    Err(e) => debug!(pipeline = stage.pipeline(), stage = stage.stage().as_str(), error = %e,
                        "a fence was not answered; its acks stay unproven"),
                }
                Vec::new()
            }
        };
        while let Ok(more) = rx.try_recv() {
            match more {
                Work::Ops(more) => ops.extend(more),
                Work::Sent(answer) => sent.push(answer),
            }
        }
        for op in coalesce(ops) {
            let result = match op {
                Op::AckUpTo(tag) => {
                    acks.increment(1);
                    upto = upto.max(tag);
                    channel
                        .basic_ack(tag, BasicAckOptions { multiple: true })
                        .await
                }
                Op::AckOne(tag) => {
                    acks.increment(1);
                    ones.push(tag);
                    channel
                        .basic_ack(tag, BasicAckOptions { multiple: false })
                        .await
                }
                Op::Requeue(tag) => {
                    channel
                        .basic_nack(
                            tag,
                            BasicNackOptions {
                                multiple: false,
                                requeue: true,
                            },
                        )
                        .await
                }
            };
            if let Err(e) = result {
                warn!(pipeline = stage.pipeline(), stage = stage.stage().as_str(), error = %e, "cannot ack on this channel any more; the broker will redeliver");
                return;
            }
        }
        // Every operation given before these was sent.
        for answer in sent {
            let _ = answer.send(());
        }
        if copies.none_unproven() {
            // Nothing registered later can be among them: its ack comes after.
            ones.clear();
        } else if !fencing && copies.provable(generation, upto, &ones) {
            fencing = true;
            let (channel, tx, ones) = (
                channel.clone(),
                proofs_tx.clone(),
                std::mem::take(&mut ones),
            );
            tokio::spawn(async move {
                let answer = fence(&channel).await;
                let _ = tx.send((answer, upto, ones));
            });
        }
    }
}

/// A synchronous round trip on `channel` that changes nothing: a passive declare of
/// `amq.direct`, which every virtual host has and nobody can delete. Its answer comes after the
/// broker handled every frame sent before it on the channel.
async fn fence(channel: &Channel) -> lapin::Result<()> {
    channel
        .exchange_declare(
            "amq.direct".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(n: u64) -> AckTracker {
        let mut t = AckTracker::default();
        for tag in 1..=n {
            t.delivered(tag);
        }
        t
    }

    #[test]
    fn in_order_acks_become_one_multi_ack_per_settle() {
        let mut t = tracker(3);
        let mut ops = Vec::new();
        t.settle(1, Disposition::Ack, &mut ops);
        t.settle(2, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(1), Op::AckUpTo(2)]);
        assert_eq!(coalesce(ops), [Op::AckUpTo(2)]);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_gap_holds_later_acks_until_it_is_filled() {
        let mut t = tracker(4);
        let mut ops = Vec::new();
        for tag in [2, 3, 4] {
            t.settle(tag, Disposition::Ack, &mut ops);
        }
        assert!(ops.is_empty());
        t.settle(1, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(4)]);
        assert!(t.is_empty());
    }

    #[test]
    fn nacks_go_out_at_once_and_before_the_multi_ack_that_passes_them() {
        let mut t = tracker(3);
        let mut ops = Vec::new();
        t.settle(2, Disposition::Requeue, &mut ops);
        t.settle(3, Disposition::Requeue, &mut ops);
        assert_eq!(ops, [Op::Requeue(2), Op::Requeue(3)]);
        t.settle(1, Disposition::Ack, &mut ops);
        // The multi-ack names tag 1, the last acked one: 2 and 3 are already gone.
        assert_eq!(ops.last(), Some(&Op::AckUpTo(1)));
        assert!(t.is_empty());
    }

    #[test]
    fn a_held_front_releases_what_waits_behind_it_one_by_one() {
        let mut t = tracker(6);
        let mut ops = Vec::new();
        for tag in [2, 3, 5] {
            t.settle(tag, Disposition::Ack, &mut ops);
        }
        t.settle(4, Disposition::Requeue, &mut ops);
        assert_eq!(ops, [Op::Requeue(4)]);
        assert_eq!((t.held_front(), t.waiting()), (Some(1), 3));
        ops.clear();
        t.release(&mut ops);
        assert_eq!(ops, [Op::AckOne(2), Op::AckOne(3), Op::AckOne(5)]);
        assert_eq!(t.waiting(), 0);
        // Settled later behind the same front: released on the next call, never twice.
        ops.clear();
        t.settle(6, Disposition::Ack, &mut ops);
        t.release(&mut ops);
        assert_eq!(ops, [Op::AckOne(6)]);
        // The front settles: nothing left to name in a multi-ack but the front itself.
        ops.clear();
        t.settle(1, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(1)]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_multi_ack_never_names_a_tag_already_acked_alone() {
        let mut t = tracker(4);
        let mut ops = Vec::new();
        t.settle(2, Disposition::Ack, &mut ops);
        t.release(&mut ops);
        t.settle(3, Disposition::Ack, &mut ops);
        ops.clear();
        t.settle(1, Disposition::Ack, &mut ops);
        // 1..3 settle; 2 went alone, so the multi-ack names 3 (still unacked at the broker).
        assert_eq!(ops, [Op::AckUpTo(3)]);
        ops.clear();
        t.settle(4, Disposition::Requeue, &mut ops);
        assert_eq!(ops, [Op::Requeue(4)]);
        assert!(t.is_empty());
    }

    #[test]
    fn the_release_point_is_past_what_the_happy_path_settles_ahead() {
        // Defaults: 2 batchers of 1,000 in a window of 4,000: all but the oldest batch.
        assert_eq!(release_point(4000, 2, 1000), 3001);
        // The byte budget's cap under 4 batchers: three whole batches may be ahead.
        assert_eq!(release_point(4096, 4, 1000), 3097);
        // A window smaller than the batchers' batches: all of it but the front (no more can
        // settle behind a held front; review R38i F1: past it, one window a tick).
        assert_eq!(release_point(1000, 8, 500), 999);
        assert_eq!(release_point(192, 2, 1000), 191);
        // A window smaller than a batch: half of it.
        assert_eq!(release_point(100, 1, 1000), 50);
        // A window of one: its one delivery.
        assert_eq!(release_point(1, 2, 1000), 1);
    }

    /// Review R38i F1: behind a delivery held aside (a body over the limit waiting for its
    /// turn), what settles is acked one by one at once, whatever the release point; the
    /// aside one settles later as any other.
    #[test]
    fn what_settles_behind_a_delivery_held_aside_is_acked_at_once() {
        let mut t = tracker(5);
        let mut ops = Vec::new();
        t.settle(2, Disposition::Ack, &mut ops);
        t.aside(1);
        assert!(t.front_aside());
        assert_eq!(t.held_front(), Some(1));
        t.release(&mut ops);
        assert_eq!(ops, [Op::AckOne(2)]);
        ops.clear();
        // A front settling in front of an aside one: the multi-ack stops before it.
        let mut t = tracker(5);
        t.aside(3);
        assert!(!t.front_aside());
        t.settle(1, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(1)]);
        t.settle(4, Disposition::Ack, &mut ops);
        t.settle(2, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(1), Op::AckUpTo(2)]);
        assert!(t.front_aside());
        ops.clear();
        t.release(&mut ops);
        assert_eq!(ops, [Op::AckOne(4)]);
        // The aside one settles (given back): nothing acked twice, the rest goes on.
        ops.clear();
        t.settle(3, Disposition::Requeue, &mut ops);
        t.settle(5, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::Requeue(3), Op::AckUpTo(5)]);
        assert!(t.is_empty());
        // Marking a settled or unknown tag changes nothing.
        let mut t = tracker(2);
        t.settle(1, Disposition::Ack, &mut ops);
        t.aside(1);
        t.aside(9);
        assert!(!t.front_aside());
    }

    #[test]
    fn a_delivery_out_of_tag_order_is_found_when_it_settles() {
        // Found by the balance bench: a chunk of a cancelled subscription handed on after the
        // first chunk of the next one was appended behind it, its settlements were not found
        // (a binary search over a deque out of order), the front waited on it for ever, and
        // every later ack went one by one.
        let mut t = AckTracker::default();
        assert!(t.delivered(5));
        assert!(t.delivered(6));
        assert!(!t.delivered(3));
        assert!(!t.delivered(4));
        assert!(!t.delivered(4), "a repeat is recorded once");
        let mut ops = Vec::new();
        for tag in [5, 6, 4] {
            t.settle(tag, Disposition::Ack, &mut ops);
        }
        assert!(ops.is_empty(), "3 holds the front: {ops:?}");
        t.settle(3, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::AckUpTo(6)]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_run_of_nacks_only_produces_no_ack_and_repeats_are_ignored() {
        let mut t = tracker(2);
        let mut ops = Vec::new();
        t.settle(1, Disposition::Requeue, &mut ops);
        t.settle(1, Disposition::Ack, &mut ops);
        t.settle(9, Disposition::Ack, &mut ops);
        assert_eq!(ops, [Op::Requeue(1)]);
        assert_eq!(t.len(), 1);
    }
}
