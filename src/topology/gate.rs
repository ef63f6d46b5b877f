//! The topology gate: a start whose check of the broker's exchanges and queues could not run
//! (the broker could not be reached, or, for an instance of the API alone, they were not
//! declared yet) holds every consumer of the process, and the HTTP API's publishes (503), until
//! the check passed (review R37x F4, R38-F8). Started without it, a retry queue that
//! dead-letters elsewhere (declared by hand, or by an older configuration) strands every
//! retried message once the broker is back, and a main queue with a length limit drops what the
//! API confirmed; the check exits 1 on it instead. Open unless [`hold`] was called: tests and
//! tools that build pipelines in-process consume at once. While held, `/readyz` names it.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::sync::watch;

fn gate() -> &'static watch::Sender<bool> {
    static GATE: OnceLock<watch::Sender<bool>> = OnceLock::new();
    GATE.get_or_init(|| watch::channel(true).0)
}

/// What `/readyz` says while the gate is held.
pub const HELD: &str =
    "the consumers and the API wait for the check of the broker's exchanges and queues";

/// Consumers of this process do not consume, and the API does not publish, until [`open`].
pub fn hold() {
    gate().send_replace(false);
    crate::metrics::starting(Some(HELD));
}

/// Consumers may consume and the API publish (the check passed).
pub fn open() {
    if !gate().send_replace(true) {
        crate::metrics::starting(None);
    }
}

/// Whether consumers may consume.
pub fn is_open() -> bool {
    *gate().borrow()
}

/// Waits up to `bound` for the gate to be open; `false` when it is still closed.
pub async fn wait_open(bound: Duration) -> bool {
    let mut open = gate().subscribe();
    matches!(
        tokio::time::timeout(bound, open.wait_for(|o| *o)).await,
        Ok(Ok(_))
    )
}
