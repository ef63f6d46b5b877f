//! Unit tests of `app/pipelines.rs`: the plan of a reload, holds and pauses.

use super::*;

fn with(file: &str) -> Settings {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.toml");
    std::fs::write(&path, file).unwrap();
    let sources = crate::config::Sources {
        use_env: false,
        ..crate::config::Sources::new(Some(path))
    };
    Settings::load(&sources).unwrap()
}

const ORDERS: &str = r#"
[[pipelines]]
name = "orders"
table = "orders"
key = ["id"]
batch_size = 50
[pipelines.columns]
id = { path = "/id", type = "uuid" }
"#;

fn find<'a>(all: &'a [Declared], name: &str) -> &'a Declared {
    all.iter().find(|d| d.name == name).unwrap()
}

#[test]
fn every_pipeline_setting_is_a_setting() {
    let names: Vec<&str> = crate::config::setting_names().map(|(k, _)| k).collect();
    for key in pipeline_settings() {
        assert!(names.contains(&key.as_str()), "{key}");
    }
}

/// [`pipeline_settings`] is exactly the settings that change a pipeline's resolved spec:
/// each setting is given other valid values, one at a time, and the pipelines resolved
/// again. One missing from the list would make a reload that changes it restart-only (and
/// keep running the pipelines' old spec); one listed that changes no pipeline would hide a
/// change that needs a restart.
#[test]
fn the_pipeline_settings_are_those_that_change_a_pipeline() {
    let load = |over: Option<(&str, &str)>| {
        let mut sources = crate::config::Sources {
            use_env: false,
            ..crate::config::Sources::new(None)
        };
        if let Some((key, value)) = over {
            sources = sources.with_override(key, value);
        }
        Settings::load(&sources)
    };
    let base = load(None).unwrap();
    let listed_settings = pipeline_settings();
    let mut missing = Vec::new();
    let mut idle = Vec::new();
    for (key, values) in crate::config::sample_values() {
        let listed = listed_settings.iter().any(|k| k == key);
        let mut loaded = false;
        let mut changes = None;
        for value in &values {
            let Ok(other) = load(Some((key, value))) else {
                continue;
            };
            loaded = true;
            if other.pipelines() != base.pipelines() {
                changes = Some(value.clone());
            }
        }
        assert!(
            loaded,
            "{key}: none of {values:?} loads: give the test a valid one"
        );
        match (listed, changes) {
            (false, Some(value)) => missing.push(format!("{key} (= {value:?})")),
            (true, None) => idle.push(key),
            _ => {}
        }
    }
    assert!(
        missing.is_empty(),
        "settings that change a pipeline's spec but are not in pipeline_settings(): {missing:?}"
    );
    assert!(
        idle.is_empty(),
        "settings in pipeline_settings() that change no pipeline's spec: {idle:?}"
    );
}

/// A pipeline changes with its entry or a setting it reads (its own, or a default it takes),
/// never with the process's settings.
#[test]
fn a_pipeline_changes_with_what_it_reads_only() {
    let before = with(ORDERS);
    let was = declared(&before).unwrap();
    assert_eq!(
        was.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["users", "orders"]
    );
    let again = declared(&with(ORDERS)).unwrap();
    assert!(same(find(&was, "orders"), find(&again, "orders")));
    assert!(same(find(&was, "users"), find(&again, "users")));

    let bigger = declared(&with(&ORDERS.replace("batch_size = 50", "batch_size = 60"))).unwrap();
    assert!(!same(find(&was, "orders"), find(&bigger, "orders")));
    assert!(same(find(&was, "users"), find(&bigger, "users")));

    // A default both read (BATCH_TIMEOUT_MS) changes both; users' own setting users only.
    let timeout = declared(&with(&format!("batch_timeout_ms = 7\n{ORDERS}"))).unwrap();
    assert!(!same(find(&was, "orders"), find(&timeout, "orders")));
    assert!(!same(find(&was, "users"), find(&timeout, "users")));
    let own = declared(&with(&format!("users_batch_timeout_ms = 7\n{ORDERS}"))).unwrap();
    assert!(same(find(&was, "orders"), find(&own, "orders")));
    assert!(!same(find(&was, "users"), find(&own, "users")));

    // The process's settings change no pipeline: they need a restart.
    let listen = with(&format!(
        "http_addr = \"127.0.0.1:1\"\ncontrol_secret = \"s3cret-that-is-long-enough\"\n{ORDERS}"
    ));
    let moved = declared(&listen).unwrap();
    assert!(same(find(&was, "orders"), find(&moved, "orders")));
    assert!(same(find(&was, "users"), find(&moved, "users")));
    assert_eq!(
        restart_needed(&before, &listen),
        ["control_secret", "http_addr"]
    );
    assert!(restart_needed(&before, &with(ORDERS)).is_empty());
    assert!(
        restart_needed(&before, &with("users_batch_size = 3\n")).is_empty(),
        "a pipeline's setting, and the file's pipelines, are no restart's"
    );
}

