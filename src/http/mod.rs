//! The HTTP API (actix-web): `/healthz` and `/readyz` for orchestrators, and, in `pipelines`,
//! `POST /api/v1/<name>`, `PUT` and `GET /api/v1/<name>/<key>` of every pipeline with
//! `api = true` (the built-in users pipeline's `/api/v1/users` among them): a body checked by the
//! pipeline's mapping and published with a broker confirm, a row read back or the message's
//! parked fate. Here: what they share (reading a body, publishing, the `Idempotency-Key`, the
//! bounded database work, the parked answer). It has its own bounded database pool, starts and
//! answers while the broker or the database is away (503), and recovers by itself. A `HEAD` of a
//! `GET` route is answered as the `GET` without its body; a client slow to send its headers or
//! its body is answered 408 and disconnected ([`HEADER_TIMEOUT`], [`BODY_TIMEOUT`]). `ops` is the
//! other listener, on `METRICS_ADDR` and every role: `/metrics`, `/healthz`, `/readyz`.

pub mod config;
pub mod ops;
pub mod pipelines;

pub use config::{HttpConfig, HttpConfigError, ListenerConfig};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use actix_web::dev::{ServerHandle, Service};
use actix_web::http::StatusCode;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use deadpool_postgres::{Object, Pool};
use futures::StreamExt;
use futures::future::{BoxFuture, FutureExt};
use lapin::types::ShortString;
use serde_json::{Value, json};
use tokio_postgres::NoTls;
use uuid::Uuid;

use crate::amqp::publisher::{IsConnected, Publish, Publisher, traced_json_properties};
use crate::amqp::{AmqpConfig, AmqpError};
use crate::db::{DbError, dead_letters};

/// Largest accepted request body, as the client sends it (a key the API writes into it is not
/// counted here; `MAX_MESSAGE_BYTES` is the bound of what is published, [`oversized`]).
pub const BODY_LIMIT: usize = 64 * 1024;

/// How long a client may take to send a request's line and headers (actix-web's client request
/// timeout): a connection still sending them then is answered 408 and closed, so a client that
/// sends its headers slowly cannot hold connections.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client may take to send a request's body once its headers arrived: a body still
/// incomplete then is answered 408 and the connection closed.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an idle connection is kept open between requests (keep-alive).
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// Bound on the database work of one request (waiting for a connection of the API's pool and
/// the queries), so a slow or unreachable database answers 503 within seconds.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest accepted `Idempotency-Key`, in characters.
pub const IDEMPOTENCY_KEY_MAX: usize = 200;

/// The UUID v5 namespace of ids derived from an `Idempotency-Key`. Fixed forever: changing it
/// would give a retried request another id than its first attempt.
pub const IDEMPOTENCY_NAMESPACE: Uuid = Uuid::from_u128(0xcfe1_41c5_49af_4aba_bc86_7460_06d1_23dc);

/// What every handler needs.
struct AppState {
    publisher: Addr<Publisher>,
    /// The API's own pool (`API_POOL_SIZE`, `warren-api`), never the pipeline's.
    pool: Pool,
    /// `PUBLISH_LATENCY_HEADER`: what the API publishes carries `x-published-ms`.
    latency_header: bool,
    /// `MAX_MESSAGE_BYTES`: a larger body is what the pipeline refuses unread, so the API
    /// refuses it with 422 instead of publishing it to be parked.
    max_message_bytes: usize,
    /// The writes' budget (half `MAX_INFLIGHT_BYTES`, in units of [`WRITE_UNIT`]): each write holds
    /// what its body may decode to until it is answered; more wait their turn. Unbounded,
    /// concurrent POSTs of orders of 6,000 items took 2 MB each: 100 of them 231 MiB, an OOM
    /// kill under the Deployment's limit (review R38f F6).
    writes: Arc<tokio::sync::Semaphore>,
    /// The budget's size in units.
    write_units: u32,
}

/// The unit of the API's write budget.
const WRITE_UNIT: u64 = 64 << 10;

impl AppState {
    /// Waits for room for a write of `body` bytes (`nested`: the mapping has child tables, each
    /// element of an array a row of its own: counted at 64 times the body, about the most its
    /// rows hold; else twice, the body and its row), and holds it until the returned permit
    /// drops. Never more than the whole budget: a single write always goes.
    async fn room_for_write(
        &self,
        body: usize,
        nested: bool,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let factor: u64 = if nested { 64 } else { 2 };
        let units = (body as u64 * factor)
            .div_ceil(WRITE_UNIT)
            .clamp(1, u64::from(self.write_units));
        self.writes
            .clone()
            .acquire_many_owned(units as u32)
            .await
            .ok()
    }
}

