//! The one get -> publish with confirm -> ack loop (`warren move`, `warren dlq replay`): messages
//! taken from a queue with `basic.get`, a window at a time; a copy of each that the [`Route`]
//! wants sent is published, the window's copies as one group with publisher confirms; the
//! originals are acked only once every copy of their window is confirmed. What the route leaves,
//! and a window whose copies did not all make it, go back to the queue.

use std::future::Future;
use std::time::Duration;

use lapin::message::BasicGetMessage;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use crate::amqp::AmqpError;
use crate::amqp::publisher::{Publish, publish_group};

/// The per-message decision of a transfer, and what it hears on the way.
pub trait Route {
    /// The copy to publish for `m` (take its body: it is not read again), or `None` to leave
    /// `m` in the queue.
    fn route(&mut self, m: &mut BasicGetMessage) -> Option<Publish>;

    /// Called after each window whose copies were published (confirmed or not, acked or not),
    /// with the counts so far: a progress report. Nothing by default.
    fn published(&mut self, _tally: &Tally) {}
}

/// A closure is a route that reports nothing.
impl<F: FnMut(&mut BasicGetMessage) -> Option<Publish>> Route for F {
    fn route(&mut self, m: &mut BasicGetMessage) -> Option<Publish> {
        self(m)
    }
}

/// What to take, and how.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    /// The queue the messages are taken from.
    pub queue: &'a str,
    /// Take at most this many: at most the queue's depth at the start, so that copies routed
    /// back into the same queue are not taken again.
    pub take: u64,
    /// Publish at most this many copies (confirmed or not); `None`: as many as `take` allows.
    pub publish: Option<u64>,
    /// Messages taken, and copies awaiting their confirms, at once (at least 1).
    pub window: usize,
    /// Bound on a window's confirms.
    pub confirm_timeout: Duration,
    /// Bound on a window's `basic.get`s; `None` waits as long as the broker takes.
    pub get_timeout: Option<Duration>,
    /// The publishing link's frame limit: a copy whose content header exceeds it is not sent.
    pub frame_max: u32,
}

impl Plan<'_> {
    /// How many messages the next window takes, given the counts so far (0: done).
    fn next_window(&self, tally: &Tally) -> u64 {
        let by_publish = self
            .publish
            .map_or(u64::MAX, |limit| limit.saturating_sub(tally.published()));
        self.take
            .saturating_sub(tally.taken)
            .min(by_publish)
            .min(self.window as u64)
    }
}

/// What a transfer did.
#[derive(Debug, Default)]
pub struct Tally {
    /// Messages taken from the queue.
    pub taken: u64,
    /// Copies confirmed whose originals were acked: transferred for good.
    pub acked: u64,
    /// Copies confirmed whose originals were not acked (the ack failed, or another copy of
    /// their window failed): the message is in both places.
    pub unacked: u64,
    /// Copies not confirmed (nacked, unroutable, timed out, not sent): their originals stay.
    pub failed: u64,
    /// Messages the route left in the queue.
    pub skipped: u64,
    /// Why the transfer stopped early, if it did: it stops at the first failure.
    pub stopped: Option<Stop>,
    /// Whether the stop token ended it.
    pub interrupted: bool,
}

impl Tally {
    /// Copies published, confirmed or not.
    pub fn published(&self) -> u64 {
        self.acked + self.unacked + self.failed
    }
}

/// Why a transfer stopped early. Nothing taken and not acked is lost: it returns to the queue
/// (by a nack, or when the channel closes).
#[derive(Debug)]
pub enum Stop {
    /// `basic.get` failed.
    Get(lapin::Error),
    /// `basic.get` did not answer within [`Plan::get_timeout`].
    GetTimeout(Duration),
    /// A copy was not confirmed, so no original of its window was acked.
    NotPublished {
        /// The first such copy's message: its id, or its delivery tag.
        message_id: String,
        /// Why its copy was not confirmed.
        error: AmqpError,
        /// Messages taken in its window (all of them stay in the queue).
        window: usize,
        /// Copies of the window confirmed nevertheless: those messages are in both places.
        confirmed: usize,
    },
    /// Copies were confirmed but their originals could not be acked.
    NotAcked {
        /// The first original not acked: its id, or its delivery tag.
        message_id: String,
        /// How many originals were not acked.
        count: usize,
        /// Why.
        error: AckError,
    },
    /// What the transfer left unacked could not be nacked back to the queue (closing the
    /// channel, which follows, returns it).
    NotReturned(lapin::Error),
}

