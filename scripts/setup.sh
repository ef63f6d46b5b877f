#!/usr/bin/env bash
# Brings up RabbitMQ, PostgreSQL and Redis on localhost for warren, on Debian or Ubuntu:
# installs them with apt-get if missing, starts them if stopped, creates the `warren` role and
# database. Idempotent: whatever is already done is left alone. Run as root or with sudo.
#   --with-promtool   also install what the tests need beyond the servers: Debian's prometheus
#                     package (`promtool`, `prometheus`) and, if missing, systemd's
#                     `systemd-analyze` (the unit checks of tests/deploy.rs), and podman,
#                     buildah and runc (the image and Kubernetes tests)
set -euo pipefail
WITH_PROMTOOL=""
for arg in "$@"; do
  case "$arg" in
    --with-promtool) WITH_PROMTOOL=1 ;;
    *) echo "setup: unknown argument $arg" >&2; exit 2 ;;
  esac
done

log() { printf 'setup: %s\n' "$*" >&2; }
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # name port seconds
  for _ in $(seq 1 "$3"); do port_open "$2" && return 0; sleep 1; done
  log "$1 did not open port $2 within $3 s"; return 1
}
have_systemd() { [ -d /run/systemd/system ]; }

APT_UPDATED=""
install_pkg() { # package [package...]
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ -z "$APT_UPDATED" ]; then $SUDO apt-get update -qq; APT_UPDATED=1; fi
  log "installing ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# --- PostgreSQL -------------------------------------------------------------------------------
install_pkg postgresql postgresql-client
if ! port_open 5432; then
  log "starting PostgreSQL"
  if have_systemd; then $SUDO systemctl start postgresql
  else
    for v in $(ls /etc/postgresql); do $SUDO pg_ctlcluster --skip-systemctl-redirect "$v" main start || true; done
  fi
  wait_port PostgreSQL 5432 60
fi
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi; }
psql_admin() { (cd / && as_postgres psql -v ON_ERROR_STOP=1 -qtA "$@"); }
if [ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = 'warren'")" != 1 ]; then
  log "creating role warren"
  psql_admin -c "CREATE ROLE warren LOGIN PASSWORD 'warren' CREATEDB"
fi
if [ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = 'warren'")" != 1 ]; then
  log "creating database warren"
  psql_admin -c "CREATE DATABASE warren OWNER warren"
fi

# --- RabbitMQ ---------------------------------------------------------------------------------
install_pkg rabbitmq-server
if ! port_open 5672; then
  log "starting RabbitMQ"
  if have_systemd; then $SUDO systemctl start rabbitmq-server
  else $SUDO rabbitmq-server -detached; fi
  wait_port RabbitMQ 5672 120
fi

# --- Redis ------------------------------------------------------------------------------------
install_pkg redis-server
if ! port_open 6379; then
  log "starting Redis"
  if have_systemd; then $SUDO systemctl start redis-server
  else $SUDO redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no; fi
  wait_port Redis 6379 30
fi

# --- test tools: promtool and prometheus, systemd-analyze (tests only) ----------------------
if [ -n "$WITH_PROMTOOL" ]; then
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    install_pkg prometheus
  fi
  if ! command -v systemd-analyze >/dev/null; then
    install_pkg systemd
  fi
  # The container image and the Kubernetes manifests (tests/image.rs, tests/kube.rs).
  if ! command -v podman >/dev/null || ! command -v buildah >/dev/null; then
    install_pkg podman buildah runc
  fi
fi

log "RabbitMQ :5672, PostgreSQL :5432 (role and database warren), Redis :6379 are up"
