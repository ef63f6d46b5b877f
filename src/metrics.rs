//! Every metric warren exports, with its labels, described once; and one function per event
//! that both logs and counts it. Labels stay low-cardinality: `pipeline`, `kind`, `reason`.

use std::net::SocketAddr;
use std::time::Duration;

use metrics::{
    Counter, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tracing::warn;

use crate::pipeline::processor::Delivered;

pub const RECEIVED: &str = "warren_messages_received_total";
pub const INSERTED: &str = "warren_messages_inserted_total";
pub const RETRIED: &str = "warren_messages_retried_total";
pub const DEAD_LETTERED: &str = "warren_messages_dead_lettered_total";
pub const PARKED: &str = "warren_messages_parked_total";
pub const BATCH_SIZE: &str = "warren_batch_size";
pub const BATCH_INSERT_SECONDS: &str = "warren_batch_insert_seconds";
pub const END_TO_END_SECONDS: &str = "warren_end_to_end_seconds";
pub const INFLIGHT: &str = "warren_inflight_messages";
pub const PUBLISHED: &str = "warren_published_total";
pub const PUBLISH_CONFIRM_SECONDS: &str = "warren_publish_confirm_seconds";
pub const CONNECTION_UP: &str = "warren_connection_up";
pub const RECONNECTS: &str = "warren_reconnects_total";
pub const HTTP_REQUESTS: &str = "warren_http_requests_total";
pub const HTTP_REQUEST_SECONDS: &str = "warren_http_request_seconds";
pub const BUILD_INFO: &str = "warren_build_info";
pub const BREAKER_OPEN: &str = "warren_breaker_open";

/// Starts the Prometheus endpoint on `addr` and describes every series.
pub fn install(addr: SocketAddr) -> Result<(), String> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
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
        .and_then(|b| b.install())
        .map_err(|e| format!("METRICS_ADDR {addr}: {e}"))?;
    describe();
    Ok(())
}

fn describe() {
    describe_counter!(
        RECEIVED,
        "Deliveries taken from the queue, by pipeline (main, dlq)."
    );
    describe_counter!(
        INSERTED,
        "Rows committed (new or already present), by pipeline."
    );
    describe_counter!(
        RETRIED,
        "Messages republished to the retry queue, by pipeline and reason."
    );
    describe_counter!(
        DEAD_LETTERED,
        "Messages published to the DLX, by pipeline and x-error-kind."
    );
    describe_counter!(
        PARKED,
        "Messages parked in the dead_letters table by the DLQ consumer, by kind."
    );
    describe_histogram!(BATCH_SIZE, "Valid messages per batch insert.");
    describe_histogram!(
        BATCH_INSERT_SECONDS,
        "Time to insert one batch, including splits and in-place retries."
    );
    describe_histogram!(
        END_TO_END_SECONDS,
        "From the message timestamp to the commit of its row."
    );
    describe_gauge!(
        INFLIGHT,
        "Deliveries received but not yet acked or requeued."
    );
    describe_counter!(
        PUBLISHED,
        "Publishes by outcome (confirmed, unroutable, nacked, unavailable, timeout)."
    );
    describe_histogram!(PUBLISH_CONFIRM_SECONDS, "From publish to broker confirm.");
    describe_gauge!(
        CONNECTION_UP,
        "1 while the connection to the target (amqp, postgres, redis) is up."
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
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// The received counter of a pipeline, resolved once (it is hit per message).
pub fn received_counter(pipeline: &'static str) -> Counter {
    counter!(RECEIVED, "pipeline" => pipeline)
}

/// The in-flight gauge, shared by the pipelines.
pub fn set_inflight(pipeline: &'static str, n: usize) {
    gauge!(INFLIGHT, "pipeline" => pipeline).set(n as f64);
}

/// A body the domain refused (it is dead-lettered or parked next).
pub fn message_refused(pipeline: &'static str, kind: &str, reason: &str, delivery_tag: u64) {
    warn!(pipeline, delivery_tag, kind, reason, "message refused");
}

/// One batch insert finished: `attempted` valid rows, `inserted` of them committed.
pub fn batch_inserted(pipeline: &'static str, attempted: usize, inserted: usize, took: Duration) {
    histogram!(BATCH_SIZE, "pipeline" => pipeline).record(attempted as f64);
    histogram!(BATCH_INSERT_SECONDS, "pipeline" => pipeline).record(took.as_secs_f64());
    counter!(INSERTED, "pipeline" => pipeline).increment(inserted as u64);
}

/// End-to-end latency of rows committed now, from their message timestamps (seconds).
pub fn end_to_end(timestamps: impl Iterator<Item = u64>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let h = histogram!(END_TO_END_SECONDS);
    for ts in timestamps {
        if ts > 0 {
            h.record((now - ts as f64).max(0.0));
        }
    }
}

/// A message was republished (retry queue or DLX) and confirmed.
pub fn message_routed(pipeline: &'static str, kind: &'static str, message: &Delivered) {
    if kind == "retry" {
        counter!(RETRIED, "pipeline" => pipeline, "reason" => "db_transient").increment(1);
    } else {
        warn!(
            pipeline,
            delivery_tag = message.tag,
            kind,
            "message dead-lettered"
        );
        counter!(DEAD_LETTERED, "pipeline" => pipeline, "kind" => kind).increment(1);
    }
}

/// The DLQ consumer parked a message in `dead_letters`.
pub fn message_parked(kind: &'static str) {
    counter!(PARKED, "kind" => kind).increment(1);
}

/// The sink-outage breaker of `pipeline` opened or closed.
pub fn breaker(pipeline: &'static str, open: bool) {
    gauge!(BREAKER_OPEN, "pipeline" => pipeline).set(if open { 1.0 } else { 0.0 });
}

/// A publish finished with `outcome`.
pub fn published(outcome: &'static str, took: Duration) {
    counter!(PUBLISHED, "outcome" => outcome).increment(1);
    if outcome == "confirmed" {
        histogram!(PUBLISH_CONFIRM_SECONDS).record(took.as_secs_f64());
    }
}

/// A connection to `target` came up or went down.
pub fn connection(target: &'static str, up: bool) {
    gauge!(CONNECTION_UP, "target" => target).set(if up { 1.0 } else { 0.0 });
}

/// A reconnection to `target` succeeded.
pub fn reconnected(target: &'static str) {
    counter!(RECONNECTS, "target" => target).increment(1);
}
