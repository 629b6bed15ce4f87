"""Load a target and an optional draft model through `mlx_lm.load`, from local paths or
hub ids already in the local Hugging Face cache.

Paths are checked (`models.loading.checks`) and hub ids found (`models.loading.hub`, never the network)
before mlx-lm sees them: given a string that is not a local directory, `mlx_lm.load` would
try the Hugging Face hub, which is not what a user who mistyped a path wants; downloads
happen only where the deployment allows them (`ServeArgs.model_dirs`). Every failure is a
`ModelLoadError` naming the path and what is wrong with it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from models.loading.checks import ModelLoadError, check_model_dir, model_fingerprint  # noqa: F401 (re-exported)
from models.loading.hub import cached_name, resolve_model_dir
from models.platform import cpu_math, upstream_fixes  # noqa: F401 (installs the fixes for every model loaded here)


@dataclass
class LoadedModel:
    path: str
    name: str  # directory name (`org/name` for a hub cache snapshot), for logs
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    max_context: int
    fingerprint: str = ""  # content hash (models.loading.checks.model_fingerprint): the policy key


def _to_float32_on_cpu(model: nn.Module) -> None:
    # float16/bfloat16 matmuls are slow on the CPU backend; quantized weights stay as is.
    if mx.default_device() != mx.cpu:
        return
    half = (mx.float16, mx.bfloat16)
    if not any(v.dtype in half for _, v in tree_flatten(model.parameters())):
        return
    model.update(tree_map(lambda v: v.astype(mx.float32) if v.dtype in half else v, model.parameters()))
    mx.eval(model.parameters())


def _one_float_dtype_on_gpu(model: nn.Module, config: dict) -> None:
    # GGUF files keep norms in float32 beside half weights; a float32 norm weight makes
    # every activation after it float32 (and each half matmul cast its weights up).
    if mx.default_device() == mx.cpu or "gguf_sha256" not in config:
        return
    dtypes = Counter(v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype in (mx.float16, mx.bfloat16))
    if not dtypes:
        return
    half = dtypes.most_common(1)[0][0]
    model.update(tree_map(lambda v: v.astype(half) if v.dtype == mx.float32 else v, model.parameters()))
    mx.eval(model.parameters())


def load_model(path: str, role: str = "target") -> LoadedModel:
    """Load one model directory, or a hub id's cached snapshot (weights cast to float32 on CPU)."""
    from mlx_lm import load

    path = resolve_model_dir(path, role)
    try:
        model, tokenizer, config = load(path, return_config=True)
    except Exception as exc:  # mlx-lm raises several kinds; the user needs the path
        raise ModelLoadError(f"{role} model at {path!r} failed to load: {exc}") from exc
    _to_float32_on_cpu(model)
    _one_float_dtype_on_gpu(model, config)
    cpu_math.install()  # after the load: the model's mlx-lm module is imported by now
    max_context = int(config.get("max_position_embeddings") or 0) or 4096
    return LoadedModel(os.path.abspath(path), cached_name(path), model, tokenizer, max_context, model_fingerprint(path))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must map every token string to the same id as the target."""
    t_vocab = target.tokenizer.get_vocab()
    d_vocab = draft.tokenizer.get_vocab()
    if t_vocab == d_vocab:
        return
    differing = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
    example = differing[0] if differing else None
    raise ModelLoadError(
        f"draft model at {draft.path!r} does not share the target's vocabulary "
        f"({len(d_vocab)} tokens vs {len(t_vocab)} in {target.path!r}; "
        f"first difference: {example!r}); a draft must use the target's tokenizer"
    )


def load_pair(target_path: str, draft_path: str | None) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and (optional) draft model, with the vocabulary check."""
    target = load_model(target_path, "target")
    if draft_path is None:
        return target, None
    draft = load_model(draft_path, "draft")
    check_same_vocabulary(target, draft)
    return target, draft
