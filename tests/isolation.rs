//! Row isolation: a row whose email is stored under another id (or earlier in its batch) is found
//! by the batch's one insert, and copies of a row inserted at the same moment are each a success.
//! A batch the database refuses (a CHECK constraint, SQLSTATE 23514) is split in halves until
//! only the offending rows fail, also when a shutdown begins while the batch is in the
//! database; the others are committed, the offenders go to the DLQ as `db_permanent` and no
//! retry is spent on them. A batch refused with an unclassified code (a trigger's P0001) is split
//! the same way once its in-place retries are spent. A message whose id is stored with other
//! content is dead-lettered as `id_conflict`.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use uuid::Uuid;
use warren::domain::Domain;

/// A user body with a chosen email.
fn body(id: Uuid, email: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","name":"user {id}","email":"{email}"}}"#).into_bytes()
}

/// 1,000 messages in one batch, 3 of them reusing the email of another message of the batch:
/// 997 rows, the 3 losers of the duplicates in the DLQ as db_permanent, nothing retried, and no
/// split: the one insert skips them and tells why.
#[tokio::test(flavor = "multi_thread")]
async fn duplicate_emails_in_a_batch_of_1000_are_isolated_and_dead_lettered() {
    const N: usize = 1000;
    // (position reusing an email, position whose email it reuses)
    const DUPLICATES: [(usize, usize); 3] = [(400, 5), (700, 300), (999, 600)];
    let mut env = TestEnv::new("isolate_dup").await;
    env.set("USERS_BATCH_SIZE", "1000")
        .set("USERS_BATCH_CONCURRENCY", "1")
        .set("USERS_BATCH_TIMEOUT_MS", "2000")
        .set("USERS_BATCH_MIN_WAIT_MS", "2000");
    env.declare();

    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::new_v4()).collect();
    let mut emails: Vec<String> = ids.iter().map(|id| format!("{id}@example.com")).collect();
    for (dup, orig) in DUPLICATES {
        emails[dup] = emails[orig].clone();
    }
    // Published (pipelined confirms) before warren starts, so they form one batch.
    env.publish_pipelined(
        ids.iter()
            .zip(&emails)
            .map(|(id, email)| (body(*id, email), json_props(*id))),
    )
    .await;
    assert_eq!(env.queue_state(&env.main_queue).await.0 as usize, N);

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("997 rows", Duration::from_secs(60), || async {
        env.count_rows().await == (N - DUPLICATES.len()) as i64
    })
    .await;
    wait_until("3 messages in the DLQ", Duration::from_secs(20), || async {
        env.queue_state(&env.dlq_queue).await.0 as usize == DUPLICATES.len()
    })
    .await;

    // One batch of 1,000 valid messages, no retry, 3 dead-lettered as db_permanent.
    let batches = metric(
        &env,
        "warren_batch_size_count",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    let batched = metric(
        &env,
        "warren_batch_size_sum",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    assert_eq!(
        (batches, batched),
        (1.0, N as f64),
        "the messages did not form one batch; log:\n{}",
        warren.logs()
    );
    let retried = metric(&env, "warren_messages_retried_total", &[]).await;
    assert_eq!(retried, 0.0, "messages were sent to the retry queue");
    let permanent = metric(
        &env,
        "warren_messages_dead_lettered_total",
        &[("kind", "db_permanent")],
    )
    .await;
    assert_eq!(permanent, DUPLICATES.len() as f64);
    let inserted = metric(
        &env,
        "warren_messages_inserted_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    assert_eq!(inserted, (N - DUPLICATES.len()) as f64);
    assert!(
        !warren
            .logs()
            .contains("batch split to isolate refused rows"),
        "the batch was split:\n{}",
        warren.logs()
    );

    assert!(warren.terminate(Duration::from_secs(25)).success());
    // Everything settled: nothing came back to the main queue, the retry queue (10 s TTL, so a
    // retried message would still be there) received nothing.
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;

    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(dead.len(), DUPLICATES.len());
    let dead_ids: HashSet<Uuid> = dead.iter().map(message_uuid).collect();
    let rows = env.row_ids().await;
    for (dup, orig) in DUPLICATES {
        let (a, b) = (ids[dup], ids[orig]);
        assert!(
            rows.contains(&a) != rows.contains(&b),
            "exactly one of a duplicate pair is stored"
        );
        assert!(
            dead_ids.contains(&a) != dead_ids.contains(&b),
            "exactly one of a duplicate pair is dead-lettered"
        );
        assert!(dead_ids.contains(&a) != rows.contains(&a));
    }
    // Every message is either a row or in the DLQ.
    let all: HashSet<Uuid> = ids.iter().copied().collect();
    assert_eq!(rows.union(&dead_ids).copied().collect::<HashSet<_>>(), all);
    assert!(rows.is_disjoint(&dead_ids));

    let position = |id: Uuid| ids.iter().position(|x| *x == id).unwrap();
    for m in &dead {
        let p = &m.delivery.properties;
        let id = message_uuid(m);
        assert_eq!(
            m.delivery.data,
            body(id, &emails[position(id)]),
            "body changed"
        );
        assert_eq!(
            text_header(p, "x-error-kind").as_deref(),
            Some("db_permanent"),
            "{:?}",
            p.headers()
        );
        let reason = text_header(p, "x-error-reason").expect("x-error-reason");
        assert!(
            reason.contains("23505") && reason.contains("duplicate"),
            "x-error-reason {reason:?}"
        );
        // It names the id its email is stored under: the other message of its pair.
        let (dup, orig) = DUPLICATES
            .into_iter()
            .find(|(d, o)| ids[*d] == id || ids[*o] == id)
            .expect("a dead-lettered message is one of a pair");
        let holder = if ids[dup] == id { ids[orig] } else { ids[dup] };
        assert!(
            reason.contains(&format!("stored under id {holder}")),
            "x-error-reason {reason:?}"
        );
        assert_eq!(
            strict_int_header(p, "x-retries").unwrap_or(0),
            0,
            "a retry was spent"
        );
        assert_eq!(header(p, "x-retry-reason"), None);
    }
    // The stored emails are unique and every email of the batch is stored once.
    let stored: i64 = env
        .db
        .query_one("SELECT count(DISTINCT email) FROM users", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, (N - DUPLICATES.len()) as i64);
}

/// Copies of the same rows inserted at the same moment by separate statements (a redelivered
/// message meeting its first copy's statement still running, two instances, the main pipeline
/// and the DLQ consumer) are each an idempotent success. With `ON CONFLICT (id)` a losing copy
/// could fail with 23505 on `users_email_key` (its id check passed before the other copy's row
/// existed; its email check then waited for it), and its message was dead-lettered, or parked,
/// although its row was stored.
#[tokio::test(flavor = "multi_thread")]
async fn copies_of_a_row_inserted_at_the_same_moment_are_each_a_success() {
    const ROWS: usize = 300;
    const COPIES: usize = 4;
    let env = TestEnv::new("isolate_race").await;
    env.declare();
    let pool =
        warren::db::pool_for(&env.settings().database(), COPIES, "warren-test").expect("pool");
    // The users pipeline as warren runs it: its declaration, through the mapping.
    let mapping = Arc::new(
        warren::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles"),
    );
    let users: Arc<Vec<(Uuid, warren::domain::mapping::Row)>> = Arc::new(
        (0..ROWS)
            .map(|_| {
                let id = Uuid::new_v4();
                let body = serde_json::json!({
                    "id": id,
                    "name": format!("user {id}"),
                    "email": format!("{id}@example.com"),
                });
                let row = mapping
                    .decode(body.to_string().as_bytes())
                    .expect("a valid user");
                (id, row)
            })
            .collect(),
    );
    // Every copy inserts row k at the same moment, one statement a row.
    let barrier = Arc::new(tokio::sync::Barrier::new(COPIES));
    let copies = (0..COPIES).map(|_| {
        let (pool, users, barrier, mapping) = (
            pool.clone(),
            users.clone(),
            barrier.clone(),
            mapping.clone(),
        );
        tokio::spawn(async move {
            let client = pool.get().await.expect("a connection");
            let mut failures = Vec::new();
            for (id, row) in users.iter() {
                barrier.wait().await;
                match mapping.insert(&client, &[row]).await {
                    Ok(done) if done.conflicts.is_empty() && done.refused.is_empty() => {}
                    other => failures.push(format!("{id}: {other:?}")),
                }
            }
            failures
        })
    });
    let failures: Vec<String> = futures::future::join_all(copies)
        .await
        .into_iter()
        .flat_map(|copy| copy.expect("a copy's task"))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} inserts failed, for example {:?}",
        failures.len(),
        ROWS * COPIES,
        &failures[..failures.len().min(3)]
    );
    assert_eq!(env.count_rows().await, ROWS as i64);
}

