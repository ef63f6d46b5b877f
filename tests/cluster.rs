//! warren on the 3-node RabbitMQ test cluster (`scripts/cluster.sh up`, found through
//! `WARREN_TEST_CLUSTER_URLS`): `QUEUE_TYPE=quorum` declares every queue as a quorum queue with
//! its arguments and a member on each of the three nodes, a second declare matches and changes
//! nothing, the arguments work (a retry tier's TTL brings a message back to the main queue, the
//! delivery limit dead-letters to the DLQ), the pipeline runs on them (a transient failure goes
//! through a quorum retry tier, every user ends in the table once), and a queue of the other
//! type (classic vs quorum) is reported as drift and left as it was. At-least-once
//! dead-lettering keeps retry-queue messages whose main queue was deleted until it is declared
//! again (and delivers each once), where classic queues lose them.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::cluster::*;
use common::*;
use lapin::Connection;
use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeleteOptions};
use serde_json::{Value, json};

// ---- this file's setup ----------------------------------------------------------------------

/// The line of `stdout` that mentions `object` (for example `queue NAME (`).
fn line_of<'a>(stdout: &'a str, object: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.contains(object))
        .unwrap_or_else(|| panic!("no line for {object:?} in:\n{stdout}"))
}

fn args(pairs: &[(&str, Value)]) -> BTreeMap<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// The quorum topology's queues and their arguments: main, one retry queue per `(name, ttl)`,
/// DLQ.
fn quorum_queues(
    env: &TestEnv,
    tiers: &[(String, u64)],
    delivery_limit: u64,
) -> BTreeMap<String, BTreeMap<String, Value>> {
    let mut wanted = BTreeMap::new();
    wanted.insert(
        env.main_queue.clone(),
        args(&[
            ("x-queue-type", json!("quorum")),
            ("x-dead-letter-exchange", json!(env.dlx_exchange)),
            ("x-dead-letter-routing-key", json!(env.dlq_queue)),
            ("x-dead-letter-strategy", json!("at-least-once")),
            ("x-overflow", json!("reject-publish")),
            ("x-delivery-limit", json!(delivery_limit)),
        ]),
    );
    for (name, ttl) in tiers {
        wanted.insert(
            name.clone(),
            args(&[
                ("x-queue-type", json!("quorum")),
                ("x-message-ttl", json!(ttl)),
                ("x-dead-letter-exchange", json!(env.main_exchange)),
                ("x-dead-letter-routing-key", json!(env.main_queue)),
                ("x-dead-letter-strategy", json!("at-least-once")),
                ("x-overflow", json!("reject-publish")),
            ]),
        );
    }
    wanted.insert(
        env.dlq_queue.clone(),
        args(&[
            ("x-queue-type", json!("quorum")),
            ("x-delivery-limit", json!(1_000_000)),
        ]),
    );
    wanted
}

/// Asserts that `queues` are exactly `wanted`, each quorum, durable, with 3 members.
fn assert_quorum_queues(
    queues: &BTreeMap<String, ClusterQueue>,
    wanted: &BTreeMap<String, BTreeMap<String, Value>>,
) {
    assert_eq!(
        queues.keys().collect::<Vec<_>>(),
        wanted.keys().collect::<Vec<_>>(),
        "the env's queues on the cluster"
    );
    for (name, q) in queues {
        assert_eq!(q.queue_type, "quorum", "{name}: {q:?}");
        assert!(q.durable, "{name}: {q:?}");
        assert_eq!(&q.arguments, &wanted[name], "{name}: arguments");
        let mut nodes = q.members.clone();
        nodes.dedup();
        assert_eq!(nodes.len(), 3, "{name}: members {:?}", q.members);
    }
}

/// (messages, messages_dlx) of the quorum queue `queue` on the cluster: `messages` counts what
/// consumers can get (ready + unacked), `messages_dlx` what the queue handed its dead-letter
/// worker and still keeps until the target confirmed it. 3.10's `rabbitmqctl list_queues` does
/// not accept `messages_dlx` (only the management API shows it), so this asks the queue through
/// `rabbitmqctl eval`.
async fn dlx_counts(queue: &str) -> (u64, u64) {
    let expr = format!(
        "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{queue}\">>)), \
         I = rabbit_quorum_queue:info(Q, [messages, messages_dlx]), \
         io:format(\"~p ~p~n\", [proplists:get_value(messages, I), \
         proplists:get_value(messages_dlx, I)])."
    );
    let out = rabbitmqctl(&["-n", &cluster_node(), "eval", &expr]).await;
    let nums: Vec<u64> = out
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    match nums[..] {
        [messages, dlx] => (messages, dlx),
        _ => panic!("messages and messages_dlx of {queue}: {out:?}"),
    }
}

