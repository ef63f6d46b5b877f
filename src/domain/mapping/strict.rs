//! Strict JSON reading: a document that means one thing to every reader, and numbers as
//! PostgreSQL reads them.
//!
//! - [`parse`]: refuses an object with a repeated key, anywhere in the document. RFC 8259
//!   leaves a repeated key's meaning to the parser: serde_json keeps the last, others keep the
//!   first, PostgreSQL's `json` keeps both. A message whose fields mean different things to
//!   different readers is refused (`invalid_payload` naming the key's JSON Pointer) rather than
//!   stored with one of its readings, as the typed users code always did.
//! - [`integer`]: an integer column's value, `-0` included.
//! - [`number_beyond_numeric`]: a number a `jsonb` value holds that PostgreSQL cannot store.
//! - [`too_deep`]: a document nested deeper than [`DEPTH_MAX`] arrays and objects, which is
//!   JSON but more than warren reads (serde_json's recursion limit, which keeps a hostile body
//!   from exhausting the stack): refused as such, never as "not JSON".

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The deepest nesting of arrays and objects a document may have (serde_json's recursion limit,
/// a depth budget of 128 that the 128th level exhausts): 127 levels are read, a 128th is
/// refused ([`too_deep`]).
pub const DEPTH_MAX: usize = 127;

/// Whether `e`, from [`parse`], says the document nests arrays and objects deeper than
/// [`DEPTH_MAX`]: well-formed JSON up to there, but more than warren reads. serde_json gives no
/// code for it but its words, which its own tests fix.
pub fn too_deep(e: &serde_json::Error) -> bool {
    e.classify() == serde_json::error::Category::Syntax
        && e.to_string().starts_with("recursion limit exceeded")
}

/// What a [`too_deep`] document is refused with: the limit and where it was passed.
pub fn too_deep_reason(e: &serde_json::Error) -> String {
    format!(
        "the body nests arrays and objects deeper than {DEPTH_MAX} levels (the most warren \
         reads), at line {} column {}",
        e.line(),
        e.column()
    )
}

/// Parses `text` into a [`Value`]; an object with a repeated key is an error naming it. As
/// fast as parsing into a `Value`: the pointer is only written for the error.
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = Strict {
        parent: None,
        step: Step::Root,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// An integer column's value (int4, int8): a JSON number written as an integer, digits with an
/// optional minus and neither a fraction nor an exponent, as PostgreSQL's integer input reads
/// it. `written` gives the number as the message wrote it, asked only for what serde_json does
/// not read as an integer: `-0` (read as the float -0.0) is 0; `-0.0`, `0e0`, `1e2` and `1.0`
/// are not integers (PostgreSQL: `invalid input syntax for type integer`), whatever their value.
pub fn integer(value: &Value, written: impl FnOnce() -> Option<String>) -> Option<i64> {
    if let Some(n) = value.as_i64() {
        return Some(n);
    }
    match value {
        Value::Number(n) if n.as_f64() == Some(0.0) => (written()?.as_str() == "-0").then_some(0),
        _ => None,
    }
}

/// The first number of the JSON text `json` that PostgreSQL's `jsonb` cannot store, if any:
/// jsonb holds each number as a `numeric` (at most 131072 digits before the point and 16383
/// after, [`super::numeric_fits`]), and refuses the whole value otherwise (22003 `value
/// overflows numeric format`). Strings are skipped; `json` is valid JSON (already parsed).
pub fn number_beyond_numeric(json: &str) -> Option<&str> {
    let bytes = json.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                // To the closing quote, over escapes (`\"`, `\\`).
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                let number = &json[start..i];
                if !super::numeric_fits(number) {
                    return Some(number);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// How a value is reached from its parent.
#[derive(Clone, Copy)]
enum Step<'p> {
    Root,
    Key(&'p str),
    Index(usize),
}

/// One value, with the way to it (for the error's JSON Pointer).
struct Strict<'p> {
    parent: Option<&'p Strict<'p>>,
    step: Step<'p>,
}

impl Strict<'_> {
    /// The JSON Pointer (RFC 6901) of this value, `key` appended when given.
    fn pointer(&self, key: Option<&str>) -> String {
        let mut steps = Vec::new();
        if let Some(key) = key {
            steps.push(key.replace('~', "~0").replace('/', "~1"));
        }
        let mut at = Some(self);
        while let Some(here) = at {
            match here.step {
                Step::Root => {}
                Step::Key(k) => steps.push(k.replace('~', "~0").replace('/', "~1")),
                Step::Index(i) => steps.push(i.to_string()),
            }
            at = here.parent;
        }
        steps.iter().rev().map(|s| format!("/{s}")).collect()
    }
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // serde_json hands only finite numbers here.
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element_seed(Strict {
            parent: Some(&self),
            step: Step::Index(items.len()),
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(Strict {
                parent: Some(&self),
                step: Step::Key(&key),
            })?;
            // One lookup a key, as serde_json's own Value does.
            match object.entry(key) {
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(value);
                }
                serde_json::map::Entry::Occupied(taken) => {
                    return Err(de::Error::custom(format_args!(
                        "the key {} appears twice in one object",
                        self.pointer(Some(taken.key()))
                    )));
                }
            }
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_parses_as_serde_json_parses_it() {
        for text in [
            r#"{"a":1,"b":[true,null,"x",-2,1.5e3],"c":{"d":{}}}"#,
            "[]",
            "\"s\"",
            "18446744073709551615",
            "-9223372036854775808",
            "1e308",
        ] {
            assert_eq!(
                parse(text).unwrap(),
                serde_json::from_str::<Value>(text).unwrap()
            );
        }
    }

    #[test]
    fn an_integer_is_written_as_one_and_minus_zero_is_zero() {
        let int = |text: &str| integer(&parse(text).unwrap(), || Some(text.to_string()));
        assert_eq!(int("-0"), Some(0));
        assert_eq!(int("0"), Some(0));
        assert_eq!(int("-12"), Some(-12));
        assert_eq!(int("9223372036854775807"), Some(i64::MAX));
        assert_eq!(int("-9223372036854775808"), Some(i64::MIN));
        // What psql answers for '<text>'::int4: invalid input syntax for type integer.
        for not_integer in [
            "-0.0",
            "0.0",
            "0e0",
            "-0e0",
            "1e2",
            "1.0",
            "1.5",
            "9223372036854775808",
        ] {
            assert_eq!(int(not_integer), None, "{not_integer}");
        }
        // Not a number at all.
        assert_eq!(int("\"1\""), None);
        assert_eq!(int("true"), None);
        // Without the written form (a header's float), -0.0 stays a float.
        assert_eq!(integer(&parse("-0").unwrap(), || None), None);
    }

    #[test]
    fn a_jsonb_number_beyond_numeric_is_found_where_postgresql_refuses_it() {
        // Each expectation is what PostgreSQL 15 answered for `select '<json>'::jsonb`:
        // stored, or `value overflows numeric format`.
        let stored = [
            "1e-16383",
            "1.5e-16382",
            "1e131071",
            "9.9e131071",
            "0e999999",
            "-0",
            "-0.0",
            "0e0",
            "1e2",
            "1.0",
            r#""1e-99999""#,
            r#"{"a":"x\"1e-99999","b":[1,-2.5e3]}"#,
        ];
        for json in stored {
            assert_eq!(number_beyond_numeric(json), None, "{json}");
        }
        let refused = [
            ("1e-20000", "1e-20000"),
            ("1e-16384", "1e-16384"),
            ("1.5e-16383", "1.5e-16383"),
            ("1e131072", "1e131072"),
            ("12e131071", "12e131071"),
            ("0e-99999", "0e-99999"),
            ("0.000e-16383", "0.000e-16383"),
            ("1e-1073741822", "1e-1073741822"),
            ("0e1073741823", "0e1073741823"),
            (r#"[1,{"a":1e-16384}]"#, "1e-16384"),
            (r#"{"s":"\\","n":-1E-20000}"#, "-1E-20000"),
        ];
        for (json, number) in refused {
            assert_eq!(number_beyond_numeric(json), Some(number), "{json}");
        }
    }

    #[test]
    fn a_repeated_key_is_named_wherever_it_is() {
        let e = parse(r#"{"id":1,"id":2}"#).unwrap_err().to_string();
        assert!(e.contains("the key /id appears twice"), "{e}");
        let e = parse(r#"{"a":[{"x":1},{"b/c":1,"b/c":2}]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the key /a/1/b~1c appears twice"), "{e}");
        // The same key in two objects is no repetition.
        assert!(parse(r#"[{"k":1},{"k":2}]"#).is_ok());
        // Trailing text is still refused.
        assert!(parse(r#"{"k":1} x"#).is_err());
    }
}
