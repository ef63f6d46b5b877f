//! `warren dlq`: inspect the dead-letter queue without taking anything out of it, replay its
//! messages to the main exchange (each republish confirmed before the DLQ copy is acked), and
//! list or replay the messages parked in the `dead_letters` table (rows locked, published and
//! marked in one transaction, so a concurrent re-park waits and then re-opens the row).
//!
//! Here: the arguments, the kinds `--kind` selects and the dispatch, and the output helpers both
//! tools share; `queue` works on the DLQ, `parked` on the parking table.

mod parked;
mod queue;

pub use parked::replay_headers;
use parked::{parked_list, parked_replay};
use queue::{inspect, replay};

use std::time::{SystemTime, UNIX_EPOCH};

use clap::builder::PossibleValuesParser;
use comfy_table::{Table, presets};
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::amqp::{headers, republish};
use crate::config::Settings;
use crate::registry::record::{self, Basis, Configured, PipelineRecord, UnknownPipeline};

/// The kinds of dead letter `--kind` selects: the values of `x-error-kind` (and of
/// `dead_letters.error_kind`), then the kinds of messages the broker dead-lettered itself (see
/// [`kind_of`]).
pub const KINDS: [&str; 10] = [
    "invalid_json",
    "invalid_payload",
    "db_permanent",
    "retries_exhausted",
    "id_conflict",
    "unpublishable",
    "broker_rejected",
    "broker_expired",
    "broker_maxlen",
    "broker_delivery_limit",
];

/// The header the DLQ consumer counts its attempts in; a replay starts the count again.
pub(super) const X_DLQ_ATTEMPTS: &str = "x-dlq-attempts";

/// The broker's `x-death` reasons and the kinds they are shown and selected as.
const BROKER_KINDS: [(&str, &str); 4] = [
    ("rejected", "broker_rejected"),
    ("expired", "broker_expired"),
    ("maxlen", "broker_maxlen"),
    ("delivery_limit", "broker_delivery_limit"),
];

/// The newest entry of the `x-death` header the broker adds when it dead-letters a message
/// itself (a reject or nack without requeue, an expired TTL, an overflowing queue, a quorum
/// queue's delivery limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerDeath {
    /// The entry's `reason`, as the broker wrote it (`rejected`, `expired`, ...).
    pub reason: String,
    /// The queue the message died in, when the entry names it.
    pub queue: Option<String>,
}

impl BrokerDeath {
    /// The first entry of `x-death` (the broker puts the newest death first), or of
    /// `x-original-x-death` where a move set it aside; `None` when the header is missing or not
    /// an array of tables with a `reason`.
    pub fn of(properties: &BasicProperties) -> Option<Self> {
        let headers = properties.headers().as_ref()?.inner();
        let AMQPValue::FieldArray(deaths) = headers
            .get(republish::X_DEATH)
            .or_else(|| headers.get(republish::X_ORIGINAL_DEATH))?
        else {
            return None;
        };
        let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
            return None;
        };
        Some(Self {
            reason: headers::value_text(first.inner().get("reason")?),
            queue: first.inner().get("queue").map(headers::value_text),
        })
    }

    /// `broker_rejected`, `broker_expired`, `broker_maxlen` or `broker_delivery_limit`; `None`
    /// for a reason the broker did not document.
    pub fn kind(&self) -> Option<&'static str> {
        BROKER_KINDS
            .iter()
            .find(|(reason, _)| *reason == self.reason)
            .map(|(_, kind)| *kind)
    }

    /// What `dlq inspect` shows as the reason of a message without `x-error-reason`.
    fn describe(&self) -> String {
        match &self.queue {
            Some(q) => format!("dead-lettered by the broker ({}) in queue {q}", self.reason),
            None => format!("dead-lettered by the broker ({})", self.reason),
        }
    }
}

