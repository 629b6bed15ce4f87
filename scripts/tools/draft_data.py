"""Training data for a draft model, written by its target (`scripts.tools.train_draft`).

Prompts come from the training side of the project's prompt sets (`scripts.bench.prompts`):
chat questions and chat requests about code go through the target's chat template, raw
code snippets are continued as they are. The target continues each prompt in batches of
fixed shapes (`generate`: a greedy pass and a sampled one), and every generated position
keeps the target's top-k log-probabilities, which it computed anyway, for distillation.

`plan_batches` turns the examples into padded training batches of a few fixed shapes
(lengths rounded up to `PAD_TO`, rows = token budget // length), so a compiled train
step traces each shape once.
"""

from __future__ import annotations

import math
import random
import time
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from models.forward.slab_forward import last_positions
from scripts.bench import prompts as prompt_sets

PROMPT_KINDS = ("chat", "code_chat", "code")  # the held-out evaluation's kinds
# Training may also take requests the target writes itself (`self_chat_prompts`).
TRAINING_KINDS = (*PROMPT_KINDS, "self_chat")
SELF_CHAT_TEMPERATURE = 0.8  # hotter writes garbled requests, colder repeats a few
SELF_CHAT_TOKENS = 64  # a user's turn at most; one not ended by then is dropped
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


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens before a user's words (its system turn included): what
    the target continues to write a user's request itself."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self_chat prompts need a target whose tokenizer has a chat template")
    sentinel = "SPECSLOT-USER-TURN"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    prefix = list(tokenizer.encode(text[: text.index(sentinel)], add_special_tokens=False))
    whole = list(tokenizer.apply_chat_template([{"role": "user", "content": sentinel}]))
    if not prefix or whole[: len(prefix)] != prefix:
        raise ValueError("the chat template's text before a user's words does not tokenize as its own start")
    return prefix


