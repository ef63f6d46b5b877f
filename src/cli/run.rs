//! `warren run [--declare] [--roles consumer,dlq,api]`: run the roles until SIGTERM or SIGINT,
//! then shut down gracefully in the pipeline's fixed order; SIGHUP reloads the configuration's
//! pipelines from the same sources. A second signal exits at once; a
//! shutdown that reached SHUTDOWN_TIMEOUT_MS with messages in flight exits 1.

use std::future::Future;
use std::time::Duration;

use backon::Retryable;
use tracing::{info, warn};

use crate::config::{ConfigError, Settings, Sources};
use crate::topology::{Topology, TopologyError};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Declare the topology and apply migrations first (idempotent).
    #[arg(long)]
    pub declare: bool,
    /// Comma-separated subset of consumer,dlq,api (overrides ROLES).
    #[arg(long, value_name = "ROLES")]
    pub roles: Option<String>,
    /// Comma-separated pipelines to run (default: users and every pipeline of the file; see
    /// `warren pipelines`).
    #[arg(long, value_name = "NAMES")]
    pub pipelines: Option<String>,
}

/// `settings` with only the pipelines `list` names (comma-separated); an unknown name is a
/// configuration error (exit 2) naming the known ones, and so is a `MAX_INSERTS_IN_FLIGHT`
/// below what the pipelines kept always hold.
pub fn select_pipelines(mut settings: Settings, list: &str) -> Result<Settings, ConfigError> {
    let wanted: Vec<&str> = crate::config::list_entries(list).collect();
    let mut known = vec!["users".to_string()];
    known.extend(
        settings
            .pipelines
            .iter()
            .map(|p| p.name.clone())
            .filter(|n| n != "users"),
    );
    if let Some(unknown) = wanted.iter().find(|w| !known.iter().any(|k| k == *w)) {
        // As every other tool's --pipeline (review R40a F1).
        let meant = crate::config::closest(unknown, known.iter().map(String::as_str), false)
            .map(|m| format!(" (did you mean {m}?)"))
            .unwrap_or_default();
        return Err(ConfigError::Invalid {
            setting: "--pipelines".into(),
            expected: format!(
                "names of pipelines of this configuration ({})",
                known.join(", ")
            ),
            got: format!("{unknown:?}{meant}"),
        });
    }
    settings.select_pipelines(&wanted);
    // Only now: the inserts of the pipelines left out do not count against the budget.
    settings.check_inserts_budget()?;
    Ok(settings)
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
/// A reload reads the configuration again from `sources` (with the same `--pipelines`), and
/// checks (and, with `--declare`, declares) what it starts.
pub async fn execute(
    settings: Settings,
    sources: Sources,
    args: Args,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<i32> {
    // The whole configuration, before `--pipelines`: what the selected pipelines' tables may
    // share with the others is checked against all of it.
    let whole = settings.clone();
    let settings = match &args.pipelines {
        Some(list) => select_pipelines(settings, list)?,
        None => settings,
    };
    // SIGHUP, SIGUSR1 and SIGCONT during the start (a database waited for) must not end warren
    // nor be lost: caught since `main` (again here for a caller without it), applied in their
    // order once the roles run.
    crate::app::catch_operator_signals()?;
    // The listener first: probes answer while warren declares or waits for the database.
    crate::app::start_listener(&settings).await?;
    if args.declare {
        let topology = Topology::from_settings(&settings)?;
        crate::cli::declare::declare_topology(&settings, &topology).await?;
    }
    // The configured pipelines' tables fit their mappings before anything is consumed (with
    // `--declare`, once the migrations are applied). A database that cannot be asked (a restart
    // during an outage or a fence) is waited for with the reconnect backoff, as the pipelines
    // wait for it; only a mismatch stops warren (exit 2), or, with `--declare`, a database that
    // answered and refused the migrations (exit 1). Found by the ledger: a warren restarted
    // after kill -9 while the database was cut exited at once, and nothing consumed any more;
    // `--declare` (scripts/run.sh) exited 1 the same way until issue 34.
    tokio::pin!(shutdown);
    let declare = args.declare;
    let prepare = || async {
        if declare {
            crate::cli::declare::migrate(&settings).await?;
            crate::cli::declare::tombstones(&settings).await?;
        } else {
            // What declare checks of the broker's version (a quorum DLQ without a delivery
            // limit on RabbitMQ 4), checked here too: exit 2 in the same words.
            let topology = Topology::from_settings(&settings)?;
            crate::cli::declare::check_broker(&settings, &topology).await?;
        }
        crate::cli::declare::check_tables_among(&settings, &whole).await
    };
    crate::metrics::starting(Some("checking the pipelines' tables in the database"));
    let prepared = prepare
        .retry(crate::amqp::reconnect_builder())
        .when(|e: &anyhow::Error| {
            e.downcast_ref::<ConfigError>().is_none()
                && e.downcast_ref::<crate::cli::declare::MigrationRefused>()
                    .is_none()
        })
        .notify(|e: &anyhow::Error, delay: Duration| {
            warn!(error = %format!("{e:#}"), retry_in_ms = delay.as_millis() as u64,
                "cannot check the pipelines' tables yet; trying again");
            // Under systemd the start lasts past the next attempt (its bound, as in
            // check_tables, and a margin): TimeoutStartSec must not end a warren that waits.
            let attempt = Duration::from_secs(5) + settings.database().call_bound();
            crate::app::extend_start(delay + attempt + Duration::from_secs(10));
        });
    tokio::select! {
        result = prepared => result?,
        _ = &mut shutdown => return Ok(0),
    }
    // A drift found by a check left for later (the broker could not be reached): told here,
    // and warren stops (exit 1) as the check at the start would have.
    let (drifted, mut drift) = tokio::sync::oneshot::channel::<anyhow::Error>();
    if declare {
        info!("topology declared and migrations applied");
    } else {
        // Waited for, as the database is: a stop meanwhile ends warren at once.
        crate::metrics::starting(Some(
            "checking the broker's exchanges and queues against the configuration",
        ));
        let checked = tokio::select! {
            result = check_topology(&settings) => result?,
            _ = &mut shutdown => return Ok(0),
        };
        crate::metrics::starting(None);
        if checked == Checked::Later {
            crate::topology::gate::hold();
            tokio::spawn(check_later(settings.clone(), drifted));
        }
    }
    if declare {
        crate::metrics::starting(None);
    }
    let found = std::sync::Arc::new(std::sync::Mutex::new(None));
    let shutdown = {
        let found = found.clone();
        async move {
            tokio::select! {
                _ = shutdown => {}
                Ok(e) = &mut drift => {
                    *found.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        }
    };
    let selection = args.pipelines.clone();
    // A refusal of the database or the broker names the file the pipelines came from (the
    // pipeline and the table or queue are in its words).
    let from = sources
        .file
        .as_ref()
        .map(|f| format!("{}: ", f.display()))
        .unwrap_or_default();
    // With `--pipelines`, the whole configuration a reload read, for the check of shared
    // partitions and inheritance trees (review R39-F5: against the selection alone, a pipeline
    // added on a partition of a selected table with deletes passed). Reloads run one at a
    // time, so the last load is the one prepared.
    let whole: std::sync::Arc<std::sync::Mutex<Option<Settings>>> = Default::default();
    let loaded_whole = whole.clone();
    let reload = crate::app::Reload {
        base: std::sync::Arc::new(settings.clone()),
        load: std::sync::Arc::new(move |pinned| {
            let mut sources = sources.clone();
            sources.pinned = pinned.clone();
            let settings = Settings::load(&sources)?;
            match &selection {
                Some(list) => {
                    *loaded_whole.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(settings.clone());
                    select_pipelines(settings, list)
                }
                None => Ok(settings),
            }
        }),
        prepare: Box::new(
            move |starting: Option<Settings>, all: Settings, left: Vec<String>| {
                let from = from.clone();
                let loaded = whole.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let selected = loaded.is_some();
                let whole = loaded.unwrap_or_else(|| all.clone());
                Box::pin(async move {
                    // Everything is checked before anything is declared: a reload refused for a
                    // table declares nothing on the broker.
                    let prepared = async {
                        if let Some(settings) = &starting {
                            let topology = Topology::from_settings(settings)?;
                            if declare {
                                crate::cli::declare::tombstones(settings).await?;
                            }
                            crate::cli::declare::check_tables_among(settings, &whole).await?;
                            if declare {
                                crate::cli::declare::declare_topology(settings, &topology).await?;
                            } else {
                                crate::cli::declare::check_broker(settings, &topology).await?;
                            }
                        } else if selected {
                            crate::cli::declare::check_shared_tables(&whole).await?;
                        }
                        // Every pipeline's exchanges and queues, those it leaves running too: they
                        // exist and have the declared properties (review R35g F5, R35h F4).
                        let topology = Topology::from_settings(&all)?;
                        let absent =
                            crate::cli::declare::check_declared_and_absent(&all, &topology, &left)
                                .await?;
                        // The configuration that runs from now on is checked: consumers held by a
                        // start whose check waits for the broker may consume (review R38-F1: the
                        // start's check kept asking for a queue the reload had left, for ever).
                        crate::topology::gate::open();
                        Ok(absent)
                    };
                    prepared.await.map_err(|e: anyhow::Error| {
                        crate::app::ReloadError::Prepare(format!("{from}{e:#}"))
                    })
                })
            },
        ),
    };
    let code = crate::app::run(settings, reload, shutdown).await?;
    match found.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(e) => Err(e),
        None => Ok(code),
    }
}

/// How the start's topology check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    /// Checked.
    Now,
    /// Not checked yet (the broker could not be reached; for an instance of the API alone, also
    /// what is not declared yet): the consumers and the API's publishes are held
    /// ([`crate::topology::gate`]) until [`check_later`] passed.
    Later,
}

/// The start's check, tried again with the reconnect backoff (no limit) until the broker can be
/// reached and every object exists: opens the topology gate when it passes; a drift is sent to
/// `drifted`, which stops warren with it (exit 1).
async fn check_later(settings: Settings, drifted: tokio::sync::oneshot::Sender<anyhow::Error>) {
    let checked = async {
        let topology = Topology::from_settings(&settings)?;
        // A reload whose own check passed opened the gate: the start's configuration no
        // longer runs, and is not asked after any more.
        let check = || async {
            if crate::topology::gate::is_open() {
                return Ok(());
            }
            crate::cli::declare::check_declared(&settings, &topology).await
        };
        check
            .retry(crate::amqp::reconnect_builder())
            .when(|e: &anyhow::Error| !is_drift(e))
            .notify(|e: &anyhow::Error, delay: Duration| {
                warn!(error = %format!("{e:#}"), retry_in_ms = delay.as_millis() as u64,
                    "consuming and publishing wait for the check of the broker's exchanges and queues; trying again");
            })
            .await
    };
    match checked.await {
        Ok(()) if crate::topology::gate::is_open() => {}
        Ok(()) => {
            info!(
                "the broker's exchanges and queues match this configuration; consuming and publishing start"
            );
            crate::topology::gate::open();
        }
        // What a reload checked and applied meanwhile runs now, not the start's configuration.
        Err(_) if crate::topology::gate::is_open() => {}
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "the broker's exchanges and queues do not match this configuration; stopping");
            let _ = drifted.send(e);
        }
    }
}

