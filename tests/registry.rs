//! The Redis instance registry: a running instance keeps a hash with a TTL and live counters and
//! leaves a shutdown record when it stops (the newest 1,000 kept); a Redis outage loses no message, shows on
//! `warren_connection_up{target="redis"}` and ends with the instance registered again; `warren
//! status` lists the instances and the queues.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lapin::BasicProperties;
use serde_json::Value;

/// A private `redis-server` on its own port, killed on drop.
struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    async fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(std::env::temp_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        let server = RedisServer {
            port,
            child: Some(child),
        };
        let url = server.url();
        wait_until(
            &format!("redis-server on port {port}"),
            Duration::from_secs(10),
            || async {
                try_redis_query::<String>(&url, &redis::cmd("PING"))
                    .await
                    .is_some()
            },
        )
        .await;
        server
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: the server disappears without a word.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `warren` is registered with status `running`; returns its record.
async fn wait_registered(env: &TestEnv, warren: &Warren) -> Value {
    wait_until(
        "the instance registered as running",
        Duration::from_secs(20),
        || async { instance(env, warren.pid()).await["status"] == "running" },
    )
    .await;
    instance(env, warren.pid()).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_registers_with_live_counters_and_leaves_a_shutdown_record() {
    const N: usize = 500;
    let mut env = TestEnv::new("reg_live").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("USERS_PROC_CONCURRENCY", "3");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let before = registry_now();
    let started = Instant::now();
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let pid = warren.pid();
    let key = instance_key(&env, pid);

    let hash = wait_registered(&env, &warren).await;
    assert_eq!(hash["format"], 1, "{hash}");
    assert_eq!(hash["host"], host().as_str(), "{hash}");
    assert_eq!(hash["pid"], pid, "{hash}");
    assert_eq!(hash["roles"], "consumer,dlq", "{hash}");
    assert_eq!(hash["version"], env!("CARGO_PKG_VERSION"), "{hash}");
    assert_eq!(hash["processors"], 3, "{hash}");
    let started_at: u64 = hash["started_at"].as_u64().expect("started_at");
    assert!(
        started_at >= before && started_at <= registry_now(),
        "started_at {started_at}, test started at {before}"
    );
    for counter in [
        "received",
        "inserted",
        "retried",
        "dead_lettered",
        "inflight",
    ] {
        assert_eq!(hash[counter], 0, "{counter} before any message: {hash}");
    }
    let ttl: i64 = redis_query(&env, redis::cmd("TTL").arg(&key)).await;
    assert!(ttl > 0 && ttl <= 30, "TTL {ttl}");

    // Live counters.
    env.publish_users(N).await;
    wait_until(
        "received and inserted reach N in the hash",
        Duration::from_secs(30),
        || async {
            let h = instance(&env, pid).await;
            h["received"] == N && h["inserted"] == N
        },
    )
    .await;
    assert_eq!(env.count_rows().await, N as i64);
    let hash = instance(&env, pid).await;
    assert_eq!(hash["status"], "running", "{hash}");
    assert_eq!(hash["retried"], 0, "{hash}");
    assert_eq!(hash["dead_lettered"], 0, "{hash}");

    // The heartbeat renews the TTL (without it, 2 s later it would be under 28 s) and the time.
    let first_beat = hash["last_heartbeat"].as_u64().expect("last_heartbeat");
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let pttl: i64 = redis_query(&env, redis::cmd("PTTL").arg(&key)).await;
    assert!(pttl > 28_500 && pttl <= 30_000, "PTTL {pttl} ms");
    let hash = instance(&env, pid).await;
    let last_beat = hash["last_heartbeat"].as_u64().expect("last_heartbeat");
    assert!(last_beat > first_beat, "last_heartbeat did not advance");

    // A graceful stop deregisters and records why.
    let status = warren.terminate(Duration::from_secs(25));
    let elapsed = started.elapsed().as_secs();
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());
    let exists: i64 = redis_query(&env, redis::cmd("EXISTS").arg(&key)).await;
    assert_eq!(exists, 0, "the instance hash outlived the process");
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r["host"], host().as_str(), "{r}");
    assert_eq!(r["pid"], pid, "{r}");
    assert_eq!(r["roles"], "consumer,dlq", "{r}");
    assert_eq!(r["reason"], "signal", "{r}");
    assert_eq!(r["received"], N as u64, "{r}");
    assert_eq!(r["inserted"], N as u64, "{r}");
    assert_eq!(r["retried"], 0, "{r}");
    assert_eq!(r["dead_lettered"], 0, "{r}");
    assert_eq!(r["started_at"], started_at, "{r}");
    let uptime = r["uptime_s"].as_u64().expect("uptime_s");
    let stopped_at = r["stopped_at"].as_u64().expect("stopped_at");
    assert!(
        (2..=elapsed + 1).contains(&uptime),
        "uptime {uptime} s, the test ran {elapsed} s: {r}"
    );
    assert_eq!(stopped_at - started_at, uptime, "{r}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shutdown_history_keeps_the_newest_thousand_records() {
    let mut env = TestEnv::new("reg_trim").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    // 1,005 records of earlier stops (scored long ago, oldest first).
    let key = format!("{}:shutdowns", env.id);
    let mut zadd = redis::cmd("ZADD");
    zadd.arg(&key);
    for i in 0..1_005 {
        zadd.arg(i).arg(format!(r#"{{"old":{i}}}"#));
    }
    let added: i64 = redis_query(&env, &zadd).await;
    assert_eq!(added, 1_005);

    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;
    let status = warren.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());

    // The new record went in and the six oldest went out, in the same step.
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1_000);
    assert_eq!(records[0]["old"], 6, "{}", records[0]);
    assert_eq!(records[998]["old"], 1_004, "{}", records[998]);
    let newest = &records[999];
    assert_eq!(newest["pid"], pid, "{newest}");
    assert_eq!(newest["reason"], "signal", "{newest}");
}

/// Seconds since the Unix epoch.
fn registry_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_outage_loses_nothing_and_the_instance_registers_again() {
    const HALF: usize = 1_500;
    let port = free_port();
    let mut server = RedisServer::start(port).await;
    let mut env = TestEnv::new("reg_outage").await;
    env.set("REDIS_URL", server.url())
        .set("REGISTRY_HEARTBEAT_MS", "300")
        .set("USERS_BATCH_SIZE", "100");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;
    wait_until("redis gauge 1", Duration::from_secs(10), || async {
        try_metric(&env, "warren_connection_up", &[("target", "redis")]).await == Some(1.0)
    })
    .await;

    // Redis dies in the middle of a run.
    let mut ids = env.publish_users(HALF).await;
    wait_until("the first rows", Duration::from_secs(30), || async {
        env.count_rows().await > 0
    })
    .await;
    server.kill();
    ids.extend(env.publish_users(HALF).await);
    wait_until(
        "warren_connection_up{target=\"redis\"} 0",
        Duration::from_secs(15),
        || async {
            try_metric(&env, "warren_connection_up", &[("target", "redis")]).await == Some(0.0)
        },
    )
    .await;
    wait_until(
        "every row while Redis is down",
        Duration::from_secs(60),
        || async { env.count_rows().await >= ids.len() as i64 },
    )
    .await;
    assert!(warren.is_running(), "warren died; log:\n{}", warren.logs());
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    assert_queue_empty(&env, &env.main_queue).await;
    assert_queue_empty(&env, &env.retry_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
    assert_eq!(
        try_metric(&env, "warren_connection_up", &[("target", "redis")]).await,
        Some(0.0),
        "the gauge must stay 0 while Redis is away"
    );
    // The operator tools say so instead of hanging or failing obscurely.
    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "status without Redis:\n{out}\n{err}");
    assert!(out.contains("Redis unreachable"), "{out}");
    assert!(out.contains(&env.main_queue), "queues still listed:\n{out}");
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "status --json without Redis:\n{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(doc["instances"], Value::Null, "{doc}");
    assert_eq!(doc["queues"].as_array().map(Vec::len), Some(3), "{doc}");
    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 1, "ctl without Redis:\n{out}\n{err}");
    assert!(
        err.contains("cannot reach Redis") && err.contains(&port.to_string()),
        "{err}"
    );
    assert!(warren.is_running());

    // Redis comes back on the same port, empty: the instance registers again.
    let _server = {
        drop(server);
        RedisServer::start(port).await
    };
    let _cleanup = RedisCleanup::new(&env);
    let total = 2 * HALF;
    wait_until(
        "the instance hash back, with every insert counted",
        Duration::from_secs(20),
        || async {
            let h = instance(&env, pid).await;
            h["status"] == "running" && h["inserted"] == total
        },
    )
    .await;
    wait_until("redis gauge back to 1", Duration::from_secs(10), || async {
        try_metric(&env, "warren_connection_up", &[("target", "redis")]).await == Some(1.0)
    })
    .await;
    let reconnects = try_metric(&env, "warren_reconnects_total", &[("target", "redis")]).await;
    assert!(
        reconnects.is_some_and(|n| n >= 1.0),
        "warren_reconnects_total{{target=\"redis\"}} = {reconnects:?}"
    );
    let key = instance_key(&env, pid);
    let ttl: i64 = redis_query(&env, redis::cmd("TTL").arg(&key)).await;
    assert!(ttl > 0 && ttl <= 30, "TTL {ttl}");
    // One warning for the whole outage, not one per failed heartbeat.
    let logs = warren.logs();
    assert_eq!(logs.matches("Redis unreachable").count(), 1, "log:\n{logs}");

    let status = warren.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["reason"], "signal");
    assert_eq!(records[0]["inserted"], 2 * HALF as u64);
    assert_eq!(env.count_rows().await, 2 * HALF as i64);
}

