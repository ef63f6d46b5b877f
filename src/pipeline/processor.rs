//! The processor actor: decodes and validates each delivery through the domain and hands the
//! outcome (a record, or the reason it was refused) to the batcher the consumer chose.

use std::sync::Arc;

use actix::prelude::*;
use lapin::BasicProperties;

use super::Drain;
use super::batcher::Processed;
use crate::domain::{Domain, Rejection};

/// One delivery, as the consumer hands it over.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Delivered {
    /// Channel generation, so the settlement reaches only the channel that delivered it.
    pub generation: u64,
    pub tag: u64,
    pub redelivered: bool,
    /// Kept until settled: a retry or dead-letter republishes it unchanged.
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    /// Index of the batcher this delivery goes to.
    pub batcher: usize,
}

impl Delivered {
    /// The AMQP message id, for logs (`-` when the publisher set none).
    pub fn message_id(&self) -> &str {
        self.properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str())
            .unwrap_or("-")
    }
}

/// The processor actor.
pub struct Processor<D: Domain> {
    domain: Arc<D>,
    /// Bodies larger than this are refused unread.
    max_message_bytes: usize,
    batchers: Vec<Recipient<Processed<D::Record>>>,
    drains: Vec<Recipient<Drain>>,
}

impl<D: Domain> Processor<D> {
    pub fn new(
        domain: Arc<D>,
        max_message_bytes: usize,
        batchers: Vec<Recipient<Processed<D::Record>>>,
        drains: Vec<Recipient<Drain>>,
    ) -> Self {
        Self {
            domain,
            max_message_bytes,
            batchers,
            drains,
        }
    }
}

impl<D: Domain> Actor for Processor<D> {
    type Context = Context<Self>;
}

impl<D: Domain> Supervised for Processor<D> {}

impl<D: Domain> Handler<Delivered> for Processor<D> {
    type Result = ();

    fn handle(&mut self, msg: Delivered, _: &mut Self::Context) {
        let result = if msg.body.len() > self.max_message_bytes {
            Err(Rejection::payload(format!(
                "body of {} bytes exceeds MAX_MESSAGE_BYTES ({})",
                msg.body.len(),
                self.max_message_bytes
            )))
        } else {
            self.domain.decode(&msg.body)
        };
        let index = msg.batcher % self.batchers.len();
        self.batchers[index].do_send(Processed {
            delivered: msg,
            result,
        });
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
