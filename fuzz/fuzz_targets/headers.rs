//! cargo-fuzz target `headers`: libFuzzer's inputs through the check in `fuzz/checks/headers.rs`
//! (what it checks is written there). tests/fuzz_seeds.rs runs the same check over the committed
//! seeds in every test run.
#![no_main]

#[path = "../checks/headers.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
