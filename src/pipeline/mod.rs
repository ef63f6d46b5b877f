//! The Broadway-shaped pipeline, wired here in flow order, with its one shutdown sequence.
//!
//! ```text
//!  queue ─chunks─> Consumer ─Chunk─> Processor x P ─Processed─> Batcher x B ─Batch─> Sink x B
//!  (prefetch)        ^  (broker link, acks)  (decode, validate)   (flush rules)   (insert, retry in
//!                    │                                                            place, isolate)
//!                    │                                                    Leftovers │
//!                    │                                                              v
//!                    └──────────────── Settle (per batch) ─────────────── Router (main: retry / DLX)
//!                                                                       or DlqStage (dlq: park)
//! ```
//!
//! - `message.rs`: what the stages send each other.
//! - `consumer/`: the broker link: connect, qos, subscribe, reconnect, watchdog; hands
//!   deliveries on (`throttle.rs`: the rate limit; `dispatch.rs`: which processor and batcher);
//!   `acks.rs` turns settlements into ordered multi-acks.
//! - `processor.rs`: decode and validate through the [`Domain`], a chunk at a time: one on the
//!   pipeline's thread, or several on threads of their own (`Pipeline::processors`).
//! - `batcher.rs`: flush rules only (a free sink takes what waits, up to the size; the minimum
//!   wait; drain).
//! - `sink.rs`: one insert statement per batch, in-place retry, row isolation; `breaker.rs`;
//!   `predecessors.rs`: what a stage a reload started asks of the stages stopped before it.
//! - `router.rs`: the outcome policy (`router/republisher.rs`: the confirmed republishing);
//!   `dlq.rs`: the DLQ consumer's stage;
//!   `copies.rs`: the copies whose ack may be lost with the consumer's link, so their
//!   redeliveries are not routed twice; `acked.rs`: the acks that may be lost, so a stage a
//!   reload starts asks the old stage's table about those redeliveries, and only those.
//! - `balance.rs`: how many batch inserts a main stage has in flight (balancing, its bounds).
//! - `shutdown.rs`: the bound on the graceful stop ([`shutdown::ShutdownConfig`]).
//!
//! Each stage gets its downstream as a `Recipient`, so a test can put a probe in its place.
//! Backpressure: the prefetch window bounds the deliveries in the pipeline; each sink works on
//! one batch at a time; the broker sends nothing new until acks free room.

pub mod acked;
pub mod acks;
pub mod balance;
pub mod batcher;
pub mod breaker;
pub mod consumer;
pub mod copies;
pub mod dispatch;
pub mod dlq;
pub mod message;
pub mod predecessors;
pub mod processor;
pub mod router;
pub mod shutdown;
pub mod sink;
pub mod throttle;

use std::future::Future;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::amqp::AmqpConfig;
use crate::amqp::monitor::Depths;
use crate::amqp::publisher::{self, Publisher};
use crate::config::pipelines::{Names, PipelineSpec};
use crate::domain::Domain;
pub use crate::metrics::{Stage, StageId};
use batcher::{Batcher, FlushRule, SinkStates};
use breaker::Breaker;
use consumer::{Consumer, ConsumerConfig};
use dispatch::{Dispatch, Feed};
use message::{Drain, Leftovers};
use processor::Processor;
use router::{Fallback, Republisher, Router};
use sink::{Sink, SinkConfig};

/// What a pipeline does with the messages its sink could not insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackKind {
    /// The main pipeline: retry queue for transient failures, DLX for the rest.
    Route,
    /// The DLQ consumer: park in `dead_letters`, counting its attempts up to `max_attempts`.
    Park { max_attempts: u32 },
}

