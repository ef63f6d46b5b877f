//! The database: rows of the env's `users` table (`count_rows`, `row_ids`,
//! `assert_rows_exactly`), any count or set of ids (`count_of`, `uuids_of`, `assert_same_ids`),
//! fault injection through triggers (`install_fault` with
//! `CountAttempts`, `set_fault_sqlstate`, `clear_fault`, `track_attempts`, `attempts`,
//! `install_poison_trigger`), `InsertLock`, which holds warren's batch inserts, and
//! `terminate_backends`, which kills chosen warren connections as superuser.
//!
//! The fault is a trigger installed in the test schema after `declare`: an AFTER INSERT statement
//! trigger on `users` raises `serialization_failure` (SQLSTATE 40001, a transient error) while
//! `fault_flag.active` is set, so every insert of a batch fails; the statement trigger also fires
//! for the breaker's probe (an insert of zero rows). Optionally a BEFORE INSERT row trigger counts
//! every insert attempt per id, in a sequence of its own (`attempts_<id>`): `nextval` is not
//! rolled back, so the count survives the failed statement, and every row of a batch is counted
//! before the statement fails. Only ids given to `track_attempts` are counted.

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::NoTls;
use uuid::Uuid;

use super::env::{TestEnv, database_url};
use super::wait::wait_until;

impl TestEnv {
    /// Rows in this test's `users` table. A failed query panics with the query and the error: an
    /// error is never read as 0 (it made every `count_rows() == 0` pass when the query failed).
    pub async fn count_rows(&self) -> i64 {
        count_of(self, "SELECT count(*) FROM users").await
    }

    /// Every id in `users`.
    pub async fn row_ids(&self) -> HashSet<Uuid> {
        uuids_of(self, "SELECT id FROM users")
            .await
            .into_iter()
            .collect()
    }
}

/// The count `sql` answers (one row, one `int8` column, as `SELECT count(*) ...`), asked in the
/// env's schema. Panics with the query and the error when it fails: never 0 on error.
pub async fn count_of(env: &TestEnv, sql: &str) -> i64 {
    match env.db.query_one(sql, &[]).await {
        Ok(row) => row
            .try_get(0)
            .unwrap_or_else(|e| panic!("{sql}: the answer is no int8 count: {e}")),
        Err(e) => panic!("{sql}: {e:?}"),
    }
}

/// The uuids of the first column of `sql`'s rows, in the order they come (a duplicate stays
/// one). Panics with the query and the error when it fails.
pub async fn uuids_of(env: &TestEnv, sql: &str) -> Vec<Uuid> {
    env.db
        .query(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .iter()
        .map(|r| {
            r.try_get(0)
                .unwrap_or_else(|e| panic!("{sql}: the first column is no uuid: {e}"))
        })
        .collect()
}

/// Asserts that the ids `stored` in `what` are the `expected` ones, naming (up to 20 of) the
/// missing ones and the extra ones, and the duplicates when `stored` holds an id twice.
pub fn assert_same_ids(what: &str, expected: &HashSet<Uuid>, stored: &[Uuid]) {
    let set: HashSet<Uuid> = stored.iter().copied().collect();
    let sample = |ids: Vec<&Uuid>| -> String {
        let n = ids.len();
        let shown: Vec<String> = ids.iter().take(20).map(|id| id.to_string()).collect();
        format!(
            "{n}: {}{}",
            shown.join(", "),
            if n > 20 { ", ..." } else { "" }
        )
    };
    let missing: Vec<&Uuid> = expected.difference(&set).collect();
    let extra: Vec<&Uuid> = set.difference(expected).collect();
    let mut seen = HashSet::new();
    let twice: Vec<&Uuid> = stored.iter().filter(|id| !seen.insert(**id)).collect();
    assert!(
        missing.is_empty() && extra.is_empty() && twice.is_empty(),
        "{what}: {} ids stored for {} expected; missing {}; extra {}; stored twice {}",
        stored.len(),
        expected.len(),
        sample(missing),
        sample(extra),
        sample(twice),
    );
}

/// Waits (at most `timeout`) until `users` holds as many rows as `expected` has ids, then
/// asserts that it holds exactly those: no more rows, and the same ids (the missing and extra
/// ones named). `logs` (warren's) are shown when the count is off.
pub async fn assert_rows_exactly(
    env: &TestEnv,
    expected: &HashSet<Uuid>,
    timeout: Duration,
    logs: &dyn Fn() -> String,
) {
    let n = expected.len() as i64;
    wait_until(&format!("{n} rows"), timeout, || async {
        env.count_rows().await >= n
    })
    .await;
    assert_eq!(env.count_rows().await, n, "log:\n{}", logs());
    assert_same_ids(
        "users",
        expected,
        &uuids_of(env, "SELECT id FROM users").await,
    );
}

/// Whether [`install_fault`] also counts the insert attempts of tracked ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountAttempts {
    /// With the counting trigger: read the counts with [`attempts`].
    Yes,
    /// The failing trigger only.
    No,
}

