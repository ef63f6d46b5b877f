//! The fuzz targets' checks (`fuzz/checks/`, what `scripts/fuzz.sh` runs under libFuzzer) over
//! their committed seeds (`fuzz/seeds/<target>/`): every input that once mattered stays a test in
//! every run, and the checks compile with the code they check (a change of a signature they call
//! once broke the fuzz build and nothing else). Finding new inputs is fuzzing's job, by hand
//! (docs/development.md, "Fuzzing").
//!
//! The seeds of `users_decode` and `amqp_frames` carry their expected outcome in their name,
//! `<outcome>-<what it is>`, checked here, so a decoder that refused every body, or a frame
//! check whose seeds never reach a refusal, fails: `users_decode` seeds are `ok-*`,
//! `invalid_json-*` or `invalid_payload-*`; `amqp_frames` seeds name what became of the copy of
//! each content header they hold, in order, joined by `+` (`fits`, `cut`: fits once warren's
//! reasons are cut, `refused`), or `none` when no content header parses.

// `check` is the fuzz targets' entry; the seeds of these two run it through `outcomes`/`outcome`.
#[allow(dead_code)]
#[path = "../fuzz/checks/amqp_frames.rs"]
mod amqp_frames;
#[path = "../fuzz/checks/headers.rs"]
mod headers;
#[allow(dead_code)]
#[path = "../fuzz/checks/users_decode.rs"]
mod users_decode;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The seeds of `target`, sorted.
fn seeds(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a seed").path())
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    seeds
}

/// Runs `check` over every seed of `target`, naming the seed that breaks it.
fn replay(target: &str, check: fn(&[u8])) {
    for seed in seeds(target) {
        let data = std::fs::read(&seed).expect("read the seed");
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(
            outcome.is_ok(),
            "{target}: the seed {} breaks the check",
            seed.display()
        );
    }
}

/// Runs `outcome` (the check, and what it found) over every seed of `target`: each must find
/// what its name says (`<outcome>-<what it is>`), and every one of `outcomes` must be some
/// seed's.
fn replay_expecting(target: &str, outcome: fn(&[u8]) -> String, outcomes: &[&str]) {
    let mut seen = BTreeSet::new();
    let mut wrong = Vec::new();
    for seed in seeds(target) {
        let name = seed
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a seed's name is UTF-8");
        let Some((expected, _)) = name.split_once('-') else {
            wrong.push(format!("{name}: no `<outcome>-` in its name"));
            continue;
        };
        let data = std::fs::read(&seed).expect("read the seed");
        let found = std::panic::catch_unwind(|| outcome(&data))
            .unwrap_or_else(|_| panic!("{target}: the seed {} breaks the check", seed.display()));
        if found != expected {
            wrong.push(format!("{name}: {found}, its name says {expected}"));
        }
        seen.extend(found.split('+').map(str::to_string));
    }
    for o in outcomes {
        if !seen.contains(*o) {
            wrong.push(format!("no seed ends as {o}"));
        }
    }
    assert!(wrong.is_empty(), "{target}:\n{}", wrong.join("\n"));
}

#[test]
fn amqp_frames_seeds() {
    replay_expecting(
        "amqp_frames",
        |data| {
            let found = amqp_frames::outcomes(data);
            if found.is_empty() {
                "none".into()
            } else {
                found.join("+")
            }
        },
        &["fits", "cut", "refused", "none"],
    );
}

#[test]
fn headers_seeds() {
    replay("headers", headers::check);
}

#[test]
fn users_decode_seeds() {
    replay_expecting(
        "users_decode",
        |body| users_decode::outcome(body).into(),
        &["ok", "invalid_json", "invalid_payload"],
    );
}
