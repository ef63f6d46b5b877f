//! Deploying warren: the systemd unit (deploy/systemd/warren@.service) passes `systemd-analyze
//! verify` and its offline security review, the example env file is a valid configuration,
//! `warren run` tells systemd READY=1 once its roles are up and STOPPING=1 on SIGTERM (run
//! under memory-deny-write-execute, as the unit runs it), and the shell completions and man
//! pages generate.
//!
//! systemd-analyze comes with Debian's `systemd` package (`scripts/setup.sh --with-promtool`
//! installs it when it is missing); without it the unit tests fail and say so.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::ops::{repo_path, start_without_wx};
use common::*;

const UNIT: &str = "deploy/systemd/warren@.service";
const ENV_EXAMPLE: &str = "deploy/systemd/warren.env.example";
/// Where the unit expects the binary (docs/deploying.md "Install").
const INSTALLED_BIN: &str = "/usr/local/bin/warren";

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo_path(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// `systemd-analyze args...` with `MANPATH` set, which must be installed.
fn systemd_analyze(args: &[&str], manpath: &Path) -> Output {
    let out = Command::new("systemd-analyze")
        .args(args)
        .env("MANPATH", manpath)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output();
    match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "systemd-analyze is not installed: run `scripts/setup.sh --with-promtool` \
             (it installs Debian's `systemd` package when systemd-analyze is missing)"
        ),
        Err(e) => panic!("cannot run systemd-analyze: {e}"),
    }
}

/// A copy of the unit as the instance `warren@ci.service` in a temporary directory, its
/// ExecStart pointing at the binary under test (systemd-analyze checks that it exists), and a
/// MANPATH holding `warren man`'s page (it checks `Documentation=man:warren(1)` too).
fn unit_copy() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let text = read(UNIT);
    assert!(
        text.contains(&format!("ExecStart={INSTALLED_BIN} run")),
        "{UNIT} runs `{INSTALLED_BIN} run` (the path docs/deploying.md \"Install\" installs to)"
    );
    let copy = text.replace(INSTALLED_BIN, BIN);
    let unit = dir.path().join("warren@ci.service");
    std::fs::write(&unit, copy).expect("write the unit copy");
    let man1 = dir.path().join("man/man1");
    std::fs::create_dir_all(&man1).expect("man dir");
    let page = warren(&["man"], &[]);
    assert!(page.status.success(), "warren man: {page:?}");
    std::fs::write(man1.join("warren.1"), &page.stdout).expect("write warren.1");
    (dir, unit)
}

/// Runs the built `warren args...` with `vars` set (nothing else of warren's inherited).
fn warren(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (key, _) in std::env::vars() {
        if key.starts_with("AMQP_")
            || key.starts_with("DATABASE_")
            || key == "ROLES"
            || key == "WARREN_CONFIG"
        {
            cmd.env_remove(key);
        }
    }
    cmd.envs(vars.iter().copied());
    cmd.output().expect("run warren")
}

/// The unit's `Key=value` lines of its `[Service]` section (a key set twice keeps both values).
fn service_settings() -> BTreeMap<String, Vec<String>> {
    let mut settings: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut in_service = false;
    for line in read(UNIT).lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_service = line == "[Service]";
        } else if in_service
            && !line.starts_with('#')
            && let Some((key, value)) = line.split_once('=')
        {
            settings
                .entry(key.to_string())
                .or_default()
                .push(value.to_string());
        }
    }
    settings
}

// ---- the unit ---------------------------------------------------------------------------------

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let (dir, unit) = unit_copy();
    let out = systemd_analyze(
        &["verify", unit.to_str().expect("UTF-8 path")],
        &dir.path().join("man"),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify {UNIT} (as warren@ci.service, ExecStart={BIN}): exit {:?}\n{}{stderr}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn systemd_analyze_verify_catches_a_broken_copy() {
    // The check above is only worth something if verify complains about a bad unit.
    let (dir, unit) = unit_copy();
    let text = std::fs::read_to_string(&unit).expect("read copy");
    std::fs::write(&unit, text.replace("PrivateTmp=yes", "PrivateTmpp=yes")).expect("write");
    let out = systemd_analyze(
        &["verify", unit.to_str().expect("UTF-8 path")],
        &dir.path().join("man"),
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("PrivateTmpp"),
        "verify said nothing of an unknown key: {out:?}"
    );
}

#[test]
fn systemd_analyze_security_rates_the_unit_ok() {
    let (dir, unit) = unit_copy();
    let out = systemd_analyze(
        &[
            "security",
            "--offline=true",
            "--no-pager",
            unit.to_str().expect("UTF-8 path"),
        ],
        &dir.path().join("man"),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let exposure: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for warren@ci.service:")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure level in:\n{text}"));
    assert!(
        exposure <= 2.0,
        "exposure {exposure} (0 best, 10 worst): the hardening of {UNIT} got weaker:\n{text}"
    );
}

