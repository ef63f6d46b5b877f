//! The HTTP API of a pipeline with `api = true` (the built-in users pipeline's `/api/v1/users`
//! among them): `POST /api/v1/<name>` checks a message body with the pipeline's mapping (as
//! `warren pipelines test` does) and publishes it to the pipeline's exchange with a broker
//! confirm; `PUT /api/v1/<name>/<key>` does the same for a body whose key is the one in the path;
//! `GET /api/v1/<name>/<key>` reads the row (as JSON, every column, and each child table's rows
//! under its array's name), else the fate of a message parked under the pipeline with that key
//! as its message id, else 404. A nested message (child tables) is checked by writing its rows
//! into the tables and rolling them back, so what the database refuses of it is a 422. The message id of a
//! published message is its key, so a retried request is the same message to the pipeline (the
//! same key and content: one row).
//!
//! What the pipeline would refuse is refused at once (422, with the kind and reason the DLQ would
//! carry and the fields at fault: a body over `MAX_MESSAGE_BYTES`, one the mapping refuses); so
//! is a key no message id can carry (over 255 bytes: the pipeline would store such a message
//! from a publisher that picks its own message id, but the API's promises, one message per key
//! and `GET` of its fate, rest on the key being the message id). Two options of the pipeline's
//! entry: `api_key = "chosen"`, the API chooses a `POST`'s key (a new UUID, or the one derived
//! from its `Idempotency-Key`) and writes it into the body; `api_check`, the table is asked
//! before publishing (the same content under the key: answered, not published again; other
//! content, or a value another unique index holds: 409). Without `api_check` whether the key is
//! already stored with other content is the pipeline's to decide (`on_conflict`), and `GET` tells
//! it afterwards.

use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::future::FutureExt;
use serde_json::{Value, json};

use lapin::types::ShortString;

use super::{
    AppState, FieldError, Found, QueryError, bounded, chosen_key, error, oversized, parked_answer,
    parked_fate, publish_body, read_body, trace,
};
use crate::amqp::headers;
use crate::config::ConfigError;
use crate::config::pipelines::{ApiKey, PipelineSpec};
use crate::domain::ErrorKind;
use crate::domain::mapping::{Cell, ColType, Mapping, Op, Problem, Refused, Row, Standing, Trial};

/// One pipeline's API: its mapping, where it publishes, its table's key and its options.
pub struct PipelineApi {
    pub name: String,
    mapping: Mapping,
    exchange: String,
    routing_key: String,
    /// The key column's position in the mapping's columns, its name and type.
    key_index: usize,
    key_column: String,
    key_type: ColType,
    /// `api_key = "chosen"`: the top-level field of the body the key is written to.
    chosen: Option<String>,
    /// `api_check`: the table is asked before publishing.
    check: bool,
    /// The table's columns in their order, read once (a 422 names the fields at fault in it).
    order: tokio::sync::OnceCell<Vec<String>>,
}

impl PipelineApi {
    /// The API of every pipeline with `api = true`, as the configuration resolves them
    /// ([`crate::config::Settings::pipelines`]): the built-in users pipeline (as `config/default.toml` declares
    /// it, under the names `MAIN_EXCHANGE` and `MAIN_QUEUE`) unless a file's pipeline named
    /// users replaces it, and the file's.
    pub fn all(pipelines: &[PipelineSpec]) -> Result<Vec<Arc<Self>>, ConfigError> {
        pipelines
            .iter()
            .filter(|p| p.api.enabled)
            .map(|p| Self::new(p).map(Arc::new))
            .collect()
    }

