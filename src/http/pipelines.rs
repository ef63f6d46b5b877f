//! The HTTP API of a configured pipeline with `api = true`: `POST /api/v1/<name>` checks a
//! message body with the pipeline's mapping (as `warren pipelines test` does) and publishes it,
//! byte for byte, to the pipeline's exchange with a broker confirm; `PUT /api/v1/<name>/<key>`
//! does the same for a body whose key is the one in the path; `GET /api/v1/<name>/<key>` reads the
//! row (as JSON, every column), else the fate of a message parked under the pipeline with that key
//! as its message id, else 404. The message id of a published message is its key, so a retried
//! request is the same message to the pipeline (the same key and content: one row).
//!
//! What the pipeline would refuse is refused at once (422, with the kind and reason the DLQ would
//! carry: a body over `MAX_MESSAGE_BYTES`, one the mapping refuses); so is a key no message id can
//! carry (over 255 bytes: the pipeline would store such a message from a publisher that picks
//! its own message id, but the API's promises, one message per key and `GET` of its fate, rest
//! on the key being the message id). Whether the key is already stored with other content is the
//! pipeline's to decide (`on_conflict`), and `GET` tells it afterwards.

use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::future::FutureExt;
use serde_json::{Value, json};

use lapin::types::ShortString;

use super::{
    AppState, Found, QueryError, bounded, error, oversized, parked_answer, parked_fate,
    publish_body, read_body, trace,
};
use crate::amqp::headers;
use crate::config::pipelines::PipelineConfig;
use crate::config::{ConfigError, Settings};
use crate::domain::mapping::{Cell, Mapping, Row};

/// One pipeline's API: its mapping, where it publishes, and its table's key.
pub struct PipelineApi {
    pub name: String,
    mapping: Mapping,
    exchange: String,
    routing_key: String,
    /// The key column's position in the mapping's columns, and its name.
    key_index: usize,
    key_column: String,
}

impl PipelineApi {
    /// The API of every pipeline of `settings` with `api = true`. A pipeline named `users` in the
    /// file replaces the typed users API.
    pub fn all(settings: &Settings) -> Result<Vec<Arc<Self>>, ConfigError> {
        settings
            .pipelines
            .iter()
            .filter(|p| p.api)
            .map(|p| Self::new(p, settings).map(Arc::new))
            .collect()
    }

    fn new(p: &PipelineConfig, settings: &Settings) -> Result<Self, ConfigError> {
        let mapping = p.mapping()?;
        let names = p.names(settings);
        let [key] = p.key.as_slice() else {
            // Checked when the configuration loads; kept here so a caller cannot get past it.
            return Err(ConfigError::Pipeline(format!(
                "pipelines.{}.api: true needs a one-column key",
                p.name
            )));
        };
        let key_index = mapping
            .columns()
            .position(|(c, _, _)| c == key)
            .ok_or_else(|| ConfigError::Pipeline(format!("pipelines.{}: no key column", p.name)))?;
        Ok(Self {
            name: p.name.clone(),
            mapping,
            exchange: names.main_exchange,
            routing_key: names.main_queue,
            key_index,
            key_column: key.clone(),
        })
    }

    /// Whether `path` names `key`: the same text, or the same UUID written otherwise (upper case).
    fn same_key(&self, key: &str, path: &str) -> bool {
        key == path
            || matches!(
                (uuid::Uuid::parse_str(key), uuid::Uuid::parse_str(path)),
                (Ok(a), Ok(b)) if a == b
            )
    }

    /// The key of a decoded row as text (the message id it is published under).
    fn key_of(&self, row: &crate::domain::mapping::Row) -> Option<String> {
        Some(match row.0.get(self.key_index)? {
            Cell::Null => return None,
            Cell::Text(s) | Cell::Numeric(s) | Cell::Timestamptz(s) | Cell::Date(s) => s.clone(),
            Cell::Jsonb(s) => s.clone(),
            Cell::Uuid(u) => u.to_string(),
            Cell::Int4(n) => n.to_string(),
            Cell::Int8(n) => n.to_string(),
            Cell::Float8(f) => f.to_string(),
            Cell::Bool(b) => b.to_string(),
        })
    }
}

/// Registers the routes of `api` on `config`.
pub fn routes(config: &mut web::ServiceConfig, api: Arc<PipelineApi>) {
    let data = web::Data::from(api.clone());
    config.service(
        web::resource(format!("/api/v1/{}", api.name))
            .app_data(data.clone())
            .route(web::post().to(post)),
    );
    config.service(
        web::resource(format!("/api/v1/{}/{{key}}", api.name))
            .app_data(data)
            .route(web::get().to(get))
            .route(web::put().to(put)),
    );
}

/// Checks `body` as the pipeline would (its size first, unread, then the mapping) and its key as
/// the message id it is published under; `Ok` is the key (as text, and as the message id),
/// `Err` the 422 to send.
fn check(
    state: &AppState,
    api: &PipelineApi,
    body: &[u8],
) -> Result<(String, ShortString, Row), Box<HttpResponse>> {
    if let Some(refused) = oversized(state, body) {
        return Err(Box::new(refused));
    }
    let row = api.mapping.decode_message(body, None).map_err(|r| {
        Box::new(HttpResponse::UnprocessableEntity().json(json!({
            "error": r.reason,
            "kind": r.kind.as_str(),
        })))
    })?;
    let key = api.key_of(&row).ok_or_else(|| {
        Box::new(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("the key column {} is null", api.key_column),
        ))
    })?;
    let id = headers::short(key.as_str()).map_err(|e| {
        Box::new(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "key {}: at most {} bytes as a message id, found {}",
                api.key_column,
                headers::SHORT_MAX,
                e.len
            ),
        ))
    })?;
    Ok((key, id, row))
}

