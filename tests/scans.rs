//! What a batch reads: the rows of its own keys, through the keys' indexes, never a whole
//! table, however large the tables are (R36-F2 of issue 36: with deletes, the statements that
//! find what the transaction wrote filtered on `xmin` and read every row of the table, the
//! tombstones and the child table, per batch and per half of a batch being isolated). Counted
//! by PostgreSQL's own statistics (rows read by scans and index fetches), not timed.

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;
use warren::domain::Domain;
use warren::domain::mapping::{Mapping, MappingSpec};

/// Rows in each big table.
const BIG: i64 = 200_000;

/// `orders` (with deletes, `update` by `version`) and its `order_items`, as `tests/versions.rs`
/// has them.
fn mapping() -> Mapping {
    let spec: MappingSpec = toml::from_str(
        r#"
table = "orders"
key = ["order_id"]
on_conflict = "update"
version_column = "version"
unknown_fields = "ignore"
delete = { field = "/op", value = "delete" }

[columns]
order_id = { path = "/order_id", type = "uuid" }
total    = { path = "/total", type = "numeric" }
version  = { path = "/version", type = "int8" }

[[children]]
table = "order_items"
rows = "/items"
key = ["order_id", "line"]
optional = true

[children.columns]
order_id = { parent = "order_id" }
line     = { index = true }
sku      = { path = "/sku", type = "text" }
"#,
    )
    .expect("spec");
    Mapping::compile("orders", &spec).expect("compiles")
}

/// Rows read from `table` so far (by sequential scans and by index fetches), as flushed.
async fn rows_read(env: &TestEnv, table: &str) -> i64 {
    env.db
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .expect("clear the stats snapshot");
    env.db
        .query_one(
            "SELECT (COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0))::int8 \
             FROM pg_stat_user_tables WHERE schemaname = current_schema() AND relname = $1",
            &[&table],
        )
        .await
        .expect("the table's statistics")
        .get(0)
}

/// Rows deleted from `orders` so far, as flushed.
async fn orders_deleted(env: &TestEnv) -> i64 {
    env.db
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .expect("clear the stats snapshot");
    env.db
        .query_one(
            "SELECT n_tup_del FROM pg_stat_user_tables \
             WHERE schemaname = current_schema() AND relname = 'orders'",
            &[],
        )
        .await
        .expect("orders' statistics")
        .get(0)
}

/// 200,000 orders (one item each) and 200,000 tombstones of other keys; then batches of 50
/// newer writes of stored orders (their items replaced) and 50 deletes of others, once whole
/// and once in halves (as the isolation of a refused row splits a batch). Each batch reads a few
/// rows per record from the orders, the items and the tombstones, not a table: before, each read
/// the whole of each (about 200,000 rows from every table, per batch and per half).
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_with_deletes_reads_its_keys_rows_not_the_tables() {
    let env = TestEnv::new("scan_deletes").await;
    env.db
        .batch_execute(&format!(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL, \
               version int8 NOT NULL);
             CREATE TABLE order_items (order_id uuid NOT NULL REFERENCES orders, \
               line int4 NOT NULL, sku text NOT NULL, PRIMARY KEY (order_id, line));
             INSERT INTO orders SELECT gen_random_uuid(), 1, 1 FROM generate_series(1, {BIG});
             INSERT INTO order_items SELECT order_id, 1, 'A' FROM orders;"
        ))
        .await
        .expect("the big tables");
    let m = mapping();
    m.declare_tombstones(&env.db).await.expect("declare");
    env.db
        .batch_execute(&format!(
            "INSERT INTO tombstones_orders (order_id, version) \
               SELECT gen_random_uuid(), 1 FROM generate_series(1, {BIG});
             ANALYZE orders; ANALYZE order_items; ANALYZE tombstones_orders;"
        ))
        .await
        .expect("the tombstones");
    let keys: Vec<Uuid> = uuids_of(&env, "SELECT order_id FROM orders LIMIT 400").await;
    let pool = mapping_pool(&env, "warren-scans-test");
    let tables = ["orders", "order_items", "tombstones_orders"];

    // Batches of (50 writes, 50 deletes): one whole, then one in two halves.
    let batch = |keys: &[Uuid]| -> Vec<Vec<u8>> {
        let (writes, deletes) = keys.split_at(keys.len() / 2);
        writes
            .iter()
            .map(|k| {
                format!(r#"{{"order_id":"{k}","total":"2","version":2,"items":[{{"sku":"B"}}]}}"#)
                    .into_bytes()
            })
            .chain(
                deletes.iter().map(|k| {
                    format!(r#"{{"op":"delete","order_id":"{k}","version":2}}"#).into_bytes()
                }),
            )
            .collect()
    };
    let before_deleted = orders_deleted(&env).await;
    let mut before = Vec::new();
    for t in tables {
        before.push(rows_read(&env, t).await);
    }
    let mut deleted = 0;
    for group in [&keys[0..100], &keys[100..150], &keys[150..200]] {
        let bodies = batch(group);
        let client = pool.get().await.expect("client");
        let rows: Vec<_> = bodies.iter().map(|b| m.decode(b).expect("valid")).collect();
        let refs: Vec<_> = rows.iter().collect();
        let done = m.insert(&client, &refs).await.expect("the batch");
        assert_eq!(done.deleted.len(), group.len() / 2, "{done:?}");
        deleted += group.len() as i64 / 2;
        // This connection's statistics reach the shared ones once it is idle.
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .expect("flush the statistics");
    }
    wait_until(
        "the batches' statistics",
        Duration::from_secs(30),
        || async { orders_deleted(&env).await >= before_deleted + deleted },
    )
    .await;
    let mut read = Vec::new();
    for (t, b) in tables.iter().zip(&before) {
        read.push((*t, rows_read(&env, t).await - b));
    }
    // 200 records in 3 batches: a few rows each per table (the row, its item, its tombstone;
    // and PostgreSQL's foreign key checks), far from one table's 200,000.
    for (t, n) in &read {
        assert!(
            *n < 5_000,
            "{t}: {n} rows read by 200 records in 3 batches: {read:?}"
        );
    }
    // What the batches did, for the record.
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM orders WHERE version = 2").await,
        100
    );
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM tombstones_orders WHERE version = 2"
        )
        .await,
        100
    );
}

