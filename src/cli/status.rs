//! `warren status [--json] [--watch [SECONDS]]`: the live instances from the Redis registry
//! (with the rates each one computes and writes itself at every heartbeat) and, for each queue,
//! its depth, consumer count and depth trend from the broker. `--watch` redraws in place until
//! interrupted, like `top`. Numbers are at most `REGISTRY_HEARTBEAT_MS` old (1 s by default);
//! `--json` gives them as JSON numbers; every string read from Redis is escaped before it
//! reaches the terminal.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use comfy_table::{CellAlignment, Table, presets};
use serde_json::json;

use crate::cli::out::{self, out};
use crate::cli::{json_terminal_safe, terminal_safe as safe};
use crate::config::pipelines::Names;
use crate::config::{Settings, redact_url};
use crate::registry::{self, InstanceFields, Keys, Redis, now_s};

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

/// (queue, messages, consumers); the numbers are `None` when the queue cannot be read.
type QueueRow = (String, Option<u32>, Option<u32>);

/// What one redraw shows.
struct Snapshot {
    instances: Option<Vec<InstanceFields>>,
    queues: Option<Vec<QueueRow>>,
    /// When the queue depths were read.
    at: Instant,
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let Some(every) = args.watch else {
        let first = queue_rows(settings).await.map(|q| (q, Instant::now()));
        if first.is_some() {
            tokio::time::sleep(TREND_SAMPLE).await;
        }
        let now = snapshot(settings).await;
        let trends = trends(first.as_ref().map(|(q, at)| (q.as_slice(), *at)), &now);
        // A closed stdout loses the answer, never the exit code of servers out of reach.
        out::unless_closed(out!("{}", render(settings, &now, &trends, args.json, true)))?;
        return Ok(if now.instances.is_none() && now.queues.is_none() {
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
    loop {
        let now = snapshot(settings).await;
        let trends = trends(previous.as_ref().map(|(q, at)| (q.as_slice(), *at)), &now);
        let text = render(settings, &now, &trends, args.json, false);
        // A closed stdout (the reader gone) ends the watch, exit 0.
        if args.json {
            out!("{text}")?;
        } else {
            // Clear the screen and home the cursor, then draw.
            out!("\x1b[2J\x1b[H{text}")?;
        }
        if let Some(q) = now.queues {
            previous = Some((q, now.at));
        }
        tokio::select! {
            () = &mut stop => return Ok(0),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

async fn snapshot(settings: &Settings) -> Snapshot {
    let keys = Keys::new(&settings.redis_prefix);
    let instances = match Redis::connect(&settings.redis_url).await {
        Ok(_) => registry::instances(&mut Redis::new(&settings.redis_url), &keys).await,
        Err(_) => None,
    };
    let queues = queue_rows(settings).await;
    Snapshot {
        instances,
        queues,
        at: Instant::now(),
    }
}

/// Change of each queue's depth per second between `before` and `now` (`None` without two
/// readings).
fn trends(before: Option<(&[QueueRow], Instant)>, now: &Snapshot) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    let (Some((before, then)), Some(rows)) = (before, &now.queues) else {
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
        let doc = json!({
            "instances": snap.instances.as_ref().map(|list| list.iter().map(typed).collect::<Vec<_>>()),
            "queues": snap.queues.as_ref().map(|q| q.iter().map(|(name, m, c)| json!({
                "name": name, "messages": m, "consumers": c,
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
        Some(list) => {
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
            for i in list {
                let get = |k: &str| safe(i.get(k).map(String::as_str).unwrap_or("-"));
                let age = get("last_heartbeat")
                    .parse::<u64>()
                    .map(|t| format!("{}s ago", now_s().saturating_sub(t)))
                    .unwrap_or_else(|_| "-".into());
                let limit = match get("rate_limit_per_s").as_str() {
                    "0" => "off".to_string(),
                    other => other.to_string(),
                };
                t.add_row(vec![
                    format!("{}:{}", get("host"), get("pid")),
                    get("roles").to_string(),
                    get("status").to_string(),
                    get("processors").to_string(),
                    get("received").to_string(),
                    get("inserted").to_string(),
                    get("received_per_s").to_string(),
                    get("inserted_per_s").to_string(),
                    get("inflight").to_string(),
                    get("breaker").to_string(),
                    limit.to_string(),
                    age,
                    get("concurrency").to_string(),
                ]);
            }
            let _ = writeln!(out, "{}", t.trim_fmt());
            let stages = pipeline_rows(list);
            if !stages.is_empty() {
                let mut t = table(
                    &[
                        "INSTANCE", "PIPELINE", "RECEIVED", "INSERTED", "RECV/S", "INS/S",
                        "RETRIED", "DEAD", "INSERTS",
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
                    "(no live instance under REDIS_PREFIX {:?})",
                    settings.redis_prefix
                );
            }
        }
        None => {
            let _ = writeln!(
                out,
                "instances: Redis unreachable at {}",
                redact_url(&settings.redis_url)
            );
        }
    }
    let _ = writeln!(out);
    match &snap.queues {
        Some(rows) => {
            let mut t = table(&["QUEUE", "MESSAGES", "CONSUMERS", "TREND"], 1);
            for (name, m, c) in rows {
                t.add_row(match (m, c) {
                    (Some(m), Some(c)) => vec![
                        name.clone(),
                        m.to_string(),
                        c.to_string(),
                        trend_text(trends.get(name).copied()),
                    ],
                    _ => vec![name.clone(), "missing".into(), "-".into(), "-".into()],
                });
            }
            let _ = writeln!(out, "{}", t.trim_fmt());
        }
        None => {
            let _ = writeln!(
                out,
                "queues: broker unreachable at {}",
                redact_url(&settings.amqp_url)
            );
        }
    }
    out
}

/// The registry fields whose values are numbers (counters, rates, times, the PID).
const NUMERIC_FIELDS: &[&str] = &[
    "pid",
    "started_at",
    "processors",
    "received",
    "inserted",
    "received_per_s",
    "inserted_per_s",
    "rate_limit_per_s",
    "retried",
    "dead_lettered",
    "inflight",
    "last_heartbeat",
];

/// One instance's fields as JSON, the numeric ones as numbers (a value that is not one, which
/// only a hand-edited hash holds, stays a string).
fn typed(fields: &InstanceFields) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for (key, value) in fields {
        let number = NUMERIC_FIELDS
            .contains(&key.as_str())
            .then(|| {
                value
                    .parse::<u64>()
                    .map(serde_json::Value::from)
                    .ok()
                    .or_else(|| {
                        value
                            .parse::<f64>()
                            .ok()
                            .and_then(|f| serde_json::Number::from_f64(f).map(Into::into))
                    })
            })
            .flatten();
        // The per-pipeline counters are a JSON object of their own.
        let object = (key == "pipelines")
            .then(|| serde_json::from_str::<serde_json::Value>(value).ok())
            .flatten()
            .filter(serde_json::Value::is_object);
        out.insert(
            key.clone(),
            number.or(object).unwrap_or_else(|| value.clone().into()),
        );
    }
    out.into()
}

/// Each instance's per-pipeline lines (instance, stage, its counters), from its `pipelines`
/// field; empty when every instance runs only users' stages (`users/main`, `users/dlq`), whose
/// counts are the instance's own.
fn pipeline_rows(list: &[InstanceFields]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut configured = false;
    for i in list {
        let Some(serde_json::Value::Object(stages)) = i
            .get("pipelines")
            .and_then(|v| serde_json::from_str::<serde_json::Value>(v).ok())
        else {
            continue;
        };
        let instance = format!(
            "{}:{}",
            safe(i.get("host").map(String::as_str).unwrap_or("-")),
            safe(i.get("pid").map(String::as_str).unwrap_or("-"))
        );
        for (stage, counts) in &stages {
            configured |= !matches!(stage.as_str(), "users/main" | "users/dlq");
            let n = |k: &str| {
                counts
                    .get(k)
                    .map(|v| safe(&v.to_string()))
                    .unwrap_or_else(|| "-".into())
            };
            rows.push(vec![
                instance.clone(),
                safe(stage),
                n("received"),
                n("inserted"),
                n("received_per_s"),
                n("inserted_per_s"),
                n("retried"),
                n("dead_lettered"),
                match n("concurrency").as_str() {
                    "0" => "-".into(),
                    c => c.to_string(),
                },
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

/// (queue, messages, consumers) for the main queue, every retry tier and the DLQ of every
/// pipeline; `None` without a broker.
async fn queue_rows(settings: &Settings) -> Option<Vec<QueueRow>> {
    let mut fast = settings.clone();
    fast.amqp_connect_timeout_ms = fast.amqp_connect_timeout_ms.min(3000);
    let conn = crate::amqp::connect(&fast, "status", crate::amqp::Frames::Small)
        .await
        .ok()?;
    let mut rows = Vec::new();
    // Users' queues (unless a file's pipeline named users replaces it), then every configured
    // pipeline's.
    let mut names = Vec::new();
    if !settings.pipelines.iter().any(|p| p.name == "users") {
        names.push(Names::users(settings));
    }
    names.extend(settings.pipelines.iter().map(|p| p.names(settings)));
    let mut queues = Vec::new();
    for n in names {
        queues.push(n.main_queue);
        queues.extend(n.retry_tiers.into_iter().map(|t| t.queue));
        queues.push(n.dlq_queue);
    }
    for q in &queues {
        let stats =
            tokio::time::timeout(Duration::from_secs(3), crate::amqp::queue_stats(&conn, q)).await;
        match stats {
            Ok(Ok((m, c))) => rows.push((q.clone(), Some(m), Some(c))),
            _ => rows.push((q.clone(), None, None)),
        }
    }
    crate::amqp::close(None, Some(conn)).await;
    Some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trends_are_depth_changes_per_second() {
        let then = Instant::now();
        let before = vec![("q".to_string(), Some(100), Some(1))];
        let now = Snapshot {
            instances: None,
            queues: Some(vec![
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
    fn instance_numbers_are_json_numbers_and_names_stay_strings() {
        let fields: InstanceFields = [
            ("host", "123"),
            ("pid", "1"),
            ("inserted", "40001"),
            ("inserted_per_s", "12.5"),
            ("received", "garbled"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(
            typed(&fields),
            json!({"host": "123", "pid": 1, "inserted": 40001, "inserted_per_s": 12.5,
                   "received": "garbled"})
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
