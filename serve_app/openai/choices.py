"""A generation's choices read into its response. Each choice is an async stream of
pieces, `(text, finish_reason, usage, error, logprob entries)` tuples from
`OpenAIService._pieces`; `collect_one` reads one into the JSON body's choice,
`sse_body` turns all of them into the lines of an event stream, and `merged`
interleaves several choices as their pieces come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from serve_app.deployment.client import SCHEDULER_LOST
from serve_app.openai.protocol import APIError
from serve_app.openai.responses import ResponseFormat, Usage, sse

logger = logging.getLogger("serve_app.http")  # where operators' filters expect the HTTP layer


async def collect_one(pieces) -> tuple:
    """(text, finish_reason, usage, logprob entries or None) of one choice."""
    texts: list[str] = []
    entries: list | None = None
    result = None
    # read to the end: the generator releases the request's queue once it has returned
    async for text, finish_reason, usage, error, released in pieces:  # ends after the final piece
        if error is not None:
            raise APIError(500, error, "server_error", code="generation_failed")
        texts.append(text)
        if released is not None:
            entries = (entries or []) + released
        if finish_reason is not None:
            result = "".join(texts), finish_reason, usage, entries
    if result is None:
        raise APIError(500, SCHEDULER_LOST, "server_error", code="generation_failed")
    return result


async def sse_body(fmt: ResponseFormat, streams: list, include_usage: bool):
    """The SSE lines of a streamed response: a first chunk per choice, text chunks as
    they come (held back to the end where the reply may be tool calls), each choice's
    finish, the usage chunk when asked, then `[DONE]`."""
    for i in range(len(streams)):
        yield sse(fmt.chunk("", None, first=True, index=i))
    held: dict[int, list[str]] = {}  # a reply that may be tool calls is sent once finished
    held_entries: dict[int, list] = {}
    usages: list = []
    async with contextlib.aclosing(merged(streams)) as pieces:
        async for i, (text, finish_reason, usage, error, released) in pieces:
            if error is not None:  # one choice failed: the request ends (the others are cancelled)
                yield sse(APIError(500, error, "server_error", code="generation_failed").body())
                break
            if fmt.holds_back_stream:
                held.setdefault(i, []).append(text)
                if released is not None:
                    held_entries[i] = held_entries.get(i, []) + released
            elif text:
                yield sse(fmt.chunk(text, None, index=i, entries=released))
                released = None
            if finish_reason is not None:
                if fmt.holds_back_stream:
                    ending = fmt.final_chunks(
                        "".join(held.pop(i, [])), finish_reason, i, held_entries.pop(i, None) if fmt.logprobs else None
                    )
                else:
                    ending = [fmt.chunk(None, finish_reason, index=i, entries=released or None)]
                for chunk in ending:
                    yield sse(chunk)
                usages.append(usage)
        else:
            if include_usage and len(usages) == len(streams):
                yield sse(fmt.usage_chunk(Usage.of_choices(usages)))
    yield sse("[DONE]")


async def merged(streams: list):
    """(choice index, piece) from every choice's pieces as they come. One choice reads
    its stream directly; several are read by one task each, all cancelled when the
    consumer stops (a client that went away, a failed choice), which cancels their
    requests (`OpenAIService._pieces`)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as pieces:  # a consumer that stops closes it
            async for piece in pieces:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pieces) -> None:
        try:
            async for piece in pieces:
                queue.put_nowait((index, piece))
        except Exception:  # noqa: BLE001 - reported as the choice's failure
            logger.exception("choice %d failed", index)
            queue.put_nowait((index, ("", "error", None, SCHEDULER_LOST, None)))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, piece = await queue.get()
            if piece is None:
                running -= 1
            else:
                yield index, piece
    finally:
        for task in tasks:
            task.cancel()
