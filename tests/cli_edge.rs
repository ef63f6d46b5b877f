//! The command line's edge, as a shell user meets it: every subcommand that prints stops
//! quietly (exit 0) when its reader goes away (`| head -1`), and another write error (a full
//! disk) is an error naming stdout; `events --follow` waits across quiet spells and a lost Redis
//! link, printing each event once; `events --last N` counts after the filters; an empty
//! `WARREN_CONFIG` (or `--config ""`) means no file.

mod common;

use std::io::{BufRead as _, BufReader, Read as _};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use uuid::Uuid;

/// How long any one command may take before the test calls it hung.
const BOUND: Duration = Duration::from_secs(60);

/// Waits for `child` at most `BOUND`, killing it past that: (exit code, stderr).
fn finish(mut child: Child, what: &str) -> (i32, String) {
    let deadline = Instant::now() + BOUND;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("warren {what} still running after {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        stderr.read_to_string(&mut err).expect("stderr");
    }
    (child.wait().expect("status").code().unwrap_or(-1), err)
}

/// Runs `warren args` with stdout a pipe whose reader is closed before warren starts, so its
/// first write already hits EPIPE: (exit code, stderr).
fn run_into_closed_pipe(env: &TestEnv, args: &[&str]) -> (i32, String) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let child = env
        .command(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    finish(child, &args.join(" "))
}

/// Runs `warren args` as `| head -1` does: reads one line, then closes the pipe (the output is
/// longer than the pipe's buffer, so warren is still writing): (first line, exit code, stderr).
fn run_into_head(env: &TestEnv, args: &[&str]) -> (String, i32, String) {
    let mut child = env
        .command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("read a line");
    let (code, err) = finish(child, &args.join(" "));
    (first, code, err)
}

/// Asserts that `warren args` ended as a closed stdout must end it: exit 0, nothing on stderr
/// about the pipe, no panic.
fn assert_quiet(args: &[&str], code: i32, err: &str) {
    assert_eq!(code, 0, "warren {args:?}: exit {code}\n{err}");
    let lower = err.to_ascii_lowercase();
    assert!(
        !lower.contains("broken pipe") && !lower.contains("panicked") && !lower.contains("stdout"),
        "warren {args:?} said on stderr:\n{err}"
    );
}

/// One event as warren writes it, for the stream `<prefix>:events`.
fn event(kind: &str, message_id: &str) -> String {
    serde_json::json!({
        "v": 1, "type": kind, "time": "2026-11-28T08:00:00.000000Z", "host": "test-host",
        "pid": 4242, "pipeline": "users", "message_id": message_id,
    })
    .to_string()
}

