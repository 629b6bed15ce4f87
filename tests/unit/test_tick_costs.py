"""The load-time cost tables' timing (models.forward.tick_costs): forwards of one size run
in turns, each beside the decode step of its own round."""

import statistics

from models.forward import tick_costs


def test_a_variant_is_the_baseline_plus_its_paired_difference(monkeypatch):
    """A machine that slows down partway moves both sides of a round's difference: a
    variant costs the baseline's median plus the median of its per-round differences,
    where separate medians would pair the baseline's fast rounds with the variant's slow
    ones (here: 26 where the draft adds 2 at one pace and 6 at the other)."""
    clock = [0.0]
    monkeypatch.setattr(tick_costs.time, "perf_counter", lambda: clock[0])
    # (decode, one_draft) milliseconds per round, the warm-up first; the machine slows 3x
    # between the decode step and the draft of the third measured round
    rounds = [(10, 12), (10, 12), (10, 12), (10, 36), (30, 36), (30, 36)]
    calls = iter(t / 1000 for pair in rounds for t in pair)
    order = []

    def forward(name):
        def run():
            clock[0] += next(calls)
            order.append(name)

        return run

    out = tick_costs._timed_in_turns({"decode": forward("decode"), "one_draft": forward("one_draft")})
    assert order == ["decode", "one_draft"] * len(rounds)  # in turns, one warm-up each
    ms = {name: round(t * 1000, 6) for name, t in out.items()}
    measured = rounds[1:]
    assert ms["decode"] == statistics.median(d for d, _ in measured) == 10
    assert ms["one_draft"] == 10 + statistics.median(v - d for d, v in measured) == 16  # the slow pace's 6
    assert statistics.median(v for _, v in measured) - ms["decode"] == 26  # separate medians