    fn new(p: &PipelineSpec) -> Result<Self, ConfigError> {
        let mapping = p.mapping()?;
        let names = &p.names;
        let [key] = p.mapping.key.as_slice() else {
            // Checked when the configuration loads; kept here so a caller cannot get past it.
            return Err(ConfigError::Pipeline(format!(
                "pipelines.{}.api: true needs a one-column key",
                p.name
            )));
        };
        let (key_index, key_type) = mapping
            .columns()
            .enumerate()
            .find(|(_, (c, _, _))| c == key)
            .map(|(i, (_, ty, _))| (i, ty))
            .ok_or_else(|| ConfigError::Pipeline(format!("pipelines.{}: no key column", p.name)))?;
        let chosen = match p.api.key {
            ApiKey::Body => None,
            ApiKey::Chosen => Some(
                mapping
                    .field_of(key)
                    .filter(|_| key_type == ColType::Uuid)
                    .ok_or_else(|| {
                        ConfigError::Pipeline(format!(
                            "pipelines.{}.api_key: \"chosen\" needs a uuid key read from a \
                             top-level field",
                            p.name
                        ))
                    })?
                    .to_string(),
            ),
        };
        Ok(Self {
            name: p.name.clone(),
            mapping,
            exchange: names.main_exchange.clone(),
            routing_key: names.main_queue.clone(),
            key_index,
            key_column: key.clone(),
            key_type,
            chosen,
            check: p.api.check,
            order: tokio::sync::OnceCell::new(),
        })
    }

