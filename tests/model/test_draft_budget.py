"""The step's draft budget (scheduler.costs.step_draft_budget): when the rows' drafts do
not all fit, rows share it in lane order, and a row denied drafts skip_cap steps running
goes first; every stream still emits exactly what classic decode emits."""

import pytest

from models.batch import slab_batch
from models.batch.slab_batch import SlabBatch
from scheduler.costs import TickCosts, share_drafts, step_draft_budget, verify_costs
from scheduler.request import Lane, Request, SamplingParams

from .helpers import run_classic
from .test_slab import REPEATING

pytestmark = pytest.mark.model

# Fitted: 10 ms a forward, 1 ms a row, 1.6 ms a draft position: 3 rows may verify 4
# drafts in all (half of a 13 ms step), one row's worth.
COSTS = TickCosts({1: 11.0, 2: 12.0, 4: 14.0}, {0: 17.4, 2: 18.4}, 0.0, {2: 24.8, 4: 39.6})


def land_every_match(batch, accepted: bool = True) -> None:
    """Give every kind of a row's own match a long record of greedy drafts that all land
    (`accepted`) or all miss, so rows are priced by it rather than by `match_prior`."""
    from scheduler.costs import MATCH_MIN_VERIFIES

    for n in range(1, 4):
        for _ in range(8 * MATCH_MIN_VERIFIES):
            batch.match_acceptance[True].record(("own", n), 4, 4 if accepted else 0)


def test_the_budget_goes_by_lane_and_the_skip_cap_bounds_who_waits(loaded, monkeypatch):
    assert verify_costs(COSTS, 4) == pytest.approx((10.0, 1.0, 1.6, 0.0, 0.0, 0.0, 0.0))
    assert step_draft_budget(3, verify_costs(COSTS, 4), 0.5) == 4
    calls = []

    def spy(wants, lanes, denied, budget, skip_cap):
        given = share_drafts(wants, lanes, denied, budget, skip_cap)
        calls.append((list(wants), list(lanes), list(denied), budget, given))
        return given

    monkeypatch.setattr(slab_batch, "share_drafts", spy)
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    repeating = list(target.tokenizer.encode(REPEATING))
    lanes = dict(low=Lane.LOW, normal=Lane.NORMAL, high=Lane.HIGH)
    requests = [
        Request(rid, repeating[i:], SamplingParams(max_tokens=40), lane=lanes[rid]) for i, rid in enumerate(lanes)
    ]
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.costs, batch.skip_cap, batch.draft_step_share = COSTS, 2, 0.5
    land_every_match(batch)
    out, reasons, steps = {r.request_id: [] for r in requests}, {}, []
    for b in batch.prefill(requests):
        out[b.request_id] += b.token_ids
    while len(reasons) < len(requests):
        step = {}
        for b in batch.decode(drafts=True):
            out[b.request_id] += b.token_ids
            step[b.request_id] = b.num_drafted
            if b.finish_reason:
                reasons[b.request_id] = b.finish_reason
                batch.remove(b.request_id)
        steps.append(step)
    assert all(sum(s.values()) <= 4 for s in steps)
    full = [c for c in calls if len(c[0]) == 3]
    assert len(full) >= 6
    assert all(lanes_ == [2, 1, 0] and budget == 4 for _, lanes_, _, budget, _ in full)
    assert full[0][2] == [0, 0, 0] and full[0][4][2] == min(full[0][0][2], 4)  # high first
    for (wants, _, denied, _, given), (_, _, after, _, _) in zip(full, full[1:]):
        assert after == [0 if g or not w else d + 1 for w, d, g in zip(wants, denied, given)]
    # a row denied skip_cap steps running goes first: nobody waits past the cap plus
    # the overdue rows ahead of it
    assert max(d for c in full for d in c[2]) <= batch.skip_cap + 2
    assert any(c[4][0] for c in full)  # the low lane drafts too
    assert out == {rid: tokens for rid, (tokens, _) in run_classic(target.model, requests, eos).items()}


