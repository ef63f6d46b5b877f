//! Balancing against a real broker and database: `simple` follows the formula on the queue's
//! depth within two cooldowns and comes back to the minimum when the queue is empty; `auto`
//! climbs step by step (never more than `max_shift` a cooldown) while steps help, stops rising
//! when the database is the wall (a trigger that serialises and sleeps), and returns to the
//! minimum when idle; two pipelines share the process budget; concurrency changing under load
//! (the balancer's and an operator's) loses and repeats nothing. Each change is a metric, an
//! event and a `warren ctl history` line.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use uuid::Uuid;

/// The gauge of `stage`'s concurrency, sampled every 100 ms while the returned guard lives:
/// (time since start, value) for every change seen.
struct Samples(
    Arc<Mutex<Vec<(Duration, f64)>>>,
    tokio::task::JoinHandle<()>,
);

impl Samples {
    fn start(env: &TestEnv, pipelines: &[&str]) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (into, pipelines): (_, Vec<String>) = (
            seen.clone(),
            pipelines.iter().map(|s| s.to_string()).collect(),
        );
        let port = env.metrics_port;
        let task = tokio::spawn(async move {
            let started = Instant::now();
            loop {
                let url = format!("http://127.0.0.1:{port}/metrics");
                if let Ok(Ok(text)) = tokio::task::spawn_blocking(move || {
                    ureq::get(&url)
                        .call()
                        .and_then(|mut r| r.body_mut().read_to_string())
                })
                .await
                {
                    let s = Scrape::parse(text);
                    let total: f64 = pipelines
                        .iter()
                        .filter_map(|p| {
                            s.one(
                                "warren_pipeline_concurrency",
                                &[("pipeline", p.as_str()), ("stage", "main")],
                            )
                        })
                        .sum();
                    let mut v = into.lock().unwrap();
                    if v.last().is_none_or(|(_, last)| *last != total) {
                        v.push((started.elapsed(), total));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Samples(seen, task)
    }

    fn values(&self) -> Vec<(Duration, f64)> {
        self.0.lock().unwrap().clone()
    }

    fn max(&self) -> f64 {
        self.values().iter().map(|(_, v)| *v).fold(0.0, f64::max)
    }
}

impl Drop for Samples {
    fn drop(&mut self) {
        self.1.abort();
    }
}

async fn concurrency(env: &TestEnv, pipeline: &str) -> f64 {
    try_metric(
        env,
        "warren_pipeline_concurrency",
        &[("pipeline", pipeline), ("stage", "main")],
    )
    .await
    .unwrap_or(-1.0)
}

/// The balancing entries of `warren ctl history --json`, oldest first.
async fn balance_history(env: &TestEnv) -> Vec<Value> {
    let (code, out, err) = env
        .run_async(&["ctl", "history", "--json", "--limit", "500"])
        .await;
    assert_eq!(code, 0, "ctl history: {out}{err}");
    let mut lines: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["command"] == "balance")
        .collect();
    lines.reverse();
    lines
}

fn balanced(env: &mut TestEnv, strategy: &str, cooldown_ms: u64) {
    env.set("USERS_BALANCE", strategy)
        .set("USERS_BALANCE_COOLDOWN_MS", cooldown_ms.to_string())
        .set("USERS_BATCH_SIZE", "100")
        .set("USERS_BATCH_TIMEOUT_MS", "50")
        .set("REGISTRY_HEARTBEAT_MS", "300");
}

#[tokio::test(flavor = "multi_thread")]
async fn simple_follows_the_formula_within_two_cooldowns_and_returns_to_min_when_empty() {
    let mut env = TestEnv::new("bal_simple").await;
    balanced(&mut env, "simple", 1000);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "5")
        .set("USERS_SCALE_THRESHOLD", "1000");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "the concurrency gauge at min",
        Duration::from_secs(30),
        || async { concurrency(&env, "users").await == 1.0 },
    )
    .await;
    let samples = Samples::start(&env, &["users"]);

    // A backlog while paused: 3,000 messages = ceil(3000 / 1000) = 3 inserts in flight.
    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let ids = env.publish_users(3000).await;
    let published = Instant::now();
    wait_until("concurrency 3", Duration::from_secs(10), || async {
        concurrency(&env, "users").await == 3.0
    })
    .await;
    let took = published.elapsed();
    assert!(
        took <= Duration::from_millis(2 * 1000 + 600),
        "the formula's value came {took:?} after the backlog, more than two cooldowns"
    );
    // A deeper backlog asks for more than max: it stops at max.
    env.publish_users(7000).await;
    wait_until("concurrency 5 (max)", Duration::from_secs(10), || async {
        concurrency(&env, "users").await == 5.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        samples.max(),
        5.0,
        "never above max: {:?}",
        samples.values()
    );

    // Resumed, the queue empties and the concurrency comes back to min.
    let (code, out, err) = env.run_async(&["ctl", "resume", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    wait_until("10,000 rows", Duration::from_secs(60), || async {
        env.count_rows().await == 10_000
    })
    .await;
    wait_until("back to min", Duration::from_secs(10), || async {
        concurrency(&env, "users").await == 1.0
    })
    .await;
    assert!(
        env.row_ids().await.is_superset(&ids.into_iter().collect()),
        "every id inserted"
    );

    // Each change: a history line with its inputs, and a `scaled` event.
    let history = balance_history(&env).await;
    let details: Vec<&str> = history
        .iter()
        .filter_map(|h| h["detail"].as_str())
        .collect();
    assert!(
        details
            .iter()
            // The backlog the poll saw, perhaps while the publishing went on: 2001 to 3000.
            .any(|d| d.contains("-> 3 (backlog): backlog=2")
                || d.contains("-> 3 (backlog): backlog=3000 ")),
        "{details:#?}"
    );
    assert!(
        details.last().is_some_and(|d| d.contains("-> 1 (")),
        "{details:#?}"
    );
    let events = stream_events(&env).await;
    let scaled: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "scaled" && e["what"] == "concurrency")
        .collect();
    assert_eq!(scaled.len(), history.len(), "{scaled:#?}\n{history:#?}");
    assert!(
        scaled.iter().all(|e| e["pipeline"] == "users"),
        "{scaled:#?}"
    );

    // `warren status` shows the concurrency (INSERTS).
    let (code, out, _) = env.run_async(&["status"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("INSERTS"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_climbs_step_by_step_while_it_helps_and_returns_to_min_when_idle() {
    let mut env = TestEnv::new("bal_auto").await;
    balanced(&mut env, "auto", 800);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "4")
        .set("USERS_BALANCE_MAX_SHIFT", "1")
        .set("USERS_SCALE_UP_THRESHOLD", "100")
        .set("USERS_SCALE_DOWN_THRESHOLD", "20");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    // A database that gains from more inserts in flight: each statement waits 40 ms without
    // holding anything, so two at once insert twice as fast.
    env.db
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.slow_statement() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.04); RETURN NULL; END $$;
             CREATE TRIGGER slow AFTER INSERT ON {s}.users
             FOR EACH STATEMENT EXECUTE FUNCTION {s}.slow_statement();",
            s = env.schema
        ))
        .await
        .expect("slow trigger");
    env.publish_users(20_000).await;
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let samples = Samples::start(&env, &["users"]);
    wait_until("20,000 rows", Duration::from_secs(120), || async {
        env.count_rows().await == 20_000
    })
    .await;
    wait_until("back to min", Duration::from_secs(20), || async {
        concurrency(&env, "users").await == 1.0
    })
    .await;
    let values = samples.values();
    assert!(samples.max() >= 3.0, "it climbed: {values:?}");
    for pair in values.windows(2) {
        let (a, b) = (pair[0].1, pair[1].1);
        assert!(
            (b - a).abs() <= 1.0,
            "more than max_shift in one step: {values:?}"
        );
    }
    let history = balance_history(&env).await;
    let ups: Vec<u64> = history
        .iter()
        .filter(|h| {
            h["detail"]
                .as_str()
                .is_some_and(|d| d.contains("(backlog)"))
        })
        .map(|h| h["at"].as_u64().unwrap_or(0))
        .collect();
    assert!(ups.len() >= 2, "{history:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_stops_rising_when_more_inserts_in_flight_do_not_help() {
    let mut env = TestEnv::new("bal_wall").await;
    balanced(&mut env, "auto", 800);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "6")
        .set("USERS_BALANCE_MAX_SHIFT", "1")
        .set("USERS_SCALE_UP_THRESHOLD", "100")
        .set("USERS_SCALE_DOWN_THRESHOLD", "20");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    // The wall: every statement takes one lock and sleeps 50 ms holding it, so statements run
    // one at a time whatever the concurrency.
    env.db
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.serial_statement() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock(774411); PERFORM pg_sleep(0.05);
             RETURN NULL; END $$;
             CREATE TRIGGER serial AFTER INSERT ON {s}.users
             FOR EACH STATEMENT EXECUTE FUNCTION {s}.serial_statement();",
            s = env.schema
        ))
        .await
        .expect("serial trigger");
    // At most 2,000 rows/s through the wall (100 rows per 50 ms): 15 s of backlog.
    env.publish_users(30_000).await;
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let samples = Samples::start(&env, &["users"]);
    // 8 s of backlog: about ten decisions.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        env.ready(&env.main_queue).await > 1000,
        "the backlog lasted the observation"
    );
    // It may climb while steps help (one insert in flight leaves the database idle between
    // batches), but the first step that does not help is taken back, and it rises no more.
    let values = samples.values();
    let history = balance_history(&env).await;
    let no_gain = history
        .iter()
        .find(|h| {
            h["detail"]
                .as_str()
                .is_some_and(|d| d.contains("(no_gain)"))
        })
        .unwrap_or_else(|| {
            panic!(
                "no step taken back: {history:#?}
{values:?}"
            )
        });
    let detail = no_gain["detail"].as_str().unwrap_or_default();
    let back_to: f64 = detail
        .split(" -> ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{detail}"));
    let at = values
        .iter()
        .rposition(|(_, v)| *v == back_to)
        .expect("the level it went back to was sampled");
    let peak = values.iter().map(|(_, v)| *v).fold(0.0, f64::max);
    assert!(
        peak <= back_to + 1.0,
        "one step past the wall at most: {values:?}"
    );
    assert!(
        values[at..].iter().all(|(_, v)| *v <= back_to),
        "it rose again after the step that did not help: {values:?}"
    );
    wait_until("30,000 rows", Duration::from_secs(120), || async {
        env.count_rows().await == 30_000
    })
    .await;
}

