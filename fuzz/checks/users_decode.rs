//! The users body decoder (`Users` through the `Domain` trait) on any bytes: it must never
//! panic, a body it accepts must be a valid user that survives a JSON round trip, and a refusal
//! must say why. [`outcome`] says which (`ok`, `invalid_json`, `invalid_payload`), so a seed can
//! name the outcome it must have (tests/fuzz_seeds.rs).

use warren::domain::users::{Users, validate};
use warren::domain::{Domain, ErrorKind};

/// The check: panics on a broken promise.
pub fn check(body: &[u8]) {
    outcome(body);
}

/// The check, and what the decoder made of `body`: `ok`, or the refusal's kind.
pub fn outcome(body: &[u8]) -> &'static str {
    match Users.decode(body) {
        Ok(user) => {
            assert!(
                validate(&user.name, &user.email).is_empty(),
                "accepted an invalid user: {user:?}"
            );
            let again = serde_json::to_vec(&user).expect("a user serializes");
            assert_eq!(
                Users.decode(&again).as_ref(),
                Ok(&user),
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
