//! `warren config`: the effective configuration after every layer, passwords redacted.

use crate::config::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub fn execute(settings: &Settings, _: Args) -> anyhow::Result<i32> {
    print!("{}", settings.to_redacted_toml());
    println!("# effective prefetch: {}", settings.effective_prefetch());
    Ok(0)
}
