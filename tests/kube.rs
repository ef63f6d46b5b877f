//! The Kubernetes manifests (`deploy/kubernetes/`): their invariants against the code (probe
//! paths and port, the grace period against the shutdown timeout, every environment name a real
//! setting, the image's user), and the Deployment with its ConfigMap and Secret run by
//! `podman kube play` against the real servers: rows land, and a stop as the kubelet does it
//! (SIGTERM, then the grace period) drains, exits 0 and records a clean `stopped`.
//!
//! What the test changes in its copy of the manifests, and why: the image (this build's), one
//! replica, the host network (the servers listen on 127.0.0.1) and so no port mappings and
//! numeric probe ports, the listeners on 127.0.0.1 and the test's own names. podman 4.3 (Debian
//! 12) cannot read a `Secret` document in `kube play` (it stores the YAML where it later wants
//! JSON), so the test creates the same Secret as podman keeps them (`podman secret create`, a
//! JSON map of base64 values) under the name the Deployment refers to.

mod common;

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use base64::Engine as _;
use common::container::{RemoveImage, image};
use common::ops::repo_path;
use common::*;

fn manifest(name: &str) -> String {
    let path = repo_path(&format!("deploy/kubernetes/{name}"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path:?}: {e}"))
}

/// The value after `key:` on every line that has it (trimmed, quotes removed).
fn values(text: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}:");
    text.lines()
        .filter_map(|l| {
            let l = l.trim().trim_start_matches("- ");
            l.strip_prefix(&prefix)
        })
        .map(|v| v.trim().trim_matches('"').to_string())
        .collect()
}

/// The one value of `key`; a manifest without it, or with two, fails.
fn one(text: &str, key: &str) -> String {
    let found = values(text, key);
    assert_eq!(
        found.len(),
        1,
        "expected one {key}: in the manifest, found {found:?}"
    );
    found[0].clone()
}

/// The environment variable names a container of `text` sets (`- name: UPPER_CASE`).
fn env_names(text: &str) -> BTreeSet<String> {
    values(text, "name")
        .into_iter()
        .filter(|n| n.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .collect()
}

/// The value of the env variable `name` in `text` (the `value:` line after its `- name:`).
fn env_value(text: &str, name: &str) -> String {
    let mut lines = text.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line == format!("- name: {name}") {
            let next = lines.next().unwrap_or_default();
            if let Some(v) = next.strip_prefix("value:") {
                return v.trim().trim_matches('"').to_string();
            }
        }
    }
    panic!("no env {name} with a value in the manifest")
}

/// Every setting's environment name, from `warren config` (`key = value  # origin`).
fn setting_names() -> HashSet<String> {
    let out = std::process::Command::new(bin())
        .arg("config")
        .env_remove("WARREN_CONFIG")
        .output()
        .expect("run warren config");
    assert!(out.status.success(), "warren config failed");
    let names: HashSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_once(" = ")
                .map(|(k, _)| k.trim().to_ascii_uppercase())
        })
        .collect();
    assert!(names.contains("AMQP_URL") && names.len() > 40, "{names:?}");
    names
}

