"""Resumability: sessions driven round by round in any interleaving produce exactly their
isolated outputs, and each keeps its own draft KV cache."""

import random

import pytest

from models.speculative.drafters import DraftModelDrafter
from models.speculative.session import PROBE_TOKENS

from .conftest import make_request
from .helpers import make_drafter, new_session, run_session

pytestmark = pytest.mark.model

K = 4
PROMPT_INDICES = (0, 6, 13)


def interleaved_runs(loaded, requests, drafter, seed):
    """Drive sessions one round at a time in a random order; returns per-request
    (tokens, reason, rounds) like `run_session`."""
    rng = random.Random(seed)
    sessions = {r.request_id: new_session(loaded, r, K) for r in requests}
    results = {rid: [[], None, []] for rid in sessions}
    started = set()
    live = list(sessions)
    while live:
        rid = rng.choice(live)
        session = sessions[rid]
        session.bind(drafter)  # take
        if rid not in started:
            started.add(rid)
            r = session.begin()
            results[rid][0] += r.token_ids
        else:
            r = session.step()
            results[rid][0] += r.token_ids
            results[rid][2].append((r.token_ids, r.num_drafted, r.num_accepted))
        session.unbind()  # park: the handle goes back, the session keeps its state
        if r.finish_reason:
            results[rid][1] = r.finish_reason
            session.finish()
            live.remove(rid)
    return {rid: tuple(v) for rid, v in results.items()}


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleaving_matches_isolated_runs(loaded, prompt_ids, kind, seed):
    drafter = make_drafter(kind, loaded)
    requests = [make_request(f"r{i}", prompt_ids[i], 20) for i in PROMPT_INDICES]
    isolated = {r.request_id: run_session(loaded, r, K, drafter) for r in requests}
    interleaved = interleaved_runs(loaded, requests, drafter, seed)
    # Same tokens AND the same rounds (drafted, accepted): a session whose draft state
    # was disturbed would still emit correct tokens, but accept differently.
    assert interleaved == isolated


class SharedCacheDrafter(DraftModelDrafter):
    """A broken drafter that keeps one draft state for every session."""

    def __init__(self, model, name):
        super().__init__(model, name)
        self._shared = None

    def new_state(self, prompt_ids):
        if self._shared is None:
            self._shared = super().new_state(prompt_ids)
        return self._shared


def test_the_interleaving_check_catches_a_shared_draft_cache(loaded, prompt_ids):
    requests = [make_request(f"r{i}", prompt_ids[i], 20) for i in PROMPT_INDICES]
    honest = make_drafter("draft_model", loaded)
    isolated = {r.request_id: run_session(loaded, r, K, honest) for r in requests}
    broken = SharedCacheDrafter(loaded[1].model, loaded[1].name)
    try:
        interleaved = interleaved_runs(loaded, requests, broken, seed=0)
    except Exception:  # a shared cache can also run out of sync with a session's history
        interleaved = None
    assert interleaved != isolated


def test_each_session_owns_its_draft_cache(loaded, prompt_ids):
    drafter = make_drafter("draft_model", loaded)
    a = new_session(loaded, make_request("a", prompt_ids[0]), K, drafter)
    b = new_session(loaded, make_request("b", prompt_ids[6]), K, drafter)
    a.begin()
    b.begin()
    a.step()
    b.step()
    assert a.draft_state is not b.draft_state
    assert a.draft_state.cache is not b.draft_state.cache
    # Each draft cache holds its own history minus what it has not yet been fed.
    for s in (a, b):
        assert s.draft_state.cache[0].offset == s.draft_state.num_cached
        assert s.draft_state.num_cached <= len(s.history) - 1


def test_probe_rounds_interleave_with_real_rounds(loaded, prompt_ids):
    """Probe rounds (no drafter bound; a burst of classic steps) keep the session exact."""
    drafter = make_drafter("draft_model", loaded)
    request = make_request("p", prompt_ids[3], 4 * PROBE_TOKENS + 24)
    expected, _, _ = run_session(loaded, request, K, drafter)
    session = new_session(loaded, request, K, drafter)
    tokens = list(session.begin().token_ids)
    session.unbind()
    for probe in (True, True, False, True, False, False, True, False, False, False):
        if session.finished:
            break
        if probe:
            session.unbind()
        else:
            session.bind(drafter)
        r = session.step(probe=probe)
        if probe:
            assert (r.num_drafted, r.num_accepted, len(r.token_ids)) == (0, 0, PROBE_TOKENS)
            assert 0 < r.seconds_per_token < r.seconds
        tokens += r.token_ids
    while not session.finished:
        session.bind(drafter)
        tokens += session.step().token_ids
    assert tokens == expected
    assert session.counters.num_probe_rounds == 4


@pytest.mark.parametrize("max_tokens", [2, PROBE_TOKENS + 3])
def test_probe_round_near_the_budget_and_at_a_stop_token(loaded, prompt_ids, max_tokens):
    """A probe never emits past max_tokens, ends at a stop token, and leaves the cache
    holding every token but the pending one."""
    request = make_request("p", prompt_ids[5], max_tokens)
    expected, reason, _ = run_session(loaded, request, K, make_drafter("ngram", loaded))
    session = new_session(loaded, request, K)
    tokens = list(session.begin().token_ids)
    while not session.finished:
        r = session.step(probe=True)
        tokens += r.token_ids
        assert r.finish_reason or session.cache[0].offset == len(session.history) - 1
    assert (tokens, session.finish_reason) == (expected, reason)

    stop = expected[min(3, len(expected) - 1)]
    stopping = make_request("q", prompt_ids[5], max_tokens, stop_token_ids=(stop,))
    session = new_session(loaded, stopping, K)
    tokens = list(session.begin().token_ids)
    while not session.finished:
        tokens += session.step(probe=True).token_ids
    assert (tokens, session.finish_reason) == (expected[: expected.index(stop) + 1], "stop")
