//! Process faults: warren killed with SIGKILL mid-run, alone and among several consumers of one
//! queue. The broker redelivers what the dead process held; nothing is lost, nothing written twice.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_run_then_restart_writes_every_row_once() {
    let env = TestEnv::new("kill9").await;
    env.declare();
    let total = 30_000usize;
    let expected: HashSet<Uuid> = env.publish_users(total).await.into_iter().collect();

    let mut first = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![first.log.clone()]);
    wait_until("8,000 rows", Duration::from_secs(60), || async {
        env.count_rows().await >= 8_000
    })
    .await;
    first.kill9();
    let rows = env.count_rows().await;
    assert!(
        rows < total as i64,
        "the run was over ({rows} rows) before the kill"
    );
    // What the dead process held unacked is back in the queue, for the next one.
    wait_until(
        "the killed consumer gone from the queue",
        Duration::from_secs(30),
        || async { env.queue_state(&env.main_queue).await.1 == 0 },
    )
    .await;

    let mut second = env.start(&["--roles", "consumer"]);
    let _logs_second = LogsOnPanic(vec![second.log.clone()]);
    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &|| second.logs()).await;
    wait_until("main queue empty", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert!(second.terminate(Duration::from_secs(25)).success());
    // Nothing unacked either: after warren closed its channel, nothing came back.
    assert_eq!(
        env.queue_state(&env.main_queue).await,
        (0, 0),
        "log:\n{}",
        second.logs()
    );
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0, "DLQ not empty");
    assert_eq!(env.count_rows().await, total as i64);
}

#[tokio::test(flavor = "multi_thread")]
async fn one_of_three_consumers_killed_midway_loses_nothing() {
    let mut env = TestEnv::new("kill_one_of_3").await;
    env.declare();
    let total = 45_000usize;
    let expected: HashSet<Uuid> = env.publish_users(total).await.into_iter().collect();

    // Each process needs its own metrics listener.
    let mut warrens: Vec<Warren> = (0..3)
        .map(|_| {
            env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
            env.start(&["--roles", "consumer"])
        })
        .collect();
    let _logs = LogsOnPanic(warrens.iter().map(|w| w.log.clone()).collect());
    wait_until("three consumers", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.1 == 3
    })
    .await;
    wait_until("12,000 rows", Duration::from_secs(60), || async {
        env.count_rows().await >= 12_000
    })
    .await;
    warrens[1].kill9();
    let rows = env.count_rows().await;
    assert!(
        rows < total as i64,
        "the run was over ({rows} rows) before the kill"
    );

    let logs = || {
        warrens
            .iter()
            .map(|w| w.logs())
            .collect::<Vec<_>>()
            .join("\n----\n")
    };
    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &logs).await;
    wait_until("main queue empty", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await == (0, 2)
    })
    .await;
    for i in [0, 2] {
        assert!(
            warrens[i].terminate(Duration::from_secs(25)).success(),
            "warren {i} did not stop cleanly"
        );
    }
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0, "DLQ not empty");
    assert_eq!(env.count_rows().await, total as i64);
}
