//! Decoding one message with its mapping: the body (a JSON document, parsed strictly), its
//! headers and, for property columns, its AMQP properties and where it was published, into one
//! cell per column and the child tables' rows; or every problem found, each naming its path and
//! what was expected.

use super::*;

impl Mapping {
    /// Decodes one message: its body (and headers) into one cell per column, or why not. No
    /// properties: a property column is absent (NULL when optional, its default, or refused).
    pub fn decode_message(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Row, Rejection> {
        self.decode_detailed(body, headers).map_err(|r| r.rejection)
    }

    /// As [`Mapping::decode_message`], and a refusal also names each field at fault
    /// ([`Problem`]), for an answer that lists them (the API's 422). Nothing more is built on
    /// the way to a row.
    pub fn decode_detailed(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
    ) -> Result<Row, Refused> {
        self.decode_full(body, headers, None)
    }

    /// Decodes one delivered message: body, headers and properties (`envelope`).
    pub fn decode_envelope(&self, body: &[u8], envelope: &Envelope<'_>) -> Result<Row, Refused> {
        self.decode_full(body, envelope.properties.headers().as_ref(), Some(envelope))
    }

    pub(super) fn decode_full(
        &self,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
        envelope: Option<&Envelope<'_>>,
    ) -> Result<Row, Refused> {
        if body.is_empty() {
            return Err(Rejection::json("empty body").into());
        }
        let text = std::str::from_utf8(body)
            .map_err(|e| Rejection::json(format!("body is not UTF-8: {e}")))?;
        let doc: Value = strict::parse(text).map_err(|e| match e.classify() {
            // A repeated key in JSON that is otherwise well formed; cut short or broken
            // further on, it is not JSON.
            serde_json::error::Category::Data => {
                match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                    Ok(_) => Rejection::payload(e.to_string()),
                    Err(syntax) => Rejection::json(format!("not JSON: {syntax}")),
                }
            }
            // JSON, but deeper than warren reads: said so, as a payload it will not take.
            _ if strict::too_deep(&e) => Rejection::payload(strict::too_deep_reason(&e)),
            _ => Rejection::json(format!("not JSON: {e}")),
        })?;
        // Fields are read from an object: another value is the wrong shape, said as such rather
        // than as every required column missing.
        if self.reads_object && !doc.is_object() {
            return Err(Rejection::payload(format!(
                "the body: expected a JSON object (the columns read its fields), found {}",
                found(&doc)
            ))
            .into());
        }
        // Every problem is named, the unknown fields of the body's top level with those of the
        // elements and the columns' (review R36g F5: the first ones alone were named).
        let unknown = self.unknown_top_level(&doc);
        if let Some(d) = &self.delete
            && d.matches(&doc)
        {
            // Its unknown fields with its other problems (review R36h F8).
            return match (unknown, self.decode_delete(text, &doc, headers, envelope)) {
                (None, decoded) => decoded,
                (Some(refused), Ok(_)) => Err(refused),
                (Some(mut refused), Err(other)) => {
                    refused.rejection.reason =
                        format!("{}; {}", refused.rejection.reason, other.rejection.reason);
                    refused.problems.extend(other.problems);
                    Err(refused)
                }
            };
        }
        let mut cells = Vec::with_capacity(self.columns.len());
        let mut problems = Vec::new();
        for c in &self.columns {
            let cell = match c.source {
                Source::Kept => self.kept(text, &doc),
                _ => Self::cell(c, text, &doc, headers, envelope),
            };
            match cell {
                Ok(cell) => cells.push(cell),
                Err(p) => {
                    // A place kept, so the columns after it keep their indices: a child column
                    // reads its parent's cell by index (review R36i F3: a parent column refused
                    // before the key put the next column's value in a child key's reason).
                    cells.push(Cell::Null);
                    problems.push((c, p));
                }
            }
        }
        let mut rows = Vec::with_capacity(self.children.len());
        let mut child_problems: Vec<(String, Problem)> = Vec::new();
        for child in &self.children {
            match child.decode(self, text, &doc, &cells, headers, envelope) {
                Ok(r) => rows.push(r),
                Err(mut found) => {
                    rows.push(Vec::new());
                    child_problems.append(&mut found);
                }
            }
        }
        if problems.is_empty() && child_problems.is_empty() && unknown.is_none() {
            return Ok(Row(cells, rows, Op::Write));
        }
        if problems.len() > 1 {
            // In the order the body gives its fields (a field it lacks, or a header, after).
            let order = values::body_fields(text);
            problems.sort_by_key(|(c, _)| match &c.source {
                Source::Path { segments, .. } => segments
                    .first()
                    .and_then(|f| order.iter().position(|o| o == f))
                    .unwrap_or(usize::MAX),
                _ => usize::MAX,
            });
        }
        let (mut reason, mut found) = match unknown {
            Some(refused) => (vec![refused.rejection.reason], refused.problems),
            None => (Vec::new(), Vec::new()),
        };
        reason.extend(problems.iter().map(|(c, e)| c.reason(e)));
        reason.extend(child_problems.iter().map(|(r, _)| r.clone()));
        // Once each: a property or header every element of an array reads refused the message
        // once per element, its reason a thousand times over (review R36f F2).
        let mut seen = std::collections::HashSet::new();
        reason.retain(|r| seen.insert(r.clone()));
        found.extend(problems.into_iter().map(|(c, error)| Problem::Column {
            column: c.name.clone(),
            error,
        }));
        found.extend(child_problems.into_iter().map(|(_, p)| p));
        Err(Refused {
            rejection: Rejection::payload(reason.join("; ")),
            problems: found,
        })
    }

