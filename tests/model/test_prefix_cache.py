"""The KV prefix cache (models.batch.prefix_cache) and its use by the slab batch: a lookup
finds the longest cached prefix and always leaves the last prompt token to run; the
byte budget holds; entries are copies of rows, never views; and a greedy stream that
starts from a cached prefix emits exactly the tokens of its isolated classic decode."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models.batch import prefix_cache as pc
from models.batch.prefix_cache import PrefixCache, default_budget
from models.batch.slab_batch import SlabBatch
from models.forward.slab import STEP, Slab
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import Request

from .conftest import drain, make_request
from .helpers import make_drafter, run_classic

pytestmark = pytest.mark.model

KV_ATOL = 1e-4

# -- the store, over made-up KV ---------------------------------------------------------

LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # keys and values, float32
STORED = list(range(100, 120))  # 20 tokens: five blocks of 4


def made_up_kv(n):
    """Per-layer (heads, n, dim) keys and values; position i holds i (+ 1000 per layer)."""
    pos = mx.broadcast_to(mx.arange(n, dtype=mx.float32)[None, :, None], (HEADS, n, DIM))
    return [mx.array(pos + 1000 * i) for i in range(LAYERS)], [mx.array(-pos - 1000 * i) for i in range(LAYERS)]


def store(cache, tokens):
    return cache.store(tokens, BYTES_PER_TOKEN * len(tokens), lambda: made_up_kv(len(tokens)))


def must_not_copy():
    raise AssertionError("copy_kv called for an entry that is not kept")


LOOKUPS = [  # (prompt, cached tokens; None: a miss)
    (STORED + [1, 2, 3], 20),  # the entry and more: all of it
    (STORED, 19),  # the same sequence: all but the last token, which must run
    (STORED[:10] + [7] * 5, 10),  # diverges inside the third block: the hit ends mid-block
    (STORED[:5], 4),  # one block is left once the last token is set aside
    (STORED[:4], None),  # three tokens to reuse: less than a block
    (STORED[:3] + [7] * 10, None),  # diverges inside the first block
    ([7] + STORED, None),
    ([], None),
]


@pytest.fixture(params=["hashed", "every_hash_collides"])
def index(request, monkeypatch):
    """The block index as built, and with every block hashing alike: candidates then
    share nothing, and the token comparison alone must give the same answers."""
    if request.param == "every_hash_collides":
        monkeypatch.setattr(pc, "block_hashes", lambda tokens, size: (0 for _ in range(len(tokens) // size)))
    return request.param


@pytest.mark.parametrize("prompt, expected", LOOKUPS)
def test_lookup_finds_the_longest_prefix_and_leaves_the_last_token(index, prompt, expected):
    cache = PrefixCache(1 << 20, block_size=4)
    assert store(cache, STORED)
    assert store(cache, STORED[:8] + [9] * 12)  # shares two blocks with STORED
    hit = cache.lookup(prompt)
    assert (hit and hit.num_tokens) == expected
    if hit is not None:
        assert len(hit.keys) == LAYERS
        positions = np.array(hit.keys[1][0, : hit.num_tokens, 0])
        assert positions.tolist() == [1000 + i for i in range(hit.num_tokens)]
    assert (cache.num_hits, cache.num_misses) == ((1, 0) if expected else (0, 1))
    assert cache.num_query_tokens == len(prompt) and cache.num_hit_tokens == (expected or 0)


@pytest.mark.parametrize("prompt,expected", LOOKUPS)
def test_cached_length_is_what_a_lookup_would_find_without_counting_one(index, prompt, expected):
    cache = PrefixCache(1 << 20, block_size=4)
    store(cache, STORED)
    store(cache, STORED[:8] + [9] * 12)
    order = list(cache._entries)
    assert cache.cached_length(prompt) == (expected or 0)
    assert (cache.num_hits, cache.num_misses, cache.num_query_tokens) == (0, 0, 0)
    assert list(cache._entries) == order  # the LRU order is untouched
    hit = cache.lookup(prompt)
    assert (hit.num_tokens if hit else 0) == cache.cached_length(prompt)


def test_the_longest_of_several_candidates_wins(index):
    cache = PrefixCache(1 << 20, block_size=4)
    shared = list(range(8))
    store(cache, shared + [1] * 10)
    store(cache, shared + [2] * 10)
    store(cache, shared + [2] * 3 + [5] * 7)
    assert cache.lookup(shared + [2] * 5 + [3]).num_tokens == 13
    assert cache.lookup(shared + [1, 1, 4]).num_tokens == 10


def test_a_longer_sequence_replaces_its_prefix_and_a_held_one_is_not_copied(index):
    cache = PrefixCache(1 << 20, block_size=4)
    assert store(cache, STORED)
    assert store(cache, STORED + [1] * 10)  # the next turn: the first entry is redundant
    assert cache.num_entries == 1 and cache.num_bytes == 30 * BYTES_PER_TOKEN
    assert not cache.store(STORED[:12], 12 * BYTES_PER_TOKEN, must_not_copy)
    assert not cache.store([1, 2, 3], 3 * BYTES_PER_TOKEN, must_not_copy)  # shorter than a block
    assert cache.num_stores == 2 and cache.num_evictions == 0


def test_the_budget_evicts_least_recently_used_first():
    cache = PrefixCache(50 * BYTES_PER_TOKEN, block_size=4)
    a, b, c = ([k] * 20 for k in (1, 2, 3))
    assert store(cache, a) and store(cache, b)
    assert cache.lookup(a + [0]).num_tokens == 20  # a is now the most recently used
    assert store(cache, c)  # 60 tokens > 50: b goes
    assert cache.lookup(b + [0]) is None and cache.lookup(a + [0]) and cache.lookup(c + [0])
    assert cache.num_evictions == 1 and cache.num_bytes == 40 * BYTES_PER_TOKEN
    assert not cache.store([4] * 51, 51 * BYTES_PER_TOKEN, must_not_copy)  # larger than the budget
    assert cache.num_entries == 2


def test_the_budget_is_never_exceeded():
    rng = np.random.default_rng(0)
    budget = 300 * BYTES_PER_TOKEN
    cache = PrefixCache(budget, block_size=4)
    for _ in range(300):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 120))).tolist()  # many shared prefixes
        if rng.random() < 0.5:
            store(cache, tokens)
        else:
            cache.lookup(tokens)
        assert cache.num_bytes <= budget
        assert cache.num_bytes == sum(e.num_bytes for e in cache._entries.values())
    assert cache.num_evictions > 0 and cache.num_hits > 0
    cache.clear()
    assert cache.num_bytes == 0 and cache._by_prefix == {}


@pytest.mark.parametrize("available, budget", [(0, 0), (100, 12), (8 << 30, 1 << 30), (64 << 30, 4 << 30)])
def test_default_budget(available, budget):
    assert default_budget(available) == budget


# -- the slab ---------------------------------------------------------------------------


def test_a_copied_prefix_is_a_copy_that_outlives_the_slab(loaded):
    """What `copy_prefix` returns holds its own memory: once the slab is gone, only the
    copies stay allocated (a view of a row would keep the whole buffer alive), and
    they keep their values while the row is rewritten."""
    model = loaded[0].model
    gc.collect()
    before = mx.get_active_memory()

    def copy_one_row():
        store_ = Slab(model, rows=8)
        rows = [store_.add() for _ in range(8)]
        store_.forward(model, [(r, list(range(3 + i, 3 + i + STEP))) for i, r in enumerate(rows)])
        mx.eval(store_.arrays())
        keys, values = store_.copy_prefix(rows[0], STEP)
        kept = [np.array(a) for a in keys + values]
        store_.free(rows[0])
        row = store_.add()  # the same slot, other keys
        store_.forward(model, [(row, list(range(300, 300 + STEP)))])
        mx.eval(store_.arrays())
        assert all(np.array_equal(np.array(a), b) for a, b in zip(keys + values, kept))
        assert sum(a.nbytes for a in keys + values) == STEP * store_.bytes_per_position
        return keys, values

    keys, values = copy_one_row()
    gc.collect()
    assert mx.get_active_memory() - before < 2 * sum(a.nbytes for a in keys + values)  # a row of 8


# -- the batch: every stream equals its isolated classic decode ------------------------


def drive(batch, requests, on_step=lambda: None, drafts=False, stats=None):
    """{request_id: tokens}: `requests` prefilled together, then decoded to the end
    (`stats["accepted"]` counts accepted drafts)."""
    out, done = {r.request_id: [] for r in requests}, set()

    def take(batches):
        for b in batches:
            out[b.request_id] += b.token_ids
            if stats is not None:
                stats["accepted"] += b.num_accepted
            if b.finish_reason:
                done.add(b.request_id)
                batch.remove(b.request_id)

    take(batch.prefill(requests))
    on_step()
    while len(done) < len(requests):
        take(batch.decode(drafts=drafts))
        on_step()
    assert batch.num_rows() == 0 and batch.slab.num_rows == 0
    return out


def isolated(model, request, eos=()):
    """The request's tokens from mlx-lm's batch alone, no cache (`helpers.run_classic`)."""
    fresh = Request(request.request_id, list(request.prompt_ids), request.sampling)
    return run_classic(model, [fresh], eos)[request.request_id][0]


def reference_kv(model, prompt):
    """mlx-lm's own keys and values of `prompt` (one forward), per layer, as numpy."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    n = len(prompt)
    return [np.array(c.keys[0, :, :n]) for c in cache] + [np.array(c.values[0, :, :n]) for c in cache]


