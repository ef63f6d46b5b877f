//! The one shared test harness. Every test binary uses a part of it (hence `dead_code` allowed).
//!
//! - **Services**: the server URLs from the environment with localhost defaults (`amqp_url`,
//!   `database_url`, `redis_url`), `free_port`, and `host` (the host name as warren records it).
//! - **`TestEnv`**: one test's private world (unique queues, exchanges, database schema, Redis
//!   prefix), removed on drop even when the test panics. It runs `warren` (`command`, `run`,
//!   `run_async`, `declare`, `start`), publishes (`publish_raw`, `publish_to`,
//!   `publish_to_dlq`, `publish_pipelined`, `publish_users`, `publish_ids`) and reads rows and
//!   queues (`count_rows`, `row_ids`, `queue_state`, `try_queue_state`, `ready`,
//!   `queue_exists`, `exchange_exists`, `peek`, `drain_queue`).
//! - **`Warren`**: a running `warren run` (signals, `terminate`, `terminate_ok`, `wait`, `kill9`,
//!   `logs`), and `LogsOnPanic` to show logs of failed tests.
//! - **Messages**: bodies and properties (`user_body`, `json_props`, `with_header`,
//!   `long_string`, `dead_letter_props`) and reading them back (`header`, `as_int`, `int_header`,
//!   `strict_int_header`, `text_header`, `message_id`, `message_uuid`).
//! - **Waiting and assertions**: `wait_until`, `assert_queue_empty`, `assert_rows_exactly`.
//! - **PostgreSQL**: fault injection through triggers (`install_fault` with `CountAttempts`,
//!   `clear_fault`, `track_attempts`, `attempts`) and `InsertLock`, which holds warren's batch
//!   inserts.
//! - **Metrics**: the `/metrics` scrape (`scrape_text`, `Scrape`, `wait_scrape`) and single
//!   values (`metric`, `try_metric`).
//! - **HTTP**: `http_agent` and `http`, one request to the env's API.
//! - **Redis**: `RedisCleanup`, `try_redis_query`, `redis_query`, and the instance registry
//!   (`instance_key`, `instance`, `shutdowns`).
//! - **RabbitMQ CLI**: `try_rabbitmqctl`, `rabbitmqctl`, `rabbitmqctl_rows`.
#![allow(dead_code)]

pub mod ops;
pub mod raw_amqp;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_postgres::NoTls;
use uuid::Uuid;

pub const BIN: &str = env!("CARGO_BIN_EXE_warren");

// ---- services -------------------------------------------------------------------------------

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

/// The host name as warren records it (registry keys, `ctl` output).
pub fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

// ---- TestEnv --------------------------------------------------------------------------------

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

    // -- settings and running warren --

    /// Sets (or replaces) one setting for the warren processes this env starts.
    pub fn set(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.vars.retain(|(k, _)| k != key);
        self.vars.push((key.to_string(), value.into()));
        self
    }

    /// The current value of one setting (see [`TestEnv::set`]).
    pub fn setting(&self, key: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
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
        outcome(self.command(args).output().expect("run warren"))
    }

    /// [`TestEnv::run`] off the async threads, for commands that take a while (`ctl`,
    /// `status`): (exit code, stdout, stderr).
    pub async fn run_async(&self, args: &[&str]) -> (i32, String, String) {
        let mut cmd = self.command(args);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .expect("join")
            .expect("run warren");
        outcome(out)
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

    /// The warren process's HTTP base URL.
    pub fn http_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    // -- publishing --

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
        let mut pending = Vec::with_capacity(1000);
        for (body, properties) in messages {
            let confirm = self
                .channel
                .basic_publish(
                    self.main_exchange.as_str().into(),
                    self.main_queue.as_str().into(),
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

    // -- reading rows --

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

    // -- reading queues and exchanges --

    /// (messages ready, consumers) of `queue`, by passive declare on a channel of its own; the
    /// broker's refusal if the queue does not exist.
    pub async fn try_queue_state(
        &self,
        queue: &str,
    ) -> Result<(u32, u32), warren::amqp::AmqpError> {
        warren::amqp::queue_stats(&self.conn, queue).await
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

    /// Whether `queue` exists.
    pub async fn queue_exists(&self, queue: &str) -> bool {
        self.try_queue_state(queue).await.is_ok()
    }

    /// Whether `exchange` exists.
    pub async fn exchange_exists(&self, exchange: &str) -> bool {
        warren::amqp::exchange_exists(&self.conn, exchange)
            .await
            .unwrap_or(false)
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

/// (exit code, stdout, stderr) of a finished command.
fn outcome(out: Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
        let redis_prefix = self.id.clone();
        let redis_at = self
            .vars
            .iter()
            .find(|(k, _)| k == "REDIS_URL")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(redis_url);
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
                // Every Redis key under the env's prefix (registry, commands, history, shutdowns).
                let redis = async {
                    let client = redis::Client::open(redis_at.as_str()).ok()?;
                    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                    let keys: Vec<String> = redis::cmd("KEYS")
                        .arg(format!("{redis_prefix}:*"))
                        .query_async(&mut conn)
                        .await
                        .ok()?;
                    if !keys.is_empty() {
                        let _: Option<()> = redis::cmd("DEL")
                            .arg(&keys)
                            .query_async(&mut conn)
                            .await
                            .ok();
                    }
                    Some(())
                };
                let _ = tokio::time::timeout(Duration::from_secs(3), redis).await;
            });
        })
        .join();
    }
}

