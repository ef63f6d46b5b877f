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
exec cargo test --all-targets "$@"