/// One stage's own settings: what it consumes and how it batches, from its pipeline's resolved
/// spec ([`Spec::main`], [`Spec::dlq`]); a test or another domain may build its own.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Which of the pipeline's stages this is: decides its fallback's events and scaling words,
    /// and is the `stage` label of logs and metrics (never read from a name).
    pub stage: Stage,
    /// The pipeline the stage belongs to (`users`, or a configured one's name): the `pipeline`
    /// label of logs and metrics, what `warren ctl --pipeline` names, what its parked rows are
    /// filed under.
    pub pipeline: String,
    pub queue: String,
    pub batch_size: usize,
    /// The longest a partial batch is held for more (it caps `batch_min_wait`).
    pub batch_timeout: Duration,
    /// How long a partial batch is held for more before a free sink takes it (0: at once).
    pub batch_min_wait: Duration,
    /// Processor actors (decode): one runs on the pipeline's thread; more run on min(this,
    /// cores) threads of their own (parallel decoding).
    pub processors: usize,
    /// Batcher and sink pairs in use at start: batches inserted at the same time.
    pub batchers: usize,
    /// Batcher and sink pairs that exist: the most the concurrency can be set to (balancing,
    /// `warren ctl scale --max`).
    pub max_batchers: usize,
    /// How the concurrency follows the backlog (main stages; the DLQ stage is fixed).
    pub policy: balance::Policy,
    /// The prefetch window at start; it follows the concurrency (`balance::Concurrency::window`).
    pub prefetch: u16,
    /// The most the window may be: `PREFETCH` when set, and what the byte budget holds.
    pub window_cap: u16,
    pub max_message_bytes: usize,
    /// Bytes of bodies in flight at most (past it the consumer pauses and cuts its window).
    pub max_inflight_bytes: u64,
    /// How long a transient failure is retried in place.
    pub db_retry_window: Duration,
    /// Consecutive failing batches that open the breaker (`None`: only systemic errors do).
    pub breaker_failures: Option<u32>,
    pub fallback: FallbackKind,
    /// The pipeline's exchanges and queues: where its retries and dead letters go, and the
    /// queue its retry tiers dead-letter back to.
    pub names: Names,
    /// Retries through the retry queue before a transient failure is dead-lettered.
    pub max_retries: u32,
    /// Messages handed onwards per second at most (0: no limit).
    pub rate_limit_per_s: u32,
}

impl Spec {
    /// The main stage of the pipeline `p` (resolved once when the configuration loaded,
    /// [`crate::config::Settings::pipelines`]): everything the stages need is copied here, so
    /// nothing on the data path reads the settings.
    pub fn main(p: &PipelineSpec) -> Self {
        Self {
            stage: Stage::Main,
            pipeline: p.name.clone(),
            queue: p.names.main_queue.clone(),
            names: p.names.clone(),
            max_retries: p.max_retries,
            rate_limit_per_s: p.rate_limit_per_s,
            batch_size: p.batching.size,
            batch_timeout: p.batching.timeout,
            batch_min_wait: p.batching.min_wait,
            processors: p.batching.processors,
            batchers: p.held_inserts(),
            max_batchers: p.most_inserts(),
            policy: p.balance,
            prefetch: p.start_prefetch,
            window_cap: p.window_cap,
            max_message_bytes: p.max_message_bytes,
            max_inflight_bytes: p.max_inflight_bytes,
            db_retry_window: p.db_retry_window,
            breaker_failures: Some(p.breaker_failures),
            fallback: FallbackKind::Route,
        }
    }

    /// The DLQ consumer of the same pipeline: what is still refused is parked; its concurrency
    /// is fixed at the batch concurrency.
    pub fn dlq(p: &PipelineSpec) -> Self {
        Self {
            stage: Stage::Dlq,
            queue: p.names.dlq_queue.clone(),
            breaker_failures: None,
            fallback: FallbackKind::Park {
                max_attempts: p.dlq_max_attempts,
            },
            batchers: p.batching.concurrency,
            max_batchers: p.batching.concurrency,
            policy: balance::Policy {
                strategy: crate::config::Balance::Off,
                ..p.balance
            },
            prefetch: p.prefetch,
            ..Self::main(p)
        }
    }
}

/// Starts one more processor: on the given thread, or on the pipeline's own with `None`.
type ProcessorFactory = Box<dyn Fn(Option<&ArbiterHandle>) -> (Feed, Recipient<Drain>)>;

/// A number a running pipeline does not take (`warren ctl scale`, `warren ctl rate`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfRange {
    #[error("processors: expected 1 to 256, got {0}")]
    Processors(usize),
    #[error("rate: expected 0 to 1000000 messages per second, got {0}")]
    Rate(u32),
}

