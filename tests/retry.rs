//! Transient database failures through the retry queue: `x-retries` + 1 and `x-retry-reason` on
//! each pass, the retry queue's TTL bringing messages back, insertion once the fault clears, the
//! DLQ with `retries_exhausted` once MAX_RETRIES is spent, and retry tiers (RETRY_TTLS_MS): the
//! n-th retry through the n-th tier's queue.
//!
//! The fault is the harness's trigger pair (`install_fault` with `CountAttempts::Yes`), installed
//! in the test schema after `declare`: a BEFORE INSERT row trigger counts every insert attempt per
//! id in a sequence of its own (`nextval` is not rolled back, so the count survives the failed
//! statement), and an AFTER INSERT statement trigger raises `serialization_failure` (SQLSTATE
//! 40001) while `fault_flag.active` is set. Every row of a batch is therefore counted before the
//! statement fails.

mod common;

use std::time::{Duration, Instant};

use common::cluster::QueueCleanup;
use common::*;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use uuid::Uuid;

// ---- this file's setup ----------------------------------------------------------------------

/// Declares, installs the counting fault, publishes `n` tracked users and starts a consumer:
/// (their ids, the consumer).
async fn publish_into_a_failing_database(env: &TestEnv, n: usize) -> (Vec<Uuid>, Warren) {
    env.declare();
    install_fault(env, CountAttempts::Yes).await;
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    track_attempts(env, &ids).await;
    env.publish_ids(&ids).await;
    (ids, env.start(&["--roles", "consumer"]))
}

// ---- tests ----------------------------------------------------------------------------------