/// Review R43 F8: the same without statistics (tables never analysed: autovacuum off, a table
/// before its first autoanalyze, statistics lost with a restore). A batch of new orders asks
/// whether any child row of its keys is to go: the question was planned as a scan of the whole
/// child table for each order (4,000 new orders took 202 s against 10 s once analysed). Now a
/// batch of new orders, and one of newer versions of stored orders, read a few rows each.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_reads_its_keys_rows_without_statistics() {
    let env = TestEnv::new("scan_nostats").await;
    env.db
        .batch_execute(&format!(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL, \
               version int8 NOT NULL) WITH (autovacuum_enabled = false);
             CREATE TABLE order_items (order_id uuid NOT NULL REFERENCES orders, \
               line int4 NOT NULL, sku text NOT NULL, PRIMARY KEY (order_id, line)) \
               WITH (autovacuum_enabled = false);
             INSERT INTO orders SELECT gen_random_uuid(), 1, 1 FROM generate_series(1, {BIG});
             INSERT INTO order_items SELECT order_id, 1, 'A' FROM orders;"
        ))
        .await
        .expect("the big tables, never analysed");
    let m = mapping();
    m.declare_tombstones(&env.db).await.expect("declare");
    let stored: Vec<Uuid> = uuids_of(&env, "SELECT order_id FROM orders LIMIT 100").await;
    let fresh: Vec<Uuid> = (0..100).map(|_| Uuid::new_v4()).collect();
    let pool = mapping_pool(&env, "warren-scans-test");
    let tables = ["orders", "order_items"];
    let mut before = Vec::new();
    for t in tables {
        before.push(rows_read(&env, t).await);
    }
    for (what, keys, version) in [("new", &fresh, 1), ("stored", &stored, 2)] {
        for group in keys.chunks(50) {
            let bodies: Vec<Vec<u8>> = group
                .iter()
                .map(|k| {
                    format!(
                        r#"{{"order_id":"{k}","total":"2","version":{version},"items":[{{"sku":"B"}},{{"sku":"C"}}]}}"#
                    )
                    .into_bytes()
                })
                .collect();
            let client = pool.get().await.expect("client");
            let rows: Vec<_> = bodies.iter().map(|b| m.decode(b).expect("valid")).collect();
            let refs: Vec<_> = rows.iter().collect();
            let done = m.insert(&client, &refs).await.expect("the batch");
            assert_eq!(done.rows, group.len() as u64, "{what}: {done:?}");
            client
                .batch_execute("SELECT pg_stat_force_next_flush()")
                .await
                .expect("flush the statistics");
        }
    }
    let wanted = (fresh.len() + stored.len()) as i64 * 2;
    wait_until(
        "the batches' statistics",
        Duration::from_secs(30),
        || async {
            count_of(
                &env,
                "SELECT n_tup_ins FROM pg_stat_user_tables \
                 WHERE schemaname = current_schema() AND relname = 'order_items'",
            )
            .await
                >= BIG + wanted
        },
    )
    .await;
    let mut read = Vec::new();
    for (t, b) in tables.iter().zip(&before) {
        read.push((*t, rows_read(&env, t).await - b));
    }
    for (t, n) in &read {
        assert!(
            *n < 5_000,
            "{t}: {n} rows read by 200 records in 4 batches without statistics: {read:?}"
        );
    }
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM order_items WHERE sku = 'C'").await,
        wanted / 2
    );
}

