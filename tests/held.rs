//! A message held at the front of the window never holds the ones behind it, at any moment: one
//! invalid message whose dead letter cannot be routed (the DLQ's binding removed) is held by warren
//! in its requeue backoff, again and again, while the pipeline resubscribes in every way it can
//! (the balancer moving the concurrency up and down, and the prefetch window with it; `warren ctl
//! pause` and `resume`; the consumer's connection closed by the broker). Each time, the rows
//! published behind it land well before the held message is released. Once the binding is back,
//! the held message is in the DLQ once and every published row in the table once.
//!
//! "Before it is released" is read from warren's own log: each hold is one `messages go back to
//! their queue after a backoff` line with its `delay_ms`, logged as the hold begins; the test
//! waits for holds long enough to leave seconds to spare, and a phase passes only if its rows all
//! landed before that hold could have ended (and, where the link stays up, while no new hold began).

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use lapin::types::FieldTable;
use serde_json::Value;
use uuid::Uuid;

/// The held message's id.
const HELD: &str = "held-invalid";

/// A hold long enough to run a phase inside it: the requeue backoff reaches it at its 7th
/// step (12.8 s, up to twice that with jitter), some 13 to 25 s after the start.
const LONG_HOLD: Duration = Duration::from_secs(12);

/// How far before the hold's end a phase must be done: the hold began at most this long before
/// the test saw its log line (the test polls every 100 ms).
const MARGIN: Duration = Duration::from_secs(1);

/// One hold of the held message, as warren logged it.
#[derive(Debug, Clone, Copy)]
struct Hold {
    /// Its place among the holds logged (0 for the first).
    index: usize,
    /// The backoff it waits out before the message goes back to its queue.
    delay: Duration,
    /// When the test saw its line (the hold began at most [`MARGIN`] earlier, the line being
    /// logged as the backoff starts).
    seen: Instant,
}

impl Hold {
    /// The latest moment the message is certainly still held.
    fn still_held_until(&self) -> Instant {
        self.seen + self.delay - MARGIN
    }

    fn left(&self) -> Duration {
        self.still_held_until()
            .saturating_duration_since(Instant::now())
    }
}

/// The delays of every hold of the main pipeline logged so far, in order.
fn holds_logged(warren: &Warren) -> Vec<Duration> {
    warren
        .logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["message"] == "messages go back to their queue after a backoff"
                && v["pipeline"] == "users"
                && v["stage"] == "main"
        })
        .map(|v| {
            Duration::from_millis(
                v["delay_ms"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("a hold line without delay_ms: {v}")),
            )
        })
        .collect()
}

