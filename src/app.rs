//! The composition root of `warren run`: the metrics listener first ([`start_listener`], before
//! anything waits for a server), then the roles in order (queue poller, pipelines, API,
//! readiness, database probe, registry and remote control, [`control`]); waits for the shutdown
//! trigger or a remote `drain`, applying remote commands and the operator signals (`SIGUSR1`
//! pauses every pipeline, `SIGCONT` resumes) meanwhile, and stops them in order: pipelines
//! (each with its own fixed sequence, `pipeline::Pipeline::shutdown`), then the API, then the
//! registry. Errors of the boundaries
//! meet here, so it speaks `anyhow` like the CLI.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};

use crate::amqp::monitor::Depths;
use crate::config::{Role, Settings};
use crate::domain::mapping::Mapping;
use crate::events::{self, Kind};
use crate::pipeline::{self, Spec, Stage, StageId};
use crate::registry::{Command, Report, Status};
use crate::{db, http, metrics};
use control::ControlError;

mod control;

/// Installs the metrics recorder and binds the metrics listener (`METRICS_ADDR`: `/metrics`,
/// `/healthz`, `/readyz`), before anything waits for a server: a warren waiting for its database
/// at start is alive (`/healthz` 200) and not ready (`/readyz` 503, the database down), so a
/// liveness probe does not restart it for waiting. The roles come later ([`run`]).
pub async fn start_listener(settings: &Settings) -> anyhow::Result<()> {
    let metrics_addr: SocketAddr = crate::config::listen_addr(&settings.metrics_addr)
        .map_err(|e| anyhow::anyhow!("METRICS_ADDR {}: {e}", settings.metrics_addr))?;
    let recorder = metrics::install().map_err(anyhow::Error::msg)?;
    http::ops::serve(metrics_addr, recorder).await?;
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
/// gracefully. The exit code is 0 after a complete drain, 1 when the shutdown timeout left
/// messages in flight.
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()>) -> anyhow::Result<i32> {
    if settings.control_secret.is_empty() {
        warn!(
            "CONTROL_SECRET is not set: anyone with write access to Redis can pause, drain or scale this instance; set CONTROL_SECRET (the same on every instance and for `warren ctl`) to accept only signed commands"
        );
    }
    // SIGUSR1 / SIGCONT pause and resume every pipeline; taken over before anything starts, so
    // neither ends nor is lost by the process from here on.
    let mut operator = control::OperatorSignals::listen()
        .map_err(|e| anyhow::anyhow!("cannot listen for SIGUSR1 and SIGCONT: {e}"))?;
    events::start(&settings);
    events::emit(
        None,
        Kind::Started {
            version: env!("CARGO_PKG_VERSION").into(),
            roles: settings.roles.to_string(),
        },
    );

    // The file's pipelines, each with the settings as it sees them and its name (its stages'
    // `pipeline` label, beside `stage="main"|"dlq"`, as users'). A file's pipeline named users
    // replaces the built-in one.
    let configured: Vec<(Settings, String, Arc<Mapping>)> = settings
        .pipelines
        .iter()
        .map(|p| Ok((p.view(&settings), p.name.clone(), Arc::new(p.mapping()?))))
        .collect::<Result<_, crate::config::ConfigError>>()?;
    let builtin_users =
        !settings.without_users && !settings.pipelines.iter().any(|p| p.name == "users");
    // The queue poller: every served pipeline's queues, for the metrics and the stages.
    let mut served = Vec::new();
    if builtin_users {
        served.push(crate::config::pipelines::Names::users(&settings));
    }
    served.extend(settings.pipelines.iter().map(|p| p.names(&settings)));
    let queues = served
        .into_iter()
        .flat_map(|n| {
            std::iter::once(n.main_queue)
                .chain(n.retry_tiers.into_iter().map(|t| t.queue))
                .chain(std::iter::once(n.dlq_queue))
        })
        .collect();
    let depths = Depths::default();
    // Every 5 s, or every balanced pipeline's cooldown if shorter: a balancing decision sees
    // a depth at most one cooldown old.
    let views = std::iter::once(&settings).chain(configured.iter().map(|c| &c.0));
    let poll_every = views
        .filter(|v| v.users_balance != crate::config::Balance::Off)
        .map(|v| Duration::from_millis(v.users_balance_cooldown_ms))
        .fold(Duration::from_secs(5), Duration::min)
        .max(Duration::from_millis(250));
    tokio::spawn(crate::amqp::monitor::poll_queues(
        settings.clone(),
        queues,
        poll_every,
        depths.clone(),
    ));
    // Every stage this instance runs: each served pipeline's main stage (role consumer) and
    // DLQ stage (role dlq), under one scheme, users' as any other's.
    let served_names: Vec<&str> = builtin_users
        .then_some("users")
        .into_iter()
        .chain(configured.iter().map(|c| c.1.as_str()))
        .collect();
    let stages: Vec<StageId> = [(Role::Consumer, Stage::Main), (Role::Dlq, Stage::Dlq)]
        .into_iter()
        .filter(|(role, _)| settings.has_role(*role))
        .flat_map(|(_, stage)| served_names.iter().map(move |p| StageId::new(p, stage)))
        .collect();
    metrics::preregister(&stages);
    // What the metrics listener's /readyz waits for: every AMQP link the roles open (each
    // stage's consumer, `<pipeline>/<stage>`, and their publisher `router`; the API's
    // publisher `api`) and the database, which every role uses.
    let mut links: Vec<String> = stages.iter().map(StageId::to_string).collect();
    if !stages.is_empty() {
        links.push("router".into());
    }
    if settings.has_role(Role::Api) {
        links.push("api".into());
    }
    metrics::needs(&links, true);
    metrics::connection("amqp", false);
    metrics::connection("postgres", false);

    // One pool for every pipeline, with a connection for each insert that can be in flight:
    // the main stages' most (the batchers they have, within the process-wide budget), and the
    // DLQ stages' batch concurrency.
    let budget = settings.inserts_budget();
    let mut database = settings.database();
    let served: Vec<&Settings> = builtin_users
        .then_some(&settings)
        .into_iter()
        .chain(configured.iter().map(|c| &c.0))
        .collect();
    let most: usize = served.iter().map(|v| v.most_concurrency()).sum();
    let dlq: usize = served.iter().map(|v| v.users_batch_concurrency).sum();
    database.pool_size = database.pool_size.max(most.min(budget) + dlq + 1);
    let pool = db::pool(&database)?;
    // The built-in users pipeline: its declaration in config/default.toml, through the mapping
    // like every other, under the global settings (`MAIN_QUEUE`, `USERS_*`).
    let users: Arc<Mapping> = Arc::new(crate::config::pipelines::users()?.mapping()?);
    // Every main stage first, then every DLQ stage: users, then the file's.
    let mut pipelines = Vec::new();
    for role in [Role::Consumer, Role::Dlq] {
        if !settings.has_role(role) {
            continue;
        }
        let stage = |view: &Settings| match role {
            Role::Dlq => Spec::dlq(view),
            _ => Spec::main(view),
        };
        if builtin_users {
            let spec = stage(&settings);
            pipelines.push(pipeline::start(
                &settings,
                spec,
                users.clone(),
                pool.clone(),
                depths.clone(),
            ));
        }
        for (view, name, mapping) in &configured {
            let spec = Spec {
                pipeline: name.clone(),
                ..stage(view)
            };
            pipelines.push(pipeline::start(
                &settings,
                spec,
                mapping.clone(),
                pool.clone(),
                depths.clone(),
            ));
        }
    }
    // Balancing: one task decides for every balanced main stage, within the budget.
    let concurrencies: Vec<_> = pipelines
        .iter()
        .filter_map(|p| p.concurrency.clone())
        .collect();
    let (decisions_tx, decisions_rx) = mpsc::unbounded_channel();
    let balancing = tokio_util::sync::CancellationToken::new();
    tokio::spawn(pipeline::balance::run(
        concurrencies.clone(),
        budget,
        depths.clone(),
        decisions_tx,
        balancing.clone(),
    ));
    let api = if settings.has_role(Role::Api) {
        // The API's own pool: a flood of reads can never take the pipeline's connections.
        let api_pool = db::pool_for(&database, settings.api_pool_size, "warren-api")?;
        Some(http::serve(&settings, api_pool).await?)
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

    let probe_pool = pool.clone();
    let probe_bound = database.call_bound();
    tokio::spawn(async move {
        loop {
            crate::events::database(db::ping(&probe_pool, probe_bound).await.is_ok());
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    });

    // Remote control: the registry task reads commands from Redis; they are applied here, on
    // the actor system's thread, in the same loop that waits for the shutdown signal.
    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel::<control::Control>();
    let (report_tx, report_rx) = watch::channel(Report {
        status: Status::Running,
        processors: settings.users_proc_concurrency,
        rate_limit_per_s: settings.rate_limit_per_s,
    });
    let (stop_tx, stop_rx) = oneshot::channel::<String>();
    let registry = tokio::spawn(control::registry_loop(
        settings.clone(),
        ctl_tx,
        report_rx,
        stop_rx,
        decisions_rx,
    ));

    tokio::pin!(shutdown);
    let reason = loop {
        tokio::select! {
            _ = &mut shutdown => break "signal",
            (command, signal) = operator.next() => {
                // As `warren ctl pause` / `resume` without `--pipeline`, for this process.
                let result = control::apply(command, None, &pipelines, &report_tx, budget);
                match &result {
                    Ok(()) => info!(signal, %command, "operator signal: every pipeline"),
                    Err(error) => warn!(signal, %command, %error, "operator signal not applied"),
                }
            }
            Some((wire, command, reply)) = ctl_rx.recv() => {
                let result = control::apply(command, wire.pipeline.as_deref(), &pipelines, &report_tx, budget);
                let drain = command == Command::Drain && result.is_ok();
                info!(command = %command, id = %wire.id, ok = result.is_ok(), "remote command");
                let _ = reply.send(result);
                if drain {
                    break "drain";
                }
            }
        }
    };
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
        timeout_ms = settings.shutdown_timeout_ms,
        "shutting down"
    );
    events::emit(
        None,
        Kind::Draining {
            reason: reason.into(),
        },
    );

    balancing.cancel();
    let timeout = settings.shutdown_timeout();
    let results = futures::future::join_all(pipelines.iter().map(|p| p.shutdown(timeout))).await;
    let mut counts = crate::pipeline::consumer::StopCounts::default();
    for (_, c) in &results {
        counts += *c;
    }
    let (settled, given_back) = (counts.settled, counts.given_back);
    if let Some(api) = api {
        api.stop().await;
    }
    let _ = stop_tx.send(reason.to_string());
    let _ = tokio::time::timeout(Duration::from_secs(5), registry).await;
    // The last line says what the stop did with the deliveries it had in hand.
    let code = if !results.iter().all(|(drained, _)| *drained) {
        warn!(
            settled,
            given_back,
            "stopped with messages still in flight after SHUTDOWN_TIMEOUT_MS: {settled} \
             deliveries settled, {given_back} given back to the broker unprocessed (it \
             redelivers them); exit 1"
        );
        1
    } else if given_back > 0 {
        warn!(
            settled,
            given_back,
            "stopped: {settled} deliveries settled, {given_back} given back to the broker \
             unprocessed (they wait in their queues for the next consumer; nothing is lost)"
        );
        0
    } else {
        info!(
            settled,
            given_back, "stopped cleanly: {settled} deliveries settled, none given back"
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
