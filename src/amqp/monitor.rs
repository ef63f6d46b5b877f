//! The queue poller: the depth and consumer count of the main, retry (every tier's) and DLQ
//! queues, every few seconds on a connection of its own, for `warren_queue_messages` /
//! `warren_queue_consumers` and the consumers' idle watchdog (`metrics::queue_depth`).

use std::time::Duration;

use crate::config::Settings;

/// Polls the queues of `settings` every `every`, forever (reconnecting when the link is gone).
pub async fn poll_queues(settings: Settings, every: Duration) {
    let mut queues = vec![settings.main_queue.clone()];
    queues.extend(settings.retry_tiers().into_iter().map(|t| t.queue));
    queues.push(settings.dlq_queue.clone());
    let mut conn: Option<lapin::Connection> = None;
    loop {
        if conn.as_ref().is_none_or(|c| !c.status().connected()) {
            conn = super::connect(&settings, "monitor", super::Frames::Small)
                .await
                .ok();
        }
        if let Some(c) = &conn {
            for q in &queues {
                if let Ok((messages, consumers)) = super::queue_stats(c, q).await {
                    crate::metrics::queue_polled(q, messages, consumers);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}