// ---- TCP proxy: cut one warren's link to a server --------------------------------------------

/// A TCP proxy in front of a server (PostgreSQL, RabbitMQ) that one test's warren connects
/// through, so the test can cut and restore that warren's link alone, and knows which upstream
/// connections are its own.
pub struct TcpProxy {
    port: u16,
    /// The server's URL, to rewrite for the proxy.
    upstream_url: url::Url,
    state: Arc<ProxyState>,
    accept: tokio::task::JoinHandle<()>,
}

/// What the accept loop and the connection tasks share with the test.
pub struct ProxyState {
    /// Where the server listens.
    upstream: String,
    /// While false, new connections are reset as soon as they are accepted.
    up: AtomicBool,
    /// Bumped by `cut`: every live connection ends when it changes.
    cuts: watch::Sender<u64>,
    /// While true, nothing passes in either direction, but every socket stays open: a
    /// half-open link, as a network partition leaves it.
    frozen: watch::Sender<bool>,
    /// Local ports of the live upstream connections: PostgreSQL's `client_port` for them.
    upstream_ports: Mutex<HashSet<u16>>,
}

impl TcpProxy {
    /// Starts a proxy to the server of `server_url` (`default_port` when the URL has none).
    pub async fn start(server_url: &str, default_port: u16) -> Self {
        let upstream_url = url::Url::parse(server_url).expect("server URL");
        let upstream = format!(
            "{}:{}",
            upstream_url.host_str().unwrap_or("127.0.0.1"),
            upstream_url.port().unwrap_or(default_port)
        );
        let listener = TcpListener::bind(("127.0.0.1", free_port()))
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(ProxyState {
            upstream,
            up: AtomicBool::new(true),
            cuts: watch::Sender::new(0),
            frozen: watch::Sender::new(false),
            upstream_ports: Mutex::new(HashSet::new()),
        });
        let accept = tokio::spawn({
            let state = state.clone();
            async move {
                loop {
                    if let Ok((client, _)) = listener.accept().await {
                        tokio::spawn(state.clone().serve(client));
                    }
                }
            }
        });
        TcpProxy {
            port,
            upstream_url,
            state,
            accept,
        }
    }

    /// The server's URL, through the proxy.
    pub fn url(&self) -> String {
        let mut url = self.upstream_url.clone();
        url.set_host(Some("127.0.0.1")).expect("host");
        url.set_port(Some(self.port)).expect("port");
        url.to_string()
    }

