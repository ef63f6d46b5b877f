//! Configured pipelines in tests: `PipelineNames`, a pipeline's own broker names under the
//! test's id (with their `[[pipelines]]` lines), and `PipelineCleanup`, which deletes its
//! queues and exchanges also after a failed assertion; `tail` for logs in reports.

use super::env::{TestEnv, amqp_url};

/// A configured pipeline's broker names, the test's own: `<id>_<pipeline>_exchange`, ...,
/// one retry tier of 1 s.
#[derive(Clone)]
pub struct PipelineNames {
    pub exchange: String,
    pub queue: String,
    pub retry_exchange: String,
    pub retry: String,
    pub dlx: String,
    pub dlq: String,
}

impl PipelineNames {
    pub fn of(env: &TestEnv, pipeline: &str) -> Self {
        let n = |what: &str| format!("{}_{pipeline}_{what}", env.id);
        PipelineNames {
            exchange: n("exchange"),
            queue: n("queue"),
            retry_exchange: n("retry_exchange"),
            retry: n("retry_1s"),
            dlx: n("dlx"),
            dlq: n("dlq"),
        }
    }

    /// The env's own topology names (`MAIN_EXCHANGE`, ...), for a pipeline declared on the
    /// queues the env already has (users as a configured pipeline); the env deletes them.
    pub fn of_env(env: &TestEnv) -> Self {
        PipelineNames {
            exchange: env.main_exchange.clone(),
            queue: env.main_queue.clone(),
            retry_exchange: env.retry_exchange.clone(),
            retry: env.retry_queue.clone(),
            dlx: env.dlx_exchange.clone(),
            dlq: env.dlq_queue.clone(),
        }
    }

    /// The names as the lines of a `[[pipelines]]` entry.
    pub fn toml(&self) -> String {
        format!(
            "main_exchange = \"{}\"\nmain_queue = \"{}\"\nretry_exchange = \"{}\"\n\
             retry_queue = \"{}\"\ndlx_exchange = \"{}\"\ndlq_queue = \"{}\"\n",
            self.exchange, self.queue, self.retry_exchange, self.retry, self.dlx, self.dlq
        )
    }

    /// Deletes these queues and exchanges when dropped.
    pub fn cleanup(&self) -> PipelineCleanup {
        PipelineCleanup(
            vec![self.queue.clone(), self.retry.clone(), self.dlq.clone()],
            vec![
                self.exchange.clone(),
                self.retry_exchange.clone(),
                self.dlx.clone(),
            ],
        )
    }
}

/// Deletes queues and exchanges (queues first), also after a failed assertion.
pub struct PipelineCleanup(Vec<String>, Vec<String>);

impl Drop for PipelineCleanup {
    fn drop(&mut self) {
        super::cluster::delete_on(
            &amqp_url(),
            std::mem::take(&mut self.0),
            std::mem::take(&mut self.1),
        );
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
