//! PostgreSQL: the connection pools (the pipeline's and the API's), the embedded migrations, the
//! error classification that decides between retrying, dead-lettering and stopping, and
//! (`dead_letters`) the parking table; `statements` keeps a stage's statements in flight, to
//! cancel at its stop. Its settings are its own ([`DbConfig`], in `config`: the
//! session timeouts and the client-side bound on every statement); it imports nothing of
//! warren's configuration, broker link or events.

pub mod config;
pub mod dead_letters;
pub mod error;
pub mod statements;
pub use config::{DbConfig, DbConfigError};
pub use error::{DbError, ErrorClass, classify_sqlstate};
pub use statements::{Running, Statements};

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

mod embedded {
    refinery::embed_migrations!("./src/db/migrations");
}

/// Advisory lock key held while migrating, so concurrent `warren declare` runs take turns.
const MIGRATION_LOCK: i64 = 0x7761_7272_656e; // "warren"

/// Gives up on `client` after its statement passed the client-side bound (a half-open link, a
/// server that stopped answering): a cancel request is sent for its statement (a server that
/// is only slow, or waits on a lock, ends it rather than commit it later unseen), the
/// connection is taken out of the pool and closed, and the error to report is a connection
/// error (transient), not a hang.
///
/// Use: `match timeout(bound, work(&client)).await { Ok(r) => r, Err(_) => Err(abandon(client, bound)) }`.
pub fn abandon(client: deadpool_postgres::Object, bound: Duration) -> DbError {
    statements::cancel(client.cancel_token());
    drop(deadpool_postgres::Object::take(client));
    DbError::Connection(format!(
        "no answer from the database within {} ms; the connection was dropped",
        bound.as_millis()
    ))
}

/// [`abandon`], then one question to the database (a fresh round trip within at most 5 s):
/// when it answers, the server is there and the abandoned work was too slow for the bound
/// ([`DbError::Outlasted`], an answer: the DLQ consumer counts it as an attempt, so a message
/// whose work always outlasts the bound is parked, not cycled for ever); when it does not,
/// the link or the server is gone (the connection error of [`abandon`]: an outage, uncounted).
///
/// The abandoned connection's server process is ended too (`pg_terminate_backend`, once the
/// database answers, then awaited gone): its statement may still be on its way (a proxy or a
/// network path that holds the bytes) and reach an idle process after the cancel did, and
/// commit there after the batch went back to its queue; or its transaction may wait for a
/// COMMIT that never comes, holding its locks (review R38-F2: after a reload that switched the
/// table, such a statement committed in the old table, and its message was in both). Once the
/// process is gone, what it committed is in the table and nothing else of it ever will be, so
/// a look-up of the rows is the answer.
pub async fn abandon_asking(
    pool: &Pool,
    client: deadpool_postgres::Object,
    bound: Duration,
) -> DbError {
    let backend = statements::backend_pid(&client.cancel_token()).await;
    let gone = abandon(client, bound);
    let ask = bound.min(Duration::from_secs(5));
    let asked = async {
        match backend {
            Some(pid) => end_backend(pool, pid, ask).await,
            None => ping(pool, ask).await,
        }
    };
    match tokio::time::timeout(ask, asked).await {
        Ok(Ok(())) => DbError::Outlasted {
            bound_ms: bound.as_millis() as u64,
        },
        _ => gone,
    }
}

