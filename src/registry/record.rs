//! The instance record: one serde struct per instance, written whole by its heartbeat and read
//! whole by `warren status` and `warren ctl`; what a reader makes of a record it cannot read; and
//! the pipelines an instance runs (names, table, queues), which every tool learns from it, and
//! which of a pipeline's names a tool uses ([`resolve`]: the configuration's when it gives them,
//! else the live instances', else the built-in defaults; several sets when instances disagree).
//!
//! The record is the JSON of [`InstanceRecord`] in the field `record` of the hash
//! `{prefix}:instances:{host}:{pid}` (a hash, so that an older warren's `status` reading it meets
//! no type error). Its `format` is [`RECORD_FORMAT`]; a record of another format, a hash without
//! the field (an instance of an older warren) or bytes that do not parse are [`Unreadable`], shown
//! as such, never skipped.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::redis::ConnectError;
use crate::config::pipelines::Names;
use crate::config::pipelines::PipelineSpec;

/// The format of the record this warren writes and reads; another one is [`Unreadable::Format`].
pub const RECORD_FORMAT: u32 = 1;
/// The hash field holding the record.
pub const RECORD_FIELD: &str = "record";

/// What an instance is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Taking deliveries.
    Running,
    /// Every pipeline held by an operator (`warren ctl pause` without `--pipeline`, `SIGUSR1`).
    Paused,
    /// Stopping: finishing what is in flight.
    Draining,
    /// Started, every consumer and the API's publishes held until the start's check of the
    /// broker's exchanges and queues passed (`topology::gate`; review R39-F9: said `running`).
    Waiting,
}

impl Status {
    /// Its name, as in the record and the table.
    pub fn name(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Draining => "draining",
            Status::Waiting => "waiting",
        }
    }
}

/// The sink-outage breakers of the instance's pipelines, together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Breaker {
    /// Every breaker lets deliveries through.
    Closed,
    /// At least one holds its consumer.
    Open,
}

/// One stage's counts (a pipeline's main or DLQ stage), from the instance's start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageCounts {
    /// Held by `warren ctl pause --pipeline` (an instance-wide pause shows in `status`).
    pub paused: bool,
    pub received: u64,
    pub inserted: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    /// Over the last rate window, one decimal.
    pub received_per_s: f64,
    pub inserted_per_s: f64,
    /// Batch inserts in flight at most; 0 for a stage that does not batch-insert (yet).
    pub concurrency: u64,
    /// Its processors and rate limit (messages per second, 0 = none), each pipeline's own: from
    /// its spec at start, then `warren ctl scale` / `rate` (with or without `--pipeline`).
    /// Absent in the records of a warren before them (read as 0).
    #[serde(default)]
    pub processors: u64,
    #[serde(default)]
    pub rate_limit_per_s: u32,
}

/// A pipeline an instance runs: what `status`, `ctl`, `dlq` and `events` need to know of it
/// without the configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineRecord {
    /// Its name (`users`, `orders`): what `--pipeline` names.
    pub name: String,
    /// The table its rows go to.
    pub table: String,
    /// Where `dlq replay` sends messages back to.
    pub main_exchange: String,
    pub main_queue: String,
    /// Its retry tiers' queues, shortest delay first.
    pub retry_queues: Vec<String>,
    pub dlq_queue: String,
}

impl PipelineRecord {
    /// The pipeline `name` writing into `table`, with its exchanges and queues `names`.
    pub fn of(name: &str, table: &str, names: &Names) -> Self {
        Self {
            name: name.to_string(),
            table: table.to_string(),
            main_exchange: names.main_exchange.clone(),
            main_queue: names.main_queue.clone(),
            retry_queues: names.retry_tiers.iter().map(|t| t.queue.clone()).collect(),
            dlq_queue: names.dlq_queue.clone(),
        }
    }

