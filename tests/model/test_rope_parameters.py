"""transformers-5 configs put rope_theta / rope_scaling under `rope_parameters`; mlx-lm
0.32.2's llama ignores that key, so without `models.platform.upstream_fixes` a model silently runs
at rope_theta 10,000. The same weights must give the same logits whichever form the
config uses, and values at the top level of the file win."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from models.loading.loader import load_model
from models.platform.upstream_fixes import rope_from_parameters

pytestmark = pytest.mark.model

_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(96)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random llama saved with no rope keys at all in its config.json."""
    from models import tiny

    root = str(tmp_path_factory.mktemp("rope"))
    tok = os.path.join(root, "tokenizer")
    tiny.train_tiny_tokenizer(tok)
    with open(os.path.join(tok, "tokenizer.json")) as f:
        vocab_size = len(json.load(f)["model"]["vocab"])
    args = tiny.tiny_args(vocab_size, num_layers=2)
    path = os.path.join(root, "base")
    # Large output projections: attention, so the rope, shows plainly in the logits.
    tiny.save_model(tiny.random_model(args, 0, 1.0, 4.0), args, tok, path)
    config = json.loads(Path(path, "config.json").read_text())
    del config["rope_theta"], config["rope_scaling"]
    Path(path, "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def variant(base_dir, tmp_path):
    """variant(name, **config keys): a copy of the base model with those keys added."""

    def make(name, **keys):
        path = tmp_path / name
        shutil.copytree(base_dir, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **keys}))
        return str(path)

    return make


def _logits(model):
    out = model(mx.array([_PROMPT]))
    mx.eval(out)
    return out


def _bases(model):
    return [layer.self_attn.rope.base for layer in model.layers]


def test_rope_theta_from_rope_parameters(variant):
    nested = load_model(variant("nested", rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})).model
    flat = load_model(variant("flat", rope_theta=100000.0)).model
    old = load_model(variant("old", rope_theta=10000.0)).model
    assert _bases(nested) == [100000.0, 100000.0]
    assert mx.array_equal(_logits(nested), _logits(flat))
    assert mx.abs(_logits(nested) - _logits(old)).max().item() > 0.05


def test_every_mlx_lm_load_path_gets_it(variant):
    from mlx_lm import load
    from mlx_lm.utils import load_model as mlx_load_model

    path = variant("nested", rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    assert _bases(load(path)[0]) == [100000.0, 100000.0]
    model, config = mlx_load_model(Path(path))
    assert _bases(model) == [100000.0, 100000.0] and config["rope_theta"] == 100000.0


def test_llama3_rope_parameters_match_top_level_rope_scaling(variant):
    from mlx_lm.models.rope_utils import Llama3RoPE

    nested = load_model(
        variant("nested", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3})
    ).model
    flat = load_model(variant("flat", rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **_LLAMA3})).model
    unscaled = load_model(variant("unscaled", rope_theta=500000.0)).model
    assert isinstance(nested.layers[0].self_attn.rope, Llama3RoPE)
    assert mx.array_equal(nested.layers[0].self_attn.rope._freqs, flat.layers[0].self_attn.rope._freqs)
    assert mx.array_equal(_logits(nested), _logits(flat))
    assert mx.abs(_logits(nested) - _logits(unscaled)).max().item() > 0.05


def test_top_level_values_win(variant):
    params = {"rope_type": "llama3", "rope_theta": 100000.0, **_LLAMA3}
    model = load_model(
        variant("both", rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}, rope_parameters=params)
    ).model
    rope = model.layers[0].self_attn.rope
    assert (rope.base, rope.scale) == (10000.0, 0.5)


def test_per_layer_type_rope_parameters_load(variant):
    model = load_model(
        variant(
            "per_layer",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    ).model
    assert _bases(model) == [100000.0, 100000.0]


_DEFAULT = {"rope_type": "default", "rope_theta": 1e5}
_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096}
_YARN_SCALING = {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "config, lifted",
    [
        ({}, {}),
        ({"rope_theta": 5e5}, {}),
        ({"rope_parameters": None}, {}),
        ({"rope_parameters": _DEFAULT}, {"rope_theta": 1e5}),
        ({"rope_parameters": _DEFAULT, "rope_theta": None, "rope_scaling": None}, {"rope_theta": 1e5}),
        ({"rope_parameters": {"type": "default", "rope_theta": 1e5}}, {"rope_theta": 1e5}),
        ({"rope_parameters": _YARN}, {"rope_theta": 1e6, "rope_scaling": _YARN_SCALING}),
        (
            {"rope_parameters": {**_YARN, "rope_type": None, "type": "yarn"}},
            {"rope_theta": 1e6, "rope_scaling": {**_YARN_SCALING, "rope_type": "yarn"}},
        ),
        ({"rope_parameters": _YARN, "rope_theta": 2.0}, {"rope_scaling": _YARN_SCALING}),
        ({"rope_parameters": _YARN, "rope_scaling": {"type": "linear", "factor": 2.0}}, {"rope_theta": 1e6}),
        (
            {
                "rope_parameters": {
                    "full_attention": _YARN,
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            {"rope_theta": 1e6, "rope_scaling": _YARN_SCALING, "rope_local_base_freq": 1e4},
        ),
        ({"rope_parameters": {"full_attention": _DEFAULT, "sliding_attention": None}}, {"rope_theta": 1e5}),
        ({"rope_parameters": {"linear_attention": None, "sliding_attention": _DEFAULT}}, {"rope_local_base_freq": 1e5}),
        (
            {"text_config": {"rope_parameters": _DEFAULT}},
            {"text_config": {"rope_parameters": _DEFAULT, "rope_theta": 1e5}},
        ),
    ],
)
def test_config_transform(config, lifted):
    before = json.dumps(config)
    assert rope_from_parameters(config) == {**config, **lifted}
    assert json.dumps(config) == before  # the input is not modified
