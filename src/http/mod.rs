//! The HTTP API (actix-web): `POST /api/v1/users` and `PUT /api/v1/users/{id}` publish a user
//! with a broker confirm (idempotently: `PUT` with the client's id, `POST` with an id derived from
//! its `Idempotency-Key`), `GET /api/v1/users/{id}` reads the row or the message's parked fate,
//! `/healthz` and `/readyz` for orchestrators; `pipelines` serves the same three for each
//! configured pipeline with `api = true`. It has its own bounded database pool, starts and answers
//! while the broker or the database is away (503), and recovers by itself. `ops` is the other
//! listener, on `METRICS_ADDR` and every role: `/metrics`, `/healthz`, `/readyz`.

pub mod ops;
pub mod pipelines;

use std::net::SocketAddr;
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

use crate::amqp::AmqpError;
use crate::amqp::publisher::{IsConnected, Publish, Publisher, traced_json_properties};
use crate::config::Settings;
use crate::db::{DbError, dead_letters};
use crate::domain::users::{FieldError, User, validate};

/// Largest accepted request body.
pub const BODY_LIMIT: usize = 64 * 1024;

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
    exchange: String,
    routing_key: String,
    /// `PUBLISH_LATENCY_HEADER`: what the API publishes carries `x-published-ms`.
    latency_header: bool,
    /// `MAX_MESSAGE_BYTES`: a larger body is what the pipeline refuses unread, so the API
    /// refuses it with 422 instead of publishing it to be parked.
    max_message_bytes: usize,
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

/// Binds `HTTP_ADDR` and serves the API in the background; `pool` is the API's own (see
/// [`crate::db::pool_for`]).
pub async fn serve(settings: &Settings, pool: Pool) -> anyhow::Result<Api> {
    let addr: SocketAddr = crate::config::listen_addr(&settings.http_addr)
        .map_err(|e| anyhow::anyhow!("HTTP_ADDR {}: {e}", settings.http_addr))?;
    let publisher = actix::Actor::start(Publisher::new(
        settings.clone(),
        "api",
        crate::amqp::Frames::Small,
        crate::events::publisher_link,
    ));
    let mapped = pipelines::PipelineApi::all(settings)?;
    // A file's pipeline named users replaces the built-in one, and its API the typed one.
    let typed_users = !settings.pipelines.iter().any(|p| p.name == "users");
    let state = web::Data::new(AppState {
        publisher: publisher.clone(),
        pool,
        exchange: settings.main_exchange.clone(),
        routing_key: settings.main_queue.clone(),
        latency_header: settings.publish_latency_header,
        max_message_bytes: settings.max_message_bytes,
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
            .route("/healthz", web::get().to(healthz))
            .route("/readyz", web::get().to(readyz))
            .configure(|config| {
                if typed_users {
                    config
                        .route("/api/v1/users", web::post().to(create_user))
                        .service(
                            web::resource("/api/v1/users/{id}")
                                .route(web::get().to(get_user))
                                .route(web::put().to(put_user)),
                        );
                }
                for api in &mapped {
                    pipelines::routes(config, api.clone());
                }
            })
            .default_service(web::to(|| async {
                HttpResponse::NotFound().json(json!({"error": "no such route"}))
            }))
    })
    .workers(2)
    .disable_signals()
    .shutdown_timeout(5)
    .bind(addr)
    .map_err(|e| anyhow::anyhow!("HTTP_ADDR {addr}: {e}"))?
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

fn error(status: StatusCode, message: impl Into<String>) -> HttpResponse {
    HttpResponse::build(status).json(json!({"error": message.into()}))
}

fn unprocessable(message: &str, fields: Vec<FieldError>) -> HttpResponse {
    HttpResponse::UnprocessableEntity().json(json!({"error": message, "fields": fields}))
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

/// Reads the body up to [`BODY_LIMIT`]; `Err` is the response to send.
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
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| error(StatusCode::BAD_REQUEST, format!("cannot read body: {e}")))?;
        if body.len() + chunk.len() > BODY_LIMIT {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Takes a required string field, or records why it cannot.
fn string_field<'a>(
    object: &'a serde_json::Map<String, Value>,
    field: &'static str,
    errors: &mut Vec<FieldError>,
) -> Option<&'a str> {
    match object.get(field) {
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            errors.push(FieldError {
                field,
                message: "must be a string".into(),
            });
            None
        }
        None => {
            errors.push(FieldError {
                field,
                message: "is required".into(),
            });
            None
        }
    }
}

