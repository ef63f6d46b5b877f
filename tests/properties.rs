//! Message properties as columns (`property = "message_id"`, ...) on the real broker and
//! database: a message stores its own properties and the exchange and routing key it was
//! published with; a message that goes through the retry queue first, and one dead-lettered and
//! replayed from the DLQ, store the ORIGINAL's (the broker delivers warren's copies through
//! warren's own exchanges, with warren's routing keys).

mod common;

use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::FieldTable;

/// Deletes the test's own exchange, also after a failed assertion.
struct ExchangeCleanup(String);

impl Drop for ExchangeCleanup {
    fn drop(&mut self) {
        common::cluster::delete_on(&amqp_url(), Vec::new(), vec![self.0.clone()]);
    }
}

const COLUMNS: &str = r#"
[pipelines.columns]
id     = { path = "/id", type = "int4" }
qty    = { path = "/qty", type = "int4" }
msg_id = { property = "message_id", type = "text" }
corr   = { property = "correlation_id", type = "text", optional = true }
at     = { property = "timestamp", type = "timestamptz" }
kind   = { property = "type", type = "text", optional = true }
app    = { property = "app_id", type = "text", optional = true }
ctype  = { property = "content_type", type = "text", optional = true }
rk     = { property = "routing_key", type = "text" }
ex     = { property = "exchange", type = "text" }
"#;

fn props(n: i32) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(format!("m-{n}").into())
        .with_correlation_id(format!("c-{n}").into())
        .with_timestamp(1_700_000_000 + n as u64)
        .with_type("order.created".into())
        .with_app_id("shop".into())
        .with_content_type("application/json".into())
}

/// What row `id` stores of its message's properties: (msg_id, corr, at's seconds, kind, app,
/// ctype, rk, ex).
type Stored = (String, String, i64, String, String, String, String, String);

