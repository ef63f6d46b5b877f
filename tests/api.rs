//! The HTTP API of `warren run --roles api`: health and readiness, `POST /api/v1/users` through
//! the broker into a row readable with `GET /api/v1/users/{id}`, 422 naming the failing field,
//! 413 over 64 KiB, and 503 (fast, JSON) while the broker is unreachable.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use uuid::Uuid;

/// The harness's blocking HTTP client (every status is a value) on the env's API.
struct Http {
    agent: ureq::Agent,
    base: String,
}

/// One answer: status and body (JSON when it parses, else the text as a JSON string).
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: Value,
}

impl Http {
    fn new(env: &TestEnv) -> Self {
        Self {
            agent: http_agent(),
            base: env.http_base(),
        }
    }

    fn answer(response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Answer {
        let mut response = response.unwrap_or_else(|e| panic!("HTTP request failed: {e}"));
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer {
            status,
            content_type,
            body,
        }
    }

    /// GET `path`; `None` when nothing answers (not listening yet).
    fn try_get(&self, path: &str) -> Option<Answer> {
        let url = format!("{}{path}", self.base);
        let response = tokio::task::block_in_place(|| self.agent.get(&url).call());
        response.ok().map(|r| Self::answer(Ok(r)))
    }

    fn get(&self, path: &str) -> Answer {
        let url = format!("{}{path}", self.base);
        Self::answer(tokio::task::block_in_place(|| self.agent.get(&url).call()))
    }

    /// POST a raw body as `application/json` (with a Content-Length).
    fn post(&self, path: &str, body: impl AsRef<[u8]>) -> Answer {
        let url = format!("{}{path}", self.base);
        Self::answer(tokio::task::block_in_place(|| {
            self.agent
                .post(&url)
                .header("content-type", "application/json")
                .send(body.as_ref())
        }))
    }

    /// Waits until GET `path` answers `status`.
    async fn wait_status(&self, path: &str, status: u16, timeout: Duration) {
        wait_until(&format!("GET {path} -> {status}"), timeout, || async {
            self.try_get(path).is_some_and(|a| a.status == status)
        })
        .await;
    }
}

/// The `fields` of a 422 answer, as (field, message).
fn fields(answer: &Answer) -> Vec<(String, String)> {
    answer.body["fields"]
        .as_array()
        .unwrap_or_else(|| panic!("no fields in {answer:?}"))
        .iter()
        .map(|f| {
            (
                f["field"].as_str().unwrap_or_default().to_string(),
                f["message"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn assert_json_error(answer: &Answer, status: u16) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert!(
        answer.content_type.starts_with("application/json"),
        "{answer:?}"
    );
    assert!(
        answer.body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "no error message in {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_posted_user_becomes_a_readable_row() {
    let mut env = TestEnv::new("api_post").await;
    // A slow batch flush, so the row is certainly not there right after the POST.
    env.set("USERS_BATCH_TIMEOUT_MS", "1500");
    env.declare();
    let mut warren = env.start(&["--roles", "api,consumer"]);
    let http = Http::new(&env);
    http.wait_status("/healthz", 200, Duration::from_secs(20))
        .await;
    http.wait_status("/readyz", 200, Duration::from_secs(20))
        .await;
    let ready = http.get("/readyz");
    assert_eq!(ready.body, json!({"broker": true, "database": true}));

    let email = format!("ana-{}@example.com", Uuid::new_v4().simple());
    let created = http.post(
        "/api/v1/users",
        json!({"name": "Ana María", "email": email}).to_string(),
    );
    assert_eq!(created.status, 200, "{created:?}\nlog:\n{}", warren.logs());
    let id: Uuid = created.body["id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no UUID id in {created:?}"));

    let path = format!("/api/v1/users/{id}");
    let early = http.get(&path);
    assert_json_error(&early, 404);

    let mut row = None;
    wait_until("GET the user -> 200", Duration::from_secs(20), || {
        let answer = http.get(&path);
        let done = answer.status == 200;
        if done {
            row = Some(answer);
        } else {
            assert_eq!(answer.status, 404, "{answer:?}");
        }
        async move { done }
    })
    .await;
    let row = row.unwrap();
    assert_eq!(row.body["id"], json!(id.to_string()));
    assert_eq!(row.body["name"], json!("Ana María"));
    assert_eq!(row.body["email"], json!(email));
    assert!(row.body["inserted_at"].as_str().is_some(), "{row:?}");
    assert_eq!(env.row_ids().await, [id].into_iter().collect());

    // A path that is not a UUID is a client error, not a 404 or a 500.
    let bad = http.get("/api/v1/users/not-a-uuid");
    assert_json_error(&bad, 400);

    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_users_get_422_naming_the_field() {
    let env = TestEnv::new("api_422").await;
    env.declare();
    let mut warren = env.start(&["--roles", "api"]);
    let http = Http::new(&env);
    http.wait_status("/readyz", 200, Duration::from_secs(20))
        .await;

    let field_cases: Vec<(&str, String, &str)> = vec![
        (
            "missing name",
            json!({"email": "a@example.com"}).to_string(),
            "name",
        ),
        ("missing email", json!({"name": "Ana"}).to_string(), "email"),
        (
            "empty name",
            json!({"name": "", "email": "a@example.com"}).to_string(),
            "name",
        ),
        (
            "blank name",
            json!({"name": "   ", "email": "a@example.com"}).to_string(),
            "name",
        ),
        (
            "bad email",
            json!({"name": "Ana", "email": "not-an-email"}).to_string(),
            "email",
        ),
        (
            "name of the wrong type",
            json!({"name": 5, "email": "a@example.com"}).to_string(),
            "name",
        ),
        (
            "email of the wrong type",
            json!({"name": "Ana", "email": true}).to_string(),
            "email",
        ),
    ];
    for (case, body, field) in &field_cases {
        let answer = http.post("/api/v1/users", body);
        assert_json_error(&answer, 422);
        let named: Vec<String> = fields(&answer).into_iter().map(|(f, _)| f).collect();
        assert_eq!(named, vec![field.to_string()], "{case}: {answer:?}");
    }
    // Both fields wrong: both are named.
    let answer = http.post(
        "/api/v1/users",
        json!({"name": "", "email": "x"}).to_string(),
    );
    assert_json_error(&answer, 422);
    let named: Vec<String> = fields(&answer).into_iter().map(|(f, _)| f).collect();
    assert_eq!(named, vec!["name".to_string(), "email".to_string()]);

    // Bodies that are not a JSON object at all: the error says what was expected.
    let answer = http.post("/api/v1/users", "this is not json");
    assert_json_error(&answer, 422);
    assert!(
        answer.body["error"].as_str().unwrap().contains("JSON"),
        "{answer:?}"
    );
    let answer = http.post(
        "/api/v1/users",
        json!([{"name": "Ana", "email": "a@example.com"}]).to_string(),
    );
    assert_json_error(&answer, 422);
    assert!(
        answer.body["error"].as_str().unwrap().contains("object"),
        "{answer:?}"
    );

    // Nothing invalid reached the broker.
    assert_queue_empty(&env, &env.main_queue).await;
    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_64_kib_get_413() {
    const LIMIT: usize = 64 * 1024;
    let env = TestEnv::new("api_413").await;
    env.declare();
    let mut warren = env.start(&["--roles", "api"]);
    let http = Http::new(&env);
    http.wait_status("/readyz", 200, Duration::from_secs(20))
        .await;

    // A valid user padded with whitespace to exactly the limit is accepted ...
    let user = json!({"name": "Ana", "email": "ana@example.com"}).to_string();
    let exact = format!("{user}{}", " ".repeat(LIMIT - user.len()));
    assert_eq!(exact.len(), LIMIT);
    let answer = http.post("/api/v1/users", &exact);
    assert_eq!(answer.status, 200, "{answer:?}");

    // ... one byte more is refused, whatever it contains.
    let over = format!("{exact} ");
    let answer = http.post("/api/v1/users", &over);
    assert_json_error(&answer, 413);
    let big = format!(
        r#"{{"name":"{}","email":"ana@example.com"}}"#,
        "a".repeat(LIMIT)
    );
    let answer = http.post("/api/v1/users", &big);
    assert_json_error(&answer, 413);

    // Without a Content-Length (chunked), the limit holds while reading.
    let url = format!("{}/api/v1/users", http.base);
    let chunked = Http::answer(tokio::task::block_in_place(|| {
        http.agent
            .post(&url)
            .header("content-type", "application/json")
            .send(ureq::SendBody::from_owned_reader(std::io::Cursor::new(
                big.clone().into_bytes(),
            )))
    }));
    assert_json_error(&chunked, 413);

    // Only the accepted one was published.
    assert_eq!(env.queue_state(&env.main_queue).await.0, 1);
    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_broker_gives_503_fast() {
    let mut env = TestEnv::new("api_503").await;
    env.declare();
    let closed = free_port();
    env.set(
        "AMQP_URL",
        format!("amqp://guest:guest@127.0.0.1:{closed}/%2f"),
    );
    let mut warren = env.start(&["--roles", "api"]);
    let http = Http::new(&env);
    http.wait_status("/healthz", 200, Duration::from_secs(20))
        .await;

    let started = Instant::now();
    let ready = http.get("/readyz");
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(ready.body, json!({"broker": false, "database": true}));
    assert!(started.elapsed() < Duration::from_secs(5));

    let started = Instant::now();
    let answer = http.post(
        "/api/v1/users",
        json!({"name": "Ana", "email": "ana@example.com"}).to_string(),
    );
    let took = started.elapsed();
    assert_json_error(&answer, 503);
    assert!(took < Duration::from_secs(5), "503 took {took:?}");

    // Liveness is not readiness: the process itself is fine.
    assert_eq!(http.get("/healthz").status, 200);
    warren.terminate_ok(Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_recovers_by_itself_when_the_broker_comes_back() {
    let mut env = TestEnv::new("api_back").await;
    env.declare();
    // The API reaches the broker through a proxy the test can cut.
    let proxy = TcpProxy::start(&amqp_url(), 5672).await;
    env.set("AMQP_URL", proxy.url());
    let mut warren = env.start(&["--roles", "api,consumer"]);
    let http = Http::new(&env);
    http.wait_status("/readyz", 200, Duration::from_secs(20))
        .await;
    let user = json!({"name": "Ana", "email": "ana-before@example.com"}).to_string();
    assert_eq!(http.post("/api/v1/users", user).status, 200);

    // The broker goes away: 503 quickly, readiness says so.
    proxy.cut();
    wait_until(
        "readyz reports the broker down",
        Duration::from_secs(15),
        || async { http.get("/readyz").status == 503 },
    )
    .await;
    let started = Instant::now();
    let during = json!({"name": "Ana", "email": "ana-during@example.com"}).to_string();
    assert_json_error(&http.post("/api/v1/users", during), 503);
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "503 took {:?}",
        started.elapsed()
    );

    // It comes back: the API recovers with no restart, and what it accepts is inserted.
    proxy.restore();
    http.wait_status("/readyz", 200, Duration::from_secs(40))
        .await;
    let after = json!({"name": "Ana", "email": "ana-after@example.com"}).to_string();
    let answer = http.post("/api/v1/users", after);
    assert_eq!(answer.status, 200, "{answer:?}");
    let id = answer.body["id"].as_str().expect("an id").to_string();
    wait_until(
        "the row accepted after the outage",
        Duration::from_secs(30),
        || async { http.get(&format!("/api/v1/users/{id}")).status == 200 },
    )
    .await;
    warren.terminate_ok(Duration::from_secs(30));
}
