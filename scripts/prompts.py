"""Bundled prompt sets, reproducible by seed: snippets of held-out stdlib source, and
everyday chat questions (`chat_questions`) for an instruct model, where prompt lookup
rarely finds a draft.

The bundled pair was trained on the standard library with every 20th file held out
(`models.corpus.split_corpus`); prompts come from those held-out files, so they are
in-distribution for the bundled models without being memorized training text. A
prompt is the `num_chars` characters starting at a line boundary of a file chosen by
`random.Random(seed)`; the same seed and Python version give the same prompts.
"""

from __future__ import annotations

import functools
import random


@functools.lru_cache(maxsize=1)
def _held_out_files() -> tuple[str, ...]:
    from models.corpus import split_corpus

    _, valid = split_corpus()
    return tuple(text for text in valid if len(text) > 4000)


def stdlib_snippets(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[str]:
    """`num_prompts` code snippets of about `num_chars` characters each."""
    files = _held_out_files()
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = files[rng.randrange(len(files))]
        start = rng.randrange(0, max(1, len(text) - num_chars - 1))
        newline = text.find("\n", start)
        start = newline + 1 if 0 <= newline < len(text) - num_chars else start
        prompts.append(text[start:start + num_chars])
    return prompts


def sized_snippets(codec, num_prompts: int, seed: int = 0, num_tokens: int = 2048) -> list[str]:
    """`num_prompts` code texts of `num_tokens` tokens each as `codec` (a
    `serve_app.codec.TextCodec`) tokenizes them, give or take the token at the cut
    (re-encoding a text cut at a token boundary can merge its last tokens): a line
    naming the prompt first, so no two share a prefix, then snippets until the length."""
    encoded = [codec.encode(t) for t in stdlib_snippets(num_prompts, seed, num_chars=num_tokens * 6)]
    out = []
    for i in range(num_prompts):
        ids, k = codec.encode(f"# prompt {seed}-{i}\n"), i
        while len(ids) < num_tokens:
            ids += encoded[k % num_prompts]
            k += 1
        out.append(codec.decode(ids[:num_tokens]))
    return out


def chat_messages(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[list[dict]]:
    """The same snippets as chat requests asking to continue the code."""
    return [[{"role": "user", "content": "Continue this Python code:\n" + s}]
            for s in stdlib_snippets(num_prompts, seed, num_chars)]


def token_prompts(tokenizer, num_prompts: int, seed: int = 0, num_tokens: int = 128) -> list[list[int]]:
    """Token-id prompts of exactly `num_tokens` tokens (for the engine benchmark)."""
    prompts = []
    for text in stdlib_snippets(num_prompts, seed, num_chars=num_tokens * 6):
        ids = tokenizer.encode(text)
        prompts.append(list(ids[:num_tokens]))
    return prompts


_TOPICS = ("photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
           "machine learning", "the immune system", "climate change", "the printing press", "honey bees",
           "the stock market", "plate tectonics", "the Roman Empire", "electric cars", "sleep",
           "the moon landing", "coral reefs", "vaccines", "the internet", "rainbows", "jazz music",
           "the Great Wall of China", "recycling", "earthquakes")
_ASKS = ("Explain {} in simple terms.", "What are three interesting facts about {}?",
         "Write a short paragraph about {} for a ten-year-old.", "Why does {} matter?",
         "Give me a brief history of {}.", "What are common misconceptions about {}?",
         "Write a short poem about {}.", "Summarize what scientists know about {}.")


def chat_questions(num_prompts: int, seed: int = 0) -> list[list[dict]]:
    """`num_prompts` one-turn chats asking an everyday question (topic x phrasing,
    chosen by `random.Random(seed)`): answers are prose, not copies of the prompt."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(_ASKS).format(rng.choice(_TOPICS))}]
            for _ in range(num_prompts)]
