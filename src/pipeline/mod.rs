//! The Broadway-shaped pipeline, wired here in flow order:
//!
//! ```text
//!  queue ──> Consumer ──round-robin──> Processor x USERS_PROC_CONCURRENCY   (decode, validate)
//!  (prefetch)   ^                            │ batcher chosen by the consumer, a batch-size chunk each
//!               │                            v
//!               │                      Batcher x USERS_BATCH_CONCURRENCY    (size or timeout flush,
//!               │                            │                               one INSERT per batch)
//!               │                            ├──> Router ──> retry exchange / DLX  (confirmed)
//!               └──────── Settle ────────────┘   ack after commit or confirmed republish
//! ```
//!
//! - `consumer.rs`: connection, qos, consume, reconnect, watchdog, ordered acks (`acks.rs`).
//! - `processor.rs`: decode and validate through the [`Domain`].
//! - `batcher.rs`: batching, insert, row isolation, routing, settlement.
//! - `router.rs`: retry queue and DLX republishing.
//! - `publisher.rs`: confirmed publishing, used by the router, the HTTP API and `warren publish`.
//!
//! Backpressure: the prefetch window bounds the deliveries in the pipeline at any time; each
//! batcher inserts one batch at a time, and the broker sends nothing new until acks free room.
//!
//! Shutdown order: cancel the consumer -> its stream ends -> `Drain` passes through every
//! processor (after the deliveries it holds) to every batcher -> batchers flush at once -> the
//! consumer waits until every delivery is settled and its acks are sent -> channel and
//! connection close.

pub mod acks;
pub mod batcher;
pub mod consumer;
pub mod processor;
pub mod publisher;
pub mod router;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use actix::prelude::*;
use deadpool_postgres::Pool;
use tracing::{info, warn};

use crate::config::Settings;
use crate::domain::Domain;
use batcher::{Batcher, Mode, Shared};
use consumer::{Consumer, ConsumerConfig, Shutdown};
use processor::Processor;
use publisher::{Close, Publisher};
use router::Router;

/// Flush everything now: sent by the consumer through the processors to the batchers once no
/// more deliveries will come.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Drain;

/// Starts one more processor wired to the pipeline's batchers.
type ProcessorFactory = Box<dyn Fn() -> (Recipient<processor::Delivered>, Recipient<Drain>)>;

/// A running pipeline.
pub struct Pipeline {
    pub name: &'static str,
    consumer: Addr<Consumer>,
    /// Starts processors for live scaling.
    spawn_processor: ProcessorFactory,
    publisher: Addr<Publisher>,
    stopping: Arc<AtomicBool>,
}

/// Starts a pipeline consuming `queue` into `domain`: the main one (`Mode::Main`) or the DLQ
/// consumer (`Mode::Dlq`).
pub fn start<D: Domain>(settings: &Settings, domain: Arc<D>, pool: Pool, mode: Mode) -> Pipeline {
    let (name, queue) = match mode {
        Mode::Main => ("main", settings.main_queue.clone()),
        Mode::Dlq => ("dlq", settings.dlq_queue.clone()),
    };
    let stopping = Arc::new(AtomicBool::new(false));

    // The consumer's address exists before it runs, so batchers can settle to it.
    let consumer_ctx: Context<Consumer> = Context::new();
    let consumer_addr = consumer_ctx.address();

    let publisher = Publisher::new(settings.clone(), "router").start();
    let shared = Arc::new(Shared {
        domain: domain.clone(),
        pool,
        router: Router::new(publisher.clone(), settings, name),
        settle: consumer_addr.clone().recipient(),
        mode,
        pipeline: name,
        db_retry_window: Duration::from_millis(settings.db_retry_window_ms),
        stopping: stopping.clone(),
        failures: AtomicU32::new(0),
        hold: consumer_addr.clone().recipient(),
        breaker_threshold: settings.breaker_failures,
        breaker_open: AtomicBool::new(false),
        dlq_max_attempts: settings.dlq_max_attempts,
        db_bound: crate::db::call_bound(settings),
        requeues: AtomicU32::new(0),
    });

    let batch_size = settings.users_batch_size;
    let timeout = settings.batch_timeout();
    let batchers: Vec<Addr<Batcher<D>>> = (0..settings.users_batch_concurrency)
        .map(|i| {
            let shared = shared.clone();
            Supervisor::start(move |_| Batcher::new(shared, i, batch_size, timeout))
        })
        .collect();

    let max = settings.max_message_bytes;
    let factory_batchers = batchers.clone();
    let spawn_processor: ProcessorFactory = Box::new(move || {
        let domain = domain.clone();
        let records = factory_batchers
            .iter()
            .map(|b| b.clone().recipient())
            .collect();
        let drains = factory_batchers
            .iter()
            .map(|b| b.clone().recipient())
            .collect();
        let addr: Addr<Processor<D>> =
            Supervisor::start(move |_| Processor::new(domain, max, records, drains));
        (addr.clone().recipient(), addr.recipient())
    });
    let (deliveries, drains): (Vec<_>, Vec<_>) = (0..settings.users_proc_concurrency)
        .map(|_| spawn_processor())
        .unzip();

    let config = ConsumerConfig {
        pipeline: name,
        queue,
        prefetch: settings.effective_prefetch(),
        batch_size,
    };
    let consumer = Consumer::new(config, settings.clone(), deliveries, drains, batchers.len());
    consumer_ctx.run(consumer);

    Pipeline {
        name,
        consumer: consumer_addr,
        spawn_processor,
        publisher,
        stopping,
    }
}

impl Pipeline {
    /// Stops (`on`) or resumes taking deliveries on an operator's request.
    pub fn hold(&self, on: bool) {
        self.consumer.do_send(consumer::Hold {
            reason: consumer::HoldReason::Operator,
            on,
        });
    }

    /// Runs `n` processors from now on (1 to 256).
    pub fn scale(&self, n: usize) -> Result<(), String> {
        if !(1..=256).contains(&n) {
            return Err(format!("processors: expected 1 to 256, got {n}"));
        }
        let (deliveries, drains) = (0..n).map(|_| (self.spawn_processor)()).unzip();
        self.consumer
            .do_send(consumer::SetProcessors { deliveries, drains });
        Ok(())
    }

    /// Hands at most `per_s` messages per second onwards from now on (0 = no limit, up to
    /// 1,000,000); the rest wait in the queue.
    pub fn rate(&self, per_s: u32) -> Result<(), String> {
        if per_s > 1_000_000 {
            return Err(format!(
                "rate: expected 0 to 1000000 messages per second, got {per_s}"
            ));
        }
        self.consumer.do_send(consumer::SetRate { per_s });
        Ok(())
    }

    /// Graceful stop in the fixed order (see the module doc), bounded by `timeout`. Returns
    /// whether everything in flight was settled; what was not is redelivered by the broker.
    pub async fn shutdown(&self, timeout: Duration) -> bool {
        self.stopping.store(true, Ordering::Relaxed);
        let drained = tokio::time::timeout(timeout, self.consumer.send(Shutdown))
            .await
            .is_ok();
        if drained {
            info!(pipeline = self.name, "pipeline drained");
        } else {
            warn!(
                pipeline = self.name,
                ?timeout,
                "shutdown timeout reached; unacked messages will be redelivered"
            );
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.publisher.send(Close)).await;
        drained
    }
}