    /// The server goes away: live connections are reset, new ones are reset on accept.
    pub fn cut(&self) {
        self.state.up.store(false, Ordering::SeqCst);
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// The server is back for new connections.
    pub fn restore(&self) {
        self.state.up.store(true, Ordering::SeqCst);
    }

    /// The link goes silent without closing: live and new connections stay open, but no byte
    /// passes either way (a half-open connection; only timeouts can notice it).
    pub fn freeze(&self) {
        self.state.frozen.send_replace(true);
    }

    /// Ends a freeze: the frozen connections are reset, new ones pass again.
    pub fn thaw(&self) {
        self.state.frozen.send_replace(false);
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// Local ports of the live upstream connections (PostgreSQL's `client_port` for them).
    pub fn backend_client_ports(&self) -> Vec<i32> {
        let ports = self.state.upstream_ports.lock().unwrap();
        ports.iter().map(|p| i32::from(*p)).collect()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

impl ProxyState {
    async fn serve(self: Arc<Self>, mut client: TcpStream) {
        // Subscribe before looking at `up`, so a cut in between is not missed.
        let mut cuts = self.cuts.subscribe();
        let mut frozen = self.frozen.subscribe();
        if !self.up.load(Ordering::SeqCst) {
            let _ = client.set_zero_linger();
            return;
        }
        let frozen_now = *frozen.borrow_and_update();
        if frozen_now {
            // Accepted, never answered, until the freeze ends.
            let _ = cuts.changed().await;
            let _ = client.set_zero_linger();
            return;
        }
        let Ok(mut upstream) = TcpStream::connect(&self.upstream).await else {
            let _ = client.set_zero_linger();
            return;
        };
        let port = upstream.local_addr().map(|a| a.port()).unwrap_or(0);
        self.upstream_ports.lock().unwrap().insert(port);
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
            _ = cuts.changed() => {
                let _ = client.set_zero_linger();
                let _ = upstream.set_zero_linger();
            }
            _ = async { frozen.wait_for(|f| *f).await.is_ok() } => {
                // Silent from now on; both sockets stay open until the freeze ends.
                let _ = cuts.changed().await;
                let _ = client.set_zero_linger();
                let _ = upstream.set_zero_linger();
            }
        }
        self.upstream_ports.lock().unwrap().remove(&port);
    }
}

/// A superuser connection, for `pg_terminate_backend` (`WARREN_TEST_PG_SUPERUSER_URL`).
pub fn superuser_url() -> String {
    std::env::var("WARREN_TEST_PG_SUPERUSER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Terminates, as superuser, the backends whose client port is in `ports`; returns how many.
pub async fn terminate_backends(ports: &[i32]) -> usize {
    let (db, connection) = tokio_postgres::connect(&superuser_url(), NoTls)
        .await
        .unwrap_or_else(|e| panic!("superuser connection to {}: {e}", superuser_url()));
    tokio::spawn(connection);
    db.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE client_port = ANY($1) AND application_name LIKE 'warren%' AND pid <> pg_backend_pid()",
        &[&ports],
    )
    .await
    .expect("pg_terminate_backend")
    .iter()
    .filter(|row| row.get::<_, bool>(0))
    .count()
}

// ---- Warren ---------------------------------------------------------------------------------

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

    /// Sends SIGTERM and asserts a clean stop (exit code 0) within `timeout`, showing the log
    /// otherwise.
    pub fn terminate_ok(&mut self, timeout: Duration) {
        let status = self.terminate(timeout);
        assert_eq!(status.code(), Some(0), "log:\n{}", self.logs());
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

/// Prints the logs of warren processes (`Warren::log`) when the test fails: their files go with
/// the processes. Hold it for the test's length: `let _logs = LogsOnPanic(vec![w.log.clone()]);`
pub struct LogsOnPanic(pub Vec<std::path::PathBuf>);

impl Drop for LogsOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in &self.0 {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                eprintln!("---- warren log {}:\n{text}", log.display());
            }
        }
    }
}

// ---- messages -------------------------------------------------------------------------------

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

/// Properties of a message the main pipeline dead-lettered: JSON, `message_id`, and the
/// `x-retries`, `x-error-kind` and `x-error-reason` headers warren's router writes.
pub fn dead_letter_props(
    message_id: &str,
    kind: &str,
    retries: i64,
    reason: &str,
) -> BasicProperties {
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id(message_id.into());
    let props = with_header(props, "x-retries", AMQPValue::LongLongInt(retries));
    let props = with_header(props, "x-error-kind", long_string(kind));
    with_header(props, "x-error-reason", long_string(reason))
}

/// One header, as sent.
pub fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(key)
}

/// The value of an AMQP integer of any type; `None` for anything else.
pub fn as_int(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(v) => Some(*v as i64),
        AMQPValue::ShortShortUInt(v) => Some(*v as i64),
        AMQPValue::ShortInt(v) => Some(*v as i64),
        AMQPValue::ShortUInt(v) => Some(*v as i64),
        AMQPValue::LongInt(v) => Some(*v as i64),
        AMQPValue::LongUInt(v) => Some(*v as i64),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// An integer header of any AMQP integer type; `None` if missing or not an integer.
pub fn int_header(props: &BasicProperties, key: &str) -> Option<i64> {
    header(props, key).and_then(as_int)
}

/// An integer header of any AMQP integer type; `None` if missing, and a failed test if it is
/// there but not an integer.
pub fn strict_int_header(props: &BasicProperties, key: &str) -> Option<i64> {
    header(props, key)
        .map(|v| as_int(v).unwrap_or_else(|| panic!("{key} is not an integer: {v:?}")))
}

/// A string header (long or short string); `None` if missing or of another type.
pub fn text_header(props: &BasicProperties, key: &str) -> Option<String> {
    match header(props, key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// The `message_id` of a fetched message; empty when it has none.
pub fn message_id(m: &BasicGetMessage) -> String {
    m.delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_string())
        .unwrap_or_default()
}

/// The `message_id` of a fetched message as a UUID; a failed test when it is missing or is not
/// a UUID.
pub fn message_uuid(m: &BasicGetMessage) -> Uuid {
    let id = m
        .delivery
        .properties
        .message_id()
        .as_ref()
        .expect("message_id kept");
    id.as_str()
        .parse()
        .unwrap_or_else(|e| panic!("message_id {id} is not a UUID: {e}"))
}

// ---- waiting and assertions -----------------------------------------------------------------

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

/// Waits (at most `timeout`) until `users` holds as many rows as `expected` has ids, then
/// asserts that it holds exactly those: no more rows, and the same ids. `logs` (warren's) are
/// shown when the count is off.
pub async fn assert_rows_exactly(
    env: &TestEnv,
    expected: &HashSet<Uuid>,
    timeout: Duration,
    logs: &dyn Fn() -> String,
) {
    let n = expected.len() as i64;
    wait_until(&format!("{n} rows"), timeout, || async {
        env.count_rows().await >= n
    })
    .await;
    assert_eq!(env.count_rows().await, n, "log:\n{}", logs());
    assert!(env.row_ids().await == *expected, "the ids differ");
}

// ---- PostgreSQL: fault injection and a lock on inserts --------------------------------------
//
// The fault is a trigger installed in the test schema after `declare`: an AFTER INSERT statement
// trigger on `users` raises `serialization_failure` (SQLSTATE 40001, a transient error) while
// `fault_flag.active` is set, so every insert of a batch fails; the statement trigger also fires
// for the breaker's probe (an insert of zero rows). Optionally a BEFORE INSERT row trigger counts
// every insert attempt per id, in a sequence of its own (`attempts_<id>`): `nextval` is not
// rolled back, so the count survives the failed statement, and every row of a batch is counted
// before the statement fails. Only ids given to `track_attempts` are counted.

/// Whether [`install_fault`] also counts the insert attempts of tracked ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountAttempts {
    /// With the counting trigger: read the counts with [`attempts`].
    Yes,
    /// The failing trigger only.
    No,
}

/// Installs the failing trigger (and the counting one with [`CountAttempts::Yes`]) in the env's
/// schema; the fault starts active.
pub async fn install_fault(env: &TestEnv, count: CountAttempts) {
    let s = &env.schema;
    let counting = match count {
        CountAttempts::Yes => format!(
            r#"
            CREATE FUNCTION {s}.count_attempt() RETURNS trigger LANGUAGE plpgsql AS $f$
            DECLARE
                counter regclass := to_regclass(format('%I.%I', TG_TABLE_SCHEMA,
                    'attempts_' || replace(NEW.id::text, '-', '')));
            BEGIN
                IF counter IS NOT NULL THEN
                    PERFORM nextval(counter);
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER users_count_attempts BEFORE INSERT ON {s}.users
                FOR EACH ROW EXECUTE FUNCTION {s}.count_attempt();
            "#
        ),
        CountAttempts::No => String::new(),
    };
    env.db
        .batch_execute(&format!(
            r#"
            CREATE TABLE {s}.fault_flag (active boolean NOT NULL, sqlstate text NOT NULL DEFAULT '40001');
            INSERT INTO {s}.fault_flag VALUES (true);
            {counting}
            CREATE FUNCTION {s}.fail_while_flagged() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF (SELECT active FROM {s}.fault_flag) THEN
                    RAISE EXCEPTION 'injected failure'
                        USING ERRCODE = (SELECT sqlstate FROM {s}.fault_flag);
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER users_fail_while_flagged AFTER INSERT ON {s}.users
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.fail_while_flagged();
            "#
        ))
        .await
        .expect("install the fault triggers");
}

/// A trigger that refuses rows whose email starts with `poison` with an unclassified SQLSTATE
/// (P0001, raise_exception), row by row.
pub async fn install_poison_trigger(env: &TestEnv) {
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE FUNCTION {s}.refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF NEW.email LIKE 'poison%' THEN
                    RAISE EXCEPTION 'poisoned row %', NEW.id;
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER users_refuse_poison BEFORE INSERT ON {s}.users
                FOR EACH ROW EXECUTE FUNCTION {s}.refuse_poison();
            "#
        ))
        .await
        .expect("install the poison trigger");
}