/// Installs the failing trigger (and the counting one with [`CountAttempts::Yes`]) in the env's
/// schema; the fault starts active.
pub async fn install_fault(env: &TestEnv, count: CountAttempts) {
    let s = &env.schema;
    let counting = match count {
        CountAttempts::Yes => format!(
            r#"
            CREATE FUNCTION {s}.count_attempt() RETURNS trigger LANGUAGE plpgsql AS $f$
            DECLARE
                counter regclass := to_regclass(format('%I.%I', TG_TABLE_SCHEMA,
                    'attempts_' || replace(NEW.id::text, '-', '')));
            BEGIN
                IF counter IS NOT NULL THEN
                    PERFORM nextval(counter);
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER users_count_attempts BEFORE INSERT ON {s}.users
                FOR EACH ROW EXECUTE FUNCTION {s}.count_attempt();
            "#
        ),
        CountAttempts::No => String::new(),
    };
    env.db
        .batch_execute(&format!(
            r#"
            CREATE TABLE {s}.fault_flag (active boolean NOT NULL, sqlstate text NOT NULL DEFAULT '40001');
            INSERT INTO {s}.fault_flag VALUES (true);
            {counting}
            CREATE FUNCTION {s}.fail_while_flagged() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF (SELECT active FROM {s}.fault_flag) THEN
                    RAISE EXCEPTION 'injected failure'
                        USING ERRCODE = (SELECT sqlstate FROM {s}.fault_flag);
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER users_fail_while_flagged AFTER INSERT ON {s}.users
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.fail_while_flagged();
            "#
        ))
        .await
        .expect("install the fault triggers");
}

/// A trigger that refuses rows whose email starts with `poison` with an unclassified SQLSTATE
/// (P0001, raise_exception), row by row.
pub async fn install_poison_trigger(env: &TestEnv) {
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE FUNCTION {s}.refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF NEW.email LIKE 'poison%' THEN
                    RAISE EXCEPTION 'poisoned row %', NEW.id;
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER users_refuse_poison BEFORE INSERT ON {s}.users
                FOR EACH ROW EXECUTE FUNCTION {s}.refuse_poison();
            "#
        ))
        .await
        .expect("install the poison trigger");
}

/// A trigger that makes the insert of a user named `slow` sleep 3 s, row by row: past a small
/// `DATABASE_STATEMENT_TIMEOUT_MS`, its statement times out (57014), and so does its batch.
pub async fn install_slow_trigger(env: &TestEnv) {
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE FUNCTION {s}.slow_insert() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF NEW.name = 'slow' THEN
                    PERFORM pg_sleep(3);
                END IF;
                RETURN NEW;
            END $f$;
            CREATE TRIGGER users_slow_insert BEFORE INSERT ON {s}.users
                FOR EACH ROW EXECUTE FUNCTION {s}.slow_insert();
            "#
        ))
        .await
        .expect("install the slow trigger");
}

/// The body of a user named `slow` (see [`install_slow_trigger`]).
pub fn slow_user_body(id: Uuid) -> Vec<u8> {
    serde_json::json!({"id": id, "name": "slow", "email": format!("{id}@example.com")})
        .to_string()
        .into_bytes()
}

/// Makes the fault raise `sqlstate` instead of 40001 (for example 42501, a systemic error).
pub async fn set_fault_sqlstate(env: &TestEnv, sqlstate: &str) {
    env.db
        .execute(
            &format!("UPDATE {}.fault_flag SET sqlstate = $1", env.schema),
            &[&sqlstate],
        )
        .await
        .expect("set the fault's SQLSTATE");
}

/// Clears the fault: inserts succeed from now on.
pub async fn clear_fault(env: &TestEnv) {
    env.db
        .execute(
            &format!("UPDATE {}.fault_flag SET active = false", env.schema),
            &[],
        )
        .await
        .expect("clear the fault");
}

/// Creates the attempt counters of `ids` (before they are published).
pub async fn track_attempts(env: &TestEnv, ids: &[Uuid]) {
    let sql: String = ids
        .iter()
        .map(|id| format!("CREATE SEQUENCE {}.attempts_{};", env.schema, id.simple()))
        .collect();
    env.db.batch_execute(&sql).await.expect("attempt counters");
}

/// Insert attempts seen for a tracked `id` (committed or not).
pub async fn attempts(env: &TestEnv, id: Uuid) -> i64 {
    env.db
        .query_one(
            &format!(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}.attempts_{}",
                env.schema,
                id.simple()
            ),
            &[],
        )
        .await
        .expect("read attempt counter")
        .get(0)
}

/// A transaction holding a lock that blocks INSERT into `users` or another table (but not SELECT), so warren's
/// batches hang in the database (a command can land while they are in flight, a graceful
/// shutdown cannot drain); released by [`InsertLock::release`] or by dropping it.
pub struct InsertLock {
    client: tokio_postgres::Client,
    /// The backend holding the lock.
    pid: i32,
}

impl InsertLock {
    /// Takes the lock on the env's `users` table.
    pub async fn take(env: &TestEnv) -> Self {
        Self::take_on(env, "users").await
    }

