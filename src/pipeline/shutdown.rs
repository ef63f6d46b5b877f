//! The graceful stop's own settings ([`ShutdownConfig`]: how long every pipeline's shutdown
//! sequence, [`super::Pipeline::shutdown`], may take together) and their check. Built from
//! warren's settings above this layer (`config::components`); nothing here reads those.

use std::time::Duration;

/// The longest a graceful stop may take, and what `systemd`'s `TimeoutStopSec=` of the shipped
/// unit covers (tests/deploy.rs holds them together).
pub const MAX_SHUTDOWN_MS: u64 = 3_600_000;

/// How the process stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownConfig {
    /// The bound on the graceful stop (`SHUTDOWN_TIMEOUT_MS`): every pipeline's drain together;
    /// what is still in flight after it goes back to the broker (exit 1). 0 does not wait.
    pub timeout_ms: u64,
}

/// A [`ShutdownConfig`] that cannot work, named by its setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShutdownConfigError {
    /// A bound past what a service manager waits for.
    #[error("SHUTDOWN_TIMEOUT_MS: expected 0 to {MAX_SHUTDOWN_MS} ms, got {0}")]
    Timeout(u64),
}

impl ShutdownConfig {
    /// A bound of at most [`MAX_SHUTDOWN_MS`].
    pub fn validate(&self) -> Result<(), ShutdownConfigError> {
        if self.timeout_ms > MAX_SHUTDOWN_MS {
            return Err(ShutdownConfigError::Timeout(self.timeout_ms));
        }
        Ok(())
    }

    /// The bound on the graceful stop.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_at_most_an_hour_and_named() {
        let at = |timeout_ms| ShutdownConfig { timeout_ms }.validate();
        assert_eq!(at(0), Ok(()));
        assert_eq!(at(MAX_SHUTDOWN_MS), Ok(()));
        let over = at(MAX_SHUTDOWN_MS + 1).unwrap_err();
        assert_eq!(
            over.to_string(),
            "SHUTDOWN_TIMEOUT_MS: expected 0 to 3600000 ms, got 3600001"
        );
        assert_eq!(
            ShutdownConfig { timeout_ms: 1_500 }.timeout(),
            Duration::from_millis(1_500)
        );
    }
}
