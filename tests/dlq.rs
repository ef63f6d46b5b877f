//! The DLQ consumer (`--roles dlq`): a message it can insert is inserted and acked; one that can
//! never be inserted (invalid, or refused permanently by the database) is parked in
//! `dead_letters` with its body and headers and acked; while the database fails transiently the
//! message stays in the DLQ and is requeued after a growing backoff, then inserted once the
//! database recovers.

mod common;

use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use uuid::Uuid;

// ---- this file's probes ---------------------------------------------------------------------

/// Rows in `dead_letters`; -1 while the table cannot be read.
async fn parked_count(env: &TestEnv) -> i64 {
    env.db
        .query_one("SELECT count(*) FROM dead_letters", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Properties of a message the main pipeline dead-lettered.
fn dead_lettered(message_id: &str, kind: &str, retries: i64) -> BasicProperties {
    dead_letter_props(message_id, kind, retries, "set by the main pipeline")
}

/// Puts a valid user in the DLQ as the main pipeline leaves it once its retries are spent.
async fn publish_exhausted_user(env: &TestEnv, id: Uuid) {
    env.publish_to_dlq(
        &user_body(id),
        dead_lettered(&id.to_string(), "retries_exhausted", 3),
    )
    .await;
}

/// Stops `warren` cleanly and checks that it settled everything it took: the DLQ is empty with
/// no consumer (acked, not merely held: nothing came back when warren closed its channel), and
/// nothing went to the main or the retry queue.
async fn stop_with_everything_acked(env: &TestEnv, warren: &mut Warren) {
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(
        env.queue_state(&env.dlq_queue).await,
        (0, 0),
        "log:\n{}",
        warren.logs()
    );
    assert_queue_empty(env, &env.main_queue).await;
    assert_queue_empty(env, &env.retry_queue).await;
}

/// Waits until `id` is a row and the DLQ is empty.
async fn wait_inserted_and_dlq_empty(env: &TestEnv, id: Uuid) {
    wait_until("the row", Duration::from_secs(30), || async {
        env.row_ids().await.contains(&id)
    })
    .await;
    wait_until("the DLQ empty", Duration::from_secs(10), || async {
        env.queue_state(&env.dlq_queue).await.0 == 0
    })
    .await;
}

/// The `delay_ms` of every "... after a backoff" line of a JSON log (a DLQ batch tried again
/// later, or given back to its queue).
fn requeue_delays(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("after a backoff"))
        })
        .map(|v| {
            v["delay_ms"]
                .as_u64()
                .expect("delay_ms in the requeue log line")
        })
        .collect()
}

// ---- tests ----------------------------------------------------------------------------------

/// A valid user in the DLQ is inserted and acked; nothing is parked or republished.
#[tokio::test(flavor = "multi_thread")]
async fn a_valid_dlq_message_is_inserted_and_acked() {
    let env = TestEnv::new("dlq_valid").await;
    env.declare();
    let id = Uuid::new_v4();
    publish_exhausted_user(&env, id).await;
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 1);

    let mut warren = env.start(&["--roles", "dlq"]);
    wait_inserted_and_dlq_empty(&env, id).await;
    stop_with_everything_acked(&env, &mut warren).await;
    assert_eq!(env.count_rows().await, 1);
    assert_eq!(parked_count(&env).await, 0);
}

