#!/usr/bin/env bash
# Wheels the whole service (Ray Serve, its dependencies, llguidance, the load generator's
# clients) needs on the lent H200, beyond MLX itself (../shared/device/mlx-cuda-wheels.sh):
# Python 3.12, x86_64, no network there. One tarball of wheels, split so that each device
# call carries less than 64 MiB with the working tree:
#   .dw_1/ .dw_2/ ...   part.NN files of the tarball (<= PART_MB MiB each, 36 unless set), one folder per call
# On the device, on one warm machine (it goes back ~30 s after a call), for each k:
#   call k:  carry [".dw_k"]   mkdir -p $HOME/dw && cp .dw_k/part.* $HOME/dw/
# and in the call that runs the service, before starting it:
#   mkdir -p /tmp/dw && cat $HOME/dw/part.* | tar -x -C /tmp/dw && \
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/dw/*.whl
# (the image's own numpy, pyyaml, protobuf, jinja2, tokenizers and transformers are kept).
# Versions are pinned to the checkout's environment (`make install`'s .venv) where it has
# the package, so the device runs what the tests ran.
# Usage (from anywhere inside the checkout): scripts/device_wheels.sh [extra==ver ...]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf .dw_* && tmp=$(mktemp -d)
py=${PYTHON:-.venv/bin/python}
pins=()
if [ -x "$py" ]; then
  "$py" -m pip freeze --exclude-editable | grep -v -i -E "^(mlx|scipy-openblas)" > "$tmp/pins.txt"
  pins=(-c "$tmp/pins.txt")
fi
plat=()
for n in 35 34 31 28 27 24 17 5; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  "${pins[@]}" "${plat[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp/w" \
  "ray[serve]==2.60.0" "pydantic>=2" starlette prometheus-client llguidance==1.9.1 \
  "openai>=1.40" httpx aiohttp "$@"
# What the device image already has (../shared/device/README.md).
rm -f "$tmp"/w/numpy-*.whl "$tmp"/w/PyYAML-*.whl "$tmp"/w/pyyaml-*.whl "$tmp"/w/protobuf-*.whl \
  "$tmp"/w/jinja2-*.whl "$tmp"/w/MarkupSafe-*.whl "$tmp"/w/markupsafe-*.whl
tar -C "$tmp/w" -cf "$tmp/wheels.tar" .
split -b "${PART_MB:-36}m" -d "$tmp/wheels.tar" "$tmp/part."
k=0
for part in "$tmp"/part.*; do
  k=$((k + 1))
  mkdir -p ".dw_$k" && mv "$part" ".dw_$k/"
  grep -qx "/.dw_$k/" .git/info/exclude 2>/dev/null || echo "/.dw_$k/" >> .git/info/exclude
done
rm -rf "$tmp"
echo "$(ls -d .dw_* | wc -l) calls:" && du -sh .dw_*
