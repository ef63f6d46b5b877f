//! warren moves messages from RabbitMQ into PostgreSQL through a supervised pipeline of actix
//! actors shaped like Elixir's Broadway: consume, decode and validate, batch, insert with one
//! statement, ack after commit; retry what can be retried, dead-letter the rest, lose nothing.
//!
//! # Layout
//! - [`app`]: the composition root of `warren run`: roles, start order, process shutdown; its
//!   `control` applies remote commands and the operator signals (`SIGUSR1`, `SIGCONT`,
//!   `SIGHUP`), its `pipelines` runs and reloads the pipelines, and its `components` is the one
//!   place the settings become the components' own configurations (`AmqpConfig`, `DbConfig`,
//!   `RegistryConfig`, `EventsConfig`, `HttpConfig`, `ListenerConfig`, `ShutdownConfig`): no
//!   module below `app` and `cli` reads the settings themselves (`tests/layers.rs`).
//! - [`config`]: typed settings, their layering and validation, and each pipeline resolved
//!   once into its complete spec (`config::pipelines::PipelineSpec`).
//! - [`topology`]: the declared RabbitMQ topology and its idempotent declare.
//! - [`amqp`]: its own settings (`config`: `AmqpConfig`), connections to one of several nodes
//!   with heartbeats and backoff, the confirmed
//!   publisher (pipeline, API, CLI; it reports its link to its owner and emits no event), the
//!   `x-*` headers, the queue poller (`monitor`), and `transfer`, the one get -> publish with
//!   confirm -> ack loop (`move`, `dlq replay`).
//! - [`pipeline`]: the stages, wired in flow order in `pipeline/mod.rs` with the one shutdown
//!   sequence: message, consumer (broker link, a folder), acks, processor, batcher (flush rules), sink
//!   (insert, retry in place, row isolation), breaker, router (outcome policy), copies (so a
//!   copy whose ack was lost is not routed twice), acked (the acks a reload's successor asks the
//!   old table about), dlq; a pipeline is started with its spec
//!   and its `Links` (the broker link's and the database's settings), and `shutdown` holds the
//!   graceful stop's bound.
//! - [`domain`]: the seam the pipeline stores through, and the users domain behind it.
//! - [`db`]: its own settings (`DbConfig`, built by `config`; it imports nothing of warren's
//!   settings, broker link or events), pools (pipeline and API), client-side statement bounds,
//!   embedded migrations, SQLSTATE classification, and `dead_letters` (all SQL of the parking
//!   table).
//! - [`http`]: its own settings (`config`: `HttpConfig`, `ListenerConfig`), the actix-web API
//!   (`HTTP_ADDR`), and `ops`, the metrics listener on every role (`METRICS_ADDR`: `/metrics`,
//!   `/healthz`, `/readyz`).
//! - [`metrics`]: every metric name and label; it imports nothing of the stages or the broker
//!   link (they call it).
//! - [`registry`]: the Redis instance registry and remote control: `config` (its own settings,
//!   `RedisConfig` and `RegistryConfig`), `redis` (the link: reconnects,
//!   call bound, no password in messages), `record` (the instance record, one serde struct, and
//!   the pipelines it runs), `instance` (key scheme, heartbeat, rates, shutdown record, the
//!   listing), `commands` (the wire form and `Command::read`), `signing`, `guard`, `outcome`,
//!   `control` (typed errors: `Rejected`, `Refusal`; `CommandError` is `commands`'); the app owns
//!   `ControlError`.
//! - [`events`]: lifecycle events appended to a Redis stream (`warren events` reads them),
//!   dropped and counted rather than ever waited for; its settings are `EventsConfig`.
//! - [`cli`]: one file per subcommand of the `warren` binary; a subcommand with two tools is a
//!   folder (`dlq/`: the queue and the parking table).
//! - [`text`]: the caps on outside text wherever it reaches an event, a log line or a stored
//!   error; below every other module.
//! - [`redact`]: secrets out of URL settings wherever one is shown (the broker link, the
//!   configuration, the CLI); below every other module.
//! - [`error_kind`]: [`error_kind::ErrorKind`], the one list of why a message is dead-lettered
//!   or parked (stages, metrics, parking, API and CLI); below every other module.

pub mod amqp;
pub mod app;
pub mod cli;
pub mod config;
pub mod db;
pub mod domain;
pub mod error_kind;
pub mod events;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod redact;
pub mod registry;
pub mod text;
pub mod topology;

/// This machine's host name (for connection names, consumer tags and the registry): the
/// kernel's, as gethostname(2) gives it; else `$HOSTNAME`; else `localhost`.
pub fn hostname() -> String {
    Some(
        gethostname::gethostname()
            .to_string_lossy()
            .trim()
            .to_string(),
    )
    .filter(|s| !s.is_empty())
    .or_else(|| std::env::var("HOSTNAME").ok())
    .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    /// The same name the kernel publishes in /proc (what `hostname()` read before).
    #[cfg(target_os = "linux")]
    #[test]
    fn hostname_is_the_kernels() {
        let proc = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("/proc hostname");
        assert_eq!(super::hostname(), proc.trim());
    }
}
