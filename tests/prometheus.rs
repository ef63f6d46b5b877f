//! The dashboard and the alert rules on a real Prometheus: Debian's `prometheus` scrapes two
//! warren processes every second (one with every role, one API-only whose broker is a closed
//! port), traffic of every kind goes through them, and then every PromQL query of every panel
//! of grafana/dashboards/*.json and every alert expression is evaluated through Prometheus's
//! HTTP API. Each must parse; each panel query must return at least one series. The table of
//! results is printed (`cargo test --test prometheus -- --nocapture` shows it).
//!
//! prometheus comes from Debian's `prometheus` package (`scripts/setup.sh --with-promtool`);
//! without it the test fails and says so.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::ops::{Prometheus, repo_path, series_value, unix_now};
use common::*;
use serde_json::Value;

const JOB: &str = "warren";
const RULES: &str = "prometheus/warren-alerts.yml";

// ---- the dashboards ---------------------------------------------------------------------------

/// One PromQL query of a dashboard, where it is, and the expression as Prometheus gets it.
struct PanelQuery {
    place: String,
    expr: String,
}

/// Every dashboard under grafana/dashboards/.
fn dashboards() -> Vec<(String, Value)> {
    let dir = repo_path("grafana/dashboards");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("grafana/dashboards") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).expect("read dashboard");
            let json: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            out.push((name.unwrap_or_default(), json));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no dashboard in grafana/dashboards");
    out
}

/// What each template variable stands for in a query: a multi-value or "All" variable matches
/// everything (`.*`, it is used with `=~`), any other its current value (the job name).
fn variable_values(dashboard: &Value) -> BTreeMap<String, String> {
    let mut values = BTreeMap::new();
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = var["name"].as_str().unwrap_or_default().to_string();
        let value =
            if var["includeAll"].as_bool() == Some(true) || var["multi"].as_bool() == Some(true) {
                var["allValue"].as_str().unwrap_or(".*").to_string()
            } else {
                match &var["current"]["value"] {
                    Value::String(s) => s.clone(),
                    Value::Array(a) => a
                        .first()
                        .and_then(Value::as_str)
                        .unwrap_or(".*")
                        .to_string(),
                    _ => ".*".to_string(),
                }
            };
        values.insert(name, value);
    }
    values
}

/// `expr` with Grafana's variables replaced: intervals by `1m`, the range by `1h`, template
/// variables (`$name`, `${name}`, `[[name]]`) by [`variable_values`].
fn concrete(expr: &str, variables: &BTreeMap<String, String>) -> String {
    let mut e = expr
        .replace("$__rate_interval", "1m")
        .replace("${__rate_interval}", "1m")
        .replace("$__interval", "1m")
        .replace("${__interval}", "1m")
        .replace("$__range", "1h")
        .replace("${__range}", "1h");
    // Longest names first, so `$instance` is not cut by a variable named `$inst`.
    let mut names: Vec<&String> = variables.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        let value = &variables[name];
        e = e
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("[[{name}]]"), value)
            .replace(&format!("${name}"), value);
    }
    assert!(
        !e.contains('$'),
        "a Grafana variable is left in {expr:?}: {e:?}"
    );
    e
}

/// Every panel query (rows' nested panels included) and every query variable, ready for
/// Prometheus. `label_values(SELECTOR, LABEL)` becomes `count by (LABEL) (SELECTOR)`.
fn panel_queries() -> Vec<PanelQuery> {
    fn walk(
        panels: &Value,
        file: &str,
        vars: &BTreeMap<String, String>,
        out: &mut Vec<PanelQuery>,
    ) {
        for panel in panels.as_array().into_iter().flatten() {
            walk(&panel["panels"], file, vars, out);
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(PanelQuery {
                        place: format!(
                            "{file} #{} {} [{}]",
                            panel["id"],
                            panel["title"].as_str().unwrap_or("?"),
                            target["refId"].as_str().unwrap_or("?")
                        ),
                        expr: concrete(expr, vars),
                    });
                }
            }
        }
    }
    let mut out = Vec::new();
    for (file, dashboard) in dashboards() {
        let vars = variable_values(&dashboard);
        walk(&dashboard["panels"], &file, &vars, &mut out);
        for var in dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let query = var["query"]["query"]
                .as_str()
                .or_else(|| var["query"].as_str());
            let Some(query) = query.filter(|_| var["type"] == "query") else {
                continue;
            };
            let query = concrete(query, &vars);
            let expr = match query
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .and_then(|q| q.rsplit_once(','))
            {
                Some((selector, label)) => format!("count by ({}) ({selector})", label.trim()),
                None => query,
            };
            out.push(PanelQuery {
                place: format!("{file} variable ${}", var["name"].as_str().unwrap_or("?")),
                expr,
            });
        }
    }
    out
}

