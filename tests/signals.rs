//! The operator signals on the host: `SIGUSR1` pauses every pipeline of the process, `SIGCONT`
//! resumes them, as `warren ctl pause` / `resume` without `--pipeline` (the status in the
//! registry record, the `paused` / `resumed` events), on the real broker and database.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn sigusr1_pauses_every_pipeline_and_sigcont_resumes() {
    let mut env = TestEnv::new("sig_pause").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    let status = |want: &'static str| {
        let env = &env;
        async move { instance(env, pid).await["status"] == want }
    };
    wait_until("registered as running", Duration::from_secs(20), || {
        status("running")
    })
    .await;
    let mut ids: HashSet<_> = env.publish_users(20).await.into_iter().collect();
    wait_until("20 rows", Duration::from_secs(20), || async {
        env.count_rows().await == 20
    })
    .await;

    warren.signal("USR1");
    wait_until("paused in the record", Duration::from_secs(10), || {
        status("paused")
    })
    .await;
    assert!(
        warren.is_running(),
        "SIGUSR1 ended warren; log:\n{}",
        warren.logs()
    );
    // Published while paused: no sentinel can pass a paused consumer, so the proof is the
    // broker's: every message ready in the queue, which has no consumer, hence nothing can be
    // delivered.
    ids.extend(env.publish_users(300).await);
    wait_until(
        "300 messages ready and no consumer",
        Duration::from_secs(10),
        || async { env.queue_state(&env.main_queue).await == (300, 0) },
    )
    .await;
    assert_eq!(env.count_rows().await, 20, "rows inserted while paused");
    let paused: Vec<_> = stream_events(&env)
        .await
        .into_iter()
        .filter(|e| e["type"] == "paused")
        .collect();
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert_eq!(paused[0]["by"], "operator", "{}", paused[0]);
    assert!(paused[0].get("pipeline").is_none(), "{}", paused[0]);
    assert!(
        warren.logs().contains("operator signal: every pipeline"),
        "log:\n{}",
        warren.logs()
    );

    warren.signal("CONT");
    assert_rows_exactly(&env, &ids, Duration::from_secs(30), &|| warren.logs()).await;
    wait_until("running in the record", Duration::from_secs(10), || {
        status("running")
    })
    .await;
    assert!(
        stream_events(&env)
            .await
            .iter()
            .any(|e| e["type"] == "resumed" && e["by"] == "operator"),
        "no resumed event"
    );
    assert_queue_empty(&env, &env.main_queue).await;
    warren.terminate_ok(Duration::from_secs(25));
}
