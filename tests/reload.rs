//! Reload without a restart (`SIGHUP`, `warren ctl reload`), on the real broker and database: a
//! new pipeline is checked against its table and starts (declared, under `--declare`); a changed
//! one drains and starts again with its new spec; a removed one drains (every delivery settled,
//! nothing lost) and stops, leaving the record and the live stages; an unchanged one keeps its
//! consumer (the same consumer tag on the broker); a file that does not check changes nothing
//! (one error line, a `reload_failed` event); `warren ctl reload` is signed and answers what
//! changed; and under load (publishers with confirms while two reloads happen) every confirmed
//! message ends once in its table. A reload runs beside the control loop: while it drains,
//! signals, commands, the heartbeat and SIGTERM are taken at once, and reloads asked for
//! meanwhile run once after it; signals sent while warren starts are applied once it runs; a
//! refused reload declares nothing; after reloads the record and the metrics say what runs; a
//! reload switching a table while inserts wait on a lock of the old one stores each message
//! once, and one renaming a pipeline while its park waits on a lock parks the message once (the
//! drain cancels them before its deadline); a reload switching a table or renaming a pipeline
//! while the old consumer's link is silent (its acks, cancel and close lost) stores and parks
//! each message once when the broker delivers them again.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use serde_json::Value;
use tokio::sync::Mutex;
use uuid::Uuid;

type Names = PipelineNames;

/// A test's pipelines: their names and tables (created), their broker objects and the env's
/// Redis keys removed when it is dropped, and a configuration file holding the first one's
/// entry (batch size 50, qty up to 1000).
struct Fixture {
    names: Vec<Names>,
    _cleanups: Vec<PipelineCleanup>,
    _redis: RedisCleanup,
    _config: ConfigFile,
    /// The configuration file, and its path as `--config` takes it.
    path: std::path::PathBuf,
    file: String,
}

impl Fixture {
    async fn new(env: &TestEnv, pipelines: &[&str]) -> Self {
        let _redis = RedisCleanup::new(env);
        let names: Vec<Names> = pipelines.iter().map(|p| Names::of(env, p)).collect();
        let _cleanups = names.iter().map(Names::cleanup).collect();
        create_tables(env, pipelines).await;
        let _config = ConfigFile::new(&entry(pipelines[0], &names[0], 50, 1000));
        Self {
            names,
            _cleanups,
            _redis,
            path: _config.path().to_path_buf(),
            file: _config.at().to_string(),
            _config,
        }
    }

    /// The `i`-th pipeline's names.
    fn names(&self, i: usize) -> Names {
        self.names[i].clone()
    }
}

/// A `[[pipelines]]` entry writing `{"id": uuid, "qty": n}` into `table` (`id`, `qty`), with
/// `qty` at most `max_qty`.
fn entry(name: &str, names: &Names, batch_size: u32, max_qty: u32) -> String {
    format!(
        r#"
[[pipelines]]
name = "{name}"
table = "{name}"
key = ["id"]
batch_size = {batch_size}
batch_timeout_ms = 50
retry_ttls_ms = [1000]
{}
[pipelines.columns]
id  = {{ path = "/id", type = "uuid" }}
qty = {{ path = "/qty", type = "int4", min = 1, max = {max_qty} }}
"#,
        names.toml()
    )
}

fn body(id: Uuid, qty: u32) -> Vec<u8> {
    format!(r#"{{"id":"{id}","qty":{qty}}}"#).into_bytes()
}

fn props(id: Uuid) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.to_string().into())
}

/// The tables of the pipelines `names`.
async fn create_tables(env: &TestEnv, names: &[&str]) {
    for name in names {
        env.db
            .batch_execute(&format!(
                "CREATE TABLE {name} (id uuid PRIMARY KEY, qty int4 NOT NULL)"
            ))
            .await
            .expect("create table");
    }
}

/// Publishes one message per id (qty 1) to `names`' exchange, pipelined confirms.
async fn publish(env: &TestEnv, names: &Names, ids: &[Uuid]) {
    env.publish_pipelined_to(
        &names.exchange,
        &names.queue,
        ids.iter().map(|id| (body(*id, 1), props(*id))),
    )
    .await;
}

fn new_ids(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
}

/// The ids in `table`.
async fn ids_in(env: &TestEnv, table: &str) -> Vec<Uuid> {
    uuids_of(env, &format!("SELECT id FROM {table}")).await
}

/// Waits until `table` holds as many rows as `expected`, then that they are exactly those.
async fn assert_table(env: &TestEnv, table: &str, expected: &HashSet<Uuid>, warren: &Warren) {
    let what = format!("{} rows in {table}", expected.len());
    let n = expected.len() as i64;
    wait_until(&what, Duration::from_secs(60), || async {
        count_of(env, &format!("SELECT count(*) FROM {table}")).await >= n
    })
    .await;
    let stored = ids_in(env, table).await;
    if stored.len() != expected.len() {
        eprintln!("{}", tail(&warren.logs(), 40));
    }
    assert_same_ids(table, expected, &stored);
}

/// Every consumer on `queue`, from the broker: its tag and its channel (a pipeline started
/// again has the same tag on a channel of a new connection).
async fn tags(queue: &str) -> Vec<String> {
    rabbitmqctl_rows(&[
        "list_consumers",
        "queue_name",
        "channel_pid",
        "consumer_tag",
    ])
    .await
    .into_iter()
    .filter(|row| row["queue_name"].as_str() == Some(queue))
    .map(|row| {
        format!(
            "{} on {}",
            row["consumer_tag"].as_str().unwrap_or_default(),
            row["channel_pid"].as_str().unwrap_or_default()
        )
    })
    .collect()
}

/// Waits until exactly one consumer is on `queue`, and answers its tag.
/// How many of `pipeline`'s consumers have stopped (its stages that a reload stopped, to
/// change or remove them): an untouched pipeline has none. A consumer tag is no such proof: a
/// stage's first accepted delivery opens its window with a new subscription.
fn stops(warren: &Warren, pipeline: &str) -> usize {
    let line = format!("consumer stopped pipeline=\"{pipeline}\"");
    warren.logs().lines().filter(|l| l.contains(&line)).count()
}

async fn one_consumer(queue: &str) -> String {
    wait_until(
        &format!("one consumer on {queue}"),
        Duration::from_secs(30),
        || async { tags(queue).await.len() == 1 },
    )
    .await;
    tags(queue).await.remove(0)
}

/// The env's events of `kind`, oldest first.
async fn events_of(env: &TestEnv, kind: &str) -> Vec<Value> {
    stream_events(env)
        .await
        .into_iter()
        .filter(|e| e["type"] == kind)
        .collect()
}

/// Review R35g F3: a reload whose file also raised `MAX_INSERTS_IN_FLIGHT` (a setting that
/// applies only at a restart) checked the pipeline it added against the new budget, which does
/// not run, and started it past the budget that runs. Now a reload resolves and checks its
/// pipelines against the running values of such settings: refused, naming the budget; without
/// the new pipeline the same file reloads, its new budget named as waiting for a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_checks_what_it_adds_against_the_settings_that_run() {
    let env = TestEnv::new("rl_pinned").await;
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let orders_entry = entry("orders", &orders, 50, 1000);
    // users and orders hold 2 inserts each: a budget of 4, in the file.
    std::fs::write(&path, format!("max_inserts_in_flight = 4\n{orders_entry}")).expect("write");
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;

    std::fs::write(
        &path,
        format!(
            "max_inserts_in_flight = 100\n{orders_entry}{}",
            entry("refunds", &refunds, 50, 1000)
        ),
    )
    .expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("checked with the values that run of max_inserts_in_flight")
            && reason.contains("got 4"),
        "checked against the budget that runs: {failed}"
    );
    assert!(
        events_of(&env, "reloaded").await.is_empty(),
        "nothing added"
    );
    assert!(tags(&refunds.queue).await.is_empty(), "refunds not started");

    std::fs::write(
        &path,
        format!("max_inserts_in_flight = 100\n{orders_entry}"),
    )
    .expect("write");
    reload(&env, &warren, "reloaded", 1).await;
    assert!(
        warren
            .logs()
            .lines()
            .any(|l| l.contains("apply only at a restart") && l.contains("max_inserts_in_flight")),
        "the new budget named as waiting for a restart; log:\n{}",
        warren.logs()
    );
}

/// Sends SIGHUP and waits for the `n`-th event of `kind` (`reloaded`, `reload_failed`); answers it.
async fn reload(env: &TestEnv, warren: &Warren, kind: &str, n: usize) -> Value {
    warren.signal("HUP");
    wait_for_event(env, warren, kind, n).await
}

async fn wait_for_event(env: &TestEnv, warren: &Warren, kind: &str, n: usize) -> Value {
    wait_until(
        &format!("{n} {kind} events"),
        Duration::from_secs(60),
        || async { events_of(env, kind).await.len() >= n },
    )
    .await;
    assert!(
        warren.logs().lines().count() > 0,
        "warren wrote no log; it may have ended"
    );
    events_of(env, kind).await.remove(n - 1)
}