/// Makes the fault raise `sqlstate` instead of 40001 (for example 42501, a systemic error).
pub async fn set_fault_sqlstate(env: &TestEnv, sqlstate: &str) {
    env.db
        .execute(
            &format!("UPDATE {}.fault_flag SET sqlstate = $1", env.schema),
            &[&sqlstate],
        )
        .await
        .expect("set the fault's SQLSTATE");
}

/// Clears the fault: inserts succeed from now on.
pub async fn clear_fault(env: &TestEnv) {
    env.db
        .execute(
            &format!("UPDATE {}.fault_flag SET active = false", env.schema),
            &[],
        )
        .await
        .expect("clear the fault");
}

/// Creates the attempt counters of `ids` (before they are published).
pub async fn track_attempts(env: &TestEnv, ids: &[Uuid]) {
    let sql: String = ids
        .iter()
        .map(|id| format!("CREATE SEQUENCE {}.attempts_{};", env.schema, id.simple()))
        .collect();
    env.db.batch_execute(&sql).await.expect("attempt counters");
}

/// Insert attempts seen for a tracked `id` (committed or not).
pub async fn attempts(env: &TestEnv, id: Uuid) -> i64 {
    env.db
        .query_one(
            &format!(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}.attempts_{}",
                env.schema,
                id.simple()
            ),
            &[],
        )
        .await
        .expect("read attempt counter")
        .get(0)
}

