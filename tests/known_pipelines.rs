//! Every tool knows every pipeline: a running instance publishes the pipelines it runs (name,
//! table, queues) in its registry record, so `status`, `ctl`, `dlq` and `events --pipeline` work
//! for a pipeline of its file without that file; a pipeline nobody runs or names is an error
//! that lists the known ones once each.

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
    env.db
        .batch_execute("CREATE TABLE orders (order_id uuid PRIMARY KEY, qty int4 NOT NULL)")
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(
        &path,
        format!(
            "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
             retry_ttls_ms = [1000]\n{}\n[pipelines.columns]\n\
             order_id = {{ path = \"/id\", type = \"uuid\" }}\n\
             qty = {{ path = \"/qty\", type = \"int4\" }}\n",
            names.toml()
        ),
    )
    .expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    // No DLQ role: a dead letter put into orders' DLQ stays there for `dlq inspect`.
    let mut warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_until("registered as running", Duration::from_secs(20), || async {
        instance(&env, pid).await["status"] == "running"
    })
    .await;
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
        .run_async(&["--config", &file, "dlq", "--pipeline", "orders", "inspect"])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
}