async fn stored(env: &TestEnv, id: i32) -> Option<Stored> {
    let row = env
        .db
        .query_opt(
            "SELECT msg_id, corr, extract(epoch FROM at)::int8, kind, app, ctype, rk, ex \
             FROM props WHERE id = $1",
            &[&id],
        )
        .await
        .expect("read props")?;
    Some((
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
        row.get(6),
        row.get(7),
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_and_a_replayed_message_store_the_originals_properties() {
    let mut env = TestEnv::new("props").await;
    // A transient failure goes to the retry queue at once; the breaker stays closed.
    env.set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1000");
    let names = PipelineNames::of(&env, "props");
    let _cleanup = names.cleanup();
    let s = &env.schema;
    // The first insert attempt of id 2 fails as a serialization failure (a transient error):
    // the sequence is not rolled back, so its second attempt passes. qty over 99 is refused
    // for good until the constraint is dropped.
    env.db
        .batch_execute(&format!(
            "CREATE TABLE {s}.props (id int4 PRIMARY KEY, qty int4 NOT NULL CONSTRAINT small \
                CHECK (qty < 100), msg_id text NOT NULL, corr text, at timestamptz NOT NULL, \
                kind text, app text, ctype text, rk text NOT NULL, ex text NOT NULL);
             CREATE SEQUENCE {s}.first_try;
             CREATE FUNCTION {s}.fail_first() RETURNS trigger LANGUAGE plpgsql AS $f$
             BEGIN
                 IF NEW.id = 2 AND nextval('{s}.first_try') = 1 THEN
                     RAISE EXCEPTION 'try again' USING ERRCODE = '40001';
                 END IF;
                 RETURN NEW;
             END $f$;
             CREATE TRIGGER fail_first BEFORE INSERT ON {s}.props
                 FOR EACH ROW EXECUTE FUNCTION {s}.fail_first();"
        ))
        .await
        .expect("create props");
    let file = ConfigFile::new(&format!(
        "[[pipelines]]\nname = \"props\"\ntable = \"props\"\nkey = [\"id\"]\n\
         retry_ttls_ms = [1000]\n{}\n{COLUMNS}",
        names.toml()
    ));
    declare_file(&env, &file).await;
    // The publishers' own exchange, bound to the pipeline's queue by a pattern.
    let inbound = format!("{}_shop_in", env.id);
    let _inbound = ExchangeCleanup(inbound.clone());
    env.channel
        .exchange_declare(
            inbound.as_str().into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the inbound exchange");
    env.channel
        .queue_bind(
            names.queue.as_str().into(),
            inbound.as_str().into(),
            "orders.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    let warren = env.start(&["--config", file.at(), "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    for (id, qty) in [(1, 1), (2, 2), (3, 150)] {
        env.publish_to(
            &inbound,
            "orders.eu.created",
            format!(r#"{{"id":{id},"qty":{qty}}}"#).as_bytes(),
            props(id),
        )
        .await;
    }
    let expected = |n: i32| -> Stored {
        (
            format!("m-{n}"),
            format!("c-{n}"),
            1_700_000_000 + n as i64,
            "order.created".into(),
            "shop".into(),
            "application/json".into(),
            "orders.eu.created".into(),
            inbound.clone(),
        )
    };
    wait_until("ids 1 and 2 stored", Duration::from_secs(30), || async {
        stored(&env, 1).await.is_some() && stored(&env, 2).await.is_some()
    })
    .await;
    // Id 2 was refused once and came back through the retry queue.
    let tries: i64 = env
        .db
        .query_one(&format!("SELECT last_value FROM {s}.first_try"), &[])
        .await
        .expect("the sequence")
        .get(0);
    assert!(tries >= 2, "id 2 was tried {tries} times");
    assert_eq!(stored(&env, 1).await, Some(expected(1)), "published as is");
    assert_eq!(stored(&env, 2).await, Some(expected(2)), "after a retry");
    // Id 3 is in the DLQ (db_permanent); once the table takes it, a replay stores it.
    wait_until("id 3 in the DLQ", Duration::from_secs(30), || async {
        env.ready(&names.dlq).await == 1
    })
    .await;
    env.db
        .batch_execute(&format!("ALTER TABLE {s}.props DROP CONSTRAINT small"))
        .await
        .expect("drop the constraint");
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "dlq",
            "--pipeline",
            "props",
            "replay",
        ])
        .await;
    assert_eq!(code, 0, "dlq replay:\n{out}{err}");
    wait_until("id 3 stored", Duration::from_secs(30), || async {
        stored(&env, 3).await.is_some()
    })
    .await;
    assert_eq!(
        stored(&env, 3).await,
        Some(expected(3)),
        "replayed from the DLQ"
    );
}

/// A child table's column reads a property of the message (`{ property = "message_id" }` in
/// `[pipelines.children.columns]`): each element's row holds its message's, the same for each
/// element; a message without it is parked once, `invalid_payload` naming the property.
#[tokio::test(flavor = "multi_thread")]
async fn a_child_column_stores_its_messages_property_in_each_row() {
    let env = TestEnv::new("props_child").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "ALTER TABLE order_items ADD COLUMN msg_id text NOT NULL, ADD COLUMN rk text NOT NULL",
        )
        .await
        .expect("add the property columns");
    let text = nested_toml(&names, "").replace(
        "qty      = { path = \"/qty\", type = \"int4\", min = 1 }",
        "qty      = { path = \"/qty\", type = \"int4\", min = 1 }\n\
         msg_id   = { property = \"message_id\", type = \"text\" }\n\
         rk       = { property = \"routing_key\", type = \"text\" }",
    );
    assert!(text.contains("msg_id"), "the child columns were extended");
    let file = ConfigFile::new(&text);
    declare_file(&env, &file).await;
    let warren = env.start(&[
        "--config",
        file.at(),
        "--roles",
        "consumer,dlq",
        "--pipelines",
        "orders",
    ]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let orders: Vec<(uuid::Uuid, usize)> = (1..=4).map(|n| (uuid::Uuid::new_v4(), n)).collect();
    for (id, n) in &orders {
        let items: Vec<(&str, i64)> = (0..*n).map(|_| ("S-1", 1)).collect();
        env.publish_to(
            &names.exchange,
            &names.queue,
            &nested_order(*id, 1, &items),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(format!("m-{id}").into()),
        )
        .await;
    }
    let without = uuid::Uuid::new_v4();
    env.publish_to(
        &names.exchange,
        &names.queue,
        &nested_order(without, 1, &[("S-1", 1)]),
        BasicProperties::default().with_delivery_mode(2),
    )
    .await;
    let all: i64 = orders.iter().map(|(_, n)| *n as i64).sum();
    wait_until(
        "every item stored, the bad order parked",
        Duration::from_secs(60),
        || async {
            count_of(&env, "SELECT count(*) FROM order_items").await == all
                && count_of(&env, "SELECT count(*) FROM dead_letters").await == 1
        },
    )
    .await;
    for (id, n) in &orders {
        let rows = env
            .db
            .query(
                "SELECT msg_id, rk FROM order_items WHERE order_id = $1 ORDER BY line",
                &[id],
            )
            .await
            .expect("the items");
        let got: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        assert_eq!(
            got,
            vec![(format!("m-{id}"), names.queue.clone()); *n],
            "order {id}"
        );
    }
    let parked = env
        .db
        .query_one(
            "SELECT error_kind, error_reason, body FROM dead_letters",
            &[],
        )
        .await
        .expect("the parked order");
    let (kind, reason, body): (String, String, Vec<u8>) =
        (parked.get(0), parked.get(1), parked.get(2));
    assert_eq!(kind, "invalid_payload");
    assert!(
        reason.contains("property message_id: missing (a text is required)"),
        "{reason}"
    );
    assert!(
        String::from_utf8_lossy(&body).contains(&without.to_string()),
        "the order without a message id is the one parked"
    );
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM orders").await,
        orders.len() as i64
    );
}
