//! `warren move`: a queue's messages go to another exchange and routing key once each, headers
//! and properties intact, in order, with `--limit` and a second run picking up the rest; an
//! unroutable destination (exchange missing, or no queue bound for the key) moves nothing and
//! loses nothing; a destination that routes back into the source does not loop; a move killed
//! midway leaves every message in the source, the destination or both, and a second run
//! finishes it.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use lapin::types::AMQPValue;
use uuid::Uuid;

/// Publishes `n` users to the main queue, each with the headers `x-seq` (its position) and
/// `x-note` and a priority, expiration-free; returns the ids in order.
async fn publish_numbered(env: &TestEnv, n: usize) -> Vec<Uuid> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    env.publish_pipelined(ids.iter().enumerate().map(|(i, id)| {
        let props = json_props(*id)
            .with_priority(3)
            .with_correlation_id("c-42".into());
        let props = with_header(props, "x-seq", AMQPValue::LongLongInt(i as i64));
        let props = with_header(props, "x-note", long_string("kept as is"));
        (user_body(*id), props)
    }))
    .await;
    ids
}

/// Runs `warren move args...` and asserts exit code `code`: (stdout, stderr).
fn warren_move(env: &TestEnv, args: &[&str], code: i32) -> (String, String) {
    let mut full = vec!["move"];
    full.extend_from_slice(args);
    let (got, out, err) = env.run(&full);
    assert_eq!(got, code, "warren {full:?}: exit {got}\n{out}\n{err}");
    (out, err)
}