/// Why an ack failed.
#[derive(Debug, thiserror::Error)]
pub enum AckError {
    /// The channel closed before the ack (lapin refuses it: the broker returns the message).
    #[error("the channel is closed")]
    Closed,
    /// The ack itself failed.
    #[error(transparent)]
    Failed(lapin::Error),
}

/// Why a transfer could not start: nothing was taken.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A channel could not be opened.
    #[error(transparent)]
    Channel(lapin::Error),
    /// The publishing channel refused confirm mode.
    #[error("cannot put the publishing channel in confirm mode")]
    ConfirmMode(#[source] lapin::Error),
}

/// Takes messages from `plan.queue` on a channel of `conn`, window by window, and publishes
/// the copies `route` makes on a second channel, in confirm mode; each window's originals are
/// acked once all its copies are confirmed. It ends when the queue is empty, [`Plan::take`] or
/// [`Plan::publish`] is reached, at the first failure ([`Tally::stopped`]), or at `stop`
/// (which also ends a wait for the queue: what that window took returns to the queue). A window
/// being published finishes first (its publishes and its ack are bounded): stopping in its
/// middle would leave its copies in both places. At the end, what the route left and a failed
/// window are nacked back to the queue with one `multiple` nack, and both channels close
/// (which returns anything else still unacked).
pub async fn transfer(
    conn: &Connection,
    plan: &Plan<'_>,
    route: &mut impl Route,
    stop: &CancellationToken,
) -> Result<Tally, OpenError> {
    let get = conn.create_channel().await.map_err(OpenError::Channel)?;
    let publish = conn.create_channel().await.map_err(OpenError::Channel)?;
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(OpenError::ConfirmMode)?;
    let mut tally = Tally::default();
    // The highest delivery tag left unacked on `get` (left by the route, or in a failed window).
    let mut held: Option<u64> = None;
    while tally.stopped.is_none() {
        let want = plan.next_window(&tally);
        if want == 0 {
            break;
        }
        if stop.is_cancelled() {
            tally.interrupted = true;
            break;
        }
        let taken = tokio::select! {
            taken = within(plan.get_timeout, take(&get, plan.queue, want as usize)) => taken,
            _ = stop.cancelled() => {
                tally.interrupted = true;
                break;
            }
        };
        let window = match taken {
            Ok(Ok(w)) if w.is_empty() => break,
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                tally.stopped = Some(Stop::Get(e));
                break;
            }
            Err(bound) => {
                tally.stopped = Some(Stop::GetTimeout(bound));
                break;
            }
        };
        let size = window.len();
        tally.taken += size as u64;
        let last_tag = window.last().map(|m| m.delivery.delivery_tag);
        let mut copies = Vec::with_capacity(size);
        let mut originals = Vec::with_capacity(size);
        for mut m in window {
            match route.route(&mut m) {
                Some(copy) => {
                    copies.push(copy);
                    originals.push(m);
                }
                None => {
                    tally.skipped += 1;
                    held = held.max(Some(m.delivery.delivery_tag));
                }
            }
        }
        if copies.is_empty() {
            continue;
        }
        let results = publish_group(&publish, copies, plan.frame_max, plan.confirm_timeout).await;
        let confirmed = results.iter().filter(|r| r.is_ok()).count();
        let first_failure = results
            .into_iter()
            .enumerate()
            .find_map(|(i, r)| r.err().map(|e| (i, e)));
        if let Some((i, error)) = first_failure {
            tally.unacked += confirmed as u64;
            tally.failed += (originals.len() - confirmed) as u64;
            held = held.max(last_tag);
            tally.stopped = Some(Stop::NotPublished {
                message_id: message_id(&originals[i]),
                error,
                window: size,
                confirmed,
            });
        } else {
            match ack(&originals, held.is_none()).await {
                Ok(()) => tally.acked += originals.len() as u64,
                Err((acked, error)) => {
                    tally.acked += acked as u64;
                    tally.unacked += (originals.len() - acked) as u64;
                    tally.stopped = Some(Stop::NotAcked {
                        message_id: message_id(&originals[acked]),
                        count: originals.len() - acked,
                        error,
                    });
                }
            }
        }
        route.published(&tally);
    }
    let returned = give_back(&get, held).await;
    let _ = publish.close(200, "bye".into()).await;
    let _ = get.close(200, "bye".into()).await;
    if let Err(e) = returned
        && tally.stopped.is_none()
    {
        tally.stopped = Some(Stop::NotReturned(e));
    }
    Ok(tally)
}