// ---- traffic ----------------------------------------------------------------------------------

/// (status, body) of one request to the env's API (the harness's [`http`]); a failed test if
/// nothing answers.
async fn request(env: &TestEnv, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    http(env, method, path, body)
        .await
        .unwrap_or_else(|| panic!("{method} {}{path}: no answer", env.http_base()))
}

/// Waits until the env's `users` table holds `n` rows.
async fn wait_rows(env: &TestEnv, n: i64) {
    wait_until(&format!("{n} rows"), Duration::from_secs(90), || async {
        env.count_rows().await == n
    })
    .await;
}

/// API traffic: a user through the broker (200), an invalid one (422), a 400 and a 404 on the
/// full warren; publishes and reads refused with 503 by the API-only one. Returns the users.
async fn api_traffic(full: &TestEnv, api_only: &TestEnv, round: usize) -> usize {
    let (status, body) = request(
        full,
        "POST",
        "/api/v1/users",
        Some(&format!(
            r#"{{"name":"Prom {round}","email":"prom-{round}-{}@example.com"}}"#,
            full.id
        )),
    )
    .await;
    assert_eq!(status, 200, "POST on the full warren: {body}");
    let id = serde_json::from_str::<Value>(&body).expect("JSON")["id"]
        .as_str()
        .expect("an id")
        .to_string();
    let (status, body) = request(full, "POST", "/api/v1/users", Some(r#"{"name":""}"#)).await;
    assert_eq!(status, 422, "{body}");
    let (status, _) = request(full, "GET", "/api/v1/users/not-a-uuid", None).await;
    assert_eq!(status, 400);
    let (status, _) = request(full, "GET", "/no/such/route", None).await;
    assert_eq!(status, 404);
    for _ in 0..3 {
        let (status, body) = request(
            api_only,
            "POST",
            "/api/v1/users",
            Some(r#"{"name":"Nobody","email":"nobody@example.com"}"#),
        )
        .await;
        assert_eq!(
            status, 503,
            "POST on the API-only warren without a broker: {body}"
        );
    }
    let (status, _) = request(api_only, "GET", &format!("/api/v1/users/{id}"), None).await;
    assert_eq!(
        status, 503,
        "GET on the API-only warren (its schema has no users table)"
    );
    let (status, _) = request(api_only, "GET", "/readyz", None).await;
    assert_eq!(status, 503);
    1
}

/// Messages: `warren publish` (timestamped; every 5th invalid, so dead-lettered, then parked by
/// the DLQ consumer) and raw users. Returns the valid ones.
async fn message_traffic(env: &TestEnv) -> usize {
    let (code, out, err) = env.run(&["publish", "--count", "20", "--invalid-every", "5"]);
    assert_eq!(code, 0, "warren publish failed:\n{out}\n{err}");
    env.publish_users(10).await;
    16 + 10
}

// ---- the test ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn every_dashboard_panel_and_alert_evaluates_on_a_real_prometheus() {
    let queries = panel_queries();

    // The full warren: every role; a fault makes the first batch fail at once and retry soon.
    let mut env = TestEnv::new("prom").await;
    env.set("RETRY_TTL_MS", "1000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1");
    env.declare();
    let warren = env.start(&["--roles", "consumer,dlq,api"]);
    // The API-only warren: its broker is a closed port, so it answers 503.
    let mut api_env = TestEnv::new("prom_api").await;
    api_env.set(
        "AMQP_URL",
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", free_port()),
    );
    api_env.set("AMQP_CONNECT_TIMEOUT_MS", "500");
    let api_warren = api_env.start(&["--roles", "api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone(), api_warren.log.clone()]);

    let targets = vec![
        format!("127.0.0.1:{}", env.metrics_port),
        format!("127.0.0.1:{}", api_env.metrics_port),
    ];
    let prometheus = Prometheus::start(JOB, &targets, &[repo_path(RULES)]).await;

    wait_until(
        "the full warren's /readyz answers 200",
        Duration::from_secs(30),
        || async { matches!(http(&env, "GET", "/readyz", None).await, Some((200, _))) },
    )
    .await;
    // Alive, never ready: its broker is a closed port, and its 503s are what it is for (the
    // full warren above waits for readiness).
    wait_until(
        "the API-only warren answers",
        Duration::from_secs(30),
        || async { http(&api_env, "GET", "/healthz", None).await.is_some() },
    )
    .await;

    // Scraping from before the traffic, so that the rates see it.
    prometheus
        .wait_scrapes_after(JOB, targets.len(), 0.0, 1)
        .await;

    // Round 1: inserted, dead-lettered and parked, every API status.
    let mut rows = api_traffic(&env, &api_env, 1).await;
    rows += message_traffic(&env).await;
    wait_rows(&env, rows as i64).await;
    wait_scrape(&env, &warren, "4 parked", Duration::from_secs(30), |s| {
        s.sum("warren_messages_parked_total", &[]) == 4.0
    })
    .await;

    // Round 2: a transient database fault (deadlock_detected, 40P01): the batch goes to the
    // retry queue and the breaker opens; then the fault clears and every row arrives.
    install_fault(&env, CountAttempts::No).await;
    set_fault_sqlstate(&env, "40P01").await;
    env.publish_users(3).await;
    rows += 3;
    wait_scrape(
        &env,
        &warren,
        "retried and the breaker open",
        Duration::from_secs(30),
        |s| {
            s.sum("warren_messages_retried_total", &[]) >= 1.0
                && s.one(
                    "warren_breaker_open",
                    &[("pipeline", "users"), ("stage", "main")],
                ) == Some(1.0)
        },
    )
    .await;
    clear_fault(&env).await;
    wait_rows(&env, rows as i64).await;

    // Round 3, just before the evaluation, so that the 1-minute rates see it.
    rows += api_traffic(&env, &api_env, 3).await;
    rows += message_traffic(&env).await;
    wait_rows(&env, rows as i64).await;
    wait_scrape(
        &env,
        &warren,
        "8 parked, the breaker closed, nothing in flight, the queue gauges polled",
        Duration::from_secs(30),
        |s| {
            s.sum("warren_messages_parked_total", &[]) == 8.0
                && s.one(
                    "warren_breaker_open",
                    &[("pipeline", "users"), ("stage", "main")],
                ) == Some(0.0)
                && s.one("warren_inflight_messages", &[]) == Some(0.0)
                && s.one(
                    "warren_queue_messages",
                    &[("queue", env.main_queue.as_str())],
                )
                .is_some()
        },
    )
    .await;
    prometheus
        .wait_scrapes_after(JOB, targets.len(), unix_now(), 2)
        .await;

    // Evaluate every panel query and every alert expression.
    let mut table = Vec::new();
    let mut problems = Vec::new();
    for q in &queries {
        match prometheus.query(&q.expr).await {
            Ok(series) => {
                let nan = series
                    .iter()
                    .filter(|s| series_value(s).is_none_or(f64::is_nan))
                    .count();
                if series.is_empty() {
                    problems.push(format!("{}: no series for {}", q.place, q.expr));
                }
                table.push((q.place.clone(), series.len(), nan, String::new()));
            }
            Err(e) => {
                problems.push(format!("{}: {e} in {}", q.place, q.expr));
                table.push((q.place.clone(), 0, 0, "ERROR".into()));
            }
        }
    }

    // The alerts, as Prometheus loaded them: healthy, and each expression evaluated now.
    let mut alerts: BTreeMap<String, (String, String)> = BTreeMap::new();
    for group in prometheus.rules().await {
        for rule in group["rules"].as_array().into_iter().flatten() {
            let name = rule["name"].as_str().unwrap_or("?").to_string();
            let health = rule["health"].as_str().unwrap_or("?").to_string();
            if health != "ok" && health != "unknown" {
                problems.push(format!(
                    "alert {name}: health {health}: {}",
                    rule["lastError"].as_str().unwrap_or("")
                ));
            }
            alerts.insert(
                name,
                (
                    rule["query"].as_str().unwrap_or("").to_string(),
                    rule["state"].as_str().unwrap_or("?").to_string(),
                ),
            );
        }
    }
    let in_file = std::fs::read_to_string(repo_path(RULES))
        .expect("rule file")
        .lines()
        .filter(|l| l.trim().starts_with("- alert:"))
        .count();
    assert_eq!(
        alerts.len(),
        in_file,
        "Prometheus loaded {} of the {in_file} alerts of {RULES}:\n{}",
        alerts.len(),
        prometheus.logs()
    );
    let mut alert_counts = BTreeMap::new();
    for (name, (expr, state)) in &alerts {
        match prometheus.query(expr).await {
            Ok(series) => {
                alert_counts.insert(name.clone(), series.len());
                table.push((format!("alert {name}"), series.len(), 0, state.clone()));
            }
            Err(e) => {
                problems.push(format!("alert {name}: {e} in {expr}"));
                table.push((format!("alert {name}"), 0, 0, "ERROR".into()));
            }
        }
        // Every warren series the alert reads exists: a misspelt name would never fire.
        for metric in metric_names(expr) {
            let count = prometheus
                .value(&format!("count({{__name__=\"{metric}\"}})"))
                .await;
            if count.is_none_or(|c| c < 1.0) {
                problems.push(format!("alert {name}: Prometheus has no series {metric}"));
            }
        }
    }

    println!(
        "\n{:<70} {:>6} {:>4}  note",
        "panel / alert", "series", "NaN"
    );
    for (place, n, nan, note) in &table {
        println!("{place:<70} {n:>6} {nan:>4}  {note}");
    }
    println!();

    // What this traffic must show: the API-only warren has no broker and answers 503.
    for (alert, why) in [
        (
            "WarrenBrokerLinkDown",
            "the API-only warren's broker is a closed port",
        ),
        (
            "WarrenApiUnavailable",
            "the API-only warren answered only 503 to /api requests",
        ),
        (
            "WarrenPublishFailing",
            "the API-only warren's publishes ended unavailable",
        ),
        ("WarrenMessagesParked", "the DLQ consumer parked 8 messages"),
    ] {
        if alert_counts.get(alert).copied().unwrap_or(0) == 0 {
            problems.push(format!("alert {alert}: expression empty although {why}"));
        }
    }
    for (alert, why) in [
        ("WarrenDown", "both targets are up"),
        ("WarrenInstanceDown", "both targets are up"),
        (
            "WarrenMainQueueNoConsumers",
            "the full warren consumes the main queue",
        ),
        ("WarrenBreakerOpen", "the breaker closed again"),
        ("WarrenDatabaseLinkDown", "both instances reach PostgreSQL"),
    ] {
        if alert_counts.get(alert).copied().unwrap_or(0) != 0 {
            problems.push(format!(
                "alert {alert}: expression not empty although {why}"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The `warren_` metric names an expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("warren_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let before = rest[..i].chars().last();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '"') {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn grafana_variables_are_replaced() {
    let vars = BTreeMap::from([
        ("job".to_string(), "warren".to_string()),
        ("instance".to_string(), ".*".to_string()),
    ]);
    assert_eq!(
        concrete(
            r#"rate(x{job=~"$job", instance=~"${instance}"}[$__rate_interval])"#,
            &vars
        ),
        r#"rate(x{job=~"warren", instance=~".*"}[1m])"#
    );
    let queries = panel_queries();
    assert!(
        queries
            .iter()
            .any(|q| q.place.contains("variable $instance"))
    );
    assert!(queries.iter().all(|q| !q.expr.contains('$')));
}