def assert_row_holds(slab, row, model, prompt):
    """The tiny models' greedy tokens depend mostly on the last token, so a row that
    holds wrong keys can still emit the right ones: compare the keys themselves (RoPE
    makes every key depend on its position)."""
    assert row.length == len(prompt)
    keys, values = slab.copy_prefix(row, row.length)
    for got, want in zip(keys + values, reference_kv(model, prompt)):
        assert np.abs(np.array(got) - want).max() < KV_ATOL


@pytest.fixture(scope="module")
def base():
    return np.random.default_rng(1).integers(3, 400, size=200).tolist()


def fresh_tokens(n, seed):
    """Tokens that never occur in `base` (400..511), so a prefix match ends where intended."""
    return np.random.default_rng(seed).integers(400, 512, size=n).tolist()


@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_repeated_prompts_and_next_turns_start_from_the_cache(loaded, base, grid):
    model = loaded[0].model
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20))
    batch.slab.grid = grid
    first = make_request("turn1", base, 24)
    out1 = drive(batch, [first])["turn1"]
    assert first.num_cached_tokens == 0 and out1 == isolated(model, first)
    assert batch.prefix_cache.num_entries == 1  # prompt + output but the pending token
    cases = [
        ("again", base, len(base) - 1),
        ("turn2", base + out1 + fresh_tokens(30, 2), len(base) + len(out1) - 1),
        ("mid_block", base[:100] + fresh_tokens(20, 3), 100),
        ("fresh", fresh_tokens(150, 4), 0),
    ]
    for rid, prompt, cached in cases:
        request = make_request(rid, prompt, 24)
        assert drive(batch, [request])[rid] == isolated(model, request), rid
        assert request.num_cached_tokens == cached, rid
    assert batch.prefix_cache.num_hits == 3 and batch.prefix_cache.num_misses == 2


