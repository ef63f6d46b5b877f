//! `warren declare [--dry-run]`: declare the topology (reporting each object as created or
//! already matched) and apply the database migrations. Never deletes anything.

use anyhow::Context as _;

use crate::config::Settings;
use crate::topology::Topology;
use crate::{amqp, db};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the plan without touching the broker or the database.
    #[arg(long)]
    pub dry_run: bool,
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let topology = Topology::from_settings(settings)?;
    if args.dry_run {
        println!("plan (nothing declared):");
        for step in topology.plan() {
            println!("  {}", step.object);
        }
        println!(
            "  database schema {}: migrations V1__users, V2__dead_letters",
            settings.database_schema
        );
        return Ok(0);
    }
    declare_all(settings, &topology, true).await?;
    Ok(0)
}

/// Declares the topology and migrates the database; prints each step when `verbose`.
pub async fn declare_all(
    settings: &Settings,
    topology: &Topology,
    verbose: bool,
) -> anyhow::Result<()> {
    let conn = amqp::connect(settings, "declare", amqp::Frames::Small)
        .await
        .with_context(|| {
            format!(
                "cannot reach the broker at {}",
                crate::config::redact_url(&settings.amqp_url)
            )
        })?;
    let result = topology.declare(&conn).await;
    amqp::close(None, Some(conn)).await;
    let steps = result?;
    for step in &steps {
        let outcome = step
            .outcome
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        if verbose {
            println!("{:<90} {outcome}", step.object);
        }
        tracing::debug!(object = %step.object, %outcome, "declared");
    }
    let report = db::migrate(settings).await.with_context(|| {
        format!(
            "cannot migrate the database at {}",
            crate::config::redact_url(&settings.database_url)
        )
    })?;
    if verbose {
        let what = if report.applied.is_empty() {
            "already up to date".to_string()
        } else {
            format!("applied {}", report.applied.join(", "))
        };
        println!(
            "{:<90} {what}",
            format!("database schema {}", settings.database_schema)
        );
    }
    Ok(())
}