/// A running API server.
pub struct Api {
    handle: ServerHandle,
    publisher: Addr<Publisher>,
}

impl Api {
    /// Stops accepting, finishes requests in flight, closes the publisher.
    pub async fn stop(self) {
        self.handle.stop(true).await;
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.publisher.send(crate::amqp::publisher::Close),
        )
        .await;
    }
}

/// Why the API could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Its configuration cannot work (an address that does not resolve, a pool of 0).
    #[error(transparent)]
    Config(#[from] HttpConfigError),
    /// The address resolved but could not be bound (in use, not this host's, no permission).
    /// The io error is in the message and is not a `source`: a report that walks the chain
    /// (`{:#}`) printed it twice.
    #[error(
        "HTTP_ADDR {addr}: cannot listen there ({error}): expected an address of this host that no \
         other process holds"
    )]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
}

/// Binds `HTTP_ADDR` and serves the API of `mapped` (each pipeline with `api = true`) in the
/// background, publishing through a link of its own to the broker of `amqp`; `pool` is the
/// API's own (see [`crate::db::pool_for`]).
pub async fn serve(
    config: &HttpConfig,
    amqp: &AmqpConfig,
    mapped: Vec<Arc<pipelines::PipelineApi>>,
    pool: Pool,
) -> Result<Api, ServeError> {
    config.validate()?;
    let addr = config.socket_addr()?;
    let publisher = actix::Actor::start(Publisher::new(
        amqp.clone(),
        "api",
        crate::amqp::Frames::Small,
        crate::events::publisher_link,
    ));
    // Half a stage's budget: the API is one more holder beside the stages (docs/failures.md).
    let write_units =
        (config.max_inflight_bytes / 2 / WRITE_UNIT).clamp(1, u64::from(u32::MAX >> 4)) as u32;
    let state = web::Data::new(AppState {
        publisher: publisher.clone(),
        pool,
        latency_header: amqp.publish_latency_header,
        max_message_bytes: config.max_message_bytes,
        writes: Arc::new(tokio::sync::Semaphore::new(write_units as usize)),
        write_units,
    });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .wrap_fn(|req, srv| {
                let route = req.match_pattern().unwrap_or_else(|| "unmatched".into());
                let started = Instant::now();
                let call = srv.call(req);
                async move {
                    let res = call.await?;
                    let status = res.status().as_u16().to_string();
                    metrics::counter!(crate::metrics::HTTP_REQUESTS, "route" => route, "status" => status)
                        .increment(1);
                    metrics::histogram!(crate::metrics::HTTP_REQUEST_SECONDS)
                        .record(started.elapsed().as_secs_f64());
                    Ok(res)
                }
            })
            .route("/healthz", get_or_head().to(healthz))
            .route("/readyz", get_or_head().to(readyz))
            .configure(|config| {
                for api in &mapped {
                    pipelines::routes(config, api.clone());
                }
            })
            .default_service(web::to(|| async {
                HttpResponse::NotFound().json(json!({"error": "no such route"}))
            }))
    })
    .workers(2)
    .client_request_timeout(HEADER_TIMEOUT)
    .client_disconnect_timeout(Duration::from_secs(1))
    .keep_alive(KEEP_ALIVE)
    .disable_signals()
    .shutdown_timeout(5)
    .bind(addr)
    .map_err(|error| ServeError::Bind { addr, error })?
    .run();
    let handle = server.handle();
    actix::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "HTTP server failed");
        }
    });
    tracing::info!(%addr, "HTTP API listening");
    Ok(Api { handle, publisher })
}

/// A route for `GET` and `HEAD` (actix-web's `web::get()` is `GET` alone, so `HEAD /healthz` was
/// a 404): a `HEAD` is answered as the `GET`, without the body.
pub(crate) fn get_or_head() -> actix_web::Route {
    use actix_web::guard;
    web::route().guard(guard::Any(guard::Get()).or(guard::Head()))
}

fn error(status: StatusCode, message: impl Into<String>) -> HttpResponse {
    HttpResponse::build(status).json(json!({"error": message.into()}))
}

