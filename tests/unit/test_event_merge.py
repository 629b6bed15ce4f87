"""Per-request streams on the replica: events that queued up while the last piece was
being sent are read as one (fewer, larger chunks when the replica falls behind)."""

import asyncio

from scheduler.events import TokenEvent
from scheduler.request import TokenLogprob
from serve_app.deployment.events import EventRouter, iterate


def read_all(queue, on_merge=None):
    async def go():
        return [e async for e in iterate(queue, on_merge)]

    return asyncio.run(go())


def test_waiting_events_are_read_as_one_and_the_finish_keeps_its_fields():
    router = EventRouter()
    queue = router.open("r")
    lp = [TokenLogprob(-0.5, ()), TokenLogprob(-1.0, ()), TokenLogprob(-0.1, ())]
    router.deliver([TokenEvent("r", [1], logprobs=lp[:1])])
    router.deliver([TokenEvent("r", [2, 3], logprobs=lp[1:])])
    merged = []
    events = read_all_after(
        queue, [TokenEvent("r", [4], finish_reason="length", prompt_tokens=7, num_cached_tokens=3)], merged
    )
    assert [e.token_ids for e in events] == [[1, 2, 3], [4]]
    assert events[0].logprobs == lp and events[0].finish_reason is None
    assert events[1].finish_reason == "length" and (events[1].prompt_tokens, events[1].num_cached_tokens) == (7, 3)
    assert merged == [1]


def read_all_after(queue, later, merged):
    """Read the stream; `later` arrives once the first piece was read (not merged into it)."""
    pending = list(later)

    async def go():
        out = []
        async for event in iterate(queue, merged.append):
            out.append(event)
            while pending:
                queue.put_nowait(pending.pop(0))
        return out

    return asyncio.run(go())


def test_a_finish_waiting_behind_tokens_is_merged_and_ends_the_stream():
    queue = asyncio.Queue()
    for e in (TokenEvent("r", [1]), TokenEvent("r", [2]), TokenEvent("r", [], finish_reason="stop")):
        queue.put_nowait(e)
    events = read_all(queue)
    assert len(events) == 1 and events[0].token_ids == [1, 2] and events[0].finish_reason == "stop"


def test_nothing_waiting_nothing_merged():
    queue = asyncio.Queue()
    queue.put_nowait(TokenEvent("r", [5], finish_reason="stop"))
    merged = []
    assert [e.token_ids for e in read_all(queue, merged.append)] == [[5]] and merged == []
