//! Live rates and rate limiting: RATE_LIMIT_PER_S caps what a pipeline takes (the rest waits in
//! the broker's queue), `warren ctl rate N` changes it at run time, and each instance writes its
//! own msg/s into its registry hash, which `warren status --watch` redraws.

mod common;

use std::io::Read;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

/// Settings shared by these tests: small batches flushed quickly, so the limiter, not the
/// batching, decides the pace; fast heartbeats.
fn limited_env(env: &mut TestEnv, rate: u32) {
    env.set("REGISTRY_HEARTBEAT_MS", "300")
        .set("USERS_BATCH_SIZE", "100")
        .set("USERS_BATCH_TIMEOUT_MS", "50")
        .set("PREFETCH", "200")
        .set("RATE_LIMIT_PER_S", rate.to_string());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rate_limit_holds_messages_in_the_queue_and_ctl_rate_changes_it_live() {
    let mut env = TestEnv::new("rate_limit").await;
    limited_env(&mut env, 500);
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    let pid = warren.pid();
    wait_running(&env, pid).await;
    assert_eq!(instance(&env, pid).await["rate_limit_per_s"], 500);

    // Phase 1: 3,000 messages at 500/s take at least 5.5 s (burst 25, then 2 ms apart).
    let started = Instant::now();
    env.publish_users(3000).await;
    // While limited, most messages wait in the broker, not in warren.
    wait_until("a third inserted", Duration::from_secs(20), || async {
        env.count_rows().await >= 1000
    })
    .await;
    let (ready, _) = env.queue_state(&env.main_queue).await;
    assert!(
        ready >= 1000,
        "only {ready} ready in the queue with 1,000+ inserted"
    );
    wait_until("3,000 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 3000
    })
    .await;
    let phase1 = started.elapsed();
    eprintln!("phase 1: 3000 messages at RATE_LIMIT_PER_S=500 in {phase1:?}");
    assert!(
        phase1 >= Duration::from_millis(5500),
        "3,000 messages at 500/s took only {phase1:?}"
    );

    // Phase 2: the same again; after 500 more rows, `ctl rate 5000` speeds up the rest.
    let started = Instant::now();
    env.publish_users(3000).await;
    wait_until("500 more rows", Duration::from_secs(20), || async {
        env.count_rows().await >= 3500
    })
    .await;
    let slow = started.elapsed();
    let (code, out, err) = env.run_async(&["ctl", "rate", "5000", "--all"]).await;
    assert_eq!(code, 0, "ctl rate:\n{out}\n{err}");
    assert!(out.contains("rate  executed"), "{out}");
    let sped_up = Instant::now();
    let rows_then = env.count_rows().await;
    let (ready, _) = env.queue_state(&env.main_queue).await;
    wait_until("6,000 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 6000
    })
    .await;
    let fast = sped_up.elapsed();
    let rest = 6000 - rows_then;
    let fast_rate = rest as f64 / fast.as_secs_f64();
    eprintln!(
        "phase 2: first 500 in {slow:?} (500/s), then {rest} in {fast:?} at 5000/s ({fast_rate:.0} msg/s; {ready} were still queued)"
    );
    assert!(
        rest >= 1000,
        "ctl rate came too late to measure ({rest} left)"
    );
    assert!(
        fast_rate > 1000.0,
        "after ctl rate 5000: {rest} in {fast:?} ({fast_rate:.0}/s)"
    );
    assert_eq!(instance(&env, pid).await["rate_limit_per_s"], 5000);

    // Recorded in the history, with its value.
    let (code, out, err) = env.run_async(&["ctl", "history", "--json"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.lines().any(|l| l.contains("\"command\":\"rate\"")
            && l.contains("\"rate\":5000")
            && l.contains("\"executed\"")),
        "{out}"
    );
    let (_, out, _) = env.run_async(&["ctl", "history"]).await;
    assert!(out.contains("rate=5000/s"), "{out}");
    // 0 turns it off.
    let (code, out, err) = env.run_async(&["ctl", "rate", "0", "--all"]).await;
    assert_eq!(code, 0, "ctl rate 0:\n{out}\n{err}");
    wait_until("limit off in the hash", Duration::from_secs(10), || async {
        instance(&env, pid).await["rate_limit_per_s"] == 0
    })
    .await;
    let (code, _, err) = env.run_async(&["ctl", "rate", "1000001", "--all"]).await;
    assert_eq!(code, 2, "out of range must be refused: {err}");

    assert!(warren.terminate(Duration::from_secs(25)).success());
    assert_eq!(env.count_rows().await, 6000);
    assert_queue_empty(&env, &env.main_queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_limited_instance_stops_cleanly_with_everything_settled() {
    let mut env = TestEnv::new("rate_stop").await;
    limited_env(&mut env, 100);
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut warren = env.start(&["--roles", "consumer"]);
    wait_running(&env, warren.pid()).await;
    env.publish_users(1000).await;
    wait_until("some rows", Duration::from_secs(20), || async {
        env.count_rows().await >= 50
    })
    .await;
    // SIGTERM with a held buffer: whatever was taken is inserted and acked, the rest stays queued.
    assert!(
        warren.terminate(Duration::from_secs(25)).success(),
        "{}",
        warren.logs()
    );
    let rows = env.count_rows().await;
    let (ready, consumers) = env.queue_state(&env.main_queue).await;
    assert_eq!(consumers, 0);
    assert_eq!(
        rows + i64::from(ready),
        1000,
        "{rows} rows + {ready} queued"
    );
    assert!(ready > 0, "the limit let everything through");
}

/// The last full redraw of `status --watch` in `text`.
fn last_frame(text: &str) -> Option<&str> {
    // Into a pipe, `status --watch` writes snapshots one after the other (no clear-screen
    // codes): each begins with the instances' table header.
    let frames: Vec<&str> = text.split("INSTANCE ").collect();
    // The last one may still be being written; take the one before when there are two.
    match frames.len() {
        0 | 1 => None,
        2 => frames.last().copied(),
        n => frames.get(n - 2).copied(),
    }
}

/// (received/s, inserted/s) of `pid` in a `status` table.
fn rates_in(frame: &str, pid: i32) -> Option<(f64, f64)> {
    let me = format!("{}:{pid}", host());
    let row: Vec<&str> = frame
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|t| t.first() == Some(&me.as_str()))?;
    Some((row.get(6)?.parse().ok()?, row.get(7)?.parse().ok()?))
}

#[tokio::test(flavor = "multi_thread")]
async fn status_watch_redraws_live_rates_of_two_instances() {
    let mut env = TestEnv::new("rate_watch").await;
    limited_env(&mut env, 200);
    let _cleanup = RedisCleanup::new(&env);
    env.declare();
    let mut a = env.start(&["--roles", "consumer"]);
    // Each instance needs its own metrics port.
    env.set("METRICS_ADDR", format!("127.0.0.1:{}", free_port()));
    let mut b = env.start(&["--roles", "consumer"]);
    let pids = [a.pid(), b.pid()];
    for pid in pids {
        wait_running(&env, pid).await;
    }

    let mut watch = env
        .command(&["status", "--watch", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("status --watch");
    let text = Arc::new(Mutex::new(String::new()));
    let mut stdout = watch.stdout.take().expect("stdout");
    let sink = text.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            if let Ok(mut t) = sink.lock() {
                t.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
    });
    let frame = || last_frame(&text.lock().unwrap()).map(str::to_string);

    // 2,000 messages at 200/s per instance: several seconds of traffic on both.
    env.publish_users(2000).await;
    wait_until(
        "both instances with rates above 0 in the hash",
        Duration::from_secs(20),
        || async {
            let mut all = true;
            for pid in pids {
                let i = instance(&env, pid).await;
                let rate = |k: &str| i[k].as_f64().unwrap_or(0.0);
                all &= rate("received_per_s") > 0.0 && rate("inserted_per_s") > 0.0;
            }
            all
        },
    )
    .await;
    let i = instance(&env, pids[0]).await;
    assert_eq!(i["breaker"], "closed", "{i:?}");
    assert_eq!(i["rate_limit_per_s"], 200, "{i:?}");
    wait_until(
        "a redraw with both instances moving",
        Duration::from_secs(10),
        || async {
            frame().is_some_and(|f| {
                pids.iter()
                    .all(|p| rates_in(&f, *p).is_some_and(|(r, i)| r > 0.0 && i > 0.0))
            })
        },
    )
    .await;
    let busy = frame().unwrap_or_default();
    assert!(busy.contains("BREAKER") && busy.contains("TREND"), "{busy}");
    assert!(
        !busy.contains('\x1b'),
        "no terminal codes into a pipe: {busy:?}"
    );
    assert!(busy.contains(&env.main_queue), "{busy}");

    wait_until("2,000 rows", Duration::from_secs(30), || async {
        env.count_rows().await == 2000
    })
    .await;
    wait_until(
        "a redraw with both instances at 0",
        Duration::from_secs(10),
        || async {
            frame().is_some_and(|f| pids.iter().all(|p| rates_in(&f, *p) == Some((0.0, 0.0))))
        },
    )
    .await;
    let redraws = text.lock().unwrap().matches("INSTANCE ").count();
    assert!(redraws >= 3, "{redraws} redraws");
    let _ = watch.kill();
    let _ = watch.wait();
    eprintln!("busy frame:\n{busy}");
    assert!(a.terminate(Duration::from_secs(25)).success());
    assert!(b.terminate(Duration::from_secs(25)).success());
}
