//! Every metric warren exports, with its labels, described once; and one function per event
//! that both logs and counts it. Labels stay low-cardinality: `pipeline` and `stage` (one
//! scheme for every pipeline's stages, [`StageId`]), `kind`, `reason`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use metrics::{
    Counter, Gauge, Label, counter, describe_counter, describe_gauge, describe_histogram, gauge,
    histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::warn;

use crate::error_kind::ErrorKind;

mod links;

pub const RECEIVED: &str = "warren_messages_received_total";
pub const INSERTED: &str = "warren_messages_inserted_total";
pub const RETRIED: &str = "warren_messages_retried_total";
pub const DEAD_LETTERED: &str = "warren_messages_dead_lettered_total";
pub const PARKED: &str = "warren_messages_parked_total";
pub const OUTCOMES: &str = "warren_messages_outcomes_total";
pub const BATCH_SIZE: &str = "warren_batch_size";
pub const BATCH_INSERT_SECONDS: &str = "warren_batch_insert_seconds";
pub const END_TO_END_SECONDS: &str = "warren_end_to_end_seconds";
pub const INFLIGHT: &str = "warren_inflight_messages";
pub const INFLIGHT_BYTES: &str = "warren_inflight_bytes";
pub const QUEUE_MESSAGES: &str = "warren_queue_messages";
pub const QUEUE_CONSUMERS: &str = "warren_queue_consumers";
pub const PUBLISHED: &str = "warren_published_total";
pub const PUBLISH_CONFIRM_SECONDS: &str = "warren_publish_confirm_seconds";
pub const CONNECTION_UP: &str = "warren_connection_up";
pub const AMQP_NODE_INFO: &str = "warren_amqp_node_info";
pub const RECONNECTS: &str = "warren_reconnects_total";
pub const HTTP_REQUESTS: &str = "warren_http_requests_total";
pub const HTTP_REQUEST_SECONDS: &str = "warren_http_request_seconds";
pub const BUILD_INFO: &str = "warren_build_info";
pub const BREAKER_OPEN: &str = "warren_breaker_open";
pub const CONSUMER_RESTARTS: &str = "warren_consumer_restarts_total";
pub const REQUEUED: &str = "warren_messages_requeued_total";
pub const REDELIVERIES: &str = "warren_redeliveries_total";
pub const ACKS: &str = "warren_amqp_acks_total";
pub const LOG_LINES_DROPPED: &str = "warren_log_lines_dropped_total";
pub const EVENTS_DROPPED: &str = "warren_events_dropped_total";
pub const PIPELINE_CONCURRENCY: &str = "warren_pipeline_concurrency";
pub const BALANCE_DECISIONS: &str = "warren_balance_decisions_total";
pub const OVERSIZE_PERMIT_WAITING: &str = "warren_oversize_permit_waiting";

/// Which of a pipeline's two stages a consumer is: the `stage` label of every per-pipeline
/// metric. Every pipeline has the same two, whatever its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The pipeline's queue: inserts, and routes what fails to the retry queue or the DLX.
    Main,
    /// The pipeline's dead-letter queue: inserts again, and parks what is still refused.
    Dlq,
}

impl Stage {
    /// Both stages, in the order they start.
    pub const ALL: [Stage; 2] = [Stage::Main, Stage::Dlq];

    /// The `stage` label's value: `main` or `dlq`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Main => "main",
            Stage::Dlq => "dlq",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stage of one pipeline: its labels (`pipeline="<name>"`, `stage="main"|"dlq"`) on every
/// per-pipeline metric and log line, and, written `<name>/<stage>` ([`fmt::Display`]), the name
/// of its consumer's AMQP link and of its line in the registry. Cheap to clone (the name is
/// shared).
///
/// [`fmt::Display`]: std::fmt::Display
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StageId {
    /// The pipeline's name (`users`, `orders`): the `pipeline` label.
    pipeline: std::sync::Arc<str>,
    /// Which of its stages: the `stage` label.
    stage: Stage,
}

impl StageId {
    pub fn new(pipeline: &str, stage: Stage) -> Self {
        Self {
            pipeline: pipeline.into(),
            stage,
        }
    }

    /// The pipeline's name: the `pipeline` label.
    pub fn pipeline(&self) -> &str {
        &self.pipeline
    }

