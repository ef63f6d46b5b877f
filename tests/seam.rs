//! The seam holds: a second domain, defined only in this test (`events`: id, kind, payload
//! jsonb), runs through the same pipeline core as users, in process, on the real broker and
//! database: valid events are inserted once, a refused one is dead-lettered with its kind, and
//! the core knows nothing of either domain.

mod common;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use uuid::Uuid;
use warren::db::DbError;
use warren::domain::{Domain, Inserted, Rejection};
use warren::pipeline::{self, FallbackKind, Spec, Stage};

use common::*;

/// The second domain: events with a kind and a JSON payload.
struct Events {
    /// The schema the `events` table lives in (the test's own).
    schema: String,
}

#[derive(Debug)]
struct Event {
    id: Uuid,
    kind: String,
    payload: Value,
}

impl Domain for Events {
    type Record = Event;

    fn decode(&self, body: &[u8]) -> Result<Event, Rejection> {
        let v: Value = serde_json::from_slice(body).map_err(|e| Rejection::json(e.to_string()))?;
        let id = v
            .get("id")
            .and_then(Value::as_str)
            .and_then(|s| Uuid::parse_str(s).ok())
            .ok_or_else(|| Rejection::payload("id: expected a UUID"))?;
        let kind = v
            .get("kind")
            .and_then(Value::as_str)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| Rejection::payload("kind: expected a non-empty string"))?
            .to_string();
        let payload = v.get("payload").cloned().unwrap_or(Value::Null);
        Ok(Event { id, kind, payload })
    }

    fn insert<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a Event],
    ) -> BoxFuture<'a, Result<Inserted, DbError>> {
        Box::pin(async move {
            let ids: Vec<Uuid> = records.iter().map(|e| e.id).collect();
            let kinds: Vec<&str> = records.iter().map(|e| e.kind.as_str()).collect();
            let payloads: Vec<&Value> = records.iter().map(|e| &e.payload).collect();
            let sql = format!(
                "INSERT INTO {}.events (id, kind, payload) \
                 SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::jsonb[]) \
                 ON CONFLICT (id) DO NOTHING",
                self.schema
            );
            let rows = client
                .execute(&sql, &[&ids, &kinds, &payloads])
                .await
                .map_err(DbError::from_pg)?;
            Ok(Inserted {
                rows,
                ..Default::default()
            })
        })
    }
}

fn event_body(id: Uuid, kind: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"id": id, "kind": kind, "payload": {"n": 1}})).unwrap()
}

#[actix::test]
async fn a_second_domain_runs_through_the_same_core() {
    let env = TestEnv::new("seam").await;
    env.declare();
    env.db
        .batch_execute(&format!(
            "CREATE TABLE {}.events (id uuid PRIMARY KEY, kind text NOT NULL, payload jsonb)",
            env.schema
        ))
        .await
        .expect("create events");

    let settings = env.settings();
    let users = settings.pipeline("users").expect("the users pipeline");
    let pool = warren::db::pool_for(&settings.database(), 2, "warren-seam-test").expect("pool");
    let spec = Spec {
        stage: Stage::Main,
        pipeline: "events".into(),
        queue: env.main_queue.clone(),
        batch_size: 50,
        batch_timeout: Duration::from_millis(100),
        batch_min_wait: Duration::ZERO,
        processors: 2,
        batchers: 2,
        max_batchers: 2,
        policy: users.balance,
        prefetch: 200,
        window_cap: 200,
        max_message_bytes: 4096,
        max_inflight_bytes: 64 << 20,
        db_retry_window: Duration::from_secs(1),
        breaker_failures: Some(3),
        fallback: FallbackKind::Route,
        names: users.names.clone(),
        max_retries: settings.max_retries,
        rate_limit_per_s: 0,
    };
    let domain = Arc::new(Events {
        schema: env.schema.clone(),
    });
    let links = pipeline::Links {
        amqp: settings.amqp(),
        db_bound: settings.database().call_bound(),
        oversize: Default::default(),
    };
    let running = pipeline::start(
        &links,
        spec,
        domain,
        pool,
        Default::default(),
        None,
        Vec::new(),
    );

    let ids: Vec<Uuid> = (0..120).map(|_| Uuid::new_v4()).collect();
    for id in &ids {
        env.publish_raw(&event_body(*id, "signup"), json_props(*id))
            .await;
    }
    let refused = Uuid::new_v4();
    env.publish_raw(&event_body(refused, ""), json_props(refused))
        .await;

    let count = format!("SELECT count(*) FROM {}.events", env.schema);
    wait_until(
        "all 120 events inserted",
        Duration::from_secs(30),
        || async {
            let n: i64 = env.db.query_one(&count, &[]).await.unwrap().get(0);
            n == 120
        },
    )
    .await;
    wait_until(
        "the refused event in the DLQ",
        Duration::from_secs(30),
        || async { queue_counts(&env.dlq_queue).await.0 == 1 },
    )
    .await;
    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(message_uuid(&dead[0]), refused);
    assert_eq!(
        text_header(&dead[0].properties, "x-error-kind").as_deref(),
        Some("invalid_payload")
    );

    assert!(running.shutdown(Duration::from_secs(10)).await.0, "drained");
    assert_eq!(queue_counts(&env.main_queue).await, (0, 0));
    let n: i64 = env.db.query_one(&count, &[]).await.unwrap().get(0);
    assert_eq!(n, 120, "each event exactly once");
}