def test_a_session_keeps_its_lane_as_a_row():
    """A demoted or parked session's row shares the draft budget in its request's lane."""
    from .test_fused_real import bundled_runner

    runner = bundled_runner("ngram")
    try:
        prompt = runner.tokenizer.encode(REPEATING)
        for rid, lane in (("h", Lane.HIGH), ("l", Lane.LOW)):
            runner.spec_begin(Request(rid, prompt, SamplingParams(max_tokens=30), lane=lane))
            runner.spec_to_classic(rid)
        assert {rid: s.lane for rid, s in runner._classic._streams.items()} == {"h": 0, "l": 2}
        assert runner._sessions == {}  # the lanes went with the sessions
    finally:
        runner.close()


def test_a_row_drafts_from_the_replicas_past_outputs(loaded, prompt_ids):
    """A second request whose answer repeats a first one's drafts that answer from the
    replica's index, and emits exactly what classic decode emits."""
    from models.speculative.replica_index import ReplicaIndex

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    first = Request("first", prompt_ids[0], SamplingParams(max_tokens=48))
    again = Request("again", prompt_ids[0], SamplingParams(max_tokens=48))
    results = {}
    for replica in (False, True):
        batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
        batch.replica_index = ReplicaIndex() if replica else None
        runs = {}
        for request in (first, again):
            out, drafted, accepted = [], 0, 0
            batches = batch.prefill([request])
            while True:
                for b in batches:
                    out += b.token_ids
                    drafted, accepted = drafted + b.num_drafted, accepted + b.num_accepted
                if batches and batches[0].finish_reason:
                    batch.remove(request.request_id)
                    break
                batches = batch.decode(drafts=True)
            runs[request.request_id] = (out, drafted, accepted)
        results[replica] = runs
    classic = run_classic(target.model, [first], eos)["first"][0]
    for runs in results.values():
        assert runs["first"][0] == runs["again"][0] == classic
    (_, _, plain), (_, drafted, with_index) = results[False]["again"], results[True]["again"]
    assert with_index >= len(classic) // 2 and with_index > plain  # the first answer, drafted back
    assert results[True]["first"][1:] == results[False]["first"][1:]  # nothing stored yet: the same drafts


def test_the_slot_holder_drafts_from_the_replicas_past_outputs_too():
    """With replica_drafts an n-gram holder drafts a finished session's answer back."""
    from .test_fused_real import bundled_runner

    runner = bundled_runner("ngram")
    try:
        prompt = runner.tokenizer.encode("def parse_header(line):\n    name, _, value = line.partition(':')\n")
        runs = {}
        for on in (False, True):
            runner.replica_drafts = False  # a fresh index
            runner.replica_drafts = on
            for rid in ("first", "again"):
                first = runner.spec_begin(Request(f"{rid}-{on}", prompt, SamplingParams(max_tokens=48)))
                out, accepted, reason = list(first.token_ids), 0, first.finish_reason
                while reason is None:
                    outcome = runner.spec_round(f"{rid}-{on}")
                    out += outcome.token_ids
                    accepted += outcome.num_accepted
                    reason = outcome.finish_reason
                runner.spec_finish(f"{rid}-{on}")
                runs[(rid, on)] = (out, accepted)
        assert len({tuple(out) for out, _ in runs.values()}) == 1
        assert runs[("again", True)][1] > runs[("again", False)][1]
        assert runs[("again", True)][1] >= len(runs[("again", True)][0]) // 2
    finally:
        runner.close()


def test_by_default_no_step_budget_cuts_a_rows_drafts(loaded, monkeypatch):
    calls = []
    monkeypatch.setattr(slab_batch, "share_drafts", lambda *a: calls.append(a) or a[0])
    target = loaded[0]
    repeating = list(target.tokenizer.encode(REPEATING))
    batch = SlabBatch(target.model, eos_token_ids=sorted(target.tokenizer.eos_token_ids), row_drafts=True)
    batch.costs = COSTS
    assert batch.draft_step_share == 0
    batch.prefill([Request(rid, repeating[i:], SamplingParams(max_tokens=40)) for i, rid in enumerate("abc")])
    per_step = []
    while batch.num_rows():
        step = batch.decode(drafts=True)
        per_step.append(sum(b.num_drafted for b in step))
        for b in step:
            if b.finish_reason:
                batch.remove(b.request_id)
    assert calls == [] and max(per_step) > 4  # more than a 0.5 share's 4 per step would allow