#[test]
fn the_unit_runs_one_notify_instance_per_env_file_hardened() {
    let s = service_settings();
    let one = |key: &str| -> String {
        match s.get(key).map(Vec::as_slice) {
            Some([value]) => value.clone(),
            other => panic!("{UNIT}: {key} should be set once, found {other:?}"),
        }
    };
    assert_eq!(one("Type"), "notify");
    assert_eq!(one("EnvironmentFile"), "/etc/warren/%i.env");
    assert_eq!(one("Restart"), "on-failure");
    assert_eq!(one("KillSignal"), "SIGTERM");
    assert_eq!(one("User"), "warren");
    // The stop timeout outlasts the default graceful shutdown plus the API and registry close.
    let default_shutdown_ms: u64 = read("config/default.toml")
        .lines()
        .find_map(|l| l.trim().strip_prefix("shutdown_timeout_ms"))
        .and_then(|rest| rest.trim().trim_start_matches('=').split('#').next())
        .and_then(|v| v.trim().parse().ok())
        .expect("shutdown_timeout_ms in config/default.toml");
    let stop_s: u64 = one("TimeoutStopSec")
        .parse()
        .expect("TimeoutStopSec in seconds");
    assert!(
        stop_s * 1000 >= default_shutdown_ms + 15_000,
        "TimeoutStopSec={stop_s} leaves no room after SHUTDOWN_TIMEOUT_MS={default_shutdown_ms}"
    );
    for (key, value) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
    ] {
        assert_eq!(one(key), value, "{UNIT}: {key}");
    }
    assert!(
        s.get("SystemCallFilter")
            .is_some_and(|v| v.iter().any(|f| f == "@system-service")),
        "{UNIT}: SystemCallFilter=@system-service"
    );
}

#[test]
fn the_example_env_file_is_a_valid_configuration() {
    let text = read(ENV_EXAMPLE);
    // Every KEY=VALUE line, the commented-out ones too (RUST_LOG is not a setting).
    let vars: Vec<(String, String)> = text
        .lines()
        .map(str::trim)
        // `#KEY=value` is a setting commented out; `# text` is prose.
        .filter_map(|l| match l.strip_prefix('#') {
            Some(rest) if rest.starts_with(' ') || rest.is_empty() => None,
            Some(rest) => Some(rest),
            None => Some(l),
        })
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| {
            !k.is_empty()
                && k.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && *k != "RUST_LOG"
        })
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert!(vars.len() >= 6, "{ENV_EXAMPLE}: {vars:?}");
    let refs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let out = warren(&["config"], &refs);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "warren config with {ENV_EXAMPLE}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (key, _) in &vars {
        assert!(
            printed.contains(&format!("{} =", key.to_lowercase())),
            "{ENV_EXAMPLE}: {key} is not a setting warren knows:\n{printed}"
        );
    }
    assert!(
        printed.contains(r#"roles = "consumer,dlq,api""#),
        "{printed}"
    );
    assert!(
        !printed.contains("CHANGE-ME"),
        "passwords are redacted:\n{printed}"
    );
}

// ---- sd_notify ----------------------------------------------------------------------------------

