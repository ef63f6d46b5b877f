//! The HTTP API (actix-web): `POST /api/v1/users` publishes a user with a broker confirm,
//! `GET /api/v1/users/{id}` reads the row, `/healthz` and `/readyz` for orchestrators. It starts
//! and answers while the broker or the database is away (503), and recovers by itself.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use actix::Addr;
use actix_web::dev::{ServerHandle, Service};
use actix_web::http::StatusCode;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use deadpool_postgres::Pool;
use futures::StreamExt;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::amqp::AmqpError;
use crate::config::Settings;
use crate::db::{self, DbError};
use crate::domain::users::{FieldError, User, validate};
use crate::pipeline::publisher::{IsConnected, Publish, Publisher, json_properties};

/// Largest accepted request body.
pub const BODY_LIMIT: usize = 64 * 1024;

/// What every handler needs.
struct AppState {
    publisher: Addr<Publisher>,
    pool: Pool,
    exchange: String,
    routing_key: String,
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
            self.publisher.send(crate::pipeline::publisher::Close),
        )
        .await;
    }
}

/// Binds `HTTP_ADDR` and serves the API in the background.
pub async fn serve(settings: &Settings, pool: Pool) -> anyhow::Result<Api> {
    let addr: SocketAddr = settings.http_addr.parse()?;
    let publisher = actix::Actor::start(Publisher::new(settings.clone(), "api"));
    let state = web::Data::new(AppState {
        publisher: publisher.clone(),
        pool,
        exchange: settings.main_exchange.clone(),
        routing_key: settings.main_queue.clone(),
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
            .route("/api/v1/users", web::post().to(create_user))
            .route("/api/v1/users/{id}", web::get().to(get_user))
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
    let database = matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            db::ping(&state.pool, Duration::from_secs(2))
        )
        .await,
        Ok(Ok(()))
    );
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

async fn create_user(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    let body = match read_body(&req, payload).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return unprocessable(&format!("body is not valid JSON: {e}"), Vec::new()),
    };
    let Some(object) = value.as_object() else {
        return unprocessable("body must be a JSON object with name and email", Vec::new());
    };
    let mut errors = Vec::new();
    let name = string_field(object, "name", &mut errors);
    let email = string_field(object, "email", &mut errors);
    if let (Some(name), Some(email)) = (name, email) {
        errors.extend(validate(name, email));
    }
    if !errors.is_empty() {
        return unprocessable("validation failed", errors);
    }
    let (Some(name), Some(email)) = (name, email) else {
        return unprocessable("validation failed", errors);
    };
    let user = User {
        id: Uuid::new_v4(),
        name: name.to_string(),
        email: email.to_string(),
    };
    let id = user.id.to_string();
    let body = match serde_json::to_vec(&user) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let publish = Publish {
        exchange: state.exchange.clone(),
        routing_key: state.routing_key.clone(),
        body,
        properties: json_properties(&id),
    };
    let outcome =
        tokio::time::timeout(Duration::from_secs(10), state.publisher.send(publish)).await;
    let result = match outcome {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(AmqpError::Unavailable(e.to_string())),
        Err(_) => Err(AmqpError::ConfirmTimeout(Duration::from_secs(10))),
    };
    match result {
        Ok(()) => HttpResponse::Ok().json(json!({"id": id})),
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

async fn get_user(path: web::Path<String>, state: web::Data<AppState>) -> HttpResponse {
    let Ok(id) = Uuid::parse_str(&path) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!("{:?} is not a UUID", path.as_str()),
        );
    };
    let result = async {
        let client = state.pool.get().await.map_err(DbError::from_pool)?;
        client
            .query_opt(
                "SELECT id, name, email, \
                 to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
                 FROM users WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(DbError::from_pg)
    }
    .await;
    match result {
        Ok(Some(row)) => HttpResponse::Ok().json(json!({
            "id": row.get::<_, Uuid>(0),
            "name": row.get::<_, String>(1),
            "email": row.get::<_, String>(2),
            "inserted_at": row.get::<_, String>(3),
        })),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no user {id} (yet)")),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database unavailable: {e}"),
        ),
    }
}