/// The kind of a dead letter: its `x-error-kind`, or, when warren did not write one (the
/// broker dead-lettered the message itself), the kind of the broker's reason in the newest
/// `x-death` entry (`broker_rejected`, ...).
pub fn kind_of(properties: &BasicProperties) -> Option<String> {
    headers::text(properties, headers::X_ERROR_KIND).or_else(|| {
        BrokerDeath::of(properties)
            .and_then(|d| d.kind())
            .map(str::to_string)
    })
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The pipeline whose DLQ and parked messages to work on (see `warren pipelines`); a replay
    /// sends its messages back to this pipeline's queue.
    #[arg(long, global = true, value_name = "NAME", default_value = "users")]
    pub pipeline: String,
    /// Work on the queues this live instance (`HOST:PID`, as `warren status` lists it) runs
    /// the pipeline on: to choose when live instances run it on different queues.
    #[arg(long, global = true, value_name = "HOST:PID")]
    pub instance: Option<String>,
    #[command(subcommand)]
    pub command: DlqCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// List messages of the DLQ (id, kind, reason, retries, age) and leave them in the queue.
    Inspect(InspectArgs),
    /// Move DLQ messages back to the main exchange, with x-retries reset to 0.
    ///
    /// The x-error-* headers are removed; the body and the other properties are kept. A message
    /// the broker dead-lettered itself (x-death, no x-error-kind) has the kind broker_<reason>
    /// (broker_rejected, broker_expired, broker_maxlen, broker_delivery_limit). Each
    /// republish is confirmed by the broker before the DLQ copy is acked, so nothing is lost;
    /// a failed republish leaves its message in the DLQ, stops the replay and exits 1.
    Replay(ReplayArgs),
    /// The messages the DLQ consumer parked in the dead_letters table.
    #[command(subcommand)]
    Parked(ParkedCommand),
}

#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// Show at most N messages (the queue's depth is printed too).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: u64,
    /// Print one JSON object per message instead of a table (the depth goes to stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// Replay only messages of this kind (x-error-kind, or broker_<reason> from x-death); the
    /// others stay in the DLQ.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Replay at most N messages (default: every message in the queue when the command starts).
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: Option<u64>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ParkedCommand {
    /// List parked messages not yet replayed, newest first.
    List(ParkedListArgs),
    /// Publish parked messages not yet replayed to the main exchange, oldest first.
    ///
    /// Each row's body goes out as a persistent JSON message with its message id, its parked
    /// headers (without x-error-* and x-dlq-attempts) and x-retries 0. Rows are locked (FOR
    /// UPDATE SKIP LOCKED, up to 100 at a time), published with confirms, and marked replayed in
    /// the same transaction, so a concurrent re-park of a row waits and then re-opens it. A row
    /// whose publish failed is left untouched, and the command exits 1.
    Replay(ParkedReplayArgs),
}

#[derive(Debug, clap::Args)]
pub struct ParkedListArgs {
    /// The pipeline whose rows (from `dlq --pipeline`).
    #[arg(skip)]
    pub pipeline: String,
    /// Why no configuration or live instance knows the pipeline, when none does: said when
    /// nothing is parked under its name (a misspelt name lists nothing).
    #[arg(skip)]
    pub unknown: Option<UnknownPipeline>,
    /// Redis answered (so "no live instance runs it" is known, not guessed): a name nobody
    /// knows with nothing parked under it is then a misspelt one, refused.
    #[arg(skip)]
    pub registry_answered: bool,
    /// Only rows with this error kind.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Show at most N rows.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: u64,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ParkedReplayArgs {
    /// The pipeline whose rows (from `dlq --pipeline`).
    #[arg(skip)]
    pub pipeline: String,
    /// Only rows with this error kind.
    #[arg(long, value_name = "KIND", value_parser = PossibleValuesParser::new(KINDS))]
    pub kind: Option<String>,
    /// Replay at most N rows (default: all).
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_limit,
        allow_negative_numbers = true
    )]
    pub limit: Option<u64>,
}

/// `--limit` (of `dlq` and `move`): a whole number of at least 1.
pub(crate) fn parse_limit(raw: &str) -> Result<u64, String> {
    match raw.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number of at least 1".into()),
    }
}

