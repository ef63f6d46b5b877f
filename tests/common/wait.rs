//! Waiting on a condition instead of sleeping: `wait_until`, and `wait_queues_settled` (nothing
//! ready or unacknowledged in some queues).

use std::time::{Duration, Instant};

use super::broker::rabbitmqctl_rows;

/// Waits until `condition` holds, polling; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until each of `queues` (which must exist) holds no message, neither ready nor
/// unacknowledged, as `rabbitmqctl list_queues` counts them: nothing is in flight through them
/// (a message waiting out a retry tier's TTL counts as ready). Awaited after a sentinel, it
/// proves that what came before was settled, instead of a sleep "long enough". Panics after
/// `timeout` with the last counts.
pub async fn wait_queues_settled(queues: &[&str], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let rows = rabbitmqctl_rows(&[
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .await;
        let counts: Vec<(&str, u64, u64)> = queues
            .iter()
            .map(|q| {
                let row = rows
                    .iter()
                    .find(|row| row["name"].as_str() == Some(*q))
                    .unwrap_or_else(|| panic!("queue {q} is not listed by rabbitmqctl"));
                let n = |field: &str| {
                    row[field]
                        .as_u64()
                        .unwrap_or_else(|| panic!("queue {q}: no {field} in {row}"))
                };
                (*q, n("messages_ready"), n("messages_unacknowledged"))
            })
            .collect();
        if counts
            .iter()
            .all(|(_, ready, unacked)| *ready == 0 && *unacked == 0)
        {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for settled queues: (queue, ready, unacked) {counts:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
