//! Graceful shutdown of `warren run`: SIGTERM in the middle of a large run drains and exits 0
//! in time with every inserted message acked and nothing lost; a stop says how many deliveries
//! it settled and how many it gave back to the broker; a stop behind a lock cancels the
//! inserts still waiting before its deadline and exits 0 (saying so, its breaker closed: the
//! cancels are the stop's, not the database's; a park it cancelled too), one with no time to
//! drain exits 1,
//! and neither leaves an insert running behind it; a second SIGTERM during a stuck shutdown exits at once, and
//! a restart still delivers every message exactly once.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;

/// Lets the database go once `warren` has exited: waits until its consumer has left the main
/// queue (whatever it did not ack is still with the broker), then checks that a restarted
/// consumer stores every id of `ids` exactly once.
async fn release_and_assert_everything_arrives_once(
    env: &TestEnv,
    locker: InsertLock,
    ids: &[uuid::Uuid],
) {
    locker.release().await;
    wait_until(
        "no consumer on the main queue",
        Duration::from_secs(10),
        || async { env.queue_state(&env.main_queue).await.1 == 0 },
    )
    .await;
    assert_everything_arrives_once(env, ids).await;
}

/// Waits until the restarted consumer stored every id in `ids`, then checks the end state.
async fn assert_everything_arrives_once(env: &TestEnv, ids: &[uuid::Uuid]) {
    let total = ids.len() as i64;
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until(
        &format!("{total} rows after the restart"),
        Duration::from_secs(90),
        || async { env.count_rows().await >= total },
    )
    .await;
    wait_until("the main queue empty", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    // The primary key rules out duplicate rows; the count and the set rule out extra or
    // missing ones.
    assert_eq!(env.count_rows().await, total, "log:\n{}", warren.logs());
    let expected: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    assert_eq!(expected.len(), ids.len());
    let stored = env.row_ids().await;
    let missing = expected.difference(&stored).count();
    let unexpected = stored.difference(&expected).count();
    assert!(
        missing == 0 && unexpected == 0,
        "{missing} published ids missing, {unexpected} unexpected ids stored"
    );
    assert_queue_empty(env, &env.retry_queue).await;
    assert_queue_empty(env, &env.dlq_queue).await;
    let status = warren.terminate(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "log:\n{}", warren.logs());
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_run_drains_exits_zero_and_loses_nothing() {
    const TOTAL: usize = 50_000;
    const SHUTDOWN_TIMEOUT_MS: u64 = 20_000;
    let mut env = TestEnv::new("term_mid").await;
    env.set("SHUTDOWN_TIMEOUT_MS", SHUTDOWN_TIMEOUT_MS.to_string());
    env.declare();
    let ids = env.publish_users(TOTAL).await;
    assert_eq!(env.queue_state(&env.main_queue).await.0, TOTAL as u32);

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("the first rows", Duration::from_secs(60), || async {
        env.count_rows().await > 0
    })
    .await;
    let before_signal = env.count_rows().await;
    assert!(
        before_signal < TOTAL as i64,
        "warren finished the whole run before the SIGTERM; the test proves nothing"
    );

    let signalled = Instant::now();
    let margin = Duration::from_secs(10);
    let status = warren.terminate(Duration::from_millis(SHUTDOWN_TIMEOUT_MS) + margin);
    let took = signalled.elapsed();
    assert_eq!(
        status.code(),
        Some(0),
        "exit after SIGTERM: {status:?}; log:\n{}",
        warren.logs()
    );
    assert!(
        took <= Duration::from_millis(SHUTDOWN_TIMEOUT_MS) + Duration::from_secs(5),
        "shutdown took {took:?}"
    );
    let logs = warren.logs();
    assert!(logs.contains("shutting down"), "log:\n{logs}");

    // A graceful stop acks exactly what it inserted: the rows plus what the broker holds again
    // is the whole run, with no consumer left.
    let rows = env.count_rows().await;
    assert!(
        rows >= before_signal && rows < TOTAL as i64,
        "rows {rows}, before the signal {before_signal}"
    );
    wait_until(
        "rows + messages back in the queue = everything published",
        Duration::from_secs(10),
        || async {
            let (ready, consumers) = env.queue_state(&env.main_queue).await;
            consumers == 0 && rows + ready as i64 == TOTAL as i64
        },
    )
    .await;
    assert_eq!(env.count_rows().await, rows, "rows appeared after the exit");
    eprintln!("SIGTERM at {before_signal} rows; exited 0 after {took:?} with {rows} rows stored");

    assert_everything_arrives_once(&env, &ids).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_sigterm_during_shutdown_exits_at_once() {
    const TOTAL: usize = 5_000;
    let mut env = TestEnv::new("term_twice").await;
    // Long enough that the first shutdown cannot finish by itself during the test.
    env.set("SHUTDOWN_TIMEOUT_MS", "120000");
    env.declare();
    let ids = env.publish_users(TOTAL).await;

    let locker = InsertLock::take(&env).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    locker.wait_for_a_blocked_insert(&env).await;

    warren.begin_shutdown().await;
    assert!(
        warren.is_running(),
        "warren exited although its batches were blocked; log:\n{}",
        warren.logs()
    );

    let second = Instant::now();
    let status = warren.terminate(Duration::from_secs(10));
    let took = second.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the second SIGTERM took {took:?} to exit"
    );
    assert_ne!(status.code(), Some(0), "log:\n{}", warren.logs());
    assert!(
        warren.logs().contains("second signal"),
        "log:\n{}",
        warren.logs()
    );

    // Let the database go; whatever was not acked is still with the broker.
    release_and_assert_everything_arrives_once(&env, locker, &ids).await;
}

/// A stop behind a lock: every batch INSERT waits on a table another session locked. The
/// inserts still waiting shortly before the drain's deadline (a quarter of
/// `SHUTDOWN_TIMEOUT_MS`, at most 5 s) are cancelled, their messages go back to the queue (no
/// retry spent, nothing to the DLQ), and the stop ends before the deadline with exit 0:
/// everything in flight was settled. Before, it lasted the whole timeout and exited 1 (review
/// R38-F4), and the inserts, never cancelled, were still waiting after the exit, to commit when
/// the lock went although their deliveries were back with the broker (R35-F1).
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_behind_a_lock_cancels_the_inserts_and_exits_zero_before_the_timeout() {
    const TOTAL: usize = 3_000;
    // Cancelled 2.5 s before the deadline: the settle after it took 1.4 s on a loaded machine.
    const SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
    let mut env = TestEnv::new("term_stuck").await;
    env.set("SHUTDOWN_TIMEOUT_MS", SHUTDOWN_TIMEOUT_MS.to_string());
    env.declare();
    let ids = env.publish_users(TOTAL).await;
    let locker = InsertLock::take(&env).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    locker.wait_for_a_blocked_insert(&env).await;
    let blocked = locker.blocked(&env).await;

    let signalled = Instant::now();
    let status =
        warren.terminate(Duration::from_millis(SHUTDOWN_TIMEOUT_MS) + Duration::from_secs(15));
    let took = signalled.elapsed();
    let logs = warren.logs();
    assert_eq!(status.code(), Some(0), "log:\n{logs}");
    assert!(
        took < Duration::from_millis(SHUTDOWN_TIMEOUT_MS),
        "exited after {took:?}; log:\n{logs}"
    );
    assert!(
        logs.contains("statements still running are cancelled"),
        "log:\n{logs}"
    );
    assert!(!logs.contains("shutdown timeout reached"), "log:\n{logs}");
    // The inserts ended before the exit, rolled back: none of them still runs.
    assert_eq!(
        active_backends(&env, &blocked).await,
        0,
        "an insert of the stopped warren still runs"
    );
    assert_eq!(env.count_rows().await, 0);
    // Every message is back in its queue, none through the retry queue or the DLQ.
    wait_until(
        "every message back in the main queue",
        Duration::from_secs(10),
        || async { env.queue_state(&env.main_queue).await == (TOTAL as u32, 0) },
    )
    .await;
    assert_queue_empty(&env, &env.retry_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
    eprintln!("a stop behind a lock exited 0 after {took:?}");

    release_and_assert_everything_arrives_once(&env, locker, &ids).await;
}

/// A stop behind a lock says what happened: the inserts it cancelled near the drain's deadline
/// are the stop's doing, said as such, and never counted against the database. With four batch
/// inserts waiting (`BATCH_CONCURRENCY=4`, `BREAKER_FAILURES=3`), the cancels counted as
/// failures and opened the sink-outage breaker in the middle of the stop: an error line saying
/// that the database keeps failing, and a `breaker_opened` event, on a healthy database.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_behind_a_lock_says_it_cancelled_the_inserts_and_opens_no_breaker() {
    const TOTAL: usize = 2_000;
    const SHUTDOWN_TIMEOUT_MS: u64 = 8_000;
    let mut env = TestEnv::new("term_words").await;
    env.set("SHUTDOWN_TIMEOUT_MS", SHUTDOWN_TIMEOUT_MS.to_string())
        .set("BATCH_SIZE", "100")
        .set("BATCH_CONCURRENCY", "4")
        .set("BREAKER_FAILURES", "3");
    let _redis = RedisCleanup::new(&env);
    env.declare();
    let ids = env.publish_users(TOTAL).await;
    let locker = InsertLock::take(&env).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until(
        "four inserts blocked by the lock",
        Duration::from_secs(30),
        || async { locker.blocked(&env).await.len() >= 4 },
    )
    .await;

    let status =
        warren.terminate(Duration::from_millis(SHUTDOWN_TIMEOUT_MS) + Duration::from_secs(15));
    let logs = warren.logs();
    assert_eq!(status.code(), Some(0), "log:\n{logs}");
    assert!(
        logs.contains("statements still running are cancelled"),
        "log:\n{logs}"
    );
    let cancelled = logs
        .lines()
        .filter(|l| l.contains("batch insert cancelled by the stop"))
        .count();
    assert!(
        cancelled >= 4,
        "{cancelled} batches said cancelled; log:\n{logs}"
    );
    for wrong in [
        "sink-outage breaker OPEN",
        "batch insert failed for some rows",
        "transient database error",
    ] {
        assert!(
            !logs.contains(wrong),
            "{wrong:?} in the log of a stop:\n{logs}"
        );
    }
    let opened: Vec<_> = stream_events(&env)
        .await
        .into_iter()
        .filter(|e| e["type"] == "breaker_opened")
        .collect();
    assert!(opened.is_empty(), "{opened:?}");

    release_and_assert_everything_arrives_once(&env, locker, &ids).await;
}

/// A stop while a park (the DLQ stage's INSERT into `dead_letters`) waits on a lock says the
/// stop cancelled it, and gives the message back to its queue: the park was logged as an ERROR
/// saying the database did not take the messages, which read as an outage (review R35). When the
/// lock goes, the next DLQ consumer parks the message once.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_behind_a_lock_says_it_cancelled_the_park() {
    const SHUTDOWN_TIMEOUT_MS: u64 = 4_000;
    let mut env = TestEnv::new("term_park").await;
    env.set("SHUTDOWN_TIMEOUT_MS", SHUTDOWN_TIMEOUT_MS.to_string());
    env.declare();
    let lock = InsertLock::take_on(&env, "dead_letters").await;
    // Not JSON: the DLQ stage parks it at once, and the park waits on the lock.
    env.publish_to_dlq(
        b"{not json",
        dead_letter_props(
            "park-at-stop",
            "invalid_json",
            0,
            "set by the main pipeline",
        ),
    )
    .await;
    let mut warren = env.start(&["--roles", "dlq"]);
    lock.wait_for_a_blocked_insert(&env).await;
    let blocked = lock.blocked(&env).await;

    let status =
        warren.terminate(Duration::from_millis(SHUTDOWN_TIMEOUT_MS) + Duration::from_secs(15));
    let logs = warren.logs();
    assert_eq!(status.code(), Some(0), "log:\n{logs}");
    assert!(
        logs.contains("statements still running are cancelled"),
        "log:\n{logs}"
    );
    assert!(logs.contains("park cancelled by the stop"), "log:\n{logs}");
    for wrong in ["cannot park messages", "ERROR"] {
        assert!(
            !logs.contains(wrong),
            "{wrong:?} in the log of a stop:\n{logs}"
        );
    }
    assert_eq!(
        active_backends(&env, &blocked).await,
        0,
        "a park of the stopped warren still runs"
    );
    // Back in the DLQ, unparked.
    wait_until(
        "the message back in the DLQ",
        Duration::from_secs(10),
        || async { env.queue_state(&env.dlq_queue).await == (1, 0) },
    )
    .await;

    lock.release().await;
    let count_parked = || async {
        env.db
            .query_one(
                "SELECT count(*) FROM dead_letters WHERE message_id = 'park-at-stop'",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0))
            .unwrap_or(-1)
    };
    assert_eq!(count_parked().await, 0);
    let mut warren = env.start(&["--roles", "dlq"]);
    wait_until("the message parked", Duration::from_secs(30), || async {
        count_parked().await == 1 && env.queue_state(&env.dlq_queue).await.0 == 0
    })
    .await;
    warren.terminate_ok(Duration::from_secs(25));
    assert_eq!(count_parked().await, 1);
}

