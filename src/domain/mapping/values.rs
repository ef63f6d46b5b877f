//! The mapping's checks of one value, pure: JSON Pointers and the lookup of a value, numbers
//! as written, text (lengths, `format = "email"` and `"line"`), ranges, years, AMQP header
//! values as JSON, and the words that name what was expected and found.

use std::collections::BTreeMap;

use serde_json::Value;
use serde_json::value::RawValue;

use super::{ColType, Column, Format};

/// Longest accepted email (`format = "email"`), in bytes (RFC 5321 path limit).
pub const EMAIL_MAX: usize = 254;

/// Why a column's `path` is not a JSON Pointer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PointerError {
    #[error("path {0:?} is not a JSON Pointer: it must be \"\" (the whole body) or start with /")]
    NoSlash(String),
    #[error("path {0:?} is not a JSON Pointer: ~ must be followed by 0 or 1")]
    BadEscape(String),
}

/// The unescaped segments of a JSON Pointer (RFC 6901): `""` is the whole document, otherwise
/// `/` then segments separated by `/`, with `~1` for `/` and `~0` for `~`.
pub(super) fn pointer_segments(pointer: &str) -> Result<Vec<String>, PointerError> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(PointerError::NoSlash(pointer.to_string()));
    };
    rest.split('/')
        .map(|seg| {
            let mut out = String::with_capacity(seg.len());
            let mut chars = seg.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => return Err(PointerError::BadEscape(pointer.to_string())),
                }
            }
            Ok(out)
        })
        .collect()
}

/// The value at `segments` of `doc` (an array index is a decimal without leading zeros).
pub(super) fn lookup<'a>(doc: &'a Value, segments: &[String]) -> Option<&'a Value> {
    let mut at = doc;
    for seg in segments {
        at = match at {
            Value::Object(map) => map.get(seg)?,
            Value::Array(items) => {
                if seg.len() > 1 && seg.starts_with('0') {
                    return None;
                }
                items.get(seg.parse::<usize>().ok()?)?
            }
            _ => return None,
        };
    }
    Some(at)
}

/// The text of the number at `segments` of the JSON `text`, as written (numbers lose digits
/// when parsed into a float: `numeric` keeps them).
pub(super) fn raw_number(text: &str, segments: &[String]) -> Option<String> {
    let s = raw_json(text, segments)?;
    s.starts_with(|c: char| c == '-' || c.is_ascii_digit())
        .then_some(s)
}

/// The JSON text of the value at `segments` of the JSON `text`, as written.
pub(super) fn raw_json(text: &str, segments: &[String]) -> Option<String> {
    let mut raw: &RawValue = serde_json::from_str(text).ok()?;
    for seg in segments {
        let trimmed = raw.get().trim_start();
        raw = if trimmed.starts_with('{') {
            let map: BTreeMap<String, &RawValue> = serde_json::from_str(raw.get()).ok()?;
            map.get(seg).copied()?
        } else {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).ok()?;
            items.get(seg.parse::<usize>().ok()?).copied()?
        };
    }
    Some(raw.get().trim().to_string())
}

/// The top-level fields of a JSON object `text` in the order it gives them (empty for anything
/// else), so what is wrong with a body is said in the order its writer wrote it.
pub fn body_fields(text: &str) -> Vec<String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visit;
            impl<'de> serde::de::Visitor<'de> for Visit {
                type Value = Keys;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some((k, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(Visit)
        }
    }
    serde_json::from_str::<Keys>(text)
        .map(|k| k.0)
        .unwrap_or_default()
}

/// Whether `s` is a decimal PostgreSQL's numeric takes: optional sign, digits, an optional
/// fraction, an optional exponent.
pub(super) fn is_decimal(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e)),
        None => (s, None),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |d: &str| d.chars().all(|c| c.is_ascii_digit());
    (!int.is_empty() || !frac.is_empty())
        && digits(int)
        && digits(frac)
        && exponent.is_none_or(|e| {
            let e = e.strip_prefix(['-', '+']).unwrap_or(e);
            !e.is_empty() && digits(e)
        })
}

