//! The `warren` command line: bad settings stop `run` with exit code 2 and a message naming the
//! setting, `config` shows the effective settings with passwords redacted, and `publish`
//! (generated load with invalid messages, or JSON lines from stdin) end to end.

mod common;

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lapin::types::AMQPValue;
use uuid::Uuid;

/// Runs `cmd` to completion, killing it after `timeout` (a `run` that should have refused to
/// start must not hang the test): (exit code, stdout, stderr).
fn run_bounded(mut cmd: Command, timeout: Duration) -> (i32, String, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "warren still running after {timeout:?}:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `warren run` with `env`'s settings plus `extra` variables and `args` must exit 2 at once
/// with `message` on stderr.
fn assert_refused(env: &TestEnv, extra: &[(&str, &str)], args: &[&str], message: &str) {
    let mut cmd = env.command(args);
    cmd.envs(extra.iter().copied());
    let (code, out, err) = run_bounded(cmd, Duration::from_secs(10));
    assert_eq!(
        code, 2,
        "warren {args:?} with {extra:?}: exit {code}\n{out}\n{err}"
    );
    assert!(
        err.contains(message),
        "warren {args:?} with {extra:?}: stderr lacks {message:?}:\n{err}"
    );
    // Refused before doing anything: one line, no logs of a started pipeline.
    assert!(!err.contains("warren running"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_settings_stop_run_with_exit_code_2_naming_them() {
    let env = TestEnv::new("cli_bad").await;
    assert_refused(
        &env,
        &[("USERS_BATCH_SIZE", "abc")],
        &["run"],
        r#"USERS_BATCH_SIZE: expected an integer from 1 to 10000, got "abc""#,
    );
    assert_refused(
        &env,
        &[],
        &["run", "--set", "users_batch_size=0"],
        "USERS_BATCH_SIZE: expected an integer from 1 to 10000, got 0",
    );
    // `--set` before the subcommand is the same flag.
    assert_refused(
        &env,
        &[],
        &["--set", "users_batch_size=10001", "run"],
        "USERS_BATCH_SIZE: expected an integer from 1 to 10000, got 10001",
    );
    assert_refused(
        &env,
        &[],
        &["run", "--set", "nope=1"],
        "unknown setting `nope` in --set",
    );
    assert_refused(
        &env,
        &[],
        &["run", "--set", "users_batch_size"],
        "expected KEY=VALUE",
    );
    assert_refused(
        &env,
        &[("AMQP_URL", "http://127.0.0.1:5672")],
        &["run"],
        r#"AMQP_URL: expected a URL starting with amqp:// or amqps://, got "http://127.0.0.1:5672""#,
    );
    assert_refused(
        &env,
        &[("AMQP_URL", "not a url")],
        &["run"],
        r#"AMQP_URL: expected a URL starting with amqp:// or amqps://, got "not a url""#,
    );
    // The CLI flag wins over a good environment value, and a bad one is refused even when the
    // environment is fine.
    assert_refused(
        &env,
        &[("USERS_BATCH_SIZE", "500")],
        &["run", "--roles", "consumer,web"],
        "ROLES: expected a comma-separated subset of consumer,dlq,api",
    );
    // Nothing was declared or consumed by the refused runs.
    let (code, out, err) = env.run(&["declare", "--dry-run"]);
    assert_eq!(code, 0, "{out}\n{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_amqp_url_the_amqp_client_cannot_parse_is_refused_at_startup() {
    // A well-formed URL whose query the AMQP client refuses (heartbeat is a number of seconds):
    // no connection can ever be made with it, so it is a bad value like any other.
    let env = TestEnv::new("cli_bad_url").await;
    assert_refused(
        &env,
        &[(
            "AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10s",
        )],
        &["run", "--roles", "consumer"],
        "AMQP_URL:",
    );
}

/// `amqps://` goes through the TLS stack (rustls with the ring provider): against the broker's
/// plain AMQP port the handshake fails and the command says so, naming the broker without its
/// password; a TLS stack built without a provider would panic here instead.
#[tokio::test(flavor = "multi_thread")]
async fn an_amqps_url_speaks_tls_and_a_failed_handshake_is_an_error_not_a_panic() {
    let mut env = TestEnv::new("cli_amqps").await;
    let plain = url::Url::parse(&amqp_url()).expect("AMQP URL");
    let port = plain.port().unwrap_or(5672);
    env.set(
        "AMQP_URL",
        format!("amqps://guest:s3cret@127.0.0.1:{port}/%2f"),
    )
    .set("AMQP_CONNECT_TIMEOUT_MS", "3000");
    let (code, out, err) = run_bounded(env.command(&["declare"]), Duration::from_secs(60));
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains(&format!(
            "cannot reach the broker at amqps://guest:***@127.0.0.1:{port}"
        )),
        "{err}"
    );
    assert!(
        !err.contains("s3cret") && !err.contains("panicked"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn config_prints_the_effective_settings_with_passwords_redacted() {
    let mut env = TestEnv::new("cli_config").await;
    env.set("USERS_BATCH_SIZE", "123")
        .set("REDIS_URL", "redis://:hunter2@127.0.0.1:6379");
    let (code, out, err) = env.run(&["config"]);
    assert_eq!(code, 0, "{out}\n{err}");

    // Valid TOML with exactly the settings of the shipped config/default.toml.
    let table: toml::Table = out.parse().unwrap_or_else(|e| panic!("{e}:\n{out}"));
    let shipped: toml::Table =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/default.toml"))
            .unwrap()
            .parse()
            .unwrap();
    let keys = |t: &toml::Table| t.keys().cloned().collect::<std::collections::BTreeSet<_>>();
    assert_eq!(keys(&table), keys(&shipped), "{out}");
    // The environment override and the env's own names are in effect.
    assert_eq!(table["users_batch_size"].as_integer(), Some(123), "{out}");
    assert_eq!(table["main_queue"].as_str(), Some(env.main_queue.as_str()));
    assert_eq!(table["retry_ttl_ms"].as_integer(), Some(10_000));
    assert!(out.contains("# effective prefetch: 492"), "{out}");

    // Passwords redacted, users and hosts kept.
    assert_eq!(
        table["amqp_url"].as_str(),
        Some("amqp://guest:***@127.0.0.1:5672/%2f"),
        "{out}"
    );
    assert_eq!(
        table["database_url"].as_str(),
        Some("postgres://warren:***@127.0.0.1:5432/warren"),
        "{out}"
    );
    assert!(
        table["redis_url"]
            .as_str()
            .is_some_and(|u| u.contains(":***@127.0.0.1:6379")),
        "{out}"
    );
    for secret in [":guest@", ":warren@", "hunter2"] {
        assert!(!out.contains(secret), "{secret} shown:\n{out}");
    }

    // `--set` wins over the environment.
    let (code, out, err) = env.run(&["config", "--set", "users_batch_size=77"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("users_batch_size = 77"), "{out}");
    assert!(out.contains("# effective prefetch: 308"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_with_invalid_messages_sends_them_to_the_dlq() {
    let env = TestEnv::new("cli_pub_inv").await;
    env.declare();
    let (code, out, err) = env.run(&["publish", "--count", "500", "--invalid-every", "100"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("published 500 messages"), "{out}");
    assert!(out.contains(", 0 failed"), "{out}");
    assert_eq!(env.queue_state(&env.main_queue).await.0, 500);

    // Only the main consumer: the DLQ consumer would take the dead letters away.
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("495 rows", Duration::from_secs(30), || async {
        env.count_rows().await >= 495
    })
    .await;
    wait_until(
        "5 dead letters and an empty main queue",
        Duration::from_secs(15),
        || async {
            env.queue_state(&env.dlq_queue).await.0 == 5
                && env.queue_state(&env.main_queue).await.0 == 0
        },
    )
    .await;
    assert_eq!(env.count_rows().await, 495, "log:\n{}", warren.logs());
    warren.terminate_ok(Duration::from_secs(30));

    let dead = env.drain_queue(&env.dlq_queue, 10).await;
    assert_eq!(dead.len(), 5);
    let mut kinds = Vec::new();
    for m in &dead {
        let headers = m
            .properties
            .headers()
            .clone()
            .expect("headers on a dead letter");
        let header = |key: &str| match headers.inner().get(key) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("{key}: {other:?} on {:?}", String::from_utf8_lossy(&m.data)),
        };
        let kind = header("x-error-kind");
        assert!(!header("x-error-reason").is_empty());
        // The body is the original one, unchanged.
        let body = String::from_utf8_lossy(&m.data).into_owned();
        match kind.as_str() {
            "invalid_json" => assert!(body.starts_with("not json"), "{body}"),
            "invalid_payload" => assert!(body.contains("not-an-email"), "{body}"),
            other => panic!("unexpected x-error-kind {other}"),
        }
        kinds.push(kind);
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "invalid_json",
            "invalid_json",
            "invalid_json",
            "invalid_payload",
            "invalid_payload"
        ]
    );
    assert_queue_empty(&env, &env.retry_queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_stdin_sends_json_lines_and_names_the_bad_one() {
    let env = TestEnv::new("cli_pub_stdin").await;
    env.declare();
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let lines = [
        String::from_utf8(user_body(ids[0])).unwrap(),
        String::from_utf8(user_body(ids[1])).unwrap(),
        "this line is not JSON".to_string(),
        String::from_utf8(user_body(ids[2])).unwrap(),
        "[1, 2]".to_string(),
    ];
    let mut child = env
        .command(&["publish", "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren publish");
    {
        let mut stdin = child.stdin.take().unwrap();
        for line in &lines {
            writeln!(stdin, "{line}").unwrap();
        }
    }
    let out = tokio::task::block_in_place(|| child.wait_with_output()).expect("publish");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("published 3 messages"), "{stdout}");
    assert!(
        stderr.contains("line 3: not JSON"),
        "stderr does not name line 3:\n{stderr}"
    );
    assert!(
        stderr.contains("line 5: expected a JSON object"),
        "stderr does not name line 5:\n{stderr}"
    );
    assert!(
        !stderr.contains("line 1:") && !stderr.contains("line 4"),
        "{stderr}"
    );
    assert_eq!(env.queue_state(&env.main_queue).await.0, 3);

    let mut warren = env.start(&["--roles", "consumer"]);
    wait_until("3 rows", Duration::from_secs(30), || async {
        env.count_rows().await >= 3
    })
    .await;
    wait_until("the main queue empty", Duration::from_secs(10), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_eq!(env.row_ids().await, ids.iter().copied().collect());
    let email: String = env
        .db
        .query_one("SELECT email FROM users WHERE id = $1", &[&ids[1]])
        .await
        .unwrap()
        .get(0);
    assert_eq!(email, format!("{}@example.com", ids[1]));
    assert_queue_empty(&env, &env.dlq_queue).await;
    warren.terminate_ok(Duration::from_secs(30));
}

/// Settings are easy to discover and hard to get silently wrong: `WARREN_<NAME>` wins over the
/// bare name, a `WARREN_*` variable that is no setting stops warren naming the closest one,
/// `config --origin` says where each value comes from, `run --help` lists every variable and
/// the exit codes, and a host name is accepted in a listen address. Kubernetes' service links
/// (`WARREN_SERVICE_HOST`, ...) are not taken for misspelled settings.
#[tokio::test(flavor = "multi_thread")]
async fn settings_answer_to_warren_names_and_a_misspelled_one_is_refused() {
    let env = TestEnv::new("cli_names").await;
    let run = |vars: &[(&str, &str)], args: &[&str]| {
        let mut cmd = env.command(args);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        run_bounded(cmd, Duration::from_secs(30))
    };

    let (code, out, err) = run(
        &[("WARREN_USERS_BATCH_SIZE", "7"), ("USERS_BATCH_SIZE", "9")],
        &["config", "--origin"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l == "users_batch_size = 7  # environment WARREN_USERS_BATCH_SIZE"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("dlq_max_attempts = ") && l.ends_with("# default")),
        "{out}"
    );

    for args in [&["config"][..], &["run", "--roles", "consumer"]] {
        let (code, out, err) = run(&[("WARREN_USER_BATCH_SIZE", "10")], args);
        assert_eq!(code, 2, "warren {args:?}:\n{out}{err}");
        assert!(
            err.contains(
                "WARREN_USER_BATCH_SIZE: no such setting (did you mean WARREN_USERS_BATCH_SIZE?)"
            ),
            "{err}"
        );
    }
    // The harness's own variables are not settings and are allowed.
    let (code, _, err) = run(&[("WARREN_TEST_SOMETHING", "1")], &["config"]);
    assert_eq!(code, 0, "{err}");
    // Nor are Kubernetes' service links of a Service named `warren`: the pod must start.
    let links = [
        ("WARREN_SERVICE_HOST", "10.96.0.12"),
        ("WARREN_SERVICE_PORT", "9898"),
        ("WARREN_PORT", "tcp://10.96.0.12:9898"),
        ("WARREN_PORT_9898_TCP", "tcp://10.96.0.12:9898"),
        ("WARREN_PORT_9898_TCP_ADDR", "10.96.0.12"),
    ];
    let (code, _, err) = run(&links, &["config"]);
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = run(&[], &["run", "--help"]);
    assert_eq!(code, 0, "{err}");
    for expected in [
        "ENVIRONMENT:",
        "USERS_BATCH_SIZE (or WARREN_USERS_BATCH_SIZE)",
        "The largest batch insert, in messages",
        "EXIT STATUS:",
        "  2    a bad setting",
    ] {
        assert!(
            out.contains(expected),
            "{expected:?} missing from run --help:\n{out}"
        );
    }
    assert!(!out.contains("guest:guest"), "{out}");

    let port = free_port();
    let (code, out, err) = run(&[("HTTP_ADDR", &format!("localhost:{port}"))], &["config"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("http_addr = \"localhost:{port}\"")),
        "{out}"
    );
    let (code, _, err) = run(&[("METRICS_ADDR", "no-such-host.invalid:9")], &["config"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("METRICS_ADDR: expected an address host:port"),
        "{err}"
    );
}

/// `warren run --declare` (what scripts/run.sh runs) with the database away at start waits for
/// it as `warren run` does (issue 34, item 11): it declares the topology, says it waits (the same
/// line), consumes nothing meanwhile, and once the database answers it applies the migrations,
/// checks the tables and consumes every message once. It exited 1 at once before.
#[tokio::test(flavor = "multi_thread")]
async fn run_declare_waits_for_the_database_then_migrates_and_consumes() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("cli_declare_waits").await;
    env.set("DATABASE_URL", proxy.url());
    proxy.cut();
    let mut warren = env.start(&["--declare", "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !warren
        .logs()
        .contains("cannot check the pipelines' tables yet")
    {
        assert!(
            warren.is_running(),
            "warren run --declare exited while the database was away:\n{}",
            warren.logs()
        );
        assert!(
            Instant::now() < deadline,
            "no wait for the database in 30 s:\n{}",
            warren.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        warren.logs().contains("cannot migrate the database"),
        "the wait names what it waits for:\n{}",
        warren.logs()
    );
    // The topology is declared (the queue exists and takes messages); nothing is consumed.
    let ids = env.publish_users(200).await;
    assert_eq!(
        env.queue_state(&env.main_queue).await,
        (200, 0),
        "nothing is consumed before the database is migrated and checked"
    );
    assert!(warren.is_running(), "{}", warren.logs());

    proxy.restore();
    // The users table exists once the migrations ran: only then can its rows be counted.
    wait_until(
        "the migrations applied",
        Duration::from_secs(60),
        || async {
            warren
                .logs()
                .contains("topology declared and migrations applied")
        },
    )
    .await;
    let expected: std::collections::HashSet<Uuid> = ids.into_iter().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}

/// Found by the review: a database that takes the connection and never answers (half-open,
/// partitioned) left `warren declare` hanging for ever (and `run --declare` silent): the
/// migration's connection had no bound. Now `declare` exits 1 within the connect timeout and
/// one statement's bound, naming the silence.
#[tokio::test(flavor = "multi_thread")]
async fn declare_against_a_database_that_never_answers_exits_1_within_its_bound() {
    // Accepts connections and never reads or answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = silent.local_addr().expect("address").port();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let mut env = TestEnv::new("cli_declare_silent").await;
    env.set(
        "DATABASE_URL",
        format!("postgres://warren:warren@127.0.0.1:{port}/warren"),
    )
    .set("DATABASE_STATEMENT_TIMEOUT_MS", "500");
    let started = Instant::now();
    let (code, out, err) =
        tokio::time::timeout(Duration::from_secs(60), env.run_async(&["declare"]))
            .await
            .expect("declare still running after 60 s: it hangs on a silent database");
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("no answer from the database within 7500 ms"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    holder.abort();
}

/// Found by the review: `publish --stdin --rate R` ignored the rate (3,000 lines at 3,137 msg/s
/// with `--rate 1000`). The i-th line now goes no earlier than i / R seconds after the start:
/// 40 lines at 40 msg/s take at least 39/40 s, which an unpaced publish does in milliseconds.
#[tokio::test(flavor = "multi_thread")]
async fn publish_stdin_keeps_its_rate() {
    let env = TestEnv::new("cli_pub_rate").await;
    env.declare();
    let mut child = env
        .command(&["publish", "--stdin", "--rate", "40"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren publish");
    {
        let mut stdin = child.stdin.take().unwrap();
        for _ in 0..40 {
            let line = String::from_utf8(user_body(Uuid::new_v4())).unwrap();
            writeln!(stdin, "{line}").unwrap();
        }
    }
    let out = tokio::task::block_in_place(|| child.wait_with_output()).expect("publish");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    // "published 40 messages in S s (R msg/s), 0 failed"
    let secs: f64 = stdout
        .split(" in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no duration in {stdout:?}"));
    assert!(stdout.contains("published 40 messages"), "{stdout}");
    assert!(secs >= 0.97, "40 lines at 40 msg/s in {secs} s: {stdout}");
    assert_eq!(env.queue_state(&env.main_queue).await.0, 40);
}

/// Found by the second review: a line of `publish --stdin` that is not UTF-8 ended the input
/// there (exit 0, the lines after it unpublished). It is named and skipped like a line that is
/// not JSON, and the lines after it are published.
#[tokio::test(flavor = "multi_thread")]
async fn publish_stdin_skips_a_line_that_is_not_utf8_and_goes_on() {
    let env = TestEnv::new("cli_pub_utf8").await;
    env.declare();
    let mut child = env
        .command(&["publish", "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren publish");
    {
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&user_body(Uuid::new_v4())).unwrap();
        stdin.write_all(b"\n{\"name\":\"a\xff\"}\n").unwrap();
        stdin.write_all(&user_body(Uuid::new_v4())).unwrap();
        stdin.write_all(b"\n").unwrap();
    }
    let out = tokio::task::block_in_place(|| child.wait_with_output()).expect("publish");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("published 2 messages"), "{stdout}");
    assert!(stderr.contains("line 2: not UTF-8, skipped"), "{stderr}");
    assert_eq!(env.queue_state(&env.main_queue).await.0, 2);
}
