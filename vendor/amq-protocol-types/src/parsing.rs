use crate::{flags::*, types::*, value::*};
use nom::{
    self, Parser,
    bytes::streaming::take,
    combinator::{all_consuming, complete, flat_map, map, map_opt, map_parser, map_res},
    error::{ContextError, ErrorKind, ParseError, context},
    multi::fold_many0,
    number::streaming::{
        be_f32, be_f64, be_i16, be_i32, be_i64, be_u16, be_u32, be_u64, i8 as be_i8, u8 as be_u8,
    },
    sequence::pair,
};
use std::{error, fmt};
use traits::*;

/// Error context for `ParserErrors`
#[derive(Clone, Debug, Eq, PartialEq)]
enum VerboseErrorKind {
    /// Static string added by the `context` function
    Context(&'static str),
    /// Indicates which character was expected by the `char` function
    Char(char),
    /// Error kind given by various nom parsers
    Nom(ErrorKind),
}

/// Struct holding the errors stack
#[derive(Clone, Debug, PartialEq)]
pub struct ParserErrors {
    error: VerboseErrorKind,
    errors: Option<Vec<VerboseErrorKind>>,
}

impl ParserErrors {
    #[cfg(not(feature = "verbose-errors"))]
    fn init_errors() -> Option<Vec<VerboseErrorKind>> {
        None
    }
    #[cfg(feature = "verbose-errors")]
    fn init_errors() -> Option<Vec<VerboseErrorKind>> {
        Some(Vec::new())
    }
}

impl<I> ParseError<I> for ParserErrors {
    fn from_error_kind(_input: I, kind: ErrorKind) -> Self {
        Self {
            error: VerboseErrorKind::Nom(kind),
            errors: Self::init_errors(),
        }
    }

    fn append(_input: I, kind: ErrorKind, mut other: Self) -> Self {
        if let Some(errors) = other.errors.as_mut() {
            errors.push(VerboseErrorKind::Nom(kind));
        }
        other
    }

    fn from_char(_input: I, c: char) -> Self {
        Self {
            error: VerboseErrorKind::Char(c),
            errors: Self::init_errors(),
        }
    }
}

impl<I> ContextError<I> for ParserErrors {
    fn add_context(_input: I, ctx: &'static str, mut other: Self) -> Self {
        if let Some(errors) = other.errors.as_mut() {
            errors.push(VerboseErrorKind::Context(ctx));
        }
        other
    }
}

impl<I, E> nom::error::FromExternalError<I, E> for ParserErrors {
    fn from_external_error(input: I, kind: ErrorKind, _e: E) -> Self {
        Self::from_error_kind(input, kind)
    }
}

impl fmt::Display for ParserErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Parser error: {:?}", self.error)?;
        if let Some(errors) = self.errors.as_ref() {
            for error in errors {
                writeln!(f)?;
                write!(f, "\tat {error:?}")?;
            }
        }
        Ok(())
    }
}

impl error::Error for ParserErrors {}

/// Error returned by parsers
pub type ParserError = nom::Err<ParserErrors>;
/// Return type of parsers
pub type ParserResult<I, T> = Result<(I, T), ParserError>;

/// Parse the [AMQPValue](../type.AMQPValue.html) of the given [AMQPType](../type.AMQPType.html)
#[must_use]
pub fn parse_raw_value<I: ParsableInput>(
    amqp_type: AMQPType,
) -> impl Parser<I, Output = AMQPValue, Error = ParserErrors> {
    context("parse_raw_value", move |i: I| {
        charge(&i, VALUE_BYTES)?;
        parse_counted_value(amqp_type, i)
    })
}

/// [`parse_raw_value`] once the value was counted against the table's [`Budget`].
fn parse_counted_value<I: ParsableInput>(amqp_type: AMQPType, i: I) -> ParserResult<I, AMQPValue> {
    match amqp_type {
        AMQPType::Boolean => map(parse_boolean, AMQPValue::Boolean).parse(i),
        AMQPType::ShortShortInt => map(parse_short_short_int, AMQPValue::ShortShortInt).parse(i),
        AMQPType::ShortShortUInt => map(parse_short_short_uint, AMQPValue::ShortShortUInt).parse(i),
        AMQPType::ShortInt => map(parse_short_int, AMQPValue::ShortInt).parse(i),
        AMQPType::ShortUInt => map(parse_short_uint, AMQPValue::ShortUInt).parse(i),
        AMQPType::LongInt => map(parse_long_int, AMQPValue::LongInt).parse(i),
        AMQPType::LongUInt => map(parse_long_uint, AMQPValue::LongUInt).parse(i),
        AMQPType::LongLongInt => map(parse_long_long_int, AMQPValue::LongLongInt).parse(i),
        /* RabbitMQ treats LongLongUInt as a LongLongInt hence expose it as such */
        AMQPType::LongLongUInt => map(parse_long_long_int, AMQPValue::LongLongInt).parse(i),
        AMQPType::Float => map(parse_float, AMQPValue::Float).parse(i),
        AMQPType::Double => map(parse_double, AMQPValue::Double).parse(i),
        AMQPType::DecimalValue => map(parse_decimal_value, AMQPValue::DecimalValue).parse(i),
        AMQPType::ShortString => map(parse_short_string, AMQPValue::ShortString).parse(i),
        AMQPType::LongString => map(parse_long_string, AMQPValue::LongString).parse(i),
        AMQPType::FieldArray => match Nesting::enter() {
            Some(level) => Budget::or_raw(i, level, map(parse_field_array, AMQPValue::FieldArray)),
            None => map(parse_byte_array, AMQPValue::ByteArray).parse(i),
        },
        AMQPType::Timestamp => map(parse_timestamp, AMQPValue::Timestamp).parse(i),
        AMQPType::FieldTable => match Nesting::enter() {
            Some(level) => Budget::or_raw(i, level, |i: I| {
                // A table with an entry allocates a whole B-tree node (11 slots).
                let (_, len) = be_u32(i.clone())?;
                if len > 0 {
                    charge(&i, NODE_BYTES)?;
                }
                map(parse_field_table, AMQPValue::FieldTable).parse(i)
            }),
            None => map(parse_byte_array, AMQPValue::ByteArray).parse(i),
        },
        AMQPType::ByteArray => map(parse_byte_array, AMQPValue::ByteArray).parse(i),
        AMQPType::Void => Ok((i, AMQPValue::Void)),
    }
}

