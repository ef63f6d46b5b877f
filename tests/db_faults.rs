//! Database faults under a running warren, injected per test through a TCP proxy in front of
//! PostgreSQL: backends terminated by the server, a 60 s outage during a steady publish, and a
//! failover in which the first host of a multi-host URL stops taking writes.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread")]
async fn backends_terminated_by_the_server_lose_nothing() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_terminate").await;
    env.set("DATABASE_URL", proxy.url());
    env.declare();
    let total = 40_000usize;
    let expected: HashSet<Uuid> = env.publish_users(total).await.into_iter().collect();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    for threshold in [5_000i64, 15_000, 25_000] {
        wait_until(
            &format!("{threshold} rows"),
            Duration::from_secs(60),
            || async { env.count_rows().await >= threshold },
        )
        .await;
        let killed = terminate_backends(&proxy.backend_client_ports()).await;
        let rows = env.count_rows().await;
        assert!(killed >= 1, "no warren backend to terminate at {rows} rows");
        assert!(
            rows < total as i64,
            "the run was over ({rows} rows) before the backends were terminated"
        );
    }

    assert_rows_exactly(&env, &expected, Duration::from_secs(120), &|| warren.logs()).await;
    wait_until("main queue empty", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0, "DLQ not empty");
    assert_eq!(env.count_rows().await, total as i64);
}

