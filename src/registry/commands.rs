//! The signed remote commands: what `warren ctl` queues, the bytes its signature covers, the
//! [`Guard`] that decides which ones an instance applies, and the signed outcomes it records.
//!
//! Remote commands are signed with HMAC-SHA256 under `CONTROL_SECRET` over a canonical
//! encoding of every field and the target instance ([`CtlCommand::canonical`]); the target names
//! the instance's run (`host:pid/run`, a random id drawn at start and published in its hash), so
//! a command captured for one process is refused by a later one with the same host and PID (PID 1
//! in every container). [`Guard`] refuses unsigned, badly signed, stale, future, replayed and
//! misaddressed ones. Outcomes are signed the same way ([`CtlOutcome::canonical`]), so a line
//! written into the history by anyone who can write to Redis does not pass for an instance's.

use std::collections::HashMap;

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// A signed command issued further than this from the instance's clock is refused.
pub const MAX_SKEW_S: u64 = 120;
/// Start of the error of a command refused for carrying no signature.
pub const REFUSED_UNSIGNED: &str = "refused: unsigned command";
/// Start of the error of a command refused for a signature that does not verify.
pub const REFUSED_BAD_SIGNATURE: &str = "refused: bad signature";

/// A remote-control command, as queued for one instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtlCommand {
    /// Shared by the copies sent to several instances, to find their outcomes.
    pub id: String,
    /// `pause`, `resume`, `drain`, `scale` or `rate`.
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
    /// [`MAX_SKEW_S`], so a captured copy cannot be replayed later.
    pub issued_at: u64,
    /// Who asked (`host:pid` of the `warren ctl` process).
    pub by: String,
    /// The instance it is meant for, `host:pid/run` (`run` from the instance's hash; `host:pid`
    /// from older `warren ctl`s), so a copy pushed to another instance's list, or to a later
    /// process with the same host and PID, is refused; absent in commands from the oldest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlCommand::canonical`] under `CONTROL_SECRET`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl CtlCommand {
    /// The bytes the signature covers: a version line, then each field as
    /// `name=<byte length>:<value>` and a newline, in this order: `id`, `command`, `processors`
    /// (empty when absent), `rate` and `pipeline` (each only when present, so commands without
    /// them keep the signatures they always had), `issued_at`, `by`, `target` (the instance that
    /// applies it, as `host:pid`). The length prefixes make the encoding unambiguous whatever the values hold.
    pub fn canonical(&self, target: &str) -> Vec<u8> {
        // No `..`: a new field does not compile until it is added here, so every argument is
        // covered by the signature.
        let CtlCommand {
            id,
            command,
            processors,
            rate,
            pipeline,
            issued_at,
            by,
            target: _,
            signature: _,
        } = self;
        let processors = processors.map(|n| n.to_string()).unwrap_or_default();
        let rate = rate.map(|n| n.to_string());
        let issued_at = issued_at.to_string();
        encode(
            "warren-ctl-v1",
            [
                Some(("id", id.as_str())),
                Some(("command", command.as_str())),
                Some(("processors", processors.as_str())),
                rate.as_deref().map(|r| ("rate", r)),
                pipeline.as_deref().map(|p| ("pipeline", p)),
                Some(("issued_at", issued_at.as_str())),
                Some(("by", by.as_str())),
                Some(("target", target)),
            ],
        )
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
    /// The run of the instance that recorded it (see [`Instance::run`](super::Instance::run));
    /// absent from older ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Lower-case hex HMAC-SHA256 of [`CtlOutcome::canonical`] under `CONTROL_SECRET`, when the
    /// instance has one: a `warren ctl` with the secret believes only outcomes that verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl CtlOutcome {
    /// The bytes the signature covers, encoded as commands are (see [`CtlCommand::canonical`])
    /// under the version line `warren-outcome-v1`: `id`, `command`, `processors` and `rate`
    /// (empty when absent), `pipeline` (only when present), `host`, `pid`, `run`, `outcome`,
    /// `error` (empty when absent), `at`.
    pub fn canonical(&self) -> Vec<u8> {
        let CtlOutcome {
            id,
            command,
            processors,
            rate,
            pipeline,
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
    fn commands_round_trip_as_json() {
        let mut c = CtlCommand {
            id: "x".into(),
            command: "scale".into(),
            processors: Some(4),
            rate: None,
            pipeline: None,
            issued_at: 1,
            by: "h:1".into(),
            target: None,
            signature: None,
        };
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        c.sign("k", "h:2").unwrap();
        let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
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
        CtlCommand {
            id: "0b8f".into(),
            command: "scale".into(),
            processors: Some(4),
            rate: None,
            pipeline: None,
            issued_at: 1_795_239_346,
            by: "ops:42".into(),
            target: None,
            signature: None,
        }
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
            |c| c.command = "drain".into(),
            |c| c.processors = Some(5),
            |c| c.processors = None,
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
        (a.id, a.command) = ("ab".into(), "c".into());
        (b.id, b.command) = ("a".into(), "bc".into());
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
        (c.command, c.processors, c.rate) = ("rate".into(), None, Some(500));
        assert_eq!(
            String::from_utf8(c.canonical("vm:1")).unwrap(),
            "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\n\
             issued_at=10:1795239346\nby=6:ops:42\ntarget=4:vm:1\n"
        );
        c.sign("k", "vm:1").unwrap();
        for altered in [Some(5000), Some(0), None] {
            let mut other = c.clone();
            other.rate = altered;
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