/// Messages that can never be inserted are parked with their exact body, their headers as
/// jsonb, the kind and reason; then acked. A valid sentinel behind them is inserted.
#[tokio::test(flavor = "multi_thread")]
async fn invalid_and_permanently_refused_dlq_messages_are_parked() {
    let env = TestEnv::new("dlq_park").await;
    env.declare();

    // Not JSON, with the headers the main pipeline set and one of the publisher's own.
    let not_json = b"{not json".to_vec();
    let props = with_header(
        dead_lettered("not-json-1", "invalid_json", 0),
        "x-trace",
        long_string("abc-123"),
    );
    env.publish_to_dlq(&not_json, props).await;
    // Binary garbage: the bytea must keep every byte.
    let binary = b"\x00\xff\xfe binary \x80\x00".to_vec();
    env.publish_to_dlq(&binary, dead_lettered("binary-1", "invalid_json", 0))
        .await;
    // A valid user whose email is taken by another row: refused permanently (23505).
    let taken = Uuid::new_v4();
    env.db
        .execute(
            "INSERT INTO users (id, name, email) VALUES ($1, 'owner', $2)",
            &[&taken, &format!("{taken}@example.com")],
        )
        .await
        .unwrap();
    let dup = Uuid::new_v4();
    let dup_body =
        format!(r#"{{"id":"{dup}","name":"dup","email":"{taken}@example.com"}}"#).into_bytes();
    env.publish_to_dlq(&dup_body, dead_lettered("dup-1", "retries_exhausted", 3))
        .await;
    let sentinel = Uuid::new_v4();
    publish_exhausted_user(&env, sentinel).await;

    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until(
        "3 parked and the sentinel row",
        Duration::from_secs(30),
        || async { parked_count(&env).await == 3 && env.row_ids().await.contains(&sentinel) },
    )
    .await;
    stop_with_everything_acked(&env, &mut warren).await;
    assert_eq!(parked_count(&env).await, 3, "parked twice?");
    assert_eq!(env.count_rows().await, 2, "the owner and the sentinel");

    let rows = env
        .db
        .query(
            "SELECT message_id, body, headers, error_kind, error_reason, parked_at IS NOT NULL, \
             replayed_at IS NULL FROM dead_letters ORDER BY seq",
            &[],
        )
        .await
        .unwrap();
    let find = |mid: &str| {
        rows.iter()
            .find(|r| r.get::<_, Option<String>>(0).as_deref() == Some(mid))
            .unwrap_or_else(|| panic!("{mid} not parked"))
    };

    let r = find("not-json-1");
    assert_eq!(r.get::<_, Vec<u8>>(1), not_json);
    let headers: serde_json::Value = r.get(2);
    assert_eq!(headers["x-trace"], "abc-123", "{headers}");
    assert_eq!(headers["x-error-kind"], "invalid_json", "{headers}");
    assert_eq!(headers["x-retries"], 0, "{headers}");
    assert_eq!(r.get::<_, String>(3), "invalid_json");
    assert!(!r.get::<_, String>(4).is_empty());
    assert!(r.get::<_, bool>(5) && r.get::<_, bool>(6));

    let r = find("binary-1");
    assert_eq!(r.get::<_, Vec<u8>>(1), binary);
    assert_eq!(r.get::<_, String>(3), "invalid_json");

    let r = find("dup-1");
    assert_eq!(r.get::<_, Vec<u8>>(1), dup_body);
    assert_eq!(r.get::<_, String>(3), "db_permanent");
    let reason: String = r.get(4);
    assert!(reason.contains("23505"), "error_reason {reason:?}");
    let headers: serde_json::Value = r.get(2);
    assert_eq!(headers["x-retries"], 3, "{headers}");
    assert!(!env.row_ids().await.contains(&dup));
}

/// While the database fails transiently the DLQ message is neither parked nor dropped: it is
/// requeued after a growing delay (visible in the log), stays in the DLQ across a restart, and
/// is inserted once the database recovers.
#[tokio::test(flavor = "multi_thread")]
async fn a_dlq_message_is_requeued_with_a_growing_backoff_while_the_database_fails() {
    let mut env = TestEnv::new("dlq_backoff").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("LOG_FORMAT", "json")
        .set("DLQ_MAX_ATTEMPTS", "50");
    env.declare();
    install_fault(&env, CountAttempts::Yes).await;
    let id = Uuid::new_v4();
    track_attempts(&env, &[id]).await;
    publish_exhausted_user(&env, id).await;

    // Phase 1: five failures, each requeue delayed longer than the one before.
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("five attempts", Duration::from_secs(30), || async {
        attempts(&env, id).await >= 5
    })
    .await;
    wait_until("four delays logged", Duration::from_secs(10), || async {
        requeue_delays(&warren.logs()).len() >= 4
    })
    .await;
    assert_eq!(parked_count(&env).await, 0, "parked on a transient error");
    assert_eq!(env.count_rows().await, 0);
    let delays = requeue_delays(&warren.logs());
    for pair in delays.windows(2) {
        assert!(pair[1] > pair[0], "delays do not grow: {delays:?}");
    }
    for (k, d) in delays.iter().enumerate() {
        let base = (200u64 << k.min(20)).min(30_000);
        assert!(
            *d >= base && *d <= 2 * base,
            "delay #{} = {d} ms, expected {base}..={} ms: {delays:?}",
            k + 1,
            2 * base
        );
    }
    // Stopped during the outage: the message is still in the DLQ, never acked.
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(
        env.queue_state(&env.dlq_queue).await,
        (1, 0),
        "the DLQ was emptied; log:\n{}",
        warren.logs()
    );
    assert_eq!(parked_count(&env).await, 0);

    // Phase 2: a new DLQ consumer, still failing, then the database recovers.
    let before = attempts(&env, id).await;
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("two more attempts", Duration::from_secs(20), || async {
        attempts(&env, id).await >= before + 2
    })
    .await;
    clear_fault(&env).await;
    wait_inserted_and_dlq_empty(&env, id).await;
    stop_with_everything_acked(&env, &mut warren).await;
    assert_eq!(parked_count(&env).await, 0);
    assert_eq!(env.count_rows().await, 1);
}

/// NUL bytes (which PostgreSQL's text and jsonb cannot hold) in the message id, a header key, a
/// header value and the reason: the park statement used to be refused, and the whole park set,
/// innocent messages with it, was requeued forever. Now the text is escaped and every message of
/// the set is parked, with a sentinel row inserted behind them.
#[tokio::test(flavor = "multi_thread")]
async fn text_postgresql_cannot_store_is_escaped_and_parking_never_blocks() {
    let env = TestEnv::new("dlq_nul").await;
    env.declare();
    let nul_props = with_header(
        with_header(
            dead_letter_props("nul\0id", "invalid_json", 0, "reason with \0 inside"),
            "x-note\0key",
            long_string("value\0with nul"),
        ),
        "x-long",
        long_string(&"r".repeat(5000)),
    );
    env.publish_to_dlq(b"\0{not json", nul_props).await;
    let innocent: Vec<String> = (0..5).map(|i| format!("innocent-{i}")).collect();
    for label in &innocent {
        env.publish_to_dlq(b"{not json", dead_lettered(label, "invalid_json", 0))
            .await;
    }
    let sentinel = Uuid::new_v4();
    publish_exhausted_user(&env, sentinel).await;

    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until(
        "6 parked and the sentinel row",
        Duration::from_secs(30),
        || async { parked_count(&env).await == 6 && env.row_ids().await.contains(&sentinel) },
    )
    .await;
    stop_with_everything_acked(&env, &mut warren).await;
    let row = env
        .db
        .query_one(
            "SELECT message_id, headers, body FROM dead_letters WHERE message_id LIKE 'nul%'",
            &[],
        )
        .await
        .expect("the NUL message parked with its id");
    assert_eq!(row.get::<_, String>(0), "nul\\u0000id");
    let headers: serde_json::Value = row.get(1);
    // The name escaped; the value, which a replay must give back as it came, tagged (its bytes
    // in hex: jsonb cannot hold U+0000).
    let hex: String = b"value\0with nul"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        headers["x-note\\u0000key"],
        serde_json::json!({"$amqp": "long_string", "hex": hex}),
        "{headers}"
    );
    assert_eq!(
        row.get::<_, Vec<u8>>(2),
        b"\0{not json",
        "body kept byte for byte"
    );
}

