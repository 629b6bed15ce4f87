"""docs/configuration.md's knob tables are generated from the configs that declare them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ConfigDict, ValidationError, create_model

from scheduler.config import SchedulerConfig
from scheduler.knobs import knob, knob_fields
from serve_app.configuration import docs as config_docs
from serve_app.configuration import knob_fields as derive
from serve_app.configuration.args import LiveConfig, ServeArgs


def test_configuration_page_is_current():
    page = config_docs.DOC_PATH.read_text(encoding="utf-8")
    assert config_docs.render(page) == page, (
        "docs/configuration.md is stale: run `python -m serve_app.configuration.docs`"
    )


def test_a_stale_table_is_rewritten():
    page = "x\n<!-- BEGIN generated: live-keys -->\nold\n<!-- END generated: live-keys -->\ny\n"
    fresh = config_docs.render(page)
    assert "old" not in fresh and "`grant_rounds`" in fresh and fresh.startswith("x\n") and fresh.endswith("y\n")
    assert config_docs.render(fresh) == fresh


def test_every_deployment_key_has_a_row():
    rows = "\n".join(config_docs.blocks().values())
    keys = ["drafter.kind" if k == "drafter" else k for k in ServeArgs.model_fields]
    assert [key for key in keys if f"| `{key}` |" not in rows] == []


@pytest.mark.parametrize(
    "name, values",
    [
        ("tick_mode", "`fused` | `alternate`"),
        ("num_draft_tokens", "1–16"),
        ("tick_slice", "bool"),
        ("max_body_bytes", "1 KiB–1 GiB"),
        ("prefix_cache_bytes", "0–4 TiB"),
        ("classic_burst_ms", "0–1000"),
        ("grant_rounds", "0–1,000,000"),
        ("policy_cache_dir", "string"),
    ],
)
def test_values_column(name, values):
    assert config_docs.values(name, ServeArgs.model_fields[name]) == values


def test_a_new_knob_is_one_field():
    """A knob declared once gets a validated deployment field and a live field."""

    @dataclass(frozen=True)
    class Toy:
        depth: int = knob(3, "How deep.", ge=1, le=5, live=True)

    (field,) = knob_fields(Toy).values()
    strict = ConfigDict(extra="forbid", strict=True)
    Args = create_model("Args", __config__=strict, depth=derive._field(field, live_only=False))
    Live = create_model("Live", __config__=strict, depth=derive._field(field, live_only=True))
    assert Args().depth == 3 and Live().depth is None and Live(depth=5).depth == 5
    for bad in (0, 6, "3"):
        with pytest.raises(ValidationError):
            Args(depth=bad)
    assert Args.model_fields["depth"].description == "How deep."


def test_serve_args_carry_the_knobs():
    for name, field in knob_fields(SchedulerConfig).items():
        info = ServeArgs.model_fields[name]
        assert info.description == field.knob.description
        default = None if field.knob.env else field.default
        assert info.default == default, name
    assert set(LiveConfig.model_fields) == {n for n, f in knob_fields(SchedulerConfig).items() if f.knob.live}


@pytest.mark.parametrize("raw", [{"num_draft_tokens": 17}, {"backlog_cap": 65}, {"classic_burst_ms": 1000.5}])
def test_upper_bounds_hold_at_the_edge(raw):
    with pytest.raises(ValidationError):
        ServeArgs.model_validate({"model": "m", **raw})
