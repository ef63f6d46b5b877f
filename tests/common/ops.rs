//! Operations tooling for the tests: `promtool`, a real Prometheus server on a loopback port
//! (`Prometheus`), and a `warren run` started under the kernel's memory-deny-write-execute
//! (`start_without_wx`), the way the systemd unit's `MemoryDenyWriteExecute=` runs it.
//!
//! promtool and prometheus come from Debian's `prometheus` package; a missing one fails the test
//! and says to run `scripts/setup.sh --with-promtool`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{TestEnv, Warren, free_port, http_agent};

const HOW_TO_INSTALL: &str = "run `scripts/setup.sh --with-promtool` (it installs Debian's \
    `prometheus` package, which ships both `prometheus` and `promtool`)";

/// A path inside the repository.
pub fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// `program`, which must be installed: a missing tool is a failure with how to install it,
/// never a skip.
fn installed(program: &str) -> Command {
    match Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(_) => Command::new(program),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{program} is not installed: {HOW_TO_INSTALL}")
        }
        Err(e) => panic!("cannot run {program}: {e}"),
    }
}

/// Runs `promtool args...`: (success, stdout + stderr).
pub fn promtool(args: &[&str]) -> (bool, String) {
    let out = installed("promtool")
        .args(args)
        .current_dir(repo_path(""))
        .output()
        .expect("run promtool");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

// ---- a real Prometheus ----------------------------------------------------------------------

/// A Prometheus server on 127.0.0.1, with its own data directory, scraping warren every second
/// and evaluating the given rule files every second; killed on drop.
pub struct Prometheus {
    child: Child,
    /// Its HTTP API, `http://127.0.0.1:PORT`.
    pub base: String,
    /// Config, data and log; removed on drop.
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus with one scrape job `job` over `targets` (`host:port` of METRICS_ADDR)
    /// and `rule_files` (absolute paths), and waits until it is ready.
    pub async fn start(job: &str, targets: &[String], rule_files: &[PathBuf]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let rules: String = rule_files
            .iter()
            .map(|f| format!("  - {}\n", f.display()))
            .collect();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n{rules}\
             scrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, &config).expect("write prometheus.yml");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let port = free_port();
        let child = installed("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let mut prometheus = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!(
                    "prometheus exited ({status}) at start; config:\n{config}\nlog:\n{}",
                    prometheus.logs()
                );
            }
            if matches!(prometheus.get("/-/ready", &[]).await, Ok((200, _))) {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus was not ready within 60 s; log:\n{}",
                prometheus.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Prometheus's own log.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// (status, body) of a GET of `path` with `params`; `Err` if nothing answers.
    pub async fn get(&self, path: &str, params: &[(&str, &str)]) -> Result<(u16, String), String> {
        let url = format!("{}{path}", self.base);
        let params: Vec<(String, String)> = params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        tokio::task::spawn_blocking(move || {
            let mut request = http_agent().get(&url);
            for (k, v) in &params {
                request = request.query(k, v);
            }
            let mut response = request.call().map_err(|e| e.to_string())?;
            let status = response.status().as_u16();
            let body = response
                .body_mut()
                .read_to_string()
                .map_err(|e| e.to_string())?;
            Ok((status, body))
        })
        .await
        .expect("http task")
    }

    /// The `data` of a successful API answer; `Err` with Prometheus's error otherwise.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let (status, body) = self.get(path, params).await?;
        let json: Value = serde_json::from_str(&body)
            .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        if json["status"] == "success" {
            Ok(json["data"].clone())
        } else {
            Err(format!(
                "HTTP {status}: {} {}",
                json["errorType"].as_str().unwrap_or(""),
                json["error"].as_str().unwrap_or(&body)
            ))
        }
    }

    /// Evaluates `expr` now (`/api/v1/query`): the result series (a scalar counts as one), or
    /// Prometheus's error (a parse error, for example).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self.api("/api/v1/query", &[("query", expr)]).await?;
        match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => {
                Ok(data["result"].as_array().cloned().unwrap_or_default())
            }
            Some("scalar") | Some("string") => Ok(vec![data["result"].clone()]),
            other => Err(format!("unexpected result type {other:?}: {data}")),
        }
    }

    /// The value of a one-series query, if it has exactly one series with a number.
    pub async fn value(&self, expr: &str) -> Option<f64> {
        let series = self.query(expr).await.ok()?;
        match series.as_slice() {
            [one] => series_value(one),
            _ => None,
        }
    }

    /// The rule groups Prometheus loaded (`/api/v1/rules`), with each rule's health.
    pub async fn rules(&self) -> Vec<Value> {
        let data = self
            .api("/api/v1/rules", &[])
            .await
            .unwrap_or_else(|e| panic!("/api/v1/rules: {e}"));
        data["groups"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until every target of `job` (`expected` of them) is up and has been scraped at
    /// least `scrapes` times since `after` (seconds since the epoch). Prometheus applies new
    /// targets only every 5 s, so the first scrape comes a few seconds after its start.
    pub async fn wait_scrapes_after(&self, job: &str, expected: usize, after: f64, scrapes: usize) {
        let timeout = Duration::from_secs(60);
        let deadline = Instant::now() + timeout;
        // Every sample of `up` of the last 2 minutes (at least that much must have passed).
        let expr = format!("up{{job=\"{job}\"}}[2m]");
        loop {
            let done = self.query(&expr).await.is_ok_and(|targets| {
                targets.len() == expected
                    && targets.iter().all(|target| {
                        let samples = target["values"].as_array().cloned().unwrap_or_default();
                        let since: Vec<&Value> = samples
                            .iter()
                            .filter(|s| s[0].as_f64().is_some_and(|t| t >= after))
                            .collect();
                        since.len() >= scrapes
                            && since.last().and_then(|s| s[1].as_str()) == Some("1")
                    })
            });
            if done {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus did not scrape the {expected} targets of job {job} {scrapes} times \
                 within {timeout:?}; up: {:?}\nlog:\n{}",
                self.query(&expr).await,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The number of a series of an instant query (`value: [time, "number"]`), or of a scalar.
pub fn series_value(series: &Value) -> Option<f64> {
    let pair = series.get("value").unwrap_or(series);
    pair.get(1)?.as_str()?.parse().ok()
}

/// Seconds since the epoch, now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

// ---- warren under memory-deny-write-execute --------------------------------------------------

unsafe extern "C" {
    /// glibc's prctl(2).
    fn prctl(option: i32, ...) -> i32;
}

/// `PR_SET_MDWE` / `PR_MDWE_REFUSE_EXEC_GAIN` (Linux 6.3+): from now on, no mapping of this
/// process or of what it executes may become writable and executable; inherited across
/// `execve`. What systemd's `MemoryDenyWriteExecute=yes` enforces.
const PR_SET_MDWE: i32 = 65;
const PR_MDWE_REFUSE_EXEC_GAIN: u64 = 1;

/// Starts `warren run args...` with the env's settings under memory-deny-write-execute; the
/// start fails (and the test with it) if the kernel cannot enforce it.
pub fn start_without_wx(env: &TestEnv, args: &[&str]) -> Warren {
    use std::os::unix::process::CommandExt as _;
    let mut full = vec!["run"];
    full.extend_from_slice(args);
    let log = env.log_path();
    let file = std::fs::File::create(&log).expect("log file");
    let mut cmd = env.command(&full);
    cmd.stdout(Stdio::null()).stderr(file);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0u64, 0u64, 0u64) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let child = cmd.spawn().unwrap_or_else(|e| {
        panic!("cannot start warren under PR_SET_MDWE (Linux 6.3 or later is needed): {e}")
    });
    Warren::new(child, log)
}