/// A row the parking table itself refuses (a trigger on dead_letters refusing one message's
/// headers) does not block the others: the set is parked row by row, and the refused row is
/// parked without its headers, keeping its message id (its identity: `GET` finds it, and a
/// later park of the same message meets the same row).
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_park_row_is_split_off_and_parked_bare() {
    let env = TestEnv::new("dlq_refused_row").await;
    env.declare();
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE FUNCTION {s}.refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF NEW.headers ? 'x-refuse-me' THEN
                    RAISE EXCEPTION 'refused by a trigger' USING ERRCODE = 'P0001';
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER dead_letters_refuse BEFORE INSERT ON {s}.dead_letters
                FOR EACH ROW EXECUTE FUNCTION {s}.refuse_marked();
            "#
        ))
        .await
        .expect("install the trigger");
    let marked = with_header(
        dead_lettered("marked", "invalid_json", 0),
        "x-refuse-me",
        long_string("yes"),
    );
    env.publish_to_dlq(b"marked body", marked).await;
    for i in 0..4 {
        env.publish_to_dlq(
            b"{not json",
            dead_lettered(&format!("plain-{i}"), "invalid_json", 0),
        )
        .await;
    }
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("5 parked", Duration::from_secs(30), || async {
        parked_count(&env).await == 5
    })
    .await;
    stop_with_everything_acked(&env, &mut warren).await;
    let bare = env
        .db
        .query_one(
            "SELECT message_id, headers, error_reason FROM dead_letters WHERE body = 'marked body'",
            &[],
        )
        .await
        .expect("the refused row, parked without its headers");
    assert_eq!(bare.get::<_, Option<String>>(0).as_deref(), Some("marked"));
    assert_eq!(bare.get::<_, serde_json::Value>(1), serde_json::json!({}));
    assert!(
        bare.get::<_, String>(2)
            .starts_with("parked without its headers"),
        "{}",
        bare.get::<_, String>(2)
    );
}

