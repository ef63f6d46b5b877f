//! The built-in users pipeline, as config/default.toml declares it, held to the answers users
//! gave before it was declared (its typed code, kept here as the reference: [`today`]), and the
//! checks of `format = "line"` it shares with every mapping.
//! Test code only (`#![cfg(test)]`): its unwraps and expects never run in the service.
#![cfg(test)]

use super::*;
use crate::domain::{ErrorKind, Rejection};

/// The users pipeline warren runs.
fn users() -> Mapping {
    crate::config::pipelines::users()
        .and_then(|p| p.mapping())
        .expect("the shipped users pipeline compiles")
}

/// What users answered before it was declared: the typed decode and validation of
/// `src/domain/users.rs` as they were, word for word, the reference the declaration is held to.
mod today {
    use super::{Rejection, email_problem, line_problem};
    use serde::Deserialize;
    use uuid::Uuid;

    /// One user, as carried in a message body.
    #[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct User {
        pub id: Uuid,
        pub name: String,
        pub email: String,
    }

    /// One field that failed validation, for a 422 answer or a DLQ reason.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct FieldError {
        pub field: &'static str,
        pub message: String,
    }

    /// Validates a name and an email; every failing field is reported.
    pub fn validate(name: &str, email: &str) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let chars = name.trim().chars().count();
        if chars == 0 {
            errors.push(FieldError {
                field: "name",
                message: "must not be empty".into(),
            });
        } else if name.chars().count() > 200 {
            errors.push(FieldError {
                field: "name",
                message: "must be at most 200 characters".to_string(),
            });
        } else if let Some(what) = line_problem(name) {
            errors.push(FieldError {
                field: "name",
                message: format!("must be one line of readable text, without {what}"),
            });
        }
        if let Some(problem) = email_problem(email) {
            errors.push(FieldError {
                field: "email",
                message: problem.to_string(),
            });
        }
        errors
    }

    pub fn decode(body: &[u8]) -> Result<User, Rejection> {
        if body.is_empty() {
            return Err(Rejection::json("empty body"));
        }
        if let Err(e) = std::str::from_utf8(body) {
            return Err(Rejection::json(format!("body is not UTF-8: {e}")));
        }
        // Only an object is a user: serde would also take an array of the fields in order.
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if first != Some(&b'{') {
            return Err(
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Ok(_) => Rejection::payload("wrong shape: expected a JSON object"),
                    Err(e) => Rejection::json(format!("not JSON: {e}")),
                },
            );
        }
        let user: User = serde_json::from_slice(body).map_err(|e| match e.classify() {
            // serde stops at the first wrong type, before it sees that the text is cut short
            // (`{"id":1`): only a body that is JSON at all is of the wrong shape.
            serde_json::error::Category::Data => {
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Ok(_) => Rejection::payload(format!("wrong shape: {e}")),
                    Err(syntax) => Rejection::json(format!("not JSON: {syntax}")),
                }
            }
            _ => Rejection::json(format!("not JSON: {e}")),
        })?;
        let errors = validate(&user.name, &user.email);
        if !errors.is_empty() {
            let text: Vec<String> = errors
                .iter()
                .map(|e| format!("{} {}", e.field, e.message))
                .collect();
            return Err(Rejection::payload(text.join("; ")));
        }
        Ok(user)
    }
}

#[test]
fn bad_bodies_get_the_right_kind() {
    let users = users();
    let decode = |body: &[u8]| users.decode_message(body, None);
    assert_eq!(decode(b"").unwrap_err().kind, ErrorKind::InvalidJson);
    assert_eq!(
        decode(&[0xff, 0xfe]).unwrap_err().kind,
        ErrorKind::InvalidJson
    );
    assert_eq!(
        decode(b"{not json").unwrap_err().kind,
        ErrorKind::InvalidJson
    );
    assert_eq!(
        decode(b"[1,2]").unwrap_err().kind,
        ErrorKind::InvalidPayload
    );
    assert!(
        decode(b"[1,2]")
            .unwrap_err()
            .reason
            .contains("expected a JSON object")
    );
    assert_eq!(decode(b"  nope").unwrap_err().kind, ErrorKind::InvalidJson);
    // Cut short after a value of the wrong type: still not JSON (found by fuzzing review).
    assert_eq!(
        decode(br#"{"id":1"#).unwrap_err().kind,
        ErrorKind::InvalidJson
    );
    let bad_email = r#"{"id":"6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10","name":"Ana","email":"nope"}"#;
    let err = decode(bad_email.as_bytes()).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidPayload);
    assert!(err.reason.contains("email"), "{}", err.reason);
}

