//! What the stages send each other, in flow order. Deliveries travel in chunks (what the broker
//! pushed, up to a bound), decoded records in the same chunks, settlements per batch: a hop
//! between stages is paid per chunk, not per message.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use actix::prelude::*;
use lapin::BasicProperties;

use crate::amqp::held::HeldProperties;

use crate::db::ErrorClass;
use crate::domain::{ErrorKind, Rejection};

/// One delivery, as the broker gave it. The body and properties move, never cloned, until the
/// message is settled (a retry or dead-letter republishes them).
#[derive(Debug)]
pub struct Delivery {
    /// Channel generation, so the settlement reaches only the channel that delivered it.
    pub generation: u64,
    pub tag: u64,
    pub redelivered: bool,
    /// Shared with a republished copy (retry, dead letter), never copied.
    pub body: bytes::Bytes,
    /// A small header table packed (`amqp::held`): `bare()` reads no header, `full()` all.
    pub properties: HeldProperties,
    /// When it was published (`headers::published_ms`), read at receipt: every acked message's
    /// end-to-end latency is measured from it without reading its headers again.
    pub published_ms: Option<u64>,
    /// The exchange and routing key the broker delivered it with: where it was published (a
    /// copy of warren's names its original's in headers, `amqp::headers::origin`).
    pub exchange: lapin::types::ShortString,
    pub routing_key: lapin::types::ShortString,
    /// What it holds in memory, counted against `MAX_INFLIGHT_BYTES`: the body and its
    /// properties as parsed (`headers::parsed_bytes`), reckoned once at receipt.
    pub held_bytes: u64,
    /// When warren received it (one clock read per chunk): the broker's `consumer_timeout`
    /// counts from about then, so a stage holding it long gives it back in time (`sink.rs`).
    pub received_at: Instant,
    /// What its decoded record holds, counted against `MAX_INFLIGHT_BYTES` from the decode to
    /// the end of its batch's statement (the processor sets it, the sink releases it).
    pub decoded: Charge,
}

impl Delivery {
    /// A delivery as lapin gave it: what it holds reckoned, when it was published read, its
    /// header table packed.
    pub fn new(generation: u64, d: lapin::message::Delivery, received_at: Instant) -> Self {
        let held_bytes = (d.data.len() + crate::amqp::headers::parsed_bytes(&d.properties)) as u64;
        Self {
            generation,
            tag: d.delivery_tag,
            redelivered: d.redelivered,
            held_bytes,
            published_ms: crate::amqp::headers::published_ms(&d.properties),
            body: d.data.into(),
            properties: HeldProperties::new(d.properties),
            exchange: d.exchange,
            routing_key: d.routing_key,
            received_at,
            decoded: Default::default(),
        }
    }

    /// What the domain reads besides the body, `properties` as it needs them: every one
    /// (`HeldProperties::full`) or all but the header table.
    pub fn envelope<'a>(&'a self, properties: &'a BasicProperties) -> crate::domain::Envelope<'a> {
        crate::domain::Envelope {
            properties,
            exchange: self.exchange.as_str(),
            routing_key: self.routing_key.as_str(),
        }
    }

    /// The AMQP message id, for logs (`-` when the publisher set none).
    pub fn message_id(&self) -> &str {
        self.properties
            .bare()
            .message_id()
            .as_ref()
            .map(|m| m.as_str())
            .unwrap_or("-")
    }
}

/// Consumer -> processor: deliveries of one channel generation, in delivery order, all for the
/// batcher `batcher` (so a batch fills in one place).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Chunk {
    pub batcher: usize,
    pub deliveries: Vec<Delivery>,
}

/// The memory a stage's decoded records hold: the processors add each record's bytes as they
/// decode it, the sink releases them once its batch's statement ended (before it settles), and
/// the consumer counts them in its byte budget. A record can hold many times its body: a
/// message of 12 KB whose array gives 1,000 child rows decodes to some 260 KB, and a budget
/// that counted bodies alone let 4,000 of them take a process to 1 GB (review R36e F9).
#[derive(Debug, Default)]
pub struct DecodedBytes {
    /// Bytes of the records alive now.
    live: AtomicU64,
    /// The largest delivery decoded since the consumer last looked, its body, properties and
    /// record together: the consumer's window is cut to what the budget holds of it.
    largest: AtomicU64,
    /// Deliveries the processors have decoded (accepted or refused): the consumer compares it
    /// with what it handed them before it opens a window.
    done: AtomicU64,
}

impl DecodedBytes {
    /// Bytes of the records alive now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// The largest delivery decoded since the last call (0 if none), and forgets it.
    pub fn take_largest(&self) -> u64 {
        self.largest.swap(0, Ordering::AcqRel)
    }

    /// Deliveries the processors have decoded so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// `n` more deliveries decoded (their charges taken).
    pub fn decoded(&self, n: usize) {
        self.done.fetch_add(n as u64, Ordering::AcqRel);
    }

