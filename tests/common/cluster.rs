//! The RabbitMQ test cluster (`scripts/cluster.sh`): its URLs (`cluster_urls`, from
//! `WARREN_TEST_CLUSTER_URLS`), `ClusterEnv`, a `TestEnv` whose warren talks to the cluster
//! (with publishing helpers on the cluster: `publish_to`, `publish_with`, `publish_ids`),
//! reading the cluster's queues (`cluster_queues`, `ClusterQueue`), and `QueueCleanup`, which
//! deletes queues a `TestEnv` does not know (retry tiers, observers) on drop, on any broker.

use std::collections::BTreeMap;

use lapin::options::{ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde_json::Value;

use super::broker::rabbitmqctl_rows;
use super::env::TestEnv;
use super::messages::{json_props, user_body};

const HOW_TO_START: &str = "start the test cluster with `sudo scripts/cluster.sh up` and export \
    WARREN_TEST_CLUSTER_URLS=\"$(scripts/cluster.sh urls)\" (scripts/test.sh does both)";

/// The cluster's AMQP URLs (`WARREN_TEST_CLUSTER_URLS`, comma-separated); fails, saying how to
/// start the cluster, when unset.
pub fn cluster_urls() -> Vec<String> {
    let raw = std::env::var("WARREN_TEST_CLUSTER_URLS").unwrap_or_default();
    let urls: Vec<String> = raw
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(String::from)
        .collect();
    assert!(
        !urls.is_empty(),
        "WARREN_TEST_CLUSTER_URLS is not set: {HOW_TO_START}"
    );
    urls
}

/// The node `rabbitmqctl -n` asks about the cluster (`WARREN_TEST_CLUSTER_NODE`, default
/// `warren-rc1@localhost`, the first node of `scripts/cluster.sh`).
pub fn cluster_node() -> String {
    std::env::var("WARREN_TEST_CLUSTER_NODE").unwrap_or_else(|_| "warren-rc1@localhost".into())
}

/// Connects to `url`, failing with how to start the cluster.
pub async fn connect_cluster(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach the test cluster at {}: {e}; {HOW_TO_START}",
                warren::config::redact_url(url)
            )
        })
}

/// A `TestEnv` (names, schema, Redis prefix, database) whose warren processes use the cluster
/// (`AMQP_URL` is its first node), with the test's own link to that node. On drop the env's
/// queues (every one of `extra_queues` too) and exchanges are deleted on the cluster.
pub struct ClusterEnv {
    pub env: TestEnv,
    /// The node warren and the test talk to.
    pub url: String,
    /// The test's link to `url`; `channel` is in confirm mode.
    pub conn: Connection,
    pub channel: Channel,
    /// Queues beyond the env's three (retry tiers), deleted with the env.
    pub extra_queues: Vec<String>,
}

impl ClusterEnv {
    pub async fn new(test: &str) -> Self {
        let url = cluster_urls().remove(0);
        let conn = connect_cluster(&url).await;
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let mut env = TestEnv::new(test).await;
        env.set("AMQP_URL", url.clone());
        ClusterEnv {
            env,
            url,
            conn,
            channel,
            extra_queues: Vec::new(),
        }
    }

    /// Publishes one message to `exchange` with `routing_key`, confirmed and routed.
    pub async fn publish_to(&self, exchange: &str, routing_key: &str, body: &[u8]) {
        self.publish_with(exchange, routing_key, body, BasicProperties::default())
            .await;
    }

    /// Publishes one valid user per id to the main exchange, confirmed, in order.
    pub async fn publish_ids(&self, ids: &[uuid::Uuid]) {
        for id in ids {
            self.publish_with(
                &self.env.main_exchange,
                &self.env.main_queue,
                &user_body(*id),
                json_props(*id),
            )
            .await;
        }
    }

    /// [`ClusterEnv::publish_to`] with `properties` (made persistent).
    pub async fn publish_with(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) {
        super::broker::publish_on(&self.channel, exchange, routing_key, body, properties).await;
    }