def split_counts(total: int, mix: dict[str, float]) -> dict[str, int]:
    """`total` shared out by the weights of `mix`, largest remainders first.

    >>> split_counts(10, {"chat": 0.5, "code_chat": 0.25, "code": 0.25})
    {'chat': 5, 'code_chat': 3, 'code': 2}
    """
    weight = sum(mix.values())
    exact = {k: total * w / weight for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def training_prompts(tokenizer, counts: dict[str, int], seed: int, code_chars: int) -> dict[str, list[list[int]]]:
    """Token prompts per kind, from the training-side prompt sets only."""
    return {
        "chat": [encode_chat(tokenizer, m) for m in prompt_sets.training_chat_questions(counts.get("chat", 0), seed)],
        "code_chat": [
            encode_chat(tokenizer, m)
            for m in prompt_sets.training_code_messages(counts.get("code_chat", 0), seed + 1, code_chars)
        ],
        "code": [
            list(tokenizer.encode(s))
            for s in prompt_sets.training_snippets(counts.get("code", 0), seed + 2, code_chars)
        ],
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


class _Buffers:
    """One layer's keys and values for a batch of left-padded rows that share one offset,
    in buffers of a fixed length: every decode step attends over the same shapes (MLX on
    CUDA builds an attention kernel per key length). `batch.mask` hides the padding and
    the positions not written yet."""

    def __init__(self, batch: _FixedBatch) -> None:
        # A weak reference: a cycle would keep each chunk's buffers on the device until the
        # cyclic collector runs, which a process holding millions of tokens rarely does.
        self.batch = weakref.proxy(batch)
        self.keys = self.values = None

    @property
    def offset(self) -> mx.array:  # RoPE's position of the tokens being fed
        return self.batch.offset_array

    def make_mask(self, *args, **kwargs) -> mx.array:
        return self.batch.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            shape = (keys.shape[0], keys.shape[1], self.batch.length, keys.shape[3])
            self.keys, self.values = mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)
        at = self.batch.write_positions  # an index array: no kernel per offset either
        self.keys[:, :, at] = keys
        self.values[:, :, at] = values
        return self.keys, self.values


class _FixedBatch:
    """Rows left-padded to `width` tokens, generating up to `new` more, in fixed buffers."""

    def __init__(self, model, prompts: list[list[int]], width: int, new: int) -> None:
        self.length = width + new
        pads = mx.array([width - len(p) for p in prompts])[:, None]
        self.keys_at = mx.arange(self.length)[None, :]
        self.real = self.keys_at >= pads  # (rows, length): not padding
        self.caches = [_Buffers(self) for _ in model.layers]
        self.offset = 0
        self.tokens = mx.array([[0] * (width - len(p)) + list(p) for p in prompts])

    def feed(self, n: int) -> None:
        """The next forward brings `n` positions per row, from the shared offset."""
        self.offset_array = mx.array(self.offset)
        self.write_positions = mx.arange(self.offset, self.offset + n)
        queries_at = self.write_positions[:, None]  # (n, 1)
        # A padding query sees only itself (finite values in its keys, masked out later).
        seen = (self.real[:, None, :] & (self.keys_at[None] <= queries_at)) | (self.keys_at[None] == queries_at)
        self.mask = seen[:, None]  # (rows, 1, n, length)
        self.offset += n


def _length_bucket(n: int) -> int:
    return -(-n // PAD_TO) * PAD_TO


PREFILL_WIDTH = 256  # prompts wider than this run in fewer rows: prefill attention grows as width squared


def rows_for(batch_size: int, lengths: list[int]) -> int:
    """Rows of the next chunk, whose prompts have the (ascending) `lengths`: all
    `batch_size` of them while the chunk's width is at most PREFILL_WIDTH, fewer (halving)
    so that rows x width stays within batch_size x PREFILL_WIDTH.

    >>> rows_for(8, [10] * 8), rows_for(8, [10] * 3), rows_for(8, [10] * 6 + [600] * 2)
    (8, 3, 4)
    """
    rows = min(batch_size, len(lengths))
    while rows > 1 and _length_bucket(lengths[rows - 1]) * rows > batch_size * PREFILL_WIDTH:
        rows //= 2
    return rows


def plan_chunks(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Prompt indices in generation chunks: sorted by length, cut by `rows_for`, the chunks
    in an order shuffled by `seed`.

    >>> plan_chunks([5, 1, 4, 2, 3, 6], 2, seed=0)
    [[0, 5], [1, 3], [4, 2]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks, lo = [], 0
    while lo < len(order):
        chunks.append(order[lo : lo + rows_for(batch_size, [lengths[i] for i in order[lo : lo + batch_size]])])
        lo += len(chunks[-1])
    return [chunks[j] for j in np.random.default_rng(seed).permutation(len(chunks))]


def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_ids,
    topk: int,
    batch_size: int,
    deadline: float = math.inf,
    label: str = "gen",
    log_every_s: float = 10.0,
    seed: int = 0,
) -> tuple[list[Example], dict]:
    """The target's continuation of each prompt (stopping at an EOS id, which is kept, or
    after `max_new_tokens`), with its top-`topk` log-probabilities at every generated
    position. Prompts of similar lengths run together, `batch_size` at a time (`rows_for`),
    left-padded in fixed-length buffers (`_FixedBatch`), every row stepping `max_new_tokens`
    times unless all have stopped; the chunks run in an order shuffled by `seed`, so a pass
    that `deadline` (time.monotonic()) stops holds prompts of every length, not only the
    shortest. Returns (examples in `prompts`' order, without empty ones; stats)."""
    chunks = plan_chunks([len(p) for p in prompts], batch_size, seed)
    eos = mx.array(sorted(eos_ids)) if eos_ids else None
    new = _length_bucket(max_new_tokens)
    results: dict[int, Example] = {}
    start = last_log = time.monotonic()
    num_done, num_tokens, stopped_by = 0, 0, "done"
    for number, chunk in enumerate(chunks):
        if time.monotonic() > deadline:
            stopped_by = "time"
            break
        batch = _FixedBatch(
            model, [prompts[i] for i in chunk], _length_bucket(max(len(prompts[i]) for i in chunk)), new
        )
        width = batch.tokens.shape[1]
        batch.feed(width)
        with last_positions(model, [(r + 1) * width - 1 for r in range(len(chunk))]) as gathered:
            logits = model(batch.tokens, cache=batch.caches)  # the last position's logits only
        logits = logits[0] if gathered else logits[:, -1, :]
        steps, step_ids, step_lps = [], [], []
        done = mx.zeros((len(chunk),), dtype=mx.bool_)
        for step in range(max_new_tokens):
            logprobs = logits.astype(mx.float32)
            logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
            token = (
                mx.argmax(logprobs, axis=-1)
                if temperature == 0
                else mx.random.categorical(logprobs * (1.0 / temperature))
            )
            if topk:
                # A copy, not a view: a slice keeps the whole (rows, vocab) partition alive.
                ids = mx.contiguous(mx.argpartition(-logprobs, kth=topk - 1, axis=-1)[:, :topk])
                step_ids.append(ids)
                step_lps.append(mx.take_along_axis(logprobs, ids, axis=-1))
            steps.append(token)
            if eos is not None:
                done = done | mx.any(token[:, None] == eos[None], axis=-1)
            if step + 1 == max_new_tokens:
                break
            batch.feed(1)
            logits = model(token[:, None], cache=batch.caches)[:, -1, :]
            # Evaluated as they come: a lazy top-k keeps its step's whole log-probabilities alive.
            mx.async_eval(logits, done, token, *(step_ids[-1:] + step_lps[-1:]))
            if step % 16 == 15 and (bool(mx.all(done).item()) or time.monotonic() > deadline):
                stopped_by = "time" if not bool(mx.all(done).item()) else stopped_by
                break
        tokens = np.array(mx.stack(steps, axis=1))
        # Chunks differ in width: cached buffers of other widths would pile up on the device.
        mx.clear_cache()
        ids = np.array(mx.stack(step_ids, axis=1)) if topk else None
        lps = np.array(mx.stack(step_lps, axis=1).astype(mx.float32)) if topk else None
        stop = set(eos_ids or ())
        for row, i in enumerate(chunk):
            out = tokens[row].tolist()
            cut = next((j + 1 for j, t in enumerate(out) if t in stop), len(out))
            num_done += cut < len(out) or cut == max_new_tokens  # stopped, or ran its whole budget
            num_tokens += cut
            results[i] = Example(
                list(prompts[i]),
                out[:cut],
                ids[row, :cut].astype(np.int32) if topk else np.zeros((cut, 0), np.int32),
                lps[row, :cut] if topk else np.zeros((cut, 0), np.float32),
            )
        now = time.monotonic()
        if now - last_log >= log_every_s or number + 1 == len(chunks):
            last_log = now
            rate = num_tokens / max(now - start, 1e-9)
            print(
                f"{label}: {len(results)}/{len(prompts)} prompts, {num_tokens:,} tokens, {rate:,.0f} tok/s, "
                f"memory {mx.get_active_memory() / 2**30:.1f} GiB (peak {mx.get_peak_memory() / 2**30:.1f})",
                flush=True,
            )
    seconds = time.monotonic() - start
    examples = [results[i] for i in range(len(prompts)) if i in results and results[i].completion_ids]
    stats = {
        "prompts": len(prompts),
        "finished": num_done,
        "kept": len(examples),
        "tokens": num_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(num_tokens / max(seconds, 1e-9), 1),
        "stopped_by": stopped_by,
    }
    return examples, stats


def self_chat_prompts(
    model, tokenizer, num_prompts: int, *, batch_size: int, deadline: float = math.inf, seed: int = 0
) -> tuple[list[list[int]], dict]:
    """Requests the target writes itself, sampled from its template's user turn (the
    "Magpie" recipe), each then put through the template for the assistant's turn: topics
    and phrasings from the target's own distribution, past any fixed list. Turns that do
    not end within SELF_CHAT_TOKENS, are empty or repeat one already kept are dropped."""
    eos = set(tokenizer.eos_token_ids)
    turns, stats = generate(
        model,
        [user_turn_prefix(tokenizer)] * num_prompts,
        max_new_tokens=SELF_CHAT_TOKENS,
        temperature=SELF_CHAT_TEMPERATURE,
        eos_ids=eos,
        topk=0,
        batch_size=batch_size,
        deadline=deadline,
        label="generate (self_chat requests)",
        seed=seed,
    )
    texts = dict.fromkeys(tokenizer.decode(t.completion_ids[:-1]).strip() for t in turns if t.completion_ids[-1] in eos)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in texts if text]
    return prompts, {**stats, "requests_kept": len(prompts)}


def clip(example: Example, max_seq: int) -> Example:
    """An example whose prompt + completion fits `max_seq` tokens: the prompt loses its
    start first (the completion's context is its end), then the completion its tail."""
    room = max_seq - 1
    completion = example.completion_ids[:room]
    keep = len(completion)
    prompt = example.prompt_ids[max(0, len(example.prompt_ids) - (max_seq - keep)) :]
    return Example(prompt, completion, example.topk_ids[:keep], example.topk_logprobs[:keep])


def save_examples(path: str, examples: list[Example]) -> None:
    """`examples` in one .npz: token lists flattened with their offsets, top-k rows stacked."""
    prompt_lens = np.array([len(e.prompt_ids) for e in examples], np.int64)
    completion_lens = np.array([len(e.completion_ids) for e in examples], np.int64)
    k = examples[0].topk_ids.shape[1] if examples else 0
    np.savez(
        path,
        prompt_lens=prompt_lens,
        completion_lens=completion_lens,
        prompt_ids=np.array([t for e in examples for t in e.prompt_ids], np.int32),
        completion_ids=np.array([t for e in examples for t in e.completion_ids], np.int32),
        topk_ids=np.concatenate([e.topk_ids for e in examples]) if examples else np.zeros((0, k), np.int32),
        topk_logprobs=(
            np.concatenate([e.topk_logprobs for e in examples]) if examples else np.zeros((0, k), np.float32)
        ),
    )


def load_examples(path: str) -> list[Example]:
    """What `save_examples` wrote, as it was."""
    with np.load(path) as f:
        arrays = {name: f[name] for name in f.files}
    p_ends = np.cumsum(arrays["prompt_lens"])
    c_ends = np.cumsum(arrays["completion_lens"])
    examples = []
    for i in range(len(p_ends)):
        p0 = p_ends[i] - arrays["prompt_lens"][i]
        c0 = c_ends[i] - arrays["completion_lens"][i]
        examples.append(
            Example(
                arrays["prompt_ids"][p0 : p_ends[i]].tolist(),
                arrays["completion_ids"][c0 : c_ends[i]].tolist(),
                arrays["topk_ids"][c0 : c_ends[i]],
                arrays["topk_logprobs"][c0 : c_ends[i]],
            )
        )
    return examples


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
        batches += [members[j : j + rows] for j in range(0, len(members), rows)]
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
