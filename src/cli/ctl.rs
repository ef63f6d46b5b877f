//! `warren ctl`: remote control through Redis. `pause`, `resume`, `drain`, `reload`, `scale` and
//! `rate` are queued for the chosen instances (signed for each one with CONTROL_SECRET when it is set), which
//! apply them and record the outcome (a copy no instance answered within the wait is withdrawn
//! while still queued, or said taken); `history` lists outcomes, and the balancers' changes of
//! concurrency (`balance`). With CONTROL_SECRET set, an
//! outcome counts only when its signature verifies; every string read from Redis is escaped
//! before it reaches the terminal. Instances are addressed from their registry records (one that
//! cannot be read is named, not addressed); `--pipeline` must name a pipeline a live instance
//! runs or the configuration names.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Subcommand;
use comfy_table::{Table, presets};

use crate::cli::out::{self, outln};
use crate::cli::{json_terminal_safe, terminal_safe as safe};
use crate::config::Settings;
use crate::pipeline::shutdown::MAX_SHUTDOWN_MS;
use crate::registry::{
    self, Command, CtlCommand, CtlOutcome, InstanceRecord, Keys, REFUSED_BAD_SIGNATURE,
    REFUSED_UNSIGNED, Redis, now_s, record, utc,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub action: Action,
}

/// Which instances a command goes to.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Target {
    /// Every live instance on this host, or one instance as `warren status` shows it
    /// (HOST:PID).
    #[arg(long, value_name = "HOST[:PID]")]
    pub host: Option<String>,
    /// Every live instance of the deployment (REDIS_PREFIX).
    #[arg(long)]
    pub all: bool,
}