def test_a_rows_drafts_are_priced_by_the_record_of_their_kind_of_match(loaded):
    """Once a kind of lookup match has a record, a row's drafts from it are priced by that
    record, not by the row's own rounds: a row whose own estimate is at the prior does not
    draft from matches that have failed, and one whose own estimate has collapsed still
    drafts from matches that land. The stream stays what classic decode emits."""
    from scheduler.costs import RowAcceptance

    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    request = Request("r", list(target.tokenizer.encode(REPEATING)), SamplingParams(max_tokens=30))
    expected = run_classic(target.model, [request], eos)["r"][0]

    def run(match_alpha: float, own_alpha: float) -> tuple[list[int], int, set]:
        batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
        batch.costs = COSTS
        land_every_match(batch, match_alpha > 0.5)
        out = [t for b in batch.prefill([request]) for t in b.token_ids]
        batch._streams["r"].acceptance = RowAcceptance(own_alpha, 1.0 - own_alpha)
        drafted, matches = 0, set()
        while True:
            (b,) = batch.decode(drafts=True)
            out += b.token_ids
            drafted += b.num_drafted
            if b.num_drafted:
                matches.add(batch._streams["r"].match if "r" in batch._streams else None)
            if b.finish_reason:
                return out, drafted, matches

    out, drafted, _ = run(match_alpha=0.0, own_alpha=0.8)
    assert drafted == 0 and out == expected
    out, drafted, matches = run(match_alpha=1.0, own_alpha=0.05)
    assert drafted > 0 and out == expected
    assert matches <= {("own", n) for n in range(1, 4)} | {None}


def test_until_a_kind_of_match_has_a_record_its_length_caps_a_rows_price(loaded):
    """A fresh replica prices a row's drafts from a one-token match at `match_prior`'s
    cap, not at the row's optimistic start; a row's own lower estimate and a kind's own
    record, once there, take over."""
    from scheduler.costs import RowAcceptance, match_prior

    target = loaded[0]
    batch = SlabBatch(target.model, eos_token_ids=sorted(target.tokenizer.eos_token_ids), row_drafts=True)
    batch.prefill([Request("r", list(target.tokenizer.encode(REPEATING)), SamplingParams(max_tokens=8))])
    stream = batch._streams["r"]
    stream.acceptance = RowAcceptance(0.8, 0.2)
    for match in (("own", 1), ("own", 2), ("own", 3), ("replica", 4)):
        stream.match = match
        assert batch._alpha(stream) == pytest.approx(min(0.8, match_prior(match)))
    assert match_prior(("own", 1)) < match_prior(("own", 3)) < 0.8
    stream.acceptance = RowAcceptance(0.1, 0.9)
    assert batch._alpha(stream) == pytest.approx(0.1)
    land_every_match(batch)
    stream.match = ("own", 1)
    assert batch._alpha(stream) > 0.95


def test_the_rows_drafts_are_priced_by_the_steps_the_batch_times(loaded):
    """A packed slab the runner builds times every step and moves the fit its rows' drafts
    are priced by (`scheduler.costs.LiveDraftFit`): COSTS says a plain step takes seconds, the toy's take
    milliseconds, so the fixed cost falls; the streams stay what classic decode emits."""
    target = loaded[0]
    eos = sorted(target.tokenizer.eos_token_ids)
    repeating = list(target.tokenizer.encode(REPEATING))
    requests = [Request(rid, repeating[i:], SamplingParams(max_tokens=30)) for i, rid in enumerate("ab")]
    batch = SlabBatch(target.model, eos_token_ids=eos, row_drafts=True)
    batch.costs, batch.price_by_steps = COSTS, True  # as the runner sets them
    land_every_match(batch)
    measured = verify_costs(COSTS, 4)
    out = {r.request_id: [] for r in requests}
    for b in batch.prefill(requests):
        out[b.request_id] += b.token_ids
    while batch.num_rows():
        for b in batch.decode(drafts=True):
            out[b.request_id] += b.token_ids
            if b.finish_reason:
                batch.remove(b.request_id)
    live = batch.step_stats()["draft_costs"]
    assert live["plain_steps"] + live["drafting_steps"] == batch.num_steps and live["drafting_steps"] > 0
    assert live["plain_extra_ms"] < 0 and batch._fit.per_forward < measured.per_forward
    assert out == {rid: tokens for rid, (tokens, _) in run_classic(target.model, requests, eos).items()}