/// Whether the decimal `s` (as [`is_decimal`] takes it) is one PostgreSQL's numeric can hold:
/// at most 131072 digits before the point (a zero has none) and a scale of at most 16383, the
/// scale being the digits written after the point minus the exponent, and an exponent below
/// 1073741823 in size (PostgreSQL 15's numeric.c; tests/mapping.rs asks the server itself).
/// Beyond them the server
/// refuses the whole statement ("value overflows numeric format"), which would cost a batch
/// split to find the row.
pub(super) fn numeric_fits(s: &str) -> bool {
    const MAX_BEFORE_POINT: i64 = 131_072;
    const MAX_SCALE: i64 = 16_383;
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = s.split_once(['e', 'E']).unwrap_or((s, "0"));
    let exponent: i64 = {
        let (negative, digits) = match exponent.strip_prefix('-') {
            Some(d) => (true, d),
            None => (false, exponent.strip_prefix('+').unwrap_or(exponent)),
        };
        let digits = digits.trim_start_matches('0');
        // Past 18 digits it overflows any bound here: saturate.
        let magnitude: i64 = if digits.len() > 18 {
            i64::MAX / 4
        } else {
            digits.parse().unwrap_or(0)
        };
        if negative { -magnitude } else { magnitude }
    };
    // The server refuses any exponent from INT_MAX / 2 on, even on a zero (numeric.c).
    if exponent.abs() >= i64::from(i32::MAX / 2) {
        return false;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let scale = frac.len() as i64 - exponent;
    if scale > MAX_SCALE {
        return false;
    }
    let int = int.trim_start_matches('0');
    let before_point = if !int.is_empty() {
        int.len() as i64
    } else {
        match frac.find(|c| c != '0') {
            Some(zeros) => -(zeros as i64),
            // Zero: no digit before the point, whatever the exponent.
            None => return true,
        }
    };
    before_point + exponent <= MAX_BEFORE_POINT
}

/// What is wrong with one column's value. A declared check ([`CheckError`]) is named by its
/// column in a reason (`name must not be empty`: the column's own rule, the 422's field and
/// message); anything else by where the value was looked for (`/id: missing (a uuid is
/// required)`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValueError {
    /// Absent, and the column is not optional.
    #[error("missing (a {0} is required)")]
    Missing(ColType),
    /// `null`, and the column is not optional.
    #[error("null (a {0} is required)")]
    Null(ColType),
    /// A JSON value of another kind than the column's type reads (as [`found`] words it).
    #[error("expected {}, found {found}", expects(*.expected))]
    WrongType { expected: ColType, found: String },
    /// A value of the right JSON kind that the column's type cannot take, or that PostgreSQL
    /// cannot store (a string that is no UUID, an integer beyond an int4, U+0000 in text, a
    /// header of another AMQP type): the words say which.
    #[error("{0}")]
    Unfit(String),
    /// A declared check of the column (`min`, `max`, `min_len`, `max_len`, `format`) refused it.
    #[error("{0}")]
    Check(#[from] CheckError),
}

impl ValueError {
    /// The words for a client naming the field apart (the API's 422 `fields`): a value that is
    /// not there `is required`, one of the wrong kind `must be` what the type reads, the rest as
    /// the reason words it.
    pub fn field_message(&self) -> String {
        match self {
            ValueError::Missing(_) => "is required".into(),
            ValueError::Null(_) => "must not be null".into(),
            ValueError::WrongType { expected, .. } => format!("must be {}", expects(*expected)),
            other => other.to_string(),
        }
    }
}

/// A declared check of a column that refused its value, in the words users always had (`name
/// must not be empty`, `name must be at most 200 characters`): the column's name, then the rule.
/// An element of a child table's array is named by its path instead, then what was expected
/// and found ([`CheckError::expected`]: `/items/1/qty: expected at least 1, found 0`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
    /// `format = "line"`: only whitespace.
    #[error("must not be empty")]
    Blank,
    /// `min_len`, in characters, and the characters found.
    #[error("must be at least {min} characters")]
    TooShort { min: usize, found: usize },
    /// `max_len`, in characters, and the characters found.
    #[error("must be at most {max} characters")]
    TooLong { max: usize, found: usize },
    /// `format = "line"`: what a screen would not show as written ([`line_problem`]).
    #[error("must be one line of readable text, without {0}")]
    NotALine(String),
    /// `format = "email"`.
    #[error("{0}")]
    NotAnEmail(EmailProblem),
    /// `min`: the least accepted, and the value as written.
    #[error("must be at least {min}, found {shown}")]
    Below { min: f64, shown: String },
    /// `max`: the greatest accepted, and the value as written.
    #[error("must be at most {max}, found {shown}")]
    Above { max: f64, shown: String },
    /// `one_of`: the values accepted, as shown (`EUR, USD`), and the value found.
    #[error("must be one of {allowed}, found {found}")]
    NotOneOf { allowed: String, found: String },
    /// `pattern`: the pattern, as shown, and the value found.
    #[error("must match the pattern {pattern}, found {found}")]
    NoMatch { pattern: String, found: String },
}

