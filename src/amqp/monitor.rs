//! The queue poller: the depth and consumer count of every served pipeline's main, retry (every
//! tier's) and DLQ queues, every few seconds on a connection of its own, for
//! `warren_queue_messages` / `warren_queue_consumers` and for the stages that act on a backlog
//! ([`Depths`]: the consumers' idle watchdog).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::AmqpConfig;

/// How long a polled depth stands for the queue's.
const FRESH: Duration = Duration::from_secs(15);

/// The depths the last polls found, with when: the poller writes them, the pipelines read them.
#[derive(Debug, Clone, Default)]
pub struct Depths(Arc<Mutex<HashMap<String, (u32, Instant)>>>);

impl Depths {
    /// The messages ready in `queue` as polled within the last 15 s, if any.
    pub fn get(&self, queue: &str) -> Option<u32> {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (depth, at) = guard.get(queue)?;
        (at.elapsed() < FRESH).then_some(*depth)
    }

    fn record(&self, queue: &str, depth: u32) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(queue.to_string(), (depth, Instant::now()));
    }
}

/// Polls `queues` every `every`, forever (reconnecting when the link is gone, through `amqp`),
/// into the metrics and `depths`.
pub async fn poll_queues(amqp: AmqpConfig, queues: Vec<String>, every: Duration, depths: Depths) {
    let mut conn: Option<lapin::Connection> = None;
    loop {
        if conn.as_ref().is_none_or(|c| !c.status().connected()) {
            conn = super::connect(&amqp, "monitor", super::Frames::Small)
                .await
                .ok();
        }
        if let Some(c) = &conn {
            for q in &queues {
                if let Ok((messages, consumers)) = super::queue_stats(c, q).await {
                    crate::metrics::queue_polled(q, messages, consumers);
                    depths.record(q, messages);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_depth_is_known_while_fresh_and_per_queue() {
        let depths = Depths::default();
        assert_eq!(depths.get("q"), None);
        depths.record("q", 7);
        assert_eq!(depths.get("q"), Some(7));
        assert_eq!(depths.clone().get("q"), Some(7), "clones share the depths");
        assert_eq!(depths.get("other"), None);
        depths
            .0
            .lock()
            .unwrap()
            .insert("old".into(), (3, Instant::now() - FRESH));
        assert_eq!(depths.get("old"), None, "a stale poll stands for nothing");
    }
}