    /// Under `unknown_fields = "reject"`, the body's top-level fields no column reads, as a
    /// refusal naming them all (`unknown fields /a, /b`); `None` when there are none.
    fn unknown_top_level(&self, doc: &Value) -> Option<Refused> {
        let Value::Object(map) = doc else {
            return None;
        };
        if self.unknown_fields != UnknownFields::Reject {
            return None;
        }
        let mut unknown: Vec<&String> = map.keys().filter(|k| !self.fields.contains(*k)).collect();
        if unknown.is_empty() {
            return None;
        }
        unknown.sort();
        // JSON Pointers, as every other path (review R36h F2: `/c/d` read as d inside c).
        let list: Vec<String> = unknown
            .iter()
            .map(|k| format!("/{}", super::children::escape(k)))
            .collect();
        Some(Refused {
            rejection: Rejection::payload(format!(
                "unknown field{} {} (unknown_fields = \"reject\")",
                if list.len() == 1 { "" } else { "s" },
                list.join(", ")
            )),
            problems: unknown
                .into_iter()
                .map(|k| Problem::Unknown(k.clone()))
                .collect(),
        })
    }

    /// `unknown_fields = { keep = ... }`: the body's top-level fields no column reads, as one
    /// JSON object of them, each value as written (a number keeps its digits); `{}` when there
    /// are none (or the body is no object). Checked as a jsonb column's value is: no U+0000, no
    /// number beyond PostgreSQL's numeric.
    fn kept(&self, text: &str, doc: &Value) -> Result<Cell, ValueError> {
        let Value::Object(map) = doc else {
            return Ok(Cell::Jsonb("{}".into()));
        };
        if map.keys().all(|k| self.fields.contains(k)) {
            return Ok(Cell::Jsonb("{}".into()));
        }
        // The body once more, each field's value as written (the body parsed strictly
        // already: no key twice).
        let raw: std::collections::BTreeMap<String, &serde_json::value::RawValue> =
            serde_json::from_str(text)
                .map_err(|e| unfit(format!("the body's fields could not be read again: {e}")))?;
        let mut out = String::with_capacity(text.len());
        out.push('{');
        for (k, v) in raw.iter().filter(|(k, _)| !self.fields.contains(*k)) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&Value::String(k.clone()).to_string());
            out.push(':');
            out.push_str(v.get());
        }
        out.push('}');
        let kept: Vec<(&String, &Value)> = map
            .iter()
            .filter(|(k, _)| !self.fields.contains(*k))
            .collect();
        if let Some((k, _)) = kept
            .iter()
            .find(|(k, v)| k.contains('\0') || contains_nul(v))
        {
            return Err(unfit(format!(
                "the unknown field {:?} holds U+0000, which PostgreSQL's jsonb cannot store",
                clip(k)
            )));
        }
        if let Some(n) = strict::number_beyond_numeric(&out) {
            return Err(unfit(format!(
                "an unknown field holds the number {}, beyond what PostgreSQL's jsonb stores (a \
                 numeric: at most 131072 digits before the point and 16383 after)",
                clip(n)
            )));
        }
        Ok(Cell::Jsonb(out))
    }

    /// The top-level fields of a body the columns read, sorted.
    pub fn fields(&self) -> Vec<&str> {
        let mut fields: Vec<&str> = self.fields.iter().map(String::as_str).collect();
        fields.sort_unstable();
        fields
    }

    /// The top-level field of the body column `column` reads its value from (its path is
    /// `/<field>`), if it reads one so.
    pub fn field_of(&self, column: &str) -> Option<&str> {
        match &self.columns.iter().find(|c| c.name == column)?.source {
            Source::Path { segments, .. } if segments.len() == 1 => Some(segments[0].as_str()),
            _ => None,
        }
    }

    /// One column's cell, or what is wrong with its value.
    pub(super) fn cell(
        c: &Column,
        text: &str,
        doc: &Value,
        headers: Option<&lapin::types::FieldTable>,
        envelope: Option<&Envelope<'_>>,
    ) -> Result<Cell, ValueError> {
        let value = match &c.source {
            Source::Path { segments, .. } => lookup(doc, segments).cloned(),
            Source::Property(p) => match envelope {
                Some(e) => property(*p, e)?,
                None => None,
            },
            // Filled by the child table's decode (or the decode of the body), never looked up.
            Source::Parent(_) | Source::Index | Source::Kept => None,
            // Past the parser's budget too: a header the message carries is never read as
            // absent (`headers::header`).
            Source::Header(h) => match headers
                .map(|t| crate::amqp::headers::header(t, h))
                .transpose()
                .map_err(|e| ValueError::Unfit(e.to_string()))?
                .flatten()
                .map(|v| header_json(&v))
            {
                Some(Err(amqp_type)) => {
                    return Err(ValueError::Unfit(format!(
                        "expected {}, found {amqp_type} (a header column reads a string, a \
                         number, a boolean or void)",
                        expects(c.ty)
                    )));
                }
                Some(Ok(v)) => Some(v),
                None => None,
            },
        };
        let value = match value {
            None if c.default.is_some() => return Ok(c.default.clone().unwrap_or(Cell::Null)),
            None | Some(Value::Null) if c.optional => return Ok(Cell::Null),
            None => return Err(ValueError::Missing(c.ty)),
            Some(Value::Null) => return Err(ValueError::Null(c.ty)),
            Some(v) => v,
        };
        let wrong = |v: &Value| ValueError::WrongType {
            expected: c.ty,
            found: found(v),
        };
        let cell = match c.ty {
            ColType::Text => match value {
                Value::String(s) => {
                    check_text(c, &s)?;
                    Cell::Text(s)
                }
                other => return Err(wrong(&other)),
            },
            ColType::Uuid => match &value {
                // As PostgreSQL's uuid input reads it, braces and groupings included.
                Value::String(s) => Cell::Uuid(
                    pg_uuid(s)
                        .ok_or_else(|| unfit(format!("expected a UUID, found {:?}", clip(s))))?,
                ),
                other => return Err(wrong(other)),
            },
            ColType::Int4 | ColType::Int8 => {
                // As written: `-0` is 0 (serde_json reads it as a float).
                let written = || match &c.source {
                    Source::Path { segments, .. } => raw_number(text, segments),
                    _ => None,
                };
                let n = strict::integer(&value, written).ok_or_else(|| wrong(&value))?;
                check_range(c, n as f64, &n.to_string())?;
                if c.ty == ColType::Int4 {
                    Cell::Int4(i32::try_from(n).map_err(|_| {
                        unfit(format!(
                            "{n} does not fit an int4 (-2147483648 to 2147483647)"
                        ))
                    })?)
                } else {
                    Cell::Int8(n)
                }
            }
            ColType::Float8 => {
                let n = match &value {
                    Value::Number(n) => n.as_f64().ok_or_else(|| wrong(&value))?,
                    other => return Err(wrong(other)),
                };
                // A number below the smallest double parses to 0: PostgreSQL's float8 refuses
                // it (`select '1e-400'::float8`: out of range), so warren never stores 0 for it.
                if n == 0.0
                    && let Source::Path { segments, .. } = &c.source
                    && let Some(raw) = raw_number(text, segments)
                    && raw
                        .split(['e', 'E'])
                        .next()
                        .is_some_and(|m| m.bytes().any(|b| (b'1'..=b'9').contains(&b)))
                {
                    return Err(unfit(format!(
                        "the number {} is too small for a float8 (below the smallest double, \
                         about 4.9e-324; PostgreSQL refuses it as out of range): map it as \
                         numeric to keep it",
                        clip(&raw)
                    )));
                }
                check_range(c, n, &n.to_string())?;
                Cell::Float8(n)
            }
            ColType::Numeric => {
                let digits = match &value {
                    Value::Number(_) => match &c.source {
                        // The number as written: the parsed value would have lost digits.
                        Source::Path { segments, .. } => {
                            raw_number(text, segments).unwrap_or_else(|| value.to_string())
                        }
                        _ => value.to_string(),
                    },
                    Value::String(s) if is_decimal(s) => s.clone(),
                    Value::String(s) => {
                        return Err(unfit(format!(
                            "expected a number or a string holding a decimal, found {:?}",
                            clip(s)
                        )));
                    }
                    other => return Err(wrong(other)),
                };
                if !numeric_fits(&digits) {
                    return Err(unfit(format!(
                        "{} is beyond PostgreSQL's numeric (at most 131072 digits before the \
                         point and 16383 after)",
                        clip(&digits)
                    )));
                }
                let approx: f64 = digits.parse().unwrap_or(f64::NAN);
                check_range(c, approx, &digits)?;
                Cell::Numeric(digits)
            }
            ColType::Bool => match value {
                Value::Bool(b) => Cell::Bool(b),
                other => return Err(wrong(&other)),
            },
            ColType::Timestamptz => match &value {
                Value::String(s) => {
                    times::timestamptz(s)?;
                    Cell::Timestamptz(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Date => match &value {
                Value::String(s) => {
                    times::date(s)?;
                    Cell::Date(s.clone())
                }
                other => return Err(wrong(other)),
            },
            ColType::Jsonb => {
                if contains_nul(&value) {
                    return Err(unfit(
                        "holds U+0000, which PostgreSQL's jsonb cannot store".into(),
                    ));
                }
                // The JSON as written (jsonb keeps a number's digits; a parsed float would not).
                let raw = match &c.source {
                    Source::Path { segments, .. } => raw_json(text, segments),
                    _ => None,
                };
                let json = raw.unwrap_or_else(|| value.to_string());
                if let Some(n) = strict::number_beyond_numeric(&json) {
                    return Err(unfit(format!(
                        "holds the number {}, beyond what PostgreSQL's jsonb stores (a numeric: \
                         at most 131072 digits before the point and 16383 after)",
                        clip(n)
                    )));
                }
                Cell::Jsonb(json)
            }
        };
        if let Some(one_of) = &c.one_of
            && !one_of.cells.contains(&cell)
        {
            return Err(CheckError::NotOneOf {
                allowed: one_of.shown.clone(),
                found: shown_cell(&cell),
            }
            .into());
        }
        Ok(cell)
    }
}

/// A cell of a `one_of` column as a reason shows it (`EUR`, `7`).
pub(super) fn shown_cell(cell: &Cell) -> String {
    match cell {
        Cell::Text(s) => values::shown(s),
        Cell::Uuid(u) => u.to_string(),
        Cell::Int4(n) => n.to_string(),
        Cell::Int8(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// The value of property `p` of a delivered message, as JSON (absent: `None`); the exchange
/// and routing key are where the original was published (`headers::origin`), the timestamp an
/// RFC 3339 time of its seconds. A text property holding U+FFFD is refused: the AMQP parser
/// reads bytes that are not UTF-8 as U+FFFD, so distinct message ids (`id-\xff`, `id-\xfe`)
/// read alike, and a key of them took the second for a copy of the first, acked unstored
/// (review R36f F8).
fn property(p: Property, e: &Envelope<'_>) -> Result<Option<Value>, ValueError> {
    let checked = |s: &str| {
        if s.contains('\u{fffd}') {
            return Err(unfit(
                "holds U+FFFD, which is how bytes that are not UTF-8 are read: warren cannot \
                 tell this value from others as text"
                    .into(),
            ));
        }
        Ok(Value::String(s.to_string()))
    };
    let text =
        |s: &Option<lapin::types::ShortString>| s.as_ref().map(|s| checked(s.as_str())).transpose();
    let props = e.properties;
    Ok(match p {
        Property::MessageId => text(props.message_id())?,
        Property::CorrelationId => text(props.correlation_id())?,
        Property::Type => text(props.kind())?,
        Property::AppId => text(props.app_id())?,
        Property::ContentType => text(props.content_type())?,
        Property::Exchange | Property::RoutingKey => {
            let (ex, rk) = crate::amqp::headers::origin(props, e.exchange, e.routing_key);
            let v = if p == Property::Exchange { ex } else { rk };
            Some(checked(&v)?)
        }
        Property::Timestamp => match *props.timestamp() {
            None => None,
            Some(t) => Some(Value::String(times::of_unix_seconds(t)?)),
        },
    })
}

/// A value the column's type cannot take, in these words.
fn unfit(words: String) -> ValueError {
    ValueError::Unfit(words)
}
