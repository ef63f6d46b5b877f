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
///
/// A value whose shape is not `scheme://[user[:password]@]host[:port][/path][?query]` (a
/// misplaced or missing `:`, `@` or `//`: `guest:pw@h`, `amqp:/u:pw@h`, `amqp://u:pw` with no
/// `@host`) cannot be told apart from its password, so it is not shown: such an entry becomes
/// `***`, or `scheme://***` when only what follows the `//` is malformed (a "port" that is no
/// number: `u:pw/db`). Text without `@` whose every `:` is followed by a digit or a space (`not
/// a url`, `h2:5432/db`, `12:30`) is shown as it is.
pub fn redact_url(raw: &str) -> String {
    let schemes: Vec<usize> = raw.match_indices("://").map(|(i, _)| i).collect();
    if schemes.is_empty() {
        return redact_loose(raw);
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
        return format!("{}{separators}", redact_loose(body));
    };
    // The scheme: the letters, digits, `+`, `.` and `-` right before the `://`.
    let scheme_start = body[..sep]
        .char_indices()
        .rev()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || "+.-".contains(c)))
        .map_or(0, |(i, c)| i + c.len_utf8());
    if scheme_start == sep {
        return format!("{}{separators}", redact_loose(body));
    }
    let mut out = redact_loose(&body[..scheme_start]);
    out.push_str(&body[scheme_start..sep + 3]);
    let rest = &body[sep + 3..];
    let (userinfo, after) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (hosts, tail) = after.split_at(after.find(['/', '?', '#']).unwrap_or(after.len()));
    if !hosts_are_plain(hosts) {
        // `u:pw` or `u:pw:h` where hosts belong: the "port" may be the password.
        out.push_str("***");
        out.push_str(separators);
        return out;
    }
    if let Some(info) = userinfo {
        match info.split_once(':') {
            Some((user, _)) if is_plain_user(user) => {
                out.push_str(user);
                out.push_str(":***");
            }
            None if is_plain_user(info) => out.push_str(info),
            // `u@pw`, `u/pw`, or another entry run into this one: no user shown.
            _ => out.push_str("***"),
        }
        out.push('@');
    }
    out.push_str(hosts);
    match tail.split_once('?') {
        Some((path, query)) => {
            out.push_str(&redact_path(path));
            out.push('?');
            let (params, fragment) = match query.find('#') {
                Some(hash) => query.split_at(hash),
                None => (query, ""),
            };
            let shown: Vec<String> = params
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if is_secret_key(key) => format!("{key}=***"),
                    Some((key, value)) if is_suspicious(value) => format!("{key}=***"),
                    None if is_suspicious(param) => "***".to_string(),
                    _ => param.to_string(),
                })
                .collect();
            out.push_str(&shown.join("&"));
            out.push_str(&redact_path(fragment));
        }
        None => out.push_str(&redact_path(tail)),
    }
    out.push_str(separators);
    out
}

/// A path (or fragment) as shown: hidden after its first character when it holds what may be
/// a password run into it (`/%2f,amqp//u:pw/h`).
fn redact_path(path: &str) -> String {
    if is_suspicious(path) {
        let first = path.chars().next().map(String::from).unwrap_or_default();
        format!("{first}***")
    } else {
        path.to_string()
    }
}

/// Whether `hosts` (between the user info and the path) is a list of `host`, `host:port` or
/// `[v6]:port` with numeric ports: anything else may be a password in the wrong place.
fn hosts_are_plain(hosts: &str) -> bool {
    hosts.split(',').all(|host| {
        let port = match host.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((_, "")) => return true,
                Some((_, after)) => match after.strip_prefix(':') {
                    Some(port) => port,
                    None => return false,
                },
                None => return false,
            },
            None => match host.split_once(':') {
                Some((_, port)) => port,
                None => return !host.contains(char::is_whitespace),
            },
        };
        port.chars().all(|c| c.is_ascii_digit())
    })
}

/// Whether a user name is shown: one that no misplaced separator ran into.
fn is_plain_user(user: &str) -> bool {
    !user.contains(['@', '/', ':', '?', '#', ',', ';', ' '])
}

/// Whether text may hold a password: an `@`, or a `:` followed by neither a digit nor a space
/// (a port, a time and prose punctuation are not).
fn is_suspicious(text: &str) -> bool {
    text.contains('@')
        || text.match_indices(':').any(|(i, _)| {
            !text[i + 1..].starts_with(|c: char| c.is_ascii_digit() || c.is_whitespace())
        })
}

/// A value with no `scheme://`: a PostgreSQL key/value string (`host=h password=p`) has its
/// secret values redacted; other text is shown only if it cannot hold a password
/// ([`is_suspicious`]).
fn redact_loose(text: &str) -> String {
    let trimmed = text.trim_start();
    let ident = trimmed
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(trimmed.len());
    let key_value = ident > 0 && trimmed[ident..].trim_start().starts_with('=');
    if key_value {
        redact_keywords(text)
    } else if is_suspicious(text) {
        "***".to_string()
    } else {
        text.to_string()
    }
}

/// Whether a query parameter or connection keyword names a secret.
fn is_secret_key(key: &str) -> bool {
    // As the clients read it: percent-decoded (`%70assword` is `password` to libpq: review
    // R39-F1), and `+` a space. Undecodable bytes stay as they are.
    let decoded = percent_decoded(key.trim());
    let key = decoded.to_ascii_lowercase();
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
        // Where the value ends as libpq reads it: a quoted value at the first quote not escaped
        // by a backslash, an unquoted one at the first whitespace not escaped by one (`my\ pw`
        // is one value: review R38-F6 showed its second half). Whatever follows a quoted value
        // up to the next whitespace is hidden too (`'a'b` is no valid string, but may be a
        // password mistyped): more hidden rather than less.
        let unescaped_end = |text: &str, stop: fn(char) -> bool| -> Option<usize> {
            let mut escaped = false;
            text.char_indices()
                .find(|&(_, c)| {
                    let ends = stop(c) && !escaped;
                    escaped = c == '\\' && !escaped;
                    ends
                })
                .map(|(i, _)| i)
        };
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            let close = unescaped_end(quoted, |c| c == '\'').map_or(value.len(), |i| i + 2);
            close
                + value[close..]
                    .find(char::is_whitespace)
                    .unwrap_or(value.len() - close)
        } else {
            unescaped_end(value, char::is_whitespace).unwrap_or(value.len())
        };
        out.push_str("***");
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// `text` with every `%XX` escape decoded ([`crate::text::percent_decoded`]) and `+` read as a
/// space (bytes that are no UTF-8 are replaced).
fn percent_decoded(text: &str) -> String {
    String::from_utf8_lossy(&crate::text::percent_decoded(&text.replace('+', " "))).into_owned()
}