#[tokio::test(flavor = "multi_thread")]
async fn status_lists_the_instance_and_the_queues() {
    let mut env = TestEnv::new("reg_status").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("RETRY_TTL_MS", "600000");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;

    // Five rows through the pipeline; three messages parked in the retry queue (long TTL).
    env.publish_users(5).await;
    for _ in 0..3 {
        let id = uuid::Uuid::new_v4();
        env.publish_to(
            &env.retry_exchange,
            &env.retry_queue,
            &user_body(id),
            BasicProperties::default(),
        )
        .await;
    }
    wait_until(
        "5 rows, counted in the hash",
        Duration::from_secs(20),
        || async { env.count_rows().await == 5 && instance(&env, pid).await["inserted"] == 5 },
    )
    .await;
    wait_until("the queues settle", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await == (0, 1)
            && env.queue_state(&env.retry_queue).await == (3, 0)
            && env.queue_state(&env.dlq_queue).await == (0, 1)
    })
    .await;
    let expected_queues = [
        (env.main_queue.clone(), 0, 1),
        (env.retry_queue.clone(), 3, 0),
        (env.dlq_queue.clone(), 0, 1),
    ];
    let me = format!("{}:{pid}", host());

    // The tables.
    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "warren status:\n{out}\n{err}");
    let row = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|t| t.first() == Some(&me.as_str()))
        .unwrap_or_else(|| panic!("no row for {me}:\n{out}"));
    assert_eq!(row.get(1), Some(&"consumer,dlq"), "{out}");
    assert_eq!(row.get(2), Some(&"running"), "{out}");
    assert_eq!(row.get(5), Some(&"5"), "inserted column:\n{out}");
    for (name, messages, consumers) in &expected_queues {
        let row = out
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|t| t.first() == Some(&name.as_str()))
            .unwrap_or_else(|| panic!("no row for queue {name}:\n{out}"));
        assert_eq!(
            row[1..3].to_vec(),
            vec![messages.to_string(), consumers.to_string()],
            "queue {name}:\n{out}"
        );
    }

    // The JSON document.
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "warren status --json:\n{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let instances = doc["instances"].as_array().expect("instances array");
    assert_eq!(instances.len(), 1, "{doc}");
    let i = &instances[0];
    assert_eq!(i["host"], host().as_str(), "{i}");
    assert_eq!(i["pid"], pid, "numbers are JSON numbers: {i}");
    assert_eq!(i["status"], "running", "{i}");
    assert_eq!(i["roles"], "consumer,dlq", "{i}");
    assert_eq!(i["inserted"], 5, "{i}");
    assert!(i["inserted_per_s"].is_number(), "{i}");
    let queues = doc["queues"].as_array().expect("queues array");
    assert_eq!(queues.len(), 3, "{doc}");
    for (name, messages, consumers) in &expected_queues {
        let q = queues
            .iter()
            .find(|q| q["name"] == name.as_str())
            .unwrap_or_else(|| panic!("no queue {name}: {doc}"));
        assert_eq!(q["messages"], *messages, "{q}");
        assert_eq!(q["consumers"], *consumers, "{q}");
    }

    assert!(warren.terminate(Duration::from_secs(25)).success());
    // Once stopped it is no longer listed.
    let (code, out, _) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0);
    let doc: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(doc["instances"], serde_json::json!([]), "{doc}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_instance_expires_without_a_shutdown_record() {
    let mut env = TestEnv::new("reg_expire").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;
    let key = instance_key(&env, pid);

    // SIGKILL: no deregistration, so the hash lives out its TTL and then disappears.
    warren.kill9();
    let killed = Instant::now();
    let ttl: i64 = redis_query(&env, redis::cmd("TTL").arg(&key)).await;
    assert!(ttl > 25 && ttl <= 30, "TTL {ttl} right after the kill");
    wait_until("the hash expired", Duration::from_secs(35), || async {
        try_redis_query::<i64>(&redis_url(), redis::cmd("EXISTS").arg(&key)).await == Some(0)
    })
    .await;
    assert!(
        killed.elapsed() > Duration::from_secs(25),
        "expired after {:?}",
        killed.elapsed()
    );
    assert!(shutdowns(&env).await.is_empty());
}

