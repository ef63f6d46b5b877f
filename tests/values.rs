//! PostgreSQL decides what a value is (issue 34, items 1 and 5): a value the table cannot hold
//! as sent is never taken for the row its key holds (a `varchar(3)` is not a truncating cast),
//! and records that are one key only under the column's type (`citext`) are one key in one
//! statement, not a transient error retried in place. On the real broker and database.

mod common;

use std::time::Duration;

use common::*;
use lapin::BasicProperties;

type Names = PipelineNames;

/// A `[[pipelines]]` entry of `name` into `table`, with `columns` (TOML lines). `batch` is the
/// batch size and the time a partial batch is held for more (its timeout and minimum wait
/// both): the tests here put several messages in one batch on purpose.
fn entry(
    n: &Names,
    name: &str,
    table: &str,
    key: &str,
    extra: &str,
    batch: (usize, u64),
    columns: &str,
) -> String {
    format!(
        "[[pipelines]]\nname = \"{name}\"\ntable = \"{table}\"\nkey = [\"{key}\"]\n{extra}\n\
         batch_size = {}\nbatch_timeout_ms = {}\nbatch_min_wait_ms = {}\n\
         retry_ttls_ms = [1000]\n{}\n[pipelines.columns]\n{columns}\n",
        batch.0,
        batch.1,
        batch.1,
        n.toml()
    )
}

/// Writes `config` to a file and declares it (which must succeed): the file's folder (kept
/// while the test runs) and its path.
async fn declared(env: &TestEnv, config: String) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("pipelines.toml");
    std::fs::write(&path, config).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    (dir, file)
}

/// Writes `config` to a file, declares it (which must succeed) and starts `warren run` with it
/// and `roles`: the process, the file (kept while the test runs) and its logs shown on a panic.
async fn declared_and_started(
    env: &TestEnv,
    config: String,
    roles: &str,
) -> (Warren, tempfile::TempDir, LogsOnPanic) {
    let (dir, file) = declared(env, config).await;
    let warren = env.start(&["--config", &file, "--roles", roles]);
    let logs = LogsOnPanic(vec![warren.log.clone()]);
    (warren, dir, logs)
}

/// The (kind, reason) of every message parked under `pipeline` with id `message_id`.
async fn parked(env: &TestEnv, pipeline: &str, message_id: &str) -> Vec<(String, String)> {
    env.db
        .query(
            "SELECT error_kind, error_reason FROM dead_letters \
             WHERE pipeline = $1 AND message_id = $2",
            &[&pipeline, &message_id],
        )
        .await
        .expect("read dead_letters")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Whether `condition` held within `timeout` (for a failure that shows what was there).
async fn waited<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if condition().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    condition().await
}

fn with_id(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.into())
}

