//! The composition root of `warren run`: the metrics listener first ([`start_listener`], before
//! anything waits for a server), then the roles in order (pipelines with their queue poller and
//! balancer, [`pipelines`]; API, readiness, database probe, registry and remote control,
//! [`control`]); waits for the shutdown trigger or a remote `drain`, applying remote commands
//! and the operator signals (`SIGUSR1` pauses every pipeline, `SIGCONT` lifts that pause,
//! `SIGHUP` reloads the configuration's pipelines, [`signals`]) meanwhile, a reload running
//! beside the loop ([`reload`]), and stops them in order: pipelines
//! (each with its own fixed sequence, `pipeline::Pipeline::shutdown`), then the API, then the
//! registry. Errors of the boundaries
//! meet here, so it speaks `anyhow` like the CLI.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};

use crate::amqp::monitor::Depths;
use crate::config::{Role, Settings};
use crate::events::{self, Kind};
use crate::registry::{self, Command, Report, Status};
use crate::{db, http, metrics};
use control::ControlError;
use pipelines::Pipelines;
pub use pipelines::{Reload, ReloadError};

mod components;
mod control;
mod pipelines;
mod reload;
mod signals;

pub use signals::catch as catch_operator_signals;

/// How long the readiness probe waits for the database's answer (connecting included), and how
/// long between probes: a database that hangs reads as unreachable within twice this.
const READY_PROBE: Duration = Duration::from_secs(2);

/// Installs the metrics recorder and binds the metrics listener (`METRICS_ADDR`: `/metrics`,
/// `/healthz`, `/readyz`), before anything waits for a server: a warren waiting for its database
/// at start is alive (`/healthz` 200) and not ready (`/readyz` 503, the database down), so a
/// liveness probe does not restart it for waiting. The roles come later ([`run`]).
pub async fn start_listener(settings: &Settings) -> anyhow::Result<()> {
    let listener = settings.metrics_listener();
    listener.validate()?;
    let recorder = metrics::install()?;
    http::ops::serve(&listener, recorder).await?;
    // Every role uses the database, and it is not up until a probe or an insert says so.
    metrics::needs(&[], true);
    Ok(())
}

/// Under systemd (`Type=notify`): the start goes on for `by` more (`EXTEND_TIMEOUT_USEC`), so
/// the unit's `TimeoutStartSec=` does not stop, and restart in a loop, a warren that waits for a
/// server before its roles run and it says `READY=1`. A no-op when NOTIFY_SOCKET is unset.
pub fn extend_start(by: Duration) {
    let usec = u32::try_from(by.as_micros()).unwrap_or(u32::MAX);
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::ExtendTimeoutUsec(usec)]) {
        warn!(error = %e, "cannot tell systemd (NOTIFY_SOCKET) that the start goes on");
    }
}

