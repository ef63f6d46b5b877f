//! The processor stage: decodes and validates each delivery of a chunk through the domain and
//! hands the decoded chunk (records, or the reasons they were refused) to the batcher the
//! consumer chose. One processor decodes on the pipeline's own thread (decoding a user costs
//! about a microsecond, less than a hop to another thread); more run on threads of their own,
//! for domains whose decoding is dear (`Pipeline::processors`).

use std::sync::Arc;

use actix::prelude::*;

use super::message::{Chunk, Decoded, DecodedBytes, Delivery, Drain, Flush, Processed};
use crate::domain::{Domain, Rejection};

/// The processor actor.
pub struct Processor<D: Domain> {
    domain: Arc<D>,
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
}

impl<D: Domain> Processor<D> {
    pub fn new(
        domain: Arc<D>,
        max_message_bytes: usize,
        batchers: Vec<Recipient<Processed<D::Record>>>,
        drains: Vec<Recipient<Drain>>,
        flushes: Vec<Recipient<Flush>>,
        decoded: Arc<DecodedBytes>,
    ) -> Self {
        Self {
            domain,
            max_message_bytes,
            batchers,
            drains,
            flushes,
            decoded,
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
        self.domain.decode_with(body, &delivery.envelope())
    }
}

impl<D: Domain> Actor for Processor<D> {
    type Context = Context<Self>;
}

impl<D: Domain> Supervised for Processor<D> {}

impl<D: Domain> Handler<Chunk> for Processor<D> {
    type Result = ();

    fn handle(&mut self, chunk: Chunk, _: &mut Self::Context) {
        let decoded: Vec<_> = chunk
            .deliveries
            .into_iter()
            .map(|mut delivery| {
                let result = self.decode(&delivery);
                if let Ok(record) = &result {
                    let bytes = self.domain.record_bytes(record);
                    delivery.decoded = self.decoded.charge(bytes, delivery.held_bytes);
                }
                Decoded { result, delivery }
            })
            .collect();
        self.decoded.decoded(decoded.len());
        let index = chunk.batcher % self.batchers.len();
        self.batchers[index].do_send(Processed(decoded));
    }
}

impl<D: Domain> Handler<Drain> for Processor<D> {
    type Result = ();

    /// Everything this processor received before `Drain` is already forwarded (mailbox order).
    fn handle(&mut self, _: Drain, _: &mut Self::Context) {
        for d in &self.drains {
            d.do_send(Drain);
        }
    }
}

impl<D: Domain> Handler<Flush> for Processor<D> {
    type Result = ();

    /// After the chunks this processor holds for that batcher (mailbox order).
    fn handle(&mut self, msg: Flush, _: &mut Self::Context) {
        if let Some(f) = self.flushes.get(msg.batcher) {
            f.do_send(msg);
        }
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
            properties: BasicProperties::default(),
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
}