    /// Its queues: main, retry tiers, DLQ.
    pub fn queues(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.main_queue.as_str())
            .chain(self.retry_queues.iter().map(String::as_str))
            .chain(std::iter::once(self.dlq_queue.as_str()))
    }
}

/// The pipelines `settings` configures ([`crate::config::Settings::pipelines`], resolved when it loaded): the
/// built-in users pipeline (unless a file's pipeline named users replaces it, or `run
/// --pipelines` leaves it out), then the file's, in its order.
pub fn configured(pipelines: &[PipelineSpec]) -> Vec<PipelineRecord> {
    pipelines
        .iter()
        .map(|p| PipelineRecord::of(&p.name, p.table(), &p.names))
        .collect()
}

/// Every pipeline `settings` configures, then each one the records publish that it does not
/// (by name; the first seen wins): once each.
pub fn known<'a>(
    pipelines: &[PipelineSpec],
    records: impl IntoIterator<Item = &'a InstanceRecord>,
) -> Vec<PipelineRecord> {
    let mut out = configured(pipelines);
    for r in records {
        for p in &r.pipelines {
            if !out.iter().any(|k| k.name == p.name) {
                out.push(p.clone());
            }
        }
    }
    out
}

/// What the configuration says of one pipeline: its names, and whether it gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Configured {
    pub pipeline: PipelineRecord,
    /// A file's `[[pipelines]]` entry, or the built-in users pipeline with one of its name
    /// settings (`MAIN_QUEUE`, ...) given in a file, the environment or `--set`: these names
    /// win over the records. `false` for the built-in defaults (`raffle_*`), which yield to
    /// what a live instance runs.
    pub explicit: bool,
}

/// Where the tools took a set of a pipeline's names from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Basis {
    /// The configuration names them.
    Config,
    /// Live instances run the pipeline on them (their records).
    Instances,
    /// The built-in defaults: no configuration names them and no live instance runs the
    /// pipeline.
    Defaults,
}

/// One set of names a pipeline runs on, and who says so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NameSet {
    #[serde(flatten)]
    pub pipeline: PipelineRecord,
    /// Where the names come from (`status --json`: `basis`).
    pub basis: Basis,
    /// `host:pid` of every live instance that runs the pipeline on exactly these names.
    pub instances: Vec<String>,
}

impl NameSet {
    /// `dlq rv_orders_dlq (main rv_orders_exchange -> rv_orders_queue), run by vm:12, vm:13`:
    /// what a choice between sets shows of one.
    fn describe(&self) -> String {
        let p = &self.pipeline;
        let whose = match (self.basis, self.instances.is_empty()) {
            (_, false) => format!("run by {}", self.instances.join(", ")),
            (Basis::Config, true) => "the configuration's".into(),
            _ => "the built-in defaults".into(),
        };
        format!(
            "dlq {} (main {} -> {}), {whose}",
            p.dlq_queue, p.main_exchange, p.main_queue
        )
    }

    /// What a tool that works on the DLQ uses of the names: the DLQ, and where a replay goes.
    fn dlq_target(&self) -> (&str, &str, &str) {
        let p = &self.pipeline;
        (&p.dlq_queue, &p.main_exchange, &p.main_queue)
    }
}

/// One pipeline as the tools know it: every set of names it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownPipeline {
    pub name: String,
    /// Never empty; the first is the one a tool uses when it may. Precedence: the
    /// configuration's names when it gives them (first), then the live instances' (one set per
    /// distinct set of names, in the order the records list them), then the built-in defaults
    /// when no instance runs the pipeline.
    pub sets: Vec<NameSet>,
}

/// Why a tool that acts on one DLQ cannot choose a pipeline's set of names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Choice {
    /// Live instances run the pipeline on different queues and no configuration names them.
    #[error(
        "pipeline {name:?} runs on different queues: {}; choose one with --instance HOST:PID, \
         or name its queues in a --config file", candidates.join("; ")
    )]
    Ambiguous {
        name: String,
        candidates: Vec<String>,
    },
    /// `--instance` names no live instance that runs the pipeline.
    #[error(
        "--instance {instance}: no live instance {instance} runs pipeline {name:?}; it runs on: {}",
        candidates.join("; ")
    )]
    NotRunBy {
        instance: String,
        name: String,
        candidates: Vec<String>,
    },
}

