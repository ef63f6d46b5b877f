//! `warren status [--json] [--watch [SECONDS]]`: the live instances from the Redis registry
//! (their records, with the rates each one computes and writes itself at every heartbeat; an
//! entry that cannot be read is listed as such) and, for each queue of every pipeline the
//! configuration names or a live instance runs, its depth, consumer count and depth trend from
//! the broker. A pipeline's queues are the configuration's when it names them, else those the
//! live instances run it on (every set, per instance, when they differ), else the built-in
//! defaults ([`record::resolve`]); a disagreement is said once, under the queues. `--watch` redraws in place until interrupted, like `top`. Numbers are at most
//! `REGISTRY_HEARTBEAT_MS` old (1 s by default); `--json` is a versioned document
//! ([`JSON_VERSION`]); every string read from Redis is escaped before it reaches the terminal.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use comfy_table::{CellAlignment, Table, presets};
use serde_json::json;

use crate::cli::out::{self, out};
use crate::cli::{json_terminal_safe, terminal_safe as safe};
use crate::config::{Settings, redact_url};
use crate::registry::record::{Configured, KnownPipeline};
use crate::registry::{self, Breaker, ConnectError, Keys, Listed, Redis, now_s, record};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON document instead of tables (one per line with --watch).
    #[arg(long)]
    pub json: bool,
    /// Redraw every SECONDS (1 to 3600, default 2) until interrupted.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub watch: Option<u64>,
}

/// Time between the two depth samples of a single `warren status`, for the trend.
const TREND_SAMPLE: Duration = Duration::from_secs(1);

/// The version of the `status --json` document's schema (docs/operations.md#warren-status-json):
/// raised when a field changes meaning or goes, not when one is added.
pub const JSON_VERSION: u32 = 1;

/// (queue, messages, consumers); the numbers are `None` when the queue cannot be read.
type QueueRow = (String, Option<u32>, Option<u32>);

/// What one redraw shows.
struct Snapshot {
    /// The registry's entries (none when no instance is registered), or why Redis could not
    /// be asked: two different answers, said differently.
    instances: Result<Vec<Listed>, ConnectError>,
    /// Every pipeline the configuration names or a live instance runs, once each, with every
    /// set of queues it runs on.
    pipelines: Vec<KnownPipeline>,
    /// The queues' rows, or why the broker did not answer (a refused login is not a network
    /// problem: review R40a F7).
    queues: Result<Vec<QueueRow>, crate::amqp::AmqpError>,
    /// When the queue depths were read.
    at: Instant,
}

