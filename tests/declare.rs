//! `warren declare` against the real broker and database: the exact topology it creates (checked
//! with `rabbitmqctl` and by routing through every binding), idempotence, drift that is reported
//! and never "fixed" by deleting, `--dry-run`, and the migrations it applies.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use serde_json::{Value, json};

/// The broker's view of one queue: durable flag and arguments (name -> value).
#[derive(Debug, Clone, PartialEq)]
struct QueueInfo {
    durable: bool,
    arguments: BTreeMap<String, Value>,
}

/// Queues whose names start with this env's id.
async fn queues(env: &TestEnv) -> BTreeMap<String, QueueInfo> {
    rabbitmqctl_rows(&["list_queues", "name", "durable", "arguments"])
        .await
        .into_iter()
        .filter(|q| q["name"].as_str().is_some_and(|n| n.starts_with(&env.id)))
        .map(|q| {
            let arguments = q["arguments"]
                .as_array()
                .expect("arguments")
                .iter()
                .map(|a| (a[0].as_str().unwrap().to_string(), a[2].clone()))
                .collect();
            (
                q["name"].as_str().unwrap().to_string(),
                QueueInfo {
                    durable: q["durable"].as_bool().unwrap(),
                    arguments,
                },
            )
        })
        .collect()
}

/// Exchanges of this env: name -> (type, durable, auto_delete).
async fn exchanges(env: &TestEnv) -> BTreeMap<String, (String, bool, bool)> {
    rabbitmqctl_rows(&["list_exchanges", "name", "type", "durable", "auto_delete"])
        .await
        .into_iter()
        .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with(&env.id)))
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                (
                    e["type"].as_str().unwrap().to_string(),
                    e["durable"].as_bool().unwrap(),
                    e["auto_delete"].as_bool().unwrap(),
                ),
            )
        })
        .collect()
}

/// Bindings whose source is one of this env's exchanges: (source, destination, routing key).
async fn bindings(env: &TestEnv) -> Vec<(String, String, String)> {
    let mut out: Vec<_> = rabbitmqctl_rows(&[
        "list_bindings",
        "source_name",
        "destination_name",
        "destination_kind",
        "routing_key",
    ])
    .await
    .into_iter()
    .filter(|b| {
        b["source_name"]
            .as_str()
            .is_some_and(|n| n.starts_with(&env.id))
    })
    .map(|b| {
        assert_eq!(b["destination_kind"], "queue", "{b}");
        (
            b["source_name"].as_str().unwrap().to_string(),
            b["destination_name"].as_str().unwrap().to_string(),
            b["routing_key"].as_str().unwrap().to_string(),
        )
    })
    .collect();
    out.sort();
    out
}

/// The line of `stdout` that mentions `object` (for example `queue NAME (`).
fn line_of<'a>(stdout: &'a str, object: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.contains(object))
        .unwrap_or_else(|| panic!("no line for {object:?} in:\n{stdout}"))
}

fn expected_queues(env: &TestEnv, ttl: u64) -> BTreeMap<String, QueueInfo> {
    let q = |args: Vec<(&str, Value)>| QueueInfo {
        durable: true,
        arguments: args.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    };
    BTreeMap::from([
        (
            env.main_queue.clone(),
            q(vec![
                ("x-dead-letter-exchange", json!(env.dlx_exchange)),
                ("x-dead-letter-routing-key", json!(env.dlq_queue)),
            ]),
        ),
        (
            env.retry_queue.clone(),
            q(vec![
                ("x-message-ttl", json!(ttl)),
                ("x-dead-letter-exchange", json!(env.main_exchange)),
                ("x-dead-letter-routing-key", json!(env.main_queue)),
            ]),
        ),
        (env.dlq_queue.clone(), q(vec![])),
    ])
}

fn expected_bindings(env: &TestEnv) -> Vec<(String, String, String)> {
    let mut b = vec![
        (
            env.main_exchange.clone(),
            env.main_queue.clone(),
            env.main_queue.clone(),
        ),
        (
            env.retry_exchange.clone(),
            env.retry_queue.clone(),
            env.retry_queue.clone(),
        ),
        (
            env.dlx_exchange.clone(),
            env.dlq_queue.clone(),
            env.dlq_queue.clone(),
        ),
    ];
    b.sort();
    b
}

