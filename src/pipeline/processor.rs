//! The processor stage: decodes and validates each delivery of a chunk through the domain and
//! hands the decoded chunk (records, or the reasons they were refused) to the batcher the
//! consumer chose. One processor decodes on the pipeline's own thread (decoding a user costs
//! about a microsecond, less than a hop to another thread); more run on threads of their own,
//! for domains whose decoding is dear (`Pipeline::processors`).
//!
//! **Decoding under the budget.** A record can hold many times its body (a child table's row per
//! element of an array), and the AMQP client receives a whole window of bodies before the
//! consumer can see what their records will hold: a window opened on small orders took 470
//! orders of 6,000 items, 370 MB of rows (review R38f F1). So a processor decodes the next
//! delivery only while the records its stage holds (`DecodedBytes`, released as their batches'
//! statements end) leave room under `MAX_INFLIGHT_BYTES` for what it may decode to (reserved
//! before, atomically, so several processors never pass on the same room), or none are held;
//! past it, what it was
//! handed waits, undecoded (its body already counted), the batcher it feeds is flushed so its
//! rows commit, and it looks again shortly. `Drain` and `Flush` keep their place behind the
//! chunks that wait.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::message::{Chunk, Decoded, DecodedBytes, Delivery, Drain, Flush, Processed};
use crate::domain::{Domain, Rejection};

/// How long a processor past the budget waits before it looks again.
const GATED_RETRY: Duration = Duration::from_millis(2);

/// What a processor was handed and has not handed on yet, in order.
enum Pending {
    /// The rest of a chunk, waiting for the decoded rows to fall under the budget.
    Chunk {
        batcher: usize,
        deliveries: VecDeque<Delivery>,
    },
    Drain,
    Flush(Flush),
}

/// The processor actor.
pub struct Processor<D: Domain> {
    domain: Arc<D>,
    /// Whether the domain reads the header table (`Domain::reads_headers`, asked once): a small
    /// one is rebuilt from its packed entries for each decode only then.
    reads_headers: bool,
    /// Bodies larger than this are refused unread.
    max_message_bytes: usize,
    /// The batchers, by the index a chunk names.
    batchers: Vec<Recipient<Processed<D::Record>>>,
    /// The same batchers, for the `Drain` marker that follows the chunks.
    drains: Vec<Recipient<Drain>>,
    /// The same batchers, for the `Flush` of one taken out by a scale-down.
    flushes: Vec<Recipient<Flush>>,
    /// The stage's count of decoded bytes, which the consumer's byte budget reads.
    decoded: Arc<DecodedBytes>,
    /// `MAX_INFLIGHT_BYTES`: no more decoding while the stage's records hold this much.
    limit: u64,
    /// What waits for room (empty in the steady state).
    waiting: VecDeque<Pending>,
    /// A look again is scheduled; the batcher of the waiting chunk was flushed this time.
    gated: (bool, bool),
}

impl<D: Domain> Processor<D> {
    pub fn new(
        domain: Arc<D>,
        max_message_bytes: usize,
        batchers: Vec<Recipient<Processed<D::Record>>>,
        drains: Vec<Recipient<Drain>>,
        flushes: Vec<Recipient<Flush>>,
        decoded: Arc<DecodedBytes>,
        limit: u64,
    ) -> Self {
        Self {
            reads_headers: domain.reads_headers(),
            domain,
            max_message_bytes,
            batchers,
            drains,
            flushes,
            decoded,
            limit,
            waiting: VecDeque::new(),
            gated: (false, false),
        }
    }

    /// Decodes one delivery: refused unread when its body is over the size limit.
    fn decode(&self, delivery: &Delivery) -> Result<D::Record, Rejection> {
        let body = &delivery.body;
        if body.len() > self.max_message_bytes {
            return Err(Rejection::payload(format!(
                "body of {} bytes exceeds MAX_MESSAGE_BYTES ({})",
                body.len(),
                self.max_message_bytes
            )));
        }
        let properties = if self.reads_headers {
            delivery.properties.full()
        } else {
            std::borrow::Cow::Borrowed(delivery.properties.bare())
        };
        self.domain
            .decode_with(body, &delivery.envelope(&properties))
    }

    /// Decodes one delivery and charges its record to the stage.
    fn decoded(&self, mut delivery: Delivery) -> Decoded<D::Record> {
        let result = self.decode(&delivery);
        if let Ok(record) = &result {
            let bytes = self.domain.record_bytes(record);
            delivery.decoded = self.decoded.charge(bytes, delivery.held_bytes);
        }
        Decoded { result, delivery }
    }

