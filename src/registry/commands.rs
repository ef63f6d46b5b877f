//! The signed remote commands: [`CtlCommand`], a command as it is queued in Redis (its JSON, the
//! strings of the edge) and the bytes its signature covers; [`Command`], what it asks, read from
//! it once ([`Command::read`]), a malformed one being a [`CommandError`].
//!
//! Remote commands are signed with HMAC-SHA256 under `CONTROL_SECRET` over a canonical
//! encoding of every field and the target instance ([`CtlCommand::canonical`]); the target names
//! the instance's run (`host:pid/run`, a random id drawn at start and published in its record),
//! so a command captured for one process is refused by a later one with the same host and PID
//! (PID 1 in every container). The [`Guard`](super::Guard) refuses unsigned, badly signed, stale,
//! future, replayed and misaddressed ones; outcomes are signed the same way
//! ([`CtlOutcome`](super::CtlOutcome)).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::signing::{KeyError, encode, tag, verifies};

/// What a remote command asks an instance to do: what `warren ctl` sends, read once from the
/// wire ([`Command::read`]). On the wire its name is the JSON string `command` and its number
/// rides beside it in `processors`, `rate`, `min` or `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `pause`: stop taking deliveries; what is in flight finishes.
    Pause,
    /// `resume`: take deliveries again.
    Resume,
    /// `drain`: finish what is in flight and exit 0, as on SIGTERM; the whole instance only.
    Drain,
    /// `reload`: read the configuration again and apply its pipelines, as on SIGHUP; the whole
    /// instance only.
    Reload,
    /// `scale`: this many processors per pipeline (`processors` on the wire).
    Scale { processors: usize },
    /// `rate`: messages per second each pipeline takes from its queue, 0 = no limit (`rate` on
    /// the wire).
    Rate { per_s: u32 },
    /// `concurrency`: the bounds of each main stage's batch inserts in flight (`warren ctl
    /// scale --min/--max`; `min` and `max` on the wire, absent = unchanged, one at least).
    Concurrency {
        min: Option<usize>,
        max: Option<usize>,
    },
}

/// Why a command read from Redis says nothing this instance can do. No `warren ctl` sends one;
/// it is recorded as failed with this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// A name this version does not know (kept as read: its outcome names it).
    #[error("unknown command {0:?}")]
    Unknown(String),
    /// `scale` without `processors`.
    #[error("scale needs a number of processors")]
    ScaleWithoutProcessors,
    /// `rate` without `rate`.
    #[error("rate needs a number of messages per second")]
    RateWithoutLimit,
    /// `concurrency` with neither `min` nor `max`.
    #[error("concurrency needs min or max")]
    ConcurrencyWithoutBounds,
    /// A number beside a command that does not take it (`processors` on a `pause`).
    #[error("{command} takes no {field}")]
    Stray {
        command: &'static str,
        field: &'static str,
    },
    /// `drain` with a pipeline: it stops the whole process.
    #[error("drain applies to the whole instance, not to one pipeline")]
    DrainOnePipeline,
    /// `reload` with a pipeline: it reads the whole configuration again.
    #[error("reload applies to the whole instance, not to one pipeline")]
    ReloadOnePipeline,
}

impl Command {
    /// Its name: on the wire, in the signed bytes, in outcomes, logs and `warren ctl`'s output.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Pause => "pause",
            Command::Resume => "resume",
            Command::Drain => "drain",
            Command::Reload => "reload",
            Command::Scale { .. } => "scale",
            Command::Rate { .. } => "rate",
            Command::Concurrency { .. } => "concurrency",
        }
    }

    /// Whether it acts on pipelines (their stages): an instance that runs none (ROLES without
    /// consumer and dlq: an API-only instance) refuses it. `drain` and `reload` act on the
    /// instance.
    pub fn acts_on_pipelines(&self) -> bool {
        !matches!(self, Command::Drain | Command::Reload)
    }

    /// What the wire fields of `wire` ask, or why they ask nothing this instance can do.
    pub fn read(wire: &CtlCommand) -> Result<Self, CommandError> {
        let command = match wire.command.as_str() {
            "pause" => Command::Pause,
            "resume" => Command::Resume,
            "drain" => Command::Drain,
            "reload" => Command::Reload,
            "scale" => Command::Scale {
                processors: wire
                    .processors
                    .ok_or(CommandError::ScaleWithoutProcessors)?,
            },
            "rate" => Command::Rate {
                per_s: wire.rate.ok_or(CommandError::RateWithoutLimit)?,
            },
            "concurrency" => match (wire.min, wire.max) {
                (None, None) => return Err(CommandError::ConcurrencyWithoutBounds),
                (min, max) => Command::Concurrency { min, max },
            },
            other => return Err(CommandError::Unknown(other.to_string())),
        };
        let name = command.name();
        let stray = |field: &'static str| CommandError::Stray {
            command: name,
            field,
        };
        let bounds = matches!(command, Command::Concurrency { .. });
        if wire.processors.is_some() && !matches!(command, Command::Scale { .. }) {
            return Err(stray("processors"));
        }
        if wire.rate.is_some() && !matches!(command, Command::Rate { .. }) {
            return Err(stray("rate"));
        }
        if wire.min.is_some() && !bounds {
            return Err(stray("min"));
        }
        if wire.max.is_some() && !bounds {
            return Err(stray("max"));
        }
        if command == Command::Drain && wire.pipeline.is_some() {
            return Err(CommandError::DrainOnePipeline);
        }
        if command == Command::Reload && wire.pipeline.is_some() {
            return Err(CommandError::ReloadOnePipeline);
        }
        Ok(command)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A remote-control command as it is queued for one instance: field for field, and in this order,
