//! Why a remote command was not applied: [`ControlError`], one typed error for everything an
//! instance can answer `failed` with (refused by the guard, malformed, refused by the instance's
//! pipelines, or arriving while it stops). Its text is the outcome's `error`.

use super::commands::CommandError;
use super::guard::Refusal;
use crate::pipeline::OutOfRange;
use crate::pipeline::balance::BoundsError;

/// Why a command read from Redis was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The guard refused it (signature, freshness, replay, address).
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// It does not say what to do (an unknown name, a missing or stray number).
    #[error(transparent)]
    Malformed(#[from] CommandError),
    /// It acts on pipelines and the instance runs none (ROLES without consumer or dlq).
    #[error("this instance runs no consumer role")]
    NoConsumer,
    /// Its `--pipeline` is not one the instance runs; `runs` lists those it runs, once each.
    #[error("this instance runs no pipeline {name:?} (it runs {})", runs.join(", "))]
    NoPipeline { name: String, runs: Vec<String> },
    /// `scale --min/--max` on an instance with no main stage.
    #[error("this instance runs no main stage (ROLES has no consumer)")]
    NoMainStage,
    /// A number outside what a pipeline takes.
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    /// Bounds a main stage cannot take.
    #[error(transparent)]
    Bounds(#[from] BoundsError),
    /// It arrived while the instance was stopping.
    #[error("warren is stopping")]
    Stopping,
}