impl KnownPipeline {
    /// The set a tool that acts on the pipeline's DLQ uses: the one `instance` (`host:pid`)
    /// runs when given; else the configuration's when it names them; else the one every live
    /// instance agrees on (DLQ, main exchange and queue; retry tiers may differ), or an error
    /// that lists the candidates and how to choose.
    pub fn choose(&self, instance: Option<&str>) -> Result<&NameSet, Choice> {
        let candidates = || self.sets.iter().map(NameSet::describe).collect();
        if let Some(instance) = instance {
            return self
                .sets
                .iter()
                .find(|s| s.instances.iter().any(|i| i == instance))
                .ok_or_else(|| Choice::NotRunBy {
                    instance: instance.to_string(),
                    name: self.name.clone(),
                    candidates: candidates(),
                });
        }
        let Some(first) = self.sets.first() else {
            return Err(Choice::Ambiguous {
                name: self.name.clone(),
                candidates: Vec::new(),
            });
        };
        if first.basis == Basis::Config
            || self
                .sets
                .iter()
                .all(|s| s.dlq_target() == first.dlq_target())
        {
            return Ok(first);
        }
        Err(Choice::Ambiguous {
            name: self.name.clone(),
            candidates: candidates(),
        })
    }

    /// What a person should know about where the names come from, to be said once: the
    /// configuration and live instances disagree, or live instances disagree among themselves.
    pub fn note(&self) -> Option<String> {
        let queues = |s: &NameSet| s.pipeline.queues().collect::<Vec<_>>().join(", ");
        let [first, rest @ ..] = self.sets.as_slice() else {
            return None;
        };
        if rest.is_empty() {
            return None;
        }
        // What differs is what is said: two sets with the same queues differ in their table or
        // main exchange (review R40a F8: "different queues" over two identical lists, when one
        // queue's messages went into two tables).
        let queues_differ = rest.iter().any(|s| queues(s) != queues(first));
        let tables_differ = rest
            .iter()
            .any(|s| s.pipeline.table != first.pipeline.table);
        let how = if queues_differ {
            "on different queues"
        } else if tables_differ {
            "into different tables"
        } else {
            "from different exchanges"
        };
        let shown = |s: &NameSet| {
            let mut shown = queues(s);
            if tables_differ {
                shown.push_str(&format!(" into table {}", s.pipeline.table));
            }
            if !queues_differ && !tables_differ {
                shown.push_str(&format!(" from exchange {}", s.pipeline.main_exchange));
            }
            shown
        };
        let others: Vec<String> = rest
            .iter()
            .map(|s| format!("{} runs it on {}", s.instances.join(", "), shown(s)))
            .collect();
        Some(if first.basis == Basis::Config {
            format!(
                "pipeline {:?}: the configuration names {}, but {}; the tools act on the \
                 configuration's",
                self.name,
                shown(first),
                others.join("; ")
            )
        } else {
            format!(
                "pipeline {:?}: live instances run it {how}: {} runs it on {}; {}",
                self.name,
                first.instances.join(", "),
                shown(first),
                others.join("; ")
            )
        })
    }
}

