#!/usr/bin/env bash
# The GPU swap an operator does by hand, scripted: what gpuswapd replaces (the baseline of
# tests/benchmarks/swap_bench.py).
#
#   naive_swap.sh open    pause the agent timers, stop the resident (llama-swap goes with strata),
#                         watch nvidia-smi until the VRAM is free, `docker run -d` the engine,
#                         curl its /health every second, warm it and check it answers with curl
#   naive_swap.sh close   docker stop/rm the engine, watch nvidia-smi until the VRAM is free,
#                         start llama-swap (it pulls strata in), curl a completion through it every
#                         second until one answers, start the paused timers again
#
# The test world's systemd is reached only through DBUS_SYSTEM_BUS_ADDRESS (systemctl cannot reach
# it), so `systemctl stop|start` is done the way systemctl does it: a StopUnit/StartUnit call over
# busctl, then waiting until the unit has left or reached "active".
# Environment: `python -m tests.stack env` (bus, DOCKER_HOST, PATH with the fake nvidia-smi), and
# GPU_DIR (the ledger directory) and ENV_FILE (the engine's environment); the rest has defaults.
set -euo pipefail

ENGINE_PORT=${ENGINE_PORT:-18020}
PROXY_PORT=${PROXY_PORT:-8090}
IMAGE=${IMAGE:-hyperqwen-sim:latest}
NAME=${NAME:-hyperqwen}
GPU_DIR=${GPU_DIR:?set GPU_DIR to the ledger directory}
ENV_FILE=${ENV_FILE:?set ENV_FILE to the engine environment file}
TIMERS_FILE=${TIMERS_FILE:-/var/tmp/gpuswapd-bench/naive-timers}
WINDOW_NEEDS_MIB=${WINDOW_NEEDS_MIB:-21504}
RESIDENT_NEEDS_MIB=${RESIDENT_NEEDS_MIB:-22528}
WARMUPS=${WARMUPS:-2}

manager() {  # METHOD ARGS...: one call on systemd's manager object
    busctl --system call org.freedesktop.systemd1 /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager "$@"
}

active_state() {
    local path
    path=$(manager LoadUnit s "$1" | cut -d'"' -f2)
    busctl --system get-property org.freedesktop.systemd1 "$path" org.freedesktop.systemd1.Unit ActiveState | cut -d'"' -f2
}

systemctl_stop() {  # like `systemctl stop UNIT...`: back once each is inactive
    local unit
    for unit in "$@"; do manager StopUnit ss "$unit" replace >/dev/null; done
    for unit in "$@"; do
        until [[ $(active_state "$unit") =~ ^(inactive|failed)$ ]]; do sleep 0.05; done
    done
}

systemctl_start() {  # like `systemctl start UNIT...`: back once each is active
    local unit
    for unit in "$@"; do manager StartUnit ss "$unit" replace >/dev/null; done
    for unit in "$@"; do
        until [[ $(active_state "$unit") == active ]]; do sleep 0.05; done
    done
}

free_mib() {
    nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1 | tr -d ' '
}

wait_free() {  # MIB: what an operator does with `watch -n1 nvidia-smi`
    until (( $(free_mib) >= $1 )); do sleep 1; done
}

answers() {  # URL MODEL PROMPT MAX_TOKENS: one streamed completion that carries answer text
    local body out
    body=$(printf '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}' "$2" "$3" "$4")
    out=$(curl -sfN --max-time 60 -H 'Content-Type: application/json' -d "$body" "$1") || return 1
    grep -q '"content":"[^"]' <<<"$out"
}

open_window() {
    manager ListUnitsByPatterns asas 1 active 1 'agent-*.timer' --json=short \
        | jq -r '.data[0][][0]' >"$TIMERS_FILE"
    # shellcheck disable=SC2046
    systemctl_stop $(cat "$TIMERS_FILE")
    systemctl_stop strata.service llama-swap.service
    wait_free "$WINDOW_NEEDS_MIB"
    docker run -d --name "$NAME" --network host -v /usr:/usr:ro -v "$GPU_DIR:/gpu" --env-file "$ENV_FILE" \
        "$IMAGE" >/dev/null
    until curl -sf -o /dev/null "http://127.0.0.1:$ENGINE_PORT/health"; do sleep 1; done
    local url="http://127.0.0.1:$ENGINE_PORT/v1/chat/completions" n
    for ((n = 0; n < WARMUPS; n++)); do answers "$url" hyperqwen "Write a haiku about GPUs." 64; done
    answers "$url" hyperqwen "Reply with the single word: ready" 64
}

close_window() {
    docker stop -t 10 "$NAME" >/dev/null
    docker rm "$NAME" >/dev/null
    wait_free "$RESIDENT_NEEDS_MIB"
    systemctl_start llama-swap.service
    until answers "http://127.0.0.1:$PROXY_PORT/v1/chat/completions" strata "Reply with the single word: ready" 16; do
        sleep 1
    done
    # shellcheck disable=SC2046
    systemctl_start $(cat "$TIMERS_FILE")
}

case "${1:-}" in
    open) open_window ;;
    close) close_window ;;
    *) echo "usage: naive_swap.sh open|close" >&2; exit 2 ;;
esac