@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_a_row_started_from_the_cache_holds_the_keys_of_its_own_prefill(loaded, base, grid):
    model = loaded[0].model
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20), prefill_batch_size=4)
    batch.slab.grid = grid
    out1 = drive(batch, [make_request("turn1", base, 24)])["turn1"]
    requests = [
        make_request("again", base, 8),
        make_request("turn2", base + out1 + fresh_tokens(30, 2), 8),
        make_request("mid_block", base[:100] + fresh_tokens(20, 3), 8),
        make_request("miss", fresh_tokens(70, 4), 8),
    ]
    batch.prefill(requests)  # one group: three hits of different lengths and a miss
    assert [r.num_cached_tokens for r in requests] == [len(base) - 1, len(base) + len(out1) - 1, 100, 0]
    for r in requests:
        assert_row_holds(batch.slab, batch._streams[r.request_id].row, model, r.prompt_ids)
        batch.remove(r.request_id)


@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_rows_of_one_prefill_group_share_an_entry(loaded, base, grid):
    """Hits of different lengths from one entry, and a miss, in one prefill group."""
    model = loaded[0].model
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20), prefill_batch_size=4)
    batch.slab.grid = grid
    out1 = drive(batch, [make_request("turn1", base, 16)])["turn1"]
    hit = batch.prefix_cache.lookup(base + [1])
    entry = [np.array(k) for k in hit.keys + hit.values]
    requests = [
        make_request("full", base + fresh_tokens(5, 5), 20),
        make_request("part", base[:150] + fresh_tokens(40, 6), 20),
        make_request("turn2", base + out1 + fresh_tokens(9, 7), 20),
        make_request("miss", fresh_tokens(90, 8), 20),
    ]
    got = drive(batch, requests)
    assert [r.num_cached_tokens for r in requests] == [200, 150, 200 + len(out1) - 1, 0]
    for r in requests:
        assert got[r.request_id] == isolated(model, r), r.request_id
    assert all(np.array_equal(np.array(a), b) for a, b in zip(hit.keys + hit.values, entry))