/// The `orders` pipeline balanced by `strategy` (min 1, max 6, batches of 100): its table, its
/// file and its topology ([`orders_pipeline`]).
async fn balanced_orders(
    env: &TestEnv,
    names: &PipelineNames,
    strategy: &str,
    cooldown_ms: u64,
) -> ConfigFile {
    let extra = format!(
        "balance = \"{strategy}\"\nmin_concurrency = 1\nmax_concurrency = 6\n\
         scale_threshold = 500\nscale_up_threshold = 500\nscale_down_threshold = 100\n\
         balance_cooldown_ms = {cooldown_ms}\nbatch_size = 100\nbatch_timeout_ms = 50"
    );
    orders_pipeline(env, names, &extra).await
}

async fn publish_orders(env: &TestEnv, names: &PipelineNames, n: usize) -> Vec<Uuid> {
    let orders: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    env.publish_pipelined_to(
        &names.exchange,
        &names.queue,
        orders.iter().map(|id| {
            (
                format!(r#"{{"id":"{id}","qty":1}}"#).into_bytes(),
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
        }),
    )
    .await;
    orders
}

async fn orders_count(env: &TestEnv) -> i64 {
    count_of(env, "SELECT count(*) FROM orders").await
}

/// Asserts that `orders` holds exactly the `published` order ids (the missing and the extra
/// ones named), and `users` exactly the `users` ids.
async fn assert_both_exactly(env: &TestEnv, users: Vec<Uuid>, published: Vec<Uuid>) {
    let users: HashSet<Uuid> = users.into_iter().collect();
    assert_same_ids(
        "users",
        &users,
        &uuids_of(env, "SELECT id FROM users").await,
    );
    let n = published.len();
    let orders: HashSet<Uuid> = published.into_iter().collect();
    assert_eq!(orders.len(), n, "the published order ids are distinct");
    assert_same_ids(
        "orders",
        &orders,
        &uuids_of(env, "SELECT order_id FROM orders").await,
    );
}

/// warren running users and an `orders` pipeline balanced by `strategy`, both at their
/// minimum; what it made (names, table, config file, Redis keys) goes when it is dropped.
struct WithOrders {
    names: PipelineNames,
    /// Runs while the test lasts (its logs are shown by `_logs` on a failure).
    _warren: Warren,
    _logs: LogsOnPanic,
    _file: ConfigFile,
    _cleanup: PipelineCleanup,
    _redis: RedisCleanup,
}

impl WithOrders {
    async fn start(env: &TestEnv, strategy: &str, cooldown_ms: u64) -> Self {
        let names = PipelineNames::of(env, "orders");
        let cleanup = names.cleanup();
        let redis = RedisCleanup::new(env);
        let file = balanced_orders(env, &names, strategy, cooldown_ms).await;
        let warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
        let logs = LogsOnPanic(vec![warren.log.clone()]);
        wait_until("both gauges at min", Duration::from_secs(30), || async {
            concurrency(env, "users").await == 1.0 && concurrency(env, "orders").await == 1.0
        })
        .await;
        WithOrders {
            names,
            _warren: warren,
            _logs: logs,
            _file: file,
            _cleanup: cleanup,
            _redis: redis,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_pipelines_share_the_process_budget_by_backlog() {
    let mut env = TestEnv::new("bal_budget").await;
    balanced(&mut env, "simple", 700);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "6")
        .set("USERS_SCALE_THRESHOLD", "500")
        .set("MAX_INSERTS_IN_FLIGHT", "5");
    let run = WithOrders::start(&env, "simple", 700).await;
    let names = &run.names;
    let samples = Samples::start(&env, &["users", "orders"]);
    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    // Users alone first: it takes what the budget has beside orders' minimum (5 - 1), not its
    // max (6).
    let users = env.publish_users(6000).await;
    wait_until("users at the budget", Duration::from_secs(10), || async {
        concurrency(&env, "users").await == 4.0
    })
    .await;
    // Then orders gets a backlog twice users': the budget moves to it, by backlog.
    let orders = publish_orders(&env, names, 12_000).await;
    wait_until(
        "orders holds the larger share",
        Duration::from_secs(15),
        || async {
            concurrency(&env, "orders").await >= 3.0 && concurrency(&env, "users").await <= 2.0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        samples.max() <= 5.0,
        "the two together never past MAX_INSERTS_IN_FLIGHT: {:?}",
        samples.values()
    );
    let (code, out, err) = env.run_async(&["ctl", "resume", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    wait_until("every row", Duration::from_secs(90), || async {
        env.count_rows().await == 6000 && orders_count(&env).await == 12_000
    })
    .await;
    assert_both_exactly(&env, users, orders).await;
    assert!(samples.max() <= 5.0, "{:?}", samples.values());
}

/// Two `auto` pipelines climbing at once under one budget: each starts at its minimum, neither
/// waits for the other to finish, the two together never hold more inserts in flight than
/// MAX_INSERTS_IN_FLIGHT, every row lands once and both come back to their minimum when idle.
#[tokio::test(flavor = "multi_thread")]
async fn two_auto_pipelines_climb_within_the_process_budget() {
    let mut env = TestEnv::new("bal_budget_auto").await;
    balanced(&mut env, "auto", 300);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "6")
        .set("USERS_SCALE_UP_THRESHOLD", "500")
        .set("USERS_SCALE_DOWN_THRESHOLD", "100")
        .set("MAX_INSERTS_IN_FLIGHT", "4");
    let run = WithOrders::start(&env, "auto", 300).await;
    let names = &run.names;
    let samples = Samples::start(&env, &["users", "orders"]);
    let (users, orders) = tokio::join!(
        env.publish_users(20_000),
        publish_orders(&env, names, 20_000)
    );
    wait_until("every row", Duration::from_secs(180), || async {
        env.count_rows().await == 20_000 && orders_count(&env).await == 20_000
    })
    .await;
    // Every published id stored, and nothing else: the ids compared, not counted (a count of
    // DISTINCT on the primary key, after waiting for the count, could not fail).
    assert_both_exactly(&env, users, orders).await;
    wait_until("both back at min", Duration::from_secs(30), || async {
        concurrency(&env, "users").await == 1.0 && concurrency(&env, "orders").await == 1.0
    })
    .await;
    let seen = samples.values();
    assert!(
        samples.max() <= 4.0,
        "the two together never past MAX_INSERTS_IN_FLIGHT: {seen:?}"
    );
    assert!(
        samples.max() >= 3.0,
        "with both backlogs deep, auto took more than the two minimums: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrency_changing_under_load_loses_and_repeats_nothing() {
    let mut env = TestEnv::new("bal_ledger").await;
    // A low threshold and a short cooldown: the concurrency moves with every poll.
    balanced(&mut env, "simple", 300);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "8")
        .set("USERS_SCALE_THRESHOLD", "150")
        .set("USERS_BATCH_SIZE", "37");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let samples = Samples::start(&env, &["users"]);
    let mut ids = Vec::new();
    // Waves of backlog, and an operator moving the bounds between them.
    for (wave, bounds) in [
        (4000, None),
        (3000, Some(["--min", "3", "--max", "5"])),
        (5000, Some(["--min", "1", "--max", "2"])),
        (3000, Some(["--min", "1", "--max", "8"])),
    ] {
        if let Some(b) = bounds {
            let mut args = vec!["ctl", "scale"];
            args.extend(b);
            args.push("--all");
            let (code, out, err) = env.run_async(&args).await;
            assert_eq!(code, 0, "{args:?}: {out}{err}");
        }
        ids.extend(env.publish_users(wave).await);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    wait_until("15,000 rows", Duration::from_secs(90), || async {
        env.count_rows().await == 15_000
    })
    .await;
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(10), &|| warren.logs()).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
    // Every delivery was acked, in multi-acks: a resubscription never left a delivery behind
    // the front (the balance bench found one left for ever, after which every ack went one by
    // one and the last ones were still unacked at the stop).
    let (acks, batches) = acks_and_batches(&env).await;
    assert!(
        batches > 0.0 && acks <= 2.0 * batches,
        "{acks} acks for {batches} batches:\n{}",
        warren.logs()
    );
    let changes = samples.values().len();
    assert!(
        changes >= 4,
        "the concurrency moved: {:?}",
        samples.values()
    );
    // The operator's bounds were applied and recorded with their numbers.
    let (_, out, _) = env.run_async(&["ctl", "history", "--limit", "50"]).await;
    assert!(out.contains("min=1 max=2"), "{out}");
    // A bound past the batchers that exist is refused, naming them.
    let (code, out, err) = env
        .run_async(&["ctl", "scale", "--max", "9", "--all"])
        .await;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        format!("{out}{err}").contains("max_concurrency"),
        "{out}{err}"
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(
        env.queue_state(&env.main_queue).await,
        (0, 0),
        "nothing went back to the queue at the stop"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_window_smaller_than_a_batch_flushes_when_full_instead_of_at_the_batch_timeout() {
    // Found by review: PREFETCH=100 under batches of 1,000 took one window per batch timeout
    // (10,000 messages in 103 s). Once the window is full nothing more can come before the acks,
    // so the batchers flush at once.
    let mut env = TestEnv::new("bal_window").await;
    env.set("PREFETCH", "100")
        .set("USERS_BATCH_SIZE", "1000")
        .set("USERS_BATCH_TIMEOUT_MS", "5000");
    env.declare();
    let ids = env.publish_users(3000).await;
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // With the batch timeout, 30 windows would take 150 s; flushed when full, seconds.
    wait_until("3,000 rows", Duration::from_secs(40), || async {
        env.count_rows().await == 3000
    })
    .await;
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(5), &|| warren.logs()).await;
}

/// Found by the balance bench: a subscription cancelled for a new window could still hand on a
/// chunk after the next subscription's first one; that delivery's settlement was not found, the
/// front of the acks waited on it for ever, every later ack went one by one (one a message), and
/// the last deliveries were still unacked at the stop. A deep backlog under large windows that
/// change every cooldown: every delivery is acked, in multi-acks, and nothing goes back to the
/// queue at the stop.
#[tokio::test(flavor = "multi_thread")]
async fn windows_changing_under_a_deep_backlog_leave_no_delivery_unacked() {
    let mut env = TestEnv::new("bal_resub").await;
    balanced(&mut env, "simple", 200);
    env.set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "8")
        .set("USERS_SCALE_THRESHOLD", "4000")
        .set("USERS_BATCH_SIZE", "500")
        .set("USERS_BATCH_TIMEOUT_MS", "200");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let ids = env.publish_users(40_000).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let samples = Samples::start(&env, &["users"]);
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &|| warren.logs()).await;
    let (acks, batches) = acks_and_batches(&env).await;
    assert!(
        samples.values().len() >= 3,
        "the window changed: {:?}",
        samples.values()
    );
    assert!(
        batches > 0.0 && acks <= 2.0 * batches,
        "{acks} acks for {batches} batches; concurrency {:?}",
        samples.values()
    );
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(
        env.queue_state(&env.main_queue).await,
        (0, 0),
        "nothing went back to the queue at the stop"
    );
}