/// what every `warren ctl` wrote, and the source of the signed bytes. What it asks is read from it
/// once, by [`Command::read`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CtlCommand {
    /// Shared by the copies sent to several instances, to find their outcomes.
    pub id: String,
    /// The command's name ([`Command::name`]), as written.
    pub command: String,
    /// For `scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processors: Option<usize>,
    /// For `rate`: messages per second, 0 = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The pipeline it applies to (`pause`, `resume`, `scale`, `rate`); absent: every pipeline
    /// of the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    /// Unix seconds when `warren ctl` sent it: an instance with a secret refuses it after
    /// [`MAX_SKEW_S`](super::MAX_SKEW_S), so a captured copy cannot be replayed later.
    pub issued_at: u64,
    /// Who asked (`host:pid` of the `warren ctl` process).
    pub by: String,
    /// The instance it is meant for, `host:pid/run` (`host:pid` from older `warren ctl`s), so a
    /// copy pushed to another instance's list, or to a later process with the same host and
    /// PID, is refused; absent in commands from the oldest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlCommand::canonical`] under `CONTROL_SECRET`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// For `concurrency`: the new bounds (absent: unchanged). Last, so the sequence form of
    /// older commands reads as it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<usize>,
}

impl CtlCommand {
    /// `command`, issued at `issued_at` by `by`, for every pipeline or only `pipeline`, not yet
    /// addressed nor signed.
    pub fn new(
        id: String,
        command: Command,
        pipeline: Option<String>,
        issued_at: u64,
        by: String,
    ) -> Self {
        let (mut processors, mut rate, mut min, mut max) = (None, None, None, None);
        match command {
            Command::Scale { processors: n } => processors = Some(n),
            Command::Rate { per_s } => rate = Some(per_s),
            Command::Concurrency { min: lo, max: hi } => (min, max) = (lo, hi),
            Command::Pause | Command::Resume | Command::Drain | Command::Reload => {}
        }
        Self {
            id,
            command: command.name().to_string(),
            processors,
            rate,
            pipeline,
            issued_at,
            by,
            target: None,
            signature: None,
            min,
            max,
        }
    }

    /// The bytes the signature covers: a version line, then each field as
    /// `name=<byte length>:<value>` and a newline, in this order: `id`, `command`, `processors`
    /// (empty when absent), `rate`, `pipeline`, `min` and `max` (each only when present, so
    /// commands without them keep the signatures they always had), `issued_at`, `by`, `target`
    /// (the instance that applies it). The length prefixes make the encoding unambiguous
    /// whatever the values hold.
    pub fn canonical(&self, target: &str) -> Vec<u8> {
        // No `..`: a new field does not compile until it is added here, so every argument is
        // covered by the signature.
        let CtlCommand {
            id,
            command,
            processors,
            rate,
            pipeline,
            min,
            max,
            issued_at,
            by,
            target: _,
            signature: _,
        } = self;
        let processors = processors.map(|n| n.to_string()).unwrap_or_default();
        let rate = rate.map(|n| n.to_string());
        let (min, max) = (min.map(|n| n.to_string()), max.map(|n| n.to_string()));
        let issued_at = issued_at.to_string();
        encode(
            "warren-ctl-v1",
            [
                Some(("id", id.as_str())),
                Some(("command", command.as_str())),
                Some(("processors", processors.as_str())),
                rate.as_deref().map(|r| ("rate", r)),
                pipeline.as_deref().map(|p| ("pipeline", p)),
                min.as_deref().map(|n| ("min", n)),
                max.as_deref().map(|n| ("max", n)),
                Some(("issued_at", issued_at.as_str())),
                Some(("by", by.as_str())),
                Some(("target", target)),
            ],
        )
    }

    /// Addresses the command to `target` (`host:pid/run`) and signs it with `secret`.
    pub fn sign(&mut self, secret: &str, target: &str) -> Result<(), KeyError> {
        self.target = Some(target.to_string());
        self.signature = Some(tag(secret, &self.canonical(target))?);
        Ok(())
    }

    /// Whether the signature is the one `secret` gives for this command applied by `target`
    /// (compared in constant time).
    pub fn signature_matches(&self, secret: &str, target: &str) -> bool {
        verifies(secret, &self.canonical(target), self.signature.as_deref())
    }
}

#[cfg(test)]
mod tests;
