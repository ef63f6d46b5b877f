//! Every tool knows every pipeline: a running instance publishes the pipelines it runs (name,
//! table, queues) in its registry record, so `status`, `ctl`, `dlq` and `events --pipeline` work
//! for a pipeline of its file without that file; a pipeline nobody runs or names is an error
//! that lists the known ones once each. The queues the tools take are the configuration's when
//! it names them, else the live instances' (never the built-in defaults while an instance runs
//! the pipeline elsewhere); instances that disagree are each shown by `status`, and `dlq`
//! refuses to guess between them.

mod common;

use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread")]
async fn every_tool_knows_the_pipelines_a_live_instance_runs() {
    let mut env = TestEnv::new("known_pipes").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    let names = PipelineNames::of(&env, "orders");
    let _names_cleanup = names.cleanup();
    let file = orders_pipeline(&env, &names, "").await;
    // No DLQ role: a dead letter put into orders' DLQ stays there for `dlq inspect`.
    let mut warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    env.publish_to("", &names.dlq, b"{\"id\":1}", BasicProperties::default())
        .await;

    // status, without the file: orders' queues, named as orders'.
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let orders = doc["pipelines"]
        .as_array()
        .and_then(|l| l.iter().find(|p| p["name"] == "orders"))
        .unwrap_or_else(|| panic!("no orders pipeline: {doc}"));
    assert_eq!(orders["table"], "orders", "{orders}");
    assert_eq!(orders["main_queue"], names.queue.as_str(), "{orders}");
    for queue in [&names.queue, &names.retry, &names.dlq] {
        let row = doc["queues"]
            .as_array()
            .and_then(|q| q.iter().find(|q| q["name"] == queue.as_str()))
            .unwrap_or_else(|| panic!("no queue {queue}: {doc}"));
        assert_eq!(row["pipeline"], "orders", "{row}");
    }
    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.lines().any(|l| l.starts_with(&names.dlq)),
        "orders' DLQ in the table:\n{out}"
    );

    // ctl: a pipeline nobody runs is refused, the known ones listed once each; orders works.
    let (code, out, err) = env
        .run_async(&["ctl", "rate", "100", "--all", "--pipeline", "nosuch"])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("no pipeline \"nosuch\"") && err.contains("known: users, orders\n"),
        "{err}"
    );
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("pause  executed"), "{out}");
    let (code, out, err) = env
        .run_async(&["ctl", "resume", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");

    // dlq, without the file: orders' DLQ, from the record.
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "orders", "inspect"])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        format!("{out}{err}").contains(&format!("dlq {}: 1 message", names.dlq)),
        "{out}\n{err}"
    );
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "nosuch", "inspect"])
        .await;
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(err.contains("known: users, orders\n"), "{err}");

    // events --pipeline: orders is known, nosuch is not.
    let (code, out, err) = env.run_async(&["events", "--pipeline", "orders"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("paused"), "orders' paused event: {out}");
    let (code, out, err) = env.run_async(&["events", "--pipeline", "nosuch"]).await;
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(err.contains("known: users, orders\n"), "{err}");
    // An empty name (a script's unset variable) is no pipeline either: it matched every
    // instance-wide event, and printed them all (review R35e F8).
    let (code, out, err) = env.run_async(&["events", "--pipeline", ""]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.is_empty()
            && err.contains("no pipeline \"\"")
            && err.contains("known: users, orders\n"),
        "{out}\n{err}"
    );

    // Once it stops, orders is known to nobody without the file.
    warren.terminate_ok(Duration::from_secs(25));
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "orders", "inspect"])
        .await;
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("no pipeline \"orders\"") && err.contains("known: users\n"),
        "{err}"
    );
    // With the file, as always.
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "dlq",
            "--pipeline",
            "orders",
            "inspect",
        ])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
}

/// The settings that name the built-in users pipeline's queues, which an operator's shell
/// does not have.
const NAME_VARS: [&str; 6] = [
    "MAIN_EXCHANGE",
    "MAIN_QUEUE",
    "RETRY_EXCHANGE",
    "RETRY_QUEUE",
    "DLX_EXCHANGE",
    "DLQ_QUEUE",
];