/// Item 1: `trunc(id int8 primary key, name varchar(3))`, keep: `{"id":1,"name":"abc"}` then
/// `{"id":1,"name":"abcdef"}`. The insert refuses the second (22001); it used to be compared
/// with the stored row through `CAST(v AS varchar(3))`, which truncates, found equal, acked as
/// "already stored as it is", and lost. The same with the key itself (`code varchar(3)`).
/// Each must end parked once (a conflict or a refusal), the stored rows untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_value_the_column_cannot_hold_is_never_taken_for_the_stored_row() {
    let mut env = TestEnv::new("val_trunc").await;
    env.set("DB_RETRY_WINDOW_MS", "200");
    let a = Names::of(&env, "trunc");
    let b = Names::of(&env, "trunck");
    let _ca = a.cleanup();
    let _cb = b.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE trunc (id int8 PRIMARY KEY, name varchar(3));
             CREATE TABLE trunck (code varchar(3) PRIMARY KEY, v int8)",
        )
        .await
        .expect("create the tables");
    let config = entry(
        &a,
        "trunc",
        "trunc",
        "id",
        "",
        (10, 50),
        "id = { path = \"/id\", type = \"int8\" }\nname = { path = \"/name\", type = \"text\" }",
    ) + &entry(
        &b,
        "trunck",
        "trunck",
        "code",
        "",
        (10, 50),
        "code = { path = \"/code\", type = \"text\" }\nv = { path = \"/v\", type = \"int8\" }",
    );
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq").await;

    env.publish_to(
        &a.exchange,
        &a.queue,
        br#"{"id":1,"name":"abc"}"#,
        with_id("t-1"),
    )
    .await;
    env.publish_to(
        &b.exchange,
        &b.queue,
        br#"{"code":"abc","v":1}"#,
        with_id("k-1"),
    )
    .await;
    wait_until(
        "both first rows stored",
        Duration::from_secs(30),
        || async {
            count_of(
                &env,
                "SELECT count(*) FROM trunc WHERE id = 1 AND name = 'abc'",
            )
            .await
                == 1
                && count_of(
                    &env,
                    "SELECT count(*) FROM trunck WHERE code = 'abc' AND v = 1",
                )
                .await
                    == 1
        },
    )
    .await;
    env.publish_to(
        &a.exchange,
        &a.queue,
        br#"{"id":1,"name":"abcdef"}"#,
        with_id("t-2"),
    )
    .await;
    env.publish_to(
        &b.exchange,
        &b.queue,
        br#"{"code":"abcdef","v":1}"#,
        with_id("k-2"),
    )
    .await;
    wait_until(
        "both longer values parked",
        Duration::from_secs(60),
        || async {
            !parked(&env, "trunc", "t-2").await.is_empty()
                && !parked(&env, "trunck", "k-2").await.is_empty()
        },
    )
    .await;
    for (pipeline, id) in [("trunc", "t-2"), ("trunck", "k-2")] {
        let fates = parked(&env, pipeline, id).await;
        assert_eq!(fates.len(), 1, "{pipeline} {id} parked once: {fates:?}");
        let (kind, reason) = &fates[0];
        assert!(
            kind == "db_permanent" || kind == "id_conflict",
            "{pipeline} {id}: {kind} {reason}"
        );
    }
    let rows: Vec<(i64, String)> = env
        .db
        .query("SELECT id, name FROM trunc", &[])
        .await
        .expect("trunc")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![(1, "abc".to_string())]);
    let keys: Vec<String> = env
        .db
        .query("SELECT code FROM trunck", &[])
        .await
        .expect("trunck")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys, vec!["abc".to_string()]);
    for q in [&a.queue, &a.dlq, &b.queue, &b.dlq] {
        assert_queue_empty(&env, q).await;
    }
}

/// Item 5: `ci(email citext primary key, v int8)`, update: `User0@x.com` v1 and `user0@x.com`
/// v2 in one batch are one key to PostgreSQL. The `DISTINCT ON` of the batch ran on the text
/// parameters, kept both, and PostgreSQL answered 21000 (`ON CONFLICT DO UPDATE command cannot
/// affect row a second time`), classed transient: retried in place, then split. Now the batch
/// commits in one go with the highest version, and no transient error is logged.
#[tokio::test(flavor = "multi_thread")]
async fn records_of_one_key_under_the_columns_type_are_one_key_in_one_statement() {
    let mut env = TestEnv::new("val_citext").await;
    env.set("DB_RETRY_WINDOW_MS", "3000");
    let n = Names::of(&env, "ci");
    let _c = n.cleanup();
    env.db
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public;
             CREATE TABLE ci (email public.citext PRIMARY KEY, v int8)",
        )
        .await
        .expect("create ci");
    let config = entry(
        &n,
        "ci",
        "ci",
        "email",
        "on_conflict = \"update\"\nversion_column = \"v\"",
        (4, 2000),
        "email = { path = \"/email\", type = \"text\" }\nv = { path = \"/v\", type = \"int8\" }",
    );
    let (warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq").await;

    // Four in one batch (batch size 4): two keys, each in two spellings.
    for (i, body) in [
        r#"{"email":"User0@x.com","v":1}"#,
        r#"{"email":"user0@x.com","v":2}"#,
        r#"{"email":"OTHER@x.com","v":7}"#,
        r#"{"email":"other@X.com","v":3}"#,
    ]
    .iter()
    .enumerate()
    {
        env.publish_to(
            &n.exchange,
            &n.queue,
            body.as_bytes(),
            with_id(&format!("c-{i}")),
        )
        .await;
    }
    let rows = || async {
        env.db
            .query("SELECT email::text, v FROM ci ORDER BY v", &[])
            .await
            .expect("read ci")
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .collect::<Vec<_>>()
    };
    let expected = vec![
        ("user0@x.com".to_string(), 2),
        ("OTHER@x.com".to_string(), 7),
    ];
    let seen = waited(Duration::from_secs(30), || async {
        rows().await == expected
    })
    .await;
    assert!(
        seen,
        "one row per key at its highest version and spelling {expected:?}; the table holds {:?}\n{}",
        rows().await,
        tail(&warren.logs(), 30)
    );
    assert_queue_empty(&env, &n.queue).await;
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM dead_letters WHERE pipeline = 'ci'"
        )
        .await,
        0
    );
    let logs = warren.logs();
    assert!(
        !logs.contains("transient database error") && !logs.contains("batch split"),
        "the batch was retried or split:\n{}",
        tail(&logs, 40)
    );
}