@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_a_prefilled_prompt_is_stored_after_its_first_token_for_requests_meanwhile(loaded, base, grid):
    """A prefill group's first tokens go out before its prompts are copied into the cache:
    the copy runs at the batch's next operation, so a request that shares the prompt and
    arrives while the first one decodes still starts from it. A row that ends on its first
    token stores its prompt once, when it leaves."""
    model = loaded[0].model
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20))
    batch.slab.grid = grid
    first = make_request("first", base, 24)
    batch.prefill([first])
    assert batch.prefix_cache.num_stores == 0  # not on the first token's path
    batch.decode()  # the next operation stores it
    assert batch.prefix_cache.num_stores == 1
    second = make_request("second", base + fresh_tokens(12, 9), 20)
    batch.prefill([second])  # while the first one decodes
    assert second.num_cached_tokens == len(base) - 1
    assert_row_holds(batch.slab, batch._streams["second"].row, model, second.prompt_ids)

    lone = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20))
    lone.slab.grid = grid
    (first_token,) = lone.prefill([make_request("short", base, 1)])  # ends on its first token
    assert first_token.finish_reason == "length" and lone.prefix_cache.num_stores == 1
    lone.prefill([make_request("after", base + fresh_tokens(5, 10), 4)])  # the deferred copy is not made twice
    assert lone.prefix_cache.num_stores == 1 and lone.prefix_cache.num_hits == 1


@pytest.mark.parametrize("with_cache", [False, True], ids=["no_cache", "cache"])
@pytest.mark.parametrize("grid", [False, True], ids=["packed", "grid"])
def test_choices_of_one_prompt_prefill_it_once(loaded, base, grid, with_cache):
    """The choices of an n > 1 request arrive together with one prompt: its first row
    runs the prompt, its last token included, the others copy its keys and draw from
    its logits, and every stream equals the same request prefilled alone."""
    model = loaded[0].model

    def new_batch():
        batch = SlabBatch(
            model, eos_token_ids=(), prefill_batch_size=8, prefix_cache=PrefixCache(64 << 20) if with_cache else None
        )
        batch.slab.grid = grid
        return batch

    other = fresh_tokens(70, 3)
    requests = [
        make_request("g0", base, 16),
        make_request("s0", base, 16, temperature=0.8, seed=5),
        make_request("o", other, 16),
        make_request("g1", base, 16),
        make_request("s1", base, 16, temperature=0.8, seed=6),
    ]
    batch = new_batch()
    fed, stepping = [], []  # prompt tokens the prefill's chunked forwards ran
    forward, step = batch.slab.forward, batch._step
    batch.slab.forward = lambda m, entries, *a, **k: (
        stepping or fed.append(sum(len(t) for _, t in entries)),
        forward(m, entries, *a, **k),
    )[1]
    batch._step = lambda *a, **k: (stepping.append(1), step(*a, **k))[1]
    got = drive(batch, requests)
    assert sum(fed) == len(base) + len(other)  # the shared prompt ran once, in the one forward
    assert [r.num_cached_tokens for r in requests] == [0, len(base) - 1, 0, len(base) - 1, len(base) - 1]
    for r in requests:
        alone = Request(r.request_id, list(r.prompt_ids), r.sampling)
        assert got[r.request_id] == drive(new_batch(), [alone])[r.request_id], r.request_id
    assert got["g0"] == got["g1"] == isolated(model, requests[0]) and got["s0"] != got["s1"]
    assert batch.slab.num_rows == 0


