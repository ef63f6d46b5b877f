//! The signed remote commands: what they ask ([`Command`]) and their JSON in Redis, the bytes
//! their signature covers, the [`Guard`] that decides which ones an instance applies, and the
//! signed outcomes it records.
//!
//! Remote commands are signed with HMAC-SHA256 under `CONTROL_SECRET` over a canonical
//! encoding of every field and the target instance ([`CtlCommand::canonical`]); the target names
//! the instance's run (`host:pid/run`, a random id drawn at start and published in its hash), so
//! a command captured for one process is refused by a later one with the same host and PID (PID 1
//! in every container). [`Guard`] refuses unsigned, badly signed, stale, future, replayed and
//! misaddressed ones. Outcomes are signed the same way ([`CtlOutcome::canonical`]), so a line
//! written into the history by anyone who can write to Redis does not pass for an instance's.

use std::collections::HashMap;
use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// A signed command issued further than this from the instance's clock is refused.
pub const MAX_SKEW_S: u64 = 120;
/// Start of the error of a command refused for carrying no signature.
pub const REFUSED_UNSIGNED: &str = "refused: unsigned command";
/// Start of the error of a command refused for a signature that does not verify.
pub const REFUSED_BAD_SIGNATURE: &str = "refused: bad signature";

/// What a remote command asks an instance to do: the five `warren ctl` sends, and what an
/// instance can read from Redis but not apply. On the wire its name is the JSON string `command`
/// and its number rides beside it in `processors` or `rate` (see `Wire`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `pause`: stop taking deliveries; what is in flight finishes.
    Pause,
    /// `resume`: take deliveries again.
    Resume,
    /// `drain`: finish what is in flight and exit 0, as on SIGTERM; the whole instance only.
    Drain,
    /// `scale`: this many processors per pipeline (`processors` on the wire).
    Scale { processors: usize },
    /// `rate`: messages per second each pipeline takes from its queue, 0 = no limit (`rate` on
    /// the wire).
    Rate { per_s: u32 },
    /// `concurrency`: the bounds of each main stage's batch inserts in flight (`warren ctl
    /// scale --min/--max`; `min` and `max` on the wire, absent = unchanged).
    Concurrency {
        min: Option<usize>,
        max: Option<usize>,
    },
    /// `scale` without `processors`, which no `warren ctl` sends: refused when applied.
    ScaleWithoutProcessors,
    /// `rate` without `rate`, which no `warren ctl` sends: refused when applied.
    RateWithoutLimit,
    /// A name this version does not know, kept as it was read so that its signature still
    /// verifies and its outcome names it: refused when applied (`unknown command "..."`).
    Unknown(String),
}

impl Command {
    /// Its name: on the wire, in the signed bytes, in outcomes, logs and `warren ctl`'s output.
    pub fn name(&self) -> &str {
        match self {
            Command::Pause => "pause",
            Command::Resume => "resume",
            Command::Drain => "drain",
            Command::Scale { .. } | Command::ScaleWithoutProcessors => "scale",
            Command::Rate { .. } | Command::RateWithoutLimit => "rate",
            Command::Concurrency { .. } => "concurrency",
            Command::Unknown(name) => name,
        }
    }