/// One field at fault in a 422 answer: a column's (or the body's field it is read from), or a
/// field of the body no column reads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
struct FieldError {
    field: String,
    message: String,
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let broker = matches!(
        tokio::time::timeout(Duration::from_secs(2), state.publisher.send(IsConnected)).await,
        Ok(Ok(true))
    );
    let database = bounded(&state.pool, |client| {
        async move { client.simple_query("SELECT 1").await.map(|_| ()) }.boxed()
    })
    .await
    .is_ok();
    let body = json!({"broker": broker, "database": database});
    if broker && database {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// Reads the body up to [`BODY_LIMIT`], within [`BODY_TIMEOUT`]; `Err` is the response to send.
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
) -> Result<web::BytesMut, HttpResponse> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds {BODY_LIMIT} bytes"),
        )
    };
    let declared = req
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT) {
        return Err(too_large());
    }
    let mut body = web::BytesMut::new();
    let deadline = tokio::time::Instant::now() + BODY_TIMEOUT;
    loop {
        let next = tokio::time::timeout_at(deadline, payload.next())
            .await
            .map_err(|_| {
                error(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "request body not received within {} s ({} bytes arrived)",
                        BODY_TIMEOUT.as_secs(),
                        body.len()
                    ),
                )
            })?;
        let Some(chunk) = next else {
            return Ok(body);
        };
        let chunk =
            chunk.map_err(|e| error(StatusCode::BAD_REQUEST, format!("cannot read body: {e}")))?;
        if body.len() + chunk.len() > BODY_LIMIT {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
}

/// A malformed `Idempotency-Key` header: the message of the 400 to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum IdempotencyKeyError {
    /// The header came more than once.
    #[error("Idempotency-Key header: expected one value, got several")]
    Several,
    /// Empty, too long, or with a character that is not visible ASCII (its length in bytes).
    #[error(
        "Idempotency-Key header: expected 1 to {IDEMPOTENCY_KEY_MAX} visible ASCII characters \
         (no spaces), got {0} bytes"
    )]
    Malformed(usize),
}

/// The key a `POST` of a pipeline with `api_key = "chosen"` publishes under: derived from its
/// `Idempotency-Key` (UUID v5 under [`IDEMPOTENCY_NAMESPACE`]) so a retry gets the same key, or
/// a new random one without the header.
fn chosen_key(req: &HttpRequest) -> Result<Uuid, IdempotencyKeyError> {
    let mut values = req.headers().get_all("idempotency-key");
    let Some(key) = values.next() else {
        return Ok(Uuid::new_v4());
    };
    if values.next().is_some() {
        return Err(IdempotencyKeyError::Several);
    }
    let key = key.as_bytes();
    if key.is_empty()
        || key.len() > IDEMPOTENCY_KEY_MAX
        || !key.iter().all(|b| b.is_ascii_graphic())
    {
        return Err(IdempotencyKeyError::Malformed(key.len()));
    }
    Ok(Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, key))
}

/// Why the pipeline would refuse `body` before reading it (`MAX_MESSAGE_BYTES`, as
/// `pipeline::processor` words it), as the 422 to send. `sent` is the size of the body the
/// client sent: when the API wrote the key into it (`api_key = "chosen"`), the message says
/// both, since what is published, and so what the pipeline bounds, is the larger.
fn oversized(state: &AppState, body: &[u8], sent: usize) -> Option<HttpResponse> {
    (body.len() > state.max_message_bytes).then(|| {
        let max = state.max_message_bytes;
        let added = body.len().saturating_sub(sent);
        HttpResponse::UnprocessableEntity().json(json!({
            "error": if added == 0 {
                format!("body of {} bytes exceeds MAX_MESSAGE_BYTES ({max})", body.len())
            } else {
                format!(
                    "body of {sent} bytes is {} bytes with the key the API writes into it, \
                     which exceeds MAX_MESSAGE_BYTES ({max}): send at most {} bytes",
                    body.len(),
                    max.saturating_sub(added)
                )
            },
            "kind": crate::domain::ErrorKind::InvalidPayload.as_str(),
        }))
    })
}