#[test]
fn the_manifests_agree_with_the_code() {
    let deployment = manifest("deployment.yaml");
    let job = manifest("declare-job.yaml");
    let secret = manifest("secret.yaml");
    let service = manifest("service.yaml");

    // Every environment name is a real setting (or the config file's, or the log filter's).
    let settings = setting_names();
    let mut names = env_names(&deployment);
    names.extend(env_names(&job));
    let secret_keys: BTreeSet<String> = secret
        .lines()
        .filter_map(|l| {
            l.strip_prefix("  ")?
                .split_once(':')
                .map(|(k, _)| k.to_string())
        })
        .filter(|k| k.chars().all(|c| c.is_ascii_uppercase() || c == '_') && !k.is_empty())
        .collect();
    assert_eq!(
        secret_keys.iter().map(String::as_str).collect::<Vec<_>>(),
        ["AMQP_URL", "CONTROL_SECRET", "DATABASE_URL", "REDIS_URL"]
    );
    names.extend(secret_keys);
    let unknown: Vec<_> = names
        .iter()
        .filter(|n| !settings.contains(*n) && !["WARREN_CONFIG", "RUST_LOG"].contains(&n.as_str()))
        .collect();
    assert!(unknown.is_empty(), "not settings of warren: {unknown:?}");

    // The probes: warren's paths, on the port METRICS_ADDR binds.
    assert_eq!(values(&deployment, "path"), ["/readyz", "/healthz"]);
    assert_eq!(values(&deployment, "port"), ["metrics", "metrics"]);
    let metrics_port = env_value(&deployment, "METRICS_ADDR");
    let http_port = env_value(&deployment, "HTTP_ADDR");
    let ports = values(&deployment, "containerPort");
    assert_eq!(ports, ["8080", "9898"]);
    assert_eq!(metrics_port, "0.0.0.0:9898");
    assert_eq!(http_port, "0.0.0.0:8080");
    assert_eq!(values(&service, "targetPort"), ["http", "metrics"]);
    for text in [&deployment, &service] {
        assert_eq!(one(text, "prometheus.io/port"), "9898");
    }
    // The paths exist: a warren's metrics listener answers them.
    let routes = std::fs::read_to_string(repo_path("src/http/ops.rs")).expect("ops.rs");
    for path in ["\"/readyz\"", "\"/healthz\"", "\"/metrics\""] {
        assert!(routes.contains(path), "src/http/ops.rs serves no {path}");
    }

    // The grace period covers the drain (SHUTDOWN_TIMEOUT_MS), closing the API (10 s) and the
    // registry (5 s), with margin, as the systemd unit's TimeoutStopSec does.
    let grace: u64 = one(&deployment, "terminationGracePeriodSeconds")
        .parse()
        .expect("a number of seconds");
    let shutdown_ms: u64 = env_value(&deployment, "SHUTDOWN_TIMEOUT_MS")
        .parse()
        .expect("milliseconds");
    assert!(
        grace * 1000 >= shutdown_ms + 10_000 + 5_000 + 5_000,
        "terminationGracePeriodSeconds {grace} does not cover SHUTDOWN_TIMEOUT_MS {shutdown_ms} \
         + 15 s of closing + 5 s of margin"
    );

    // Non-root as the image's user, read-only, no capabilities.
    let containerfile = std::fs::read_to_string(repo_path("deploy/container/Containerfile"))
        .expect("Containerfile");
    assert!(containerfile.contains("\nUSER 65532:65532\n"));
    for text in [&deployment, &job] {
        assert_eq!(one(text, "runAsUser"), "65532");
        assert_eq!(one(text, "runAsNonRoot"), "true");
        assert_eq!(one(text, "readOnlyRootFilesystem"), "true");
        assert_eq!(one(text, "allowPrivilegeEscalation"), "false");
        assert_eq!(one(text, "drop"), "[\"ALL\"]");
        assert_eq!(one(text, "mountPath"), "/etc/warren");
        assert_eq!(
            env_value(text, "WARREN_CONFIG"),
            "/etc/warren/pipelines.toml"
        );
    }
    assert!(manifest("configmap.yaml").contains("  pipelines.toml: |"));
}

/// `text` with `from` replaced by `to`, which must be there.
fn patch(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the manifest no longer has {from:?}");
    text.replace(from, to)
}

