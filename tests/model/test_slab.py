"""The slab (models.forward.slab) and the batch over it (models.batch.slab_batch): one forward over
rows that bring different numbers of tokens gives each row what its own forward gives;
rows move, free and shrink without disturbing the others; rows that verify their own
n-gram drafts emit exactly what classic decode emits."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models.batch.prefix_cache import PrefixCache
from models.batch.slab_batch import SlabBatch
from models.forward import slab, slab_forward
from models.forward.slab_forward import Forward
from models.speculative.drafters import NgramIndex, ngram_lookup
from scheduler.costs import TickCosts
from scheduler.request import Request

from .conftest import make_request
from .helpers import run_classic
from .test_ragged import _llama, _qwen2, refused_models

pytestmark = pytest.mark.model

ATOL = 1e-4
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(70, 143)), list(range(5, 9))]


def _alone(model, prompt, new):
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return model(mx.array([new]), cache=cache)[0]


@pytest.mark.parametrize(
    "make_model",
    [lambda: _llama(False), lambda: _llama(True), _qwen2],
    ids=["llama-untied", "llama-tied", "qwen2-bias"],
)
@pytest.mark.parametrize("widths", [(1, 1, 1, 1), (1, 1, 1, 5), (2, 1, 7, 1), (4, 3, 2, 6)])
@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_slab_forward_matches_separate_forwards(make_model, widths, grid):
    """Rows at different lengths, each bringing its own number of tokens. Packed:
    one-token rows in slots 0..m-1 share one attention call, the others attend alone;
    grid: every row padded to the widest, one masked attention call."""
    model = make_model()
    store = slab.Slab(model, rows=2, grid=grid)  # grows to 4 rows
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    news = [[(11 * i + j) % 200 + 1 for j in range(w)] for i, w in enumerate(widths)]
    out = store.forward(model, [(r, n) for r, n in zip(rows, news)])
    for got, prompt, new in zip(out, PROMPTS, news):
        assert mx.abs(got - _alone(model, prompt, new)).max().item() < ATOL
    assert [r.length for r in rows] == [len(p) + len(n) for p, n in zip(PROMPTS, news)]
    # A following step reads what this one wrote: every row's cache is its own forward's.
    out = store.forward(model, [(r, [7]) for r in rows])
    for got, prompt, new in zip(out, PROMPTS, news):
        assert mx.abs(got - _alone(model, prompt + new, [7])).max().item() < ATOL


@pytest.mark.parametrize(
    "widths, block",
    [
        ((5, 5, 5, 5), [0, 1, 2, 3]),  # every row drafts: one call over the four
        ((5, 1, 3, 1), [0, 2]),  # a one-token row between them is padding
        ((5, 1, 1, 3), None),  # two rows apart: each its own call
        ((1, 1, 1, 5), None),  # one such row: its own call
        ((5, 12, 3, 1), [0, 2]),  # a prompt chunk's row attends alone
    ],
)
def test_packed_rows_of_a_few_tokens_attend_in_one_call_and_match_separate_forwards(widths, block):
    """Packed, rows that bring 2..`EXACT_WIDTHS` tokens (drafts, a verify) in slots with
    few others between them are attended as one masked grid (`_Block`): the same logits
    as each row's own forward, and the next step reads what it wrote."""
    model = _llama(False)
    store = slab.Slab(model, rows=4, grid=False)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    news = [[(13 * i + j) % 200 + 1 for j in range(w)] for i, w in enumerate(widths)]
    entries = [(r, n) for r, n in zip(rows, news)]
    plan = Forward(store, entries)
    assert (None if plan.block is None else list(range(plan.block.lo, plan.block.lo + plan.block.num_rows))) == (
        None if block is None else list(range(block[0], block[-1] + 1))
    )
    out = store.forward(model, entries)
    for got, prompt, new in zip(out, PROMPTS, news):
        assert mx.abs(got - _alone(model, prompt, new)).max().item() < ATOL
    out = store.forward(model, [(r, [7]) for r in rows])
    for got, prompt, new in zip(out, PROMPTS, news):
        assert mx.abs(got - _alone(model, prompt + new, [7])).max().item() < ATOL


