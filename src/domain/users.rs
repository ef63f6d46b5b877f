//! The users domain: `{"id","name","email"}` messages, their validation (shared with the HTTP
//! API) and the batch insert into `users` with one `INSERT .. SELECT FROM UNNEST` statement.

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use std::collections::{HashMap, HashSet};

use super::{Domain, Inserted, Rejection};
use crate::db::error::DbError;

/// Longest accepted name, in characters.
pub const NAME_MAX_CHARS: usize = 200;
/// Longest accepted email, in bytes (RFC 5321 path limit).
pub const EMAIL_MAX: usize = 254;

/// One user, as carried in a message body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct User {
    pub id: Uuid,
    pub name: String,
    pub email: String,
}

/// One field that failed validation, for a 422 answer or a DLQ reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
    } else if name.chars().count() > NAME_MAX_CHARS {
        errors.push(FieldError {
            field: "name",
            message: format!("must be at most {NAME_MAX_CHARS} characters"),
        });
    } else if let Some(what) = line_problem(name) {
        errors.push(FieldError {
            field: "name",
            message: format!("must be one line of readable text, without {what}"),
        });
    }
    if let Some(message) = email_problem(email) {
        errors.push(FieldError {
            field: "email",
            message,
        });
    }
    errors
}

/// What keeps `text` from being one line of readable text (a user's name, a mapped column's
/// `format = "line"`), if anything: the first character a screen would not show as written,
/// described with its code point. Refused:
/// - control characters (U+0000-U+001F, U+007F-U+009F: line feeds, tabs, escapes);
/// - the line and paragraph separators U+2028 and U+2029 (a second line);
/// - bidi embeddings, overrides and isolates, U+202A-U+202E and U+2066-U+2069 (they reorder
///   what follows them on a screen: "Trojan Source") and the bidi marks U+200E, U+200F, U+061C;
/// - invisible characters: U+200B zero width space, U+2060-U+2064 (word joiner, invisible
///   operators), U+FEFF zero width no-break space, U+180E Mongolian vowel separator;
/// - the zero width joiners U+200C and U+200D except inside a word, between two characters that
///   are neither whitespace nor refused here (Persian, Indic scripts and emoji sequences need
///   them there; alone, first, last or beside a space they only hide).
///
/// Blankness (only whitespace) is the caller's to check: it reads differently for each.
pub(crate) fn line_problem(text: &str) -> Option<String> {
    let refused = |c: char| -> Option<&'static str> {
        match c {
            c if c.is_control() => Some("the control character"),
            '\u{2028}' => Some("the line separator"),
            '\u{2029}' => Some("the paragraph separator"),
            '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' => Some("the bidi control"),
            '\u{200E}' | '\u{200F}' | '\u{061C}' => Some("the bidi mark"),
            '\u{200B}' | '\u{2060}'..='\u{2064}' | '\u{FEFF}' | '\u{180E}' => {
                Some("the invisible character")
            }
            _ => None,
        }
    };
    let joiner = |c: char| c == '\u{200C}' || c == '\u{200D}';
    let chars: Vec<char> = text.chars().collect();
    // Inside a word: a neighbour that is shown (not a space, not refused, not a joiner).
    let shown = |at: Option<&char>| {
        at.is_some_and(|&c| !c.is_whitespace() && refused(c).is_none() && !joiner(c))
    };
    for (i, &c) in chars.iter().enumerate() {
        if let Some(what) = refused(c) {
            return Some(if c.is_control() {
                format!("{what} {c:?}")
            } else {
                format!("{what} U+{:04X}", u32::from(c))
            });
        }
        if joiner(c) && !(i > 0 && shown(chars.get(i - 1)) && shown(chars.get(i + 1))) {
            return Some(format!(
                "the zero width joiner U+{:04X} outside a word",
                u32::from(c)
            ));
        }
    }
    None
}

/// Why `email` is not a plausible address, if it is not.
pub(crate) fn email_problem(email: &str) -> Option<String> {
    if email.len() > EMAIL_MAX {
        return Some(format!("must be at most {EMAIL_MAX} characters"));
    }
    let plausible = match email.rsplit_once('@') {
        Some((local, domain)) => {
            !local.is_empty()
                && local.len() <= 64
                && !local.contains('@')
                && domain.contains('.')
                && !domain.starts_with('.')
                && !domain.ends_with('.')
                && !domain.contains("..")
                && domain
                    .chars()
                    .all(|c| c.is_alphanumeric() || c == '-' || c == '.')
                && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        }
        None => false,
    };
    (!plausible).then(|| "must be a valid email address such as ana@example.com".to_string())
}

/// The users domain behind the pipeline.
#[derive(Debug, Default, Clone)]
pub struct Users;

