"""Fixes for bugs in the pinned mlx-lm (0.32.2) that change what a served model outputs.

Each fix wraps one mlx-lm function, says what it repairs and how a test shows it, and is
installed once on import (`models.loading.loader` imports this module, so every loaded model
has it). Remove a fix when the pin moves past the bug; its test then says so.

- gemma2 attention with grouped queries (every real gemma2 checkpoint): mlx-lm reshapes
  the queries to 5-D (batch, kv heads, repeats, L, dim) but applies the 4-D array mask
  (batch, 1, L, keys) of a batch with left padding as it comes, so the mask's batch axis
  lines up with the kv-head axis: with two rows of different lengths each row gets the
  other's padding mask (silently wrong), with three or more the shapes do not broadcast
  (`tests/model/test_families.py`: gemma2 with GQA in the matrix, and
  `test_gemma2_batches_with_grouped_queries`).
- configs written by transformers 5 carry rope_theta / rope_scaling only inside
  `rope_parameters`, which most mlx-lm models (llama, qwen2, ...) ignore: they silently
  run with their default rope_theta (10,000 for llama) and no scaling. `load_config` now
  lifts them to the top level where the file has none (`tests/model/test_rope_parameters.py`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import utils as mlx_utils
from mlx_lm.models import gemma2

_GEMMA2_ATTENTION = gemma2.Attention.__call__


def _gemma2_attention(self, x, mask=None, cache=None):
    if self.repeats > 1 and isinstance(mask, mx.array) and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)  # (B, 1, L, T) -> (B, 1, 1, L, T): every group alike
    return _GEMMA2_ATTENTION(self, x, mask=mask, cache=cache)


gemma2.Attention.__call__ = _gemma2_attention


def _flat_rope(config: dict, params: dict) -> None:
    if config.get("rope_theta") is None and params.get("rope_theta") is not None:
        config["rope_theta"] = params["rope_theta"]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default" and config.get("rope_scaling") is None:
        # rope_utils reads "type" or "rope_type"; some model files index "type" directly.
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        config["rope_scaling"] = {**scaling, "rope_type": rope_type, "type": rope_type}


def rope_from_parameters(config: dict) -> dict:
    """`config` with rope_theta / rope_scaling lifted from a transformers-5 `rope_parameters`
    (also in `text_config`) where the top level lacks them (None counts as lacking)."""
    config = dict(config)
    for target in (config, config.get("text_config")):
        params = target.get("rope_parameters") if isinstance(target, dict) else None
        if not isinstance(params, dict):
            continue
        if target is not config:
            target = config["text_config"] = dict(target)
        if any(k in params for k in ("rope_theta", "rope_type", "type")):
            _flat_rope(target, params)
            continue
        # Nested per layer type: mlx-lm has one global rope plus, for gemma3-style
        # models, a local base for sliding layers (transformers 5's own mapping).
        full, local = params.get("full_attention"), params.get("sliding_attention")
        if isinstance(full, dict):
            _flat_rope(target, full)
        if (
            isinstance(local, dict)
            and local.get("rope_theta") is not None
            and target.get("rope_local_base_freq") is None
        ):
            target["rope_local_base_freq"] = local["rope_theta"]
    return config


_LOAD_CONFIG = mlx_utils.load_config


def _load_config(model_path):
    return rope_from_parameters(_LOAD_CONFIG(model_path))


# utils.load_model (so mlx_lm.load) looks load_config up in mlx_lm.utils' globals.
mlx_utils.load_config = _load_config