/// Parking is idempotent: the same message parked twice (its ack lost after the park commit, so
/// the DLQ delivers it again) is one row; parked again after a replay, its row is re-opened.
#[tokio::test(flavor = "multi_thread")]
async fn parking_the_same_message_twice_keeps_one_row() {
    let env = TestEnv::new("dlq_idempotent").await;
    env.declare();
    for _ in 0..2 {
        env.publish_to_dlq(b"{not json", dead_lettered("twice", "invalid_json", 0))
            .await;
    }
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("the DLQ empty", Duration::from_secs(30), || async {
        queue_counts(&env.dlq_queue).await == (0, 0)
    })
    .await;
    assert_eq!(parked_count(&env).await, 1, "parked twice");
    // As `warren dlq parked replay` leaves it, then the message fails and is parked once more.
    env.db
        .execute("UPDATE dead_letters SET replayed_at = now()", &[])
        .await
        .unwrap();
    env.publish_to_dlq(b"{not json", dead_lettered("twice", "invalid_json", 0))
        .await;
    wait_until("re-opened", Duration::from_secs(30), || async {
        env.db
            .query_one(
                "SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL AND park_count = 2",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0) == 1)
            .unwrap_or(false)
    })
    .await;
    stop_with_everything_acked(&env, &mut warren).await;
    assert_eq!(parked_count(&env).await, 1);
}

