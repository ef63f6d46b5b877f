//! Secrets never reach the output: every role of `warren run` and every subcommand that
//! connects, pointed at unreachable servers whose URLs carry distinctive passwords, with
//! CONTROL_SECRET set and `RUST_LOG=debug`, prints none of them on stdout or stderr.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Four distinctive secrets (letters, digits and `-` only, so they read the same
/// percent-encoded) and an env whose servers are closed ports on 127.0.0.1.
struct Leaky {
    env: TestEnv,
    secrets: [String; 4],
    ports: [u16; 3],
}

/// Where the secrets sit in the URLs.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// In the user info, where a URL parser finds them.
    Plain,
    /// After a `?` or `#` inside a password, and in a query string (`?password=`), where a
    /// redaction that stops at the first `?` or `#` shows them.
    Tricky,
}

impl Leaky {
    async fn new(test: &str) -> Self {
        Self::shaped(test, Shape::Plain).await
    }

    async fn shaped(test: &str, shape: Shape) -> Self {
        let mut env = TestEnv::new(test).await;
        let tag = &uuid::Uuid::new_v4().simple().to_string()[..10];
        let secrets = [
            format!("amqpPw-{tag}"),
            format!("pgPw-{tag}"),
            format!("redisPw-{tag}"),
            format!("ctlSecret-{tag}"),
        ];
        let ports = [free_port(), free_port(), free_port()];
        let [amqp, pg, redis] = match shape {
            Shape::Plain => [
                format!("amqp://u:{}@127.0.0.1:{}/%2f", secrets[0], ports[0]),
                format!("postgres://u:{}@127.0.0.1:{}/db", secrets[1], ports[1]),
                format!("redis://:{}@127.0.0.1:{}", secrets[2], ports[2]),
            ],
            Shape::Tricky => [
                format!(
                    "amqp://127.0.0.1:{0}/%2f?password={1},amqp://u:x?{1}@127.0.0.1:{0}/%2f",
                    ports[0], secrets[0]
                ),
                format!(
                    "postgres://u@127.0.0.1:{}/db?sslmode=disable&password={}",
                    ports[1], secrets[1]
                ),
                format!("redis://:x#{}@127.0.0.1:{}", secrets[2], ports[2]),
            ],
        };
        env.set("AMQP_URL", amqp)
            .set("DATABASE_URL", pg)
            .set("REDIS_URL", redis)
            .set("CONTROL_SECRET", secrets[3].clone())
            .set("RUST_LOG", "debug")
            .set("AMQP_CONNECT_TIMEOUT_MS", "1000")
            .set("SHUTDOWN_TIMEOUT_MS", "3000")
            .set("REGISTRY_HEARTBEAT_MS", "300");
        Leaky {
            env,
            secrets,
            ports,
        }
    }

    /// Fails naming the secret and the line if `output` shows any of the secrets.
    fn assert_clean(&self, what: &str, output: &str) {
        for secret in &self.secrets {
            if let Some(line) = output.lines().find(|l| l.contains(secret.as_str())) {
                panic!("{what} printed the secret {secret:?}:\n{line}\n\nwhole output:\n{output}");
            }
        }
    }
}