/// The next datagram on `socket`, as text; panics with warren's log after `timeout`.
async fn next_notification(
    socket: &tokio::net::UnixDatagram,
    warren: &Warren,
    what: &str,
    timeout: Duration,
) -> String {
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(timeout, socket.recv(&mut buf)).await {
        Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n]).into_owned(),
        Ok(Err(e)) => panic!("reading the notify socket: {e}"),
        Err(_) => panic!(
            "no {what} notification within {timeout:?}; log:\n{}",
            warren.logs()
        ),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_notifies_ready_once_up_and_stopping_on_sigterm_without_wx_memory() {
    let mut env = TestEnv::new("notify").await;
    env.declare();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    env.set("NOTIFY_SOCKET", path.to_str().expect("UTF-8 path"));

    // Run as the unit runs it: no memory may become writable and executable.
    let mut warren = start_without_wx(&env, &["--roles", "consumer,dlq,api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let ready = next_notification(&socket, &warren, "READY=1", Duration::from_secs(60)).await;
    assert_eq!(ready.trim(), "READY=1", "the first notification");
    // Ready means the roles are up: the API and the metrics endpoint answer at once.
    let health = http(&env, "GET", "/healthz", None).await;
    assert!(
        matches!(health, Some((200, _))),
        "/healthz right after READY=1: {health:?}"
    );
    assert!(
        scrape_text(&env).await.is_ok(),
        "/metrics right after READY=1"
    );
    // And the pipeline works: a user goes through the broker into its row.
    let ids = env.publish_users(5).await;
    wait_until("5 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 5
    })
    .await;
    assert_eq!(env.row_ids().await, ids.into_iter().collect());

    warren.signal("TERM");
    let stopping = next_notification(&socket, &warren, "STOPPING=1", Duration::from_secs(30)).await;
    assert_eq!(
        stopping.trim(),
        "STOPPING=1",
        "the notification after SIGTERM"
    );
    let status = warren.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "log:\n{}", warren.logs());
    assert!(
        !warren.logs().contains("cannot tell systemd"),
        "{}",
        warren.logs()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_notify_socket_is_a_warning_not_a_failure() {
    let mut env = TestEnv::new("notify_gone").await;
    env.declare();
    env.set("NOTIFY_SOCKET", "/nonexistent/warren-notify.sock");
    let mut warren = env.start(&["--roles", "api"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log(
            "the warning in the log",
            "cannot tell systemd (NOTIFY_SOCKET) that warren is ready",
        )
        .await;
    assert!(
        matches!(http(&env, "GET", "/healthz", None).await, Some((200, _))),
        "warren serves anyway"
    );
    warren.terminate_ok(Duration::from_secs(30));
}

// ---- completions and man pages ------------------------------------------------------------------

const SUBCOMMANDS: [&str; 9] = [
    "run",
    "declare",
    "publish",
    "config",
    "status",
    "ctl",
    "dlq",
    "completions",
    "man",
];

#[test]
fn completions_are_generated_for_bash_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let out = warren(&["completions", shell], &[]);
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "warren completions {shell}: {out:?}");
        assert!(
            script.len() > 1000,
            "{shell}: a script this short? {script}"
        );
        for sub in SUBCOMMANDS {
            assert!(
                script.contains(sub),
                "{shell} completions lack {sub}:\n{script}"
            );
        }
    }
    let out = warren(&["completions", "tcsh"], &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

#[test]
fn the_bash_completion_registers_and_completes_subcommands() {
    let out = warren(&["completions", "bash"], &[]);
    assert!(out.status.success());
    let dir = tempfile::tempdir().expect("temp dir");
    let script = dir.path().join("warren.bash");
    std::fs::write(&script, &out.stdout).expect("write script");
    // Load it, complete `warren dl<TAB>` and `warren dlq <TAB>`.
    let probe = format!(
        r#"source {}; complete -p warren;
           COMP_WORDS=(warren dl); COMP_CWORD=1; COMP_LINE="warren dl"; COMP_POINT=9;
           _warren warren dl warren; echo "one: ${{COMPREPLY[*]}}";
           COMP_WORDS=(warren dlq ""); COMP_CWORD=2; COMP_LINE="warren dlq "; COMP_POINT=11;
           _warren warren "" dlq; echo "two: ${{COMPREPLY[*]}}""#,
        script.display()
    );
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", &probe])
        .output()
        .expect("run bash");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("-F _warren warren"), "{text}");
    assert!(text.contains("one: dlq"), "{text}");
    for sub in ["inspect", "replay", "parked"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("two:") && l.contains(sub)),
            "`warren dlq <TAB>` does not offer {sub}: {text}"
        );
    }
}

#[test]
fn man_pages_are_generated_and_render() {
    let out = warren(&["man"], &[]);
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "warren man: {out:?}");
    assert!(page.contains(".TH warren 1"), "{page}");
    for sub in SUBCOMMANDS {
        assert!(
            page.contains(&format!("warren\\-{sub}(1)")),
            "warren(1) lacks {sub}:\n{page}"
        );
    }
    let run = warren(&["man", "run"], &[]);
    let run_page = String::from_utf8_lossy(&run.stdout);
    assert!(run_page.contains(".TH warren-run 1"), "{run_page}");
    assert!(run_page.contains("\\-\\-declare"), "{run_page}");
    let parked = warren(&["man", "dlq", "parked"], &[]);
    assert!(String::from_utf8_lossy(&parked.stdout).contains(".TH warren-dlq-parked 1"));
    let unknown = warren(&["man", "nope"], &[]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no subcommand \"nope\""),
        "{unknown:?}"
    );

    // groff renders both pages that carry the ENVIRONMENT section without a warning (a long
    // default such as a URL must not break justification).
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, roff, heading) in [
        ("warren.1", &out.stdout, "SUBCOMMANDS"),
        ("warren-run.1", &run.stdout, "ENVIRONMENT"),
    ] {
        let file = dir.path().join(name);
        std::fs::write(&file, roff).expect("write page");
        let rendered = Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-P-c", "-P-b", "-P-o", "-P-u"])
            .arg(&file)
            .output();
        match rendered {
            Ok(r) => {
                assert!(r.status.success(), "groff: {r:?}");
                let stderr = String::from_utf8_lossy(&r.stderr);
                assert!(
                    stderr.trim().is_empty(),
                    "groff warnings in {name}: {stderr}"
                );
                assert!(String::from_utf8_lossy(&r.stdout).contains(heading));
            }
            Err(e) => panic!("groff (Debian's groff-base, which `man` needs) cannot run: {e}"),
        }
    }
}

#[test]
fn completions_and_man_need_no_valid_settings() {
    let bad = [("USERS_BATCH_SIZE", "abc")];
    let config = warren(&["config"], &bad);
    assert_eq!(
        config.status.code(),
        Some(2),
        "a bad setting stops `config`"
    );
    for args in [&["completions", "bash"][..], &["man"][..]] {
        let out = warren(args, &bad);
        assert!(
            out.status.success() && !out.stdout.is_empty(),
            "warren {args:?} with a bad setting: {out:?}"
        );
    }
}