/// Publishes `n` users every `every` until `duration` is over; returns their ids and the highest
/// DLQ depth seen meanwhile.
async fn publish_steadily(
    env: &TestEnv,
    n: usize,
    every: Duration,
    duration: Duration,
) -> (Vec<Uuid>, u32) {
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut dlq_max = 0;
    while started.elapsed() < duration {
        let tick = Instant::now();
        ids.extend(env.publish_users(n).await);
        dlq_max = dlq_max.max(env.queue_state(&env.dlq_queue).await.0);
        // The publish rate, not a wait on a condition.
        tokio::time::sleep(every.saturating_sub(tick.elapsed())).await;
    }
    (ids, dlq_max)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_60_s_database_outage_holds_messages_in_the_queue_and_loses_none() {
    let prefetch = 500u32;
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_outage").await;
    env.set("DATABASE_URL", proxy.url())
        .set("RETRY_TTL_MS", "10000")
        .set("MAX_RETRIES", "3")
        .set("PREFETCH", prefetch.to_string());
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    // Steady traffic while the database is up: all of it lands.
    let (before, _) =
        publish_steadily(&env, 50, Duration::from_millis(500), Duration::from_secs(3)).await;
    let mut expected: HashSet<Uuid> = before.into_iter().collect();
    let n = expected.len() as i64;
    wait_until(
        "the rows published before the outage",
        Duration::from_secs(30),
        || async { env.count_rows().await == n },
    )
    .await;
    wait_until("main queue empty", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;

    // The database is down for 60 s while publishing goes on at 100 messages a second.
    proxy.cut();
    let (during, dlq_max) = publish_steadily(
        &env,
        50,
        Duration::from_millis(500),
        Duration::from_secs(60),
    )
    .await;
    let (ready, _) = env.queue_state(&env.main_queue).await;
    let (retrying, _) = env.queue_state(&env.retry_queue).await;
    proxy.restore();
    let published = during.len();
    expected.extend(during);
    eprintln!(
        "outage: {published} published, {ready} ready in the main queue, {retrying} in the retry \
         queue, DLQ up to {dlq_max}"
    );

    assert!(
        ready as usize + prefetch as usize >= published,
        "warren kept consuming while the database was down: after 60 s only {ready} of the \
         {published} messages published meanwhile are ready in the main queue \
         ({retrying} in the retry queue, up to {dlq_max} seen in the DLQ); log:\n{}",
        warren.logs()
    );
    assert_eq!(
        dlq_max,
        0,
        "messages were dead-lettered during the outage; log:\n{}",
        warren.logs()
    );

    // Every row after the database came back.
    assert_rows_exactly(&env, &expected, Duration::from_secs(90), &|| warren.logs()).await;
    wait_until("main queue empty", Duration::from_secs(30), || async {
        env.queue_state(&env.main_queue).await.0 == 0
    })
    .await;
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0, "DLQ not empty");
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}

/// A hold survives a broker reconnect. With the breaker open (the database cut), warren's link
/// to the broker is cut and restored: the new link must not subscribe while the breaker holds,
/// so no prefetch window is taken and no message spends a retry. Before, the reconnect consumed
/// at once and sent a whole window through the retry queue.
#[tokio::test(flavor = "multi_thread")]
async fn a_breaker_hold_survives_a_broker_reconnect() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("hold_reconnect").await;
    env.set("DATABASE_URL", pg.url())
        .set("AMQP_URL", amqp.url())
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1")
        .set("RETRY_TTL_MS", "500")
        .set("PREFETCH", "100");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let first = env.publish_users(1).await;
    let mut expected: HashSet<Uuid> = first.into_iter().collect();
    wait_until("the first row", Duration::from_secs(20), || async {
        env.count_rows().await == 1
    })
    .await;

    // The database goes away: one message fails, the breaker opens and holds the consumer.
    pg.cut();
    expected.extend(env.publish_users(1).await);
    wait_until("the breaker open", Duration::from_secs(30), || async {
        try_metric(
            &env,
            "warren_breaker_open",
            &[("pipeline", "users"), ("stage", "main")],
        )
        .await
            == Some(1.0)
    })
    .await;
    // The message whose failure opened the breaker goes through the retry queue; the breaker
    // may open before that republish is confirmed, so wait for it to be counted first.
    wait_until(
        "the failed message retried",
        Duration::from_secs(30),
        || async {
            try_metric(
                &env,
                "warren_messages_retried_total",
                &[("pipeline", "users"), ("stage", "main")],
            )
            .await
                == Some(1.0)
        },
    )
    .await;
    let retried_before = 1.0;
    let held = env.publish_users(300).await;
    expected.extend(held.iter().copied());

    // The broker link is cut and comes back while the breaker still holds.
    let before = amqp_reconnects(&env).await;
    amqp.cut();
    amqp.restore();
    wait_until(
        "the consumer reconnected",
        Duration::from_secs(30),
        || async { amqp_reconnects(&env).await > before },
    )
    .await;
    // The sentinel: a message published after the reconnect is still ready, like the 300.
    env.publish_users(1).await.into_iter().for_each(|id| {
        expected.insert(id);
    });
    // 300 + the sentinel + the message that failed when the breaker opened (back from the
    // retry queue after its TTL, or still there).
    let (ready, unacked) = queue_counts(&env.main_queue).await;
    let (retrying, _) = queue_counts(&env.retry_queue).await;
    let consumers = env.queue_state(&env.main_queue).await.1;
    assert_eq!(
        (ready + retrying, unacked, consumers),
        (302, 0, 0),
        "deliveries taken (or a consumer subscribed) while the breaker held; log:\n{}",
        warren.logs()
    );
    let retried = metric(
        &env,
        "warren_messages_retried_total",
        &[("pipeline", "users"), ("stage", "main")],
    )
    .await;
    assert_eq!(retried, retried_before, "retries spent during the hold");

    // The database is back: the breaker closes and everything lands once.
    pg.restore();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0);
}

/// A half-open database connection (the link goes silent without closing, as a partition
/// leaves it) used to hang a batch for the kernel's ~15 minutes of retransmissions, holding its
/// acks, with the breaker never opening. Now the client-side bound on each statement fails it
/// within seconds as a transient error: the breaker opens, and after the link is back every row
/// lands once.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_open_database_connection_fails_within_seconds() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_half_open").await;
    env.set("DATABASE_URL", pg.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "1000")
        .set("DB_RETRY_WINDOW_MS", "0")
        .set("BREAKER_FAILURES", "1")
        .set("RETRY_TTL_MS", "1000");
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let mut expected: HashSet<Uuid> = env.publish_users(10).await.into_iter().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(20), &|| warren.logs()).await;

    pg.freeze();
    let frozen_at = Instant::now();
    expected.extend(env.publish_users(10).await);
    wait_until(
        "the breaker open after the silent link",
        Duration::from_secs(30),
        || async {
            try_metric(
                &env,
                "warren_breaker_open",
                &[("pipeline", "users"), ("stage", "main")],
            )
            .await
                == Some(1.0)
        },
    )
    .await;
    let took = frozen_at.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the breaker opened only after {took:?}"
    );
    assert!(
        warren.logs().contains("no answer from the database within"),
        "log:\n{}",
        warren.logs()
    );

    pg.thaw();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0);
}