/// `work`, within `bound` when there is one; `Err(bound)` when it did not finish in time.
async fn within<T>(bound: Option<Duration>, work: impl Future<Output = T>) -> Result<T, Duration> {
    match bound {
        Some(bound) => tokio::time::timeout(bound, work).await.map_err(|_| bound),
        None => Ok(work.await),
    }
}

/// Up to `n` messages of `queue`, unacked on `channel`; fewer when it runs empty.
async fn take(
    channel: &Channel,
    queue: &str,
    n: usize,
) -> Result<Vec<BasicGetMessage>, lapin::Error> {
    let mut window = Vec::with_capacity(n);
    while window.len() < n {
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await?
        {
            Some(m) => window.push(m),
            None => break,
        }
    }
    Ok(window)
}

/// Acks `originals` (in delivery order, all copies confirmed): with one `multiple` ack of the
/// last when `alone` (nothing else is unacked on the channel before them), else one by one, so
/// that what the route left stays unacked. `Err`: how many were acked before the failure, and
/// why.
async fn ack(originals: &[BasicGetMessage], alone: bool) -> Result<(), (usize, AckError)> {
    let settled = |acked: lapin::Result<bool>| match acked {
        Ok(true) => Ok(()),
        Ok(false) => Err(AckError::Closed),
        Err(e) => Err(AckError::Failed(e)),
    };
    if alone {
        let Some(last) = originals.last() else {
            return Ok(());
        };
        let acked = last
            .delivery
            .acker
            .ack(BasicAckOptions { multiple: true })
            .await;
        return settled(acked).map_err(|e| (0, e));
    }
    for (i, m) in originals.iter().enumerate() {
        settled(m.delivery.acker.ack(BasicAckOptions::default()).await).map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Returns every message still unacked on `channel` up to `last_tag` to its queue: one nack
/// with `multiple` and `requeue`.
pub async fn give_back(channel: &Channel, last_tag: Option<u64>) -> Result<(), lapin::Error> {
    match last_tag {
        Some(tag) => {
            channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await
        }
        None => Ok(()),
    }
}

/// How a failure names a message: its id, or its delivery tag when it has none.
fn message_id(m: &BasicGetMessage) -> String {
    m.delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|| format!("(no message id, delivery {})", m.delivery.delivery_tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(take: u64, publish: Option<u64>, window: usize) -> Plan<'static> {
        Plan {
            queue: "q",
            take,
            publish,
            window,
            confirm_timeout: Duration::from_secs(1),
            get_timeout: None,
            frame_max: 0,
        }
    }

    #[test]
    fn windows_stop_at_the_depth_the_limit_and_the_window_size() {
        // `warren move`: the budget is the depth or less, in windows of `--in-flight`.
        let moving = plan(150, None, 64);
        let mut tally = Tally::default();
        assert_eq!(moving.next_window(&tally), 64);
        tally.taken = 128;
        tally.acked = 128;
        assert_eq!(moving.next_window(&tally), 22, "the last window is short");
        tally.taken = 150;
        tally.acked = 150;
        assert_eq!(moving.next_window(&tally), 0);

        // `warren dlq replay`: one at a time; skipped messages count against the depth only,
        // failed and unacked copies against the limit too.
        let replaying = plan(10, Some(2), 1);
        let mut tally = Tally {
            taken: 5,
            skipped: 4,
            acked: 1,
            ..Tally::default()
        };
        assert_eq!(replaying.next_window(&tally), 1);
        tally.failed = 1;
        assert_eq!(
            replaying.next_window(&tally),
            0,
            "the limit counts failed copies"
        );
        tally.failed = 0;
        tally.unacked = 1;
        assert_eq!(replaying.next_window(&tally), 0, "and unacked ones");
        let tally = Tally {
            taken: 10,
            skipped: 10,
            ..Tally::default()
        };
        assert_eq!(replaying.next_window(&tally), 0, "never beyond the depth");
    }
}
