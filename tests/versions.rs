//! `on_conflict = "update"` outcomes and deletes against the real database and broker: an older
//! version is `stale` (acked, counted and evented, never inserted), the same version with other
//! content (child rows included) `id_conflict`, the same content a copy; a delete removes its
//! key's row and child rows under the version guard and leaves a tombstone an older write never
//! gets past. Generated sequences (seeded) of versions, deletes and conflicting twins of a few
//! keys, cut into batches of every size and order, with and without child tables, must end as
//! the highest version says, with every message accounted for once.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use uuid::Uuid;
use warren::domain::mapping::{Mapping, MappingSpec};
use warren::domain::{Domain, Inserted};

/// `orders` and `order_items` (a foreign key without cascade: warren deletes the items itself).
async fn tables(env: &TestEnv) {
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                total numeric NOT NULL,
                version int8 NOT NULL
            );
            CREATE TABLE order_items (
                order_id uuid NOT NULL REFERENCES orders,
                line int4 NOT NULL,
                sku text NOT NULL,
                PRIMARY KEY (order_id, line)
            )",
        )
        .await
        .expect("create the tables");
}

const PARENT: &str = r#"
[columns]
order_id = { path = "/order_id", type = "uuid" }
total    = { path = "/total", type = "numeric" }
version  = { path = "/version", type = "int8" }
"#;

const CHILDREN: &str = r#"
[[children]]
table = "order_items"
rows = "/items"
key = ["order_id", "line"]
optional = true

[children.columns]
order_id = { parent = "order_id" }
line     = { index = true }
sku      = { path = "/sku", type = "text" }
"#;

/// The orders mapping, `update`, with deletes (`/op` = "delete") or without, with the items
/// child table or without.
fn mapping(deletes: bool, children: bool) -> Mapping {
    let spec: MappingSpec = toml::from_str(&format!(
        "table = \"orders\"\nkey = [\"order_id\"]\non_conflict = \"update\"\n\
         version_column = \"version\"\nunknown_fields = \"ignore\"\n{}{PARENT}{}",
        if deletes {
            "delete = { field = \"/op\", value = \"delete\" }\n"
        } else {
            ""
        },
        if children { CHILDREN } else { "" }
    ))
    .expect("spec");
    Mapping::compile("orders", &spec).expect("compiles")
}

/// One message of the generated sequences: a write of `total` with `items`, or a delete.
#[derive(Debug, Clone, PartialEq)]
struct Msg {
    key: Uuid,
    version: i64,
    delete: bool,
    total: String,
    items: Vec<String>,
}

