//! A reload as the control loop runs it ([`Reloads`]): beside the loop, never in its way. Its
//! steps are [`Pipelines::plan`] (read the file, compare), `Reload::prepare` (check the tables,
//! then declare what starts), [`Pipelines::begin`] (what goes or changes leaves the running set
//! and drains) and [`Pipelines::finish`] (what is added or changed starts); the loop awaits the
//! slow ones ([`Reloads::step`]) beside signals, commands and the shutdown. One reload runs at a
//! time: those asked for while one runs are coalesced into one that runs after it, and every
//! `warren ctl reload` waiting gets the answer of the reload that covered it.

use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use super::control::{Answer, ControlError};
use super::pipelines::{Draining, Pipelines, Plan, Reload, ReloadError, ReloadReport};
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
    /// `Reload::prepare`: the tables checked, then (`--declare`) what starts declared.
    Preparing(futures::future::LocalBoxFuture<'static, Result<(), ReloadError>>),
    /// The drain of what it stops ([`Pipelines::begin`]).
    Draining(Draining),
}

/// The reload under way.
struct Current {
    asked: Asked,
    plan: Plan,
    work: Work,
}

/// What the slow part of the reload under way came to ([`Reloads::step`]).
pub(super) enum Step {
    Prepared(Result<(), ReloadError>),
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
        pipelines: &mut Pipelines,
        reload: &Reload,
        report: &watch::Sender<Report>,
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
            self.start(asked, pipelines, reload, report);
        }
    }

    /// Reads the configuration again and plans it; starts its checks (or, when it starts
    /// nothing, the drain of what it stops). One that fails here is answered at once.
    fn start(
        &mut self,
        asked: Asked,
        pipelines: &mut Pipelines,
        reload: &Reload,
        report: &watch::Sender<Report>,
    ) {
        let plan = (reload.load)()
            .map_err(|e| ReloadError::Config(e.to_string()))
            .and_then(|next| pipelines.plan(next));
        let plan = match plan {
            Ok(plan) => plan,
            Err(error) => {
                let answer = failed(asked.by, error);
                asked.answer(&answer);
                return self.start_queued(pipelines, reload, report);
            }
        };
        let work = match plan.checked.clone() {
            Some(checked) => Work::Preparing((reload.prepare)(checked)),
            None => Work::Draining(pipelines.begin(&plan)),
        };
        self.current = Some(Current { asked, plan, work });
    }

    /// The reload asked for while the last one ran, if any.
    fn start_queued(
        &mut self,
        pipelines: &mut Pipelines,
        reload: &Reload,
        report: &watch::Sender<Report>,
    ) {
        if let Some(asked) = self.queued.take() {
            self.start(asked, pipelines, reload, report);
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
        match step {
            Step::Prepared(Ok(())) => {
                let work = Work::Draining(pipelines.begin(&current.plan));
                self.current = Some(Current { work, ..current });
                return;
            }
            Step::Prepared(Err(error)) => {
                let answer = failed(current.asked.by, error);
                current.asked.answer(&answer);
            }
            Step::Drained((drained, _)) => {
                let done = pipelines.finish(current.plan, drained);
                pipelines.report_runs(report);
                let answer = reloaded(current.asked.by, &done);
                current.asked.answer(&answer);
            }
        }
        self.start_queued(pipelines, reload, report);
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
            Work::Preparing(_) => {
                warn!(
                    by,
                    "reload interrupted by the shutdown before it changed anything"
                );
                None
            }
            Work::Draining(drain) => {
                warn!(by, removed = %current.plan.report.removed.join(","),
                    changed = %current.plan.report.changed.join(","),
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
            "reload: the HTTP API serves the pipelines it started with until a restart");
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
