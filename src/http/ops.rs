//! The metrics listener on `METRICS_ADDR`, on every role: `GET /metrics` (the Prometheus
//! scrape), `/healthz` (the process and its runtime answer), `/readyz` (the links the roles need
//! are up, from the same state as `warren_connection_up`, [`crate::metrics::readiness`]; open
//! breakers are named in the body and leave it ready), and 404 on any other path. It runs on
//! the runtime of the pipeline itself, so an answer from `/healthz` means that runtime is not
//! stuck; under systemd's `WatchdogSec=` the same runtime pings the watchdog.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

/// The paths this listener serves, for the 404's message.
const PATHS: &str = "/metrics, /healthz and /readyz";

/// How long a client may take to send its request's headers before the connection is closed.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the metrics listener could not start.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// `METRICS_ADDR` does not resolve.
    #[error(transparent)]
    Config(#[from] super::HttpConfigError),
    /// The address resolved but could not be bound.
    /// The io error is in the message and is not a `source`: a report that walks the chain
    /// (`{:#}`) printed it twice.
    #[error(
        "METRICS_ADDR {addr}: cannot listen there ({error}): expected an address of this host that no \
         other process holds"
    )]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
}

/// Binds `METRICS_ADDR` (`config`) and serves the listener on the current runtime until the
/// process exits, so `/metrics` answers through the whole shutdown.
pub async fn serve(
    config: &super::ListenerConfig,
    metrics: PrometheusHandle,
) -> Result<(), ListenError> {
    let addr = config.socket_addr()?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| ListenError::Bind { addr, error })?;
    // The port bound, not the one asked for: `METRICS_ADDR=127.0.0.1:0` gets one from the system.
    let addr = listener.local_addr().unwrap_or(addr);
    tokio::spawn(accept(listener, metrics));
    info!(%addr, "metrics listening (/metrics, /healthz, /readyz)");
    watchdog();
    Ok(())
}

/// Under systemd with `WatchdogSec=` (it sets `WATCHDOG_USEC`), tells the watchdog twice a
/// period that this runtime answers, the liveness `/healthz` reports; systemd restarts a warren
/// whose runtime stopped answering. Nothing without it.
fn watchdog() {
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    info!(
        period_ms = period.as_millis() as u64,
        "pinging the systemd watchdog"
    );
    tokio::spawn(async move {
        let mut every = tokio::time::interval(period / 2);
        loop {
            every.tick().await;
            if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
                warn!(error = %e, "cannot ping the systemd watchdog (NOTIFY_SOCKET); giving up");
                return;
            }
        }
    });
}

/// Accepts connections forever, each served on a task of its own.
async fn accept(listener: TcpListener, metrics: PrometheusHandle) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: wait rather than spin.
                warn!(error = %e, "metrics listener cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| answer(req, metrics.clone()));
            if let Err(e) = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %e, "metrics listener: connection ended with an error");
            }
        });
    }
}

/// One request's answer.
async fn answer(
    req: Request<Incoming>,
    metrics: PrometheusHandle,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path();
    if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": format!("no such path {path:?}; this listener serves {PATHS}")}),
        ));
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut response = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"error": format!("{} {path}: only GET and HEAD", req.method())}),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(response);
    }
    Ok(match path {
        "/metrics" => scrape(metrics).await,
        "/healthz" => json_response(StatusCode::OK, &json!({"status": "ok"})),
        _ => {
            let readiness = crate::metrics::readiness();
            let status = if readiness.ready() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            json_response(status, &json!(readiness))
        }
    })
}

/// The Prometheus text exposition, rendered off the runtime's thread (it walks every series).
async fn scrape(metrics: PrometheusHandle) -> Response<Full<Bytes>> {
    match tokio::task::spawn_blocking(move || crate::metrics::render(&metrics)).await {
        Ok(text) => {
            let mut response = Response::new(Full::new(Bytes::from(text)));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        Err(e) => json_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": format!("cannot render the metrics: {e}")}),
        ),
    }
}

/// A response with `status` and `body` as JSON.
fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
