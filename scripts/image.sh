#!/usr/bin/env bash
# Builds warren's container image, localhost/warren:<version> and localhost/warren:latest, from a
# warren binary (the release build by default, built if missing), with podman (buildah) or
# docker. Nothing is pulled: the image is assembled FROM scratch out of the binary, the shared
# libraries it links (as `ldd` names them), the CA bundle (for amqps://), an /etc/passwd with the
# user warren (65532) and the commented defaults (deploy/container/Containerfile).
#
#   scripts/image.sh [--bin PATH] [--revision REV] [--tag NAME] [--engine podman|docker]
#     --bin PATH     the binary to package (default target/release/warren)
#     --revision REV the source revision the binary was built from, for the image's
#                    org.opencontainers.image.revision label (default: this checkout's commit
#                    when the binary is its release build; with --bin, no label unless given)
#     --tag NAME     the image name (default localhost/warren); tagged :<version> and :latest
#     --engine E     podman or docker (default: podman if installed, else docker)
#
# Prints the image's name:version on stdout as its last line.
set -euo pipefail
# Paths given on the command line are the caller's: resolve them before moving to the checkout.
CALLER_DIR="$PWD"
cd "$(dirname "$0")/.."

BIN=""
REVISION=""
NAME="localhost/warren"
ENGINE=""
log() { printf 'image: %s\n' "$*" >&2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bin|--tag|--engine|--revision)
      [ $# -ge 2 ] || { log "$1 needs a value (expected --bin PATH, --revision REV, --tag NAME, --engine podman|docker)"; exit 2; } ;;
  esac
  case "$1" in
    --bin) case "$2" in /*) BIN="$2" ;; *) BIN="$CALLER_DIR/$2" ;; esac; shift 2 ;;
    --revision) REVISION="$2"; shift 2 ;;
    --tag) NAME="$2"; shift 2 ;;
    --engine) ENGINE="$2"; shift 2 ;;
    *) log "unknown argument $1 (expected --bin PATH, --revision REV, --tag NAME, --engine podman|docker)"; exit 2 ;;
  esac
done
# --tag names the image, the script adds the tags (:<version> and :latest): a tag or a digest
# given with it would make "NAME:1.0:0.1.0", which the engine refuses with a message about a
# reference format. A registry's port (registry.example:5000/warren) is part of the name.
BASE="${NAME##*/}"
case "$BASE" in
  *:*|*@*) log "--tag $NAME: give the image's name without a tag or digest (here ${NAME%"$BASE"}${BASE%%[:@]*}); the script tags it :<version> and :latest itself"; exit 2 ;;
esac
[ -n "$NAME" ] && [ -n "${NAME##*/}" ] || { log "--tag '$NAME': expected an image name such as localhost/warren"; exit 2; }
# An image's repository is lower case, which the engine would say only after the build, in its
# own words. The first part is a registry (whose host may have capitals) when it holds a dot or
# a colon or is localhost, as the engines read a reference.
FIRST="${NAME%%/*}"; REPO_PART="$NAME"; HOST_PART=""
if [ "$FIRST" != "$NAME" ] && { [[ "$FIRST" == *[.:]* ]] || [ "$FIRST" = localhost ]; }; then
  HOST_PART="$FIRST/"; REPO_PART="${NAME#*/}"
fi
case "$REPO_PART" in
  *[A-Z]*) log "--tag $NAME: an image's repository must be lower case (here $HOST_PART$(printf '%s' "$REPO_PART" | tr 'A-Z' 'a-z'))"; exit 2 ;;
esac
# What the image carries besides the binary, from this checkout.
for f in config/default.toml LICENSE-MIT LICENSE-APACHE deploy/container/Containerfile; do
  [ -f "$f" ] || { log "$f is missing from $(pwd): the image carries it (the licences and the commented defaults under /usr/share/doc/warren/); run this script from a complete checkout of warren"; exit 1; }
done

if [ -z "$ENGINE" ]; then
  if command -v podman >/dev/null; then ENGINE=podman
  elif command -v docker >/dev/null; then ENGINE=docker
  else log "neither podman nor docker is installed (Debian: apt-get install podman buildah runc)"; exit 1; fi
