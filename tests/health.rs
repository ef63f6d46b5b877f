//! The metrics listener (`METRICS_ADDR`) on every role: `/metrics` for Prometheus, `/healthz`
//! (the process and its runtime answer), `/readyz` (the links its roles need are up: the broker,
//! the database; an open breaker is named, and leaves it ready), 404 on any other path. A consumer-only instance binds no API port, so this is
//! the only place an orchestrator can probe it.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use serde_json::Value;
use uuid::Uuid;

/// Waits until `GET path` answers `status`; returns the body as JSON (`Null` when it is not).
async fn wait_status(env: &TestEnv, warren: &Warren, path: &str, status: u16) -> Value {
    let mut last = None;
    for _ in 0..600 {
        last = metrics_get(env, path).await;
        if let Some((s, body)) = &last
            && *s == status
        {
            return serde_json::from_str(body).unwrap_or(Value::Null);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "GET {path} did not answer {status} within 60 s; last answer {last:?}; log:\n{}",
        warren.logs()
    );
}

/// A consumer-only instance: `/healthz` 200 as soon as it runs; `/readyz` 200 once its broker
/// and database links are up, 503 (naming the link) while the database is cut, then the broker,
/// and 200 again when they are back; any other path 404; `/metrics` still scrapes.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_only_instance_answers_health_and_readiness_on_its_metrics_port() {
    let mut env = TestEnv::new("health_consumer").await;
    env.declare();
    let db = TcpProxy::start(&database_url(), 5432).await;
    let broker = TcpProxy::start(&amqp_url(), 5672).await;
    env.set("DATABASE_URL", db.url());
    env.set("AMQP_URL", broker.url());
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let health = wait_status(&env, &warren, "/healthz", 200).await;
    assert_eq!(health["status"], "ok", "{health}");
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(ready["broker"], true, "{ready}");
    assert_eq!(ready["database"], true, "{ready}");
    for path in ["/other", "/", "/metrics/x", "/healthzz"] {
        let (status, body) = metrics_get(&env, path).await.expect("an answer");
        assert_eq!(status, 404, "GET {path}: {body}");
        assert!(!body.contains("warren_build_info"), "GET {path}: {body}");
    }
    let scrape = wait_scrape(
        &env,
        &warren,
        "warren_build_info",
        Duration::from_secs(10),
        |s| s.one("warren_build_info", &[]).is_some(),
    )
    .await;
    assert_eq!(
        scrape.types.get("warren_build_info").map(String::as_str),
        Some("gauge")
    );
    let ids: HashSet<Uuid> = env.publish_users(20).await.into_iter().collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;

    // The database goes away: not ready, and the body says which link; still healthy.
    db.cut();
    let down = wait_status(&env, &warren, "/readyz", 503).await;
    assert_eq!(down["database"], false, "{down}");
    assert_eq!(down["broker"], true, "{down}");
    assert_eq!(metrics_get(&env, "/healthz").await.map(|a| a.0), Some(200));
    db.restore();
    wait_status(&env, &warren, "/readyz", 200).await;

    // The broker goes away.
    broker.cut();
    let down = wait_status(&env, &warren, "/readyz", 503).await;
    assert_eq!(down["broker"], false, "{down}");
    broker.restore();
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(ready["broker"], true, "{ready}");
    assert_eq!(ready["database"], true, "{ready}");

    warren.terminate_ok(Duration::from_secs(30));
}

