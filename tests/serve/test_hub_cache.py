"""Hub ids as `model` / `drafter.path`: found in the local Hugging Face cache (laid out as
huggingface_hub lays it out, built here from the bundled pair), downloaded only with
`allow_download`, else one ModelLoadError line naming the id, the cache and the command
that downloads it; and one deployment by hub ids on the real Serve cluster. No test
reaches beyond 127.0.0.1 (`loopback_only`): lookups never use the network, and the
download tests use a stand-in hub or a closed port on loopback."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket

import httpx
import huggingface_hub
import pytest

from models.loading.checks import ModelLoadError, model_fingerprint
from models.loading.hub import DOWNLOAD_PATTERNS, cached_name, hub_cache_dir, is_repo_id, resolve_model_dir
from serve_app.app import build_app, load_replica
from serve_app.configuration.args import ServeArgs, resolve_path
from serve_app.deployment.ready import drafter_label

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED = {
    "specslot/tiny-target": os.path.join(REPO, "models", "bundled", "target"),
    "specslot/tiny-draft": os.path.join(REPO, "models", "bundled", "draft"),
}
TARGET_ID, DRAFT_ID, MISSING_ID = "specslot/tiny-target", "specslot/tiny-draft", "mlx-community/not-cached-4bit"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache, repo_id, source, files=None):
    """`repo_id` at REVISION as `hf download` leaves it: blobs named by content,
    snapshots/REVISION/<file> symlinks to them, refs/main naming the revision."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in files or sorted(os.listdir(source)):
        with open(os.path.join(source, name), "rb") as f:
            data = f.read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    return snapshot


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Any connection beyond 127.0.0.1 fails the test."""
    connect = socket.socket.connect

    def guarded(sock, address):
        if not (isinstance(address, tuple) and address[0] == "127.0.0.1"):
            raise AssertionError(f"a test tried to reach {address!r}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An HF cache holding the bundled pair as two hub repos; HF_HUB_CACHE points at it."""
    cache = str(tmp_path / "hub")
    snapshots = {rid: add_to_cache(cache, rid, src) for rid, src in BUNDLED.items()}
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    return cache, snapshots


