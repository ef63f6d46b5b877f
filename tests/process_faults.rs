//! Process faults: warren killed with SIGKILL mid-run, alone and among several consumers of one
//! queue, and a nested pipeline's instance killed between its commit and its acks. The broker
//! redelivers what the dead process held; nothing is lost, nothing written twice.

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

/// A nested pipeline (orders and their items) killed with SIGKILL between the commit of its
/// batches and their acks: the inserts are held by a lock on `orders` until the broker link is
/// frozen (the deliveries are in, no ack can pass), then committed; the process is killed while
/// every order is stored and still unacked. The broker redelivers them all to the next
/// instance, which finds each order stored with exactly its items (a copy: done): every order
/// and every item once, nothing parked, the queues empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_nested_order_redelivered_after_a_kill_between_commit_and_ack_stays_once() {
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("kill9_nested").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    let file = ConfigFile::new(&nested_toml(&names, "batch_size = 100"));
    declare_file(&env, &file).await;
    let ids: Vec<Uuid> = (0..30).map(|_| Uuid::new_v4()).collect();
    let items = |i: usize| -> Vec<(String, i64)> {
        (0..1 + i % 5)
            .map(|j| (format!("S-{i}-{j}"), 1 + j as i64))
            .collect()
    };
    let body = |i: usize| {
        let owned = items(i);
        let items: Vec<(&str, i64)> = owned.iter().map(|(s, q)| (s.as_str(), *q)).collect();
        nested_order(ids[i], 1, &items)
    };
    for i in 0..ids.len() {
        env.publish_to(
            &names.exchange,
            &names.queue,
            &body(i),
            lapin::BasicProperties::default().with_delivery_mode(2),
        )
        .await;
    }
    let expected_items: usize = (0..ids.len()).map(|i| items(i).len()).sum();

    env.set("AMQP_URL", amqp.url());
    let lock = InsertLock::take_on(&env, "orders").await;
    let mut first = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![first.log.clone()]);
    lock.wait_for_a_blocked_insert(&env).await;
    wait_until(
        "every order delivered, none acked",
        Duration::from_secs(30),
        || async { queue_counts(&names.queue).await == (0, ids.len() as u64) },
    )
    .await;
    amqp.freeze();
    lock.release().await;
    wait_until(
        "every order and item committed",
        Duration::from_secs(30),
        || async {
            count_of(&env, "SELECT count(*) FROM orders").await == ids.len() as i64
                && count_of(&env, "SELECT count(*) FROM order_items").await == expected_items as i64
        },
    )
    .await;
    first.kill9();
    amqp.thaw();
    // Nothing was acked: the broker has every order back, for the next instance.
    wait_until(
        "every order back in the queue",
        Duration::from_secs(30),
        || async { queue_counts(&names.queue).await == (ids.len() as u64, 0) },
    )
    .await;

    env.set("AMQP_URL", amqp_url());
    let mut second = env.start(&["--config", file.at(), "--roles", "consumer,dlq"]);
    let _logs_second = LogsOnPanic(vec![second.log.clone()]);
    let sentinel = Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &nested_order(sentinel, 1, &[("S", 1)]),
        lapin::BasicProperties::default().with_delivery_mode(2),
    )
    .await;
    wait_until("the sentinel order", Duration::from_secs(60), || async {
        nested_items(&env, sentinel).await.len() == 1
    })
    .await;
    wait_queues_settled(
        &[&names.queue, &names.retry, &names.dlq],
        Duration::from_secs(30),
    )
    .await;
    let stored: HashSet<Uuid> = uuids_of(&env, "SELECT order_id FROM orders")
        .await
        .into_iter()
        .collect();
    let mut all: HashSet<Uuid> = ids.iter().copied().collect();
    all.insert(sentinel);
    assert_eq!(stored, all);
    for (i, id) in ids.iter().enumerate() {
        let expected: Vec<(i32, String, i32)> = items(i)
            .into_iter()
            .enumerate()
            .map(|(j, (sku, qty))| (j as i32 + 1, sku, qty as i32))
            .collect();
        assert_eq!(nested_items(&env, *id).await, expected, "order {i}");
    }
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM order_items").await,
        expected_items as i64 + 1
    );
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM dead_letters WHERE pipeline = 'orders'"
        )
        .await,
        0,
        "a redelivered copy was parked:\n{}",
        second.logs()
    );
    assert!(second.terminate(Duration::from_secs(25)).success());
}