/// A transaction holding a lock that blocks INSERT into `users` (but not SELECT), so warren's
/// batches hang in the database (a command can land while they are in flight, a graceful
/// shutdown cannot drain); released by [`InsertLock::release`] or by dropping it.
pub struct InsertLock {
    client: tokio_postgres::Client,
    /// The backend holding the lock.
    pid: i32,
}

impl InsertLock {
    /// Takes the lock on the env's `users` table.
    pub async fn take(env: &TestEnv) -> Self {
        let (client, connection) = tokio_postgres::connect(&database_url(), NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "SET search_path TO {}; BEGIN; LOCK TABLE users IN SHARE MODE",
                env.schema
            ))
            .await
            .expect("lock users");
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        InsertLock { client, pid }
    }

    /// Waits until some backend (warren's batch INSERT) waits for the lock.
    pub async fn wait_for_a_blocked_insert(&self, env: &TestEnv) {
        wait_until(
            "a warren INSERT blocked by the lock",
            Duration::from_secs(30),
            || async {
                env.db
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                        &[&self.pid],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0) > 0)
                    .unwrap_or(false)
            },
        )
        .await;
    }

    /// Lets the inserts through (`ROLLBACK`).
    pub async fn release(self) {
        self.client.batch_execute("ROLLBACK").await.expect("unlock");
    }
}