/// AMQP reconnections counted by the env's warren.
async fn amqp_reconnects(env: &TestEnv) -> f64 {
    // An absent series is 0; a /metrics that does not answer is a failure, never 0.
    metric(env, "warren_reconnects_total", &[("target", "amqp")]).await
}

/// A failover: the first host of `DATABASE_URL` (a primary being fenced) keeps its sessions but
/// answers every write with 25006 (read-only transaction) and takes no new session. warren
/// kept its pooled connections to it forever (every batch split row by row as if a row were at
/// fault, retries spent, the breaker's probe failing on the same connections, nothing reaching
/// the writable host). A read-only answer now costs the pool its connections: the next ones go
/// through the host list (`target_session_attrs=read-write`) to the second host, and every
/// message is inserted, none dead-lettered.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_that_turns_read_only_sends_warren_to_the_next_host() {
    let fenced = TcpProxy::start(&database_url(), 5432).await;
    let standby = TcpProxy::start(&database_url(), 5432).await;
    let hosts = |p: &TcpProxy| {
        let url = url::Url::parse(&p.url()).expect("proxy URL");
        format!("127.0.0.1:{}", url.port().expect("port"))
    };
    let base = url::Url::parse(&database_url()).expect("DATABASE_URL");
    let userinfo = match base.password() {
        Some(p) => format!("{}:{p}@", base.username()),
        None if base.username().is_empty() => String::new(),
        None => format!("{}@", base.username()),
    };
    let url = format!(
        "postgres://{userinfo}{},{}{}?target_session_attrs=read-write",
        hosts(&fenced),
        hosts(&standby),
        base.path()
    );
    let mut env = TestEnv::new("pg_failover").await;
    env.set("DATABASE_URL", url)
        .set("DATABASE_POOL_SIZE", "3")
        .set("USERS_BATCH_CONCURRENCY", "2")
        .set("DB_RETRY_WINDOW_MS", "2000")
        .set("MAX_RETRIES", "1");
    env.declare();
    // Writes through the fenced host's sessions fail as on a read-only server (a statement
    // trigger fires for the breaker's empty probe too).
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE TABLE {s}.fenced_ports (port int PRIMARY KEY);
            CREATE FUNCTION {s}.refuse_fenced() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF inet_client_port() IN (SELECT port FROM {s}.fenced_ports) THEN
                    RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction'
                        USING ERRCODE = '25006';
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER users_refuse_fenced BEFORE INSERT ON {s}.users
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_fenced();
            "#
        ))
        .await
        .expect("install the fence");
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let first: HashSet<Uuid> = env.publish_users(200).await.into_iter().collect();
    assert_rows_exactly(&env, &first, Duration::from_secs(30), &|| warren.logs()).await;
    // Fill the pool (3: two batch inserts and one spare) with connections through the first
    // host: both inserts held by a lock, the database probe (every 5 s) takes the third.
    let lock = InsertLock::take(&env).await;
    let held: HashSet<Uuid> = env.publish_users(1_000).await.into_iter().collect();
    lock.wait_for_a_blocked_insert(&env).await;
    wait_until(
        "3 pool connections through the first host",
        Duration::from_secs(30),
        || async { fenced.backend_client_ports().len() >= 3 },
    )
    .await;
    lock.release().await;
    let first: HashSet<Uuid> = first.union(&held).copied().collect();
    assert_rows_exactly(&env, &first, Duration::from_secs(30), &|| warren.logs()).await;

    // The fence: the first host's sessions take no writes, and it takes no new session.
    fenced.refuse_new();
    for port in fenced.backend_client_ports() {
        env.db
            .execute(
                &format!("INSERT INTO {s}.fenced_ports VALUES ($1)"),
                &[&port],
            )
            .await
            .expect("fence a port");
    }
    let second: HashSet<Uuid> = env.publish_users(2_000).await.into_iter().collect();
    let expected: HashSet<Uuid> = first.union(&second).copied().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    assert_eq!(
        env.ready(&env.dlq_queue).await,
        0,
        "log:\n{}",
        warren.logs()
    );
    assert!(
        !standby.backend_client_ports().is_empty(),
        "writes moved to the second host"
    );
    warren.terminate_ok(Duration::from_secs(30));
}

