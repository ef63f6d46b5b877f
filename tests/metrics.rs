//! The Prometheus metrics and the Grafana dashboard: exact counts after a run with known
//! outcomes, `promtool check metrics` on a real scrape, and a dashboard (grafana/) that is valid,
//! reaches its datasource through a variable on every panel, and queries only series warren
//! exports.
//!
//! promtool comes from Debian's `prometheus` package (`scripts/test.sh` installs it through
//! `scripts/setup.sh --with-promtool`); without it the tests that need it fail and say so.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use serde_json::Value;
use uuid::Uuid;

// ---- waits and checks on the scrape (`Scrape` is the harness's) ------------------------------

/// Waits until the env's `users` table holds `n` rows; panics with the queues and warren's log.
async fn wait_rows(env: &TestEnv, warren: &Warren, n: i64, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while env.count_rows().await != n {
        if std::time::Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for {n} rows (have {}; main {:?}, retry {:?}, \
                 dlq {:?}); log:\n{}",
                env.count_rows().await,
                env.queue_state(&env.main_queue).await,
                env.queue_state(&env.retry_queue).await,
                env.queue_state(&env.dlq_queue).await,
                warren.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the scrape has a `warren_queue_messages` sample for each of the env's queues.
fn has_queue_gauges(s: &Scrape, env: &TestEnv) -> bool {
    [&env.main_queue, &env.retry_queue, &env.dlq_queue]
        .iter()
        .all(|q| {
            s.one("warren_queue_messages", &[("queue", q.as_str())])
                .is_some()
        })
}

// ---- promtool --------------------------------------------------------------------------------

/// `promtool`, which must be installed: a missing promtool is a failure, never a skip.
fn promtool() -> Command {
    match Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(_) => Command::new("promtool"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool is not installed: run `apt-get install prometheus` \
             (Debian's package ships promtool; scripts/test.sh installs it through \
             `scripts/setup.sh --with-promtool`)"
        ),
        Err(e) => panic!("cannot run promtool: {e}"),
    }
}

/// Runs `promtool args...` with `stdin`; (success, stdout + stderr).
fn run_promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = promtool()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    {
        let mut input = child.stdin.take().expect("promtool stdin");
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).expect("write to promtool");
        }
    }
    let out = child.wait_with_output().expect("promtool output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

// ---- the dashboard ---------------------------------------------------------------------------

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo_path(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

const DASHBOARD: &str = "grafana/dashboards/warren.json";
const DATASOURCE: &str = "grafana/provisioning/datasources/prometheus.yml";
const PROVIDER: &str = "grafana/provisioning/dashboards/warren.yml";
const PROMETHEUS_CONFIG: &str = "grafana/prometheus.yml";

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not valid JSON: {e}"))
}

/// The value of every `key: value` line of a small YAML file (quotes removed).
fn yaml_values(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.trim().trim_start_matches("- ").trim())
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| {
            v.split(" #")
                .next()
                .unwrap_or("")
                .trim()
                .trim_matches(|c| c == '"' || c == '\'')
                .to_string()
        })
        .collect()
}

/// The uid of the provisioned Prometheus datasource.
fn provisioned_uid() -> String {
    let text = read(DATASOURCE);
    let uids = yaml_values(&text, "uid");
    assert_eq!(
        uids.len(),
        1,
        "{DATASOURCE} must provision one datasource uid"
    );
    assert_eq!(
        yaml_values(&text, "type"),
        vec!["prometheus".to_string()],
        "{DATASOURCE}: the datasource is of type prometheus"
    );
    assert!(!uids[0].is_empty(), "{DATASOURCE}: empty uid");
    uids[0].clone()
}

/// Every panel, nested ones (inside rows) included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            if let Some(nested) = p.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Every PromQL query of the dashboard, with where it is: panel targets and query variables.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                out.push((
                    format!("panel {} target {}", p["title"], t["refId"]),
                    expr.to_string(),
                ));
            }
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let q = v["query"]["query"].as_str().or(v["query"].as_str());
        if let (Some(q), Some("query")) = (q, v["type"].as_str()) {
            out.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    out
}