/// A running pipeline.
pub struct Pipeline {
    /// The pipeline (`users`, `orders`: what `warren ctl --pipeline` names) and which of its
    /// stages: the `pipeline` and `stage` labels.
    pub id: StageId,
    consumer: Addr<Consumer>,
    /// The processors' drain addresses, current ones (live scaling replaces them).
    drains: Mutex<Vec<Recipient<Drain>>>,
    spawn_processor: ProcessorFactory,
    /// The threads processors run on when there is more than one (empty with one processor:
    /// it runs on the pipeline's own thread). They only grow (a processor replaced by scaling
    /// still finishes its mailbox there) and stop at shutdown.
    threads: Mutex<Vec<Arbiter>>,
    publisher: Addr<Publisher>,
    /// Cancelled when shutdown starts: backoffs and in-place retries end.
    stopping: CancellationToken,
    /// The stage's statements in flight (its sinks' inserts, its parks): cancelled when the
    /// drain nears its deadline, so each is known ended before its deliveries go elsewhere.
    statements: Arc<crate::db::Statements>,
    /// The client-side bound on one statement: the longest a statement the stop cancelled may
    /// still take to end (a cancel that did not reach the server).
    db_bound: Duration,
    /// A main stage's batch inserts in flight (balancing, `warren ctl scale --min/--max`);
    /// `None` for a DLQ stage.
    pub concurrency: Option<Arc<balance::Concurrency>>,
    /// The stage's memory of copies whose original's ack may be lost, and of its acks that
    /// may be lost (`acked.rs`): a reload hands it to the stage it starts in this one's place
    /// ([`start`]'s `kept`).
    pub copies: Arc<copies::Copies>,
    /// This start of the stage: what its consumer acked is recorded under it, and a stage a
    /// reload starts on the same queue asks this one's table about those redeliveries only.
    pub incarnation: u64,
}

/// What a pipeline's stages connect with, beside the pool they are given: the broker link's
/// settings, the database's bound on one statement, and what the process's stages share: the
/// one permit to hold a body over `MAX_MESSAGE_BYTES`. Nothing else of warren's settings
/// reaches a pipeline: what it consumes, where its failures go, its batching and limits are its
/// [`Spec`].
#[derive(Debug, Clone)]
pub struct Links {
    /// The consumer's and the router's publisher's broker link: where to connect, the connect
    /// and confirm bounds, the broker's consumer timeout (when a held delivery is given back).
    pub amqp: AmqpConfig,
    /// The client-side bound on one database statement (`DbConfig::call_bound`): the sinks'
    /// inserts and the fallback stages' parking give up on a statement after it.
    pub db_bound: Duration,
    /// The process's one permit to hold a body over `MAX_MESSAGE_BYTES`, made once by the
    /// composition root and shared by every stage of every pipeline, those a reload starts
    /// included: the process holds one such body at a time (`consumer/oversize.rs`).
    pub oversize: consumer::OversizePermit,
}