/// Publishes `body` under message id `id` to `exchange` with `routing_key`, and answers 200
/// (`{"id": id}`) once the broker confirmed it, 503 when it cannot. What the pipeline or the link
/// would refuse is a 422 and is not published: a body over `MAX_MESSAGE_BYTES`, properties over
/// the link's frame (`unpublishable`; the API's own properties are bounded: a message id of at
/// most 255 bytes, a `traceparent` of at most 512, so this is a guard, not a path).
async fn publish_body(
    state: &AppState,
    exchange: &str,
    routing_key: &str,
    id: ShortString,
    body: bytes::Bytes,
    trace: Option<&str>,
) -> HttpResponse {
    if let Some(refused) = oversized(state, &body, body.len()) {
        return refused;
    }
    // Not before the start's topology check passed (a queue that drops what the broker
    // confirms must not get a 200: review R38-F8). Counted as a publish that found no broker
    // (`unavailable`), which is what it is until the check ran: WarrenPublishFailing sees it.
    if !crate::topology::gate::is_open() {
        crate::metrics::published("unavailable", Duration::ZERO);
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the broker's exchanges and queues are not checked against this configuration yet \
             (the broker could not be reached, or they were not declared, at the start); \
             try again"
                .to_string(),
        );
    }
    let shown = id.as_str().to_string();
    let publish = Publish {
        exchange: exchange.to_string(),
        routing_key: routing_key.to_string(),
        body,
        properties: traced_json_properties(id, trace, state.latency_header),
    };
    let outcome =
        tokio::time::timeout(Duration::from_secs(10), state.publisher.send(publish)).await;
    let result = match outcome {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(AmqpError::Unavailable(e.to_string())),
        Err(_) => Err(AmqpError::ConfirmTimeout(Duration::from_secs(10))),
    };
    match result {
        Ok(()) => HttpResponse::Ok().json(json!({"id": shown})),
        Err(e @ AmqpError::Unpublishable(_)) => HttpResponse::UnprocessableEntity().json(json!({
            "error": e.to_string(),
            "kind": crate::domain::ErrorKind::Unpublishable.as_str(),
        })),
        Err(e @ AmqpError::Unroutable { .. }) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{e}; run `warren declare` to create the topology"),
        ),
        Err(e) if e.to_string().contains("NOT_FOUND") => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{e}; run `warren declare` to create the topology"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// The request's W3C `traceparent` header, when it holds one valid value of at most
/// [`crate::amqp::headers::TRACEPARENT_MAX`] bytes: set on the message the request publishes. An
/// invalid or longer one is ignored, as the Trace Context specification lets a vendor do (the
/// request is neither refused nor failed over a client's own header).
pub(crate) fn trace(req: &HttpRequest) -> Option<String> {
    let mut values = req.headers().get_all(crate::amqp::headers::TRACEPARENT);
    let value = values.next()?.to_str().ok()?.trim();
    (values.next().is_none() && crate::amqp::headers::valid_traceparent(value))
        .then(|| value.to_string())
}

