//! A configured pipeline (`[[pipelines]]`) runs beside users in one process: an `orders` table
//! with a uuid key, an email-format text, a numeric with a minimum, an int4 range, a timestamptz,
//! the whole body as jsonb, a header column, an optional column and a second unique index. Good
//! messages land once; bad ones end parked under `orders` with the kind and a reason naming the
//! path; a transient failure sends an orders message through orders' own retry queue back to
//! orders' queue, never to the users queues; users keeps working beside it.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use uuid::Uuid;

type Names = PipelineNames;

fn config(n: &Names) -> String {
    format!(
        r#"
[[pipelines]]
name = "orders"
table = "orders"
key = ["order_id"]
batch_size = 50
batch_timeout_ms = 100
retry_ttls_ms = [1000]
main_exchange = "{}"
main_queue = "{}"
retry_exchange = "{}"
retry_queue = "{}"
dlx_exchange = "{}"
dlq_queue = "{}"

[pipelines.columns]
order_id  = {{ path = "/id", type = "uuid" }}
email     = {{ path = "/customer/email", type = "text", format = "email", max_len = 320 }}
total     = {{ path = "/total", type = "numeric", min = 0 }}
quantity  = {{ path = "/qty", type = "int4", min = 1, max = 1000 }}
placed_at = {{ path = "/placed_at", type = "timestamptz" }}
note      = {{ path = "/note", type = "text", optional = true }}
tenant    = {{ header = "x-tenant", type = "text", optional = true }}
ref       = {{ path = "/ref", type = "text", optional = true }}
doc       = {{ path = "", type = "jsonb" }}
"#,
        n.exchange, n.queue, n.retry_exchange, n.retry, n.dlx, n.dlq
    )
}