/// Starts the pipeline `spec` of `domain`, wired in flow order from the broker link down.
/// `links` gives the connections only (the broker, the database's statement bound); what the
/// pipeline consumes, where its failures go, its batching and limits come from `spec`; `depths`
/// is what the queue poller sees of its queues; `kept` is the memory of copies of the stage this
/// one replaces (a reload), taken over when it is the same stage on the same queue, so the
/// redeliveries of what that one left are still recognised (`copies.rs`); `before` are the
/// domains and names of the stages of this kind this process's reloads stopped on the queue
/// (newest first): a redelivery one of them stored or parked is acked as done, not stored or
/// parked again under this spec (`predecessors::settled_before`).
pub fn start<D: Domain>(
    links: &Links,
    spec: Spec,
    domain: Arc<D>,
    pool: Pool,
    depths: Depths,
    kept: Option<Arc<copies::Copies>>,
    before: Vec<predecessors::Predecessor<D>>,
) -> Pipeline {
    let id = StageId::new(&spec.pipeline, spec.stage);
    let incarnation = acked::incarnation();
    let stopping = CancellationToken::new();
    let statements = crate::db::Statements::new();

    // The consumer's address exists before it runs: the last stages settle to it.
    let consumer_ctx: Context<Consumer> = Context::new();
    let consumer_addr = consumer_ctx.address();

    // Fallback stage (what the sink could not insert).
    let publisher = Publisher::new(
        links.amqp.clone(),
        "router",
        crate::amqp::Frames::Broker,
        crate::events::publisher_link,
    )
    .start();
    let db_bound = links.db_bound;
    let copies = copies::Copies::carry_on(
        kept,
        id.clone(),
        &spec.queue,
        spec.window_cap.max(spec.prefetch),
    );
    let fallback = Fallback {
        stage: id.clone(),
        republisher: Republisher::new(publisher.clone(), &spec, links.amqp.publish_timeout()),
        settle: consumer_addr.clone().recipient(),
        stopping: stopping.clone(),
        requeues: AtomicU32::new(0),
        pool: pool.clone(),
        db_bound,
        statements: statements.clone(),
        parks_as: spec.pipeline.clone(),
        park_over: spec.max_message_bytes,
        copies: copies.clone(),
        incarnation,
        hand_back_after: links.amqp.hand_back_after(),
        parked_before: {
            let mut names: Vec<String> = Vec::new();
            for b in &before {
                if b.parks_as != spec.pipeline && !names.contains(&b.parks_as) {
                    names.push(b.parks_as.clone());
                }
            }
            names
        },
    };
    let leftovers: Recipient<Leftovers> = match spec.fallback {
        FallbackKind::Route => Supervisor::start(move |_| Router::new(fallback)).recipient(),
        FallbackKind::Park { max_attempts } => {
            Supervisor::start(move |_| dlq::DlqStage::new(fallback, max_attempts)).recipient()
        }
    };

    // Sinks, one per batcher.
    let sink_config = Arc::new(SinkConfig {
        domain: domain.clone(),
        pool: pool.clone(),
        stage: id.clone(),
        db_retry_window: spec.db_retry_window,
        db_bound,
        hand_back_after: links.amqp.hand_back_after(),
        breaker: Arc::new(Breaker::new(
            id.clone(),
            spec.breaker_failures,
            consumer_addr.clone().recipient(),
            stopping.clone(),
        )),
        stopping: stopping.clone(),
        silent_at_stop: Default::default(),
        statements: statements.clone(),
        settle: consumer_addr.clone().recipient(),
        leftovers,
        copies: copies.clone(),
        incarnation,
        predecessors: before,
    });

    // Batchers.
    let rule = FlushRule {
        batch_size: spec.batch_size,
        timeout: spec.batch_timeout,
        min_wait: spec.batch_min_wait,
    };
    let sink_states = SinkStates::new(spec.max_batchers.max(spec.batchers).max(1));
    let batchers: Vec<Addr<Batcher<D::Record>>> = (0..spec.max_batchers.max(spec.batchers).max(1))
        .map(|i| {
            let config = sink_config.clone();
            let sink = Supervisor::start(move |_| Sink::new(config)).recipient();
            let name = format!("{id}-{i}");
            let states = sink_states.clone();
            Supervisor::start(move |_| Batcher::new(rule, sink, name).reporting(states, i))
        })
        .collect();

    // Processors: one on the pipeline's own thread, or several on threads of their own.
    let max = spec.max_message_bytes;
    let limit = spec.max_inflight_bytes;
    let decoded = Arc::new(message::DecodedBytes::default());
    let counted = decoded.clone();
    let spawn_processor: ProcessorFactory = Box::new(move |thread| {
        let domain = domain.clone();
        let decoded = counted.clone();
        let records = batchers.iter().map(|b| b.clone().recipient()).collect();
        let drains = batchers.iter().map(|b| b.clone().recipient()).collect();
        let flushes = batchers.iter().map(|b| b.clone().recipient()).collect();
        let make = move |_: &mut Context<Processor<D>>| {
            Processor::new(domain, max, records, drains, flushes, decoded, limit)
        };
        let addr: Addr<Processor<D>> = match thread {
            Some(thread) => Supervisor::start_in_arbiter(thread, make),
            None => Supervisor::start(make),
        };
        let feed = Feed {
            chunks: addr.clone().recipient(),
            flushes: addr.clone().recipient(),
        };
        (feed, addr.recipient())
    });
    let created = spec.max_batchers.max(spec.batchers).max(1);
    let concurrency = (spec.fallback == FallbackKind::Route).then(|| {
        Arc::new(balance::Concurrency::new(
            id.clone(),
            spec.policy,
            spec.queue.clone(),
            consumer_addr.clone().recipient(),
            spec.batchers.max(1),
            created,
            spec.batch_size,
            spec.window_cap,
        ))
    });
    let pipeline = Pipeline {
        id: id.clone(),
        consumer: consumer_addr,
        drains: Mutex::new(Vec::new()),
        spawn_processor,
        threads: Mutex::new(Vec::new()),
        publisher,
        stopping,
        statements,
        db_bound,
        concurrency,
        copies: copies.clone(),
        incarnation,
    };
    let chunks = pipeline.processors(spec.processors);
    crate::metrics::stage(&pipeline.id)
        .rate_limit_per_s
        .store(spec.rate_limit_per_s, std::sync::atomic::Ordering::Relaxed);

    // The broker link.
    let config = ConsumerConfig {
        stage: id,
        queue: spec.queue.clone(),
        prefetch: spec.prefetch,
        max_inflight_bytes: spec.max_inflight_bytes,
        max_message_bytes: spec.max_message_bytes,
        rate_limit_per_s: spec.rate_limit_per_s,
        depths,
        copies,
        incarnation,
        oversize: links.oversize.clone(),
        decoded,
    };
    // A batch's worth to one batcher before the next one's turn, each chunk to the next processor.
    let dispatch = Dispatch::new(chunks, created, spec.batchers, spec.batch_size, sink_states);
    let consumer = Consumer::new(config, links.amqp.clone(), dispatch);
    consumer_ctx.run(consumer);
    pipeline
}

