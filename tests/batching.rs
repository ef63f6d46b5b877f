//! Natural batching on the real broker and database (docs/pipelines.md, batching): a batch goes
//! to its sink as soon as the sink is free, so a lone message is committed without waiting for
//! the batch timeout, a backlog still goes in batches that grow to the size, and the acks stay
//! one multi-ack per contiguous run; `batch_min_wait_ms` holds a partial batch on purpose.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use uuid::Uuid;

/// How long until `id`'s row is visible to the test's own connection (so: committed), polled
/// every 5 ms from `since`; `None` if it is not there by `deadline`.
async fn committed_within(
    env: &TestEnv,
    id: Uuid,
    since: Instant,
    deadline: Duration,
) -> Option<Duration> {
    loop {
        let found = env
            .db
            .query_opt("SELECT 1 FROM users WHERE id = $1", &[&id])
            .await
            .expect("the row query");
        if found.is_some() {
            return Some(since.elapsed());
        }
        if since.elapsed() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Rows per insert statement among `ids`: rows of one batch share its transaction (`xmin`).
async fn batch_sizes(env: &TestEnv, ids: &[Uuid]) -> Vec<i64> {
    env.db
        .query(
            "SELECT count(*) FROM users WHERE id = ANY($1) GROUP BY xmin::text ORDER BY 1",
            &[&ids],
        )
        .await
        .expect("rows per transaction")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// With a batch timeout of 5 s, a lone message is committed within 2 s (on the old rule it
/// waited the whole 5 s), one after the other, with one ack per batch; then a backlog of 5,000
/// drains in far fewer statements than messages (batches grow while the sink inserts), none
/// past the size, and still no more acks than batches.
#[tokio::test(flavor = "multi_thread")]
async fn a_lone_message_does_not_wait_for_the_batch_timeout_and_a_backlog_still_batches() {
    let mut env = TestEnv::new("natural").await;
    env.set("USERS_BATCH_TIMEOUT_MS", "5000");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let mut logs = LogsOnPanic(vec![warren.log.clone()]);

    // The first message also waits for warren to start and subscribe: not timed.
    let first = env.publish_users(1).await[0];
    let started = Instant::now();
    assert!(
        committed_within(&env, first, started, Duration::from_secs(30))
            .await
            .is_some(),
        "the first row never came:\n{}",
        warren.logs()
    );
    let mut lone = vec![first];
    for _ in 0..3 {
        let sent = Instant::now();
        let id = env.publish_users(1).await[0];
        let took = committed_within(&env, id, sent, Duration::from_secs(2)).await;
        assert!(
            took.is_some(),
            "a lone message not committed within 2 s (batch timeout 5 s):\n{}",
            warren.logs()
        );
        eprintln!("lone message committed after {took:?} (publish and confirm included)");
        lone.push(id);
    }
    wait_queues_settled(&[&env.main_queue], Duration::from_secs(10)).await;
    let (acks, batches) = acks_and_batches(&env).await;
    eprintln!("light load: {acks} acks for {batches} batches");
    assert!(
        acks >= 1.0 && acks <= batches,
        "{acks} acks for {batches} batches"
    );
    assert_eq!(batch_sizes(&env, &lone).await, [1, 1, 1, 1]);
    warren.terminate_ok(Duration::from_secs(25));

    // A backlog in the queue before warren starts: what arrives while a sink inserts is its
    // next batch, so batches grow to the size (1,000) instead of going one message at a time.
    let burst = env.publish_users(5_000).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    logs.0.push(warren.log.clone());
    let all: HashSet<Uuid> = lone.iter().chain(&burst).copied().collect();
    assert_rows_exactly(&env, &all, Duration::from_secs(60), &|| warren.logs()).await;
    wait_queues_settled(&[&env.main_queue], Duration::from_secs(10)).await;
    let sizes = batch_sizes(&env, &burst).await;
    let (acks, batches) = acks_and_batches(&env).await;
    eprintln!("backlog of 5,000: {batches} batches, {acks} acks, rows per batch {sizes:?}");
    assert_eq!(
        sizes.len() as f64,
        batches,
        "the metric counts the insert statements"
    );
    assert!(
        sizes.len() <= 100 && sizes.iter().all(|n| *n <= 1_000),
        "5,000 messages in {} statements (at least 50 rows each on average expected, none \
         past 1,000): {sizes:?}",
        sizes.len()
    );
    assert!(
        acks >= 1.0 && acks <= batches,
        "{acks} acks for {batches} batches"
    );
    warren.terminate_ok(Duration::from_secs(25));
}

/// `batch_min_wait_ms` holds a partial batch on purpose: messages published 50 ms apart within
/// a 1.5 s minimum wait go in one insert, which does not come before the wait.
#[tokio::test(flavor = "multi_thread")]
async fn a_minimum_wait_holds_a_partial_batch_for_more() {
    let mut env = TestEnv::new("min_wait").await;
    env.set("USERS_BATCH_TIMEOUT_MS", "5000")
        .set("USERS_BATCH_MIN_WAIT_MS", "1500")
        .set("USERS_BATCH_CONCURRENCY", "1");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // Subscribed once a first message was committed.
    let first = env.publish_users(1).await[0];
    wait_until("the first row", Duration::from_secs(30), || async {
        env.row_ids().await.contains(&first)
    })
    .await;

    let sent = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.extend(env.publish_users(1).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = committed_within(&env, ids[0], sent, Duration::from_secs(4))
        .await
        .unwrap_or_else(|| panic!("not committed within 4 s:\n{}", warren.logs()));
    assert!(
        took >= Duration::from_millis(1_500),
        "committed after {took:?}, before the minimum wait"
    );
    assert_rows_exactly(
        &env,
        &ids.iter().chain([&first]).copied().collect(),
        Duration::from_secs(10),
        &|| warren.logs(),
    )
    .await;
    assert_eq!(
        batch_sizes(&env, &ids).await,
        [5],
        "one insert for the five"
    );
    warren.terminate_ok(Duration::from_secs(25));
}

/// A table slower than the load (a per-row trigger of 10 ms: one sink takes 100 rows a second)
/// gets its second insert in flight as soon as the first has been inserting for longer than the
/// pace, not after a whole batch's worth of deliveries went to the first batcher (found by
/// review: at 360 msg/s on such a table the second sink idled for 1,000 deliveries at a time,
/// p99 2.9 s). 301 messages, fewer than a batch's worth: on the old rule they all went to the
/// first batcher, one insert at a time (fails against a build before the fix:
/// `WARREN_TEST_BIN=<that build>`: no two transactions overlapped).
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_table_gets_its_second_insert_in_flight_without_waiting_for_a_batch_s_worth() {
    let env = TestEnv::new("slow_table").await;
    env.declare();
    env.db
        .batch_execute(
            "CREATE TABLE insert_trace (tx text NOT NULL, at timestamptz NOT NULL);
             CREATE FUNCTION slow_row() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               PERFORM pg_sleep(0.01);
               INSERT INTO insert_trace VALUES (pg_current_xact_id()::text, clock_timestamp());
               RETURN NULL;
             END $$;
             CREATE TRIGGER slow_row AFTER INSERT ON users FOR EACH ROW EXECUTE FUNCTION slow_row();",
        )
        .await
        .expect("the slow trigger");
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // One message first, so warren is consuming; then a stream of about 200 msg/s (5 every
    // 25 ms, the pacing of the input, not a wait) into a table that takes 100 rows a second:
    // deliveries keep arriving while the first sink inserts. A backlog published before the
    // start would arrive in one chunk while the sink is free (one batch, nothing to pass).
    let mut ids: HashSet<Uuid> = env.publish_users(1).await.into_iter().collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(30), &|| warren.logs()).await;
    for _ in 0..60 {
        ids.extend(env.publish_users(5).await);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;
    warren.terminate_ok(Duration::from_secs(25));
    // Each insert's transaction, from its first row to its last: two that overlap were in
    // flight at once.
    let overlapping: i64 = env
        .db
        .query_one(
            "WITH t AS (SELECT tx, min(at) lo, max(at) hi, count(*) n FROM insert_trace GROUP BY tx)
             SELECT count(*) FROM t a JOIN t b ON a.tx < b.tx AND a.lo < b.hi AND b.lo < a.hi",
            &[],
        )
        .await
        .expect("overlapping inserts")
        .get(0);
    let transactions: i64 = env
        .db
        .query_one("SELECT count(DISTINCT tx) FROM insert_trace", &[])
        .await
        .expect("transactions")
        .get(0);
    eprintln!("{transactions} insert transactions, {overlapping} overlapping pairs");
    assert!(
        overlapping >= 1,
        "no two of the {transactions} inserts were in flight at once: the second sink idled \
         while the first could not keep up"
    );
}
