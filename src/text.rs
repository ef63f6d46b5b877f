//! Bounds on text that came from outside (a message's reason, id or header value, a server's
//! error message): [`capped`] cuts text to a number of bytes on a character boundary, and
//! [`shown`] is that cut wherever such text reaches an event, a log line or a stored error;
//! [`percent_decoded`] reads `%XX` escapes as the clients do (the API's path key, a URL's
//! parameter names when redacting); [`closest`] is the "did you mean" of every error that
//! names a choice; [`listed`] names the first few of a list in one line.
//! Neutral ground: the broker link, the database layer and the events all use it, and it
//! imports nothing of theirs.

use std::borrow::Cow;

/// Longest piece of outside text (a reason, a message id, a header value, a server's message)
/// written to an event or a log line, in bytes: the cap the parking table puts on a reason
/// (`db::dead_letters::REASON_MAX`, and `amqp::headers::REASON_MAX` on a header).
pub const SHOWN_MAX: usize = 1024;

/// `text` as an event or a log line shows it: capped at [`SHOWN_MAX`] bytes on a character
/// boundary, with `…` when cut. Everything of a message's content that reaches an event or a log
/// field goes through here, so neither grows with what a publisher sends.
pub fn shown(text: &str) -> Cow<'_, str> {
    capped(text, SHOWN_MAX)
}

/// How many items of a list one line names before it says how many more ([`listed`]).
pub const LISTED: usize = 5;

/// `items` for one line: the first [`LISTED`] joined with `, `, then ` and N more` when there
/// are more. A line that named every problem grew with the configuration (review R44 F9: a
/// reload of a thousand pipelines on undeclared queues logged one line of 36 KB); the caller
/// says where to see them all.
pub fn listed<S: AsRef<str>>(items: &[S]) -> String {
    let mut line = items
        .iter()
        .take(LISTED)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > LISTED {
        line.push_str(&format!(" and {} more", items.len() - LISTED));
    }
    line
}

/// `text` cut to at most `max` bytes on a character boundary, with `…` when cut.
pub fn capped(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut cut = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut]).into()
}

/// `text`'s bytes with every `%XX` escape (two hex digits) decoded; an escape that is not one
/// stays as written. The caller decides what bytes that are no UTF-8 mean.
pub fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// The name of `candidates` closest to `got` (case aside), if it is close enough to be what was
/// meant: at most a quarter of its length (plus one) of edits for a key among many, at most half
/// (plus one) among the few variants of a closed set (`upsert` -> `update`), whose full list the
/// error gives anyway.
pub fn closest<'a>(
    got: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    few: bool,
) -> Option<&'a str> {
    let got = got.to_ascii_lowercase();
    let (distance, best) = candidates
        .into_iter()
        .map(|c| (strsim::levenshtein(&got, &c.to_ascii_lowercase()), c))
        .min_by_key(|(d, _)| *d)?;
    let longest = got.len().max(best.len());
    let allowed = if few {
        longest / 2 + 1
    } else {
        longest / 4 + 1
    };
    (distance <= allowed).then_some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34, item 3: what an event or a log line shows of a message is capped on a character
    /// boundary, as parking caps a reason.
    #[test]
    fn what_events_and_logs_show_of_a_message_is_capped() {
        assert_eq!(shown("short"), "short");
        let long = "é".repeat(30_000);
        let cut = shown(&long);
        assert!(
            cut.len() <= SHOWN_MAX && cut.ends_with('…'),
            "{}",
            cut.len()
        );
        assert!(cut.len() > SHOWN_MAX - 8);
    }

    /// The cut never splits a character, and text at the bound is left whole.
    #[test]
    fn a_cut_keeps_whole_characters_and_text_at_the_bound_stays_whole() {
        assert_eq!(capped("abcd", 4), "abcd");
        // "é" is two bytes, "…" three: 5 bytes keep one "é" and the ellipsis.
        assert_eq!(capped("ééé", 5), "é…");
        assert_eq!(capped("ééé", 6), "ééé");
        assert_eq!(capped("éééé", 6), "é…");
    }
}
