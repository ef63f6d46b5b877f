//! JSON parsing that refuses an object with a repeated key, anywhere in the document.
//!
//! RFC 8259 leaves a repeated key's meaning to the parser: serde_json keeps the last, others keep
//! the first, PostgreSQL's `json` keeps both. A message whose fields mean different things to
//! different readers is refused (`invalid_payload` naming the key's JSON Pointer) rather than
//! stored with one of its readings, as the typed users code always did.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

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
