//! Secrets out of what is shown: passwords and secret query parameters of URL settings.

/// Replaces every secret in a URL setting with `***`: the password of the user info (everything
/// between the first `:` and the last `@` of the part after `scheme://`), the value of every
/// query parameter whose name says it holds a secret (`password`, `sslpassword`, `pass`, `pwd`,
/// `secret`, `token`, ... in any case), in every entry of a comma-separated list (`AMQP_URL`)
/// and in the one user info of a URL with several hosts (`postgres://u:p@h1:5432,h2:5432/db`);
/// and in a PostgreSQL key/value string (`host=h password=p`), the value of such keys. It works
/// on the text, not through a URL parser, so a URL no parser accepts is redacted all the same;
/// where it cannot tell (an `@` in a path or a query, a `?` or `#` in a password), it hides more
/// rather than less.
pub fn redact_url(raw: &str) -> String {
    let schemes: Vec<usize> = raw.match_indices("://").map(|(i, _)| i).collect();
    if schemes.is_empty() {
        return redact_keywords(raw);
    }
    // Each entry of a list starts after the last separator before its `://`; without one, the
    // `://` is inside the previous entry (a query value, say) and starts nothing.
    let mut starts = vec![0];
    for pair in schemes.windows(2) {
        let between = &raw[pair[0] + 3..pair[1]];
        if let Some(sep) = between.rfind([',', ' ', ';']) {
            starts.push(pair[0] + 3 + sep + 1);
        }
    }
    starts.push(raw.len());
    starts
        .windows(2)
        .map(|w| redact_entry(&raw[w[0]..w[1]]))
        .collect()
}

/// One URL of a list (with the separator that follows it, if any), redacted.
fn redact_entry(entry: &str) -> String {
    let body = entry.trim_end_matches([',', ' ', ';']);
    let separators = &entry[body.len()..];
    let Some(sep) = body.find("://") else {
        return redact_keywords(entry);
    };
    let (head, rest) = body.split_at(sep + 3);
    let mut out = String::from(head);
    let after_userinfo = match rest.rfind('@') {
        Some(at) => {
            match rest[..at].find(':') {
                Some(colon) => {
                    out.push_str(&rest[..=colon]);
                    out.push_str("***");
                }
                None => out.push_str(&rest[..at]),
            }
            &rest[at..]
        }
        None => rest,
    };
    match after_userinfo.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let (params, fragment) = match query.find('#') {
                Some(hash) => query.split_at(hash),
                None => (query, ""),
            };
            let shown: Vec<String> = params
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if is_secret_key(key) => format!("{key}=***"),
                    _ => param.to_string(),
                })
                .collect();
            out.push_str(&shown.join("&"));
            out.push_str(fragment);
        }
        None => out.push_str(after_userinfo),
    }
    out.push_str(separators);
    out
}

/// Whether a query parameter or connection keyword names a secret.
fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// A PostgreSQL key/value connection string (`host=h password='a b'`) with the value of every
/// secret keyword replaced by `***`; any other text comes back as it was.
fn redact_keywords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let (before, after) = rest.split_at(eq);
        out.push_str(before);
        out.push('=');
        let after = &after[1..];
        let key = before
            .trim_end()
            .rsplit(|c: char| c.is_whitespace())
            .next()
            .unwrap_or("");
        if !is_secret_key(key) {
            rest = after;
            continue;
        }
        let value = after.trim_start();
        out.push_str(&after[..after.len() - value.len()]);
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            // A quoted value ends at the first quote not escaped by a backslash.
            let mut escaped = false;
            let close = quoted.char_indices().find(|&(_, c)| {
                let closes = c == '\'' && !escaped;
                escaped = c == '\\' && !escaped;
                closes
            });
            close.map_or(value.len(), |(i, _)| i + 2)
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        out.push_str("***");
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}
