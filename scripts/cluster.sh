#!/usr/bin/env bash
# A 3-node RabbitMQ cluster on this machine for warren's cluster tests, made of the installed
# RabbitMQ and started beside the system's own node (5672, left alone): nodes
# warren-rc1..3@localhost, AMQP on 127.0.0.1:5681..5683, Erlang distribution on
# 127.0.0.1:25681..25683, no plugins. Configuration, data and logs live under WARREN_CLUSTER_DIR
# (default /var/lib/rabbitmq/warren-cluster), owned by the rabbitmq user; the nodes run as that
# user and share its Erlang cookie. Run as root or with sudo.
#   up              start the nodes that are not running, join rc2 and rc3 to rc1, wait until all
#                   3 run as one cluster. Idempotent: a node that was killed (kill -9) is started
#                   again and rejoins; a node that lost its data is reset and joined again
#   status          each node's ports, pid and state, then the cluster's running nodes; exits 0
#                   when all 3 run as one cluster, 1 otherwise
#   down [--purge]  stop the nodes; --purge also removes WARREN_CLUSTER_DIR, so the next up starts
#                   from nothing
#   urls            the AMQP URLs of the 3 nodes, comma-separated (WARREN_TEST_CLUSTER_URLS)
set -euo pipefail

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
usage() { die "usage: scripts/cluster.sh up | status | down [--purge] | urls"; }

DIR="${WARREN_CLUSTER_DIR:-/var/lib/rabbitmq/warren-cluster}"
NODES=(1 2 3)
name() { echo "warren-rc$1@localhost"; }
amqp_port() { echo $((5680 + $1)); }
dist_port() { echo $((25680 + $1)); }
SEED="$(name 1)"
# Quorum queues: how long the dead-letter worker (at-least-once dead-lettering) waits for the
# publisher confirm of a dead-lettered message before it sends it again. RabbitMQ's default is
# 180000 ms; the tests should not wait 3 minutes for a retry.
DLX_CONFIRM_TIMEOUT_MS=5000
# Every node and every rabbitmqctl keeps its Erlang distribution on loopback; one scheduler per
# node, since 3 test nodes share this machine's cores with the system node and the builds.
LOOPBACK_DIST="-kernel inet_dist_use_interface {127,0,0,1}"
SERVER_ERL_ARGS="+S 1:1 $LOOPBACK_DIST"

urls() {
  local u=() i
  for i in "${NODES[@]}"; do u+=("amqp://guest:guest@127.0.0.1:$(amqp_port "$i")/%2f"); done
  (IFS=,; echo "${u[*]}")
}

case "${1:-}" in
  up|status|urls) [ $# -eq 1 ] || usage ;;
  down) [ $# -eq 1 ] || { [ $# -eq 2 ] && [ "$2" = --purge ]; } || usage ;;
  *) usage ;;
esac
if [ "$1" = urls ]; then urls; exit 0; fi

# --- the installed RabbitMQ, its user and cookie -----------------------------------------------
RABBIT_BIN=/usr/lib/rabbitmq/bin   # Debian's real scripts; /usr/sbin has wrappers around them
if [ ! -x "$RABBIT_BIN/rabbitmq-server" ]; then
  s="$(PATH="$PATH:/usr/sbin:/usr/local/sbin" command -v rabbitmq-server)" \
    || die "RabbitMQ is not installed: run scripts/setup.sh first"
  RABBIT_BIN="$(dirname "$(readlink -f "$s")")"
fi
RMQ_HOME="$(getent passwd rabbitmq | cut -d: -f6)" || die "there is no rabbitmq user: run scripts/setup.sh first"
[ "$(getent ahostsv4 localhost | awk 'NR==1 {print $1}')" = 127.0.0.1 ] \
  || die "localhost does not resolve to 127.0.0.1: add '127.0.0.1 localhost' to /etc/hosts"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
as_rabbitmq() { # command...: run as the rabbitmq user, whose home holds the Erlang cookie
  if [ "$(id -un)" = rabbitmq ]; then "$@"
  elif [ "$(id -u)" = 0 ]; then runuser -u rabbitmq -- "$@"
  else sudo -u rabbitmq -- "$@"; fi
}