    /// A path's key as the pipeline stores it: a uuid key written as PostgreSQL reads a UUID is
    /// (`GET` and `PUT` of `/api/v1/users/6F1C...` or `{6f1c...}` are the user `6f1c...`), and a
    /// path that is none is a 400.
    fn uuid_path(&self, path: String) -> Result<String, Box<HttpResponse>> {
        if self.key_type != ColType::Uuid {
            return Ok(path);
        }
        match crate::domain::mapping::pg_uuid(&path) {
            Some(id) => Ok(id.to_string()),
            None => Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                format!("{:?} is not a UUID", crate::text::shown(&path)),
            ))),
        }
    }

    /// Whether `path` names `key`: the same text, or the same UUID written otherwise (upper case).
    fn same_key(&self, key: &str, path: &str) -> bool {
        use crate::domain::mapping::pg_uuid;
        key == path || matches!((pg_uuid(key), pg_uuid(path)), (Some(a), Some(b)) if a == b)
    }

    /// The key of a decoded row as text (the message id it is published under).
    fn key_of(&self, row: &Row) -> Option<String> {
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

    /// The table's columns in their order (read once; the mapping's columns' order while the
    /// database cannot say).
    async fn table_order(&self, state: &AppState) -> Vec<String> {
        let table = self.mapping.table().sql();
        let read = self
            .order
            .get_or_try_init(|| async {
                bounded(&state.pool, move |client| {
                    async move {
                        let rows = client
                            .query(
                                "SELECT attname::text FROM pg_attribute \
                                 WHERE attrelid = to_regclass($1) AND attnum > 0 \
                                 AND NOT attisdropped ORDER BY attnum",
                                &[&table],
                            )
                            .await?;
                        Ok(rows.iter().map(|r| r.get(0)).collect::<Vec<String>>())
                    }
                    .boxed()
                })
                .await
            })
            .await;
        match read {
            Ok(order) => order.clone(),
            Err(_) => self
                .mapping
                .columns()
                .map(|(c, _, _)| c.to_string())
                .collect(),
        }
    }

    /// What one row of the pipeline is called in the API's answers: its name in the singular
    /// (`users`: `user`, `orders`: `order`, `categories`: `category`, `addresses`: `address`),
    /// or `<name> row` for a name that does not end in a plural `s`.
    fn item(&self) -> String {
        let name = self.name.as_str();
        if let Some(stem) = name.strip_suffix("ies").filter(|s| !s.is_empty()) {
            format!("{stem}y")
        } else if let Some(stem) = name.strip_suffix("sses") {
            format!("{stem}ss")
        } else if let Some(stem) = name
            .strip_suffix('s')
            .filter(|s| !s.is_empty() && !s.ends_with('s') && !s.ends_with('u'))
        {
            stem.to_string()
        } else {
            format!("{name} row")
        }
    }

    /// A key as the answers write it: a UUID or a number as it is, text quoted.
    fn shown_key(&self, key: &str) -> String {
        match self.key_type {
            ColType::Text | ColType::Jsonb => format!("{:?}", crate::text::shown(key)),
            _ => crate::text::shown(key).into_owned(),
        }
    }

    /// The body's fields the columns read, in the order of the table's columns (fields no
    /// table column orders after, sorted).
    fn fields_in_order(&self, order: &[String]) -> Vec<String> {
        let mut fields: Vec<String> = order
            .iter()
            .filter_map(|c| self.mapping.field_of(c))
            .map(str::to_string)
            .collect();
        for f in self.mapping.fields() {
            if !fields.iter().any(|g| g == f) {
                fields.push(f.to_string());
            }
        }
        fields
    }

    /// The 422 for a body the mapping refuses, in the API's words: a body that is no JSON
    /// (`body is not valid JSON: ...`) or no object (`body must be a JSON object with name and
    /// email`), a field no column reads (`unknown field "x", expected one of id, name, email`),
    /// else `validation failed` with each field at fault (in the order of the table's columns,
    /// `first` before them) and its message. The kind and reason the DLQ would carry go beside.
    async fn refused(
        &self,
        state: &AppState,
        body: &[u8],
        refused: Refused,
        first: Option<FieldError>,
    ) -> HttpResponse {
        let order = self.table_order(state).await;
        let expected = self.fields_in_order(&order);
        let unknown: Vec<String> = refused
            .problems
            .iter()
            .filter_map(|p| match p {
                Problem::Unknown(field) => Some(format!("{:?}", crate::text::shown(field))),
                Problem::Column { .. } => None,
            })
            .collect();
        let mut fields: Vec<(usize, FieldError)> = refused
            .problems
            .into_iter()
            .filter_map(|p| match p {
                // An element's field (a path into an array): the parent's fields are not what
                // it should have been (review R38f F7).
                Problem::Unknown(field) if field.starts_with('/') => Some(FieldError {
                    field,
                    message: "is not a field the columns of its array's elements read".into(),
                }),
                Problem::Unknown(field) => Some(FieldError {
                    field,
                    message: format!(
                        "is not a field of {} (expected one of {})",
                        self.name,
                        expected.join(", ")
                    ),
                }),
                // The key's field is named once, by `first`.
                Problem::Column { column, .. }
                    if first.as_ref().is_some_and(|f| f.field == column) =>
                {
                    None
                }
                Problem::Column { column, error } => Some(FieldError {
                    field: column,
                    message: error.field_message(),
                }),
            })
            .map(|f| {
                let at = order
                    .iter()
                    .position(|c| *c == f.field)
                    .unwrap_or(usize::MAX);
                (at, f)
            })
            .collect();
        fields.sort_by_key(|(at, _)| *at);
        let fields: Vec<FieldError> = first
            .into_iter()
            .chain(fields.into_iter().map(|(_, f)| f))
            .collect();
        let message = if let Some(unreadable) = self.unreadable(body, &expected) {
            unreadable
        } else if !unknown.is_empty() && unknown.iter().all(|u| u.starts_with("\"/")) {
            format!(
                "unknown field {}: no column of its array's elements reads it",
                unknown.join(", ")
            )
        } else if !unknown.is_empty() {
            // An unknown field is named as a client reads it (the DLQ's reason gives its path).
            format!(
                "unknown field {}, expected one of {}",
                unknown.join(", "),
                expected.join(", ")
            )
        } else if !fields.is_empty() {
            "validation failed".to_string()
        } else {
            refused.rejection.reason.clone()
        };
        HttpResponse::UnprocessableEntity().json(json!({
            "error": message,
            "kind": refused.rejection.kind.as_str(),
            "reason": refused.rejection.reason,
            "fields": fields,
        }))
    }

    /// What keeps `body` from being read at all, in the API's words: not JSON (`body is not
    /// valid JSON: ...`, a key twice included), or not the object the columns read (`body must
    /// be a JSON object with name and email`: the fields a client gives, `expected` but the
    /// key the API chooses). `None`: it is an object (or the columns read no object).
    fn unreadable(&self, body: &[u8], expected: &[String]) -> Option<String> {
        let doc = match std::str::from_utf8(body) {
            Err(e) => return Some(format!("body is not valid JSON: not UTF-8: {e}")),
            Ok(text) => match crate::domain::mapping::parse_strict(text) {
                Err(e) if crate::domain::mapping::too_deep(&e) => {
                    return Some(format!(
                        "body nests arrays and objects deeper than {} levels (the most the \
                         pipeline reads), at line {} column {}",
                        crate::domain::mapping::DEPTH_MAX,
                        e.line(),
                        e.column()
                    ));
                }
                Err(e) => return Some(format!("body is not valid JSON: {e}")),
                Ok(doc) => doc,
            },
        };
        if doc.is_object() || !self.mapping.reads_object() {
            return None;
        }
        let given: Vec<&str> = expected
            .iter()
            .map(String::as_str)
            .filter(|f| self.chosen.as_deref() != Some(*f))
            .collect();
        Some(format!(
            "body must be a JSON object with {}",
            match given.split_last() {
                Some((last, [])) => last.to_string(),
                Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
                None => "fields".to_string(),
            }
        ))
    }
}

