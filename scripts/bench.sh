#!/usr/bin/env bash
# Benchmark that tells the truth: warren next to what the broker alone, the least code doing
# warren's job and careful code doing it achieve on this machine, in ONE run, repetitions
# interleaved, so the ratios hold even when the machine's speed drifts.
#
#   scripts/bench.sh [N] [REPS] [KEY=VALUE...]              drain bench (N=200000, REPS=6)
#   scripts/bench.sh --live [RATE] [SECONDS] [KEY=VALUE...]  live bench (RATE=10000, SECONDS=60)
#   scripts/bench.sh --live-search [RATE] [SECONDS] [KEY=VALUE...]
#                                                            the highest live rate warren keeps up
#                                                            with (from RATE=2000, SECONDS=10 a
#                                                            step, REPS=2 repetitions of each)
#   scripts/bench.sh --all-roles [N] [KEY=VALUE...]          memory with all roles (N=100000)
#   scripts/bench.sh --wide [N] [REPS] [KEY=VALUE...]       a 10-column mapped pipeline (N=100000, REPS=3)
#   scripts/bench.sh --balance [N] [REPS] [KEY=VALUE...]    balance=auto against fixed concurrencies
#                                                            (N=200000, REPS=3)
#   scripts/bench.sh --redis-stop [N] [REPS] [KEY=VALUE...] warren whose Redis stops mid-drain
#                                                            (N=200000, REPS=3)
#   scripts/bench.sh --props [N] [REPS]                     what message properties cost the broker
#                                                            (N=200000, REPS=3)
#   scripts/bench.sh --orders [N] [REPS] [KEY=VALUE...]     nested orders (1-5 items each) against
#                                                            the users pipeline (N=100000, REPS=4)
#
# N, REPS, RATE and SECONDS may also be given as N=..., REPS=..., RATE=..., SECONDS=...; any other
# KEY=VALUE is a warren setting (environment) for the warren runs, e.g. USERS_BATCH_SIZE=2000.
# WARREN_BIN=path measures another build of warren; WARREN_BIN_B=path adds to the drain bench a
# contender warren_b, that build with default settings, for an A/B in one run (its ratios to the
# raw drain and to warren of the same repetitions); BENCH_TIMEOUT_S (600) bounds one drain.
# BENCH_PROFILE=debug builds and runs the debug build and examples instead of the release ones:
# a smoke run of the script itself, whose figures are not results.
# BENCH_PERF=1 profiles every drain of the drain, wide and props benches with `perf record -a -g`
# (the whole machine: broker, PostgreSQL and the contender) and writes beside its log a
# `<tag>.perf.txt`: the share of CPU samples per thread name (beam's schedulers, postgres, the
# contender's threads) and the top symbols of each. The sampling costs a few percent: take the
# figures of a run without it.
# BENCH_PIN=1 gives the broker CPU 0 to itself and runs PostgreSQL and the contenders on the other
# CPUs (as where the broker has its own host); needs root, restores the CPU masks at exit.
#
# Drain bench: every repetition runs the six contenders, each on its own backlog of N persistent
# ~100-byte users published with `warren publish --count N` (the queue must hold N before the
# drain starts). The order turns by one each repetition (repetition 2 starts with the minimal
# pipeline, 3 with the tuned one, 4 with warren, ...), so that what a drain leaves behind in the
# broker (its message store's garbage, a warm or cold cache) is not always charged to the same
# contender; with REPS a multiple of 6 every contender runs in every place equally often:
#   raw_drain          examples/raw_drain.rs: bare lapin, prefetch 5000, one multi-ack per 100
#                      deliveries, no decoding, no database (what the broker alone delivers)
#   minimal_pipeline   examples/minimal_pipeline.rs, the least code: lapin, prefetch 2000,
#                      serde_json, one UNNEST insert ON CONFLICT DO NOTHING per 1000 messages then
#                      one multi-ack, one insert in flight, no actors
#   tuned_pipeline     examples/tuned_pipeline.rs, careful code: prefetch 4000, batches of up to
#                      1000 (1 s timeout), each to whichever of two connections is free (two
#                      inserts in flight while the next batch fills), a plain UNNEST insert first
#                      (ON CONFLICT (id) DO NOTHING only after a unique violation), one multi-ack
#                      per run of committed batches, in batch order (as the yardstick's probe
#                      `pipeline --inflight 2 --plain-first`)
#   warren             warren run --roles consumer, default settings (plus the KEY=VALUEs given)
#   warren_pf5000      the same with PREFETCH=5000
#   warren_mapped      warren with users declared as a configured pipeline (docs/pipelines.md):
#                      the same queue, table and checks through the generic mapping instead of
#                      the typed users code
# and prints one table of medians (rate, ratios to the raw drain and, for warren, to the minimal
# and the tuned pipeline, CPU and broker CPU per message, peak RSS, acks per batch) and the figures
# of every repetition. docs/performance.md ("How to reproduce") says what each column measures.
# Every contender is timed the same way, by this script and the broker, never by the contender:
# from its launch (connecting and subscribing included) to the moment the queue holds nothing,
# ready or unacked (its last ack done: the broker's own count, read every 10 ms from inside the
# node, see "the end of a drain" below) and the table holds all N rows (counted once then; a
# contender that acked rows before committing them is timed until they are all in). msg/s is N
# over that span, the raw drain's included (it has no table). Until issue 37 the pipelines' rates
# came from inserted_at, which left out the last batch's insert, commit and ack and every
# start-up: figures from before are not comparable with these.
#
# Live bench: warren (run --roles consumer, defaults) consumes an empty queue while
# examples/live_publisher.rs publishes RATE msg/s for SECONDS s on a fixed schedule, then reports
# the achieved rate, the max queue depth (sampled every 50 ms) against two prefetch windows, what
# a user waits for: p50/p90/p99/max from the moment each message was due to the moment its row
# was committed (seen by another connection, through a trigger's NOTIFY), against the target p99
# (USERS_BATCH_TIMEOUT_MS + 250 ms, or BENCH_TARGET_P99_MS), and the verdict: kept up only when
# the p99 met the target, every message arrived, the depth stayed within the bound and the
# publisher reached the rate (a short queue with a growing latency is not keeping up); and the
# costs: insert statements per second, warren's, PostgreSQL's and the whole machine's CPU per
# message, acks per batch.
#
# Capacity search (--live-search): live runs of SECONDS s, REPS times each rate (a rate is held
# only if every repetition holds it; the first miss ends its repetitions), from RATE doubling
# while warren keeps up, then bisecting between the last rate held and the first missed until
# they are within 10%. The whole search (after the build) stays within BENCH_SEARCH_BUDGET_S
# (270) s, so a run is under 5 minutes: a rate is tried only if all its runs fit, by the longest
# run so far, and a run waits at most SECONDS after publishing for its last commits (later is a
# miss anyway). Prints each run's verdict, latency, costs and length, the time the search took,
# what the budget left untried, and the highest rate held.
#
# All roles: `warren run` with its default roles (consumer, dlq, api) drains N messages of which
# every 50th is invalid (to the DLQ, parked by the DLQ consumer) while 2,000 users are posted to
# the API one by one; prints the peak RSS against the target (32 MiB) and the time to settle.
#
# Wide bench: the drain bench's raw drain against warren running a configured pipeline of 10
# columns (uuid, text with the email format, numeric with a minimum, int4 with a range, int8,
# float8, bool, timestamptz, date, jsonb) into a table of its own, each on a backlog of N JSON
# messages of those 10 fields (~300 bytes) published with `warren publish --stdin`.
#
# Balance bench: the raw drain, warren with a fixed concurrency of 1, 2, 3 and 4 batch inserts in
# flight (USERS_BATCH_CONCURRENCY), and warren with USERS_BALANCE=auto from USERS_MIN_CONCURRENCY=1
# (USERS_MAX_CONCURRENCY=4, USERS_BALANCE_COOLDOWN_MS=1000; KEY=VALUEs given override them), each
# on a backlog of N; prints auto's rate against the best fixed concurrency of the same repetition
# (docs/balancing.md asks for >= 0.95) and the curve of auto's concurrency over time (sampled
# every 0.5 s from warren_pipeline_concurrency, with the rows inserted so far).
#
# Redis-stop bench: the raw drain, warren (defaults) and warren whose Redis (a redis-server of its
# own on a free port, started for that drain) is shut down once a tenth of the backlog is in the
# table: its rate against warren's of the same repetition (the events and the registry must never
# hold the data path) and the events it dropped and counted (warren_events_dropped_total).
#
# Properties bench: the raw drain of backlogs published by examples/publish_props.rs with bare
# properties (content type, persistent), with the message id alone, the timestamp alone, both (the
# id hyphenated, 65 bytes of properties, and as 32 hex digits, 61 bytes), with those and the
# x-published-ms header table, and with a traceparent header as well; prints, for each, the
# broker's CPU a message to take the backlog in (publishing with confirms) and to deliver it, and
# the drain's rate. PROPS_SETS="bare id:43 id:44" measures those sets instead (examples/
# publish_props.rs --props: id:N is a message id of N characters).
#
# Orders bench: the raw drain and warren (defaults) on the drain bench's users backlog, and the
# raw drain and warren on a backlog of N orders of 1-5 items each (generated from ORDERS_SEED, 36
# by default: the same orders every run) drained through the nested pipeline of docs/pipelines.md's
# worked example (parent table orders, child table order_items with a foreign key to it, on_conflict
# = "update"): timed the same way, from the launch to the queue empty AND every order's parent row
# and child rows in their tables. Prints, per repetition and as medians: the orders' msg/s and its
# ratio to warren's users of the same repetition (target >= 0.75), rows/s (parents + children),
# PostgreSQL's CPU a row and warren's peak RSS (target <= 32 MiB). After each orders drain (not
# timed) the tables are compared with the published orders, ids and values, parent and child rows:
# a row missing, extra or different stops the bench (exit 1), naming orders. With WARREN_BIN_B the
# B build drains both backlogs too (warren_b, warren_orders_b).
#
# Every drain of a table ends with all its rows: a queue empty (every message acked) while rows
# are still missing 10 s later is a lost message, and stops the bench (exit 1), never measured
# again.
#
# QUEUE_TYPE=quorum runs every contender (raw drain and minimal pipeline included) on quorum
# queues (warren_bench_*_quorum, deleted at the end): warren's drain of a quorum queue against the
# raw drain of the same quorum queue.
#
# Uses its own queues (warren_bench_*), schema (warren_bench) and Redis prefix (warren_bench);
# purges the queues and drops the schema at the end. A second run waits for the first
# (/tmp/warren-bench.lock). Logs stay in a directory under /tmp, named at the start.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'bench: %s\n' "$*" >&2; exit 1; }
say() { printf 'bench: %s\n' "$*" >&2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

# --- arguments --------------------------------------------------------------------------------
MODE=drain
case "${1:-}" in
  --live) MODE=live; shift ;;
  --live-search) MODE=search; shift ;;
  --all-roles) MODE=roles; shift ;;
  --wide) MODE=wide; shift ;;
  --balance) MODE=balance; shift ;;
  --redis-stop) MODE=redis; shift ;;
  --props) MODE=props; shift ;;
  --orders) MODE=orders; shift ;;