/// A stop that has no time to drain (`SHUTDOWN_TIMEOUT_MS=0`) behind a lock exits 1 at once
/// (messages were in flight: a supervisor sees it), yet its inserts are cancelled and known
/// ended before it exits, and nothing is lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_that_cannot_drain_exits_one_and_leaves_no_insert_running() {
    const TOTAL: usize = 3_000;
    let mut env = TestEnv::new("term_nodrain").await;
    env.set("SHUTDOWN_TIMEOUT_MS", "0");
    env.declare();
    let ids = env.publish_users(TOTAL).await;
    let locker = InsertLock::take(&env).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    locker.wait_for_a_blocked_insert(&env).await;
    let blocked = locker.blocked(&env).await;

    let signalled = Instant::now();
    let status = warren.terminate(Duration::from_secs(20));
    let took = signalled.elapsed();
    let logs = warren.logs();
    // Messages were still in flight: not a clean stop, so a supervisor sees the failure.
    assert_eq!(status.code(), Some(1), "log:\n{logs}");
    assert!(took < Duration::from_secs(5), "exited after {took:?}");
    assert!(logs.contains("shutdown timeout reached"), "log:\n{logs}");
    assert_eq!(
        active_backends(&env, &blocked).await,
        0,
        "an insert of the stopped warren still runs"
    );
    assert_eq!(env.count_rows().await, 0);

    // The restart's stop drains in time (with 0 it cannot, even with nothing in flight).
    env.set("SHUTDOWN_TIMEOUT_MS", "20000");
    release_and_assert_everything_arrives_once(&env, locker, &ids).await;
}

