//! The tools that read the instance registry tell a Redis that cannot be reached from a Redis
//! without a live instance, and say how to mend each: `warren dlq ... parked list` needs only
//! PostgreSQL, so it lists a pipeline's parked rows with Redis down (warning that whether an
//! instance runs it is unknown) or with no instance registered; `inspect`, `replay`, `parked
//! replay` and `--instance` say that the live instances are unknown, not that none runs the
//! pipeline, and how to start Redis; `warren status`, `warren ctl` and `warren events` say which
//! of the two they met, with what to do (review of issue 35, R35-F10: every one of them answered
//! "no live instance runs it" with Redis down).

mod common;

use common::*;
use serde_json::Value;

/// The settings that name the built-in users pipeline's queues (an operator without the
/// instance's configuration has none of them).
const NAME_VARS: [&str; 6] = [
    "MAIN_EXCHANGE",
    "MAIN_QUEUE",
    "RETRY_EXCHANGE",
    "RETRY_QUEUE",
    "DLX_EXCHANGE",
    "DLQ_QUEUE",
];

/// `warren ARGS` with the env's settings, `REDIS_URL` replaced by `redis` when given, and
/// without the users naming settings when `unnamed`: (exit code, stdout, stderr).
async fn run(
    env: &TestEnv,
    redis: Option<&str>,
    unnamed: bool,
    args: &[&str],
) -> (i32, String, String) {
    let mut cmd = env.command(args);
    if let Some(url) = redis {
        cmd.env("REDIS_URL", url);
    }
    if unnamed {
        for key in NAME_VARS {
            cmd.env_remove(key);
        }
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run warren");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Parks `n` rows for `pipeline` in the env's `dead_letters`, as the DLQ consumer files them.
async fn park(env: &TestEnv, pipeline: &str, n: usize) {
    for i in 0..n {
        env.db
            .execute(
                "INSERT INTO dead_letters (message_id, body, error_kind, error_reason, pipeline) \
                 VALUES ($1, $2, 'invalid_json', 'not JSON', $3)",
                &[&format!("{pipeline}-{i}"), &b"not json".to_vec(), &pipeline],
            )
            .await
            .expect("park a row");
    }
}

/// What a tool must never say while Redis cannot be asked: that no instance runs a pipeline.
const NOBODY: &str = "no live instance runs it";

#[tokio::test(flavor = "multi_thread")]
async fn the_tools_tell_a_redis_that_is_down_from_a_registry_without_instances() {
    let env = TestEnv::new("cli_registry").await;
    let _redis = RedisCleanup::new(&env);
    env.declare();
    park(&env, "orders", 2).await;
    // A port nothing listens on: Redis down.
    let down = format!("redis://127.0.0.1:{}", free_port());
    let down = Some(down.as_str());

    // Redis down: the parked rows of a pipeline nobody configures are listed from the
    // database, with a warning, exit 0.
    let (code, out, err) = run(
        &env,
        down,
        false,
        &["dlq", "--pipeline", "orders", "parked", "list"],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("for pipeline orders, not replayed: 2 messages, 2 shown"),
        "{out}\n{err}"
    );
    assert!(out.contains("orders-1"), "{out}");
    assert!(
        err.contains("warning: cannot reach Redis at")
            && err.contains("whether a live instance runs pipeline \"orders\" is unknown"),
        "{err}"
    );
    assert!(!err.contains(NOBODY), "{err}");
    let (code, out, err) = run(
        &env,
        down,
        false,
        &["dlq", "--pipeline", "orders", "parked", "list", "--json"],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out.lines().count(), 2, "{out}");

    // What needs the pipeline's queues says that the instances are unknown, and how to start
    // Redis, never that none runs it.
    for args in [
        &["dlq", "--pipeline", "orders", "inspect"][..],
        &["dlq", "--pipeline", "orders", "replay"],
        &["dlq", "--pipeline", "orders", "parked", "replay"],
    ] {
        let (code, out, err) = run(&env, down, false, args).await;
        assert_eq!(code, 1, "{args:?}: {out}\n{err}");
        assert!(
            err.contains("no pipeline \"orders\" in the configuration, and the live instances are unknown (cannot reach Redis at")
                && err.contains("start Redis (`systemctl start redis-server`")
                && err.contains("known: users\n"),
            "{args:?}: {err}"
        );
        assert!(!err.contains(NOBODY), "{args:?}: {err}");
    }
    let (code, out, err) = run(&env, down, false, &["dlq", "--instance", "vm:1", "inspect"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("--instance vm:1: the live instances are unknown (cannot reach Redis at")
            && err.contains("start Redis"),
        "{err}"
    );
    assert!(!err.contains("no live instance vm:1"), "{err}");
    // users on the built-in names (no naming setting): acted on, with a warning that a live
    // instance may run it elsewhere. Nothing is parked for users: the replay publishes nothing.
    let (code, out, err) = run(&env, down, true, &["dlq", "parked", "replay"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("the queues of pipeline \"users\" are the built-in defaults (raffle_queue")
            && err.contains("a live instance may not run on"),
        "{err}"
    );

    // ctl and events go through Redis: they say it cannot be reached and how to start it,
    // never that no instance runs the pipeline.
    for args in [
        &["ctl", "pause", "--all"][..],
        &["ctl", "pause", "--all", "--pipeline", "orders"],
        &["events"],
        &["events", "--pipeline", "orders"],
    ] {
        let (code, out, err) = run(&env, down, false, args).await;
        assert_eq!(code, 1, "{args:?}: {out}\n{err}");
        assert!(
            err.contains("cannot reach Redis at")
                && (err.contains("through Redis") || err.contains("from Redis"))
                && err.contains("start Redis (`systemctl start redis-server`")
                && err.contains("REDIS_URL"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("no live instance"), "{args:?}: {err}");
    }

    // status: the instances are unknown, and how to start Redis; the queues are still shown.
    let (code, out, err) = run(&env, down, false, &["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("instances: unknown, Redis unreachable (cannot reach Redis at")
            && out.contains("start Redis (`systemctl start redis-server`"),
        "{out}"
    );
    assert!(out.contains(&env.main_queue), "{out}");
    let (code, out, err) = run(&env, down, false, &["status", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(doc["instances"], Value::Null, "{doc}");
    assert!(
        doc["registry_error"]
            .as_str()
            .is_some_and(|e| e.starts_with("cannot reach Redis at") && e.contains("start Redis")),
        "{doc}"
    );

    // Redis up, no instance registered under the env's prefix: the parked rows are listed
    // without a warning; a name nobody knows with nothing parked is refused (exit 1), naming the known ones; the tools that need
    // the queues say that no live instance runs the pipeline, and what to do.
    let (code, out, err) = run(
        &env,
        None,
        false,
        &["dlq", "--pipeline", "orders", "parked", "list"],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("2 messages, 2 shown"), "{out}");
    assert!(!err.contains("warning") && !err.contains("note"), "{err}");
    let (code, out, err) = run(
        &env,
        None,
        false,
        &["dlq", "--pipeline", "ordres", "parked", "list"],
    )
    .await;
    assert_eq!(
        code, 1,
        "a misspelt name with nothing parked is refused: {out}\n{err}"
    );
    assert!(
        err.contains("no pipeline \"ordres\": the configuration does not name it and no live instance runs it")
            && err.contains("known: users"),
        "{err}"
    );
    let (code, out, err) = run(
        &env,
        None,
        false,
        &["dlq", "--pipeline", "orders", "inspect"],
    )
    .await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains(NOBODY) && err.contains("start an instance that runs it"),
        "{err}"
    );
    assert!(!err.contains("Redis"), "{err}");
    // ctl and events: Redis answers and no instance runs the pipeline; how to start one.
    for args in [
        &["ctl", "pause", "--all", "--pipeline", "orders"][..],
        &["events", "--pipeline", "orders"],
    ] {
        let (code, out, err) = run(&env, None, false, args).await;
        assert_eq!(code, 1, "{args:?}: {out}\n{err}");
        assert!(
            err.contains(NOBODY) && err.contains("start an instance that runs it"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("Redis"), "{args:?}: {err}");
    }
    let (code, out, err) = run(&env, None, false, &["ctl", "pause", "--all"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("no live instance registered under REDIS_PREFIX")
            && err.contains("answers")
            && err.contains("start one with `warren run`"),
        "{err}"
    );
    let (code, out, err) = run(&env, None, false, &["status"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("no live instance is registered under REDIS_PREFIX")
            && out.contains("start one with `warren run`"),
        "{out}"
    );
    let (code, out, _) = run(&env, None, false, &["status", "--json"]).await;
    assert_eq!(code, 0, "{out}");
    let doc: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(doc["instances"], serde_json::json!([]), "{doc}");
    assert_eq!(doc["registry_error"], Value::Null, "{doc}");
}