esac
POSITIONAL=()
SETTINGS=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    N=*|REPS=*|RATE=*|SECONDS=*) ;;           # handled below (SECONDS is also bash's own)
    [A-Za-z_]*=*) SETTINGS+=("$arg") ;;
    *[!0-9.]*|'') die "unknown argument '$arg' (see scripts/bench.sh --help)" ;;
    *) POSITIONAL+=("$arg") ;;
  esac
done
named() { # NAME DEFAULT ARGS...: the value of NAME=... among ARGS, else DEFAULT
  local name="$1" v="$2" arg
  shift 2
  for arg in "$@"; do case "$arg" in "$name="*) v="${arg#*=}" ;; esac; done
  printf '%s' "$v"
}
positive_int() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1: expected a whole number above 0, got '$2'"; }
if [ "$MODE" = roles ]; then
  [ ${#POSITIONAL[@]} -le 1 ] || die "too many numbers: expected [N]"
  N=$(named N "${POSITIONAL[0]:-100000}" "$@")
  positive_int N "$N"
elif [ "$MODE" = drain ] || [ "$MODE" = wide ] || [ "$MODE" = balance ] || [ "$MODE" = redis ] || [ "$MODE" = props ] || [ "$MODE" = orders ]; then
  [ ${#POSITIONAL[@]} -le 2 ] || die "too many numbers: expected [N] [REPS]"
  case "$MODE" in
    wide) DEFAULT_N=100000 DEFAULT_REPS=3 ;;
    balance|redis|props) DEFAULT_N=200000 DEFAULT_REPS=3 ;;
    orders) DEFAULT_N=100000 DEFAULT_REPS=4 ;;   # each of the four contenders once in each place
    *) DEFAULT_N=200000 DEFAULT_REPS=6 ;;   # a multiple of the drain bench's six contenders
  esac
  N=$(named N "${POSITIONAL[0]:-$DEFAULT_N}" "$@")
  REPS=$(named REPS "${POSITIONAL[1]:-$DEFAULT_REPS}" "$@")
  positive_int N "$N"; positive_int REPS "$REPS"
else
  [ ${#POSITIONAL[@]} -le 2 ] || die "too many numbers: expected [RATE] [SECONDS]"
  if [ "$MODE" = search ]; then DEFAULT_RATE=2000 DEFAULT_SECONDS=10; else DEFAULT_RATE=10000 DEFAULT_SECONDS=60; fi
  LIVE_RATE=$(named RATE "${POSITIONAL[0]:-$DEFAULT_RATE}" "$@")
  LIVE_SECONDS=$(named SECONDS "${POSITIONAL[1]:-$DEFAULT_SECONDS}" "$@")
  LIVE_REPS=$(named REPS 2 "$@")
  positive_int RATE "$LIVE_RATE"; positive_int SECONDS "$LIVE_SECONDS"; positive_int REPS "$LIVE_REPS"
fi
TIMEOUT_S="${BENCH_TIMEOUT_S:-600}"

# --- environment ------------------------------------------------------------------------------
./scripts/setup.sh >/dev/null 2>&1 || ./scripts/setup.sh
case "${BENCH_PROFILE:-release}" in
  release) cargo build --release -q --bins --examples; PROFILE_DIR=target/release ;;
  debug) cargo build -q --bins --examples; PROFILE_DIR=target/debug
         say "BENCH_PROFILE=debug: debug builds; the figures of this run are not results" ;;
  *) die "BENCH_PROFILE: expected release or debug, got '${BENCH_PROFILE}'" ;;
esac

# One bench at a time: runs share the warren_bench_* queues and schema (and the CPUs), so a second
# run waits here instead of purging the first one's backlog or dropping its schema.
LOCK=/tmp/warren-bench.lock
exec 9>"$LOCK"
if ! flock -n 9; then
  say "another scripts/bench.sh holds $LOCK; waiting for it to finish"
  flock 9
fi
BIN="${WARREN_BIN:-$PROFILE_DIR/warren}"
[ -x "$BIN" ] || die "WARREN_BIN=$BIN is not an executable"
BIN_B="${WARREN_BIN_B:-}"
# The bench's own variables are not warren settings: warren refuses unknown WARREN_* names.
unset WARREN_BIN WARREN_BIN_B
EX=$PROFILE_DIR/examples

export MAIN_EXCHANGE=warren_bench_exchange MAIN_QUEUE=warren_bench_queue
export RETRY_EXCHANGE=warren_bench_retry_exchange RETRY_QUEUE=warren_bench_retry
export DLX_EXCHANGE=warren_bench_dlx DLQ_QUEUE=warren_bench_dlq
export DATABASE_SCHEMA=warren_bench REDIS_PREFIX=warren_bench HTTP_ADDR=127.0.0.1:0
export AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
export DATABASE_URL="${DATABASE_URL:-postgres://warren:warren@127.0.0.1:5432/warren}"
for kv in "${SETTINGS[@]}"; do export "${kv?}"; done
# QUEUE_TYPE=quorum measures every contender on quorum queues of their own (a queue never changes
# its type), declared by `warren declare` on the node of AMQP_URL and deleted at the end.
if [ "${QUEUE_TYPE:-classic}" = quorum ]; then
  MAIN_QUEUE+=_quorum RETRY_QUEUE+=_quorum DLQ_QUEUE+=_quorum
fi
CLK_TCK=$(getconf CLK_TCK); export CLK_TCK
SCHEMA="$DATABASE_SCHEMA"
LOGDIR=$(mktemp -d /tmp/warren-bench.XXXXXX)

psql_q() { PGOPTIONS='-c client_min_messages=warning' psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -qtAX -c "$1"; }

# The RabbitMQ node behind 5672: its beam.smp process, whose CPU time is the broker's.
BEAM_PID=$(ss -Htlnp 'sport = :5672' 2>/dev/null | grep -o 'beam.smp",pid=[0-9]*' | head -1 | cut -d= -f2 || true)
if [ -z "$BEAM_PID" ]; then
  BEAM_PID=$(rabbitmqctl -q eval 'list_to_integer(os:getpid()).' 2>/dev/null | tr -dc 0-9 || true)
fi
if [ -z "$BEAM_PID" ] || [ ! -r "/proc/$BEAM_PID/stat" ]; then
  say "cannot find the broker's beam.smp process: broker CPU will read n/a"; BEAM_PID=""
fi

# BENCH_PIN=1: the broker gets CPU 0 to itself; PostgreSQL, this script and everything it starts
# share the other CPUs (the layout of a deployment, where the broker has a host of its own).
# Needs the right to set other users' CPU affinity (root); the old masks are restored at exit.
if [ "${BENCH_PIN:-0}" = 1 ]; then
  CPUS=$(nproc)
  [ "$CPUS" -ge 2 ] || die "BENCH_PIN=1 needs at least 2 CPUs, this machine has $CPUS"
  [ -n "$BEAM_PID" ] || die "BENCH_PIN=1: the broker's beam.smp process was not found"
  REST="1-$((CPUS - 1))"
  PINNED=("$BEAM_PID" $(pgrep -u postgres || true))
  declare -A OLD_MASK
  for pid in "${PINNED[@]}"; do OLD_MASK[$pid]=$(taskset -p "$pid" | awk '{print $NF}'); done
  unpin() {
    local pid
    for pid in "${!OLD_MASK[@]}"; do taskset -a -p "${OLD_MASK[$pid]}" "$pid" >/dev/null 2>&1 || true; done
  }
  trap unpin EXIT   # until cleanup's trap below takes over (it calls unpin)
  taskset -a -p -c 0 "$BEAM_PID" >/dev/null || die "BENCH_PIN=1: cannot pin the broker (taskset; root needed)"
  for pid in "${PINNED[@]:1}"; do taskset -a -p -c "$REST" "$pid" >/dev/null 2>&1 || true; done
  taskset -p -c "$REST" $$ >/dev/null
  say "pinned: the broker (pid $BEAM_PID) on CPU 0; PostgreSQL and the contenders on CPUs $REST"
fi

cpu_ticks() { # PID: utime + stime in clock ticks (fields 14 and 15, counted after the comm)
  sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}