/// The built-in users entry copied into a file is the pipeline that runs: not changed.
#[test]
fn the_users_entry_written_in_a_file_as_shipped_is_not_a_change() {
    let shipped = crate::config::DEFAULT_TOML
        .split_once(crate::config::pipelines::USERS_MARK)
        .map(|(_, rest)| format!("{}{rest}", crate::config::pipelines::USERS_MARK))
        .unwrap();
    let builtin = declared(&with("")).unwrap();
    let written = declared(&with(&shipped)).unwrap();
    assert!(find(&builtin, "users").spec.builtin && !find(&written, "users").spec.builtin);
    assert!(same(find(&builtin, "users"), find(&written, "users")));
    assert!(same(find(&written, "users"), find(&builtin, "users")));
    // One value other is a change.
    let other = shipped.replace("name = \"users\"", "name = \"users\"\nbatch_size = 7");
    let other = declared(&with(&other)).unwrap();
    assert!(!same(find(&builtin, "users"), find(&other, "users")));
}

/// What the process's HTTP API serves keeps its main queue and tables across a reload (review
/// R35i F5); its `api` keys alone are no change of the pipeline (review R35i F8).
#[test]
fn a_reload_keeps_where_the_api_publishes_and_reads() {
    let api = ORDERS.replace("batch_size = 50", "batch_size = 50\napi = true");
    let was = declared(&with(&api)).unwrap();
    assert_eq!(api_kept(&was, &was), Ok(()));
    let bigger = declared(&with(&api.replace("batch_size = 50", "batch_size = 60"))).unwrap();
    assert_eq!(
        api_kept(&was, &bigger),
        Ok(()),
        "another batch size is fine"
    );
    let refused = |file: &str| {
        api_kept(&was, &declared(&with(file)).unwrap())
            .unwrap_err()
            .to_string()
    };
    let moved = refused(&api.replace("batch_size = 50", "main_queue = \"orders_q2\""));
    assert!(
        moved.contains("this reload moves pipeline orders's main queue from orders_exchange/orders_queue to orders_exchange/orders_q2, but this process's HTTP API serves pipeline orders as it started"),
        "{moved}"
    );
    let table = refused(&api.replace("table = \"orders\"", "table = \"orders2\""));
    assert!(
        table.contains("changes pipeline orders's tables from orders to orders2"),
        "{table}"
    );
    let removed = refused("");
    assert!(
        removed.contains("this reload removes pipeline orders, but"),
        "{removed}"
    );
    // Without the API, all of it is a pipeline's change like another.
    let plain = declared(&with(ORDERS)).unwrap();
    assert_eq!(api_kept(&plain, &declared(&with("")).unwrap()), Ok(()));
    // `api` alone: the same pipeline.
    assert!(same(find(&plain, "orders"), find(&was, "orders")));
}

/// A left queue as it is named, with its move.
fn pairs(left: Vec<Left>) -> Vec<(String, String)> {
    left.into_iter().map(|l| (l.named, l.moved)).collect()
}