/// The top-level fields of a JSON object body in the order it gives them (empty for anything
/// else).
fn body_fields(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .map(crate::domain::mapping::body_fields)
        .unwrap_or_default()
}

/// `body` (a JSON object, trimmed) with `"<field>": "<key>"` written first, everything else
/// as the client wrote it (numbers keep their digits); `None` when it is no object or already
/// has the field (the mapping then says what is wrong with it).
fn with_key(body: &[u8], field: &str, key: &str) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?.trim();
    let doc = crate::domain::mapping::parse_strict(text).ok()?;
    let object = doc.as_object()?;
    if object.contains_key(field) {
        return None;
    }
    let rest = text.strip_prefix('{')?;
    let pair = format!(
        "{}:{}",
        serde_json::to_string(field).ok()?,
        serde_json::to_string(key).ok()?
    );
    let comma = if object.is_empty() { "" } else { "," };
    Some(format!("{{{pair}{comma}{rest}").into_bytes())
}

/// Registers the routes of `api` on `config`. The path's parameter is named after the key
/// column (`/api/v1/users/{id}`, `/api/v1/orders/{order_id}`: the `route` label of
/// `warren_http_requests_total`), or `{key}` for a column name a route pattern cannot hold.
pub fn routes(config: &mut web::ServiceConfig, api: Arc<PipelineApi>) {
    let data = web::Data::from(api.clone());
    let param = if api
        .key_column
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        api.key_column.as_str()
    } else {
        "key"
    };
    config.service(
        web::resource(format!("/api/v1/{}", api.name))
            .app_data(data.clone())
            .route(web::post().to(post)),
    );
    config.service(
        web::resource(format!("/api/v1/{}/{{{param}}}", api.name))
            .app_data(data)
            .route(super::get_or_head().to(get))
            .route(web::put().to(put)),
    );
}