/// With the default heartbeat, `warren status` shows counters at most about two seconds old
/// (they used to be up to 10 s old), and what Redis holds is escaped before the terminal.
#[tokio::test(flavor = "multi_thread")]
async fn status_is_fresh_by_default_and_escapes_what_redis_holds() {
    let env = TestEnv::new("reg_fresh").await;
    assert_eq!(
        env.setting("REGISTRY_HEARTBEAT_MS"),
        None,
        "the default heartbeat"
    );
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;

    env.publish_users(300).await;
    wait_until("300 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 300
    })
    .await;
    let inserted_at = std::time::Instant::now();
    let counted = loop {
        let (code, out, err) = env.run_async(&["status", "--json"]).await;
        assert_eq!(code, 0, "{err}");
        let doc: Value = serde_json::from_str(&out).expect("json");
        let mine = doc["instances"]
            .as_array()
            .and_then(|l| l.iter().find(|i| i["pid"] == pid).cloned());
        if mine.is_some_and(|i| i["inserted"] == 300) {
            break inserted_at.elapsed();
        }
        assert!(
            inserted_at.elapsed() < Duration::from_secs(10),
            "status still behind the table after 10 s: {doc}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // One heartbeat (1 s) and the time `status` takes (its trend sample alone is 1 s).
    assert!(
        counted < Duration::from_millis(3500),
        "status caught up {counted:?} after the last insert"
    );

    // A record written by anyone who can write to Redis, its strings full of terminal escapes.
    let (_, prefix) = redis_of(&env);
    let evil = format!("{prefix}:instances:evil:1");
    let mut record = instance(&env, pid).await;
    record["host"] = "evil\u{1b}]0;owned\u{7}".into();
    record["pid"] = 1.into();
    record["roles"] = "\u{1b}[2J\u{1b}[H".into();
    record["pipelines"][0]["name"] = "users\r\u{9b}31m".into();
    let _: () = redis_query(
        &env,
        redis::cmd("HSET")
            .arg(&evil)
            .arg("record")
            .arg(record.to_string()),
    )
    .await;
    let _: () = redis_query(&env, redis::cmd("EXPIRE").arg(&evil).arg(60)).await;
    for args in [&["status"][..], &["status", "--json"]] {
        let (code, out, err) = env.run_async(args).await;
        assert_eq!(code, 0, "{err}");
        assert!(
            !out.contains(['\u{1b}', '\u{7}', '\r', '\u{9b}']),
            "warren {args:?} printed a terminal control:\n{out:?}"
        );
        assert!(out.contains("evil"), "{out}");
    }
    let _: () = redis_query(&env, redis::cmd("DEL").arg(&evil)).await;
}

/// `status --json` is a versioned document (docs/operations.md, "`status --json`"), read here from
/// a running instance: every number a JSON number, the status and breaker their lower-case names,
/// each stage's counts an object, the pipelines it runs with their queues.
#[tokio::test(flavor = "multi_thread")]
async fn status_json_follows_its_documented_schema() {
    let mut env = TestEnv::new("reg_schema").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("USERS_PROC_CONCURRENCY", "2");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let warren = env.start(&["--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_registered(&env, &warren).await;
    env.publish_users(7).await;
    wait_until("7 rows counted", Duration::from_secs(20), || async {
        instance(&env, pid).await["inserted"] == 7
    })
    .await;

    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    assert_eq!(doc["version"], 1, "{doc}");
    let i = doc["instances"]
        .as_array()
        .and_then(|l| l.iter().find(|i| i["pid"] == pid))
        .unwrap_or_else(|| panic!("no instance {pid}: {doc}"));
    for number in [
        "format",
        "pid",
        "started_at",
        "last_heartbeat",
        "processors",
        "concurrency",
        "rate_limit_per_s",
        "shutdown_timeout_ms",
        "received",
        "inserted",
        "retried",
        "dead_lettered",
        "inflight",
        "received_per_s",
        "inserted_per_s",
    ] {
        assert!(i[number].is_number(), "{number} is not a JSON number: {i}");
    }
    for text in ["host", "run", "roles", "version"] {
        assert!(i[text].is_string(), "{text} is not a string: {i}");
    }
    assert_eq!(i["processors"], 2, "{i}");
    assert_eq!(i["inserted"], 7, "{i}");
    assert_eq!(i["status"], "running", "{i}");
    assert_eq!(i["breaker"], "closed", "{i}");
    let main = &i["stages"]["users/main"];
    assert_eq!(main["inserted"], 7, "{i}");
    assert_eq!(main["paused"], false, "{i}");
    assert!(main["received_per_s"].is_number(), "{i}");
    let users = &i["pipelines"][0];
    assert_eq!(users["name"], "users", "{i}");
    assert_eq!(users["main_queue"], env.main_queue.as_str(), "{i}");
    assert_eq!(
        users["retry_queues"],
        serde_json::json!([env.retry_queue]),
        "{i}"
    );
    assert_eq!(users["dlq_queue"], env.dlq_queue.as_str(), "{i}");
    assert_eq!(doc["pipelines"][0]["name"], "users", "{doc}");
    let queue = doc["queues"]
        .as_array()
        .and_then(|q| q.iter().find(|q| q["name"] == env.main_queue.as_str()))
        .unwrap_or_else(|| panic!("no main queue: {doc}"));
    assert_eq!(queue["pipeline"], "users", "{queue}");
    assert!(queue["messages"].is_number(), "{queue}");
}

/// Registry entries that are not this warren's record (an older warren's hash, another format,
/// garbage, another Redis type) are listed as unreadable by `status` (table and JSON, exit 0),
/// and `ctl` names them as not addressed: never a crash, never silently skipped.
#[tokio::test(flavor = "multi_thread")]
async fn unreadable_records_are_shown_as_such() {
    let env = TestEnv::new("reg_unreadable").await;
    let _cleanup = RedisCleanup::new(&env);
    let (_, prefix) = redis_of(&env);
    let key = |name: &str| format!("{prefix}:instances:{name}:1");
    let _: () = redis_query(
        &env,
        redis::cmd("HSET").arg(key("old")).arg(&[
            ("host", "old"),
            ("pid", "1"),
            ("status", "running"),
            ("processors", "2"),
        ]),
    )
    .await;
    let _: () = redis_query(
        &env,
        redis::cmd("HSET")
            .arg(key("newer"))
            .arg("record")
            .arg(r#"{"format":2,"host":"newer","pid":1}"#),
    )
    .await;
    let _: () = redis_query(
        &env,
        redis::cmd("HSET")
            .arg(key("garbled"))
            .arg("record")
            .arg("{not json"),
    )
    .await;
    let _: () = redis_query(&env, redis::cmd("SET").arg(key("string")).arg("x")).await;
    // A key that is not UTF-8 (found by the review of 2026-11-28: it made every listing read
    // as "Redis unreachable", blinding status and ctl to every instance).
    let mut binary = format!("{prefix}:instances:").into_bytes();
    binary.extend_from_slice(b"h\xff\xfe:9");
    let _: () = redis_query(&env, redis::cmd("HSET").arg(&binary).arg("record").arg("x")).await;

    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    for (name, why) in [
        ("old", "older warren"),
        ("newer", "record format 2"),
        ("garbled", "not a warren record"),
        ("string", "not a hash"),
    ] {
        let row = out
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|t| t.first() == Some(&format!("{name}:1").as_str()))
            .unwrap_or_else(|| panic!("no row for {name}:\n{out}"));
        assert_eq!(row.get(2), Some(&"unreadable"), "{out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with(&key(name)) && l.contains(why)),
            "no reason {why:?} for {name}:\n{out}"
        );
    }
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let listed = doc["instances"].as_array().expect("instances");
    assert_eq!(listed.len(), 5, "{doc}");
    for entry in listed {
        assert!(entry["unreadable"].is_string(), "{entry}");
        assert!(entry["key"].is_string(), "{entry}");
    }

    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(
        err.matches("not addressed, its registry record cannot be read")
            .count(),
        5,
        "{err}"
    );
    assert!(err.contains("no live instance registered"), "{err}");
}
