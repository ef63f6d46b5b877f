//! `warren dlq`: `inspect` shows the DLQ and leaves it as it was; `replay` moves dead letters
//! back to the main exchange (x-retries 0, x-error-* gone, each republish confirmed before the
//! DLQ copy is acked), all or one `--kind`, including the `broker_*` kinds of messages the broker
//! dead-lettered itself; `parked list` / `parked replay` work on the `dead_letters` table (the
//! parked headers go out again; a re-park racing a replay waits and re-opens its row); bad
//! arguments are refused with a clear message.

mod common;

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_postgres::NoTls;
use uuid::Uuid;

/// Properties of a dead letter as warren's router writes them.
fn dead_props(id: Uuid, kind: &str, retries: i64) -> BasicProperties {
    dead_letter_props(&id.to_string(), kind, retries, &format!("{kind}: test"))
}

/// Puts a valid user in the DLQ as `kind` and returns its id.
async fn put_dead_user(env: &TestEnv, kind: &str) -> Uuid {
    let id = Uuid::new_v4();
    env.publish_to_dlq(&user_body(id), dead_props(id, kind, 3))
        .await;
    id
}

/// Puts a body that is not JSON in the DLQ as `invalid_json` and returns its id.
async fn put_dead_garbage(env: &TestEnv) -> Uuid {
    let id = Uuid::new_v4();
    env.publish_to_dlq(
        format!("not json {id}").as_bytes(),
        dead_props(id, "invalid_json", 0),
    )
    .await;
    id
}

