//! The main pipeline against the real broker and database: counts, idempotence, batch sizes (a
//! backlog goes in batches that grow to the size and never past it). A lone message not waiting
//! for the batch timeout: tests/batching.rs.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_messages_become_ten_thousand_rows() {
    let env = TestEnv::new("ten_k").await;
    env.declare();
    let ids = env.publish_users(10_000).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("10,000 rows", Duration::from_secs(60), || async {
        env.count_rows().await == 10_000
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    assert!(warren.terminate(Duration::from_secs(25)).success());
    // Nothing unacked: after warren closed its channel, nothing came back to the queue.
    let (ready, consumers) = env.queue_state(&env.main_queue).await;
    assert_eq!((ready, consumers), (0, 0), "log:\n{}", warren.logs());
    assert_eq!(env.count_rows().await, 10_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_message_twice_is_one_row() {
    let env = TestEnv::new("dup_id").await;
    env.declare();
    let id = uuid::Uuid::new_v4();
    env.publish_raw(&user_body(id), json_props(id)).await;
    env.publish_raw(&user_body(id), json_props(id)).await;
    // A sentinel after the duplicates proves both were processed.
    let sentinel = env.publish_users(1).await[0];
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("sentinel row", Duration::from_secs(30), || async {
        env.row_ids().await.contains(&sentinel)
    })
    .await;
    wait_until("queue empty", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_eq!(env.count_rows().await, 2);
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_queue_empty(&env, &env.dlq_queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_goes_in_batches_that_grow_to_the_size_and_never_past_it() {
    let mut env = TestEnv::new("batch_size").await;
    env.set("USERS_BATCH_SIZE", "100")
        .set("USERS_BATCH_TIMEOUT_MS", "300");
    env.declare();
    // Rows of one batch share the INSERT's transaction (`xmin`): group by it to see the batches.
    let ids = env.publish_users(1_000).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    assert_rows_exactly(
        &env,
        &ids.iter().copied().collect(),
        Duration::from_secs(30),
        &|| warren.logs(),
    )
    .await;
    let sizes: Vec<i64> = env
        .db
        .query(
            "SELECT count(*) FROM users GROUP BY xmin::text ORDER BY 1",
            &[],
        )
        .await
        .expect("rows per transaction")
        .iter()
        .map(|r| r.get(0))
        .collect();
    // A free sink takes whatever waits, so the first batch of a turn may be small (what the
    // first chunk held); what arrives while it inserts is the next batch. Never past the size,
    // and a backlog in batches, not a statement per message or per chunk: at least 20 rows a
    // statement on average (10 full batches is the fewest possible).
    assert_eq!(sizes.iter().sum::<i64>(), 1_000);
    assert!(
        sizes.iter().all(|n| *n <= 100) && sizes.len() <= 50,
        "rows per batch: {sizes:?}\n{}",
        warren.logs()
    );
    assert!(warren.terminate(Duration::from_secs(25)).success());
}
