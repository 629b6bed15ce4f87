"""Training data for a draft model, written by its target (`scripts.train_draft`).

Prompts come from the training side of the project's prompt sets (`scripts.prompts`):
chat questions and chat requests about code go through the target's chat template, raw
code snippets are continued as they are. The target continues each prompt in mlx-lm's
`BatchGenerator` (continuous batching, one sampler per pass: a greedy pass and a
sampled one), and every generated position keeps the target's top-k log-probabilities,
which it computed anyway, for distillation.

`plan_batches` turns the examples into padded training batches of a few fixed shapes
(lengths rounded up to `PAD_TO`, rows = token budget // length), so a compiled train
step traces each shape once.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from scripts import prompts as prompt_sets

PROMPT_KINDS = ("chat", "code_chat", "code")
PAD_TO = 32


@dataclass
class Example:
    """One prompt and the target's continuation of it (its stop token included)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    topk_ids: np.ndarray  # (len(completion_ids), k) int32: the target's k most likely tokens
    topk_logprobs: np.ndarray  # (len(completion_ids), k) float32, their log-probabilities


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """`messages` through the tokenizer's chat template, ready for the assistant's turn; a
    tokenizer without a template gets the user's text as it is."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(messages[-1]["content"]))


def split_counts(total: int, mix: dict[str, float]) -> dict[str, int]:
    """`total` shared out by the weights of `mix`, largest remainders first.

    >>> split_counts(10, {"chat": 0.5, "code_chat": 0.25, "code": 0.25})
    {'chat': 5, 'code_chat': 3, 'code': 2}
    """
    weight = sum(mix.values())
    exact = {k: total * w / weight for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


def training_prompts(tokenizer, counts: dict[str, int], seed: int, code_chars: int) -> dict[str, list[list[int]]]:
    """Token prompts per kind, from the training-side prompt sets only."""
    return {
        "chat": [encode_chat(tokenizer, m) for m in prompt_sets.training_chat_questions(counts.get("chat", 0), seed)],
        "code_chat": [encode_chat(tokenizer, m) for m in
                      prompt_sets.training_code_messages(counts.get("code_chat", 0), seed + 1, code_chars)],
        "code": [list(tokenizer.encode(s)) for s in
                 prompt_sets.training_snippets(counts.get("code", 0), seed + 2, code_chars)],
    }


def held_out_prompts(tokenizer, num_per_kind: int, seed: int, code_chars: int) -> dict[str, list[list[int]]]:
    """The evaluation prompts: held-out chat questions and held-out stdlib files."""
    return {
        "chat": [encode_chat(tokenizer, m) for m in prompt_sets.chat_questions(num_per_kind, seed)],
        "code_chat": [encode_chat(tokenizer, m) for m in prompt_sets.chat_messages(num_per_kind, seed, code_chars)],
        "code": [list(tokenizer.encode(s)) for s in prompt_sets.stdlib_snippets(num_per_kind, seed, code_chars)],
    }


def assign_sampled(num_prompts: int, sampled_fraction: float, seed: int) -> list[bool]:
    """Which prompts get a sampled continuation (the rest greedy), by `random.Random(seed)`."""
    rng = random.Random(seed)
    return [rng.random() < sampled_fraction for _ in range(num_prompts)]


def generate(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos_ids,
             topk: int, batch_size: int, deadline: float = math.inf, label: str = "gen",
             log_every_s: float = 10.0) -> tuple[list[Example], dict]:
    """The target's continuation of each prompt (stopping at an EOS id, which is kept, or
    after `max_new_tokens`), with its top-`topk` log-probabilities at every generated
    position. Past `deadline` (time.monotonic()) it stops and keeps what each row has so
    far. Returns (examples in `prompts`' order, without empty ones; stats)."""
    sampler = make_sampler(temp=temperature)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos_ids], sampler=sampler,
                         completion_batch_size=batch_size, prefill_batch_size=min(batch_size, 16))
    uids = gen.insert(prompts, [max_new_tokens] * len(prompts))
    tokens = {uid: [] for uid in uids}
    rows = {uid: [] for uid in uids}  # each token's row in the concatenated per-step top-k arrays
    step_ids, step_lps = [], []
    start = last_log = time.monotonic()
    num_done, num_tokens, stopped_by = 0, 0, "done"
    while responses := gen.next_generated():
        if topk:
            # One batched top-k per step over the rows' log-probabilities (already evaluated).
            logprobs = mx.stack([r.logprobs for r in responses])
            ids = mx.argpartition(-logprobs, kth=topk - 1, axis=-1)[:, :topk]
            step_ids.append(np.array(ids, dtype=np.int32))
            step_lps.append(np.array(mx.take_along_axis(logprobs, ids, axis=-1).astype(mx.float32)))
        for i, r in enumerate(responses):
            tokens[r.uid].append(r.token)
            rows[r.uid].append(num_tokens + i)
            num_done += r.finish_reason is not None
        num_tokens += len(responses)
        now = time.monotonic()
        if now - last_log >= log_every_s:
            last_log = now
            rate = num_tokens / (now - start)
            left = (len(prompts) - num_done) * max_new_tokens / max(rate, 1e-9)
            print(f"{label}: {num_done}/{len(prompts)} prompts, {num_tokens:,} tokens, {rate:,.0f} tok/s, "
                  f"eta <= {min(left, max(0.0, deadline - now)):.0f}s", flush=True)
        if now > deadline:
            stopped_by = "time"
            break
    gen.close()
    seconds = time.monotonic() - start
    all_ids = np.concatenate(step_ids) if step_ids else np.zeros((num_tokens, 0), np.int32)
    all_lps = np.concatenate(step_lps) if step_lps else np.zeros((num_tokens, 0), np.float32)
    examples = [Example(list(prompt), tokens[uid], all_ids[rows[uid]], all_lps[rows[uid]])
                for uid, prompt in zip(uids, prompts) if tokens[uid]]
    stats = {"prompts": len(prompts), "finished": num_done, "kept": len(examples), "tokens": num_tokens,
             "seconds": round(seconds, 2), "tokens_per_s": round(num_tokens / max(seconds, 1e-9), 1),
             "stopped_by": stopped_by}
    return examples, stats