@pytest.mark.parametrize("make_model", [lambda: _llama(False), lambda: _llama(True)], ids=["untied", "tied"])
@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_last_only_gives_each_rows_last_logits_and_runs_the_head_on_those_alone(make_model, grid):
    model = make_model()
    store = slab.Slab(model, rows=4, grid=grid)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p[:-3]) for r, p in zip(rows, PROMPTS)])
    head_inputs = []  # what the model's head got: one position per row
    gather = slab_forward._Gather.__call__
    try:
        slab_forward._Gather.__call__ = lambda self, *a, **k: (lambda h: (head_inputs.append(h.shape), h)[1])(
            gather(self, *a, **k)
        )
        out = store.forward(model, [(r, p[-3:]) for r, p in zip(rows, PROMPTS)], last_only=True)
    finally:
        slab_forward._Gather.__call__ = gather
    assert [tuple(x.shape) for x in out] == [(1, model.args.vocab_size)] * len(PROMPTS)
    for got, prompt in zip(out, PROMPTS):
        assert mx.abs(got - _alone(model, prompt[:-3], prompt[-3:])[-1:]).max().item() < ATOL
    assert [r.length for r in rows] == [len(p) for p in PROMPTS]
    assert model.model is not None and "model" not in vars(model)  # the body is back in place
    assert head_inputs == [(1, len(PROMPTS), model.args.hidden_size)]


def test_freeing_a_row_moves_another_without_changing_it():
    model = _llama(False)
    store = slab.Slab(model, rows=4)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    store.free(rows[1])  # the last row takes slot 1
    assert rows[3].slot == 1 and store.num_rows == 3 and rows[1].freed
    store.swap(rows[0], rows[2])
    live = [rows[0], rows[2], rows[3]]
    out = store.forward(model, [(r, [9]) for r in live])
    for got, prompt in zip(out, [PROMPTS[0], PROMPTS[2], PROMPTS[3]]):
        assert mx.abs(got - _alone(model, prompt, [9])).max().item() < ATOL
    with pytest.raises(ValueError, match="not in this slab"):
        store.forward(model, [(rows[1], [1])])


def spy_moves(store):
    """Record every (src, dst, length) the slab copies."""
    moved, inner = [], store._move
    store._move = lambda moves: (moved.extend(moves), inner(moves))[1]
    return moved


def test_moves_copy_the_positions_rows_hold_and_never_a_row_on_its_way_out():
    model = _llama(False)
    store = slab.Slab(model, rows=4)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    store.reserve(1024)  # room far past every row's length
    moved = spy_moves(store)
    store.swap(rows[1], rows[3], discard=rows[1])  # rows[1] leaves: only rows[3] is copied
    assert moved == [(3, 1, len(PROMPTS[3]))]
    store.free(rows[1])  # the last row now: nothing else moves
    assert moved == [(3, 1, len(PROMPTS[3]))] and rows[3].slot == 1 and store.num_rows == 3
    store.swap(rows[0], rows[2])
    assert moved[1:] == [(2, 0, len(PROMPTS[2])), (0, 2, len(PROMPTS[0]))]
    live = [rows[2], rows[3], rows[0]]
    assert [r.slot for r in live] == [0, 1, 2]
    out = store.forward(model, [(r, [9]) for r in live])
    for got, prompt in zip(out, [PROMPTS[2], PROMPTS[3], PROMPTS[0]]):
        assert mx.abs(got - _alone(model, prompt, [9])).max().item() < ATOL


def test_a_finished_row_leaves_the_batch_without_its_keys_being_copied():
    """Its stream is stored first; then the last classic row takes its slot, and the
    slab's last row (a session's) the slot that frees: two copies, not the leaving row's."""
    model = _llama(False)
    batch = SlabBatch(model, eos_token_ids=(), prefill_batch_size=4)
    batch.prefill([make_request(f"r{i}", p, 8) for i, p in enumerate(PROMPTS[:3])])
    session = batch.new_session_cache(PROMPTS[3])
    batch.slab.forward(model, [(session[0].row, PROMPTS[3])])
    rows = [batch._streams[f"r{i}"].row for i in range(3)]
    moved = spy_moves(batch.slab)
    batch.remove("r0")
    assert moved == [(2, 0, rows[2].length), (3, 2, len(PROMPTS[3]))]
    assert [rows[2].slot, rows[1].slot, session[0].row.slot] == [0, 1, 2]
    out = batch.slab.forward(model, [(rows[1], [9]), (rows[2], [9]), (session[0].row, [9])])
    for got, prompt in zip(out, PROMPTS[1:4]):  # each row holds its prompt (a row's first token is pending)
        assert mx.abs(got - _alone(model, prompt, [9])).max().item() < ATOL