/// A SIGTERM during a table outage: the users table is missing, the breaker holds the
/// pipeline, and the batch in flight waits in place. The stop gives its deliveries back to the
/// broker unprocessed, which is right (nothing is lost: the next consumer takes them), but the
/// stop said "stopped cleanly" with exit 0 and nothing about them. Now the last line and the
/// `stopped` event say how many deliveries were settled and how many were given back, and the
/// count is the broker's: every message unacked at the signal is ready in the queue afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_during_a_table_outage_says_how_many_deliveries_it_gave_back() {
    const TOTAL: usize = 100;
    let env = TestEnv::new("term_outage").await;
    env.declare();
    env.db
        .batch_execute("ALTER TABLE users RENAME TO users_away")
        .await
        .expect("rename the table away");
    env.publish_users(TOTAL).await;
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_scrape(
        &env,
        &warren,
        "the breaker open",
        Duration::from_secs(60),
        |s| {
            s.one(
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", "main")],
            ) == Some(1.0)
        },
    )
    .await;
    // The breaker holds the consumer: what it has is all it gets until the stop.
    wait_until(
        "deliveries held unacked",
        Duration::from_secs(30),
        || async { queue_counts(&env.main_queue).await.1 > 0 },
    )
    .await;
    let unacked = queue_counts(&env.main_queue).await.1;

    let status = warren.terminate(Duration::from_secs(40));
    let logs = warren.logs();
    eprintln!("SIGTERM with {unacked} deliveries held by the open breaker");
    assert_eq!(status.code(), Some(0), "log:\n{logs}");
    let last = logs
        .lines()
        .rev()
        .find(|l| l.contains("stopped"))
        .unwrap_or_default();
    assert!(
        last.contains(&format!(
            "stopped: 0 deliveries settled, {unacked} given back to the broker unprocessed"
        )),
        "the last line does not say what the stop gave back ({unacked} unacked): {last}\n\
         log:\n{logs}"
    );
    let events = stream_events(&env).await;
    let stopped = events
        .iter()
        .rev()
        .find(|e| e["type"] == "stopped")
        .unwrap_or_else(|| panic!("no stopped event: {events:#?}"));
    assert_eq!(stopped["exit_code"], 0, "{stopped}");
    assert_eq!(stopped["settled"], 0, "{stopped}");
    assert_eq!(stopped["given_back"], unacked, "{stopped}");
    // The broker has them all again.
    wait_until(
        "every message ready again",
        Duration::from_secs(10),
        || async { queue_counts(&env.main_queue).await == (TOTAL as u64, 0) },
    )
    .await;
}

