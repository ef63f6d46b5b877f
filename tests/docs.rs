//! The documentation cannot drift: docs/configuration.md lists every setting of
//! config/default.toml with its default and no other, every relative link between README.md and
//! docs/*.md reaches a file and, with `#anchor`, a heading there, and the README links every page.
//!
//! No server is needed: these read files only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use warren::config::{DEFAULT_TOML, setting_names};

/// The section of docs/configuration.md that is the reference table of the settings.
const SETTINGS_HEADING: &str = "## Every setting";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// README.md and every page under docs/, as paths relative to the repository.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![PathBuf::from("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a readable docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().expect("a file name")))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

/// The lines of a markdown text outside fenced code blocks, with their line numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m && trimmed.trim_end() == m => fence = None,
            (None, None) => lines.push((i + 1, line)),
            _ => {}
        }
    }
    lines
}

/// A line without its inline code spans (`...`), where a `[x](y)` is text, not a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// `[text](target)` with the text only, so a heading's slug is made of what GitHub shows.
fn strip_link_syntax(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("](") {
        let Some(end) = rest[start..].find(')') else {
            break;
        };
        out.push_str(&rest[..start]);
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    out.replace('[', "")
}

/// The anchors GitHub gives the headings of a markdown text: lower case, punctuation other than
/// `-` and `_` dropped, spaces as `-`; a repeated slug gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug: String = strip_link_syntax(line[hashes..].trim())
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        anchors.insert(if *n == 0 { slug } else { format!("{slug}-{n}") });
        *n += 1;
    }
    anchors
}

/// Every link target of a markdown text (`[text](target)` and images), with its line number.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in prose_lines(text) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(start) = rest.find("](") {
            let after = &rest[start + 2..];
            let Some(end) = after.find(')') else {
                break;
            };
            // `[a](b "title")`: the target is what comes before the title.
            let target = after[..end].split_whitespace().next().unwrap_or("");
            found.push((number, target.trim_matches(['<', '>']).to_string()));
            rest = &after[end + 1..];
        }
    }
    found
}

/// `base/relative` with `.` and `..` resolved, or None if it leaves the repository.
fn resolve(base: &Path, relative: &str) -> Option<PathBuf> {
    let joined = base.join(relative);
    let mut parts: Vec<Component> = Vec::new();
    for part in joined.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    Some(parts.iter().collect())
}

#[test]
fn every_relative_link_between_the_pages_reaches_a_file_and_its_heading() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&root().join(&file));
        let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
        for (line, target) in links(&text) {
            if target.is_empty()
                || target.contains("://")
                || target.starts_with("mailto:")
                || target.starts_with('/')
            {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let at = format!("{}:{line}: link {target:?}", file.display());
            let resolved = if path.is_empty() {
                Some(file.clone())
            } else {
                resolve(&dir, path)
            };
            let Some(resolved) = resolved else {
                problems.push(format!("{at} leaves the repository"));
                continue;
            };
            checked += 1;
            if !root().join(&resolved).exists() {
                problems.push(format!("{at}: no such file {}", resolved.display()));
                continue;
            }
            if !anchor.is_empty() {
                if resolved.extension().is_none_or(|e| e != "md") {
                    problems.push(format!("{at}: an anchor into a file that is not markdown"));
                } else if !anchors(&read(&root().join(&resolved))).contains(anchor) {
                    problems.push(format!(
                        "{at}: {} has no heading with the anchor #{anchor}",
                        resolved.display()
                    ));
                }
            }
        }
    }
    assert!(
        checked > 0,
        "no relative link found: is the link parser broken?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_readme_links_every_docs_page() {
    let readme = read(&root().join("README.md"));
    let linked: BTreeSet<String> = links(&readme)
        .into_iter()
        .map(|(_, t)| t.split('#').next().unwrap_or("").to_string())
        .collect();
    let missing: Vec<String> = markdown_files()
        .into_iter()
        .skip(1)
        .map(|p| p.display().to_string())
        .filter(|p| !linked.contains(p))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md links no page {missing:?}: add each to its list of pages"
    );
}

#[test]
fn the_slugs_are_githubs() {
    let text = "# warren\n## `warren move`\n## Signed commands (`CONTROL_SECRET`)\n\
                ```sh\n# not a heading\n```\n## What happens when things fail\n\
                ## Notes\n## Notes\n### [WarrenDown](x.md)\n";
    let expected: BTreeSet<String> = [
        "warren",
        "warren-move",
        "signed-commands-control_secret",
        "what-happens-when-things-fail",
        "notes",
        "notes-1",
        "warrendown",
    ]
    .map(String::from)
    .into();
    assert_eq!(anchors(text), expected);
    assert_eq!(
        links("see [a](b.md#c) and `[not](a link)`, ![i](img.png \"t\")\n```\n[x](y)\n```"),
        vec![(1, "b.md#c".to_string()), (1, "img.png".to_string())]
    );
}

/// A default as the reference table shows it: `value` in backticks, or the word "empty".
fn shown_default(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) if s.is_empty() => "empty".into(),
        toml::Value::String(s) => format!("`{s}`"),
        other => format!("`{other}`"),
    }
}

/// The rows of the settings table: environment name -> (default cell, line number).
fn documented_settings() -> (BTreeMap<String, (String, usize)>, Vec<String>) {
    let page = read(&root().join("docs/configuration.md"));
    let start = page
        .lines()
        .position(|l| l.trim_end() == SETTINGS_HEADING)
        .unwrap_or_else(|| panic!("docs/configuration.md has no heading {SETTINGS_HEADING:?}"));
    let mut rows = BTreeMap::new();
    let mut problems = Vec::new();
    for (i, line) in page.lines().enumerate().skip(start + 1) {
        if line.starts_with("## ") {
            break;
        }
        let cells: Vec<&str> = line.trim().split('|').map(str::trim).collect();
        // `| NAME | default | meaning |` splits into "", NAME, default, meaning..., "".
        let Some(name) = cells
            .get(1)
            .and_then(|c| c.strip_prefix('`'))
            .and_then(|c| c.strip_suffix('`'))
        else {
            continue;
        };
        if !line.trim_start().starts_with('|') {
            continue;
        }
        let default = cells.get(2).copied().unwrap_or("").to_string();
        if rows.insert(name.to_string(), (default, i + 1)).is_some() {
            problems.push(format!("{name} is listed twice"));
        }
    }
    (rows, problems)
}

#[test]
fn the_configuration_reference_lists_every_setting_with_its_default_and_no_other() {
    let defaults: toml::Table = DEFAULT_TOML.parse().expect("config/default.toml parses");
    let (rows, mut problems) = documented_settings();
    let mut names = BTreeSet::new();
    for (key, env) in setting_names() {
        let value = defaults
            .get(key)
            .unwrap_or_else(|| panic!("{key} is not in config/default.toml"));
        let expected = shown_default(value);
        match rows.get(&env) {
            None => problems.push(format!(
                "{env} (config key {key}) is missing from the table under {SETTINGS_HEADING:?}; \
                 add `| `{env}` | {expected} | ... |`"
            )),
            Some((shown, line)) if *shown != expected => problems.push(format!(
                "docs/configuration.md:{line}: {env} shows the default {shown:?}, \
                 config/default.toml has {expected:?}"
            )),
            Some(_) => {}
        }
        names.insert(env);
    }
    for (name, (_, line)) in &rows {
        if !names.contains(name) {
            problems.push(format!(
                "docs/configuration.md:{line}: {name} is no setting of config/default.toml"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/configuration.md and config/default.toml disagree:\n{}",
        problems.join("\n")
    );
}
