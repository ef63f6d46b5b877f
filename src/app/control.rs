//! How a running instance is steered: the remote commands the registry relays ([`apply`], on the
//! actor system's thread, with [`ControlError`] for what it refuses), the registry's own loop
//! (heartbeats, commands, balancing decisions, deregistration: [`registry_loop`]). The operator
//! signals stand for commands too (`super::signals`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

use super::pipelines::{Holds, ReloadError};
use crate::events::{self, Kind};
use crate::pipeline::OutOfRange;
use crate::pipeline::balance::BoundsError;
use crate::pipeline::{self, Pipeline};
use crate::registry::{Command, CtlCommand, PipelineRecord, Registry, Rejected, Report, Status};

/// Why a remote command was not applied: rejected before it reached the pipelines (by the
/// guard, or malformed), or refused by them. Its text is the outcome's `error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// Refused by the guard or malformed ([`Rejected`]).
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// It acts on pipelines and the instance runs none (ROLES without consumer or dlq).
    #[error("this instance runs no consumer role")]
    NoConsumer,
    /// Its `--pipeline` is not one the instance runs; `runs` lists those it runs, once each.
    #[error("this instance runs no pipeline {name:?} (it runs {})", runs.join(", "))]
    NoPipeline { name: String, runs: Vec<String> },
    /// `scale --min/--max` on an instance with no main stage.
    #[error("this instance runs no main stage (ROLES has no consumer)")]
    NoMainStage,
    /// A number outside what a pipeline takes.
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    /// Bounds a main stage cannot take.
    #[error(transparent)]
    Bounds(#[from] BoundsError),
    /// It arrived while the instance was stopping.
    #[error("warren is stopping")]
    Stopping,
    /// `scale`, `rate` or `concurrency` with `--pipeline` naming a pipeline that a reload in
    /// progress stops or starts again (a pause or resume of it is kept for when it starts).
    #[error(
        "pipeline {name:?} is being stopped or started again by a reload in progress; send the command again once the reload is done (`warren events --type reloaded`)"
    )]
    Reloading { name: String },
    /// `pause` or `resume` with `--pipeline` naming a pipeline that a reload in progress
    /// removes: nothing would keep it (review R35i F6: answered `executed`, then forgotten).
    #[error(
        "pipeline {name:?} is being removed by a reload in progress: there is nothing to pause or resume (added again later, it starts as the instance's pause says)"
    )]
    Removing { name: String },
    /// `scale`, `rate` or `concurrency` without `--pipeline` while a reload in progress stops
    /// and starts pipelines again (`again`): they start with their entries' values, so the
    /// command would miss them; refused whole (review R44 F4: answered `executed`).
    #[error(
        "{command} applies to every pipeline, and a reload in progress stops and starts again {}: they start with their entries' values, not this command's, so nothing was applied; send it again once the reload is done (`warren events --type reloaded`){}",
        quoted(again),
        if kept.is_empty() { String::new() } else { format!(", or name the pipelines it keeps with --pipeline ({})", kept.join(", ")) }
    )]
    ReloadingSome {
        command: Command,
        again: Vec<String>,
        kept: Vec<String>,
    },
    /// A reload that changed nothing: the configuration does not load or check, or a table
    /// does not fit.
    #[error("reload failed, nothing changed: {0}")]
    Reload(#[from] ReloadError),
}

/// `pipeline "a"`, `pipelines "a", "b"`: names as the refusals quote them.
fn quoted(names: &[String]) -> String {
    let list: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    let list = crate::text::listed(&list);
    if names.len() == 1 {
        format!("pipeline {list}")
    } else {
        format!("pipelines {list}")
    }
}

/// What an applied command says beside `executed` (a reload's changes), or why it failed.
pub(super) type Answer = Result<Option<String>, ControlError>;

/// A remote command read from Redis and where to answer whether it was applied.
pub(super) type Control = (CtlCommand, Command, oneshot::Sender<Answer>);