/// Columns of the types teams use beyond the mapping's own (int2, float4, timestamp, an enum):
/// each takes a value by PostgreSQL's assignment rules, and what does not fit (a 40000 into an
/// int2, a label the enum does not have) is that message's refusal alone, parked once.
#[tokio::test(flavor = "multi_thread")]
async fn narrower_columns_and_enums_take_what_postgresql_takes() {
    let mut env = TestEnv::new("val_kinds").await;
    env.set("DB_RETRY_WINDOW_MS", "200");
    let n = Names::of(&env, "kinds");
    let _c = n.cleanup();
    env.db
        .batch_execute(
            "CREATE TYPE mood AS ENUM ('calm', 'busy');
             CREATE TABLE kinds (id int8 PRIMARY KEY, mood mood NOT NULL, small int2,
                                 f float4, ts timestamp)",
        )
        .await
        .expect("create kinds");
    let config = entry(
        &n,
        "kinds",
        "kinds",
        "id",
        "",
        (10, 50),
        "id = { path = \"/id\", type = \"int8\" }\n\
         mood = { path = \"/mood\", type = \"text\" }\n\
         small = { path = \"/small\", type = \"int4\" }\n\
         f = { path = \"/f\", type = \"float8\" }\n\
         ts = { path = \"/ts\", type = \"timestamptz\" }",
    );
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq").await;
    let good = r#"{"id":1,"mood":"busy","small":-32768,"f":1.5,"ts":"2026-11-24T10:00:00+02:00"}"#;
    let bad_label = r#"{"id":2,"mood":"angry","small":1,"f":1,"ts":"2026-11-24T10:00:00Z"}"#;
    let bad_small = r#"{"id":3,"mood":"calm","small":40000,"f":1,"ts":"2026-11-24T10:00:00Z"}"#;
    let bad_float = r#"{"id":4,"mood":"calm","small":1,"f":1e300,"ts":"2026-11-24T10:00:00Z"}"#;
    for (id, body) in [
        ("k-1", good),
        ("k-2", bad_label),
        ("k-3", bad_small),
        ("k-4", bad_float),
    ] {
        env.publish_to(&n.exchange, &n.queue, body.as_bytes(), with_id(id))
            .await;
    }
    wait_until("three refusals parked", Duration::from_secs(60), || async {
        count_of(
            &env,
            "SELECT count(*) FROM dead_letters WHERE pipeline = 'kinds'",
        )
        .await
            >= 3
    })
    .await;
    let rows: Vec<(i64, String, i16, f32, String)> = env
        .db
        .query(
            "SELECT id, mood::text, small, f, ts::text FROM kinds ORDER BY id",
            &[],
        )
        .await
        .expect("kinds")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        rows,
        vec![(1, "busy".into(), -32768, 1.5, "2026-11-24 08:00:00".into())],
        "the good message, its instant as UTC wall time"
    );
    for (id, sqlstate) in [("k-2", "22P02"), ("k-3", "22003"), ("k-4", "22003")] {
        let fates = parked(&env, "kinds", id).await;
        assert_eq!(fates.len(), 1, "{id} parked once: {fates:?}");
        assert_eq!(fates[0].0, "db_permanent", "{id}: {fates:?}");
        assert!(fates[0].1.contains(sqlstate), "{id}: {fates:?}");
    }
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM dead_letters WHERE pipeline = 'kinds'"
        )
        .await,
        3
    );
}