/// `warren ARGS` with the env's settings but none of [`NAME_VARS`]: an operator without the
/// instance's configuration. (exit code, stdout, stderr)
async fn run_unnamed(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let mut cmd = env.command(args);
    for key in NAME_VARS {
        cmd.env_remove(key);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run warren");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The names of the queues in a `status --json` document, with the pipeline each belongs to.
fn queue_rows(doc: &Value) -> Vec<(String, Value)> {
    doc["queues"]
        .as_array()
        .unwrap_or_else(|| panic!("no queues: {doc}"))
        .iter()
        .map(|q| {
            (
                q["name"].as_str().unwrap_or("").to_string(),
                q["pipeline"].clone(),
            )
        })
        .collect()
}

/// Review finding 7, case a: users run on the instance's own queues (MAIN_QUEUE, ... in its
/// environment). Without them, the tools take the queues from its record, never the built-in
/// `raffle_*` (another deployment's on a shared broker); with other names given, those win and
/// the disagreement is said once.
#[tokio::test(flavor = "multi_thread")]
async fn the_users_queues_are_the_running_instances_not_the_defaults() {
    let mut env = TestEnv::new("known_users").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    env.publish_to_dlq(b"{\"id\":1}", BasicProperties::default())
        .await;
    let ours = [&env.main_queue, &env.retry_queue, &env.dlq_queue];

    let (code, out, err) = run_unnamed(&env, &["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let rows = queue_rows(&doc);
    for queue in ours {
        assert!(
            rows.iter()
                .any(|(n, p)| n == queue.as_str() && *p == "users"),
            "{queue} as users': {doc}"
        );
    }
    assert!(
        !rows.iter().any(|(n, _)| n.starts_with("raffle_")),
        "the built-in default names while an instance runs users elsewhere: {doc}"
    );
    let users: Vec<&Value> = doc["pipelines"]
        .as_array()
        .expect("pipelines")
        .iter()
        .filter(|p| p["name"] == "users")
        .collect();
    assert_eq!(users.len(), 1, "{doc}");
    assert_eq!(users[0]["dlq_queue"], env.dlq_queue.as_str(), "{doc}");
    assert_eq!(users[0]["basis"], "instances", "{doc}");
    assert_eq!(doc["notes"], serde_json::json!([]), "{doc}");
    let (code, out, err) = run_unnamed(&env, &["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    for queue in ours {
        assert!(
            out.lines().any(|l| l.starts_with(queue.as_str())),
            "{queue}:\n{out}"
        );
    }
    assert!(!out.contains("raffle_"), "{out}");

    // dlq (users by default): the instance's DLQ.
    let (code, out, err) = run_unnamed(&env, &["dlq", "inspect"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("dlq {}: 1 message", env.dlq_queue)),
        "{out}\n{err}"
    );
    assert!(!err.contains("note:"), "nothing to note: {err}");

    // Names given (here --set) win over the record, and the disagreement is said once.
    let other = format!("{}_elsewhere", env.id);
    let set_dlq = format!("dlq_queue={other}_dlq");
    let set_main = format!("main_queue={other}_queue");
    let (code, out, err) = run_unnamed(
        &env,
        &["--set", &set_dlq, "--set", &set_main, "status", "--json"],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let notes = doc["notes"].as_array().expect("notes");
    assert_eq!(notes.len(), 1, "{doc}");
    let note = notes[0].as_str().unwrap_or("");
    let me = format!("{}:{pid}", host());
    assert!(
        note.contains(&format!("{other}_dlq"))
            && note.contains(&me)
            && note.contains(&env.dlq_queue),
        "{note}"
    );
    let rows = queue_rows(&doc);
    for queue in [&format!("{other}_dlq"), &env.dlq_queue] {
        assert!(
            rows.iter().any(|(n, _)| n == queue.as_str()),
            "{queue}: {doc}"
        );
    }
    let (code, out, err) = run_unnamed(&env, &["--set", &set_dlq, "dlq", "inspect"]).await;
    assert_eq!(
        code, 1,
        "the configuration's DLQ, which does not exist:\n{out}\n{err}"
    );
    assert!(
        err.contains(&format!("cannot read queue {other}_dlq")),
        "{err}"
    );
    assert_eq!(err.matches("note: ").count(), 1, "said once: {err}");
    assert!(err.contains(&me), "{err}");
    // --instance chooses the instance's, silently.
    let (code, out, err) = run_unnamed(
        &env,
        &["--set", &set_dlq, "dlq", "--instance", &me, "inspect"],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("dlq {}: 1 message", env.dlq_queue)),
        "{out}"
    );
    warren.terminate_ok(Duration::from_secs(25));
}

/// Review finding 7, case b: two instances run pipeline orders on different queues. `status`
/// shows both sets, each with its instance; `dlq` refuses to choose and says how
/// (`--instance`, or `--config`), and acts on the one chosen.
#[tokio::test(flavor = "multi_thread")]
async fn instances_that_run_one_pipeline_on_different_queues_are_each_shown() {
    let mut env = TestEnv::new("known_split").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    create_orders_table(&env).await;
    let first = PipelineNames::of(&env, "orders");
    let second = PipelineNames::of(&env, "orders2");
    let _first_cleanup = first.cleanup();
    let _second_cleanup = second.cleanup();
    let mut files = Vec::new();
    for names in [&first, &second] {
        let file = ConfigFile::new(&orders_toml(names, ""));
        declare_file(&env, &file).await;
        files.push(file);
    }
    let a = env.start(&["--config", files[0].at(), "--roles", "consumer"]);
    env.set("HTTP_ADDR", format!("127.0.0.1:{}", free_port()));
    env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    let b = env.start(&["--config", files[1].at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![a.log.clone(), b.log.clone()]);
    for pid in [a.pid(), b.pid()] {
        wait_running(&env, pid).await;
    }
    let (who_a, who_b) = (
        format!("{}:{}", host(), a.pid()),
        format!("{}:{}", host(), b.pid()),
    );
    env.publish_to("", &second.dlq, b"{\"id\":2}", BasicProperties::default())
        .await;

    // status: both sets, each with its instance, and one note.
    let (code, out, err) = env.run_async(&["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let rows = queue_rows(&doc);
    for queue in [
        &first.queue,
        &first.retry,
        &first.dlq,
        &second.queue,
        &second.retry,
        &second.dlq,
    ] {
        assert!(
            rows.iter()
                .any(|(n, p)| n == queue.as_str() && *p == "orders"),
            "{queue} as orders': {doc}"
        );
    }
    let mut sets: Vec<(String, Value)> = doc["pipelines"]
        .as_array()
        .expect("pipelines")
        .iter()
        .filter(|p| p["name"] == "orders")
        .map(|p| {
            (
                p["dlq_queue"].as_str().unwrap_or("").to_string(),
                p["instances"].clone(),
            )
        })
        .collect();
    let mut expected = vec![
        (first.dlq.clone(), serde_json::json!([who_a])),
        (second.dlq.clone(), serde_json::json!([who_b])),
    ];
    sets.sort_by(|x, y| x.0.cmp(&y.0));
    expected.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(sets, expected, "{doc}");
    assert_eq!(doc["notes"].as_array().map(Vec::len), Some(1), "{doc}");
    let (code, out, err) = env.run_async(&["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    for (dlq, who) in [(&first.dlq, &who_a), (&second.dlq, &who_b)] {
        assert!(
            out.lines().any(|l| l.starts_with(dlq.as_str())),
            "{dlq} queue row:\n{out}"
        );
        assert!(
            out.lines().any(|l| l.starts_with("orders")
                && l.contains(who.as_str())
                && l.contains(dlq.as_str())),
            "{dlq} run by {who}:\n{out}"
        );
    }
    assert_eq!(out.matches("note: ").count(), 1, "{out}");

    // dlq: no guess; the error lists both and how to choose.
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "orders", "inspect"])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("pipeline \"orders\" runs on different queues")
            && err.contains(&first.dlq)
            && err.contains(&second.dlq)
            && err.contains(&who_a)
            && err.contains(&who_b)
            && err.contains("--instance HOST:PID")
            && err.contains("--config"),
        "{err}"
    );
    assert!(!out.contains("dlq "), "nothing inspected: {out}");
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "orders", "replay"])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("runs on different queues"), "{err}");
    // Chosen by instance: that one's DLQ.
    let (code, out, err) = env
        .run_async(&[
            "dlq",
            "--pipeline",
            "orders",
            "--instance",
            &who_b,
            "inspect",
        ])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("dlq {}: 1 message", second.dlq)),
        "{out}"
    );
    let (code, out, err) = env
        .run_async(&[
            "dlq",
            "--pipeline",
            "orders",
            "--instance",
            "nohost:1",
            "inspect",
        ])
        .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("no live instance nohost:1 runs pipeline \"orders\""),
        "{err}"
    );
    // Chosen by configuration: the file's, the disagreement said once.
    let (code, out, err) = env
        .run_async(&[
            "--config",
            files[0].at(),
            "dlq",
            "--pipeline",
            "orders",
            "inspect",
        ])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("dlq {}: 0 messages", first.dlq)),
        "{out}"
    );
    assert_eq!(err.matches("note: ").count(), 1, "{err}");
    assert!(err.contains(&who_b) && err.contains(&second.dlq), "{err}");
    // The parked rows are the pipeline's whatever its queues: listed without a choice.
    let (code, out, err) = env
        .run_async(&["dlq", "--pipeline", "orders", "parked", "list"])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
}