/// The identifiers starting with `warren_` in a PromQL expression (metric names; warren uses
/// no such label names).
fn warren_identifiers(expr: &str) -> BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = BTreeSet::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts = (i == 0 || !ident(bytes[i - 1]))
            && bytes[i..].iter().take(7).collect::<String>() == "warren_";
        if starts {
            let end = (i..bytes.len())
                .find(|&j| !ident(bytes[j]))
                .unwrap_or(bytes.len());
            out.insert(bytes[i..end].iter().collect());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// Grafana's variables replaced by concrete values, so promtool can parse the expression.
fn concrete(expr: &str) -> String {
    let e = expr
        .replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$instance", ".*")
        .replace("$pipeline", ".*")
        .replace("$stage", ".*")
        .replace("$job", "warren");
    assert!(!e.contains('$'), "unknown Grafana variable in {expr:?}");
    e
}

/// Whether the scrape's families explain `name`: a counter or gauge family of that name, or
/// `<histogram>_bucket|_sum|_count`. Returns why not otherwise.
fn exported(types: &BTreeMap<String, String>, name: &str) -> Result<(), String> {
    match types.get(name).map(String::as_str) {
        Some("histogram") | Some("summary") => {
            return Err(format!(
                "{name} is a {}: query {name}_bucket, {name}_sum or {name}_count",
                types[name]
            ));
        }
        Some(_) => return Ok(()),
        None => {}
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            return match types.get(base).map(String::as_str) {
                Some("histogram") => Ok(()),
                Some("summary") if suffix != "_bucket" => Ok(()),
                Some(other) => Err(format!("{base} is a {other}, it has no {suffix} series")),
                None => Err(format!("{name}: warren exports no family {base}")),
            };
        }
    }
    Err(format!("{name}: warren exports no such family"))
}

// ---- a warren that has done a bit of everything ------------------------------------------------

