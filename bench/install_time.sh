#!/usr/bin/env bash
# Install as a user would, from a clean clone into a fresh venv, and time each step (prints JSON):
#   pip install ./   (the dependencies from the package index, the CPU extension compiled)
#   segserve fetch-model, then `segserve serve` until /health answers, then the first chat
#   request (greedy, 64 tokens at most). /health's model.quantization says whether the
#   installed server took the extension's quantized path.
#
#   bash bench/install_time.sh [WORKDIR]     (default: a new temp dir; nothing else is touched)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d)}"
PORT="${PORT:-8765}"
PY="${PYTHON:-python3}"
now() { date +%s.%N; }
git clone -q "$ROOT" "$WORK/src"
t0=$(now)
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --no-cache-dir "$WORK/src" > "$WORK/pip.log" 2>&1
t1=$(now)
"$WORK/venv/bin/segserve" fetch-model > "$WORK/fetch.log" 2>&1
t2=$(now)
cd "$WORK"  # not the checkout: the installed package must serve
"$WORK/venv/bin/segserve" serve --port "$PORT" --bank-dir none > "$WORK/serve.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true' EXIT
ts=$(now)
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $pid 2>/dev/null || { tail -20 "$WORK/serve.log"; exit 1; }
  sleep 0.2
done
tr=$(now)
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"default","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":64,"temperature":0}' \
  > "$WORK/first.json"
tf=$(now)
curl -sf "http://127.0.0.1:$PORT/health" > "$WORK/health.json"
"$PY" - "$t0" "$t1" "$t2" "$ts" "$tr" "$tf" "$WORK" "$("$WORK/venv/bin/segserve" --version)" <<'PY'
import json, sys
t0, t1, t2, ts, tr, tf = map(float, sys.argv[1:7])
work, version = sys.argv[7], sys.argv[8]
first = json.load(open(f"{work}/first.json"))
health = json.load(open(f"{work}/health.json"))
print(json.dumps({
    "version": version,
    "pip_install_s": round(t1 - t0, 1),
    "fetch_model_s": round(t2 - t1, 1),
    "start_to_ready_s": round(tr - ts, 1),
    "first_request_s": round(tf - tr, 2),
    "first_request_tokens": first["usage"]["completion_tokens"],
    "first_answer": first["choices"][0]["message"]["content"],
    "quantization": health["model"]["quantization"],
    "kv_route": health["kv"]["route"],
}, indent=1))
PY