fn order(id: Uuid, total: &str, qty: i64, reference: Option<&str>) -> Vec<u8> {
    let r = reference
        .map(|r| format!(r#","ref":"{r}""#))
        .unwrap_or_default();
    format!(
        r#"{{"id":"{id}","customer":{{"email":"c-{id}@example.com"}},"total":{total},"qty":{qty},"placed_at":"2026-11-24T10:00:00Z"{r}}}"#
    )
    .into_bytes()
}

fn with_tenant(tenant: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-tenant".into(), AMQPValue::LongString(tenant.into()));
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_orders_pipeline_runs_beside_users_and_keeps_its_own_paths() {
    let mut env = TestEnv::new("pl_orders").await;
    env.set("DATABASE_STATEMENT_TIMEOUT_MS", "500")
        .set("DB_RETRY_WINDOW_MS", "300")
        .set("RETRY_TTL_MS", "1000");
    let names = Names::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                email text NOT NULL,
                total numeric NOT NULL,
                quantity int4 NOT NULL,
                placed_at timestamptz NOT NULL,
                note text,
                tenant text,
                ref text UNIQUE,
                doc jsonb NOT NULL
            )",
        )
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(&path, config(&names)).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // The queue poller watches orders' queues beside users' (the metrics, and the depth the
    // idle watchdog reads).
    wait_until("orders' queues polled", Duration::from_secs(30), || async {
        let Ok(text) = scrape_text(&env).await else {
            return false;
        };
        let s = Scrape::parse(text);
        [&names.queue, &names.retry, &names.dlq, &env.main_queue]
            .iter()
            .all(|q| {
                s.one("warren_queue_messages", &[("queue", q.as_str())])
                    .is_some()
            })
    })
    .await;

    // Good orders (one with a tenant header), users beside them.
    let good: Vec<Uuid> = (0..40).map(|_| Uuid::new_v4()).collect();
    for (i, id) in good.iter().enumerate() {
        let props = if i == 0 {
            with_tenant("acme")
        } else {
            BasicProperties::default().with_delivery_mode(2)
        };
        env.publish_to(
            &names.exchange,
            &names.queue,
            &order(*id, "\"12.50\"", 2, None),
            props,
        )
        .await;
    }
    let users: HashSet<Uuid> = env.publish_users(20).await.into_iter().collect();

    // Bad ones, each with the path its reason must name.
    let taken = Uuid::new_v4();
    let bad: Vec<(Vec<u8>, &str, &str)> = vec![
        (br#"{"id":"nope"}"#.to_vec(), "invalid_payload", "/id"),
        (
            order(Uuid::new_v4(), "-1", 2, None),
            "invalid_payload",
            "/total",
        ),
        (
            order(Uuid::new_v4(), "1", 1001, None),
            "invalid_payload",
            "/qty",
        ),
        (b"{not json".to_vec(), "invalid_json", "JSON"),
        // A key twice: parsers disagree on which one counts, so the message is refused.
        (
            {
                let mut body = order(Uuid::new_v4(), "1", 2, None);
                body.pop();
                body.extend_from_slice(br#","qty":3}"#);
                body
            },
            "invalid_payload",
            "/qty",
        ),
        // Same key as a good one, other content.
        (order(good[1], "99", 2, None), "id_conflict", ""),
        // Another unique index (ref) holds its value under another key.
        (
            order(Uuid::new_v4(), "1", 1, Some("R-1")),
            "db_permanent",
            "ref",
        ),
    ];
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(taken, "1", 1, Some("R-1")),
        BasicProperties::default(),
    )
    .await;
    // The order holding R-1 stored before the one that clashes with it is published.
    wait_until("the order holding R-1", Duration::from_secs(30), || async {
        uuids_of(&env, "SELECT order_id FROM orders WHERE ref = 'R-1'").await == [taken]
    })
    .await;
    for (body, _, _) in &bad {
        env.publish_to(
            &names.exchange,
            &names.queue,
            body,
            BasicProperties::default(),
        )
        .await;
    }

    let count = |sql: &'static str| count_of(&env, sql);
    wait_until(
        "41 orders, 20 users, 7 parked under orders",
        Duration::from_secs(60),
        || async {
            count("SELECT count(*) FROM orders").await == 41
                && env.count_rows().await == 20
                && count("SELECT count(*) FROM dead_letters WHERE pipeline = 'orders'").await == 7
        },
    )
    .await;
    let parked = env
        .db
        .query(
            "SELECT error_kind, error_reason FROM dead_letters WHERE pipeline = 'orders' ORDER BY seq",
            &[],
        )
        .await
        .expect("parked rows");
    for (_, kind, word) in &bad {
        assert!(
            parked
                .iter()
                .any(|r| r.get::<_, String>(0) == *kind && r.get::<_, String>(1).contains(word)),
            "no {kind} row naming {word:?}: {:?}",
            parked
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
                .collect::<Vec<_>>()
        );
    }
    let tenant: Option<String> = env
        .db
        .query_one("SELECT tenant FROM orders WHERE order_id = $1", &[&good[0]])
        .await
        .expect("the first order")
        .get(0);
    assert_eq!(tenant.as_deref(), Some("acme"));
    assert_eq!(
        count("SELECT count(*) FROM dead_letters WHERE pipeline <> 'orders'").await,
        0,
        "nothing of orders parked under users"
    );

    // A transient failure: the table locked past the statement timeout. The order goes through
    // orders' retry queue and back to orders' queue; the users queues never see it.
    let (lock, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    lock.batch_execute(&format!(
        "SET search_path TO {}; BEGIN; LOCK TABLE orders IN SHARE MODE",
        env.schema
    ))
    .await
    .expect("lock orders");
    let late = Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(late, "3", 3, None),
        BasicProperties::default(),
    )
    .await;
    wait_until(
        "the order in orders' retry queue",
        Duration::from_secs(30),
        || async { env.queue_state(&names.retry).await.0 > 0 },
    )
    .await;
    assert_eq!(
        env.queue_state(&env.retry_queue).await.0,
        0,
        "users' retry queue"
    );
    lock.batch_execute("ROLLBACK").await.expect("unlock");
    wait_until(
        "the retried order inserted",
        Duration::from_secs(60),
        || async { count("SELECT count(*) FROM orders").await == 42 },
    )
    .await;
    assert_eq!(env.count_rows().await, 20, "users unchanged");
    for q in [
        &names.queue,
        &names.retry,
        &names.dlq,
        &env.main_queue,
        &env.dlq_queue,
    ] {
        assert_eq!(env.queue_state(q).await.0, 0, "{q} empty");
    }
    assert_rows_exactly(&env, &users, Duration::from_secs(5), &|| warren.logs()).await;

    // The DLQ tools know the pipeline: its parked rows, and a replay back to its own queue (the
    // invalid ones come back to orders' parking, re-opened; nothing reaches users).
    let (code, out, err) = env
        .run_async(&[
            "--config",
            &file,
            "dlq",
            "--pipeline",
            "orders",
            "parked",
            "list",
        ])
        .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("pipeline orders, not replayed: 7 messages"),
        "{out}"
    );
    let (code, out, err) = env
        .run_async(&["--config", &file, "dlq", "parked", "list"])
        .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("pipeline users, not replayed: 0 messages"),
        "users has none: {out}"
    );
    let (code, _, err) = env
        .run_async(&[
            "--config",
            &file,
            "dlq",
            "--pipeline",
            "nope",
            "parked",
            "list",
        ])
        .await;
    assert_ne!(code, 0);
    assert!(err.contains("no pipeline \"nope\""), "{err}");
    let (code, out, err) = env
        .run_async(&[
            "--config",
            &file,
            "dlq",
            "--pipeline",
            "orders",
            "parked",
            "replay",
            "--kind",
            "invalid_payload",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&names.exchange),
        "replayed to orders' exchange: {out}"
    );
    wait_until("the replayed rows parked again under orders", Duration::from_secs(60), || async {
        count("SELECT count(*) FROM dead_letters WHERE pipeline = 'orders' AND replayed_at IS NULL")
            .await
            == 7
    })
    .await;
    assert_eq!(
        count("SELECT count(*) FROM dead_letters WHERE pipeline <> 'orders'").await,
        0
    );
    assert_eq!(env.count_rows().await, 20, "users unchanged");
}

