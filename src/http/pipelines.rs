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
use tokio::sync::OnceCell;

use lapin::types::ShortString;

use super::{
    AppState, Found, QueryError, bounded, error, oversized, parked_answer, parked_fate,
    publish_body, read_body, trace,
};
use crate::amqp::headers;
use crate::config::pipelines::PipelineConfig;
use crate::config::{ConfigError, Settings};
use crate::domain::mapping::{Cell, Mapping, quote};

/// One pipeline's API: its mapping, where it publishes, and its table's key.
pub struct PipelineApi {
    pub name: String,
    mapping: Mapping,
    exchange: String,
    routing_key: String,
    /// The key column's position in the mapping's columns, and its name.
    key_index: usize,
    key_column: String,
    /// The key column's SQL type in the table (`uuid`, `bigint`, ...), read at the first `GET`.
    key_type: OnceCell<String>,
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
            key_type: OnceCell::new(),
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
) -> Result<(String, ShortString), Box<HttpResponse>> {
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
    // Issue 34 item 6, "what PostgreSQL cannot store" (a value too long for its varchar(n), ...):
    // the database probe of the row goes here, before anything is published.
    Ok((key, id))
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
        Ok((_, id)) => {
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
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let body = match read_body(&req, payload).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    match check(&state, &api, &body) {
        Ok((key, id)) if api.same_key(&key, &path) => {
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
        Ok((key, _)) => error(
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

/// `GET /api/v1/<name>/<key>`: the row; else the fate of a parked message with that key as its
/// id; else 404. A key the column's type cannot hold is a 400.
async fn get(
    path: web::Path<String>,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let key = path.into_inner();
    let api = api.into_inner();
    let lookup = {
        let api = api.clone();
        let key = key.clone();
        bounded(&state.pool, move |client| {
            async move {
                let ty = api
                    .key_type
                    .get_or_try_init(|| async {
                        let row = client
                            .query_one(
                                "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
                                 WHERE a.attrelid = $1::text::regclass AND a.attname = $2 \
                                 AND NOT a.attisdropped",
                                &[&api.mapping.table().sql(), &api.key_column],
                            )
                            .await?;
                        Ok::<_, tokio_postgres::Error>(row.get::<_, String>(0))
                    })
                    .await?;
                let sql = format!(
                    "SELECT to_jsonb(t)::text FROM {} t WHERE {} = CAST($1::text AS {ty})",
                    api.mapping.table().sql(),
                    quote(&api.key_column)
                );
                if let Some(row) = client.query_opt(&sql, &[&key]).await? {
                    let text: String = row.get(0);
                    return Ok(Found::Row(
                        serde_json::from_str(&text).unwrap_or(Value::String(text)),
                    ));
                }
                parked_fate(client, Some(&api.name), &key).await
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
        Err(QueryError::Db(e)) if e.sqlstate().is_some_and(|s| s.starts_with("22")) => error(
            StatusCode::BAD_REQUEST,
            format!("{key:?} is not a valid {}: {e}", api.key_column),
        ),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database unavailable: {e}"),
        ),
    }
}