def test_grid_rows_between_entries_are_padding_and_keep_their_keys():
    """A grid over slots 0..3 with slot 1 left out: row 1 runs as padding (its writes
    land past its length) and its next forward is still its own; with too many gaps
    the forward runs packed."""
    model = _llama(False)
    store = slab.Slab(model, rows=4, grid=True)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    ctx = Forward(store, [(rows[0], [1]), (rows[2], [2, 3]), (rows[3], [4])])
    assert ctx.grid == (4, 2) and ctx.grid_rows == slice(0, 4) and ctx.grid_keys % slab.STEP == 0
    assert Forward(store, [(rows[0], [1]), (rows[3], [2])]).grid is None  # two gaps for two rows
    picks = [(rows[0], [9]), (rows[2], [5, 6, 7]), (rows[3], [8])]
    out = store.forward(model, picks)
    assert rows[1].length == len(PROMPTS[1])
    for got, (row, new) in zip(out, picks):
        assert mx.abs(got - _alone(model, PROMPTS[rows.index(row)], new)).max().item() < ATOL
    out = store.forward(model, [(rows[1], [3])])[0]
    assert mx.abs(out - _alone(model, PROMPTS[1], [3])).max().item() < ATOL


def test_grid_prompt_chunks_of_rows_apart_gather_their_keys():
    """Prompt chunks (wider than `EXACT_WIDTHS`) of rows too far apart for a run of slots
    (a prefill group whose shorter prompts are done) still run as one grid: the entries'
    rows alone, their keys gathered for attention; the rows between keep their keys.
    One-token entries that far apart run packed."""
    model = _llama(False)
    store = slab.Slab(model, rows=4, grid=True)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    picks = [(rows[0], list(range(200, 230))), (rows[3], list(range(230, 242)))]
    ctx = Forward(store, picks)
    assert ctx.grid == (2, 32) and ctx.grid_rows.tolist() == [0, 3]
    assert Forward(store, [(rows[0], [1]), (rows[3], [2])]).grid is None
    for got, (row, new) in zip(store.forward(model, picks), picks):
        assert mx.abs(got - _alone(model, PROMPTS[rows.index(row)], new)).max().item() < ATOL
    for row, prompt in zip(rows[1:3], PROMPTS[1:3]):
        assert row.length == len(prompt)
        out = store.forward(model, [(row, [3])])[0]
        assert mx.abs(out - _alone(model, prompt, [3])).max().item() < ATOL


def test_grid_lone_row_attends_to_exactly_its_keys():
    """A run of one slot bringing one token (a lone stream's decode) passes attention no
    mask array, and its keys end at its length; several tokens keep the bucket."""
    model = _llama(True)
    store = slab.Slab(model, rows=3, grid=True)
    rows = [store.add() for _ in PROMPTS[:3]]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    for new in ([7], [7, 8, 9, 10, 11]):
        ctx = Forward(store, [(rows[1], new)])
        assert ctx.grid == (1, len(new)) and ctx.grid_rows == slice(1, 2)
        if len(new) == 1:
            assert ctx.grid_keys == rows[1].length + 1 and ctx.grid_mask is None
        else:
            assert ctx.grid_keys % slab.STEP == 0 and ctx.grid_mask.shape == (1, 1, len(new), ctx.grid_keys)
    out = store.forward(model, [(rows[1], [7, 8, 9, 10, 11])])[0]
    assert mx.abs(out - _alone(model, PROMPTS[1], [7, 8, 9, 10, 11])).max().item() < ATOL
    out = store.forward(model, [(rows[1], [12])])[0]
    assert mx.abs(out - _alone(model, PROMPTS[1], [7, 8, 9, 10, 11, 12])[-1:]).max().item() < ATOL


