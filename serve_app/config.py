"""Deployment arguments: the typed boundary between YAML `args` and the scheduler.

`ServeArgs` validates what a YAML config's `args` (or `build_app(args)`) supplies: unknown
keys, wrong types and out-of-range values are rejected with a message naming the field.
`scheduler_config()` resolves the two process-wide env overrides exactly once, here, so no
decision code reads the environment. `LiveConfig` is the subset Serve's `user_config`
may change on a running replica.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.hub import is_repo_id
from scheduler.request import Lane
from serve_app.sampling_defaults import SamplingDefaults

REPO_ROOT = Path(__file__).resolve().parent.parent

ENV_GRANT_ROUNDS = "SPECSLOT_SLICE_GRANT_ROUNDS"
ENV_TICK_SLICE = "SPECSLOT_TICK_SLICE"

LaneName = Literal["high", "normal", "low"]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class DrafterArgs(BaseModel):
    model_config = _STRICT

    kind: Literal["draft_model", "ngram", "none"] = Field(
        "draft_model",
        description="Drafter for the speculative slot: a small `draft_model` sharing the "
        "target's vocabulary, `ngram` prompt lookup (no weights), or `none` (classic only).",
    )
    path: str | None = Field(
        None, description="Draft model: a directory (mlx-lm format) or a Hugging Face hub id, "
        "as for `model`; required for draft_model."
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> "DrafterArgs":
        if self.kind == "draft_model" and not self.path:
            raise ValueError("drafter.path is required when drafter.kind is 'draft_model'")
        if self.kind != "draft_model" and self.path:
            raise ValueError(f"drafter.path must be empty when drafter.kind is '{self.kind}'")
        return self


class ApiKeyArgs(BaseModel):
    model_config = _STRICT

    key: str = Field(..., min_length=8, description="Bearer token a client sends in Authorization.")
    max_lane: LaneName = Field(
        "high", description="Highest X-Priority lane a client holding this key may claim."
    )


class ServeArgs(BaseModel):
    """Everything one specslot deployment needs; see docs/configuration.md."""

    model_config = _STRICT

    model: str = Field(
        ..., min_length=1,
        description="Target model: a directory (mlx-lm / HF format; relative paths resolve "
        "against the working directory, then the specslot checkout), or a Hugging Face hub id "
        "(`org/name`) found in the local Hugging Face cache.",
    )
    served_model_name: str | None = Field(
        None, min_length=1,
        description="Model id clients send and /v1/models lists; default: the model directory "
        "name, or the hub id.",
    )
    allow_download: bool = Field(
        False, description="Download a hub id (`model`, `drafter.path`) missing from the local "
        "Hugging Face cache into it; false: fail with the command that downloads it.",
    )
    drafter: DrafterArgs = Field(
        default_factory=lambda: DrafterArgs(kind="ngram"),
        description="Drafter kind and path; `kind: none` disables speculation.",
    )
    num_draft_tokens: int = Field(4, ge=1, le=16, description="Tokens drafted per speculative round (K).")
    tick_slice: bool | None = Field(
        None,
        description="Run one speculative slice per tick (true) or the whole generation in one "
        f"tick (false). Unset: {ENV_TICK_SLICE}, else true.",
    )
    tick_mode: Literal["fused", "alternate"] = Field(
        "fused",
        description="fused: the slot holder's verify rides in the classic batch's decode forward, "
        "so classic rows never wait for a speculative round; alternate: the seed's strict "
        "alternation (a tick runs either the round or the decode step).",
    )
    fast_verify: bool = Field(
        False,
        description="The slot verifies through compiled, shape-bucketed per-session forwards "
        "(models/bucketed.py): the fastest lone stream on a GPU, but its verify cannot ride in the "
        "batch's forward, so the alternating tick and mlx-lm's BatchGenerator run instead of the slab.",
    )
    row_drafts: bool = Field(
        True,
        description="Classic rows verify their own n-gram (prompt lookup) drafts in their decode "
        "steps, each as many as its acceptance pays for at the current batch size (greedy rows, "
        "fused tick); b1_policy off turns them off too.",
    )
    grant_rounds: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Slices a slot grant lasts before the job parks when others wait; 0 disables "
        f"rotation (whole-generation hold). Unset: {ENV_GRANT_ROUNDS}, else 8.",
    )
    skip_cap: int = Field(2, ge=1, le=1000, description="Grant decisions an entry may be skipped before it must win.")
    backlog_cap: int = Field(2, ge=0, le=64, description="Grant backlog entries (parked + waiting) beyond the slot.")
    speculative_disable_by_batch_size: int = Field(
        0, ge=0, le=1_000_000,
        description="A new request skips the speculative slot (and its ring) and decodes in the "
        "classic batch when this many other requests are live; 0 = never.",
    )
    b1_policy: Literal["auto", "on", "off"] = Field(
        "auto", description="Adaptive B=1 policy: profile and decide (auto), always (on), never (off)."
    )
    b1_default_enabled: bool = Field(
        True, description="Verdict when the measured speedup is between 1.0 and 1.5."
    )
    b1_profile_requests: int = Field(
        3, ge=1, le=1000, description="Speculative requests b1_policy=auto profiles before it decides."
    )
    b1_probe_rounds: int = Field(
        2, ge=1, le=100,
        description="Probe rounds (bursts of pipelined classic steps: the classic time per token) per profiled request.",
    )
    max_batch_size: int = Field(16, ge=1, le=1024, description="Classic continuous-batching rows.")
    prefill_batch_size: int = Field(8, ge=1, le=1024, description="Requests prefilled in one classic prefill.")
    classic_burst_ms: float = Field(
        4.0, ge=0.0, le=1000.0,
        description="A classic row decoding alone keeps stepping for up to this long per engine tick "
        "(several tokens per tick when steps are fast); 0 = one token per tick.",
    )
    prefix_cache_bytes: int | None = Field(
        None, ge=0, le=1 << 42,
        description="Bytes of KV the replica's prefix cache may hold: finished requests' prompt and "
        "output, reused by later prompts that start with the same tokens (multi-turn chat, agents); "
        "0 = off. Unset: an eighth of the memory available once the model is loaded, at most 4 GiB.",
    )
    affinity_routing: bool = Field(
        True,
        description="Serve routes the requests of one session (Serve's X-Session-Id header) to "
        "one replica, where its prefix cache is (a new session goes to the replica with the fewest "
        "sessions), unless that replica's queue is longer than the "
        "least loaded one's by more than affinity_load_margin; false: Serve's default router.",
    )
    affinity_key: Literal["session", "prompt"] = Field(
        "session",
        description="What affinity_routing keys on. session: Serve's session header only (the HTTP "
        "proxy routes; requests without one are spread). prompt: a front deployment, SpecslotIngress, "
        "reads each request and keys it on its session header or, without one, on a hash of the "
        "prompt's leading messages (the same for every turn of a conversation); one more hop per request.",
    )
    affinity_load_margin: int = Field(
        4, ge=0, le=1_000_000,
        description="Ongoing requests a session's replica may have beyond the least loaded "
        "replica before its request goes to the least loaded one instead.",
    )
    max_queue_depth: int = Field(
        256, ge=1, le=1_000_000, description="Pending requests per replica before 503 + Retry-After."
    )
    max_tokens_limit: int = Field(
        4096, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for."
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="max_tokens when a request omits it (clipped to the context)."
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30, description="Largest accepted HTTP request body; larger gets 413."
    )
    max_lane_unauthenticated: LaneName = Field(
        "high",
        description="Highest X-Priority lane for requests without a (configured) API key; "
        "with api_keys set, requests without a valid key are rejected with 401.",
    )
    api_keys: list[ApiKeyArgs] = Field(
        default_factory=list, description="Optional Bearer API keys for the /v1 routes, each with its lane cap."
    )
    policy_cache_dir: str | None = Field(
        None, description="Directory persisting adaptive-policy verdicts across restarts; unset: none."
    )
    actor_num_gpus: float = Field(
        0.0, ge=0.0, le=8.0,
        description="GPUs the scheduler actor reserves (CUDA nodes); 0 on CPU and Apple silicon.",
    )
    retry_after_seconds: int = Field(1, ge=1, le=3600, description="Retry-After sent with 503 on a full queue.")
    chat_template: str | None = Field(
        None, min_length=1,
        description="Chat template for /v1/chat/completions, used instead of the tokenizer's "
        "own (or where it has none): a jinja template, or a path to a .jinja file, read when "
        "the app is built. Unset: the tokenizer's template; without one, chat is a 400.",
    )
    use_generation_config: bool = Field(
        True,
        description="Requests that omit temperature, top_p, top_k, min_p or repetition_penalty "
        "take the values in the model's generation_config.json, where it has one; false: "
        "OpenAI's defaults (temperature 1, top_p 1, the rest off).",
    )
    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="Defaults for sampling fields a request omits (temperature, top_p, top_k, "
        "min_p, repetition_penalty, presence_penalty, frequency_penalty); each one set here "
        "overrides generation_config.json's.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ServeArgs":
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
        return self.model if is_repo_id(self.model) else Path(self.model).name

    @property
    def speculative(self) -> bool:
        return self.drafter.kind != "none"

    def with_resolved_paths(self, cwd: Path | None = None) -> "ServeArgs":
        """A copy whose local model paths are absolute and whose `chat_template` file has
        been read into the template (the replica may run elsewhere); hub ids stay ids
        (each process looks them up in its own Hugging Face cache). Raises ConfigError
        when the template file cannot be read."""
        drafter = self.drafter
        if drafter.path:
            drafter = drafter.model_copy(update={"path": resolve_path(drafter.path, cwd)})
        return self.model_copy(update={"model": resolve_path(self.model, cwd), "drafter": drafter,
                                       "chat_template": read_chat_template(self.chat_template, cwd)})

    def model_dirs(self) -> tuple[str, str | None]:
        """(target directory, draft directory or None): local paths as given, hub ids from
        the local Hugging Face cache (downloaded there first when `allow_download`).
        Raises ModelLoadError, naming the path or id, when mlx-lm could not load one."""
        from models.hub import resolve_model_dir

        target = resolve_model_dir(self.model, "target", self.allow_download)
        if self.drafter.kind != "draft_model":
            return target, None
        return target, resolve_model_dir(self.drafter.path, "draft", self.allow_download)

    def scheduler_config(self, env: Mapping[str, str] | None = None):
        """The scheduler's frozen config, env overrides applied where the YAML is silent."""
        from scheduler.config import SchedulerConfig, env_defaults

        defaults = env_defaults(os.environ if env is None else env)
        grant_rounds = defaults["grant_rounds"] if self.grant_rounds is None else self.grant_rounds
        tick_slice = defaults["tick_slice"] if self.tick_slice is None else self.tick_slice
        return SchedulerConfig(
            tick_slice=tick_slice,
            tick_mode=self.tick_mode,
            row_drafts=self.row_drafts,
            grant_rounds=grant_rounds,
            skip_cap=self.skip_cap,
            backlog_cap=self.backlog_cap,
            speculative_disable_by_batch_size=self.speculative_disable_by_batch_size,
            num_draft_tokens=self.num_draft_tokens,
            b1_policy=self.b1_policy,
            b1_default_enabled=self.b1_default_enabled,
            b1_profile_requests=self.b1_profile_requests,
            b1_probe_rounds=self.b1_probe_rounds,
            max_batch_size=self.max_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            max_queue_depth=self.max_queue_depth,
            policy_cache_dir=self.policy_cache_dir,
        )

    def lane_cap_for(self, api_key: str | None) -> Lane | None:
        """Highest lane a client may claim; None when the key is required and wrong."""
        if self.api_keys:
            for entry in self.api_keys:
                if api_key is not None and entry.key == api_key:
                    return Lane[entry.max_lane.upper()]
            return None
        return Lane[self.max_lane_unauthenticated.upper()]