broker_ticks() { if [ -n "$BEAM_PID" ]; then cpu_ticks "$BEAM_PID"; else echo -1; fi; }
# PostgreSQL's CPU so far: every live postgres process (utime + stime), plus what the ones that
# exited left in the postmaster's cutime + cstime (a contender's backend ends with it); -1 when
# no postgres process is visible.
pg_ticks() {
  local pid s=0 oldest
  oldest=$(pgrep -o -u postgres -x postgres 2>/dev/null || true)
  [ -n "$oldest" ] || { echo -1; return; }
  for pid in $(pgrep -u postgres 2>/dev/null); do
    [ -r "/proc/$pid/stat" ] && s=$(( s + $(cpu_ticks "$pid" 2>/dev/null || echo 0) ))
  done
  echo $(( s + $(sed 's/^.*) //' "/proc/$oldest/stat" | awk '{print $14 + $15}') ))
}
peak_rss_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }
# The whole machine's busy CPU so far (every CPU: user, nice, system, irq, softirq, steal), in
# clock ticks.
machine_ticks() { awk '$1 == "cpu" {print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }
now() { printf '%s' "$EPOCHREALTIME"; }

queue_field() { # QUEUE FIELD: e.g. messages, consumers
  rabbitmqctl -q list_queues --no-table-headers name "$2" | awk -v q="$1" '$1 == q {print $2}'
}
purge_queues() {
  local q
  for q in "$MAIN_QUEUE" "$RETRY_QUEUE" "$DLQ_QUEUE"; do rabbitmqctl -q purge_queue "$q" >/dev/null 2>&1 || true; done
}

free_port() {
  local p
  for _ in $(seq 1 100); do
    p=$((20000 + RANDOM % 20000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  die "found no free port for METRICS_ADDR"
}

# The users pipeline's main stage, as a build labels it: `pipeline="users"` (with
# `stage="main"`; the bench runs only the consumer role), or `pipeline="main"` in builds before
# the one label scheme (docs/operations.md, upgrading), so WARREN_BIN_B may be one of those.
# Sum of a metric's samples for the users stage (or without labels), read with bash alone so
# that polling spawns no process while warren is measured; empty if warren has not exported it.
scrape() { # PORT: sets PAGE to warren's /metrics page, empty when it does not answer
  # The page in one read, searched as one string: bash reads a socket line by line a byte a
  # syscall, and loops over lines slowly (15 ms of CPU a poll, 7% of the machine during a quorum
  # drain, all of it charged to warren's runs; now under 1 ms).
  PAGE=""
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 0
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  IFS= read -r -d '' -N 4194304 PAGE <&3 || true
  exec 3<&-
}
metric_of() { # NAME: the sum from the last scrape's PAGE
  local rest re line sum="" value
  # Each line `NAME VALUE` or `NAME{labels} VALUE`, by regex (a glob `*X*` that fails is
  # quadratic in bash).
  rest=$'\n'"${PAGE//$'\r'/}"
  re=$'\n'"$1"$'([ {][^\n]*)(.*)'
  while [[ "$rest" =~ $re ]]; do
    line="${BASH_REMATCH[1]}"; rest="${BASH_REMATCH[2]}"
    case "$line" in *pipeline=*) [[ "$line" == *'pipeline="users"'* || "$line" == *'pipeline="main"'* ]] || continue ;; esac
    value="${line##* }"; sum=$(( ${sum:-0} + ${value%%.*} ))
  done
  printf '%s' "$sum"
}
metric_now() { scrape "$1"; metric_of "$2"; } # PORT NAME
metric_file() { # FILE NAME: the same from a saved scrape (awk, after the measurement)
  awk -v name="$2" '
    (index($1, name "{") == 1 || $1 == name) && ($0 !~ /pipeline=/ || index($0, "pipeline=\"users\"") || index($0, "pipeline=\"main\"")) { s += $NF; found = 1 }
    END { if (found) printf "%.0f", s }' "$1"
}

CHILD=""
STOP_RC=0
stop_child() { # SIGTERM, wait up to 30 s, then SIGKILL; sets STOP_RC (not in a subshell: wait needs the parent)
  STOP_RC=0
  [ -n "$CHILD" ] || return 0
  kill -TERM "$CHILD" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$CHILD" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$CHILD" 2>/dev/null; then kill -KILL "$CHILD" 2>/dev/null || true; fi
  wait "$CHILD" 2>/dev/null || STOP_RC=$?
  CHILD=""
}
cleanup() {
  local rc=$?
  [ -z "${PERF_PID:-}" ] || kill -INT "$PERF_PID" 2>/dev/null || true
  if declare -F watch_stop >/dev/null; then watch_stop; fi
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then stop_child; fi
  purge_queues
  if [ "${QUEUE_TYPE:-classic}" = quorum ]; then
    for q in "$MAIN_QUEUE" "$RETRY_QUEUE" "$DLQ_QUEUE"; do rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true; done
  fi
  psql_q "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null 2>&1 || true
  if command -v redis-cli >/dev/null; then
    redis-cli --scan --pattern "$REDIS_PREFIX:*" 2>/dev/null | xargs -r redis-cli del >/dev/null 2>&1 || true
  fi
  if declare -F unpin >/dev/null; then unpin; fi
  [ "$rc" = 0 ] || say "failed; logs are in $LOGDIR"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Fresh state: the schema (warren declare re-creates it with its migrations) and the queues.
psql_q "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null
"$BIN" declare >"$LOGDIR/declare.log" 2>&1 || die "warren declare failed; see $LOGDIR/declare.log"
purge_queues

# Starts warren (run --roles consumer) with extra environment; sets CHILD, WARREN_PORT, WARREN_LOG.
start_warren() { # LOG [KEY=VALUE...]
  WARREN_LOG="$1"; shift
  WARREN_PORT=$(free_port)
  env "$@" METRICS_ADDR="127.0.0.1:$WARREN_PORT" "$BIN" run --roles consumer >"$WARREN_LOG" 2>&1 &
  CHILD=$!
}
# What warren tells about itself before it stops: CPU ticks, peak RSS, acks and batches.
read_warren() { # SCRAPE_FILE; sets W_TICKS W_RSS_KB W_ACKS W_BATCHES
  curl -sf "http://127.0.0.1:$WARREN_PORT/metrics" >"$1" || : >"$1"
  W_TICKS=$(cpu_ticks "$CHILD"); W_RSS_KB=$(peak_rss_kb "$CHILD")
  W_ACKS=$(metric_file "$1" warren_amqp_acks_total)
  W_BATCHES=$(metric_file "$1" warren_batch_size_count)
}
acks_per_batch() { # ACKS BATCHES
  if [ -n "$1" ] && [ -n "$2" ] && [ "$2" -gt 0 ]; then awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; else echo n/a; fi
}
stop_warren() { # warns unless warren stopped cleanly
  stop_child
  [ "$STOP_RC" = 0 ] || say "warning: warren exited with status $STOP_RC after SIGTERM; see $WARREN_LOG"
}

# ==============================================================================================
if [ "$MODE" = live ] || [ "$MODE" = search ]; then
  BATCH_TIMEOUT_MS="${USERS_BATCH_TIMEOUT_MS:-1000}"
  PREFETCH_NOW="${PREFETCH:-0}"
  if [ "$PREFETCH_NOW" = 0 ]; then
    PREFETCH_NOW=$(( ${USERS_BATCH_SIZE:-1000} * ${USERS_BATCH_CONCURRENCY:-2} * 2 ))
    [ "$PREFETCH_NOW" -le 65535 ] || PREFETCH_NOW=65535
  fi
  BOUND=$((2 * PREFETCH_NOW)); TARGET_MS=${BENCH_TARGET_P99_MS:-$((BATCH_TIMEOUT_MS + 250))}
  positive_int BENCH_TARGET_P99_MS "$TARGET_MS"
  SEARCH_START=$SECONDS
  # A run's wait, after publishing, for every message to be committed: a live bench waits up to
  # 120 s; a search step that needs more than SECONDS has missed anyway (far beyond the p99
  # target), and must not spend the search's budget.
  if [ "$MODE" = search ]; then SETTLE_S=$LIVE_SECONDS; else SETTLE_S=120; fi
  # The commit watcher's trigger (examples/live_publisher.rs), before any warren runs: no DDL
  # meets a running warren's statements.
  "$EX/live_publisher" --install-only >"$LOGDIR/install.log" 2>&1 || die "the live publisher could not install its trigger; see $LOGDIR/install.log"
  # One live run: warren consumes while the publisher sends RATE msg/s for SECONDS s; prints the
  # publisher's report and warren's and the broker's cost; sets KEPT_UP (yes/no) and LIVE_LINE.
  live_once() { # RATE SECONDS TAG
    local rate="$1" secs="$2" tag="$3" deadline b0 b1 m0 m1 p0 p1 rc=0 msgs
    psql_q "TRUNCATE $SCHEMA.users" >/dev/null
    purge_queues
    start_warren "$LOGDIR/warren-$tag.log"
    deadline=$((SECONDS + 60))
    until [ "$(queue_field "$MAIN_QUEUE" consumers)" -ge 1 ] 2>/dev/null; do
      kill -0 "$CHILD" 2>/dev/null || die "warren exited before it consumed; see $WARREN_LOG"
      [ "$SECONDS" -lt "$deadline" ] || die "warren did not subscribe to $MAIN_QUEUE within 60 s; see $WARREN_LOG"
      sleep 0.5
    done
    b0=$(broker_ticks); m0=$(machine_ticks); p0=$(pg_ticks)
    "$EX/live_publisher" --rate "$rate" --seconds "$secs" --depth-bound "$BOUND" \
      --target-p99-ms "$TARGET_MS" --settle-timeout-s "$SETTLE_S" 2>"$LOGDIR/live_publisher-$tag.err" >"$LOGDIR/live_publisher-$tag.out" || rc=$?
    b1=$(broker_ticks); m1=$(machine_ticks); p1=$(pg_ticks)
    kill -0 "$CHILD" 2>/dev/null || die "warren exited during the live run; see $WARREN_LOG"
    read_warren "$LOGDIR/warren-$tag.metrics"
    stop_warren
    [ "$rc" = 0 ] || die "the live publisher failed: $(tail -1 "$LOGDIR/live_publisher-$tag.err"); warren's log: $WARREN_LOG"
    [ "$MODE" = search ] || cat "$LOGDIR/live_publisher-$tag.out"
    MSGS=$(awk '/^published/ {print $2}' "$LOGDIR/live_publisher-$tag.out")
    KEPT_UP=$(sed -n 's/^kept up: \([a-z]*\).*/\1/p' "$LOGDIR/live_publisher-$tag.out")
    # The costs over the publisher's run (publishing, settling): insert statements per second
    # (warren's batches; the commits the watcher saw when the build exports none), warren's CPU
    # a message (its lifetime), PostgreSQL's a row and the whole machine's a message (the
    # publisher and its watcher included).
    COSTS_LINE=$(awk -v t="$W_TICKS" -v hz="$CLK_TCK" -v n="$MSGS" -v kb="$W_RSS_KB" -v b0="$b0" -v b1="$b1" \
        -v m0="$m0" -v m1="$m1" -v p0="$p0" -v p1="$p1" -v batches="${W_BATCHES:-}" \
        -v apb="$(acks_per_batch "$W_ACKS" "$W_BATCHES")" '
      /^commits seen/ { commits = $3; secs = $0; sub(/.* over /, "", secs); secs += 0 }
      END {
        stmts = (batches != "" ? batches : commits)
        printf "%.0f statements/s (%.1f rows each), acks/batch %s; CPU a message: warren %.1f us, PostgreSQL %s us, machine %.1f us, broker %s us; warren peak RSS %.1f MiB",
          (secs > 0 ? stmts / secs : 0), (stmts > 0 ? n / stmts : 0), apb, t / hz * 1e6 / n,
          (p0 >= 0 ? sprintf("%.1f", (p1 - p0) / hz * 1e6 / n) : "n/a"), (m1 - m0) / hz * 1e6 / n,
          (b0 >= 0 ? sprintf("%.1f", (b1 - b0) / hz * 1e6 / n) : "n/a"), kb / 1024 }' \
      "$LOGDIR/live_publisher-$tag.out")
    LIVE_LINE="$(sed -n 's/^kept up: //p' "$LOGDIR/live_publisher-$tag.out" | sed 's/^/kept up: /'); $(sed -n 's/^end-to-end latency[^:]*: //p' "$LOGDIR/live_publisher-$tag.out"); $COSTS_LINE"
    if [ "$MODE" = live ]; then
      echo "bound: two prefetch windows (2 x $PREFETCH_NOW); target p99: $TARGET_MS ms (due -> committed)"
      echo "costs over the publisher's run: $COSTS_LINE"
    fi
  }
  say "logs in $LOGDIR"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ "$MODE" = live ]; then
    echo "live bench: $LIVE_RATE msg/s for $LIVE_SECONDS s into warren (run --roles consumer${SETTINGS[*]:+, ${SETTINGS[*]}}; $BIN)"
    live_once "$LIVE_RATE" "$LIVE_SECONDS" live
  else
    # Capacity search: double the rate from RATE while warren keeps up, then halve the interval
    # between the last rate held and the first missed until they are within 10% of each other.
    echo "capacity search: the highest rate warren (run --roles consumer${SETTINGS[*]:+, ${SETTINGS[*]}}) keeps up with, $LIVE_SECONDS s a run, $LIVE_REPS runs a rate, from $LIVE_RATE msg/s; kept up = every run: p99 (due -> committed) <= $TARGET_MS ms, every message in, depth <= $BOUND, rate reached ($BIN)"
    # The budget bounds the whole search (set-up, every run, the stops between them): a run
    # starts only if it fits, by the longest run so far (before the first: SECONDS + 10 s), and
    # a rate is tried only if all its repetitions fit; what does not fit is left undecided, and
    # said.
    BUDGET_S=${BENCH_SEARCH_BUDGET_S:-270}
    positive_int BENCH_SEARCH_BUDGET_S "$BUDGET_S"
    held=0; missed=0; rate=$LIVE_RATE; step=0; HELD_LINE=""; longest=0; out_of_budget=""
    run_estimate() { if [ "$longest" -gt 0 ]; then echo "$longest"; else echo $((LIVE_SECONDS + 10)); fi; }
    fits() { [ $((SECONDS - SEARCH_START + $1 * $(run_estimate))) -le "$BUDGET_S" ]; } # RUNS: do they fit?
    while :; do
      step=$((step + 1))
      fits "$LIVE_REPS" || { out_of_budget=$rate; break; }
      # A rate is held only if every repetition holds it; the first miss ends its repetitions.
      rate_kept=yes
      for rep in $(seq 1 "$LIVE_REPS"); do
        if [ "$rep" -gt 1 ] && ! fits 1; then out_of_budget=$rate; break; fi
        run_start=$SECONDS
        live_once "$rate" "$LIVE_SECONDS" "search-$step-$rate-$rep"
        [ $((SECONDS - run_start)) -le "$longest" ] || longest=$((SECONDS - run_start))
        printf '  %6d msg/s, run %d (%d s): %s\n' "$rate" "$rep" "$((SECONDS - run_start))" "$LIVE_LINE"
        [ "$KEPT_UP" = yes ] || { rate_kept=no; break; }
      done
      [ -z "$out_of_budget" ] || break
      if [ "$rate_kept" = yes ]; then held=$rate; HELD_LINE=$LIVE_LINE; else missed=$rate; fi
      if [ "$missed" = 0 ]; then
        [ "$rate" -lt 128000 ] || break
        rate=$((rate * 2))
      else
        [ "$held" -gt 0 ] || { rate=$((missed / 2)); [ "$rate" -ge 100 ] || break; continue; }
        [ $((missed * 10)) -gt $((held * 11)) ] || break
        rate=$(( (held + missed) / 2 ))
      fi
    done
    echo "search: $((SECONDS - SEARCH_START)) s of a budget of $BUDGET_S s (BENCH_SEARCH_BUDGET_S)${out_of_budget:+; $out_of_budget msg/s left undecided: its runs (about $(run_estimate) s each) did not fit}"
    if [ "$held" -gt 0 ]; then
      echo "highest rate kept up: $held msg/s (missed at ${missed/#0/none tried}); there: $HELD_LINE"
    elif [ "$missed" = 0 ]; then
      echo "no rate decided within the budget"
    else
      echo "kept up at no rate tried (the lowest missed: $missed msg/s)"
    fi
  fi
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi

# ==============================================================================================
if [ "$MODE" = roles ]; then
  POSTS=2000
  INVALID=$((N / 50))
  say "logs in $LOGDIR"
  echo "all roles: warren run (consumer, dlq, api) drains $N messages ($INVALID invalid) while $POSTS users are posted to the API one by one ($BIN)"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BIN" publish --count "$N" --invalid-every 50 >"$LOGDIR/publish.log" 2>&1 \
    || die "warren publish failed; see $LOGDIR/publish.log"
  HTTP_PORT=$(free_port)
  WARREN_PORT=$(free_port)
  WARREN_LOG="$LOGDIR/warren-all-roles.log"
  started=$(now)
  env HTTP_ADDR="127.0.0.1:$HTTP_PORT" METRICS_ADDR="127.0.0.1:$WARREN_PORT" "$BIN" run >"$WARREN_LOG" 2>&1 &
  CHILD=$!
  deadline=$((SECONDS + 60))
  until curl -sf "http://127.0.0.1:$HTTP_PORT/healthz" >/dev/null; do
    kill -0 "$CHILD" 2>/dev/null || die "warren exited at start; see $WARREN_LOG"
    [ "$SECONDS" -lt "$deadline" ] || die "the API did not answer within 60 s; see $WARREN_LOG"
    sleep 0.2
  done
  run_id="$$-$(date +%s)"
  posted=0
  for i in $(seq 1 "$POSTS"); do
    curl -sf -XPOST "http://127.0.0.1:$HTTP_PORT/api/v1/users" -H 'content-type: application/json' \
      -d "{\"name\":\"bench $i\",\"email\":\"bench-$run_id-$i@example.com\"}" >/dev/null \
      && posted=$((posted + 1))
  done
  users=$((N - INVALID + posted))
  deadline=$((SECONDS + TIMEOUT_S))
  until [ "$(psql_q "SELECT count(*) FROM $SCHEMA.users")" -ge "$users" ] \
    && [ "$(psql_q "SELECT count(*) FROM $SCHEMA.dead_letters")" -ge "$INVALID" ]; do
    kill -0 "$CHILD" 2>/dev/null || die "warren exited during the run; see $WARREN_LOG"
    [ "$SECONDS" -lt "$deadline" ] || die "not settled within $TIMEOUT_S s; see $WARREN_LOG"
    sleep 0.5
  done
  settled=$(now)
  RSS_KB=$(peak_rss_kb "$CHILD")
  stop_warren
  awk -v kb="$RSS_KB" -v s="$started" -v e="$settled" -v p="$posted" -v u="$users" -v i="$INVALID" 'BEGIN {
    printf "posted %d of 2000 through the API; %d rows in users and %d parked after %.1f s\n", p, u, i, e - s
    printf "peak RSS %.1f MiB (target 32)\n", kb / 1024
  }'
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi

# ==============================================================================================
# Drain bench. Every measurement appends one line to $RESULTS:
#   rep contender msg/s drain_s wall_s cpu_us/msg broker_us/msg rss_mib acks batches acks/batch
RESULTS="$LOGDIR/results.tsv"
: >"$RESULTS"
CONTENDERS=(raw_drain minimal_pipeline tuned_pipeline warren warren_pf5000 warren_mapped)
# The bench's queue and exchange names as the lines of a `[[pipelines]]` entry.
names_toml() {
  printf 'main_exchange = "%s"\nmain_queue = "%s"\nretry_exchange = "%s"\n' "$MAIN_EXCHANGE" "$MAIN_QUEUE" "$RETRY_EXCHANGE"
  printf 'retry_queue = "%s"\ndlx_exchange = "%s"\ndlq_queue = "%s"\n' "$RETRY_QUEUE" "$DLX_EXCHANGE" "$DLQ_QUEUE"
}
# The table the warren contenders fill (users; wide for the wide bench).
TABLE=users
if [ -n "$BIN_B" ] && [ "$MODE" = drain ]; then
  [ -x "$BIN_B" ] || die "WARREN_BIN_B=$BIN_B is not an executable"
  CONTENDERS+=(warren_b)
fi
if [ "$MODE" = redis ]; then
  CONTENDERS=(raw_drain warren warren_redis_stop)
fi
if [ "$MODE" = props ]; then
  CONTENDERS=(props_bare props_id props_ts props_id_ts props_id32_ts props_warren props_traced)
  # PROPS_SETS="bare id:43 id:44": these sets of properties instead (publish_props --props).
  if [ -n "${PROPS_SETS:-}" ]; then
    CONTENDERS=(); for set in $PROPS_SETS; do CONTENDERS+=("props=$set"); done
  fi
fi
if [ "$MODE" = balance ]; then
  CONTENDERS=(raw_drain warren_c1 warren_c2 warren_c3 warren_c4 warren_auto)
fi
if [ "$MODE" = wide ]; then
  CONTENDERS=(raw_drain warren_wide)
  TABLE=wide
  psql_q "CREATE TABLE $SCHEMA.wide (id uuid PRIMARY KEY, email text NOT NULL, total numeric NOT NULL,
            qty int4 NOT NULL, big int8 NOT NULL, ratio float8 NOT NULL, flag bool NOT NULL,
            at timestamptz NOT NULL, day date NOT NULL, doc jsonb NOT NULL,
            inserted_at timestamptz NOT NULL DEFAULT now())" >/dev/null
  WIDE="$LOGDIR/wide.toml"
  cat >"$WIDE" <<TOML
[[pipelines]]
name = "users"
table = "wide"
key = ["id"]
unknown_fields = "reject"
$(names_toml)

[pipelines.columns]
id    = { path = "/id", type = "uuid" }
email = { path = "/email", type = "text", format = "email", max_len = 254 }
total = { path = "/total", type = "numeric", min = 0 }
qty   = { path = "/qty", type = "int4", min = 1, max = 1000 }
big   = { path = "/big", type = "int8" }
ratio = { path = "/ratio", type = "float8" }
flag  = { path = "/flag", type = "bool" }
at    = { path = "/at", type = "timestamptz" }
day   = { path = "/day", type = "date" }
doc   = { path = "/doc", type = "jsonb" }
TOML
fi
if [ "$MODE" = orders ]; then
  CONTENDERS=(raw_drain warren raw_drain_orders warren_orders)
  [ -z "$BIN_B" ] || CONTENDERS+=(warren_b warren_orders_b)
  # docs/pipelines.md's worked example: its tables (the items' foreign key and CHECK included)
  # and its pipeline, on the bench's queues. The entry is named users, as the wide bench's: it
  # takes the built-in users pipeline's place (and its metrics' label, which the script reads).
  psql_q "CREATE TABLE $SCHEMA.orders (order_id uuid PRIMARY KEY, email text NOT NULL,
            total numeric NOT NULL, version int8 NOT NULL);
          CREATE TABLE $SCHEMA.order_items (
            order_id uuid NOT NULL REFERENCES $SCHEMA.orders ON DELETE CASCADE,
            line int4 NOT NULL, sku text NOT NULL, qty int4 NOT NULL CHECK (qty <= 100),
            PRIMARY KEY (order_id, line))" >/dev/null
  ORDERS="$LOGDIR/orders.toml"
  cat >"$ORDERS" <<TOML
