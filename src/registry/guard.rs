//! The [`Guard`]: which remote commands an instance applies. With `CONTROL_SECRET`, only commands
//! signed for this instance's run, issued within [`MAX_SKEW_S`] of its clock and not seen before;
//! without one, every command addressed to it (as before signing existed). What it refuses is a
//! typed [`Refusal`] (defined with the other control errors, `control.rs`).

use std::collections::HashMap;

use super::commands::CtlCommand;
use super::control::{MAX_SKEW_S, Refusal};
use super::outcome::CtlOutcome;
use super::signing::tag;

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