    /// Reserves `estimate` bytes for a record about to be decoded, when the records alive leave
    /// room under `limit` for it, or none are alive (one always goes): answers whether it did.
    /// Atomic, so several processors never pass the check together on the same room (review
    /// R38g F2: four processors each decoded a message of 17 MB of rows past the budget).
    /// [`DecodedBytes::unreserve`] gives it back once the record is charged.
    pub fn reserve(&self, estimate: u64, limit: u64) -> bool {
        let before = self.live.fetch_add(estimate, Ordering::AcqRel);
        if before == 0 || before.saturating_add(estimate) <= limit {
            return true;
        }
        self.live.fetch_sub(estimate, Ordering::AcqRel);
        false
    }

    /// Gives back a reservation ([`DecodedBytes::reserve`]).
    pub fn unreserve(&self, estimate: u64) {
        self.live.fetch_sub(estimate, Ordering::AcqRel);
    }

    /// Counts a record of `bytes` decoded from a delivery holding `held` bytes; the returned
    /// charge gives them back when released or dropped.
    pub fn charge(self: &Arc<Self>, bytes: u64, held: u64) -> Charge {
        self.largest.fetch_max(held + bytes, Ordering::AcqRel);
        if bytes == 0 {
            return Charge::default();
        }
        self.live.fetch_add(bytes, Ordering::AcqRel);
        Charge(Some((self.clone(), bytes)))
    }
}

/// One delivery's share of its stage's [`DecodedBytes`]: released once, by the sink when its
/// record is dropped, or by whoever drops the delivery first.
#[derive(Debug, Default)]
pub struct Charge(Option<(Arc<DecodedBytes>, u64)>);

impl Charge {
    /// Gives the bytes back (once).
    pub fn release(&mut self) {
        if let Some((counter, bytes)) = self.0.take() {
            counter.live.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// One delivery and what the domain made of its body.
#[derive(Debug)]
pub struct Decoded<R> {
    pub delivery: Delivery,
    pub result: Result<R, Rejection>,
}

/// Processor -> batcher: a decoded chunk.
#[derive(Debug)]
pub struct Processed<R>(pub Vec<Decoded<R>>);

impl<R: 'static> Message for Processed<R> {
    type Result = ();
}

/// Batcher -> sink: one batch to insert and settle. The sink answers when the batch is settled,
/// which is the batcher's signal that its sink is free again.
#[derive(Debug)]
pub struct Batch<R> {
    /// `pipeline-batcher-n`, for logs.
    pub id: String,
    pub entries: Vec<Decoded<R>>,
}

impl<R: 'static> Message for Batch<R> {
    type Result = ();
}

/// Why the sink did not insert a message.
#[derive(Debug, Clone)]
pub enum Failure {
    /// Refused before or by the database for the message itself (`x-error-kind`): the domain
    /// refused the body, or its id is stored with other content.
    Refused { kind: ErrorKind, reason: String },
    /// The insert failed with a database error of this class.
    Db {
        class: ErrorClass,
        /// The server answered with an error (as opposed to no database at all).
        server_answered: bool,
        /// Formatted once per failing group.
        reason: Arc<str>,
    },
    /// Not decided yet: a redelivery to ask of the table of a stage a reload replaced, which
    /// was locked (`predecessors::settled_before`). Asked again once it comes back through the
    /// retry queue (or the DLQ, for a DLQ stage), its retries not counted: given back to the
    /// head of its queue it filled the window again at once and held the live pipeline for as
    /// long as the lock lasted, and a quorum queue counted each give-back towards its delivery
    /// limit (review R46a F7, F8).
    Waits { reason: Arc<str> },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused { kind, reason } => write!(f, "{kind}: {reason}"),
            Failure::Db { reason, .. } | Failure::Waits { reason } => f.write_str(reason),
        }
    }
}

/// Sink -> fallback stage (`router.rs` or `dlq.rs`): the messages of a batch that were not
/// inserted, each with why. Answered once every one of them is settled.
#[derive(Debug)]
pub struct Leftovers {
    pub batch_id: String,
    pub items: Vec<(Delivery, Failure)>,
}

impl Message for Leftovers {
    type Result = ();
}

/// How a delivery ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Done (inserted, or safely republished elsewhere): ack.
    Ack,
    /// Give it back to the queue (nack with requeue). warren never lets the broker dead-letter
    /// a delivery (a nack without requeue): RabbitMQ dead-letters at most once, and drops the
    /// message if the target is missing at that moment (review R38b-F1).
    Requeue,
}