    /// Reserves room for `delivery`'s record under the budget ([`DecodedBytes::reserve`]): the
    /// estimate, to give back once it is charged; `None` while there is no room.
    fn room(&self, delivery: &Delivery) -> Option<u64> {
        let estimate = self.domain.record_estimate(delivery.body.len());
        self.decoded
            .reserve(estimate, self.limit)
            .then_some(estimate)
    }

    /// Hands on what waits, in order, as far as the budget lets it; past it, flushes the
    /// batcher the waiting chunk feeds (once) and looks again shortly.
    fn pump(&mut self, ctx: &mut Context<Self>) {
        while let Some(next) = self.waiting.pop_front() {
            match next {
                Pending::Chunk {
                    batcher,
                    mut deliveries,
                } => {
                    let index = batcher % self.batchers.len();
                    let mut out = Vec::new();
                    while let Some(delivery) = deliveries.pop_front() {
                        let Some(reserved) = self.room(&delivery) else {
                            deliveries.push_front(delivery);
                            break;
                        };
                        out.push(self.decoded(delivery));
                        self.decoded.unreserve(reserved);
                    }
                    if !out.is_empty() {
                        self.decoded.decoded(out.len());
                        self.batchers[index].do_send(Processed(out));
                    }
                    if deliveries.is_empty() {
                        self.gated.1 = false;
                        continue;
                    }
                    self.waiting.push_front(Pending::Chunk {
                        batcher,
                        deliveries,
                    });
                    if !self.gated.1 {
                        self.gated.1 = true;
                        if let Some(f) = self.flushes.get(index) {
                            f.do_send(Flush { batcher: index });
                        }
                    }
                    if !self.gated.0 {
                        self.gated.0 = true;
                        ctx.run_later(GATED_RETRY, |processor, ctx| {
                            processor.gated.0 = false;
                            processor.pump(ctx);
                        });
                    }
                    return;
                }
                Pending::Drain => {
                    for d in &self.drains {
                        d.do_send(Drain);
                    }
                }
                Pending::Flush(msg) => {
                    if let Some(f) = self.flushes.get(msg.batcher) {
                        f.do_send(msg);
                    }
                }
            }
        }
    }
}

impl<D: Domain> Actor for Processor<D> {
    type Context = Context<Self>;
}

impl<D: Domain> Supervised for Processor<D> {}

impl<D: Domain> Handler<Chunk> for Processor<D> {
    type Result = ();

    fn handle(&mut self, chunk: Chunk, ctx: &mut Self::Context) {
        self.waiting.push_back(Pending::Chunk {
            batcher: chunk.batcher,
            deliveries: chunk.deliveries.into(),
        });
        self.pump(ctx);
    }
}

impl<D: Domain> Handler<Drain> for Processor<D> {
    type Result = ();

    /// Forwarded behind everything this processor received before it (mailbox order, and the
    /// chunks that wait for room).
    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) {
        self.waiting.push_back(Pending::Drain);
        self.pump(ctx);
    }
}

impl<D: Domain> Handler<Flush> for Processor<D> {
    type Result = ();

