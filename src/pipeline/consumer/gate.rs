//! The consume gate: a start whose check of the broker's exchanges and queues could not run (the
//! broker could not be reached) holds every consumer of the process until the check passed
//! (review R37x F4). Started without it, a retry queue that dead-letters elsewhere (declared
//! by hand, or by an older configuration) strands every retried message once the broker is
//! back; the check exits 1 on it instead. Open unless [`hold`] was called: tests and tools that
//! build pipelines in-process consume at once.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::sync::watch;

fn gate() -> &'static watch::Sender<bool> {
    static GATE: OnceLock<watch::Sender<bool>> = OnceLock::new();
    GATE.get_or_init(|| watch::channel(true).0)
}

/// Consumers of this process do not consume until [`open`].
pub fn hold() {
    gate().send_replace(false);
}

/// Consumers may consume (the start's check passed).
pub fn open() {
    gate().send_replace(true);
}

/// Whether consumers may consume.
pub fn is_open() -> bool {
    *gate().borrow()
}

/// Waits up to `bound` for the gate to be open; `false` when it is still closed.
pub(super) async fn wait_open(bound: Duration) -> bool {
    let mut open = gate().subscribe();
    matches!(
        tokio::time::timeout(bound, open.wait_for(|o| *o)).await,
        Ok(Ok(_))
    )
}