#[test]
fn every_field_at_fault_is_named() {
    let users = users();
    let refused = users
        .decode_detailed(br#"{"name":"","email":"x"}"#, None)
        .unwrap_err();
    let columns: Vec<&str> = refused
        .problems
        .iter()
        .map(|p| match p {
            Problem::Column { column, .. } => column.as_str(),
            Problem::Unknown(f) => f.as_str(),
        })
        .collect();
    // In the body's order, the field it lacks after.
    assert_eq!(columns, ["name", "email", "id"], "{refused:?}");
    assert_eq!(
        refused.problems[0],
        Problem::Column {
            column: "name".into(),
            error: ValueError::Check(CheckError::Blank),
        }
    );
    assert_eq!(
        refused.rejection.reason,
        "name must not be empty; email must be a valid email address such as ana@example.com; \
         /id: missing (a uuid is required)"
    );
    // Two checks refused, in the order the body gives them.
    let swapped = users
        .decode_detailed(
            br#"{"email":"x","id":"6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10","name":" "}"#,
            None,
        )
        .unwrap_err();
    assert_eq!(
        swapped.rejection.reason,
        "email must be a valid email address such as ana@example.com; name must not be empty"
    );
    let unknown = users
        .decode_detailed(
            br#"{"id":"6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10","x":1}"#,
            None,
        )
        .unwrap_err();
    // The unknown field with the others at fault (review R36g F5: it alone was named).
    assert_eq!(
        unknown.rejection.reason,
        "unknown field /x (unknown_fields = \"reject\"); /email: missing (a text is required); \
         /name: missing (a text is required)"
    );
    assert_eq!(unknown.problems[0], Problem::Unknown("x".into()));
    assert_eq!(unknown.problems.len(), 3, "{:?}", unknown.problems);
    assert_eq!(users.field_of("email"), Some("email"));
}

#[test]
fn a_line_holds_only_what_a_screen_shows_as_written() {
    for fine in [
        "Ana",
        "Ana Maria",
        "  Ana  ",
        "José Ñúñez",
        "محمد",
        "שלום",
        "李小龍",
        // Joiners inside a word: Persian (ZWNJ), an emoji sequence (ZWJ).
        "می\u{200C}خواهم",
        "👩\u{200D}💻",
        "🏳\u{FE0F}\u{200D}🌈",
    ] {
        assert_eq!(line_problem(fine), None, "{fine:?}");
    }
    for (bad, what) in [
        ("Ana\nMaria", "the control character '\\n'"),
        ("Ana\u{85}", "the control character '\\u{85}'"),
        ("Ana\u{2028}Maria", "the line separator U+2028"),
        ("Ana\u{2029}", "the paragraph separator U+2029"),
        ("\u{202E}anA", "the bidi control U+202E"),
        ("Ana\u{202A}", "the bidi control U+202A"),
        ("Ana\u{2066}x\u{2069}", "the bidi control U+2066"),
        ("Ana\u{200F}", "the bidi mark U+200F"),
        ("\u{200B}", "the invisible character U+200B"),
        ("A\u{200B}na", "the invisible character U+200B"),
        ("Ana\u{FEFF}", "the invisible character U+FEFF"),
        ("A\u{2060}na", "the invisible character U+2060"),
        ("\u{200D}", "the zero width joiner U+200D outside a word"),
        ("\u{200C}Ana", "the zero width joiner U+200C outside a word"),
        ("Ana\u{200D}", "the zero width joiner U+200D outside a word"),
        (
            "Ana \u{200D}x",
            "the zero width joiner U+200D outside a word",
        ),
        (
            "A\u{200D}\u{200D}na",
            "the zero width joiner U+200D outside a word",
        ),
    ] {
        assert_eq!(line_problem(bad).as_deref(), Some(what), "{bad:?}");
        let errors = today::validate(bad, "ana@example.com");
        assert_eq!(errors.len(), 1, "{bad:?}: {errors:?}");
        assert_eq!(errors[0].field, "name");
        assert!(errors[0].message.contains(what), "{bad:?}: {errors:?}");
    }
}

/// The users pipeline declared in config/default.toml gives every message the answer users
/// gave before it was declared (its typed code, kept above as [`today`]): it accepts it with
/// the same row, or refuses it as the same kind, and where the typed code worded the refusal
/// itself (its checks: a blank or long name, one that is no line of text, an email that is no
/// address) with the same words, word for word. What serde worded for the typed code (a field
/// missing, of the wrong type, unknown or twice, an id that is no UUID: `wrong shape: ...` with
/// a line and column) the mapping words by path, expected and found (docs/http-api.md, the
/// upgrade note). Drawn over ids, names, emails and shapes a publisher may send.
#[test]
fn the_declared_users_pipeline_gives_todays_answer_to_every_message() {
    let mapping = crate::config::pipelines::users()
        .and_then(|p| p.mapping())
        .expect("the shipped users pipeline compiles");
    let id = "6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10";
    let ids = [
        format!("\"{id}\""),
        format!("\"{}\"", id.to_uppercase()),
        format!("\"{}\"", id.replace('-', "")),
        format!("\"{{{id}}}\""),
        "\"not-a-uuid\"".into(),
        "\"\"".into(),
        "42".into(),
        "null".into(),
        String::new(),
    ];
    let long = "é".repeat(200);
    let longer = "é".repeat(201);
    let names = [
        "\"Ana\"".to_string(),
        "\"  Ana  \"".into(),
        "\"\"".into(),
        "\"   \"".into(),
        "\"\\t\"".into(),
        "\"Ana\\u0007\"".into(),
        "\"Ana\\nMaria\"".into(),
        "\"Ana\\u0085\"".into(),
        "\"Ana\\u200b\"".into(),
        "\"\\u200b\"".into(),
        "\"Ana\\u2028Maria\"".into(),
        "\"\\u202eanA\"".into(),
        "\"Ana\\u2066x\\u2069\"".into(),
        "\"mi\\u200cx\"".into(),
        "\"\\u200d\"".into(),
        format!("\"{long}\""),
        format!("\"{longer}\""),
        "\"\\u0000\"".into(),
        "7".into(),
        "null".into(),
        "[\"Ana\"]".into(),
        String::new(),
    ];
    let local = "a".repeat(64);
    let emails = [
        "\"ana@example.com\"".to_string(),
        "\"ANA@Example.COM\"".into(),
        "\"nope\"".into(),
        "\"a@b\"".into(),
        "\"a b@example.com\"".into(),
        "\"ana@exämple.com\"".into(),
        format!("\"{local}@{}.com\"", "d".repeat(185)),
        format!("\"{local}@{}.com\"", "d".repeat(186)),
        format!("\"{local}a@example.com\""),
        "\"\"".into(),
        "null".into(),
        "{}".into(),
        String::new(),
    ];
    let extras = [
        "",
        ",\"extra\":1",
        ",\"email\":\"dup@example.com\"",
        ",\"\":null",
    ];
    let mut checked = 0;
    let mut worded = 0;
    for i in &ids {
        for n in &names {
            for e in &emails {
                for x in extras {
                    let mut fields = Vec::new();
                    for (k, v) in [("id", i), ("name", n), ("email", e)] {
                        if !v.is_empty() {
                            fields.push(format!("\"{k}\":{v}"));
                        }
                    }
                    let body = format!("{{{}{x}}}", fields.join(","));
                    let body = body.replacen("{,", "{", 1);
                    let typed = today::decode(body.as_bytes());
                    let mapped = mapping.decode(body.as_bytes());
                    match (&typed, &mapped) {
                        (Ok(u), Ok(row)) => {
                            for cell in [
                                Cell::Uuid(u.id),
                                Cell::Text(u.name.clone()),
                                Cell::Text(u.email.clone()),
                            ] {
                                assert!(row.0.contains(&cell), "{body}: {u:?} vs {row:?}");
                            }
                        }
                        (Err(a), Err(b)) => {
                            assert_eq!(a.kind, b.kind, "{body}: {a:?} vs {b:?}");
                            if !a.reason.starts_with("wrong shape: ") {
                                assert_eq!(a.reason, b.reason, "{body}");
                                worded += 1;
                            }
                        }
                        _ => panic!("{body}: before {typed:?}, declared {mapped:?}"),
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(
        checked,
        ids.len() * names.len() * emails.len() * extras.len()
    );
    // The ids that are UUIDs (4) by the names (18) and emails (10) that are strings, less the
    // 4 x 4 accepted, without extras; and the 14 refused names with no email but the extra
    // one: every refusal of a check compared word for word.
    assert_eq!(
        worded,
        4 * (18 * 10 - 4 * 4 + 14),
        "refusals compared word for word"
    );
    // One answer changed on purpose: `urn:uuid:<id>`, which the uuid crate (the typed code)
    // reads and PostgreSQL's uuid input refuses; a uuid column reads as PostgreSQL does.
    let urn = format!(r#"{{"id":"urn:uuid:{id}","name":"Ana","email":"ana@example.com"}}"#);
    assert!(today::decode(urn.as_bytes()).is_ok());
    let refused = mapping.decode(urn.as_bytes()).unwrap_err();
    assert_eq!(
        refused.reason,
        format!("/id: expected a UUID, found \"urn:uuid:{id}\""),
        "{refused:?}"
    );
}