/// One row raising P0001 in a batch of 500 no longer drags the batch through the retry queue
/// into the DLQ: the batch is split, 499 rows commit at once, and only the poisoned message goes
/// on: retried MAX_RETRIES times, dead-lettered as retries_exhausted, then tried by the DLQ
/// consumer DLQ_MAX_ATTEMPTS times and parked. Nothing loops, nothing is left in a queue.
#[tokio::test(flavor = "multi_thread")]
async fn an_unclassified_error_on_one_row_is_isolated_and_ends_parked() {
    const N: usize = 500;
    let mut env = TestEnv::new("isolate_p0001").await;
    env.set("USERS_BATCH_SIZE", "500")
        .set("USERS_BATCH_CONCURRENCY", "1")
        .set("USERS_BATCH_TIMEOUT_MS", "2000")
        .set("USERS_BATCH_MIN_WAIT_MS", "2000")
        .set("DB_RETRY_WINDOW_MS", "300")
        .set("MAX_RETRIES", "2")
        .set("RETRY_TTL_MS", "300")
        .set("DLQ_MAX_ATTEMPTS", "3");
    env.declare();
    install_poison_trigger(&env).await;

    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::new_v4()).collect();
    let poison = ids[250];
    env.publish_pipelined(ids.iter().map(|id| {
        let email = if *id == poison {
            format!("poison-{id}@example.com")
        } else {
            format!("{id}@example.com")
        };
        (body(*id, &email), json_props(*id))
    }))
    .await;
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let innocent: HashSet<Uuid> = ids.iter().copied().filter(|id| *id != poison).collect();
    assert_rows_exactly(&env, &innocent, Duration::from_secs(30), &|| warren.logs()).await;
    // The innocent rows were committed by the first batch: no retry was spent on them.
    let parked = wait_parked(&env, 1).await;
    assert_eq!(parked[0].0, poison.to_string());
    assert_eq!(parked[0].1, "retries_exhausted");
    assert!(
        parked[0].2.contains("P0001") && parked[0].2.contains("gave up after 3 attempts"),
        "{:?}",
        parked[0].2
    );
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    assert_eq!(
        retried, 2.0,
        "only the poisoned message is retried, MAX_RETRIES times"
    );
    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        assert_eq!(env.queue_state(q).await.0, 0, "{q} not empty");
    }
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(env.count_rows().await, (N - 1) as i64);
}

