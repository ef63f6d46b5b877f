//! Node loss under load, on the 3-node test cluster (`scripts/cluster.sh up`, found through
//! `WARREN_TEST_CLUSTER_URLS`): with `QUEUE_TYPE=quorum`, the API (`POST /api/v1/users` with an
//! `Idempotency-Key`, its links starting on the leader) and two `warren publish --stdin` (one
//! starting on the leader, one on a survivor) feed the main queue while two consumer instances,
//! started on different nodes (the leader and a survivor), drain it; the node that leads the
//! main queue is killed with `kill -9` in the middle, and feeding goes on through the failover.
//! Then:
//!
//! - every message whose publish was confirmed (an API `200`, a `warren publish` line not named
//!   as unconfirmed, and each `warren publish` counts exactly those) is in `users` exactly once,
//!   with its content; nothing else is there but messages that were sent and not confirmed (a
//!   confirm lost with the node: counted and printed);
//! - the API answered `200` or `503`, nothing else, and `200` again after its last `503` (it
//!   recovers by itself); a `503` promises nothing in general (the message may have been
//!   enqueued, its confirm lost with the node): the test counts both cases, checks that what
//!   warren never sent (`no connection to the broker`) or the queue nacked is absent, then
//!   retries every `503` with the same `Idempotency-Key`, and each key ends once in `users`;
//! - both consumers resumed by themselves: each is subscribed again, on a surviving node
//!   (`warren_amqp_node_info`, `warren_connection_up`), and took deliveries after the kill; the
//!   queues end empty (nothing unacked, nothing dead-lettered).
//!
//! The killed node is started again at the end (`scripts/cluster.sh up`), also when the test
//! fails, so the cluster is whole for the next test.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;
use uuid::Uuid;

// ---- this file's setup ----------------------------------------------------------------------

/// How long the load runs before the kill, and after it.
const BEFORE_KILL: Duration = Duration::from_secs(4);
const AFTER_KILL: Duration = Duration::from_secs(8);

fn cluster_script() -> String {
    format!("{}/scripts/cluster.sh", env!("CARGO_MANIFEST_DIR"))
}

/// One node of `scripts/cluster.sh status`.
#[derive(Debug, Clone)]
struct Node {
    /// `warren-rcN@localhost`.
    name: String,
    /// Its AMQP `127.0.0.1:PORT`, as warren names nodes in logs and metrics.
    amqp: String,
    /// The OS pid of its Erlang VM, `None` when not running.
    pid: Option<u32>,
}

/// The nodes as `scripts/cluster.sh status` lists them (it finds each VM's pid and checks it
/// is that node's).
fn cluster_status() -> Vec<Node> {
    let out = Command::new(cluster_script())
        .arg("status")
        .output()
        .expect("run scripts/cluster.sh status");
    let text = String::from_utf8_lossy(&out.stdout);
    let nodes: Vec<Node> = text
        .lines()
        .filter(|l| l.starts_with("warren-rc"))
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            Node {
                name: cols[0].to_string(),
                amqp: cols[1].to_string(),
                pid: cols[3].parse().ok(),
            }
        })
        .collect();
    assert_eq!(nodes.len(), 3, "scripts/cluster.sh status:\n{text}");
    nodes
}