    /// Which stage: the `stage` label.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The stage's labels, then `extra` ones.
    fn labels(&self, extra: &[(&'static str, &'static str)]) -> Vec<Label> {
        let mut labels = Vec::with_capacity(2 + extra.len());
        labels.push(Label::new("pipeline", self.pipeline.clone()));
        labels.push(Label::new("stage", self.stage.as_str()));
        labels.extend(extra.iter().map(|(k, v)| Label::new(*k, *v)));
        labels
    }
}

impl std::fmt::Display for StageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.pipeline, self.stage.as_str())
    }
}

/// Process-wide counts, for the Redis registry and the shutdown record (the Prometheus
/// recorder cannot be read back). The message counts of the pipelines are their stages' sums
/// ([`totals`]).
#[derive(Debug, Default)]
pub struct Stats {
    pub parked: AtomicU64,
    pub inflight: AtomicI64,
    /// Stages whose sink-outage breaker is open (each counted once, [`StageStats::breaker_open`]),
    /// so the registry can report the breaker state.
    pub breakers_open: AtomicU32,
}

pub static STATS: Stats = Stats {
    parked: AtomicU64::new(0),
    inflight: AtomicI64::new(0),
    breakers_open: AtomicU32::new(0),
};

/// One stage's counts ([`StageId`]: `users/main`, `orders/dlq`, ...), for the registry's
/// per-pipeline lines.
#[derive(Debug, Default)]
pub struct StageStats {
    /// Held by `warren ctl pause --pipeline` (an instance-wide pause shows in its status).
    pub paused: AtomicBool,
    pub received: AtomicU64,
    pub inserted: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Batch inserts in flight at most (the batchers in use), as last set; 0 before the stage
    /// starts.
    pub concurrency: AtomicU64,
    /// Its processors, as set at start (its pipeline's spec) or by `warren ctl scale`: a
    /// pipeline of a file may run another number than the instance's first.
    pub processors: AtomicU64,
    /// Messages per second it takes, 0 = no limit, as set at start or by `warren ctl rate`.
    pub rate_limit_per_s: AtomicU32,
    /// Batches the sinks finished, and the time they took in all (microseconds): the balancer's
    /// insert latency.
    pub batches: AtomicU64,
    pub insert_us: AtomicU64,
    /// Whether the stage's sink-outage breaker is open (counted in [`Stats::breakers_open`]).
    pub breaker_open: AtomicBool,
}

/// Every stage's counts; a stage appears with its first count (or [`preregister`]).
static STAGES: std::sync::RwLock<std::collections::BTreeMap<StageId, std::sync::Arc<StageStats>>> =
    std::sync::RwLock::new(std::collections::BTreeMap::new());

/// The stages a reload removed ([`forget`]) and none brought back ([`revive`]).
static FORGOTTEN: Mutex<std::collections::BTreeSet<StageId>> =
    Mutex::new(std::collections::BTreeSet::new());

/// The counts of `stage`, created on first use. A stage a reload removed is not made live
/// again by what its parts still count while they end (a consumer whose link has not closed
/// yet, a late publish outcome): they count into counts of their own, shown nowhere (review
/// R42b F7: the old name's stage stayed in the record and `warren status` after a rename).
pub fn stage(stage: &StageId) -> std::sync::Arc<StageStats> {
    if let Some(s) = STAGES.read().ok().and_then(|m| m.get(stage).cloned()) {
        return s;
    }
    if FORGOTTEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(stage)
    {
        return Default::default();
    }
    let mut map = STAGES
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    map.entry(stage.clone()).or_default().clone()
}

/// The process's message counts: every stage's summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub received: u64,
    pub inserted: u64,
    pub retried: u64,
    pub dead_lettered: u64,
}

/// The counts of the stages a reload removed ([`forget`]), so that the process's totals never
/// go back.
static RETIRED: Mutex<Totals> = Mutex::new(Totals {
    received: 0,
    inserted: 0,
    retried: 0,
    dead_lettered: 0,
});

/// The sums of every stage's counts, the removed ones' included.
pub fn totals() -> Totals {
    let retired = *RETIRED.lock().unwrap_or_else(|p| p.into_inner());
    stages().iter().fold(retired, |t, (_, s)| Totals {
        received: t.received + s.received.load(Ordering::Relaxed),
        inserted: t.inserted + s.inserted.load(Ordering::Relaxed),
        retried: t.retried + s.retried.load(Ordering::Relaxed),
        dead_lettered: t.dead_lettered + s.dead_lettered.load(Ordering::Relaxed),
    })
}