class LiveConfig(BaseModel):
    """Fields Serve's `user_config` may change on a running replica (next grant)."""

    model_config = _STRICT

    grant_rounds: int | None = Field(None, ge=0, le=1_000_000, description="See ServeArgs.grant_rounds.")
    skip_cap: int | None = Field(None, ge=1, le=1000, description="See ServeArgs.skip_cap.")
    tick_slice: bool | None = Field(None, description="See ServeArgs.tick_slice.")
    backlog_cap: int | None = Field(None, ge=0, le=64, description="See ServeArgs.backlog_cap.")
    tick_mode: Literal["fused", "alternate"] | None = Field(None, description="See ServeArgs.tick_mode.")
    row_drafts: bool | None = Field(None, description="See ServeArgs.row_drafts.")

    def changes(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ConfigError(ValueError):
    """Deployment args or user_config failed validation (message lists every problem)."""


def is_template_path(value: str) -> bool:
    """Whether a `chat_template` value names a file: one line ending in `.jinja`, no braces."""
    return "\n" not in value and "{" not in value and value.strip().endswith(".jinja")


def read_chat_template(value: str | None, cwd: Path | None = None) -> str | None:
    """The template a `chat_template` value means: itself, or its file's text (a relative
    path resolves as a model path does)."""
    if value is None or not is_template_path(value):
        return value
    path = resolve_path(value.strip(), cwd)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"invalid specslot config:\n  args.chat_template: cannot read "
                          f"{path!r}: {reason}") from None
    if not text.strip():
        raise ConfigError(f"invalid specslot config:\n  args.chat_template: {path!r} is empty")
    return text