/// Which of an instance's pipelines a command applies to.
#[derive(Debug, Clone, clap::Args)]
pub struct Only {
    /// Only this pipeline (its main and DLQ stages): one a live instance runs or the
    /// configuration names (`users`, `orders`); by default every pipeline of the instance.
    #[arg(long, value_name = "NAME")]
    pub pipeline: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Stop taking deliveries; what is in flight finishes.
    Pause {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        only: Only,
    },
    /// Take deliveries again.
    Resume {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        only: Only,
    },
    /// Finish what is in flight and exit 0, as on SIGTERM.
    Drain(Target),
    /// Read the configuration again and apply its pipelines, as on SIGHUP: new ones start,
    /// removed ones drain and stop, changed ones drain and start again; answers what changed,
    /// or why nothing did.
    Reload(Target),
    /// Change the number of processors, or the bounds of the batch inserts in flight, live.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true)
        .args(["processors", "min", "max"])))]
    Scale {
        /// Processors per pipeline (1 to 256).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256),
            conflicts_with_all = ["min", "max"])]
        processors: Option<u16>,
        /// The fewest batch inserts in flight per pipeline (1 to 64): a balanced pipeline never
        /// goes below it; a fixed one is raised to it.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
        min: Option<u16>,
        /// The most batch inserts in flight per pipeline (1 to 64, at most the larger of its
        /// batch_concurrency and max_concurrency): a balanced pipeline never goes above it; a
        /// fixed one is lowered to it.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
        max: Option<u16>,
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        only: Only,
    },
    /// Change the messages per second each pipeline takes from its queue (0 = no limit).
    Rate {
        /// Messages per second (0 to 1000000; 0 turns the limit off).
        #[arg(value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
        per_s: u32,
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        only: Only,
    },
    /// Recorded outcomes of remote commands, newest first.
    History {
        /// How many entries (at least 1).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
        limit: u64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

/// Whether an instance of `roles` (`consumer,dlq,api`) runs pipelines.
fn runs_pipelines(roles: &str) -> bool {
    roles
        .split(',')
        .any(|r| matches!(r.trim(), "consumer" | "dlq"))
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let config = settings.registry();
    let keys = Keys::new(&config.redis.prefix);
    let mut redis = Redis::new(&config.redis.url);
    // Redis away is not "no instance": the commands go through it, and so does what names the
    // instances; say how to reach it (review R35-F10).
    if let Err(e) = Redis::connect(&config.redis.url).await {
        bail!(
            "{e}; `warren ctl` reaches the instances through Redis: {}",
            e.remedy()
        );
    }
    let secret = config.secret();
    let (asked, target, pipeline) = match args.action {
        Action::History { limit, json } => {
            return history(&mut redis, &keys, limit, json, secret).await;
        }
        Action::Pause { target, only } => (Command::Pause, target, only.pipeline),
        Action::Resume { target, only } => (Command::Resume, target, only.pipeline),
        Action::Drain(t) => (Command::Drain, t, None),
        Action::Reload(t) => (Command::Reload, t, None),
        Action::Scale {
            processors,
            min,
            max,
            target,
            only,
        } => (
            match processors {
                Some(n) => Command::Scale {
                    processors: n as usize,
                },
                None => {
                    if let (Some(min), Some(max)) = (min, max)
                        && min > max
                    {
                        return Err(
                            super::Usage(format!("--min {min} is above --max {max}")).into()
                        );
                    }
                    Command::Concurrency {
                        min: min.map(usize::from),
                        max: max.map(usize::from),
                    }
                }
            },
            target,
            only.pipeline,
        ),
        Action::Rate {
            per_s,
            target,
            only,
        } => (Command::Rate { per_s }, target, only.pipeline),
    };
    let Some(instances) = registry::instances(&mut redis, &keys).await else {
        bail!("lost the connection to Redis while listing instances");
    };
    // Entries that cannot be read (an older warren's, another format) cannot be addressed:
    // said once each, never silently skipped.
    for listed in &instances {
        if let Err(why) = &listed.record {
            eprintln!(
                "warren: {}: not addressed, its registry record cannot be read: {}",
                safe(&listed.instance()),
                safe(&why.to_string())
            );
        }
    }
    let records: Vec<&InstanceRecord> = instances
        .iter()
        .filter_map(|l| l.record.as_ref().ok())
        .collect();
    if let Some(name) = &pipeline {
        let known = record::known(settings.pipelines(), records.iter().copied());
        if let Err(unknown) = record::find(&known, name) {
            bail!("--pipeline: {}", safe(&unknown.to_string()));
        }
    }
    let addressed: Vec<&InstanceRecord> = match &target.host {
        None => records.clone(),
        Some(given) => {
            let at = Address::of(given, &records);
            records.iter().copied().filter(|i| at.is(i)).collect()
        }
    };
    // A command on pipelines skips the instances that run none (an API-only instance of the
    // split deployment the README shows), said once each: sent, it came back refused, and every
    // `ctl pause --all` of that deployment exited 1 (review R35e F15).
    let (runners, skipped): (Vec<&InstanceRecord>, Vec<&InstanceRecord>) = addressed
        .into_iter()
        .partition(|i| !asked.acts_on_pipelines() || runs_pipelines(&i.roles));
    for i in &skipped {
        eprintln!(
            "warren: {}:{}: skipped, it runs no pipeline (roles {})",
            safe(&i.host),
            i.pid,
            safe(&i.roles)
        );
    }
    if runners.is_empty() && !skipped.is_empty() {
        bail!(
            "no addressed instance runs a pipeline (ROLES with consumer or dlq): {} acts on \
             pipelines",
            asked.name()
        );
    }
    // (host, pid) -> run: the run goes into the signed target.
    let runs: BTreeMap<(String, u32), String> = runners
        .iter()
        .map(|i| ((i.host.clone(), i.pid), i.run.clone()))
        .collect();
    let chosen: Vec<(String, u32)> = runs.keys().cloned().collect();
    if chosen.is_empty() {
        match &target.host {
            Some(given) => bail!("{}", Address::of(given, &records).none_live(&records)),
            None => bail!(
                "no live instance registered under REDIS_PREFIX {:?} (Redis at {} answers): \
                 start one with `warren run`, or set REDIS_PREFIX to the deployment's",
                config.redis.prefix,
                crate::config::redact_url(&config.redis.url)
            ),
        }
    }
    let command = CtlCommand::new(
        uuid::Uuid::new_v4().to_string(),
        asked,
        pipeline,
        now_s(),
        format!("{}:{}", crate::hostname(), std::process::id()),
    );
    let name = asked.name();
    // How long the outcomes are waited for. A reload may drain pipelines first, each instance
    // bounded by its own SHUTDOWN_TIMEOUT_MS: it is waited for the longest of them.
    let wait = match asked {
        Command::Reload => ANSWER_WITHIN + reload_drain(&runners, settings.shutdown().timeout()),
        _ => ANSWER_WITHIN,
    };
    let within = wait.as_secs();
    // Each copy as queued, by instance: what is withdrawn when no answer comes.
    let mut queued: BTreeMap<(String, u32), (String, String)> = BTreeMap::new();
    for (host, pid) in &chosen {
        // One copy per instance: the signature covers the target (this run of the instance),
        // so it cannot be redirected, nor replayed to a later process with the same PID.
        let target = format!("{host}:{pid}/{}", runs[&(host.clone(), *pid)]);
        let mut copy = command.clone();
        match secret {
            None => copy.target = Some(target),
            Some(secret) => copy.sign(secret, &target)?,
        }
        let json = serde_json::to_string(&copy)?;
        let key = keys.commands(host, *pid);
        // The list outlives the wait, so a copy still queued at its end is there to withdraw
        // (not expired, which would read as taken).
        let ttl = i64::try_from(wait.as_secs())
            .unwrap_or(i64::MAX)
            .saturating_add(60);
        let mut pipe = redis::pipe();
        pipe.rpush(&key, &json).ignore().expire(&key, ttl).ignore();
        if redis.pipe::<()>(&pipe).await.is_none() {
            bail!("lost the connection to Redis while sending the command");
        }
        queued.insert((host.clone(), *pid), (key, json));
    }

    // A mixed deployment: instances without CONTROL_SECRET apply a signed command as any
    // other, and record outcomes that cannot be verified; with a secret here, those are shown
    // as theirs, marked unverified (review R35e F5: they read as forgeries, "no signed answer",
    // exit 1, while the command had been applied).
    let open: BTreeSet<(String, u32)> = runners
        .iter()
        .filter(|i| secret.is_some() && i.signed_commands == Some(false))
        .map(|i| (i.host.clone(), i.pid))
        .collect();

    // Wait for every chosen instance to record its outcome.
    let deadline = Instant::now() + wait;
    let mut answers = Answers::default();
    while answers.answered.len() < chosen.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        answers
            .read(&mut redis, &keys, &command.id, secret, &open)
            .await;
    }
    // A copy no instance answered is withdrawn while it is still queued, so it is never applied
    // after `ctl` gave up on it (review R35e F7: one was applied 150 s later, behind a backlog);
    // one the instance already took may still apply, and its outcome lands in the history.
    let mut fates: BTreeMap<(String, u32), Unanswered> = BTreeMap::new();
    for (at, (key, json)) in &queued {
        if answers.answered.contains_key(at) {
            continue;
        }
        let removed: Option<i64> = redis
            .query(redis::cmd("LREM").arg(key).arg(1).arg(json))
            .await;
        let fate = match removed {
            Some(n) if n > 0 => Unanswered::Withdrawn,
            Some(_) => Unanswered::Taken,
            None => Unanswered::Unknown,
        };
        fates.insert(at.clone(), fate);
    }
    // What was taken may have been answered in the meantime.
    if fates.values().any(|f| *f != Unanswered::Withdrawn) {
        answers
            .read(&mut redis, &keys, &command.id, secret, &open)
            .await;
    }
    let Answers {
        answered: outcomes,
        forged,
    } = answers;
    let mut all_ok = true;
    let (mut unsigned, mut bad_signature) = (false, false);
    // The instances whose outcome is shown unverified because they run without a secret.
    let mut unprotected: Vec<String> = Vec::new();
    for (host, pid) in &chosen {
        let key = (host.clone(), *pid);
        let host = safe(host);
        let unverified = |o: &CtlOutcome| secret.is_some_and(|s| !o.verifies(s));
        let line = match outcomes.get(&key) {
            // A reload says what it changed.
            Some(o) if o.outcome == "executed" => {
                let mark = if unverified(o) {
                    unprotected.push(format!("{host}:{pid}"));
                    UNVERIFIED_OPEN
                } else {
                    ""
                };
                match (&o.detail, asked) {
                    (Some(detail), Command::Reload) => {
                        format!("{host}:{pid}  {name}  executed{mark}: {}", safe(detail))
                    }
                    _ => format!("{host}:{pid}  {name}  executed{mark}"),
                }
            }
            Some(o) => {
                all_ok = false;
                let error = o.error.as_deref().unwrap_or("?");
                unsigned |= error.starts_with(REFUSED_UNSIGNED);
                bad_signature |= error.starts_with(REFUSED_BAD_SIGNATURE);
                let mark = match secret {
                    Some(_) if unverified(o) && open.contains(&key) => {
                        unprotected.push(format!("{host}:{pid}"));
                        UNVERIFIED_OPEN
                    }
                    Some(_) if unverified(o) => {
                        " (this outcome is not signed with CONTROL_SECRET here)"
                    }
                    _ => "",
                };
                format!("{host}:{pid}  {name}  failed: {}{mark}", safe(error))
            }
            None if forged.contains_key(&key) => {
                all_ok = false;
                format!(
                    "{host}:{pid}  {name}  no signed answer within {within} s: an outcome under this \
                     command's id does not verify with CONTROL_SECRET (written by someone else \
                     than the instance), ignored; {}",
                    fates
                        .get(&key)
                        .copied()
                        .unwrap_or(Unanswered::Unknown)
                        .said()
                )
            }
            None => {
                all_ok = false;
                let fate = fates.get(&key).copied().unwrap_or(Unanswered::Unknown);
                let why = match fate {
                    Unanswered::Withdrawn => " (busy, or gone)",
                    _ => "",
                };
                format!(
                    "{host}:{pid}  {name}  no answer within {within} s{why}: {}",
                    fate.said()
                )
            }
        };
        // A closed stdout loses the lines, never the exit code of a failed command.
        out::unless_closed(outln!("{line}"))?;
    }
    if unsigned {
        eprintln!(
            "warren: refused: the instance requires signed commands and CONTROL_SECRET is not set here; \
             run `warren ctl` with the deployment's CONTROL_SECRET"
        );
    }
    if !unprotected.is_empty() {
        eprintln!(
            "warren: {} run{} without CONTROL_SECRET: {} any command from whoever can write to \
             Redis, signed or not, and {} outcomes cannot be verified; set the deployment's \
             CONTROL_SECRET on {}",
            unprotected.join(", "),
            if unprotected.len() == 1 { "s" } else { "" },
            if unprotected.len() == 1 {
                "it applies"
            } else {
                "they apply"
            },
            if unprotected.len() == 1 {
                "its"
            } else {
                "their"
            },
            if unprotected.len() == 1 { "it" } else { "them" },
        );
    }
    if bad_signature {
        eprintln!(
            "warren: refused: the signature did not verify; CONTROL_SECRET here differs from the instance's"
        );
    }
    Ok(if all_ok { 0 } else { 1 })
}