/// Why the API's database work failed.
#[derive(Debug, thiserror::Error)]
enum QueryError {
    /// No answer within [`QUERY_TIMEOUT`] (no free connection, or a slow statement).
    #[error("the database did not answer within {} ms", QUERY_TIMEOUT.as_millis())]
    Timeout,
    /// The pool or the server refused.
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Runs `work` on a connection of `pool`, all within [`QUERY_TIMEOUT`]. A statement still
/// running at the deadline is cancelled and its connection leaves the pool, so a slow database
/// cannot keep the API's connections.
async fn bounded<T, W>(pool: &Pool, work: W) -> Result<T, QueryError>
where
    W: for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>>,
{
    let deadline = tokio::time::Instant::now() + QUERY_TIMEOUT;
    let client = tokio::time::timeout_at(deadline, pool.get())
        .await
        .map_err(|_| QueryError::Timeout)?
        .map_err(DbError::from_pool)?;
    let outcome = tokio::time::timeout_at(deadline, work(&client)).await;
    match outcome {
        Ok(result) => result.map_err(|e| DbError::from_pg(e).into()),
        Err(_) => {
            let token = client.cancel_token();
            drop(Object::take(client));
            tokio::spawn(cancel(token));
            Err(QueryError::Timeout)
        }
    }
}

/// Asks the server to cancel a statement, within [`QUERY_TIMEOUT`].
async fn cancel(token: tokio_postgres::CancelToken) {
    let _ = tokio::time::timeout(QUERY_TIMEOUT, token.cancel_query(NoTls)).await;
}

/// What a `GET` of one row found.
enum Found {
    /// The row, as the answer's body.
    Row(Value),
    /// The message was parked in `dead_letters` (and not replayed): (kind, reason, parked at).
    Parked(String, String, String),
    /// Neither (yet).
    Nothing,
}

/// The newest open parked row with message id `id` (of `pipeline` only, when given), as
/// [`Found::Parked`], else [`Found::Nothing`].
async fn parked_fate(
    client: &Object,
    pipeline: Option<&str>,
    id: &str,
) -> Result<Found, tokio_postgres::Error> {
    Ok(match dead_letters::open_fate(client, pipeline, id).await? {
        Some(fate) => Found::Parked(fate.kind, fate.reason, fate.parked_at),
        None => Found::Nothing,
    })
}

/// The answer for a message parked (and not replayed): 422 or 409 ([`parked_status`]) with
/// `{"error", "id": id, "key": id, "state": "parked", "kind", "reason", "parked_at"}` (the
/// message id is the key).
fn parked_answer(id: &str, kind: &str, reason: &str, parked_at: &str) -> HttpResponse {
    let mut body = serde_json::Map::new();
    body.insert(
        "error".into(),
        format!("message {id} was parked ({kind}) and will not be inserted unless replayed").into(),
    );
    body.insert("id".into(), id.into());
    body.insert("key".into(), id.into());
    body.insert("state".into(), "parked".into());
    body.insert("kind".into(), kind.into());
    body.insert("reason".into(), reason.into());
    body.insert("parked_at".into(), parked_at.into());
    HttpResponse::build(parked_status(kind)).json(Value::Object(body))
}

/// The status that tells a client why its parked message was not inserted: 422 when the
/// message itself was bad, 409 when it clashed with what the database holds (or ran out of
/// retries).
fn parked_status(kind: &str) -> StatusCode {
    match crate::domain::ErrorKind::parse(kind) {
        Some(k) if k.is_invalid_input() => StatusCode::UNPROCESSABLE_ENTITY,
        _ => StatusCode::CONFLICT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_kinds_map_to_422_or_409() {
        assert_eq!(
            parked_status("invalid_json"),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            parked_status("invalid_payload"),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(parked_status("db_permanent"), StatusCode::CONFLICT);
        assert_eq!(parked_status("retries_exhausted"), StatusCode::CONFLICT);
        assert_eq!(parked_status("something_new"), StatusCode::CONFLICT);
    }

    #[test]
    fn the_idempotency_namespace_never_changes() {
        // Ids already handed out depend on it.
        assert_eq!(
            IDEMPOTENCY_NAMESPACE.to_string(),
            "cfe141c5-49af-4aba-bc86-746006d123dc"
        );
        let id = Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, b"order-42");
        assert_eq!(id.get_version_num(), 5);
        assert_eq!(id, Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, b"order-42"));
    }

    /// A key's header in its three shapes: none (a random key), one good value (its UUID v5),
    /// and the malformed ones, each a typed error whose words are the 400's message.
    #[test]
    fn a_chosen_key_is_derived_or_refused_in_the_api_s_words() {
        use actix_web::test::TestRequest;
        let none = TestRequest::default().to_http_request();
        assert_eq!(chosen_key(&none).map(|k| k.get_version_num()), Ok(4));
        let one = TestRequest::default()
            .insert_header(("Idempotency-Key", "order-42"))
            .to_http_request();
        assert_eq!(
            chosen_key(&one),
            Ok(Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, b"order-42"))
        );
        let two = TestRequest::default()
            .append_header(("Idempotency-Key", "a"))
            .append_header(("Idempotency-Key", "b"))
            .to_http_request();
        assert_eq!(chosen_key(&two), Err(IdempotencyKeyError::Several));
        assert_eq!(
            IdempotencyKeyError::Several.to_string(),
            "Idempotency-Key header: expected one value, got several"
        );
        for bad in [
            "with space".to_string(),
            "k".repeat(IDEMPOTENCY_KEY_MAX + 1),
        ] {
            let req = TestRequest::default()
                .insert_header(("Idempotency-Key", bad.as_str()))
                .to_http_request();
            assert_eq!(
                chosen_key(&req),
                Err(IdempotencyKeyError::Malformed(bad.len()))
            );
        }
        assert_eq!(
            IdempotencyKeyError::Malformed(201).to_string(),
            "Idempotency-Key header: expected 1 to 200 visible ASCII characters (no spaces), \
             got 201 bytes"
        );
    }
}
