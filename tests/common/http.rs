//! HTTP: the env's API address (`http_base`), `http_agent`, `http` (one request to the API) and
//! `metrics_get` (one `GET` on the metrics listener: `/metrics`, `/healthz`, `/readyz`).

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
