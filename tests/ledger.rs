//! The ledger: warren's promise checked the way Jepsen's total-queue checker does. One seeded run
//! publishes a known mix (good users, malformed bodies, duplicate emails, same-id conflicts, rows
//! a trigger refuses with an unclassified SQLSTATE, NUL bytes, exact duplicates of a message)
//! and messages drawn from everything AMQP 0-9-1 lets a publisher send (`common::hostile`: every
//! property unset, set or at its limits, short strings of invalid bytes, header tables of every
//! type nested or filled to the frame limit, another user's `user_id`, bodies from empty to past
//! MAX_MESSAGE_BYTES), while faults hit at random moments (the broker link cut, backends
//! terminated, kill -9 and restart, the DLQ deleted and re-declared, a database outage, the
//! database fenced read-only); then every message the broker confirmed must end exactly once: in
//! `users` (its row holds its content) or in `dead_letters` (by its ledger key, its row parked
//! once: `park_count` 1, never replayed), none twice, none missing, and every queue empty within a
//! bound.
//!
//! The faults hit while the messages are published: the publishing is paced over the whole fault
//! window, no chunk goes out before its share of the faults has begun (a fault that overruns its
//! slot holds the publishing back), and the last chunk waits for the last fault to end. Every fault type hits in every run
//! (the schedule is each type once plus more drawn at random, shuffled, one in each slot of the
//! window).
//!
//! The seed is printed; `WARREN_LEDGER_SEED=N` replays it, `WARREN_LEDGER_MESSAGES=N` (default
//! 2000), `WARREN_LEDGER_HOSTILE=N` (default 600) and `WARREN_LEDGER_FAULT_SECONDS=N` (default
//! 20) run it longer by hand.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::raw_amqp;
use common::*;
use lapin::BasicProperties;
use lapin::options::QueueDeleteOptions;
use tokio::sync::Mutex;
use uuid::Uuid;

/// What one published message is, and where it may end.
#[derive(Debug, Clone)]
struct Entry {
    /// The ledger key: the AMQP message id (unique per message; exact duplicates share it).
    message_id: String,
    /// The user it carries, if its body is a valid user.
    user: Option<(Uuid, String, String)>,
    /// The mix's label, for the report.
    kind: &'static str,
}