/// A stage a reload removed leaves the live stages (the registry's lines): its counts stay in
/// the process's totals, its open breaker (if any) no longer counts.
pub fn forget(id: &StageId) {
    FORGOTTEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id.clone());
    let gone = STAGES
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(id);
    let Some(s) = gone else { return };
    let mut retired = RETIRED.lock().unwrap_or_else(|p| p.into_inner());
    retired.received += s.received.load(Ordering::Relaxed);
    retired.inserted += s.inserted.load(Ordering::Relaxed);
    retired.retried += s.retried.load(Ordering::Relaxed);
    retired.dead_lettered += s.dead_lettered.load(Ordering::Relaxed);
    if s.breaker_open.swap(false, Ordering::Relaxed) {
        STATS.breakers_open.fetch_sub(1, Ordering::Relaxed);
    }
    gauge!(PIPELINE_CONCURRENCY, id.labels(&[])).set(0.0);
    gauge!(BREAKER_OPEN, id.labels(&[])).set(0.0);
}

/// `id`, removed by a reload, is added again: live again ([`stage`] creates its counts).
pub fn revive(id: &StageId) {
    FORGOTTEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(id);
    stage(id);
}

/// Every stage's counts, in the order of their names.
pub fn stages() -> Vec<(StageId, std::sync::Arc<StageStats>)> {
    STAGES
        .read()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

/// The database link as last seen: 0 unknown, 1 up, 2 down (to count reconnections).
static POSTGRES_STATE: AtomicU8 = AtomicU8::new(0);

/// Why the metrics recorder could not be installed: a bucket list the exporter refuses, or a
/// recorder already installed in this process.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the metrics recorder: {0}")]
pub struct InstallError(#[from] metrics_exporter_prometheus::BuildError);

/// Installs the Prometheus recorder, describes every series, and keeps the recorder's upkeep
/// running on the current runtime; the handle renders the scrape (served on `METRICS_ADDR` by
/// `http::ops`).
pub fn install() -> Result<PrometheusHandle, InstallError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(BATCH_SIZE.into()),
            &[
                1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
            ],
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(BATCH_INSERT_SECONDS.into()),
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                ],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(END_TO_END_SECONDS.into()),
                &[
                    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
                ],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(PUBLISH_CONFIRM_SECONDS.into()),
                &[
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0,
                ],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(HTTP_REQUEST_SECONDS.into()),
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
                ],
            )
        })
        .and_then(|b| b.install_recorder())?;
    // Drains the histograms' pending samples into their buckets, as the exporter's own
    // listener did every 5 s.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    describe();
    Ok(handle)
}

