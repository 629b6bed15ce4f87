"""What a request's omitted sampling fields become.

Precedence, per field: the request's own value; the deployment's `sampling_defaults`;
the model's `generation_config.json` (with `use_generation_config`, for the fields
Hugging Face and vLLM take from it: temperature, top_p, top_k, min_p,
repetition_penalty); OpenAI's defaults (temperature 1, top_p 1, every processor off).
>>> request_defaults(SamplingDefaults(top_p=0.9), {"temperature": 0.6, "top_p": 0.95})
{'temperature': 0.6, 'top_p': 0.9}
"""

from __future__ import annotations

import json
import logging
import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}  # the rest: SamplingParams' neutral values


class SamplingDefaults(BaseModel):
    """Defaults for sampling fields a request omits; unset fields fall through (see the
    module docstring). Ranges are those of the request fields."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="0 = off.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="1 = off.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    def values(self) -> dict:
        return sampling_fields(self.model_dump())


def sampling_fields(values: dict) -> dict:
    """The set fields as `SamplingParams` takes them (`top_k: -1`, off, becomes 0)."""
    out = {k: v for k, v in values.items() if v is not None}
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


def read_generation_config(model_dir: str) -> dict:
    """The sampling fields of `model_dir/generation_config.json` ({} without the file).
    A value out of range (or of the wrong type) is dropped with a warning; `do_sample`
    is not read (as in vLLM)."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    if not isinstance(config, dict):
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    picked = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    try:
        SamplingDefaults.model_validate(picked)
    except ValidationError as err:
        bad = {e["loc"][0] for e in err.errors()}
        logger.warning(
            "ignoring %s in %s: %s", sorted(bad), path, "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in err.errors())
        )
        picked = {k: v for k, v in picked.items() if k not in bad}
    return SamplingDefaults.model_validate(picked).values()


def request_defaults(configured: SamplingDefaults, generation_config: dict | None) -> dict:
    """`SamplingParams` fields for whatever a request omits: `configured` over
    `generation_config` (already read, or None when not used) over OpenAI's defaults."""
    return {**OPENAI_DEFAULTS, **(generation_config or {}), **configured.values()}