fn env_number(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seeded mix: (entry, body, properties) per publish, exact duplicates included.
fn mix(rng: &mut fastrand::Rng, n: usize) -> Vec<(Entry, Vec<u8>, BasicProperties)> {
    let mut out: Vec<(Entry, Vec<u8>, BasicProperties)> = Vec::with_capacity(n + n / 20);
    let mut good: Vec<(Uuid, String)> = Vec::new();
    for i in 0..n {
        let message_id = format!("m-{i}");
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2);
        let roll = rng.u32(0..100);
        let user = |id: Uuid, name: String, email: String| {
            (
                format!(r#"{{"id":"{id}","name":"{name}","email":"{email}"}}"#).into_bytes(),
                Some((id, name, email)),
            )
        };
        let (kind, (body, user)) = match roll {
            0..=5 => ("malformed", (b"{not json".to_vec(), None)),
            6..=7 => (
                "invalid_payload",
                (br#"{"id":"x","name":"","email":"nope"}"#.to_vec(), None),
            ),
            8..=12 if !good.is_empty() => {
                let (_, email) = &good[rng.usize(0..good.len())];
                (
                    "duplicate_email",
                    user(Uuid::new_v4(), format!("dup {i}"), email.clone()),
                )
            }
            13..=16 if !good.is_empty() => {
                let (id, email) = &good[rng.usize(0..good.len())];
                (
                    "same_id_conflict",
                    user(*id, format!("other {i}"), email.clone()),
                )
            }
            17..=19 => {
                let id = Uuid::new_v4();
                (
                    "poison",
                    user(
                        id,
                        format!("poison {i}"),
                        format!("poison-{id}@example.com"),
                    ),
                )
            }
            20..=22 => (
                "nul_bytes",
                (
                    format!("\0{{\"id\":\"{}\",\"name\":\"a\\u0000b\"}}", Uuid::new_v4())
                        .into_bytes(),
                    None,
                ),
            ),
            _ => {
                let id = Uuid::new_v4();
                let email = format!("{id}@example.com");
                good.push((id, email.clone()));
                ("good", user(id, format!("user {i}"), email))
            }
        };
        let props = if kind == "nul_bytes" {
            with_header(props, "x-note", long_string("has \0 a nul"))
        } else {
            props
        };
        let entry = Entry {
            message_id,
            user,
            kind,
        };
        // Exact duplicates (a publisher that retried): the same message twice.
        if rng.u32(0..100) < 3 {
            out.push((entry.clone(), body.clone(), props.clone()));
        }
        out.push((entry, body, props));
    }
    // Interleave a little, as several publishers would.
    for i in (1..out.len()).rev() {
        if rng.u32(0..10) == 0 {
            let j = rng.usize(i.saturating_sub(20)..=i);
            out.swap(i, j);
        }
    }
    out
}

/// A row of `dead_letters` as the check reads it: message id, error kind, reason, body,
/// `park_count`, and whether it was replayed.
type ParkedRow = (Option<String>, String, String, Vec<u8>, i32, bool);

/// One fault, as injected.
#[derive(Debug, Clone, Copy)]
enum Fault {
    CutBroker,
    TerminateBackends,
    Kill9,
    DeleteDlq,
    DatabaseOutage,
    /// The database answers every write with 25006 (read-only transaction) for a while, as a
    /// primary fenced during a failover.
    ReadOnly,
}

const FAULTS: [Fault; 6] = [
    Fault::CutBroker,
    Fault::TerminateBackends,
    Fault::Kill9,
    Fault::DeleteDlq,
    Fault::DatabaseOutage,
    Fault::ReadOnly,
];

/// The fault schedule over `window` (see [`fault_schedule`]).
fn schedule(rng: &mut fastrand::Rng, window: Duration) -> Vec<(Duration, Fault)> {
    fault_schedule(rng, window, &FAULTS)
}

/// Every schedule holds every fault type within its window ([`check_fault_schedules`]).
#[test]
fn every_schedule_holds_every_fault_type_within_its_window() {
    check_fault_schedules(&FAULTS);
}

/// A statement trigger on `users` and `dead_letters` that refuses every write as a read-only
/// server does (25006) while the fence is up ([`fence`]).
async fn install_read_only_fence(env: &TestEnv) {
    let s = &env.schema;
    env.db
        .batch_execute(&format!(
            r#"
            CREATE TABLE {s}.read_only_fence (up boolean NOT NULL);
            INSERT INTO {s}.read_only_fence VALUES (false);
            CREATE FUNCTION {s}.refuse_while_fenced() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                IF (SELECT up FROM {s}.read_only_fence) THEN
                    RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction'
                        USING ERRCODE = '25006';
                END IF;
                RETURN NULL;
            END $f$;
            CREATE TRIGGER users_read_only BEFORE INSERT OR UPDATE ON {s}.users
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            CREATE TRIGGER dead_letters_read_only BEFORE INSERT OR UPDATE ON {s}.dead_letters
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.refuse_while_fenced();
            "#
        ))
        .await
        .expect("install the read-only fence");
}

async fn fence(env: &TestEnv, up: bool) {
    env.db
        .execute(
            &format!("UPDATE {}.read_only_fence SET up = $1", env.schema),
            &[&up],
        )
        .await
        .expect("set the fence");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_published_message_ends_exactly_once_under_faults() {
    let seed = env_number("WARREN_LEDGER_SEED", fastrand::u64(..));
    let n = env_number("WARREN_LEDGER_MESSAGES", 2000) as usize;
    let n_hostile = env_number("WARREN_LEDGER_HOSTILE", 600) as usize;
    let fault_window = Duration::from_secs(env_number("WARREN_LEDGER_FAULT_SECONDS", 20));
    eprintln!(
        "ledger: seed {seed} (replay with WARREN_LEDGER_SEED={seed}), {n} messages and \
         {n_hostile} drawn from what AMQP allows"
    );
    let mut rng = fastrand::Rng::with_seed(seed);

    let pg = TcpProxy::start(&database_url(), 5432).await;
    let amqp = TcpProxy::start(&amqp_url(), 5672).await;
    let mut env = TestEnv::new("ledger").await;
    env.set("DATABASE_URL", pg.url())
        .set("AMQP_URL", amqp.url())
        .set("USERS_BATCH_SIZE", "200")
        .set("MAX_RETRIES", "2")
        .set("RETRY_TTL_MS", "300")
        .set("DLQ_MAX_ATTEMPTS", "3")
        .set("DB_RETRY_WINDOW_MS", "300")
        .set("PUBLISH_TIMEOUT_MS", "1000")
        .set("DATABASE_STATEMENT_TIMEOUT_MS", "3000")
        .set("MAX_MESSAGE_BYTES", "16384")
        .set("SHUTDOWN_TIMEOUT_MS", "5000");
    env.declare();
    install_poison_trigger(&env).await;
    install_read_only_fence(&env).await;
    let other_user = BrokerUser::create(&env.id).await;
    let hostile: Vec<common::hostile::Hostile> = (0..n_hostile)
        .map(|i| {
            let mut h = common::hostile::draw(&mut rng, i, &env.main_queue, 16384);
            if h.as_other_user {
                h.properties.user_id = Some(other_user.name.clone().into_bytes());
            }
            h
        })
        .collect();
    eprintln!(
        "ledger: property and body classes drawn {:?}",
        common::hostile::tally(hostile.iter())
    );

    let published = mix(&mut rng, n);
    let mut ledger: HashMap<String, Vec<Entry>> = HashMap::new();
    for (entry, _, _) in &published {
        let copies = ledger.entry(entry.message_id.clone()).or_default();
        if copies.is_empty() {
            copies.push(entry.clone());
        }
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for entries in ledger.values() {
        *counts.entry(entries[0].kind).or_default() += 1;
    }
    eprintln!("ledger: mix {counts:?}, {} publishes", published.len());

    // Two instances: the main pipeline, and the DLQ consumer (stopped for DLQ maintenance).
    let main = Arc::new(Mutex::new(env.start(&[
        "--roles",
        "consumer",
        "--set",
        "metrics_addr=127.0.0.1:0",
    ])));
    let dlq = Arc::new(Mutex::new(env.start(&[
        "--roles",
        "dlq",
        "--set",
        "metrics_addr=127.0.0.1:0",
    ])));
    // Logs of replaced instances, kept for the report (a dropped instance deletes its log).
    let history: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let retire = |w: &Warren| {
        history.lock().unwrap().push(format!(
            "---- {}:\n{}",
            w.log.display(),
            tail(&w.logs(), 60)
        ));
    };

    // Publishing in chunks paced over the fault window while the faults hit; the last chunk
    // waits for the last fault to end, so every fault lands while messages are published.
    let faults = schedule(&mut rng, fault_window);
    eprintln!("ledger: faults {faults:?}");
    let injected = AtomicBool::new(false);
    // Faults begun so far: chunk k waits for its share of them (k * faults / chunks), so a fault
    // that takes longer than its slot (a DLQ consumer slow to stop) holds the publishing back
    // rather than leaving the faults after it to land once everything is published.
    let begun = AtomicUsize::new(0);
    let started = Instant::now();
    // The hostile messages the broker confirmed (taken), by key; the others never enter it.
    let taken: Arc<std::sync::Mutex<HashMap<String, Entry>>> = Arc::default();
    let publish = async {
        let mut guest = raw_amqp::RawPublisher::new(&amqp_url()).expect("raw publisher");
        let mut other = raw_amqp::RawPublisher::new(&other_user.url()).expect("raw publisher");
        let chunks = published.len().div_ceil(50).max(1);
        let per_chunk = hostile.len().div_ceil(chunks).max(1);
        let mut drawn = hostile.chunks(per_chunk);
        let mut refused: HashMap<&str, usize> = HashMap::new();
        let pace = fault_window / chunks as u32;
        for (k, chunk) in published.chunks(50).enumerate() {
            if k + 1 == chunks {
                while !injected.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            } else {
                tokio::time::sleep((pace * k as u32).saturating_sub(started.elapsed())).await;
                while begun.load(Ordering::SeqCst) < k * faults.len() / chunks {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            env.publish_pipelined(chunk.iter().map(|(_, b, p)| (b.clone(), p.clone())))
                .await;
            for h in drawn.next().unwrap_or_default() {
                let publisher = if h.as_other_user {
                    &mut other
                } else {
                    &mut guest
                };
                let answer = publisher
                    .publish(&env.main_exchange, &env.main_queue, &h.properties, &h.body)
                    .await;
                match answer {
                    Ok(raw_amqp::Answer::Taken) => {
                        taken.lock().unwrap().insert(
                            h.key.clone(),
                            Entry {
                                message_id: h.key.clone(),
                                user: h.user.clone(),
                                kind: "hostile",
                            },
                        );
                    }
                    Ok(raw_amqp::Answer::Closed(_)) => *refused.entry("closed").or_default() += 1,
                    Ok(raw_amqp::Answer::NotTaken) => *refused.entry("not taken").or_default() += 1,
                    Err(e) => panic!("hostile publish {}: {e}", h.key),
                }
            }
        }
        eprintln!(
            "ledger: {} hostile messages confirmed by the broker, refused {refused:?}, the \
             publishing done at {:?}",
            taken.lock().unwrap().len(),
            started.elapsed()
        );
    };
    let inject = async {
        for (at, fault) in &faults {
            tokio::time::sleep(at.saturating_sub(started.elapsed())).await;
            begun.fetch_add(1, Ordering::SeqCst);
            match fault {
                Fault::CutBroker => {
                    amqp.cut();
                    amqp.restore();
                }
                Fault::TerminateBackends => {
                    terminate_backends(&pg.backend_client_ports()).await;
                }
                Fault::Kill9 => {
                    let (which, roles) = if rng.bool() {
                        (&main, "consumer")
                    } else {
                        (&dlq, "dlq")
                    };
                    let mut w = which.lock().await;
                    w.kill9();
                    retire(&w);
                    *w = env.start(&["--roles", roles, "--set", "metrics_addr=127.0.0.1:0"]);
                }
                Fault::DeleteDlq => {
                    // DLQ maintenance as the drift advice describes it: its consumer stopped,
                    // the DLQ unbound (from now on the main pipeline's dead-letter publishes are
                    // unroutable), then deleted (only if empty: deleting messages is the
                    // operator losing them) and re-declared, and its consumer started again.
                    // Unbinding first matters: RabbitMQ confirms a message routed to a queue
                    // that is deleted before it is enqueued, so deleting a queue that still
                    // receives publishes drops them whatever the publisher does.
                    let mut w = dlq.lock().await;
                    w.terminate(Duration::from_secs(30));
                    retire(&w);
                    let channel = env.conn.create_channel().await.expect("channel");
                    channel
                        .queue_unbind(
                            env.dlq_queue.as_str().into(),
                            env.dlx_exchange.as_str().into(),
                            env.dlq_queue.as_str().into(),
                            Default::default(),
                        )
                        .await
                        .expect("unbind the DLQ");
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    let deleted = channel
                        .queue_delete(
                            env.dlq_queue.as_str().into(),
                            QueueDeleteOptions {
                                if_empty: true,
                                ..Default::default()
                            },
                        )
                        .await;
                    if deleted.is_err() {
                        eprintln!("ledger: DLQ not empty, not deleted");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    env.declare();
                    *w = env.start(&["--roles", "dlq", "--set", "metrics_addr=127.0.0.1:0"]);
                }
                Fault::DatabaseOutage => {
                    pg.cut();
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    pg.restore();
                }
                Fault::ReadOnly => {
                    fence(&env, true).await;
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    fence(&env, false).await;
                }
            }
            eprintln!("ledger: {:?} at {:?}", fault, started.elapsed());
        }
        injected.store(true, Ordering::SeqCst);
    };
    tokio::join!(publish, inject);
    pg.restore();
    amqp.restore();
    fence(&env, false).await;
    for (key, entry) in taken.lock().unwrap().drain() {
        ledger.insert(key, vec![entry]);
    }

    // Everything accounted for within a bound.
    let expected = ledger.len();
    // Rows in users and dead_letters; `None` (not settled) while the database does not answer.
    let accounted = || async {
        match env
            .db
            .query_one(
                "SELECT (SELECT count(*) FROM users) + (SELECT count(*) FROM dead_letters)",
                &[],
            )
            .await
        {
            Ok(row) => Some(row.get::<_, i64>(0) as usize),
            Err(e) => {
                eprintln!("ledger: cannot count the rows: {e}");
                None
            }
        }
    };
    // Backoffs grow with the faults (requeues up to 30 s, DLQ attempts likewise): the bound
    // grows with the fault window.
    let settle = Duration::from_secs(180) + 2 * fault_window;
    let deadline = Instant::now() + settle;
    let mut unsettled: Option<String> = None;
    let mut progress = Instant::now();
    loop {
        let rows = accounted().await;
        let done = rows.is_some_and(|n| n >= expected);
        let mut empty = true;
        let mut state = Vec::new();
        for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
            let counts = queue_counts(q).await;
            if counts != (0, 0) {
                empty = false;
            }
            state.push(counts);
        }
        if done && empty {
            break;
        }
        if progress.elapsed() > Duration::from_secs(10) {
            progress = Instant::now();
            eprintln!(
                "ledger: at {:?}, {rows:?} of {expected} rows; main, retry, DLQ (ready, \
                 unacked) {state:?}",
                started.elapsed()
            );
        }
        if Instant::now() > deadline {
            for w in [&main, &dlq] {
                let w = w.lock().await;
                history.lock().unwrap().push(format!(
                    "---- {}:\n{}",
                    w.log.display(),
                    tail(&w.logs(), 120)
                ));
            }
            let mut state = String::new();
            for q in [&env.main_queue, &env.retry_queue, &env.dlq_queue] {
                state.push_str(&format!("{q}: {:?}; ", queue_counts(q).await));
            }
            unsettled = Some(format!(
                "not settled within {settle:?}: {:?} of {expected} accounted; {state}",
                accounted().await
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    main.lock().await.terminate(Duration::from_secs(30));
    dlq.lock().await.terminate(Duration::from_secs(30));

    // The check: every message once, in users (holding its content) or in dead_letters.
    let users: HashMap<Uuid, (String, String)> = env
        .db
        .query("SELECT id, name, email FROM users", &[])
        .await
        .expect("users")
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    // Each parked row with how often it was parked (`park_count`: 1 when parked, + 1 each time
    // it is parked again after a replay; a second park without a replay leaves it as it is) and
    // whether it was replayed. Nothing replays here: every row must be parked once, open.
    let parked: Vec<ParkedRow> = env
        .db
        .query(
            "SELECT message_id, error_kind, error_reason, body, park_count, \
             replayed_at IS NOT NULL FROM dead_letters",
            &[],
        )
        .await
        .expect("dead_letters")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    let mut problems: Vec<String> = unsettled.into_iter().collect();
    let mut parked_ids: HashMap<String, usize> = HashMap::new();
    // Why each was parked (the last row's kind and reason), for the report.
    let mut parked_why: HashMap<String, String> = HashMap::new();
    for (id, kind, reason, body, park_count, replayed) in &parked {
        // The ledger key: the body's marker or the message id's start (a hostile id is decoded
        // lossily, past its key).
        let key = common::hostile::key_of(id.as_deref(), body)
            .unwrap_or_else(|| format!("<none: id {id:?}>"));
        *parked_ids.entry(key.clone()).or_default() += 1;
        if *park_count != 1 || *replayed {
            problems.push(format!(
                "{key}: parked with park_count {park_count}, replayed {replayed} ({kind}); \
                 expected parked once, never replayed"
            ));
        }
        parked_why.insert(key, format!("{kind}: {reason}"));
    }
    let mut owners: HashSet<Uuid> = HashSet::new();
    for (message_id, entries) in &ledger {
        let entry = &entries[0];
        let in_users = entry.user.as_ref().is_some_and(|(id, name, email)| {
            users.get(id).is_some_and(|(n, e)| n == name && e == email)
        });
        let times_parked = parked_ids.get(message_id).copied().unwrap_or(0);
        match (in_users, times_parked) {
            (true, 0) => {
                if let Some((id, ..)) = &entry.user {
                    owners.insert(*id);
                }
            }
            (false, 1) => {}
            (in_users, times) => problems.push(format!(
                "{message_id} ({}): in users {in_users}, parked {times} times{}",
                entry.kind,
                parked_why
                    .get(message_id)
                    .map(|why| format!(" (last as {why})"))
                    .unwrap_or_default()
            )),
        }
    }
    for (id, times) in &parked_ids {
        if !ledger.contains_key(id) {
            problems.push(format!(
                "parked message {id:?} ({times}x) was never published"
            ));
        }
    }
    if users.len() != owners.len() {
        problems.push(format!(
            "{} rows in users, {} owned by a published message",
            users.len(),
            owners.len()
        ));
    }
    let mut kinds: HashMap<&str, usize> = HashMap::new();
    for (_, kind, ..) in &parked {
        *kinds.entry(kind.as_str()).or_default() += 1;
    }
    eprintln!(
        "ledger: seed {seed}: {expected} messages, {} in users, {} parked {kinds:?}, {} faults, \
         settled after {:?}, {} problems",
        owners.len(),
        parked.len(),
        faults.len(),
        started.elapsed(),
        problems.len()
    );
    assert!(
        problems.is_empty(),
        "seed {seed}: {} problems:\n{}\n{}",
        problems.len(),
        problems.join("\n"),
        history.lock().unwrap().join("\n")
    );
}
