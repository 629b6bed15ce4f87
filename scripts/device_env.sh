#!/usr/bin/env bash
# Sourced by the scripts that run on the offline lent H200 (gpu_serve.sh, and by hand
# before scripts/experiments/*.py or scripts.bench.multiturn): installs MLX and the
# service's wheels into /tmp/site when it is missing and the parts are where
# ../shared/device/README.md and scripts/device_wheels.sh put them, puts /tmp/site on
# the paths, and builds the random-weight model of $SHAPE (scripts/bench/shapes.py; $BITS bits, 4 unless
# set, 0 for bf16) at $MODEL. MODEL_DIR names another model instead: a directory, a .gguf file or a
# `pypi:` file (SmolLM2: its GGUF goes into $SPECSLOT_CACHE_DIR's pypi folder first, it has no network).
#
#   SHAPE=q15 source scripts/device_env.sh && python3 -m scripts.experiments.gpu_ticks --target "$MODEL" ...
T0=${T0:-$(date +%s)}
if [ -d "$HOME/mlx-parts" ] && [ ! -d /tmp/site ]; then
  cat "$HOME/mlx-parts/part.aa" .whl_b/part.ab > "/tmp/$(cat .whl_b/NAME)"
  mkdir -p /tmp/dw && cat "$HOME"/dw/part.* | tar -x -C /tmp/dw
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "/tmp/$(cat .whl_b/NAME)" .whl/*.whl /tmp/dw/*.whl 2>&1 | tail -3
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH; fi
echo "installed after $(( $(date +%s) - T0 )) s"
python3 -c "import ray, mlx.core as mx; print('ray', ray.__version__, 'mlx', mx.__version__, mx.default_device())"
SHAPE=${SHAPE:-q15}
BITS=${BITS:-4}  # 0: unquantized bf16 (scripts/bench/shapes.py --bits)
MODEL=${MODEL_DIR:-/tmp/specslot-$SHAPE$([ "$BITS" = 4 ] || echo "-b$BITS")}
case "$MODEL" in pypi:*|*.gguf) ;; *) test -f "$MODEL/model.safetensors" || python3 -m scripts.bench.shapes "$SHAPE" "$MODEL" --tokenizer-vocab --bits "$BITS" ;; esac
echo "model after $(( $(date +%s) - T0 )) s"