fn names_of(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The pipelines the instance's registry record publishes.
async fn recorded_pipelines(env: &TestEnv, pid: i32) -> Vec<String> {
    instance(env, pid).await["pipelines"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// A transaction holding a lock that blocks inserts into `table` (not reads) until released.
struct TableLock(tokio_postgres::Client);

impl TableLock {
    async fn take(env: &TestEnv, table: &str) -> Self {
        Self::take_in(env, table, "SHARE").await
    }

    /// The lock in `mode` (`ACCESS EXCLUSIVE` keeps reads out too).
    async fn take_in(env: &TestEnv, table: &str, mode: &str) -> Self {
        let (client, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "SET search_path TO {}; BEGIN; LOCK TABLE {table} IN {mode} MODE",
                env.schema
            ))
            .await
            .expect("lock");
        TableLock(client)
    }

    async fn release(self) {
        self.0.batch_execute("ROLLBACK").await.expect("unlock");
    }
}

/// Takes the lock on `table`, publishes `n` new ids to its pipeline (`names`) and waits until
/// warren took them all from the queue: they are held, in flight, until the lock goes.
async fn hold(env: &TestEnv, names: &Names, table: &str, n: usize) -> (TableLock, Vec<Uuid>) {
    let lock = TableLock::take(env, table).await;
    let held = new_ids(n);
    publish(env, names, &held).await;
    wait_until(
        &format!("{table} delivered, held"),
        Duration::from_secs(30),
        || async { env.queue_state(&names.queue).await.0 == 0 },
    )
    .await;
    (lock, held)
}

/// Waits until `names`' queue has no consumer: a drain (a reload's or the shutdown's) started.
async fn cancelled(names: &Names, what: &str) {
    wait_until(what, Duration::from_secs(30), || async {
        tags(&names.queue).await.is_empty()
    })
    .await;
}

/// Adds `refunds`, changes `orders` (a column check), removes `refunds` with deliveries in
/// flight, each by SIGHUP; users, never in the file, keeps its consumer throughout, and every
/// pipeline not changed keeps its own.
#[tokio::test(flavor = "multi_thread")]
async fn sighup_adds_changes_and_removes_pipelines_and_touches_no_other() {
    let mut env = TestEnv::new("rl_sighup").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&env.main_queue).await;
    let mut stored_orders: HashSet<Uuid> = HashSet::new();
    let first = new_ids(20);
    publish(&env, &orders, &first).await;
    stored_orders.extend(first);
    assert_table(&env, "orders", &stored_orders, &warren).await;
    let orders_tag = one_consumer(&orders.queue).await;

    // Added: refunds' queues are declared (warren runs with --declare), its table checked, its
    // stage runs and shows in the record and the metrics.
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["added"]), ["refunds"], "{event}");
    assert!(names_of(&event["changed"]).is_empty(), "{event}");
    assert!(names_of(&event["removed"]).is_empty(), "{event}");
    assert!(
        warren.logs().contains("configuration reloaded"),
        "{}",
        warren.logs()
    );
    let mut stored_refunds: HashSet<Uuid> = new_ids(30).into_iter().collect();
    publish(
        &env,
        &refunds,
        &stored_refunds.iter().copied().collect::<Vec<_>>(),
    )
    .await;
    assert_table(&env, "refunds", &stored_refunds, &warren).await;
    one_consumer(&refunds.queue).await;
    wait_until("refunds in the record", Duration::from_secs(10), || async {
        recorded_pipelines(&env, pid).await == ["users", "orders", "refunds"]
    })
    .await;
    assert_eq!(
        metric(
            &env,
            "warren_messages_inserted_total",
            &[("pipeline", "refunds"), ("stage", "main")]
        )
        .await,
        30.0
    );
    assert_eq!(stops(&warren, "users"), 0, "users untouched");
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");

    // Changed: orders takes qty up to 10 only; its new spec applies (a qty of 50 is refused
    // now, to its DLQ: this instance runs no DLQ stage), the others keep their consumers.
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 10) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let event = reload(&env, &warren, "reloaded", 2).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    assert!(names_of(&event["added"]).is_empty(), "{event}");
    assert_ne!(
        one_consumer(&orders.queue).await,
        orders_tag,
        "orders started again"
    );
    let (small, big) = (Uuid::new_v4(), Uuid::new_v4());
    env.publish_to(&orders.exchange, &orders.queue, &body(big, 50), props(big))
        .await;
    env.publish_to(
        &orders.exchange,
        &orders.queue,
        &body(small, 5),
        props(small),
    )
    .await;
    stored_orders.insert(small);
    assert_table(&env, "orders", &stored_orders, &warren).await;
    wait_until(
        "the qty of 50 in orders' DLQ",
        Duration::from_secs(30),
        || async { env.queue_state(&orders.dlq).await.0 == 1 },
    )
    .await;
    assert_eq!(stops(&warren, "users"), 0, "users untouched");
    assert_eq!(stops(&warren, "refunds"), 0, "refunds untouched");
    assert_eq!(stops(&warren, "orders"), 1, "orders started again once");

    // Removed with deliveries in flight: its inserts are held by a lock when SIGHUP comes; the
    // drain settles every one (rows in the table, the queue empty) before it stops.
    let (lock, held) = hold(&env, &refunds, "refunds", 40).await;
    stored_refunds.extend(held);
    std::fs::write(&path, entry("orders", &orders, 50, 10)).expect("write");
    warren.signal("HUP");
    // The consumer is cancelled first (the shutdown sequence), then the lock goes.
    cancelled(&refunds, "refunds' consumer cancelled").await;
    lock.release().await;
    let event = wait_for_event(&env, &warren, "reloaded", 3).await;
    assert_eq!(names_of(&event["removed"]), ["refunds"], "{event}");
    // Its close answered, its acks are proven: the advice to move its queue has no caveat
    // (review R44 F1: it came always).
    let logs = warren.logs();
    let advice = logs
        .lines()
        .find(|l| l.contains("no pipeline consumes these queues now"))
        .unwrap_or_else(|| panic!("no advice to move refunds' queue: {}", tail(&logs, 30)));
    assert!(
        advice.contains(&refunds.queue) && !advice.contains("wait until the broker dropped"),
        "{advice}"
    );
    // Its stage ends: nothing of it runs on (its consumer's actor stops; this instance runs
    // no DLQ stage).
    warren
        .wait_for_log(
            "refunds/main's consumer stopped",
            "consumer stopped pipeline=\"refunds\" stage=\"main\"",
        )
        .await;
    assert_table(&env, "refunds", &stored_refunds, &warren).await;
    assert_eq!(
        env.queue_state(&refunds.queue).await,
        (0, 0),
        "refunds' queue empty and without consumer"
    );
    wait_queues_settled(&[&refunds.queue], Duration::from_secs(10)).await;
    wait_until(
        "refunds gone from the record",
        Duration::from_secs(10),
        || async {
            let record = instance(&env, pid).await;
            recorded_pipelines(&env, pid).await == ["users", "orders"]
                && record["stages"].get("refunds/main").is_none()
        },
    )
    .await;
    assert_eq!(stops(&warren, "users"), 0, "users untouched");
    assert_eq!(tags(&env.main_queue).await.len(), 1, "users consumes");
    assert_eq!(stops(&warren, "orders"), 1, "orders untouched");
    // Still ready: /readyz waits for no link of refunds.
    let ready = metrics_get(&env, "/readyz").await;
    assert_eq!(ready.as_ref().map(|r| r.0), Some(200), "{ready:?}");
    // Users still flows.
    let users: HashSet<Uuid> = env.publish_users(10).await.into_iter().collect();
    assert_rows_exactly(&env, &users, Duration::from_secs(30), &|| warren.logs()).await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A file that does not check leaves everything as it was (one error line naming the entry and
/// field, a `reload_failed` event); `warren ctl reload` is refused unsigned under
/// CONTROL_SECRET, answers the error signed, then what changed once the file is fixed.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_file_changes_nothing_and_ctl_reload_answers_signed() {
    let mut env = TestEnv::new("rl_bad").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("CONTROL_SECRET", "a-reload-secret-of-the-deployment");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let good = entry("orders", &orders, 50, 1000);
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&orders.queue).await;
    wait_running(&env, pid).await;

    // batch_size 0 is out of range: nothing changes.
    std::fs::write(&path, good.replace("batch_size = 50", "batch_size = 0")).expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    let reason = failed["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason.contains("batch_size") && reason.contains("orders"),
        "the reason names the entry and the field: {failed}"
    );
    let errors: Vec<String> = warren
        .logs()
        .lines()
        .filter(|l| l.contains("reload failed"))
        .map(String::from)
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {errors:?}");
    assert!(errors[0].contains("batch_size"), "{}", errors[0]);
    assert!(events_of(&env, "reloaded").await.is_empty());
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");
    let ids = new_ids(20);
    publish(&env, &orders, &ids).await;
    assert_table(&env, "orders", &ids.into_iter().collect(), &warren).await;

    // Unsigned: refused, nothing applied.
    let (code, out, err) = {
        let mut cmd = env.command(&["ctl", "reload", "--all"]);
        cmd.env("CONTROL_SECRET", "");
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .expect("join")
            .expect("run");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("reload  failed: refused: unsigned"),
        "{out}{err}"
    );
    assert_eq!(
        events_of(&env, "reload_failed").await.len(),
        1,
        "not applied"
    );

    // Signed, the file still bad: the error is the answer.
    let (code, out, err) = env.run_async(&["ctl", "reload", "--all"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("reload  failed: reload failed, nothing changed:")
            && out.contains("batch_size"),
        "{out}{err}"
    );
    // Fixed, with refunds beside: what changed is the answer.
    std::fs::write(&path, good.clone() + &entry("refunds", &refunds, 50, 1000)).expect("write");
    let (code, out, err) = env.run_async(&["ctl", "reload", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("reload  executed: added refunds; unchanged users, orders"),
        "{out}{err}"
    );
    let ids = new_ids(10);
    publish(&env, &refunds, &ids).await;
    assert_table(&env, "refunds", &ids.into_iter().collect(), &warren).await;
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");

    // A new pipeline is checked against its table, as at start: audit has none.
    let audit = Names::of(&env, "audit");
    let _c3 = audit.cleanup();
    std::fs::write(
        &path,
        good.clone() + &entry("refunds", &refunds, 50, 1000) + &entry("audit", &audit, 50, 1000),
    )
    .expect("write");
    let (code, out, err) = env.run_async(&["ctl", "reload", "--all"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("reload  failed: reload failed, nothing changed:") && out.contains("audit"),
        "{out}{err}"
    );
    assert!(
        recorded_pipelines(&env, pid).await == ["users", "orders", "refunds"],
        "nothing changed"
    );
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");
    // --pipeline is refused, as drain's.
    let (code, out, err) = env
        .run_async(&["ctl", "reload", "--all", "--pipeline", "orders"])
        .await;
    assert_ne!(code, 0, "{out}{err}");
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Without `--declare`, a pipeline a reload adds whose exchanges and queues were never
/// declared is refused (nothing changes, the reason names what to declare): started, it would
/// fail to subscribe for ever and take the instance's readiness with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_pipeline_added_before_its_queues_are_declared_is_refused() {
    let mut env = TestEnv::new("rl_undeclared").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;

    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("not declared") && reason.contains(&refunds.queue),
        "the reason names what to declare: {failed}"
    );
    assert!(events_of(&env, "reloaded").await.is_empty());
    let ready = metrics_get(&env, "/readyz").await;
    assert_eq!(ready.as_ref().map(|r| r.0), Some(200), "{ready:?}");
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Without `--declare`, a reload checks that the objects of a changed pipeline match what it
/// declares, not only that they exist (review R35g F5): orders' main queue renamed, its new
/// queue declared and bound, but its retry queue still dead-letters to the old one, where every
/// retried message would be stranded. The reload is refused naming the retry queue and the
/// argument, and orders goes on as it ran. Then the file as it runs, but orders' retry queue
/// declared again dead-lettering elsewhere: refused too, though orders is unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_onto_a_retry_queue_that_dead_letters_elsewhere_is_refused() {
    let mut env = TestEnv::new("rl_drift").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;

    // The new main queue, declared and bound as `warren declare` would.
    let renamed = Names {
        queue: format!("{}_v2", orders.queue),
        ..orders.clone()
    };
    let _c2 = PipelineCleanup::queues(&[&renamed.queue]);
    let channel = env.conn.create_channel().await.expect("channel");
    let mut args = lapin::types::FieldTable::default();
    for (key, value) in [
        ("x-dead-letter-exchange", orders.dlx.as_str()),
        ("x-dead-letter-routing-key", orders.dlq.as_str()),
    ] {
        args.insert(
            key.into(),
            lapin::types::AMQPValue::LongString(value.into()),
        );
    }
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(renamed.queue.as_str().into(), durable, args)
        .await
        .expect("the new main queue");
    channel
        .queue_bind(
            renamed.queue.as_str().into(),
            renamed.exchange.as_str().into(),
            renamed.queue.as_str().into(),
            Default::default(),
            Default::default(),
        )
        .await
        .expect("bound");

    std::fs::write(&path, entry("orders", &renamed, 50, 1000)).expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    let reason = failed["reason"].as_str().unwrap_or_default();
    let expected = format!(
        "queue {} exists with x-dead-letter-routing-key = {}, but warren declares \
         x-dead-letter-routing-key = {}",
        orders.retry, orders.queue, renamed.queue
    );
    assert!(reason.contains(&expected), "{expected}\n{failed}");
    assert!(events_of(&env, "reloaded").await.is_empty());
    assert_eq!(stops(&warren, "orders"), 0, "orders untouched");
    let ids = new_ids(10);
    publish(&env, &orders, &ids).await;
    assert_table(&env, "orders", &ids.into_iter().collect(), &warren).await;

    // The file as it runs, but the retry queue of the unchanged pipeline declared again with
    // other arguments (review R35h F4: checked only for what a reload starts, it passed, and
    // every retried message was dropped by the broker).
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    channel
        .queue_delete(orders.retry.as_str().into(), Default::default())
        .await
        .expect("delete the retry queue");
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongInt(1000),
    );
    for (key, value) in [
        ("x-dead-letter-exchange", orders.exchange.as_str()),
        ("x-dead-letter-routing-key", renamed.queue.as_str()),
    ] {
        args.insert(
            key.into(),
            lapin::types::AMQPValue::LongString(value.into()),
        );
    }
    channel
        .queue_declare(orders.retry.as_str().into(), durable, args)
        .await
        .expect("the retry queue, dead-lettering elsewhere");
    let failed = reload(&env, &warren, "reload_failed", 2).await;
    let reason = failed["reason"].as_str().unwrap_or_default();
    let expected = format!(
        "queue {} exists with x-dead-letter-routing-key = {}, but warren declares \
         x-dead-letter-routing-key = {}",
        orders.retry, renamed.queue, orders.queue
    );
    assert!(reason.contains(&expected), "{expected}\n{failed}");
    assert!(events_of(&env, "reloaded").await.is_empty());
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Publishes `{"id", "qty": 1}` messages to `names` with pipelined confirms (chunks of 100)
/// until `stop`, recording every confirmed id in `confirmed`.
async fn publish_until(
    channel: lapin::Channel,
    names: Names,
    stop: Arc<AtomicBool>,
    confirmed: Arc<Mutex<Vec<Uuid>>>,
) {
    while !stop.load(Ordering::Relaxed) {
        let ids = new_ids(100);
        let mut pending = Vec::with_capacity(ids.len());
        for id in &ids {
            let confirm = channel
                .basic_publish(
                    names.exchange.as_str().into(),
                    names.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body(*id, 1),
                    props(*id),
                )
                .await
                .expect("publish");
            pending.push(confirm);
        }
        for (id, c) in ids.iter().zip(pending) {
            if c.await.expect("confirm").is_ack() {
                confirmed.lock().await.push(*id);
            }
        }
    }
}

/// Publishers keep publishing with confirms while two reloads happen (one changes the pipeline
/// under load, one adds another beside it): every confirmed message is once in its table.
#[tokio::test(flavor = "multi_thread")]
async fn under_load_two_reloads_lose_and_duplicate_nothing() {
    let mut env = TestEnv::new("rl_load").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;

    let stop = Arc::new(AtomicBool::new(false));
    let orders_confirmed = Arc::new(Mutex::new(Vec::new()));
    let refunds_confirmed = Arc::new(Mutex::new(Vec::new()));
    // Each publisher on a connection of its own.
    let channel = |_: &TestEnv| async {
        let conn = lapin::Connection::connect(&amqp_url(), Default::default())
            .await
            .expect("connect");
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(Default::default())
            .await
            .expect("confirms");
        // The connection lives as long as the test process's publishers need it.
        std::mem::forget(conn);
        ch
    };
    let orders_publisher = tokio::spawn(publish_until(
        channel(&env).await,
        Names::of(&env, "orders"),
        stop.clone(),
        orders_confirmed.clone(),
    ));
    let at_least = |confirmed: Arc<Mutex<Vec<Uuid>>>, n: usize| async move {
        wait_until(
            &format!("{n} confirmed"),
            Duration::from_secs(60),
            || async { confirmed.lock().await.len() >= n },
        )
        .await;
    };
    at_least(orders_confirmed.clone(), 1500).await;

    // One reload changes orders under load (a smaller batch): it drains and starts again.
    std::fs::write(&path, entry("orders", &orders, 20, 1000)).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let n = orders_confirmed.lock().await.len();
    at_least(orders_confirmed.clone(), n + 1500).await;

    // The other adds refunds, published at once.
    std::fs::write(
        &path,
        entry("orders", &orders, 20, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let event = reload(&env, &warren, "reloaded", 2).await;
    assert_eq!(names_of(&event["added"]), ["refunds"], "{event}");
    assert!(names_of(&event["changed"]).is_empty(), "{event}");
    let refunds_publisher = tokio::spawn(publish_until(
        channel(&env).await,
        Names::of(&env, "refunds"),
        stop.clone(),
        refunds_confirmed.clone(),
    ));
    let n = orders_confirmed.lock().await.len();
    at_least(orders_confirmed.clone(), n + 1500).await;
    at_least(refunds_confirmed.clone(), 1500).await;
    stop.store(true, Ordering::Relaxed);
    orders_publisher.await.expect("orders publisher");
    refunds_publisher.await.expect("refunds publisher");

    let orders_ids: HashSet<Uuid> = orders_confirmed.lock().await.iter().copied().collect();
    let refunds_ids: HashSet<Uuid> = refunds_confirmed.lock().await.iter().copied().collect();
    assert_table(&env, "orders", &orders_ids, &warren).await;
    assert_table(&env, "refunds", &refunds_ids, &warren).await;
    wait_queues_settled(
        &[&orders.queue, &orders.dlq, &refunds.queue, &refunds.dlq],
        Duration::from_secs(30),
    )
    .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// The instance's pause and a pipeline's own are two layers: `SIGCONT` lifts the instance's
/// (`SIGUSR1`) and leaves a pipeline paused by `warren ctl pause --pipeline` held, and a reload
/// that changes that pipeline starts it again held; `resume --pipeline` lets it go.
#[tokio::test(flavor = "multi_thread")]
async fn sigcont_and_reloads_keep_a_pipelines_own_pause() {
    let mut env = TestEnv::new("rl_holds").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    one_consumer(&env.main_queue).await;
    wait_running(&env, warren.pid()).await;
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let no_consumer = |queue: String| async move { tags(&queue).await.is_empty() };
    wait_until("orders paused", Duration::from_secs(20), || {
        no_consumer(orders.queue.clone())
    })
    .await;

    warren.signal("USR1");
    wait_until("users paused", Duration::from_secs(20), || {
        no_consumer(env.main_queue.clone())
    })
    .await;
    warren.signal("CONT");
    one_consumer(&env.main_queue).await;
    let held = new_ids(10);
    publish(&env, &orders, &held).await;
    // Users flows again: its rows prove SIGCONT was handled; orders is still held.
    let users: HashSet<Uuid> = env.publish_users(5).await.into_iter().collect();
    assert_rows_exactly(&env, &users, Duration::from_secs(30), &|| warren.logs()).await;
    assert_eq!(
        env.queue_state(&orders.queue).await,
        (10, 0),
        "SIGCONT resumed the pipeline paused on its own"
    );

    // Changed by a reload: started again, still held.
    std::fs::write(&path, entry("orders", &orders, 20, 1000)).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let more = env.publish_users(5).await;
    let users: HashSet<Uuid> = users.into_iter().chain(more).collect();
    assert_rows_exactly(&env, &users, Duration::from_secs(30), &|| warren.logs()).await;
    assert_eq!(
        env.queue_state(&orders.queue).await,
        (10, 0),
        "the reload let the paused pipeline go"
    );

    let (code, out, err) = env
        .run_async(&["ctl", "resume", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert_table(&env, "orders", &held.into_iter().collect(), &warren).await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Signals while `warren run` still waits for its database (its configuration read) end
/// nothing and are not lost: once the database answers, `SIGHUP` applies the file changed
/// meanwhile and `SIGUSR1`, `SIGCONT`, `SIGUSR1` leave it paused (their order kept).
#[tokio::test(flavor = "multi_thread")]
async fn signals_during_the_start_apply_once_warren_runs() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("rl_start").await;
    env.set("DATABASE_URL", proxy.url())
        .set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let both = entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000);
    std::fs::write(&path, &both).expect("write");
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    // A configured pipeline: its table is checked before anything runs, which waits.
    proxy.cut();
    let mut warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log(
            "the wait for the database",
            "cannot check the pipelines' tables yet",
        )
        .await;
    std::fs::write(&path, &both).expect("write");
    for signal in ["HUP", "USR1", "HUP", "CONT", "USR1"] {
        warren.signal(signal);
    }
    let ids: HashSet<Uuid> = env.publish_users(20).await.into_iter().collect();
    assert!(
        warren.is_running(),
        "a signal during the start ended warren:\n{}",
        warren.logs()
    );
    proxy.restore();
    let event = wait_for_event(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["added"]), ["refunds"], "{event}");
    wait_until(
        "the record says paused",
        Duration::from_secs(20),
        || async { beat(&env, warren.pid()).await.0 == "paused" },
    )
    .await;
    wait_until("refunds in the record", Duration::from_secs(10), || async {
        recorded_pipelines(&env, warren.pid()).await == ["users", "orders", "refunds"]
    })
    .await;
    assert!(
        ids_in(&env, "users").await.is_empty(),
        "paused: nothing taken"
    );
    warren.signal("CONT");
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;
    assert_eq!(
        events_of(&env, "reloaded").await.len(),
        1,
        "the two SIGHUPs of the start are one reload"
    );
    warren.terminate_ok(Duration::from_secs(25));
}

/// Whether the process `pid` catches every signal of `numbers` (`SigCgt` in its
/// `/proc/<pid>/status`).
fn catches(pid: i32, numbers: &[i32]) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or(0);
    numbers.iter().all(|n| mask & (1 << (n - 1)) != 0)
}

/// `SIGUSR1` and `SIGHUP` sent the moment warren catches them (before it even logs), then
/// again at growing delays while it starts: it runs on, ends paused, and reloads.
#[tokio::test(flavor = "multi_thread")]
async fn signals_right_after_the_exec_are_kept() {
    let mut env = TestEnv::new("rl_exec").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _redis = RedisCleanup::new(&env);
    let mut warren = env.start(&["--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !catches(pid, &[libc::SIGHUP, libc::SIGUSR1]) {
        assert!(std::time::Instant::now() < deadline, "never caught");
        std::thread::yield_now();
    }
    // SAFETY: a signal to the child this test started.
    unsafe {
        libc::kill(pid, libc::SIGUSR1);
        libc::kill(pid, libc::SIGHUP);
    }
    // Again and again while it starts, at growing delays.
    for delay_ms in [1, 2, 5, 10, 20, 50, 100, 200] {
        std::thread::sleep(Duration::from_millis(delay_ms));
        // SAFETY: as above.
        unsafe {
            libc::kill(pid, libc::SIGHUP);
            libc::kill(pid, libc::SIGUSR1);
        }
        assert!(warren.is_running(), "{}", warren.logs());
    }
    let event = wait_for_event(&env, &warren, "reloaded", 1).await;
    assert!(names_of(&event["added"]).is_empty(), "{event}");
    wait_until(
        "the record says paused",
        Duration::from_secs(20),
        || async { beat(&env, pid).await.0 == "paused" },
    )
    .await;
    assert!(warren.is_running(), "{}", warren.logs());
    assert!(tags(&env.main_queue).await.is_empty(), "users paused");
    warren.terminate_ok(Duration::from_secs(25));
}

/// `warren ctl reload` run in the background: (exit code, stdout, stderr) once it answers.
fn ctl_reload(env: &TestEnv) -> tokio::task::JoinHandle<(i32, String, String)> {
    let mut cmd = env.command(&["ctl", "reload", "--all"]);
    tokio::spawn(async move {
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .expect("join")
            .expect("run");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
}

/// The instance's status and its last heartbeat (seconds), from its record.
async fn beat(env: &TestEnv, pid: i32) -> (String, u64) {
    let record = instance(env, pid).await;
    (
        record["status"].as_str().unwrap_or_default().to_string(),
        record["last_heartbeat"].as_u64().unwrap_or(0),
    )
}

/// A reload that drains (refunds removed while its inserts are held by a lock) runs beside the
/// control loop: meanwhile SIGUSR1 pauses and SIGCONT resumes the pipelines that stay, `ctl
/// pause/resume --pipeline` are answered, the record keeps beating, and the reloads asked for
/// meanwhile (two SIGHUPs, a second `ctl reload`) run once after it, each `ctl reload` answered
/// by the reload that covered it. Every held delivery ends in refunds' table.
#[tokio::test(flavor = "multi_thread")]
async fn a_draining_reload_blocks_no_signal_command_or_heartbeat() {
    let mut env = TestEnv::new("rl_beside").await;
    // The drain lasts until the test lets the lock go: a bound of 20 s ran out on a loaded
    // machine before the steps below were done (refunds gone, the command not refused).
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("SHUTDOWN_TIMEOUT_MS", "120000");
    let fx = Fixture::new(&env, &["orders", "refunds", "audit"]).await;
    let (orders, refunds, audit, path, file) = (
        fx.names(0),
        fx.names(1),
        fx.names(2),
        fx.path.clone(),
        fx.file.clone(),
    );
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&refunds.queue).await;
    one_consumer(&env.main_queue).await;
    wait_until("registered", Duration::from_secs(20), || async {
        beat(&env, pid).await.0 == "running"
    })
    .await;

    let (lock, held) = hold(&env, &refunds, "refunds", 20).await;
    // The first reload removes refunds, asked by `warren ctl reload`: it drains until the lock
    // goes.
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    let first = ctl_reload(&env);
    cancelled(&refunds, "refunds' consumer cancelled: the drain under way").await;

    // The record beats on while the ctl reload waits for its answer.
    let (_, then) = beat(&env, pid).await;
    wait_until(
        "a heartbeat during the reload",
        Duration::from_secs(5),
        || async { beat(&env, pid).await.1 > then },
    )
    .await;
    // SIGUSR1 and SIGCONT apply now, in their order, to the pipelines that stay.
    warren.signal("USR1");
    wait_until(
        "users paused during the reload",
        Duration::from_secs(10),
        || async { tags(&env.main_queue).await.is_empty() },
    )
    .await;
    wait_until(
        "the record says paused",
        Duration::from_secs(10),
        || async { beat(&env, pid).await.0 == "paused" },
    )
    .await;
    warren.signal("CONT");
    one_consumer(&env.main_queue).await;
    // Commands are answered meanwhile.
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    wait_until("orders paused", Duration::from_secs(10), || async {
        tags(&orders.queue).await.is_empty()
    })
    .await;
    let (code, out, err) = env
        .run_async(&["ctl", "resume", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    one_consumer(&orders.queue).await;
    // A `--pipeline` command for the pipeline being removed says why it is refused.
    let (code, out, err) = env
        .run_async(&["ctl", "rate", "5", "--all", "--pipeline", "refunds"])
        .await;
    assert_ne!(code, 0, "{out}{err}");
    assert!(out.contains("reload in progress"), "{out}{err}");

    // Asked for meanwhile: two SIGHUPs and a ctl reload, for a file that adds audit.
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("audit", &audit, 50, 1000),
    )
    .expect("write");
    warren.signal("HUP");
    let second = ctl_reload(&env);
    warren.signal("HUP");
    wait_until(
        "the second ctl reload taken, to run after the first",
        Duration::from_secs(10),
        || async {
            warren
                .logs()
                .matches("remote command: reload asked")
                .count()
                == 2
        },
    )
    .await;
    assert!(
        events_of(&env, "reloaded").await.is_empty(),
        "still draining"
    );

    lock.release().await;
    let (code, out, err) = first.await.expect("first ctl");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("reload  executed: removed refunds; unchanged users, orders"),
        "{out}{err}"
    );
    let (code, out, err) = second.await.expect("second ctl");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("reload  executed: added audit; unchanged users, orders"),
        "{out}{err}"
    );
    assert_table(&env, "refunds", &held.into_iter().collect(), &warren).await;
    // One reload ran for the three asked meanwhile: a sentinel reload is the third.
    let event = reload(&env, &warren, "reloaded", 3).await;
    assert!(names_of(&event["added"]).is_empty(), "{event}");
    let all = events_of(&env, "reloaded").await;
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!(names_of(&all[0]["removed"]), ["refunds"], "{all:?}");
    assert_eq!(names_of(&all[1]["added"]), ["audit"], "{all:?}");
    wait_until("audit in the record", Duration::from_secs(10), || async {
        recorded_pipelines(&env, pid).await == ["users", "orders", "audit"]
    })
    .await;
    let ids = new_ids(10);
    publish(&env, &audit, &ids).await;
    assert_table(&env, "audit", &ids.into_iter().collect(), &warren).await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// SIGTERM during a reload's drain starts the shutdown at once; the stages the reload stops
/// are drained by it with the rest (every held delivery ends in its table), and warren exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_a_reload_shuts_down_at_once() {
    let mut env = TestEnv::new("rl_term").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("SHUTDOWN_TIMEOUT_MS", "20000");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let mut warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&refunds.queue).await;
    let (lock, held) = hold(&env, &refunds, "refunds", 20).await;
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    warren.signal("HUP");
    cancelled(&refunds, "refunds' consumer cancelled: the drain under way").await;
    // The lock still holds the drain: the shutdown starts anyway.
    warren.begin_shutdown().await;
    assert!(
        warren.logs().contains("reload interrupted by the shutdown"),
        "{}",
        warren.logs()
    );
    assert!(warren.is_running(), "draining");
    lock.release().await;
    let status = warren.wait(Duration::from_secs(25));
    assert_eq!(status.code(), Some(0), "{}", warren.logs());
    assert_same_ids(
        "refunds",
        &held.into_iter().collect(),
        &ids_in(&env, "refunds").await,
    );
    assert!(events_of(&env, "reloaded").await.is_empty());
}

/// Under `--declare`, a reload refused for a table (audit has none) declares nothing of the
/// new configuration on the broker: everything is checked before anything is declared.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_reload_declares_nothing() {
    let mut env = TestEnv::new("rl_nodecl").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let audit = Names::of(&env, "audit");
    let _audit = audit.cleanup();
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("audit", &audit, 50, 1000),
    )
    .expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    assert!(
        failed["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("audit"),
        "{failed}"
    );
    for exchange in [&audit.exchange, &audit.retry_exchange, &audit.dlx] {
        assert!(
            !env.exchange_exists(exchange).await,
            "{exchange} declared by a refused reload"
        );
    }
    for queue in [&audit.queue, &audit.retry, &audit.dlq] {
        assert!(
            !env.queue_exists(queue).await,
            "{queue} declared by a refused reload"
        );
    }
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// What the record and the metrics say after reloads is what runs: a pipeline removed and
/// added again has its DLQ stage in the record again, a removed one's broker link leaves
/// `warren_amqp_node_info` (at 0), the record's rate is the one the first pipeline runs after a
/// reload started it again, and `warren events --pipeline` shows a removed pipeline's past.
#[tokio::test(flavor = "multi_thread")]
async fn after_reloads_the_record_and_metrics_say_what_runs() {
    let mut env = TestEnv::new("rl_drift").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    let both = entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000);
    std::fs::write(&path, &both).expect("write");
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&refunds.queue).await;
    let stages = |record: &Value| -> Vec<String> {
        record["stages"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    let all_stages = [
        "orders/dlq",
        "orders/main",
        "refunds/dlq",
        "refunds/main",
        "users/dlq",
        "users/main",
    ];
    wait_until(
        "every stage in the record",
        Duration::from_secs(20),
        || async { stages(&instance(&env, pid).await) == all_stages },
    )
    .await;
    wait_until(
        "refunds/main's link on a node",
        Duration::from_secs(20),
        || async {
            try_metric(&env, "warren_amqp_node_info", &[("link", "refunds/main")]).await
                == Some(1.0)
        },
    )
    .await;
    // An event about refunds, for its past.
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "refunds"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    // Messages wait in refunds' queue, and its gauge says so.
    let held = new_ids(5);
    publish(&env, &refunds, &held).await;
    let depth = |queue: String| {
        let env = &env;
        async move { try_metric(env, "warren_queue_messages", &[("queue", &queue)]).await }
    };
    wait_until(
        "refunds' queue gauge at 5",
        Duration::from_secs(20),
        || async { depth(refunds.queue.clone()).await == Some(5.0) },
    )
    .await;
    // A rate for every pipeline: the record shows it.
    let (code, out, err) = env.run_async(&["ctl", "rate", "7", "--all"]).await;
    assert_eq!(code, 0, "{out}{err}");
    wait_until("the record's rate 7", Duration::from_secs(10), || async {
        instance(&env, pid).await["rate_limit_per_s"] == 7
    })
    .await;

    // Removed: its stages and its link leave what the record and the metrics say.
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["removed"]), ["refunds"], "{event}");
    wait_until("refunds' stages gone", Duration::from_secs(10), || async {
        stages(&instance(&env, pid).await)
            == ["orders/dlq", "orders/main", "users/dlq", "users/main"]
    })
    .await;
    for stage in ["main", "dlq"] {
        let link = format!("refunds/{stage}");
        assert_eq!(
            metric(&env, "warren_amqp_node_info", &[("link", &link)]).await,
            0.0,
            "{link} is on no node"
        );
    }
    // Its queues are no longer polled: their series leave the scrape, neither frozen at their
    // last value (review R35g F2) nor at 0 consumers, which fired WarrenMainQueueNoConsumers
    // for a pipeline that no longer exists (review R44 F8), though the messages still wait
    // there.
    let queue_series = |queue: String| {
        let env = &env;
        async move {
            let scrape = Scrape::parse(scrape_text(env).await.expect("metrics endpoint"));
            ["warren_queue_messages", "warren_queue_consumers"]
                .iter()
                .map(|name| scrape.matching(name, &[("queue", &queue)]).count())
                .sum::<usize>()
        }
    };
    wait_until(
        "refunds' queue series gone from the scrape",
        Duration::from_secs(20),
        || async {
            queue_series(refunds.queue.clone()).await == 0
                && queue_series(refunds.dlq.clone()).await == 0
        },
    )
    .await;
    assert_eq!(queue_series(orders.queue.clone()).await, 2, "orders' stay");
    assert_eq!(
        env.queue_state(&refunds.queue).await,
        (5, 0),
        "still waiting"
    );
    // Its past events are shown.
    let (code, out, err) = env.run_async(&["events", "--pipeline", "refunds"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("paused"), "{out}{err}");
    let (code, out, err) = env.run_async(&["events", "--pipeline", "nosuch"]).await;
    assert_ne!(code, 0, "{out}{err}");

    // Added again: both its stages are back in the record, and it consumes.
    std::fs::write(&path, &both).expect("write");
    let event = reload(&env, &warren, "reloaded", 2).await;
    assert_eq!(names_of(&event["added"]), ["refunds"], "{event}");
    wait_until(
        "every stage in the record again",
        Duration::from_secs(10),
        || async { stages(&instance(&env, pid).await) == all_stages },
    )
    .await;
    let ids = new_ids(10);
    publish(&env, &refunds, &ids).await;
    assert_table(
        &env,
        "refunds",
        &ids.into_iter().chain(held).collect(),
        &warren,
    )
    .await;
    // Polled again, its queues' series are back.
    wait_until(
        "refunds' queue series back",
        Duration::from_secs(20),
        || async { queue_series(refunds.queue.clone()).await == 2 },
    )
    .await;

    // users started again by a reload runs at its own rate (0): so does the record.
    std::fs::write(&path, format!("users_batch_size = 7\n{both}")).expect("write");
    let event = reload(&env, &warren, "reloaded", 3).await;
    assert_eq!(names_of(&event["changed"]), ["users"], "{event}");
    wait_until("the record's rate 0", Duration::from_secs(10), || async {
        instance(&env, pid).await["rate_limit_per_s"] == 0
    })
    .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload that switches a pipeline's table while its batch inserts wait on a lock of the old
/// table, with a drain bound shorter than the lock (`SHUTDOWN_TIMEOUT_MS=2000`): the inserts
/// still waiting before the drain's deadline are cancelled, their deliveries go back to the
/// queue, and the stage started in its place stores each message once, in the new table; when
/// the lock goes, the old table gets nothing. Before, the old inserts were left waiting and
/// committed when the lock went: every message in both tables (review R35-F1).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_the_table_behind_a_lock_stores_each_message_once() {
    let mut env = TestEnv::new("rl_lock").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "2000");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;

    let lock = InsertLock::take_on(&env, "orders").await;
    let held = new_ids(300);
    publish(&env, &orders, &held).await;
    lock.wait_for_a_blocked_insert(&env).await;
    let blocked = lock.blocked(&env).await;
    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    assert!(switched.contains("orders_new"), "{switched}");
    std::fs::write(&path, switched).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let expected: HashSet<Uuid> = held.iter().copied().collect();
    assert_table(&env, "orders_new", &expected, &warren).await;

    // The lock goes: an old insert still waiting would commit now.
    lock.release().await;
    wait_until("the old inserts ended", Duration::from_secs(30), || async {
        active_backends(&env, &blocked).await == 0
    })
    .await;
    let old: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
    assert!(
        old.is_empty(),
        "{} of the {} messages stored in the old table too; log:\n{}",
        old.intersection(&expected).count(),
        expected.len(),
        tail(&warren.logs(), 40)
    );
    assert_table(&env, "orders_new", &expected, &warren).await;
    assert!(
        warren
            .logs()
            .contains("statements still running are cancelled"),
        "{}",
        tail(&warren.logs(), 40)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload that switches a pipeline's table while the answer to a batch's insert is lost (the
/// link to PostgreSQL goes silent right after the client sent it; the server committed): the
/// statement outlasts its bound during the stop, and its messages, stored in the old table, are
/// found there and acked, not given back to be stored again in the new one. Before, every such
/// message was in both tables (review R35i F9).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_the_table_while_an_inserts_answer_is_lost_stores_each_message_once() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("rl_lost_commit").await;
    env.set("DATABASE_URL", pg.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "1000")
        .set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(100);
    publish(&env, &orders, &warm).await;
    assert_table(&env, "orders", &warm.iter().copied().collect(), &warren).await;

    pg.hold_after_next_send("warren-pipeline");
    let held = new_ids(200);
    publish(&env, &orders, &held).await;
    wait_until(
        "an insert's answer held",
        Duration::from_secs(30),
        || async { pg.hold_fired() },
    )
    .await;
    // At once, within the client's bound (1 s + 2 s): the batch fails during the stop.
    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    std::fs::write(&path, switched).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let all: HashSet<Uuid> = warm.iter().chain(&held).copied().collect();
    wait_until("every message stored", Duration::from_secs(60), || async {
        let mut stored: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
        stored.extend(ids_in(&env, "orders_new").await);
        stored == all
    })
    .await;
    pg.release();
    let old: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
    let new: HashSet<Uuid> = ids_in(&env, "orders_new").await.into_iter().collect();
    let both: Vec<&Uuid> = old.intersection(&new).collect();
    assert!(
        both.is_empty(),
        "{} messages in both tables; log:\n{}",
        both.len(),
        tail(&warren.logs(), 40)
    );
    // The lost answer was met and looked up: by the stop's look-up of a group, or, when the
    // group was split down to one row before the stop began, by the one row's (CI once).
    let logs = warren.logs();
    assert!(
        logs.contains("rows whose statement got no answer at the stop are stored as they are")
            || logs.contains("a refused row is already stored as it is"),
        "the lost answer was met and looked up: {}",
        tail(&logs, 40)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review R46a F6 (a duplicate): the same lost answer, and the stage's other connections to
/// PostgreSQL half-open too (nothing the server sends reaches them), so the stop cannot ask
/// its table whether the batch committed. Its messages go back to the queue remembered as acks
/// the old stage may have made; the stage the reload starts asks the old table about their
/// redeliveries (on connections of its own) and acks those stored there. Before, they were
/// given back as "not inserted" and stored again in the new table.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_the_table_while_every_old_link_is_half_open_stores_each_message_once() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("rl_lost_commit_all").await;
    // The drain's deadline comes before the held statement's bound (3 s), as with the
    // defaults (20 s against 32 s): the stop waits for the statement past its deadline.
    env.set("DATABASE_URL", pg.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "1000")
        .set("SHUTDOWN_TIMEOUT_MS", "1000");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(100);
    publish(&env, &orders, &warm).await;
    assert_table(&env, "orders", &warm.iter().copied().collect(), &warren).await;

    pg.hold_after_next_send("warren-pipeline");
    let held = new_ids(200);
    publish(&env, &orders, &held).await;
    wait_until(
        "an insert's answer held",
        Duration::from_secs(30),
        || async { pg.hold_fired() },
    )
    .await;
    // Every live connection of the pipelines' pool goes half-open; new ones pass.
    pg.hold_named("warren-pipeline");
    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    std::fs::write(&path, switched).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let all: HashSet<Uuid> = warm.iter().chain(&held).copied().collect();
    wait_until("every message stored", Duration::from_secs(90), || async {
        let mut stored: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
        stored.extend(ids_in(&env, "orders_new").await);
        stored == all
    })
    .await;
    wait_until(
        "every message settled on the broker",
        Duration::from_secs(60),
        || async { queue_counts(&orders.queue).await == (0, 0) },
    )
    .await;
    pg.release();
    let old: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
    let new: HashSet<Uuid> = ids_in(&env, "orders_new").await.into_iter().collect();
    let both: Vec<&Uuid> = old.intersection(&new).collect();
    assert!(
        both.is_empty(),
        "{} messages in both tables; log:\n{}",
        both.len(),
        tail(&warren.logs(), 40)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload that switches a pipeline's table while a batch's insert is on its way to the
/// server (held in the proxy: the server has not received it) (review R38-F2): the statement
/// outlasts its bound during the stop and its batch goes back to the queue, to be stored in the
/// new table. The old session is ended first, so the held insert, delivered after that, runs
/// nowhere. Before, the cancel reached an idle server process, the batch went back, and the
/// insert, delivered late, committed in the old table: the messages were in both.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_the_table_while_an_insert_is_on_its_way_stores_each_message_once() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("rl_in_transit").await;
    env.set("DATABASE_URL", pg.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "1000")
        .set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(100);
    publish(&env, &orders, &warm).await;
    assert_table(&env, "orders", &warm.iter().copied().collect(), &warren).await;

    pg.hold_next_send("warren-pipeline");
    let held = new_ids(200);
    publish(&env, &orders, &held).await;
    wait_until(
        "an insert held on its way",
        Duration::from_secs(30),
        || async { pg.held_before_fired() },
    )
    .await;
    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    std::fs::write(&path, switched).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    let all: HashSet<Uuid> = warm.iter().chain(&held).copied().collect();
    wait_until("every message stored", Duration::from_secs(60), || async {
        let mut stored: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
        stored.extend(ids_in(&env, "orders_new").await);
        stored == all
    })
    .await;
    // The held insert goes on now, and its connection ends once what it carried was passed
    // on or refused (a server that took it has run it by then).
    pg.release();
    wait_until(
        "the held connection ended",
        Duration::from_secs(30),
        || async { pg.held_before_ended() },
    )
    .await;
    let old: HashSet<Uuid> = ids_in(&env, "orders").await.into_iter().collect();
    let new: HashSet<Uuid> = ids_in(&env, "orders_new").await.into_iter().collect();
    let both: Vec<&Uuid> = old.intersection(&new).collect();
    assert!(
        both.is_empty(),
        "{} messages in both tables; log:\n{}",
        both.len(),
        tail(&warren.logs(), 40)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload applied while a start without `--declare` still holds its consumers (the broker was
/// away at the start, and the start's configuration names a retry queue that does not exist)
/// (review R38-F1): the reload checked the configuration that runs from then on, so the
/// consumers start. Before, the start's check kept asking for the queue the reload had left,
/// for ever, and nothing was consumed. The start's main queue, never declared, is not named
/// as a queue the reload leaves (review R39-F15).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_while_the_start_holds_the_consumers_lets_them_consume() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_held_start").await;
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let missing = Names {
        retry: format!("{}_gone", orders.retry),
        queue: format!("{}_gone", orders.queue),
        ..orders.clone()
    };
    std::fs::write(&path, entry("orders", &missing, 50, 1000)).expect("write");
    env.set("AMQP_URL", amqp.url());
    amqp.cut();
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log(
            "the consumers held",
            "consuming and publishing wait for the check of the broker's exchanges and queues",
        )
        .await;
    amqp.restore();
    warren
        .wait_for_log(
            "the missing retry tier named",
            &format!("queue {}_1s", missing.retry),
        )
        .await;
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    let reloaded = reload(&env, &warren, "reloaded", 1).await;
    // The main queue and retry tier the start's configuration named were never declared: they
    // hold nothing to move, and the reload does not name them as left (review R39-F15).
    assert!(reloaded.get("left_queues").is_none(), "{reloaded}");
    assert!(
        !warren
            .logs()
            .contains("no pipeline consumes these queues now"),
        "{}",
        warren.logs()
    );
    let ids = new_ids(20);
    publish(&env, &orders, &ids).await;
    assert_table(&env, "orders", &ids.iter().copied().collect(), &warren).await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload that renames a pipeline (the same queues and table, another name) while its DLQ
/// stage's park of a message (an INSERT into `dead_letters`) waits on a lock, with a drain bound
/// shorter than the lock (`SHUTDOWN_TIMEOUT_MS=2000`): the drain cancels the park before its
/// deadline, the message goes back to the DLQ, and the stage started under the new name parks
/// it; when the lock goes, the message is parked once, under the new name. A park left
/// waiting past the drain commits when the lock goes, after the new stage parked the message
/// again: once under each name, the unique (pipeline, fingerprint) no help (review R35-F1b).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_renaming_a_pipeline_while_its_park_waits_parks_the_message_once() {
    let mut env = TestEnv::new("rl_park").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "2000");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.dlq).await;

    // A message refused for good (qty over its maximum) in the DLQ: its stage parks it, and
    // the park waits on the lock.
    let lock = InsertLock::take_on(&env, "dead_letters").await;
    let id = Uuid::new_v4();
    env.publish_to("", &orders.dlq, &body(id, 5000), props(id))
        .await;
    lock.wait_for_a_blocked_insert(&env).await;
    let blocked = lock.blocked(&env).await;

    let renamed =
        entry("orders", &orders, 50, 1000).replace(r#"name = "orders""#, r#"name = "orders_v2""#);
    assert!(renamed.contains(r#"table = "orders""#), "{renamed}");
    std::fs::write(&path, renamed).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["added"]), ["orders_v2"], "{event}");
    assert_eq!(names_of(&event["removed"]), ["orders"], "{event}");
    // The new stage took the message back from the DLQ: its park waits on the lock too.
    wait_until(
        "the message taken again, by the new stage",
        Duration::from_secs(30),
        || async { env.queue_state(&orders.dlq).await == (0, 1) },
    )
    .await;

    // The lock goes: a park of the old stage still waiting would commit now.
    lock.release().await;
    wait_until("the old park ended", Duration::from_secs(30), || async {
        active_backends(&env, &blocked).await == 0
    })
    .await;
    let parked_as = || async {
        env.db
            .query(
                "SELECT pipeline FROM dead_letters WHERE message_id = $1 ORDER BY seq",
                &[&id.to_string()],
            )
            .await
            .expect("read dead_letters")
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
    };
    wait_until("the message parked", Duration::from_secs(30), || async {
        !parked_as().await.is_empty()
    })
    .await;
    // Settled: acked once parked, nothing left in the DLQ or in flight.
    wait_until("the DLQ settled", Duration::from_secs(30), || async {
        env.queue_state(&orders.dlq).await == (0, 1) && queue_counts(&orders.dlq).await == (0, 0)
    })
    .await;
    assert_eq!(
        parked_as().await,
        ["orders_v2"],
        "log:\n{}",
        tail(&warren.logs(), 40)
    );
    assert!(
        warren
            .logs()
            .contains("statements still running are cancelled"),
        "{}",
        tail(&warren.logs(), 40)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload of a large file (255 pipelines more, on tables that do not exist: the most a file
/// holds, 256) reads and resolves it off the runtime the pipelines and the heartbeat run on:
/// the record keeps beating while it runs (the whole instance froze for the length of the
/// load, and the broker dropped every link; review of issue 35, F5), and its one error line
/// quotes a few of the tables and says how many more (it was one line of 350 KB). A file of
/// more pipelines is refused before it is checked (review R35e F14: 20,000 took the instance
/// to 741 MiB).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_of_a_large_file_blocks_no_heartbeat_and_says_one_short_line() {
    let mut env = TestEnv::new("rl_large").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&orders.queue).await;
    wait_until("registered", Duration::from_secs(20), || async {
        beat(&env, pid).await.0 == "running"
    })
    .await;

    let mut large = entry("orders", &orders, 50, 1000);
    for i in 0..255 {
        large.push_str(&format!(
            "\n[[pipelines]]\nname = \"large{i}\"\ntable = \"no_such_table_{i}\"\nkey = [\"id\"]\n\n\
             [pipelines.columns]\nid = {{ path = \"/id\", type = \"uuid\" }}\n"
        ));
    }
    std::fs::write(&path, large).expect("write");
    warren.signal("HUP");
    // Until the reload is refused, the record's heartbeat is never more than 3 s old.
    let started = std::time::Instant::now();
    let mut oldest = 0;
    while events_of(&env, "reload_failed").await.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no reload_failed within 300 s"
        );
        let (_, last) = beat(&env, pid).await;
        oldest = oldest.max((common::ops::unix_now() as u64).saturating_sub(last));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        oldest <= 3,
        "the heartbeat stopped for {oldest} s during the reload ({:?} in all)",
        started.elapsed()
    );
    let errors: Vec<String> = warren
        .logs()
        .lines()
        .filter(|l| l.contains("reload failed"))
        .map(String::from)
        .collect();
    assert_eq!(errors.len(), 1, "one error line");
    assert!(
        errors[0].len() < 4096,
        "an error line of {} bytes",
        errors[0].len()
    );
    assert!(
        errors[0].contains("no_such_table_") && errors[0].contains("more"),
        "{}",
        errors[0]
    );
    // Nothing changed: orders still consumes.
    let ids = new_ids(10);
    publish(&env, &orders, &ids).await;
    assert_table(&env, "orders", &ids.into_iter().collect(), &warren).await;
}

/// `ctl pause --pipeline P` sent while a reload restarts P is kept for when it starts again,
/// and the record says so: P's stages show `"paused": true` in `status --json` (they showed
/// false while P consumed nothing; review of issue 35, F7).
#[tokio::test(flavor = "multi_thread")]
async fn a_pause_taken_while_a_reload_restarts_a_pipeline_shows_in_the_record() {
    let mut env = TestEnv::new("rl_pausewhile").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    wait_running(&env, warren.pid()).await;

    // orders changed (its batch size) while its inserts wait on a lock: its drain waits.
    let (lock, held) = hold(&env, &orders, "orders", 5).await;
    std::fs::write(&path, entry("orders", &orders, 40, 1000)).expect("write");
    warren.signal("HUP");
    cancelled(&orders, "orders' consumer cancelled: the drain under way").await;
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    lock.release().await;
    wait_for_event(&env, &warren, "reloaded", 1).await;
    assert_table(&env, "orders", &held.into_iter().collect(), &warren).await;
    wait_until(
        "status shows orders paused",
        Duration::from_secs(10),
        || async {
            let (_, out, _) = env.run_async(&["status", "--json"]).await;
            let doc: Value = serde_json::from_str(&out).unwrap_or_default();
            let stages = &doc["instances"][0]["stages"];
            stages["orders/main"]["paused"] == true && stages["users/main"]["paused"] == false
        },
    )
    .await;
    assert!(tags(&orders.queue).await.is_empty(), "orders consumes");
}

/// A reload whose drain reaches SHUTDOWN_TIMEOUT_MS (refunds removed while its inserts wait on
/// a lock): once everything is settled, nothing shows in flight (`warren_inflight_messages`
/// and the record's count stayed at the deliveries given back, for ever; review of issue 35,
/// F2). A bound of 0: with any other, the stop cancels the waiting inserts before the deadline
/// and the drain completes (`a_reload_switching_the_table_behind_a_lock_...`).
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_that_times_out_leaves_nothing_in_flight() {
    let mut env = TestEnv::new("rl_inflight").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("SHUTDOWN_TIMEOUT_MS", "0");
    let fx = Fixture::new(&env, &["orders", "refunds"]).await;
    let (orders, refunds, path, file) =
        (fx.names(0), fx.names(1), fx.path.clone(), fx.file.clone());
    std::fs::write(
        &path,
        entry("orders", &orders, 50, 1000) + &entry("refunds", &refunds, 50, 1000),
    )
    .expect("write");
    let warren = env.start(&["--config", &file, "--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    one_consumer(&refunds.queue).await;
    wait_running(&env, pid).await;

    let (lock, _held) = hold(&env, &refunds, "refunds", 20).await;
    std::fs::write(&path, entry("orders", &orders, 50, 1000)).expect("write");
    let done = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(done["drained"], false, "{done}");
    lock.release().await;
    wait_until(
        "nothing in flight (metric and record)",
        Duration::from_secs(20),
        || async {
            try_metric(&env, "warren_inflight_messages", &[]).await == Some(0.0)
                && instance(&env, pid).await["inflight"].as_u64() == Some(0)
        },
    )
    .await;
}

/// Review R39-F5, the reload's half: an instance started with `--pipelines parted` (deletes on
/// a partitioned table) reloads a file that adds `part0` on one of its partitions, for another
/// instance to run. The start refuses that file for either selection (the shared rows never see
/// the tombstones, and a delete is lost); the reload, which starts nothing here, refused
/// nothing: it checked the selection alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_under_a_selection_checks_shared_tables_against_the_whole_file() {
    let env = TestEnv::new("rl_family").await;
    let fx = Fixture::new(&env, &["parted"]).await;
    let (parted, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let part0 = Names::of(&env, "part0");
    let _part0 = part0.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE pt (k text NOT NULL, v int8 NOT NULL, PRIMARY KEY (k))
                 PARTITION BY HASH (k);
             CREATE TABLE pt_0 PARTITION OF pt FOR VALUES WITH (MODULUS 1, REMAINDER 0)",
        )
        .await
        .expect("the partitioned table");
    let entry = |name: &str, table: &str, names: &Names, extra: &str| {
        format!(
            "[[pipelines]]\nname = \"{name}\"\ntable = \"{table}\"\nkey = [\"k\"]\n\
             on_conflict = \"update\"\nversion_column = \"v\"\n{extra}{}\n\
             [pipelines.columns]\nk = {{ path = \"/k\", type = \"text\" }}\n\
             v = {{ path = \"/v\", type = \"int8\" }}\n",
            names.toml()
        )
    };
    let with_deletes = entry(
        "parted",
        "pt",
        &parted,
        "delete = { field = \"/op\", value = \"delete\" }\n",
    );
    std::fs::write(&path, &with_deletes).expect("write");
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let warren = env.start(&[
        "--config",
        &file,
        "--roles",
        "consumer",
        "--pipelines",
        "parted",
    ]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&parted.queue).await;
    std::fs::write(
        &path,
        format!("{with_deletes}\n{}", entry("part0", "pt_0", &part0, "")),
    )
    .expect("write");
    let failed = reload(&env, &warren, "reload_failed", 1).await;
    let words = "pipeline parted has deletes and writes pt; pipeline part0 writes pt_0, of the \
                 same partitioned or inherited table pt:";
    assert!(
        failed["reason"]
            .as_str()
            .unwrap_or_default()
            .contains(words),
        "{words}\n{failed}"
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// A reload that switches a pipeline's table while its consumer's link has gone silent (what
/// warren sends on it never reaches the broker: the acks of its last commits, then its cancel
/// and close): the old stage drains and its close goes unanswered, the broker still counts
/// those messages unacked, and once the link drops it delivers them again, to the stage started
/// on the new table. That stage finds them stored in the old table (asked with the old
/// mapping) and acks them as done; before, each was stored in both tables (review R40a F4).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_the_table_while_the_old_links_acks_are_lost_stores_each_message_once() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_lost_acks").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    // Deliveries make the consumer's link the busiest.
    let warm = new_ids(50);
    publish(&env, &orders, &warm).await;
    let mut all: HashSet<Uuid> = warm.iter().copied().collect();
    assert_table(&env, "orders", &all, &warren).await;

    amqp.hold_busiest_from_client();
    let held = new_ids(200);
    publish(&env, &orders, &held).await;
    all.extend(held.iter().copied());
    assert_table(&env, "orders", &all, &warren).await;
    wait_until(
        "the stored messages still unacked on the broker",
        Duration::from_secs(30),
        || async { queue_counts(&orders.queue).await == (0, held.len() as u64) },
    )
    .await;

    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    let event =
        reload_behind_a_silent_link(&env, &warren, &amqp, &path, &switched, &orders.queue).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    // The new stage stores what comes now, in the new table, and nothing of the old one's.
    let fresh = new_ids(20);
    publish(&env, &orders, &fresh).await;
    assert_table(
        &env,
        "orders_new",
        &fresh.iter().copied().collect(),
        &warren,
    )
    .await;
    assert_table(&env, "orders", &all, &warren).await;
    warren
        .wait_for_log(
            "the redeliveries acked as done",
            "redeliveries acked as done: a stage a reload replaced had settled them",
        )
        .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review R42b F2: the same silence, and a second reload right after the first (before the
/// old link drops) switching the table again: the broker delivers the first stage's unacked
/// messages to the third stage, which asks every stage this process's reloads stopped on the
/// queue (the second's table and the first's), finds them stored in the first table and acks
/// them as done. Before, only the stage replaced last was asked, after its own close went
/// unanswered: each was stored in the first and the third table. The second stage loses a
/// window's worth of acks too (review R46a F1: its lost acks pushed the first stage's out).
#[tokio::test(flavor = "multi_thread")]
async fn two_reloads_before_the_old_link_drops_store_each_message_once() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_two_reloads").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    // A window of 200: each stage remembers its last 400 acks, fewer than the second stage
    // makes.
    env.set("PREFETCH", "200");
    let fx = Fixture::new(&env, &["orders", "orders_new", "orders_third"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(50);
    publish(&env, &orders, &warm).await;
    let mut all: HashSet<Uuid> = warm.iter().copied().collect();
    assert_table(&env, "orders", &all, &warren).await;

    amqp.hold_busiest_from_client();
    let held = new_ids(200);
    publish(&env, &orders, &held).await;
    all.extend(held.iter().copied());
    assert_table(&env, "orders", &all, &warren).await;
    wait_until(
        "the stored messages still unacked on the broker",
        Duration::from_secs(30),
        || async { queue_counts(&orders.queue).await == (0, held.len() as u64) },
    )
    .await;

    let table = |t: &str| {
        entry("orders", &orders, 50, 1000)
            .replace(r#"table = "orders""#, &format!("table = \"{t}\""))
    };
    std::fs::write(&path, table("orders_new")).expect("write");
    let first = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&first["changed"]), ["orders"], "{first}");
    assert!(
        warren
            .logs()
            .contains("the broker link did not answer its close"),
        "{}",
        tail(&warren.logs(), 40)
    );
    // The second stage stores more than its window with its acks answered, then more with
    // its link held too: a window's worth of its own acks are lost, which must not push the
    // first stage's out of the memory (review R46a F1: the last stopped stage's lost acks
    // replaced the earlier ones', and the first stage's were stored again in the third table).
    let between = new_ids(600);
    publish(&env, &orders, &between).await;
    let mut second_table: HashSet<Uuid> = between.iter().copied().collect();
    assert_table(&env, "orders_new", &second_table, &warren).await;
    amqp.hold_busiest_from_client();
    let held_second = new_ids(200);
    publish(&env, &orders, &held_second).await;
    second_table.extend(held_second.iter().copied());
    assert_table(&env, "orders_new", &second_table, &warren).await;
    let unacked = (held.len() + held_second.len()) as u64;
    wait_until(
        "both stages' stored messages unacked on the broker",
        Duration::from_secs(30),
        || async { queue_counts(&orders.queue).await == (0, unacked) },
    )
    .await;
    std::fs::write(&path, table("orders_third")).expect("write");
    let second = reload(&env, &warren, "reloaded", 2).await;
    assert_eq!(names_of(&second["changed"]), ["orders"], "{second}");
    let mark = warren.logs().len();
    amqp.cut();
    amqp.restore();
    // The third stage's own acks of the redeliveries it takes as done are lost too: its link
    // held once it has taken some, then cut. Their next redelivery must be asked of the old
    // tables again: the memory's entries were used up at the first, and the second was taken
    // as new and stored in the third table too (once by chance in this test's run, before the
    // acks a stage makes for a predecessor were remembered under it). Awaited on the link
    // made after the cut (a line of the link the cut ended held the wrong connection).
    wait_until(
        "the third stage's new link acking redeliveries as done",
        Duration::from_secs(30),
        || async {
            let logs = warren.logs();
            let after = &logs[mark.min(logs.len())..];
            after
                .find(r#"connected pipeline="orders" stage="main""#)
                .is_some_and(|at| {
                    after[at..].contains(
                        "redeliveries acked as done: a stage a reload replaced had settled them",
                    )
                })
        },
    )
    .await;
    amqp.hold_busiest_from_client();
    wait_until(
        "the third stage's window settled, its acks held",
        Duration::from_secs(30),
        || async {
            let (_, unacked) = queue_counts(&orders.queue).await;
            unacked > 0 && metric(&env, "warren_inflight_messages", &[]).await == 0.0
        },
    )
    .await;
    amqp.cut();
    amqp.restore();
    wait_until(
        "every message settled on the broker",
        Duration::from_secs(60),
        || async { queue_counts(&orders.queue).await == (0, 0) },
    )
    .await;
    let fresh = new_ids(20);
    publish(&env, &orders, &fresh).await;
    assert_table(
        &env,
        "orders_third",
        &fresh.iter().copied().collect(),
        &warren,
    )
    .await;
    assert_table(&env, "orders_new", &second_table, &warren).await;
    assert_table(&env, "orders", &all, &warren).await;
    warren
        .wait_for_log(
            "the redeliveries acked as done",
            "redeliveries acked as done: a stage a reload replaced had settled them",
        )
        .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// The same silence at a reload that renames a pipeline (the same queues and table): its DLQ
/// stage parked messages under the old name and its acks were lost; the stage started under the
/// new name gets them again and finds them parked under the old name, and acks them as done.
/// Before, each was parked once under each name (review R40a F6).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_renaming_a_pipeline_while_the_old_links_acks_are_lost_parks_each_message_once() {
    let run = parked_behind_a_silent_link("rl_lost_parks", &|orders| {
        entry("orders", orders, 50, 1000).replace(r#"name = "orders""#, r#"name = "orders_v2""#)
    })
    .await;
    let (env, orders) = (&run.env, &run.orders);
    assert_eq!(
        names_of(&run.event["added"]),
        ["orders_v2"],
        "{}",
        run.event
    );
    // The new name parks what comes now, and nothing the old one parked.
    let fresh = new_ids(10);
    env.publish_pipelined_to("", &orders.dlq, refused(&fresh))
        .await;
    let fresh: HashSet<Uuid> = fresh.into_iter().collect();
    wait_until("the new ones parked", Duration::from_secs(30), || async {
        parked_as(env, "orders_v2").await.len() >= fresh.len()
    })
    .await;
    assert_same_ids(
        "dead_letters of orders_v2",
        &fresh,
        &parked_as(env, "orders_v2")
            .await
            .into_iter()
            .collect::<Vec<_>>(),
    );
    run.finish().await;
}

/// Review R46a F10 (a duplicate: stored and parked): as above, but the reload keeps the name
/// and changes the mapping so that it accepts what the old one parked (qty up to 10,000). The
/// new DLQ stage asked the parking only under other names than its own, when about to park;
/// the redeliveries of the lost acks were stored in the table too. Now a DLQ stage asks the
/// parking under each predecessor's name, its own included, before it stores them.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_accepts_what_the_old_mapping_parked_while_its_acks_are_lost_stores_none_of_it()
 {
    let run = parked_behind_a_silent_link("rl_lost_accept", &|orders| {
        entry("orders", orders, 50, 10_000)
    })
    .await;
    let (env, orders) = (&run.env, &run.orders);
    assert_eq!(names_of(&run.event["changed"]), ["orders"], "{}", run.event);
    // What comes now is accepted and stored; nothing parked before is.
    let fresh = new_ids(10);
    env.publish_pipelined_to("", &orders.dlq, refused(&fresh))
        .await;
    let fresh: HashSet<Uuid> = fresh.into_iter().collect();
    assert_table(env, "orders", &fresh, &run.warren).await;
    run.finish().await;
}

/// Messages refused for good (qty 5,000, over the first entry's maximum), published straight
/// into the DLQ.
fn refused(ids: &[Uuid]) -> Vec<(Vec<u8>, BasicProperties)> {
    ids.iter().map(|id| (body(*id, 5000), props(*id))).collect()
}

/// The message ids parked under `pipeline`.
async fn parked_as(env: &TestEnv, pipeline: &str) -> HashSet<Uuid> {
    env.db
        .query(
            "SELECT message_id FROM dead_letters WHERE pipeline = $1",
            &[&pipeline],
        )
        .await
        .expect("read dead_letters")
        .iter()
        .map(|r| r.get::<_, String>(0).parse::<Uuid>().expect("a uuid"))
        .collect()
}

/// A DLQ stage that parked 150 messages, the acks of the last 100 lost with its silent link,
/// then a reload to `after` (the file's text, given the pipeline's names).
struct ParkedRun {
    _amqp: TcpProxy,
    env: TestEnv,
    _fx: Fixture,
    orders: Names,
    warren: Warren,
    _logs: LogsOnPanic,
    /// Every message parked before the reload.
    all: HashSet<Uuid>,
    event: Value,
}

async fn parked_behind_a_silent_link(prefix: &str, after: &dyn Fn(&Names) -> String) -> ParkedRun {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new(prefix).await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "dlq"]);
    let logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.dlq).await;
    let warm = new_ids(50);
    env.publish_pipelined_to("", &orders.dlq, refused(&warm))
        .await;
    let mut all: HashSet<Uuid> = warm.iter().copied().collect();
    wait_until("the first ones parked", Duration::from_secs(30), || async {
        parked_as(&env, "orders").await == all
    })
    .await;

    amqp.hold_busiest_from_client();
    let held = new_ids(100);
    env.publish_pipelined_to("", &orders.dlq, refused(&held))
        .await;
    all.extend(held.iter().copied());
    wait_until("all parked", Duration::from_secs(30), || async {
        parked_as(&env, "orders").await == all
    })
    .await;
    wait_until(
        "the parked messages still unacked on the broker",
        Duration::from_secs(30),
        || async { queue_counts(&orders.dlq).await == (0, held.len() as u64) },
    )
    .await;

    let event =
        reload_behind_a_silent_link(&env, &warren, &amqp, &path, &after(&orders), &orders.dlq)
            .await;
    ParkedRun {
        _logs: logs,
        _amqp: amqp,
        env,
        _fx: fx,
        orders,
        warren,
        all,
        event,
    }
}

impl ParkedRun {
    /// Every message parked before the reload parked once under the old name and stored
    /// nowhere; the redeliveries acked as done, said in the log; warren stops cleanly.
    async fn finish(self) {
        assert_eq!(parked_as(&self.env, "orders").await, self.all);
        let stored: HashSet<Uuid> = ids_in(&self.env, "orders").await.into_iter().collect();
        let both: Vec<&Uuid> = stored.intersection(&self.all).collect();
        assert!(
            both.is_empty(),
            "parked and stored: {} of {}: {both:?}",
            both.len(),
            self.all.len()
        );
        self.warren
            .wait_for_log(
                "the redeliveries acked as done",
                "redeliveries acked as done: a stage a reload replaced had",
            )
            .await;
        let mut warren = self.warren;
        warren.terminate_ok(Duration::from_secs(25));
    }
}

/// Review R44 F5 (a loss): a stage a reload starts asked the tables of the stages it replaced
/// about every redelivery, also one the old stage never settled (given back by a pause, a
/// breaker, a stop). With versions, a message older than what the old table held for its key
/// was taken as settled there (stale) and acked, never stored in the new table. Now only the
/// redeliveries of acks the old stage may have lost are asked (none here: its close was
/// answered). The redelivery is made by a `basic.get` left unacked while the pipeline is paused.
#[tokio::test(flavor = "multi_thread")]
async fn a_redelivery_the_replaced_stage_never_settled_is_stored_in_the_new_table() {
    let env = TestEnv::new("rl_unsettled").await;
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    for table in ["orders", "orders_new"] {
        env.db
            .batch_execute(&format!("ALTER TABLE {table} ADD COLUMN version int8"))
            .await
            .expect("alter table");
    }
    let versioned = |table: &str| {
        entry("orders", &orders, 50, 1000)
            .replace(r#"table = "orders""#, &format!("table = \"{table}\""))
            .replace(
                "retry_ttls_ms = [1000]",
                "retry_ttls_ms = [1000]\non_conflict = \"update\"\nversion_column = \"version\"",
            )
            .replace(
                "[pipelines.columns]",
                "[pipelines.columns]\nversion = { path = \"/v\", type = \"int8\" }",
            )
    };
    std::fs::write(&path, versioned("orders")).expect("write");
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let key = Uuid::new_v4();
    let message = |v: u32| {
        let body = format!(r#"{{"id":"{key}","qty":1,"v":{v}}}"#).into_bytes();
        (body, props(key))
    };
    env.publish_pipelined_to(&orders.exchange, &orders.queue, [message(5)])
        .await;
    let stored = |table: &'static str| {
        let env = &env;
        async move {
            count_of(
                env,
                &format!("SELECT count(*) FROM {table} WHERE id = '{key}' AND version IS NOT NULL"),
            )
            .await
        }
    };
    wait_until(
        "version 5 stored in orders",
        Duration::from_secs(30),
        || async { stored("orders").await == 1 },
    )
    .await;

    // Paused: an older version waits in the queue, taken once and given back (redelivered).
    warren.signal("USR1");
    wait_until("orders paused", Duration::from_secs(20), || async {
        tags(&orders.queue).await.is_empty()
    })
    .await;
    env.publish_pipelined_to(&orders.exchange, &orders.queue, [message(3)])
        .await;
    let taken = env.peek(&orders.queue, 1).await;
    assert_eq!(taken.len(), 1, "the older version to take and give back");
    std::fs::write(&path, versioned("orders_new")).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    warren.signal("CONT");
    wait_until(
        "the redelivery settled",
        Duration::from_secs(30),
        || async { queue_counts(&orders.queue).await == (0, 0) },
    )
    .await;
    let version: Option<i64> = env
        .db
        .query_opt(
            &format!("SELECT version FROM orders_new WHERE id = '{key}'"),
            &[],
        )
        .await
        .expect("read orders_new")
        .map(|r| r.get(0));
    assert_eq!(
        version,
        Some(3),
        "the redelivery the old stage never settled is stored in the new table; log:\n{}",
        tail(&warren.logs(), 30)
    );
    assert!(
        !warren.logs().contains("redeliveries acked as done"),
        "{}",
        tail(&warren.logs(), 30)
    );
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review R44 F6 (a stall): the redeliveries of acks the old stage lost are asked of its table;
/// locked (an operator migrating the retired table), the question waited for the statement
/// bound, and the live pipeline behind it, then stored them again in the new table. Now it
/// waits 2 s for the lock, sends those redeliveries through the retry queue, their retries not
/// counted (asked again when they come back) and lets the rest go on: new messages are stored
/// meanwhile, and once the lock goes each is found stored in the old table and acked, none
/// stored twice. The redeliveries fill the whole window (review R46a F7: given back to the head
/// of their queue, they filled it again at once, and nothing else was stored while the lock
/// lasted; F8: a quorum queue counted each give-back towards its delivery limit).
#[tokio::test(flavor = "multi_thread")]
async fn a_locked_retired_table_holds_back_only_the_redeliveries_asked_of_it() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_locked_before").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    env.set("PREFETCH", "100");
    let fx = Fixture::new(&env, &["orders", "orders_new"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(50);
    publish(&env, &orders, &warm).await;
    let mut all: HashSet<Uuid> = warm.iter().copied().collect();
    assert_table(&env, "orders", &all, &warren).await;
    amqp.hold_busiest_from_client();
    let held = new_ids(100);
    publish(&env, &orders, &held).await;
    all.extend(held.iter().copied());
    assert_table(&env, "orders", &all, &warren).await;
    wait_until(
        "the stored messages still unacked on the broker",
        Duration::from_secs(30),
        || async { queue_counts(&orders.queue).await == (0, held.len() as u64) },
    )
    .await;

    let switched = entry("orders", &orders, 50, 1000)
        .replace(r#"table = "orders""#, r#"table = "orders_new""#);
    std::fs::write(&path, switched).expect("write");
    let event = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    assert!(
        warren
            .logs()
            .contains("the broker link did not answer its close"),
        "{}",
        tail(&warren.logs(), 40)
    );
    let lock = TableLock::take_in(&env, "orders", "ACCESS EXCLUSIVE").await;
    amqp.cut();
    amqp.restore();
    // The pipeline goes on meanwhile.
    let fresh = new_ids(20);
    publish(&env, &orders, &fresh).await;
    let fresh: HashSet<Uuid> = fresh.into_iter().collect();
    wait_until(
        "the new messages stored behind the lock",
        Duration::from_secs(30),
        || async {
            let stored: HashSet<Uuid> = ids_in(&env, "orders_new").await.into_iter().collect();
            fresh.is_subset(&stored)
        },
    )
    .await;
    warren
        .wait_for_log(
            "the redeliveries given back behind the lock",
            "the table of a stage a reload replaced is locked",
        )
        .await;
    // Behind the lock, some time: several rounds through the retry queue, none counted, each
    // round counted by the metric (review R46a F9: nothing counted them).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let waits = metric(
        &env,
        "warren_redeliveries_total",
        &[
            ("pipeline", "orders"),
            ("stage", "main"),
            ("outcome", "waits_for_retired_table"),
        ],
    )
    .await;
    assert!(
        waits >= held.len() as f64,
        "{waits} redeliveries counted as waiting for the locked table; {} were held",
        held.len()
    );
    // Not counted as retries after a transient error either (review R47a F7: each was).
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "orders"), ("stage", "main")],
    )
    .await;
    assert_eq!(retried, 0.0, "waits counted as retries");
    lock.release().await;
    wait_until(
        "every message settled on the broker, none waiting in the retry queue",
        Duration::from_secs(60),
        || async {
            queue_counts(&orders.queue).await == (0, 0)
                && queue_counts(&orders.retry).await == (0, 0)
        },
    )
    .await;
    assert_table(&env, "orders_new", &fresh, &warren).await;
    assert_table(&env, "orders", &all, &warren).await;
    assert_eq!(
        queue_counts(&orders.dlq).await,
        (0, 0),
        "nothing dead-lettered"
    );
    warren
        .wait_for_log(
            "the redeliveries acked as done",
            "redeliveries acked as done: a stage a reload replaced had settled them",
        )
        .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review R44 F3 (a duplicate): a rename done as two reloads, a removal and then an addition
/// under the new name on the same queues, while the old consumer's link is silent. The old
/// stage had routed refused messages to the DLQ (their copies confirmed) and its acks were lost;
/// the broker delivers them again to the stage added later, which must know them as routed.
/// Before, the memory of copies lived only through one reload, and each was routed twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_rename_done_as_a_removal_and_an_addition_routes_each_message_once() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_two_step_rename").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    // Refused for good (qty over its maximum): routed to the DLQ, their originals acked.
    let refused = |ids: &[Uuid]| -> Vec<(Vec<u8>, BasicProperties)> {
        ids.iter().map(|id| (body(*id, 5000), props(*id))).collect()
    };
    let warm = new_ids(20);
    env.publish_pipelined_to(&orders.exchange, &orders.queue, refused(&warm))
        .await;
    wait_until("the first ones routed", Duration::from_secs(30), || async {
        queue_counts(&orders.dlq).await.0 == warm.len() as u64
    })
    .await;
    amqp.hold_busiest_from_client();
    let held = new_ids(100);
    env.publish_pipelined_to(&orders.exchange, &orders.queue, refused(&held))
        .await;
    let all = warm.len() + held.len();
    wait_until(
        "every copy in the DLQ, the held originals unacked",
        Duration::from_secs(30),
        || async {
            queue_counts(&orders.dlq).await.0 == all as u64
                && queue_counts(&orders.queue).await == (0, held.len() as u64)
        },
    )
    .await;

    // Removed (its close unanswered), then, once the broker has the originals back, added
    // under another name on the same queues.
    std::fs::write(&path, "").expect("write");
    let removed = reload(&env, &warren, "reloaded", 1).await;
    assert_eq!(names_of(&removed["removed"]), ["orders"], "{removed}");
    assert!(
        warren
            .logs()
            .contains("the broker link did not answer its close"),
        "{}",
        tail(&warren.logs(), 40)
    );
    // Its close unanswered: the advice to move its queues says to wait for the link's end.
    let logs = warren.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("no pipeline consumes these queues now")
                && l.contains("wait until the broker dropped the link")),
        "{}",
        tail(&logs, 40)
    );
    amqp.cut();
    amqp.restore();
    wait_until(
        "the originals back in the queue",
        Duration::from_secs(60),
        || async { queue_counts(&orders.queue).await == (held.len() as u64, 0) },
    )
    .await;
    let renamed =
        entry("orders", &orders, 50, 1000).replace(r#"name = "orders""#, r#"name = "orders_v2""#);
    std::fs::write(&path, renamed).expect("write");
    let added = reload(&env, &warren, "reloaded", 2).await;
    assert_eq!(names_of(&added["added"]), ["orders_v2"], "{added}");
    wait_until(
        "the redeliveries settled",
        Duration::from_secs(60),
        || async { queue_counts(&orders.queue).await == (0, 0) },
    )
    .await;
    let copies = env.drain_queue(&orders.dlq, all * 3).await;
    let ids: Vec<Uuid> = copies
        .iter()
        .map(|m| {
            let id = m.properties.message_id().as_ref().expect("a message id");
            id.as_str().parse().expect("a uuid")
        })
        .collect();
    let expected: HashSet<Uuid> = warm.iter().chain(&held).copied().collect();
    assert_same_ids("the DLQ's copies", &expected, &ids);
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review R47a F1 (a duplicate): the main stage routed refused messages to the DLQ (their
/// copies confirmed) and their acks were lost with its silent link; a reload that widened the
/// mapping (qty up to 10,000) gave the redeliveries to a stage whose mapping accepts them, and
/// they were stored while their copies waited in the DLQ: stored, and later parked too. The
/// memory of copies was asked only when a message was routed. Now a redelivery whose copy was
/// confirmed is acked as already routed before any insert.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_accepts_what_the_old_stage_routed_while_its_acks_are_lost_stores_none_of_it()
{
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("rl_routed_accept").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "15000");
    let fx = Fixture::new(&env, &["orders"]).await;
    let (orders, path, file) = (fx.names(0), fx.path.clone(), fx.file.clone());
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.set("AMQP_URL", amqp.url());
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    one_consumer(&orders.queue).await;
    let warm = new_ids(20);
    env.publish_pipelined_to(&orders.exchange, &orders.queue, refused(&warm))
        .await;
    wait_until("the first ones routed", Duration::from_secs(30), || async {
        queue_counts(&orders.dlq).await.0 == warm.len() as u64
    })
    .await;
    amqp.hold_busiest_from_client();
    let held = new_ids(100);
    env.publish_pipelined_to(&orders.exchange, &orders.queue, refused(&held))
        .await;
    let all = warm.len() + held.len();
    wait_until(
        "every copy in the DLQ, the held originals unacked",
        Duration::from_secs(30),
        || async {
            queue_counts(&orders.dlq).await.0 == all as u64
                && queue_counts(&orders.queue).await == (0, held.len() as u64)
        },
    )
    .await;
    let event = reload_behind_a_silent_link(
        &env,
        &warren,
        &amqp,
        &path,
        &entry("orders", &orders, 50, 10_000),
        &orders.queue,
    )
    .await;
    assert_eq!(names_of(&event["changed"]), ["orders"], "{event}");
    // What comes now is accepted and stored; nothing routed before is.
    let fresh = new_ids(10);
    env.publish_pipelined_to(&orders.exchange, &orders.queue, refused(&fresh))
        .await;
    let fresh: HashSet<Uuid> = fresh.into_iter().collect();
    assert_table(&env, "orders", &fresh, &warren).await;
    let copies = env.drain_queue(&orders.dlq, all * 3).await;
    let ids: Vec<Uuid> = copies
        .iter()
        .map(|m| {
            let id = m.properties.message_id().as_ref().expect("a message id");
            id.as_str().parse().expect("a uuid")
        })
        .collect();
    let expected: HashSet<Uuid> = warm.iter().chain(&held).copied().collect();
    assert_same_ids("the DLQ's copies", &expected, &ids);
    warren
        .wait_for_log(
            "the redeliveries acked as already routed",
            "redeliveries acked as already routed before any insert",
        )
        .await;
    let mut warren = warren;
    warren.terminate_ok(Duration::from_secs(25));
}

/// Writes `text` to the configuration file and reloads while the consumer's link is held (its
/// close goes unanswered, as the log must say), then drops every link: the broker delivers
/// what the old link left unacked again. Waits until `queue` has settled everything; answers
/// the `reloaded` event.
async fn reload_behind_a_silent_link(
    env: &TestEnv,
    warren: &Warren,
    amqp: &TcpProxy,
    path: &std::path::Path,
    text: &str,
    queue: &str,
) -> Value {
    std::fs::write(path, text).expect("write");
    let event = reload(env, warren, "reloaded", 1).await;
    assert!(
        warren
            .logs()
            .contains("the broker link did not answer its close"),
        "{}",
        tail(&warren.logs(), 40)
    );
    amqp.cut();
    amqp.restore();
    wait_until(
        "every message settled on the broker",
        Duration::from_secs(60),
        || async { queue_counts(queue).await == (0, 0) },
    )
    .await;
    event
}