def resolve_path(path: str, cwd: Path | None = None) -> str:
    """Absolute path: as given if absolute, else under `cwd` if it exists there, else
    under the repo if it exists there. Otherwise a hub id (`org/name`) stays as it is, and
    any other path resolves under the repo (so the error names a full path)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    here = (cwd or Path.cwd()) / p
    if here.exists():
        return str(here.resolve())
    in_repo = REPO_ROOT / p
    if not in_repo.exists() and is_repo_id(path):
        return path
    return str(in_repo.resolve())


def format_validation_error(err: ValidationError, prefix: str = "args",
                            schema: type[BaseModel] | None = None) -> str:
    """One line per problem, `args.field: message`, for operators reading a failed deploy.

    With `schema` (the model validated), an unknown key names its closest known
    sibling: `args.grant_round: unknown key (did you mean 'grant_rounds'?)`.
    """
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        where = f"{prefix}.{loc}" if loc else prefix
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            close = difflib.get_close_matches(str(e["loc"][-1]), _keys_at(schema, e["loc"][:-1]), n=1)
            if close:
                msg += f" (did you mean '{close[0]}'?)"
        lines.append(f"{where}: {msg}")
    return "invalid specslot config:\n  " + "\n  ".join(lines)


def _keys_at(schema: type[BaseModel] | None, loc: tuple) -> list[str]:
    """Field names of the (nested) model at `loc`, e.g. ("drafter",) -> DrafterArgs'."""
    for part in loc:
        if schema is None or isinstance(part, int):  # list index: same item model
            continue
        field = schema.model_fields.get(part)
        schema = _model_in(field.annotation) if field else None
    return list(schema.model_fields) if schema else []


def _model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: `DrafterArgs`, `list[ApiKeyArgs]`, ...."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