fn describe() {
    describe_counter!(
        RECEIVED,
        "Deliveries taken from the queue, by pipeline and stage (main, dlq)."
    );
    describe_counter!(
        INSERTED,
        "Rows committed (new or already present), by pipeline and stage."
    );
    describe_counter!(
        RETRIED,
        "Messages republished to the retry queue, by pipeline, stage and reason."
    );
    describe_counter!(
        DEAD_LETTERED,
        "Messages published to the DLX, by pipeline, stage and x-error-kind."
    );
    describe_counter!(
        PARKED,
        "Messages parked in the dead_letters table, by pipeline, stage and kind."
    );
    describe_counter!(
        OUTCOMES,
        "Messages acked without being counted as inserted, by pipeline, stage and outcome \
         (stale: older than the version its key holds or its batch writes, it changed nothing; \
         deleted: a delete that holds, its key's row and child rows gone)."
    );
    describe_histogram!(BATCH_SIZE, "Valid messages per batch insert.");
    describe_gauge!(
        PIPELINE_CONCURRENCY,
        "Batch inserts in flight at most (batchers in use), as balancing or an operator set it."
    );
    describe_counter!(
        BALANCE_DECISIONS,
        "Changes of a pipeline's concurrency, by reason (start, backlog, idle, no_gain, budget, operator)."
    );
    describe_histogram!(
        BATCH_INSERT_SECONDS,
        "Time to insert one batch, including splits and in-place retries."
    );
    describe_histogram!(
        END_TO_END_SECONDS,
        "From the publish time (x-published-ms, else the AMQP timestamp) of the oldest message \
         of a batch to the commit of that batch; one sample per batch."
    );
    describe_gauge!(
        INFLIGHT,
        "Deliveries received but not yet acked or requeued."
    );
    describe_gauge!(
        INFLIGHT_BYTES,
        "Bytes of messages (bodies and parsed properties) received and not yet acked or \
         requeued, by pipeline (accepted ones bounded by MAX_INFLIGHT_BYTES; beside them at most \
         one body over MAX_MESSAGE_BYTES, being parked)."
    );
    describe_gauge!(
        OVERSIZE_PERMIT_WAITING,
        "1 while the stage waits for the process's one permit to hold a body over \
         MAX_MESSAGE_BYTES (another stage holds one): it takes no deliveries meanwhile."
    );
    describe_gauge!(
        QUEUE_MESSAGES,
        "Messages ready in the main, retry and DLQ queues (passive declare every few seconds)."
    );
    describe_gauge!(
        QUEUE_CONSUMERS,
        "Consumers of the main, retry and DLQ queues."
    );
    describe_counter!(
        PUBLISHED,
        "Publishes by outcome (confirmed, unroutable, nacked, unavailable, timeout, unpublishable)."
    );
    describe_histogram!(PUBLISH_CONFIRM_SECONDS, "From publish to broker confirm.");
    describe_gauge!(
        CONNECTION_UP,
        "1 while the connection to the target (amqp, postgres, redis) is up."
    );
    describe_gauge!(
        AMQP_NODE_INFO,
        "1 for the broker node (host:port) each AMQP link (consumer or publisher, by name) is \
         connected to; 0 for a node it left, and while the link is down."
    );
    describe_counter!(
        RECONNECTS,
        "Reconnections to the target (amqp, postgres, redis)."
    );
    describe_counter!(HTTP_REQUESTS, "HTTP requests by route and status.");
    describe_histogram!(HTTP_REQUEST_SECONDS, "HTTP request duration.");
    describe_gauge!(
        BUILD_INFO,
        "Always 1; the version label says which build runs."
    );
    describe_gauge!(
        BREAKER_OPEN,
        "1 while the sink-outage breaker holds the pipeline's consumer."
    );
    describe_counter!(
        CONSUMER_RESTARTS,
        "Consumer links rebuilt, by pipeline and reason (connection_lost, cancelled, stuck, \
         parse_error, frame_too_large); each rebuild after a short-lived link waits a growing backoff."
    );
    describe_counter!(
        REQUEUED,
        "Messages given back to their queue (nack with requeue) after a backoff, by pipeline and \
         reason (publish_failed: a retry or dead-letter republish was not confirmed; db_unavailable: \
         the DLQ consumer found no database; copy_pending: a redelivery whose earlier copy was \
         still being published after the wait; stopping: at once at a stop, what the database did \
         not take for a passing reason, no retry spent)."
    );
    describe_counter!(
        REDELIVERIES,
        "Copies whose ack was lost with the consumer's link, by pipeline, stage and outcome \
         (already_routed: the redelivery was acked instead of routed again; forgotten: past twice \
         the prefetch, the oldest were forgotten and their redeliveries are routed again)."
    );
    describe_counter!(
        ACKS,
        "basic.ack frames sent, by pipeline (each acks a contiguous run of deliveries)."
    );
    describe_counter!(
        LOG_LINES_DROPPED,
        "Log lines that could not be written to stderr (its pipe's reader is gone, a full disk) \
         and were dropped; warren goes on without them."
    );
    describe_counter!(
        EVENTS_DROPPED,
        "Lifecycle events not written to the Redis stream, by reason (full: more waited than the \
         writer holds, Redis slow or away; redis: the write failed). The data path never waits \
         for them."
    );
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// A log line could not be written to stderr and was dropped. It counts, and says nothing:
/// where would it say it?
pub fn log_line_dropped() {
    counter!(LOG_LINES_DROPPED).increment(1);
}

/// `n` lifecycle events were dropped for `reason` (`full`, `redis`).
pub fn events_dropped(reason: &'static str, n: u64) {
    counter!(EVENTS_DROPPED, "reason" => reason).increment(n);
}

/// A pipeline's consumer link is rebuilt, for `reason`.
pub fn consumer_restart(stage: &StageId, reason: &'static str) {
    counter!(CONSUMER_RESTARTS, stage.labels(&[("reason", reason)])).increment(1);
}

/// `n` messages of a stage are given back to their queue, for `reason`.
pub fn requeued(stage: &StageId, reason: &'static str, n: u64) {
    counter!(REQUEUED, stage.labels(&[("reason", reason)])).increment(n);
}

/// `n` copies whose ack was lost with the consumer's link ended this way (`already_routed`,
/// `forgotten`), or redeliveries of acks a stage a reload replaced may have lost
/// (`settled_before_reload`, `waits_for_retired_table`).
pub fn redeliveries(stage: &StageId, outcome: &'static str, n: u64) {
    counter!(REDELIVERIES, stage.labels(&[("outcome", outcome)])).increment(n);
}

/// The received counter of a stage, resolved once (it is hit per message).
pub fn received_counter(stage: &StageId) -> Counter {
    counter!(RECEIVED, stage.labels(&[]))
}

/// The in-flight gauge (all pipelines), resolved once.
pub fn inflight_gauge() -> Gauge {
    gauge!(INFLIGHT)
}

/// The bytes-in-flight gauge of `stage`, resolved once by its consumer.
pub fn inflight_bytes_gauge(stage: &StageId) -> Gauge {
    gauge!(INFLIGHT_BYTES, stage.labels(&[]))
}

/// The gauge of `stage` waiting for the permit to hold a body over `MAX_MESSAGE_BYTES`,
/// resolved once by its consumer.
pub fn oversize_waiting_gauge(stage: &StageId) -> Gauge {
    gauge!(OVERSIZE_PERMIT_WAITING, stage.labels(&[]))
}

/// `n` deliveries entered (`n > 0`) or left (`n < 0`) the pipeline.
pub fn inflight(gauge: &Gauge, n: i64) {
    STATS.inflight.fetch_add(n, Ordering::Relaxed);
    if n >= 0 {
        gauge.increment(n as f64);
    } else {
        gauge.decrement((-n) as f64);
    }
}

/// A body the domain refused (it is dead-lettered or parked next). The reason and the id come
/// from the message: the line shows them capped (`text::shown`, as the parking table
/// caps a reason), so a refusal's log line never grows with what a publisher sends.
pub fn message_refused(
    stage: &StageId,
    kind: &str,
    reason: &str,
    message_id: &str,
    delivery_tag: u64,
) {
    use crate::text::shown;
    let (reason, message_id) = (shown(reason), shown(message_id));
    warn!(
        message_id = &*message_id,
        pipeline = stage.pipeline(),
        stage = stage.stage().as_str(),
        delivery_tag,
        kind,
        reason = &*reason,
        "message refused"
    );
}

/// The `basic.ack` counter of a stage, resolved once (hit per ack frame, not per message).
pub fn acks_counter(stage: &StageId) -> Counter {
    counter!(ACKS, stage.labels(&[]))
}

/// One batch insert finished: `attempted` valid rows, `inserted` of them committed.
pub fn batch_inserted(id: &StageId, attempted: usize, inserted: usize, took: Duration) {
    histogram!(BATCH_SIZE, id.labels(&[])).record(attempted as f64);
    histogram!(BATCH_INSERT_SECONDS, id.labels(&[])).record(took.as_secs_f64());
    counter!(INSERTED, id.labels(&[])).increment(inserted as u64);
    let stats = stage(id);
    stats.inserted.fetch_add(inserted as u64, Ordering::Relaxed);
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats
        .insert_us
        .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
}

/// A stage's batch inserts in flight at most, set to `to` (at start, by the balancer, or by an
/// operator) for `reason`: the gauge, and the decision counted by reason.
pub fn concurrency(id: &StageId, to: usize, reason: &'static str) {
    gauge!(PIPELINE_CONCURRENCY, id.labels(&[])).set(to as f64);
    counter!(BALANCE_DECISIONS, id.labels(&[("reason", reason)])).increment(1);
    stage(id).concurrency.store(to as u64, Ordering::Relaxed);
}

/// The database answered (`up`) or could not be reached; counts reconnections.
pub fn postgres(up: bool) {
    let now = if up { 1 } else { 2 };
    let was = POSTGRES_STATE.swap(now, Ordering::Relaxed);
    if was != now {
        connection("postgres", up);
        if up && was == 2 {
            reconnected("postgres");
        }
    }
}

/// End-to-end latency of a committed batch: from the publish time (Unix ms) of its oldest
/// message to now. One sample per batch, not per message.
pub fn end_to_end(oldest_published_ms: Option<u64>) {
    let Some(published) = oldest_published_ms else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    histogram!(END_TO_END_SECONDS).record(now.saturating_sub(published) as f64 / 1000.0);
}

/// A message was republished (retry queue or DLX) and confirmed: logs a dead-letter (the
/// counts go through [`messages_routed`], once per batch).
pub fn message_routed(
    stage: &StageId,
    kind: &'static str,
    message_id: &str,
    delivery_tag: u64,
    traceparent: Option<&str>,
) {
    if !is_retry_kind(kind) {
        // The id is a short string (255 bytes at most) and a traceparent is carried only up to
        // 512 bytes (`amqp::headers::TRACEPARENT_MAX`): both bounded already.
        warn!(
            message_id,
            pipeline = stage.pipeline(),
            stage = stage.stage().as_str(),
            delivery_tag,
            kind,
            traceparent,
            "message dead-lettered"
        );
    }
}

/// Whether a route's `kind` sends the message round to be tried again (`retry`, `dlq_retry`,
/// or `wait`: asked again once a locked retired table may answer), not to the DLQ.
pub fn is_retry_kind(kind: &str) -> bool {
    matches!(kind, "retry" | "dlq_retry" | "wait")
}

/// `n` messages of one batch were republished as `kind` (`retry`, `dlq_retry`, `wait` or an
/// `x-error-kind`). A `wait` is counted where it is decided
/// (`warren_redeliveries_total{outcome="waits_for_retired_table"}`), not as a retry: no
/// transient error, no retry or attempt spent (review R47a F7).
pub fn messages_routed(id: &StageId, kind: &'static str, n: u64) {
    if kind == "wait" {
        return;
    }
    if kind == "retry" || kind == "dlq_retry" {
        counter!(RETRIED, id.labels(&[("reason", "db_transient")])).increment(n);
        stage(id).retried.fetch_add(n, Ordering::Relaxed);
    } else {
        counter!(DEAD_LETTERED, id.labels(&[("kind", kind)])).increment(n);
        stage(id).dead_lettered.fetch_add(n, Ordering::Relaxed);
    }
}

/// `n` messages of `kind` of stage `id` were parked in `dead_letters`.
pub fn messages_parked(id: &StageId, kind: &'static str, n: u64) {
    counter!(PARKED, id.labels(&[("kind", kind)])).increment(n);
    STATS.parked.fetch_add(n, Ordering::Relaxed);
}

/// Of one batch of stage `id`, `stale` messages changed nothing (older than their key's
/// version) and `deleted` were deletes that hold: acked, not counted as inserted.
pub fn messages_settled(id: &StageId, stale: u64, deleted: u64) {
    counter!(OUTCOMES, id.labels(&[("outcome", "stale")])).increment(stale);
    counter!(OUTCOMES, id.labels(&[("outcome", "deleted")])).increment(deleted);
}

/// The sink-outage breaker of `id` opened or closed.
pub fn breaker(id: &StageId, open: bool) {
    gauge!(BREAKER_OPEN, id.labels(&[])).set(if open { 1.0 } else { 0.0 });
    let was = stage(id).breaker_open.swap(open, Ordering::Relaxed);
    match (was, open) {
        (false, true) => STATS.breakers_open.fetch_add(1, Ordering::Relaxed),
        (true, false) => STATS.breakers_open.fetch_sub(1, Ordering::Relaxed),
        _ => 0,
    };
}

/// A publish finished with `outcome` (`confirmed`, `unroutable`, `nacked`, `timeout`,
/// `unpublishable`, `unavailable`): counts it, and times confirmed ones.
pub fn published(outcome: &'static str, took: Duration) {
    counter!(PUBLISHED, "outcome" => outcome).increment(1);
    if outcome == "confirmed" {
        histogram!(PUBLISH_CONFIRM_SECONDS).record(took.as_secs_f64());
    }
}

pub use links::*;

/// Registers the labelled series that exist from the start at 0, so dashboards show 0 rather
/// than "no data" before the first event.
pub fn preregister(stages: &[StageId]) {
    stages.iter().for_each(preregister_stage);
    for outcome in [
        "confirmed",
        "unroutable",
        "nacked",
        "unavailable",
        "timeout",
        "unpublishable",
    ] {
        counter!(PUBLISHED, "outcome" => outcome).absolute(0);
    }
    for target in ["amqp", "postgres", "redis"] {
        counter!(RECONNECTS, "target" => target).absolute(0);
    }
    gauge!(INFLIGHT).set(0.0);
    counter!(LOG_LINES_DROPPED).absolute(0);
}

/// Registers one stage's labelled series at 0 (at start, or when a reload adds the stage):
/// called once per stage in a process, since it sets its counters to 0.
pub fn preregister_stage(p: &StageId) {
    revive(p);
    counter!(RECEIVED, p.labels(&[])).absolute(0);
    counter!(INSERTED, p.labels(&[])).absolute(0);
    counter!(RETRIED, p.labels(&[("reason", "db_transient")])).absolute(0);
    for kind in ErrorKind::ALL {
        counter!(DEAD_LETTERED, p.labels(&[("kind", kind.as_str())])).absolute(0);
        counter!(PARKED, p.labels(&[("kind", kind.as_str())])).absolute(0);
    }
    for outcome in ["stale", "deleted"] {
        counter!(OUTCOMES, p.labels(&[("outcome", outcome)])).absolute(0);
    }
    for reason in [
        "publish_failed",
        "db_unavailable",
        "copy_pending",
        "stopping",
    ] {
        counter!(REQUEUED, p.labels(&[("reason", reason)])).absolute(0);
    }
    for outcome in ["already_routed", "forgotten"] {
        counter!(REDELIVERIES, p.labels(&[("outcome", outcome)])).absolute(0);
    }
    for reason in [
        "connection_lost",
        "cancelled",
        "stuck",
        "parse_error",
        "frame_too_large",
    ] {
        counter!(CONSUMER_RESTARTS, p.labels(&[("reason", reason)])).absolute(0);
    }
    gauge!(BREAKER_OPEN, p.labels(&[])).set(0.0);
    gauge!(OVERSIZE_PERMIT_WAITING, p.labels(&[])).set(0.0);
    counter!(ACKS, p.labels(&[])).absolute(0);
}

/// A reconnection to `target` succeeded.
pub fn reconnected(target: &'static str) {
    counter!(RECONNECTS, "target" => target).increment(1);
}

/// A poll of `queue` found `messages` ready and `consumers` consumers
/// (`warren_queue_messages`, `warren_queue_consumers`).
pub fn queue_polled(queue: &str, messages: u32, consumers: u32) {
    gauge!(QUEUE_MESSAGES, "queue" => queue.to_string()).set(messages as f64);
    gauge!(QUEUE_CONSUMERS, "queue" => queue.to_string()).set(consumers as f64);
}

/// The queues no longer polled since a reload removed (or moved) their pipelines: their series
/// leave the scrape ([`render`]). The exporter has no way to delete a series (the
/// metrics-exporter-prometheus 0.18 handle only renders; metrics-rs issue 243), and an idle
/// timeout would drop every series not updated for a while, the counters at 0 among them.
static UNPOLLED: Mutex<std::collections::BTreeSet<String>> =
    Mutex::new(std::collections::BTreeSet::new());

/// `gone` are no longer polled, `polled` are (again): the series of the first leave the scrape,
/// those of the second are back with their next poll. Exported at 0, a queue of a removed
/// pipeline fired WarrenMainQueueNoConsumers (critical) for a pipeline that no longer exists
/// (review R44 F8); frozen at their last value, a depth alert (review R35g F2).
pub fn queues_polled(polled: &[String], gone: &[String]) {
    let mut unpolled = UNPOLLED.lock().unwrap_or_else(|p| p.into_inner());
    for queue in gone {
        queue_polled(queue, 0, 0);
        unpolled.insert(queue.clone());
    }
    for queue in polled {
        unpolled.remove(queue);
    }
}

/// The scrape: what `handle` renders, without the series of the queues no longer polled
/// ([`queues_polled`]).
pub fn render(handle: &PrometheusHandle) -> String {
    let text = handle.render();
    let unpolled = UNPOLLED.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if unpolled.is_empty() {
        return text;
    }
    without_queues(&text, &unpolled)
}

/// `text` without the lines of `warren_queue_messages` and `warren_queue_consumers` of the
/// queues `gone` (each line `name{queue="..."} value`, the value escaped as the exporter
/// writes it).
fn without_queues(text: &str, gone: &std::collections::BTreeSet<String>) -> String {
    use metrics_exporter_prometheus::formatting::sanitize_label_value;
    let series: std::collections::HashSet<String> = gone
        .iter()
        .flat_map(|q| {
            let value = sanitize_label_value(q);
            [QUEUE_MESSAGES, QUEUE_CONSUMERS].map(|name| format!("{name}{{queue=\"{value}\"}} "))
        })
        .collect();
    text.split_inclusive('\n')
        .filter(|line| {
            let series_of = if line.starts_with("warren_queue_") {
                line.rfind("} ").map(|end| &line[..end + 2])
            } else {
                None
            };
            !series_of.is_some_and(|s| series.contains(s))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{STATS, Stage, StageId};

    /// Review R42b F7: what a removed stage's parts count while they end does not bring it
    /// back among the live stages (the record, `warren status`); adding it again does.
    #[test]
    fn a_forgotten_stage_stays_gone_until_revived() {
        let id = StageId::new("forgotten_stage_test", Stage::Main);
        let live = |id: &StageId| super::stages().iter().any(|(s, _)| s == id);
        super::preregister_stage(&id);
        assert!(live(&id));
        super::forget(&id);
        assert!(!live(&id));
        super::messages_routed(&id, "retry", 1);
        super::stage(&id)
            .received
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(!live(&id), "made live again by a late count");
        super::revive(&id);
        assert!(live(&id));
        super::forget(&id);
    }
    use std::sync::atomic::Ordering;

    #[test]
    fn a_stage_is_its_pipeline_and_its_kind_whatever_the_names() {
        let dlq = StageId::new("orders_dlq", Stage::Main);
        assert_eq!(dlq.pipeline(), "orders_dlq");
        assert_eq!(
            dlq.stage(),
            Stage::Main,
            "a name ending in _dlq is not a DLQ"
        );
        assert_eq!(dlq.to_string(), "orders_dlq/main");
        let labels: Vec<(String, String)> = StageId::new("users", Stage::Dlq)
            .labels(&[("reason", "stuck")])
            .iter()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(
            labels,
            [
                pair("pipeline", "users"),
                pair("stage", "dlq"),
                pair("reason", "stuck")
            ]
        );
        assert!(StageId::new("a", Stage::Main) < StageId::new("a", Stage::Dlq));
    }

    /// Review R44 F8: the series of the queues no longer polled leave the scrape, exactly
    /// theirs: another queue whose name starts the same, and every other series, stay.
    #[test]
    fn the_series_of_queues_no_longer_polled_leave_the_scrape() {
        let text = "# TYPE warren_queue_consumers gauge\n\
                    warren_queue_consumers{queue=\"refunds_queue\"} 0\n\
                    warren_queue_consumers{queue=\"refunds_queue_2\"} 1\n\
                    warren_queue_consumers{queue=\"q\\\"x\"} 0\n\
                    # TYPE warren_queue_messages gauge\n\
                    warren_queue_messages{queue=\"refunds_queue\"} 5\n\
                    warren_queue_messages{queue=\"orders_queue\"} 3\n\
                    warren_messages_received_total{pipeline=\"refunds\",stage=\"main\"} 7\n";
        let gone = ["refunds_queue".to_string(), "q\"x".to_string()]
            .into_iter()
            .collect();
        assert_eq!(
            super::without_queues(text, &gone),
            "# TYPE warren_queue_consumers gauge\n\
             warren_queue_consumers{queue=\"refunds_queue_2\"} 1\n\
             # TYPE warren_queue_messages gauge\n\
             warren_queue_messages{queue=\"orders_queue\"} 3\n\
             warren_messages_received_total{pipeline=\"refunds\",stage=\"main\"} 7\n"
        );
    }

    /// Two stages' breakers are counted apart: one closing leaves the other open (a bit per
    /// stage name once lumped every configured pipeline together).
    #[test]
    fn each_stages_breaker_is_counted_once() {
        let (a, b) = (
            StageId::new("breaker_test_a", Stage::Main),
            StageId::new("breaker_test_b", Stage::Dlq),
        );
        let open = || STATS.breakers_open.load(Ordering::Relaxed);
        let before = open();
        super::breaker(&a, true);
        super::breaker(&a, true);
        super::breaker(&b, true);
        assert_eq!(open(), before + 2);
        super::breaker(&a, false);
        assert_eq!(open(), before + 1, "b is still open");
        super::breaker(&b, false);
        super::breaker(&b, false);
        assert_eq!(open(), before);
    }
}
