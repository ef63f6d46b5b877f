//! Remote control through Redis (`warren ctl`): pause holds deliveries and resume drains the
//! backlog, scale changes the processors live, drain stops an instance with nothing lost, every
//! outcome lands in `warren ctl history`, bad targets are refused, `--all` reaches every
//! instance, and a command to an instance already stopping fails without spoiling its stop.
//! With CONTROL_SECRET, commands are signed: `ctl` with the secret works, and commands that are
//! unsigned, badly signed, stale, from the future, redirected or replayed are refused, recorded
//! as failed and change nothing; without it, everything works as before, with a warning.

mod common;

use std::time::{Duration, Instant};

use common::*;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

/// `warren ctl ARGS`, which must succeed with one `executed` line per pid in `pids`.
async fn ctl_ok(env: &TestEnv, args: &[&str], pids: &[i32]) {
    let mut full = vec!["ctl"];
    full.extend_from_slice(args);
    let (code, out, err) = env.run_async(&full).await;
    assert_eq!(code, 0, "warren {full:?}:\n{out}\n{err}");
    let command = args[0];
    for pid in pids {
        let me = format!("{}:{pid}", host());
        assert!(
            out.lines().any(|l| {
                let t: Vec<&str> = l.split_whitespace().collect();
                t == [me.as_str(), command, "executed"]
            }),
            "no `{me}  {command}  executed` line from warren {full:?}:\n{out}"
        );
    }
    assert_eq!(
        out.lines().filter(|l| !l.trim().is_empty()).count(),
        pids.len(),
        "warren {full:?}:\n{out}"
    );
}

/// `warren ctl history` and `--json` both show `command` on `pid` with `outcome`; returns the
/// JSON entry.
async fn assert_in_history(env: &TestEnv, command: &str, pid: i32, outcome: &str) -> Value {
    let me = format!("{}:{pid}", host());
    let (code, out, err) = env.run_async(&["ctl", "history"]).await;
    assert_eq!(code, 0, "warren ctl history:\n{out}\n{err}");
    // WHEN is two words (date, time), then INSTANCE COMMAND OUTCOME [DETAIL].
    assert!(
        out.lines().skip(1).any(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            t.len() >= 5 && t[2] == me && t[3] == command && t[4] == outcome
        }),
        "no {command} {outcome} for {me} in the history:\n{out}"
    );
    let (code, out, err) = env.run_async(&["ctl", "history", "--json"]).await;
    assert_eq!(code, 0, "warren ctl history --json:\n{out}\n{err}");
    let entries: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let entry = entries
        .iter()
        .find(|e| e["command"] == command && e["pid"] == pid)
        .unwrap_or_else(|| panic!("no {command} for {me} in:\n{out}"))
        .clone();
    assert_eq!(entry["outcome"], outcome, "{entry}");
    assert_eq!(entry["host"], host().as_str(), "{entry}");
    assert!(
        entry["id"].as_str().is_some_and(|s| !s.is_empty()),
        "{entry}"
    );
    entry
}

/// A fresh env with a fast heartbeat, declared.
async fn env_for(test: &str) -> (TestEnv, RedisCleanup) {
    let mut env = TestEnv::new(test).await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    env.declare();
    let cleanup = RedisCleanup::new(&env);
    (env, cleanup)
}