/// Sink -> consumer: how deliveries of one channel generation ended (one per batch and
/// generation).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Settle {
    /// The channel generation the deliveries came from; settlements for an older one are
    /// dropped (the broker already requeued those messages).
    pub generation: u64,
    pub items: Vec<(u64, Disposition)>,
    /// The bytes these deliveries held, bodies and parsed properties (the consumer's byte
    /// budget frees them).
    pub bytes: u64,
    /// The prints of the deliveries acked (`acked.rs`): a reload's successor asks the old
    /// table about the redeliveries of those whose ack the broker may not have handled. Each
    /// with the stage incarnation that settled it when not this stage: a predecessor whose
    /// table or parking held it (`predecessors::settled_before`), to be asked again if this
    /// ack is lost too.
    pub acked: Vec<(super::acked::AckPrint, Option<u64>)>,
}

impl Settle {
    /// Groups deliveries and how each ended into one `Settle` per channel generation present
    /// (normally exactly one), in order.
    pub fn group<'a>(items: impl IntoIterator<Item = (&'a Delivery, Disposition)>) -> Vec<Settle> {
        Self::group_settled(
            items
                .into_iter()
                .map(|(d, disposition)| (d, disposition, None)),
        )
    }

    /// As [`Settle::group`], each delivery with the predecessor that settled it, if one did.
    pub fn group_settled<'a>(
        items: impl IntoIterator<Item = (&'a Delivery, Disposition, Option<u64>)>,
    ) -> Vec<Settle> {
        let mut out: Vec<Settle> = Vec::with_capacity(1);
        for (d, disposition, settled_by) in items {
            let bytes = d.held_bytes;
            let at = match out.iter().position(|s| s.generation == d.generation) {
                Some(at) => at,
                None => {
                    out.push(Settle {
                        generation: d.generation,
                        items: Vec::new(),
                        bytes: 0,
                        acked: Vec::new(),
                    });
                    out.len() - 1
                }
            };
            let s = &mut out[at];
            s.items.push((d.tag, disposition));
            s.bytes += bytes;
            if disposition == Disposition::Ack {
                s.acked.push((
                    super::acked::print(&d.body, d.properties.bare()),
                    settled_by,
                ));
            }
        }
        out
    }
}

/// Flush everything now: sent by the consumer through the processors to the batchers once no
/// more deliveries will come.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Drain;

/// Flush what waits now, once: a batcher taken out of the rotation by a scale-down
/// (`Dispatch::set_batchers`) hands its partial batch to its sink at once instead of at the batch
/// timeout. Sent by the consumer to every processor (`batcher` names the one), which forward it
/// after the chunks they hold, so it reaches the batcher after its last entries.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Flush {
    pub batcher: usize,
}

/// Why the consumer stops taking deliveries for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// The database keeps failing: the sink-outage breaker is open.
    Breaker,
    /// An operator asked for it (`warren ctl pause`).
    Operator,
}

/// Stop (`on = true`) or resume (`on = false`) taking deliveries for `reason`. Deliveries in
/// flight finish normally; the channel stays open so they can be acked.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Hold {
    pub reason: HoldReason,
    pub on: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(generation: u64, tag: u64, bytes: usize) -> Delivery {
        Delivery {
            generation,
            tag,
            redelivered: false,
            body: vec![b'x'; bytes].into(),
            properties: BasicProperties::default().into(),
            published_ms: None,
            exchange: Default::default(),
            routing_key: Default::default(),
            held_bytes: bytes as u64,
            received_at: Instant::now(),
            decoded: Default::default(),
        }
    }

    #[test]
    fn settlements_are_grouped_per_generation_in_order() {
        let (a, b, c) = (delivery(1, 5, 10), delivery(2, 1, 7), delivery(1, 6, 5));
        let groups = Settle::group([
            (&a, Disposition::Ack),
            (&b, Disposition::Requeue),
            (&c, Disposition::Ack),
        ]);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].generation, 1);
        assert_eq!(
            groups[0].items,
            [(5, Disposition::Ack), (6, Disposition::Ack)]
        );
        assert_eq!(groups[0].bytes, 15);
        assert_eq!(groups[1].items, [(1, Disposition::Requeue)]);
        assert_eq!(groups[1].bytes, 7);
    }

    /// Review R38g F2: the room under the budget is taken before decoding, atomically: of two
    /// processors asking at once for more than is left, one goes (always one, when nothing is
    /// held), the other waits until it is given back.
    #[test]
    fn a_reservation_takes_the_room_once() {
        let bytes = Arc::new(DecodedBytes::default());
        assert!(bytes.reserve(10, 4), "nothing held: one always goes");
        assert!(!bytes.reserve(1, 4), "no room left beside it");
        bytes.unreserve(10);
        assert_eq!(bytes.live(), 0);
        assert!(bytes.reserve(3, 4));
        assert!(bytes.reserve(1, 4));
        assert!(!bytes.reserve(1, 4));
        let charge = bytes.charge(2, 0);
        bytes.unreserve(4);
        assert_eq!(bytes.live(), 2);
        drop(charge);
        assert_eq!(bytes.live(), 0);
    }
}
