//! Where the logs go and what they say: `warren run` keeps working, drains and records its
//! shutdown when its stderr (and stdout) is a pipe whose reader has gone; subcommands other than
//! `run` log warnings and errors only unless `RUST_LOG` says otherwise; colours only on a
//! terminal, never with `NO_COLOR`.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use uuid::Uuid;

/// `warren run 2>&1 | tee run.log`, then `tee` dies: warren's stderr and stdout are pipes whose
/// reader closes while debug lines keep coming. It must go on consuming (the messages published
/// after the pipe closed are inserted), and on SIGTERM drain, write its shutdown record to Redis,
/// remove its registry key and exit 0. Before the fix, the first line written after the close
/// panicked (`failed printing to stderr: Broken pipe`): the consumer's task died silently, the
/// rows never came, and the shutdown ended in exit 101 with the key left behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_closed_log_pipe_neither_stops_the_pipeline_nor_the_shutdown() {
    let mut env = TestEnv::new("log_pipe").await;
    let _redis = RedisCleanup::new(&env);
    // Debug lines on every batch, so that lines keep coming after the reader has gone.
    env.set("RUST_LOG", "debug,lapin=off");
    env.set("REGISTRY_HEARTBEAT_MS", "500");
    env.declare();

    // What warren wrote before the pipe closed goes to a file, for the failure messages.
    let log = env.log_path();
    let mut child = env
        .command(&["run", "--roles", "consumer,dlq"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    let stdout = child.stdout.take().expect("stdout pipe");
    let stderr = child.stderr.take().expect("stderr pipe");
    let mut warren = Warren::new(child, log.clone());
    let _logs = LogsOnPanic(vec![log.clone()]);
    drop(stdout); // nobody reads stdout either

    // Copy the log to a file until the first rows are in, then close the pipe: the reader
    // stops at the next line (the database probe logs one every 5 s at debug).
    let close = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let copy = log.clone();
    let reader = std::thread::spawn({
        let close = close.clone();
        move || {
            let mut file = std::fs::File::create(&copy).expect("log copy");
            let mut lines = BufReader::new(stderr).lines();
            while let Some(Ok(line)) = lines.next() {
                let _ = writeln!(file, "{line}");
                if close.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
            }
            // `lines`, the only reader, is dropped here: the pipe is closed.
        }
    });
    let first: HashSet<Uuid> = env.publish_users(20).await.into_iter().collect();
    assert_rows_exactly(&env, &first, Duration::from_secs(60), &|| {
        std::fs::read_to_string(&log).unwrap_or_default()
    })
    .await;
    close.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::task::spawn_blocking(move || reader.join())
        .await
        .expect("join")
        .expect("reader");

    // Every log line from now on fails with EPIPE; the pipeline must not care.
    let mut all = first.clone();
    all.extend(env.publish_users(50).await);
    assert_rows_exactly(&env, &all, Duration::from_secs(60), &|| {
        std::fs::read_to_string(&log).unwrap_or_default()
    })
    .await;
    assert!(warren.is_running(), "warren died with its log pipe");
    // The lines it could not write are counted.
    wait_until(
        "warren_log_lines_dropped_total > 0",
        Duration::from_secs(30),
        || async { metric(&env, "warren_log_lines_dropped_total", &[]).await > 0.0 },
    )
    .await;
    let pid = warren.pid();
    wait_until(
        "the instance is registered",
        Duration::from_secs(30),
        || async { !instance(&env, pid).await.is_null() },
    )
    .await;

    let status = warren.terminate(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let records = shutdowns(&env).await;
    assert!(
        records
            .iter()
            .any(|r| r["pid"].as_i64() == Some(i64::from(pid))),
        "no shutdown record for pid {pid}: {records:?}"
    );
    assert!(
        instance(&env, pid).await.is_null(),
        "the registry key {} was left behind",
        instance_key(&env, pid)
    );
}

/// Found by the review: a log reader that is alive but stops reading (a paused `| less`, a
/// stalled shipper) filled the pipe, and every thread that logged blocked on it: no inserts,
/// `/metrics` silent, the heartbeat stopped. Lines now go through a bounded queue on a thread of
/// their own; with the pipe full they are dropped and counted, and the pipeline keeps moving.
#[tokio::test(flavor = "multi_thread")]
async fn a_log_reader_that_stops_reading_never_stops_the_pipeline() {
    let mut env = TestEnv::new("log_stalled").await;
    env.set("RUST_LOG", "debug,lapin=off");
    env.declare();
    let log = env.log_path();
    let mut child = env
        .command(&["run", "--roles", "consumer,dlq"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    // Held open and never read: once its 64 KiB are full, a write to it blocks.
    let stalled = child.stderr.take().expect("stderr pipe");
    let mut warren = Warren::new(child, log.clone());
    // Each refused message logs lines at warn: far more than the pipe holds.
    for i in 0..3000 {
        env.publish_raw(
            format!("not json {i} {}", "x".repeat(200)).as_bytes(),
            lapin::BasicProperties::default(),
        )
        .await;
    }
    let ids: HashSet<Uuid> = env.publish_users(500).await.into_iter().collect();
    assert_rows_exactly(&env, &ids, Duration::from_secs(60), &|| {
        "(its log is the stalled pipe)".to_string()
    })
    .await;
    wait_until(
        "warren_log_lines_dropped_total > 0, /metrics answering",
        Duration::from_secs(30),
        || async { metric(&env, "warren_log_lines_dropped_total", &[]).await > 0.0 },
    )
    .await;
    assert!(warren.is_running(), "warren died with its log pipe full");
    let status = warren.terminate(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    drop(stalled);
}

/// Runs `warren args...` of `env` with stderr to a file; (exit code, stdout, stderr).
fn run_with_stderr_to_file(
    env: &TestEnv,
    args: &[&str],
    vars: &[(&str, Option<&str>)],
) -> (i32, String, String) {
    let path = env.log_path();
    let file = std::fs::File::create(&path).expect("stderr file");
    let mut cmd = env.command(args);
    for (key, value) in vars {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.stderr(file).output().expect("run warren");
    let err = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        err,
    )
}

/// `warren status` answers on stdout; its stderr holds no INFO line and no colour unless asked
/// (`RUST_LOG=info`), and never a colour when it is a file.
#[tokio::test(flavor = "multi_thread")]
async fn subcommands_log_warnings_only_and_no_colours_into_a_file() {
    let env = TestEnv::new("log_quiet").await;
    let _redis = RedisCleanup::new(&env);
    env.declare();

    let (code, out, err) =
        run_with_stderr_to_file(&env, &["status"], &[("RUST_LOG", None), ("NO_COLOR", None)]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(!out.is_empty(), "status printed nothing");
    assert!(!err.contains("INFO"), "INFO lines by default:\n{err}");
    assert!(!err.contains('\x1b'), "ANSI escapes into a file:\n{err:?}");

    // RUST_LOG still decides when it is set.
    let (code, out, err) = run_with_stderr_to_file(
        &env,
        &["status"],
        &[("RUST_LOG", Some("info")), ("NO_COLOR", None)],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("INFO") && err.contains("connected to the broker"),
        "RUST_LOG=info logs:\n{err}"
    );
    assert!(!err.contains('\x1b'), "ANSI escapes into a file:\n{err:?}");

    // `run` keeps logging at info by default.
    let log = env.log_path();
    let file = std::fs::File::create(&log).expect("log file");
    let mut cmd = env.command(&["run", "--roles", "consumer"]);
    cmd.env_remove("RUST_LOG").env_remove("NO_COLOR");
    let mut warren = Warren::new(cmd.stderr(file).spawn().expect("start"), log);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("warren runs", Duration::from_secs(30), || async {
        warren.logs().contains("warren running")
    })
    .await;
    warren.terminate_ok(Duration::from_secs(30));
    let logs = warren.logs();
    assert!(logs.contains("INFO"), "{logs}");
    assert!(
        !logs.contains('\x1b'),
        "ANSI escapes into a file:\n{logs:?}"
    );
}

/// On a terminal (`script` gives warren a pseudo-terminal) the log is coloured, unless
/// `NO_COLOR` is set.
#[tokio::test(flavor = "multi_thread")]
async fn colours_only_on_a_terminal_and_never_with_no_color() {
    let env = TestEnv::new("log_tty").await;
    let _redis = RedisCleanup::new(&env);
    env.declare();
    let on_a_terminal = |no_color: Option<&str>| {
        // `script -qec CMD /dev/null` runs CMD on a new pseudo-terminal and copies what it
        // writes to our stdout; stdin is /dev/null so it does not wait for input.
        let mut cmd = Command::new("script");
        cmd.args(["-qec", &format!("{BIN} status"), "/dev/null"]);
        for (k, v) in env.command(&[]).get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd.env("RUST_LOG", "info");
        match no_color {
            Some(v) => cmd.env("NO_COLOR", v),
            None => cmd.env_remove("NO_COLOR"),
        };
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .expect("run `script` (util-linux)");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let coloured = on_a_terminal(None);
    assert!(
        coloured.contains("connected to the broker") && coloured.contains("\x1b["),
        "no colour on a terminal:\n{coloured:?}"
    );
    let plain = on_a_terminal(Some("1"));
    assert!(
        plain.contains("connected to the broker") && !plain.contains('\x1b'),
        "colour despite NO_COLOR:\n{plain:?}"
    );
}
