//! `warren config [--origin]`: the effective configuration after every layer, passwords
//! redacted; with `--origin`, where each value comes from.

use crate::cli::out::{out, outln};
use crate::config::{Settings, Sources, origins};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// After each setting, the layer that set it: default, file, environment variable (named),
    /// or command line.
    #[arg(long)]
    pub origin: bool,
}

pub fn execute(settings: &Settings, sources: &Sources, args: Args) -> anyhow::Result<i32> {
    let text = settings.to_redacted_toml();
    if !args.origin {
        out!("{text}")?;
    } else {
        let origins = origins(sources)?;
        for line in text.lines() {
            let key = line.split_once(" = ").map(|(k, _)| k.trim());
            match key.and_then(|k| origins.get(k)) {
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