[[pipelines]]
name = "users"
table = "orders"
key = ["order_id"]
on_conflict = "update"
version_column = "version"
$(names_toml)

[pipelines.columns]
order_id = { path = "/order_id", type = "uuid" }
email    = { path = "/customer/email", type = "text", format = "email" }
total    = { path = "/total", type = "numeric", min = 0 }
version  = { path = "/version", type = "int8" }

[[pipelines.children]]
table = "order_items"
rows = "/items"
key = ["order_id", "line"]

[pipelines.children.columns]
order_id = { parent = "order_id" }
line     = { index = true }
sku      = { path = "/sku", type = "text", min_len = 1 }
qty      = { path = "/qty", type = "int4", min = 1 }
TOML
  # N orders, the same for a seed on every machine (an integer hash of the order's number, not
  # awk's rand): 1-5 items of 1-100 each, ~150-350 bytes. The items' count is kept for the end
  # of a drain; the orders themselves are loaded into the schema as the rows they must give, to
  # compare with the tables after each drain.
  ORDERS_SEED="${ORDERS_SEED:-36}"
  positive_int ORDERS_SEED "$ORDERS_SEED"
  ORDERS_FILE="$LOGDIR/orders.jsonl"
  ITEMS=$(awk -v n="$N" -v seed="$ORDERS_SEED" -v out="$ORDERS_FILE" 'BEGIN {
    for (i = 1; i <= n; i++) {
      h = (i * 2654435761 + seed * 40503) % 4294967296
      k = 1 + h % 5; items = ""; cents = 0
      for (j = 1; j <= k; j++) {
        g = (h + j * 2246822519) % 4294967296
        qty = 1 + int(g / 5) % 100; price = 100 + int(g / 500) % 9900; cents += qty * price
        items = items sprintf("%s{\"sku\":\"SKU-%05d\",\"qty\":%d}", (j > 1 ? "," : ""), int(g / 7) % 100000, qty)
      }
      printf "{\"order_id\":\"%08x-0000-4000-8000-%012x\",\"customer\":{\"email\":\"o%d@example.com\"},\"total\":\"%d.%02d\",\"version\":1,\"items\":[%s]}\n", \
        i, seed, i, int(cents / 100), cents % 100, items >out
      total += k
    }
    print total }') || die "cannot generate $ORDERS_FILE"
  psql_q "CREATE TABLE $SCHEMA.orders_published (doc jsonb NOT NULL)" >/dev/null
  PGOPTIONS='-c client_min_messages=warning' psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -qtAX \
    -c "\\copy $SCHEMA.orders_published (doc) FROM '$ORDERS_FILE'" >/dev/null \
    || die "cannot load $ORDERS_FILE into $SCHEMA.orders_published"
  psql_q "CREATE TABLE $SCHEMA.orders_expected AS
            SELECT (doc->>'order_id')::uuid order_id, doc#>>'{customer,email}' email,
                   (doc->>'total')::numeric total, (doc->>'version')::int8 version
            FROM $SCHEMA.orders_published;
          CREATE TABLE $SCHEMA.order_items_expected AS
            SELECT (doc->>'order_id')::uuid order_id, e.line::int4 line, e.item->>'sku' sku,
                   (e.item->>'qty')::int4 qty
            FROM $SCHEMA.orders_published, jsonb_array_elements(doc->'items') WITH ORDINALITY e(item, line)" >/dev/null
  loaded=$(psql_q "SELECT (SELECT count(*) FROM $SCHEMA.orders_expected) || ' ' || (SELECT count(*) FROM $SCHEMA.order_items_expected)")
  [ "$loaded" = "$N $ITEMS" ] || die "the generated orders load as $loaded orders and items, not $N $ITEMS"
  say "orders: $N orders of $ITEMS items (seed $ORDERS_SEED, $(( $(stat -c %s "$ORDERS_FILE") / N )) bytes each on average)"
