//! The one shared test harness: server URLs from the environment with localhost defaults, unique
//! names per test (queues, exchanges, database schema), starting and stopping the `warren`
//! binary, publishing test messages, reading rows and queue depths, `wait_until`, and cleanup
//! that runs even when a test panics.
#![allow(dead_code)]

use std::collections::HashSet;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio_postgres::NoTls;
use uuid::Uuid;

pub const BIN: &str = env!("CARGO_BIN_EXE_warren");

/// The broker the tests use (`WARREN_TEST_AMQP_URL`).
pub fn amqp_url() -> String {
    std::env::var("WARREN_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The database the tests use (`WARREN_TEST_DATABASE_URL`).
pub fn database_url() -> String {
    std::env::var("WARREN_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://warren:warren@127.0.0.1:5432/warren".into())
}

/// The Redis the tests use (`WARREN_TEST_REDIS_URL`).
pub fn redis_url() -> String {
    std::env::var("WARREN_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

const HOW_TO_START: &str = "start the local services with `scripts/setup.sh` \
    (or: rabbitmq-server -detached; pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start; \
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save \"\" --appendonly no)";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// One test's private world: its own exchanges, queues and schema, removed on drop.
pub struct TestEnv {
    /// Unique prefix of every name this test creates.
    pub id: String,
    pub schema: String,
    pub main_exchange: String,
    pub main_queue: String,
    pub retry_exchange: String,
    pub retry_queue: String,
    pub dlx_exchange: String,
    pub dlq_queue: String,
    pub http_port: u16,
    pub metrics_port: u16,
    /// Settings passed to every warren this env starts (environment variables).
    pub vars: Vec<(String, String)>,
    pub conn: Connection,
    pub channel: Channel,
    pub db: tokio_postgres::Client,
}

impl TestEnv {
    /// Connects to the real services (failing with how to start them) and picks unique names.
    pub async fn new(test: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let short = &Uuid::new_v4().simple().to_string()[..8];
        let id = format!("t_{}_{}_{}", test, n, short).to_ascii_lowercase();
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot reach RabbitMQ at {}: {e}; {HOW_TO_START}",
                    amqp_url()
                )
            });
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let (db, connection) = tokio_postgres::connect(&database_url(), NoTls)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot reach PostgreSQL at {}: {e}; {HOW_TO_START}",
                    database_url()
                )
            });
        tokio::spawn(connection);
        let schema = id.clone();
        db.batch_execute(&format!(
            "CREATE SCHEMA {schema}; SET search_path TO {schema}"
        ))
        .await
        .expect("create schema");
        let http_port = free_port();
        let metrics_port = free_port();
        let mut env = TestEnv {
            main_exchange: format!("{id}_exchange"),
            main_queue: format!("{id}_queue"),
            retry_exchange: format!("{id}_retry_exchange"),
            retry_queue: format!("{id}_retry"),
            dlx_exchange: format!("{id}_dlx"),
            dlq_queue: format!("{id}_dlq"),
            schema,
            id,
            http_port,
            metrics_port,
            vars: Vec::new(),
            conn,
            channel,
            db,
        };
        env.vars = vec![
            ("AMQP_URL".into(), amqp_url()),
            ("DATABASE_URL".into(), database_url()),
            ("REDIS_URL".into(), redis_url()),
            ("REDIS_PREFIX".into(), env.id.clone()),
            ("DATABASE_SCHEMA".into(), env.schema.clone()),
            ("MAIN_EXCHANGE".into(), env.main_exchange.clone()),
            ("MAIN_QUEUE".into(), env.main_queue.clone()),
            ("RETRY_EXCHANGE".into(), env.retry_exchange.clone()),
            ("RETRY_QUEUE".into(), env.retry_queue.clone()),
            ("DLX_EXCHANGE".into(), env.dlx_exchange.clone()),
            ("DLQ_QUEUE".into(), env.dlq_queue.clone()),
            ("HTTP_ADDR".into(), format!("127.0.0.1:{http_port}")),
            ("METRICS_ADDR".into(), format!("127.0.0.1:{metrics_port}")),
            ("USERS_BATCH_TIMEOUT_MS".into(), "100".into()),
            ("SHUTDOWN_TIMEOUT_MS".into(), "20000".into()),
            ("RUST_LOG".into(), "info,lapin=off".into()),
        ];
        env
    }

    /// Sets (or replaces) one setting for the warren processes this env starts.
    pub fn set(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.vars.retain(|(k, _)| k != key);
        self.vars.push((key.to_string(), value.into()));
        self
    }

    /// A `warren` command with this env's settings and nothing inherited that could leak in.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args);
        for key in [
            "AMQP_URL",
            "DATABASE_URL",
            "PREFETCH",
            "ROLES",
            "USERS_BATCH_SIZE",
            "MAX_RETRIES",
            "RETRY_TTL_MS",
            "LOG_FORMAT",
            "WARREN_CONFIG",
        ] {
            cmd.env_remove(key);
        }
        cmd.envs(self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd
    }

    /// Runs a `warren` subcommand to completion: (exit code, stdout, stderr).
    pub fn run(&self, args: &[&str]) -> (i32, String, String) {
        let out = self.command(args).output().expect("run warren");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `warren declare`, which must succeed.
    pub fn declare(&self) {
        let (code, out, err) = self.run(&["declare"]);
        assert_eq!(code, 0, "warren declare failed:\n{out}\n{err}");
    }

    /// Starts `warren run` with `args` (for example `--roles consumer`).
    pub fn start(&self, args: &[&str]) -> Warren {
        let mut full = vec!["run"];
        full.extend_from_slice(args);
        let log = std::env::temp_dir().join(format!(
            "{}-{}.log",
            self.id,
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::File::create(&log).expect("log file");
        let child = self
            .command(&full)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start warren");
        Warren {
            child: Some(child),
            log,
        }
    }

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
        let confirm = self
            .channel
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

    /// Publishes `n` valid users (pipelined confirms) and returns their ids.
    pub async fn publish_users(&self, n: usize) -> Vec<Uuid> {
        let mut ids = Vec::with_capacity(n);
        let mut pending = Vec::with_capacity(1000);
        for _ in 0..n {
            let id = Uuid::new_v4();
            ids.push(id);
            let confirm = self
                .channel
                .basic_publish(
                    self.main_exchange.as_str().into(),
                    self.main_queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &user_body(id),
                    json_props(id),
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
        ids
    }

    /// Rows in this test's `users` table.
    pub async fn count_rows(&self) -> i64 {
        self.db
            .query_one("SELECT count(*) FROM users", &[])
            .await
            .map(|r| r.get(0))
            .unwrap_or(0)
    }

    /// Every id in `users`.
    pub async fn row_ids(&self) -> HashSet<Uuid> {
        self.db
            .query("SELECT id FROM users", &[])
            .await
            .expect("select ids")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// (messages ready, consumers) of `queue`, by passive declare.
    pub async fn queue_state(&self, queue: &str) -> (u32, u32) {
        let ch = self.conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("queue {queue}: {e}"));
        let _ = ch.close(200, "ok".into()).await;
        (q.message_count(), q.consumer_count())
    }

    /// Takes up to `max` messages from `queue` (acked), for inspection.
    pub async fn drain_queue(
        &self,
        queue: &str,
        max: usize,
    ) -> Vec<lapin::message::BasicGetMessage> {
        let ch = self.conn.create_channel().await.expect("channel");
        let mut out = Vec::new();
        while out.len() < max {
            match ch
                .basic_get(
                    queue.into(),
                    lapin::options::BasicGetOptions { no_ack: true },
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

    /// The warren process's HTTP base URL.
    pub fn http_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let names = (
            [
                self.main_queue.clone(),
                self.retry_queue.clone(),
                self.dlq_queue.clone(),
            ],
            [
                self.main_exchange.clone(),
                self.retry_exchange.clone(),
                self.dlx_exchange.clone(),
            ],
        );
        let schema = self.schema.clone();
        // Cleanup needs its own runtime: Drop may run while the test's runtime is unwinding.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(conn) =
                    Connection::connect(&amqp_url(), ConnectionProperties::default()).await
                {
                    for q in &names.0 {
                        if let Ok(ch) = conn.create_channel().await {
                            let _ = ch
                                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                                .await;
                        }
                    }
                    for e in &names.1 {
                        if let Ok(ch) = conn.create_channel().await {
                            let _ = ch
                                .exchange_delete(
                                    e.as_str().into(),
                                    ExchangeDeleteOptions::default(),
                                )
                                .await;
                        }
                    }
                    let _ = conn.close(200, "bye".into()).await;
                }
                if let Ok((db, c)) = tokio_postgres::connect(&database_url(), NoTls).await {
                    tokio::spawn(c);
                    let _ = db
                        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// A running `warren run`; killed on drop if still running.
pub struct Warren {
    child: Option<Child>,
    /// Its stderr (logs), for failure messages.
    pub log: std::path::PathBuf,
}

impl Warren {
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status();
    }

    /// Sends SIGTERM and waits for the exit, at most `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal("TERM");
        self.wait(timeout)
    }

    /// Waits for the process to exit; panics with its log after `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "warren did not exit within {timeout:?}; log:\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, no cleanup.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Warren {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A valid user body.
pub fn user_body(id: Uuid) -> Vec<u8> {
    format!(r#"{{"id":"{id}","name":"user {id}","email":"{id}@example.com"}}"#).into_bytes()
}

/// Properties as warren's publisher sets them.
pub fn json_props(id: Uuid) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.to_string().into())
}

/// Properties with one header set.
pub fn with_header(props: BasicProperties, key: &str, value: AMQPValue) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(key.into(), value);
    props.with_headers(headers)
}

pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Waits until `condition` holds, polling; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts that `queue` holds no ready message.
pub async fn assert_queue_empty(env: &TestEnv, queue: &str) {
    let (messages, _) = env.queue_state(queue).await;
    assert_eq!(messages, 0, "queue {queue} still holds {messages} messages");
}
