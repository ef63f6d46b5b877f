//! Containers for the tests (by path, `common::container::...`): the podman invocation this
//! machine needs ([`Engine`]), this build's image built once per test binary with
//! `scripts/image.sh` ([`image`]) and removed by [`RemoveImage`], and [`Container`], removed on
//! drop. podman comes with `./scripts/setup.sh --with-promtool`; without it the tests fail and
//! say so.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use super::bin;
use super::ops::repo_path;

/// The revision the tests' image is labelled with (`scripts/image.sh --revision`).
pub const TEST_REVISION: &str = "warren-test-build";

/// The podman invocation this machine needs: the defaults, or, where the default runtime
/// cannot set the default rlimits (an unprivileged sandbox: `error setting rlimit`), a
/// `containers.conf` with `default_ulimits = []` (docs/deploying.md, "Container").
pub struct Engine {
    pub conf: Option<PathBuf>,
}

impl Engine {
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("podman");
        cmd.args(args);
        if let Some(conf) = &self.conf {
            cmd.env("CONTAINERS_CONF", conf);
        }
        cmd
    }

    pub fn output(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run podman {args:?}: {e}"))
    }

    /// Runs podman, which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.output(args);
        assert!(
            out.status.success(),
            "podman {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// The image of this build, built once per test binary, and the engine to run it with.
pub struct Image {
    pub engine: Engine,
    /// `localhost/warren-test-<pid>:<version>`.
    pub name: String,
}

pub fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let found = Command::new("podman").arg("--version").output();
        assert!(
            found.as_ref().is_ok_and(|o| o.status.success()),
            "podman is not installed: run ./scripts/setup.sh --with-promtool (it installs Debian's \
             podman, buildah and runc)"
        );
        let repo = std::process::id();
        let tag = format!("localhost/warren-test-{repo}");
        let out = Command::new(repo_path("scripts/image.sh"))
            .args(["--engine", "podman", "--bin", &bin(), "--tag", &tag])
            .args(["--revision", TEST_REVISION])
            .output()
            .expect("run scripts/image.sh");
        assert!(
            out.status.success(),
            "scripts/image.sh failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let name = stdout.lines().last().unwrap_or_default().trim().to_string();
        assert!(
            name.starts_with(&tag),
            "scripts/image.sh printed {stdout:?}, not the image's name"
        );
        let mut engine = Engine { conf: None };
        let probe = engine.output(&["run", "--rm", &name, "--version"]);
        if !probe.status.success() && String::from_utf8_lossy(&probe.stderr).contains("rlimit") {
            let conf = std::env::temp_dir().join(format!("warren-test-containers-{repo}.conf"));
            std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n")
                .expect("write containers.conf");
            engine.conf = Some(conf);
        }
        Image { engine, name }
    })
}

/// Removes the image (both tags) at the end of the test, also when it fails.
pub struct RemoveImage;

impl Drop for RemoveImage {
    fn drop(&mut self) {
        let image = image();
        let base = image.name.split(':').next().unwrap_or_default().to_string();
        let _ = image
            .engine
            .output(&["rmi", "--force", &image.name, &format!("{base}:latest")]);
    }
}

/// One container of the test, removed (stopped at once) on drop.
pub struct Container {
    pub name: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = image()
            .engine
            .output(&["rm", "--force", "--time", "0", &self.name]);
    }
}

/// The container's output (warren's log lines).
pub fn logs(name: &str) -> String {
    let out = image().engine.output(&["logs", name]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