@pytest.mark.parametrize("mode", ["mask", "rows", "matmuls"])
def test_grid_decode_steps_attend_alike_whichever_decode_attention(mode, monkeypatch):
    """A grid step of one-token rows (a GPU's classic decode) attends with a mask over the
    bucket ("mask"), one unmasked call per row over exactly its keys ("rows", up to
    `PER_ROW_DECODE` rows), or two matmuls ("matmuls"): the same logits as each row's
    own forward either way, a gap's row included as padding, and the next step reads
    what it wrote."""
    monkeypatch.setattr(slab_forward, "DECODE_ATTENTION", mode)
    model = _llama(False)
    store = slab.Slab(model, rows=4, grid=True)
    rows = [store.add() for _ in PROMPTS]
    store.forward(model, [(r, p) for r, p in zip(rows, PROMPTS)])
    picks = [(rows[0], [9]), (rows[2], [5]), (rows[3], [8])]  # slot 1 runs as padding
    ctx = Forward(store, picks)
    assert ctx.grid == (4, 1) and ctx.grid_rows == slice(0, 4)
    if mode == "rows":
        assert ctx.row_keys == [(r.slot, r.length + 1) for r in rows] and ctx.grid_mask is None
    else:
        assert ctx.row_keys is None and ctx.grid_mask.shape == (4, 1, 1, ctx.grid_keys)
    for got, (row, new) in zip(store.forward(model, picks), picks):
        assert mx.abs(got - _alone(model, PROMPTS[rows.index(row)], new)).max().item() < ATOL
    assert rows[1].length == len(PROMPTS[1])
    out = store.forward(model, [(r, [4]) for r in rows])
    for got, row, prompt, (_, new) in zip(out, rows, PROMPTS, [picks[0], (None, []), picks[1], picks[2]]):
        assert mx.abs(got - _alone(model, prompt + new, [4])).max().item() < ATOL
    monkeypatch.setattr(slab_forward, "PER_ROW_DECODE", 3)  # more rows than that: the mask
    assert Forward(store, [(r, [1]) for r in rows]).row_keys is None


def test_shrink_returns_capacity_once_the_long_row_is_gone():
    """A grid slab grows by `STEP` and gives capacity back when the longest row fits in
    half of it; a packed slab doubles (fewer copies as a conversation grows), gives it
    back at a quarter (a slab that just doubled keeps it), and counts the last
    `RECENT_ROWS` rows freed as rows it still needs room for."""
    model = _llama(False)
    for grid, length, grown, kept in (
        (True, 300, 512, slab.STEP),
        (False, 597, 768, 768),
        (False, 300, 512, 512),
        (False, 1100, 1280, slab.STEP),
    ):
        store = slab.Slab(model, rows=2, grid=grid)
        short, long = store.add(), store.add()
        store.forward(model, [(short, PROMPTS[1]), (long, (list(range(1, 200)) * 6)[:length])])
        assert store.capacity == grown, (grid, length)
        store.free(long)
        store.shrink()
        if not grid:  # the long row was freed last: its room is kept ...
            assert store.capacity == grown
            for _ in range(slab.RECENT_ROWS):  # ... until as many short rows have come and gone
                extra = store.add()
                store.forward(model, [(extra, PROMPTS[3])])
                store.free(extra)
            store.shrink()
        assert store.capacity == kept, (grid, length)
        out = store.forward(model, [(short, [4])])
        assert mx.abs(out[0] - _alone(model, PROMPTS[1], [4])).max().item() < ATOL


def test_a_packed_slab_allocates_rows_as_they_come():
    """A packed slab starts with `FRUGAL_ROWS` rows and doubles them (a copy of its
    buffers costs in proportion to the rows allocated); a grid slab allocates them all."""
    model = _llama(False)
    packed, grid = slab.Slab(model, rows=18, grid=False), slab.Slab(model, rows=18, grid=True)
    assert packed.keys[0].shape[0] == slab.FRUGAL_ROWS and grid.keys[0].shape[0] == 18
    rows = [packed.add() for _ in range(slab.FRUGAL_ROWS + 1)]
    assert packed.keys[0].shape[0] == 2 * slab.FRUGAL_ROWS
    packed.forward(model, [(r, PROMPTS[i % len(PROMPTS)]) for i, r in enumerate(rows)])
    out = packed.forward(model, [(rows[-1], [4])])
    assert mx.abs(out[0] - _alone(model, PROMPTS[slab.FRUGAL_ROWS % len(PROMPTS)], [4])).max().item() < ATOL


def test_row_view_is_a_kv_cache_for_ordinary_forwards():
    """A session's own forwards (prefill, a verify alone, a trim) run on a slab row."""
    model = _llama(True)
    store = slab.Slab(model)
    row = store.add()
    model(mx.array([PROMPTS[0]]), cache=row.cache)
    verify = model(mx.array([[5, 6, 7]]), cache=row.cache)[0]
    assert mx.abs(verify - _alone(model, PROMPTS[0], [5, 6, 7])).max().item() < ATOL
    assert all(view.trim(2) == 2 for view in row.cache) and row.length == len(PROMPTS[0]) + 1
    out = store.forward(model, [(row, [8])])[0]  # the trimmed entries are gone
    assert mx.abs(out - _alone(model, PROMPTS[0] + [5], [8])).max().item() < ATOL


