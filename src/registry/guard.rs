//! The [`Guard`]: which remote commands an instance applies. With `CONTROL_SECRET`, only commands
//! signed for this instance's run, issued within [`MAX_SKEW_S`] of its clock and not seen before;
//! without one, every command addressed to it (as before signing existed). What it refuses is a
//! typed [`Refusal`].

use std::collections::HashMap;

use super::commands::CtlCommand;
use super::outcome::CtlOutcome;
use super::signing::tag;

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

/// Decides which remote commands this instance applies.
pub struct Guard {
    /// `CONTROL_SECRET`; `None` when unset.
    secret: Option<String>,
    /// This instance as `host:pid/run`, which the signature must cover.
    me: String,
    /// Ids of the commands already accepted, with their `issued_at`, so a replay is refused;
    /// forgotten once they are too old to pass the freshness check anyway.
    pub(super) seen: HashMap<String, u64>,
}

impl Guard {
    pub fn new(secret: &str, me: String) -> Self {
        Self {
            secret: Some(secret.to_string()).filter(|s| !s.is_empty()),
            me,
            seen: HashMap::new(),
        }
    }

    /// `Ok` when `command` may be applied now (`now` in Unix seconds), else why it is refused.
    pub fn check(&mut self, command: &CtlCommand, now: u64) -> Result<(), Refusal> {
        let (host_pid, _run) = self.me.split_once('/').unwrap_or((&self.me, ""));
        if let Some(target) = &command.target
            && *target != self.me
        {
            // Without a secret, a command of an older `warren ctl` (`host:pid`) is still taken.
            let older = self.secret.is_none() && target == host_pid;
            if !older {
                let another_run =
                    target.split_once('/').map_or(target.as_str(), |(hp, _)| hp) == host_pid;
                return Err(Refusal::Misaddressed {
                    target: target.clone(),
                    me: self.me.clone(),
                    another_run,
                });
            }
        }
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        if command.signature.is_none() {
            return Err(Refusal::Unsigned);
        }
        if !command.signature_matches(secret, &self.me) {
            return Err(Refusal::BadSignature);
        }
        if command.issued_at + MAX_SKEW_S < now {
            return Err(Refusal::Stale {
                ago_s: now - command.issued_at,
            });
        }
        if command.issued_at > now + MAX_SKEW_S {
            return Err(Refusal::Future {
                ahead_s: command.issued_at - now,
            });
        }
        // Keep ids while a copy could still pass the freshness check, with a margin for a clock
        // that steps back.
        self.seen
            .retain(|_, issued| *issued + 2 * MAX_SKEW_S >= now);
        if self.seen.contains_key(&command.id) {
            return Err(Refusal::Replay {
                id: command.id.clone(),
            });
        }
        self.seen.insert(command.id.clone(), command.issued_at);
        Ok(())
    }

    /// Signs `outcome` when this instance has a secret.
    pub fn sign(&self, outcome: &mut CtlOutcome) {
        if let Some(secret) = &self.secret {
            outcome.signature = tag(secret, &outcome.canonical()).ok();
        }
    }
}