/// users as a configured pipeline on this env's queues and table: `warren run` checks its table
/// against the mapping before it consumes anything.
fn mapped_users(env: &TestEnv) -> String {
    format!(
        "[[pipelines]]\nname = \"users\"\ntable = \"users\"\nkey = [\"id\"]\n{}\n\
         [pipelines.columns]\n\
         id    = {{ path = \"/id\", type = \"uuid\" }}\n\
         name  = {{ path = \"/name\", type = \"text\", min_len = 1, max_len = 200 }}\n\
         email = {{ path = \"/email\", type = \"text\", format = \"email\", max_len = 254 }}\n",
        PipelineNames::of_env(env).toml()
    )
}

/// Writes [`mapped_users`] of `env` to a file of a new temporary directory: the directory (the
/// file lives as long as it) and the file's path.
fn write_mapped_users(env: &TestEnv) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("users.toml");
    std::fs::write(&path, mapped_users(env)).expect("write the config");
    (dir, path.to_string_lossy().into_owned())
}

/// Starts `warren run` with the config `file` and waits until it logs that it waits for the
/// database to check the pipelines' tables.
async fn start_waiting_for_the_database(env: &TestEnv, file: &str) -> Warren {
    let warren = env.start(&["--config", file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log(
            "the wait for the database in the log",
            "cannot check the pipelines' tables yet",
        )
        .await;
    warren
}

/// A warren started while its database is away (refused, then silent) neither exits nor
/// consumes: it waits for the database to check its pipelines' tables, a SIGTERM during that wait
/// ends it with 0 and nothing taken, and once the database answers it consumes every message.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_away_at_start_is_waited_for_and_a_sigterm_ends_the_wait() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_away_at_start").await;
    env.declare();
    let (_dir, file) = write_mapped_users(&env);
    // A silent database is given up on after the connect timeout (5 s) and one statement's
    // bound (this + 2 s), then asked again.
    env.set("DATABASE_URL", proxy.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "3000");
    let ids = env.publish_users(300).await;

    for silent in [false, true] {
        if silent {
            proxy.restore();
            proxy.freeze();
        } else {
            proxy.cut();
        }
        let mut warren = start_waiting_for_the_database(&env, &file).await;
        let _logs = LogsOnPanic(vec![warren.log.clone()]);
        assert!(warren.is_running(), "warren exited:\n{}", warren.logs());
        assert_eq!(
            env.queue_state(&env.main_queue).await,
            (300, 0),
            "nothing is consumed before the tables are checked"
        );
        let started = Instant::now();
        let status = warren.terminate(Duration::from_secs(10));
        assert!(
            status.success(),
            "SIGTERM during the wait: {status}\n{}",
            warren.logs()
        );
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    proxy.thaw();

    // Away again at start, then back: warren goes on by itself and consumes everything once.
    // While it waits it is alive and not ready: its listener is up before the check, so a
    // liveness probe does not restart it for waiting (it was bound only after the check).
    proxy.cut();
    let mut warren = start_waiting_for_the_database(&env, &file).await;
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    let health = metrics_get(&env, "/healthz").await;
    assert_eq!(health.as_ref().map(|h| h.0), Some(200), "{health:?}");
    let (status, body) = metrics_get(&env, "/readyz").await.expect("/readyz answers");
    assert_eq!(status, 503, "{body}");
    let ready: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(
        ready,
        serde_json::json!({"starting": "checking the pipelines' tables in the database"}),
        "what the start waits for, no link the roles have not made"
    );
    proxy.restore();
    let expected: HashSet<Uuid> = ids.into_iter().collect();
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    warren.terminate_ok(Duration::from_secs(30));
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
}

/// Under systemd (`Type=notify`, `TimeoutStartSec=60` in the unit) a warren that waits for its
/// database at start says, at each attempt, that its start goes on (`EXTEND_TIMEOUT_USEC`, past
/// the next attempt): without it systemd stopped it after 60 s and restarted it, in a loop for as
/// long as the database was away. No `READY=1` before its roles run; once the database answers,
/// `READY=1`.
#[tokio::test(flavor = "multi_thread")]
async fn a_start_that_waits_for_the_database_keeps_extending_systemds_start_timeout() {
    let proxy = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_away_systemd").await;
    env.declare();
    let (dir, file) = write_mapped_users(&env);
    let socket_path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).expect("bind the notify socket");
    env.set("DATABASE_URL", proxy.url())
        .set("NOTIFY_SOCKET", socket_path.to_str().expect("UTF-8 path"));
    proxy.cut();
    let mut warren = start_waiting_for_the_database(&env, &file).await;
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let mut buf = vec![0u8; 4096];
    let mut seen = Vec::new();
    let mut next = async || {
        let n = tokio::time::timeout(Duration::from_secs(60), socket.recv(&mut buf))
            .await
            .expect("a notification within 60 s")
            .expect("read the notify socket");
        String::from_utf8_lossy(&buf[..n]).trim().to_string()
    };
    let mut extends = 0;
    while extends < 2 {
        let text = next().await;
        assert_ne!(text, "READY=1", "ready while waiting; seen {seen:?}");
        if let Some(usec) = text.strip_prefix("EXTEND_TIMEOUT_USEC=") {
            let usec: u64 = usec.parse().expect("a number of microseconds");
            assert!(usec >= 15_000_000, "extended by {usec} us only");
            extends += 1;
        }
        seen.push(text);
    }
    proxy.restore();
    loop {
        let text = next().await;
        if text == "READY=1" {
            break;
        }
        seen.push(text);
    }
    warren.terminate_ok(Duration::from_secs(30));
}

/// The `codes` table and a pipeline into it (`conflict`: its `on_conflict` lines, `update`
/// by version `v` or `keep`); declared. Answers the config file's path.
async fn codes_pipeline(
    env: &TestEnv,
    names: &PipelineNames,
    dir: &tempfile::TempDir,
    conflict: &str,
) -> String {
    env.db
        .batch_execute("CREATE TABLE codes (code varchar(40) PRIMARY KEY, v int8 NOT NULL)")
        .await
        .expect("create codes");
    let path = dir.path().join("codes.toml");
    std::fs::write(
        &path,
        format!(
            "[[pipelines]]\nname = \"codes\"\ntable = \"codes\"\nkey = [\"code\"]\n\
             {conflict}\nbatch_size = 50\n\
             batch_timeout_ms = 20\nretry_ttls_ms = [1000]\n{}\n[pipelines.columns]\n\
             code = {{ path = \"/code\", type = \"text\" }}\n\
             v = {{ path = \"/v\", type = \"int8\" }}\n",
            names.toml()
        ),
    )
    .expect("write the config");
    let file = path.to_str().expect("utf-8").to_string();
    let (code, out, err) = env.run_async(&["--config", &file, "declare"]).await;
    assert_eq!(code, 0, "declare:\n{out}{err}");
    file
}

/// Publishes the codes `from..to` to `names`' exchange; answers them.
async fn publish_codes(
    env: &TestEnv,
    names: &PipelineNames,
    from: usize,
    to: usize,
) -> Vec<String> {
    let codes: Vec<String> = (from..to).map(|i| format!("c-{i}")).collect();
    env.publish_pipelined_to(
        &names.exchange,
        &names.queue,
        codes.iter().map(|c| {
            (
                format!(r#"{{"code":"{c}","v":1}}"#).into_bytes(),
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
        }),
    )
    .await;
    codes
}

/// Every code stored in `codes`; an error is a failure, not an empty table.
async fn stored_codes(env: &TestEnv) -> HashSet<String> {
    env.db
        .query("SELECT code::text FROM codes", &[])
        .await
        .expect("select codes")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A column's type changed under a running pipeline (issue 34, item 9): PostgreSQL refuses the
/// pooled connections' prepared statement (`cached plan must not change result type`, 0A000)
/// until it is prepared again. warren drops the pool's prepared statements and runs the batch
/// again at once: every row lands once, no batch waits for an in-place retry, no message goes
/// through the retry queue and none spends a retry. Since the nested orders' speed-up the
/// `update` upsert returns `xmax = 0` (a boolean), not the key column whose type changes:
/// PostgreSQL replans it without an error, so the stale plan is no longer met here (the test
/// asserted it was, and failed); what it still holds: the type changes cost no retry and lose
/// nothing. No batch reaches the recovery from 0A000 now (a `keep` batch with copies does not
/// either: its probe's statements are prepared for each run, see the next test); the recovery
/// itself is tested on the one cached statement that returns a column of the table
/// (`a_stale_plan_is_prepared_again_...`).
#[tokio::test(flavor = "multi_thread")]
async fn a_column_type_changed_under_a_running_pipeline_costs_no_retry() {
    let env = TestEnv::new("pg_alter_type").await;
    env.declare();
    let names = PipelineNames::of(&env, "codes");
    let _cleanup = names.cleanup();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = codes_pipeline(
        &env,
        &names,
        &dir,
        "on_conflict = \"update\"\nversion_column = \"v\"",
    )
    .await;
    let warren = env.start(&["--config", &file, "--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let mut expected: HashSet<String> = HashSet::new();
    let types = ["text", "varchar(40)", "text", "varchar(40)"];
    for (round, ty) in types.iter().enumerate() {
        // Rows land (the connections prepare and cache the statement), then the type changes
        // while the next messages are on their way.
        let published = publish_codes(&env, &names, round * 1000, round * 1000 + 600).await;
        expected.extend(published);
        wait_until(
            &format!("round {round}: the first rows"),
            Duration::from_secs(30),
            || async { stored_codes(&env).await.len() > round * 1000 },
        )
        .await;
        let alter = format!("ALTER TABLE codes ALTER code TYPE {ty}");
        let (more, altered) = tokio::join!(
            publish_codes(&env, &names, round * 1000 + 600, round * 1000 + 1000),
            env.db.batch_execute(&alter)
        );
        altered.unwrap_or_else(|e| panic!("ALTER TABLE codes ALTER code TYPE {ty}: {e}"));
        expected.extend(more);
        wait_until(
            &format!("round {round}: every row so far"),
            Duration::from_secs(60),
            || async { stored_codes(&env).await.len() == expected.len() },
        )
        .await;
    }
    assert_eq!(stored_codes(&env).await, expected);
    let logs = warren.logs();
    // A stale plan, if met, cost no in-place retry.
    assert!(
        !logs.contains("retrying the batch in place"),
        "a stale plan cost an in-place retry; log:\n{logs}"
    );
    // The metrics endpoint must answer (a scrape that fails is a failure, not 0).
    let retried = metric(&env, "warren_messages_retried_total", &[]).await;
    assert_eq!(
        retried, 0.0,
        "messages sent through the retry queue; log:\n{logs}"
    );
    assert_eq!(
        env.queue_state(&names.retry).await,
        (0, 0),
        "the retry queue"
    );
    assert_eq!(env.queue_state(&names.dlq).await.0, 0, "the DLQ");
    assert_eq!(env.queue_state(&names.queue).await.0, 0, "the main queue");
}

/// The same with `on_conflict = "keep"` and copies in every batch after the first (each round
/// publishes the last 200 codes of the round before again): the type changes between batches
/// lose nothing, store nothing twice, park nothing and cost no retry. A batch with copies goes
/// through the probe, whose statements are prepared for each run, and the plain insert before
/// it returns nothing: neither meets a stale plan (checked: the recovery's log line never
/// appears in this run), so the recovery is tested on its own below.
#[tokio::test(flavor = "multi_thread")]
async fn a_column_type_changed_under_a_keep_pipeline_with_copies_costs_no_retry() {
    let env = TestEnv::new("pg_alter_keep").await;
    env.declare();
    let names = PipelineNames::of(&env, "codes");
    let _cleanup = names.cleanup();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = codes_pipeline(&env, &names, &dir, "on_conflict = \"keep\"").await;
    let warren = env.start(&["--config", &file, "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);

    let mut expected: HashSet<String> = HashSet::new();
    let types = ["text", "varchar(40)", "text"];
    for (round, ty) in types.iter().enumerate() {
        let from = round * 400;
        // New codes and, from the second round, copies of the round before.
        let copies_from = from.saturating_sub(200);
        expected.extend(publish_codes(&env, &names, copies_from, from + 400).await);
        wait_until(
            &format!("round {round}: every row so far"),
            Duration::from_secs(60),
            || async { stored_codes(&env).await.len() == expected.len() },
        )
        .await;
        let alter = format!("ALTER TABLE codes ALTER code TYPE {ty}");
        env.db
            .batch_execute(&alter)
            .await
            .unwrap_or_else(|e| panic!("{alter}: {e}"));
    }
    // The last batches, copies only, after the last change.
    publish_codes(&env, &names, 800, 1200).await;
    let sentinel = publish_codes(&env, &names, 5000, 5001).await;
    expected.extend(sentinel);
    wait_until("the sentinel", Duration::from_secs(60), || async {
        stored_codes(&env).await.len() == expected.len()
    })
    .await;
    assert_eq!(stored_codes(&env).await, expected);
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM codes").await,
        expected.len() as i64,
        "a code stored twice"
    );
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM dead_letters").await,
        0,
        "a copy parked"
    );
    let logs = warren.logs();
    assert!(
        !logs.contains("retrying the batch in place"),
        "a type change cost an in-place retry; log:\n{logs}"
    );
    let retried = metric(&env, "warren_messages_retried_total", &[]).await;
    assert_eq!(retried, 0.0, "retries spent; log:\n{logs}");
    for q in [&names.queue, &names.retry, &names.dlq] {
        assert_eq!(env.queue_state(q).await.0, 0, "{q}");
    }
}

/// The recovery from a stale plan itself (`db::replanning`), against the real server: the one
/// statement of a mapping that returns a column of the table, `keep`'s `.. RETURNING code`
/// (what the breaker's probe runs, a batch of no records), cached on a connection, then the
/// column's type changed: run again as it is, PostgreSQL refuses it (0A000 `cached plan must
/// not change result type`); through `replanning` it is prepared again and answers, at once,
/// on the same connection, and the next run needs no recovery.
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_plan_is_prepared_again_at_once_on_the_same_connection() {
    use warren::domain::Domain;
    use warren::domain::mapping::{Mapping, MappingSpec};
    let env = TestEnv::new("pg_stale_plan").await;
    env.db
        .batch_execute("CREATE TABLE codes (code varchar(40) PRIMARY KEY, v int8 NOT NULL)")
        .await
        .expect("create codes");
    let spec: MappingSpec = toml::from_str(
        "table = \"codes\"\nkey = [\"code\"]\non_conflict = \"keep\"\n[columns]\n\
         code = { path = \"/code\", type = \"text\" }\nv = { path = \"/v\", type = \"int8\" }\n",
    )
    .expect("spec");
    let m = Mapping::compile("codes", &spec).expect("compiles");
    let pool = mapping_pool(&env, "warren-stale-plan-test");
    let client = pool.get().await.expect("client");
    m.insert(&client, &[]).await.expect("prepared and cached");
    env.db
        .batch_execute("ALTER TABLE codes ALTER code TYPE text")
        .await
        .expect("alter");
    let stale = m.insert(&client, &[]).await.expect_err("a stale plan");
    assert!(stale.is_stale_plan(), "{stale:?}");
    warren::db::replanning(&pool, || m.insert(&client, &[]))
        .await
        .expect("prepared again and run");
    m.insert(&client, &[])
        .await
        .expect("the new plan is cached");
}

/// A session of warren's pools whose client went silent inside a transaction (a partition
/// that lost the link's FIN, a proxy that holds it) is ended by the server within a
/// statement's bound, and its locks with it (review R36h F4, R36i F2: two orphans `idle in
/// transaction` held their keys' advisory locks for as long as the server's TCP keepalive, two
/// hours by default, and the pipeline stalled).
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_session_silent_inside_a_transaction_is_ended_with_its_locks() {
    let mut env = TestEnv::new("pg_idle_tx").await;
    env.set("DATABASE_STATEMENT_TIMEOUT_MS", "1000");
    let pool = mapping_pool(&env, "warren-idle-tx-test");
    let client = pool.get().await.expect("client");
    let key: i64 = 0x5ee_d00d ^ i64::from(std::process::id());
    client.batch_execute("BEGIN").await.expect("begin");
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    client
        .execute("SELECT pg_advisory_xact_lock($1)", &[&key])
        .await
        .expect("the lock");
    let silent = Instant::now();
    wait_until(
        "the silent session ended by the server",
        Duration::from_secs(15),
        || async {
            env.db
                .query("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
                .await
                .expect("pg_stat_activity")
                .is_empty()
        },
    )
    .await;
    assert!(
        silent.elapsed() >= Duration::from_secs(2),
        "ended after {:?}, before the bound (statement timeout + 2 s)",
        silent.elapsed()
    );
    let free: bool = env
        .db
        .query_one("SELECT pg_try_advisory_lock($1)", &[&key])
        .await
        .expect("try the lock")
        .get(0);
    assert!(free, "its lock went with it");
    env.db
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .expect("unlock");
    assert!(
        client.execute("SELECT 1", &[]).await.is_err(),
        "the session is gone"
    );
}

/// Review R40a F5: a stop while the database is silent (a partition: the link holds every byte
/// and every new connection) with many batches still held. Each batch tried during the stop
/// waited out the pool's 5 s for a connection in turn, so the stop took all of
/// `SHUTDOWN_TIMEOUT_MS` and exited 1. Now the first batch that gets no answer during the stop
/// makes the others go back untried: exit 0 well within the bound, and every message is stored
/// once by the next start.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_while_the_database_is_silent_gives_back_what_it_holds_within_its_bound() {
    let pg = TcpProxy::start(&database_url(), 5432).await;
    let mut env = TestEnv::new("pg_stop_silent").await;
    env.set("DATABASE_URL", pg.url())
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "1000")
        .set("USERS_BATCH_SIZE", "20")
        .set("PREFETCH", "2000")
        .set("SHUTDOWN_TIMEOUT_MS", "15000");
    env.declare();
    let expected: HashSet<Uuid> = env.publish_users(2000).await.into_iter().collect();
    pg.freeze();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    warren
        .wait_for_log("the consumer subscribed", "consuming pipeline=\"users\"")
        .await;
    // The window fills while the first batches wait for a connection.
    wait_until("deliveries held", Duration::from_secs(20), || async {
        try_metric(
            &env,
            "warren_messages_received_total",
            &[("pipeline", "users"), ("stage", "main")],
        )
        .await
        .unwrap_or(0.0)
            >= 1000.0
    })
    .await;
    // Exit 0 is a stop within SHUTDOWN_TIMEOUT_MS (exit 1 past it, as before the fix).
    let status = warren.terminate(Duration::from_secs(40));
    assert_eq!(status.code(), Some(0), "log:\n{}", warren.logs());
    pg.thaw();
    let mut warren = env.start(&["--roles", "consumer"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    assert_rows_exactly(&env, &expected, Duration::from_secs(60), &|| warren.logs()).await;
    warren.terminate_ok(Duration::from_secs(25));
    assert_eq!(env.queue_state(&env.main_queue).await, (0, 0));
    assert_eq!(env.queue_state(&env.dlq_queue).await.0, 0);
}
