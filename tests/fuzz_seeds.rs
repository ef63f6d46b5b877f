//! The fuzz targets' checks (`fuzz/checks/`, what `scripts/fuzz.sh` runs under libFuzzer) over
//! their committed seeds (`fuzz/seeds/<target>/`): every input that once mattered stays a test in
//! every run, and the checks compile with the code they check (a change of a signature they call
//! once broke the fuzz build and nothing else). Finding new inputs is fuzzing's job, by hand
//! (docs/development.md, "Fuzzing").

#[path = "../fuzz/checks/amqp_frames.rs"]
mod amqp_frames;
#[path = "../fuzz/checks/headers.rs"]
mod headers;
#[path = "../fuzz/checks/users_decode.rs"]
mod users_decode;

use std::path::Path;

/// Runs `check` over every seed of `target`, naming the seed that breaks it.
fn replay(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a seed").path())
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    for seed in seeds {
        let data = std::fs::read(&seed).expect("read the seed");
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(
            outcome.is_ok(),
            "{target}: the seed {} breaks the check",
            seed.display()
        );
    }
}

#[test]
fn amqp_frames_seeds() {
    replay("amqp_frames", amqp_frames::check);
}

#[test]
fn headers_seeds() {
    replay("headers", headers::check);
}

#[test]
fn users_decode_seeds() {
    replay("users_decode", users_decode::check);
}
