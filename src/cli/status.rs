//! `warren status [--json]`: the live instances from the Redis registry and, for each queue, its
//! depth and consumer count from the broker.

use std::time::Duration;

use serde_json::json;

use crate::config::{Settings, redact_url};
use crate::registry::{self, Keys, Redis, now_s};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON document instead of tables.
    #[arg(long)]
    pub json: bool,
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let keys = Keys::new(&settings.redis_prefix);
    let instances = match Redis::connect(&settings.redis_url).await {
        Ok(_) => registry::instances(&mut Redis::new(&settings.redis_url), &keys).await,
        Err(_) => None,
    };
    let queues = queue_rows(settings).await;

    if args.json {
        let doc = json!({
            "instances": instances.as_ref().map(|list| list.iter().map(|i| json!(i)).collect::<Vec<_>>()),
            "queues": queues.as_ref().map(|q| q.iter().map(|(name, m, c)| json!({
                "name": name, "messages": m, "consumers": c,
            })).collect::<Vec<_>>()),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        match &instances {
            Some(list) => {
                println!(
                    "{:<28} {:<18} {:<9} {:>5} {:>10} {:>10} {:>8} {:>6} {:>8} {:>9}",
                    "INSTANCE",
                    "ROLES",
                    "STATUS",
                    "PROCS",
                    "RECEIVED",
                    "INSERTED",
                    "RETRIED",
                    "DEAD",
                    "INFLIGHT",
                    "HEARTBEAT"
                );
                for i in list {
                    let get = |k: &str| i.get(k).map(String::as_str).unwrap_or("-");
                    let age = get("last_heartbeat")
                        .parse::<u64>()
                        .map(|t| format!("{}s ago", now_s().saturating_sub(t)))
                        .unwrap_or_else(|_| "-".into());
                    println!(
                        "{:<28} {:<18} {:<9} {:>5} {:>10} {:>10} {:>8} {:>6} {:>8} {:>9}",
                        format!("{}:{}", get("host"), get("pid")),
                        get("roles"),
                        get("status"),
                        get("processors"),
                        get("received"),
                        get("inserted"),
                        get("retried"),
                        get("dead_lettered"),
                        get("inflight"),
                        age
                    );
                }
                if list.is_empty() {
                    println!(
                        "(no live instance under REDIS_PREFIX {:?})",
                        settings.redis_prefix
                    );
                }
            }
            None => println!(
                "instances: Redis unreachable at {}",
                redact_url(&settings.redis_url)
            ),
        }
        println!();
        match &queues {
            Some(rows) => {
                println!("{:<40} {:>10} {:>10}", "QUEUE", "MESSAGES", "CONSUMERS");
                for (name, m, c) in rows {
                    match (m, c) {
                        (Some(m), Some(c)) => println!("{name:<40} {m:>10} {c:>10}"),
                        _ => println!("{name:<40} {:>10} {:>10}", "missing", "-"),
                    }
                }
            }
            None => println!(
                "queues: broker unreachable at {}",
                redact_url(&settings.amqp_url)
            ),
        }
    }
    Ok(if instances.is_none() && queues.is_none() {
        1
    } else {
        0
    })
}

/// (queue, messages, consumers) for the main, retry and DLQ queues; `None` without a broker.
async fn queue_rows(settings: &Settings) -> Option<Vec<(String, Option<u32>, Option<u32>)>> {
    let mut fast = settings.clone();
    fast.amqp_connect_timeout_ms = fast.amqp_connect_timeout_ms.min(3000);
    let conn = crate::amqp::connect(&fast, "status").await.ok()?;
    let mut rows = Vec::new();
    for q in [
        &settings.main_queue,
        &settings.retry_queue,
        &settings.dlq_queue,
    ] {
        let stats =
            tokio::time::timeout(Duration::from_secs(3), crate::amqp::queue_stats(&conn, q)).await;
        match stats {
            Ok(Ok((m, c))) => rows.push((q.clone(), Some(m), Some(c))),
            _ => rows.push((q.clone(), None, None)),
        }
    }
    crate::amqp::close(None, Some(conn)).await;
    Some(rows)
}