/// A reload that leaves a queue no pipeline consumes names it (review R35h F3); one that
/// does not exist on the broker is forgotten (review R39-F15).
#[test]
fn the_queues_a_reload_leaves_are_named() {
    let was = declared(&with(ORDERS)).unwrap();
    assert!(left_queues(was.iter(), &was).is_empty());
    let renamed = declared(&with(&ORDERS.replace(
        "batch_size = 50",
        "main_queue = \"orders_q2\"\nretry_queue = \"orders_r2\"",
    )))
    .unwrap();
    assert_eq!(
        pairs(left_queues(
            was.iter().filter(|d| d.name == "orders"),
            &renamed
        )),
        [
            (
                "orders_retry_10s (orders, retry tier of orders_queue)".to_string(),
                "warren move --from orders_retry_10s --to orders_exchange/orders_q2".to_string()
            ),
            (
                "orders_queue (orders)".to_string(),
                "warren move --from orders_queue --to orders_exchange/orders_q2".to_string()
            )
        ],
        "what waits in the old retry tier dead-letters back to the left main queue: named too \
         (review R38-F5), and moved first (R39-F14)"
    );
    // The retry queue renamed alone: its old tier drains by itself into the main queue,
    // still consumed, and is not named.
    let retry_only = declared(&with(
        &ORDERS.replace("batch_size = 50", "retry_queue = \"orders_r2\""),
    ))
    .unwrap();
    assert!(left_queues(was.iter().filter(|d| d.name == "orders"), &retry_only).is_empty());
    // A pipeline removed whose queues another takes over leaves none.
    let taken = declared(&with(&ORDERS.replace(
        "name = \"orders\"",
        "name = \"orders2\"\nmain_queue = \"orders_queue\"",
    )))
    .unwrap();
    assert_eq!(
        pairs(left_queues(
            was.iter().filter(|d| d.name == "orders"),
            &taken
        )),
        [(
            "orders_dlq (orders)".to_string(),
            "warren move --from orders_dlq --to EXCHANGE/ROUTING_KEY".to_string()
        )]
    );
    let mut report = ReloadReport::default();
    report.leave(left_queues(
        was.iter().filter(|d| d.name == "orders"),
        &renamed,
    ));
    report.forget_absent(&["orders_retry_10s".to_string()]);
    assert_eq!(report.left_queues, ["orders_queue (orders)"]);
    assert_eq!(
        report.moves,
        ["warren move --from orders_queue --to orders_exchange/orders_q2"]
    );
    assert_eq!(report.left_names, ["orders_queue"]);
}

/// A reload never leaves an instance that runs pipelines with none; one that runs none
/// (started with an empty `--pipelines`) reloads as it likes.
#[test]
fn a_reload_to_no_pipeline_is_refused() {
    let one = declared(&with("")).unwrap();
    assert_eq!(refuse_empty(&[], &[]), Ok(()));
    assert_eq!(refuse_empty(&["users"], &one), Ok(()));
    assert_eq!(refuse_empty(&[], &one), Ok(()));
    let refused = refuse_empty(&["users", "orders"], &[]).unwrap_err();
    assert!(
        refused.to_string().contains("keeps running users, orders")
            && refused.to_string().contains("warren ctl drain"),
        "{refused}"
    );
}

#[test]
fn holds_are_two_layers() {
    let mut holds = Holds::default();
    holds.pipelines.insert("orders".into());
    assert!(holds.holds("orders") && !holds.holds("users"));
    holds.all = true;
    assert!(holds.holds("orders") && holds.holds("users"));
    holds.all = false;
    assert!(
        holds.holds("orders"),
        "lifting the instance's pause leaves a pipeline's own"
    );
}

#[test]
fn a_report_names_what_changed() {
    let report = ReloadReport {
        added: vec!["orders".into()],
        changed: vec!["users".into(), "audit".into()],
        unchanged: vec!["refunds".into()],
        restart_needed: vec!["amqp_url".into()],
        drained: true,
        ..ReloadReport::default()
    };
    assert_eq!(
        report.summary(),
        "added orders; changed users, audit; unchanged refunds; needs a restart to apply amqp_url"
    );
    let nothing = ReloadReport {
        drained: true,
        ..ReloadReport::default()
    };
    assert_eq!(nothing.summary(), "no pipeline changed");
    let late = ReloadReport {
        removed: vec!["orders".into()],
        ..ReloadReport::default()
    };
    assert_eq!(
        late.summary(),
        "removed orders; a stopped stage reached SHUTDOWN_TIMEOUT_MS: what it had not settled \
         went back to its queue"
    );
}