/// A started `warren run` that is killed when the test ends, also when it fails midway (a
/// failed assertion must not leave the process running).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_role_of_run_prints_a_password() {
    let leaky = Leaky::new("secrets_run").await;
    let env = &leaky.env;
    let dir = tempfile::tempdir().expect("temp dir");
    for roles in ["consumer", "dlq", "api", "consumer,dlq,api"] {
        let out_path = dir.path().join(format!("{roles}.out"));
        let err_path = dir.path().join(format!("{roles}.err"));
        let mut child = KillOnDrop(
            env.command(&["run", "--roles", roles])
                .stdout(std::fs::File::create(&out_path).expect("stdout file"))
                .stderr(std::fs::File::create(&err_path).expect("stderr file"))
                .spawn()
                .expect("start warren"),
        );
        let child = &mut child.0;
        let read = || {
            format!(
                "{}{}",
                std::fs::read_to_string(&out_path).unwrap_or_default(),
                std::fs::read_to_string(&err_path).unwrap_or_default()
            )
        };
        let started = Instant::now();
        // Redis and the broker have been tried and found unreachable, for at least a few
        // seconds so reconnects and heartbeats run too (the database is tried through the API).
        let mut needed = vec![
            format!(
                "cannot reach Redis at redis://:***@127.0.0.1:{}",
                leaky.ports[2]
            ),
            "Redis unreachable".to_string(),
        ];
        if roles.contains("consumer") || roles.contains("dlq") {
            needed.push("consumer cannot consume".into());
        }
        if roles.contains("api") {
            needed.push("publisher cannot reach the broker".into());
        }
        if roles.contains("api") {
            wait_until("the API answers", Duration::from_secs(20), || async {
                http(env, "GET", "/healthz", None).await.is_some()
            })
            .await;
            // The paths that reach the broker and the database, failing.
            let post = http(
                env,
                "POST",
                "/api/v1/users",
                Some(r#"{"name":"Ana","email":"ana@example.com"}"#),
            )
            .await;
            assert_eq!(post.map(|(s, _)| s), Some(503));
            let get = http(
                env,
                "GET",
                &format!("/api/v1/users/{}", uuid::Uuid::new_v4()),
                None,
            )
            .await;
            assert_eq!(get.map(|(s, _)| s), Some(503));
            let ready = http(env, "GET", "/readyz", None).await;
            assert_eq!(ready.map(|(s, _)| s), Some(503));
        }
        wait_until(
            &format!("--roles {roles}: {needed:?} in the log"),
            Duration::from_secs(30),
            || async {
                let log = read();
                needed.iter().all(|n| log.contains(n.as_str()))
                    && started.elapsed() >= Duration::from_secs(3)
            },
        )
        .await;
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "--roles {roles} exited early:\n{}",
            read()
        );
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let exited = !matches!(child.try_wait(), Ok(None));
        let _ = child.kill();
        let _ = child.wait();
        let output = read();
        assert!(exited, "--roles {roles} ignored SIGTERM:\n{output}");
        assert!(
            output.contains("DEBUG"),
            "--roles {roles}: RUST_LOG=debug did not apply:\n{output}"
        );
        leaky.assert_clean(&format!("warren run --roles {roles}"), &output);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_subcommand_prints_a_password() {
    every_subcommand_is_clean(Shape::Plain).await;
}

/// Passwords holding `?` and `#` (which tokio-postgres and the redis crate accept) and
/// passwords in query strings, in every entry of a list.
#[tokio::test(flavor = "multi_thread")]
async fn no_subcommand_prints_a_password_hidden_after_a_question_mark_or_in_a_query() {
    every_subcommand_is_clean(Shape::Tricky).await;
}

async fn every_subcommand_is_clean(shape: Shape) {
    let leaky = Leaky::shaped("secrets_cli", shape).await;
    let env = &leaky.env;
    for args in [
        &["declare"][..],
        &["publish", "--count", "1"],
        &["status"],
        &["status", "--json"],
        &["ctl", "pause", "--all"],
        &["ctl", "history"],
        &["dlq", "inspect"],
        &["dlq", "parked", "list"],
        &["config"],
    ] {
        let mut cmd = env.command(args);
        cmd.stdin(Stdio::null());
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .expect("join")
            .expect("run warren");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.trim().is_empty(), "warren {args:?} printed nothing");
        leaky.assert_clean(&format!("warren {args:?}"), &text);
        if shape == Shape::Tricky {
            // Some of these URLs fail validation, some connections: either way, no secret.
            continue;
        }
        if args == ["config"] {
            assert_eq!(out.status.code(), Some(0), "{text}");
            assert!(text.contains("***"), "{text}");
        } else if args != ["status"] && args != ["status", "--json"] {
            // They fail, and say where they could not connect.
            assert_ne!(out.status.code(), Some(0), "warren {args:?}:\n{text}");
            assert!(
                leaky.ports.iter().any(|p| text.contains(&p.to_string())),
                "warren {args:?} does not name the unreachable server:\n{text}"
            );
        }
    }
}