    /// Takes the lock on `table` of the env's schema (a configured pipeline's).
    pub async fn take_on(env: &TestEnv, table: &str) -> Self {
        let (client, connection) = tokio_postgres::connect(&database_url(), NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "SET search_path TO {}; BEGIN; LOCK TABLE {table} IN SHARE MODE",
                env.schema
            ))
            .await
            .expect("lock the table");
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        InsertLock { client, pid }
    }

    /// Waits until some backend (warren's batch INSERT) waits for the lock.
    pub async fn wait_for_a_blocked_insert(&self, env: &TestEnv) {
        wait_until(
            "a warren INSERT blocked by the lock",
            Duration::from_secs(30),
            || async {
                env.db
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                        &[&self.pid],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0) > 0)
                    .unwrap_or_else(|e| panic!("pg_blocking_pids: {e:?}"))
            },
        )
        .await;
    }

    /// The backends (warren's statements) waiting for the lock now.
    pub async fn blocked(&self, env: &TestEnv) -> Vec<i32> {
        env.db
            .query(
                "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                &[&self.pid],
            )
            .await
            .unwrap_or_else(|e| panic!("pg_blocking_pids: {e:?}"))
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Lets the inserts through (`ROLLBACK`).
    pub async fn release(self) {
        self.client.batch_execute("ROLLBACK").await.expect("unlock");
    }
}

/// How many of the backends `pids` run a statement now (`state = 'active'`): once none does,
/// what they were running committed or rolled back.
pub async fn active_backends(env: &TestEnv, pids: &[i32]) -> i64 {
    env.db
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND state = 'active'",
            &[&pids],
        )
        .await
        .unwrap_or_else(|e| panic!("pg_stat_activity: {e:?}"))
        .get(0)
}

/// A superuser connection, for `pg_terminate_backend` (`WARREN_TEST_PG_SUPERUSER_URL`).
pub fn superuser_url() -> String {
    std::env::var("WARREN_TEST_PG_SUPERUSER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Terminates, as superuser, the backends whose client port is in `ports`; returns how many.
pub async fn terminate_backends(ports: &[i32]) -> usize {
    let (db, connection) = tokio_postgres::connect(&superuser_url(), NoTls)
        .await
        .unwrap_or_else(|e| panic!("superuser connection to {}: {e}", superuser_url()));
    tokio::spawn(connection);
    db.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE client_port = ANY($1) AND application_name LIKE 'warren%' AND pid <> pg_backend_pid()",
        &[&ports],
    )
    .await
    .expect("pg_terminate_backend")
    .iter()
    .filter(|row| row.get::<_, bool>(0))
    .count()
}

/// A trigger on the env's `dead_letters` refusing every park of a body over 1.5 MB (drop it
/// with `DROP TRIGGER refuse_big ON dead_letters`): bodies parking refuses, beside bodies it
/// takes.
pub async fn refuse_big_parks(env: &TestEnv) {
    env.db
        .batch_execute(
            "CREATE FUNCTION refuse_big() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               IF octet_length(NEW.body) > 1500000 THEN \
                 RAISE EXCEPTION 'test: body too large for parking'; \
               END IF; RETURN NEW; END $$; \
             CREATE TRIGGER refuse_big BEFORE INSERT ON dead_letters \
               FOR EACH ROW EXECUTE FUNCTION refuse_big()",
        )
        .await
        .expect("the trigger refusing big parks");
}

/// The window between a batch's question about `order_items`' DELETE triggers and its delete
/// (review R45 F5): another session holds a SHARE lock on `order_items` (reads pass, the delete
/// waits), and [`PutBackWindow::close`] creates, in that session, an AFTER DELETE trigger that
/// puts the deleted `SHIP` lines back, and commits once the delete waits for the lock.
pub struct PutBackWindow(tokio_postgres::Client);

impl PutBackWindow {
    /// Creates the trigger's function, then takes the lock in a session of its own.
    pub async fn open(env: &TestEnv) -> Self {
        env.db
            .batch_execute(
                "CREATE FUNCTION put_back() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                   INSERT INTO order_items SELECT * FROM gone WHERE sku = 'SHIP'; \
                   RETURN NULL; END $$",
            )
            .await
            .expect("the function");
        let (locker, connection) = tokio_postgres::connect(&database_url(), NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        locker
            .batch_execute(&format!(
                "SET search_path TO {}; BEGIN; LOCK TABLE order_items IN SHARE MODE",
                env.schema
            ))
            .await
            .expect("lock");
        Self(locker)
    }

    /// Waits until a session waits for the lock on `order_items`, then creates the trigger and
    /// commits (the lock goes, the waiting delete runs with the trigger in place).
    pub async fn close(self, env: &TestEnv) {
        wait_until(
            "a delete waiting for the lock",
            Duration::from_secs(30),
            || async {
                let sql = format!(
                    "SELECT count(*) FROM pg_locks \
                       WHERE NOT granted AND relation = '{}.order_items'::regclass",
                    env.schema
                );
                count_of(env, &sql).await > 0
            },
        )
        .await;
        self.0
            .batch_execute(
                "CREATE TRIGGER put_back AFTER DELETE ON order_items \
                   REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION put_back(); \
                 COMMIT",
            )
            .await
            .expect("the trigger, committed");
    }
}