/// `warren run --pipelines orders` runs orders alone: users messages wait in their queue, with
/// no consumer; an unknown name stops warren with exit 2 naming the known ones.
#[tokio::test(flavor = "multi_thread")]
async fn run_pipelines_chooses_which_pipelines_run() {
    let env = TestEnv::new("pl_select").await;
    let names = Names::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, email text NOT NULL,
                total numeric NOT NULL, quantity int4 NOT NULL, placed_at timestamptz NOT NULL,
                note text, tenant text, ref text UNIQUE, doc jsonb NOT NULL)",
        )
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(&path, config(&names)).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");

    let (code, out, err) = env
        .run_async(&["--config", &file, "run", "--pipelines", "orders,nope"])
        .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("--pipelines: expected names of pipelines of this configuration (users, orders), got \"nope\""),
        "{err}"
    );
    // A name close to one offers it, as every other tool's --pipeline (review R40a F1).
    let (code, out, err) = env
        .run_async(&["--config", &file, "run", "--pipelines", "ordres"])
        .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("got \"ordres\" (did you mean orders?)"),
        "{err}"
    );

    let warren = env.start(&[
        "--config",
        &file,
        "--roles",
        "consumer",
        "--pipelines",
        "orders",
    ]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    for _ in 0..5 {
        env.publish_to(
            &names.exchange,
            &names.queue,
            &order(Uuid::new_v4(), "1", 1, None),
            BasicProperties::default(),
        )
        .await;
    }
    env.publish_users(5).await;
    wait_until("5 orders", Duration::from_secs(30), || async {
        count_of(&env, "SELECT count(*) FROM orders").await == 5
    })
    .await;
    assert_eq!(
        env.queue_state(&env.main_queue).await,
        (5, 0),
        "users not consumed"
    );
    assert_eq!(env.count_rows().await, 0);
}

