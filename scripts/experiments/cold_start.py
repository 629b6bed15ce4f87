"""A replica's first start on a machine: the engine a config builds (as the scheduler
actor builds it, without Ray or HTTP), loaded against an empty kernel cache, then the
seconds from this process's start to ready and, for each GPU kernel family MLX
compiled, when it landed in the cache (its file's time). A later start with the same
`kernel_cache_dir` loads them instead (another process: MLX reads the cache once).
`--config` overrides go on top, e.g. `prebuild_kernels=false` for MLX
building every family itself inside the load (docs/gpu.md, "Install and serve").

    python3 -m scripts.experiments.cold_start --target "$MODEL" --config "configs/gpu.yaml:drafter={kind: ngram}"
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import glob  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu.yaml:drafter={kind: ngram}", metavar="PATH[:key=value,...]")
    ap.add_argument("--target", required=True, help="the model directory")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(message)s", datefmt="%H:%M:%S")
    from scripts.bench.engine_load import engine_from_config

    cache = tempfile.mkdtemp(prefix="specslot-cold-")
    spec = f"{args.config}{',' if ':' in args.config else ':'}kernel_cache_dir={cache},policy_cache_dir={cache}/policy"
    engine, _ = engine_from_config(spec, args.target)
    ready = time.time()
    files = sorted(glob.glob(os.path.join(cache, "*", "*", "ptx", "*.ptx")), key=os.path.getmtime)
    print(f"ready {ready - T0:.1f} s after the process started; {len(files)} kernel families compiled:")
    for path in files:
        print(f"  {os.path.getmtime(path) - T0:6.1f} s  {os.path.basename(path)[:-4][:70]}")
    engine.stop()


if __name__ == "__main__":
    main()