impl Pipeline {
    /// Stops (`on`) or resumes taking deliveries on an operator's request.
    pub fn hold(&self, on: bool) {
        self.consumer.do_send(message::Hold {
            reason: message::HoldReason::Operator,
            on,
        });
    }

    /// Runs `n` processors from now on (1 to 256).
    pub fn scale(&self, n: usize) -> Result<(), OutOfRange> {
        if !(1..=256).contains(&n) {
            return Err(OutOfRange::Processors(n));
        }
        let from = self.drains.lock().unwrap_or_else(|p| p.into_inner()).len();
        let chunks = self.processors(n);
        self.consumer.do_send(consumer::SetProcessors(chunks));
        if from != n {
            crate::events::emit(
                Some(self.id.pipeline()),
                crate::events::Kind::Scaled {
                    what: match self.id.stage() {
                        Stage::Main => "processors",
                        Stage::Dlq => "dlq_processors",
                    }
                    .into(),
                    from,
                    to: n,
                    reason: "operator".into(),
                },
            );
        }
        Ok(())
    }

    /// Starts `n` processors and makes their drains the current ones. One runs on the pipeline's
    /// own thread: decoding costs about a microsecond a message, less than handing a chunk to
    /// another thread and back (measured: docs/performance.md, "What the measurements taught").
    /// More than one means parallel decoding, for domains whose decoding is dear: they go round
    /// min(`n`, cores) threads.
    fn processors(&self, n: usize) -> Vec<Feed> {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        let wanted = if n > 1 {
            n.min(std::thread::available_parallelism().map_or(2, |c| c.get()))
        } else {
            0
        };
        while threads.len() < wanted {
            threads.push(Arbiter::new());
        }
        let (chunks, drains): (Vec<_>, Vec<_>) = (0..n.max(1))
            .map(|i| {
                let thread = (wanted > 0).then(|| threads[i % wanted].handle());
                (self.spawn_processor)(thread.as_ref())
            })
            .unzip();
        *self.drains.lock().unwrap_or_else(|p| p.into_inner()) = drains;
        // What the registry publishes of the stage (`warren status`).
        crate::metrics::stage(&self.id)
            .processors
            .store(n.max(1) as u64, std::sync::atomic::Ordering::Relaxed);
        chunks
    }

