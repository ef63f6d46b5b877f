//! A reload's plan, apart from the running pipelines: what counts as a pipeline's change
//! ([`same`]), what the process's HTTP API needs kept ([`api_kept`]), the queues a reload leaves
//! ([`left_queues`]), what a removed pipeline leaves under its name ([`left_behind`]), what the
//! API does until a restart ([`api_notes`]) and the report of what it did ([`ReloadReport`]).

use std::collections::HashSet;

use super::{Declared, ReloadError};

/// Whether a running pipeline declared as `old` is left untouched by a reload that declares it
/// as `new`: the same resolved spec. The one place that says what a pipeline's change is.
pub(in crate::app) fn same(old: &Declared, new: &Declared) -> bool {
    // Where the entry is written (the shipped defaults or a file) is not what runs: the
    // built-in users entry copied into a file is the same pipeline (review R35h F9: it was
    // drained and started again).
    // Nor is its HTTP API: the API serves the pipelines it started with until a restart, so a
    // change of `api`, `api_key` or `api_check` alone restarted the consumers for nothing
    // (review R35i F8; the reload warns that the API waits for a restart).
    if old.spec.builtin == new.spec.builtin && old.spec.api == new.spec.api {
        return old.spec == new.spec;
    }
    let mut new = new.spec.clone();
    new.builtin = old.spec.builtin;
    new.api = old.spec.api;
    old.spec == new
}

/// The pipelines this process's HTTP API serves (`api`: those it started with, `api = true`)
/// keep, in `wanted`, where the API publishes and reads: a reload that removes one or changes
/// its main exchange, main queue or tables is refused, as the API follows only at a restart
/// (review R35i F5: after a reload renamed users' main queue, every POST was answered 200 and
/// stranded in the queue left behind; after a table switch, GET read the old table).
pub(in crate::app) fn api_kept(api: &[Declared], wanted: &[Declared]) -> Result<(), ReloadError> {
    let tables = |d: &Declared| -> Vec<String> {
        std::iter::once(d.spec.mapping.table.clone())
            .chain(d.spec.mapping.children.iter().map(|c| c.table.clone()))
            .collect()
    };
    for served in api.iter().filter(|d| d.spec.api.enabled) {
        let (was, table_was) = (&served.spec.names, tables(served));
        let change = match wanted.iter().find(|d| d.name == served.name) {
            None => Some(format!("removes pipeline {}", served.name)),
            Some(d)
                if (&d.spec.names.main_exchange, &d.spec.names.main_queue)
                    != (&was.main_exchange, &was.main_queue) =>
            {
                Some(format!(
                    "moves pipeline {}'s main queue from {}/{} to {}/{}",
                    served.name,
                    was.main_exchange,
                    was.main_queue,
                    d.spec.names.main_exchange,
                    d.spec.names.main_queue
                ))
            }
            Some(d) if tables(d) != table_was => Some(format!(
                "changes pipeline {}'s tables from {} to {}",
                served.name,
                table_was.join(", "),
                tables(d).join(", ")
            )),
            Some(_) => None,
        };
        if let Some(change) = change {
            return Err(ReloadError::Api {
                pipeline: served.name.clone(),
                change,
            });
        }
    }
    Ok(())
}

/// The queues of `running` (removed or changed) that none of `wanted` consumes: `queue
/// (pipeline)`, for [`ReloadReport::left_queues`], and the `warren move` that empties each
/// where the pipeline now takes such messages ([`ReloadReport::moves`]). A main queue or a
/// DLQ; and, with a main queue left, its retry tiers that no wanted pipeline uses, as `tier
/// (pipeline, retry tier of queue)`: what waits there dead-letters back to the left main queue
/// by its TTL, after a move of that queue said "0 left" (review R38-F5). A retry tier of a main
/// queue still consumed empties by itself and is not named (review R35i F1).
pub(in crate::app) fn left_queues<'a>(
    running: impl Iterator<Item = &'a Declared>,
    wanted: &'a [Declared],
) -> Vec<Left> {
    let consumed = |d: &'a Declared| {
        [
            d.spec.names.main_queue.as_str(),
            d.spec.names.dlq_queue.as_str(),
        ]
    };
    let now: HashSet<&str> = wanted.iter().flat_map(consumed).collect();
    let tiers_now: HashSet<&str> = wanted
        .iter()
        .flat_map(|d| d.spec.names.retry_tiers.iter().map(|t| t.queue.as_str()))
        .collect();
    running
        .flat_map(|r| {
            // Where the pipeline of that name takes them now: its main exchange under its
            // main queue's routing key, its DLX under its DLQ's. A message moved keeps its
            // own routing key without one, which the left queue is still bound under (review
            // R35i F7: the advice moved them back where they were).
            let next = wanted.iter().find(|d| d.name == r.name).map(|d| {
                let n = &d.spec.names;
                [
                    format!("{}/{}", n.main_exchange, n.main_queue),
                    format!("{}/{}", n.dlx_exchange, n.dlq_queue),
                ]
            });
            let to = |i: usize| -> String {
                next.as_ref()
                    .map_or("EXCHANGE/ROUTING_KEY".to_string(), |to| to[i].clone())
            };
            let main = r.spec.names.main_queue.as_str();
            // The tiers first: moved after the main queue, what a tier's TTL sends back to it
            // meanwhile stays there after its move said "0 left" (review R39-F14).
            let mut left: Vec<Left> = Vec::new();
            let mut queues: Vec<Left> = consumed(r)
                .into_iter()
                .enumerate()
                .filter(|(_, q)| !now.contains(q))
                .map(|(i, q)| Left {
                    queue: q.to_string(),
                    named: format!("{q} ({})", r.name),
                    moved: format!("warren move --from {q} --to {}", to(i)),
                })
                .collect();
            if !now.contains(main) {
                left.extend(
                    r.spec
                        .names
                        .retry_tiers
                        .iter()
                        .map(|t| t.queue.as_str())
                        .filter(|q| !tiers_now.contains(q))
                        .map(|q| Left {
                            queue: q.to_string(),
                            named: format!("{q} ({}, retry tier of {main})", r.name),
                            moved: format!("warren move --from {q} --to {}", to(0)),
                        }),
                );
            }
            left.append(&mut queues);
            left
        })
        .collect()
}

