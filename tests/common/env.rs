//! Env and names: the servers' URLs (from the environment, with localhost defaults),
//! `free_port`, `host`, and `TestEnv`, one test's private world (its own exchanges, queues,
//! schema and Redis prefix), removed on drop even when the test panics.

use lapin::options::{ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Channel, Connection, ConnectionProperties};
use std::sync::atomic::{AtomicU32, Ordering};
use tokio_postgres::NoTls;
use uuid::Uuid;

use super::redis::delete_keys_under;

pub const BIN: &str = env!("CARGO_BIN_EXE_warren");

/// The `warren` binary the tests run: this build's, or another build's when
/// `WARREN_TEST_BIN` names one (to show that a test fails on an older build, or to A/B two).
pub fn bin() -> String {
    std::env::var("WARREN_TEST_BIN").unwrap_or_else(|_| BIN.to_string())
}

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

/// A number no other call in this test binary gets (in names of queues, schemas, log files).
pub(super) fn unique_number() -> u32 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// A free TCP port on 127.0.0.1 (bound, then released), never one this test binary was given
/// before: released ports go back to the kernel, which may hand the same one to the next call
/// while the first caller's warren is still starting (seen: a consumer's `/metrics` took the
/// API's port, the API failed to bind, and the test's requests were answered by the metrics
/// endpoint).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// The host name as warren records it (registry keys, `ctl` output): warren's own lookup.
pub fn host() -> String {
    warren::hostname()
}

/// One test's private world: its own exchanges, queues and schema, removed on drop.
pub struct TestEnv {
    /// Unique prefix of every name this test creates.
    pub id: String,
    /// The PostgreSQL schema warren's tables go to (`DATABASE_SCHEMA`), dropped with the env.
    pub schema: String,
    /// The topology's names (`MAIN_EXCHANGE`, `MAIN_QUEUE`, ...): this test's alone, deleted
    /// with the env.
    pub main_exchange: String,
    pub main_queue: String,
    pub retry_exchange: String,
    pub retry_queue: String,
    pub dlx_exchange: String,
    pub dlq_queue: String,
    /// Where the env's warren serves its API (`HTTP_ADDR`) and `/metrics` (`METRICS_ADDR`).
    pub http_port: u16,
    pub metrics_port: u16,
    /// Settings passed to every warren this env starts (environment variables).
    pub vars: Vec<(String, String)>,
    /// The test's own broker link; `channel` is in confirm mode, for the publishing helpers.
    pub conn: Connection,
    pub channel: Channel,
    /// The test's database link, with `search_path` set to `schema`.
    pub db: tokio_postgres::Client,
}

impl TestEnv {
    /// Connects to the real services (failing with how to start them) and picks unique names.
    pub async fn new(test: &str) -> Self {
        let n = unique_number();
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
                // "db error" alone says nothing: the server's own words are in its DbError.
                let why = e
                    .as_db_error()
                    .map_or_else(|| e.to_string(), |db| db.message().to_string());
                panic!(
                    "cannot reach PostgreSQL at {}: {why}; {HOW_TO_START}",
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
            ("BATCH_TIMEOUT_MS".into(), "100".into()),
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

    /// The current value of one setting (see [`TestEnv::set`]).
    pub fn setting(&self, key: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// warren's settings as a process this env starts would load them (for tests that run
    /// warren's parts in-process).
    pub fn settings(&self) -> warren::config::Settings {
        let mut sources = warren::config::Sources {
            use_env: false,
            ..Default::default()
        };
        for (key, value) in self.vars.iter().filter(|(k, _)| k != "RUST_LOG") {
            sources = sources.with_override(&key.to_ascii_lowercase(), value.clone());
        }
        warren::config::Settings::load(&sources).expect("the test's settings are valid")
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
        let redis_prefix = self.id.clone();
        let redis_at = self
            .setting("REDIS_URL")
            .map_or_else(redis_url, String::from);
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
            // Every Redis key under the env's prefix (registry, commands, history, shutdowns).
            delete_keys_under(&redis_at, &redis_prefix);
        })
        .join();
    }
}
