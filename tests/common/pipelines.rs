//! Configured pipelines in tests: `PipelineNames`, a pipeline's own broker names under the
//! test's id (with their `[[pipelines]]` lines), and `PipelineCleanup`, which deletes its
//! queues and exchanges also after a failed assertion; the `orders` pipeline several tests run
//! beside users (`create_orders_table`, `orders_toml`, `declare_file`, `orders_pipeline`);
//! the nested orders, an order and its items (`create_nested_tables`, `NESTED_ORDERS`,
//! `nested_toml`, `nested_order`, `nested_items`); a mapping driven straight against the
//! database (`mapping_pool`, `insert_bodies`); `tail` for logs in reports.

use super::env::{TestEnv, amqp_url};
use super::files::ConfigFile;

/// A configured pipeline's broker names, the test's own: `<id>_<pipeline>_exchange`, ...,
/// one retry tier of 1 s.
#[derive(Clone)]
pub struct PipelineNames {
    pub exchange: String,
    pub queue: String,
    pub retry_exchange: String,
    pub retry: String,
    pub dlx: String,
    pub dlq: String,
}

impl PipelineNames {
    pub fn of(env: &TestEnv, pipeline: &str) -> Self {
        let n = |what: &str| format!("{}_{pipeline}_{what}", env.id);
        PipelineNames {
            exchange: n("exchange"),
            queue: n("queue"),
            retry_exchange: n("retry_exchange"),
            retry: n("retry_1s"),
            dlx: n("dlx"),
            dlq: n("dlq"),
        }
    }

    /// The env's own topology names (`MAIN_EXCHANGE`, ...), for a pipeline declared on the
    /// queues the env already has (users as a configured pipeline); the env deletes them.
    pub fn of_env(env: &TestEnv) -> Self {
        PipelineNames {
            exchange: env.main_exchange.clone(),
            queue: env.main_queue.clone(),
            retry_exchange: env.retry_exchange.clone(),
            retry: env.retry_queue.clone(),
            dlx: env.dlx_exchange.clone(),
            dlq: env.dlq_queue.clone(),
        }
    }

    /// The names as the lines of a `[[pipelines]]` entry.
    pub fn toml(&self) -> String {
        format!(
            "main_exchange = \"{}\"\nmain_queue = \"{}\"\nretry_exchange = \"{}\"\n\
             retry_queue = \"{}\"\ndlx_exchange = \"{}\"\ndlq_queue = \"{}\"\n",
            self.exchange, self.queue, self.retry_exchange, self.retry, self.dlx, self.dlq
        )
    }

    /// Deletes these queues and exchanges when dropped.
    pub fn cleanup(&self) -> PipelineCleanup {
        PipelineCleanup(
            vec![self.queue.clone(), self.retry.clone(), self.dlq.clone()],
            vec![
                self.exchange.clone(),
                self.retry_exchange.clone(),
                self.dlx.clone(),
            ],
        )
    }
}

/// Deletes queues and exchanges (queues first), also after a failed assertion.
pub struct PipelineCleanup(Vec<String>, Vec<String>);

impl PipelineCleanup {
    /// Deletes `queues` when dropped.
    pub fn queues(queues: &[&str]) -> Self {
        PipelineCleanup(queues.iter().map(|q| q.to_string()).collect(), Vec::new())
    }
}

impl Drop for PipelineCleanup {
    fn drop(&mut self) {
        super::cluster::delete_on(
            &amqp_url(),
            std::mem::take(&mut self.0),
            std::mem::take(&mut self.1),
        );
    }
}

/// Creates the `orders` table of the env's schema: `order_id uuid` (the key), `qty int4`.
pub async fn create_orders_table(env: &TestEnv) {
    env.db
        .batch_execute("CREATE TABLE orders (order_id uuid PRIMARY KEY, qty int4 NOT NULL)")
        .await
        .expect("create orders");
}

