//! A reload as the control loop runs it ([`Reloads`]): beside the loop, never in its way. Its
//! steps are [`Loaded::read`] (read the file and resolve it, on a blocking thread: a file of
//! thousands of pipelines takes a while, and the runtime runs the pipelines, the heartbeat and
//! the broker links), [`Pipelines::plan`] (compare), `Reload::prepare` (check the tables,
//! then declare what starts), [`Pipelines::begin`] (what goes or changes leaves the running set
//! and drains) and [`Pipelines::finish`] (what is added or changed starts); the loop awaits the
//! slow ones ([`Reloads::step`]) beside signals, commands and the shutdown. One reload runs at a
//! time: those asked for while one runs are coalesced into one that runs after it, and every
//! `warren ctl reload` waiting gets the answer of the reload that covered it.

use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use super::control::{Answer, ControlError};
use super::pipelines::{Draining, Loaded, Pipelines, Plan, Reload, ReloadError, ReloadReport};
use crate::events::{self, Kind};
use crate::pipeline::consumer::StopCounts;
use crate::registry::Report;

/// Who asked for a reload: the first asker's name (`SIGHUP`, `ctl`), for the log, and the
/// `warren ctl reload` commands waiting for its answer.
struct Asked {
    by: &'static str,
    waiters: Vec<oneshot::Sender<Answer>>,
}

impl Asked {
    /// Answers every waiting `warren ctl reload`.
    fn answer(self, answer: &Answer) {
        for waiter in self.waiters {
            let _ = waiter.send(answer.clone());
        }
    }
}

/// The slow part of the reload under way.
enum Work {
    /// [`Loaded::read`], on a blocking thread.
    Loading(tokio::task::JoinHandle<Result<Box<Loaded>, ReloadError>>),
    /// `Reload::prepare`: the tables checked, then (`--declare`) what starts declared.
    Preparing(futures::future::LocalBoxFuture<'static, Result<Vec<String>, ReloadError>>),
    /// The drain of what it stops ([`Pipelines::begin`]).
    Draining(Draining),
}

/// The reload under way.
struct Current {
    asked: Asked,
    /// `None` while the configuration is read ([`Work::Loading`]).
    plan: Option<Plan>,
    work: Work,
}

/// What the slow part of the reload under way came to ([`Reloads::step`]).
pub(super) enum Step {
    Loaded(Result<Box<Loaded>, ReloadError>),
    Prepared(Result<Vec<String>, ReloadError>),
    Drained((bool, StopCounts)),
}

/// The reloads of the control loop: the one under way, and the one asked for meanwhile.
#[derive(Default)]
pub(super) struct Reloads {
    current: Option<Current>,
    /// Asked for while `current` ran: runs once after it, for every asker.
    queued: Option<Asked>,
}

impl Reloads {
    /// Whether a reload is under way (the loop then awaits [`Reloads::step`]).
    pub fn busy(&self) -> bool {
        self.current.is_some()
    }

    /// The end of the slow part of the reload under way (never, when none is). Cancel-safe:
    /// the work stays in `self` when the loop takes another branch.
    pub async fn step(&mut self) -> Step {
        match self.current.as_mut().map(|c| &mut c.work) {
            Some(Work::Loading(work)) => Step::Loaded(work.await.unwrap_or_else(|e| {
                Err(ReloadError::Config(format!(
                    "reading the configuration failed: {e}"
                )))
            })),
            Some(Work::Preparing(work)) => Step::Prepared(work.await),
            Some(Work::Draining(work)) => Step::Drained(work.await),
            None => std::future::pending().await,
        }
    }

    /// A reload asked for by `by` (`SIGHUP`, `ctl`, with where to answer): it starts now, or,
    /// while one runs, once after it (with every other asked for meanwhile).
    pub fn ask(
        &mut self,
        by: &'static str,
        waiter: Option<oneshot::Sender<Answer>>,
        reload: &Reload,
    ) {
        let mut asked = match (self.current.is_some(), self.queued.take()) {
            (true, Some(queued)) => queued,
            _ => Asked {
                by,
                waiters: Vec::new(),
            },
        };
        asked.waiters.extend(waiter);
        if self.current.is_some() {
            info!(
                by,
                "reload asked while one runs: it runs once that one is done"
            );
            self.queued = Some(asked);
        } else {
            self.start(asked, reload);
        }
    }

    /// Starts reading the configuration again, on a blocking thread ([`Loaded::read`]).
    fn start(&mut self, asked: Asked, reload: &Reload) {
        let (load, base) = (reload.load.clone(), reload.base.clone());
        let work = Work::Loading(tokio::task::spawn_blocking(move || {
            Loaded::read(&*load, &base).map(Box::new)
        }));
        self.current = Some(Current {
            asked,
            plan: None,
            work,
        });
    }

