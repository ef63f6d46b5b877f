//! Where a message that was not inserted goes: back through the retry queue with `x-retries` + 1,
//! to the dead-letter exchange with `x-error-kind` / `x-error-reason`, or (the DLQ consumer) back
//! to the DLQ with `x-dlq-attempts` + 1. Every republish is confirmed by the broker before the
//! original is acked. A republish that is not confirmed leaves the message with warren's queue
//! (nack with requeue, after a backoff): never with the broker's own dead-lettering, which is
//! at-most-once and drops a message whose target is missing at that moment.

use std::time::Duration;

use actix::Addr;
use backon::{ConstantBuilder, Retryable};
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
    /// The DLQ consumer tries again later: back to the DLQ with `x-dlq-attempts` = `attempts`.
    DlqAttempt { attempts: u32, reason: String },
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
    pipeline: &'static str,
    /// How long a publish waits for the publisher to (re)connect.
    patience: Duration,
}

impl Router {
    pub fn new(publisher: Addr<Publisher>, settings: &Settings, pipeline: &'static str) -> Self {
        Self {
            publisher,
            retry_exchange: settings.retry_exchange.clone(),
            retry_queue: settings.retry_queue.clone(),
            dlx_exchange: settings.dlx_exchange.clone(),
            dlq_queue: settings.dlq_queue.clone(),
            max_retries: settings.max_retries,
            pipeline,
            patience: settings.publish_timeout(),
        }
    }

    /// The publish for `message` along `route`, after applying the retry budget, and the kind
    /// it is counted as (`retry`, `dlq_retry` or an `x-error-kind`).
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
            Route::DlqAttempt { attempts, reason } => (
                &self.dlx_exchange,
                &self.dlq_queue,
                headers::for_dlq_attempt(&message.properties, *attempts, reason),
                "dlq_retry",
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

    /// Routes every message; each disposition is `Ack` once its republish was confirmed, and
    /// `Requeue` otherwise (the caller waits a backoff first). While the publisher has no
    /// connection (at start-up, or during a reconnect) a publish is retried for up to
    /// `patience` before it counts as failed.
    pub async fn route(&self, items: &[(&Delivered, Route)]) -> Vec<(Disposition, &'static str)> {
        let attempts = (self.patience.as_millis() / 100).max(1) as usize;
        let sends = items.iter().map(|(message, route)| {
            let (publish, kind) = self.plan(message, route);
            let publisher = self.publisher.clone();
            async move {
                let send = || async {
                    match publisher.send(publish.clone()).await {
                        Ok(result) => result,
                        Err(e) => Err(AmqpError::Unavailable(format!(
                            "publisher actor is gone: {e}"
                        ))),
                    }
                };
                let result = send
                    .retry(
                        ConstantBuilder::default()
                            .with_delay(Duration::from_millis(100))
                            .with_max_times(attempts),
                    )
                    .when(|e| matches!(e, AmqpError::Unavailable(_)))
                    .await;
                match result {
                    Ok(()) => (Disposition::Ack, kind),
                    Err(e) => {
                        error!(message_id = message.message_id(), pipeline = self.pipeline, delivery_tag = message.tag, error = %e, kind,
                            "republish not confirmed; the message goes back to its queue after a backoff");
                        (Disposition::Requeue, kind)
                    }
                }
            }
        });
        join_all(sends).await
    }
}