/// What the advice to move a left queue adds when a stage that consumed one stopped without a
/// proof that the broker handled its acks (review R44 F1: said always before, also when every
/// close was answered): its last acks may be lost, and those messages come back to the left
/// queue, stored already, once the broker drops the link; moved to a pipeline on another table,
/// they are stored again there (review R42b F8).
pub(in crate::app) const MOVE_CAVEAT: &str = "before a move, wait until the broker dropped the \
     link of the stage that consumed it (AMQP_HEARTBEAT_S; it warned \"the broker link did not \
     answer its close\", or its link was gone): its last acks may not have reached the broker, \
     which then puts those messages, stored already by the old stage, back in its queue, and a \
     move republishes them as new messages (a pipeline on another table stores them again: \
     where the table changed, drain the queue with the old configuration instead)";

/// What the pipelines `removed` leave behind under their names, one sentence each, for the
/// reload's report (review R44 F7: a rename by reload was silent about them). A pipeline's
/// parked messages are `dead_letters` rows filed under its name: the pipeline of another name
/// neither lists nor replays them, and parks what it refuses under its own name. With deletes,
/// its tombstones are in `<schema>.tombstones_<name>`, which the pipeline now writing its table
/// (of another name) does not read: an older copy of a deleted row (retried, in the DLQ,
/// parked and replayed) writes the row again.
pub(in crate::app) fn left_behind<'a>(
    removed: impl Iterator<Item = &'a Declared>,
    wanted: &[Declared],
    schema: &str,
) -> Vec<String> {
    removed
        .map(|r| {
            let name = &r.name;
            let mut said = format!(
                "pipeline {name}'s parked messages, if any, stay filed under {name} (`warren dlq \
                 --pipeline {name} parked list` lists them; a replay needs a configuration that \
                 declares {name})"
            );
            if r.spec.mapping.delete.is_some() {
                let table = &r.spec.mapping.table;
                let now = wanted
                    .iter()
                    .find(|d| &d.spec.mapping.table == table)
                    .map_or("no pipeline".to_string(), |d| {
                        format!("pipeline {}", d.name)
                    });
                said.push_str(&format!(
                    ", and its tombstones stay in {schema}.tombstones_{name}, which {now} (writing \
                     {table}) does not read: its deletes no longer hold back older copies of \
                     the rows (a retried, dead-lettered or replayed one writes a deleted row \
                     again); move them to the new name with warren stopped, or drop the table \
                     (docs/pipelines.md#deletes, \"A renamed or removed pipeline\")"
                ));
            }
            said
        })
        .collect()
}

/// What the HTTP API does until a restart for each pipeline of `changed` (added, changed or
/// with other `api` keys, with `api = true` before or after), whose API `served` says it
/// started with: a pipeline it did not serve answers 404 (review R44 F10: silent); one it
/// served is served as it started.
pub(in crate::app) fn api_notes(
    changed: &[String],
    served: &[Declared],
    wanted: &[Declared],
) -> Vec<String> {
    let is_api = |name: &String| wanted.iter().any(|d| &d.name == name && d.spec.api.enabled);
    let was_served = |name: &String| served.iter().any(|d| &d.name == name && d.spec.api.enabled);
    changed
        .iter()
        .map(|name| match (was_served(name), is_api(name)) {
            (false, _) => format!("/api/v1/{name} answers 404 until then"),
            (true, false) => format!("/api/v1/{name} is still served until then"),
            (true, true) => format!("/api/v1/{name} checks and publishes as it started until then"),
        })
        .collect()
}

