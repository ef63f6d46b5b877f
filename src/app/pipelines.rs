//! The pipelines `warren run` runs, by name: started from the settings ([`Pipelines::start`]),
//! held by operators ([`Holds`]), changed by a reload in three steps that the control loop
//! drives (`super::reload`): [`Pipelines::plan`] compares, [`Pipelines::begin`] takes what is
//! removed or changed out of the running set and answers its drain, [`Pipelines::finish`] starts
//! what is added or changed with its new spec (unchanged ones are not touched); and stopped at
//! the end ([`Pipelines::shutdown`]). What counts
//! as a pipeline's change is [`same`], in one place; what the process keeps until a restart is
//! every setting that is not a pipeline's ([`restart_needed`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::amqp::monitor::Depths;
use crate::config::pipelines::PipelineSpec;
use crate::config::{Balance, ConfigError, Role, Settings};
use crate::domain::mapping::Mapping;
use crate::pipeline::balance::Decision;
use crate::pipeline::consumer::StopCounts;
use crate::pipeline::copies::Copies;
use crate::pipeline::{self, Pipeline, Spec, Stage, StageId};
use crate::registry::PipelineRecord;

/// One pipeline as the configuration declares it: its resolved spec (what its stages start
/// from, and what a reload compares, [`same`]) and its compiled mapping.
#[derive(Clone)]
pub(super) struct Declared {
    /// `users`, `orders`: the `pipeline` label, what `--pipeline` names.
    pub name: String,
    /// The pipeline resolved once from its entry and the defaults (`config::pipelines::resolve`).
    pub spec: PipelineSpec,
    /// Its compiled mapping, shared by its stages.
    pub mapping: Arc<Mapping>,
}

/// The pipelines `settings` declares, as they resolved at load: the built-in users pipeline
/// first (unless a file's pipeline named users replaces it, or `--pipelines` left it out), then
/// the file's in order.
pub(super) fn declared(settings: &Settings) -> Result<Vec<Declared>, ConfigError> {
    settings
        .pipelines()
        .iter()
        .map(|spec| {
            Ok(Declared {
                name: spec.name.clone(),
                mapping: Arc::new(spec.mapping()?),
                spec: spec.clone(),
            })
        })
        .collect()
}

/// The settings every pipeline's spec reads that no entry key stands for (the limits and
/// bounds every pipeline takes as they are).
const SPEC_WIDE_SETTINGS: &[&str] = &[
    "retry_ttl_ms",
    "max_message_bytes",
    "max_inflight_bytes",
    "db_retry_window_ms",
    "breaker_failures",
];

/// The settings that only feed the pipelines' specs: those an entry key stands for (the
/// defaults, the users pipeline's own names and settings; `config::pipelines::ENTRY_KEYS`, the
/// one table), and [`SPEC_WIDE_SETTINGS`]. A change of one changes the pipelines whose resolved
/// spec it changes, and needs no restart. Every other setting is the process's (connections,
/// listeners, roles, timeouts of the links, the insert budget) and changes only with a restart
/// ([`restart_needed`]). Held by a test to exactly the settings that change some pipeline's
/// resolved spec (each setting tried with other values).
pub(super) fn pipeline_settings() -> Vec<String> {
    crate::config::pipelines::entry_settings()
        .chain(SPEC_WIDE_SETTINGS.iter().map(|k| k.to_string()))
        .collect()
}

/// The settings as one JSON object, by key.
fn by_key(settings: &Settings) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(settings) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    }
}

/// The settings of `next` that differ from those the process started with (`base`) and are not
/// a pipeline's: they apply only at a restart. Names only, never values (a secret may be one).
pub(super) fn restart_needed(base: &Settings, next: &Settings) -> Vec<String> {
    let (was, now) = (by_key(base), by_key(next));
    let pipelines = pipeline_settings();
    let mut keys: BTreeSet<&String> = was.keys().chain(now.keys()).collect();
    keys.retain(|k| k.as_str() != "pipelines" && !pipelines.contains(k));
    keys.into_iter()
        .filter(|k| was.get(*k) != now.get(*k))
        .map(|k| k.to_string())
        .collect()
}

/// Who holds which pipelines: the instance's pause (`SIGUSR1`, `warren ctl pause` without
/// `--pipeline`) and each pipeline's own (`warren ctl pause --pipeline`). They are two layers:
/// lifting the instance's pause (`SIGCONT`, `resume` without `--pipeline`) leaves a pipeline
/// paused on its own held, and a pipeline resumed on its own stays held while the instance is
/// paused. A stage takes deliveries when neither holds it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Holds {
    /// The instance is paused.
    pub all: bool,
    /// Pipelines paused on their own, by name.
    pub pipelines: BTreeSet<String>,
}

