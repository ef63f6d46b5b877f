#!/usr/bin/env bash
# The whole test suite: bring up RabbitMQ, PostgreSQL and Redis on localhost (scripts/setup.sh),
# then run every unit and integration test against them. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-promtool
exec cargo test --all-targets "$@"