# The nodes read this file instead of /etc/rabbitmq/rabbitmq-env.conf, and their own conf.d
# (empty) instead of /etc/rabbitmq/conf.d, so nothing meant for the system node (its NODENAME,
# its listeners) reaches them; all they need is in node_env and the files write_files writes.
ENV_FILE="$DIR/rabbitmq-env.conf"
node_env() { # i: sets NODE_ENV to node i's environment, for env(1)
  local d="$DIR/rc$1"
  NODE_ENV=(HOME="$RMQ_HOME" RABBITMQ_CONF_ENV_FILE="$ENV_FILE"
    RABBITMQ_NODENAME="$(name "$1")" RABBITMQ_USE_LONGNAME=false
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$(amqp_port "$1")"
    RABBITMQ_DIST_PORT="$(dist_port "$1")" ERL_EPMD_ADDRESS=127.0.0.1
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config"
    RABBITMQ_CONFIG_FILES="$d/conf.d/*.conf"
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins"
    RABBITMQ_MNESIA_BASE="$d/mnesia" RABBITMQ_LOG_BASE="$d/log"
    RABBITMQ_PID_FILE="$(pid_file "$1")"
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="$SERVER_ERL_ARGS")
}
pid_file() { echo "$DIR/rc$1/mnesia/$(name "$1").pid"; }
log_file() { echo "$DIR/rc$1/log/$(name "$1").log"; }

cli() { # tool node command [args...]: a RabbitMQ CLI tool against one node
  local tool="$1" node="$2"; shift 2
  (cd / && as_rabbitmq env HOME="$RMQ_HOME" RABBITMQ_CONF_ENV_FILE="$ENV_FILE" \
    RABBITMQ_CTL_ERL_ARGS="$LOOPBACK_DIST" ERL_EPMD_ADDRESS=127.0.0.1 \
    "$RABBIT_BIN/$tool" -q -n "$node" "$@")
}
ctl() { cli rabbitmqctl "$@"; }
quiet() { # command...: run it, show its output only if it fails
  local out
  out="$("$@" 2>&1)" || { printf '%s\n' "$out" >&2; return 1; }
}
eval_on() { ctl "$1" eval "$2" 2>/dev/null | tr -d '"'; }   # node expression: its value, printed

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
vm_up() { port_open "$(dist_port "$1")"; }     # the Erlang VM listens for distribution
app_up() { port_open "$(amqp_port "$1")"; }    # RabbitMQ has booted and opened its AMQP listener
node_pid() { # i: the node's OS pid, if that process is alive and is this node
  local p
  p="$(cat "$(pid_file "$1")" 2>/dev/null)" || return 1
  # after a kill -9 the pid file stays and its pid may be reused: ask the process who it is
  [ -n "$p" ] && as_rabbitmq cat "/proc/$p/environ" 2>/dev/null | tr '\0' '\n' \
    | grep -qx "RABBITMQ_NODENAME=$(name "$1")" && echo "$p"
}
running_nodes() { # node: the cluster's running nodes as that node sees them, sorted, one a line
  eval_on "$1" 'lists:flatten(lists:join(" ", [atom_to_list(N) || N <- lists:sort(rabbit_mnesia:cluster_nodes(running))])).' \
    | tr ' ' '\n' | grep . || true
}
complete() { # are all 3 nodes running, clustered with the seed?
  local want got
  want="$(for i in "${NODES[@]}"; do name "$i"; done)"
  got="$(running_nodes "$SEED")"
  [ "$got" = "$want" ]
}

