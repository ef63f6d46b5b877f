//! `unknown_fields = { keep = "<column>" }` on the real broker and database: a producer that
//! adds fields (a different set on each message, nested values, numbers with many digits)
//! loses none of them: every message's fields that no column reads are in the kept column,
//! exactly, `{}` for a message without any, through the queue and through the API (`api =
//! true`); `declare` names a missing or non-jsonb kept column (exit 2), `warren pipelines`
//! lists it and `warren pipelines test` prints it in the row.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use uuid::Uuid;

/// The orders pipeline of `orders_toml`, keeping its unknown fields in `extra`, with its API.
fn kept_toml(names: &PipelineNames) -> String {
    orders_toml(names, "unknown_fields = { keep = \"extra\" }\napi = true")
}

/// The fields a producer adds to message `i`: none for some, else a drawn set of names and
/// values (nested, numbers with more digits than a double keeps, text beyond ASCII).
fn added(rng: &mut fastrand::Rng, i: usize) -> Vec<(String, String)> {
    if i.is_multiple_of(7) {
        return Vec::new();
    }
    let values = [
        r#""plain""#.to_string(),
        r#""é ü \" \\ 😀""#.to_string(),
        "12.500000000000000000001".to_string(),
        "-0".to_string(),
        "1e3".to_string(),
        "true".to_string(),
        "null".to_string(),
        r#"[1,"two",{"three":3}]"#.to_string(),
        r#"{"nested":{"deep":[{"x":1.10}]}}"#.to_string(),
        format!(r#""{}""#, "x".repeat(rng.usize(0..2000))),
    ];
    let n = rng.usize(1..6);
    let mut names = HashSet::new();
    let mut out = Vec::new();
    while out.len() < n {
        let name = match rng.u32(0..4) {
            0 => format!("f{}", rng.u32(0..10)),
            1 => format!("added_{i}"),
            2 => "coupon".to_string(),
            _ => "a/b~c".to_string(),
        };
        if names.insert(name.clone()) {
            out.push((name, values[rng.usize(0..values.len())].clone()));
        }
    }
    out
}

/// An order's body: its id and qty, then the added fields, in the order given.
fn body(id: Uuid, qty: i64, extra: &[(String, String)]) -> String {
    let mut text = format!(r#"{{"id":"{id}","qty":{qty}"#);
    for (k, v) in extra {
        text.push_str(&format!(
            ",{}:{v}",
            serde_json::to_string(k).expect("a name")
        ));
    }
    text.push('}');
    text
}

/// The added fields as the JSON object the kept column must hold.
fn object(extra: &[(String, String)]) -> String {
    let pairs: Vec<String> = extra
        .iter()
        .map(|(k, v)| format!("{}:{v}", serde_json::to_string(k).expect("a name")))
        .collect();
    format!("{{{}}}", pairs.join(","))
}

/// The ids whose stored `extra` equals (as jsonb) the expected object.
async fn matching(env: &TestEnv, expected: &[(Uuid, String)]) -> Vec<Uuid> {
    let ids: Vec<Uuid> = expected.iter().map(|(id, _)| *id).collect();
    let objects: Vec<String> = expected.iter().map(|(_, o)| o.clone()).collect();
    env.db
        .query(
            "SELECT o.order_id FROM orders AS o \
             JOIN unnest($1::uuid[], $2::text[]) AS e(id, x) ON o.order_id = e.id \
             WHERE o.extra = e.x::jsonb",
            &[&ids, &objects],
        )
        .await
        .expect("compare the kept fields")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_producer_adding_fields_loses_none_of_them() {
    let env = TestEnv::new("kept_fields").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, qty int4 NOT NULL, \
             extra jsonb NOT NULL)",
        )
        .await
        .expect("create orders");
    let file = ConfigFile::new(&kept_toml(&names));
    declare_file(&env, &file).await;
    let warren = env.start(&[
        "--config",
        file.at(),
        "--roles",
        "api,consumer,dlq",
        "--pipelines",
        "orders",
    ]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_ready(&env, Duration::from_secs(30)).await;

    let seed = fastrand::u64(..);
    eprintln!("kept_fields: seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut expected: Vec<(Uuid, String)> = Vec::new();
    let mut messages = Vec::new();
    for i in 0..200 {
        let id = Uuid::new_v4();
        let extra = added(&mut rng, i);
        messages.push((
            body(id, 1 + i as i64, &extra).into_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        ));
        expected.push((id, object(&extra)));
    }
    env.publish_pipelined_to(&names.exchange, &names.queue, messages)
        .await;
    // Through the API: the body is checked and published as it came.
    for i in 0..5 {
        let id = Uuid::new_v4();
        let extra = added(&mut rng, 1000 + i);
        let answer = http(&env, "POST", "/api/v1/orders", Some(&body(id, 7, &extra))).await;
        assert!(matches!(answer, Some((200, _))), "POST: {answer:?}");
        expected.push((id, object(&extra)));
    }

    let want: HashSet<Uuid> = expected.iter().map(|(id, _)| *id).collect();
    wait_until("every order stored", Duration::from_secs(60), || async {
        count_of(&env, "SELECT count(*) FROM orders").await >= want.len() as i64
    })
    .await;
    // Every row's kept fields are its message's, exactly (compared as jsonb); no other row.
    assert_same_ids(
        "orders with exactly their added fields",
        &want,
        &matching(&env, &expected).await,
    );
    assert_same_ids(
        "orders",
        &want,
        &uuids_of(&env, "SELECT order_id FROM orders").await,
    );
    let empty = count_of(
        &env,
        "SELECT count(*) FROM orders WHERE extra = '{}'::jsonb",
    )
    .await;
    let none = expected.iter().filter(|(_, o)| o == "{}").count() as i64;
    assert_eq!(empty, none, "the orders without added fields hold {{}}");
    // The API reads it back as a column.
    let (id, object) = &expected[1];
    let (status, text) = http(&env, "GET", &format!("/api/v1/orders/{id}"), None)
        .await
        .expect("an answer");
    assert_eq!(status, 200, "{text}");
    let got: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    // As jsonb keeps it: the database decides a value's form (a generated -0.0 is 0 there,
    // numeric having no negative zero), not serde's reading of what was sent.
    let stored: String = env
        .db
        .query_one("SELECT $1::text::jsonb::text", &[object])
        .await
        .expect("the added fields as jsonb")
        .get(0);
    let want_extra: serde_json::Value = serde_json::from_str(&stored).expect("JSON");
    assert_eq!(got["extra"], want_extra, "{text}");
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM dead_letters").await,
        0,
        "nothing parked"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kept_column_is_checked_listed_and_shown() {
    let env = TestEnv::new("kept_check").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    let file = ConfigFile::new(&kept_toml(&names));
    // Missing, then json: declare names the pipeline, the table and the column, exit 2.
    env.db
        .batch_execute("CREATE TABLE orders (order_id uuid PRIMARY KEY, qty int4 NOT NULL)")
        .await
        .expect("create orders");
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(
            "pipeline orders: table orders: column extra does not exist (expected a jsonb column"
        ),
        "{err}"
    );
    env.db
        .batch_execute("ALTER TABLE orders ADD COLUMN extra json")
        .await
        .expect("add extra json");
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("pipeline orders: table orders: column extra is json; unknown_fields = { keep = \"extra\" } needs a jsonb column"),
        "{err}"
    );
    // The start of run checks it too.
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "run",
            "--pipelines",
            "orders",
            "--roles",
            "consumer",
        ])
        .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("column extra is json"), "{err}");
    env.db
        .batch_execute("ALTER TABLE orders ALTER COLUMN extra TYPE jsonb")
        .await
        .expect("extra jsonb");
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 0, "{out}{err}");

    // Listed, and shown in the row pipelines test prints.
    let (code, out, err) = env.run_async(&["--config", file.at(), "pipelines"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("unknown_fields keep (in column extra)"),
        "{out}"
    );
    assert!(
        out.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["extra", "(unknown", "fields)", "jsonb"]),
        "{out}"
    );
    let id = Uuid::new_v4();
    let lines = ConfigFile::new(&format!(
        "{{\"id\":\"{id}\",\"qty\":2,\"coupon\":\"X1\",\"n\":1.50}}\n{{\"id\":\"{id}\",\"qty\":2}}\n"
    ));
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "pipelines",
            "test",
            "orders",
            lines.at(),
            "--db",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(r#""extra":{"coupon":"X1","n":1.50}"#), "{out}");
    assert!(out.contains(r#""extra":{}"#), "{out}");

    // `unknown_fields = "keep"` without its column: exit 2 in warren's words.
    let bare = ConfigFile::new(&orders_toml(&names, "unknown_fields = \"keep\""));
    let (code, out, err) = env.run_async(&["--config", bare.at(), "config"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("unknown_fields") && err.contains("{ keep = \"<column>\" }"),
        "{err}"
    );
}