/// Two messages with the same body (and the same message id, or none) that differ in a header
/// of their publisher's are two messages: two parked rows, each with its headers. Before, the
/// fingerprint was the message id and the body, and the second vanished into the first's row.
/// Another attempt of one message (other stamps: x-dlq-attempts, x-error-*) is still one row.
#[tokio::test(flavor = "multi_thread")]
async fn messages_that_differ_only_in_a_header_of_their_own_park_as_two_rows() {
    let env = TestEnv::new("dlq_headers_identity").await;
    env.declare();
    for tenant in ["a", "b"] {
        let props = with_header(
            dead_lettered("same-id", "invalid_json", 0),
            "tenant",
            long_string(tenant),
        );
        env.publish_to_dlq(b"{not json", props).await;
    }
    for k in [1, 2] {
        let props = with_header(
            BasicProperties::default().with_delivery_mode(2),
            "k",
            AMQPValue::LongLongInt(k),
        );
        env.publish_to_dlq(b"{also not json", props).await;
    }
    // The same message as the first, another attempt: other stamps, one row with it.
    let again = with_header(
        with_header(
            dead_lettered("same-id", "invalid_json", 0),
            "tenant",
            long_string("a"),
        ),
        "x-dlq-attempts",
        AMQPValue::LongLongInt(2),
    );
    env.publish_to_dlq(b"{not json", again).await;
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("the DLQ empty", Duration::from_secs(30), || async {
        queue_counts(&env.dlq_queue).await == (0, 0)
    })
    .await;
    stop_with_everything_acked(&env, &mut warren).await;
    let rows: Vec<(Option<String>, String, i32)> = env
        .db
        .query(
            "SELECT message_id, headers::text, park_count FROM dead_letters ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for needle in [
        r#""tenant": "a""#,
        r#""tenant": "b""#,
        r#""k": 1"#,
        r#""k": 2"#,
    ] {
        assert!(
            rows.iter().any(|(_, h, _)| h.contains(needle)),
            "no row with {needle}: {rows:?}"
        );
    }
    assert_eq!(
        rows.iter()
            .filter(|(_, h, _)| h.contains(r#""tenant": "a""#))
            .count(),
        1,
        "the second attempt of the first message is that message's row: {rows:?}"
    );
}

/// No database at all (an outage, not an error the database answers with): the DLQ consumer
/// gives the message back to the DLQ after a backoff and spends no attempt on it, however long
/// the outage; once the database is back it is inserted once and nothing is parked.
#[tokio::test(flavor = "multi_thread")]
async fn an_outage_requeues_dlq_messages_without_spending_attempts() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("dlq_outage").await;
    env.declare();
    env.set("DATABASE_URL", proxy.url())
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("DLQ_MAX_ATTEMPTS", "1");
    proxy.cut();
    let id = Uuid::new_v4();
    publish_exhausted_user(&env, id).await;
    let mut warren = env.start(&["--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "two requeues for want of a database",
        Duration::from_secs(30),
        || async {
            try_metric(
                &env,
                "warren_messages_requeued_total",
                &[
                    ("pipeline", "users"),
                    ("stage", "dlq"),
                    ("reason", "db_unavailable"),
                ],
            )
            .await
            .unwrap_or(0.0)
                >= 2.0
        },
    )
    .await;
    // DLQ_MAX_ATTEMPTS=1 would park it at its first counted attempt: none was counted.
    assert_eq!(parked_count(&env).await, 0, "parked during an outage");
    let attempts = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "dlq")],
    )
    .await;
    assert_eq!(attempts, 0.0, "DLQ attempts spent during an outage");

    proxy.restore();
    wait_inserted_and_dlq_empty(&env, id).await;
    stop_with_everything_acked(&env, &mut warren).await;
    assert_eq!(parked_count(&env).await, 0);
    assert_eq!(env.count_rows().await, 1);
}

