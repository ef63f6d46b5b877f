//! The Redis instance registry and remote control, never on the data path.
//!
//! Each instance registers itself in Redis with a heartbeat, publishes its status and counters
//! there (what `warren status` reads), takes the signed remote commands `warren ctl` queues for
//! it, records their outcomes, and leaves a shutdown record when it stops gracefully. When Redis
//! is unreachable warren keeps working and registers again later.
//!
//! # Parts
//! - [`config`]: its own settings ([`RedisConfig`], shared with the events writer, and
//!   [`RegistryConfig`]), built from warren's settings above it, which it never reads.
//! - [`redis`]: the link to Redis: lazy reconnects, a bound on every call, one
//!   warning per outage, no password in any message.
//! - [`record`]: the instance record (one serde struct, written and read whole), what a reader
//!   makes of one it cannot read, and the pipelines an instance runs, which every tool learns.
//! - [`instance`]: the key scheme, this instance's heartbeat (its record: status, counters,
//!   rates), the relay of its commands, its shutdown record, and the listing of every entry.
//! - [`commands`]: the signed remote commands: [`CtlCommand`], as queued (its JSON and signed
//!   bytes), and [`Command`], what it asks, read from it once (a malformed one a
//!   [`CommandError`]).
//! - [`signing`]: the canonical encoding and the HMAC-SHA256 over it.
//! - [`guard`]: the [`Guard`] that refuses unsigned, forged, stale, replayed, misaddressed
//!   commands ([`Refusal`]).
//! - [`outcome`]: the signed outcomes recorded in the history.
//! - [`control`]: [`Rejected`] and [`Refusal`], why a command is not applied before it reaches
//!   the pipelines.

pub mod commands;
pub mod config;
pub mod control;
pub mod guard;
pub mod instance;
pub mod outcome;
pub mod record;
pub mod redis;
pub mod signing;

pub use self::commands::{Command, CommandError, CtlCommand};
pub use self::config::INSTANCE_TTL_S;
pub use self::config::{RedisConfig, RegistryConfig, RegistryConfigError};
pub use self::control::Rejected;
pub use self::control::{MAX_SKEW_S, REFUSED_BAD_SIGNATURE, REFUSED_UNSIGNED, Refusal};
pub use self::guard::Guard;
pub use self::instance::{
    Instance, Keys, RATE_WINDOW, Registry, Report, SHUTDOWNS_MAX, instances, live, now_s,
    per_second, utc,
};
pub use self::outcome::{CtlOutcome, Recorder};
pub use self::record::{
    Breaker, InstanceRecord, Listed, PipelineRecord, RECORD_FORMAT, StageCounts, Status,
    UnknownPipeline, Unreadable,
};
pub use self::redis::{ConnectError, Redis, scrub};
