//! The signed outcomes an instance records for the commands it read ([`CtlOutcome`]), and for
//! the balancers' decisions, in `{prefix}:ctl:history`. They are signed like commands (see
//! [`CtlOutcome::canonical`]), so a line written into the history by anyone who can write to
//! Redis does not pass for an instance's.

use serde::{Deserialize, Serialize};

use super::commands::CtlCommand;
use super::signing::{encode, verifies};

/// What an instance did with a command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtlOutcome {
    /// The command's id, by which `warren ctl` finds the outcomes of what it sent.
    pub id: String,
    /// The command's name as it was read (a line of the history may hold anything).
    pub command: String,
    /// The command's `processors` and `rate`, if it had them (`warren ctl history` shows them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processors: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The command's `--pipeline`, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    /// The instance that recorded it.
    pub host: String,
    pub pid: u32,
    /// `executed` or `failed`.
    pub outcome: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Unix seconds when it was recorded.
    pub at: u64,
    /// The run of the instance that recorded it (see [`Recorder::run`]); absent from older ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlOutcome::canonical`] under `CONTROL_SECRET`, when the
    /// instance has one: a `warren ctl` with the secret believes only outcomes that verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// What else it said: a `concurrency`'s bounds (`min=2 max=8`), a balancing decision's
    /// change, reason and inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Who records an outcome: the instance that applied the command.
#[derive(Debug, Clone, Copy)]
pub struct Recorder<'a> {
    pub host: &'a str,
    pub pid: u32,
    /// The instance's run: a random id drawn at its start.
    pub run: &'a str,
}

impl CtlOutcome {
    /// What `instance` records for `command`, at `at` (Unix seconds): `executed`, or `failed`
    /// with the error; unsigned.
    pub fn of(
        command: &CtlCommand,
        instance: Recorder<'_>,
        result: &Result<(), impl std::fmt::Display>,
        at: u64,
    ) -> Self {
        // What the command carried is outside text (anyone who can write to Redis can send
        // one): capped as a log line shows it, so the history's lines, and `warren ctl history`,
        // never grow with it (review R35g F1: an id of 2 MB stored and printed whole).
        let shown = |text: &str| crate::text::shown(text).into_owned();
        Self {
            id: shown(&command.id),
            command: shown(&command.command),
            processors: command.processors,
            rate: command.rate,
            pipeline: command.pipeline.as_deref().map(shown),
            detail: match (command.min, command.max) {
                (None, None) => None,
                (min, max) => Some(
                    [("min", min), ("max", max)]
                        .iter()
                        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
                        .collect::<Vec<_>>()
                        .join(" "),
                ),
            },
            host: instance.host.to_string(),
            pid: instance.pid,
            outcome: if result.is_ok() { "executed" } else { "failed" }.into(),
            error: result.as_ref().err().map(|e| shown(&e.to_string())),
            at,
            run: Some(instance.run.to_string()),
            signature: None,
        }
    }

    /// A balancing decision recorded by `instance` at `at`: command `balance`, the pipeline, and
    /// `detail` (the change, its reason and inputs); unsigned.
    pub fn decision(
        instance: Recorder<'_>,
        id: String,
        pipeline: &str,
        detail: String,
        at: u64,
    ) -> Self {
        Self {
            id,
            command: "balance".into(),
            processors: None,
            rate: None,
            pipeline: Some(pipeline.to_string()),
            detail: Some(detail),
            host: instance.host.to_string(),
            pid: instance.pid,
            outcome: "executed".into(),
            error: None,
            at,
            run: Some(instance.run.to_string()),
            signature: None,
        }
    }

    /// The bytes the signature covers, encoded as commands are (see [`CtlCommand::canonical`])
    /// under the version line `warren-outcome-v1`: `id`, `command`, `processors` and `rate`
    /// (empty when absent), `pipeline` and `detail` (each only when present), `host`, `pid`,
    /// `run`, `outcome`, `error` (empty when absent), `at`.
    pub fn canonical(&self) -> Vec<u8> {
        let CtlOutcome {
            id,
            command,
            processors,
            rate,
            pipeline,
            detail,
            host,
            pid,
            outcome,
            error,
            at,
            run,
            signature: _,
        } = self;
        let processors = processors.map(|n| n.to_string()).unwrap_or_default();
        let rate = rate.map(|n| n.to_string()).unwrap_or_default();
        let (pid, at) = (pid.to_string(), at.to_string());
        encode(
            "warren-outcome-v1",
            [
                Some(("id", id.as_str())),
                Some(("command", command.as_str())),
                Some(("processors", processors.as_str())),
                Some(("rate", rate.as_str())),
                pipeline.as_deref().map(|p| ("pipeline", p)),
                detail.as_deref().map(|d| ("detail", d)),
                Some(("host", host.as_str())),
                Some(("pid", pid.as_str())),
                Some(("run", run.as_deref().unwrap_or_default())),
                Some(("outcome", outcome.as_str())),
                Some(("error", error.as_deref().unwrap_or_default())),
                Some(("at", at.as_str())),
            ],
        )
    }

    /// Whether the outcome carries the signature `secret` gives it.
    pub fn verifies(&self, secret: &str) -> bool {
        verifies(secret, &self.canonical(), self.signature.as_deref())
    }
}