/// Found by review (R36-F3): a header the AMQP parser kept raw, past its 128 KiB budget (2,000
/// entries sorted before it spent the budget), was stored as NULL by an optional header column.
/// Through the real broker and consumer it is stored as sent; an order with plain headers beside
/// it too. And through a copy (review R36f F3): warren's retry copy carried the raw rest as one
/// byte-array entry, where nothing found the header again, and the retried order was stored with
/// a NULL tenant; the copy now carries the entries as they came.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_past_the_parsers_budget_is_stored_not_null() {
    let mut env = TestEnv::new("pl_hdr_budget").await;
    env.set("DB_RETRY_WINDOW_MS", "0");
    let names = Names::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, email text NOT NULL,
                total numeric NOT NULL, quantity int4 NOT NULL, placed_at timestamptz NOT NULL,
                note text, tenant text, ref text UNIQUE, doc jsonb NOT NULL);
             CREATE TABLE fail_orders (active boolean NOT NULL);
             INSERT INTO fail_orders VALUES (true);
             CREATE FUNCTION fail_orders() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               IF (SELECT active FROM fail_orders) THEN
                 RAISE EXCEPTION 'test: orders fail for now' USING ERRCODE = '40001';
               END IF; RETURN NULL; END $$;
             CREATE TRIGGER fail_orders AFTER INSERT ON orders
               FOR EACH STATEMENT EXECUTE FUNCTION fail_orders();",
        )
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(&path, config(&names)).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let warren = env.start(&[
        "--config",
        &file,
        "--roles",
        "consumer",
        "--pipelines",
        "orders",
    ]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let far_headers = |tenant: &str| {
        let mut headers = FieldTable::default();
        for i in 0..2_000 {
            headers.insert(format!("x-f{i:04}").into(), AMQPValue::Void);
        }
        headers.insert("x-tenant".into(), AMQPValue::LongString(tenant.into()));
        BasicProperties::default().with_headers(headers)
    };
    // Refused for now (a transient error): through orders' retry queue, a copy of warren's.
    let retried = Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(retried, "1", 1, None),
        far_headers("retried"),
    )
    .await;
    wait_until("the order retried", Duration::from_secs(30), || async {
        try_metric(
            &env,
            "warren_messages_retried_total",
            &[("pipeline", "orders")],
        )
        .await
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    env.db
        .batch_execute("UPDATE fail_orders SET active = false")
        .await
        .expect("end the failure");
    let (far, near) = (Uuid::new_v4(), Uuid::new_v4());
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(far, "1", 1, None),
        far_headers("far"),
    )
    .await;
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(near, "1", 1, None),
        with_tenant("near"),
    )
    .await;
    wait_until("the three orders", Duration::from_secs(30), || async {
        count_of(&env, "SELECT count(*) FROM orders").await == 3
    })
    .await;
    let tenant = |id: Uuid| {
        let env = &env;
        async move {
            env.db
                .query_one("SELECT tenant FROM orders WHERE order_id = $1", &[&id])
                .await
                .expect("the order")
                .get::<_, Option<String>>(0)
        }
    };
    assert_eq!(tenant(far).await.as_deref(), Some("far"));
    assert_eq!(tenant(near).await.as_deref(), Some("near"));
    assert_eq!(tenant(retried).await.as_deref(), Some("retried"));
}