// ---- metrics --------------------------------------------------------------------------------

/// One sample line of the exposition format.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed scrape: its text, its samples, and the family types of its `# TYPE` lines.
#[derive(Debug, Clone)]
pub struct Scrape {
    /// The text as scraped.
    pub text: String,
    pub samples: Vec<Sample>,
    /// Family name -> type (`counter`, `gauge`, `histogram`...).
    pub types: BTreeMap<String, String>,
}

impl Scrape {
    /// Parses an exposition; panics on a line that is not a comment or a sample.
    pub fn parse(text: String) -> Self {
        let mut samples = Vec::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    types.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            samples.push(
                parse_sample(line).unwrap_or_else(|| panic!("unparsable metrics line {line:?}")),
            );
        }
        Scrape {
            text,
            samples,
            types,
        }
    }

    /// The samples of `name` whose labels include every `(label, value)` of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The sum of the matching samples; 0 when there is none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// The value of the one matching sample, if there is exactly one.
    pub fn one(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<f64> = self.matching(name, labels).map(|s| s.value).collect();
        (found.len() == 1).then(|| found[0])
    }

    /// Every distinct value of `label` among the samples of `name`.
    pub fn label_values(&self, name: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }
}

/// `name{a="x",b="y"} value [timestamp]`, with escaped label values.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        let consumed = loop {
            // Skip separators, then read `key="value"` or the closing brace.
            while let Some((_, c)) = chars.peek() {
                if *c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let (i, c) = chars.next()?;
            if c == '}' {
                break i + 1;
            }
            let mut key = String::from(c);
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => break,
                    other => value.push(other),
                }
            }
            labels.insert(key.trim().to_string(), value);
        };
        rest = &inner[consumed..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The text of the env's `/metrics`, or the error if nothing answers (yet).
pub async fn scrape_text(env: &TestEnv) -> Result<String, String> {
    let url = format!("http://127.0.0.1:{}/metrics", env.metrics_port);
    tokio::task::spawn_blocking(move || {
        ureq::get(&url)
            .call()
            .and_then(|mut r| r.body_mut().read_to_string())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("metrics task")
}

/// The sum of the samples of `name` whose labels include every `(label, value)` of `labels`;
/// 0 when the series does not exist yet. Panics if the endpoint does not answer.
pub async fn metric(env: &TestEnv, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = scrape_text(env)
        .await
        .unwrap_or_else(|e| panic!("metrics endpoint: {e}"));
    Scrape::parse(text).sum(name, labels)
}

/// Like [`metric`], but `None` when no sample matches or the endpoint does not answer.
pub async fn try_metric(env: &TestEnv, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let scrape = Scrape::parse(scrape_text(env).await.ok()?);
    let values: Vec<f64> = scrape.matching(name, labels).map(|s| s.value).collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Waits until `/metrics` answers and `condition` holds on its scrape; returns that scrape.
/// Panics after `timeout` with the last scrape and warren's log.
pub async fn wait_scrape(
    env: &TestEnv,
    warren: &Warren,
    what: &str,
    timeout: Duration,
    condition: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        if let Ok(text) = scrape_text(env).await {
            let s = Scrape::parse(text);
            if condition(&s) {
                return s;
            }
            last = s.text;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for: {what}\nlast scrape:\n{last}\nlog:\n{}",
                warren.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

// ---- HTTP -----------------------------------------------------------------------------------

/// A blocking HTTP client that returns every status as a value (no error for 4xx/5xx), with a
/// 15 s bound on each request.
pub fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(15)))
        .build()
        .into()
}

/// (status, body) of one request to the env's API: `GET`, or `POST` of a JSON `body`; `None`
/// if nothing answers.
pub async fn http(
    env: &TestEnv,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Option<(u16, String)> {
    let url = format!("{}{path}", env.http_base());
    let method = method.to_string();
    let body = body.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        let agent = http_agent();
        let response = match (method.as_str(), body) {
            ("POST", Some(b)) => agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b.as_bytes()),
            _ => agent.get(&url).call(),
        };
        response.ok().map(|mut r| {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        })
    })
    .await
    .expect("http task")
}

// ---- Redis ----------------------------------------------------------------------------------
//
// The instance registry lives under the env's prefix (`REDIS_PREFIX`, the env's id) in the Redis
// of the env's `REDIS_URL` setting (the shared one unless a test points it at its own server).

/// (Redis URL, key prefix) of the warren processes `env` starts.
fn redis_of(env: &TestEnv) -> (String, String) {
    (
        env.setting("REDIS_URL")
            .map_or_else(redis_url, String::from),
        env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string(),
    )
}

/// Deletes every key under the env's prefix when dropped (also when the test panics).
pub struct RedisCleanup {
    url: String,
    prefix: String,
}

impl RedisCleanup {
    /// Cleans up the Redis `env` points at now.
    pub fn new(env: &TestEnv) -> Self {
        let (url, prefix) = redis_of(env);
        RedisCleanup { url, prefix }
    }
}

impl Drop for RedisCleanup {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(self.url.as_str()) else {
            return;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query(&mut conn);
        }
    }
}