fi
# users as a configured pipeline: the typed pipeline's queue, table and checks, through the mapping.
MAPPED="$LOGDIR/users-mapped.toml"
cat >"$MAPPED" <<TOML
[[pipelines]]
name = "users"
table = "users"
key = ["id"]
on_conflict = "keep"
unknown_fields = "reject"
$(names_toml)

[pipelines.columns]
id    = { path = "/id", type = "uuid" }
name  = { path = "/name", type = "text", min_len = 1, max_len = 200 }
email = { path = "/email", type = "text", format = "email", max_len = 254 }
TOML

# A measurement that fails sets FAIL and returns 1; the loop below measures it again (the broker
# and database are shared: another test may close every connection or restart a server).
FAIL=""
ATTEMPTS=3

# Publishes N and waits until the queue holds them.
fill_queue() { # LOG
  local depth deadline
  # rabbitmqctl's count of a quorum queue comes from statistics emitted every 5 s: right after a
  # drain it can still show messages that were acked. Read again for up to 12 s before calling
  # what it shows a leftover.
  deadline=$((SECONDS + 12))
  depth=$(queue_field "$MAIN_QUEUE" messages)
  while [ "${depth:-0}" != 0 ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 1
    depth=$(queue_field "$MAIN_QUEUE" messages)
  done
  if [ "${depth:-0}" != 0 ]; then say "warning: $MAIN_QUEUE held $depth messages before publishing; purged"; purge_queues; fi
  if [ "$MODE" = props ]; then
    local b0 b1
    b0=$(broker_ticks)
    "$EX/publish_props" --count "$N" --props "$PROPS" >"$1" 2>&1 || { FAIL="publish_props failed: $(tail -1 "$1"); see $1"; return 1; }
    b1=$(broker_ticks)
    PUBLISH_BROKER_TICKS=$(( b0 < 0 ? -1 : b1 - b0 ))
  elif [ "$BACKLOG" = orders ]; then
    "$BIN" publish --file "$ORDERS_FILE" >"$1" 2>&1 || { FAIL="warren publish --file $ORDERS_FILE failed: $(tail -1 "$1"); see $1"; return 1; }
  elif [ "$MODE" = wide ]; then
    awk -v n="$N" 'BEGIN { for (i = 1; i <= n; i++) printf "{\"id\":\"%08x-0000-4000-8000-%012x\",\"email\":\"w%d@example.com\",\"total\":\"%d.%02d\",\"qty\":%d,\"big\":%d,\"ratio\":%d.5,\"flag\":%s,\"at\":\"2026-11-25T10:%02d:%02dZ\",\"day\":\"2026-11-25\",\"doc\":{\"n\":%d,\"tags\":[\"a\",\"b\"]}}\n", i, i, i, i % 1000, i % 100, 1 + i % 1000, 1000000000 + i, i % 7, (i % 2 ? "true" : "false"), i % 60, i % 60, i }' \
      | "$BIN" publish --stdin >"$1" 2>&1 || { FAIL="warren publish --stdin failed: $(tail -1 "$1"); see $1"; return 1; }
  else
    "$BIN" publish --count "$N" >"$1" 2>&1 || { FAIL="warren publish failed: $(tail -1 "$1"); see $1"; return 1; }
  fi
  deadline=$((SECONDS + 60))
  until [ "$(queue_field "$MAIN_QUEUE" messages)" = "$N" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      FAIL="$MAIN_QUEUE does not hold $N messages 60 s after publishing (it holds $(queue_field "$MAIN_QUEUE" messages))"
      return 1
    fi
    sleep 0.5
  done
}
# What the queue is filled with before a drain: users (warren publish --count), or the orders
# bench's orders (set by measure).
BACKLOG=users
# The rows in the table (counted once a drain is over, never in a loop while one runs: a
# count(*) of a growing table costs PostgreSQL tens of ms); for orders, the parent rows and the
# child rows, as "PARENTS CHILDREN".
rows_in_table() {
  if [ "$TABLE" = orders ]; then
    psql_q "SELECT (SELECT count(*) FROM $SCHEMA.orders) || ' ' || (SELECT count(*) FROM $SCHEMA.order_items)"
  else
    psql_q "SELECT count(*) FROM $SCHEMA.$TABLE"
  fi
}
# The rows a drain must leave, in the form rows_in_table answers.
rows_wanted() { if [ "$TABLE" = orders ]; then printf '%s %s' "$N" "$ITEMS"; else printf '%s' "$N"; fi; }
# The orders bench's tables against the orders published (ids and values, parent and child
# rows), once a drain is over; a difference stops the bench: warren lost, added or changed rows.
verify_orders() { # TAG
  local diff
  diff=$(psql_q "WITH
      p_missing AS (SELECT * FROM $SCHEMA.orders_expected
                    EXCEPT SELECT order_id, email, total, version FROM $SCHEMA.orders),
      p_extra AS (SELECT order_id, email, total, version FROM $SCHEMA.orders
                  EXCEPT SELECT * FROM $SCHEMA.orders_expected),
      c_missing AS (SELECT * FROM $SCHEMA.order_items_expected
                    EXCEPT SELECT order_id, line, sku, qty FROM $SCHEMA.order_items),
      c_extra AS (SELECT order_id, line, sku, qty FROM $SCHEMA.order_items
                  EXCEPT SELECT * FROM $SCHEMA.order_items_expected)
    SELECT (SELECT count(*) FROM p_missing) || ' ' || (SELECT count(*) FROM p_extra) || ' '
        || (SELECT count(*) FROM c_missing) || ' ' || (SELECT count(*) FROM c_extra) || ' '
        || coalesce((SELECT string_agg(order_id::text, ',') FROM (SELECT order_id FROM p_missing
             UNION SELECT order_id FROM p_extra UNION SELECT order_id FROM c_missing
             UNION SELECT order_id FROM c_extra ORDER BY 1 LIMIT 3) f), '-')") \
    || die "$1: cannot compare $SCHEMA.orders and $SCHEMA.order_items with the orders published"
  read -r pm pe cm ce ids <<<"$diff"
  [ "$pm $pe $cm $ce" = "0 0 0 0" ] || die "$1: the tables do not hold the orders published: \
$pm of $N orders missing or different in $SCHEMA.orders and $pe there not as published; \
$cm of $ITEMS items missing or different in $SCHEMA.order_items and $ce there not as published \
(orders $ids ...); every message was acked: a lost or changed message. See $LOGDIR/$1.log"
}

# --- the end of a drain, as the broker sees it --------------------------------------------------
# A drain is over when its queue holds nothing, ready or unacked: the contender's last ack is
# done. `rabbitmqctl list_queues` cannot time that: each call starts a CLI (0.7 s, 0.5 s of CPU)
# and counts a quorum queue from statistics emitted every 5 s. So one `rabbitmqctl eval` a drain,
# started and reading the queue before the contender starts, asks the broker from inside every
# 10 ms (a classic queue: its process's `messages`, ready plus unacked; a quorum queue: its
# leader's `rabbit_fifo` total, ready plus checked out) and returns the broker's clock at the
# first read of 0. It only reads, ends with its CLI (it monitors it) and after BENCH_TIMEOUT_S.
WATCH_PID=""
vhost_of() { # URL: the vhost of an amqp:// URL (its path, percent-decoded; "/" when it has none)
  local rest="${1#*://}" path=""
  case "$rest" in */*) path="${rest#*/}" ;; esac
  path="${path%%\?*}"
  if [ -z "$path" ]; then printf '/'; else printf '%b' "${path//%/\\x}"; fi
}
VHOST=$(vhost_of "$AMQP_URL")
watch_expr() { # QUEUE TIMEOUT_MS: the Erlang the watcher evaluates on the node
  cat <<ERL
QName = rabbit_misc:r(<<"$VHOST">>, queue, <<"$1">>),
case rabbit_amqqueue:lookup(QName) of
  {error, not_found} -> no_queue;
  {ok, Q} ->
    Count = case amqqueue:get_type(Q) of
      rabbit_quorum_queue ->
        fun() -> {ok, {_, N}, _} = ra:local_query(amqqueue:get_pid(Q), fun rabbit_fifo:query_messages_total/1), N end;
      _ -> fun() -> [{messages, N}] = rabbit_amqqueue:info(Q, [messages]), N end
    end,
    erlang:monitor(process, group_leader()),
    io:format("watching ~b cli ~s~n", [Count(), rpc:call(node(group_leader()), os, getpid, [])]),
    Deadline = erlang:monotonic_time(millisecond) + $2,
    Loop = fun L() ->
      case Count() of
        0 -> {empty, os:system_time(microsecond)};
        Left -> receive {'DOWN', _, _, _, _} -> gone
                after 10 -> case erlang:monotonic_time(millisecond) > Deadline of
                              true -> {timeout, Left}; false -> L() end
                end
      end
    end,
    Loop()
end.
ERL
}
watch_start() { # TAG: starts the watcher on MAIN_QUEUE; returns once it has read the queue's N
  local out="$LOGDIR/$1.watch" deadline=$((SECONDS + 30)) seen=""
  rabbitmqctl -q eval "$(watch_expr "$MAIN_QUEUE" $((TIMEOUT_S * 1000)))" >"$out" 2>&1 &
  WATCH_PID=$!; WATCH_OUT="$out"; WATCH_CLI=""
  until [ -n "$seen" ]; do
    if ! kill -0 "$WATCH_PID" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      watch_stop; FAIL="the drain's watcher (rabbitmqctl eval) did not start: $(tail -1 "$out"); see $out"; return 1
    fi
    sleep 0.05
    read -r _ seen _ WATCH_CLI < <(grep -m1 '^watching ' "$out") || true
  done
  [ "$seen" = "$N" ] || { watch_stop; FAIL="$MAIN_QUEUE holds $seen messages, not $N, as the drain starts; see $out"; return 1; }
}
# Ends the watcher before its time: its CLI's own process (rabbitmqctl runs it through su, whose
# child is in a session of its own, out of reach of the wrapper's signals); the node's side of
# the watcher ends with it.
watch_stop() {
  [ -n "${WATCH_PID:-}" ] || return 0
  if kill -0 "$WATCH_PID" 2>/dev/null && [ -n "${WATCH_CLI:-}" ] \
    && [ "$(cat "/proc/$WATCH_CLI/comm" 2>/dev/null)" = beam.smp ]; then
    kill "$WATCH_CLI" 2>/dev/null || true
  fi
  kill "$WATCH_PID" 2>/dev/null || true; wait "$WATCH_PID" 2>/dev/null || true; WATCH_PID=""
}
watch_over() { [ -n "$WATCH_PID" ] && ! kill -0 "$WATCH_PID" 2>/dev/null; } # it returned: the queue emptied, or it gave up
# Once the watcher returned: sets DRAIN_END (epoch seconds) to the moment the queue held nothing
# ready or unacked and the table all N rows (not counted with NO_TABLE=1: the raw drain); with
# fewer rows then, the contender acked rows it had not committed: the drain ends when they are
# all there, if they come.
drain_end() { # [NO_TABLE]
  local result rows deadline
  wait "$WATCH_PID" 2>/dev/null || true; WATCH_PID=""
  result=$(tail -1 "$WATCH_OUT")
  case "$result" in
    '{empty,'*'}') DRAIN_END=$(awk -v us="${result//[^0-9]/}" 'BEGIN {printf "%.6f", us / 1e6}') ;;
    '{timeout,'*'}') FAIL="$MAIN_QUEUE still held ${result//[^0-9]/} messages (ready or unacked) after $TIMEOUT_S s"; return 1 ;;
    *) FAIL="the drain's watcher failed: $result; see $WATCH_OUT"; return 1 ;;
  esac
  [ "${1:-}" != 1 ] || return 0
  local want; want=$(rows_wanted)
  rows=$(rows_in_table); deadline=$((SECONDS + 10))
  if [ "$rows" != "$want" ]; then
    say "warning: $MAIN_QUEUE was empty with ${rows:-?} of $want rows in $SCHEMA.$TABLE: acks before commits"
    until [ "$rows" = "$want" ]; do
      # Every message acked and rows still missing: a lost message, not a disturbed measurement.
      [ "$SECONDS" -lt "$deadline" ] || die "$SCHEMA.$TABLE holds ${rows:-?} rows of $want ($([ "$TABLE" = orders ] && echo 'orders and items, ')10 s after every message was acked: rows lost; logs in $LOGDIR"
      sleep 0.02; rows=$(rows_in_table)
    done
    DRAIN_END=$(now)
  fi
}
# Rate over the first 99% of the backlog, by the database's clock: the rows committed before the
# batch that brought the table past 99% of N began, over the time from the first batch's start to
# that batch's start. The last 1% is left out: a drain's last batch is partial whenever the
# batches stopped lining up with N (a flush at a change of concurrency does that), and a partial
# batch waits the batch timeout for more, which a backlog of a round N spares the others.
db_rate99() {
  psql_q "WITH b AS (SELECT inserted_at t, count(*) n FROM $SCHEMA.$TABLE GROUP BY inserted_at),
               c AS (SELECT t, sum(n) OVER (ORDER BY t) cum FROM b),
               lo AS (SELECT min(t) t0 FROM b),
               hi AS (SELECT min(t) t99 FROM c WHERE cum >= 0.99 * $N)
          SELECT coalesce(CASE WHEN hi.t99 > lo.t0 THEN
                   (SELECT sum(n) FROM b WHERE b.t < hi.t99) / extract(epoch FROM hi.t99 - lo.t0) END, 0)
          FROM lo, hi"
}
record() { # rep contender rate drain_s wall_s ticks broker_ticks rss_kb acks batches db_ticks
  awk -v hz="$CLK_TCK" -v n="$N" -v rep="$1" -v c="$2" -v rate="$3" -v drain="$4" -v wall="$5" \
      -v t="$6" -v bt="$7" -v kb="$8" -v acks="$9" -v batches="${10}" -v apb="$(acks_per_batch "$9" "${10}")" \
      -v dt="${11:--1}" 'BEGIN {
    printf "%s\t%s\t%.0f\t%.3f\t%.3f\t%.2f\t%s\t%.1f\t%s\t%s\t%s\t%s\n", rep, c, rate, drain, wall, t / hz * 1e6 / n,
      (bt >= 0 ? sprintf("%.2f", bt / hz * 1e6 / n) : "n/a"), kb / 1024,
      (acks == "" ? "n/a" : acks), (batches == "" ? "n/a" : batches), apb,
      (dt >= 0 ? sprintf("%.2f", dt / hz * 1e6 / n) : "n/a")
  }' >>"$RESULTS"
}
field() { # KEY LINE: the value of key=value in an example's output line
  local kv
  for kv in $2; do case "$kv" in "$1="*) printf '%s' "${kv#*=}"; return ;; esac; done
}
seconds_between() { awk -v a="$1" -v b="$2" 'BEGIN {print b - a}'; }