/// The destination of these tests: the env's DLX, whose binding routes the DLQ's name to the
/// DLQ (a plain queue, removed with the env).
fn to_dlq(env: &TestEnv) -> String {
    format!("{}/{}", env.dlx_exchange, env.dlq_queue)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_messages_move_once_each_with_their_headers_in_order() {
    let env = TestEnv::new("move_200").await;
    env.declare();
    let ids = publish_numbered(&env, 200).await;
    let to = to_dlq(&env);

    // --limit takes a part; windows of 64 make several windows, the last one short.
    let (out, _) = warren_move(
        &env,
        &[
            "--from",
            &env.main_queue,
            "--to",
            &to,
            "--limit",
            "50",
            "--in-flight",
            "64",
        ],
        0,
    );
    assert!(
        out.contains(&format!(
            "moved 50 messages from {} to {} (routing key {:?}); 150 left in {}",
            env.main_queue, env.dlx_exchange, env.dlq_queue, env.main_queue
        )),
        "{out}"
    );
    assert_eq!(env.ready(&env.dlq_queue).await, 50);
    // Run again: the rest, and it ends with the source empty.
    let (out, _) = warren_move(
        &env,
        &["--from", &env.main_queue, "--to", &to, "--in-flight", "64"],
        0,
    );
    assert!(out.contains("moved 150 messages"), "{out}");
    assert!(
        out.contains(&format!("; 0 left in {}", env.main_queue)),
        "{out}"
    );
    assert_eq!(
        queue_counts(&env.main_queue).await,
        (0, 0),
        "source empty, nothing unacked"
    );
    // Nothing left to move: exit 0 at once.
    let (out, _) = warren_move(&env, &["--from", &env.main_queue, "--to", &to], 0);
    assert!(out.contains("moved 0 messages"), "{out}");

    let moved = env.drain_queue(&env.dlq_queue, 1000).await;
    assert_eq!(moved.len(), 200, "every message arrived once");
    let position: HashMap<Uuid, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut seen = HashSet::new();
    for (i, m) in moved.iter().enumerate() {
        let id = message_uuid(m);
        assert!(seen.insert(id), "{id} arrived twice");
        assert_eq!(position.get(&id), Some(&i), "in the order of the source");
        assert_eq!(strict_int_header(&m.properties, "x-seq"), Some(i as i64));
        assert_eq!(
            text_header(&m.properties, "x-note").as_deref(),
            Some("kept as is")
        );
        assert_eq!(m.properties.delivery_mode(), &Some(2));
        assert_eq!(m.properties.priority(), &Some(3));
        assert_eq!(
            m.properties.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            m.properties.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c-42")
        );
        assert_eq!(m.data, user_body(id), "body unchanged");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unroutable_destination_moves_nothing_and_loses_nothing() {
    let env = TestEnv::new("move_unroutable").await;
    env.declare();
    let ids = publish_numbered(&env, 30).await;

    // The exchange does not exist: refused before anything is taken.
    let missing = format!("{}_missing", env.id);
    let (_, err) = warren_move(
        &env,
        &["--from", &env.main_queue, "--to", &format!("{missing}/k")],
        1,
    );
    assert!(
        err.contains(&format!(
            "exchange {missing} does not exist; nothing was moved"
        )),
        "{err}"
    );
    assert_eq!(queue_counts(&env.main_queue).await, (30, 0));

    // The exchange exists but no queue is bound for the key: the first window comes back
    // unroutable, nothing is acked.
    let (out, err) = warren_move(
        &env,
        &[
            "--from",
            &env.main_queue,
            "--to",
            &format!("{}/nobody", env.dlx_exchange),
            "--in-flight",
            "8",
        ],
        1,
    );
    assert!(out.contains("moved 0 messages"), "{out}");
    assert!(err.contains("was not republished: unroutable"), "{err}");
    assert!(
        err.contains(&format!("stay in {}", env.main_queue)),
        "{err}"
    );
    assert_eq!(
        queue_counts(&env.main_queue).await,
        (30, 0),
        "all back in the source"
    );
    assert_eq!(env.ready(&env.dlq_queue).await, 0);

    // The source queue does not exist.
    let (_, err) = warren_move(&env, &["--from", &missing, "--to", &to_dlq(&env)], 1);
    assert!(
        err.contains(&format!("queue {missing} does not exist")),
        "{err}"
    );

    // Without a routing key each message keeps its own: to the main exchange, that routes it
    // back into the source, and the move stops after the 30 it found there instead of looping.
    let (out, _) = warren_move(
        &env,
        &["--from", &env.main_queue, "--to", &env.main_exchange],
        0,
    );
    assert!(
        out.contains(&format!(
            "moved 30 messages from {q} to {} (each message's own routing key); 30 left in {q}",
            env.main_exchange,
            q = env.main_queue
        )),
        "{out}"
    );

    // Still all there, once each.
    let left: HashSet<Uuid> = env
        .drain_queue(&env.main_queue, 100)
        .await
        .iter()
        .map(message_uuid)
        .collect();
    assert_eq!(left, ids.into_iter().collect::<HashSet<_>>());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_move_killed_midway_loses_nothing_and_a_second_run_finishes_it() {
    let env = TestEnv::new("move_kill").await;
    env.declare();
    let total = 5000;
    let ids: HashSet<Uuid> = env.publish_users(total).await.into_iter().collect();
    let to = to_dlq(&env);
    let window = 10;
    let mut child = env
        .command(&[
            "move",
            "--from",
            &env.main_queue,
            "--to",
            &to,
            "--in-flight",
            "10",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start warren move");
    wait_until("the move under way", Duration::from_secs(30), || async {
        env.ready(&env.dlq_queue).await >= 500
    })
    .await;
    child.kill().expect("kill -9");
    let _ = child.wait();
    let arrived = env.ready(&env.dlq_queue).await as usize;
    assert!(arrived < total, "the move was over before the kill");
    // Unacked messages return to the source when the broker sees the connection gone.
    wait_until("the source settled", Duration::from_secs(30), || async {
        queue_counts(&env.main_queue).await.1 == 0
    })
    .await;
    let left = env.ready(&env.main_queue).await as usize;
    assert!(
        left + arrived >= total && left + arrived <= total + window,
        "every message in the source or the destination, at most a window in both: {left} + {arrived}"
    );

    warren_move(&env, &["--from", &env.main_queue, "--to", &to], 0);
    assert_eq!(queue_counts(&env.main_queue).await, (0, 0));
    let moved = env.drain_queue(&env.dlq_queue, total + 100).await;
    let distinct: HashSet<Uuid> = moved.iter().map(message_uuid).collect();
    assert_eq!(distinct, ids, "every message at the destination");
    assert!(
        moved.len() <= total + window,
        "at most one window twice: {}",
        moved.len()
    );
}