impl Holds {
    /// Whether the pipeline `name` is held.
    pub fn holds(&self, name: &str) -> bool {
        self.all || self.pipelines.contains(name)
    }
}

/// Reads the configuration's sources again, with values that win over them all.
pub type LoadFn = dyn Fn(&std::collections::BTreeMap<String, serde_json::Value>) -> Result<Settings, ConfigError>
    + Send
    + Sync;

/// Checks (and declares) what a reload starts, and the broker objects of every pipeline of
/// the configuration read again ([`Reload::prepare`]).
pub type PrepareFn =
    dyn Fn(
        Option<Settings>,
        Settings,
        Vec<String>,
    ) -> futures::future::LocalBoxFuture<'static, Result<Vec<String>, ReloadError>>;

/// How `warren run` reads its configuration again and prepares what a reload starts (given by
/// `cli/run.rs`, which knows the sources and `--declare`).
pub struct Reload {
    /// The settings from the sources the process started with (the file, the environment,
    /// `--set`), with its `--pipelines` selection.
    /// Called off the async runtime (`reload::Loaded::read`): a large file takes a while to read
    /// and resolve, and the pipelines, the heartbeat and the broker links run on that runtime.
    /// Its argument: values that win over every source (`Sources::pinned`), the running
    /// values of the settings that apply only at a restart ([`Loaded::read`]).
    pub load: Arc<LoadFn>,
    /// The settings the process started with: a reload resolves and checks its pipelines
    /// against their values of the settings that apply only at a restart.
    pub base: Arc<Settings>,
    /// Checks the tables of the first settings' pipelines, those the reload starts (and,
    /// under `--declare`, declares their exchanges and queues), then that the exchanges and
    /// queues of every pipeline of the second, the whole configuration read again, exist with
    /// the declared properties (review R35h F4: an unchanged pipeline's retry queue declared
    /// again with other arguments passed a reload that a restart refused): a
    /// [`ReloadError::Prepare`] when they cannot start or run. Answers which of the third, the
    /// queues the reload leaves ([`ReloadReport::left_names`]), do not exist on the broker.
    pub prepare: Box<PrepareFn>,
}

/// Why a reload changed nothing. Its text is the `reload_failed` event's reason, the error
/// line's and `warren ctl reload`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    /// The configuration does not load or check (its error names the file, the entry and the
    /// field).
    #[error("{0}")]
    Config(String),
    /// A new or changed pipeline's table does not fit its mapping, the database cannot be
    /// asked, or (started with `--declare`) its exchanges and queues cannot be declared.
    #[error("{0}")]
    Prepare(String),
    /// The reload would remove, or move the main queue or the tables of, a pipeline this
    /// process's HTTP API serves (`api_kept`).
    #[error(
        "this reload {change}, but this process's HTTP API serves pipeline {pipeline} as it started until a restart (it would publish to a queue no pipeline consumes, or read a table the pipeline no longer writes): restart warren to apply it, or serve the API from instances of their own (`--roles api`)"
    )]
    Api { pipeline: String, change: String },
    /// The configuration runs no pipeline, and the instance runs some (`running`): a reload
    /// never stops every pipeline.
    #[error(
        "the configuration runs no pipeline (the file declares none and the users pipeline is left out); a reload never stops every pipeline, this instance keeps running {running}; to run none, stop the instance (`warren ctl drain`) or pause it (`warren ctl pause`)"
    )]
    NoPipeline { running: String },
}

/// The most lines of an error a reload's one error line quotes ([`ReloadError::one_line`]).
pub const SHOWN_LINES: usize = 5;

impl ReloadError {
    /// The same error on one line (a configuration error may quote several): its lines joined
    /// with ` | `, each at most [`crate::text::SHOWN_MAX`] bytes, for the one error line and
    /// the event; past [`SHOWN_LINES`] of them, how many more there are and where to see them
    /// all (a file of 3,000 pipelines on missing tables made a line of 350 KB; review R44 F9:
    /// "and N more" said nowhere to see them).
    pub fn one_line(self) -> Self {
        let join = |text: String, all: &str| {
            let lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let mut shown = lines[..lines.len().min(SHOWN_LINES)]
                .iter()
                .map(|l| crate::text::shown(l))
                .collect::<Vec<_>>()
                .join(" | ");
            if lines.len() > SHOWN_LINES {
                shown.push_str(&format!(
                    " | and {} more ({all})",
                    lines.len() - SHOWN_LINES
                ));
            }
            shown
        };
        match self {
            ReloadError::Config(text) => ReloadError::Config(join(
                text,
                "`warren config` with this configuration shows them all",
            )),
            ReloadError::Prepare(text) => ReloadError::Prepare(join(
                text,
                "`warren declare --dry-run` with this configuration names them all, changing \
                 nothing",
            )),
            other @ (ReloadError::NoPipeline { .. } | ReloadError::Api { .. }) => other,
        }
    }
}