/// Ends the server process `pid` of an abandoned connection of `pool` (the same role and
/// `application_name`, so never another client's) and waits until it is gone, polling every
/// 20 ms within `bound`: `Ok` once the database answered that no such process runs.
async fn end_backend(pool: &Pool, pid: i32, bound: Duration) -> Result<(), DbError> {
    let client = pool.get().await.map_err(DbError::from_pool)?;
    let ended = tokio::time::timeout(bound, async {
        // The login role's own session (`usename` is the role that logged in): ended as that
        // role, not as one the session switched to by default (`ALTER ROLE login SET role =
        // owner`, the usual login/owner split), which may not end it (review R39-F8).
        const OURS: &str = "pid = $1 AND usename = session_user \
             AND application_name = current_setting('application_name')";
        let terminated = client
            .simple_query(&format!(
                "BEGIN; SET LOCAL ROLE NONE; \
                 SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE {}; COMMIT",
                OURS.replace("$1", &pid.to_string())
            ))
            .await;
        match terminated {
            Ok(_) => {}
            // Refused: the database answered, and the cancel is all that was sent, as before;
            // said, as what the stop then gives back may be stored twice.
            Err(e) if e.as_db_error().is_some() => {
                let _ = client.simple_query("ROLLBACK").await;
                tracing::warn!(error = %e, pid,
                    "cannot end the server process of an abandoned statement: a statement still \
                     on its way may commit after its messages went back to the queue");
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        loop {
            let running = client
                .query_one(
                    &format!("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE {OURS})"),
                    &[&pid],
                )
                .await?
                .get::<_, bool>(0);
            if !running {
                return Ok::<_, tokio_postgres::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    match ended {
        Ok(result) => {
            let result = result.map_err(DbError::from_pg);
            release(pool, client, &result);
            result
        }
        Err(_) => Err(abandon(client, bound)),
    }
}

/// Hands `client` back after a statement that ended with `result`: an error that says the
/// server takes no writes or is going away ([`DbError::discards_connection`]) drops it, and every
/// idle connection of the pool with it (they reach the same server), so the next statement
/// connects again and a multi-host `DATABASE_URL` finds the writable host.
pub fn release<T>(pool: &Pool, client: deadpool_postgres::Object, result: &Result<T, DbError>) {
    if let Err(e) = result
        && e.discards_connection()
    {
        drop(deadpool_postgres::Object::take(client));
        let dropped = pool.retain(|_, _| false).removed.len();
        tracing::warn!(error = %e, idle_dropped = dropped,
            "the database server takes no writes or is going away; its connections are dropped \
             and the next statement connects again");
    }
}

/// Runs `statement` (on a connection of `pool`), and once more at once when the server refused
/// a prepared statement as stale ([`DbError::is_stale_plan`]: a table's column type changed
/// under it). Before the second run every connection of the pool forgets its prepared
/// statements (the server's copies are closed as they go), so each is prepared again against
/// the table as it is now: a schema change costs one round trip per connection, no in-place
/// retry after a wait and no message's retries. A second stale plan (the table changed again
/// meanwhile) is returned: a transient error, retried as any other.
pub async fn replanning<T, F, Fut>(pool: &Pool, mut statement: F) -> Result<T, DbError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, DbError>>,
{
    match statement().await {
        Err(e) if e.is_stale_plan() => {
            pool.manager().statement_caches.clear();
            tracing::info!(error = %e,
                "a table changed under a prepared statement; the pool's prepared statements \
                 were dropped and the statement runs again");
            statement().await
        }
        other => other,
    }
}

/// How long a pool waits for a free connection, for a new one, and for the check of a pooled
/// one before its `get` fails (the words of [`DbError::from_pool`]).
pub const POOL_WAIT: Duration = Duration::from_secs(5);
pub const POOL_CREATE: Duration = Duration::from_secs(5);
pub const POOL_RECYCLE: Duration = Duration::from_secs(2);

/// The pipeline's pool (`warren-pipeline` in `pg_stat_activity`): `config.pool_size`
/// connections (the composition root sizes it so batches never wait for one).
pub fn pool(config: &DbConfig) -> Result<Pool, DbError> {
    pool_for(config, config.pool_size, "warren-pipeline")
}

/// A pool of at most `max_size` connections whose sessions carry `application_name`, so each
/// user of the database (pipeline, API) has its own and can be told apart in
/// `pg_stat_activity`. It connects lazily (so warren starts while the database is down) and
/// reconnects by itself: a connection that fails its recycle check is replaced.
pub fn pool_for(
    config: &DbConfig,
    max_size: usize,
    application_name: &str,
) -> Result<Pool, DbError> {
    let idle = config.call_bound();
    let mut config = config.pg_config()?;
    config.application_name(application_name);
    // A session of the service's own never waits inside a transaction on anything but its
    // next statement: one silent longer than a statement may take lost its client (a
    // partition that dropped the link's FIN, a proxy that holds it), and the server ends it,
    // its locks with it, instead of keeping them for the hours its TCP keepalive takes (review
    // R36h F4, R36i F2: two such orphans held their keys' advisory locks and stalled the
    // pipeline for minutes). The server's own keepalives notice a peer gone within seconds.
    // Not for the CLI's sessions: a replay holds its rows' locks while the broker confirms.
    let options = format!(
        "{} -c idle_in_transaction_session_timeout={} -c tcp_keepalives_idle=5 \
         -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3",
        config.get_options().unwrap_or_default(),
        idle.as_millis()
    );
    config.options(options);
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(POOL_WAIT))
        .create_timeout(Some(POOL_CREATE))
        .recycle_timeout(Some(POOL_RECYCLE))
        .build()
        .map_err(|e| DbError::Config(DbConfigError::Pool(e.to_string())))
}

/// What `migrate` did.
#[derive(Debug, Clone)]
pub struct MigrationReport {
    /// Versions applied now, as `V1__users`.
    pub applied: Vec<String>,
}

/// Every migration built into warren, in order: (version, `V1__users`).
pub fn embedded_migrations() -> Vec<(i64, String)> {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| {
            (
                i64::from(m.version()),
                format!("V{}__{}", m.version(), m.name()),
            )
        })
        .collect()
}

/// The versions of the migrations applied in the schema (none when its history table does not
/// exist yet); an error when the database cannot be asked. Reads only.
pub async fn applied_migrations(config: &DbConfig) -> Result<Vec<i64>, DbError> {
    let (client, connection) = config
        .pg_config()?
        .connect(NoTls)
        .await
        .map_err(DbError::from_pg)?;
    let task = tokio::spawn(connection);
    let table = format!("{}.refinery_schema_history", config.schema);
    let result = async {
        let exists: Option<u32> = client
            .query_one("SELECT to_regclass($1)::oid", &[&table])
            .await
            .map_err(DbError::from_pg)?
            .get(0);
        if exists.is_none() {
            return Ok(Vec::new());
        }
        let rows = client
            .query(
                &format!("SELECT version::int8 FROM {table} ORDER BY version"),
                &[],
            )
            .await
            .map_err(DbError::from_pg)?;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
    }
    .await;
    drop(client);
    let _ = task.await;
    result
}

/// Creates the schema if needed and applies the embedded, versioned migrations in it. The
/// connection and its first statement are bounded (the connect timeout and one statement's
/// bound): a server that takes the connection and never answers (half-open, partitioned) is an
/// error in seconds, not a hang; once it has answered, the migrations take what they take (the
/// advisory lock waits for another `declare`, and the server's `statement_timeout` bounds each).
pub async fn migrate(config: &DbConfig) -> Result<MigrationReport, DbError> {
    let bound = Duration::from_secs(5) + config.call_bound();
    let silent = || {
        DbError::Connection(format!(
            "no answer from the database within {} ms",
            bound.as_millis()
        ))
    };
    let (mut client, connection) = tokio::time::timeout(bound, config.pg_config()?.connect(NoTls))
        .await
        .map_err(|_| silent())?
        .map_err(DbError::from_pg)?;
    let task = tokio::spawn(connection);
    let result = async {
        tokio::time::timeout(
            bound,
            client.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", config.schema)),
        )
        .await
        .map_err(|_| silent())?
        .map_err(DbError::from_pg)?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(DbError::from_pg)?;
        let report = embedded::migrations::runner()
            .run_async(&mut client)
            .await
            .map_err(|e| DbError::Migration(e.to_string()));
        let _ = client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await;
        let report = report?;
        Ok(MigrationReport {
            applied: report
                .applied_migrations()
                .iter()
                .map(|m| format!("V{}__{}", m.version(), m.name()))
                .collect(),
        })
    }
    .await;
    drop(client);
    // The connection ends once the client is gone. After an error it is not waited for: a
    // server that stopped answering would hold the exit for another bound (found by the review:
    // 75 s where the error said 37).
    if result.is_err() {
        task.abort();
    } else {
        let _ = tokio::time::timeout(bound, task).await;
    }
    result
}

/// One cheap round trip within `bound`: whether the database answers.
pub async fn ping(pool: &Pool, bound: Duration) -> Result<(), DbError> {
    let client = pool.get().await.map_err(DbError::from_pool)?;
    match tokio::time::timeout(bound, client.simple_query("SELECT 1")).await {
        Ok(result) => {
            let result = result.map(|_| ()).map_err(DbError::from_pg);
            release(pool, client, &result);
            result
        }
        Err(_) => Err(abandon(client, bound)),
    }
}