fn is_drift(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<TopologyError>(),
        Some(TopologyError::Drift(_))
    )
}

/// At a start without `--declare`: the exchanges and queues exist with the properties this
/// configuration declares (review R35g F5: a retry queue that still dead-letters to a main queue
/// the file renamed strands every retried message there); a drift stops warren (exit 1, the
/// advice of `warren declare`). Those not declared yet are waited for, with the reconnect
/// backoff and a warning naming them at each attempt, and checked once they exist (review
/// R35h F5: one another step declared later with other arguments was taken unchecked until
/// the next reload). A broker that cannot be reached now (or that went away during that wait)
/// does not hold the start (the roles start and wait for it, the API answers 503, as at every
/// start): [`Checked::Later`], the consumers and the API's publishes held until [`check_later`]
/// passed (review R37x F4: the check was left out, and a drifted retry queue lost every retry);
/// an instance of the API alone does not wait for what is not declared either, and is held the
/// same way until it is (review R38-F8: a drifted main queue dropped what the API confirmed).
async fn check_topology(settings: &Settings) -> anyhow::Result<Checked> {
    use crate::cli::declare::NotDeclared;
    use crate::config::Role;
    let topology = Topology::from_settings(settings)?;
    let check = || crate::cli::declare::check_declared(settings, &topology);
    // Only what consumes waits: an instance of the API alone starts (its publishes are
    // refused, 503, until the queues exist), so it also says at once what else is wrong
    // with it (an address it cannot listen on).
    let consumes = settings.has_role(Role::Consumer) || settings.has_role(Role::Dlq);
    let checked = check
        .retry(crate::amqp::reconnect_builder())
        .when(|e: &anyhow::Error| consumes && e.downcast_ref::<NotDeclared>().is_some())
        .notify(|e: &anyhow::Error, delay: Duration| {
            warn!(error = %format!("{e:#}"), retry_in_ms = delay.as_millis() as u64,
                "waiting for the pipelines' exchanges and queues to be declared; the roles start once they exist and match this configuration");
            crate::app::extend_start(delay + Duration::from_secs(15));
        })
        .await;
    match checked {
        Ok(()) => Ok(Checked::Now),
        Err(e) if is_drift(&e) => Err(e),
        Err(e) if e.downcast_ref::<NotDeclared>().is_some() => {
            warn!(error = %format!("{e:#}"),
                "the HTTP API starts; what it publishes is refused (503) until they are declared and checked against this configuration");
            Ok(Checked::Later)
        }
        Err(e) if consumes => {
            warn!(error = %format!("{e:#}"),
                "cannot check yet that the broker's exchanges and queues match the configuration; \
                 the roles start, and the consumers wait until the check passed");
            Ok(Checked::Later)
        }
        Err(e) => {
            warn!(error = %format!("{e:#}"),
                "cannot check yet that the broker's exchanges and queues match the configuration; \
                 the HTTP API starts, and refuses to publish (503) until the check passed");
            Ok(Checked::Later)
        }
    }
}