    /// The configuration read again (`loaded`): plans it and starts its checks (or, when it
    /// starts nothing, the drain of what it stops). One that fails here is answered at once.
    fn planned(
        &mut self,
        asked: Asked,
        loaded: Result<Box<Loaded>, ReloadError>,
        pipelines: &mut Pipelines,
        reload: &Reload,
    ) {
        let plan = match loaded.and_then(|next| pipelines.plan(*next)) {
            Ok(plan) => plan,
            Err(error) => {
                let answer = failed(asked.by, error);
                asked.answer(&answer);
                return self.start_queued(reload);
            }
        };
        // Always prepared: the broker objects of the pipelines it leaves running are checked
        // too (review R35h F4).
        let work = Work::Preparing((reload.prepare)(
            plan.checked.clone(),
            plan.next().clone(),
            plan.report.left_names.clone(),
        ));
        self.current = Some(Current {
            asked,
            plan: Some(plan),
            work,
        });
    }

    /// The reload asked for while the last one ran, if any.
    fn start_queued(&mut self, reload: &Reload) {
        if let Some(asked) = self.queued.take() {
            self.start(asked, reload);
        }
    }

    /// Takes the reload under way to its next step after `step` ([`Reloads::step`]'s answer):
    /// from its checks to its drain, or to its end (answered), then the one queued.
    pub fn advance(
        &mut self,
        step: Step,
        pipelines: &mut Pipelines,
        reload: &Reload,
        report: &watch::Sender<Report>,
    ) {
        let Some(current) = self.current.take() else {
            return;
        };
        let Current { asked, plan, .. } = current;
        match (step, plan) {
            (Step::Loaded(loaded), _) => {
                return self.planned(asked, loaded, pipelines, reload);
            }
            (Step::Prepared(Ok(absent)), Some(mut plan)) => {
                plan.report.forget_absent(&absent);
                let work = Work::Draining(pipelines.begin(&plan));
                self.current = Some(Current {
                    asked,
                    plan: Some(plan),
                    work,
                });
                return;
            }
            (Step::Prepared(Err(error)), _) => {
                let answer = failed(asked.by, error);
                asked.answer(&answer);
            }
            (Step::Drained((drained, _)), Some(plan)) => {
                let done = pipelines.finish(plan, drained);
                pipelines.report_runs(report);
                let answer = reloaded(asked.by, &done);
                asked.answer(&answer);
            }
            // A step past the loading always has its plan.
            (Step::Prepared(Ok(_)) | Step::Drained(_), None) => {}
        }
        self.start_queued(reload);
    }

    /// The shutdown began: the reload under way ends here (what it would start does not
    /// start) and its askers, and those of the one queued, are told warren stops. Answers the
    /// drain of what it stops, if it got that far, for the shutdown to await with the rest.
    pub fn interrupt(&mut self) -> Option<Draining> {
        let stopping = Err(ControlError::Stopping);
        if let Some(queued) = self.queued.take() {
            queued.answer(&stopping);
        }
        let current = self.current.take()?;
        let by = current.asked.by;
        current.asked.answer(&stopping);
        match current.work {
            Work::Loading(_) | Work::Preparing(_) => {
                warn!(
                    by,
                    "reload interrupted by the shutdown before it changed anything"
                );
                None
            }
            Work::Draining(drain) => {
                let report = current.plan.map(|p| p.report).unwrap_or_default();
                warn!(by, removed = %report.removed.join(","),
                    changed = %report.changed.join(","),
                    "reload interrupted by the shutdown: what it stops drains with the rest, what it would start does not start");
                Some(drain)
            }
        }
    }
}

/// A reload applied (asked by `by`): one log line and a `reloaded` event naming what changed
/// (and a warning naming the settings that wait for a restart). Answers what changed, for
/// `warren ctl reload`'s outcome.
fn reloaded(by: &str, report: &ReloadReport) -> Answer {
    if !report.restart_needed.is_empty() {
        warn!(by, settings = %report.restart_needed.join(", "),
            "reload: these settings are not a pipeline's and apply only at a restart; they keep their values, the pipelines were applied");
    }
    if !report.api_unchanged.is_empty() {
        warn!(by, pipelines = %report.api_unchanged.join(", "),
            "reload: the HTTP API serves the pipelines it started with until a restart: {}",
            report.api_notes.join("; "));
    }
    if !report.left_queues.is_empty() {
        warn!(by, queues = %report.left_queues.join(", "), moves = %report.moves.join("; "),
            "reload: no pipeline consumes these queues now; what they hold (and what their retry queues dead-letter back to them) waits there until moved{}",
            report.move_caveat());
    }
    for behind in &report.left_behind {
        warn!(by, "reload: {behind}");
    }
    info!(by, added = %report.added.join(","), removed = %report.removed.join(","),
        changed = %report.changed.join(","), unchanged = %report.unchanged.join(","),
        drained = report.drained, "configuration reloaded");
    events::emit(
        None,
        Kind::Reloaded {
            added: report.added.clone(),
            removed: report.removed.clone(),
            changed: report.changed.clone(),
            restart_needed: report.restart_needed.clone(),
            drained: report.drained,
            left_queues: report.left_queues.clone(),
        },
    );
    Ok(Some(report.summary()))
}

/// A reload that changed nothing: one error line and a `reload_failed` event, everything left
/// running as it was.
fn failed(by: &str, error: ReloadError) -> Answer {
    let error = error.one_line();
    tracing::error!(by, reason = %error, "reload failed; everything keeps running as it was");
    events::emit(
        None,
        Kind::ReloadFailed {
            reason: error.to_string(),
        },
    );
    Err(ControlError::Reload(error))
}
