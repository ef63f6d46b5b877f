//! The ledger with three mapped pipelines in one process: `orders` (`on_conflict = "keep"`, a
//! numeric with a minimum, an int4 range, a CHECK the database enforces, the whole body as jsonb),
//! `events` (`on_conflict = "update"` by a version column) and `baskets`, a nested pipeline (each
//! basket's items in the child table `basket_items`, with a foreign key to its basket and a CHECK
//! the database enforces), beside the built-in users pipeline, each with its own queues, retry
//! tier, DLQ and DLQ stage. One seeded mix per pipeline (good rows, malformed JSON, invalid
//! payloads, an invalid element, same-key conflicts, rows and child rows the database refuses,
//! several versions of one key in random order, exact duplicates) is published while faults hit
//! (the broker link cut, backends terminated, kill -9 and restart, a database outage, every
//! write refused as read-only for a while). Then every message the broker confirmed must end
//! exactly once in its own pipeline: orders in `orders` holding its content or parked once under
//! `orders`; every basket with exactly its items (compared line by line) or parked once under
//! `baskets`, never a basket without its items; every event version accounted for: stored as its key's row (the row names the
//! message), or superseded by a higher version of its key (stale), or, when another message of
//! its key has its version with other content, parked once under `events` as `id_conflict`
//! (two states under one version); each key's row is its highest version; every parked row parked
//! once (`park_count` 1, never replayed); nothing parked under another pipeline, no row without a
//! message, every queue empty.
//!
//! The faults hit while the messages are published: the publishing is paced over the whole fault
//! window, no chunk goes out before its share of the faults has begun (a fault that overruns its
//! slot holds the publishing back), and the last chunk waits for the last fault to end. Every fault type hits in every run
//! (the schedule is each type once plus more drawn at random, shuffled, one in each slot of the
//! window).
//!
//! The seed is printed; `WARREN_LEDGER_SEED=N` replays it, `WARREN_LEDGER_MESSAGES=N` (default
//! 1200 per pipeline) and `WARREN_LEDGER_FAULT_SECONDS=N` (default 15) run it longer by hand.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use lapin::BasicProperties;
use tokio::sync::Mutex;
use uuid::Uuid;

