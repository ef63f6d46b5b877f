//! The broker's `consumer_timeout` against warren holding deliveries: with the database
//! systemically failing, the breaker holds the consumer and the sink retries its batch in place;
//! warren gives the batch back (nack with requeue) before `AMQP_CONSUMER_TIMEOUT_MS`, so the
//! broker never closes its channel, the messages wait in the queue (ready, none unacked, no
//! `x-retries`), and land once when the database is back. When the broker's timeout is shorter
//! than warren's setting, the broker closes the channel and warren recovers by itself.
//!
//! RabbitMQ 3.10 reads `rabbit.consumer_timeout` once per channel, when the channel starts, and
//! enforces it on the channel's tick (`rabbit.channel_tick_interval`, read again at every tick,
//! 60 s by default) by closing the channel with PRECONDITION_FAILED. The tests set both at run
//! time on ONE cluster node (the last of `WARREN_TEST_CLUSTER_URLS`), start warren against that
//! node alone, put the timeout back once warren's channel exists (so other clients of the node
//! are not affected for longer), and restore both in a drop guard whatever happens.

mod common;

use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;

/// The broker's consumer timeout the tests set, in ms.
const BROKER_TIMEOUT_MS: u64 = 10_000;

/// One test at a time changes the node's settings (the tests of this file run in parallel).
static NODE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runtime settings of one cluster node, restored on drop.
struct NodeSettings {
    node: String,
    /// (key, Erlang term of the value before the test).
    saved: Vec<(&'static str, String)>,
    /// Held while the settings are changed; released after they are restored.
    _lock: tokio::sync::MutexGuard<'static, ()>,
}

impl NodeSettings {
    /// Sets `rabbit.channel_tick_interval` to 1 s (the broker checks every second) and
    /// `rabbit.consumer_timeout` to `timeout_ms` on `node`, remembering the old values.
    async fn shorten(node: &str, timeout_ms: u64) -> Self {
        let mut guard = NodeSettings {
            node: node.to_string(),
            saved: Vec::new(),
            _lock: NODE_LOCK.lock().await,
        };
        for (key, value) in [
            ("channel_tick_interval", 1000),
            ("consumer_timeout", timeout_ms),
        ] {
            let old = eval(node, &format!("application:get_env(rabbit, {key}).")).await;
            guard.saved.push((key, old));
            eval(
                node,
                &format!("application:set_env(rabbit, {key}, {value})."),
            )
            .await;
        }
        guard
    }

    /// Puts the node's consumer timeout back (channels opened from now on get it).
    fn restore_consumer_timeout(&mut self) {
        if let Some(i) = self
            .saved
            .iter()
            .position(|(k, _)| *k == "consumer_timeout")
        {
            let (key, old) = self.saved.remove(i);
            restore(&self.node, key, &old);
        }
    }
}

impl Drop for NodeSettings {
    fn drop(&mut self) {
        for (key, old) in std::mem::take(&mut self.saved) {
            restore(&self.node, key, &old);
        }
    }
}

/// `rabbitmqctl -n node eval expr`, which must succeed: its output, trimmed.
async fn eval(node: &str, expr: &str) -> String {
    rabbitmqctl(&["-n", node, "eval", expr])
        .await
        .trim()
        .to_string()
}

/// Sets `rabbit.key` back to what `application:get_env` printed (`{ok,V}`), or unsets it.
fn restore(node: &str, key: &str, old: &str) {
    let expr = match old.strip_prefix("{ok,").and_then(|v| v.strip_suffix('}')) {
        Some(value) => format!("application:set_env(rabbit, {key}, {value})."),
        None => format!("application:unset_env(rabbit, {key})."),
    };
    let ok = std::process::Command::new("rabbitmqctl")
        .args(["-q", "-n", node, "eval", &expr])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "could not restore rabbit.{key} on {node}: run `rabbitmqctl -n {node} eval '{expr}'`"
        );
    }
}

/// The last cluster node: (its URL, its node name).
fn last_node() -> (String, String) {
    let urls = cluster_urls();
    let n = urls.len();
    (urls[n - 1].clone(), format!("warren-rc{n}@localhost"))
}