/// Appends `events` (JSON texts) to the env's stream on the real Redis, in one round trip.
async fn append_events(env: &TestEnv, events: &[String]) {
    let (_, prefix) = redis_of(env);
    let client = redis::Client::open(redis_url()).expect("Redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis answers");
    let mut pipe = redis::pipe();
    for e in events {
        pipe.cmd("XADD")
            .arg(format!("{prefix}:events"))
            .arg("*")
            .arg("event")
            .arg(e)
            .ignore();
    }
    let () = pipe.query_async(&mut conn).await.expect("XADD");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_subcommand_stops_quietly_when_its_reader_goes_away() {
    let env = TestEnv::new("edge_pipes").await;
    env.declare();
    let _cleanup = RedisCleanup::new(&env);
    // Enough of everything for long outputs: 3,000 events, 300 parked rows, 5 dead letters,
    // 50 ctl history lines, a pipelines test input of 5,000 lines.
    let events: Vec<String> = (0..3_000)
        .map(|i| event("parked", &format!("m-{i}")))
        .collect();
    append_events(&env, &events).await;
    for i in 0..300 {
        env.db
            .execute(
                &format!(
                    "INSERT INTO {}.dead_letters (message_id, body, headers, error_kind, \
                     error_reason) VALUES ($1, $2, '{{}}', 'db_permanent', 'parked by the test')",
                    env.schema
                ),
                &[
                    &format!("p-{i}"),
                    &format!("body {i} {}", "x".repeat(200)).as_bytes(),
                ],
            )
            .await
            .expect("insert a parked row");
    }
    for _ in 0..5 {
        let id = Uuid::new_v4();
        env.publish_to_dlq(&user_body(id), json_props(id)).await;
    }
    let (_, prefix) = redis_of(&env);
    let history: Vec<String> = (0..50)
        .map(|i| {
            serde_json::json!({"id": format!("c{i}"), "command": "pause", "host": "h",
                               "pid": 1, "outcome": "executed", "at": 1_700_000_000 + i})
            .to_string()
        })
        .collect();
    let _: i64 = redis_query(
        &env,
        redis::cmd("RPUSH")
            .arg(format!("{prefix}:ctl:history"))
            .arg(&history),
    )
    .await;
    let input = std::env::temp_dir().join(format!("{}-lines.jsonl", env.id));
    let lines: String = (0..5_000)
        .map(|_| String::from_utf8(user_body(Uuid::new_v4())).expect("UTF-8") + "\n")
        .collect();
    std::fs::write(&input, lines).expect("write the input");
    let input = input.to_str().expect("path").to_string();
    let dlq = env.dlq_queue.clone();
    let main = format!("{}/{}", env.main_exchange, env.main_queue);

    let every: Vec<Vec<&str>> = vec![
        vec!["--help"],
        vec!["help", "run"],
        vec!["--version"],
        vec!["config"],
        vec!["config", "--origin"],
        vec!["declare", "--dry-run"],
        vec!["declare"],
        vec!["pipelines"],
        vec!["pipelines", "test", "users", &input],
        vec!["status"],
        vec!["status", "--json"],
        vec!["status", "--watch", "1"],
        vec!["events"],
        vec!["events", "--json", "--last", "3000"],
        vec!["events", "--follow"],
        vec!["dlq", "inspect"],
        vec!["dlq", "inspect", "--json"],
        vec!["dlq", "parked", "list", "--limit", "300"],
        vec!["dlq", "parked", "list", "--json"],
        vec!["ctl", "history", "--limit", "50"],
        vec!["ctl", "history", "--json"],
        vec!["completions", "bash"],
        vec!["completions", "zsh"],
        vec!["man"],
        vec!["man", "run"],
        vec!["publish", "--count", "10"],
        vec!["move", "--from", &dlq, "--to", &main, "--limit", "1"],
    ];
    for args in &every {
        let (code, err) = run_into_closed_pipe(&env, args);
        assert_quiet(args, code, &err);
    }
    // Closed after the first line, with the rest still to write (more than a pipe holds).
    for args in [
        vec!["events"],
        vec!["events", "--json", "--last", "3000"],
        vec!["dlq", "parked", "list", "--limit", "300"],
        vec!["pipelines", "test", "users", &input],
        vec!["completions", "bash"],
    ] {
        let (first, code, err) = run_into_head(&env, &args);
        assert!(!first.trim().is_empty(), "warren {args:?} printed nothing");
        assert_quiet(&args, code, &err);
    }
    // A closed stderr loses the notes beside the answer, never the answer (no panic).
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = env
        .command(&["dlq", "parked", "list", "--json", "--limit", "300"])
        .stdin(Stdio::null())
        .stderr(writer)
        .output()
        .expect("run warren");
    assert_eq!(
        out.status.code(),
        Some(0),
        "parked list --json with stderr closed: {:?}",
        out.status
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 300);
    let _ = std::fs::remove_file(&input);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_under_stdout_is_an_error_naming_stdout() {
    let env = TestEnv::new("edge_full").await;
    let _cleanup = RedisCleanup::new(&env);
    append_events(&env, &[event("parked", "m-1")]).await;
    for args in [
        vec!["config"],
        vec!["events"],
        vec!["pipelines"],
        vec!["man"],
        // clap's own answers: its `exit` ignores a failed write.
        vec!["--help"],
        vec!["--version"],
        vec!["run", "--help"],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let child = env
            .command(&args)
            .stdin(Stdio::null())
            .stdout(full)
            .stderr(Stdio::piped())
            .spawn()
            .expect("start warren");
        let (code, err) = finish(child, &args.join(" "));
        assert_eq!(code, 1, "warren {args:?}: exit {code}\n{err}");
        assert!(
            err.contains("cannot write to stdout: No space left on device")
                && !err.contains("panicked"),
            "warren {args:?}:\n{err}"
        );
    }
}

/// A running `warren events --follow --json`: its stdout and stderr lines as they come.
struct Follower {
    child: Child,
    out: mpsc::Receiver<String>,
    err: mpsc::Receiver<String>,
    /// Every stderr line so far.
    said: Vec<String>,
}

impl Follower {
    fn start(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start warren events --follow");
        let lines = |read: Box<dyn std::io::Read + Send>| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(read).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            rx
        };
        let out = lines(Box::new(child.stdout.take().expect("stdout")));
        let err = lines(Box::new(child.stderr.take().expect("stderr")));
        Follower {
            child,
            out,
            err,
            said: Vec::new(),
        }
    }

    /// The next event printed (its `message_id`), waiting up to 30 s.
    fn next(&mut self) -> String {
        let line = self
            .out
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                panic!("no event printed within 30 s; stderr: {:?}", self.stderr())
            });
        let event: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        event["message_id"]
            .as_str()
            .expect("message_id")
            .to_string()
    }

    /// Everything said on stderr so far.
    fn stderr(&mut self) -> Vec<String> {
        self.said.extend(self.err.try_iter());
        self.said.clone()
    }

    /// Waits up to 30 s for a stderr line containing `text`.
    fn wait_said(&mut self, text: &str) {
        self.wait_said_times(text, 1);
    }

    /// Waits up to 30 s for `n` stderr lines containing `text`.
    fn wait_said_times(&mut self, text: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.stderr().iter().filter(|l| l.contains(text)).count() < n {
            assert!(
                Instant::now() < deadline,
                "stderr never said {text:?}: {:?}",
                self.said
            );
            if let Ok(line) = self.err.recv_timeout(Duration::from_millis(100)) {
                self.said.push(line);
            }
        }
    }

    /// Sends `sig` and waits for the exit code.
    fn stop(mut self, sig: &str) -> i32 {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status();
        let pid = self.child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code().unwrap_or(-1);
            }
            assert!(
                Instant::now() < deadline,
                "warren (pid {pid}) still running 10 s after SIG{sig}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("wait").is_none()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn events_follow_waits_across_quiet_spells_and_a_lost_redis() {
    let redis = TcpProxy::start(&redis_url(), 6379).await;
    let mut env = TestEnv::new("edge_follow").await;
    let _cleanup = RedisCleanup::new(&env);
    env.set("REDIS_URL", redis.url());
    append_events(&env, &[event("parked", "before")]).await;
    let mut follow = Follower::start(&mut env.command(&["events", "--follow", "--json"]));
    assert_eq!(follow.next(), "before");

    // A quiet spell longer than one blocking read (5 s), then an event: still following.
    // (The quiet spell is what is tested, so it is slept, not awaited.)
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        follow.running(),
        "ended in a quiet spell: {:?}",
        follow.stderr()
    );
    append_events(&env, &[event("parked", "after-quiet")]).await;
    assert_eq!(follow.next(), "after-quiet");

    // The link cut: warren says it reconnects; an event appended meanwhile (to Redis itself)
    // is printed once the link is back, once, and the next one after it.
    redis.cut();
    follow.wait_said("reconnecting");
    append_events(&env, &[event("parked", "during-cut")]).await;
    redis.restore();
    assert_eq!(follow.next(), "during-cut");
    append_events(&env, &[event("parked", "sentinel")]).await;
    assert_eq!(follow.next(), "sentinel", "an event was printed twice");
    let told = follow
        .stderr()
        .iter()
        .filter(|l| l.contains("reconnecting"))
        .count();
    assert_eq!(told, 1, "{:?}", follow.said);

    // A link that goes silent without closing (a partition): noticed by the link's bound on an
    // answer, made again once the network is back, nothing lost or repeated.
    redis.freeze();
    append_events(&env, &[event("parked", "during-freeze")]).await;
    follow.wait_said_times("reconnecting", 2);
    redis.thaw();
    assert_eq!(follow.next(), "during-freeze");
    append_events(&env, &[event("parked", "sentinel-2")]).await;
    assert_eq!(follow.next(), "sentinel-2", "an event was printed twice");
    assert_eq!(follow.stop("INT"), 0);

    // SIGTERM ends it the same way, also while the link is down.
    let mut follow = Follower::start(&mut env.command(&["events", "--follow", "--json"]));
    assert_eq!(follow.next(), "before");
    redis.cut();
    follow.wait_said("reconnecting");
    assert_eq!(follow.stop("TERM"), 0);
    redis.restore();
}