/// A pipeline and its running stages (none when the roles run no pipeline).
struct Running {
    declared: Declared,
    /// Its main stage (role consumer), then its DLQ stage (role dlq).
    stages: Vec<Pipeline>,
    /// Its processors and rate limit as they run now: its spec's, or what `warren ctl scale` /
    /// `rate` set since it started (what the registry record shows of the first pipeline).
    runs: Runs,
}

impl Running {
    fn new(declared: Declared, stages: Vec<Pipeline>) -> Self {
        let runs = Runs {
            processors: declared.spec.batching.processors,
            rate_limit_per_s: declared.spec.rate_limit_per_s,
        };
        Self {
            declared,
            stages,
            runs,
        }
    }
}

/// A pipeline's processors and rate limit as they run now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Runs {
    pub processors: usize,
    pub rate_limit_per_s: u32,
}

/// A reload between its steps ([`Pipelines::plan`], [`Pipelines::begin`],
/// [`Pipelines::finish`]): the configuration it applies and what it changes.
pub(super) struct Plan {
    /// The configuration read again.
    next: Settings,
    /// Its pipelines, as they resolved.
    wanted: Vec<Declared>,
    /// What it changes, by name (its `drained` once the drain is done).
    pub report: ReloadReport,
    /// The settings with only the pipelines it adds or changes, for [`Reload::prepare`] to
    /// check (and declare) before anything changes; `None` when it starts none.
    pub checked: Option<Settings>,
}

impl Plan {
    /// The configuration read again, every pipeline of it.
    pub fn next(&self) -> &Settings {
        &self.next
    }
}

/// The drain of the stages a reload stops ([`Pipelines::begin`]): whether every one settled
/// everything, and what they settled and gave back.
pub(super) type Draining = futures::future::LocalBoxFuture<'static, (bool, StopCounts)>;

/// Refuses a reload after which an instance that runs pipelines (`running`) would run none
/// (`wanted` empty): a file emptied by mistake, or half written, would stop everything.
fn refuse_empty(running: &[&str], wanted: &[Declared]) -> Result<(), ReloadError> {
    if wanted.is_empty() && !running.is_empty() {
        return Err(ReloadError::NoPipeline {
            running: running.join(", "),
        });
    }
    Ok(())
}

/// The running pipelines and what they share.
pub(super) struct Pipelines {
    /// The process's settings as it started: the connections and timeouts every stage uses,
    /// the roles. What is not a pipeline's changes only with a restart.
    base: Settings,
    /// What every stage's links are built from (the broker's, the database statement's
    /// bound), from `base`.
    links: pipeline::Links,
    /// The pipelines' one pool, resized when a reload changes what they need.
    pool: Pool,
    /// What the queue poller sees of every pipeline's queues.
    depths: Depths,
    running: Vec<Running>,
    /// Who holds which pipelines; a pipeline started by a reload starts held if they hold it.
    pub holds: Holds,
    /// Batch inserts in flight in the whole process (`MAX_INSERTS_IN_FLIGHT` or derived).
    budget: usize,
    /// Ends the current balancer (a reload starts another for the new set of stages).
    balancing: CancellationToken,
    /// Where the balancers' decisions go (the registry's history).
    decisions: mpsc::UnboundedSender<Decision>,
    /// The queue poller of the current pipelines' queues (restarted when they change).
    poller: Option<JoinHandle<()>>,
    /// The queues it polls: those a reload stops polling leave the scrape
    /// (`metrics::queues_polled`).
    polled: Vec<String>,
    /// Stages whose series were registered, once each in a process (registering sets the
    /// counters to 0).
    registered: BTreeSet<StageId>,
    /// The pipelines the registry record publishes.
    records: watch::Sender<Vec<PipelineRecord>>,
    /// The pipelines a reload in progress stops or starts again, each with whether it removes
    /// it ([`Pipelines::reloading`]).
    reloading: Vec<(String, bool)>,
    /// The stages this process's reloads stopped, newest first, at most
    /// `predecessors::PREDECESSORS` per queue and kind: a stage started on the same queue asks their
    /// tables and parking about the redeliveries it gets (`pipeline::predecessors::Predecessor`), for
    /// the acks of their last commits may have been lost with their link (review R42b F1-F3:
    /// asked only of the one stage replaced, after an unanswered close, a reset link, a second
    /// reload or a pipeline removed and added back stored the window twice).
    retired: Vec<Retired>,
}

