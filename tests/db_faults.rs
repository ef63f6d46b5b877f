//! Database faults under a running warren, injected per test through a TCP proxy in front of
//! PostgreSQL: backends terminated by the server, and a 60 s outage during a steady publish.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_postgres::NoTls;
use uuid::Uuid;

/// A superuser connection, for `pg_terminate_backend` (`WARREN_TEST_PG_SUPERUSER_URL`).
fn superuser_url() -> String {
    std::env::var("WARREN_TEST_PG_SUPERUSER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A TCP proxy in front of the test database that one test's warren connects through, so the
/// test can cut and restore that warren's database alone, and knows which backends are its own.
struct PgProxy {
    port: u16,
    /// The database URL of the harness, to rewrite for the proxy.
    upstream_url: url::Url,
    state: Arc<ProxyState>,
    accept: tokio::task::JoinHandle<()>,
}

/// What the accept loop and the connection tasks share with the test.
struct ProxyState {
    /// Where the database listens.
    upstream: String,
    /// While false, new connections are reset as soon as they are accepted.
    up: AtomicBool,
    /// Bumped by `cut`: every live connection ends when it changes.
    cuts: watch::Sender<u64>,
    /// Local ports of the live upstream connections: PostgreSQL's `client_port` for them.
    upstream_ports: Mutex<HashSet<u16>>,
}

impl PgProxy {
    async fn start() -> Self {
        let upstream_url = url::Url::parse(&database_url()).expect("database URL");
        let upstream = format!(
            "{}:{}",
            upstream_url.host_str().unwrap_or("127.0.0.1"),
            upstream_url.port().unwrap_or(5432)
        );
        let listener = TcpListener::bind(("127.0.0.1", free_port()))
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(ProxyState {
            upstream,
            up: AtomicBool::new(true),
            cuts: watch::Sender::new(0),
            upstream_ports: Mutex::new(HashSet::new()),
        });
        let accept = tokio::spawn({
            let state = state.clone();
            async move {
                loop {
                    if let Ok((client, _)) = listener.accept().await {
                        tokio::spawn(state.clone().serve(client));
                    }
                }
            }
        });
        PgProxy {
            port,
            upstream_url,
            state,
            accept,
        }
    }

    /// The harness's database URL, through the proxy.
    fn url(&self) -> String {
        let mut url = self.upstream_url.clone();
        url.set_host(Some("127.0.0.1")).expect("host");
        url.set_port(Some(self.port)).expect("port");
        url.to_string()
    }

    /// The database goes away: live connections are reset, new ones are reset on accept.
    fn cut(&self) {
        self.state.up.store(false, Ordering::SeqCst);
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// The database is back for new connections.
    fn restore(&self) {
        self.state.up.store(true, Ordering::SeqCst);
    }

    /// `client_port`s of the backends serving connections made through this proxy.
    fn backend_client_ports(&self) -> Vec<i32> {
        let ports = self.state.upstream_ports.lock().unwrap();
        ports.iter().map(|p| i32::from(*p)).collect()
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

impl ProxyState {
    async fn serve(self: Arc<Self>, mut client: TcpStream) {
        // Subscribe before looking at `up`, so a cut in between is not missed.
        let mut cuts = self.cuts.subscribe();
        if !self.up.load(Ordering::SeqCst) {
            let _ = client.set_zero_linger();
            return;
        }
        let Ok(mut upstream) = TcpStream::connect(&self.upstream).await else {
            let _ = client.set_zero_linger();
            return;
        };
        let port = upstream.local_addr().map(|a| a.port()).unwrap_or(0);
        self.upstream_ports.lock().unwrap().insert(port);
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
            _ = cuts.changed() => {
                let _ = client.set_zero_linger();
                let _ = upstream.set_zero_linger();
            }
        }
        self.upstream_ports.lock().unwrap().remove(&port);
    }
}

/// Terminates, as superuser, the backends whose client port is in `ports`; returns how many.
async fn terminate_backends(ports: &[i32]) -> usize {
    let (db, connection) = tokio_postgres::connect(&superuser_url(), NoTls)
        .await
        .unwrap_or_else(|e| panic!("superuser connection to {}: {e}", superuser_url()));
    tokio::spawn(connection);
    db.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE client_port = ANY($1) AND application_name = 'warren' AND pid <> pg_backend_pid()",
        &[&ports],
    )
    .await
    .expect("pg_terminate_backend")
    .iter()
    .filter(|row| row.get::<_, bool>(0))
    .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn backends_terminated_by_the_server_lose_nothing() {
    let proxy = PgProxy::start().await;
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
    let proxy = PgProxy::start().await;
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