def test_check_support_accepts_plain_families_and_refuses_the_others():
    assert slab.check_support(_llama(True)) is None and slab.check_support(_qwen2()) is None
    sliding, softcapped = refused_models()
    assert "not a plain KVCache" in slab.check_support(sliding)
    assert "a slab forward failed" in slab.check_support(softcapped)


def test_logits_agree_bounds_the_error_by_each_positions_spread():
    """Half-precision rounding (a small share of the spread) passes; a wrong position's
    logits (another row's, or shifted by a share of the spread) do not."""
    want = mx.random.normal((4, 1000), key=mx.random.key(0)) * 5
    noise = mx.random.uniform(-1, 1, want.shape, key=mx.random.key(1))
    spread = (want.max(axis=-1) - want.min(axis=-1))[:, None]
    assert slab.logits_agree(want, want, 1e-3, slab.FLOAT_RTOL) is None
    assert slab.logits_agree(want + 0.03 * spread * noise, want, 1e-3, slab.HALF_RTOL) is None
    assert "of the logits' spread" in slab.logits_agree(want + 0.03 * spread * noise, want, 1e-3, slab.FLOAT_RTOL)
    assert slab.logits_agree(want[::-1], want, 1e-3, slab.HALF_RTOL) is not None
    shifted = mx.concatenate([want[:3], want[3:] + 0.2 * spread[3:] * noise[3:]])
    assert slab.logits_agree(shifted, want, 1e-3, slab.HALF_RTOL) is not None


def test_check_support_in_half_precision_on_real_text_ids():
    """The load check the runner runs (a text's token ids) passes a bf16 model."""
    model = _llama(True)
    model.set_dtype(mx.bfloat16)
    assert slab.check_support(model, token_ids=list(range(40, 80))) is None
    assert slab.check_support(model, token_ids=[3, 4]) is None  # too few: ids 1-17


def test_ngram_index_proposes_what_ngram_lookup_proposes():
    rng = random.Random(0)
    for _ in range(200):
        history = [rng.randrange(5) for _ in range(rng.randrange(1, 80))]
        cut = rng.randrange(len(history) + 1)
        index = NgramIndex(history[:cut])
        index.extend(history[cut:])
        for k in (1, 4):
            assert index.propose(k) == ngram_lookup(history, k, 3)
        # built at once from a history, or one token at a time: the same index
        for max_n, min_n in ((3, 1), (4, 2), (1, 1)):
            whole, stepwise = NgramIndex(history[:cut], max_n, min_n), NgramIndex([], max_n, min_n)
            stepwise.extend(history[:cut])
            assert whole.history == stepwise.history and whole._starts == stepwise._starts


# -- the batch ------------------------------------------------------------------------

REPEATING = "    def add(self, x):\n        return x + 1\n" * 6  # n-gram drafts land here


def _run(batch, requests, drafts):
    out, reasons, stats = {r.request_id: [] for r in requests}, {}, {"drafted": 0, "accepted": 0}

    def take(batches):
        for b in batches:
            out[b.request_id] += b.token_ids
            stats["drafted"] += b.num_drafted
            stats["accepted"] += b.num_accepted
            if b.finish_reason:
                reasons[b.request_id] = b.finish_reason
                batch.remove(b.request_id)

    take(batch.prefill(requests))
    for _ in range(500):
        if len(reasons) == len(requests):
            break
        take(batch.decode(drafts=drafts))
    assert batch.num_rows() == 0 and batch.slab.num_rows == 0
    return {rid: (out[rid], reasons[rid]) for rid in out}, stats