/// Every pipeline the configuration names or a live instance runs, once each (the
/// configuration's first, in its order, then the others in the records' order), with every
/// set of names it runs on (see [`KnownPipeline::sets`] for the precedence).
pub fn resolve<'a>(
    configured: &[Configured],
    records: impl IntoIterator<Item = &'a InstanceRecord>,
) -> Vec<KnownPipeline> {
    let mut live: Vec<KnownPipeline> = Vec::new();
    for r in records {
        let who = format!("{}:{}", r.host, r.pid);
        for p in &r.pipelines {
            let at = match live.iter().position(|k| k.name == p.name) {
                Some(at) => at,
                None => {
                    live.push(KnownPipeline {
                        name: p.name.clone(),
                        sets: Vec::new(),
                    });
                    live.len() - 1
                }
            };
            let sets = &mut live[at].sets;
            match sets.iter_mut().find(|s| s.pipeline == *p) {
                Some(s) => s.instances.push(who.clone()),
                None => sets.push(NameSet {
                    pipeline: p.clone(),
                    basis: Basis::Instances,
                    instances: vec![who.clone()],
                }),
            }
        }
    }
    let mut out = Vec::new();
    for c in configured {
        let mut sets = match live.iter().position(|k| k.name == c.pipeline.name) {
            Some(at) => live.remove(at).sets,
            None => Vec::new(),
        };
        if c.explicit {
            // The configuration's first; the instances running on the same names join it.
            let instances = match sets.iter().position(|s| s.pipeline == c.pipeline) {
                Some(at) => sets.remove(at).instances,
                None => Vec::new(),
            };
            sets.insert(
                0,
                NameSet {
                    pipeline: c.pipeline.clone(),
                    basis: Basis::Config,
                    instances,
                },
            );
        } else if sets.is_empty() {
            sets.push(NameSet {
                pipeline: c.pipeline.clone(),
                basis: Basis::Defaults,
                instances: Vec::new(),
            });
        }
        out.push(KnownPipeline {
            name: c.pipeline.name.clone(),
            sets,
        });
    }
    out.extend(live);
    out
}

/// The pipeline `name` among `known`, or the error that lists them once each.
pub fn find_known<'a>(
    known: &'a [KnownPipeline],
    name: &str,
) -> Result<&'a KnownPipeline, UnknownPipeline> {
    by_name(known, name, |p| &p.name)
}

/// The item of `items` whose name (`name_of`) is `name`, or the error that lists every name.
fn by_name<'a, T>(
    items: &'a [T],
    name: &str,
    name_of: impl Fn(&T) -> &String,
) -> Result<&'a T, UnknownPipeline> {
    items
        .iter()
        .find(|p| name_of(p) == name)
        .ok_or_else(|| UnknownPipeline {
            name: name.to_string(),
            known: items.iter().map(|p| name_of(p).clone()).collect(),
            registry: None,
        })
}

/// A `--pipeline` that names no pipeline the configuration names or a live instance runs: Redis
/// answered and no instance runs it, or Redis could not be asked ([`UnknownPipeline::registry`]),
/// which the error tells apart, each with what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPipeline {
    pub name: String,
    /// Every known pipeline's name, once each.
    pub known: Vec<String>,
    /// Why the live instances are unknown (Redis unreachable), when they are: then an instance
    /// may well run the pipeline, and the error says so rather than that none does.
    pub registry: Option<ConnectError>,
}

impl UnknownPipeline {
    /// The error with what the tool met asking Redis for the live instances (`live`'s answer).
    pub fn asked<T>(mut self, live: &Result<T, ConnectError>) -> Self {
        self.registry = live.as_ref().err().cloned();
        self
    }
}

impl std::fmt::Display for UnknownPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = &self.name;
        match &self.registry {
            None => write!(
                f,
                "no pipeline {name:?}: the configuration does not name it and no live instance \
                 runs it; give the file that declares it (--config FILE), or start an instance \
                 that runs it (`warren run --config FILE`)"
            )?,
            Some(e) => write!(
                f,
                "no pipeline {name:?} in the configuration, and the live instances are unknown \
                 ({e}); {}, or give the file that declares it (--config FILE)",
                e.remedy()
            )?,
        }
        let known = if self.known.is_empty() {
            "none".to_string()
        } else {
            self.known.join(", ")
        };
        write!(f, "; known: {known}")?;
        match crate::config::closest(name, self.known.iter().map(String::as_str), false) {
            Some(closest) => write!(f, " (did you mean {closest}?)"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for UnknownPipeline {}

/// The pipeline `name` among `known`, or the error that lists them.
pub fn find<'a>(
    known: &'a [PipelineRecord],
    name: &str,
) -> Result<&'a PipelineRecord, UnknownPipeline> {
    by_name(known, name, |p| &p.name)
}