/// A `ClusterEnv` whose warren talks to `url` alone, with the database refusing every insert
/// with a systemic error (insufficient_privilege) and `n` users published.
async fn systemic_setup(test: &str, url: &str, n: usize) -> (ClusterEnv, Vec<uuid::Uuid>) {
    let mut c = ClusterEnv::new(test).await;
    c.env
        .set("AMQP_URL", url)
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("USERS_BATCH_SIZE", "10");
    c.env.declare();
    install_fault(&c.env, CountAttempts::No).await;
    set_fault_sqlstate(&c.env, "42501").await;
    let ids: Vec<uuid::Uuid> = (0..n).map(|_| uuid::Uuid::new_v4()).collect();
    c.publish_ids(&ids).await;
    (c, ids)
}

/// Starts warren (consumer role) once the node's settings are shortened, and waits until it
/// consumes; then the node's consumer timeout goes back (warren's channel keeps the short one).
async fn start_on_short_timeout(c: &ClusterEnv, guard: &mut NodeSettings) -> Warren {
    let warren = c.env.start(&["--roles", "consumer"]);
    wait_until("warren consuming", Duration::from_secs(30), || async {
        warren.logs().contains("consuming")
    })
    .await;
    guard.restore_consumer_timeout();
    warren
}

/// Up to `max` messages of `queue` through `conn`, unacked: they go back when the channel closes.
async fn peek(
    conn: &lapin::Connection,
    queue: &str,
    max: usize,
) -> Vec<lapin::message::BasicGetMessage> {
    let ch = conn.create_channel().await.expect("channel");
    let mut out = Vec::new();
    while out.len() < max {
        match ch
            .basic_get(
                queue.into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get")
        {
            Some(m) => out.push(m),
            None => break,
        }
    }
    let _ = ch.close(200, "ok".into()).await;
    out
}

async fn amqp_reconnects(env: &TestEnv) -> f64 {
    // An absent series is 0; a /metrics that does not answer is a failure, never 0.
    metric(env, "warren_reconnects_total", &[("target", "amqp")]).await
}

/// Warren's AMQP_CONSUMER_TIMEOUT_MS equals the broker's: the batch held by the failing
/// database is given back before the broker's timeout, the broker never closes the channel, the
/// messages wait ready in the queue with no retry spent, and land once when the database is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_held_by_the_breaker_is_given_back_before_the_brokers_consumer_timeout() {
    const N: usize = 20;
    let (url, node) = last_node();
    let (mut c, ids) = systemic_setup("ct_give_back", &url, N).await;
    c.env
        .set("AMQP_CONSUMER_TIMEOUT_MS", BROKER_TIMEOUT_MS.to_string());
    let mut guard = NodeSettings::shorten(&node, BROKER_TIMEOUT_MS).await;
    let started = Instant::now();
    let mut warren = start_on_short_timeout(&c, &mut guard).await;
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    wait_until("the breaker open", Duration::from_secs(30), || async {
        try_metric(
            &c.env,
            "warren_breaker_open",
            &[("pipeline", "users"), ("stage", "main")],
        )
        .await
            == Some(1.0)
    })
    .await;
    wait_until(
        "every message given back: ready, none unacked",
        Duration::from_secs(30),
        || async { queue_counts_on(Some(&node), &c.env.main_queue).await == (N as u64, 0) },
    )
    .await;
    assert!(
        warren.logs().contains("giving it back to the queue"),
        "log:\n{}",
        warren.logs()
    );
    // The broker checks every second; had a delivery stayed unacked past its timeout it would
    // have closed the channel by now (twice the timeout after warren's first delivery).
    wait_until(
        "twice the broker's timeout since warren started",
        Duration::from_secs(60),
        || async { started.elapsed() > Duration::from_millis(2 * BROKER_TIMEOUT_MS) },
    )
    .await;
    assert_eq!(amqp_reconnects(&c.env).await, 0.0, "the channel was closed");
    assert!(
        !warren.logs().contains("consumer channel is closed"),
        "log:\n{}",
        warren.logs()
    );
    assert_eq!(
        queue_counts_on(Some(&node), &c.env.main_queue).await,
        (N as u64, 0)
    );
    // Given back untouched: no x-retries, nothing in the retry queue or the DLQ.
    for m in peek(&c.conn, &c.env.main_queue, N).await {
        assert!(
            header(&m.delivery.properties, "x-retries").is_none(),
            "x-retries set on a given-back message"
        );
    }

    clear_fault(&c.env).await;
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&c.env, &expected, Duration::from_secs(60), &|| {
        warren.logs()
    })
    .await;
    assert_eq!(
        metric(&c.env, "warren_messages_retried_total", &[]).await,
        0.0
    );
    assert_eq!(c.ready(&c.env.retry_queue).await, 0);
    assert_eq!(c.ready(&c.env.dlq_queue).await, 0);
    assert_eq!(amqp_reconnects(&c.env).await, 0.0);
    // What it told the world (docs/events.md): the systemic error, the breaker opened, the batch
    // given back (once per give-back, with its size), the breaker closed once the database was back.
    wait_until("breaker_closed", Duration::from_secs(30), || async {
        stream_events(&c.env)
            .await
            .iter()
            .any(|e| e["type"] == "breaker_closed")
    })
    .await;
    let events = stream_events(&c.env).await;
    let of = |kind: &str| {
        events
            .iter()
            .filter(|e| e["type"] == kind)
            .collect::<Vec<_>>()
    };
    assert!(
        of("error").iter().any(|e| e["message"]
            .as_str()
            .is_some_and(|m| m.contains("systemic"))),
        "{events:?}"
    );
    assert_eq!(of("breaker_opened").len(), 1, "{events:?}");
    assert_eq!(of("breaker_opened")[0]["pipeline"], "users");
    assert_eq!(of("breaker_closed").len(), 1, "{events:?}");
    let given_back = of("given_back");
    assert!(!given_back.is_empty(), "{events:?}");
    assert!(given_back.iter().all(|e| {
        e["reason"] == "consumer_timeout"
            && e["count"]
                .as_u64()
                .is_some_and(|n| (1..=N as u64).contains(&n))
    }));
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(
        queue_counts_on(Some(&node), &c.env.main_queue).await,
        (0, 0)
    );
}