/// `api = true`: `POST /api/v1/orders` checks a body with the mapping and publishes it under its
/// key; `GET /api/v1/orders/<key>` reads the row back, or the fate of a parked message; `PUT`
/// refuses a body whose key is not the path's; the users API keeps working beside it.
#[tokio::test(flavor = "multi_thread")]
async fn an_orders_api_checks_publishes_and_reads_back() {
    let env = TestEnv::new("pl_api").await;
    let names = Names::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                email text NOT NULL,
                total numeric NOT NULL,
                quantity int4 NOT NULL,
                placed_at timestamptz NOT NULL,
                note text,
                tenant text,
                ref text UNIQUE,
                doc jsonb NOT NULL
            )",
        )
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    let text = config(&names).replacen(
        "key = [\"order_id\"]",
        "key = [\"order_id\"]\napi = true",
        1,
    );
    std::fs::write(&path, text).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq,api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("the API ready", Duration::from_secs(30), || async {
        matches!(http(&env, "GET", "/readyz", None).await, Some((200, _)))
    })
    .await;

    // A good order: published under its key, then readable.
    let id = Uuid::new_v4();
    let body = String::from_utf8(order(id, "\"12.50\"", 2, Some("R-9"))).unwrap();
    let (status, answer) = http(&env, "POST", "/api/v1/orders", Some(&body))
        .await
        .expect("POST");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&answer).unwrap()["id"],
        id.to_string()
    );
    wait_until("the order readable", Duration::from_secs(30), || async {
        matches!(
            http(&env, "GET", &format!("/api/v1/orders/{id}"), None).await,
            Some((200, _))
        )
    })
    .await;
    let (_, text) = http(&env, "GET", &format!("/api/v1/orders/{id}"), None)
        .await
        .expect("GET");
    let row: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(row["order_id"], id.to_string(), "{row}");
    assert_eq!(row["email"], format!("c-{id}@example.com"), "{row}");
    assert_eq!(row["total"], 12.50, "{row}");
    assert_eq!(row["ref"], "R-9", "{row}");
    // The same again (a client's retry): accepted, still one row.
    let (status, _) = http(&env, "POST", "/api/v1/orders", Some(&body))
        .await
        .expect("POST again");
    assert_eq!(status, 200);

    // What the mapping refuses: 422 with the kind and the field, nothing published.
    let bad = String::from_utf8(order(Uuid::new_v4(), "1", 1001, None)).unwrap();
    let (status, answer) = http(&env, "POST", "/api/v1/orders", Some(&bad))
        .await
        .expect("POST bad");
    assert_eq!(status, 422, "{answer}");
    assert!(
        answer.contains("invalid_payload") && answer.contains("qty must be at most 1000"),
        "{answer}"
    );
    // PUT: the path's key must be the body's (an upper-case UUID is the same key).
    let other = Uuid::new_v4();
    let (status, answer) = http(&env, "PUT", &format!("/api/v1/orders/{other}"), Some(&body))
        .await
        .expect("PUT mismatched");
    assert_eq!(status, 422, "{answer}");
    assert!(answer.contains("must be the one in the path"), "{answer}");
    let (status, answer) = http(
        &env,
        "PUT",
        &format!("/api/v1/orders/{}", id.to_string().to_uppercase()),
        Some(&body),
    )
    .await
    .expect("PUT");
    assert_eq!(status, 200, "{answer}");

    // Same key, other content: the pipeline parks it (keep), and GET of a key whose only message
    // was parked tells why. Another unique index (ref) makes a new key's message parked.
    let clash = Uuid::new_v4();
    let clashing = String::from_utf8(order(clash, "1", 1, Some("R-9"))).unwrap();
    let (status, answer) = http(&env, "POST", "/api/v1/orders", Some(&clashing))
        .await
        .expect("POST clashing");
    assert_eq!(status, 200, "{answer}");
    wait_until(
        "the clashing order parked",
        Duration::from_secs(60),
        || async {
            matches!(
                http(&env, "GET", &format!("/api/v1/orders/{clash}"), None).await,
                Some((409, _))
            )
        },
    )
    .await;
    let (_, parked) = http(&env, "GET", &format!("/api/v1/orders/{clash}"), None)
        .await
        .expect("GET parked");
    assert!(parked.contains("\"state\":\"parked\""), "{parked}");
    assert!(parked.contains("db_permanent"), "{parked}");

    // Unknown and malformed keys.
    let (status, _) = http(
        &env,
        "GET",
        &format!("/api/v1/orders/{}", Uuid::new_v4()),
        None,
    )
    .await
    .expect("GET unknown");
    assert_eq!(status, 404);
    let (status, answer) = http(&env, "GET", "/api/v1/orders/not-a-uuid", None)
        .await
        .expect("GET malformed");
    assert_eq!(status, 400, "{answer}");

    // Users beside it.
    let user = Uuid::new_v4();
    let (status, answer) = http(
        &env,
        "PUT",
        &format!("/api/v1/users/{user}"),
        Some(&format!(r#"{{"name":"u","email":"{user}@example.com"}}"#)),
    )
    .await
    .expect("PUT user");
    assert_eq!(status, 200, "{answer}");
    wait_until("the user inserted", Duration::from_secs(30), || async {
        env.count_rows().await == 1
    })
    .await;
    let orders: i64 = env
        .db
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 1, "one row for the order posted three times");

    // warren status: a line per pipeline stage, with its own counters (orders: four messages, the
    // three copies of one order succeeded, the clashing one dead-lettered to orders' DLQ).
    wait_until(
        "status shows the orders stage",
        Duration::from_secs(30),
        || async {
            let (_, out, _) = env.run_async(&["status", "--json"]).await;
            let doc: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            let stages = &doc["instances"][0]["stages"];
            stages["orders/main"]["inserted"].as_u64() == Some(3)
                && stages["orders/main"]["received"].as_u64() == Some(4)
                && stages["orders/main"]["dead_lettered"].as_u64() == Some(1)
                && stages["orders/dlq"]["received"].as_u64() == Some(1)
                && stages["users/main"]["inserted"].as_u64() == Some(1)
        },
    )
    .await;
    let (code, out, err) = env.run_async(&["--config", &file, "status"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("orders/main"))
        .unwrap_or_else(|| panic!("no orders line:\n{out}"));
    let columns: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        columns[2..4],
        ["4", "3"],
        "orders received, inserted: {line}\n{out}"
    );
    for q in [&names.queue, &names.retry, &names.dlq, &env.main_queue] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(q.as_str()) && !l.contains("missing")),
            "no line for queue {q}:\n{out}"
        );
    }

    // warren ctl --pipeline: orders paused alone; users keeps going; an unknown name fails.
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("pause  executed"), "{out}");
    let held = Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(held, "5", 5, None),
        BasicProperties::default(),
    )
    .await;
    let user = env.publish_users(1).await[0];
    wait_until(
        "the user inserted while orders is paused",
        Duration::from_secs(30),
        || async { env.row_ids().await.contains(&user) },
    )
    .await;
    // Paused is the consumer cancelled: once orders' queue has no consumer, nothing can take
    // the order any more, and it must still be there (not delivered before the cancel).
    wait_until(
        "orders' consumer cancelled",
        Duration::from_secs(10),
        || async { env.queue_state(&names.queue).await.1 == 0 },
    )
    .await;
    assert_eq!(
        env.queue_state(&names.queue).await,
        (1, 0),
        "the order waits"
    );
    assert_eq!(
        count_of(
            &env,
            &format!("SELECT count(*) FROM orders WHERE order_id = '{held}'")
        )
        .await,
        0,
        "the held order stored while orders was paused"
    );
    wait_until(
        "status shows orders paused",
        Duration::from_secs(10),
        || async {
            let (_, out, _) = env.run_async(&["status", "--json"]).await;
            let doc: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            let stages = &doc["instances"][0]["stages"];
            stages["orders/main"]["paused"] == true && stages["users/main"]["paused"] == false
        },
    )
    .await;
    // A pipeline no instance runs and the configuration does not name: refused before any
    // command is sent, the known ones listed once each.
    let (code, out, err) = env
        .run_async(&["ctl", "pause", "--all", "--pipeline", "nope"])
        .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("no pipeline \"nope\"") && err.contains("known: users, orders\n"),
        "{err}"
    );
    let (code, out, err) = env
        .run_async(&["ctl", "resume", "--all", "--pipeline", "orders"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    wait_until(
        "the held order inserted",
        Duration::from_secs(30),
        || async {
            count_of(
                &env,
                &format!("SELECT count(*) FROM orders WHERE order_id = '{held}'"),
            )
            .await
                == 1
        },
    )
    .await;
    let (_, out, _) = env.run_async(&["ctl", "history"]).await;
    assert!(out.contains("pipeline=orders"), "{out}");
}

/// A table whose second key is an exclusion constraint, which refuses with 23P01, not 23505:
/// the plain insert tried first fails whole, the `ON CONFLICT DO NOTHING` statement skips only
/// the refused row, which is parked as `db_permanent`; its batch's other rows go in, and a copy
/// of a stored row is a success, not parked.
#[tokio::test(flavor = "multi_thread")]
async fn an_exclusion_constraint_refuses_one_row_not_its_batch() {
    let env = TestEnv::new("pl_excl").await;
    let names = Names::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                email text NOT NULL,
                total numeric NOT NULL,
                quantity int4 NOT NULL,
                placed_at timestamptz NOT NULL,
                note text,
                tenant text,
                ref text,
                doc jsonb NOT NULL,
                EXCLUDE USING btree (ref WITH =)
            )",
        )
        .await
        .expect("create orders");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(&path, config(&names)).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let count = |sql: &'static str| count_of(&env, sql);
    let props = || BasicProperties::default().with_delivery_mode(2);
    let first = Uuid::new_v4();
    let stored = order(first, "1", 1, Some("R-1"));
    env.publish_to(&names.exchange, &names.queue, &stored, props())
        .await;
    wait_until("the first order", Duration::from_secs(30), || async {
        count("SELECT count(*) FROM orders").await == 1
    })
    .await;

    // One batch's worth: good orders, one the constraint refuses, a copy of the stored one.
    let excluded = Uuid::new_v4();
    for i in 0..20 {
        env.publish_to(
            &names.exchange,
            &names.queue,
            &order(Uuid::new_v4(), "2", 2, None),
            props(),
        )
        .await;
        if i == 10 {
            let body = order(excluded, "1", 1, Some("R-1"));
            env.publish_to(&names.exchange, &names.queue, &body, props())
                .await;
            env.publish_to(&names.exchange, &names.queue, &stored, props())
                .await;
        }
    }
    wait_until(
        "21 orders and the refused one parked",
        Duration::from_secs(60),
        || async {
            count("SELECT count(*) FROM orders").await == 21
                && count("SELECT count(*) FROM dead_letters WHERE pipeline = 'orders'").await == 1
        },
    )
    .await;
    let parked = env
        .db
        .query_one(
            "SELECT error_kind FROM dead_letters WHERE pipeline = 'orders'",
            &[],
        )
        .await
        .expect("the parked row");
    assert_eq!(parked.get::<_, String>(0), "db_permanent");
    let holder: Uuid = env
        .db
        .query_one("SELECT order_id FROM orders WHERE ref = 'R-1'", &[])
        .await
        .expect("R-1's order")
        .get(0);
    assert_eq!(holder, first);
    // Nothing more comes: the copy was a success, not a retry or a second parking. A sentinel
    // after it, then nothing left in flight in orders' queues (a copy sent to the retry tier
    // would wait there, ready).
    let sentinel = Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &order(sentinel, "2", 2, None),
        props(),
    )
    .await;
    wait_until("the sentinel order", Duration::from_secs(30), || async {
        count_of(
            &env,
            &format!("SELECT count(*) FROM orders WHERE order_id = '{sentinel}'"),
        )
        .await
            == 1
    })
    .await;
    wait_queues_settled(
        &[&names.queue, &names.retry, &names.dlq],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(count("SELECT count(*) FROM orders").await, 22);
    assert_eq!(
        count("SELECT count(*) FROM dead_letters").await,
        1,
        "only the refused order parked"
    );
    assert_eq!(env.queue_state(&names.queue).await.0, 0);
}
