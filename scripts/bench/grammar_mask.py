"""Per-token mask cost of the grammar engines on CPU, with a model's own tokenizer.

For each engine: compile a JSON schema once, then walk a fixed valid JSON document
token by token, computing the allowed-token mask before each token and consuming it.
The "specslot" rows time what a verify pays here (`models.sampling.grammar.GrammarMatcher.masks`
over 1 or 5 positions, as an mlx array). Prints a table (compile ms, mean and p95 mask
µs per call) and writes JSON.

    python -m scripts.bench.grammar_mask --model models/bundled/target --out /tmp/grammar_mask.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "engines", "poetry"],
        "address": {"city": "London", "zip": "W1"},
    },
    separators=(",", ":"),
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_llguidance(hf_tokenizer, token_ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    mask = allocate_token_bitmask(1, tokenizer.vocab_size)
    costs = []
    for token in token_ids:
        start = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        costs.append(time.perf_counter() - start)
        assert (mask[0, token // 32] >> (token % 32)) & 1, f"llguidance forbids {token}: {matcher.get_error()}"
        assert matcher.consume_token(token), matcher.get_error()
    assert not np.all(mask == -1)
    return {"compile_ms": compile_ms, "mask_us": costs}


def _byte_vocabulary(hf_tokenizer) -> tuple[dict[bytes, list[int]], int]:
    from tokenizers.decoders import ByteLevel

    eos = hf_tokenizer.eos_token_id
    decoder = ByteLevel()
    vocab: dict[bytes, list[int]] = {}
    for piece, token in hf_tokenizer.get_vocab().items():
        if token == eos or piece in hf_tokenizer.all_special_tokens:
            continue
        vocab.setdefault(decoder.decode([piece]).encode("utf-8", "surrogatepass"), []).append(token)
    return vocab, eos


def bench_outlines_core(hf_tokenizer, token_ids: list[int]) -> dict:
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    pieces, eos = _byte_vocabulary(hf_tokenizer)
    vocabulary = Vocabulary(eos, pieces)
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocabulary)
    compile_ms = (time.perf_counter() - start) * 1e3
    guide = Guide(index)
    words = (len(hf_tokenizer) + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    costs = []
    for token in token_ids:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        costs.append(time.perf_counter() - start)
        assert (mask[token // 32] >> (token % 32)) & 1, f"outlines-core forbids {token}"
        guide.advance(token, return_tokens=False)
    return {"compile_ms": compile_ms, "mask_us": costs}


def bench_specslot_masks(hf_tokenizer, token_ids: list[int], num_positions: int) -> dict:
    """What a verify of `num_positions` pays here: `GrammarMatcher.masks` (llguidance's
    masks after each draft, unpacked into one (n, V) mlx bool array)."""
    from models.sampling.grammar import Grammars, json_schema_grammar

    start = time.perf_counter()
    matcher = Grammars(hf_tokenizer, [hf_tokenizer.eos_token_id]).matcher(json_schema_grammar(SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    vocab, costs = len(hf_tokenizer), []
    for i in range(len(token_ids) - num_positions):
        start = time.perf_counter()
        matcher.masks(num_positions, token_ids[i + 1 : i + num_positions], vocab)
        costs.append(time.perf_counter() - start)
        matcher.accept([token_ids[i]])
    return {"compile_ms": compile_ms, "mask_us": costs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/bundled/target")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(args.model)
    token_ids = hf_tokenizer.encode(DOCUMENT)
    rows = {}
    engines = (
        ("llguidance", bench_llguidance),
        ("outlines-core", bench_outlines_core),
        ("specslot, 1 position", lambda t, ids: bench_specslot_masks(t, ids, 1)),
        ("specslot, 5 positions", lambda t, ids: bench_specslot_masks(t, ids, 5)),
    )
    for name, bench in engines:
        runs = [bench(hf_tokenizer, token_ids) for _ in range(args.repeats)]
        costs = [c * 1e6 for run in runs[1:] or runs for c in run["mask_us"]]
        rows[name] = {
            "compile_ms": statistics.median(r["compile_ms"] for r in runs),
            "mask_us_mean": statistics.mean(costs),
            "mask_us_p95": _percentile(costs, 0.95),
            "tokens": len(token_ids),
        }
    print(f"vocab {len(hf_tokenizer)}, document {len(token_ids)} tokens, {args.repeats} repeats")
    print(f"{'engine':<22} {'compile ms':>11} {'mask µs mean':>13} {'mask µs p95':>12}")
    for name, row in rows.items():
        print(f"{name:<22} {row['compile_ms']:>11.1f} {row['mask_us_mean']:>13.1f} {row['mask_us_p95']:>12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "vocab": len(hf_tokenizer), "engines": rows}, f, indent=2)


if __name__ == "__main__":
    main()
