//! The main pipeline against the real broker and database: counts, idempotence, batch sizes (a
//! backlog goes in full batches, never more, never fewer) and the batch timeout (a lone message
//! waits for it, and no longer).

mod common;

use std::time::{Duration, Instant};

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
async fn batches_respect_the_size_and_a_lone_message_the_timeout() {
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
    // A backlog already in the queue fills every batch: exactly ten batches of 100, not more
    // than the size, and not fewer rows (a batch cut at 1 or at every chunk would pass an upper
    // bound alone).
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
    assert_eq!(sizes, [100; 10], "rows per batch:\n{}", warren.logs());

    let started = Instant::now();
    let id = env.publish_users(1).await[0];
    wait_until("the lone row", Duration::from_secs(5), || async {
        env.row_ids().await.contains(&id)
    })
    .await;
    let took = started.elapsed();
    // The timeout flushed it: not before (a lone message flushed at once would make batches of
    // one of every trickle), and not much after.
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(300 + 700),
        "lone message took {took:?}"
    );
    assert!(warren.terminate(Duration::from_secs(25)).success());
}