/// Whether PostgreSQL can hold `row`'s values in the pipeline's table, asked as the pipeline's
/// insert would write them (a value too long for a `varchar(n)`, out of an `int2`'s range,
/// refused by a domain's CHECK, not a label of an enum): `Err` is the 422 to send, with the
/// database's words, kind `db_permanent` as the pipeline would park it. A database that does
/// not answer within the API's query bound cannot say: the body is published unprobed, and the
/// pipeline decides when the database is back (a queue's point is that writes do not wait for
/// the database).
async fn storable(state: &AppState, api: &Arc<PipelineApi>, row: Row) -> Result<(), HttpResponse> {
    let probe = {
        let api = api.clone();
        bounded(&state.pool, move |client| {
            async move { api.mapping.storable(client, &row).await }.boxed()
        })
        .await
    };
    match probe {
        Ok(Err(reason)) => Err(HttpResponse::UnprocessableEntity().json(json!({
            "error": crate::text::shown(&reason),
            "kind": "db_permanent",
        }))),
        Ok(Ok(())) => Ok(()),
        Err(e) => {
            tracing::warn!(pipeline = %api.name, error = %e,
                "the database did not say whether it can hold the body; published unprobed");
            Ok(())
        }
    }
}

/// `POST /api/v1/<name>`: a message body, checked and published under its key.
async fn post(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let body = match read_body(&req, payload).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    match check(&state, &api, &body) {
        Ok((_, id, row)) => {
            if let Err(refused) = storable(&state, &api.clone().into_inner(), row).await {
                return refused;
            }
            let trace = trace(&req);
            publish_body(
                &state,
                &api.exchange,
                &api.routing_key,
                id,
                body.freeze(),
                trace.as_deref(),
            )
            .await
        }
        Err(response) => *response,
    }
}

/// `PUT /api/v1/<name>/<key>`: as `POST`, for a body whose key is the one in the path.
async fn put(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let path = match path_key(&req) {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let body = match read_body(&req, payload).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    match check(&state, &api, &body) {
        Ok((key, id, row)) if api.same_key(&key, &path) => {
            if let Err(refused) = storable(&state, &api.clone().into_inner(), row).await {
                return refused;
            }
            let trace = trace(&req);
            publish_body(
                &state,
                &api.exchange,
                &api.routing_key,
                id,
                body.freeze(),
                trace.as_deref(),
            )
            .await
        }
        Ok((key, _, _)) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "the body's key {} ({key:?}) must be the one in the path ({:?})",
                api.key_column,
                path.as_str()
            ),
        ),
        Err(response) => *response,
    }
}

/// The key of the request's path (its last segment), percent-decoded strictly: bytes that are
/// not UTF-8 (`%FF`, a cut `%C3`) are no text key, so a 400, never read as U+FFFD and answered
/// with the row of that other key (found by the review).
fn path_key(req: &HttpRequest) -> Result<String, Box<HttpResponse>> {
    let raw = req.uri().path().rsplit('/').next().unwrap_or_default();
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                _ => {
                    out.push(b'%');
                    i += 1;
                }
            },
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "the key in the path is not UTF-8 text (percent-decoded)".to_string(),
        ))
    })
}

/// Whether `e` says a key cannot be held by its column (a data exception, or a domain's CHECK).
fn unfit_key(e: &tokio_postgres::Error) -> bool {
    e.code()
        .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23"))
}

/// `GET /api/v1/<name>/<key>`: the row; else the fate of a parked message with that key as its
/// id; else 404. A key the column's type cannot hold is a 400.
async fn get(
    req: HttpRequest,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let key = match path_key(&req) {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let api = api.into_inner();
    let lookup = {
        let api = api.clone();
        let key = key.clone();
        bounded(&state.pool, move |client| {
            async move {
                // The key as the pipeline's insert would store it (PostgreSQL converts it, as
                // the insert does: `abcdef` is no key of a varchar(3), not its `abc` row).
                // A key the column cannot hold may still be a parked message's id.
                let refused = match api.mapping.find_by_key(client, &key).await {
                    Ok(Some(text)) => {
                        return Ok(Found::Row(
                            serde_json::from_str(&text).unwrap_or(Value::String(text)),
                        ));
                    }
                    Ok(None) => None,
                    Err(e) if unfit_key(&e) => Some(e),
                    Err(e) => return Err(e),
                };
                match (parked_fate(client, Some(&api.name), &key).await?, refused) {
                    (Found::Nothing, Some(e)) => Err(e),
                    (found, _) => Ok(found),
                }
            }
            .boxed()
        })
        .await
    };
    match lookup {
        Ok(Found::Row(row)) => HttpResponse::Ok().json(row),
        Ok(Found::Parked(kind, reason, parked_at)) => {
            parked_answer("key", &key, &kind, &reason, &parked_at)
        }
        Ok(Found::Nothing) => error(
            StatusCode::NOT_FOUND,
            format!("no {} row with {} {key:?} (yet)", api.name, api.key_column),
        ),
        Err(QueryError::Db(e))
            if e.sqlstate()
                .is_some_and(|s| s.starts_with("22") || s.starts_with("23")) =>
        {
            error(
                StatusCode::BAD_REQUEST,
                format!("{key:?} is not a valid {}: {e}", api.key_column),
            )
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database unavailable: {e}"),
        ),
    }
}