fn env_number(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type Names = PipelineNames;

fn config(orders: &Names, events: &Names, baskets: &Names) -> String {
    format!(
        r#"
[[pipelines]]
name = "orders"
table = "orders"
key = ["order_id"]
on_conflict = "keep"
unknown_fields = "reject"
batch_size = 100
batch_timeout_ms = 100
retry_ttls_ms = [1000]
max_retries = 2
dlq_max_attempts = 3
{}
[pipelines.columns]
order_id = {{ path = "/id", type = "uuid" }}
email    = {{ path = "/email", type = "text", format = "email" }}
total    = {{ path = "/total", type = "numeric", min = 0 }}
quantity = {{ path = "/qty", type = "int4", min = 1, max = 1000 }}
doc      = {{ path = "", type = "jsonb" }}

[[pipelines]]
name = "events"
table = "events"
key = ["event_id"]
on_conflict = "update"
version_column = "version"
unknown_fields = "ignore"
batch_size = 100
batch_timeout_ms = 100
retry_ttls_ms = [1000]
max_retries = 2
dlq_max_attempts = 3
{}
[pipelines.columns]
event_id = {{ path = "/id", type = "uuid" }}
version  = {{ path = "/version", type = "int8", min = 0 }}
kind     = {{ path = "/kind", type = "text", max_len = 40 }}
payload  = {{ path = "/payload", type = "jsonb", optional = true }}

[[pipelines]]
name = "baskets"
table = "baskets"
key = ["basket_id"]
on_conflict = "keep"
unknown_fields = "reject"
batch_size = 100
batch_timeout_ms = 100
retry_ttls_ms = [1000]
max_retries = 2
dlq_max_attempts = 3
{}
[pipelines.columns]
basket_id = {{ path = "/id", type = "uuid" }}
total     = {{ path = "/total", type = "numeric", min = 0 }}

[[pipelines.children]]
table = "basket_items"
rows = "/items"
key = ["basket_id", "line"]
max_rows = 5

[pipelines.children.columns]
basket_id = {{ parent = "basket_id" }}
line      = {{ index = true }}
sku       = {{ path = "/sku", type = "text", min_len = 1 }}
qty       = {{ path = "/qty", type = "int4", min = 1 }}
"#,
        orders.toml(),
        events.toml(),
        baskets.toml()
    )
}

/// What one published message is, and where it may end.
#[derive(Debug, Clone)]
struct Entry {
    /// `orders`, `events` or `baskets`.
    pipeline: &'static str,
    /// The mix's label, for the report.
    kind: &'static str,
    /// For a message that may land: its key and what the row then holds (orders: the email and
    /// total; events: the version and the kind, `<version> k<i>`, which names the message;
    /// baskets: the total and every item, `<total> <sku>:<qty>,...` in line order). An
    /// order lands or is parked (a same-key order with other content wins or loses by arrival);
    /// an event always succeeds, its key holding the highest version.
    lands: Option<(Uuid, String)>,
}

type Published = Vec<(String, Entry, Vec<u8>)>;

/// The orders mix, keyed by message id (`o-<i>`).
fn orders_mix(rng: &mut fastrand::Rng, n: usize) -> Published {
    let mut out = Vec::with_capacity(n);
    let mut good: Vec<Uuid> = Vec::new();
    for i in 0..n {
        let order = |id: Uuid, total: &str, qty: i64| {
            format!(r#"{{"id":"{id}","email":"o-{i}@example.com","total":{total},"qty":{qty}}}"#)
                .into_bytes()
        };
        let id = Uuid::new_v4();
        let (kind, body, lands) = match rng.u32(0..100) {
            0..=5 => ("malformed", b"{\"id\":".to_vec(), None),
            6..=10 => ("invalid_qty", order(id, "1", 0), None),
            11..=13 => (
                "unknown_field",
                format!(r#"{{"id":"{id}","email":"a@b.c","total":1,"qty":1,"x":1}}"#).into_bytes(),
                None,
            ),
            // The same key as another order, other content: whichever arrives second is an
            // id_conflict under keep.
            14..=18 if !good.is_empty() => {
                let taken = good[rng.usize(0..good.len())];
                let content = Some((taken, format!("o-{i}@example.com 2")));
                ("same_key_other_content", order(taken, "2", 2), content)
            }
            // Refused by the table's CHECK (23514): the row alone ends parked.
            19..=22 => ("check_refused", order(id, "5000000", 1), None),
            _ => {
                good.push(id);
                let total = format!("{}.{:02}", rng.u32(0..1000), rng.u32(0..100));
                let body = order(id, &format!("\"{total}\""), 1 + rng.i64(0..999));
                (
                    "good",
                    body,
                    Some((id, format!("o-{i}@example.com {total}"))),
                )
            }
        };
        out.push((
            format!("o-{i}"),
            Entry {
                pipeline: "orders",
                kind,
                lands,
            },
            body,
        ));
    }
    out
}

/// The baskets mix, keyed by message id (`b-<i>`): nested messages of 1 to 5 items.
fn baskets_mix(rng: &mut fastrand::Rng, n: usize) -> Published {
    let mut out = Vec::with_capacity(n);
    let mut good: Vec<Uuid> = Vec::new();
    for i in 0..n {
        // A basket and what its rows then hold.
        let basket = |id: Uuid, total: &str, items: &[(String, i64)]| {
            let elements: Vec<String> = items
                .iter()
                .map(|(sku, qty)| format!(r#"{{"sku":"{sku}","qty":{qty}}}"#))
                .collect();
            let content: Vec<String> = items.iter().map(|(s, q)| format!("{s}:{q}")).collect();
            (
                format!(
                    r#"{{"id":"{id}","total":"{total}","items":[{}]}}"#,
                    elements.join(",")
                )
                .into_bytes(),
                format!("{total} {}", content.join(",")),
            )
        };
        let items = |rng: &mut fastrand::Rng| -> Vec<(String, i64)> {
            (0..rng.usize(1..=5))
                .map(|j| (format!("s{i}-{j}"), rng.i64(1..99)))
                .collect()
        };
        let id = Uuid::new_v4();
        let mut drawn = items(rng);
        let (kind, body, lands) = match rng.u32(0..100) {
            0..=4 => ("malformed", b"{\"id\":\"".to_vec(), None),
            // An element a check refuses: the whole basket is invalid_payload.
            5..=9 => {
                let at = rng.usize(0..drawn.len());
                drawn[at].1 = 0;
                ("invalid_item", basket(id, "1.00", &drawn).0, None)
            }
            10..=11 => (
                "too_many_items",
                basket(
                    id,
                    "1.00",
                    &drawn.iter().cycle().take(6).cloned().collect::<Vec<_>>(),
                )
                .0,
                None,
            ),
            // An item the table's CHECK refuses (qty < 100), in the middle of a batch: the
            // basket alone is parked, with neither its row nor its other items stored.
            12..=16 => {
                let at = rng.usize(0..drawn.len());
                drawn[at].1 = 100;
                ("item_refused", basket(id, "1.00", &drawn).0, None)
            }
            // The same key as another basket, other items: whichever arrives second is an
            // id_conflict under keep.
            17..=21 if !good.is_empty() => {
                let taken = good[rng.usize(0..good.len())];
                let (body, content) = basket(taken, "2.00", &drawn);
                ("same_key_other_items", body, Some((taken, content)))
            }
            _ => {
                good.push(id);
                let total = format!("{}.{:02}", rng.u32(0..1000), rng.u32(0..100));
                let (body, content) = basket(id, &total, &drawn);
                ("good", body, Some((id, content)))
            }
        };
        out.push((
            format!("b-{i}"),
            Entry {
                pipeline: "baskets",
                kind,
                lands,
            },
            body,
        ));
    }
    out
}

/// The events mix, keyed by message id (`e-<i>`): several versions of a key, in random order.
fn events_mix(rng: &mut fastrand::Rng, n: usize) -> Published {
    let mut out = Vec::with_capacity(n);
    let mut keys: Vec<Uuid> = Vec::new();
    for i in 0..n {
        let (kind, body, lands) = match rng.u32(0..100) {
            0..=4 => ("malformed", b"[1,".to_vec(), None),
            5..=9 => (
                "invalid_version",
                format!(r#"{{"id":"{}","version":"x","kind":"k"}}"#, Uuid::new_v4()).into_bytes(),
                None,
            ),
            _ => {
                let id = if !keys.is_empty() && rng.u32(0..100) < 50 {
                    keys[rng.usize(0..keys.len())]
                } else {
                    let id = Uuid::new_v4();
                    keys.push(id);
                    id
                };
                let version = rng.i64(0..1_000_000);
                let body = format!(
                    r#"{{"id":"{id}","version":{version},"kind":"k{i}","payload":{{"n":{i}}},"extra":true}}"#
                )
                .into_bytes();
                ("version", body, Some((id, format!("{version} k{i}"))))
            }
        };
        out.push((
            format!("e-{i}"),
            Entry {
                pipeline: "events",
                kind,
                lands,
            },
            body,
        ));
    }
    out
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    CutBroker,
    TerminateBackends,
    Kill9,
    DatabaseOutage,
    ReadOnly,
}

const FAULTS: [Fault; 5] = [
    Fault::CutBroker,
    Fault::TerminateBackends,
    Fault::Kill9,
    Fault::DatabaseOutage,
    Fault::ReadOnly,
];

/// The fault schedule over `window` (see [`fault_schedule`]).
fn schedule(rng: &mut fastrand::Rng, window: Duration) -> Vec<(Duration, Fault)> {
    fault_schedule(rng, window, &FAULTS)
}

/// Every schedule holds every fault type within its window ([`check_fault_schedules`]).
#[test]
fn every_schedule_holds_every_fault_type_within_its_window() {
    check_fault_schedules(&FAULTS);
}

/// An event's version and message, from what its row or its entry holds (`<version> k<i>`).
fn version_of(content: &str) -> (i64, &str) {
    let (version, kind) = content.split_once(' ').expect("`<version> <kind>`");
    (version.parse().expect("a version"), kind)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_mapped_pipelines_end_every_message_exactly_once_under_faults() {
    let seed = env_number("WARREN_LEDGER_SEED", fastrand::u64(..));
    let n = env_number("WARREN_LEDGER_MESSAGES", 1200) as usize;
    let fault_window = Duration::from_secs(env_number("WARREN_LEDGER_FAULT_SECONDS", 15));
    eprintln!(
        "ledger_pipelines: seed {seed} (replay with WARREN_LEDGER_SEED={seed}), {n} messages a \
         pipeline"
    );
    let mut rng = fastrand::Rng::with_seed(seed);

    let pg = TcpProxy::start(&database_url(), 5432).await;
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("ledger_pl").await;
    env.set("DATABASE_URL", pg.url())
        .set("AMQP_URL", amqp.url())
        .set("DB_RETRY_WINDOW_MS", "300")
        .set("PUBLISH_TIMEOUT_MS", "1000")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "3000")
        .set("SHUTDOWN_TIMEOUT_MS", "5000");
    let orders = Names::of(&env, "orders");
    let events = Names::of(&env, "events");
    let baskets = Names::of(&env, "baskets");
    let _cleanup = (orders.cleanup(), events.cleanup(), baskets.cleanup());
    let s = env.schema.clone();
    env.db
        .batch_execute(&format!(
            r#"
            CREATE TABLE orders (
                order_id uuid PRIMARY KEY,
                email text NOT NULL,
                total numeric NOT NULL CHECK (total < 1000000),
                quantity int4 NOT NULL,
                doc jsonb NOT NULL
            );
            CREATE TABLE events (
                event_id uuid PRIMARY KEY,
                version int8 NOT NULL,
                kind text NOT NULL,
                payload jsonb
            );
            CREATE TABLE baskets (
                basket_id uuid PRIMARY KEY,
                total numeric NOT NULL
            );
            CREATE TABLE basket_items (
                basket_id uuid NOT NULL REFERENCES baskets,
                line int4 NOT NULL,
                sku text NOT NULL,
                qty int4 NOT NULL CHECK (qty < 100),
                PRIMARY KEY (basket_id, line)
            );
            CREATE TABLE read_only_fence (up boolean NOT NULL);
            INSERT INTO read_only_fence VALUES (false);
            CREATE FUNCTION {s}.refuse_while_fenced() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF (SELECT up FROM {s}.read_only_fence) THEN
                    RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction'
                        USING ERRCODE = '25006';
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER orders_read_only BEFORE INSERT OR UPDATE ON orders
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            CREATE TRIGGER events_read_only BEFORE INSERT OR UPDATE ON events
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            CREATE TRIGGER baskets_read_only BEFORE INSERT OR UPDATE ON baskets
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            CREATE TRIGGER basket_items_read_only BEFORE INSERT OR UPDATE ON basket_items
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            "#
        ))
        .await
        .expect("create the tables");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("pipelines.toml");
    std::fs::write(&path, config(&orders, &events, &baskets)).expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    // The parking table exists once declared: fence it too.
    env.db
        .batch_execute(&format!(
            "CREATE TRIGGER dead_letters_read_only BEFORE INSERT OR UPDATE ON dead_letters \
             FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();"
        ))
        .await
        .expect("fence dead_letters");
    let fence = |up: bool| {
        let db = &env.db;
        async move {
            db.execute("UPDATE read_only_fence SET up = $1", &[&up])
                .await
                .expect("set the fence");
        }
    };

    let mut published = orders_mix(&mut rng, n);
    published.extend(events_mix(&mut rng, n));
    published.extend(baskets_mix(&mut rng, n));
    // Exact duplicates (a publisher that retried), then interleaving as several publishers would.
    let mut with_copies = Vec::with_capacity(published.len() + published.len() / 20);
    for p in &published {
        if rng.u32(0..100) < 3 {
            with_copies.push(p.clone());
        }
        with_copies.push(p.clone());
    }
    for i in (1..with_copies.len()).rev() {
        let j = rng.usize(0..=i);
        with_copies.swap(i, j);
    }
    let ledger: HashMap<String, Entry> = published
        .iter()
        .map(|(id, e, _)| (id.clone(), e.clone()))
        .collect();
    let mut counts: HashMap<(&str, &str), usize> = HashMap::new();
    for e in ledger.values() {
        *counts.entry((e.pipeline, e.kind)).or_default() += 1;
    }
    eprintln!(
        "ledger_pipelines: mix {counts:?}, {} publishes",
        with_copies.len()
    );

    let args = [
        "--config",
        file.as_str(),
        "--roles",
        "consumer,dlq",
        "--set",
        "metrics_addr=127.0.0.1:0",
    ];
    let warren = Arc::new(Mutex::new(env.start(&args)));
    let history: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();

    // Publishing in chunks paced over the fault window while the faults hit; the last chunk
    // waits for the last fault to end, so every fault lands while messages are published.
    let faults = schedule(&mut rng, fault_window);
    eprintln!("ledger_pipelines: faults {faults:?}");
    let injected = AtomicBool::new(false);
    // Faults begun so far: chunk k waits for its share of them (k * faults / chunks), so a fault
    // that takes longer than its slot (a DLQ consumer slow to stop) holds the publishing back
    // rather than leaving the faults after it to land once everything is published.
    let begun = AtomicUsize::new(0);
    let started = Instant::now();
    let publish = async {
        let chunks = with_copies.len().div_ceil(50).max(1);
        let pace = fault_window / chunks as u32;
        for (k, chunk) in with_copies.chunks(50).enumerate() {
            if k + 1 == chunks {
                while !injected.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            } else {
                tokio::time::sleep((pace * k as u32).saturating_sub(started.elapsed())).await;
                while begun.load(Ordering::SeqCst) < k * faults.len() / chunks {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            for (names, pipeline) in [
                (&orders, "orders"),
                (&events, "events"),
                (&baskets, "baskets"),
            ] {
                let messages: Vec<(Vec<u8>, BasicProperties)> = chunk
                    .iter()
                    .filter(|(_, e, _)| e.pipeline == pipeline)
                    .map(|(id, _, body)| {
                        (
                            body.clone(),
                            BasicProperties::default()
                                .with_message_id(id.as_str().into())
                                .with_delivery_mode(2),
                        )
                    })
                    .collect();
                env.publish_pipelined_to(&names.exchange, &names.queue, messages)
                    .await;
            }
        }
        eprintln!(
            "ledger_pipelines: the publishing done at {:?}",
            started.elapsed()
        );
    };
    let inject = async {
        for (at, fault) in &faults {
            tokio::time::sleep(at.saturating_sub(started.elapsed())).await;
            begun.fetch_add(1, Ordering::SeqCst);
            match fault {
                Fault::CutBroker => {
                    amqp.cut();
                    amqp.restore();
                }
                Fault::TerminateBackends => {
                    terminate_backends(&pg.backend_client_ports()).await;
                }
                Fault::Kill9 => {
                    let mut w = warren.lock().await;
                    w.kill9();
                    history.lock().unwrap().push(format!(
                        "---- {}:\n{}",
                        w.log.display(),
                        tail(&w.logs(), 60)
                    ));
                    *w = env.start(&args);
                }
                Fault::DatabaseOutage => {
                    pg.cut();
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    pg.restore();
                }
                Fault::ReadOnly => {
                    fence(true).await;
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    fence(false).await;
                }
            }
            eprintln!("ledger_pipelines: {fault:?} at {:?}", started.elapsed());
        }
        injected.store(true, Ordering::SeqCst);
    };
    tokio::join!(publish, inject);
    pg.restore();
    amqp.restore();
    fence(false).await;

    // The expected end: orders that land, the highest version of each event key, the rest
    // parked once.
    let mut latest: HashMap<Uuid, i64> = HashMap::new();
    for e in ledger.values().filter(|e| e.pipeline == "events") {
        if let Some((id, content)) = &e.lands {
            let (v, _) = version_of(content);
            let best = latest.entry(*id).or_insert(v);
            *best = (*best).max(v);
        }
    }
    let all_orders = ledger.values().filter(|e| e.pipeline == "orders").count();
    let all_baskets = ledger.values().filter(|e| e.pipeline == "baskets").count();
    let bad_events = ledger
        .values()
        .filter(|e| e.pipeline == "events" && e.lands.is_none())
        .count();
    // A count; `None` (not settled) while the database does not answer.
    let count = |sql: &'static str| {
        let db = &env.db;
        async move {
            match db.query_one(sql, &[]).await {
                Ok(r) => Some(r.get::<_, i64>(0) as usize),
                Err(e) => {
                    eprintln!("ledger_pipelines: {sql}: {e}");
                    None
                }
            }
        }
    };
    let queues: Vec<&String> = [&orders, &events, &baskets]
        .iter()
        .flat_map(|n| [&n.queue, &n.retry, &n.dlq])
        .collect();
    let settle = Duration::from_secs(150) + 2 * fault_window;
    let deadline = Instant::now() + settle;
    let mut problems: Vec<String> = Vec::new();
    loop {
        let orders_accounted = count(
            "SELECT (SELECT count(*) FROM orders) + \
             (SELECT count(*) FROM dead_letters WHERE pipeline = 'orders')",
        )
        .await;
        let baskets_accounted = count(
            "SELECT (SELECT count(*) FROM baskets) + \
             (SELECT count(*) FROM dead_letters WHERE pipeline = 'baskets')",
        )
        .await;
        let done = orders_accounted.is_some_and(|n| n >= all_orders)
            && baskets_accounted.is_some_and(|n| n >= all_baskets)
            && count("SELECT count(*) FROM events")
                .await
                .is_some_and(|n| n >= latest.len())
            && count("SELECT count(*) FROM dead_letters WHERE pipeline = 'events'")
                .await
                .is_some_and(|n| n >= bad_events);
        let mut empty = true;
        for q in &queues {
            if queue_counts(q).await != (0, 0) {
                empty = false;
            }
        }
        if done && empty {
            break;
        }
        if Instant::now() > deadline {
            let mut state = String::new();
            for q in &queues {
                state.push_str(&format!("{q}: {:?}; ", queue_counts(q).await));
            }
            problems.push(format!("not settled within {settle:?}: {state}"));
            let w = warren.lock().await;
            history.lock().unwrap().push(format!(
                "---- {}:\n{}",
                w.log.display(),
                tail(&w.logs(), 120)
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    warren.lock().await.terminate(Duration::from_secs(30));

    // The check.
    let order_rows: HashMap<Uuid, String> = env
        .db
        .query(
            "SELECT order_id, email || ' ' || total::text FROM orders",
            &[],
        )
        .await
        .expect("orders")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Each basket as `<total> <sku>:<qty>,...`, its items in line order (none: nothing after
    // the space, which no published basket is).
    let basket_rows: HashMap<Uuid, String> = env
        .db
        .query(
            "SELECT b.basket_id, b.total::text || ' ' || COALESCE((SELECT string_agg(\
               i.sku || ':' || i.qty, ',' ORDER BY i.line) FROM basket_items i \
               WHERE i.basket_id = b.basket_id), '') FROM baskets b",
            &[],
        )
        .await
        .expect("baskets")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let stray_items = count_of(
        &env,
        "SELECT count(*) FROM basket_items i WHERE NOT EXISTS \
         (SELECT 1 FROM baskets b WHERE b.basket_id = i.basket_id)",
    )
    .await;
    if stray_items != 0 {
        problems.push(format!("{stray_items} items without their basket"));
    }
    let mut owned_baskets: HashMap<Uuid, usize> = HashMap::new();
    // Each key's row as `<version> k<i>`: its version and the message that wrote it.
    let event_rows: HashMap<Uuid, String> = env
        .db
        .query(
            "SELECT event_id, version::text || ' ' || kind FROM events",
            &[],
        )
        .await
        .expect("events")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Each parked row with how often it was parked (`park_count`: 1 when parked, + 1 each time
    // it is parked again after a replay) and whether it was replayed. Nothing replays here:
    // every row must be parked once, open.
    let parked: Vec<(String, Option<String>, String, i32, bool)> = env
        .db
        .query(
            "SELECT pipeline, message_id, error_kind, park_count, replayed_at IS NOT NULL \
             FROM dead_letters",
            &[],
        )
        .await
        .expect("dead_letters")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let mut parked_as: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for (pipeline, id, kind, park_count, replayed) in &parked {
        let id = id.clone().unwrap_or_else(|| "<no id>".into());
        if *park_count != 1 || *replayed {
            problems.push(format!(
                "{id} ({pipeline}, {kind}): park_count {park_count}, replayed {replayed}; \
                 expected parked once, never replayed"
            ));
        }
        parked_as
            .entry(id)
            .or_default()
            .push((pipeline.clone(), kind.clone()));
    }
    let mut owned: HashMap<Uuid, usize> = HashMap::new();
    // The event keys whose row names a published message, with how many messages it names.
    let mut owned_events: HashMap<Uuid, usize> = HashMap::new();
    // Each published version by the kind that names its message (`k<i>`): its key and version.
    let versions: HashMap<String, (Uuid, i64)> = ledger
        .values()
        .filter_map(|e| e.lands.as_ref().filter(|_| e.pipeline == "events"))
        .map(|(key, content)| {
            let (version, kind) = version_of(content);
            (kind.to_string(), (*key, version))
        })
        .collect();
    // How many published messages each (event key, version) has: more than one, twins whose
    // contents differ (each names its own message).
    let mut twins: HashMap<(Uuid, i64), usize> = HashMap::new();
    for (key, version) in versions.values() {
        *twins.entry((*key, *version)).or_default() += 1;
    }
    for (id, entry) in &ledger {
        let times = parked_as.get(id).map(Vec::len).unwrap_or(0);
        let under_events = parked_as
            .get(id)
            .is_some_and(|p| p.iter().all(|(pipeline, _)| pipeline == "events"));
        let under_orders = parked_as
            .get(id)
            .is_some_and(|p| p.iter().all(|(pipeline, _)| pipeline == "orders"));
        let under_baskets = parked_as
            .get(id)
            .is_some_and(|p| p.iter().all(|(pipeline, _)| pipeline == "baskets"));
        match (&entry.lands, entry.pipeline) {
            // A basket lands with exactly its items, or is parked once under baskets.
            (Some((key, content)), "baskets") => {
                let landed = basket_rows.get(key) == Some(content);
                if landed {
                    *owned_baskets.entry(*key).or_default() += 1;
                }
                if !matches!(
                    (landed, times, under_baskets),
                    (true, 0, _) | (false, 1, true)
                ) {
                    problems.push(format!(
                        "{id} (baskets, {}): row {:?} (its content {content:?}), parked {:?}",
                        entry.kind,
                        basket_rows.get(key),
                        parked_as.get(id)
                    ));
                }
            }
            (Some((key, content)), "orders") => {
                let landed = order_rows.get(key) == Some(content);
                if landed {
                    *owned.entry(*key).or_default() += 1;
                }
                if !matches!(
                    (landed, times, under_orders),
                    (true, 0, _) | (false, 1, true)
                ) {
                    problems.push(format!(
                        "{id} (orders, {}): row {:?} (its content {content:?}), parked {:?}",
                        entry.kind,
                        order_rows.get(key),
                        parked_as.get(id)
                    ));
                }
            }
            // Every version accounted for: the row its key holds is this message (its kind
            // `k<i>` names it), not parked; or a higher version, not parked (stale) unless a
            // twin (another published message of its key and version: other content, as its
            // kind differs) was stored when it came (`id_conflict`, parked once under
            // events); or an equal one of another published message, stored first: then this
            // one, other content under one version, is `id_conflict`, parked once.
            (Some((key, content)), _) => {
                let (version, kind) = version_of(content);
                let stored = event_rows.get(key).map(|row| version_of(row));
                let twinned = twins.get(&(*key, version)).is_some_and(|n| *n > 1);
                let parked_once = times == 1
                    && under_events
                    && parked_as
                        .get(id)
                        .is_some_and(|p| p.iter().all(|(_, kind)| kind == "id_conflict"));
                let accounted = match stored {
                    Some((v, k)) if k == kind => {
                        *owned_events.entry(*key).or_default() += 1;
                        v == version && times == 0
                    }
                    Some((v, k)) if v == version => {
                        versions.get(k) == Some(&(*key, version)) && parked_once
                    }
                    Some((v, _)) => v > version && (times == 0 || (twinned && parked_once)),
                    None => false,
                };
                if !accounted {
                    problems.push(format!(
                        "{id} (events, {}): version {version} as {kind}, the key's row {:?}, \
                         parked {:?}",
                        entry.kind,
                        event_rows.get(key),
                        parked_as.get(id)
                    ));
                }
            }
            (None, pipeline) => {
                let under = parked_as.get(id).cloned().unwrap_or_default();
                if under.len() != 1 || under[0].0 != pipeline {
                    problems.push(format!(
                        "{id} ({pipeline}, {}): parked as {under:?}, expected once under \
                         {pipeline}",
                        entry.kind
                    ));
                }
            }
        }
    }
    for (key, version) in &latest {
        let stored = event_rows.get(key).map(|row| version_of(row).0);
        if stored != Some(*version) {
            problems.push(format!(
                "event {key}: version {stored:?} stored, {version} is the highest published"
            ));
        }
    }
    // Every row written by one published version of its key (exact duplicates share a message
    // id, so `k<i>` names one message).
    if event_rows.len() != owned_events.len() || owned_events.values().any(|&n| n != 1) {
        problems.push(format!(
            "{} rows in events, {} written by a published version ({:?} more than once)",
            event_rows.len(),
            owned_events.len(),
            owned_events
                .iter()
                .filter(|(_, n)| **n != 1)
                .collect::<Vec<_>>()
        ));
    }
    if order_rows.len() != owned.len() || owned.values().any(|&n| n != 1) {
        problems.push(format!(
            "{} rows in orders, {} owned by a published order",
            order_rows.len(),
            owned.len()
        ));
    }
    if basket_rows.len() != owned_baskets.len() || owned_baskets.values().any(|&n| n != 1) {
        problems.push(format!(
            "{} rows in baskets, {} owned by a published basket with its items",
            basket_rows.len(),
            owned_baskets.len()
        ));
    }
    if event_rows.len() != latest.len() {
        problems.push(format!(
            "{} rows in events, {} keys published",
            event_rows.len(),
            latest.len()
        ));
    }
    for id in parked_as.keys() {
        if !ledger.contains_key(id) {
            problems.push(format!("parked {id:?} was never published"));
        }
    }
    let users = env.count_rows().await;
    if users != 0 {
        problems.push(format!("{users} rows in users, none published there"));
    }
    let mut kinds: HashMap<(&str, &str), usize> = HashMap::new();
    for (pipeline, _, kind, ..) in &parked {
        *kinds.entry((pipeline.as_str(), kind.as_str())).or_default() += 1;
    }
    eprintln!(
        "ledger_pipelines: seed {seed}: {} messages, {} orders, {} baskets, {} event keys, {} \
         parked {kinds:?}, {} faults, settled after {:?}, {} problems",
        ledger.len(),
        order_rows.len(),
        basket_rows.len(),
        event_rows.len(),
        parked.len(),
        faults.len(),
        started.elapsed(),
        problems.len()
    );
    assert!(
        problems.is_empty(),
        "seed {seed}: {} problems:\n{}\n{}",
        problems.len(),
        problems.join("\n"),
        history.lock().unwrap().join("\n")
    );
}