/// Two contents of one new key in one batch (`keep`): the first delivered is stored and the
/// second is `id_conflict`, as if they had come one at a time (the insert's order within a key
/// follows the delivery order; a sort alone leaves ties in any order).
#[tokio::test(flavor = "multi_thread")]
async fn of_two_contents_of_one_key_in_a_batch_the_first_delivered_is_kept() {
    let mut env = TestEnv::new("val_order").await;
    env.set("DB_RETRY_WINDOW_MS", "200");
    let n = Names::of(&env, "ord");
    let _c = n.cleanup();
    env.db
        .batch_execute("CREATE TABLE ord (id int8 PRIMARY KEY, name text NOT NULL)")
        .await
        .expect("create ord");
    let config = entry(
        &n,
        "ord",
        "ord",
        "id",
        "proc_concurrency = 1",
        (400, 3000),
        "id = { path = \"/id\", type = \"int8\" }\nname = { path = \"/name\", type = \"text\" }",
    );
    let (_dir, file) = declared(&env, config).await;
    // Published before warren starts, so they arrive in one batch of 400.
    for round in ["first", "second"] {
        for id in 0..200 {
            let body = format!(r#"{{"id":{id},"name":"{round}-{id}"}}"#);
            env.publish_to(
                &n.exchange,
                &n.queue,
                body.as_bytes(),
                with_id(&format!("{round}-{id}")),
            )
            .await;
        }
    }
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "200 rows and 200 parked",
        Duration::from_secs(60),
        || async {
            count_of(&env, "SELECT count(*) FROM ord").await == 200
                && count_of(
                    &env,
                    "SELECT count(*) FROM dead_letters WHERE pipeline = 'ord'",
                )
                .await
                    == 200
        },
    )
    .await;
    let wrong: Vec<String> = env
        .db
        .query("SELECT name FROM ord WHERE name NOT LIKE 'first-%'", &[])
        .await
        .expect("ord")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        wrong.is_empty(),
        "rows of the second delivery kept: {wrong:?}"
    );
    let parked: Vec<String> = env
        .db
        .query(
            "SELECT message_id FROM dead_letters WHERE pipeline = 'ord' \
             AND (error_kind <> 'id_conflict' OR message_id NOT LIKE 'second-%')",
            &[],
        )
        .await
        .expect("dead_letters")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        parked.is_empty(),
        "parked other than the second deliveries as id_conflict: {parked:?}"
    );
}