pub async fn execute(
    settings: &Settings,
    configured: &[Configured],
    args: Args,
) -> anyhow::Result<i32> {
    let Some(every) = args.watch else {
        let (_, pipelines) = listing(settings, configured).await;
        let first = queue_rows(settings, &pipelines)
            .await
            .ok()
            .map(|q| (q, Instant::now()));
        if first.is_some() {
            tokio::time::sleep(TREND_SAMPLE).await;
        }
        let now = snapshot(settings, configured).await;
        let trends = trends(first.as_ref().map(|(q, at)| (q.as_slice(), *at)), &now);
        // A closed stdout loses the answer, never the exit code of servers out of reach.
        out::unless_closed(out!("{}", render(settings, &now, &trends, args.json, true)))?;
        return Ok(if now.instances.is_err() && now.queues.is_err() {
            1
        } else {
            0
        });
    };
    let every = Duration::from_secs(every);
    // Listened for from here on: a signal while a snapshot is taken is kept, not lost.
    let stop = super::run::signals();
    tokio::pin!(stop);
    let mut previous: Option<(Vec<QueueRow>, Instant)> = None;
    let redraw = {
        use std::io::IsTerminal as _;
        std::io::stdout().is_terminal()
    };
    loop {
        let now = snapshot(settings, configured).await;
        let trends = trends(previous.as_ref().map(|(q, at)| (q.as_slice(), *at)), &now);
        let text = render(settings, &now, &trends, args.json, false);
        // A closed stdout (the reader gone) ends the watch, exit 0.
        if args.json {
            out!("{text}")?;
        } else if redraw {
            // Clear the screen and home the cursor, then draw.
            out!("\x1b[2J\x1b[H{text}")?;
        } else {
            // Into a file or a pipe, snapshots one after the other, each after a blank line,
            // without the terminal's escape codes.
            out!("{text}\n")?;
        }
        if let Ok(q) = now.queues {
            previous = Some((q, now.at));
        }
        tokio::select! {
            () = &mut stop => return Ok(0),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// The registry's entries (or why Redis could not be asked), and every pipeline the
/// configuration names or a readable record publishes, with the queues the tools take for it.
async fn listing(
    settings: &Settings,
    configured: &[Configured],
) -> (Result<Vec<Listed>, ConnectError>, Vec<KnownPipeline>) {
    let keys = Keys::new(&settings.redis_prefix);
    let instances = match Redis::connect(&settings.redis_url).await {
        Ok(_) => registry::instances(&mut Redis::quiet(&settings.redis_url), &keys)
            .await
            .ok_or_else(|| ConnectError::Unreachable {
                url: redact_url(&settings.redis_url),
                error: "it stopped answering while the instances were listed".into(),
            }),
        Err(e) => Err(e),
    };
    let records = instances
        .iter()
        .flatten()
        .filter_map(|l| l.record.as_ref().ok());
    let pipelines = record::resolve(configured, records);
    (instances, pipelines)
}

async fn snapshot(settings: &Settings, configured: &[Configured]) -> Snapshot {
    let (instances, pipelines) = listing(settings, configured).await;
    let queues = queue_rows(settings, &pipelines).await;
    Snapshot {
        instances,
        pipelines,
        queues,
        at: Instant::now(),
    }
}

/// Change of each queue's depth per second between `before` and `now` (`None` without two
/// readings).
fn trends(before: Option<(&[QueueRow], Instant)>, now: &Snapshot) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    let (Some((before, then)), Ok(rows)) = (before, &now.queues) else {
        return out;
    };
    let secs = now.at.saturating_duration_since(then).as_secs_f64();
    if secs <= 0.0 {
        return out;
    }
    for (name, messages, _) in rows {
        let earlier = before
            .iter()
            .find(|(n, _, _)| n == name)
            .and_then(|(_, m, _)| *m);
        if let (Some(a), Some(b)) = (earlier, messages) {
            out.insert(name.clone(), (f64::from(*b) - f64::from(a)) / secs);
        }
    }
    out
}

/// `+12.5/s`, `-3.0/s`, `0/s`, or `-` when unknown.
fn trend_text(trend: Option<f64>) -> String {
    match trend {
        None => "-".into(),
        Some(t) if t.abs() < 0.05 => "0/s".into(),
        Some(t) => format!("{t:+.1}/s"),
    }
}

/// The tables (or the JSON document, pretty or on one line) for one snapshot.
fn render(
    settings: &Settings,
    snap: &Snapshot,
    trends: &HashMap<String, f64>,
    json: bool,
    pretty: bool,
) -> String {
    let mut out = String::new();
    if json {
        let sets: Vec<_> = snap.pipelines.iter().flat_map(|p| &p.sets).collect();
        let notes: Vec<String> = snap
            .pipelines
            .iter()
            .filter_map(KnownPipeline::note)
            .collect();
        let doc = json!({
            "version": JSON_VERSION,
            "instances": snap.instances.as_ref().ok().map(|list| list.iter().map(instance_json).collect::<Vec<_>>()),
            "registry_error": snap.instances.as_ref().err().map(|e| format!("{e}; {}", e.remedy())),
            "pipelines": sets,
            "notes": notes,
            "broker_error": snap.queues.as_ref().err().map(ToString::to_string),
            "queues": snap.queues.as_ref().ok().map(|q| q.iter().map(|(name, m, c)| json!({
                "name": name,
                "pipeline": sets.iter().find(|s| s.pipeline.queues().any(|n| n == name)).map(|s| &s.pipeline.name),
                "messages": m, "consumers": c,
                "trend_per_s": trends.get(name).map(|t| (t * 10.0).round() / 10.0),
            })).collect::<Vec<_>>()),
        });
        let text = if pretty {
            serde_json::to_string_pretty(&doc)
        } else {
            serde_json::to_string(&doc)
        };
        let _ = writeln!(out, "{}", json_terminal_safe(&text.unwrap_or_default()));
        return out;
    }
    match &snap.instances {
        Ok(list) => {
            let mut t = table(
                &[
                    "INSTANCE",
                    "ROLES",
                    "STATUS",
                    "PROCS",
                    "RECEIVED",
                    "INSERTED",
                    "RECV/S",
                    "INS/S",
                    "INFLIGHT",
                    "BREAKER",
                    "LIMIT/S",
                    "HEARTBEAT",
                    "INSERTS",
                ],
                3,
            );
            let mut unreadable = Vec::new();
            for listed in list {
                let i = match &listed.record {
                    Ok(i) => i,
                    Err(why) => {
                        let mut row = vec!["-".to_string(); 13];
                        row[0] = safe(&listed.instance());
                        row[2] = "unreadable".into();
                        t.add_row(row);
                        unreadable.push((safe(&listed.key), safe(&why.to_string())));
                        continue;
                    }
                };
                let limit = match i.rate_limit_per_s {
                    0 => "off".to_string(),
                    n => n.to_string(),
                };
                t.add_row(vec![
                    format!("{}:{}", safe(&i.host), i.pid),
                    safe(&i.roles),
                    i.status.name().to_string(),
                    i.processors.to_string(),
                    i.received.to_string(),
                    i.inserted.to_string(),
                    format!("{:.1}", i.received_per_s),
                    format!("{:.1}", i.inserted_per_s),
                    i.inflight.to_string(),
                    breaker_name(i.breaker).to_string(),
                    limit,
                    beaten(now_s(), i.last_heartbeat),
                    i.concurrency.to_string(),
                ]);
            }
            let _ = writeln!(out, "{}", t.trim_fmt());
            for (key, why) in unreadable {
                let _ = writeln!(out, "{key}: unreadable record: {why}");
            }
            let stages = pipeline_rows(list);
            if !stages.is_empty() {
                let mut t = table(
                    &[
                        "INSTANCE", "PIPELINE", "RECEIVED", "INSERTED", "RECV/S", "INS/S",
                        "RETRIED", "DEAD", "INSERTS", "PROCS", "LIMIT/S",
                    ],
                    2,
                );
                for row in stages {
                    t.add_row(row);
                }
                let _ = writeln!(out);
                let _ = writeln!(out, "{}", t.trim_fmt());
            }
            if list.is_empty() {
                let _ = writeln!(
                    out,
                    "(Redis at {} answers, and no live instance is registered under \
                     REDIS_PREFIX {:?}: start one with `warren run`, or set REDIS_PREFIX to the \
                     deployment's)",
                    redact_url(&settings.redis_url),
                    settings.redis_prefix
                );
            }
        }
        Err(e) => {
            let _ = writeln!(
                out,
                "instances: unknown, Redis unreachable ({e}); {}",
                e.remedy()
            );
        }
    }
    let _ = writeln!(out);
    match &snap.queues {
        Ok(rows) => {
            let mut t = table(&["QUEUE", "MESSAGES", "CONSUMERS", "TREND"], 1);
            for (name, m, c) in rows {
                // Queue names may come from a record in Redis: escaped like every such string.
                let shown = safe(name);
                t.add_row(match (m, c) {
                    (Some(m), Some(c)) => vec![
                        shown,
                        m.to_string(),
                        c.to_string(),
                        trend_text(trends.get(name).copied()),
                    ],
                    _ => vec![shown, "missing".into(), "-".into(), "-".into()],
                });
            }
            let _ = writeln!(out, "{}", t.trim_fmt());
        }
        Err(e) => {
            let _ = writeln!(
                out,
                "queues: the broker at {} did not answer: {e}",
                redact_url(&settings.amqp_url)
            );
        }
    }
    out.push_str(&disagreements(&snap.pipelines));
    out
}

/// When a pipeline runs on more than one set of queues (the configuration's and a live
/// instance's, or two instances'): every set, with who runs it, then one note per pipeline;
/// empty otherwise.
fn disagreements(pipelines: &[KnownPipeline]) -> String {
    let split: Vec<&KnownPipeline> = pipelines.iter().filter(|p| p.sets.len() > 1).collect();
    if split.is_empty() {
        return String::new();
    }
    let mut t = table(&["PIPELINE", "QUEUES FROM", "MAIN", "RETRY", "DLQ"], 5);
    for p in &split {
        for set in &p.sets {
            let from = match (set.basis, set.instances.is_empty()) {
                (record::Basis::Config, true) => "configuration".to_string(),
                (record::Basis::Config, false) => {
                    format!("configuration, {}", set.instances.join(", "))
                }
                _ => set.instances.join(", "),
            };
            t.add_row(vec![
                safe(&p.name),
                safe(&from),
                safe(&set.pipeline.main_queue),
                safe(&set.pipeline.retry_queues.join(", ")),
                safe(&set.pipeline.dlq_queue),
            ]);
        }
    }
    let mut out = format!("\n{}\n", t.trim_fmt());
    for p in split {
        if let Some(note) = p.note() {
            let _ = writeln!(out, "note: {}", safe(&note));
        }
    }
    out
}

/// `open` or `closed`, as in the record.
fn breaker_name(b: Breaker) -> &'static str {
    match b {
        Breaker::Open => "open",
        Breaker::Closed => "closed",
    }
}

/// One registry entry in `status --json`: its record as the instance wrote it, or its key and
/// why it cannot be read.
fn instance_json(listed: &Listed) -> serde_json::Value {
    match &listed.record {
        Ok(r) => serde_json::to_value(r).unwrap_or_else(|e| {
            json!({
                "key": listed.key, "unreadable": e.to_string(),
            })
        }),
        Err(why) => json!({
            "key": listed.key,
            "instance": listed.instance(),
            "unreadable": why.to_string(),
        }),
    }
}

/// Each instance's per-stage lines (instance, stage, its counters, its processors and rate
/// limit), from its record's `stages`; empty when every instance runs only users' stages
/// (`main`, `dlq`), whose counts are the instance's own, at the instance's processors and rate
/// limit (a pipeline's own `ctl scale` / `rate --pipeline` shows them).
fn pipeline_rows(list: &[Listed]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut configured = false;
    for i in list.iter().filter_map(|l| l.record.as_ref().ok()) {
        let instance = format!("{}:{}", safe(&i.host), i.pid);
        for (stage, c) in &i.stages {
            configured |= stage != "users/main" && stage != "users/dlq";
            // 0 processors: a record of a warren before the stages published them.
            let known = c.processors > 0;
            configured |= known
                && (c.processors != i.processors as u64
                    || c.rate_limit_per_s != i.rate_limit_per_s);
            let (procs, limit) = match (known, c.rate_limit_per_s) {
                (false, _) => ("-".to_string(), "-".to_string()),
                (true, 0) => (c.processors.to_string(), "off".to_string()),
                (true, n) => (c.processors.to_string(), n.to_string()),
            };
            rows.push(vec![
                instance.clone(),
                safe(stage),
                c.received.to_string(),
                c.inserted.to_string(),
                format!("{:.1}", c.received_per_s),
                format!("{:.1}", c.inserted_per_s),
                c.retried.to_string(),
                c.dead_lettered.to_string(),
                match c.concurrency {
                    0 => "-".into(),
                    n => n.to_string(),
                },
                procs,
                limit,
            ]);
        }
    }
    if configured { rows } else { Vec::new() }
}

/// A borderless table (comfy-table) under `header`, two spaces between columns; the columns from
/// `first_number` on hold numbers and are right-aligned.
fn table(header: &[&str], first_number: usize) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING).set_header(header.to_vec());
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, 2));
        if i >= first_number {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// (queue, messages, consumers) for the main queue, every retry tier and the DLQ of every set
/// of queues of every pipeline in `pipelines`, once each; `None` without a broker.
async fn queue_rows(
    settings: &Settings,
    pipelines: &[KnownPipeline],
) -> Result<Vec<QueueRow>, crate::amqp::AmqpError> {
    let mut fast = settings.amqp();
    fast.connect_timeout_ms = fast.connect_timeout_ms.min(3000);
    let conn = crate::amqp::connect(&fast, "status", crate::amqp::Frames::Small).await?;
    let mut rows = Vec::new();
    let mut queues: Vec<&str> = Vec::new();
    for q in pipelines
        .iter()
        .flat_map(|p| &p.sets)
        .flat_map(|s| s.pipeline.queues())
    {
        if !queues.contains(&q) {
            queues.push(q);
        }
    }
    for q in queues {
        let stats =
            tokio::time::timeout(Duration::from_secs(3), crate::amqp::queue_stats(&conn, q)).await;
        match stats {
            Ok(Ok((m, c))) => rows.push((q.to_string(), Some(m), Some(c))),
            _ => rows.push((q.to_string(), None, None)),
        }
    }
    crate::amqp::close(None, Some(conn)).await;
    Ok(rows)
}

/// When an instance's heartbeat last ran, as the HEARTBEAT column shows it: 0 (a record that
/// never had one) is "never", not 56 years ago.
fn beaten(now: u64, last_heartbeat: u64) -> String {
    match last_heartbeat {
        0 => "never".to_string(),
        t if t > now => format!("{}s ahead (clock skew)", t - now),
        t => format!("{}s ago", now - t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_of_0_is_never() {
        assert_eq!(beaten(1_795_877_137, 0), "never");
        assert_eq!(beaten(100, 98), "2s ago");
        assert_eq!(beaten(100, 103), "3s ahead (clock skew)");
    }

    #[test]
    fn trends_are_depth_changes_per_second() {
        let then = Instant::now();
        let before = vec![("q".to_string(), Some(100), Some(1))];
        let now = Snapshot {
            instances: Ok(Vec::new()),
            pipelines: Vec::new(),
            queues: Ok(vec![
                ("q".to_string(), Some(40), Some(1)),
                ("new".to_string(), Some(5), Some(0)),
            ]),
            at: then + Duration::from_secs(2),
        };
        let t = trends(Some((&before, then)), &now);
        assert_eq!(t.get("q"), Some(&-30.0));
        assert_eq!(t.get("new"), None, "one reading only");
        assert!(trends(None, &now).is_empty());
        assert_eq!(trend_text(Some(-30.0)), "-30.0/s");
        assert_eq!(trend_text(Some(2.25)), "+2.2/s");
        assert_eq!(trend_text(Some(0.0)), "0/s");
        assert_eq!(trend_text(None), "-");
    }

    #[test]
    fn unreadable_entries_are_shown_as_such() {
        let listed = Listed {
            key: "w:instances:vm:7".into(),
            record: Err(registry::Unreadable::Format { found: "2".into() }),
        };
        assert_eq!(
            instance_json(&listed),
            json!({"key": "w:instances:vm:7", "instance": "vm:7",
                   "unreadable": "record format 2, this warren reads format 1: another version"})
        );
    }

    #[test]
    fn tables_align_names_left_and_numbers_right() {
        let mut t = table(&["QUEUE", "MESSAGES", "TREND"], 1);
        t.add_row(vec!["main", "12", "+2.5/s"]);
        t.add_row(vec!["a_longer_name", "3", "-"]);
        assert_eq!(
            t.trim_fmt(),
            "QUEUE          MESSAGES   TREND\n\
             main                 12  +2.5/s\n\
             a_longer_name         3       -"
        );
    }
}