/// A message that keeps failing must not make the next one wait: a poisoned row in the DLQ grows
/// the stage's requeue streak (its fifth delay is 3.2-6.4 s), and the batch of a fresh message
/// that fails once behind it waits that message's first backoff (200-400 ms), not the streak's
/// sixth (6.4-12.8 s). (With the streak alone, a run of many poisoned rows held every later
/// batch, first attempts included, at the 30 s cap: found by the ledger, seed
/// 13413845725824598492.)
#[tokio::test(flavor = "multi_thread")]
async fn a_fresh_dlq_message_waits_its_own_backoff_not_the_streak_of_a_poisoned_one() {
    let mut env = TestEnv::new("dlq_backoff_cap").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("LOG_FORMAT", "json")
        .set("USERS_BATCH_TIMEOUT_MS", "50")
        .set("DLQ_MAX_ATTEMPTS", "50");
    env.declare();
    install_poison_trigger(&env).await;
    let (old, fresh) = (Uuid::new_v4(), Uuid::new_v4());
    let poisoned = |id: Uuid| {
        serde_json::json!({"id": id, "name": "poisoned", "email": format!("poison-{id}@example.com")})
            .to_string()
            .into_bytes()
    };
    env.publish_to_dlq(
        &poisoned(old),
        dead_lettered(&old.to_string(), "retries_exhausted", 3),
    )
    .await;

    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("five delays logged", Duration::from_secs(40), || async {
        requeue_delays(&warren.logs()).len() >= 5
    })
    .await;
    let streak = requeue_delays(&warren.logs());
    assert!(
        streak[4] >= 3_200,
        "the poisoned message's streak did not grow: {streak:?}"
    );
    env.publish_to_dlq(
        &poisoned(fresh),
        dead_lettered(&fresh.to_string(), "retries_exhausted", 3),
    )
    .await;
    // The fresh message's batch (alone, or with the old message) waits at most 400 ms. The
    // streak's next delay would be 6.4 s or more, and the one after that 12.8 s or more.
    wait_until(
        "a first attempt's delay after the streak's",
        Duration::from_secs(30),
        || async {
            requeue_delays(&warren.logs())[5..]
                .iter()
                .any(|d| *d <= 400)
        },
    )
    .await;

    // Stopped mid-way: both are still in the DLQ, nothing parked, nothing inserted.
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(
        env.queue_state(&env.dlq_queue).await,
        (2, 0),
        "log:\n{}",
        warren.logs()
    );
    assert_eq!(parked_count(&env).await, 0);
    assert_eq!(env.count_rows().await, 0);
}