    /// Messages ready in `queue` on the cluster, which must exist.
    pub async fn ready(&self, queue: &str) -> u32 {
        warren::amqp::queue_stats(&self.conn, queue)
            .await
            .unwrap_or_else(|e| panic!("queue {queue}: {e}"))
            .0
    }

    /// Every queue of this env, as the cluster lists them.
    pub async fn queues(&self) -> BTreeMap<String, ClusterQueue> {
        cluster_queues(&self.env.id).await
    }
}

impl Drop for ClusterEnv {
    fn drop(&mut self) {
        let mut queues = vec![
            self.env.main_queue.clone(),
            self.env.retry_queue.clone(),
            self.env.dlq_queue.clone(),
        ];
        queues.extend(self.extra_queues.iter().cloned());
        let exchanges = vec![
            self.env.main_exchange.clone(),
            self.env.retry_exchange.clone(),
            self.env.dlx_exchange.clone(),
        ];
        delete_on(&self.url, queues, exchanges);
    }
}

/// Deletes `queues` on the broker at `url` when dropped, even when the test panics: for queues
/// the env's own cleanup does not know (retry tiers, observer queues).
pub struct QueueCleanup {
    pub url: String,
    pub queues: Vec<String>,
}

impl Drop for QueueCleanup {
    fn drop(&mut self) {
        delete_on(&self.url, std::mem::take(&mut self.queues), Vec::new());
    }
}

/// Deletes queues and exchanges at `url`, on a runtime of its own (drop may run while the
/// test's runtime unwinds); what is already gone is skipped.
pub fn delete_on(url: &str, queues: Vec<String>, exchanges: Vec<String>) {
    let url = url.to_string();
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            let Ok(conn) = Connection::connect(&url, ConnectionProperties::default()).await else {
                return;
            };
            for q in &queues {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            for e in &exchanges {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .exchange_delete(e.as_str().into(), Default::default())
                        .await;
                }
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    })
    .join();
}

/// One queue as the cluster lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterQueue {
    /// `classic` or `quorum`.
    pub queue_type: String,
    pub durable: bool,
    /// Argument name -> value.
    pub arguments: BTreeMap<String, Value>,
    /// The nodes holding a replica (quorum) or the queue (classic), sorted.
    pub members: Vec<String>,
}

/// The cluster's queues whose names start with `prefix`, from `rabbitmqctl -n NODE list_queues`.
pub async fn cluster_queues(prefix: &str) -> BTreeMap<String, ClusterQueue> {
    let node = cluster_node();
    rabbitmqctl_rows(&[
        "-n",
        &node,
        "list_queues",
        "name",
        "type",
        "durable",
        "arguments",
        "members",
        "pid",
    ])
    .await
    .into_iter()
    .filter(|q| q["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
    .map(|q| {
        let arguments = q["arguments"]
            .as_array()
            .expect("arguments")
            .iter()
            .map(|a| (a[0].as_str().unwrap().to_string(), a[2].clone()))
            .collect();
        // Quorum queues list their members; a classic queue lives where its process runs.
        let mut members: Vec<String> = match q["members"].as_array() {
            Some(m) if !m.is_empty() => m
                .iter()
                .filter_map(|n| n.as_str().map(String::from))
                .collect(),
            _ => q["pid"]
                .as_str()
                .and_then(|pid| pid.strip_prefix("<"))
                .and_then(|pid| pid.split('.').next())
                .map(|node| vec![node.to_string()])
                .unwrap_or_default(),
        };
        members.sort();
        (
            q["name"].as_str().unwrap().to_string(),
            ClusterQueue {
                queue_type: q["type"].as_str().unwrap_or("?").to_string(),
                durable: q["durable"].as_bool().unwrap_or(false),
                arguments,
                members,
            },
        )
    })
    .collect()
}
