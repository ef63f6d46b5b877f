//! The sink-outage breaker: after `BREAKER_FAILURES` consecutive batches the database took
//! nothing of (or at once on a systemic error), the consumer is held (no new deliveries) and a
//! probe runs the domain's insert of zero rows with backoff until the database takes it again,
//! each attempt on a connection made after the breaker opened (a failover leaves the pool's
//! old ones on a server that takes no writes); then the hold is lifted. A stopping stage
//! counts nothing and never opens it: what fails then is the stop's doing (statements it
//! cancelled near the drain's deadline, statements it no longer starts), not the database's,
//! and its consumer takes nothing more anyway.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use actix::Recipient;
use backon::Retryable;
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::message::{Hold, HoldReason};
use crate::db::DbError;
use crate::domain::Domain;
use crate::metrics;

/// One pipeline's breaker, shared by its sinks.
pub struct Breaker {
    /// The pipeline and which of its stages: the labels of its logs and its gauge.
    stage: metrics::StageId,
    /// Consecutive failing batches that open it; `None` = this pipeline never opens it on
    /// failures (the DLQ consumer backs off per message instead), only on systemic errors.
    threshold: Option<u32>,
    /// Consecutive batches the database took nothing of.
    failures: AtomicU32,
    /// Whether it is open (a probe task is running).
    open: AtomicBool,
    /// The consumer, held while the breaker is open.
    hold: Recipient<Hold>,
    /// Ends the probe at shutdown.
    stopping: CancellationToken,
}

impl Breaker {
    pub fn new(
        stage: metrics::StageId,
        threshold: Option<u32>,
        hold: Recipient<Hold>,
        stopping: CancellationToken,
    ) -> Self {
        Self {
            stage,
            threshold,
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            hold,
            stopping,
        }
    }

    /// Counts one batch: `inserted` rows committed, `transient` the reason when rows failed
    /// transiently. A batch that lost one bad row and committed the rest is a sign of health.
    /// Once the stage stops, nothing counts: its failures are the stop's (a statement it
    /// cancelled fails with SQLSTATE 57014, one it no longer starts as refused), and three of
    /// them opened the breaker on a healthy database, with a log line saying it kept failing.
    pub fn record<D: Domain>(
        self: &Arc<Self>,
        inserted: usize,
        transient: Option<&str>,
        domain: &Arc<D>,
        pool: &Pool,
    ) {
        if self.stopping.is_cancelled() {
            return;
        }
        match transient {
            Some(reason) if inserted == 0 => {
                let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
                if self.threshold.is_some_and(|t| failures >= t) {
                    self.trip(reason, domain, pool);
                }
            }
            _ if inserted > 0 => self.failures.store(0, Ordering::Relaxed),
            _ => {}
        }
    }

    /// Opens the breaker once: holds the consumer and starts the probe. Never once the stage
    /// stops: its consumer takes nothing more, and the probe would end at once.
    pub fn trip<D: Domain>(self: &Arc<Self>, reason: &str, domain: &Arc<D>, pool: &Pool) {
        if self.stopping.is_cancelled() || self.open.swap(true, Ordering::SeqCst) {
            return;
        }
        error!(
            pipeline = self.stage.pipeline(),
            stage = self.stage.stage().as_str(),
            reason,
            "sink-outage breaker OPEN: the database keeps failing; \
             consuming stops until it answers again"
        );
        metrics::breaker(&self.stage, true);
        crate::events::emit(
            Some(self.stage.pipeline()),
            crate::events::Kind::BreakerOpened {
                failures: self.failures.load(Ordering::Relaxed),
            },
        );
        self.hold.do_send(Hold {
            reason: HoldReason::Breaker,
            on: true,
        });
        let breaker = self.clone();
        let domain = domain.clone();
        let pool = pool.clone();
        tokio::spawn(async move { breaker.probe(domain, pool).await });
    }

    /// Probes with backoff until the database takes an empty insert, then closes.
    async fn probe<D: Domain>(self: Arc<Self>, domain: Arc<D>, pool: Pool) {
        let stopping = self.stopping.clone();
        let opened = std::time::Instant::now();
        let attempt = || async {
            // Each attempt on a connection made after the breaker opened: the ones the failures
            // came through may reach a server that no longer takes writes (a failover), and the
            // probe must find out whether the database as the URL names it takes them now.
            pool.retain(|_, m| m.created > opened);
            let client = pool.get().await.map_err(DbError::from_pool)?;
            let result = domain.insert(&client, &[]).await.map(|_| ());
            if result.is_err() {
                drop(deadpool_postgres::Object::take(client));
            }
            result
        };
        let (pipeline, stage) = (self.stage.pipeline(), self.stage.stage().as_str());
        let first = crate::amqp::reconnect_backoff().next().unwrap_or_default();
        if !super::sleep_or_cancel(first, &stopping).await {
            return;
        }
        let result = attempt
            .retry(crate::amqp::backoff_builder(
                std::time::Duration::from_millis(400),
                std::time::Duration::from_secs(10),
            ))
            .sleep(super::cancellable_sleep(stopping.clone()))
            .when(|_| !stopping.is_cancelled())
            .notify(
                |e, _| warn!(pipeline, stage, error = %e, "breaker probe: database still failing"),
            )
            .await;
        if result.is_err() {
            return;
        }
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::SeqCst);
        metrics::breaker(&self.stage, false);
        crate::events::emit(
            Some(self.stage.pipeline()),
            crate::events::Kind::BreakerClosed,
        );
        info!(
            pipeline = self.stage.pipeline(),
            stage = self.stage.stage().as_str(),
            "sink-outage breaker closed: the database answers; consuming again"
        );
        self.hold.do_send(Hold {
            reason: HoldReason::Breaker,
            on: false,
        });
    }
}
