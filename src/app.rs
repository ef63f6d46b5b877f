//! The composition root of `warren run`: the metrics listener first ([`start_listener`], before
//! anything waits for a server), then the roles in order (queue poller, pipelines, API,
//! readiness, database probe, registry and remote control); waits for the shutdown trigger or a
//! remote `drain`, and stops them in order: pipelines (each with its own fixed sequence,
//! `pipeline::Pipeline::shutdown`), then the API, then the registry. Errors of the boundaries
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
use crate::pipeline::{self, Pipeline, Spec};
use crate::registry::{Command, CtlCommand, Registry, Report};
use crate::{db, http, metrics};

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
    events::start(&settings);
    events::emit(
        None,
        Kind::Started {
            version: env!("CARGO_PKG_VERSION").into(),
            roles: settings.roles.to_string(),
        },
    );

    // The file's pipelines, each with the settings as it sees them and its stages' names (the
    // `pipeline` label: `<name>` and `<name>_dlq`; users keeps `main` and `dlq`). A file's
    // pipeline named users replaces the built-in one.
    let configured: Vec<(Settings, &'static str, &'static str, Arc<Mapping>)> = settings
        .pipelines
        .iter()
        .map(|p| {
            let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
            Ok((
                p.view(&settings),
                leak(p.name.clone()),
                leak(format!("{}_dlq", p.name)),
                Arc::new(p.mapping()?),
            ))
        })
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
    let mut names = Vec::new();
    if settings.has_role(Role::Consumer) {
        if builtin_users {
            names.push("main");
        }
        names.extend(configured.iter().map(|c| c.1));
    }
    if settings.has_role(Role::Dlq) {
        if builtin_users {
            names.push("dlq");
        }
        names.extend(configured.iter().map(|c| c.2));
    }
    metrics::preregister(&names);
    // What the metrics listener's /readyz waits for: every AMQP link the roles open (each
    // pipeline's consumer, named after the pipeline, and its publisher `router`; the API's
    // publisher `api`) and the database, which every role uses.
    let mut links = names.clone();
    if !names.is_empty() {
        links.push("router");
    }
    if settings.has_role(Role::Api) {
        links.push("api");
    }
    metrics::needs(&links, true);
    metrics::connection("amqp", false);
    metrics::connection("postgres", false);

    // One pool for every pipeline, with a connection for each insert that can be in flight:
    // the main stages' most (the batchers they have, within the process-wide budget), and the
    // DLQ stages' batch concurrency.
    let budget = settings.inserts_budget();
    let mut sized = settings.clone();
    let served: Vec<&Settings> = builtin_users
        .then_some(&settings)
        .into_iter()
        .chain(configured.iter().map(|c| &c.0))
        .collect();
    let most: usize = served.iter().map(|v| v.most_concurrency()).sum();
    let dlq: usize = served.iter().map(|v| v.users_batch_concurrency).sum();
    sized.database_pool_size = sized.database_pool_size.max(most.min(budget) + dlq + 1);
    let pool = db::pool(&sized)?;
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
        for (view, name, dlq_name, mapping) in &configured {
            let spec = Spec {
                name: if role == Role::Dlq { dlq_name } else { name },
                pipeline: name.to_string(),
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
        let api_pool = db::pool_for(&settings, settings.api_pool_size, "warren-api")?;
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
    let probe_settings = settings.clone();
    tokio::spawn(async move {
        loop {
            crate::events::database(
                db::ping(&probe_pool, db::call_bound(&probe_settings))
                    .await
                    .is_ok(),
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    });

    // Remote control: the registry task reads commands from Redis; they are applied here, on
    // the actor system's thread, in the same loop that waits for the shutdown signal.
    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel::<Control>();
    let (report_tx, report_rx) = watch::channel(Report {
        status: "running",
        processors: settings.users_proc_concurrency,
        rate_limit_per_s: settings.rate_limit_per_s,
    });
    let (stop_tx, stop_rx) = oneshot::channel::<String>();
    let registry = tokio::spawn(registry_loop(
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
            Some((command, reply)) = ctl_rx.recv() => {
                let result = apply(&command, &pipelines, &report_tx, budget);
                let drain = command.command == Command::Drain && result.is_ok();
                info!(command = %command.command, id = %command.id, ok = result.is_ok(), "remote command");
                let _ = reply.send(result);
                if drain {
                    break "drain";
                }
            }
        }
    };
    // Commands that arrive from now on are answered as failed, never left waiting.
    ctl_rx.close();
    while let Ok((_, reply)) = ctl_rx.try_recv() {
        let _ = reply.send(Err("warren is stopping".into()));
    }
    report_tx.send_modify(|r| r.status = "draining");
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
    if let Some(api) = api {
        api.stop().await;
    }
    let _ = stop_tx.send(reason.to_string());
    let _ = tokio::time::timeout(Duration::from_secs(5), registry).await;
    let code = if results.iter().all(|drained| *drained) {
        info!("stopped cleanly");
        0
    } else {
        warn!(
            "stopped with messages still in flight after SHUTDOWN_TIMEOUT_MS; the broker redelivers them; exit 1"
        );
        1
    };
    events::emit(None, Kind::Stopped { exit_code: code });
    events::flush(Duration::from_secs(2)).await;
    Ok(code)
}

/// A remote command and where to answer whether it was applied.
type Control = (CtlCommand, oneshot::Sender<Result<(), String>>);

/// Applies one remote command to this instance's pipelines.
fn apply(
    command: &CtlCommand,
    pipelines: &[Pipeline],
    report: &watch::Sender<Report>,
    budget: usize,
) -> Result<(), String> {
    let needs_consumer = || {
        if pipelines.is_empty() {
            Err("this instance runs no consumer role".to_string())
        } else {
            Ok(())
        }
    };
    // `--pipeline NAME`: the stages of that pipeline alone (its main and DLQ stages).
    let chosen: Vec<&Pipeline> = match &command.pipeline {
        None => pipelines.iter().collect(),
        Some(name) => {
            if command.command == Command::Drain {
                return Err("drain applies to the whole instance, not to one pipeline".into());
            }
            let chosen: Vec<&Pipeline> = pipelines.iter().filter(|p| p.pipeline == *name).collect();
            if chosen.is_empty() && !pipelines.is_empty() {
                let mut known: Vec<&str> = pipelines.iter().map(|p| p.pipeline.as_str()).collect();
                known.dedup();
                return Err(format!(
                    "this instance runs no pipeline {name:?} (it runs {})",
                    known.join(", ")
                ));
            }
            chosen
        }
    };
    let whole = command.pipeline.is_none();
    // `paused` / `resumed`: once for the instance, or once for the pipeline named.
    let announce = |kind: Kind| {
        events::emit(command.pipeline.as_deref(), kind);
    };
    let mark_paused = |on: bool| {
        for p in &chosen {
            crate::metrics::stage(p.name)
                .paused
                .store(on && !whole, std::sync::atomic::Ordering::Relaxed);
        }
    };
    match &command.command {
        Command::Pause => {
            needs_consumer()?;
            chosen.iter().for_each(|p| p.hold(true));
            mark_paused(true);
            announce(Kind::Paused {
                by: "operator".into(),
            });
            if whole {
                report.send_modify(|r| r.status = "paused");
            }
            Ok(())
        }
        Command::Resume => {
            needs_consumer()?;
            chosen.iter().for_each(|p| p.hold(false));
            mark_paused(false);
            announce(Kind::Resumed {
                by: "operator".into(),
            });
            if whole {
                report.send_modify(|r| r.status = "running");
            }
            Ok(())
        }
        Command::Drain => Ok(()),
        &Command::Scale { processors: n } => {
            needs_consumer()?;
            // All or nothing: a refusal depends on `n` alone, so the first stage refuses it
            // before any is changed.
            for p in &chosen {
                p.scale(n)?;
            }
            if whole {
                report.send_modify(|r| r.processors = n);
            }
            Ok(())
        }
        &Command::Concurrency { min, max } => {
            needs_consumer()?;
            if min.is_none() && max.is_none() {
                return Err("concurrency needs min or max".to_string());
            }
            // Checked for every chosen stage before any changes, so a refusal changes nothing.
            let stages: Vec<_> = chosen
                .iter()
                .filter_map(|p| p.concurrency.clone())
                .collect();
            if stages.is_empty() {
                return Err("this instance runs no main stage (ROLES has no consumer)".into());
            }
            // All or nothing: each stage is checked against what every other main stage will
            // hold once the command is applied (the chosen ones at their new bounds, the rest
            // as they are), and only then is any changed.
            let chosen_one =
                |o: &Arc<pipeline::balance::Concurrency>| stages.iter().any(|c| Arc::ptr_eq(c, o));
            let unchosen: usize = pipelines
                .iter()
                .filter_map(|p| p.concurrency.as_ref())
                .filter(|o| !chosen_one(o))
                .map(|o| o.held())
                .sum();
            // First the bounds alone (each stage's own limits), with no budget taken yet.
            let mut bounds = Vec::with_capacity(stages.len());
            for c in &stages {
                bounds.push(c.check_bounds(min, max, 0, usize::MAX)?);
            }
            let will_hold: Vec<usize> = stages
                .iter()
                .zip(&bounds)
                .map(|(c, &(lo, hi))| c.held_within(lo, hi))
                .collect();
            let total: usize = unchosen + will_hold.iter().sum::<usize>();
            for (i, c) in stages.iter().enumerate() {
                c.check_bounds(min, max, total - will_hold[i], budget)?;
            }
            for (c, &(lo, hi)) in stages.iter().zip(&bounds) {
                c.apply_bounds(lo, hi);
            }
            Ok(())
        }
        &Command::Rate { per_s: n } => {
            needs_consumer()?;
            // All or nothing, as scale: a refusal depends on `n` alone.
            for p in &chosen {
                p.rate(n)?;
            }
            if whole {
                report.send_modify(|r| r.rate_limit_per_s = n);
            }
            Ok(())
        }
        // Read from Redis in a shape no `warren ctl` sends: refused, and recorded as failed.
        Command::ScaleWithoutProcessors => {
            needs_consumer()?;
            Err("scale needs a number of processors".to_string())
        }
        Command::RateWithoutLimit => {
            needs_consumer()?;
            Err("rate needs a number of messages per second".to_string())
        }
        Command::Unknown(name) => Err(format!("unknown command {name:?}")),
    }
}

/// Keeps this instance registered in Redis, relays remote commands, and deregisters at the end.
async fn registry_loop(
    settings: Settings,
    ctl: mpsc::UnboundedSender<Control>,
    mut report: watch::Receiver<Report>,
    mut stop: oneshot::Receiver<String>,
    mut decisions: mpsc::UnboundedReceiver<pipeline::balance::Decision>,
) {
    let mut registry = Registry::new(&settings);
    let mut beat = tokio::time::interval(Duration::from_millis(settings.registry_heartbeat_ms));
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            reason = &mut stop => {
                let reason = reason.unwrap_or_else(|_| "stopped".into());
                registry.deregister(&reason).await;
                return;
            }
            _ = beat.tick() => {
                let now = *report.borrow();
                registry.heartbeat(now).await;
            }
            Some(decision) = decisions.recv() => {
                let detail = format!(
                    "concurrency {} -> {} ({}): {}",
                    decision.from, decision.to, decision.reason, decision.inputs
                );
                registry.record_decision(&decision.pipeline, detail).await;
            }
            _ = poll.tick() => {
                while let Some((command, verdict)) = registry.next_command().await {
                    // A refused command never reaches the pipelines; it is only recorded.
                    let result = match verdict {
                        Err(refused) => Err(refused),
                        Ok(()) => {
                            let (tx, rx) = oneshot::channel();
                            if ctl.send((command.clone(), tx)).is_ok() {
                                rx.await.unwrap_or_else(|_| Err("warren is stopping".into()))
                            } else {
                                Err("warren is stopping".into())
                            }
                        }
                    };
                    registry.record(&command, result).await;
                    let now = *report.borrow();
                    registry.heartbeat(now).await;
                }
            }
            changed = report.changed() => {
                if changed.is_ok() {
                    let now = *report.borrow();
                    registry.heartbeat(now).await;
                } else {
                    let reason = (&mut stop).await.unwrap_or_else(|_| "stopped".into());
                    registry.deregister(&reason).await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commands read from Redis, applied by an instance without pipelines, with what the code
    /// before the typed command answered (captured, not recomputed): an unknown name is refused
    /// by name, whatever its pipeline; a drain for one pipeline is refused before anything else.
    #[test]
    fn commands_are_applied_or_refused_as_before() {
        let (report, _) = watch::channel(Report {
            status: "running",
            processors: 1,
            rate_limit_per_s: 0,
        });
        let no_consumer = Err("this instance runs no consumer role".to_string());
        for (raw, before) in [
            (
                r#"{"id":"a","command":"pause","issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"resume","issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"drain","issued_at":1,"by":"b"}"#,
                Ok(()),
            ),
            (
                r#"{"id":"a","command":"drain","pipeline":"orders","issued_at":1,"by":"b"}"#,
                Err("drain applies to the whole instance, not to one pipeline".to_string()),
            ),
            (
                r#"{"id":"a","command":"scale","processors":3,"issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"scale","issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"rate","rate":3,"issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"rate","processors":3,"issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"reboot","issued_at":1,"by":"b"}"#,
                Err(r#"unknown command "reboot""#.to_string()),
            ),
            (
                r#"{"id":"a","command":"reboot","pipeline":"orders","issued_at":1,"by":"b"}"#,
                Err(r#"unknown command "reboot""#.to_string()),
            ),
            (
                r#"{"id":"a","command":"Drain","issued_at":1,"by":"b"}"#,
                Err(r#"unknown command "Drain""#.to_string()),
            ),
            (
                r#"{"id":"a","command":"pause","processors":4,"issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
        ] {
            let command: CtlCommand = serde_json::from_str(raw).unwrap();
            assert_eq!(apply(&command, &[], &report, 8), before, "{raw}");
        }
        assert_eq!(report.borrow().status, "running", "nothing applied");
    }
}