impl CheckError {
    /// The same refusal said after a path, as what was expected and what was found (an
    /// element of a child table: `/items/1/qty: expected at least 1, found 0`).
    pub fn expected(&self) -> String {
        match self {
            CheckError::Blank => "expected text that is not blank, found only whitespace".into(),
            CheckError::TooShort { min, found } => {
                format!("expected at least {min} characters, found {found}")
            }
            CheckError::TooLong { max, found } => {
                format!("expected at most {max} characters, found {found}")
            }
            CheckError::NotALine(what) => {
                format!("expected one line of readable text, found {what}")
            }
            CheckError::NotAnEmail(EmailProblem::TooLong) => {
                format!("expected an email address of at most {EMAIL_MAX} characters")
            }
            CheckError::NotAnEmail(EmailProblem::Implausible) => {
                "expected a valid email address such as ana@example.com".into()
            }
            CheckError::Below { min, shown } => format!("expected at least {min}, found {shown}"),
            CheckError::Above { max, shown } => format!("expected at most {max}, found {shown}"),
            CheckError::NotOneOf { allowed, found } => {
                format!("expected one of {allowed}, found {found}")
            }
            CheckError::NoMatch { pattern, found } => {
                format!("expected a match of the pattern {pattern}, found {found}")
            }
        }
    }
}

/// Why an address is not one `format = "email"` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EmailProblem {
    /// Over [`EMAIL_MAX`] bytes.
    #[error("must be at most {EMAIL_MAX} characters")]
    TooLong,
    /// Not of the shape `local@domain.tld`.
    #[error("must be a valid email address such as ana@example.com")]
    Implausible,
}

/// The checks of a text column, in the order users always made them: blank (`format =
/// "line"`), then the lengths, then the format; then U+0000, which PostgreSQL text cannot store
/// (a line or an address already refuses it as a control character).
pub(super) fn check_text(c: &Column, s: &str) -> Result<(), ValueError> {
    if c.format == Some(Format::Line) && s.trim().is_empty() {
        return Err(CheckError::Blank.into());
    }
    let chars = s.chars().count();
    if let Some(min) = c.min_len
        && chars < min
    {
        return Err(CheckError::TooShort { min, found: chars }.into());
    }
    if let Some(max) = c.max_len
        && chars > max
    {
        return Err(CheckError::TooLong { max, found: chars }.into());
    }
    match c.format {
        Some(Format::Email) => {
            if let Some(problem) = email_problem(s) {
                return Err(CheckError::NotAnEmail(problem).into());
            }
        }
        Some(Format::Line) => {
            if let Some(what) = line_problem(s) {
                return Err(CheckError::NotALine(what).into());
            }
        }
        None => {}
    }
    if let Some(p) = &c.pattern
        && !p.matches(s)
    {
        return Err(CheckError::NoMatch {
            pattern: shown(&p.source),
            found: shown(s),
        }
        .into());
    }
    if s.contains('\0') {
        return Err(ValueError::Unfit(
            "holds U+0000, which PostgreSQL text cannot store".into(),
        ));
    }
    Ok(())
}

pub(super) fn check_range(c: &Column, n: f64, shown: &str) -> Result<(), ValueError> {
    // NaN (a numeric beyond a float's range) is neither above nor below: it passes no bound.
    if let Some(min) = c.min
        && (n.is_nan() || n < min)
    {
        return Err(CheckError::Below {
            min,
            shown: shown.to_string(),
        }
        .into());
    }
    if let Some(max) = c.max
        && (n.is_nan() || n > max)
    {
        return Err(CheckError::Above {
            max,
            shown: shown.to_string(),
        }
        .into());
    }
    Ok(())
}

/// What a type expects, for messages.
pub(super) fn expects(ty: ColType) -> &'static str {
    match ty {
        ColType::Text => "a string",
        ColType::Uuid => "a string holding a UUID",
        ColType::Int4 => "an integer (int4)",
        ColType::Int8 => "an integer (int8)",
        ColType::Float8 => "a number",
        ColType::Numeric => "a number or a string holding a decimal",
        ColType::Bool => "true or false",
        ColType::Timestamptz => "a string holding an RFC 3339 time",
        ColType::Date => "a string holding a date YYYY-MM-DD",
        ColType::Jsonb => "any JSON value",
    }
}

/// What a JSON value is, for messages.
pub(super) fn found(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {:?}", clip(s)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// A value of a `one_of` or `pattern` check in a reason: as it is when it is a plain word
/// (letters, digits and `-_.@:/+`, at most 60 characters: `EUR`), else quoted and cut
/// (`"a, b"`), so a value never reads as two.
pub(super) fn shown(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars().count() <= 60
        && s.chars()
            .all(|c| c.is_alphanumeric() || "-_.@:/+".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("{:?}", clip(s))
    }
}

/// `s` cut to 60 characters for a message.
pub(super) fn clip(s: &str) -> String {
    if s.chars().count() <= 60 {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(60).collect::<String>())
    }
}

