//! The users body decoder (the built-in users pipeline as `config/default.toml` declares it,
//! through the mapping and the `Domain` trait) on any bytes: it must never panic, a body it
//! accepts must be a valid user that survives a JSON round trip, and a refusal must say why.
//! [`outcome`] says which (`ok`, `invalid_json`, `invalid_payload`), so a seed can name the
//! outcome it must have (tests/fuzz_seeds.rs).

use std::sync::OnceLock;

use warren::domain::mapping::{Cell, Mapping, email_problem, line_problem};
use warren::domain::{Domain, ErrorKind};

/// The declared users pipeline, compiled once.
fn users() -> &'static Mapping {
    static USERS: OnceLock<Mapping> = OnceLock::new();
    USERS.get_or_init(|| {
        warren::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles")
    })
}

/// The check: panics on a broken promise.
pub fn check(body: &[u8]) {
    outcome(body);
}

/// The check, and what the decoder made of `body`: `ok`, or the refusal's kind.
pub fn outcome(body: &[u8]) -> &'static str {
    let users = users();
    match users.decode(body) {
        Ok(row) => {
            // Columns in the mapping's order: email, id, name.
            let [Cell::Text(email), Cell::Uuid(id), Cell::Text(name)] = row.0.as_slice() else {
                panic!("accepted a row that is no user: {row:?}");
            };
            assert!(
                !name.trim().is_empty()
                    && name.chars().count() <= 200
                    && line_problem(name).is_none()
                    && email_problem(email).is_none(),
                "accepted an invalid user: {row:?}"
            );
            let again = serde_json::json!({"id": id, "name": name, "email": email}).to_string();
            assert_eq!(
                users.decode(again.as_bytes()).as_ref(),
                Ok(&row),
                "round trip changed the user"
            );
            "ok"
        }
        Err(rejection) => {
            assert!(!rejection.reason.is_empty(), "a refusal without a reason");
            if rejection.kind == ErrorKind::InvalidPayload {
                // Empty and non-UTF-8 bodies are invalid_json, never invalid_payload.
                assert!(!body.is_empty() && std::str::from_utf8(body).is_ok());
            }
            rejection.kind.as_str()
        }
    }
}