/// URL settings of the wrong shape (a misplaced or missing `:`, `@` or `//`), given through the
/// environment, `--set` and a `--config` file: `warren config` refuses each naming the setting,
/// and never shows the password.
#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_url_is_refused_without_its_password() {
    let env = TestEnv::new("secrets_shape").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let pw = "S3cretShape";
    let cases = [
        ("AMQP_URL", format!("guest:{pw}@127.0.0.1:5672")),
        ("AMQP_URL", format!("amqp//g:{pw}@h/%2f")),
        ("AMQP_URL", format!("amqp:/g:{pw}@h/%2f")),
        ("AMQP_URL", format!("amqp://guest:{pw}")),
        ("AMQP_URL", format!("amqp://h/%2f,amqp//g:{pw}@h/%2f")),
        ("AMQP_URL", format!("amqp://h/%2f,amqp://g:{pw}")),
        ("DATABASE_URL", format!("warren:{pw}@h/db")),
        ("DATABASE_URL", format!("postgres:/warren:{pw}@h/db")),
        ("DATABASE_URL", format!("postgres://warren:{pw}/db")),
        ("REDIS_URL", format!(":{pw}@127.0.0.1:6379")),
        ("REDIS_URL", format!("redis://u:{pw}")),
    ];
    for (setting, value) in &cases {
        let key = setting.to_ascii_lowercase();
        let file = dir.path().join("warren.toml");
        std::fs::write(&file, format!("{key} = {value:?}\n")).expect("write");
        let file = file.to_string_lossy().into_owned();
        let set = format!("{key}={value}");
        for (how, args) in [
            ("env", vec!["config"]),
            ("--set", vec!["--set", set.as_str(), "config"]),
            ("--config", vec!["--config", file.as_str(), "config"]),
        ] {
            let mut cmd = env.command(&args);
            if how == "env" {
                cmd.env(setting, value);
            } else {
                cmd.env_remove(setting);
            }
            let out = cmd.output().expect("run warren");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                out.status.code(),
                Some(2),
                "{how} {setting}={value}: {text}"
            );
            // A file's setting is named by its key (`amqp_url`), the others by the variable.
            assert!(
                text.to_ascii_lowercase().contains(&key),
                "{how} {setting}={value}: {text}"
            );
            assert!(!text.contains(pw), "{how} {setting}={value}: {text}");
        }
    }
}

/// A running instance whose file gains a malformed `database_url` and gets SIGHUP: the reload
/// fails, and neither the log line nor the `reload_failed` event in Redis shows the password.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_refusing_a_malformed_url_logs_and_stores_no_password() {
    let mut env = TestEnv::new("secrets_reload").await;
    env.set("REGISTRY_HEARTBEAT_MS", "300");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("warren.toml");
    let good = env.setting("DATABASE_URL").expect("set").to_string();
    std::fs::write(&path, format!("database_url = {good:?}\n")).expect("write");
    let file = path.to_string_lossy().into_owned();
    let log = env.log_path();
    let mut cmd = env.command(&["run", "--config", &file, "--declare", "--roles", "consumer"]);
    cmd.env_remove("DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"));
    let mut warren = Warren::new(cmd.spawn().expect("start warren"), log);
    let pid = warren.pid();
    wait_until("registered", Duration::from_secs(30), || async {
        instance(&env, pid).await["status"] == "running"
    })
    .await;
    let pw = "S3cretLEAK";
    std::fs::write(
        &path,
        format!("database_url = \"warren:{pw}@127.0.0.1:5432/warren\"\n"),
    )
    .expect("write");
    warren.signal("HUP");
    let failed = || async {
        stream_events(&env)
            .await
            .into_iter()
            .find(|e| e["type"] == "reload_failed")
    };
    wait_until("a reload_failed event", Duration::from_secs(30), || async {
        failed().await.is_some()
    })
    .await;
    let event = failed().await.expect("seen");
    let reason = event["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("database_url"), "{event}");
    assert!(!event.to_string().contains(pw), "{event}");
    warren
        .wait_for_log("the reload failed", "reload failed")
        .await;
    let logs = warren.logs();
    assert!(!logs.contains(pw), "{logs}");
    warren.terminate_ok(Duration::from_secs(25));
    let logs = warren.logs();
    assert!(!logs.contains(pw), "{logs}");
    for event in stream_events(&env).await {
        assert!(!event.to_string().contains(pw), "{event}");
    }
}