#[tokio::test]
async fn the_deployment_runs_under_podman_kube_play_and_stops_clean() {
    let _remove = RemoveImage;
    let env = TestEnv::new("kube").await;
    env.declare();
    let built = image();
    let engine = &built.engine;
    let pod = env.id.replace('_', "-");
    let secret = format!("{pod}-urls");

    // The Secret, as podman keeps them.
    let values: serde_json::Map<String, serde_json::Value> = [
        ("AMQP_URL", amqp_url()),
        ("DATABASE_URL", database_url()),
        ("REDIS_URL", redis_url()),
        ("CONTROL_SECRET", "k".repeat(40)),
    ]
    .into_iter()
    .map(|(k, v)| {
        (
            k.to_string(),
            base64::engine::general_purpose::STANDARD.encode(v).into(),
        )
    })
    .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("secret.json");
    std::fs::write(&secret_file, serde_json::Value::Object(values).to_string()).expect("write");
    engine.ok(&[
        "secret",
        "create",
        &secret,
        secret_file.to_str().expect("utf-8"),
    ]);
    struct RemoveSecret(String);
    impl Drop for RemoveSecret {
        fn drop(&mut self) {
            let _ = common::container::image()
                .engine
                .output(&["secret", "rm", &self.0]);
        }
    }
    let _secret = RemoveSecret(secret.clone());

    // The ConfigMap and the Deployment, as the test must run them.
    let mut yaml = manifest("configmap.yaml");
    yaml = patch(
        &yaml,
        "name: warren-pipelines",
        &format!("name: {pod}-pipelines"),
    );
    let mut deployment = manifest("deployment.yaml");
    deployment = patch(&deployment, "  name: warren\n", &format!("  name: {pod}\n"));
    deployment = patch(&deployment, "replicas: 2", "replicas: 1");
    deployment = patch(
        &deployment,
        "image: localhost/warren:latest",
        &format!("image: {}", built.name),
    );
    deployment = patch(
        &deployment,
        "      terminationGracePeriodSeconds",
        "      hostNetwork: true\n      terminationGracePeriodSeconds",
    );
    deployment = patch(
        &deployment,
        "          ports:\n            - name: http\n              containerPort: 8080\n            - name: metrics\n              containerPort: 9898\n",
        "",
    );
    deployment = patch(
        &deployment,
        "port: metrics",
        &format!("port: {}", env.metrics_port),
    );
    deployment = patch(&deployment, "name: warren-urls", &format!("name: {secret}"));
    deployment = patch(
        &deployment,
        "name: warren-pipelines",
        &format!("name: {pod}-pipelines"),
    );
    deployment = patch(
        &deployment,
        "0.0.0.0:8080",
        &format!("127.0.0.1:{}", env.http_port),
    );
    deployment = patch(
        &deployment,
        "0.0.0.0:9898",
        &format!("127.0.0.1:{}", env.metrics_port),
    );
    let own: String = env
        .vars
        .iter()
        .filter(|(k, _)| {
            ![
                "AMQP_URL",
                "DATABASE_URL",
                "REDIS_URL",
                "HTTP_ADDR",
                "METRICS_ADDR",
                "SHUTDOWN_TIMEOUT_MS",
                "RUST_LOG",
            ]
            .contains(&k.as_str())
        })
        .map(|(k, v)| format!("            - name: {k}\n              value: \"{v}\"\n"))
        .collect();
    deployment = patch(
        &deployment,
        "          env:\n",
        &format!("          env:\n{own}"),
    );
    yaml.push_str("\n---\n");
    yaml.push_str(&deployment);
    let file = dir.path().join("kube.yaml");
    std::fs::write(&file, &yaml).expect("write the manifests");
    let file = file.to_str().expect("utf-8").to_string();

    struct Down(String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = common::container::image()
                .engine
                .output(&["kube", "down", &self.0]);
        }
    }
    engine.ok(&["kube", "play", &file]);
    let _down = Down(file.clone());
    let pod_name = format!("{pod}-pod-0");
    let container = format!("{pod_name}-warren");
    let logs = || common::container::logs(&container);
    wait_until(
        "/readyz 200 in the pod",
        Duration::from_secs(60),
        || async { matches!(metrics_get(&env, "/readyz").await, Some((200, _))) },
    )
    .await;

    let ids = env.publish_users(500).await;
    let expected: HashSet<_> = ids.iter().copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &logs).await;

    // What the kubelet does: SIGTERM, then SIGKILL after the grace period. (podman 4.3's
    // `kube down` removes the pod without a grace period, so the pod is stopped first.)
    let stop = pod_name.clone();
    tokio::task::spawn_blocking(move || image().engine.ok(&["pod", "stop", "--time", "45", &stop]))
        .await
        .expect("join");
    let code = engine.ok(&["inspect", "--format", "{{.State.ExitCode}}", &container]);
    assert_eq!(code, "0", "the pod's exit code; logs:\n{}", logs());
    let events = stream_events(&env).await;
    let stopped = events
        .iter()
        .rev()
        .find(|e| e["type"] == "stopped")
        .unwrap_or_else(|| panic!("no stopped event: {events:?}"));
    assert_eq!(stopped["exit_code"], 0, "{stopped}");
    assert_queue_empty(&env, &env.main_queue).await;
    assert_queue_empty(&env, &env.dlq_queue).await;
}