#[tokio::test(flavor = "multi_thread")]
async fn declare_creates_exactly_the_topology() {
    let mut env = TestEnv::new("decl_new").await;
    // A TTL that is not the default proves it comes from RETRY_TTL_MS.
    env.set("RETRY_TTL_MS", "1500");
    let (code, out, err) = env.run(&["declare"]);
    assert_eq!(code, 0, "declare failed:\n{out}\n{err}");

    // Exactly three durable direct exchanges, not auto-deleted.
    let found = exchanges(&env).await;
    let wanted: BTreeMap<String, (String, bool, bool)> =
        [&env.main_exchange, &env.retry_exchange, &env.dlx_exchange]
            .into_iter()
            .map(|n| (n.clone(), ("direct".to_string(), true, false)))
            .collect();
    assert_eq!(found, wanted);

    // Exactly three durable queues with exactly these arguments.
    assert_eq!(queues(&env).await, expected_queues(&env, 1500));

    // Exactly the three bindings, routing key = queue name.
    assert_eq!(bindings(&env).await, expected_bindings(&env));

    // The report names every object, exchanges and queues as created.
    for e in [&env.main_exchange, &env.retry_exchange, &env.dlx_exchange] {
        let line = line_of(&out, &format!("exchange {e} ("));
        assert!(line.contains("direct, durable"), "{line}");
        assert!(line.trim_end().ends_with("created"), "{line}");
    }
    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        let line = line_of(&out, &format!("queue {q} ("));
        assert!(line.trim_end().ends_with("created"), "{line}");
    }
    assert!(line_of(&out, &format!("queue {} (", env.retry_queue)).contains("x-message-ttl=1500"));
    for (exchange, queue, key) in expected_bindings(&env) {
        let line = line_of(&out, &format!("binding {exchange} -> {queue} "));
        assert!(line.contains(&format!("routing key {key}")), "{line}");
    }
    let line = line_of(&out, &format!("database schema {}", env.schema));
    assert!(
        line.contains("V1__users") && line.contains("V2__dead_letters"),
        "{line}"
    );

    // The arguments work, not only exist: every binding routes (publish_to asserts it), a
    // retried message comes back to the main queue after the TTL, and a message the main queue
    // rejects is dead-lettered to the DLQ.
    env.publish_to(
        &env.dlx_exchange,
        &env.dlq_queue,
        b"to dlq",
        BasicProperties::default(),
    )
    .await;
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 1);
    env.publish_to(
        &env.retry_exchange,
        &env.retry_queue,
        b"to retry",
        BasicProperties::default(),
    )
    .await;
    assert_eq!(env.queue_state(&env.retry_queue).await.0, 1);
    wait_until(
        "the retried message back in the main queue after the TTL",
        Duration::from_secs(10),
        || async {
            env.queue_state(&env.retry_queue).await.0 == 0
                && env.queue_state(&env.main_queue).await.0 == 1
        },
    )
    .await;
    env.publish_to(
        &env.main_exchange,
        &env.main_queue,
        b"to main",
        BasicProperties::default(),
    )
    .await;
    let ch = env.conn.create_channel().await.unwrap();
    for _ in 0..2 {
        let m = ch
            .basic_get(
                env.main_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .unwrap()
            .expect("a message in the main queue");
        m.reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    wait_until(
        "both rejected messages in the DLQ",
        Duration::from_secs(5),
        || async { env.queue_state(&env.dlq_queue).await.0 == 3 },
    )
    .await;
    assert_queue_empty(&env, &env.main_queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_declare_matches_everything_and_changes_nothing() {
    let env = TestEnv::new("decl_again").await;
    env.declare();
    let before = (
        exchanges(&env).await,
        queues(&env).await,
        bindings(&env).await,
    );
    assert_eq!(before.1, expected_queues(&env, 10_000));
    // Messages waiting in the queues must survive a re-declare.
    let ids = env.publish_users(3).await;
    env.publish_to(
        &env.dlx_exchange,
        &env.dlq_queue,
        b"parked",
        BasicProperties::default(),
    )
    .await;

    let (code, out, err) = env.run(&["declare"]);
    assert_eq!(code, 0, "second declare failed:\n{out}\n{err}");
    for e in [&env.main_exchange, &env.retry_exchange, &env.dlx_exchange] {
        let line = line_of(&out, &format!("exchange {e} ("));
        assert!(line.trim_end().ends_with("already matched"), "{line}");
    }
    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        let line = line_of(&out, &format!("queue {q} ("));
        assert!(line.trim_end().ends_with("already matched"), "{line}");
    }
    assert!(
        !out.contains("created"),
        "second declare created something:\n{out}"
    );
    let line = line_of(&out, &format!("database schema {}", env.schema));
    assert!(line.contains("already up to date"), "{line}");

    let after = (
        exchanges(&env).await,
        queues(&env).await,
        bindings(&env).await,
    );
    assert_eq!(before, after, "the second declare changed the topology");
    assert_eq!(env.queue_state(&env.main_queue).await.0, ids.len() as u32);
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 1);
    // The migration history did not grow either.
    let applied: i64 = env
        .db
        .query_one("SELECT count(*) FROM refinery_schema_history", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, 4, "V1 to V4");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drifted_retry_queue_is_reported_and_left_alone() {
    let env = TestEnv::new("decl_drift").await;
    // Someone created the retry queue with another TTL (RETRY_TTL_MS stays at its 10000 default).
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(5000));
    args.insert(
        "x-dead-letter-exchange".into(),
        long_string(&env.main_exchange),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        long_string(&env.main_queue),
    );
    env.channel
        .queue_declare(
            env.retry_queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declare the drifted retry queue");
    // Messages in it (through the default exchange); they expire 5 s after this.
    let published = Instant::now();
    for i in 0..3 {
        env.publish_to(
            "",
            &env.retry_queue,
            format!("waiting {i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }

    let (code, out, err) = env.run(&["declare"]);
    let waiting = env.queue_state(&env.retry_queue).await.0;
    let checked_after = published.elapsed();

    assert_ne!(
        code, 0,
        "declare succeeded over a drifted queue:\n{out}\n{err}"
    );
    for needle in [
        env.retry_queue.as_str(),
        "x-message-ttl",
        "5000",
        "10000",
        "RETRY_TTL_MS",
        "delete_queue",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    // Which value is which: the broker holds 5000, warren wants 10000.
    assert!(
        err.contains(&format!(
            "queue {} exists with x-message-ttl = 5000, but warren declares x-message-ttl = 10000",
            env.retry_queue
        )),
        "{err}"
    );
    assert!(
        err.contains("resolve"),
        "stderr does not say how to resolve it:\n{err}"
    );
    assert!(
        checked_after < Duration::from_millis(4500),
        "declare too slow ({checked_after:?}) to check the messages before their 5 s TTL"
    );
    assert_eq!(waiting, 3, "messages of the drifted queue were lost");

    // Still there, unchanged: same TTL, same arguments, still durable.
    let found = queues(&env).await;
    let retry = found.get(&env.retry_queue).expect("retry queue deleted");
    assert!(retry.durable);
    assert_eq!(retry.arguments["x-message-ttl"], json!(5000));
    assert_eq!(
        retry.arguments["x-dead-letter-exchange"],
        json!(env.main_exchange)
    );
    assert_eq!(retry.arguments.len(), 3, "{retry:?}");

    // Following the advice (delete it with the command given, declare again) resolves it.
    follow_the_delete_advice(&err).await;
    env.declare();
    assert_eq!(queues(&env).await, expected_queues(&env, 10_000));
}

/// Runs the `rabbitmqctl ...` command the drift message suggests for deleting the object.
async fn follow_the_delete_advice(stderr: &str) {
    let start = stderr
        .find("delete it (rabbitmqctl ")
        .unwrap_or_else(|| panic!("no delete command suggested:\n{stderr}"))
        + "delete it (".len();
    let end = start + stderr[start..].find(')').expect("closing parenthesis");
    let advice: Vec<&str> = stderr[start..end].split_whitespace().collect();
    let out = tokio::process::Command::new(advice[0])
        .args(&advice[1..])
        .output()
        .await
        .expect("run the suggested command");
    assert!(
        out.status.success(),
        "the suggested `{}` fails: {}{}",
        advice.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drifted_exchange_is_reported_and_left_alone() {
    let env = TestEnv::new("decl_xdrift").await;
    // The retry exchange exists with another type.
    env.channel
        .exchange_declare(
            env.retry_exchange.as_str().into(),
            ExchangeKind::Fanout,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare the drifted exchange");

    let (code, out, err) = env.run(&["declare"]);
    assert_ne!(
        code, 0,
        "declare succeeded over a drifted exchange:\n{out}\n{err}"
    );
    assert!(
        err.contains(&format!(
            "exchange {} exists with type = fanout, but warren declares type = direct",
            env.retry_exchange
        )),
        "{err}"
    );
    assert!(err.contains("resolve"), "{err}");
    assert_eq!(
        exchanges(&env).await.get(&env.retry_exchange),
        Some(&("fanout".to_string(), true, false)),
        "the drifted exchange was changed"
    );

    // The advice names a real way to delete an exchange (rabbitmqctl has none; rabbitmqadmin
    // needs the management plugin, so the test deletes it over AMQP), after which declare works.
    assert!(
        err.contains(&format!(
            "rabbitmqadmin delete exchange name={}",
            env.retry_exchange
        )),
        "{err}"
    );
    env.channel
        .exchange_delete(
            env.retry_exchange.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("delete the drifted exchange");
    env.declare();
    assert_eq!(
        exchanges(&env).await.get(&env.retry_exchange),
        Some(&("direct".to_string(), true, false))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_prints_the_plan_and_creates_nothing() {
    let env = TestEnv::new("decl_dry").await;
    let (code, out, err) = env.run(&["declare", "--dry-run"]);
    assert_eq!(code, 0, "dry run failed:\n{out}\n{err}");
    assert!(out.contains("nothing declared"), "{out}");
    for e in [&env.main_exchange, &env.retry_exchange, &env.dlx_exchange] {
        line_of(&out, &format!("exchange {e} ("));
    }
    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        line_of(&out, &format!("queue {q} ("));
    }
    assert!(line_of(&out, &format!("queue {} (", env.retry_queue)).contains("x-message-ttl=10000"));
    for (exchange, queue, _) in expected_bindings(&env) {
        line_of(&out, &format!("binding {exchange} -> {queue} "));
    }
    line_of(&out, &format!("database schema {}", env.schema));
    assert!(!out.contains("created"), "{out}");
    // The migrations that would run: the built-in set, each pending in a fresh schema.
    for m in [
        "V1__users",
        "V2__dead_letters",
        "V3__idempotent_parking",
        "V4__pipeline_parking",
    ] {
        let line = line_of(&out, m);
        assert!(line.split_whitespace().eq([m, "pending"]), "{line}");
    }
    assert!(out.contains("4 migrations, 4 to apply"), "{out}");
    // The database out of reach: which to apply is unknown, not all (review R40a F12).
    let mut away = TestEnv::new("decl_dry_away").await;
    away.set(
        "DATABASE_URL",
        "postgres://warren:warren@127.0.0.1:1/warren",
    );
    let (code, out, err) = away.run_async(&["declare", "--dry-run"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("4 migrations, unknown which to apply (the database at"),
        "{out}"
    );

    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        assert!(!env.queue_exists(q).await, "dry run created queue {q}");
    }
    for e in [&env.main_exchange, &env.retry_exchange, &env.dlx_exchange] {
        assert!(
            !env.exchange_exists(e).await,
            "dry run created exchange {e}"
        );
    }
    let tables: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
            &[&env.schema],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "dry run touched the database");

    // After a declare, every one is applied and none is left to apply.
    env.declare();
    let (code, out, err) = env.run(&["declare", "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("4 migrations, 0 to apply"), "{out}");
    assert!(
        line_of(&out, "V4__pipeline_parking").ends_with("applied"),
        "{out}"
    );
    assert!(
        line_of(&out, "broker:").ends_with("to declare: none"),
        "{out}"
    );

    // What declare refuses, the dry run refuses in its words and exit code, changing nothing
    // (review R38-F13: a drifted queue was a plan, exit 0).
    let ttl = retry_ttl(&env).await;
    let channel = env.conn.create_channel().await.expect("channel");
    channel
        .queue_delete(env.retry_queue.as_str().into(), Default::default())
        .await
        .expect("delete the retry queue");
    let (code, out, _) = env.run(&["declare", "--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        line_of(&out, "broker:").ends_with(&format!("to declare: queue {}", env.retry_queue)),
        "{out}"
    );
    assert!(
        !env.queue_exists(&env.retry_queue).await,
        "the dry run made it"
    );
    declare_retry_queue_to(&env, &format!("{}_old", env.main_queue), ttl).await;
    let (code, out, err) = env.run(&["declare", "--dry-run"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!(
            "queue {} exists with x-dead-letter-routing-key",
            env.retry_queue
        )),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn declare_applies_the_migrations_in_the_schema() {
    let env = TestEnv::new("decl_migr").await;
    env.declare();
    let columns: Vec<(String, String, String)> = env
        .db
        .query(
            "SELECT column_name::text, data_type::text, is_nullable::text \
             FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = 'users' ORDER BY ordinal_position",
            &[&env.schema],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let owned = |a: &str, b: &str, c: &str| (a.to_string(), b.to_string(), c.to_string());
    assert_eq!(
        columns,
        vec![
            owned("id", "uuid", "NO"),
            owned("name", "text", "NO"),
            owned("email", "text", "NO"),
            owned("inserted_at", "timestamp with time zone", "NO"),
        ]
    );
    let constraints: Vec<(String, String)> = env
        .db
        .query(
            "SELECT tc.constraint_type::text, kcu.column_name::text \
             FROM information_schema.table_constraints tc \
             JOIN information_schema.key_column_usage kcu \
               ON kcu.constraint_name = tc.constraint_name AND kcu.table_schema = tc.table_schema \
             WHERE tc.table_schema = $1 AND tc.table_name = 'users' \
               AND tc.constraint_type IN ('PRIMARY KEY', 'UNIQUE') \
             ORDER BY 1, 2",
            &[&env.schema],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        constraints,
        vec![
            ("PRIMARY KEY".to_string(), "id".to_string()),
            ("UNIQUE".to_string(), "email".to_string()),
        ]
    );
    // The other migration too, and nothing in the public schema was needed.
    let dead_letters: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = $1 AND table_name = 'dead_letters'",
            &[&env.schema],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead_letters, 1);
    // inserted_at defaults to now().
    let id = uuid::Uuid::new_v4();
    env.db
        .execute(
            "INSERT INTO users (id, name, email) VALUES ($1, 'Ana', $2)",
            &[&id, &format!("{id}@example.com")],
        )
        .await
        .unwrap();
    let recent: bool = env
        .db
        .query_one(
            "SELECT inserted_at > now() - interval '1 minute' FROM users WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(recent);
}

/// `DLQ_DELIVERY_LIMIT=0` declares a quorum DLQ without a delivery limit where the broker gives it
/// none (RabbitMQ 3.x, the broker of these tests), and is refused, exit 2 and nothing declared,
/// where it would give it 20 (RabbitMQ 4): the version is the one the broker sends in
/// `connection.start`. `warren run` without `--declare` checks the same at its start: on 3.x it
/// starts (and serves), on 4.x it exits 2 in the same words.
#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_dlq_without_a_limit_is_declared_only_where_the_broker_sets_none() {
    let mut env = TestEnv::new("decl_dlq0").await;
    env.set("QUEUE_TYPE", "quorum")
        .set("DLQ_DELIVERY_LIMIT", "0");
    let version = warren::topology::broker::broker_version(&env.conn)
        .expect("RabbitMQ says its version in connection.start");
    let major: u32 = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("a version: {version:?}"));
    let (code, out, err) = env.run(&["declare"]);
    if major >= 4 {
        assert_eq!(code, 2, "declare on RabbitMQ {version}:\n{out}\n{err}");
        assert!(
            err.contains("DLQ_DELIVERY_LIMIT: expected 10000 to 1000000000 on RabbitMQ"),
            "{err}"
        );
        assert!(queues(&env).await.is_empty(), "something was declared");
        let mut run = env.start(&[]);
        let status = run.wait(Duration::from_secs(30));
        let logs = run.logs();
        assert_eq!(status.code(), Some(2), "run on RabbitMQ {version}:\n{logs}");
        assert!(
            logs.contains("DLQ_DELIVERY_LIMIT: expected 10000 to 1000000000 on RabbitMQ"),
            "{logs}"
        );
        return;
    }
    assert_eq!(code, 0, "declare on RabbitMQ {version}:\n{out}\n{err}");
    let declared = queues(&env).await;
    let dlq = &declared[&env.dlq_queue];
    assert_eq!(dlq.arguments.get("x-queue-type"), Some(&json!("quorum")));
    assert!(
        !dlq.arguments.contains_key("x-delivery-limit"),
        "{:?}",
        dlq.arguments
    );
    // The main queue keeps its own limit.
    assert_eq!(
        declared[&env.main_queue].arguments.get("x-delivery-limit"),
        Some(&json!(20))
    );
    // `run` without `--declare` asks the broker its version too, and starts on 3.x.
    let mut run = env.start(&[]);
    wait_ready(&env, Duration::from_secs(30)).await;
    assert!(run.is_running(), "{}", run.logs());
    run.terminate_ok(Duration::from_secs(30));
}

/// A child table's foreign keys at `warren declare` and at the start of `warren run`: one to the
/// parent table on the columns that carry the parent's key, and one from `sku` to a catalog,
/// fit (exit 0); one that pairs the carried column with another parent column, and one from
/// the carried column to another table, stop both with exit 2 naming the pipeline, the child
/// table, the foreign key and the column.
#[tokio::test(flavor = "multi_thread")]
async fn a_child_tables_foreign_key_must_reference_what_its_parent_columns_carry() {
    let env = TestEnv::new("decl_child_fk").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "CREATE TABLE skus (sku text PRIMARY KEY);
             ALTER TABLE order_items ADD FOREIGN KEY (sku) REFERENCES skus",
        )
        .await
        .expect("a catalog");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 0, "a fitting foreign key:\n{out}{err}");

    env.db
        .batch_execute(
            "ALTER TABLE orders ADD alt uuid UNIQUE;
             CREATE TABLE archive (order_id uuid PRIMARY KEY);
             ALTER TABLE order_items DROP CONSTRAINT order_items_order_id_fkey,
                 ADD CONSTRAINT items_alt_fkey FOREIGN KEY (order_id) REFERENCES orders (alt),
                 ADD CONSTRAINT items_archive_fkey FOREIGN KEY (order_id) REFERENCES archive",
        )
        .await
        .expect("the foreign keys that do not fit");
    let at = "pipeline orders: child table order_items (rows /items)";
    let expected = [
        format!(
            "{at}: foreign key items_alt_fkey (order_id) references orders (alt), but column \
             order_id holds the parent's order_id (expected order_id = {{ parent = \"alt\" }}: \
             a child row references the parent row of its own message)"
        ),
        format!(
            "{at}: foreign key items_archive_fkey (order_id) references archive (order_id), not \
             the pipeline's table orders, but column order_id holds the parent's order_id \
             (expected a foreign key to orders (order_id), or none)"
        ),
    ];
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "declare:\n{out}{err}");
    for line in &expected {
        assert!(err.contains(line.as_str()), "{line}\nmissing from:\n{err}");
    }
    assert!(!err.contains("skus"), "the catalog's key fits:\n{err}");
    let mut warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let status = warren.wait(Duration::from_secs(30));
    let logs = warren.logs();
    assert_eq!(status.code(), Some(2), "run:\n{logs}");
    for line in &expected {
        assert!(
            logs.contains(line.as_str()),
            "{line}\nmissing from:\n{logs}"
        );
    }
}

/// A pipeline with deletes renamed (or removed, or without deletes now) leaves its tombstone
/// table behind: `warren declare` names it with its tombstones, how to move it to the new name or
/// drop it, and keeps it; a table of someone else's named `tombstones_...` is not named. Moved
/// as docs/pipelines.md says (the new name's empty table dropped, the old one renamed), declare
/// matches it and names nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_renamed_pipelines_tombstone_table_is_named_and_kept() {
    let env = TestEnv::new("decl_tomb_rename").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    let update = "on_conflict = \"update\"\nversion_column = \"version\"\n";
    let deletes = format!("{update}delete = {{ field = \"/op\", value = \"delete\" }}\n");
    let orders = ConfigFile::new(&nested_toml(&names, &deletes));
    let (code, out, err) = env.run_async(&["--config", orders.at(), "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    assert!(!out.contains("kept"), "nothing stray yet:\n{out}");
    let deleted = uuid::Uuid::new_v4();
    env.db
        .batch_execute(&format!(
            "INSERT INTO tombstones_orders (order_id, version) VALUES ('{deleted}', 3);
             CREATE TABLE tombstones_mine (x int)"
        ))
        .await
        .expect("a tombstone, and a table warren did not make");

    // Renamed: orders becomes shop.
    let shop_toml =
        nested_toml(&names, &deletes).replacen("name = \"orders\"", "name = \"shop\"", 1);
    let shop = ConfigFile::new(&shop_toml);
    let (code, out, err) = env.run_async(&["--config", shop.at(), "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let old = format!("{}.tombstones_orders", env.schema);
    assert!(
        line_of(&out, &format!("table {old} "))
            .contains("kept: no pipeline here uses it (1 tombstone)"),
        "{out}"
    );
    for advice in [
        format!(
            "tombstone table {old} (1 tombstone) is of pipeline orders, which this configuration \
             does not have: warren keeps it"
        ),
        "renamed pipeline: move it to the new name before that pipeline runs".to_string(),
        format!("no longer needed: DROP TABLE {old};"),
    ] {
        assert!(out.contains(&advice), "{advice}\nmissing from:\n{out}");
    }
    assert!(
        line_of(&out, "table tombstones_shop").contains("created"),
        "{out}"
    );
    assert!(!out.contains("tombstones_mine"), "not warren's:\n{out}");
    let kept: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM tombstones_orders WHERE order_id = $1",
            &[&deleted],
        )
        .await
        .expect("the old table is still there")
        .get(0);
    assert_eq!(kept, 1);

    // The same pipeline without deletes: its table is named, in those words.
    let no_deletes = ConfigFile::new(&nested_toml(&names, update));
    let (code, out, err) = env
        .run_async(&["--config", no_deletes.at(), "declare"])
        .await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    assert!(
        out.contains(&format!(
            "tombstone table {old} (1 tombstone) is of pipeline orders, which has no deletes any more"
        )),
        "{out}"
    );
    assert!(out.contains("tombstones_shop (0 tombstones) is of pipeline shop, which this configuration does not have"), "{out}");

    // Moved as the docs say: the new name's empty table dropped, the old one renamed.
    env.db
        .batch_execute(
            "BEGIN; DROP TABLE tombstones_shop;
             ALTER TABLE tombstones_orders RENAME TO tombstones_shop; COMMIT",
        )
        .await
        .expect("move the tombstones");
    let (code, out, err) = env.run_async(&["--config", shop.at(), "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    assert!(
        line_of(&out, "table tombstones_shop").contains("already matched"),
        "{out}"
    );
    assert!(
        !out.contains("kept") && !out.contains("DROP TABLE"),
        "nothing stray:\n{out}"
    );
    let moved: i64 = env
        .db
        .query_one(
            "SELECT version FROM tombstones_shop WHERE order_id = $1",
            &[&deleted],
        )
        .await
        .expect("the tombstone, moved")
        .get(0);
    assert_eq!(moved, 3);
}

/// A drifted queue of a file's pipeline is advised in the keys of that pipeline's entry
/// (`pipelines.orders.retry_queue`, `retry_ttls_ms`), not the users pipeline's settings
/// (review R35e F9: the advice said `RETRY_TTL_MS` and `RETRY_QUEUE` for any pipeline).
#[tokio::test(flavor = "multi_thread")]
async fn a_drifted_queue_of_a_files_pipeline_is_advised_in_its_entrys_keys() {
    let env = TestEnv::new("decl_entry_drift").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_orders_table(&env).await;
    // Its 1 s retry tier, created by someone else with a TTL of 5 s.
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(5000));
    args.insert(
        "x-dead-letter-exchange".into(),
        long_string(&names.exchange),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        long_string(&names.queue),
    );
    env.channel
        .queue_declare(
            names.retry.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declare the drifted retry tier");
    let file = ConfigFile::new(&orders_toml(&names, ""));
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_ne!(
        code, 0,
        "declare succeeded over a drifted queue:\n{out}\n{err}"
    );
    assert!(
        err.contains(&format!(
            "queue {} exists with x-message-ttl = 5000, but warren declares x-message-ttl = 1000",
            names.retry
        )),
        "{err}"
    );
    assert!(
        err.contains("pipelines.orders.retry_queue")
            && err.contains("pipelines.orders.retry_ttls_ms")
            && !err.contains("set RETRY_TTL_MS")
            && !err.contains("give RETRY_QUEUE"),
        "the advice names the users pipeline's settings:\n{err}"
    );
}

/// `warren run` without `--declare` checks that what exists matches what it declares, not only
/// that it exists (review R35g F5): a retry queue that still dead-letters to another main queue
/// (left so by a rename) would strand every retried message there. It exits 1 at once, naming
/// the queue, the argument and both values, and leaves the queue as it was.
#[tokio::test(flavor = "multi_thread")]
async fn run_without_declare_refuses_a_retry_queue_that_dead_letters_elsewhere() {
    let env = TestEnv::new("decl_drift_run").await;
    env.declare();
    let ttl = retry_ttl(&env).await;
    let channel = env.conn.create_channel().await.expect("channel");
    channel
        .queue_delete(env.retry_queue.as_str().into(), Default::default())
        .await
        .expect("delete the retry queue");
    declare_retry_queue_to(&env, &format!("{}_old", env.main_queue), ttl).await;
    let mut run = env.start(&[]);
    let status = run.wait(Duration::from_secs(60));
    assert_drift_refused(&env, status, &run.logs()).await;
}

/// The retry queue's TTL as `warren declare` made it.
async fn retry_ttl(env: &TestEnv) -> i64 {
    queues(env).await[&env.retry_queue].arguments["x-message-ttl"]
        .as_i64()
        .expect("the retry queue's TTL")
}

/// A start exited 1 naming the retry queue that dead-letters to `<main>_old`, and left it.
async fn assert_drift_refused(env: &TestEnv, status: std::process::ExitStatus, logs: &str) {
    let old_main = format!("{}_old", env.main_queue);
    assert_eq!(status.code(), Some(1), "{logs}");
    let expected = format!(
        "queue {} exists with x-dead-letter-routing-key = {old_main}, but warren declares \
         x-dead-letter-routing-key = {}",
        env.retry_queue, env.main_queue
    );
    assert!(logs.contains(&expected), "{expected}\n{logs}");
    assert_eq!(
        queues(env).await[&env.retry_queue].arguments["x-dead-letter-routing-key"],
        json!(old_main),
        "the queue is left as it was"
    );
}

/// A queue missing at the start is waited for before anything consumes, and checked once
/// another step declares it (review R35h F5: one declared later with other arguments was
/// taken unchecked until the next reload): declared as warren declares it, the roles start;
/// declared dead-lettering elsewhere, warren exits 1 as it does at a start.
#[tokio::test(flavor = "multi_thread")]
async fn run_without_declare_waits_for_a_missing_retry_queue_and_checks_it_once_declared() {
    let env = TestEnv::new("decl_wait_run").await;
    env.declare();
    let ttl = retry_ttl(&env).await;
    let channel = env.conn.create_channel().await.expect("channel");
    let waiting = "waiting for the pipelines' exchanges and queues to be declared";
    for drifted in [false, true] {
        channel
            .queue_delete(env.retry_queue.as_str().into(), Default::default())
            .await
            .expect("delete the retry queue");
        let mut run = env.start(&[]);
        run.wait_for_log("the wait for the retry queue", waiting)
            .await;
        assert!(
            run.logs().contains(&format!("queue {}", env.retry_queue)),
            "the warning names the queue:\n{}",
            run.logs()
        );
        assert_eq!(
            env.queue_state(&env.main_queue).await.1,
            0,
            "nothing consumes meanwhile"
        );
        if drifted {
            declare_retry_queue_to(&env, &format!("{}_old", env.main_queue), ttl).await;
            let status = run.wait(Duration::from_secs(60));
            assert_drift_refused(&env, status, &run.logs()).await;
        } else {
            env.declare();
            wait_until("the stages subscribe", Duration::from_secs(60), || async {
                env.queue_state(&env.main_queue).await.1 > 0
            })
            .await;
            run.terminate_ok(Duration::from_secs(30));
        }
    }
}

/// The broker goes away while a start waits for a missing retry queue (review R37x F4): the
/// roles start, but nothing consumes until the check ran once the broker is back. Declared
/// meanwhile dead-lettering elsewhere, warren exits 1 as at a start, having consumed nothing
/// (the check was left out, and every retry was lost); declared as warren declares it, the
/// stages subscribe.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_gone_during_the_wait_holds_the_consumers_until_the_check() {
    let mut env = TestEnv::new("decl_wait_cut").await;
    env.declare();
    let ttl = retry_ttl(&env).await;
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    env.set("AMQP_URL", amqp.url());
    let channel = env.conn.create_channel().await.expect("channel");
    for drifted in [true, false] {
        channel
            .queue_delete(env.retry_queue.as_str().into(), Default::default())
            .await
            .expect("delete the retry queue");
        let mut run = env.start(&["--roles", "consumer,dlq"]);
        let _logs = LogsOnPanic(vec![run.log.clone()]);
        // A start under the full suite's load (two lanes on two cores, other tests' warrens
        // starting and migrating beside it) once took over 30 s to reach this line (its log
        // was not kept then; it is now).
        wait_until(
            "the wait for the retry queue",
            Duration::from_secs(90),
            || async {
                run.logs()
                    .contains("waiting for the pipelines' exchanges and queues to be declared")
            },
        )
        .await;
        let (status, body) = metrics_get(&env, "/readyz").await.expect("/readyz answers");
        assert_eq!(status, 503, "{body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).expect("JSON"),
            json!({"starting": "checking the broker's exchanges and queues against the configuration"}),
            "what the start waits for, not a database link it has not made"
        );
        amqp.cut();
        run.wait_for_log(
            "the consumers held",
            "consuming and publishing wait for the check of the broker's exchanges and queues",
        )
        .await;
        // The instance record says it waits (review R39-F9: it said `running`).
        wait_until(
            "the record says waiting",
            Duration::from_secs(30),
            || async {
                let (_, out, _) = env.run_async(&["status", "--json"]).await;
                serde_json::from_str::<Value>(&out)
                    .ok()
                    .and_then(|v| v["instances"].as_array().cloned())
                    .is_some_and(|list| list.iter().any(|i| i["status"] == "waiting"))
            },
        )
        .await;
        // Not the broker's link blamed: what the roles wait for (review R38-F7).
        let (status, body) = metrics_get(&env, "/readyz").await.expect("/readyz answers");
        assert_eq!(status, 503, "{body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).expect("JSON"),
            json!({"starting": "the consumers and the API wait for the check of the broker's exchanges and queues"}),
        );
        if drifted {
            declare_retry_queue_to(&env, &format!("{}_old", env.main_queue), ttl).await;
        } else {
            // Past the cut link: straight to the broker.
            env.set("AMQP_URL", amqp_url());
            env.declare();
            env.set("AMQP_URL", amqp.url());
        }
        env.publish_users(5).await;
        amqp.restore();
        if drifted {
            let status = run.wait(Duration::from_secs(60));
            assert_drift_refused(&env, status, &run.logs()).await;
            assert_eq!(
                env.queue_state(&env.main_queue).await.0,
                5,
                "nothing was consumed:\n{}",
                run.logs()
            );
        } else {
            wait_until("the stages subscribe", Duration::from_secs(60), || async {
                env.queue_state(&env.main_queue).await.1 > 0
            })
            .await;
            assert!(
                run.logs()
                    .contains("match this configuration; consuming and publishing start"),
                "{}",
                run.logs()
            );
            run.terminate_ok(Duration::from_secs(30));
        }
    }
}

/// The retry queue declared with `ttl`, dead-lettering to `main` through the main exchange.
async fn declare_retry_queue_to(env: &TestEnv, main: &str, ttl: i64) {
    let channel = env.conn.create_channel().await.expect("channel");
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongInt(ttl.try_into().unwrap()),
    );
    for (key, value) in [
        ("x-dead-letter-exchange", env.main_exchange.as_str()),
        ("x-dead-letter-routing-key", main),
    ] {
        args.insert(key.into(), AMQPValue::LongString(value.into()));
    }
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(env.retry_queue.as_str().into(), durable, args)
        .await
        .expect("the retry queue, dead-lettering to `main`");
    let _ = channel.close(200, "".into()).await;
}

/// Review R38-F11: a pipeline with deletes on a partitioned table and another pipeline on one
/// of its partitions: the same rows under two names, which the load's rule (by name) cannot
/// see; the other's writes never read the tombstones, so an older write of a deleted key
/// brought its row back. `declare` and the start of `run` refuse it (exit 2), naming both.
#[tokio::test(flavor = "multi_thread")]
async fn a_pipeline_on_a_partition_of_a_table_with_deletes_is_refused() {
    let env = TestEnv::new("decl_partition").await;
    let (pd, pw) = (
        PipelineNames::of(&env, "parted"),
        PipelineNames::of(&env, "part0"),
    );
    let (_c1, _c2) = (pd.cleanup(), pw.cleanup());
    env.db
        .batch_execute(
            "CREATE TABLE pt (k text NOT NULL, v int8 NOT NULL, PRIMARY KEY (k))
                 PARTITION BY HASH (k);
             CREATE TABLE pt_0 PARTITION OF pt FOR VALUES WITH (MODULUS 1, REMAINDER 0)",
        )
        .await
        .expect("the partitioned table");
    let entry = |name: &str, table: &str, names: &PipelineNames, extra: &str| {
        format!(
            "[[pipelines]]\nname = \"{name}\"\ntable = \"{table}\"\nkey = [\"k\"]\n\
             on_conflict = \"update\"\nversion_column = \"v\"\n{extra}{}\n\
             [pipelines.columns]\nk = {{ path = \"/k\", type = \"text\" }}\n\
             v = {{ path = \"/v\", type = \"int8\" }}\n",
            names.toml()
        )
    };
    let file = ConfigFile::new(&format!(
        "{}\n{}",
        entry(
            "parted",
            "pt",
            &pd,
            "delete = { field = \"/op\", value = \"delete\" }\n"
        ),
        entry("part0", "pt_0", &pw, "")
    ));
    let words = "pipeline parted has deletes and writes pt; pipeline part0 writes pt_0, of the \
                 same partitioned or inherited table pt:";
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains(words), "{words}\n{out}{err}");
    let (code, out, err) = env
        .run_async(&["--config", file.at(), "run", "--roles", "consumer"])
        .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains(words), "{words}\n{out}{err}");
    // Each selected by an instance of its own, against the whole file (review R39-F5).
    for selected in ["part0", "parted"] {
        let (code, out, err) = env
            .run_async(&[
                "--config",
                file.at(),
                "run",
                "--roles",
                "consumer",
                "--pipelines",
                selected,
            ])
            .await;
        assert_eq!(code, 2, "{selected}: {out}{err}");
        assert!(err.contains(words), "{selected}: {words}\n{out}{err}");
    }
    // One reading of a name in every check (review R40a F3): PT_0 is not pt_0, so it does not
    // exist, and no family of pt_0's is said of it.
    let upper = ConfigFile::new(&format!(
        "{}\n{}",
        entry(
            "parted",
            "pt",
            &pd,
            "delete = { field = \"/op\", value = \"delete\" }\n"
        ),
        entry("part0", "PT_0", &pw, "")
    ));
    let (code, out, err) = env.run_async(&["--config", upper.at(), "declare"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("table PT_0 does not exist") && !err.contains("writes PT_0"),
        "{out}{err}"
    );
    // A pipeline's table under warren's own tombstone table (an inheritance child): its rows
    // would be read as tombstones (review R39-F6).
    env.db
        .batch_execute("CREATE TABLE tomb_child (PRIMARY KEY (k)) INHERITS (tombstones_parted)")
        .await
        .expect("an inheritance child of the tombstone table");
    let file = ConfigFile::new(&format!(
        "{}\n{}",
        entry(
            "parted",
            "pt",
            &pd,
            "delete = { field = \"/op\", value = \"delete\" }\n"
        ),
        entry("part0", "tomb_child", &pw, "")
    ));
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(
            "pipeline part0 writes tomb_child, under warren's own table tombstones_parted"
        ),
        "{out}{err}"
    );
}

/// A broker user of the test's own, deleted when dropped (a panic included).
struct BrokerUser(String);

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.0])
            .output();
    }
}

/// A broker user without the configure permission cannot declare: `warren run` without
/// `--declare` checks that its exchanges and queues exist, names them in a warning, and runs;
/// one missing is still waited for.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_user_that_may_not_configure_gets_its_objects_checked_to_exist() {
    let env = TestEnv::new("decl_noconf").await;
    env.declare();
    let user = BrokerUser(format!("warren_test_noconf_{}", std::process::id()));
    rabbitmqctl(&["add_user", &user.0, "pw"]).await;
    rabbitmqctl(&["set_permissions", "-p", "/", &user.0, "^$", ".*", ".*"]).await;
    let url = format!("amqp_url=amqp://{}:pw@127.0.0.1:5672/%2f", user.0);
    let mut run = env.start(&["--roles", "consumer", "--set", &url]);
    run.wait_for_log(
        "the existence-only warning",
        "the broker user may not configure these exchanges and queues (ACCESS_REFUSED)",
    )
    .await;
    let logs = run.logs();
    assert!(
        logs.contains(&format!("queue {}", env.retry_queue)),
        "the warning names the objects:\n{logs}"
    );
    wait_until("the stages subscribe", Duration::from_secs(60), || async {
        env.queue_state(&env.main_queue).await.1 > 0
    })
    .await;
    run.terminate_ok(Duration::from_secs(30));
}

/// A binding removed by hand is made again by the start's check (review R35i F3: a main queue
/// unbound from its exchange passed, and every retry vanished at its hop back).
#[tokio::test(flavor = "multi_thread")]
async fn run_without_declare_binds_again_a_main_queue_unbound_by_hand() {
    let env = TestEnv::new("decl_rebind").await;
    env.declare();
    let binding = (
        env.main_exchange.clone(),
        env.main_queue.clone(),
        env.main_queue.clone(),
    );
    assert!(bindings(&env).await.contains(&binding), "declared bound");
    let channel = env.conn.create_channel().await.expect("channel");
    channel
        .queue_unbind(
            env.main_queue.as_str().into(),
            env.main_exchange.as_str().into(),
            env.main_queue.as_str().into(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the main queue");
    assert!(!bindings(&env).await.contains(&binding), "unbound by hand");
    let mut run = env.start(&["--roles", "consumer"]);
    wait_until(
        "the main queue bound again",
        Duration::from_secs(60),
        || async { bindings(&env).await.contains(&binding) },
    )
    .await;
    run.terminate_ok(Duration::from_secs(30));
}