/// What `--host` names: every instance of a host, or one instance as `warren status` shows it
/// (`HOST:PID`; review R35e F4: that was refused as a host named `vm:20740`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Address {
    Host(String),
    Instance(String, u32),
}

impl Address {
    /// `given` as a host, when a live instance runs on a host of that very name (or it has no
    /// `:PID`); else `HOST:PID`.
    fn of(given: &str, live: &[&InstanceRecord]) -> Self {
        if live.iter().any(|i| i.host == given) {
            return Address::Host(given.to_string());
        }
        match given.rsplit_once(':') {
            Some((host, pid)) if !host.is_empty() => match pid.parse::<u32>() {
                Ok(pid) => Address::Instance(host.to_string(), pid),
                Err(_) => Address::Host(given.to_string()),
            },
            _ => Address::Host(given.to_string()),
        }
    }

    /// Whether it names `instance`.
    fn is(&self, instance: &InstanceRecord) -> bool {
        match self {
            Address::Host(host) => instance.host == *host,
            Address::Instance(host, pid) => instance.host == *host && instance.pid == *pid,
        }
    }

    /// Why no live instance is addressed, and the live ones of that host if there are any.
    fn none_live(&self, live: &[&InstanceRecord]) -> String {
        let (what, host) = match self {
            Address::Host(host) => (format!("on host {host:?}"), host),
            Address::Instance(host, pid) => (format!("{host}:{pid}"), host),
        };
        let there: Vec<String> = live
            .iter()
            .filter(|i| i.host == *host)
            .map(|i| format!("{}:{}", i.host, i.pid))
            .collect();
        let others = if there.is_empty() {
            String::new()
        } else {
            format!("; live on {host:?}: {}", there.join(", "))
        };
        safe(&format!(
            "no live instance {what}{others} (see `warren status`)"
        ))
    }
}