impl Msg {
    fn body(&self) -> Vec<u8> {
        if self.delete {
            return format!(
                r#"{{"op":"delete","order_id":"{}","version":{}}}"#,
                self.key, self.version
            )
            .into_bytes();
        }
        let items: Vec<String> = self
            .items
            .iter()
            .map(|s| format!(r#"{{"sku":"{s}"}}"#))
            .collect();
        format!(
            r#"{{"op":"upsert","order_id":"{}","total":"{}","version":{},"items":[{}]}}"#,
            self.key,
            self.total,
            self.version,
            items.join(",")
        )
        .into_bytes()
    }

    /// Same state (a delete is a delete; a write its total and items).
    fn same(&self, other: &Msg) -> bool {
        self.delete == other.delete
            && (self.delete || (self.total == other.total && self.items == other.items))
    }
}

/// xorshift64*: a small seeded generator, so a failing case can be run again by its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn pool(env: &TestEnv) -> deadpool_postgres::Pool {
    mapping_pool(env, "warren-versions-test")
}

async fn insert(
    m: &Mapping,
    pool: &deadpool_postgres::Pool,
    bodies: &[Vec<u8>],
) -> Result<Inserted, warren::db::DbError> {
    insert_bodies(m, pool, bodies).await
}

/// What the table holds for `key`: (total, version, items by line), or None.
async fn stored(env: &TestEnv, key: Uuid) -> Option<(String, i64, Vec<String>)> {
    let row = env
        .db
        .query_opt(
            "SELECT total::text, version FROM orders WHERE order_id = $1",
            &[&key],
        )
        .await
        .expect("orders")?;
    let items = env
        .db
        .query(
            "SELECT sku FROM order_items WHERE order_id = $1 ORDER BY line",
            &[&key],
        )
        .await
        .expect("items")
        .iter()
        .map(|r| r.get(0))
        .collect();
    Some((row.get(0), row.get(1), items))
}

/// The tombstone's version of `key`, if any.
async fn tombstone(env: &TestEnv, key: Uuid) -> Option<i64> {
    env.db
        .query_opt(
            "SELECT version FROM tombstones_orders WHERE order_id = $1",
            &[&key],
        )
        .await
        .expect("tombstones")
        .map(|r| r.get(0))
}

async fn items_of(env: &TestEnv, key: Uuid) -> i64 {
    env.db
        .query_one(
            "SELECT count(*) FROM order_items WHERE order_id = $1",
            &[&key],
        )
        .await
        .expect("count")
        .get(0)
}

/// Generated sequences: 2 keys, 3 to 9 messages each round, versions 1 to 4, a delete 3 times in
/// 10 (with deletes), a conflicting twin (same version, other content or a delete) 1 in 5, cut
/// into batches of 1 to 4 in delivery order. Each key must end as its highest version's first
/// delivered message says (a row with its total and items and no tombstone, or no row, no
/// items and a tombstone of that version); of that version, each other message is a copy when
/// it says the same and `id_conflict` when not; nothing is refused; each message has one outcome
/// at most (a stale one is never a delete nor a conflict), a delete's never `stored`.
async fn generated(env: &TestEnv, deletes: bool, children: bool, seed: u64, rounds: usize) {
    let m = mapping(deletes, children);
    let pool = pool(env).await;
    let mut rng = Rng(seed);
    for round in 0..rounds {
        let keys = [Uuid::new_v4(), Uuid::new_v4()];
        let n = 3 + rng.below(7) as usize;
        let mut msgs: Vec<Msg> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = keys[rng.below(2) as usize];
            let version = 1 + rng.below(4) as i64;
            // The state a version stands for, unless this one is a twin (other content).
            let twin = rng.below(5) == 0;
            let salt = if twin { 100 + rng.below(3) } else { 0 };
            let delete = deletes && (version as u64 * 7 + salt) % 10 < 3;
            let items: Vec<String> = if children {
                (0..(version as u64 + salt) % 3)
                    .map(|i| format!("v{version}-{salt}-{i}"))
                    .collect()
            } else {
                Vec::new()
            };
            msgs.push(Msg {
                key,
                version,
                delete,
                total: format!("{}.{salt}", version * 10),
                items,
            });
        }
        // Cut into batches, in delivery order.
        let mut outcome: Vec<Vec<&'static str>> = vec![Vec::new(); n];
        let mut at = 0;
        let mut cuts = Vec::new();
        while at < n {
            let size = (1 + rng.below(4) as usize).min(n - at);
            let bodies: Vec<Vec<u8>> = msgs[at..at + size].iter().map(Msg::body).collect();
            let done = insert(&m, &pool, &bodies)
                .await
                .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}\n{msgs:#?}"));
            for (i, _) in &done.stale {
                outcome[at + i].push("stale");
            }
            for (i, _) in &done.conflicts {
                outcome[at + i].push("conflict");
            }
            if let Some((i, reason)) = done.refused.first() {
                panic!(
                    "seed {seed} round {round}: message {} refused: {reason}",
                    at + i
                );
            }
            for i in &done.deleted {
                outcome[at + i].push("deleted");
            }
            cuts.push(size);
            at += size;
        }
        let ctx = format!("seed {seed} round {round} batches {cuts:?}\n{msgs:#?}\n{outcome:?}");
        for (i, o) in outcome.iter().enumerate() {
            assert!(o.len() <= 1, "message {i} has two outcomes: {ctx}");
            if msgs[i].delete {
                assert!(!o.is_empty(), "delete {i} counted as stored: {ctx}");
            }
        }
        for key in keys {
            let of_key: Vec<(usize, &Msg)> = msgs
                .iter()
                .enumerate()
                .filter(|(_, m)| m.key == key)
                .collect();
            let Some(top) = of_key.iter().map(|(_, m)| m.version).max() else {
                assert_eq!(stored(env, key).await, None, "{ctx}");
                continue;
            };
            let (wi, winner) = of_key
                .iter()
                .find(|(_, m)| m.version == top)
                .copied()
                .expect("a winner");
            assert!(
                outcome[wi].is_empty() || outcome[wi] == ["deleted"],
                "the winner {wi} must hold: {ctx}"
            );
            for (i, msg) in &of_key {
                if msg.version == top && *i != wi {
                    let wanted: &[&str] = match (msg.same(winner), msg.delete) {
                        (true, true) => &["deleted"],
                        (true, false) => &[],
                        (false, _) => &["conflict"],
                    };
                    assert_eq!(outcome[*i], wanted, "message {i} against {wi}: {ctx}");
                }
                if outcome[*i] == ["stale"] {
                    assert!(msg.version < top, "stale {i} at the top version: {ctx}");
                }
            }
            if winner.delete {
                assert_eq!(stored(env, key).await, None, "{ctx}");
                assert_eq!(items_of(env, key).await, 0, "{ctx}");
                assert_eq!(tombstone(env, key).await, Some(top), "{ctx}");
            } else {
                let total: f64 = winner.total.parse().expect("total");
                let (t, v, items) = stored(env, key).await.expect("a row");
                assert_eq!(
                    (t.parse::<f64>().expect("numeric"), v, items),
                    (total, top, winner.items.clone()),
                    "{ctx}"
                );
                if deletes {
                    assert_eq!(tombstone(env, key).await, None, "{ctx}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_versions_end_as_the_highest_says() {
    let env = TestEnv::new("ver_gen").await;
    tables(&env).await;
    for (deletes, children, seed) in [
        (false, false, 0x9e37_79b9_7f4a_7c15),
        (false, true, 0x2545_f491_4f6c_dd1d),
    ] {
        generated(&env, deletes, children, seed, 60).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_versions_and_deletes_end_as_the_highest_says() {
    let env = TestEnv::new("ver_gen_del").await;
    tables(&env).await;
    for children in [false, true] {
        let m = mapping(true, children);
        assert_eq!(
            m.declare_tombstones(&env.db).await.expect("declare"),
            Some(!children),
            "made once"
        );
    }
    for (children, seed) in [
        (false, 0x853c_49e6_748f_ea9b),
        (true, 0xda94_2042_e4dd_58b5),
    ] {
        generated(&env, true, children, seed, 60).await;
    }
}

/// What a stop asks of a batch whose statement got no answer (review R37x F1): of each message,
/// whether the table already decides it, so that it is done whether that statement committed
/// or not. A copy, or a version older than what its key holds (a row's or a tombstone's), or
/// than the group's winner of its key, is settled; a newer version, a new key, the same
/// version with other content are not. Asked through a write rolled back: the table is left
/// as it was.
#[tokio::test(flavor = "multi_thread")]
async fn settled_says_which_messages_the_table_already_decides() {
    let env = TestEnv::new("ver_settled").await;
    tables(&env).await;
    let m = mapping(true, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let (held, deleted, new) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let msg = |key, version, delete, total: &str, items: &[&str]| Msg {
        key,
        version,
        delete,
        total: total.into(),
        items: items.iter().map(|s| s.to_string()).collect(),
    };
    for stored in [
        msg(held, 2, false, "10", &["a"]),
        msg(deleted, 1, false, "5", &["b"]),
        msg(deleted, 3, true, "", &[]),
    ] {
        insert(&m, &pool, &[stored.body()]).await.expect("insert");
    }
    // Two groups: a newer version in a group makes the older ones of its key settled.
    let groups = [
        vec![
            (msg(held, 1, false, "7", &["x"]), true),
            (msg(held, 2, false, "10", &["a"]), true),
            (msg(held, 2, false, "11", &["a"]), false),
            (msg(held, 2, false, "10", &["a", "c"]), false),
            (msg(deleted, 3, true, "", &[]), true),
            (msg(deleted, 2, true, "", &[]), true),
            (msg(deleted, 2, false, "5", &["b"]), true),
            (msg(deleted, 3, false, "5", &["b"]), false),
            (msg(new, 1, false, "1", &["n"]), false),
        ],
        vec![
            (msg(held, 3, false, "10", &["a"]), false),
            (msg(held, 2, false, "11", &["a"]), true),
            (msg(deleted, 4, false, "5", &["b"]), false),
            (msg(new, 1, false, "1", &["n"]), true),
            (msg(new, 2, false, "2", &["n"]), false),
        ],
    ];
    let client = pool.get().await.expect("client");
    for asked in groups {
        let rows: Vec<warren::domain::mapping::Row> = asked
            .iter()
            .map(|(msg, _)| m.decode(&msg.body()).expect("valid"))
            .collect();
        let refs: Vec<&warren::domain::mapping::Row> = rows.iter().collect();
        let settled = m.settled(&client, &refs).await.expect("settled");
        assert_eq!(settled.len(), asked.len());
        for ((msg, expected), got) in asked.iter().zip(&settled) {
            assert_eq!(got, expected, "{msg:?}: all {settled:?}");
        }
    }
    assert_eq!(
        stored(&env, held).await,
        Some(("10".into(), 2, vec!["a".into()]))
    );
    assert_eq!(stored(&env, deleted).await, None);
    assert_eq!(tombstone(&env, deleted).await, Some(3));
    assert_eq!(stored(&env, new).await, None, "nothing was written");
}

/// Review R39-F10: an `update` pipeline on a partitioned table stored nothing: the upsert's
/// fast path returns `xmax`, which an insert into a partitioned table cannot (`0A000`, taken for
/// a transient error: retries, the breaker, the DLQ). Such a table goes through the probe: the
/// highest version wins with its items, an older one is stale, and the breaker's probe (an
/// empty batch) answers.
#[tokio::test(flavor = "multi_thread")]
async fn an_update_pipeline_on_a_partitioned_table_keeps_the_highest_version() {
    let env = TestEnv::new("ver_parted").await;
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid NOT NULL, total numeric NOT NULL,
                 version int8 NOT NULL, PRIMARY KEY (order_id)) PARTITION BY HASH (order_id);
             CREATE TABLE orders_0 PARTITION OF orders FOR VALUES WITH (MODULUS 2, REMAINDER 0);
             CREATE TABLE orders_1 PARTITION OF orders FOR VALUES WITH (MODULUS 2, REMAINDER 1);
             CREATE TABLE order_items (order_id uuid NOT NULL, line int4 NOT NULL,
                 sku text NOT NULL, PRIMARY KEY (order_id, line))",
        )
        .await
        .expect("the partitioned table");
    let pool = pool(&env).await;
    for children in [false, true] {
        let m = mapping(false, children);
        let client = pool.get().await.expect("client");
        m.insert(&client, &[]).await.expect("the breaker's probe");
        drop(client);
        let key = Uuid::new_v4();
        let msg = |version: i64, total: &str, items: &[&str]| Msg {
            key,
            version,
            delete: false,
            total: total.into(),
            items: items.iter().map(|s| s.to_string()).collect(),
        };
        let done = insert(
            &m,
            &pool,
            &[msg(1, "1", &["a"]).body(), msg(2, "2", &["b", "c"]).body()],
        )
        .await
        .expect("stored");
        assert_eq!(
            (done.rows, done.stale.len()),
            (1, 1),
            "{children}: {done:?}"
        );
        let items: Vec<String> = if children {
            vec!["b".into(), "c".into()]
        } else {
            Vec::new()
        };
        assert_eq!(
            stored(&env, key).await,
            Some(("2".into(), 2, items.clone()))
        );
        let older = insert(&m, &pool, &[msg(1, "1", &["a"]).body()])
            .await
            .expect("stale");
        assert_eq!(older.stale.len(), 1, "{children}: {older:?}");
        let newer = insert(&m, &pool, &[msg(3, "3", &["d"]).body()])
            .await
            .expect("stored");
        assert_eq!(newer.rows, 1, "{children}: {newer:?}");
        let items: Vec<String> = if children {
            vec!["d".into()]
        } else {
            Vec::new()
        };
        assert_eq!(stored(&env, key).await, Some(("3".into(), 3, items)));
    }
}

/// A delete, told step by step: the row and its items go and a tombstone keeps the version; an
/// older write is stale and brings nothing back, one of the same version `id_conflict`; a
/// redelivered delete is a copy; a delete of a key never stored leaves its tombstone, which an
/// older write never gets past and a newer one replaces; a write, a delete and an older write of
/// one key in one batch end deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_holds_against_older_writes_and_is_idempotent() {
    let env = TestEnv::new("ver_delete").await;
    tables(&env).await;
    let m = mapping(true, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let write = |key: Uuid, version: i64, total: &str, items: &[&str]| Msg {
        key,
        version,
        delete: false,
        total: total.into(),
        items: items.iter().map(|s| s.to_string()).collect(),
    };
    let delete = |key: Uuid, version: i64| Msg {
        key,
        version,
        delete: true,
        total: String::new(),
        items: Vec::new(),
    };
    let run = |msgs: Vec<Msg>| {
        let (m, pool) = (&m, &pool);
        async move {
            let bodies: Vec<Vec<u8>> = msgs.iter().map(Msg::body).collect();
            insert(m, pool, &bodies).await.expect("insert")
        }
    };
    let a = Uuid::new_v4();
    let done = run(vec![write(a, 2, "20", &["x", "y"])]).await;
    assert_eq!(done.rows, 1);
    let done = run(vec![delete(a, 3)]).await;
    assert_eq!((done.rows, done.deleted.clone()), (0, vec![0]), "{done:?}");
    assert_eq!(stored(&env, a).await, None);
    assert_eq!(items_of(&env, a).await, 0);
    assert_eq!(tombstone(&env, a).await, Some(3));
    // The older write again (a redelivery): stale, the row stays gone.
    let done = run(vec![write(a, 2, "20", &["x", "y"])]).await;
    assert_eq!(done.stale.len(), 1, "{done:?}");
    assert!(
        done.stale[0]
            .1
            .contains("version 2 is older than the version 3 it was deleted under"),
        "{done:?}"
    );
    assert_eq!(stored(&env, a).await, None);
    // A write of the delete's version: two states under one version.
    let done = run(vec![write(a, 3, "30", &[])]).await;
    assert_eq!(done.conflicts.len(), 1, "{done:?}");
    assert!(
        done.conflicts[0].1.contains("was deleted under version 3"),
        "{done:?}"
    );
    // The delete again: a copy, nothing changes.
    let done = run(vec![delete(a, 3)]).await;
    assert_eq!(done.deleted, [0], "{done:?}");
    assert!(done.stale.is_empty() && done.conflicts.is_empty());
    assert_eq!(tombstone(&env, a).await, Some(3));
    // A newer write brings the key back and removes its tombstone.
    let done = run(vec![write(a, 4, "40", &["z"])]).await;
    assert_eq!(done.rows, 1, "{done:?}");
    assert_eq!(
        stored(&env, a).await,
        Some(("40".into(), 4, vec!["z".into()]))
    );
    assert_eq!(tombstone(&env, a).await, None);
    // A delete of the stored version: two states under one version; an older delete: stale.
    let done = run(vec![delete(a, 4), delete(a, 1)]).await;
    assert_eq!(done.conflicts.len(), 1, "{done:?}");
    assert_eq!(done.conflicts[0].0, 0);
    assert_eq!(done.stale.len(), 1, "{done:?}");
    assert_eq!(done.stale[0].0, 1);
    assert_eq!(
        stored(&env, a).await,
        Some(("40".into(), 4, vec!["z".into()]))
    );

    // A key never stored: its delete leaves a tombstone; an older write is stale.
    let b = Uuid::new_v4();
    let done = run(vec![delete(b, 5)]).await;
    assert_eq!(done.deleted, [0], "{done:?}");
    assert_eq!(tombstone(&env, b).await, Some(5));
    let done = run(vec![write(b, 4, "1", &["q"])]).await;
    assert_eq!(done.stale.len(), 1, "{done:?}");
    assert_eq!(stored(&env, b).await, None);
    assert_eq!(items_of(&env, b).await, 0);

    // One batch: a write, a delete, an older write of one key, and a newer write of another.
    let c = Uuid::new_v4();
    let done = run(vec![
        write(c, 7, "70", &["r"]),
        delete(c, 8),
        write(c, 6, "60", &[]),
        write(b, 6, "6", &["s"]),
    ])
    .await;
    assert_eq!(done.deleted, [1], "{done:?}");
    let stale: Vec<usize> = done.stale.iter().map(|(i, _)| *i).collect();
    assert_eq!(stale, [0, 2], "{done:?}");
    assert_eq!(done.rows, 1, "{done:?}");
    assert_eq!(stored(&env, c).await, None);
    assert_eq!(tombstone(&env, c).await, Some(8));
    assert_eq!(
        stored(&env, b).await,
        Some(("6".into(), 6, vec!["s".into()]))
    );
    assert_eq!(tombstone(&env, b).await, None);
}

/// A delete needs only its key and version: a missing version is refused naming it; a message
/// whose `/op` holds another value is a write.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_reads_only_its_key_and_version() {
    let m = mapping(true, true);
    let id = Uuid::new_v4();
    let refused = m
        .decode(format!(r#"{{"op":"delete","order_id":"{id}"}}"#).as_bytes())
        .expect_err("no version");
    assert!(
        refused.reason.contains("/version: missing") && refused.reason.contains("(a delete)"),
        "{}",
        refused.reason
    );
    let row = m
        .decode(format!(r#"{{"op":"delete","order_id":"{id}","version":2}}"#).as_bytes())
        .expect("a delete");
    assert_eq!(row.2, warren::domain::mapping::Op::Delete);
    let refused = m
        .decode(format!(r#"{{"op":"Delete","order_id":"{id}","version":2}}"#).as_bytes())
        .expect_err("a write without a total");
    assert!(
        refused.reason.contains("/total: missing"),
        "{}",
        refused.reason
    );
}

/// The pipeline with deletes through the broker: `warren declare` makes the tombstone table (and
/// `run` refuses to start without it); an older version is acked as stale (counted with the
/// pipeline's label and evented, not inserted), the same version with other items is parked
/// once as `id_conflict` (counted with the pipeline's label), a delete is counted as deleted and
/// removes the order and its items.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_pipeline_counts_and_tells_stale_conflicts_and_deletes() {
    let env = TestEnv::new("ver_pipeline").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    let _redis = RedisCleanup::new(&env);
    tables(&env).await;
    let config = format!(
        "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"order_id\"]\n\
         on_conflict = \"update\"\nversion_column = \"version\"\nunknown_fields = \"ignore\"\n\
         delete = {{ field = \"/op\", value = \"delete\" }}\n\
         batch_size = 100\nretry_ttls_ms = [1000]\n{}\n{}{}",
        names.toml(),
        PARENT.replace("[columns]", "[pipelines.columns]"),
        CHILDREN
            .replace("[[children]]", "[[pipelines.children]]")
            .replace("[children.columns]", "[pipelines.children.columns]")
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.toml");
    std::fs::write(&path, config).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    // Before declare, the tombstone table is missing: the start is refused, naming it.
    let (code, out, err) = env
        .run_async(&["--config", &file, "run", "--roles", "consumer"])
        .await;
    assert_eq!(code, 2, "run before declare:\n{out}{err}");
    assert!(
        err.contains("the tombstone table tombstones_orders does not exist"),
        "{err}"
    );
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("table tombstones_orders ") && l.ends_with(" created")),
        "{out}"
    );
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let props = |id: &str| {
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id.into())
    };
    let publish = |body: Vec<u8>, id: &'static str| {
        let (env, names) = (&env, &names);
        async move {
            env.publish_to(&names.exchange, &names.queue, &body, props(id))
                .await
        }
    };
    let a = Uuid::new_v4();
    let msg = |version: i64, items: &[&str]| Msg {
        key: a,
        version,
        delete: false,
        total: "5".into(),
        items: items.iter().map(|s| s.to_string()).collect(),
    };
    publish(msg(2, &["x"]).body(), "v2").await;
    wait_until("version 2", Duration::from_secs(30), || async {
        stored(&env, a).await.is_some()
    })
    .await;
    publish(msg(1, &["old"]).body(), "v1-stale").await;
    publish(msg(2, &["other"]).body(), "v2-conflict").await;
    wait_scrape(
        &env,
        &warren,
        "one stale and one id_conflict parked, both of orders",
        Duration::from_secs(60),
        |s| {
            s.sum(
                "warren_messages_outcomes_total",
                &[("pipeline", "orders"), ("outcome", "stale")],
            ) == 1.0
                && s.sum(
                    "warren_messages_parked_total",
                    &[("pipeline", "orders"), ("kind", "id_conflict")],
                ) == 1.0
        },
    )
    .await;
    let mut delete = msg(3, &[]);
    delete.delete = true;
    publish(delete.body(), "v3-delete").await;
    wait_until("the order deleted", Duration::from_secs(30), || async {
        stored(&env, a).await.is_none()
    })
    .await;
    assert_eq!(items_of(&env, a).await, 0);
    assert_eq!(tombstone(&env, a).await, Some(3));
    let s = wait_scrape(
        &env,
        &warren,
        "one delete counted",
        Duration::from_secs(30),
        |s| {
            s.sum(
                "warren_messages_outcomes_total",
                &[("pipeline", "orders"), ("outcome", "deleted")],
            ) == 1.0
        },
    )
    .await;
    assert_eq!(
        s.sum(
            "warren_messages_inserted_total",
            &[("pipeline", "orders"), ("stage", "main")]
        ),
        1.0,
        "only version 2 is inserted"
    );
    assert_eq!(
        count_of(
            &env,
            "SELECT count(*) FROM dead_letters WHERE pipeline = 'orders' \
             AND error_kind = 'id_conflict'"
        )
        .await,
        1
    );
    let events = stream_events(&env).await;
    let stale: Vec<&serde_json::Value> = events.iter().filter(|e| e["type"] == "stale").collect();
    assert_eq!(stale.len(), 1, "{events:#?}");
    assert_eq!(stale[0]["message_id"], "v1-stale");
    assert_eq!(stale[0]["pipeline"], "orders");
    assert!(
        stale[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("version 1 is older than the stored version 2")),
        "{stale:?}"
    );
    let committed: BTreeMap<&str, u64> = events
        .iter()
        .filter(|e| e["type"] == "batch_committed")
        .flat_map(|e| {
            ["stale", "deleted"]
                .into_iter()
                .map(move |k| (k, e[k].as_u64().unwrap_or(0)))
        })
        .fold(BTreeMap::new(), |mut m, (k, v)| {
            *m.entry(k).or_default() += v;
            m
        });
    assert_eq!(
        (committed.get("stale"), committed.get("deleted")),
        (Some(&1), Some(&1)),
        "{events:#?}"
    );
}

/// A key column under a nondeterministic collation (case-insensitive ICU, `und-u-ks-level2`) or
/// `citext`: the table's unique index, the column's `=`, the advisory lock's hash and the
/// tombstone (typed as the column) all take `ABC` and `abc` as one key, so a delete of `abc`
/// removes the row `ABC`, holds against an older `Abc`, and a write of `ABC` and a delete of
/// `abc` in two concurrent batches take turns (each round ends as the higher version says:
/// no row and a tombstone, never both a row and a newer tombstone).
#[tokio::test(flavor = "multi_thread")]
async fn a_key_equal_under_its_collation_is_one_key_to_writes_deletes_and_locks() {
    let env = TestEnv::new("ver_collation").await;
    env.db
        .batch_execute(
            "CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', \
               deterministic = false);
             CREATE EXTENSION IF NOT EXISTS citext SCHEMA public;
             CREATE TABLE ci_orders (k text COLLATE ci PRIMARY KEY, total numeric NOT NULL, \
               version int8 NOT NULL);",
        )
        .await
        .expect("create the table");
    // What the lock relies on: PostgreSQL hashes a key as its collation (or citext) compares it.
    let same: bool = env
        .db
        .query_one(
            "SELECT hash_array(ARRAY['ABC' COLLATE ci]) = hash_array(ARRAY['abc' COLLATE ci]) \
               AND hash_array(ARRAY['ABC'::public.citext]) \
                 = hash_array(ARRAY['abc'::public.citext])",
            &[],
        )
        .await
        .expect("hash")
        .get(0);
    assert!(same, "keys equal under their collation hash alike");
    let spec: MappingSpec = toml::from_str(
        "table = \"ci_orders\"\nkey = [\"k\"]\non_conflict = \"update\"\n\
         version_column = \"version\"\nunknown_fields = \"ignore\"\n\
         delete = { field = \"/op\", value = \"delete\" }\n\
         [columns]\nk = { path = \"/k\", type = \"text\" }\n\
         total = { path = \"/total\", type = \"numeric\" }\n\
         version = { path = \"/version\", type = \"int8\" }\n",
    )
    .expect("spec");
    let m = Mapping::compile("ci_orders", &spec).expect("compiles");
    m.declare_tombstones(&env.db).await.expect("declare");
    let problems = warren::domain::mapping::schema::check(&m, &env.db)
        .await
        .expect("check");
    assert!(problems.is_empty(), "{problems:?}");
    let pool = pool(&env).await;
    let write =
        |k: &str, v: i64| format!(r#"{{"k":"{k}","total":"1","version":{v}}}"#).into_bytes();
    let delete =
        |k: &str, v: i64| format!(r#"{{"op":"delete","k":"{k}","version":{v}}}"#).into_bytes();
    let rows = |sql: &'static str| {
        let db = &env.db;
        async move { db.query_one(sql, &[]).await.expect(sql).get::<_, i64>(0) }
    };

    let done = insert(&m, &pool, &[write("ABC", 1)]).await.expect("write");
    assert_eq!(done.rows, 1);
    let done = insert(&m, &pool, &[delete("abc", 2)])
        .await
        .expect("delete");
    assert_eq!(done.deleted, vec![0], "{done:?}");
    assert_eq!(rows("SELECT count(*) FROM ci_orders").await, 0);
    assert_eq!(rows("SELECT count(*) FROM tombstones_ci_orders").await, 1);
    let done = insert(&m, &pool, &[write("Abc", 1)])
        .await
        .expect("older write");
    assert_eq!(done.stale.len(), 1, "{done:?}");
    assert_eq!(rows("SELECT count(*) FROM ci_orders").await, 0);
    // In one batch, the two spellings are one key: the highest version wins.
    let done = insert(&m, &pool, &[write("aBc", 4), delete("ABC", 3)])
        .await
        .expect("one batch");
    assert_eq!((done.rows, done.stale.len()), (1, 1), "{done:?}");
    assert_eq!(rows("SELECT count(*) FROM tombstones_ci_orders").await, 0);

    // Two batches at once, a write of one spelling and a newer delete of another, many rounds.
    for round in 0..60 {
        let upper = format!("KEY-{round}");
        let lower = upper.to_lowercase();
        let (w, d) = ([write(&upper, 1)], [delete(&lower, 2)]);
        let (a, b) = tokio::join!(insert(&m, &pool, &w), insert(&m, &pool, &d));
        a.expect("the write");
        b.expect("the delete");
        let row = env
            .db
            .query_one(
                "SELECT (SELECT count(*) FROM ci_orders WHERE k = $1), \
                   (SELECT max(version) FROM tombstones_ci_orders WHERE k = $1)",
                &[&upper],
            )
            .await
            .expect("the round's end");
        let (stored, tomb): (i64, Option<i64>) = (row.get(0), row.get(1));
        assert_eq!(
            (stored, tomb),
            (0, Some(2)),
            "round {round}: the delete (version 2) is the key's last word"
        );
    }
}

/// A unique index on the key that compares under another collation than the column's
/// (`CREATE UNIQUE INDEX ON t (k COLLATE ci)` on a column of the default collation): `ON
/// CONFLICT` would take `ABC` and `abc` as one key while the probe, the lock and the tombstone
/// take them as two; `declare` and the start of `run` refuse it, naming the pipeline, the
/// table, the column and the index (exit 2).
#[tokio::test(flavor = "multi_thread")]
async fn a_key_index_under_another_collation_than_its_column_is_refused() {
    let env = TestEnv::new("ver_coll_idx").await;
    let names = PipelineNames::of(&env, "ci_orders");
    let _cleanup = names.cleanup();
    env.db
        .batch_execute(
            "CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', \
               deterministic = false);
             CREATE TABLE ci_orders (k text NOT NULL, total numeric NOT NULL, \
               version int8 NOT NULL);
             CREATE UNIQUE INDEX ci_orders_k ON ci_orders (k COLLATE ci);",
        )
        .await
        .expect("create the table");
    let file = ConfigFile::new(&format!(
        "[[pipelines]]\nname = \"ci_orders\"\ntable = \"ci_orders\"\nkey = [\"k\"]\n\
         on_conflict = \"update\"\nversion_column = \"version\"\n\
         delete = {{ field = \"/op\", value = \"delete\" }}\nretry_ttls_ms = [1000]\n{}\n\
         [pipelines.columns]\nk = {{ path = \"/k\", type = \"text\" }}\n\
         total = {{ path = \"/total\", type = \"numeric\" }}\n\
         version = {{ path = \"/version\", type = \"int8\" }}\n",
        names.toml()
    ));
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "declare:\n{out}{err}");
    assert!(
        err.contains(
            "pipeline ci_orders: table ci_orders: column k: the key's unique index ci_orders_k \
             compares it under the collation \"ci\", the column under \"default\""
        ),
        "{err}"
    );
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "run",
            "--pipelines",
            "ci_orders",
            "--roles",
            "consumer",
        ])
        .await;
    assert_eq!(code, 2, "run:\n{out}{err}");
    assert!(err.contains("the key's unique index ci_orders_k"), "{err}");
    // The column given the index's collation: the table is taken, but the tombstone table the
    // first declare made keys by the old collation, and is named until it is made again.
    env.db
        .batch_execute("ALTER TABLE ci_orders ALTER COLUMN k TYPE text COLLATE ci")
        .await
        .expect("alter");
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 2, "declare:\n{out}{err}");
    assert!(
        err.contains(
            "the tombstone table tombstones_ci_orders types or collates the key column k \
             otherwise than the table ci_orders"
        ),
        "{err}"
    );
    env.db
        .batch_execute("DROP TABLE tombstones_ci_orders")
        .await
        .expect("drop the tombstones");
    let (code, out, err) = env.run_async(&["--config", file.at(), "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
}

/// Review R40b F13: a reason named the version as the message wrote it, though the table
/// compares it as its column types it: a `numeric(6,2)` version `1.005` is `1.01`, the stored
/// row's version, and the conflict said "under version 1.005". Now it names `1.01`.
#[tokio::test(flavor = "multi_thread")]
async fn a_reason_names_the_version_as_the_table_types_it() {
    let env = TestEnv::new("ver_typed").await;
    env.db
        .batch_execute(
            "CREATE TABLE docs (k text PRIMARY KEY, v numeric(6,2) NOT NULL, body text NOT NULL)",
        )
        .await
        .expect("create docs");
    let spec: MappingSpec = toml::from_str(
        r#"
table = "docs"
key = ["k"]
on_conflict = "update"
version_column = "v"

[columns]
k    = { path = "/k", type = "text" }
v    = { path = "/v", type = "numeric" }
body = { path = "/body", type = "text" }
"#,
    )
    .expect("spec");
    let m = Mapping::compile("docs", &spec).expect("compiles");
    let pool = pool(&env).await;
    let doc = |v: &str, body: &str| format!(r#"{{"k":"a","v":{v},"body":"{body}"}}"#).into_bytes();
    let done = insert_bodies(&m, &pool, &[doc("1.01", "one")])
        .await
        .expect("insert");
    assert_eq!(done.rows, 1, "{done:?}");
    let done = insert_bodies(&m, &pool, &[doc("1.005", "other"), doc("0.999", "older")])
        .await
        .expect("insert");
    assert_eq!(done.conflicts.len(), 1, "{done:?}");
    assert!(
        done.conflicts[0].1.contains("under version 1.01 ")
            && !done.conflicts[0].1.contains("1.005"),
        "{done:?}"
    );
    assert_eq!(done.stale.len(), 1, "{done:?}");
    assert!(
        done.stale[0]
            .1
            .contains("version 1.00 is older than the stored version 1.01"),
        "{done:?}"
    );
}

/// Review R41b F5: a BEFORE UPDATE trigger that keeps a mapped column as it was (the usual
/// "preserve created_at") makes the row a newer version wrote other than the row its insert
/// would write: the redelivery of that version was compared with the insert's row and parked
/// `id_conflict` beside itself, stored and parked. A copy is now also compared with what an
/// update of the stored row by it writes; other content is still `id_conflict`.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_of_a_version_a_before_update_trigger_shaped_is_a_copy() {
    let env = TestEnv::new("ver_keep_created").await;
    env.db
        .batch_execute(
            "CREATE TABLE notes (id text PRIMARY KEY, v int8 NOT NULL, created text NOT NULL, \
               note text);
             CREATE FUNCTION keep_created() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN NEW.created := OLD.created; RETURN NEW; END $$;
             CREATE TRIGGER keep_created BEFORE UPDATE ON notes \
               FOR EACH ROW EXECUTE FUNCTION keep_created()",
        )
        .await
        .expect("the table and its trigger");
    let spec: MappingSpec = toml::from_str(
        r#"
table = "notes"
key = ["id"]
on_conflict = "update"
version_column = "v"

[columns]
id      = { path = "/id", type = "text" }
v       = { path = "/v", type = "int8" }
created = { path = "/created", type = "text" }
note    = { path = "/note", type = "text" }
"#,
    )
    .expect("spec");
    let m = Mapping::compile("notes", &spec).expect("compiles");
    let pool = pool(&env).await;
    let note = |v: i64, created: &str, text: &str| {
        format!(r#"{{"id":"u1","v":{v},"created":"{created}","note":"{text}"}}"#).into_bytes()
    };
    for (body, rows) in [(note(1, "2020", "a"), 1), (note(2, "2021", "b"), 1)] {
        let done = insert_bodies(&m, &pool, &[body]).await.expect("insert");
        assert_eq!(done.rows, rows, "{done:?}");
    }
    let row = env
        .db
        .query_one("SELECT v, created, note FROM notes WHERE id = 'u1'", &[])
        .await
        .expect("the row");
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2)
        ),
        (2, "2020".to_string(), "b".to_string()),
        "the trigger kept created"
    );
    // Its redelivery, and the first version's: a copy and a stale one, nothing parked.
    let done = insert_bodies(&m, &pool, &[note(2, "2021", "b"), note(1, "2020", "a")])
        .await
        .expect("insert");
    assert!(
        done.conflicts.is_empty() && done.refused.is_empty(),
        "{done:?}"
    );
    assert_eq!(done.stale.len(), 1, "{done:?}");
    // The same version with another note is two states under one version.
    let done = insert_bodies(&m, &pool, &[note(2, "2021", "c")])
        .await
        .expect("insert");
    assert_eq!(done.conflicts.len(), 1, "{done:?}");
    assert!(
        done.conflicts[0].1.contains("under version 2 with another")
            && done.conflicts[0].1.contains("note"),
        "{done:?}"
    );
}

/// Review R41b F7, F8: a BEFORE DELETE trigger that discards deletes (returns NULL: a "never
/// delete shipped lines" guard on the items, a "never delete paid orders" guard on the
/// orders) made warren's deletes silently partial: a newer version was stored with the old
/// version's surviving items beside its own, a delete left its items or its row behind a
/// tombstone (counted `deleted`). A message some of whose rows a trigger keeps is refused as a
/// whole (`db_permanent`, the reason naming the table and how many rows were kept, nothing of
/// it written, alone or in a batch beside a good message), as one whose rows a trigger
/// discards on insert.
#[tokio::test(flavor = "multi_thread")]
async fn a_trigger_that_keeps_rows_warren_deletes_refuses_the_whole_message() {
    let env = TestEnv::new("ver_keep_deleted").await;
    tables(&env).await;
    env.db
        .batch_execute(
            "CREATE FUNCTION keep_shipped() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF OLD.sku = 'SHIPPED' THEN RETURN NULL; END IF; RETURN OLD; END $$;
             CREATE TRIGGER keep_shipped BEFORE DELETE ON order_items \
               FOR EACH ROW EXECUTE FUNCTION keep_shipped();
             CREATE FUNCTION keep_paid() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF OLD.total = 99 THEN RETURN NULL; END IF; RETURN OLD; END $$;
             CREATE TRIGGER keep_paid BEFORE DELETE ON orders \
               FOR EACH ROW EXECUTE FUNCTION keep_paid()",
        )
        .await
        .expect("the guards");
    let m = mapping(true, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let msg = |key: Uuid, version: i64, delete: bool, total: &str, items: &[&str]| Msg {
        key,
        version,
        delete,
        total: total.into(),
        items: items.iter().map(|s| s.to_string()).collect(),
    };
    let (shipped, paid, good) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // The shipped line is the second: a newer version's one line does not collide with it.
    let first = [
        msg(shipped, 1, false, "10", &["x", "SHIPPED"]),
        msg(paid, 1, false, "99", &["z"]),
        msg(good, 1, false, "5", &["g"]),
    ];
    let bodies: Vec<Vec<u8>> = first.iter().map(Msg::body).collect();
    let done = insert(&m, &pool, &bodies)
        .await
        .expect("the first versions");
    assert_eq!(done.rows, 3, "{done:?}");
    let cases = [
        (
            "a newer version of an order with a shipped line",
            msg(shipped, 2, false, "11", &["y"]),
            "order_items kept 1 of the",
        ),
        (
            "a delete of an order with a shipped line",
            msg(shipped, 3, true, "", &[]),
            "order_items kept 1 of the",
        ),
        (
            "a delete of a paid order",
            msg(paid, 2, true, "", &[]),
            "orders kept 1 of the",
        ),
    ];
    for (what, bad, words) in cases {
        for batch in [
            vec![bad.body()],
            vec![msg(good, 9, false, "6", &["h"]).body(), bad.body()],
        ] {
            match insert(&m, &pool, &batch).await {
                Err(e) => {
                    assert_eq!(e.class(), warren::db::ErrorClass::Permanent, "{what}: {e}");
                    assert!(e.to_string().contains(words), "{what}: {e}");
                }
                Ok(done) => panic!("{what}: done, though a trigger kept rows: {done:?}"),
            }
        }
    }
    // Nothing of any refused message written, nor of the good one beside them.
    assert_eq!(
        stored(&env, shipped).await,
        Some(("10".into(), 1, vec!["x".into(), "SHIPPED".into()]))
    );
    assert_eq!(
        stored(&env, paid).await,
        Some(("99".into(), 1, vec!["z".into()]))
    );
    assert_eq!(
        stored(&env, good).await,
        Some(("5".into(), 1, vec!["g".into()]))
    );
    for key in [shipped, paid, good] {
        assert_eq!(
            tombstone(&env, key).await,
            None,
            "a tombstone beside a live row"
        );
    }
    // A delete of an order whose rows the guards let go is done, items and all.
    let done = insert(&m, &pool, &[msg(good, 2, true, "", &[]).body()])
        .await
        .expect("the good delete");
    assert_eq!(done.deleted, vec![0], "{done:?}");
    assert_eq!(stored(&env, good).await, None);
    assert_eq!(items_of(&env, good).await, 0);
    assert_eq!(tombstone(&env, good).await, Some(2));
}

/// Review R42a F4, F5: delete guards of two more shapes. An AFTER DELETE trigger that puts the
/// row back (`INSERT ... VALUES (OLD.*)`) deletes every row and keeps them all: the message is
/// refused whole, as for a BEFORE DELETE guard (on the old code a newer version was stored
/// beside the old version's restored line, a delete left its order beside its tombstone). A
/// statement-level BEFORE DELETE trigger that raises fires on a delete of no rows too: a batch
/// with nothing to delete runs no delete (on the old code every batch was refused, new orders
/// included), and one with rows to delete is refused by it.
#[tokio::test(flavor = "multi_thread")]
async fn delete_guards_that_put_rows_back_or_fire_per_statement_are_seen() {
    let env = TestEnv::new("ver_put_back").await;
    tables(&env).await;
    env.db
        .batch_execute(
            "CREATE FUNCTION put_shipped_back() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF OLD.sku = 'SHIPPED' THEN INSERT INTO order_items VALUES (OLD.*); \
                 END IF; RETURN NULL; END $$;
             CREATE TRIGGER put_shipped_back AFTER DELETE ON order_items \
               FOR EACH ROW EXECUTE FUNCTION put_shipped_back();
             CREATE FUNCTION put_paid_back() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF OLD.total = 99 THEN INSERT INTO orders VALUES (OLD.*); END IF; \
                 RETURN NULL; END $$;
             CREATE TRIGGER put_paid_back AFTER DELETE ON orders \
               FOR EACH ROW EXECUTE FUNCTION put_paid_back()",
        )
        .await
        .expect("the guards");
    let m = mapping(true, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let msg = |key: Uuid, version: i64, delete: bool, total: &str, items: &[&str]| Msg {
        key,
        version,
        delete,
        total: total.into(),
        items: items.iter().map(|s| s.to_string()).collect(),
    };
    let (shipped, paid, good) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let first = [
        msg(shipped, 1, false, "10", &["x", "SHIPPED"]),
        msg(paid, 1, false, "99", &["z"]),
        msg(good, 1, false, "5", &["g"]),
    ];
    let bodies: Vec<Vec<u8>> = first.iter().map(Msg::body).collect();
    let done = insert(&m, &pool, &bodies)
        .await
        .expect("the first versions");
    assert_eq!(done.rows, 3, "{done:?}");
    let cases = [
        (
            "a newer version of an order with a shipped line",
            msg(shipped, 2, false, "11", &["y"]),
            "order_items kept 1 of the",
        ),
        (
            "a delete of an order with a shipped line",
            msg(shipped, 3, true, "", &[]),
            "order_items kept 1 of the",
        ),
        (
            "a delete of a paid order",
            msg(paid, 2, true, "", &[]),
            "orders kept 1 of the",
        ),
    ];
    for (what, bad, words) in cases {
        for batch in [
            vec![bad.body()],
            vec![msg(good, 9, false, "6", &["h"]).body(), bad.body()],
        ] {
            match insert(&m, &pool, &batch).await {
                Err(e) => {
                    assert_eq!(e.class(), warren::db::ErrorClass::Permanent, "{what}: {e}");
                    assert!(e.to_string().contains(words), "{what}: {e}");
                }
                Ok(done) => panic!("{what}: done, though a trigger put rows back: {done:?}"),
            }
        }
    }
    assert_eq!(
        stored(&env, shipped).await,
        Some(("10".into(), 1, vec!["x".into(), "SHIPPED".into()]))
    );
    assert_eq!(
        stored(&env, paid).await,
        Some(("99".into(), 1, vec!["z".into()]))
    );
    assert_eq!(
        stored(&env, good).await,
        Some(("5".into(), 1, vec!["g".into()]))
    );
    for key in [shipped, paid, good] {
        assert_eq!(
            tombstone(&env, key).await,
            None,
            "a tombstone beside a live row"
        );
    }

    // A statement-level guard that raises: it fires for any delete statement, also of no rows.
    env.db
        .batch_execute(
            "DROP TRIGGER put_shipped_back ON order_items;
             DROP TRIGGER put_paid_back ON orders;
             CREATE FUNCTION no_deletes() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN RAISE EXCEPTION 'deletes are closed'; END $$;
             CREATE TRIGGER no_item_deletes BEFORE DELETE ON order_items \
               FOR EACH STATEMENT EXECUTE FUNCTION no_deletes();
             CREATE TRIGGER no_order_deletes BEFORE DELETE ON orders \
               FOR EACH STATEMENT EXECUTE FUNCTION no_deletes()",
        )
        .await
        .expect("the statement guards");
    let fresh: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let bodies: Vec<Vec<u8>> = fresh
        .iter()
        .map(|&k| msg(k, 1, false, "1", &["a", "b"]).body())
        .collect();
    let done = insert(&m, &pool, &bodies)
        .await
        .expect("new orders: nothing to delete, no delete run");
    assert_eq!(done.rows, 5, "{done:?}");
    for &k in &fresh {
        assert_eq!(
            stored(&env, k).await,
            Some(("1".into(), 1, vec!["a".into(), "b".into()]))
        );
    }
    for (what, bad) in [
        ("a newer version", msg(good, 2, false, "7", &["i"])),
        ("a delete", msg(good, 2, true, "", &[])),
    ] {
        let e = insert(&m, &pool, &[bad.body()])
            .await
            .expect_err("the guard refuses a delete of stored rows");
        assert!(e.to_string().contains("deletes are closed"), "{what}: {e}");
    }
    assert_eq!(
        stored(&env, good).await,
        Some(("5".into(), 1, vec!["g".into()]))
    );
}

/// Review R41b F2: with `update` and a BEFORE INSERT trigger that folds the key
/// (`lower(email)`), a message whose key as sent holds nothing was taken for a discarded one
/// when it was not written: an older version, or the same version with other content, was
/// parked `db_permanent` ("a BEFORE trigger ... discarded it"). They are `stale` and
/// `id_conflict`, as for any key, found under the key the insert lands on; a copy is a copy and
/// a newer version is written.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_a_trigger_folds_is_stale_or_conflicting_under_the_folded_key() {
    let env = TestEnv::new("ver_folded").await;
    env.db
        .batch_execute(
            "CREATE TABLE people (email text PRIMARY KEY, v int8 NOT NULL, name text NOT NULL);
             CREATE FUNCTION fold_email() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN NEW.email := lower(NEW.email); RETURN NEW; END $$;
             CREATE TRIGGER fold_email BEFORE INSERT ON people \
               FOR EACH ROW EXECUTE FUNCTION fold_email()",
        )
        .await
        .expect("the table and its trigger");
    let spec: MappingSpec = toml::from_str(
        r#"
table = "people"
key = ["email"]
on_conflict = "update"
version_column = "v"

[columns]
email = { path = "/email", type = "text" }
v     = { path = "/v", type = "int8" }
name  = { path = "/name", type = "text" }
"#,
    )
    .expect("spec");
    let m = Mapping::compile("people", &spec).expect("compiles");
    let pool = pool(&env).await;
    let person = |v: i64, name: &str| {
        format!(r#"{{"email":"Ann@X.org","v":{v},"name":"{name}"}}"#).into_bytes()
    };
    let done = insert_bodies(&m, &pool, &[person(2, "Ann")])
        .await
        .expect("insert");
    assert_eq!(done.rows, 1, "{done:?}");
    let done = insert_bodies(
        &m,
        &pool,
        &[person(1, "Old"), person(2, "Other"), person(2, "Ann")],
    )
    .await
    .expect("insert");
    assert!(done.refused.is_empty(), "{done:?}");
    let stale: Vec<usize> = done.stale.iter().map(|(i, _)| *i).collect();
    let conflicts: Vec<usize> = done.conflicts.iter().map(|(i, _)| *i).collect();
    assert_eq!((stale, conflicts), (vec![0], vec![1]), "{done:?}");
    assert!(
        done.stale[0].1.contains("older than the stored version 2"),
        "{done:?}"
    );
    assert!(
        done.conflicts[0]
            .1
            .contains("already stored under version 2 with other content"),
        "{done:?}"
    );
    let done = insert_bodies(&m, &pool, &[person(3, "Ann B.")])
        .await
        .expect("insert");
    assert_eq!(done.rows, 1, "{done:?}");
    // A newer version beside an older one (the probe's path): written, the older stale.
    let done = insert_bodies(&m, &pool, &[person(4, "Ann C."), person(1, "Old")])
        .await
        .expect("insert");
    assert_eq!(done.rows, 1, "{done:?}");
    assert!(
        done.refused.is_empty() && done.conflicts.is_empty(),
        "{done:?}"
    );
    assert_eq!(done.stale.len(), 1, "{done:?}");
    let done = insert_bodies(&m, &pool, &[person(3, "Ann B.")])
        .await
        .expect("insert");
    assert_eq!(done.stale.len(), 1, "{done:?}");
    let row = env
        .db
        .query_one("SELECT email, v, name FROM people", &[])
        .await
        .expect("one row");
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, String>(2)
        ),
        ("ann@x.org".to_string(), 4, "Ann C.".to_string())
    );
}

/// Review R45 F5, with deletes (every batch through the probe): a DELETE trigger created after
/// the counted delete asked whether any acts on it, and before the delete itself ran (waiting
/// for the lock the trigger's creator held), fires in it; the delete asks again in its own
/// statement, and the rows the trigger put back refuse the message whole. On the old code the
/// newer version was stored beside the shipped line the trigger put back.
#[tokio::test(flavor = "multi_thread")]
async fn a_trigger_created_while_a_counted_delete_waits_for_its_lock_is_counted() {
    let env = TestEnv::new("ver_trigger_window").await;
    tables(&env).await;
    let m = mapping(true, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let key = Uuid::new_v4();
    let body = |version: i64, items: &[&str]| {
        Msg {
            key,
            version,
            delete: false,
            total: "10".into(),
            items: items.iter().map(|s| s.to_string()).collect(),
        }
        .body()
    };
    insert(&m, &pool, &[body(1, &["A", "SHIP"])])
        .await
        .expect("the first version");
    let window = PutBackWindow::open(&env).await;
    let newer = [body(2, &["C"])];
    let (written, ()) = tokio::join!(insert(&m, &pool, &newer), window.close(&env));
    match written {
        Err(e) => {
            assert_eq!(e.class(), warren::db::ErrorClass::Permanent, "{e}");
            assert!(e.to_string().contains("order_items kept 1 of the"), "{e}");
        }
        Ok(done) => panic!("the newer version stored beside the line put back: {done:?}"),
    }
    let skus: Vec<String> = env
        .db
        .query(
            "SELECT sku FROM order_items WHERE order_id = $1 ORDER BY line",
            &[&key],
        )
        .await
        .expect("items")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(skus, ["A", "SHIP"], "the first version's items stay");
}

/// Review R45 F3's fix deletes child rows by the first column of the parent's key (`= ANY`,
/// through the child table's index) and the whole key (a hashed `IN`): with a key of two
/// columns, a newer version and a delete of one order replace and delete its items only, not
/// those of the orders that share its first column, nor of those that share its second.
#[tokio::test(flavor = "multi_thread")]
async fn a_two_column_key_replaces_and_deletes_only_its_own_child_rows() {
    let env = TestEnv::new("versions_two_column_key").await;
    env.db
        .batch_execute(
            "CREATE TABLE orders (region text NOT NULL, order_no int8 NOT NULL, \
               version int8 NOT NULL, PRIMARY KEY (region, order_no));
             CREATE TABLE order_items (region text NOT NULL, order_no int8 NOT NULL, \
               line int4 NOT NULL, sku text NOT NULL, PRIMARY KEY (region, order_no, line), \
               FOREIGN KEY (region, order_no) REFERENCES orders);",
        )
        .await
        .expect("create the tables");
    let spec: MappingSpec = toml::from_str(
        r#"
table = "orders"
key = ["region", "order_no"]
on_conflict = "update"
version_column = "version"
unknown_fields = "ignore"
delete = { field = "/op", value = "delete" }

[columns]
region   = { path = "/region", type = "text" }
order_no = { path = "/order_no", type = "int8" }
version  = { path = "/version", type = "int8" }

[[children]]
table = "order_items"
rows = "/items"
key = ["region", "order_no", "line"]
optional = true

[children.columns]
region   = { parent = "region" }
order_no = { parent = "order_no" }
line     = { index = true }
sku      = { path = "/sku", type = "text" }
"#,
    )
    .expect("spec");
    let m = Mapping::compile("orders", &spec).expect("compiles");
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let write = |region: &str, no: i64, version: i64, skus: &[&str]| {
        let items: Vec<String> = skus.iter().map(|s| format!(r#"{{"sku":"{s}"}}"#)).collect();
        format!(
            r#"{{"region":"{region}","order_no":{no},"version":{version},"items":[{}]}}"#,
            items.join(",")
        )
        .into_bytes()
    };
    let delete = |region: &str, no: i64| {
        format!(r#"{{"op":"delete","region":"{region}","order_no":{no},"version":2}}"#).into_bytes()
    };
    let orders = [
        ("eu", 1),
        ("eu", 2),
        ("eu", 3),
        ("us", 1),
        ("us", 2),
        ("us", 3),
    ];
    let first: Vec<Vec<u8>> = orders
        .iter()
        .map(|(r, n)| write(r, *n, 1, &["A", "B"]))
        .collect();
    insert(&m, &pool, &first).await.expect("the first versions");
    // Through the probe (a batch with a delete), then the fast path (newer versions alone).
    insert(&m, &pool, &[write("eu", 1, 2, &["C"]), delete("eu", 2)])
        .await
        .expect("a newer version and a delete");
    insert(&m, &pool, &[write("us", 2, 2, &["D"])])
        .await
        .expect("a newer version");
    let items: Vec<(String, i64, String)> = env
        .db
        .query(
            "SELECT region, order_no, string_agg(sku, ',' ORDER BY line) FROM order_items \
             GROUP BY region, order_no ORDER BY region, order_no",
            &[],
        )
        .await
        .expect("the items")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let want = |r: &str, n: i64, s: &str| (r.to_string(), n, s.to_string());
    assert_eq!(
        items,
        vec![
            want("eu", 1, "C"),
            want("eu", 3, "A,B"),
            want("us", 1, "A,B"),
            want("us", 2, "D"),
            want("us", 3, "A,B"),
        ]
    );
}

/// Review R46b F1: a rule ON INSERT of any kind (an audit `DO ALSO NOTIFY`) created on the
/// table while warren runs makes `INSERT ... ON CONFLICT` fail (0A000) for every message
/// alike: a systemic error (the pipeline holds its batch, nothing goes to the DLQ), whose reason
/// says which kind of rule to drop. Before, it was transient: every message was retried, then
/// parked `retries_exhausted`.
#[tokio::test(flavor = "multi_thread")]
async fn an_insert_rule_of_any_kind_is_the_tables_condition_not_the_messages() {
    let env = TestEnv::new("versions_rule_kind").await;
    tables(&env).await;
    let m = mapping(false, true);
    m.declare_tombstones(&env.db).await.expect("declare");
    let pool = pool(&env).await;
    let key = Uuid::new_v4();
    let write = |v: i64| {
        format!(r#"{{"order_id":"{key}","total":"1","version":{v},"items":[{{"sku":"A"}}]}}"#)
            .into_bytes()
    };
    insert(&m, &pool, &[write(1)])
        .await
        .expect("the first version");
    env.db
        .batch_execute("CREATE RULE audit AS ON INSERT TO orders DO ALSO NOTIFY warren_audit")
        .await
        .expect("the rule");
    let e = insert(&m, &pool, &[write(2)])
        .await
        .expect_err("refused while the rule is there");
    assert_eq!(e.class(), warren::db::ErrorClass::Systemic, "{e}");
    let reason = e.short_reason();
    assert!(
        reason.contains("0A000") && reason.contains("drop the rule"),
        "{reason}"
    );
    env.db
        .batch_execute("DROP RULE audit ON orders")
        .await
        .expect("drop the rule");
    insert(&m, &pool, &[write(2)])
        .await
        .expect("the newer version");
    assert_eq!(stored(&env, key).await.map(|s| s.1), Some(2));
}