/// Unbinds the main queue from the main exchange: a replay to it is unroutable.
async fn unbind_main_queue(env: &TestEnv) {
    env.channel
        .queue_unbind(
            env.main_queue.as_str().into(),
            env.main_exchange.as_str().into(),
            env.main_queue.as_str().into(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the main queue");
}

/// Runs `warren dlq ...` and asserts exit code `code`: (stdout, stderr).
fn dlq(env: &TestEnv, args: &[&str], code: i32) -> (String, String) {
    let mut full = vec!["dlq"];
    full.extend_from_slice(args);
    let (got, out, err) = env.run(&full);
    assert_eq!(got, code, "warren {full:?}: exit {got}\n{out}\n{err}");
    (out, err)
}

/// Waits until `queue` holds `n` ready messages.
async fn wait_depth(env: &TestEnv, queue: &str, n: u32) {
    wait_until(
        &format!("{n} messages in {queue}"),
        Duration::from_secs(10),
        || async { env.queue_state(queue).await.0 == n },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_of_100_dead_letters_lets_the_pipeline_insert_them() {
    let env = TestEnv::new("dlqt_replay100").await;
    env.declare();
    let mut ids = HashSet::new();
    for _ in 0..100 {
        ids.insert(put_dead_user(&env, "retries_exhausted").await);
    }
    wait_depth(&env, &env.dlq_queue, 100).await;

    let (out, _) = dlq(&env, &["replay"], 0);
    assert!(out.contains("replayed 100 messages"), "{out}");
    assert!(out.contains("skipped 0"), "{out}");
    assert!(out.contains("failed 0"), "{out}");
    wait_depth(&env, &env.main_queue, 100).await;
    assert_queue_empty(&env, &env.dlq_queue).await;

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("100 rows", Duration::from_secs(30), || async {
        env.count_rows().await >= 100
    })
    .await;
    wait_until("the main queue empty", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_eq!(env.row_ids().await, ids, "log:\n{}", warren.logs());
    // x-retries was reset: nothing came back as retries_exhausted.
    assert_queue_empty(&env, &env.dlq_queue).await;
    assert_queue_empty(&env, &env.retry_queue).await;
    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_the_dlq_and_leaves_it_unchanged() {
    let env = TestEnv::new("dlqt_inspect").await;
    env.declare();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut ids = Vec::new();
    // Two minutes old, with a timestamp.
    let old = Uuid::new_v4();
    env.publish_to_dlq(
        &user_body(old),
        dead_props(old, "db_permanent", 0).with_timestamp(now - 125),
    )
    .await;
    ids.push(old);
    for _ in 0..3 {
        ids.push(put_dead_user(&env, "retries_exhausted").await);
    }
    ids.push(put_dead_garbage(&env).await);
    wait_depth(&env, &env.dlq_queue, 5).await;

    let (out, _) = dlq(&env, &["inspect"], 0);
    assert!(
        out.contains(&format!("dlq {}: 5 messages, 5 shown", env.dlq_queue)),
        "{out}"
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[1].starts_with("MESSAGE ID") && lines[1].contains("KIND"),
        "{out}"
    );
    for id in &ids {
        assert!(out.contains(&id.to_string()), "{id} missing:\n{out}");
    }
    let old_line = lines.iter().find(|l| l.contains(&old.to_string())).unwrap();
    assert!(
        old_line.contains("db_permanent") && old_line.contains(" 2m"),
        "{old_line}"
    );
    assert!(out.contains("retries_exhausted: test"), "{out}");
    // Columns are aligned: KIND starts at the same offset on every line.
    let at = lines[1].find("KIND").unwrap();
    for line in &lines[2..] {
        assert_ne!(line.as_bytes()[at], b' ', "{out}");
        assert_eq!(line.as_bytes()[at - 1], b' ', "{out}");
    }

    // Unchanged: the same count right away, and after --limit and --json runs.
    wait_depth(&env, &env.dlq_queue, 5).await;
    let (out, _) = dlq(&env, &["inspect", "--limit", "2"], 0);
    assert!(out.contains("5 messages, 2 shown"), "{out}");
    assert_eq!(out.lines().count(), 4, "{out}");
    let (out, err) = dlq(&env, &["inspect", "--json"], 0);
    assert!(err.contains("5 messages"), "{err}");
    let objects: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(objects.len(), 5, "{out}");
    let old_json = objects
        .iter()
        .find(|o| o["message_id"] == old.to_string())
        .unwrap();
    assert_eq!(old_json["kind"], "db_permanent");
    assert!(old_json["age_s"].as_u64().unwrap() >= 125, "{old_json}");
    let other = objects
        .iter()
        .find(|o| o["kind"] == "retries_exhausted")
        .unwrap();
    assert_eq!(other["retries"], 3);
    assert!(other["age_s"].is_null(), "{other}");

    wait_depth(&env, &env.dlq_queue, 5).await;
    let left = env.drain_queue(&env.dlq_queue, 100).await;
    let left: HashSet<String> = left.iter().map(message_id).collect();
    assert_eq!(left, ids.iter().map(Uuid::to_string).collect());
    assert_queue_empty(&env, &env.main_queue).await;

    // An empty DLQ is a short report.
    let (out, _) = dlq(&env, &["inspect"], 0);
    assert_eq!(
        out.trim(),
        format!(
            "dlq {}: 0 messages, 0 shown, all left in the queue",
            env.dlq_queue
        )
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_of_one_kind_moves_only_those_with_clean_headers() {
    let env = TestEnv::new("dlqt_kind").await;
    env.declare();
    let mut garbage = HashSet::new();
    let mut users = HashSet::new();
    for i in 0..6 {
        if i % 2 == 0 {
            garbage.insert(put_dead_garbage(&env).await.to_string());
        } else {
            users.insert(put_dead_user(&env, "retries_exhausted").await.to_string());
        }
    }
    // A traced header that must survive the replay.
    let traced = Uuid::new_v4();
    env.publish_to_dlq(
        format!("not json {traced}").as_bytes(),
        with_header(
            dead_props(traced, "invalid_json", 2).with_timestamp(1_700_000_000),
            "trace",
            long_string("abc"),
        ),
    )
    .await;
    garbage.insert(traced.to_string());
    wait_depth(&env, &env.dlq_queue, 7).await;

    let (out, _) = dlq(&env, &["replay", "--kind", "invalid_json"], 0);
    assert!(
        out.contains("replayed 4 messages of kind invalid_json"),
        "{out}"
    );
    assert!(out.contains("skipped 3"), "{out}");
    wait_depth(&env, &env.dlq_queue, 3).await;
    wait_depth(&env, &env.main_queue, 4).await;

    let moved = env.drain_queue(&env.main_queue, 100).await;
    assert_eq!(
        moved.iter().map(message_id).collect::<HashSet<_>>(),
        garbage
    );
    for m in &moved {
        assert_eq!(
            header(&m.properties, "x-retries"),
            Some(&AMQPValue::LongLongInt(0))
        );
        assert_eq!(header(&m.properties, "x-error-kind"), None);
        assert_eq!(header(&m.properties, "x-error-reason"), None);
        let body = String::from_utf8_lossy(&m.data).into_owned();
        assert_eq!(body, format!("not json {}", message_id(m)));
        assert_eq!(*m.properties.delivery_mode(), Some(2));
        assert_eq!(
            m.properties.content_type().as_ref().map(|c| c.as_str()),
            Some("application/json")
        );
        if message_id(m) == traced.to_string() {
            assert_eq!(header(&m.properties, "trace"), Some(&long_string("abc")));
            assert_eq!(*m.properties.timestamp(), Some(1_700_000_000));
        }
    }

    // --limit stops early; the rest stays.
    let (out, _) = dlq(&env, &["replay", "--limit", "1"], 0);
    assert!(out.contains("replayed 1 message "), "{out}");
    wait_depth(&env, &env.dlq_queue, 2).await;
    wait_depth(&env, &env.main_queue, 1).await;
    let mut seen: HashSet<String> = env
        .drain_queue(&env.dlq_queue, 100)
        .await
        .iter()
        .map(message_id)
        .collect();
    seen.extend(
        env.drain_queue(&env.main_queue, 100)
            .await
            .iter()
            .map(message_id),
    );
    assert_eq!(seen, users);

    // Nothing of that kind: everything is skipped and stays.
    let id = put_dead_user(&env, "db_permanent").await;
    let (out, _) = dlq(&env, &["replay", "--kind", "invalid_payload"], 0);
    assert!(out.contains("replayed 0 messages"), "{out}");
    assert!(out.contains("skipped 1"), "{out}");
    wait_depth(&env, &env.dlq_queue, 1).await;
    let left = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(message_id(&left[0]), id.to_string());
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_the_broker_dead_lettered_have_a_broker_kind_and_replay_selects_it() {
    let env = TestEnv::new("dlqt_broker_kind").await;
    env.declare();
    let rejected = put_rejected_by_broker(&env).await;
    wait_depth(&env, &env.dlq_queue, 1).await;
    let expired = put_expired_by_broker(&env).await;
    wait_depth(&env, &env.dlq_queue, 2).await;
    let ours = put_dead_user(&env, "db_permanent").await;
    wait_depth(&env, &env.dlq_queue, 3).await;

    let (out, _) = dlq(&env, &["inspect", "--json"], 0);
    let objects: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let kind_of = |id: Uuid| {
        objects
            .iter()
            .find(|o| o["message_id"] == id.to_string())
            .unwrap_or_else(|| panic!("{id} not shown:\n{out}"))
    };
    assert_eq!(kind_of(rejected)["kind"], "broker_rejected", "{out}");
    assert_eq!(
        kind_of(rejected)["reason"],
        format!(
            "dead-lettered by the broker (rejected) in queue {}",
            env.main_queue
        ),
        "{out}"
    );
    assert_eq!(kind_of(expired)["kind"], "broker_expired", "{out}");
    assert_eq!(kind_of(ours)["kind"], "db_permanent", "{out}");
    let (table, _) = dlq(&env, &["inspect"], 0);
    let line = table
        .lines()
        .find(|l| l.contains(&rejected.to_string()))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(line.contains("broker_rejected"), "{table}");

    wait_depth(&env, &env.dlq_queue, 3).await;
    let (out, _) = dlq(&env, &["replay", "--kind", "broker_rejected"], 0);
    assert!(
        out.contains("replayed 1 message of kind broker_rejected"),
        "{out}"
    );
    assert!(out.contains("skipped 2"), "{out}");
    wait_depth(&env, &env.main_queue, 1).await;
    wait_depth(&env, &env.dlq_queue, 2).await;
    let moved = env.drain_queue(&env.main_queue, 10).await;
    assert_eq!(moved.len(), 1);
    assert_eq!(message_id(&moved[0]), rejected.to_string());
    assert_eq!(moved[0].data, user_body(rejected), "body kept");
    assert_eq!(
        header(&moved[0].properties, "x-retries"),
        Some(&AMQPValue::LongLongInt(0))
    );
    // The other kinds stayed in the DLQ, untouched.
    let left = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(
        left.iter().map(message_id).collect::<HashSet<_>>(),
        [expired, ours].iter().map(Uuid::to_string).collect()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_that_cannot_be_routed_leaves_the_dlq_intact_and_exits_1() {
    let env = TestEnv::new("dlqt_unroutable").await;
    env.declare();
    let mut ids = HashSet::new();
    for _ in 0..3 {
        ids.insert(put_dead_user(&env, "retries_exhausted").await.to_string());
    }
    wait_depth(&env, &env.dlq_queue, 3).await;
    unbind_main_queue(&env).await;

    let (out, err) = dlq(&env, &["replay"], 1);
    assert!(out.contains("replayed 0 messages"), "{out}");
    assert!(out.contains("failed 1"), "{out}");
    assert!(err.contains("unroutable"), "{err}");
    assert!(err.contains("stays in the DLQ"), "{err}");
    wait_depth(&env, &env.dlq_queue, 3).await;
    let left = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(left.iter().map(message_id).collect::<HashSet<_>>(), ids);
    // Still dead letters, headers untouched.
    for m in &left {
        assert_eq!(
            header(&m.properties, "x-error-kind"),
            Some(&long_string("retries_exhausted"))
        );
        assert_eq!(
            header(&m.properties, "x-retries"),
            Some(&AMQPValue::LongLongInt(3))
        );
    }
}

/// Puts a valid user in the DLQ the way the broker does it: published to the main queue, taken
/// and rejected without requeue, so the main queue's DLX dead-letters it with `x-death`
/// (reason `rejected`) and no `x-error-kind`. Returns its id.
async fn put_rejected_by_broker(env: &TestEnv) -> Uuid {
    let id = Uuid::new_v4();
    env.publish_raw(&user_body(id), json_props(id)).await;
    let ch = env.conn.create_channel().await.expect("channel");
    let m = ch
        .basic_get(
            env.main_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .expect("basic.get")
        .expect("the message in the main queue");
    assert_eq!(message_id(&m), id.to_string());
    m.acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .expect("reject");
    let _ = ch.close(200, "bye".into()).await;
    id
}

/// Puts a valid user in the DLQ through an expired per-message TTL in the main queue (x-death
/// reason `expired`). Returns its id.
async fn put_expired_by_broker(env: &TestEnv) -> Uuid {
    let id = Uuid::new_v4();
    env.publish_raw(&user_body(id), json_props(id).with_expiration("1".into()))
        .await;
    id
}

/// Inserts one parked row into the env's `dead_letters`; returns its seq.
async fn park(env: &TestEnv, id: Option<Uuid>, body: &[u8], kind: &str) -> i64 {
    park_with_headers(
        env,
        id,
        body,
        kind,
        serde_json::json!({"x-error-kind": kind}),
    )
    .await
}

/// [`park`] with the row's `headers` column given.
async fn park_with_headers(
    env: &TestEnv,
    id: Option<Uuid>,
    body: &[u8],
    kind: &str,
    headers: serde_json::Value,
) -> i64 {
    env.db
        .query_one(
            &format!(
                "INSERT INTO {}.dead_letters (message_id, body, headers, error_kind, error_reason) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING seq",
                env.schema
            ),
            &[
                &id.map(|i| i.to_string()),
                &body,
                &headers,
                &kind,
                &format!("{kind}: parked by the test"),
            ],
        )
        .await
        .expect("insert a parked row")
        .get(0)
}

async fn replayed_at_set(env: &TestEnv, seq: i64) -> bool {
    env.db
        .query_one(
            &format!(
                "SELECT replayed_at IS NOT NULL FROM {}.dead_letters WHERE seq = $1",
                env.schema
            ),
            &[&seq],
        )
        .await
        .expect("select replayed_at")
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn parked_rows_are_listed_and_replayed_into_rows() {
    let env = TestEnv::new("dlqt_parked").await;
    env.declare();
    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    let c = Uuid::new_v4();
    let g = Uuid::new_v4();
    let done = Uuid::new_v4();
    let seq_a = park(&env, Some(a), &user_body(a), "db_permanent").await;
    let seq_g = park(&env, Some(g), b"not json \x01\n at all", "invalid_json").await;
    let seq_b = park(&env, Some(b), &user_body(b), "db_permanent").await;
    let seq_c = park(&env, None, &user_body(c), "invalid_payload").await;
    let seq_done = park(&env, Some(done), &user_body(done), "db_permanent").await;
    env.db
        .execute(
            &format!(
                "UPDATE {}.dead_letters SET replayed_at = now() WHERE seq = $1",
                env.schema
            ),
            &[&seq_done],
        )
        .await
        .unwrap();

    // The list: not-replayed rows only, newest first.
    let (out, _) = dlq(&env, &["parked", "list"], 0);
    assert!(out.contains("not replayed: 4 messages, 4 shown"), "{out}");
    assert!(!out.contains(&done.to_string()), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[1].starts_with("SEQ") && lines[1].contains("BODY"),
        "{out}"
    );
    let order: Vec<&str> = lines[2..]
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let want: Vec<String> = [seq_c, seq_b, seq_g, seq_a]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(order, want, "{out}");
    // Control characters of the body never reach the terminal.
    assert_eq!(lines.len(), 6, "{out}");
    assert!(out.contains("not json"), "{out}");

    let (out, _) = dlq(
        &env,
        &["parked", "list", "--kind", "db_permanent", "--limit", "1"],
        0,
    );
    assert!(
        out.contains("2 messages of kind db_permanent, 1 shown"),
        "{out}"
    );
    assert!(
        out.contains(&b.to_string()) && !out.contains(&a.to_string()),
        "{out}"
    );
    let (out, _) = dlq(&env, &["parked", "list", "--json"], 0);
    let objects: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(objects.len(), 4);
    assert_eq!(objects[0]["seq"], seq_c);
    assert!(objects[0]["message_id"].is_null());

    // Replay one kind, oldest first, one at a time.
    let (out, _) = dlq(
        &env,
        &["parked", "replay", "--kind", "db_permanent", "--limit", "1"],
        0,
    );
    assert!(out.contains("replayed 1 parked message "), "{out}");
    assert!(replayed_at_set(&env, seq_a).await);
    assert!(!replayed_at_set(&env, seq_b).await);
    // Then everything that is left.
    let (out, _) = dlq(&env, &["parked", "replay"], 0);
    assert!(out.contains("replayed 3 parked messages"), "{out}");
    assert!(out.contains("failed 0"), "{out}");
    for seq in [seq_a, seq_b, seq_c, seq_g] {
        assert!(replayed_at_set(&env, seq).await, "row {seq} not marked");
    }
    wait_depth(&env, &env.main_queue, 4).await;
    let (out, _) = dlq(&env, &["parked", "list"], 0);
    assert!(out.contains("not replayed: 0 messages"), "{out}");
    let (out, _) = dlq(&env, &["parked", "replay"], 0);
    assert!(out.contains("replayed 0 parked messages"), "{out}");

    // The valid ones become rows; the garbage goes back to the DLQ.
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("3 rows", Duration::from_secs(30), || async {
        env.count_rows().await >= 3
    })
    .await;
    wait_depth(&env, &env.dlq_queue, 1).await;
    assert_eq!(
        env.row_ids().await,
        [a, b, c].into_iter().collect(),
        "log:\n{}",
        warren.logs()
    );
    warren.terminate_ok(Duration::from_secs(30));
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(message_id(&dead[0]), g.to_string());
    assert_eq!(
        header(&dead[0].properties, "x-error-kind"),
        Some(&long_string("invalid_json"))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parked_replay_sends_the_parked_headers_again() {
    let env = TestEnv::new("dlqt_parked_headers").await;
    env.declare();
    let a = Uuid::new_v4();
    let seq = park_with_headers(
        &env,
        Some(a),
        &user_body(a),
        "db_permanent",
        serde_json::json!({
            "trace": "abc-123",
            "tenant": 42,
            "vip": true,
            "score": 1.5,
            "tags": ["a", "b"],
            "x-retries": 3,
            "x-error-kind": "db_permanent",
            "x-error-reason": "db_permanent: 23514",
            "x-dlq-attempts": 4,
        }),
    )
    .await;
    let (out, _) = dlq(&env, &["parked", "replay"], 0);
    assert!(out.contains("replayed 1 parked message "), "{out}");
    assert!(replayed_at_set(&env, seq).await);
    wait_depth(&env, &env.main_queue, 1).await;
    let got = env.drain_queue(&env.main_queue, 10).await;
    let p = &got[0].properties;
    assert_eq!(message_id(&got[0]), a.to_string());
    assert_eq!(got[0].data, user_body(a));
    assert_eq!(*p.delivery_mode(), Some(2));
    assert_eq!(
        p.content_type().as_ref().map(|c| c.as_str()),
        Some("application/json")
    );
    let mut want = FieldTable::default();
    want.insert("trace".into(), long_string("abc-123"));
    want.insert("tenant".into(), AMQPValue::LongLongInt(42));
    want.insert("vip".into(), AMQPValue::Boolean(true));
    want.insert("score".into(), long_string("1.5"));
    want.insert("tags".into(), long_string(r#"["a","b"]"#));
    want.insert("x-retries".into(), AMQPValue::LongLongInt(0));
    assert_eq!(p.headers().as_ref(), Some(&want));
}

/// The pid of `client`'s server process.
async fn backend_pid(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_re_park_racing_a_parked_replay_waits_for_it_and_re_opens_the_row() {
    let env = TestEnv::new("dlqt_repark").await;
    env.declare();
    let a = Uuid::new_v4();
    let seq = park(&env, Some(a), &user_body(a), "db_permanent").await;
    // A gate: every UPDATE statement on dead_letters waits, before it touches any row, for an
    // advisory lock this test holds. So the replay is caught after its publish and before its
    // mark, holding only the locks it took before publishing. The re-parking session opts out.
    // (lock_timeout: a failed test does not leave the replay waiting for ever.)
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE FUNCTION {s}.mark_gate() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF current_setting('warren_test.no_gate', true) IS DISTINCT FROM 'on' THEN
                    PERFORM set_config('lock_timeout', '30s', true);
                    PERFORM pg_advisory_xact_lock(hashtext(TG_TABLE_SCHEMA));
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER dead_letters_mark_gate BEFORE UPDATE ON {s}.dead_letters
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.mark_gate();
            SELECT pg_advisory_lock(hashtext('{s}'));
            "#
        ))
        .await
        .expect("install the gate");
    let (reparker, connection) = tokio_postgres::connect(&database_url(), NoTls)
        .await
        .expect("a second connection");
    tokio::spawn(connection);
    reparker
        .batch_execute("SET warren_test.no_gate = 'on'")
        .await
        .expect("opt out of the gate");
    let reparker_pid = backend_pid(&reparker).await;

    let replay = env.run_async(&["dlq", "parked", "replay"]);
    let race = async {
        // The message is out: the replay now waits at the gate, before its mark.
        wait_depth(&env, &env.main_queue, 1).await;
        // The DLQ consumer's re-park of the same message: an insert that conflicts with the
        // row (here on seq) and re-opens it if, and only if, it is marked replayed.
        let sql = format!(
            "INSERT INTO {s}.dead_letters SELECT * FROM {s}.dead_letters WHERE seq = $1 \
             ON CONFLICT (seq) DO UPDATE SET replayed_at = NULL \
             WHERE dead_letters.replayed_at IS NOT NULL"
        );
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&seq];
        let repark = reparker.execute(&sql, &params);
        let open_the_gate = async {
            wait_until(
                "the re-park waits for the replay's row lock",
                Duration::from_secs(10),
                || async {
                    env.db
                        .query_one(
                            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 \
                             AND wait_event_type = 'Lock' \
                             AND wait_event IN ('transactionid', 'tuple')",
                            &[&reparker_pid],
                        )
                        .await
                        .map(|r| r.get::<_, i64>(0) == 1)
                        .unwrap_or(false)
                },
            )
            .await;
            env.db
                .execute(&format!("SELECT pg_advisory_unlock(hashtext('{s}'))"), &[])
                .await
                .expect("open the gate");
        };
        let (reopened, ()) = tokio::join!(repark, open_the_gate);
        reopened.expect("re-park")
    };
    let ((code, out, err), reopened) = tokio::join!(replay, race);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("replayed 1 parked message "), "{out}");
    // The re-park saw the committed mark and re-opened the row: it is parked again.
    assert_eq!(reopened, 1);
    assert!(!replayed_at_set(&env, seq).await);
    let (out, _) = dlq(&env, &["parked", "list"], 0);
    assert!(out.contains("not replayed: 1 message"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parked_replay_that_cannot_be_routed_leaves_the_rows_untouched() {
    let env = TestEnv::new("dlqt_parked_fail").await;
    env.declare();
    let a = Uuid::new_v4();
    let seq = park(&env, Some(a), &user_body(a), "db_permanent").await;
    unbind_main_queue(&env).await;
    let (out, err) = dlq(&env, &["parked", "replay"], 1);
    assert!(out.contains("replayed 0 parked messages"), "{out}");
    assert!(out.contains("failed 1"), "{out}");
    assert!(err.contains("unroutable"), "{err}");
    assert!(!replayed_at_set(&env, seq).await);
}

/// A replay whose mark cannot commit after the broker confirmed (here a trigger refuses the
/// UPDATE; in life a lost session): the summary says how many were published but stay open and
/// the exit is 1; the pipeline stores the message once; a second replay marks the row.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_whose_mark_fails_says_so_and_a_second_run_heals_it() {
    let env = TestEnv::new("dlqt_parked_mark").await;
    env.declare();
    let a = Uuid::new_v4();
    let seq = park(&env, Some(a), &user_body(a), "db_permanent").await;
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.no_mark() RETURNS trigger LANGUAGE plpgsql AS $f$
             BEGIN RAISE EXCEPTION 'the mark is refused' USING ERRCODE = '57P01'; END $f$;
             CREATE TRIGGER no_mark BEFORE UPDATE ON {s}.dead_letters
                 FOR EACH ROW EXECUTE FUNCTION {s}.no_mark();"
        ))
        .await
        .expect("install the trigger");
    let (out, err) = dlq(&env, &["parked", "replay"], 1);
    assert!(out.contains("replayed 1 parked message"), "{out}");
    assert!(
        out.contains("1 published but still open in dead_letters"),
        "{out}"
    );
    assert!(err.contains("cannot be marked as replayed"), "{err}");
    assert!(!replayed_at_set(&env, seq).await);
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "the replayed user stored",
        Duration::from_secs(30),
        || async { env.row_ids().await.contains(&a) },
    )
    .await;
    env.db
        .batch_execute(&format!("DROP TRIGGER no_mark ON {s}.dead_letters"))
        .await
        .expect("drop the trigger");
    let (out, _) = dlq(&env, &["parked", "replay"], 0);
    assert!(out.contains("replayed 1 parked message"), "{out}");
    assert!(!out.contains("still open"), "{out}");
    assert!(replayed_at_set(&env, seq).await);
    wait_until("the queue drained", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_eq!(
        env.count_rows().await,
        1,
        "one row for the message sent twice"
    );
    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_arguments_and_missing_objects_get_a_clear_error() {
    let env = TestEnv::new("dlqt_args").await;
    let refused: &[(&[&str], &str)] = &[
        (
            &["replay", "--kind", "bogus"],
            "invalid value 'bogus' for '--kind <KIND>'",
        ),
        (
            &["parked", "list", "--kind", "INVALID_JSON"],
            "invalid_json, invalid_payload, db_permanent, retries_exhausted",
        ),
        (
            &["inspect", "--limit", "0"],
            "expected a whole number of at least 1",
        ),
        (
            &["replay", "--limit", "-3"],
            "invalid value '-3' for '--limit <N>': expected a whole number of at least 1",
        ),
        (&["parked", "replay", "--limit", "abc"], "at least 1"),
        (&["inspect", "--bogus"], "--bogus"),
        (&[], "Usage: warren dlq"),
        (&["parked"], "Usage: warren dlq parked"),
    ];
    for (args, message) in refused {
        let (_, err) = dlq(&env, args, 2);
        assert!(
            err.contains(message),
            "warren dlq {args:?}: {message:?} not in:\n{err}"
        );
    }

    // Nothing declared yet: the queue and the table are named, with what to do.
    let (_, err) = dlq(&env, &["inspect"], 1);
    assert!(
        err.contains(&env.dlq_queue) && err.contains("warren declare"),
        "{err}"
    );
    let (_, err) = dlq(&env, &["replay"], 1);
    assert!(
        err.contains(&env.dlq_queue) && err.contains("warren declare"),
        "{err}"
    );
    let (_, err) = dlq(&env, &["parked", "list"], 1);
    assert!(
        err.contains("dead_letters") && err.contains("warren declare"),
        "{err}"
    );
    let (_, err) = dlq(&env, &["parked", "replay"], 1);
    assert!(
        err.contains("dead_letters") && err.contains("warren declare"),
        "{err}"
    );

    // An unreachable broker is named (without its password).
    let mut env = env;
    env.set("AMQP_URL", "amqp://guest:secret@127.0.0.1:1/%2f");
    env.set("AMQP_CONNECT_TIMEOUT_MS", "1000");
    let (_, err) = dlq(&env, &["inspect"], 1);
    assert!(err.contains("cannot reach the broker"), "{err}");
    assert!(!err.contains("secret"), "{err}");
}

/// Found by the review: one parked row whose `headers` hold what warren cannot read back (a
/// number beyond a double, written by another program) made `parked replay` fail for the whole
/// pipeline ("error deserializing column 3"). Now that row alone is left untouched, named, and
/// the others are replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_parked_row_with_unreadable_headers_does_not_stop_the_others_replay() {
    let env = TestEnv::new("dlqt_badhdr").await;
    env.declare();
    let good = Uuid::new_v4();
    let seq_good = park(&env, Some(good), &user_body(good), "db_permanent").await;
    let bad = Uuid::new_v4();
    let seq_bad: i64 = env
        .db
        .query_one(
            &format!(
                "INSERT INTO {}.dead_letters (message_id, body, headers, error_kind, error_reason) \
                 VALUES ($1, $2, '{{\"x-n\": 1e400}}'::jsonb, 'db_permanent', 'foreign') \
                 RETURNING seq",
                env.schema
            ),
            &[&bad.to_string(), &user_body(bad)],
        )
        .await
        .expect("insert the foreign row")
        .get(0);
    let (_, err) = dlq(&env, &["parked", "replay"], 1);
    assert!(
        err.contains(&format!("row {seq_bad} is left untouched"))
            && err.contains("cannot be read back"),
        "{err}"
    );
    assert!(
        replayed_at_set(&env, seq_good).await,
        "the readable row was replayed"
    );
    assert!(!replayed_at_set(&env, seq_bad).await);
    wait_depth(&env, &env.main_queue, 1).await;
}

/// On a quorum DLQ every `basic.get` spends one of a message's deliveries, and past the DLQ's
/// delivery limit the broker drops it. With `DLQ_DELIVERY_LIMIT=0` the limit is the broker's:
/// RabbitMQ 4 gives 20, so `dlq inspect` says what it spent and refuses (leaving the message)
/// once a message is within the margin (2) of it; RabbitMQ 3.x gives none, so inspect says
/// there is no limit to spend and shows a message delivered 18 times all the same. The branch
/// taken is the broker's own version (this machine's is 3.10).
#[tokio::test(flavor = "multi_thread")]
async fn inspect_on_a_quorum_dlq_counts_deliveries_against_the_brokers_limit() {
    let mut env = TestEnv::new("dlqt_spend").await;
    env.set("QUEUE_TYPE", "quorum")
        .set("DLQ_DELIVERY_LIMIT", "0");
    env.declare();
    let version =
        warren::topology::broker::broker_version(&env.conn).expect("the broker's version");
    let limited = warren::topology::broker::gives_default_limit(Some(&version))
        .unwrap_or_else(|| panic!("an unreadable broker version {version:?}"));
    let id = put_dead_user(&env, "retries_exhausted").await;
    wait_depth(&env, &env.dlq_queue, 1).await;
    let (out, _) = dlq(&env, &["inspect"], 0);
    let summary = if limited {
        "this spent 1 delivery of each message shown (quorum DLQ: limit 20, most delivered now 1)"
            .to_string()
    } else {
        format!(
            "quorum DLQ without a delivery limit (DLQ_DELIVERY_LIMIT=0 on RabbitMQ {version}, \
             which gives it none): no delivery limit to spend, no check needed"
        )
    };
    assert!(out.contains(&summary), "{summary:?} not in:\n{out}");
    // Delivered 17 times in all: the next inspection would be its 18th, within 2 of 20.
    for _ in 0..16 {
        let m = env
            .channel
            .basic_get(
                env.dlq_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get")
            .expect("the dead letter");
        m.acker
            .reject(BasicRejectOptions { requeue: true })
            .await
            .expect("requeue");
    }
    wait_depth(&env, &env.dlq_queue, 1).await;
    let (code, out, err) = env.run(&["dlq", "inspect"]);
    if limited {
        assert_eq!(code, 1, "inspect near the limit:\n{out}\n{err}");
        assert!(
            err.contains(&format!(
                "dlq inspect refused: message {id} in {}",
                env.dlq_queue
            )) && err.contains("delivered 18 times, within 2 of the DLQ's delivery limit of 20"),
            "{out}\n{err}"
        );
    } else {
        assert_eq!(code, 0, "no limit on RabbitMQ {version}:\n{out}\n{err}");
        assert!(
            out.contains(&id.to_string()) && out.contains(&summary) && !err.contains("refused"),
            "{out}\n{err}"
        );
    }
    wait_depth(&env, &env.dlq_queue, 1).await;
}
