//! `warren config [--origin]`: the effective configuration after every layer, passwords
//! redacted; with `--origin`, where each value comes from.

use crate::cli::out::{out, outln};
use crate::config::{Settings, Sources, file_origin, origins};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// After each setting, the layer that set it: default, file, environment variable (named),
    /// or command line; after each key of a pipeline entry, the file and line that gave it, or
    /// default.
    #[arg(long)]
    pub origin: bool,
}

pub fn execute(settings: &Settings, sources: &Sources, args: Args) -> anyhow::Result<i32> {
    let text = settings.to_redacted_toml();
    if !args.origin {
        out!("{text}")?;
    } else {
        let origins = origins(sources)?;
        // The entries are shown in order: the built-in users pipeline first unless the file
        // declares users, then the file's. A key of an entry is the entry's own (from the
        // file, at its line) or its default, never the setting of the same name.
        let builtin_first = !settings.pipelines.iter().any(|p| p.name == "users");
        let mut entry: Option<usize> = None;
        let mut within: Vec<String> = Vec::new();
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed == "[[pipelines]]" {
                entry = Some(entry.map_or(0, |n| n + 1));
                within.clear();
                outln!("{line}")?;
                continue;
            }
            if let Some(table) = trimmed
                .strip_prefix("[pipelines.")
                .and_then(|t| t.strip_suffix(']'))
            {
                within = table.split('.').map(str::to_string).collect();
                outln!("{line}")?;
                continue;
            }
            let Some(key) = line.split_once(" = ").map(|(k, _)| k.trim()) else {
                outln!("{line}")?;
                continue;
            };
            let origin = match entry {
                None => origins.get(key).cloned(),
                Some(shown) => {
                    // The entry's place in the file, if it is one of the file's.
                    let index = if builtin_first {
                        shown.checked_sub(1)
                    } else {
                        Some(shown)
                    };
                    let found = index.and_then(|index| {
                        let mut path = vec!["pipelines".to_string(), index.to_string()];
                        path.extend(within.iter().cloned());
                        path.push(key.to_string());
                        file_origin(sources, &path)
                    });
                    Some(found.unwrap_or_else(|| "default".to_string()))
                }
            };
            match origin {
                Some(origin) => outln!("{line}  # {origin}")?,
                None => outln!("{line}")?,
            }
        }
    }
    // Each pipeline's largest prefetch window as resolved: at its batch concurrency, or when
    // balanced at its most inserts in flight (what the rate limit is checked against).
    let windows: Vec<String> = settings
        .pipelines()
        .iter()
        .map(|p| format!("{} ({})", p.most_prefetch, p.name))
        .collect();
    outln!("# effective prefetch: {}", windows.join(", "))?;
    Ok(0)
}
