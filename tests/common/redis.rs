//! Redis: `RedisCleanup`, commands (`try_redis_query`, `redis_query`), the instance registry
//! (`instance_key`, `instance`, `wait_record_field`, `wait_running`, `shutdowns`, and records
//! of instances that do not run: `fake_record`, `register_record`) and the events stream
//! (`stream_events`, `stream_events_at`).
//!
//! The instance registry lives under the env's prefix (`REDIS_PREFIX`, the env's id) in the Redis
//! of the env's `REDIS_URL` setting (the shared one unless a test points it at its own server).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::env::{TestEnv, host, redis_url};

/// (Redis URL, key prefix) of the warren processes `env` starts.
pub fn redis_of(env: &TestEnv) -> (String, String) {
    (
        env.setting("REDIS_URL")
            .map_or_else(redis_url, String::from),
        env.setting("REDIS_PREFIX").unwrap_or(&env.id).to_string(),
    )
}

/// Deletes every key under the env's prefix when dropped (also when the test panics).
pub struct RedisCleanup {
    /// The Redis the env's warren processes use, taken at creation.
    url: String,
    /// Their key prefix: everything under it goes.
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
        delete_keys_under(&self.url, &self.prefix);
    }
}

/// Deletes every key under `prefix` in the Redis at `url`, blocking, each step bounded by 2 s;
/// nothing when Redis is away. For cleanup in `Drop`.
pub(super) fn delete_keys_under(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) else {
        return;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(2)));
    // As bytes: a key that is not UTF-8 (a test of such keys) must go too.
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut conn)
        .unwrap_or_default();
    if !keys.is_empty() {
        let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query(&mut conn);
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

/// The registry record of the env's instance `pid`, as JSON (`Null` when absent or Redis is
/// away); a record that is there but does not parse panics (it is never read as absent).
pub async fn instance(env: &TestEnv, pid: i32) -> Value {
    let (url, _) = redis_of(env);
    let fields: HashMap<String, String> =
        try_redis_query(&url, redis::cmd("HGETALL").arg(instance_key(env, pid)))
            .await
            .unwrap_or_default();
    match fields.get("record") {
        Some(raw) => serde_json::from_str(raw).unwrap_or_else(|e| panic!("record {raw:?}: {e}")),
        None if fields.is_empty() => Value::Null,
        None => panic!("a registry hash without a record: {fields:?}"),
    }
}

/// A registry record (format 1) of an instance `host:pid` running `roles` with the users
/// pipeline, as a running warren writes it; no process stands behind it, so nothing takes its
/// commands unless the test does. Change fields before [`register_record`].
pub fn fake_record(host: &str, pid: u32, roles: &str) -> Value {
    serde_json::json!({
        "format": 1, "host": host, "pid": pid, "run": format!("run{pid}"), "roles": roles,
        "version": "0.0.0", "started_at": 1, "last_heartbeat": 1, "status": "running",
        "processors": 1, "concurrency": 1, "rate_limit_per_s": 0, "breaker": "closed",
        "received": 0, "inserted": 0, "retried": 0, "dead_lettered": 0, "inflight": 0,
        "received_per_s": 0.0, "inserted_per_s": 0.0, "stages": {},
        "pipelines": [{"name": "users", "table": "users", "main_exchange": "x",
            "main_queue": "q", "retry_queues": [], "dlq_queue": "d"}],
    })
}

/// Writes `record` under its `host` and `pid` in the env's registry, for 120 s; returns the
/// key of its command list.
pub async fn register_record(env: &TestEnv, record: &Value) -> String {
    let (_, prefix) = redis_of(env);
    let (host, pid) = (record["host"].as_str().expect("host"), &record["pid"]);
    let key = format!("{prefix}:instances:{host}:{pid}");
    let _: () = redis_query(
        env,
        redis::cmd("HSET")
            .arg(&key)
            .arg("record")
            .arg(record.to_string()),
    )
    .await;
    let _: () = redis_query(env, redis::cmd("EXPIRE").arg(&key).arg(120)).await;
    format!("{prefix}:commands:{host}:{pid}")
}

/// Waits (up to 20 s) until the registry record of `pid` has `field` = `value` (`value` read as
/// JSON when it parses, else as a string: `"2"` is the number 2, `running` the string).
pub async fn wait_record_field(env: &TestEnv, pid: i32, field: &str, value: &str) {
    let expected: Value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
    super::wait::wait_until(
        &format!("{field} = {value} in the record of {pid}"),
        Duration::from_secs(20),
        || async { instance(env, pid).await[field] == expected },
    )
    .await;
}

/// Waits (up to 20 s) until `pid` is registered as running.
pub async fn wait_running(env: &TestEnv, pid: i32) {
    wait_record_field(env, pid, "status", "running").await;
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

/// Every lifecycle event in the env's stream (`<prefix>:events`), oldest first, read from the
/// Redis of the env's `REDIS_URL`, which must answer.
pub async fn stream_events(env: &TestEnv) -> Vec<Value> {
    let (url, prefix) = redis_of(env);
    stream_events_at(&url, &prefix).await
}

/// Every lifecycle event in the stream `<prefix>:events` of the Redis at `url`, oldest first.
/// Panics when Redis does not answer: an unanswered read is never "no events".
pub async fn stream_events_at(url: &str, prefix: &str) -> Vec<Value> {
    let reply: redis::streams::StreamRangeReply = try_redis_query(
        url,
        redis::cmd("XRANGE")
            .arg(format!("{prefix}:events"))
            .arg("-")
            .arg("+"),
    )
    .await
    .unwrap_or_else(|| panic!("Redis at {url} did not answer XRANGE {prefix}:events"));
    reply
        .ids
        .into_iter()
        .map(|entry| {
            let text: String = entry.get("event").expect("an event field");
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
        })
        .collect()
}