/// Applies `command` (for every pipeline, or only `pipeline`) to this instance's running
/// stages, and `pause` / `resume` to the holds ([`Holds`]: the instance's pause and each
/// pipeline's own are two layers). `drain` and `reload` are the run loop's to carry out.
/// `reloading` names the pipelines a reload in progress stops or starts again, each with
/// whether it removes it: their stages are not in `pipelines`; a pause or resume of one it
/// starts again by name changes its hold (the pipeline started again takes it), of one it
/// removes is refused ([`ControlError::Removing`]), anything else naming one is refused
/// ([`ControlError::Reloading`]); a `scale`, `rate` or `concurrency` for every pipeline while it
/// starts some again is refused too, naming them ([`ControlError::ReloadingSome`]).
pub(super) fn apply(
    command: Command,
    pipeline: Option<&str>,
    pipelines: &[&Pipeline],
    reloading: &[(String, bool)],
    holds: &mut Holds,
    report: &watch::Sender<Report>,
    budget: usize,
) -> Result<(), ControlError> {
    let needs_consumer = || {
        if pipelines.is_empty() && reloading.is_empty() {
            Err(ControlError::NoConsumer)
        } else {
            Ok(())
        }
    };
    // `--pipeline NAME`: the stages of that pipeline alone (its main and DLQ stages).
    let chosen: Vec<&Pipeline> = match pipeline {
        None => pipelines.to_vec(),
        Some(name) => {
            let chosen: Vec<&Pipeline> = pipelines
                .iter()
                .copied()
                .filter(|p| p.id.pipeline() == name)
                .collect();
            let reloaded = reloading.iter().find(|(r, _)| r == name);
            if chosen.is_empty() && reloaded.is_some_and(|(_, removed)| *removed) {
                return Err(ControlError::Removing {
                    name: name.to_string(),
                });
            }
            if chosen.is_empty() && reloaded.is_some() {
                if !matches!(command, Command::Pause | Command::Resume) {
                    return Err(ControlError::Reloading {
                        name: name.to_string(),
                    });
                }
            } else if chosen.is_empty() && !pipelines.is_empty() {
                // Once each: the stages come main stages first, then DLQ stages.
                let mut runs: Vec<String> = Vec::new();
                for p in pipelines {
                    if !runs.iter().any(|r: &String| r == p.id.pipeline()) {
                        runs.push(p.id.pipeline().to_string());
                    }
                }
                return Err(ControlError::NoPipeline {
                    name: name.to_string(),
                    runs,
                });
            }
            chosen
        }
    };
    let whole = pipeline.is_none();
    // For every pipeline, while a reload stops and starts some again: those start with their
    // entries' values, so a scale or a rate would miss them (a pause is the holds', which they
    // take). Those it only removes miss nothing.
    let again: Vec<String> = reloading
        .iter()
        .filter(|(_, removed)| !removed)
        .map(|(name, _)| name.clone())
        .collect();
    if whole
        && !again.is_empty()
        && matches!(
            command,
            Command::Scale { .. } | Command::Rate { .. } | Command::Concurrency { .. }
        )
    {
        let mut kept: Vec<String> = Vec::new();
        for p in pipelines {
            if !kept.iter().any(|k| k == p.id.pipeline()) {
                kept.push(p.id.pipeline().to_string());
            }
        }
        return Err(ControlError::ReloadingSome {
            command,
            again,
            kept,
        });
    }
    // `paused` / `resumed`: once for the instance, or once for the pipeline named.
    let announce = |kind: Kind| {
        events::emit(pipeline, kind);
    };
    match command {
        Command::Pause | Command::Resume => {
            needs_consumer()?;
            let on = command == Command::Pause;
            match pipeline {
                None => holds.all = on,
                Some(name) if on => {
                    holds.pipelines.insert(name.to_string());
                }
                Some(name) => {
                    holds.pipelines.remove(name);
                }
            }
            for p in &chosen {
                let name = p.id.pipeline();
                p.hold(holds.holds(name));
                // A pipeline's own pause (the instance's shows in its status).
                crate::metrics::stage(&p.id).paused.store(
                    holds.pipelines.contains(name),
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            let by = "operator".to_string();
            announce(if on {
                Kind::Paused { by }
            } else {
                Kind::Resumed { by }
            });
            if whole {
                let status = if on { Status::Paused } else { Status::Running };
                report.send_modify(|r| r.status = status);
            }
            Ok(())
        }
        // The run loop stops the process, or reloads (`super::reload`).
        Command::Drain | Command::Reload => Ok(()),
        Command::Scale { processors: n } => {
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
        Command::Concurrency { min, max } => {
            needs_consumer()?;
            // Checked for every chosen stage before any changes, so a refusal changes nothing.
            let stages: Vec<_> = chosen
                .iter()
                .filter_map(|p| p.concurrency.clone())
                .collect();
            if stages.is_empty() {
                return Err(ControlError::NoMainStage);
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
        Command::Rate { per_s: n } => {
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
    }
}

/// Keeps this instance registered in Redis (its record publishes `pipelines`, as a reload
/// changes them), relays remote commands, and deregisters at the end. A command's answer is
/// awaited beside the heartbeat, never in its way: a reload that drains for a minute leaves the
/// instance beating (and other commands relayed) meanwhile.
pub(super) async fn registry_loop(
    mut registry: Registry,
    ctl: mpsc::UnboundedSender<Control>,
    mut report: watch::Receiver<Report>,
    mut stop: oneshot::Receiver<String>,
    mut decisions: mpsc::UnboundedReceiver<pipeline::balance::Decision>,
    mut pipelines: watch::Receiver<Vec<PipelineRecord>>,
) {
    use futures::StreamExt;
    registry.set_pipelines(pipelines.borrow_and_update().clone());
    let mut beat = tokio::time::interval(registry.heartbeat_every());
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The commands relayed to the run loop whose answer has not come yet.
    let mut answers = futures::stream::FuturesUnordered::new();
    loop {
        tokio::select! {
            reason = &mut stop => {
                // The answers given before the stop (a reload's waiters told warren stops).
                while let Some(Some((wire, answer))) = futures::FutureExt::now_or_never(answers.next()) {
                    let answer: Answer = answer;
                    registry.record(&wire, &answer.map(|_| ()), None).await;
                }
                let reason = reason.unwrap_or_else(|_| "stopped".into());
                registry.deregister(&reason).await;
                return;
            }
            _ = beat.tick() => {
                let now = *report.borrow();
                registry.heartbeat(now).await;
            }
            Ok(()) = pipelines.changed() => {
                registry.set_pipelines(pipelines.borrow_and_update().clone());
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
            Some((wire, answer)) = answers.next() => {
                let answer: Answer = answer;
                let (result, detail) = match answer {
                    Ok(detail) => (Ok(()), detail),
                    Err(e) => (Err(e), None),
                };
                registry.record(&wire, &result, detail).await;
                let now = *report.borrow();
                registry.heartbeat(now).await;
            }
            _ = poll.tick() => {
                while let Some((wire, verdict)) = registry.next_command().await {
                    // A refused or malformed command never reaches the pipelines; it is only
                    // recorded.
                    let answer: futures::future::BoxFuture<'static, Answer> = match verdict {
                        Err(refused) => Box::pin(std::future::ready(Err(ControlError::from(refused)))),
                        Ok(command) => {
                            let (tx, rx) = oneshot::channel();
                            if ctl.send((wire.clone(), command, tx)).is_ok() {
                                Box::pin(async { rx.await.unwrap_or(Err(ControlError::Stopping)) })
                            } else {
                                Box::pin(std::future::ready(Err(ControlError::Stopping)))
                            }
                        }
                    };
                    answers.push(async move { (wire, answer.await) });
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

    /// A pause of a pipeline a reload in progress starts again is kept in the holds; of one it
    /// removes, refused (review R35i F6); anything else of either waits for the reload.
    #[test]
    fn a_pause_of_a_pipeline_a_reload_removes_is_refused() {
        let (report, _) = watch::channel(Report {
            status: Status::Running,
            processors: 1,
            rate_limit_per_s: 0,
        });
        let reloading = [("gone".to_string(), true), ("again".to_string(), false)];
        let mut holds = Holds::default();
        let apply = |command, name, holds: &mut Holds| {
            apply(command, Some(name), &[], &reloading, holds, &report, 8)
                .map_err(|e| e.to_string())
        };
        assert_eq!(apply(Command::Pause, "again", &mut holds), Ok(()));
        assert!(holds.holds("again"));
        let refused = apply(Command::Pause, "gone", &mut holds).unwrap_err();
        assert!(
            refused.contains("\"gone\" is being removed by a reload in progress"),
            "{refused}"
        );
        assert!(!holds.holds("gone"));
        let waits = apply(Command::Scale { processors: 2 }, "again", &mut holds).unwrap_err();
        assert!(
            waits.contains("is being stopped or started again"),
            "{waits}"
        );
    }

    /// Review R44 F4: `scale`, `rate` or `concurrency` for every pipeline while a reload stops
    /// and starts a pipeline again was answered `executed`, though that pipeline starts with
    /// its entry's values: refused, naming it and why, nothing applied. A reload that only
    /// removes pipelines leaves nothing to miss the command.
    #[test]
    fn a_command_for_every_pipeline_during_a_reload_names_what_would_miss_it() {
        let (report, _) = watch::channel(Report {
            status: Status::Running,
            processors: 1,
            rate_limit_per_s: 0,
        });
        let mut holds = Holds::default();
        let reloading = [("gone".to_string(), true), ("again".to_string(), false)];
        for command in [
            Command::Rate { per_s: 5 },
            Command::Scale { processors: 2 },
            Command::Concurrency {
                min: Some(1),
                max: Some(2),
            },
        ] {
            let refused = apply(command, None, &[], &reloading, &mut holds, &report, 8)
                .map_err(|e| e.to_string());
            let Err(refused) = refused else {
                panic!("{command}: {refused:?}, though pipeline again misses it");
            };
            assert!(
                refused.contains("\"again\"")
                    && refused.contains("reload in progress")
                    && refused.contains("nothing was applied"),
                "{refused}"
            );
            assert!(!refused.contains("\"gone\""), "{refused}");
        }
        assert_eq!(report.borrow().rate_limit_per_s, 0, "nothing applied");
        // The instance's pause is the holds', which what a reload starts takes.
        assert_eq!(
            apply(
                Command::Pause,
                None,
                &[],
                &reloading,
                &mut holds,
                &report,
                8
            ),
            Ok(())
        );
        let removing = [("gone".to_string(), true)];
        assert_eq!(
            apply(
                Command::Rate { per_s: 5 },
                None,
                &[],
                &removing,
                &mut holds,
                &report,
                8
            ),
            Ok(())
        );
    }

    /// Commands read from Redis, applied by an instance without pipelines: what is malformed is
    /// refused when read (by its typed error), the rest by the instance.
    #[test]
    fn commands_are_applied_or_refused() {
        let (report, _) = watch::channel(Report {
            status: Status::Running,
            processors: 1,
            rate_limit_per_s: 0,
        });
        let no_consumer = Err("this instance runs no consumer role".to_string());
        for (raw, expected) in [
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
                Err("scale needs a number of processors".to_string()),
            ),
            (
                r#"{"id":"a","command":"rate","rate":3,"issued_at":1,"by":"b"}"#,
                no_consumer.clone(),
            ),
            (
                r#"{"id":"a","command":"rate","processors":3,"issued_at":1,"by":"b"}"#,
                Err("rate needs a number of messages per second".to_string()),
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
                Err("pause takes no processors".to_string()),
            ),
            (
                r#"{"id":"a","command":"concurrency","issued_at":1,"by":"b"}"#,
                Err("concurrency needs min or max".to_string()),
            ),
            (
                r#"{"id":"a","command":"reload","pipeline":"orders","issued_at":1,"by":"b"}"#,
                Err("reload applies to the whole instance, not to one pipeline".to_string()),
            ),
        ] {
            let wire: CtlCommand = serde_json::from_str(raw).unwrap();
            let mut holds = Holds::default();
            let result = Command::read(&wire)
                .map_err(|e| ControlError::from(Rejected::from(e)))
                .and_then(|c| {
                    apply(
                        c,
                        wire.pipeline.as_deref(),
                        &[],
                        &[],
                        &mut holds,
                        &report,
                        8,
                    )
                });
            assert_eq!(holds, Holds::default(), "{raw}: no holds changed");
            assert_eq!(result.map_err(|e| e.to_string()), expected, "{raw}");
        }
        assert_eq!(report.borrow().status, Status::Running, "nothing applied");
    }
}