/// warren patch (see WARREN-PATCH.md): what the values of one top-level field table (a message's
/// headers, a method's arguments) may take in memory once parsed, at any depth, beyond their
/// own bytes. A parsed value takes 32 bytes however few it had on the wire (a void: one), a
/// table entry about 100 more with its key, a table with any entry a B-tree node of some 640:
/// a content header of 128 KiB parsed into up to 4 MiB (an array of voids) or 12 MiB (an array
/// of one-entry tables), and a prefetch window of such messages into gigabytes. Past the budget,
/// a nested table or array is kept as the raw bytes of its content (a byte array), and the rest
/// of the top-level table as one byte array entry, [`UNPARSED_KEY`]: parsed, a table takes at
/// most about its wire size and this budget more.
pub const MAX_PARSED_BYTES: usize = 128 * 1024;

/// What a parsed value takes (an `AMQPValue`), charged for every value.
const VALUE_BYTES: usize = 32;
/// What an array element takes beyond its value: the vector's spare capacity, at most as much.
const ELEMENT_BYTES: usize = 32;
/// What a table entry takes beyond its value and its key's bytes: the key, its allocation and
/// the B-tree slot's share of a half-full node.
const ENTRY_BYTES: usize = 96;
/// A B-tree node, allocated by a table's first entry.
const NODE_BYTES: usize = 640;

/// Charges `bytes` to the budget of the table being parsed: a recoverable error (and the budget
/// marked spent) when they are not left.
fn charge<I>(i: &I, bytes: usize) -> Result<(), nom::Err<ParserErrors>>
where
    I: Clone,
{
    if Budget::take(bytes) {
        Ok(())
    } else {
        Err(nom::Err::Error(ParserErrors::from_error_kind(
            i.clone(),
            ErrorKind::TooLarge,
        )))
    }
}

/// warren patch: the key of the entry that keeps, as raw bytes (the entries' encoding, one after
/// the other), the rest of a top-level table past [`MAX_PARSED_BYTES`] ([`unparsed_entries`]).
pub const UNPARSED_KEY: &str = "x-unparsed-entries";

/// warren patch: the value under [`UNPARSED_KEY`] that holds `raw`, the rest of a top-level table
/// as it came on the wire: an array of a short string (the key's name) and the bytes. No wire
/// value has this form (no type octet is read as a short string: RabbitMQ's `s` is a short
/// int), so a publisher's own entry of that name is never taken for the rest; and generated
/// (`gen_field_table`), the bytes are written back as the entries they are, after the others,
/// so a copy of the table carries them as the original did (they were carried as one byte
/// array entry, in which nobody found them again: reviews R36e F1 and R36f F3 of warren).
#[must_use]
pub fn unparsed_entries(raw: Vec<u8>) -> AMQPValue {
    AMQPValue::FieldArray(
        vec![
            AMQPValue::ShortString(UNPARSED_KEY.into()),
            AMQPValue::ByteArray(raw.into()),
        ]
        .into(),
    )
}

/// warren patch: the raw entries `value` holds when it is the rest of a table
/// ([`unparsed_entries`]).
#[must_use]
pub fn as_unparsed_entries(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::FieldArray(a) => match a.as_slice() {
            [AMQPValue::ShortString(name), AMQPValue::ByteArray(raw)]
                if name.as_str() == UNPARSED_KEY =>
            {
                Some(raw.as_slice())
            }
            _ => None,
        },
        _ => None,
    }
}