/// One command on a fresh connection to the Redis at `url`; `None` while it is unreachable
/// (connecting and the command are bounded by 2 s each) or the command fails.
pub async fn try_redis_query<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> Option<T> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()?;
    tokio::time::timeout(Duration::from_secs(2), cmd.query_async(&mut conn))
        .await
        .ok()?
        .ok()
}

/// One command on the env's Redis, which must answer.
pub async fn redis_query<T: redis::FromRedisValue>(env: &TestEnv, cmd: &redis::Cmd) -> T {
    let (url, _) = redis_of(env);
    try_redis_query(&url, cmd)
        .await
        .unwrap_or_else(|| panic!("Redis at {url} did not answer {cmd:?}"))
}

/// The key of the registry hash of the env's instance `pid` on this host.
pub fn instance_key(env: &TestEnv, pid: i32) -> String {
    let (_, prefix) = redis_of(env);
    format!("{prefix}:instances:{}:{pid}", host())
}

/// The registry hash of the env's instance `pid` (empty when absent or Redis is away).
pub async fn instance(env: &TestEnv, pid: i32) -> HashMap<String, String> {
    let (url, _) = redis_of(env);
    try_redis_query(&url, redis::cmd("HGETALL").arg(instance_key(env, pid)))
        .await
        .unwrap_or_default()
}

/// The shutdown records of the env's instances, oldest first.
pub async fn shutdowns(env: &TestEnv) -> Vec<Value> {
    let (_, prefix) = redis_of(env);
    let raw: Vec<String> = redis_query(
        env,
        redis::cmd("ZRANGE")
            .arg(format!("{prefix}:shutdowns"))
            .arg(0)
            .arg(-1),
    )
    .await;
    raw.iter()
        .map(|r| serde_json::from_str(r).unwrap_or_else(|e| panic!("record {r:?}: {e}")))
        .collect()
}

// ---- RabbitMQ CLI ---------------------------------------------------------------------------

/// Runs `rabbitmqctl -q args...`: (success, stdout, plus stderr on failure).
/// (ready, unacknowledged) messages of `queue`, from `rabbitmqctl list_queues`.
pub async fn queue_counts(queue: &str) -> (u64, u64) {
    let rows = rabbitmqctl_rows(&[
        "list_queues",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ])
    .await;
    let row = rows
        .iter()
        .find(|row| row["name"].as_str() == Some(queue))
        .unwrap_or_else(|| panic!("queue {queue} does not exist"));
    (
        row["messages_ready"].as_u64().unwrap_or(u64::MAX),
        row["messages_unacknowledged"].as_u64().unwrap_or(u64::MAX),
    )
}

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
