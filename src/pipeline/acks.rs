//! The acks of one channel: turns per-message settlements into as few channel operations as
//! possible, in an order the broker accepts (one `basic.ack multiple=true` for each contiguous
//! run of settled deliveries, requeues sent individually before any multi-ack that would cover
//! them), and executes them in order on one task per channel. There is no reject: the broker's
//! own dead-lettering is at-most-once, so warren never hands a message to it.

use std::collections::VecDeque;

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::mpsc;
use tracing::warn;

pub use super::message::Disposition;

/// A channel operation to perform, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `basic.ack(tag, multiple = true)`.
    AckUpTo(u64),
    /// `basic.nack(tag, multiple = false, requeue = true)`.
    Requeue(u64),
}

/// Outstanding deliveries of one channel, in delivery order.
#[derive(Debug, Default)]
pub struct AckTracker {
    /// (delivery tag, settled with Ack?) in delivery order; `None` while unsettled.
    outstanding: VecDeque<(u64, Option<bool>)>,
    /// Highest tag acked so far.
    acked: u64,
}

impl AckTracker {
    /// Records a delivery (tags grow on a channel).
    pub fn delivered(&mut self, tag: u64) {
        self.outstanding.push_back((tag, None));
    }

    /// Deliveries not settled yet.
    pub fn len(&self) -> usize {
        self.outstanding.len()
    }

    pub fn is_empty(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// Settles `tag` and appends the operations that become possible to `ops`.
    /// Unknown or already settled tags are ignored (never acked twice).
    pub fn settle(&mut self, tag: u64, disposition: Disposition, ops: &mut Vec<Op>) {
        let Ok(i) = self.outstanding.binary_search_by_key(&tag, |(t, _)| *t) else {
            return;
        };
        if self.outstanding[i].1.is_some() {
            return;
        }
        match disposition {
            Disposition::Ack => self.outstanding[i].1 = Some(true),
            Disposition::Requeue => {
                self.outstanding[i].1 = Some(false);
                ops.push(Op::Requeue(tag));
            }
        }
        let mut ack_to = None;
        while let Some((t, Some(acked))) = self.outstanding.front().copied() {
            if acked {
                ack_to = Some(t);
            }
            self.outstanding.pop_front();
        }
        if let Some(t) = ack_to {
            self.acked = t;
            ops.push(Op::AckUpTo(t));
        }
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

/// The acks of one channel generation: the tracker, and the task that executes its operations
/// in order.
pub struct Acker {
    tracker: AckTracker,
    /// Operations for the executor task; `None` once closing.
    ops: Option<mpsc::UnboundedSender<Vec<Op>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Acker {
    /// Starts the executor for `channel`.
    pub fn open(channel: Channel, pipeline: &'static str) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            tracker: AckTracker::default(),
            ops: Some(tx),
            task: Some(tokio::spawn(run_ops(channel, rx, pipeline))),
        }
    }

    /// Records deliveries (tags grow on a channel).
    pub fn delivered(&mut self, tags: impl Iterator<Item = u64>) {
        for tag in tags {
            self.tracker.delivered(tag);
        }
    }

    /// Settles deliveries and sends the operations that became possible.
    pub fn settle(&mut self, items: &[(u64, Disposition)]) {
        let mut ops = Vec::new();
        for (tag, disposition) in items {
            self.tracker.settle(*tag, *disposition, &mut ops);
        }
        if !ops.is_empty()
            && let Some(tx) = &self.ops
        {
            let _ = tx.send(ops);
        }
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
/// the broker requeues whatever was not acked).
async fn run_ops(
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Vec<Op>>,
    pipeline: &'static str,
) {
    let acks = crate::metrics::acks_counter(pipeline);
    while let Some(mut ops) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            ops.extend(more);
        }
        for op in coalesce(ops) {
            let result = match op {
                Op::AckUpTo(tag) => {
                    acks.increment(1);
                    channel
                        .basic_ack(tag, BasicAckOptions { multiple: true })
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
                warn!(pipeline, error = %e, "cannot ack on this channel any more; the broker will redeliver");
                return;
            }
        }
    }
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