/// The API of a pipeline asks PostgreSQL as its pipeline does: a `POST` of a value the table
/// cannot hold is refused (422, `db_permanent`, the database's words) and nothing is published,
/// never 200 then parked; `GET` of a key its column cannot hold finds no row (400), never the
/// row whose key a cast would truncate it to; a `citext` key is found in any case.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_asks_postgresql_what_the_table_can_hold() {
    let env = TestEnv::new("val_api").await;
    let a = Names::of(&env, "trunck");
    let b = Names::of(&env, "cik");
    let _ca = a.cleanup();
    let _cb = b.cleanup();
    env.db
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public;
             CREATE TABLE trunck (code varchar(3) PRIMARY KEY, v int2);
             CREATE TABLE cik (email public.citext PRIMARY KEY, v int8)",
        )
        .await
        .expect("create the tables");
    let config = entry(
        &a,
        "trunck",
        "trunck",
        "code",
        "api = true",
        (10, 20),
        "code = { path = \"/code\", type = \"text\" }\nv = { path = \"/v\", type = \"int4\" }",
    ) + &entry(
        &b,
        "cik",
        "cik",
        "email",
        "api = true",
        (10, 20),
        "email = { path = \"/email\", type = \"text\" }\nv = { path = \"/v\", type = \"int8\" }",
    );
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq,api").await;
    wait_ready(&env, Duration::from_secs(30)).await;

    let answer = |method: &'static str, path: String, body: Option<&'static str>| {
        let env = &env;
        async move {
            http(env, method, &path, body)
                .await
                .unwrap_or_else(|| panic!("{method} {path}: no answer"))
        }
    };
    let (status, body) = answer(
        "POST",
        "/api/v1/trunck".into(),
        Some(r#"{"code":"abc","v":1}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for (body, words) in [
        (r#"{"code":"abcdef","v":1}"#, "22001"),
        (r#"{"code":"xyz","v":40000}"#, "22003"),
    ] {
        let (status, answer) = answer("POST", "/api/v1/trunck".into(), Some(body)).await;
        assert_eq!(status, 422, "{body}: {answer}");
        assert!(
            answer.contains("db_permanent") && answer.contains(words),
            "{body}: {answer}"
        );
    }
    // The sentinel after the refusals: once it is stored, nothing before it is still on its way.
    let (status, body) = answer(
        "POST",
        "/api/v1/trunck".into(),
        Some(r#"{"code":"end","v":2}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    wait_until("the sentinel stored", Duration::from_secs(30), || async {
        count_of(&env, "SELECT count(*) FROM trunck WHERE code = 'end'").await == 1
    })
    .await;
    wait_queues_settled(&[&a.queue, &a.dlq], Duration::from_secs(30)).await;
    let codes: Vec<String> = env
        .db
        .query("SELECT code FROM trunck ORDER BY code", &[])
        .await
        .expect("trunck")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(codes, vec!["abc", "end"]);
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM dead_letters").await,
        0,
        "nothing refused was published"
    );
    let (status, body) = answer("GET", "/api/v1/trunck/abc".into(), None).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = answer("GET", "/api/v1/trunck/abcdef".into(), None).await;
    assert_eq!(
        status, 400,
        "a key no varchar(3) holds is not abc's: {body}"
    );
    assert!(!body.contains("\"v\""), "{body}");

    let (status, body) = answer(
        "POST",
        "/api/v1/cik".into(),
        Some(r#"{"email":"Ana@Example.com","v":1}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    wait_until("Ana stored", Duration::from_secs(30), || async {
        count_of(&env, "SELECT count(*) FROM cik").await == 1
    })
    .await;
    let (status, body) = answer("GET", "/api/v1/cik/ana@example.COM".into(), None).await;
    assert_eq!(status, 200, "a citext key in any case: {body}");
    assert!(body.contains("Ana@Example.com"), "{body}");
}

/// Found by the review: `keep`, keys equal only under the column's type in one batch (citext,
/// char(n)): the batch was inserted in the order of the keys as text (`ZED@X` < `zed@x`), so
/// the later message was stored and the first parked as `id_conflict`, and an exact copy of the
/// first was parked with it. Now the first delivered is stored, its copy is a copy, and only
/// other content under the key is `id_conflict`.
#[tokio::test(flavor = "multi_thread")]
async fn keep_stores_the_first_of_keys_equal_under_the_columns_type() {
    let env = TestEnv::new("val_keepci").await;
    let a = Names::of(&env, "ct");
    let b = Names::of(&env, "cht");
    let _ca = a.cleanup();
    let _cb = b.cleanup();
    env.db
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public;
             CREATE TABLE ct (e public.citext PRIMARY KEY, v text);
             CREATE TABLE cht (k char(3) PRIMARY KEY, v text)",
        )
        .await
        .expect("create the tables");
    let config = entry(
        &a,
        "ct",
        "ct",
        "e",
        "proc_concurrency = 1",
        (50, 1000),
        "e = { path = \"/e\", type = \"text\" }\nv = { path = \"/v\", type = \"text\" }",
    ) + &entry(
        &b,
        "cht",
        "cht",
        "k",
        "proc_concurrency = 1",
        (50, 1000),
        "k = { path = \"/k\", type = \"text\" }\nv = { path = \"/v\", type = \"text\" }",
    );
    let (_dir, file) = declared(&env, config).await;
    // Published before warren starts: each pipeline's messages arrive in one batch.
    for (id, body) in [
        ("ord1", r#"{"e":"zed@x","v":"first"}"#),
        ("ord2", r#"{"e":"ZED@X","v":"second"}"#),
        ("ct01", r#"{"e":"Ana@x","v":"1"}"#),
        ("ct02", r#"{"e":"ana@x","v":"1"}"#),
        ("ct03", r#"{"e":"ANA@X","v":"2"}"#),
    ] {
        env.publish_to(&a.exchange, &a.queue, body.as_bytes(), with_id(id))
            .await;
    }
    for (id, body) in [
        ("ordc1", r#"{"k":"q  ","v":"first"}"#),
        ("ordc2", r#"{"k":"q","v":"second"}"#),
    ] {
        env.publish_to(&b.exchange, &b.queue, body.as_bytes(), with_id(id))
            .await;
    }
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("three parked", Duration::from_secs(60), || async {
        count_of(&env, "SELECT count(*) FROM dead_letters").await >= 3
    })
    .await;
    wait_queues_settled(
        &[&a.queue, &a.dlq, &b.queue, &b.dlq],
        Duration::from_secs(30),
    )
    .await;
    let rows = |sql: &'static str| {
        let env = &env;
        async move {
            env.db
                .query(sql, &[])
                .await
                .expect("read the table")
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        rows("SELECT e::text, v FROM ct ORDER BY v").await,
        vec![
            ("Ana@x".into(), "1".into()),
            ("zed@x".into(), "first".into())
        ]
    );
    assert_eq!(
        rows("SELECT k::text, v FROM cht").await,
        vec![("q".into(), "first".into())]
    );
    let parked = rows("SELECT message_id, error_kind FROM dead_letters ORDER BY message_id").await;
    assert_eq!(
        parked,
        vec![
            ("ct03".into(), "id_conflict".into()),
            ("ord2".into(), "id_conflict".into()),
            ("ordc2".into(), "id_conflict".into()),
        ]
    );
}

/// Found by the review: a BEFORE INSERT trigger that rewrites a value (`v := upper(v)`) made a
/// redelivered copy of a stored message `id_conflict`: the copy was compared as sent with the
/// row as the trigger wrote it, and the message ended in its table and parked. The copy is now
/// compared with what an insert of it would write, the table's triggers included. And the API's
/// `GET` of such a table, whose column is named `s` and NULL: the whole row (it answered the
/// column's value, or panicked on NULL).
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_is_a_copy_of_what_the_tables_triggers_wrote() {
    let env = TestEnv::new("val_trigger").await;
    let n = Names::of(&env, "trg");
    let _c = n.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE trg (k text PRIMARY KEY, v text, s text);
             CREATE FUNCTION trg_upper() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               NEW.v := upper(NEW.v); RETURN NEW; END $$;
             CREATE TRIGGER trg_upper BEFORE INSERT OR UPDATE ON trg
               FOR EACH ROW EXECUTE FUNCTION trg_upper()",
        )
        .await
        .expect("create trg");
    let config = entry(
        &n,
        "trg",
        "trg",
        "k",
        "api = true",
        (10, 50),
        "k = { path = \"/k\", type = \"text\" }\nv = { path = \"/v\", type = \"text\" }",
    );
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq,api").await;
    // The message, then a copy of it (a redelivery, a publisher's retry), then other content.
    for (id, body) in [
        ("t-1", r#"{"k":"a","v":"abc"}"#),
        ("t-2", r#"{"k":"a","v":"abc"}"#),
        ("t-3", r#"{"k":"a","v":"xyz"}"#),
    ] {
        env.publish_to(&n.exchange, &n.queue, body.as_bytes(), with_id(id))
            .await;
        wait_queues_settled(&[&n.queue], Duration::from_secs(30)).await;
    }
    wait_until(
        "the other content parked",
        Duration::from_secs(30),
        || async { !parked(&env, "trg", "t-3").await.is_empty() },
    )
    .await;
    wait_queues_settled(&[&n.queue, &n.dlq], Duration::from_secs(30)).await;
    assert!(
        parked(&env, "trg", "t-2").await.is_empty(),
        "the copy was parked"
    );
    assert_eq!(parked(&env, "trg", "t-3").await[0].0, "id_conflict");
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM dead_letters").await,
        1,
        "only the other content parked"
    );
    wait_ready(&env, Duration::from_secs(30)).await;
    let (status, body) = http(&env, "GET", "/api/v1/trg/a", None)
        .await
        .expect("GET answers");
    assert_eq!(status, 200, "{body}");
    let row: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(row, serde_json::json!({"k": "a", "v": "ABC", "s": null}));
}

/// Found by the second review: a BEFORE INSERT trigger that rewrites the key (`lower(k)`) made
/// every redelivered copy `db_permanent` (its key as sent holds nothing), so the message ended
/// in its table and parked; and a trigger that discards a row (returns NULL) made the message
/// acked and counted as inserted while no table held it. Now the copy is a copy, and the
/// discarded message is parked `db_permanent` saying why, once.
#[tokio::test(flavor = "multi_thread")]
async fn triggers_that_rewrite_the_key_or_discard_the_row_never_lose_or_double_a_message() {
    let env = TestEnv::new("val_trgkey").await;
    let a = Names::of(&env, "trgk");
    let b = Names::of(&env, "trgd");
    let _ca = a.cleanup();
    let _cb = b.cleanup();
    env.db
        .batch_execute(
            "CREATE TABLE trgk (k text PRIMARY KEY, v text);
             CREATE FUNCTION trgk_lower() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               NEW.k := lower(NEW.k); RETURN NEW; END $$;
             CREATE TRIGGER trgk_lower BEFORE INSERT ON trgk
               FOR EACH ROW EXECUTE FUNCTION trgk_lower();
             CREATE TABLE trgd (k text PRIMARY KEY, v text);
             CREATE FUNCTION trgd_drop() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               IF NEW.v = 'drop' THEN RETURN NULL; END IF; RETURN NEW; END $$;
             CREATE TRIGGER trgd_drop BEFORE INSERT ON trgd
               FOR EACH ROW EXECUTE FUNCTION trgd_drop()",
        )
        .await
        .expect("create the tables");
    let columns = "k = { path = \"/k\", type = \"text\" }\nv = { path = \"/v\", type = \"text\" }";
    let config = entry(&a, "trgk", "trgk", "k", "", (10, 50), columns)
        + &entry(&b, "trgd", "trgd", "k", "", (10, 50), columns);
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq").await;
    for (id, body) in [
        ("k-1", r#"{"k":"KK","v":"abc"}"#),
        ("k-2", r#"{"k":"KK","v":"abc"}"#),
    ] {
        env.publish_to(&a.exchange, &a.queue, body.as_bytes(), with_id(id))
            .await;
        wait_queues_settled(&[&a.queue], Duration::from_secs(30)).await;
    }
    for (id, body) in [
        ("d-1", r#"{"k":"n1","v":"ok"}"#),
        ("d-2", r#"{"k":"n2","v":"drop"}"#),
        ("d-3", r#"{"k":"n3","v":"ok"}"#),
    ] {
        env.publish_to(&b.exchange, &b.queue, body.as_bytes(), with_id(id))
            .await;
    }
    wait_until(
        "the discarded message parked",
        Duration::from_secs(30),
        || async { !parked(&env, "trgd", "d-2").await.is_empty() },
    )
    .await;
    wait_queues_settled(
        &[&a.queue, &a.dlq, &b.queue, &b.dlq],
        Duration::from_secs(30),
    )
    .await;
    assert!(
        parked(&env, "trgk", "k-2").await.is_empty(),
        "the copy was parked"
    );
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM trgk WHERE k = 'kk'").await,
        1
    );
    let fates = parked(&env, "trgd", "d-2").await;
    assert_eq!(fates.len(), 1, "{fates:?}");
    assert_eq!(fates[0].0, "db_permanent", "{fates:?}");
    assert!(fates[0].1.contains("discarded"), "{fates:?}");
    assert_eq!(count_of(&env, "SELECT count(*) FROM trgd").await, 2);
    assert_eq!(count_of(&env, "SELECT count(*) FROM dead_letters").await, 1);
}

/// Found by the second review: a key in the API's path that is not UTF-8 (`%FF`) was decoded
/// to U+FFFD, and GET answered the row of that other key. It is a 400 now.
#[tokio::test(flavor = "multi_thread")]
async fn a_path_key_that_is_not_utf8_is_a_400_not_another_row() {
    let env = TestEnv::new("val_pathkey").await;
    let n = Names::of(&env, "pk");
    let _c = n.cleanup();
    env.db
        .batch_execute("CREATE TABLE pk (k text PRIMARY KEY, v text)")
        .await
        .expect("create pk");
    let config = entry(
        &n,
        "pk",
        "pk",
        "k",
        "api = true",
        (10, 20),
        "k = { path = \"/k\", type = \"text\" }\nv = { path = \"/v\", type = \"text\" }",
    );
    let (_warren, _file, _logs) = declared_and_started(&env, config, "consumer,dlq,api").await;
    wait_ready(&env, Duration::from_secs(30)).await;
    let (status, body) = http(
        &env,
        "POST",
        "/api/v1/pk",
        Some("{\"k\":\"\u{fffd}\",\"v\":\"r\"}"),
    )
    .await
    .expect("POST answers");
    assert_eq!(status, 200, "{body}");
    wait_until("the row stored", Duration::from_secs(30), || async {
        count_of(&env, "SELECT count(*) FROM pk").await == 1
    })
    .await;
    for path in ["/api/v1/pk/%FF", "/api/v1/pk/%C3"] {
        let (status, body) = http(&env, "GET", path, None).await.expect("GET answers");
        assert_eq!(status, 400, "{path}: {body}");
    }
    let (status, body) = http(&env, "GET", "/api/v1/pk/%EF%BF%BD", None)
        .await
        .expect("GET answers");
    assert_eq!(
        status, 200,
        "the key U+FFFD written as UTF-8 is found: {body}"
    );
}