/// A SIGTERM during a database outage (the database cut through a proxy while the batches in
/// flight wait for it, retried in place). Found by review (F4): the stop ended their in-place
/// retry and sent every one through the retry queue, each spending a retry, and said "stopped
/// cleanly: 3976 deliveries settled, none given back" while 4001 messages went to the retry
/// queue. Now they go back to the broker unprocessed (nack with requeue, no retry spent): the
/// retry queue stays empty, and the last line and the `stopped` event count them as given back.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_during_a_database_outage_gives_the_batches_back_without_a_retry() {
    const TOTAL: usize = 2_000;
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("term_pgcut").await;
    // No batch's in-place retry may run out before the signal: on a loaded machine the 5 s
    // window's last retry came 2.3 s in, before the test sent it, and that batch went its way
    // through the retry queue as any outage longer than the window sends it.
    env.set("DATABASE_URL", proxy.url())
        .set("DB_RETRY_WINDOW_MS", "120000");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log("the consumer subscribed", " consuming pipeline=")
        .await;
    proxy.cut();
    let ids = env.publish_users(TOTAL).await;
    // The batches in flight wait in place for the database.
    wait_until(
        "a batch retried in place",
        Duration::from_secs(60),
        || async { warren.logs().contains("retrying the batch in place") },
    )
    .await;
    let unacked = queue_counts(&env.main_queue).await.1;
    assert!(
        unacked > 0,
        "nothing held at the signal; log:\n{}",
        warren.logs()
    );

    let status = warren.terminate(Duration::from_secs(40));
    let logs = warren.logs();
    eprintln!("SIGTERM with {unacked} deliveries held during a database outage");
    assert_eq!(status.code(), Some(0), "log:\n{logs}");
    // None went through the retry queue: no retry spent on a message nobody tried to insert.
    let (retrying, _) = queue_counts(&env.retry_queue).await;
    assert_eq!(
        retrying, 0,
        "the stop sent {retrying} messages through the retry queue; log:\n{logs}"
    );
    // Nothing is acked while the database is down, so what the consumer held at the signal is
    // at least what it held at the snapshot (more may have arrived since) and at most the lot.
    let given_back = match stop_counts(&logs) {
        Some((0, given_back)) => given_back,
        other => panic!(
            "the last line does not say that the stop settled nothing and gave back what it \
             held ({unacked} unacked at the snapshot): {other:?}\nlog:\n{logs}"
        ),
    };
    assert!(
        (unacked..=TOTAL as u64).contains(&given_back),
        "given back {given_back}, held {unacked} at the snapshot, {TOTAL} published"
    );
    let events = stream_events(&env).await;
    let stopped = events
        .iter()
        .rev()
        .find(|e| e["type"] == "stopped")
        .unwrap_or_else(|| panic!("no stopped event: {events:#?}"));
    assert_eq!(stopped["settled"], 0, "{stopped}");
    assert_eq!(stopped["given_back"], given_back, "{stopped}");
    // The broker has them all again, none retried: once the database is back, each lands once.
    wait_until(
        "every message ready again",
        Duration::from_secs(10),
        || async { queue_counts(&env.main_queue).await == (TOTAL as u64, 0) },
    )
    .await;
    proxy.restore();
    assert_everything_arrives_once(&env, &ids).await;
}