/// How the outcome of an instance that runs without CONTROL_SECRET is marked by a `ctl` with one.
const UNVERIFIED_OPEN: &str = " (unverified: this instance runs without CONTROL_SECRET)";

/// How long an instance has to answer a command, beside a reload's drain.
const ANSWER_WITHIN: Duration = Duration::from_secs(15);

/// The longest drain a reload of `instances` may wait for: the largest of their shutdown
/// bounds as their records publish them, `local` (this configuration's `SHUTDOWN_TIMEOUT_MS`)
/// for a record of a warren before they were published; at most [`MAX_SHUTDOWN_MS`], whatever
/// a record says (review R35e F13: `ctl reload` waited on its own bound, not the instances').
fn reload_drain(instances: &[&InstanceRecord], local: Duration) -> Duration {
    instances
        .iter()
        .map(|i| i.shutdown_timeout_ms.map_or(local, Duration::from_millis))
        .max()
        .unwrap_or(local)
        .min(Duration::from_millis(MAX_SHUTDOWN_MS))
}

/// What became of a copy of a command that no outcome answered within the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unanswered {
    /// Still queued: withdrawn, so it is never applied.
    Withdrawn,
    /// No longer queued: the instance took it, and may still apply it.
    Taken,
    /// Redis did not answer the withdrawal.
    Unknown,
}

