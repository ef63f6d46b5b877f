//! The ledgers' fault schedule: every fault kind once, and more drawn at random, spread over
//! the window the publishing spans (shared by `ledger.rs` and `ledger_pipelines.rs`).

use std::fmt::Debug;
use std::time::Duration;

/// The fault schedule over `window`: every one of `kinds` once, and more drawn at random up to
/// one per 2.5 s of the window, shuffled; the window cut into one slot per fault, each fault at
/// a moment drawn in the first half of its slot (so they spread over the whole window, which
/// the publishing spans too, and a fault has half a slot to end before the next).
pub fn fault_schedule<F: Copy + Debug>(
    rng: &mut fastrand::Rng,
    window: Duration,
    kinds: &[F],
) -> Vec<(Duration, F)> {
    let n = ((window.as_millis() / 2500) as usize).max(kinds.len());
    let mut drawn = kinds.to_vec();
    while drawn.len() < n {
        drawn.push(kinds[rng.usize(0..kinds.len())]);
    }
    rng.shuffle(&mut drawn);
    let slot = window / n as u32;
    let half = slot.as_millis() as u64 / 2;
    let faults: Vec<(Duration, F)> = drawn
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            (
                slot * i as u32 + Duration::from_millis(rng.u64(0..=half)),
                f,
            )
        })
        .collect();
    for kind in kinds {
        assert!(
            faults
                .iter()
                .any(|(_, f)| std::mem::discriminant(f) == std::mem::discriminant(kind)),
            "the schedule lacks {kind:?}: {faults:?}"
        );
    }
    faults
}

/// `fault_schedule` over many seeds and windows: every kind in each (it asserts it), the
/// faults in order, each within the window, one per slot. For each ledger's own kinds.
pub fn check_fault_schedules<F: Copy + Debug>(kinds: &[F]) {
    for seed in 0..2000 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let window = Duration::from_secs(rng.u64(5..=120));
        let faults = fault_schedule(&mut rng, window, kinds);
        assert!(faults.len() >= kinds.len(), "seed {seed}: {faults:?}");
        assert!(
            faults.windows(2).all(|w| w[0].0 < w[1].0) && faults.iter().all(|(at, _)| *at < window),
            "seed {seed}, window {window:?}: {faults:?}"
        );
    }
}
