#!/usr/bin/env bash
# Soak: one segserve server (SSD tier on, RAM bank capped) under repeated multi-turn
# `segserve loadtest` rounds; the server's RSS is sampled every 20 s, with the memory and
# bank-bytes series of /metrics beside it (what MLX holds vs what the bank accounts for).
# Conversations name themselves (X-Session-Id), so every stored turn can be counted: after the
# load the session list is saved, the server is stopped with SIGTERM and started again on the
# same bank directory, and the list is saved again (nothing committed may be missing).
# Usage: bench/soak.sh MINUTES OUT_DIR
#   writes OUT_DIR/rss.csv, OUT_DIR/memory.log (elapsed_s then the metric lines),
#   OUT_DIR/round-N.json, OUT_DIR/idle.txt (/metrics memory once the load has stopped),
#   OUT_DIR/sessions-before.json and sessions-after.json (GET /v1/sessions around a restart)
set -euo pipefail
minutes=${1:-30}; out=${2:-bench/out/soak}
mkdir -p "$out"; bank=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_server() {  # $1: log file
  .venv/bin/segserve serve --port "$port" --bank-dir "$bank" --bank-max-bytes 512MB > "$1" 2>&1 &
  srv=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 $srv 2>/dev/null || { echo "server exited: see $1" >&2; exit 1; }; sleep 2; done
}
start_server "$out/server.log"
trap 'kill -TERM $srv 2>/dev/null; wait $srv 2>/dev/null; rm -rf "$bank"' EXIT
echo "elapsed_s,rss_kib" > "$out/rss.csv"
start=$(date +%s)
( while kill -0 $srv 2>/dev/null; do
    t=$(( $(date +%s) - start ))
    echo "$t,$(awk '/VmRSS/ {print $2}' /proc/$srv/status)" >> "$out/rss.csv"
    { echo "# $t"; curl -s -m 10 "http://127.0.0.1:$port/metrics" | grep -E '^segserve_(memory|bank_bytes|kv_bytes)' || true; } >> "$out/memory.log"
    sleep 20; done ) &
round=0
while [ $(( $(date +%s) - start )) -lt $(( minutes * 60 )) ]; do
  round=$((round + 1))
  left=$(( minutes * 60 - ($(date +%s) - start) ))
  .venv/bin/segserve loadtest --url "http://127.0.0.1:$port" --users 4 --turns 8 \
    --words-per-turn 150 --max-tokens 32 --seed "$round" --conversation session --max-seconds "$(( left < 300 ? left : 300 ))" \
    --json > "$out/round-$round.json" || true
done
sleep 30  # the load has stopped: what stays is what the server keeps
{ echo "# idle"; curl -s -m 10 "http://127.0.0.1:$port/metrics" | grep -E '^segserve_(memory|bank_bytes|kv_bytes)' || true
  echo "rss_kib $(awk '/VmRSS/ {print $2}' /proc/$srv/status)"; } > "$out/idle.txt"
curl -sf -m 60 "http://127.0.0.1:$port/v1/sessions" > "$out/sessions-before.json"
kill -TERM $srv; wait $srv || true  # graceful: queued SSD writes are flushed before exit
start_server "$out/server-restart.log"
curl -sf -m 60 "http://127.0.0.1:$port/v1/sessions" > "$out/sessions-after.json"