    /// The command the wire fields `command`, `processors` and `rate` hold, and those of the
    /// numbers that are not its own. Any name is taken: what cannot be applied is refused when
    /// applied, and recorded, as it always was.
    fn read(
        name: String,
        processors: Option<usize>,
        rate: Option<u32>,
        (min, max): (Option<usize>, Option<usize>),
    ) -> (Self, Stray) {
        let command = match name.as_str() {
            "pause" => Command::Pause,
            "resume" => Command::Resume,
            "drain" => Command::Drain,
            "scale" => processors.map_or(Command::ScaleWithoutProcessors, |processors| {
                Command::Scale { processors }
            }),
            "rate" => rate.map_or(Command::RateWithoutLimit, |per_s| Command::Rate { per_s }),
            "concurrency" => Command::Concurrency { min, max },
            _ => Command::Unknown(name),
        };
        let bounds = !matches!(command, Command::Concurrency { .. });
        let stray = Stray {
            processors: processors.filter(|_| !matches!(command, Command::Scale { .. })),
            rate: rate.filter(|_| !matches!(command, Command::Rate { .. })),
            min: min.filter(|_| bounds),
            max: max.filter(|_| bounds),
        };
        (command, stray)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Numbers read from Redis beside a command that are not its own (`processors` on a `pause`,
/// `rate` on a `scale`). No `warren ctl` sends them and none is applied, but they stay with the
/// command, so that its signature covers what was written and its outcome shows it, as before
/// commands were typed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Stray {
    /// `processors` beside a command other than `scale`.
    processors: Option<usize>,
    /// `rate` beside a command other than `rate`.
    rate: Option<u32>,
    /// `min` and `max` beside a command other than `concurrency`.
    min: Option<usize>,
    max: Option<usize>,
}

/// A remote-control command, as queued for one instance. Its JSON, and the bytes its signature
/// covers, are those of `Wire`: field for field what every `warren ctl` wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Wire", into = "Wire")]
pub struct CtlCommand {
    /// Shared by the copies sent to several instances, to find their outcomes.
    pub id: String,
    /// What it asks, with its number.
    pub command: Command,
    /// The pipeline it applies to (`pause`, `resume`, `scale`, `rate`); absent: every pipeline
    /// of the instance.
    pub pipeline: Option<String>,
    /// Unix seconds when `warren ctl` sent it: an instance with a secret refuses it after
    /// [`MAX_SKEW_S`], so a captured copy cannot be replayed later.
    pub issued_at: u64,
    /// Who asked (`host:pid` of the `warren ctl` process).
    pub by: String,
    /// The instance it is meant for, `host:pid/run` (`run` from the instance's hash; `host:pid`
    /// from older `warren ctl`s), so a copy pushed to another instance's list, or to a later
    /// process with the same host and PID, is refused; absent in commands from the oldest.
    pub target: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlCommand::canonical`] under `CONTROL_SECRET`.
    pub signature: Option<String>,
    /// Numbers read beside the command that are not its own; none in a command built here.
    stray: Stray,
}

impl CtlCommand {
    /// A command issued at `issued_at` by `by`, for every pipeline or only `pipeline`, not yet
    /// addressed nor signed.
    pub fn new(
        id: String,
        command: Command,
        pipeline: Option<String>,
        issued_at: u64,
        by: String,
    ) -> Self {
        Self {
            id,
            command,
            pipeline,
            issued_at,
            by,
            target: None,
            signature: None,
            stray: Stray::default(),
        }
    }

    /// The `processors` it carries on the wire: the number of a `scale`, else a stray one.
    pub fn processors(&self) -> Option<usize> {
        match self.command {
            Command::Scale { processors } => Some(processors),
            _ => self.stray.processors,
        }
    }

    /// The `rate` it carries on the wire: the number of a `rate`, else a stray one.
    pub fn rate(&self) -> Option<u32> {
        match self.command {
            Command::Rate { per_s } => Some(per_s),
            _ => self.stray.rate,
        }
    }

    /// The `min` and `max` it carries on the wire: those of a `concurrency`, else stray ones.
    pub fn bounds(&self) -> (Option<usize>, Option<usize>) {
        match self.command {
            Command::Concurrency { min, max } => (min, max),
            _ => (self.stray.min, self.stray.max),
        }
    }

    /// The bytes the signature covers: a version line, then each field as
    /// `name=<byte length>:<value>` and a newline, in this order: `id`, `command`, `processors`
    /// (empty when absent), `rate` and `pipeline` (each only when present, so commands without
    /// them keep the signatures they always had), `issued_at`, `by`, `target` (the instance that
    /// applies it, as `host:pid`). The length prefixes make the encoding unambiguous whatever the values hold.
    pub fn canonical(&self, target: &str) -> Vec<u8> {
        Wire::from(self.clone()).canonical(target)
    }

    /// Addresses the command to `target` (`host:pid/run`) and signs it with `secret`.
    pub fn sign(&mut self, secret: &str, target: &str) -> Result<(), String> {
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

/// A command as it is queued in Redis, field for field and in this order as every `warren ctl`
/// wrote it, and the source of the signed bytes. Named `CtlCommand` for serde, so that the
/// message about an unreadable command reads as it always did.
#[derive(Serialize, Deserialize)]
#[serde(rename = "CtlCommand", expecting = "struct CtlCommand")]
struct Wire {
    /// See [`CtlCommand::id`].
    id: String,
    /// The command's name ([`Command::name`]), whatever it is.
    command: String,
    /// For `scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    processors: Option<usize>,
    /// For `rate`: messages per second, 0 = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rate: Option<u32>,
    /// See [`CtlCommand::pipeline`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pipeline: Option<String>,
    /// See [`CtlCommand::issued_at`].
    issued_at: u64,
    /// See [`CtlCommand::by`].
    by: String,
    /// See [`CtlCommand::target`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target: Option<String>,
    /// See [`CtlCommand::signature`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signature: Option<String>,
    /// For `concurrency`: the new bounds (absent: unchanged). Last, so the sequence form of
    /// older commands reads as it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    min: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max: Option<usize>,
}

impl Wire {
    /// See [`CtlCommand::canonical`].
    fn canonical(&self, target: &str) -> Vec<u8> {
        // No `..`: a new field does not compile until it is added here, so every argument is
        // covered by the signature.
        let Wire {
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
}

impl From<Wire> for CtlCommand {
    fn from(wire: Wire) -> Self {
        let Wire {
            id,
            command,
            processors,
            rate,
            pipeline,
            min,
            max,
            issued_at,
            by,
            target,
            signature,
        } = wire;
        let (command, stray) = Command::read(command, processors, rate, (min, max));
        Self {
            id,
            command,
            pipeline,
            issued_at,
            by,
            target,
            signature,
            stray,
        }
    }
}

impl From<CtlCommand> for Wire {
    fn from(command: CtlCommand) -> Self {
        let (processors, rate) = (command.processors(), command.rate());
        let (min, max) = command.bounds();
        // No `..`: a new field does not compile until it has its place on the wire.
        let CtlCommand {
            id,
            command,
            pipeline,
            issued_at,
            by,
            target,
            signature,
            stray: _,
        } = command;
        Self {
            id,
            command: command.name().to_string(),
            processors,
            rate,
            pipeline,
            min,
            max,
            issued_at,
            by,
            target,
            signature,
        }
    }
}

/// A version line, then each present field as `name=<byte length>:<value>` and a newline: the
/// length prefixes make the encoding unambiguous whatever the values hold.
fn encode<'a>(
    version: &str,
    fields: impl IntoIterator<Item = Option<(&'a str, &'a str)>>,
) -> Vec<u8> {
    let mut out = format!("{version}\n").into_bytes();
    for (name, value) in fields.into_iter().flatten() {
        out.extend_from_slice(format!("{name}={}:", value.len()).as_bytes());
        out.extend_from_slice(value.as_bytes());
        out.push(b'\n');
    }
    out
}

/// The HMAC-SHA256 of `bytes` under `secret`; HMAC accepts keys of any length, so the error
/// only names the setting in case that ever changes.
fn mac(secret: &str, bytes: &[u8]) -> Result<Hmac<Sha256>, String> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes())
        .map_err(|e| format!("CONTROL_SECRET: not usable as an HMAC-SHA256 key ({e})"))?;
    mac.update(bytes);
    Ok(mac)
}

/// Lower-case hex of the HMAC of `bytes` under `secret`.
fn tag(secret: &str, bytes: &[u8]) -> Result<String, String> {
    let tag = mac(secret, bytes)?.finalize().into_bytes();
    Ok(tag.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `signature` (hex, either case) is the HMAC of `bytes` under `secret`, compared in
/// constant time.
fn verifies(secret: &str, bytes: &[u8], signature: Option<&str>) -> bool {
    let Some(tag) = signature.and_then(from_hex) else {
        return false;
    };
    mac(secret, bytes).is_ok_and(|mac| mac.verify_slice(&tag).is_ok())
}

/// Bytes from lower- or upper-case hex; `None` for anything else.
fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Decides which remote commands this instance applies. With a secret, only commands signed
/// for this instance, issued within [`MAX_SKEW_S`] of now and not seen before; without one,
/// every command (as before signing existed).
pub struct Guard {
    /// `CONTROL_SECRET`; `None` when unset.
    secret: Option<String>,
    /// This instance as `host:pid/run`, which the signature must cover.
    me: String,
    /// Ids of the commands already accepted, with their `issued_at`, so a replay is refused;
    /// forgotten once they are too old to pass the freshness check anyway.
    seen: HashMap<String, u64>,
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
    pub fn check(&mut self, command: &CtlCommand, now: u64) -> Result<(), String> {
        let (host_pid, _run) = self.me.split_once('/').unwrap_or((&self.me, ""));
        if let Some(target) = &command.target
            && *target != self.me
        {
            // Without a secret, a command of an older `warren ctl` (`host:pid`) is still taken.
            let older = self.secret.is_none() && target == host_pid;
            if !older {
                let why =
                    if target.split_once('/').map_or(target.as_str(), |(hp, _)| hp) == host_pid {
                        " (meant for another run of this host and PID: an earlier process, or a \
                     command captured and pushed again)"
                    } else {
                        ""
                    };
                return Err(format!(
                    "refused: addressed to {target}, not to this instance ({}){why}",
                    self.me
                ));
            }
        }
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        if command.signature.is_none() {
            return Err(format!(
                "{REFUSED_UNSIGNED}: this instance has CONTROL_SECRET set and accepts only \
                 signed commands (run `warren ctl` with the same CONTROL_SECRET)"
            ));
        }
        if !command.signature_matches(secret, &self.me) {
            return Err(format!(
                "{REFUSED_BAD_SIGNATURE}: not signed with this instance's CONTROL_SECRET for \
                 this instance, or altered on the way"
            ));
        }
        if command.issued_at + MAX_SKEW_S < now {
            return Err(format!(
                "refused: stale command, issued {} s ago (more than {MAX_SKEW_S} s; check the clocks \
                 if it was just sent)",
                now - command.issued_at
            ));
        }
        if command.issued_at > now + MAX_SKEW_S {
            return Err(format!(
                "refused: command from the future, issued {} s ahead of this instance's clock \
                 (more than {MAX_SKEW_S} s; check the clocks)",
                command.issued_at - now
            ));
        }
        // Keep ids while a copy could still pass the freshness check, with a margin for a clock
        // that steps back.
        self.seen
            .retain(|_, issued| *issued + 2 * MAX_SKEW_S >= now);
        if self.seen.contains_key(&command.id) {
            return Err(format!(
                "refused: replay, command {} was already received by this instance",
                command.id
            ));
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
        result: Result<(), String>,
        at: u64,
    ) -> Self {
        Self {
            id: command.id.clone(),
            command: command.command.name().to_string(),
            processors: command.processors(),
            rate: command.rate(),
            pipeline: command.pipeline.clone(),
            detail: match command.bounds() {
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
            error: result.err(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_concurrency_command_carries_its_bounds_signed_and_in_its_outcome() {
        let c = CtlCommand::new(
            "x".into(),
            Command::Concurrency {
                min: Some(2),
                max: None,
            },
            Some("orders".into()),
            1,
            "h:1".into(),
        );
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains(r#""command":"concurrency""#) && json.contains(r#""min":2"#));
        assert!(!json.contains("max"), "{json}");
        let back: CtlCommand = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        let canonical = String::from_utf8(c.canonical("h:2/r")).unwrap();
        assert!(canonical.contains("\nmin=1:2\n"), "{canonical}");
        // A min beside another command is kept (and signed) as it was read, never applied.
        let stray: CtlCommand =
            serde_json::from_str(r#"{"id":"a","command":"pause","issued_at":1,"by":"b","min":3}"#)
                .unwrap();
        assert_eq!(stray.command, Command::Pause);
        assert!(
            serde_json::to_string(&stray)
                .unwrap()
                .contains(r#""min":3"#)
        );
        let o = CtlOutcome::of(&c, recorder(), Ok(()), 5);
        assert_eq!(o.detail.as_deref(), Some("min=2"));
        assert!(
            String::from_utf8(o.canonical())
                .unwrap()
                .contains("detail=5:min=2")
        );
    }

    #[test]
    fn commands_round_trip_as_json() {
        let mut c = CtlCommand::new(
            "x".into(),
            Command::Scale { processors: 4 },
            None,
            1,
            "h:1".into(),
        );
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        c.sign("k", "h:2").unwrap();
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    /// Commands as they may sit in Redis, each with what the code before the typed [`Command`]
    /// made of it (the captured output of that code, not recomputed): the JSON it re-encodes to,
    /// the bytes it signs for `vm:20740/r`, the JSON once signed with `s3cret` for that target,
    /// and the JSON of its `executed` and `failed` outcomes recorded by `vm:20740` (run `r`) at
    /// 1795239400 with the secret `s3cret`. The first nine are what `warren ctl` sends; the rest
    /// are what only a hand in Redis writes: unknown names, missing or stray numbers, a drain
    /// for one pipeline, unknown fields, the sequence form serde also reads.
    #[rustfmt::skip]
    const BEFORE: [[&str; 6]; 21] = [
        [
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"2a4c271339e74d0ced371acf9973e088249eaeed262c8e9d797f59f550034679\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ae4e7ceb445de44b455c6897c413ddcb62e39da1cc23504b1bac3858d681d34a\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9cd3f5e94ab1eacfb15f4e8a81fe105ff696ecd7c2abb5a5cc1a00c1fda5c51a\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"226d73325fe588b23392f037361d5bfcc29fedbc6d8707474ca42d9e6c290575\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9a6c21bb36d4f23870780781a3227ec9586d15731952b15d40eaaa961aa64c8f\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"8767d9c5c21ac40cf752ea30fe28e9fd599cab6e23c6c0237f1f75126db579c6\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=6:resume\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7f05c8a79a3c9816cf25814bedfb6d7cfe05c44ad91d68dda5961eb5e77cc3b4\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"e9be57e1836e7cc462e80bac73f591cdfbb06dfcd0d5feff82219c42f2c60b16\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"3fa270f166e09a757fcb4f8e6bfb9146b76f8904d05d710a4f564a407907cefe\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=6:resume\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7e7568525048e4fb4c8ca7ebfc6ae588acd21cfb2163499bc843b9b6f206d23d\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"26794961f70fbaa945f92b760bfed4f8de81907e74acd3afe3de8f1ce0e366a4\"}",
            "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a4e2fe80faddf1f900fcd42798942cde755380d986c5cbacf61e2d11863136c3\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:drain\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"bbfa8fc9bd891832335f36f6056ac37927464108c3e85fff5f92459cf41f46da\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"18d89cd1000f03c9f54bd2318ea71574a36ceffbb5a9a984a6fc9205012ca9e7\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"98c5e61e8160a6074c70be5b2e61001df82123be336efbf7660192c40ba06c37\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:4\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"776a4b8667931959f0f0ebc536aa5084f400001af0adccefb09b11cbfaef668d\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ae5db5499de1f37b026944bd0c34028dff95706619aa888f51a9bad990fec3cc\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"480fc587045b7507ea0d8145d5fc4263c4d1678c48ac7b5699f48107cdc367cb\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=3:256\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"8ae740e21bfa5219ad90a54f60991f6cf3274ae5df98c333cfd830e93307843b\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"906d2c53e6e99fd8b7176d70b8a89988ee2caab5036306871e97db69cccb8160\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a7aabd1457814c38429d98d5aa775e7a4c29abcc4a5a49e92917a383d2715eed\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"e23b9adcd3cb44fdec8ba8317dcab10282084082388e70961c91e1c0af93c10c\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a4933ba4cfd0662414661eb743958c8b792ef7211b08801e9c7d50b6ce133818\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"000f259a936c5e968a1a26f701d21014ffc5edd84be51c113ace72721c237fcb\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=1:0\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"c71521fabe47e4045ffbaa2cf842894d70f2a0aa85d1669e10a5286d613a4b7a\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"7b1a8a5a589cb7df841a1ca45293043f0209a916194090163286b80fd0256b32\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"f8e8a560ff5c0f280264260094b0b0dc25df577167f9d012b4c62f53706aacb6\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=6:reboot\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"5ec978a3641638f1b3e0796723d4f44a7e20b2be10780a16630efcfd875b90c6\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"4e21ef9c9967ec6082b16a602356a47954bb71575b1917c200f456a83b94bb7c\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"345ecc5aa19607990f9268de4e3deb66e431d0870f41c280f0a960f14f398255\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=6:reboot\nprocessors=1:3\nrate=1:9\npipeline=1:p\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"63bdb37ebcddba986cbf33c934d5e0d3714906c87afe53709a2bd87129e666eb\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a441cf7fa5f9f4077771c217b0145afc4e904af96b99032c9c573af25c037cf5\"}",
            "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"f477abb511530c99818e12800df553ab02771d074dfc3312ee980de5b571665c\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"32c35eea0b7de84f7e43cabaa41faeb3a931337aa33d9afd3753121ed5082a10\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"52ff1e826f14d48ea5caf3fc08f186df2bd4d98a44d2f902f0c5c02710a1ea66\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"1f4720e151f6cc6104c2d820b6ac34ac417f693ab1fee3e1e121ca48a62eb656\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=1:3\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"1e92b21f2e4b70999cd2c45ee022047136a195185094cf52baee19d255064ea9\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"6eac7bc8011ec09d871100a3fdcae5fd3313596e418a887c162378240dd8dd75\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ded21676b8cfcddf970e5f451713992181d2af20c669d93d8a3739d23c345a2b\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=1:4\nrate=1:9\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"29c8600601c49d1b68e6d0f4337d5598075222e665338026047ca7e6da469cb1\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"aa3f7c2ea3641ccb128d377a8fe8c029c323bec5e5afccfb93bb83e5010d4e58\"}",
            "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"46334d80f1f6b05d971773c14a898afdda07a15062cd42d381b97a2e989969c5\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:2\nrate=1:7\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"bc1702e659ccb609e01d78c51afc750d17db8058484c190415b1fe50dd86e79e\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"90509dcdbf0b36603cf954d7f352dbddede32700681c76570cc705bf17c3212b\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"58bf3717d5c3dd5c75198ebd2060c93b038ba9d27960d0fb669df3be12f6ac28\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:drain\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"d09841b6ae3a5a2a24c29fee38458b9950143be0515745804b42e60ab882c9d5\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"161c73d4ca24aa9432e45e6bcb67f512e65942de151d93e60b9601b35b0c2398\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"07920bf381555014ad2036a92eb72e748943e4aa092845b31b49bdc2cdea32e5\"}",
        ],
        [
            "{\"signature\":\"AB\",\"target\":\"vm:1\",\"x\":1,\"by\":\"ops:42\",\"issued_at\":1795239346,\"command\":\"scale\",\"processors\":1,\"id\":\"0b8f\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:1\",\"signature\":\"AB\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:1\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"9f3151aa4eb3b966fe5459f1096ac5b9a9421618163bd682510f0f7916a7d1a5\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"d7cfe0a7994142d393dca3efea7697dbea34afe252d0b2a3050aab9d519a8041\"}",
            "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a902bbfdb676c6e3be4e10c0923cbb9c9b4d200652cbe2b7a2104827fef1965d\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:Pause\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"0fdddb074999e7d5407dbf3008d22be4d20686bb8f08aed796f93bda4d79adb0\"}",
            "{\"id\":\"0b8f\",\"command\":\"Pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9d241b4db7f293a884f3035318522c11141e0e04df5443fbcf8dbf670c5fb4d1\"}",
            "{\"id\":\"0b8f\",\"command\":\"Pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"434999b4454cce3b76b9c51253a53b80723c141c08dcd7d753562bae6d7d26ec\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=0:\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"1ca36774cb3d3922879bd4af71a3dcd9998d2fd7c2d02276f639f1cf76ccefba\"}",
            "{\"id\":\"0b8f\",\"command\":\"\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"1a43c020b82e65f7ca8082a435322aaea369592068f763f2287091af203b3520\"}",
            "{\"id\":\"0b8f\",\"command\":\"\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"b48bc1de1ac8e6e8b45448ea25b1aa40bb8442cd4131cb5be14bb8e938dd3d31\"}",
        ],
        [
            "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"processors\":null,\"rate\":null,\"pipeline\":null,\"target\":null,\"signature\":null,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=7:drain\n\u{1b}\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7d115c8ec38cbac48053443b6f00eb73a34c25c8589184b422a647fa34815635\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"da298f919e7300f367ecbc0b2a73ffe2c89fbccdd1d4a03f8e16f700c06e48a5\"}",
            "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"8ff780c6901e7fab364b8af6c0dd57948fbe3fe2f72e56208507f8003ba44b91\"}",
        ],
        [
            "[\"0b8f\",\"rate\",null,250,\"orders\",1795239346,\"ops:42\"]",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:250\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"652e3870c0782472d858cdd6cbc10625948b4f4677fa49e832f71c23c90e89f7\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"c30987945dc16d488ae38fd5524295ff52a9c217e747e2f47d3797cdf8b7926e\"}",
            "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"e4dfb7252d47a5a6e21c0367a296ac05bb303c776d34c6372e45819f7721cffc\"}",
        ],
    ];

    /// What each of [`BEFORE`] reads as.
    fn read_as() -> [Command; 21] {
        [
            Command::Pause,
            Command::Pause,
            Command::Resume,
            Command::Resume,
            Command::Drain,
            Command::Scale { processors: 4 },
            Command::Scale { processors: 256 },
            Command::Rate { per_s: 500 },
            Command::Rate { per_s: 0 },
            Command::Unknown("reboot".into()),
            Command::Unknown("reboot".into()),
            Command::ScaleWithoutProcessors,
            Command::RateWithoutLimit,
            Command::Pause,
            Command::Scale { processors: 2 },
            Command::Drain,
            Command::Scale { processors: 1 },
            Command::Unknown("Pause".into()),
            Command::Unknown("".into()),
            Command::Unknown("drain\n\u{1b}".into()),
            Command::Rate { per_s: 250 },
        ]
    }

    fn recorder() -> Recorder<'static> {
        Recorder {
            host: "vm",
            pid: 20740,
            run: "r",
        }
    }

    #[test]
    fn every_command_keeps_the_json_signed_bytes_and_outcomes_of_before() {
        let guard = Guard::new("s3cret", "vm:20740/r".into());
        for ([raw, json, canonical, signed, executed, failed], command) in
            BEFORE.iter().zip(read_as())
        {
            let c: CtlCommand = serde_json::from_str(raw).unwrap();
            assert_eq!(c.command, command, "{raw}");
            assert_eq!(serde_json::to_string(&c).unwrap(), *json, "{raw}");
            assert_eq!(
                String::from_utf8(c.canonical("vm:20740/r")).unwrap(),
                *canonical,
                "{raw}"
            );
            let mut s = c.clone();
            s.sign("s3cret", "vm:20740/r").unwrap();
            assert_eq!(serde_json::to_string(&s).unwrap(), *signed, "{raw}");
            // Signed by the code before, it verifies, and survives a round trip unchanged.
            let back: CtlCommand = serde_json::from_str(signed).unwrap();
            assert_eq!(back, s, "{raw}");
            assert!(back.signature_matches("s3cret", "vm:20740/r"), "{raw}");
            assert_eq!(
                Guard::new("s3cret", "vm:20740/r".into()).check(&back, 1_795_239_346),
                Ok(()),
                "{raw}"
            );
            for (result, expected) in [(Ok(()), executed), (Err("x".to_string()), failed)] {
                let mut o = CtlOutcome::of(&c, recorder(), result, 1_795_239_400);
                guard.sign(&mut o);
                assert_eq!(serde_json::to_string(&o).unwrap(), *expected, "{raw}");
                assert!(o.verifies("s3cret"), "{raw}");
            }
        }
    }

    #[test]
    fn ctl_builds_the_commands_it_always_built() {
        let built = [
            (Command::Pause, None),
            (Command::Pause, Some("orders")),
            (Command::Resume, None),
            (Command::Resume, Some("orders")),
            (Command::Drain, None),
            (Command::Scale { processors: 4 }, None),
            (Command::Scale { processors: 256 }, Some("orders")),
            (Command::Rate { per_s: 500 }, None),
            (Command::Rate { per_s: 0 }, Some("orders")),
        ];
        for ((command, pipeline), [_, json, _, signed, ..]) in built.into_iter().zip(BEFORE) {
            let mut c = CtlCommand::new(
                "0b8f".into(),
                command,
                pipeline.map(String::from),
                1_795_239_346,
                "ops:42".into(),
            );
            assert_eq!(serde_json::to_string(&c).unwrap(), json);
            c.sign("s3cret", "vm:20740/r").unwrap();
            assert_eq!(serde_json::to_string(&c).unwrap(), signed);
        }
    }

    #[test]
    fn numbers_that_are_not_the_commands_own_are_kept_but_not_its_own() {
        let c: CtlCommand = serde_json::from_str(BEFORE[13][0]).unwrap();
        assert_eq!(c.command, Command::Pause);
        assert_eq!((c.processors(), c.rate()), (Some(4), Some(9)));
        let mut signed = c.clone();
        signed.sign("k", "vm:1").unwrap();
        let mut dropped = signed.clone();
        dropped.stray = Stray::default();
        assert!(
            !dropped.signature_matches("k", "vm:1"),
            "a stray number is signed"
        );
        // A command set in place of another carries its own number, not the stray one.
        let mut scaled = c.clone();
        scaled.command = Command::Scale { processors: 2 };
        assert_eq!((scaled.processors(), scaled.rate()), (Some(2), Some(9)));
    }

    #[test]
    fn names_are_the_wire_names() {
        for (command, name) in [
            (Command::Pause, "pause"),
            (Command::Resume, "resume"),
            (Command::Drain, "drain"),
            (Command::Scale { processors: 3 }, "scale"),
            (Command::ScaleWithoutProcessors, "scale"),
            (Command::Rate { per_s: 3 }, "rate"),
            (Command::RateWithoutLimit, "rate"),
            (Command::Unknown("Drain".into()), "Drain"),
        ] {
            assert_eq!(command.name(), name);
            assert_eq!(command.to_string(), name);
        }
    }

    #[test]
    fn unreadable_commands_are_refused_with_the_messages_of_before() {
        for (raw, message) in [
            (
                "42",
                "invalid type: integer `42`, expected struct CtlCommand at line 1 column 2",
            ),
            ("{}", "missing field `id` at line 1 column 2"),
            (
                "{\"id\":\"a\",\"command\":5,\"issued_at\":1,\"by\":\"b\"}",
                "invalid type: integer `5`, expected a string at line 1 column 21",
            ),
            (
                "{\"id\":\"a\",\"command\":\"scale\",\"processors\":-1,\"issued_at\":1,\"by\":\"b\"}",
                "invalid value: integer `-1`, expected usize at line 1 column 43",
            ),
            (
                "[1]",
                "invalid type: integer `1`, expected a string at line 1 column 2",
            ),
            (
                "{\"id\":\"a\",\"command\":\"scale\",\"processors\":\"4\",\"issued_at\":1,\"by\":\"b\"}",
                "invalid type: string \"4\", expected usize at line 1 column 44",
            ),
        ] {
            let e = serde_json::from_str::<CtlCommand>(raw).unwrap_err();
            assert_eq!(e.to_string(), message);
        }
    }

    #[test]
    fn commands_of_older_ctls_still_parse() {
        let c: CtlCommand =
            serde_json::from_str(r#"{"id":"x","command":"pause","issued_at":5,"by":"h:1"}"#)
                .unwrap();
        assert_eq!((c.target, c.signature), (None, None));
    }

    #[test]
    fn the_signature_covers_the_pipeline_and_leaves_older_commands_alone() {
        let plain = sample();
        assert!(
            !String::from_utf8(plain.canonical("vm:1"))
                .unwrap()
                .contains("pipeline"),
            "a command without --pipeline signs as before"
        );
        let mut c = sample();
        c.pipeline = Some("orders".into());
        assert!(
            String::from_utf8(c.canonical("vm:1"))
                .unwrap()
                .contains("\npipeline=6:orders\n")
        );
        c.sign("k", "vm:1/r").unwrap();
        assert!(c.signature_matches("k", "vm:1/r"));
        let mut moved = c.clone();
        moved.pipeline = Some("users".into());
        assert!(!moved.signature_matches("k", "vm:1/r"), "pipeline changed");
        let mut widened = c.clone();
        widened.pipeline = None;
        assert!(
            !widened.signature_matches("k", "vm:1/r"),
            "pipeline dropped"
        );
    }

    fn sample() -> CtlCommand {
        CtlCommand::new(
            "0b8f".into(),
            Command::Scale { processors: 4 },
            None,
            1_795_239_346,
            "ops:42".into(),
        )
    }

    #[test]
    fn the_canonical_encoding_and_signature_are_the_documented_ones() {
        let c = sample();
        assert_eq!(
            String::from_utf8(c.canonical("vm:20740")).unwrap(),
            "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:4\n\
             issued_at=10:1795239346\nby=6:ops:42\ntarget=8:vm:20740\n"
        );
        // Computed independently (Python's hmac module over the bytes above).
        let mut signed = c.clone();
        signed.sign("s3cret", "vm:20740").unwrap();
        assert_eq!(signed.target.as_deref(), Some("vm:20740"));
        assert_eq!(
            signed.signature.as_deref(),
            Some("6c14c808b9ddffaed54779e9a952a26961fa099c52957be11545e8033fd069ce")
        );
        assert!(signed.signature_matches("s3cret", "vm:20740"));
        let mut upper = signed.clone();
        upper.signature = upper.signature.map(|s| s.to_uppercase());
        assert!(upper.signature_matches("s3cret", "vm:20740"));
    }

    #[test]
    fn the_signature_covers_every_field_and_the_target() {
        let mut signed = sample();
        signed.sign("k", "vm:1").unwrap();
        assert!(signed.signature_matches("k", "vm:1"));
        assert!(!signed.signature_matches("other", "vm:1"), "another secret");
        assert!(!signed.signature_matches("k", "vm:2"), "another target");
        let altered: [fn(&mut CtlCommand); 6] = [
            |c| c.id.push('x'),
            |c| c.command = Command::Drain,
            |c| c.command = Command::Scale { processors: 5 },
            |c| c.command = Command::ScaleWithoutProcessors,
            |c| c.issued_at += 1,
            |c| c.by = "someone:1".into(),
        ];
        for (i, alter) in altered.iter().enumerate() {
            let mut c = signed.clone();
            alter(&mut c);
            assert!(!c.signature_matches("k", "vm:1"), "alteration {i} verified");
        }
        // Field boundaries cannot be moved: "ab" + "c" differs from "a" + "bc".
        let (mut a, mut b) = (sample(), sample());
        (a.id, a.command) = ("ab".into(), Command::Unknown("c".into()));
        (b.id, b.command) = ("a".into(), Command::Unknown("bc".into()));
        assert_ne!(a.canonical("t"), b.canonical("t"));
        for bad in ["", "zz", "abc", "6c14"] {
            let mut c = signed.clone();
            c.signature = Some(bad.into());
            assert!(!c.signature_matches("k", "vm:1"), "{bad:?}");
        }
    }

    #[test]
    fn the_rate_joins_the_signed_encoding_only_when_present() {
        let mut c = sample();
        c.command = Command::Rate { per_s: 500 };
        assert_eq!(
            String::from_utf8(c.canonical("vm:1")).unwrap(),
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\n\
             issued_at=10:1795239346\nby=6:ops:42\ntarget=4:vm:1\n"
        );
        c.sign("k", "vm:1").unwrap();
        for altered in [Some(5000), Some(0), None] {
            let mut other = c.clone();
            other.command =
                altered.map_or(Command::RateWithoutLimit, |per_s| Command::Rate { per_s });
            assert!(!other.signature_matches("k", "vm:1"), "{altered:?}");
        }
        assert!(c.signature_matches("k", "vm:1"));
    }

    fn signed(id: &str, issued_at: u64, secret: &str, target: &str) -> CtlCommand {
        let mut c = sample();
        c.id = id.into();
        c.issued_at = issued_at;
        c.sign(secret, target).unwrap();
        c
    }

    #[test]
    fn the_guard_refuses_unsigned_forged_stale_future_replayed_and_redirected_commands() {
        let now = 1_000_000;
        let mut guard = Guard::new("k", "vm:1".into());
        assert_eq!(guard.check(&signed("a", now, "k", "vm:1"), now), Ok(()));
        // The edges of the window are accepted.
        assert_eq!(
            guard.check(&signed("b", now - 120, "k", "vm:1"), now),
            Ok(())
        );
        assert_eq!(
            guard.check(&signed("c", now + 120, "k", "vm:1"), now),
            Ok(())
        );

        let refused = |guard: &mut Guard, c: &CtlCommand| guard.check(c, now).unwrap_err();
        let e = refused(&mut guard, &sample());
        assert!(
            e.starts_with(REFUSED_UNSIGNED) && e.contains("CONTROL_SECRET"),
            "{e}"
        );
        let e = refused(&mut guard, &signed("d", now, "wrong", "vm:1"));
        assert!(e.starts_with(REFUSED_BAD_SIGNATURE), "{e}");
        let e = refused(&mut guard, &signed("e", now - 121, "k", "vm:1"));
        assert!(e.contains("stale") && e.contains("121 s ago"), "{e}");
        let e = refused(&mut guard, &signed("f", now + 121, "k", "vm:1"));
        assert!(e.contains("future") && e.contains("121 s"), "{e}");
        let e = refused(&mut guard, &signed("a", now, "k", "vm:1"));
        assert!(e.contains("replay") && e.contains('a'), "{e}");
        // Signed for another instance: its target says so; without the field the signature
        // still does not verify.
        let mut other = signed("g", now, "k", "vm:2");
        let e = refused(&mut guard, &other);
        assert!(e.contains("addressed to vm:2"), "{e}");
        other.target = None;
        assert!(refused(&mut guard, &other).starts_with(REFUSED_BAD_SIGNATURE));
        // Refusals do not mark an id as seen; a valid copy still goes through once.
        assert_eq!(guard.check(&signed("d", now, "k", "vm:1"), now), Ok(()));

        // Ids are forgotten only once a copy would be refused as stale anyway.
        let later = now + 241;
        assert!(
            guard
                .check(&signed("a", now, "k", "vm:1"), later)
                .unwrap_err()
                .contains("stale")
        );
        assert_eq!(guard.check(&signed("h", later, "k", "vm:1"), later), Ok(()));
        assert!(!guard.seen.contains_key("a"));
    }

    #[test]
    fn a_command_signed_for_an_earlier_run_of_the_same_host_and_pid_is_refused() {
        let now = 1_000_000;
        // The first process, PID 1 in its container, accepts a command signed for its run...
        let mut first = Guard::new("k", "vm:1/run-a".into());
        let captured = signed("a", now, "k", "vm:1/run-a");
        assert_eq!(first.check(&captured, now), Ok(()));
        // ...the process after a restart (same host, same PID, empty memory of ids) does not,
        // nor a command signed for the bare `host:pid` (as captured before runs existed).
        let mut second = Guard::new("k", "vm:1/run-b".into());
        let e = second.check(&captured, now + 15).unwrap_err();
        assert!(
            e.contains("addressed to vm:1/run-a") && e.contains("another run"),
            "{e}"
        );
        let e = second
            .check(&signed("b", now, "k", "vm:1"), now)
            .unwrap_err();
        assert!(e.contains("another run"), "{e}");
        // Its target rewritten to this run: the signature does not verify.
        let mut redirected = captured.clone();
        redirected.target = Some("vm:1/run-b".into());
        assert!(
            second
                .check(&redirected, now)
                .unwrap_err()
                .starts_with(REFUSED_BAD_SIGNATURE)
        );
        assert_eq!(
            second.check(&signed("c", now, "k", "vm:1/run-b"), now),
            Ok(())
        );
        // Without a secret, the bare `host:pid` of older `warren ctl`s still reaches it.
        let mut open = Guard::new("", "vm:1/run-b".into());
        assert_eq!(open.check(&signed("d", now, "", "vm:1"), now), Ok(()));
    }

    #[test]
    fn outcomes_are_signed_over_every_field_and_verified() {
        let guard = Guard::new("k", "vm:1/r".into());
        let mut o = CtlOutcome {
            id: "0b8f".into(),
            command: "pause".into(),
            processors: None,
            rate: None,
            pipeline: None,
            detail: None,
            host: "vm".into(),
            pid: 1,
            outcome: "executed".into(),
            error: None,
            at: 1_795_239_346,
            run: Some("r".into()),
            signature: None,
        };
        assert_eq!(
            String::from_utf8(o.canonical()).unwrap(),
            "warren-outcome-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\nrate=0:\nhost=2:vm\n\
             pid=1:1\nrun=1:r\noutcome=8:executed\nerror=0:\nat=10:1795239346\n"
        );
        assert!(!o.verifies("k"), "unsigned");
        guard.sign(&mut o);
        assert!(o.verifies("k"));
        assert!(!o.verifies("other"));
        let altered: [fn(&mut CtlOutcome); 6] = [
            |o| o.outcome = "failed".into(),
            |o| o.error = Some("x".into()),
            |o| o.pid = 2,
            |o| o.run = None,
            |o| o.at += 1,
            |o| o.id.push('x'),
        ];
        for alter in altered {
            let mut copy = o.clone();
            alter(&mut copy);
            assert!(!copy.verifies("k"), "{copy:?}");
        }
        let mut unsigned = o.clone();
        Guard::new("", "vm:1/r".into()).sign(&mut unsigned);
        assert!(
            unsigned.signature == o.signature,
            "no secret leaves it as it was"
        );
    }

    #[test]
    fn without_a_secret_every_command_is_accepted_as_before() {
        let mut guard = Guard::new("", "vm:1".into());
        assert_eq!(guard.check(&sample(), 0), Ok(()));
        assert_eq!(guard.check(&sample(), u64::MAX / 2), Ok(()));
        assert_eq!(guard.check(&signed("x", 0, "whatever", "vm:1"), 0), Ok(()));
        let e = guard.check(&signed("x", 0, "k", "vm:2"), 0).unwrap_err();
        assert!(e.contains("addressed to vm:2"), "{e}");
    }
}
