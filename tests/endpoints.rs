//! Several endpoints: an `AMQP_URL` list whose first node is a closed port (warren passes over
//! it, and its log names the node it took); a 3-node cluster whose node in use is stopped (the
//! consumer moves on to the next node by itself and keeps consuming); a `DATABASE_URL` whose
//! first host is a closed port (the pool connects to the second).

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection, ConnectionProperties};
use serde_json::Value;
use uuid::Uuid;

/// `host:port` of an AMQP URL, as warren's logs name a node.
fn node_of(url: &str) -> String {
    let uri: lapin::uri::AMQPUri = url.parse().expect("AMQP URL");
    format!("{}:{}", uri.authority.host, uri.authority.port)
}

/// The nodes each link of a warren (JSON logs) connected to, in order: (link, node).
fn connections(warren: &Warren) -> Vec<(String, String)> {
    warren
        .logs()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|v| v["message"] == "connected to the broker")
        .map(|v| {
            (
                v["link"].as_str().unwrap_or_default().to_string(),
                v["node"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Waits until the link `link` of `warren` has connected to `node` `times` times in all.
async fn wait_connected(warren: &Warren, link: &str, node: &str, times: usize) {
    let what = format!("link {link} connected to {node} ({times} times)");
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let n = connections(warren)
            .iter()
            .filter(|(l, n)| l == link && n == node)
            .count();
        if n >= times {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}; connections so far {:?}; log:\n{}",
            connections(warren),
            warren.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_first_amqp_endpoint_is_passed_over_and_the_log_names_the_node() {
    let mut env = TestEnv::new("ep_amqp").await;
    let closed = free_port();
    let list = format!("amqp://guest:s3cret@127.0.0.1:{closed}/%2f,{}", amqp_url());
    env.set("AMQP_URL", list);
    env.set("LOG_FORMAT", "json");
    env.declare();
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let ids: HashSet<Uuid> = env.publish_users(300).await.into_iter().collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;

    let node = node_of(&amqp_url());
    wait_connected(&warren, "users/main", &node, 1).await;
    let logs = warren.logs();
    // The node passed over is named, its password never.
    assert!(
        logs.lines().any(|l| l.contains("connected to the broker")
            && l.contains(&format!("127.0.0.1:{closed}: "))),
        "{logs}"
    );
    assert!(!logs.contains("s3cret"), "{logs}");
    assert!(
        connections(&warren).iter().all(|(_, n)| *n == node),
        "no link connected to the closed port: {:?}",
        connections(&warren)
    );
    let info = metric(
        &env,
        "warren_amqp_node_info",
        &[("link", "users/main"), ("node", &node)],
    )
    .await;
    assert_eq!(info, 1.0);
    assert_eq!(
        metric(&env, "warren_connection_up", &[("target", "amqp")]).await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_first_database_host_is_passed_over() {
    let mut env = TestEnv::new("ep_db").await;
    let closed = free_port();
    // postgres://user:password@HOST/db -> postgres://user:password@127.0.0.1:CLOSED,HOST/db
    let url = database_url();
    let after_scheme = url.find("://").expect("a URL") + 3;
    let host_at = url[after_scheme..]
        .find('@')
        .map_or(after_scheme, |at| after_scheme + at + 1);
    let mut multi = format!("{}127.0.0.1:{closed},{}", &url[..host_at], &url[host_at..]);
    multi.push(if multi.contains('?') { '&' } else { '?' });
    multi.push_str("target_session_attrs=read-write");
    env.set("DATABASE_URL", multi.clone());

    // `warren config` shows it, password redacted.
    let (code, out, err) = env.run(&["config"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("@127.0.0.1:{closed},")) && out.contains(":***@"),
        "{out}"
    );
    env.declare(); // migrations through the second host
    let warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let ids: HashSet<Uuid> = env.publish_users(300).await.into_iter().collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;
    assert_eq!(
        metric(&env, "warren_connection_up", &[("target", "postgres")]).await,
        1.0
    );
}

// ---- the cluster ----------------------------------------------------------------------------

/// `scripts/cluster.sh ARG` (its lock makes concurrent calls take turns), which must succeed.
fn cluster_script(arg: &str) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh");
    let out = std::process::Command::new(script)
        .arg(arg)
        .output()
        .expect("run scripts/cluster.sh");
    assert!(
        out.status.success(),
        "scripts/cluster.sh {arg} failed (it needs root or sudo): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A confirm-mode channel on one cluster node; fails with how to start the cluster.
async fn cluster_channel(url: &str) -> (Connection, Channel) {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!("cannot reach the test cluster at {url}: {e}; start it with `sudo scripts/cluster.sh up`")
        });
    let channel = conn.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    (conn, channel)
}

/// Publishes `n` users to the env's main exchange through `channel`, confirmed and routed.
async fn publish_users_on(env: &TestEnv, channel: &Channel, n: usize) -> Vec<Uuid> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let mut confirms = Vec::new();
    for id in &ids {
        confirms.push(
            channel
                .basic_publish(
                    env.main_exchange.as_str().into(),
                    env.main_queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &user_body(*id),
                    json_props(*id),
                )
                .await
                .expect("publish"),
        );
    }
    for c in confirms {
        let c = c.await.expect("confirm");
        assert!(c.is_ack() && c.take_message().is_none(), "not routed");
    }
    ids
}

/// On drop, even after a failed assertion: starts again whatever node was stopped
/// (`scripts/cluster.sh up`), then deletes the env's queues and exchanges on the cluster.
struct ClusterCleanup {
    url: String,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Drop for ClusterCleanup {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh");
        let up = std::process::Command::new(script).arg("up").output();
        if !matches!(&up, Ok(o) if o.status.success()) {
            eprintln!("scripts/cluster.sh up failed: {up:?}");
        }
        common::cluster::delete_on(
            &self.url,
            std::mem::take(&mut self.queues),
            std::mem::take(&mut self.exchanges),
        );
    }
}

/// `rabbitmqctl -n NODE args...`, which must succeed.
async fn rabbitmqctl_on(node: &str, args: &[&str]) {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "-n", node])
        .args(args)
        .output()
        .await
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl -n {node} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs against the cluster of `scripts/cluster.sh` (it stops one of its nodes by name, so not
/// against a cluster of `WARREN_TEST_CLUSTER_URLS`), which it starts if needed. The node stopped
/// is rc3, not rc1: the other cluster tests talk to rc1, and their quorum queues keep a majority
/// without rc3.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_moves_on_to_the_next_cluster_node_when_its_node_stops() {
    cluster_script("up");
    let urls: Vec<String> = cluster_script("urls")
        .split(',')
        .map(String::from)
        .collect();
    assert_eq!(urls.len(), 3, "three cluster URLs: {urls:?}");
    let (rc1, rc2, rc3) = (&urls[0], &urls[1], &urls[2]);
    let mut env = TestEnv::new("ep_cluster").await;
    let _cleanup = ClusterCleanup {
        url: rc2.clone(),
        queues: vec![
            env.main_queue.clone(),
            env.retry_queue.clone(),
            env.dlq_queue.clone(),
        ],
        exchanges: vec![
            env.main_exchange.clone(),
            env.retry_exchange.clone(),
            env.dlx_exchange.clone(),
        ],
    };
    let (_conn, channel) = cluster_channel(rc2).await;
    // The (classic) queues live where they are declared: on rc2, so that stopping rc3 leaves
    // them available through the other nodes.
    let mut declare = env.command(&["declare"]);
    declare.env("AMQP_URL", rc2);
    let out = declare.output().expect("warren declare");
    assert!(out.status.success(), "{out:?}");

    env.set("AMQP_URL", format!("{rc3},{rc1},{rc2}"));
    env.set("LOG_FORMAT", "json");
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    // Without AMQP_SHUFFLE every link takes the first node of the list.
    let (first, next) = (node_of(rc3), node_of(rc1));
    wait_connected(&warren, "users/main", &first, 1).await;
    let mut ids: HashSet<Uuid> = publish_users_on(&env, &channel, 200)
        .await
        .into_iter()
        .collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| warren.logs()).await;

    // Stop RabbitMQ on rc3 (the Erlang node stays): its connections close, its port too.
    rabbitmqctl_on("warren-rc3@localhost", &["stop_app"]).await;
    // The consumer moves on to the node after the one it used, rc1, by itself: it starts there
    // (nothing passed over), not at the stopped rc3.
    wait_connected(&warren, "users/main", &next, 1).await;
    let moved_on = warren
        .logs()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|v| {
            v["message"] == "connected to the broker"
                && v["link"] == "users/main"
                && v["node"] == next.as_str()
        })
        .expect("the reconnect's log line");
    assert!(moved_on.get("passed_over").is_none(), "{moved_on}");
    ids.extend(publish_users_on(&env, &channel, 200).await);
    assert_rows_exactly(&env, &ids, Duration::from_secs(90), &|| warren.logs()).await;
    wait_scrape(
        &env,
        &warren,
        "the node gauge follows the link, and every link is up again",
        Duration::from_secs(30),
        |s| {
            s.one(
                "warren_amqp_node_info",
                &[("link", "users/main"), ("node", &next)],
            ) == Some(1.0)
                && s.one(
                    "warren_amqp_node_info",
                    &[("link", "users/main"), ("node", &first)],
                ) == Some(0.0)
                && s.one("warren_connection_up", &[("target", "amqp")]) == Some(1.0)
        },
    )
    .await;
    assert!(warren.terminate(Duration::from_secs(30)).success());
}