/// The text of a configuration file with one `orders` pipeline on `names`' queues (one retry
/// tier of 1 s) reading `{"id": uuid, "qty": int}` into the `orders` table, with the lines
/// `extra` (`batch_size = 100\n...`, or nothing) in its entry.
pub fn orders_toml(names: &PipelineNames, extra: &str) -> String {
    format!(
        "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
         {extra}\nretry_ttls_ms = [1000]\n{}\n[pipelines.columns]\n\
         order_id = {{ path = \"/id\", type = \"uuid\" }}\n\
         qty = {{ path = \"/qty\", type = \"int4\" }}\n",
        names.toml()
    )
}

/// `warren --config <file> declare`, which must succeed.
pub async fn declare_file(env: &TestEnv, file: &ConfigFile) {
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
}

/// The `orders` pipeline ready to run: its table created, its file ([`orders_toml`] with
/// `extra`) written and its topology declared.
pub async fn orders_pipeline(env: &TestEnv, names: &PipelineNames, extra: &str) -> ConfigFile {
    create_orders_table(env).await;
    let file = ConfigFile::new(&orders_toml(names, extra));
    declare_file(env, &file).await;
    file
}

/// The nested orders' tables in the env's schema: `orders` (`order_id uuid` the key, `total
/// numeric`, `version int8`) and `order_items` (a foreign key to its order, `CHECK (qty <
/// 100)`, the key `order_id, line`).
pub async fn create_nested_tables(env: &TestEnv) {
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                total numeric NOT NULL,
                version int8 NOT NULL
            );
            CREATE TABLE order_items (
                order_id uuid NOT NULL REFERENCES orders ON DELETE CASCADE,
                line int4 NOT NULL,
                sku text NOT NULL,
                qty int4 NOT NULL CHECK (qty < 100),
                PRIMARY KEY (order_id, line)
            )",
        )
        .await
        .expect("create the nested orders' tables");
}

/// The nested orders' columns and child table, as the lines of a `[[pipelines]]` entry.
pub const NESTED_ORDERS: &str = r#"
[pipelines.columns]
order_id = { path = "/order_id", type = "uuid" }
total    = { path = "/total", type = "numeric", min = 0 }
version  = { path = "/version", type = "int8" }

[[pipelines.children]]
table = "order_items"
rows = "/items"
key = ["order_id", "line"]

[pipelines.children.columns]
order_id = { parent = "order_id" }
line     = { index = true }
sku      = { path = "/sku", type = "text", min_len = 1 }
qty      = { path = "/qty", type = "int4", min = 1 }
"#;

/// A configuration file's text with the nested `orders` pipeline (`on_conflict = "keep"`
/// unless `extra` says otherwise) on `names`' queues, with the lines `extra` in its entry.
pub fn nested_toml(names: &PipelineNames, extra: &str) -> String {
    format!(
        "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
         {extra}\nretry_ttls_ms = [1000]\n{}{NESTED_ORDERS}",
        names.toml()
    )
}

/// An order of the nested pipeline with `items` as (sku, qty).
pub fn nested_order(id: uuid::Uuid, version: i64, items: &[(&str, i64)]) -> Vec<u8> {
    let items: Vec<String> = items
        .iter()
        .map(|(sku, qty)| format!(r#"{{"sku":"{sku}","qty":{qty}}}"#))
        .collect();
    format!(
        r#"{{"order_id":"{id}","total":"12.50","version":{version},"items":[{}]}}"#,
        items.join(",")
    )
    .into_bytes()
}

/// The stored items of order `id`, (line, sku, qty) by line.
pub async fn nested_items(env: &TestEnv, id: uuid::Uuid) -> Vec<(i32, String, i32)> {
    env.db
        .query(
            "SELECT line, sku, qty FROM order_items WHERE order_id = $1 ORDER BY line",
            &[&id],
        )
        .await
        .expect("the items")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A pool of two connections to the test's database, named `name` in pg_stat_activity, for a
/// mapping driven straight against the tables.
pub fn mapping_pool(env: &TestEnv, name: &str) -> deadpool_postgres::Pool {
    warren::db::pool_for(&env.settings().database(), 2, name).expect("pool")
}

/// `bodies` decoded by `m` (each must be valid) and inserted as one batch, as a sink does.
pub async fn insert_bodies(
    m: &warren::domain::mapping::Mapping,
    pool: &deadpool_postgres::Pool,
    bodies: &[Vec<u8>],
) -> Result<warren::domain::Inserted, warren::db::DbError> {
    use warren::domain::Domain;
    let rows: Vec<warren::domain::mapping::Row> = bodies
        .iter()
        .map(|b| m.decode(b).expect("a valid body"))
        .collect();
    let refs: Vec<&warren::domain::mapping::Row> = rows.iter().collect();
    let client = pool.get().await.expect("client");
    m.insert(&client, &refs).await
}
