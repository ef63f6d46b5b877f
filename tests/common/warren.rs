//! Running warren: `TestEnv`'s `warren` commands (`command`, `run`, `run_async`, `declare`,
//! `start`), `Warren`, one running `warren run`, and `LogsOnPanic`, which shows the logs of the
//! processes of a failed test.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use super::env::{TestEnv, bin, unique_number};
use super::wait::wait_until;

impl TestEnv {
    /// A `warren` command with this env's settings and nothing inherited that could leak in.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.args(args);
        for key in [
            "AMQP_URL",
            "DATABASE_URL",
            "PREFETCH",
            "ROLES",
            "USERS_BATCH_SIZE",
            "BATCH_SIZE",
            "BATCH_TIMEOUT_MS",
            "BATCH_MIN_WAIT_MS",
            "MAX_RETRIES",
            "RETRY_TTL_MS",
            "LOG_FORMAT",
            "QUEUE_TYPE",
            "RETRY_TTLS_MS",
            "DELIVERY_LIMIT",
            "AMQP_SHUFFLE",
            "WARREN_CONFIG",
        ] {
            cmd.env_remove(key);
        }
        cmd.envs(self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd
    }

    /// Runs a `warren` subcommand to completion: (exit code, stdout, stderr).
    pub fn run(&self, args: &[&str]) -> (i32, String, String) {
        outcome(self.command(args).output().expect("run warren"))
    }

    /// [`TestEnv::run`] off the async threads, for commands that take a while (`ctl`,
    /// `status`): (exit code, stdout, stderr).
    pub async fn run_async(&self, args: &[&str]) -> (i32, String, String) {
        let mut cmd = self.command(args);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .expect("join")
            .expect("run warren");
        outcome(out)
    }

    /// `warren declare`, which must succeed.
    pub fn declare(&self) {
        let (code, out, err) = self.run(&["declare"]);
        assert_eq!(code, 0, "warren declare failed:\n{out}\n{err}");
    }

    /// Starts `warren run` with `args` (for example `--roles consumer`).
    pub fn start(&self, args: &[&str]) -> Warren {
        let mut full = vec!["run"];
        full.extend_from_slice(args);
        let log = self.log_path();
        let file = std::fs::File::create(&log).expect("log file");
        let child = self
            .command(&full)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start warren");
        Warren::new(child, log)
    }

    /// A fresh path for the log (stderr) of one warren process of this env.
    pub fn log_path(&self) -> PathBuf {
        std::env::temp_dir().join(format!("{}-{}.log", self.id, unique_number()))
    }
}

/// (exit code, stdout, stderr) of a finished command.
fn outcome(out: Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A running `warren run`; killed on drop if still running.
pub struct Warren {
    /// The process while it runs; `None` once it exited and was reaped.
    child: Option<Child>,
    /// Its stderr (logs), for failure messages.
    pub log: PathBuf,
}

impl Warren {
    /// A warren process started with its stderr going to `log` (see [`TestEnv::log_path`]).
    pub fn new(child: Child, log: PathBuf) -> Self {
        Warren {
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status();
    }

    /// Sends SIGTERM and waits until the graceful shutdown has begun (`shutting down` logged),
    /// without waiting for the exit.
    pub async fn begin_shutdown(&self) {
        self.signal("TERM");
        wait_until(
            "the graceful shutdown started",
            Duration::from_secs(10),
            || async { self.logs().contains("shutting down") },
        )
        .await;
    }

    /// Sends SIGTERM and waits for the exit, at most `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal("TERM");
        self.wait(timeout)
    }

    /// Sends SIGTERM and asserts a clean stop (exit code 0) within `timeout`, showing the log
    /// otherwise.
    pub fn terminate_ok(&mut self, timeout: Duration) {
        let status = self.terminate(timeout);
        assert_eq!(status.code(), Some(0), "log:\n{}", self.logs());
    }

    /// Waits for the process to exit; panics with its log after `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "warren did not exit within {timeout:?}; log:\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, no cleanup.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to 30 s until the log holds `text`; `what` names it in the timeout's panic.
    pub async fn wait_for_log(&self, what: &str, text: &str) {
        wait_until(what, Duration::from_secs(30), || async {
            self.logs().contains(text)
        })
        .await;
    }
}

impl Drop for Warren {
    fn drop(&mut self) {
        self.kill9();
        // WARREN_TEST_KEEP_LOGS=1 keeps every warren's log file (in the temp dir) for a post-mortem.
        if std::env::var_os("WARREN_TEST_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Prints the logs of warren processes (`Warren::log`) when the test fails: their files go with
/// the processes. Hold it for the test's length: `let _logs = LogsOnPanic(vec![w.log.clone()]);`
pub struct LogsOnPanic(pub Vec<PathBuf>);

impl Drop for LogsOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in &self.0 {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                eprintln!("---- warren log {}:\n{text}", log.display());
            }
        }
    }
}

/// What the last `stopped` line of `logs` says the stop did: (deliveries settled, given back to
/// the broker unprocessed); `None` when no such line gives both. One parser for every test: a
/// line of one delivery says `1 delivery settled`, which a match on "deliveries settled" missed.
pub fn stop_counts(logs: &str) -> Option<(u64, u64)> {
    let line = logs.lines().rev().find(|l| l.contains("stopped"))?;
    let from = &line[line.find("stopped")?..];
    let (_, counts) = from.split_once(": ")?;
    let (settled, rest) = counts.split_once(" settled, ")?;
    let settled = settled.split_whitespace().next()?.parse().ok()?;
    let given_back = if rest.starts_with("none given back") {
        0
    } else {
        rest.split_once(" given back")?.0.trim().parse().ok()?
    };
    Some((settled, given_back))
}

/// The peak resident memory (`VmHWM`) of process `pid`, in bytes.
pub fn peak_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmHWM in kB")
}
