"""The OpenAI-compatible HTTP layer: a Starlette app over an `EngineClient`.

Testable without Ray: give it any `EngineClient` (e.g. over a `LocalSource`). Until
`mark_ready` (the model loaded) /health answers 503 (`model_loading`) at once, and /v1
requests wait for the load: Serve routes to a replica as soon as it is constructed, so
a replica it adds or replaces must not fail its share of traffic. A failed load
(`fail_load`) is 503 `model_load_failed` naming the fault. Every
client-caused problem is a 4xx with an OpenAI error body; a full scheduler queue is a
503 with `Retry-After`; a client that goes away has its request cancelled in the
scheduler, whatever phase it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from scheduler.ledger import QueueFull
from scheduler.request import Lane, Request, SamplingParams, parse_priority
from serve_app.client import SCHEDULER_LOST, EngineClient
from serve_app.codec import TextCodec
from serve_app.config import ServeArgs
from serve_app.errors import EXCEPTION_HANDLERS
from serve_app.logprobs import LogprobFormat, LogprobTrail
from serve_app.metrics import ReplicaMetrics, StreamTimes
from serve_app.protocol import APIError, GenerationSpec, decode_json, parse_generation
from serve_app.ready import health_body
from serve_app.responses import CompletionText, ResponseFormat, Usage, sse
from serve_app.sampling_defaults import request_defaults

logger = logging.getLogger(__name__)

DRAIN_AFTER_STOP_S = 2.0  # wait for the cancelled request's final stats after a text stop


class OpenAIService:
    def __init__(self, client: EngineClient, codec: TextCodec | None, args: ServeArgs,
                 metrics: ReplicaMetrics | None = None, identity: dict | None = None) -> None:
        """`codec` None: still loading; call `mark_ready(codec)` once `client` is started."""
        self.client = client
        self.identity = dict(identity or {})  # e.g. replica and node ids, for operators
        self.codec = codec
        self.args = args
        self.metrics = metrics or ReplicaMetrics(args.model_name, args.num_draft_tokens)
        self.load_error: str | None = None  # why loading failed, once it has
        # SamplingParams fields for what a request omits (`serve_app.sampling_defaults`).
        self.sampling_defaults = request_defaults(args.sampling_defaults, None)
        self._load_ended = asyncio.Event()
        if codec is not None:
            self._load_ended.set()
        self._background: set[asyncio.Task] = set()
        self._started: set[str] = set()  # requests whose pieces are being read (`_abandon_unstarted`)

    @property
    def ready(self) -> bool:
        return self.codec is not None and self.load_error is None

    def mark_ready(self, codec: TextCodec, generation_config: dict | None = None) -> None:
        """`generation_config`: the model's sampling defaults (`read_generation_config`),
        used where the deployment's `use_generation_config` says so."""
        self.codec = codec
        if generation_config and self.args.use_generation_config:
            self.sampling_defaults = request_defaults(self.args.sampling_defaults, generation_config)
        logger.info("request sampling defaults: %s", self.sampling_defaults)
        self._load_ended.set()
        logger.info("specslot replica ready: %s", health_body(self.args, self.client.info))

    def fail_load(self, message: str) -> None:
        self.load_error = message
        self._load_ended.set()

    def _check_loaded(self) -> None:
        if self.load_error is not None:
            raise APIError(503, self.load_error, "server_error", code="model_load_failed")
        if self.codec is None:
            raise APIError(503, "the model is loading; retry later", "server_error",
                           code="model_loading", headers=self._retry())

    async def _wait_loaded(self) -> None:
        await self._load_ended.wait()
        self._check_loaded()

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),  # ids may hold "/"
            Route("/v1/internal/scheduler", self.scheduler_state, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)

    # -- small endpoints ------------------------------------------------------------------
    async def health(self, request: HTTPRequest) -> Response:
        self._check_loaded()
        if not self.client.healthy:
            raise APIError(503, "the scheduler is restarting; retry later", "server_error",
                           code="scheduler_unavailable", headers=self._retry())
        return JSONResponse(health_body(self.args, self.client.info))

    async def prometheus(self, request: HTTPRequest) -> Response:
        snapshot = await self._snapshot_or_none()
        # The header names the replica that answered: through Serve's proxy, one of them.
        return Response(self.metrics.render(snapshot), media_type="text/plain; version=0.0.4",
                        headers=self._id_header())

    async def models(self, request: HTTPRequest) -> Response:
        self._lane_cap(request)
        await self._wait_loaded()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        self._lane_cap(request)
        await self._wait_loaded()
        model_id = request.path_params["model_id"]
        if model_id != self.args.model_name:
            raise APIError(404, f"model '{model_id[:64]}' is not served here; "
                           f"use '{self.args.model_name}'", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.args.model_name, "object": "model", "created": 0, "owned_by": "specslot"}

    async def scheduler_state(self, request: HTTPRequest) -> Response:
        self._lane_cap(request)
        await self._wait_loaded()
        snapshot = await self._snapshot_or_none()
        if snapshot is None:
            raise APIError(503, "scheduler unavailable", "server_error", headers=self._retry())
        snapshot = dict(snapshot)
        snapshot["replica"] = {**self.identity, "open_streams": self.client.num_open_streams,
                               "scheduler_restarts": self.client.num_restarts,
                               "scheduler_node_id": self.client.info.get("node_id"),
                               "scheduler_actor": self.client.info.get("actor_name"),
                               "scheduler_pid": self.client.info.get("pid")}
        return JSONResponse(snapshot)

    async def _snapshot_or_none(self) -> dict | None:
        if not self.ready:  # no scheduler yet: /metrics still renders the replica's own counters
            return None
        try:
            return await self.client.snapshot()
        except Exception:
            logger.warning("scheduler snapshot failed", exc_info=True)
            return None

    # -- generation -------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, http: HTTPRequest, chat: bool) -> Response:
        lane_cap = self._lane_cap(http)
        await self._wait_loaded()
        arrival = time.monotonic()  # TTFT and e2e start here
        spec = parse_generation(decode_json(await self._read_body(http)), chat)
        if spec.model is not None and spec.model != self.args.model_name:
            raise APIError(400, f"model '{spec.model[:64]}' is not served here; "
                           f"use '{self.args.model_name}'", param="model", code="model_not_found")
        prompt_ids = self._prompt_ids(spec)
        max_tokens = self._max_tokens(spec, len(prompt_ids))
        lane = Lane(max(parse_priority(http.headers.get("x-priority")), lane_cap))
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id = prefix + uuid.uuid4().hex
        # n choices are n engine requests; a seeded request's choices get seed, seed + 1, ...
        requests = [Request(request_id if spec.n == 1 else f"{request_id}-{i}", prompt_ids,
                            self._sampling(spec, max_tokens, i), lane=lane) for i in range(spec.n)]
        streams = []
        for request in requests:
            try:
                events = await self.client.submit(request)
            except Exception as exc:
                for submitted in requests[:len(streams)]:
                    self._spawn(self._abandon(submitted.request_id, lane.name.lower()))
                raise self._submit_error(request.request_id, exc) from None
            streams.append(self._pieces(request, events, spec, len(prompt_ids), StreamTimes(arrival=arrival)))
        logprobs = None if spec.logprobs is None else LogprobFormat(self.codec.token_text, chat)
        fmt = ResponseFormat(request_id, self.args.model_name, chat, spec.output, logprobs)
        if spec.stream:
            return StreamingResponse(self._sse(fmt, streams, requests, spec.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **self._id_header()})
        response = await self._collect(fmt, streams, requests)
        response.headers.update(self._id_header())
        return response

    def _submit_error(self, request_id: str, exc: Exception) -> APIError:
        self.metrics.rejected.labels("503").inc()
        if isinstance(exc, QueueFull):
            return APIError(503, "the server is at capacity; retry later", "server_error",
                            code="queue_full", headers=self._retry())
        # scheduler dead or restarting: the replica recovers it
        logger.warning("submitting %s failed", request_id, exc_info=exc)
        return APIError(503, "the scheduler is restarting; retry later", "server_error",
                        code="scheduler_unavailable", headers=self._retry())

    def _id_header(self) -> dict[str, str]:
        replica = self.identity.get("replica_id")
        return {"X-Specslot-Replica": replica} if replica else {}

    async def _collect(self, fmt: ResponseFormat, streams: list, requests: list[Request]) -> Response:
        """All choices, read concurrently; the first to fail fails the request and
        cancels the others."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._collect_one(s)) for s in streams] if len(streams) > 1 else []
        try:
            results = await asyncio.gather(*tasks) if tasks else [await self._collect_one(streams[0])]
        finally:
            for task in tasks:
                task.cancel()
            self._abandon_unstarted(streams, requests)
        choices = [fmt.choice(i, text, finish, entries) for i, (text, finish, _, entries) in enumerate(results)]
        return JSONResponse(fmt.full(choices, Usage.of_choices([usage for _, _, usage, _ in results])))

    @staticmethod
    async def _collect_one(pieces) -> tuple:
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

    async def _sse(self, fmt: ResponseFormat, streams: list, requests: list[Request], include_usage: bool):
        try:
            async with contextlib.aclosing(self._sse_body(fmt, streams, include_usage)) as body:
                async for data in body:
                    yield data
        finally:
            self._abandon_unstarted(streams, requests)

    def _abandon_unstarted(self, streams: list, requests: list[Request]) -> None:
        """Cancel the requests whose pieces were never read (a client gone before its
        choice's first read): their own cleanup (`_pieces`) never runs."""
        for request in requests:
            if request.request_id not in self._started:
                self._spawn(self._abandon(request.request_id, request.lane.name.lower()))
        self._started.difference_update(r.request_id for r in requests)

    async def _sse_body(self, fmt: ResponseFormat, streams: list, include_usage: bool):
        for i in range(len(streams)):
            yield sse(fmt.chunk("", None, first=True, index=i))
        held: dict[int, list[str]] = {}  # a reply that may be tool calls is sent once finished
        held_entries: dict[int, list] = {}
        usages: list = []
        async with contextlib.aclosing(_merged(streams)) as pieces:
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
                        ending = fmt.final_chunks("".join(held.pop(i, [])), finish_reason, i,
                                                  held_entries.pop(i, None) if fmt.logprobs else None)
                    else:
                        ending = [fmt.chunk(None, finish_reason, index=i, entries=released or None)]
                    for chunk in ending:
                        yield sse(chunk)
                    usages.append(usage)
            else:
                if include_usage and len(usages) == len(streams):
                    yield sse(fmt.usage_chunk(Usage.of_choices(usages)))
        yield sse("[DONE]")

    async def _pieces(self, request: Request, events, spec: GenerationSpec, num_prompt: int,
                      times: StreamTimes):
        """(text, finish_reason, usage, error, logprob entries) tuples of one request
        (entries: those of the tokens whose text this piece begins, or on the final
        piece every billed token's not given yet; None without logprobs); cancels the
        request if abandoned."""
        rid, lane = request.request_id, request.lane.name.lower()
        self._started.add(rid)
        decoder = self.codec.decoder(skip_ids=self.client.info.get("eos_token_ids") or ())
        trail = None if spec.logprobs is None else LogprobTrail()
        completion = CompletionText(decoder, spec.stop, per_token=trail is not None)
        done = False
        try:
            async for event in events:
                if event.token_ids:
                    self.metrics.record_tokens(times, len(event.token_ids), num_prompt, time.monotonic())
                text = completion.add(event.token_ids)
                if trail is not None:
                    trail.add(event.token_ids, event.logprobs)
                if completion.stopped:
                    final = event if event.finish_reason else await self._cancel_and_drain(rid, events)
                    finish, error = "stop", None
                elif event.finish_reason is None:
                    released = None if trail is None else trail.release(completion.starts, completion.num_sent)
                    if text or released:
                        yield text, None, None, None, released
                    continue
                elif event.finish_reason in ("stop", "length"):
                    text += completion.finish()
                    finish = "stop" if completion.stopped else event.finish_reason
                    error, final = None, event
                else:  # "cancelled" by a stopping scheduler, or "error"
                    finish, error, final = "error", SCHEDULER_LOST, event
                    if event.error:
                        logger.warning("request %s failed: %s", rid, event.error)
                done = True
                stats = None if final is None else final.stats
                cached = 0 if final is None else final.num_cached_tokens
                self.metrics.record_finish(lane, finish, times, time.monotonic(), stats,
                                           None if final is None else final.times)
                released = None if trail is None else trail.release(completion.starts, 0, completion.num_billed)
                yield text, finish, Usage(num_prompt, completion.num_billed, stats, cached), error, released
                return
        finally:
            if not done:  # the client went away (or the response task was cancelled)
                self._spawn(self._abandon(rid, lane))
            else:
                self.client.release(rid)

    async def _cancel_and_drain(self, rid: str, events):
        """The finishing event after a text stop (its stats and times), or None."""
        await self.client.cancel(rid)
        try:
            async with asyncio.timeout(DRAIN_AFTER_STOP_S):
                async for event in events:
                    if event.finish_reason is not None:
                        return event
        except TimeoutError:
            self.client.release(rid)
        return None

    async def _abandon(self, rid: str, lane: str) -> None:
        self.client.release(rid)
        await self.client.cancel(rid)
        self.metrics.record_abort(lane)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- input checks -----------------------------------------------------------------------
    def _lane_cap(self, http: HTTPRequest) -> Lane:
        auth = http.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        cap = self.args.lane_cap_for(key)
        if cap is None:
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")
        return cap

    async def _read_body(self, http: HTTPRequest) -> bytes:
        limit = self.args.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _prompt_ids(self, spec: GenerationSpec) -> list[int]:
        if spec.prompt_ids is not None:
            ids = spec.prompt_ids
            if any(t >= self.codec.vocab_size for t in ids):
                raise APIError(400, "prompt contains token ids outside the vocabulary", param="prompt")
        elif spec.chat:
            tools = list(spec.output.tools) if spec.output.tools else None
            ids = self.codec.encode_chat(spec.messages, spec.chat_template_kwargs, tools)
        else:
            ids = self.codec.encode(spec.prompt_text)
        if not ids:
            raise APIError(400, "prompt is empty", param="messages" if spec.chat else "prompt")
        return ids

    def _max_tokens(self, spec: GenerationSpec, num_prompt: int) -> int:
        max_context = self.client.info.get("max_context")
        param = "messages" if spec.chat else "prompt"
        if max_context is not None and num_prompt >= max_context:
            raise APIError(400, f"prompt has {num_prompt} tokens; this model's context is "
                           f"{max_context}", param=param, code="context_length_exceeded")
        limit = self.args.max_tokens_limit
        if spec.max_tokens is None:
            room = limit if max_context is None else max_context - num_prompt
            return min(self.args.default_max_tokens, room)
        if spec.max_tokens > limit:
            raise APIError(400, f"max_tokens must be at most {limit}", param="max_tokens",
                           code="invalid_value")
        if max_context is not None and num_prompt + spec.max_tokens > max_context:
            raise APIError(400, f"prompt ({num_prompt} tokens) plus max_tokens exceeds the "
                           f"context of {max_context}", param="max_tokens",
                           code="context_length_exceeded")
        return spec.max_tokens

    def _sampling(self, spec: GenerationSpec, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The parameters of choice `choice` (of `spec.n`): a seeded request's choice i
        has seed + i (wrapping at 2**64), so choices differ and each is reproducible."""
        fields = {**self.sampling_defaults, **spec.sampling}
        vocab = self.codec.vocab_size
        for token_id, _ in fields.get("logit_bias", ()):
            if token_id >= vocab:
                raise APIError(400, f"logit_bias: token id {token_id} is outside the vocabulary "
                               f"({vocab} tokens)", param="logit_bias", code="invalid_value")
        seed = spec.seed
        if seed is not None and choice:
            seed = (seed + choice) % 2**64 if seed >= 0 else seed + choice
        return SamplingParams(max_tokens=max_tokens, seed=seed, grammar=spec.output.grammar, logprobs=spec.logprobs,
                              stop_token_ids=tuple(self.client.info.get("eos_token_ids") or ()), **fields)

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.args.retry_after_seconds)}



async def _merged(streams: list):
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