/// A stage a reload stopped (see [`Pipelines::retired`]).
struct Retired {
    kind: Stage,
    queue: String,
    pipeline: String,
    mapping: Arc<Mapping>,
    /// Its start: the acks it left unproven are recorded under it (`pipeline/acked.rs`).
    incarnation: u64,
    /// Its memory of copies and acks, until a stage started on the same queue (of the same
    /// kind: the same pipeline, one renamed, or one added later in a removed one's place)
    /// takes it over, once: the redeliveries of what it left are still recognised
    /// (`pipeline/copies.rs`). Kept across reloads (review R44 F3: a rename done as a removal
    /// and an addition lost it, and the copies' redeliveries were parked a second time).
    copies: Option<Arc<Copies>>,
}

/// Puts `stopped` first in `retired`, keeping the newest `predecessors::PREDECESSORS` of its
/// queue and kind. The acks a stage pushed out left unproven are forgotten with a warning and counted
/// (`warren_redeliveries_total{outcome="forgotten"}`): their redeliveries are taken as new
/// messages (review R47a F3: five reloads in a row behind stalled links stored 93 messages
/// twice, and nothing said so).
fn retire(retired: &mut Vec<Retired>, stopped: Retired) {
    let acked = stopped.copies.as_ref().map(|c| c.acked_memory());
    let newest = StageId::new(&stopped.pipeline, stopped.kind);
    retired.insert(0, stopped);
    let mut seen = 0;
    let (kind, queue) = (retired[0].kind, retired[0].queue.clone());
    let mut dropped = Vec::new();
    retired.retain(|r| {
        if r.kind != kind || r.queue != queue {
            return true;
        }
        seen += 1;
        let kept = seen <= pipeline::predecessors::PREDECESSORS;
        if !kept {
            dropped.push(r.incarnation);
        }
        kept
    });
    let Some(acked) = acked else { return };
    let forgotten: usize = dropped.iter().map(|owner| acked.forget(*owner)).sum();
    if forgotten > 0 {
        crate::metrics::redeliveries(&newest, "forgotten", forgotten as u64);
        warn!(
            pipeline = newest.pipeline(),
            stage = newest.stage().as_str(),
            queue = %queue,
            count = forgotten,
            "more acks the broker may not have handled than this process can remember: a stage \
             stopped more than {} reloads ago on this queue is forgotten, and a redelivery of \
             one of its acks is taken as a new message (it may be stored or parked twice); let \
             a stalled link end before reloading again",
            pipeline::predecessors::PREDECESSORS
        );
    }
}

/// The pool size the pipelines of `declared` need: a connection for each insert that can be in
/// flight (the main stages' most within the budget, the DLQ stages' batch concurrency), and one
/// more; never below `DATABASE_POOL_SIZE`.
pub(super) fn pool_size(base: &Settings, declared: &[Declared], budget: usize) -> usize {
    let specs: Vec<PipelineSpec> = declared.iter().map(|d| d.spec.clone()).collect();
    crate::config::pipelines::pool_size(&specs, base.database_pool_size, budget)
}

/// The process-wide budget of batch inserts in flight for the pipelines of `next`, under the
/// process's own `MAX_INSERTS_IN_FLIGHT` and `DATABASE_POOL_SIZE` (they change at a restart).
pub(super) fn budget(base: &Settings, next: &Settings) -> usize {
    let mut at = next.clone();
    at.max_inserts_in_flight = base.max_inserts_in_flight;
    at.database_pool_size = base.database_pool_size;
    at.inserts_budget()
}

impl Pipelines {
    /// Starts every pipeline `declared` names (the roles' stages of each), the queue poller and
    /// the balancer. `base` is the process's settings.
    pub fn start(
        base: Settings,
        declared: Vec<Declared>,
        pool: Pool,
        depths: Depths,
        decisions: mpsc::UnboundedSender<Decision>,
        records: watch::Sender<Vec<PipelineRecord>>,
    ) -> Self {
        let budget = base.inserts_budget();
        let links = pipeline::Links {
            amqp: base.amqp(),
            db_bound: base.database().call_bound(),
            // One per process: every stage, of every pipeline, shares it.
            oversize: pipeline::consumer::OversizePermit::new(),
        };
        let mut pipelines = Self {
            base,
            links,
            pool,
            depths,
            running: Vec::new(),
            holds: Holds::default(),
            budget,
            balancing: CancellationToken::new(),
            decisions,
            poller: None,
            polled: Vec::new(),
            registered: BTreeSet::new(),
            records,
            reloading: Vec::new(),
            retired: Vec::new(),
        };
        let stages: Vec<StageId> = declared
            .iter()
            .flat_map(|d| pipelines.stage_ids(&d.name))
            .collect();
        crate::metrics::preregister(&stages);
        pipelines.registered.extend(stages);
        let names: Vec<&str> = declared.iter().map(|d| d.name.as_str()).collect();
        pipelines.need_links(&names);
        for d in declared {
            let stages = pipelines.launch(&d);
            pipelines.running.push(Running::new(d, stages));
        }
        pipelines.refresh();
        pipelines
    }

