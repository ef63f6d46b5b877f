//! `warren run [--declare] [--roles consumer,dlq,api]`: run the roles until SIGTERM or SIGINT,
//! then shut down gracefully in the pipeline's fixed order. A second signal exits at once.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tracing::{info, warn};

use crate::config::Settings;
use crate::domain::users::Users;
use crate::pipeline::{self, batcher::Mode};
use crate::topology::Topology;
use crate::{db, http, metrics};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Declare the topology and apply migrations first (idempotent).
    #[arg(long)]
    pub declare: bool,
    /// Comma-separated subset of consumer,dlq,api (overrides ROLES).
    #[arg(long, value_name = "ROLES")]
    pub roles: Option<String>,
}

/// Resolves on the first SIGTERM or SIGINT; a second one exits the process at once (the broker
/// redelivers whatever was not acked).
pub async fn signals() {
    wait_signal().await;
    tokio::spawn(async {
        wait_signal().await;
        eprintln!("warren: second signal, exiting now");
        std::process::exit(130);
    });
}

async fn wait_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs until `shutdown` resolves, then stops gracefully. Tests pass their own trigger.
pub async fn execute(
    settings: Settings,
    args: Args,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<i32> {
    let metrics_addr: SocketAddr = settings.metrics_addr.parse().context("METRICS_ADDR")?;
    metrics::install(metrics_addr).map_err(anyhow::Error::msg)?;

    if args.declare {
        let topology = Topology::from_settings(&settings)?;
        crate::cli::declare::declare_all(&settings, &topology, false).await?;
        info!("topology declared and migrations applied");
    }

    let pool = db::pool(&settings)?;
    let domain = Arc::new(Users);
    let mut pipelines = Vec::new();
    if settings.has_role("consumer") {
        pipelines.push(pipeline::start(
            &settings,
            domain.clone(),
            pool.clone(),
            Mode::Main,
        ));
    }
    if settings.has_role("dlq") {
        pipelines.push(pipeline::start(
            &settings,
            domain.clone(),
            pool.clone(),
            Mode::Dlq,
        ));
    }
    let api = if settings.has_role("api") {
        Some(http::serve(&settings, pool.clone()).await?)
    } else {
        None
    };
    info!(roles = %settings.roles, version = env!("CARGO_PKG_VERSION"), "warren running");

    shutdown.await;
    info!(timeout_ms = settings.shutdown_timeout_ms, "shutting down");

    let timeout = settings.shutdown_timeout();
    let results = futures::future::join_all(pipelines.iter().map(|p| p.shutdown(timeout))).await;
    if let Some(api) = api {
        api.stop().await;
    }
    if results.iter().all(|drained| *drained) {
        info!("stopped cleanly");
    } else {
        warn!("stopped with messages still in flight; the broker redelivers them");
    }
    Ok(0)
}
