"""scripts.bench_vs_mlx_lm: how a --config spec becomes our server's deployment config."""

import yaml

from scripts.bench_vs_mlx_lm import our_servers


def test_a_config_spec_sets_deployment_options_and_args(tmp_path):
    """`deployment.NAME=value` in a --config spec lands in the deployment, the rest in args
    (how the GPU benchmark runs one replica against two)."""
    one, two = our_servers(["configs/local.yaml", "configs/local.yaml:deployment.num_replicas=2,grant_rounds=3"],
                           8950, str(tmp_path))
    configs = [yaml.safe_load(open(tmp_path / f"specslot-{port}.yaml")) for port in (8950, 8951)]
    assert [c["applications"][0]["deployments"][0]["num_replicas"] for c in configs] == [1, 2]
    assert configs[1]["applications"][0]["args"]["grant_rounds"] == 3
    assert "deployment.num_replicas" not in configs[1]["applications"][0]["args"]
    assert one.name != two.name and two.port == 8951
