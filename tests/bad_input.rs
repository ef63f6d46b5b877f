//! Bad input: every malformed body goes straight to the DLQ with the right `x-error-kind` and its
//! original bytes, and unusable `x-retries` values (a string, a negative number, a float) count
//! as 0 and are rewritten as an integer on the next retry.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::message::BasicGetMessage;
use lapin::types::AMQPValue;
use uuid::Uuid;

// ---- this file's messages -------------------------------------------------------------------

/// JSON properties with `label` as the message id.
fn labelled(label: &str) -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id(label.into())
}

// ---- tests ----------------------------------------------------------------------------------

/// Every kind of malformed body: straight to the DLQ, right kind, body kept, no retry, no row;
/// a body over MAX_MESSAGE_BYTES parked at once by the main stage, whole.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_messages_go_straight_to_the_dlq_with_their_kind() {
    let mut env = TestEnv::new("bad_bodies").await;
    env.set("MAX_MESSAGE_BYTES", "1024");
    env.declare();

    // Each body carries an id of its own, so a row reveals which body it came from.
    let valid = |name: &str, email: &str| {
        let id = Uuid::new_v4();
        format!(r#"{{"id":"{id}","name":{name},"email":{email}}}"#).into_bytes()
    };
    let fresh = Uuid::new_v4;
    // A valid user padded with whitespace past MAX_MESSAGE_BYTES: only the size is wrong.
    let mut oversize = valid("\"Ana\"", "\"ana@example.com\"");
    oversize.extend(std::iter::repeat_n(b' ', 2000));
    assert!(serde_json::from_slice::<serde_json::Value>(&oversize).is_ok());

    // (label = message_id, body, expected x-error-kind)
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "invalid_json"),
        (
            "not_utf8",
            b"{\"id\":\"\xff\xfe\",\"name\":\"Ana\"}".to_vec(),
            "invalid_json",
        ),
        ("not_json", b"{not json".to_vec(), "invalid_json"),
        (
            "trailing_garbage",
            [valid("\"Ana\"", "\"ana@example.com\""), b"}x".to_vec()].concat(),
            "invalid_json",
        ),
        ("array", b"[1,2]".to_vec(), "invalid_payload"),
        // An array holding the three fields in order is still not a user object.
        (
            "array_of_fields",
            format!(r#"["{}","Ana","ana@example.com"]"#, fresh()).into_bytes(),
            "invalid_payload",
        ),
        (
            "id_not_uuid",
            br#"{"id":"not-a-uuid","name":"Ana","email":"ana@example.com"}"#.to_vec(),
            "invalid_payload",
        ),
        (
            "name_number",
            valid("42", "\"ana@example.com\""),
            "invalid_payload",
        ),
        (
            "missing_email",
            format!(r#"{{"id":"{}","name":"Ana"}}"#, fresh()).into_bytes(),
            "invalid_payload",
        ),
        (
            "unknown_field",
            format!(
                r#"{{"id":"{}","name":"Ana","email":"ana@example.com","admin":true}}"#,
                fresh()
            )
            .into_bytes(),
            "invalid_payload",
        ),
        (
            "empty_name",
            valid("\"\"", "\"ana@example.com\""),
            "invalid_payload",
        ),
        ("bad_email", valid("\"Ana\"", "\"nope\""), "invalid_payload"),
    ];
    for (label, body, _) in &cases {
        env.publish_raw(body, labelled(label)).await;
    }
    // docs/failures.md, the failure table: "larger than MAX_MESSAGE_BYTES" -> invalid_payload,
    // parked by the main stage that refused it (never republished to the DLQ).
    env.publish_raw(&oversize, labelled("oversize")).await;
    // The sentinel, published last: once its row exists, every batch before it was processed.
    let sentinel = Uuid::new_v4();
    env.publish_raw(&user_body(sentinel), json_props(sentinel))
        .await;

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("the sentinel row", Duration::from_secs(30), || async {
        env.row_ids().await.contains(&sentinel)
    })
    .await;
    // The oversize body is given back unread once and taken whole later (docs/failures.md,
    // "Memory"): it may be parked after the sentinel's batch, so it is awaited too (the suite
    // under load stopped warren before it was parked: one message left in the queue).
    wait_until(
        "the oversize body parked",
        Duration::from_secs(30),
        || async {
            count_of(
                &env,
                "SELECT count(*) FROM dead_letters WHERE message_id = 'oversize'",
            )
            .await
                >= 1
        },
    )
    .await;
    // The DLQ copies are confirmed before the batch that holds the sentinel is settled, and a
    // graceful stop waits for every settlement: after it, the DLQ holds all it will get.
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;

    let dead = env.drain_queue(&env.dlq_queue, cases.len() + 5).await;
    let by_label: HashMap<String, &BasicGetMessage> =
        dead.iter().map(|m| (message_id(m), m)).collect();
    assert_eq!(
        dead.len(),
        by_label.len(),
        "a message was dead-lettered twice"
    );
    let mut wrong = Vec::new();
    for (label, body, kind) in &cases {
        let Some(m) = by_label.get(*label) else {
            wrong.push(format!("{label}: not in the DLQ"));
            continue;
        };
        let p = &m.delivery.properties;
        assert_eq!(&m.delivery.data, body, "{label}: body changed");
        assert_eq!(
            int_header(p, "x-retries").unwrap_or(0),
            0,
            "{label}: retried"
        );
        let reason = text_header(p, "x-error-reason").unwrap_or_default();
        assert!(!reason.is_empty(), "{label}: no x-error-reason");
        let got = text_header(p, "x-error-kind").unwrap_or_default();
        if got != *kind {
            wrong.push(format!(
                "{label}: x-error-kind {got:?}, expected {kind:?} (reason {reason:?})"
            ));
        }
    }
    let parked = env
        .db
        .query(
            "SELECT error_kind, error_reason, body FROM dead_letters WHERE message_id = 'oversize'",
            &[],
        )
        .await
        .expect("the parked oversize body");
    match parked.as_slice() {
        [row] => {
            let (kind, reason, body): (String, String, Vec<u8>) =
                (row.get(0), row.get(1), row.get(2));
            assert_eq!(kind, "invalid_payload", "{reason}");
            assert!(
                reason.contains("MAX_MESSAGE_BYTES"),
                "oversize reason {reason:?}"
            );
            assert_eq!(body, oversize, "oversize: body changed");
        }
        rows => wrong.push(format!("oversize: {} parked rows, expected 1", rows.len())),
    }
    // Only the sentinel may become a row (the padded user and the array of fields would be
    // valid users otherwise).
    let rows = env.row_ids().await;
    for (label, body, _) in &cases {
        if label.starts_with("array") {
            let text = String::from_utf8_lossy(body);
            if rows
                .iter()
                .any(|r| r != &sentinel && text.contains(&r.to_string()))
            {
                wrong.push(format!("{label}: inserted as a row"));
            }
        }
    }
    let text = String::from_utf8_lossy(&oversize);
    if rows
        .iter()
        .any(|r| r != &sentinel && text.contains(&r.to_string()))
    {
        wrong.push("oversize: inserted as a row".into());
    }
    if rows.len() != 1 {
        wrong.push(format!("{} rows, expected only the sentinel", rows.len()));
    }
    if dead.len() != cases.len() {
        wrong.push(format!(
            "{} DLQ messages, expected {}",
            dead.len(),
            cases.len()
        ));
    }
    assert!(wrong.is_empty(), "wrong outcomes:\n{}", wrong.join("\n"));
}

