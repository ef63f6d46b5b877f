#!/usr/bin/env bash
# Fuzz warren's parsers of untrusted input: every cargo-fuzz target in fuzz/ (the users body
# decoder, the AMQP header readers and writers) runs SECONDS (default 60) from the committed seeds
# (fuzz/seeds/<target>, read only) plus what earlier runs kept (fuzz/corpus/<target>, not
# committed). A crash stops the script with a non-zero exit; its input is in
# fuzz/artifacts/<target>/ (replay it with `cargo fuzz run <target> <file>`).
#
# CI does not fuzz: tests/fuzz_seeds.rs replays the checks (fuzz/checks/) over the seeds in
# every test run. Fuzz by hand after touching a parser or the republish policy.
#
#   scripts/fuzz.sh [SECONDS]                   quick build: unoptimized, no sanitizer
#   FUZZ_BUILD=release scripts/fuzz.sh 3600     optimized, AddressSanitizer and overflow checks:
#                                               ~4x the build time, 5-10x the runs per second
#
# Stable Rust is enough: cargo-fuzz passes -Z flags, which RUSTC_BOOTSTRAP=1 lets rustc accept.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
case "$seconds" in
  '' | *[!0-9]* | 0)
    echo "usage: scripts/fuzz.sh [SECONDS]: SECONDS must be a whole number of at least 1, got '$seconds'" >&2
    exit 2 ;;
esac
case "${FUZZ_BUILD:-dev}" in
  dev) build=(--dev --sanitizer none) ;;
  release) build=(--sanitizer address) ;; # cargo-fuzz's default: optimized, with debug assertions
  *) echo "scripts/fuzz.sh: FUZZ_BUILD must be dev or release, got '${FUZZ_BUILD}'" >&2; exit 2 ;;
esac

export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

cargo fuzz build "${build[@]}"
for target in $(cargo fuzz list); do
  mkdir -p "fuzz/corpus/$target"
  echo "fuzz.sh: $target for ${seconds}s" >&2
  # libFuzzer reports every new input and a recommended dictionary; keep the summary and
  # anything that went wrong.
  set +e
  cargo fuzz run "${build[@]}" "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=10 2>&1 |
    grep -Ev '^(#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD)|"|###### )'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "fuzz.sh: $target failed (exit $status); the input is in fuzz/artifacts/$target/" >&2
    exit "$status"
  fi
done
echo "fuzz.sh: no crash" >&2
