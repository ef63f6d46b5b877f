//! The one shared test harness, split by concern. Every test binary uses a part of it (hence
//! `dead_code` allowed); `use common::*` brings in everything but `ops` and `raw_amqp`.
//!
//! - `env`: the servers' URLs from the environment with localhost defaults (`amqp_url`,
//!   `database_url`, `redis_url`), `free_port`, `host` (the host name as warren records it), and
//!   **`TestEnv`**, one test's private world (unique queues, exchanges, database schema, Redis
//!   prefix; `set`, `setting`), removed on drop even when the test panics.
//! - `files`: **`ConfigFile`**, a configuration file of the test's own (`--config`), removed on
//!   drop.
//! - `warren`: running warren (`command`, `run`, `run_async`, `declare`, `start`, `log_path`),
//!   **`Warren`**, a running `warren run` (signals, `terminate`, `terminate_ok`, `wait`, `kill9`,
//!   `logs`), and `LogsOnPanic` to show the logs of failed tests.
//! - `broker`: publishing (`publish_raw`, `publish_to`, `publish_to_dlq`, `publish_pipelined`,
//!   `publish_pipelined_to`, `publish_users`, `publish_ids`), queues and exchanges
//!   (`queue_state`, `try_queue_state`, `ready`, `queue_exists`, `exchange_exists`, `peek`,
//!   `drain_queue`, `assert_queue_empty`), and the RabbitMQ CLI (`queue_counts`,
//!   `try_rabbitmqctl`, `rabbitmqctl`, `rabbitmqctl_rows`).
//! - `messages`: bodies and properties (`user_body`, `json_props`, `with_header`, `long_string`,
//!   `dead_letter_props`) and reading them back (`header`, `as_int`, `int_header`,
//!   `strict_int_header`, `text_header`, `message_id`, `message_uuid`).
//! - `db`: rows (`count_rows`, `row_ids`, `assert_rows_exactly`), any count or set of ids
//!   (`count_of`, `uuids_of`, `assert_same_ids`; a failed query panics, never reads as 0),
//!   fault injection through triggers (`install_fault` with `CountAttempts`,
//!   `set_fault_sqlstate`, `clear_fault`, `track_attempts`, `attempts`,
//!   `install_poison_trigger`), `InsertLock`, which holds warren's batch inserts (`take_on` a
//!   pipeline's table), and
//!   `terminate_backends`.
//! - `redis`: `RedisCleanup`, `try_redis_query`, `redis_query`, the instance registry
//!   (`instance_key`, `instance`, `wait_record_field`, `wait_running`, `shutdowns`; records of
//!   no process, `fake_record` and `register_record`) and the events stream (`stream_events`,
//!   `stream_events_at`; Redis must answer).
//! - `proxy`: `TcpProxy`, which cuts, restores, freezes and thaws one warren's link to a server.
//! - `schedule`: the ledgers' fault schedule (`fault_schedule`, `check_fault_schedules`).
//! - `metrics`: the `/metrics` scrape (`scrape_text`, `Scrape`, `wait_scrape`) and single values
//!   (`metric`: an absent series is 0, no answer panics; `try_metric`, for polling only).
//! - `http`: `http_base`, `http_agent` and `http`, one request to the env's API.
//! - `pipelines`: `PipelineNames` and `PipelineCleanup` for configured pipelines, the `orders`
//!   pipeline several tests run beside users (`create_orders_table`, `orders_toml`,
//!   `declare_file`, `orders_pipeline`), the nested orders and their items (`create_nested_tables`,
//!   `NESTED_ORDERS`, `nested_toml`, `nested_order`, `nested_items`), `tail`.
//! - `wait`: `wait_until`, `wait_queues_settled`. Wait on conditions, never on fixed sleeps; to
//!   prove that something did not happen, publish a sentinel after it and wait for the sentinel
//!   (then for the queues to be settled).
//! - `ops` (by path, `common::ops::...`): promtool, a real Prometheus, warren under
//!   memory-deny-write-execute.
//! - `raw_amqp` (by path): a frame-by-frame AMQP publisher for what no client library sends.
//! - `hostile` (by path): messages drawn from everything AMQP 0-9-1 lets a publisher send, for
//!   the ledger, and `key_of`, which finds a parked row's ledger key.
//! - `container` (by path, `common::container::...`): podman as this machine needs it, this
//!   build's image (`scripts/image.sh`), containers removed on drop.
//! - `cluster` (by path, `common::cluster::...`): the RabbitMQ test cluster
//!   (`WARREN_TEST_CLUSTER_URLS`), `ClusterEnv`, its queues as the cluster lists them, and
//!   `QueueCleanup` for queues beyond a `TestEnv`'s own (retry tiers).
#![allow(dead_code)]

mod broker;
pub mod cluster;
pub mod container;
mod db;
mod env;
mod files;
pub mod hostile;
mod http;
mod messages;
mod metrics;
pub mod ops;
mod pipelines;
mod proxy;
pub mod raw_amqp;
mod redis;
mod schedule;
mod wait;
mod warren;

// Each test binary uses some of the parts: the others' re-exports are unused there.
#[allow(unused_imports)]
pub use self::{
    broker::*, db::*, env::*, files::*, http::*, messages::*, metrics::*, pipelines::*, proxy::*,
    redis::*, schedule::*, wait::*, warren::*,
};