# --- up ------------------------------------------------------------------------------------------
write_files() { # configuration, rewritten on every up so that the next start of a node reads it
  $SUDO install -d -o rabbitmq -g rabbitmq -m 755 "$DIR"
  as_rabbitmq touch "$DIR/.warren-cluster"   # down --purge removes only a directory marked so
  printf '%s\n' "# scripts/cluster.sh: the test nodes read this file instead of" \
    "# /etc/rabbitmq/rabbitmq-env.conf; their settings are in their environment." \
    | as_rabbitmq tee "$ENV_FILE" >/dev/null
  echo '[].' | as_rabbitmq tee "$DIR/enabled_plugins" >/dev/null
  local i d
  for i in "${NODES[@]}"; do
    d="$DIR/rc$i"
    as_rabbitmq mkdir -p "$d/mnesia" "$d/log"
    printf '%s\n' "# $(name "$i"), written by scripts/cluster.sh on every up" \
      "listeners.tcp.default = 127.0.0.1:$(amqp_port "$i")" \
      "loopback_users.guest = true" \
      "log.file.level = info" \
      | as_rabbitmq tee "$d/rabbitmq.conf" >/dev/null
    printf '%s\n' "%% $(name "$i"), written by scripts/cluster.sh on every up: what rabbitmq.conf has no key for" \
      "[{rabbit, [" \
      "  %% quorum queues: the dead-letter worker sends a message again when its confirm has not" \
      "  %% come within this many ms (RabbitMQ's default: 180000)" \
      "  {dead_letter_worker_publisher_confirm_timeout, $DLX_CONFIRM_TIMEOUT_MS}" \
      "]}]." \
      | as_rabbitmq tee "$d/advanced.config" >/dev/null
  done
}

LOG_FROM=()   # per node: the size of its log when up started it, to show what this start logged
start_node() { # i: start the node in the background (the VM detaches itself)
  log "starting $(name "$1")"
  node_env "$1"
  LOG_FROM[$1]="$(stat -c %s "$(log_file "$1")" 2>/dev/null || echo 0)"
  # a kill -9 leaves the pid file behind; remove it so no one reads a dead pid as the node's
  as_rabbitmq rm -f "$(pid_file "$1")"
  # 9<&-: the node must not inherit (and hold for its lifetime) the lock taken below
  (cd "$DIR/rc$1" && as_rabbitmq env "${NODE_ENV[@]}" "$RABBIT_BIN/rabbitmq-server" -detached 9<&-)
}

await_node() { # i: wait until RabbitMQ runs on the node (the VM may still be coming up)
  local n; n="$(name "$1")"
  for _ in $(seq 1 60); do vm_up "$1" && break; sleep 1; done
  if vm_up "$1" && ! app_up "$1" \
      && [ "$(eval_on "$n" 'rabbit:is_running() orelse rabbit:is_booting().')" = false ]; then
    # the VM runs but RabbitMQ was stopped in it (an up cut short between stop_app and start_app)
    log "$n: RabbitMQ is stopped in a running VM; starting it"
    ctl "$n" start_app
  fi
  if ! ctl "$n" await_startup --timeout 180; then
    log "$n did not start; the first errors it logged ($(log_file "$1")):"
    tail -c +"$((${LOG_FROM[$1]:-0} + 1))" "$(log_file "$1")" 2>/dev/null \
      | grep -F '[error]' | head -n 15 | cut -c 1-240 >&2 || true
    return 1
  fi
}

join_node() { # i: make the node a member of the seed's cluster, if it is not one already
  local n; n="$(name "$1")"
  if running_nodes "$n" | grep -qx "$SEED"; then return 0; fi
  log "joining $n to $SEED"
  quiet ctl "$n" stop_app
  if ! quiet ctl "$n" join_cluster "$SEED" 2>/dev/null; then
    # The seed remembers an earlier life of this node (whose data was removed), or the node
    # remembers another cluster: forget the old membership, reset the node and join again.
    log "$n: the seed knew an earlier $n; forgetting that one, resetting $n and joining again"
    ctl "$SEED" forget_cluster_node "$n" >/dev/null 2>&1 || true
    quiet ctl "$n" reset
    quiet ctl "$n" join_cluster "$SEED"
  fi
  quiet ctl "$n" start_app
  quiet ctl "$n" await_startup --timeout 180
  # quorum queues declared while the node was out (or that lost it when it was forgotten) get
  # their member on it back; a fresh cluster has none
  quiet cli rabbitmq-queues "$SEED" grow "$n" all
}

