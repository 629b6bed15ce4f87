"""The runner's typed configuration: what `MlxRunner` is built with besides its models.

Each field is a `knob` (scheduler.knobs), declared here only; the deployment args
(`serve_app.configuration.args.ServeArgs`) take the `deployed` ones, and build_engine passes them
through `MlxRunner.from_paths(**...)`. Knobs the scheduler reads too (K, batch sizes,
`row_drafts`) are `SchedulerConfig`'s, declared again with `same_as`. No mlx here: the
deployment args import this module before any model is loaded.

Where a default is computed: `prefix_cache_bytes` is 0 (off) here, so scripts and tests
opt in, but a deployment leaves it None (`deploy_default`), which the runner sizes from
the memory available once the model is loaded (`models.runner_build.make_prefix_caches`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import knobs
from scheduler.config import SchedulerConfig
from scheduler.knobs import knob, same_as

_SCHEDULER = knobs.knob_fields(SchedulerConfig)
# Per-tick time a lone classic row may keep decoding: a few fast GPU steps per tick make the
# tick's own work a small share of each; on a CPU a step takes longer and a tick stays one step
# (docs/history/benchmarks-2026-11.md, "Second H200 run").
DEFAULT_CLASSIC_BURST_MS = 4.0


@dataclass(frozen=True)
class RunnerConfig:
    num_draft_tokens: int = same_as(_SCHEDULER["num_draft_tokens"])
    max_batch_size: int = same_as(_SCHEDULER["max_batch_size"])
    prefill_batch_size: int = same_as(_SCHEDULER["prefill_batch_size"])
    row_drafts: bool = same_as(_SCHEDULER["row_drafts"])
    policy_cache_dir: str | None = same_as(_SCHEDULER["policy_cache_dir"])  # the tick costs are kept there too
    fast_verify: bool = knob(
        False,
        "The slot verifies through compiled, shape-bucketed per-session forwards "
        "(`models/forward/bucketed.py`): the fastest lone stream on a GPU (docs/gpu.md), but that verify "
        "cannot ride in the batch's forward, so mlx-lm's `BatchGenerator` and the alternating tick "
        "run instead of the slab; for single-stream deployments. Off: the slab serves on CPU and GPU "
        'alike (on a GPU its forwards run as grids with bucketed shapes, docs/gpu.md "What runs by '
        'default").',
    )
    classic_burst_ms: float = knob(
        DEFAULT_CLASSIC_BURST_MS,
        "Milliseconds a classic row decoding *alone* keeps stepping within one engine tick, so a "
        "tick returns several tokens when steps are fast; a new arrival waits at most this long for its "
        "prefill; 0 = one token per tick. Rows sharing the batch always step once per tick.",
        ge=0.0,
        le=1000.0,
    )
    prefix_cache_bytes: int | None = knob(
        0,
        "Bytes of KV the replica's prefix cache may hold; **0 = off**. A classic row or a "
        "speculative session's target cache starts from the longest cached prefix of its prompt "
        "(at least 64 tokens, never the last prompt token) and prefills only the rest; a stream "
        "that finishes or is cancelled stores its prompt and output (a prompt is stored once prefilled "
        "too, for requests sharing it meanwhile, after its first token went out), least recently used entries "
        "are evicted to stay within the budget. Needs the slab batch (`fuse_blocker` unset in "
        "`/v1/internal/scheduler`). With a draft model the budget is split between the target's "
        "prefixes and the draft's own, in proportion to the KV a position takes in each. See "
        '"Prefix cache" below.',
        ge=0,
        le=1 << 42,
        deploy_default=None,
        default_doc="an eighth of the memory available once the model is loaded, at most 4 GiB",
    )
    dense_weights: bool | None = knob(
        None,
        "Dequantize a quantized model's layers (target and draft model) once at load and serve "
        "them as plain layers: float32 on a CPU, the scales' dtype on a CUDA GPU, where MLX's "
        'quantized matmuls are the slow ones (docs/models.md, docs/gpu.md "What runs by default"). '
        "None = on a CPU or a CUDA GPU when the growth fits in half the memory available (Apple "
        "silicon's quantized kernels are the fast ones); false keeps the weights as loaded, true "
        "dequantizes wherever. The load log says which.",
        default_doc="on a CPU or a CUDA GPU where the memory allows, off on Apple silicon",
    )
    draft_vocab: bool = knob(
        True,
        "Cut a draft model's output head to the tokens its `draft_vocab.json` lists (the target's "
        "most frequent output tokens, written by `train_draft` or `scripts.tools.draft_vocab`), "
        "where the draft has one: a step of SmolLM2's draft reads 16 MB of head instead of 50. "
        "The draft then never proposes another token; the target's verification keeps the output "
        'exact. Llama-shaped drafts with a plain head only (docs/models.md, "Draft vocabulary").',
    )
    draft_compiled: bool | None = knob(
        None,
        "Run a draft model's steps as compiled forwards over KV buffers grown in buckets of 256 "
        "positions (`models/forward/bucketed.py`, warmed at load) instead of mlx-lm's forward: "
        "on 2 CPU cores two steps of SmolLM2's draft take 5.7 ms instead of 9.0, with the same "
        'drafts (docs/models.md, "Draft vocabulary"). Plain-KV drafts only (llama-shaped; a draft '
        "with sliding windows keeps its forward). None = on a CPU; on a GPU `fast_verify` compiles "
        "the draft's forwards with the verify's, and without it each bucket would build kernels.",
        default_doc="on a CPU, off on a GPU",
    )
    draft_confidence: float | None = knob(
        None,
        "A draft model's round stops drafting where the product of its drafts' top probabilities "
        "(the draft's own, greedy or at the request's temperature) would fall below this, so "
        "`num_draft_tokens` becomes the most a round drafts: sure runs go long, doubtful ones stop "
        "early (a greedy round may draft nothing and verify only its pending token; a sampled one "
        "drafts at least one). The output stays exact: only how many drafts are verified changes, and "
        "the cost gate prices a round by the drafts rounds actually verify. 0 = always "
        '`num_draft_tokens`. For the SmolLM2 draft (docs/models.md, "Draft length by confidence") a '
        "draft's top probability tracks the chance the target agrees with it. Each draft step waits "
        "for its draft, which a CPU does anyway; on a GPU the wait costs. Not with `fast_verify`. "
        "None = 0.2 on a CPU, 0 on a GPU.",
        ge=0.0,
        le=1.0,
        default_doc="0.2 on a CPU, 0 (off) on a GPU",
    )
    fused_projections: bool | None = knob(
        None,
        "Run each layer's q, k and v projections as one matmul, and its MLP's gate and up as one, "
        "in every forward (llama-family models with plain layers: llama, mistral, qwen2; others are "
        'left as they are): fewer, wider matmuls, which a GPU runs faster (docs/gpu.md, "What runs '
        'by default") and a CPU no faster. None = on a CUDA GPU; true / false force it.',
        default_doc="on a CUDA GPU, off elsewhere",
    )
    draft_step_share: float = knob(
        0.0,
        "The rows' drafts in one step may add at most this share of the step's time without them "
        "(by the forward costs measured at load); when they do not all fit, rows share the budget as "
        "grants are shared: a row denied drafts `skip_cap` steps running first, then by lane (high, "
        "normal, low), then in the order rows joined. 0 = no limit: each row's drafts are priced by "
        'the cost model alone, the faster default (docs/CONTINUOUS_BATCHING.md, "The fused tick"). A '
        "bound protects rows that do not draft from long steps.",
        ge=0.0,
        le=100.0,
    )
    replica_drafts: bool = knob(
        False,
        "Classic rows that draft (`row_drafts`) also draft from the replica's past outputs: the "
        "outputs of rows that left the batch, held up to 16,384 tokens (`models/speculative/replica_index.py`); "
        "a row whose last 4-8 tokens occurred in one drafts what followed, else its own prompt "
        "lookup. For agents that re-ask and edits that return most of an earlier answer; a little "
        "slower on fresh prompts (docs/history/benchmarks-2026-12b.md, scenario 6). Needs the slab batch.",
    )
    sampled_row_drafts: bool = knob(
        False,
        "Classic rows that draft (`row_drafts`) draft at temperature > 0 too, not only greedy "
        "ones: a sampled row's draws are keyed by position, so its tokens are the same either way "
        '(docs/configuration.md, "Speculation at temperature > 0"). Off by default: it gains on code '
        "at T = 0.7 but costs a little where sampled drafts rarely land "
        "(docs/history/benchmarks-2026-12b.md, scenario 6). Needs the slab batch.",
    )
    warm_positions: int | None = knob(
        None,
        "With fast_verify, compile the shapes of contexts up to this many positions at load "
        "(None = min(max_context, 2048); 0 = lazily).",
        ge=0,
        deployed=False,
    )
    prefill_chunk: int = knob(
        128,
        "With fast_verify, a session's prefill (target and draft model) runs in compiled "
        "chunks of this many positions (0 = plain mlx-lm prefill).",
        ge=0,
        deployed=False,
    )
    warm_session: bool = knob(
        True,
        "Throwaway requests (greedy and sampled) at load: end to end with fast_verify; through "
        "the classic batch and the slot with the slab batch on a GPU, where kernels compile on first use.",
        deployed=False,
    )
    slab_batch: bool | None = knob(
        None,
        "Classic rows and sessions in one slab (`models.batch.slab_batch`); None = whenever the "
        "verify can ride in the batch's forward, False = mlx-lm's `BatchGenerator` in every case.",
        deployed=False,
    )

    def __post_init__(self) -> None:
        knobs.check_knobs(self)


def deployed_runner_knobs() -> dict[str, knobs.KnobField]:
    """The runner knobs a deployment sets (ServeArgs fields), by name."""
    return {name: f for name, f in knobs.knob_fields(RunnerConfig).items() if f.knob.deployed}