perf_start() { # tag; with BENCH_PERF=1, samples the whole machine until perf_stop
  PERF_PID=""
  [ "${BENCH_PERF:-0}" = 1 ] || return 0
  perf record -a -g -F 499 -o "$LOGDIR/$1.perf.data" >/dev/null 2>&1 &
  PERF_PID=$!; PERF_TAG="$1"
  sleep 0.2
}
perf_stop() { # writes $LOGDIR/<tag>.perf.txt: CPU by thread name, then the top symbols of each
  [ -n "${PERF_PID:-}" ] || return 0
  kill -INT "$PERF_PID" 2>/dev/null; wait "$PERF_PID" 2>/dev/null || true
  local data="$LOGDIR/$PERF_TAG.perf.data" out="$LOGDIR/$PERF_TAG.perf.txt"
  {
    echo "# CPU samples by thread name (whole machine, 499 Hz)"
    perf report -i "$data" --sort comm --stdio --no-children -g none --percent-limit 0.5 2>/dev/null | grep -v '^$'
    echo
    echo "# top symbols by thread name and library"
    perf report -i "$data" --sort comm,dso,sym --stdio --no-children -g none --percent-limit 0.4 2>/dev/null | grep -v '^$'
  } >"$out"
  rm -f "$data"; PERF_PID=""
  say "profile: $out"
}

run_example() { # rep contender tag example args...
  local rep="$1" name="$2" tag="$3" ex="$4"; shift 4
  local out="$LOGDIR/$tag.out" err="$LOGDIR/$tag.err" b0 b1 p0 p1 t0 t1 rc=0 line
  watch_start "$tag" || return 1
  perf_start "$tag"
  p0=$(pg_ticks); b0=$(broker_ticks); t0=$(now)
  "$EX/$ex" "$@" >"$out" 2>"$err" &
  CHILD=$!
  wait "$CHILD" || rc=$?
  CHILD=""
  t1=$(now); b1=$(broker_ticks); p1=$(pg_ticks)
  perf_stop
  [ "$rc" = 0 ] || { watch_stop; FAIL="$ex failed (status $rc): $(tail -1 "$err"); see $err"; return 1; }
  # The example acked its last message and closed its connection: the queue is empty by now,
  # unless an ack was lost (then the watcher times out, and the drain is measured again).
  drain_end "$([ "$ex" = raw_drain ] && echo 1)" || return 1
  line=$(tail -1 "$out")
  record "$rep" "$name" "$(drain_rate "$t0")" "$(seconds_between "$t0" "$DRAIN_END")" "$(seconds_between "$t0" "$t1")" \
    "$(( $(field cpu_us "$line") * CLK_TCK / 1000000 ))" "$(( b0 < 0 ? -1 : b1 - b0 ))" \
    "$(field peak_rss_kb "$line")" "$(field acks "$line")" "$(field batches "$line")" \
    "$(( p0 < 0 || p1 < 0 ? -1 : p1 - p0 ))"
}
# N over the drain: from the contender's launch (T0) to DRAIN_END.
drain_rate() { awk -v n="$N" -v a="$1" -v b="$DRAIN_END" 'BEGIN {print n / (b - a)}'; }