impl Unanswered {
    /// What it means for the person who sent it.
    fn said(self) -> &'static str {
        match self {
            Unanswered::Withdrawn => "withdrawn, not applied",
            Unanswered::Taken => {
                "the instance took it and may still apply it; its outcome will show in \
                 `warren ctl history`"
            }
            Unanswered::Unknown => {
                "Redis did not answer its withdrawal, so it may still be applied; its outcome \
                 will show in `warren ctl history`"
            }
        }
    }
}

/// The outcomes recorded under one command's id, by instance (`host`, `pid`).
#[derive(Debug, Default)]
struct Answers {
    /// Believed: verified with CONTROL_SECRET here (any without one), or a refusal that does
    /// not verify (shown marked; a verified outcome replaces it).
    answered: BTreeMap<(String, u32), CtlOutcome>,
    /// `executed` outcomes that do not verify: written by someone else than the instance,
    /// never believed.
    forged: BTreeMap<(String, u32), CtlOutcome>,
}

impl Answers {
    /// Reads the newest 500 entries of the history for outcomes of command `id`. `open`: the
    /// instances whose records say they run without CONTROL_SECRET, whose unsigned outcomes
    /// are theirs to give (shown unverified), not forgeries.
    async fn read(
        &mut self,
        redis: &mut Redis,
        keys: &Keys,
        id: &str,
        secret: Option<&str>,
        open: &BTreeSet<(String, u32)>,
    ) {
        let recent: Vec<String> = redis
            .query(redis::cmd("LRANGE").arg(keys.history()).arg(0).arg(499))
            .await
            .unwrap_or_default();
        for raw in recent {
            if let Ok(o) = serde_json::from_str::<CtlOutcome>(&raw)
                && o.id == id
            {
                let key = (o.host.clone(), o.pid);
                if secret.is_none_or(|s| o.verifies(s))
                    || (o.signature.is_none() && open.contains(&key))
                {
                    self.answered.insert(key, o);
                } else if o.outcome != "executed" {
                    // A refusal under another secret (or a forged failure: at worst a command
                    // reported failed) is shown, marked; a verified outcome replaces it.
                    self.answered.entry(key).or_insert(o);
                } else {
                    self.forged.insert(key, o);
                }
            }
        }
    }
}

