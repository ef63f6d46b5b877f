//! A text column's `pattern`: the regular expressions warren checks offline exactly as
//! PostgreSQL's `~` answers them (the database is the oracle of value questions; tests/mapping.rs
//! holds generated patterns and strings to its answers). The check runs on the `regex` crate (in
//! the tree already, through refinery), whose syntax is parsed first with `regex-syntax` and held
//! to a subset on which the two engines agree; anything else is refused when the configuration
//! loads, naming what to write instead. The subset:
//! - characters as themselves, and `\` before punctuation for the character itself (`\.`, `\-`);
//! - `.` (any character, a line feed included: PostgreSQL's default), `^` and `$` (the start and
//!   the end of the whole text);
//! - `|`, groups `(...)` and `(?:...)`;
//! - `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` with m, n at most 255 (PostgreSQL's limit), greedy or
//!   not (`*?`: the same answer to "does it match");
//! - bracket expressions of characters and ranges, by code point (`[A-Za-z0-9_-]`, `[^,]`).
//!
//! Refused: `\d`, `\w`, `\s`, `\b` and the POSIX classes `[[:alpha:]]` (Unicode in one engine,
//! the database's locale in the other), Unicode classes `\p{..}`, escapes of letters or digits
//! (`\n`, `\x41`, back-references), flags `(?i)`, named groups, nested or combined classes
//! (`[a-z&&[^x]]`), a quantifier on nothing or on a quantifier, and unescaped `]` or `}`
//! outside a bracket expression.

use regex_syntax::ast::{
    self, Ast, ClassSet, ClassSetItem, GroupKind, LiteralKind, RepetitionKind, RepetitionRange,
};

/// The longest pattern taken, in bytes.
pub const PATTERN_MAX: usize = 1000;
/// PostgreSQL's largest bound of a `{m,n}` (`DUPMAX`).
const BOUND_MAX: u32 = 255;
/// The most a pattern may compile to, in bytes (the `regex` crate's `size_limit`; its default is
/// 10 MiB): a counted repetition inside another multiplies, and `^([a-z]{1,255}){1,255}$`
/// compiled under the default to a matcher that took 165 s on a value of 3,000 letters, on the
/// processor's thread, which froze the whole process (review R35g F7). Every pattern of the
/// docs and the tests compiles to a few KiB.
pub const PATTERN_COMPILED_MAX: usize = 1 << 20;

/// Why a `pattern` is refused when the configuration loads (its words are the reason shown
/// after `pattern: `).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum PatternError {
    /// Longer than [`PATTERN_MAX`] bytes (`found`: its length).
    #[error("at most {PATTERN_MAX} bytes, found {found}")]
    TooLong { found: usize },
    /// Not a regular expression at all (`problem`: the parser's words).
    #[error("{written:?} is not a regular expression: {problem}")]
    NotRegex { written: String, problem: String },
    /// A regular expression, with a construct outside the subset both engines read alike.
    #[error(
        "{written:?}: {construct} is not in the dialect warren checks as PostgreSQL's ~ does \
         (characters, \\ before punctuation, ., ^, $, |, (...), (?:...), * + ? {{m,n}} \
         up to 255, and [...] of characters and ranges; docs/pipelines.md)"
    )]
    Outside {
        written: String,
        construct: Construct,
    },
    /// In the subset, yet refused by the matcher (`problem`: its words; a size limit).
    #[error("{written:?}: {problem}")]
    Engine { written: String, problem: String },
}

/// The first construct of a pattern outside the subset, as a reason names it (`the class \d`,
/// `the bound {256} (write {m}, ...)`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(super) struct Construct(String);

/// A [`Construct`] in the words `format!` makes of its arguments.
macro_rules! construct {
    ($($words:tt)*) => {
        Construct(format!($($words)*))
    };
}

/// A compiled `pattern`: the text as written (for reasons) and its matcher.
#[derive(Debug, Clone)]
pub(super) struct Pattern {
    pub(super) source: String,
    regex: regex::Regex,
}