run_warren() { # rep contender tag [KEY=VALUE...]
  local rep="$1" name="$2" tag="$3"; shift 3
  local b0 b1 p0 p1 t0 t1 inserted deadline disturbed
  watch_start "$tag" || return 1
  perf_start "$tag"
  p0=$(pg_ticks); b0=$(broker_ticks); t0=$(now)
  start_warren "$LOGDIR/$tag.log" "$@"
  deadline=$((SECONDS + TIMEOUT_S + 5))
  local next_sample=0 elapsed
  [ -z "${CURVE:-}" ] || : >"$CURVE"
  # Until the watcher saw the queue empty. warren's /metrics is read only where a bench needs
  # it during the drain (the balance bench's curve, the Redis stop): a plain drain is left alone,
  # as the examples are.
  until watch_over; do
    sleep 0.05
    kill -0 "$CHILD" 2>/dev/null || { stop_child; watch_stop; FAIL="warren exited (status $STOP_RC) before draining the queue; see $WARREN_LOG"; return 1; }
    if [ -n "${CURVE:-}" ]; then
      elapsed=$(seconds_between "$t0" "$(now)")
      if awk -v e="$elapsed" -v n="$next_sample" 'BEGIN {exit !(e >= n)}'; then
        scrape "$WARREN_PORT"
        printf '%.1f\t%s\t%s\n' "$elapsed" "$(metric_of warren_pipeline_concurrency)" "$(metric_of warren_messages_inserted_total)" >>"$CURVE"
        next_sample=$(awk -v n="$next_sample" 'BEGIN {print n + 0.5}')
      fi
    fi
    if [ -n "${REDIS_STOP_PORT:-}" ]; then
      inserted=$(metric_now "$WARREN_PORT" warren_messages_inserted_total)
      if [ "${inserted:-0}" -ge $((N / 10)) ]; then
        redis-cli -p "$REDIS_STOP_PORT" shutdown nosave >/dev/null 2>&1 || true
        say "$tag: Redis (port $REDIS_STOP_PORT) stopped at ${inserted} rows"; REDIS_STOP_PORT=""
      fi
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      stop_warren; watch_stop; FAIL="$MAIN_QUEUE not empty $TIMEOUT_S s after warren started; see $WARREN_LOG"; return 1
    fi
  done
  t1=$(now); b1=$(broker_ticks); p1=$(pg_ticks)
  perf_stop
  read_warren "$LOGDIR/$tag.metrics"
  stop_warren
  # A reconnect or a rebuilt consumer during the drain (someone closed the connections) makes
  # the figures those of a different run: measure again.
  disturbed=$(( $(metric_file "$LOGDIR/$tag.metrics" warren_reconnects_total || echo 0) + 0
    + $(metric_file "$LOGDIR/$tag.metrics" warren_consumer_restarts_total || echo 0) + 0 ))
  [ "$disturbed" = 0 ] || { watch_stop; FAIL="warren reconnected or rebuilt its consumer $disturbed time(s) during the drain; see $WARREN_LOG"; return 1; }
  drain_end || return 1
  if [ "$MODE" = balance ]; then printf '%s\t%s\t%s\n' "$rep" "$name" "$(db_rate99)" >>"$LOGDIR/rate99.tsv"; fi
  record "$rep" "$name" "$(drain_rate "$t0")" "$(seconds_between "$t0" "$DRAIN_END")" "$(seconds_between "$t0" "$t1")" \
    "$W_TICKS" "$(( b0 < 0 ? -1 : b1 - b0 ))" "$W_RSS_KB" "$W_ACKS" "$W_BATCHES" \
    "$(( p0 < 0 || p1 < 0 ? -1 : p1 - p0 ))"
}

measure() { # rep contender tag
  if [ "$MODE" = orders ]; then
    case "$2" in *orders*) BACKLOG=orders TABLE=orders ;; *) BACKLOG=users TABLE=users ;; esac
    psql_q "TRUNCATE $SCHEMA.users, $SCHEMA.order_items, $SCHEMA.orders" >/dev/null || { FAIL="cannot empty the tables"; return 1; }
  else
    psql_q "TRUNCATE $SCHEMA.$TABLE" >/dev/null || { FAIL="cannot empty $SCHEMA.$TABLE"; return 1; }
  fi
  case "$2" in
    props_bare) PROPS=bare ;;
    props_id) PROPS=id ;;
    props_ts) PROPS=timestamp ;;
    props_id_ts) PROPS=id,timestamp ;;
    props_id32_ts) PROPS=id:32,timestamp ;;
    props_warren) PROPS=id,timestamp,published_ms ;;
    props_traced) PROPS=id,timestamp,published_ms,traceparent ;;
    props=*) PROPS="${2#props=}" ;;
  esac
  fill_queue "$LOGDIR/$3.publish.log" || return 1
  case "$2" in
    props_*|props=*)  run_example "$1" "$2" "$3" raw_drain --count "$N" || return 1
                      awk -v hz="$CLK_TCK" -v n="$N" -v r="$1" -v c="$2" -v t="$PUBLISH_BROKER_TICKS" \
                        '/^published/ { rate = $NF == "msg/s" ? $(NF - 1) : "" } END {
                          printf "%s\t%s\t%s\t%s\n", r, c, (t >= 0 ? sprintf("%.2f", t / hz * 1e6 / n) : "n/a"), rate }' \
                        "$LOGDIR/$3.publish.log" >>"$LOGDIR/publish.tsv" ;;
    raw_drain|raw_drain_orders) run_example "$1" "$2" "$3" raw_drain --count "$N" ;;
    minimal_pipeline) run_example "$1" "$2" "$3" minimal_pipeline --count "$N" ;;
    tuned_pipeline)   run_example "$1" "$2" "$3" tuned_pipeline --count "$N" ;;
    warren)           run_warren "$1" "$2" "$3" ;;
    warren_b)         local bin_a="$BIN" rc=0
                      BIN="$BIN_B"; run_warren "$1" "$2" "$3" || rc=$?; BIN="$bin_a"
                      return "$rc" ;;
    warren_pf5000)    run_warren "$1" "$2" "$3" PREFETCH=5000 ;;
    warren_orders)    run_warren "$1" "$2" "$3" WARREN_CONFIG="$ORDERS" && verify_orders "$3" ;;
    warren_orders_b)  local bin_a="$BIN" rc=0
                      BIN="$BIN_B"; run_warren "$1" "$2" "$3" WARREN_CONFIG="$ORDERS" || rc=$?; BIN="$bin_a"
                      [ "$rc" = 0 ] || return "$rc"
                      verify_orders "$3" ;;
    warren_mapped)    run_warren "$1" "$2" "$3" WARREN_CONFIG="$MAPPED" ;;
    warren_wide)      run_warren "$1" "$2" "$3" WARREN_CONFIG="$WIDE" ;;
    warren_redis_stop)
                      REDIS_STOP_PORT=$(free_port)
                      redis-server --port "$REDIS_STOP_PORT" --bind 127.0.0.1 --daemonize yes --save "" \
                        --appendonly no --logfile "$LOGDIR/$3.redis.log" >/dev/null \
                        || { FAIL="cannot start redis-server on port $REDIS_STOP_PORT"; return 1; }
                      local port="$REDIS_STOP_PORT" rc=0
                      run_warren "$1" "$2" "$3" REDIS_URL="redis://127.0.0.1:$port/" || rc=$?
                      redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
                      REDIS_STOP_PORT=""
                      [ "$rc" = 0 ] || return 1
                      [ -z "$(redis-cli -p "$port" ping 2>/dev/null)" ] || { FAIL="the Redis of $3 was still up at the end"; return 1; }
                      printf '%s\t%s\n' "$1" "$(metric_file "$LOGDIR/$3.metrics" warren_events_dropped_total)" >>"$LOGDIR/dropped.tsv" ;;
    warren_c[0-9])    run_warren "$1" "$2" "$3" USERS_BALANCE=off USERS_BATCH_CONCURRENCY="${2#warren_c}" ;;
    warren_auto)      CURVE="$LOGDIR/$3.curve"
                      run_warren "$1" "$2" "$3" USERS_BALANCE=auto \
                        USERS_MIN_CONCURRENCY="${USERS_MIN_CONCURRENCY:-1}" USERS_MAX_CONCURRENCY="${USERS_MAX_CONCURRENCY:-4}" \
                        USERS_BALANCE_COOLDOWN_MS="${USERS_BALANCE_COOLDOWN_MS:-1000}" || { CURVE=""; return 1; }
                      CURVE="" ;;
  esac
}