    /// After the chunks this processor holds for that batcher (mailbox order, and the chunks
    /// that wait for room).
    fn handle(&mut self, msg: Flush, ctx: &mut Self::Context) {
        self.waiting.push_back(Pending::Flush(msg));
        self.pump(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::mapping::{Mapping, Row};
    use crate::pipeline::message::Delivery;
    use lapin::BasicProperties;
    use std::sync::Mutex;

    /// A probe in the batcher's place: records what reaches it.
    struct Probe(Arc<Mutex<Vec<(usize, bool)>>>, usize);

    impl Actor for Probe {
        type Context = Context<Self>;
    }

    impl Handler<Processed<Row>> for Probe {
        type Result = ();
        fn handle(&mut self, msg: Processed<Row>, _: &mut Self::Context) {
            let mut seen = self.0.lock().unwrap();
            for d in msg.0 {
                seen.push((self.1, d.result.is_ok()));
            }
        }
    }

    impl Handler<Drain> for Probe {
        type Result = ();
        fn handle(&mut self, _: Drain, _: &mut Self::Context) {
            self.0.lock().unwrap().push((self.1, false));
        }
    }

    impl Handler<Flush> for Probe {
        type Result = ();
        fn handle(&mut self, _: Flush, _: &mut Self::Context) {}
    }

    fn delivery(tag: u64, body: &[u8]) -> Delivery {
        Delivery {
            generation: 1,
            tag,
            redelivered: false,
            body: body.to_vec().into(),
            properties: BasicProperties::default().into(),
            published_ms: None,
            exchange: Default::default(),
            routing_key: Default::default(),
            held_bytes: body.len() as u64,
            received_at: std::time::Instant::now(),
            decoded: Default::default(),
        }
    }

    #[actix::test]
    async fn a_chunk_is_decoded_and_reaches_the_batcher_it_names_in_one_message() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let probes: Vec<Addr<Probe>> = (0..2).map(|i| Probe(seen.clone(), i).start()).collect();
        let users: Mapping = crate::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles");
        let decoded = Arc::new(DecodedBytes::default());
        let processor = Processor::new(
            Arc::new(users),
            100,
            probes.iter().map(|p| p.clone().recipient()).collect(),
            probes.iter().map(|p| p.clone().recipient()).collect(),
            probes.iter().map(|p| p.clone().recipient()).collect(),
            decoded.clone(),
            1 << 20,
        )
        .start();
        let good =
            br#"{"id":"5f0c8a4e-8f0e-4f6e-9d53-1a2b3c4d5e6f","name":"A","email":"a@example.com"}"#;
        let big = [b' '; 101];
        processor
            .send(Chunk {
                batcher: 1,
                deliveries: vec![delivery(1, good), delivery(2, b"{"), delivery(3, &big)],
            })
            .await
            .unwrap();
        processor.send(Drain).await.unwrap();
        // The drain reaches both probes after the chunk: wait for it on each.
        for p in &probes {
            p.send(Drain).await.unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        let chunk: Vec<_> = seen
            .iter()
            .filter(|(i, _)| *i == 1)
            .take(3)
            .copied()
            .collect();
        assert_eq!(chunk, [(1, true), (1, false), (1, false)]);
        // The decoded record was counted (the largest: its body and record together), and
        // given back when the probe dropped it; the refused ones count nothing.
        assert!(decoded.take_largest() > good.len() as u64);
        assert_eq!(decoded.live(), 0);
        assert_eq!(seen.len(), 3 + 2 + 2, "{seen:?}");
    }

    /// A batcher that keeps what reaches it (so the records' bytes stay charged) until told
    /// to let go, and counts the flushes it was sent.
    #[derive(Default)]
    struct Keeper {
        kept: Vec<Decoded<Row>>,
        flushes: usize,
    }

    impl Actor for Keeper {
        type Context = Context<Self>;
    }

    impl Handler<Processed<Row>> for Keeper {
        type Result = ();
        fn handle(&mut self, msg: Processed<Row>, _: &mut Self::Context) {
            self.kept.extend(msg.0);
        }
    }

    impl Handler<Drain> for Keeper {
        type Result = ();
        fn handle(&mut self, _: Drain, _: &mut Self::Context) {}
    }

    impl Handler<Flush> for Keeper {
        type Result = ();
        fn handle(&mut self, _: Flush, _: &mut Self::Context) {
            self.flushes += 1;
        }
    }

    /// (records kept, flushes received); `release` drops the kept records first.
    #[derive(Message)]
    #[rtype(result = "(usize, usize)")]
    struct Look {
        release: bool,
    }

    impl Handler<Look> for Keeper {
        type Result = MessageResult<Look>;
        fn handle(&mut self, msg: Look, _: &mut Self::Context) -> Self::Result {
            let seen = (self.kept.len(), self.flushes);
            if msg.release {
                self.kept.clear();
            }
            MessageResult(seen)
        }
    }

    /// Review R38f F1: past the budget, a processor decodes nothing more until the records
    /// its stage holds are released (their batch's statement ended), flushing its batcher
    /// once meanwhile; then it goes on, in order.
    #[actix::test]
    async fn past_the_budget_a_processor_waits_for_the_records_to_be_released() {
        let keeper = Keeper::default().start();
        let users: Mapping = crate::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles");
        let decoded = Arc::new(DecodedBytes::default());
        // A budget one record fills.
        let processor = Processor::new(
            Arc::new(users),
            1 << 10,
            vec![keeper.clone().recipient()],
            vec![keeper.clone().recipient()],
            vec![keeper.clone().recipient()],
            decoded.clone(),
            1,
        )
        .start();
        let body = |i: u8| {
            format!(
                r#"{{"id":"5f0c8a4e-8f0e-4f6e-9d53-1a2b3c4d5e{i:02x}","name":"A","email":"a@example.com"}}"#
            )
        };
        processor
            .send(Chunk {
                batcher: 0,
                deliveries: (1..=3)
                    .map(|i| delivery(u64::from(i), body(i).as_bytes()))
                    .collect(),
            })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(keeper.send(Look { release: false }).await.unwrap(), (1, 1));
        assert!(decoded.live() > 0);
        for kept in [1, 1, 1] {
            assert_eq!(keeper.send(Look { release: true }).await.unwrap().0, kept);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(keeper.send(Look { release: true }).await.unwrap().0, 0);
        assert_eq!(decoded.live(), 0);
        assert_eq!(decoded.done(), 3);
    }
}
