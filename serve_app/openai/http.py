"""The OpenAI-compatible HTTP layer: a Starlette app over an `EngineClient`.

Testable without Ray: give it any `EngineClient` (e.g. over a `LocalSource`). Until
`mark_ready` (the model loaded) /health answers 503 (`model_loading`) at once, and /v1
requests wait for the load: Serve routes to a replica as soon as it is constructed, so
a replica it adds or replaces must not fail its share of traffic. A failed load
(`fail_load`) is 503 `model_load_failed` naming the fault. Every
client-caused problem is a 4xx with an OpenAI error body; a full scheduler queue is a
503 with `Retry-After`; a client that goes away has its request cancelled in the
scheduler, whatever phase it is in. The input checks are `serve_app.openai.request_inputs`;
reading the choices into a JSON body or an event stream is `serve_app.openai.choices`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scheduler.ledger import QueueFull
from scheduler.request import Lane, Request, parse_priority
from serve_app.configuration.args import ServeArgs
from serve_app.deployment.client import SCHEDULER_LOST, EngineClient
from serve_app.deployment.metrics import ReplicaMetrics, StreamTimes
from serve_app.deployment.ready import health_body
from serve_app.openai import request_inputs
from serve_app.openai.choices import collect_one, sse_body
from serve_app.openai.codec import TextCodec
from serve_app.openai.errors import EXCEPTION_HANDLERS
from serve_app.openai.logprobs import LogprobFormat, LogprobTrail
from serve_app.openai.protocol import APIError, GenerationSpec, decode_json, parse_generation
from serve_app.openai.responses import CompletionText, ResponseFormat, Usage
from serve_app.openai.sampling_defaults import request_defaults

logger = logging.getLogger("serve_app.http")  # a stable name for operators' log filters

DRAIN_AFTER_STOP_S = 2.0  # wait for the cancelled request's final stats after a text stop
# A request body at least this large is tokenized on the replica's tokenizer thread, not on
# the event loop that streams every other request's tokens; below it an encode takes a few
# ms, about what the hop to the thread adds.
TOKENIZE_OFF_LOOP_BYTES = 16 * 1024


class OpenAIService:
    def __init__(
        self,
        client: EngineClient,
        codec: TextCodec | None,
        args: ServeArgs,
        metrics: ReplicaMetrics | None = None,
        identity: dict | None = None,
    ) -> None:
        """`codec` None: still loading; call `mark_ready(codec)` once `client` is started."""
        self.client = client
        self.identity = dict(identity or {})  # e.g. replica and node ids, for operators
        self.codec = codec
        self.args = args
        self.metrics = metrics or ReplicaMetrics(args.model_name, args.num_draft_tokens)
        self.load_error: str | None = None  # why loading failed, once it has
        # SamplingParams fields for what a request omits (`serve_app.openai.sampling_defaults`).
        self.sampling_defaults = request_defaults(args.sampling_defaults, None)
        self._load_ended = asyncio.Event()
        if codec is not None:
            self._load_ended.set()
        self._background: set[asyncio.Task] = set()
        self._started: set[str] = set()  # requests whose pieces are being read (`_abandon_unstarted`)
        self._tokenizer_thread: ThreadPoolExecutor | None = None  # `_prompt_ids`, made on first use

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
            raise APIError(
                503, "the model is loading; retry later", "server_error", code="model_loading", headers=self._retry()
            )

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
            raise APIError(
                503,
                "the scheduler is restarting; retry later",
                "server_error",
                code="scheduler_unavailable",
                headers=self._retry(),
            )
        return JSONResponse(health_body(self.args, self.client.info))

    async def prometheus(self, request: HTTPRequest) -> Response:
        snapshot = await self._snapshot_or_none()
        # The header names the replica that answered: through Serve's proxy, one of them.
        return Response(
            self.metrics.render(snapshot), media_type="text/plain; version=0.0.4", headers=self._id_header()
        )

    async def models(self, request: HTTPRequest) -> Response:
        request_inputs.lane_cap(self.args, request)
        await self._wait_loaded()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        request_inputs.lane_cap(self.args, request)
        await self._wait_loaded()
        model_id = request.path_params["model_id"]
        if model_id != self.args.model_name:
            raise APIError(
                404,
                f"model '{model_id[:64]}' is not served here; use '{self.args.model_name}'",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.args.model_name, "object": "model", "created": 0, "owned_by": "specslot"}

    async def scheduler_state(self, request: HTTPRequest) -> Response:
        request_inputs.lane_cap(self.args, request)
        await self._wait_loaded()
        snapshot = await self._snapshot_or_none()
        if snapshot is None:
            raise APIError(503, "scheduler unavailable", "server_error", headers=self._retry())
        snapshot = dict(snapshot)
        snapshot["replica"] = {
            **self.identity,
            "open_streams": self.client.num_open_streams,
            "events_merged": self.client.num_events_merged,
            "scheduler_restarts": self.client.num_restarts,
            "scheduler_node_id": self.client.info.get("node_id"),
            "scheduler_actor": self.client.info.get("actor_name"),
            "scheduler_pid": self.client.info.get("pid"),
        }
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
        lane_cap = request_inputs.lane_cap(self.args, http)
        await self._wait_loaded()
        arrival = time.monotonic()  # TTFT and e2e start here
        body = await request_inputs.read_body(http, self.args.max_body_bytes)
        spec = parse_generation(decode_json(body), chat, self.codec.tool_format)
        if spec.model is not None and spec.model != self.args.model_name:
            raise APIError(
                400,
                f"model '{spec.model[:64]}' is not served here; use '{self.args.model_name}'",
                param="model",
                code="model_not_found",
            )
        info = self.client.info
        prompt_ids = await self._prompt_ids(spec, len(body))
        max_tokens = request_inputs.max_tokens(spec, len(prompt_ids), info.get("max_context"), self.args)
        lane = Lane(max(parse_priority(http.headers.get("x-priority")), lane_cap))
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id = prefix + uuid.uuid4().hex
        # n choices are n engine requests; a seeded request's choices get seed, seed + 1, ...
        eos_ids = info.get("eos_token_ids") or ()
        requests = [
            Request(
                request_id if spec.n == 1 else f"{request_id}-{i}",
                prompt_ids,
                request_inputs.sampling(spec, max_tokens, i, self.sampling_defaults, self.codec.vocab_size, eos_ids),
                lane=lane,
            )
            for i in range(spec.n)
        ]
        streams = []
        for request in requests:
            try:
                events = await self.client.submit(request)
            except Exception as exc:
                for submitted in requests[: len(streams)]:
                    self._spawn(self._abandon(submitted.request_id, lane.name.lower()))
                raise self._submit_error(request.request_id, exc) from None
            streams.append(self._pieces(request, events, spec, len(prompt_ids), StreamTimes(arrival=arrival)))
        logprobs = None if spec.logprobs is None else LogprobFormat(self.codec.token_text, chat, self.codec.token_bytes)
        fmt = ResponseFormat(request_id, self.args.model_name, chat, spec.output, logprobs)
        if spec.stream:
            return StreamingResponse(
                self._sse(fmt, streams, requests, spec.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **self._id_header()},
            )
        response = await self._collect(fmt, streams, requests)
        response.headers.update(self._id_header())
        return response

    async def _prompt_ids(self, spec: GenerationSpec, body_bytes: int) -> list[int]:
        """The prompt's token ids; from a body of `TOKENIZE_OFF_LOOP_BYTES` or more, encoded on
        the tokenizer thread. One thread: large prompts encode one at a time, in arrival
        order (a Rust-backed tokenizer fails a call that changes its truncation or padding
        while another call runs; ours change neither, and small prompts encode on the loop
        meanwhile)."""
        if body_bytes < TOKENIZE_OFF_LOOP_BYTES:
            return request_inputs.prompt_ids(spec, self.codec)
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specslot-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, request_inputs.prompt_ids, spec, self.codec
        )

    def _submit_error(self, request_id: str, exc: Exception) -> APIError:
        self.metrics.rejected.labels("503").inc()
        if isinstance(exc, QueueFull):
            return APIError(
                503, "the server is at capacity; retry later", "server_error", code="queue_full", headers=self._retry()
            )
        # scheduler dead or restarting: the replica recovers it
        logger.warning("submitting %s failed", request_id, exc_info=exc)
        return APIError(
            503,
            "the scheduler is restarting; retry later",
            "server_error",
            code="scheduler_unavailable",
            headers=self._retry(),
        )

    def _id_header(self) -> dict[str, str]:
        replica = self.identity.get("replica_id")
        return {"X-Specslot-Replica": replica} if replica else {}

    async def _collect(self, fmt: ResponseFormat, streams: list, requests: list[Request]) -> Response:
        """All choices, read concurrently; the first to fail fails the request and
        cancels the others."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(collect_one(s)) for s in streams] if len(streams) > 1 else []
        try:
            results = await asyncio.gather(*tasks) if tasks else [await collect_one(streams[0])]
        finally:
            for task in tasks:
                task.cancel()
            self._abandon_unstarted(streams, requests)
        choices = [fmt.choice(i, text, finish, entries) for i, (text, finish, _, entries) in enumerate(results)]
        return JSONResponse(fmt.full(choices, Usage.of_choices([usage for _, _, usage, _ in results])))

    async def _sse(self, fmt: ResponseFormat, streams: list, requests: list[Request], include_usage: bool):
        try:
            async with contextlib.aclosing(sse_body(fmt, streams, include_usage)) as body:
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

    async def _pieces(self, request: Request, events, spec: GenerationSpec, num_prompt: int, times: StreamTimes):
        """(text, finish_reason, usage, error, logprob entries) tuples of one request
        (entries: those of the tokens whose text this piece begins, or on the final
        piece every billed token's not given yet; None without logprobs); cancels the
        request if abandoned."""
        rid, lane = request.request_id, request.lane.name.lower()
        self._started.add(rid)
        decoder = self.codec.decoder(
            skip_ids=self.client.info.get("eos_token_ids") or (), kept_ids=spec.output.kept_ids
        )
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
                self.metrics.record_finish(
                    lane, finish, times, time.monotonic(), stats, None if final is None else final.times
                )
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

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.args.retry_after_seconds)}