/// The batch insert. Without a conflict target every unique index (`id` and `email`) is an
/// arbiter, so a copy of a row that another statement is inserting at the same moment is
/// skipped once that statement commits. With `ON CONFLICT (id)` such a copy could fail the
/// whole statement with 23505 on `users_email_key` (its id check passed before the other copy's
/// row existed; its email check then waited for it), and the message was dead-lettered, or
/// parked, although its row was stored. A row skipped for an email stored under another id is
/// told apart below.
///
/// Rows go in key order (both statements), so two batches holding copies of the same users in
/// other orders (two instances, a redelivery beside a retry) take their locks in one order and
/// wait for each other instead of deadlocking (a review found 40P01 each few seconds, each a
/// second's wait before the retry).
const INSERT: &str = "INSERT INTO users (id, name, email) \
     SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[]) AS v(id, name, email) \
     ORDER BY id ON CONFLICT DO NOTHING RETURNING id";

/// The batch insert when every row is new, tried first ([`crate::domain::insert_if_all_new`]): a
/// copy or a conflict makes it fail whole, and [`INSERT`] runs instead.
const INSERT_NEW: &str = "INSERT INTO users (id, name, email) \
     SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[]) AS v(id, name, email) ORDER BY id";

/// What is stored under ids the insert did not take (only run when there are such ids).
const STORED: &str = "SELECT id, name, email FROM users WHERE id = ANY($1::uuid[])";

/// Which ids hold the emails of records skipped while their own id is not stored.
const EMAIL_HOLDERS: &str = "SELECT email, id FROM users WHERE email = ANY($1::text[])";

impl Domain for Users {
    type Record = User;

    fn decode(&self, body: &[u8]) -> Result<User, Rejection> {
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

    fn stored<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        record: &'a User,
    ) -> BoxFuture<'a, Result<bool, DbError>> {
        async move {
            let ids = [record.id];
            let rows = client
                .query(STORED, &[&ids.as_slice()])
                .await
                .map_err(DbError::from_pg)?;
            Ok(rows.iter().any(|r| {
                r.get::<_, String>(1) == record.name && r.get::<_, String>(2) == record.email
            }))
        }
        .boxed()
    }

    fn insert<'a>(
        &'a self,
        client: &'a deadpool_postgres::Client,
        records: &'a [&'a User],
    ) -> BoxFuture<'a, Result<Inserted, DbError>> {
        async move {
            let mut ids = Vec::with_capacity(records.len());
            let mut names = Vec::with_capacity(records.len());
            let mut emails = Vec::with_capacity(records.len());
            for r in records {
                ids.push(r.id);
                names.push(r.name.as_str());
                emails.push(r.email.as_str());
            }
            if !records.is_empty()
                && let Some(rows) =
                    crate::domain::insert_if_all_new(client, INSERT_NEW, &[&ids, &names, &emails])
                        .await?
            {
                return Ok(Inserted {
                    rows,
                    ..Default::default()
                });
            }
            let statement = client
                .prepare_cached(INSERT)
                .await
                .map_err(DbError::from_pg)?;
            let new_ids = client
                .query(&statement, &[&ids, &names, &emails])
                .await
                .map_err(DbError::from_pg)?;
            let rows = new_ids.len() as u64;
            if new_ids.len() == records.len() {
                return Ok(Inserted {
                    rows,
                    ..Default::default()
                });
            }
            // Some ids were already there (or twice in this batch), or their emails were:
            // compare what is stored.
            let taken: HashSet<Uuid> = new_ids.iter().map(|r| r.get(0)).collect();
            let mut seen = HashSet::with_capacity(ids.len());
            let check: Vec<Uuid> = ids
                .iter()
                .filter(|id| !seen.insert(**id) || !taken.contains(id))
                .copied()
                .collect();
            let stored: HashMap<Uuid, (String, String)> = client
                .query(STORED, &[&check])
                .await
                .map_err(DbError::from_pg)?
                .iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2))))
                .collect();
            // Skipped while no row holds its id: its email is stored under another id.
            let skipped: Vec<usize> = (0..records.len())
                .filter(|&i| !taken.contains(&ids[i]) && !stored.contains_key(&ids[i]))
                .collect();
            let refused = if skipped.is_empty() {
                Vec::new()
            } else {
                let emails: Vec<&str> = skipped.iter().map(|&i| emails[i]).collect();
                let holders: HashMap<String, Uuid> = client
                    .query(EMAIL_HOLDERS, &[&emails])
                    .await
                    .map_err(DbError::from_pg)?
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect();
                skipped
                    .into_iter()
                    .map(|i| (i, email_taken(holders.get(&records[i].email))))
                    .collect()
            };
            Ok(Inserted {
                rows,
                conflicts: conflicts(records, &stored),
                refused,
                ..Default::default()
            })
        }
        .boxed()
    }
}

/// Why a record whose email is stored under another id is refused (the words of the unique
/// violation the database would raise, and the id holding the email).
fn email_taken(holder: Option<&Uuid>) -> String {
    let violation = "23505 duplicate key value violates unique constraint \"users_email_key\"";
    match holder {
        Some(id) => format!("{violation}: the email is stored under id {id}"),
        None => violation.into(),
    }
}