/// Checks `body` as the pipeline would (its size first, unread, then the mapping) and its key as
/// the message id it is published under; `Ok` is the key (as text, and as the message id),
/// `Err` the 422 to send (naming `first` before the fields the mapping finds at fault, in place
/// of the mapping's words for that field).
async fn check(
    state: &AppState,
    api: &PipelineApi,
    body: &[u8],
    sent: usize,
    first: Option<FieldError>,
) -> Result<(String, ShortString, Row), Box<HttpResponse>> {
    if let Some(refused) = oversized(state, body, sent) {
        return Err(Box::new(refused));
    }
    let row = match api.mapping.decode_detailed(body, None) {
        Ok(row) => row,
        // `first` names the key column only when the mapping finds the key at fault.
        Err(r) if first.is_some() => {
            let key_at_fault = r
                .problems
                .iter()
                .any(|p| matches!(p, Problem::Column { column, .. } if *column == api.key_column));
            let first = first.filter(|_| key_at_fault);
            return Err(Box::new(api.refused(state, body, r, first).await));
        }
        Err(r) => return Err(Box::new(api.refused(state, body, r, None).await)),
    };
    let key = api.key_of(&row).ok_or_else(|| {
        Box::new(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("the key column {} is null", api.key_column),
        ))
    })?;
    // An empty key is no path segment: `GET` and `PUT /api/v1/<name>/<key>` could not address
    // what was accepted (review R36i F6).
    if key.is_empty() {
        return Err(Box::new(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "key {}: empty, which GET and PUT /api/v1/{}/<key> cannot address",
                api.key_column, api.name
            ),
        )));
    }
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
/// database's words, kind `db_permanent` as the pipeline would park it. With `api_check`, also
/// what the table holds ([`Standing`]): the same content under the key is a 200 without
/// publishing, other content a 409 `id_conflict`, a value another unique index holds a 409
/// `<columns>_taken` naming the key that holds it. A database that does not answer within the
/// API's query bound cannot say: the body is published unprobed, and the pipeline decides when
/// the database is back (a queue's point is that writes do not wait for the database).
async fn storable(
    state: &AppState,
    api: &Arc<PipelineApi>,
    key: &str,
    row: Row,
) -> Result<(), HttpResponse> {
    if row.2 == Op::Delete {
        // A delete writes no row: its key and version were checked by the mapping, and the
        // pipeline's version guard decides what it does (deleted, stale, a copy, id_conflict).
        return Ok(());
    }
    let unstorable = |reason: &str| {
        HttpResponse::UnprocessableEntity().json(json!({
            "error": crate::text::shown(reason),
            "kind": ErrorKind::DbPermanent.as_str(),
        }))
    };
    let probe = || {
        let api = api.clone();
        let row = row.clone();
        bounded(&state.pool, move |client| {
            async move {
                if api.check {
                    Ok(api.mapping.standing(client, &row).await)
                } else if api.mapping.child_tables().next().is_some() {
                    // A nested message: its parent and child rows written into the tables by
                    // the pipeline's statements and rolled back, so whatever the database
                    // refuses of any of them (a type, a CHECK, a foreign key) is answered now.
                    Ok(api.mapping.trial(client, &row).await.map(|t| match t {
                        Trial::Refused(r) => Standing::Unstorable(r.to_string()),
                        Trial::Discarded => Standing::Unstorable(
                            "not written: a trigger of the table discarded its row".into(),
                        ),
                        Trial::Written(_) | Trial::Held | Trial::Delete => Standing::New,
                    }))
                } else {
                    Ok(match api.mapping.storable(client, &row).await? {
                        Ok(()) => Ok(Standing::New),
                        Err(refusal) => Ok(Standing::Unstorable(refusal.0)),
                    })
                }
            }
            .boxed()
        })
    };
    let mut answer = probe().await;
    // The key's own row, landed between the check's queries (the key looked up before it
    // committed, the other unique indexes after: a concurrent request of the same key, or the
    // pipeline inserting an earlier copy), holds the body's values: never "taken" by itself.
    // Asked again, the key's row is found and compared (same content, or `id_conflict`).
    for _ in 0..3 {
        match &answer {
            Ok(Ok(Standing::Taken { holder, .. })) if api.same_key(holder, key) => {
                answer = probe().await;
            }
            _ => break,
        }
    }
    let why = match answer {
        Ok(Ok(Standing::Taken { holder, .. })) if api.same_key(&holder, key) => {
            // Still so after asking again (a row that keeps changing): the pipeline decides.
            format!("the key's own row holds its values but was not found by its key ({holder})")
        }
        Ok(Ok(Standing::New)) => return Ok(()),
        Ok(Ok(Standing::Same)) => return Err(HttpResponse::Ok().json(json!({"id": key}))),
        Ok(Ok(Standing::Unstorable(reason))) => return Err(unstorable(&reason)),
        Ok(Ok(Standing::Conflict(columns))) => {
            // Every other column, in the table's order: what the key's content is.
            let order = api.table_order(state).await;
            let mut others: Vec<&str> = api
                .mapping
                .columns()
                .map(|(c, _, _)| c)
                .filter(|c| *c != api.key_column)
                .collect();
            others.sort_by_key(|c| order.iter().position(|o| o == c).unwrap_or(usize::MAX));
            return Err(HttpResponse::Conflict().json(json!({
                "error": format!(
                    "{} {} is already stored with another {}",
                    api.item(),
                    api.shown_key(key),
                    match others.split_last() {
                        Some((last, [])) => last.to_string(),
                        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                        None => "content".to_string(),
                    }
                ),
                "kind": ErrorKind::IdConflict.as_str(),
                "id": key,
                "columns": columns,
            })));
        }
        Ok(Ok(Standing::Taken {
            columns,
            values,
            holder,
        })) => {
            return Err(HttpResponse::Conflict().json(json!({
                "error": format!(
                    "{} {} is already stored under {} {}",
                    columns.join(", "),
                    crate::text::shown(&values.join(", ")),
                    api.item(),
                    api.shown_key(&holder)
                ),
                "kind": format!("{}_taken", columns.join("_")),
                "id": holder,
            })));
        }
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    tracing::warn!(pipeline = %api.name, message_id = %crate::text::shown(key), error = %why,
        "the database did not say what it holds for the body; published unprobed");
    Ok(())
}

/// Checks `body`, asks the table ([`storable`]) and publishes it under its key.
async fn accept(
    req: &HttpRequest,
    state: &AppState,
    api: &Arc<PipelineApi>,
    body: bytes::Bytes,
    key: String,
    id: ShortString,
    row: Row,
) -> HttpResponse {
    if let Err(answered) = storable(state, api, &key, row).await {
        return answered;
    }
    let trace = trace(req);
    publish_body(
        state,
        &api.exchange,
        &api.routing_key,
        id,
        body,
        trace.as_deref(),
    )
    .await
}

/// `POST /api/v1/<name>`: a message body, checked and published under its key (with
/// `api_key = "chosen"`, the key the API chooses, written into the body).
async fn post(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    api: web::Data<PipelineApi>,
) -> HttpResponse {
    let chosen = match &api.chosen {
        Some(field) => match chosen_key(&req) {
            Ok(key) => Some((field.clone(), key.to_string())),
            Err(malformed) => return error(StatusCode::BAD_REQUEST, malformed.to_string()),
        },
        None => None,
    };
    let body = match read_body(&req, payload).await {
        Ok(b) => b.freeze(),
        Err(response) => return response,
    };
    // Held until answered: what the writes in work decode stays within the budget.
    let _room = state
        .room_for_write(body.len(), api.mapping.child_tables().next().is_some())
        .await;
    // What the client sent, before the API writes a key into it.
    let sent = body.len();
    let body = match &chosen {
        Some((field, key)) => match with_key(&body, field, key) {
            Some(keyed) => bytes::Bytes::from(keyed),
            None => {
                // A key in the body: refused, naming it (it would be ignored), with whatever
                // else is wrong with the body.
                let given = body_fields(&body).iter().any(|f| f == field);
                if given {
                    let first = FieldError {
                        field: api.key_column.clone(),
                        message: format!(
                            "is chosen by the API in a POST (use PUT /api/v1/{}/{{{}}} to give \
                             one)",
                            api.name, api.key_column
                        ),
                    };
                    let refused = api
                        .mapping
                        .decode_detailed(&body, None)
                        .err()
                        .unwrap_or_else(|| {
                            crate::domain::Rejection::payload(format!(
                                "{} {}",
                                first.field, first.message
                            ))
                            .into()
                        });
                    return api.refused(&state, &body, refused, Some(first)).await;
                }
                body
            }
        },
        None => body,
    };
    match check(&state, &api, &body, sent, None).await {
        // A key the API chose names no stored row: a delete names its key by PUT.
        Ok((_, _, row)) if row.2 == Op::Delete && chosen.is_some() => {
            let (field, value) = api
                .mapping
                .delete()
                .map(|(f, v, _)| (f, v))
                .unwrap_or_default();
            let message = format!(
                "is {value}: a delete names the key it deletes, and a POST's key is chosen by \
                 the API (use PUT /api/v1/{}/{{{}}} to delete one)",
                api.name, api.key_column
            );
            HttpResponse::UnprocessableEntity().json(json!({
                "error": "validation failed",
                "kind": ErrorKind::InvalidPayload.as_str(),
                "reason": format!("{field} {message}"),
                "fields": [FieldError { field: field.trim_start_matches('/').to_string(), message }],
            }))
        }
        Ok((key, id, row)) => accept(&req, &state, &api.into_inner(), body, key, id, row).await,
        Err(response) => *response,
    }
}

/// `PUT /api/v1/<name>/<key>`: as `POST`, for a body whose key is the one in the path (with
/// `api_key = "chosen"`, a body may leave it out). A path a uuid key cannot be is a 400.
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
    let path = match api.uuid_path(path) {
        Ok(path) => path,
        Err(response) => return *response,
    };
    let body = match read_body(&req, payload).await {
        Ok(b) => b.freeze(),
        Err(response) => return response,
    };
    // Held until answered: what the writes in work decode stays within the budget.
    let _room = state
        .room_for_write(body.len(), api.mapping.child_tables().next().is_some())
        .await;
    // What the client sent, before the API writes a key into it.
    let sent = body.len();
    let body = match api
        .chosen
        .as_deref()
        .and_then(|f| with_key(&body, f, &path))
    {
        Some(keyed) => bytes::Bytes::from(keyed),
        None => body,
    };
    // A key in the body that is not the path's, or no key at all, is named so.
    let mismatch = FieldError {
        field: api.key_column.clone(),
        message: format!(
            "must be the {} in the path ({}){}",
            api.key_column,
            api.shown_key(&path),
            if api.chosen.is_some() {
                " or left out"
            } else {
                ""
            }
        ),
    };
    match check(&state, &api, &body, sent, Some(mismatch.clone())).await {
        Ok((key, id, row)) if api.same_key(&key, &path) => {
            accept(&req, &state, &api.into_inner(), body, key, id, row).await
        }
        Ok((key, _, _)) => HttpResponse::UnprocessableEntity().json(json!({
            "error": "validation failed",
            "kind": ErrorKind::InvalidPayload.as_str(),
            "reason": format!(
                "the body's key {} ({}) must be the one in the path ({})",
                api.key_column,
                api.shown_key(&key),
                api.shown_key(&path)
            ),
            "fields": [mismatch],
        })),
        Err(response) => *response,
    }
}