#[tokio::test(flavor = "multi_thread")]
async fn pause_holds_deliveries_and_resume_drains_them() {
    let (env, _cleanup) = env_for("ctl_pause").await;
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    env.publish_users(20).await;
    wait_until("20 rows", Duration::from_secs(20), || async {
        env.count_rows().await == 20
    })
    .await;

    ctl_ok(&env, &["pause", "--all"], &[pid]).await;
    wait_record_field(&env, pid, "status", "paused").await;

    // Published while paused: the messages wait in the queue and nothing is inserted. No sentinel
    // can pass a paused consumer, so the proof is the broker's: the queue has no consumer, hence
    // nothing can be delivered, rather than a wait that only makes a delivery unlikely.
    let held = env.publish_users(300).await;
    wait_until(
        "300 messages ready and no consumer",
        Duration::from_secs(10),
        || async { env.queue_state(&env.main_queue).await == (300, 0) },
    )
    .await;
    assert_eq!(env.count_rows().await, 20, "rows inserted while paused");
    assert_eq!(instance(&env, pid).await["status"], "paused");
    assert!(warren.is_running());

    ctl_ok(&env, &["resume", "--host", &host()], &[pid]).await;
    wait_until("320 rows after resume", Duration::from_secs(30), || async {
        env.count_rows().await == 320
    })
    .await;
    let ids = env.row_ids().await;
    assert!(held.iter().all(|id| ids.contains(id)));
    wait_running(&env, pid).await;
    wait_until("the queue drained", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;

    assert_in_history(&env, "pause", pid, "executed").await;
    assert_in_history(&env, "resume", pid, "executed").await;
    // Newest first.
    let (_, out, _) = env.run_async(&["ctl", "history", "--json"]).await;
    let commands: Vec<String> = out
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["command"].to_string())
        .collect();
    assert_eq!(commands, ["\"resume\"", "\"pause\""], "{out}");

    // A paused instance drains at once: the held messages stay in the queue.
    ctl_ok(&env, &["pause", "--all"], &[pid]).await;
    wait_record_field(&env, pid, "status", "paused").await;
    env.publish_users(50).await;
    let asked = Instant::now();
    ctl_ok(&env, &["drain", "--all"], &[pid]).await;
    let status = warren.wait(Duration::from_secs(25));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "a paused instance took {:?} to drain",
        asked.elapsed()
    );
    assert_eq!(env.count_rows().await, 320);
    assert_eq!(env.queue_state(&env.main_queue).await, (50, 0));
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["reason"], "drain");
    assert_eq!(records[0]["inserted"], 320);
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_changes_the_number_of_processors() {
    let (mut env, _cleanup) = env_for("ctl_scale").await;
    env.set("USERS_PROC_CONCURRENCY", "2")
        .set("USERS_BATCH_SIZE", "100");
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    assert_eq!(instance(&env, pid).await["processors"], 2);

    // Scaled up while batches are in flight (held by a table lock), then more published.
    let lock = InsertLock::take(&env).await;
    let mut ids = env.publish_users(2_000).await;
    lock.wait_for_a_blocked_insert(&env).await;
    ctl_ok(&env, &["scale", "--processors", "3", "--all"], &[pid]).await;
    wait_record_field(&env, pid, "processors", "3").await;
    lock.release().await;
    ids.extend(env.publish_users(1_000).await);
    wait_until("3,000 rows", Duration::from_secs(60), || async {
        env.count_rows().await >= 3_000
    })
    .await;

    // And down to one.
    ctl_ok(
        &env,
        &["scale", "--processors", "1", "--host", &host()],
        &[pid],
    )
    .await;
    wait_record_field(&env, pid, "processors", "1").await;
    ids.extend(env.publish_users(500).await);
    wait_until("3,500 rows", Duration::from_secs(60), || async {
        env.count_rows().await >= 3_500
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    wait_until("the queue drained", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_queue_empty(&env, &env.dlq_queue).await;
    assert_eq!(instance(&env, pid).await["status"], "running");

    let entry = assert_in_history(&env, "scale", pid, "executed").await;
    assert_eq!(entry["processors"], 1, "the newest scale: {entry}");
    let (_, out, _) = env.run_async(&["ctl", "history"]).await;
    assert!(out.contains("processors=3"), "{out}");
    assert!(out.contains("processors=1"), "{out}");

    // The scaled processors take part in the graceful stop: it completes, and promptly.
    let asked = Instant::now();
    let status = warren.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stop took {:?}",
        asked.elapsed()
    );
    assert!(
        warren.logs().contains("stopped cleanly"),
        "log:\n{}",
        warren.logs()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_exits_zero_with_nothing_lost() {
    const N: i64 = 3_000;
    let (mut env, _cleanup) = env_for("ctl_drain").await;
    env.set("USERS_BATCH_SIZE", "100");
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;

    // Drain in the middle of a backlog, with batches in flight (held by a table lock).
    let lock = InsertLock::take(&env).await;
    let ids = env.publish_users(N as usize).await;
    lock.wait_for_a_blocked_insert(&env).await;
    ctl_ok(&env, &["drain", "--all"], &[pid]).await;
    assert!(
        warren.is_running(),
        "exited before its batches were inserted"
    );
    lock.release().await;
    let status = warren.wait(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());

    // Whatever it took is inserted and acked; the rest waits in the queue.
    let rows = env.count_rows().await;
    let (ready, consumers) = env.queue_state(&env.main_queue).await;
    assert_eq!(consumers, 0);
    assert!(
        rows > 0 && ready > 0,
        "the drain should land mid-run: {rows} rows, {ready} ready"
    );
    assert_eq!(
        rows + ready as i64,
        N,
        "{rows} rows + {ready} ready; log:\n{}",
        warren.logs()
    );
    let exists: i64 = redis_query(&env, redis::cmd("EXISTS").arg(instance_key(&env, pid))).await;
    assert_eq!(exists, 0, "the instance hash outlived the drain");
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r["reason"], "drain", "{r}");
    assert_eq!(r["pid"], pid, "{r}");
    assert_eq!(r["inserted"], rows, "{r}");
    assert_eq!(r["received"], rows, "{r}");
    assert_in_history(&env, "drain", pid, "executed").await;

    // Another instance takes the rest: every message arrives.
    let mut next = env.start(&["--roles", "consumer"]);
    wait_record_field(&env, next.pid(), "status", "running").await;
    wait_until("every row", Duration::from_secs(60), || async {
        env.count_rows().await >= N
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    let status = next.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit {status:?}; log:\n{}", next.logs());
    assert_queue_empty(&env, &env.dlq_queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_targets_and_failed_commands_are_refused_clearly() {
    let (mut env, _cleanup) = env_for("ctl_refuse").await;
    // An API-only instance: live, but with no consumer to pause.
    let mut warren = env.start(&["--roles", "api"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;

    // No instance on that host.
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--host", "nonexistent"])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("no live instance") && err.contains("nonexistent"),
        "unclear message:\n{err}"
    );

    // Clap refuses a missing or double target and an out-of-range count.
    for args in [
        &["ctl", "pause"][..],
        &["ctl", "resume"],
        &["ctl", "drain"],
        &["ctl", "scale", "--processors", "2"],
        &["ctl", "pause", "--all", "--host", "x"],
        &["ctl", "scale", "--processors", "0", "--all"],
        &["ctl", "scale", "--processors", "257", "--all"],
        // Bounds that cannot hold and a history of nothing: usage errors too.
        &["ctl", "scale", "--min", "9", "--max", "2", "--all"],
        &["ctl", "history", "--limit", "0"],
        // (and publish's rate of nothing, refused the same way)
        &["publish", "--count", "1", "--rate", "0"],
    ] {
        let (code, out, err) = env.run_async(args).await;
        assert_eq!(code, 2, "warren {args:?}:\n{out}\n{err}");
        assert!(out.is_empty(), "warren {args:?} printed:\n{out}");
    }
    let (_, _, err) = env.run_async(&["ctl", "pause"]).await;
    assert!(
        err.contains("--host") && err.contains("--all"),
        "clap's message should name the choices:\n{err}"
    );
    // Nothing refused reached an instance.
    let (code, out, _) = env.run_async(&["ctl", "history", "--json"]).await;
    assert_eq!(code, 0);
    assert_eq!(out.trim(), "", "refused commands must not be recorded");

    // An entry that is no outcome (another writer's, not UTF-8) is shown as unreadable, in
    // the table and in --json, never skipped and never taken for an unreachable Redis.
    let prefix = env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string();
    let history = format!("{prefix}:ctl:history");
    redis_query::<i64>(
        &env,
        redis::cmd("LPUSH")
            .arg(&history)
            .arg(b"\xff\xfe not json".as_slice()),
    )
    .await;
    let (code, out, err) = env.run_async(&["ctl", "history"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("unreadable"), "the entry is not shown:\n{out}");
    let (code, out, err) = env.run_async(&["ctl", "history", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("\"unreadable\""),
        "the entry is not shown:\n{out}"
    );
    redis_query::<i64>(&env, redis::cmd("DEL").arg(&history)).await;

    // A command on pipelines skips an instance that runs none, said on stderr; with no other
    // instance nothing is addressed: exit 1, and nothing reaches the instance.
    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains(&format!(
            "{}:{pid}: skipped, it runs no pipeline (roles api)",
            host()
        )) && err.contains("no addressed instance runs a pipeline"),
        "{err}"
    );
    // Sent anyway (by hand, or an older ctl), the instance refuses it: recorded as failed.
    let run = instance(&env, pid).await["run"]
        .as_str()
        .expect("the instance's run")
        .to_string();
    let (id, json) = command_json("pause", now_s(), &format!("{}:{pid}/{run}", host()), None);
    push_raw(&env, pid, &[&json]).await;
    let o = wait_outcomes(&env, &id, 1).await;
    assert_eq!(o[0]["outcome"], "failed", "{o:?}");
    assert!(
        o[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("consumer")),
        "{o:?}"
    );
    assert_eq!(instance(&env, pid).await["status"], "running");

    // The split deployment the README shows (an API-only instance beside a consumer): a command
    // on pipelines reaches the consumer, skips the API instance, and exits 0 (review R35e F15:
    // every `ctl pause --all` of it exited 1). `drain` would reach both.
    env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    env.set("HTTP_ADDR", format!("127.0.0.1:{}", free_port()));
    let mut consumer = env.start(&["--roles", "consumer"]);
    let consumer_pid = consumer.pid();
    wait_running(&env, consumer_pid).await;
    for (args, status) in [
        (["pause", "--all"], "paused"),
        (["resume", "--all"], "running"),
    ] {
        let mut full = vec!["ctl"];
        full.extend_from_slice(&args);
        let (code, out, err) = env.run_async(&full).await;
        assert_eq!(code, 0, "{full:?}:\n{out}\n{err}");
        assert!(
            out.contains(&format!("{}:{consumer_pid}", host()))
                && !out.contains(&format!("{}:{pid} ", host()))
                && err.contains(&format!("{}:{pid}: skipped", host())),
            "{full:?}:\n{out}\n{err}"
        );
        wait_record_field(&env, consumer_pid, "status", status).await;
    }
    assert!(consumer.terminate(Duration::from_secs(25)).success());
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

#[tokio::test(flavor = "multi_thread")]
async fn all_reaches_every_instance() {
    let (mut env, _cleanup) = env_for("ctl_all").await;
    let mut first = env.start(&["--roles", "consumer"]);
    env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    let mut second = env.start(&["--roles", "consumer"]);
    let pids = [first.pid(), second.pid()];
    for pid in pids {
        wait_running(&env, pid).await;
    }

    ctl_ok(&env, &["pause", "--all"], &pids).await;
    for pid in pids {
        wait_record_field(&env, pid, "status", "paused").await;
    }
    // Neither instance consumes: the queue has no consumer (as in
    // `pause_holds_deliveries_and_resume_drains_them`), so nothing can be delivered.
    let ids = env.publish_users(400).await;
    wait_until(
        "400 messages ready and no consumer",
        Duration::from_secs(10),
        || async { env.queue_state(&env.main_queue).await == (400, 0) },
    )
    .await;
    assert_eq!(env.count_rows().await, 0, "rows inserted while paused");

    ctl_ok(&env, &["scale", "--processors", "4", "--all"], &pids).await;
    ctl_ok(&env, &["resume", "--all"], &pids).await;
    for pid in pids {
        wait_running(&env, pid).await;
        wait_record_field(&env, pid, "processors", "4").await;
    }
    wait_until("400 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 400
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());

    ctl_ok(&env, &["drain", "--all"], &pids).await;
    for w in [&mut first, &mut second] {
        let status = w.wait(Duration::from_secs(30));
        assert!(status.success(), "exit {status:?}; log:\n{}", w.logs());
    }
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 2, "{records:?}");
    for pid in pids {
        assert!(
            records
                .iter()
                .any(|r| r["pid"] == pid && r["reason"] == "drain"),
            "no drain record for {pid}: {records:?}"
        );
        let exists: i64 =
            redis_query(&env, redis::cmd("EXISTS").arg(instance_key(&env, pid))).await;
        assert_eq!(exists, 0);
        for command in ["pause", "scale", "resume", "drain"] {
            assert_in_history(&env, command, pid, "executed").await;
        }
    }
    let inserted: i64 = records
        .iter()
        .map(|r| r["inserted"].as_i64().unwrap())
        .sum();
    assert_eq!(inserted, 400, "{records:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_to_a_stopping_instance_fails_and_it_still_deregisters() {
    let (mut env, _cleanup) = env_for("ctl_stopping").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "60000");
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;

    // SIGTERM while a batch is held by a table lock: the instance stays in its graceful stop.
    let lock = InsertLock::take(&env).await;
    let ids = env.publish_users(300).await;
    lock.wait_for_a_blocked_insert(&env).await;
    warren.signal("TERM");
    wait_record_field(&env, pid, "status", "draining").await;

    // A command that arrives now cannot be applied: it is answered as failed, promptly.
    let asked = Instant::now();
    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    let took = asked.elapsed();
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains(&format!("{}:{pid}  pause  failed", host())),
        "expected a failed outcome, got (after {took:?}):\n{out}"
    );
    assert!(took < Duration::from_secs(10), "ctl took {took:?}");
    assert!(warren.is_running());

    // The stop then completes as usual: exit 0, hash gone, a shutdown record.
    lock.release().await;
    let status = warren.wait(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}; log:\n{}", warren.logs());
    let exists: i64 = redis_query(&env, redis::cmd("EXISTS").arg(instance_key(&env, pid))).await;
    assert_eq!(exists, 0, "the instance hash outlived the process");
    let records = shutdowns(&env).await;
    assert_eq!(records.len(), 1, "no shutdown record: {records:?}");
    assert_eq!(records[0]["reason"], "signal");
    let entry = assert_in_history(&env, "pause", pid, "failed").await;
    assert!(
        entry["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{entry}"
    );

    // Nothing lost: what it did not insert is back in the queue.
    let rows = env.count_rows().await;
    let (ready, _) = env.queue_state(&env.main_queue).await;
    assert_eq!(rows + ready as i64, ids.len() as i64);
}

// ---- signed commands ------------------------------------------------------------------------

const SECRET: &str = "test-control-secret";

/// Unix seconds.
fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A command as `warren ctl` queues it, for the instance `target` (`host:pid`), signed with
/// `secret` by the encoding docs/operations.md ("Signed commands") documents (computed here, not
/// by warren's code).
fn command_json(
    command: &str,
    issued_at: u64,
    target: &str,
    sign: Option<(&str, &str)>,
) -> (String, String) {
    let id = uuid::Uuid::new_v4().to_string();
    let by = "test:1";
    let mut doc = json!({
        "id": id, "command": command, "issued_at": issued_at, "by": by, "target": target,
    });
    if let Some((secret, signed_for)) = sign {
        let issued = issued_at.to_string();
        let mut canonical = b"warren-ctl-v1\n".to_vec();
        for (name, value) in [
            ("id", id.as_str()),
            ("command", command),
            ("processors", ""),
            ("issued_at", issued.as_str()),
            ("by", by),
            ("target", signed_for),
        ] {
            canonical.extend_from_slice(format!("{name}={}:{value}\n", value.len()).as_bytes());
        }
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(&canonical);
        let tag: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        doc["signature"] = json!(tag);
    }
    (id, doc.to_string())
}

/// Pushes raw command JSON into the command list of the env's instance `pid`, as anyone with
/// write access to Redis could.
async fn push_raw(env: &TestEnv, pid: i32, commands: &[&str]) {
    let prefix = env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string();
    let key = format!("{prefix}:commands:{}:{pid}", host());
    let _: i64 = redis_query(env, redis::cmd("RPUSH").arg(&key).arg(commands)).await;
}

/// Every history entry of command `id`, newest first.
async fn outcomes_of(env: &TestEnv, id: &str) -> Vec<Value> {
    let prefix = env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string();
    let raw: Vec<String> = redis_query(
        env,
        redis::cmd("LRANGE")
            .arg(format!("{prefix}:ctl:history"))
            .arg(0)
            .arg(-1),
    )
    .await;
    raw.iter()
        .map(|r| serde_json::from_str::<Value>(r).unwrap())
        .filter(|v| v["id"] == id)
        .collect()
}

/// Waits until command `id` has `n` outcomes; returns them, newest first.
async fn wait_outcomes(env: &TestEnv, id: &str, n: usize) -> Vec<Value> {
    wait_until(
        &format!("{n} outcome(s) of command {id}"),
        Duration::from_secs(15),
        || async { outcomes_of(env, id).await.len() >= n },
    )
    .await;
    outcomes_of(env, id).await
}

/// `warren ctl ARGS` with CONTROL_SECRET replaced by `secret` (removed for `None`).
async fn ctl_with_secret(
    env: &TestEnv,
    args: &[&str],
    secret: Option<&str>,
) -> (i32, String, String) {
    let mut full = vec!["ctl"];
    full.extend_from_slice(args);
    let mut cmd = env.command(&full);
    match secret {
        Some(s) => cmd.env("CONTROL_SECRET", s),
        None => cmd.env_remove("CONTROL_SECRET"),
    };
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Publishes `n` users and waits until the table holds `total` rows: the instance consumes.
async fn still_consumes(env: &TestEnv, n: usize, total: i64) {
    env.publish_users(n).await;
    wait_until(
        &format!("{total} rows"),
        Duration::from_secs(30),
        || async { env.count_rows().await == total },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_secret_signed_commands_work_and_forged_ones_are_refused() {
    let (mut env, _cleanup) = env_for("ctl_signed").await;
    env.set("CONTROL_SECRET", SECRET);
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    // Commands are signed for this run of the instance, `host:pid/run`.
    let run = instance(&env, pid).await["run"]
        .as_str()
        .expect("run")
        .to_string();
    assert_eq!(run.len(), 32, "a random run id in the hash: {run:?}");
    let me = format!("{}:{pid}/{run}", host());

    // `warren ctl` with the same secret: pause and resume work.
    ctl_ok(&env, &["pause", "--all"], &[pid]).await;
    wait_record_field(&env, pid, "status", "paused").await;
    ctl_ok(&env, &["resume", "--all"], &[pid]).await;
    wait_running(&env, pid).await;
    assert_in_history(&env, "pause", pid, "executed").await;
    assert_in_history(&env, "resume", pid, "executed").await;
    still_consumes(&env, 10, 10).await;

    // A correctly signed pause, captured by someone who can read Redis: it works once...
    let (captured_id, captured) = command_json("pause", now_s(), &me, Some((SECRET, &me)));
    push_raw(&env, pid, &[&captured]).await;
    let o = wait_outcomes(&env, &captured_id, 1).await;
    assert_eq!(o[0]["outcome"], "executed", "{o:?}");
    wait_record_field(&env, pid, "status", "paused").await;
    ctl_ok(&env, &["resume", "--all"], &[pid]).await;
    wait_running(&env, pid).await;

    // ...and every forged or replayed pause is refused.
    let other = format!("{}:{}/{run}", host(), pid + 1);
    // Signed for this host and PID but another run: captured from an earlier process with the
    // same PID (PID 1 in every container), or in the format of before runs existed.
    let bare = format!("{}:{pid}", host());
    let (earlier, earlier_json) = command_json("pause", now_s(), &bare, Some((SECRET, &bare)));
    let earlier_run = format!("{bare}/0123456789abcdef0123456789abcdef");
    let (earlier2, earlier2_json) =
        command_json("pause", now_s(), &earlier_run, Some((SECRET, &earlier_run)));
    let (unsigned, unsigned_json) = command_json("pause", now_s(), &me, None);
    let (wrong, wrong_json) = command_json("pause", now_s(), &me, Some(("not-the-secret", &me)));
    let (stale, stale_json) = command_json("pause", now_s() - 600, &me, Some((SECRET, &me)));
    let (future, future_json) = command_json("pause", now_s() + 600, &me, Some((SECRET, &me)));
    // Signed for another instance, its target field rewritten to this one.
    let (redirected, redirected_json) = command_json("pause", now_s(), &me, Some((SECRET, &other)));
    push_raw(
        &env,
        pid,
        &[
            &unsigned_json,
            &wrong_json,
            &stale_json,
            &future_json,
            &redirected_json,
            &earlier_json,
            &earlier2_json,
            &captured,
        ],
    )
    .await;
    for (id, words) in [
        (&unsigned, &["unsigned", "CONTROL_SECRET"][..]),
        (&wrong, &["bad signature"]),
        (&stale, &["stale", "s ago"]),
        (&future, &["future", "ahead"]),
        (&redirected, &["bad signature"]),
        (&earlier, &["another run"]),
        (&earlier2, &["another run"]),
    ] {
        let o = wait_outcomes(&env, id, 1).await;
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!(o[0]["outcome"], "failed", "{o:?}");
        assert_eq!(o[0]["command"], "pause", "{o:?}");
        assert_eq!(o[0]["pid"], pid, "{o:?}");
        let error = o[0]["error"].as_str().unwrap_or_default();
        for w in words {
            assert!(error.contains(w), "{id}: {error:?} lacks {w:?}");
        }
    }
    let o = wait_outcomes(&env, &captured_id, 2).await;
    assert_eq!(o.len(), 2, "{o:?}");
    assert_eq!(o[0]["outcome"], "failed", "the replay: {o:?}");
    assert!(
        o[0]["error"].as_str().is_some_and(|e| e.contains("replay")),
        "{o:?}"
    );
    assert_eq!(o[1]["outcome"], "executed", "{o:?}");
    let (code, out, err) = env.run_async(&["ctl", "history"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("refused: replay"), "{out}");

    // None of them paused it: still running, and messages published now are inserted.
    assert_eq!(instance(&env, pid).await["status"], "running");
    still_consumes(&env, 25, 35).await;
    let logs = warren.logs();
    assert!(logs.contains("remote command refused"), "{logs}");
    assert!(!logs.contains("CONTROL_SECRET is not set"), "{logs}");
    assert!(!logs.contains(SECRET), "the secret is in the log:\n{logs}");

    // Outcomes are signed: a line written into the history by someone who can write to Redis
    // (here claiming this instance executed a drain, with terminal escapes in its strings) is
    // marked unverified, and no escape reaches the terminal.
    let prefix = env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string();
    let forged = json!({
        "id": "forged-1", "command": "drain\u{1b}[2J", "host": format!("{}\u{1b}]0;owned\u{7}", host()),
        "pid": pid, "outcome": "executed", "error": "\u{1b}[31mred\r", "at": now_s(), "run": run,
        "signature": "00".repeat(32),
    });
    let _: i64 = redis_query(
        &env,
        redis::cmd("LPUSH")
            .arg(format!("{prefix}:ctl:history"))
            .arg(forged.to_string()),
    )
    .await;
    let (code, out, err) = env.run_async(&["ctl", "history"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\r'), "{out:?}");
    let line = out
        .lines()
        .find(|l| l.contains("drain"))
        .expect("the forged line");
    assert!(
        line.contains("unverified") && line.contains("\\u{1b}"),
        "{line}"
    );
    assert!(
        out.lines()
            .filter(|l| l.contains(" pause ") || l.contains(" resume "))
            .all(|l| !l.contains("unverified")),
        "the instance's own outcomes verify:\n{out}"
    );
    let (code, out, err) = env.run_async(&["ctl", "history", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains('\u{1b}'), "{out:?}");
    let entries: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        entries
            .iter()
            .all(|e| e["verified"] == (e["id"] != "forged-1")),
        "{out}"
    );
    // Without the secret, `ctl history` cannot tell, and says nothing of verification.
    let (_, out, _) = ctl_with_secret(&env, &["history", "--json"], None).await;
    assert!(!out.contains("verified"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ctl_without_the_instances_secret_is_refused_clearly() {
    let (mut env, _cleanup) = env_for("ctl_nosecret").await;
    env.set("CONTROL_SECRET", SECRET);
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    let me = format!("{}:{pid}", host());
    wait_running(&env, pid).await;

    let (code, out, err) = ctl_with_secret(&env, &["pause", "--all"], None).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains(&format!("{me}  pause  failed: refused: unsigned command")),
        "{out}"
    );
    assert!(
        err.contains("CONTROL_SECRET is not set here"),
        "no clear hint on stderr:\n{err}"
    );

    let (code, out, err) = ctl_with_secret(&env, &["pause", "--all"], Some("another-secret")).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains(&format!("{me}  pause  failed: refused: bad signature")),
        "{out}"
    );
    assert!(err.contains("CONTROL_SECRET here differs"), "{err}");
    assert!(!out.contains("another-secret") && !err.contains("another-secret"));

    let entry = assert_in_history(&env, "pause", pid, "failed").await;
    assert!(
        entry["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("refused")),
        "{entry}"
    );
    assert_eq!(instance(&env, pid).await["status"], "running");
    still_consumes(&env, 20, 20).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_secret_commands_work_as_before_and_a_warning_is_logged() {
    let (env, _cleanup) = env_for("ctl_open").await;
    assert_eq!(env.setting("CONTROL_SECRET"), None);
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    let warnings: Vec<String> = warren
        .logs()
        .lines()
        .filter(|l| l.contains("CONTROL_SECRET"))
        .map(String::from)
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains("anyone with write access to Redis"),
        "{warnings:?}"
    );

    ctl_ok(&env, &["pause", "--all"], &[pid]).await;
    wait_record_field(&env, pid, "status", "paused").await;
    // A command in the format of older `warren ctl`s (no target, no signature) still works.
    let id = uuid::Uuid::new_v4().to_string();
    let old = json!({"id": id, "command": "resume", "issued_at": now_s(), "by": "old:1"});
    push_raw(&env, pid, &[&old.to_string()]).await;
    let o = wait_outcomes(&env, &id, 1).await;
    assert_eq!(o[0]["outcome"], "executed", "{o:?}");
    wait_running(&env, pid).await;
    still_consumes(&env, 15, 15).await;
}

/// A command that is not UTF-8 is an unreadable command like any other: logged and dropped,
/// the Redis link kept (it was taken for Redis being unreachable, the link redone and the
/// command lost without a word); and a command's id is logged capped, not whole (review of
/// issue 35, F3 and F4).
#[tokio::test(flavor = "multi_thread")]
async fn a_command_not_utf8_is_unreadable_and_a_huge_id_is_logged_capped() {
    let (env, _cleanup) = env_for("ctl_bytes").await;
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    let prefix = env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string();
    let key = format!("{prefix}:commands:{}:{pid}", host());
    let mut bad = br#"{"id":"x5","command":"pa"#.to_vec();
    bad.push(0xff);
    bad.extend_from_slice(format!(r#"use","issued_at":{},"by":"a:1"}}"#, now_s()).as_bytes());
    let _: i64 = redis_query(&env, redis::cmd("RPUSH").arg(&key).arg(bad)).await;
    let id = "i".repeat(100_000);
    let pause = json!({"id": id, "command": "pause", "issued_at": now_s(), "by": "t:1"});
    push_raw(&env, pid, &[&pause.to_string()]).await;
    wait_record_field(&env, pid, "status", "paused").await;
    let logs = warren.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("unreadable remote command ignored") && l.contains("utf-8")),
        "no unreadable-command line for the bytes that are not UTF-8"
    );
    assert!(
        !logs.contains("Redis unreachable"),
        "a malformed command dropped the Redis link"
    );
    let longest = logs.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 4096, "a log line of {longest} bytes");
    assert!(
        logs.lines()
            .any(|l| l.contains("remote command") && l.contains("iiii")),
        "the pause's line is not logged"
    );
}

/// The gauge of `stage`'s batch inserts in flight; the endpoint must answer and the series exist.
async fn inserts_in_flight(env: &TestEnv, pipeline: &str) -> f64 {
    try_metric(
        env,
        "warren_pipeline_concurrency",
        &[("pipeline", pipeline), ("stage", "main")],
    )
    .await
    .unwrap_or_else(|| panic!("no warren_pipeline_concurrency for {pipeline} in /metrics"))
}

/// A command refused for one pipeline changes none (issue 34, item 7): users and `orders`, both
/// fixed at 2 inserts in flight under MAX_INSERTS_IN_FLIGHT=5; `scale --min 3 --max 3 --all`
/// fits for each alone (3 + 2) but not for both (3 + 3): refused, exit 1, and both are still at
/// 2, so the budget the refusal did not take is there for `orders` alone afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_change_of_bounds_changes_no_pipeline() {
    let (mut env, _cleanup) = env_for("ctl_all_or_nothing").await;
    env.set("MAX_INSERTS_IN_FLIGHT", "5")
        .set("USERS_BATCH_CONCURRENCY", "2");
    let names = PipelineNames::of(&env, "orders");
    let _names_cleanup = names.cleanup();
    let file = orders_pipeline(&env, &names, "batch_concurrency = 2").await;
    let warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    wait_until(
        "both at 2 inserts in flight",
        Duration::from_secs(15),
        || async {
            try_metric(
                &env,
                "warren_pipeline_concurrency",
                &[("pipeline", "users"), ("stage", "main")],
            )
            .await
                == Some(2.0)
                && try_metric(
                    &env,
                    "warren_pipeline_concurrency",
                    &[("pipeline", "orders"), ("stage", "main")],
                )
                .await
                    == Some(2.0)
        },
    )
    .await;

    let (code, out, err) = env
        .run_async(&["ctl", "scale", "--min", "3", "--max", "3", "--all"])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains(&format!("{}:{pid}", host()))
            && out.contains("failed")
            && out.contains("exceeds MAX_INSERTS_IN_FLIGHT (5)"),
        "{out}"
    );
    assert_in_history(&env, "concurrency", pid, "failed").await;
    // The command is answered after it was applied (or not): the gauges are final now.
    for pipeline in ["users", "orders"] {
        assert_eq!(
            inserts_in_flight(&env, pipeline).await,
            2.0,
            "{pipeline} changed by a refused command; log:\n{}",
            warren.logs()
        );
    }
    assert!(
        !warren
            .logs()
            .contains("concurrency moved into the bounds an operator set"),
        "log:\n{}",
        warren.logs()
    );

    // What the refusal did not take is still free: `orders` alone fits (3 + 2).
    let (code, out, err) = env
        .run_async(&[
            "ctl",
            "scale",
            "--min",
            "3",
            "--max",
            "3",
            "--all",
            "--pipeline",
            "orders",
        ])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("{}:{pid}  concurrency  executed", host())),
        "{out}"
    );
    assert_eq!(inserts_in_flight(&env, "orders").await, 3.0);
    assert_eq!(inserts_in_flight(&env, "users").await, 2.0);
    // And the pipelines still move.
    let ids = env.publish_users(20).await;
    wait_until("20 rows", Duration::from_secs(20), || async {
        env.count_rows().await == 20
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
}

/// A command no instance answers within the wait is withdrawn from the instance's list while it
/// is still queued, and said not applied; one the instance already took is said taken, with
/// where its outcome will show (review R35e F7: `ctl` said "no answer within 15 s" and left the
/// command queued, and the instance applied it 150 s later, behind a backlog). Two instances
/// with records and no process: `gone` takes nothing, `busy` takes its copy and never answers.
#[tokio::test(flavor = "multi_thread")]
async fn an_unanswered_command_is_withdrawn_or_said_taken() {
    let env = TestEnv::new("ctl_unanswered").await;
    let _cleanup = RedisCleanup::new(&env);
    let gone = register_record(&env, &fake_record("gone", 1, "consumer")).await;
    let busy = register_record(&env, &fake_record("busy", 2, "consumer")).await;
    let (url, _) = redis_of(&env);
    let taker = tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Some(Some(json)) =
                try_redis_query::<Option<String>>(&url, redis::cmd("LPOP").arg(&busy)).await
            {
                return Some(json);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    });

    let (code, out, err) = env.run_async(&["ctl", "pause", "--all"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    let left: i64 = redis_query(&env, redis::cmd("LLEN").arg(&gone)).await;
    assert_eq!(
        left, 0,
        "the unanswered command is still queued for gone:1:\n{out}"
    );
    let line = |who: &str| {
        out.lines()
            .find(|l| l.starts_with(who))
            .unwrap_or_else(|| panic!("no line for {who}:\n{out}"))
            .to_string()
    };
    assert_eq!(
        line("gone:1"),
        "gone:1  pause  no answer within 15 s (busy, or gone): withdrawn, not applied"
    );
    assert_eq!(
        line("busy:2"),
        "busy:2  pause  no answer within 15 s: the instance took it and may still apply it; \
         its outcome will show in `warren ctl history`"
    );
    let taken = taker.await.unwrap().expect("busy:2 took no command");
    assert!(taken.contains("\"pause\""), "{taken}");
}

/// `ctl reload` waits for the longest drain among the instances it addresses, as each one's
/// record publishes its `SHUTDOWN_TIMEOUT_MS` (review R35e F13: it waited on its own setting).
/// Two records with no process: one with a 5 s bound, one of an older warren without it (taken
/// to have ctl's own, 2 s): 15 s + 5 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_waits_for_the_instances_shutdown_bound() {
    let mut env = TestEnv::new("ctl_reload_wait").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "2000");
    let _cleanup = RedisCleanup::new(&env);
    let mut slow = fake_record("slow", 1, "consumer");
    slow["shutdown_timeout_ms"] = 5_000.into();
    register_record(&env, &slow).await;
    register_record(&env, &fake_record("older", 2, "consumer")).await;
    let (code, out, err) = env.run_async(&["ctl", "reload", "--all"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    for who in ["slow:1", "older:2"] {
        assert!(
            out.lines().any(|l| l
                == format!(
                    "{who}  reload  no answer within 20 s (busy, or gone): withdrawn, not applied"
                )),
            "{out}"
        );
    }
}

/// The `stages` entry of `pipeline`'s main stage in the record of `pid`, from `warren status
/// --json`.
async fn main_stage_in_status(env: &TestEnv, pid: i32, pipeline: &str) -> Value {
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    doc["instances"]
        .as_array()
        .and_then(|l| l.iter().find(|i| i["pid"] == pid))
        .unwrap_or_else(|| panic!("no instance {pid}: {doc}"))["stages"][format!("{pipeline}/main")]
    .clone()
}

/// Each pipeline's own processors and rate limit show in `warren status` (text and `--json`,
/// as numbers), from its file's entry at start and after `ctl scale` / `rate --pipeline`
/// (review R35e F12: status showed the instance's first pipeline's only).
#[tokio::test(flavor = "multi_thread")]
async fn status_shows_each_pipelines_processors_and_rate_limit() {
    let (env, _cleanup) = env_for("ctl_stage_limits").await;
    let names = PipelineNames::of(&env, "orders");
    let _names_cleanup = names.cleanup();
    let file = orders_pipeline(&env, &names, "proc_concurrency = 3\nrate_limit_per_s = 700").await;
    let warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    let users_procs = instance(&env, pid).await["processors"].clone();
    let orders = main_stage_in_status(&env, pid, "orders").await;
    assert_eq!(
        (&orders["processors"], &orders["rate_limit_per_s"]),
        (&json!(3), &json!(700)),
        "{orders}"
    );
    let users = main_stage_in_status(&env, pid, "users").await;
    assert_eq!(
        (&users["processors"], &users["rate_limit_per_s"]),
        (&users_procs, &json!(0)),
        "{users}"
    );

    ctl_ok(
        &env,
        &["rate", "11", "--all", "--pipeline", "orders"],
        &[pid],
    )
    .await;
    ctl_ok(
        &env,
        &[
            "scale",
            "--processors",
            "2",
            "--all",
            "--pipeline",
            "orders",
        ],
        &[pid],
    )
    .await;
    wait_until(
        "orders at 2 processors, 11/s",
        Duration::from_secs(10),
        || async {
            let orders = main_stage_in_status(&env, pid, "orders").await;
            orders["processors"] == 2 && orders["rate_limit_per_s"] == 11
        },
    )
    .await;
    let users = main_stage_in_status(&env, pid, "users").await;
    assert_eq!(
        (&users["processors"], &users["rate_limit_per_s"]),
        (&users_procs, &json!(0)),
        "{users}"
    );
    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let header = out
        .lines()
        .find(|l| l.trim_start().starts_with("INSTANCE") && l.contains("PIPELINE"))
        .unwrap_or_else(|| panic!("no stage table:\n{out}"));
    assert!(header.trim_end().ends_with("PROCS  LIMIT/S"), "{out}");
    let me = format!("{}:{pid}", host());
    let row = |stage: &str| -> Vec<String> {
        out.lines()
            .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
            .find(|t| t.first() == Some(&me) && t.get(1).map(String::as_str) == Some(stage))
            .unwrap_or_else(|| panic!("no {stage} row:\n{out}"))
    };
    assert_eq!(row("orders/main")[9..], ["2", "11"], "{out}");
    assert_eq!(
        row("users/main")[9..],
        [users_procs.to_string(), "off".to_string()],
        "{out}"
    );
}

/// `--host HOST:PID`, as `warren status` shows an instance, addresses that one instance (review
/// R35e F4: it was refused as a host of that name); a live instance of the same host that it
/// does not name is not addressed, and one that matches none is refused naming the live ones.
#[tokio::test(flavor = "multi_thread")]
async fn host_colon_pid_addresses_one_instance() {
    let (env, _cleanup) = env_for("ctl_host_pid").await;
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    // Another instance of this host, that would be addressed by `--host HOST` (no process: it
    // would never answer).
    let other = pid as u32 + 100_000;
    let queued = register_record(&env, &fake_record(&host(), other, "consumer")).await;
    let me = format!("{}:{pid}", host());
    ctl_ok(&env, &["pause", "--host", &me], &[pid]).await;
    wait_record_field(&env, pid, "status", "paused").await;
    let left: i64 = redis_query(&env, redis::cmd("LLEN").arg(&queued)).await;
    assert_eq!(left, 0, "a command went to {}:{other}", host());
    let (code, out, err) = env
        .run_async(&["ctl", "resume", "--host", &format!("{}:1", host())])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains(&format!("no live instance {}:1; live on", host()))
            && err.contains(&me)
            && err.contains(&format!("{}:{other}", host())),
        "{err}"
    );
    ctl_ok(&env, &["resume", "--host", &me], &[pid]).await;
    wait_running(&env, pid).await;
}

/// A mixed deployment, one instance with CONTROL_SECRET and one without: each says what it did
/// (review R35e F5). `ctl` with the secret: the one without applies the signed command as any
/// other and its unsigned outcome is shown as its own, marked unverified, with a note on
/// stderr (it read as a forgery, "no signed answer", exit 1, while the command had been
/// applied); `ctl` without it: the signed one refuses, the other applies.
#[tokio::test(flavor = "multi_thread")]
async fn a_mixed_deployment_says_per_instance_what_each_did() {
    let (mut env, _cleanup) = env_for("ctl_mixed").await;
    env.set("CONTROL_SECRET", SECRET);
    let signed = env.start(&["--roles", "consumer"]);
    env.set("CONTROL_SECRET", "");
    env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    let open = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![signed.log.clone(), open.log.clone()]);
    let (s, o) = (signed.pid(), open.pid());
    wait_running(&env, s).await;
    wait_running(&env, o).await;
    assert_eq!(instance(&env, s).await["signed_commands"], true);
    assert_eq!(instance(&env, o).await["signed_commands"], false);
    let (sh, oh) = (format!("{}:{s}", host()), format!("{}:{o}", host()));

    let (code, out, err) = ctl_with_secret(&env, &["pause", "--all"], Some(SECRET)).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.lines().any(|l| l == format!("{sh}  pause  executed")),
        "{out}"
    );
    assert!(
        out.lines().any(|l| l
            == format!(
                "{oh}  pause  executed (unverified: this instance runs without CONTROL_SECRET)"
            )),
        "{out}"
    );
    assert!(
        err.contains(&format!("{oh} runs without CONTROL_SECRET"))
            && err.contains("set the deployment's CONTROL_SECRET"),
        "{err}"
    );
    wait_record_field(&env, s, "status", "paused").await;
    wait_record_field(&env, o, "status", "paused").await;

    let (code, out, err) = ctl_with_secret(&env, &["resume", "--all"], None).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains(&format!("{sh}  resume  failed: refused: unsigned command"))
            && out.lines().any(|l| l == format!("{oh}  resume  executed")),
        "{out}"
    );
    assert!(err.contains("CONTROL_SECRET is not set here"), "{err}");
    wait_record_field(&env, o, "status", "running").await;
    assert_eq!(instance(&env, s).await["status"], "paused");
}
