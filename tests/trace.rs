//! W3C Trace Context: a `traceparent` header on a message is kept on every copy warren publishes
//! (retry, dead letter, `dlq replay`, `dlq parked replay`, `move`), written in the log line and
//! the events of that message, and set by the HTTP API from the request's (an invalid one is
//! ignored, never refused).

mod common;

use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use uuid::Uuid;

const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn traced(id: Uuid) -> BasicProperties {
    with_header(json_props(id), "traceparent", long_string(TRACE))
}

/// retry -> DLQ -> replay -> parked -> parked replay: the header on every copy, in the log line
/// of the dead letter and in the dead_lettered and parked events.
#[tokio::test(flavor = "multi_thread")]
async fn a_traceparent_survives_retry_dead_letter_replay_and_parking() {
    let mut env = TestEnv::new("trace_path").await;
    env.set("RETRY_TTL_MS", "300")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "1")
        .set("BREAKER_FAILURES", "1000");
    env.declare();
    let _cleanup = RedisCleanup::new(&env);
    install_fault(&env, CountAttempts::No).await;
    let id = Uuid::new_v4();
    env.publish_raw(&user_body(id), traced(id)).await;

    // Retried once, then dead-lettered as retries_exhausted: the copy in the DLQ keeps it.
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until(
        "the message in the DLQ",
        Duration::from_secs(30),
        || async { env.ready(&env.dlq_queue).await == 1 },
    )
    .await;
    warren.terminate_ok(Duration::from_secs(30));
    let copy = env.peek(&env.dlq_queue, 1).await;
    assert_eq!(
        text_header(&copy[0].delivery.properties, "traceparent").as_deref(),
        Some(TRACE)
    );
    assert_eq!(
        int_header(&copy[0].delivery.properties, "x-retries"),
        Some(1)
    );
    let log = warren.logs();
    assert!(
        log.lines()
            .any(|l| l.contains("message dead-lettered") && l.contains(TRACE)),
        "no dead-letter line with the traceparent:\n{log}"
    );
    let dead: Vec<_> = stream_events(&env)
        .await
        .into_iter()
        .filter(|e| e["type"] == "dead_lettered")
        .collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["traceparent"], TRACE);

    // Replayed to the main queue: still there.
    let (code, out, err) = env.run_async(&["dlq", "replay"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let back = env.peek(&env.main_queue, 1).await;
    assert_eq!(back.len(), 1, "{out}");
    assert_eq!(
        text_header(&back[0].delivery.properties, "traceparent").as_deref(),
        Some(TRACE)
    );

    // Parked by the DLQ stage (the database still fails as it did: MAX_RETRIES again, then the
    // DLQ's attempts), then replayed from the parking table: the header comes back with it.
    env.set("DLQ_MAX_ATTEMPTS", "1");
    set_fault_sqlstate(&env, "23514").await; // a check violation: permanent, straight to the DLQ
    let mut warren = env.start(&["--roles", "consumer,dlq"]);
    let _logs2 = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("the message parked", Duration::from_secs(60), || async {
        stream_events(&env)
            .await
            .iter()
            .any(|e| e["type"] == "parked" && e["traceparent"] == TRACE)
    })
    .await;
    warren.terminate_ok(Duration::from_secs(30));
    let (code, out, err) = env.run_async(&["dlq", "parked", "replay"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let again = env.peek(&env.main_queue, 1).await;
    assert_eq!(again.len(), 1, "{out}");
    assert_eq!(
        text_header(&again[0].delivery.properties, "traceparent").as_deref(),
        Some(TRACE)
    );

    // And `move` keeps it too.
    let (code, out, err) = env
        .run_async(&[
            "move",
            "--from",
            &env.main_queue,
            "--to",
            &format!("{}/{}", env.dlx_exchange, env.dlq_queue),
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let moved = env.peek(&env.dlq_queue, 1).await;
    assert_eq!(
        text_header(&moved[0].delivery.properties, "traceparent").as_deref(),
        Some(TRACE),
        "{out}"
    );
}

/// The API sets the request's traceparent on what it publishes; an invalid one is left out and
/// the request still succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_carries_the_requests_traceparent() {
    let env = TestEnv::new("trace_api").await;
    env.declare();
    let mut warren = env.start(&["--roles", "api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // Ready, not merely alive: a POST before the publisher's link is up answers 503.
    wait_ready(&env, Duration::from_secs(30)).await;
    let url = format!("{}/api/v1/users", env.http_base());
    for (trace, kept) in [
        (TRACE, true),
        (
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            false,
        ),
        ("not a trace", false),
    ] {
        let body = format!(
            r#"{{"name":"T","email":"t-{}@example.com"}}"#,
            Uuid::new_v4()
        );
        let (url, sent) = (url.clone(), trace.to_string());
        let status = tokio::task::spawn_blocking(move || {
            http_agent()
                .post(&url)
                .header("content-type", "application/json")
                .header("traceparent", &sent)
                .send(body.as_bytes())
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        })
        .await
        .unwrap();
        assert_eq!(status, 200);
        let published = env.drain_queue(&env.main_queue, 1).await;
        assert_eq!(published.len(), 1);
        assert_eq!(
            text_header(&published[0].delivery.properties, "traceparent").is_some(),
            kept,
            "{trace}"
        );
    }
    warren.terminate_ok(Duration::from_secs(30));
}
