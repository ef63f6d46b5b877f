#!/usr/bin/env bash
# Quick start: bring up RabbitMQ, PostgreSQL and Redis on localhost (scripts/setup.sh), then run
# warren with every role, declaring the topology and migrating the database first.
# Extra arguments go to `warren run` (for example --roles consumer,api).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec cargo run --release -- run --declare "$@"