/// Runs the roles of `settings` (the listener already up, [`start_listener`]) until `shutdown` resolves (or a remote `drain`), then stops
/// gracefully; meanwhile `SIGHUP` and `warren ctl reload` apply the configuration `reload` reads
/// again, beside the loop ([`reload::Reloads`]). The exit code is 0 after a complete drain, 1 when the shutdown
/// timeout left messages in flight.
pub async fn run(
    settings: Settings,
    reload: Reload,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<i32> {
    // Each component's own configuration, from the settings (`config::components`).
    let amqp = settings.amqp();
    amqp.validate()?;
    let registry_config = settings.registry();
    registry_config.validate()?;
    let events_config = settings.events();
    events_config.validate()?;
    let shutdown_config = settings.shutdown();
    shutdown_config.validate()?;
    if registry_config.secret().is_none() {
        warn!(
            "CONTROL_SECRET is not set: anyone with write access to Redis can pause, drain or scale this instance; set CONTROL_SECRET (the same on every instance and for `warren ctl`) to accept only signed commands"
        );
    }
    // SIGUSR1 / SIGCONT pause and resume every pipeline, SIGHUP reloads: caught since the
    // process started (`signals::catch`), handed over in their order once the loop runs.
    let mut operator = signals::OperatorSignals::listen()
        .map_err(|e| anyhow::anyhow!("cannot listen for SIGUSR1, SIGCONT and SIGHUP: {e}"))?;
    events::start(&events_config);
    events::emit(
        None,
        Kind::Started {
            version: env!("CARGO_PKG_VERSION").into(),
            roles: settings.roles.to_string(),
        },
    );

    // The pipelines (the built-in users one and the file's), each resolved from the settings as
    // it sees them; started, held, reloaded and stopped by `Pipelines`.
    let declared = pipelines::declared(&settings)?;
    let depths = Depths::default();
    metrics::connection("amqp", false);
    metrics::connection("postgres", false);

    // One pool for every pipeline, with a connection for each insert that can be in flight
    // (`pipelines::pool_size`); a reload resizes it.
    let budget = settings.inserts_budget();
    let mut database = settings.database();
    database.pool_size = pipelines::pool_size(&settings, &declared, budget);
    let pool = db::pool(&database)?;
    let (decisions_tx, decisions_rx) = mpsc::unbounded_channel();
    let (records_tx, records_rx) = watch::channel(Vec::new());
    let mut pipelines = Pipelines::start(
        settings.clone(),
        declared,
        pool.clone(),
        depths,
        decisions_tx,
        records_tx,
    );
    let api = if settings.has_role(Role::Api) {
        let config = settings.http();
        // The API's own pool: a flood of reads can never take the pipeline's connections.
        let api_pool = db::pool_for(&database, config.pool_size, "warren-api")?;
        let mapped = http::pipelines::PipelineApi::all(settings.pipelines())?;
        Some(http::serve(&config, &amqp, mapped, api_pool).await?)
    } else {
        None
    };
    info!(roles = %settings.roles, version = env!("CARGO_PKG_VERSION"), "warren running");
    // `ready` once every link the roles need is up, as /readyz sees it.
    tokio::spawn(async {
        while !metrics::readiness().ready() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        events::emit(None, Kind::Ready);
    });
    // systemd (Type=notify): the roles are up. A no-op when NOTIFY_SOCKET is unset.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        warn!(error = %e, "cannot tell systemd (NOTIFY_SOCKET) that warren is ready");
    }

    // The database probe behind `/readyz`: a connection of its own (a pool of one), so
    // pipelines whose connections are all busy never delay it, and bounded by READY_PROBE, so a
    // database that accepts and never answers reads as unreachable within seconds. Bounded by
    // the statement timeout on the pipeline's pool, `/readyz` said 200 for 30-40 s of such a
    // hang (review F5).
    let probe_pool = db::pool_for(&database, 1, "warren-probe")?;
    tokio::spawn(async move {
        loop {
            let answered = tokio::time::timeout(READY_PROBE, db::ping(&probe_pool, READY_PROBE))
                .await
                .is_ok_and(|r| r.is_ok());
            crate::events::database(answered);
            tokio::time::sleep(READY_PROBE).await;
        }
    });

    // Remote control: the registry task reads commands from Redis; they are applied here, on
    // the actor system's thread, in the same loop that waits for the shutdown signal.
    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel::<control::Control>();
    let (report_tx, report_rx) = watch::channel(Report {
        status: Status::Running,
        // What the first pipeline (users, unless left out) starts with.
        processors: settings
            .pipelines()
            .first()
            .map_or(0, |p| p.batching.processors),
        rate_limit_per_s: settings
            .pipelines()
            .first()
            .map_or(0, |p| p.rate_limit_per_s),
    });
    let (stop_tx, stop_rx) = oneshot::channel::<String>();
    // This instance as the registry publishes it: the pipelines it runs (none without the
    // consumer and DLQ roles).
    let runs_pipelines = settings.has_role(Role::Consumer) || settings.has_role(Role::Dlq);
    let instance = registry::Instance::this(
        settings.roles.to_string(),
        if runs_pipelines {
            registry::record::configured(settings.pipelines())
        } else {
            Vec::new()
        },
        shutdown_config.timeout_ms,
    );
    let registry = tokio::spawn(control::registry_loop(
        registry::Registry::new(&registry_config, instance),
        ctl_tx,
        report_rx,
        stop_rx,
        decisions_rx,
        records_rx,
    ));

    tokio::pin!(shutdown);
    // A reload runs beside the loop (its checks, then the drain of what it stops), so signals,
    // commands and the shutdown are taken while it lasts; another asked for meanwhile runs
    // once after it (`reload::Reloads`).
    let mut reloads = reload::Reloads::default();
    let reason = loop {
        tokio::select! {
            _ = &mut shutdown => break "signal",
            step = reloads.step(), if reloads.busy() => {
                reloads.advance(step, &mut pipelines, &reload, &report_tx);
            }
            (command, signal) = operator.next() => {
                if command == Command::Reload {
                    // As `warren ctl reload`, for this process.
                    reloads.ask(signal, None, &reload);
                    continue;
                }
                // As `warren ctl pause` / `resume` without `--pipeline`, for this process.
                let result = command_now(command, None, &mut pipelines, &report_tx);
                match &result {
                    Ok(()) => info!(signal, %command, "operator signal: every pipeline"),
                    Err(error) => warn!(signal, %command, %error, "operator signal not applied"),
                }
            }
            Some((wire, command, reply)) = ctl_rx.recv() => {
                if command == Command::Reload {
                    info!(command = %command, id = %crate::text::shown(&wire.id), "remote command: reload asked");
                    reloads.ask("ctl", Some(reply), &reload);
                    continue;
                }
                let answer = command_now(command, wire.pipeline.as_deref(), &mut pipelines, &report_tx)
                    .map(|()| None);
                let drain = command == Command::Drain && answer.is_ok();
                info!(command = %command, id = %crate::text::shown(&wire.id), ok = answer.is_ok(), "remote command");
                let _ = reply.send(answer);
                if drain {
                    break "drain";
                }
            }
        }
    };
    // A reload in progress: what it drains is drained with the rest, its waiters told.
    let reloading = reloads.interrupt();
    // Commands that arrive from now on are answered as failed, never left waiting.
    ctl_rx.close();
    while let Ok((_, _, reply)) = ctl_rx.try_recv() {
        let _ = reply.send(Err(ControlError::Stopping));
    }
    report_tx.send_modify(|r| r.status = Status::Draining);
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Stopping]) {
        warn!(error = %e, "cannot tell systemd (NOTIFY_SOCKET) that warren is stopping");
    }
    info!(
        reason,
        timeout_ms = shutdown_config.timeout_ms,
        "shutting down"
    );
    events::emit(
        None,
        Kind::Draining {
            reason: reason.into(),
        },
    );

    let ((drained, counts), reloaded) =
        futures::future::join(pipelines.shutdown(shutdown_config.timeout()), async {
            match reloading {
                Some(drain) => drain.await,
                None => (true, Default::default()),
            }
        })
        .await;
    let (drained, mut counts) = (drained && reloaded.0, counts);
    counts += reloaded.1;
    let (settled, given_back) = (counts.settled, counts.given_back);
    if let Some(api) = api {
        api.stop().await;
    }
    let _ = stop_tx.send(reason.to_string());
    let _ = tokio::time::timeout(Duration::from_secs(5), registry).await;
    // The last line says what the stop did with the deliveries it had in hand.
    let done = deliveries(settled);
    let code = if !drained {
        warn!(
            settled,
            given_back,
            "stopped with messages still in flight after SHUTDOWN_TIMEOUT_MS: {done} settled, \
             {given_back} given back to the broker unprocessed (it redelivers them); exit 1"
        );
        1
    } else if given_back > 0 {
        warn!(
            settled,
            given_back,
            "stopped: {done} settled, {given_back} given back to the broker unprocessed (they \
             wait in their queues for the next consumer; nothing is lost)"
        );
        0
    } else {
        info!(
            settled,
            given_back, "stopped cleanly: {done} settled, none given back"
        );
        0
    };
    events::emit(
        None,
        Kind::Stopped {
            exit_code: code,
            settled,
            given_back,
        },
    );
    events::flush(Duration::from_secs(2)).await;
    Ok(code)
}

/// Applies `command` (not a reload) to the running pipelines, for every one or `pipeline`: the
/// stages a reload in progress stops or starts again are not among them
/// ([`control::apply`]). The record's processors and rate follow what runs.
fn command_now(
    command: Command,
    pipeline: Option<&str>,
    pipelines: &mut Pipelines,
    report: &watch::Sender<Report>,
) -> Result<(), ControlError> {
    let budget = pipelines.budget();
    let reloading = pipelines.reloading().to_vec();
    let (stages, holds) = pipelines.control();
    control::apply(
        command, pipeline, &stages, &reloading, holds, report, budget,
    )?;
    match command {
        Command::Scale { processors } => pipelines.ran(pipeline, |r| r.processors = processors),
        Command::Rate { per_s } => pipelines.ran(pipeline, |r| r.rate_limit_per_s = per_s),
        _ => return Ok(()),
    }
    pipelines.report_runs(report);
    Ok(())
}

/// "1 delivery", "0 deliveries", "812 deliveries": the stop's last line in plain English.
fn deliveries(n: u64) -> String {
    if n == 1 {
        "1 delivery".to_string()
    } else {
        format!("{n} deliveries")
    }
}
