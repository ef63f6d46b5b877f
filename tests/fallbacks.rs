//! The two endings the other files do not reach: a systemic database error (the deployment is
//! wrong) holds the messages and never dead-letters them, and a retry republish the broker cannot
//! route falls back to a reject, so the main queue's own DLX still keeps the message.

mod common;

use std::time::Duration;

use common::*;
use lapin::types::FieldTable;

#[tokio::test(flavor = "multi_thread")]
async fn a_systemic_error_holds_the_messages_and_never_dead_letters_them() {
    let mut env = TestEnv::new("systemic").await;
    env.set("DB_RETRY_WINDOW_MS", "0");
    env.declare();
    install_fault(&env, CountAttempts::No).await;
    set_fault_sqlstate(&env, "42501").await; // insufficient_privilege: class 42, systemic
    let ids = env.publish_users(20).await;
    let mut warren = env.start(&["--roles", "consumer"]);

    wait_until("the breaker opens", Duration::from_secs(30), || async {
        try_metric(&env, "warren_breaker_open", &[("pipeline", "main")]).await == Some(1.0)
    })
    .await;
    assert!(
        warren.logs().contains("SYSTEMIC database error"),
        "log:\n{}",
        warren.logs()
    );
    // Held, not routed: nothing was retried or dead-lettered, nothing inserted.
    assert_eq!(env.count_rows().await, 0);
    assert_eq!(env.ready(&env.dlq_queue).await, 0);
    assert_eq!(env.ready(&env.retry_queue).await, 0);
    assert_eq!(
        metric(&env, "warren_messages_retried_total", &[]).await,
        0.0
    );
    assert_eq!(
        metric(&env, "warren_messages_dead_lettered_total", &[]).await,
        0.0
    );

    // The deployment is fixed: every message is inserted, once, and the breaker closes.
    clear_fault(&env).await;
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    wait_until("the breaker closes", Duration::from_secs(30), || async {
        try_metric(&env, "warren_breaker_open", &[("pipeline", "main")]).await == Some(0.0)
    })
    .await;
    assert_eq!(env.ready(&env.dlq_queue).await, 0);
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unroutable_retry_is_rejected_into_the_dlq_and_not_lost() {
    let mut env = TestEnv::new("unroutable_retry").await;
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1000")
        .set("PUBLISH_TIMEOUT_MS", "500");
    env.declare();
    install_fault(&env, CountAttempts::No).await;
    // The retry exchange routes nowhere: the router's mandatory republish comes back unroutable.
    env.channel
        .queue_unbind(
            env.retry_queue.as_str().into(),
            env.retry_exchange.as_str().into(),
            env.retry_queue.as_str().into(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the retry queue");
    let id = env.publish_users(1).await[0];
    let mut warren = env.start(&["--roles", "consumer"]);

    wait_until(
        "the message in the DLQ",
        Duration::from_secs(30),
        || async { env.ready(&env.dlq_queue).await == 1 },
    )
    .await;
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(dead.len(), 1);
    let message = &dead[0];
    assert_eq!(message.delivery.data, user_body(id), "body kept");
    // Dead-lettered by the broker (a reject), not republished by warren: x-death, no x-error-kind.
    assert!(
        header(&message.delivery.properties, "x-death").is_some(),
        "{message:?}"
    );
    assert!(text_header(&message.delivery.properties, "x-error-kind").is_none());
    assert!(
        warren.logs().contains("republish failed"),
        "log:\n{}",
        warren.logs()
    );
    assert_eq!(env.count_rows().await, 0);
    assert_eq!(env.ready(&env.retry_queue).await, 0);
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}