/// A DLQ message whose insert always outlasts the database's `statement_timeout` (57014, a
/// slow trigger here; a huge child array or a slow disk elsewhere): the server answers with an
/// error each time, so each try is a counted attempt, carried in the message's own
/// `x-dlq-attempts` across a restart of warren; at `DLQ_MAX_ATTEMPTS` it is parked with a reason
/// naming the timeout, neither dropped nor cycled for ever. A valid sentinel behind it is
/// inserted once.
#[tokio::test(flavor = "multi_thread")]
async fn a_dlq_message_whose_insert_always_times_out_is_parked_after_its_attempts() {
    let mut env = TestEnv::new("dlq_timeout").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "300")
        .set("USERS_BATCH_TIMEOUT_MS", "20")
        .set("DLQ_MAX_ATTEMPTS", "4");
    env.declare();
    install_slow_trigger(&env).await;
    let slow = Uuid::new_v4();
    let body = slow_user_body(slow);
    env.publish_to_dlq(
        &body,
        dead_lettered(&slow.to_string(), "retries_exhausted", 3),
    )
    .await;

    // The first life: an attempt counted, then warren stops with the message in the DLQ.
    let mut warren = env.start(&["--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("a DLQ attempt counted", Duration::from_secs(30), || async {
        try_metric(
            &env,
            "warren_messages_retried_total",
            &[("pipeline", "users"), ("stage", "dlq")],
        )
        .await
        .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    let held = env.peek(&env.dlq_queue, 2).await;
    assert_eq!(
        held.len(),
        1,
        "the message left the DLQ; log:\n{}",
        warren.logs()
    );
    let counted = header(&held[0].properties, "x-dlq-attempts")
        .and_then(as_int)
        .expect("x-dlq-attempts");
    assert!(
        (1..4).contains(&counted),
        "x-dlq-attempts = {counted} after the first life"
    );
    assert_eq!(parked_count(&env).await, 0, "parked before its attempts");

    // The second life goes on from the message's count and parks it at the bound.
    let mut warren = env.start(&["--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "the slow message parked",
        Duration::from_secs(60),
        || async { parked_count(&env).await >= 1 },
    )
    .await;
    let sentinel = Uuid::new_v4();
    publish_exhausted_user(&env, sentinel).await;
    wait_inserted_and_dlq_empty(&env, sentinel).await;
    stop_with_everything_acked(&env, &mut warren).await;
    let rows = env
        .db
        .query(
            "SELECT message_id, error_kind, error_reason, headers FROM dead_letters",
            &[],
        )
        .await
        .expect("parked rows");
    assert_eq!(rows.len(), 1, "parked once");
    let (id, kind, reason, headers): (String, String, String, serde_json::Value) = (
        rows[0].get(0),
        rows[0].get(1),
        rows[0].get(2),
        rows[0].get(3),
    );
    assert_eq!(id, slow.to_string());
    assert_eq!(kind, "retries_exhausted");
    assert!(
        reason.contains("57014")
            && reason.contains("statement timeout")
            && reason.contains("gave up after 4 attempts"),
        "{reason:?}"
    );
    assert_eq!(headers["x-dlq-attempts"], 3, "{headers}");
    assert!(!env.row_ids().await.contains(&slow));
    assert_eq!(env.count_rows().await, 1, "the sentinel only");
}

/// A DLQ message whose insert outlasts warren's own bound on it (`DATABASE_STATEMENT_TIMEOUT_MS`
/// + 2 s) while each of its statements stays under the server's timeout: a newer version of an
/// order whose items take two slow statements (the old items deleted, the new ones inserted).
/// warren cancels it and drops the connection; the database still answers, so the message's
/// own work is at fault, not an outage: each try is a counted attempt and the message is parked
/// after `dlq_max_attempts` with a reason naming the bound. (Before, a bound passed on the
/// client counted as "no database", never as an attempt: the message cycled for ever.)
#[tokio::test(flavor = "multi_thread")]
async fn a_dlq_message_whose_statements_outlast_the_client_bound_is_parked() {
    let mut env = TestEnv::new("dlq_client_bound").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "3000");
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(
        &path,
        format!(
            "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
             on_conflict = \"update\"\nversion_column = \"version\"\nbatch_timeout_ms = 20\n\
             dlq_max_attempts = 2\nretry_ttls_ms = [1000]\n{}\n{NESTED_ORDERS}",
            names.toml()
        ),
    )
    .expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    // Version 1 is stored; then every statement on the items takes 2.8 s (under the server's
    // 3 s), so version 2's delete and insert of its items take 5.6 s (over warren's 5 s).
    let id = Uuid::new_v4();
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            INSERT INTO {s}.orders VALUES ('{id}', 1, 1);
            INSERT INTO {s}.order_items VALUES ('{id}', 1, 'A', 1);
            CREATE FUNCTION {s}.slow_items() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                PERFORM pg_sleep(2.8);
                RETURN NULL;
            END $f$;
            CREATE TRIGGER order_items_slow AFTER INSERT OR DELETE ON {s}.order_items
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.slow_items();
            "#
        ))
        .await
        .expect("the stored version and the slow trigger");
    let body = serde_json::json!({"order_id": id, "total": 2, "version": 2,
        "items": [{"sku": "B", "qty": 2}]})
    .to_string()
    .into_bytes();
    env.publish_to(
        &names.dlx,
        &names.dlq,
        &body,
        dead_lettered(&id.to_string(), "retries_exhausted", 1),
    )
    .await;

    let mut warren = env.start(&["--config", &file, "--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("the order parked", Duration::from_secs(60), || async {
        parked_count(&env).await >= 1
    })
    .await;
    wait_until("the DLQ empty", Duration::from_secs(10), || async {
        env.queue_state(&names.dlq).await.0 == 0
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    // Acked, not merely held: nothing came back when warren closed its channel.
    assert_eq!(env.queue_state(&names.dlq).await, (0, 0));
    let rows = env
        .db
        .query(
            "SELECT message_id, error_kind, error_reason FROM dead_letters",
            &[],
        )
        .await
        .expect("parked rows");
    assert_eq!(rows.len(), 1, "parked once");
    let (mid, kind, reason): (String, String, String) =
        (rows[0].get(0), rows[0].get(1), rows[0].get(2));
    assert_eq!(mid, id.to_string());
    assert_eq!(kind, "retries_exhausted");
    assert!(
        reason.contains("gave up after 2 attempts") && reason.contains("5000 ms"),
        "{reason:?}"
    );
    // Version 1 and its item are still what is stored: nothing of version 2 committed.
    assert_eq!(
        count_of(
            &env,
            &format!("SELECT count(*) FROM orders WHERE order_id = '{id}' AND version = 1")
        )
        .await,
        1
    );
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM order_items WHERE sku = 'A'").await,
        1
    );
}