@pytest.mark.parametrize(
    "costs", [None, TickCosts({1: 4.0, 4: 4.4}, {0: 4.2, 3: 4.6}, 0.0)], ids=["no_costs", "cheap_verify"]
)
def test_rows_that_draft_emit_exactly_what_classic_decode_emits(loaded, prompt_ids, costs):
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    requests = [
        make_request("rep", repeating, 40),
        make_request("a", prompt_ids[0], 33),
        make_request("b", prompt_ids[7], 21),
        make_request("c", repeating[5:], 1),
    ]
    eos = sorted(target.tokenizer.eos_token_ids)
    expected = run_classic(target.model, requests, eos)
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True, num_draft_tokens=4)
    batch.costs = costs
    got, stats = _run(batch, requests, drafts=True)
    assert got == expected
    assert stats["accepted"] > 0 and stats["drafted"] >= stats["accepted"]
    plain, none = _run(SlabBatch(target.model, eos_token_ids=eos, row_drafts=True), requests, drafts=False)
    assert plain == expected and none == {"drafted": 0, "accepted": 0}


@pytest.mark.parametrize("grid", [False, True])
def test_a_prefill_group_that_fails_leaves_no_rows_and_stores_nothing(loaded, monkeypatch, grid):
    """A device error surfaces at the next evaluation, which with the chunks queued
    (`mx.async_eval`) can come after the group's streams exist: the group's rows are freed,
    its streams dropped without storing their prompts in the prefix cache, and the next
    prefill runs on a batch in the state it was before, with classic decode's tokens."""
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    cache = PrefixCache(64 << 20, block_size=16)
    batch = SlabBatch(target.model, eos_token_ids=eos, prefill_batch_size=2, prefix_cache=cache, grid=grid)
    session = batch.new_session_cache()  # a session row after the classic rows moves with each group
    live = [make_request("live", list(range(5, 60)), 6)]
    batch.prefill(live)
    before = batch.slab.num_rows
    failing = [make_request("a", list(range(3, 200)), 4), make_request("b", list(range(40, 90)), 4)]
    store = batch._store_prefix

    def broken(row, token_ids):  # the queued forwards' error, surfacing at the first store
        raise RuntimeError("out of memory")

    monkeypatch.setattr(batch, "_store_prefix", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        batch.prefill(failing)
    monkeypatch.setattr(batch, "_store_prefix", store)
    assert batch.slab.num_rows == before and batch.request_ids() == ["live"]
    assert cache.lookup(failing[0].prompt_ids) is None
    assert session[0].row.slot == before - 1 and not session[0].row.freed
    batch.remove("live")
    batch.release(session)
    again = [make_request("a", list(range(3, 200)), 4), make_request("b", list(range(40, 90)), 4)]
    got, _ = _run(batch, again, drafts=False)
    assert got == run_classic(target.model, again, eos)


def test_a_long_prompt_left_alone_in_its_group_takes_the_finished_rows_share(loaded, monkeypatch):
    """Prefill forwards hold 512 positions per row while every row of the group has
    tokens left; once the short prompt is done the long one runs the rest in one wider
    chunk (`prefill_width`). The tokens are classic decode's."""
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    long = (list(range(3, 200)) * 7)[:1300]
    requests = [make_request("long", long, 6), make_request("short", list(range(40, 80)), 6)]
    batch = SlabBatch(target.model, eos_token_ids=eos, prefill_batch_size=2)
    widths, forward = [], batch.slab.forward

    def spy(model, entries, **kw):
        if kw.get("last_only"):
            widths.append([len(tokens) for _, tokens in entries])
        return forward(model, entries, **kw)

    monkeypatch.setattr(batch.slab, "forward", spy)
    got, _ = _run(batch, requests, drafts=False)
    assert widths == [[512, 40], [788]]  # 512 per row was [[512, 40], [512], [276]]
    assert got == run_classic(target.model, requests, eos)


def test_rows_do_not_draft_where_a_verify_position_costs_too_much(loaded):
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    eos = sorted(target.tokenizer.eos_token_ids)
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.costs = TickCosts({1: 1.0, 2: 1.1}, {0: 9.0, 1: 9.5}, 0.0)  # a verify costs 8 steps
    _, stats = _run(batch, [make_request("rep", repeating, 24), make_request("x", repeating[3:], 24)], drafts=True)
    assert stats["drafted"] == 0


def test_rows_do_not_draft_where_a_steps_first_draft_costs_too_much(loaded):
    """Draft positions nearly free, but a step's first draft costs 8 steps: no row's
    drafts pay for it. With a cheap first draft the same rows draft."""
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    eos = sorted(target.tokenizer.eos_token_ids)
    requests = [make_request("rep", repeating, 24), make_request("x", repeating[3:], 24)]
    for first, drafts in ((8.0, False), (0.01, True)):
        batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
        batch.costs = TickCosts(
            {1: 1.0, 2: 1.1}, {0: 1.2, 1: 1.3}, 0.0, {2: 1.1 + first + 7 * 0.01}, {1: 1.0 + first, 2: 1.1 + first}
        )
        _, stats = _run(batch, [Request(r.request_id, list(r.prompt_ids), r.sampling) for r in requests], drafts=True)
        assert (stats["drafted"] > 0) is drafts


def test_sampled_rows_draft_and_emit_their_classic_streams(loaded):
    """A verify position draws with its output position's key, as classic decode does
    (more in test_seeded_speculation)."""
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    eos = sorted(target.tokenizer.eos_token_ids)
    requests = [make_request("s", repeating, 24, temperature=0.7, seed=1)]
    off = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    _, stats = _run(off, requests, drafts=True)
    assert stats["drafted"] == 0  # `sampled_drafts` off (the default): greedy rows only
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.sampled_drafts = True
    got, stats = _run(batch, requests, drafts=True)
    assert stats["drafted"] > 0
    assert got == run_classic(target.model, requests, eos)


def test_new_rows_start_from_what_rows_of_their_kind_accepted_on_this_replica(loaded):
    """Sampled rows whose drafts kept failing make a new sampled row start pessimistic
    (it drafts nothing at first), while greedy rows keep their own estimate; verifies
    move the replica's estimate of their kind only."""
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    eos = sorted(target.tokenizer.eos_token_ids)
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.sampled_drafts = True
    # a draft position costs 0.1 steps' time: at 2 rows a draft pays where it lands ~20 %,
    # below even a one-token match's `match_prior`
    batch.costs = TickCosts({1: 1.0, 2: 1.1, 4: 1.3}, {0: 1.2, 1: 1.3}, 0.0, {2: 1.1 + 8 * 0.1, 4: 1.3 + 16 * 0.1})
    for _ in range(60):
        batch.replica_acceptance[False].record(3, 0)
    greedy_before = batch.replica_acceptance[True].alpha
    batch.prefill([make_request("s", repeating, 24, temperature=0.7, seed=1), make_request("g", repeating, 24)])
    sampled_row, greedy_row = batch._streams["s"], batch._streams["g"]
    assert sampled_row.acceptance.alpha < 0.1 and greedy_row.acceptance.alpha == pytest.approx(greedy_before)
    drafted = {"s": 0, "g": 0}
    while batch.num_rows():
        for out in batch.decode(drafts=True):
            drafted[out.request_id] += out.num_drafted
            if out.finish_reason:
                batch.remove(out.request_id)
    assert drafted["s"] == 0 and drafted["g"] > 0
    assert batch.replica_acceptance[True].alpha != greedy_before  # the greedy row's verifies counted


def test_a_row_kept_from_drafts_relaxes_only_where_its_index_had_some(loaded, monkeypatch):
    """A row whose drafts failed stops drafting; steps in which its n-gram index finds
    nothing (prose) leave its estimate where it is, steps in which the estimate kept it
    from drafts it had move it back toward the prior, and the replica's estimate of its
    kind with it."""
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.costs = TickCosts({1: 1.0, 2: 1.1, 4: 1.3}, {0: 1.2, 1: 1.3}, 0.0, {2: 1.1 + 8 * 0.22, 4: 1.3 + 16 * 0.22})
    batch.prefill([make_request("g", list(target.tokenizer.encode(REPEATING)), 40)])
    row = batch._streams["g"]
    row.acceptance.successes, row.acceptance.failures = 0.02, 0.98
    kind = batch.replica_acceptance[True]
    kind.estimate.successes, kind.estimate.failures = 0.02, 0.98
    proposals = []
    monkeypatch.setattr(batch, "_propose", lambda stream, k, count=True: proposals[:k])

    def steps(n):
        drafted = 0
        for _ in range(n):
            drafted += sum(out.num_drafted for out in batch.decode(drafts=True))
        return drafted

    assert steps(5) == 0
    assert row.acceptance.alpha == pytest.approx(0.02) and kind.alpha == pytest.approx(0.02)
    proposals[:] = [7, 7, 7, 7]
    assert steps(5) == 0
    assert row.acceptance.alpha > 0.021 and kind.alpha > 0.021


def _pipelined_run(batch, requests, late, cancel_after, drafts):
    """Two requests join after three steps (a prefill between pipelined steps), one is
    removed mid-stream; returns every stream's tokens and finish reason."""
    out, reasons = {}, {}

    def take(batches):
        for b in batches:
            out.setdefault(b.request_id, []).extend(b.token_ids)
            if b.finish_reason:
                reasons[b.request_id] = b.finish_reason
                batch.remove(b.request_id)

    take(batch.prefill(requests))
    for step in range(500):
        if step == 3:
            take(batch.prefill(late))
        if step == cancel_after[1]:
            batch.remove(cancel_after[0])
            reasons[cancel_after[0]] = "cancelled"
        if len(reasons) == len(requests) + len(late):
            break
        take(batch.decode(drafts=drafts))
    assert batch.num_rows() == 0 and batch.slab.num_rows == 0
    return {rid: (out[rid], reasons[rid]) for rid in out}


@pytest.mark.parametrize(
    "drafts, costs, pipelines",
    [
        (False, None, True),  # b1_policy off: every step plain
        (True, TickCosts({1: 1.0, 2: 1.1}, {0: 9.0, 1: 9.5}, 0.0), True),  # drafts never pay: plain
        (True, None, False),
    ],
)  # drafts cost nothing: every row, greedy or sampled, may draft in every step
def test_pipelined_steps_emit_what_unpipelined_steps_emit(loaded, prompt_ids, drafts, costs, pipelines):
    """On a grid slab the next plain step is queued before this one's tokens are read;
    joins, a removal, finishing rows and seeded sampling give the same streams as
    without the pipeline."""
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    repeating = list(target.tokenizer.encode(REPEATING))
    requests = [
        make_request("g", repeating, 8),
        make_request("s", prompt_ids[3], 26, temperature=0.8, seed=5),
        make_request("t", prompt_ids[5], 40, temperature=1.0, top_p=0.9, seed=9),
    ]
    late = [
        make_request("rep", repeating[4:], 6),
        make_request("u", prompt_ids[2], 12, temperature=0.7, seed=1),
        # penalties read every emitted token: no step is queued while this row lives
        make_request("p", prompt_ids[4], 5, temperature=0.9, seed=3, frequency_penalty=1.5),
    ]
    runs = []
    for pipeline in (False, True):
        batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True, grid=True)
        batch.costs, batch.pipeline, batch.sampled_drafts = costs, pipeline, True
        runs.append((_pipelined_run(batch, requests, late, ("t", 25), drafts), batch.num_pipelined))
    (plain, none), (piped, used) = runs
    assert none == 0 and (used >= 8 if pipelines else used == 0)
    assert piped == plain
    assert piped["t"][1] == "cancelled" and len(piped["t"][0]) < 40