def test_after_eviction_a_tiny_budget_still_gives_the_same_streams(loaded, base):
    model = loaded[0].model
    probe = SlabBatch(model, eos_token_ids=())
    budget = 300 * probe.slab.bytes_per_position  # room for one conversation
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(budget))
    cache = batch.prefix_cache

    def within_budget():
        assert cache.num_bytes <= budget

    other = fresh_tokens(200, 9)
    cases = [
        ("a", base, 0),
        ("b", other, 0),
        ("a_again", base, 0),
        ("a_third", base, len(base) - 1),
        ("long", fresh_tokens(310, 10), 0),
        ("a_fourth", base, len(base) - 1),
    ]
    for rid, prompt, cached in cases:
        request = make_request(rid, prompt, 16)
        assert drive(batch, [request], within_budget)[rid] == isolated(model, request), rid
        assert request.num_cached_tokens == cached, rid
    # b evicted a, a evicted b; the 325-position conversation never fit
    assert cache.num_evictions == 2 and cache.num_entries == 1


def test_a_cancelled_row_stores_what_it_holds(loaded, base):
    model = loaded[0].model
    batch = SlabBatch(model, eos_token_ids=(), prefix_cache=PrefixCache(64 << 20))
    emitted = batch.prefill([make_request("gone", base, 40)])[0].token_ids
    for _ in range(5):
        emitted += batch.decode()[0].token_ids
    batch.remove("gone")
    request = make_request("next", base + emitted + fresh_tokens(10, 11), 20)
    assert drive(batch, [request])["next"] == isolated(model, request)
    assert request.num_cached_tokens == len(base) + len(emitted) - 1


def test_rows_that_draft_store_only_the_tokens_they_emitted(loaded, monkeypatch):
    """A stop token inside a step's accepted drafts leaves the drafts after it in the
    row; the entry must end at the emitted tokens, or the next turn would start from
    keys of tokens it does not have."""
    from .test_slab import REPEATING

    target = loaded[0]
    prompt = list(target.tokenizer.encode(REPEATING))
    probe = SlabBatch(target.model, eos_token_ids=(), row_drafts=True)
    # Once the stream has repeated itself in the prompt, its steps accept whole drafts:
    # stop at a token first emitted as the second token of such a step.
    history = prompt + drive(probe, [make_request("warm", prompt, 24)], drafts=True)["warm"]
    emitted, stop = [], None
    probe.prefill([make_request("look", history, 16)])
    for _ in range(15):
        step = probe.decode(drafts=True)[0]
        if step.num_accepted >= 2 and step.token_ids[1] not in emitted:
            stop = step.token_ids[1]
            break
        emitted += step.token_ids
    assert stop is not None, "no step accepted two drafts"
    probe.remove("look")

    batch = SlabBatch(target.model, eos_token_ids=(), row_drafts=True, prefix_cache=PrefixCache(64 << 20))
    stored = []  # (positions in the row, positions stored) of every store
    keep = batch._store_prefix
    monkeypatch.setattr(
        batch, "_store_prefix", lambda row, ids: (stored.append((row.length, len(ids) - 1)), keep(row, ids))
    )
    first = make_request("t1", history, 16, stop_token_ids=(stop,))
    out1 = drive(batch, [first], drafts=True)["t1"]
    assert out1 == isolated(target.model, first) and out1[-1] == stop
    # The prompt, once prefilled (the row holds its last token too, which is not stored);
    # then the stream, without the accepted drafts past the stop.
    assert stored[0] == (len(history), len(history) - 1)
    assert stored[1:] == [(stored[1][0], len(history) + len(out1) - 1)] and stored[1][0] > stored[1][1]
    second = make_request("t2", history + out1 + prompt[:9], 16)
    assert drive(batch, [second], drafts=True)["t2"] == isolated(target.model, second)
    assert second.num_cached_tokens == len(history) + len(out1) - 1