/// Every role has the listener: an API-only instance answers there too, and its API keeps its
/// own `/healthz` and `/readyz` on `HTTP_ADDR`.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_only_instance_has_the_listener_too_and_its_api_keeps_its_own_probes() {
    let env = TestEnv::new("health_api").await;
    env.declare();
    let mut warren = env.start(&["--roles", "api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_status(&env, &warren, "/healthz", 200).await;
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(ready["broker"], true, "{ready}");
    assert_eq!(ready["database"], true, "{ready}");
    let (status, _) = metrics_get(&env, "/api/v1/users").await.expect("an answer");
    assert_eq!(
        status, 404,
        "the API's routes are not on the metrics listener"
    );
    assert_eq!(
        http(&env, "GET", "/healthz", None).await.map(|a| a.0),
        Some(200)
    );
    assert_eq!(
        http(&env, "GET", "/readyz", None).await.map(|a| a.0),
        Some(200)
    );
    warren.terminate_ok(Duration::from_secs(30));
}

/// Under systemd's `WatchdogSec=` (`WATCHDOG_USEC`), the runtime that answers `/healthz` pings
/// the watchdog (`WATCHDOG=1`) twice a period.
#[tokio::test(flavor = "multi_thread")]
async fn the_runtime_pings_the_systemd_watchdog() {
    let mut env = TestEnv::new("health_watchdog").await;
    env.declare();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    env.set("NOTIFY_SOCKET", path.to_str().expect("UTF-8 path"));
    env.set("WATCHDOG_USEC", "400000");
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let mut pings = 0;
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 4096];
    // READY=1 comes once the pipelines run, which may be after the first pings: wait for both.
    while pings < 3 || !seen.iter().any(|s| s == "READY=1") {
        let n = tokio::time::timeout(Duration::from_secs(30), socket.recv(&mut buf))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "3 WATCHDOG=1 and READY=1 within 30 s; got {seen:?}; log:\n{}",
                    warren.logs()
                )
            })
            .expect("read the notify socket");
        let text = String::from_utf8_lossy(&buf[..n]).trim().to_string();
        pings += usize::from(text == "WATCHDOG=1");
        seen.push(text);
    }
    assert!(seen.iter().any(|s| s == "READY=1"), "{seen:?}");
    warren.terminate_ok(Duration::from_secs(30));
}

/// What `/readyz` means with an open breaker (docs/deploying.md, "What the probes mean"): the
/// users table is missing, so the breaker opens on the systemic error and holds the pipeline;
/// the instance stays ready (the breaker is the pipeline's, shared by every instance: failing
/// readiness would only stall a rolling update and take the API out of its Service), and the
/// body names the stage whose breaker is open. The table back, the breaker closes, the users
/// land and the body no longer names it.
#[tokio::test(flavor = "multi_thread")]
async fn an_open_breaker_on_a_missing_table_is_named_by_readyz_and_leaves_it_ready() {
    let env = TestEnv::new("health_breaker").await;
    env.declare();
    env.db
        .batch_execute("ALTER TABLE users RENAME TO users_away")
        .await
        .expect("rename the table away");
    let ids: HashSet<Uuid> = env.publish_users(20).await.into_iter().collect();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_scrape(
        &env,
        &warren,
        "the breaker open",
        Duration::from_secs(60),
        |s| {
            s.one(
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", "main")],
            ) == Some(1.0)
        },
    )
    .await;
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(
        ready["breakers_open"],
        serde_json::json!(["users/main"]),
        "{ready}"
    );
    assert_eq!(ready["broker"], true, "{ready}");
    assert_eq!(ready["database"], true, "{ready}");

    env.db
        .batch_execute("ALTER TABLE users_away RENAME TO users")
        .await
        .expect("bring the table back");
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;
    let body = || async {
        metrics_get(&env, "/readyz")
            .await
            .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
            .unwrap_or(Value::Null)
    };
    wait_until(
        "the breaker left the body",
        Duration::from_secs(30),
        || async {
            let body = body().await;
            body.get("breakers_open").is_none() && body["broker"] == true
        },
    )
    .await;
    warren.terminate_ok(Duration::from_secs(30));
}

/// Review F5: a database that accepts and never answers (the proxy lets no byte through, the
/// connections stay open) must be named unreachable by `/readyz` within a few seconds. Before,
/// the probe ran on the pipeline's pool bounded by the statement timeout plus 2 s, and
/// `/readyz` answered 200, `"database": true`, for 30-40 s of such a hang. Now the probe has a
/// connection of its own and a 2 s bound: 503 with `"database": false` within two probes.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_that_hangs_is_named_unreachable_by_readyz_within_seconds() {
    let mut env = TestEnv::new("health_hang").await;
    env.declare();
    let db = TcpProxy::start(&database_url(), 5432).await;
    env.set("DATABASE_URL", db.url());
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(ready["database"], true, "{ready}");

    db.freeze();
    let hung = std::time::Instant::now();
    let down = wait_status(&env, &warren, "/readyz", 503).await;
    let took = hung.elapsed();
    assert_eq!(down["database"], false, "{down}");
    assert_eq!(down["broker"], true, "{down}");
    assert!(
        took < Duration::from_secs(8),
        "/readyz named the hung database only after {took:?}"
    );
    assert_eq!(metrics_get(&env, "/healthz").await.map(|a| a.0), Some(200));
    db.thaw();
    let ready = wait_status(&env, &warren, "/readyz", 200).await;
    assert_eq!(ready["database"], true, "{ready}");
    warren.terminate_ok(Duration::from_secs(30));
}