/// The key of the request's path (its last segment), percent-decoded strictly: bytes that are
/// not UTF-8 (`%FF`, a cut `%C3`) are no text key, so a 400, never read as U+FFFD and answered
/// with the row of that other key (found by the review).
fn path_key(req: &HttpRequest) -> Result<String, Box<HttpResponse>> {
    let raw = req.uri().path().rsplit('/').next().unwrap_or_default();
    let out = crate::text::percent_decoded(raw);
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
    let key = match path_key(&req).and_then(|key| api.uuid_path(key)) {
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
            parked_answer(&key, &kind, &reason, &parked_at)
        }
        Ok(Found::Nothing) => error(
            StatusCode::NOT_FOUND,
            format!("no {} {} (yet)", api.item(), api.shown_key(&key)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chosen_key_is_written_first_and_the_rest_kept_as_sent() {
        let id = "6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10";
        let keyed =
            |body: &str| with_key(body.as_bytes(), "id", id).map(|b| String::from_utf8(b).unwrap());
        assert_eq!(
            keyed(r#"  {"name":"Ana", "n": 1.000000000000000000001}   "#).as_deref(),
            Some(
                r#"{"id":"6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10","name":"Ana", "n": 1.000000000000000000001}"#
            )
        );
        assert_eq!(
            keyed("{ }").as_deref(),
            Some(r#"{"id":"6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10" }"#)
        );
        // Already there, no object, not JSON, a key twice: left for the mapping to judge.
        for body in [r#"{"id":"x"}"#, "[1]", "nope", r#"{"a":1,"a":2}"#] {
            assert_eq!(keyed(body), None, "{body}");
        }
    }

    #[test]
    fn the_body_s_fields_are_read_in_its_order() {
        assert_eq!(
            body_fields(br#"{"name":"","email":"x","id":7}"#),
            ["name", "email", "id"]
        );
        assert!(body_fields(b"[1]").is_empty());
        assert!(body_fields(b"not json").is_empty());
    }
}
