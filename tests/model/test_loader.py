"""Loader errors name the path and what is wrong with it."""

import json
import os
import shutil

import mlx.core as mx
import pytest

from models.loading.loader import ModelLoadError, load_model, load_pair

pytestmark = pytest.mark.model


def test_missing_path(tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"target model path '.*nope' does not exist"):
        load_model(path)


def test_file_instead_of_directory(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_model(str(path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model directory: no config.json"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path, tiny_pair):
    shutil.copy(os.path.join(tiny_pair[0], "config.json"), tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights"):
        load_model(str(tmp_path), "draft")


def test_broken_config_is_reported_with_the_path(tmp_path, tiny_pair):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_pair[0], bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(ModelLoadError, match=r"target model at '.*bad' failed to load"):
        load_model(str(bad))


def test_draft_with_another_vocabulary(tmp_path, tiny_pair):
    other = tmp_path / "other"
    shutil.copytree(tiny_pair[1], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    # Swap two token ids: same size, different vocabulary.
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="does not share the target's vocabulary"):
        load_pair(tiny_pair[0], str(other))


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the cast applies on CPU only")
def test_half_precision_weights_become_float32_on_cpu(tmp_path, tiny_pair):
    half = tmp_path / "half"
    shutil.copytree(tiny_pair[1], half)
    weights = mx.load(str(half / "model.safetensors"))
    mx.save_safetensors(str(half / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()})
    loaded = load_model(str(half), "draft")
    assert loaded.model.model.embed_tokens.weight.dtype == mx.float32
    assert loaded.max_context == 512 and loaded.name == "half"