/// Reads and validates a `{"name","email"}` body into a user with `id`. With `path_id` (a
/// `PUT`), an `"id"` in the body must be that id. `Err` is the response to send.
async fn read_user(
    req: &HttpRequest,
    payload: web::Payload,
    id: Uuid,
    path_id: Option<Uuid>,
) -> Result<User, HttpResponse> {
    let body = read_body(req, payload).await?;
    // Read as the pipelines read a body: a key twice in one object is refused (JSON parsers
    // disagree on which counts; the users pipeline refuses such a message, so the API must not
    // publish one reading of it).
    let value: Value = std::str::from_utf8(&body)
        .map_err(|e| format!("not UTF-8: {e}"))
        .and_then(|text| crate::domain::mapping::parse_strict(text).map_err(|e| e.to_string()))
        .map_err(|e| unprocessable(&format!("body is not valid JSON: {e}"), Vec::new()))?;
    let Some(object) = value.as_object() else {
        return Err(unprocessable(
            "body must be a JSON object with name and email",
            Vec::new(),
        ));
    };
    // Unknown fields as the users pipeline reads them: refused, never dropped (it parks such a
    // message as invalid_payload; the API must not publish a reading of it without them).
    if let Some(unknown) = object
        .keys()
        .find(|k| !matches!(k.as_str(), "id" | "name" | "email"))
    {
        return Err(unprocessable(
            &format!(
                "unknown field {:?}, expected one of id, name, email",
                crate::text::shown(unknown)
            ),
            Vec::new(),
        ));
    }
    let mut errors = Vec::new();
    // A POST chooses the id (new, or from its Idempotency-Key): an id in its body would be
    // ignored, so it is refused; a PUT's must be its path's.
    if path_id.is_none() && object.contains_key("id") {
        errors.push(FieldError {
            field: "id",
            message: "is chosen by the API in a POST (use PUT /api/v1/users/{id} to give one)"
                .into(),
        });
    }
    if let (Some(path_id), Some(given)) = (path_id, object.get("id")) {
        let matches = given
            .as_str()
            .and_then(|s| Uuid::parse_str(s).ok())
            .is_some_and(|given| given == path_id);
        if !matches {
            errors.push(FieldError {
                field: "id",
                message: format!("must be the id in the path ({path_id}) or left out"),
            });
        }
    }
    let name = string_field(object, "name", &mut errors);
    let email = string_field(object, "email", &mut errors);
    if let (Some(name), Some(email)) = (name, email) {
        errors.extend(validate(name, email));
    }
    match (name, email) {
        (Some(name), Some(email)) if errors.is_empty() => Ok(User {
            id,
            name: name.to_string(),
            email: email.to_string(),
        }),
        _ => Err(unprocessable("validation failed", errors)),
    }
}

/// The id a `POST` publishes under: derived from its `Idempotency-Key` (UUID v5 under
/// [`IDEMPOTENCY_NAMESPACE`]) so a retry gets the same id, or a new random one without the
/// header. `Err` is the message of the 400 to send for a malformed key.
fn post_id(req: &HttpRequest) -> Result<Uuid, String> {
    let mut values = req.headers().get_all("idempotency-key");
    let Some(key) = values.next() else {
        return Ok(Uuid::new_v4());
    };
    if values.next().is_some() {
        return Err("Idempotency-Key header: expected one value, got several".into());
    }
    let key = key.as_bytes();
    if key.is_empty()
        || key.len() > IDEMPOTENCY_KEY_MAX
        || !key.iter().all(|b| b.is_ascii_graphic())
    {
        return Err(format!(
            "Idempotency-Key header: expected 1 to {IDEMPOTENCY_KEY_MAX} visible ASCII \
             characters (no spaces), got {} bytes",
            key.len()
        ));
    }
    Ok(Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, key))
}