pub async fn execute(
    settings: &Settings,
    configured: &[Configured],
    args: Args,
) -> anyhow::Result<i32> {
    use crate::cli::terminal_safe as safe;
    // The chosen pipeline's DLQ, exchange and queue: the configuration's when it names them,
    // else those the live instances run it on (`--instance` choosing among them), else the
    // built-in defaults (record::resolve). Redis away is not "no instance": each answer below
    // says which of the two it met.
    let live = crate::registry::live(&settings.redis()).await;
    let known = record::resolve(configured, live.as_ref().map_or(&[][..], Vec::as_slice));
    let found = record::find_known(&known, &args.pipeline).map_err(|u| u.asked(&live));
    let instance = args.instance.as_deref();
    let target = || -> anyhow::Result<PipelineRecord> {
        let pipeline = found
            .as_ref()
            .map_err(|unknown| anyhow::anyhow!("--pipeline: {}", safe(&unknown.to_string())))?;
        if let (Some(instance), Err(e)) = (instance, &live) {
            anyhow::bail!(
                "--instance {}: the live instances are unknown ({}); {}",
                safe(instance),
                safe(&e.to_string()),
                e.remedy()
            );
        }
        let set = pipeline
            .choose(instance)
            .map_err(|e| anyhow::anyhow!("{}", safe(&e.to_string())))?;
        if let (Basis::Defaults, Err(e)) = (set.basis, &live) {
            crate::cli::say(format_args!(
                "warning: {}: the queues of pipeline {:?} are the built-in defaults ({}), which \
                 a live instance may not run on; {}, or name them (--config FILE, MAIN_QUEUE, \
                 ...)",
                safe(&e.to_string()),
                pipeline.name,
                safe(&set.pipeline.queues().collect::<Vec<_>>().join(", ")),
                e.remedy()
            ));
        }
        if instance.is_none()
            && let Some(note) = pipeline.note()
        {
            crate::cli::say(format_args!("note: {}", safe(&note)));
        }
        Ok(set.pipeline.clone())
    };
    match args.command {
        DlqCommand::Inspect(a) => inspect(settings, &target()?, a).await,
        DlqCommand::Replay(a) => replay(settings, &target()?, a).await,
        DlqCommand::Parked(ParkedCommand::List(mut a)) => {
            // The parked rows are read by the pipeline's name from the database: they need
            // neither its queues nor Redis. A name nobody knows is still listed (its rows say
            // it existed); with nothing parked, the listing says that nobody knows it.
            if let (Err(unknown), Err(e)) = (&found, &live) {
                crate::cli::say(format_args!(
                    "warning: {}: whether a live instance runs pipeline {:?} is unknown; its \
                     parked rows are listed from the database",
                    safe(&e.to_string()),
                    safe(&unknown.name)
                ));
            }
            a.pipeline = args.pipeline;
            a.unknown = found.err();
            a.registry_answered = live.is_ok();
            parked_list(settings, a).await
        }
        DlqCommand::Parked(ParkedCommand::Replay(mut a)) => {
            let target = target()?;
            a.pipeline = args.pipeline;
            parked_replay(settings, &target, a).await
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Output helpers
// ---------------------------------------------------------------------------------------------

/// Seconds since the Unix epoch.
pub(super) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `1 message`, `2 messages`.
pub(super) fn plural(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Time since `timestamp` as `42s`, `7m05s`, `3h12m`, `2d04h`; `-` without a timestamp.
pub(super) fn age(now: u64, timestamp: Option<u64>) -> String {
    let Some(t) = timestamp else {
        return "-".into();
    };
    let s = now.saturating_sub(t);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

/// Text fit for one table cell: control characters become spaces.
pub(super) fn cell(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// `cell(s)` cut to at most `max` characters, with `...` when cut.
pub(super) fn preview(s: &str, max: usize) -> String {
    let clean = cell(s);
    if clean.chars().count() <= max {
        return clean;
    }
    let mut cut: String = clean.chars().take(max.saturating_sub(3)).collect();
    cut.push_str("...");
    cut
}

/// An aligned table (comfy-table, no borders): a header line, then the rows, two spaces
/// between columns, no trailing blanks.
pub(super) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_header(header.to_vec())
        .add_rows(rows.iter().cloned());
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    format!("{}\n", t.trim_fmt())
}

#[cfg(test)]
mod tests {
    use super::parked::parked_properties;
    use super::*;
    use clap::Parser;
    use lapin::types::{FieldTable, LongString};

    #[test]
    fn ages_are_short_and_a_missing_timestamp_is_a_dash() {
        assert_eq!(age(1000, None), "-");
        assert_eq!(age(1000, Some(958)), "42s");
        assert_eq!(age(1000, Some(2000)), "0s");
        assert_eq!(age(10_000, Some(10_000 - 425)), "7m05s");
        assert_eq!(age(100_000, Some(100_000 - 3 * 3600 - 12 * 60)), "3h12m");
        assert_eq!(
            age(1_000_000, Some(1_000_000 - 2 * 86400 - 4 * 3600)),
            "2d04h"
        );
    }

    #[test]
    fn previews_are_cut_on_characters_and_lose_control_characters() {
        assert_eq!(preview("a\nb", 10), "a b");
        assert_eq!(preview("ééééééé", 5), "éé...");
        assert_eq!(preview("abc", 3), "abc");
    }

    #[test]
    fn tables_are_aligned() {
        let t = table(
            &["A", "LONG", "C"],
            &[
                vec!["xyz".into(), "1".into(), "last".into()],
                vec!["é".into(), "22".into(), "-".into()],
            ],
        );
        assert_eq!(t, "A    LONG  C\nxyz  1     last\né    22    -\n");
        // Aligned by display width: a CJK character takes two terminal columns.
        let t = table(&["A", "B"], &[vec!["日本".into(), "x".into()]]);
        assert_eq!(t, "A     B\n日本  x\n");
    }

    #[test]
    fn limits_and_kinds_are_checked_by_the_parser() {
        let parse = |args: &[&str]| {
            let mut full = vec!["warren", "dlq"];
            full.extend_from_slice(args);
            crate::cli::Cli::try_parse_from(full)
        };
        assert!(parse(&["inspect"]).is_ok());
        assert!(parse(&["replay", "--kind", "invalid_json", "--limit", "5"]).is_ok());
        assert!(parse(&["parked", "list", "--kind", "db_permanent"]).is_ok());
        let err = parse(&["inspect", "--limit", "0"]).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let err = parse(&["replay", "--kind", "nope"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("retries_exhausted"), "{err}");
        assert!(parse(&["parked", "replay", "--limit", "-1"]).is_err());
    }

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
    }

    fn with(pairs: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in pairs {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    /// An `x-death` header as the broker writes it: the newest death first.
    fn x_death(reasons: &[&str]) -> AMQPValue {
        let entries = reasons
            .iter()
            .map(|r| {
                let mut t = FieldTable::default();
                t.insert("reason".into(), long(r));
                t.insert("queue".into(), long("raffle_queue"));
                t.insert("count".into(), AMQPValue::LongLongInt(1));
                AMQPValue::FieldTable(t)
            })
            .collect::<Vec<_>>();
        AMQPValue::FieldArray(entries.into())
    }

    #[test]
    fn broker_dead_letters_get_a_kind_from_the_newest_x_death_entry() {
        for (reason, kind) in BROKER_KINDS {
            let p = with(&[("x-death", x_death(&[reason, "expired"]))]);
            assert_eq!(kind_of(&p).as_deref(), Some(kind), "{reason}");
            assert!(KINDS.contains(&kind));
        }
        let p = with(&[("x-death", x_death(&["rejected"]))]);
        let death = BrokerDeath::of(&p).unwrap();
        assert_eq!(death.queue.as_deref(), Some("raffle_queue"));
        assert_eq!(
            death.describe(),
            "dead-lettered by the broker (rejected) in queue raffle_queue"
        );
        // warren's own kind wins over the broker's.
        let p = with(&[
            ("x-death", x_death(&["rejected"])),
            (headers::X_ERROR_KIND, long("db_permanent")),
        ]);
        assert_eq!(kind_of(&p).as_deref(), Some("db_permanent"));
        // Unknown reasons, empty arrays and malformed headers have no kind.
        for bad in [
            x_death(&["something_new"]),
            x_death(&[]),
            long("FieldArray([...])"),
            AMQPValue::FieldArray(vec![long("rejected")].into()),
        ] {
            let p = with(&[("x-death", bad.clone())]);
            assert_eq!(kind_of(&p), None, "{bad:?}");
        }
        assert_eq!(kind_of(&BasicProperties::default()), None);
        assert!(!KINDS.contains(&"unparkable"));
        assert!(KINDS.contains(&"id_conflict"));
    }

    #[test]
    fn replay_headers_convert_json_types_and_drop_the_error_headers() {
        let json = serde_json::json!({
            "trace": "abc",
            "n": 5,
            "neg": -7,
            "flag": true,
            "f": 1.5,
            "big": u64::MAX,
            "nothing": null,
            "list": [1, "a"],
            "obj": {"a": 1},
            "x-death": "FieldArray([...])",
            "x-retries": 3,
            "x-error-kind": "db_permanent",
            "x-error-reason": "boom",
            "x-dlq-attempts": 4,
        });
        let table = replay_headers(&json).unwrap();
        let mut want = FieldTable::default();
        want.insert("trace".into(), long("abc"));
        want.insert("n".into(), AMQPValue::LongLongInt(5));
        want.insert("neg".into(), AMQPValue::LongLongInt(-7));
        want.insert("flag".into(), AMQPValue::Boolean(true));
        want.insert("f".into(), long("1.5"));
        want.insert("big".into(), long("18446744073709551615"));
        // null is what parking writes for a void header: void again.
        want.insert("nothing".into(), AMQPValue::Void);
        want.insert("list".into(), long(r#"[1,"a"]"#));
        want.insert("obj".into(), long(r#"{"a":1}"#));
        want.insert("x-death".into(), long("FieldArray([...])"));
        want.insert("x-retries".into(), AMQPValue::LongLongInt(0));
        assert_eq!(table, want);

        let mut only_retries = FieldTable::default();
        only_retries.insert("x-retries".into(), AMQPValue::LongLongInt(0));
        assert_eq!(
            replay_headers(&serde_json::json!({})).unwrap(),
            only_retries
        );
        assert_eq!(
            replay_headers(&serde_json::Value::Null).unwrap(),
            only_retries
        );
        let err = replay_headers(&serde_json::json!([1]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("JSON object"), "{err}");
        let long_name = serde_json::json!({ "h".repeat(256): 1 });
        let err = replay_headers(&long_name).unwrap_err().to_string();
        assert!(err.contains("256 bytes"), "{err}");
    }

    #[test]
    fn parked_properties_are_persistent_json_with_zero_retries() {
        let none = serde_json::Value::Null;
        let p = parked_properties(Some("m1"), &none).unwrap();
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "m1");
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(headers::retries(&p), headers::Retries::Count(0));
        assert!(
            parked_properties(None, &none)
                .unwrap()
                .message_id()
                .is_none()
        );
        assert!(parked_properties(Some(&"x".repeat(300)), &none).is_err());
    }

    #[test]
    fn a_parked_replay_gives_back_the_originals_properties() {
        let original = lapin::BasicProperties::default()
            .with_message_id("m1".into())
            .with_timestamp(1_700_000_000)
            .with_correlation_id("c".into())
            .with_type("order.created".into())
            .with_app_id("shop".into())
            .with_content_type("text/plain".into());
        // As the router parks it, delivered back from a retry tier through warren's exchange.
        let parked = headers::parked_json(&original, "shop_in", "orders.eu");
        let p = parked_properties(Some("m1"), &parked).unwrap();
        assert_eq!(*p.timestamp(), Some(1_700_000_000));
        assert_eq!(p.correlation_id().as_ref().unwrap().as_str(), "c");
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.created");
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "shop");
        assert_eq!(p.content_type().as_ref().unwrap().as_str(), "text/plain");
        assert_eq!(
            headers::origin(&p, "main_exchange", "main_queue"),
            ("shop_in".into(), "orders.eu".into())
        );
        // Given back as properties, not kept as headers too.
        assert_eq!(headers::text(&p, headers::X_WARREN_TIMESTAMP), None);
        // An original without a timestamp or a content type: its replay carries none either
        // (review R36e F10: the replay's time and application/json were stored as its own).
        let bare = lapin::BasicProperties::default().with_message_id("m2".into());
        let parked = headers::parked_json(&bare, "shop_in", "orders.eu");
        let p = parked_properties(Some("m2"), &parked).unwrap();
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "m2");
        assert_eq!(*p.timestamp(), None);
        assert_eq!(p.content_type(), &None);
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(headers::retries(&p), headers::Retries::Count(0));
    }
}