fi
case "$ENGINE" in podman|docker) ;; *) log "--engine: expected podman or docker, got $ENGINE"; exit 2 ;; esac

if [ -z "$BIN" ]; then
  # This checkout's release build: its commit is the image's revision (unless given).
  [ -n "$REVISION" ] || REVISION="$(git rev-parse HEAD 2>/dev/null || true)"
  BIN=target/release/warren
  if [ ! -x "$BIN" ]; then
    log "building the release binary (cargo build --release --locked)"
    cargo build --release --locked >&2
  fi
fi
[ -x "$BIN" ] || { log "--bin: $BIN is not an executable file"; exit 2; }
# `warren --version` prints "warren 0.1.0": anything else is not warren.
read -r PROGRAM VERSION _ < <("$BIN" --version 2>/dev/null || true) || true
if [ "${PROGRAM:-}" != warren ] || ! [[ "${VERSION:-}" =~ ^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.-]+)?$ ]]; then
  log "--bin: $BIN is not a warren binary (\`$BIN --version\` should print \"warren <version>\")"; exit 2
fi

CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
ROOT="$CTX/rootfs"
mkdir -p "$ROOT/usr/local/bin" "$ROOT/etc/warren" "$ROOT/etc/ssl/certs" "$ROOT/tmp"
install -m 0755 "$BIN" "$ROOT/usr/local/bin/warren"
# The dynamic loader and every library the binary links, at the paths the binary asks for.
for lib in $(ldd "$BIN" | awk '/=> \// {print $3} /^\s*\/[^ ]+ \(/ {print $1}'); do
  mkdir -p "$ROOT$(dirname "$lib")"
  cp -L "$lib" "$ROOT$lib"
done
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
else
  log "no /etc/ssl/certs/ca-certificates.crt on this host: the image can reach amqps:// brokers only with a CA bundle mounted there"
fi
printf 'root:x:0:0:root:/root:/sbin/nologin\nwarren:x:65532:65532:warren:/nonexistent:/sbin/nologin\n' >"$ROOT/etc/passwd"
printf 'root:x:0:\nwarren:x:65532:\n' >"$ROOT/etc/group"
chmod 1777 "$ROOT/tmp"
# The defaults are built into the binary (`warren config` prints them); the commented file is
# there to read. A deployment mounts its pipelines file (for example at /etc/warren/) and names
# it with WARREN_CONFIG; settings come from the environment.
mkdir -p "$ROOT/usr/share/doc/warren"
install -m 0644 config/default.toml LICENSE-MIT LICENSE-APACHE "$ROOT/usr/share/doc/warren/"
cp deploy/container/Containerfile "$CTX/Containerfile"

# A binary given with --bin may come from another revision than this checkout's: the label
# says only what the caller says (review R38j F3: it named the checkout's commit).
REVISION_LABEL=()
if [ -n "$REVISION" ]; then
  REVISION_LABEL=(--label "org.opencontainers.image.revision=$REVISION")
else
  log "no org.opencontainers.image.revision label: give --revision REV for the revision $BIN was built from"
fi
# Where the source is: SOURCE_URL, else the checkout's origin remote (a label needs a URL).
SOURCE="${SOURCE_URL:-$(git remote get-url origin 2>/dev/null || true)}"
SOURCE_LABEL=()
if [ -n "$SOURCE" ]; then SOURCE_LABEL=(--label "org.opencontainers.image.source=$SOURCE"); fi
log "building $NAME:$VERSION with $ENGINE from $BIN"
"$ENGINE" build --quiet -f "$CTX/Containerfile" \
  --label "org.opencontainers.image.title=warren" \
  --label "org.opencontainers.image.description=Moves RabbitMQ messages into PostgreSQL through a supervised, batched pipeline" \
  --label "org.opencontainers.image.version=$VERSION" \
  "${REVISION_LABEL[@]}" \
  "${SOURCE_LABEL[@]}" \
  --label "org.opencontainers.image.licenses=MIT OR Apache-2.0" \
  -t "$NAME:$VERSION" -t "$NAME:latest" "$CTX" >&2
SIZE="$("$ENGINE" image inspect --format '{{.Size}}' "$NAME:$VERSION")"
log "$NAME:$VERSION, $((SIZE / 1000000)) MB"
echo "$NAME:$VERSION"