def test_a_finished_rows_removal_keeps_the_queued_step(loaded, prompt_ids):
    """On a grid slab a row that finishes leaves the queued step standing: the scheduler's
    `remove` of a row already out of the batch takes nothing back, so every step after
    the first is the one queued before it (the finished rows are left out of its
    tokens), and the streams are those of an unpipelined run."""
    target = loaded[0]
    lengths = (3, 5, 6, 9, 12)
    runs = []
    for pipeline in (False, True):
        # no stop ids: each row ends at its max_tokens, one after another
        batch = SlabBatch(target.model, eos_token_ids=(), row_drafts=False, grid=True)
        batch.pipeline = pipeline
        requests = [make_request(f"r{i}", prompt_ids[i], n) for i, n in enumerate(lengths)]
        out: dict[str, list[int]] = {}
        finished = []
        steps = 0
        for b in batch.prefill(requests):
            out.setdefault(b.request_id, []).extend(b.token_ids)
        while batch.num_rows():
            steps += 1
            for b in batch.decode():
                out[b.request_id].extend(b.token_ids)
                if b.finish_reason:
                    finished.append(b.request_id)
                    batch.remove(b.request_id)
        assert batch.slab.num_rows == 0
        assert batch.num_steps == steps
        runs.append((out, finished, steps, batch.num_pipelined))
    (plain, plain_order, plain_steps, none), (piped, piped_order, piped_steps, used) = runs
    assert piped == plain and piped_order == plain_order
    assert [len(plain[f"r{i}"]) for i in range(len(lengths))] == list(lengths)
    assert none == 0 and plain_steps == piped_steps == max(lengths) - 1
    assert used == piped_steps - 1  # only the first step was not queued by the one before