/// One instance as it publishes itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    /// [`RECORD_FORMAT`], so a reader knows what it reads.
    pub format: u32,
    /// With `pid`, names the instance's keys and addresses its commands.
    pub host: String,
    pub pid: u32,
    /// A random id drawn at start, which signed commands are bound to.
    pub run: String,
    /// The roles it runs (`consumer,dlq,api`).
    pub roles: String,
    /// warren's version.
    pub version: String,
    /// Unix seconds of its start, and of this heartbeat.
    pub started_at: u64,
    pub last_heartbeat: u64,
    pub status: Status,
    /// Processors per pipeline, as last set at start or by `scale`.
    pub processors: usize,
    /// Every main stage's batch inserts in flight at most, together.
    pub concurrency: u64,
    /// Messages per second each pipeline takes, 0 = no limit.
    pub rate_limit_per_s: u32,
    /// Its bound on a graceful stop and on a reload's drain (`SHUTDOWN_TIMEOUT_MS`), so that
    /// `warren ctl reload` waits as long as the instance may take; absent in the records of a
    /// warren before it (read as `None`).
    #[serde(default)]
    pub shutdown_timeout_ms: Option<u64>,
    /// Whether it has CONTROL_SECRET: it applies only commands signed for it, and signs its
    /// outcomes. `false`: it applies any command (a signature is not checked) and its outcomes
    /// cannot be verified, which `warren ctl` says of it in a mixed deployment; absent in the
    /// records of a warren before it.
    #[serde(default)]
    pub signed_commands: Option<bool>,
    pub breaker: Breaker,
    /// The process's counts from its start.
    pub received: u64,
    pub inserted: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub inflight: u64,
    /// Over the last rate window, one decimal.
    pub received_per_s: f64,
    pub inserted_per_s: f64,
    /// Each stage's counts, by its metrics label.
    pub stages: BTreeMap<String, StageCounts>,
    /// The pipelines it runs.
    pub pipelines: Vec<PipelineRecord>,
}

/// Why a registry entry could not be read as an [`InstanceRecord`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// A hash without the `record` field: the hash of an older warren (before the record), or
    /// something else written under the key.
    #[error(
        "no `record` field (fields: {fields}): an older warren's registry hash, or not warren's"
    )]
    NoRecord { fields: String },
    /// A record of another format.
    #[error("record format {found}, this warren reads format {RECORD_FORMAT}: another version")]
    Format { found: String },
    /// Bytes that are not a record.
    #[error("not a warren record: {0}")]
    Garbage(String),
}

impl InstanceRecord {
    /// The record in a registry hash's `fields` (`HGETALL`), or why not.
    pub fn read(fields: &HashMap<String, String>) -> Result<Self, Unreadable> {
        let Some(raw) = fields.get(RECORD_FIELD) else {
            let mut names: Vec<&str> = fields.keys().map(String::as_str).collect();
            names.sort_unstable();
            return Err(Unreadable::NoRecord {
                fields: names.join(", "),
            });
        };
        Self::parse(raw)
    }

    /// The record in `raw` (its JSON), or why not.
    pub fn parse(raw: &str) -> Result<Self, Unreadable> {
        let doc: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| Unreadable::Garbage(e.to_string()))?;
        match doc.get("format") {
            Some(f) if f.as_u64() == Some(u64::from(RECORD_FORMAT)) => {}
            Some(f) => {
                return Err(Unreadable::Format {
                    found: f.to_string(),
                });
            }
            None => return Err(Unreadable::Garbage("no `format` field".into())),
        }
        serde_json::from_value(doc).map_err(|e| Unreadable::Garbage(e.to_string()))
    }
}