/// `POST /api/v1/users`: publishes a user under a new id, or under the id derived from its
/// `Idempotency-Key`.
async fn create_user(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    let id = match post_id(&req) {
        Ok(id) => id,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    match read_user(&req, payload, id, None).await {
        Ok(user) => accept(&state, user, trace(&req).as_deref()).await,
        Err(response) => response,
    }
}

/// `PUT /api/v1/users/{id}`: publishes a user under the client's id; repeating it is safe.
async fn put_user(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    let id = match parse_id(&path) {
        Ok(id) => id,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    match read_user(&req, payload, id, Some(id)).await {
        Ok(user) => accept(&state, user, trace(&req).as_deref()).await,
        Err(response) => response,
    }
}

/// What `users` already holds for a user about to be published.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stored {
    /// Neither its id nor its email.
    Nothing,
    /// Its id, with the same name and email: it is already done.
    Same,
    /// Its id, with another name or email.
    IdConflict,
    /// Its email, under this other id.
    EmailTaken(Uuid),
}

/// Judges the rows `users` holds with `user`'s id or email, as (id, name, email).
fn judge(user: &User, rows: &[(Uuid, String, String)]) -> Stored {
    if let Some((_, name, email)) = rows.iter().find(|(id, _, _)| *id == user.id) {
        if *name == user.name && *email == user.email {
            Stored::Same
        } else {
            Stored::IdConflict
        }
    } else if let Some((other, _, _)) = rows.iter().find(|(_, _, email)| *email == user.email) {
        Stored::EmailTaken(*other)
    } else {
        Stored::Nothing
    }
}

/// Answers a valid user: refuses what the database would refuse anyway, answers what is already
/// stored, and publishes the rest. The check is best effort: when the database cannot tell
/// within [`QUERY_TIMEOUT`], the user is published and the pipeline decides.
async fn accept(state: &AppState, user: User, trace: Option<&str>) -> HttpResponse {
    let (id, email) = (user.id, user.email.clone());
    let looked_up = bounded(&state.pool, move |client| {
        async move {
            let rows = client
                .query(
                    "SELECT id, name, email FROM users WHERE id = $1 OR email = $2",
                    &[&id, &email],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect::<Vec<(Uuid, String, String)>>())
        }
        .boxed()
    })
    .await;
    match looked_up.map(|rows| judge(&user, &rows)) {
        Ok(Stored::Same) => HttpResponse::Ok().json(json!({"id": user.id})),
        Ok(Stored::IdConflict) => HttpResponse::Conflict().json(json!({
            "error": format!("user {} is already stored with another name or email", user.id),
            "kind": crate::domain::ErrorKind::IdConflict.as_str(),
            "id": user.id,
        })),
        Ok(Stored::EmailTaken(other)) => HttpResponse::Conflict().json(json!({
            "error": format!("email {} is already stored under user {other}", user.email),
            "kind": "email_taken",
            "id": other,
        })),
        Ok(Stored::Nothing) => publish(state, &user, trace).await,
        Err(e) => {
            tracing::warn!(message_id = %user.id, error = %e,
                "cannot check the users table before publishing; publishing anyway");
            publish(state, &user, trace).await
        }
    }
}

/// Publishes `user` (message id = its id) and answers 200 once the broker confirmed it.
async fn publish(state: &AppState, user: &User, trace: Option<&str>) -> HttpResponse {
    let id = match crate::amqp::headers::short(user.id.to_string()) {
        Ok(id) => id,
        // A UUID is 36 bytes: never, but an answer rather than a panic.
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("id: {e}")),
    };
    let body = match serde_json::to_vec(user) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    publish_body(
        state,
        &state.exchange,
        &state.routing_key,
        id,
        body.into(),
        trace,
    )
    .await
}