/// Deletes `queue` through `conn` (its messages go with it).
async fn delete_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap_or_else(|e| panic!("delete {queue}: {e}"));
    let _ = ch.close(200, "ok".into()).await;
}

/// Takes every message of `queue` (acked) through `conn` and returns their message ids, in
/// order.
async fn take_all_ids(conn: &Connection, queue: &str) -> Vec<String> {
    let ch = conn.create_channel().await.expect("channel");
    let mut ids = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        ids.push(message_id(&m));
    }
    let _ = ch.close(200, "ok".into()).await;
    ids
}

// ---- tests ----------------------------------------------------------------------------------

/// QUEUE_TYPE=quorum with two retry tiers: every queue quorum with its arguments and 3
/// members; a second declare matches everything; the TTL and the delivery limit work.
#[tokio::test(flavor = "multi_thread")]
async fn quorum_declare_replicates_every_queue_and_matches_the_second_time() {
    let mut c = ClusterEnv::new("cl_quorum").await;
    let tiers = vec![
        (format!("{}_300ms", c.env.retry_queue), 300),
        (format!("{}_600ms", c.env.retry_queue), 600),
    ];
    c.extra_queues = tiers.iter().map(|(n, _)| n.clone()).collect();
    c.env
        .set("QUEUE_TYPE", "quorum")
        .set("DELIVERY_LIMIT", "2")
        .set("RETRY_TTLS_MS", "300,600");

    let (code, out, err) = c.env.run(&["declare"]);
    assert_eq!(code, 0, "declare failed:\n{out}\n{err}");
    let wanted = quorum_queues(&c.env, &tiers, 2);
    for name in wanted.keys() {
        let line = line_of(&out, &format!("queue {name} ("));
        assert!(line.contains("(quorum, durable"), "{line}");
        assert!(line.trim_end().ends_with("created"), "{line}");
    }
    for (name, _) in &tiers {
        let line = line_of(
            &out,
            &format!("binding {} -> {name} ", c.env.retry_exchange),
        );
        assert!(line.contains(&format!("routing key {name}")), "{line}");
    }
    let before = c.queues().await;
    assert_quorum_queues(&before, &wanted);

    // A second declare: exit 0, everything already matched, nothing changed.
    let (code, again, err) = c.env.run(&["declare"]);
    assert_eq!(code, 0, "second declare failed:\n{again}\n{err}");
    for name in wanted.keys() {
        let line = line_of(&again, &format!("queue {name} ("));
        assert!(line.trim_end().ends_with("already matched"), "{line}");
    }
    assert!(
        !again.contains("created"),
        "second declare created:\n{again}"
    );
    assert_eq!(
        c.queues().await,
        before,
        "the second declare changed a queue"
    );

    // The arguments work: a message in the second tier comes back to the main queue after
    // its TTL (quorum queues dead-letter it at least once) ...
    c.publish_to(&c.env.retry_exchange, &tiers[1].0, b"retried")
        .await;
    wait_until(
        "the retried message back in the main queue",
        Duration::from_secs(20),
        || async { c.ready(&tiers[1].0).await == 0 && c.ready(&c.env.main_queue).await == 1 },
    )
    .await;
    // ... and a message returned to the main queue more than DELIVERY_LIMIT times goes to the
    // DLQ.
    let ch = c.conn.create_channel().await.unwrap();
    let mut deliveries = 0;
    while let Some(m) = ch
        .basic_get(
            c.env.main_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    {
        deliveries += 1;
        assert!(deliveries <= 3, "delivered {deliveries} times, limit 2");
        m.reject(BasicRejectOptions { requeue: true })
            .await
            .unwrap();
    }
    wait_until(
        "the message past its delivery limit in the DLQ",
        Duration::from_secs(20),
        || async { c.ready(&c.env.dlq_queue).await == 1 },
    )
    .await;
    assert_eq!(c.ready(&c.env.main_queue).await, 0);
}

/// `warren run` on quorum queues with retry tiers: users that fail once go through the first
/// tier and back, are inserted once the fault clears, and every queue ends empty.
#[tokio::test(flavor = "multi_thread")]
async fn the_pipeline_runs_on_quorum_queues_through_the_retry_tiers() {
    const N: usize = 10;
    let mut c = ClusterEnv::new("cl_run").await;
    let tiers = [
        format!("{}_300ms", c.env.retry_queue),
        format!("{}_600ms", c.env.retry_queue),
    ];
    c.extra_queues = tiers.to_vec();
    c.env
        .set("QUEUE_TYPE", "quorum")
        .set("RETRY_TTLS_MS", "300,600")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("MAX_RETRIES", "10")
        .set("BREAKER_FAILURES", "1000");
    c.env.declare();
    install_fault(&c.env, CountAttempts::Yes).await;
    let ids: Vec<uuid::Uuid> = (0..N).map(|_| uuid::Uuid::new_v4()).collect();
    track_attempts(&c.env, &ids).await;
    c.publish_ids(&ids).await;
    let mut warren = c.env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    wait_until(
        "every message failed twice (back from the first tier)",
        Duration::from_secs(30),
        || async {
            for id in &ids {
                if attempts(&c.env, *id).await < 2 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    clear_fault(&c.env).await;
    wait_until("every row inserted", Duration::from_secs(30), || async {
        c.env.count_rows().await == N as i64
    })
    .await;
    assert_eq!(c.env.row_ids().await, ids.iter().copied().collect());
    wait_until("every queue empty", Duration::from_secs(15), || async {
        c.ready(&c.env.main_queue).await == 0
            && c.ready(&tiers[0]).await == 0
            && c.ready(&tiers[1]).await == 0
            && c.ready(&c.env.dlq_queue).await == 0
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
}

/// A classic topology exists; QUEUE_TYPE=quorum is refused as drift, naming the queue, the
/// argument, both values, the type and how to resolve it; nothing changes.
#[tokio::test(flavor = "multi_thread")]
async fn a_classic_queue_is_reported_when_quorum_is_wanted_and_left_alone() {
    let mut c = ClusterEnv::new("cl_c2q").await;
    c.env.declare();
    c.publish_to(&c.env.main_exchange, &c.env.main_queue, b"waiting")
        .await;
    let before = c.queues().await;
    assert_eq!(before.len(), 3, "{before:?}");
    assert!(
        before.values().all(|q| q.queue_type == "classic"),
        "{before:?}"
    );

    c.env.set("QUEUE_TYPE", "quorum");
    let (code, out, err) = c.env.run(&["declare"]);
    assert_eq!(code, 1, "declare over classic queues:\n{out}\n{err}");
    let main = &c.env.main_queue;
    for needle in [
        format!("queue {main} exists with "),
        "(not set), but warren declares".to_string(),
        "It looks like a classic queue, and QUEUE_TYPE=quorum declares quorum queues".into(),
        "set QUEUE_TYPE=classic".into(),
        "warren never deletes or changes an existing object".into(),
        format!("rabbitmqctl delete_queue {main}"),
    ] {
        assert!(err.contains(&needle), "stderr lacks {needle:?}:\n{err}");
    }
    assert_eq!(c.queues().await, before, "a drifted queue was changed");
    assert_eq!(c.ready(main).await, 1, "the waiting message was lost");
}

/// The other way: a quorum topology exists and QUEUE_TYPE=classic is refused the same way.
#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_queue_is_reported_when_classic_is_wanted_and_left_alone() {
    let mut c = ClusterEnv::new("cl_q2c").await;
    c.env.set("QUEUE_TYPE", "quorum");
    c.env.declare();
    c.publish_to(&c.env.main_exchange, &c.env.main_queue, b"waiting")
        .await;
    let before = c.queues().await;
    let tiers = [(c.env.retry_queue.clone(), 10_000)];
    assert_quorum_queues(&before, &quorum_queues(&c.env, &tiers, 20));

    c.env.set("QUEUE_TYPE", "classic");
    let (code, out, err) = c.env.run(&["declare"]);
    assert_eq!(code, 1, "declare over quorum queues:\n{out}\n{err}");
    let main = &c.env.main_queue;
    for needle in [
        format!("queue {main} exists with "),
        ", but warren declares".to_string(),
        "= (not set).".into(),
        "It looks like a quorum queue, and QUEUE_TYPE=classic declares classic queues".into(),
        "set QUEUE_TYPE=quorum".into(),
        "warren never deletes or changes an existing object".into(),
        format!("rabbitmqctl delete_queue {main}"),
    ] {
        assert!(err.contains(&needle), "stderr lacks {needle:?}:\n{err}");
    }
    assert_eq!(c.queues().await, before, "a drifted queue was changed");
    assert_eq!(c.ready(main).await, 1, "the waiting message was lost");
}

/// A quorum DLQ declared before warren declared the DLQ's own delivery limit (RabbitMQ 4 gives
/// every quorum queue 20 by default, past which this DLQ, which dead-letters nowhere, drops): the
/// drift says so and how to keep it (`DLQ_DELIVERY_LIMIT=0`) or move it; with that setting it
/// matches, and nothing changed.
#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_dlq_without_its_delivery_limit_is_reported_with_the_way_out() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};

    let mut c = ClusterEnv::new("cl_dlqlim").await;
    c.env.set("QUEUE_TYPE", "quorum");
    let mut old = FieldTable::default();
    old.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    c.channel
        .queue_declare(
            c.env.dlq_queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            old,
        )
        .await
        .expect("the DLQ as declared before");
    let (code, out, err) = c.env.run(&["declare"]);
    assert_eq!(code, 1, "declare over the old DLQ:\n{out}\n{err}");
    for needle in [
        format!(
            "queue {} exists with x-delivery-limit = (not set)",
            c.env.dlq_queue
        ),
        "warren declares a quorum DLQ with its delivery limit (DLQ_DELIVERY_LIMIT)".to_string(),
        "DLQ_DELIVERY_LIMIT=0".into(),
    ] {
        assert!(err.contains(&needle), "stderr lacks {needle:?}:\n{err}");
    }
    c.env.set("DLQ_DELIVERY_LIMIT", "0");
    let (code, out, err) = c.env.run(&["declare"]);
    assert_eq!(code, 0, "declare keeping the old DLQ:\n{out}\n{err}");
    let queues = c.queues().await;
    assert_eq!(
        queues[&c.env.dlq_queue].arguments,
        args(&[("x-queue-type", json!("quorum"))])
    );
}

/// At-least-once dead-lettering, the reason for quorum queues: messages waiting in the retry
/// queue while the main queue is deleted expire into the retry queue's dead-letter worker, stay
/// with the broker (`messages_dlx`) while their route is missing, and arrive in the main queue
/// exactly once after `warren declare` re-creates it (within the worker's retry interval,
/// `dead_letter_worker_publisher_confirm_timeout`, 5 s on the test cluster).
#[tokio::test(flavor = "multi_thread")]
async fn quorum_retry_messages_survive_a_deleted_main_queue_and_arrive_once() {
    const N: usize = 20;
    let mut c = ClusterEnv::new("cl_dlx_q").await;
    c.env.set("QUEUE_TYPE", "quorum").set("RETRY_TTL_MS", "500");
    c.env.declare();
    delete_queue(&c.conn, &c.env.main_queue).await;

    let ids: Vec<String> = (0..N).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    for id in &ids {
        let uuid = id.parse().unwrap();
        c.publish_with(
            &c.env.retry_exchange,
            &c.env.retry_queue,
            &user_body(uuid),
            json_props(uuid),
        )
        .await;
    }
    // Expired, handed to the dead-letter worker, which finds no route and keeps them.
    wait_until(
        "every retry message expired and held by the dead-letter worker",
        Duration::from_secs(30),
        || async { dlx_counts(&c.env.retry_queue).await == (0, N as u64) },
    )
    .await;
    assert!(
        warren::amqp::queue_stats(&c.conn, &c.env.main_queue)
            .await
            .is_err(),
        "the main queue should still be deleted"
    );

    c.env.declare();
    wait_until(
        "the worker delivered every held message and settled it",
        Duration::from_secs(30),
        || async {
            dlx_counts(&c.env.retry_queue).await == (0, 0)
                && c.ready(&c.env.main_queue).await >= N as u32
        },
    )
    .await;
    // The worker is done with the retry queue (messages_dlx 0): nothing more can come from it.
    let mut got = take_all_ids(&c.conn, &c.env.main_queue).await;
    got.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(
        got, want,
        "every held message exactly once in the main queue"
    );
}

/// The same scenario on classic queues (on the single node) loses the messages: the retry
/// queue dead-letters at most once, an expired message with no route is dropped. After the TTL
/// the retry queue is empty, and when the main queue is declared again only a sentinel sent
/// through the same retry queue afterwards arrives.
#[tokio::test(flavor = "multi_thread")]
async fn classic_retry_messages_are_lost_when_the_main_queue_is_deleted() {
    const N: usize = 20;
    let mut env = TestEnv::new("dlx_classic").await;
    env.set("RETRY_TTL_MS", "500");
    env.declare();
    delete_queue(&env.conn, &env.main_queue).await;
    for _ in 0..N {
        let id = uuid::Uuid::new_v4();
        env.publish_to(
            &env.retry_exchange,
            &env.retry_queue,
            &user_body(id),
            json_props(id),
        )
        .await;
    }
    wait_until(
        "the retry queue empty after the TTL",
        Duration::from_secs(30),
        || async { env.ready(&env.retry_queue).await == 0 },
    )
    .await;

    env.declare();
    let sentinel = uuid::Uuid::new_v4();
    env.publish_to(
        &env.retry_exchange,
        &env.retry_queue,
        &user_body(sentinel),
        json_props(sentinel),
    )
    .await;
    wait_until(
        "the sentinel in the main queue",
        Duration::from_secs(30),
        || async { env.ready(&env.main_queue).await >= 1 },
    )
    .await;
    let got = take_all_ids(&env.conn, &env.main_queue).await;
    assert_eq!(
        got,
        vec![sentinel.to_string()],
        "classic queues dropped the {N} messages; only the sentinel arrives"
    );
}