/// Waits for the next hold to begin after the `after`-th (any delay) and answers it.
async fn next_hold(warren: &Warren, after: usize, timeout: Duration) -> Hold {
    let deadline = Instant::now() + timeout;
    loop {
        let holds = holds_logged(warren);
        if holds.len() > after {
            let index = holds.len() - 1;
            return Hold {
                index,
                delay: holds[index],
                seen: Instant::now(),
            };
        }
        assert!(
            Instant::now() < deadline,
            "no hold after the {after}-th within {timeout:?}; log:\n{}",
            tail(&warren.logs(), 60)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A hold with at least `left` to go: `current` if it has, else the next hold long enough.
async fn hold_with(warren: &Warren, current: Hold, left: Duration) -> Hold {
    let mut hold = current;
    while hold.left() < left {
        hold = next_hold(warren, hold.index, Duration::from_secs(180)).await;
    }
    hold
}

/// Waits until every id of `ids` is in the table, while `hold` certainly lasts; panics naming
/// the phase, and how far it got, otherwise. With `same_hold`, no new hold may have begun
/// meanwhile either (the held message was never released).
async fn land_within(
    env: &TestEnv,
    warren: &Warren,
    hold: Hold,
    ids: &HashSet<Uuid>,
    phase: &str,
    same_hold: bool,
) {
    loop {
        let stored = env.row_ids().await;
        let missing = ids.iter().filter(|id| !stored.contains(id)).count();
        if missing == 0 {
            break;
        }
        assert!(
            Instant::now() < hold.still_held_until(),
            "{phase}: {missing} of {} rows published behind the held message had not landed \
             {:?} into its hold of {:?} (hold {}): the held message holds the window; log:\n{}",
            ids.len(),
            hold.seen.elapsed(),
            hold.delay,
            hold.index,
            tail(&warren.logs(), 80)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if same_hold {
        assert_eq!(
            holds_logged(warren).len(),
            hold.index + 1,
            "{phase}: the held message was released and held again before the rows landed"
        );
    }
}

async fn concurrency(env: &TestEnv) -> Option<f64> {
    try_metric(
        env,
        "warren_pipeline_concurrency",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await
}

/// Lines of warren's log whose message is `message`, logged by the main pipeline's consumer.
fn logged(warren: &Warren, message: &str) -> usize {
    warren
        .logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == message && v["pipeline"] == "users" && v["stage"] == "main")
        .count()
}

/// `warren ctl ARGS`, which must succeed.
async fn ctl(env: &TestEnv, args: &[&str]) {
    let mut full = vec!["ctl"];
    full.extend_from_slice(args);
    let (code, out, err) = env.run_async(&full).await;
    assert_eq!(code, 0, "warren {full:?}:\n{out}\n{err}");
    assert!(out.contains("executed"), "warren {full:?}:\n{out}\n{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_held_message_never_holds_the_rows_behind_it_across_any_resubscription() {
    let mut env = TestEnv::new("held").await;
    env.set("LOG_FORMAT", "json")
        .set("PUBLISH_TIMEOUT_MS", "500")
        .set("REGISTRY_HEARTBEAT_MS", "300")
        .set("USERS_BALANCE", "simple")
        .set("USERS_BALANCE_COOLDOWN_MS", "500")
        .set("USERS_SCALE_THRESHOLD", "300")
        .set("USERS_MIN_CONCURRENCY", "1")
        .set("USERS_MAX_CONCURRENCY", "3")
        .set("USERS_BATCH_SIZE", "100")
        .set("USERS_BATCH_TIMEOUT_MS", "50");
    let _redis = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let pid = warren.pid();
    wait_until(
        "the consumer is running",
        Duration::from_secs(30),
        || async { instance(&env, pid).await["status"] == "running" },
    )
    .await;
    // The DLQ unbound (once warren runs: its start binds what `warren declare` binds): the
    // held message's dead letter comes back unroutable, so warren keeps it (a requeue after a
    // growing backoff) instead of acking it.
    env.channel
        .queue_unbind(
            env.dlq_queue.as_str().into(),
            env.dlx_exchange.as_str().into(),
            env.dlq_queue.as_str().into(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the DLQ");
    let props = lapin::BasicProperties::default().with_message_id(HELD.into());
    env.publish_raw(b"{not json", props).await;
    let mut all: HashSet<Uuid> = HashSet::new();

    // Its first holds are short; the phases run inside holds of seconds.
    let first = next_hold(&warren, 0, Duration::from_secs(30)).await;
    let hold = hold_with(&warren, first, LONG_HOLD).await;

    // 1. The balancer moves 1 -> 3 under a backlog: the window grows from 200 to 600.
    let resubscribed = logged(&warren, "consuming");
    let ids: Vec<Uuid> = env.publish_users(12_000).await;
    all.extend(ids.iter().copied());
    let phase: HashSet<Uuid> = ids.into_iter().collect();
    wait_until(
        "the balancer at 3 inserts in flight",
        hold.left(),
        || async { concurrency(&env).await == Some(3.0) },
    )
    .await;
    let landed = env.row_ids().await;
    assert!(
        phase.iter().any(|id| !landed.contains(id)),
        "the backlog drained before the balancer moved: the phase tested nothing"
    );
    land_within(&env, &warren, hold, &phase, "balance 1 -> 3", true).await;
    assert!(
        logged(&warren, "consuming") > resubscribed,
        "no resubscription at the change 1 -> 3"
    );

    // 2. The backlog gone, the balancer moves back to 1: the window shrinks to 200.
    let hold = hold_with(&warren, hold, Duration::from_secs(6)).await;
    wait_until("the balancer back at 1", hold.left(), || async {
        concurrency(&env).await == Some(1.0)
    })
    .await;
    let ids = env.publish_users(200).await;
    all.extend(ids.iter().copied());
    land_within(
        &env,
        &warren,
        hold,
        &ids.into_iter().collect(),
        "balance 3 -> 1",
        true,
    )
    .await;

    // 3. An operator pauses, then resumes: the consumer subscribes again at once.
    let hold = hold_with(&warren, hold, Duration::from_secs(8)).await;
    ctl(&env, &["pause", "--all"]).await;
    wait_until("paused", hold.left(), || async {
        instance(&env, pid).await["status"] == "paused"
    })
    .await;
    let ids = env.publish_users(200).await;
    all.extend(ids.iter().copied());
    ctl(&env, &["resume", "--all"]).await;
    land_within(
        &env,
        &warren,
        hold,
        &ids.into_iter().collect(),
        "ctl pause + resume",
        true,
    )
    .await;

    // 4. The broker closes the consumer's connection: the new link subscribes at once, while
    // the old link's copy of the held message still waits out its backoff in warren (the broker
    // took it back and delivers it again, so it is held anew). `rabbitmqctl` can take seconds to
    // answer: the connection is looked up first, and the hold must leave time for the close.
    let name = format!("warren users/main {}:{pid}", host());
    let listing = rabbitmqctl(&[
        "list_connections",
        "--no-table-headers",
        "pid",
        "client_properties",
    ])
    .await;
    let conn = listing
        .lines()
        .find(|line| line.contains(&format!("\"{name}\"")))
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or_else(|| panic!("no connection named {name} in:\n{listing}"))
        .to_string();
    let hold = hold_with(&warren, hold, Duration::from_secs(20)).await;
    let connected = logged(&warren, "connected");
    rabbitmqctl(&["close_connection", &conn, "test: the consumer's link lost"]).await;
    wait_until("the consumer reconnected", hold.left(), || async {
        logged(&warren, "connected") > connected
    })
    .await;
    let ids = env.publish_users(200).await;
    all.extend(ids.iter().copied());
    land_within(
        &env,
        &warren,
        hold,
        &ids.into_iter().collect(),
        "the consumer's connection closed",
        false,
    )
    .await;

    // The route is back: the held message goes to the DLQ, once; every row is there, once.
    env.channel
        .queue_bind(
            env.dlq_queue.as_str().into(),
            env.dlx_exchange.as_str().into(),
            env.dlq_queue.as_str().into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the DLQ again");
    wait_until(
        "the held message in the DLQ",
        Duration::from_secs(150),
        || async { env.ready(&env.dlq_queue).await >= 1 },
    )
    .await;
    assert_rows_exactly(&env, &all, Duration::from_secs(60), &|| warren.logs()).await;
    warren.terminate_ok(Duration::from_secs(30));
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    let ids: Vec<String> = dead.iter().map(message_id).collect();
    assert_eq!(ids, [HELD], "the held message once in the DLQ");
    assert_eq!(
        text_header(&dead[0].delivery.properties, "x-error-kind").as_deref(),
        Some("invalid_json")
    );
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}