/// The newest `limit` outcomes; with `secret`, each one marked verified or not (an outcome that
/// does not verify was not written by an instance with this secret).
async fn history(
    redis: &mut Redis,
    keys: &Keys,
    limit: u64,
    json: bool,
    secret: Option<&str>,
) -> anyhow::Result<i32> {
    // Read as bytes: an entry that is not UTF-8 is one entry that cannot be read, not a Redis
    // that cannot be reached.
    let Some(raw) = redis
        .query::<Vec<Vec<u8>>>(
            redis::cmd("LRANGE")
                .arg(keys.history())
                .arg(0)
                .arg(limit.saturating_sub(1)),
        )
        .await
    else {
        bail!("cannot read the command history from Redis");
    };
    let raw: Vec<String> = raw
        .into_iter()
        .map(|entry| String::from_utf8_lossy(&entry).into_owned())
        .collect();
    let verified = |o: &CtlOutcome| secret.map(|s| o.verifies(s));
    if json {
        for line in raw {
            // Re-encoded, so no raw control character reaches the terminal.
            match serde_json::from_str::<serde_json::Value>(&line) {
                Ok(mut doc) => {
                    if let Ok(o) = serde_json::from_value::<CtlOutcome>(doc.clone())
                        && let Some(v) = verified(&o)
                    {
                        doc["verified"] = v.into();
                    }
                    outln!("{}", json_terminal_safe(&doc.to_string()))?;
                }
                Err(_) => outln!(
                    "{}",
                    json_terminal_safe(&serde_json::json!({ "unreadable": line }).to_string())
                )?,
            }
        }
        return Ok(0);
    }
    let mut table = Table::new();
    table
        .load_style(presets::NOTHING)
        .set_header(vec!["WHEN", "INSTANCE", "COMMAND", "OUTCOME", "DETAIL"]);
    for line in raw {
        let Ok(o) = serde_json::from_str::<CtlOutcome>(&line) else {
            // Shown, never skipped: a history that hides entries hides what happened.
            table.add_row(vec![
                "?".to_string(),
                "?".to_string(),
                "?".to_string(),
                "unreadable".to_string(),
                crate::text::shown(&safe(&line)).into_owned(),
            ]);
            continue;
        };
        let mut detail = match (&o.error, o.processors, o.rate, &o.detail) {
            (Some(e), ..) => safe(e),
            (None, Some(n), ..) => format!("processors={n}"),
            (None, None, Some(n), _) => format!("rate={n}/s"),
            (None, None, None, Some(d)) => safe(d),
            _ => String::new(),
        };
        if let Some(p) = &o.pipeline {
            detail = format!("pipeline={} {detail}", safe(p))
                .trim_end()
                .to_string();
        }
        let outcome = match verified(&o) {
            Some(false) => format!(
                "{} (unverified: not signed with CONTROL_SECRET)",
                safe(&o.outcome)
            ),
            _ => safe(&o.outcome),
        };
        table.add_row(vec![
            utc(o.at),
            format!("{}:{}", safe(&o.host), o.pid),
            safe(&o.command),
            outcome,
            detail,
        ]);
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    outln!("{}", table.trim_fmt())?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::record::tests::sample;

    #[test]
    fn host_names_a_host_or_one_instance_as_status_shows_it() {
        let on = |host: &str, pid: u32| InstanceRecord {
            host: host.into(),
            pid,
            ..sample()
        };
        let (a, b, odd) = (on("vm", 7), on("vm", 8), on("db:9", 1));
        let live = [&a, &b, &odd];
        assert_eq!(Address::of("vm", &live), Address::Host("vm".into()));
        assert_eq!(
            Address::of("vm:7", &live),
            Address::Instance("vm".into(), 7)
        );
        // A host whose name looks like HOST:PID is a host.
        assert_eq!(Address::of("db:9", &live), Address::Host("db:9".into()));
        assert_eq!(Address::of("vm:x", &live), Address::Host("vm:x".into()));
        assert_eq!(Address::of(":7", &live), Address::Host(":7".into()));
        let vm7 = Address::of("vm:7", &live);
        assert!(vm7.is(&a) && !vm7.is(&b));
        assert_eq!(
            Address::of("vm:9", &live).none_live(&live),
            "no live instance vm:9; live on \"vm\": vm:7, vm:8 (see `warren status`)"
        );
        assert_eq!(
            Address::of("elsewhere", &live).none_live(&live),
            "no live instance on host \"elsewhere\" (see `warren status`)"
        );
    }

    #[test]
    fn a_reload_waits_for_the_longest_drain_of_the_instances_it_addresses() {
        let with = |ms: Option<u64>| InstanceRecord {
            shutdown_timeout_ms: ms,
            ..sample()
        };
        let local = Duration::from_secs(30);
        let (short, long, older) = (with(Some(5_000)), with(Some(90_000)), with(None));
        assert_eq!(reload_drain(&[&short], local), Duration::from_secs(5));
        assert_eq!(
            reload_drain(&[&short, &long], local),
            Duration::from_secs(90)
        );
        // A record without the bound (an older warren's) is taken to have the local one.
        assert_eq!(reload_drain(&[&short, &older], local), local);
        assert_eq!(reload_drain(&[], local), local);
        // Whatever a record says, never past the longest bound an instance accepts.
        let absurd = with(Some(u64::MAX));
        assert_eq!(
            reload_drain(&[&absurd], local),
            Duration::from_millis(MAX_SHUTDOWN_MS)
        );
    }
}
