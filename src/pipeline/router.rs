//! Where a message that was not inserted goes: back through the retry queue with `x-retries` + 1,
//! or to the dead-letter exchange with `x-error-kind` / `x-error-reason`. Every republish is
//! confirmed by the broker before the original is acked.

use actix::Addr;
use futures::future::join_all;
use tracing::{error, warn};

use super::acks::Disposition;
use super::processor::Delivered;
use super::publisher::{Publish, Publisher};
use crate::amqp::AmqpError;
use crate::amqp::headers::{self, Retries};
use crate::config::Settings;

/// Where one message should go.
#[derive(Debug, Clone)]
pub enum Route {
    /// A transient failure: through the retry queue, unless its retries are spent.
    Retry { reason: String },
    /// Straight to the DLQ with this `x-error-kind`.
    DeadLetter { kind: &'static str, reason: String },
}

/// Republishes messages to the retry exchange or the DLX.
#[derive(Clone)]
pub struct Router {
    publisher: Addr<Publisher>,
    retry_exchange: String,
    retry_queue: String,
    dlx_exchange: String,
    dlq_queue: String,
    max_retries: u32,
    /// What to do when the republish fails: the main queue may `Reject` (its broker-level DLX
    /// still catches the message); the DLQ has no DLX, so it must `Requeue`.
    on_failure: Disposition,
    pipeline: &'static str,
    /// How long a publish waits for the publisher to (re)connect.
    patience: std::time::Duration,
}

impl Router {
    pub fn new(
        publisher: Addr<Publisher>,
        settings: &Settings,
        on_failure: Disposition,
        pipeline: &'static str,
    ) -> Self {
        Self {
            publisher,
            retry_exchange: settings.retry_exchange.clone(),
            retry_queue: settings.retry_queue.clone(),
            dlx_exchange: settings.dlx_exchange.clone(),
            dlq_queue: settings.dlq_queue.clone(),
            max_retries: settings.max_retries,
            on_failure,
            pipeline,
            patience: settings.publish_timeout(),
        }
    }

    /// The publish for `message` along `route`, after applying the retry budget.
    pub fn plan(&self, message: &Delivered, route: &Route) -> (Publish, &'static str) {
        let retries = headers::retries(&message.properties);
        if let Retries::Invalid(what) = &retries {
            warn!(message_id = message.message_id(), pipeline = self.pipeline, delivery_tag = message.tag, problem = %what,
                "unusable x-retries treated as 0; it is rewritten as an integer");
        }
        let count = retries.count();
        let (exchange, routing_key, properties, kind) = match route {
            Route::Retry { reason } if count < self.max_retries => (
                &self.retry_exchange,
                &self.retry_queue,
                headers::for_retry(&message.properties, count + 1, reason),
                "retry",
            ),
            Route::Retry { reason } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                headers::for_dead_letter(
                    &message.properties,
                    count,
                    "retries_exhausted",
                    &format!("retries exhausted after {count}: {reason}"),
                ),
                "retries_exhausted",
            ),
            Route::DeadLetter { kind, reason } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                headers::for_dead_letter(&message.properties, count, kind, reason),
                *kind,
            ),
        };
        (
            Publish {
                exchange: exchange.clone(),
                routing_key: routing_key.clone(),
                body: message.body.clone(),
                properties,
            },
            kind,
        )
    }

    /// Routes every message; each disposition is `Ack` once its republish was confirmed. While
    /// the publisher has no connection (at start-up, or during a reconnect) a publish is retried
    /// for up to `patience` before it counts as failed.
    pub async fn route(&self, items: &[(&Delivered, Route)]) -> Vec<(Disposition, &'static str)> {
        let sends = items.iter().map(|(message, route)| {
            let (publish, kind) = self.plan(message, route);
            let publisher = self.publisher.clone();
            async move {
                let deadline = std::time::Instant::now() + self.patience;
                let result = loop {
                    match publisher.send(publish.clone()).await {
                        Ok(Err(AmqpError::Unavailable(_))) if std::time::Instant::now() < deadline => {
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                        Ok(result) => break result,
                        Err(e) => break Err(AmqpError::Unavailable(format!("publisher actor is gone: {e}"))),
                    }
                };
                match result {
                    Ok(()) => (Disposition::Ack, kind),
                    Err(e) => {
                        error!(message_id = message.message_id(), pipeline = self.pipeline, delivery_tag = message.tag, error = %e, kind,
                            "republish failed; the message stays with the broker");
                        (self.on_failure, kind)
                    }
                }
            }
        });
        join_all(sends).await
    }
}