    /// The stages the roles run of the pipeline `name`: main (role consumer), DLQ (role dlq).
    fn stage_ids(&self, name: &str) -> Vec<StageId> {
        [(Role::Consumer, Stage::Main), (Role::Dlq, Stage::Dlq)]
            .into_iter()
            .filter(|(role, _)| self.base.has_role(*role))
            .map(|(_, stage)| StageId::new(name, stage))
            .collect()
    }

    /// Tells `/readyz` which AMQP links the roles open for the pipelines `names`: each stage's
    /// consumer (`<pipeline>/<stage>`) and their publisher `router`; the API's publisher `api`.
    fn need_links(&self, names: &[&str]) {
        let mut links: Vec<String> = names
            .iter()
            .flat_map(|n| self.stage_ids(n))
            .map(|s| s.to_string())
            .collect();
        if !links.is_empty() {
            links.push("router".into());
        }
        if self.base.has_role(Role::Api) {
            links.push("api".into());
        }
        crate::metrics::needs(&links, true);
    }

    /// Starts the roles' stages of `d`, held if the holds hold it.
    fn launch(&mut self, d: &Declared) -> Vec<Pipeline> {
        let stages: Vec<Pipeline> = self
            .stage_ids(&d.name)
            .into_iter()
            .map(|id| {
                let spec = match id.stage() {
                    Stage::Main => Spec::main(&d.spec),
                    Stage::Dlq => Spec::dlq(&d.spec),
                };
                let kept = self.take_memory(&id, &spec.queue);
                let before: Vec<pipeline::predecessors::Predecessor<Mapping>> = self
                    .retired
                    .iter()
                    .filter(|r| r.kind == id.stage() && r.queue == spec.queue)
                    .map(|r| pipeline::predecessors::Predecessor {
                        domain: r.mapping.clone(),
                        parks_as: r.pipeline.clone(),
                        incarnation: r.incarnation,
                    })
                    .collect();
                pipeline::start(
                    &self.links,
                    spec,
                    d.mapping.clone(),
                    self.pool.clone(),
                    self.depths.clone(),
                    kept,
                    before,
                )
            })
            .collect();
        if self.holds.holds(&d.name) {
            stages.iter().for_each(|p| p.hold(true));
        }
        // Its own pause in the record, also one taken while a reload restarted it (issue 35).
        let own = self.holds.pipelines.contains(&d.name);
        for p in &stages {
            crate::metrics::stage(&p.id)
                .paused
                .store(own, std::sync::atomic::Ordering::Relaxed);
        }
        stages
    }

    /// The memory of copies and acks a stage `id` started on `queue` takes over: the newest
    /// stopped stage's of the same pipeline and kind on that queue, else the newest of the same
    /// kind on it (a pipeline renamed, in one reload or as a removal and an addition); each
    /// memory once (two live stages never share one).
    fn take_memory(&mut self, id: &StageId, queue: &str) -> Option<Arc<Copies>> {
        let on_queue = |r: &Retired| r.kind == id.stage() && r.queue == queue && r.copies.is_some();
        let at = self
            .retired
            .iter()
            .position(|r| on_queue(r) && r.pipeline == id.pipeline())
            .or_else(|| self.retired.iter().position(on_queue))?;
        self.retired[at].copies.take()
    }

    /// Every running stage: each pipeline's main stage, then its DLQ stage.
    pub fn stages(&self) -> Vec<&Pipeline> {
        self.running.iter().flat_map(|r| r.stages.iter()).collect()
    }

    /// The running stages and the holds, for a command to change both.
    pub fn control(&mut self) -> (Vec<&Pipeline>, &mut Holds) {
        let stages = self.running.iter().flat_map(|r| r.stages.iter()).collect();
        (stages, &mut self.holds)
    }

    /// The processors and rate limit of the first running pipeline (users, unless left out) as
    /// it runs now, what the registry record shows; zeros when none runs.
    fn runs(&self) -> Runs {
        self.running.first().map(|r| r.runs).unwrap_or_default()
    }

    /// Puts [`Self::runs`] into the instance's report (what the heartbeat publishes), when it
    /// changed.
    pub fn report_runs(&self, report: &watch::Sender<crate::registry::Report>) {
        let runs = self.runs();
        report.send_if_modified(|r| {
            let was = (r.processors, r.rate_limit_per_s);
            r.processors = runs.processors;
            r.rate_limit_per_s = runs.rate_limit_per_s;
            was != (r.processors, r.rate_limit_per_s)
        });
    }

