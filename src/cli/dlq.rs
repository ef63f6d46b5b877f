//! `warren dlq`: inspect and replay the dead-letter queue and the parked messages.

use crate::config::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub async fn execute(_settings: &Settings, _args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("not implemented yet")
}
