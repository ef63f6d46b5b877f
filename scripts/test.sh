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
# Two lanes run at once, so the suite takes about as long as its longer lane rather than the sum
# of all files (CI has 30 minutes; one lane took 25). The lane beside runs its files one after the
# other, without cargo (whose lock on the build directory would hold one lane behind the other):
# every file that uses the RabbitMQ test cluster (they stop its nodes and change their settings,
# so never two at once), and the longest that spend their minutes waiting (reload and db_faults
# moved here when CI took 29 of its 30 minutes: the main lane was about twice the other). `broker_faults` closes
# every connection of the broker, so it runs alone, after both lanes. Any other argument than
# --no-fail-fast (a filter, a --test) runs everything in one `cargo test`, as before.
BESIDE="cluster consumer_timeout endpoints failover properties retry memory ledger_pipelines held reload db_faults"
ALONE="broker_faults"
if [ "$#" -gt 1 ] || { [ "$#" -eq 1 ] && [ "$1" != "--no-fail-fast" ]; }; then
  exec cargo test --all-targets "$@"
fi
beside=()
alone=()
others=(--lib --bins --examples)
for file in tests/*.rs; do
  name="$(basename "$file" .rs)"
  case " $BESIDE " in
    *" $name "*) beside+=(--test "$name"); continue ;;
  esac
  case " $ALONE " in
    *" $name "*) alone+=(--test "$name") ;;
    *) others+=(--test "$name") ;;
  esac
done
cargo test --all-targets --no-run
lane="$(mktemp -d)"
trap 'rm -rf "$lane"' EXIT
# Runs the executables of the test files named by `--test NAME` arguments one after the other,
# each one's output into $lane/NAME.log and a line into $lane/summary; exit 1 if one failed.
run_files() {
  local executables failed=0 exe name start
  # The test harnesses only (targets of kind "test"), not the warren binary they use.
  executables="$(cargo test "$@" --no-run --message-format=json 2>/dev/null |
    grep -F '"kind":["test"]' | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/')"
  for exe in $executables; do
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
run_files "${beside[@]}" &
beside_pid=$!
status=0
cargo test "${others[@]}" "$@" || status=$?
wait "$beside_pid" || status=1
if [ "$status" = 0 ] || [ "$fail_fast" = 0 ]; then
  run_files "${alone[@]}" || status=1
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