up() {
  write_files
  local i all_up=1
  for i in "${NODES[@]}"; do app_up "$i" || all_up=""; done
  if [ -n "$all_up" ] && complete; then
    log "already up: $(urls)"
    return 0
  fi
  # Start every stopped node before waiting for any: after all of them stopped, each waits at
  # boot for the others it was clustered with.
  for i in "${NODES[@]}"; do
    if ! vm_up "$i" && app_up "$i"; then
      die "port $(amqp_port "$i") of $(name "$i") is taken by another process: $(ss -ltnpH "sport = :$(amqp_port "$i")" 2>/dev/null)"
    fi
  done
  for i in "${NODES[@]}"; do vm_up "$i" || start_node "$i"; done
  for i in "${NODES[@]}"; do await_node "$i"; done
  for i in "${NODES[@]}"; do [ "$(name "$i")" = "$SEED" ] || join_node "$i"; done
  complete || die "the cluster did not form; running on $SEED: $(running_nodes "$SEED" | paste -sd ' ')"
  log "up: $(running_nodes "$SEED" | paste -sd ' ')"
  log "AMQP: $(urls)"
}

# --- status --------------------------------------------------------------------------------------
status() {
  local i state pid seen=""
  printf '%-22s %-16s %-17s %-8s %s\n' NODE AMQP DISTRIBUTION PID STATE
  for i in "${NODES[@]}"; do
    if app_up "$i"; then state=running; seen="${seen:-$(name "$i")}"
    elif vm_up "$i"; then state="booting, or RabbitMQ stopped in its VM"
    else state=stopped; fi
    pid="$(node_pid "$i")" || pid=-
    printf '%-22s %-16s %-17s %-8s %s\n' "$(name "$i")" "127.0.0.1:$(amqp_port "$i")" \
      "127.0.0.1:$(dist_port "$i")" "$pid" "$state"
  done
  echo "data and logs: $DIR"
  [ -n "$seen" ] || { echo "cluster: down"; return 1; }
  echo "running cluster nodes (as $seen sees them): $(running_nodes "$seen" | paste -sd ' ')"
  complete
}

# --- down ----------------------------------------------------------------------------------------
stop_node() { # i: stop the node, by rabbitmqctl or else by signal
  local n pid; n="$(name "$1")"
  pid="$(node_pid "$1")" || pid=""
  if ! vm_up "$1" && [ -z "$pid" ]; then return 0; fi
  log "stopping $n"
  # given the pid file, stop returns once the OS process has exited
  local args=(stop); [ -z "$pid" ] || args+=("$(pid_file "$1")")
  if ! ctl "$n" "${args[@]}" >/dev/null 2>&1 && [ -n "$pid" ]; then
    log "$n did not stop on request; sending TERM to $pid"
    $SUDO kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do node_pid "$1" >/dev/null || break; sleep 1; done
    if node_pid "$1" >/dev/null; then $SUDO kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  for _ in $(seq 1 30); do vm_up "$1" || return 0; sleep 1; done
  log "$n still listens on $(dist_port "$1")"; return 1
}

down() {
  local i pids=() failed=""
  for i in "${NODES[@]}"; do stop_node "$i" & pids+=($!); done
  for i in "${pids[@]}"; do wait "$i" || failed=1; done
  [ -z "$failed" ] || die "a node did not stop; see scripts/cluster.sh status"
  if [ "${1:-}" = --purge ] && [ -d "$DIR" ]; then
    [ -f "$DIR/.warren-cluster" ] || die "$DIR was not made by this script; not removing it"
    log "removing $DIR"
    $SUDO rm -rf -- "$DIR"
  fi
  log "down"
}

# one up or down at a time (two test runs started together would both start nodes)
LOCK="${TMPDIR:-/tmp}/warren-cluster.lock"
if [ "$1" != status ] && command -v flock >/dev/null; then
  : >>"$LOCK" 2>/dev/null || true
  exec 9<"$LOCK"
  flock 9
fi
case "$1" in
  up) up ;;
  status) status ;;
  down) down "${2:-}" ;;
esac
