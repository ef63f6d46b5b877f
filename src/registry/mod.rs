//! The Redis instance registry and remote control, never on the data path.
//!
//! Each instance registers itself in Redis with a heartbeat, publishes its status and counters
//! there (what `warren status` reads), takes the signed remote commands `warren ctl` queues for
//! it, records their outcomes, and leaves a shutdown record when it stops gracefully. When Redis
//! is unreachable warren keeps working and registers again later.
//!
//! # Parts
//! - [`redis`]: the link to Redis: lazy reconnects, a bound on every call, one
//!   warning per outage, no password in any message.
//! - [`instance`]: the key scheme, this instance's hash and heartbeat (status, counters, rates),
//!   the relay of its commands, its shutdown record, and the listing of every live instance.
//! - [`commands`]: the signed remote commands and their outcomes: the typed [`Command`] and its
//!   wire form, the canonical encoding, HMAC-SHA256 signing and verification, and the [`Guard`]
//!   that refuses.

pub mod commands;
pub mod instance;
pub mod redis;

pub use self::commands::{
    Command, CtlCommand, CtlOutcome, Guard, MAX_SKEW_S, REFUSED_BAD_SIGNATURE, REFUSED_UNSIGNED,
};
pub use self::instance::{
    INSTANCE_TTL_S, Instance, InstanceFields, Keys, RATE_WINDOW, Registry, Report, SHUTDOWNS_MAX,
    instances, now_s, per_second, utc,
};
pub use self::redis::{Redis, scrub};
