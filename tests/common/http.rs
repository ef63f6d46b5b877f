//! HTTP: the env's API address (`http_base`), `http_agent`, `http` (one request to the API),
//! `wait_ready` (the API's `/readyz` answers 200: its publisher's link and its database are up)
//! and `metrics_get` (one `GET` on the metrics listener: `/metrics`, `/healthz`, `/readyz`).

use std::time::Duration;

use super::env::TestEnv;

impl TestEnv {
    /// The warren process's HTTP base URL.
    pub fn http_base(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }
}

/// A blocking HTTP client that returns every status as a value (no error for 4xx/5xx), with a
/// 15 s bound on each request.
pub fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(15)))
        .build()
        .into()
}

/// (status, body) of one request to the env's API: `GET`, or `POST` or `PUT` of a JSON `body`; `None`
/// if nothing answers.
pub async fn http(
    env: &TestEnv,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Option<(u16, String)> {
    let url = format!("{}{path}", env.http_base());
    let method = method.to_string();
    let body = body.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        let agent = http_agent();
        let response = match (method.as_str(), body) {
            ("POST", Some(b)) => agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b.as_bytes()),
            ("PUT", Some(b)) => agent
                .put(&url)
                .header("content-type", "application/json")
                .send(b.as_bytes()),
            _ => agent.get(&url).call(),
        };
        response.ok().map(|mut r| {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        })
    })
    .await
    .expect("http task")
}

/// Waits until the env's API answers `/readyz` with 200 (its publisher's link to the broker and
/// its database are up), at most `timeout`; panics with the last answer after it. Wait for this,
/// not `/healthz`, before a request that publishes: `/healthz` answers as soon as the listener
/// runs, while a `POST` before the publisher's link is up answers 503.
pub async fn wait_ready(env: &TestEnv, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let answer = http(env, "GET", "/readyz", None).await;
        if matches!(answer, Some((200, _))) {
            return;
        }
        if std::time::Instant::now() > deadline {
            panic!("the API not ready within {timeout:?}: /readyz answered {answer:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// (status, body) of `GET path` on the env's metrics listener (`METRICS_ADDR`); `None` while
/// nothing answers.
pub async fn metrics_get(env: &TestEnv, path: &str) -> Option<(u16, String)> {
    let url = format!("http://127.0.0.1:{}{path}", env.metrics_port);
    tokio::task::spawn_blocking(move || {
        http_agent().get(&url).call().ok().map(|mut r| {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        })
    })
    .await
    .expect("metrics listener task")
}