/// One entry of the registry as a reader finds it: its key, and the record or why it is not one.
#[derive(Debug, Clone)]
pub struct Listed {
    /// `{prefix}:instances:{host}:{pid}`: names the entry even when it cannot be read.
    pub key: String,
    pub record: Result<InstanceRecord, Unreadable>,
}

impl Listed {
    /// `host:pid` from the key (what follows `instances:`), for an entry that cannot be read.
    pub fn instance(&self) -> String {
        match &self.record {
            Ok(r) => format!("{}:{}", r.host, r.pid),
            Err(_) => self
                .key
                .split_once(":instances:")
                .map_or(self.key.as_str(), |(_, rest)| rest)
                .to_string(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A record of `vm:7`, paused, running users; for the tests of its readers too.
    pub(crate) fn sample() -> InstanceRecord {
        InstanceRecord {
            format: RECORD_FORMAT,
            host: "vm".into(),
            pid: 7,
            run: "r".into(),
            roles: "consumer,dlq".into(),
            version: "1.0.0".into(),
            started_at: 1,
            last_heartbeat: 2,
            status: Status::Paused,
            processors: 2,
            concurrency: 3,
            rate_limit_per_s: 0,
            shutdown_timeout_ms: Some(30_000),
            signed_commands: Some(false),
            breaker: Breaker::Closed,
            received: 10,
            inserted: 9,
            retried: 1,
            dead_lettered: 0,
            inflight: 0,
            received_per_s: 1.5,
            inserted_per_s: 1.0,
            stages: [("main".to_string(), StageCounts::default())].into(),
            pipelines: vec![PipelineRecord {
                name: "users".into(),
                table: "users".into(),
                main_exchange: "users_exchange".into(),
                main_queue: "users_queue".into(),
                retry_queues: vec!["users_retry_10s".into()],
                dlq_queue: "users_dlq".into(),
            }],
        }
    }

    #[test]
    fn a_record_round_trips_with_numbers_as_numbers_and_the_status_lower_case() {
        let r = sample();
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["status"], "paused");
        assert_eq!(json["breaker"], "closed");
        assert_eq!(json["processors"], 2);
        assert_eq!(json["received_per_s"], 1.5);
        assert_eq!(json["format"], RECORD_FORMAT);
        let fields = [(RECORD_FIELD.to_string(), json.to_string())].into();
        assert_eq!(InstanceRecord::read(&fields), Ok(r.clone()));
        // A record of a warren before the shutdown bound was published reads without it.
        let mut older = json.clone();
        older.as_object_mut().unwrap().remove("shutdown_timeout_ms");
        older.as_object_mut().unwrap().remove("signed_commands");
        assert_eq!(
            InstanceRecord::parse(&older.to_string()),
            Ok(InstanceRecord {
                shutdown_timeout_ms: None,
                signed_commands: None,
                ..r
            })
        );
    }

    #[test]
    fn records_that_cannot_be_read_say_why() {
        let old: HashMap<String, String> = [("host", "vm"), ("pid", "7"), ("status", "running")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let e = InstanceRecord::read(&old).unwrap_err();
        assert_eq!(
            e,
            Unreadable::NoRecord {
                fields: "host, pid, status".into()
            }
        );
        assert!(e.to_string().contains("older warren"), "{e}");
        let mut newer = serde_json::to_value(sample()).unwrap();
        newer["format"] = 2.into();
        let e = InstanceRecord::parse(&newer.to_string()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "record format 2, this warren reads format 1: another version"
        );
        assert!(matches!(
            InstanceRecord::parse("{garbage"),
            Err(Unreadable::Garbage(_))
        ));
        let mut wrong = serde_json::to_value(sample()).unwrap();
        wrong["processors"] = "2".into();
        let e = InstanceRecord::parse(&wrong.to_string()).unwrap_err();
        assert!(e.to_string().contains("invalid type: string \"2\""), "{e}");
        let listed = Listed {
            key: "warren:instances:vm:7".into(),
            record: Err(e),
        };
        assert_eq!(listed.instance(), "vm:7");
    }

    /// Pipeline `name` on `<prefix>_queue`, `<prefix>_retry_1s`, `<prefix>_dlq`.
    fn on(name: &str, prefix: &str) -> PipelineRecord {
        PipelineRecord {
            name: name.into(),
            table: name.into(),
            main_exchange: format!("{prefix}_exchange"),
            main_queue: format!("{prefix}_queue"),
            retry_queues: vec![format!("{prefix}_retry_1s")],
            dlq_queue: format!("{prefix}_dlq"),
        }
    }

    /// An instance `vm:pid` running `pipelines`.
    fn running(pid: u32, pipelines: Vec<PipelineRecord>) -> InstanceRecord {
        InstanceRecord {
            pid,
            pipelines,
            ..sample()
        }
    }

    #[test]
    fn the_defaults_yield_to_what_live_instances_run() {
        let defaults = Configured {
            pipeline: on("users", "raffle"),
            explicit: false,
        };
        let people = running(1, vec![on("users", "rv_people")]);
        let known = resolve(std::slice::from_ref(&defaults), [&people]);
        assert_eq!(known.len(), 1);
        assert_eq!(known[0].sets.len(), 1, "{known:?}");
        let set = known[0].choose(None).unwrap();
        assert_eq!(set.pipeline.dlq_queue, "rv_people_dlq");
        assert_eq!(
            (set.basis, set.instances.clone()),
            (Basis::Instances, vec!["vm:1".to_string()])
        );
        assert_eq!(known[0].note(), None);
        // Nobody runs it: the defaults.
        let known = resolve(std::slice::from_ref(&defaults), []);
        let set = known[0].choose(None).unwrap();
        assert_eq!(
            (set.basis, set.pipeline.dlq_queue.as_str()),
            (Basis::Defaults, "raffle_dlq")
        );
    }

    #[test]
    fn explicit_names_win_and_a_disagreement_is_noted() {
        let given = Configured {
            pipeline: on("users", "mine"),
            explicit: true,
        };
        let same = running(1, vec![on("users", "mine")]);
        let other = running(2, vec![on("users", "theirs")]);
        let known = resolve(std::slice::from_ref(&given), [&same, &other]);
        let users = &known[0];
        assert_eq!(users.sets.len(), 2, "{users:?}");
        let set = users.choose(None).unwrap();
        assert_eq!(
            (
                set.basis,
                set.pipeline.dlq_queue.as_str(),
                set.instances.clone()
            ),
            (Basis::Config, "mine_dlq", vec!["vm:1".to_string()])
        );
        assert_eq!(
            users.choose(Some("vm:2")).unwrap().pipeline.dlq_queue,
            "theirs_dlq"
        );
        assert_eq!(
            users.note().unwrap(),
            "pipeline \"users\": the configuration names mine_queue, mine_retry_1s, mine_dlq, but \
             vm:2 runs it on theirs_queue, theirs_retry_1s, theirs_dlq; the tools act on the \
             configuration's"
        );
        // Agreeing: nothing to say.
        let known = resolve(std::slice::from_ref(&given), [&same]);
        assert_eq!(known[0].note(), None);
    }

    #[test]
    fn instances_that_disagree_are_each_listed_and_a_choice_is_refused() {
        let a = running(1, vec![on("orders", "o1")]);
        let b = running(2, vec![on("orders", "o2"), on("users", "u")]);
        let c = running(3, vec![on("orders", "o1")]);
        let known = resolve(&[], [&a, &b, &c]);
        let names: Vec<&str> = known.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["orders", "users"]);
        let orders = &known[0];
        let sets: Vec<(&str, Vec<String>)> = orders
            .sets
            .iter()
            .map(|s| (s.pipeline.dlq_queue.as_str(), s.instances.clone()))
            .collect();
        assert_eq!(
            sets,
            [
                ("o1_dlq", vec!["vm:1".to_string(), "vm:3".to_string()]),
                ("o2_dlq", vec!["vm:2".to_string()])
            ]
        );
        // The order of the records does not choose.
        for known in [resolve(&[], [&a, &b, &c]), resolve(&[], [&b, &a, &c])] {
            let e = known[0].choose(None).unwrap_err();
            assert!(matches!(e, Choice::Ambiguous { .. }), "{e}");
        }
        assert_eq!(
            orders.choose(None).unwrap_err().to_string(),
            "pipeline \"orders\" runs on different queues: dlq o1_dlq (main o1_exchange -> \
             o1_queue), run by vm:1, vm:3; dlq o2_dlq (main o2_exchange -> o2_queue), run by \
             vm:2; choose one with --instance HOST:PID, or name its queues in a --config file"
        );
        assert_eq!(
            orders.choose(Some("vm:2")).unwrap().pipeline.dlq_queue,
            "o2_dlq"
        );
        assert_eq!(
            orders.choose(Some("vm:3")).unwrap().pipeline.dlq_queue,
            "o1_dlq"
        );
        let e = orders.choose(Some("vm:9")).unwrap_err().to_string();
        assert!(
            e.starts_with("--instance vm:9: no live instance vm:9 runs pipeline \"orders\"; it runs on: dlq o1_dlq"),
            "{e}"
        );
        assert!(
            orders
                .note()
                .unwrap()
                .contains("vm:1, vm:3 runs it on o1_queue")
        );
        // The same queues into another table: the note names the tables (review R40a F8).
        let mut elsewhere = on("orders", "o1");
        elsewhere.table = "orders_v2".into();
        let e = running(5, vec![elsewhere]);
        let known = resolve(&[], [&a, &e]);
        let note = known[0].note().unwrap();
        assert!(
            note.contains("live instances run it into different tables: vm:1 runs it on ")
                && note.contains("into table orders_v2"),
            "{note}"
        );
        // Retry tiers alone differing: the DLQ work is the same either way.
        let mut longer = on("orders", "o1");
        longer.retry_queues.push("o1_retry_1m".into());
        let d = running(4, vec![longer]);
        let known = resolve(&[], [&a, &d]);
        assert_eq!(known[0].sets.len(), 2);
        assert_eq!(known[0].choose(None).unwrap().pipeline.dlq_queue, "o1_dlq");
    }

    #[test]
    fn known_pipelines_are_listed_once_each() {
        let mut a = sample();
        a.pipelines.push(PipelineRecord {
            name: "orders".into(),
            ..a.pipelines[0].clone()
        });
        let b = a.clone();
        let names: Vec<String> = known(&[], [&a, &b]).into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["users", "orders"]);
        let known = known(&[], [&a, &b]);
        assert_eq!(
            find(&known, "orders").map(|p| p.name.as_str()),
            Ok("orders")
        );
        let unknown = find(&known, "nosuch").unwrap_err();
        assert_eq!(
            unknown.to_string(),
            "no pipeline \"nosuch\": the configuration does not name it and no live instance \
             runs it; give the file that declares it (--config FILE), or start an instance that \
             runs it (`warren run --config FILE`); known: users, orders"
        );
        // Redis away: the instances are unknown, not absent, and the error says how to start it.
        let away: Result<(), ConnectError> = Err(ConnectError::Unreachable {
            url: "redis://127.0.0.1:1".into(),
            error: "Connection refused".into(),
        });
        assert_eq!(
            unknown.asked(&away).to_string(),
            "no pipeline \"nosuch\" in the configuration, and the live instances are unknown \
             (cannot reach Redis at redis://127.0.0.1:1: Connection refused); start Redis \
             (`systemctl start redis-server`, or `redis-server --daemonize yes`) or set \
             REDIS_URL to the deployment's Redis, or give the file that declares it (--config \
             FILE); known: users, orders"
        );
    }
}