thread_local! {
    /// Bytes the top-level table being parsed may still take; `None` outside one.
    static BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// Set when a charge found the budget spent: the parse that fails with it is kept raw.
    static SPENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The value budget of the top-level table being parsed on this thread; dropping it ends it.
struct Budget;

impl Budget {
    /// Starts the budget of a top-level table, or `None` inside one.
    fn top_level() -> Option<Self> {
        BUDGET.with(|b| {
            b.get().is_none().then(|| {
                b.set(Some(MAX_PARSED_BYTES));
                SPENT.with(|s| s.set(false));
                Budget
            })
        })
    }

    /// Takes `bytes`; `false` (and spent) when they are not left. Outside a table: `true`.
    fn take(bytes: usize) -> bool {
        BUDGET.with(|b| match b.get() {
            None => true,
            Some(n) if n < bytes => {
                SPENT.with(|s| s.set(true));
                false
            }
            Some(n) => {
                b.set(Some(n - bytes));
                true
            }
        })
    }

    /// Whether the last failure came from a spent budget (and forgets it).
    fn spent() -> bool {
        SPENT.with(|s| s.replace(false))
    }

    /// Parses a nested table or array with `parser`; when the budget runs out inside it, keeps
    /// it whole as the raw bytes of its content, and what its partial parse took is given back.
    /// A container kept raw this way needed more than was left, so the work thrown away is
    /// bounded by its own size on the wire.
    fn or_raw<I: ParsableInput>(
        i: I,
        level: Nesting,
        mut parser: impl Parser<I, Output = AMQPValue, Error = ParserErrors>,
    ) -> ParserResult<I, AMQPValue> {
        let left = BUDGET.with(|b| b.get());
        match parser.parse(i.clone()) {
            Err(nom::Err::Error(_)) if Budget::spent() => {
                drop(level);
                BUDGET.with(|b| b.set(left));
                map(parse_byte_array, AMQPValue::ByteArray).parse(i)
            }
            other => other,
        }
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        BUDGET.with(|b| b.set(None));
        SPENT.with(|s| s.set(false));
    }
}

/// warren patch (see WARREN-PATCH.md): tables and arrays nested deeper than this are not parsed
/// further: such a value is kept as the raw bytes of its content (a byte array). The broker
/// accepts any depth; parsing, cloning, comparing, encoding and dropping a nested value all
/// recurse, and a header nested some thousands of levels deep overflowed the stack of the thread
/// that handled it (lapin's I/O thread: the whole process aborted).
pub const MAX_NESTING: usize = 64;

thread_local! {
    static NESTING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One level of table or array nesting being parsed on this thread; leaving it (drop) pops it.
struct Nesting;

impl Nesting {
    /// Enters one more level, or `None` at [`MAX_NESTING`].
    fn enter() -> Option<Self> {
        NESTING.with(|n| {
            let depth = n.get();
            (depth < MAX_NESTING).then(|| {
                n.set(depth + 1);
                Nesting
            })
        })
    }
}

impl Drop for Nesting {
    fn drop(&mut self) {
        NESTING.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// Parse an [AMQPValue](../type.AMQPValue.html)
pub fn parse_value<I: ParsableInput>(i: I) -> ParserResult<I, AMQPValue> {
    context("parse_value", flat_map(parse_type, parse_raw_value)).parse(i)
}

/// Parse an [AMQPType](../type.AMQPType.html)
pub fn parse_type<I: ParsableInput>(i: I) -> ParserResult<I, AMQPType> {
    context(
        "parse_type",
        map_opt(be_u8, |t| AMQPType::from_id(t as char)),
    )
    .parse(i)
}

/// Parse an id [(ShortUInt)](../type.ShortUInt.html)
pub fn parse_id<I: ParsableInput>(i: I) -> ParserResult<I, ShortUInt> {
    context("parse_id", parse_short_uint).parse(i)
}

/// Parse a [Boolean](../type.Boolean.html)
pub fn parse_boolean<I: ParsableInput>(i: I) -> ParserResult<I, Boolean> {
    context("parse_boolean", map(be_u8, |b| b != 0)).parse(i)
}

/// Parse a [ShortShortInt](../type.ShortShortInt.html)
pub fn parse_short_short_int<I: ParsableInput>(i: I) -> ParserResult<I, ShortShortInt> {
    context("parse_short_short_int", be_i8).parse(i)
}

/// Parse a [ShortShortUInt](../type.ShortShortUInt.html)
pub fn parse_short_short_uint<I: ParsableInput>(i: I) -> ParserResult<I, ShortShortUInt> {
    context("parse_short_short_uint", be_u8).parse(i)
}

/// Parse a [ShortInt](../type.ShortInt.html)
pub fn parse_short_int<I: ParsableInput>(i: I) -> ParserResult<I, ShortInt> {
    context("parse_short_int", be_i16).parse(i)
}

/// Parse a [ShortUInt](../type.ShortUInt.html)
pub fn parse_short_uint<I: ParsableInput>(i: I) -> ParserResult<I, ShortUInt> {
    context("parse_short_uint", be_u16).parse(i)
}

/// Parse a [LongInt](../type.LongInt.html)
pub fn parse_long_int<I: ParsableInput>(i: I) -> ParserResult<I, LongInt> {
    context("parse_long_int", be_i32).parse(i)
}

/// Parse a [LongUInt](../type.LongUInt.html)
pub fn parse_long_uint<I: ParsableInput>(i: I) -> ParserResult<I, LongUInt> {
    context("parse_long_uint", be_u32).parse(i)
}

/// Parse a [LongLongInt](../type.LongLongInt.html)
pub fn parse_long_long_int<I: ParsableInput>(i: I) -> ParserResult<I, LongLongInt> {
    context("parse_long_long_int", be_i64).parse(i)
}

/// Parse a [LongLongUInt](../type.LongLongUInt.html)
pub fn parse_long_long_uint<I: ParsableInput>(i: I) -> ParserResult<I, LongLongUInt> {
    context("parse_long_long_uint", be_u64).parse(i)
}

/// Parse a [Float](../type.Float.html)
pub fn parse_float<I: ParsableInput>(i: I) -> ParserResult<I, Float> {
    context("parse_float", be_f32).parse(i)
}

/// Parse a [Double](../type.Double.html)
pub fn parse_double<I: ParsableInput>(i: I) -> ParserResult<I, Double> {
    context("parse_double", be_f64).parse(i)
}

/// Parse a [DecimalValue](../type.DecimalValue.html)
pub fn parse_decimal_value<I: ParsableInput>(i: I) -> ParserResult<I, DecimalValue> {
    context(
        "parse_decimal_value",
        map(
            pair(parse_short_short_uint, parse_long_uint),
            |(scale, value)| DecimalValue { scale, value },
        ),
    )
    .parse(i)
}

// warren patch (see WARREN-PATCH.md): a short string that is not valid UTF-8 (the broker
// accepts any bytes) is decoded lossily instead of failing the whole frame, which used to kill
// the connection and leave the message at the head of its queue forever. The result must stay a
// valid short string (at most 255 bytes, or `ShortString::from` panics): each invalid sequence
// becomes U+FFFD (3 bytes) when that fits, else `?` (1 byte), which never makes it longer.
fn make_str<I: Input<Item = u8>>(i: I) -> Result<String, std::string::FromUtf8Error> {
    let bytes: Vec<u8> = i.iter_elements().collect();
    Ok(match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => lossy_short(e.as_bytes()),
    })
}

/// `bytes` as text of at most [`MAX_SHORT_STRING_LENGTH`] bytes when `bytes` is no longer than
/// that: U+FFFD for each invalid sequence when the result fits, else `?`.
fn lossy_short(bytes: &[u8]) -> String {
    let lossy = String::from_utf8_lossy(bytes).into_owned();
    if lossy.len() <= MAX_SHORT_STRING_LENGTH || bytes.len() > MAX_SHORT_STRING_LENGTH {
        return lossy;
    }
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        if !chunk.invalid().is_empty() {
            out.push('?');
        }
    }
    out
}

/// Parse a [ShortString](../type.ShortString.html)
pub fn parse_short_string<I: ParsableInput>(i: I) -> ParserResult<I, ShortString> {
    context(
        "parse_short_string",
        map(
            map_res(flat_map(parse_short_short_uint, take), make_str),
            ShortString::from,
        ),
    )
    .parse(i)
}

/// Parse a [LongString](../type.LongString.html)
pub fn parse_long_string<I: ParsableInput>(i: I) -> ParserResult<I, LongString> {
    context(
        "parse_long_string",
        map(flat_map(parse_long_uint, take), |i: I| {
            i.iter_elements().collect::<Vec<u8>>().into()
        }),
    )
    .parse(i)
}

/// Parse a [FieldArray](../type.FieldArray.html)
pub fn parse_field_array<I: ParsableInput>(i: I) -> ParserResult<I, FieldArray> {
    context(
        "parse_field_array",
        map_parser(
            flat_map(parse_long_uint, take),
            all_consuming(fold_many0(
                context(
                    "parse_field_array_entry",
                    complete(|i: I| {
                        charge(&i, ELEMENT_BYTES)?;
                        parse_value(i)
                    }),
                ),
                FieldArray::default,
                |mut acc, elem| {
                    acc.push(elem);
                    acc
                },
            )),
        ),
    )
    .parse(i)
}

/// Parse a [Timestamp](../type.Timestamp.html)
pub fn parse_timestamp<I: ParsableInput>(i: I) -> ParserResult<I, Timestamp> {
    context("parse_timestamp", parse_long_long_uint).parse(i)
}

/// Parse a [FieldTable](../type.FieldTable.html)
pub fn parse_field_table<I: ParsableInput>(i: I) -> ParserResult<I, FieldTable> {
    match Budget::top_level() {
        Some(budget) => parse_top_level_table(i, budget),
        None => parse_nested_table(i),
    }
}

/// warren patch: a top-level table, what its values take charged to `_budget`; past it, the
/// rest of its entries are kept as one byte array entry, [`UNPARSED_KEY`].
fn parse_top_level_table<I: ParsableInput>(i: I, _budget: Budget) -> ParserResult<I, FieldTable> {
    context("parse_field_table", |i: I| {
        let (rest, mut input) = flat_map(parse_long_uint, take).parse(i)?;
        let mut table = FieldTable::default();
        if input.input_len() > 0 {
            charge(&input, NODE_BYTES)?;
        }
        while input.input_len() > 0 {
            match complete(parse_table_entry).parse(input.clone()) {
                // An entry of the wire under the key of the raw rest: kept raw from there, so
                // the key holds only the parser's rest (an entry the publisher named so is one
                // of the raw entries, as on the wire).
                Ok((_, (key, _))) if key.as_str() == UNPARSED_KEY => {
                    let raw: Vec<u8> = input.iter_elements().collect();
                    table.insert(UNPARSED_KEY.into(), unparsed_entries(raw));
                    break;
                }
                Ok((next, (key, value))) => {
                    table.insert(key, value);
                    input = next;
                }
                Err(nom::Err::Error(_)) if Budget::spent() => {
                    let raw: Vec<u8> = input.iter_elements().collect();
                    table.insert(UNPARSED_KEY.into(), unparsed_entries(raw));
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok((rest, table))
    })
    .parse(i)
}

/// One table entry, its key and slot charged to the budget first.
fn parse_table_entry<I: ParsableInput>(i: I) -> ParserResult<I, (ShortString, AMQPValue)> {
    let (_, key_len) = be_u8(i.clone())?;
    charge(&i, ENTRY_BYTES + usize::from(key_len))?;
    pair(parse_short_string, parse_value).parse(i)
}

/// A table inside another table or array, as upstream parses every table.
fn parse_nested_table<I: ParsableInput>(i: I) -> ParserResult<I, FieldTable> {
    context(
        "parse_field_table",
        map_parser(
            flat_map(parse_long_uint, take),
            all_consuming(fold_many0(
                context("parse_field_table_entry", complete(parse_table_entry)),
                FieldTable::default,
                |mut acc, (key, value)| {
                    acc.insert(key, value);
                    acc
                },
            )),
        ),
    )
    .parse(i)
}

/// Parse a [ByteArray](../type.ByteArray.html)
pub fn parse_byte_array<I: ParsableInput>(i: I) -> ParserResult<I, ByteArray> {
    context(
        "parse_byte_array",
        map(flat_map(parse_long_uint, take), |i: I| {
            i.iter_elements().collect::<Vec<u8>>().into()
        }),
    )
    .parse(i)
}

/// Parse the [AMQPFlags](../type.AMQPFlags.html) for which the names are provided
pub fn parse_flags<I: ParsableInput>(i: I, names: &[&str]) -> ParserResult<I, AMQPFlags> {
    context(
        "parse_flags",
        map(take(names.len().div_ceil(8)), |b| {
            AMQPFlags::from_bytes(names, b)
        }),
    )
    .parse(i)
}

/// Traits required for parsing
pub mod traits {
    /// Reexport nom traits required for parsing
    pub use nom::{Compare, CompareResult, Input, Needed};

    /// Trait used to ensure we can properly parse input
    pub trait ParsableInput: Clone + Compare<&'static [u8]> + Input<Item = u8> + PartialEq {}

    impl<T: Clone + Compare<&'static [u8]> + Input<Item = u8> + PartialEq> ParsableInput for T {}
}

#[cfg(test)]
mod test {
    use super::*;

    const EMPTY: &[u8] = b"";

    #[test]
    fn test_parse_value() {
        assert_eq!(
            parse_value(&[84, 42, 42, 42, 42, 42, 42, 42, 42][..]),
            Ok((EMPTY, AMQPValue::Timestamp(3038287259199220266)))
        );
        assert_eq!(
            parse_value(&[83, 0, 0, 0, 4, 116, 101, 115, 116][..]),
            Ok((EMPTY, AMQPValue::LongString("test".into())))
        );
    }

    #[test]
    fn test_parse_raw_value() {
        assert_eq!(
            parse_raw_value(AMQPType::Timestamp).parse(&[42, 42, 42, 42, 42, 42, 42, 42][..]),
            Ok((EMPTY, AMQPValue::Timestamp(3038287259199220266)))
        );
        assert_eq!(
            parse_raw_value(AMQPType::LongString).parse(&[0, 0, 0, 4, 116, 101, 115, 116][..]),
            Ok((EMPTY, AMQPValue::LongString("test".into())))
        );
        /* Test internal exceptions */
        assert_eq!(
            parse_raw_value(AMQPType::LongLongUInt).parse(&[42, 42, 42, 42, 42, 42, 42, 42][..]),
            Ok((EMPTY, AMQPValue::LongLongInt(3038287259199220266)))
        );
        assert_eq!(
            parse_raw_value(AMQPType::ShortString).parse(&[4, 116, 101, 115, 116][..]),
            Ok((EMPTY, AMQPValue::ShortString("test".into())))
        );
    }

    #[test]
    fn test_parse_type() {
        assert_eq!(parse_type(&[116][..]), Ok((EMPTY, AMQPType::Boolean)));
        assert_eq!(parse_type(&[102][..]), Ok((EMPTY, AMQPType::Float)));
    }

    #[test]
    fn test_parse_id() {
        assert_eq!(parse_id(&[0, 0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_id(&[255, 255][..]), Ok((EMPTY, 65535)));
    }

    #[test]
    fn test_parse_boolean() {
        assert_eq!(parse_boolean(&[0][..]), Ok((EMPTY, false)));
        assert_eq!(parse_boolean(&[1][..]), Ok((EMPTY, true)));
    }

    #[test]
    fn test_parse_short_short_int() {
        assert_eq!(parse_short_short_int(&[0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_short_short_int(&[255][..]), Ok((EMPTY, -1)));
    }

    #[test]
    fn test_parse_short_short_uint() {
        assert_eq!(parse_short_short_uint(&[0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_short_short_uint(&[255][..]), Ok((EMPTY, 255)));
    }

    #[test]
    fn test_parse_short_int() {
        assert_eq!(parse_short_int(&[0, 0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_short_int(&[255, 255][..]), Ok((EMPTY, -1)));
    }

    #[test]
    fn test_parse_short_uint() {
        assert_eq!(parse_short_uint(&[0, 0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_short_uint(&[255, 255][..]), Ok((EMPTY, 65535)));
    }

    #[test]
    fn test_parse_long_int() {
        assert_eq!(parse_long_int(&[0, 0, 0, 0][..]), Ok((EMPTY, 0)));
        assert_eq!(parse_long_int(&[255, 255, 255, 255][..]), Ok((EMPTY, -1)));
    }

    #[test]
    fn test_parse_long_uint() {
        assert_eq!(parse_long_uint(&[0, 0, 0, 0][..]), Ok((EMPTY, 0)));
        assert_eq!(
            parse_long_uint(&[255, 255, 255, 255][..]),
            Ok((EMPTY, 4294967295))
        );
    }

    #[test]
    fn test_parse_long_long_int() {
        assert_eq!(
            parse_long_long_int(&[0, 0, 0, 0, 0, 0, 0, 0][..]),
            Ok((EMPTY, 0))
        );
        assert_eq!(
            parse_long_long_int(&[255, 255, 255, 255, 255, 255, 255, 255][..]),
            Ok((EMPTY, -1))
        );
    }

    #[test]
    fn test_parse_long_long_uint() {
        assert_eq!(
            parse_long_long_uint(&[0, 0, 0, 0, 0, 0, 0, 0][..]),
            Ok((EMPTY, 0))
        );
        assert_eq!(
            parse_long_long_uint(&[255, 255, 255, 255, 255, 255, 255, 255][..]),
            Ok((EMPTY, 18446744073709551615))
        );
    }

    #[test]
    fn test_parse_float() {
        assert_eq!(parse_float(&[0, 0, 0, 0][..]), Ok((EMPTY, 0.)));
        assert_eq!(parse_float(&[66, 41, 174, 20][..]), Ok((EMPTY, 42.42)));
    }

    #[test]
    fn test_parse_double() {
        assert_eq!(parse_double(&[0, 0, 0, 0, 0, 0, 0, 0][..]), Ok((EMPTY, 0.)));
        assert_eq!(
            parse_double(&[64, 69, 53, 194, 143, 92, 40, 246][..]),
            Ok((EMPTY, 42.42))
        );
    }

    #[test]
    fn test_parse_decimal_value() {
        assert_eq!(
            parse_decimal_value(&[0, 0, 0, 0, 0][..]),
            Ok((EMPTY, DecimalValue { scale: 0, value: 0 }))
        );
        assert_eq!(
            parse_decimal_value(&[255, 255, 255, 255, 255][..]),
            Ok((
                EMPTY,
                DecimalValue {
                    scale: 255,
                    value: 4294967295
                }
            ))
        );
    }

    #[test]
    fn test_parse_short_string_lossy_never_exceeds_the_limit() {
        // warren patch: 255 invalid bytes would be 765 bytes of U+FFFD; they become '?'.
        let mut input = vec![255u8];
        input.extend(std::iter::repeat_n(0xffu8, 255));
        let (_, s) = parse_short_string(&input[..]).unwrap();
        assert_eq!(s.as_str(), "?".repeat(255));
        // 85 invalid bytes fit as U+FFFD (255 bytes); 86 do not.
        for n in [85usize, 86, 100, 200] {
            let mut input = vec![n as u8 + 1, b'a'];
            input.extend(std::iter::repeat_n(0xfeu8, n));
            let (_, s) = parse_short_string(&input[..]).unwrap();
            assert!(s.as_str().len() <= 255, "{n}: {}", s.as_str().len());
            assert!(s.as_str().starts_with('a'));
        }
    }

    #[test]
    fn test_deep_nesting_is_kept_as_bytes_beyond_the_limit() {
        // warren patch: a table nested 100,000 deep parses without recursing that deep.
        let depth = 100_000usize;
        // Innermost: an empty table; each level wraps the previous one as the value of key "k".
        let mut value: Vec<u8> = vec![b'F', 0, 0, 0, 0];
        for _ in 0..depth {
            let mut entry = vec![1u8, b'k'];
            entry.extend_from_slice(&value);
            let mut next = vec![b'F'];
            next.extend_from_slice(&(entry.len() as u32).to_be_bytes());
            next.extend_from_slice(&entry);
            value = next;
        }
        let (rest, parsed) = parse_value(&value[..]).unwrap();
        assert!(rest.is_empty());
        let mut levels = 0;
        let mut current = &parsed;
        while let AMQPValue::FieldTable(t) = current {
            levels += 1;
            current = t.inner().get("k").unwrap();
        }
        assert_eq!(levels, MAX_NESTING);
        assert!(matches!(current, AMQPValue::ByteArray(_)));
        // The counter is back at zero: the next value parses to the full depth again.
        let (_, again) = parse_value(&value[..]).unwrap();
        assert_eq!(again, parsed);
    }

    /// A field table's wire bytes (length prefix and content) from its entries' bytes.
    fn table(entries: &[Vec<u8>]) -> Vec<u8> {
        let content: Vec<u8> = entries.concat();
        let mut out = (content.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&content);
        out
    }

    /// One table entry: a short-string key and a value's bytes (type and payload).
    fn entry(key: &str, value: &[u8]) -> Vec<u8> {
        let mut out = vec![key.len() as u8];
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(value);
        out
    }

    #[test]
    fn test_a_table_past_the_value_budget_keeps_the_rest_raw() {
        // warren patch: an array of 5,000 voids (5,005 bytes on the wire, 160 KB parsed) is kept
        // as its raw content; the entries beside it are parsed.
        let mut voids = vec![b'A'];
        voids.extend_from_slice(&5000u32.to_be_bytes());
        voids.extend(std::iter::repeat_n(b'V', 5000));
        let wire = table(&[
            entry("a", &[b't', 1]),
            entry("big", &voids),
            entry("z", &[b'b', 7]),
        ]);
        let (rest, parsed) = parse_field_table(&wire[..]).unwrap();
        assert!(rest.is_empty());
        let inner = parsed.inner();
        assert_eq!(inner.get("a"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(inner.get("z"), Some(&AMQPValue::ShortShortInt(7)));
        match inner.get("big") {
            Some(AMQPValue::ByteArray(b)) => assert_eq!(b.as_slice(), &voids[5..]),
            other => panic!("{other:?}"),
        }

        // 2,000 top-level entries: what the budget holds parsed (each entry: 96 + its 5-byte
        // key + a 32-byte value), the rest kept as one entry of raw bytes.
        let entries: Vec<Vec<u8>> = (0..2000)
            .map(|n| entry(&format!("k{n:04}"), &[b't', 1]))
            .collect();
        let wire = table(&entries);
        let (_, parsed) = parse_field_table(&wire[..]).unwrap();
        let fit = (MAX_PARSED_BYTES - NODE_BYTES) / (ENTRY_BYTES + 5 + VALUE_BYTES);
        assert_eq!(parsed.inner().len(), fit + 1);
        match parsed.inner().get(UNPARSED_KEY).and_then(as_unparsed_entries) {
            Some(b) => assert_eq!(b, &entries[fit..].concat()[..]),
            other => panic!("{other:?}"),
        }
        // An array of 1,000 one-entry tables (9 bytes each on the wire, a B-tree node each
        // parsed) goes raw too.
        let one = table(&[entry("", b"V")]);
        let mut tables = vec![b'A'];
        let content: Vec<u8> = std::iter::repeat_n([&[b'F'][..], &one[..]].concat(), 1000)
            .flatten()
            .collect();
        tables.extend_from_slice(&(content.len() as u32).to_be_bytes());
        tables.extend_from_slice(&content);
        let (_, parsed) = parse_field_table(&table(&[entry("t", &tables)])[..]).unwrap();
        assert!(matches!(
            parsed.inner().get("t"),
            Some(AMQPValue::ByteArray(_))
        ));

        // A small nested table after a container kept raw still parses (what the raw one's
        // partial parse took was given back), and the next table has a budget of its own.
        let small = table(&[entry("x", &[b't', 0]), entry("y", &[b't', 1])]);
        let mut nested = vec![b'F'];
        nested.extend_from_slice(&small);
        let wire = table(&[entry("big", &voids), entry("small", &nested)]);
        let (_, parsed) = parse_field_table(&wire[..]).unwrap();
        assert!(matches!(
            parsed.inner().get("big"),
            Some(AMQPValue::ByteArray(_))
        ));
        match parsed.inner().get("small") {
            Some(AMQPValue::FieldTable(t)) => assert_eq!(t.inner().len(), 2),
            other => panic!("{other:?}"),
        }
        let wire = table(&entries[..fit]);
        let (_, parsed) = parse_field_table(&wire[..]).unwrap();
        assert_eq!(parsed.inner().len(), fit);
        assert!(parsed.inner().get(UNPARSED_KEY).is_none());

        // A malformed table is still an error, not raw bytes.
        let bad = table(&[entry("a", &[b'?', 1])]);
        assert!(parse_field_table(&bad[..]).is_err());
    }

    /// A table generated to bytes.
    fn generate(t: &FieldTable) -> Vec<u8> {
        let mut buf = vec![0u8; 1 << 20];
        let (_, len) = cookie_factory::r#gen(crate::generation::gen_field_table(t), &mut buf[..])
            .expect("generate");
        buf.truncate(len as usize);
        buf
    }

    /// warren patch: the raw rest is written back as the entries it holds, after the others, so
    /// a table generated from what was parsed is the table that came (its keys in order).
    #[test]
    fn test_a_table_kept_raw_past_the_budget_is_generated_as_it_came() {
        let entries: Vec<Vec<u8>> = (0..2000)
            .map(|n| entry(&format!("k{n:04}"), &[b'I', 0, 0, 0, n as u8]))
            .collect();
        let wire = table(&entries);
        let (_, parsed) = parse_field_table(&wire[..]).unwrap();
        assert!(parsed.inner().contains_key(UNPARSED_KEY));
        assert_eq!(generate(&parsed), wire);
    }

    /// warren patch: a publisher's own entry named as the raw rest is not taken for it (it was
    /// read as the parser's rest, its content as entries the message did not carry: review R36e
    /// F1 of warren): kept raw from there, as it came, and generated back as it came.
    #[test]
    fn test_an_entry_of_the_wire_named_as_the_raw_rest_is_kept_as_it_came() {
        let mut spoof = vec![b'x'];
        let fake = entry("tenant", &[b'S', 0, 0, 0, 1, b'z']);
        spoof.extend_from_slice(&(fake.len() as u32).to_be_bytes());
        spoof.extend_from_slice(&fake);
        let entries = [
            entry("a", &[b't', 1]),
            entry(UNPARSED_KEY, &spoof),
            entry("z", &[b'b', 7]),
        ];
        let wire = table(&entries);
        let (_, parsed) = parse_field_table(&wire[..]).unwrap();
        assert_eq!(parsed.inner().get("a"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(parsed.inner().get("tenant"), None);
        assert_eq!(parsed.inner().get("z"), None);
        assert_eq!(
            parsed.inner().get(UNPARSED_KEY).and_then(as_unparsed_entries),
            Some(&entries[1..].concat()[..])
        );
        assert_eq!(generate(&parsed), wire);
        // No value of the wire has the raw rest's form.
        let (_, value) = parse_value(&spoof[..]).unwrap();
        assert_eq!(as_unparsed_entries(&value), None);
    }

    #[test]
    fn test_parse_short_string_lossy() {
        // warren patch: invalid UTF-8 becomes U+FFFD instead of a parse error.
        assert_eq!(
            parse_short_string(&[3, b'a', 0xff, b'b'][..]),
            Ok((&[][..], ShortString::from("a\u{fffd}b")))
        );
    }

    #[test]
    fn test_parse_short_string() {
        assert_eq!(
            parse_short_string(&[0][..]),
            Ok((EMPTY, ShortString::default()))
        );
        assert_eq!(
            parse_short_string(&[4, 116, 101, 115, 116][..]),
            Ok((EMPTY, "test".into()))
        );
    }

    #[test]
    fn test_parse_long_string() {
        assert_eq!(
            parse_long_string(&[0, 0, 0, 0][..]),
            Ok((EMPTY, LongString::default()))
        );
        assert_eq!(
            parse_long_string(&[0, 0, 0, 4, 116, 101, 115, 116][..]),
            Ok((EMPTY, "test".into()))
        );
    }

    #[test]
    fn test_parse_field_array() {
        assert_eq!(
            parse_field_array(&[0, 0, 0, 0][..]),
            Ok((EMPTY, FieldArray::default()))
        );
        assert_eq!(
            parse_field_array(&[0, 0, 0, 10, 83, 0, 0, 0, 4, 116, 101, 115, 116, 86][..]),
            Ok((
                EMPTY,
                vec![AMQPValue::LongString("test".into()), AMQPValue::Void].into()
            ))
        );
    }

    #[test]
    fn test_parse_timestamp() {
        assert_eq!(
            parse_timestamp(&[0, 0, 0, 0, 0, 0, 0, 0][..]),
            Ok((EMPTY, 0))
        );
        assert_eq!(
            parse_timestamp(&[255, 255, 255, 255, 255, 255, 255, 255][..]),
            Ok((EMPTY, 18446744073709551615))
        );
    }

    #[test]
    fn test_parse_field_table() {
        let mut table = FieldTable::default();
        table.insert("test".into(), AMQPValue::LongString("test".into()));
        table.insert("tt".into(), AMQPValue::Void);
        assert_eq!(
            parse_field_table(&[0, 0, 0, 0][..]),
            Ok((EMPTY, FieldTable::default()))
        );
        assert_eq!(
            parse_field_table(
                &[
                    0, 0, 0, 18, 4, 116, 101, 115, 116, 83, 0, 0, 0, 4, 116, 101, 115, 116, 2, 116,
                    116, 86
                ][..]
            ),
            Ok((EMPTY, table))
        );
    }

    #[test]
    fn test_parse_byte_array() {
        assert_eq!(
            parse_byte_array(&[0, 0, 0, 0][..]),
            Ok((EMPTY, ByteArray::default()))
        );
        assert_eq!(
            parse_byte_array(&[0, 0, 0, 4, 42, 1, 2, 3][..]),
            Ok((EMPTY, vec![42, 1, 2, 3].into()))
        );
    }

    #[test]
    fn test_parse_flags() {
        let mut flags = AMQPFlags::default();
        let mut names = Vec::new();
        names.push("a");
        flags.add_flag("a".to_string(), true);
        names.push("b");
        flags.add_flag("b".to_string(), false);
        names.push("c");
        flags.add_flag("c".to_string(), true);
        names.push("d");
        flags.add_flag("d".to_string(), true);
        assert_eq!(
            parse_flags(&[0b00001101][..], &names),
            Ok((EMPTY, flags.clone()))
        );
        names.push("e");
        flags.add_flag("e".to_string(), true);
        names.push("f");
        flags.add_flag("f".to_string(), false);
        names.push("g");
        flags.add_flag("g".to_string(), true);
        names.push("h");
        flags.add_flag("h".to_string(), true);
        names.push("i");
        flags.add_flag("i".to_string(), false);
        names.push("j");
        flags.add_flag("j".to_string(), true);
        assert_eq!(
            parse_flags(&[0b11011101, 0b00000010][..], &names),
            Ok((EMPTY, flags))
        );
    }
}