impl Pattern {
    /// Compiles `source`, or says why it is not in the dialect both engines read alike.
    pub(super) fn compile(source: &str) -> Result<Self, PatternError> {
        if source.len() > PATTERN_MAX {
            return Err(PatternError::TooLong {
                found: source.len(),
            });
        }
        let parsed =
            ast::parse::Parser::new()
                .parse(source)
                .map_err(|e| PatternError::NotRegex {
                    written: source.to_string(),
                    problem: e.kind().to_string(),
                })?;
        check(&parsed, source).map_err(|construct| PatternError::Outside {
            written: source.to_string(),
            construct,
        })?;
        let regex = regex::RegexBuilder::new(source)
            .dot_matches_new_line(true)
            .size_limit(PATTERN_COMPILED_MAX)
            .build()
            .map_err(|e| PatternError::Engine {
                written: source.to_string(),
                problem: match e {
                    regex::Error::CompiledTooBig(_) => format!(
                        "compiles to more than {} KiB, and its matching would cost seconds a                          value: a counted repetition inside another multiplies (write + or *                          for the outer one, or smaller bounds)",
                        PATTERN_COMPILED_MAX >> 10
                    ),
                    e => e.to_string(),
                },
            })?;
        Ok(Self {
            source: source.to_string(),
            regex,
        })
    }

    /// Whether `text` holds a match (PostgreSQL's `text ~ pattern`).
    pub(super) fn matches(&self, text: &str) -> bool {
        self.regex.is_match(text)
    }
}

/// `Err` names the first construct of `ast` outside the subset (`source` is the pattern).
fn check(ast: &Ast, source: &str) -> Result<(), Construct> {
    let text = |span: &ast::Span| source[span.start.offset..span.end.offset].to_string();
    match ast {
        Ast::Empty(_) | Ast::Dot(_) => Ok(()),
        Ast::Literal(l) => literal(l, false, source),
        Ast::Assertion(a) => match a.kind {
            ast::AssertionKind::StartLine | ast::AssertionKind::EndLine => Ok(()),
            _ => Err(construct!("the assertion {}", text(&a.span))),
        },
        Ast::Flags(f) => Err(construct!("the flags {}", text(&f.span))),
        Ast::ClassUnicode(c) => Err(construct!("the Unicode class {}", text(&c.span))),
        Ast::ClassPerl(c) => Err(construct!(
            "the class {} (write a bracket expression: [0-9], [A-Za-z0-9_], or the characters \
             meant)",
            text(&c.span)
        )),
        Ast::ClassBracketed(c) => bracketed(c, source),
        Ast::Repetition(r) => {
            if matches!(
                *r.ast,
                Ast::Empty(_) | Ast::Assertion(_) | Ast::Repetition(_) | Ast::Flags(_)
            ) {
                return Err(construct!(
                    "the quantifier {} on no character",
                    text(&r.op.span)
                ));
            }
            if let RepetitionKind::Range(range) = &r.op.kind {
                let (m, n) = match *range {
                    RepetitionRange::Exactly(m) => (m, m),
                    RepetitionRange::AtLeast(m) => (m, m),
                    RepetitionRange::Bounded(m, n) => (m, n),
                };
                if m.max(n) > BOUND_MAX {
                    return Err(construct!(
                        "the bound {} (write {{m}}, {{m,}} or {{m,n}}, at most {BOUND_MAX})",
                        text(&r.op.span)
                    ));
                }
            }
            check(&r.ast, source)
        }
        Ast::Group(g) => match &g.kind {
            GroupKind::CaptureIndex(_) => check(&g.ast, source),
            GroupKind::NonCapturing(flags) if flags.items.is_empty() => check(&g.ast, source),
            GroupKind::NonCapturing(flags) => Err(construct!("the flags {}", text(&flags.span))),
            GroupKind::CaptureName { name, .. } => {
                Err(construct!("the named group {}", text(&name.span)))
            }
        },
        Ast::Alternation(a) => a.asts.iter().try_for_each(|x| check(x, source)),
        Ast::Concat(c) => c.asts.iter().try_for_each(|x| check(x, source)),
    }
}

/// A character as itself: verbatim (not `]` or `}` outside a bracket expression, which one
/// engine reads as themselves and the other may not) or `\` and a punctuation character.
fn literal(l: &ast::Literal, in_brackets: bool, source: &str) -> Result<(), Construct> {
    let written = &source[l.span.start.offset..l.span.end.offset];
    match l.kind {
        LiteralKind::Verbatim if !in_brackets && matches!(l.c, ']' | '}') => {
            Err(construct!("the unescaped {written} (write \\{written})"))
        }
        LiteralKind::Verbatim => Ok(()),
        LiteralKind::Meta | LiteralKind::Superfluous if l.c.is_ascii_punctuation() => Ok(()),
        _ => Err(construct!("the escape {written}")),
    }
}

