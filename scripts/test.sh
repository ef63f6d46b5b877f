#!/usr/bin/env bash
# The whole test suite: bring up RabbitMQ, PostgreSQL and Redis on localhost (scripts/setup.sh)
# and the 3-node RabbitMQ test cluster (scripts/cluster.sh), then run every unit and integration
# test against them. Extra arguments go to `cargo test`. A caller who sets
# WARREN_TEST_CLUSTER_URLS brings a cluster of its own, and none is started.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-promtool
if [ -z "${WARREN_TEST_CLUSTER_URLS:-}" ]; then
  ./scripts/cluster.sh up
  WARREN_TEST_CLUSTER_URLS="$(./scripts/cluster.sh urls)"
  export WARREN_TEST_CLUSTER_URLS
fi
# The vendored patches' own unit tests (vendor/*/WARREN-PATCH.md), built in warren's target dir.
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" cargo test -q --manifest-path vendor/lapin/Cargo.toml \
  --lib --no-default-features --features tokio warren_patch
# The patched AMQP parser's and generator's own tests (vendor/amq-protocol-types/WARREN-PATCH.md).
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" cargo test -q \
  --manifest-path vendor/amq-protocol-types/Cargo.toml --lib
# Three lanes run at once, so the suite takes about as long as its longest lane rather than the
# sum of all files (CI has 30 minutes; one lane took 25, two lanes 20 and CI 35 with the build).
# The main lane is one `cargo test` over the lib, the bins, the examples and most test files. The
# two lanes beside run their files one after the other, without cargo (whose lock on the build
# directory would hold one lane behind the other): BESIDE holds every file that uses the RabbitMQ
# test cluster (they stop its nodes and change their settings, so never two at once) and some
# that spend their minutes waiting; THIRD the longest of the rest. `broker_faults` closes every
# connection of the broker, so it runs alone, after the lanes. Any other argument than
# --no-fail-fast (a filter, a --test) runs everything in one `cargo test`, as before.
BESIDE="cluster consumer_timeout endpoints failover properties retry ledger_pipelines held reload db_faults"
THIRD="memory ledger balance hostile shutdown fallbacks"
ALONE="broker_faults"
if [ "$#" -gt 1 ] || { [ "$#" -eq 1 ] && [ "$1" != "--no-fail-fast" ]; }; then
  exec cargo test --all-targets "$@"
fi
beside=()
third=()
alone=()
others=(--lib --bins --examples)
for file in tests/*.rs; do
  name="$(basename "$file" .rs)"
  case " $BESIDE " in
    *" $name "*) beside+=(--test "$name"); continue ;;
  esac
  case " $THIRD " in
    *" $name "*) third+=(--test "$name"); continue ;;
  esac
  case " $ALONE " in
    *" $name "*) alone+=(--test "$name") ;;
    *) others+=(--test "$name") ;;
  esac
done
cargo test --all-targets --no-run
lane="$(mktemp -d)"
trap 'rm -rf "$lane"' EXIT
# The test harnesses (targets of kind "test", not the warren binary they use) of the test
# files named by `--test NAME` arguments, one path a line (none found is said below).
executables() {
  cargo test "$@" --no-run --message-format=json 2>/dev/null |
    grep -F '"kind":["test"]' | grep -o '"executable":"[^"]*"' |
    sed 's/"executable":"\(.*\)"/\1/' || true
}
# Runs the given executables (one path a line) one after the other, each one's output into
# $lane/NAME.log and a line into $lane/summary; exit 1 if one failed.
run_files() {
  local failed=0 exe name start
  for exe in $1; do
    name="$(basename "$exe")"
    name="${name%-*}"
    start=$SECONDS
    if "$exe" > "$lane/$name.log" 2>&1; then
      echo "test.sh: $name passed in $((SECONDS - start)) s" >> "$lane/summary"
    else
      echo "test.sh: $name FAILED in $((SECONDS - start)) s" >> "$lane/summary"
      failed=1
      [ "$fail_fast" = 1 ] && break
    fi
  done
  return "$failed"
}
fail_fast=1
[ "${1:-}" = "--no-fail-fast" ] && fail_fast=0
# The lanes' executables are listed before any lane starts: `cargo test --no-run` takes the
# build directory's lock, which the main lane's `cargo test` holds while it runs.
beside_exes="$(executables "${beside[@]}")"
third_exes="$(executables "${third[@]}")"
alone_exes="$(executables "${alone[@]}")"
# Each lane runs as many executables as it names files (an empty list would pass unseen).
for listed in "beside:${#beside[@]}:$beside_exes" "third:${#third[@]}:$third_exes" \
  "alone:${#alone[@]}:$alone_exes"; do
  name="${listed%%:*}"
  rest="${listed#*:}"
  files=$((${rest%%:*} / 2))
  found="$(printf '%s\n' "${rest#*:}" | grep -c . || true)"
  if [ "$found" != "$files" ]; then
    echo "test.sh: the $name lane names $files test files but $found executables were built" >&2
    exit 1
  fi
done
run_files "$beside_exes" &
beside_pid=$!
run_files "$third_exes" &
third_pid=$!
status=0
cargo test "${others[@]}" "$@" || status=$?
wait "$beside_pid" || status=1
wait "$third_pid" || status=1
if [ "$status" = 0 ] || [ "$fail_fast" = 0 ]; then
  run_files "$alone_exes" || status=1
fi
for log in "$lane"/*.log; do
  [ -e "$log" ] || continue
  echo "---- test.sh: $(basename "$log" .log), run beside the others or alone"
  cat "$log"
done
cat "$lane/summary" 2>/dev/null || true
if [ "$status" != 0 ]; then
  echo "test.sh: failed" >&2
  exit 1
fi