    /// Hands at most `per_s` messages per second onwards from now on (0 = no limit, up to
    /// 1,000,000); the rest wait in the queue.
    pub fn rate(&self, per_s: u32) -> Result<(), OutOfRange> {
        if per_s > 1_000_000 {
            return Err(OutOfRange::Rate(per_s));
        }
        self.consumer.do_send(consumer::SetRate { per_s });
        crate::metrics::stage(&self.id)
            .rate_limit_per_s
            .store(per_s, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The one shutdown sequence, bounded by `timeout`:
    /// 1. cancel: backoffs and in-place retries end, the consumer cancels its subscription and
    ///    answers once nothing more arrives;
    /// 2. drain: `Drain` follows the last chunks through every processor to every batcher;
    /// 3. flush: batchers hand over what they hold at once, sinks insert it;
    /// 4. ack: the consumer answers once every delivery is settled and its ack was sent;
    /// 5. close: the consumer's channel and connection, the republisher, the processor threads.
    ///
    /// A statement still running [`cancel_grace`] before the deadline (a batch waiting on a
    /// lock, a slow server) is cancelled then, and no new one starts: each ends rolled back
    /// (its messages go back to their queue, no retry spent) or committed (acked), and the
    /// sinks settle the batch the usual way, the channel still open. Past the deadline, what
    /// still runs is waited for (at most a statement's bound): once this returns, no statement
    /// of the stage can commit any more, so a stage started in its place (a reload switching
    /// the table) never stores again what one of these stores (review R35-F1).
    ///
    /// Returns whether everything in flight was settled (acked, or given back with a nack:
    /// what was not is redelivered by the broker when the channel closes), and what the stop
    /// did with the deliveries: settled, or given back to the broker unprocessed.
    pub async fn shutdown(&self, timeout: Duration) -> (bool, consumer::StopCounts) {
        self.stopping.cancel();
        let drain = async {
            let _ = self.consumer.send(consumer::Cancel).await;
            let drains = self
                .drains
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for d in drains {
                d.do_send(Drain);
            }
            let _ = self.consumer.send(consumer::Settled).await;
        };
        tokio::pin!(drain);
        let grace = cancel_grace(timeout);
        let mut drained = tokio::time::timeout(timeout - grace, &mut drain)
            .await
            .is_ok();
        if !drained {
            let cancelled = self.statements.cancel_all();
            if cancelled > 0 {
                warn!(
                    pipeline = self.id.pipeline(),
                    stage = self.id.stage().as_str(),
                    cancelled,
                    "the drain nears its deadline: statements still running are cancelled; \
                     what they did not commit goes back to its queue"
                );
            }
            drained = tokio::time::timeout(grace, &mut drain).await.is_ok();
        }
        if drained {
            info!(
                pipeline = self.id.pipeline(),
                stage = self.id.stage().as_str(),
                "pipeline drained"
            );
        } else {
            warn!(
                pipeline = self.id.pipeline(),
                stage = self.id.stage().as_str(),
                ?timeout,
                "shutdown timeout reached; unacked messages will be redelivered"
            );
            if !self.statements.ended(self.db_bound).await {
                warn!(
                    pipeline = self.id.pipeline(),
                    stage = self.id.stage().as_str(),
                    running = self.statements.running(),
                    "statements still running after their bound; the server's statement_timeout \
                     ends them"
                );
            } else {
                // The sinks settle what those statements ended with before the channel
                // closes: a batch whose outcome is unknown is remembered as acks this stage
                // may have made before its deliveries go back (review R46a F6), so that a
                // stage a reload starts asks this table about their redeliveries.
                let _ = tokio::time::timeout(SETTLE_AFTER_END, &mut drain).await;
            }
        }
        // A consumer that does not answer (it never does but in a broken process) counts
        // nothing: its channel closes with the process, and the broker has every delivery back.
        let counts =
            tokio::time::timeout(Duration::from_secs(5), self.consumer.send(consumer::Close))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.publisher.send(publisher::Close),
        )
        .await;
        for thread in self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            thread.stop();
        }
        (drained, counts)
    }
}

/// How long a stop past its deadline waits, once its statements ended, for the sinks to
/// settle what they ended with: no statement starts any more, but a sink asking its table
/// about a batch whose answer was lost may wait for a connection first, up to the pool's wait
/// (review R47a F2: with 2 s, a frozen database link kept two sinks past it, the reload
/// started the next stage, and what they remembered too late was stored in both tables).
const SETTLE_AFTER_END: Duration = Duration::from_secs(crate::db::POOL_WAIT.as_secs() + 1);

/// How long before the drain's deadline `timeout` the statements still running are cancelled:
/// a quarter of it, at most 5 s (a cancel takes milliseconds; the settle that follows it, every
/// batch's failure, its nacks, took 1.4 s on a loaded test machine).
pub fn cancel_grace(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(5))
}

/// Sleeps `delay` unless `stopping` is cancelled first; returns whether the whole delay passed.
pub async fn sleep_or_cancel(delay: Duration, stopping: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = stopping.cancelled() => false,
    }
}

/// A backon sleeper that wakes early when `stopping` is cancelled.
pub fn cancellable_sleep(
    stopping: CancellationToken,
) -> impl Fn(Duration) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + 'static {
    move |delay| {
        let stopping = stopping.clone();
        Box::pin(async move {
            sleep_or_cancel(delay, &stopping).await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_cancelled_a_quarter_of_the_bound_before_it_at_most_5_s() {
        assert_eq!(cancel_grace(Duration::ZERO), Duration::ZERO);
        assert_eq!(
            cancel_grace(Duration::from_millis(2_000)),
            Duration::from_millis(500)
        );
        assert_eq!(
            cancel_grace(Duration::from_secs(30)),
            Duration::from_secs(5)
        );
    }
}
