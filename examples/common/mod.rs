//! What the bench examples share: the broker and database URLs from the environment, the
//! consumer the drains subscribe, and the process's own CPU time and peak RSS, read from
//! /proc/self the way `scripts/bench.sh` reads warren's (utime + stime of /proc/PID/stat, VmHWM
//! of /proc/PID/status). `users.rs`: what the two pipelines (minimal and tuned) share.

use std::time::Duration;

use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer};

#[allow(dead_code)] // only the two pipelines use it
pub mod users;

/// The broker, from `AMQP_URL` as warren reads it.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The database, from `DATABASE_URL` as warren reads it.
#[allow(dead_code)] // the raw drain has no database
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://warren:warren@127.0.0.1:5432/warren".into())
}

/// A drain's link to the broker: one connection, one channel with `prefetch` unacked deliveries
/// at most (basic.qos), and a consumer named `tag` on `queue`.
#[allow(dead_code)] // the publishers consume nothing
pub async fn subscribe(
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> Result<(Connection, Channel, Consumer), lapin::Error> {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, channel, consumer))
}

/// This process's resource use so far.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// User plus system CPU time (utime + stime), at the clock-tick resolution of /proc.
    pub cpu: Duration,
    /// Peak resident set size (VmHWM), in KiB.
    pub peak_rss_kb: u64,
}

/// Reads /proc/self/stat and /proc/self/status. Clock ticks per second come from `CLK_TCK`
/// (`scripts/bench.sh` passes `getconf CLK_TCK`), else 100, Linux's USER_HZ.
pub fn usage() -> std::io::Result<Usage> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The command name (field 2) may hold spaces: count the fields after its closing paren,
    // where field 3 (state) comes first, so utime (14) and stime (15) are the 12th and 13th.
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| -> u64 { fields.get(i).and_then(|f| f.parse().ok()).unwrap_or(0) };
    let hz: u64 = std::env::var("CLK_TCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&hz| hz > 0)
        .unwrap_or(100);
    let cpu_ticks = ticks(11) + ticks(12);
    let status = std::fs::read_to_string("/proc/self/status")?;
    let peak_rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok(Usage {
        cpu: Duration::from_micros(cpu_ticks * 1_000_000 / hz),
        peak_rss_kb,
    })
}