/// Warren's AMQP_CONSUMER_TIMEOUT_MS is larger than the broker's (here 0: warren believes there
/// is none): the broker closes the channel over the held batch; warren rebuilds its link by
/// itself, stays held while the database fails, and every message lands once afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn warren_recovers_when_the_broker_times_its_consumer_out() {
    const N: usize = 20;
    let (url, node) = last_node();
    let (mut c, ids) = systemic_setup("ct_timed_out", &url, N).await;
    c.env.set("AMQP_CONSUMER_TIMEOUT_MS", "0");
    let mut guard = NodeSettings::shorten(&node, BROKER_TIMEOUT_MS).await;
    let mut warren = start_on_short_timeout(&c, &mut guard).await;
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    wait_until(
        "the broker closed the channel and warren reconnected",
        Duration::from_secs(60),
        || async { amqp_reconnects(&c.env).await >= 1.0 },
    )
    .await;
    assert!(
        warren.logs().contains("consumer channel is closed"),
        "log:\n{}",
        warren.logs()
    );
    clear_fault(&c.env).await;
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&c.env, &expected, Duration::from_secs(60), &|| {
        warren.logs()
    })
    .await;
    assert_eq!(c.ready(&c.env.dlq_queue).await, 0);
    wait_until("the main queue empty", Duration::from_secs(30), || async {
        queue_counts_on(Some(&node), &c.env.main_queue).await == (0, 0)
    })
    .await;
    warren.terminate_ok(Duration::from_secs(30));
}

