//! The broker: publishing (`publish_raw`, `publish_to`, `publish_to_dlq`, `publish_pipelined`,
//! `publish_users`, `publish_ids`), reading queues and exchanges through AMQP (`queue_state`,
//! `try_queue_state`, `ready`, `queue_exists`, `exchange_exists`, `peek`, `drain_queue`,
//! `assert_queue_empty`) and through `rabbitmqctl` (`queue_counts`, `rabbitmqctl`,
//! `try_rabbitmqctl`, `rabbitmqctl_rows`).

use std::time::Duration;

use lapin::BasicProperties;
use lapin::message::BasicGetMessage;
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use serde_json::Value;
use uuid::Uuid;

use super::env::TestEnv;
use super::messages::{json_props, user_body};

impl TestEnv {
    /// Publishes one raw message to the main exchange, confirmed.
    pub async fn publish_raw(&self, body: &[u8], properties: BasicProperties) {
        self.publish_to(&self.main_exchange, &self.main_queue, body, properties)
            .await;
    }

    /// Publishes one message to `exchange` with `routing_key`, confirmed and routed.
    pub async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) {
        publish_on(&self.channel, exchange, routing_key, body, properties).await;
    }

    /// Publishes into the DLQ the way the main pipeline does: through the DLX with the DLQ's
    /// routing key (see [`dead_letter_props`] for the properties).
    pub async fn publish_to_dlq(&self, body: &[u8], properties: BasicProperties) {
        self.publish_to(&self.dlx_exchange, &self.dlq_queue, body, properties)
            .await;
    }

    /// Publishes `messages` (body, properties) to the main exchange in order, with pipelined
    /// confirms (at most 1,000 outstanding); every one is confirmed on return.
    pub async fn publish_pipelined(
        &self,
        messages: impl IntoIterator<Item = (Vec<u8>, BasicProperties)>,
    ) {
        self.publish_pipelined_to(&self.main_exchange, &self.main_queue, messages)
            .await;
    }

    /// As [`Self::publish_pipelined`], to `exchange` with `routing_key`.
    pub async fn publish_pipelined_to(
        &self,
        exchange: &str,
        routing_key: &str,
        messages: impl IntoIterator<Item = (Vec<u8>, BasicProperties)>,
    ) {
        let mut pending = Vec::with_capacity(1000);
        for (body, properties) in messages {
            let confirm = self
                .channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    properties,
                )
                .await
                .expect("publish");
            pending.push(confirm);
            if pending.len() == 1000 {
                for c in pending.drain(..) {
                    assert!(c.await.expect("confirm").is_ack());
                }
            }
        }
        for c in pending.drain(..) {
            assert!(c.await.expect("confirm").is_ack());
        }
    }

    /// Publishes `n` valid users (pipelined confirms) and returns their ids.
    pub async fn publish_users(&self, n: usize) -> Vec<Uuid> {
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
        self.publish_pipelined(ids.iter().map(|id| (user_body(*id), json_props(*id))))
            .await;
        ids
    }

    /// Publishes one valid user per id, confirmed, in order.
    pub async fn publish_ids(&self, ids: &[Uuid]) {
        for id in ids {
            self.publish_raw(&user_body(*id), json_props(*id)).await;
        }
    }

    /// (messages ready, consumers) of `queue`, by passive declare on a channel of its own; the
    /// broker's refusal if the queue does not exist.
    pub async fn try_queue_state(
        &self,
        queue: &str,
    ) -> Result<(u32, u32), warren::amqp::AmqpError> {
        warren::amqp::queue_stats(&self.conn, queue).await
    }

    /// Takes the next message of the env's DLQ (`basic.get`, acked), which must be there.
    pub async fn take_dead_letter(&self) -> lapin::message::BasicGetMessage {
        self.channel
            .basic_get(
                self.dlq_queue.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .expect("basic.get")
            .expect("the dead letter")
    }

    /// (messages ready, consumers) of `queue`, which must exist.
    pub async fn queue_state(&self, queue: &str) -> (u32, u32) {
        self.try_queue_state(queue)
            .await
            .unwrap_or_else(|e| panic!("queue {queue}: {e}"))
    }

    /// Messages ready in `queue`, which must exist.
    pub async fn ready(&self, queue: &str) -> u32 {
        self.queue_state(queue).await.0
    }

    /// Whether `queue` exists (the broker answers 404 NOT_FOUND when not); panics when the
    /// broker cannot be asked (an error is never "absent").
    pub async fn queue_exists(&self, queue: &str) -> bool {
        match self.try_queue_state(queue).await {
            Ok(_) => true,
            Err(warren::amqp::AmqpError::NotFound(_)) => false,
            Err(e) => panic!("queue {queue}: {e}"),
        }
    }

    /// Whether `exchange` exists; panics when the broker cannot be asked (an error is never
    /// "absent").
    pub async fn exchange_exists(&self, exchange: &str) -> bool {
        warren::amqp::exchange_exists(&self.conn, exchange)
            .await
            .unwrap_or_else(|e| panic!("exchange {exchange}: {e}"))
    }

    /// Reads up to `max` messages of `queue` without taking them: they are returned unacked and
    /// go back to their place (with their original TTL) when the peeking channel closes.
    pub async fn peek(&self, queue: &str, max: usize) -> Vec<BasicGetMessage> {
        self.get_up_to(queue, max, false).await
    }

    /// Takes up to `max` messages from `queue` (acked), for inspection.
    pub async fn drain_queue(&self, queue: &str, max: usize) -> Vec<BasicGetMessage> {
        self.get_up_to(queue, max, true).await
    }

    /// `basic.get` on a channel of its own until `max` messages or the queue is empty; the
    /// channel is closed afterwards (which requeues what was not acked).
    async fn get_up_to(&self, queue: &str, max: usize, no_ack: bool) -> Vec<BasicGetMessage> {
        let ch = self.conn.create_channel().await.expect("channel");
        let mut out = Vec::new();
        while out.len() < max {
            match ch
                .basic_get(queue.into(), BasicGetOptions { no_ack })
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
}

/// Asserts that `queue` holds no ready message.
pub async fn assert_queue_empty(env: &TestEnv, queue: &str) {
    let (messages, _) = env.queue_state(queue).await;
    assert_eq!(messages, 0, "queue {queue} still holds {messages} messages");
}

// ---- RabbitMQ CLI ---------------------------------------------------------------------------

/// (ready, unacknowledged) messages of `queue`, from `rabbitmqctl list_queues`.
pub async fn queue_counts(queue: &str) -> (u64, u64) {
    queue_counts_on(None, queue).await
}

/// The same, asked of the node `node` (`rabbitmqctl -n`; `None`: the default node).
pub async fn queue_counts_on(node: Option<&str>, queue: &str) -> (u64, u64) {
    let mut args = Vec::new();
    if let Some(node) = node {
        args.extend(["-n", node]);
    }
    args.extend([
        "list_queues",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ]);
    let rows = rabbitmqctl_rows(&args).await;
    let row = rows
        .iter()
        .find(|row| row["name"].as_str() == Some(queue))
        .unwrap_or_else(|| {
            panic!(
                "queue {queue} is not listed by {}",
                node.unwrap_or("the default node")
            )
        });
    (
        row["messages_ready"].as_u64().unwrap_or(u64::MAX),
        row["messages_unacknowledged"].as_u64().unwrap_or(u64::MAX),
    )
}

/// Runs `rabbitmqctl -q args...`: (success, stdout, plus stderr on failure).
pub async fn try_rabbitmqctl(args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .output()
        .await
        .expect("run rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        (true, text)
    } else {
        (
            false,
            format!("{text}{}", String::from_utf8_lossy(&out.stderr)),
        )
    }
}

/// Runs `rabbitmqctl -q args...`, which must succeed; returns its stdout.
pub async fn rabbitmqctl(args: &[&str]) -> String {
    let (ok, text) = try_rabbitmqctl(args).await;
    assert!(ok, "rabbitmqctl {args:?} failed: {text}");
    text
}

/// A read-only `rabbitmqctl list_* args...` with the JSON formatter, one object per row (anything
/// printed before the JSON array is skipped). Tried up to three times: the CLI itself can time
/// out on a busy node.
pub async fn rabbitmqctl_rows(args: &[&str]) -> Vec<Value> {
    let mut full = args.to_vec();
    full.extend(["--formatter", "json"]);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let (ok, text) = try_rabbitmqctl(&full).await;
        if ok
            && let Some(rows) = text
                .find('[')
                .and_then(|start| serde_json::from_str(&text[start..]).ok())
        {
            return rows;
        }
        assert!(attempts < 3, "rabbitmqctl {args:?} failed: {text}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Publishes one message on `channel` (in confirm mode) to `exchange` with `routing_key`,
/// persistent, and asserts it was confirmed and routed.
pub async fn publish_on(
    channel: &lapin::Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) {
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            properties.with_delivery_mode(2),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack(), "publish not confirmed");
    assert!(
        confirm.take_message().is_none(),
        "message to {exchange}/{routing_key} was unroutable"
    );
}

/// A RabbitMQ user of the test's own (created with `rabbitmqctl`, all permissions on `/`),
/// deleted on drop: messages it publishes carry its name as `user_id`, which the broker checks
/// against the publishing connection.
pub struct BrokerUser {
    pub name: String,
    password: String,
}

impl BrokerUser {
    pub async fn create(test_id: &str) -> Self {
        let name = format!("{test_id}_user");
        let password = uuid::Uuid::new_v4().simple().to_string();
        rabbitmqctl(&["add_user", &name, &password]).await;
        rabbitmqctl(&["set_permissions", "-p", "/", &name, ".*", ".*", ".*"]).await;
        Self { name, password }
    }

    /// The broker's URL with this user's credentials.
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&super::env::amqp_url()).expect("AMQP URL");
        let _ = url.set_username(&self.name);
        let _ = url.set_password(Some(&self.password));
        url.to_string()
    }

    /// Publishes one message as this user, with `user_id` = its name, confirmed and routed, to
    /// the env's main exchange.
    pub async fn publish(&self, env: &TestEnv, body: &[u8], properties: BasicProperties) {
        let conn = lapin::Connection::connect(&self.url(), Default::default())
            .await
            .expect("connect as the test user");
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(Default::default())
            .await
            .expect("confirm mode");
        publish_on(
            &channel,
            &env.main_exchange,
            &env.main_queue,
            body,
            properties.with_user_id(self.name.as_str().into()),
        )
        .await;
        let _ = conn.close(200, "bye".into()).await;
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.name])
            .output();
    }
}
