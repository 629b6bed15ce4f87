"""The adaptive policy's persistence key names models by content, not by directory."""

from __future__ import annotations

import json
import shutil

import pytest

from models.loading.checks import WEIGHT_INDEX, model_fingerprint

pytestmark = pytest.mark.model


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_copies_share_a_fingerprint_and_a_changed_config_does_not(tmp_path, tiny_pair):
    target, _ = tiny_pair
    a = copy_model(target, tmp_path / "a")
    b = copy_model(target, tmp_path / "renamed-elsewhere")
    assert model_fingerprint(a) == model_fingerprint(b) == model_fingerprint(target)
    config_path = tmp_path / "a" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    config_path.write_text(json.dumps(config))
    assert model_fingerprint(a) != model_fingerprint(b)


def test_weight_sizes_or_the_index_count(tmp_path, tiny_pair):
    target, _ = tiny_pair
    a = copy_model(target, tmp_path / "a")
    before = model_fingerprint(a)
    with open(tmp_path / "a" / "model.safetensors", "ab") as f:
        f.write(b"\0")  # a different size: another checkpoint
    grown = model_fingerprint(a)
    assert grown != before
    (tmp_path / "a" / WEIGHT_INDEX).write_text('{"weight_map": {}}')
    assert model_fingerprint(a) != grown


def test_policy_key_is_the_same_for_two_copies_of_one_pair(tmp_path, tiny_pair):
    from models.runner import MlxRunner

    target, draft = tiny_pair
    keys = []
    for name in ("one", "two"):
        runner = MlxRunner.from_paths(
            copy_model(target, tmp_path / name / "target"),
            drafter_kind="draft_model",
            drafter_path=copy_model(draft, tmp_path / name / f"draft-{name}"),
            fast_verify=False,
        )
        keys.append(runner.policy_key())
        runner.close()
    assert keys[0] == keys[1]
    assert keys[0].startswith(model_fingerprint(target) + "|draft_model:" + model_fingerprint(draft))