/// A bracket expression of characters and ranges, negated or not.
fn bracketed(c: &ast::ClassBracketed, source: &str) -> Result<(), Construct> {
    let text = |span: &ast::Span| source[span.start.offset..span.end.offset].to_string();
    let item = |i: &ClassSetItem| -> Result<(), Construct> {
        match i {
            ClassSetItem::Empty(_) => Ok(()),
            ClassSetItem::Literal(l) => literal(l, true, source),
            ClassSetItem::Range(r) => {
                literal(&r.start, true, source)?;
                literal(&r.end, true, source)
            }
            ClassSetItem::Ascii(a) => Err(construct!(
                "the class {} (its letters are the database's locale's; write the ranges)",
                text(&a.span)
            )),
            ClassSetItem::Unicode(u) => Err(construct!("the Unicode class {}", text(&u.span))),
            ClassSetItem::Perl(p) => Err(construct!(
                "the class {} (write its ranges: 0-9, A-Za-z0-9_)",
                text(&p.span)
            )),
            ClassSetItem::Bracketed(b) => Err(construct!("the nested class {}", text(&b.span))),
            ClassSetItem::Union(_) => Err(construct!("the class {}", text(&c.span))),
        }
    };
    match &c.kind {
        ClassSet::Item(ClassSetItem::Union(u)) => u.items.iter().try_for_each(item),
        ClassSet::Item(i) => item(i),
        ClassSet::BinaryOp(op) => Err(construct!("the class operation {}", text(&op.span))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subset_compiles_and_matches_as_postgresql_reads_it() {
        let p = Pattern::compile("^[A-Z]{3}$").unwrap();
        assert!(p.matches("EUR"));
        assert!(!p.matches("EURO") && !p.matches("eur") && !p.matches("EU\n"));
        // `.` takes a line feed, as PostgreSQL's does; `$` is the end of the whole text.
        assert!(Pattern::compile("^a.b$").unwrap().matches("a\nb"));
        assert!(!Pattern::compile("^a$").unwrap().matches("a\n"));
        assert!(Pattern::compile("[^,]\\.x?").unwrap().matches("é."));
        for good in [
            "",
            "a|b",
            "(ab)+",
            "(?:x){2,5}?",
            "[-a-z_]",
            "[\\]]",
            "\\-\\/",
            "a{255}",
        ] {
            Pattern::compile(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
    }

    /// Review R35g F7: a counted repetition inside another compiled (under the crate's 10 MiB
    /// default) to a matcher that took minutes on one value and froze the process; refused at
    /// load now, saying what to write. Realistic bounded patterns still compile.
    #[test]
    fn a_pattern_whose_matcher_would_be_huge_is_refused_saying_what_to_write() {
        for huge in [
            "^([a-z]{1,255}){1,255}$",
            "^[a-z]{1,255}(,[a-z]{1,255}){0,255}$",
        ] {
            let e = Pattern::compile(huge).expect_err(huge).to_string();
            assert!(
                e.contains("compiles to more than 1024 KiB") && e.contains("write + or *"),
                "{huge}: {e}"
            );
        }
        for fine in [
            "^[a-z]{1,255}$",
            "^[a-z0-9._-]{1,64}@[a-z0-9.-]{1,255}$",
            "^(a|b|c){0,255}x{0,255}$",
            "^[a-z]{1,255}(,[a-z]{1,255})*$",
        ] {
            let p = Pattern::compile(fine).unwrap_or_else(|e| panic!("{fine}: {e}"));
            let begun = std::time::Instant::now();
            p.matches(&"a".repeat(3000));
            assert!(
                begun.elapsed() < std::time::Duration::from_secs(1),
                "{fine}"
            );
        }
    }

    #[test]
    fn what_the_engines_read_apart_is_refused_naming_it() {
        for (bad, named) in [
            ("\\d+", "the class \\d"),
            ("[[:alpha:]]", "the class [:alpha:]"),
            ("(?i)abc", "the flags (?i)"),
            ("\\bword", "the assertion \\b"),
            ("\\n", "the escape \\n"),
            ("(a)\\1", "backreferences are not supported"),
            ("(?P<x>a)", "the named group x"),
            ("[a-z&&[^x]]", "the class operation"),
            ("a{256}", "the bound {256}"),
            ("a{,3}", "repetition quantifier expects a valid decimal"),
            ("a]", "the unescaped ]"),
            ("\\p{L}", "the Unicode class"),
        ] {
            let err = Pattern::compile(bad).unwrap_err().to_string();
            assert!(err.contains(named), "{bad:?}: {err}");
        }
        let err = Pattern::compile("(").unwrap_err().to_string();
        assert!(err.contains("is not a regular expression"), "{err}");
    }
}