/// A DLQ batch of 20 messages, one of which times out (a trigger sleeping past a 300 ms
/// `statement_timeout` for its key): the timeout is the slow message's, not its neighbours'.
/// The batch is split to find it within the same delivery, the 19 others are inserted once,
/// and only the slow message spends attempts and is parked once, after `DLQ_MAX_ATTEMPTS`.
/// The search is bounded as a bisection is: each delivery's isolation meets at most
/// ceil(log2 20) + 2 = 7 timeouts, not 20. (Before, a timeout failed the whole batch: every
/// message spent an attempt with the slow one each time and all 20 were parked.)
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_message_in_a_dlq_batch_is_isolated_and_its_neighbours_inserted() {
    let mut env = TestEnv::new("dlq_slow_one").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "300")
        .set("LOG_FORMAT", "json")
        .set("USERS_BATCH_MIN_WAIT_MS", "500")
        .set("USERS_BATCH_TIMEOUT_MS", "1000")
        .set("DLQ_MAX_ATTEMPTS", "3");
    env.declare();
    install_slow_trigger(&env).await;
    let ids: Vec<Uuid> = (0..20).map(|_| Uuid::new_v4()).collect();
    let slow = ids[7];
    for &id in &ids {
        let body = if id == slow {
            slow_user_body(id)
        } else {
            user_body(id)
        };
        env.publish_to_dlq(
            &body,
            dead_lettered(&id.to_string(), "retries_exhausted", 3),
        )
        .await;
    }
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 20);

    let mut warren = env.start(&["--roles", "dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "something parked and the DLQ empty",
        Duration::from_secs(60),
        || async { parked_count(&env).await >= 1 && env.queue_state(&env.dlq_queue).await.0 == 0 },
    )
    .await;
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "dlq")],
    )
    .await;
    stop_with_everything_acked(&env, &mut warren).await;

    let innocent: std::collections::HashSet<Uuid> =
        ids.iter().copied().filter(|&id| id != slow).collect();
    assert_eq!(
        env.row_ids().await,
        innocent,
        "the 19 others inserted, the slow one not; log:\n{}",
        warren.logs()
    );
    let rows = env
        .db
        .query(
            "SELECT message_id, error_kind, error_reason, park_count FROM dead_letters",
            &[],
        )
        .await
        .expect("parked rows");
    let parked: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(parked, vec![slow.to_string()], "only the slow one parked");
    let (kind, reason, park_count): (String, String, i32) =
        (rows[0].get(1), rows[0].get(2), rows[0].get(3));
    assert_eq!(kind, "retries_exhausted");
    assert_eq!(park_count, 1, "parked once");
    assert!(
        reason.contains("57014") && reason.contains("gave up after 3 attempts"),
        "{reason:?}"
    );
    // Only the slow message went back to the DLQ for another attempt (twice: the third parks).
    assert_eq!(retried, 2.0, "DLQ attempts republished");
    // Each delivery's search met at most 7 timeouts.
    let log = warren.logs();
    let searches: Vec<u64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["timed_out"].as_u64())
        .collect();
    assert!(!searches.is_empty(), "no isolation of a timeout logged");
    assert!(
        searches.iter().all(|&n| n <= 7),
        "timeouts met per isolation: {searches:?}"
    );
}