/// `warren <args>` (a `status --watch`): its first line of output, then SIGINT; its exit code
/// and stderr with the line.
fn first_line_then_sigint(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let mut child = env
        .command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren status --watch");
    let mut first = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    out.read_line(&mut first).expect("a first redraw");
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    // Keep reading so a redraw never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let (code, err) = finish(child, "status --watch");
    (code, err, first)
}

#[tokio::test(flavor = "multi_thread")]
async fn status_watch_ends_with_exit_0_on_sigint() {
    let env = TestEnv::new("edge_watch").await;
    let _cleanup = RedisCleanup::new(&env);
    let (code, err, first) = first_line_then_sigint(&env, &["status", "--watch", "1", "--json"]);
    assert!(first.starts_with('{'), "{first}");
    assert_eq!(code, 0, "{err}");

    // The tables into a pipe: snapshots one after the other, no terminal escape codes.
    let (code, err, first) = first_line_then_sigint(&env, &["status", "--watch", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(!first.is_empty(), "no snapshot:\n{err}");
    assert!(
        !first.contains('\x1b'),
        "escape codes written into a pipe: {first:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn events_last_counts_the_events_that_pass_the_filters() {
    let env = TestEnv::new("edge_last").await;
    let _cleanup = RedisCleanup::new(&env);
    // Three parked events, then more other events than one page of the backwards read holds.
    let mut events: Vec<String> = ["p1", "p2", "p3"]
        .iter()
        .map(|id| event("parked", id))
        .collect();
    events.extend((0..1_200).map(|i| event("batch_committed", &format!("b{i}"))));
    // And, newest, an entry that is no event: filtered out by --type, and with --json shown as a
    // JSON object (the review of 2026-11-28 found a bare text line in the JSON output).
    events.push("garbage".into());
    append_events(&env, &events).await;

    let ids = |out: &str| -> Vec<String> {
        out.lines()
            .map(|l| {
                let e: serde_json::Value =
                    serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
                e["message_id"].as_str().expect("message_id").to_string()
            })
            .collect()
    };
    let (code, out, err) = env
        .run_async(&["events", "--last", "2", "--type", "parked", "--json"])
        .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        ids(&out),
        ["p2", "p3"],
        "the newest two parked, oldest first"
    );
    let (code, out, err) = env
        .run_async(&["events", "--last", "10", "--type", "parked", "--json"])
        .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        ids(&out),
        ["p1", "p2", "p3"],
        "every parked one, the stream exhausted"
    );
    let (code, out, err) = env.run_async(&["events", "--last", "2", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "no filter: the newest two\n{out}");
    assert_eq!(lines[0]["message_id"], "b1199", "{out}");
    assert!(
        lines[1]["unreadable"]
            .as_str()
            .is_some_and(|u| u.contains("garbage")),
        "{out}"
    );
    // A pipeline no instance runs and the configuration does not name is an error that lists
    // the known ones (docs/events.md), not an empty answer.
    let (code, out, err) = env
        .run_async(&["events", "--last", "1", "--pipeline", "nosuch", "--json"])
        .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("no pipeline \"nosuch\"") && err.contains("known: users"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_warren_config_means_no_file() {
    let env = TestEnv::new("edge_config").await;
    let (code, plain, err) = env.run(&["config"]);
    assert_eq!(code, 0, "{err}");
    let mut cmd = env.command(&["config"]);
    cmd.env("WARREN_CONFIG", "");
    let out = cmd.output().expect("run warren");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), plain);
    let (code, out, err) = env.run(&["--config", "", "config"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, plain);
    // A file that is not there is still an error naming it.
    let (code, _, err) = env.run(&["--config", "/nonexistent/warren.toml", "config"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/warren.toml"), "{err}");
}

/// Review R40a F7: `warren status` against a broker that refuses the login said "broker
/// unreachable", sending the operator after the network; it now says what the broker answered.
#[tokio::test(flavor = "multi_thread")]
async fn status_says_what_the_broker_answered() {
    let mut env = TestEnv::new("edge_status_login").await;
    let url = amqp_url().replace("guest:guest@", "guest:not-the-password@");
    assert_ne!(url, amqp_url(), "the test's AMQP_URL has guest:guest");
    env.set("AMQP_URL", url);
    let (_, out, err) = env.run_async(&["status"]).await;
    assert!(
        out.contains("did not answer:") && out.contains("ACCESS_REFUSED"),
        "{out}{err}"
    );
    assert!(!out.contains("not-the-password"), "{out}");
}