/// A queue a reload leaves ([`left_queues`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::app) struct Left {
    /// Its name on the broker.
    pub queue: String,
    /// `queue (pipeline)`, or `tier (pipeline, retry tier of queue)`.
    pub named: String,
    /// The `warren move` that empties it.
    pub moved: String,
}

/// What a reload changed: the pipelines by name, and what it could not apply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::app) struct ReloadReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
    pub unchanged: Vec<String>,
    /// Settings it changed that are not a pipeline's: they keep their values until a restart.
    pub restart_needed: Vec<String>,
    /// Added, removed or changed pipelines with `api = true`: the HTTP API serves the pipelines
    /// it started with until a restart.
    pub api_unchanged: Vec<String>,
    /// What each of [`ReloadReport::api_unchanged`] means for its routes until a restart
    /// ([`api_notes`]): `/api/v1/refunds answers 404 ...` for one the API did not serve at the
    /// start (review R44 F10: silent).
    pub api_notes: Vec<String>,
    /// What each removed pipeline leaves behind under its name ([`left_behind`]): its parked
    /// messages, its tombstones (review R44 F7: a rename was silent about them).
    pub left_behind: Vec<String>,
    /// Whether every stage it stopped settled all its deliveries within `SHUTDOWN_TIMEOUT_MS`
    /// (what one did not settle goes back to its queue).
    pub drained: bool,
    /// Queues a removed or changed pipeline consumed (or dead-lettered back to its main queue)
    /// that no pipeline consumes now, `queue (pipeline)`: what they hold waits there until
    /// moved (review R35h F3: a main and retry queue renamed together stranded every retry
    /// without a word, and `warren status` stopped showing them).
    pub left_queues: Vec<String>,
    /// For each of [`ReloadReport::left_queues`], the `warren move` that empties it.
    pub moves: Vec<String>,
    /// For each of [`ReloadReport::left_queues`], its name on the broker.
    pub left_names: Vec<String>,
    /// Whether a stage that consumed one of [`ReloadReport::left_queues`] stopped without a
    /// proof that the broker handled its acks ([`MOVE_CAVEAT`]).
    pub acks_unproven: bool,
}

impl ReloadReport {
    /// The queues it leaves, as [`left_queues`] answers them.
    pub fn leave(&mut self, left: Vec<Left>) {
        for l in left {
            self.left_queues.push(l.named);
            self.moves.push(l.moved);
            self.left_names.push(l.queue);
        }
    }

    /// Forgets the left queues that do not exist on the broker (`absent`): one never declared
    /// holds nothing, and naming it with a move sends the operator after nothing (review
    /// R39-F15).
    pub fn forget_absent(&mut self, absent: &[String]) {
        let keep: Vec<bool> = self
            .left_names
            .iter()
            .map(|q| !absent.contains(q))
            .collect();
        for list in [&mut self.left_queues, &mut self.moves, &mut self.left_names] {
            let mut kept = keep.iter();
            list.retain(|_| *kept.next().unwrap_or(&true));
        }
    }

    /// `; ` and [`MOVE_CAVEAT`] when it applies, else nothing.
    pub fn move_caveat(&self) -> String {
        if self.acks_unproven {
            format!("; {MOVE_CAVEAT}")
        } else {
            String::new()
        }
    }

    /// `added orders; removed refunds; changed users; unchanged audit`, the parts with names
    /// only (`nothing changed` when none), then what waits for a restart.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = [
            ("added", &self.added),
            ("removed", &self.removed),
            ("changed", &self.changed),
        ]
        .iter()
        .filter(|(_, names)| !names.is_empty())
        .map(|(what, names)| format!("{what} {}", names.join(", ")))
        .collect();
        if parts.is_empty() {
            parts.push("no pipeline changed".into());
        }
        if !self.unchanged.is_empty() {
            parts.push(format!("unchanged {}", self.unchanged.join(", ")));
        }
        if !self.restart_needed.is_empty() {
            parts.push(format!(
                "needs a restart to apply {}",
                self.restart_needed.join(", ")
            ));
        }
        if !self.left_queues.is_empty() {
            parts.push(format!(
                "no pipeline consumes {} now: what they hold waits there until moved ({}){}",
                self.left_queues.join(", "),
                self.moves.join("; "),
                self.move_caveat()
            ));
        }
        parts.extend(self.left_behind.iter().cloned());
        if !self.api_notes.is_empty() {
            parts.push(format!(
                "the HTTP API serves the pipelines it started with until a restart: {}",
                self.api_notes.join("; ")
            ));
        }
        if !self.drained {
            parts.push(
                "a stopped stage reached SHUTDOWN_TIMEOUT_MS: what it had not settled went back \
                 to its queue"
                    .into(),
            );
        }
        parts.join("; ")
    }
}