/// A failure that clears: one pass through the retry queue with x-retries = 1, back after the
/// TTL, inserted once the fault is gone, every id exactly once, every queue empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_transient_failure_goes_through_the_retry_queue_until_it_clears() {
    const N: usize = 20;
    let mut env = TestEnv::new("retry_clears").await;
    env.set("RETRY_TTL_MS", "3000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "10")
        // Retry-queue semantics only: the sink-outage breaker must not hold the consumer.
        .set("BREAKER_FAILURES", "1000");
    let (ids, mut warren) = publish_into_a_failing_database(&env, N).await;

    // First failure: every message waits in the retry queue, counted once, tagged.
    wait_until(
        "all messages in the retry queue",
        Duration::from_secs(20),
        || async { env.ready(&env.retry_queue).await as usize == N },
    )
    .await;
    let first_pass_seen = Instant::now();
    let peeked = env.peek(&env.retry_queue, N).await;
    assert_eq!(peeked.len(), N, "log:\n{}", warren.logs());
    for m in &peeked {
        let p = &m.delivery.properties;
        let id = message_uuid(m);
        assert!(ids.contains(&id));
        assert_eq!(m.delivery.data, user_body(id), "body changed on retry");
        assert!(
            matches!(header(p, "x-retries"), Some(AMQPValue::LongLongInt(1))),
            "x-retries after the first failure: {:?}",
            header(p, "x-retries")
        );
        let reason = text_header(p, "x-retry-reason").expect("x-retry-reason");
        assert!(reason.starts_with("db_error"), "x-retry-reason {reason:?}");
        assert!(reason.contains("40001"), "x-retry-reason {reason:?}");
        assert_eq!(
            header(p, "x-error-kind"),
            None,
            "a retry is not dead-lettered"
        );
    }
    for id in &ids {
        assert_eq!(
            attempts(&env, *id).await,
            1,
            "attempts of {id} before the TTL"
        );
    }
    assert_eq!(env.count_rows().await, 0);

    // After the TTL the broker brings them back and they fail again.
    wait_until(
        "every message tried a second time",
        Duration::from_secs(20),
        || async {
            for id in &ids {
                if attempts(&env, *id).await < 2 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let back_after = first_pass_seen.elapsed();
    assert!(
        back_after >= Duration::from_millis(2500),
        "second attempt {back_after:?} after the first pass was seen, TTL is 3000 ms"
    );
    assert_eq!(env.count_rows().await, 0);
    assert_queue_empty(&env, &env.dlq_queue).await;

    clear_fault(&env).await;
    wait_until("every row inserted", Duration::from_secs(30), || async {
        env.count_rows().await == N as i64
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    wait_until(
        "main, retry and DLQ empty",
        Duration::from_secs(15),
        || async {
            env.ready(&env.main_queue).await == 0
                && env.ready(&env.retry_queue).await == 0
                && env.ready(&env.dlq_queue).await == 0
        },
    )
    .await;

    // Exactly once: every attempt either went to the retry queue or committed, and each message
    // committed once.
    let inserted = metric(
        &env,
        "warren_messages_inserted_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    let mut total_attempts = 0;
    for id in &ids {
        let a = attempts(&env, *id).await;
        // Two failures seen before the fault was cleared, then the commit (the second attempt
        // may itself have committed if it read the flag just after it was cleared).
        assert!(a >= 2, "{id} tried {a} times");
        total_attempts += a;
    }
    assert_eq!(inserted, N as f64, "messages committed");
    assert_eq!(
        total_attempts as f64,
        retried + inserted,
        "attempts = retries + commits"
    );

    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
    assert_eq!(env.count_rows().await, N as i64);
}

/// A failure that never clears: each message is tried 1 + MAX_RETRIES times, then dead-lettered
/// with x-retries = MAX_RETRIES and x-error-kind = retries_exhausted.
#[tokio::test(flavor = "multi_thread")]
async fn a_failure_that_never_clears_ends_in_the_dlq_after_max_retries() {
    const N: usize = 5;
    let mut env = TestEnv::new("retry_exhausted").await;
    env.set("RETRY_TTL_MS", "1000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "3")
        // Without this the sink-outage breaker (BREAKER_FAILURES, default 3) holds the consumer
        // while the database keeps failing, and the retries are never spent.
        .set("BREAKER_FAILURES", "1000");
    let (ids, mut warren) = publish_into_a_failing_database(&env, N).await;

    wait_until(
        "every message in the DLQ",
        Duration::from_secs(40),
        || async { env.ready(&env.dlq_queue).await as usize == N },
    )
    .await;
    wait_until(
        "main and retry queues empty",
        Duration::from_secs(10),
        || async {
            env.ready(&env.main_queue).await == 0 && env.ready(&env.retry_queue).await == 0
        },
    )
    .await;
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    let exhausted = metric(
        &env,
        "warren_messages_dead_lettered_total",
        &[
            ("pipeline", "users"),
            ("stage", "main"),
            ("kind", "retries_exhausted"),
        ],
    )
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());

    // Counted after warren stopped: no attempt can still be on its way.
    for id in &ids {
        assert_eq!(
            attempts(&env, *id).await,
            4,
            "attempts of {id}: 1 + 3 retries"
        );
    }
    assert_eq!(retried, (3 * N) as f64, "republishes to the retry queue");
    assert_eq!(exhausted, N as f64, "dead-lettered as retries_exhausted");

    let dead = env.drain_queue(&env.dlq_queue, N + 5).await;
    assert_eq!(dead.len(), N);
    for m in &dead {
        let p = &m.delivery.properties;
        let id = message_uuid(m);
        assert!(ids.contains(&id));
        assert_eq!(m.delivery.data, user_body(id), "body changed");
        assert_eq!(int_header(p, "x-retries"), Some(3), "{:?}", p.headers());
        assert_eq!(
            text_header(p, "x-error-kind").as_deref(),
            Some("retries_exhausted")
        );
        let reason = text_header(p, "x-error-reason").expect("x-error-reason");
        assert!(
            reason.contains("retries exhausted after 3") && reason.contains("db_error"),
            "x-error-reason {reason:?}"
        );
    }
    assert_eq!(env.count_rows().await, 0);
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
}

/// At the default RETRY_TTL_MS (10 s) a retried message comes back after ~10 s, not before 9 s.
#[tokio::test(flavor = "multi_thread")]
async fn at_the_default_ttl_a_retried_message_comes_back_after_ten_seconds() {
    let mut env = TestEnv::new("retry_default_ttl").await;
    env.set("DB_RETRY_WINDOW_MS", "0");
    let (ids, mut warren) = publish_into_a_failing_database(&env, 1).await;
    let id = ids[0];

    wait_until(
        "the message failed once and sits in the retry queue",
        Duration::from_secs(20),
        || async { attempts(&env, id).await == 1 && env.ready(&env.retry_queue).await == 1 },
    )
    .await;
    // Seen at most one poll after it entered the retry queue: `elapsed` below underestimates
    // the time it spent there, so the lower bound is safe.
    let seen_in_retry = Instant::now();
    clear_fault(&env).await;
    // `wait_until` under an outer bound, so a miss reports the queues and warren's log.
    let row = wait_until("the row", Duration::from_secs(60), || async {
        env.row_ids().await.contains(&id)
    });
    if tokio::time::timeout(Duration::from_secs(20), row)
        .await
        .is_err()
    {
        panic!(
            "no row 20 s after the retry (attempts {}, main {:?}, retry {:?}, dlq {:?}); log:\n{}",
            attempts(&env, id).await,
            env.queue_state(&env.main_queue).await,
            env.queue_state(&env.retry_queue).await,
            env.queue_state(&env.dlq_queue).await,
            warren.logs()
        );
    }
    let elapsed = seen_in_retry.elapsed();
    assert!(
        elapsed >= Duration::from_secs(9),
        "back after {elapsed:?}, before the 10 s TTL"
    );
    assert!(
        elapsed <= Duration::from_secs(13),
        "back after {elapsed:?}, long after the 10 s TTL"
    );
    assert_eq!(attempts(&env, id).await, 2);
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
}

/// RETRY_TTLS_MS=300,600,900: one queue per tier, named from RETRY_QUEUE, and a message failing
/// every time goes through tier 1, 2 and 3 in that order (x-retries 1, 2, 3), waits in each (the
/// broker records each expiry in x-death), then goes to the DLQ as retries_exhausted.
#[tokio::test(flavor = "multi_thread")]
async fn each_retry_goes_through_its_tier_in_order() {
    let mut env = TestEnv::new("retry_tiers").await;
    let tiers: Vec<(String, u64)> = [("300ms", 300), ("600ms", 600), ("900ms", 900)]
        .into_iter()
        .map(|(suffix, ttl)| (format!("{}_{suffix}", env.retry_queue), ttl))
        .collect();
    // Sees every republish to the retry exchange, in order, with its routing key.
    let observer = format!("{}_observer", env.id);
    let mut extra: Vec<String> = tiers.iter().map(|(q, _)| q.clone()).collect();
    extra.push(observer.clone());
    let _cleanup = QueueCleanup {
        url: amqp_url(),
        queues: extra,
    };
    env.set("RETRY_TTLS_MS", "300,600,900")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "3")
        .set("BREAKER_FAILURES", "1000");
    env.declare();

    // One queue per tier with its TTL, back to the main queue; RETRY_QUEUE itself is only the
    // base of their names.
    let listed = rabbitmqctl_rows(&["list_queues", "name", "arguments"]).await;
    for (queue, ttl) in &tiers {
        let row = listed
            .iter()
            .find(|r| r["name"].as_str() == Some(queue))
            .unwrap_or_else(|| panic!("tier queue {queue} not declared"));
        let args: Vec<(String, serde_json::Value)> = row["arguments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (a[0].as_str().unwrap().to_string(), a[2].clone()))
            .collect();
        assert!(
            args.contains(&("x-message-ttl".into(), json!(ttl))),
            "{queue}: {args:?}"
        );
        assert!(
            args.contains(&("x-dead-letter-routing-key".into(), json!(env.main_queue))),
            "{queue}: {args:?}"
        );
    }
    assert!(!env.queue_exists(&env.retry_queue).await);
    env.channel
        .queue_declare(
            observer.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("observer queue");
    for (queue, _) in &tiers {
        env.channel
            .queue_bind(
                observer.as_str().into(),
                env.retry_exchange.as_str().into(),
                queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the observer");
    }

    install_fault(&env, CountAttempts::Yes).await;
    let id = Uuid::new_v4();
    track_attempts(&env, &[id]).await;
    env.publish_ids(&[id]).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until(
        "the message in the DLQ after 3 retries",
        Duration::from_secs(40),
        || async { env.ready(&env.dlq_queue).await == 1 },
    )
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(attempts(&env, id).await, 4, "attempts: 1 + 3 retries");

    let copies = env.drain_queue(&observer, 10).await;
    let seen: Vec<(String, Option<i64>)> = copies
        .iter()
        .map(|m| {
            (
                m.delivery.routing_key.to_string(),
                int_header(&m.delivery.properties, "x-retries"),
            )
        })
        .collect();
    let wanted: Vec<(String, Option<i64>)> = tiers
        .iter()
        .zip(1..)
        .map(|((q, _), n)| (q.clone(), Some(n)))
        .collect();
    assert_eq!(seen, wanted, "retries and the tiers they went to, in order");

    // The broker's own record: the message expired once in each tier queue.
    let dead = env.drain_queue(&env.dlq_queue, 5).await;
    assert_eq!(dead.len(), 1);
    let p = &dead[0].delivery.properties;
    assert_eq!(int_header(p, "x-retries"), Some(3));
    assert_eq!(
        text_header(p, "x-error-kind").as_deref(),
        Some("retries_exhausted")
    );
    let Some(AMQPValue::FieldArray(deaths)) = header(p, "x-death") else {
        panic!("no x-death: {:?}", p.headers());
    };
    let mut expired: Vec<String> = deaths
        .as_slice()
        .iter()
        .filter_map(|d| match d {
            AMQPValue::FieldTable(t) => {
                let get = |k: &str| match t.inner().get(k) {
                    Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                    _ => None,
                };
                (get("reason").as_deref() == Some("expired")).then(|| get("queue"))?
            }
            _ => None,
        })
        .collect();
    expired.sort();
    let mut tier_names: Vec<String> = tiers.iter().map(|(q, _)| q.clone()).collect();
    tier_names.sort();
    assert_eq!(expired, tier_names, "queues the message expired in");
    for (queue, _) in &tiers {
        assert_queue_empty(&env, queue).await;
    }
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}

/// A batch of 20 in which one message's insert times out (a trigger sleeping past a 300 ms
/// `statement_timeout` for its key): the timeout is that message's, not its batch's. The batch
/// is split at once to find it, the 19 others are inserted without a retry, and only the slow
/// message goes through the retry queue, then to the DLQ (`retries_exhausted`). (Before, a
/// timeout was not split: all 20 spent every retry together and all 20 were dead-lettered.)
#[tokio::test(flavor = "multi_thread")]
async fn only_the_slow_message_of_a_batch_that_timed_out_spends_retries() {
    let mut env = TestEnv::new("retry_slow_one").await;
    env.set("RETRY_TTL_MS", "300")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "2")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "300")
        .set("USERS_BATCH_MIN_WAIT_MS", "500")
        .set("USERS_BATCH_TIMEOUT_MS", "1000")
        .set("BREAKER_FAILURES", "1000");
    env.declare();
    install_slow_trigger(&env).await;
    let ids: Vec<Uuid> = (0..20).map(|_| Uuid::new_v4()).collect();
    let slow = ids[12];
    env.publish_pipelined(ids.iter().map(|&id| {
        let body = if id == slow {
            slow_user_body(id)
        } else {
            user_body(id)
        };
        (body, json_props(id))
    }))
    .await;

    // Without the DLQ consumer: the dead letter stays in the DLQ to be read.
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "a message in the DLQ, main and retry queues empty",
        Duration::from_secs(40),
        || async {
            env.ready(&env.dlq_queue).await >= 1
                && env.ready(&env.main_queue).await == 0
                && env.ready(&env.retry_queue).await == 0
        },
    )
    .await;
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());

    let others: std::collections::HashSet<Uuid> =
        ids.iter().copied().filter(|&id| id != slow).collect();
    assert_eq!(env.row_ids().await, others, "the 19 others inserted");
    assert_eq!(
        retried, 2.0,
        "republishes to the retry queue: the slow one's"
    );
    let dead = env.drain_queue(&env.dlq_queue, 25).await;
    let dead_ids: Vec<Uuid> = dead.iter().map(message_uuid).collect();
    assert_eq!(dead_ids, vec![slow], "only the slow one dead-lettered");
    let p = &dead[0].delivery.properties;
    assert_eq!(int_header(p, "x-retries"), Some(2));
    assert_eq!(
        text_header(p, "x-error-kind").as_deref(),
        Some("retries_exhausted")
    );
    let reason = text_header(p, "x-error-reason").expect("x-error-reason");
    assert!(reason.contains("57014"), "x-error-reason {reason:?}");
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_queue_empty(&env, &env.retry_queue).await;
}

/// A batch in which every message times out (an overloaded server, as far as warren can tell):
/// the search for slow rows stops once both halves of the batch time out too, three timeouts in
/// all, not one per message; every message then spends its retries, as any transient failure.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_every_message_times_out_stops_its_search_after_both_halves() {
    let mut env = TestEnv::new("retry_all_slow").await;
    env.set("RETRY_TTL_MS", "300")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "1")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "300")
        .set("LOG_FORMAT", "json")
        .set("USERS_BATCH_MIN_WAIT_MS", "500")
        .set("USERS_BATCH_TIMEOUT_MS", "1000")
        .set("BREAKER_FAILURES", "1000");
    env.declare();
    install_slow_trigger(&env).await;
    let ids: Vec<Uuid> = (0..20).map(|_| Uuid::new_v4()).collect();
    env.publish_pipelined(ids.iter().map(|&id| (slow_user_body(id), json_props(id))))
        .await;

    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("all 20 in the DLQ", Duration::from_secs(40), || async {
        env.ready(&env.dlq_queue).await == 20
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    let searches: Vec<u64> = warren
        .logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["timed_out"].as_u64())
        .collect();
    assert!(!searches.is_empty(), "no search logged");
    assert!(
        searches.iter().all(|&n| n == 3),
        "timeouts met per search: {searches:?}"
    );
    assert_eq!(env.count_rows().await, 0);
    let dead: Vec<Uuid> = env
        .drain_queue(&env.dlq_queue, 25)
        .await
        .iter()
        .map(message_uuid)
        .collect();
    assert_eq!(dead.len(), 20, "each dead-lettered once: {dead:?}");
    assert_eq!(
        dead.into_iter()
            .collect::<std::collections::HashSet<Uuid>>(),
        ids.iter().copied().collect()
    );
}
