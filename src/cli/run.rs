//! `warren run [--declare] [--roles consumer,dlq,api]`: run the roles until SIGTERM or SIGINT,
//! then shut down gracefully in the pipeline's fixed order. A second signal exits at once; a
//! shutdown that reached SHUTDOWN_TIMEOUT_MS with messages in flight exits 1.

use std::future::Future;

use tracing::info;

use crate::config::Settings;
use crate::topology::Topology;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Declare the topology and apply migrations first (idempotent).
    #[arg(long)]
    pub declare: bool,
    /// Comma-separated subset of consumer,dlq,api (overrides ROLES).
    #[arg(long, value_name = "ROLES")]
    pub roles: Option<String>,
}

/// Installs the SIGTERM and SIGINT handlers now (so a signal during start-up is not fatal) and
/// returns a future that resolves on the first one; a second one exits the process at once (the
/// broker redelivers whatever was not acked).
pub fn signals() -> impl Future<Output = ()> {
    use tokio::signal::unix::{Signal, SignalKind, signal};
    let streams: Option<(Signal, Signal)> = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(term), Ok(int)) => Some((term, int)),
        _ => None,
    };
    async move {
        let Some((mut term, mut int)) = streams else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            crate::cli::say(format_args!("second signal, exiting now"));
            std::process::exit(130);
        });
    }
}

/// Declares first if asked, then runs the roles until `shutdown` resolves (`app::run`). Tests
/// pass their own trigger.
pub async fn execute(
    settings: Settings,
    args: Args,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<i32> {
    if args.declare {
        let topology = Topology::from_settings(&settings)?;
        crate::cli::declare::declare_all(&settings, &topology, false).await?;
        info!("topology declared and migrations applied");
    }
    crate::app::run(settings, shutdown).await
}
