//! Each component owns its settings (issue 35): no module below the composition root imports
//! warren's flat `config::Settings`. The broker link, the pipelines, the HTTP API, the registry,
//! the events writer and the database layer each take their own configuration (`AmqpConfig`,
//! `pipeline::Links`, `HttpConfig`, `RegistryConfig`, `EventsConfig`, `DbConfig`), built from the
//! settings in one place, `src/config/components.rs`; only `app` and `cli` read `Settings`.
//!
//! Read as text, as a reviewer would: a `use` of `config::Settings` (alone or in a group, over
//! several lines), or a path through it (`crate::config::Settings::defaults()`), in code or in
//! the file's tests.

use std::path::{Path, PathBuf};

/// The parts of `src/` below the composition root that must not read `Settings`.
const BELOW_THE_ROOT: &[&str] = &["amqp", "pipeline", "http", "registry", "db", "events.rs"];

fn rust_files(at: &Path, out: &mut Vec<PathBuf>) {
    if at.is_file() {
        if at.extension().is_some_and(|e| e == "rs") {
            out.push(at.to_path_buf());
        }
        return;
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(at)
        .unwrap_or_else(|e| panic!("{}: {e}", at.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for entry in entries {
        rust_files(&entry, out);
    }
}

/// The text without its comments (`//` to the end of the line; strings are left alone, which
/// at worst keeps a `//` inside one and its line's rest).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `text` (code, comments removed) names `config::Settings`: a path through it, or a
/// `use ...config::{...}` group that holds it.
fn names_settings(text: &str) -> bool {
    let is_word = |s: &str, at: usize, len: usize| {
        let before = s[..at].chars().next_back();
        let after = s[at + len..].chars().next();
        let ident = |c: char| c.is_alphanumeric() || c == '_';
        !before.is_some_and(ident) && !after.is_some_and(ident)
    };
    // A path: `config::Settings` (not `config::SettingsX`).
    for (at, _) in text.match_indices("config::Settings") {
        if is_word(text, at + "config::".len(), "Settings".len()) {
            return true;
        }
    }
    // A group: `config::{ ... Settings ... }`, possibly over several lines.
    for (at, _) in text.match_indices("config::{") {
        let rest = &text[at + "config::{".len()..];
        let group = &rest[..rest.find('}').unwrap_or(rest.len())];
        if group.split(',').any(|item| {
            let item = item.trim();
            item == "Settings" || item.starts_with("Settings ")
        }) {
            return true;
        }
    }
    false
}

/// The check itself finds each form of import, and none in a comment or a longer name.
#[test]
fn the_check_finds_every_form_of_import() {
    for found in [
        "use crate::config::Settings;",
        "use crate::config::{Role, Settings};",
        "use crate::config::{\n    Balance,\n    Settings,\n};",
        "use crate::config::{Settings as S};",
        "let s = crate::config::Settings::defaults();",
        "fn f(s: &warren::config::Settings) {}",
    ] {
        assert!(names_settings(&code(found)), "{found}");
    }
    for not in [
        "// use crate::config::Settings;",
        "/// takes no config::Settings",
        "use crate::config::SettingsView;",
        "use crate::config::{Role, redact_url};",
        "use crate::db::DbConfig;",
    ] {
        assert!(!names_settings(&code(not)), "{not}");
    }
}

#[test]
fn no_module_below_the_composition_root_imports_settings() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for part in BELOW_THE_ROOT {
        rust_files(&root.join("src").join(part), &mut files);
    }
    assert!(
        files.len() > 20,
        "the walk found the modules ({} files)",
        files.len()
    );
    let mut offenders = Vec::new();
    for file in &files {
        let shown = file
            .strip_prefix(root)
            .expect("under the crate")
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(file).expect("a source file");
        let imports = names_settings(&code(&text));
        if imports {
            offenders.push(shown);
        }
    }
    assert!(
        offenders.is_empty(),
        "these modules below the composition root import config::Settings; give them their \
         component's own configuration (built in src/config/components.rs) instead: {offenders:#?}"
    );
}
