"""A draft model's output head cut to the tokens its target writes (`draft_vocab`, on by
default).

A small draft spends much of each step in its output head: SmolLM2's draft reads 49,152
rows of 256 float32 weights (50 MB) a step, as much as its six layers together, and on a
CPU, between target forwards that push those rows out of the caches, more. Most of the
vocabulary is never what the target writes next. A draft directory may hold
`draft_vocab.json` (`scripts.tools.draft_vocab`, or `train_draft` from its own data): the
ids of the tokens the target wrote, most frequent first, as many as cover `coverage` of
them. With it, the head computes logits for those ids only and writes them into a
full-vocabulary row whose other entries are -inf: every caller (greedy drafts, the
distributions sampled drafts are drawn from) runs unchanged, a draft never proposes a
token outside the set, and the target's verification keeps the output exact.

Llama-shaped models (llama, mistral, qwen2, qwen3: their forward runs `lm_head` when the
embeddings are not tied) with a plain (unquantized) head only; any other draft keeps its
whole head, and the load log says why.
"""

from __future__ import annotations

import json
import logging
import os

import mlx.core as mx
import mlx.nn as nn

from models.loading.checks import ModelLoadError

log = logging.getLogger(__name__)

FILE = "draft_vocab.json"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # forwards that honour `lm_head` when untied


class SubsetHead(nn.Module):
    """An output head over `ids` only, its logits scattered into a full row of -inf."""

    def __init__(self, weight: mx.array, ids: list[int], vocab_size: int) -> None:
        super().__init__()
        index = mx.array(ids, dtype=mx.int32)
        self.weight = mx.take(weight, index, axis=0)
        self._index = index  # a plain attribute: not a parameter
        self._vocab_size = vocab_size

    def __call__(self, x: mx.array) -> mx.array:
        logits = x @ self.weight.T
        shape = (*logits.shape[:-1], self._vocab_size)
        full = mx.full(shape, -mx.inf, dtype=logits.dtype)
        index = mx.broadcast_to(self._index, logits.shape)
        return mx.put_along_axis(full, index, logits, axis=-1)


def read(path: str, vocab_size: int) -> list[int] | None:
    """The ids in `path`/draft_vocab.json (None without one); a file that is not a list
    of distinct ids below `vocab_size` raises ModelLoadError."""
    file = os.path.join(path, FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            ids = json.load(f)["ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"draft model at {path!r}: {FILE} is unreadable: {exc}") from None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise ModelLoadError(
            f"draft model at {path!r}: {FILE} must hold 'ids', a list of distinct token ids below {vocab_size}"
        )
    return ids


def _head_weight(model: nn.Module) -> tuple[mx.array | None, str]:
    """The dense output head's weight, or None and why it cannot be cut."""
    args = getattr(model, "args", None)
    if getattr(args, "model_type", None) not in FAMILIES or not hasattr(args, "tie_word_embeddings"):
        return None, f"a {getattr(args, 'model_type', type(model).__name__)} model (cut: {', '.join(FAMILIES)})"
    head = model.model.embed_tokens if args.tie_word_embeddings else getattr(model, "lm_head", None)
    if type(head) not in (nn.Embedding, nn.Linear):
        return None, "its head is quantized"
    return head.weight, ""


def apply(model: nn.Module, path: str, name: str, setting: bool) -> int:
    """Cut `model`'s head to the ids of `path`'s draft_vocab.json when `setting` is on and
    the model allows it (in place); returns the head's rows, 0 when left whole."""
    if not setting:
        return 0
    vocab_size = model.args.vocab_size if hasattr(getattr(model, "args", None), "vocab_size") else None
    ids = read(path, vocab_size) if vocab_size else None
    if ids is None:
        return 0
    if not cut(model, ids):
        log.info("%s: %s found, head left whole: %s", name, FILE, _head_weight(model)[1])
        return 0
    log.info("%s: output head cut to the %d tokens of %s (of %d)", name, len(ids), FILE, vocab_size)
    return len(ids)


def cut(model: nn.Module, ids: list[int]) -> bool:
    """Give `model` a `SubsetHead` over `ids` (in place); False where its head cannot be cut."""
    weight, _ = _head_weight(model)
    if weight is None:
        return False
    model.lm_head = SubsetHead(weight, ids, model.args.vocab_size)
    model.args.tie_word_embeddings = False  # the forward now runs lm_head
    mx.eval(model.lm_head.parameters())
    return True


def choose(counts: dict[int, int], coverage: float, multiple: int = 256) -> tuple[list[int], float]:
    """The most frequent ids whose counts cover `coverage` of all, rounded up to a
    `multiple` of ids (or all of them) where there are more; (ids ascending, share covered).

    >>> choose({5: 6, 7: 3, 9: 1}, 0.9, multiple=1)
    ([5, 7], 0.9)
    >>> choose({5: 6, 7: 3, 9: 1}, 0.5, multiple=2)
    ([5, 7], 0.9)
    """
    ranked = sorted(counts, key=lambda i: (-counts[i], i))
    total = sum(counts.values())
    kept, covered = 0, 0
    while kept < len(ranked) and covered < coverage * total:
        covered += counts[ranked[kept]]
        kept += 1
    while kept < len(ranked) and kept % multiple:
        covered += counts[ranked[kept]]
        kept += 1
    return sorted(ranked[:kept]), round(covered / max(total, 1), 6)


def write(path: str, ids: list[int], coverage: float, counted: int, source: str, **extra) -> str:
    """Write `path`/draft_vocab.json: the ids, the share of `counted` target tokens they
    cover, where the counts came from, and `extra` (e.g. the agreement it was measured at)."""
    file = os.path.join(path, FILE)
    with open(file, "w", encoding="utf-8") as f:
        json.dump({"coverage": coverage, "tokens_counted": counted, "source": source, **extra, "ids": ids}, f)
        f.write("\n")
    return file