/// Review R44 F9: a reload refused for many problems says the first five in full, then how
/// many more and where to see them all; a single line is capped too.
#[test]
fn a_refusal_for_many_problems_is_one_short_line() {
    let many: Vec<String> = (0..3000)
        .map(|i| format!("w.toml: pipeline p{i}: table shop.t{i} does not exist"))
        .collect();
    let line = ReloadError::Prepare(many.join("\n")).one_line().to_string();
    assert!(line.len() < 2048, "{} bytes: {line}", line.len());
    assert!(line.contains("pipeline p4: table"), "{line}");
    assert!(!line.contains("pipeline p5:"), "{line}");
    assert!(
        line.contains("and 2995 more") && line.contains("warren declare --dry-run"),
        "{line}"
    );
    let long = ReloadError::Config("x".repeat(40_000))
        .one_line()
        .to_string();
    assert!(long.len() < 2048, "{} bytes", long.len());
}

/// Review R44 F1: the advice to move a queue a reload left says to wait for the old stage's
/// link to end when its acks were not proven handled (an unanswered close, a link gone), or a
/// move republishes what it already stored; only then.
#[test]
fn the_advice_to_move_a_left_queue_warns_of_unproven_acks_only_then() {
    let mut report = ReloadReport {
        removed: vec!["orders".into()],
        left_queues: vec!["orders_queue (orders)".into()],
        moves: vec!["warren move --from orders_queue --to EXCHANGE/ROUTING_KEY".into()],
        left_names: vec!["orders_queue".into()],
        drained: true,
        acks_unproven: true,
        ..ReloadReport::default()
    };
    let summary = report.summary();
    assert!(
        summary.contains("warren move --from orders_queue")
            && summary.contains("did not answer its close")
            && summary.contains("AMQP_HEARTBEAT_S"),
        "{summary}"
    );
    report.acks_unproven = false;
    let summary = report.summary();
    assert!(
        summary.contains("warren move --from orders_queue")
            && !summary.contains("AMQP_HEARTBEAT_S"),
        "{summary}"
    );
}

/// The running set of `settings` (roles `api`: no stage starts, nothing connects) and what a
/// reload to `next` plans.
async fn planned(settings: Settings, next: Settings) -> Result<Plan, ReloadError> {
    let pool = crate::db::pool(&settings.database()).unwrap();
    let (decisions, _) = mpsc::unbounded_channel();
    let (records, _) = watch::channel(Vec::new());
    let running = declared(&settings).unwrap();
    let pipelines = Pipelines::start(
        settings,
        running,
        pool,
        Depths::default(),
        decisions,
        records,
    );
    let loaded = Loaded {
        wanted: declared(&next).unwrap(),
        next,
        restart: Vec::new(),
    };
    pipelines.plan(loaded)
}

const ORDERS_DELETES: &str = r#"
roles = "api"
[[pipelines]]
name = "orders"
table = "orders"
key = ["id"]
on_conflict = "update"
version_column = "version"
delete = { field = "/op", value = "delete" }
[pipelines.columns]
id = { path = "/id", type = "uuid" }
version = { path = "/version", type = "int8" }
"#;

/// Review R44 F7: a reload renaming a pipeline with deletes says what the old name leaves: its
/// tombstones, in a table the new name does not read, and its parked messages, filed under
/// the old name.
#[tokio::test]
async fn a_reload_renaming_a_pipeline_with_deletes_says_what_the_old_name_leaves() {
    let renamed = ORDERS_DELETES.replace(r#"name = "orders""#, r#"name = "sales""#);
    let plan = planned(with(ORDERS_DELETES), with(&renamed)).await.unwrap();
    assert_eq!(plan.report.removed, ["orders"]);
    let summary = plan.report.summary();
    assert!(
        summary.contains("public.tombstones_orders") && summary.contains("sales"),
        "{summary}"
    );
    assert!(
        summary.contains("parked") && summary.contains("--pipeline orders"),
        "{summary}"
    );
}

/// Review R44 F10: a reload adding a pipeline with `api = true` on an instance that runs the
/// API says in its answer that the API serves it only after a restart (its routes answer 404
/// until then).
#[tokio::test]
async fn a_reload_adding_a_pipeline_with_the_api_says_it_waits_for_a_restart() {
    let with_api = format!(
        "roles = \"api\"\n{}",
        ORDERS.replace("batch_size = 50", "batch_size = 50\napi = true")
    );
    let base = with("roles = \"api\"\n");
    let plan = planned(base, with(&with_api)).await.unwrap();
    assert_eq!(plan.report.added, ["orders"]);
    let summary = plan.report.summary();
    assert!(
        summary.contains("until a restart: /api/v1/orders answers 404 until then"),
        "{summary}"
    );
}