@pytest.mark.parametrize("configured", [None, 0, 1 << 20])
def test_the_runner_builds_the_cache_it_is_given(tiny_pair, configured):
    """None: sized from the memory available at load; 0: no cache, nothing counted."""
    from models.runner import MlxRunner

    runner = MlxRunner.from_paths(tiny_pair[0], drafter_kind="ngram", prefix_cache_bytes=configured)
    stats = runner.prefix_cache_stats()
    if configured == 0:
        assert stats is None and runner._classic.prefix_cache is None
    elif configured is None:
        assert 0 < stats["budget_bytes"] <= pc.DEFAULT_BUDGET_CAP
    else:
        assert stats["budget_bytes"] == configured and stats["hits"] == stats["bytes"] == 0
    runner.close()


def assert_draft_holds(state, model, tokens):
    """The draft state's cache holds exactly the KV of a fresh prefill of `tokens`."""
    assert state.num_cached == state.cache[0].offset == len(tokens)
    want = reference_kv(model, tokens)
    got = [np.array(c.keys[0, :, : len(tokens)]) for c in state.cache] + [
        np.array(c.values[0, :, : len(tokens)]) for c in state.cache
    ]
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < KV_ATOL


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_a_session_starts_from_the_cache_and_stores_its_stream(loaded, base, kind):
    """The slot's session: its target row starts from the cached prefix, and so does a
    draft model's own cache (from the draft's share of the budget); the finished
    stream is stored in both. An entry's arrays never change under a session that
    started from them."""
    from models.runner import MlxRunner

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    runner = MlxRunner(target, make_drafter(kind, loaded), num_draft_tokens=3, prefix_cache_bytes=64 << 20)
    draft_cache = runner._slot.drafter.prefix_cache if kind == "draft_model" else None
    if kind == "draft_model":
        draft_bytes = runner._slot.drafter.kv_bytes_per_position()
        share = draft_bytes / (draft_bytes + runner._classic.slab.bytes_per_position)
        assert draft_cache.budget_bytes == int((64 << 20) * share)
        assert draft_cache.budget_bytes + runner._classic.prefix_cache.budget_bytes == 64 << 20

    def speculate(request):
        first = runner.spec_begin(request)
        session = runner.session(request.request_id)
        assert_row_holds(runner._classic.slab, session.cache[0].row, target.model, request.prompt_ids)
        if kind == "draft_model":
            assert_draft_holds(session.draft_state, loaded[1].model, request.prompt_ids)
        tokens, reason = list(first.token_ids), first.finish_reason
        while reason is None:
            outcome = runner.spec_round(request.request_id)
            tokens, reason = tokens + outcome.token_ids, outcome.finish_reason
        runner.spec_finish(request.request_id)
        return tokens

    first = make_request("s1", base, 20)
    out1 = speculate(first)
    second = make_request("s2", base + out1 + fresh_tokens(5, 12), 20)
    held = draft_cache.lookup(second.prompt_ids) if draft_cache is not None else None
    before = [np.array(a) for a in (held.keys + held.values)] if held is not None else []
    out2 = speculate(second)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(base) + len(out1) - 1)
    assert out1 == isolated(target.model, first, eos) and out2 == isolated(target.model, second, eos)
    assert runner.num_live_sessions() == 0 and runner._classic.slab.num_rows == 0
    stats = runner.prefix_cache_stats()
    if kind == "draft_model":
        # s1's draft KV reaches at least past the prompt; s2 found it, then stored its own
        # longer stream in its place.
        assert held is not None and len(base) <= held.num_tokens <= len(base) + len(out1) - 1
        assert stats["draft"]["hits"] == 2 and stats["draft"]["stores"] == 2 and stats["draft"]["entries"] == 1
        assert all(np.array_equal(b, np.array(a)) for b, a in zip(before, held.keys + held.values))
    else:
        assert "draft" not in stats
    runner.close()


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_a_parked_session_keeps_its_state_while_the_cache_evicts_its_prefix(loaded, base, kind):
    """A parked session's target KV is its own slab row (a hit was copied in at begin)
    and its draft state is the session's: the cache holds neither, so evicting the
    entry the session started from, while it is parked, changes nothing it resumes with."""
    from models.runner import MlxRunner

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    runner = MlxRunner(target, make_drafter(kind, loaded), num_draft_tokens=3, prefix_cache_bytes=64 << 20)
    cache = runner._classic.prefix_cache
    cache.budget_bytes = 260 * runner._classic.slab.bytes_per_position  # room for one conversation

    def run(request, rounds=None):
        tokens = list(runner.spec_begin(request).token_ids)
        for _ in range(rounds or 10_000):
            outcome = runner.spec_round(request.request_id)
            tokens += outcome.token_ids
            if outcome.finish_reason:
                runner.spec_finish(request.request_id)
                break
        return tokens

    def row_matches_history(session):
        row = session.cache[0].row
        keys, values = runner._classic.slab.copy_prefix(row, row.length)
        want = reference_kv(target.model, session.history[: row.length])
        return all(np.abs(np.array(g) - w).max() < KV_ATOL for g, w in zip(keys + values, want))

    first = make_request("t1", base, 20)
    out1 = run(first)
    second = make_request("t2", base + out1 + fresh_tokens(5, 50), 30)
    out2 = run(second, rounds=2)
    assert second.num_cached_tokens == len(base) + len(out1) - 1  # started from t1's entry
    runner.spec_park("t2")
    parked = runner.session("t2")
    assert row_matches_history(parked)
    evictions = cache.num_evictions
    other = make_request("o1", fresh_tokens(200, 51), 20)
    run(other)  # another session takes the drafter, finishes, and its stream evicts t1's entry
    assert cache.num_evictions > evictions and cache.lookup(second.prompt_ids) is None
    assert row_matches_history(parked)
    runner.spec_resume("t2")
    for _ in range(10_000):
        outcome = runner.spec_round("t2")
        out2 += outcome.token_ids
        if outcome.finish_reason:
            runner.spec_finish("t2")
            break
    assert out2 == isolated(target.model, second, eos)
    assert runner.num_live_sessions() == 0 and cache.num_bytes <= cache.budget_bytes
    runner.close()


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_conversations_through_the_scheduler_match_isolated_decode(loaded, base, kind):
    """Three conversations of two turns through the fused tick, the slot rotating:
    second turns start from the cache, as classic rows and as sessions."""
    from models.runner import MlxRunner

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    runner = MlxRunner(target, make_drafter(kind, loaded), num_draft_tokens=3, prefix_cache_bytes=64 << 20)
    assert runner.can_fuse()
    scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on", grant_rounds=1, num_draft_tokens=3))
    histories = [base, base[:120] + fresh_tokens(60, 30), fresh_tokens(180, 31)]
    for turn in range(2):
        requests = [make_request(f"c{i}t{turn}", h, 20) for i, h in enumerate(histories)]
        for r in requests:
            scheduler.submit(r)
        streams = {r.request_id: [] for r in requests}
        for _ in range(2000):
            for event in scheduler.tick():
                streams[event.request_id] += event.token_ids
            if not scheduler.has_work():
                break
        for r in requests:
            assert streams[r.request_id] == isolated(target.model, r, eos), r.request_id
        if turn == 1:
            assert all(r.num_cached_tokens == len(h) - 1 - 3 for r, h in zip(requests, histories))
            assert any(r.spec.num_rounds and r.num_cached_tokens for r in requests)
        histories = [
            h + streams[r.request_id] + fresh_tokens(3, 40 + i) for i, (r, h) in enumerate(zip(requests, histories))
        ]
    stats = scheduler.snapshot()["prefix_cache"]
    draft = stats.get("draft", {"budget_bytes": 0, "bytes": 0})
    assert stats["hits"] >= 3 and stats["bytes"] <= stats["budget_bytes"] and draft["bytes"] <= draft["budget_bytes"]
    assert stats["budget_bytes"] + draft["budget_bytes"] == 64 << 20
    if kind == "draft_model":  # a second turn that speculated started its draft cache from the first's
        assert draft["hits"] >= 1 and draft["hit_tokens"] >= 120
    runner.close()