    /// `warren ctl scale` / `rate` (`n`) was applied to the pipeline `name`, or to every one.
    pub fn ran(&mut self, name: Option<&str>, set: impl Fn(&mut Runs)) {
        self.running
            .iter_mut()
            .filter(|r| name.is_none_or(|n| n == r.declared.name))
            .for_each(|r| set(&mut r.runs));
    }

    /// The process-wide budget of batch inserts in flight.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// After a start or a change: the queue poller (every pipeline's queues), the balancer
    /// (every main stage), the pool's size and the registry record's pipelines.
    fn refresh(&mut self) {
        // Every 5 s, or every balanced pipeline's cooldown if shorter: a balancing decision
        // sees a depth at most one cooldown old.
        let poll_every = self
            .running
            .iter()
            .map(|r| &r.declared.spec.balance)
            .filter(|b| b.strategy != Balance::Off)
            .map(|b| b.cooldown)
            .fold(Duration::from_secs(5), Duration::min)
            .max(Duration::from_millis(250));
        let queues: Vec<String> = self
            .running
            .iter()
            .flat_map(|r| {
                let n = &r.declared.spec.names;
                std::iter::once(n.main_queue.clone())
                    .chain(n.retry_tiers.iter().map(|t| t.queue.clone()))
                    .chain(std::iter::once(n.dlq_queue.clone()))
            })
            .collect();
        if let Some(old) = self.poller.take() {
            old.abort();
        }
        // The queues of the pipelines a reload removed (or renamed) are no longer polled: their
        // series leave the scrape, neither frozen at their last value, which kept an alert on a
        // queue no pipeline serves firing until a restart (review R35g F2), nor at 0 consumers,
        // which fired WarrenMainQueueNoConsumers for a pipeline that no longer exists (review
        // R44 F8).
        let gone: Vec<String> = self
            .polled
            .iter()
            .filter(|q| !queues.contains(q))
            .cloned()
            .collect();
        crate::metrics::queues_polled(&queues, &gone);
        self.polled = queues.clone();
        self.poller = Some(tokio::spawn(crate::amqp::monitor::poll_queues(
            self.links.amqp.clone(),
            queues,
            poll_every,
            self.depths.clone(),
        )));

        self.balancing.cancel();
        self.balancing = CancellationToken::new();
        let concurrencies: Vec<_> = self
            .stages()
            .iter()
            .filter_map(|p| p.concurrency.clone())
            .collect();
        tokio::spawn(pipeline::balance::run(
            concurrencies,
            self.budget,
            self.depths.clone(),
            self.decisions.clone(),
            self.balancing.clone(),
        ));

        let declared: Vec<Declared> = self.running.iter().map(|r| r.declared.clone()).collect();
        let size = pool_size(&self.base, &declared, self.budget);
        if size != self.pool.status().max_size {
            self.pool.resize(size);
        }

        let runs_pipelines = self.base.has_role(Role::Consumer) || self.base.has_role(Role::Dlq);
        let records = if runs_pipelines {
            self.running
                .iter()
                .map(|r| {
                    PipelineRecord::of(
                        &r.declared.name,
                        r.declared.spec.table(),
                        &r.declared.spec.names,
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        self.records.send_replace(records);
    }

    /// A reload's first step: what the configuration `next` (`Loaded::read`) changes, by
    /// name, and the settings [`Reload::prepare`] checks (and declares) before
    /// anything changes: the pipelines it adds or changes (`None` when it starts none). Refuses
    /// a configuration that runs no pipeline where some run now ([`ReloadError::NoPipeline`]).
    pub fn plan(&self, next: Loaded) -> Result<Plan, ReloadError> {
        let Loaded {
            next,
            wanted,
            restart,
        } = next;
        let running: Vec<&str> = self
            .running
            .iter()
            .map(|r| r.declared.name.as_str())
            .collect();
        refuse_empty(&running, &wanted)?;
        // What this process's HTTP API serves: the pipelines it started with.
        let served = if self.base.has_role(Role::Api) {
            let api = declared(&self.base).map_err(|e| ReloadError::Config(e.to_string()))?;
            api_kept(&api, &wanted)?;
            api
        } else {
            Vec::new()
        };
        let mut report = ReloadReport {
            restart_needed: restart,
            drained: true,
            ..ReloadReport::default()
        };
        // By name, in sets: a file may declare thousands of pipelines, and this runs on the
        // control loop's thread.
        let by_name: HashMap<&str, &Declared> =
            wanted.iter().map(|d| (d.name.as_str(), d)).collect();
        let running_names: HashSet<&str> = running.iter().copied().collect();
        for r in &self.running {
            match by_name.get(r.declared.name.as_str()) {
                None => report.removed.push(r.declared.name.clone()),
                Some(d) if same(&r.declared, d) => report.unchanged.push(d.name.clone()),
                Some(d) => report.changed.push(d.name.clone()),
            }
        }
        for d in &wanted {
            if !running_names.contains(d.name.as_str()) {
                report.added.push(d.name.clone());
            }
        }
        report.leave(left_queues(
            self.running.iter().map(|r| &r.declared),
            &wanted,
        ));
        let removed = self
            .running
            .iter()
            .map(|r| &r.declared)
            .filter(|d| report.removed.contains(&d.name));
        let behind = left_behind(removed, &wanted, &self.base.database_schema);
        report.left_behind = behind;
        let starts: HashSet<&String> = report.added.iter().chain(&report.changed).collect();
        let starting = |name: &String| starts.contains(name);
        // What starts is checked against its tables first, as at start.
        let mut checked = next.clone();
        let names: Vec<String> = checked
            .pipelines()
            .iter()
            .map(|p| p.name.clone())
            .filter(|name| starting(name))
            .collect();
        checked.select_pipelines(&names.iter().map(String::as_str).collect::<Vec<_>>());
        let checked = (!names.is_empty()).then_some(checked);
        if self.base.has_role(Role::Api) {
            let was_api = |name: &String| {
                self.running
                    .iter()
                    .any(|r| &r.declared.name == name && r.declared.spec.api.enabled)
            };
            let is_api =
                |name: &String| wanted.iter().any(|d| &d.name == name && d.spec.api.enabled);
            // An unchanged pipeline whose `api` keys alone changed (`same` leaves them out).
            let api_changed = |name: &String| {
                let was = self.running.iter().find(|r| &r.declared.name == name);
                let now = wanted.iter().find(|d| &d.name == name);
                matches!((was, now), (Some(r), Some(d)) if r.declared.spec.api != d.spec.api)
            };
            report.api_unchanged = report
                .added
                .iter()
                .chain(&report.removed)
                .chain(&report.changed)
                .filter(|n| was_api(n) || is_api(n))
                .chain(report.unchanged.iter().filter(|n| api_changed(n)))
                .cloned()
                .collect();
            report.api_notes = api_notes(&report.api_unchanged, &served, &wanted);
        }
        Ok(Plan {
            next,
            wanted,
            report,
            checked,
        })
    }

    /// A reload's second step, once [`Reload::prepare`] accepted what `plan` starts: the
    /// pipelines it removes or changes leave the running set (commands no longer reach them)
    /// and drain, each stage's one shutdown sequence at once, bounded by
    /// `SHUTDOWN_TIMEOUT_MS`. The drain is the future answered, which owns them: the control
    /// loop awaits it beside everything else, and [`Pipelines::finish`] takes its outcome.
    pub fn begin(&mut self, plan: &Plan) -> Draining {
        let (stopping, kept): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| !plan.report.unchanged.contains(&r.declared.name));
        self.running = kept;
        for r in &stopping {
            for p in &r.stages {
                retire(
                    &mut self.retired,
                    Retired {
                        kind: p.id.stage(),
                        queue: p.copies.queue().to_string(),
                        pipeline: p.id.pipeline().to_string(),
                        mapping: r.declared.mapping.clone(),
                        incarnation: p.incarnation,
                        copies: Some(p.copies.clone()),
                    },
                );
            }
        }
        let removed = plan.report.removed.iter().map(|n| (n.clone(), true));
        let again = plan.report.changed.iter().chain(&plan.report.added);
        self.reloading = removed.chain(again.map(|n| (n.clone(), false))).collect();
        let timeout = self.base.shutdown_timeout();
        Box::pin(async move {
            let results = futures::future::join_all(
                stopping
                    .iter()
                    .flat_map(|r| r.stages.iter())
                    .map(|p| p.shutdown(timeout)),
            )
            .await;
            let mut counts = StopCounts::default();
            for (_, c) in &results {
                counts += *c;
            }
            drop(stopping);
            (results.iter().all(|(drained, _)| *drained), counts)
        })
    }

    /// A reload's last step, after the drain of what it stopped (`drained`: whether every
    /// stage settled everything): what is removed leaves the readiness, the live stages and
    /// the metrics; added and changed pipelines start with their new spec (held if the holds
    /// hold them), in the order the configuration declares them.
    pub fn finish(&mut self, plan: Plan, drained: bool) -> ReloadReport {
        let Plan {
            next,
            wanted,
            mut report,
            ..
        } = plan;
        report.drained = drained;
        // A stage that consumed a queue now left stopped without a proof that the broker
        // handled its acks: the advice to move that queue says to wait (review R44 F1).
        report.acks_unproven = self.retired.iter().any(|r| {
            report.left_names.contains(&r.queue)
                && r.copies
                    .as_ref()
                    .is_some_and(|c| c.acked().unproven(r.incarnation))
        });
        self.reloading.clear();
        // What is removed leaves the readiness, the live stages and the metrics' links.
        for name in &report.removed {
            let ids = self.stage_ids(name);
            let links: Vec<String> = ids.iter().map(ToString::to_string).collect();
            crate::metrics::unneed(&links);
            crate::metrics::unlink(&links);
            ids.iter().for_each(crate::metrics::forget);
            self.holds.pipelines.remove(name);
        }

        // The new set, in the order the configuration declares it.
        self.budget = budget(&self.base, &next);
        let mut kept = std::mem::take(&mut self.running);
        for d in wanted {
            if let Some(i) = kept.iter().position(|r| r.declared.name == d.name) {
                let r = kept.remove(i);
                self.running.push(r);
                continue;
            }
            for id in self.stage_ids(&d.name) {
                if self.registered.insert(id.clone()) {
                    crate::metrics::preregister_stage(&id);
                } else {
                    // Added again after a reload removed it: live again (its counters go on
                    // from where they were; registering would set them back to 0).
                    crate::metrics::revive(&id);
                }
            }
            let stages = self.launch(&d);
            self.running.push(Running::new(d, stages));
        }
        if self.stages().is_empty() {
            crate::metrics::unneed(&["router".to_string()]);
        }
        let names: Vec<String> = self
            .running
            .iter()
            .map(|r| r.declared.name.clone())
            .collect();
        self.need_links(&names.iter().map(String::as_str).collect::<Vec<_>>());
        self.refresh();
        if !report.drained {
            warn!(
                "a stopped pipeline reached SHUTDOWN_TIMEOUT_MS with deliveries in flight; the broker redelivers them"
            );
        }
        report
    }

    /// The pipelines a reload in progress stops or starts again (none between reloads):
    /// commands naming one wait for it ([`super::control::apply`]).
    pub fn reloading(&self) -> &[(String, bool)] {
        &self.reloading
    }

    /// The one shutdown of every stage, at once, bounded by `timeout`: whether all settled, and
    /// what they settled and gave back, together.
    pub async fn shutdown(&mut self, timeout: Duration) -> (bool, StopCounts) {
        self.balancing.cancel();
        let results =
            futures::future::join_all(self.stages().into_iter().map(|p| p.shutdown(timeout))).await;
        if let Some(poller) = self.poller.take() {
            poller.abort();
        }
        let mut counts = StopCounts::default();
        for (_, c) in &results {
            counts += *c;
        }
        (results.iter().all(|(drained, _)| *drained), counts)
    }
}

/// A configuration read again and its pipelines compiled: the slow part of a reload's first
/// step, done off the async runtime ([`Loaded::read`]).
pub struct Loaded {
    pub next: Settings,
    pub wanted: Vec<Declared>,
    /// The settings the sources changed that apply only at a restart (names only).
    pub restart: Vec<String>,
}

impl Loaded {
    /// Reads the configuration with `load` and compiles its pipelines' mappings. When the
    /// sources change settings that apply only at a restart (`base`: what runs), it is read
    /// again with those pinned to the running values, so the pipelines are resolved and checked
    /// against what runs, not against values that do not apply (review R35g F3, F4: a new
    /// `MAX_INSERTS_IN_FLIGHT` let a pipeline past the budget that runs, and a new
    /// `DATABASE_SCHEMA` had a tombstone table checked where the pipeline would not write).
    /// The sources as they are must load too: a mistake in them is refused either way.
    pub fn read(load: &LoadFn, base: &Settings) -> Result<Self, ReloadError> {
        let config = |e: ConfigError| ReloadError::Config(e.to_string());
        let raw = load(&std::collections::BTreeMap::new()).map_err(config)?;
        let restart = restart_needed(base, &raw);
        let next = if restart.is_empty() {
            raw
        } else {
            let running = by_key(base);
            let pins = restart
                .iter()
                .filter_map(|k| running.get(k).map(|v| (k.clone(), v.clone())))
                .collect();
            load(&pins).map_err(|e| {
                ReloadError::Config(format!(
                    "checked with the values that run of {} (they apply only at a restart): {e}",
                    restart.join(", ")
                ))
            })?
        };
        let wanted = declared(&next).map_err(config)?;
        Ok(Self {
            next,
            wanted,
            restart,
        })
    }
}

mod plan;
#[cfg(test)]
use plan::Left;
pub(super) use plan::{ReloadReport, api_kept, api_notes, left_behind, left_queues, same};

#[cfg(test)]
mod tests;