/// The records whose id is stored with another name or email, with the reason.
fn conflicts(records: &[&User], stored: &HashMap<Uuid, (String, String)>) -> Vec<(usize, String)> {
    records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let (name, email) = stored.get(&r.id)?;
            let differs: Vec<&str> = [("name", *name != r.name), ("email", *email != r.email)]
                .into_iter()
                .filter(|(_, d)| *d)
                .map(|(field, _)| field)
                .collect();
            (!differs.is_empty()).then(|| {
                (
                    i,
                    format!(
                        "id {} is already stored with another {}",
                        r.id,
                        differs.join(" and ")
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::ErrorKind;

    #[test]
    fn only_other_content_under_a_stored_id_is_a_conflict() {
        let id = Uuid::new_v4();
        let same = User {
            id,
            name: "Ana".into(),
            email: "ana@example.com".into(),
        };
        let other = User {
            name: "Bea".into(),
            ..same.clone()
        };
        let stored = HashMap::from([(id, ("Ana".to_string(), "ana@example.com".to_string()))]);
        assert!(conflicts(&[&same], &stored).is_empty());
        let found = conflicts(&[&same, &other], &stored);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, 1);
        assert!(found[0].1.ends_with("another name"), "{}", found[0].1);
        assert!(conflicts(&[&other], &HashMap::new()).is_empty());
    }

    fn decode(body: &[u8]) -> Result<User, Rejection> {
        Users.decode(body)
    }

    #[test]
    fn a_valid_user_decodes() {
        let id = Uuid::new_v4();
        let body = format!(r#"{{"id":"{id}","name":"Ana","email":"ana@example.com"}}"#);
        assert_eq!(decode(body.as_bytes()).unwrap().id, id);
    }

    #[test]
    fn bad_bodies_get_the_right_kind() {
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
        let id = Uuid::new_v4();
        let as_array = format!(r#"["{id}","Ana","ana@example.com"]"#);
        let err = decode(as_array.as_bytes()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidPayload);
        assert_eq!(decode(b"  nope").unwrap_err().kind, ErrorKind::InvalidJson);
        // Cut short after a value of the wrong type: still not JSON (found by fuzzing review).
        assert_eq!(
            decode(br#"{"id":1"#).unwrap_err().kind,
            ErrorKind::InvalidJson
        );
        assert_eq!(
            decode(br#"{"id":"x","name":"a","email":"a@b.co"}"#)
                .unwrap_err()
                .kind,
            ErrorKind::InvalidPayload
        );
        let id = Uuid::new_v4();
        let no_email = format!(r#"{{"id":"{id}","name":"Ana"}}"#);
        assert_eq!(
            decode(no_email.as_bytes()).unwrap_err().kind,
            ErrorKind::InvalidPayload
        );
        let bad_email = format!(r#"{{"id":"{id}","name":"Ana","email":"nope"}}"#);
        let err = decode(bad_email.as_bytes()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidPayload);
        assert!(err.reason.contains("email"), "{}", err.reason);
    }

    #[test]
    fn validation_reports_every_failing_field() {
        let errors = validate("", "x");
        assert_eq!(errors.len(), 2);
        assert!(
            validate(&"a".repeat(201), "a@b.co")[0]
                .message
                .contains("200")
        );
        assert!(validate(&"é".repeat(200), "a@b.co").is_empty());
        let long_email = format!("{}@example.com", "a".repeat(250));
        assert_eq!(validate("Ana", &long_email)[0].field, "email");
        for bad in ["a@b", "@b.co", "a b@c.co", "a@.co", "a@b..co", "a@b.co."] {
            assert_eq!(validate("Ana", bad).len(), 1, "{bad}");
        }
        assert!(validate("Ana", "ana.maria+tag@sub.example.com").is_empty());
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
            let errors = validate(bad, "ana@example.com");
            assert_eq!(errors.len(), 1, "{bad:?}: {errors:?}");
            assert_eq!(errors[0].field, "name");
            assert!(errors[0].message.contains(what), "{bad:?}: {errors:?}");
        }
    }

    /// The users pipeline declared in config/default.toml and warren's typed users code give the
    /// same answer to every message: both accept it with the same row, or both refuse it as the
    /// same kind. Drawn over ids, names, emails and shapes a publisher may send.
    #[test]
    fn the_declared_users_pipeline_and_the_typed_code_agree_on_every_message() {
        use crate::domain::mapping::Cell;
        let mapping = crate::config::pipelines::users()
            .and_then(|p| p.mapping())
            .expect("the shipped users pipeline compiles");
        let id = "6f1c2c1e-8d3a-4c55-9a8e-0d2b8d1e7a10";
        let ids = [
            format!("\"{id}\""),
            format!("\"{}\"", id.to_uppercase()),
            format!("\"{}\"", id.replace('-', "")),
            format!("\"{{{id}}}\""),
            format!("\"urn:uuid:{id}\""),
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
                        let typed = Users.decode(body.as_bytes());
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
                                assert_eq!(a.kind, b.kind, "{body}: {a:?} vs {b:?}")
                            }
                            _ => panic!("{body}: typed {typed:?}, declared {mapped:?}"),
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
    }
}