def clip(example: Example, max_seq: int) -> Example:
    """An example whose prompt + completion fits `max_seq` tokens: the prompt loses its
    start first (the completion's context is its end), then the completion its tail."""
    room = max_seq - 1
    completion = example.completion_ids[:room]
    keep = len(completion)
    prompt = example.prompt_ids[max(0, len(example.prompt_ids) - (max_seq - keep)):]
    return Example(prompt, completion, example.topk_ids[:keep], example.topk_logprobs[:keep])


def padded_length(num_tokens: int) -> int:
    """Input positions of a row, rounded up to `PAD_TO` (a sequence of n tokens has n-1 inputs).

    >>> [padded_length(n) for n in (2, 33, 34, 100)]
    [32, 32, 64, 128]
    """
    return max(PAD_TO, math.ceil((num_tokens - 1) / PAD_TO) * PAD_TO)


def plan_batches(lengths: list[int], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """One epoch's batches of example indices: examples of one padded length together,
    `batch_tokens // length` rows each (a last short batch is padded later), in a
    shuffled order. `lengths` are the examples' token counts.

    >>> plan_batches([10, 40, 12, 50, 11], 64, np.random.default_rng(0))
    [[3], [4, 0], [1], [2]]
    """
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(padded_length(n), []).append(i)
    batches = []
    for length in sorted(by_length):
        members = [by_length[length][j] for j in rng.permutation(len(by_length[length]))]
        rows = max(1, batch_tokens // length)
        batches += [members[j:j + rows] for j in range(0, len(members), rows)]
    return [batches[j] for j in rng.permutation(len(batches))]


def collate(examples: list[Example], topk: int, num_rows: int) -> tuple[mx.array, ...]:
    """(inputs, targets, mask, topk_ids, topk_probs) for one batch of `num_rows` rows of one
    padded length; the loss mask is 1 exactly where the target is a completion token.
    Teacher top-k probabilities are renormalised to sum to 1 per position."""
    length = max(padded_length(len(e.prompt_ids) + len(e.completion_ids)) for e in examples)
    inputs = np.zeros((num_rows, length), np.int32)
    targets = np.zeros((num_rows, length), np.int32)
    mask = np.zeros((num_rows, length), np.float32)
    top_ids = np.zeros((num_rows, length, max(topk, 1)), np.int32)
    top_probs = np.zeros((num_rows, length, max(topk, 1)), np.float32)
    for row, e in enumerate(examples):
        seq = np.asarray(e.prompt_ids + e.completion_ids, np.int32)
        n, first = len(seq) - 1, len(e.prompt_ids) - 1  # position `first` predicts completion[0]
        inputs[row, :n], targets[row, :n] = seq[:-1], seq[1:]
        mask[row, first:n] = 1.0
        if topk:
            top_ids[row, first:n] = e.topk_ids
            probs = np.exp(e.topk_logprobs - e.topk_logprobs.max(axis=-1, keepdims=True))
            top_probs[row, first:n] = probs / probs.sum(axis=-1, keepdims=True)
    return tuple(mx.array(a) for a in (inputs, targets, mask, top_ids, top_probs))