/// `text` as PostgreSQL's `uuid` input reads it (`uuid.c`, `string_to_uuid`), or `None` where
/// PostgreSQL refuses it: 32 hexadecimal digits in either case, optionally between `{` and `}`,
/// with at most one `-` after any group of four digits (`a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11`
/// as much as the standard 8-4-4-4-12), and nothing else: no blanks around it, no `urn:uuid:`,
/// no hyphen first, last or doubled. The uuid crate's parser takes `urn:uuid:` and refuses the
/// other groupings; a column then refused what it would hold, or held what PostgreSQL refuses.
pub fn pg_uuid(text: &str) -> Option<uuid::Uuid> {
    let bytes = text.as_bytes();
    let (braces, mut at) = match bytes.first() {
        Some(b'{') => (true, 1),
        _ => (false, 0),
    };
    let mut value: u128 = 0;
    for i in 0..16 {
        let pair = bytes.get(at..at + 2)?;
        let hex = |b: u8| (b as char).to_digit(16);
        value = value << 8 | u128::from(hex(pair[0])? * 16 + hex(pair[1])?);
        at += 2;
        if bytes.get(at) == Some(&b'-') && i % 2 == 1 && i < 15 {
            at += 1;
        }
    }
    if braces {
        (bytes.get(at) == Some(&b'}')).then_some(())?;
        at += 1;
    }
    (at == bytes.len()).then_some(uuid::Uuid::from_u128(value))
}

pub(super) fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

/// PostgreSQL reads no year 0 and no negative year in ISO spelling (it writes BC instead): such
/// a date or time is refused here, naming the path, rather than by the database for its batch.
pub(super) fn check_year(year: i32, text: &str) -> Result<(), ValueError> {
    if year < 1 {
        return Err(ValueError::Unfit(format!(
            "expected a year from 0001 (PostgreSQL reads no year 0 or below), found {:?}",
            clip(text)
        )));
    }
    Ok(())
}

/// An AMQP header value as JSON, so a header column reads like a path: strings as strings,
/// integers and floats as numbers, booleans, void as null. Anything else (byte arrays, arrays,
/// tables, decimals, timestamps, a string of invalid UTF-8) has no one JSON reading: `Err`
/// names its AMQP type, and the message is refused rather than stored as some rendering of it.
pub(super) fn header_json(v: &lapin::types::AMQPValue) -> Result<Value, &'static str> {
    use lapin::types::AMQPValue as A;
    Ok(match v {
        A::LongString(s) => Value::String(
            std::str::from_utf8(s.as_bytes())
                .map_err(|_| "a string of invalid UTF-8")?
                .to_string(),
        ),
        A::ShortString(s) => Value::String(s.as_str().to_string()),
        A::Boolean(b) => Value::Bool(*b),
        A::ShortShortInt(n) => Value::from(*n),
        A::ShortShortUInt(n) => Value::from(*n),
        A::ShortInt(n) => Value::from(*n),
        A::ShortUInt(n) => Value::from(*n),
        A::LongInt(n) => Value::from(*n),
        A::LongUInt(n) => Value::from(*n),
        A::LongLongInt(n) => Value::from(*n),
        A::Float(f) => Value::from(*f as f64),
        A::Double(f) => Value::from(*f),
        A::Void => Value::Null,
        A::ByteArray(_) => return Err("a byte array"),
        A::FieldArray(_) => return Err("a field array"),
        A::FieldTable(_) => return Err("a field table"),
        A::DecimalValue(_) => return Err("an AMQP decimal"),
        A::Timestamp(_) => return Err("an AMQP timestamp"),
    })
}

/// What keeps `text` from being one line of readable text (a mapped column's `format = "line"`:
/// names and titles), if anything: the first character a screen would not show as written,
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
pub fn line_problem(text: &str) -> Option<String> {
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
    // Printable ASCII has none of them (the common case, read without decoding a char).
    if text.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    let joiner = |c: char| c == '\u{200C}' || c == '\u{200D}';
    // Inside a word: a neighbour that is shown (not a space, not refused, not a joiner).
    let shown = |at: Option<char>| {
        at.is_some_and(|c| !c.is_whitespace() && refused(c).is_none() && !joiner(c))
    };
    let mut before = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if let Some(what) = refused(c) {
            return Some(if c.is_control() {
                format!("{what} {c:?}")
            } else {
                format!("{what} U+{:04X}", u32::from(c))
            });
        }
        if joiner(c) && !(shown(before) && shown(chars.peek().copied())) {
            return Some(format!(
                "the zero width joiner U+{:04X} outside a word",
                u32::from(c)
            ));
        }
        before = Some(c);
    }
    None
}

/// Why `email` is not a plausible address, if it is not.
pub fn email_problem(email: &str) -> Option<EmailProblem> {
    if email.len() > EMAIL_MAX {
        return Some(EmailProblem::TooLong);
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
    (!plausible).then_some(EmailProblem::Implausible)
}