/// Runs `scripts/cluster.sh up` on drop: a killed node is started again and rejoins, even when
/// the test panics.
struct RestartOnDrop;

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        let out = Command::new(cluster_script())
            .arg("up")
            .output()
            .expect("run scripts/cluster.sh up");
        if !out.status.success() {
            eprintln!(
                "scripts/cluster.sh up failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// The node that leads quorum queue `queue`, asked of `node`; `None` while it has none (an
/// election) or `node` does not answer.
async fn try_leader_of(node: &str, queue: &str) -> Option<String> {
    let (ok, text) = try_rabbitmqctl(&[
        "-n",
        node,
        "list_queues",
        "name",
        "leader",
        "--formatter",
        "json",
    ])
    .await;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text[text.find('[')?..]).ok()?;
    ok.then_some(())?;
    rows.into_iter()
        .find(|q| q["name"].as_str() == Some(queue))
        .and_then(|q| q["leader"].as_str().map(String::from))
        .filter(|l| l.starts_with("warren-rc"))
}

/// The node that leads quorum queue `queue`, asked of `node`.
async fn leader_of(node: &str, queue: &str) -> String {
    try_leader_of(node, queue)
        .await
        .unwrap_or_else(|| panic!("no leader for {queue} on {node}"))
}

/// Consumer tags on `queue`, asked of `node`.
async fn consumers_on(node: &str, queue: &str) -> Vec<String> {
    rabbitmqctl_rows(&["-n", node, "list_consumers", "queue_name", "consumer_tag"])
        .await
        .into_iter()
        .filter(|c| c["queue_name"].as_str() == Some(queue))
        .filter_map(|c| c["consumer_tag"].as_str().map(String::from))
        .collect()
}

/// The `/metrics` of the warren whose metrics listen on `port`, parsed; `None` if it does not
/// answer.
async fn scrape(port: u16) -> Option<Scrape> {
    let url = format!("http://127.0.0.1:{port}/metrics");
    tokio::task::spawn_blocking(move || {
        ureq::get(&url)
            .call()
            .and_then(|mut r| r.body_mut().read_to_string())
            .ok()
    })
    .await
    .expect("metrics task")
    .map(Scrape::parse)
}

/// One consumer instance: its process and where its metrics listen.
struct ConsumerInstance {
    warren: Warren,
    metrics_port: u16,
    /// The node its `AMQP_URL` list starts with.
    first: String,
}

/// What `POST /api/v1/users` with `key` publishes: the user id (UUID v5 of the key) and body.
fn api_user(key: &str) -> (Uuid, String, String) {
    let id = Uuid::new_v5(&warren::http::IDEMPOTENCY_NAMESPACE, key.as_bytes());
    (id, format!("api {key}"), format!("{key}@example.com"))
}

/// One `POST` with `Idempotency-Key: key`: the status and body, `None` if nothing answered.
fn post_key_answer(agent: &ureq::Agent, base: &str, key: &str) -> Option<(u16, String)> {
    let (_, name, email) = api_user(key);
    let body = serde_json::json!({"name": name, "email": email}).to_string();
    agent
        .post(&format!("{base}/api/v1/users"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .send(body.as_bytes())
        .ok()
        .map(|mut r| {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        })
}

/// One `POST` with `Idempotency-Key: key`: the status, `None` if nothing answered.
fn post_key(agent: &ureq::Agent, base: &str, key: &str) -> Option<u16> {
    post_key_answer(agent, base, key).map(|(s, _)| s)
}

/// What the feeders did: API answers by key, and `warren publish` lines.
#[derive(Default)]
struct Fed {
    /// Idempotency key, status (`None` for no answer), sent after the kill, answered when.
    api: Vec<(String, Option<u16>, bool, Instant)>,
    /// The body of each answer other than 200, by idempotency key.
    errors: HashMap<String, String>,
    /// Every id written to `warren publish --stdin`, with its (name, email).
    cli: HashMap<Uuid, (String, String)>,
}

// ---- the test -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_main_queues_leader_under_load_loses_no_confirmed_message() {
    let mut c = ClusterEnv::new("failover").await;
    c.env
        .set("QUEUE_TYPE", "quorum")
        .set("PREFETCH", "200")
        .set("USERS_BATCH_SIZE", "100")
        .set("SHUTDOWN_TIMEOUT_MS", "10000");
    c.env.declare();
    // Declared after `c`, so dropped before it: the node is back before the queues are deleted.
    let restart = RestartOnDrop;
    let urls = cluster_urls();
    let nodes = cluster_status();
    assert!(
        nodes.iter().all(|n| n.pid.is_some()),
        "a cluster node is down: {nodes:?}; run scripts/cluster.sh up"
    );
    let url_of = |n: &Node| -> String {
        let port = n.amqp.rsplit(':').next().unwrap();
        urls.iter()
            .find(|u| u.contains(&format!(":{port}/")))
            .unwrap_or_else(|| panic!("no URL for {n:?} in {urls:?}"))
            .clone()
    };
    let list = |order: &[&Node]| {
        order
            .iter()
            .map(|n| url_of(n))
            .collect::<Vec<_>>()
            .join(",")
    };

    let leader_name = leader_of(&nodes[0].name, &c.env.main_queue).await;
    let li = nodes
        .iter()
        .position(|n| n.name == leader_name)
        .unwrap_or_else(|| panic!("leader {leader_name} is not a cluster node: {nodes:?}"));
    let leader = nodes[li].clone();
    let (s1, s2) = (&nodes[(li + 1) % 3], &nodes[(li + 2) % 3]);
    eprintln!(
        "failover: {} leads {}; survivors {} and {}",
        leader.name, c.env.main_queue, s1.name, s2.name
    );

    // Two consumers starting on different nodes (one on the leader, whose link dies), the API
    // on the leader (its publisher must move), `warren publish` on a survivor.
    let mut consumers = Vec::new();
    for order in [[&leader, s1, s2], [s1, s2, &leader]] {
        c.env.set("AMQP_URL", list(&order));
        let metrics_port = free_port();
        let warren = c.env.start(&[
            "--roles",
            "consumer",
            "--set",
            &format!("metrics_addr=127.0.0.1:{metrics_port}"),
        ]);
        consumers.push(ConsumerInstance {
            warren,
            metrics_port,
            first: order[0].amqp.clone(),
        });
    }
    c.env.set("AMQP_URL", list(&[&leader, s2, s1]));
    let mut api = c.env.start(&["--roles", "api"]);
    let mut logs: Vec<_> = consumers.iter().map(|i| i.warren.log.clone()).collect();
    logs.push(api.log.clone());
    let _logs = LogsOnPanic(logs);

    let base = c.env.http_base();
    wait_until("the API ready", Duration::from_secs(30), || async {
        http(&c.env, "GET", "/readyz", None)
            .await
            .is_some_and(|(s, _)| s == 200)
    })
    .await;
    wait_until(
        "both consumers subscribed",
        Duration::from_secs(30),
        || async { consumers_on(&s1.name, &c.env.main_queue).await.len() == 2 },
    )
    .await;

    // The feeders: three API clients, and `warren publish --stdin` fed line by line.
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let fed = Arc::new(Mutex::new(Fed::default()));
    let mut feeders = Vec::new();
    for t in 0..3 {
        let (stop, killed, fed, base) = (stop.clone(), killed.clone(), fed.clone(), base.clone());
        let prefix = c.env.id.clone();
        feeders.push(std::thread::spawn(move || {
            let agent = http_agent();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("{prefix}-{t}-{n}");
                n += 1;
                let after = killed.load(Ordering::Relaxed);
                let answer = post_key_answer(&agent, &base, &key);
                let status = answer.as_ref().map(|(s, _)| *s);
                let mut fed = fed.lock().unwrap();
                if let Some((s, body)) = answer.filter(|(s, _)| *s != 200) {
                    fed.errors.insert(key.clone(), format!("{s} {body}"));
                }
                fed.api.push((key, status, after, Instant::now()));
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
    }
    // Two `warren publish --stdin`: one starting on the leader (its link dies), one on a
    // survivor (its channel stays, the queue's leader changes under it).
    let mut clis = Vec::new();
    for order in [[&leader, s2, s1], [s2, &leader, s1]] {
        c.env.set("AMQP_URL", list(&order));
        let mut child = c
            .env
            .command(&["publish", "--stdin", "--in-flight", "64"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start warren publish");
        let mut input = child.stdin.take().expect("stdin");
        let (stop, fed) = (stop.clone(), fed.clone());
        let writer = std::thread::spawn(move || {
            let mut mine = HashSet::new();
            while !stop.load(Ordering::Relaxed) {
                let id = Uuid::new_v4();
                let (name, email) = (format!("cli {id}"), format!("{id}@example.org"));
                let line = serde_json::json!({"id": id, "name": name, "email": email});
                fed.lock().unwrap().cli.insert(id, (name, email));
                mine.insert(id);
                if writeln!(input, "{line}").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(8));
            }
            // Dropping stdin ends the input: warren publish finishes and reports.
            mine
        });
        clis.push((order[0].amqp.clone(), child, writer));
    }

    // The kill, mid-load, of whatever node leads the main queue now.
    let load_started = Instant::now();
    wait_until("rows arriving", Duration::from_secs(30), || async {
        c.env.count_rows().await >= 100
    })
    .await;
    tokio::time::sleep(BEFORE_KILL.saturating_sub(load_started.elapsed())).await;
    let now_leading = leader_of(&s1.name, &c.env.main_queue).await;
    assert_eq!(now_leading, leader.name, "the leader moved before the kill");
    let received_before: Vec<f64> = {
        let mut v = Vec::new();
        for i in &consumers {
            let s = scrape(i.metrics_port).await.expect("consumer metrics");
            v.push(s.sum(
                "warren_messages_received_total",
                &[("pipeline", "users"), ("stage", "main")],
            ));
        }
        v
    };
    let pid = leader.pid.expect("leader pid");
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -9 {pid} ({})", leader.name);
    killed.store(true, Ordering::Relaxed);
    let killed_at = Instant::now();
    eprintln!(
        "failover: killed {} (pid {pid}) after {:?}, {} rows",
        leader.name,
        load_started.elapsed(),
        c.env.count_rows().await
    );
    wait_until(
        "a new leader on a survivor",
        Duration::from_secs(30),
        || async {
            try_leader_of(&s1.name, &c.env.main_queue)
                .await
                .is_some_and(|l| l != leader.name)
        },
    )
    .await;
    eprintln!(
        "failover: {} leads after {:?}",
        leader_of(&s1.name, &c.env.main_queue).await,
        killed_at.elapsed()
    );
    tokio::time::sleep(AFTER_KILL.saturating_sub(killed_at.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    for f in feeders {
        f.join().expect("feeder");
    }
    // What the feeders were told: each `warren publish` names the lines it could not confirm,
    // and its count of published messages is the rest.
    let mut unconfirmed_cli: HashSet<Uuid> = HashSet::new();
    let mut cli_reports = Vec::new();
    for (first, child, writer) in clis {
        let sent = writer.join().expect("warren publish feeder");
        let out = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .expect("warren publish output");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        let mut named: HashSet<Uuid> = HashSet::new();
        for line in stderr.lines() {
            if let Some(rest) = line.strip_prefix("warren publish: line ")
                && let Some(id) = rest.split("(id ").nth(1).and_then(|r| r.split(')').next())
            {
                named.insert(id.parse().expect("an id"));
            }
        }
        assert!(
            named.is_subset(&sent),
            "warren publish named lines never sent"
        );
        assert!(
            stdout.contains(&format!("published {} messages", sent.len() - named.len())),
            "warren publish (from {first}): its count differs from the lines it did not name \
             ({} sent, {} named):\n{stdout}\n{stderr}",
            sent.len(),
            named.len()
        );
        cli_reports.push(format!(
            "from {first}: {} lines, {} not confirmed",
            sent.len(),
            named.len()
        ));
        unconfirmed_cli.extend(named);
    }
    let fed = std::mem::take(&mut *fed.lock().unwrap());
    let confirmed_cli: HashSet<Uuid> = fed
        .cli
        .keys()
        .filter(|id| !unconfirmed_cli.contains(id))
        .copied()
        .collect();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for (_, status, after, _) in &fed.api {
        let label = format!(
            "{} {}",
            if *after { "after" } else { "before" },
            status.map_or("no answer".to_string(), |s| s.to_string())
        );
        *statuses.entry(label).or_default() += 1;
    }
    eprintln!("failover: API answers {statuses:?}; warren publish {cli_reports:?}");
    let after_kill = |status: u16| -> Vec<Duration> {
        fed.api
            .iter()
            .filter(|(_, s, after, _)| *after && *s == Some(status))
            .map(|(_, _, _, at)| at.saturating_duration_since(killed_at))
            .collect()
    };
    let (ok_after, unavailable_after) = (after_kill(200), after_kill(503));
    eprintln!(
        "failover: API 503s after the kill from {:?} to {:?}; 200s after the kill: {}",
        unavailable_after.iter().min(),
        unavailable_after.iter().max(),
        ok_after.len()
    );
    assert!(
        ok_after
            .iter()
            .any(|at| unavailable_after.iter().all(|u| at > u)),
        "the API did not recover during the load: no 200 after its last 503"
    );
    let odd: Vec<_> = fed
        .api
        .iter()
        .filter(|(_, s, _, _)| !matches!(s, Some(200) | Some(503)))
        .collect();
    assert!(
        odd.is_empty(),
        "API answers other than 200 and 503: {odd:?}"
    );
    let api_200: HashSet<Uuid> = fed
        .api
        .iter()
        .filter(|(_, s, _, _)| *s == Some(200))
        .map(|(k, _, _, _)| api_user(k).0)
        .collect();
    let api_503: Vec<String> = fed
        .api
        .iter()
        .filter(|(_, s, _, _)| *s == Some(503))
        .map(|(k, _, _, _)| k.clone())
        .collect();

    // Every confirmed message arrives, the queue drains: the consumers resumed by themselves.
    let confirmed: HashSet<Uuid> = api_200.union(&confirmed_cli).copied().collect();
    wait_until(
        &format!("the {} confirmed messages in users", confirmed.len()),
        Duration::from_secs(60),
        || async {
            let rows = c.env.row_ids().await;
            confirmed.is_subset(&rows)
        },
    )
    .await;
    wait_until(
        "the main queue drained (nothing ready or unacked)",
        Duration::from_secs(30),
        || async { queue_counts_on(Some(&s1.name), &c.env.main_queue).await == (0, 0) },
    )
    .await;
    eprintln!(
        "failover: everything confirmed is in users {:?} after the kill",
        killed_at.elapsed()
    );
    let survivors = [s1.amqp.as_str(), s2.amqp.as_str()];
    for (i, (instance, before)) in consumers.iter().zip(&received_before).enumerate() {
        let s = scrape(instance.metrics_port)
            .await
            .unwrap_or_else(|| panic!("consumer {i} metrics"));
        let on: Vec<String> = s
            .matching("warren_amqp_node_info", &[("link", "users/main")])
            .filter(|x| x.value == 1.0)
            .filter_map(|x| x.labels.get("node").cloned())
            .collect();
        assert!(
            on.len() == 1 && survivors.contains(&on[0].as_str()),
            "consumer {i} (started on {}) is on {on:?}, not on a survivor {survivors:?}",
            instance.first
        );
        assert_eq!(
            s.one("warren_connection_up", &[("target", "amqp")]),
            Some(1.0),
            "consumer {i}: warren_connection_up"
        );
        let after = s.sum(
            "warren_messages_received_total",
            &[("pipeline", "users"), ("stage", "main")],
        );
        assert!(
            after > *before,
            "consumer {i} (started on {}) took nothing after the kill ({before} before)",
            instance.first
        );
        eprintln!(
            "failover: consumer {i} started on {}, now on {}, received {before} before the kill, {} after",
            instance.first,
            on[0],
            after - before
        );
    }
    let tags = consumers_on(&s1.name, &c.env.main_queue).await;
    eprintln!("failover: consumers on the main queue: {tags:?}");
    for instance in &consumers {
        let mine = format!("-{}-users/main-", instance.warren.pid());
        assert!(
            tags.iter().any(|t| t.contains(&mine)),
            "consumer {} (pid {}) is not subscribed: {tags:?}",
            instance.first,
            instance.warren.pid()
        );
    }

    // A 503 promises nothing: count what the failover did with them, then retry each with the
    // same key; every key ends once in users.
    let rows = c.env.row_ids().await;
    let mut by_error: BTreeMap<(&str, bool), usize> = BTreeMap::new();
    for key in &api_503 {
        let present = rows.contains(&api_user(key).0);
        *by_error
            .entry((fed.errors[key].as_str(), present))
            .or_default() += 1;
        // What warren never sent, and what a quorum queue refused, is not in the queue.
        let error = &fed.errors[key];
        if error.contains("no connection to the broker") || error.contains("(nack)") {
            assert!(!present, "{key}: answered {error}, yet in users");
        }
    }
    eprintln!("failover: API 503s by (answer, present anyway): {by_error:?}");
    let present_503 = api_503
        .iter()
        .filter(|k| rows.contains(&api_user(k).0))
        .count();
    let cli_unconfirmed_present = unconfirmed_cli
        .iter()
        .filter(|id| rows.contains(id))
        .count();
    eprintln!(
        "failover: API 503s: {} ({present_503} present anyway, {} absent); warren publish \
         unconfirmed: {} ({cli_unconfirmed_present} present anyway, {} absent)",
        api_503.len(),
        api_503.len() - present_503,
        unconfirmed_cli.len(),
        unconfirmed_cli.len() - cli_unconfirmed_present
    );
    let retries = api_503.clone();
    let base2 = base.clone();
    let retried = tokio::task::spawn_blocking(move || {
        let agent = http_agent();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut still: Vec<(String, Option<u16>)> = Vec::new();
        for key in retries {
            let mut status = post_key(&agent, &base2, &key);
            while status != Some(200) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
                status = post_key(&agent, &base2, &key);
            }
            if status != Some(200) {
                still.push((key, status));
            }
        }
        still
    });
    let still = retried.await.expect("retries");
    assert!(still.is_empty(), "retries not answered 200: {still:?}");

    // The sentinel, sent last: once it is a row and the queue is empty, nothing else is coming.
    let sentinel = format!("{}-sentinel", c.env.id);
    let agent = http_agent();
    let s = {
        let (b, k) = (base.clone(), sentinel.clone());
        tokio::task::spawn_blocking(move || post_key(&agent, &b, &k))
            .await
            .unwrap()
    };
    assert_eq!(s, Some(200), "the sentinel");
    let api_ids: HashSet<Uuid> = fed.api.iter().map(|(k, _, _, _)| api_user(k).0).collect();
    let mut must: HashSet<Uuid> = api_ids.union(&confirmed_cli).copied().collect();
    must.insert(api_user(&sentinel).0);
    wait_until(
        "every API key (retried) and the sentinel in users",
        Duration::from_secs(60),
        || async { must.is_subset(&c.env.row_ids().await) },
    )
    .await;
    wait_until(
        "the main queue drained again",
        Duration::from_secs(30),
        || async { queue_counts_on(Some(&s1.name), &c.env.main_queue).await == (0, 0) },
    )
    .await;

    // Exactly once, with the content that was sent; nothing that was never sent.
    let rows: Vec<(Uuid, String, String)> = c
        .env
        .db
        .query("SELECT id, name, email FROM users", &[])
        .await
        .expect("users")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let mut sent: HashMap<Uuid, (String, String)> = fed.cli.clone();
    for key in fed
        .api
        .iter()
        .map(|(k, _, _, _)| k.clone())
        .chain([sentinel.clone()])
    {
        let (id, name, email) = api_user(&key);
        sent.insert(id, (name, email));
    }
    let mut seen: HashSet<Uuid> = HashSet::new();
    for (id, name, email) in &rows {
        assert!(seen.insert(*id), "{id} twice in users");
        let want = sent
            .get(id)
            .unwrap_or_else(|| panic!("{id} in users was never sent"));
        assert_eq!((name, email), (&want.0, &want.1), "{id}: content");
    }
    let missing: Vec<&Uuid> = must.iter().filter(|id| !seen.contains(id)).collect();
    assert!(missing.is_empty(), "missing from users: {missing:?}");
    for q in [&c.env.retry_queue, &c.env.dlq_queue] {
        assert_eq!(
            queue_counts_on(Some(&s1.name), q).await,
            (0, 0),
            "{q} not empty"
        );
    }
    eprintln!(
        "failover: {} rows: {} API keys ({} 200 at once, {} 503 then retried), {} warren \
         publish lines confirmed, {cli_unconfirmed_present} unconfirmed ones arrived anyway, \
         sentinel",
        rows.len(),
        api_ids.len(),
        api_200.len(),
        api_503.len(),
        confirmed_cli.len(),
    );

    for mut instance in consumers {
        assert!(
            instance.warren.terminate(Duration::from_secs(20)).success(),
            "consumer exit:\n{}",
            instance.warren.logs()
        );
    }
    assert!(api.terminate(Duration::from_secs(20)).success());
    drop(restart);
}