/// Waits until `n` rows are parked; returns (message_id, kind, reason) of each.
async fn wait_parked(env: &TestEnv, n: i64) -> Vec<(String, String, String)> {
    wait_until(&format!("{n} parked"), Duration::from_secs(60), || async {
        count_of(env, "SELECT count(*) FROM dead_letters").await >= n
    })
    .await;
    env.db
        .query(
            "SELECT coalesce(message_id, ''), error_kind, error_reason FROM dead_letters ORDER BY seq",
            &[],
        )
        .await
        .expect("parked rows")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The same id with another name is not "already inserted": it is dead-lettered as id_conflict
/// with the stored row untouched, while the very same message again is an idempotent success.
/// Both cases in one batch and across batches.
#[tokio::test(flavor = "multi_thread")]
async fn same_id_other_content_is_dead_lettered_as_id_conflict() {
    let env = TestEnv::new("id_conflict").await;
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let stored = Uuid::new_v4();
    let email = format!("{stored}@example.com");
    env.publish_raw(&body(stored, &email), json_props(stored))
        .await;
    wait_until("the first row", Duration::from_secs(20), || async {
        env.count_rows().await == 1
    })
    .await;

    // Across batches: the same message again (a duplicate delivery), and the same id renamed.
    let renamed = format!(r#"{{"id":"{stored}","name":"someone else","email":"{email}"}}"#);
    env.publish_raw(&body(stored, &email), json_props(stored))
        .await;
    env.publish_raw(renamed.as_bytes(), labelled_props("renamed"))
        .await;
    // In one batch: a new id twice, with two different emails.
    let twice = Uuid::new_v4();
    env.publish_pipelined([
        (
            body(twice, &format!("{twice}@example.com")),
            labelled_props("twice-a"),
        ),
        (
            body(twice, &format!("{twice}@example.org")),
            labelled_props("twice-b"),
        ),
    ])
    .await;

    wait_until("2 messages in the DLQ", Duration::from_secs(20), || async {
        env.queue_state(&env.dlq_queue).await.0 == 2
    })
    .await;
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    let mut labels: Vec<(String, String, String)> = dead
        .iter()
        .map(|m| {
            let p = &m.delivery.properties;
            (
                message_id(m),
                text_header(p, "x-error-kind").unwrap_or_default(),
                text_header(p, "x-error-reason").unwrap_or_default(),
            )
        })
        .collect();
    labels.sort();
    assert_eq!(labels[0].0, "renamed");
    assert_eq!(labels[0].1, "id_conflict");
    assert!(labels[0].2.contains("another name"), "{:?}", labels[0]);
    assert_eq!(labels[1].1, "id_conflict");
    assert!(labels[1].2.contains("another email"), "{:?}", labels[1]);
    // The stored rows are the first versions.
    let row = env
        .db
        .query_one("SELECT name FROM users WHERE id = $1", &[&stored])
        .await
        .expect("row");
    assert_eq!(row.get::<_, String>(0), format!("user {stored}"));
    assert_eq!(env.count_rows().await, 2);
    let conflicts = metric(
        &env,
        "warren_messages_dead_lettered_total",
        &[
            ("pipeline", "users"),
            ("stage", "main"),
            ("kind", "id_conflict"),
        ],
    )
    .await;
    assert_eq!(conflicts, 2.0);
    warren.terminate_ok(Duration::from_secs(20));
    assert_queue_empty(&env, &env.main_queue).await;
}

/// JSON properties with `label` as the message id.
fn labelled_props(label: &str) -> lapin::BasicProperties {
    lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id(label.into())
}

/// A shutdown that begins while a batch is in the database still splits the batch when one row
/// is refused (here by a CHECK constraint, SQLSTATE 23514): the others commit, only the offender
/// goes its way. Found by the ledger test: the DLQ consumer, stopped for DLQ maintenance with a
/// batch in flight, parked 166 good messages as `db_permanent` for one refused row among them.
async fn a_refused_row_as_shutdown_begins(role: &str) {
    const N: usize = 20;
    let mut env = TestEnv::new(&format!("isolate_stop_{role}")).await;
    env.set("USERS_BATCH_SIZE", N.to_string())
        .set("USERS_BATCH_CONCURRENCY", "1")
        .set("USERS_BATCH_TIMEOUT_MS", "2000")
        .set("USERS_BATCH_MIN_WAIT_MS", "2000")
        .set("SHUTDOWN_TIMEOUT_MS", "20000");
    env.declare();
    // The database refuses one email for good.
    env.db
        .batch_execute(
            "ALTER TABLE users ADD CONSTRAINT not_refused CHECK (email <> 'refused@example.com')",
        )
        .await
        .expect("the CHECK constraint");
    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::new_v4()).collect();
    let offender = ids[N / 2];
    for id in &ids {
        let email = if *id == offender {
            "refused@example.com".to_string()
        } else {
            format!("{id}@example.com")
        };
        let body = body(*id, &email);
        if role == "dlq" {
            let props = dead_letter_props(&id.to_string(), "retries_exhausted", 3, "db down");
            env.publish_to_dlq(&body, props).await;
        } else {
            env.publish_raw(&body, json_props(*id)).await;
        }
    }

    let locker = InsertLock::take(&env).await;
    let mut warren = env.start(&["--roles", role]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    locker.wait_for_a_blocked_insert(&env).await;
    warren.begin_shutdown().await;
    locker.release().await;
    let status = warren.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "log:\n{}", warren.logs());

    let expected: HashSet<Uuid> = ids.iter().copied().filter(|id| *id != offender).collect();
    assert_eq!(env.row_ids().await, expected, "log:\n{}", warren.logs());
    if role == "dlq" {
        let parked = wait_parked(&env, 1).await;
        assert_eq!(parked.len(), 1, "{parked:?}");
        assert_eq!(parked[0].0, offender.to_string());
        assert_eq!(parked[0].1, "db_permanent");
        assert_queue_empty(&env, &env.dlq_queue).await;
    } else {
        let dead = env.drain_queue(&env.dlq_queue, N).await;
        let dead: Vec<Uuid> = dead.iter().map(message_uuid).collect();
        assert_eq!(dead, [offender], "log:\n{}", warren.logs());
        assert_queue_empty(&env, &env.main_queue).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_row_as_shutdown_begins_takes_only_itself_to_the_dlq() {
    a_refused_row_as_shutdown_begins("consumer").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_row_as_shutdown_begins_is_the_only_one_the_dlq_consumer_parks() {
    a_refused_row_as_shutdown_begins("dlq").await;
}

/// A copy of a stored message that a CHECK added since refuses is done, not refused: the first
/// copy committed (a redelivery after a lost ack, a publisher's retry), then the table gained a
/// constraint the row does not meet (PostgreSQL checks it before ON CONFLICT sees the
/// duplicate). Before, the copy went to the DLQ as db_permanent and was parked: the message in
/// the table and in parking both. A different message the CHECK refuses is still parked.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_of_a_stored_row_that_a_new_check_refuses_is_done_not_parked() {
    let mut env = TestEnv::new("isolate_copy").await;
    env.set("USERS_BATCH_TIMEOUT_MS", "100")
        .set("DB_RETRY_WINDOW_MS", "300")
        .set("DLQ_MAX_ATTEMPTS", "2");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let first = Uuid::new_v4();
    let zz = |id: Uuid| {
        format!(r#"{{"id":"{id}","name":"zz {id}","email":"{id}@example.com"}}"#).into_bytes()
    };
    env.publish_raw(&zz(first), json_props(first)).await;
    wait_until("the first copy stored", Duration::from_secs(30), || async {
        env.row_ids().await.contains(&first)
    })
    .await;
    env.db
        .batch_execute(
            "ALTER TABLE users ADD CONSTRAINT no_zz CHECK (name NOT LIKE 'zz%') NOT VALID",
        )
        .await
        .expect("add the CHECK");

    // The same message again (a redelivery or a publisher's retry), with good ones around it,
    // and a new message the CHECK refuses.
    let refused = Uuid::new_v4();
    let good: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    env.publish_raw(
        &body(good[0], &format!("{}@example.com", good[0])),
        json_props(good[0]),
    )
    .await;
    env.publish_raw(&zz(first), json_props(first)).await;
    env.publish_raw(&zz(refused), json_props(refused)).await;
    for id in &good[1..] {
        env.publish_raw(&body(*id, &format!("{id}@example.com")), json_props(*id))
            .await;
    }
    let parked = wait_parked(&env, 1).await;
    assert_eq!(parked[0].0, refused.to_string(), "{parked:?}");
    assert_eq!(parked[0].1, "db_permanent", "{parked:?}");
    let mut expected: HashSet<Uuid> = good.iter().copied().collect();
    expected.insert(first);
    assert_rows_exactly(&env, &expected, Duration::from_secs(30), &|| warren.logs()).await;
    // The copy was found stored (done), then a sentinel behind everything, then nothing in
    // flight anywhere: a copy sent on to the DLQ or the retry tier would be counted there or
    // parked by now.
    warren
        .wait_for_log(
            "the copy found stored",
            "a refused row is already stored as it is",
        )
        .await;
    let sentinel = env.publish_users(1).await[0];
    expected.insert(sentinel);
    assert_rows_exactly(&env, &expected, Duration::from_secs(30), &|| warren.logs()).await;
    wait_queues_settled(
        &[&env.main_queue, &env.retry_queue, &env.dlq_queue],
        Duration::from_secs(30),
    )
    .await;
    let parked = count_of(&env, "SELECT count(*) FROM dead_letters").await;
    assert_eq!(parked, 1, "only the new refused message is parked");
    for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
        assert_eq!(env.queue_state(q).await.0, 0, "{q} not empty");
    }
    assert!(
        warren
            .logs()
            .contains("a refused row is already stored as it is"),
        "{}",
        warren.logs()
    );
    warren.terminate_ok(Duration::from_secs(30));
}

/// Found by review: two instances inserting copies of the same users in other orders (each
/// chunk of 50 published forwards and then backwards) deadlocked every few seconds (40P01); each
/// deadlock held its batch for the database's deadlock timeout, and the acks behind it went one
/// by one (about 50 acks a batch). Rows now go in key order: every user lands once, no deadlock
/// is logged, and the acks stay about one a batch.
#[tokio::test(flavor = "multi_thread")]
async fn copies_in_other_orders_from_two_instances_do_not_deadlock() {
    let mut env = TestEnv::new("iso_order").await;
    env.set("USERS_BATCH_SIZE", "200")
        .set("USERS_BATCH_CONCURRENCY", "4");
    env.declare();
    let mut second = env.command(&["run", "--roles", "consumer"]);
    second.env("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    let log_b = env.log_path();
    let file = std::fs::File::create(&log_b).expect("log file");
    let b = second
        .stdout(std::process::Stdio::null())
        .stderr(file)
        .spawn()
        .expect("start the second warren");
    let mut b = Warren::new(b, log_b);
    let mut a = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![a.log.clone(), b.log.clone()]);
    let ids: Vec<Uuid> = (0..12_000).map(|_| Uuid::new_v4()).collect();
    let mut messages = Vec::new();
    for chunk in ids.chunks(50) {
        for id in chunk.iter().chain(chunk.iter().rev()) {
            messages.push((body(*id, &format!("u-{id}@example.com")), json_props(*id)));
        }
    }
    env.publish_pipelined(messages).await;
    let expected: HashSet<Uuid> = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &|| {
        format!("{}\n{}", a.logs(), b.logs())
    })
    .await;
    let (acks, batches) = acks_and_batches(&env).await;
    a.terminate_ok(Duration::from_secs(30));
    b.terminate_ok(Duration::from_secs(30));
    let logs = format!("{}\n{}", a.logs(), b.logs());
    assert!(!logs.contains("40P01"), "a deadlock:\n{logs}");
    assert!(
        batches > 0.0 && acks <= 3.0 * batches,
        "instance A: {acks} acks for {batches} batches"
    );
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0, "nothing parked");
}