/// `x-retries` as a string, as -1 and as a float on messages that hit a transient failure: read as
/// 0, so each goes to the retry queue with x-retries = 1 as an integer (not to the DLQ), and from
/// there on counts normally to retries_exhausted (no loop). Integer types are read as numbers.
#[tokio::test(flavor = "multi_thread")]
async fn unusable_x_retries_count_as_zero_and_are_rewritten_as_integers() {
    let mut env = TestEnv::new("bad_retries").await;
    env.set("RETRY_TTL_MS", "3000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "3")
        // Retry-queue semantics only: the sink-outage breaker must not hold the consumer.
        .set("BREAKER_FAILURES", "1000");
    env.declare();
    install_fault(&env, CountAttempts::Yes).await;

    // (label, x-retries sent, x-retries expected after the first failure, attempts in all)
    let cases: Vec<(&str, AMQPValue, Option<i64>, i64)> = vec![
        ("string", long_string("7"), Some(1), 4),
        ("negative", AMQPValue::LongLongInt(-1), Some(1), 4),
        ("float", AMQPValue::Double(7.5), Some(1), 4),
        // Controls: integers of other AMQP types are read as their value.
        ("u8_one", AMQPValue::ShortShortUInt(1), Some(2), 3),
        ("i32_two", AMQPValue::LongInt(2), Some(3), 2),
        // Spent already: dead-lettered at its first failure.
        ("i64_three", AMQPValue::LongLongInt(3), None, 1),
    ];
    let ids: Vec<Uuid> = cases.iter().map(|_| Uuid::new_v4()).collect();
    track_attempts(&env, &ids).await;
    let label_of: HashMap<Uuid, &str> =
        ids.iter().copied().zip(cases.iter().map(|c| c.0)).collect();
    for ((_, value, _, _), id) in cases.iter().zip(&ids) {
        let props = with_header(json_props(*id), "x-retries", value.clone());
        env.publish_raw(&user_body(*id), props).await;
    }
    let mut warren = env.start(&["--roles", "consumer"]);

    // First failure: five in the retry queue, the spent one in the DLQ.
    wait_until("first failure routed", Duration::from_secs(20), || async {
        env.ready(&env.retry_queue).await == 5 && env.ready(&env.dlq_queue).await == 1
    })
    .await;
    let peeked = env.peek(&env.retry_queue, 10).await;
    assert_eq!(peeked.len(), 5, "log:\n{}", warren.logs());
    for m in &peeked {
        let id = message_uuid(m);
        let label = label_of[&id];
        let (_, _, expected, _) = cases.iter().find(|c| c.0 == label).unwrap();
        let p = &m.delivery.properties;
        assert!(
            matches!(header(p, "x-retries"), Some(AMQPValue::LongLongInt(_))),
            "{label}: x-retries not rewritten as an integer: {:?}",
            header(p, "x-retries")
        );
        assert_eq!(int_header(p, "x-retries"), *expected, "{label}");
        let reason = text_header(p, "x-retry-reason").unwrap_or_default();
        assert!(reason.starts_with("db_error"), "{label}: {reason:?}");
    }
    for (id, (label, _, _, _)) in ids.iter().zip(&cases) {
        assert_eq!(attempts(&env, *id).await, 1, "{label}: attempts at first");
    }

    // From there on they count normally and end in the DLQ: no loop.
    wait_until("all in the DLQ", Duration::from_secs(40), || async {
        env.ready(&env.dlq_queue).await as usize == cases.len()
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    for (id, (label, _, _, tries)) in ids.iter().zip(&cases) {
        assert_eq!(
            attempts(&env, *id).await,
            *tries,
            "{label}: attempts in all"
        );
    }
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(dead.len(), cases.len());
    for m in &dead {
        let id = message_uuid(m);
        let label = label_of[&id];
        let p = &m.delivery.properties;
        assert_eq!(int_header(p, "x-retries"), Some(3), "{label}");
        assert_eq!(
            text_header(p, "x-error-kind").as_deref(),
            Some("retries_exhausted"),
            "{label}"
        );
        assert_eq!(m.delivery.data, user_body(id), "{label}: body changed");
    }
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
    assert_eq!(env.count_rows().await, 0);
}

/// A delivery whose properties are not valid UTF-8 (a foreign publisher's Latin-1 message-id,
/// reply-to and content-type; the broker accepts any bytes) used to make the AMQP client fail
/// the connection: the message went back to the head of the queue and nothing behind it was
/// ever inserted. Now it is delivered like any other (its body is a valid user: inserted), and
/// everything behind it flows, without a single reconnect.
#[tokio::test(flavor = "multi_thread")]
async fn undecodable_properties_do_not_stall_the_queue() {
    let env = TestEnv::new("bad_props").await;
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let first = Uuid::new_v4();
    let props = raw_amqp::RawProperties {
        content_type: Some(b"application/json; charset=\xe9".to_vec()),
        reply_to: Some(b"r\xff\xfe".to_vec()),
        message_id: Some(b"caf\xe9-\xff".to_vec()),
        delivery_mode: Some(2),
        ..Default::default()
    };
    raw_amqp::publish(
        &amqp_url(),
        &env.main_exchange,
        &env.main_queue,
        &props,
        &user_body(first),
    )
    .await
    .expect("raw publish");
    let behind = env.publish_users(200).await;

    let mut expected: std::collections::HashSet<Uuid> = behind.into_iter().collect();
    expected.insert(first);
    assert_rows_exactly(&env, &expected, Duration::from_secs(30), &|| warren.logs()).await;
    assert_queue_empty(&env, &env.main_queue).await;
    // Absent from an answering /metrics: no reconnect (0); no answer: a failure.
    let reconnects = metric(&env, "warren_reconnects_total", &[("target", "amqp")]).await;
    assert_eq!(
        reconnects, 0.0,
        "the consumer reconnected {reconnects} times"
    );
    warren.terminate_ok(Duration::from_secs(20));
}
