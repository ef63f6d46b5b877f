//! Row isolation: a batch the database refuses permanently (a duplicate email, SQLSTATE 23505)
//! is split in halves until only the offending rows fail; the others are committed, the
//! offenders go to the DLQ as `db_permanent` and no retry is spent on them.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use uuid::Uuid;

/// A user body with a chosen email.
fn body(id: Uuid, email: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","name":"user {id}","email":"{email}"}}"#).into_bytes()
}

/// 1,000 messages in one batch, 3 of them reusing the email of another message of the batch:
/// 997 rows, the 3 losers of the duplicates in the DLQ as db_permanent, nothing retried.
#[tokio::test(flavor = "multi_thread")]
async fn duplicate_emails_in_a_batch_of_1000_are_isolated_and_dead_lettered() {
    const N: usize = 1000;
    // (position reusing an email, position whose email it reuses)
    const DUPLICATES: [(usize, usize); 3] = [(400, 5), (700, 300), (999, 600)];
    let mut env = TestEnv::new("isolate_dup").await;
    env.set("USERS_BATCH_SIZE", "1000")
        .set("USERS_BATCH_CONCURRENCY", "1")
        .set("USERS_BATCH_TIMEOUT_MS", "2000");
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
    let batches = metric(&env, "warren_batch_size_count", &[("pipeline", "main")]).await;
    let batched = metric(&env, "warren_batch_size_sum", &[("pipeline", "main")]).await;
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
        &[("pipeline", "main")],
    )
    .await;
    assert_eq!(inserted, (N - DUPLICATES.len()) as f64);
    assert!(
        warren
            .logs()
            .contains("batch split to isolate refused rows"),
        "no split logged:\n{}",
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