/// Starts `warren run` with every role and makes it do a bit of everything the dashboard shows:
/// API requests (200, 422, 400, 404), valid and invalid messages with and without timestamps
/// (inserted, dead-lettered, parked by the DLQ consumer), and a database outage that sends
/// messages through the retry queue and opens, then closes, the breaker. Returns the warren and
/// its scrape once it has polled the queues.
async fn busy_warren(env: &mut TestEnv) -> (Warren, Scrape) {
    env.set("RETRY_TTL_MS", "1000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1");
    env.declare();
    let warren = env.start(&["--roles", "consumer,dlq,api"]);
    wait_until("/readyz answers 200", Duration::from_secs(30), || async {
        matches!(http(env, "GET", "/readyz", None).await, Some((200, _)))
    })
    .await;

    // The API: one user through the broker, a 422, a 400, a 404 and the health checks.
    let (status, body) = http(
        env,
        "POST",
        "/api/v1/users",
        Some(r#"{"name":"Metrics Ana","email":"metrics-ana@example.com"}"#),
    )
    .await
    .expect("POST answers");
    assert_eq!(status, 200, "POST /api/v1/users: {body}");
    let id = serde_json::from_str::<Value>(&body).expect("JSON answer")["id"]
        .as_str()
        .expect("an id")
        .to_string();
    let (status, _) = http(env, "POST", "/api/v1/users", Some(r#"{"name":""}"#))
        .await
        .expect("POST answers");
    assert_eq!(status, 422);
    let (status, _) = http(env, "GET", "/api/v1/users/not-a-uuid", None)
        .await
        .expect("GET answers");
    assert_eq!(status, 400);
    let (status, _) = http(env, "GET", "/no/such/route", None)
        .await
        .expect("GET answers");
    assert_eq!(status, 404);
    let (status, _) = http(env, "GET", "/healthz", None)
        .await
        .expect("GET answers");
    assert_eq!(status, 200);

    // Messages: `warren publish` (timestamped, every 5th invalid) and the harness's users.
    let (code, out, err) = env.run(&["publish", "--count", "20", "--invalid-every", "5"]);
    assert_eq!(code, 0, "warren publish failed:\n{out}\n{err}");
    env.publish_users(10).await;
    wait_rows(env, &warren, 1 + 16 + 10, Duration::from_secs(30)).await;
    let path = format!("/api/v1/users/{id}");
    let (status, _) = http(env, "GET", &path, None).await.expect("GET answers");
    assert_eq!(status, 200, "GET {path}");
    wait_scrape(
        env,
        &warren,
        "the 4 invalid messages parked by the DLQ consumer",
        Duration::from_secs(30),
        |s| s.sum("warren_messages_parked_total", &[]) == 4.0,
    )
    .await;

    // An outage: the batch fails, goes to the retry queue, the breaker opens; then it clears.
    install_fault(env, CountAttempts::No).await;
    env.publish_users(3).await;
    wait_scrape(
        env,
        &warren,
        "the breaker open",
        Duration::from_secs(30),
        |s| {
            s.one(
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", "main")],
            ) == Some(1.0)
        },
    )
    .await;
    clear_fault(env).await;
    wait_rows(env, &warren, 1 + 16 + 10 + 3, Duration::from_secs(60)).await;
    let s = wait_scrape(
        env,
        &warren,
        "the breaker closed, retries counted, queue gauges polled",
        Duration::from_secs(30),
        |s| {
            s.one(
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", "main")],
            ) == Some(0.0)
                && s.sum("warren_messages_retried_total", &[]) >= 1.0
                && has_queue_gauges(s, env)
        },
    )
    .await;
    (warren, s)
}

// ---- tests -----------------------------------------------------------------------------------

/// 50 valid users, 3 bodies that are not JSON, 2 invalid payloads and 2 messages reusing the
/// email of another message of the same batch, through `--roles consumer`: the scrape shows
/// exactly received 57, inserted 50, dead-lettered 3 invalid_json + 2 invalid_payload +
/// 2 db_permanent, nothing retried, the build info and the env's queue gauges.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_with_known_outcomes_shows_exactly_those_counts() {
    let mut env = TestEnv::new("metrics_counts").await;
    // One batch: every message is in the queue before warren starts, one batcher, 2 s timer.
    env.set("USERS_BATCH_SIZE", "1000")
        .set("USERS_BATCH_CONCURRENCY", "1")
        .set("USERS_BATCH_TIMEOUT_MS", "2000")
        .set("USERS_BATCH_MIN_WAIT_MS", "2000");
    env.declare();

    let ids = env.publish_users(50).await;
    let not_json: [&[u8]; 3] = [b"{not json", b"  nope", &[0xff, 0xfe, 0xfd]];
    for body in not_json {
        env.publish_raw(body, BasicProperties::default()).await;
    }
    let invalid_payloads = [
        format!(
            r#"{{"id":"{}","name":"","email":"empty-name@example.com"}}"#,
            Uuid::new_v4()
        ),
        format!(r#"{{"id":"{}","name":"No Email"}}"#, Uuid::new_v4()),
    ];
    for body in &invalid_payloads {
        env.publish_raw(body.as_bytes(), BasicProperties::default())
            .await;
    }
    // Two valid messages whose emails belong to two of the 50 users (same batch): the
    // database refuses one of each pair (23505), isolated as db_permanent.
    for original in [ids[3], ids[40]] {
        let id = Uuid::new_v4();
        let body = format!(r#"{{"id":"{id}","name":"dup {id}","email":"{original}@example.com"}}"#);
        env.publish_raw(body.as_bytes(), json_props(id)).await;
    }
    assert_eq!(env.queue_state(&env.main_queue).await.0, 57);

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_rows(&env, &warren, 50, Duration::from_secs(60)).await;
    wait_until("7 messages in the DLQ", Duration::from_secs(30), || async {
        env.queue_state(&env.dlq_queue).await.0 == 7
    })
    .await;
    // Settled (in flight back to 0: every count is made before its delivery settles), and the
    // queue poller (every 5 s) has seen the final depths.
    let (main_q, retry_q, dlq_q) = (
        env.main_queue.as_str(),
        env.retry_queue.as_str(),
        env.dlq_queue.as_str(),
    );
    let s = wait_scrape(
        &env,
        &warren,
        "nothing in flight and the queue gauges at main 0, retry 0, DLQ 7",
        Duration::from_secs(30),
        |s| {
            s.one("warren_inflight_messages", &[]) == Some(0.0)
                && s.one("warren_queue_messages", &[("queue", main_q)]) == Some(0.0)
                && s.one("warren_queue_messages", &[("queue", retry_q)]) == Some(0.0)
                && s.one("warren_queue_messages", &[("queue", dlq_q)]) == Some(7.0)
        },
    )
    .await;
    let ctx = format!("scrape:\n{}\nlog:\n{}", s.text, warren.logs());

    assert_eq!(
        s.one(
            "warren_messages_received_total",
            &[("pipeline", "users"), ("stage", "main")]
        ),
        Some(57.0),
        "received; {ctx}"
    );
    assert_eq!(
        s.sum(
            "warren_messages_received_total",
            &[("pipeline", "users"), ("stage", "dlq")]
        ),
        0.0,
        "no DLQ consumer runs; {ctx}"
    );
    assert_eq!(
        s.one(
            "warren_messages_inserted_total",
            &[("pipeline", "users"), ("stage", "main")]
        ),
        Some(50.0),
        "inserted; {ctx}"
    );
    let dead = |kind: &str| {
        s.one(
            "warren_messages_dead_lettered_total",
            &[("pipeline", "users"), ("stage", "main"), ("kind", kind)],
        )
    };
    assert_eq!(dead("invalid_json"), Some(3.0), "invalid_json; {ctx}");
    assert_eq!(dead("invalid_payload"), Some(2.0), "invalid_payload; {ctx}");
    assert_eq!(dead("db_permanent"), Some(2.0), "db_permanent; {ctx}");
    assert_eq!(
        s.sum("warren_messages_dead_lettered_total", &[]),
        7.0,
        "no other kind; {ctx}"
    );
    assert_eq!(
        s.sum("warren_messages_retried_total", &[]),
        0.0,
        "retried (0 or absent); {ctx}"
    );
    assert_eq!(s.sum("warren_messages_parked_total", &[]), 0.0, "{ctx}");
    assert_eq!(
        s.sum("warren_messages_received_total", &[]),
        s.sum("warren_messages_inserted_total", &[])
            + s.sum("warren_messages_dead_lettered_total", &[])
            + s.sum("warren_messages_retried_total", &[]),
        "every delivery is inserted, dead-lettered or retried; {ctx}"
    );
    // One batch of the 52 valid messages (50 users + the 2 duplicates).
    assert_eq!(
        (
            s.one(
                "warren_batch_size_count",
                &[("pipeline", "users"), ("stage", "main")]
            ),
            s.one(
                "warren_batch_size_sum",
                &[("pipeline", "users"), ("stage", "main")]
            ),
        ),
        (Some(1.0), Some(52.0)),
        "batch count and size; {ctx}"
    );
    assert_eq!(
        s.one(
            "warren_batch_insert_seconds_count",
            &[("pipeline", "users"), ("stage", "main")]
        ),
        Some(1.0),
        "{ctx}"
    );
    // The build info: one series, value 1, this crate's version.
    assert_eq!(
        s.one(
            "warren_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0),
        "warren_build_info; {ctx}"
    );
    assert_eq!(s.matching("warren_build_info", &[]).count(), 1, "{ctx}");
    // Queue gauges for exactly the env's queues, consumers included.
    let expected: BTreeSet<String> = [main_q, retry_q, dlq_q].map(String::from).into();
    assert_eq!(
        s.label_values("warren_queue_messages", "queue"),
        expected,
        "{ctx}"
    );
    assert_eq!(
        s.label_values("warren_queue_consumers", "queue"),
        expected,
        "{ctx}"
    );
    assert_eq!(
        s.one("warren_queue_consumers", &[("queue", main_q)]),
        Some(1.0),
        "warren consumes the main queue; {ctx}"
    );
    for target in ["amqp", "postgres", "redis"] {
        assert_eq!(
            s.one("warren_connection_up", &[("target", target)]),
            Some(1.0),
            "connection {target}; {ctx}"
        );
    }

    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
}

/// `promtool check metrics` accepts a scrape of a warren that has done a bit of everything
/// (every family present: counters, gauges, histograms with and without labels).
#[tokio::test(flavor = "multi_thread")]
async fn promtool_accepts_the_scrape() {
    let _ = promtool(); // fail first, and fast, if promtool is missing
    let mut env = TestEnv::new("metrics_promtool").await;
    let (mut warren, s) = busy_warren(&mut env).await;
    let (ok, report) = run_promtool(&["check", "metrics"], Some(&s.text));
    assert!(
        ok,
        "promtool check metrics refused the scrape:\n{report}\nscrape:\n{}",
        s.text
    );
    // The scrape is not trivially small: the families the dashboard relies on are all there.
    for family in [
        "warren_messages_received_total",
        "warren_messages_retried_total",
        "warren_batch_size",
        "warren_end_to_end_seconds",
        "warren_http_request_seconds",
        "warren_breaker_open",
    ] {
        assert!(
            s.types.contains_key(family),
            "{family} missing from the scrape:\n{}",
            s.text
        );
    }
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// The Grafana files: valid JSON with a uid, the data source variable on every panel, target
/// and query variable, the panels docs/metrics.md promises, PromQL that parses, and a
/// Prometheus scrape config that `promtool check config` accepts.
#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_and_provisioning_are_valid() {
    // Touches no shared state (no server), but keeps the suite's convention of one env per test.
    let _env = TestEnv::new("metrics_dashboard_files").await;
    // The provisioned datasource is valid; panels, targets and variables reach it through the
    // dashboard's data source variable, whose default is its uid (tests/dashboard.rs).
    provisioned_uid();
    let uid = "${DS_PROMETHEUS}".to_string();
    let provider = read(PROVIDER);
    assert_eq!(
        yaml_values(&provider, "type"),
        vec!["file".to_string()],
        "{PROVIDER}: a file provider"
    );
    let paths = yaml_values(&provider, "path");
    assert!(
        paths.len() == 1 && paths[0].starts_with('/'),
        "{PROVIDER}: one absolute dashboards path, got {paths:?}"
    );

    let d = dashboard();
    assert_eq!(d["uid"].as_str(), Some("warren"), "dashboard uid");
    assert!(
        d["title"].as_str().is_some_and(|t| !t.is_empty()),
        "dashboard title"
    );
    assert!(
        d["id"].is_null(),
        "a provisioned dashboard carries no numeric id"
    );
    let all = panels(&d);
    assert!(!all.is_empty(), "no panels");
    let mut panel_ids = HashSet::new();
    for p in &all {
        let title = &p["title"];
        assert!(
            panel_ids.insert(p["id"].as_i64().expect("panel id")),
            "duplicate panel id {}",
            p["id"]
        );
        if p["type"] == "row" {
            continue;
        }
        assert!(p["gridPos"].is_object(), "panel {title} has no gridPos");
        assert_eq!(
            p["datasource"]["uid"].as_str(),
            Some(uid.as_str()),
            "panel {title}: datasource"
        );
        assert_eq!(p["datasource"]["type"].as_str(), Some("prometheus"));
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} has no target");
        for t in targets {
            assert_eq!(
                t["datasource"]["uid"].as_str(),
                Some(uid.as_str()),
                "panel {title} target {}: datasource",
                t["refId"]
            );
            assert!(
                t["expr"].as_str().is_some_and(|e| !e.trim().is_empty()),
                "panel {title} target {}: no expr",
                t["refId"]
            );
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] == "query" {
            assert_eq!(
                v["datasource"]["uid"].as_str(),
                Some(uid.as_str()),
                "variable {}: datasource",
                v["name"]
            );
        }
    }

    // The panels docs/metrics.md promises, by what they query.
    let exprs: Vec<String> = queries(&d).into_iter().map(|(_, e)| e).collect();
    let uses = |needle: &str| exprs.iter().any(|e| e.contains(needle));
    for needle in [
        "rate(warren_messages_received_total",
        "rate(warren_messages_inserted_total",
        "rate(warren_messages_retried_total",
        "rate(warren_messages_dead_lettered_total",
        "warren_queue_messages",
        "warren_batch_size_bucket",
        "warren_batch_insert_seconds_bucket",
        "warren_connection_up",
        "warren_build_info",
        "warren_published_total",
        "warren_breaker_open",
        "warren_http_requests_total",
    ] {
        assert!(uses(needle), "no panel queries {needle}");
    }
    assert!(
        exprs.iter().any(|e| {
            e.contains("rate(warren_messages_inserted_total")
                && e.contains("/")
                && e.contains("rate(warren_messages_received_total")
        }),
        "no success ratio (inserted / received)"
    );
    for q in ["0.5", "0.95", "0.99"] {
        assert!(
            exprs.iter().any(|e| {
                e.contains(&format!("histogram_quantile({q},"))
                    && e.contains("warren_end_to_end_seconds_bucket")
            }),
            "no end-to-end p{q} panel"
        );
    }

    // Every query parses as PromQL: promtool checks them as recording rules.
    let mut rules = String::from("groups:\n  - name: warren_dashboard\n    rules:\n");
    for (i, (_, e)) in queries(&d).iter().enumerate() {
        let expr = concrete(e);
        if expr.starts_with("label_values(") {
            continue; // a Grafana function, not PromQL
        }
        rules += &format!(
            "      - record: warren_dashboard:query_{i}\n        expr: {}\n",
            Value::String(expr)
        );
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let rules_file = dir.path().join("dashboard-rules.yml");
    std::fs::write(&rules_file, &rules).expect("write rules");
    let (ok, report) = run_promtool(
        &["check", "rules", rules_file.to_str().expect("utf-8 path")],
        None,
    );
    assert!(
        ok,
        "a dashboard query is not valid PromQL:\n{report}\n{rules}"
    );

    // The example scrape config.
    let config = read(PROMETHEUS_CONFIG);
    assert_eq!(yaml_values(&config, "job_name"), vec!["warren".to_string()]);
    assert!(
        config.contains("127.0.0.1:9898"),
        "{PROMETHEUS_CONFIG}: default target"
    );
    let (ok, report) = run_promtool(
        &[
            "check",
            "config",
            repo_path(PROMETHEUS_CONFIG).to_str().expect("utf-8 path"),
        ],
        None,
    );
    assert!(ok, "promtool check config {PROMETHEUS_CONFIG}:\n{report}");
}

/// Every metric name in every query of the dashboard is one a running warren exports: a
/// counter or gauge family of its scrape, or a histogram family's _bucket/_sum/_count.
#[tokio::test(flavor = "multi_thread")]
async fn every_dashboard_metric_is_exported_by_a_running_warren() {
    let mut env = TestEnv::new("metrics_dashboard_names").await;
    let d = dashboard();
    let (mut warren, s) = busy_warren(&mut env).await;

    let mut used = BTreeSet::new();
    let mut problems = Vec::new();
    for (place, expr) in queries(&d) {
        for name in warren_identifiers(&expr) {
            if let Err(why) = exported(&s.types, &name) {
                problems.push(format!("{place}: {why}\n    {expr}"));
            }
            used.insert(name);
        }
    }
    assert!(
        problems.is_empty(),
        "the dashboard queries series warren does not export:\n{}\nfamilies in the scrape: {:?}",
        problems.join("\n"),
        s.types
    );
    assert!(used.len() >= 15, "suspiciously few metric names: {used:?}");
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// The breaker gauge of each running pipeline is exported from the start (0, closed), so the
/// dashboard's breaker panels and alerts see "closed" instead of no data before the first
/// outage.
#[tokio::test(flavor = "multi_thread")]
async fn the_breaker_gauge_is_exported_closed_from_the_start() {
    let env = TestEnv::new("metrics_breaker_initial").await;
    env.declare();
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let s = wait_scrape(
        &env,
        &warren,
        "warren up: connected to the broker, queues polled",
        Duration::from_secs(30),
        |s| {
            s.one("warren_connection_up", &[("target", "amqp")]) == Some(1.0)
                && has_queue_gauges(s, &env)
        },
    )
    .await;
    for stage in ["main", "dlq"] {
        assert_eq!(
            s.one(
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", stage)]
            ),
            Some(0.0),
            "warren_breaker_open{{pipeline=\"users\",stage=\"{stage}\"}} should be exported as 0 from the \
             start (a state gauge with no series reads as no data before the first outage); \
             scrape:\n{}",
            s.text
        );
    }
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// An instance that runs only the API (its broker link is the publisher's) reports
/// `warren_connection_up{target="amqp"}` 1 once it is connected, like a consumer does; otherwise
/// the dashboard shows the broker down on every API-only host.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_only_instance_reports_its_broker_connection_up() {
    let env = TestEnv::new("metrics_api_amqp_up").await;
    env.declare();
    let mut warren = env.start(&["--roles", "api"]);
    wait_until(
        "/readyz 200 (broker and database answer)",
        Duration::from_secs(30),
        || async { matches!(http(&env, "GET", "/readyz", None).await, Some((200, _))) },
    )
    .await;
    let (status, body) = http(
        &env,
        "POST",
        "/api/v1/users",
        Some(r#"{"name":"Up Ana","email":"up-ana@example.com"}"#),
    )
    .await
    .expect("POST answers");
    assert_eq!(
        status, 200,
        "a publish through the connected broker: {body}"
    );
    wait_scrape(
        &env,
        &warren,
        "warren_connection_up{target=\"amqp\"} 1 on an API-only instance whose publisher is \
         connected (readyz says broker true, a publish was confirmed)",
        Duration::from_secs(15),
        |s| {
            s.one("warren_connection_up", &[("target", "postgres")]) == Some(1.0)
                && s.one("warren_connection_up", &[("target", "amqp")]) == Some(1.0)
        },
    )
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// The scrape parser itself (it decides what every other test sees).
#[test]
fn the_scrape_parser_reads_labels_values_and_types() {
    let s = Scrape::parse(
        "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"z\"} 3\n\
         # TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.5\nh_count 2\nb 1e3\n"
            .to_string(),
    );
    assert_eq!(s.one("a_total", &[("x", "1"), ("y", "q\"z")]), Some(3.0));
    assert_eq!(s.one("h_bucket", &[("le", "+Inf")]), Some(2.0));
    assert_eq!(s.sum("b", &[]), 1000.0);
    assert_eq!(s.types["h"], "histogram");
    assert!(exported(&s.types, "h_bucket").is_ok());
    assert!(exported(&s.types, "h").is_err());
    assert!(exported(&s.types, "a_total_count").is_err());
    assert_eq!(
        warren_identifiers("sum(rate(warren_x_total{a=\"warren\"}[1m])) / xwarren_y"),
        BTreeSet::from(["warren_x_total".to_string()])
    );
}

// ---- one label scheme for every pipeline's stages ----------------------------------------------

/// The per-pipeline series as docs/metrics.md lists them (a row whose labels name `pipeline`),
/// each with whether its labels also name `stage`.
fn documented_per_pipeline_series() -> Vec<(String, bool)> {
    read("docs/metrics.md")
        .lines()
        .filter(|l| l.starts_with("| `warren_"))
        .filter_map(|l| {
            let cols: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cols.get(1)?.trim_matches('`').to_string();
            let labels = cols.get(3)?;
            labels
                .contains("`pipeline`")
                .then(|| (name, labels.contains("`stage`")))
        })
        .collect()
}

/// A warren running users and a configured `orders` pipeline, both stages each, labels every
/// per-pipeline series the same way: `pipeline` the pipeline's name, `stage` `main` or `dlq`.
/// Every sample with a `pipeline` label has a `stage` one (no stage name such as `main` or
/// `orders_dlq` in `pipeline`), and every series docs/metrics.md lists with `pipeline` is there
/// for each stage of both pipelines (the main stages' own, concurrency and balancing, for the
/// main stages). Valid messages published to each DLQ directly give the DLQ stages a batch too.
#[tokio::test(flavor = "multi_thread")]
async fn every_per_pipeline_series_carries_the_pipeline_and_its_stage() {
    let env = TestEnv::new("m_stages").await;
    env.declare();
    let orders = PipelineNames::of(&env, "orders");
    let _cleanup = orders.cleanup();
    env.db
        .batch_execute("CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL)")
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    let config = format!(
        "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
         batch_timeout_ms = 100\nretry_ttls_ms = [1000]\n{}\n[pipelines.columns]\n\
         order_id = {{ path = \"/id\", type = \"uuid\" }}\n\
         total = {{ path = \"/total\", type = \"numeric\" }}\n",
        orders.toml()
    );
    std::fs::write(&path, config).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let mut warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let order = |id: Uuid| format!(r#"{{"id":"{id}","total":"1.5"}}"#).into_bytes();
    let persistent = || BasicProperties::default().with_delivery_mode(2);
    for _ in 0..3 {
        let (user, dlq_user) = (Uuid::new_v4(), Uuid::new_v4());
        env.publish_raw(&user_body(user), json_props(user)).await;
        env.publish_to_dlq(&user_body(dlq_user), json_props(dlq_user))
            .await;
        let (o, dlq_o) = (Uuid::new_v4(), Uuid::new_v4());
        env.publish_to(&orders.exchange, &orders.queue, &order(o), persistent())
            .await;
        env.publish_to(&orders.dlx, &orders.dlq, &order(dlq_o), persistent())
            .await;
    }

    let stages = [
        ("users", "main"),
        ("users", "dlq"),
        ("orders", "main"),
        ("orders", "dlq"),
    ];
    let documented = documented_per_pipeline_series();
    assert!(
        documented.len() >= 10,
        "docs/metrics.md lists the per-pipeline series: {documented:?}"
    );
    for (name, with_stage) in &documented {
        assert!(
            with_stage,
            "docs/metrics.md: {name} has a pipeline label but no stage label"
        );
    }
    // A histogram's samples are `<name>_count` and friends; a stage's own are there for every
    // stage, the main stages' concurrency and its decisions for the main stages only.
    let sample_name = |name: &str, s: &Scrape| {
        if s.types.get(name).map(String::as_str) == Some("histogram") {
            format!("{name}_count")
        } else {
            name.to_string()
        }
    };
    let main_only = |name: &str| {
        name == "warren_pipeline_concurrency" || name == "warren_balance_decisions_total"
    };
    let missing = |s: &Scrape| -> Vec<String> {
        let mut missing = Vec::new();
        for (name, _) in &documented {
            let sample = sample_name(name, s);
            for (pipeline, stage) in stages {
                if stage == "dlq" && main_only(name) {
                    continue;
                }
                let labels = [("pipeline", pipeline), ("stage", stage)];
                if s.matching(&sample, &labels).next().is_none() {
                    missing.push(format!("{sample}{{pipeline={pipeline:?},stage={stage:?}}}"));
                }
            }
        }
        missing
    };
    let inserted = |s: &Scrape, pipeline: &str, stage: &str| {
        s.one(
            "warren_messages_inserted_total",
            &[("pipeline", pipeline), ("stage", stage)],
        )
    };
    let s = wait_scrape(
        &env,
        &warren,
        "every per-pipeline series for every stage of users and orders, 3 rows by each stage",
        Duration::from_secs(60),
        |s| {
            missing(s).is_empty()
                && stages
                    .iter()
                    .all(|(p, stage)| inserted(s, p, stage) == Some(3.0))
        },
    )
    .await;

    // No sample names a stage in `pipeline`, nor lacks `stage`.
    let bad: Vec<String> = s
        .samples
        .iter()
        .filter(|x| x.name.starts_with("warren_"))
        .filter_map(|x| {
            let pipeline = x.labels.get("pipeline")?;
            let stage = x.labels.get("stage").map(String::as_str);
            let ok = ["users", "orders"].contains(&pipeline.as_str())
                && matches!(stage, Some("main" | "dlq"));
            (!ok).then(|| format!("{} {:?}", x.name, x.labels))
        })
        .collect();
    assert!(
        bad.is_empty(),
        "samples whose pipeline label is not a pipeline's name with a stage beside it:\n{}",
        bad.join("\n")
    );
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// `METRICS_ADDR=127.0.0.1:0` takes a port from the system: the log names the port bound (not
/// `:0`), and the endpoints answer there.
#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_log_line_names_the_port_bound() {
    let mut env = TestEnv::new("ep_port0").await;
    env.set("METRICS_ADDR", "127.0.0.1:0");
    let mut warren = env.start(&["--roles", "api"]);
    warren
        .wait_for_log("the metrics listener's line", "metrics listening")
        .await;
    let logs = warren.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("metrics listening"))
        .expect("the line")
        .to_string();
    let port: u16 = line
        .split("addr=127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no addr=127.0.0.1:PORT in {line:?}"));
    assert_ne!(port, 0, "{line}");
    let healthy = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
    assert!(
        healthy.is_ok(),
        "nothing listens on {port} ({healthy:?}): {line}\nwarren {}; its log:\n{}",
        if warren.is_running() {
            "still runs"
        } else {
            "exited"
        },
        warren.logs()
    );
    warren.terminate_ok(Duration::from_secs(25));
}