def test_a_demoted_session_stores_its_draft_prefix_and_a_parked_one_keeps_its_state(loaded, base):
    """Demotion drops the draft state, so its KV is stored; a park into the classic
    batch keeps the state for the next grant, so nothing is stored then."""
    from models.runner import MlxRunner

    target = loaded[0]
    runner = MlxRunner(target, make_drafter("draft_model", loaded), num_draft_tokens=3, prefix_cache_bytes=64 << 20)
    draft_cache = runner._slot.drafter.prefix_cache
    runner.spec_begin(make_request("p", base, 40))
    runner.spec_round("p")
    runner.spec_park_to_classic("p")
    assert draft_cache.num_stores == 0 and "p" in runner._parked_drafts
    runner.spec_begin(make_request("d", fresh_tokens(150, 60), 40))
    runner.spec_round("d")
    history = runner.session("d").history
    runner.spec_to_classic("d")
    assert draft_cache.num_stores == 1
    hit = draft_cache.lookup(history + [1])
    assert hit is not None and len(history) - 3 <= hit.num_tokens <= len(history)
    runner.close()


def test_the_choices_of_one_request_share_its_prompt_through_the_scheduler(loaded, base):
    """n = 4 choices of one prompt, arriving together on the fused tick: the first takes
    the slot, the second waits in its ring, the others become classic rows. Each prompt
    is stored once prefilled, so every later choice starts from it (the classic ones
    also share within their prefill group), and every stream is what it is with the
    cache off."""
    from models.runner import MlxRunner

    target = loaded[0]

    def run(cache_bytes):
        runner = MlxRunner(target, make_drafter("ngram", loaded), num_draft_tokens=3, prefix_cache_bytes=cache_bytes)
        scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on", tick_mode="fused", num_draft_tokens=3))
        requests = [make_request(f"c{i}", base, 16, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(4)]
        for r in requests:
            scheduler.submit(r)
        out = drain(scheduler, {r.request_id: [] for r in requests})
        runner.close()
        return out, requests

    on, with_cache = run(64 << 20)
    off, without = run(0)
    assert on == off
    assert with_cache[0].spec.num_rounds and with_cache[1].spec.num_rounds  # the slot and its ring
    assert [r.num_cached_tokens for r in with_cache] == [0] + [len(base) - 1] * 3
    assert [r.num_cached_tokens for r in without] == [0, 0] + [len(base) - 1] * 2  # the prefill group only


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_warm_requests_leave_nothing_behind(loaded, prompt_ids, kind):
    """The GPU load's throwaway requests (`runner_build.run_warm_batch`, run here on the
    CPU): no rows, no sessions, no prefix-cache entries or counts, nothing in the
    replica index, and a real request afterwards decodes as it would have without."""
    from models import runner_build
    from models.runner import MlxRunner

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    runner = MlxRunner(
        target, make_drafter(kind, loaded), num_draft_tokens=3, prefix_cache_bytes=64 << 20, replica_drafts=True
    )
    before = runner.prefix_cache_stats()
    assert runner_build.run_warm_batch(runner) == 5
    assert runner.num_classic_rows() == 0 and runner.num_live_sessions() == 0
    assert runner._classic.slab.num_rows == 0 and runner._slot.holder is None
    assert runner.prefix_cache_stats() == before and before["entries"] == 0
    assert runner._classic.replica_index is not None and len(runner._classic.replica_index) == 0
    request = make_request("after", prompt_ids[1], 16)
    assert drive(runner._classic, [request], drafts=True)["after"] == isolated(target.model, request, eos)
    runner.close()
