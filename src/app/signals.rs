//! The operator signals of `warren run` (`SIGUSR1` pauses every pipeline, `SIGCONT` lifts that
//! pause, `SIGHUP` reloads): caught from the first moment of the process ([`catch`], before the
//! settings load), so none sent while warren starts ends it or is lost, and handed to the
//! control loop in the order they arrived ([`OperatorSignals::next`]).
//!
//! Each kind is kept once: several `SIGUSR1` before the loop takes one are one pause. Kinds are
//! ordered by their last arrival as the handlers saw it. Two sent back to back may both be
//! pending in the kernel, which runs their handlers in an order of its own: their order is
//! kept only when the first was caught before the second was sent (docs/operations.md).

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::registry::Command;

/// The signals, their names and the commands they stand for, in the order of [`LAST`].
const SIGNALS: [(libc::c_int, &str, Command); 3] = [
    (libc::SIGUSR1, "SIGUSR1", Command::Pause),
    (libc::SIGCONT, "SIGCONT", Command::Resume),
    (libc::SIGHUP, "SIGHUP", Command::Reload),
];

/// Counts every operator signal caught, to order them.
static ARRIVALS: AtomicU64 = AtomicU64::new(0);
/// For each of [`SIGNALS`], the number ([`ARRIVALS`]) of its last arrival; 0 for none yet.
static LAST: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static CAUGHT: Once = Once::new();

/// Catches the operator signals from now on (idempotent): from here on `SIGHUP` and `SIGUSR1` no
/// longer end the process, and each one is kept until [`OperatorSignals::next`] hands it over.
/// `warren run` calls it first thing, before its settings load.
pub fn catch() -> std::io::Result<()> {
    let mut result = Ok(());
    CAUGHT.call_once(|| {
        for (i, (number, _, _)) in SIGNALS.iter().enumerate() {
            let action = move || {
                // Async-signal-safe: two atomic operations, no allocation, no lock.
                let n = ARRIVALS.fetch_add(1, Ordering::SeqCst) + 1;
                LAST[i].store(n, Ordering::SeqCst);
            };
            // SAFETY: the action only touches atomics (async-signal-safe), and these three
            // signals are not ones `signal_hook_registry` forbids (SIGKILL, SIGSTOP, SIGILL,
            // SIGFPE, SIGSEGV).
            if let Err(e) = unsafe { signal_hook_registry::register(*number, action) } {
                result = Err(e);
                return;
            }
        }
    });
    result
}

/// The operator signals as the control loop takes them: [`catch`]'s record of what arrived,
/// and tokio's streams of the same signals to wake the loop.
pub(super) struct OperatorSignals {
    /// What woke the loop; what arrived is read from [`LAST`].
    wake: [Signal; 3],
    /// For each of [`SIGNALS`], the last arrival already handed over.
    taken: [u64; 3],
}

impl OperatorSignals {
    /// Catches the signals ([`catch`], if not done yet) and starts handing them over: what
    /// arrived since [`catch`] first, oldest first.
    pub(super) fn listen() -> std::io::Result<Self> {
        catch()?;
        Ok(Self {
            wake: [
                signal(SignalKind::user_defined1())?,
                signal(SignalKind::from_raw(libc::SIGCONT))?,
                signal(SignalKind::hangup())?,
            ],
            taken: [0; 3],
        })
    }

    /// The signal that arrived first of those not handed over yet, if any.
    fn pending(&mut self) -> Option<(Command, &'static str)> {
        let i = (0..SIGNALS.len())
            .filter(|&i| LAST[i].load(Ordering::SeqCst) > self.taken[i])
            .min_by_key(|&i| LAST[i].load(Ordering::SeqCst))?;
        self.taken[i] = LAST[i].load(Ordering::SeqCst);
        Some((SIGNALS[i].2, SIGNALS[i].1))
    }

    /// The next operator signal, as the command it stands for, with the signal's name.
    /// Cancel-safe: a signal not handed over stays for the next call.
    pub(super) async fn next(&mut self) -> (Command, &'static str) {
        loop {
            if let Some(next) = self.pending() {
                return next;
            }
            // A signal arriving after `pending` looked wakes one of these.
            let [a, b, c] = &mut self.wake;
            tokio::select! {
                _ = a.recv() => {}
                _ = b.recv() => {}
                _ = c.recv() => {}
            }
        }
    }
}