/// Review R45 F3: the deletes of child rows (a newer version's replaced items, a delete
/// message's items) on tables never analysed. As a join of the batch's keys to the child table
/// they were planned as a hash join over the whole child table, once per batch (20,000 deletes
/// of stored orders with 4 million items took 22-24 s). Batches of newer versions and deletes
/// of stored orders (through the probe, as a batch with deletes goes), and a batch of newer
/// versions alone (the fast path): a few rows read a record.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_deletes_its_keys_child_rows_without_statistics() {
    let env = TestEnv::new("scan_nostats_del").await;
    env.db
        .batch_execute(&format!(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL, \
               version int8 NOT NULL) WITH (autovacuum_enabled = false);
             CREATE TABLE order_items (order_id uuid NOT NULL REFERENCES orders, \
               line int4 NOT NULL, sku text NOT NULL, PRIMARY KEY (order_id, line)) \
               WITH (autovacuum_enabled = false);
             INSERT INTO orders SELECT gen_random_uuid(), 1, 1 FROM generate_series(1, {BIG});
             INSERT INTO order_items SELECT order_id, l, 'A' FROM orders, generate_series(1, 4) AS l;"
        ))
        .await
        .expect("the big tables, never analysed");
    let m = mapping();
    m.declare_tombstones(&env.db).await.expect("declare");
    let keys: Vec<Uuid> = uuids_of(&env, "SELECT order_id FROM orders LIMIT 600").await;
    let pool = mapping_pool(&env, "warren-scans-test");
    let before = rows_read(&env, "order_items").await;
    let write = |k: &Uuid| {
        format!(r#"{{"order_id":"{k}","total":"2","version":2,"items":[{{"sku":"B"}}]}}"#)
            .into_bytes()
    };
    let delete =
        |k: &Uuid| format!(r#"{{"op":"delete","order_id":"{k}","version":2}}"#).into_bytes();
    // Two batches of 200 writes and 200 deletes, then one of 200 writes alone.
    let batches: Vec<Vec<Vec<u8>>> = vec![
        keys[0..100]
            .iter()
            .map(write)
            .chain(keys[100..200].iter().map(delete))
            .collect(),
        keys[200..300]
            .iter()
            .map(write)
            .chain(keys[300..400].iter().map(delete))
            .collect(),
        keys[400..600].iter().map(write).collect(),
    ];
    let before_deleted = count_of(
        &env,
        "SELECT n_tup_del FROM pg_stat_user_tables \
         WHERE schemaname = current_schema() AND relname = 'order_items'",
    )
    .await;
    for bodies in &batches {
        let client = pool.get().await.expect("client");
        let rows: Vec<_> = bodies.iter().map(|b| m.decode(b).expect("valid")).collect();
        let refs: Vec<_> = rows.iter().collect();
        m.insert(&client, &refs).await.expect("the batch");
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .expect("flush the statistics");
    }
    // 600 stored orders lose their 4 items each.
    wait_until(
        "the batches' statistics",
        Duration::from_secs(30),
        || async {
            env.db
                .batch_execute("SELECT pg_stat_clear_snapshot()")
                .await
                .expect("clear the stats snapshot");
            count_of(
                &env,
                "SELECT n_tup_del FROM pg_stat_user_tables \
                 WHERE schemaname = current_schema() AND relname = 'order_items'",
            )
            .await
                >= before_deleted + 600 * 4
        },
    )
    .await;
    let read = rows_read(&env, "order_items").await - before;
    // A few rows a record (its items, found and deleted; the foreign key's checks), far from
    // the 4 x 200,000 of one scan.
    assert!(
        read < 20_000,
        "order_items: {read} rows read by 1,000 records in 3 batches without statistics"
    );
    // What the batches did: the writes' one item each, the deletes' none.
    let of = |ks: &[Uuid]| {
        ks.iter()
            .map(|k| format!("'{k}'"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let written: Vec<Uuid> = keys[0..100]
        .iter()
        .chain(&keys[200..300])
        .chain(&keys[400..600])
        .copied()
        .collect();
    let deleted: Vec<Uuid> = keys[100..200]
        .iter()
        .chain(&keys[300..400])
        .copied()
        .collect();
    assert_eq!(
        uuids_of(
            &env,
            &format!(
                "SELECT order_id FROM order_items WHERE order_id IN ({}) ORDER BY order_id, line",
                of(&written)
            )
        )
        .await,
        {
            let mut w = written.clone();
            w.sort();
            w
        },
        "each written order has its one new item"
    );
    for table in ["orders", "order_items"] {
        assert_eq!(
            uuids_of(
                &env,
                &format!(
                    "SELECT order_id FROM {table} WHERE order_id IN ({})",
                    of(&deleted)
                )
            )
            .await,
            Vec::<Uuid>::new(),
            "{table}: the deleted orders' rows"
        );
    }
}

/// Review R46b F4: a key of two columns whose first has few values (a tenant). The child rows'
/// deletes compared that column with `= ANY` and the whole key with a hashed `IN`, which read
/// every child row of the batch's tenants: the whole table. Analysed (as autovacuum keeps
/// them), batches of newer versions and deletes read a few rows a record.
#[tokio::test(flavor = "multi_thread")]
async fn a_two_column_key_with_few_tenants_deletes_its_keys_child_rows() {
    let env = TestEnv::new("scan_tenants").await;
    env.db
        .batch_execute(&format!(
            "CREATE TABLE orders (tenant text NOT NULL, order_no int8 NOT NULL, \
               version int8 NOT NULL, PRIMARY KEY (tenant, order_no));
             CREATE TABLE order_items (tenant text NOT NULL, order_no int8 NOT NULL, \
               line int4 NOT NULL, sku text NOT NULL, PRIMARY KEY (tenant, order_no, line));
             INSERT INTO orders SELECT 't' || (n % 3), n, 1 FROM generate_series(1, {BIG}) AS n;
             INSERT INTO order_items SELECT tenant, order_no, 1, 'A' FROM orders;
             ANALYZE orders; ANALYZE order_items;"
        ))
        .await
        .expect("the big tables");
    let spec: MappingSpec = toml::from_str(
        r#"
table = "orders"
key = ["tenant", "order_no"]
on_conflict = "update"
version_column = "version"
unknown_fields = "ignore"
delete = { field = "/op", value = "delete" }

[columns]
tenant   = { path = "/tenant", type = "text" }
order_no = { path = "/order_no", type = "int8" }
version  = { path = "/version", type = "int8" }

[[children]]
table = "order_items"
rows = "/items"
key = ["tenant", "order_no", "line"]
optional = true

[children.columns]
tenant   = { parent = "tenant" }
order_no = { parent = "order_no" }
line     = { index = true }
sku      = { path = "/sku", type = "text" }
"#,
    )
    .expect("spec");
    let m = Mapping::compile("orders", &spec).expect("compiles");
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = mapping_pool(&env, "warren-scans-test");
    let before = rows_read(&env, "order_items").await;
    let key = |n: i64| format!(r#""tenant":"t{}","order_no":{n}"#, n % 3);
    let batches: Vec<Vec<Vec<u8>>> = vec![
        // Through the probe (writes and deletes), then the fast path (writes alone).
        (1..=100)
            .map(|n| format!(r#"{{{},"version":2,"items":[{{"sku":"B"}}]}}"#, key(n)))
            .chain((101..=200).map(|n| format!(r#"{{"op":"delete",{},"version":2}}"#, key(n))))
            .map(String::into_bytes)
            .collect(),
        (201..=300)
            .map(|n| format!(r#"{{{},"version":2,"items":[{{"sku":"B"}}]}}"#, key(n)).into_bytes())
            .collect(),
    ];
    for bodies in &batches {
        let client = pool.get().await.expect("client");
        let rows: Vec<_> = bodies.iter().map(|b| m.decode(b).expect("valid")).collect();
        let refs: Vec<_> = rows.iter().collect();
        m.insert(&client, &refs).await.expect("the batch");
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .expect("flush the statistics");
    }
    wait_until(
        "the batches' statistics",
        Duration::from_secs(30),
        || async {
            env.db
                .batch_execute("SELECT pg_stat_clear_snapshot()")
                .await
                .expect("clear the stats snapshot");
            count_of(
                &env,
                "SELECT n_tup_del FROM pg_stat_user_tables \
                 WHERE schemaname = current_schema() AND relname = 'order_items'",
            )
            .await
                >= 300
        },
    )
    .await;
    let read = rows_read(&env, "order_items").await - before;
    assert!(
        read < 5_000,
        "order_items: {read} rows read by 300 records in 2 batches (a tenant's share of the \
         table is {})",
        BIG / 3
    );
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM order_items WHERE order_no <= 300 AND sku = 'A'"
        )
        .await,
        0,
        "every replaced or deleted order's old item gone"
    );
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM order_items WHERE order_no <= 300"
        )
        .await,
        200,
        "the written orders' new items"
    );
}