/// Reviews R38f F5 and F2: bodies over MAX_MESSAGE_BYTES whose parks wait, under a broker
/// `consumer_timeout` of 6 s that warren knows (`AMQP_CONSUMER_TIMEOUT_MS`). One body parking
/// refuses (a trigger on `dead_letters`) is at the head of the queue, two parking takes behind
/// it. The refused body's park is tried again after a backoff that grows to 30 to 60 s, and it
/// held the delivery that long (F5: 49 s under a 20 s timeout, and the broker closed the
/// channel, everything in flight on it going back): now it is cut to what is left of 80% of the
/// timeout. And every give-back put the bodies back at the queue's head in their first order,
/// where a rotation by place began again at the refused one (F2): now the turn goes by the
/// failed parks of each body. The two are parked, the users land, and the refused body's
/// park fails until its backoff (0.2 s doubling) is past the timeout, and for twice the timeout
/// more: the broker never closed the channel. Then the trigger goes and the third is parked,
/// each once.
#[tokio::test(flavor = "multi_thread")]
async fn bodies_whose_parks_fail_are_given_back_within_the_brokers_consumer_timeout() {
    const N: usize = 20;
    const TIMEOUT_MS: u64 = 6_000;
    let (url, node) = last_node();
    let mut c = ClusterEnv::new("ct_parks").await;
    c.env
        .set("AMQP_URL", &url)
        .set("AMQP_CONSUMER_TIMEOUT_MS", TIMEOUT_MS.to_string());
    c.env.declare();
    refuse_big_parks(&c.env).await;
    let sizes = [2usize << 20, 300 << 10, (300 << 10) + 1];
    for (i, size) in sizes.iter().enumerate() {
        let properties = lapin::BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id(format!("big-{i}").into());
        c.publish_with(
            &c.env.main_exchange,
            &c.env.main_queue,
            &vec![b'a' + i as u8; *size],
            properties,
        )
        .await;
    }
    let ids: Vec<uuid::Uuid> = (0..N).map(|_| uuid::Uuid::new_v4()).collect();
    c.publish_ids(&ids).await;
    let mut guard = NodeSettings::shorten(&node, TIMEOUT_MS).await;
    let mut warren = start_on_short_timeout(&c, &mut guard).await;
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let expected = ids.iter().copied().collect();
    assert_rows_exactly(&c.env, &expected, Duration::from_secs(60), &|| {
        warren.logs()
    })
    .await;
    let parked = "SELECT count(*) FROM dead_letters WHERE message_id IN ('big-1', 'big-2')";
    wait_until(
        "the two bodies parking takes, parked",
        Duration::from_secs(60),
        || async { count_of(&c.env, parked).await == 2 },
    )
    .await;
    // The refused body's backoff grows past the timeout (its 7th is 6.4 to 12.8 s): had one
    // held its delivery past it, the broker (checking every second) would close the channel.
    const BACKOFF: &str = "messages go back to their queue after a backoff";
    wait_until(
        "the refused body's park failed 7 times",
        Duration::from_secs(120),
        || async { warren.logs().matches(BACKOFF).count() >= 7 },
    )
    .await;
    let since = Instant::now();
    wait_until(
        "twice the broker's timeout more",
        Duration::from_secs(60),
        || async { since.elapsed() > Duration::from_millis(2 * TIMEOUT_MS) },
    )
    .await;
    assert_eq!(amqp_reconnects(&c.env).await, 0.0, "the channel was closed");
    assert!(
        !warren.logs().contains("consumer channel is closed"),
        "log:\n{}",
        warren.logs()
    );
    c.env
        .db
        .batch_execute("DROP TRIGGER refuse_big ON dead_letters")
        .await
        .expect("drop the trigger");
    wait_until(
        "the refused body parked once the trigger went",
        Duration::from_secs(90),
        || async { count_of(&c.env, "SELECT count(*) FROM dead_letters").await == 3 },
    )
    .await;
    warren.terminate_ok(Duration::from_secs(30));
    let rows = c
        .env
        .db
        .query(
            "SELECT message_id, octet_length(body) FROM dead_letters ORDER BY message_id",
            &[],
        )
        .await
        .expect("the parked rows");
    let parked: Vec<(String, i32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let expected: Vec<(String, i32)> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("big-{i}"), *s as i32))
        .collect();
    assert_eq!(parked, expected, "each body parked once, whole");
    assert_eq!(
        queue_counts_on(Some(&node), &c.env.main_queue).await,
        (0, 0)
    );
}
