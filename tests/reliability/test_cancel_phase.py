"""The phase a cancellation is counted under (scheduler.counters.cancel_phase)."""

import pytest

from scheduler.counters import CANCEL_PHASES, cancel_phase
from scheduler.request import RequestStatus as S


@pytest.mark.parametrize(
    "status, override, phase",
    [
        (S.QUEUED, None, "queued"),
        (S.CLASSIC, None, "classic"),
        (S.WAITING, None, "waiting"),
        (S.PARKED, None, "parked"),
        (S.ACTIVE, None, "active"),
        (S.CLASSIC, "prefill", "prefill"),
        (S.ACTIVE, "prefill", "prefill"),
        (S.QUEUED, "inbox", "inbox"),
    ],
)
def test_cancel_phase_table(status, override, phase):
    assert cancel_phase(status, override) == phase
    assert phase in CANCEL_PHASES


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError):
        cancel_phase(S.ACTIVE, "decoding")
