#!/usr/bin/env bash
# Benchmark: publish N persistent messages with `warren publish` (default 200,000), then drain
# them with `warren run --roles consumer` and print the throughput (messages per second, from
# the first row committed to the last), warren's peak RSS and CPU time, and the same drain by a
# minimal lapin consumer without a database (examples/broker_baseline.rs) for comparison. Uses its own queue names
# (warren_bench_*) and schema (warren_bench); re-runs purge them first.
#   scripts/bench.sh [N] [extra settings as KEY=VALUE ...]   (WARREN_BIN=path measures another build)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-200000}"; shift || true
./scripts/setup.sh >/dev/null 2>&1 || ./scripts/setup.sh
cargo build --release -q --bins --examples
BIN="${WARREN_BIN:-target/release/warren}"

export MAIN_EXCHANGE=warren_bench_exchange MAIN_QUEUE=warren_bench_queue
export RETRY_EXCHANGE=warren_bench_retry_exchange RETRY_QUEUE=warren_bench_retry
export DLX_EXCHANGE=warren_bench_dlx DLQ_QUEUE=warren_bench_dlq
export DATABASE_SCHEMA=warren_bench METRICS_ADDR=127.0.0.1:0 HTTP_ADDR=127.0.0.1:0
export DATABASE_URL="${DATABASE_URL:-postgres://warren:warren@127.0.0.1:5432/warren}"
for kv in "$@"; do export "${kv?}"; done

psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS warren_bench CASCADE" 2>/dev/null
"$BIN" declare >/dev/null
for q in "$MAIN_QUEUE" "$RETRY_QUEUE" "$DLQ_QUEUE"; do rabbitmqctl -q purge_queue "$q" >/dev/null; done

echo "publishing $N messages for the broker baseline..."
"$BIN" publish --count "$N"
BASELINE=$(target/release/examples/broker_baseline "$MAIN_QUEUE" "$N")
echo "$BASELINE"
BASE_RATE=$(echo "$BASELINE" | awk '{print $(NF-1)}')

echo "publishing $N messages for warren..."
"$BIN" publish --count "$N"

"$BIN" run --roles consumer 2>/tmp/warren-bench.log &
PID=$!
START=$(date +%s.%N)
while :; do
  ROWS=$(psql "$DATABASE_URL" -qtAc "SELECT count(*) FROM warren_bench.users")
  [ "$ROWS" -ge "$N" ] && break
  kill -0 "$PID" 2>/dev/null || { echo "warren exited; see /tmp/warren-bench.log"; exit 1; }
  sleep 0.2
done
END=$(date +%s.%N)
PEAK_KB=$(awk '/VmHWM/ {print $2}' "/proc/$PID/status")
CPU_S=$(awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$PID/stat")
kill -TERM "$PID"; wait "$PID" || true

SPAN=$(psql "$DATABASE_URL" -qtAc \
  "SELECT extract(epoch FROM max(inserted_at) - min(inserted_at)) FROM warren_bench.users")
awk -v n="$N" -v span="$SPAN" -v start="$START" -v end="$END" -v kb="$PEAK_KB" -v cpu="$CPU_S" -v base="$BASE_RATE" 'BEGIN {
  printf "drained %d messages\n", n
  printf "throughput: %.0f msg/s (first to last commit, %.2f s), %.0f%% of the broker baseline\n", n / span, span, 100 * n / span / base
  printf "wall clock from process start: %.2f s (%.0f msg/s)\n", end - start, n / (end - start)
  printf "peak RSS: %.1f MiB\n", kb / 1024
  printf "warren CPU: %.2f s (%.1f us per message)\n", cpu, cpu * 1e6 / n
}'
psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS warren_bench CASCADE"