@pytest.mark.parametrize(
    "source, expected",
    [
        ("mlx-community/Qwen2.5-0.5B-Instruct-4bit", True),
        ("Qwen/Qwen3-0.6B", True),
        ("models/bundled", True),  # shape only: an existing directory of that name wins
        ("/models/qwen7b", False),
        ("./target", False),
        ("models/bundled/target", False),
        ("target", False),
        ("org/na--me", False),
        ("org/..", False),
        ("~/models", False),
    ],
)
def test_hub_id_shape(source, expected):
    assert is_repo_id(source) is expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}, "/c/hub"),
        ({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"}, "/legacy"),
        ({"HF_HOME": "/h"}, "/h/hub"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
        ({}, os.path.expanduser("~/.cache/huggingface/hub")),
    ],
)
def test_cache_dir_follows_huggingface_hub_rules(env, expected):
    assert hub_cache_dir(env) == expected


def test_download_patterns_are_mlx_lms_own():
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    assert DOWNLOAD_PATTERNS == DEFAULT_ALLOW_PATTERNS


def test_cached_name_is_the_hub_id_for_a_snapshot_else_the_directory_name():
    assert (
        cached_name(f"/c/hub/models--mlx-community--Qwen2.5-0.5B/snapshots/{REVISION}") == "mlx-community/Qwen2.5-0.5B"
    )
    assert cached_name("/models/qwen7b/") == "qwen7b"


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    cache, snapshots = hub_cache
    assert resolve_model_dir(TARGET_ID, "target") == snapshots[TARGET_ID]
    assert model_fingerprint(snapshots[TARGET_ID]) == model_fingerprint(BUNDLED[TARGET_ID])


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    snapshot = add_to_cache(str(tmp_path / "home" / "hub"), TARGET_ID, BUNDLED[TARGET_ID])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_dir(TARGET_ID, "target") == snapshot


def test_build_app_accepts_cached_hub_ids_and_keeps_them_for_the_replicas(hub_cache):
    app = build_app({"model": TARGET_ID, "drafter": {"kind": "draft_model", "path": DRAFT_ID}})
    (bound,) = app._bound_deployment.init_args
    assert (bound["model"], bound["drafter"]["path"]) == (TARGET_ID, DRAFT_ID)
    args = ServeArgs.model_validate(bound)
    assert args.model_name == TARGET_ID and drafter_label(args) == f"draft_model {DRAFT_ID}"
    assert args.model_dirs() == (hub_cache[1][TARGET_ID], hub_cache[1][DRAFT_ID])


def test_a_local_directory_wins_over_a_hub_id_of_the_same_shape(hub_cache, tmp_path):
    """`models/bundled`-like relative paths resolve locally when they exist; only what
    exists nowhere stays a hub id."""
    assert resolve_path("models/bundled", tmp_path) == os.path.join(REPO, "models", "bundled")
    assert resolve_path(TARGET_ID, tmp_path) == TARGET_ID
    assert resolve_path("no-such-dir", tmp_path) == os.path.join(REPO, "no-such-dir")


@pytest.mark.model
def test_the_runner_loads_a_cached_hub_id(hub_cache):
    """What the scheduler actor does: `load_pair` on the ids finds the snapshots."""
    from models.loading.loader import load_pair

    target, draft = load_pair(TARGET_ID, DRAFT_ID)
    assert (target.name, draft.name) == (TARGET_ID, DRAFT_ID)
    assert target.path == hub_cache[1][TARGET_ID]
    assert target.fingerprint == model_fingerprint(BUNDLED[TARGET_ID])  # the policy key


def test_the_replica_loads_its_tokenizer_from_the_cache(hub_cache):
    class Started:
        info, healthy, num_open_streams, num_restarts = {"max_context": 512, "eos_token_ids": [0]}, True, 0, 0
        num_events_merged = 0

        async def start(self):
            pass

    from serve_app.openai.http import OpenAIService

    service = OpenAIService(
        Started(), None, ServeArgs.model_validate({"model": TARGET_ID, "drafter": {"kind": "ngram"}})
    )
    asyncio.run(load_replica(service))
    assert service.load_error is None and service.ready


def missing_message(role, repo_id, cache):
    return (
        f"{role} model '{repo_id}' is not a local directory, and not in the Hugging Face cache "
        f"{cache} (HF_HUB_CACHE, else $HF_HOME/hub); download it with `hf download {repo_id}`, "
        f"or `hf download {repo_id} --local-dir DIR` and give DIR as the path, or set "
        "allow_download: true"
    )


@pytest.mark.parametrize(
    "args, role, repo_id",
    [
        ({"model": MISSING_ID}, "target", MISSING_ID),
        ({"model": TARGET_ID, "drafter": {"kind": "draft_model", "path": MISSING_ID}}, "draft", MISSING_ID),
    ],
)
def test_an_id_not_in_the_cache_fails_with_one_line(hub_cache, monkeypatch, args, role, repo_id):
    def no_download(*a, local_files_only=False, **kw):
        if not local_files_only:
            raise AssertionError("downloaded without allow_download")
        return real(*a, local_files_only=local_files_only, **kw)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    with pytest.raises(ModelLoadError) as info:
        build_app(args)
    assert str(info.value) == missing_message(role, repo_id, hub_cache[0])


def test_the_cli_names_the_missing_id_and_exits_before_ray(hub_cache, tmp_path, monkeypatch, capsys):
    import ray
    import yaml

    from serve_app import cli

    with open(os.path.join(REPO, "configs", "bundled.yaml")) as f:
        config = yaml.safe_load(f)
    config["applications"][0]["args"]["model"] = MISSING_ID
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started"))
    assert cli.main([str(tmp_path / "hub.yaml")]) == 1
    err = capsys.readouterr().err
    assert err == f"specslot: application 'specslot': {missing_message('target', MISSING_ID, hub_cache[0])}\n"


def test_a_cached_snapshot_without_weights_is_named_as_such(hub_cache):
    cache, _ = hub_cache
    add_to_cache(cache, "specslot/no-weights", BUNDLED[TARGET_ID], files=["config.json", "tokenizer.json"])
    with pytest.raises(
        ModelLoadError,
        match=r"^target model 'specslot/no-weights' from the Hugging Face "
        r"cache: .* no \*\.safetensors weights$",
    ):
        resolve_model_dir("specslot/no-weights", "target")


def test_allow_download_fetches_a_missing_id_into_the_cache(hub_cache, monkeypatch):
    """A stand-in hub: the real lookup misses, then the download lands where
    huggingface_hub would put it, and the id resolves to it."""
    cache, _ = hub_cache
    real, downloads = huggingface_hub.snapshot_download, []

    def hub(repo_id, *, cache_dir, allow_patterns, local_files_only=False):
        if local_files_only:
            return real(repo_id, cache_dir=cache_dir, allow_patterns=allow_patterns, local_files_only=True)
        downloads.append((repo_id, cache_dir, allow_patterns))
        return add_to_cache(cache_dir, repo_id, BUNDLED[TARGET_ID])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    args = {"model": MISSING_ID, "drafter": {"kind": "ngram"}, "allow_download": True}
    (bound,) = build_app(args)._bound_deployment.init_args
    assert downloads == [(MISSING_ID, cache, DOWNLOAD_PATTERNS)]
    assert bound["model"] == MISSING_ID
    assert resolve_model_dir(MISSING_ID, "target") == os.path.join(
        cache, "models--mlx-community--not-cached-4bit", "snapshots", REVISION
    )
    build_app(args)  # now cached: no second download
    assert len(downloads) == 1


def test_allow_download_with_the_hub_unreachable_fails_with_one_line(hub_cache, monkeypatch):
    """The real download, sent to a closed port on loopback."""
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", functools.partial(real, endpoint="http://127.0.0.1:9"))
    with pytest.raises(ModelLoadError) as info:
        resolve_model_dir(MISSING_ID, "target", allow_download=True)
    message = str(info.value)
    assert message.startswith(
        f"target model '{MISSING_ID}' is not in the Hugging Face cache {hub_cache[0]} and downloading it failed: "
    )
    assert "\n" not in message


@pytest.mark.serve
def test_a_deployment_by_hub_ids_serves_what_one_by_paths_does(ray_cluster, tiny_pair, main_app, tmp_path, monkeypatch):
    """Real Ray Serve: the replica finds the ids in the cache its runtime_env names and
    its scheduler actor loads them from there; greedy text equals the app deployed by
    directory (`main_app`, the same models), and the draft model drafts (b1_policy on)."""
    from ray import serve
    from serve_helpers import MODEL, PROMPT, deploy, oai

    cache = str(tmp_path / "hub")
    for repo_id, path in zip((TARGET_ID, DRAFT_ID), tiny_pair):
        add_to_cache(cache, repo_id, path)
    monkeypatch.setenv("HF_HUB_CACHE", cache)  # build_app, in this process
    env = {"HF_HUB_CACHE": cache, "PYTHONPATH": REPO}
    base = deploy(
        ray_cluster,
        tiny_pair,
        "hub",
        "/hub",
        args={"model": TARGET_ID, "drafter": {"kind": "draft_model", "path": DRAFT_ID}, "b1_policy": "on"},
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
    )
    try:
        health = httpx.get(f"{base}/health", timeout=5).json()
        assert (health["model"], health["drafter"]) == (MODEL, f"draft_model {DRAFT_ID}")
        by_id, by_path = (
            oai(b).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
            for b in (base, main_app)
        )
        assert by_id.choices[0].text == by_path.choices[0].text
        assert by_id.usage.model_extra["speculative"]["rounds"] > 0
    finally:
        serve.delete("hub")
