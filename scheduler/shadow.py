"""Shadow rounds: what a classic row would have accepted in the slot, read off the
tokens it emits anyway.

The cost gate (`scheduler.costs`) grants the slot only where a row's acceptance pays;
unmeasured, a row that accepts nothing is granted again and again to find that out. With an
n-gram drafter the measurement is free: a round opens where the slot would (proposing
`num_draft_tokens` from the row's history) and matches the row's next tokens to the drafts.
The row samples each draft with the probability the verify accepts it, so the leading
matches have the accepted count's distribution (greedy: they are it). A round ends at the
first mismatch or at the token after the last draft; a lookup that drafts nothing is a round
with nothing gained. `ShadowRounds` keeps one index per row (the last `MAX_HISTORY` tokens,
then extended) and hands each round's matches to `record(request, matches)`; tokens emitted
as the slot's holder are folded in unscored.
See docs/CONTINUOUS_BATCHING.md, "The fused tick" ("Shadow rounds").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from scheduler.request import Request

# Positions of prompt + output a row's index starts from: the drafts a lookup finds
# come mostly from recent text, and the build (one dict entry per n-gram) runs inside a
# tick (its cost: docs/CONTINUOUS_BATCHING.md, "The fused tick", shadow rounds).
MAX_HISTORY = 1024


class Proposer(Protocol):
    def extend(self, tokens: Sequence[int]) -> None: ...
    def propose(self, k: int) -> list[int]: ...


@dataclass
class _Track:
    index: Proposer
    seen: int  # output tokens folded into `index`
    drafts: list[int] | None = None  # the open round's proposal (None: no round open)
    matched: int = 0


class ShadowRounds:
    def __init__(
        self,
        make_index: Callable[[Sequence[int]], Proposer],
        num_drafts: Callable[[], int],
        record: Callable[[Request, int], None],
    ) -> None:
        """`make_index(history)`: a proposer over `history` that proposes as the slot's
        drafter does; `num_drafts()`: tokens a round drafts (K); `record(request,
        matches)`: a shadow round of `request` ended with `matches` leading drafts matched."""
        self._make_index = make_index
        self._num_drafts = num_drafts
        self._record = record
        self._tracks: dict[str, _Track] = {}
        self.num_rounds = 0  # shadow rounds recorded (snapshot)

    def __len__(self) -> int:
        return len(self._tracks)

    def observe(self, request: Request, num_new: int) -> None:
        """`request` emitted its last `num_new` output tokens as a classic row (they are
        already in `request.output_ids`): score them against the open round's drafts."""
        outputs = request.output_ids
        before = len(outputs) - num_new
        track = self._tracks.get(request.request_id)
        if track is None:
            history = [*request.prompt_ids, *outputs[:before]][-MAX_HISTORY:]
            track = self._tracks[request.request_id] = _Track(self._make_index(history), before)
        elif track.seen != before:  # emitted as the slot's holder since: fold them in unscored
            track.index.extend(outputs[track.seen : before])
            track.drafts = None
        for token in outputs[before:]:
            if track.drafts is None:  # a round opens where the history stands
                track.drafts, track.matched = track.index.propose(self._num_drafts()), 0
            if track.matched < len(track.drafts) and token == track.drafts[track.matched]:
                track.matched += 1
            else:  # the verify's correction or bonus token (with no drafts, the round's only one): it ends
                self.num_rounds += 1
                self._record(request, track.matched)
                track.drafts = None
            track.index.extend((token,))
        track.seen = len(outputs)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
