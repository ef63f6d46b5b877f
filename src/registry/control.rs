//! Why a remote command is not applied, as far as the registry can tell: [`Rejected`], refused
//! by the guard ([`Refusal`]) or malformed ([`CommandError`]). What the instance's pipelines
//! refuse is the app's (`app::control::ControlError`, which wraps this one).

use super::commands::CommandError;

/// Why a command read from Redis is not applied before it reaches the pipelines.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The guard refused it (signature, freshness, replay, address).
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// It does not say what to do (an unknown name, a missing or stray number).
    #[error(transparent)]
    Malformed(#[from] CommandError),
}

/// A signed command issued further than this from the instance's clock is refused.
pub const MAX_SKEW_S: u64 = 120;
/// Start of the error of a command refused for carrying no signature.
pub const REFUSED_UNSIGNED: &str = "refused: unsigned command";
/// Start of the error of a command refused for a signature that does not verify.
pub const REFUSED_BAD_SIGNATURE: &str = "refused: bad signature";

/// Why the guard refused a command; its text is what the outcome records (`warren ctl` looks
/// for [`REFUSED_UNSIGNED`] and [`REFUSED_BAD_SIGNATURE`] at its start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Its target is another instance, or another run of this host and PID.
    #[error("refused: addressed to {target}, not to this instance ({me}){}", if *another_run {
        " (meant for another run of this host and PID: an earlier process, or a command captured \
         and pushed again)"
    } else { "" })]
    Misaddressed {
        target: String,
        me: String,
        another_run: bool,
    },
    #[error(
        "{REFUSED_UNSIGNED}: this instance has CONTROL_SECRET set and accepts only signed \
         commands (run `warren ctl` with the same CONTROL_SECRET)"
    )]
    Unsigned,
    #[error(
        "{REFUSED_BAD_SIGNATURE}: not signed with this instance's CONTROL_SECRET for this \
         instance, or altered on the way"
    )]
    BadSignature,
    #[error(
        "refused: stale command, issued {ago_s} s ago (more than {MAX_SKEW_S} s; check the clocks \
         if it was just sent)"
    )]
    Stale { ago_s: u64 },
    #[error(
        "refused: command from the future, issued {ahead_s} s ahead of this instance's clock \
         (more than {MAX_SKEW_S} s; check the clocks)"
    )]
    Future { ahead_s: u64 },
    #[error("refused: replay, command {id} was already received by this instance")]
    Replay { id: String },
}
