//! The container image (`scripts/image.sh`, `deploy/container/Containerfile`), built and run
//! here with podman: its configuration (non-root, `warren` the entrypoint, `run` the command,
//! OCI labels, nothing in it but the binary and what it needs), then `declare` and `run` as
//! containers on the host network against the real servers: every published user lands once,
//! and `podman stop` (SIGTERM to warren as PID 1) drains, exits 0 and leaves the queue empty,
//! also in the middle of a backlog. The start-to-ready and SIGTERM-to-exit times are printed.
//!
//! The tests package this build's own binary (`--bin`), so they test the code under test;
//! `scripts/image.sh` without `--bin` packages the release build (docs/deploying.md gives its
//! size). podman comes with `./scripts/setup.sh --with-promtool` (Debian's podman, buildah and
//! runc); without it these tests fail and say so.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::container::{Container, RemoveImage, image, logs};
use common::*;

/// `podman run` arguments giving the container `env`'s settings, on the host network (the
/// servers listen on 127.0.0.1, as do the container's listeners).
fn run_args(env: &TestEnv, name: &str, detach: bool) -> Vec<String> {
    let mut args = vec!["run".to_string(), "--network=host".into()];
    if detach {
        args.extend(["--detach".into(), "--name".into(), name.into()]);
    } else {
        args.push("--rm".into());
    }
    for (key, value) in &env.vars {
        args.extend(["--env".into(), format!("{key}={value}")]);
    }
    args.push(image().name.clone());
    args
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Starts `warren run` (the image's default command) in a container and waits until it is
/// ready; how long that took.
async fn start(env: &TestEnv, name: &str) -> (Container, Duration) {
    let started = Instant::now();
    image().engine.ok(&as_strs(&run_args(env, name, true)));
    let container = Container { name: name.into() };
    wait_until(
        "the container's /readyz 200",
        Duration::from_secs(60),
        || async { matches!(metrics_get(env, "/readyz").await, Some((200, _))) },
    )
    .await;
    (container, started.elapsed())
}

/// `podman stop` with a grace period above `SHUTDOWN_TIMEOUT_MS`: the exit code and how long
/// the stop took.
async fn stop(container: &Container) -> (i64, Duration) {
    let engine = &image().engine;
    let began = Instant::now();
    let name = container.name.clone();
    tokio::task::spawn_blocking(move || image().engine.ok(&["stop", "--time", "40", &name]))
        .await
        .expect("join");
    let took = began.elapsed();
    let code = engine.ok(&[
        "inspect",
        "--format",
        "{{.State.ExitCode}}",
        &container.name,
    ]);
    (
        code.parse()
            .unwrap_or_else(|_| panic!("podman inspect printed {code:?}, not an exit code")),
        took,
    )
}

/// One test, in three parts, so that the image is built once and removed at the end.
#[tokio::test]
async fn the_image_builds_runs_and_stops_as_a_deployment_needs() {
    let _remove = RemoveImage;
    the_image_runs_as_a_non_root_user_with_warren_run_and_holds_nothing_else();
    a_container_declares_runs_and_stops_within_its_grace_period_losing_nothing().await;
    podman_stop_in_the_middle_of_a_backlog_gives_back_what_it_did_not_store().await;
}

fn the_image_runs_as_a_non_root_user_with_warren_run_and_holds_nothing_else() {
    let image = image();
    let engine = &image.engine;
    let config = engine.ok(&[
        "image",
        "inspect",
        "--format",
        "{{.Config.User}}|{{json .Config.Entrypoint}}|{{json .Config.Cmd}}|{{json .Config.Labels}}",
        &image.name,
    ]);
    let parts: Vec<&str> = config.splitn(4, '|').collect();
    assert_eq!(parts.len(), 4, "{config}");
    assert_eq!(parts[0], "65532:65532", "the image's user");
    assert_eq!(parts[1], r#"["/usr/local/bin/warren"]"#);
    assert_eq!(parts[2], r#"["run"]"#);
    let labels: serde_json::Value = serde_json::from_str(parts[3]).expect("labels are JSON");
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        "MIT OR Apache-2.0"
    );
    // The revision given with the binary, never the checkout's (review R38j F3).
    assert_eq!(
        labels["org.opencontainers.image.revision"],
        common::container::TEST_REVISION
    );
    // No shell: the image holds the binary and what it links, nothing to run commands with.
    let shell = engine.output(&[
        "run",
        "--rm",
        "--entrypoint",
        "/bin/sh",
        &image.name,
        "-c",
        "true",
    ]);
    assert!(!shell.status.success(), "the image has a shell");
    // Everything but the binary is small: libraries, CA bundle, passwd, configuration.
    let size: u64 = engine
        .ok(&["image", "inspect", "--format", "{{.Size}}", &image.name])
        .parse()
        .expect("a size");
    let binary = std::fs::metadata(bin()).expect("the binary").len();
    assert!(
        size.saturating_sub(binary) < 8_000_000,
        "the image is {size} bytes, the binary {binary}: more than 8 MB besides it"
    );
    // The user warren runs it with the defaults built in: the users pipeline's raffle_* names.
    let out = engine.output(&["run", "--rm", &image.name, "config"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("main_queue = \"raffle_queue\""), "{text}");
}

async fn a_container_declares_runs_and_stops_within_its_grace_period_losing_nothing() {
    let env = TestEnv::new("image_run").await;
    let mut declare = run_args(&env, "", false);
    declare.push("declare".into());
    let out = image().engine.output(&as_strs(&declare));
    assert!(
        out.status.success(),
        "declare in a container:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        env.queue_exists(&env.main_queue).await,
        "declare made no main queue"
    );

    let name = format!("{}_run", env.id);
    let (container, ready_after) = start(&env, &name).await;
    let ids = env.publish_users(500).await;
    let expected: HashSet<_> = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| logs(&name)).await;
    let (exit, stop_took) = stop(&container).await;
    assert_eq!(exit, 0, "the container's exit code; logs:\n{}", logs(&name));
    assert_queue_empty(&env, &env.main_queue).await;
    eprintln!("image: start to /readyz 200 {ready_after:?}, podman stop to exit {stop_took:?}");
}

async fn podman_stop_in_the_middle_of_a_backlog_gives_back_what_it_did_not_store() {
    let env = TestEnv::new("image_stop").await;
    env.declare();
    let ids = env.publish_users(20_000).await;
    let name = format!("{}_a", env.id);
    let (first, _) = start(&env, &name).await;
    wait_until("the first rows", Duration::from_secs(60), || async {
        env.count_rows().await > 0
    })
    .await;
    let (exit, took) = stop(&first).await;
    assert_eq!(exit, 0, "a stop mid-backlog; logs:\n{}", logs(&name));
    assert!(
        took < Duration::from_secs(35),
        "podman stop took {took:?}: past SHUTDOWN_TIMEOUT_MS, podman would have killed it"
    );
    // What it did not store is with the broker, and a second container stores it, each once.
    let name = format!("{}_b", env.id);
    let (second, _) = start(&env, &name).await;
    let expected: HashSet<_> = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &|| logs(&name)).await;
    let (exit, _) = stop(&second).await;
    assert_eq!(exit, 0, "logs:\n{}", logs(&name));
    assert_queue_empty(&env, &env.main_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
}

/// Runs `script` with `args`, from the directory it is in; (exit code, stderr).
fn run_script(script: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .expect("run scripts/image.sh");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Review F6: `--tag` with a tag (`localhost/warren:1.0`) made "localhost/warren:1.0:0.1.0",
/// which the engine refused in words about a reference format; the script now refuses it
/// itself (exit 2), saying what to give. A registry's port is part of a name and is taken.
/// Checked before anything else: no podman needed, nothing built.
#[test]
fn image_sh_refuses_a_tag_in_its_tag_option_and_says_what_to_give() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/image.sh");
    for (tag, name) in [
        ("localhost/warren:1.0", "localhost/warren"),
        ("warren:latest", "warren"),
        (
            "registry.example:5000/team/warren@sha256:0123",
            "registry.example:5000/team/warren",
        ),
    ] {
        // No engine and no binary: whatever the script checks, it never builds anything.
        let (code, err) = run_script(
            &script,
            &["--tag", tag, "--engine", "none", "--bin", "/nonexistent"],
        );
        assert_eq!(code, Some(2), "--tag {tag}: {err}");
        assert!(
            err.contains(&format!(
                "--tag {tag}: give the image's name without a tag or digest (here {name})"
            )),
            "--tag {tag}: {err}"
        );
    }
    // A registry's port is no tag: refused only for the engine named next.
    let (code, err) = run_script(
        &script,
        &["--tag", "registry.example:5000/warren", "--engine", "none"],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--engine: expected podman or docker, got none"),
        "{err}"
    );
    let (code, err) = run_script(&script, &["--tag"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--tag needs a value"), "{err}");
}

/// Review F6: without the LICENSE-* files (a partial copy of the tree) the script failed inside
/// `install` with a bare "cannot stat"; it now says which file is missing, why the image needs
/// it, and to run it from a complete checkout, before anything is built.
#[test]
fn image_sh_names_a_missing_licence_file() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let copy = tempfile::tempdir().expect("temp dir");
    for file in [
        "scripts/image.sh",
        "config/default.toml",
        "deploy/container/Containerfile",
        "LICENSE-APACHE",
    ] {
        let to = copy.path().join(file);
        std::fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(root.join(file), &to).expect("copy");
    }
    let (code, err) = run_script(
        &copy.path().join("scripts/image.sh"),
        &["--engine", "none", "--bin", "/nonexistent"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("LICENSE-MIT is missing from")
            && err.contains("run this script from a complete checkout of warren"),
        "{err}"
    );
}

/// Review R38 F3: a relative `--bin` was taken from the checkout (the script moves there), so
/// `--bin ./warren` in the caller's directory was "not an executable file"; a binary that is
/// not warren (`/bin/ls`) took "(GNU" for its version and failed in the engine; an upper-case
/// repository passed and failed in the engine. Each now gets the script's own words, exit 2,
/// before anything is built.
#[test]
fn image_sh_takes_a_relative_bin_from_the_caller_and_refuses_what_is_not_warren() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/image.sh");
    let caller = tempfile::tempdir().expect("temp dir");
    std::fs::copy("/bin/ls", caller.path().join("notwarren")).expect("copy /bin/ls");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(["--engine", "podman", "--bin", "./notwarren"])
        .current_dir(caller.path())
        .output()
        .expect("run scripts/image.sh");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let named = caller.path().join("./notwarren");
    assert!(
        err.contains(&format!(
            "--bin: {} is not a warren binary",
            named.display()
        )),
        "{err}"
    );
    for (tag, lower) in [
        ("LOCALHOST/WARREN", "localhost/warren"),
        ("localhost/Warren", "localhost/warren"),
        (
            "Registry.Example:5000/Team/warren",
            "Registry.Example:5000/team/warren",
        ),
    ] {
        let (code, err) = run_script(&script, &["--tag", tag, "--engine", "none"]);
        assert_eq!(code, Some(2), "--tag {tag}: {err}");
        assert!(
            err.contains(&format!(
                "--tag {tag}: an image's repository must be lower case (here {lower})"
            )),
            "--tag {tag}: {err}"
        );
    }
}