/// Why the pipeline would refuse `body` before reading it (`MAX_MESSAGE_BYTES`, as
/// `pipeline::processor` words it), as the 422 to send.
fn oversized(state: &AppState, body: &[u8]) -> Option<HttpResponse> {
    (body.len() > state.max_message_bytes).then(|| {
        HttpResponse::UnprocessableEntity().json(json!({
            "error": format!(
                "body of {} bytes exceeds MAX_MESSAGE_BYTES ({})",
                body.len(),
                state.max_message_bytes
            ),
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
    if let Some(refused) = oversized(state, &body) {
        return refused;
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

/// The `{id}` of a path; `Err` is the message of the 400 to send.
fn parse_id(path: &str) -> Result<Uuid, String> {
    Uuid::parse_str(path).map_err(|_| format!("{path:?} is not a UUID"))
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

/// What a `GET` of one row found (users', or a configured pipeline's).
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
/// `{"error", <id_field>: id, "state": "parked", "kind", "reason", "parked_at"}`.
fn parked_answer(
    id_field: &str,
    id: &str,
    kind: &str,
    reason: &str,
    parked_at: &str,
) -> HttpResponse {
    let mut body = serde_json::Map::new();
    body.insert(
        "error".into(),
        format!("message {id} was parked ({kind}) and will not be inserted unless replayed").into(),
    );
    body.insert(id_field.into(), id.into());
    body.insert("state".into(), "parked".into());
    body.insert("kind".into(), kind.into());
    body.insert("reason".into(), reason.into());
    body.insert("parked_at".into(), parked_at.into());
    HttpResponse::build(parked_status(kind)).json(Value::Object(body))
}

/// `GET /api/v1/users/{id}`: the row; else the fate of a parked message with that id; else 404.
async fn get_user(path: web::Path<String>, state: web::Data<AppState>) -> HttpResponse {
    let id = match parse_id(&path) {
        Ok(id) => id,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let found = bounded(&state.pool, move |client| {
        async move {
            let row = client
                .query_opt(
                    "SELECT id, name, email, \
                     to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
                     FROM users WHERE id = $1",
                    &[&id],
                )
                .await?;
            if let Some(row) = row {
                return Ok(Found::Row(json!({
                    "id": row.get::<_, Uuid>(0),
                    "name": row.get::<_, String>(1),
                    "email": row.get::<_, String>(2),
                    "inserted_at": row.get::<_, String>(3),
                })));
            }
            parked_fate(client, None, &id.to_string()).await
        }
        .boxed()
    })
    .await;
    match found {
        Ok(Found::Row(body)) => HttpResponse::Ok().json(body),
        Ok(Found::Parked(kind, reason, parked_at)) => {
            parked_answer("id", &id.to_string(), &kind, &reason, &parked_at)
        }
        Ok(Found::Nothing) => error(StatusCode::NOT_FOUND, format!("no user {id} (yet)")),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database unavailable: {e}"),
        ),
    }
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

    fn user(id: Uuid, name: &str, email: &str) -> User {
        User {
            id,
            name: name.into(),
            email: email.into(),
        }
    }

    #[test]
    fn stored_rows_are_judged_by_id_first_then_email() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let ana = user(a, "Ana", "ana@example.com");
        let row = |id, name: &str, email: &str| (id, name.to_string(), email.to_string());
        assert_eq!(judge(&ana, &[]), Stored::Nothing);
        assert_eq!(
            judge(&ana, &[row(a, "Ana", "ana@example.com")]),
            Stored::Same
        );
        assert_eq!(
            judge(&ana, &[row(a, "Ana B", "ana@example.com")]),
            Stored::IdConflict
        );
        assert_eq!(
            judge(&ana, &[row(a, "Ana", "other@example.com")]),
            Stored::IdConflict
        );
        assert_eq!(
            judge(&ana, &[row(b, "Bea", "ana@example.com")]),
            Stored::EmailTaken(b)
        );
        // Its id with other content and its email elsewhere: the id is what conflicts.
        assert_eq!(
            judge(
                &ana,
                &[
                    row(b, "Bea", "ana@example.com"),
                    row(a, "Ana", "x@example.com")
                ]
            ),
            Stored::IdConflict
        );
    }

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
}