say "logs in $LOGDIR"
echo "$MODE bench: N=$N messages per drain, $REPS repetitions interleaved; warren: $BIN${SETTINGS[*]:+ with ${SETTINGS[*]}}"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
busy_check() { # warns when something else holds the CPUs now (sampled over 2 s, the bench idle)
  local a b
  a=$(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat); sleep 2
  b=$(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat)
  awk -v a="$a" -v b="$b" -v cpus="$(nproc)" 'BEGIN { split(a, x, " "); split(b, y, " ")
    busy = (y[1] - x[1]) / ((y[1] - x[1]) + (y[2] - x[2]) + 1e-9)
    if (busy > 0.25) printf "bench: warning: the machine is busy (%.0f%% of %d CPUs in use before the first drain, by something else): absolute rates are lower and noisier; the ratios of one run still compare\n", busy * 100, cpus }' >&2
}
busy_check
for rep in $(seq 1 "$REPS"); do
  for place in "${!CONTENDERS[@]}"; do
    name=${CONTENDERS[$(( (place + rep - 1) % ${#CONTENDERS[@]} ))]}
    for attempt in $(seq 1 "$ATTEMPTS"); do
      tag="$name-$rep"; [ "$attempt" = 1 ] || tag="$tag-try$attempt"
      FAIL=""
      if measure "$rep" "$name" "$tag"; then break; fi
      [ "$attempt" -lt "$ATTEMPTS" ] || die "$name, repetition $rep, failed $ATTEMPTS times; the last: $FAIL"
      say "warning: $name, repetition $rep, attempt $attempt: $FAIL; measuring it again"
      purge_queues
    done
    printf 'rep %d/%d %-17s %s msg/s  (%s)\n' "$rep" "$REPS" "$name" "$(tail -1 "$RESULTS" | cut -f3)" \
      "$(sed -n 's/^published \([0-9]*\) messages in \([0-9.]*\) s.*/published \1 in \2 s/p' "$LOGDIR/$tag.publish.log")"
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo

awk -F'\t' -v reps="$REPS" -v list="${CONTENDERS[*]}" -v base="${CONTENDERS[0]}" '
  function median(list,   a, n, i, j, t) {
    n = split(list, a, " ")
    if (n == 0) return "n/a"
    for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  function spread(list,   a, n, i, lo, hi) {
    n = split(list, a, " ")
    if (n == 0) return "n/a"
    lo = hi = a[1] + 0
    for (i = 2; i <= n; i++) { if (a[i] + 0 < lo) lo = a[i] + 0; if (a[i] + 0 > hi) hi = a[i] + 0 }
    return sprintf("%.2f-%.2f", lo, hi)
  }
  function add(key, v) { if (v != "n/a" && v != "") vals[key] = vals[key] " " v }
  { rate[$1, $2] = $3; add($2 SUBSEP "rate", $3); add($2 SUBSEP "cpu", $6); add($2 SUBSEP "broker", $7)
    add($2 SUBSEP "rss", $8); add($2 SUBSEP "apb", $11); add($2 SUBSEP "db", $12); line[NR] = $0 }
  END {
    nc = split(list, names, " ")
    label["raw_drain"] = "raw drain"; label["minimal_pipeline"] = "minimal pipeline"; label["tuned_pipeline"] = "tuned pipeline"
    label["warren"] = "warren (defaults)"; label["warren_pf5000"] = "warren PREFETCH=5000"
    label["warren_mapped"] = "warren, users mapped"; label["warren_wide"] = "warren, 10 columns"
    for (i = 1; i <= 9; i++) label["warren_c" i] = "warren concurrency " i
    label["props_bare"] = "drain, bare properties"; label["props_id_ts"] = "drain, + id, timestamp"
    label["props_id"] = "drain, + message id"; label["props_ts"] = "drain, + timestamp"
    label["props_id32_ts"] = "drain, + 32-hex id, timestamp"
    label["props_warren"] = "drain, + x-published-ms"; label["props_traced"] = "drain, + traceparent"
    label["warren_b"] = "warren B (WARREN_BIN_B)"
    label["raw_drain_orders"] = "raw drain, orders"; label["warren_orders"] = "warren, orders nested"
    label["warren_orders_b"] = "warren B, orders"
    label["warren_auto"] = "warren balance=auto"; label["warren_redis_stop"] = "warren, Redis stopped"
    for (r = 1; r <= reps; r++) for (k = 1; k <= nc; k++) {
      c = names[k]
      if (rate["" r, base] > 0) add(c SUBSEP "vs_raw", rate["" r, c] / rate["" r, base])
      if (c ~ /^warren/ && rate["" r, "minimal_pipeline"] > 0) add(c SUBSEP "vs_min", rate["" r, c] / rate["" r, "minimal_pipeline"])
      if (c ~ /^warren/ && rate["" r, "tuned_pipeline"] > 0) add(c SUBSEP "vs_tuned", rate["" r, c] / rate["" r, "tuned_pipeline"])
    }
    # Balance bench: auto against the best fixed concurrency of the same repetition.
    for (r = 1; r <= reps; r++) {
      best = 0; bestc = ""
      for (k = 1; k <= nc; k++) if (names[k] ~ /^warren_c/ && rate["" r, names[k]] > best) { best = rate["" r, names[k]]; bestc = names[k] }
      if (best > 0 && rate["" r, "warren_auto"] > 0) {
        add("auto_vs_best", rate["" r, "warren_auto"] / best); bests = bests " " bestc
        per_rep = per_rep sprintf(" rep %d: %.3f of %s;", r, rate["" r, "warren_auto"] / best, bestc)
      }
    }
    print "medians over " reps " repetition(s); ratios are medians of the per-repetition ratios, (min-max) their spread"
    printf "%-22s %8s %7s %10s %11s %10s %9s %10s %11s %14s %10s %13s %11s\n", "contender", "msg/s", "vs raw", "(min-max)", "vs minimal", "(min-max)", "vs tuned", "(min-max)", "CPU us/msg", "broker us/msg", "db us/msg", "peak RSS MiB", "acks/batch"
    for (k = 1; k <= nc; k++) {
      c = names[k]
      vm = (c ~ /^warren/) ? median(vals[c SUBSEP "vs_min"]) : "-"
      if (vm != "-" && vm != "n/a") vm = sprintf("%.2f", vm)
      vt = (c ~ /^warren/) ? median(vals[c SUBSEP "vs_tuned"]) : "-"
      if (vt != "-" && vt != "n/a") vt = sprintf("%.2f", vt)
      br = median(vals[c SUBSEP "broker"]); ap = median(vals[c SUBSEP "apb"]); db = median(vals[c SUBSEP "db"])
      sr = (c == base) ? "-" : spread(vals[c SUBSEP "vs_raw"])
      sm = (vm == "-" || vm == "n/a") ? "-" : spread(vals[c SUBSEP "vs_min"])
      st = (vt == "-" || vt == "n/a") ? "-" : spread(vals[c SUBSEP "vs_tuned"])
      printf "%-22s %8.0f %7.2f %10s %11s %10s %9s %10s %11.2f %14s %10s %13.1f %11s\n", (c in label) ? label[c] : c, median(vals[c SUBSEP "rate"]),
        median(vals[c SUBSEP "vs_raw"]), sr, vm, sm, vt, st, median(vals[c SUBSEP "cpu"]),
        (br == "n/a" ? br : sprintf("%.2f", br)), (db == "n/a" ? db : sprintf("%.2f", db)),
        median(vals[c SUBSEP "rss"]), (ap == "n/a" ? ap : sprintf("%.2f", ap))
    }
    if (vals["auto_vs_best"] != "") {
      split(vals["auto_vs_best"], ab, " "); mn = 1e9; mx = 0
      for (i in ab) { if (ab[i] + 0 < mn) mn = ab[i] + 0; if (ab[i] + 0 > mx) mx = ab[i] + 0 }
      printf "\nbalance=auto against the best fixed concurrency of each repetition: median %.3f (min %.3f, max %.3f; target >= 0.95)\n", median(vals["auto_vs_best"]), mn, mx
      print " " per_rep
    }
    print ""
    print "per repetition"
    printf "%-4s %-17s %8s %8s %8s %11s %14s %10s %9s %7s %8s %11s\n", "rep", "contender", "msg/s", "drain s", "wall s", "CPU us/msg", "broker us/msg", "db us/msg", "RSS MiB", "acks", "batches", "acks/batch"
    for (i = 1; i <= NR; i++) {
      split(line[i], f, "\t")
      printf "%-4s %-17s %8s %8.2f %8.2f %11s %14s %10s %9s %7s %8s %11s\n", f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[12], f[8], f[9], f[10], f[11]
    }
  }' "$RESULTS"
if [ "$MODE" = balance ] && [ -s "$LOGDIR/rate99.tsv" ]; then
  echo
  echo "over the first 99% of each backlog (the last partial batch's wait left out; see db_rate99):"
  awk -F'\t' '{ r[$1, $2] = $3; if ($1 > reps) reps = $1 }
    END { for (k = 1; k <= reps; k++) { best = 0; bc = ""
            for (c = 1; c <= 9; c++) if (r[k, "warren_c" c] > best) { best = r[k, "warren_c" c]; bc = "warren_c" c }
            if (best > 0 && r[k, "warren_auto"] > 0)
              printf "  rep %d: auto %.0f msg/s against %.0f (%s) = %.3f\n", k, r[k, "warren_auto"], best, bc, r[k, "warren_auto"] / best } }' \
    "$LOGDIR/rate99.tsv"
fi
if [ "$MODE" = balance ]; then
  for curve in "$LOGDIR"/warren_auto-*.curve; do
    [ -f "$curve" ] || continue
    echo
    echo "concurrency of $(basename "$curve" .curve) over time (s, inserts in flight, rows inserted; a line per change):"
    awk -F'\t' '$2 != last { printf "  %6.1f s  %s  %s\n", $1, $2, $3; last = $2 } END { printf "  %6.1f s  %s  %s (last sample)\n", $1, $2, $3 }' "$curve"
  done
fi
if [ "$MODE" = redis ]; then
  echo
  echo "warren with its Redis stopped at a tenth of the drain, against warren with Redis, per repetition:"
  awk -F'\t' 'FILENAME == ARGV[1] { dropped[$1] = $2; next }
    { rate[$1, $2] = $3; if ($1 > reps) reps = $1 }
    END { for (r = 1; r <= reps; r++) if (rate[r, "warren"] > 0)
      printf "  rep %d: %.0f against %.0f msg/s = %.3f; events dropped and counted: %s\n", r, rate[r, "warren_redis_stop"],
        rate[r, "warren"], rate[r, "warren_redis_stop"] / rate[r, "warren"], (dropped[r] == "" ? "n/a" : dropped[r]) }' \
    "$LOGDIR/dropped.tsv" "$RESULTS"
fi
if [ "$MODE" = orders ]; then
  echo
  echo "orders: $N orders and $ITEMS items, $((N + ITEMS)) rows a drain (parents + children; seed $ORDERS_SEED), per repetition:"
  # Per repetition, for warren (and B): the orders' rate against the users' of the same build and
  # repetition, rows/s, PostgreSQL's CPU a row (its us/msg over the rows a message gives) and the
  # peak RSS; then the medians and the worst peak against the targets.
  awk -F'\t' -v n="$N" -v items="$ITEMS" '
    function median(list,   a, k, i, j, t) {
      k = split(list, a, " "); if (k == 0) return "n/a"
      for (i = 2; i <= k; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
      return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    function lo(list,   a, k, i, m) { k = split(list, a, " "); m = a[1] + 0; for (i = 2; i <= k; i++) if (a[i] + 0 < m) m = a[i] + 0; return m }
    function hi(list,   a, k, i, m) { k = split(list, a, " "); m = a[1] + 0; for (i = 2; i <= k; i++) if (a[i] + 0 > m) m = a[i] + 0; return m }
    { rate[$1, $2] = $3; db[$1, $2] = $12; rss[$1, $2] = $8; if ($1 > reps) reps = $1 }
    END {
      rows = (n + items) / n
      nb = split("warren_orders:warren:warren_orders_b:warren_b", pairs, ":")
      for (b = 1; b <= nb; b += 2) {
        o = pairs[b]; u = pairs[b + 1]; who = (b == 1 ? "warren" : "warren B")
        ratios = ""; rates = ""; rps = ""; pgrow = ""; upg = ""; peak = ""; seen = 0
        for (r = 1; r <= reps; r++) {
          if (rate[r, o] == "" || rate[r, u] == "") continue
          seen = 1
          ratio = rate[r, o] / rate[r, u]; ratios = ratios " " ratio; rates = rates " " rate[r, o]
          rps = rps " " rate[r, o] * rows; peak = peak " " rss[r, o]
          pr = (db[r, o] == "n/a" ? "n/a" : sprintf("%.2f", db[r, o] / rows)); if (pr != "n/a") pgrow = pgrow " " pr
          if (db[r, u] != "n/a") upg = upg " " db[r, u]
          printf "  rep %d %-9s %6.0f msg/s = %.2f of its users (%.0f msg/s), %7.0f rows/s, raw drain of the orders %s msg/s; PostgreSQL %s us/row (users %s); peak RSS %.1f MiB\n", \
            r, who, rate[r, o], ratio, rate[r, u], rate[r, o] * rows, (rate[r, "raw_drain_orders"] == "" ? "n/a" : rate[r, "raw_drain_orders"]), \
            pr, db[r, u], rss[r, o]
        }
        if (!seen) continue
        printf "%s, medians over %d repetition(s): %.0f msg/s = %.2f (%.2f-%.2f) of the users pipeline (target >= 0.75), %.0f rows/s, PostgreSQL %s us/row (users %s us/row); peak RSS at most %.1f MiB (target <= 32)\n", \
          who, reps, median(rates), median(ratios), lo(ratios), hi(ratios), median(rps), \
          (pgrow == "" ? "n/a" : sprintf("%.2f", median(pgrow))), (upg == "" ? "n/a" : sprintf("%.2f", median(upg))), hi(peak)
      }
    }' "$RESULTS"
fi
if [ "$MODE" = props ]; then
  echo
  echo "taking the backlog in (publish_props with confirms), medians over the repetitions:"
  awk -F'\t' '{ b[$2] = b[$2] " " $3; r[$2] = r[$2] " " $4; if (!($2 in seen)) { seen[$2] = 1; order[++n] = $2 } }
    function median(list,   a, k, i, j, t) {
      k = split(list, a, " "); if (k == 0) return "n/a"
      for (i = 2; i <= k; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
      return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    END { printf "  %-14s %16s %14s\n", "properties", "broker us/msg", "publish msg/s"
      for (i = 1; i <= n; i++) printf "  %-14s %16s %14.0f\n", order[i], median(b[order[i]]), median(r[order[i]]) }' "$LOGDIR/publish.tsv"
fi
